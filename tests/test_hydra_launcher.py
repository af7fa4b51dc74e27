"""The Hydra launcher plugin without Slurm (docs/hydra.md): discovered once hpc_train is installed, its config group,
its keys checked with a sentence, an app's config error refused before anything is queued (Hydra's own words, the
key named), the jobs composed as Hydra composes them (once per distinct structural override set), and real apps
run through hpc_train's local executor: a sweep in Hydra's layout and a run without -m."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

import pytest
from conftest import HPC_TRAIN, names, read_events, run

REPO = Path(__file__).resolve().parent.parent
ANCHOR = REPO / "benchmarks" / "hydra_anchor" / "app.py"  # the app users sweep with submitit_slurm today
TYPED = REPO / "tests" / "scripts" / "hydra_typed"  # a structured config defined in __main__, a config group


# A sweep through the launcher on the local executor: the arguments most tests start with
LOCAL_SWEEP = ("-m", "hydra/launcher=hpc_train", "hydra.launcher.executor=local")


def app(script: Path, *args: str, cwd: Path, timeout_s: float = 120, extra: tuple[str, ...] = ()) -> Any:
    env = {**os.environ, "HPC_BENCH_OUT": str(cwd)}  # the anchor's hydra.sweep.dir reads it
    return run([sys.executable, *extra, str(script), *args], env=env, cwd=cwd, timeout_s=timeout_s)


def preempt_once(cmd: list[str], env: dict[str, str], cwd: Path, target: Path) -> None:
    """Run a launch without -m whose task waits for its stop (WAIT_FOR_STOP), preempt its first attempt (SIGTERM to
    the local executor's controller) once the task is ready, and wait for the launch to end well."""
    import signal
    import subprocess

    from conftest import wait_until

    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: (target / "ready").exists(), 60, "the first attempt's task")
        job_id = json.loads((target / "submission.json").read_text())["job_id"]
        os.kill(int(job_id), signal.SIGTERM)  # the local executor's preemption
        out, err = proc.communicate(timeout=180)
    finally:
        proc.kill() if proc.poll() is None else None
    assert proc.returncode == 0, out + err[-3000:]


