"""One `Task` per rank process: what the job side knows of itself beyond its RankEnv, made by job.run_job and
handed to the rendezvous, the watchdog, the failure path and the in-process rejoin (torch-free)."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class Task:
    # This task's RankEnv once placed by the rendezvous (ranks in topology order); None before: the failure path
    # and the watchdog then name Slurm's task numbering.
    placed: Any = None
    # This process claimed its attempt's failure: a second failing thread (the watchdog beside the main one) must
    # not end the process under the deciding one.
    deciding: bool = False
    # cluster.in_process_restart: this process's lock of its attempt's paths.alive file (rejoin.plan_rejoin reads
    # a free lock as a dead rank).
    alive_fd: int | None = None
    # checkpoint.memory_every_steps: this attempt's live memory tier (Attempt.build sets it), whose copies the
    # failure path abandons and cleans by the verdict (failure.clean_memory).
    memory: Any = None
