"""What every task of a job runs (start.py calls run_job): rank env, placed rendezvous, the hang
watchdog, then the training function with its Attempt, then the one requeue decision.

Importing this module is cheap and torch-free (the login node pickles `run_job` by reference); torch
is imported when the job runs. Exit codes: 0 finished, 144 saved-and-requeued, 145 relaunched inside the
allocation (an in-job restart, cluster.spare_nodes), 1 stopped or failed.

An attempt, from process start to exit (docs/lifecycle.md draws it):
    start.py installs the record-only USR2/TERM handlers   -> phase "python"
    imports, frozen config.yaml                            -> phase "imports"
    placed rendezvous (TCPStore + topology plan)           -> phase "rendezvous"
    preflight on every node (preflight.py)                 -> phase "preflight"; `preflight`; a sick node:
                                                              `node_excluded`, requeue, ExcNodeList
    Attempt.build, the function builds its model           -> phase "setup"
    at.resume(state): verify (every rank a share), load    -> phases "verify", "load"; the `start` event
    the loop: at.step_end() each step                      -> `first_step`, saves, a `signal`
    stopped: rank 0 decides (preempt.decide) and requeues  -> `requeue` | `requeue_failed` | `stopped`
    failed, with hot spares: relaunched in the allocation  -> `in_job_restart` (preempt.in_job_restart)
    ... cluster.in_process_restart: survivors and a standby -> `in_job_restart` (in_process); a new attempt in
        rejoin in their processes (_plan_rejoin, _rejoin)     the same processes: Attempt.build, fn again
    finished: at.finish(): final save, summary.json        -> `finish`
    raised or hung: the first rank to fail decides alike   -> `fail`, then as stopped
"""

from __future__ import annotations

import dataclasses
import gc
import importlib
import json
import os
import shutil
import sys
import time
import traceback
from collections.abc import Callable, Collection
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

from hpc_train import journal, leave, preempt, script, slurm
from hpc_train.paths import (
    RunPaths,
    finished_marker,
    hold_for_life,
    holder_gone,
    locked,
    make_dir,
    relaunch_marker,
    relay_beat,
    untrusted,
    write_atomic,
)


def process_start_time() -> float:
    """When this process started, as Unix time: /proc/self/stat's starttime (clock ticks since boot)
    against /proc/uptime, good to ~10 ms (btime alone is whole seconds)."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.time()


def resolve(target: str) -> Callable[..., Any]:
    """fn._target_ ("pkg.mod.function") -> the function; empty: the built-in trainer."""
    module, name = (target or "hpc_train.train.main").rsplit(".", 1)
    fn = getattr(importlib.import_module(module), name, None)
    if not callable(fn):
        raise ValueError(f"fn._target_={target!r}: {module} has no function {name!r}")
    return fn


# How long a starting job waits for the run's lock (paths.locked) before it reads the journal without it.
RUN_LOCK_WAIT_S = 60.0


def run_job(run_dir_str: str) -> dict[str, Any] | None:
    from hpc_train import env as rank_env

    preempt.install_handlers()  # start.py did, first thing; this covers a caller that did not
    process_start = process_start_time()
    phases_s = {"python": max(0.0, preempt.installed_at[0] - process_start)}
    paths = RunPaths(Path(run_dir_str))
    # An `hpc-train resume` still recording its event holds the lock for a second or so: wait, but not for
    # a holder that died on NFSv3 (its lock stays until its node reboots; the watchdog is not running yet).
    with locked(paths.lock, shared=True, wait_s=RUN_LOCK_WAIT_S) as ok:
        events = journal.read(paths.run_dir)
    if not ok:
        print(
            f"[hpc_train] warning: {paths.lock} still locked after {RUN_LOCK_WAIT_S:.0f} s (a crashed "
            f"`hpc-train resume`?): read the attempt number without it",
            file=sys.stderr,
            flush=True,
        )
    if "SLURM_PROCID" not in os.environ:  # the local controller restarts in place: attempts counted on disk
        os.environ["HPC_TRAIN_ATTEMPT"] = str(journal.new_job_attempt(events, None))
    env = rank_env.from_env(os.environ)
    if env.executor == "slurm":  # a resumed Slurm job counts SLURM_RESTART_COUNT from 0 again
        attempt = journal.new_job_attempt(events, env.restart_count, env.job_id)
        # A port of its own per attempt: an in-job restart's store may start on the last step's first node
        # while that step's port is in TIME_WAIT (rendezvous_port, as across requeues).
        port = (
            env.master_port
            if os.environ.get("HPC_TRAIN_MASTER_PORT")
            else rank_env.rendezvous_port(env.job_id, attempt)
        )
        env = dataclasses.replace(env, restart_count=attempt, master_port=port)
    os.environ["HPC_TRAIN_ATTEMPT"] = str(env.restart_count)  # the run's attempt: drills fire in attempt 0 only
    os.environ.update(rank_env.torchrun_vars(env))
    for stream in (sys.stdout, sys.stderr):  # `hpc-train logs --attempt` cuts both files at these lines
        print(f"==== hpc_train attempt {env.restart_count} rank {env.rank} ====", file=stream, flush=True)
    _placed[0] = None
    try:
        return _run(paths, env, process_start, phases_s)
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as e:  # DCP's CheckpointException is a BaseException, not an Exception
        verdict, grace_s = _failed(paths, env, e)
        _leave_after_failure(verdict, grace_s, env)


def _failed(paths: RunPaths, env: Any, e: BaseException) -> tuple[str, float]:
    """This rank's `fail` event, then the one decision (_after_failure): (verdict, grace_s)."""
    # Past the rendezvous, the placed rank: the watchdog writes its heartbeat count under it, and the
    # deciding rank maps counts to nodes in placement order (Slurm's task id collided with another rank's).
    env = _placed[0] or env
    _log_fail(paths, env, f"{type(e).__name__}: {e}", traceback=traceback.format_exc(limit=5))
    return _after_failure(paths, env, e)


def _log_fail(paths: RunPaths, env: Any, error: str, **extra: Any) -> None:
    """This rank's `fail` event at the step it reached (a crash, or the watchdog's hang)."""
    journal.log(
        paths.run_dir,
        journal.FAIL,
        preempt.step_reached[0],
        env.job_id,
        env.restart_count,
        rank=env.rank,
        error=error,
        **extra,
    )


def _leave_after_failure(verdict: str, grace_s: float, env: Any) -> None:
    traceback.print_exc()  # this rank's log keeps the whole story
    if verdict in ("wait", "relaunch") or (verdict == "requeue" and env.executor == "local"):
        _leave(verdict, grace_s)  # 144: the local controller restarts every task on this code
    _leave("stop", 0.0)


def spare_nodes(env: Any, cluster: Any) -> int | None:
    """Nodes of the job's partition in a usable state beyond those the run needs and cluster.exclude
    (preempt.spare_nodes); None when Slurm does not say. The local executor has one machine: none spare."""
    from hpc_train.env import parse_nodelist

    if env.executor != "slurm":
        return 0
    try:
        states = slurm.node_states(cluster.partition or os.environ.get("SLURM_JOB_PARTITION", ""))
    except slurm.SlurmError:
        return None
    # What the requeued job asks for: nodes + spare_nodes with hot spares (a fixed allocation), else min_nodes
    need = cluster.nodes + cluster.spare_nodes if cluster.spare_nodes else cluster.min_nodes or cluster.nodes
    return preempt.spare_nodes(states, need, parse_nodelist(cluster.exclude or "")) if states else None


# What rank 0 runs between a stop save and the answer of `scontrol requeue`, at its worst: the job's fate
# (slurm.STOP_FATE, 10 s), the requeue (slurm.STOP_REQUEUE, 21 s) and 4 s for reading and appending
# events.jsonl and broadcasting the verdict: 35 s, kept out of a time-limit stop save's budget
# (Attempt.step_end). With the failure path's policies (33 s + 33 s) it was 70 s of the default
# signal_lead_s=120. Retention deletes nothing on the stop path (the next resume does), and `scontrol
# update` comes after the requeue, under KillWait, either way.
REQUEUE_RESERVE_S = slurm.worst_s(*slurm.STOP_FATE) + slurm.worst_s(*slurm.STOP_REQUEUE) + 4.0
# An elastic run's queue snapshot before the requeue: 3 calls under slurm.STOP_SNAPSHOT, 15 s more.
ELASTIC_RESERVE_S = 3 * slurm.worst_s(*slurm.STOP_SNAPSHOT)


def decision_reserve_s(env: Any, cfg: Any) -> float:
    """Seconds a time-limit stop keeps after its save for the requeue (REQUEUE_RESERVE_S, + ELASTIC_RESERVE_S
    for an elastic run); the local executor's decision calls no Slurm client: only its 4 s of records."""
    return reserve_s(env.executor, elastic(env, cfg))


