"""What the benchmarks that drive the dev cluster (tests/cluster.py) share: its module, the CLI, a run's
events, a bounded wait and a Slurm client call."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import cluster  # noqa: E402,F401  (tests/cluster.py, for the benchmarks that import it from here)

HPC_TRAIN = str(Path(sys.executable).parent / "hpc-train")


def events(run_dir: Path) -> list[dict]:
    p = run_dir / "events.jsonl"
    return [json.loads(line) for line in p.read_text().splitlines()] if p.exists() else []


def wait(pred: Callable[[], object], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.2)


def sh(args: list[str], env: dict[str, str]) -> str:
    return subprocess.run(args, env=env, capture_output=True, text=True, check=True).stdout.strip()
