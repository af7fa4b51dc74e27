"""The one requeue decision and its application: Slurm's facts (the job's fate, the nodes it holds, the queue),
preempt.decide's action, the exclusions and the next attempt's size, the records, the sentence; and the stop's
agreement (rank 0 decides, every rank leaves by the broadcast verdict)."""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
import time
from collections.abc import Callable, Collection
from typing import Any

from hpc_train import deadlines, journal, preempt, relaunch, slurm, verdict
from hpc_train.env import parse_nodelist
from hpc_train.paths import RunPaths
from hpc_train.task import Task
from hpc_train.verdict import Verdict


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


@dataclasses.dataclass(frozen=True)
class Facts:
    """What one decision knows, gathered once (gather): the run's journal, Slurm's fate of the job (or the local
    event log's), the budgets as `hpc-train resume` raised them, the nodes a hot-spares job holds now, and the sick
    nodes ({node: why}: those blamed, and those Slurm took out of the job)."""

    reason: str
    stopping: bool  # after a stop signal: the Slurm calls take the stop path's shorter policies
    events: list[dict[str, Any]]
    fate: str
    budgets: Any
    held: slurm.Allocation | None
    sick: dict[str, str] | None
    signals: list[str]  # the stop signals the deciding rank received, in order


def gather(paths: RunPaths, env: Any, cfg: Any, reason: str, sick: dict[str, str] | None, signals: list[str]) -> Facts:
    stopping = reason in ("time_limit", "preempt")
    events = journal.read(paths.run_dir)
    restarts = int(os.environ.get("SLURM_RESTART_COUNT") or 0)  # Slurm's count for this job, not the run's attempt
    fate = (
        slurm.job_fate(env.job_id, restarts, slurm.STOP_FATE if stopping else slurm.FATE)
        if env.executor == "slurm"
        else journal.local_fate(events)
    )
    budgets = dataclasses.replace(cfg.requeue, **journal.budget_changes(events))  # raised by `hpc-train resume`
    # Hot spares (sbatch --no-kill): the job outlives a lost node, which is blamed here, so that a relaunch and a
    # requeue's ExcNodeList leave it out (a requeued job started on it again while its slurmd still held the old
    # one: "Duplicate jobid", node drained, the job held). A stop asks only when its batch host is gone.
    held: slurm.Allocation | None = None
    if cfg.cluster.spare_nodes and env.executor == "slurm" and (not stopping or fate == "batch_host_lost"):
        held = slurm.allocation(env.job_id, slurm.STOP_FATE if stopping else slurm.FATE)
        # read after the fate: the batch host may have left NodeList since (Slurm ends the job ms later)
        fate = "batch_host_lost" if held and slurm.batch_host_lost(held) else fate
        allocated, known = os.environ.get("SLURM_JOB_NODELIST", ""), journal.excluded_nodes(events)
        sick = {**lost_nodes(allocated, held, known, fate == "batch_host_lost"), **(sick or {})} or None
    # the Pulse's own list, not a copy: a preemption's TERM during the Slurm calls that follow (scontrol requeue
    # retries for up to 33 s) makes a refused requeue a wait for Slurm's, not a stop
    return Facts(reason, stopping, events, fate, budgets, held, sick, signals)


def requeue_or_stop(
    paths: RunPaths,
    env: Any,
    cfg: Any,
    reason: str,
    step: int,
    sick: dict[str, str] | None = None,
    hang: bool = False,
    *,
    signals: list[str],
) -> str:
    """Ask Slurm (or the local event log) what it is doing with the job (gather), take the one decision
    (preempt.decide; preempt.exclusion for `sick` nodes, {node: why}), act on it and record it. Returns
    "requeue" (the job comes back, without the run's excluded nodes), "relaunch" (hot spares: the batch
    script starts the training step again inside the allocation, without them; relaunch.relaunch), "rejoin"
    (cluster.in_process_restart), "wait" (only Slurm can bring it back: stay alive until it ends the job) or
    "stop". After a stop signal ("time_limit", "preempt") the Slurm calls take the stop path's shorter policies,
    whose worst case deadlines.REQUEUE_RESERVE_S reserves. hang: the watchdog fired (an in-job restart
    relaunches, never rejoins: rejoin.plan_rejoin). signals: the stop signals this rank received (Task.pulse)."""
    facts = gather(paths, env, cfg, reason, sick, signals)
    record = lambda name, **f: journal.log(paths.run_dir, name, step, env.job_id, env.restart_count, **f)  # noqa: E731
    action, why = preempt.decide(reason, facts.events, facts.budgets, facts.fate)
    if how := _inside_the_allocation(paths, env, cfg, facts, action, record, hang):
        return how
    action, why, reason, excluded = _exclusions(env, cfg, facts, action, why, record)
    if action == "stop":
        record(journal.STOPPED, reason=why)
        print(f"[hpc_train] not requeueing: {why}", file=sys.stderr, flush=True)
        return "stop"
    if action == "slurm":
        size, snapshot = next_attempt_size(env, cfg, queue_wait_s(env, cfg, excluded, facts.stopping))
        err = update_next_attempt(env, cfg.cluster, excluded, size, record)
        error = {"nodes_update_error": err} if err and size else {}
        record(journal.REQUEUE, reason=reason, by="slurm", note=why, **snapshot, **error)
        return "requeue"
    return _requeue(env, cfg, facts, reason, excluded, record)


