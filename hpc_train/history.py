"""The site's history: how often runs here were stopped, and how, per node-hour, from Slurm's accounting (sacct) and
the journals of earlier runs in the project folder; the goodput model's fault rates (planning.py, docs/goodput.md).
Torch-free: the login side and the job side may both read it.

    from hpc_train import history
    rates = history.site_rates("low", 4, runs_dir=Path("runs"))  # sacct once (10 s at most), runs/*/events.jsonl
    rates.describe(4)             # '1 unannounced fault per 9.4 h at 4 nodes (node failures 2, failures 1 in ...)'
    rates.unannounced_per_h(4)    # planning.Tier(faults_per_h=...): crashes, node failures (lost work)
    rates.announced_per_h(4)      # planning.forecast(announced_per_h=...): preemptions, time limits (a stop save)
    .venv/bin/python -m pytest -n0 -q tests/test_history.py

Kinds: a node failure and a failure (a crash, an OOM, a hang) are unannounced: the work since the last commit is
lost. A preemption, a time limit and a requeue (an operator's or a program's `scontrol requeue`: Slurm sends
SIGTERM and waits KillWait) are announced: a stop save, a restart, no lost work. Per job, a journal says why
(a failure hpc_train requeued is REQUEUED in sacct; an in-job restart is not in sacct at all), and sacct says
what the journal cannot see (a NODE_FAIL Slurm requeued reads from inside as a SIGTERM) and the allocation's
node-hours; a job in both is counted once (reconcile).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields, replace
from datetime import datetime
from pathlib import Path
from typing import NamedTuple

from hpc_train import journal, slurm
from hpc_train.planning import _per
from hpc_train.reputation import journal_files

ANNOUNCED = ("preemptions", "time_limits", "requeues")
UNANNOUNCED = ("node_failures", "failures")
KINDS = ANNOUNCED + UNANNOUNCED

# sacct's State (first word: "CANCELLED by 0") -> the kind of stop it is. Not here: COMPLETED, CANCELLED (a person's
# word), RUNNING, PENDING: no fault. DEADLINE is the time limit of --deadline. Not BOOT_FAIL either: a node that never
# came up ran nothing, and no work was lost (its requeue's queue wait still counts, REQUEUED_STATES).
SACCT_KINDS = {
    "PREEMPTED": "preemptions",
    "TIMEOUT": "time_limits",
    "DEADLINE": "time_limits",
    "REQUEUED": "requeues",
    "NODE_FAIL": "node_failures",
    "FAILED": "failures",
    "OUT_OF_MEMORY": "failures",
}
# After a record in one of these states Slurm runs the same job id again: the next record's start - this one's end is
# the queue wait after a requeue (--duplicates also lists a different job that reused an id after a reset: its
# record starts before the previous ended, or follows a state that is never requeued, and is not counted).
REQUEUED_STATES = ("REQUEUED", "PREEMPTED", "NODE_FAIL", "BOOT_FAIL", "REQUEUE_HOLD", "REQUEUE_FED")

# A history with no unannounced fault counts one in its node-hours, 4 node failures to 1 crash as DEFAULTS has them
UNSEEN = {"node_failures": 0.8, "failures": 0.2}
MIN_JOBS = 10  # fewer jobs: a rate is a handful of jobs' luck
MIN_FAULTS = 3  # ... or fewer unannounced faults than this and fewer node-hours than MIN_NODE_HOURS
NEWEST_RUNS = 200  # journals read at most: ~1 ms each here, and older runs are mostly out of the window anyway


@dataclass(frozen=True)
class Rates:
    """A history's stops counted by kind over its node-hours (per_node_h: the rate), the jobs it holds, and the
    queue waits measured after requeues. thin: why it is too thin to trust (site_rates then gives DEFAULTS with
    it); note: what else a reader should know (sacct did not answer). Counts, not rates, so that merging is a sum."""

    preemptions: int = 0
    time_limits: int = 0
    requeues: int = 0
    node_failures: int = 0
    failures: int = 0
    node_hours: float = 0.0
    jobs: int = 0
    queue_waits_s: tuple[float, ...] = ()  # each requeue's end -> the job's next start, in s
    window_days: float = 0.0
    partition: str = ""
    source: str = ""  # "sacct", "journals", "both", "defaults"
    thin: str = ""
    note: str = ""

    def per_node_h(self, kind: str) -> float:
        """Stops of `kind` (KINDS) per node-hour; 0 with no node-hours. No unannounced fault seen is not a rate of
        0 (every interval would be the 7-day cap, and the first crash would lose a whole time-limit segment): at
        most 1 in the history's node-hours, split as the defaults split theirs (UNSEEN)."""
        if self.node_hours <= 0:
            return 0.0
        if kind in UNANNOUNCED and not any(getattr(self, k) for k in UNANNOUNCED):
            return UNSEEN[kind] / self.node_hours
        return getattr(self, kind) / self.node_hours

    def unannounced_per_h(self, nodes: int) -> float:
        """Unannounced faults per hour of a run of `nodes` nodes (planning.Tier.faults_per_h)."""
        return nodes * sum(self.per_node_h(k) for k in UNANNOUNCED)

    def announced_per_h(self, nodes: int) -> float:
        """Announced stops per hour of running of a run of `nodes` nodes (planning.forecast's announced_per_h)."""
        return nodes * sum(self.per_node_h(k) for k in ANNOUNCED)

    @property
    def queue_wait_s(self) -> float | None:
        """The median queue wait after a requeue, in s; None when none was measured."""
        return statistics.median(self.queue_waits_s) if self.queue_waits_s else None

    def describe(self, nodes: int) -> str:
        """One line: '1 unannounced fault per 9.4 h at 4 nodes (node failures 2, failures 1 in 812 node-hours of 40
        jobs, 30 days on low); 1 announced stop per 2.1 h (preemptions 9); queue wait after a requeue 45 s (median of
        9)', then the thin sentence and the note when there are."""
        hours = f"{self.node_hours:,.0f}" if self.node_hours >= 10 else f"{self.node_hours:.2g}"
        where = f" of {_n(self.jobs, 'job')}, {_n(self.window_days, 'day')}" + (
            f" on {self.partition}" if self.partition else ""
        )
        if self.source == "defaults":
            where = ": the defaults, not this site's"
        faults = self.unannounced_per_h(nodes)
        counted = _counted(self, UNANNOUNCED)
        line = (
            f"{'1' if counted else 'at most 1'} unannounced fault per {_per(1 / faults)}"
            if faults
            else "no unannounced faults"
        )
        counted = counted or "none"
        line += f" at {_n(nodes, 'node')} ({counted} in {hours} node-hours{where})"
        stops = self.announced_per_h(nodes)
        line += f"; 1 announced stop per {_per(1 / stops)} ({_counted(self, ANNOUNCED)})" if stops else ""
        if self.queue_wait_s is not None:
            line += f"; queue wait after a requeue {self.queue_wait_s:.0f} s (median of {len(self.queue_waits_s)})"
        return "; ".join([line] + [s for s in (self.thin, self.note) if s])


