"""The trainer's tokens/s against a plain torch loop of the same model and batch, on CPU, in one run.

    .venv/bin/python benchmarks/trainer_bench.py                 # model=small, 200 steps, 1 rank
    .venv/bin/python benchmarks/trainer_bench.py --steps 100

Plain loop: this process, the same GPT, batch, AdamW and thread count; nothing else. hpc_train:
`hpc-train submit` on the local executor with 1 rank, checkpoints every 50 steps (async) and
everything else the product does per step (DDP, the all-ranks stop check, the watchdog heartbeat).
Both are timed from the end of their first step to the end of the last. Target: ratio >= 0.97.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from hpc_train import data
from hpc_train.config import DataConfig, ModelConfig
from hpc_train.model import GPT

HPC_TRAIN = str(Path(sys.executable).parent / "hpc-train")


def plain_loop(model_cfg: ModelConfig, steps: int, batch: int, threads: int) -> float:
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = GPT(model_cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    sampler = data.open_sampler(DataConfig(), model_cfg.seq_len, model_cfg.vocab_size)
    t_first = 0.0
    for step in range(steps):
        x, y = sampler.next_batch(0, 1, batch)
        loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step == 0:
            t_first = time.monotonic()
    return (steps - 1) * batch * model_cfg.seq_len / (time.monotonic() - t_first)


def ours(steps: int, batch: int, out: Path) -> float:
    subprocess.run(
        [
            HPC_TRAIN,
            "submit",
            "model=small",
            f"train.steps={steps}",
            f"train.batch_seqs_per_rank={batch}",
            "cluster.tasks_per_node=1",
            "checkpoint.every_steps=50",
            f"out_dir={out}",
            "name=bench",
        ],
        check=True,
        capture_output=True,
    )
    events = [json.loads(line) for line in (out / "bench-1" / "events.jsonl").read_text().splitlines()]
    first = next(e for e in events if e["event"] == "first_step")
    finish = next(e for e in events if e["event"] == "finish")
    seq_len = ModelConfig(**{"seq_len": 128, "d_model": 256, "n_layers": 4, "n_heads": 8}).seq_len
    return (steps - 1) * batch * seq_len / (finish["time"] - first["time"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args()
    small = ModelConfig(seq_len=128, d_model=256, n_layers=4, n_heads=8)
    threads = torch.get_num_threads()
    out = Path(tempfile.mkdtemp(prefix="trainer_bench_"))
    # plain, ours, plain again: the machine is noisy, so show the spread instead of one lucky figure
    plain_before = plain_loop(small, args.steps, args.batch, threads)
    ours_tps = ours(args.steps, args.batch, out)
    plain_after = plain_loop(small, args.steps, args.batch, threads)
    plain_tps = (plain_before + plain_after) / 2
    print(
        f"model=small ({sum(p.numel() for p in GPT(small).parameters()) / 1e6:.1f} M params), batch {args.batch} x "
        f"{small.seq_len} tokens, {args.steps} steps, {threads} threads, 1 rank"
    )
    print(f"plain torch loop:  {plain_tps:10,.0f} tokens/s  (before {plain_before:,.0f}, after {plain_after:,.0f})")
    print(
        f"hpc_train:         {ours_tps:10,.0f} tokens/s  = {ours_tps / plain_tps:.3f}x the plain loop (target >= 0.97)"
    )


if __name__ == "__main__":
    main()
