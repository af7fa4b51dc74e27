"""Stop signals, fault drills and the one requeue decision. Torch-free and cheap to import: the task's
entry point (start.py) installs the handlers before it imports anything else.

Slurm warns of the time limit with the --signal signal (USR2, not USR1: NCCL may install its own USR1
handler) and of preemption with SIGTERM to every task (or with USR2 when the cluster sets
preempt_send_user_signal). The handler appends the signal's name and returns: no I/O, no collectives,
no logging inside a handler. The attempt (attempt.py) all-reduces the flag at each step boundary, so
every rank saves the same step; job.py then asks `decide` whether to requeue.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import time
from pathlib import Path
from typing import Any

from hpc_train.reasons import Action, Fate, Reason
from hpc_train.task import Pulse

# submitit's local controller restarts every task of a job when one exits with this code; on Slurm the
# same code marks "saved and requeued" in sacct's ExitCode column.
REQUEUE_EXIT_CODE = 144
# Every rank of a training step that is relaunched inside the allocation (an in-job restart): sacct's
# ExitCode then says why the step ended; the batch script's srun() relaunches on its marker file, not this.
IN_JOB_RESTART_EXIT_CODE = 145
STOP_SIGNALS = (signal.SIGUSR2, signal.SIGTERM)
# Slurm may deliver the time-limit warning up to 60 s before the requested lead; 60 s more of margin.
TIME_LIMIT_SLACK_S = 120


class Unrecoverable(RuntimeError):
    """A failure no requeue can fix (e.g. the checkpoint needs another world size): the run stops at once."""


def collective_timeout_s(watchdog_s: float) -> float:
    """How long a collective may block before torch.distributed raises: past the watchdog's limit plus its
    polling interval (min(5, watchdog_s / 10) s), so the watchdog names a hang first."""
    return watchdog_s + 60.0


def install_handlers() -> Pulse:
    """Record-only handlers for USR2 and TERM, in place of submitit's (which requeue from inside the
    handler, on rank 0 only, without a save): the process's Pulse. Idempotent: a second call returns the Pulse the
    handlers already record into. From the main thread only (signal.signal)."""
    current = getattr(signal.getsignal(signal.SIGTERM), "__self__", None)
    if isinstance(current, Pulse):
        return current
    pulse = Pulse(installed_at=time.time())
    for sig in STOP_SIGNALS:
        signal.signal(sig, pulse.record)
    # A stop signal the batch shell caught while the last training step ended, relayed into this one
    # (an in-job restart, or the batch script's setup; relay.py) as "SIGUSR2@<Unix s>": as when it came, so
    # the stop save gets the time Slurm still gives, not that plus the relaunch (a bare name: now).
    name, _, at = os.environ.pop("HPC_TRAIN_PENDING_SIGNAL", "").partition("@")
    if name in ("SIGUSR2", "SIGTERM") and not pulse.received:
        age = time.time() - int(at) if at.isdigit() and int(at) > 0 else 0.0
        pulse.received_at.append(time.monotonic() - max(0.0, age))  # another node's clock ahead: now
        pulse.received.append(name)
    return pulse


def stop_reason(signals: list[str], end_in_s: float, signal_lead_s: int, preempted: bool = False) -> Reason:
    """ "time_limit" for a USR2 near the allocation's end (end_in_s: seconds from now to Slurm's EndTime,
    slurm.end_time, which follows --time-min, --deadline and `scontrol update TimeLimit=`; not
    cluster.timeout_min), else "preempt": SIGTERM, a job Slurm is preempting (PreemptTime set), or USR2
    sent early by preempt_send_user_signal, scancel --signal, the batch-shell relay or `hpc-train chaos`."""
    near_end = end_in_s <= signal_lead_s + TIME_LIMIT_SLACK_S
    return (
        Reason.TIME_LIMIT
        if "SIGUSR2" in signals and "SIGTERM" not in signals and near_end and not preempted
        else Reason.PREEMPT
    )


def time_left(
    pulse: Pulse, cluster: Any, end_s: float, preempted: bool, start_end_s: float, allocated_at: float
) -> tuple[float, float]:
    """This rank's (seconds from now until Slurm's SIGKILL, 1.0 for a time limit | 2.0 for a preemption)
    from its first stop signal; (inf, 0.0) with none. The end is Slurm's EndTime asked now (end_s; 0: no
    answer), else as the attempt started (start_end_s), else the frozen cluster.timeout_min from
    allocated_at; never later than Slurm's EndTime. The reason is judged by the end as it was when the
    signal came (a relayed one came before this step started). One judgement for the built-in trainer's
    Attempt and a user's script (script.py): callers all-reduce it (the least time left, the strongest reason)."""
    said = end_s or start_end_s
    end_in_s = (said or allocated_at + cluster.timeout_min * 60) - time.time()
    if not pulse.received_at:
        return float("inf"), 0.0
    since_s = max(0.0, time.monotonic() - pulse.received_at[0])
    reason = stop_reason(pulse.received, end_in_s + since_s, cluster.signal_lead_s, preempted=preempted)
    kill_in_s = seconds_to_kill(reason, cluster.signal_lead_s, cluster.preempt_grace_s)
    left = pulse.received_at[0] + kill_in_s - time.monotonic()
    return (min(left, end_in_s) if said else left), 2.0 if reason == Reason.PREEMPT else 1.0


