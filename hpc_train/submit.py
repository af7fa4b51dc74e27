"""compose -> validate -> freeze a new run directory -> submit through submitit.

Torch-free: this is the login-node path.

A run directory holds everything a (re)started attempt needs and everything it leaves:
    runs/demo-3/
        config.yaml      the resolved config, frozen at submit; attempts re-read it, never recompose
        submission.json  executor, job id, submit time
        submitit/        submitit's pickles and the per-task logs (<job>_<task>_log.out)
        checkpoints/     step_NNNNNN/ folders; only those with COMMITTED count
        events.jsonl     start / signal / checkpoint_committed / requeue / finish / fail, every attempt
        metrics.jsonl    loss, lr and step time per log interval
        summary.json     final_step, final_loss, params_sha256 (written at the end)
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Iterator

from hpc_train.config import CONF_DIR, RunConfig, compose, to_run_config
from hpc_train.sbatch import make_executor


def new_run_dir(out_dir: Path, name: str) -> Path:
    """<out_dir>/<name>-<n> with the next free n; mkdir without exist_ok, so two submits never share one."""
    out_dir.mkdir(parents=True, exist_ok=True)
    taken = [int(p.name.rsplit("-", 1)[1]) for p in out_dir.glob(f"{name}-*") if p.name.rsplit("-", 1)[1].isdigit()]
    n = max(taken, default=0) + 1
    while True:
        try:
            (out_dir / f"{name}-{n}").mkdir()
            return (out_dir / f"{name}-{n}").resolve()
        except FileExistsError:
            n += 1


@contextlib.contextmanager
def _stdio_to_devnull() -> Iterator[None]:
    """The local executor's controller inherits our stdout/stderr and outlives us: holding them, it would
    keep `hpc-train submit --no-wait | tee log` (or a test's pipe) open until the job ends. Its own
    output goes to the per-task log files."""
    saved = [os.dup(1), os.dup(2)]
    sys.stdout.flush()
    sys.stderr.flush()
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, devnull):
            os.close(fd)


def submit(overrides: list[str], config_dir: Path = CONF_DIR) -> tuple[Path, Any]:
    """Returns (run_dir, submitit job). Validation errors raise before anything is written or queued."""
    from omegaconf import OmegaConf

    cfg = compose(overrides, config_dir)
    run: RunConfig = to_run_config(cfg)  # every __post_init__ check runs here, before the run dir exists
    run_dir = new_run_dir(Path(run.out_dir), run.name)
    OmegaConf.save(cfg, run_dir / "config.yaml", resolve=True)
    from hpc_train.job import run_job

    executor = make_executor(run.cluster, run_dir / "submitit", job_name=run.name)
    with _stdio_to_devnull() if run.cluster.executor == "local" else contextlib.nullcontext():
        job = executor.submit(run_job, str(run_dir))
    record = {"executor": run.cluster.executor, "job_id": str(job.job_id), "submitted_at": time.time(),
              "overrides": overrides}
    (run_dir / "submission.json").write_text(json.dumps(record, indent=1) + "\n")
    return run_dir, job