def _n(count: float, noun: str) -> str:
    return f"{count:g} {noun}" + ("" if count == 1 else "s")


def _counted(rates: Rates, kinds: tuple[str, ...]) -> str:
    """'node failures 2, failures 1': the kinds with a count."""
    return ", ".join(f"{k.replace('_', ' ')} {getattr(rates, k)}" for k in kinds if getattr(rates, k))


# Site-independent defaults for a history too thin to trust. Meta's Llama 3 pre-training ("The Llama 3 Herd of
# Models", 2024, section 3.3.4): 419 unexpected interruptions in a 54-day snapshot on up to 16,384 H100 GPUs (2,048
# nodes of 8), 1 per 6,335 node-hours, ~78% of them hardware. Rounded up to 1 per 5,000 node-hours (GPU nodes fail
# more often than CPU ones: conservative for both), 4:1 node failures to failures. Announced stops are a site's
# policy (preemption, its time limits), not its hardware: no default guesses them (0), nor the queue wait.
DEFAULTS = Rates(node_failures=4, failures=1, node_hours=25_000.0, source="defaults")
# 15,000: below it the defaults expect fewer than 3 unannounced faults, and a count of 0 to 2 cannot tell a site
# from them (0 has a 5% chance even at a mean of 3)
MIN_NODE_HOURS = MIN_FAULTS / sum(DEFAULTS.per_node_h(k) for k in UNANNOUNCED)


def merge(*parts: Rates) -> Rates:
    """Independent histories as one: counts, node-hours, jobs and waits add (order-independent); the widest window;
    the source both when sacct and journals are in it."""
    if not parts:
        return Rates()
    sums = {f.name: sum(getattr(p, f.name) for p in parts) for f in fields(Rates) if f.name in (*KINDS, "jobs")}
    sources = {p.source for p in parts if p.source}
    return Rates(
        **sums,
        node_hours=math.fsum(p.node_hours for p in parts),  # correctly rounded: the same in any order
        queue_waits_s=tuple(sorted(w for p in parts for w in p.queue_waits_s)),
        window_days=max(p.window_days for p in parts),
        partition=",".join(sorted({p.partition for p in parts if p.partition})),
        source="both" if {"sacct", "journals"} <= sources else (sources.pop() if len(sources) == 1 else ""),
        note="; ".join(sorted({p.note for p in parts if p.note})),
    )