def slurm_end(executor: str, job_id: str) -> tuple[float, float]:
    """(Slurm's EndTime of this job as Unix s, 0 when unknown; 1.0 when Slurm is preempting it), for a
    tensor; (0, 0) off Slurm. Rank 0 alone asks (one slurmctld call, not one per rank)."""
    from hpc_train import slurm

    if executor != "slurm":
        return 0.0, 0.0
    end, preempting = slurm.end_time(job_id)
    return end or 0.0, 1.0 if preempting else 0.0


def seconds_to_kill(reason: Reason, signal_lead_s: float, grace_s: float) -> float:
    """From the first signal to Slurm's SIGKILL: the time limit comes signal_lead_s after its warning; a
    preemption (SIGTERM, or USR2 under preempt_send_user_signal) kills after the partition's GraceTime."""
    return signal_lead_s if reason == Reason.TIME_LIMIT else grace_s


# ---- who owns a run directory ---------------------------------------------------------------------------

# A lease not renewed for LEASE_S is free. Its owner's rank 0 renews it every LEASE_RENEW_S from the
# watchdog thread, which runs through saves and collectives alike: 6 renewals missed before another job
# may take over; a suspended or partitioned owner is the only one that loses it while alive.
LEASE_S = 180.0
LEASE_RENEW_S = 30.0


def lease_verdict(lease: dict[str, Any] | None, me: str, now: float, owner_active: bool | None) -> bool:
    """May the job `me` train in a run directory whose lease says `lease`? (pure) Yes with no lease, its
    own from an earlier attempt, or one whose owner Slurm says is gone. No when Slurm says the owner is
    queued or running, however old its lease: a requeued owner comes back to it, and one suspended or on a
    full disk stops renewing while alive. When nobody can say (owner_active None: Slurm does not answer, or
    a local owner on another host), the lease's age does: renewed within two renewal periods (60 s), its
    owner lives; expires_at is for people reading the file."""
    if not lease or str(lease.get("job_id")) == me:
        return True
    if owner_active is None:
        return now - float(lease.get("renewed_at", 0)) >= 2 * LEASE_RENEW_S
    return not owner_active


# ---- fault drills ------------------------------------------------------------------------------------


def injected(fault: str) -> bool:
    """Drills set at submit: HPC_TRAIN_FAULT=raise_at_start,ecc_at_start,kill_rank_during_save,hang (with
    +cluster.env.HPC_TRAIN_FAULT=...). Each fires in the first attempt only unless its name ends in
    `_always`, so a drill shows the recovery."""
    faults = os.environ.get("HPC_TRAIN_FAULT", "").split(",")
    # The run's attempt (job.py sets it on Slurm too): a resumed job's SLURM_RESTART_COUNT starts at 0 again.
    first_attempt = os.environ.get("HPC_TRAIN_ATTEMPT", "0") in ("", "0")
    return f"{fault}_always" in faults or (fault in faults and first_attempt)


