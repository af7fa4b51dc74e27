"""The one requeue decision and its application: Slurm's facts (the job's fate, the nodes it holds, the queue),
preempt.decide's action, the exclusions and the next attempt's size, the records, the sentence; and the stop's
agreement (rank 0 decides, every rank leaves by the broadcast verdict)."""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

from hpc_train import deadlines, decision, journal, pipeline, preempt, rejoin, relay, slurm, verdict
from hpc_train.decision import Decision, Facts, Inside, Queue
from hpc_train.env import parse_nodelist
from hpc_train.paths import RunPaths
from hpc_train.reasons import STOP_SIGNALLED, Action, Fate, Reason
from hpc_train.task import Task
from hpc_train.verdict import Verdict

log = logging.getLogger(__name__)


def spare_nodes(env: Any, cluster: Any) -> int | None:
    """Nodes of the job's partition in a usable state beyond those the run needs and cluster.exclude
    (preempt.spare_nodes); None when Slurm does not say. The local executor has one machine: none spare."""
    if env.executor != "slurm":
        return 0
    try:
        states = slurm.node_states(cluster.partition or os.environ.get("SLURM_JOB_PARTITION", ""))
    except slurm.SlurmError:
        return None
    # What the requeued job asks for: nodes + spare_nodes with hot spares (a fixed allocation), else min_nodes
    need = cluster.nodes + cluster.spare_nodes if cluster.spare_nodes else cluster.min_nodes or cluster.nodes
    return preempt.spare_nodes(states, need, parse_nodelist(cluster.exclude or "")) if states else None


def gather(
    paths: RunPaths, env: Any, cfg: Any, reason: Reason, sick: dict[str, str] | None, signals: list[str]
) -> Facts:
    """Slurm's facts and the journal's, asked once for one decision (decision.Facts). signals: the Pulse's own list,
    not a copy: a preemption's TERM during the Slurm calls that follow (scontrol requeue retries for up to 33 s)
    makes a refused requeue a wait for Slurm's, not a stop (decision.after_refusal)."""
    stopping = reason in STOP_SIGNALLED
    on_slurm = env.executor == "slurm"
    events = journal.read(paths.run_dir)
    restarts = int(os.environ.get("SLURM_RESTART_COUNT") or 0)  # Slurm's count for this job, not the run's attempt
    fate = (
        slurm.job_fate(env.job_id, restarts, slurm.STOP_FATE if stopping else slurm.FATE)
        if on_slurm
        else journal.local_fate(events)
    )
    budgets = dataclasses.replace(cfg.requeue, **journal.budget_changes(events))  # raised by `hpc-train resume`
    # Hot spares (sbatch --no-kill): the job outlives a lost node, which is blamed here, so that a relaunch and a
    # requeue's ExcNodeList leave it out (a requeued job started on it again while its slurmd still held the old
    # one: "Duplicate jobid", node drained, the job held). A stop asks only when its batch host is gone.
    held: slurm.Allocation | None = None
    spares = bool(cfg.cluster.spare_nodes) and on_slurm
    if spares and (not stopping or fate == Fate.BATCH_HOST_LOST):
        held = slurm.allocation(env.job_id, slurm.STOP_FATE if stopping else slurm.FATE)
        # read after the fate: the batch host may have left NodeList since (Slurm ends the job ms later)
        fate = Fate.BATCH_HOST_LOST if held and slurm.batch_host_lost(held) else fate
        allocated, known = os.environ.get("SLURM_JOB_NODELIST", ""), journal.excluded_nodes(events)
        sick = {**lost_nodes(allocated, held, known, fate == Fate.BATCH_HOST_LOST), **(sick or {})} or None
    # Only what this decision can use: nothing more after a stop (cancelled, a budget spent), no restart inside the
    # allocation after a stop signal (preempt.in_job_restart refuses it), and the partition's spare nodes only for
    # the requeue path: a relaunch counts the allocation's (each sinfo up to 21 s, EndTime 3 s, the relay 6 s)
    action, _ = preempt.decide(reason, events, budgets, fate)
    may_restart = spares and action == "requeue" and not (stopping or signals) and fate != Fate.BATCH_HOST_LOST
    facts = Facts(
        reason,
        stopping,
        events,
        fate,
        budgets,
        held,
        sick,
        signals,
        executor=env.executor,
        job_id=env.job_id,
        nodes=tuple(getattr(env, "nodes", ())),
        queue=snapshot(env, cfg, stopping) if action != "stop" else None,
        inside=_inside_facts(env, cfg) if may_restart else None,
        now=time.time(),
    )
    if sick and action != "stop" and decision.decide(facts, cfg).action not in (Action.RELAUNCH, Action.REJOIN):
        facts = dataclasses.replace(facts, spare=spare_nodes(env, cfg.cluster))
    return facts


