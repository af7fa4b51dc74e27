"""A long seeded team storm on the dev cluster (tests/team_storm.py): two shells on one sweep under a fault
storm. Figures are printed, never asserted; the invariants are checked and any violation printed. Every
command the shells ran (argv, exit code, output) goes to <storm dir>/commands.json.

    .venv/bin/python benchmarks/team_storm_bench.py --actions 40 --faults 12 --seed 7
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import cluster  # noqa: E402
import team_storm  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--actions", type=int, default=40, help="actions per shell, after its first")
    ap.add_argument("--faults", type=int, default=12)
    ap.add_argument("--steps", type=int, default=600, help="train.steps of each trial")
    ap.add_argument("--seed", type=int, default=int(os.environ.get("HPC_TRAIN_TEAM_STORM_SEED", time.time() % 10_000)))
    args = ap.parse_args()
    started = not cluster.is_up()
    if started:
        cluster.up()
    load0 = os.getloadavg()
    try:
        out = Path(tempfile.mkdtemp(prefix="team_storm_"))
        result = team_storm.run_storm(
            cluster.client_env(), out, args.seed, args.actions, args.faults, args.steps, settle_s=600
        )
        fig, violations = team_storm.figures(result), team_storm.check(result)
    finally:
        if started:
            cluster.down()
    commands = [dataclasses.asdict(c) for c in result.commands]
    (out / "commands.json").write_text(
        json.dumps({"plans": result.plans, "faults": result.faults, "commands": commands})
    )
    print(f"seed {args.seed} (replay: HPC_TRAIN_TEAM_STORM_SEED={args.seed}); sweep {result.sweep_dir}")
    print(f"wall time {fig['wall_s'] / 60:.1f} min; load average before {load0[0]:.2f}, after {os.getloadavg()[0]:.2f}")
    print(f"commands run per kind: {fig['commands']} (longest, s: {fig['command_s_max']})")
    print(f"refused with exit 2: {fig['refused']}, of which 'being submitted or resumed': {fig['refused_busy']}")
    print(f"jobs refused by the lease (lease_refused): {fig['lease_refused']}")
    print(f"faults injected: {fig['faults']} ({fig['faults_skipped']} skipped: no trial ready within 60 s)")
    print(
        f"attempts {fig['attempts']}, requeues {fig['requeues']}, checkpoints deleted {fig['checkpoints_deleted']}, "
        f"trials finished {fig['finished']}/{team_storm.TRIALS}"
    )
    print(
        f"squeue samples {fig['squeue_samples']}, most live jobs of one trial in a sample: "
        f"{fig['most_live_jobs_per_trial']}"
    )
    print("invariant violations: " + ("none" if not violations else "; ".join(violations)))


if __name__ == "__main__":
    main()
