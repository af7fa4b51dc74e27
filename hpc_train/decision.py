"""The requeue decision as data (pure, torch-free): Facts in (what requeue.gather asked Slurm and read in the journal,
once), a Decision out (decide), applied in one place (requeue.apply). The budgets are preempt.decide's, the sick
nodes preempt.exclusion's, a restart inside the allocation preempt.in_job_restart's: this module composes them."""

from __future__ import annotations

import dataclasses
from typing import Any

from hpc_train import journal, preempt
from hpc_train.reasons import Action, Fate, Reason


@dataclasses.dataclass(frozen=True)
class Queue:
    """An elastic run's queue snapshot (slurm.queue_snapshot): node -> sinfo's short state, and the partition's jobs;
    error: why there is none (the size is then unknown: Slurm's range, going on smaller)."""

    states: dict[str, str] = dataclasses.field(default_factory=dict)
    jobs: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    error: str = ""


@dataclasses.dataclass(frozen=True)
class Inside:
    """What a restart inside a hot-spares allocation is judged by, read on the failure path only: the allocation's
    nodes (SLURM_JOB_NODELIST), the seconds to Slurm's EndTime (else the allocation's start + the time limit, taken
    as it was read: the calls after it do not shorten it), how long the batch
    script's relay has been silent (requeue.relay_silent_s: 0.0 alive), whether our batch script started this step
    (HPC_TRAIN_STEP_ARGS: it reads the marker), and whether scontrol exists (without it the lost nodes stay unknown:
    a relaunch goes on without them)."""

    job_nodes: list[str]
    left_s: float
    relay_silent_s: float = 0.0
    our_step: bool = True
    scontrol: bool = True
    relay_file: str = ""  # the relay's beat file, named in the sentence when it is silent


@dataclasses.dataclass(frozen=True)
class Facts:
    """What one decision knows, gathered once (requeue.gather): the run's journal, Slurm's fate of the job (or the
    local event log's), the budgets as `hpc-train resume` raised them, the nodes a hot-spares job holds now, the sick
    nodes ({node: why}: those blamed, and those Slurm took out of the job), the stop signals the deciding rank
    received (the Pulse's live list: requeue.apply reads it again after a refused requeue), the partition's usable
    nodes beyond the run's need (spare; None: unknown or not asked, no node sick), an elastic run's queue snapshot,
    and a hot-spares failure's Inside facts."""

    reason: Reason
    stopping: bool  # after a stop signal: the Slurm calls take the stop path's shorter policies
    events: list[dict[str, Any]]
    fate: Fate
    budgets: Any
    held: Any  # slurm.Allocation | None
    sick: dict[str, str] | None
    signals: list[str]
    executor: str = "slurm"
    job_id: str = ""
    nodes: tuple[str, ...] = ()  # this attempt's nodes (RankEnv.nodes)
    spare: int | None = None
    queue: Queue | None = None
    inside: Inside | None = None
    now: float = 0.0  # time.time() of the gathering


@dataclasses.dataclass(frozen=True)
class Decision:
    """One decision: the action, its sentence (why), the reason the requeue is counted under, the nodes the next
    attempt leaves out (oldest blame first), the records written once the action is taken (before the Slurm calls
    of a stop or a requeue; after the marker of a relaunch), the sentences said first, an elastic requeue's
    NumNodes/NumTasks and its snapshot's fields for the requeue event, a relaunch's srun options, nodes and
    in_job_restart fields, and what is done instead when a relaunch or a rejoin cannot be made (fallback)."""

    action: Action
    why: str = ""
    reason: str = ""
    excluded: tuple[str, ...] = ()
    records: tuple[tuple[str, dict[str, Any]], ...] = ()
    said: tuple[str, ...] = ()
    size: dict[str, str] = dataclasses.field(default_factory=dict)
    snapshot: dict[str, Any] = dataclasses.field(default_factory=dict)
    srun_args: str = ""
    fallback: Decision | None = None


NOT_INSIDE = "not restarting inside the allocation: "


def decide(f: Facts, cfg: Any) -> Decision:
    """The one decision for a stop and a failure alike (pure). preempt.decide's budgets first; a failure's requeue
    of a hot-spares job Slurm still runs becomes a restart inside the allocation where one can be made (inside);
    otherwise the sick nodes are left out of the requeued job within their budgets (outside)."""
    action, why = preempt.decide(f.reason, f.events, f.budgets, f.fate)
    if not (cfg.cluster.spare_nodes and f.executor == "slurm" and action == Action.REQUEUE and not f.stopping):
        return outside(f, cfg, action, why)
    restart, why_not = inside(f, cfg)
    if restart is not None:
        return restart
    fallback = outside(f, cfg, action, why)
    return dataclasses.replace(fallback, said=(*([NOT_INSIDE + why_not] if why_not else []), *fallback.said))


