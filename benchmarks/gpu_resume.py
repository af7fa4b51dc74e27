"""A stop and a resume on one GPU (local executor, one node, one rank), against the same run uninterrupted.

    .venv/bin/python benchmarks/gpu_resume.py --out OUT          # on a GPU: model=small, bf16
    .venv/bin/python benchmarks/gpu_resume.py --cpu --out OUT    # benchmarks/gpu_check.sh --dry: model=tiny

The cut run gets SIGTERM (as a preemption would send it) once its first checkpoint has committed; it saves,
the local controller restarts it, and it resumes from that checkpoint. Writes resume.json (both runs'
summaries, whether the final weights are bit-identical, every attempt's devices) and the cut run's events
and preflight event under OUT. Exits non-zero unless the cut run resumed (2 start events) and finished, and
every rank computed on cuda (--cpu: cpu). Bit-identity is reported, not required: GPU kernels
(atomics in backward) need not sum in the same order twice.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HPC_TRAIN = str(Path(sys.executable).parent / "hpc-train")


def events(run_dir: Path) -> list[dict]:
    path = run_dir / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def submit(args: list[str]) -> tuple[Path, str]:
    proc = subprocess.run([HPC_TRAIN, "submit", *args], capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        sys.exit(f"hpc-train submit {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}")
    line = next(line for line in proc.stdout.splitlines() if line.startswith("submitted job"))
    return Path(line.split("run directory ")[1]), line.split()[2].rstrip(";")


def wait(what: str, predicate, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            sys.exit(f"gpu_resume.py: timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.5)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    args = ap.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="gpu_resume_out_"))
    out.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="gpu_resume_"))
    common = [
        f"out_dir={scratch}",
        "cluster.tasks_per_node=1",
        *(["model=tiny"] if args.cpu else ["model=small", "cluster.gpus_per_node=1"]),
        f"train.steps={args.steps}",
        f"checkpoint.every_steps={max(1, args.steps // 4)}",
        "train.min_step_time_s=0.1",  # time to send the signal between two checkpoints
    ]
    try:
        whole, _ = submit([*common, "name=whole"])
        cut, job_id = submit([*common, "name=cut", "--no-wait"])
        committed = lambda: any(e["event"] == "checkpoint_committed" for e in events(cut))  # noqa: E731
        wait("the cut run's first checkpoint", committed, 300)
        os.kill(int(job_id), signal.SIGTERM)  # the local controller forwards it to the rank
        wait("the cut run's summary.json", lambda: (cut / "summary.json").exists(), 400)
        evs = events(cut)
        starts = [e for e in evs if e["event"] == "start"]
        summaries = {n: json.loads((d / "summary.json").read_text()) for n, d in (("whole", whole), ("cut", cut))}
        result = {
            "attempts": len(starts),
            "resumed_from": [e.get("resumed_from") for e in starts],
            "devices": [e.get("devices") for e in starts],
            "bit_identical": summaries["whole"].get("params_sha256") == summaries["cut"].get("params_sha256"),
            "final_loss": {n: s.get("final_loss") for n, s in summaries.items()},
            "summaries": summaries,
        }
        (out / "resume.json").write_text(json.dumps(result, indent=1) + "\n")
        shutil.copy(cut / "events.jsonl", out / "resume_events.jsonl")
        preflight = [e for e in evs if e["event"] == "preflight"]
        (out / "preflight.json").write_text(json.dumps(preflight, indent=1) + "\n")
        for log in (cut / "submitit").glob("*_log.*"):
            shutil.copy(log, out / f"resume_{log.name}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    want = "cpu" if args.cpu else "cuda"
    print(json.dumps({k: v for k, v in result.items() if k != "summaries"}))
    if len(starts) != 2 or any(d != want for ds in result["devices"] for d in (ds or ["?"])):
        sys.exit(f"gpu_resume.py: expected 2 attempts on {want}, got {result['attempts']} on {result['devices']}")


if __name__ == "__main__":
    main()
