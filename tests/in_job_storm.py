"""A seeded storm of faults recovered inside one allocation (hot spares, issue 20), then the invariants and the
figures. tests/test_in_job_storm.py runs a short one (4 faults, one of each kind) in CI;
benchmarks/in_job_storm_bench.py a longer one, with the memory tier and without, and prints the figures.

    .venv/bin/python benchmarks/in_job_storm_bench.py --faults 8 --seed 7      # replays exactly that sequence

The run: 2 nodes x 1 task with cluster.spare_nodes=2 on the 4-node `debug` partition (never preempted), so
the job holds every node. A competing 1-node job is queued once it runs: any node the job gave back, or a
requeue, would let it in, and a requeued run would then wait behind it for its 4 nodes. Each fault comes a
seeded 1..every_steps-1 steps after a checkpoint the current attempt committed, on a seeded rank. What each
fault really is on this cluster:
    kill-rank   SIGKILL to the rank (`hpc-train chaos kill-rank`): the step is relaunched on the same nodes
    hang        SIGSTOP to the rank (srun --overlap into the allocation, as chaos kill-rank does): process
                and watchdog thread frozen. The peer's watchdog (train.watchdog_s) names the hang; with one
                heartbeat count of two no node is blamed (preempt.hung_ranks), so the step is relaunched on
                the same nodes once the batch script's relay has ended the step it holds
                (HPC_TRAIN_STEP_END_S after the relaunch marker, then srun's SIGKILL to every task)
    node-loss   the node fails as Slurm sees it: `scontrol update State=DOWN` (what slurmctld does to a node
                silent for SlurmdTimeout), DRAINed first so that it stays out once its slurmd registers again
                (ReturnToService=2) until the storm ends. The job is --no-kill (hot spares): Slurm takes the
                node out of it and kills the tasks there; the deciding survivor blames it (requeue.lost_nodes)
                and the step is relaunched without it, on a spare. Never the batch script's node, whose loss
                ends the job (a requeue: test_in_job.py's batch host test); then the seeded rank's peer's node is lost
    sick-node   the rank's node marked sick, the other rank (on a healthy node) SIGKILLed: the relaunch's
                preflight finds the sick node, and the next one leaves it out for a spare
A node fault costs a spare; the sequence holds at most cluster.spare_nodes of them, so every fault is
recovered inside the allocation (rank kills and hangs cost none).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from conftest import HPC_TRAIN, final_state, read_events, run, submit, wait_finished, wait_until
from storm import outcome

from hpc_train import journal

FAULTS = ("kill-rank", "hang", "node-loss", "sick-node")
NODE_FAULTS = {"node-loss", "sick-node"}  # each leaves a node out and takes a spare
SPARES = 2  # the 4-node cluster: 2 nodes train, 2 wait
EVERY = 10  # checkpoint.every_steps
STEP_S = 0.2  # train.min_step_time_s: 10 steps between checkpoints = 2 s, so a fault lands between two
WATCHDOG_S = 20  # train.watchdog_s: the set-up before the first step must not reach it on loaded cores
STEP_END_S = 10  # the relay's wait for a step that outlives its relaunch marker (a SIGSTOPped rank; default 90)


def train_args(steps: int) -> list[str]:
    """The arguments that decide the weights, the reference's and the storm's alike."""
    return [
        "cluster=dev",
        "cluster.partition=debug",
        "cluster.tasks_per_node=1",
        "cluster.timeout_min=30",  # an in-job restart needs startup + signal_lead_s before the time limit
        f"train.steps={steps}",
        f"train.min_step_time_s={STEP_S}",
        f"train.watchdog_s={WATCHDOG_S}",
        "train.log_every_steps=1",  # metrics.jsonl: the step each fault came after
        f"checkpoint.every_steps={EVERY}",
        "checkpoint.keep_last=2",
    ]


def sequence(rng: random.Random, n: int, spares: int = SPARES) -> list[tuple[str, int, int]]:
    """(fault, rank 0|1, steps after a commit): every kind once (shuffled) before repeats, and at most
    `spares` node faults; past them, rank kills and hangs."""
    kinds = list(FAULTS)
    rng.shuffle(kinds)
    out: list[str] = []
    for kind in kinds + [rng.choice(FAULTS) for _ in range(n)]:
        if len(out) < n and not (kind in NODE_FAULTS and sum(f in NODE_FAULTS for f in out) >= spares):
            out.append(kind)
    out += [rng.choice(("kill-rank", "hang")) for _ in range(n - len(out))]
    return [(f, rng.randrange(2), rng.randint(1, EVERY - 1)) for f in out]


@dataclass
class Storm:
    seed: int
    faults: list[tuple[str, int, int]]
    run_dir: Path
    job_id: str
    reference: dict[str, Any]
    memory_every_steps: int
    injected: list[dict[str, Any]] = field(default_factory=list)  # fault, rank, node, time, attempt, step
    competitor: list[str] = field(default_factory=list)  # its squeue state at each look while the run ran
    restarts: str = ""  # `scontrol show job`'s Restarts= at the end
    lost: list[str] = field(default_factory=list)  # the nodes set DOWN (node-loss), resumed at the end
    summary: dict[str, Any] | None = None
    slurm_state: str = ""  # sacct's state of the job once it ended, when the run finished


def _metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def _ready(run_dir: Path, after: float, offset: int) -> dict | None:
    """The current attempt's start once it trained `offset` steps past a checkpoint it committed after
    `after` (None until then)."""
    events = read_events(run_dir)
    starts = journal.named(events, journal.START)
    if not starts or (run_dir / "summary.json").exists():
        return None
    start = starts[-1]
    if any(e["restart"] == start["restart"] and e["event"] == journal.FAIL for e in events):
        return None
    commits = [
        e["step"]
        for e in events
        if e["event"] == journal.CHECKPOINT_COMMITTED
        and e["restart"] == start["restart"]
        and e["time"] > max(after, start["time"])
    ]
    reached = max((m["step"] for m in _metrics(run_dir) if m["time"] > start["time"]), default=0)
    return start if commits and reached >= max(commits) + offset else None


def _squeue_state(job_id: str, env: dict[str, str]) -> str:
    return run(["squeue", "-h", "-j", job_id, "-o", "%T"], env=env).stdout.strip()


def _batch_host(job_id: str, env: dict[str, str]) -> str:
    text = run(["scontrol", "show", "job", "-o", job_id], env=env).stdout
    return next((w.split("=", 1)[1] for w in text.split() if w.startswith("BatchHost=")), "")


def run_storm(
    env: dict[str, str],
    out: Path,
    seed: int,
    n_faults: int,
    steps: int,
    memory_every_steps: int = 0,
    reference: dict[str, Any] | None = None,
    say: Callable[[str], None] = print,
) -> Storm:
    """The reference (unless given: the same train_args give the same weights), then the storm's run."""
    faults = sequence(random.Random(seed), n_faults)
    say(f"in-job storm seed {seed}: {' '.join(f'{f}@rank{r}+{o}' for f, r, o in faults)}")
    if reference is None:  # 2 nodes, before the storm's job takes all 4
        ref_dir, ref_job = submit([*train_args(steps), f"out_dir={out}", "name=ref"], env=env)
        reference = wait_finished(ref_dir, ref_job, env, timeout_s=300)
    name = f"storm-mem{memory_every_steps}"
    run_dir, job_id = submit(
        [
            *train_args(steps),
            f"cluster.spare_nodes={SPARES}",
            f"checkpoint.memory_every_steps={memory_every_steps}",
            f"+cluster.env.HPC_TRAIN_STEP_END_S={STEP_END_S}",
            f"out_dir={out}",
            f"name={name}",
        ],
        env=env,
    )
    storm = Storm(seed, faults, run_dir, job_id, reference, memory_every_steps)
    wait_until(lambda: _squeue_state(job_id, env) == "RUNNING", 120, "the storm's job to hold its 4 nodes")
    # --exclusive: a whole node, as a GPU job takes one (the storm's job uses 1 of each node's 4 CPUs)
    queue = ["sbatch", "--parsable", "-p", "debug", "-N", "1", "--exclusive", "-J", "competitor", "-o", "/dev/null"]
    # 60 s once it runs: a run that gave its nodes back waits that long in the queue, and a failing test ends
    proc = run([*queue, "--wrap", "sleep 60"], env=env)
    assert proc.returncode == 0, proc.stderr
    competitor = proc.stdout.strip().split(";")[0]
    chaos = lambda *args: run([HPC_TRAIN, "chaos", str(run_dir), *args], env=env)  # noqa: E731
    try:
        last = 0.0
        for i, (fault, rank, offset) in enumerate(faults):
            finished = lambda: (run_dir / "summary.json").exists()  # noqa: E731
            start = wait_until(
                lambda: _ready(run_dir, last, offset) or finished(),
                240,
                f"an attempt ready for fault {i} ({fault})",
                every_s=0.2,
            )
            if start is True:
                say(f"the run finished after {i} faults")
                break
            storm.competitor.append(_squeue_state(competitor, env))
            attempt, node = start["restart"], start["rank_nodes"][rank]
            if fault == "node-loss" and node == _batch_host(job_id, env):  # its loss ends the job: the peer's node
                rank, node = 1 - rank, start["rank_nodes"][1 - rank]
            say(f"fault {i}: {fault} on rank {rank} ({node}) in attempt {attempt}")
            if fault == "hang":
                stop = ["srun", "--overlap", f"--jobid={job_id}", "-w", node, "-N1", "-n1"]
                t0 = time.time()
                proc = run([*stop, "kill", "-STOP", str(start["pids"][rank])], env=env)
                assert proc.returncode == 0, proc.stderr
                journal.log(
                    run_dir, journal.CHAOS, -1, job_id, attempt, action="hang", injected=f"SIGSTOP to rank {rank}"
                )
            elif fault == "node-loss":
                t0 = time.time()
                # DRAIN first: the DOWN node's slurmd answers at once and ReturnToService=2 makes it IDLE, and
                # a DRAIN after it lost the race to the competitor once (6 ms); DOWN keeps the DRAIN flag
                for state in ("DRAIN", "DOWN"):
                    proc = run(["scontrol", "update", f"NodeName={node}", f"State={state}", "Reason=storm"], env=env)
                    assert proc.returncode == 0, proc.stderr
                storm.lost.append(node)
            else:
                if fault in NODE_FAULTS:
                    done = chaos("sick-node", "--rank", str(rank))
                    assert done.returncode == 0, done.stdout + done.stderr
                # sick-node: the rank on the healthy node dies
                action, target = ("kill-rank", rank) if fault == "kill-rank" else ("kill-rank", 1 - rank)
                t0 = time.time()  # the fault is the kill: a sick-node drill alone stops nothing
                done = chaos(action, "--rank", str(target))
                assert done.returncode == 0, done.stdout + done.stderr
            storm.injected.append({"fault": fault, "rank": rank, "node": node, "time": t0, "attempt": attempt})
            wait_until(
                lambda: (
                    any(e["event"] == journal.FIRST_STEP and e["restart"] > attempt for e in read_events(run_dir))
                    or finished()
                    or any(e["event"] == journal.STOPPED for e in read_events(run_dir))
                ),
                240,
                f"the first step after fault {i} ({fault})",
            )
            if not finished():  # once the run ended (its job gone in ms: os._exit) the competitor may start
                storm.competitor.append(_squeue_state(competitor, env))
            last = time.time()
        wait_until(
            lambda: finished() or any(e["event"] == journal.STOPPED for e in read_events(run_dir)),
            300,
            "the storm's run to finish",
        )
        job = run(["scontrol", "show", "job", "-o", job_id], env=env).stdout  # kept MinJobAge=300 s after the end
        storm.restarts = next((w for w in job.split() if w.startswith("Restarts=")), job)
    finally:
        run(["scancel", competitor], env=env)
        for node in storm.lost:
            run(["scontrol", "update", f"NodeName={node}", "State=RESUME"], env=env)
        for drill in (run_dir / "drills").glob("sick_node.*"):  # healed: later runs' preflights pass
            drill.unlink()
        # The left-out nodes' ranks died: their memory copies stay in tmpfs until the node's cleanup
        shutil.rmtree(Path("/dev/shm") / f"hpc_train-{os.geteuid()}" / job_id, ignore_errors=True)
    summary = run_dir / "summary.json"
    storm.summary = json.loads(summary.read_text()) if summary.exists() else None
    storm.slurm_state = final_state(job_id, env) if storm.summary is not None else ""
    return storm


