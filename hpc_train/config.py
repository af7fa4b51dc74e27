"""The root config: composed by Hydra from conf/ on the login node, frozen as config.yaml at submit.

The trainer-side dataclasses live here rather than in model.py/train.py/checkpoint.py because those
import torch (~1.5 s), and the login node validates every config without importing torch. Each class
says which module it configures. ClusterConfig lives beside the executor code in sbatch.py, PreflightConfig
in preflight.py (torch-free at import). The checks in __post_init__ are pure (no file read, no import
lookup, no sys.path edit); check_environment is the one step that asks this machine.
"""

from __future__ import annotations

import functools
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpc_train import shipped_dir
from hpc_train.preflight import PreflightConfig
from hpc_train.sbatch import ClusterConfig
from hpc_train.script import ScriptConfig
from hpc_train.straggler import StragglerConfig
from hpc_train.tracking import TrackingConfig

CONF_DIR = Path(shipped_dir("conf"))  # the starter configs; `hpc-train init` copies them to ./conf


def check_at_least(scope: str, cfg: Any, minimums: dict[str, tuple[float, str]]) -> None:
    """The first field below its minimum, or not finite -> `scope.key=value must be >= low: what it is; e.g.
    scope.key=default`. `not (value >= low)`: nan compares False with everything, so `value < low` let it through."""
    from dataclasses import fields

    defaults = {f.name: f.default for f in fields(cfg)}
    for key, (low, what) in minimums.items():
        value = getattr(cfg, key)
        if not (value >= low and math.isfinite(value)):
            finite = "" if math.isfinite(value) else "finite and "
            raise ValueError(
                f"{scope}.{key}={value} must be {finite}>= {low:g}: {what}; e.g. {scope}.{key}={defaults[key]}"
            )


@dataclass
class ModelConfig:  # model.py
    vocab_size: int = 256  # byte-level tokens; data=tokens raises it to the data's (meta.json)
    seq_len: int = 32
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4

    def __post_init__(self) -> None:
        check_at_least(
            "model",
            self,
            {
                "vocab_size": (2, "token ids the model predicts (byte tokens: 256)"),
                "seq_len": (1, "tokens per training sequence, the context length"),
                "n_layers": (1, "transformer blocks"),
                "n_heads": (1, "attention heads per block"),
                "d_model": (1, "the width of every token's vector"),
            },
        )
        if self.d_model % self.n_heads:
            raise ValueError(
                f"model.d_model={self.d_model} must be divisible by model.n_heads={self.n_heads}; "
                f"use n_heads in {[h for h in range(1, 17) if self.d_model % h == 0]}"
            )


@dataclass
class DataConfig:  # data.py
    # "synthetic": generated in-process, no download, same bytes on every rank, with a held-out corpus of
    # corpus_words / 8 more words for evaluation; "tokens": the shards `hpc-train prepare-data` wrote into
    # `path`, read by memmap (its held-out split: `prepare-data --val-fraction`)
    source: str = "synthetic"
    path: str = ""
    corpus_words: int = 16384  # synthetic: "words" of 3-8 tokens in the generated corpus (~90 k tokens)
    seed: int = 0  # the corpus and the order windows are visited in
    # A resume on data other than the checkpoint's (a shard appended, removed or resized: another window
    # order from then on) stops with a sentence; true trains on with the data as it is then, recording a
    # `data_changed` event. A run that stopped so: hpc-train resume RUN --allow-data-changed.
    allow_changed: bool = False

    def __post_init__(self) -> None:
        if self.source not in ("synthetic", "tokens"):
            raise ValueError(
                f"data.source={self.source!r} is not one of ('synthetic', 'tokens'); use data=synthetic "
                f"or data=tokens data.path=DIR"
            )
        if self.source == "tokens" and not self.path:
            raise ValueError(
                "data.source=tokens needs data.path: the directory `hpc-train prepare-data FILES... --out DIR` wrote"
            )
        if self.corpus_words < 64:
            raise ValueError(f"data.corpus_words={self.corpus_words} must be >= 64 so every batch finds a window")
        check_at_least("data", self, {"seed": (0, "numpy seeds the corpus and the window order with it")})


LR_SCHEDULES = ("cosine", "linear", "constant", "wsd")


