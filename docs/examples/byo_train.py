"""Bring your own training function: a small DDP regression (dropout; AdamW with decayed weights and
undecayed biases, nanoGPT's two groups) that hpc_train submits, places, stops at a step boundary when
Slurm warns or preempts, requeues and resumes.

    PYTHONPATH=docs/examples hpc-train submit fn._target_=byo_train.main
    PYTHONPATH=docs/examples hpc-train submit fn._target_=byo_train.main +fn.kwargs.steps=2000 \\
        cluster=dev cluster.nodes=2

hpc_train calls main(at, **fn.kwargs) on every rank with an Attempt (hpc_train/attempt.py): the same
object, and the same loop shape, as its own trainer (hpc_train/train.py).
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from hpc_train.attempt import Attempt
from hpc_train.checkpoint import TrainState
from hpc_train.train import params_sha256


def main(at: Attempt, steps: int = 300, lr: float = 0.01, step_s: float = 0.0) -> dict | None:
    torch.manual_seed(0)  # same initial weights on every rank
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Dropout(0.1), torch.nn.Linear(64, 1)
    ).to(at.device)
    net = DDP(model)
    decay = [p for p in model.parameters() if p.dim() >= 2]  # weights decay, biases do not
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": 0.1},
            {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=lr,
    )
    state = TrainState(model, optimizer)  # step, model, optimizer and this rank's RNG go into each checkpoint
    at.resume(state)  # newest checkpoint that verifies; step 0 on the first attempt
    truth = torch.randn(16, 1, generator=torch.Generator().manual_seed(1))
    at.say(f"byo_train: {at.env.world_size} ranks on {at.env.nodes}, from step {state.step}")
    loss = torch.tensor(float("nan"))
    while state.step < steps:
        t0 = time.monotonic()
        # This rank's batch is a function of (step, rank): a resumed run sees the same data.
        g = torch.Generator().manual_seed(state.step * at.env.world_size + at.env.rank)
        x = torch.randn(32, 16, generator=g)
        loss = F.mse_loss(net(x.to(at.device)), (x @ truth).to(at.device))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        state.step += 1
        time.sleep(max(0.0, step_s - (time.monotonic() - t0)))  # step_s: a floor per step, for drills
        if at.step_end(state, steps):  # collective: a stop signal -> this step saved; hpc_train requeues
            return None
    return at.finish(state, final_loss=loss.item(), params_sha256=params_sha256(model))  # equal hashes: equal weights
