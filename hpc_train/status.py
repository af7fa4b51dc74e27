"""`hpc-train status` and `results`: one row per run (or per trial of a sweep), from what the run wrote
(config.yaml, events.jsonl, metrics.jsonl, summary.json) plus one Slurm query per refresh (slurm.job_states).
Torch-free (login node).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from hpc_train import journal, slurm
from hpc_train.metrics import lead_warning, read_metrics
from hpc_train.runs import Run, denied, find_runs, local_pid

NO_PROGRESS_WARN_S = 15 * 60


def slurm_states_or_error(job_ids: list[str], retry_after_s: float = 1.0) -> tuple[dict[str, str], str]:
    """slurm.job_states, asked a second time when it fails: status is a read, safe to repeat, and slurm.call
    retries only timeouts and the errors it knows as transient. Each ask lets slurm.call retry once,
    so a controller that never answers costs 4 squeue tries of 30 s, as one call with its default 3
    retries did. After both fail: no states, and the whole error for the user (the controller may be down:
    status still shows what the run directories say)."""
    if not [j for j in job_ids if j]:
        return {}, ""
    for attempt in range(2):
        try:
            return slurm.job_states(job_ids, retries=1), ""
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
    named = journal.named(events, journal.STRAGGLER)
    if not named:
        return 0, ""
    last = named[-1]
    now = journal.stragglers_now(events).get(last["rank"]) is last
    return len(named), f"rank {last['rank']} on {last['node']}{' (now)' if now else ''}"


def _total_steps(cfg: dict[str, Any], events: list[dict[str, Any]], metrics: list[dict[str, Any]]) -> int | None:
    """The run's own total: what its loop told (Attempt.step_end's last_step; a script's `total_steps` in
    script_helper.log), else train.steps for the built-in trainer only; a function's or a script's train.steps
    is not theirs (none)."""
    told = journal.total_steps(events)
    if told is None:
        told = next((m["total_steps"] for m in reversed(metrics) if type(m.get("total_steps")) is int), None)
    builtin = not (cfg.get("script") or {}).get("cmd") and not (cfg.get("fn") or {}).get("_target_")
    return told if told is not None else (cfg["train"]["steps"] if builtin else None)


def status_rows(runs: list[Run]) -> list[dict[str, Any]]:
    import yaml

    slurm_ids = [r.job_id for r in runs if r.executor == "slurm"]
    states, state_error = slurm_states_or_error(slurm_ids)
    rows = []
    for r in runs:
        try:
            cfg = {} if r.unreadable else yaml.safe_load((r.run_dir / "config.yaml").read_text())
        except PermissionError as e:
            r.unreadable = denied(Path(e.filename or r.run_dir))
        except FileNotFoundError:  # a trial folder someone deleted: a row that says so, not a traceback
            missing = f"{r.run_dir / 'config.yaml'} does not exist (deleted?)"
            rows.append({**dict.fromkeys(COLUMNS), "run": r.label, "job_id": r.job_id, "state": "missing"})
            rows[-1]["warnings"] = [missing]
            continue
        if r.unreadable:
            rows.append({**dict.fromkeys(COLUMNS), "run": r.label, "job_id": r.job_id})
            rows[-1].update(state="unreadable: permission denied", warnings=[r.unreadable])
            continue
        events = journal.read(r.run_dir)
        state = (
            states.get(r.job_id, "PENDING" if r.job_id else "NOT QUEUED")
            if r.executor == "slurm"
            else journal.local_state(events, local_pid(r) is not None)
        )
        rows.append(_row(r, cfg, events, state))
        if state_error and r.executor == "slurm":  # shown once below the table, in full
            rows[-1].update(state="unknown", state_error=state_error)
    return rows


def _warnings(r: Run, cfg: dict[str, Any], events: list[dict[str, Any]], state: str) -> list[str]:
    """What needs a person: a signal lead too short, the failure budget nearly spent, a failed requeue, no event
    for a while, the reason the run stopped."""
    warnings = []
    if cfg["cluster"]["executor"] == "slurm" and lead_warning([r.run_dir], cfg["cluster"]["signal_lead_s"]):
        warnings.append("signal lead too short")
    failures = journal.failures_in_a_row(events)  # what the job's requeue decision counts
    max_failures = {**cfg["requeue"], **journal.budget_changes(events)}["max_failures"]  # resume may raise it
    if failures and failures >= max_failures - 1:
        warnings.append(f"failure budget {failures}/{max_failures} used")
    warnings += [f"requeue failed: {e['error']}" for e in journal.named(events[-3:], journal.REQUEUE_FAILED)]
    last = max((e["time"] for e in events), default=None)
    if state == "RUNNING" and last is not None and time.time() - last > NO_PROGRESS_WARN_S:
        warnings.append(f"no event for {(time.time() - last) / 60:.0f} min")
    if stopped := journal.stopped(events):
        warnings.append(stopped["reason"])
    return warnings


def _row(r: Run, cfg: dict[str, Any], events: list[dict[str, Any]], state: str) -> dict[str, Any]:
    metrics = read_metrics(r.run_dir)
    last = max((e["time"] for e in events), default=None)
    atts = journal.attempts(events)
    return {
        "run": r.label,
        "job_id": r.job_id,
        "state": state,
        "attempts": len(atts),
        "restarts": max((a["restart"] for a in atts), default=0),
        # cluster.min_nodes: the latest attempt's
        "world_size": next((a["world_size"] for a in reversed(atts) if a["world_size"]), None),
        "committed_step": journal.committed_step(events),
        "total_steps": _total_steps(cfg, events, metrics),
        "tokens_per_s": metrics[-1].get("tokens_per_s") if metrics else None,
        "mfu": metrics[-1].get("mfu") if metrics else None,
        "val_loss": next((m["val_loss"] for m in reversed(metrics) if "val_loss" in m), None),  # eval_every_steps
        "goodput": round(journal.goodput(events, metrics)["goodput"], 3) if atts else None,
        "since_last_event_s": round(time.time() - last, 1) if last else None,
        "warnings": _warnings(r, cfg, events, state),
        "excluded_nodes": journal.excluded_nodes(events),  # node -> why (preflight, hardware error)
        "in_job_restarts": len(journal.in_job_restarts(events)),  # hot spares (cluster.spare_nodes)
        # of them, the ranks that survived rejoined in their processes (cluster.in_process_restart)
        "in_process_restarts": sum(bool(e.get("in_process")) for e in journal.in_job_restarts(events)),
        "spares_left": journal.spares_left(events, cfg["cluster"].get("spare_nodes", 0)),
        # the latest attempt that started: where it resumed from ("memory (step S)", "step_000040", None)
        "resumed": next(((a["restart"], a["resumed_from"]) for a in reversed(atts) if a["start"]), None),
        **dict(zip(("stragglers", "last_straggler"), stragglers(events))),
    }


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
    for r in rows:
        if r.get("in_job_restarts"):
            console.print(
                f"{r['run']}: {r['in_job_restarts']} in-job restart(s)"
                + (f" ({r['in_process_restarts']} in process)" if r.get("in_process_restarts") else "")
                + f"; {r['spares_left']:.0f} spare node(s) left",
                markup=False,
                highlight=False,
            )
    for r in rows:
        if r.get("resumed") and r["resumed"][1]:
            attempt, where = r["resumed"]
            console.print(f"{r['run']}: attempt {attempt} resumed from {where}", markup=False, highlight=False)
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