def claim_drill(drills: Path, name: str) -> bool:
    """A one-shot drill armed at run time (`hpc-train chaos RUN kill-rank-during-save` writes
    drills/<name>): the first process to rename it away fires it, exactly once."""
    try:
        os.rename(drills / name, drills / f"{name}.fired-{os.getpid()}")
        return True
    except OSError:
        return False


def drill_seconds(drills: Path, name: str) -> float:
    """A lasting drill armed at run time, e.g. drills/slow_storage holding "3.0": 0 when not armed."""
    try:
        return float((drills / name).read_text())
    except (OSError, ValueError):
        return 0.0


# ---- the requeue decision (pure) ---------------------------------------------------------------------


def decide(reason: Reason, events: list[dict[str, Any]], budgets: Any, fate: Fate) -> tuple[Action, str]:
    """The one requeue decision, for a clean stop and a failure alike (pure).

    reason: "preempt" | "time_limit" | "failure" | "node_health" (the preflight found a sick node);
    events: the run's events.jsonl; budgets: RequeueConfig;
    fate: what Slurm is doing with the job (slurm.job_fate / journal.local_fate): "running", "requeued",
    "cancelled", "batch_host_lost" (hot spares' --no-kill job ended by the loss of its batch script's node:
    requeued as a failure) or "unknown" (scontrol did not answer: treated as running, since requeueing a live
    run beats losing it). Returns (REQUEUE, "") when we must requeue, (SLURM, why) when Slurm already does (or
    the job requeued itself: requeued_inside, within its budget), (STOP, why) when the run ends here.
    """
    from hpc_train import journal  # here, not at the top: start.py imports this module before its handlers

    if fate == Fate.CANCELLED:
        return Action.STOP, "cancelled (scancel or hpc-train cancel): not requeueing"
    inside = requeued_inside(reason, fate)
    if fate == Fate.REQUEUED and not inside:
        return Action.SLURM, "Slurm requeued the job itself (scontrol requeue or a node failure): no budget spent"
    if reason == Reason.NODE_HEALTH:  # a sick node, not the run's fault: bounded by `exclusion`, not a requeue budget
        return Action.REQUEUE, ""
    key = journal.BUDGET_KEYS[reason]
    limit = getattr(budgets, key)
    if reason == Reason.FAILURE:
        used = journal.failures_in_a_row(events)
        if limit != -1 and used >= limit:
            return Action.STOP, (
                f"failure budget spent: {used} failure requeues in a row without a newer checkpoint "
                f"(requeue.{key}={limit})"
            )
    else:
        used = journal.requeues_counted(events, reason)
        if limit != -1 and used >= limit:
            cancel = "; the requeue made inside the job is cancelled" if inside else ""
            return Action.STOP, (
                f"{reason} budget spent: {used} requeues for {reason} already (requeue.{key}={limit}){cancel}"
            )
    if inside:
        return Action.SLURM, REQUEUED_INSIDE
    return Action.REQUEUE, ""


# Lightning's auto_requeue runs `scontrol requeue` in its USR1 handler; submitit's own handler does the same.
REQUEUED_INSIDE = (
    "the job was requeued from inside it during the time-limit warning (Slurm requeues no job for its time limit "
    "itself: the script's own `scontrol requeue`, e.g. Lightning's auto_requeue, or a person's): counted under "
    "requeue.max_time_limit_requeues"
)


def requeued_inside(reason: Reason, fate: Fate) -> bool:
    """A requeue Slurm did not make (pure): the job is requeued while its ranks stop for the time-limit warning.
    Slurm ends a job at its time limit as TIMEOUT and never requeues it, so someone's `scontrol requeue` did: the
    script's own (a framework's auto-requeue), or a person's. It counts against the time-limit budget as ours
    would; a preemption requeued meanwhile is Slurm's own at GraceTime's end, and costs none."""
    return fate == Fate.REQUEUED and reason == Reason.TIME_LIMIT


