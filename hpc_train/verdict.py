"""The verdicts of the one requeue decision, and the one way a rank leaves by one (torch-free)."""

from __future__ import annotations

import enum
import time
from typing import NoReturn

from hpc_train import leave as leave_process
from hpc_train import preempt, script
from hpc_train.task import Task


class Verdict(str, enum.Enum):
    """What the decision says every rank does (a str: it is what events and logs name)."""

    STOP = "stop"  # exit 1, no requeue
    REQUEUE = "requeue"  # exit 144: Slurm brings the job back (the local controller restarts in place)
    WAIT = "wait"  # a preemption whose requeue failed: stay alive until Slurm ends and requeues the job
    RELAUNCH = "relaunch"  # exit 145: the batch script's relay starts the step again inside the allocation
    REJOIN = "rejoin"  # cluster.in_process_restart: the survivors rejoin in their processes (never exits)
    FINISHED = "finished"  # a failure after the attempt's finish is on record: exit 0
    NONE = ""  # a rank that did not decide: it leaves as the verdict on record says

    # its value in f-strings and str() too (an Enum's own would say "Verdict.STOP", Python 3.11)
    __str__ = str.__str__
    __format__ = str.__format__


EXIT_CODES = {Verdict.STOP: 1, Verdict.RELAUNCH: preempt.IN_JOB_RESTART_EXIT_CODE, Verdict.FINISHED: 0}


def leave(task: Task, verdict: str, grace_s: float, kill_deadline: float = float("inf")) -> NoReturn:
    """Exit with the verdict's code, without joining a background checkpoint write that was given up on (it
    could hold the process for as long as the slow storage takes). WAIT: stay alive until Slurm kills the job at
    GraceTime's end (+ 60 s; KillWait defaults to 30 s), which requeues a preempted job; one that exits inside its
    grace time is not requeued."""
    task.pulse.stand_down()
    script.end_child(task.child)  # a script's process never outlives the rank that started it
    if verdict == Verdict.WAIT:
        start = task.pulse.received_at[0] if task.pulse.received_at else time.monotonic()
        until = min(kill_deadline, start + grace_s) + 60
        while time.monotonic() < until:
            time.sleep(1)
    leave_process.process(EXIT_CODES.get(Verdict(verdict), preempt.REQUEUE_EXIT_CODE))