def _recovered(events: list[dict], attempt: int) -> dict | None:
    """The first attempt after `attempt` that reached a step: its start."""
    firsts = {e["restart"] for e in events if e["event"] == journal.FIRST_STEP and e["restart"] > attempt}
    return next((e for e in journal.named(events, journal.START) if e["restart"] == min(firsts, default=-1)), None)


def check(storm: Storm) -> list[str]:
    """What must hold after any storm within the spares; returns the violations (empty when all hold)."""
    events = read_events(storm.run_dir)
    bad = outcome(storm.summary, storm.reference, events)
    if storm.summary is not None and storm.slurm_state != "COMPLETED":
        bad.append(f"the run finished but its job {storm.job_id} ended {storm.slurm_state or 'unknown'} in sacct")
    if storm.restarts != "Restarts=0":
        bad.append(f"Slurm requeued the job: {storm.restarts}")
    if ids := {e["job_id"] for e in events if e.get("job_id")} - {storm.job_id}:
        bad.append(f"events of other job ids {sorted(ids)}")
    if requeues := [e for e in events if e["event"] in (journal.REQUEUE, journal.REQUEUE_FAILED, journal.STOPPED)]:
        bad.append(f"requeued or stopped: {requeues}")
    if any(s != "PENDING" for s in storm.competitor):
        bad.append(f"the competing job ran before the run ended: {storm.competitor}")
    restarts = {e["restart"]: e for e in journal.named(events, journal.IN_JOB_RESTART)}
    for inj in storm.injected:
        fault, r = inj["fault"], inj["attempt"]
        if r not in restarts:
            bad.append(f"{fault} in attempt {r}: no in-job restart after it")
            continue
        if fault == "hang" and not any(
            e["event"] == journal.FAIL and e["restart"] == r and "hang" in str(e.get("error")) for e in events
        ):
            bad.append(f"hang in attempt {r}: no watchdog named it")
        if fault == "node-loss" and inj["node"] not in restarts[r].get("left_out", []):
            bad.append(f"node-loss of {inj['node']} in attempt {r}: not left out by the relaunch: {restarts[r]}")
        if fault == "sick-node":
            then = restarts.get(r + 1, {})
            if then.get("reason") != "node_health" or inj["node"] not in then.get("left_out", []):
                bad.append(f"{fault} on {inj['node']} in attempt {r}: not left out at the next preflight: {then}")
        resumed = _recovered(events, r)
        if resumed is None:
            bad.append(f"{fault} in attempt {r}: no attempt after it reached a step")
        elif inj["node"] in resumed["nodes"] and fault in NODE_FAULTS:
            bad.append(f"{fault}: attempt {resumed['restart']} trains on the sick {inj['node']}")
    # Each attempt resumes from the newest committed checkpoint there was, or a newer memory step
    for s in journal.named(events, journal.START):
        newest = max(
            (e["step"] for e in events if e["event"] == journal.CHECKPOINT_COMMITTED and e["time"] < s["time"]),
            default=0,
        )
        memory = str(s.get("resumed_from") or "").startswith("memory step")
        if s["step"] < newest or (s["step"] > newest and not memory):
            bad.append(f"attempt {s['restart']} resumed at step {s['step']} ({s.get('resumed_from')}), newest {newest}")
    return bad


def figures(storm: Storm) -> dict[str, Any]:
    """Per fault: seconds from injection to the next attempt's first step, and the steps lost (the step the
    failed attempt reached, its `fail` events', minus the step the recovering attempt resumed at)."""
    events = read_events(storm.run_dir)
    per = []
    for inj in storm.injected:
        resumed = _recovered(events, inj["attempt"])
        if resumed is None:
            continue
        first = next(e for e in events if e["event"] == journal.FIRST_STEP and e["restart"] == resumed["restart"])
        failed = [e["step"] for e in events if e["event"] == journal.FAIL and e["restart"] == inj["attempt"]]
        done = max(failed, default=resumed["step"])
        per.append(
            {
                "fault": inj["fault"],
                "recovery_s": round(first["time"] - inj["time"], 1),
                "steps_lost": max(0, done - resumed["step"]),
                "from": "memory" if str(resumed.get("resumed_from")).startswith("memory") else "disk",
            }
        )
    return {
        "faults": len(storm.injected),
        "in_job_restarts": len(journal.named(events, journal.IN_JOB_RESTART)),
        "finished": storm.summary is not None,
        "per_fault": per,
    }
