"""`hpc-train status` and `results` of a big sweep, this tree beside a baseline revision, on the dev cluster,
in one run.

    .venv/bin/python benchmarks/status_bench.py                        # 1,000 and 10,000 trials
    .venv/bin/python benchmarks/status_bench.py --sizes 10000 --baseline HEAD~5

Each sweep is queued on hold by this tree's submit (no trial starts, every task PENDING in squeue). Then 3
of its trials get the records a failed trial leaves (start, fail, stopped) and 20 those of a finished one
(start, finish, summary.json), written directly, and their tasks cancelled, so that the glance has trials
to show. Each command runs
3 times, the two trees taking turns: median wall seconds, the lines it printed, its widest line. The
baseline is `git archive REV` unpacked in a temporary folder and imported first (PYTHONPATH), with the same
interpreter and packages. Figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))
import cluster  # noqa: E402
from submit_bench import MAX_JOB_COUNT, cancel, queued_tasks  # noqa: E402

from hpc_train import journal  # noqa: E402
from hpc_train.plan import job_name  # noqa: E402

PY = sys.executable
# the entry point as the installed hpc-train script runs it, importing hpc_train from sys.path
CLI = "import sys; from hpc_train.cli import main; sys.exit(main())"
FAILED, FINISHED = 3, 20


def queue_on_hold(out: Path, n: int, env: dict[str, str]) -> Path:
    """A real n-trial sweep, queued on hold; returns its directory once every task is in squeue."""
    name = f"glance{n}"
    cmd = [PY, "-c", CLI, "submit", "-m", "cluster=dev", f"out_dir={out}", f"name={name}"]
    cmd += [f"train.seed=range({n})", "+cluster.sbatch_extra.hold=''"]
    subprocess.run(cmd, env=env, cwd=out, check=True, capture_output=True, timeout=600)
    sweep_dir = out / f"{name}-1"
    deadline = time.monotonic() + 300
    while queued_tasks(job_name(sweep_dir), env) < n:
        assert time.monotonic() < deadline, f"{n} tasks not queued in 300 s"
        time.sleep(1)
    return sweep_dir


def mark_trials(sweep_dir: Path, n: int, env: dict[str, str]) -> None:
    """FAILED trials with a failure's records, FINISHED with a finish's, spread over the sweep; then each is
    cancelled with `hpc-train cancel`, so that Slurm no longer holds its task pending."""
    trials = json.loads((sweep_dir / "sweep.json").read_text())["trials"]
    for k in range(FAILED + FINISHED):
        t = trials[(k * 7919) % n]  # a prime stride: spread, never twice for these sizes
        run_dir, job = Path(t["run_dir"]), t["job_id"]
        journal.log(run_dir, journal.START, 0, job, 0, world_size=2)
        if k < FAILED:
            journal.log(
                run_dir, journal.FAIL, 4, job, 0, rank=1, error="RuntimeError: CUDA error: an illegal memory access"
            )
            journal.log(run_dir, journal.STOPPED, 4, job, 0, reason="the failure budget is spent (3 failures in a row)")
            continue
        loss = 3.0 + k / 100
        (run_dir / "summary.json").write_text(json.dumps({"final_step": 60, "final_loss": loss}) + "\n")
        journal.log(run_dir, journal.FINISH, 60, job, 0, final_step=60, final_loss=loss)
    for k in range(FAILED + FINISHED):
        trial = trials[(k * 7919) % n]["run_dir"]
        subprocess.run([PY, "-c", CLI, "cancel", trial], env=env, cwd=sweep_dir, check=True, capture_output=True)


def timed(cmd: list[str], env: dict[str, str], cwd: Path) -> tuple[float, str]:
    """Run from cwd: `python -c` puts the current folder first on sys.path, and the repository's would win."""
    t0 = time.monotonic()
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return time.monotonic() - t0, proc.stdout


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1000,10000")
    ap.add_argument("--baseline", default="2cdcef2", help="the revision to compare with (default: before the glance)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    started = not cluster.is_up()
    if started:
        cluster.up(max_job_count=MAX_JOB_COUNT)
    env = cluster.client_env()
    work = Path(tempfile.mkdtemp(prefix="status_bench_"))
    base = work / "baseline"
    base.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", args.baseline, "hpc_train"], capture_output=True, check=True
    )
    subprocess.run(["tar", "-x", "-C", str(base)], input=archive.stdout, check=True)
    trees = {"baseline": {**env, "PYTHONPATH": str(base)}, "this tree": {**env, "PYTHONPATH": str(ROOT)}}
    for tree, tree_env in trees.items():
        where = subprocess.run(
            [PY, "-c", "import hpc_train; print(hpc_train.__file__)"],
            env=tree_env,
            cwd=work,
            text=True,
            capture_output=True,
            check=True,
        ).stdout.strip()
        print(f"{tree}: {args.baseline if tree == 'baseline' else 'working tree'} ({where})")
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; {args.repeats} runs each, taking turns")
    sizes = [int(s) for s in args.sizes.split(",")]
    for n in sizes:
        sweep_dir = queue_on_hold(work, n, env)
        mark_trials(sweep_dir, n, env)
        commands = {
            "status SWEEP": ["status", str(sweep_dir)],
            "status SWEEP --all": ["status", str(sweep_dir), "--all"],
            "results SWEEP": ["results", str(sweep_dir)],
            "results SWEEP --all": ["results", str(sweep_dir), "--all"],
        }
        for what, argv in commands.items():
            runs: dict[str, list[tuple[float, str]]] = {tree: [] for tree in trees}
            for _ in range(args.repeats):
                for tree, tree_env in trees.items():
                    if "--all" in argv and tree == "baseline":
                        continue  # the baseline has no --all: its plain command printed every trial
                    runs[tree].append(timed([PY, "-c", CLI, *argv], tree_env, work))
            cells = []
            for tree, got in runs.items():
                if got:
                    lines = got[-1][1].splitlines()
                    cells.append(
                        f"{tree} {statistics.median(s for s, _ in got):6.2f} s, {len(lines):6,} lines, "
                        f"widest {max(map(len, lines), default=0):3d}"
                    )
            print(f"{n:6,} trials  {what:20s}  " + "  |  ".join(cells), flush=True)
            if "--all" not in argv and n == max(sizes):  # what the glance shows (docs/operations.md's capture)
                print("\n".join(f"    {line}" for line in runs["this tree"][-1][1].splitlines()))
        cancel(
            job_name(sweep_dir),
            {a["job_id"] for a in json.loads((sweep_dir / "sweep.json").read_text())["arrays"]},
            env,
        )
    subprocess.run(["rm", "-rf", str(work)], check=False)
    if started:
        cluster.down()


if __name__ == "__main__":
    main()
