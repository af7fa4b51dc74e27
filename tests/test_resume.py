"""Resume and reuse: `hpc-train resume RUN` (a stopped run again, same identity) and checkpoint.init_from
(a new run from another run's checkpoint). In-process tests use the real Saver on a 1-rank gloo group;
the rest run `hpc-train` as a user would, on the local executor."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from conftest import HPC_TRAIN, fake_clients, names, read_events, refused, run, submit, wait_until

from hpc_train import journal
from hpc_train.checkpoint import Saver, TrainState, step_dir
from hpc_train.config import CheckpointConfig, RunConfig
from hpc_train.preempt import Unrecoverable


@pytest.fixture(scope="module")
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def trained(seed: int, width: int = 8) -> TrainState:
    torch.manual_seed(seed)
    model = torch.nn.Linear(8, width)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):
        model(torch.randn(4, 8)).pow(2).sum().backward()
        opt.step()
    return TrainState(model, opt, step=40, tokens_seen=1234)


def source_checkpoint(tmp_path: Path) -> tuple[TrainState, Path]:
    """A committed checkpoint at step 40 of a 'source run'."""
    state = trained(seed=0)
    saver = Saver(tmp_path / "src" / "checkpoints", CheckpointConfig(), tmp_path / "drills", lambda *a, **k: None, 0.0)
    saver.save(state, "final", background=False)
    return state, step_dir(tmp_path / "src" / "checkpoints", 40)


def attempt_from(run_dir: Path, **checkpoint: Any) -> Any:
    from hpc_train.attempt import Attempt
    from hpc_train.env import RankEnv
    from hpc_train.paths import RunPaths

    env = RankEnv("local", 0, 0, 1, 1, 0, 1, ("127.0.0.1",), "127.0.0.1", 0, "1", 0)
    cfg = RunConfig(checkpoint=CheckpointConfig(**checkpoint))
    return Attempt.build(env, cfg, RunPaths(run_dir), time.time(), {})


@pytest.mark.parametrize("with_optimizer", [False, True])
def test_init_from_loads_weights_at_step_0(tmp_path: Path, one_rank_group: Any, with_optimizer: bool) -> None:
    src, folder = source_checkpoint(tmp_path)
    new_dir = tmp_path / "new"
    new_dir.mkdir()
    at, state = attempt_from(new_dir, init_from=str(folder), init_from_optimizer=with_optimizer), trained(seed=1)
    state.step, state.tokens_seen = 0, 0
    fresh_optim = {k: v.clone() for k, v in state.optimizer.state[state.model.weight].items()}
    assert not torch.equal(state.model.weight, src.model.weight)
    assert at.resume(state) is False  # a new run: nothing of its own resumed
    assert all(torch.equal(a, b) for a, b in zip(state.model.state_dict().values(), src.model.state_dict().values()))
    assert (state.step, state.tokens_seen) == (0, 0)
    moments = state.optimizer.state[state.model.weight]
    want = src.optimizer.state[src.model.weight] if with_optimizer else fresh_optim
    assert all(torch.equal(moments[k], want[k]) for k in ("exp_avg", "exp_avg_sq", "step"))
    start = next(e for e in read_events(new_dir) if e["event"] == "start")
    assert start["step"] == 0 and start["resumed_from"] is None
    assert start["init_from"] == {"path": str(folder), "step": 40, "optimizer": with_optimizer}


def test_init_from_refuses_other_shapes_and_a_damaged_source(tmp_path: Path, one_rank_group: Any) -> None:
    _, folder = source_checkpoint(tmp_path)
    (tmp_path / "new").mkdir()
    at = attempt_from(tmp_path / "new", init_from=str(folder))
    with pytest.raises(Unrecoverable) as e:
        at.resume(trained(seed=1, width=16))
    assert names(
        str(e.value),
        f"checkpoint.init_from={folder}: ",
        "model.weight is [8, 8]",
        "[16, 8] here",
        "model.bias is [8]",
        "[16] here",
        "config.yaml",
        "drop checkpoint.init_from",
    )
    shard = folder / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-1] + b"x")
    with pytest.raises(
        Unrecoverable,
        match=r"does not verify: __0_0.distcp checksum differs from the manifest; "
        r"submit again with another committed step folder",
    ):
        attempt_from(tmp_path / "new", init_from=str(folder)).resume(trained(seed=1))


# ---- the command line, on the local executor ------------------------------------------------------------

ARGS = ["train.steps=30", "checkpoint.every_steps=10", "cluster.tasks_per_node=2"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted run: what a resumed one must match, and the source of init_from runs."""
    run_dir, _ = submit([f"out_dir={tmp_path_factory.mktemp('ref')}", "name=ref", *ARGS])
    assert (run_dir / "summary.json").exists()
    return run_dir


