"""Scaling on the dev cluster: 1 -> 2 -> 4 "nodes" x 2 ranks (gloo), tokens/s from each run's metrics.

    .venv/bin/python benchmarks/scaling_bench.py

All four "nodes" share this machine's cores, so this measures the product's multi-node path (placement,
rendezvous, gloo over loopback), not real scaling: on 2 cores, 8 ranks are 4x oversubscribed.
Never asserts.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import cluster  # noqa: E402

HPC_TRAIN = str(Path(sys.executable).parent / "hpc-train")


def main() -> None:
    started = not cluster.is_up()
    if started:
        cluster.up()
    env = cluster.client_env()
    out = Path(tempfile.mkdtemp(prefix="scaling_"))
    print(f"{'nodes':>5s} {'ranks':>5s} {'tokens/s':>10s} {'per rank':>9s} {'step ms':>8s}")
    for nodes in (1, 2, 4):
        subprocess.run(
            [
                HPC_TRAIN,
                "submit",
                "cluster=dev",
                f"cluster.nodes={nodes}",
                "train.steps=100",
                "train.log_every_steps=10",
                "checkpoint.every_steps=50",
                f"out_dir={out}",
                f"name=n{nodes}",
            ],
            env=env,
            check=True,
            capture_output=True,
        )
        run_dir = out / f"n{nodes}-1"
        while not (run_dir / "summary.json").exists():
            time.sleep(1)
        metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][1:]
        tps = statistics.median(m["tokens_per_s"] for m in metrics)
        step = statistics.median(m["step_time_s"] for m in metrics)
        print(f"{nodes:5d} {nodes * 2:5d} {tps:10,.0f} {tps / (nodes * 2):9,.0f} {step * 1e3:8.1f}")
    if started:
        cluster.down()


if __name__ == "__main__":
    main()
