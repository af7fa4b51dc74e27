"""What submitit pickles and runs on every task: rank env, signal recorder, rendezvous, the trainer.

Importing this module is cheap and torch-free (the login node pickles `run_job` by reference); the
trainer is imported when the job runs. Exit codes: 0 finished, 144 saved-and-requeued, 1 failed.
"""

from __future__ import annotations

import os
import sys
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

from hpc_train.metrics import EVENTS, log_event, read_jsonl


def run_job(run_dir_str: str) -> dict[str, Any] | None:
    from hpc_train import env as rank_env
    from hpc_train import preempt  # imports torch

    preempt.install_handlers()  # first: a signal may arrive while torch initialises
    run_dir = Path(run_dir_str)
    if "SLURM_PROCID" not in os.environ:  # local controller restarts in place: count attempts on disk
        requeues = sum(e["event"] == "requeue" for e in read_jsonl(run_dir / EVENTS))
        os.environ["HPC_TRAIN_ATTEMPT"] = str(requeues)
    env = rank_env.from_env(os.environ)
    os.environ.update(rank_env.torchrun_vars(env))
    try:
        return _run(run_dir, env, preempt)
    except Exception as e:
        log_event(run_dir, "fail", -1, env.job_id, env.restart_count, rank=env.rank,
                  error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc(limit=5))
        raise


def _run(run_dir: Path, env: Any, preempt: Any) -> dict[str, Any] | None:
    import torch
    import torch.distributed as dist

    from hpc_train.config import load_frozen
    from hpc_train.train import train

    cfg = load_frozen(run_dir)
    # One intra-op thread pool per rank sized to its CPUs: torch's default (all cores in every rank)
    # made 4 ranks on 2 cores 35x slower per step on the dev cluster (350 ms vs 10 ms).
    cores = os.environ.get("SLURM_CPUS_PER_TASK") or max(1, (os.cpu_count() or 1) // env.local_world_size)
    torch.set_num_threads(int(cores))
    init = f"tcp://{env.master_addr}:{env.master_port}"
    try:
        dist.init_process_group("gloo", init_method=init, rank=env.rank, world_size=env.world_size,
                                timeout=timedelta(seconds=cfg.train.rendezvous_timeout_s))
    except Exception as e:
        raise RuntimeError(
            f"rank {env.rank}/{env.world_size}: rendezvous at {env.master_addr}:{env.master_port} failed "
            f"within train.rendezvous_timeout_s={cfg.train.rendezvous_timeout_s}: {e}. Check that "
            f"{env.master_addr} resolves and the port is free on it.") from e
    outcome, step = train(cfg, env, run_dir)
    dist.barrier()
    dist.destroy_process_group()
    if outcome == "requeue":
        if env.rank == 0:
            err = preempt.requeue_slurm_job(env.job_id) if env.executor == "slurm" else ""
            log_event(run_dir, "requeue", step, env.job_id, env.restart_count, error=err or None)
        sys.stdout.flush()
        sys.exit(preempt.REQUEUE_EXIT_CODE)
    if env.rank == 0:
        import json

        return json.loads((run_dir / "summary.json").read_text())
    return None