BATCH_HOST_LOST = (
    "the batch script's node was lost (Slurm ended the job): nothing here can relaunch the step; requeueing"
)


@dataclasses.dataclass(frozen=True)
class RestartFacts:
    """What in_job_restart decides from: the run's spares and sizes, the decision it would replace, Slurm's fate,
    the signals seen, the in-job restarts used in a row and their budget, the allocation and the time left."""

    spare_nodes: int  # cluster.spare_nodes
    action: str  # what `decide` chose
    reason: Reason
    fate: Fate
    signals: list[str]
    used: int  # journal.in_job_restarts_in_a_row
    budget: int  # requeue.max_in_job_restarts
    job_nodes: list[str]  # the allocation's nodes
    left_out: list[str]  # of those, the blamed ones
    nodes: int  # cluster.nodes
    left_s: float = float("inf")  # to Slurm's EndTime
    startup_s: float = 0.0  # journal.startup_s: the slowest launch -> first step so far
    signal_lead_s: float = 0.0
    min_nodes: int | None = None


def in_job_restart(facts: RestartFacts) -> tuple[int, str]:
    """Relaunch the training step inside the allocation instead of the requeue `decide` chose? (pure)
    (the relaunch's node count, "") to relaunch, else (0, why not) ("" reasons never print: no spares asked
    for, or no requeue to replace).

    Only in place of a requeue after a failure or a failed preflight (reason "failure" | "node_health") of a
    job Slurm still runs (fate "running", or "unknown" as `decide` reads it) with no stop signal seen: a
    time limit or a preemption gives the allocation back through the stop save and the requeue as before.
    Needs the budget (used: in-job restarts in a row, journal.in_job_restarts_in_a_row), `nodes` of the
    allocation's job_nodes that are not left_out (the nodes of this job blamed so far; with cluster.min_nodes,
    at least min_nodes: the step goes on smaller once no spare is left, on all the healthy nodes up to
    `nodes`, as an elastic requeue would), and time: left_s
    (now to Slurm's EndTime) at least startup_s (the run's slowest launch -> first step, journal.startup_s)
    + signal_lead_s, so the relaunched step trains before the time-limit warning; with less it would reach
    its first step boundary after the warning, or be killed before it, and the requeue it ends in (if any)
    is one a requeue now makes without the start-up."""
    f = facts
    if not f.spare_nodes or f.action != Action.REQUEUE:
        return 0, "no spares asked for" if not f.spare_nodes else f"not a requeue ({f.action})"
    if f.fate == Fate.BATCH_HOST_LOST:  # before the signals: the job's end sent its tasks a SIGTERM too
        return 0, BATCH_HOST_LOST
    if f.reason not in (Reason.FAILURE, Reason.NODE_HEALTH) or f.signals:
        return 0, f"a stop signal ({f.reason}, {f.signals}): the stop save and the requeue give the allocation back"
    if f.fate not in (Fate.RUNNING, Fate.UNKNOWN):
        return 0, f"Slurm is not running the job as before ({f.fate})"
    if f.budget == 0:
        return 0, "requeue.max_in_job_restarts=0: never inside the allocation; requeueing"
    if f.used >= f.budget:
        return 0, (
            f"in-job restart budget spent: {f.used} in a row without a newer checkpoint "
            f"(requeue.max_in_job_restarts={f.budget}); requeueing"
        )
    healthy = sorted(set(f.job_nodes) - set(f.left_out))
    if len(healthy) < (f.min_nodes or f.nodes):
        floor = f"cluster.nodes={f.nodes}" if f.min_nodes is None else f"cluster.min_nodes={f.min_nodes}"
        return 0, (
            f"no spare left: {len(healthy)} healthy nodes of the allocation ({', '.join(healthy) or 'none'}; "
            f"left out: {', '.join(f.left_out)}) for {floor}; requeueing"
        )
    if f.left_s < f.startup_s + f.signal_lead_s:
        return 0, (
            f"{max(f.left_s, 0.0):.0f} s left before the time limit, under the {f.startup_s + f.signal_lead_s:.0f} s a "
            f"relaunch needs to train before its warning (the slowest start-up so far, {f.startup_s:.0f} s, + "
            f"cluster.signal_lead_s={f.signal_lead_s:g}); requeueing"
        )
    return min(len(healthy), f.nodes), ""