def outside(f: Facts, cfg: Any, action: Action, why: str) -> Decision:
    """The requeue path: the sick nodes left out of the next attempt (preempt.exclusion, within
    requeue.max_excluded_nodes and the partition's spare nodes). One that cannot be left out turns the stop's
    requeue into a failure's (counted in requeue.max_failures, so a crash loop still ends); one whose budget is
    spent stops the run."""
    before = journal.excluded_nodes(f.events)
    excluded, reason, sick = list(before), f.reason, f.sick or {}
    records: list[tuple[str, dict[str, Any]]] = []
    said: list[str] = []
    if action != Action.STOP and sick:
        local = f.executor != "slurm"
        excluded, not_out, stop = preempt.exclusion(f.events, sick, f.budgets.max_excluded_nodes, f.spare, local=local)
        if stop:
            action, why = Action.STOP, stop
        elif not_out:
            records.append((journal.NODE_NOT_EXCLUDED, {"nodes": sorted(set(sick) - set(excluded)), "why": not_out}))
            said.append(not_out)
            reason = Reason.FAILURE
            action, why = preempt.decide(reason, f.events, f.budgets, f.fate)
        else:
            records += [(journal.NODE_EXCLUDED, {"node": n, "why": because}) for n, because in sick.items()]
        order = [*(n for n in before if n not in sick), *sick]  # the sick ones: newest
        excluded = sorted(excluded, key=lambda n: order.index(n) if n in order else len(order))
    if action == Action.STOP:
        return Decision(Action.STOP, why, reason, tuple(excluded), tuple(records), tuple(said))
    size, snapshot = next_size(f, cfg, excluded)
    return Decision(Action(action), why, reason, tuple(excluded), tuple(records), tuple(said), size, snapshot)


def inside(f: Facts, cfg: Any) -> tuple[Decision | None, str]:
    """Hot spares: a relaunch (or, with cluster.in_process_restart, a rejoin) inside the allocation in place of the
    failure's requeue, the sick nodes left out of the allocation (preempt.exclusion counting its nodes: the step
    starts there, whatever the partition holds). (the Decision, "") or (None, why not: "" for a blamed node that
    could not be left out there, which the requeue path then judges against the partition)."""
    if f.fate == Fate.BATCH_HOST_LOST:  # no relay left to relaunch: requeue (and no EndTime call)
        return None, preempt.BATCH_HOST_LOST
    if f.inside is None:  # requeue.gather asks nothing of a restart after a stop signal
        return None, f"a stop signal ({f.reason}, {f.signals}): the stop save and the requeue give the allocation back"
    if f.held is None and f.inside.scontrol:
        return None, "Slurm did not say which nodes the job holds now (scontrol show job); requeueing"
    c, job_nodes, sick = cfg.cluster, f.inside.job_nodes, f.sick or {}
    excluded, not_out, stop = (
        preempt.exclusion(
            f.events,
            sick,
            f.budgets.max_excluded_nodes,
            len(job_nodes) - (c.min_nodes or c.nodes),
            allocation=job_nodes,
        )
        if sick
        else (sorted(journal.excluded_nodes(f.events)), "", "")
    )
    if stop or not_out:  # relaunched, the step could land on a blamed node again
        return None, ""
    left_out = sorted(set(excluded) & set(job_nodes))
    used = journal.in_job_restarts_in_a_row(f.events)
    n, why_not = preempt.in_job_restart(
        preempt.RestartFacts(
            c.spare_nodes,
            Action.REQUEUE,
            f.reason,
            f.fate,
            list(f.signals),
            used,
            f.budgets.max_in_job_restarts,
            job_nodes,
            left_out,
            c.nodes,
            left_s=f.inside.left_s,
            startup_s=journal.startup_s(f.events),
            signal_lead_s=c.signal_lead_s,
            min_nodes=c.min_nodes,
        )
    )
    if why_not:
        return None, why_not
    relaunch, why_not = _relaunch(f, cfg, job_nodes, left_out, used, n)
    if c.in_process_restart:  # the plan may still fail (requeue.apply): the relaunch, or the requeue, then
        requeue = outside(f, cfg, Action.REQUEUE, "")
        fallback = relaunch or dataclasses.replace(requeue, said=(NOT_INSIDE + why_not, *requeue.said))
        return Decision(Action.REJOIN, reason=f.reason, excluded=tuple(left_out), fallback=fallback), ""
    return relaunch, why_not