def test_the_plugin_is_discovered_with_its_config_group(tmp_path: Path) -> None:
    """Hydra's own discovery finds the Launcher (hydra_plugins namespace); `hydra/launcher=hpc_train` selects a node
    that takes the anchor's submitit-style keys as they are, and brings the callback that queues a run without -m."""
    import yaml
    from hydra.core.config_store import ConfigStore
    from hydra.core.plugins import Plugins
    from hydra.plugins.launcher import Launcher

    found = [f"{c.__module__}.{c.__name__}" for c in Plugins.instance().discover(Launcher)]
    from hydra_plugins.hpc_train_launcher import launcher as plugin  # after Hydra's own discovery, which imports it

    launcher_target, callback_target = (
        f"{plugin.__name__}.{c.__name__}" for c in (plugin.HpcTrainLauncher, plugin.QueueRun)
    )
    assert launcher_target in found, found
    assert "hpc_train.yaml" in ConfigStore.instance().list("hydra/launcher")
    proc = app(ANCHOR, "hydra/launcher=hpc_train", "--cfg", "hydra", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    hydra = yaml.safe_load(proc.stdout)["hydra"]
    node = hydra["launcher"]
    assert (node["_target_"], node["partition"], node["timeout_min"]) == (launcher_target, "debug", 10)  # the anchor's
    assert callback_target in [c["_target_"] for c in hydra["callbacks"].values()]


def test_the_node_holds_every_cluster_option_at_its_default() -> None:
    """NODE is literal (Hydra imports every plugin at every app's start): it must stay hpc_train's own defaults, but
    for a sweep's two (Slurm, one task a node as submitit's launcher)."""
    from hpc_train.config import RequeueConfig
    from hpc_train.hydra_launch import CLUSTER, OWN
    from hpc_train.preflight import PreflightConfig
    from hpc_train.sbatch import ClusterConfig

    defaults = asdict(ClusterConfig())
    assert list(CLUSTER) == list(defaults) == [f.name for f in fields(ClusterConfig)]
    assert {k: v for k, v in CLUSTER.items() if defaults[k] != v} == {"executor": "slurm", "tasks_per_node": 1}
    assert OWN["requeue"] == asdict(RequeueConfig()) and OWN["preflight"] == asdict(PreflightConfig())


def test_launcher_values_are_refused_in_the_launchers_words() -> None:
    from hpc_train.hydra_launch import LaunchError, run_config

    with pytest.raises(LaunchError, match=r"hydra\.launcher\.nodes=0 must be >= 1"):
        run_config({"nodes": 0}, "app")
    with pytest.raises(
        LaunchError, match=r"hydra\.launcher\.nodes='two' is a str, but hydra\.launcher\.nodes takes int"
    ):
        run_config({"nodes": "two"}, "app")
    with pytest.raises(LaunchError, match=r"hydra\.launcher\.stop_signal='KILL' is not one of"):
        run_config({"stop_signal": "KILL"}, "app")
    cfg, run_ = run_config({"nodes": 2, "requeue": {"max_failures": 0}, "checkpoint": "ckpt.pt"}, "my app")
    assert cfg["cluster"]["nodes"] == 2 and cfg["requeue"]["max_failures"] == 0 and cfg["name"] == "my-app"
    assert cfg["script"]["checkpoint"] == "ckpt.pt" and run_.cluster.executor == "slurm"


def test_an_unknown_key_is_refused_with_a_sentence_before_anything_is_written(tmp_path: Path) -> None:
    from hpc_train.hydra_launch import NODE

    sweep = tmp_path / "sw"
    proc = app(
        ANCHOR, "-m", "hydra/launcher=hpc_train", "+hydra.launcher.nodez=2", f"hydra.sweep.dir={sweep}", cwd=tmp_path
    )
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert names(
        proc.stderr, "hpc_train launcher: ", "'hydra.launcher.nodez'", "not an option", "hydra.launcher.nodes?"
    )
    (valid,) = [line for line in proc.stderr.splitlines() if line.startswith("valid keys under hydra.launcher: ")]
    assert valid.split(": ", 1)[1].split(", ") == list(NODE)  # every key the launcher takes
    proc = app(ANCHOR, "-m", "hydra/launcher=hpc_train", "+hydra.launcher.array_parallelism=4", cwd=tmp_path)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert names(proc.stderr, "hydra.launcher.array_parallelism", "submitit launcher", "hydra.launcher.max_parallel")
    proc = app(ANCHOR, "-m", "hydra/launcher=hpc_train", "hydra.launcher.nodez=2", cwd=tmp_path)  # Hydra's own
    assert proc.returncode == 1 and names(proc.stderr, "Could not override", "'hydra.launcher.nodez'")
    assert not sweep.exists()  # refused at the launcher's setup: the sweep never began


@pytest.mark.parametrize(
    "sweep,said",
    [
        (
            "optim.lr=0.1,abc",
            r"Error merging override optim.lr=abc\nValue 'abc' of type 'str' could not be converted to Float\n    full_key: optim.lr",
        ),
        ("optim.lrr=0.1,0.2", r"Could not override 'optim.lrr'.*full_key: optim.lrr"),
        ("db=mysql,oracle", r"In 'config': Could not find 'db/oracle'"),
    ],
)
def test_a_config_error_of_the_app_is_refused_before_anything_is_queued(tmp_path: Path, sweep: str, said: str) -> None:
    """Refused while the sweeper checks its batch, in Hydra's own words (a failing job is composed by Hydra itself):
    no trial folder, no manifest, nothing frozen; Slurm is never asked (there is none here)."""
    target = tmp_path / "sw"
    proc = app(TYPED / "app.py", "-m", "hydra/launcher=hpc_train", sweep, f"hydra.sweep.dir={target}", cwd=tmp_path)
    assert proc.returncode == 1
    assert re.search(said, proc.stderr, re.S), proc.stderr
    assert sorted(p.name for p in target.iterdir()) == ["multirun.yaml"]  # Hydra's own, written before its check


def _typed_loader() -> tuple[Any, Any]:
    """Hydra's loader for the typed app and its master config, as Hydra makes them for `-m` (the app's module
    imported for its ConfigStore schema)."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra._internal.utils import create_config_search_path
    from hydra.types import RunMode

    spec = importlib.util.spec_from_file_location("hydra_typed_app", TYPED / "app.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["hydra_typed_app"] = module  # where pickle finds its classes
    spec.loader.exec_module(module)
    loader = ConfigLoaderImpl(config_search_path=create_config_search_path(str(TYPED / "conf")))
    return loader, loader.load_configuration("config", [], RunMode.MULTIRUN)


def test_jobs_compose_as_hydra_composes_them() -> None:
    """Each job's config as hydra_job.py builds it (a base composed once per distinct structural override set, its
    `key=value` overrides applied on top) equals Hydra's own compose of that job, hydra node included."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from omegaconf import OmegaConf, open_dict

    from hpc_train.hydra_job import trial_config
    from hpc_train.hydra_launch import Memo, _copy

    loader, master = _typed_loader()
    memo = Memo(loader, master)
    jobs = [
        ["optim.lr=0.5"],
        ["db=postgres", "optim.lr=0.25"],
        ["seed=7", "optim.momentum=0.5"],
        ["+extra=1", "seed=2"],
        ["optim.lr=1e-3", "db=postgres", "seed=5"],
        ["tag='a b'", "seed=4"],
        ["seed=8", "+x=1", "x=2"],  # x named by a structural override of the same job: composed whole
        ["optim.lr=-2.5e-3", "tag=plain_word"],
    ]
    for num, job in enumerate(jobs):
        k, _ = memo.check(job)
        ours = trial_config(_copy(memo.bases[k]), job, num, "7")
        hydras = ConfigLoaderImpl.load_sweep_config(loader, master, job)
        with open_dict(hydras.hydra.job):
            hydras.hydra.job.num, hydras.hydra.job.id = num, "7"
        assert OmegaConf.to_container(ours, resolve=False) == OmegaConf.to_container(hydras, resolve=False), job
        assert OmegaConf.get_type(ours.optim).__name__ == "Optim"  # the structured config kept its types
    assert list(memo.index) == [(), ("db=postgres",), ("+extra=1",), ("tag='a b'",), ("seed=8", "+x=1", "x=2")]


def test_resume_overrides_are_checked_against_every_base() -> None:
    from hpc_train.hydra_launch import LaunchError, check_resume

    loader, master = _typed_loader()
    bases = [loader.load_sweep_config(master, []), loader.load_sweep_config(master, ["db=postgres"])]
    check_resume(["+resume=true", "seed=9"], bases)
    assert bases[0].seed == 0  # copies were changed, never the frozen bases
    with pytest.raises(LaunchError, match=r"resume_overrides=\['resum=true'\]: Could not override 'resum'"):
        check_resume(["resum=true"], bases)


def test_the_sweepers_check_of_a_batch_composes_once() -> None:
    """Hydra's Sweeper.validate_batch_is_legal through the launcher's loader: 1,000 jobs over one key are one
    compose (Hydra alone: 1,000, 54 s here); a job with an error is composed by Hydra, which says it."""
    from hydra.errors import ConfigCompositionException
    from hydra.plugins.sweeper import Sweeper
    from hydra.types import HydraContext

    from hpc_train.hydra_launch import Memo

    loader, master = _typed_loader()
    composed: list[list[str]] = []
    real = loader.load_sweep_config

    def counted(master_config: Any, sweep_overrides: list[str]) -> Any:
        composed.append(list(sweep_overrides))
        return real(master_config, sweep_overrides)

    loader.load_sweep_config = counted
    sweeper = type("S", (), {})()
    sweeper.hydra_context, sweeper.config = HydraContext(config_loader=Memo(loader, master), callbacks=None), master
    Sweeper.validate_batch_is_legal(sweeper, [[f"optim.lr={i}e-4", "seed=1"] for i in range(1000)])
    assert composed == [[]]
    with pytest.raises(ConfigCompositionException, match="optim.lr=oops"):
        Sweeper.validate_batch_is_legal(sweeper, [["optim.lr=0.1"], ["optim.lr=oops"]])
    assert composed[-1] == ["optim.lr=oops"]  # Hydra's own compose of the failing job, for its words
    # anyone else asking gets Hydra's compose of the job, as before
    assert sweeper.hydra_context.config_loader.load_sweep_config(master, ["seed=3"]).seed == 3
    assert composed[-1] == ["seed=3"]


