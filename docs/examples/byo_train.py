"""Bring your own training function: a small DDP regression that hpc_train submits, places, stops
at a step boundary when Slurm warns or preempts, requeues and resumes.

    PYTHONPATH=docs/examples hpc-train submit fn._target_=byo_train.main
    PYTHONPATH=docs/examples hpc-train submit fn._target_=byo_train.main +fn.kwargs.steps=2000 \\
        cluster=dev cluster.nodes=2

hpc_train calls main(ctx, **fn.kwargs) on every rank; see hpc_train/byo.py for what ctx offers.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from hpc_train.train import params_sha256


def main(ctx, steps: int = 300, lr: float = 0.05, save_every: int = 100, step_s: float = 0.0) -> dict:
    torch.manual_seed(0)  # same initial weights on every rank
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1)).to(ctx.device)
    net = DDP(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    step, _ = ctx.load(model, optimizer)  # (0, {}) on the first attempt
    truth = torch.randn(16, 1, generator=torch.Generator().manual_seed(1))
    if ctx.env.rank == 0:
        print(f"byo_train: rank 0 of {ctx.env.world_size} on {ctx.env.nodes}, from step {step}", flush=True)
    while step < steps:
        t0 = time.monotonic()
        # This rank's batch is a function of (step, rank): a resumed run sees the same data.
        x = torch.randn(32, 16, generator=torch.Generator().manual_seed(step * ctx.env.world_size + ctx.env.rank))
        loss = F.mse_loss(net(x.to(ctx.device)), (x @ truth).to(ctx.device))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step += 1
        time.sleep(max(0.0, step_s - (time.monotonic() - t0)))  # step_s: a floor per step, for drills
        if ctx.should_stop():  # every rank gets the same answer
            ctx.save(step, model, optimizer)
            return {}  # hpc_train requeues; the next attempt resumes from this checkpoint
        if step % save_every == 0:
            ctx.save(step, model, optimizer)
    if ctx.step != step:
        ctx.save(step, model, optimizer)
    return {"final_loss": loss.item(), "params_sha256": params_sha256(model)}  # equal hashes: equal weights
