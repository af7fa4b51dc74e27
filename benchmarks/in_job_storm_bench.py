"""A longer seeded in-job fault storm on the dev cluster (tests/in_job_storm.py), run twice on the same faults:
with the memory tier (checkpoint.memory_every_steps=1) and disk only. Per fault kind, the seconds from the
fault to the first step inside the allocation and the steps lost, side by side. Figures are printed, never
asserted; the invariants of tests/in_job_storm.py are checked and any violation printed.

    .venv/bin/python benchmarks/in_job_storm_bench.py --faults 8 --seed 7
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
import in_job_storm  # noqa: E402


def _line(label: str, per: list[dict]) -> str:
    if not per:
        return f"  {label:<12} -"
    s, lost = [f["recovery_s"] for f in per], [f["steps_lost"] for f in per]
    return (
        f"  {label:<12} fault -> first step median {statistics.median(s):5.1f} s, max {max(s):5.1f} s; "
        f"steps lost mean {statistics.mean(lost):4.1f}, max {max(lost)}  ({len(per)} faults)"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--faults", type=int, default=8)
    ap.add_argument("--seed", type=int, default=int(time.time()) % 10_000)
    ap.add_argument("--steps", type=int, default=0, help="train.steps (default: 20 per fault + 60)")
    args = ap.parse_args()
    steps = args.steps or 20 * args.faults + 60
    started = not cluster.is_up()
    if started:
        cluster.up()
    t0 = time.monotonic()
    results = {}
    try:
        out = Path(tempfile.mkdtemp(prefix="in_job_storm_"))
        env, reference = cluster.client_env(), None
        for memory in (1, 0):
            storm = in_job_storm.run_storm(env, out, args.seed, args.faults, steps, memory, reference)
            reference = storm.reference  # the same train_args: one uninterrupted run for both
            results[memory] = (storm, in_job_storm.figures(storm), in_job_storm.check(storm))
    finally:
        if started:
            cluster.down()
    faults = " ".join(f"{f}@rank{r}+{o}" for f, r, o in results[0][0].faults)
    print(
        f"\nseed {args.seed}, {args.faults} faults ({faults}; +N: steps after a checkpoint), "
        f"{steps} steps of {in_job_storm.STEP_S} s, a checkpoint every {in_job_storm.EVERY} steps, "
        f"2 nodes + {in_job_storm.SPARES} spares; {(time.monotonic() - t0) / 60:.1f} min"
    )
    for memory, (storm, fig, violations) in results.items():
        name = "memory tier every step" if memory else "disk only"
        print(
            f"{name}: {fig['faults']} faults, {fig['in_job_restarts']} in-job restarts, Slurm {storm.restarts}, "
            f"finished with the uninterrupted run's weights: "
            f"{bool(storm.summary) and storm.summary['params_sha256'] == storm.reference['params_sha256']}"
        )
        per = fig["per_fault"]
        print(_line("all", per))
        for kind in in_job_storm.FAULTS:
            print(_line(kind, [f for f in per if f["fault"] == kind]))
        print(f"  resumed from: {[f['from'] for f in per]}; run directory {storm.run_dir}")
        print("  invariant violations: " + ("none" if not violations else "; ".join(violations)))


if __name__ == "__main__":
    main()