@dataclass
class TrainConfig:  # train.py
    steps: int = 60
    batch_seqs_per_rank: int = 8  # per data-parallel rank: the train.tp ranks of a tensor-parallel group share one
    lr: float = 3e-3  # the peak, reached at the end of warm-up
    # After warm-up (lr_at): "cosine" to min_lr_fraction x lr; "linear" to the same; "constant"; "wsd":
    # warmup-stable-decay, constant until the last decay_fraction of the steps, then linear to the floor.
    lr_schedule: str = "cosine"
    warmup_steps: int = 5  # linear from lr / warmup_steps to lr
    min_lr_fraction: float = 0.1  # the floor the decay heads for, as a fraction of lr (reached at step `steps`)
    decay_fraction: float = 0.2  # wsd: the share of all steps spent decaying (MiniCPM, Hu et al. 2024: ~10-20%)
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    weight_decay: float = 0.1  # AdamW's decoupled decay, on every parameter
    grad_clip: float = 1.0  # max total gradient norm (the norm before clipping is logged as grad_norm)
    seed: int = 0
    log_every_steps: int = 10
    # Mean loss over eval_batches held-out batches per data-parallel rank (each batch_seqs_per_rank
    # sequences; the same batches every time) every eval_every_steps and at the last step. 0 = off.
    eval_every_steps: int = 0
    eval_batches: int = 4
    # A floor on each step's wall time, for drills and tests that must land a signal mid-run. 0 = off.
    min_step_time_s: float = 0.0
    rendezvous_timeout_s: int = 120
    parallelism: str = "ddp"  # "ddp": replicate and all-reduce; "fsdp": FSDP2, shard params/grads/optimizer
    # Tensor-parallel ranks per group (fsdp only): each block's matmuls split over tp ranks of one node,
    # FSDP2 shards over the tasks_per_node / tp * nodes groups. 1 = off.
    tp: int = 1
    bf16: bool | None = None  # autocast matmuls to bfloat16; None: on for GPU, off for CPU
    activation_checkpointing: bool | None = None  # recompute each block in backward; None: on for GPU
    # torch.compile each block (inductor). Needs a C++ compiler ($CXX or g++) where the job runs; the
    # first step pays the compilation (~25 s for model=tiny on the 2-core test machine; then cached on disk).
    compile: bool = False
    grad_accum_steps: int = 1  # micro-batches of batch_seqs_per_rank summed into one optimizer step
    # A step (collectives and save included) that takes longer is a hang: every rank dumps its Python
    # stack to its log and the job fails (then requeues within requeue.max_failures). Keep it above the
    # slowest step + synchronous save.
    watchdog_s: float = 900.0
    peak_tflops_per_device: float = 0.0  # for MFU; 0: detected for known GPUs, "n/a" on CPU

    def __post_init__(self) -> None:
        if self.parallelism not in ("ddp", "fsdp"):
            raise ValueError(f"train.parallelism={self.parallelism!r} is not one of ('ddp', 'fsdp')")
        if self.tp < 1 or (self.tp > 1 and self.parallelism != "fsdp"):
            raise ValueError(
                f"train.tp={self.tp} needs train.parallelism=fsdp (FSDP2 + tensor parallel on a 2-D "
                f"mesh) and must be >= 1; got parallelism={self.parallelism!r}"
            )
        if not (self.lr > 0 and self.grad_clip > 0 and math.isfinite(self.lr) and math.isfinite(self.grad_clip)):
            raise ValueError(f"train.lr={self.lr} and train.grad_clip={self.grad_clip} must be > 0 and finite")
        if self.grad_accum_steps < 1 or not (self.watchdog_s > 0 and math.isfinite(self.watchdog_s)):
            raise ValueError(
                f"train.grad_accum_steps={self.grad_accum_steps} must be >= 1 and train.watchdog_s="
                f"{self.watchdog_s} > 0"
            )
        if self.steps < 1 or self.batch_seqs_per_rank < 1:
            raise ValueError(
                f"train.steps={self.steps} and train.batch_seqs_per_rank={self.batch_seqs_per_rank} must both be >= 1"
            )
        check_at_least(
            "train",
            self,
            {
                "warmup_steps": (0, "steps of linear warm-up (0: start at the peak lr)"),
                "weight_decay": (0, "AdamW's decoupled decay: each step shrinks weights by lr x weight_decay"),
                "seed": (0, "the initial weights' seed"),
                "log_every_steps": (1, "a metrics line every this many steps"),
                "eval_every_steps": (0, "0 = no evaluation"),
                "eval_batches": (1, "held-out batches per data-parallel rank in each evaluation"),
                "min_step_time_s": (0, "0 = off"),
                "rendezvous_timeout_s": (1, "seconds the ranks wait for each other at start"),
                "peak_tflops_per_device": (0, "0 = detect the GPU"),
            },
        )
        if self.eval_batches > 10_000:  # each rank's loop; ~100 s at 10 ms a batch, every eval_every_steps
            raise ValueError(
                f"train.eval_batches={self.eval_batches} must be <= 10000: an evaluation holds up "
                f"training and must stay short; e.g. train.eval_batches=4"
            )
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(
                f"train.lr_schedule={self.lr_schedule!r} is not one of {LR_SCHEDULES}; e.g. train.lr_schedule=cosine"
            )
        intervals = {
            "min_lr_fraction": (0.0 <= self.min_lr_fraction <= 1.0, "[0, 1]"),
            "decay_fraction": (0.0 < self.decay_fraction <= 1.0, "(0, 1]"),
            "adam_beta1": (0.0 <= self.adam_beta1 < 1.0, "[0, 1)"),  # 1 would never forget a gradient
            "adam_beta2": (0.0 <= self.adam_beta2 < 1.0, "[0, 1)"),
        }
        for key, (ok, interval) in intervals.items():
            if not ok:
                raise ValueError(
                    f"train.{key}={getattr(self, key)} must be in {interval}; e.g. train.{key}="
                    f"{getattr(TrainConfig, key)}"
                )
        if not (self.adam_eps > 0 and math.isfinite(self.adam_eps)):
            raise ValueError(
                f"train.adam_eps={self.adam_eps} must be > 0 (it keeps AdamW's division finite); "
                f"e.g. train.adam_eps=1e-8"
            )


