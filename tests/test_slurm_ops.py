"""The on-call's tools against the real cluster: status, report, cancel, chaos."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
from conftest import HPC_TRAIN, RUN_ARGS, names, read_events, run, sacct_state, submit, wait_until

from hpc_train import journal

pytestmark = pytest.mark.slurm


def ops(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    proc = run([HPC_TRAIN, *args], env=env, timeout_s=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def wait_event(run_dir: Path, name: str, restart: int, timeout_s: float = 180) -> None:
    wait_until(
        lambda: any(e["event"] == name and e["restart"] == restart for e in read_events(run_dir)),
        timeout_s,
        f"{name} in attempt {restart} of {run_dir.name}",
    )


def test_status_of_a_sweep_with_preempted_failed_and_finished_trials(slurm_env: dict[str, str], tmp_path: Path) -> None:
    proc = run(
        [
            HPC_TRAIN,
            "submit",
            "-m",
            *RUN_ARGS,
            f"out_dir={tmp_path}",
            "name=mix",
            "requeue.max_failures=0",
            "+cluster.env.HPC_TRAIN_FAULT=none,none,raise_at_start_always",
        ],
        env=slurm_env,
        timeout_s=120,
    )
    assert proc.returncode == 0, proc.stderr
    sweep = next(tmp_path.glob("mix-*"))
    finished, preempted, failed = (sweep / f"{i:04d}" for i in range(3))
    wait_event(preempted, "checkpoint_committed", 0)
    ops(["chaos", str(preempted), "preempt"], slurm_env)
    wait_until(lambda: all((d / "summary.json").exists() for d in (finished, preempted)), 300, "two trials to finish")
    wait_until(lambda: any(e["event"] == "stopped" for e in read_events(failed)), 120, "the failing trial to stop")
    ids = [t["job_id"] for t in json.loads((sweep / "sweep.json").read_text())["trials"]]
    wait_until(
        lambda: [sacct_state(j, slurm_env) for j in ids] == ["COMPLETED", "COMPLETED", "FAILED"],
        60,
        "Slurm to agree: COMPLETED, COMPLETED, FAILED",
    )
    rows = json.loads(ops(["status", str(sweep), "--json"], slurm_env).stdout)
    got = [(r["run"].split("/")[1], r["state"], r["attempts"], r["restarts"], r["committed_step"]) for r in rows]
    assert got == [("0000", "COMPLETED", 1, 0, 60), ("0001", "COMPLETED", 2, 1, 60), ("0002", "FAILED", 1, 0, None)]
    (warning,) = rows[2]["warnings"]
    assert names(warning, "failure budget spent", "requeue.max_failures=0")
    assert 0 < rows[1]["goodput"] < rows[0]["goodput"] <= 1  # the preempted trial lost some time
    table = ops(["status", str(sweep)], slurm_env).stdout
    print(table)  # docs/operations.md's capture (pytest -s)
    assert "mix-1/0001" in table and "COMPLETED" in table and "FAILED" in table


def test_report_of_a_run_preempted_twice(slurm_env: dict[str, str], tmp_path: Path) -> None:
    # 0.5 s a step: the second `chaos preempt` lands before attempt 1's last step on loaded cores too
    run_dir, _ = submit([*RUN_ARGS, "train.min_step_time_s=0.5", f"out_dir={tmp_path}", "name=rep"], env=slurm_env)
    for restart in (0, 1):
        wait_event(run_dir, "checkpoint_committed", restart)
        ops(["chaos", str(run_dir), "preempt"], slurm_env)
        wait_event(run_dir, "requeue", restart)
    wait_until(lambda: (run_dir / "summary.json").exists(), 300, "the third attempt to finish")
    out = ops(["report", str(run_dir)], slurm_env).stdout
    assert "goodput" in out and "picture:" in out
    from hpc_train.metrics import read_jsonl

    events, metrics = read_events(run_dir), read_jsonl(run_dir / "metrics.jsonl")
    parts = journal.goodput(events, metrics)
    wall = sum(a["end"] - a["launched"] for a in journal.attempts(events))
    assert len(journal.attempts(events)) == 3
    summed = parts["committed"] + parts["lost"] + parts["stall"] + parts["overhead"]
    assert abs(summed - wall) <= 0.02 * wall, (parts, wall)
    assert parts["queue_wait"] > 10  # two requeues on the dev cluster: ~15-20 s each
    png = run_dir / "report.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    import matplotlib.image

    assert matplotlib.image.imread(png).shape[:2] == (800, 1000)  # readable: 10 x 8 inches at 100 dpi


def test_cancel_leaves_other_jobs_alone(slurm_env: dict[str, str], tmp_path: Path) -> None:
    keep_dir, keep_id = submit([*RUN_ARGS, f"out_dir={tmp_path}", "name=keep"], env=slurm_env)
    gone_dir, gone_id = submit([*RUN_ARGS, f"out_dir={tmp_path}", "name=gone"], env=slurm_env)
    wait_event(gone_dir, "start", 0)
    assert gone_id in ops(["cancel", str(gone_dir)], slurm_env).stdout
    wait_until(lambda: sacct_state(gone_id, slurm_env).startswith("CANCELLED"), 60, "the cancelled job to end")
    wait_until(lambda: (keep_dir / "summary.json").exists(), 240, "the other job to finish")
    assert sacct_state(keep_id, slurm_env) in ("COMPLETED", "RUNNING")
    events = read_events(gone_dir)
    assert "cancel" in [e["event"] for e in events] and "requeue" not in [e["event"] for e in events]
    (stopped,) = [e for e in events if e["event"] == "stopped"]
    assert names(stopped["reason"], "cancelled", "not requeueing")
    time.sleep(15)  # cred_expire + a scheduling pass: a wrongly requeued job would have restarted by now
    assert sacct_state(gone_id, slurm_env).startswith("CANCELLED")


CHAOS_ANSWERS = {"time-limit": "preempt", "requeue": None, "kill-rank": "failure", "lose-node": "failure"}


def test_chaos_actions_lead_to_requeue_and_resume(slurm_env: dict[str, str], tmp_path: Path, reference: dict) -> None:
    """time-limit (an early USR2 counts as a preemption), an operator's requeue, one rank SIGKILLed, and
    a lost node all end in a resumed run with the reference's weights. The four runs share the cluster at
    once (4 x 4 CPUs: all of it); each only waits on its own job."""
    # 0.5 s a step (weights alike): the fourth run's chaos comes after three other waits and chaos commands, and must
    # still find it running
    runs = {
        action: submit(
            [*RUN_ARGS, "train.min_step_time_s=0.5", f"out_dir={tmp_path}", f"name={action}"], env=slurm_env
        )[0]
        for action in CHAOS_ANSWERS
    }
    for action, run_dir in runs.items():
        wait_event(run_dir, "checkpoint_committed", 0)
        ops(["chaos", str(run_dir), action, "--rank", "1"], slurm_env)
    for action, run_dir in runs.items():
        wait_until(lambda: (run_dir / "summary.json").exists(), 300, f"the {action} run to resume and finish")
        events = read_events(run_dir)
        assert [e["action"] for e in events if e["event"] == "chaos"] == [action]
        assert sorted({e["restart"] for e in events if e["event"] == "start"}) == [0, 1], action
        if CHAOS_ANSWERS[action]:
            assert [e["reason"] for e in events if e["event"] == "requeue"] == [CHAOS_ANSWERS[action]], action
        assert json.loads((run_dir / "summary.json").read_text())["params_sha256"] == reference["params_sha256"], action


def test_a_sweep_cancelled_while_pending_reads_cancelled_not_pending(slurm_env: dict[str, str], tmp_path: Path) -> None:
    """A pending array task cancelled alone leaves squeue and sacct at once (Slurm 22.05 drops it from the array's
    pending record), and once the whole array is cancelled squeue lists its first task only: status read every
    such trial PENDING. The trials' own `cancel` events tell."""
    proc = run(
        [HPC_TRAIN, "submit", "-m", *RUN_ARGS, f"out_dir={tmp_path}", "name=held", "train.seed=1,2,3"]
        + ["+cluster.sbatch_extra.hold=''"],
        env=slurm_env,
        timeout_s=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    sweep = tmp_path / "held-1"

    def states() -> list[str]:
        return [r["state"] for r in json.loads(ops(["status", str(sweep), "--json"], slurm_env).stdout)]

    assert states() == ["PENDING"] * 3
    ops(["cancel", str(sweep / "0001")], slurm_env)
    wait_until(lambda: states() == ["PENDING", "CANCELLED", "PENDING"], 30, "trial 1 cancelled")
    ops(["cancel", str(sweep)], slurm_env)
    wait_until(lambda: states() == ["CANCELLED"] * 3, 30, "every trial cancelled")


def test_a_job_requeued_and_cancelled_at_once_reads_cancelled_not_requeued(
    slurm_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The team storm's unsettled trial: `hpc-train cancel` a moment after a requeue. Slurm 22.05's accounting then
    keeps the old run's REQUEUED and never records the pending job's cancel, while squeue no longer lists it: resume
    was refused for ever ("still REQUEUED"). A waiting state of a job the controller no longer holds is stale."""
    from hpc_train import slurm

    monkeypatch.setenv("SLURM_CONF", slurm_env["SLURM_CONF"])  # job_states below runs in this process
    proc = run(
        ["sbatch", "--parsable", "--array=0-1", "--requeue", "-p", "debug", "-o", "/dev/null", "--wrap", "sleep 120"],
        env=slurm_env,
    )
    array = proc.stdout.strip()
    task = f"{array}_0"
    try:
        sacct = ["sacct", "-X", "-n", "-P", "-j", task, "-o", "State"]
        wait_until(lambda: "RUNNING" in run(sacct, env=slurm_env).stdout, 60, "running, in accounting too")
        assert run(["scontrol", "requeue", task], env=slurm_env).returncode == 0
        assert run(["scancel", task], env=slurm_env).returncode == 0
        wait_until(lambda: not run(["squeue", "-h", "-j", task], env=slurm_env).stdout.strip(), 60, "gone from squeue")
        accounted = run(sacct, env=slurm_env).stdout.split()
        states = slurm.job_states([task], strict=True)
    finally:
        run(["scancel", array], env=slurm_env)
    assert states == {task: "CANCELLED"}, (states, accounted)  # accounted: ['REQUEUED'], seen
