"""The run directory's journals: events.jsonl (what happened, every attempt) and metrics.jsonl.

Torch-free, so the login-node tools (status, report) read the same files with the same code.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

EVENTS = "events.jsonl"
METRICS = "metrics.jsonl"


def append_jsonl(path: Path, record: dict[str, Any]) -> None:
    """One line per record, written with a single O_APPEND write so concurrent writers never interleave."""
    line = (json.dumps(record, sort_keys=True) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def log_event(run_dir: Path, event: str, step: int, job_id: str, restart: int, **fields: Any) -> None:
    append_jsonl(run_dir / EVENTS, {"time": time.time(), "event": event, "step": step, "job_id": job_id,
                                    "restart": restart, **fields})


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """All complete records; a torn last line (writer killed mid-write) is skipped."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records
