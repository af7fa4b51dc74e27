"""Golden files pin the batch script exactly as submitted. Refresh after an intended change with
    HPC_TRAIN_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/test_sbatch.py
and review the diff."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

import hpc_train
from hpc_train.config import compose, to_run_config
from hpc_train.sbatch import render

GOLDEN = Path(__file__).parent / "golden"


@pytest.mark.parametrize("name, overrides, array_size, max_parallel", [
    ("dev", ["cluster=dev"], None, None),
    ("dev_array", ["cluster=dev", "+cluster.env.MSG=\"it's $(x) `y`; z\""], 500, 16),
    ("apptainer", ["cluster=slurm", "cluster.template=apptainer", "+cluster.template_vars.image=/img/a b.sif",
                   "cluster.launcher=[apptainer,exec,--nv,'/img/a b.sif']"], None, None),
    ("slurm_gpu_setup", ["cluster=slurm", "cluster.gpus_per_node=8", "cluster.tasks_per_node=8", "cluster.mem_gb=480",
                         "cluster.partition=gpu", "cluster.setup=['module load cuda/12.4','export NCCL_DEBUG=WARN']"],
     None, None),
])
def test_rendered_script_matches_golden(name: str, overrides: list[str], array_size: int | None,
                                        max_parallel: int | None) -> None:
    run = to_run_config(compose(overrides))
    script = render(run.cluster, "golden-1", Path("/runs/golden-1/submitit"), array_size, max_parallel)
    script = script.replace(sys.executable, "/venv/bin/python")  # the golden file is machine-independent
    script = script.replace(str(Path(hpc_train.__file__).resolve().parent), "/venv/hpc_train")  # start.py
    path = GOLDEN / f"{name}.sbatch"
    if os.environ.get("HPC_TRAIN_UPDATE_GOLDEN"):
        path.write_text(script)
    assert path.exists(), f"no golden file {path}; create it with HPC_TRAIN_UPDATE_GOLDEN=1"
    assert script == path.read_text(), (
        f"rendered script differs from {path}; if the change is intended, refresh with "
        f"HPC_TRAIN_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/test_sbatch.py and review the diff")


def test_switches_request() -> None:
    run = to_run_config(compose(["cluster=dev", "cluster.switches='1@30:00'"]))
    script = render(run.cluster, "s-1", Path("/runs/s-1/submitit"))
    assert "#SBATCH --switches=1@30:00\n" in script
    with pytest.raises(ValueError, match=r"cluster.switches='one' is not sbatch's <count>\[@<max wait>\]"):
        to_run_config(compose(["cluster=dev", "cluster.switches=one"]))