AUTO = "auto"  # checkpoint.every_steps / memory_every_steps: the interval that pays best (intervals.py)
# An auto interval's saves until one is measured: the first disk save at step 20 (the fixed default), the first
# copy in memory at step 5; from then on planning.py chooses from what they cost (docs/goodput.md)
FIRST_AUTO_STEPS = {"every_steps": 20, "memory_every_steps": 5}


@dataclass
class CheckpointConfig:  # checkpoint.py
    # periodic save; a stop signal also saves at the next step boundary. "auto": the interval that maximises the
    # expected goodput from this run's save cost and the site's rate of unannounced faults (docs/goodput.md)
    every_steps: int | str = 20
    keep_last: int = 2  # periodic checkpoints kept below the newest verified one; older stop saves go
    keep_every_steps: int = 0  # also keep every checkpoint whose step is a multiple of this; 0 = none
    # Periodic saves write in the background: the loop waits only while state is copied to host memory.
    # Final saves are synchronous; a stop save uses the background writer too, so that it can be given
    # up on when the time before SIGKILL runs out (Saver.stop).
    async_save: bool = True
    # A new run starting from another run's committed checkpoint: a run directory (its newest), its
    # checkpoints/ folder or one step folder. Frozen at submit as the absolute step folder; used only
    # while this run has no checkpoint of its own. Weights only, unless init_from_optimizer.
    init_from: str = ""
    init_from_optimizer: bool = False  # also the AdamW state (moments, step count, betas, weight decay)
    # memory_tier.py: every N steps each rank's state goes to a file in node-local tmpfs and to a buddy rank on
    # another node, which an in-job restart (cluster.spare_nodes) loads when newer than the disk checkpoint.
    # 0 = off. Holds up to 4 copies of a rank's state per rank in memory_dir (own + buddy, newest complete + next
    # while it is written). Needs cluster.spare_nodes on Slurm: only a relaunch inside the allocation reads it.
    memory_every_steps: int | str = 0  # "auto": as every_steps=auto, for the faults this tier survives
    memory_dir: str = "/dev/shm"  # node-local and in RAM: outlives the training step, not the node
    # The site's history behind "auto" and the forecast (history.py): sacct and the project's journals over this many
    # days; with fewer jobs than history_min_jobs in it the defaults are used (1 unannounced fault per 5,000
    # node-hours). A small site or a new partition may trust fewer jobs; 10: a rate is not a handful of jobs' luck
    history_window_days: float = 30.0
    history_min_jobs: int = 10

    def steps(self, name: str) -> int:
        """every_steps or memory_every_steps as the loop starts: the number given, or for "auto" the first interval
        before any save is measured (FIRST_AUTO_STEPS; intervals.py chooses once one is)."""
        value = getattr(self, name)
        return FIRST_AUTO_STEPS[name] if value == AUTO else int(value)

    def __post_init__(self) -> None:
        for name in ("every_steps", "memory_every_steps"):
            value = getattr(self, name)
            if isinstance(value, str) and value != AUTO:
                raise ValueError(
                    f"checkpoint.{name}={value!r} is neither a number of steps nor auto; e.g. checkpoint.{name}=50, "
                    f"or checkpoint.{name}=auto (the interval that pays best: docs/goodput.md)"
                )
        if self.steps("memory_every_steps") < 0 or not self.memory_dir.startswith("/"):
            raise ValueError(
                f"checkpoint.memory_every_steps={self.memory_every_steps} must be >= 0 (0: no copies in memory) "
                f"and checkpoint.memory_dir={self.memory_dir!r} an absolute path (a node-local tmpfs, e.g. /dev/shm)"
            )
        if self.steps("every_steps") < 1 or self.keep_last < 1 or self.keep_every_steps < 0:
            raise ValueError(
                f"checkpoint.every_steps={self.every_steps} and checkpoint.keep_last="
                f"{self.keep_last} must be >= 1, checkpoint.keep_every_steps="
                f"{self.keep_every_steps} >= 0"
            )
        days, jobs = self.history_window_days, self.history_min_jobs
        if not 0 < days <= 3650 or jobs < 1:  # sacct's start time is a date: 10 years, not 1e12 days
            raise ValueError(
                f"checkpoint.history_window_days={days} must be in (0, 3650] and checkpoint.history_min_jobs={jobs} "
                f">= 1 (the "
                f"days of the site's history read, the jobs it needs to be trusted); e.g. "
                f"checkpoint.history_window_days=30 checkpoint.history_min_jobs=10"
            )
        if self.init_from_optimizer and not self.init_from:
            raise ValueError(
                "checkpoint.init_from_optimizer=true needs checkpoint.init_from=PATH (a run directory "
                "or a step folder of another run)"
            )


