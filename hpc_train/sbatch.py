"""Where and how a run is placed: the cluster config, the pure render of its batch script, validation
against the live cluster, and the submitit executor built from it.

Torch-free: this runs on the login node.
"""

from __future__ import annotations

import os
import re
import shlex
import string
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpc_train import shipped_dir

EXECUTORS = ("local", "slurm")
TEMPLATES_DIR = Path(shipped_dir("sbatch_templates"))
SHELL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


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
    # SIGTERM -> SIGKILL at preemption: the partition's GraceTime (`scontrol show partition`). A stop save
    # that will not fit in what is left of it (or of signal_lead_s after USR2) is skipped.
    preempt_grace_s: int = 30
    # Exported as SLURM_CONF for every Slurm client call (without it, clients try a DNS SRV lookup).
    slurm_conf: str | None = None
    template: str | None = None  # sbatch_templates/<template>.sh: site setup (modules, paths)
    template_vars: dict[str, str] = field(default_factory=dict)  # $name in the template; values shell-quoted
    env: dict[str, str] = field(default_factory=dict)  # exported in the batch script; values shell-quoted
    setup: list[str] = field(default_factory=list)  # shell lines, one command each, run before srun
    launcher: list[str] = field(default_factory=list)  # words before python in srun, e.g. apptainer exec IMG
    # sbatch --switches=<count>[@<max wait>]: at most that many leaf switches, waiting up to the time
    # given for such an allocation ("1@30:00"); None leaves placement to Slurm.
    switches: str | None = None

    def __post_init__(self) -> None:
        if self.executor not in EXECUTORS:
            raise ValueError(f"cluster.executor={self.executor!r} is not one of {EXECUTORS}; "
                             f"use cluster=local or cluster=slurm")
        for key in ("nodes", "tasks_per_node", "cpus_per_task", "timeout_min", "signal_lead_s"):
            if getattr(self, key) < 1:
                raise ValueError(f"cluster.{key}={getattr(self, key)} must be >= 1")
        if self.gpus_per_node < 0:
            raise ValueError(f"cluster.gpus_per_node={self.gpus_per_node} must be >= 0")
        if self.executor == "local" and self.nodes != 1:
            raise ValueError(f"cluster.nodes={self.nodes} but the local executor runs on this one machine; "
                             f"use cluster.nodes=1, or cluster=slurm for several nodes")
        if self.signal_lead_s >= self.timeout_min * 60:
            raise ValueError(f"cluster.signal_lead_s={self.signal_lead_s} must be shorter than "
                             f"cluster.timeout_min={self.timeout_min} minutes; lower signal_lead_s")
        if self.partition is not None and not re.fullmatch(r"[\w.-]+", self.partition):
            raise ValueError(f"cluster.partition={self.partition!r} is not a partition name; "
                             f"use letters, digits, '.', '_' or '-'")
        for what, mapping in (("env", self.env), ("template_vars", self.template_vars)):
            for key in mapping:
                if not SHELL_NAME.fullmatch(key):
                    raise ValueError(f"cluster.{what} key {key!r} is not a shell variable name; "
                                     f"use [A-Za-z_][A-Za-z0-9_]*")
        for i, line in enumerate(self.setup):
            if any(c in line for c in "\n\r\0"):
                raise ValueError(f"cluster.setup[{i}]={line!r} spans several lines; give each command as "
                                 f"its own list item")
        if self.switches is not None and not re.fullmatch(r"\d+(@[\d:-]+)?", self.switches):
            raise ValueError(f"cluster.switches={self.switches!r} is not sbatch's <count>[@<max wait>]; "
                             f"e.g. cluster.switches='1@30:00'")
        if self.template is not None and not (TEMPLATES_DIR / f"{self.template}.sh").is_file():
            known = sorted(p.stem for p in TEMPLATES_DIR.glob("*.sh") if p.stem != "signal_relay")
            raise ValueError(f"cluster.template={self.template!r}: no {TEMPLATES_DIR}/{self.template}.sh; "
                             f"use one of {known} or add the file")


