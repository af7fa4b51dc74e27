"""What the user reads: bad input is refused before anything is written or queued, and the
login-node path never imports torch."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import HPC_TRAIN, fake_clients, names, refused, run


@pytest.mark.parametrize(
    "override, message",
    [
        ("cluster.nodes=0", r"cluster.nodes=0 must be >= 1"),
        ("cluster.nodes=2", r"cluster.nodes=2 but the local executor runs on this one machine; use cluster.nodes=1"),
        ("cluster.executor=pbs", r"cluster.executor='pbs' is not one of \('local', 'slurm'\)"),
        (
            "model.n_heads=5",
            r"model.d_model=64 must be divisible by model.n_heads=5; use n_heads in \[1, 2, 4, 8, 16\]",
        ),
        ("train.stepz=3", r"Could not override 'train.stepz'.*valid keys under train: steps, batch_seqs_per_rank"),
        ("train.steps=many", r"train.steps='many' is a str, but train.steps takes int"),
        ("name='a;b'", r"name='a;b' must be 1-64 letters, digits, '.', '_' or '-'"),
        (
            "cluster=dev|cluster.setup=['echo \"unterminated']",
            r"the batch script would not parse: .*(unexpected EOF|syntax error).*check cluster.setup",
        ),
        (
            "cluster=dev|cluster.setup=['trap \"rm -rf /tmp/x\" EXIT']",
            r"sets an EXIT trap, which would never run: .*clean up in a Slurm epilog",
        ),
        (
            "cluster=nope",
            r"no cluster config named 'nope': there are dev, example_site, local, slurm \(conf/cluster/\*.yaml\)\n"
            r"a cluster of your own: hpc-train init, then cp conf/cluster/example_site.yaml conf/cluster/nope.yaml",
        ),
        (
            "train.parallelism=fsdp|train.tp=3",
            r"train.tp=3 must divide cluster.tasks_per_node=2 so tensor-parallel "
            r"groups stay on one node; use tp in \[1, 2\]",
        ),
        ("train.tp=2", r"train.tp=2 needs train.parallelism=fsdp"),
        (
            "data=tokens|data.path=/nonexistent",
            r"data.path='/nonexistent' has no readable meta.json .*; write one with "
            r"`hpc-train prepare-data FILES... --out /nonexistent`",
        ),
        ("fn._target_=not a path", r"fn._target_='not a path' is not a dotted path; write package.module.function"),
        ("trian.steps=5", r"Could not override 'trian.steps'.*\ndid you mean train.steps\?"),
        ("train.step=5", r"no key 'step'.*\ndid you mean train.steps\?"),
        ("cluster=devv", r"no cluster config named 'devv': .*\ndid you mean cluster=dev\?"),
        ("+trian.x=1", r"Key 'trian' is not in RunConfig.*\ndid you mean train\?"),
        (
            "train.lr=1e-3,3e-3",
            r"'train.lr=1e-3,3e-3' gives several values, a sweep: add -m to run one trial per value",
        ),
    ],
)
def test_bad_override_is_refused_with_the_fix(tmp_path: Path, override: str, message: str) -> None:
    proc = run([HPC_TRAIN, "submit", f"out_dir={tmp_path}", *override.split("|")])
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.startswith("hpc-train submit: error:")
    assert re.search(message, proc.stderr, re.S), proc.stderr
    assert "Config search path" not in proc.stderr  # Hydra's dump of where it looked: not for a user
    assert list(tmp_path.iterdir()) == []  # nothing written, nothing submitted


@pytest.mark.parametrize(
    "override, message",
    [
        ("trian.steps=5", r"Key 'trian' not in 'RunConfig'.*\ndid you mean train.steps\?"),
        ("model=tinny", r"no model config named 'tinny': there are 1b, small, tiny .*\ndid you mean model=tiny\?"),
        ("train.lr=1e-3,3e-3", r"'train.lr=1e-3,3e-3' gives several values, a sweep: add -m"),
    ],
)
def test_cfg_job_suggests_the_nearest_key(override: str, message: str) -> None:
    """--cfg composes through Hydra itself, whose errors explain() completes."""
    proc = run([HPC_TRAIN, "submit", "--cfg", "job", override])
    assert proc.returncode == 2 and re.search(message, proc.stderr, re.S), proc.stderr


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.lr=nan", r"train.lr=nan and train.grad_clip=1.0 must be > 0 and finite"),
        ("train.weight_decay=nan", r"train.weight_decay=nan must be finite and >= 0: AdamW's decoupled decay"),
        ("train.min_step_time_s=inf", r"train.min_step_time_s=inf must be finite and >= 0: 0 = off"),
        ("train.adam_eps=nan", r"train.adam_eps=nan must be > 0"),
    ],
)
def test_nan_and_inf_are_refused(override: str, message: str) -> None:
    """nan compares False with everything: `value < low` let it through to the job."""
    proc = run([HPC_TRAIN, "submit", "--cfg", "job", override])
    assert proc.returncode == 2 and re.search(message, proc.stderr), proc.stderr


@pytest.mark.parametrize(
    "override, sentence",
    [
        (
            "train.compile=true",
            "train.compile=true needs a C++ compiler for torch.compile (inductor), and '/nonexistent/g++' is not on "
            "PATH here; install g++ (apt-get install g++) or set CXX, or set train.compile=false",
        ),
        (
            "fn._target_=no_such_pkg.train.main",
            "fn._target_='no_such_pkg.train.main': module 'no_such_pkg.train' is not importable here; install it "
            "(pip install -e .) or add its folder to PYTHONPATH, which the job inherits",
        ),
        ("data=tokens|data.path=/nonexistent", "data.path='/nonexistent' has no readable meta.json"),
        ("metrics.wandb=true", "metrics.wandb=true needs the wandb package, which is not installed in this Python"),
    ],
)
def test_validation_is_pure_and_the_environment_check_names_what_is_missing(
    override: str, sentence: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """to_run_config (every dataclass check) only reads the config: no compiler lookup, no import lookup,
    no file read, no subprocess, sys.path as it was. check_environment, the one step that asks this
    machine, raises the sentence `hpc-train submit` prints, and leaves sys.path as it found it too."""
    import builtins
    import importlib.util
    import io
    import shutil

    from hpc_train.config import check_environment, compose, to_run_config

    monkeypatch.setenv("CXX", "/nonexistent/g++")
    monkeypatch.setitem(sys.modules, "wandb", None)  # how Python marks a module absent
    monkeypatch.chdir(tmp_path)  # the cwd is searched for fn._target_: an empty one
    cfg = compose(override.split("|"))  # Hydra reads conf/: before the validation under test
    path = list(sys.path)

    def touched(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"validation touched the world: {args}")

    with monkeypatch.context() as world:
        for module, name in [
            (shutil, "which"),
            (importlib.util, "find_spec"),
            (builtins, "open"),
            (io, "open"),
            (subprocess, "run"),
            (subprocess, "Popen"),
        ]:
            world.setattr(module, name, touched)
        run = to_run_config(cfg)
    assert sys.path == path
    with pytest.raises(ValueError) as e:
        check_environment(run)
    assert sentence in str(e.value)
    assert sys.path == path


def test_version_names_the_installed_package() -> None:
    import hpc_train

    proc = run([HPC_TRAIN, "--version"])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"hpc-train {hpc_train.__version__} from {Path(hpc_train.__file__).resolve().parent}")


def test_the_first_hour_a_folder_that_is_not_a_run_and_a_mistyped_command(tmp_path: Path) -> None:
    """Issue 29 D3: `status` where nothing was submitted yet says so (exit 0); `resume conf` (Hydra's
    conf/config.yaml is no run) says it is not a run and writes nothing there (it left conf/.lock); a mistyped
    command gets the nearest one; `--help` opens with what hpc-train is, not a note for developers."""
    empty = run([HPC_TRAIN, "status"], cwd=tmp_path)
    assert empty.returncode == 0 and empty.stdout.startswith("no runs here yet"), empty.stdout + empty.stderr
    assert run([HPC_TRAIN, "status", "--json"], cwd=tmp_path).stdout == "[]\n"  # a script still reads JSON
    assert run([HPC_TRAIN, "init"], cwd=tmp_path).returncode == 0
    before = sorted(p.relative_to(tmp_path) for p in (tmp_path / "conf").rglob("*"))
    for command in ("resume", "logs", "report", "status"):
        proc = run([HPC_TRAIN, command, "conf"], cwd=tmp_path)
        said = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(said) == 1 and "Traceback" not in proc.stderr, (command, proc.stderr)
        assert "conf is not a run directory" in said[0] or "no runs under conf" in said[0], (command, said)
    assert sorted(p.relative_to(tmp_path) for p in (tmp_path / "conf").rglob("*")) == before  # no .lock
    typo = run([HPC_TRAIN, "stauts"], cwd=tmp_path)
    assert typo.returncode == 2 and names(typo.stderr, "'stauts'", "did you mean hpc-train status?")
    helped = run([HPC_TRAIN, "--help"], cwd=tmp_path)
    from hpc_train.cli import USAGE

    assert helped.stdout.split("\n\n")[1] == USAGE.split("\n\n")[0], helped.stdout  # what it is, after the usage


def test_a_config_group_option_missing_from_a_config_names_the_config_that_asked_for_it() -> None:
    from hydra.errors import MissingConfigException

    from hpc_train.config import explain

    e = MissingConfigException("In 'cluster/mine': Could not find 'data/nosuch'", "data/nosuch", ["synthetic"])
    assert names(explain(e), "data config named 'nosuch'", "cluster/mine.yaml", "synthetic")
    e = MissingConfigException("In 'config': Could not find 'cluster/mysite'", "cluster/mysite", ["dev", "local"])
    assert names(explain(e), "cluster config named 'mysite'", "dev, local", "conf/cluster/*.yaml")
    assert "cluster/mine" not in explain(e)  # asked for by the primary config: no other config named


def test_every_argument_of_every_command_says_what_it_is() -> None:
    from hpc_train import cli

    _, commands = cli._parser(["chaos"])  # chaos's actions too
    silent = [
        f"{name} {a.dest}" for name, sub in commands.items() for a in sub._actions if a.dest != "help" and not a.help
    ]
    assert not silent, silent


def test_init_writes_a_starter_conf_that_submit_then_uses(tmp_path: Path) -> None:
    """./conf of the current folder is the primary config directory, as in Hydra; init never overwrites."""
    proc = run([HPC_TRAIN, "init"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "wrote conf/" in proc.stdout and (tmp_path / "conf" / "config.yaml").is_file()
    (tmp_path / "conf" / "model" / "mine.yaml").write_text("d_model: 96\nn_heads: 3\n")
    cfg = run([HPC_TRAIN, "submit", "--cfg", "job", "model=mine"], cwd=tmp_path)
    assert cfg.returncode == 0 and "d_model: 96" in cfg.stdout, cfg.stderr
    again = run([HPC_TRAIN, "init"], cwd=tmp_path)
    assert refused(again, "init", "conf exists already", "never overwrites")
    assert (tmp_path / "conf" / "model" / "mine.yaml").exists()
    # A team's shared site options, listed in conf/config.yaml with Hydra's searchpath (docs/submitting.md)
    (tmp_path / "site" / "cluster").mkdir(parents=True)
    (tmp_path / "site" / "cluster" / "mysite.yaml").write_text("executor: slurm\npartition: gpu\nnodes: 3\n")
    with open(tmp_path / "conf" / "config.yaml", "a") as f:
        f.write(f"hydra:\n  searchpath: [file://{tmp_path / 'site'}]\n")
    site = run([HPC_TRAIN, "submit", "--cfg", "job", "cluster=mysite"], cwd=tmp_path)
    assert site.returncode == 0 and "partition: gpu" in site.stdout and "nodes: 3" in site.stdout, site.stderr


def test_config_path_and_name_pick_the_primary_config(tmp_path: Path) -> None:
    """Hydra's -cp replaces the primary directory (from any folder), -cn picks the file in it."""
    assert run([HPC_TRAIN, "init", str(tmp_path)]).returncode == 0
    conf = tmp_path / "conf"
    (conf / "big.yaml").write_text((conf / "config.yaml").read_text().replace("name: demo", "name: big"))
    (conf / "train" / "default.yaml").write_text("steps: 5\n")
    proc = run([HPC_TRAIN, "submit", "--cfg", "job", "--config-path", str(conf), "--config-name", "big"])
    assert proc.returncode == 0, proc.stderr
    assert "name: big" in proc.stdout and "steps: 5" in proc.stdout
    missing = run([HPC_TRAIN, "submit", "--cfg", "job", "-cp", str(tmp_path / "nope")])
    assert missing.returncode == 2 and f"config directory '{tmp_path}/nope' does not exist" in missing.stderr


