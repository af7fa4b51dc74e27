"""Operations on runs that exist: status, logs, cancel, chaos, report, results. Torch-free (login node).

Everything is read from what runs leave in their directories (submission.json, sweep.json,
events.jsonl, metrics.jsonl) plus one Slurm query per refresh; nothing is kept elsewhere.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpc_train.metrics import lead_warning, log_event, read_events, read_metrics
from hpc_train.preempt import budget_changes, excluded_nodes, failures_in_a_row

NO_PROGRESS_WARN_S = 15 * 60


@dataclass
class Run:
    run_dir: Path
    label: str  # "demo-3" or "sweep-2/0004"
    job_id: str
    executor: str
    log_dir: Path  # where submitit wrote the per-task logs
    unreadable: str = ""  # why this user may not read the run's files (another user's owner-only run)
    process: dict[str, Any] | None = None  # local runs: process_identity() of the controller at submit


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
            executor = _executor([Path(t["run_dir"]) for t in manifest["trials"]])
            return [
                Run(
                    Path(t["run_dir"]),
                    f"{path.name}/{Path(t['run_dir']).name}",
                    t["job_id"] or "",
                    executor,
                    path / "submitit",
                    process=t.get("process"),
                )
                for t in manifest["trials"]
            ]
        if (path / "config.yaml").exists():
            if (path.parent / "sweep.json").exists():  # a trial: its sweep, or the sweep's unreadable row
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


def slurm_states(job_ids: list[str], retries: int = 3) -> dict[str, str]:
    """State per job id: one sacct call, then squeue for what accounting has not caught up with yet."""
    from hpc_train import slurm

    ids = [j for j in job_ids if j]
    if not ids:
        return {}
    out: dict[str, str] = {}
    sacct = ["sacct", "-X", "-n", "-P", "-j", ",".join(ids), "-o", "JobID,State"]
    for line in slurm.call(sacct, retries=retries).splitlines():
        if "|" in line:
            job, state = line.split("|")[:2]
            out[job] = state.split()[0]
    missing = [j for j in ids if j not in out]
    if missing:
        for line in slurm.call(["squeue", "-h", "-j", ",".join(missing), "-o", "%i|%T"], retries=retries).splitlines():
            job, state = line.split("|")
            out[job] = state
    return out


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


def since_resume(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The events after the last `hpc-train resume` (all of them if never resumed): how it ended before no
    longer says how it is now."""
    last = max((i for i, e in enumerate(events) if e["event"] == "resume"), default=-1)
    return events[last + 1 :]


def local_state(run: Run, events: list[dict[str, Any]]) -> str:
    names = [e["event"] for e in since_resume(events)]
    if "finish" in names:
        return "COMPLETED"
    if "stopped" in names:
        return "CANCELLED" if "cancel" in names else "FAILED"
    if local_pid(run):
        return "RUNNING"
    return "FAILED" if "fail" in names else "UNKNOWN"