@dataclass
class ProfileConfig:  # profiling.py, driven by Attempt.step_end: the built-in trainer and every function
    # torch.profiler records global steps start_step .. start_step + active_steps - 1 (step 1 is the first
    # optimizer step), one Chrome/Perfetto trace per rank under profile/; the warmup_steps before them run
    # it unrecorded, so its start-up cost is not in the first recorded step. active_steps=0: off, at no cost.
    start_step: int = 10
    active_steps: int = 0
    warmup_steps: int = 1
    memory: bool = False  # also a CUDA memory snapshot of those steps per rank (GPU only; pytorch.org/memory_viz)

    def __post_init__(self) -> None:
        check_at_least(
            "profile",
            self,
            {
                "active_steps": (0, "steps recorded, 0 = off (a trace of 3 steps is the usual size)"),
                "warmup_steps": (0, "steps the profiler runs unrecorded before start_step"),
            },
        )
        if self.active_steps and not self.start_step > self.warmup_steps:
            raise ValueError(
                f"profile.start_step={self.start_step} must be >= {self.warmup_steps + 1}: the first step is 1 "
                f"and profile.warmup_steps={self.warmup_steps} steps come before the first recorded one; "
                f"e.g. profile.start_step={self.warmup_steps + 1}, or profile.warmup_steps=0"
            )
        if self.memory and not self.active_steps:
            raise ValueError(
                "profile.memory=true snapshots CUDA memory over the profiled steps, and profile.active_steps=0 "
                "profiles none; e.g. profile.active_steps=3"
            )


@dataclass
class RequeueConfig:  # job.py: how often a run may requeue itself; counted in its events.jsonl
    max_preemptions: int = -1  # -1: unlimited; a preemption is the cluster's choice, not the run's fault
    max_time_limit_requeues: int = 100  # each one is a full time limit of progress
    max_failures: int = 2  # crashes and hangs: a crash loop stops after this many requeues
    # Sick nodes (a failed preflight, a hardware error) left out of later attempts with ExcNodeList;
    # never so many that the partition keeps fewer than the run needs. A resume starts again from none.
    max_excluded_nodes: int = 2
    # cluster.min_nodes < cluster.nodes: after a requeue the next attempt waits for all nodes (grows back)
    # when the queue says they are free within this long, else it starts on what Slurm gives (>= min_nodes).
    shrink_after_s: float = 600.0
    # cluster.spare_nodes > 0: a failure relaunches the training step inside the allocation (a blamed node
    # left out, a spare taken) instead of requeueing, this many times in a row without a newer checkpoint
    # (as max_failures counts); then it requeues as before. 0: never.
    max_in_job_restarts: int = 3

    def __post_init__(self) -> None:
        if not self.shrink_after_s >= 0:
            raise ValueError(f"requeue.shrink_after_s={self.shrink_after_s} must be >= 0 (0: never wait for all nodes)")
        if (
            self.max_failures < 0
            or self.max_time_limit_requeues < 0
            or self.max_preemptions < -1
            or self.max_excluded_nodes < 0
            or self.max_in_job_restarts < 0
        ):
            raise ValueError(f"requeue budgets must be >= 0 (max_preemptions may be -1 = unlimited); got {self}")


@dataclass
class FnConfig:  # job.py: the training function, yours or the built-in one
    # "package.module.function", called on every rank as function(at, **kwargs) with an attempt.Attempt;
    # empty: the built-in trainer (hpc_train.train.main)
    _target_: str = ""
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self._target_ and not re.fullmatch(r"[A-Za-z_][\w.]*\.[A-Za-z_]\w*", self._target_):
            raise ValueError(f"fn._target_={self._target_!r} is not a dotted path; write package.module.function")