def test_cfg_job_prints_the_composed_config() -> None:
    proc = run([HPC_TRAIN, "submit", "--cfg", "job", "cluster=dev", "train.steps=7"])
    assert proc.returncode == 0, proc.stderr
    assert "steps: 7" in proc.stdout and "executor: slurm" in proc.stdout
    assert "slurm_conf: /" in proc.stdout  # ${oc.env:...} resolved


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["--version"],
        ["submit", "--cfg", "job"],
        ["submit", "--dry-run", "-m", "train.seed=1,2"],
        ["submit", "--no-wait", "train.steps=2"],
    ],
)
def test_login_node_path_never_imports_torch(argv: list[str], tmp_path: Path) -> None:
    """`submit` itself too: it pickles run_job by reference; only the job's own processes import torch."""
    argv = [*argv, f"out_dir={tmp_path}"] if argv[0] == "submit" else argv
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "hpc_train.cli", *argv], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    imported = {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if "|" in line}
    assert "hydra" in imported or argv[0].startswith("--")
    assert "torch" not in imported
    if "--no-wait" not in argv:  # only chaos needs ops (and a local run's controller identity)
        assert "hpc_train.ops" not in imported
    if "--no-wait" in argv:  # a single run records which code validated it
        import hpc_train

        code = json.loads(next(tmp_path.glob("*/code.json")).read_text())
        assert code["version"] == hpc_train.__version__ and code["path"] == str(
            Path(hpc_train.__file__).resolve().parent
        )


