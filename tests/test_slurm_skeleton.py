"""The walking skeleton on the real four-node cluster: submit -> train -> preempt -> requeue -> resume.

Every interrupted run must end with the same params_sha256 as the uninterrupted one.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import cluster
import pytest
from conftest import high_job_preempting, interrupted_run, run, sacct_state, wait_until

pytestmark = pytest.mark.slurm


def test_two_node_gloo_allreduce(slurm_env: dict[str, str], tmp_path: Path) -> None:
    """Four ranks on two "nodes" rendezvous through hpc_train.env and all-reduce over gloo."""
    script = tmp_path / "allreduce.py"
    script.write_text(
        textwrap.dedent("""
        import os, socket, torch, torch.distributed as dist
        from hpc_train.env import from_env
        env = from_env(os.environ)
        dist.init_process_group("gloo", init_method=f"tcp://{env.master_addr}:{env.master_port}",
                                rank=env.rank, world_size=env.world_size)
        t = torch.tensor([float(env.rank + 1)])
        dist.all_reduce(t)
        print(f"rank={env.rank} node={env.node_rank} host={socket.gethostname()} sum={t.item():.0f}", flush=True)
        dist.destroy_process_group()
    """)
    )
    out = tmp_path / "out.txt"
    proc = run(
        [
            "sbatch",
            "--parsable",
            "-N",
            "2",
            "--ntasks-per-node=2",
            "-o",
            str(out),
            "--wrap",
            f"srun {sys.executable} {script}",
        ],
        env=slurm_env,
    )
    assert proc.returncode == 0, proc.stderr
    job_id = proc.stdout.strip().split(";")[0]
    wait_until(
        lambda: sacct_state(job_id, slurm_env) in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"),
        90,
        f"job {job_id} to end",
    )
    assert sacct_state(job_id, slurm_env) == "COMPLETED", out.read_text()
    lines = sorted(l for l in out.read_text().splitlines() if l.startswith("rank="))
    assert len(lines) == 4, out.read_text()
    assert all(l.endswith("sum=10") for l in lines)  # 1+2+3+4 on every rank
    assert len({l.split()[2] for l in lines}) == 2  # two distinct hostnames: really two nodes


def test_uninterrupted(reference: dict) -> None:
    assert reference["final_step"] == 60
    assert len(reference["params_sha256"]) == 64
    assert reference["final_loss"] < 5.0  # ln(256) = 5.55 at the start: it learned something


def test_preempted_by_high_partition_job(slurm_env: dict[str, str], tmp_path: Path, reference: dict) -> None:
    """A real preemption: Slurm sends SIGTERM to every task (and the batch shell), then requeues."""
    high: list[str] = []
    summary, events = interrupted_run(slurm_env, tmp_path, "preempted", high_job_preempting(slurm_env, high))
    assert summary["params_sha256"] == reference["params_sha256"]
    assert summary["final_loss"] == reference["final_loss"]
    signals = [e for e in events if e["event"] == "signal"]
    assert signals and "SIGTERM" in signals[0]["signals"]
    starts = [e for e in events if e["event"] == "start"]
    assert [s["restart"] for s in starts] == [0, 1]
    assert starts[1]["step"] == signals[0]["step"]  # resumed exactly where it saved: no lost steps
    wait_until(lambda: sacct_state(high[0], slurm_env) == "COMPLETED", 60, "the high job to complete")


def test_preempted_with_preempt_send_user_signal(slurm_env: dict[str, str], tmp_path: Path, reference: dict) -> None:
    """Clusters with SlurmctldParameters=preempt_send_user_signal send the --signal signal (USR2) at
    preemption instead of SIGTERM first; the run must save and resume the same way."""

    cluster.reconfigure(ctld_parameters="preempt_send_user_signal")
    try:
        summary, events = interrupted_run(slurm_env, tmp_path, "usersig", high_job_preempting(slurm_env, []))
    finally:
        cluster.reconfigure()
    assert summary["params_sha256"] == reference["params_sha256"]
    signals = [e for e in events if e["event"] == "signal"]
    assert signals and signals[0]["signals"][0] == "SIGUSR2"
    # Slurm moved EndTime to PreemptTime + GraceTime (30 s): near the end, yet a preemption (PreemptTime set)
    assert signals[0]["reason"] == "preempt" and signals[0]["left_s"] <= 30, signals[0]
    assert [e["restart"] for e in events if e["event"] == "start"] == [0, 1]


def test_time_limit_warning_usr2(slurm_env: dict[str, str], tmp_path: Path, reference: dict) -> None:
    """`scancel --signal=USR2` is what Slurm's --signal=USR2@lead delivers before the time limit."""

    def warn(job_id: str) -> None:
        proc = run(["scancel", "--signal=USR2", job_id], env=slurm_env)
        assert proc.returncode == 0, proc.stderr

    summary, events = interrupted_run(slurm_env, tmp_path, "usr2", warn)
    assert summary["params_sha256"] == reference["params_sha256"]
    signals = [e for e in events if e["event"] == "signal"]
    assert signals and signals[0]["signals"] == ["SIGUSR2"]
    requeues = [e for e in events if e["event"] == "requeue"]
    assert len(requeues) == 1 and requeues[0]["by"] == "hpc_train"  # our own `scontrol requeue` succeeded
    starts = [e for e in events if e["event"] == "start"]
    assert [s["restart"] for s in starts] == [0, 1] and starts[1]["step"] == signals[0]["step"]


def test_signal_to_batch_shell_only_is_relayed(slurm_env: dict[str, str], tmp_path: Path, reference: dict) -> None:
    """`scancel --batch` reaches only the batch shell, as `--signal=B:` and preempt_send_user_signal do.
    Untrapped, USR2 would kill bash and the job unsaved; the script relays it to every task instead."""

    def batch_only(job_id: str) -> None:
        proc = run(["scancel", "--batch", "--signal=USR2", job_id], env=slurm_env)
        assert proc.returncode == 0, proc.stderr

    summary, events = interrupted_run(slurm_env, tmp_path, "batch", batch_only)
    assert summary["params_sha256"] == reference["params_sha256"]
    assert [e["signals"] for e in events if e["event"] == "signal"] == [["SIGUSR2"]]
    assert [e["restart"] for e in events if e["event"] == "start"] == [0, 1]
