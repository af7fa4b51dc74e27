"""Where and how a run is placed: the cluster config, the pure render of its batch script, validation
against the live cluster, and the submitit executor built from it.

Torch-free: this runs on the login node.
"""

from __future__ import annotations

import math
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
# `trap CMD EXIT` / `trap CMD 0`, with other signals beside it or not (a comment line is no trap)
EXIT_TRAP = re.compile(r"^\s*[^#]*\btrap\b.*\s(EXIT|SIGEXIT|0)\b")


@dataclass
class ClusterConfig:
    executor: str = "local"  # "local": submitit's local executor on this machine; "slurm": sbatch
    partition: str | None = None  # None: the cluster's default partition
    nodes: int = 1
    # Elastic: an attempt may start on as few as min_nodes (sbatch --nodes=<min>-<nodes>); None: exactly nodes.
    # The global batch stays that of `nodes` (train.py); requeue.shrink_after_s decides when to go on smaller.
    min_nodes: int | None = None
    # Hot spares: the job allocates nodes + spare_nodes and trains on `nodes`; a failure blamed on a node
    # relaunches the training step inside the allocation without it, on a spare (requeue.max_in_job_restarts).
    # With min_nodes the allocation stays nodes + spare_nodes (a requeue too): once no spare is left, the
    # relaunch goes on with the healthy nodes left, down to min_nodes, before it requeues.
    spare_nodes: int = 0
    # With spare_nodes: the training step spans the spares too, where a warm standby (torch imported) waits per
    # task; a crashed rank's node is replaced by one without a new process for the ranks that survived: they
    # drop the process group and rejoin with the standby (docs/preemption.md). Anything else relaunches the step.
    in_process_restart: bool = False
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
    # Site options, sbatch's own (--account ...); None/False/empty: not rendered, Slurm's default. Each
    # is checked against the live cluster before anything is queued (validate_live).
    account: str | None = None  # charged for the run: one of `sacctmgr show assoc user=$USER`
    qos: str | None = None  # allowed under that account (the user's default account when None)
    constraint: str | None = None  # node features, sbatch's syntax: "fast", "a100&ib", "[rack1|rack2]"
    reservation: str | None = None  # `scontrol show reservation`
    exclusive: bool = False  # whole nodes: no other job shares them
    mem_per_cpu_gb: float | None = None  # instead of mem_gb (sbatch refuses both)
    # Generic resources, e.g. "gpu:a100:8" or "gpu:8,shard:2"; GPUs named here must equal gpus_per_node
    # (one rank per GPU); --gpus-per-node is then left out, as sbatch would count them twice.
    gres: str | None = None
    mail_type: str | None = None  # e.g. "END,FAIL"; needs the site's MailProg
    mail_user: str | None = None  # default: the submitting user
    nodelist: str | None = None  # only these nodes, e.g. "node[1-2]"
    exclude: str | None = None  # never these nodes
    # At submit, leave out the partition's nodes with a recent bad record in the runs of out_dir (failed preflights,
    # hardware errors, hangs, losses, stragglers: reputation.py), as far as the partition can spare them; added
    # after exclude in the frozen config, so requeues and resumes keep them out. false: every node, whatever its record.
    avoid_bad_nodes: bool = True
    # Any other sbatch long option, without "--": {"mem-bind": "local"}; "" renders a bare flag
    # (--contiguous). Names are checked against sbatch 22.05's; values are shell-quoted by submitit.
    sbatch_extra: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.executor not in EXECUTORS:
            raise ValueError(
                f"cluster.executor={self.executor!r} is not one of {EXECUTORS}; use cluster=local or cluster=slurm"
            )
        for key in ("nodes", "tasks_per_node", "cpus_per_task", "timeout_min", "signal_lead_s"):
            if getattr(self, key) < 1:
                raise ValueError(f"cluster.{key}={getattr(self, key)} must be >= 1")
        if self.gpus_per_node < 0:
            raise ValueError(f"cluster.gpus_per_node={self.gpus_per_node} must be >= 0")
        if self.gpus_per_node and self.gpus_per_node != self.tasks_per_node:
            # One rank per GPU: 2 ranks on one GPU make NCCL fail ("Duplicate GPU detected"); fewer ranks idle GPUs.
            raise ValueError(
                f"cluster.gpus_per_node={self.gpus_per_node} but cluster.tasks_per_node={self.tasks_per_node}: "
                f"hpc_train runs one rank per GPU; set cluster.tasks_per_node={self.gpus_per_node}, or "
                f"cluster.gpus_per_node={self.tasks_per_node}"
            )
        if self.min_nodes is not None and not 1 <= self.min_nodes <= self.nodes:
            raise ValueError(
                f"cluster.min_nodes={self.min_nodes} must be between 1 and cluster.nodes={self.nodes}; "
                f"use null for a fixed size"
            )
        if self.spare_nodes < 0:
            raise ValueError(f"cluster.spare_nodes={self.spare_nodes} must be >= 0 (0: no hot spares)")
        mincpus, extra = self.tasks_per_node * self.cpus_per_task, str(self.sbatch_extra.get("mincpus", ""))
        if self.elastic() and extra.isdigit() and int(extra) < mincpus:
            raise ValueError(
                f"cluster.sbatch_extra.mincpus={self.sbatch_extra['mincpus']} is below the "
                f"{self.tasks_per_node} x {self.cpus_per_task} CPUs an elastic run's ranks need on each "
                f"node (it sets --mincpus={mincpus}); raise it or leave it out"
            )
        self._check_spares_and_local()
        if self.signal_lead_s >= self.timeout_min * 60:
            raise ValueError(
                f"cluster.signal_lead_s={self.signal_lead_s} must be shorter than "
                f"cluster.timeout_min={self.timeout_min} minutes; lower signal_lead_s"
            )
        if self.partition is not None and not re.fullmatch(r"[\w.-]+", self.partition):
            raise ValueError(
                f"cluster.partition={self.partition!r} is not a partition name; use letters, digits, '.', '_' or '-'"
            )
        for what, mapping in (("env", self.env), ("template_vars", self.template_vars)):
            for key in mapping:
                if not SHELL_NAME.fullmatch(key):
                    raise ValueError(
                        f"cluster.{what} key {key!r} is not a shell variable name; use [A-Za-z_][A-Za-z0-9_]*"
                    )
        self._check_setup()
        if self.switches is not None and not re.fullmatch(r"\d+(@[\d:-]+)?", self.switches):
            raise ValueError(
                f"cluster.switches={self.switches!r} is not sbatch's <count>[@<max wait>]; "
                f"e.g. cluster.switches='1@30:00'"
            )
        self._check_site_options()
        if self.template is not None and not (TEMPLATES_DIR / f"{self.template}.sh").is_file():
            known = sorted(p.stem for p in TEMPLATES_DIR.glob("*.sh") if p.stem != "signal_relay")
            raise ValueError(
                f"cluster.template={self.template!r}: no {TEMPLATES_DIR}/{self.template}.sh; "
                f"use one of {known} or add the file"
            )

    def _check_spares_and_local(self) -> None:
        """Hot spares' in-process restart has standbys to rejoin, in Slurm's block order; the local executor is one
        machine."""
        if self.in_process_restart and not self.spare_nodes:
            raise ValueError(
                "cluster.in_process_restart=true needs a warm standby on a spare node; set cluster.spare_nodes=1 "
                "(or more), or cluster.in_process_restart=false"
            )
        spread = str(self.sbatch_extra.get("distribution", "block"))
        if self.in_process_restart and spread.split(":")[0] not in ("block", "*"):  # rejoin.split_standby's order
            raise ValueError(
                f"cluster.sbatch_extra.distribution={spread!r} puts the step's tasks on its nodes in another order, "
                f"but cluster.in_process_restart=true takes the tasks of the first cluster.nodes nodes (Slurm's block "
                f"order) as the trainers and the rest as standbys; drop it, keep its node part block (e.g. "
                f"block:cyclic), or set cluster.in_process_restart=false"
            )
        if self.executor == "local" and self.spare_nodes:
            raise ValueError(
                f"cluster.spare_nodes={self.spare_nodes} but the local executor runs on this one machine; "
                f"use cluster.spare_nodes=0, or cluster=slurm for hot spares"
            )
        if self.executor == "local" and self.nodes != 1:
            raise ValueError(
                f"cluster.nodes={self.nodes} but the local executor runs on this one machine; "
                f"use cluster.nodes=1, or cluster=slurm for several nodes"
            )

    def _check_setup(self) -> None:
        """cluster.setup: one command per item, and no EXIT trap there or in the site template: the batch script
        ends by exec'ing the step's supervisor (hpc_train/relay.py), so bash would never run it."""
        for i, line in enumerate(self.setup):
            if any(c in line for c in "\n\r\0"):
                raise ValueError(
                    f"cluster.setup[{i}]={line!r} spans several lines; give each command as its own list item"
                )
        template = (TEMPLATES_DIR / f"{self.template}.sh") if self.template else None
        lines = [*self.setup, *(template.read_text().splitlines() if template and template.is_file() else [])]
        for line in lines:
            if EXIT_TRAP.search(line):
                raise ValueError(
                    f"{line.strip()!r} (cluster.setup or cluster.template) sets an EXIT trap, which would never run: "
                    "the batch script hands itself to hpc_train's relay (exec) to run the step; clean up in a Slurm "
                    "epilog, or at the end of your training code"
                )

    def elastic(self) -> bool:
        """Does the allocation's size change across requeues (sbatch --nodes=<min_nodes>-<nodes>)? Not with hot
        spares: their allocation is nodes + spare_nodes every time, and min_nodes only lets an in-job
        relaunch go on smaller (preempt.in_job_restart)."""
        return (self.min_nodes or self.nodes) < self.nodes and not self.spare_nodes

    def _check_site_options(self) -> None:
        for key in ("account", "qos", "reservation"):
            value = getattr(self, key)
            if value is not None and not re.fullmatch(r"[\w.-]+", value):
                raise ValueError(
                    f"cluster.{key}={value!r} is not a Slurm {key} name; use letters, digits, '.', "
                    f"'_' or '-' (`sacctmgr show assoc user=$USER` lists yours)"
                )
        for key in ("constraint", "gres", "mail_type", "mail_user", "nodelist", "exclude"):
            value = getattr(self, key)
            if value is not None and (not value or re.search(r"[\s'\"\\]", value)):
                raise ValueError(
                    f"cluster.{key}={value!r} must be one word without spaces, quotes or "
                    f"backslashes (sbatch --{key.replace('_', '-')} syntax), or null"
                )
        both = _expand(self.nodelist or "") & _expand(self.exclude or "")
        if both:  # sbatch would say only "Invalid node name specified"
            raise ValueError(
                f"cluster.nodelist={self.nodelist!r} and cluster.exclude={self.exclude!r} both name "
                f"{', '.join(sorted(both))}; drop it from one of them"
            )
        if self.mem_gb is not None and self.mem_per_cpu_gb is not None:
            raise ValueError(
                f"cluster.mem_gb={self.mem_gb} and cluster.mem_per_cpu_gb={self.mem_per_cpu_gb} are "
                f"both set, but sbatch takes one of --mem and --mem-per-cpu; set the other to null"
            )
        for key in ("mem_gb", "mem_per_cpu_gb"):
            value = getattr(self, key)
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise ValueError(f"cluster.{key}={value} must be > 0 and finite, or null for the partition's default")
        if self.gres is not None:
            if not re.fullmatch(r"[A-Za-z][\w/.-]*(:[\w.-]+)*(,[A-Za-z][\w/.-]*(:[\w.-]+)*)*", self.gres):
                raise ValueError(
                    f"cluster.gres={self.gres!r} is not sbatch's name[:type][:count][,...]; "
                    f"e.g. cluster.gres=gpu:a100:8"
                )
            gpus = gres_gpus(self.gres)
            if gpus is not None and gpus != self.gpus_per_node:
                raise ValueError(
                    f"cluster.gres={self.gres!r} asks for {gpus} GPUs per node but "
                    f"cluster.gpus_per_node={self.gpus_per_node}; set cluster.gpus_per_node={gpus} "
                    f"(one rank per GPU: tasks_per_node follows it)"
                )
        if self.mail_type is not None:
            bad = [t for t in self.mail_type.upper().split(",") if t not in MAIL_TYPES]
            if bad:
                raise ValueError(
                    f"cluster.mail_type={self.mail_type!r}: {bad} not among sbatch's mail types; "
                    f"use a comma list of {', '.join(MAIL_TYPES)}"
                )
        if self.mail_user is not None and self.mail_type is None:
            raise ValueError(
                f"cluster.mail_user={self.mail_user!r} without cluster.mail_type sends no mail; "
                f"set cluster.mail_type, e.g. END,FAIL"
            )
        for key, value in self.sbatch_extra.items():
            check_sbatch_extra(key, value)


