"""Who am I in this job: rank facts as pure functions of an environment mapping.

Slurm (srun) and submitit's local executor both describe a task through environment variables; this
module turns either into one RankEnv and into torchrun's variables, so code written for torchrun runs
unchanged. Torch-free and side-effect-free: tests call it with plain dicts.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class RankEnv:
    executor: str  # "slurm" or "local"
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    nodes: tuple[str, ...]
    master_addr: str
    master_port: int
    job_id: str  # what `scontrol requeue` takes: <array_job_id>_<task_id> for array tasks
    restart_count: int  # SLURM_RESTART_COUNT; 0 on the first attempt


def parse_nodelist(nodelist: str) -> list[str]:
    """Expand Slurm's compact host list: "node[1-3,5],gpu[01-02]" -> node1 node2 node3 node5 gpu01 gpu02.

    Zero padding follows each range's first bound, as Slurm does; several bracket groups in one name
    ("rack[1-2]-n[1-2]") expand as a product, in Slurm's order.
    """
    parts, depth, cur = [], 0, ""
    for ch in nodelist:
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
            continue
        depth += (ch == "[") - (ch == "]")
        cur += ch
    parts.append(cur)
    return [host for part in parts if part for host in _expand_host(part)]


def _expand_host(part: str) -> list[str]:
    m = re.fullmatch(r"([^\[]*)\[([^\]]*)\](.*)", part)
    if not m:
        return [part]
    prefix, ranges, rest = m.groups()
    tails = _expand_host(rest)
    hosts = []
    for r in ranges.split(","):
        lo, _, hi = r.partition("-")
        for i in range(int(lo), int(hi or lo) + 1):
            hosts += [f"{prefix}{i:0{len(lo)}d}{tail}" for tail in tails]
    return hosts


def rendezvous_port(job_id: str, restart_count: int) -> int:
    """A port in 20000-29999 from job id and attempt: a requeued attempt never meets the previous
    attempt's port in TIME_WAIT, and two jobs sharing a first node rarely collide (1 in 10,000)."""
    return 20000 + zlib.crc32(f"{job_id}:{restart_count}".encode()) % 10000


def from_env(environ: Mapping[str, str]) -> RankEnv:
    """HPC_TRAIN_MASTER_ADDR overrides the rendezvous host (e.g. a site whose node names resolve to the
    management network: HPC_TRAIN_MASTER_ADDR=node1-ib); HPC_TRAIN_MASTER_PORT the port."""
    env = _from_env(environ)
    addr = environ.get("HPC_TRAIN_MASTER_ADDR") or env.master_addr
    port = int(environ.get("HPC_TRAIN_MASTER_PORT") or env.master_port)
    return (
        env if (addr, port) == (env.master_addr, env.master_port) else replace(env, master_addr=addr, master_port=port)
    )


def _from_env(environ: Mapping[str, str]) -> RankEnv:
    if "SLURM_PROCID" in environ:
        nodes = tuple(parse_nodelist(environ["SLURM_JOB_NODELIST"]))
        array_job, array_task = environ.get("SLURM_ARRAY_JOB_ID"), environ.get("SLURM_ARRAY_TASK_ID")
        job_id = f"{array_job}_{array_task}" if array_job and array_task else environ["SLURM_JOB_ID"]
        restart = int(environ.get("SLURM_RESTART_COUNT") or 0)
        # srun sets SLURM_NTASKS_PER_NODE only when it honours --ntasks-per-node; it ignores it ("can't
        # honor") when an inherited SLURM_NTASKS disagrees, and the ranks would be placed unevenly.
        per_node = environ.get("SLURM_NTASKS_PER_NODE") or environ.get("SLURM_STEP_TASKS_PER_NODE", "")
        world_size, local_world_size = int(environ["SLURM_NTASKS"]), int(per_node.split("(")[0].split(",")[0] or 0)
        if local_world_size * len(nodes) != world_size:
            raise RuntimeError(
                f"srun started {world_size} tasks on {len(nodes)} nodes ({per_node or '?'} per node), "
                f"not the same number on each: the job's task count disagrees with its nodes "
                f"(SLURM_NTASKS inherited from an salloc shell, or a NumTasks set by hand); submit "
                f"from a login shell and leave NumNodes/NumTasks to hpc-train"
            )
        return RankEnv(
            executor="slurm",
            rank=int(environ["SLURM_PROCID"]),
            local_rank=int(environ["SLURM_LOCALID"]),
            world_size=world_size,
            local_world_size=local_world_size,
            node_rank=int(environ["SLURM_NODEID"]),
            num_nodes=len(nodes),
            nodes=nodes,
            master_addr=nodes[0],
            master_port=rendezvous_port(job_id, restart),
            job_id=job_id,
            restart_count=restart,
        )
    if "SUBMITIT_LOCAL_JOB_ID" in environ:
        ntasks = int(environ["SUBMITIT_LOCAL_NTASKS"])
        job_id = environ["SUBMITIT_LOCAL_JOB_ID"]
        # The local controller restarts tasks in place with the same environment, so the attempt
        # number comes from the run directory (HPC_TRAIN_ATTEMPT, set by job.py before this call).
        restart = int(environ.get("HPC_TRAIN_ATTEMPT", "0"))
        return RankEnv(
            executor="local",
            rank=int(environ["SUBMITIT_LOCAL_GLOBALID"]),
            local_rank=int(environ["SUBMITIT_LOCAL_LOCALID"]),
            world_size=ntasks,
            local_world_size=ntasks,
            node_rank=0,
            num_nodes=1,
            nodes=("127.0.0.1",),
            master_addr="127.0.0.1",
            master_port=rendezvous_port(job_id, restart),
            job_id=job_id,
            restart_count=restart,
        )
    raise RuntimeError(
        "neither SLURM_PROCID nor SUBMITIT_LOCAL_JOB_ID is set: run this inside a job "
        "started by `hpc-train submit` (or under srun)"
    )


def torchrun_vars(env: RankEnv) -> dict[str, str]:
    """The variables torchrun would set, so user code written for torchrun runs unchanged."""
    return {
        "RANK": str(env.rank),
        "LOCAL_RANK": str(env.local_rank),
        "WORLD_SIZE": str(env.world_size),
        "LOCAL_WORLD_SIZE": str(env.local_world_size),
        "MASTER_ADDR": env.master_addr,
        "MASTER_PORT": str(env.master_port),
    }