def _count(kind: str | None, **more: object) -> Rates:
    """One job's (or one attempt's) Rates: one stop of `kind` (None: none)."""
    return Rates(**({kind: 1} if kind else {}), **more)  # type: ignore[arg-type]


# ---- sacct ----------------------------------------------------------------------------------------------------


class Record(NamedTuple):
    """One run of a job in `sacct -X -P --duplicates -o slurm.ACCOUNTING_FIELDS` (times in Unix s; None: Unknown)."""

    job: str  # JobID: 123, or 123_4 for an array task
    state: str  # first word: "CANCELLED by 0" -> CANCELLED
    partition: str
    nodes: int
    elapsed_s: float
    submit: float | None
    start: float | None
    end: float | None


def _time(text: str) -> float | None:
    try:
        return datetime.fromisoformat(text).timestamp()  # the controller's local time, as sacct prints it
    except ValueError:  # Unknown, None
        return None


def parse_accounting(text: str) -> list[Record]:
    """slurm.accounting's text -> its records (pure); a line of another shape is skipped."""
    names = slurm.ACCOUNTING_FIELDS.split(",")
    out = []
    for line in text.splitlines():
        values = line.split("|")
        if len(values) != len(names) or not values[0]:
            continue
        f = dict(zip(names, values))
        try:
            nodes, elapsed = int(f["NNodes"]), float(f["ElapsedRaw"] or 0)
        except ValueError:
            continue
        state = (f["State"].split() or [""])[0]
        row = Record(f["JobID"], state, f["Partition"], nodes, elapsed, _time(f["Submit"]), None, None)
        out.append(row._replace(start=_time(f["Start"]), end=_time(f["End"])))
    return out


# A job that failed within this much of its start is a start-up failure (a wrong path, a config error, an import),
# the same at every try, not a site's random fault: ten 45 s debug crashes made auto save every few steps for hours
MIN_FAULT_ELAPSED_S = 300.0


def _kind(r: Record, min_fault_s: float) -> str | None:
    kind = SACCT_KINDS.get(r.state)
    return None if kind == "failures" and r.elapsed_s < min_fault_s else kind


def sacct_jobs(records: Iterable[Record], min_fault_s: float = MIN_FAULT_ELAPSED_S) -> dict[str, Rates]:
    """Each job id's Rates from its records (pure): a stop per record by SACCT_KINDS, node-hours NNodes x Elapsed,
    the queue wait from a requeued record's end to the next record's start."""
    by_job: dict[str, list[Record]] = {}
    for r in records:
        by_job.setdefault(r.job, []).append(r)
    out = {}
    for job, runs in by_job.items():
        runs.sort(key=lambda r: r.start or r.submit or 0.0)
        waits = tuple(
            b.start - a.end
            for a, b in zip(runs, runs[1:])
            if a.state in REQUEUED_STATES and a.end is not None and b.start is not None and b.start >= a.end
        )
        parts = [_count(_kind(r, min_fault_s), node_hours=r.nodes * r.elapsed_s / 3600) for r in runs]
        out[job] = replace(merge(*parts), jobs=1, queue_waits_s=waits, partition=runs[-1].partition)
    return out


def from_sacct(text: str, *, window_days: float = 0.0, min_fault_s: float = MIN_FAULT_ELAPSED_S) -> Rates:
    """The Rates of slurm.accounting's text (pure)."""
    jobs = sacct_jobs(parse_accounting(text), min_fault_s)
    return replace(merge(*jobs.values()), source="sacct", window_days=window_days)


# ---- journals -------------------------------------------------------------------------------------------------


def attempt_kind(events: list[journal.Event]) -> str | None:
    """What stopped one attempt, from its events (pure): a node left out (node_excluded, an in-job restart without
    a node: a node failure), a `fail` with no stop signal before it (a failure: a fail after the signal is the stop
    dying on its way out), the stop signal's reason (preempt, time_limit), a requeue nobody signalled (Slurm's or an
    operator's); None: it finished, was cancelled (`hpc-train cancel`, or scancel: preempt.decide's "cancelled ..."
    stop), or runs."""
    restarts = journal.named(events, journal.IN_JOB_RESTART)
    if journal.named(events, journal.NODE_EXCLUDED) or any(e.get("left_out") for e in restarts):
        return "node_failures"
    stopped = journal.last(events, journal.STOPPED)
    if journal.named(events, journal.CANCEL) or (stopped and str(stopped.get("reason", "")).startswith("cancelled")):
        return None
    signal = journal.last(events, journal.SIGNAL)
    if signal is None and journal.named(events, journal.FAIL):  # before its first step: its start-up's, not a fault
        return "failures" if journal.named(events, journal.FIRST_STEP) else None
    if signal is not None:
        return {"preempt": "preemptions", "time_limit": "time_limits"}.get(str(signal.get("reason")), "requeues")
    return "requeues" if journal.named(events, journal.REQUEUE) else None