def _relaunch(
    f: Facts, cfg: Any, job_nodes: list[str], left_out: list[str], used: int, n: int
) -> tuple[Decision | None, str]:
    """The relaunch of n nodes (cluster.nodes, fewer with cluster.min_nodes once no spare is left): the next step's
    srun options for the relay's marker, and its records; (None, why not) where no batch script of ours started
    the step or its relay is silent (nobody would read the marker)."""
    assert f.inside is not None
    if not f.inside.our_step:
        return None, (
            "this step was not started by hpc_train's batch script with hot spares (no HPC_TRAIN_STEP_ARGS, e.g. srun "
            "by hand); requeueing"
        )
    if f.inside.relay_silent_s:
        return None, (
            f"the batch script's relay last wrote {f.inside.relay_file} {f.inside.relay_silent_s:.0f} s ago (its node "
            f"lost?); requeueing"
        )
    c = cfg.cluster
    spares = len(set(job_nodes) - set(left_out)) - n
    step = n + (spares if c.in_process_restart else 0)  # the spares left run the standbys again
    args = f"--nodes={step} --ntasks={step * c.tasks_per_node}" + (
        f" --exclude={','.join(left_out)}" if left_out else ""
    )
    restart = {
        "reason": f.reason,
        "left_out": left_out,
        "nodes_next": n,
        "spares_left": spares,
        "in_job_restarts": used + 1,
        "srun_args": args,
    }
    records = (
        *((journal.NODE_EXCLUDED, {"node": node, "why": because}) for node, because in (f.sick or {}).items()),
        (journal.IN_JOB_RESTART, restart),
    )
    out = f" without {', '.join(left_out)}" if left_out else ""
    smaller = f", going on with {n} of cluster.nodes={c.nodes}" if n < c.nodes else ""
    why = f"restarting inside the allocation{out} ({spares} spare(s) left{smaller}): srun {args}"
    fallback = outside(f, cfg, Action.REQUEUE, "")
    return Decision(Action.RELAUNCH, why, f.reason, tuple(left_out), records, srun_args=args, fallback=fallback), ""


def queue_wait(f: Facts, cfg: Any, excluded: list[str]) -> tuple[float | None, dict[str, Any]]:
    """(seconds until the job's full size could run, None if unknown; the snapshot's facts for the requeue event)
    from the queue snapshot (preempt.full_size_wait_s), not counting the run's excluded nodes among its own. Facts:
    free_nodes (counted free now) and not_free (node -> state of those neither free nor held by a running job: why
    a node was not counted), or queue_error. (None, {}) without a snapshot (a job not elastic)."""
    if f.queue is None:
        return None, {}
    if f.queue.error:  # unknown: keep Slurm's range, go on smaller
        return None, {"queue_error": f.queue.error}
    # The run's own exclusions count wherever Slurm's ExcNodeList does: an update that failed, or a requeue Slurm
    # made, left them out of ExcNodeList, and a left-out idle node counted free pinned NumNodes=4-4 on 3 usable
    # nodes (pending for good on a 4-node partition).
    states, jobs = f.queue.states, f.queue.jobs
    mine = [j for j in jobs if j["id"] == f.job_id] or [
        {"id": f.job_id, "state": "PENDING", "end": None, "nodes": [], "excluded": []}
    ]
    jobs = [j for j in jobs if j["id"] != f.job_id] + [
        {**mine[0], "excluded": sorted({*mine[0]["excluded"], *excluded})}
    ]
    own = [n for n in f.nodes if n not in excluded]
    free = preempt.free_now(own, states, preempt.job_excluded(f.job_id, jobs))
    facts = {"free_nodes": sorted(free), "not_free": preempt.not_free(f.job_id, states, free, jobs)}
    return preempt.full_size_wait_s(cfg.cluster.nodes, f.job_id, own, states, jobs, f.now), facts


def next_size(f: Facts, cfg: Any, excluded: list[str]) -> tuple[dict[str, str], dict[str, Any]]:
    """An elastic job (cluster.min_nodes < cluster.nodes, no hot spares: ClusterConfig.elastic), requeued: wait for
    all its nodes if they are free within requeue.shrink_after_s, else go on with the nodes free now
    (preempt.next_size). Returns (the NumNodes/NumTasks fields for requeue.update_next_attempt, the requeue event's
    fields: nodes_next, full_size_wait_s (None: unknown) and the snapshot's facts); ({}, {}) without a snapshot: a
    hot spares job is requeued as it was queued, nodes + spare_nodes."""
    if f.queue is None or not cfg.cluster.elastic():
        return {}, {}
    c, (wait_s, facts) = cfg.cluster, queue_wait(f, cfg, excluded)
    free = facts.get("free_nodes")
    fields = preempt.next_size(
        c.min_nodes, c.nodes, c.tasks_per_node, wait_s, cfg.requeue.shrink_after_s, None if free is None else len(free)
    )
    return fields, {
        "nodes_next": fields["NumNodes"],
        "full_size_wait_s": None if wait_s is None else round(wait_s, 1),
        **facts,
    }


def after_refusal(reason: Reason, signals: list[str], fate: Fate) -> str:
    """A requeue Slurm refused (no scontrol in the container): "wait" for a preemption, which Slurm requeues itself
    when it kills the job at the end of GraceTime (not one that exited on its own before), a crash inside a
    preemption's grace too; else "stop". Not a job that ended with its batch host: Slurm never requeues that one.
    signals: read after the refusal (a TERM may have come during scontrol's retries)."""
    preempted = (reason == Reason.PREEMPT or "SIGTERM" in signals) and fate != Fate.BATCH_HOST_LOST
    return "wait" if preempted else "stop"
