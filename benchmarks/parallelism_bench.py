"""DDP vs FSDP2 vs FSDP2 x TP on 4 ranks (gloo, CPU): per-rank memory and tokens/s in one table.

    .venv/bin/python benchmarks/parallelism_bench.py            # model=small, 30 steps each

The three run the trainer's own parallelize() and clip_grad_norm() on the same global batch (16
sequences per step: 4 x 4, or 2 data-parallel groups x 8 under tp=2). Memory is counted from the tensors
each rank holds after an optimizer step (local shards under FSDP2 and TP), so it is exact rather than an
allocator reading; peak RSS (rank 0's process: ~300 MB of it is torch itself) is the OS's view.
Target: FSDP2's per-rank state <= 1/4 of DDP's + 10%. Never asserts.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hpc_train import data
from hpc_train.attempt import device_and_mesh
from hpc_train.config import DataConfig, ModelConfig, TrainConfig
from hpc_train.model import GPT
from hpc_train.train import clip_grad_norm, parallelize, peak_memory_mb

WORLD, STEPS, GLOBAL_BATCH = 4, 30, 16
SMALL = ModelConfig(seq_len=128, d_model=256, n_layers=4, n_heads=8)
MODES = {
    "ddp": TrainConfig(parallelism="ddp"),
    "fsdp": TrainConfig(parallelism="fsdp"),
    "fsdp+tp2": TrainConfig(parallelism="fsdp", tp=2),
}


def local_bytes(t: torch.Tensor) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def worker(rank: int, mode: str, port: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    tc = MODES[mode]
    _, mesh = device_and_mesh(WORLD, tc.tp)
    dp_rank, dp_size = mesh["dp"].get_local_rank(), mesh["dp"].size()
    torch.manual_seed(0)
    model = GPT(SMALL)
    net = parallelize(model, tc, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sampler = data.open_sampler(DataConfig(), SMALL.seq_len, SMALL.vocab_size)
    t0 = 0.0
    for step in range(STEPS):
        x, y = sampler.next_batch(dp_rank, dp_size, GLOBAL_BATCH // dp_size)
        loss = net(x, y)
        opt.zero_grad(set_to_none=False)  # keep grads allocated: they count
        loss.backward()
        clip_grad_norm(model, 1.0)
        opt.step()
        if step == 0:
            t0 = time.monotonic()
    elapsed = time.monotonic() - t0
    mean_loss = loss.detach().reshape(1)
    dist.all_reduce(mean_loss)  # a tp group's ranks hold the same loss: the mean over all ranks is dp's
    params = sum(local_bytes(p) for p in model.parameters())
    grads = sum(local_bytes(p.grad) for p in model.parameters() if p.grad is not None)
    optim = sum(local_bytes(v) for s in opt.state.values() for v in s.values() if torch.is_tensor(v))
    if rank == 0:
        out[mode] = {
            "params": params,
            "grads": grads,
            "optim": optim,
            "tokens_per_s": (STEPS - 1) * GLOBAL_BATCH * SMALL.seq_len / elapsed,
            "loss": mean_loss.item() / WORLD,
            "peak_rss_mb": peak_memory_mb(torch.device("cpu")),
        }
    dist.destroy_process_group()


def main() -> None:
    results = mp.Manager().dict()
    for k, mode in enumerate(MODES):
        mp.spawn(worker, args=(mode, 29561 + k, results), nprocs=WORLD)
    n = sum(p.numel() for p in GPT(SMALL).parameters())
    print(
        f"model=small ({n / 1e6:.1f} M params), {WORLD} ranks, {GLOBAL_BATCH} x {SMALL.seq_len} tokens per step, "
        f"gloo on CPU, 1 thread per rank"
    )
    print(
        f"{'':9s} {'dp x tp':>7s} {'params MB':>10s} {'grads MB':>9s} {'AdamW MB':>9s} {'total MB':>9s} "
        f"{'peak RSS MB':>11s} {'tokens/s':>9s} {'loss@30':>8s}"
    )
    for mode, tc in MODES.items():
        r = results[mode]
        total = (r["params"] + r["grads"] + r["optim"]) / 1e6
        print(
            f"{mode:9s} {f'{WORLD // tc.tp} x {tc.tp}':>7s} {r['params'] / 1e6:10.2f} {r['grads'] / 1e6:9.2f} "
            f"{r['optim'] / 1e6:9.2f} {total:9.2f} {r['peak_rss_mb']:11.0f} {r['tokens_per_s']:9,.0f} {r['loss']:8.4f}"
        )
    state = {m: sum(results[m][k] for k in ("params", "grads", "optim")) for m in MODES}
    print(
        f"FSDP2 / DDP per-rank state: {state['fsdp'] / state['ddp']:.3f} (target <= 0.25 + 10% = 0.275); "
        f"FSDP2 x TP / DDP: {state['fsdp+tp2'] / state['ddp']:.3f}"
    )


if __name__ == "__main__":
    main()
