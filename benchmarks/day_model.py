"""Goodput over one scripted day of a 4-node run, with and without issue 12's features: a model, fed
with the figures measured on the dev cluster (docs/benchmarks.md) and with stated assumptions.

    .venv/bin/python benchmarks/day_model.py
    .venv/bin/python benchmarks/day_model.py --repair-h 8 --slowdown 1.25 --human-h 16

The script (hours from midnight), the same for both runs, on a partition of exactly the run's 4 nodes:
  06:00  node A dies mid-run (its rank crashes); repaired --repair-h hours later, it is given back still
         faulty (a GPU with rising ECC counts: the "repaired" node) and dies again --refail-h hours after
         it was given back, if a run is on it.
  10:00  node B turns into a straggler: its steps take --slowdown x as long, and synchronous training
         waits for it.
  every --timeout-h hours the run reaches its time limit and requeues (a restart, nothing lost).

Without the features the run needs all 4 nodes: it waits for each repair, lands on the faulty node again
(nothing checks it), and nobody can drop the straggler without stopping the run.
With them (cluster.min_nodes=3, requeue.shrink_after_s < the repair time): after the crash, node A is
excluded (its rank's error was a device error; the preflight would have failed it too) and the run goes
on with 3 nodes, never landing on the returned node A again; every attempt start pays --preflight-s; the
straggler is named within --detect-s and dropped only when 2 healthy nodes beat 3 with it in.
Work lost at a crash: half a checkpoint interval. Every restart costs --restart-s.

With issue 20's too (cluster.spare_nodes=1 on a partition one node larger, checkpoint.memory_every_steps):
node A's crash is relaunched inside the allocation on the spare within --in-job-s, losing half of
--memory-every-s; the run stays at 4 nodes and node A is left out; the straggler is named and kept (nothing
replaces a straggler by a spare). The spare is held, idle, all day: the figure says how many node-hours that is.

Goodput = work done / (24 h x full-size throughput); throughput is proportional to the nodes in use
(ideal weak scaling, an assumption) and divided by the slowdown while the straggler is in.
Never asserts; prints both timelines and the figures.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass


@dataclass
class Day:
    nodes: int = 4
    restart_s: float = 20.0  # requeue -> first step on the dev cluster: 13-18 s to launch + 5.6 s restart
    checkpoint_min: float = 30.0
    repair_h: float = 4.0
    refail_h: float = 4.0
    slowdown: float = 1.4
    timeout_h: float = 4.0
    detect_s: float = 80.0  # (windows + 1) x every_steps = 80 steps when named (straggler_bench.py), at 1 s a step
    preflight_s: float = 0.4  # per attempt start: max 0.37 s per node on the dev cluster (preflight_bench.py)
    # issue 20 (cluster.spare_nodes=1 on a partition one node larger): kill -> first step inside the allocation
    # 4.1 s, 6.7 s with the memory tier, on the dev cluster (in_job_bench.py)
    in_job_s: float = 6.7
    memory_every_s: float = 5.0  # checkpoint.memory_every_steps=5 at 1 s a step: a crash loses <= 5 s of work


def timeline(d: Day, features: bool | str) -> list[tuple[float, float, float, str]]:
    """(start h, end h, throughput as a fraction of the full size, what) for the whole day. features: False
    (none), True (issue 12's), "spares" (also issue 20's: one hot spare and the memory tier)."""
    h = 1 / 3600
    crash_lost_h = d.checkpoint_min / 60 / 2
    slow = 1 / d.slowdown
    if features == "spares":  # node A's crash: relaunched on the spare inside the allocation, the node left out
        segs = [
            (0, 6, 1.0, "4 nodes + 1 spare"),
            (6, 6 + d.in_job_s * h, 0.0, f"node A died: {d.memory_every_s / 2:g} s lost (memory tier), relaunched"),
            (6 + d.in_job_s * h, 10, 1.0, "4 nodes (the spare in), node A left out"),
            (10, 24, slow, f"node B named within {d.detect_s:.0f} s, kept: a straggler is not replaced by a spare"),
        ]
        lost = [(6, d.memory_every_s / 2 * h)]
    elif not features:
        a_back = 6 + d.repair_h
        refail = a_back + d.refail_h
        segs = [
            (0, 6, 1.0, "4 nodes"),
            (
                6,
                a_back + d.restart_s * h,
                0.0,
                f"node A died: {crash_lost_h:g} h of work lost, waiting {d.repair_h:g} h for 4 nodes",
            ),
            (a_back + d.restart_s * h, refail, slow, f"4 nodes, node B straggling {d.slowdown:g}x"),
            (
                refail,
                refail + d.repair_h + d.restart_s * h,
                0.0,
                f"node A died again: {crash_lost_h:g} h lost, waiting {d.repair_h:g} h",
            ),
            (refail + d.repair_h + d.restart_s * h, 24, slow, f"4 nodes, node B straggling {d.slowdown:g}x"),
        ]
        lost = [(6, crash_lost_h), (refail, crash_lost_h * slow)]
    else:
        three = 3 / d.nodes
        drop_b = 2 / d.nodes > three * slow  # 2 healthy nodes beat 3 with the straggler in
        b_part = (
            f"node B named within {d.detect_s:.0f} s; dropped: 2 nodes"
            if drop_b
            else f"node B named within {d.detect_s:.0f} s and kept (2 nodes would be slower)"
        )
        segs = [
            (0, 6, 1.0, "4 nodes"),
            (6, 6 + d.restart_s * h, 0.0, f"node A died: {crash_lost_h:g} h lost, excluded; resume on 3 nodes"),
            (6 + d.restart_s * h, 10, three, "3 nodes"),
            (10, 24, 2 / d.nodes if drop_b else three * slow, b_part),
        ]
        lost = [(6, crash_lost_h)]
    out: list[tuple[float, float, float, str]] = []
    for start, end, rate, what in segs:  # time-limit requeues: a restart each
        out.append((start, end, rate, what))
    requeues = [k * d.timeout_h for k in range(1, int(24 / d.timeout_h) + 1) if k * d.timeout_h < 24]
    restarts = len(requeues)
    penalty = restarts * (d.restart_s + (d.preflight_s if features else 0)) * h  # a preflight at every start
    out.append((0, 0, 0.0, f"{len(requeues)} time-limit requeues, {restarts} restarts: {penalty * 60:.1f} min"))
    out.append((0, -sum(x for _, x in lost) - penalty, 1.0, "lost"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    for name, default in vars(Day()).items():
        ap.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default)
    d = Day(**vars(ap.parse_args()))
    print(f"assumptions: {d}\n")
    names = {False: "without issue 12's features", True: "with issue 12's features", "spares": "with issue 20's too"}
    for features in (False, True, "spares"):
        segs = timeline(d, features)
        work = sum((end - start) * rate for start, end, rate, _ in segs)
        held = (d.nodes + 1) * 24  # the spare is held all day, idle until a node fails
        cost = (
            f"; the run holds {held:.0f} node-hours, {work * d.nodes / held:.1%} of them training"
            if features == "spares"
            else ""
        )
        print(f"{names[features]}: goodput {work / 24:.1%} ({work:.2f} full-size hours of 24{cost})")
        for start, end, rate, what in segs:
            if what != "lost":
                span = f"{start:05.2f}-{end:05.2f} h  x{rate:.2f}  " if end > start else " " * 22
                print(f"    {span}{what}")
        print()


if __name__ == "__main__":
    main()