def _inside_facts(env: Any, cfg: Any) -> Inside:
    """A hot-spares failure's facts for a restart inside the allocation: its nodes, the time left (Slurm's EndTime:
    one scontrol call, 3 s at most, else the frozen time limit from the allocation's start the batch script noted),
    the relay's silence, whether our batch script started the step, whether scontrol exists at all (a container)."""
    folder, slurm_job = os.environ.get("SUBMITIT_FOLDER"), os.environ.get("SLURM_JOB_ID")
    our_step = bool(folder and slurm_job and os.environ.get("HPC_TRAIN_STEP_ARGS"))  # exported by our batch script
    end = (
        slurm.end_time(env.job_id)[0]
        or float(os.environ.get("HPC_TRAIN_ALLOCATED_AT") or "inf") + cfg.cluster.timeout_min * 60
    )
    left_s = end - time.time()  # now, before the relay's recheck may sleep 6 s
    silent = relay_silent_s(Path(folder), slurm_job) if our_step and folder and slurm_job else 0.0
    return Inside(
        parse_nodelist(os.environ.get("SLURM_JOB_NODELIST", "")),
        left_s,
        silent,
        our_step,
        shutil.which("scontrol") is not None,
        str(relay.beat_file(Path(folder), slurm_job)) if silent and folder and slurm_job else "",
    )


def relay_silent_s(folder: Path, slurm_job: str) -> float:
    """How long the batch script's relay has been silent (its node lost), or 0.0 when it lives or nobody knows
    (relay.beat_at). Older than deadlines.RELAY_SILENT_S by this node's clock, the beat is read once more
    deadlines.RELAY_RECHECK_S later: a changed one is a live relay on a node whose clock is behind, not a lost one."""
    beat = relay.beat_at(folder, slurm_job)
    if beat is None or time.time() - beat <= deadlines.RELAY_SILENT_S:
        return 0.0
    time.sleep(deadlines.RELAY_RECHECK_S)
    return time.time() - beat if relay.beat_at(folder, slurm_job) == beat else 0.0


def snapshot(env: Any, cfg: Any, stopping: bool) -> Queue | None:
    """An elastic run's queue snapshot (slurm.queue_snapshot; stopping: the stop path's shorter policy,
    slurm.STOP_SNAPSHOT); None for a run that is not elastic (no call)."""
    if not elastic(env, cfg):
        return None
    partition = cfg.cluster.partition or os.environ.get("SLURM_JOB_PARTITION", "")
    try:
        states, jobs = slurm.queue_snapshot(partition, env.job_id, slurm.STOP_SNAPSHOT if stopping else (10.0, 1))
    except slurm.SlurmError as e:
        return Queue(error=str(e))
    return Queue(states, jobs)


def requeue_or_stop(
    paths: RunPaths,
    env: Any,
    cfg: Any,
    reason: Reason,
    step: int,
    sick: dict[str, str] | None = None,
    hang: bool = False,
    *,
    signals: list[str],
) -> Verdict:
    """Gather the facts once (Slurm's fate of the job, or the local event log's; `sick` nodes, {node: why}), decide
    (decision.decide, pure) and apply the decision. Returns Verdict.REQUEUE (the job comes back, without the run's
    excluded nodes), RELAUNCH (hot spares: the batch script starts the training step again inside the allocation,
    without them), REJOIN (cluster.in_process_restart), WAIT (only Slurm can bring it back: stay alive until it ends
    the job) or STOP. After a stop signal ("time_limit", "preempt") the Slurm calls take the stop path's shorter
    policies, whose worst case deadlines.REQUEUE_RESERVE_S reserves. hang: the watchdog fired (an in-job restart
    relaunches, never rejoins: rejoin.plan_rejoin). signals: the stop signals this rank received (Task.pulse)."""
    facts = gather(paths, env, cfg, reason, sick, signals)
    record = lambda name, **f: journal.log(paths.run_dir, name, step, env.job_id, env.restart_count, **f)  # noqa: E731
    return apply(paths, env, cfg, facts, decision.decide(facts, cfg), record, hang)