def test_a_local_sweep_runs_each_job_through_hpc_train_in_hydras_layout(tmp_path: Path) -> None:
    """4 jobs (a config group and a typed key swept) through hpc_train's local executor: Hydra's multirun folder
    (multirun.yaml, one folder per job number with .hydra/), each trial an hpc_train run there, the task given its
    composed config with its types, ${now:} at the sweep's time, its own output folder; results reads the sweep. The
    command's own process never imports torch."""
    proc = app(
        TYPED / "app.py",
        *LOCAL_SWEEP,
        "optim.lr=0.1,0.2",
        "db=mysql,postgres",
        "seed=3",
        cwd=tmp_path,
        timeout_s=240,
        extra=("-X", "importtime"),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert not re.search(r"\| +torch$", proc.stderr, re.M), "the login side imported torch"
    (sweep,) = (tmp_path / "multirun").glob("*/*")
    assert "hpc_train: 4 trial(s) ran here" in proc.stdout and f"hpc-train status {sweep}" in proc.stdout
    assert (sweep / "multirun.yaml").is_file() and (sweep / "sweep.json").is_file()
    manifest = json.loads((sweep / "sweep.json").read_text())
    assert [t["run_dir"] for t in manifest["trials"]] == [str(sweep / str(i)) for i in range(4)]
    for i, (lr, db) in enumerate([(0.1, "mysql"), (0.1, "postgres"), (0.2, "mysql"), (0.2, "postgres")]):
        trial = sweep / str(i)
        assert {p.name for p in (trial / ".hydra").iterdir()} == {"config.yaml", "hydra.yaml", "overrides.yaml"}
        assert (trial / ".hydra" / "overrides.yaml").read_text() == f"- optim.lr={lr}\n- db={db}\n- seed=3\n"
        assert [e["event"] for e in read_events(trial) if e["event"] in ("start", "finish")] == ["start", "finish"]
        value = json.loads((trial / "job_return.json").read_text())["value"]
        assert value == {
            "type": "Config",
            "lr": lr,
            "seed": 3,
            "db": db,
            "tag": "seed-3",
            "started": sweep.name,  # Hydra's sweep folder is named by ${now:%H-%M-%S} too: the same moment
            "output_dir": str(trial),
            "num": i,
            "override_dirname": f"db={db},optim.lr={lr},seed=3",
        }
    results = run([HPC_TRAIN, "results", str(sweep), "--json"])
    rows = json.loads(results.stdout)
    assert [(r["overrides"]["optim.lr"], r["overrides"]["db"], r["state"]) for r in rows] == [
        ("0.1", "mysql", "COMPLETED"),
        ("0.1", "postgres", "COMPLETED"),
        ("0.2", "mysql", "COMPLETED"),
        ("0.2", "postgres", "COMPLETED"),
    ]


def test_a_run_without_m_is_one_run_in_hydras_run_dir(tmp_path: Path) -> None:
    """No -m: Hydra would run the task in its own process; the launcher's callback queues it instead (here: runs it
    through hpc_train's local executor and waits) in hydra.run.dir, as a run alone, and the process ends there."""
    target = tmp_path / "outputs" / "one"
    proc = app(
        ANCHOR,
        "hydra/launcher=hpc_train",
        "hydra.launcher.executor=local",
        "lr=3",
        f"hydra.run.dir={target}",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert f"hpc_train: finished {target}; it returned 3.0" in proc.stdout
    assert (target / "submission.json").is_file() and not (target / "sweep.json").exists()
    assert (target / ".hydra" / "overrides.yaml").read_text().splitlines()[-1] == "- lr=3"
    assert "lr: 3" in (target / ".hydra" / "config.yaml").read_text()
    status = json.loads(run([HPC_TRAIN, "status", str(target), "--json"]).stdout)
    assert [(r["run"], r["state"], r["finished"]) for r in status] == [("one", "COMPLETED", True)]


def test_a_task_that_raises_fails_its_trial_and_hydra_says_so(tmp_path: Path) -> None:
    """The task's exception ends its trial (no retry here: requeue.max_failures=0); the local executor's launch
    returns it as Hydra's FAILED JobReturn, which Hydra raises with the job's overrides."""
    proc = app(
        TYPED / "app.py",
        *LOCAL_SWEEP,
        "hydra.launcher.requeue.max_failures=0",
        "seed=-1",
        f"hydra.sweep.dir={tmp_path / 'sw'}",
        cwd=tmp_path,
        timeout_s=180,
    )
    assert proc.returncode == 1
    assert names(proc.stderr, "Error executing job", "overrides: ['seed=-1']")  # Hydra's own sentence
    assert "did not finish" in proc.stderr or "seed must be >= 0" in proc.stderr, proc.stderr[-2000:]
    assert json.loads((tmp_path / "sw" / "0" / "job_return.json").read_text())["status"] == "FAILED"
    events = read_events(tmp_path / "sw" / "0")
    assert any(e["event"] == "fail" and "seed must be >= 0" in e["error"] + e.get("output", "") for e in events)


def test_resume_overrides_are_added_once_the_checkpoint_exists(tmp_path: Path) -> None:
    """hydra.launcher.checkpoint names the app's file (here one that exists from the start): the attempt's start
    names it, and hydra.launcher.resume_overrides join the job's overrides, Hydra's .hydra/ records included."""
    ckpt = tmp_path / "ckpt.pt"
    ckpt.write_text("a checkpoint\n")
    sweep = tmp_path / "sw"
    proc = app(
        ANCHOR,
        *LOCAL_SWEEP,
        f"hydra.launcher.checkpoint={ckpt}",
        "hydra.launcher.resume_overrides=['+resumed=true']",
        "lr=1",
        f"hydra.sweep.dir={sweep}",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert (sweep / "0" / ".hydra" / "config.yaml").read_text() == "lr: 1\nresumed: true\n"
    assert (sweep / "0" / ".hydra" / "overrides.yaml").read_text() == "- lr=1\n- +resumed=true\n"
    assert next(e for e in read_events(sweep / "0") if e["event"] == "start")["resumed_from"] == str(ckpt)


def test_review_the_spec_is_trusted_only_when_ours_and_the_apps_classes_pickle_once_it_imports_multiprocessing(
    tmp_path: Path,
) -> None:
    """Review: (1) hydra_launch.json names the file every rank imports and runs, yet only the base pickle was checked:
    a group member who could write the sweep folder could point it at their code; (2) an app that imports torch
    (multiprocessing) had __mp_main__ pointed back at hydra_job, and its own classes no longer pickled there
    (torch.save of its config failed at the stop save)."""
    import os
    import subprocess
    import sys

    from hpc_train import hydra_job

    folder = tmp_path / "sweep"
    folder.mkdir(mode=0o700)
    marker = tmp_path / "ran"
    app = tmp_path / "evil.py"
    app.write_text(f"open({str(marker)!r}, 'w').close()\n")
    ref = {"module": "evil", "file": str(app), "name": "main", "wrapped": False, "main": True}
    spec = hydra_job.freeze(folder, ref, [{"a": 1}], multirun=True, private=True)
    spec.chmod(0o664)  # as a group member's copy would be
    env = {**os.environ, "HPC_TRAIN_RUN_DIR": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, hydra_job.__file__, str(spec), "0", "0", "--"], env=env, capture_output=True, text=True
    )
    assert proc.returncode != 0 and "refusing to run the app" in proc.stderr and not marker.exists(), proc.stderr
    typed = tmp_path / "typed_app.py"
    typed.write_text(
        "import multiprocessing\nfrom dataclasses import dataclass\n\n@dataclass\nclass Config:\n    lr: float = 0.1\n"
    )
    code = (
        "import pickle, sys; from hpc_train import hydra_job; "
        f"m = hydra_job.import_app({{'module': 'typed_app', 'file': {str(typed)!r}, 'name': 'x', 'wrapped': False, "
        "'main': True}); print(pickle.loads(pickle.dumps(m.Config())).lr)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "0.1", out.stderr


# An app of the review's second round: a TERM handler of its own (as tests/scripts/hydra_train's), told to wait for a
# stop at its first attempt; and a callback that records every hook Hydra calls, where and with what status.
STOP_APP = """
import json, os, signal, time
import hydra
from hydra.core.hydra_config import HydraConfig

STOP = []


def on_term(signum, frame):
    STOP.append(signum)
    if os.environ.get("RAISE_AT_STOP"):  # an app that unwinds its stack from its handler
        raise RuntimeError("unwinding at SIGTERM")


@hydra.main(version_base=None, config_path=".", config_name="config")
def main(cfg):
    signal.signal(signal.SIGTERM, on_term)
    out = HydraConfig.get().runtime.output_dir
    if os.environ.get("HPC_TRAIN_RESTART_COUNT", "0") == "0" and os.environ.get("WAIT_FOR_STOP"):
        open(os.path.join(out, "ready"), "w").close()
        while not STOP:
            time.sleep(0.05)
        return "cut short"
    before = os.path.join(out, "job_return.json")  # what the stopped attempt left, read by the next one
    with open(os.environ["MARKS"], "a") as f:
        f.write(json.dumps({"what": "found", "record": json.load(open(before)) if os.path.exists(before) else None}) + "\\n")
    return f"whole at lr={cfg.lr}"


if __name__ == "__main__":
    main()
"""
MARKS = """
import json, os
from hydra.experimental.callback import Callback


def mark(what, **fields):
    with open(os.environ["MARKS"], "a") as f:
        f.write(json.dumps({"what": what, **fields}) + "\\n")


class Mark(Callback):
    def on_run_start(self, config, **kwargs):
        mark("run_start")

    def on_run_end(self, config, job_return=None, **kwargs):
        mark("run_end", status=job_return.status.name)

    def on_multirun_start(self, config, **kwargs):
        mark("multirun_start")

    def on_multirun_end(self, config, **kwargs):
        mark("multirun_end")

    def on_job_start(self, config, **kwargs):
        mark("job_start")

    def on_job_end(self, config, job_return, **kwargs):
        mark("job_end", status=job_return.status.name, attempt=os.environ.get("HPC_TRAIN_RESTART_COUNT"))
"""


def _stop_app(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """The app and its callback in tmp_path; the environment its commands run with (MARKS: the callback's file)."""
    (tmp_path / "stop_app.py").write_text(STOP_APP)
    (tmp_path / "marks.py").write_text(MARKS)
    (tmp_path / "config.yaml").write_text("lr: 1.0\n")
    return tmp_path / "stop_app.py", {**os.environ, "MARKS": str(tmp_path / "marks.jsonl")}


def _marks(tmp_path: Path) -> list[dict[str, Any]]:
    path = tmp_path / "marks.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _readable_by_others(path: Path, top: Path) -> bool:
    """Whether someone but the owner may read `path` through every folder from it up to `top`."""
    if not path.stat().st_mode & 0o044:
        return False
    return all(p.stat().st_mode & 0o011 for p in path.parents if p.is_relative_to(top))


def test_a_sweep_under_umask_002_runs_in_a_folder_only_its_owner_writes(tmp_path: Path) -> None:
    """Hydra's sweeper made the sweep folder 0775 under umask 002 and submit's trust check refused it; the
    launcher makes the folder itself, as `hpc-train submit` makes its own (0700 whatever the umask)."""
    sweep = tmp_path / "sw"
    proc = run(
        [sys.executable, str(ANCHOR), "-m", "hydra/launcher=hpc_train", "hydra.launcher.executor=local", "lr=1,2"]
        + [f"hydra.sweep.dir={sweep}"],
        env={**os.environ, "HPC_BENCH_OUT": str(tmp_path)},
        cwd=tmp_path,
        preexec_fn=lambda: os.umask(0o002),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "hpc_train: 2 trial(s) ran here" in proc.stdout
    assert sweep.stat().st_mode & 0o777 == 0o700
    assert [json.loads((sweep / str(i) / "job_return.json").read_text())["value"] for i in range(2)] == [1.0, 2.0]


def test_now_in_any_format_is_the_submits_moment_at_every_attempt(tmp_path: Path) -> None:
    """${now:FMT} of a format Hydra had not resolved before the compose (the sweep folder's two defaults)
    was resolved again by the job, at its own time. Every format is the submit's one moment: the sweep folder, the
    trial's folder (subdir) and the app's key, of three formats, read the same microsecond; a run alone's too."""
    sweep_root = tmp_path / "sw"
    proc = app(
        TYPED / "app.py",
        *LOCAL_SWEEP,
        "started=${now:%H%M%S.%f}",
        f"hydra.sweep.dir={sweep_root}/" + "${now:%Y%m%d-%H%M%S.%f}",
        "hydra.sweep.subdir=t${hydra.job.num}-${now:%S.%f}",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    (sweep,) = sweep_root.iterdir()
    (trial,) = (p for p in sweep.iterdir() if p.name.startswith("t0-"))
    value = json.loads((trial / "job_return.json").read_text())["value"]
    assert sweep.name.endswith("-" + value["started"]) and sweep.name.endswith(trial.name[3:]), (sweep, trial, value)
    run_root = tmp_path / "one"
    proc = app(
        TYPED / "app.py",
        "hydra/launcher=hpc_train",
        "hydra.launcher.executor=local",
        "started=${now:%M%S.%f}",
        f"hydra.run.dir={run_root}/" + "${now:%H%M%S.%f}",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    (one,) = run_root.iterdir()
    assert one.name.endswith(json.loads((one / "job_return.json").read_text())["value"]["started"]), one


@pytest.mark.parametrize("subdir", [".", "./", "sub/.."])
def test_an_output_subdir_on_the_trials_own_files_is_refused(tmp_path: Path, subdir: str) -> None:
    """hydra.output_subdir=. had Hydra's run_job write its config.yaml over the trial's own (hpc_train's
    frozen run config). Refused with the value and the fix before anything is queued, with -m and without."""
    sweep = tmp_path / "sw"
    proc = app(
        ANCHOR,
        *LOCAL_SWEEP,
        f"hydra.output_subdir={subdir}",
        f"hydra.sweep.dir={sweep}",
        cwd=tmp_path,
    )
    said = (f"hpc_train launcher: hydra.output_subdir={subdir} ", "Hydra's config.yaml", "hydra.output_subdir=.hydra")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert names(proc.stderr, *said, "the trial's own config.yaml")
    assert not (sweep / "sweep.json").exists() and not (sweep / "0").exists()
    target = tmp_path / "one"
    proc = app(
        ANCHOR,
        "hydra/launcher=hpc_train",
        "hydra.launcher.executor=local",
        f"hydra.output_subdir={subdir}",
        f"hydra.run.dir={target}",
        cwd=tmp_path,
    )
    assert proc.returncode == 1 and names(proc.stderr, *said, "the run's own config.yaml"), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and not target.exists()


def test_launcher_env_values_stay_owner_only_in_hydras_records(tmp_path: Path) -> None:
    """a value in hydra.launcher.env (an API key) reached multirun.yaml and each attempt's .hydra/hydra.yaml
    readable by the group (share_with_group=true). hpc_train's rule for cluster.env: every file that holds one is
    its owner's alone; so here, Hydra's records too."""
    secret = "s3cret-v4lue-of-the-review"
    sweep = tmp_path / "sw"
    proc = app(
        ANCHOR,
        *LOCAL_SWEEP,
        "hydra.launcher.share_with_group=true",
        f"+hydra.launcher.env.MY_API_KEY={secret}",
        "lr=1",
        f"hydra.sweep.dir={sweep}",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    holding = [p for p in sweep.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]
    assert {p.relative_to(sweep).as_posix() for p in holding} >= {"multirun.yaml", "0/.hydra/hydra.yaml"}
    assert [p for p in holding if _readable_by_others(p, sweep)] == []
    assert sweep.stat().st_mode & 0o777 == 0o750 and (sweep / "0").stat().st_mode & 0o777 == 0o750  # still shared


def test_a_stopped_attempt_does_not_claim_completed(tmp_path: Path) -> None:
    """an attempt stopped to be requeued (its app saved and returned at TERM) wrote job_return.json
    COMPLETED, and Hydra's callbacks got a COMPLETED JobReturn for it. A preemption of the local executor (TERM to its
    controller): the stopped attempt's record and JobReturn say it stopped; the resumed one's say COMPLETED."""

    script, env = _stop_app(tmp_path)
    target = tmp_path / "one"
    cmd = [sys.executable, str(script), "hydra/launcher=hpc_train", "hydra.launcher.executor=local"]
    cmd += [f"hydra.run.dir={target}", "+hydra.callbacks.mark._target_=marks.Mark"]
    preempt_once(cmd, {**env, "WAIT_FOR_STOP": "1"}, tmp_path, target)
    jobs = [(m["attempt"], m["status"]) for m in _marks(tmp_path) if m["what"] == "job_end"]
    assert jobs == [("0", "FAILED"), ("1", "COMPLETED")], _marks(tmp_path)
    (found,) = [m["record"] for m in _marks(tmp_path) if m["what"] == "found"]
    assert found["status"] == "STOPPED", found
    assert json.loads((target / "job_return.json").read_text()) == {"status": "COMPLETED", "value": "whole at lr=1.0"}
    assert [e["reason"] for e in read_events(target) if e["event"] == "requeue"] == ["preempt"]


def test_a_fixed_run_dir_is_used_and_refused_once_it_holds_a_run(tmp_path: Path) -> None:
    """a run without -m in a fixed hydra.run.dir that existed went to <dir>-1. A fixed folder is used (one
    that exists, yours alone, too); one that holds a run already is refused with the fix, nothing queued."""
    target = tmp_path / "fixed"
    target.mkdir(mode=0o700)
    args = ("hydra/launcher=hpc_train", "hydra.launcher.executor=local", "lr=3", f"hydra.run.dir={target}")
    proc = app(ANCHOR, *args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert f"hpc_train: finished {target}; it returned 3.0" in proc.stdout
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("fixed")) == ["fixed"]
    proc = app(ANCHOR, *args, cwd=tmp_path)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr[-3000:]
    assert names(proc.stderr, f"hydra.run.dir={target} ", "holds a run", f"hpc-train resume {target}")
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("fixed")) == ["fixed"]
    assert len(json.loads(run([HPC_TRAIN, "status", str(target), "--json"]).stdout)) == 1


@pytest.mark.parametrize("multirun", [True, False])
def test_an_unset_env_var_in_a_launcher_key_is_one_sentence(tmp_path: Path, multirun: bool) -> None:
    """${oc.env:NAME} of an unset variable in hydra.launcher.* gave OmegaConf's traceback."""
    where = [f"hydra.sweep.dir={tmp_path / 'sw'}"] if multirun else [f"hydra.run.dir={tmp_path / 'one'}"]
    proc = app(
        ANCHOR,
        *(["-m"] if multirun else []),
        "hydra/launcher=hpc_train",
        "hydra.launcher.partition=${oc.env:HPC_TRAIN_TEST_UNSET}",
        *where,
        cwd=tmp_path,
    )
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    unset = "${oc.env:HPC_TRAIN_TEST_UNSET"
    assert names(
        proc.stderr,
        f"hydra.launcher.partition={unset}}}",
        "'HPC_TRAIN_TEST_UNSET' not found",
        f"default: {unset},VALUE}}",
    )
    assert not (tmp_path / "sw" / "sweep.json").exists() and not (tmp_path / "one").exists()


def test_a_subdir_by_hydras_resolver_names_each_trial(tmp_path: Path) -> None:
    """hydra.sweep.subdir=${hydra:job.override_dirname} (Hydra's resolver, which reads HydraConfig) gave a
    traceback; it names each trial's folder as under Hydra's own launchers."""
    sweep = tmp_path / "sw"
    proc = app(
        ANCHOR,
        *LOCAL_SWEEP,
        "lr=1,2",
        "hydra.sweep.subdir=${hydra:job.override_dirname}",
        f"hydra.sweep.dir={sweep}",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert [json.loads((sweep / f"lr={i}" / "job_return.json").read_text())["value"] for i in (1, 2)] == [1.0, 2.0]


def test_callbacks_run_around_a_run_without_m_as_under_hydras_launcher(tmp_path: Path) -> None:
    """on_run_start / on_run_end of the app's callbacks were skipped for a run without -m. The same hooks,
    in the same order, with the same status, as the basic launcher calls them."""
    script, env = _stop_app(tmp_path)
    common = ["+hydra.callbacks.mark._target_=marks.Mark", "lr=2"]
    hooks = []
    for launcher in ("basic", "hpc_train"):
        extra = ["hydra.launcher.executor=local"] if launcher == "hpc_train" else []
        target = tmp_path / launcher
        cmd = [sys.executable, str(script), f"hydra/launcher={launcher}", *extra, *common, f"hydra.run.dir={target}"]
        proc = run(cmd, env=env, cwd=tmp_path)
        assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
        hooks.append([(m["what"], m.get("status")) for m in _marks(tmp_path) if m["what"] != "found"])
        (tmp_path / "marks.jsonl").unlink()
    assert hooks[0] == [("run_start", None), ("job_start", None), ("job_end", "COMPLETED"), ("run_end", "COMPLETED")]
    assert hooks[1] == hooks[0]


def test_resume_overrides_keep_the_trials_folder_and_override_dirname(tmp_path: Path) -> None:
    """the resume overrides joined hydra.job.override_dirname at a resume, so the attempt's Hydra saw
    another job than the one submitted (a folder named by it, a grouping by it)."""
    ckpt = tmp_path / "ckpt.pt"
    ckpt.write_text("a checkpoint\n")
    sweep = tmp_path / "sw"
    proc = app(
        ANCHOR,
        *LOCAL_SWEEP,
        f"hydra.launcher.checkpoint={ckpt}",
        "hydra.launcher.resume_overrides=['+resumed=true']",
        "hydra.sweep.subdir=${hydra.job.override_dirname}",
        "lr=1",
        f"hydra.sweep.dir={sweep}",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    import yaml

    hydra_yaml = yaml.safe_load((sweep / "lr=1" / ".hydra" / "hydra.yaml").read_text())["hydra"]
    assert hydra_yaml["job"]["override_dirname"] == "lr=1"
    assert hydra_yaml["runtime"]["output_dir"] == str(sweep / "lr=1")
    assert (sweep / "lr=1" / ".hydra" / "overrides.yaml").read_text() == "- lr=1\n- +resumed=true\n"


def test_waiting_on_a_site_without_accounting_ends_on_the_trials_own_records(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """hydra.launcher.wait=true where Slurm cannot say how a job ended (no accounting: sacct fails once squeue forgot
    the job, and every state reads "unknown"): the wait ended only on Slurm's word, so it never did. Each trial's own
    records say it too (summary.json; a `stopped` event: it will not requeue by itself), and the site is said once."""
    import threading
    from types import SimpleNamespace

    from hpc_train import hydra_launch, journal, runs, status

    done, stopped = tmp_path / "0", tmp_path / "1"
    for d in (done, stopped):
        d.mkdir()
    (done / "summary.json").write_text("{}\n")
    journal.log(stopped, journal.STOPPED, 3, "7_1", 0, reason="failure budget spent")
    unknown = {"finished": False, "state": "unknown", "state_error": "sacct: error: accounting storage is disabled"}
    monkeypatch.setattr(status, "status_rows", lambda runs: [dict(unknown), dict(unknown)])
    monkeypatch.setattr(runs, "find_runs", lambda path: [])
    p = SimpleNamespace(target=tmp_path, trials=[SimpleNamespace(run_dir=str(d), job_id="") for d in (done, stopped)])
    waiter = threading.Thread(target=hydra_launch.wait_for, args=(p, 0.01), daemon=True)
    with caplog.at_level("INFO", logger="hpc_train.hydra_launch"):
        waiter.start()
        waiter.join(timeout=10)
    assert not waiter.is_alive(), "wait_for still waiting on Slurm's word"
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]  # once, though asked often
    assert len(said) == 1 and names(
        said[0], "Slurm cannot say", f"({unknown['state_error']})", "summary.json", "events.jsonl"
    )


def test_waiting_without_accounting_ends_on_a_cancel_and_on_a_job_squeue_forgot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """hydra.launcher.wait=true where sacct fails: a trial `hpc-train cancel` took while pending (a `cancel` event, no
    `stopped`) and one Slurm killed before its requeue decision (no event at all) never ended the wait. A cancel ends
    it, and so does a job squeue no longer lists whose run holds no live lease; a job squeue lists is waited for."""
    import threading
    import time
    from types import SimpleNamespace

    from conftest import fake_clients

    from hpc_train import hydra_launch, journal, runs, status

    bin_dir, state = fake_clients(tmp_path, {"squeue": 'cat "$STATE/squeue"'})
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    (state / "squeue").write_text("7_2|PENDING\n")
    cancelled, killed, queued = (tmp_path / str(i) for i in range(3))
    for d in (cancelled, killed, queued):
        d.mkdir()
    journal.log(cancelled, journal.CANCEL, 0, "7_0", 0)
    unknown = {"finished": False, "state": "unknown", "state_error": "sacct: error: accounting storage is disabled"}
    monkeypatch.setattr(status, "status_rows", lambda runs: [dict(unknown) for _ in range(3)])
    monkeypatch.setattr(runs, "find_runs", lambda path: [])
    trials = [SimpleNamespace(run_dir=str(d), job_id=f"7_{i}") for i, d in enumerate((cancelled, killed, queued))]
    p = SimpleNamespace(target=tmp_path, trials=trials)
    waiter = threading.Thread(target=hydra_launch.wait_for, args=(p, 0.01), daemon=True)
    waiter.start()
    time.sleep(1.0)
    assert waiter.is_alive(), "the wait ended while squeue still lists trial 2's job"
    (state / "squeue").write_text("")
    waiter.join(timeout=10)
    assert not waiter.is_alive(), "wait_for still waiting on trials that ended"


def test_a_timed_folder_taken_already_gets_the_next_numbered_name(tmp_path: Path) -> None:
    """Two launches in the same second share Hydra's ${now:} folder: the second reused the first's sweep folder
    (its frozen app, its manifest), and a run alone's went to a name of another time (2026-12 -> 2026-1). Each
    takes <name>-1, as docs/hydra.md says; the folder already there is left as it was."""
    from datetime import datetime

    month = datetime.now().strftime("%Y-%m")
    taken = tmp_path / "runs" / month
    taken.mkdir(parents=True, mode=0o700)
    run_dir = f"hydra.run.dir={tmp_path / 'runs'}/" + "${now:%Y-%m}"
    proc = app(ANCHOR, "hydra/launcher=hpc_train", "hydra.launcher.executor=local", "lr=2", run_dir, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == [month, f"{month}-1"]
    assert json.loads((taken.parent / f"{month}-1" / "job_return.json").read_text())["value"] == 2.0
    sweeps = tmp_path / "sweeps"
    (sweeps / month).mkdir(parents=True, mode=0o700)
    sweep_dir = f"hydra.sweep.dir={sweeps}/" + "${now:%Y-%m}"
    proc = app(
        ANCHOR, "-m", "hydra/launcher=hpc_train", "hydra.launcher.executor=local", "lr=4", sweep_dir, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert list((sweeps / month).iterdir()) == []  # the first launch's folder, untouched
    claimed = sweeps / f"{month}-1"
    assert {"multirun.yaml", "sweep.json", "hydra_launch.json"} <= {p.name for p in claimed.iterdir()}
    assert json.loads((claimed / "0" / "job_return.json").read_text())["value"] == 4.0


def test_a_run_alone_never_reuses_a_spec_another_launch_froze(tmp_path: Path) -> None:
    """Two runs started together in one fixed hydra.run.dir both passed its check, and the second took the
    first's frozen app as its own. Freezing a run alone claims its spec: the second is refused."""
    from hpc_train import hydra_job

    folder = tmp_path / "exp"
    folder.mkdir(mode=0o700)
    ref = {"module": "app", "file": None, "name": "main", "wrapped": False, "main": False}
    hydra_job.freeze(folder, ref, [{"a": 1}], multirun=False, private=True)
    with pytest.raises(ValueError, match="hydra_launch.json"):
        hydra_job.freeze(folder, {**ref, "name": "other"}, [{"a": 2}], multirun=False, private=True)
    assert json.loads((folder / hydra_job.SPEC).read_text())["app"]["name"] == "main"


def test_a_sweep_into_a_folder_another_launch_is_queueing_is_refused(tmp_path: Path) -> None:
    """Two sweeps in one fixed hydra.sweep.dir at once went through same_sweep, freeze and submit side by side.
    The launcher holds the folder's lock from its check through the submit; a second is refused meanwhile."""
    from hpc_train.hydra_launch import LAUNCH_LOCK
    from hpc_train.paths import locked

    sweep = tmp_path / "sw"
    sweep.mkdir(mode=0o700)
    args = ("-m", "hydra/launcher=hpc_train", "hydra.launcher.executor=local", "lr=1", f"hydra.sweep.dir={sweep}")
    with locked(sweep / LAUNCH_LOCK):
        proc = app(ANCHOR, *args, cwd=tmp_path)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr[-3000:]
    assert names(proc.stderr, f"{sweep}", "another", "hpc-train status")
    assert not (sweep / "sweep.json").exists() and not (sweep / "hydra_launch.json").exists()


def test_an_existing_sweep_folder_is_judged_before_hydra_writes_into_it(tmp_path: Path) -> None:
    """A sweep folder others can write was judged only at submit, after Hydra's sweeper wrote multirun.yaml in it;
    one whose parent is a file gave a traceback. Both are one sentence from the launcher's setup, nothing written."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    local = ("-m", "hydra/launcher=hpc_train", "hydra.launcher.executor=local", "lr=1")
    proc = app(ANCHOR, *local, f"hydra.sweep.dir={shared}", cwd=tmp_path)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert names(proc.stderr, f"hydra.sweep.dir={shared}", "writable")
    assert list(shared.iterdir()) == []
    (tmp_path / "afile").write_text("")
    bad = tmp_path / "afile" / "sw"
    proc = app(ANCHOR, *local, f"hydra.sweep.dir={bad}", cwd=tmp_path)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert names(proc.stderr, f"hydra.sweep.dir={bad}", str(tmp_path / "afile"), "hydra.sweep.dir=...")


def test_a_stop_the_app_unwinds_by_raising_is_recorded_as_stopped(tmp_path: Path) -> None:
    """An app whose TERM handler raises to unwind its stack: the stopped attempt's job_return.json said FAILED with
    the traceback. It says STOPPED, and the resumed attempt's COMPLETED."""

    script, env = _stop_app(tmp_path)
    target = tmp_path / "one"
    cmd = [sys.executable, str(script), "hydra/launcher=hpc_train", "hydra.launcher.executor=local"]
    cmd += [f"hydra.run.dir={target}", "+hydra.callbacks.mark._target_=marks.Mark"]
    preempt_once(cmd, {**env, "WAIT_FOR_STOP": "1", "RAISE_AT_STOP": "1"}, tmp_path, target)
    (found,) = [m["record"] for m in _marks(tmp_path) if m["what"] == "found"]
    assert found["status"] == "STOPPED", found
    assert json.loads((target / "job_return.json").read_text()) == {"status": "COMPLETED", "value": "whole at lr=1.0"}


def test_hydras_folder_takes_the_runs_mode_under_umask_002(tmp_path: Path) -> None:
    """share_with_group=true without env values: Hydra made each trial's .hydra/ with the umask's mode (0775 under
    umask 002 where the job keeps it, 0755 here). It takes the run's folder mode (0750), as the trial's folder does,
    and the records run_job writes in it (0664 under umask 002, 0644 here) the run's file mode, 0640."""
    sweep = tmp_path / "sw"
    proc = run(
        [sys.executable, str(ANCHOR), "-m", "hydra/launcher=hpc_train", "hydra.launcher.executor=local", "lr=1"]
        + ["hydra.launcher.share_with_group=true", f"hydra.sweep.dir={sweep}"],
        env={**os.environ, "HPC_BENCH_OUT": str(tmp_path)},
        cwd=tmp_path,
        preexec_fn=lambda: os.umask(0o002),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert (sweep / "0" / ".hydra").stat().st_mode & 0o777 == 0o750
    modes = {p.name: p.stat().st_mode & 0o777 for p in (sweep / "0" / ".hydra").iterdir()}
    assert modes == {"config.yaml": 0o640, "hydra.yaml": 0o640, "overrides.yaml": 0o640}, modes


@pytest.mark.parametrize("subdir", ["..", "../elsewhere"])
def test_an_output_subdir_outside_the_trials_folder_is_refused(tmp_path: Path, subdir: str) -> None:
    """hydra.output_subdir=.. had each trial's run_job write config.yaml into the sweep folder (and change its
    mode). Any value outside the trial's folder is refused with the value and the fix, before anything is queued."""
    sweep = tmp_path / "sw"
    args = ("-m", "hydra/launcher=hpc_train", "hydra.launcher.executor=local", f"hydra.output_subdir={subdir}")
    proc = app(ANCHOR, *args, "lr=1", f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert names(proc.stderr, f"hydra.output_subdir={subdir} ", "outside", "hydra.output_subdir=.hydra")
    assert not (sweep / "sweep.json").exists() and not (sweep / "config.yaml").exists()


def test_braces_in_the_sweep_folder_are_kept(tmp_path: Path) -> None:
    """hydra.sweep.dir=s{name}: the trial's command named its spec by that path, and script.fill took {name} for
    the run's name; the braces are literal."""
    sweep = tmp_path / "s{name}"
    proc = app(
        ANCHOR,
        *LOCAL_SWEEP,
        "lr=5",
        f"hydra.sweep.dir='{sweep}'",  # quoted: Hydra's grammar takes braces only in a quoted value
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert json.loads((sweep / "0" / "job_return.json").read_text())["value"] == 5.0


def test_a_sweep_whose_freeze_stopped_before_its_pickles_is_refused_with_the_fix(tmp_path: Path) -> None:
    """A launch that stopped between its claim (hydra_launch.json) and its pickles left a spec without its bases;
    the next launch into the folder queued trials that then failed to load them. Refused at the freeze, with the
    files to remove."""
    from hpc_train import hydra_job

    folder = tmp_path / "sweep"
    folder.mkdir(mode=0o700)
    ref = {"module": "app", "file": None, "name": "main", "wrapped": False, "main": False}
    hydra_job.freeze(folder, ref, [{"a": 1}, {"a": 2}], multirun=True, private=True)
    (folder / hydra_job.base_file(1)).unlink()  # as a launch killed after writing base 0
    with pytest.raises(ValueError) as refused:
        hydra_job.freeze(folder, ref, [{"a": 1}], multirun=True, private=True)
    assert names(str(refused.value), hydra_job.base_file(1), "not there", f"remove {hydra_job.SPEC}", "hydra.sweep.dir")
    (folder / hydra_job.base_file(0)).unlink()
    (folder / hydra_job.SPEC).unlink()  # the fix: then it freezes again
    assert hydra_job.freeze(folder, ref, [{"a": 1}], multirun=True, private=True).exists()


def test_a_damaged_spec_or_a_records_folder_gone_is_no_traceback(tmp_path: Path) -> None:
    """Review: a spec saying "bases": Infinity raised OverflowError out of the launcher; a .hydra/ folder gone
    before the task (tighten_records) failed a good run."""
    from hpc_train import hydra_job

    folder = tmp_path / "sweep"
    folder.mkdir(mode=0o700)
    ref = {"module": "app", "file": None, "name": "main", "wrapped": False, "main": False}
    spec = hydra_job.freeze(folder, ref, [{"a": 1}], multirun=True, private=True)
    spec.write_text(json.dumps({**json.loads(spec.read_text()), "bases": float("inf")}))
    assert hydra_job.freeze(folder, ref, [{"a": 1}], multirun=True, private=True) == spec  # its one base is there
    hydra_job.tighten_records((tmp_path / "gone" / ".hydra", 0o600))  # no error: the run goes on