@dataclass
class RunConfig:
    name: str = "demo"
    out_dir: str = "runs"  # run directories are created below this, one per submit
    # Folders we create (run and sweep directories, submitit/, checkpoints/, step folders) are 0700: only
    # you. true: 0750, so your group can read a run (status, logs, init_from) but never write in it.
    # Files are never group-writable either way; those holding cluster.env values stay 0600 (docs/cluster.md).
    share_with_group: bool = False
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    requeue: RequeueConfig = field(default_factory=RequeueConfig)
    preflight: PreflightConfig = field(default_factory=PreflightConfig)  # node health at attempt start
    fn: FnConfig = field(default_factory=FnConfig)
    script: ScriptConfig = field(default_factory=ScriptConfig)  # your own command on every rank (script.py)
    metrics: TrackingConfig = field(default_factory=TrackingConfig)  # TensorBoard, W&B, MLflow (tracking.py)
    straggler: StragglerConfig = field(default_factory=StragglerConfig)  # slow ranks named (straggler.py)
    profile: ProfileConfig = field(default_factory=ProfileConfig)  # torch.profiler traces (profiling.py)

    def __post_init__(self) -> None:
        from hpc_train.topology import mesh_shape

        tp, per_node = self.train.tp, self.cluster.tasks_per_node
        mesh_shape(per_node * self.cluster.nodes, per_node, tp)  # the job's own check, at submit
        if tp > 1 and self.model.n_heads % tp:
            raise ValueError(
                f"train.tp={tp} must divide model.n_heads={self.model.n_heads}: each rank holds whole attention heads"
            )
        if self.checkpoint.memory_every_steps and self.cluster.executor == "slurm" and not self.cluster.spare_nodes:
            raise ValueError(
                f"checkpoint.memory_every_steps={self.checkpoint.memory_every_steps} with cluster.spare_nodes=0: on "
                f"Slurm every failure then requeues into a new allocation, which cannot read copies in the old "
                f"nodes' memory; set cluster.spare_nodes=1 (or more) or checkpoint.memory_every_steps=0"
            )
        if self.cluster.in_process_restart and self.script.cmd:
            raise ValueError(
                "cluster.in_process_restart=true keeps the trainer's processes across a crash, but a command after "
                "-- (script.cmd) runs in processes of its own; set cluster.in_process_restart=false"
            )
        if self.script.cmd and self.fn._target_:
            raise ValueError(
                f"fn._target_={self.fn._target_!r} and a command after -- (script.cmd) both say what every rank "
                f"runs; give one of them"
            )
        if self.profile.active_steps and self.script.cmd:
            raise ValueError(
                f"profile.active_steps={self.profile.active_steps} profiles the built-in trainer and functions "
                f"(fn._target_) through Attempt.step_end; a command after -- runs its own loop: use "
                f"torch.profiler in the script (docs/profiling.md), or set profile.active_steps=0"
            )
        pc = self.profile
        if pc.active_steps and not self.fn._target_ and pc.start_step > self.train.steps:
            raise ValueError(
                f"profile.start_step={pc.start_step} is past train.steps={self.train.steps}: nothing would be "
                f"profiled; e.g. profile.start_step={max(pc.warmup_steps + 1, self.train.steps // 2)}"
            )
        # The name becomes a directory and the Slurm job name: keep it to characters that need no quoting.
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", self.name):
            raise ValueError(
                f"name={self.name!r} must be 1-64 letters, digits, '.', '_' or '-' (it names the run "
                f"directory and the Slurm job); e.g. name=lr-sweep"
            )
        if any(ord(c) < 32 for c in self.out_dir):
            raise ValueError(f"out_dir={self.out_dir!r} contains a control character (newline?); give a plain path")


def check_environment(run: RunConfig) -> None:
    """What the dataclasses' checks cannot know: whether this machine has what the run needs. The one step
    that touches the world, after the pure validation: at submit (and `--cfg job`, `hpc-train resume`), and
    in every task of the job before it trains (a compute node may lack what the login node has). Raises
    ValueError naming the key, the value and the fix. data=tokens: raises model.vocab_size to meta.json's
    (a larger one, e.g. padded to a multiple of 64 for faster matmuls, is kept); submit freezes it."""
    import importlib.util
    import os
    import shutil
    import sys

    cxx = os.environ.get("CXX", "g++")  # the C++ compiler torch.compile's inductor looks for
    if run.train.compile and shutil.which(cxx) is None:
        raise ValueError(
            f"train.compile=true needs a C++ compiler for torch.compile (inductor), and "
            f"{cxx!r} is not on PATH here; install g++ (apt-get install g++) "
            f"or set CXX, or set train.compile=false"
        )
    if run.fn._target_:
        module, cwd = run.fn._target_.rsplit(".", 1)[0], os.getcwd()
        added = cwd not in sys.path  # the job's sys.path ends with the cwd (start.py): here too, for this lookup
        if added:
            sys.path.append(cwd)
        try:  # finds the file without running it (its parent packages are imported)
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            found = False
        finally:
            if added:
                sys.path.remove(cwd)
        if not found:
            raise ValueError(
                f"fn._target_={run.fn._target_!r}: module {module!r} is not importable here; install it "
                f"(pip install -e .) or add its folder to PYTHONPATH, which the job inherits"
            )
    from hpc_train.tracking import PACKAGES

    for switch, module in PACKAGES.items():
        if getattr(run.metrics, switch) and importlib.util.find_spec(module) is None:
            raise ValueError(
                f"metrics.{switch}=true needs the {module} package, which is not installed in "
                f"this Python; run: pip install 'hpc_train[{switch}]' (the job uses the same "
                f"environment), or set metrics.{switch}=false"
            )
    if run.data.source == "tokens":
        from hpc_train.data import read_meta

        meta = read_meta(Path(run.data.path))  # the data's tokenizer sets the vocabulary
        run.model.vocab_size = max(run.model.vocab_size, int(meta["vocab_size"]))
        val = meta.get("val_shards", [])
        if run.train.eval_every_steps and max((s["tokens"] for s in val), default=0) <= run.model.seq_len:
            raise ValueError(
                f"train.eval_every_steps={run.train.eval_every_steps} needs a held-out split with a "
                f"window of model.seq_len + 1 = {run.model.seq_len + 1} tokens, and data.path="
                f"{run.data.path!r} has {sum(s['tokens'] for s in val)} held-out tokens; prepare it "
                f"with `hpc-train prepare-data ... --val-fraction 0.01`, or set train.eval_every_steps=0"
            )


