"""A seeded fault storm against one run on the dev cluster, then the invariants that must hold whatever
the sequence. tests/test_slurm_storm.py runs a short one (6 faults) in CI; benchmarks/storm_bench.py a
long one (30+) and prints its figures.

    .venv/bin/python benchmarks/storm_bench.py --faults 30 --seed 7      # replays exactly that sequence

Faults, each injected the way a user or the cluster would (mostly `hpc-train chaos`), once the current
attempt has committed a checkpoint since the previous fault:
    time-limit            USR2 to every task (Slurm's time-limit warning)
    preempt               a `high` job takes the run's nodes: SIGTERM, GraceTime, Slurm requeues
    preempt-user-signal   the same with SlurmctldParameters=preempt_send_user_signal (USR2 first)
    requeue               an operator's `scontrol requeue`
    batch-term            TERM to the batch shell only (relayed to srun as USR2)
    kill-rank-during-save the last rank SIGKILLs itself in the middle of its next save
    corrupt-checkpoint    after a time-limit stop, a byte flipped in the newest committed checkpoint
                          before the next attempt starts
    slow-storage          every later write 1.5 s slower, so background writes overlap (off at the next fault)
    scontrol-fails-once   the job's next scontrol call fails as an unreachable controller, then a time-limit stop
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import cluster as test_cluster
from conftest import HPC_TRAIN, final_state, read_events, run, submit, wait_until

from hpc_train import journal

FAULTS = (
    "time-limit",
    "preempt",
    "preempt-user-signal",
    "requeue",
    "batch-term",
    "kill-rank-during-save",
    "corrupt-checkpoint",
    "slow-storage",
    "scontrol-fails-once",
)
ENDS_ATTEMPT = set(FAULTS) - {"slow-storage"}
FAULT_BIN = Path(__file__).resolve().parent / "fault_bin"
STEP_S = 0.1  # per step: 10 steps between checkpoints = 1 s, so async writes slowed by 1.5 s overlap


def train_args(steps: int, tasks_per_node: int = 2) -> list[str]:
    return [
        "cluster=dev",
        "cluster.partition=low",
        f"cluster.tasks_per_node={tasks_per_node}",
        f"train.steps={steps}",
        f"train.min_step_time_s={STEP_S}",
        "checkpoint.every_steps=10",
        "checkpoint.keep_last=2",
    ]


def sequence(rng: random.Random, n: int) -> list[str]:
    """Every fault kind once (shuffled) before any repeats, so 9 faults cover them all."""
    kinds = list(FAULTS)
    rng.shuffle(kinds)
    return kinds[:n] + [rng.choice(FAULTS) for _ in range(n - len(kinds))]


@dataclass
class Storm:
    seed: int
    faults: list[str]
    run_dir: Path
    job_id: str
    reference: dict[str, Any]
    injected: list[dict[str, Any]] = field(default_factory=list)  # fault, time, attempt, step
    summary: dict[str, Any] | None = None
    slurm_state: str = ""  # sacct's state of the job once it ended, when the run finished


def _attempts_started(events: list[dict]) -> list[dict]:
    return [e for e in events if e["event"] == "start"]


def _ready(run_dir: Path, after: float) -> dict | None:
    """The current attempt's start, once it has committed a checkpoint after `after` (None until then)."""
    events = read_events(run_dir)
    starts = _attempts_started(events)
    if not starts or (run_dir / "summary.json").exists():
        return None
    start = starts[-1]
    commits = [
        e
        for e in events
        if e["event"] == "checkpoint_committed"
        and e["restart"] == start["restart"]
        and e["time"] > max(after, start["time"])
    ]
    return start if commits else None