def reserve_s(executor: str, is_elastic: bool) -> float:
    if executor != "slurm":
        return 4.0
    return REQUEUE_RESERVE_S + (ELASTIC_RESERVE_S if is_elastic else 0.0)


# The least a time-limit stop should leave for the save itself (the trainer's, or a script's save and exit)
# after the reserve: below it the trainer skips every stop save of any real model and a script is killed
# almost at once. Not a measurement: metrics.lead_warning judges the lead by the saves a run measured.
MIN_STOP_GRACE_S = 10.0


def reserve_warning(cluster: Any) -> str:
    """ "" when cluster.signal_lead_s leaves MIN_STOP_GRACE_S for a time-limit stop's save after the requeue
    decision's reserve (decision_reserve_s), else the warning submit prints (pure)."""
    is_elastic = cluster.executor == "slurm" and cluster.elastic()
    keep, lead = reserve_s(cluster.executor, is_elastic), cluster.signal_lead_s
    if lead >= keep + MIN_STOP_GRACE_S:
        return ""
    return (
        f"cluster.signal_lead_s={lead} leaves {max(0.0, lead - keep):.0f} s for a time-limit stop's save: "
        f"the requeue decision keeps {keep:.0f} s of it (job.decision_reserve_s: scontrol's worst case"
        f"{', and an elastic run queue snapshot' if is_elastic else ''}), so the trainer would skip its stop save "
        f"and a script would get SIGKILL {max(0.0, lead - keep):.0f} s after its stop signal; use "
        f"cluster.signal_lead_s>={keep + MIN_STOP_GRACE_S:.0f}, or more: the slowest save and step, plus 60 s"
    )


def requeue_or_stop(
    paths: RunPaths,
    env: Any,
    cfg: Any,
    reason: str,
    step: int,
    sick: dict[str, str] | None = None,
    hang: bool = False,
) -> str:
    """Ask Slurm (or the local event log) what it is doing with the job, take the one decision
    (preempt.decide; preempt.exclusion for `sick` nodes, {node: why}), act on it and record it. Returns
    "requeue" (the job comes back, without the run's excluded nodes), "relaunch" (hot spares: the batch
    script starts the training step again inside the allocation, without them; _relaunch), "wait" (only
    Slurm can bring it back: stay alive until it ends the job) or "stop". After a stop signal ("time_limit",
    "preempt") the Slurm calls take the stop path's shorter policies, whose worst case REQUEUE_RESERVE_S
    reserves. hang: the watchdog fired (an in-job restart relaunches, never rejoins: _plan_rejoin)."""
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
    action, why = preempt.decide(reason, events, budgets, fate)
    record = lambda name, **f: journal.log(paths.run_dir, name, step, env.job_id, env.restart_count, **f)  # noqa: E731
    # Hot spares replace a failure's requeue only; the stop path's reserve (REQUEUE_RESERVE_S) has no room for
    # the EndTime call the time check makes.
    in_job = cfg.cluster.spare_nodes and env.executor == "slurm" and action == "requeue" and not stopping
    if in_job and fate == "batch_host_lost":  # no relay left to relaunch: requeue (and no EndTime call)
        in_job = False
        print(f"[hpc_train] not restarting inside the allocation: {preempt.BATCH_HOST_LOST}", file=sys.stderr)
    # No scontrol at all (a container): the lost nodes stay unknown, as before they were asked; one that does not
    # answer may be too busy to have noticed a lost node yet: a relaunch could count it
    if in_job and held is None and shutil.which("scontrol"):
        print(
            "[hpc_train] not restarting inside the allocation: Slurm did not say which nodes the job holds now "
            "(scontrol show job); requeueing",
            file=sys.stderr,
            flush=True,
        )
    elif in_job and (how := _in_job_restart(paths, env, cfg, reason, fate, events, budgets, sick or {}, record, hang)):
        return how
    excluded = list(journal.excluded_nodes(events))  # oldest blame first: _update_next_attempt lets those in first
    if action != "stop" and sick:
        excluded, not_out, stop = preempt.exclusion(
            events, sick, budgets.max_excluded_nodes, spare_nodes(env, cfg.cluster), local=env.executor != "slurm"
        )
        if stop:
            action, why = "stop", stop
        elif not_out:  # requeued as a failure: counted in requeue.max_failures, a crash loop still ends
            record(journal.NODE_NOT_EXCLUDED, nodes=sorted(set(sick) - set(excluded)), why=not_out)
            print(f"[hpc_train] {not_out}", file=sys.stderr, flush=True)
            reason = "failure"
            action, why = preempt.decide(reason, events, budgets, fate)
        for node, because in sick.items() if not (stop or not_out) else ():
            record(journal.NODE_EXCLUDED, node=node, why=because)
        order = [*(n for n in journal.excluded_nodes(events) if n not in sick), *sick]  # the sick ones: newest
        excluded = sorted(excluded, key=lambda n: order.index(n) if n in order else len(order))
    if action == "stop":
        record(journal.STOPPED, reason=why)
        print(f"[hpc_train] not requeueing: {why}", file=sys.stderr, flush=True)
        return "stop"
    if action == "slurm":
        size, facts = next_attempt_size(env, cfg, queue_wait_s(env, cfg, excluded, stopping))
        err = _update_next_attempt(env, cfg.cluster, excluded, size, record)
        record(
            journal.REQUEUE,
            reason=reason,
            by="slurm",
            note=why,
            **facts,
            **({"nodes_update_error": err} if err and size else {}),
        )
        return "requeue"
    wait = queue_wait_s(env, cfg, excluded, stopping)  # before the requeue, as the reserve counts it
    policy = slurm.STOP_REQUEUE if stopping else slurm.REQUEUE
    err = slurm.requeue(env.job_id, policy) if env.executor == "slurm" else ""
    if not err:
        size, facts = next_attempt_size(env, cfg, wait)
        err = _update_next_attempt(
            env, cfg.cluster, excluded, size, record
        )  # first: KillWait may end this process soon
        record(
            journal.REQUEUE,
            reason=reason,
            by="hpc_train",
            fate=fate,
            **facts,
            **({"nodes_update_error": err} if err and size else {}),
        )
        return "requeue"
    # e.g. no scontrol in the container. Slurm requeues a preempted job itself when it kills it at the end
    # of GraceTime, but not one that exited on its own before: so a preemption waits to be killed.
    # No requeue, so no pending job to set ExcNodeList on: the node's next preflight finds it and sets it then.
    unset = {"exclude_nodes": f"not set ({','.join(sorted(excluded))}): the job was not requeued"} if excluded else {}
    record(journal.REQUEUE_FAILED, reason=reason, fate=fate, error=err, **unset)
    # a crash inside a preemption's grace too; not a job that ended with its batch host, which Slurm never requeues
    preempted = (reason == "preempt" or "SIGTERM" in preempt.received) and fate != "batch_host_lost"
    then = (
        "waiting for Slurm to end and requeue the preempted job"
        if preempted
        else "the last committed checkpoint stays; resubmit to go on"
    )
    print(f"[hpc_train] requeue failed: {err}; {then}", file=sys.stderr, flush=True)
    return "wait" if preempted else "stop"


def _in_job_restart(
    paths: RunPaths,
    env: Any,
    cfg: Any,
    reason: str,
    fate: str,
    events: list[dict[str, Any]],
    budgets: Any,
    sick: dict[str, str],
    record: Callable[..., None],
    hang: bool = False,
) -> str:
    """Hot spares: relaunch the training step inside the allocation in place of the failure's requeue `decide`
    chose (preempt.in_job_restart), leaving the sick nodes out of the allocation (preempt.exclusion counting the
    allocation's nodes: the step starts there, whatever the partition holds)? "relaunch" once the marker is
    written and recorded, "rejoin" once an in-process restart is (cluster.in_process_restart, _plan_rejoin);
    "": the requeue path decides as without spares, counting the partition."""
    from hpc_train.env import parse_nodelist

    job_nodes = parse_nodelist(os.environ.get("SLURM_JOB_NODELIST", ""))
    excluded, not_out, stop = (
        preempt.exclusion(
            events,
            sick,
            budgets.max_excluded_nodes,
            len(job_nodes) - (cfg.cluster.min_nodes or cfg.cluster.nodes),
            allocation=job_nodes,
        )
        if sick
        else (sorted(journal.excluded_nodes(events)), "", "")
    )
    # A blamed node that could not be left out (its budget spent): relaunched, the step could land on it again.
    if stop or not_out:
        return ""
    # Time left: Slurm's EndTime (one scontrol call, 3 s at most), else the frozen time limit from the start
    # of the allocation the batch script noted.
    end = (
        slurm.end_time(env.job_id)[0]
        or float(os.environ.get("HPC_TRAIN_ALLOCATED_AT") or "inf") + cfg.cluster.timeout_min * 60
    )
    left_out = sorted(set(excluded) & set(job_nodes))
    used = journal.in_job_restarts_in_a_row(events)
    n, why_not = preempt.in_job_restart(
        cfg.cluster.spare_nodes,
        "requeue",
        reason,
        fate,
        list(preempt.received),
        used,
        budgets.max_in_job_restarts,
        job_nodes,
        left_out,
        cfg.cluster.nodes,
        left_s=end - time.time(),
        startup_s=journal.startup_s(events),
        signal_lead_s=cfg.cluster.signal_lead_s,
        min_nodes=cfg.cluster.min_nodes,
    )
    if why_not:
        print(f"[hpc_train] not restarting inside the allocation: {why_not}", file=sys.stderr, flush=True)
        return ""
    if cfg.cluster.in_process_restart and _plan_rejoin(paths, env, events, sick, used, reason, record, hang):
        return "rejoin"
    return "relaunch" if _relaunch(env, cfg.cluster, reason, job_nodes, left_out, used, record, n, sick) else ""