# sbatch 22.05's long options (its man page; `sbatch --help` lists most). A name outside this list would
# make sbatch fail at submit time, after the run directory exists.
SBATCH_OPTIONS = (
    "account",
    "acctg-freq",
    "array",
    "batch",
    "bb",
    "bbf",
    "begin",
    "chdir",
    "cluster-constraint",
    "clusters",
    "comment",
    "constraint",
    "container",
    "contiguous",
    "core-spec",
    "cores-per-socket",
    "cpu-freq",
    "cpus-per-gpu",
    "cpus-per-task",
    "deadline",
    "delay-boot",
    "dependency",
    "distribution",
    "error",
    "exclude",
    "exclusive",
    "export",
    "export-file",
    "extra-node-info",
    "get-user-env",
    "gid",
    "gpu-bind",
    "gpu-freq",
    "gpus",
    "gpus-per-node",
    "gpus-per-socket",
    "gpus-per-task",
    "gres",
    "gres-flags",
    "help",
    "hint",
    "hold",
    "ignore-pbs",
    "input",
    "job-name",
    "kill-on-invalid-dep",
    "licenses",
    "mail-type",
    "mail-user",
    "mcs-label",
    "mem",
    "mem-bind",
    "mem-per-cpu",
    "mem-per-gpu",
    "mincpus",
    "network",
    "nice",
    "no-kill",
    "no-requeue",
    "nodefile",
    "nodelist",
    "nodes",
    "ntasks",
    "ntasks-per-core",
    "ntasks-per-gpu",
    "ntasks-per-node",
    "ntasks-per-socket",
    "open-mode",
    "output",
    "overcommit",
    "oversubscribe",
    "parsable",
    "partition",
    "power",
    "prefer",
    "priority",
    "profile",
    "propagate",
    "qos",
    "quiet",
    "reboot",
    "requeue",
    "reservation",
    "signal",
    "sockets-per-node",
    "spread-job",
    "switches",
    "test-only",
    "thread-spec",
    "threads-per-core",
    "time",
    "time-min",
    "tmp",
    "uid",
    "usage",
    "use-min-nodes",
    "verbose",
    "version",
    "wait",
    "wait-all-nodes",
    "wckey",
    "wrap",
)
# Options that take no value: sbatch refuses "--contiguous=x".
SBATCH_FLAGS = (
    "batch",
    "contiguous",
    "help",
    "hold",
    "ignore-pbs",
    "no-kill",
    "no-requeue",
    "overcommit",
    "oversubscribe",
    "parsable",
    "quiet",
    "reboot",
    "requeue",
    "spread-job",
    "test-only",
    "usage",
    "use-min-nodes",
    "verbose",
    "version",
    "wait",
)
# Options hpc_train renders itself, or that would break how it submits, and what to do instead.
SBATCH_OWNED = {
    **{
        o: f"use cluster.{o.replace('-', '_')}"
        for o in (
            "account",
            "qos",
            "constraint",
            "reservation",
            "exclusive",
            "gres",
            "mail-type",
            "mail-user",
            "nodelist",
            "exclude",
            "switches",
            "partition",
            "nodes",
            "cpus-per-task",
        )
    },
    "mem": "use cluster.mem_gb",
    "mem-per-cpu": "use cluster.mem_per_cpu_gb",
    "gpus-per-node": "use cluster.gpus_per_node",
    "ntasks-per-node": "use cluster.tasks_per_node",
    "ntasks": "use cluster.tasks_per_node",
    "time": "use cluster.timeout_min",
    "use-min-nodes": "an elastic run (cluster.min_nodes) starts on as many nodes as are free; for a fixed size "
    "leave cluster.min_nodes unset",
    "signal": "use cluster.signal_lead_s (USR2 that long before the time limit)",
    "requeue": "every run may be requeued already",
    "no-requeue": "a run must requeue to survive preemption",
    "array": "a sweep (-m) renders it; --max-parallel throttles it",
    "job-name": "use name=...",
    "output": "logs go to the run directory's submitit/",
    "error": "logs go to the run directory's submitit/",
    "open-mode": "logs are appended across requeues",
    "parsable": "submitit reads sbatch's usual answer",
    "wait": "submit returns once queued",
    "wrap": "the batch script is rendered",
    "test-only": "use --dry-run",
    "help": "run sbatch --help",
    "usage": "run sbatch --usage",
    "version": "run sbatch --version",
    **dict.fromkeys(
        ("clusters", "M", "cluster-constraint"),
        "status, logs, resume and cancel ask the one cluster SLURM_CONF names; use cluster.slurm_conf "
        "for another cluster",
    ),
    **dict.fromkeys(
        ("export", "export-file", "get-user-env"),
        "the job must inherit the submitting environment (its Python, SLURM_CONF); use cluster.env",
    ),
    **dict.fromkeys(
        ("gpus", "gpus-per-task", "gpus-per-socket"), "one rank per GPU, counted per node; use cluster.gpus_per_node"
    ),
    "no-kill": (
        "a lost node must end the attempt so it requeues; with cluster.spare_nodes hpc_train sets it and the "
        "step goes on on a spare"
    ),
    **dict.fromkeys(("uid", "gid"), "the run directory and its requeues belong to the submitting user"),
    **dict.fromkeys(("chdir", "D"), "the frozen config's relative paths are read from the submit directory"),
}
MAIL_TYPES = (
    "NONE",
    "BEGIN",
    "END",
    "FAIL",
    "REQUEUE",
    "ALL",
    "INVALID_DEPEND",
    "STAGE_OUT",
    "TIME_LIMIT",
    "TIME_LIMIT_90",
    "TIME_LIMIT_80",
    "TIME_LIMIT_50",
    "ARRAY_TASKS",
)


