"""Login-node submission, hpc_train vs the anchor (Hydra's submitit launcher), on the dev cluster, in one run.

    .venv/bin/pip install -e '.[bench]'
    .venv/bin/python benchmarks/submit_bench.py                          # 1k, 10k and 100k points
    .venv/bin/python benchmarks/submit_bench.py --sizes 1000,10000       # quicker

Figures (printed, never asserted):
  - dry run: `hpc-train submit --dry-run cluster=dev` (renders the script, validates against the live
    cluster with sbatch --test-only) vs the anchor's closest, `app.py --cfg job` (prints the config only):
    median and fastest wall time of 15 runs each, the two taking turns, and median CPU time (the command
    and the clients it runs)
  - N-point sweep: seconds until all N tasks are in the queue, CPU seconds of the submitting command,
    both per point, whether it then returns at once, sbatch calls (counted in slurmctld.log), peak RSS
Each sweep is queued on hold (sbatch --hold, both tools), so that no task starts and loads this machine
while the rest is still being queued, and is cancelled by its job ids once every task is queued. The
anchor runs at the sizes it can reach: its launcher submits a sweep as one array, so nothing above the
cluster's MaxArraySize. The cluster, if this starts it, allows 300,000 jobs (Slurm's default 10,000
counts each array task, and a cancelled one for MinJobAge).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
import cluster  # noqa: E402

from hpc_train.plan import job_name  # noqa: E402

PY = sys.executable
HPC_TRAIN = str(Path(PY).parent / "hpc-train")
APP = str(ROOT / "benchmarks" / "hydra_anchor" / "app.py")
MAX_JOB_COUNT = 300_000
# Runs the command, prints its pid at once, then its peak RSS (KiB), exit code and CPU seconds when it ends.
RSS_WRAPPER = (
    "import resource, subprocess, sys\n"
    "p = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)\n"
    "print(p.pid, flush=True)\n"
    "err = p.communicate()[1]\n"
    "r = resource.getrusage(resource.RUSAGE_CHILDREN)\n"
    "print(r.ru_maxrss, p.returncode, r.ru_utime + r.ru_stime, flush=True)\n"
    "sys.stderr.write(err.decode()[-2000:] if p.returncode not in (0, -15) else '')\n"
)


def submissions() -> int:
    log = cluster.paths()["log"] / "slurmctld.log"
    return log.read_text().count("_slurm_rpc_submit_batch_job")


def slurm(args: list[str], env: dict[str, str]) -> str:
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=120).stdout


def queued_tasks(name: str, env: dict[str, str]) -> int:
    """Tasks of that job name in the queue, from squeue's compact lines (`123_[0-1000%8]` is 1001 tasks):
    `squeue -r` would print 100,000 lines every poll, and steal the CPU being measured."""
    n = 0
    for job in slurm(["squeue", "-h", "--name", name, "-o", "%i"], env).split():
        ranges = re.fullmatch(r"\d+_\[([^\]%]+)(%\d+)?\]", job)
        if not ranges:
            n += 1
            continue
        for part in ranges.group(1).split(","):
            first, _, last = part.partition("-")
            n += int(last or first) - int(first) + 1
    return n


def cancel(name: str, ids: set[str], env: dict[str, str]) -> None:
    """scancel by job id: the ids the sweep recorded and any still queued under its name."""
    ids |= set(slurm(["squeue", "-h", "--name", name, "-o", "%F"], env).split())
    if ids:
        subprocess.run(["scancel", *sorted(ids)], env=env, capture_output=True)
    deadline = time.monotonic() + 120
    while queued_tasks(name, env) and time.monotonic() < deadline:
        time.sleep(0.5)


def sweep(cmd: list[str], name: str, n: int, env: dict[str, str], manifest: Path | None) -> dict[str, float]:
    """Start `cmd`; time until n tasks named `name` are queued; let it return (ours) or stop it (the anchor
    blocks until its jobs end); cancel what it queued."""
    before = submissions()
    t0 = time.monotonic()
    wrapper = subprocess.Popen([PY, "-c", RSS_WRAPPER, *cmd], env=env, stdout=subprocess.PIPE, text=True)
    pid = int(wrapper.stdout.readline())
    queued_s = float("nan")
    while queued_s != queued_s:
        if queued_tasks(name, env) >= n:
            queued_s = time.monotonic() - t0
        elif wrapper.poll() is not None:
            break  # it ended without queueing everything
        else:
            time.sleep(0.2)
    if manifest is None and wrapper.poll() is None:
        os.kill(pid, 15)  # the anchor blocks until its jobs end: we have the figure
    rss_kib, rc, cpu_s = wrapper.stdout.readline().split()
    wall_s = time.monotonic() - t0
    calls = submissions() - before
    ids = set()
    if manifest is not None and manifest.exists():
        ids = {a["job_id"] for a in json.loads(manifest.read_text())["arrays"] if a["job_id"]}
    cancel(name, ids, env)
    return {
        "queued_s": queued_s,
        "returned_s": wall_s,
        "cpu_s": float(cpu_s),
        "sbatch_calls": calls,
        "rss_mb": int(rss_kib) / 1024,
        "rc": int(rc),
    }


def medians(cmds: list[list[str]], env: dict[str, str], repeats: int = 15) -> list[tuple[float, float, float]]:
    """Per command, (median wall s, fastest wall s, median CPU s of it and its children) of `repeats` runs,
    the commands taking turns: this shared machine's speed drifts, and it drifts for both alike."""
    walls: list[list[float]] = [[] for _ in cmds]
    cpus: list[list[float]] = [[] for _ in cmds]
    for _ in range(repeats):
        for cmd, wall, cpu in zip(cmds, walls, cpus):
            usage = resource.getrusage(resource.RUSAGE_CHILDREN)
            t0 = time.monotonic()
            subprocess.run(cmd, env=env, capture_output=True, check=True)
            wall.append(time.monotonic() - t0)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu.append(after.ru_utime + after.ru_stime - usage.ru_utime - usage.ru_stime)
    return [(statistics.median(w), min(w), statistics.median(c)) for w, c in zip(walls, cpus)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1000,10000,100000")
    ap.add_argument("--out", default=None, help="a folder for the sweeps' directories (default: a new one in /tmp)")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",") if s]  # --sizes "": the dry run only
    started = not cluster.is_up()
    if started:
        cluster.up(max_job_count=MAX_JOB_COUNT)
    out = Path(tempfile.mkdtemp(prefix="submit_bench_", dir=args.out))
    env = {**cluster.client_env(), "HPC_BENCH_OUT": str(out)}
    config = dict(re.findall(r"^(\w+)\s+= (\S+)", slurm(["scontrol", "show", "config"], env), re.M))
    max_array, max_jobs = int(config["MaxArraySize"]), int(config["MaxJobCount"])

    import hpc_train

    pyc = any(Path(hpc_train.__file__).parent.glob("__pycache__/*.pyc"))
    print(
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; MaxArraySize {max_array}, MaxJobCount "
        f"{max_jobs}; hpc_train's bytecode: {'cached .pyc' if pyc else 'none cached'}"
        f"{', PYTHONDONTWRITEBYTECODE set' if sys.flags.dont_write_bytecode else ''}; sweeps in {out}"
    )
    # The anchor's Hydra runs from the bytecode pip compiled at install; an editable install under
    # PYTHONDONTWRITEBYTECODE (this sandbox) never caches ours, and compiling ~9,000 lines is ~0.07 s a run.
    # So the dry run is measured as found and, when none was cached, again with it compiled as pip would.
    for compiled in [False, True] if not pyc else [True]:
        if compiled and not pyc:
            subprocess.run([PY, "-m", "compileall", "-q", str(Path(hpc_train.__file__).parent)], check=True)
        ours_dry, anchor_cfg = medians(
            [[HPC_TRAIN, "submit", "--dry-run", "cluster=dev", f"out_dir={out}"], [PY, APP, "--cfg", "job"]], env
        )
        (ow, of, oc), (aw, af, ac) = ours_dry, anchor_cfg
        print(
            f"dry run (median of 15, taking turns; hpc_train's bytecode {'cached' if compiled else 'not cached'}): "
            f"hpc_train {ow:.3f} s wall (fastest {of:.3f}), {oc:.3f} s CPU; anchor (--cfg job, no script) "
            f"{aw:.3f} s wall (fastest {af:.3f}), {ac:.3f} s CPU; ratio {ow / aw:.2f}x wall (fastest "
            f"{of / af:.2f}x), {oc / ac:.2f}x CPU",
            flush=True,
        )

    first: dict[str, tuple[int, float]] = {}  # tool -> (its smallest size, CPU s a point there)

    def report(n: int, tool: str, r: dict[str, float]) -> None:
        first.setdefault(tool, (n, r["cpu_s"] / n))
        print(
            f"{n:7d}-point sweep {tool:9s} queued in {r['queued_s']:7.2f} s ({1000 * r['queued_s'] / n:5.2f} ms a "
            f"point), {r['cpu_s']:7.2f} s CPU ({1000 * r['cpu_s'] / n:5.2f} ms a point, "
            f"{r['cpu_s'] / n / first[tool][1]:4.2f}x its {first[tool][0]}-point rate); returned after "
            f"{r['returned_s']:7.2f} s; {r['sbatch_calls']:3d} sbatch call(s); peak RSS {r['rss_mb']:6.1f} MB; "
            f"exit {r['rc']}; load average {os.getloadavg()[0]:.1f}",
            flush=True,
        )

    for n in sizes:
        if 2 * n + 2000 > max_jobs:  # the cancelled tasks of the sizes before stay counted for MinJobAge
            print(f"{n}-point sweep: skipped, MaxJobCount {max_jobs} is too small; start the cluster from here")
            continue
        name = f"bench{n}"
        ours = sweep(
            [
                HPC_TRAIN,
                "submit",
                "-m",
                "cluster=dev",
                f"out_dir={out}",
                f"name={name}",
                f"train.seed=range({n})",
                "+cluster.sbatch_extra.hold=''",
            ],
            job_name(out.resolve() / f"{name}-1"),
            n,
            env,
            out / f"{name}-1" / "sweep.json",
        )
        report(n, "hpc_train", ours)
        shutil.rmtree(out / f"{name}-1", ignore_errors=True)
        if n > max_array:
            print(f"{n}-point sweep: anchor not run: its launcher queues one array of {n} > MaxArraySize {max_array}")
            continue
        anchor = sweep(
            [
                PY,
                APP,
                "-m",
                f"lr=range({n})",
                f"hydra.launcher.name=anchor{n}",
                "+hydra.launcher.additional_parameters.hold=true",
            ],
            f"anchor{n}",
            n,
            env,
            None,
        )
        report(n, "anchor", anchor)
        shutil.rmtree(out / "hydra_multirun", ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    if started:
        cluster.down()


if __name__ == "__main__":
    main()
