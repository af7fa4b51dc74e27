"""Pipelines on the real cluster (`hpc-train submit --after`): a pretrain preempted once, then its evaluation, then a
fine-tune from its final checkpoint, each started by Slurm once the stages before it ended; a stage that fails for
good cancels the run queued after it with the reason in its journal, and its resume brings both back."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from conftest import (
    HPC_TRAIN,
    RUN_ARGS,
    high_job_preempting,
    read_events,
    run,
    sacct_state,
    submit,
    wait_finished,
    wait_until,
)

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("no_node_left_drained")]

# One node, one rank: the stages after the pretrain are as small as a run gets (a rank's start is ~3 CPU-s).
SMALL = ["cluster=dev", "cluster.partition=low", "cluster.nodes=1", "cluster.tasks_per_node=1"]
EVAL = Path(__file__).parent / "scripts" / "eval_stage.py"


def sacct_times(job_ids: list[str], env: dict[str, str]) -> dict[str, tuple[str, str]]:
    """job id -> (Start, End) of its last record (ISO times sort as text)."""
    out = run(["sacct", "-X", "-n", "-P", "-o", "JobID,Start,End", "-j", ",".join(job_ids)], env=env).stdout
    return {j: (s, e) for j, s, e in (line.split("|") for line in out.splitlines() if line.count("|") == 2)}


def status(path: Path, env: dict[str, str]) -> str:
    proc = run([HPC_TRAIN, "status", str(path)], env=env)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_pretrain_preempted_once_then_evaluate_then_fine_tune(slurm_env: dict[str, str], tmp_path: Path) -> None:
    out = f"out_dir={tmp_path}"
    # 0.4 s a step: after its step-20 checkpoint it runs 8 s more, for `status` and the preemption to find it running
    pre, pre_job = submit(
        [*RUN_ARGS, out, "name=pretrain", "train.steps=40", "train.min_step_time_s=0.4"], env=slurm_env
    )
    ev, ev_job = submit(
        [*SMALL, out, "name=eval", "--after", f"{pre}:any"]
        + ["--", sys.executable, str(EVAL), "--ckpt", "{after.ckpt}", "--out", "{run_dir}/eval.json"],
        env=slurm_env,
    )
    ft, ft_job = submit(
        [*SMALL, out, "name=finetune", "train.steps=10", f"--after={pre},{ev}", f"checkpoint.init_from={pre}"],
        env=slurm_env,
    )
    wait_until(lambda: any(e["event"] == "checkpoint_committed" for e in read_events(pre)), 120, "a checkpoint")
    chain = status(tmp_path, slurm_env)
    assert f"eval-1: after pretrain-1:any (RUNNING, job {pre_job})" in chain
    assert f"finetune-1: after pretrain-1:ok (RUNNING, job {pre_job}), eval-1:ok (PENDING, job {ev_job})" in chain
    high_job_preempting(slurm_env, [])(pre_job)  # the stages after it stay pending through its requeue
    wait_until(lambda: any(e["event"] == "requeue" for e in read_events(pre)), 120, "the pretrain's requeue")
    print(f"$ hpc-train status {tmp_path}\n{status(tmp_path, slurm_env)}")  # docs/submitting.md shows one

    summary = wait_finished(ft, ft_job, slurm_env, timeout_s=300)
    assert [e["reason"] for e in read_events(pre) if e["event"] == "requeue"] == ["preempt"]
    assert [sacct_state(j, slurm_env) for j in (pre_job, ev_job)] == ["COMPLETED", "COMPLETED"]
    times = sacct_times([pre_job, ev_job, ft_job], slurm_env)
    assert times[pre_job][1] <= times[ev_job][0] and times[ev_job][1] <= times[ft_job][0], times  # in order
    final = pre / "checkpoints" / "step_000040"
    assert json.loads((ev / "eval.json").read_text()) == {"ckpt": str(final), "step": 40}
    start = next(e for e in read_events(ft) if e["event"] == "start")
    assert start["init_from"] == {"path": str(final), "step": 40, "optimizer": False}
    assert summary["final_step"] == 10
    done = status(tmp_path, slurm_env)
    print(f"$ hpc-train status {tmp_path}\n{done}")
    assert "finetune-1: after pretrain-1:ok (COMPLETED), eval-1:ok (COMPLETED)" in done


def test_a_failed_stage_cancels_the_run_after_it_with_the_reason_and_its_resume_brings_both_back(
    slurm_env: dict[str, str], tmp_path: Path
) -> None:
    out = f"out_dir={tmp_path}"
    fault = ["requeue.max_failures=0", "+cluster.env.HPC_TRAIN_FAULT=raise_at_start"]  # attempt 0 only
    # held until the run after it is queued: it fails within seconds of its start, and a submit --after a stage
    # that already stopped for good is refused (test_pipeline), not queued to be cancelled
    bad, bad_job = submit(
        [*SMALL, out, "name=bad", "train.steps=10", *fault, "+cluster.sbatch_extra.hold=''"], env=slurm_env
    )
    nxt, nxt_job = submit([*SMALL, out, "name=next", "train.steps=5", "--after", str(bad)], env=slurm_env)
    assert run(["scontrol", "release", bad_job], env=slurm_env).returncode == 0
    wait_until(lambda: any(e["event"] == "stopped" for e in read_events(nxt)), 180, "the run after it told")
    stopped = next(e for e in read_events(nxt) if e["event"] == "stopped")
    reason = (
        f"cancelled before it started: bad-1, which it runs after, stopped for good: failure budget spent: 0 failure "
        f"requeues in a row without a newer checkpoint (requeue.max_failures=0); `hpc-train resume {bad}` queues it "
        f"again, and this run after it"
    )
    assert (stopped["reason"], stopped["upstream"], stopped["by"]) == (reason, str(bad), "pipeline")
    wait_until(lambda: sacct_state(nxt_job, slurm_env) == "CANCELLED", 60, "the run after it CANCELLED")
    said = status(nxt, slurm_env)
    print(f"$ hpc-train status {nxt}\n{said}")
    assert "next-1: cancelled before it started: bad-1, which it runs after, stopped for good" in said.replace("\n", "")
    assert "next-1: after bad-1:ok (stopped)" in said  # its journal says so: Slurm is not asked
    wait_until(lambda: sacct_state(bad_job, slurm_env) == "FAILED", 60, "the stage's job FAILED")

    proc = run([HPC_TRAIN, "resume", str(bad)], env=slurm_env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    print(f"$ hpc-train resume {bad}\n{proc.stdout}")
    bad_new = next(line for line in proc.stdout.splitlines() if line.startswith("resumed as job")).split()[3]
    again = next(line for line in proc.stdout.splitlines() if line.startswith("next-1, which never started"))
    nxt_new = again.split()[-1]
    assert run(["scontrol", "release", bad_new], env=slurm_env).returncode == 0  # its frozen sbatch_extra holds it
    wait_finished(nxt, nxt_new, slurm_env, timeout_s=240)
    assert sacct_state(bad_new, slurm_env) == "COMPLETED"
    times = sacct_times([bad_new, nxt_new], slurm_env)
    assert times[bad_new][1] <= times[nxt_new][0], times
    resumed = [e for e in read_events(nxt) if e["event"] == "resume"]
    assert [(e["previous_job_id"], e["job_id"]) for e in resumed] == [(nxt_job, nxt_new)]
