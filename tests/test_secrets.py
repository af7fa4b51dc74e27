"""cluster.env values (API keys) stay owner-only in every file a submit writes, and the ops commands of
another user who cannot read them say so in one line."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import HPC_TRAIN, run, submit, wait_until

pytestmark = [pytest.mark.slurm, pytest.mark.xdist_group("secrets")]  # secret_runs: once, on one worker

QUICK = ["cluster=dev", "train.steps=4", "checkpoint.every_steps=4"]
NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


def mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture(scope="module")
def secret_runs(slurm_env: dict[str, str]) -> Iterator[tuple[Path, str]]:
    """A run and a two-trial sweep with +cluster.env.WANDB_API_KEY, finished, in a folder every user may
    enter (tmp_path's parents are 0700), so another user can try to read them."""
    out = Path(tempfile.mkdtemp(prefix="hpc_train_secrets_", dir="/tmp"))
    out.chmod(0o755)
    secret = f"s3cr3t-{uuid.uuid4().hex}"
    env_override = f"+cluster.env.WANDB_API_KEY={secret}"
    run_dir, _ = submit([*QUICK, f"out_dir={out}", "name=key", env_override], env=slurm_env)
    proc = run(
        [HPC_TRAIN, "submit", "-m", *QUICK, f"out_dir={out}", "name=keys", "train.seed=1,2", env_override],
        env=slurm_env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    done = [
        run_dir / "summary.json",
        out / "keys-1" / "0000" / "summary.json",
        out / "keys-1" / "0001" / "summary.json",
    ]
    wait_until(lambda: all(p.exists() for p in done), 240, "the run and both trials to finish")
    yield out, secret
    shutil.rmtree(out)


def test_files_holding_cluster_env_values_are_owner_only(secret_runs: tuple[Path, str]) -> None:
    out, secret = secret_runs
    run_dir, sweep = out / "key-1", out / "keys-1"
    assert [mode(p) for p in (run_dir / "config.yaml", run_dir / "submission.json")] == [0o600, 0o600]
    assert [
        mode(p) for p in (sweep / "sweep.json", sweep / "0000" / "config.yaml", sweep / "0001" / "config.yaml")
    ] == [0o600, 0o600, 0o600]
    assert mode(run_dir / "submitit") == mode(sweep / "submitit") == 0o700  # batch scripts, pickles, logs
    assert secret in next((run_dir / "submitit").glob("*_submission.sh")).read_text()
    # The judge: another user finds the value in no file.
    proc = subprocess.run([*NOBODY, "grep", "-rl", secret, str(out)], capture_output=True, text=True, timeout=30)
    assert proc.stdout == "" and "Permission denied" in proc.stderr, proc.stdout + proc.stderr


def test_another_user_gets_a_row_or_one_line_not_a_traceback(
    secret_runs: tuple[Path, str], slurm_env: dict[str, str]
) -> None:
    out, _ = secret_runs
    env = {**slurm_env, "HOME": "/tmp"}
    proc = run([*NOBODY, HPC_TRAIN, "status", str(out), "--json"], env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [(r["run"], r["state"]) for r in json.loads(proc.stdout)] == [
        ("key-1", "unreadable: permission denied"),
        ("keys-1", "unreadable: permission denied"),
    ]
    table = run([*NOBODY, HPC_TRAIN, "status", str(out / "keys-1" / "0001")], env=env)
    assert table.returncode == 0 and "unreadable: permission denied" in table.stdout, table.stdout + table.stderr
    for command in (["logs", str(out / "key-1")], ["report", str(out / "key-1")], ["report", str(out / "keys-1")]):
        proc = run([*NOBODY, HPC_TRAIN, *command], env=env)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert len(proc.stderr.splitlines()) == 1 and "permission denied" in proc.stderr, proc.stderr
