"""A training function that finishes while a thread of its own is still inside gloo all_reduce calls: what
DDP's reducer, a user's metrics thread or a background evaluation can leave behind. hpc_train must still
leave with exit 0 (hpc_train/leave.py); through the interpreter's shutdown this aborted 4 of 4 times.

    PYTHONPATH=tests/scripts hpc-train submit fn._target_=busy_finish.main +fn.kwargs.steps=3
"""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist

from hpc_train.attempt import Attempt
from hpc_train.checkpoint import TrainState


def main(at: Attempt, steps: int = 3) -> dict:
    model = torch.nn.Linear(4, 1)
    state = TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    at.resume(state)
    # One group of one rank each, made by every rank (new_group is collective): each thread spins alone.
    solo = [dist.new_group([r], backend="gloo") for r in range(at.env.world_size)][at.env.rank]
    spinning = threading.Event()

    def spin() -> None:
        t = torch.ones(1 << 16)
        while True:
            dist.all_reduce(t, group=solo)
            spinning.set()

    threading.Thread(target=spin, name="busy-gloo", daemon=True).start()
    spinning.wait(30)
    while state.step < steps:
        state.step += 1
        if at.step_end(state, steps):
            return {}
    return at.finish(state, spinning=spinning.is_set())