def _inside_the_allocation(
    paths: RunPaths, env: Any, cfg: Any, facts: Facts, action: str, record: Callable[..., None], hang: bool
) -> str:
    """Hot spares replace a failure's requeue only (the stop path's reserve has no room for the EndTime call the
    time check makes): "relaunch" or "rejoin" once relaunch.in_job_restart did it, else "" (said why)."""
    if not (cfg.cluster.spare_nodes and env.executor == "slurm" and action == "requeue" and not facts.stopping):
        return ""
    if facts.fate == "batch_host_lost":  # no relay left to relaunch: requeue (and no EndTime call)
        print(f"[hpc_train] not restarting inside the allocation: {preempt.BATCH_HOST_LOST}", file=sys.stderr)
        return ""
    # No scontrol at all (a container): the lost nodes stay unknown, as before they were asked; one that does not
    # answer may be too busy to have noticed a lost node yet: a relaunch could count it
    if facts.held is None and shutil.which("scontrol"):
        print(
            "[hpc_train] not restarting inside the allocation: Slurm did not say which nodes the job holds now "
            "(scontrol show job); requeueing",
            file=sys.stderr,
            flush=True,
        )
        return ""
    f, sick = facts, facts.sick or {}
    return relaunch.in_job_restart(
        paths, env, cfg, f.reason, f.fate, f.events, f.budgets, sick, f.signals, record, hang
    )


def _exclusions(
    env: Any, cfg: Any, facts: Facts, action: str, why: str, record: Callable[..., None]
) -> tuple[str, str, str, list[str]]:
    """The sick nodes left out of the next attempt (preempt.exclusion, within requeue.max_excluded_nodes and the
    partition's spare nodes) and recorded: (action, why, reason, the run's excluded nodes, oldest blame first).
    One that cannot be left out turns the stop's requeue into a failure's (counted in requeue.max_failures, so a
    crash loop still ends); one whose budget is spent stops the run."""
    excluded = list(journal.excluded_nodes(facts.events))  # oldest blame first: update_next_attempt lets those in
    sick, reason = facts.sick, facts.reason
    if action == "stop" or not sick:
        return action, why, reason, excluded
    local = env.executor != "slurm"
    max_out = facts.budgets.max_excluded_nodes
    excluded, not_out, stop = preempt.exclusion(facts.events, sick, max_out, spare_nodes(env, cfg.cluster), local=local)
    if stop:
        action, why = "stop", stop
    elif not_out:
        record(journal.NODE_NOT_EXCLUDED, nodes=sorted(set(sick) - set(excluded)), why=not_out)
        print(f"[hpc_train] {not_out}", file=sys.stderr, flush=True)
        reason = "failure"
        action, why = preempt.decide(reason, facts.events, facts.budgets, facts.fate)
    for node, because in sick.items() if not (stop or not_out) else ():
        record(journal.NODE_EXCLUDED, node=node, why=because)
    order = [*(n for n in journal.excluded_nodes(facts.events) if n not in sick), *sick]  # the sick ones: newest
    excluded = sorted(excluded, key=lambda n: order.index(n) if n in order else len(order))
    return action, why, reason, excluded


def _requeue(env: Any, cfg: Any, facts: Facts, reason: str, excluded: list[str], record: Callable[..., None]) -> str:
    """hpc_train's own `scontrol requeue`, then the next attempt's ExcNodeList and size: "requeue"; refused (no
    scontrol in a container), "wait" for a preemption (Slurm requeues it when it kills it) or "stop"."""
    wait = queue_wait_s(env, cfg, excluded, facts.stopping)  # before the requeue, as the reserve counts it
    policy = slurm.STOP_REQUEUE if facts.stopping else slurm.REQUEUE
    err = slurm.requeue(env.job_id, policy) if env.executor == "slurm" else ""
    if not err:
        size, snapshot = next_attempt_size(env, cfg, wait)
        err = update_next_attempt(env, cfg.cluster, excluded, size, record)  # first: KillWait may end this process
        error = {"nodes_update_error": err} if err and size else {}
        record(journal.REQUEUE, reason=reason, by="hpc_train", fate=facts.fate, **snapshot, **error)
        return "requeue"
    # e.g. no scontrol in the container. Slurm requeues a preempted job itself when it kills it at the end
    # of GraceTime, but not one that exited on its own before: so a preemption waits to be killed.
    # No requeue, so no pending job to set ExcNodeList on: the node's next preflight finds it and sets it then.
    unset = {"exclude_nodes": f"not set ({','.join(sorted(excluded))}): the job was not requeued"} if excluded else {}
    record(journal.REQUEUE_FAILED, reason=reason, fate=facts.fate, error=err, **unset)
    # a crash inside a preemption's grace too; not a job that ended with its batch host, which Slurm never requeues
    preempted = (reason == "preempt" or "SIGTERM" in facts.signals) and facts.fate != "batch_host_lost"
    then = (
        "waiting for Slurm to end and requeue the preempted job"
        if preempted
        else "the last committed checkpoint stays; resubmit to go on"
    )
    print(f"[hpc_train] requeue failed: {err}; {then}", file=sys.stderr, flush=True)
    return "wait" if preempted else "stop"


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
            print(f"[hpc_train] {why}", file=sys.stderr, flush=True)
        if err:
            print(f"[hpc_train] could not leave out {value}: {err}", file=sys.stderr, flush=True)
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


