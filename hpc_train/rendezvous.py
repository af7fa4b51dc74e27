"""The placed rendezvous: one TCPStore where every task publishes its node and switch, the store's host plans the
rank order (topology.py), and every task joins the process group under its placed rank."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
from datetime import timedelta
from typing import Any

from hpc_train import preempt, ranklog
from hpc_train.paths import RunPaths, hold_for_life, make_dir
from hpc_train.task import Task

log = logging.getLogger(__name__)


def join(env: Any, cfg: Any, paths: RunPaths, task: Task, keep_order: bool = False) -> Any:
    """One TCPStore rendezvous that also places ranks: every task publishes its node and
    SLURM_TOPOLOGY_ADDR, the store's host (Slurm's task 0) plans the order (topology.py) and publishes
    it, and every task joins the process group under its placed rank. Returns the placed RankEnv.
    keep_order: env.nodes is the order (an in-process restart's plan: re-planned by switch, a standby in a dead
    node's place swapped the survivors' ranks, and their state with them)."""
    import torch
    import torch.distributed as dist

    from hpc_train import topology
    from hpc_train.env import torchrun_vars

    timeout = timedelta(seconds=cfg.train.rendezvous_timeout_s)
    where = f"{env.master_addr}:{env.master_port}"
    try:
        store = dist.TCPStore(
            env.master_addr,
            env.master_port,
            env.world_size,
            is_master=env.rank == 0,
            timeout=timeout,
            wait_for_workers=False,
        )
        node = os.environ.get("SLURMD_NODENAME", env.nodes[env.node_rank])
        store.set(f"topo/{env.rank}", json.dumps([node, os.environ.get("SLURM_TOPOLOGY_ADDR", "")]))
        if env.rank == 0:
            store.wait([f"topo/{r}" for r in range(env.world_size)])
            addrs: dict[str, str] = {}
            for r in range(env.world_size):  # Slurm's task order = its node order
                n, addr = json.loads(store.get(f"topo/{r}"))
                addrs.setdefault(n, addr)
            plan = topology.placement(addrs, env.local_world_size, cfg.train.tp, env.nodes if keep_order else None)
            store.set("placement", json.dumps(plan))
            paths.placement.write_text(json.dumps(plan, indent=1) + "\n")
        plan = json.loads(store.get("placement"))
        order = plan["nodes"]
        placed = dataclasses.replace(
            env,
            rank=order.index(node) * env.local_world_size + env.local_rank,
            node_rank=order.index(node),
            nodes=tuple(order),
        )
        backend = "gloo"
        # One GPU per task: the task's own if Slurm bound one, else by local rank. Not for a script: its GPU
        # is its child's, and set_device alone makes a CUDA context there (cudaSetDevice, CUDA >= 12: ~0.5 GB
        # held by our rank process for the whole run); our collectives are CPU tensors over gloo anyway.
        if torch.cuda.is_available() and not cfg.script.cmd:
            torch.cuda.set_device(env.local_rank % torch.cuda.device_count())
            backend = "cpu:gloo,cuda:nccl"  # CPU tensors (resume step, verdicts) still go through gloo
        # Collectives wait past the hang watchdog's limit (900 s), not the rendezvous timeout: rank 0's requeue
        # decision (two scontrol calls, up to ~66 s) or one rank's slower write must not time out the others.
        # 60 s past it: the watchdog (polling every <= 5 s) fires first on every rank, so a hang is judged as
        # one (heartbeat counts, the hung node left out); at exactly watchdog_s gloo's own timeout usually won
        # and the hang went down as an ordinary failure, onto the same node again.
        dist.init_process_group(
            backend,
            store=store,
            rank=placed.rank,
            world_size=env.world_size,
            timeout=max(timeout, timedelta(seconds=preempt.collective_timeout_s(cfg.train.watchdog_s))),
        )
    except Exception as e:
        raise RuntimeError(
            f"task {env.rank}/{env.world_size} on {socket.gethostname()}: rendezvous at {where} failed within "
            f"train.rendezvous_timeout_s={cfg.train.rendezvous_timeout_s}: {e}. Check that {env.master_addr} "
            f"resolves here and that port {env.master_port} is free on it."
        ) from e
    os.environ.update(torchrun_vars(placed))
    if cfg.cluster.in_process_restart:  # this rank's life, for a deciding rank's rejoin.plan_rejoin
        make_dir(paths.alive(env.job_id, env.restart_count), exist_ok=True)
        if task.alive_fd is not None:
            os.close(task.alive_fd)
        task.alive_fd = hold_for_life(paths.alive(env.job_id, env.restart_count) / str(placed.rank))
    ranklog.configure(placed.rank)  # from here this process speaks as its placed rank
    log.info(f"placed task {env.rank} as rank {placed.rank} on {node}")
    task.placed = placed
    return placed
