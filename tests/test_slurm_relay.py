"""The batch shell's signal relay on the real cluster: a TERM that reaches only the batch shell.

Slurm 22.05's srun turns a SIGTERM it receives into SIGKILL for every task (src/srun/libsrun/srun_job.c,
_srun_signal_mgr: "case SIGTERM: ... launch_g_fwd_signal(SIGKILL)"), so the relay must not pass TERM on.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import RUN_ARGS, names, read_events, run, sacct_state, submit, wait_until

from hpc_train import sbatch

pytestmark = pytest.mark.slurm


def test_term_to_batch_shell_only_saves_and_resumes(slurm_env: dict[str, str], tmp_path: Path, reference: dict) -> None:
    """`scancel --batch --signal=TERM` (as a site's --signal=B:TERM@lead) reaches only the batch shell.
    The ranks must still save at a step boundary, requeue and resume exactly."""
    run_dir, job_id = submit([*RUN_ARGS, f"out_dir={tmp_path}", "name=batchterm"], env=slurm_env)
    wait_until(
        lambda: any(e["event"] == "checkpoint_committed" for e in read_events(run_dir)),
        120,
        "the first committed checkpoint",
    )
    proc = run(["scancel", "--batch", "--signal=TERM", job_id], env=slurm_env)
    assert proc.returncode == 0, proc.stderr

    def ended() -> str:  # summary.json, or a job that ended unrequeued (SIGKILLed ranks): fail at once
        if (run_dir / "summary.json").exists():
            return "finished"
        state = sacct_state(job_id, slurm_env)
        return state if state in ("FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY") else ""

    how = wait_until(ended, 300, f"job {job_id} to finish")
    events = read_events(run_dir)
    log = run_dir / "submitit" / f"{job_id}_0_log.out"
    log_text = log.read_text() if log.exists() else ""
    assert how == "finished", (
        f"job {job_id} ended {how} without summary.json; events: "
        f"{[(e['event'], e['step'], e['restart']) for e in events]}; log tail:\n"
        + "\n".join(log_text.splitlines()[-15:])
    )
    wait_until(lambda: sacct_state(job_id, slurm_env) == "COMPLETED", 60, f"job {job_id} COMPLETED in sacct")
    summary = json.loads((run_dir / "summary.json").read_text())

    assert names(log_text, "hpc_train relay:", "got SIGTERM", "sent SIGUSR2 to srun")
    assert log_text.count("==== hpc_train attempt 0 rank 0 ====") == 1  # stdout and stderr are one file here
    signals = [e for e in events if e["event"] == "signal"]
    assert [e["signals"] for e in signals] == [["SIGUSR2"]]
    stop_saves = [e for e in events if e["event"] == "checkpoint_committed" and e["reason"] == "stop"]
    assert [e["step"] for e in stop_saves] == [signals[0]["step"]]
    requeues = [e for e in events if e["event"] == "requeue"]
    assert len(requeues) == 1 and requeues[0]["by"] == "hpc_train"
    assert requeues[0]["reason"] == "preempt"  # far from the time limit: an external stop, not the clock
    starts = [e for e in events if e["event"] == "start"]
    assert [s["restart"] for s in starts] == [0, 1] and starts[1]["step"] == signals[0]["step"]
    assert summary["params_sha256"] == reference["params_sha256"]


def test_a_stopped_task_after_the_relaunch_marker_is_killed_and_the_step_relaunched(
    slurm_env: dict[str, str], tmp_path: Path
) -> None:
    """Issue 20 on Slurm 22.05: task 0 of the first step writes the relaunch marker and exits 145, task 1 stops
    itself (SIGSTOP, as a rank that never exits). The batch step's relay (hpc_train/relay.py) gives the step HPC_TRAIN_STEP_END_S,
    then TERMs srun, whose SIGKILL ends the stopped task too; the step is relaunched and the job completes."""
    relay = "\n".join(sbatch.relay_lines())
    folder = tmp_path / "submitit"
    folder.mkdir()
    (tmp_path / "step.sh").write_text(
        'if [ "$SLURM_STEP_ID" = 0 ]; then\n'
        '  [ "$SLURM_PROCID" = 0 ] || kill -STOP $$\n'
        '  echo "--nodes=2 --ntasks=2" > "$1/.relaunch-$SLURM_JOB_ID"; exit 145\n'
        "fi\n"
        'echo "task $SLURM_PROCID of step $SLURM_STEP_ID"\n'
    )
    (tmp_path / "batch.sh").write_text(
        # the spares' export after the relay, as sbatch.py renders it (the relay unsets an inherited one)
        f"#!/bin/bash\nset -u\n{relay}\nexport HPC_TRAIN_STEP_ARGS='--nodes=2 --ntasks=2' HPC_TRAIN_STEP_END_S=3\n"
        f"srun bash {tmp_path}/step.sh {folder}\n"
    )
    log = tmp_path / "batch.log"
    sub = ["sbatch", "--parsable", "-p", "debug", "-N", "2", "-t", "3", "-o", str(log), str(tmp_path / "batch.sh")]
    proc = run(sub, env=slurm_env)
    assert proc.returncode == 0, proc.stderr
    job_id = proc.stdout.strip()
    try:
        state = wait_until(
            lambda: (s := sacct_state(job_id, slurm_env)) in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT") and s,
            120,
            f"job {job_id} to end",
        )
    finally:
        run(["scancel", job_id], env=slurm_env)
    text = log.read_text()
    assert state == "COMPLETED", text
    assert names(text, "did not end within 3 s of its relaunch marker", "sent srun SIGTERM")
    assert names(text, "relaunching it inside the allocation", "srun --nodes=2 --ntasks=2")
    assert sorted(line for line in text.splitlines() if line.startswith("task ")) == [
        "task 0 of step 1",
        "task 1 of step 1",
    ], text