def check_sbatch_extra(key: str, value: str) -> None:
    """One cluster.sbatch_extra entry (pure): a real sbatch option we do not own, a one-line value."""
    import difflib

    name = key.replace("_", "-")
    if name in SBATCH_OWNED:
        raise ValueError(f"cluster.sbatch_extra.{key}: --{name} is hpc_train's own; {SBATCH_OWNED[name]}")
    if name not in SBATCH_OPTIONS:
        hint = "see `sbatch --help` for the long option names"
        for close in difflib.get_close_matches(name, SBATCH_OPTIONS, n=1, cutoff=0.7):
            hint = f"did you mean {close!r}?" + (f" ({SBATCH_OWNED[close]})" if close in SBATCH_OWNED else "")
        raise ValueError(f"cluster.sbatch_extra.{key}: --{name} is not an sbatch option (sbatch 22.05); {hint}")
    if any(ord(c) < 32 or c == "\x7f" for c in value):
        raise ValueError(
            f"cluster.sbatch_extra.{key}={value!r} contains a control character (newline?); give a one-line value"
        )
    if "\\" in value:
        raise ValueError(
            f"cluster.sbatch_extra.{key}={value!r} contains a backslash, which sbatch's #SBATCH "
            f"parser reads as an escape; give the value without one"
        )
    if name in SBATCH_FLAGS and value:
        raise ValueError(
            f"cluster.sbatch_extra.{key}={value!r}: --{name} takes no value; set it to '' "
            f"(+cluster.sbatch_extra.{key}='')"
        )