def attempts(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per attempt (by restart count): launch, start, first step, end times, what ended it, and its size
    (world_size, nodes, grad_accum_steps, global_batch_seqs: from the start event; None before it) (pure)."""
    by_restart: dict[int, list[dict[str, Any]]] = {}
    for e in events:
        by_restart.setdefault(int(e.get("restart", 0)), []).append(e)
    out = []
    for restart in sorted(by_restart):
        evs = by_restart[restart]
        start = next((e for e in evs if e["event"] == "start"), None)
        launched = start.get("launched_at", start["time"]) if start else min(e["time"] for e in evs)
        first = next((e for e in evs if e["event"] == "first_step"), None)
        commits = [e for e in evs if e["event"] == "checkpoint_committed"]
        ended = next(
            (e["event"] for e in reversed(evs) if e["event"] in ("finish", "requeue", "stopped", "fail")), "running"
        )
        out.append(
            {
                "restart": restart,
                "launched": launched,
                "job_id": next((e["job_id"] for e in evs if e.get("job_id")), None),  # a `resume` event has none yet
                "start": start["time"] if start else None,
                "start_step": start["step"] if start else None,
                "first_step": first["time"] if first else None,
                "end": max(e["time"] for e in evs),
                "ended_by": ended,
                "reached_step": max([e["step"] for e in evs] + [start["step"] if start else 0]),
                "committed_step": max((e["step"] for e in commits), default=None),
                "stall_s": sum(
                    e.get("stall_s", 0.0) if e.get("reason") == "periodic" else e.get("save_s", 0.0) for e in commits
                ),
                "signals": [s for e in evs if e["event"] == "signal" for s in e.get("signals", [])],
                "nodes_next": next((e.get("nodes_next") for e in evs if e["event"] == "requeue"), None),  # elastic
                **{
                    k: start.get(k) if start else None
                    for k in ("world_size", "nodes", "grad_accum_steps", "global_batch_seqs")
                },
                # start-up, phase by phase (job.py): python, imports, rendezvous, preflight, setup, verify, load,
                # first step
                "phases_s": {
                    **(start.get("phases_s", {}) if start else {}),
                    **({"first_step": first["step_time_s"]} if first and "step_time_s" in first else {}),
                },
            }
        )
    return out


def size_text(att: dict[str, Any]) -> str:
    """An attempt's size for `report`: "4 on node1,node3" (ranks on nodes); past 4 nodes, their count."""
    if not att.get("world_size"):
        return "-"
    nodes = att.get("nodes") or []
    return f"{att['world_size']} on {','.join(nodes) if len(nodes) <= 4 else f'{len(nodes)} nodes'}"


def batch_text(atts: list[dict[str, Any]]) -> list[str] | None:
    """Per attempt "32 seqs x1" (global batch, micro-batches per step) when it differs between attempts
    (an elastic resume accumulates more, or a batch_changed one steps fewer sequences), else None."""
    seen = {(a.get("global_batch_seqs"), a.get("grad_accum_steps")) for a in atts if a.get("world_size")}
    if len(seen) < 2:
        return None
    return [
        f"{a['global_batch_seqs']} seqs x{a['grad_accum_steps']}" if a.get("global_batch_seqs") else "-" for a in atts
    ]


def goodput(events: list[dict[str, Any]], metrics: list[dict[str, Any]], live: bool = False) -> dict[str, float]:
    """Where the allocated time went, in seconds; the parts add up to the attempts' wall time (pure).

    allocated   launch of each attempt -> its last event
    overhead    launch -> training starts (imports, rendezvous, checkpoint load)
    stall       the loop blocked by checkpoint saves
    lost        training on steps no checkpoint kept (recomputed by the next attempt)
    committed   the rest: training that became committed progress
    queue_wait  requeue -> next launch (not allocated; reported beside)

    live: an attempt still running ends at its last metrics row, not its last event (a checkpoint,
    minutes ago), so Prometheus' gauge moves between events; the steps since its last commit count as lost.
    """
    atts = attempts(events)
    last_row = metrics[-1] if metrics else {}
    if (
        live
        and atts
        and atts[-1]["ended_by"] == "running"
        and isinstance(last_row.get("time"), (int, float))
        and last_row["time"] > atts[-1]["end"]
        and isinstance(last_row.get("step"), int)
    ):
        atts[-1] = {
            **atts[-1],
            "end": last_row["time"],
            "reached_step": max(atts[-1]["reached_step"], last_row["step"]),
        }
    step_times = sorted(m["step_time_s"] for m in metrics if isinstance(m.get("step_time_s"), (int, float)))
    step_s = step_times[len(step_times) // 2] if step_times else 0.0
    parts = {"allocated": 0.0, "overhead": 0.0, "stall": 0.0, "lost": 0.0, "committed": 0.0, "queue_wait": 0.0}
    for i, a in enumerate(atts):
        wall = a["end"] - a["launched"]
        overhead = (a["start"] - a["launched"]) if a["start"] else wall
        kept = a["committed_step"] if a["committed_step"] is not None else (a["start_step"] or 0)
        lost = min(max(0.0, (a["reached_step"] - kept) * step_s), max(0.0, wall - overhead - a["stall_s"]))
        parts["allocated"] += wall
        parts["overhead"] += overhead
        parts["stall"] += min(a["stall_s"], wall - overhead)
        parts["lost"] += lost
        parts["committed"] += max(0.0, wall - overhead - a["stall_s"] - lost)
        if i + 1 < len(atts):
            parts["queue_wait"] += max(0.0, atts[i + 1]["launched"] - a["end"])
    parts["goodput"] = parts["committed"] / parts["allocated"] if parts["allocated"] else 0.0
    return parts


def slurm_states_or_error(job_ids: list[str], retry_after_s: float = 1.0) -> tuple[dict[str, str], str]:
    """slurm_states, asked a second time when it fails: status is a read, safe to repeat, and slurm.call
    retries only timeouts and the errors it knows as transient. Each ask lets slurm.call retry once,
    so a controller that never answers costs 4 tries of 30 s, as one call with its default 3 retries
    did. After both fail: no states, and the whole error for the user (the controller may be down:
    status still shows what the run directories say)."""
    if not [j for j in job_ids if j]:
        return {}, ""
    for attempt in range(2):
        try:
            return slurm_states(job_ids, retries=1), ""
        except Exception as e:  # SlurmError, or output we could not parse
            error = str(e).strip()
            if attempt == 0:
                time.sleep(retry_after_s)
    return {}, error


COLUMNS = (
    "run",
    "job_id",
    "state",
    "attempts",
    "restarts",
    "world_size",
    "committed_step",
    "total_steps",
    "tokens_per_s",
    "mfu",
    "val_loss",
    "goodput",
    "since_last_event_s",
    "warnings",
    "stragglers",
    "last_straggler",
)


def stragglers(events: list[dict[str, Any]]) -> tuple[int, str]:
    """(straggler events in the run, the last one named as "rank R on NODE", with "(now)" while it is
    not cleared in the latest attempt; "" when none) (pure)."""
    from hpc_train.straggler import current

    named = [e for e in events if e["event"] == "straggler"]
    if not named:
        return 0, ""
    last = named[-1]
    now = current(events).get(last["rank"]) is last
    return len(named), f"rank {last['rank']} on {last['node']}{' (now)' if now else ''}"


def status_rows(runs: list[Run]) -> list[dict[str, Any]]:
    slurm_ids = [r.job_id for r in runs if r.executor == "slurm"]
    states, state_error = slurm_states_or_error(slurm_ids)
    rows = []
    for r in runs:
        import yaml

        try:
            cfg = {} if r.unreadable else yaml.safe_load((r.run_dir / "config.yaml").read_text())
        except PermissionError as e:
            r.unreadable = denied(Path(e.filename or r.run_dir))
        except FileNotFoundError:  # a trial folder someone deleted: a row that says so, not a traceback
            rows.append(
                {
                    **dict.fromkeys(COLUMNS),
                    "run": r.label,
                    "job_id": r.job_id,
                    "state": "missing",
                    "warnings": [f"{r.run_dir / 'config.yaml'} does not exist (deleted?)"],
                }
            )
            continue
        if r.unreadable:
            rows.append(
                {
                    **dict.fromkeys(COLUMNS),
                    "run": r.label,
                    "job_id": r.job_id,
                    "state": "unreadable: permission denied",
                    "warnings": [r.unreadable],
                }
            )
            continue
        events, metrics = read_events(r.run_dir), read_metrics(r.run_dir)
        state = (
            states.get(r.job_id, "PENDING" if r.job_id else "NOT QUEUED")
            if r.executor == "slurm"
            else local_state(r, events)
        )
        commits = [e["step"] for e in events if e["event"] == "checkpoint_committed"]
        last = max((e["time"] for e in events), default=None)
        atts = attempts(events)
        warnings = []
        if cfg["cluster"]["executor"] == "slurm":
            lead = lead_warning([r.run_dir], cfg["cluster"]["signal_lead_s"])
            warnings += ["signal lead too short"] if lead else []
        failures = failures_in_a_row(events)  # what the job's requeue decision counts
        max_failures = {**cfg["requeue"], **budget_changes(events)}["max_failures"]  # hpc-train resume may raise it
        if failures and failures >= max_failures - 1:
            warnings.append(f"failure budget {failures}/{max_failures} used")
        warnings += [f"requeue failed: {e['error']}" for e in events[-3:] if e["event"] == "requeue_failed"]
        if state == "RUNNING" and last is not None and time.time() - last > NO_PROGRESS_WARN_S:
            warnings.append(f"no event for {(time.time() - last) / 60:.0f} min")
        if any(e["event"] == "stopped" for e in since_resume(events)):
            warnings.append(next(e["reason"] for e in since_resume(events) if e["event"] == "stopped"))
        rows.append(
            {
                "run": r.label,
                "job_id": r.job_id,
                "state": state,
                "attempts": len(atts),
                "restarts": max((a["restart"] for a in atts), default=0),
                "world_size": next(
                    (a["world_size"] for a in reversed(atts) if a["world_size"]), None
                ),  # cluster.min_nodes
                "committed_step": max(commits, default=None),
                "total_steps": cfg["train"]["steps"],
                "tokens_per_s": metrics[-1].get("tokens_per_s") if metrics else None,
                "mfu": metrics[-1].get("mfu") if metrics else None,
                "val_loss": next(
                    (m["val_loss"] for m in reversed(metrics) if "val_loss" in m), None
                ),  # eval_every_steps
                "goodput": round(goodput(events, metrics)["goodput"], 3) if atts else None,
                "since_last_event_s": round(time.time() - last, 1) if last else None,
                "warnings": warnings,
                "excluded_nodes": excluded_nodes(events),  # node -> why (preflight, hardware error)
                **dict(zip(("stragglers", "last_straggler"), stragglers(events))),
            }
        )
        if state_error and r.executor == "slurm":  # shown once below the table, in full
            rows[-1].update(state="unknown", state_error=state_error)
    return rows


def print_status(rows: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table()
    for col in (
        "run",
        "job",
        "state",
        "attempts",
        "restarts",
        "ranks",
        "step",
        "tokens/s",
        "MFU",
        "val loss",
        "goodput",
        "last event",
        "stragglers",
        "warnings",
    ):
        table.add_column(col)
    for r in rows:
        step = f"{r['committed_step'] if r['committed_step'] is not None else '-'}/{r['total_steps'] or '-'}"
        since = f"{r['since_last_event_s']:.0f} s ago" if r["since_last_event_s"] is not None else "-"
        counts = [
            "-" if r.get(k) is None else str(r[k]) for k in ("attempts", "restarts", "world_size")
        ]  # None: unreadable
        table.add_row(
            r["run"],
            r["job_id"],
            r["state"],
            *counts,
            step,
            f"{r['tokens_per_s']:,.0f}" if r["tokens_per_s"] else "-",
            f"{r['mfu']:.1%}" if isinstance(r["mfu"], (int, float)) else "n/a",  # rich renders str only
            f"{r['val_loss']:.4f}" if isinstance(r["val_loss"], (int, float)) else "-",
            f"{r['goodput']:.1%}" if r["goodput"] is not None else "-",
            since,
            f"{r['stragglers']}: {r['last_straggler']}" if r.get("stragglers") else "-",
            "; ".join(r["warnings"]),
        )
    console = Console(width=220)
    console.print(table)
    for r in rows:  # a line per excluded node, below the table: the reasons are sentences
        for node, why in (r.get("excluded_nodes") or {}).items():
            console.print(f"{r['run']}: {node} left out: {why}", markup=False, highlight=False, soft_wrap=True)
    for error in dict.fromkeys(r["state_error"] for r in rows if r.get("state_error")):
        console.print(f"state unknown: {error}", markup=False, highlight=False, soft_wrap=True)


RESULT_COLUMNS = ("trial", "state", "step", "final_loss", "val_loss", "goodput", "run_dir")


def results_rows(sweep_dir: Path) -> list[dict[str, Any]]:
    """One row per trial of a sweep, in sweep.json's order: its overrides (key -> value as typed), the
    state and goodput of its status row, the last step and loss logged (summary.json's final_loss once
    it finished), and the last val_loss in metrics.jsonl, if the run evaluates."""
    if not (sweep_dir / "sweep.json").exists():
        raise ValueError(
            f"{sweep_dir} is not a sweep directory (no sweep.json); give the folder "
            f"`hpc-train submit -m ...` printed, e.g. runs/mix-1"
        )
    runs = find_runs(sweep_dir)
    if any(r.unreadable for r in runs):
        raise ValueError(next(r.unreadable for r in runs if r.unreadable))
    trials = json.loads((sweep_dir / "sweep.json").read_text())["trials"]
    rows = []
    for trial, run, status in zip(trials, runs, status_rows(runs)):
        metrics = read_metrics(run.run_dir)
        summary_path = run.run_dir / "summary.json"
        summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
        losses = [m for m in metrics if isinstance(m.get("loss"), (int, float))]
        vals = [m["val_loss"] for m in metrics if isinstance(m.get("val_loss"), (int, float))]
        rows.append(
            {
                "trial": run.run_dir.name,
                "overrides": {k: v for k, _, v in (o.partition("=") for o in trial["overrides"])},
                "state": status["state"],
                "step": summary.get("final_step", losses[-1]["step"] if losses else None),
                "final_loss": summary.get("final_loss", losses[-1]["loss"] if losses else None),
                "val_loss": vals[-1] if vals else None,
                "goodput": status["goodput"],
                "run_dir": str(run.run_dir),
            }
        )
    return rows


def sort_results(rows: list[dict[str, Any]], key: str, reverse: bool = False) -> list[dict[str, Any]]:
    """Rows sorted by a column or an override key (numbers as numbers: "3e-4" < "1e-3"); rows without
    a value last either way (a trial that has not logged a loss yet)."""
    keys = [*RESULT_COLUMNS, *dict.fromkeys(k for r in rows for k in r["overrides"])]
    if key not in keys:
        raise ValueError(f"--sort {key}: no such column; use one of {', '.join(keys)}")

    def get(row: dict[str, Any]) -> Any:
        return row[key] if key in RESULT_COLUMNS else row["overrides"].get(key)

    def value(row: dict[str, Any]) -> tuple[int, float, str]:
        try:
            return (0, float(get(row)), "")
        except (TypeError, ValueError):
            return (1, 0.0, str(get(row)))

    present = sorted((r for r in rows if get(r) is not None), key=value, reverse=reverse)
    return present + [r for r in rows if get(r) is None]


def print_results(rows: list[dict[str, Any]], title: str, fmt: str) -> None:
    """fmt "table" (overrides every trial shares go in the title), "json" or "csv" (every override)."""
    overrides = list(dict.fromkeys(k for r in rows for k in r["overrides"]))
    if fmt == "json":
        print(json.dumps(rows, indent=1))
        return
    if fmt == "csv":
        import csv

        writer = csv.writer(sys.stdout, lineterminator="\n")
        writer.writerow(["trial", *overrides, *RESULT_COLUMNS[1:]])
        for r in rows:
            writer.writerow(
                [
                    r["trial"],
                    *(r["overrides"].get(k, "") for k in overrides),
                    *("" if r[c] is None else r[c] for c in RESULT_COLUMNS[1:]),
                ]
            )
        return
    from rich.console import Console
    from rich.table import Table

    varying = [k for k in overrides if len({r["overrides"].get(k) for r in rows}) > 1]
    common = " ".join(f"{k}={rows[0]['overrides'][k]}" for k in overrides if k not in varying)
    table = Table(title=title)
    for col in ("trial", *varying, "state", "step", "final loss", "val loss", "goodput"):
        table.add_column(col)
    for r in rows:
        table.add_row(
            r["trial"],
            *(r["overrides"].get(k, "-") for k in varying),
            r["state"],
            "-" if r["step"] is None else str(r["step"]),
            *("-" if r[k] is None else f"{r[k]:.4f}" for k in ("final_loss", "val_loss")),
            "-" if r["goodput"] is None else f"{r['goodput']:.1%}",
        )
    console = Console(width=220)
    console.print(table)
    if common:
        console.print(f"in every trial: {common}", markup=False, highlight=False, soft_wrap=True)


def log_path(run: Run, rank: int) -> Path:
    """submitit's file for this rank: <job>_<rank>_log.out, or <array>_<task>_<rank>_log.out."""
    path = run.log_dir / f"{run.job_id}_{rank}_log.out"
    if run.log_dir.exists() and not os.access(run.log_dir, os.R_OK | os.X_OK):  # else exists() says False
        raise ValueError(denied(run.log_dir))
    if not path.exists():
        raise ValueError(
            f"no log for rank {rank} of {run.label} at {path}; has the job started? "
            f"(ranks: {sorted(p.name for p in run.log_dir.glob(f'{run.job_id}_*_log.out'))})"
        )
    return path


def attempt_section(text: str, attempt: int | None) -> str:
    """The lines of one attempt: each attempt's ranks print `==== hpc_train attempt K rank R ====` first."""
    if attempt is None:
        return text
    out, inside = [], False
    for line in text.splitlines(keepends=True):
        if line.startswith("==== hpc_train attempt "):
            inside = line.split()[3] == str(attempt)
        if inside:
            out.append(line)
    return "".join(out)


def current_attempt(run_dir: Path) -> int:
    """The restart count of the last attempt that started (or that `hpc-train resume` submitted), else 0."""
    starts = [e for e in read_events(run_dir) if e["event"] in ("start", "resume")]
    return int(starts[-1]["restart"]) if starts else 0


def cancel(runs: list[Run]) -> list[str]:
    """scancel exactly these runs' Slurm jobs; SIGTERM to each local run's controller while it is still the
    process submit recorded (a local run that ended is left alone). Returns the job ids cancelled."""
    from hpc_train import slurm

    mine = [r for r in runs if r.job_id and (r.executor == "slurm" or local_pid(r))]
    for r in mine:  # first: the ranks look for it when they stop, and it precedes what they log
        log_event(r.run_dir, "cancel", -1, r.job_id, current_attempt(r.run_dir), by="hpc-train cancel")
    slurm_ids = sorted({r.job_id for r in mine if r.executor == "slurm"})
    if slurm_ids:
        slurm.call(["scancel", *slurm_ids])
    for r in mine:
        pid = local_pid(r) if r.executor == "local" else None
        # SIGTERM: submitit's controller forwards it to every task, which save at the next step and stop.
        # SIGINT (no handler there) would kill the controller, which then kills the ranks unsaved.
        if pid:
            with contextlib.suppress(ProcessLookupError):  # it exited a moment ago
                os.kill(pid, signal.SIGTERM)
    return [r.job_id for r in mine]


CHAOS = {  # action -> what it injects; recorded as a `chaos` event
    "time-limit": "USR2 to every task, as Slurm's time-limit warning",
    "preempt": "SIGTERM to every task, as a preemption",
    "batch-term": "SIGTERM to the batch shell only (scancel --batch), as --signal=B:TERM or an operator",
    "requeue": "scontrol requeue",
    "kill-rank": "SIGKILL to one rank",
    "lose-node": "SIGKILL to every rank on one node, as a lost node",
    "kill-rank-during-save": "the last rank SIGKILLs itself in the middle of its next save (once)",
    "slow-storage": "every later checkpoint write takes --seconds longer (0: back to normal)",
    "corrupt-checkpoint": "one byte flipped in the newest committed checkpoint (the next resume skips it)",
    "sick-node": "--node (else rank --rank's node) fails every later preflight until RUN/drills/sick_node.NODE goes",
    "slow-rank": "rank --rank works --seconds longer each step, as a slow GPU or core (0: back to normal)",
}
DRILLS = (
    "kill-rank-during-save",
    "slow-storage",
    "corrupt-checkpoint",
    "sick-node",
    "slow-rank",
)  # files in the run dir: local runs too


def chaos(run: Run, action: str, rank: int = 0, seconds: float | None = None, node: str = "") -> str:
    """Inject a fault into a running job (or arm a drill the job fires) and record it in events.jsonl."""
    from hpc_train import slurm
    from hpc_train.paths import RunPaths, read_marker, step_dir, step_folders

    if action not in CHAOS:
        raise ValueError(f"chaos action {action!r}: use one of {list(CHAOS)}")
    if run.executor != "slurm" and action not in DRILLS:
        raise ValueError(
            f"{run.label} runs on the local executor; chaos {action} needs Slurm (cluster=dev); "
            f"local runs take {', '.join(DRILLS)}"
        )
    paths = RunPaths(run.run_dir)
    events = read_events(run.run_dir)
    start = next((e for e in reversed(events) if e["event"] == "start"), None)
    what = CHAOS[action]
    if action in ("time-limit", "preempt", "batch-term"):
        signal_arg = ["--signal=USR2"] if action == "time-limit" else ["--signal=TERM"]
        slurm.call(["scancel", *signal_arg, *(["--batch"] if action == "batch-term" else []), run.job_id])
    elif action == "requeue":
        slurm.call(["scontrol", "requeue", run.job_id])
    elif action in ("kill-rank-during-save", "slow-storage"):
        paths.drills.mkdir(exist_ok=True)
        drill = paths.drills / action.replace("-", "_")
        if action == "slow-storage":
            drill, seconds = paths.drills / "slow_storage", 2.0 if seconds is None else seconds
            if seconds <= 0:
                drill.unlink(missing_ok=True)
            else:
                drill.write_text(f"{seconds}\n")
            what = f"checkpoint writes {seconds:g} s slower" if seconds > 0 else "checkpoint writes at normal speed"
        else:
            drill.write_text("armed\n")
    elif action == "sick-node":  # a file on the shared filesystem: the node's own preflight finds it
        if not node and (start is None or "rank_nodes" not in start):
            raise ValueError(f"{run.label} has not started yet, so rank {rank} has no node: give --node NAME")
        ranks = start["rank_nodes"] if start and "rank_nodes" in start else []
        if not node and not 0 <= rank < len(ranks):
            raise ValueError(f"--rank {rank}: {run.label}'s last attempt has ranks 0..{len(ranks) - 1}")
        if node and ranks and node not in ranks:  # a typo would arm a drill that never fires
            raise ValueError(
                f"--node {node}: {run.label}'s last attempt ran on {', '.join(dict.fromkeys(ranks))}; name one of them"
            )
        node = node or ranks[rank]
        paths.drills.mkdir(exist_ok=True)
        (paths.drills / f"sick_node.{node}").write_text("armed\n")
        what = f"{node} fails every later preflight (rm {paths.drills / f'sick_node.{node}'} to heal it)"
    elif action == "slow-rank":  # the rank re-reads it once per straggler window (train.py)
        from hpc_train.straggler import MAX_SLOW_RANK_S

        world = start.get("world_size") if start else None
        if seconds is None or not 0 <= seconds <= MAX_SLOW_RANK_S:  # NaN and inf fail this too
            given = "needs --seconds" if seconds is None else f"--seconds {seconds:g}"
            raise ValueError(
                f"chaos slow-rank {given}: give the extra seconds per step, 0 to "
                f"{MAX_SLOW_RANK_S:g} (0: back to normal), e.g. --seconds 0.02"
            )
        if not isinstance(world, int) or not 0 <= rank < world:
            raise ValueError(
                f"chaos slow-rank --rank {rank}: "
                + (
                    f"{run.label} has {world} ranks; give 0 to {world - 1}"
                    if isinstance(world, int)
                    else f"{run.label} has not started yet, so its ranks are "
                    f"unknown; try again once `hpc-train status` shows it running"
                )
            )
        paths.drills.mkdir(exist_ok=True)
        drill = paths.drills / f"slow_rank_{rank}"
        if seconds <= 0:
            drill.unlink(missing_ok=True)
        else:
            drill.write_text(f"{seconds}\n")
        what = f"rank {rank} works {seconds:g} s more per step" if seconds > 0 else f"rank {rank} at normal speed"
    elif action == "corrupt-checkpoint":
        committed = [(s, m) for s, f in step_folders(paths.checkpoints).items() if (m := read_marker(f))]
        if not committed:
            raise ValueError(f"{run.label} has no committed checkpoint to corrupt yet")
        step, marker = committed[-1]
        name = max(marker["files"], key=lambda n: marker["files"][n]["bytes"])
        target = step_dir(paths.checkpoints, step) / name
        with open(target, "r+b") as f:  # same size, one byte changed: only the checksum can tell
            f.seek(marker["files"][name]["bytes"] // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))
        what = f"one byte flipped in {target.relative_to(run.run_dir)}"
    else:
        if start is None or "pids" not in start:
            raise ValueError(f"{run.label} has not started yet (no start event with rank pids); try again shortly")
        nodes, pids = start["rank_nodes"], start["pids"]
        targets = (
            [(nodes[rank], pids[rank])]
            if action == "kill-rank"
            else [(n, p) for n, p in zip(nodes, pids) if n == nodes[rank]]
        )
        numeric = slurm.call(["squeue", "-h", "-j", run.job_id, "-o", "%A"]).split()  # array task -> its own id
        if not numeric:
            raise ValueError(f"job {run.job_id} is not running; nothing to kill")
        # Through Slurm, so it works on a real cluster's compute node too; one step for all of the node's ranks:
        # the first SIGKILL fails the job, whose requeue revokes the credential a second srun needs (on loaded
        # cores it came first: "Task launch ... failed on node node2: Job credential revoked").
        slurm.call(
            ["srun", "--overlap", f"--jobid={numeric[0]}", "-w", targets[0][0], "-N1", "-n1", "kill", "-KILL"]
            + [str(pid) for _, pid in targets],
            timeout_s=60,
            retries=0,
        )
        what = (
            f"SIGKILL to rank {rank} (pid {pids[rank]} on {nodes[rank]})"
            if action == "kill-rank"
            else f"SIGKILL to every rank on {nodes[rank]} ({len(targets)} processes), as a lost node"
        )
    log_event(
        run.run_dir,
        "chaos",
        start["step"] if start else -1,
        run.job_id,
        current_attempt(run.run_dir),
        action=action,
        injected=what,
    )
    return what


def straggler_rows(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each `straggler` event with the step its `straggler_cleared` came at (None: still slow, or the
    attempt ended first) (pure): what `report` lists."""
    rows = []
    for i, e in enumerate(events):
        if e["event"] == "straggler":
            cleared = next(
                (
                    c["step"]
                    for c in events[i + 1 :]
                    if c["event"] == "straggler_cleared"
                    and c["rank"] == e["rank"]
                    and c.get("restart") == e.get("restart")
                ),
                None,
            )
            rows.append(
                {
                    "attempt": e.get("restart", 0),
                    "step": e["step"],
                    "rank": e["rank"],
                    "node": e["node"],
                    "own_ms": e["own_s"] * 1e3,
                    "median_ms": e["median_own_s"] * 1e3,
                    "comm_ms": e.get("comm_s", 0.0) * 1e3,
                    "cleared_step": cleared,
                }
            )
    return rows


def report_marks(atts: list[dict[str, Any]], metrics: list[dict[str, Any]]) -> dict[str, Any]:
    """What the report's axes show, chosen without drawing (pure): one integer tick per attempt, the
    attempt boundaries (seconds since the first launch; the step each later attempt resumed from), and
    a tokens/s axis from 0, so 0.3 tok/s of noise on 4,000 stays a flat line instead of a cliff."""
    t0 = atts[0]["launched"] if atts else 0.0
    rates = [m["tokens_per_s"] for m in metrics if isinstance(m.get("tokens_per_s"), (int, float))]
    return {
        "t0": t0,
        "attempt_ticks": [a["restart"] for a in atts],
        "boundaries_s": [a["launched"] - t0 for a in atts[1:]],
        "boundary_steps": [a["start_step"] for a in atts[1:] if a["start_step"] is not None],
        "tokens_per_s_ylim": (0.0, max(rates, default=0.0) * 1.1 or 1.0),  # 10% headroom above the top point
    }


def report(run: Run, png: Path | None) -> tuple[dict[str, float], list[dict[str, Any]], str]:
    """Goodput parts, attempts, and the PNG path written ('' when matplotlib is missing)."""
    events, metrics = read_events(run.run_dir), read_metrics(run.run_dir)
    parts, atts = goodput(events, metrics), attempts(events)
    if png is None:
        return parts, atts, ""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return parts, atts, "matplotlib is not installed: pip install 'hpc_train[plot]' (or matplotlib) for the PNG"
    png.parent.mkdir(parents=True, exist_ok=True)
    marks = report_marks(atts, metrics)
    t0 = marks["t0"]
    fig, (ax_t, ax_l, ax_s) = plt.subplots(3, 1, figsize=(10, 8), height_ratios=[1.2, 1, 1])
    for k, a in enumerate(atts):
        ax_t.barh(
            a["restart"],
            a["end"] - a["launched"],
            left=a["launched"] - t0,
            color="#9ecae1",
            label="training" if k == 0 else None,
        )
        if a["start"]:
            ax_t.barh(
                a["restart"],
                a["start"] - a["launched"],
                left=a["launched"] - t0,
                color="#fdae6b",
                label="start-up" if k == 0 else None,
            )
    commits = [e for e in events if e["event"] == "checkpoint_committed"]
    ax_t.scatter(
        [e["time"] - t0 for e in commits],
        [e["restart"] for e in commits],
        marker="|",
        s=200,
        color="green",
        label="checkpoint committed",
    )
    sig = [e for e in events if e["event"] in ("signal", "chaos", "fail")]
    ax_t.scatter(
        [e["time"] - t0 for e in sig],
        [e["restart"] for e in sig],
        marker="x",
        s=80,
        color="red",
        label="signal / injected / failure",
    )
    ax_t.set_yticks(marks["attempt_ticks"])
    ax_t.set(
        xlabel="seconds since first launch", ylabel="attempt", title=f"{run.label}: goodput {parts['goodput']:.1%}"
    )
    ax_t.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)  # beside the bars, never over them
    ax_l.plot([m["step"] for m in metrics], [m.get("loss", float("nan")) for m in metrics], ".-")
    ax_l.set(xlabel="step", ylabel="loss")
    ax_s.plot([m["time"] - t0 for m in metrics], [m.get("tokens_per_s", 0) for m in metrics], ".-")
    ax_s.set(
        xlabel="seconds since first launch", ylabel="tokens/s", ylim=marks["tokens_per_s_ylim"], xlim=ax_t.get_xlim()
    )  # the same clock as the timeline above, boundaries aligned
    for ax, xs in ((ax_t, marks["boundaries_s"]), (ax_s, marks["boundaries_s"]), (ax_l, marks["boundary_steps"])):
        for k, x in enumerate(xs):
            ax.axvline(
                x, color="gray", linestyle="--", linewidth=1, label="next attempt" if k == 0 and ax is ax_l else None
            )
    if marks["boundary_steps"]:
        ax_l.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return parts, atts, str(png)


def stderr_path(out: Path) -> Path:
    """The rank's stderr beside its stdout: <job>_<rank>_log.err (tracebacks, warnings, stack dumps)."""
    return out.with_name(out.name.removesuffix(".out") + ".err")


def has_output(text: str) -> bool:
    """More than the attempt headers job.py prints to both streams."""
    return any(line.strip() and not line.startswith("==== hpc_train attempt ") for line in text.splitlines())


# Slurm states after which nothing more is written to a job's logs. Not PREEMPTED: our jobs are requeued.
FINAL_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "BOOT_FAIL", "DEADLINE")


# `logs -f` stops after squeue and sacct have both known nothing of the job for this long: a job id never
# recorded, or one that left accounting. 60 s: sacct may lag a fresh sbatch by a few seconds, never a minute.
UNKNOWN_GIVE_UP_S = 60.0


def run_ended(run: Run, unknown_since: list[float] | None = None) -> bool:
    """Whether the run's ranks will write no more: a local controller that is gone (it outlives every
    attempt of its ranks), or a Slurm job in a final state (a requeue goes through PENDING, not final).
    With unknown_since (a list this keeps its first time in): also once Slurm has not known the job for
    UNKNOWN_GIVE_UP_S, saying so on stderr."""
    if run.executor != "slurm":
        return local_pid(run) is None
    try:
        state = slurm_states([run.job_id], retries=0).get(run.job_id, "")
    except Exception as e:  # no answer this time: keep following, ask again at the next check
        if "invalid job id" not in str(e).lower():  # squeue's answer for a job it does not hold
            return False
        state = ""
    if state or unknown_since is None:
        if unknown_since:
            unknown_since.clear()
        return state.rstrip("+") in FINAL_STATES
    unknown_since[:] = unknown_since or [time.monotonic()]
    if time.monotonic() - unknown_since[0] < UNKNOWN_GIVE_UP_S:
        return False
    print(
        f"hpc-train logs: stopped following: neither squeue nor sacct has known job "
        f"{run.job_id or '(none recorded)'} for {UNKNOWN_GIVE_UP_S:.0f} s (never queued, or gone from "
        f"accounting); see `hpc-train status {run.run_dir}`",
        file=sys.stderr,
        flush=True,
    )
    return True


def follow(
    streams: list[tuple[Path, int, str]],
    last_label: str,
    ended: Callable[[], bool],
    check_every_s: float,
    every_s: float = 0.5,
) -> None:
    """`tail -f` of several files (path, bytes already shown, label), each chunk under its label whenever
    the stream changes; returns on Ctrl-C, or once ended() says nothing more will be written and what
    was written before that is shown."""
    files: dict[Path, Any] = {}
    next_check = 0.0  # at once: following a run that has ended prints what is left and returns
    try:
        while True:
            done = False
            if time.monotonic() >= next_check:  # asked before reading, so the last read sees every last line
                done, next_check = ended(), time.monotonic() + check_every_s
            quiet = True
            for path, offset, label in streams:
                if path not in files:
                    if not path.exists():
                        continue
                    files[path] = open(path, errors="replace")  # noqa: SIM115  (closed below)
                    files[path].seek(offset)
                chunk = files[path].read()
                if chunk:
                    if label != last_label:
                        print(label, flush=True)
                        last_label = label
                    print(chunk, end="", flush=True)
                    quiet = False
            if done:
                return
            if quiet:
                time.sleep(every_s)
    except KeyboardInterrupt:
        return
    finally:
        for f in files.values():
            f.close()
