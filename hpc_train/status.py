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

from hpc_train import journal, slurm, stages
from hpc_train.metrics import lead_warning_of, read_metrics
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


def own_steps(cfg: dict[str, Any]) -> int | None:
    """train.steps for the built-in trainer; None for a function or a script, whose loop is not ours (pure)."""
    builtin = not (cfg.get("script") or {}).get("cmd") and not (cfg.get("fn") or {}).get("_target_")
    return cfg["train"]["steps"] if builtin else None


BRIEF_KEYS = {"executor", "signal_lead_s", "spare_nodes", "max_failures", "steps"}


def brief(cfg: dict[str, Any]) -> dict[str, Any]:
    """What a status row reads of a run's frozen config (pure). submit keeps each trial's in sweep.json, so
    that status of a 10,000-trial sweep parses no config.yaml: PyYAML takes 5 to 13 ms a file here, 50 s
    and more for the sweep. A run alone, or a sweep submitted before, is read from its config.yaml."""
    return {
        "executor": cfg["cluster"]["executor"],
        "signal_lead_s": cfg["cluster"]["signal_lead_s"],
        "spare_nodes": cfg["cluster"].get("spare_nodes", 0),
        "max_failures": cfg["requeue"]["max_failures"],
        "steps": own_steps(cfg),
    }


def _total_steps(steps: int | None, events: list[dict[str, Any]], metrics: list[dict[str, Any]]) -> int | None:
    """The run's own total: what its loop told (Attempt.step_end's last_step; a script's `total_steps` in
    script_helper.log), else `steps` (own_steps: the built-in trainer's train.steps, else none)."""
    told = journal.total_steps(events)
    if told is None:
        told = next((m["total_steps"] for m in reversed(metrics) if type(m.get("total_steps")) is int), None)
    return told if told is not None else steps


def _brief_of(r: Run) -> dict[str, Any]:
    """The trial's brief as submit recorded it, else read from its config.yaml (OSError: none to read)."""
    import yaml

    if r.brief is not None and set(r.brief) == BRIEF_KEYS:  # another version's brief: read the config instead
        if not r.run_dir.is_dir():  # 5 us, where the yaml read below would have failed
            raise FileNotFoundError(r.run_dir / "config.yaml")
        return r.brief
    try:
        return brief(yaml.safe_load((r.run_dir / "config.yaml").read_text()))
    except PermissionError as e:
        r.unreadable = denied(Path(e.filename or r.run_dir))
        raise


def status_rows(runs: list[Run]) -> list[dict[str, Any]]:
    """One row per run (COLUMNS and more). Reads each run's events.jsonl once, and its metrics.jsonl only
    once it has an event: a trial still queued costs one failed open."""
    slurm_ids = [r.job_id for r in runs if r.executor == "slurm"]
    states, state_error = slurm_states_or_error(slurm_ids)
    rows = []
    for r in runs:
        try:
            facts = {} if r.unreadable else _brief_of(r)
        except PermissionError:
            facts = {}
        except FileNotFoundError:  # a trial folder someone deleted: a row that says so, not a traceback
            missing = f"{r.run_dir / 'config.yaml'} does not exist (deleted?)"
            rows.append({**dict.fromkeys(COLUMNS), "run": r.label, "job_id": r.job_id, "state": "missing"})
            rows[-1]["warnings"] = [missing]
            continue
        if not r.unreadable:
            try:
                events = journal.read(r.run_dir)
                metrics = read_metrics(r.run_dir) if events else []
            except PermissionError as e:  # a trial made owner-only after its brief was written
                r.unreadable = denied(Path(e.filename or r.run_dir))
        if r.unreadable:
            rows.append({**dict.fromkeys(COLUMNS), "run": r.label, "job_id": r.job_id})
            rows[-1].update(state="unreadable: permission denied", warnings=[r.unreadable])
            continue
        if not r.job_id and (r.executor == "slurm" or not events):  # still to be queued (a local sweep's: run)
            state = "NOT QUEUED"
        elif r.executor == "slurm":
            # Neither squeue nor sacct knows a pending array task once it is cancelled (22.05 drops it from the
            # array): the run's own cancel tells. Else a job neither knows yet is one just queued.
            state = states.get(r.job_id) or ("CANCELLED" if journal.cancelled(events) else "PENDING")
        else:
            state = journal.local_state(events, local_pid(r) is not None)
        rows.append(_row(r, facts, events, metrics, state))
        if state_error and r.executor == "slurm":  # shown once below the table, in full
            rows[-1].update(state="unknown", state_error=state_error)
    chains = stages.chain(runs)  # the runs queued after others (submit --after): their stages as they stand
    for r, row in zip(runs, rows):
        row["after"] = chains.get(r.run_dir, [])
    return rows


