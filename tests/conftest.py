"""Shared fixtures: the real Slurm test cluster (session scope) and helpers to drive `hpc-train`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import cluster as test_cluster  # noqa: E402  (tests/cluster.py)

HPC_TRAIN = str(Path(sys.executable).parent / "hpc-train")


@pytest.fixture(scope="session")
def slurm_env() -> dict[str, str]:
    """Start the four-node cluster (or reuse one already up) and stop it after the session if we started it.

    A test that needs the cluster fails, never skips, when it cannot start.
    """
    started = not test_cluster.is_up()
    if started:
        took = test_cluster.up()
        print(f"\n[cluster] up in {took:.1f} s")
    yield test_cluster.client_env()
    if started and not os.environ.get("HPC_TRAIN_KEEP_CLUSTER"):
        test_cluster.down()


def run(cmd: list[str], env: dict[str, str] | None = None, timeout_s: float = 120, **kw: Any) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s, **kw)


def wait_until(predicate: Callable[[], Any], timeout_s: float, what: str, every_s: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def read_events(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def submit(args: list[str], env: dict[str, str] | None = None, cwd: Path | None = None) -> tuple[Path, str]:
    """Run `hpc-train submit ARGS` as a user would; returns (run_dir, job_id)."""
    proc = run([HPC_TRAIN, "submit", *args], env=env, cwd=cwd, timeout_s=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    line = next(l for l in proc.stdout.splitlines() if l.startswith("submitted job"))
    job_id, run_dir = line.split()[2].rstrip(";"), Path(line.split("run directory ")[1])
    return run_dir, job_id


def sacct_state(job_id: str, env: dict[str, str]) -> str:
    out = run(["sacct", "-X", "-n", "-P", "-o", "State", "-j", job_id], env=env).stdout.split()
    return out[0] if out else ""


def wait_finished(run_dir: Path, job_id: str, env: dict[str, str], timeout_s: float = 240) -> dict[str, Any]:
    """Wait for summary.json and for Slurm to call the job COMPLETED; return the summary."""
    wait_until(lambda: (run_dir / "summary.json").exists() or _failed(run_dir), timeout_s,
               f"{run_dir}/summary.json (job {job_id})")
    assert not _failed(run_dir), f"job failed: {[e for e in read_events(run_dir) if e['event'] == 'fail']}"
    wait_until(lambda: sacct_state(job_id, env) == "COMPLETED", 60, f"job {job_id} COMPLETED in sacct")
    return json.loads((run_dir / "summary.json").read_text())


def _failed(run_dir: Path) -> bool:
    return any(e["event"] == "fail" for e in read_events(run_dir))
