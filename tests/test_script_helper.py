"""What a user's script may import (hpc_train/script_helper.py): importing it imports no torch; log() rows and
committed() events reach status and report; stop_requested() reads the flag alone and, once
torch.distributed is up, agrees across ranks with one all-reduce per call."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _python(code: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
    )


def test_importing_the_helper_imports_no_torch() -> None:
    proc = _python(
        """
        import sys
        from hpc_train import script_helper as hpc
        hpc.log(step=1, loss=0.5)  # outside a job: nothing, and still no torch
        hpc.committed(1, "x")
        assert hpc.stop_requested() is False
        print("torch" in sys.modules)
        """,
        env={"HPC_TRAIN_STOP_SIGNAL": "TERM"},
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "False", proc.stdout + proc.stderr


def test_stop_requested_without_torch_distributed_is_the_local_flag() -> None:
    """The job's stop signal (HPC_TRAIN_STOP_SIGNAL) sets it; a script's own handler for it is left alone."""
    proc = _python(
        """
        import os, signal
        from hpc_train import script_helper as hpc
        before = hpc.stop_requested()
        os.kill(os.getpid(), signal.SIGUSR1)
        print(before, hpc.stop_requested())
        """,
        env={"HPC_TRAIN_STOP_SIGNAL": "USR1"},
    )
    assert proc.returncode == 0 and proc.stdout.split() == ["False", "True"], proc.stdout + proc.stderr
    own = _python(
        """
        import os, signal
        seen = []
        signal.signal(signal.SIGUSR1, lambda *_: seen.append(1))
        from hpc_train import script_helper as hpc
        os.kill(os.getpid(), signal.SIGUSR1)
        print(seen, hpc.stop_requested())
        """,
        env={"HPC_TRAIN_STOP_SIGNAL": "USR1"},
    )
    assert own.returncode == 0 and own.stdout.split() == ["[1]", "False"], own.stdout + own.stderr


def test_a_stop_signal_inherited_as_ignored_still_reaches_stop_requested() -> None:
    """nohup ignores HUP, a shell's `cmd &` INT: an ignored signal stays ignored across exec, and the helper
    used to leave it so (the stop never seen, the script killed at the grace's end)."""
    import signal

    code = "import os, signal\nfrom hpc_train import script_helper as hpc\nos.kill(os.getpid(), signal.SIGINT)\n"
    code += "print(hpc.stop_requested())\n"
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT), "HPC_TRAIN_STOP_SIGNAL": "INT"},
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    assert proc.returncode == 0 and proc.stdout.split() == ["True"], proc.stdout + proc.stderr


def test_stop_requested_agrees_across_ranks_with_one_all_reduce() -> None:
    """Two ranks over gloo: only rank 1 gets the signal; both see it at the same call, each call costs one
    all-reduce, and a call before the signal is False on both."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = """
        import os, signal
        import torch
        import torch.distributed as dist
        from hpc_train import script_helper as hpc
        dist.init_process_group("gloo")
        calls = []
        real = dist.all_reduce
        dist.all_reduce = lambda *a, **k: (calls.append(1), real(*a, **k))[1]
        first = hpc.stop_requested()
        if dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        dist.barrier()
        second = hpc.stop_requested()
        print(first, second, len(calls))
        dist.destroy_process_group()
        """
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2", "HPC_TRAIN_STOP_SIGNAL": "TERM"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(code)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT), **env, "RANK": str(r), "OMP_NUM_THREADS": "1"},
        )
        for r in range(2)
    ]
    outs = [p.communicate(timeout=180) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
        assert out.split() == ["False", "True", "2"], out + err


def test_log_and_committed_reach_status_and_report(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hpc_train import journal, report, script_helper, status
    from hpc_train.metrics import read_metrics
    from hpc_train.runs import Run

    run_dir = tmp_path / "script-1"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(
        "cluster: {executor: local, signal_lead_s: 30}\ntrain: {steps: 60}\nrequeue: {max_failures: 2}\n"
    )
    journal.log(run_dir, journal.START, 0, "1", 0, target="script")
    monkeypatch.setenv("HPC_TRAIN_RUN_DIR", str(run_dir))
    monkeypatch.setenv("HPC_TRAIN_JOB_ID", "1")
    monkeypatch.setenv("HPC_TRAIN_RESTART_COUNT", "0")
    monkeypatch.setattr(script_helper, "_last", [0.0, 0])
    times = iter([1000.0, 1002.0, 1003.0])
    monkeypatch.setattr(script_helper, "time", SimpleNamespace(time=lambda: next(times)))  # log()'s clock only
    monkeypatch.setenv("RANK", "1")
    script_helper.log(step=1, loss=9.0, tokens=1)  # another rank: nothing
    script_helper.committed(1, "nope")
    monkeypatch.setenv("RANK", "0")
    script_helper.log(step=10, loss=2.5, tokens=1000)
    script_helper.log(step=20, loss=2.0, tokens=3000, lr=3e-4)
    script_helper.committed(20, run_dir / "script_checkpoints" / "ckpt.pt")
    rows = read_metrics(run_dir)
    assert rows == [
        {"time": 1000.0, "step": 10, "loss": 2.5, "tokens_seen": 1000},
        {
            "time": 1002.0,
            "step": 20,
            "loss": 2.0,
            "step_time_s": 0.2,
            "tokens_seen": 3000,
            "tokens_per_s": 1000.0,
            "lr": 3e-4,
        },
    ]
    events = journal.read(run_dir)
    commit = journal.last(events, journal.CHECKPOINT_COMMITTED)
    assert commit is not None and commit["step"] == 20 and commit["path"].endswith("ckpt.pt")
    assert commit["job_id"] == "1" and commit["restart"] == 0 and journal.committed_step(events) == 20
    run = Run(run_dir, "script-1", "", "local", run_dir / "submitit")
    (row,) = status.status_rows([run])
    assert row["committed_step"] == 20 and row["tokens_per_s"] == 1000.0 and row["goodput"] is not None
    parts, atts, _ = report.report(run, None)
    assert atts[0]["committed_step"] == 20 and parts["allocated"] >= 0
    json.dumps(row)  # what `status --json` prints
