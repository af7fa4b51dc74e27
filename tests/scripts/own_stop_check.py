"""A function that checks for the stop itself (at.should_stop) and returns without at.step_end's stop save, as
a loop with its own evaluation boundary may: hpc_train then requeues from the last checkpoint. In attempt 0 it
sends itself SIGTERM (a preemption, as submitit's local controller forwards one) after step `signal_at`.

    PYTHONPATH=tests/scripts hpc-train submit fn._target_=own_stop_check.main +fn.kwargs.steps=12
"""

from __future__ import annotations

import os
import signal

import torch

from hpc_train.attempt import Attempt
from hpc_train.checkpoint import TrainState


def main(at: Attempt, steps: int = 12, signal_at: int = 7) -> dict | None:
    model = torch.nn.Linear(4, 1)
    state = TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    at.resume(state)
    while state.step < steps:
        state.step += 1
        if state.step == signal_at and at.env.restart_count == 0 and at.env.rank == 0:
            os.kill(os.getpid(), signal.SIGTERM)
        if state.step % 5 != 0 and at.should_stop():  # its own check, between step_end's
            return None
        at.step_end(state, steps)
    return at.finish(state)
