"""Checkpoint save speed on this disk, side by side with `dd conv=fsync`, in one run.

    .venv/bin/python benchmarks/checkpoint_bench.py            # 512 MiB of fp32 weights + AdamW state
    .venv/bin/python benchmarks/checkpoint_bench.py --mib 128

Prints (never asserts):
  - dd: bytes written with `dd if=/dev/zero bs=16M conv=fsync`, MB/s
  - synchronous save (hpc_train.checkpoint.start_save + commit: DCP files fsynced, each rank's sha256
    of what it wrote, COMMITTED marker): MB/s and the ratio to dd (target >= 0.8)
  - async save: how long the training loop is blocked (copy to host memory) / synchronous save time
    (target <= 0.1)
One process, world size 1, gloo; model and optimizer state sizes are printed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from hpc_train import checkpoint


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=512, help="parameter bytes; AdamW adds 2x that")
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir under ./runs)")
    args = ap.parse_args()
    root = Path(
        args.dir
        or tempfile.mkdtemp(prefix="ckpt_bench_", dir=Path("runs").resolve() if Path("runs").is_dir() else None)
    )
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    dist.init_process_group("gloo", rank=0, world_size=1)
    n_layers = max(1, args.mib // 64)  # 4096 x 4096 fp32 = 64 MiB each
    model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096, bias=False) for _ in range(n_layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(2, 4096)).sum().backward()
    opt.step()  # materialise exp_avg / exp_avg_sq
    state_bytes = 3 * sum(p.numel() * p.element_size() for p in model.parameters())
    state = checkpoint.TrainState(model, opt, step=1)
    mb = state_bytes / 1e6

    dd_file = root / "dd.bin"
    t0 = time.monotonic()
    subprocess.run(
        ["dd", "if=/dev/zero", f"of={dd_file}", "bs=16M", f"count={max(1, state_bytes >> 24)}", "conv=fsync"],
        check=True,
        capture_output=True,
    )
    dd_s = time.monotonic() - t0
    dd_file.unlink()

    def save(step: int, background: bool) -> tuple[float, float]:
        state.step = step
        pending = checkpoint.start_save(
            root / "ckpt", state, "periodic", writer if background else None, root / "drills", False
        )
        stall = pending.stall_s
        why, _ = checkpoint.commit(pending)
        assert not why, why
        return stall, time.monotonic() - pending.started

    writer = checkpoint.Writer()
    save(0, False)  # warm-up: first DCP call plans and imports
    sync = [save(s, False)[1] for s in (1, 2, 3)]
    asyn = [save(s, True) for s in (4, 5, 6, 7)][1:]  # the first one allocates the reused host buffers
    sync_s = min(sync)
    stall_s = min(a[0] for a in asyn)
    print(f"state: {n_layers} x 4096x4096 fp32 weights + AdamW moments = {mb:,.0f} MB on {root}")
    print(f"dd conv=fsync:            {mb / dd_s:8.1f} MB/s  ({dd_s:.2f} s)")
    print(f"synchronous save+commit:  {mb / sync_s:8.1f} MB/s  ({sync_s:.2f} s, best of 3) = {dd_s / sync_s:.2f}x dd")
    print(
        f"async save: loop blocked  {stall_s:8.3f} s  = {stall_s / sync_s:.3f}x the synchronous save "
        f"(background write + commit took {min(a[1] for a in asyn):.2f} s)"
    )
    dist.destroy_process_group()
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
