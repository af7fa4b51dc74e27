"""The hang watchdog: a daemon thread per rank that watches the loop's heartbeat (a hung collective never returns,
and no signal arrives), renews rank 0's lease, and decides at a SIGTERM whose batch host was lost."""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from hpc_train import failure, lease, preempt, requeue, slurm
from hpc_train.paths import RunPaths
from hpc_train.reasons import Fate
from hpc_train.task import Pulse, Task

log = logging.getLogger(__name__)


def start(limit_s: float, paths: RunPaths, env: Any, task: Task) -> None:
    """A hung collective never returns, and no signal arrives. A daemon thread watches the loop's
    heartbeat; past `limit_s` it dumps every thread's stack to this rank's log, records the failure,
    requeues within the failure budget and ends the process, so the job fails fast instead of holding
    its nodes until the time limit. (gloo and NCCL ops release the GIL, so the thread runs.)"""
    env0 = env

    def watch() -> None:
        renewed, asked = time.monotonic(), ""
        while time.monotonic() - task.pulse.last_beat < limit_s:
            time.sleep(min(5.0, limit_s / 10))
            now = task.placed or env0  # an in-process restart rejoins under another rank and attempt
            if now.rank == 0 and time.monotonic() - renewed >= preempt.LEASE_RENEW_S:
                lease.renew(paths, now)
                renewed = time.monotonic()
            if not asked and blocked_at_term(task.pulse) and (asked := batch_host_lost(now)) == "lost":
                why = "the batch script's node was lost: Slurm ended the job while this rank waited in a collective"
                log.warning(f"{why}; deciding now")
                failure.log_fail(paths, now, task, why)
                failure.leave_by(task, *failure.after_failure(paths, now, task, RuntimeError(why)), now)
        env = task.placed or env0
        log.warning(f"no step finished in train.watchdog_s={limit_s:.0f} s: hang; stacks follow")
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        failure.log_fail(paths, env, task, f"hang: no step finished in train.watchdog_s={limit_s:.0f} s")
        failure.leave_by(task, *failure.after_failure(paths, env, task, hang=True), env)

    task.pulse.beat()
    threading.Thread(target=watch, daemon=True, name="hpc_train-watchdog").start()


def blocked_at_term(pulse: Pulse) -> bool:
    """A SIGTERM came and the loop has not beaten since (Attempt.should_stop beats before it all-reduces the stop
    flag): the main thread is blocked, not saving for the stop, which the watchdog must not cut short."""
    if "SIGTERM" not in pulse.received:
        return False
    return pulse.last_beat < pulse.received_at[pulse.received.index("SIGTERM")]


def batch_host_lost(env: Any) -> str:
    """At a SIGTERM, in the watchdog thread (the main one blocked in a collective on a peer that died with no
    reset: a crashed node): has a spares job lost its batch script's node? "lost", "alive" (Slurm said not: not
    asked again), "" (no evidence yet: asked again at the next poll). Only with the relay's beat silent
    (requeue.relay_silent_s: no Slurm call otherwise, as a preemption TERMs every rank) is Slurm asked (one 10 s try).
    Slurm ends such a --no-kill job without a requeue and SIGKILLs the ranks after KillWait (30 s by default), so
    the watchdog decides then: a requeue as a failure, where the blocked main thread would have died undecided."""
    folder, job_id = os.environ.get("SUBMITIT_FOLDER"), os.environ.get("SLURM_JOB_ID")
    if env.executor != "slurm" or not (folder and job_id and os.environ.get("HPC_TRAIN_STEP_ARGS")):
        return "alive"
    if not requeue.relay_silent_s(Path(folder), job_id):
        return ""
    restarts = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
    return "lost" if slurm.job_fate(env.job_id, restarts, slurm.STOP_FATE) == Fate.BATCH_HOST_LOST else "alive"
