"""The run directory's lease: one live job owns a run (its rank 0 claims it before anything is loaded, saved or
deleted, and renews it from the watchdog thread); a second job on the same run refuses and leaves."""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from typing import Any

from hpc_train import journal, preempt, slurm, verdict
from hpc_train.paths import RunPaths, locked, write_atomic
from hpc_train.task import Task
from hpc_train.verdict import Verdict

log = logging.getLogger(__name__)


def read(paths: RunPaths) -> dict[str, Any] | None:
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


def write(paths: RunPaths, env: Any) -> None:
    now = time.time()
    record = {"job_id": env.job_id, "host": socket.gethostname(), "renewed_at": now}
    record["expires_at"] = now + preempt.LEASE_S
    write_atomic(paths.lease, json.dumps(record) + "\n")


def owner_active(lease: dict[str, Any], env: Any) -> bool | None:
    """Is the lease's job still queued or running? Slurm's answer (None when it gives none); a local
    owner by its controller's pid, on this host only."""
    owner = str(lease["job_id"])
    if env.executor == "slurm":
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


def claim(paths: RunPaths, env: Any) -> dict[str, Any] | None:
    """Rank 0: make this job the run directory's owner, or return the lease of the live job that owns it.
    Two jobs on one run (two submits that queued one trial, an orphan of a lost record) both append to one
    journal, spend its budgets twice and delete each other's checkpoints by retention: the second to start
    refuses instead. Under a lock, so two starting at once do not both take it; after the watchdog starts,
    which ends a wait on a lock a dead NFS client still holds."""
    with locked(paths.run_dir / ".lease.lock", wait_s=5):  # a dead NFS holder: decide unlocked after 5 s
        lease = read(paths)
        active = owner_active(lease, env) if lease and lease["job_id"] != env.job_id else None
        if not preempt.lease_verdict(lease, env.job_id, time.time(), active):
            return lease
        write(paths, env)
    return None


def renew(paths: RunPaths, env: Any) -> None:
    """The watchdog thread, every LEASE_RENEW_S on rank 0: extend this job's lease, never another's (one
    that took it after Slurm said this job was gone, or this job missed renewals for 60 s while Slurm did not
    answer). Never blocks: a busy lock, or a lease it cannot read (ESTALE), waits a turn."""
    try:
        with locked(paths.run_dir / ".lease.lock", wait=False):
            lease = read(paths)
            if lease is None or str(lease.get("job_id")) == env.job_id:
                write(paths, env)
            else:
                log.warning(f"job {lease.get('job_id')} took this run's lease")
    except (OSError, ValueError):  # a full disk or a busy lock: the next turn, 30 s on
        pass


def own_run_dir(paths: RunPaths, env: Any, task: Task) -> None:
    """Collective, before anything is loaded, saved or deleted: rank 0 claims the lease; when another live
    job owns the run directory every rank leaves (exit 1, no requeue) and rank 0 says which job owns it."""
    import torch.distributed as dist

    found: list[Any] = [claim(paths, env) if env.rank == 0 else None]
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
        log.error(
            f"job {env.job_id} refuses to train: job {lease['job_id']} (on {lease.get('host')}) owns "
            f"{paths.run_dir} and is still queued or running; this job leaves its checkpoints and budgets "
            f"alone. Follow the owner with hpc-train status {paths.run_dir}; if it is gone, hpc-train resume "
            f"{paths.run_dir} starts the run again"
        )
    verdict.leave(task, Verdict.STOP, 0.0)
