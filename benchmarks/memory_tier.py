"""The checkpoint tier in memory (checkpoint.memory_every_steps) against the disk, side by side in one run.

    .venv/bin/python benchmarks/memory_tier.py                      # model=tiny, 40 steps, 64 MiB save
    .venv/bin/python benchmarks/memory_tier.py --model small --steps 60 --mib 256

Prints (never asserts):
  - the trainer's median and mean wall time per step on the local executor (2 ranks, one node: the own copy only)
    with checkpoint.memory_every_steps=1 and with it off, the same run otherwise, and the overhead (aim <= 5%)
  - one memory save (torch.save to bytes, sha256, the own copy into /dev/shm, the buddy exchange over gloo and
    the buddy copy; 2 gloo ranks as 2 "nodes") against one synchronous disk save (checkpoint.start_save +
    commit: DCP files fsynced, hashed, COMMITTED) of the same state, in seconds (median of --repeats)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HPC_TRAIN = str(Path(sys.executable).parent / "hpc-train")


def step_times(out: Path, name: str, steps: int, model: str, memory_every_steps: int) -> list[float]:
    """A local run's wall seconds per step: the time between consecutive metrics.jsonl rows (one every step), so
    the step_end work (the memory copy) counts, which step_time_s (the step itself) leaves out; the first 5
    (warm-up) left out."""
    args = [f"train.steps={steps}", f"model={model}", "train.log_every_steps=1", f"checkpoint.every_steps={steps}"]
    args += [f"checkpoint.memory_every_steps={memory_every_steps}", f"out_dir={out}", f"name={name}"]
    proc = subprocess.run([HPC_TRAIN, "submit", "cluster=local", *args], capture_output=True, text=True)
    run_dir = next(out.glob(f"{name}-*"), None)
    if proc.returncode or run_dir is None:
        raise SystemExit(f"the {name} run failed: {proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    times = [r["time"] for r in rows if "step_time_s" in r]
    return [b - a for a, b in zip(times, times[1:])][5:]


def _saves(rank: int, world: int, port: int, mib: int, repeats: int, out: str) -> None:
    from hpc_train.checkpoint import TrainState, commit, start_save
    from hpc_train.config import CheckpointConfig
    from hpc_train.env import RankEnv
    from hpc_train.memory_tier import MemoryTier

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    n = max(1, mib // 16)  # 2048 x 2048 fp32 = 16 MiB each; AdamW adds 2x that
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048, bias=False) for _ in range(n)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(2, 2048)).sum().backward()
    opt.step()
    state = TrainState(model, opt, step=1)
    root = Path(out)
    cfg = CheckpointConfig(memory_every_steps=1)
    env = RankEnv("local", rank, 0, world, 1, rank, world, tuple(f"bench{r}" for r in range(world)), "", 0, "bench", 0)
    os.environ.pop("SLURMD_NODENAME", None)
    memory = MemoryTier.build(cfg, env, root / "run", (world, 1), lambda line: None)
    mem_s, disk_s = [], []
    for i in range(repeats):
        state.step = i + 1
        dist.barrier()
        mem_s.append(memory.save(state))
        dist.barrier()
        t0 = time.monotonic()
        why, _ = commit(start_save(root / "run" / "checkpoints", state, "periodic", None, root, fallback_exists=False))
        disk_s.append(time.monotonic() - t0)
        assert not why, why
    memory.clean()
    if rank == 0:
        state_mb = 3 * sum(p.numel() * p.element_size() for p in model.parameters()) / 1e6
        (root / "saves.json").write_text(json.dumps({"mem_s": mem_s, "disk_s": disk_s, "state_mb": state_mb}))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--mib", type=int, default=64, help="parameter bytes per rank for the save timing")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    out = Path(tempfile.mkdtemp(prefix="memory_tier_bench_"))
    try:
        off = step_times(out, "off", args.steps, args.model, 0)
        on = step_times(out, "on", args.steps, args.model, 1)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.start_processes(
            _saves, args=(2, port, args.mib, args.repeats, str(out)), nprocs=2, join=True, start_method="fork"
        )
        saves = json.loads((out / "saves.json").read_text())
    finally:
        shutil.rmtree(out, ignore_errors=True)
    print(f"wall time per step, model={args.model}, local executor, 2 ranks, {len(off)} steps after 5 warm-up ones:")
    print(f"  {'':28s} {'median ms':>10s} {'mean ms':>10s}")
    for label, xs in (("checkpoint.memory_every_steps=0", off), ("checkpoint.memory_every_steps=1", on)):
        print(f"  {label:28s} {statistics.median(xs) * 1e3:10.1f} {statistics.mean(xs) * 1e3:10.1f}")
    print(f"  overhead of a memory copy every step: {statistics.median(on) / statistics.median(off) - 1:+.1%} (median)")
    mem, disk = statistics.median(saves["mem_s"]), statistics.median(saves["disk_s"])
    print(f"one save of {saves['state_mb']:.0f} MB of state per rank (2 gloo ranks, median of {args.repeats}):")
    print(f"  memory (own copy in /dev/shm + buddy over gloo) {mem:8.3f} s")
    print(f"  disk (DCP, fsync, sha256, COMMITTED)            {disk:8.3f} s   ({disk / mem:.1f}x the memory save)")
    print("  (the trainer's periodic disk saves run in the background; the memory copy blocks the loop for all of it)")


if __name__ == "__main__":
    main()
