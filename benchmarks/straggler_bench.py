"""Straggler detection delay on the dev cluster: steps and seconds from arming the slow-rank drill to the
`straggler` event, for a few amounts of extra work per step.

    .venv/bin/python benchmarks/straggler_bench.py                       # 2 nodes x 2 ranks, rank 3 slowed
    .venv/bin/python benchmarks/straggler_bench.py --every 10 --windows 2

One run (model=tiny, straggler.factor=1.5, floor_s=0.002): for each amount, `hpc-train chaos RUN
slow-rank --rank 3 --seconds S`, wait for the event (or give up after 60 s: "not named"), then the drill
off and wait for `straggler_cleared`. Steps and seconds are counted from the `chaos` event (written just
after the drill file): steps from the last metrics row logged before it, so up to log_every_steps=10
more than the true delay. The bound the design promises is
(windows + 1) x every_steps. Never asserts. All four "nodes" share this machine's cores.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import cluster  # noqa: E402

HPC_TRAIN = str(Path(sys.executable).parent / "hpc-train")


def rows(path: Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            out.append(json.loads(line))
        except ValueError:  # a line being written
            pass
    return out


def wait_for(run_dir: Path, name: str, after: int, timeout_s: float) -> dict | None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = [e for e in rows(run_dir / "events.jsonl")[after:] if e["event"] == name]
        if found:
            return found[0]
        time.sleep(0.2)
    return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--every", type=int, default=20, help="straggler.every_steps")
    ap.add_argument("--windows", type=int, default=3, help="straggler.windows")
    ap.add_argument("--seconds", default="0.003,0.005,0.01,0.02,0.05", help="extra work per step on rank 3")
    args = ap.parse_args()
    started = not cluster.is_up()
    if started:
        cluster.up()
    env = cluster.client_env()
    out = Path(tempfile.mkdtemp(prefix="straggler_"))
    subprocess.run(
        [
            HPC_TRAIN,
            "submit",
            "cluster=dev",
            "cluster.nodes=2",
            "train.steps=100000",
            "checkpoint.every_steps=5000",
            f"straggler.every_steps={args.every}",
            f"straggler.windows={args.windows}",
            f"out_dir={out}",
            "name=bench",
        ],
        env=env,
        check=True,
        capture_output=True,
    )
    run_dir = out / "bench-1"
    while not any(m["step"] >= 200 for m in rows(run_dir / "metrics.jsonl")):  # past start-up and warm-up
        time.sleep(0.5)
    print(f"bound: (windows + 1) x every_steps = {(args.windows + 1) * args.every} steps")
    print(f"{'extra ms':>8s} {'own ms':>7s} {'others ms':>9s} {'x':>5s} {'steps':>6s} {'seconds':>8s}")
    for seconds in (float(s) for s in args.seconds.split(",")):
        n_events = len(rows(run_dir / "events.jsonl"))
        subprocess.run(
            [HPC_TRAIN, "chaos", str(run_dir), "slow-rank", "--rank", "3", "--seconds", str(seconds)],
            env=env,
            check=True,
            capture_output=True,
        )
        t0 = wait_for(run_dir, "chaos", n_events, 10)["time"]  # written just after the drill file
        armed_step = max(m["step"] for m in rows(run_dir / "metrics.jsonl") if m["time"] <= t0)
        named = wait_for(run_dir, "straggler", n_events, 60)
        subprocess.run(
            [HPC_TRAIN, "chaos", str(run_dir), "slow-rank", "--rank", "3", "--seconds", "0"],
            env=env,
            check=True,
            capture_output=True,
        )
        if named is None:
            print(f"{seconds * 1e3:8.1f} {'-':>7s} {'-':>9s} {'-':>5s} {'not named in 60 s':>15s}")
            time.sleep(3 * args.every * 0.05)  # let the slow windows pass before the next amount
            continue
        print(
            f"{seconds * 1e3:8.1f} {named['own_s'] * 1e3:7.1f} {named['median_own_s'] * 1e3:9.1f} "
            f"{named['own_s'] / named['median_own_s']:5.1f} {named['step'] - armed_step:6d} {named['time'] - t0:8.1f}"
        )
        wait_for(run_dir, "straggler_cleared", n_events, 120)
    subprocess.run([HPC_TRAIN, "cancel", str(run_dir)], env=env, capture_output=True)
    if started:
        cluster.down()


if __name__ == "__main__":
    main()
