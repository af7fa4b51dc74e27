"""Login-node submission, hpc_train vs the anchor (Hydra's submitit launcher), on the dev cluster, in one run.

    .venv/bin/pip install -e '.[bench]'
    .venv/bin/python benchmarks/submit_bench.py                 # sizes 100 and 1000
    .venv/bin/python benchmarks/submit_bench.py --sizes 100     # quicker

Figures (printed, never asserted):
  - dry run: `hpc-train submit --dry-run cluster=dev` (renders the script, validates against the live
    cluster with sbatch --test-only) vs the anchor's closest, `app.py --cfg job` (prints the config only)
  - N-point sweep: seconds until all N tasks are in the queue, whether the command then returns or
    blocks until the jobs end, sbatch calls (counted in slurmctld.log), peak RSS of the submitting process
Every job is cancelled right after it is queued (the anchor's 100-point sweep is left to finish once,
to time how long it blocks the terminal).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
import cluster  # noqa: E402

from hpc_train.submit import job_name  # noqa: E402

PY = sys.executable
HPC_TRAIN = str(Path(PY).parent / "hpc-train")
APP = str(ROOT / "benchmarks" / "hydra_anchor" / "app.py")
# Runs the command, prints its pid at once and its peak RSS (KiB) when it ends.
RSS_WRAPPER = (
    "import resource, subprocess, sys\n"
    "p = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)\n"
    "print(p.pid, flush=True)\n"
    "err = p.communicate()[1]\n"
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, p.returncode, flush=True)\n"
    "sys.stderr.write(err.decode()[-2000:])\n"
)


def submissions() -> int:
    log = cluster.paths()["log"] / "slurmctld.log"
    return log.read_text().count("_slurm_rpc_submit_batch_job")


def queued_tasks(name: str, env: dict[str, str]) -> int:
    out = subprocess.run(["squeue", "-h", "-r", "--name", name, "-o", "%i"], env=env, capture_output=True, text=True)
    return len(out.stdout.split())


def cancel(name: str, env: dict[str, str]) -> None:
    subprocess.run(["scancel", "--name", name], env=env, capture_output=True)
    deadline = time.monotonic() + 60
    while queued_tasks(name, env) and time.monotonic() < deadline:
        time.sleep(0.5)


def sweep(cmd: list[str], job_name: str, n: int, env: dict[str, str], wait_for_end: bool) -> dict[str, float]:
    """Start `cmd`; time until n tasks of job_name are queued; then let it return, or kill it."""
    before = submissions()
    t0 = time.monotonic()
    wrapper = subprocess.Popen([PY, "-c", RSS_WRAPPER, *cmd], env=env, stdout=subprocess.PIPE, text=True)
    pid = int(wrapper.stdout.readline())
    queued_s = float("nan")
    while wrapper.poll() is None or queued_s != queued_s:
        if queued_s != queued_s and queued_tasks(job_name, env) >= n:
            queued_s = time.monotonic() - t0
            if not wait_for_end and wrapper.poll() is None:
                os.kill(pid, 15)  # the anchor blocks until its jobs end: stop waiting, we have the figure
        if wrapper.poll() is not None and queued_s != queued_s and queued_tasks(job_name, env) < n:
            break
        time.sleep(0.05)
    rss_kib, rc = (int(x) for x in wrapper.stdout.readline().split())
    wall_s = time.monotonic() - t0
    calls = submissions() - before
    cancel(job_name, env)
    return {"queued_s": queued_s, "returned_s": wall_s, "sbatch_calls": calls, "rss_mb": rss_kib / 1024, "rc": rc}


def median_wall(cmd: list[str], env: dict[str, str], repeats: int = 7) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.monotonic()
        subprocess.run(cmd, env=env, capture_output=True, check=True)
        times.append(time.monotonic() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="100,1000")
    args = ap.parse_args()
    started = not cluster.is_up()
    if started:
        cluster.up()
    out = Path(tempfile.mkdtemp(prefix="submit_bench_"))
    env = {**cluster.client_env(), "HPC_BENCH_OUT": str(out)}

    ours_dry = median_wall([HPC_TRAIN, "submit", "--dry-run", "cluster=dev", f"out_dir={out}"], env)
    anchor_cfg = median_wall([PY, APP, "--cfg", "job"], env)
    print(
        f"{'dry run (median of 7)':40s} hpc_train {ours_dry:6.2f} s   anchor (--cfg job, no script) {anchor_cfg:6.2f} s"
    )

    for n in [int(s) for s in args.sizes.split(",")]:
        name = f"bench{n}"
        ours = sweep(
            [HPC_TRAIN, "submit", "-m", "cluster=dev", f"out_dir={out}", f"name={name}", f"train.seed=range({n})"],
            job_name(out.resolve() / f"{name}-1"),
            n,
            env,
            wait_for_end=True,
        )
        anchor = sweep(
            [PY, APP, "-m", f"lr=range({n})", f"hydra.launcher.name=anchor{n}"],
            f"anchor{n}",
            n,
            env,
            wait_for_end=(n <= 100),
        )
        for label, r in (("hpc_train", ours), ("anchor", anchor)):
            print(
                f"{n:5d}-point sweep  {label:10s} queued in {r['queued_s']:7.2f} s, command returned after "
                f"{r['returned_s']:7.2f} s, {r['sbatch_calls']:4d} sbatch call(s), peak RSS {r['rss_mb']:6.1f} MB"
            )
    if started:
        cluster.down()


if __name__ == "__main__":
    main()
