"""What every task of a job runs (start.py calls run_job): rank env, placed rendezvous, the hang
watchdog, then the training function with its Attempt, then the one requeue decision.

Importing this module is cheap and torch-free (the login node pickles `run_job` by reference); torch
is imported when the job runs. Exit codes (verdict.py): 0 finished, 144 saved-and-requeued, 145 relaunched
inside the allocation (an in-job restart, cluster.spare_nodes), 1 stopped or failed.

The job side, one module a protocol (docs/architecture.md draws them):
    job.py         this entry: an attempt from the rank's env to its result
    task.py        the rank process's own state (placed env, the failure claim, the life lock)
    rendezvous.py  the placed TCPStore rendezvous       lease.py     one live job owns a run directory
    watchdog.py    the hang watchdog                    failure.py   fail event, claim, the verdict wait
    decision.py    the decision as data: facts in, one out  requeue.py  its facts gathered, and applied
    rejoin.py      in-process restart: standbys, plan   verdict.py   the verdicts and the one way out
    deadlines.py   every deadline of the stop and failure paths

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
        rejoin in their processes (rejoin.plan_rejoin)        the same processes: Attempt.build, fn again
    finished: at.finish(): final save, summary.json        -> `finish`
    raised or hung: the first rank to fail decides alike   -> `fail`, then as stopped
"""

from __future__ import annotations

import dataclasses
import gc
import importlib
import inspect
import json
import logging
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hpc_train import (
    deadlines,
    failure,
    journal,
    lease,
    preempt,
    ranklog,
    rejoin,
    relay,
    rendezvous,
    requeue,
    slurm,
    verdict,
    watchdog,
)
from hpc_train.paths import RunPaths, locked, make_dir
from hpc_train.reasons import Fate, Reason
from hpc_train.task import Task
from hpc_train.verdict import Verdict

log = logging.getLogger(__name__)


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
        raise preempt.Unrecoverable(f"fn._target_={target!r}: {module} has no function {name!r}; fix fn._target_")
    return fn