def queue_wait_s(
    env: Any, cfg: Any, excluded: list[str], stopping: bool = False
) -> tuple[float | None, dict[str, Any]]:
    """(seconds until the job's full size could run, None if unknown; the snapshot's facts for the requeue
    event) from one queue snapshot (preempt.full_size_wait_s), not counting the run's excluded nodes among
    its own. Facts: free_nodes (counted free now) and not_free (node -> state of those neither free nor held
    by a running job: why a node was not counted), or queue_error. (None, {}) for a job not elastic.
    stopping: the stop path's shorter policy (slurm.STOP_SNAPSHOT)."""
    if not elastic(env, cfg):
        return None, {}
    partition = cfg.cluster.partition or os.environ.get("SLURM_JOB_PARTITION", "")
    try:
        states, jobs = slurm.queue_snapshot(partition, env.job_id, slurm.STOP_SNAPSHOT if stopping else (10.0, 1))
    except slurm.SlurmError as e:  # unknown: keep Slurm's range, go on smaller
        return None, {"queue_error": str(e)}
    # The run's own exclusions count wherever Slurm's ExcNodeList does: an update that failed, or a requeue
    # Slurm made, left them out of ExcNodeList, and a left-out idle node counted free pinned NumNodes=4-4
    # on 3 usable nodes (pending for good on a 4-node partition).
    mine = [j for j in jobs if j["id"] == env.job_id] or [
        {"id": env.job_id, "state": "PENDING", "end": None, "nodes": [], "excluded": []}
    ]
    jobs = [j for j in jobs if j["id"] != env.job_id] + [
        {**mine[0], "excluded": sorted({*mine[0]["excluded"], *excluded})}
    ]
    own = [n for n in env.nodes if n not in excluded]
    free = preempt.free_now(own, states, preempt.job_excluded(env.job_id, jobs))
    facts = {"free_nodes": sorted(free), "not_free": preempt.not_free(env.job_id, states, free, jobs)}
    return preempt.full_size_wait_s(cfg.cluster.nodes, env.job_id, own, states, jobs, time.time()), facts


def next_attempt_size(
    env: Any, cfg: Any, wait: tuple[float | None, dict[str, Any]]
) -> tuple[dict[str, str], dict[str, Any]]:
    """An elastic job (cluster.min_nodes < cluster.nodes, no hot spares: ClusterConfig.elastic), just requeued:
    wait for all its nodes if they are free within requeue.shrink_after_s, else go on with the nodes free now
    (preempt.next_size). Returns (the NumNodes/NumTasks fields for update_next_attempt, the requeue event's
    fields: nodes_next, full_size_wait_s (None: unknown) and the snapshot's facts); ({}, {}) for a job that is
    not elastic: a hot spares job is requeued as it was queued, nodes + spare_nodes."""
    if not elastic(env, cfg):
        return {}, {}
    c, (wait_s, facts) = cfg.cluster, wait
    free = facts.get("free_nodes")
    fields = preempt.next_size(
        c.min_nodes, c.nodes, c.tasks_per_node, wait_s, cfg.requeue.shrink_after_s, None if free is None else len(free)
    )
    return fields, {
        "nodes_next": fields["NumNodes"],
        "full_size_wait_s": None if wait_s is None else round(wait_s, 1),
        **facts,
    }


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
    reason: str,
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
        memory.wait(max(0.0, min(kill_deadline - time.monotonic() - 5, deadlines.STOP_MEMORY_WAIT_S)))
    if memory is None or memory.idle.is_set():
        dist.destroy_process_group()
    again = chosen == Verdict.RELAUNCH or (chosen == Verdict.REQUEUE and env.executor == "local")
    if memory is not None and not again:
        memory.clean()
    verdict.leave(task, chosen, cfg.cluster.preempt_grace_s, kill_deadline)
