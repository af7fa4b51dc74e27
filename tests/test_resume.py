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

from hpc_train.checkpoint import Saver, TrainState, step_dir
from hpc_train.config import CheckpointConfig, RunConfig
from hpc_train.preempt import Unrecoverable

from conftest import HPC_TRAIN, read_events, run, submit, wait_until


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
    assert str(e.value) == (
        f"checkpoint.init_from={folder}: model.weight is [8, 8] in the checkpoint but [16, 8] here; model.bias is "
        f"[8] in the checkpoint but [16] here; build the model that checkpoint was trained with (its run's "
        f"config.yaml), or drop checkpoint.init_from")
    shard = folder / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-1] + b"x")
    with pytest.raises(Unrecoverable, match=r"does not verify: __0_0.distcp checksum differs from the manifest; "
                                            r"submit again with another committed step folder"):
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
    from hpc_train.ops import process_identity

    run_dir, job_id = submit([f"out_dir={tmp_path}", "name=cut", *ARGS, "train.min_step_time_s=0.2", "--no-wait"])
    wait_until(lambda: any(e["event"] == "checkpoint_committed" for e in read_events(run_dir)), 120, "a checkpoint")
    busy = run([HPC_TRAIN, "resume", str(run_dir)])
    assert busy.returncode == 2 and busy.stderr.startswith(
        f"hpc-train resume: error: cut-1 is still running (local controller pid {job_id}): there is nothing to "
        f"resume; follow it with hpc-train logs -f {run_dir}, or stop it first with hpc-train cancel {run_dir}")
    assert run([HPC_TRAIN, "cancel", str(run_dir)]).returncode == 0
    wait_until(lambda: process_identity(int(job_id)) is None, 120, "the cancelled run's controller to exit")

    proc = run([HPC_TRAIN, "resume", str(run_dir), "--max-failures", "5", "--reason", "cancelled by mistake"],
               timeout_s=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout.splitlines()
    stop = next(e for e in read_events(run_dir) if e["event"] == "checkpoint_committed" and e["reason"] == "stop")
    assert out[:3] == [
        "cut-1 stopped because cancelled (scancel or hpc-train cancel): not requeueing",
        "budgets: preemptions 0/unlimited, time-limit requeues 0/100, failures in a row 0/5 (raised now)",
        f"resuming from {stop['path']}, its newest committed checkpoint (verified when the job starts; an older one "
        f"if it does not verify)"]
    new_id = out[3].split()[3]
    assert out[3] == f"resumed as job {new_id} (attempt 1); run directory {run_dir}" and new_id != job_id
    assert json.loads((run_dir / "summary.json").read_text()) == json.loads((reference / "summary.json").read_text())

    events = read_events(run_dir)
    resume = next(e for e in events if e["event"] == "resume")
    assert (resume["restart"], resume["step"], resume["reason"], resume["budgets"], resume["previous_job_id"]) == (
        1, stop["step"], "cancelled by mistake", {"max_failures": 5}, job_id)
    assert "@" in resume["by"]
    assert [(e["restart"], e["step"]) for e in events if e["event"] == "start"] == [(0, 0), (1, stop["step"])]
    rows = json.loads(run([HPC_TRAIN, "status", str(run_dir), "--json"]).stdout)
    assert [(r["job_id"], r["state"], r["attempts"], r["warnings"]) for r in rows] == [(new_id, "COMPLETED", 2, [])]
    assert json.loads((run_dir / "submission.json").read_text())["previous_job_ids"] == [job_id]

    again = run([HPC_TRAIN, "resume", str(run_dir)])
    assert again.returncode == 2 and again.stderr == (
        f"hpc-train resume: error: cut-1 finished at step 30: there is nothing to resume. To train on from its "
        f"weights, start a new run: hpc-train submit checkpoint.init_from={run_dir} ...\n")


def test_resume_of_a_run_that_spent_its_failure_budget(tmp_path: Path) -> None:
    """A crash at every start with requeue.max_failures=0 stops the run at once. Resume says why, and the
    budget it raises is the one the job then decides with: one failure requeue, then a stop at 1/1."""
    proc = run([HPC_TRAIN, "submit", f"out_dir={tmp_path}", *ARGS, "requeue.max_failures=0",
                "+cluster.env.HPC_TRAIN_FAULT=raise_at_start_always"], timeout_s=240)
    assert proc.returncode == 1
    run_dir = tmp_path / "demo-1"
    bad = run([HPC_TRAIN, "resume", str(run_dir), "--max-failures", "-3"])
    assert bad.returncode == 2 and bad.stderr == (
        "hpc-train resume: error: --max-failures -3: a budget is a count >= 0; e.g. --max-failures 4\n")
    proc = run([sys.executable, "-X", "importtime", "-m", "hpc_train.cli", "resume", str(run_dir), "--max-failures",
                "1"], timeout_s=240)
    assert "torch" not in {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if "|" in line}
    assert proc.returncode == 1 and proc.stdout.splitlines()[:4] == [
        "demo-1 stopped because failure budget spent: 0 failure requeues in a row without a newer checkpoint "
        "(requeue.max_failures=0)",
        "budgets: preemptions 0/unlimited, time-limit requeues 0/100, failures in a row 0/1 (raised now)",
        "no committed checkpoint: starting again from step 0",
        f"resumed as job {proc.stdout.split('resumed as job ')[1].split()[0]} (attempt 1); run directory {run_dir}"]
    events = read_events(run_dir)
    assert [(e["event"], e["restart"]) for e in events if e["event"] in ("resume", "requeue", "stopped")] == [
        ("stopped", 0), ("resume", 1), ("requeue", 1), ("stopped", 2)]
    stopped = [e["reason"] for e in events if e["event"] == "stopped"]
    assert stopped[-1] == "failure budget spent: 1 failure requeues in a row without a newer checkpoint (requeue.max_failures=1)"
    assert (run_dir / "config.yaml").read_text().count("max_failures: 0") == 1  # the frozen config, as submitted


def test_init_from_starts_a_new_run_from_the_source_weights(tmp_path: Path, reference: Path) -> None:
    """The new run's first loss (step 1, before its first update) is the source's final weights' loss on
    the new run's first batch, computed here from the source checkpoint: the weights came through exactly."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from hpc_train import data
    from hpc_train.config import DataConfig, ModelConfig
    from hpc_train.model import GPT

    run_dir, _ = submit([f"out_dir={tmp_path}", "name=ft", *ARGS, "train.steps=5", "train.log_every_steps=1",
                         f"checkpoint.init_from={reference}"])
    source = reference / "checkpoints" / "step_000030"
    assert f"init_from: {source}\n" in (run_dir / "config.yaml").read_text()  # frozen as the step folder
    start = next(e for e in read_events(run_dir) if e["event"] == "start")
    assert (start["step"], start["resumed_from"], start["init_from"]) == (
        0, None, {"path": str(source), "step": 30, "optimizer": False})

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
    assert wrong.returncode == 2 and wrong.stderr == (
        f"hpc-train submit: error: checkpoint.init_from={reference}: model.d_model=128 but the checkpoint has 64 "
        f"(its run's {reference}/config.yaml); set model.d_model=64, or drop checkpoint.init_from to train from "
        f"scratch\n")
    empty = tmp_path / "empty"
    empty.mkdir()
    none = run([HPC_TRAIN, "submit", f"out_dir={tmp_path}", f"checkpoint.init_from={empty}"])
    assert none.returncode == 2 and none.stderr == (
        f"hpc-train submit: error: checkpoint.init_from={empty}: no committed checkpoint under {empty} (no "
        f"step_*/COMMITTED); give a run directory that saved one, or one of its step folders\n")
    assert list(tmp_path.iterdir()) == [empty]  # nothing written, nothing queued