def run_storm(
    env: dict[str, str],
    out: Path,
    seed: int,
    n_faults: int,
    steps: int,
    say: Callable[[str], None] = print,
    tasks_per_node: int = 2,
) -> Storm:
    rng = random.Random(seed)
    faults = sequence(rng, n_faults)
    say(f"storm seed {seed}: {' '.join(faults)}")
    # The uninterrupted reference runs first: beside the storm it would share nodes the `high` job must take.
    ref_dir, _ = submit(
        [*train_args(steps, tasks_per_node), "cluster.partition=debug", f"out_dir={out}", "name=ref"], env=env
    )
    wait_until(lambda: (ref_dir / "summary.json").exists(), 600, "the storm's uninterrupted reference")
    trigger = out / "storm-1" / "drills" / "scontrol_fail_once"
    run_dir, job_id = submit(
        [
            *train_args(steps, tasks_per_node),
            f"out_dir={out}",
            "name=storm",
            f"cluster.setup=['export PATH={FAULT_BIN}:$PATH']",
            f"+cluster.env.HPC_TRAIN_SCONTROL_FAIL_ONCE={trigger}",
        ],
        env=env,
    )
    storm = Storm(seed, faults, run_dir, job_id, {})
    chaos = lambda action, *extra: run([HPC_TRAIN, "chaos", str(run_dir), action, *extra], env=env)  # noqa: E731
    last = 0.0
    for i, fault in enumerate(faults):
        finished = lambda: (run_dir / "summary.json").exists()  # noqa: E731
        start = wait_until(lambda: _ready(run_dir, last) or finished(), 240, f"attempt ready for fault {i} ({fault})")
        if start is True:
            say(f"the run finished after {i} faults")
            break
        if (run_dir / "drills" / "slow_storage").exists():
            chaos("slow-storage", "--seconds", "0")
        restart, t0 = start["restart"], time.time()
        say(f"fault {i}: {fault} in attempt {restart}")
        if fault in ("preempt", "preempt-user-signal"):
            if fault == "preempt-user-signal":
                test_cluster.reconfigure(ctld_parameters="preempt_send_user_signal")
            nodes = ",".join(sorted(set(start["nodes"])))
            proc = run(
                [
                    "sbatch",
                    "--parsable",
                    "-p",
                    "high",
                    "-w",
                    nodes,
                    "-N",
                    str(len(start["nodes"])),
                    "--exclusive",
                    "-o",
                    "/dev/null",
                    "--wrap",
                    "sleep 2",
                ],
                env=env,
            )
            assert proc.returncode == 0, proc.stderr
            journal.log(
                run_dir,
                "chaos",
                -1,
                job_id,
                restart,
                action=fault,
                injected=f"high job {proc.stdout.strip()} on {nodes}",
            )
        elif fault == "corrupt-checkpoint":
            assert chaos("time-limit").returncode == 0
            wait_until(
                lambda: any(
                    e["event"] in ("requeue", "requeue_failed") and e["restart"] == restart
                    for e in read_events(run_dir)
                ),
                120,
                "the stop before the corruption",
            )
            proc = chaos("corrupt-checkpoint")
            assert proc.returncode == 0, proc.stderr
        elif fault == "scontrol-fails-once":
            trigger.parent.mkdir(exist_ok=True)
            trigger.write_text("")
            journal.log(
                run_dir, "chaos", -1, job_id, restart, action=fault, injected="the next scontrol call fails once"
            )
            assert chaos("time-limit").returncode == 0
        else:
            extra = ["--seconds", "1.5"] if fault == "slow-storage" else []
            proc = chaos(fault, *extra)
            assert proc.returncode == 0, proc.stderr
        storm.injected.append({"fault": fault, "time": t0, "attempt": restart})
        if fault in ENDS_ATTEMPT:
            wait_until(
                lambda: (
                    any(e["restart"] > restart for e in _attempts_started(read_events(run_dir)))
                    or (run_dir / "summary.json").exists()
                ),
                240,
                f"the attempt after fault {i} ({fault})",
            )
        if fault == "preempt-user-signal":
            test_cluster.reconfigure()
        last = time.time()
    chaos("slow-storage", "--seconds", "0")
    storm.reference = json.loads((ref_dir / "summary.json").read_text())
    wait_until(
        lambda: (run_dir / "summary.json").exists() or any(e["event"] == "stopped" for e in read_events(run_dir)),
        300,
        "the storm run to finish",
    )
    storm.summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else None
    storm.slurm_state = final_state(job_id, env) if storm.summary is not None else ""
    return storm