def check_kwargs(fn: Callable[..., Any], target: str, kwargs: dict[str, Any]) -> None:
    """fn.kwargs fit the function (it is called as fn(attempt, **kwargs)): a config error no retry mends is said
    before the first step, not as a TypeError three attempts long."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # no signature to read (a builtin, a C extension): the call will tell
        return
    try:
        signature.bind(None, **kwargs)
    except TypeError as e:
        raise preempt.Unrecoverable(
            f"fn.kwargs={dict(kwargs)} do not fit {target or 'hpc_train.train.main'}{signature}: {e}; fix fn.kwargs "
            "(the function is called as fn(attempt, **fn.kwargs))"
        ) from None


def run_job(run_dir_str: str) -> dict[str, Any] | None:
    from hpc_train import env as rank_env

    pulse = preempt.install_handlers()  # start.py did, first thing (then this returns its Pulse)
    process_start = process_start_time()
    phases_s = {"python": max(0.0, pulse.installed_at - process_start)}
    paths = RunPaths(Path(run_dir_str))
    # An `hpc-train resume` still recording its event holds the lock for a second or so: wait, but not for
    # a holder that died on NFSv3 (its lock stays until its node reboots; the watchdog is not running yet).
    with locked(paths.lock, shared=True, wait_s=deadlines.RUN_LOCK_WAIT_S) as ok:
        events = journal.read(paths.run_dir)
    if not ok:
        log.warning(
            f"{paths.lock} still locked after {deadlines.RUN_LOCK_WAIT_S:.0f} s (a crashed "
            f"`hpc-train resume`?): read the attempt number without it"
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
    ranklog.configure(env.rank)  # Slurm's task number until placement names the rank (rendezvous.join)
    os.environ.update(rank_env.torchrun_vars(env))
    ranklog.header(env.restart_count, env.rank)
    task = Task(pulse)
    try:
        result = _run(paths, env, task, process_start, phases_s)
        task.pulse.stand_down()  # finished: no hang to watch while the exit joins threads and runs atexit (~60 s)
        return result
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as e:  # DCP's CheckpointException is a BaseException, not an Exception
        failure.leave_after_failure(task, *failure.failed(paths, env, task, e), env)


def _run(
    paths: RunPaths, env: Any, task: Task, process_start: float, phases_s: dict[str, float]
) -> dict[str, Any] | None:
    """Everything of an attempt after the rank's env: the frozen config, this node's checks, the placed
    rendezvous (or a standby's wait), preflight, then the user's script or training function."""
    t0 = time.time()
    import torch  # noqa: F401  here, not later: its ~1.5 s is the "imports" phase

    from hpc_train.config import check_environment, load_frozen

    cfg = load_frozen(paths.run_dir)
    check_environment(cfg)  # this node's answers: fn._target_ importable, the compiler, data.path's meta.json
    phases_s["imports"] = time.time() - t0
    _before_rendezvous(paths, env, cfg)
    if cfg.cluster.in_process_restart:
        # What is imported lives as long as the process: out of the collector's sight, so the collections of a
        # rank that rejoins (freeing the failed attempt's model) and the DDP search of the resume
        # (attempt.ddps_to_rebucket) see only what an attempt made: 0.67 s -> ms of each here.
        gc.freeze()
    env, standby = rejoin.split_standby(env, cfg)
    if standby:  # cluster.in_process_restart: warm (torch and the trainer imported) until a rank dies
        resolve(cfg.fn._target_)
        rejoin.warm_up()
        plan = rejoin.standby_wait(paths, env, task.pulse)
        watchdog.start(cfg.train.watchdog_s, paths, env, task)  # before the rejoin, whose beat counts from 1
        env, process_start, phases_s = rejoin.join(paths, cfg, plan, env, task, standby=True)
    else:
        t0 = time.time()
        env = rendezvous.join(env, cfg, paths, task)
        phases_s["rendezvous"] = time.time() - t0
        watchdog.start(cfg.train.watchdog_s, paths, env, task)
        lease.own_run_dir(paths, env, task)
    if cfg.preflight.enabled and not standby:
        from hpc_train import preflight

        t0 = time.time()
        # the same verdict on every rank; a script's GPUs are read (nvidia-smi, XIDs) but not timed here
        sick = preflight.check(env, cfg.preflight, paths, time_gpu=not cfg.script.cmd)
        phases_s["preflight"] = time.time() - t0
        if sick:
            requeue.decide_together(paths, env, task, cfg, Reason.NODE_HEALTH, -1, sick=sick)
    if cfg.script.cmd:
        return _run_script(paths, env, task, cfg, process_start)
    return _run_function(paths, env, task, cfg, process_start, phases_s)


def _before_rendezvous(paths: RunPaths, env: Any, cfg: Any) -> None:
    """This node's code against code.json, a cancel between two local attempts, the start drills, the thread pool
    and the GPUs' environment: what each task does before it meets the others."""
    import torch

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
            log.warning(changed)
    events = journal.read(paths.run_dir)
    if env.executor == "local" and journal.local_fate(events) == Fate.CANCELLED:
        if env.rank == 0:  # `hpc-train cancel` came between two attempts
            why = "cancelled before this attempt started"
            journal.log(paths.run_dir, journal.STOPPED, -1, env.job_id, env.restart_count, reason=why)
        sys.exit(1)
    stop = journal.stopped(events)
    # an earlier attempt's stop only: a peer of this attempt that failed first (raise_at_start on every rank) has
    # recorded this attempt's own stop, and its job must end FAILED, not be cancelled
    if env.executor == "slurm" and stop is not None and int(stop.get("restart", 0)) < env.restart_count:
        # Stopped for good, yet its job started again: a requeue the stop's scancel lost to (a script's own
        # `scontrol requeue`, Slurm's at a preemption's end), or a pipeline's cancel of a job that started anyway
        log.error(
            "this run stopped for good (%s); not training again: hpc-train resume %s", stop.get("reason"), paths.run_dir
        )
        if env.rank == 0:
            try:
                slurm.scancel([env.job_id])
            except slurm.SlurmError as e:
                log.error("could not cancel job %s: %s; scancel it by hand", env.job_id, e)
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


def _run_script(paths: RunPaths, env: Any, task: Task, cfg: Any, process_start: float) -> dict[str, Any] | None:
    """The user's own command, one child per rank (supervisor.py), then the one decision."""
    import torch.distributed as dist

    from hpc_train import supervisor

    reserve = deadlines.decision_reserve_s(env, cfg)
    out = supervisor.supervise(env, cfg, paths, dataclasses.asdict(cfg), process_start, reserve, task)
    if out["outcome"] == "unrunnable":  # exit 126/127: no requeue makes a missing program run
        if env.rank == 0:
            journal.log(paths.run_dir, journal.STOPPED, out["step"], env.job_id, env.restart_count, reason=out["why"])
            log.error(f"not requeueing: {out['why']}")
            requeue.settle(paths, out["why"])
        dist.barrier()  # the verdict is on record before any rank exits (srun's KillOnBadExit)
        dist.destroy_process_group()
        verdict.leave(task, Verdict.STOP, 0.0)
    if out["outcome"] != "finished":
        kill_deadline = out.get("kill_deadline", float("inf"))
        requeue.decide_together(paths, env, task, cfg, out["reason"], out["step"], kill_deadline, out.get("sick"))
    summary = supervisor.finish(env, paths, out)
    _close(env)
    return summary if env.rank == 0 else None


def _run_function(
    paths: RunPaths, env: Any, task: Task, cfg: Any, process_start: float, phases_s: dict[str, float]
) -> dict[str, Any] | None:
    """The training function (fn._target_, the built-in trainer by default) with its Attempt; with
    cluster.in_process_restart a failure that the deciding rank turns into a rejoin runs it again here."""

    from hpc_train.attempt import Attempt

    fn = resolve(cfg.fn._target_)
    check_kwargs(fn, cfg.fn._target_, cfg.fn.kwargs)
    plan: dict[str, Any] | None = None
    while True:  # once, unless cluster.in_process_restart rejoins after a crash (rejoin.plan_rejoin)
        try:
            if plan is not None:  # inside the try: a failure while rejoining relaunches the step (rejoin.plan_rejoin)
                gc.collect()  # the failed attempt's model and optimizer (GPU memory too), held in cycles
                env, process_start, phases_s = rejoin.join(paths, cfg, plan, env, task)
                plan = None
            reserve = deadlines.decision_reserve_s(env, cfg)
            at = Attempt.build(env, cfg, paths, process_start, phases_s, reserve, task)
            result = fn(at, **cfg.fn.kwargs)
            break
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException as e:  # DCP's CheckpointException is a BaseException, not an Exception
            if not (cfg.cluster.in_process_restart and env.executor == "slurm"):
                raise
            # first: a peer blocked on this rank fails now
            rejoin.drop_group(task.placed or env, paths, task.pulse.ticks)
            chosen, grace_s = failure.failed(paths, env, task, e)
            if chosen != Verdict.REJOIN:
                failure.leave_after_failure(task, chosen, grace_s, env)
            traceback.print_exc()
            log.info(f"{type(e).__name__}: {e}; rejoining in this process")
            plan, env = rejoin.rejoin_plan_or_leave(paths, env.job_id, task), task.placed or env
    ranklog.enable()  # the function may have silenced our loggers (dictConfig): the decision and finish speak
    at.returned()  # at its own stop check: a stop at the step reached
    if at.stopped and at.finished is None:
        at.profile.close(False, "the requeue decision")  # a function that returned at its own stop check
        if at.memory:  # no stop save: the copy in flight is the newest step there is, kept if done in time
            at.wait_for_memory(deadlines.stop_memory_wait_s(at.kill_deadline, time.monotonic(), reserve))
        requeue.decide_together(paths, env, task, cfg, at.stop_reason, at.stop_step, at.kill_deadline, memory=at.memory)
    summary = at.finished or at.finish(None, **(result if isinstance(result, dict) else {"result": result}))
    folder, slurm_job = os.environ.get("SUBMITIT_FOLDER"), os.environ.get("SLURM_JOB_ID")
    # A job with hot spares: the relay (relay.py) returns 0 on this file whatever srun says (137 when a
    # task an in-process restart replaced died in this step, a rank's abort after its result), not srun's status.
    if env.rank == 0 and (cfg.cluster.spare_nodes or cfg.cluster.in_process_restart) and folder and slurm_job:
        try:
            relay.write_finished(Path(folder), slurm_job)
        except OSError:  # then srun's status is the job's; the run is finished all the same
            pass
    _close(env)
    return summary if env.rank == 0 else None


def _close(env: Any) -> None:
    """After the finish: every rank here before any tears down (rank 0 hosts the store), then the groups. A peer
    gone by now fails the barrier: the run is finished all the same (exit 0, the result written)."""
    import torch.distributed as dist

    try:
        dist.barrier()
        dist.destroy_process_group()
    except Exception as e:
        log.warning(f"the run finished; its closing barrier failed: {e}")
