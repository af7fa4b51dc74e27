"""checkpoint.every_steps=auto on the dev cluster (issue 30's proof): the site's history is made by real jobs, read
back by history.py at submit (sacct), and the runs' `interval` events say what each chose from it."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest
from conftest import HPC_TRAIN, read_events, run, submit, wait_finished, wait_until

from hpc_train import history, intervals, journal
from hpc_train.metrics import read_metrics
from hpc_train.paths import RunPaths

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("no_node_left_drained")]

# 1 node, 1 task, 40 steps of 0.25 s: the first save at step 20 (auto's provisional interval), then a choice
AUTO_ARGS = [
    "cluster=dev",
    "cluster.nodes=1",
    "cluster.tasks_per_node=1",
    "train.steps=40",
    "train.min_step_time_s=0.25",
    "checkpoint.every_steps=auto",
    "checkpoint.history_min_jobs=3",  # the few jobs of a test: the default (10) would call it thin
]


def sbatch(env: dict[str, str], *args: str) -> str:
    proc = run(["sbatch", "--parsable", "-o", "/dev/null", *args], env=env)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def states(jobs: list[str], env: dict[str, str]) -> list[str]:
    out = run(["sacct", "-X", "-n", "-P", "--duplicates", "-j", ",".join(jobs), "-o", "State"], env=env).stdout
    return [line.split()[0] for line in out.splitlines() if line.split()]


def node_failures(
    env: dict[str, str], node: str, partition: str, count: int, run_s: float, requeue: bool = False
) -> list[str]:
    """`count` one-CPU jobs on `node` (4 CPUs) that run run_s, then the node set DOWN: NODE_FAIL each, and the node
    back. requeue: Slurm runs them again (sacct measures the queue wait after a requeue), and they are cancelled
    once they do; else --no-requeue."""
    again = [] if requeue else ["--no-requeue"]
    jobs = [sbatch(env, "-p", partition, "-w", node, "-n1", *again, "--wrap", "sleep 300") for _ in range(count)]
    running = lambda: run(["squeue", "-h", "-j", ",".join(jobs), "-t", "R", "-o", "%i"], env=env).stdout.split()  # noqa: E731
    wait_until(lambda: len(running()) == count, 60, f"{count} jobs running on {node}")
    time.sleep(run_s)
    try:
        proc = run(["scontrol", "update", f"NodeName={node}", "State=DOWN", "Reason=hpc_train-goodput"], env=env)
        assert proc.returncode == 0, proc.stderr
        wait_until(lambda: states(jobs, env).count("NODE_FAIL") == count, 60, "the jobs to end NODE_FAIL")
    finally:
        run(["scontrol", "update", f"NodeName={node}", "State=RESUME"], env=env)
        up = lambda: set(run(["sinfo", "-h", "-n", node, "-o", "%t"], env=env).stdout.split())  # noqa: E731
        wait_until(lambda: up() and up() <= {"idle", "mix", "alloc"}, 30, f"{node} to respond again")
    if requeue:  # cred_expire=10 s: a requeued job starts no sooner
        wait_until(lambda: len(running()) == count, 60, f"the {count} jobs to run again")
        run(["scancel", *jobs], env=env)
    return jobs


def chosen(run_dir: Path) -> dict:
    """The run's last `interval` event chosen from a measured save (not the provisional first one)."""
    return [e for e in read_events(run_dir) if e["event"] == "interval" and not e["provisional"]][-1]


def test_auto_saves_more_often_on_a_partition_with_a_fault_heavy_history(slurm_env: dict[str, str], tmp_path: Path):
    """On `low`: 4 jobs whose node went DOWN (NODE_FAIL: 4 unannounced faults in seconds of node-time). On `high`: 4
    jobs that completed. The same run with every_steps=auto on each, at once (node1, node2): on `low` it saves every
    few steps, on `high` (no fault: too thin to tell from the defaults, 1 per 5,000 node-hours) hardly ever."""
    env, began = slurm_env, time.time()
    node_failures(env, "node3", "low", 4, run_s=5)
    clean = [sbatch(env, "-p", "high", "-w", "node4", "-n1", "--wrap", "sleep 5") for _ in range(4)]
    wait_until(lambda: states(clean, env) == ["COMPLETED"] * 4, 60, "the clean jobs to complete")
    # the window: this test's jobs, not those earlier tests ran on this cluster
    window = f"checkpoint.history_window_days={(time.time() - began + 60) / 86400:.6f}"
    runs = {
        p: submit(
            [*AUTO_ARGS, window, f"cluster.partition={p}", f"cluster.nodelist={n}", f"out_dir={tmp_path / p}"], env
        )
        for p, n in (("low", "node1"), ("high", "node2"))
    }
    for run_dir, job in runs.values():
        wait_finished(run_dir, job, env)
    heavy, calm = chosen(runs["low"][0]), chosen(runs["high"][0])
    print(f"low: {heavy['why']}\nhigh: {calm['why']}")
    assert heavy["every_steps"] < 20 < calm["every_steps"], (heavy, calm)
    faults = [e["inputs"]["disk"]["faults_per_h"] for e in (heavy, calm)]
    assert faults[0] > 100 * faults[1], faults  # 4 in ~20 node-s against the defaults' 1 in 5,000 node-hours


