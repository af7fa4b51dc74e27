"""Preemption, requeue and failure paths on the real cluster. Every run that finishes must match the
uninterrupted reference bit for bit, and no node may be left drained."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import (
    HPC_TRAIN,
    RUN_ARGS,
    first_start,
    high_job_preempting,
    interrupted_run,
    names,
    read_events,
    run,
    sacct_state,
    submit,
    wait_until,
)

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("no_node_left_drained")]


def starts(events: list[dict]) -> list[int]:
    return [e["restart"] for e in events if e["event"] == "start"]


def test_external_scontrol_requeue(slurm_env: dict[str, str], tmp_path: Path, reference: dict) -> None:
    """An operator's `scontrol requeue`: Slurm stops the job (SIGTERM, then SIGKILL after KillWait)."""
    summary, events = interrupted_run(
        slurm_env, tmp_path, "ext", lambda job_id: run(["scontrol", "requeue", job_id], env=slurm_env)
    )
    assert summary["params_sha256"] == reference["params_sha256"]
    assert starts(events) == [0, 1]


def test_two_preemptions_in_a_row(slurm_env: dict[str, str], tmp_path: Path, reference: dict) -> None:
    # 0.5 s a step (weights alike): the second preemption lands between attempt 1's step-40 checkpoint and its last
    # step on loaded cores too (at 0.25 s, 4.5 s for a poll, an sbatch and Slurm's preemption)
    run_dir, job_id = submit(
        [*RUN_ARGS, "train.min_step_time_s=0.5", f"out_dir={tmp_path}", "name=twice"], env=slurm_env
    )
    preempt = high_job_preempting(slurm_env, [])
    for restart in (0, 1):
        wait_until(
            lambda: any(e["event"] == "checkpoint_committed" and e["restart"] == restart for e in read_events(run_dir)),
            120,
            f"a checkpoint in attempt {restart}",
        )
        preempt(job_id)
    wait_until(lambda: (run_dir / "summary.json").exists(), 300, "the end of the third attempt")
    events = read_events(run_dir)
    assert starts(events) == [0, 1, 2]
    assert [e["reason"] for e in events if e["event"] == "requeue"] == ["preempt", "preempt"]
    assert json.loads((run_dir / "summary.json").read_text())["params_sha256"] == reference["params_sha256"]
    # Each stop save replaced the previous one: at most keep_last=2 periodic + the newest are left.
    assert len(list((run_dir / "checkpoints").glob("step_*"))) <= 3


def test_rank_killed_during_save_resumes_from_previous(
    slurm_env: dict[str, str], tmp_path: Path, reference: dict
) -> None:
    """SIGKILL of the last rank in the middle of the second save: that folder never gets its marker,
    the other ranks fail on the dead peer, the failure budget requeues, and the next attempt resumes
    from the first (committed, background-written) checkpoint."""
    run_dir, job_id = submit(
        [*RUN_ARGS, f"out_dir={tmp_path}", "name=killed", "+cluster.env.HPC_TRAIN_FAULT=kill_rank_during_save"],
        env=slurm_env,
    )
    wait_until(lambda: (run_dir / "summary.json").exists(), 300, "the run to recover and finish")
    events = read_events(run_dir)
    assert starts(events) == [0, 1]
    assert [e["reason"] for e in events if e["event"] == "requeue"] == ["failure"]
    resumed = [e for e in events if e["event"] == "start"][1]
    assert resumed["step"] == 20 and resumed["resumed_from"].endswith("step_000020")
    assert json.loads((run_dir / "summary.json").read_text())["params_sha256"] == reference["params_sha256"]
    wait_until(lambda: sacct_state(job_id, slurm_env) == "COMPLETED", 60, "COMPLETED")


def test_crash_loop_stops_after_failure_budget(slurm_env: dict[str, str], tmp_path: Path) -> None:
    run_dir, job_id = submit(
        [
            *RUN_ARGS,
            f"out_dir={tmp_path}",
            "name=crash",
            "requeue.max_failures=1",
            "+cluster.env.HPC_TRAIN_FAULT=raise_at_start_always",
        ],
        env=slurm_env,
    )
    wait_until(lambda: any(e["event"] == "stopped" for e in read_events(run_dir)), 180, "the run to give up")
    events = read_events(run_dir)
    stopped = next(e for e in events if e["event"] == "stopped")
    assert names(stopped["reason"], "failure budget spent", "1 failure requeues", "requeue.max_failures=1")
    assert [e["reason"] for e in events if e["event"] == "requeue"] == ["failure"]
    assert {e["restart"] for e in events if e["event"] == "fail"} == {0, 1}
    wait_until(lambda: sacct_state(job_id, slurm_env) == "FAILED", 60, "the job to end FAILED")
    log = "".join(p.read_text() for p in (run_dir / "submitit").glob("*_log.out"))
    assert "not requeueing: failure budget spent" in log