def gres_gpus(gres: str) -> int | None:
    """GPUs per node named in a --gres value (pure): "gpu:a100:8,shard:2" -> 8, "gpu" -> 1, "shard:2" -> None."""
    counts = [part.split(":") for part in gres.split(",") if part.split(":")[0] == "gpu"]
    if not counts:
        return None
    return sum(int(c[-1]) if len(c) > 1 and c[-1].isdigit() else 1 for c in counts)


def setup_lines(cluster: ClusterConfig) -> list[str]:
    """The batch script's setup section: the relay's trap, site template, env exports, user lines, the relay's
    srun()."""
    # The allocation's start, for telling the time-limit warning from a preemption (Slurm 22.05 exports no
    # start or end time to the job; a task's own start can be minutes later behind a container launch).
    # The relay's trap next: a stop signal during the rest of the setup is recorded, not the job's end. Its
    # srun() last: an `srun` in the setup is Slurm's (ours would exec the relay there, and the job end with it).
    relay = relay_lines()
    cut = relay.index("srun() {")
    cut -= next(i for i, line in enumerate(reversed(relay[:cut])) if not line.startswith("#"))  # its comment too
    lines: list[str] = ["export HPC_TRAIN_ALLOCATED_AT=$(date +%s)", *relay[:cut]]
    if cluster.template:
        text = (TEMPLATES_DIR / f"{cluster.template}.sh").read_text()
        try:
            text = string.Template(text).substitute({k: shlex.quote(v) for k, v in cluster.template_vars.items()})
        except KeyError as e:
            raise ValueError(
                f"sbatch_templates/{cluster.template}.sh needs cluster.template_vars.{e.args[0]}; "
                f"set it, e.g. +cluster.template_vars.{e.args[0]}=..."
            ) from None
        lines += text.rstrip("\n").split("\n")
    lines += [f"export {k}={shlex.quote(v)}" for k, v in cluster.env.items()]
    lines += cluster.setup
    return lines + relay[cut:]