def setup_lines(cluster: ClusterConfig) -> list[str]:
    """The batch script's setup section: site template, env exports, user lines, the signal relay."""
    # The allocation's start, for telling the time-limit warning from a preemption (Slurm 22.05 exports no
    # start or end time to the job; a task's own start can be minutes later behind a container launch).
    lines: list[str] = ["export HPC_TRAIN_ALLOCATED_AT=$(date +%s)"]
    if cluster.template:
        text = (TEMPLATES_DIR / f"{cluster.template}.sh").read_text()
        try:
            text = string.Template(text).substitute({k: shlex.quote(v) for k, v in cluster.template_vars.items()})
        except KeyError as e:
            raise ValueError(f"sbatch_templates/{cluster.template}.sh needs cluster.template_vars.{e.args[0]}; "
                             f"set it, e.g. +cluster.template_vars.{e.args[0]}=...") from None
        lines += text.rstrip("\n").split("\n")
    lines += [f"export {k}={shlex.quote(v)}" for k, v in cluster.env.items()]
    lines += cluster.setup
    lines += (TEMPLATES_DIR / "signal_relay.sh").read_text().rstrip("\n").split("\n")
    return lines


def executor_parameters(cluster: ClusterConfig, job_name: str, max_parallel: int | None = None) -> dict[str, Any]:
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
        "setup": setup_lines(cluster),
    }
    if max_parallel is not None:
        params["array_parallelism"] = max_parallel
    if cluster.switches:
        params["additional_parameters"]["switches"] = cluster.switches
    if cluster.partition:
        params["partition"] = cluster.partition
    if cluster.gpus_per_node:
        params["gpus_per_node"] = cluster.gpus_per_node
    if cluster.mem_gb is not None:
        params["mem"] = f"{int(cluster.mem_gb * 1024)}M"
    return params


def python_command(cluster: ClusterConfig) -> str:
    return shlex.join([*cluster.launcher, sys.executable])


def entry_command(python: str, folder: Path) -> str:
    """What every task runs: our entry (start.py) installs the stop-signal handlers before any import,
    then runs submitit's pickle; submitit's own entry would install its handlers instead. By its path,
    not `-m hpc_train.start`: -m puts the cwd (the submit folder) first on sys.path, where a ./hpc_train
    would shadow the package that validated the run; start.py imports the package beside it."""
    start = Path(__file__).resolve().parent / "start.py"
    return f"{python} -u {shlex.quote(str(start))} {shlex.quote(str(folder))}"


def render(cluster: ClusterConfig, job_name: str, folder: Path, array_size: int | None = None,
           max_parallel: int | None = None) -> str:
    """The batch script exactly as submitit submits it (pure, but for reading the template files)."""
    from submitit.slurm.slurm import _make_sbatch_string

    params = executor_parameters(cluster, job_name, max_parallel)
    command = entry_command(python_command(cluster), folder)
    return _make_sbatch_string(command=command, folder=folder, map_count=array_size, **params)


def check_syntax(script: str) -> None:
    """`bash -n`: a setup line with an unbalanced quote fails here, not on the compute node."""
    proc = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True, timeout=10)
    if proc.returncode != 0:
        raise ValueError(f"the batch script would not parse: {proc.stderr.strip()}; check cluster.setup "
                         f"and cluster.template for unbalanced quotes")