def test_array_task_preempted_while_siblings_run(slurm_env: dict[str, str], tmp_path: Path) -> None:
    """Two trials, each a whole node (--exclusive, 2 tasks); a `high` job takes one trial's node only. The
    trials differ only in their step-time floor, so the sibling is the victim's uninterrupted twin. Not
    2 tasks x 2 CPUs: 4 ranks of 2 intra-op threads on the machine's 2 cores spun in each other's way, 15
    CPU-s a rank and 156 s for the test."""
    proc = run(
        [
            HPC_TRAIN,
            "submit",
            "-m",
            *RUN_ARGS,
            f"out_dir={tmp_path}",
            "name=arr",
            "cluster.nodes=1",
            "cluster.tasks_per_node=2",
            "cluster.exclusive=true",
            "train.min_step_time_s=0.25,0.26",
        ],
        env=slurm_env,
        timeout_s=120,
    )
    assert proc.returncode == 0, proc.stderr
    manifest = json.loads(next(tmp_path.glob("arr-*/sweep.json")).read_text())
    victim, sibling = (Path(t["run_dir"]) for t in manifest["trials"])
    wait_until(
        lambda: all(any(e["event"] == "checkpoint_committed" for e in read_events(d)) for d in (victim, sibling)),
        240,  # two jobs start, import torch and rendezvous: 120 s ran out at load 20-40 (a deadline, not a figure)
        "both trials past their first checkpoint",
    )
    node = first_start(victim)["nodes"][0]
    assert node != first_start(sibling)["nodes"][0]
    high_job_preempting(slurm_env, [], nodes=node)(manifest["trials"][0]["job_id"])
    wait_until(lambda: all((d / "summary.json").exists() for d in (victim, sibling)), 300, "both trials to finish")
    assert starts(read_events(victim)) == [0, 1] and starts(read_events(sibling)) == [0]
    assert [e["reason"] for e in read_events(victim) if e["event"] == "requeue"] == ["preempt"]
    assert first_start(victim)["job_id"] == manifest["trials"][0]["job_id"]  # "<array>_<task>"
    twin = json.loads((sibling / "summary.json").read_text())
    assert json.loads((victim / "summary.json").read_text()) == twin


def test_a_time_limit_shortened_after_the_start_is_judged_the_time_limit(
    slurm_env: dict[str, str], tmp_path: Path
) -> None:
    """An administrator's `scontrol update TimeLimit=` (like sbatch --time-min or --deadline) ends the job
    long before the frozen cluster.timeout_min=10: its USR2 is the time-limit warning (signal_lead_s left,
    a stop save, the time-limit budget), not a preemption (30 s, the preemption budget). With no
    time-limit requeue left the run stops and says why."""
    import math

    from hpc_train.slurm import parse_key_values, time_limit_min

    run_dir, job_id = submit(
        [
            *RUN_ARGS,
            "cluster.partition=debug",
            "train.steps=2000",
            "requeue.max_time_limit_requeues=0",
            f"out_dir={tmp_path}",
            "name=shortened",
        ],
        env=slurm_env,
    )
    try:
        wait_until(lambda: any(e["event"] == "checkpoint_committed" for e in read_events(run_dir)), 120, "a checkpoint")
        job = parse_key_values(run(["scontrol", "show", "job", "-o", job_id], env=slurm_env).stdout)
        # 150-210 s from now: the 90 s warning comes within ~2 min, far inside the frozen 10 min
        limit = math.ceil(time_limit_min(job["RunTime"]) + 2.5)
        proc = run(["scontrol", "update", f"JobId={job_id}", f"TimeLimit={limit}"], env=slurm_env)
        assert proc.returncode == 0, proc.stderr
        decided = lambda: any(e["event"] in ("stopped", "requeue") for e in read_events(run_dir))  # noqa: E731
        wait_until(decided, 240, "the run's requeue-or-stop decision")
    finally:
        run(["scancel", job_id], env=slurm_env)
    events = read_events(run_dir)
    signal = next(e for e in events if e["event"] == "signal")
    assert signal["signals"] == ["SIGUSR2"] and signal["reason"] == "time_limit", signal
    assert 40 < signal["left_s"] <= 90, signal  # signal_lead_s, or less when the end came nearer
    assert any(e["event"] == "checkpoint_committed" and e["reason"] == "stop" for e in events)
    stopped = next(e for e in events if e["event"] == "stopped")
    assert stopped["reason"].startswith("time_limit budget spent"), stopped
    assert not any(e["event"] == "requeue" for e in events)