def apply(
    paths: RunPaths, env: Any, cfg: Any, facts: Facts, d: Decision, record: Callable[..., None], hang: bool = False
) -> Verdict:
    """The one place a decision is acted on: its sentences said, its records written, Slurm asked (scontrol requeue
    and update), the relaunch marker or the rejoin plan written; a relaunch or a rejoin that cannot be made takes
    the decision's fallback."""
    for line in d.said:
        log.warning(line)
    if d.action == Action.REJOIN:
        used = journal.in_job_restarts_in_a_row(facts.events)
        if rejoin.plan_rejoin(paths, env, facts.events, facts.sick or {}, used, d.reason, record, hang):
            return Verdict.REJOIN
        assert d.fallback is not None
        return apply(paths, env, cfg, facts, d.fallback, record, hang)
    if d.action == Action.RELAUNCH:
        folder, slurm_job = os.environ.get("SUBMITIT_FOLDER", ""), os.environ.get("SLURM_JOB_ID", "")
        try:
            relay.write_marker(Path(folder), slurm_job, d.srun_args)
        except OSError as e:  # a full disk: the requeue still brings the run back
            log.warning("could not write the relaunch marker (%s): requeueing", e)
            assert d.fallback is not None
            return apply(paths, env, cfg, facts, d.fallback, record, hang)
        _write(record, d.records)
        log.warning(d.why)
        return Verdict.RELAUNCH
    _write(record, d.records)
    inside = preempt.requeued_inside(d.reason or facts.reason, facts.fate)
    if d.action == Action.STOP:
        record(journal.STOPPED, reason=d.why)
        log.error("not requeueing: %s", d.why)
        if inside and env.executor == "slurm":  # first: the job the script requeued starts again unless cancelled
            cancel_own_job(env.job_id)
        settle(paths, d.why)
        return Verdict.STOP
    if d.action == Action.SLURM:
        err = update_next_attempt(env, cfg.cluster, list(d.excluded), d.size, record)
        error = {"nodes_update_error": err} if err and d.size else {}
        by = "inside_job" if inside else "slurm"  # inside_job counts against its budget (journal.requeues_counted)
        record(journal.REQUEUE, reason=d.reason, by=by, note=d.why, **d.snapshot, **error)
        return Verdict.REQUEUE
    err = (
        slurm.requeue(env.job_id, slurm.STOP_REQUEUE if facts.stopping else slurm.REQUEUE)
        if env.executor == "slurm"
        else ""
    )
    if not err:
        err = update_next_attempt(env, cfg.cluster, list(d.excluded), d.size, record)  # first: KillWait may end us
        error = {"nodes_update_error": err} if err and d.size else {}
        record(journal.REQUEUE, reason=d.reason, by="hpc_train", fate=facts.fate, **d.snapshot, **error)
        return Verdict.REQUEUE
    restarts = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
    if env.executor == "slurm" and slurm.job_fate(env.job_id, restarts, slurm.STOP_FATE) == Fate.REQUEUED:
        # refused because the job was requeued meanwhile (the script's own `scontrol requeue`, an operator's):
        # it comes back all the same, and counts as the decision said (preempt.requeued_inside)
        by = "inside_job" if preempt.requeued_inside(d.reason, Fate.REQUEUED) else "slurm"
        record(journal.REQUEUE, reason=d.reason, by=by, note=f"requeued meanwhile; ours was refused: {err}")
        return Verdict.REQUEUE
    # No requeue, so no pending job to set ExcNodeList on: the node's next preflight finds it and sets it then.
    excluded = sorted(d.excluded)
    unset = {"exclude_nodes": f"not set ({','.join(excluded)}): the job was not requeued"} if excluded else {}
    record(journal.REQUEUE_FAILED, reason=d.reason, fate=facts.fate, error=err, **unset)
    then = decision.after_refusal(d.reason, facts.signals, facts.fate)  # the live list: a TERM during the retries
    if then == "stop":
        settle(paths, f"its requeue failed: {err}")
    log.error(
        f"requeue failed: {err}; "
        + (
            "waiting for Slurm to end and requeue the preempted job"
            if then == "wait"
            else "the last committed checkpoint stays; resubmit to go on"
        )
    )
    return Verdict(then)


