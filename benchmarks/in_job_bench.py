"""A crash with a competing job in the queue: relaunch inside the allocation (hot spares) vs requeue.

    .venv/bin/python benchmarks/in_job_bench.py                       # both modes, a 60 s competitor
    .venv/bin/python benchmarks/in_job_bench.py --modes in-job --competitor-s 120
    .venv/bin/python benchmarks/in_job_bench.py --memory-every-steps 1  # in-job mode also with the memory tier
    .venv/bin/python benchmarks/in_job_bench.py --modes in-job+memory,in-process  # the in-process restart beside it

On the dev cluster (tests/cluster.py; export HPC_TRAIN_CLUSTER_DIR / _PORT_OFFSET for your own), its
`debug` partition of 4 nodes. A run of 2 nodes x 1 rank (tiny, 0.25 s a step); mode "in-job" adds
cluster.spare_nodes=1 (3 nodes held), mode "requeue" has none (2 held). After the first committed
checkpoint a competitor is queued that needs one node more than is free (`sleep --competitor-s`), so
it waits behind the run; then the last rank is SIGKILLed (`hpc-train chaos RUN kill-rank`). In-job, the
step is relaunched on the allocation the run still holds; requeued, the run goes back to the queue, where
the competitor is first in line for the nodes it gives back. Prints, from the run's events: kill -> the
next attempt's first step, the steps lost (the failed step - the step resumed at), and whether the
competitor ran before the run resumed. Mode "in-process" is in-job+memory with cluster.in_process_restart: the
rank that survived rejoins in its process with the spare's warm standby; it also prints the failure the survivor
saw -> first step (the kill's own srun into the allocation takes 0.5-1 s of kill -> first step here), and whether
the survivor kept its pid. Figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
import time
from pathlib import Path

from devcluster import HPC_TRAIN, cluster, events, sh, wait  # noqa: E402

ARGS = [
    "cluster=dev",
    "cluster.partition=debug",
    "cluster.nodes=2",
    "cluster.tasks_per_node=1",
    "model=tiny",
    "train.steps=300",
    "train.min_step_time_s=0.25",
    "checkpoint.every_steps=40",
]


def one(mode: str, args: argparse.Namespace, env: dict[str, str], out: Path) -> dict:
    wait(lambda: sh(["sinfo", "-h", "-p", "debug", "-t", "idle", "-o", "%D"], env) == "4", 120, "4 idle nodes")
    extra = ["cluster.spare_nodes=1"] if mode.startswith("in-") else []
    if mode in ("in-job+memory", "in-process"):
        extra.append(f"checkpoint.memory_every_steps={args.memory_every_steps}")
    if mode == "in-process":
        extra.append("cluster.in_process_restart=true")
    line = sh([HPC_TRAIN, "submit", *ARGS, *extra, f"out_dir={out}", f"name={mode.replace('+', '-')}"], env)
    line = next(l for l in line.splitlines() if l.startswith("submitted job"))
    job_id, run_dir = line.split()[2].rstrip(";"), Path(line.split("run directory ")[1])
    competitor = ""
    try:
        wait(lambda: any(e["event"] == "checkpoint_committed" for e in events(run_dir)), 300, "a first checkpoint")
        held = 3 if extra else 2
        competitor = sh(
            [
                *("sbatch", "--parsable", "-p", "debug", "-N", str(4 - held + 1), "--exclusive"),
                *("-o", "/dev/null", "--wrap", f"sleep {args.competitor_s:.0f}"),
            ],
            env,
        )
        wait(lambda: sh(["squeue", "-h", "-j", competitor, "-o", "%T"], env) == "PENDING", 30, "the competitor queued")
        time.sleep(args.run_on_s)  # the run trains on past its checkpoint: the steps a crash loses
        killed_at = time.time()
        sh([HPC_TRAIN, "chaos", str(run_dir), "kill-rank", "--rank", "1"], env)
        wait(lambda: (run_dir / "summary.json").exists(), args.competitor_s + 900, f"the {mode} run to finish")
    finally:
        if competitor:
            subprocess.run(["scancel", competitor], env=env, capture_output=True)
        subprocess.run(["scancel", job_id], env=env, capture_output=True)
    ev = events(run_dir)
    first = next(e for e in ev if e["event"] == "first_step" and e["time"] > killed_at)
    start = next(e for e in ev if e["event"] == "start" and e["restart"] == first["restart"])
    reached = max(e["step"] for e in ev if e["restart"] < first["restart"])  # the failing rank's `fail` step
    failed = next(e for e in ev if e["event"] == "fail" and e["time"] > killed_at)
    before = next(e for e in ev if e["event"] == "start" and e["restart"] < first["restart"])
    competitor_rows = sh(["sacct", "-n", "-X", "-P", "-j", competitor, "-o", "Start,End"], env).split("|")
    competitor_start = competitor_rows[0] if competitor_rows else "Unknown"
    ran_first = competitor_start not in ("Unknown", "None", "") and time.mktime(
        time.strptime(competitor_start, "%Y-%m-%dT%H:%M:%S")
    ) < float(first["time"])
    return {
        "mode": mode,
        "kill_to_first_step_s": first["time"] - killed_at,
        "fail_to_first_step_s": first["time"] - failed["time"],
        "survivor_kept_pid": before["pids"][0] == start["pids"][0],
        "steps_lost": max(0, reached - int(start["step"])),
        "reached": reached,
        "resumed_at": start["step"],
        "resumed_from": start.get("resumed_from"),
        "competitor_ran_first": ran_first,
        "same_job": start["job_id"] == job_id,
        "run_dir": str(run_dir),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--modes", default="in-job,requeue", help="in-job, requeue, in-job+memory, in-process")
    ap.add_argument("--competitor-s", type=float, default=60.0, help="how long the queued competitor runs")
    ap.add_argument("--run-on-s", type=float, default=5.0, help="training after the competitor queued, before the kill")
    ap.add_argument("--memory-every-steps", type=int, default=1, help="checkpoint.memory_every_steps of in-job+memory")
    args = ap.parse_args()
    started = not cluster.is_up()
    if started:
        cluster.up()
    env = cluster.client_env()
    out = Path(tempfile.mkdtemp(prefix="in_job_bench_"))
    rows = [one(mode, args, env, out) for mode in args.modes.split(",")]
    print(
        f"2 nodes x 1 rank, tiny, 0.25 s/step, a checkpoint every 40 steps; a competitor of "
        f"{args.competitor_s:.0f} s queued; rank 1 killed {args.run_on_s:.0f} s later"
    )
    for r in rows:
        print(
            f"{r['mode']:14s}: kill -> first step {r['kill_to_first_step_s']:6.1f} s (failure seen -> first step "
            f"{r['fail_to_first_step_s']:.1f} s); steps lost {r['steps_lost']:3d} "
            f"(reached {r['reached']}, resumed at {r['resumed_at']} from {r['resumed_from']}); "
            f"same job {r['same_job']}; rank 0 kept its pid {r['survivor_kept_pid']}; competitor ran first "
            f"{r['competitor_ran_first']}  [{r['run_dir']}]"
        )
    if started:
        cluster.down()


if __name__ == "__main__":
    main()