def journal_jobs(
    events: list[journal.Event], since_s: float = 0.0, sizes: tuple[int, int] = (0, 1 << 30)
) -> dict[str, Rates]:
    """One run's journal -> each of its job ids' Rates (pure): a stop per attempt (attempt_kind), node-hours its
    nodes x launch to end (to the relaunch for an in-job restart: the allocation is held), the queue wait from a
    requeue to the next attempt's launch of the same job. Attempts launched before since_s, or on a number of nodes
    outside `sizes` (min, max: those sacct is asked for), are left out."""
    by_restart: dict[int, list[journal.Event]] = {}
    for e in events:
        by_restart.setdefault(int(e.get("restart", 0)), []).append(e)
    atts = journal.attempts(events)
    out: dict[str, Rates] = {}
    nodes = 0
    for i, a in enumerate(atts):
        nodes = len(set(a["nodes"])) if isinstance(a["nodes"], list) else nodes  # none before a start: the last
        after = atts[i + 1] if i + 1 < len(atts) else None
        if a["launched"] < since_s or not a["job_id"] or not sizes[0] <= nodes <= sizes[1]:
            continue
        end = after["launched"] if after and a["ended_by"] == journal.IN_JOB_RESTART else a["end"]
        same_job = after is not None and after["job_id"] == a["job_id"]
        wait = (after["launched"] - a["end"],) if same_job and a["ended_by"] == journal.REQUEUE else ()
        kind = attempt_kind(by_restart[a["restart"]])
        if kind is None and same_job and a["ended_by"] == "running":
            kind = "failures"  # it ended without a word and the job ran again: killed (a batch host lost, SIGKILL)
        one = _count(kind, node_hours=nodes * max(0.0, end - a["launched"]) / 3600)
        out[a["job_id"]] = merge(out.get(a["job_id"], Rates()), replace(one, queue_waits_s=wait))
    return {job: replace(r, jobs=1) for job, r in out.items()}


def from_journals(run_dirs: Iterable[Path], *, window_days: float = 0.0, now_s: float | None = None) -> Rates:
    """The Rates of these runs' journals (journal.read each), attempts launched in the last window_days (0: all)."""
    since = ((now_s or time.time()) - window_days * 86400) if window_days else 0.0
    jobs = [r for d in run_dirs for r in journal_jobs(journal.read(Path(d)), since).values()]
    return replace(merge(*jobs), source="journals", window_days=window_days)


def journal_runs(runs_dir: Path, partition: str) -> list[Path]:
    """The run folders under runs_dir (reputation.journal_files: its runs and sweeps' trials, once each) whose frozen
    config queued them on Slurm's `partition`, the NEWEST_RUNS most recently written; a run on the cluster's default
    partition without naming it is not known to be on `partition`, and is left out."""
    journals = journal_files(runs_dir)
    newest = sorted(journals, key=_mtime, reverse=True)[:NEWEST_RUNS]
    return [j.parent for j in newest if queued_on(j.parent / "config.yaml") == ("slurm", partition)]


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:  # removed meanwhile
        return 0.0


def queued_on(config: Path) -> tuple[str, str]:
    """(cluster.executor, cluster.partition) of a frozen config.yaml, read by lines: PyYAML takes 5 to 13 ms a file
    here (status.py), this ~0.1 ms; the frozen config is PyYAML's block dump, the cluster's keys indented by 2."""
    try:
        lines = config.read_text(errors="replace").splitlines()
    except OSError:
        return "", ""
    keys, inside = {}, False
    for line in lines:
        if not line.startswith(" "):
            inside = line.rstrip() == "cluster:"
        elif inside and not line.startswith("   "):
            key, _, value = line.strip().partition(":")
            keys[key] = value.strip().strip("'\"")
    return keys.get("executor", ""), keys.get("partition", "")


# ---- the two together -----------------------------------------------------------------------------------------