# The relay writes its beat every 5 s while the step runs: 30 s is six missed beats (a loaded batch host, a slow
# shared file system), far under the SlurmdTimeout (300 s by default) after which Slurm itself takes a silent
# node out of the job.
RELAY_SILENT_S = 30.0
RELAY_RECHECK_S = 6.0  # a beat that looks old is read again this much later: unchanged, the relay is gone


def _relay_silent_s(folder: Path, slurm_job: str) -> float:
    """How long the batch script's relay has been silent (its node lost), or 0.0 when it lives or nobody knows
    (paths.relay_beat). Older than RELAY_SILENT_S by this node's clock, the beat is read once more
    RELAY_RECHECK_S later: a changed one is a live relay on a node whose clock is behind, not a lost one."""
    beat = relay_beat(folder, slurm_job)
    if beat is None or time.time() - beat <= RELAY_SILENT_S:
        return 0.0
    time.sleep(RELAY_RECHECK_S)
    return time.time() - beat if relay_beat(folder, slurm_job) == beat else 0.0


def _relaunch(
    env: Any,
    cluster: Any,
    reason: str,
    job_nodes: list[str],
    left_out: list[str],
    used: int,
    record: Callable[..., None],
    n: int,
    sick: dict[str, str] | None = None,
) -> bool:
    """Write the next training step's srun options (n nodes: cluster.nodes, fewer with cluster.min_nodes once
    no spare is left; preempt.in_job_restart) where the batch script's srun() looks (paths.relaunch_marker)
    and record the sick nodes left out and the in-job restart; False (requeue instead, nothing recorded) where
    no batch script of ours started the step or the marker could not be written."""
    folder, slurm_job = os.environ.get("SUBMITIT_FOLDER"), os.environ.get("SLURM_JOB_ID")
    if not (folder and slurm_job and os.environ.get("HPC_TRAIN_STEP_ARGS")):  # exported by our spares' batch script
        print(
            "[hpc_train] not restarting inside the allocation: this step was not started by hpc_train's batch script "
            "with hot spares (no HPC_TRAIN_STEP_ARGS, e.g. srun by hand); requeueing",
            file=sys.stderr,
            flush=True,
        )
        return False
    if silent := _relay_silent_s(Path(folder), slurm_job):  # the relay's node is lost: nobody would read a marker
        print(
            f"[hpc_train] not restarting inside the allocation: the batch script's relay last wrote "
            f"{Path(folder) / ('.relay-' + slurm_job)} {silent:.0f} s ago (its node lost?); requeueing",
            file=sys.stderr,
            flush=True,
        )
        return False
    spares = len(set(job_nodes) - set(left_out)) - n
    step = n + (spares if cluster.in_process_restart else 0)  # the spares left run the standbys again
    args = f"--nodes={step} --ntasks={step * cluster.tasks_per_node}" + (
        f" --exclude={','.join(left_out)}" if left_out else ""
    )
    try:
        write_atomic(relaunch_marker(Path(folder), slurm_job), args + "\n")
    except OSError as e:  # a full disk: the requeue still brings the run back
        print(f"[hpc_train] could not write the relaunch marker ({e}): requeueing", file=sys.stderr, flush=True)
        return False  # said here: the caller's sentence would have no reason to give
    for node, because in (sick or {}).items():
        record(journal.NODE_EXCLUDED, node=node, why=because)
    record(
        journal.IN_JOB_RESTART,
        reason=reason,
        left_out=left_out,
        nodes_next=n,
        spares_left=spares,
        in_job_restarts=used + 1,
        srun_args=args,
    )
    out = f" without {', '.join(left_out)}" if left_out else ""
    smaller = f", going on with {n} of cluster.nodes={cluster.nodes}" if n < cluster.nodes else ""
    print(
        f"[hpc_train] restarting inside the allocation{out} ({spares} spare(s) left{smaller}): srun {args}",
        file=sys.stderr,
        flush=True,
    )
    return True


def _update_next_attempt(
    env: Any, cluster: Any, nodes: list[str], size: dict[str, str], record: Callable[..., None]
) -> str:
    """One `scontrol update` of the requeued job: ExcNodeList (the run's excluded nodes and cluster.exclude)
    and an elastic run's NumNodes/NumTasks together, so either both land or neither (ExcNodeList alone
    with a failed NumNodes could leave NumTasks=8 on too few usable nodes: pending for good). Only now:
    Slurm 22.05 refuses both on a running job ("Job is no longer pending execution"); the requeued job is
    PENDING and cannot start before cred_expire (10 s on the dev cluster, 120 s by default). Set at every
    requeue while the run has excluded nodes: it also survives a lost first try. `nodes`: oldest blame
    first; the oldest are let back in where the partition would keep too few for the job (_fit_exclusions).
    Returns "" or the error."""
    if env.executor != "slurm" or not (nodes or size):
        return ""
    kept, let_in, why = _fit_exclusions(cluster, nodes)
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


