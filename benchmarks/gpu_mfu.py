"""MFU of the trainer on one GPU: FSDP2, bf16 (FSDP2's MixedPrecisionPolicy), model=1b (~1.0 B parameters),
synthetic data.

    .venv/bin/python benchmarks/gpu_mfu.py                       # 40 steps, batch 8 x 2048 tokens, eager
    .venv/bin/python benchmarks/gpu_mfu.py --compile --steps 30  # train.compile=true (needs g++)
    .venv/bin/python benchmarks/gpu_mfu.py --steps 60 --batch 4 --activation-checkpointing
    .venv/bin/python benchmarks/gpu_mfu.py --cpu --steps 6       # benchmarks/gpu_check.sh --dry: model=tiny on CPU

Runs `hpc-train submit` on the local executor with 1 task and cluster.gpus_per_node=1 (the product's own
path: rendezvous, nccl, FSDP2, checkpoints, metrics), then prints the median tokens/s, step time, peak
memory and MFU of the logged intervals after the first (warm-up). MFU = model FLOPs per token (6 N + 12 L d s)
x tokens/s / the GPU's dense bf16 peak (metrics.PEAK_TFLOPS; H200: 989 TFLOP/s). Target: >= 45 %.
Exits non-zero unless every rank's start event says it computed on `cuda` (with --cpu: on `cpu`): a
figure a CPU produced is no GPU figure. Writes mfu.json (and the run's metrics and events) under --out
or $OUT when given; the run directory itself (a ~16 GB final checkpoint for 1b) is deleted.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HPC_TRAIN = str(Path(sys.executable).parent / "hpc-train")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=8, help="sequences per step")
    ap.add_argument("--activation-checkpointing", action="store_true")
    ap.add_argument("--compile", action="store_true", help="train.compile=true")
    ap.add_argument("--cpu", action="store_true", help="a dry run on CPU: model=tiny, no GPU asked for")
    ap.add_argument("--out", default=os.environ.get("OUT", ""), help="folder for mfu.json (default $OUT)")
    args = ap.parse_args()
    import torch

    if not args.cpu and not torch.cuda.is_available():
        sys.exit("gpu_mfu.py needs a GPU and a CUDA build of torch (--cpu: a dry run on CPU)")
    scratch = Path(tempfile.mkdtemp(prefix="gpu_mfu_"))
    gpu = [] if args.cpu else ["model=1b", "cluster.gpus_per_node=1", "train.bf16=true"]
    cmd = [
        HPC_TRAIN,
        "submit",
        *(gpu or ["model=tiny"]),
        "train.parallelism=fsdp",
        f"train.activation_checkpointing={str(args.activation_checkpointing).lower()}",
        f"train.compile={str(args.compile).lower()}",
        "cluster.tasks_per_node=1",
        f"train.steps={args.steps}",
        f"train.batch_seqs_per_rank={args.batch}",
        f"train.log_every_steps={max(1, min(5, args.steps // 4))}",
        f"train.warmup_steps={min(5, args.steps)}",
        f"checkpoint.every_steps={args.steps}",
        f"out_dir={scratch}",
        "name=mfu",
    ]
    print(" ".join(cmd), flush=True)
    try:
        subprocess.run(cmd, check=True)
        run_dir = scratch / "mfu-1"
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
        if args.out:
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            for name in ("metrics.jsonl", "events.jsonl"):
                shutil.copy(run_dir / name, out / name)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    devices = [d for e in events if e["event"] == "start" for d in e.get("devices", ["?"])]
    want = "cpu" if args.cpu else "cuda"
    rows = rows[1:] or rows  # the first interval holds the warm-up (and compilation)
    median = {
        k: statistics.median(r[k] for r in rows if r.get(k) is not None)
        for k in ("tokens_per_s", "step_time_s", "peak_memory_mb", "mfu")
        if any(r.get(k) is not None for r in rows)
    }
    result = {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "devices": devices,
        "compile": args.compile,
        "batch_seqs": args.batch,
        "activation_checkpointing": args.activation_checkpointing,
        **median,
    }
    mfu = "n/a" if median.get("mfu") is None else f"{median['mfu']:.1%}"
    print(
        f"{result['gpu']} ({'compiled' if args.compile else 'eager'}): {median['tokens_per_s']:,.0f} tokens/s, "
        f"{median['step_time_s'] * 1e3:.0f} ms/step, peak {median['peak_memory_mb'] / 1024:.1f} GiB, "
        f"MFU {mfu} (target >= 45%), ranks on {devices}"
    )
    if args.out:
        (Path(args.out) / "mfu.json").write_text(json.dumps(result, indent=1) + "\n")
    if not devices or any(d != want for d in devices):
        sys.exit(f"gpu_mfu.py: ranks computed on {devices}, not {want}: the figures above are not {want} figures")


if __name__ == "__main__":
    main()