def relay_lines(python: str = sys.executable) -> list[str]:
    """The batch script's srun(): the training step under hpc_train/relay.py, run by the submitting python with
    the stop path's deadlines (deadlines.py) as its arguments."""
    from hpc_train import deadlines

    # safe_: the shell's own $@ and $(...) stay as they are
    text = string.Template((TEMPLATES_DIR / "signal_relay.sh").read_text()).safe_substitute(
        python=shlex.quote(python),
        relay=shlex.quote(str(Path(__file__).resolve().parent / "relay.py")),
        step_end_s=deadlines.STEP_END_S,
        step_kill_s=deadlines.STEP_KILL_S,
        beat_s=deadlines.RELAY_BEAT_S,
    )
    return text.rstrip("\n").split("\n")


def executor_parameters(
    cluster: ClusterConfig, job_name: str, max_parallel: int | None = None, dependency: str = ""
) -> dict[str, Any]:
    """submitit parameters for this cluster config (pure); `dependency`: sbatch's --dependency (pipeline.dependency),
    the stages' current jobs."""
    if cluster.executor == "local":
        # gpus_per_node always: submitit's local executor sets CUDA_VISIBLE_DEVICES to the first that many
        # GPUs, and to "" (none: a CPU run) without it.
        return {
            "tasks_per_node": cluster.tasks_per_node,
            "gpus_per_node": cluster.gpus_per_node,
            "timeout_min": cluster.timeout_min,
            "signal_delay_s": cluster.signal_lead_s,
        }
    params: dict[str, Any] = {
        "job_name": job_name,
        "nodes": cluster.nodes + cluster.spare_nodes,
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
    if cluster.elastic():
        # --nodes=2-4: Slurm starts it on as many as are free, at least 2. An additional parameter overrides
        # "nodes" in the script only. No --ntasks-per-node in the header: with it sbatch sets ntasks to
        # min_nodes x tasks_per_node and Slurm never gives more nodes than tasks (--nodes=2-4
        # --ntasks-per-node=1 started on 2 of 4 idle dev nodes). --mincpus reserves the tasks' CPUs on each
        # node instead, and srun places tasks_per_node ranks on every node it got.
        # submitit's own task count becomes nodes x 1; nothing reads it for a Slurm job (logs and results
        # go by srun's %t). SLURM_NTASKS unset: srun counts SLURM_NNODES x tasks_per_node, where an
        # inherited value (a submit from inside salloc) would make it ignore --ntasks-per-node.
        params.pop("ntasks_per_node")
        params["additional_parameters"]["nodes"] = f"{cluster.min_nodes}-{cluster.nodes}"
        params["additional_parameters"]["mincpus"] = cluster.tasks_per_node * cluster.cpus_per_task
        params["srun_args"] = [f"--ntasks-per-node={cluster.tasks_per_node}"]
        params["setup"] = [*params["setup"], "unset SLURM_NTASKS SLURM_NPROCS"]
    if cluster.spare_nodes:
        # The training step on `nodes` of the allocation; the signal relay's srun() reads this and, after an
        # in-job restart, replaces it with the relaunch's nodes and exclusions (hpc_train/relay.py).
        # With in_process_restart the spares run the step's standbys (rejoin.split_standby)
        n = cluster.nodes + (cluster.spare_nodes if cluster.in_process_restart else 0)
        step = f"--nodes={n} --ntasks={n * cluster.tasks_per_node}"
        params["setup"] = [*params["setup"], f"export HPC_TRAIN_STEP_ARGS='{step}'"]
        # A failed node then leaves the job instead of ending it (Slurm 22.05 excises it and kills the tasks
        # there); the relay's srun() runs the step --no-kill too, else Slurm SIGKILLs every task of it and no
        # rank is left to decide. The failure path blames the node (requeue.lost_nodes) and relaunches without it.
        params["additional_parameters"]["no-kill"] = True
    if cluster.switches:
        params["additional_parameters"]["switches"] = cluster.switches
    if cluster.partition:
        params["partition"] = cluster.partition
    if cluster.gpus_per_node and (cluster.gres is None or gres_gpus(cluster.gres) is None):
        params["gpus_per_node"] = cluster.gpus_per_node
    # Whole MiB, rounded up: int() made mem_gb=0.0005 into --mem=0M, which Slurm reads as all of the node's memory
    if cluster.mem_gb is not None:
        params["mem"] = f"{math.ceil(cluster.mem_gb * 1024)}M"
    if cluster.mem_per_cpu_gb is not None:
        params["mem_per_cpu"] = f"{math.ceil(cluster.mem_per_cpu_gb * 1024)}M"
    for key in ("account", "qos", "constraint", "gres", "mail_type", "mail_user", "nodelist", "exclude"):
        if getattr(cluster, key) is not None:
            params[key] = getattr(cluster, key)
    if cluster.exclusive:
        params["exclusive"] = True
    if cluster.reservation is not None:
        params["additional_parameters"]["reservation"] = cluster.reservation
    for key, value in cluster.sbatch_extra.items():  # submitit shell-quotes each value; True: a bare flag
        params["additional_parameters"][key.replace("_", "-")] = value if value else True
    if dependency:  # a stage that fails unseen (an admin's scancel) cancels this job, never DependencyNeverSatisfied
        params["additional_parameters"].update({"dependency": dependency, "kill-on-invalid-dep": "yes"})
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


def render(
    cluster: ClusterConfig,
    job_name: str,
    folder: Path,
    array_size: int | None = None,
    max_parallel: int | None = None,
    dependency: str = "",
) -> str:
    """The batch script exactly as submitit submits it (pure, but for reading the template files)."""
    from submitit.slurm.slurm import _make_sbatch_string

    params = executor_parameters(cluster, job_name, max_parallel, dependency)
    command = entry_command(python_command(cluster), folder)
    return _make_sbatch_string(command=command, folder=folder, map_count=array_size, **params)


def check_syntax(script: str) -> None:
    """`bash -n`: a setup line with an unbalanced quote fails here, not on the compute node."""
    proc = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True, timeout=10)
    if proc.returncode != 0:
        raise ValueError(
            f"the batch script would not parse: {proc.stderr.strip()}; check cluster.setup "
            f"and cluster.template for unbalanced quotes"
        )