def _warnings(
    facts: dict[str, Any], events: list[dict[str, Any]], metrics: list[dict[str, Any]], state: str
) -> list[str]:
    """What needs a person: a signal lead too short, the failure budget nearly spent, a failed requeue, no event
    for a while, the reason the run stopped."""
    warnings = []
    if facts["executor"] == "slurm" and lead_warning_of([(events, metrics)], facts["signal_lead_s"]):
        warnings.append("signal lead too short")
    failures = journal.failures_in_a_row(events)  # what the job's requeue decision counts
    max_failures = journal.budget_changes(events).get("max_failures", facts["max_failures"])  # resume may raise it
    if failures and failures >= max_failures - 1:
        warnings.append(f"failure budget {failures}/{max_failures} used")
    warnings += [f"requeue failed: {e['error']}" for e in journal.named(events[-3:], journal.REQUEUE_FAILED)]
    last = max((e["time"] for e in events), default=None)
    if state == "RUNNING" and last is not None and time.time() - last > NO_PROGRESS_WARN_S:
        warnings.append(f"no event for {(time.time() - last) / 60:.0f} min")
    if stopped := journal.stopped(events):
        warnings.append(stopped["reason"])
    return warnings


def _row(
    r: Run, facts: dict[str, Any], events: list[dict[str, Any]], metrics: list[dict[str, Any]], state: str
) -> dict[str, Any]:
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
        "finished": journal.finished(events) is not None,
        "total_steps": _total_steps(facts["steps"], events, metrics),
        "tokens_per_s": metrics[-1].get("tokens_per_s") if metrics else None,
        "mfu": metrics[-1].get("mfu") if metrics else None,
        # eval_every_steps
        "val_loss": next(
            (m["val_loss"] for m in reversed(metrics) if isinstance(m.get("val_loss"), (int, float))), None
        ),
        # the last loss logged, as (step, loss): results' until summary.json holds the final one
        "last_loss": next(
            ((m["step"], m["loss"]) for m in reversed(metrics) if isinstance(m.get("loss"), (int, float))), None
        ),
        "goodput": _rounded(journal.goodput(events, metrics)["goodput"]) if atts else None,  # None: unknown
        "since_last_event_s": round(time.time() - last, 1) if last else None,
        "warnings": _warnings(facts, events, metrics, state),
        "excluded_nodes": journal.excluded_nodes(events),  # node -> why (preflight, hardware error)
        "in_job_restarts": len(journal.in_job_restarts(events)),  # hot spares (cluster.spare_nodes)
        # of them, the ranks that survived rejoined in their processes (cluster.in_process_restart)
        "in_process_restarts": sum(bool(e.get("in_process")) for e in journal.in_job_restarts(events)),
        "spares_left": journal.spares_left(events, facts["spare_nodes"]),
        # the latest attempt that started: where it resumed from ("memory (step S)", "step_000040", None)
        "resumed": next(((a["restart"], a["resumed_from"]) for a in reversed(atts) if a["start"]), None),
        **dict(zip(("stragglers", "last_straggler"), stragglers(events))),
        # checkpoint.every_steps=auto: the interval chosen last, and why (intervals.py); None: a fixed one
        "interval": (chosen := journal.last(events, journal.INTERVAL)) and chosen.get("why"),
    }


# A sweep of more trials than this is shown at a glance: its counts, then only the trials that need a person.
GLANCE_ROWS = 20
# Width for output that is not a terminal (a pipe, a file, a capture): what a 100-column terminal shows.
PLAIN_WIDTH = 100
WIDE_WIDTH = 220


def console(wide: bool = False) -> Any:
    """rich's Console at the terminal's width (PLAIN_WIDTH when not a terminal); WIDE_WIDTH for --wide."""
    from rich.console import Console

    if wide:
        return Console(width=WIDE_WIDTH)
    # a pipe or a file: a 100-column terminal's, whatever COLUMNS says (what a script parses stays put)
    return Console(width=None if sys.stdout.isatty() else PLAIN_WIDTH)