def cancel_own_job(job_id: str) -> None:
    """scancel this job (one try of 5 s, shielded from the stop signals): a stop for good whose job Slurm has
    requeued meanwhile. Inside KillWait (30 s by default, 10 s on the dev cluster), so first and short."""
    try:
        slurm.call(["scancel", job_id], timeout_s=5.0, retries=0, ignore_term=True)
    except slurm.SlurmError as e:
        log.error("could not cancel job %s, which was requeued: %s; scancel it by hand", job_id, e)


def settle(paths: RunPaths, why: str) -> None:
    """This run stopped for good (`why`): the runs queued after it (submit --after) are told, the :ok ones cancelled
    (pipeline.settle_dependents, asking Slurm no states: the stop path's few seconds). Never raises: a failure here
    leaves their cancel to Slurm's --kill-on-invalid-dep."""
    try:
        pipeline.settle_dependents(paths.run_dir, why, ask_slurm=False)
    except Exception as e:
        log.warning("the runs queued after %s were not told it stopped: %s", paths.run_dir, e)


def _write(record: Callable[..., None], records: tuple[tuple[str, dict[str, Any]], ...]) -> None:
    for name, fields in records:
        record(name, **fields)


def update_next_attempt(
    env: Any, cluster: Any, nodes: list[str], size: dict[str, str], record: Callable[..., None]
) -> str:
    """One `scontrol update` of the requeued job: ExcNodeList (the run's excluded nodes and cluster.exclude)
    and an elastic run's NumNodes/NumTasks together, so either both land or neither (ExcNodeList alone
    with a failed NumNodes could leave NumTasks=8 on too few usable nodes: pending for good). Only now:
    Slurm 22.05 refuses both on a running job ("Job is no longer pending execution"); the requeued job is
    PENDING and cannot start before cred_expire (10 s on the dev cluster, 120 s by default). Set at every
    requeue while the run has excluded nodes: it also survives a lost first try. `nodes`: oldest blame
    first; the oldest are let back in where the partition would keep too few for the job (fit_exclusions).
    Returns "" or the error."""
    if env.executor != "slurm" or not (nodes or size):
        return ""
    kept, let_in, why = fit_exclusions(cluster, nodes)
    value = ",".join([*kept, *([cluster.exclude] if cluster.exclude else [])])  # "": clears an earlier one
    err = slurm.update_job(env.job_id, {**({"ExcNodeList": value} if nodes else {}), **size})
    if nodes:
        extra = {"let_in": let_in, "why": why} if let_in else {}
        record(journal.EXCLUDE_NODES, nodes=value, ok=not err, **extra, **({"error": err} if err else {}))
        if let_in:
            log.warning(why)
        if err:
            log.warning(f"could not leave out {value}: {err}")
    return err


def fit_exclusions(cluster: Any, nodes: list[str]) -> tuple[list[str], list[str], str]:
    """(the nodes the requeued job still leaves out, sorted; those let back in; the sentence that says so):
    the partition must keep the job's nodes (nodes + spare_nodes, else min_nodes or nodes) usable beyond them
    (preempt.fit_exclusions). One sinfo try of 5 s (slurm.STOP_SNAPSHOT: this runs after a stop's requeue
    too, inside KillWait); no answer: all stay out, as before."""
    need = cluster.nodes + cluster.spare_nodes if cluster.spare_nodes else cluster.min_nodes or cluster.nodes
    partition = cluster.partition or os.environ.get("SLURM_JOB_PARTITION", "")
    # cluster.nodelist's nodes are required (--nodelist): one of them in ExcNodeList keeps the job pending for good
    required = sorted(n for n in nodes if n in set(parse_nodelist(cluster.nodelist or "")))
    nodes = [n for n in nodes if n not in required]
    said = f"ExcNodeList lets {','.join(required)} back in: cluster.nodelist requires them" if required else ""
    try:
        states = slurm.node_states(partition, slurm.STOP_SNAPSHOT) if nodes else {}
    except slurm.SlurmError:
        states = {}
    if not states:
        return sorted(nodes), required, said
    kept, let_in = preempt.fit_exclusions(nodes, states, need, parse_nodelist(cluster.exclude or ""))
    usable = len(preempt.usable_nodes(states) - set(parse_nodelist(cluster.exclude or "")))
    why = (
        f"ExcNodeList lets {','.join(let_in)} back in (left out longest ago): the job needs {need} nodes and "
        f"partition {partition or '(default)'} has {usable} usable, so leaving out all {len(nodes)} of "
        f"{','.join(sorted(nodes))} would keep it pending for good; {','.join(kept) or 'none'} stay out"
    )
    return kept, sorted([*let_in, *required]), "; ".join(filter(None, [said, why if let_in else ""]))


