"""One attempt protocol, whoever runs the loop: the built-in trainer and a training function (attempt.py), or a
user's script (supervisor.py). What an attempt records and agrees on has one owner here:

    start_event   the attempt's `start`: its world, nodes, each rank's pid, what it resumed from
    time_left     at a stop: the seconds until Slurm's SIGKILL and why (time limit or preemption), agreed by all
    signal_event  the stop's `signal`: the signals, the reason, the time left
    finish        summary.json (whole or absent) and the `finish` event, once, by rank 0

Collectives where said (every rank calls them); the journal is written by rank 0 only.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import torch
import torch.distributed as dist

from hpc_train import journal, preempt
from hpc_train.env import RankEnv
from hpc_train.paths import RunPaths, write_atomic
from hpc_train.reasons import Reason
from hpc_train.task import Pulse

log = logging.getLogger(__name__)


def gather_ints(env: RankEnv, values: list[int]) -> list[list[int]]:
    """Collective: every rank's `values` (the same length on each), in rank order."""
    out = [torch.zeros(len(values), dtype=torch.int64) for _ in range(env.world_size)]
    dist.all_gather(out, torch.tensor(values, dtype=torch.int64))
    return [[int(v) for v in t] for t in out]


def start_event(
    env: RankEnv,
    paths: RunPaths,
    step: int,
    *,
    target: str,
    launched_at: float,
    pids: list[int],
    resumed_from: str | None,
    **fields: Any,
) -> None:
    """Rank 0 records the attempt's start: what ran (target: a function's dotted name, or "script"), its world,
    which node each rank is on, each rank's pid (`hpc-train chaos kill-rank`, post-mortems), what it resumed from."""
    if env.rank != 0:
        return
    journal.log(
        paths.run_dir,
        journal.START,
        step,
        env.job_id,
        env.restart_count,
        resumed_from=resumed_from,
        target=target,
        world_size=env.world_size,
        nodes=list(env.nodes),
        launched_at=launched_at,
        pids=pids,
        rank_nodes=[env.nodes[r // env.local_world_size] for r in range(env.world_size)],
        **fields,
    )


def time_left(
    env: RankEnv, cluster: Any, pulse: Pulse, launched_at: float, end_at: float = 0.0
) -> tuple[float, Reason]:
    """Collective: (seconds until Slurm's SIGKILL, why) from the first stop signal any rank caught, the same on every
    rank. A USR2 near the allocation's end is the time-limit warning (TIME_LIMIT: cluster.signal_lead_s left);
    anything else, a USR2 under preempt_send_user_signal included, is a preemption (PREEMPT: cluster.preempt_grace_s
    left); one rank's SIGTERM makes it a preemption. The end is Slurm's EndTime asked again now (an administrator may
    have shortened the limit since the start; end_at: the one read at the attempt's start, 0 unknown), never later
    than it: rank 0 asks, every rank gets its answer (preempt.time_left judges)."""
    end = torch.tensor(
        preempt.slurm_end(env.executor, env.job_id) if env.rank == 0 else (0.0, 0.0),
        dtype=torch.float64,
    )
    dist.broadcast(end, src=0)
    allocated_at = float(os.environ.get("HPC_TRAIN_ALLOCATED_AT") or launched_at)
    left, code = preempt.time_left(pulse, cluster, float(end[0]), bool(end[1]), end_at, allocated_at)
    t = torch.tensor([-left, code], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the least time left, the strongest reason
    return -float(t[0]), Reason.TIME_LIMIT if int(t[1]) == 1 else Reason.PREEMPT


def signal_event(
    env: RankEnv, paths: RunPaths, step: int, pulse: Pulse, reason: Reason, left_s: float, **fields: Any
) -> None:
    """Rank 0 records the stop every rank agreed on: the signals this rank received, the reason, the time left."""
    if env.rank == 0:
        journal.log(
            paths.run_dir,
            journal.SIGNAL,
            step,
            env.job_id,
            env.restart_count,
            signals=list(pulse.received),
            reason=reason,
            left_s=round(left_s, 2),
            **fields,
        )


def finish(env: RankEnv, paths: RunPaths, step: int | None, **summary: Any) -> dict[str, Any]:
    """The attempt finished the run: rank 0 writes summary.json (whole or absent: readers poll for it) and the
    `finish` event, and says so on the run's console. step: the final step (None: a script that told none).
    Returns the summary, on every rank."""
    out = {"final_step": step, **summary}
    if env.rank == 0:
        write_atomic(paths.summary, json.dumps(out, indent=1, default=str) + "\n")
        journal.log(paths.run_dir, journal.FINISH, step or 0, env.job_id, env.restart_count, **out)
        log.info("finished at step %s: %s", step, json.dumps(out, default=str))
    return out
