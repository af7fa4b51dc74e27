"""A pipeline's evaluation stage as people write one: given the checkpoint the training stage left (`{after.ckpt}`,
hpc_train's committed step folder), it reads what that checkpoint says of itself and writes its verdict.

    hpc-train submit cluster=dev --after runs/pretrain-1:any -- python tests/scripts/eval_stage.py \\
        --ckpt {after.ckpt} --out {run_dir}/eval.json
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    marker = Path(args.ckpt) / "COMMITTED"
    if not marker.is_file():
        print(f"no committed checkpoint at {args.ckpt}", flush=True)
        return 3
    if os.environ.get("RANK", "0") == "0":
        step = json.loads(marker.read_text()).get("step")
        Path(args.out).write_text(json.dumps({"ckpt": args.ckpt, "step": step}) + "\n")
        print(f"evaluated {args.ckpt} (step {step})", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