def _fit_exclusions(cluster: Any, nodes: list[str]) -> tuple[list[str], list[str], str]:
    """(the nodes the requeued job still leaves out, sorted; those let back in; the sentence that says so):
    the partition must keep the job's nodes (nodes + spare_nodes, else min_nodes or nodes) usable beyond them
    (preempt.fit_exclusions). One sinfo try of 5 s (slurm.STOP_SNAPSHOT: this runs after a stop's requeue
    too, inside KillWait); no answer: all stay out, as before."""
    from hpc_train.env import parse_nodelist

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
    (preempt.next_size). Returns (the NumNodes/NumTasks fields for _update_next_attempt, the requeue event's
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


def _leave(verdict: str, grace_s: float, kill_deadline: float = float("inf")) -> NoReturn:
    """Exit with the verdict's code, without joining a background checkpoint write that was given up on
    (it could hold the process for as long as the slow storage takes). "wait": stay alive until Slurm
    kills the job at GraceTime's end (+ 60 s; KillWait defaults to 30 s), which requeues a preempted job;
    one that exits inside its grace time is not requeued."""
    preempt.last_beat[0] = float("inf")  # the hang watchdog has nothing left to watch
    script.end_children()  # a script's process never outlives the rank that started it
    if verdict == "wait":
        start = preempt.received_at[0] if preempt.received_at else time.monotonic()
        until = min(kill_deadline, start + grace_s) + 60
        while time.monotonic() < until:
            time.sleep(1)
    leave.process({"stop": 1, "relaunch": preempt.IN_JOB_RESTART_EXIT_CODE}.get(verdict, preempt.REQUEUE_EXIT_CODE))


def _hung_nodes(hangs: Path, env: Any, wait_s: float) -> dict[str, str]:
    """At a hang, the nodes of the ranks that stopped (preempt.hung_ranks), from the heartbeat counts every
    failing rank writes into `hangs`; waits up to wait_s for them all (the blocked ranks' watchdogs fire
    a forward pass later than the stopped rank's and poll every <= 5 s; others fail as peers exit)."""
    until = time.monotonic() + wait_s
    while len([p for p in hangs.iterdir() if p.name.isdigit()]) < env.world_size and time.monotonic() < until:
        time.sleep(0.5)
    counts = {}
    for p in hangs.iterdir():
        try:
            counts[int(p.name)] = int(p.read_text())
        except ValueError:
            pass
    out: dict[str, str] = {}
    for r in preempt.hung_ranks(counts, env.world_size):
        node = env.nodes[r // env.local_world_size]
        out[node] = f"rank {r} on {node} hung: {counts[r]} heartbeats while the others reached {max(counts.values())}"
    return out if len(out) < len(set(env.nodes)) or env.executor != "slurm" else {}


# How long a rank that did not decide waits for the verdict on record: the deciding rank's failure path at
# its worst, when Slurm does not answer: a hang's blame (30 s, _hung_nodes), the job's fate and, with hot spares,
# the nodes it holds (slurm.FATE, 33 s each), EndTime (3 s), sinfo for an exclusion (21 s), an elastic queue
# snapshot (3 x 21 s), the requeue and the ExcNodeList update (slurm.REQUEUE, 33 s each) and 10 s for the config
# and the records: 259 s. It was 60 s,
# and a slower decision that came to a relaunch found the copies of the ranks that had left deleted.
# It ends as soon as the verdict is there (within ms of the relay's marker, which it follows at once).
VERDICT_WAIT_S = (
    30.0 + 2 * slurm.worst_s(*slurm.FATE) + 3.0 + 4 * slurm.worst_s(10.0, 1) + 2 * slurm.worst_s(*slurm.REQUEUE) + 10.0
)
_placed: list[Any] = [None]  # this task's env once placed by the rendezvous (ranks in topology order)
_deciding = [False]  # this process claimed the attempt's failure: a second failing thread must not end it


def _write_heartbeats(paths: RunPaths, env: Any) -> Path:
    """This failing rank's heartbeat count, in the attempt's folder of them (returned): a hang's blame
    (_hung_nodes) and, with cluster.in_process_restart, its word that it lives (_plan_rejoin)."""
    hangs = paths.run_dir / f".hang-{env.job_id}-{env.restart_count}"
    try:
        make_dir(hangs, exist_ok=True)
        write_atomic(hangs / str(env.rank), str(preempt.ticks[0]))
    except OSError:
        pass  # the deciding rank counts itself; another is then taken for dead after REJOIN_SETTLE_S
    return hangs


def _after_failure(
    paths: RunPaths, env: Any, error: BaseException | None = None, hang: bool = False
) -> tuple[str, float]:
    """The first rank to fail in an attempt decides (an O_EXCL file); the others die with it (gloo
    sees the closed peer). Returns (its verdict, or "" for the others; the partition's grace time).
    Every failing rank first writes its heartbeat count, from which the deciding rank blames a hang
    (hang=True: the watchdog fired) on the ranks that stopped first (_hung_nodes)."""
    from hpc_train.config import check_environment, load_frozen

    hangs = _write_heartbeats(paths, env)
    try:
        claim = paths.failure_claim(env.job_id, env.restart_count)
        os.close(os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except FileExistsError:
        # The watchdog thread decides while the main thread sees the peers' exits (gloo: closed peer), or
        # the other way round: this thread must not end the process under the deciding one, which exits.
        while _deciding[0]:
            time.sleep(1)
        # Another rank decides: stay until its verdict is on record. Exiting at once closed this rank's
        # sockets, failing the blocked ranks before they wrote their heartbeat counts, and under a site's
        # KillOnBadExit=1 srun would kill the deciding rank with us. Still none by VERDICT_WAIT_S (the
        # deciding rank died): this node's copies stay, since a relaunch could still come and read them.
        until = time.monotonic() + VERDICT_WAIT_S
        while (end := journal.verdict(journal.read(paths.run_dir), env.restart_count)) is None:
            if time.monotonic() >= until:
                print(
                    f"[hpc_train] no verdict on record {VERDICT_WAIT_S:.0f} s after this rank failed: leaving "
                    f"without it, this node's memory copies kept for a relaunch that may still come",
                    file=sys.stderr,
                    flush=True,
                )
                break
            time.sleep(0.5)
        _clean_memory(end, env.executor == "local")
        plan = read_rejoin_plan(paths, env.job_id)  # and the verdict: a plan alone may be a deciding rank's last act
        mine = plan and plan["from"] == env.restart_count and env.rank in plan.get("survivors", [])
        if not hang and mine and journal.rejoins(end):
            return "rejoin", 0.0
        return "", 0.0
    _deciding[0] = True
    try:
        cfg = load_frozen(paths.run_dir)
        check_environment(cfg)
    except Exception as e:  # the config itself, or what it needs of this node, is what fails: no point in retrying
        # on record: the other ranks' verdict wait (VERDICT_WAIT_S) and a standby's (journal.step_over) end now
        why = (
            f"the frozen config or this node's environment failed ({type(e).__name__}: {e}); fix it, then "
            f"hpc-train resume {paths.run_dir}"
        )
        try:
            journal.log(
                paths.run_dir, journal.STOPPED, preempt.step_reached[0], env.job_id, env.restart_count, reason=why
            )
        except OSError:
            pass
        print(f"[hpc_train] not requeueing: {why}", file=sys.stderr, flush=True)
        return "stop", 0.0
    if isinstance(error, preempt.Unrecoverable):
        journal.log(
            paths.run_dir, journal.STOPPED, preempt.step_reached[0], env.job_id, env.restart_count, reason=str(error)
        )
        print(f"[hpc_train] not requeueing: {error}", file=sys.stderr, flush=True)
        return "stop", 0.0
    text = f"{type(error).__name__}: {error}" if error is not None else ""
    marker = preempt.hardware_error(text)
    node = os.environ.get("SLURMD_NODENAME") or env.nodes[env.node_rank]
    # env is Slurm's task numbering (this runs outside the placed rendezvous too): name the task, not a rank
    task = f"{'Slurm task' if env.executor == 'slurm' else 'task'} {env.rank}"
    sick = {node: f"{task} on {node} failed with a hardware error ({marker}): {text[:200]}"} if marker else None
    if hang:
        sick = _hung_nodes(hangs, env, min(30.0, cfg.train.watchdog_s)) or None
    verdict = requeue_or_stop(paths, env, cfg, "failure", preempt.step_reached[0], sick, hang)
    # by the verdict on record, as the other ranks judge it: a relaunch that leaves this rank's node out
    # (its own hardware error, its hang) has no rank here to read this node's copies
    _clean_memory(journal.verdict(journal.read(paths.run_dir), env.restart_count), env.executor == "local")
    return verdict, cfg.cluster.preempt_grace_s


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
    from hpc_train.env import parse_nodelist

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


def _clean_memory(end: dict[str, Any] | None, local: bool) -> None:
    """checkpoint.memory_every_steps: this node's copies go unless the failed attempt's verdict `end` starts
    the step again in this allocation on this node (journal.keeps_memory): a requeue's allocation (another
    Slurm restart count) never reads them, and nothing else removes them from a node the run does not come
    back to (RAM until the node's reboot)."""
    if "hpc_train.memory_tier" in sys.modules:  # built by this attempt (Attempt.build imports it)
        from hpc_train import memory_tier

        tier = memory_tier.BUILT[0]
        if tier is not None:
            tier.abandon()  # the copy in flight either way (a peer may be gone): a relaunch reads complete steps only
            if not journal.keeps_memory(end, tier.node, local):
                tier.clean()


# The most a stop waits for the memory copy in flight before it leaves (a copy of a `1b` state takes ~10 s).
STOP_MEMORY_WAIT_S = 60.0


def _decide_together(
    paths: RunPaths,
    env: Any,
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

    actions = ("stop", "requeue", "wait", "relaunch")
    if memory is not None:  # a stop: its disk save is newer than any copy, and the requeue must not wait on one
        memory.abandon()  # the copy in flight writes nothing more (its collectives still end on every rank)
    verdict = torch.tensor([0])
    if env.rank == 0:
        verdict[0] = actions.index(requeue_or_stop(paths, env, cfg, reason, step, sick))
    dist.broadcast(verdict, src=0)
    # destroy_process_group would wait on the copy thread's group: that copy first, until 5 s before the kill;
    # still running then, no teardown (_leave's os._exit ends the process either way)
    if memory is not None:  # a stop without a signal's deadline (none is known) waits STOP_MEMORY_WAIT_S
        memory.wait(max(0.0, min(kill_deadline - time.monotonic() - 5, STOP_MEMORY_WAIT_S)))
    if memory is None or memory.idle.is_set():
        dist.destroy_process_group()
    again = actions[int(verdict)] == "relaunch" or (actions[int(verdict)] == "requeue" and env.executor == "local")
    if memory is not None and not again:
        memory.clean()
    _leave(actions[int(verdict)], cfg.cluster.preempt_grace_s, kill_deadline)


def _rendezvous(env: Any, cfg: Any, paths: RunPaths, keep_order: bool = False) -> Any:
    """One TCPStore rendezvous that also places ranks: every task publishes its node and
    SLURM_TOPOLOGY_ADDR, the store's host (Slurm's task 0) plans the order (topology.py) and publishes
    it, and every task joins the process group under its placed rank. Returns the placed RankEnv.
    keep_order: env.nodes is the order (an in-process restart's plan: re-planned by switch, a standby in a dead
    node's place swapped the survivors' ranks, and their state with them)."""
    import dataclasses
    import json
    import socket

    import torch
    import torch.distributed as dist

    from hpc_train import topology
    from hpc_train.env import torchrun_vars

    timeout = timedelta(seconds=cfg.train.rendezvous_timeout_s)
    where = f"{env.master_addr}:{env.master_port}"
    try:
        store = dist.TCPStore(
            env.master_addr,
            env.master_port,
            env.world_size,
            is_master=env.rank == 0,
            timeout=timeout,
            wait_for_workers=False,
        )
        node = os.environ.get("SLURMD_NODENAME", env.nodes[env.node_rank])
        store.set(f"topo/{env.rank}", json.dumps([node, os.environ.get("SLURM_TOPOLOGY_ADDR", "")]))
        if env.rank == 0:
            store.wait([f"topo/{r}" for r in range(env.world_size)])
            addrs: dict[str, str] = {}
            for r in range(env.world_size):  # Slurm's task order = its node order
                n, addr = json.loads(store.get(f"topo/{r}"))
                addrs.setdefault(n, addr)
            plan = topology.placement(addrs, env.local_world_size, cfg.train.tp, env.nodes if keep_order else None)
            store.set("placement", json.dumps(plan))
            paths.placement.write_text(json.dumps(plan, indent=1) + "\n")
        plan = json.loads(store.get("placement"))
        order = plan["nodes"]
        placed = dataclasses.replace(
            env,
            rank=order.index(node) * env.local_world_size + env.local_rank,
            node_rank=order.index(node),
            nodes=tuple(order),
        )
        backend = "gloo"
        # One GPU per task: the task's own if Slurm bound one, else by local rank. Not for a script: its GPU
        # is its child's, and set_device alone makes a CUDA context there (cudaSetDevice, CUDA >= 12: ~0.5 GB
        # held by our rank process for the whole run); our collectives are CPU tensors over gloo anyway.
        if torch.cuda.is_available() and not cfg.script.cmd:
            torch.cuda.set_device(env.local_rank % torch.cuda.device_count())
            backend = "cpu:gloo,cuda:nccl"  # CPU tensors (resume step, verdicts) still go through gloo
        # Collectives wait past the hang watchdog's limit (900 s), not the rendezvous timeout: rank 0's requeue
        # decision (two scontrol calls, up to ~66 s) or one rank's slower write must not time out the others.
        # 60 s past it: the watchdog (polling every <= 5 s) fires first on every rank, so a hang is judged as
        # one (heartbeat counts, the hung node left out); at exactly watchdog_s gloo's own timeout usually won
        # and the hang went down as an ordinary failure, onto the same node again.
        dist.init_process_group(
            backend,
            store=store,
            rank=placed.rank,
            world_size=env.world_size,
            timeout=max(timeout, timedelta(seconds=preempt.collective_timeout_s(cfg.train.watchdog_s))),
        )
    except Exception as e:
        raise RuntimeError(
            f"task {env.rank}/{env.world_size} on {socket.gethostname()}: rendezvous at {where} failed within "
            f"train.rendezvous_timeout_s={cfg.train.rendezvous_timeout_s}: {e}. Check that {env.master_addr} "
            f"resolves here and that port {env.master_port} is free on it."
        ) from e
    os.environ.update(torchrun_vars(placed))
    if cfg.cluster.in_process_restart:  # this rank's life, for a deciding rank's _plan_rejoin
        make_dir(paths.alive(env.job_id, env.restart_count), exist_ok=True)
        if _alive_fd[0] is not None:
            os.close(_alive_fd[0])
        _alive_fd[0] = hold_for_life(paths.alive(env.job_id, env.restart_count) / str(placed.rank))
    print(f"[hpc_train] placed task {env.rank} as rank {placed.rank} on {node}", flush=True)
    _placed[0] = placed
    return placed


# cluster.in_process_restart: the deciding rank waits until every rank either said it survived (its heartbeat
# count, written as it fails: within one step of the crash) or is known dead (its lock of paths.alive is free:
# at once for a killed process), at most this long: a lost node's lock on NFS outlives it (~90 s), and a rank
# silent by then is taken for dead. One that was only late finds itself out of the plan and exits.
REJOIN_SETTLE_S = 2.0
_alive_fd: list[int | None] = [None]  # this process's lock of its attempt's paths.alive file


def _split_standby(env: Any, cfg: Any) -> tuple[Any, bool]:
    """cluster.in_process_restart: the step spans the spares too (sbatch renders it so; job._relaunch again);
    its first cluster.nodes nodes train, every task beyond them is a warm standby. (the training env, standby?)"""
    lws = env.local_world_size
    if not (cfg.cluster.in_process_restart and env.executor == "slurm" and os.environ.get("HPC_TRAIN_STEP_ARGS")):
        return env, False
    n = min(cfg.cluster.nodes, env.num_nodes)
    if n == env.num_nodes:  # a step gone on smaller (cluster.min_nodes): no spare left, no standby
        return env, False
    train = dataclasses.replace(env, world_size=n * lws, num_nodes=n, nodes=env.nodes[:n])
    return train, env.rank >= n * lws


def _warm_up() -> None:
    """What a standby's first attempt would otherwise import on the clock: torch.optim's first optimizer imports
    torch._dynamo (2.9 s of a 4 s in-process restart here, before this), its first step the fused kernels."""
    import torch

    layer = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(layer.parameters())
    layer(torch.ones(1, 2)).sum().backward()
    optimizer.step()


def read_rejoin_plan(paths: RunPaths, job_id: str) -> dict[str, Any] | None:
    """The plan for the next attempt in these processes, or None: none, not a plan, or one that may not be this
    user's alone (a symlink; a file or folder another user owns or can write: the hosts it names would be joined,
    and the new group's broadcast_object_list unpickles their bytes), which is said once."""
    where = paths.rejoin_plan(job_id)
    try:
        # NFS: opening the folder revalidates it (close-to-open); else a standby's negative lookup of the plan (its
        # reads before it existed) or a survivor's of the previous plan stays cached up to acdirmax (60 s)
        os.listdir(paths.run_dir)
        text = where.read_text()
        why = f"{where} is a symlink; remove it" if where.is_symlink() else untrusted(where, paths.run_dir)
    except OSError:
        return None
    if why:
        if why not in _refused_plans:
            _refused_plans.add(why)
            print(f"[hpc_train] not rejoining by {where}: {why}", file=sys.stderr, flush=True)
        return None
    try:
        plan = json.loads(text)
    except ValueError:
        return None
    numbered = isinstance(plan, dict) and all(type(plan.get(k)) is int for k in ("from", "attempt"))
    return plan if numbered else None


def rejoin_plan_or_leave(paths: RunPaths, job_id: str) -> dict[str, Any]:
    """The plan a `rejoin` verdict names; gone or refused between the verdict and this read (read_rejoin_plan says
    why), this rank leaves as a failed one: with no plan, Attempt.build ran on the destroyed group, failed, and the
    same verdict came again, a busy loop until the 900 s watchdog."""
    plan = read_rejoin_plan(paths, job_id)
    if plan is None:
        print(
            f"[hpc_train] no rejoin plan to read in {paths.rejoin_plan(job_id)}: leaving", file=sys.stderr, flush=True
        )
        _leave("stop", 0.0)
    return plan


_refused_plans: set[str] = set()  # read_rejoin_plan's refusals said so far: the standby's poll reads every 20 ms


def _standby_wait(paths: RunPaths, env: Any) -> dict[str, Any]:
    """A standby's wait, warm: every 20 ms for a plan that names its Slurm task (then it returns it), every
    second for the step's end (_step_left: it exits 0, so the step's status is the training ranks')."""
    task, node = os.environ.get("SLURM_PROCID", "0"), os.environ.get("SLURMD_NODENAME", "")
    mine = paths.standbys(env.job_id) / task
    make_dir(mine.parent, exist_ok=True)
    write_atomic(mine, node)
    held = hold_for_life(mine)  # freed by its death: _plan_rejoin counts live standbys only
    print(f"[hpc_train] task {task} on {node}: warm standby (cluster.in_process_restart)", flush=True)
    check, confirmed = 0.0, env.restart_count  # the newest plan's attempt whose verdict is on record
    while True:
        plan = read_rejoin_plan(paths, env.job_id)
        # Only a plan whose in-process verdict is on record (its deciding rank may die between the two writes, and
        # the survivors then leave): the journal is read while a newer plan waits for it, ms in the normal case.
        if plan and plan["attempt"] > confirmed:
            if journal.rejoins(journal.verdict(journal.read(paths.run_dir), plan["from"])):
                confirmed = plan["attempt"]
        if plan and plan["attempt"] == confirmed > env.restart_count and task in plan.get("standby", {}):
            mine.unlink(missing_ok=True)
            if held is not None:
                os.close(held)
            return plan
        if time.monotonic() >= check:
            check = time.monotonic() + 1.0
            if why := _step_left(paths, env, plan if plan and plan["attempt"] == confirmed else None):
                print(f"[hpc_train] task {task} on {node}: standby leaves: {why}", flush=True)
                mine.unlink(missing_ok=True)
                leave.process(0)
        time.sleep(0.02)


def _step_left(paths: RunPaths, env: Any, plan: dict[str, Any] | None) -> str:
    """Why a standby's training step is over, "" while it is not: a stop signal srun forwarded (the training ranks
    decide; nothing rejoins after one), the step's verdict on record (journal.step_over), or every training rank of
    the step's current attempt (the newest plan's, else the standby's own) gone without one (their paths.alive locks
    free: the deciding rank died, its verdict wait ran out, the user's function called sys.exit). Without the last
    two the standby alone kept srun's step, and the job, to its time limit. A rank not yet placed has no lock file:
    not gone (holder_gone), so a step still starting is not taken for over."""
    if preempt.received:
        return f"{preempt.received[0]} received"
    if journal.step_over(journal.read(paths.run_dir), env.restart_count):
        return "the step's verdict is on record"
    newer = plan is not None and plan.get("attempt", -1) > env.restart_count
    attempt, world = (plan["attempt"], plan["world_size"]) if plan and newer else (env.restart_count, env.world_size)
    locks = paths.alive(env.job_id, attempt)
    if all(holder_gone(locks / str(r)) for r in range(world)):
        return f"all {world} training ranks of attempt {attempt} are gone without a verdict"
    return ""


def _plan_rejoin(
    paths: RunPaths,
    env: Any,
    events: list[dict[str, Any]],
    sick: dict[str, str],
    used: int,
    reason: str,
    record: Callable[..., None],
    hang: bool = False,
) -> bool:
    """The deciding rank, once an in-job restart is decided (cluster.in_process_restart): can the ranks that
    survived rejoin in their processes, each dead node replaced by a standby's? True once the plan is written
    (paths.rejoin_plan) and recorded (`in_job_restart`, in_process); False (said why): the step is relaunched.
    hang: the watchdog fired, every rank leaves its process (job._start_watchdog), so none rejoins."""
    from hpc_train.env import rendezvous_port

    per, hangs = env.local_world_size, paths.run_dir / f".hang-{env.job_id}-{env.restart_count}"
    locks, until = paths.alive(env.job_id, env.restart_count), time.monotonic() + REJOIN_SETTLE_S
    while True:
        alive = {int(p.name) for p in hangs.iterdir() if p.name.isdigit()} if hangs.is_dir() else set()
        alive.add(env.rank)  # this one decides, so lives, though its heartbeat write failed (a full disk)
        gone = {r for r in set(range(env.world_size)) - alive if holder_gone(locks / str(r))}
        if len(alive | gone) >= env.world_size or time.monotonic() >= until:
            break
        time.sleep(0.01)
    dead_nodes = sorted({r // per for r in set(range(env.world_size)) - alive})
    standbys: dict[str, list[str]] = {}
    for p in paths.standbys(env.job_id).iterdir() if paths.standbys(env.job_id).is_dir() else []:
        # A standby that died waiting (the relay's SIGKILL), or one of this job id's allocation before a Slurm
        # requeue: counted, the survivors waited train.rendezvous_timeout_s for it and the step relaunched.
        if holder_gone(p):
            continue
        try:
            standbys.setdefault(p.read_text().strip(), []).append(p.name)
        except OSError:
            continue
    free = [n for n, tasks in sorted(standbys.items()) if len(tasks) == per and n not in env.nodes]
    mixed = [env.nodes[n] for n in dead_nodes if any(n * per + i in alive for i in range(per))]
    trained = journal.trained(events, env.restart_count)
    # A blamed node whose ranks all died (a node failure Slurm took out of the job, job.lost_nodes) is replaced
    # like any dead node, and left out (recorded) so that no later relaunch of this allocation lands on it.
    gone_nodes = {env.nodes[n] for n in dead_nodes} - set(mixed)
    blamed = [n for n in sick if n not in gone_nodes]
    why = (
        # Every rank blocked together (a deadlock, a storage stall) blames no node, yet the watchdog's rank exits
        # and the others' wait ends with no rank to rejoin: the plan was held until the time limit.
        "a hang (train.watchdog_s): its ranks leave their processes"
        if hang
        else f"a node was blamed ({', '.join(blamed)}): it is left out by a relaunch"
        if blamed
        else "this attempt failed before its first step (while rejoining?)"
        if not trained
        else f"ranks on {', '.join(mixed)} survived beside the dead: a standby replaces whole nodes"
        if mixed
        else f"{len(dead_nodes)} node(s) lost, {len(free)} warm standby node(s) left"
        if len(free) < len(dead_nodes)
        else ""
    )
    if why:
        print(f"[hpc_train] not restarting in process: {why}; relaunching the step", file=sys.stderr, flush=True)
        return False
    nodes, standby = list(env.nodes), {}
    for n, node in zip(dead_nodes, free):
        nodes[n] = node
        for i, task in enumerate(sorted(standbys[node], key=int)):  # block distribution: task order = local id
            standby[task] = n * per + i
    attempt = env.restart_count + 1
    plan = {"from": env.restart_count, "attempt": attempt, "world_size": env.world_size, "nodes": nodes}
    plan |= {"master_port": rendezvous_port(env.job_id, attempt), "survivors": sorted(alive), "standby": standby}
    try:
        write_atomic(paths.rejoin_plan(env.job_id), json.dumps(plan | {"at": time.time()}) + "\n")
    except OSError as e:
        print(f"[hpc_train] could not write the rejoin plan ({e}): relaunching the step", file=sys.stderr, flush=True)
        return False
    replaced = {env.nodes[n]: nodes[n] for n in dead_nodes}
    for node, because in sick.items():
        record(journal.NODE_EXCLUDED, node=node, why=because)
    record(
        journal.IN_JOB_RESTART,
        reason=reason,
        in_process=True,
        replaced=replaced,
        left_out=sorted(sick),
        nodes_next=len(nodes),
        spares_left=len(free) - len(dead_nodes),
        in_job_restarts=used + 1,
    )
    swaps = ", ".join(f"{a} by the standby on {b}" for a, b in replaced.items()) or "no node lost"
    print(f"[hpc_train] restarting in process ({swaps}): the ranks that survived rejoin", file=sys.stderr, flush=True)
    return True


def _drop_group(env: Any, paths: RunPaths | None = None) -> None:
    """A failed rank that will rejoin: cut its connections to the job's nodes (gloo's and the old store's), so a
    peer blocked on this rank fails now too, write its heartbeat count (with `paths`: before the teardown, which
    can take longer than the deciding rank's REJOIN_SETTLE_S, 2 s, and a live rank silent that long is taken for
    dead), then destroy its process groups. destroy_process_group (and
    ProcessGroupGloo.abort) close gloo's sockets only with the group's last reference, and the exception's traceback
    still holds one (frames -> model -> DDP -> group): a peer blocked in recv failed only when this process exited
    (torch 2.13), and with 2 ranks per node a survivor was silent for REJOIN_SETTLE_S and taken for dead.
    No gc.collect(): 0.5 s of a loaded core here; the old model goes with the exception."""
    import torch.distributed as dist

    _cut_connections({*env.nodes, env.master_addr})
    if paths is not None:
        _write_heartbeats(paths, env)
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception as e:  # a group a failure left half torn down: the new one does not need it
        print(f"[hpc_train] destroying the failed process group: {type(e).__name__}: {e}", file=sys.stderr)


def _cut_connections(hosts: set[str]) -> None:
    """shutdown(2) every TCP connection of this process to one of `hosts` (its fds stay open, for their owners to
    close): the peer reads EOF at once. Only the job's nodes by their names: a tracker's or Prometheus' connections
    elsewhere are left alone (gloo on an interface other than the names' would be too: the watchdog then)."""
    import socket

    addresses = set()
    for host in hosts:
        try:
            addresses |= {str(a[4][0]) for a in socket.getaddrinfo(host, None)}
        except OSError:
            continue
    for name in os.listdir("/proc/self/fd"):
        try:
            sock = socket.socket(fileno=os.dup(int(name)))  # a dup: closing it leaves the fd to its owner
        except (OSError, ValueError):
            continue
        try:
            if sock.type == socket.SOCK_STREAM and sock.family in (socket.AF_INET, socket.AF_INET6):
                if str(sock.getpeername()[0]).removeprefix("::ffff:") in addresses:
                    sock.shutdown(socket.SHUT_RDWR)
        except OSError:  # not connected (a listening socket), or already shut
            pass
        finally:
            sock.close()


def _rejoin(
    paths: RunPaths, cfg: Any, plan: dict[str, Any], env: Any, standby: bool = False
) -> tuple[Any, float, dict[str, float]]:
    """Join the plan's attempt in this process: a survivor under its rank, a standby under the dead rank it
    replaces; the rendezvous of _rendezvous on the plan's nodes and port. Returns (placed env, the attempt's
    start: the plan's time, its phases)."""
    rank = plan["standby"][os.environ.get("SLURM_PROCID", "")] if standby else env.rank
    nodes, per = tuple(plan["nodes"]), env.local_world_size
    env = dataclasses.replace(
        env,
        rank=rank,
        local_rank=rank % per,
        world_size=plan["world_size"],
        node_rank=rank // per,
        num_nodes=len(nodes),
        nodes=nodes,
        master_addr=nodes[0],
        master_port=plan["master_port"],
        restart_count=plan["attempt"],
    )
    os.environ["HPC_TRAIN_ATTEMPT"] = str(env.restart_count)
    _deciding[0] = False  # this attempt's failure, if any, is decided afresh
    # Heartbeats from 1 on every rank, as a first attempt's (_start_watchdog's beat): a survivor kept the failed
    # attempt's count (5000 against the standby's 12: a later hang was blamed on the standby's node). The beat
    # also restarts a survivor's watchdog clock.
    preempt.ticks[0] = 0
    preempt.beat()
    for stream in (sys.stdout, sys.stderr):  # `hpc-train logs --attempt` cuts both files at these lines
        print(f"==== hpc_train attempt {env.restart_count} rank {env.rank} ====", file=stream, flush=True)
    _placed[0] = env  # a failure in the rendezvous is this attempt's (not yet trained: _plan_rejoin relaunches)
    placed = _rendezvous(env, cfg, paths, keep_order=True)
    return placed, float(plan["at"]), {"rejoin": time.time() - float(plan["at"])}


def _start_watchdog(limit_s: float, paths: RunPaths, env: Any) -> None:
    """A hung collective never returns, and no signal arrives. A daemon thread watches the loop's
    heartbeat; past `limit_s` it dumps every thread's stack to this rank's log, records the failure,
    requeues within the failure budget and ends the process, so the job fails fast instead of holding
    its nodes until the time limit. (gloo and NCCL ops release the GIL, so the thread runs.)"""
    import faulthandler
    import threading

    env0 = env

    def watch() -> None:
        renewed, asked = time.monotonic(), ""
        while time.monotonic() - preempt.last_beat[0] < limit_s:
            time.sleep(min(5.0, limit_s / 10))
            now = _placed[0] or env0  # an in-process restart rejoins under another rank and attempt
            if now.rank == 0 and time.monotonic() - renewed >= preempt.LEASE_RENEW_S:
                _renew_lease(paths, now)
                renewed = time.monotonic()
            if not asked and _blocked_at_term() and (asked := _batch_host_lost(now)) == "lost":
                why = "the batch script's node was lost: Slurm ended the job while this rank waited in a collective"
                print(f"[hpc_train] rank {now.rank}: {why}; deciding now", file=sys.stderr, flush=True)
                _log_fail(paths, now, why)
                verdict, grace_s = _after_failure(paths, now, RuntimeError(why))
                _leave(verdict if verdict in ("wait", "relaunch") else "stop", grace_s)
        env = _placed[0] or env0
        print(
            f"[hpc_train] rank {env.rank}: no step finished in train.watchdog_s={limit_s:.0f} s: hang; stacks follow",
            file=sys.stderr,
            flush=True,
        )
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        _log_fail(paths, env, f"hang: no step finished in train.watchdog_s={limit_s:.0f} s")
        verdict, grace_s = _after_failure(paths, env, hang=True)
        local_requeue = verdict == "requeue" and env.executor == "local"
        _leave(verdict if verdict in ("wait", "relaunch") or local_requeue else "stop", grace_s)

    preempt.beat()
    threading.Thread(target=watch, daemon=True, name="hpc_train-watchdog").start()


def _blocked_at_term() -> bool:
    """A SIGTERM came and the loop has not beaten since (Attempt.should_stop beats before it all-reduces the stop
    flag): the main thread is blocked, not saving for the stop, which the watchdog must not cut short."""
    if "SIGTERM" not in preempt.received:
        return False
    return preempt.last_beat[0] < preempt.received_at[preempt.received.index("SIGTERM")]


def _batch_host_lost(env: Any) -> str:
    """At a SIGTERM, in the watchdog thread (the main one blocked in a collective on a peer that died with no
    reset: a crashed node): has a spares job lost its batch script's node? "lost", "alive" (Slurm said not: not
    asked again), "" (no evidence yet: asked again at the next poll). Only with the relay's beat silent
    (_relay_silent_s: no Slurm call otherwise, as a preemption TERMs every rank) is Slurm asked (one 10 s try).
    Slurm ends such a --no-kill job without a requeue and SIGKILLs the ranks after KillWait (30 s by default), so
    the watchdog decides then: a requeue as a failure, where the blocked main thread would have died undecided."""
    folder, job_id = os.environ.get("SUBMITIT_FOLDER"), os.environ.get("SLURM_JOB_ID")
    if env.executor != "slurm" or not (folder and job_id and os.environ.get("HPC_TRAIN_STEP_ARGS")):
        return "alive"
    if not _relay_silent_s(Path(folder), job_id):
        return ""
    restarts = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
    return "lost" if slurm.job_fate(env.job_id, restarts, slurm.STOP_FATE) == "batch_host_lost" else "alive"


def _read_lease(paths: RunPaths) -> dict[str, Any] | None:
    """The lease, or None when there is none or it is not one (torn, hand-edited: nobody's). An unreadable
    file (ESTALE, EIO) raises OSError: whether another job owns the run is then unknown."""
    try:
        lease = json.loads(paths.lease.read_text())
    except FileNotFoundError:
        return None
    except ValueError:
        return None
    ok = isinstance(lease, dict) and isinstance(lease.get("job_id"), str) and lease["job_id"]
    numbers = ok and all(isinstance(lease.get(k), (int, float)) for k in ("renewed_at", "expires_at"))
    return lease if numbers else None


def _write_lease(paths: RunPaths, env: Any) -> None:
    import socket

    now = time.time()
    record = {"job_id": env.job_id, "host": socket.gethostname(), "renewed_at": now}
    record["expires_at"] = now + preempt.LEASE_S
    write_atomic(paths.lease, json.dumps(record) + "\n")


def _owner_active(lease: dict[str, Any], env: Any) -> bool | None:
    """Is the lease's job still queued or running? Slurm's answer (None when it gives none); a local
    owner by its controller's pid, on this host only."""
    import socket

    owner = str(lease["job_id"])
    if env.executor == "slurm":
        from hpc_train import slurm

        try:  # one short try (squeue, then sacct): every other rank waits in a collective meanwhile
            return slurm.job_states([owner], retries=1, timeout_s=5).get(owner, "") in slurm.ACTIVE_STATES
        except slurm.SlurmError:
            return None
    if lease.get("host") != socket.gethostname() or not owner.isdigit():
        return None
    try:
        os.kill(int(owner), 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's: a reused pid
        return False
    return True


def _claim_lease(paths: RunPaths, env: Any) -> dict[str, Any] | None:
    """Rank 0: make this job the run directory's owner, or return the lease of the live job that owns it.
    Two jobs on one run (two submits that queued one trial, an orphan of a lost record) both append to one
    journal, spend its budgets twice and delete each other's checkpoints by retention: the second to start
    refuses instead. Under a lock, so two starting at once do not both take it; after the watchdog starts,
    which ends a wait on a lock a dead NFS client still holds."""
    with locked(paths.run_dir / ".lease.lock", wait_s=5):  # a dead NFS holder: decide unlocked after 5 s
        lease = _read_lease(paths)
        now = time.time()
        owner_active = None
        if lease and lease["job_id"] != env.job_id:
            owner_active = _owner_active(lease, env)
        if not preempt.lease_verdict(lease, env.job_id, now, owner_active):
            return lease
        _write_lease(paths, env)
    return None


def _renew_lease(paths: RunPaths, env: Any) -> None:
    """The watchdog thread, every LEASE_RENEW_S on rank 0: extend this job's lease, never another's (one
    that took it after Slurm said this job was gone, or this job missed renewals for 60 s while Slurm did not
    answer). Never blocks: a busy lock, or a lease it cannot read (ESTALE), waits a turn."""
    try:
        with locked(paths.run_dir / ".lease.lock", wait=False):
            lease = _read_lease(paths)
            if lease is None or str(lease.get("job_id")) == env.job_id:
                _write_lease(paths, env)
            else:
                print(f"[hpc_train] warning: job {lease.get('job_id')} took this run's lease", file=sys.stderr)
    except (OSError, ValueError):  # a full disk or a busy lock: the next turn, 30 s on
        pass


def _own_run_dir(paths: RunPaths, env: Any) -> None:
    """Collective, before anything is loaded, saved or deleted: rank 0 claims the lease; when another live
    job owns the run directory every rank leaves (exit 1, no requeue) and rank 0 says which job owns it."""
    import torch.distributed as dist

    found: list[Any] = [_claim_lease(paths, env) if env.rank == 0 else None]
    dist.broadcast_object_list(found, src=0)
    lease = found[0]
    if lease is None:
        return
    if env.rank == 0:
        journal.log(
            paths.run_dir,
            journal.LEASE_REFUSED,
            -1,
            env.job_id,
            env.restart_count,
            owner=str(lease["job_id"]),
            owner_host=lease.get("host"),
            expires_at=lease.get("expires_at"),
        )
        print(
            f"[hpc_train] job {env.job_id} refuses to train: job {lease['job_id']} (on {lease.get('host')}) owns "
            f"{paths.run_dir} and is still queued or running; this job leaves its checkpoints and budgets "
            f"alone. Follow the owner with hpc-train status {paths.run_dir}; if it is gone, hpc-train resume "
            f"{paths.run_dir} starts the run again",
            file=sys.stderr,
            flush=True,
        )
    _leave("stop", 0.0)


def _run(paths: RunPaths, env: Any, process_start: float, phases_s: dict[str, float]) -> dict[str, Any] | None:
    t0 = time.time()
    import torch
    import torch.distributed as dist

    from hpc_train.attempt import Attempt
    from hpc_train.config import check_environment, load_frozen

    cfg = load_frozen(paths.run_dir)
    check_environment(cfg)  # this node's answers: fn._target_ importable, the compiler, data.path's meta.json
    phases_s["imports"] = time.time() - t0
    if env.local_rank == 0 and paths.code.exists():  # one task per node: each node may have its own install
        from hpc_train.provenance import differences

        try:  # a check that informs: it never fails the attempt (a damaged code.json, git's odd output)
            changed = differences(json.loads(paths.code.read_text()))
        except Exception as e:
            changed = f"could not compare the code with code.json ({type(e).__name__}: {e})"
        if changed:
            journal.log(
                paths.run_dir, journal.CODE_CHANGED, -1, env.job_id, env.restart_count, rank=env.rank, detail=changed
            )
            print(f"[hpc_train] warning: {changed}", file=sys.stderr, flush=True)
    if env.executor == "local" and journal.local_fate(journal.read(paths.run_dir)) == "cancelled":
        if env.rank == 0:  # `hpc-train cancel` came between two attempts
            journal.log(
                paths.run_dir,
                journal.STOPPED,
                -1,
                env.job_id,
                env.restart_count,
                reason="cancelled before this attempt started",
            )
        sys.exit(1)
    if preempt.injected("raise_at_start"):
        raise RuntimeError("injected fault: raise_at_start (HPC_TRAIN_FAULT)")
    if preempt.injected("ecc_at_start"):  # a hardware error: the node is left out (preempt.HARDWARE_ERRORS)
        raise RuntimeError("CUDA error: uncorrectable ECC error encountered (injected fault: ecc_at_start)")
    # One intra-op thread pool per rank sized to its CPUs: torch's default (all cores in every rank)
    # made 4 ranks on 2 cores 35x slower per step on the dev cluster (350 ms vs 10 ms).
    cores = os.environ.get("SLURM_CPUS_PER_TASK") or max(1, (os.cpu_count() or 1) // env.local_world_size)
    torch.set_num_threads(int(cores))
    if torch.cuda.is_available():  # before the process group: NCCL reads these when it starts
        from hpc_train.env import gpu_sharing_error, nccl_env

        if why := gpu_sharing_error(torch.cuda.device_count(), env.local_world_size):
            raise preempt.Unrecoverable(f"{os.environ.get('SLURMD_NODENAME', env.nodes[env.node_rank])}: {why}")
        make_dir(paths.nccl_trace, exist_ok=True)
        os.environ.update(nccl_env(str(paths.nccl_trace), os.environ))
    if cfg.cluster.in_process_restart:
        # What is imported lives as long as the process: out of the collector's sight, so the collections of a
        # rank that rejoins (freeing the failed attempt's model) and the DDP search of the resume
        # (attempt.ddps_to_rebucket) see only what an attempt made: 0.67 s -> ms of each here.
        gc.freeze()
    env, standby = _split_standby(env, cfg)
    if standby:  # cluster.in_process_restart: warm (torch and the trainer imported) until a rank dies
        resolve(cfg.fn._target_)
        _warm_up()
        plan = _standby_wait(paths, env)
        _start_watchdog(cfg.train.watchdog_s, paths, env)  # before _rejoin, whose beat counts from 1 as a survivor's
        env, process_start, phases_s = _rejoin(paths, cfg, plan, env, standby=True)
    else:
        t0 = time.time()
        env = _rendezvous(env, cfg, paths)
        phases_s["rendezvous"] = time.time() - t0
        _start_watchdog(cfg.train.watchdog_s, paths, env)
        _own_run_dir(paths, env)
    if cfg.preflight.enabled and not standby:
        from hpc_train import preflight

        t0 = time.time()
        # the same verdict on every rank; a script's GPUs are read (nvidia-smi, XIDs) but not timed here
        sick = preflight.check(env, cfg.preflight, paths, time_gpu=not cfg.script.cmd)
        phases_s["preflight"] = time.time() - t0
        if sick:
            _decide_together(paths, env, cfg, "node_health", -1, sick=sick)
    if cfg.script.cmd:  # the user's own command, one child per rank (script.py), then the one decision
        out = script.supervise(env, cfg, paths, dataclasses.asdict(cfg), process_start, decision_reserve_s(env, cfg))
        if out["outcome"] == "unrunnable":  # exit 126/127: no requeue makes a missing program run
            if env.rank == 0:
                journal.log(
                    paths.run_dir, journal.STOPPED, out["step"], env.job_id, env.restart_count, reason=out["why"]
                )
                print(f"[hpc_train] not requeueing: {out['why']}", file=sys.stderr, flush=True)
            dist.barrier()  # the verdict is on record before any rank exits (srun's KillOnBadExit)
            dist.destroy_process_group()
            _leave("stop", 0.0)
        if out["outcome"] != "finished":
            _decide_together(
                paths, env, cfg, out["reason"], out["step"], out.get("kill_deadline", float("inf")), out.get("sick")
            )
        summary = script.finish(env, paths, out)
        dist.barrier()
        dist.destroy_process_group()
        return summary if env.rank == 0 else None
    fn = resolve(cfg.fn._target_)
    plan: dict[str, Any] | None = None
    while True:  # once, unless cluster.in_process_restart rejoins after a crash (_plan_rejoin)
        try:
            if plan is not None:  # inside the try: a failure while rejoining relaunches the step (_plan_rejoin)
                gc.collect()  # the failed attempt's model and optimizer (GPU memory too), held in cycles
                env, process_start, phases_s = _rejoin(paths, cfg, plan, env)
                plan = None
            at = Attempt.build(env, cfg, paths, process_start, phases_s, decision_reserve_s(env, cfg))
            result = fn(at, **cfg.fn.kwargs)
            break
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException as e:  # DCP's CheckpointException is a BaseException, not an Exception
            if not (cfg.cluster.in_process_restart and env.executor == "slurm"):
                raise
            _drop_group(_placed[0] or env, paths)  # first: a peer blocked on this rank fails now, not at the timeout
            verdict, grace_s = _failed(paths, env, e)
            if verdict != "rejoin":
                _leave_after_failure(verdict, grace_s, env)
            traceback.print_exc()
            print(f"[hpc_train] rank {env.rank}: {type(e).__name__}: {e}; rejoining in this process", flush=True)
            plan, env = rejoin_plan_or_leave(paths, env.job_id), _placed[0] or env
    at.returned()  # at its own stop check: a stop at the step reached
    if at.stopped and at.finished is None:
        at.profile.close(False, "the requeue decision")  # a function that returned at its own stop check
        _decide_together(paths, env, cfg, at.stop_reason, at.stop_step, at.kill_deadline, memory=at.memory)
    summary = at.finished or at.finish(None, **(result if isinstance(result, dict) else {"result": result}))
    folder, slurm_job = os.environ.get("SUBMITIT_FOLDER"), os.environ.get("SLURM_JOB_ID")
    # A job with hot spares: the relay (signal_relay.sh) returns 0 on this file whatever srun says (137 when a
    # task an in-process restart replaced died in this step, a rank's abort after its result), not srun's status.
    if env.rank == 0 and (cfg.cluster.spare_nodes or cfg.cluster.in_process_restart) and folder and slurm_job:
        try:
            write_atomic(finished_marker(Path(folder), slurm_job), "finished\n")
        except OSError:  # then srun's status is the job's; the run is finished all the same
            pass
    dist.barrier()
    dist.destroy_process_group()
    return summary if env.rank == 0 else None