def register_schema() -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="run_schema", node=RunConfig)


@dataclass(frozen=True)
class ConfigSource:
    """Where a config is composed from, as in Hydra: the primary config directory (--config-path; else
    ./conf when it holds config.yaml (or the --config-name file); else the package's) and file (--config-name), then
    directories searched after it (--config-dir: add options such as cluster/mysite.yaml, copy nothing)."""

    dir: Path = CONF_DIR
    name: str = "config"
    extra: tuple[Path, ...] = ()

    @staticmethod
    def find(
        config_path: str | None = None, config_name: str | None = None, config_dirs: list[str] | tuple[str, ...] = ()
    ) -> ConfigSource:
        # ./conf only when it holds the primary config: a project's unrelated conf/ (or a dangling link) is not ours
        own = Path("conf") / f"{config_name or 'config'}.yaml"
        primary = Path(config_path) if config_path else Path("conf") if own.is_file() else CONF_DIR
        for d in (primary, *map(Path, config_dirs)):
            if not d.is_dir():
                raise ValueError(
                    f"config directory {str(d)!r} does not exist; give a folder holding config.yaml "
                    f"and groups such as cluster/ (hpc-train init writes one to ./conf)"
                )
        return ConfigSource(primary.resolve(), config_name or "config", tuple(Path(d).resolve() for d in config_dirs))

    def is_group(self, key: str) -> bool:
        return any((d / key).is_dir() for d in (self.dir, *self.extra))


def compose(overrides: list[str], source: ConfigSource = ConfigSource()) -> Any:
    """Compose the source's primary config with Hydra overrides; returns the DictConfig, typed by RunConfig."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    register_schema()
    if source.extra:  # Hydra's --config-dir: searched after the primary directory
        overrides = [f"hydra.searchpath=[{','.join(f'file://{d}' for d in source.extra)}]", *overrides]
    with initialize_config_dir(config_dir=str(source.dir), version_base=None):
        return hydra_compose(config_name=source.name, overrides=overrides)


def expand_sweep(overrides: list[str], multirun: bool = True) -> list[list[str]]:
    """Hydra's sweep grammar -> one override list per trial, in Hydra's order (last key varies fastest).

    `a=1,2`, `a=range(0,10,2)`, `a=choice(x,y)` and config-group sweeps (`model=tiny,small`) expand;
    everything else is passed through to every trial. Without multirun a sweep is refused: add -m.
    """
    import itertools

    from hydra.core.override_parser.overrides_parser import OverridesParser

    axes = []
    for o in OverridesParser.create().parse_overrides(overrides):
        if o.is_sweep_override():
            if not multirun:
                raise ValueError(
                    f"{o.input_line!r} gives several values, a sweep: add -m to run one trial per "
                    f"value (hpc-train submit -m ... {o.input_line}), or write one value; a list value "
                    f"is written [a,b], a string with a comma is quoted"
                )
            if o.is_interval_sweep():
                raise ValueError(
                    f"{o.input_line!r}: interval() needs an optimizing sweeper; list the values, e.g. range() or a,b,c"
                )
            axes.append([f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()])
        else:
            axes.append([o.input_line])
    return [list(trial) for trial in itertools.product(*axes)]


def compose_trials(
    trials: list[list[str]], source: ConfigSource = ConfigSource()
) -> list[tuple[dict[str, Any], RunConfig]]:
    """(resolved config as plain dicts, its validated RunConfig) per trial; pure but for Hydra reading conf/.

    Hydra's compose costs ~50 ms, 53 s for 1,000 trials. So compose once per distinct set of
    config-group choices and structural overrides, then set each trial's plain `key=value` overrides on a
    copy of that resolved dict (~0.1 ms), type-checked by `build`. Trials whose values could interact
    with an interpolation (`${...}` in the composed tree or in the value) take the full compose.
    Each distinct override string is parsed once, and `key=literal` without Hydra's parser
    (`_plain_override`): its ANTLR parse took 0.2 ms an override, 2 s of a 10,000-point sweep.
    """
    import pickle

    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    parser = OverridesParser.create()
    bases: dict[tuple[str, ...], tuple[dict[str, Any], bool]] = {}
    parsed: dict[str, Any] = {}  # override string -> (key, value) when plain, else Hydra's Override
    groups: dict[str, bool] = {}  # key -> whether it names a config group (a directory)
    out = []
    for trial in trials:
        fast: list[tuple[str, Any]] = []
        structural = []
        for line in trial:
            if line not in parsed:
                parsed[line] = _plain_override(line) or parser.parse_overrides([line])[0]
            o = parsed[line]
            if isinstance(o, tuple):
                key, value = o
            elif o.type.name == "CHANGE" and o.package is None and "${" not in o.input_line:
                key, value = o.key_or_group, o.value()
            else:
                structural.append(line)
                continue
            if key not in groups:
                groups[key] = key.startswith("hydra.") or source.is_group(key)
            if groups[key]:
                structural.append(line)
            else:
                fast.append((key, value))
        if tuple(structural) not in bases:
            cfg = compose(structural, source)
            raw = OmegaConf.to_container(cfg, resolve=False)
            node_refs = re.search(r"\$\{(?!oc\.env:)", str(raw)) is not None
            bases[tuple(structural)] = (OmegaConf.to_container(cfg, resolve=True), node_refs)  # type: ignore[assignment]
        base, node_refs = bases[tuple(structural)]
        if node_refs and fast:
            cfg = compose(trial, source)
            resolved = OmegaConf.to_container(cfg, resolve=True)
        else:
            # A plain tree of dicts, lists and scalars: pickle copies it 5x faster than copy.deepcopy.
            resolved = pickle.loads(pickle.dumps(base, pickle.HIGHEST_PROTOCOL))
            for key, value in fast:
                _set_dotted(resolved, key, value)
        out.append((resolved, build(RunConfig, resolved)))  # type: ignore[arg-type]
    return out


# `key=value` as Hydra's grammar (hydra/grammar/OverrideLexer.g4) reads it, for a subset of it only: a
# dotted key of identifiers, and a value that is one INT, FLOAT or ID token (Hydra's int(), float(), the
# text). BOOL, NULL, inf and nan look like IDs but are other tokens: left to Hydra's parser, as is
# anything else (quotes, lists, functions, +/~ prefixes, @package, spaces, underscores in numbers).
_PLAIN = re.compile(
    r"(?P<key>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)="
    r"(?:(?P<int>-?(?:0|[1-9][0-9]*))"
    r"|(?P<float>-?(?:0|[1-9][0-9]*)(?:\.[0-9]+(?:[eE][+-]?[0-9]+)?|[eE][+-]?[0-9]+))"
    r"|(?P<id>[A-Za-z_][A-Za-z0-9_-]*))",
    re.ASCII,
)
_NOT_IDS = ("true", "false", "null", "inf", "nan")


def _plain_override(line: str) -> tuple[str, Any] | None:
    """(key, value) of a plain `key=literal` override exactly as Hydra's parser types it; None otherwise."""
    m = _PLAIN.fullmatch(line)
    if m is None:
        return None
    if m["int"] is not None:
        return m["key"], int(m["int"])
    if m["float"] is not None:
        return m["key"], float(m["float"])
    return None if m["id"].lower() in _NOT_IDS else (m["key"], m["id"])


