"""A user's own script launched unchanged (script.py) on the dev cluster, 2 nodes x 2 ranks: a torchrun-style
DDP script with a SIGTERM handler through three interruptions of different kinds ends at its last step with
the loss of an uninterrupted run; one with no handler resumes through script.resume_args; a crash loop stops
at its failure budget."""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import pytest
from conftest import HPC_TRAIN, high_job_preempting, names, read_events, run, sacct_state, submit, wait_until

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("no_node_left_drained")]

DDP = str(Path(__file__).resolve().parent / "scripts" / "ddp_train.py")
STEPS = 300


def ddp(*extra: str) -> list[str]:
    return ["--", sys.executable, DDP, "--steps", str(STEPS), "--out", "{ckpt_dir}", *extra]


def final(run_dir: Path) -> dict:
    return json.loads((run_dir / "script_checkpoints" / "final.json").read_text())


def starts(run_dir: Path) -> list[dict]:
    return [e for e in read_events(run_dir) if e["event"] == "start"]


def wait_progress(run_dir: Path, restart: int) -> None:
    """An attempt numbered `restart` or later started and its script saved a checkpoint since. (Or later: an
    attempt may fail before it starts, e.g. its rendezvous port taken by another cluster's job on this host.)"""
    wait_until(lambda: any(e["restart"] >= restart for e in starts(run_dir)), 120, f"attempt {restart}")
    began = time.time()
    ckpt = run_dir / "script_checkpoints" / "ckpt.pt"
    wait_until(lambda: ckpt.exists() and ckpt.stat().st_mtime > began, 60, f"a save in attempt {restart}")


def test_a_ddp_script_with_a_handler_survives_three_kinds_of_interruption(
    slurm_env: dict[str, str], tmp_path: Path
) -> None:
    common = ["cluster=dev", "cluster.tasks_per_node=1", f"out_dir={tmp_path}"]  # 2 ranks on 2 nodes
    ref_dir, ref_id = submit([*common, "cluster.partition=debug", "name=ref", *ddp()], env=slurm_env)
    # script.checkpoint only names the file, for the start event's resumed_from: the script resumes by itself
    storm = [*common, "cluster.partition=low", "name=storm", "script.checkpoint=script_checkpoints/ckpt.pt"]
    run_dir, job_id = submit([*storm, *ddp("--stop-save-s", "1.5")], env=slurm_env)
    chaos = lambda action: run([HPC_TRAIN, "chaos", str(run_dir), action], env=slurm_env)  # noqa: E731
    wait_progress(run_dir, 0)
    assert chaos("time-limit").returncode == 0
    wait_progress(run_dir, 1)
    assert chaos("requeue").returncode == 0
    wait_progress(run_dir, starts(run_dir)[-1]["restart"] + 1)
    high_job_preempting(slurm_env, [], nodes=",".join(sorted(set(starts(run_dir)[-1]["nodes"]))))(job_id)
    wait_until(lambda: (run_dir / "summary.json").exists(), 240, "the interrupted run's end")
    wait_until(lambda: (ref_dir / "summary.json").exists(), 120, "the reference's end")
    ours, ref = final(run_dir), final(ref_dir)
    assert ours["step"] == ref["step"] == STEPS
    # Not bit-exact: DDP rebuilds its buckets after the first step of each attempt, which changes the order of
    # gloo's sums (3e-8 relative seen at 4 ranks; issue 19 part 4f). The same step, the same loss to 1e-6.
    assert ours["loss"] == pytest.approx(ref["loss"], rel=1e-6)
    events = read_events(run_dir)
    assert len(starts(run_dir)) >= 4
    signals = [e for e in events if e["event"] == "signal"]
    assert [e["sent"] for e in signals] == ["TERM"] * len(signals) and len(signals) >= 3
    assert any(e["signals"] == ["SIGUSR2"] for e in signals)  # the time-limit drill, forwarded as TERM
    for attempt in starts(run_dir)[1:]:
        assert attempt["resumed_from"].endswith("ckpt.pt")
    log = (run_dir / "submitit" / f"{job_id}_0_log.out").read_text()
    assert log.count("stopping at step") >= 3 and "resumed at step" in log
    # one TERM per stop, within a 1.5 s stop save: Slurm's own (the preemption) is not sent again (issue 29)
    assert set(re.findall(r"stopping at step \d+ after (\d+) TERM", log)) == {"1"}, log
    wait_until(lambda: sacct_state(job_id, slurm_env) == "COMPLETED", 60, "COMPLETED in sacct")
    print(f"exact: {ours['params_sha256'] == ref['params_sha256']}; loss {ours['loss']} vs {ref['loss']}")


def test_a_script_without_a_handler_resumes_through_resume_args(slurm_env: dict[str, str], tmp_path: Path) -> None:
    """TERM kills it (default action); the next attempt appends --resume because ckpt.pt exists."""
    run_dir, job_id = submit(
        [
            "cluster=dev",
            "cluster.nodes=1",
            f"out_dir={tmp_path}",
            "script.checkpoint=script_checkpoints/ckpt.pt",
            "script.resume_args=[--resume]",
            *ddp("--no-handler"),
        ],
        env=slurm_env,
    )
    wait_progress(run_dir, 0)
    assert run([HPC_TRAIN, "chaos", str(run_dir), "time-limit"], env=slurm_env).returncode == 0
    wait_until(lambda: (run_dir / "summary.json").exists(), 180, "the run's end")
    first, second = starts(run_dir)[:2]
    assert "--resume" not in first["cmd"] and second["cmd"][-1] == "--resume"
    assert final(run_dir)["step"] == STEPS
    requeues = [e for e in read_events(run_dir) if e["event"] == "requeue"]
    assert [(e["reason"], e["by"]) for e in requeues] == [("preempt", "hpc_train")]
    log = (run_dir / "submitit" / f"{job_id}_0_log.out").read_text()
    assert "resumed at step" in log and "stopping at step" not in log


