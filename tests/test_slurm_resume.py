"""`hpc-train resume` on the real cluster: a cancelled run comes back as a new job under the same run
directory, its attempts numbered on from the first job's, and ends with the uninterrupted run's weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import (
    HPC_TRAIN,
    RUN_ARGS,
    names,
    read_events,
    run,
    sacct_state,
    submit,
    wait_finished,
    wait_until,
)

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("no_node_left_drained")]


def test_cancelled_job_resumes_as_a_new_job(slurm_env: dict[str, str], tmp_path: Path, reference: dict) -> None:
    # 1 s a step (the reference's 0.25 s sleeps longer, weights alike): after the first checkpoint the job runs 40 s
    # more, not 10, so the two commands before the cancel find it running on loaded cores too (at load average
    # ~50 it had finished first).
    run_dir, job_id = submit([*RUN_ARGS, "train.min_step_time_s=1", f"out_dir={tmp_path}", "name=res"], env=slurm_env)
    wait_until(lambda: any(e["event"] == "checkpoint_committed" for e in read_events(run_dir)), 120, "a checkpoint")
    busy = run([HPC_TRAIN, "resume", str(run_dir)], env=slurm_env)
    assert busy.returncode == 2 and names(busy.stderr, "res-1", "RUNNING", f"(job {job_id})", "nothing to resume")
    assert run([HPC_TRAIN, "cancel", str(run_dir)], env=slurm_env).returncode == 0
    wait_until(lambda: sacct_state(job_id, slurm_env) == "CANCELLED", 120, f"job {job_id} CANCELLED")

    proc = run([HPC_TRAIN, "resume", str(run_dir), "--reason", "slurm test"], env=slurm_env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert names(proc.stdout, "res-1 stopped because cancelled")
    new_id = next(line for line in proc.stdout.splitlines() if line.startswith("resumed as job")).split()[3]
    assert new_id != job_id
    summary = wait_finished(run_dir, new_id, slurm_env, timeout_s=300)
    assert summary["params_sha256"] == reference["params_sha256"]
    events = read_events(run_dir)
    assert [(e["restart"], e["job_id"]) for e in events if e["event"] == "start"] == [(0, job_id), (1, new_id)]
    rows = json.loads(run([HPC_TRAIN, "status", str(run_dir), "--json"], env=slurm_env).stdout)
    assert [(r["job_id"], r["state"], r["attempts"]) for r in rows] == [(new_id, "COMPLETED", 2)]
