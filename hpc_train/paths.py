"""Every file of a run directory, named once (submitit's JobPaths is the model). Torch-free: the login
node (submit, status, report) and the job read and write the same names through this one object.

    runs/demo-1/
        config.yaml       the resolved config, frozen at submit; attempts re-read it, never recompose
        submission.json   executor, job id, overrides (local runs: the controller's pid and start time)
        code.json         which code validated it (version, package path, git commit); code.diff beside it
        submitit/         submitit's pickles and the per-task logs <job>_<task>_log.out
        checkpoints/      step_NNNNNN/ folders; only those with COMMITTED count
        events.jsonl      what happened, every attempt (docs/lifecycle.md lists the events)
        metrics.jsonl     loss, lr, step time per log interval
        summary.json      final_step, final_loss, params_sha256, written at the end
        placement.json    the rank order the planner chose
        drills/           fault drills armed by `hpc-train chaos` (kill-rank-during-save, slow-storage)
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MARKER = "COMMITTED"  # a checkpoint folder counts once this manifest is in it (checkpoint.py writes it last)
STEP_DIR = re.compile(r"step_(\d+)")


@dataclass(frozen=True)
class RunPaths:
    run_dir: Path

    @property
    def config(self) -> Path:
        return self.run_dir / "config.yaml"

    @property
    def submission(self) -> Path:
        return self.run_dir / "submission.json"

    @property
    def code(self) -> Path:
        return self.run_dir / "code.json"

    @property
    def submitit(self) -> Path:
        return self.run_dir / "submitit"

    @property
    def checkpoints(self) -> Path:
        return self.run_dir / "checkpoints"

    @property
    def events(self) -> Path:
        return self.run_dir / "events.jsonl"

    @property
    def metrics(self) -> Path:
        return self.run_dir / "metrics.jsonl"

    @property
    def summary(self) -> Path:
        return self.run_dir / "summary.json"

    @property
    def placement(self) -> Path:
        return self.run_dir / "placement.json"

    @property
    def report_png(self) -> Path:
        return self.run_dir / "report.png"

    @property
    def drills(self) -> Path:
        return self.run_dir / "drills"

    def failure_claim(self, job_id: str, restart: int) -> Path:
        """Created O_EXCL by the first rank to fail in an attempt: that rank alone decides the requeue."""
        return self.run_dir / f".failed-{job_id}-{restart}"


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:06d}"  # 7+ digits past step 999,999: every reader sorts by number


def step_folders(root: Path) -> dict[int, Path]:
    """Every step folder under root by its step, in numeric order (step_1000000 after step_999980)."""
    if not root.is_dir():
        return {}
    found = {int(m.group(1)): p for p in root.iterdir() if (m := STEP_DIR.fullmatch(p.name)) and p.is_dir()}
    return dict(sorted(found.items()))


def read_marker(folder: Path) -> dict[str, Any] | None:
    """The COMMITTED manifest, or None when it is missing, torn, or not of our shape (never raises): every
    entry a plain file name in this folder with an int size and a sha256, DCP's .metadata and one rank
    file per rank among them, an int world size. A foreign or damaged manifest is skipped, not trusted."""
    try:
        marker = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(marker, dict) or not isinstance(marker.get("files"), dict):
        return None
    files, world = marker["files"], marker.get("world_size")
    shaped = all(
        isinstance(n, str)
        and Path(n).name == n
        and n not in (".", "..")
        and isinstance(e, dict)
        and type(e.get("bytes")) is int
        and e["bytes"] >= 0
        and isinstance(e.get("sha256"), str)
        for n, e in files.items()
    )
    complete = (
        type(world) is int
        and world >= 1
        and ".metadata" in files
        and all(f"rank_{r:05d}.pt" in files for r in range(world))
    )
    return marker if shaped and complete else None