def needs_a_person(row: dict[str, Any]) -> bool:
    """A row someone should look at (pure): a state neither live, COMPLETED nor still to be queued (failed,
    cancelled, timed out, missing, unknown) of a run that did not finish, a warning (a stop's reason, a spent
    budget, no event for a while), a straggler now, a node left out (its note is printed for the rows shown).
    Not a state Slurm could not tell: that error is said once."""
    # the counts show those; a run that finished needs no one, whatever Slurm says of its job since
    bad_state = row["state"] not in (*slurm.ACTIVE_STATES, "COMPLETED", "NOT QUEUED") and not row.get("finished")
    if row.get("state_error"):  # Slurm did not answer: said once below the table, not for every trial
        bad_state = False
    straggler = str(row.get("last_straggler") or "").endswith("(now)")
    return bad_state or bool(row.get("warnings")) or straggler or bool(row.get("excluded_nodes"))


def glance(trials: list[dict[str, Any]]) -> list[str]:
    """A sweep's trials in a few lines (pure): the count by state, the steps done of those known, the mean
    goodput of the trials that ran, and the slowest running ones."""
    counts: dict[str, int] = {}
    for r in trials:
        counts[r["state"]] = counts.get(r["state"], 0) + 1
    by_state = ", ".join(f"{n:,} {state}" for state, n in sorted(counts.items(), key=lambda kv: -kv[1]))
    known = [r for r in trials if r.get("total_steps")]
    done = sum(min(r["committed_step"] or 0, r["total_steps"]) for r in known)
    total = sum(r["total_steps"] for r in known)
    ran = [r["goodput"] for r in trials if r.get("goodput") is not None]
    lines = [f"{len(trials):,} trials: {by_state}"]
    if total:
        unknown = f" ({len(trials) - len(known):,} without a known total)" if len(known) < len(trials) else ""
        lines.append(f"steps committed: {done:,} of {total:,} ({done / total:.1%}){unknown}")
    if ran:
        lines.append(f"goodput: {sum(ran) / len(ran):.1%}, the mean of the {len(ran):,} trials that ran")
    running = [r for r in trials if r["state"] == "RUNNING" and r.get("tokens_per_s")]
    if len(running) > 1:
        slow = sorted(running, key=lambda r: r["tokens_per_s"])[:3]
        lines.append("slowest running: " + ", ".join(f"{r['run']} ({r['tokens_per_s']:,.0f} tokens/s)" for r in slow))
    return lines