def _nearest(word: str, options: Any) -> str | None:
    import difflib

    near = difflib.get_close_matches(word, [str(o) for o in options], n=1, cutoff=0.6)
    return near[0] if near else None


def did_you_mean(key: str, part: int, options: Any) -> str:
    """ "\ndid you mean train.steps?" for key "trian.steps" whose part 0 is not among options; "" if none is near."""
    parts = key.split(".")
    near = _nearest(parts[part], options)
    return f"\ndid you mean {'.'.join([*parts[:part], near, *parts[part + 1 :]])}?" if near else ""


def _set_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
    *parents, leaf = key.split(".")
    node = tree
    for i, part in enumerate(parents):
        if not isinstance(node.get(part), dict):
            raise ValueError(
                f"Could not override '{key}': '{'.'.join(parents[: i + 1])}' is not a config group "
                f"or section{did_you_mean(key, i, [k for k, v in node.items() if isinstance(v, dict)])}"
            )
        node = node[part]
    if leaf not in node:
        where = ".".join(parents) or "the top level"
        raise ValueError(
            f"Could not override '{key}': no key '{leaf}'\nvalid keys under {where}: "
            f"{', '.join(node)}{did_you_mean(key, len(parents), node)}"
        )
    node[leaf] = value


def build(cls: type, data: dict[str, Any], path: str = "") -> Any:
    """Plain dict -> dataclass instance, checking keys and value types; runs every __post_init__."""
    hints, names, nested = _fields(cls)
    for key in data:
        if key not in hints:
            raise ValueError(
                f"Key '{path}{key}' is not in {cls.__name__}\n"
                f"valid keys under {path.rstrip('.') or 'the top level'}: {', '.join(names)}"
                f"{did_you_mean(path + key, path.count('.'), names)}"
            )
    kwargs = {}
    for key, value in data.items():
        hint = hints[key]
        if key in nested:
            kwargs[key] = build(hint, value, f"{path}{key}.")
        elif type(value) is hint and hint in _SCALARS:  # most values: checked without building their name
            kwargs[key] = value
        else:
            kwargs[key] = _check_type(value, hint, f"{path}{key}")
    return cls(**kwargs)


