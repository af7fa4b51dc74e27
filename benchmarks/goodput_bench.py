"""Goodput of a run preempted about every 2 minutes on the dev cluster, reported by `hpc-train report`.

    .venv/bin/python benchmarks/goodput_bench.py                  # ~8 min: 6 min of training, 3 preemptions
    .venv/bin/python benchmarks/goodput_bench.py --minutes 3 --every-s 60

A 2-node x 2-rank run in partition `low` (0.25 s per step, a checkpoint every 40 steps); every
`--every-s` seconds of its training a `high` job needing all four nodes preempts it. Prints the
report's table (goodput excludes queue wait: the time Slurm takes to start the requeued job) and the
requeue/start times from slurmctld.log, to check the report against by hand. Never asserts.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import cluster  # noqa: E402

HPC_TRAIN = str(Path(sys.executable).parent / "hpc-train")


def events(run_dir: Path) -> list[dict]:
    p = run_dir / "events.jsonl"
    return [json.loads(line) for line in p.read_text().splitlines()] if p.exists() else []


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=6.0, help="training time of an uninterrupted run")
    ap.add_argument("--every-s", type=float, default=120.0, help="preempt after this much training")
    args = ap.parse_args()
    started = not cluster.is_up()
    if started:
        cluster.up()
    env = cluster.client_env()
    out = Path(tempfile.mkdtemp(prefix="goodput_"))
    steps = int(args.minutes * 60 / 0.25)
    proc = subprocess.run(
        [
            HPC_TRAIN,
            "submit",
            "cluster=dev",
            "cluster.partition=low",
            f"train.steps={steps}",
            "train.min_step_time_s=0.25",
            "checkpoint.every_steps=40",
            "train.log_every_steps=40",
            f"out_dir={out}",
            "name=goodput",
        ],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    job_id = re.search(r"submitted job (\S+);", proc.stdout).group(1)
    run_dir = out / "goodput-1"
    preemptions = 0
    while not (run_dir / "summary.json").exists():
        starts = [e for e in events(run_dir) if e["event"] == "start"]
        if starts and len(starts) == preemptions + 1 and time.time() - starts[-1]["time"] >= args.every_s:
            subprocess.run(
                ["sbatch", "-p", "high", "-N", "4", "--exclusive", "-o", "/dev/null", "--wrap", "sleep 1"],
                env=env,
                check=True,
                capture_output=True,
            )
            preemptions += 1
        time.sleep(1)
    print(f"run {run_dir} (job {job_id}): {steps} steps, preempted {preemptions} times\n")
    print(subprocess.run([HPC_TRAIN, "report", str(run_dir)], env=env, capture_output=True, text=True).stdout)
    log = (cluster.paths()["log"] / "slurmctld.log").read_text()
    print("slurmctld.log, for checking by hand:")
    for line in log.splitlines():
        if re.search(
            rf"JobId={job_id}\b.*(Requeuing|Allocate)|Requeuing JobId={job_id}\b|Allocate JobId={job_id}\b", line
        ):
            print("  " + line)
    if started:
        cluster.down()


if __name__ == "__main__":
    main()
