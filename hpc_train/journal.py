"""events.jsonl, the run's journal: the one owner of its event names, its writes, its tolerant read and
the facts every reader folds out of it (which attempt, restarts, budgets spent, last committed step, why
it stopped, the attempt timeline goodput uses). Torch-free: the job's decisions, `status`, `report`,
`resume` and Prometheus read one file with this one code.

    from hpc_train import journal
    events = journal.read(run_dir)                  # malformed lines skipped, one warning per file
    journal.current_attempt(events), journal.committed_step(events), journal.goodput(events, metrics)
    journal.log(run_dir, journal.CANCEL, -1, job_id, attempt, by="hpc-train cancel")

docs/lifecycle.md lists each event's fields. A reader never compares `e["event"]` itself: it asks a
reducer here, or `named(events, NAME)`.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hpc_train.paths import RunPaths, append_line
from hpc_train.reasons import Fate, Reason

Event = dict[str, Any]

# ---- the events -----------------------------------------------------------------------------------------
# an attempt (rank 0 unless said)
START = "start"  # at.resume: step, resumed_from, world_size, nodes, rank_nodes, pids, devices, phases_s, ...
FIRST_STEP = "first_step"  # step_time_s: resume -> first step; ddp_rebucket_s: of it, DDP's throwaway
BATCH_CHANGED = "batch_changed"  # the global batch does not divide over this attempt's ranks
DATA_CHANGED = "data_changed"  # resumed on other data than the checkpoint's, allowed: change, was, now
PREFLIGHT = "preflight"  # every node's health, after the rendezvous
SIGNAL = "signal"  # a stop signal seen at a step boundary
FINISH = "finish"  # the run's last step; the summary
CODE_CHANGED = "code_changed"  # the first task on a node runs other code than code.json names
LEASE_REFUSED = "lease_refused"  # a second job on a run another live job owns: owner, expires_at; it exits
# checkpoints
CHECKPOINT_COMMITTED = "checkpoint_committed"
# a script's checkpoint file (script.checkpoint) newer at its attempt's end than at its start, when
# script_helper.committed() said nothing: path, mtime (the file server's clock, compared only with itself)
SCRIPT_CHECKPOINT = "script_checkpoint"
CHECKPOINT_SKIPPED = "checkpoint_skipped"
CHECKPOINT_DELETED = "checkpoint_deleted"
CHECKPOINT_ABANDONED = "checkpoint_abandoned"
STOP_SAVE_SKIPPED = "stop_save_skipped"
# checkpoint.every_steps / memory_every_steps=auto chosen (intervals.py): every_steps, memory_every_steps, provisional
# (a save's cost still unmeasured), why (the sentence), inputs (the tiers and rates it rests on)
INTERVAL = "interval"
# the one requeue decision (the deciding rank)
FAIL = "fail"  # the failing rank: error, traceback
REQUEUE = "requeue"
REQUEUE_FAILED = "requeue_failed"
STOPPED = "stopped"
NODE_EXCLUDED = "node_excluded"
NODE_NOT_EXCLUDED = "node_not_excluded"
EXCLUDE_NODES = "exclude_nodes"  # the ExcNodeList set on the requeued job, ok or not; let_in: nodes let back in
# the training step relaunched inside the allocation (cluster.spare_nodes): reason, left_out (nodes of this
# job it leaves out), nodes_next, spares_left, in_job_restarts (in a row, this one included)
IN_JOB_RESTART = "in_job_restart"  # in_process: True when the ranks that survived rejoined in their processes
# side services
STRAGGLER = "straggler"
STRAGGLER_CLEARED = "straggler_cleared"
TRACKING_FAILED = "tracking_failed"
PROMETHEUS = "prometheus"
PROMETHEUS_FAILED = "prometheus_failed"
# a pipeline (pipeline.py): a run queued after others (`submit --after`), told what became of them; a run
# cancelled because one stopped for good gets a `stopped` with upstream, root and by="pipeline"
RELEASED = "released"  # queued :any after a run that stopped for good: no longer held for it: reason, upstream, root
REPOINTED = "repointed"  # still queued when its stage was resumed: now waits for that new job: upstream, dependency
# people (the login side)
RESUME = "resume"  # `hpc-train resume`: the attempt it starts, budgets, previous_job_id
CANCEL = "cancel"  # `hpc-train cancel`
CHAOS = "chaos"  # `hpc-train chaos`: action, injected

ENDS = (FINISH, REQUEUE, IN_JOB_RESTART, STOPPED, FAIL)  # what can end an attempt, as `report` names it
BUDGET_KEYS = {
    Reason.PREEMPT: "max_preemptions",
    Reason.TIME_LIMIT: "max_time_limit_requeues",
    Reason.FAILURE: "max_failures",
}


# ---- write and read -------------------------------------------------------------------------------------


def log(run_dir: Path, event: str, step: int, job_id: str, restart: int, **fields: Any) -> None:
    """Append one event: time, name, step (-1: before any), the job and the attempt (restart) it belongs to."""
    record = {"time": time.time(), "event": event, "step": step, "job_id": job_id, "restart": restart, **fields}
    append_line(RunPaths(run_dir).events, record)


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def is_event(e: Any) -> bool:
    """The shape every reader may index: a str `event`, a finite numeric `time` (json reads Infinity), an int
    `step` and `restart`."""
    return (
        isinstance(e, dict)
        and isinstance(e.get("event"), str)
        and _number(e.get("time"))
        and math.isfinite(e["time"])
        and type(e.get("step")) is int
        and type(e.get("restart", 0)) is int
    )


_warned: set[str] = set()  # files already warned about in this process: one warning each


def parse(text: str, where: str = "events.jsonl") -> list[Event]:
    """The events of a journal's text. A torn last line (its writer killed mid-write, or still writing) is
    skipped silently; any other line that is not an event (edited by hand, another tool's) is skipped with
    one warning per file and process on stderr, never a crash of a decision or of `status`."""
    lines = text.split("\n")
    out, bad = [], []
    for i, line in enumerate(lines, 1):
        try:
            e = json.loads(line)
        except ValueError:
            e = None
        if is_event(e):
            out.append(e)
        elif line.strip() and i < len(lines):  # the last piece has no newline yet: a write under way or torn
            bad.append(i)
    if bad and where not in _warned:
        _warned.add(where)
        print(
            f"hpc-train: warning: skipped {len(bad)} line(s) of {where} that are not events (first: line {bad[0]})",
            file=sys.stderr,
        )
    return out


def read(run_dir: Path) -> list[Event]:
    """The run's events, in the order they were written ([] before the first)."""
    path = RunPaths(run_dir).events
    try:
        return parse(path.read_text(errors="replace"), str(path))
    except FileNotFoundError:
        return []


def named(events: list[Event], *names: str) -> list[Event]:
    """The events of these names, in order."""
    return [e for e in events if e["event"] in names]


def last(events: list[Event], *names: str) -> Event | None:
    return next((e for e in reversed(events) if e["event"] in names), None)


# ---- attempts -------------------------------------------------------------------------------------------


def since_resume(events: list[Event]) -> list[Event]:
    """The events after the last `hpc-train resume` (all of them if never resumed): how it ended before no
    longer says how it is now."""
    at = max((i for i, e in enumerate(events) if e["event"] == RESUME), default=-1)
    return events[at + 1 :]


def current_attempt(events: list[Event]) -> int:
    """The attempt (restart count) that last started, or that `hpc-train resume` last queued; 0 before any."""
    found = last(events, START, RESUME)
    return int(found["restart"]) if found else 0


def next_attempt(events: list[Event]) -> int:
    """The number `hpc-train resume` gives the attempt it queues: one past every attempt on record."""
    return max((e["restart"] for e in events), default=-1) + 1


def new_job_attempt(events: list[Event], slurm_restarts: int | None, job_id: str = "") -> int:
    """The attempt a starting job is: the one `hpc-train resume` recorded (a resumed Slurm job counts
    SLURM_RESTART_COUNT from 0 again) plus Slurm's restarts since plus job `job_id`'s in-job restarts since
    (each relaunches the step without moving SLURM_RESTART_COUNT); the local controller restarts in place,
    so there (slurm_restarts None) the requeues on record since that resume count instead."""
    resume = last(events, RESUME)
    base = resume["restart"] if resume else 0
    if slurm_restarts is None:
        return base + len(named(since_resume(events), REQUEUE))
    in_job = [e for e in named(since_resume(events), IN_JOB_RESTART) if e.get("job_id") == job_id]
    return base + slurm_restarts + len(in_job)


def verdict(events: list[Event], restart: int) -> Event | None:
    """Attempt `restart`'s requeue-or-stop verdict on record (the last), or None while there is none."""
    ends = named(events, REQUEUE, REQUEUE_FAILED, STOPPED, IN_JOB_RESTART)
    return next((e for e in reversed(ends) if e.get("restart") == restart), None)


def rejoins(end: Event | None) -> bool:
    """Whether a verdict (`verdict`) is an in-process restart: the survivors and standbys rejoin by its plan."""
    return end is not None and end["event"] == IN_JOB_RESTART and bool(end.get("in_process"))


def decided(events: list[Event], restart: int) -> bool:
    """Whether attempt `restart`'s requeue-or-stop verdict is on record."""
    return verdict(events, restart) is not None


def keeps_memory(end: Event | None, node: str, local: bool = False) -> bool:
    """Whether a failed attempt's memory copies on `node` stay (checkpoint.memory_every_steps), by its verdict
    `end`: an in-job restart whose step runs on `node`, the local executor's requeue (it restarts in place),
    or no verdict seen (None: the deciding rank was slower than deadlines.VERDICT_WAIT_S, or died): one may still
    come and read them. An in-job restart that leaves `node` out has no rank there to read them, and
    nothing else would free that RAM before the node reboots."""
    if end is None:
        return True
    if end["event"] == IN_JOB_RESTART:
        return node not in (end.get("left_out") or [])
    return local and end["event"] == REQUEUE


def total_steps(events: list[Event]) -> int | None:
    """The run's own total as its loop last told it (the `last_step` of Attempt.step_end, in each attempt's
    `first_step`); None when no attempt reached a step."""
    told = [e["total_steps"] for e in named(events, FIRST_STEP) if type(e.get("total_steps")) is int]
    return told[-1] if told else None


def trained(events: list[Event], restart: int) -> bool:
    """Whether attempt `restart` reached its first step (an in-process restart rejoins only such an attempt)."""
    return any(e.get("restart") == restart for e in named(events, FIRST_STEP))


def step_over(events: list[Event], restart: int) -> bool:
    """Whether the training step a standby waits in (started at attempt `restart`) is ending: the run finished,
    or a verdict since then other than an in-process restart (which keeps the step) is on record."""
    ends = (FINISH, REQUEUE, REQUEUE_FAILED, STOPPED, LEASE_REFUSED)
    return any(
        e.get("restart", -1) >= restart
        and (e["event"] in ends or (e["event"] == IN_JOB_RESTART and not e.get("in_process")))
        for e in events
    )


def committed_steps(events: list[Event]) -> list[int]:
    return [e["step"] for e in named(events, CHECKPOINT_COMMITTED)]


def committed_step(events: list[Event]) -> int | None:
    """The newest step a checkpoint committed, in any attempt (None: none yet)."""
    return max(committed_steps(events), default=None)


def progress(events: list[Event], metrics: Path) -> bool:
    """The run got anywhere: a committed checkpoint, a script's checkpoint file, or a metrics row. Before that a
    failure that is the code's or the config's (an import, the syntax, the arguments) is one no retry mends."""
    if named(events, CHECKPOINT_COMMITTED) or any(_number(e.get("mtime")) for e in named(events, SCRIPT_CHECKPOINT)):
        return True
    try:
        return metrics.stat().st_size > 0
    except OSError:
        return False


def slowest_write_s(events: list[Event]) -> float:
    """The slowest checkpoint write on record, in any attempt: what a stop save must fit."""
    times = [e.get("write_s", e.get("save_s", 0.0)) for e in named(events, CHECKPOINT_COMMITTED)]
    return max((t for t in times if _number(t)), default=0.0)


def save_times_s(events: list[Event]) -> list[float]:
    """Every committed save's whole time (save_s), for the signal-lead check."""
    return [s for e in named(events, CHECKPOINT_COMMITTED) if _number(s := e.get("save_s", 0.0))]


def first_step_times_s(events: list[Event]) -> list[float]:
    return [s for e in named(events, FIRST_STEP) if _number(s := e.get("step_time_s", 0.0))]


def startup_s(events: list[Event]) -> float:
    """The slowest launch -> first step of the run's attempts, in s (0.0 when none reached one): what an
    in-job restart must expect to pay before it trains again (preempt.in_job_restart)."""
    return max((a["first_step"] - a["launched"] for a in attempts(events) if a["first_step"] is not None), default=0.0)


# ---- how a run ended ------------------------------------------------------------------------------------


def finished(events: list[Event]) -> Event | None:
    """The `finish` event, once the run reached its last step."""
    return last(events, FINISH)


def stopped(events: list[Event]) -> Event | None:
    """The last `stopped` since the last resume: the run ended here and will not requeue by itself."""
    return last(since_resume(events), STOPPED)


def cancelled(events: list[Event]) -> bool:
    """`hpc-train cancel` since the last resume."""
    return last(since_resume(events), CANCEL) is not None


def failures(events: list[Event]) -> list[Event]:
    """The `fail` events since the last resume."""
    return named(since_resume(events), FAIL)


def stop_reason(events: list[Event], job_id: str = "", state: str = "") -> str:
    """Why the run is not running, in a few words for `resume` and `status`: the `stopped` reason, the last
    failure's error, or what Slurm said (state) when the run itself wrote nothing."""
    why, fails = stopped(events), failures(events)
    if why:
        return str(why.get("reason", ""))
    if fails:
        return f"its last attempt failed: {fails[-1].get('error', '')}"
    if state:
        return f"Slurm ended job {job_id} as {state} without a word in events.jsonl"
    return "it ended without a word in events.jsonl (killed?)"


def local_state(events: list[Event], alive: bool) -> str:
    """A local run's state in Slurm's words, from its journal and whether its controller still runs."""
    since = since_resume(events)
    if last(since, FINISH):
        return "COMPLETED"
    if last(since, STOPPED):
        return "CANCELLED" if last(since, CANCEL) else "FAILED"
    if alive:
        return "RUNNING"
    return "FAILED" if last(since, FAIL) else "UNKNOWN"


def local_fate(events: list[Event]) -> Fate:
    """The local executor's answer to "what is the scheduler doing with this job": "cancelled" once
    `hpc-train cancel` wrote its event in the attempt of the last requeue or later (a cancel that raced
    that requeue still counts: the next attempt stops at once), else "running". A `resume` starts a new
    attempt as a requeue does: the cancel that stopped the run before it no longer counts."""
    cancels = [e.get("restart", 0) for e in named(events, CANCEL)]
    requeues = [e.get("restart", 0) for e in named(events, REQUEUE, RESUME)]
    return Fate.CANCELLED if cancels and max(cancels) >= max(requeues, default=-1) else Fate.RUNNING


# ---- budgets --------------------------------------------------------------------------------------------


def failures_in_a_row(events: list[Event]) -> int:
    """Failure requeues since the run last made progress (committed a step beyond every earlier commit, or
    a script's checkpoint file newer than any before: SCRIPT_CHECKPOINT) or was resumed (`hpc-train resume`
    is a person's word that the cause is fixed). A crash loop never makes progress; three node faults a
    month apart each come after progress."""
    ours = lambda e: e["event"] == REQUEUE and e.get("reason") == "failure" and e.get("by") != "slurm"  # noqa: E731
    return _in_a_row(events, ours)


def in_job_restarts_in_a_row(events: list[Event]) -> int:
    """In-job restarts since the run last made progress or was resumed, as failures_in_a_row counts: what
    requeue.max_in_job_restarts bounds (a crash loop never makes progress; two node faults an hour apart
    each come after progress)."""
    return _in_a_row(events, lambda e: e["event"] == IN_JOB_RESTART)


def _in_a_row(events: list[Event], counts: Callable[[Event], bool]) -> int:
    """Events `counts` accepts since the last progress (a commit beyond every earlier one, a script's newer
    checkpoint file) or `resume`: one notion of progress for both budgets (a script's run got its in-job
    budget back only through commits it never makes, before)."""
    count, best, newest = 0, -1, 0.0
    for e in events:
        if e["event"] == CHECKPOINT_COMMITTED and e["step"] > best:
            best, count = e["step"], 0
        elif e["event"] == SCRIPT_CHECKPOINT and _number(e.get("mtime")) and e["mtime"] > newest:
            newest, count = e["mtime"], 0
        elif e["event"] == RESUME:
            count = 0
        elif counts(e):
            count += 1
    return count


def in_job_restarts(events: list[Event]) -> list[Event]:
    """The `in_job_restart` events since the last resume: what status, report and Prometheus count."""
    return named(since_resume(events), IN_JOB_RESTART)


def spares_left(events: list[Event], spare_nodes: float) -> float:
    """Hot spares the allocation still holds unused: the spares_left of the in-job restart that relaunched
    the current attempt (or is relaunching it), else spare_nodes. A new allocation has all its spares: after
    a requeue, a resume, or an attempt that is not that relaunch (Slurm's own requeue of a NODE_FAIL, which
    no rank records, shows only as a start with another attempt number)."""
    at = max(
        (i for i, e in enumerate(events) if e["event"] == IN_JOB_RESTART and _number(e.get("spares_left"))), default=-1
    )
    if at < 0:
        return spare_nodes
    relaunched = int(events[at].get("restart", 0)) + 1
    for e in events[at + 1 :]:
        if e["event"] in (REQUEUE, RESUME) or (e["event"] == START and int(e.get("restart", 0)) != relaunched):
            return spare_nodes
    return float(events[at]["spares_left"])


def requeues_counted(events: list[Event], reason: Reason) -> int:
    """Requeues this run asked for, for `reason`; those Slurm did by itself cost no budget."""
    return sum(1 for e in named(events, REQUEUE) if e.get("reason") == reason and e.get("by") != "slurm")


def budget_changes(events: list[Event]) -> dict[str, int]:
    """requeue.* values set by `hpc-train resume --max-...` (its `resume` events' budgets, later over
    earlier): they apply over the frozen config.yaml, which is never rewritten."""
    return {
        k: v
        for e in named(events, RESUME)
        for k, v in (e.get("budgets") or {}).items()
        if k in (*BUDGET_KEYS.values(), "max_excluded_nodes") and type(v) is int
    }


def data_change_allowed(events: list[Event]) -> bool:
    """The last `hpc-train resume` was given --allow-data-changed: its attempts may resume on data other
    than their checkpoint's (data.allow_changed for them; config.yaml stays as submitted)."""
    found = last(events, RESUME)
    return found is not None and found.get("allow_data_changed") is True


def excluded_nodes(events: list[Event]) -> dict[str, str]:
    """node -> why, oldest blame first, from the `node_excluded` events since the last `hpc-train resume` (a
    person's word that the nodes are fixed; the resumed job starts without the exclusions and the preflight
    judges again), less the nodes a requeue let back in since (`exclude_nodes` with `let_in`: the partition
    would have kept too few for the run, preempt.fit_exclusions)."""
    out: dict[str, str] = {}
    for e in since_resume(events):
        if e["event"] == NODE_EXCLUDED and isinstance(e.get("node"), str):
            out.pop(e["node"], None)  # blamed again: the newest
            out[e["node"]] = str(e.get("why", ""))
        elif e["event"] == EXCLUDE_NODES:
            for node in e.get("let_in") or []:
                out.pop(node, None)
    return out


def exclusion_took(events: list[Event], node: str) -> tuple[bool, int]:
    """(an `exclude_nodes` event with ok=True named `node` after it was first left out, how many times it
    was left out), since the last resume or since a requeue let it back in (its `let_in`)."""
    took, times = False, 0
    for e in since_resume(events):
        if e["event"] == NODE_EXCLUDED and e.get("node") == node:
            times += 1
        elif e["event"] == EXCLUDE_NODES and node in (e.get("let_in") or []):
            took, times = False, 0
        elif e["event"] == EXCLUDE_NODES and e.get("ok") and times and node in str(e.get("nodes", "")).split(","):
            took = True
    return took, times


# ---- stragglers -----------------------------------------------------------------------------------------


def stragglers_now(events: list[Event]) -> dict[int, Event]:
    """The ranks named and not cleared in the latest attempt (rank -> its `straggler` event): a new attempt
    starts with no straggler, as rank 0's Judge does."""
    latest = max((e.get("restart", 0) for e in events), default=0)
    out: dict[int, Event] = {}
    for e in events:
        if not isinstance(e.get("rank"), int) or e.get("restart", 0) != latest:
            continue  # an event edited into another shape names nobody
        if e["event"] == STRAGGLER:
            out[e["rank"]] = e
        elif e["event"] == STRAGGLER_CLEARED:
            out.pop(e["rank"], None)
    return out


def uncleared_stragglers(events: list[Event]) -> list[Event]:
    """Every `straggler` event its attempt never cleared (`straggler_cleared` of the same rank and attempt): the
    verdicts that outlive a run (reputation.py)."""
    slow: dict[tuple[int, Any], Event] = {}
    for e in named(events, STRAGGLER, STRAGGLER_CLEARED):
        if e["event"] == STRAGGLER:
            slow[(e["restart"], e.get("rank"))] = e
        else:
            slow.pop((e["restart"], e.get("rank")), None)
    return list(slow.values())


def straggler_episodes(events: list[Event]) -> list[dict[str, Any]]:
    """Each `straggler` event with the step its `straggler_cleared` came at (None: still slow, or the
    attempt ended first): what `report` lists."""
    rows = []
    for i, e in enumerate(events):
        if e["event"] != STRAGGLER:
            continue
        cleared = next(
            (
                c["step"]
                for c in named(events[i + 1 :], STRAGGLER_CLEARED)
                if c.get("rank") == e["rank"] and c.get("restart") == e.get("restart")
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


# ---- the timeline goodput uses --------------------------------------------------------------------------


def resumed_text(start: Event | None) -> str | None:
    """Where an attempt's state came from, in words: "memory (step S)" (checkpoint.memory_every_steps), the
    disk checkpoint's folder name ("step_000040"), or None (a fresh start, or no start event yet)."""
    if not start or not start.get("resumed_from"):
        return None
    memory = start.get("memory") or {}
    return f"memory (step {memory['step']})" if "step" in memory else Path(str(start["resumed_from"])).name


def attempts(events: list[Event]) -> list[dict[str, Any]]:
    """Per attempt (by restart count): launch, start, first step, end times, what ended it, and its size
    (world_size, nodes, grad_accum_steps, global_batch_seqs: from the start event; None before it)."""
    by_restart: dict[int, list[Event]] = {}
    for e in events:
        by_restart.setdefault(int(e.get("restart", 0)), []).append(e)
    out = []
    for restart in sorted(by_restart):
        evs = by_restart[restart]
        start = next(iter(named(evs, START)), None)
        first = next(iter(named(evs, FIRST_STEP)), None)
        commits = named(evs, CHECKPOINT_COMMITTED)
        # The verdict over a `fail`: the other failing ranks log theirs as they die, after the deciding one's.
        ended = last(evs, *(e for e in ENDS if e != FAIL)) or last(evs, FAIL)
        out.append(
            {
                "restart": restart,
                "launched": start.get("launched_at", start["time"]) if start else min(e["time"] for e in evs),
                "job_id": next((e["job_id"] for e in evs if e.get("job_id")), None),  # a `resume` event has none yet
                "start": start["time"] if start else None,
                "start_step": start["step"] if start else None,
                "resumed_from": resumed_text(start),
                "first_step": first["time"] if first else None,
                "end": max(e["time"] for e in evs),
                "ended_by": ended["event"] if ended else "running",
                "reached_step": max([e["step"] for e in evs] + [start["step"] if start else 0]),
                "committed_step": max((e["step"] for e in commits), default=None),
                "stall_s": sum(
                    e.get("stall_s", 0.0) if e.get("reason") == "periodic" else e.get("save_s", 0.0) for e in commits
                ),
                "signals": [s for e in named(evs, SIGNAL) for s in e.get("signals", [])],
                # a script's attempt (`submit ... -- CMD`) and the newest checkpoint file it left (its mtime,
                # script._file_progress): what goodput knows of a script that tells no steps
                "script": bool(start and start.get("target") == "script"),
                "looked": bool(named(evs, SCRIPT_CHECKPOINT)),  # for a file at its end (none newer: mtime None)
                "file_at": max(
                    (e["mtime"] for e in named(evs, SCRIPT_CHECKPOINT) if _number(e.get("mtime"))), default=None
                ),
                # an elastic requeue's NumNodes ("2-2"), or an in-job restart's node count (fewer: min_nodes)
                "nodes_next": next((e.get("nodes_next") for e in named(evs, REQUEUE, IN_JOB_RESTART)), None),
                # an in-job restart (hot spares): the allocation's nodes it left out, the spares it kept; in process
                # (cluster.in_process_restart): the dead nodes and the standbys' that replaced them
                **{
                    k: next((e.get(k) for e in named(evs, IN_JOB_RESTART)), None)
                    for k in ("left_out", "spares_left", "in_process", "replaced")
                },
                **{
                    k: start.get(k) if start else None
                    for k in ("world_size", "nodes", "grad_accum_steps", "global_batch_seqs")
                },
                # start-up, phase by phase (job.py): python, imports, rendezvous, preflight, setup, verify,
                # load, first step
                "phases_s": {
                    **(start.get("phases_s", {}) if start else {}),
                    **({"first_step": first["step_time_s"]} if first and "step_time_s" in first else {}),
                },
            }
        )
    return out


def goodput(events: list[Event], metrics: list[dict[str, Any]], live: bool = False) -> dict[str, Any]:
    """Where the allocated time went, in seconds; the parts add up to the attempts' wall time (pure).

    allocated   launch of each attempt -> its last event
    overhead    launch -> training starts (imports, rendezvous, checkpoint load)
    stall       the loop blocked by checkpoint saves
    lost        training on steps no checkpoint kept (recomputed by the next attempt)
    committed   the rest: training that became committed progress
    unknown     a script's attempt that tells no steps and ended unfinished, with no look at its checkpoint
                file on record (no script.checkpoint, or an end never recorded): the goodput is then None
    queue_wait  requeue -> next launch (not allocated; reported beside); after an in-job restart the
                allocation is held while the step relaunches: that gap is allocated overhead instead

    A script's attempt that tells no steps (no script_helper) and ended unfinished lost the time since its
    newest checkpoint file (its mtime, the file server's clock, kept within the attempt), all of it when
    none newer was found at its end; a finished one lost nothing.

    live: an attempt still running ends at its last metrics row, not its last event (a checkpoint,
    minutes ago), so Prometheus' gauge moves between events; the steps since its last commit count as lost.
    """
    atts = attempts(events)
    helper = bool(named(events, CHECKPOINT_COMMITTED))  # a script that commits through script_helper tells steps
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
    parts["unknown"] = 0.0
    for i, a in enumerate(atts):
        wall = a["end"] - a["launched"]
        overhead = (a["start"] - a["launched"]) if a["start"] else wall
        kept = a["committed_step"] if a["committed_step"] is not None else (a["start_step"] or 0)
        after = atts[i + 1] if i + 1 < len(atts) else None
        if after and (after["resumed_from"] or "").startswith("memory") and after["start_step"] is not None:
            kept = max(kept, min(after["start_step"], a["reached_step"]))  # the memory tier kept these steps
        worked = max(0.0, wall - overhead - a["stall_s"])
        lost = min(max(0.0, (a["reached_step"] - kept) * step_s), worked)
        unknown = 0.0
        if a["script"] and not helper and a["ended_by"] != FINISH:
            if a["file_at"] is not None:  # the work after the file was written is redone
                lost = min(worked, max(0.0, a["end"] - max(a["file_at"], a["start"] or a["launched"])))
            elif a["looked"]:  # no newer file at its end: all of it is redone
                lost = worked
            else:
                unknown = worked
        parts["allocated"] += wall
        parts["overhead"] += overhead
        parts["stall"] += min(a["stall_s"], wall - overhead)
        parts["lost"] += lost
        parts["unknown"] += unknown
        parts["committed"] += max(0.0, worked - lost - unknown)
        if i + 1 < len(atts):
            gap = max(0.0, atts[i + 1]["launched"] - a["end"])
            if a["ended_by"] == IN_JOB_RESTART:
                parts["allocated"] += gap
                parts["overhead"] += gap
            else:
                parts["queue_wait"] += gap
    if parts["unknown"]:  # a script's attempt that nothing tells: no share is honest
        parts["goodput"] = None
    else:
        parts["goodput"] = parts["committed"] / parts["allocated"] if parts["allocated"] else 0.0
    return parts