def validate_live(
    cluster: ClusterConfig, script: str, array_size: int, max_parallel: int | None, warnings: list[str] | None = None
) -> list[str]:
    """Check the request against the running cluster; ValueError names key, value, limit and fix.
    Returns what could not be checked (also printed as a warning): sbatch --test-only then judges it.
    `warnings`: where a check that cannot be fixed any more goes instead of raising (resume: the frozen
    config's preempt_grace_s, which a site may have outgrown since the submit)."""
    from hpc_train import slurm

    parts = slurm.partitions()
    name = cluster.partition or next((p for p, f in parts.items() if f.get("Default") == "YES"), None)
    if name not in parts:
        raise ValueError(
            f"cluster.partition={cluster.partition!r} does not exist on this cluster; use one of {sorted(parts)}"
        )
    part = parts[name]
    if part.get("State") not in ("UP", None):
        raise ValueError(
            f"partition {name} is {part['State']}; jobs will not start; use one of "
            f"{sorted(p for p, f in parts.items() if f.get('State') == 'UP')}"
        )
    total_nodes = int(part.get("TotalNodes", "0"))
    max_nodes = part.get("MaxNodes", "UNLIMITED")
    limit = total_nodes if max_nodes == "UNLIMITED" else min(total_nodes, int(max_nodes))
    if cluster.nodes + cluster.spare_nodes > limit:
        spares = f" + cluster.spare_nodes={cluster.spare_nodes}" if cluster.spare_nodes else ""
        raise ValueError(
            f"cluster.nodes={cluster.nodes}{spares} exceeds partition {name}'s limit of {limit} nodes; "
            f"use cluster.nodes{' + spare_nodes' if spares else ''}<={limit} or another partition"
        )
    max_time = slurm.time_limit_min(part.get("MaxTime", "UNLIMITED"))
    if cluster.timeout_min > max_time:
        raise ValueError(
            f"cluster.timeout_min={cluster.timeout_min} exceeds partition {name}'s MaxTime of "
            f"{max_time:.0f} min; use cluster.timeout_min<={max_time:.0f} (the run requeues "
            f"itself at the limit and resumes)"
        )
    # A preempted run whose own requeue fails stays alive preempt_grace_s + 60 s for Slurm to kill and
    # requeue it (verdict.leave); with a longer GraceTime it exits first, and Slurm requeues no job that
    # ended on its own. Not on a partition Slurm never preempts (PreemptMode=OFF).
    grace = part.get("GraceTime", "0")
    if part.get("PreemptMode") != "OFF" and grace.isdigit() and int(grace) > cluster.preempt_grace_s:
        short = (
            f"cluster.preempt_grace_s={cluster.preempt_grace_s} is shorter than partition {name}'s GraceTime "
            f"of {grace} s: a preempted run whose requeue fails would exit before Slurm requeues it"
        )
        if warnings is None:
            raise ValueError(f"{short}; set cluster.preempt_grace_s={grace}")
        warnings.append(f"{short} (frozen at submit; a new run can set cluster.preempt_grace_s={grace})")
    node_info = slurm.nodes()
    in_partition = _expand(part.get("Nodes", ""))
    members = {n: node_info[n] for n in node_info if n in in_partition}
    _check_node_size(cluster, name, members)
    if max_parallel is not None and max_parallel < 1:
        raise ValueError(f"--max-parallel={max_parallel} must be >= 1")
    unchecked = _validate_site(cluster, name, part, members)
    _test_only(script, name)
    return unchecked


