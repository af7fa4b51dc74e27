"""Attempt-lifecycle faults on the real cluster that no single-fault test covered before: a signal in the
first second of a task, no `scontrol` inside the job, a node failure Slurm requeues by itself."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import (
    HPC_TRAIN,
    RUN_ARGS,
    high_job_preempting,
    names,
    read_events,
    run,
    sacct_state,
    submit,
    wait_finished,
    wait_until,
)

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("no_node_left_drained")]


def test_usr2_in_the_first_second_of_a_task_is_recorded_saved_and_budgeted(
    slurm_env: dict[str, str], tmp_path: Path, reference: dict
) -> None:
    """USR2 as soon as every task printed its first line: our handler must have it (start.py installs it
    before any import), not submitit's (which requeued without a save or a budget entry) and not the
    default action (which killed the task). Before, the first line came from submitit, before torch."""
    # 300 s to save, not `low`'s 30 s GraceTime (no preemption ends this job): the signal comes before torch's
    # import, and on a loaded CI machine the first step came over 30 s later, so the save rightly did not fit.
    early = [f"out_dir={tmp_path}", "name=early", "cluster.preempt_grace_s=300"]
    run_dir, job_id = submit([*RUN_ARGS, *early], env=slurm_env)
    logs = lambda: sorted((run_dir / "submitit").glob(f"{job_id}_*_log.out"))  # noqa: E731
    wait_until(lambda: len(logs()) == 2 and all(p.read_text().strip() for p in logs()), 120, "every task's first line")
    proc = run(["scancel", "--signal=USR2", job_id], env=slurm_env)
    assert proc.returncode == 0, proc.stderr
    summary = wait_finished(run_dir, job_id, slurm_env, timeout_s=300)
    assert summary["params_sha256"] == reference["params_sha256"]
    events = read_events(run_dir)
    signal = next(e for e in events if e["event"] == "signal")
    assert signal["restart"] == 0 and signal["signals"] == ["SIGUSR2"]
    assert [(e["reason"], e["by"]) for e in events if e["event"] == "requeue"] == [("preempt", "hpc_train")]
    stop = next(e for e in events if e["event"] == "checkpoint_committed" and e["reason"] == "stop")
    assert [e["step"] for e in events if e["event"] == "start"] == [0, stop["step"]]
    text = "".join(p.read_text() for p in logs())
    assert "Caught signal" not in text and "Traceback" not in text  # submitit's handler never ran


def test_no_scontrol_inside_the_job(slurm_env: dict[str, str], tmp_path: Path, reference: dict) -> None:
    """A container without Slurm's clients (here: PATH without them, for the ranks only). The stop path
    must not raise: a warning saves, records `requeue_failed` with the reason and ends the job cleanly;
    a preemption still comes back and finishes bit-exact."""
    no_clients = ["cluster.launcher=[env,'PATH=/nonexistent']"]
    # A preemption: our requeue fails, so the ranks wait for Slurm to kill the job at the end of its
    # GraceTime (30 s on `low`), which requeues it; had they exited, the job would have ended FAILED.
    preempted, preempted_id = submit([*RUN_ARGS, *no_clients, f"out_dir={tmp_path}", "name=preempted"], env=slurm_env)
    wait_until(lambda: any(e["event"] == "checkpoint_committed" for e in read_events(preempted)), 120, "a checkpoint")
    nodes = ",".join(next(e for e in read_events(preempted) if e["event"] == "start")["nodes"])
    high_job_preempting(slurm_env, [], nodes=nodes)(preempted_id)
    wait_until(lambda: any(e["event"] == "requeue_failed" for e in read_events(preempted)), 120, "the failed requeue")

    # Meanwhile, on the two other nodes (`debug`: nothing preempts it), a time-limit warning: it saves,
    # records `requeue_failed` with the reason and ends the job, no traceback.
    warned, warned_id = submit(
        [*RUN_ARGS, *no_clients, "cluster.partition=debug", f"out_dir={tmp_path}", "name=warned"], env=slurm_env
    )
    wait_until(lambda: any(e["event"] == "checkpoint_committed" for e in read_events(warned)), 120, "a checkpoint")
    assert run(["scancel", "--signal=USR2", warned_id], env=slurm_env).returncode == 0
    wait_until(lambda: sacct_state(warned_id, slurm_env) in ("FAILED", "COMPLETED"), 120, "the warned job to end")
    events = read_events(warned)
    assert [e["event"] for e in events if e["event"] in ("requeue", "requeue_failed", "stopped")] == ["requeue_failed"]
    assert events[-1]["fate"] == "unknown" and names(events[-1]["error"], "`scontrol`", "not on PATH")
    assert any(e["event"] == "checkpoint_committed" and e["reason"] == "stop" for e in events)
    rows = json.loads(run([HPC_TRAIN, "status", str(warned), "--json"], env=slurm_env).stdout)
    assert any(w.startswith("requeue failed: `scontrol` is not installed") for w in rows[0]["warnings"]), rows
    log = "".join(p.read_text() for p in (warned / "submitit").glob("*_log.out"))
    assert "requeue failed:" in log and "Traceback" not in log

    summary = wait_finished(preempted, preempted_id, slurm_env, timeout_s=300)
    assert summary["params_sha256"] == reference["params_sha256"]
    events = read_events(preempted)
    assert [e["event"] for e in events if e["event"] in ("requeue", "requeue_failed", "stopped")] == ["requeue_failed"]
    stop = next(e for e in events if e["event"] == "checkpoint_committed" and e["reason"] == "stop")
    assert [e["step"] for e in events if e["event"] == "start"] == [0, stop["step"]]


def test_a_node_failure_slurm_requeues_spends_no_budget(
    slurm_env: dict[str, str], tmp_path: Path, reference: dict
) -> None:
    """A node of the job goes DOWN: Slurm requeues the job by itself (--requeue). The ranks save and see
    Restarts already incremented: no second `scontrol requeue`, no budget spent (every budget is 0 here)."""
    run_dir, job_id = submit(
        [
            *RUN_ARGS,
            "requeue.max_preemptions=0",
            "requeue.max_failures=0",
            "requeue.max_time_limit_requeues=0",
            f"out_dir={tmp_path}",
            "name=nodefail",
        ],
        env=slurm_env,
    )
    wait_until(
        lambda: any(e["event"] == "checkpoint_committed" for e in read_events(run_dir)), 120, "the first checkpoint"
    )
    node = next(e for e in read_events(run_dir) if e["event"] == "start")["nodes"][1]
    try:
        proc = run(["scontrol", "update", f"NodeName={node}", "State=DOWN", "Reason=hpc_train-test"], env=slurm_env)
        assert proc.returncode == 0, proc.stderr
        summary = wait_finished(run_dir, job_id, slurm_env, timeout_s=300)
    finally:  # ReturnToService=2 brings a responding node back by itself; make sure
        if "down" in run(["sinfo", "-h", "-n", node, "-o", "%t"], env=slurm_env).stdout:
            run(["scontrol", "update", f"NodeName={node}", "State=RESUME"], env=slurm_env)
    assert summary["params_sha256"] == reference["params_sha256"]
    events = read_events(run_dir)
    assert [e["by"] for e in events if e["event"] == "requeue"] == ["slurm"]
    assert not [e for e in events if e["event"] in ("stopped", "requeue_failed")]
    assert [e["restart"] for e in events if e["event"] == "start"] == [0, 1]