def hung_ranks(counts: dict[int, int], world_size: int) -> list[int]:
    """The ranks a hang is blamed on (pure), from the heartbeat counts the ranks wrote as they failed
    (counts: rank -> ticks): those behind every other rank, when they are at most half the ranks (a node's
    ranks, or 1 of 2). [] when all are level (blocked together, e.g. in FSDP's forward all-gather), when
    most are behind, or with fewer than two counts. A rank that wrote none is not blamed: it may have died
    of a peer's exit before its watchdog fired."""
    if len(counts) < 2 or min(counts.values()) == max(counts.values()):
        return []
    behind = [r for r, t in counts.items() if t == min(counts.values())]
    return sorted(behind) if 2 * len(behind) <= world_size else []


# ---- sick nodes left out (pure) ----------------------------------------------------------------------

# Error text that blames this node's hardware, not the code: a rank that fails first with one of these has
# its node left out of the next attempt. Not any Python exception (a code bug would exclude innocent
# nodes), not NCCL errors in general (a peer's death shows as one on every rank), not CUDA out of memory
# (a config). "unhandled cuda error" is NCCL's ncclUnhandledCudaError: a CUDA call failed in this process.
# Whole words, case-insensitive: "Xid" alone matched '/data/oxide-corpus/meta.json'. Not "Input/output
# error" (a Lustre EIO on shared storage blames no node), not "all CUDA-capable devices are busy or
# unavailable" (exclusive-process mode or CUDA_VISIBLE_DEVICES: a config).
HARDWARE_ERRORS = (
    r"\buncorrectable ECC error",
    r"\bXid\b",
    r"\bfallen off the bus\b",
    r"\bunhandled cuda error\b",
    r"\bno CUDA-capable device is detected\b",
)


def hardware_error(text: str, gpu_node: bool = True) -> str:
    """The first HARDWARE_ERRORS marker found in a failure's text, as written there; "" for anything else. On a
    node without NVIDIA's driver (gpu_node=False: a CPU node, where a CUDA build of torch says "no CUDA-capable
    device is detected") that line is the code's or the config's, never the node's."""
    found = (re.search(p, text, re.IGNORECASE) for p in HARDWARE_ERRORS if gpu_node or "CUDA-capable" not in p)
    return next((m.group(0) for m in found if m), "")


# An import or open that failed on the file system, not in the code: a stale NFS handle, an I/O error, a shared
# library a node lacks or read half (a Triton cache on a shared $HOME: pytorch issue 173679). Another attempt, on
# another node, may well succeed, so such a failure keeps its retries even before any progress.
TRANSIENT_IO = re.compile(
    r"\[Errno (?!2\])\d+\]|Stale file handle|Input/output error|cannot open shared object file|file too short"
    r"|cannot read file data|Transport endpoint is not connected",
    re.IGNORECASE,
)


def gpu_node() -> bool:
    """NVIDIA's kernel driver is loaded here: a GPU node, even when its GPU fell off the bus."""
    return os.path.exists("/proc/driver/nvidia")


