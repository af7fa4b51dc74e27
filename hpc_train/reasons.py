"""The words of the stop path, each an Enum of str (torch-free, imports nothing): why an attempt stopped (Reason)
and what Slurm is doing with its job as its ranks stop (Fate). A str: events and logs hold the value as it was."""

from __future__ import annotations

import enum


class Reason(str, enum.Enum):
    """Why an attempt stopped: what the requeue is counted under (journal.BUDGET_KEYS)."""

    PREEMPT = "preempt"  # SIGTERM, a job Slurm preempts (PreemptTime set), or a USR2 far from the time limit
    TIME_LIMIT = "time_limit"  # Slurm's USR2 warning near the allocation's end (cluster.signal_lead_s)
    FAILURE = "failure"  # a rank raised, hung, or its script exited non-zero
    NODE_HEALTH = "node_health"  # the preflight found a sick node: bounded by exclusions, not a requeue budget

    __str__ = str.__str__  # its value in f-strings and str(), not "Reason.PREEMPT" (Python 3.11)
    __format__ = str.__format__


STOP_SIGNALLED = (Reason.PREEMPT, Reason.TIME_LIMIT)  # a stop signal's reasons: the stop path's shorter Slurm calls


class Fate(str, enum.Enum):
    """What Slurm is doing with the job as its ranks stop (slurm.parse_fate, journal.local_fate)."""

    RUNNING = "running"  # a time-limit warning, the limit itself, a preemption in its grace time: we requeue
    REQUEUED = "requeued"  # Restarts passed ours: Slurm requeued it (a node failure, a preemption, scontrol requeue)
    CANCELLED = "cancelled"  # scancel or hpc-train cancel
    BATCH_HOST_LOST = "batch_host_lost"  # a hot-spares (--no-kill) job whose batch script's node failed
    UNKNOWN = "unknown"  # scontrol did not answer: taken as running, since requeueing a live run beats losing it

    __str__ = str.__str__
    __format__ = str.__format__


class Action(str, enum.Enum):
    """What the one requeue decision has the deciding rank do (preempt.decide, decision.decide)."""

    STOP = "stop"  # the run ends here: no requeue
    SLURM = "slurm"  # Slurm requeues the job itself (fate "requeued"): no budget spent, no scontrol requeue
    REQUEUE = "requeue"  # hpc_train's own scontrol requeue; refused: a preemption waits for Slurm's, else a stop
    RELAUNCH = "relaunch"  # hot spares: the batch script's relay starts the step again inside the allocation
    REJOIN = "rejoin"  # cluster.in_process_restart: the survivors rejoin in their processes

    __str__ = str.__str__
    __format__ = str.__format__
