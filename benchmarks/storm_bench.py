"""A long seeded fault storm on the dev cluster (tests/storm.py): faults survived, steps lost per fault
and requeue latency. Figures are printed, never asserted; the invariants of tests/storm.py are checked
and any violation printed.

    .venv/bin/python benchmarks/storm_bench.py --faults 30 --seed 7
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import cluster  # noqa: E402
import storm  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--faults", type=int, default=30)
    ap.add_argument("--seed", type=int, default=int(time.time()) % 10_000)
    ap.add_argument("--steps", type=int, default=0, help="train.steps (default: 30 per fault + 100)")
    args = ap.parse_args()
    started = not cluster.is_up()
    if started:
        cluster.up()
    t0 = time.monotonic()
    try:
        out = Path(tempfile.mkdtemp(prefix="storm_"))
        result = storm.run_storm(
            cluster.client_env(), out, args.seed, args.faults, args.steps or 30 * args.faults + 100
        )
        fig, violations = storm.figures(result), storm.check(result)
    finally:
        if started:
            cluster.down()
    lost, lat = fig["steps_lost"], fig["requeue_latency_s"]
    print(
        f"seed {args.seed}, {fig['faults']} faults injected over {fig['attempts']} attempts, "
        f"{(time.monotonic() - t0) / 60:.1f} min; run directory {result.run_dir}"
    )
    print(f"finished with the uninterrupted run's weights: {fig['finished'] and not violations}")
    print(f"faults by kind: { {k: sum(i['fault'] == k for i in result.injected) for k in storm.FAULTS} }")
    if lost:
        print(
            f"steps lost per attempt-ending fault: mean {statistics.mean(lost):.1f}, max {max(lost)} "
            f"(checkpoint every 10 steps)"
        )
    if lat:
        print(f"requeue -> next attempt launched: median {statistics.median(lat):.1f} s, max {max(lat):.1f} s")
    print("invariant violations: " + ("none" if not violations else "; ".join(violations)))


if __name__ == "__main__":
    main()