@functools.cache
def _fields(cls: type) -> tuple[dict[str, Any], list[str], set[str]]:
    """A dataclass's resolved type hints, its field names and those that are dataclasses themselves:
    typing.get_type_hints evaluates every annotation string each call (~0.1 ms a class, 1 ms of each
    trial's build), and none of it ever changes."""
    from dataclasses import fields, is_dataclass

    every = typing.get_type_hints(cls)
    hints = {f.name: every[f.name] for f in fields(cls)}
    return hints, list(hints), {k for k, h in hints.items() if is_dataclass(h)}


_SCALARS = (int, float, str, bool)
_UNIONS = (typing.Union, getattr(types, "UnionType", None))  # Optional[int], and int | None on 3.10+


@functools.cache
def _origin_args(hint: Any) -> tuple[Any, tuple[Any, ...]]:
    return typing.get_origin(hint), typing.get_args(hint)


def _check_type(value: Any, hint: Any, key: str) -> Any:
    origin, args = _origin_args(hint)
    if origin in _UNIONS:
        if value is None and type(None) in args:
            return None
        kinds = [a for a in args if a is not type(None)]
        if any(type(value) is a for a in kinds if a in _SCALARS):  # int | str: "auto" or a number of steps
            return value
        return _check_type(value, kinds[0], key)
    if origin is list and isinstance(value, list):
        return [_check_type(v, args[0], f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict and isinstance(value, dict):
        return {str(k): _check_type(v, args[1], f"{key}.{k}") for k, v in value.items()}
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is Any or (hint in _SCALARS and type(value) is hint):
        return value
    want = getattr(hint, "__name__", str(hint))
    raise ValueError(f"{key}={value!r} is a {type(value).__name__}, but {key} takes {want}")


def to_run_config(cfg: Any) -> RunConfig:
    """DictConfig -> dataclasses, once, at the entry point, so every __post_init__ check runs."""
    from omegaconf import OmegaConf

    return build(RunConfig, OmegaConf.to_container(cfg, resolve=True))  # type: ignore[arg-type]


def load_frozen(run_dir: Path) -> RunConfig:
    """A (re)started job reads the config frozen at submit; it never recomposes, nor resolves again:
    config.yaml holds the values as resolved at submit, so a ${...} in it is text (a script's argument
    `${HOME}/x` after --), as for every other reader of the file (status, tracking: yaml.safe_load)."""
    from omegaconf import OmegaConf

    return build(RunConfig, OmegaConf.to_container(OmegaConf.load(run_dir / "config.yaml"), resolve=False))  # type: ignore[arg-type]


def explain(error: Exception) -> str:
    """Hydra/OmegaConf's message and its cause; for an unknown key, the valid keys beside it; for a
    misspelled key or group option, the nearest one."""
    from dataclasses import fields, is_dataclass

    lines = [line for line in str(error).splitlines() if not line.startswith("To append to your config")]
    cause = error.__cause__
    if cause is not None:
        lines.append(str(cause))
    missing = getattr(error, "missing_cfg_file", None) or ""  # Hydra's MissingConfigException: "cluster/devv"
    if getattr(error, "options", None) and "/" in missing:
        group, _, option = missing.rpartition("/")
        options = list(error.options)  # type: ignore[attr-defined]
        near = _nearest(option, options)
        # one sentence, not Hydra's options and search path one a line each
        named_in = re.match(r"In '([^']+)':", str(error))  # the config that asked for it, if not the primary
        where = f", asked for in {named_in.group(1)}.yaml" if named_in and named_in.group(1) != "config" else ""
        lines = [f"no {group} config named {option!r}{where}: there are {', '.join(options)} (conf/{group}/*.yaml)"]
        lines.append(f"did you mean {group.replace('/', '.')}={near}?" if near else "")
        if group == "cluster" and not near:
            lines.append(
                f"a cluster of your own: hpc-train init, then cp conf/cluster/example_site.yaml "
                f"conf/cluster/{option}.yaml and fill in its partition, account and nodes"
            )
    full_key = getattr(cause, "full_key", None) or ""
    if type(cause).__name__ in ("ConfigAttributeError", "ConfigKeyError") and full_key:
        node: Any = RunConfig
        *parents, _ = full_key.split(".")
        for part in parents:
            node = next((f.type for f in fields(node) if f.name == part), None)
            node = globals().get(node, node) if isinstance(node, str) else node
            if not is_dataclass(node):
                break
        if is_dataclass(node):
            where = ".".join(parents) or "the top level"
            names = [f.name for f in fields(node)]
            overridden = re.search(r"Could not override '([^']+)'", str(error))  # the whole key: trian.steps
            key = overridden.group(1) if overridden else full_key
            lines.append(f"valid keys under {where}: {', '.join(names)}{did_you_mean(key, len(parents), names)}")
    return "\n".join(line for line in lines if line)
