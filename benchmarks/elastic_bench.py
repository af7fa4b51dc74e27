"""Time to go on after a node loss: resume smaller (cluster.min_nodes) vs wait for the full size.

    .venv/bin/python benchmarks/elastic_bench.py                 # both modes, 2 of 4 nodes back after 90 s
    .venv/bin/python benchmarks/elastic_bench.py --repair-s 60 --modes shrink
    .venv/bin/python benchmarks/elastic_bench.py --nodes 2 --min-nodes 1 --tasks-per-node 2 --lost node3 \
        --blocker node2,node4                                   # the 2-node variant: a numeric estimate

On the dev cluster (tests/cluster.py; export HPC_TRAIN_CLUSTER_DIR / _PORT_OFFSET for your own). Default:
a run of 4 nodes x 1 rank; after its first checkpoint node3 and node4 are drained (lost) and the run
preempted (scancel --signal=TERM); they come back (State=RESUME) --repair-s seconds after the loss. Mode
"shrink" (cluster.min_nodes=--min-nodes) goes on with the 2 nodes left, mode "full" (min_nodes unset)
waits for all 4. --blocker: a job holding those nodes for --repair-s (started just before the run; its
time limit, the end time the estimate reads, is the next whole minute above). Prints, from the run's
events: requeue -> next attempt's first step, that attempt's world size, the estimate, and the whole
run's wall time. Figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from devcluster import HPC_TRAIN, cluster, events, sh, wait  # noqa: E402

ARGS = [
    "cluster=dev",
    "model=tiny",
    "train.steps=200",
    "train.min_step_time_s=0.25",
    "checkpoint.every_steps=20",
    "requeue.shrink_after_s=30",
]


def one(mode: str, args: argparse.Namespace, env: dict[str, str], out: Path) -> dict:
    repair_s, lost = args.repair_s, args.lost.split(",")
    wait(lambda: sh(["sinfo", "-h", "-p", "debug", "-t", "idle", "-o", "%D"], env) == "4", 120, "4 idle nodes")
    blocker = ""
    try:
        if args.blocker:
            blocker = sh(
                [
                    "sbatch",
                    "--parsable",
                    "-p",
                    "debug",
                    "-w",
                    args.blocker,
                    "-N",
                    str(len(args.blocker.split(","))),
                    "--exclusive",
                    f"--time={int(repair_s // 60) + 1}",
                    "-o",
                    "/dev/null",
                    "--wrap",
                    f"sleep {repair_s}",
                ],
                env,
            )
            wait(lambda: sh(["squeue", "-h", "-j", blocker, "-o", "%T"], env) == "RUNNING", 60, "the blocker")
        extra = [f"cluster.min_nodes={args.min_nodes}"] if mode == "shrink" else []
        line = sh(
            [
                HPC_TRAIN,
                "submit",
                *ARGS,
                f"cluster.nodes={args.nodes}",
                f"cluster.tasks_per_node={args.tasks_per_node}",
                *extra,
                f"out_dir={out}",
                f"name={mode}",
            ],
            env,
        )
        line = next(l for l in line.splitlines() if l.startswith("submitted job"))
        job_id, run_dir = line.split()[2].rstrip(";"), Path(line.split("run directory ")[1])
        wait(lambda: any(e["event"] == "checkpoint_committed" for e in events(run_dir)), 180, "a first checkpoint")
        lost_at = time.time()
        for node in lost:
            sh(["scontrol", "update", f"NodeName={node}", "State=DRAIN", "Reason=elastic-bench"], env)
        sh(["scancel", "--signal=TERM", job_id], env)
        repair = threading.Timer(
            max(0.0, lost_at + repair_s - time.time()),
            lambda: [
                subprocess.run(["scontrol", "update", f"NodeName={node}", "State=RESUME"], env=env, capture_output=True)
                for node in lost
            ],
        )
        repair.start()
        wait(lambda: (run_dir / "summary.json").exists(), repair_s + 600, f"{mode} run to finish")
        repair.join()
    finally:
        if blocker:
            subprocess.run(["scancel", blocker], env=env, capture_output=True)
        for node in lost:
            subprocess.run(["scontrol", "update", f"NodeName={node}", "State=RESUME"], env=env, capture_output=True)
    ev = events(run_dir)
    requeue = next(e for e in ev if e["event"] == "requeue")
    start = next(e for e in ev if e["event"] == "start" and e["restart"] == 1)
    first = next(e for e in ev if e["event"] == "first_step" and e["restart"] == 1)
    finish = next(e for e in ev if e["event"] == "finish")
    launched = min(e.get("launched_at", e["time"]) for e in ev if e["event"] == "start")
    return {
        "mode": mode,
        "requeue_to_first_step_s": first["time"] - requeue["time"],
        "world_size": start["world_size"],
        "nodes_next": requeue.get("nodes_next", f"{args.nodes} (fixed)"),
        "nodes": start["nodes"],
        "full_size_wait_s": requeue.get("full_size_wait_s"),
        "resumed_step": start["step"],
        "lost_to_first_step_s": first["time"] - lost_at,
        "run_wall_s": finish["time"] - launched,
        "run_dir": str(run_dir),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--repair-s", type=float, default=90.0, help="the lost nodes (and the blocker's) back after this long"
    )
    ap.add_argument("--modes", default="shrink,full")
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--min-nodes", type=int, default=2, help="cluster.min_nodes of mode shrink")
    ap.add_argument("--tasks-per-node", type=int, default=1)
    ap.add_argument("--lost", default="node3,node4", help="nodes drained under the run")
    ap.add_argument("--blocker", default="", help="nodes another job holds for --repair-s, from before the run")
    args = ap.parse_args()
    started = not cluster.is_up()
    if started:
        cluster.up()
    env = cluster.client_env()
    out = Path(tempfile.mkdtemp(prefix="elastic_bench_"))
    rows = [one(mode, args, env, out) for mode in args.modes.split(",")]
    print(
        f"{args.lost} lost, back after {args.repair_s:.0f} s; blocker on {args.blocker or 'no node'}; "
        f"{args.nodes} nodes x "
        f"{args.tasks_per_node} ranks, tiny, 0.25 s/step, 200 steps"
    )
    for r in rows:
        print(
            f"{r['mode']:6s}: requeue -> first step {r['requeue_to_first_step_s']:6.1f} s on {r['world_size']} ranks "
            f"{','.join(r['nodes'])} (nodes_next {r['nodes_next']}, estimate {r['full_size_wait_s']} s); node lost -> "
            f"first step {r['lost_to_first_step_s']:6.1f} s; whole run {r['run_wall_s']:6.1f} s  [{r['run_dir']}]"
        )
    if started:
        cluster.down()


if __name__ == "__main__":
    main()