def test_dry_run_prints_scripts_and_configs_and_writes_nothing(tmp_path: Path) -> None:
    proc = run(
        [HPC_TRAIN, "submit", "--dry-run", "-m", f"out_dir={tmp_path}", "train.seed=choice(1,2)", "model=tiny,small"]
    )
    assert proc.returncode == 0, proc.stderr
    trials = re.findall(r"# ---- trial (\d): (.*) -> (\S+) ----", proc.stdout)
    assert [t[1].split()[1:] for t in trials] == [
        ["train.seed=1", "model=tiny"],
        ["train.seed=1", "model=small"],
        ["train.seed=2", "model=tiny"],
        ["train.seed=2", "model=small"],
    ]
    assert proc.stdout.count("d_model: 256") == 2 and proc.stdout.count("d_model: 64") == 2  # group sweep composed
    assert "dry run: 4 trial(s)" in proc.stdout
    assert list(tmp_path.iterdir()) == []


def test_users_config_dir_adds_options(tmp_path: Path) -> None:
    """Hydra's -cd: searched after the primary directory, so a site file needs no copy of the rest."""
    (tmp_path / "cluster").mkdir()
    (tmp_path / "cluster" / "mysite.yaml").write_text("executor: slurm\npartition: gpu\nnodes: 3\n")
    proc = run([HPC_TRAIN, "submit", "--config-dir", str(tmp_path), "--cfg", "job", "cluster=mysite"])
    assert proc.returncode == 0, proc.stderr
    assert "partition: gpu" in proc.stdout and "nodes: 3" in proc.stdout and "d_model: 64" in proc.stdout