def _rounded(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def print_status(rows: list[dict[str, Any]], wide: bool = False, every: bool = False) -> None:
    """The table (wide: every column), and each sweep of more than GLANCE_ROWS trials at a glance (its
    counts, then only its trials that need a person; every: all of them), then a line per note."""
    out = console(wide)
    sweeps: dict[str, list[dict[str, Any]]] = {}
    for r in rows:  # a trial's label is SWEEP/NNNN
        sweeps.setdefault(r["run"].rpartition("/")[0], []).append(r)
    shown = []
    for sweep, members in sweeps.items():
        if not sweep or every or len(members) <= GLANCE_ROWS:
            shown += members
            continue
        flagged = [r for r in members if needs_a_person(r)]
        for line in glance(members):
            out.print(f"{sweep}: {line}", markup=False, highlight=False)
        listed = f" (the first {GLANCE_ROWS} below)" if len(flagged) > GLANCE_ROWS else " (below)" * bool(flagged)
        out.print(f"{sweep}: {len(flagged):,} need a person{listed}; every trial: --all", markup=False, highlight=False)
        shown += flagged[:GLANCE_ROWS]
    if shown:
        _print_table(out, shown, wide)
    _print_notes(out, shown, wide)
    for error in dict.fromkeys(r["state_error"] for r in rows if r.get("state_error")):
        out.print(f"state unknown: {error}", markup=False, highlight=False, soft_wrap=True)


def short(n: float | None) -> str:
    """A count in at most 5 characters, rounded down (pure): 9999, 12k, 999k, 1.2M; "-" for none."""
    if n is None:
        return "-"
    if abs(n) < 10_000:
        return f"{n:.0f}"
    if abs(n) < 1_000_000:  # rounded down: 999,600 of 1,000,000 is not done
        return f"{int(n // 1000)}k"
    return f"{int(n // 100_000) / 10:g}M"


def ago(seconds: float | None) -> str:
    """How long ago, in the unit that reads best (pure): 40 s, 12 min, 5 h, 3 d."""
    if seconds is None:
        return "-"
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= 2 * size:
            return f"{seconds / size:.0f} {unit} ago"
    return f"{seconds:.0f} s ago"


def _cells(wide: bool) -> list[tuple[str, Any, str]]:
    """(header, the cell of a row, when it is shown: "always", "some" (a row has a value) or "wide") of each
    column. A 100-column terminal gets the few that matter, counts shortened (the warnings and a straggler
    now go below the table, as sentences: _print_notes); --wide every column, exact."""
    number = (lambda n: "-" if n is None else str(n)) if wide else short

    def step(r: dict[str, Any]) -> str:
        return f"{number(r['committed_step'])}/{number(r['total_steps'] or None)}"

    def count(key: str) -> Any:
        return lambda r: "-" if r.get(key) is None else str(r[key])  # None: unreadable

    def warnings(r: dict[str, Any]) -> str:
        return "; ".join(r["warnings"] or [])

    def tokens(r: dict[str, Any]) -> str:
        return "-" if not r["tokens_per_s"] else f"{r['tokens_per_s']:,.0f}" if wide else short(r["tokens_per_s"])

    def mfu(r: dict[str, Any]) -> str:  # n/a on CPU: no peak FLOP/s to divide by
        return f"{r['mfu']:.1%}" if isinstance(r["mfu"], (int, float)) else "n/a" if wide else "-"

    def goodput(r: dict[str, Any]) -> str:  # unknown: a script that tells no steps left no checkpoint file
        return f"{r['goodput']:.1%}" if r["goodput"] is not None else "unknown" if r.get("attempts") else "-"

    def val_loss(r: dict[str, Any]) -> str:
        return f"{r['val_loss']:.4f}" if isinstance(r["val_loss"], (int, float)) else "-"

    always, some = "always", "some"  # some: when a row has a value
    return [
        ("run", lambda r: r["run"], always),
        ("job", lambda r: r["job_id"], "wide"),  # every hpc-train command takes the run; sacct the job
        ("state", lambda r: r["state"], always),
        ("attempts", count("attempts"), always),
        ("restarts", count("restarts"), "wide"),
        ("ranks", count("world_size"), "wide"),
        ("step", step, always),
        ("tokens/s", tokens, some),
        ("MFU", mfu, some),
        ("val loss", val_loss, "wide"),
        ("goodput", goodput, always),
        ("last event", lambda r: ago(r["since_last_event_s"]), always),
        ("stragglers", lambda r: f"{r['stragglers']}: {r['last_straggler']}" if r.get("stragglers") else "-", "wide"),
        ("warnings", warnings, "wide"),  # else sentences below the table (_print_notes): they read whole there
    ]


def _print_table(out: Any, rows: list[dict[str, Any]], wide: bool) -> None:
    from rich.table import Table

    columns = []
    for header, cell, when in _cells(wide):
        values = [cell(r) for r in rows]
        if when == "always" or wide or (when == "some" and any(v != "-" for v in values)):
            columns.append((header, values))
    table = Table()
    for header, _ in columns:  # squeezed, a cell wraps whole: never cut (a label or a count read wrong)
        table.add_column(header, overflow="fold", min_width=12 if header == "run" else None)
    for i in range(len(rows)):
        table.add_row(*(values[i] for _, values in columns))
    out.print(table)


def _print_notes(out: Any, rows: list[dict[str, Any]], wide: bool = False) -> None:
    """Below the table, a line per note: the reasons are sentences. The warnings too, unless --wide put them in
    the table."""
    for r in [] if wide else rows:
        straggler = str(r.get("last_straggler") or "")
        now = [f"straggler {straggler}"] if straggler.endswith("(now)") else []
        for warning in [*(r.get("warnings") or []), *now]:
            out.print(f"{r['run']}: {warning}", markup=False, highlight=False)
    for r in rows:
        for node, why in (r.get("excluded_nodes") or {}).items():
            out.print(f"{r['run']}: {node} left out: {why}", markup=False, highlight=False, soft_wrap=True)
    for r in rows:
        if r.get("in_job_restarts"):
            out.print(
                f"{r['run']}: {r['in_job_restarts']} in-job restart(s)"
                + (f" ({r['in_process_restarts']} in process)" if r.get("in_process_restarts") else "")
                + f"; {r['spares_left']:.0f} spare node(s) left",
                markup=False,
                highlight=False,
            )
    said = set()
    for r in rows:  # a sweep's trials share their stages: one line
        line = f"{r['run'].rpartition('/')[0] or r['run']}: {stages.chain_text(r['after'])}" if r.get("after") else ""
        if line and line not in said:
            said.add(line)
            out.print(line, markup=False, highlight=False, soft_wrap=True)
    for r in rows:
        if r.get("interval"):
            out.print(f"{r['run']}: checkpoint interval (auto): {r['interval']}", markup=False, highlight=False)
    for r in rows:
        if r.get("resumed") and r["resumed"][1]:
            attempt, where = r["resumed"]
            out.print(f"{r['run']}: attempt {attempt} resumed from {where}", markup=False, highlight=False)


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
        try:
            summary = json.loads((run.run_dir / "summary.json").read_text())
        except FileNotFoundError:  # not finished: an open that fails is all a queued trial costs
            summary = {}
        step, loss = status.get("last_loss") or (None, None)
        rows.append(
            {
                "trial": run.run_dir.name,
                "overrides": {k: v for k, _, v in (o.partition("=") for o in trial["overrides"])},
                "state": status["state"],
                "step": summary.get("final_step", step),
                "final_loss": summary.get("final_loss", loss),
                "val_loss": status["val_loss"],
                "goodput": status["goodput"],
                "run_dir": str(run.run_dir),
            }
        )
    return rows


def _result(row: dict[str, Any], key: str) -> Any:
    """A results row's column or override value."""
    return row[key] if key in RESULT_COLUMNS else row["overrides"].get(key)


def sort_results(rows: list[dict[str, Any]], key: str, reverse: bool = False) -> list[dict[str, Any]]:
    """Rows sorted by a column or an override key (numbers as numbers: "3e-4" < "1e-3"); rows without
    a value last either way (a trial that has not logged a loss yet)."""
    keys = [*RESULT_COLUMNS, *dict.fromkeys(k for r in rows for k in r["overrides"])]
    if key not in keys:
        raise ValueError(f"--sort {key}: no such column; use one of {', '.join(keys)}")

    def value(row: dict[str, Any]) -> tuple[int, float, str]:
        try:
            return (0, float(_result(row, key)), "")
        except (TypeError, ValueError):
            return (1, 0.0, str(_result(row, key)))

    present = sorted((r for r in rows if _result(r, key) is not None), key=value, reverse=reverse)
    return present + [r for r in rows if _result(r, key) is None]


# results of a sweep of more than GLANCE_ROWS trials: the first and the last few in the order asked
RESULTS_FEW = 5


def print_results(
    rows: list[dict[str, Any]], title: str, fmt: str, key: str = "final_loss", wide: bool = False, every: bool = False
) -> None:
    """fmt "table" (overrides every trial shares go below it; of more than GLANCE_ROWS rows, the RESULTS_FEW
    first and last with a value of `key`, the sort key, unless every), "json" or "csv" (every row and override)."""
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
    from rich.table import Table

    varying = [k for k in overrides if len({r["overrides"].get(k) for r in rows}) > 1]
    common = " ".join(f"{k}={rows[0]['overrides'][k]}" for k in overrides if k not in varying)
    valued = [r for r in rows if _result(r, key) is not None]
    few = not every and len(rows) > GLANCE_ROWS
    shown = rows
    if few:  # the trials without a value are counted below the table
        shown = [*valued[:RESULTS_FEW], None, *valued[-RESULTS_FEW:]] if len(valued) > 2 * RESULTS_FEW else valued
    table = Table(title=title)
    for col in ("trial", *varying, "state", "step", "final loss", "val loss", "goodput"):
        table.add_column(col)
    for r in shown:
        if r is None:  # between the best and the worst few
            table.add_row("...", *([""] * (len(varying) + 4)))
            continue
        table.add_row(
            r["trial"],
            *(r["overrides"].get(k, "-") for k in varying),
            r["state"],
            "-" if r["step"] is None else str(r["step"]),
            *("-" if r[k] is None else f"{r[k]:.4f}" for k in ("final_loss", "val_loss")),
            "-" if r["goodput"] is None else f"{r['goodput']:.1%}",  # results_rows: None also before a start
        )
    out = console(wide)
    out.print(table)
    if common:
        out.print(f"in every trial: {common}", markup=False, highlight=False, soft_wrap=True)
    if shown is not rows:
        some = f"the {RESULTS_FEW} first and last of" if len(valued) > 2 * RESULTS_FEW else "the"
        out.print(
            f"{some} {len(valued):,} trials with a {key}"
            + (f" ({len(rows) - len(valued):,} without one yet)" if len(valued) < len(rows) else "")
            + "; every trial: --all",
            markup=False,
            highlight=False,
        )