def _check_node_size(cluster: ClusterConfig, name: str, members: dict[str, dict[str, str]]) -> None:
    """The tasks' CPUs and the GPUs asked for fit the biggest of partition `name`'s nodes (scontrol show node)."""
    cpus = max((int(info.get("CPUTot", "0")) for info in members.values()), default=0)
    want_cpus = cluster.tasks_per_node * cluster.cpus_per_task
    if want_cpus > cpus:
        raise ValueError(
            f"cluster.tasks_per_node={cluster.tasks_per_node} x cluster.cpus_per_task="
            f"{cluster.cpus_per_task} = {want_cpus} CPUs per node, but partition {name}'s nodes have "
            f"at most {cpus}; lower one of them"
        )
    if cluster.gpus_per_node:
        gpus = max((_gpu_count(info.get("Gres", "")) for info in members.values()), default=0)
        if cluster.gpus_per_node > gpus:
            raise ValueError(
                f"cluster.gpus_per_node={cluster.gpus_per_node} but partition {name}'s nodes have "
                f"at most {gpus} GPUs (Gres); use cluster.gpus_per_node<={gpus} or a GPU partition"
            )


def _test_only(script: str, name: str) -> None:
    """sbatch --test-only of the rendered script; refused: ValueError with Slurm's words."""
    from hpc_train import slurm

    with tempfile.NamedTemporaryFile("w", suffix=".sh") as f:
        f.write(script)
        f.flush()
        for attempt in range(6):
            try:
                slurm.test_only(f.name)
                return
            except slurm.SlurmError as e:
                # Right after a controller restart, nodes have not re-registered ("idle*", "unk*") and
                # every request looks impossible for a few seconds: wait for them, up to ~10 s.
                states = slurm.call(["sinfo", "-h", "-p", name, "-o", "%t"]).split()
                if attempt < 5 and any(st.endswith("*") or st.startswith("unk") for st in states):
                    time.sleep(2)
                    continue
                raise ValueError(f"sbatch --test-only refused the request for partition {name}: {e}") from None