def test_status_shows_a_numeric_mfu(tmp_path: Path) -> None:
    """A GPU run's metrics carry a float MFU; rich cannot render a float, and `status` crashed on it."""
    import json

    from hpc_train import journal
    from hpc_train.paths import append_line

    run_dir = tmp_path / "gpu-1"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(
        "cluster: {executor: local, signal_lead_s: 120}\ntrain: {steps: 60}\nrequeue: {max_failures: 2}\n"
    )
    (run_dir / "submission.json").write_text(json.dumps({"executor": "local", "job_id": ""}))
    journal.log(run_dir, "start", 0, "1", 0)
    append_line(run_dir / "metrics.jsonl", {"time": 1.0, "step": 10, "tokens_per_s": 1e6, "mfu": 0.4213})
    out = run([HPC_TRAIN, "status", str(run_dir)])
    assert out.returncode == 0 and "42.1%" in out.stdout, out.stdout + out.stderr


def test_init_into_a_file_or_a_dangling_conf_link_says_what_to_fix(tmp_path: Path) -> None:
    """Before: NotADirectoryError and FileExistsError tracebacks."""
    (tmp_path / "afile").write_text("x")
    proc = run([HPC_TRAIN, "init", "afile"], cwd=tmp_path)
    assert refused(proc, "init", "afile is a file, not a folder", "e.g. hpc-train init .")
    (tmp_path / "conf").symlink_to(tmp_path / "gone")
    proc = run([HPC_TRAIN, "init"], cwd=tmp_path)
    assert refused(proc, "init", f"conf is a symlink to {tmp_path}/gone", "does not exist", "rm conf", "hpc-train init")


