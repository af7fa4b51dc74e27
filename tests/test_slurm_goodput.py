"""checkpoint.every_steps=auto on the dev cluster (issue 30's proof): the site's history is made by real jobs, read
back by history.py at submit (sacct), and the runs' `interval` events say what each chose from it."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest
from conftest import HPC_TRAIN, PATIENCE, _stopped, read_events, run, submit, wait_finished, wait_until

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
    jobs that completed. One sweep over the two partitions with every_steps=auto, on node1: each trial reads its own
    partition's history (history.json `partitions`), so on `low` it saves every few steps, on `high` (no fault: too
    thin to tell from the defaults, 1 per 5,000 node-hours) hardly ever; submit says both forecasts."""
    env, began = slurm_env, time.time()
    node_failures(env, "node3", "low", 4, run_s=5)
    clean = [sbatch(env, "-p", "high", "-w", "node4", "-n1", "--wrap", "sleep 5") for _ in range(4)]
    wait_until(lambda: states(clean, env) == ["COMPLETED"] * 4, 60, "the clean jobs to complete")
    # the window: this test's jobs, not those earlier tests ran on this cluster
    window = f"checkpoint.history_window_days={(time.time() - began + 60) / 86400:.6f}"
    sweep_args = ["-m", *AUTO_ARGS, window, "cluster.partition=low,high", "cluster.nodelist=node1"]
    proc = run([HPC_TRAIN, "submit", *sweep_args, f"out_dir={tmp_path}", "name=both"], env=env, timeout_s=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    said = [line for line in proc.stderr.splitlines() if "forecast: expected goodput" in line]
    assert [line.split(" on ")[-1] for line in said] == ["low at 1 node(s)", "high at 1 node(s)"], proc.stderr
    sweep = next(tmp_path.glob("both-*"))
    jobs = [t["job_id"] for t in json.loads((sweep / "sweep.json").read_text())["trials"]]
    trials = {history.queued_on(sweep / f"{i:04d}" / "config.yaml")[1]: sweep / f"{i:04d}" for i in range(2)}
    for run_dir, job in zip((sweep / "0000", sweep / "0001"), jobs):
        wait_finished(run_dir, job, env)
    heavy, calm = chosen(trials["low"]), chosen(trials["high"])
    print(f"low: {heavy['why']}\nhigh: {calm['why']}")
    assert heavy["every_steps"] < 20 < calm["every_steps"], (heavy, calm)
    faults = [e["inputs"]["disk"]["faults_per_h"] for e in (heavy, calm)]
    assert faults[0] > 100 * faults[1], faults  # 4 in ~20 node-s against the defaults' 1 in 5,000 node-hours


# The storm: one unannounced fault (`hpc-train chaos RUN kill-rank`: a crash; the run requeues itself) in every
# MTBF_S of the run's running time (first step -> end of each attempt: faults strike running jobs, planning.py), at
# a seeded place in the middle half of each slot; the run is sized to STORM_SLOTS slots of running, so the count
# is the forecast's rate x the run's length (one fault more or less on a run of ~3 moves its goodput ~8 points)
STORM_SLOTS = 3
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


def running_s(events: list[dict]) -> float:
    """Seconds the run's attempts trained: each attempt's first step -> its end (now, for the newest one while it
    trains; an older one without an end event ends at its last event)."""
    atts, now, total = journal.attempts(events), time.time(), 0.0
    for i, a in enumerate(atts):
        if a["first_step"] is not None:
            newest_training = i == len(atts) - 1 and a["ended_by"] == "running"
            total += (now if newest_training else a["end"]) - a["first_step"]
    return total


def storm(env: dict[str, str], run_dir: Path, mtbf_s: float, seed: int) -> list[float]:
    """Kill rank 1 once in every mtbf_s of the run's running time, at a seeded place in the middle half of each
    slot (so that a run a few seconds longer or shorter than its slots has the same count). Returns the faults'
    times in running seconds."""
    rng, done, slot = random.Random(seed), [], 0
    finished = lambda: (run_dir / "summary.json").exists()  # noqa: E731
    while not finished():
        due = (slot + rng.uniform(0.25, 0.75)) * mtbf_s
        slot += 1
        ended = lambda: finished() or _stopped(run_dir)  # noqa: E731
        # up to 1.5 slots of running and a restart (~20 s) since the last fault, with room for a loaded machine
        wait_until(
            lambda: ended() or running_s(read_events(run_dir)) >= due,
            (2 * mtbf_s + 120) / PATIENCE,
            f"{due:.0f} s of running",
            0.2,
        )
        assert not _stopped(run_dir), read_events(run_dir)[-3:]
        if finished():
            break
        proc = run([HPC_TRAIN, "chaos", str(run_dir), "kill-rank", "--rank", "1"], env=env)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        done.append(running_s(read_events(run_dir)))
        wait_until(lambda: not _training(read_events(run_dir)), 60, "the killed attempt to end")
    return done


def _training(events: list[dict]) -> bool:
    """The newest attempt took its first step and has not ended."""
    now = [e for e in events if e.get("restart") == max((e.get("restart", 0) for e in events), default=0)]
    names = {e["event"] for e in now}
    return journal.FIRST_STEP in names and not names & {journal.FAIL, journal.REQUEUE, journal.FINISH}


def test_a_seeded_storm_realises_the_goodput_forecast_at_its_submit(
    slurm_env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """The project: the site's history on `low`, 4 node failures in ~4 minutes of node-time (14 one-CPU jobs of 15 s
    on the 4 nodes, the node-failed ones requeued: the queue wait after a requeue too), then a clean run there
    alone (what a step, a save and a start-up cost here, for the forecast; beside 14 jobs starting, its start-up
    was up to 4x a requeued attempt's). The storm run's submit forecasts its goodput from them (history.json: the rates and the
    numbers); faults then come at that rate, one in each MTBF of running. The run's committed time
    (journal.goodput, what report shows) over its wall time, queue waits included as the forecast's restarts
    include them and its first start-up left out (once a run, the forecast is per hour of a long one), is within
    5 points of the forecast."""
    env, began, out = slurm_env, time.time(), tmp_path / "runs"
    fill = [
        sbatch(env, "-p", "low", "-w", n, "-n1", "--wrap", "sleep 15") for n in ["node1"] * 2 + ["node2", "node4"] * 4
    ]
    node_failures(env, "node3", "low", 4, run_s=15, requeue=True)
    wait_until(lambda: states(fill, env) == ["COMPLETED"] * len(fill), 60, "the history's clean jobs")
    ref_dir, ref_job = submit(
        [*STORM_ARGS, "cluster.nodelist=node1", "train.steps=40", f"out_dir={out}", "name=ref"], env
    )
    wait_finished(ref_dir, ref_job, env)
    days = (time.time() - began + 60) / 86400
    # the size: STORM_SLOTS slots of running at the rate the submit will read (sacct, asked here as it will)
    monkeypatch.setenv("SLURM_CONF", env["SLURM_CONF"])
    ahead = history.site_rates("low", 1, runs_dir=out, window_days=days, min_jobs=3)
    steps = round(STORM_SLOTS * 3600 / ahead.unannounced_per_h(1) / intervals.project_measured(out).step_s)
    # sacct answered and the history is this test's (~1 fault a minute at 0.25 s a step: ~700 steps)
    assert ahead.source != "defaults" and not ahead.note and 100 < steps < 3000, (ahead, steps)
    window = f"checkpoint.history_window_days={days:.6f}"
    run_dir, job = submit([*STORM_ARGS, f"train.steps={steps}", window, f"out_dir={out}", "name=storm"], env)
    frozen = json.loads(RunPaths(run_dir).history.read_text())
    rates = history.Rates(**{**frozen["rates"], "queue_waits_s": tuple(frozen["rates"]["queue_waits_s"])})
    forecast = intervals.forecast_expected(RunPaths(run_dir).history, run_dir)
    assert forecast is not None and rates.source != "defaults", frozen
    mtbf_s = 3600 / rates.unannounced_per_h(1)
    assert mtbf_s == pytest.approx(3600 / ahead.unannounced_per_h(1), rel=0.1), (rates, ahead)  # what it was sized by
    faults = storm(env, run_dir, mtbf_s, seed=2026)
    wait_finished(run_dir, job, env, timeout_s=300)
    events = read_events(run_dir)
    parts = journal.goodput(journal.read(run_dir), read_metrics(run_dir))
    first = journal.attempts(events)[0]
    wall = parts["allocated"] + parts["queue_wait"] - (first["first_step"] - first["launched"])
    realised = {"allocation": parts["goodput"], "wall": parts["committed"] / wall}
    chosen = [e for e in events if e["event"] == "interval"]
    print(f"forecast {forecast}; {rates.describe(1)}; {steps} steps; faults at {[round(f) for f in faults]} s of")
    print(f"{running_s(events):.0f} s running (1 per {mtbf_s:.0f} s); realised {realised}; parts {parts}")
    print(f"intervals {[(e['restart'], e['every_steps'], e['inputs'].get('disk')) for e in chosen]}")
    assert len(faults) == STORM_SLOTS, faults  # one more or less: the run's length was not what it was sized to
    assert abs(realised["wall"] - forecast.goodput) <= 0.05, (realised, forecast)
