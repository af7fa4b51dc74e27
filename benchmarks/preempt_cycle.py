"""One preempt -> requeue -> resume cycle on the dev cluster, timed from the run's own events.jsonl.

    .venv/bin/python benchmarks/preempt_cycle.py                 # USR2 (time-limit warning) path
    .venv/bin/python benchmarks/preempt_cycle.py --how high      # real preemption by a `high` job

Prints: cluster `up` time, then for the cycle: signal sent -> ranks agreed (signal event) -> checkpoint
committed -> requeue -> next attempt's start event -> finish, and the steps lost (signal step minus the
step the next attempt resumed at), and the next attempt's start-up: process start -> checkpoint loaded
-> first step done. Figures are printed, never asserted.
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


def events(run_dir: Path) -> list[dict]:
    p = run_dir / "events.jsonl"
    return [json.loads(line) for line in p.read_text().splitlines()] if p.exists() else []


def wait(pred, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise SystemExit("timed out")
        time.sleep(0.1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--how", choices=["usr2", "high"], default="usr2")
    args = ap.parse_args()
    started = not cluster.is_up()
    up_s = cluster.up() if started else float("nan")
    env = cluster.client_env()
    out = Path(tempfile.mkdtemp(prefix="preempt_cycle_"))
    proc = subprocess.run(
        [
            HPC_TRAIN,
            "submit",
            "cluster=dev",
            "cluster.partition=low",
            "train.steps=60",
            "train.min_step_time_s=0.25",
            f"out_dir={out}",
            "name=cycle",
        ],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    job_id = proc.stdout.split()[2].rstrip(";")
    run_dir = out / "cycle-1"
    wait(lambda: any(e["event"] == "checkpoint_committed" for e in events(run_dir)), 120)
    sent = time.time()
    if args.how == "usr2":
        subprocess.run(["scancel", "--signal=USR2", job_id], env=env, check=True)
    else:
        subprocess.run(
            ["sbatch", "-p", "high", "-N", "4", "--exclusive", "-o", "/dev/null", "--wrap", "sleep 2"],
            env=env,
            check=True,
            capture_output=True,
        )
    wait(lambda: (run_dir / "summary.json").exists(), 300)
    ev = events(run_dir)
    first = lambda name, after=0.0: next(e for e in ev if e["event"] == name and e["time"] >= after)  # noqa: E731
    sig = first("signal", sent)
    commit = first("checkpoint_committed", sig["time"])
    requeue = first("requeue", sig["time"])
    restart = first("start", sig["time"])
    resumed_step = first("first_step", restart["time"])
    finish = first("finish")
    print(f"cluster up:                              {up_s:6.1f} s" + ("" if started else " (was already up)"))
    print(f"preempt path:                            {args.how}")
    print(f"signal sent -> all ranks agreed to stop: {sig['time'] - sent:6.2f} s (step {sig['step']})")
    print(f"agreed -> checkpoint committed:          {commit['time'] - sig['time']:6.2f} s")
    print(f"committed -> requeue done:               {requeue['time'] - commit['time']:6.2f} s")
    print(f"requeue -> next attempt started:         {restart['time'] - requeue['time']:6.2f} s")
    print(
        f"next attempt: process start -> resumed:  {restart['time'] - restart['launched_at']:6.2f} s "
        f"(imports, rendezvous, checkpoint load)"
    )
    print(f"resumed -> first step done:              {resumed_step['time'] - restart['time']:6.2f} s")
    print(f"signal sent -> first resumed step done:  {resumed_step['time'] - sent:6.2f} s")
    print(f"steps lost:                              {sig['step'] - restart['step']}")
    print(f"finished at step {finish['final_step']}, params_sha256 {finish['params_sha256'][:16]}...")
    if started:
        cluster.down()


if __name__ == "__main__":
    main()