def reconcile(accounting: Mapping[str, Rates], journals: Mapping[str, Rates]) -> list[Rates]:
    """Each job once (pure). A job in both: the journal's kinds (it knows a failure hpc_train requeued, which sacct
    calls REQUEUED, and in-job restarts, which sacct never sees), at least sacct's node failures (a NODE_FAIL Slurm
    requeued reads from inside as a SIGTERM: taken from the journal's requeues, preemptions, failures in that
    order), sacct's node-hours (the allocation as Slurm billed it) and its queue waits when it measured any."""
    out = [r for job, r in accounting.items() if job not in journals]
    for job, ours in journals.items():
        theirs = accounting.get(job)
        if theirs is None:
            out.append(ours)
            continue
        counts = {k: getattr(ours, k) for k in KINDS}
        missing = max(0, theirs.node_failures - ours.node_failures)
        counts["node_failures"] += missing
        for kind in ("requeues", "preemptions", "failures"):
            taken = min(missing, counts[kind])
            counts[kind], missing = counts[kind] - taken, missing - taken
        waits = theirs.queue_waits_s or ours.queue_waits_s
        out.append(replace(ours, **counts, node_hours=theirs.node_hours, queue_waits_s=waits))
    return out


def thin(rates: Rates, min_jobs: int = MIN_JOBS, min_node_hours: float = MIN_NODE_HOURS) -> str:
    """Why `rates` is too thin to trust, "" when it is not (pure): fewer than min_jobs jobs, or fewer than MIN_FAULTS
    unannounced faults in fewer than min_node_hours node-hours (too few to tell this site from the defaults)."""
    where = _n(rates.window_days, "day") + (f" on partition {rates.partition}" if rates.partition else "")
    if rates.jobs < min_jobs:
        return f"{_n(rates.jobs, 'job')} in {where}: using the defaults (fewer than {min_jobs} jobs)"
    faults = sum(getattr(rates, k) for k in UNANNOUNCED)
    if faults < MIN_FAULTS and rates.node_hours < min_node_hours:
        return (
            f"{_n(faults, 'unannounced fault')} in {rates.node_hours:,.0f} node-hours ({where}): using the defaults "
            f"(too few to tell this site from them: {MIN_FAULTS} faults or {min_node_hours:,.0f} node-hours)"
        )
    return ""


def sizes_like(nodes: int) -> tuple[int, int]:
    """The node counts of the jobs that speak for a run of `nodes` nodes: nodes / 2 to nodes x 2."""
    return max(1, nodes // 2), nodes * 2


def accounting_args(partition: str, nodes: int, window_days: float, now_s: float) -> list[str]:
    """The sacct site_rates(partition, nodes, window_days=..., now_s=...) asks, for slurm.prefetch."""
    return slurm.accounting_args(now_s - window_days * 86400, partition=partition, nodes=sizes_like(nodes))


def site_rates(
    partition: str,
    nodes: int,
    *,
    runs_dir: Path,
    window_days: float = 30,
    account: str = "",
    all_users: bool = False,
    min_jobs: int = MIN_JOBS,
    min_node_hours: float = MIN_NODE_HOURS,
    min_fault_s: float = MIN_FAULT_ELAPSED_S,
    now_s: float | None = None,
) -> Rates:
    """This site's rates for a run of `nodes` nodes on `partition`: sacct once (one try of 10 s; no answer: the
    journals alone, said in `note`) for the jobs of window_days before now_s (default: now) on it of nodes / 2 to
    nodes x 2 nodes (this user's, or `account`'s with all_users), and the journals of runs_dir's runs (the project's
    out_dir) queued on it (journal_runs), reconciled; DEFAULTS with the `thin` sentence when too thin to trust."""
    since, sizes = (now_s or time.time()) - window_days * 86400, sizes_like(nodes)
    journals: dict[str, Rates] = {}
    for run_dir in journal_runs(Path(runs_dir), partition):
        try:
            journals.update(journal_jobs(journal.read(run_dir), since, sizes))
        except (TypeError, ValueError, KeyError, AttributeError):  # a journal edited into another shape: not counted
            continue
    note, text = "", ""
    try:
        text = slurm.accounting(since, partition=partition, nodes=sizes, account=account, all_users=all_users)
    except slurm.SlurmError as e:
        note = f"sacct did not answer, journals only ({str(e).splitlines()[0]})"
    accounting = sacct_jobs(parse_accounting(text), min_fault_s)
    source = "both" if accounting and journals else "journals" if journals or note else "sacct"
    measured = replace(
        merge(*reconcile(accounting, journals)), window_days=window_days, partition=partition, source=source, note=note
    )
    why = thin(measured, min_jobs, min_node_hours)
    return replace(DEFAULTS, window_days=window_days, partition=partition, thin=why, note=note) if why else measured
