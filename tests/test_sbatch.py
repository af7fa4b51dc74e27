"""Golden files pin the batch script exactly as submitted. Refresh after an intended change with
    HPC_TRAIN_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/test_sbatch.py
and review the diff."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hpc_train.config import compose, to_run_config
from hpc_train.sbatch import render

GOLDEN = Path(__file__).parent / "golden"


@pytest.mark.parametrize("name, overrides", [
    ("dev", ["cluster=dev"]),
    ("slurm_gpu_setup", ["cluster=slurm", "cluster.gpus_per_node=8", "cluster.tasks_per_node=8", "cluster.mem_gb=480",
                         "cluster.partition=gpu", "cluster.setup=['module load cuda/12.4','export NCCL_DEBUG=WARN']"]),
])
def test_rendered_script_matches_golden(name: str, overrides: list[str]) -> None:
    run = to_run_config(compose(overrides))
    script = render(run.cluster, "golden", Path("/runs/golden-1/submitit"),
                    "/venv/bin/python -u -m submitit.core._submit /runs/golden-1/submitit")
    path = GOLDEN / f"{name}.sbatch"
    if os.environ.get("HPC_TRAIN_UPDATE_GOLDEN"):
        path.write_text(script)
    assert path.exists(), f"no golden file {path}; create it with HPC_TRAIN_UPDATE_GOLDEN=1"
    assert script == path.read_text(), (
        f"rendered script differs from {path}; if the change is intended, refresh with "
        f"HPC_TRAIN_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/test_sbatch.py and review the diff")
