"""MFU of the trainer on one GPU: FSDP2, bf16 autocast, model=1b (~1.0 B parameters), synthetic data.

    .venv/bin/python benchmarks/gpu_mfu.py                       # 40 steps, batch 8 x 2048 tokens
    .venv/bin/python benchmarks/gpu_mfu.py --steps 60 --batch 4 --activation-checkpointing

Runs `hpc-train submit` on the local executor with 1 task (the product's own path: rendezvous, nccl,
FSDP2, checkpoints, metrics), then prints the median tokens/s, step time, peak memory and MFU of the
logged intervals after the first (warm-up). MFU = model FLOPs per token (6 N + 12 L d s) x tokens/s /
the GPU's dense bf16 peak (H200: 989 TFLOP/s). Target: >= 45 %. Writes mfu.json under $OUT when set.
Never asserts. Needs a CUDA build of torch; the final checkpoint (~16 GB of fp32 state) is written too.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HPC_TRAIN = str(Path(sys.executable).parent / "hpc-train")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=8, help="sequences of 2048 tokens per step")
    ap.add_argument("--activation-checkpointing", action="store_true")
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        sys.exit("gpu_mfu.py needs a GPU and a CUDA build of torch")
    out = Path(tempfile.mkdtemp(prefix="gpu_mfu_"))
    cmd = [
        HPC_TRAIN,
        "submit",
        "model=1b",
        "train.parallelism=fsdp",
        "train.bf16=true",
        f"train.activation_checkpointing={str(args.activation_checkpointing).lower()}",
        "cluster.tasks_per_node=1",
        f"train.steps={args.steps}",
        f"train.batch_seqs_per_rank={args.batch}",
        "train.log_every_steps=5",
        "train.warmup_steps=5",
        f"checkpoint.every_steps={args.steps}",
        f"out_dir={out}",
        "name=mfu",
    ]
    print(" ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    rows = [json.loads(line) for line in (out / "mfu-1" / "metrics.jsonl").read_text().splitlines()][1:]
    median = {
        k: statistics.median(r[k] for r in rows) for k in ("tokens_per_s", "step_time_s", "peak_memory_mb", "mfu")
    }
    result = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "batch_tokens": args.batch * 2048,
        "activation_checkpointing": args.activation_checkpointing,
        **median,
    }
    print(
        f"{result['gpu']}: {median['tokens_per_s']:,.0f} tokens/s, {median['step_time_s'] * 1e3:.0f} ms/step, "
        f"peak {median['peak_memory_mb'] / 1024:.1f} GiB, MFU {median['mfu']:.1%} (target >= 45%)"
    )
    if os.environ.get("OUT"):
        (Path(os.environ["OUT"]) / "mfu.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
