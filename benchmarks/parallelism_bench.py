"""DDP vs FSDP2 on 4 ranks (gloo, CPU): per-rank parameter + gradient + optimizer memory and tokens/s.

    .venv/bin/python benchmarks/parallelism_bench.py            # model=small, 30 steps each

Memory is counted from the tensors each rank holds after an optimizer step (local shards under FSDP2),
so it is exact rather than an allocator reading. Target: FSDP2's per-rank state <= 1/4 of DDP's + 10%.
FSDP2 + tensor parallel is not built yet. Never asserts.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

from hpc_train import data
from hpc_train.config import DataConfig, ModelConfig
from hpc_train.model import GPT

WORLD, STEPS, BATCH = 4, 30, 4
SMALL = ModelConfig(seq_len=128, d_model=256, n_layers=4, n_heads=8)


def local_bytes(t: torch.Tensor) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def worker(rank: int, mode: str, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29561" if mode == "ddp" else "29562")
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(SMALL)
    if mode == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (WORLD,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        net = fully_shard(model, mesh=mesh)
    else:
        net = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    corpus = data.synthetic_corpus(DataConfig(), SMALL.vocab_size)
    t0 = 0.0
    for step in range(STEPS):
        x, y = data.batch(corpus, step, rank, WORLD, BATCH, SMALL.seq_len)
        loss = net(x, y)
        opt.zero_grad(set_to_none=False)  # keep grads allocated: they count
        loss.backward()
        opt.step()
        if step == 0:
            t0 = time.monotonic()
    elapsed = time.monotonic() - t0
    params = sum(local_bytes(p) for p in model.parameters())
    grads = sum(local_bytes(p.grad) for p in model.parameters() if p.grad is not None)
    optim = sum(local_bytes(v) for s in opt.state.values() for v in s.values() if torch.is_tensor(v))
    if rank == 0:
        out[mode] = {"params": params, "grads": grads, "optim": optim,
                     "tokens_per_s": (STEPS - 1) * BATCH * SMALL.seq_len * WORLD / elapsed, "loss": loss.item()}
    dist.destroy_process_group()


def main() -> None:
    results = mp.Manager().dict()
    for mode in ("ddp", "fsdp"):
        mp.spawn(worker, args=(mode, results), nprocs=WORLD)
    n = sum(p.numel() for p in GPT(SMALL).parameters())
    print(f"model=small ({n / 1e6:.1f} M params), {WORLD} ranks, batch {BATCH} x {SMALL.seq_len} per rank, gloo on CPU")
    print(f"{'':8s} {'params MB':>10s} {'grads MB':>9s} {'AdamW MB':>9s} {'total MB':>9s} {'tokens/s':>9s} {'loss@30':>8s}")
    for mode in ("ddp", "fsdp"):
        r = results[mode]
        total = (r["params"] + r["grads"] + r["optim"]) / 1e6
        print(f"{mode:8s} {r['params'] / 1e6:10.2f} {r['grads'] / 1e6:9.2f} {r['optim'] / 1e6:9.2f} {total:9.2f} "
              f"{r['tokens_per_s']:9,.0f} {r['loss']:8.4f}")
    ddp_total = sum(results["ddp"][k] for k in ("params", "grads", "optim"))
    fsdp_total = sum(results["fsdp"][k] for k in ("params", "grads", "optim"))
    print(f"FSDP2 / DDP per-rank state: {fsdp_total / ddp_total:.3f} (target <= 0.25 + 10% = 0.275)")
    print("FSDP2 + tensor parallel: not built yet")


if __name__ == "__main__":
    main()