def exclusion(
    events: list[dict[str, Any]],
    sick: dict[str, str],
    max_excluded_nodes: int,
    spare_nodes: int | None,
    local: bool = False,
    allocation: list[str] | None = None,
) -> tuple[list[str], str, str]:
    """Leave the sick nodes out of the next attempt? (pure) Returns (every node the next attempt leaves out,
    sorted; why the sick nodes are NOT left out, or ""; why the run stops, or "").

    Not left out when requeue.max_excluded_nodes is spent or the partition would keep too few nodes
    (spare_nodes = its usable nodes - the nodes the run needs; None: unknown). For an in-job restart,
    `allocation` (the job's nodes) with spare_nodes = its nodes beyond the run's fewest (cluster.min_nodes,
    else cluster.nodes): only the left-out nodes in it count, since the step starts there, whatever the
    partition holds (on a partition of exactly nodes + spare_nodes the partition's count has no node to
    spare). Either way the run requeues anyway,
    under requeue.max_failures, so three unrelated faults weeks apart do not stop a healthy run. A node
    sick again though left out: its ExcNodeList may have been lost (the requeued job's KillWait); set it
    once more; it stops the run only when ExcNodeList took (or was set twice) and the node is back."""
    from hpc_train import journal

    before = journal.excluded_nodes(events)
    for node in (n for n in sick if n in before):
        took, times = journal.exclusion_took(events, node)
        if took or times >= 2:
            how = (
                "ExcNodeList took (an exclude_nodes event with ok=true)"
                if took
                else f"ExcNodeList was set {times} times without an exclude_nodes event with ok=true"
            )
            return (
                [],
                "",
                (
                    f"{node} failed again ({sick[node]}) though left out since an earlier attempt: {how}; "
                    f"fix the node or add it to cluster.exclude, then `hpc-train resume RUN`"
                ),
            )
    after = {**before, **sick}
    new = {n: why for n, why in sick.items() if n not in before}
    named, it = "; ".join(f"{n}: {why}" for n, why in new.items()), "it" if len(new) == 1 else "them"
    fix = (
        f"requeued without leaving {it} out, as after any failure (requeue.max_failures); have the admins check "
        f"{it}, or leave {it} out for good with cluster.exclude"
    )
    if local:
        return sorted(before), f"a local run has one machine: nowhere to leave it out ({named}); {fix}", ""
    if not new:  # only nodes already left out, sick again: set the same ExcNodeList once more, no budget spent
        return sorted(before), "", ""
    if len(after) > max_excluded_nodes:
        return (
            sorted(before),
            (
                f"node-exclusion budget spent: {len(after)} sick nodes would be left out, more than "
                f"requeue.max_excluded_nodes={max_excluded_nodes} ({named}); {fix}, or raise the "
                f"budget with `hpc-train resume RUN --max-excluded-nodes {len(after) + 1}`"
            ),
            "",
        )
    counted = [n for n in after if allocation is None or n in allocation]
    if spare_nodes is not None and len(counted) > spare_nodes:
        room = max(spare_nodes, 0)
        where = (
            f"the partition has {room} usable nodes beyond those it needs"
            if allocation is None
            else f"the allocation holds {room} node(s) beyond cluster.min_nodes (else cluster.nodes)"
        )
        return (
            sorted(before),
            f"leaving out {len(counted)} sick nodes would leave too few for the run: {where} ({named}); {fix}",
            "",
        )
    return sorted(after), "", ""


# sinfo's short states of a node that cannot take the next attempt (a lost node is drained or down); a
# trailing "*" means not responding.
UNUSABLE = ("drain", "drng", "down", "fail", "maint", "pow", "unk", "boot", "resv", "inval")


def usable_nodes(states: dict[str, str]) -> set[str]:
    """Nodes that can take a job once their jobs end: neither drained, down, nor not responding."""
    return {n for n, st in states.items() if not st.endswith("*") and not st.startswith(UNUSABLE)}


def free_now(own_nodes: list[str], states: dict[str, str], excluded: list[str]) -> set[str]:
    """Nodes the next attempt could start on at once (pure): the partition's idle nodes plus own_nodes (the
    job's own, completing after its requeue) that are not drained or down, less the excluded ones. Not
    "idle*": a node just back from `scontrol update State=RESUME` shows idle* (not responding) until it
    answers the controller's ping, ~1 s on the dev cluster, and Slurm starts nothing on it before; a node
    whose slurmd died shows the same for SlurmdTimeout (300 s by default) before it turns down*."""
    return ({n for n, st in states.items() if st == "idle"} | (set(own_nodes) & usable_nodes(states))) - set(excluded)


def not_free(job_id: str, states: dict[str, str], free: set[str], jobs: list[dict[str, Any]]) -> dict[str, str]:
    """node -> state for the partition's nodes neither free now nor held by another running job (pure): what
    the estimate left out and why (drng, down*, idle* just resumed, "idle excluded"), for the requeue event."""
    held = {n for j in jobs if j["state"] == "RUNNING" and j["id"] != job_id for n in j["nodes"]}
    excluded = job_excluded(job_id, jobs)
    return {
        n: f"{st} excluded" if n in excluded else st
        for n, st in sorted(states.items())
        if n not in free and n not in held
    }