def test_a_conf_folder_without_config_yaml_is_not_the_primary_config(tmp_path: Path) -> None:
    """A project's own conf/ (here: logging settings) is not hpc-train's; submit says which config it used."""
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "logging.ini").write_text("[loggers]\n")
    proc = run([HPC_TRAIN, "submit", "--dry-run", "cluster=dev", "train.steps=3"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr  # before: "Cannot find primary config 'config'"
    from hpc_train.config import CONF_DIR

    assert f"hpc-train submit: config {CONF_DIR.resolve()}/config.yaml\n" in proc.stderr
    (tmp_path / "conf" / "config.yaml").write_text((CONF_DIR / "config.yaml").read_text())
    for group in ("cluster", "model", "train", "data", "checkpoint", "experiment"):
        if (CONF_DIR / group).is_dir():
            (tmp_path / "conf" / group).symlink_to(CONF_DIR / group)
    proc = run([HPC_TRAIN, "submit", "--dry-run", "cluster=dev", "train.steps=3"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    primary = tmp_path / "conf" / "config.yaml"
    assert f"hpc-train submit: config {primary}\n" in proc.stderr


# A Slurm cluster as its client commands answer, for what the real test cluster cannot be made to do
# (an sbatch that takes seconds, a slurmdbd that is down). $STATE/<name> overrides a command's answer.
FAKE_SLURM = {
    "scontrol": """case "$*" in
  ping*) echo "Slurmctld(primary) at fake is UP";;
  "show partition -o") echo "PartitionName=debug Default=YES State=UP TotalNodes=2 MaxNodes=UNLIMITED MaxTime=UNLIMITED Nodes=n[1-2]";;
  "show node -o") printf 'NodeName=n1 CPUTot=8 State=IDLE\\nNodeName=n2 CPUTot=8 State=IDLE\\n';;
  "show config") printf 'ClusterName = fake\nMaxArraySize = 1001\nAccountingStorageType = accounting_storage/slurmdbd\nAccountingStorageEnforce = associations,limits,qos\n';;
  *) echo "scontrol $*: not faked" >&2; exit 1;;
esac""",
    "sbatch": """case "$1" in
  --test-only) echo "sbatch: Job 1 to start at 2026-01-01T00:00:00 using 4 processors on nodes n1 in partition debug" >&2;;
  *) touch "$STATE/sbatch_started"; sleep "$(cat "$STATE/sbatch_sleep" 2>/dev/null || echo 0)"
     echo "Submitted batch job 4242";;
esac""",
    "sacctmgr": """[ -f "$STATE/sacctmgr" ] && . "$STATE/sacctmgr"; echo "research|research||normal,long\"""",
    "squeue": """[ -f "$STATE/squeue" ] && . "$STATE/squeue"; exit 0""",
    "sacct": """[ -f "$STATE/sacct" ] && . "$STATE/sacct"; exit 0""",
    "srun": """exit 0  # submitit's SlurmExecutor only looks for it""",
}


def fake_slurm(tmp_path: Path) -> tuple[dict[str, str], Path, str]:
    """(env with the fake clients first on PATH, their state folder, a cluster.slurm_conf override)."""
    import os

    bin_dir, state = fake_clients(tmp_path, FAKE_SLURM)
    (tmp_path / "slurm.conf").write_text("ClusterName=fake\n")
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    return env, state, f"cluster.slurm_conf={tmp_path / 'slurm.conf'}"


def test_ctrl_c_during_sbatch_waits_until_the_job_id_is_recorded(tmp_path: Path) -> None:
    """Before: a traceback, and the job sbatch queued was named nowhere (no submission.json)."""
    import signal
    import time

    env, state, conf = fake_slurm(tmp_path)
    (state / "sbatch_sleep").write_text("3")
    proc = subprocess.Popen(
        [HPC_TRAIN, "submit", "cluster=slurm", conf, f"out_dir={tmp_path / 'runs'}"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(
            signal.SIGINT, signal.SIG_DFL
        ),  # as at a terminal: a shell's `cmd &` ignores it
    )
    deadline = time.monotonic() + 60
    while not (state / "sbatch_started").exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, proc.communicate()
    proc.send_signal(signal.SIGINT)  # as Ctrl-C, mid-sbatch
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, out + err
    assert "Traceback" not in err and names(
        err, "hpc-train submit: interrupted (Ctrl-C)", "recorded in its run directory"
    )
    assert json.loads((tmp_path / "runs" / "demo-1" / "submission.json").read_text())["job_id"] == "4242"


@pytest.mark.parametrize("sacctmgr", ["down", "hangs", "missing"])
def test_account_and_qos_unchecked_when_slurmdbd_is_down_says_so_and_submits(tmp_path: Path, sacctmgr: str) -> None:
    """Before: sacctmgr's 30 s timeout x 4 tries (a hang: 2 min) then an error, or "use cluster=local" when
    sacctmgr is missing. Now one try of 5 s, a warning, and sbatch --test-only judges the account."""
    import shutil
    import time

    env, state, conf = fake_slurm(tmp_path)
    tries = state / "sacctmgr_tries"  # a line per call
    if sacctmgr == "down":
        (state / "sacctmgr").write_text(
            f"echo >> {tries}; echo 'sacctmgr: error: Problem talking to the database: Connection refused' >&2; exit 1\n"
        )
    elif sacctmgr == "hangs":
        (state / "sacctmgr").write_text(f"echo >> {tries}; exec sleep 60\n")
    else:  # a PATH with the fake clients and the few tools they use, and no sacctmgr anywhere on it
        (tmp_path / "fakebin" / "sacctmgr").unlink()
        tools = tmp_path / "tools"
        tools.mkdir()
        for tool in ("sh", "bash", "sleep", "cat", "touch"):
            (tools / tool).symlink_to(shutil.which(tool))
        env["PATH"] = f"{tmp_path / 'fakebin'}:{tools}"
    args = [
        HPC_TRAIN,
        "submit",
        "cluster=slurm",
        "cluster.account=research",
        "cluster.qos=long",
        conf,
        f"out_dir={tmp_path / 'runs'}",
    ]
    t0 = time.monotonic()
    dry = run([*args, "--dry-run"], env=env)
    took = time.monotonic() - t0
    reason = {
        "down": r"`sacctmgr -n -P show user \S+ withassoc .*` failed: sacctmgr: error: Problem talking to the "
        r"database: Connection refused",
        "hangs": r"`sacctmgr -n -P show user \S+ withassoc .*` did not answer within 5 s",
        "missing": r"`sacctmgr` is not installed here",
    }[sacctmgr]
    assert dry.returncode == 0, dry.stderr
    (warning,) = [line for line in dry.stderr.splitlines() if line.startswith("hpc-train: warning: ")]
    assert re.search(reason, warning) and names(warning, "account/qos not checked", "sbatch --test-only"), dry.stderr
    assert re.search(rf"# NOT validated: account/qos .*{reason}", dry.stdout), dry.stdout
    # One try, not 4, and given up on before the hung one would have answered: counted and ordered, not timed.
    calls = len(tries.read_text().splitlines()) if tries.exists() else 0
    assert calls == (0 if sacctmgr == "missing" else 1), calls
    assert "cluster=local" not in dry.stderr and (sacctmgr != "hangs" or took < 60), (took, dry.stderr)
    proc = run(args, env=env)
    assert proc.returncode == 0 and "submitted job 4242" in proc.stdout, proc.stderr


def test_the_program_skips_the_collections_at_exit_and_a_caller_keeps_them(tmp_path: Path) -> None:
    """`hpc-train submit` to Slurm collects no garbage (a sweep's plan is millions of objects, none of them
    garbage) and every command freezes what is left before exiting (the interpreter's last collections walked every object Hydra,
    OmegaConf and submitit made: ~40 ms of a dry run); main([...]) called by a program leaves gc alone."""
    code = (
        "import atexit, gc, sys\n"
        "from hpc_train.cli import main\n"
        "atexit.register(lambda: print('frozen', gc.get_freeze_count() > 0, not gc.isenabled()))\n"
        "who, sys.argv = sys.argv[1], ['hpc-train', *sys.argv[2:]]\n"
        "main(sys.argv[1:]) if who == 'caller' else main()\n"
    )
    for who, args, frozen, paused in (
        ("program", ["--cfg", "job"], True, True),
        ("caller", ["--cfg", "job"], False, False),
        ("program", ["--dry-run"], True, False),  # the local executor: submit waits for its trials, collecting
    ):
        argv = [sys.executable, "-c", code, who, "submit", *args, f"out_dir={tmp_path}"]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.endswith(f"frozen {frozen} {paused}\n"), proc.stdout[-200:]


def test_an_error_wraps_to_the_terminal_and_stays_one_line_in_a_pipe(tmp_path: Path) -> None:
    """Issue 29 D3: a sentence that names the value and the fix ran to 379 columns in an 80-column terminal. On a
    terminal it wraps at its width, words and paths whole; into a pipe it stays one line (what a script greps)."""
    import os
    import pty
    import re
    import subprocess

    args = [HPC_TRAIN, "submit", "train.stepz=3"]  # a key that is not a config key: a line of 379 columns
    piped = subprocess.run(args, capture_output=True, text=True, cwd=tmp_path)
    assert piped.returncode == 2 and max(len(line) for line in piped.stderr.splitlines()) > 300, piped.stderr
    master, slave = pty.openpty()
    env = {**os.environ, "COLUMNS": "60"}
    proc = subprocess.run(args, stdin=slave, stdout=slave, stderr=slave, env=env, cwd=tmp_path)
    os.close(slave)
    out = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the child's side is closed and everything is read
            break
        if not chunk:
            break
        out += chunk
    os.close(master)
    lines = out.decode().replace("\r\n", "\n").rstrip("\n").split("\n")
    assert proc.returncode == 2 and len(lines) > 3, lines
    assert all(len(line) <= 60 for line in lines if " " in line.strip()), lines  # a word longer than 60 stays whole
    assert re.sub(r"\s+", " ", " ".join(lines)) == re.sub(r"\s+", " ", piped.stderr.strip())  # the same words
