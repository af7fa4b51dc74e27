"""A real `@hydra.main` app swept through `hydra/launcher=hpc_train` on the dev cluster (docs/hydra.md): a training
app that keeps its own checkpoint file, unchanged; one trial preempted, one given a time-limit warning, each
resumed from its own file and finished as an uninterrupted run would, to the bit."""

from __future__ import annotations

import importlib.util
import json
import math
import re
import sys
import time
from pathlib import Path

import pytest
from conftest import HPC_TRAIN, read_events, run, sacct_state, wait_until

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("no_node_left_drained")]

TRAIN = Path(__file__).resolve().parent / "scripts" / "hydra_train" / "app.py"
RATES = (0.02, 0.05, 0.1)


def reference(lr: float, tmp_path: Path, steps: int = 40) -> float:
    """The app's own loop, uninterrupted, here: its loss after `steps` (its final one by default)."""
    spec = importlib.util.spec_from_file_location("hydra_train_app", TRAIN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.train(steps, lr, 0, str(tmp_path / f"ref-{lr}-{steps}.pt"))


def starts(trial: Path) -> list[dict]:
    return [e for e in read_events(trial) if e["event"] == "start"]


def test_a_sweep_of_a_training_app_survives_a_preemption_and_a_time_limit(
    slurm_env: dict[str, str], tmp_path: Path
) -> None:
    sweep = tmp_path / "sw"
    began = time.monotonic()
    proc = run(
        [
            sys.executable,
            str(TRAIN),
            "-m",
            "hydra/launcher=hpc_train",
            "hydra.launcher.partition=debug",
            "hydra.launcher.signal_lead_s=90",  # cluster=dev's: > the save + Slurm's 60 s early delivery
            "hydra.launcher.checkpoint=ckpt.pt",  # the app's own file, in its output folder: resumed_from, progress
            f"lr={','.join(map(str, RATES))}",
            f"hydra.sweep.dir={sweep}",
        ],
        env=slurm_env,
        cwd=tmp_path,
        timeout_s=120,
    )
    queued_s = time.monotonic() - began
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "hpc_train: 3 trial(s) queued in 1 sbatch call(s)" in proc.stdout, proc.stdout
    trials = [sweep / str(i) for i in range(3)]
    jobs = [t["job_id"] for t in json.loads((sweep / "sweep.json").read_text())["trials"]]
    chaos = lambda trial, action: run([HPC_TRAIN, "chaos", str(trial), action], env=slurm_env)  # noqa: E731

    # the app saves ckpt.pt every 10 steps of 0.25 s: each interruption lands after its first save, mid-run
    wait_until(lambda: (trials[0] / "ckpt.pt").exists(), 120, "trial 0's first save")
    assert chaos(trials[0], "preempt").returncode == 0  # TERM to every task, as a preemption
    wait_until(lambda: (trials[1] / "ckpt.pt").exists(), 120, "trial 1's first save")
    # A time-limit warning: the job's end brought within signal_lead_s + 120 s (as an administrator's
    # `scontrol update TimeLimit=` does), then Slurm's USR2: judged the time limit, not a preemption.
    from hpc_train.slurm import parse_key_values, time_limit_min

    job = parse_key_values(run(["scontrol", "show", "job", "-o", jobs[1]], env=slurm_env).stdout)
    limit = math.ceil(time_limit_min(job["RunTime"]) + 2)
    assert run(["scontrol", "update", f"JobId={jobs[1]}", f"TimeLimit={limit}"], env=slurm_env).returncode == 0
    assert chaos(trials[1], "time-limit").returncode == 0

    wait_until(lambda: all((t / "summary.json").exists() for t in trials), 240, "every trial's end")
    for trial, lr in zip(trials, RATES):  # the app's own final loss, as an uninterrupted run's
        assert json.loads((trial / "job_return.json").read_text())["value"] == reference(lr, tmp_path), trial
    requeues = [[e["reason"] for e in read_events(t) if e["event"] == "requeue"] for t in trials]
    assert requeues[0] == ["preempt"] and requeues[1] == ["time_limit"], requeues
    for trial in trials[:2]:
        assert len(starts(trial)) == 2 and starts(trial)[1]["resumed_from"] == str(trial / "ckpt.pt")
    log = "".join(p.read_text() for p in (sweep / "submitit").glob("*_log.out"))
    assert log.count("stopping at step") >= 2 and log.count("resumed at step") >= 2, log
    assert requeues[2] == [] and len(starts(trials[2])) == 1  # the third ran straight through
    for trial in trials:  # Hydra's layout, written by each attempt from the frozen config
        assert (trial / ".hydra" / "overrides.yaml").is_file() and (trial / "app.log").exists()
    for job_id in jobs:
        wait_until(lambda: sacct_state(job_id, slurm_env) == "COMPLETED", 60, f"job {job_id} COMPLETED")
    rows = json.loads(run([HPC_TRAIN, "results", str(sweep), "--json"], env=slurm_env).stdout)
    assert [(r["overrides"]["lr"], r["state"]) for r in rows] == [(str(lr), "COMPLETED") for lr in RATES]
    print(
        f"queued in {queued_s:.2f} s (the command returned then); all three finished in {time.monotonic() - began:.0f} s"
    )


def test_a_run_without_m_is_queued_and_a_waited_sweep_returns_once_its_trials_ended(
    slurm_env: dict[str, str], tmp_path: Path
) -> None:
    """The anchor app (what users sweep with submitit_slurm today), only the launcher changed: without -m one run is
    queued in hydra.run.dir and the command returns; with hydra.launcher.wait=true the sweep's command returns once
    every trial ended, as submitit's does, with what each task returned."""
    anchor = Path(__file__).resolve().parent.parent / "benchmarks" / "hydra_anchor" / "app.py"
    env = {**slurm_env, "HPC_BENCH_OUT": str(tmp_path)}  # its hydra.sweep.dir reads it
    one = tmp_path / "outputs" / "one"
    proc = run([sys.executable, str(anchor), "hydra/launcher=hpc_train", "lr=3", f"hydra.run.dir={one}"], env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "hpc_train: submitted job" in proc.stdout and f"run directory {one}" in proc.stdout, proc.stdout
    waited = tmp_path / "waited"
    cmd = [sys.executable, str(anchor), "-m", "hydra/launcher=hpc_train", "hydra.launcher.wait=true", "lr=1,2"]
    proc = run([*cmd, f"hydra.sweep.dir={waited}"], env=env, timeout_s=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for num, value in ((0, 1.0), (1, 2.0)):  # ended before the command returned
        assert (waited / str(num) / "summary.json").exists()
        assert json.loads((waited / str(num) / "job_return.json").read_text()) == {
            "status": "COMPLETED",
            "value": value,
        }
    wait_until(lambda: (one / "summary.json").exists(), 120, "the run without -m to finish")
    assert json.loads((one / "job_return.json").read_text())["value"] == 3.0
    assert (one / ".hydra" / "config.yaml").read_text() == "lr: 3\n"


def test_the_same_sweep_under_submitit_slurm_returns_a_preempted_trial_cut_short(
    slurm_env: dict[str, str], tmp_path: Path
) -> None:
    """The comparison (hydra-submitit-launcher, in the dev extra for it): the same app and sweep under
    `hydra/launcher=submitit_slurm`, trial 0 sent the same TERM after its first save. The app saves and returns, as it
    should; submitit takes that for the job's end: COMPLETED in sacct, "success", the loss at the step it stopped as
    the trial's result, never resumed (under hpc_train, above: requeued, resumed, the uninterrupted run's loss). The
    command blocks until every job ended."""
    import pickle
    import subprocess

    sweep = tmp_path / "sub"
    cmd = [sys.executable, str(TRAIN), "-m", "hydra/launcher=submitit_slurm", "hydra.launcher.partition=debug"]
    cmd += [f"lr={','.join(map(str, RATES))}", f"hydra.sweep.dir={sweep}"]
    proc = subprocess.Popen(cmd, env=slurm_env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: (sweep / "0" / "ckpt.pt").exists(), 120, "trial 0's first save under submitit")
        (folder,) = (sweep / ".submitit").glob("*_0")  # submitit's folder of the array's task 0: its job id
        assert run(["scancel", "--signal=TERM", folder.name], env=slurm_env).returncode == 0
        out, err = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == 0, out + err  # the sweep "succeeded"
    log = (folder / f"{folder.name}_0_log.out").read_text()
    stopped_at = int(re.search(r"stopping at step (\d+)", log).group(1))
    assert "resumed at step" not in log and stopped_at < 40, log
    outcome, ret = pickle.loads((folder / f"{folder.name}_0_result.pkl").read_bytes())
    assert outcome == "success" and ret.return_value == reference(RATES[0], tmp_path, steps=stopped_at)
    assert ret.return_value != reference(RATES[0], tmp_path)  # not the trial's result: 40 steps were asked
    assert sacct_state(folder.name, slurm_env) == "COMPLETED"
    print(f"submitit_slurm: trial 0 ended at step {stopped_at} of 40, loss {ret.return_value:.4f}, COMPLETED")
