"""The checkpoint tier in memory (checkpoint.memory_every_steps) against the disk, side by side in one run.

    .venv/bin/python benchmarks/memory_tier.py                      # model=tiny, 60 steps, 2 rounds, 64 MiB save
    .venv/bin/python benchmarks/memory_tier.py --model small --steps 60 --mib 256
    .venv/bin/python benchmarks/memory_tier.py --mib 0               # the trainer runs only

Prints (never asserts):
  - the trainer's median and mean wall time per step on the local executor (2 ranks, one node: the own copy only)
    with checkpoint.memory_every_steps=0 (off), 1 and 10, the same run otherwise, side by side, run --rounds
    times in turn (off, 1, 10, off, ...) so a change of the machine's load falls on all three; the overhead
    against off (aim <= 5% at 1), and rank 0's seconds per step that the loop was blocked by the tier
    (metrics.jsonl memory_blocked_s: the snapshot, and memory_wait_s, waiting for the copy in flight) and a
    copy's seconds in its thread (memory_copy_s, wall; memory_copy_cpu_s, the thread's own CPU time): the
    thread competes for the same cores (and the GIL), so where the ranks already fill the cores the wall-time
    overhead exceeds the blocked time, and a copy's wall time its CPU time, which makes the next snapshot wait
  - one memory save (the snapshot the loop waits for, then the thread: torch.save to bytes, sha256, the own copy
    into /dev/shm, the buddy exchange over gloo and the buddy copy; 2 gloo ranks as 2 "nodes") against one
    synchronous disk save (checkpoint.start_save + commit: DCP files fsynced, hashed, COMMITTED) of the same
    state, in seconds (median of --repeats)
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


def step_times(out: Path, name: str, steps: int, model: str, memory_every_steps: int) -> tuple[list[float], list[dict]]:
    """A local run's wall seconds per step: the time between consecutive metrics.jsonl rows (one every step), so
    the step_end work (the memory copy) counts, which step_time_s (the step itself) leaves out; the first 5
    (warm-up) left out. And those rows."""
    args = [f"train.steps={steps}", f"model={model}", "train.log_every_steps=1", f"checkpoint.every_steps={steps}"]
    args += [f"checkpoint.memory_every_steps={memory_every_steps}", f"out_dir={out}", f"name={name}"]
    proc = subprocess.run([HPC_TRAIN, "submit", "cluster=local", *args], capture_output=True, text=True)
    run_dir = next(out.glob(f"{name}-*"), None)
    if proc.returncode or run_dir is None:
        raise SystemExit(f"the {name} run failed: {proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "step_time_s" in r]
    times = [r["time"] for r in rows]
    return [b - a for a, b in zip(times, times[1:])][5:], rows[6:]


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
    mem_s, blocked_s, disk_s = [], [], []
    for i in range(repeats):
        state.step = i + 1
        dist.barrier()
        t0 = time.monotonic()
        blocked_s.append(memory.save(state))
        memory.wait()
        mem_s.append(time.monotonic() - t0)
        dist.barrier()
        t0 = time.monotonic()
        why, _ = commit(start_save(root / "run" / "checkpoints", state, "periodic", None, root, fallback_exists=False))
        disk_s.append(time.monotonic() - t0)
        assert not why, why
    memory.clean()
    if rank == 0:
        state_mb = 3 * sum(p.numel() * p.element_size() for p in model.parameters()) / 1e6
        saves = {"mem_s": mem_s, "blocked_s": blocked_s, "disk_s": disk_s, "state_mb": state_mb}
        (root / "saves.json").write_text(json.dumps(saves))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--rounds", type=int, default=2, help="runs of each setting, in turn")
    ap.add_argument("--mib", type=int, default=64, help="parameter bytes per rank for the save timing (0: none)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    out = Path(tempfile.mkdtemp(prefix="memory_tier_bench_"))
    every = (0, 1, 10)
    walls: dict[int, list[float]] = {n: [] for n in every}
    rows: dict[int, list[dict]] = {n: [] for n in every}
    try:
        for i in range(args.rounds):
            for n in every:
                wall, got = step_times(out, f"every{n}-{i}", args.steps, args.model, n)
                walls[n] += wall
                rows[n] += got
        if args.mib:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            mp.start_processes(
                _saves, args=(2, port, args.mib, args.repeats, str(out)), nprocs=2, join=True, start_method="fork"
            )
        saves = json.loads((out / "saves.json").read_text()) if args.mib else None
    finally:
        shutil.rmtree(out, ignore_errors=True)
    base = statistics.median(walls[0])
    print(
        f"wall time per step, model={args.model}, local executor, 2 ranks, {args.rounds} x {args.steps} steps, "
        f"{len(walls[0])} timed after 5 warm-up ones a run ({os.cpu_count()} CPUs here):"
    )
    head = ("median ms", "mean ms", "overhead", "blocked ms", "of it wait", "copy ms", "copy CPU ms")
    print(f"  {'':32s} " + " ".join(f"{h:>11s}" for h in head))
    for n in every:
        med, mean = statistics.median(walls[n]), statistics.mean(walls[n])
        cells = [f"{med * 1e3:11.1f}", f"{mean * 1e3:11.1f}"]
        if n:
            per_step = [sum(r[k] for r in rows[n]) / len(rows[n]) for k in ("memory_blocked_s", "memory_wait_s")]
            copies = [statistics.median(r[k] for r in rows[n] if r[k]) for k in ("memory_copy_s", "memory_copy_cpu_s")]
            cells += [f"{med / base - 1:+11.1%}", *(f"{x * 1e3:11.2f}" for x in per_step + copies)]
        print(f"  {f'checkpoint.memory_every_steps={n}':32s} " + " ".join(cells))
    print(
        "  overhead: of the median wall time per step against memory_every_steps=0; blocked: rank 0's loop in the\n"
        "  tier, per step (the snapshot, and any wait for the copy in flight); copy: one copy in its thread, wall\n"
        "  time and the thread's own CPU time (medians)"
    )
    if saves is None:
        return
    mem, blocked, disk = (statistics.median(saves[k]) for k in ("mem_s", "blocked_s", "disk_s"))
    print(f"one save of {saves['state_mb']:.0f} MB of state per rank (2 gloo ranks, median of {args.repeats}):")
    for label, x in (
        ("memory: the loop blocked (the snapshot)", blocked),
        ("memory: both copies written (own + buddy over gloo)", mem),
    ):
        print(f"  {label:52s} {x:8.3f} s")
    print(f"  {'disk (DCP, fsync, sha256, COMMITTED)':52s} {disk:8.3f} s   ({disk / mem:.1f}x the memory save)")


if __name__ == "__main__":
    main()
