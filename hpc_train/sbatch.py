"""Where and how a run is placed: the cluster config and the executor built from it.

Torch-free: this runs on the login node.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

EXECUTORS = ("local", "slurm")


@dataclass
class ClusterConfig:
    executor: str = "local"  # "local": submitit's local executor on this machine; "slurm": sbatch
    partition: str | None = None  # None: the cluster's default partition
    nodes: int = 1
    tasks_per_node: int = 2  # one task per rank (per GPU on GPU nodes)
    cpus_per_task: int = 1
    gpus_per_node: int = 0
    mem_gb: float | None = None  # per node; None: the partition's default
    timeout_min: int = 60
    # USR2 this long before the time limit. Slurm may deliver it up to 60 s early, and the save must fit.
    signal_lead_s: int = 120
    # Exported as SLURM_CONF for every Slurm client call (without it, clients try a DNS SRV lookup).
    slurm_conf: str | None = None
    setup: list[str] = field(default_factory=list)  # shell lines run in the batch script before srun

    def __post_init__(self) -> None:
        if self.executor not in EXECUTORS:
            raise ValueError(f"cluster.executor={self.executor!r} is not one of {EXECUTORS}; "
                             f"use cluster=local or cluster=slurm")
        for key in ("nodes", "tasks_per_node", "cpus_per_task", "timeout_min", "signal_lead_s"):
            if getattr(self, key) < 1:
                raise ValueError(f"cluster.{key}={getattr(self, key)} must be >= 1")
        if self.executor == "local" and self.nodes != 1:
            raise ValueError(f"cluster.nodes={self.nodes} but the local executor runs on this one machine; "
                             f"use cluster.nodes=1, or cluster=slurm for several nodes")
        if self.signal_lead_s >= self.timeout_min * 60:
            raise ValueError(f"cluster.signal_lead_s={self.signal_lead_s} must be shorter than "
                             f"cluster.timeout_min={self.timeout_min} minutes; lower signal_lead_s")


def executor_parameters(cluster: ClusterConfig, job_name: str) -> dict[str, Any]:
    """submitit parameters for this cluster config (pure)."""
    if cluster.executor == "local":
        return {"tasks_per_node": cluster.tasks_per_node, "timeout_min": cluster.timeout_min,
                "signal_delay_s": cluster.signal_lead_s}
    params: dict[str, Any] = {
        "job_name": job_name,
        "nodes": cluster.nodes,
        "ntasks_per_node": cluster.tasks_per_node,
        "cpus_per_task": cluster.cpus_per_task,
        "time": cluster.timeout_min,
        "signal_delay_s": cluster.signal_lead_s,  # renders --signal=USR2@<lead>
        "stderr_to_stdout": True,
        # --requeue: the job may be requeued by `scontrol requeue` and by preemption.
        "additional_parameters": {"requeue": True},
    }
    if cluster.partition:
        params["partition"] = cluster.partition
    if cluster.gpus_per_node:
        params["gpus_per_node"] = cluster.gpus_per_node
    if cluster.mem_gb is not None:
        params["mem"] = f"{int(cluster.mem_gb * 1024)}M"
    if cluster.setup:
        params["setup"] = list(cluster.setup)
    return params


# Slurm delivers some signals to the batch shell only: `--signal=B:USR2@lead`, `scancel --batch`, and
# preemption on clusters with SlurmctldParameters=preempt_send_user_signal. Untrapped, USR2 or TERM kill
# bash and with it the job before any rank can save. So srun runs in the background and the shell relays
# both signals to it (srun forwards them to every task); `wait` returns early on each trapped signal,
# hence the loop, and the script exits with srun's status.
SIGNAL_RELAY = """\
{srun} &
srun_pid=$!
trap 'kill -USR2 $srun_pid 2>/dev/null' USR2
trap 'kill -TERM $srun_pid 2>/dev/null' TERM
while true; do
  wait $srun_pid
  status=$?
  kill -0 $srun_pid 2>/dev/null || break
done
exit $status"""


def render(cluster: ClusterConfig, job_name: str, folder: Path, command: str) -> str:
    """The whole batch script, as submitted (pure): submitit's header and srun line, plus the relay."""
    from submitit.slurm.slurm import _make_sbatch_string

    script = _make_sbatch_string(command=command, folder=folder, **executor_parameters(cluster, job_name))
    lines = script.split("\n")
    i = next(i for i, line in enumerate(lines) if line.startswith("srun "))
    return "\n".join([*lines[:i], SIGNAL_RELAY.format(srun=lines[i]), *lines[i + 1:]])


def make_executor(cluster: ClusterConfig, folder: Path, job_name: str) -> Any:
    import submitit  # lazy: 0.1 s, and only `submit` needs it

    if cluster.slurm_conf:
        os.environ["SLURM_CONF"] = cluster.slurm_conf
    if cluster.executor == "local":
        executor: Any = submitit.LocalExecutor(folder=folder)
        executor.update_parameters(**executor_parameters(cluster, job_name))
        return executor
    executor = submitit.SlurmExecutor(folder=folder, max_num_timeout=1000)
    executor.update_parameters(**executor_parameters(cluster, job_name))
    # submitit's one hook for the script text; ours adds the signal relay to its rendering.
    executor._make_submission_file_text = lambda command, uid: render(cluster, job_name, executor.folder, command)
    return executor