def elastic(env: Any, cfg: Any) -> bool:
    return env.executor == "slurm" and cfg.cluster.elastic()


def lost_nodes(
    allocated: str, now: slurm.Allocation | None, known: Collection[str] = (), batch_host_lost: bool = False
) -> dict[str, str]:
    """The nodes Slurm took out of this job since it started, {node: why} (pure). With hot spares the job is
    submitted --no-kill, so a failed node (silent for SlurmdTimeout, or set DOWN by an admin or a health check) is
    excised from it and the tasks there killed while the job goes on (slurm.allocation); `allocated`:
    SLURM_JOB_NODELIST, which keeps the first list. Once the job ends (COMPLETING lists only the nodes still
    completing: an idle spare drops out in ms) only the batch host, and only when Slurm's fate says so
    (batch_host_lost: its script killed with its node, slurm.parse_fate). Not those `known` (left out already,
    journal.excluded_nodes): blamed again at a later failure of the same allocation, such a node read as "sick
    again though left out" and stopped the run. {} when Slurm did not answer (now None)."""
    if now is None or not now.nodes:
        return {}
    if now.state != "RUNNING":
        host = now.batch_host
        if batch_host_lost and host in parse_nodelist(allocated) and host not in now.nodes and host not in known:
            return {host: f"{host}, the batch script's node, left the job's allocation: a node failure ended the job"}
        return {}
    return {
        node: f"{node} left the job's allocation, a node failure (Slurm's NodeList is now {','.join(now.nodes)})"
        for node in parse_nodelist(allocated)
        if node not in now.nodes and node not in known
    }


def decide_together(
    paths: RunPaths,
    env: Any,
    task: Task,
    cfg: Any,
    reason: Reason,
    step: int,
    kill_deadline: float = float("inf"),
    sick: dict[str, str] | None = None,
    memory: Any = None,
) -> None:
    """Rank 0 decides (requeue_or_stop) and tells everyone, so no rank exits with 144 alone; never returns.
    `memory` (Attempt.memory): its copies go on every node unless the training step is started again on this
    allocation (a relaunch, or the local executor's restart in place, which reads them)."""
    import torch
    import torch.distributed as dist

    actions = (Verdict.STOP, Verdict.REQUEUE, Verdict.WAIT, Verdict.RELAUNCH)
    if memory is not None:  # a stop: its disk save is newer than any copy, and the requeue must not wait on one
        memory.abandon()  # the copy in flight writes nothing more (its collectives still end on every rank)
    index = torch.tensor([0])
    if env.rank == 0:
        decided = requeue_or_stop(paths, env, cfg, reason, step, sick, signals=task.pulse.received)
        index[0] = actions.index(Verdict(decided))
    dist.broadcast(index, src=0)
    chosen = actions[int(index)]
    # destroy_process_group would wait on the copy thread's group: that copy first, until 5 s before the kill;
    # still running then, no teardown (verdict.leave's os._exit ends the process either way)
    if memory is not None:  # a stop without a signal's deadline (none is known) waits deadlines.STOP_MEMORY_WAIT_S
        memory.wait(deadlines.stop_memory_wait_s(kill_deadline, time.monotonic(), 5.0))
    if memory is None or memory.idle.is_set():
        dist.destroy_process_group()
    again = chosen == Verdict.RELAUNCH or (chosen == Verdict.REQUEUE and env.executor == "local")
    if memory is not None and not again:
        memory.clean()
    verdict.leave(task, chosen, cfg.cluster.preempt_grace_s, kill_deadline)
