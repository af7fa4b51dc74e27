"""What submitit pickles and runs on every task: rank env, signal recorder, rendezvous, the trainer,
then the requeue decision against the run's budgets.

Importing this module is cheap and torch-free (the login node pickles `run_job` by reference); the
trainer is imported when the job runs. Exit codes: 0 finished, 144 saved-and-requeued, 1 failed.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

from hpc_train.metrics import EVENTS, log_event, read_jsonl

# Slurm may deliver the time-limit warning up to 60 s before the requested lead; 60 s more of margin.
TIME_LIMIT_SLACK_S = 120


def stop_reason(signals: list[str], elapsed_s: float, timeout_min: int, signal_lead_s: int) -> str:
    """"time_limit" for a USR2 near the end of the allocation, else "preempt" (SIGTERM, or USR2 sent
    early by preempt_send_user_signal, scancel --signal or `hpc-train chaos`)."""
    near_end = elapsed_s >= timeout_min * 60 - signal_lead_s - TIME_LIMIT_SLACK_S
    return "time_limit" if "SIGUSR2" in signals and "SIGTERM" not in signals and near_end else "preempt"


def budget_left(events: list[dict[str, Any]], reason: str, budgets: Any) -> tuple[bool, str]:
    """May this run requeue once more for `reason`? Counts earlier requeues in events.jsonl (pure)."""
    used = sum(1 for e in events if e["event"] == "requeue" and e.get("reason") == reason)
    limit = {"preempt": budgets.max_preemptions, "time_limit": budgets.max_time_limit_requeues,
             "failure": budgets.max_failures}[reason]
    key = {"preempt": "max_preemptions", "time_limit": "max_time_limit_requeues", "failure": "max_failures"}[reason]
    if limit != -1 and used >= limit:
        return False, f"{reason} budget spent: {used} requeues for {reason} already (requeue.{key}={limit})"
    return True, ""


def run_job(run_dir_str: str) -> dict[str, Any] | None:
    from hpc_train import env as rank_env
    from hpc_train import preempt  # imports torch

    preempt.install_handlers()  # first: a signal may arrive while torch initialises
    started, launched_at = time.monotonic(), time.time()
    run_dir = Path(run_dir_str)
    if "SLURM_PROCID" not in os.environ:  # local controller restarts in place: count attempts on disk
        requeues = sum(e["event"] == "requeue" for e in read_jsonl(run_dir / EVENTS))
        os.environ["HPC_TRAIN_ATTEMPT"] = str(requeues)
    env = rank_env.from_env(os.environ)
    os.environ.update(rank_env.torchrun_vars(env))
    print(f"==== hpc_train attempt {env.restart_count} rank {env.rank} ====", flush=True)  # `hpc-train logs --attempt`
    try:
        return _run(run_dir, env, preempt, started, launched_at)
    except Exception as e:
        log_event(run_dir, "fail", -1, env.job_id, env.restart_count, rank=env.rank,
                  error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc(limit=5))
        _requeue_after_failure(run_dir, env, preempt)
        raise


def _requeue_after_failure(run_dir: Path, env: Any, preempt: Any) -> None:
    """The first rank to fail decides (an O_EXCL file per attempt): requeue while the failure budget
    lasts, else record why the run stops. The other ranks die with it (gloo sees the closed peer)."""
    from hpc_train.config import load_frozen

    try:
        fd = os.open(run_dir / f".failed-{env.job_id}-{env.restart_count}", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        os.close(fd)
    except FileExistsError:
        return
    try:
        budgets = load_frozen(run_dir).requeue
    except Exception:  # the config itself is what fails: no point in retrying
        return
    ok, why = budget_left(read_jsonl(run_dir / EVENTS), "failure", budgets)
    if env.executor == "slurm" and preempt.slurm_job_fate(env.job_id, env.restart_count) == "cancelled":
        ok, why = False, "cancelled (scancel): not requeueing"  # ranks dying of a cancel are no crash loop
    if not ok:
        log_event(run_dir, "stopped", -1, env.job_id, env.restart_count, reason=why)
        print(f"[hpc_train] not requeueing: {why}", file=sys.stderr, flush=True)
        return
    err = preempt.requeue_slurm_job(env.job_id) if env.executor == "slurm" else ""
    log_event(run_dir, "requeue", -1, env.job_id, env.restart_count, reason="failure", error=err or None)
    if env.executor == "local":
        sys.exit(preempt.REQUEUE_EXIT_CODE)


def _rendezvous(env: Any, cfg: Any, run_dir: Path) -> Any:
    """One TCPStore rendezvous that also places ranks: every task publishes its node and
    SLURM_TOPOLOGY_ADDR, the store's host (Slurm's task 0) plans the order (topology.py) and publishes
    it, and every task joins the process group under its placed rank. Returns the placed RankEnv."""
    import dataclasses
    import json
    import socket

    import torch
    import torch.distributed as dist

    from hpc_train import topology
    from hpc_train.env import torchrun_vars

    timeout = timedelta(seconds=cfg.train.rendezvous_timeout_s)
    where = f"{env.master_addr}:{env.master_port}"
    try:
        store = dist.TCPStore(env.master_addr, env.master_port, env.world_size, is_master=env.rank == 0,
                              timeout=timeout, wait_for_workers=False)
        node = os.environ.get("SLURMD_NODENAME", env.nodes[env.node_rank])
        store.set(f"topo/{env.rank}", json.dumps([node, os.environ.get("SLURM_TOPOLOGY_ADDR", "")]))
        if env.rank == 0:
            store.wait([f"topo/{r}" for r in range(env.world_size)])
            addrs: dict[str, str] = {}
            for r in range(env.world_size):  # Slurm's task order = its node order
                n, addr = json.loads(store.get(f"topo/{r}"))
                addrs.setdefault(n, addr)
            plan = topology.placement(addrs, env.local_world_size, cfg.train.tp)
            store.set("placement", json.dumps(plan))
            (run_dir / "placement.json").write_text(json.dumps(plan, indent=1) + "\n")
        plan = json.loads(store.get("placement"))
        order = plan["nodes"]
        placed = dataclasses.replace(env, rank=order.index(node) * env.local_world_size + env.local_rank,
                                     node_rank=order.index(node), nodes=tuple(order))
        backend = "gloo"
        if torch.cuda.is_available():  # one GPU per task: the task's own if Slurm bound one, else by local rank
            torch.cuda.set_device(env.local_rank % torch.cuda.device_count())
            backend = "cpu:gloo,cuda:nccl"  # CPU tensors (resume step, verdicts) still go through gloo
        dist.init_process_group(backend, store=store, rank=placed.rank, world_size=env.world_size, timeout=timeout)
    except Exception as e:
        raise RuntimeError(
            f"task {env.rank}/{env.world_size} on {socket.gethostname()}: rendezvous at {where} failed within "
            f"train.rendezvous_timeout_s={cfg.train.rendezvous_timeout_s}: {e}. Check that {env.master_addr} "
            f"resolves here and that port {env.master_port} is free on it.") from e
    os.environ.update(torchrun_vars(placed))
    print(f"[hpc_train] placed task {env.rank} as rank {placed.rank} on {node}", flush=True)
    return placed


def _start_watchdog(limit_s: float, run_dir: Path, env: Any, preempt: Any) -> None:
    """A hung collective never returns, and no signal arrives. A daemon thread watches the loop's
    heartbeat; past `limit_s` it dumps every thread's stack to this rank's log, records the failure,
    requeues within the failure budget and ends the process, so the job fails fast instead of holding
    its nodes until the time limit. (gloo and NCCL ops release the GIL, so the thread runs.)"""
    import faulthandler
    import threading

    def watch() -> None:
        while time.monotonic() - preempt.last_beat[0] < limit_s:
            time.sleep(min(5.0, limit_s / 10))
        print(f"[hpc_train] rank {env.rank}: no step finished in train.watchdog_s={limit_s:.0f} s: hang; "
              f"stacks follow", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        log_event(run_dir, "fail", -1, env.job_id, env.restart_count, rank=env.rank,
                  error=f"hang: no step finished in train.watchdog_s={limit_s:.0f} s")
        try:
            _requeue_after_failure(run_dir, env, preempt)
        except SystemExit:
            pass
        os._exit(preempt.REQUEUE_EXIT_CODE if env.executor == "local" else 1)

    preempt.beat()
    threading.Thread(target=watch, daemon=True, name="hpc_train-watchdog").start()


def _run(run_dir: Path, env: Any, preempt: Any, started: float, launched_at: float) -> dict[str, Any] | None:
    import torch
    import torch.distributed as dist

    from hpc_train.config import load_frozen
    from hpc_train.train import train

    cfg = load_frozen(run_dir)
    if preempt.injected("raise_at_start"):
        raise RuntimeError("injected fault: raise_at_start (HPC_TRAIN_FAULT)")
    # One intra-op thread pool per rank sized to its CPUs: torch's default (all cores in every rank)
    # made 4 ranks on 2 cores 35x slower per step on the dev cluster (350 ms vs 10 ms).
    cores = os.environ.get("SLURM_CPUS_PER_TASK") or max(1, (os.cpu_count() or 1) // env.local_world_size)
    torch.set_num_threads(int(cores))
    env = _rendezvous(env, cfg, run_dir)
    _start_watchdog(cfg.train.watchdog_s, run_dir, env, preempt)
    if cfg.fn._target_:  # the user's own function, with the same services
        from hpc_train import byo

        outcome, step = byo.run(cfg, env, run_dir, launched_at)
    else:
        outcome, step = train(cfg, env, run_dir, launched_at)
    if outcome == "requeue":
        # Rank 0 decides against the budgets and tells everyone, so no rank exits with 144 alone.
        reason = stop_reason(preempt.received, time.monotonic() - started, cfg.cluster.timeout_min,
                             cfg.cluster.signal_lead_s)
        verdict = torch.tensor([1])
        if env.rank == 0:
            ok, why = budget_left(read_jsonl(run_dir / EVENTS), reason, cfg.requeue)
            fate = preempt.slurm_job_fate(env.job_id, env.restart_count) if env.executor == "slurm" else "running"
            if fate == "cancelled":  # scancel also sends SIGTERM: a cancel must not come back as a requeue
                ok, why = False, "cancelled (scancel): saved, not requeueing"
            verdict[0] = int(ok)
            if ok:
                # Slurm already requeues a job an operator requeued (`scontrol requeue`): no second call.
                err = preempt.requeue_slurm_job(env.job_id) if fate == "running" and env.executor == "slurm" else ""
                log_event(run_dir, "requeue", step, env.job_id, env.restart_count, reason=reason, error=err or None,
                          by="slurm" if fate == "requeued" else "hpc_train")
            else:
                log_event(run_dir, "stopped", step, env.job_id, env.restart_count, reason=why)
                print(f"[hpc_train] not requeueing: {why}", file=sys.stderr, flush=True)
        dist.broadcast(verdict, src=0)
        dist.destroy_process_group()
        sys.stdout.flush()
        sys.exit(preempt.REQUEUE_EXIT_CODE if verdict.item() else 1)
    dist.barrier()
    dist.destroy_process_group()
    if env.rank == 0:
        import json

        return json.loads((run_dir / "summary.json").read_text())
    return None
