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
        # The step's nodes, not the job's: with hot spares (cluster.spare_nodes) the step runs on fewer.
        nodes = tuple(parse_nodelist(environ.get("SLURM_STEP_NODELIST") or environ["SLURM_JOB_NODELIST"]))
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


def gpu_sharing_error(visible_gpus: int, local_ranks: int) -> str:
    """Why this node's ranks cannot each have a GPU, or "" (pure). One visible GPU per task is Slurm's
    per-task binding (each task sees its own); 2..local_ranks-1 GPUs for local_ranks tasks would put two
    ranks on one GPU, where NCCL fails ("Duplicate GPU detected") or one GPU does two ranks' work."""
    if 1 < visible_gpus < local_ranks:
        return (
            f"{visible_gpus} GPUs visible (CUDA_VISIBLE_DEVICES) for {local_ranks} ranks on this node: two ranks "
            f"would share a GPU; set cluster.tasks_per_node={visible_gpus} and cluster.gpus_per_node={visible_gpus}"
            f", or ask for {local_ranks} GPUs per node"
        )
    return ""


# A hung NCCL collective: the job's own watchdog (job.py, train.watchdog_s) names the hang and decides the
# requeue in a thread of the same process, so NCCL must not kill that process under it.
#  2 = CleanUpOnly: a timed-out collective aborts its communicator and raises in the thread waiting on it
#      (job.py's failure path, which waits while the watchdog thread decides); torch 2.13's default 3
#      (SkipCleanUp) and torchrun's 1 (TearDown) end the process with SIGABRT, mid-decision.
#  Flight recorder: the last 2000 collectives of every rank, dumped to RUN/nccl_trace/rank_N at a timeout
#      (torch's own file writer; read with `python -m torch.distributed.flight_recorder.fr_trace`).
#  Heartbeat: after a dump torch's monitor thread ends the process once this many seconds pass; 900 s
#      leaves the decision (<= 30 s of heartbeat counts + ~66 s of scontrol) far inside it.
NCCL_TRACE_ENTRIES = 2000
NCCL_HEARTBEAT_TIMEOUT_S = 900


def nccl_env(trace_dir: str, environ: Mapping[str, str]) -> dict[str, str]:
    """The NCCL variables a job sets before its process group starts (pure): error handling always ours,
    the dump settings unless the site set them already (cluster.env, the template)."""
    defaults = {
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_TRACE_BUFFER_SIZE": str(NCCL_TRACE_ENTRIES),
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": f"{trace_dir}/rank_",
        "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": str(NCCL_HEARTBEAT_TIMEOUT_S),
    }
    return {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", **{k: v for k, v in defaults.items() if k not in environ}}