def _validate_site(
    cluster: ClusterConfig, partition: str, part: dict[str, str], node_info: dict[str, dict[str, str]]
) -> list[str]:
    """The site options against what Slurm holds: associations (slurmdbd), node features, reservations,
    node names. sbatch --test-only would refuse most of these too, but without saying what is valid."""
    from hpc_train import slurm

    unchecked = []
    if cluster.account is not None or cluster.qos is not None:
        unchecked += _validate_association(cluster, partition)
    if cluster.constraint is not None:
        features = sorted(
            {
                f
                for info in node_info.values()
                for f in info.get("AvailableFeatures", "").split(",")
                if f and f != "(null)"
            }
        )
        # sbatch's syntax: "a&b", "a|b", "[a|b]", "a*2" (a count), "a,b"
        for word in re.split(r"[&|,\[\]()!*\s]+", cluster.constraint):
            if word and not word.isdigit() and word not in features:
                raise ValueError(
                    f"cluster.constraint={cluster.constraint!r}: no node of partition {partition} has "
                    f"the feature {word!r}; features there: {features or 'none'} "
                    f"(`sinfo -p {partition} -o '%N %f'`)"
                )
    if cluster.reservation is not None:
        known = slurm.reservations()
        if cluster.reservation not in known:
            there = f"use one of {sorted(known)}" if known else "this cluster has none now"
            raise ValueError(
                f"cluster.reservation={cluster.reservation!r} does not exist; {there} (`scontrol show reservation`)"
            )
    for key in ("nodelist", "exclude"):
        value = getattr(cluster, key)
        unknown = sorted(_expand(value) - set(node_info)) if value else []
        if unknown:
            raise ValueError(
                f"cluster.{key}={value!r}: {', '.join(unknown)} not in partition {partition}; its nodes "
                f"are {part.get('Nodes', '')} (`sinfo -p {partition} -N`)"
            )
    return unchecked


def _validate_association(cluster: ClusterConfig, partition: str) -> list[str]:
    """Account and QoS against the user's associations in slurmdbd (`sacctmgr show assoc`). [] when
    checked; a warning when slurmdbd does not answer or sacctmgr is missing: slurmctld keeps its own copy
    of the associations, so sbatch --test-only (after this) still refuses a bad account or QoS."""
    import pwd
    import shutil

    from hpc_train import slurm

    config = slurm.show_config()
    enforce = config.get("AccountingStorageEnforce", "none")
    if config.get("AccountingStorageType") != "accounting_storage/slurmdbd" or not re.search(
        r"associations|limits|qos|safe", enforce
    ):
        return []  # Slurm then takes any account and QoS name: nothing to check them against
    user, cluster_name = pwd.getpwuid(os.getuid()).pw_name, config.get("ClusterName", "")
    try:
        default, rows = slurm.associations(user, cluster_name)
    except slurm.SlurmError as e:
        reason = "`sacctmgr` is not installed here" if shutil.which("sacctmgr") is None else str(e).splitlines()[0]
        note = f"account/qos not checked: {reason}; sbatch --test-only judges them"
        print(f"hpc-train: warning: {note}", file=sys.stderr, flush=True)
        return [note]
    rows = [r for r in rows if r[1] in ("", partition)]  # an association may be for one partition only
    accounts = sorted({account for account, _, _ in rows})
    if not accounts:
        raise ValueError(
            f"user {user} has no Slurm account on cluster {cluster_name} for partition {partition}; "
            f"ask your Slurm administrator to add one (sacctmgr add user {user} account=...)"
        )
    account = cluster.account or default
    if account not in accounts:
        what = f"cluster.account={cluster.account!r} is" if cluster.account else f"your default account {default!r} is"
        raise ValueError(
            f"{what} not an account of user {user} on cluster {cluster_name} (partition {partition}); "
            f"use cluster.account= one of {accounts} (`sacctmgr show assoc user={user}`)"
        )
    if cluster.qos is not None:
        allowed = sorted({q for a, _, qos in rows if a == account for q in qos})
        if cluster.qos not in allowed:
            whose = f"account {account}" + ("" if cluster.account else " (your default)")
            raise ValueError(
                f"cluster.qos={cluster.qos!r} is not allowed for {whose} of user {user}; use "
                f"cluster.qos= one of {allowed} (`sacctmgr show assoc user={user} format=account,qos`)"
            )
    return []


def _expand(nodelist: str) -> set[str]:
    from hpc_train.env import parse_nodelist

    return set(parse_nodelist(nodelist))


def _gpu_count(gres: str) -> int:
    """ "gpu:a100:8(S:0-1),shard:4" -> 8."""
    return sum(int(m.group(1)) for m in re.finditer(r"gpu(?::[\w-]+)?:(\d+)", gres))


def make_executor(
    cluster: ClusterConfig, folder: Path, job_name: str, max_parallel: int | None = None, dependency: str = ""
) -> Any:
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
    executor.update_parameters(**executor_parameters(cluster, job_name, max_parallel, dependency))
    return executor
