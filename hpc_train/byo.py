"""Bring your own training function: hpc_train submits, places, signals and requeues; you train.

    hpc-train submit fn._target_=my_pkg.train.main +fn.kwargs.steps=500 cluster=dev cluster.nodes=2

`my_pkg.train.main(ctx, **fn.kwargs)` runs on every rank once torch.distributed is up (placed ranks,
torchrun's variables exported, the hang watchdog armed). It owns its model and loop and uses `ctx`:

    step, extra = ctx.load(model, optimizer)   # newest committed checkpoint, or (0, {})
    while step < steps:
        ...one step...
        step += 1
        if ctx.should_stop():                  # collective, once per step: the time limit or a preemption
            ctx.save(step, model, optimizer)   # then return; hpc_train requeues the job
            return
    ctx.save(step, model, optimizer)
    return {"final_loss": ...}                 # -> summary.json

A worked example is docs/examples/byo_train.py.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hpc_train import checkpoint, preempt
from hpc_train.config import RunConfig
from hpc_train.env import RankEnv
from hpc_train.metrics import log_event
from hpc_train.train import device_and_mesh, start_fields


@dataclass
class Context:
    env: RankEnv  # this rank after placement: rank, local_rank, world_size, node_rank, nodes
    mesh: Any  # torch DeviceMesh ("dp", "tp"); tp = train.tp, inside a node
    device: torch.device  # this rank's GPU, else CPU
    run_dir: Path
    cfg: RunConfig  # the frozen config; cfg.checkpoint applies to ctx.save
    step: int = 0  # the last step saved or loaded
    stopped: bool = False  # should_stop() said True: the job requeues when the function returns

    def event(self, name: str, step: int, **fields: Any) -> None:
        if self.env.rank == 0:
            log_event(self.run_dir, name, step, self.env.job_id, self.env.restart_count, **fields)

    def should_stop(self) -> bool:
        """Collective: call on every rank at each step boundary. True once any rank got the time-limit
        warning or a preemption signal; every rank gets the same answer. Also the watchdog's heartbeat."""
        preempt.beat()
        if not self.stopped and preempt.should_stop():
            self.stopped = True
            self.event("signal", self.step, signals=list(preempt.received))
        return self.stopped

    def save(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             extra: dict[str, Any] | None = None) -> Path:
        """Collective: a committed DCP checkpoint of model + optimizer (+ this rank's `extra` tensors and
        plain values), retention by cfg.checkpoint. Returns its folder."""
        root = self.run_dir / "checkpoints"
        reason = "stop" if self.stopped else "periodic"
        pending = checkpoint.start_save(root, step, model, optimizer, {**(extra or {}), "step": step}, reason)
        save_s = checkpoint.commit(pending, root, self.cfg.checkpoint)
        self.step = step
        self.event("checkpoint_committed", step, path=str(pending.folder), reason=reason, save_s=round(save_s, 4),
                   stall_s=round(pending.stall_s, 4))
        return pending.folder

    def load(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[int, dict[str, Any]]:
        """Collective: load the newest committed checkpoint that verifies into model and optimizer.
        Returns (its step, this rank's extra), or (0, {}) on a fresh run."""
        root = self.run_dir / "checkpoints"
        folder, extra = checkpoint.resume(root, model, optimizer, lambda why: self.event("checkpoint_skipped", 0, reason=why))
        self.step = int(extra.pop("step")) if folder is not None else 0
        return self.step, extra


def resolve(target: str) -> Any:
    module, name = target.rsplit(".", 1)
    fn = getattr(importlib.import_module(module), name, None)
    if not callable(fn):
        raise ValueError(f"fn._target_={target!r}: {module} has no function {name!r}")
    return fn


def run(cfg: RunConfig, env: RankEnv, run_dir: Path, launched_at: float) -> tuple[str, int]:
    """The built-in trainer's contract for a user's function: ("finished" | "requeue", step)."""
    fn = resolve(cfg.fn._target_)
    device, mesh = device_and_mesh(env.world_size, cfg.train.tp)
    ctx = Context(env, mesh, device, run_dir, cfg)
    newest = checkpoint.committed(run_dir / "checkpoints")  # what ctx.load will most likely pick
    ctx.event("start", checkpoint.step_of(newest[-1]) if newest else 0, target=cfg.fn._target_,
              **start_fields(env, launched_at))
    result = fn(ctx, **cfg.fn.kwargs)
    if ctx.stopped:
        return "requeue", ctx.step
    summary = {"final_step": ctx.step, **(result if isinstance(result, dict) else {"result": result})}
    if env.rank == 0:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    ctx.event("finish", ctx.step, **summary)
    return "finished", ctx.step
