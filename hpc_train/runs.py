"""Which runs a path names, and whether they are still alive: a run directory, a sweep, or a folder of
them, read from what submit left there (submission.json, sweep.json); a local run's controller told apart
from a later process given its pid; cancel. Torch-free (login node).
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import signal
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpc_train import journal, pipeline, slurm

# Beside a run's config.yaml, one at least (code.json: submit freezes it with the config; a sweep's trial has no
# submission.json or submitit/ of its own, nor an events.jsonl until a rank wrote one)
RUN_FILES = ("events.jsonl", "submission.json", "submitit", "code.json")


@dataclass
class Run:
    run_dir: Path
    label: str  # "demo-3" or "sweep-2/0004"
    job_id: str
    executor: str
    log_dir: Path  # where submitit wrote the per-task logs
    unreadable: str = ""  # why this user may not read the run's files (another user's owner-only run)
    process: dict[str, Any] | None = None  # local runs: process_identity() of the controller at submit
    brief: dict[str, Any] | None = None  # a sweep's trial: what status reads of its config (status.brief)


def denied(path: Path) -> str:
    """One line for a file of another user's run: submit makes them owner-only when cluster.env is set."""
    try:
        owner = pwd.getpwuid(path.stat().st_uid).pw_name
    except (OSError, KeyError):
        owner = "its owner"
    return (
        f"cannot read {path}: permission denied (owner-only, as the run's cluster.env holds values); "
        f"run this as {owner}"
    )


def find_runs(path: Path) -> list[Run]:
    """A run directory, a sweep directory, or a folder holding either (one level down)."""
    path = path.resolve()
    try:
        if (path / "sweep.json").exists():
            manifest = json.loads((path / "sweep.json").read_text())
            first = manifest["trials"][0] if manifest["trials"] else {}
            executor = (first.get("brief") or {}).get("executor") or _executor(
                [Path(t["run_dir"]) for t in manifest["trials"]]
            )
            return [
                Run(
                    Path(t["run_dir"]),
                    f"{path.name}/{Path(t['run_dir']).name}",
                    t["job_id"] or "",
                    executor,
                    path / "submitit",
                    process=t.get("process"),
                    brief=t.get("brief"),
                )
                for t in manifest["trials"]
            ]
        # a run's frozen config with what submit wrote beside it: not Hydra's conf/config.yaml
        in_sweep = (path.parent / "sweep.json").exists()
        if (path / "config.yaml").exists() and (in_sweep or any((path / f).exists() for f in RUN_FILES)):
            if in_sweep:  # a trial: its sweep, or the sweep's unreadable row
                return [r for r in find_runs(path.parent) if r.run_dir == path or r.unreadable]
            sub = json.loads((path / "submission.json").read_text()) if (path / "submission.json").exists() else {}
            return [
                Run(
                    path,
                    path.name,
                    sub.get("job_id", ""),
                    sub.get("executor", "slurm"),
                    path / "submitit",
                    process=sub.get("process"),
                )
            ]
    except PermissionError as e:
        return [Run(path, path.name, "", "?", path / "submitit", unreadable=denied(Path(e.filename or path)))]
    if path.is_dir():
        return [r for child in sorted(path.iterdir()) if child.is_dir() for r in find_runs(child)]
    raise ValueError(f"{path} is not a run directory, a sweep directory or a folder of them; give e.g. runs/demo-1")


def _executor(run_dirs: list[Path]) -> str:
    """The sweep's executor, from the first trial whose config.yaml is still there (one may be deleted)."""
    import yaml

    for run_dir in run_dirs:
        try:
            return yaml.safe_load((run_dir / "config.yaml").read_text())["cluster"]["executor"]
        except FileNotFoundError:
            continue
    return "slurm"


def process_identity(pid: int) -> dict[str, Any] | None:
    """What tells this process from a later one given the same pid: its start time (field 22 of
    /proc/<pid>/stat, clock ticks after boot) and the boot's id. None when no such process runs."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()  # the name may hold ") "
        boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None
    if fields[0] == "Z":  # exited; its parent has not reaped it yet
        return None
    # fields[0] is field 3; the host: a pid says nothing on another machine (resume refuses there)
    return {"start_time": int(fields[19]), "boot_id": boot_id, "host": socket.gethostname()}


def local_pid(run: Run) -> int | None:
    """The pid of a local run's controller while it is the process submit recorded; None once it exited,
    even if the pid now belongs to another process."""
    if not run.job_id.isdigit() or run.process is None:
        return None
    now = process_identity(int(run.job_id)) or {}
    return int(run.job_id) if all(now.get(k) == v for k, v in run.process.items()) else None  # older: no host


def cancel(runs: list[Run]) -> tuple[list[str], list[str]]:
    """scancel exactly these runs' Slurm jobs; SIGTERM to each local run's controller while it is still the
    process submit recorded (a local run that ended is left alone). Then the runs queued after one that did not
    finish are told, and those queued :ok cancelled too (pipeline.settle_dependents, one Slurm query for all:
    pipeline.waiting takes Slurm's own cancel of them, which says nothing); not when the scancel failed, which
    leaves these runs as they were. Returns (the job ids cancelled, a sentence per run queued after them)."""
    mine = [r for r in runs if r.job_id and (r.executor == "slurm" or local_pid(r))]
    unfinished = []
    for r in mine:  # first: the ranks look for it when they stop, and it precedes what they log
        events = journal.read(r.run_dir)
        journal.log(r.run_dir, journal.CANCEL, -1, r.job_id, journal.current_attempt(events), by="hpc-train cancel")
        unfinished += [] if journal.finished(events) else [r.run_dir]
    slurm_ids = sorted({r.job_id for r in mine if r.executor == "slurm"})
    if slurm_ids:
        slurm.scancel(slurm_ids)
    for r in mine:
        pid = local_pid(r) if r.executor == "local" else None
        # SIGTERM: submitit's controller forwards it to every task, which save at the next step and stop.
        # SIGINT (no handler there) would kill the controller, which then kills the ranks unsaved.
        if pid:
            with contextlib.suppress(ProcessLookupError):  # it exited a moment ago
                os.kill(pid, signal.SIGTERM)
    # then the runs queued after them, but those cancelled here too (their `cancel` says why)
    said = pipeline.settle_dependents(unfinished, "cancelled by hpc-train cancel") if unfinished else []
    return [r.job_id for r in mine], said