# The storm: one unannounced fault (`hpc-train chaos RUN kill-rank`: a crash; the run requeues itself) in every
# MTBF_S of the run's wall time, at a seeded place in it: faults at the rate the forecast assumes, with the count
# fixed by the run's length (a Poisson count of ~4 would move the goodput by +-15 points from one seed to the next)
STORM_ARGS = [
    "cluster=dev",
    "cluster.partition=low",
    "cluster.nodes=1",
    "cluster.tasks_per_node=2",  # the rank left decides the requeue (a lone rank killed ends the job FAILED)
    "train.min_step_time_s=0.25",
    "checkpoint.every_steps=auto",
    "checkpoint.history_min_jobs=3",
    "requeue.max_failures=50",
]


def storm(env: dict[str, str], run_dir: Path, mtbf_s: float, seed: int) -> list[float]:
    """Kill rank 1 once in every mtbf_s of wall time since the run's first launch, at a seeded uniform place in each
    slot; a fault due while no attempt trains waits for the next one's first step (a queued job cannot fail, and
    the fault then costs a restart, as one during a restart does in the model). Returns the faults' times."""
    rng, done = random.Random(seed), []
    launched = wait_until(
        lambda: next((e for e in read_events(run_dir) if e["event"] == "start"), None), 120, "a start"
    )
    t0, slot = launched.get("launched_at", launched["time"]), 0
    while not (run_dir / "summary.json").exists():
        due = t0 + (slot + rng.random()) * mtbf_s
        slot += 1
        while time.time() < due and not (run_dir / "summary.json").exists():
            time.sleep(0.2)
        training = lambda: _training(read_events(run_dir)) or (run_dir / "summary.json").exists()  # noqa: E731
        wait_until(training, 120, "an attempt to train")
        if (run_dir / "summary.json").exists():
            break
        proc = run([HPC_TRAIN, "chaos", str(run_dir), "kill-rank", "--rank", "1"], env=env)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        done.append(time.time() - t0)
        wait_until(lambda: not _training(read_events(run_dir)), 60, "the killed attempt to end")
    return done


def _training(events: list[dict]) -> bool:
    """The newest attempt took its first step and has not ended."""
    now = [e for e in events if e.get("restart") == max((e.get("restart", 0) for e in events), default=0)]
    names = {e["event"] for e in now}
    return journal.FIRST_STEP in names and not names & {journal.FAIL, journal.REQUEUE, journal.FINISH}


def test_a_seeded_storm_realises_the_goodput_forecast_at_its_submit(slurm_env: dict[str, str], tmp_path: Path):
    """The project: a clean run on `low` (what a step, a save and a start-up cost here, for the forecast) and the
    site's history there, 4 node failures in ~4 minutes of node-time (14 one-CPU jobs of 15 s on the 4 nodes, the
    node-failed ones requeued: the queue wait after a requeue too). The storm run's submit forecasts its goodput
    from them (history.json: the rates and the numbers); faults then come at that rate. The run's committed time
    (journal.goodput, what report shows) over its wall time, queue waits included as the forecast's restarts include
    them, is within 5 points of the forecast (2026-12-06: 73.2% against 77.6%, 3 faults in 210 s)."""
    env, began, out = slurm_env, time.time(), tmp_path / "runs"
    ref_dir, ref_job = submit(
        [*STORM_ARGS, "cluster.nodelist=node1", "train.steps=80", f"out_dir={out}", "name=ref"], env
    )
    fill = [
        sbatch(env, "-p", "low", "-w", n, "-n1", "--wrap", "sleep 15") for n in ["node1"] * 2 + ["node2", "node4"] * 4
    ]
    node_failures(env, "node3", "low", 4, run_s=15, requeue=True)
    wait_finished(ref_dir, ref_job, env)
    wait_until(lambda: states(fill, env) == ["COMPLETED"] * len(fill), 60, "the history's clean jobs")
    window = f"checkpoint.history_window_days={(time.time() - began + 60) / 86400:.6f}"
    run_dir, job = submit([*STORM_ARGS, "train.steps=600", window, f"out_dir={out}", "name=storm"], env)
    frozen = json.loads(RunPaths(run_dir).history.read_text())
    rates = history.Rates(**{**frozen["rates"], "queue_waits_s": tuple(frozen["rates"]["queue_waits_s"])})
    forecast = intervals.forecast_expected(RunPaths(run_dir).history, run_dir)
    assert forecast is not None and rates.source != "defaults", frozen
    mtbf_s = 3600 / rates.unannounced_per_h(1)
    faults = storm(env, run_dir, mtbf_s, seed=2026)
    wait_finished(run_dir, job, env, timeout_s=300)
    parts = journal.goodput(journal.read(run_dir), read_metrics(run_dir))
    wall = parts["allocated"] + parts["queue_wait"]
    realised = {"allocation": parts["goodput"], "wall": parts["committed"] / wall}
    chosen = [e for e in read_events(run_dir) if e["event"] == "interval"]
    print(f"forecast {forecast}; {rates.describe(1)}; faults at {[round(f) for f in faults]} s (1 per {mtbf_s:.0f} s)")
    print(f"realised {realised}; parts {parts}; intervals {[(e['restart'], e['every_steps']) for e in chosen]}")
    assert len(faults) >= 3, faults
    assert abs(realised["wall"] - forecast.goodput) <= 0.05, (realised, forecast)