def validate_live(cluster: ClusterConfig, script: str, array_size: int, max_parallel: int | None) -> None:
    """Check the request against the running cluster; ValueError names key, value, limit and fix."""
    from hpc_train import slurm

    parts = slurm.partitions()
    name = cluster.partition or next((p for p, f in parts.items() if f.get("Default") == "YES"), None)
    if name not in parts:
        raise ValueError(f"cluster.partition={cluster.partition!r} does not exist on this cluster; "
                         f"use one of {sorted(parts)}")
    part = parts[name]
    if part.get("State") not in ("UP", None):
        raise ValueError(f"partition {name} is {part['State']}; jobs will not start; use one of "
                         f"{sorted(p for p, f in parts.items() if f.get('State') == 'UP')}")
    total_nodes = int(part.get("TotalNodes", "0"))
    max_nodes = part.get("MaxNodes", "UNLIMITED")
    limit = total_nodes if max_nodes == "UNLIMITED" else min(total_nodes, int(max_nodes))
    if cluster.nodes > limit:
        raise ValueError(f"cluster.nodes={cluster.nodes} exceeds partition {name}'s limit of {limit} nodes; "
                         f"use cluster.nodes<={limit} or another partition")
    max_time = slurm.time_limit_min(part.get("MaxTime", "UNLIMITED"))
    if cluster.timeout_min > max_time:
        raise ValueError(f"cluster.timeout_min={cluster.timeout_min} exceeds partition {name}'s MaxTime of "
                         f"{max_time:.0f} min; use cluster.timeout_min<={max_time:.0f} (the run requeues "
                         f"itself at the limit and resumes)")
    node_info = slurm.nodes()
    in_partition = _expand(part.get("Nodes", ""))
    members = [n for n in node_info if n in in_partition]
    cpus = max((int(node_info[n].get("CPUTot", "0")) for n in members), default=0)
    want_cpus = cluster.tasks_per_node * cluster.cpus_per_task
    if want_cpus > cpus:
        raise ValueError(f"cluster.tasks_per_node={cluster.tasks_per_node} x cluster.cpus_per_task="
                         f"{cluster.cpus_per_task} = {want_cpus} CPUs per node, but partition {name}'s nodes have "
                         f"at most {cpus}; lower one of them")
    if cluster.gpus_per_node:
        gpus = max((_gpu_count(node_info[n].get("Gres", "")) for n in members), default=0)
        if cluster.gpus_per_node > gpus:
            raise ValueError(f"cluster.gpus_per_node={cluster.gpus_per_node} but partition {name}'s nodes have "
                             f"at most {gpus} GPUs (Gres); use cluster.gpus_per_node<={gpus} or a GPU partition")
    if max_parallel is not None and max_parallel < 1:
        raise ValueError(f"--max-parallel={max_parallel} must be >= 1")
    with tempfile.NamedTemporaryFile("w", suffix=".sh") as f:
        f.write(script)
        f.flush()
        for attempt in range(6):
            try:
                slurm.test_only(f.name)
                break
            except slurm.SlurmError as e:
                # Right after a controller restart, nodes have not re-registered ("idle*", "unk*") and
                # every request looks impossible for a few seconds: wait for them, up to ~10 s.
                states = slurm.call(["sinfo", "-h", "-p", name, "-o", "%t"]).split()
                if attempt < 5 and any(st.endswith("*") or st.startswith("unk") for st in states):
                    time.sleep(2)
                    continue
                raise ValueError(f"sbatch --test-only refused the request for partition {name}: {e}") from None


def _expand(nodelist: str) -> set[str]:
    from hpc_train.env import parse_nodelist

    return set(parse_nodelist(nodelist))


def _gpu_count(gres: str) -> int:
    """"gpu:a100:8(S:0-1),shard:4" -> 8."""
    return sum(int(m.group(1)) for m in re.finditer(r"gpu(?::[\w-]+)?:(\d+)", gres))


def make_executor(cluster: ClusterConfig, folder: Path, job_name: str, max_parallel: int | None = None) -> Any:
    import submitit  # lazy: 0.1 s, and only `submit` needs it

    class Local(submitit.LocalExecutor):
        @property
        def _submitit_command_str(self) -> str:
            return entry_command(self.python, self.folder)

    class Slurm(submitit.SlurmExecutor):
        @property
        def _submitit_command_str(self) -> str:  # also used for arrays (map_array)
            return entry_command(self.python, self.folder)

    if cluster.executor == "local":
        os.environ.update(cluster.env)  # the local controller and its tasks inherit this process's env
        executor: Any = Local(folder=folder)
    else:
        executor = Slurm(folder=folder, max_num_timeout=1000, python=python_command(cluster))
    executor.update_parameters(**executor_parameters(cluster, job_name, max_parallel))
    return executor