def fit_exclusions(
    excluded: list[str], states: dict[str, str], need: int, exclude: list[str]
) -> tuple[list[str], list[str]]:
    """Which of the run's left-out nodes (`excluded`, oldest blame first) a requeued job can keep in its
    ExcNodeList and still find `need` nodes in the partition (pure): (kept, let back in), both sorted. An
    in-job restart counts only its allocation, so exclusions grow past what the partition can spare: 2 nodes
    left out inside a 3 + 1 allocation on a 4-node partition left the requeued job pending for good. The
    most recently blamed stay out; a node unusable anyway (drained, down) costs nothing and stays too.
    states: node -> sinfo's short state; exclude: cluster.exclude, never let in."""
    usable = usable_nodes(states) - set(exclude)
    costly = [n for n in excluded if n in usable]
    back = costly[: max(0, len(costly) - max(0, len(usable) - need))]
    return sorted(set(excluded) - set(back)), sorted(back)


def spare_nodes(states: dict[str, str], need: int, exclude: list[str]) -> int:
    """The partition's nodes in a usable state (states: node -> sinfo's short state), less cluster.exclude,
    beyond the `need` the run has (pure). Not TotalNodes: it counts drained and down nodes, so exclusions
    could leave fewer usable nodes than the run needs and the requeued job would pend."""
    return len(usable_nodes(states) - set(exclude)) - need


def full_size_wait_s(
    need: int, job_id: str, own_nodes: list[str], states: dict[str, str], jobs: list[dict[str, Any]], now: float
) -> float | None:
    """Seconds until `need` nodes could be free for job `job_id` (pure), from one snapshot: free_now, and if
    short, running jobs' nodes as their end times come, soonest first. None when unknown (a job with no end
    time, or too few nodes even then). states: node -> sinfo's short state; jobs: {"id", "state", "end"
    (Unix s or None), "nodes", "excluded"}, as slurm.parse_queue gives them."""
    excluded = job_excluded(job_id, jobs)
    usable = usable_nodes(states)
    free = free_now(own_nodes, states, excluded)
    if len(free) >= need:
        return 0.0
    running = sorted(
        (j for j in jobs if j["id"] != job_id and j["state"] == "RUNNING"),
        key=lambda j: float("inf") if j["end"] is None else j["end"],
    )
    for j in running:
        if j["end"] is None:
            return None
        free |= set(j["nodes"]) & usable - set(excluded)
        if len(free) >= need:
            return max(0.0, j["end"] - now)
    return None


def job_excluded(job_id: str, jobs: list[dict[str, Any]]) -> list[str]:
    """The nodes job `job_id` excludes (its ExcNodeList, squeue %x), from the snapshot's jobs."""
    return next((j["excluded"] for j in jobs if j["id"] == job_id), [])


def next_size(
    min_nodes: int,
    max_nodes: int,
    tasks_per_node: int,
    wait_s: float | None,
    shrink_after_s: float,
    free_now: int | None = None,
) -> dict[str, str]:
    """The `scontrol update` fields for a requeued elastic job's next attempt (pure): wait for all nodes
    (grow back) when they are free within shrink_after_s, else go on with the nodes free now (free_now,
    at least min_nodes; min_nodes when unknown). An exact count, not a range, and NumTasks to match:
    a task count that disagrees with the nodes makes srun ignore --ntasks-per-node ("can't honor") and
    place the ranks unevenly. (With the earlier --ntasks-per-node header a requeued job also
    kept its last count: NumNodes=2-3 with NumTasks=8 left it pending, Reason=BadConstraints, 22.05.)"""
    grow = wait_s is not None and wait_s <= shrink_after_s
    low = max_nodes if grow else min(max_nodes, max(min_nodes, free_now or 0))
    return {"NumNodes": f"{low}-{low}", "NumTasks": str(low * tasks_per_node)}
