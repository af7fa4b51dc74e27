"""Stop signals: handlers that only record, a decision all ranks take together, and the requeue.

Slurm warns of the time limit with the --signal signal (USR2, not USR1: NCCL may install its own USR1
handler) and of preemption with SIGTERM to every task (or with the --signal signal when the cluster sets
preempt_send_user_signal). Either way the handler appends the signal's name and returns: no I/O, no
collectives, no logging inside a handler. The training loop calls `should_stop()` at each step
boundary; it all-reduces the flag so every rank saves the same step and exits together.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time

import torch
import torch.distributed as dist

# submitit's local controller restarts every task of a job when one exits with this code; on Slurm the
# same code marks "saved and requeued" in sacct's ExitCode column.
REQUEUE_EXIT_CODE = 144
STOP_SIGNALS = (signal.SIGUSR2, signal.SIGTERM)

received: list[str] = []  # names of the signals caught so far, in order; read by the loop
received_at: list[float] = []  # time.monotonic() of each, for the time left to save
last_beat = [time.monotonic()]  # the loop's heartbeat, read by job.py's hang watchdog


def beat() -> None:
    last_beat[0] = time.monotonic()


def injected(fault: str) -> bool:
    """Fault drills: HPC_TRAIN_FAULT=raise_at_start,kill_rank_during_save,hang (set with
    +cluster.env.HPC_TRAIN_FAULT=...). Each fires in the first attempt only unless its name ends in
    `_always`, so a drill shows the recovery."""
    faults = os.environ.get("HPC_TRAIN_FAULT", "").split(",")
    first_attempt = os.environ.get("SLURM_RESTART_COUNT", os.environ.get("HPC_TRAIN_ATTEMPT", "0")) in ("", "0")
    return f"{fault}_always" in faults or (fault in faults and first_attempt)


def _record(signum: int, frame: object) -> None:
    received_at.append(time.monotonic())
    received.append(signal.Signals(signum).name)


def save_fits(expected_save_s: float, signal_lead_s: float, grace_s: float) -> bool:
    """Collective: does a stop save of expected_save_s fit, on every rank, before Slurm's SIGKILL? The
    deadline runs from the first signal: signal_lead_s after a USR2 alone, else grace_s (preemption)."""
    budget = signal_lead_s if received and "SIGTERM" not in received else grace_s
    left = (received_at[0] + budget - time.monotonic()) if received_at else float("inf")
    flag = torch.tensor([1 if expected_save_s <= left else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def install_handlers() -> None:
    """Replace submitit's handlers (which checkpoint inside the handler, on rank 0 only)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, _record)


def should_stop() -> bool:
    """True on every rank if any rank caught a stop signal. One 4-byte all-reduce per step (~0.1 ms on gloo)."""
    flag = torch.tensor([1 if received else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def slurm_job_fate(job_id: str, restart_count: int) -> str:
    """What Slurm is doing with this job as the ranks stop: "running" (a time-limit warning or a
    preemption in its grace time: we requeue), "requeued" (an operator's `scontrol requeue`: COMPLETING
    with Restarts already incremented) or "cancelled" (scancel: COMPLETING, Restarts unchanged)."""
    proc = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=60)
    state = re.search(r"JobState=(\S+)", proc.stdout)
    restarts = re.search(r"Restarts=(\d+)", proc.stdout)
    if state is None or state.group(1) in ("RUNNING", "SUSPENDED", "PENDING", "REQUEUED"):
        return "running"  # unknown counts as running: requeueing a live run beats losing it
    if state.group(1) == "CANCELLED" or (restarts and int(restarts.group(1)) <= restart_count):
        return "cancelled"
    return "requeued"


def requeue_slurm_job(job_id: str, attempts: int = 4) -> str:
    """`scontrol requeue` this job; returns "" on success, else scontrol's last message.

    Retries (1, 2, 4 s) only when the controller did not answer: a preempted job is already being
    requeued by Slurm itself, scontrol then refuses at once, and that refusal is final and harmless.
    """
    err = ""
    for attempt in range(attempts):
        proc = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=60)
        if proc.returncode == 0:
            return ""
        err = (proc.stderr or proc.stdout).strip()
        if not any(word in err.lower() for word in ("timed out", "unable to contact", "connection refused")):
            break
        time.sleep(2**attempt)
    return err
