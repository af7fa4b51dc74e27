"""A finished run never ends FAILED (hpc_train/leave.py): many finishes through the real finish code (start.py,
job.run_job, Attempt.finish), each with a thread of the function's own still inside gloo at the end
(tests/scripts/busy_finish.py), counted by how each rank and job ended.

    .venv/bin/python benchmarks/finish_loop.py --local 200                  # local executor, 2 ranks a run
    python tests/cluster.py up && export SLURM_CONF=/tmp/hpc_train_cluster/etc/slurm.conf
    .venv/bin/python benchmarks/finish_loop.py --slurm 50                   # one sweep, 2 nodes a trial
    .venv/bin/python benchmarks/finish_loop.py --slurm 50 --spare-nodes 1   # the relay's finished file too

Local: a rank that aborted leaves `terminate called` in its stderr (submitit's local controller reads only the
result pickle, so the run still says finished). Slurm: sacct's state of every array task, COMPLETED or not.
Before leave.py both ranks of every local run aborted (3 of 3 runs).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HPC_TRAIN = str(Path(sys.executable).parent / "hpc-train")
FN = ["fn._target_=busy_finish.main", "+fn.kwargs.steps=3"]


def env() -> dict[str, str]:
    scripts = str(ROOT / "tests" / "scripts")
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [scripts, os.environ.get("PYTHONPATH")]))}


def aborted_ranks(run_dir: Path) -> int:
    return sum("terminate called" in p.read_text(errors="replace") for p in (run_dir / "submitit").glob("*_log.err"))


def one_local(out: Path, i: int) -> tuple[bool, int]:
    """(finished, aborted ranks) of one 2-rank local run."""
    args = [HPC_TRAIN, "submit", f"out_dir={out}", f"name=r{i}", "cluster.tasks_per_node=2", *FN]
    subprocess.run(args, env=env(), capture_output=True, text=True, timeout=300, cwd=out)
    run_dir = out / f"r{i}-1"
    return (run_dir / "summary.json").exists(), aborted_ranks(run_dir)


def local(n: int, parallel: int) -> None:
    out = Path(tempfile.mkdtemp(prefix="finish_loop-"))
    began = time.monotonic()
    with ThreadPoolExecutor(parallel) as pool:
        results = list(pool.map(lambda i: one_local(out, i), range(n)))
    finished = sum(f for f, _ in results)
    aborted = sum(a for _, a in results)
    print(
        f"local: {n} runs x 2 ranks in {time.monotonic() - began:.0f} s: {finished} finished, "
        f"{aborted} ranks aborted (terminate called), {sum(a > 0 for _, a in results)} runs with an abort; {out}"
    )


def sacct_states(job: str) -> dict[str, str]:
    proc = subprocess.run(
        ["sacct", "-j", job, "-X", "-n", "-P", "-o", "JobID,State"], capture_output=True, text=True, timeout=30
    )
    return dict(line.split("|", 1) for line in proc.stdout.split() if "|" in line)


def on_slurm(n: int, spare_nodes: int, timeout_s: float) -> None:
    if "SLURM_CONF" not in os.environ:
        raise SystemExit("export SLURM_CONF first (python tests/cluster.py env)")
    out = Path(tempfile.mkdtemp(prefix="finish_loop-slurm-"))
    shape = ["cluster=dev", "cluster.nodes=2", "cluster.tasks_per_node=1", f"cluster.spare_nodes={spare_nodes}"]
    args = [HPC_TRAIN, "submit", "-m", f"out_dir={out}", "name=f", *shape, *FN, f"train.seed=range({n})"]
    began = time.monotonic()
    subprocess.run(args, env=env(), capture_output=True, text=True, timeout=300, check=True, cwd=out)
    sweep = json.loads((out / "f-1" / "sweep.json").read_text())
    arrays = sorted({t["job_id"].split("_")[0] for t in sweep["trials"]})
    ended = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL"}
    states: dict[str, str] = {}
    while time.monotonic() - began < timeout_s:
        states = {k: v for a in arrays for k, v in sacct_states(a).items()}
        if len(states) >= n and all(s.split()[0] in ended for s in states.values()):
            break
        time.sleep(5)
    counts: dict[str, int] = {}
    for s in states.values():
        counts[s.split()[0]] = counts.get(s.split()[0], 0) + 1
    summaries = sum((Path(t["run_dir"]) / "summary.json").exists() for t in sweep["trials"])
    aborted = aborted_ranks(out / "f-1")  # a sweep's logs: <sweep>/submitit/<array>_<task>_<rank>_log.err
    print(
        f"slurm: {n} trials x 2 nodes (spare_nodes={spare_nodes}) in {time.monotonic() - began:.0f} s: "
        f"sacct {counts}, {summaries} summary.json, {aborted} ranks aborted; {out / 'f-1'}"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--local", type=int, default=0, help="local runs (2 ranks each)")
    p.add_argument("--parallel", type=int, default=2, help="local runs at once")
    p.add_argument("--slurm", type=int, default=0, help="trials of one sweep on the dev cluster")
    p.add_argument("--spare-nodes", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=3600)
    a = p.parse_args()
    if a.local:
        local(a.local, a.parallel)
    if a.slurm:
        on_slurm(a.slurm, a.spare_nodes, a.timeout_s)


if __name__ == "__main__":
    main()