def test_resume_of_a_cancelled_run_finishes_as_an_uninterrupted_one(tmp_path: Path, reference: Path) -> None:
    from hpc_train.runs import process_identity

    run_dir, job_id = submit([f"out_dir={tmp_path}", "name=cut", *ARGS, "train.min_step_time_s=0.2", "--no-wait"])
    wait_until(lambda: any(e["event"] == "checkpoint_committed" for e in read_events(run_dir)), 120, "a checkpoint")
    busy = run([HPC_TRAIN, "resume", str(run_dir)])
    assert refused(
        busy,
        "resume",
        "cut-1 is still running",
        f"pid {job_id}",
        f"hpc-train logs -f {run_dir}",
        f"hpc-train cancel {run_dir}",
    )
    assert run([HPC_TRAIN, "cancel", str(run_dir)]).returncode == 0
    wait_until(lambda: process_identity(int(job_id)) is None, 120, "the cancelled run's controller to exit")

    proc = run(
        [HPC_TRAIN, "resume", str(run_dir), "--max-failures", "5", "--reason", "cancelled by mistake"], timeout_s=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout.splitlines()
    stop = next(e for e in read_events(run_dir) if e["event"] == "checkpoint_committed" and e["reason"] == "stop")
    assert names(out[0], "cut-1 stopped", "cancelled", "not requeueing")
    assert names(out[1], "preemptions 0/unlimited", "time-limit requeues 0/100", "failures in a row 0/5 (raised now)")
    assert names(out[2], f"resuming from {stop['path']}", "newest committed checkpoint")
    new_id = out[3].split()[3]
    assert names(out[3], f"job {new_id}", "(attempt 1)", f"run directory {run_dir}") and new_id != job_id
    assert json.loads((run_dir / "summary.json").read_text()) == json.loads((reference / "summary.json").read_text())

    events = read_events(run_dir)
    resume = next(e for e in events if e["event"] == "resume")
    assert (resume["restart"], resume["step"], resume["reason"], resume["budgets"], resume["previous_job_id"]) == (
        1,
        stop["step"],
        "cancelled by mistake",
        {"max_failures": 5},
        job_id,
    )
    assert "@" in resume["by"]
    assert [(e["restart"], e["step"]) for e in events if e["event"] == "start"] == [(0, 0), (1, stop["step"])]
    rows = json.loads(run([HPC_TRAIN, "status", str(run_dir), "--json"]).stdout)
    assert [(r["job_id"], r["state"], r["attempts"], r["warnings"]) for r in rows] == [(new_id, "COMPLETED", 2, [])]
    assert json.loads((run_dir / "submission.json").read_text())["previous_job_ids"] == [job_id]

    again = run([HPC_TRAIN, "resume", str(run_dir)])
    assert refused(again, "resume", "cut-1 finished at step 30", f"hpc-train submit checkpoint.init_from={run_dir}")


def test_resume_of_a_run_that_spent_its_failure_budget(tmp_path: Path) -> None:
    """A crash at every start with requeue.max_failures=0 stops the run at once. Resume says why, and the
    budget it raises is the one the job then decides with: one failure requeue, then a stop at 1/1."""
    proc = run(
        [
            HPC_TRAIN,
            "submit",
            f"out_dir={tmp_path}",
            *ARGS,
            "requeue.max_failures=0",
            "+cluster.env.HPC_TRAIN_FAULT=raise_at_start_always",
        ],
        timeout_s=240,
    )
    assert proc.returncode == 1
    run_dir = tmp_path / "demo-1"
    bad = run([HPC_TRAIN, "resume", str(run_dir), "--max-failures", "-3"])
    assert refused(bad, "resume", "--max-failures -3", ">= 0", "e.g. --max-failures 4")
    proc = run(
        [
            sys.executable,
            "-X",
            "importtime",
            "-m",
            "hpc_train.cli",
            "resume",
            str(run_dir),
            "--max-failures",
            "1",
            "--max-excluded-nodes",
            "3",
        ],
        timeout_s=240,
    )
    assert "torch" not in {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if "|" in line}
    out = proc.stdout.splitlines()
    assert proc.returncode == 1 and len(out) >= 4, proc.stdout
    assert names(out[0], "demo-1 stopped", "failure budget spent", "0 failure requeues", "requeue.max_failures=0")
    assert names(out[1], "preemptions 0/unlimited", "time-limit requeues 0/100", "failures in a row 0/1 (raised now)")
    assert names(out[2], "no committed checkpoint", "step 0")
    assert names(out[3], "resumed as job ", "(attempt 1)", f"run directory {run_dir}")
    events = read_events(run_dir)
    assert [(e["event"], e["restart"]) for e in events if e["event"] in ("resume", "requeue", "stopped")] == [
        ("stopped", 0),
        ("resume", 1),
        ("requeue", 1),
        ("stopped", 2),
    ]
    assert next(e for e in events if e["event"] == "resume")["budgets"] == {"max_failures": 1, "max_excluded_nodes": 3}
    stopped = [e["reason"] for e in events if e["event"] == "stopped"]
    assert names(stopped[-1], "failure budget spent", "1 failure requeues in a row", "requeue.max_failures=1")
    assert (run_dir / "config.yaml").read_text().count("max_failures: 0") == 1  # the frozen config, as submitted


def test_init_from_starts_a_new_run_from_the_source_weights(tmp_path: Path, reference: Path) -> None:
    """The new run's first loss (step 1, before its first update) is the source's final weights' loss on
    the new run's first batch, computed here from the source checkpoint: the weights came through exactly."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from hpc_train import data
    from hpc_train.config import DataConfig, ModelConfig
    from hpc_train.model import GPT

    run_dir, _ = submit(
        [
            f"out_dir={tmp_path}",
            "name=ft",
            *ARGS,
            "train.steps=5",
            "train.log_every_steps=1",
            f"checkpoint.init_from={reference}",
        ]
    )
    source = reference / "checkpoints" / "step_000030"
    # Pinned at submit: hardlinked into the run (the source's retention cannot take it), the original named
    pinned = next((run_dir / "init_from").glob("*/step_000030"))
    assert f"init_from: {pinned}\n" in (run_dir / "config.yaml").read_text()  # frozen as the pinned step folder
    assert json.loads((pinned.parent / "source.json").read_text()) == {"init_from": str(source)}
    assert sorted(p.name for p in pinned.iterdir()) == sorted(p.name for p in source.iterdir())
    assert all((pinned / p.name).stat().st_ino == p.stat().st_ino for p in source.iterdir())
    start = next(e for e in read_events(run_dir) if e["event"] == "start")
    assert (start["step"], start["resumed_from"], start["init_from"]) == (
        0,
        None,
        {"path": str(pinned), "step": 30, "optimizer": False},
    )

    dcp_to_torch_save(source, tmp_path / "source.pt")
    model = GPT(ModelConfig())
    model.load_state_dict(torch.load(tmp_path / "source.pt", weights_only=True)["model"])
    losses = []
    for dp_rank in (0, 1):  # each rank's sampler starts at position 0 and reads its share
        x, y = data.open_sampler(DataConfig(), 32, 256).next_batch(dp_rank, 2, 8)
        with torch.no_grad():
            losses.append(model(x, y).double().item())
    first = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert first["step"] == 1 and math.isclose(first["loss"], sum(losses) / 2, rel_tol=1e-6)
    assert first["loss"] < math.log(256) - 1  # trained weights: far below a fresh model's ~ln(256)


def test_init_from_is_checked_at_submit(tmp_path: Path, reference: Path) -> None:
    wrong = run([HPC_TRAIN, "submit", f"out_dir={tmp_path}", f"checkpoint.init_from={reference}", "model.d_model=128"])
    assert refused(
        wrong,
        "submit",
        f"checkpoint.init_from={reference}: ",
        "model.d_model=128",
        "has 64",
        f"{reference}/config.yaml",
        "set model.d_model=64",
        "drop checkpoint.init_from",
    )
    empty = tmp_path / "empty"
    empty.mkdir()
    none = run([HPC_TRAIN, "submit", f"out_dir={tmp_path}", f"checkpoint.init_from={empty}"])
    assert refused(
        none, "submit", f"checkpoint.init_from={empty}: ", f"no committed checkpoint under {empty}", "step_*/COMMITTED"
    )
    assert list(tmp_path.iterdir()) == [empty]  # nothing written, nothing queued


# ---- resume's guards: one resume at a time, the live controller of a sweep's trial, hosts ----------------


def stopped_local_run(run_dir: Path, process: dict[str, Any] | None = None) -> Path:
    """A local run that was cancelled at step 5 and whose controller is gone (a pid nothing runs as)."""
    import yaml

    from hpc_train import journal
    from hpc_train.config import compose_trials

    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(compose_trials([["train.steps=10"]])[0][0]))
    (run_dir / "submission.json").write_text(
        json.dumps({"executor": "local", "job_id": "1", "process": process or {"start_time": 1, "boot_id": "gone"}})
    )
    journal.log(run_dir, "start", 0, "1", 0)
    journal.log(run_dir, "stopped", 5, "1", 0, reason="cancelled")
    return run_dir


# The real command, with sbatch (here the local controller's start) taking 3 s: the window two resumes race in.
SLOW_SBATCH = """import os, sys, time
from hpc_train import resume
class Job:
    job_id = str(os.getpid())
class Executor:
    def submit(self, fn, run_dir):
        time.sleep(3.0)
        return Job()
resume.make_executor = lambda *a, **k: Executor()
from hpc_train.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_two_resumes_at_once_queue_one_job(tmp_path: Path) -> None:
    """Before: both saw a stopped run and both queued it (two jobs training into one run directory)."""
    import subprocess

    run_dir = stopped_local_run(tmp_path / "demo-1")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", SLOW_SBATCH, "resume", str(run_dir), "--no-wait"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outs = [(p.wait(timeout=60), *p.communicate()) for p in procs]
    queued = [o for o in outs if o[0] == 0]
    lost = [o for o in outs if o[0] != 0]
    assert len(queued) == 1 and len(lost) == 1, outs
    code, err = lost[0][0], lost[0][2]
    assert code == 2 and err.startswith("hpc-train resume: error: demo-1 is ") and err.count("\n") == 1, lost
    # the other command's resume under way, or the run it queued already running
    assert ("another hpc-train command" in err and f"hpc-train status {run_dir}" in err) or "still running" in err, lost
    assert [e["event"] for e in read_events(run_dir)].count("resume") == 1


def test_resume_of_a_running_local_sweep_trial_is_refused(tmp_path: Path) -> None:
    """Before: a local sweep recorded its trial's controller only once the trial ended, so resume saw no
    live process and started a second copy of a training trial. A local sweep runs its trials inside the
    submit command, which holds the sweep's lock until the last one ends: resume says so."""
    import subprocess

    from hpc_train.runs import process_identity

    driver = subprocess.Popen(
        [HPC_TRAIN, "submit", "-m", f"out_dir={tmp_path}", "name=sw", "train.steps=400", "train.min_step_time_s=0.1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    trial = tmp_path / "sw-1" / "0000"
    try:
        wait_until(lambda: any(e["event"] == "start" for e in read_events(trial)), 120, "the trial to start")
        recorded = json.loads((tmp_path / "sw-1" / "sweep.json").read_text())["trials"][0]
        assert recorded["job_id"] and recorded["process"] == process_identity(int(recorded["job_id"]))
        busy = run([HPC_TRAIN, "resume", str(trial)])
        assert refused(busy, "resume", f"{tmp_path / 'sw-1'} is being submitted or resumed", "another hpc-train")
    finally:
        driver.kill()
        driver.wait()
        run([HPC_TRAIN, "cancel", str(trial)])
    pid = int(json.loads((tmp_path / "sw-1" / "sweep.json").read_text())["trials"][0]["job_id"])
    wait_until(lambda: process_identity(pid) is None, 120, "the cancelled trial's controller to exit")


def test_submit_keeps_the_job_id_a_resume_recorded(tmp_path: Path) -> None:
    """The sweep's submit driver saves sweep.json after each trial: a trial resumed meanwhile keeps its new
    job id (before: the driver wrote back the id it knew, and status/cancel lost the resumed job)."""
    from hpc_train import plan, submit

    sweep = tmp_path / "sw-1"
    sweep.mkdir()
    p = plan.Plan(
        sweep,
        [plan.Trial(0, ["a=1"], str(sweep / "0000"), "11"), plan.Trial(1, ["a=2"], str(sweep / "0001"), "12")],
        [],
        [],
    )
    submit._save_manifest(p, ["a=1,2"])
    manifest = json.loads((sweep / "sweep.json").read_text())
    manifest["trials"][0].update(job_id="77", previous_job_ids=["11"])  # what resume writes
    (sweep / "sweep.json").write_text(json.dumps(manifest))
    p.trials[1].job_id = "13"
    submit._save_manifest(p, ["a=1,2"])
    trials = json.loads((sweep / "sweep.json").read_text())["trials"]
    assert [(t["job_id"], t.get("previous_job_ids")) for t in trials] == [("77", ["11"]), ("13", None)]
    assert p.trials[0].job_id == "77"


def test_resume_refuses_another_hosts_local_run_and_keeps_sweep_json_mode(tmp_path: Path) -> None:
    elsewhere = stopped_local_run(tmp_path / "far-1", {"start_time": 1, "boot_id": "b", "host": "node-far"})
    proc = run([HPC_TRAIN, "resume", str(elsewhere)])
    import socket

    assert refused(
        proc,
        "resume",
        "far-1 ran on host node-far",
        f"({socket.gethostname()})",
        f"hpc-train resume {elsewhere} on node-far",
    )

    sweep = tmp_path / "sw-1"
    trial = stopped_local_run(sweep / "0000")
    (trial / "submission.json").unlink()
    (sweep / "sweep.json").write_text(
        json.dumps(
            {
                "sweep_dir": str(sweep),
                "overrides": [],
                "arrays": [],
                "trials": [{"index": 0, "overrides": [], "run_dir": str(trial), "job_id": "1"}],
            }
        )
    )
    (sweep / "sweep.json").chmod(0o640)
    proc = run([sys.executable, "-c", SLOW_SBATCH.replace("3.0", "0"), "resume", str(trial)])
    assert proc.returncode == 0, proc.stderr
    assert (sweep / "sweep.json").stat().st_mode & 0o777 == 0o640  # before: rewritten 0644
    saved = json.loads((sweep / "sweep.json").read_text())["trials"][0]
    assert saved["previous_job_ids"] == ["1"] and saved["process"]["host"] == socket.gethostname()


def test_resume_of_a_folder_without_runs_says_so(tmp_path: Path) -> None:
    proc = run([HPC_TRAIN, "resume", str(tmp_path)])
    # before: IndexError's traceback
    assert refused(
        proc, "resume", f"{tmp_path} is not a run directory", "sweep.json", "e.g. runs/demo-1", "hpc-train status"
    )


def slurm_run_dir(tmp_path: Path) -> Path:
    import yaml

    from hpc_train import journal
    from hpc_train.config import compose_trials

    run_dir = tmp_path / "sl-1"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(yaml.safe_dump(compose_trials([["cluster=slurm"]])[0][0]))
    (run_dir / "submission.json").write_text(json.dumps({"executor": "slurm", "job_id": "100"}))
    journal.log(run_dir, "stopped", 5, "100", 0, reason="cancelled")
    return run_dir


FAKE_SLURM = {  # the clients' command lines, as a cluster answers them; $STATE holds what sbatch queued
    "squeue": """case "$*" in
  *--name*) cat "$STATE/queued" 2>/dev/null;;
  *) echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1;;
esac""",
    "sacct": """printf '100|CANCELLED by 1000\\n'""",
    "sbatch": """n=$(cat "$STATE/sbatch_calls" 2>/dev/null || echo 0); echo $((n + 1)) > "$STATE/sbatch_calls"
case "$(sed -n "$((n + 1))p" "$STATE/script")" in
  queued_then_timeout) echo 555 >> "$STATE/queued"; echo "sbatch: error: Socket timed out on send/recv operation" >&2; exit 1;;
  down) echo "sbatch: error: Batch job submission failed: Unable to contact slurm controller" >&2; exit 1;;
  *) echo "Submitted batch job 556";;
esac""",
}


@pytest.fixture
def fake_slurm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """sbatch, squeue and sacct answering as a cluster would where a real one cannot be made to (an sbatch
    that queued the job and then timed out); validate_live is tested on the real cluster."""
    import os

    from hpc_train import resume

    bin_dir, state = fake_clients(tmp_path, FAKE_SLURM)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setattr(resume, "validate_live", lambda *a, **k: None)
    monkeypatch.setattr(resume.time, "sleep", lambda s: None)  # sbatch's 1, 2, 4 s backoff
    return state


def test_resume_retry_adopts_the_job_a_timed_out_sbatch_queued(tmp_path: Path, fake_slurm: Path) -> None:
    """sbatch timed out but queued job 555: the retry finds it by name (100, recorded, is not it) instead of
    queueing a second copy, and writes the pickle submitit never renamed into place (before: two jobs, and the
    run recorded the second; then, adopted without its pickle, the job waited 60 s for it and failed)."""
    from hpc_train import resume

    (fake_slurm / "script").write_text("queued_then_timeout\nok\n")
    run_dir = slurm_run_dir(tmp_path)
    job, lines = resume.resume(run_dir, {})
    assert (job.job_id, (fake_slurm / "sbatch_calls").read_text().strip()) == ("555", "1")
    record = json.loads((run_dir / "submission.json").read_text())
    assert (record["job_id"], record["previous_job_ids"]) == ("555", ["100"])
    assert [(e["event"], e["job_id"]) for e in read_events(run_dir) if e["event"] == "resume"] == [("resume", "555")]
    assert (run_dir / "submitit" / "555_submitted.pkl").is_file()


def test_resume_event_only_once_sbatch_succeeded(tmp_path: Path, fake_slurm: Path) -> None:
    """A resume that queued nothing leaves no `resume` event (before: one, which reset the run's budgets
    and attempt count for a job that never existed)."""
    from hpc_train import resume, slurm

    (fake_slurm / "script").write_text("down\n" * 4)
    run_dir = slurm_run_dir(tmp_path)
    with pytest.raises(slurm.SlurmError, match="sbatch failed 4 times"):
        resume.resume(run_dir, {})
    assert [e["event"] for e in read_events(run_dir)] == ["stopped"]


def test_resume_refuses_when_squeue_cannot_answer_though_accounting_says_cancelled(
    tmp_path: Path, fake_slurm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Accounting says CANCELLED while the controller may still show the job COMPLETING, its ranks saving in
    KillWait: with squeue unanswered, resume refuses rather than start a second job on the run (adversarial
    review: status's sacct fallback had reached resume)."""
    from hpc_train import resume, slurm

    (fake_slurm.parent / "fakebin" / "squeue").write_text(
        "#!/bin/sh\necho 'slurm_load_jobs error: Unable to contact slurm controller (connect failure)' >&2\nexit 1\n"
    )
    monkeypatch.setattr(slurm.time, "sleep", lambda s: None)
    run_dir = slurm_run_dir(tmp_path)
    with pytest.raises(slurm.SlurmError, match="cannot tell whether job 100 of sl-1 is still queued or running"):
        resume.resume(run_dir, {})
    assert not (fake_slurm / "sbatch_calls").exists()
    assert [e["event"] for e in read_events(run_dir)] == ["stopped"]


def test_job_states_asks_squeue_first_and_sacct_for_the_rest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pending array task is pending by its own id (squeue -r), though accounting may not know it yet;
    sacct answers only for what slurmctld no longer holds."""
    from hpc_train import slurm

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "squeue").write_text(
        f'#!/bin/sh\necho "$@" >> {tmp_path}/calls\n'
        "case \"$*\" in *-r*) printf '123_4|PENDING\\n123_5|PENDING\\n';; "
        "*) printf '123_[4-5]|PENDING\\n';; esac\n"
    )
    (bin_dir / "sacct").write_text(
        f"#!/bin/sh\necho sacct \"$@\" >> {tmp_path}/calls\nprintf '99|CANCELLED by 1000\\n'\n"
    )
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{__import__('os').environ['PATH']}")
    assert slurm.job_states(["123_4"]) == {"123_4": "PENDING"}
    assert "sacct" not in (tmp_path / "calls").read_text()
    assert slurm.job_states(["123_5", "99"]) == {"123_5": "PENDING", "99": "CANCELLED"}
    assert "sacct -X -n -P -j 99 " in (tmp_path / "calls").read_text()


def test_job_states_asks_sacct_when_squeue_cannot_answer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The controller down: accounting still says how a job ended (status showed it so when it asked sacct
    first); a job accounting does not know either is not taken as gone: squeue's error, so resume refuses."""
    from hpc_train import slurm

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "squeue").write_text(
        "#!/bin/sh\necho 'slurm_load_jobs error: Unable to contact slurm controller (connect failure)' >&2\nexit 1\n"
    )
    (bin_dir / "sacct").write_text("#!/bin/sh\nprintf '99|CANCELLED by 1000\\n'\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{__import__('os').environ['PATH']}")
    assert slurm.job_states(["99"], retries=0) == {"99": "CANCELLED"}
    with pytest.raises(slurm.SlurmError, match="Unable to contact slurm controller"):
        slurm.job_states(["99", "100"], retries=0)
    with pytest.raises(slurm.SlurmError, match="Unable to contact slurm controller"):  # resume's check
        slurm.job_states(["99"], retries=0, strict=True)


def test_a_resume_resets_failures_in_a_row_and_first_attempt_drills(monkeypatch: pytest.MonkeyPatch) -> None:
    """Resume is a person's word that the cause is fixed; and a resumed Slurm job (SLURM_RESTART_COUNT 0
    again) is attempt 1 of the run: a first-attempt drill does not fire again."""
    from hpc_train import preempt

    crash = [{"event": "requeue", "reason": "failure", "step": 0}] * 2
    assert journal.failures_in_a_row(crash) == 2
    assert journal.failures_in_a_row([*crash, {"event": "resume", "step": 0}]) == 0
    assert journal.failures_in_a_row([*crash, {"event": "resume", "step": 0}, *crash[:1]]) == 1
    monkeypatch.setenv("HPC_TRAIN_FAULT", "raise_at_start")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    monkeypatch.setenv("HPC_TRAIN_ATTEMPT", "1")
    assert not preempt.injected("raise_at_start")
    monkeypatch.setenv("HPC_TRAIN_ATTEMPT", "0")
    assert preempt.injected("raise_at_start")


INIT_FROM_RANK = """import sys, time
from datetime import timedelta
from pathlib import Path
import torch, torch.distributed as dist
from hpc_train import checkpoint
from hpc_train.checkpoint import Saver, TrainState
from hpc_train.config import CheckpointConfig
from hpc_train.preempt import Unrecoverable
rank, folder, port = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                        timeout=timedelta(seconds=20))
if rank == 1:  # the folder deleted between rank 0's look and rank 1's
    checkpoint.read_marker = lambda p: None
torch.manual_seed(1)
model = torch.nn.Linear(8, 8)
state = TrainState(model, torch.optim.AdamW(model.parameters()))
saver = Saver(Path(folder).parent, CheckpointConfig(init_from=folder), Path(folder).parent / "drills",
              lambda *a, **k: None, 0.0)
t0 = time.monotonic()
try:
    source, _, _ = saver.init_from(state)
    print(f"rank {rank}: loaded step {source['step']} in {time.monotonic() - t0:.1f} s", flush=True)
except Unrecoverable as e:
    print(f"rank {rank}: Unrecoverable {e}", flush=True)
# Leave together: a rank that exits while its peer's gloo threads still talk to it made the peer abort
# ("terminate called without an active exception", exit -6; 1 CI run in ~10).
dist.barrier()
dist.destroy_process_group()
"""


def test_init_from_ranks_agree_on_what_rank_0_read(tmp_path: Path, one_rank_group: Any) -> None:
    """Rank 0 reads the manifest and the DCP metadata and broadcasts them: a rank that would have seen the
    folder gone no longer raises alone while the others wait for it in a collective (before: rank 0 hung
    20 s in all_gather, then died of the timeout)."""
    import socket
    import subprocess

    _, folder = source_checkpoint(tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", INIT_FROM_RANK, str(r), str(folder), str(port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    outs = [p.communicate(timeout=120)[0] for p in ranks]
    assert [p.returncode for p in ranks] == [0, 0], outs
    assert [o.splitlines()[-1].split(" in ")[0] for o in outs] == ["rank 0: loaded step 40", "rank 1: loaded step 40"]


def test_resume_of_a_script_run_names_the_scripts_checkpoint_never_step_0(tmp_path: Path) -> None:
    """A script's checkpoints are its own: `resume` said "no committed checkpoint: starting again from step 0",
    then the script resumed from its file at step 40. It names the file script.checkpoint matches (and the
    resume_args), else what script_helper.committed() recorded, else says the script decides."""
    import dataclasses

    from hpc_train.resume import _script_resumes_from
    from hpc_train.script import ScriptConfig, ckpt_dir

    script = ScriptConfig(cmd=["python", "t.py"], checkpoint="{ckpt_dir}/ckpt*.pt", resume_args=["--resume"])
    cfg = dataclasses.replace(RunConfig(), script=script)
    assert "starts again from step 0" in _script_resumes_from(cfg, tmp_path, [])
    ckpt_dir(tmp_path).mkdir(parents=True)
    (ckpt_dir(tmp_path) / "ckpt40.pt").write_bytes(b"x")
    said = _script_resumes_from(cfg, tmp_path, [])
    assert str(ckpt_dir(tmp_path) / "ckpt40.pt") in said and "--resume" in said
    helper = dataclasses.replace(RunConfig(), script=ScriptConfig(cmd=["python", "t.py"]))
    events = [{"event": "checkpoint_committed", "step": 40, "path": "/x/ckpt.pt", "reason": "script"}]
    assert "/x/ckpt.pt (step 40)" in _script_resumes_from(helper, tmp_path, events)
    assert "step 0" not in _script_resumes_from(helper, tmp_path, [])