def committed_lost(events: list[dict]) -> list[str]:
    """A committed checkpoint is deleted only once a newer one is known good in that attempt: the violations."""
    good: dict[int, set[int]] = {}
    bad = []
    for e in events:
        r = e["restart"]
        if e["event"] == "start" and str(e.get("resumed_from") or "").startswith("/"):  # not "memory step N"
            good.setdefault(r, set()).add(int(Path(e["resumed_from"]).name.split("_")[1]))
        elif e["event"] == "checkpoint_committed":
            good.setdefault(r, set()).add(e["step"])
        elif e["event"] == "checkpoint_deleted" and not e.get("torn"):  # a folder never committed may go any time
            if not (e["anchor"] > e["step"] and e["anchor"] in good.get(r, set())):
                bad.append(
                    f"step {e['step']} deleted in attempt {r} with anchor {e['anchor']}, not a newer verified one"
                )
    return bad


def outcome(summary: dict | None, reference: dict, events: list[dict]) -> list[str]:
    """What every storm must end with: the run finished with the uninterrupted run's weights, no committed
    checkpoint lost."""
    bad = []
    if summary is None:
        bad.append(f"the run did not finish: {[e for e in events if e['event'] in ('stopped', 'fail')][-3:]}")
    elif summary["params_sha256"] != reference["params_sha256"]:
        bad.append("final weights differ from the uninterrupted run's")
    return bad + committed_lost(events)


def check(storm: Storm) -> list[str]:
    """What must hold after any storm; returns the violations (empty when all hold)."""
    events = read_events(storm.run_dir)
    bad = outcome(storm.summary, storm.reference, events)
    if storm.summary is not None and storm.slurm_state != "COMPLETED":
        bad.append(f"the run finished but its job {storm.job_id} ended {storm.slurm_state or 'unknown'} in sacct")
    # Every fault shows: its chaos event, then the job's answer
    chaos_events = [e for e in events if e["event"] == "chaos"]
    for inj in storm.injected:
        if not any(e["action"] == inj["fault"] for e in chaos_events):
            bad.append(f"{inj['fault']} at {inj['time']:.0f} has no chaos event")
        after = [e for e in events if e["time"] >= inj["time"] - 1]
        names = {e["event"] for e in after}
        answer = {
            "kill-rank-during-save": "fail",
            "corrupt-checkpoint": "checkpoint_skipped",
            "slow-storage": "checkpoint_committed",
        }.get(inj["fault"], "signal")
        if inj["fault"] in ("requeue", "preempt", "preempt-user-signal"):
            answer = "start"  # Slurm ends the attempt itself; the ranks usually save first (a signal event)
        if answer not in names:
            bad.append(f"{inj['fault']} in attempt {inj['attempt']}: no {answer} event after it")
    # The corrupted checkpoint is never resumed from
    for e in events:
        if e["event"] == "chaos" and e["action"] == "corrupt-checkpoint":
            folder = e["injected"].split(" in ")[1].split("/")[1]
            resumed = [s.get("resumed_from") or "" for s in events if s["event"] == "start" and s["time"] > e["time"]]
            if any(r.endswith(folder) for r in resumed):
                bad.append(f"resumed from the corrupted {folder}")
    return bad


def figures(storm: Storm) -> dict[str, Any]:
    """Faults survived, steps lost per fault, requeue latency (requeue -> next attempt's start)."""
    events = read_events(storm.run_dir)
    starts = _attempts_started(events)
    lost, latency = [], []
    for inj in storm.injected:
        if inj["fault"] not in ENDS_ATTEMPT:
            continue
        reached = max(
            (e["step"] for e in events if e["restart"] == inj["attempt"]), default=0
        )  # fail: the step reached
        nxt = next((s for s in starts if s["restart"] > inj["attempt"]), None)
        if nxt is None:
            continue
        lost.append(max(0, reached - nxt["step"]))
        ends = [
            e for e in events if e["restart"] == inj["attempt"] and e["event"] in ("requeue", "requeue_failed", "fail")
        ]
        if ends:
            latency.append(nxt.get("launched_at", nxt["time"]) - ends[-1]["time"])
    return {
        "faults": len(storm.injected),
        "attempts": len(starts),
        "finished": storm.summary is not None,
        "steps_lost": lost,
        "requeue_latency_s": latency,
    }