def test_a_crashing_script_stops_at_its_failure_budget(slurm_env: dict[str, str], tmp_path: Path) -> None:
    run_dir, _ = submit(
        ["cluster=dev", "cluster.nodes=1", "requeue.max_failures=1", f"out_dir={tmp_path}", *ddp("--crash-at", "3")],
        env=slurm_env,
    )
    wait_until(lambda: any(e["event"] == "stopped" for e in read_events(run_dir)), 180, "the stop")
    events = read_events(run_dir)
    fails = [e for e in events if e["event"] == "fail"]
    assert len(fails) == 2 and "script exited with code 1" in fails[0]["error"]
    assert "crash at step 3" in fails[0]["output"]
    assert [e["reason"] for e in events if e["event"] == "requeue"] == ["failure"]
    stopped = next(e for e in events if e["event"] == "stopped")
    assert names(stopped["reason"], "failure budget spent", "1 failure requeues")
    assert not (run_dir / "summary.json").exists()


def test_a_script_that_requeues_itself_at_the_time_limit_spends_its_budget(
    slurm_env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 29 D2: with script.stop_signal=USR1 Lightning's auto_requeue runs `scontrol requeue` from inside the job
    at the time-limit warning, and we recorded Slurm's own requeue, no budget spent: such a script requeued for
    ever. Now it is `requeue` by=inside_job, counted under requeue.max_time_limit_requeues (1 here): the first
    requeue resumes the script; the second spends the budget, the run stops and the job its script requeued is
    cancelled, so it never starts again."""
    import math

    from hpc_train import slurm
    from hpc_train.slurm import parse_key_values, time_limit_min

    monkeypatch.setenv("SLURM_CONF", slurm_env["SLURM_CONF"])  # slurm.job_states below runs in this process
    script = str(Path(__file__).resolve().parent / "scripts" / "self_requeue.py")
    run_dir, job_id = submit(
        [
            "cluster=dev",
            "cluster.tasks_per_node=1",
            "cluster.partition=debug",
            "script.stop_signal=USR1",
            "script.checkpoint=script_checkpoints/ckpt.json",
            "requeue.max_time_limit_requeues=1",
            f"out_dir={tmp_path}",
            "name=selfrq",
            "--",
            sys.executable,
            script,
            "{ckpt_dir}",
        ],
        env=slurm_env,
    )

    def warn_near_the_end(attempt: int) -> None:
        """The attempt's children run; its EndTime 2-3 min away (within signal_lead_s + the slack: the time-limit
        warning, not an early USR2 of a preemption); then Slurm's warning, as `hpc-train chaos time-limit`."""
        wait_until(lambda: any(e["restart"] >= attempt for e in starts(run_dir)), 120, f"attempt {attempt}")
        job = parse_key_values(run(["scontrol", "show", "job", "-o", job_id], env=slurm_env).stdout)
        limit = math.ceil(time_limit_min(job["RunTime"]) + 2)
        assert run(["scontrol", "update", f"JobId={job_id}", f"TimeLimit={limit}"], env=slurm_env).returncode == 0
        assert run([HPC_TRAIN, "chaos", str(run_dir), "time-limit"], env=slurm_env).returncode == 0

    try:
        warn_near_the_end(0)
        wait_until(lambda: any(e["event"] == "requeue" for e in read_events(run_dir)), 120, "the first decision")
        warn_near_the_end(1)
        wait_until(lambda: any(e["event"] == "stopped" for e in read_events(run_dir)), 120, "the second decision")
        # accounting keeps the requeued run's REQUEUED for a job cancelled as it was requeued (22.05): Slurm's
        # answer is job_states' (squeue first), as status gives it
        cancelled = lambda: slurm.job_states([job_id]).get(job_id) == "CANCELLED"  # noqa: E731
        wait_until(cancelled, 60, "the requeued job cancelled")
    finally:
        run(["scancel", job_id], env=slurm_env)
    events = read_events(run_dir)
    signals = [e for e in events if e["event"] == "signal"]
    assert [(e["reason"], e["sent"]) for e in signals] == [("time_limit", "USR1")] * 2, signals
    (requeue,) = [e for e in events if e["event"] == "requeue"]
    assert requeue["by"] == "inside_job" and requeue["reason"] == "time_limit", requeue
    stopped = next(e for e in events if e["event"] == "stopped")
    assert stopped["reason"].startswith("time_limit budget spent: 1 requeues") and "cancelled" in stopped["reason"]
    assert starts(run_dir)[-1]["resumed_from"].endswith("ckpt.json")  # the first requeue resumed the script
    time.sleep(15)  # past cred_expire (10 s): a requeued job not cancelled would have started again
    assert len(starts(run_dir)) == 2 and cancelled()
