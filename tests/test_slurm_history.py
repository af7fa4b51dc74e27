"""The site's history read back (history.py): real jobs on the dev cluster end each way a job ends, and
history.site_rates counts each kind once, from sacct and from an hpc_train run's journal."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from conftest import HPC_TRAIN, RUN_ARGS, read_events, run, submit, wait_until

from hpc_train import history

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("no_node_left_drained")]


def sbatch(env: dict[str, str], node: str, *args: str, partition: str = "low") -> str:
    proc = run(["sbatch", "--parsable", "-p", partition, "-w", node, "-o", "/dev/null", *args], env=env)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def runs_of(job: str, env: dict[str, str]) -> list[str]:
    """sacct's state of each run of the job, in order (--duplicates: a requeued job has a record per run)."""
    out = run(["sacct", "-X", "-n", "-P", "--duplicates", "-j", job, "-o", "State"], env=env).stdout
    return [line.split()[0] for line in out.splitlines() if line.split()]


def running(job: str, env: dict[str, str]) -> bool:
    return run(["squeue", "-h", "-j", job, "-o", "%T"], env=env).stdout.strip() == "RUNNING"


def test_a_history_made_by_real_jobs_is_read_back_by_kind(
    slurm_env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On `low` (1-2 nodes): a job past its --time=1 (TIMEOUT), one killed (FAILED), one that completes, one
    cancelled, one requeued by `scontrol requeue`, one whose node is set DOWN (NODE_FAIL; Slurm requeues it), one
    preempted by a `high` job on its node (PREEMPTED; requeued); and an hpc_train run preempted by `hpc-train chaos`
    (its journal: one preemption; sacct calls it REQUEUED). The reruns are cancelled at the end."""
    began, env = time.time(), slurm_env
    # node1, node2: the hpc_train run, away from node3 (set DOWN) and node4 (the `high` job takes it whole)
    run_dir, run_job = submit(
        [*RUN_ARGS, f"out_dir={tmp_path / 'runs'}", "name=hist", "cluster.nodelist='node[1-2]'"], env=env
    )
    jobs = {
        "timeout": sbatch(env, "node1", "--time=1", "--wrap", "sleep 300"),
        "failed": sbatch(env, "node1", "--wrap", "sleep 2; kill -KILL $$"),
        "completed": sbatch(env, "node1", "--wrap", "true"),
        "cancelled": sbatch(env, "node2", "--wrap", "sleep 300"),
        "requeued": sbatch(env, "node2", "--wrap", "sleep 300"),
        "node_fail": sbatch(env, "node3", "--wrap", "sleep 300"),
        "preempted": sbatch(env, "node4", "--wrap", "sleep 300"),
    }
    reruns = ("requeued", "node_fail", "preempted")
    wait_until(lambda: all(running(jobs[k], env) for k in ("cancelled", *reruns)), 60, "the sleep jobs to run")
    try:
        assert run(["scancel", jobs["cancelled"]], env=env).returncode == 0
        assert run(["scontrol", "requeue", jobs["requeued"]], env=env).returncode == 0
        proc = run(["scontrol", "update", "NodeName=node3", "State=DOWN", "Reason=hpc_train-history"], env=env)
        assert proc.returncode == 0, proc.stderr
        sbatch(env, "node4", "-N1", "--exclusive", "--wrap", "sleep 2", partition="high")
        wait_until(lambda: any(e["event"] == "checkpoint_committed" for e in read_events(run_dir)), 120, "a commit")
        assert run([HPC_TRAIN, "chaos", str(run_dir), "preempt"], env=env).returncode == 0
        wait_until(lambda: (run_dir / "summary.json").exists(), 240, "the hpc_train run to finish after its requeue")
        # Slurm ends a job past its limit at its next check (~30 s); preempts after GraceTime=30 s (+ a check)
        wait_until(lambda: runs_of(jobs["timeout"], env) == ["TIMEOUT"], 120, "the TIMEOUT")
        wait_until(lambda: all(running(jobs[k], env) for k in reruns), 120, "the requeued jobs to run again")
    finally:
        run(["scontrol", "update", "NodeName=node3", "State=RESUME"], env=env)  # ReturnToService=2 may have already
        node3 = lambda: set(run(["sinfo", "-h", "-n", "node3", "-o", "%t"], env=env).stdout.split())  # noqa: E731
        wait_until(lambda: node3() and node3() <= {"idle", "mix", "alloc"}, 30, "node3 to respond again")
        run(["scancel", *(jobs[k] for k in reruns)], env=env)
    ended = {"requeued": "REQUEUED", "node_fail": "NODE_FAIL", "preempted": "PREEMPTED"}
    wait_until(
        lambda: (
            all(runs_of(jobs[k], env) == [ended[k], "CANCELLED"] for k in reruns)
            and runs_of(run_job, env) == ["REQUEUED", "COMPLETED"]
            and runs_of(jobs["failed"], env) == ["FAILED"]
        ),
        60,
        "accounting to hold every run",
    )
    monkeypatch.setenv("SLURM_CONF", env["SLURM_CONF"])
    rates = history.site_rates(
        "low", 1, runs_dir=tmp_path / "runs", window_days=1, min_jobs=1, min_node_hours=0, min_fault_s=0
    )
    print(rates.describe(1))
    counts = {k: getattr(rates, k) for k in history.KINDS}
    assert counts == {"preemptions": 2, "time_limits": 1, "requeues": 1, "node_failures": 1, "failures": 1}, rates
    assert (rates.jobs, rates.source, rates.note) == (8, "both", "")
    # after the scontrol requeue, the NODE_FAIL, the preemption and the hpc_train run's own requeue: at least
    # cred_expire=10 s each (a requeued job starts no sooner)
    assert len(rates.queue_waits_s) == 4 and min(rates.queue_waits_s) >= 10, rates.queue_waits_s
    ours = history.from_journals([run_dir])
    assert {k: getattr(ours, k) for k in history.KINDS} == {**dict.fromkeys(history.KINDS, 0), "preemptions": 1}
    assert ours.jobs == 1 and len(ours.queue_waits_s) == 1
    # node-hours: at least the TIMEOUT's 60 s, the killed job's 2 s and the run's attempts on 2 nodes; at most
    # every job on its nodes for the whole test
    low, high = 62 + ours.node_hours * 3600, (len(jobs) + 2) * (time.time() - began)
    assert low <= rates.node_hours * 3600 <= high, (low, rates.node_hours * 3600, high)
    thin = history.site_rates("low", 1, runs_dir=tmp_path / "runs", window_days=1)
    assert thin.source == "defaults" and thin.thin == (
        "8 jobs in 1 day on partition low: using the defaults (fewer than 10 jobs)"
    )
