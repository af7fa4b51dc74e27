"""One Hydra app, two launchers, side by side in one run on the dev cluster: `hydra/launcher=submitit_slurm` (the
anchor: what users run today) against `hydra/launcher=hpc_train`, the same app and the same sweep.

    .venv/bin/pip install -e '.[bench]'                  # hydra-submitit-launcher, for the anchor
    .venv/bin/python benchmarks/hydra_launcher_bench.py  # 1,000 points both, then 10,000 ours (~3 min)
    .venv/bin/python benchmarks/hydra_launcher_bench.py --sizes 1000 --repeats 3

Figures (printed, never asserted), per launcher and size: seconds from the command's start until every task is in
the queue, whether the command then returns (ours) or blocks until every job ends (the anchor: stopped once its
tasks are queued), CPU seconds, sbatch calls, peak RSS. The app is benchmarks/hydra_anchor/app.py, unchanged; only
the override differs. Each sweep is queued on hold and cancelled by its job ids once queued (submit_bench.py's
`sweep`, which this reuses). At 10,000 points the anchor is not run: its launcher queues one array, and the
cluster's MaxArraySize is 1001; hpc_train splits the sweep into arrays under it.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from submit_bench import APP, MAX_JOB_COUNT, PY, cluster, slurm, sweep  # noqa: E402  (it puts tests/ on sys.path)

from hpc_train.plan import job_name  # noqa: E402


def ours(n: int, out: Path, env: dict[str, str]) -> dict[str, float]:
    target = out / f"ours{n}"
    cmd = [PY, APP, "-m", "hydra/launcher=hpc_train", f"lr=range({n})", f"hydra.sweep.dir={target}"]
    cmd += ["+hydra.launcher.sbatch_extra.hold=''"]  # queued on hold: nothing starts while the rest is queued
    result = sweep(cmd, job_name(target.resolve()), n, env, target / "sweep.json")
    shutil.rmtree(target, ignore_errors=True)
    return result


def anchor(n: int, out: Path, env: dict[str, str]) -> dict[str, float]:
    cmd = [PY, APP, "-m", f"lr=range({n})", f"hydra.launcher.name=anchor{n}"]
    cmd += ["+hydra.launcher.additional_parameters.hold=true"]
    result = sweep(cmd, f"anchor{n}", n, env, None)
    shutil.rmtree(out / "hydra_multirun", ignore_errors=True)
    return result


def line(n: int, tool: str, r: dict[str, float]) -> str:
    return (
        f"{n:6d} points {tool:26s} queued in {r['queued_s']:6.2f} s ({1000 * r['queued_s'] / n:5.2f} ms a point); "
        f"returned after {r['returned_s']:6.2f} s{' (stopped: it blocks until every job ends)' if r['rc'] else ''}; "
        f"{r['cpu_s']:6.2f} s CPU; {r['sbatch_calls']:3d} sbatch call(s); peak RSS {r['rss_mb']:5.0f} MB; "
        f"load {os.getloadavg()[0]:.1f}"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1000,10000", help="comma-separated; the anchor runs those <= MaxArraySize")
    ap.add_argument("--repeats", type=int, default=1, help="each size this many times, the two launchers in turn")
    args = ap.parse_args()
    started = not cluster.is_up()
    if started:
        cluster.up(max_job_count=MAX_JOB_COUNT)
    out = Path(tempfile.mkdtemp(prefix="hydra_launcher_bench_"))
    env = {**cluster.client_env(), "HPC_BENCH_OUT": str(out)}
    config = dict(re.findall(r"^(\w+)\s+= (\S+)", slurm(["scontrol", "show", "config"], env), re.M))
    max_array, max_jobs = int(config["MaxArraySize"]), int(config["MaxJobCount"])
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; MaxArraySize {max_array}; sweeps in {out}")
    for n in [int(s) for s in args.sizes.split(",") if s]:
        if 2 * n + 2000 > max_jobs:
            print(f"{n}-point sweep: skipped, MaxJobCount {max_jobs} is too small; stop the cluster, run this again")
            continue
        for _ in range(args.repeats):
            mine = ours(n, out, env)
            print(line(n, "hydra/launcher=hpc_train", mine), flush=True)
            if n > max_array:
                print(
                    f"{n:6d} points hydra/launcher=submitit_slurm not run: one array of {n} > MaxArraySize {max_array}"
                )
                continue
            theirs = anchor(n, out, env)
            print(line(n, "hydra/launcher=submitit_slurm", theirs), flush=True)
            print(f"{n:6d} points: hpc_train queued {theirs['queued_s'] / mine['queued_s']:.1f}x faster", flush=True)
    shutil.rmtree(out, ignore_errors=True)
    if started:
        cluster.down()


if __name__ == "__main__":
    main()
