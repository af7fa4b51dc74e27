"""The built-in trainer, top to bottom: model, parallelize, resume, then the loop (step, evaluation, log,
stop check and save through the Attempt). `main` tells that in one screen; each part is a function above it.

    hpc-train submit                                # 2 ranks on this machine (local executor)
    hpc-train submit cluster=dev train.steps=200    # 2 nodes x 2 ranks on the test cluster
    hpc-train submit train.parallelism=fsdp train.tp=2 cluster.tasks_per_node=4   # FSDP2 x TP on a 2x2 mesh
    hpc-train submit profile.start_step=10 profile.active_steps=3   # a torch.profiler trace per rank, steps 10-12

`main(at)` is a client of the Attempt (attempt.py) exactly as a bring-your-own function is: job.py
calls it on every rank and decides what happens after it returns. Bit-exact on CPU: a run stopped and
resumed any number of times ends with the same weights as an uninterrupted one, because data, LR and
RNG are functions of the saved state.
"""

from __future__ import annotations

import hashlib
import logging
import math
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel as DDP

from hpc_train import data, journal, preempt, prometheus, straggler, tracking
from hpc_train.attempt import Attempt
from hpc_train.checkpoint import TrainState
from hpc_train.config import RunConfig, TrainConfig
from hpc_train.metrics import peak_tflops
from hpc_train.model import GPT
from hpc_train.paths import append_line
from hpc_train.ranklog import PROGRESS

progress = logging.getLogger(PROGRESS)  # the step line: rank 0's console row (ranklog.py)

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def lr_at(step: int, cfg: TrainConfig) -> float:
    """The learning rate of optimizer step `step` (0 = the first): linear warm-up to cfg.lr over
    warmup_steps, then cfg.lr_schedule. The decays head for min_lr_fraction x lr at step `steps`, one past
    the last, so the last step's lr is just above the floor (cosine's default kept from the first version)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    floor = cfg.min_lr_fraction
    if cfg.lr_schedule == "constant":
        return cfg.lr
    if cfg.lr_schedule == "wsd":  # stable at the peak, then linear over the last decay_fraction of the steps
        decay_start = max(cfg.warmup_steps, cfg.steps - round(cfg.decay_fraction * cfg.steps))
        if step < decay_start:
            return cfg.lr
        return cfg.lr * (1 - (1 - floor) * (step - decay_start) / max(1, cfg.steps - decay_start))
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    if cfg.lr_schedule == "linear":
        return cfg.lr * (floor + (1 - floor) * (1 - progress))
    return cfg.lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))  # cosine


def grad_accum_for(global_batch_seqs: int, dp_size: int, batch_seqs_per_rank: int) -> int:
    """Micro-batches per optimizer step that keep the run's global batch on dp_size data-parallel ranks
    (pure): 4 ranks x 8 seqs x 1 on 4 nodes -> 2 on 2 nodes (same 32 sequences per step). When it does not
    divide, the nearest count >= 1 (the caller says what the global batch becomes)."""
    return max(1, round(global_batch_seqs / (dp_size * batch_seqs_per_rank)))


def parallelize(model: GPT, tc: TrainConfig, mesh: DeviceMesh, bf16: bool = False) -> torch.nn.Module:
    """DDP; or FSDP2 over dp, each block's matmuls first split over tp (Megatron's layout: qkv and
    fc by columns, proj and fc_out by rows, so one all-reduce per attention and per MLP). Embeddings,
    norms and the tied head stay whole on every tp rank. Returns the module to call.
    bf16 under FSDP2: its MixedPrecisionPolicy, not autocast. FSDP2 then all-gathers bf16 (half the bytes
    of fp32) and computes in bf16, and reduce-scatters gradients in fp32 into the fp32 shards AdamW steps;
    under autocast it all-gathered fp32 and autocast kept a bf16 copy of each weight besides."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    if tc.tp > 1:
        plan = {
            "qkv": ColwiseParallel(),
            "proj": RowwiseParallel(),
            "fc": ColwiseParallel(),
            "fc_out": RowwiseParallel(),
        }
        for block in model.blocks:
            parallelize_module(block, mesh["tp"], plan)
    if tc.compile:  # each block in place, after TP and before FSDP (torchtitan's order); names stay, so do checkpoints
        for block in model.blocks:
            block.compile()
    if tc.parallelism == "ddp":
        return DDP(model)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    kw: dict[str, Any] = {"mesh": mesh["dp"], **({"mp_policy": mp} if mp else {})}
    for block in model.blocks:  # one all-gather per block in forward, freed after: peak = one block's params
        fully_shard(block, **kw)
    return fully_shard(model, **kw)


def param_groups(model: torch.nn.Module) -> list[dict[str, Any]]:
    """The parameters, one AdamW group per device mesh. FSDP2 x TP puts block matmuls on (dp, tp) and norms
    and embeddings on dp, and AdamW's foreach path (the default on CUDA, off on CPU) calls one _foreach op
    over a group's tensors: per mesh, each call sees one mesh whatever a torch version's DTensor does with
    several (issue 19 read it failing "cross-mesh"; torch 2.13 ran a mixed group with foreach=True on 4 CPU
    ranks, so this is a guard for the torch>=2.4 the package allows, not a fix measured here)."""
    from torch.distributed.tensor import DTensor

    groups: dict[object, list[torch.nn.Parameter]] = {}
    for p in model.parameters():
        groups.setdefault(p.device_mesh if isinstance(p, DTensor) else None, []).append(p)
    return [{"params": params} for params in groups.values()]


def clip_grad_norm(model: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """torch's clip_grad_norm_, for gradients that live on different meshes (FSDP2 x TP: block matmuls
    on (dp, tp), norms and embeddings on dp), which torch's one foreach call rejects. The norm of each
    mesh's group is reduced over its mesh, then combined. Returns that total norm, before clipping."""
    from torch.distributed.tensor import DTensor

    groups: dict[object, list[torch.nn.Parameter]] = {}
    for p in model.parameters():
        if p.grad is not None:
            groups.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    norms = []
    for params in groups.values():
        n = torch.nn.utils.get_total_norm([p.grad for p in params])
        norms.append(n.full_tensor() if isinstance(n, DTensor) else n)
    total = norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms))
    for params in groups.values():
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def peak_memory_mb(device: torch.device) -> float:
    """Peak allocated by tensors on a GPU; on CPU the process's peak resident set (tensors + Python)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def step_clock(device: torch.device) -> float:
    """time.monotonic() once the device's queued work is done: on a GPU the host only queues kernels, and
    a clock read without torch.cuda.synchronize() measures the queueing, not the step. The sync costs the
    next step's launch overlap (~tens of us per step against a 1B model's ~1 s)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.monotonic()


def global_mean(value: torch.Tensor) -> float:
    t = value.detach().to(torch.float64).reshape(1)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def model_flops_per_token(model: torch.nn.Module, cfg: RunConfig) -> float:
    """Training FLOPs per token: 6 per parameter (forward 2, backward 4) plus attention's
    12 x layers x d_model x seq_len (PaLM appendix B); embeddings' lookups are not matmuls."""
    n = sum(p.numel() for name, p in model.named_parameters() if not name.startswith("pos."))
    m = cfg.model
    return 6 * n + 12 * m.n_layers * m.d_model * m.seq_len


def peak_flops_per_device(configured_tflops: float) -> float | None:
    """Configured, else looked up by the GPU's exact name (metrics.PEAK_TFLOPS); None on CPU or for a GPU
    the table lacks (MFU is then "n/a", not invented)."""
    if configured_tflops > 0:
        return configured_tflops * 1e12
    if not torch.cuda.is_available():
        return None
    tflops = peak_tflops(torch.cuda.get_device_name())
    return None if tflops is None else tflops * 1e12


def mfu(flops_per_token: float, tokens_per_s_per_device: float, peak: float | None) -> float | None:
    return None if peak is None else flops_per_token * tokens_per_s_per_device / peak


@dataclass
class Parts:
    """What a step and an evaluation use: the model (parameters, evaluation, hashes), the module to call
    (DDP's or FSDP2's wrapper), its AdamW, and how this rank's batches reach them."""

    model: GPT
    net: torch.nn.Module
    optimizer: torch.optim.Optimizer
    device: torch.device
    bf16: bool
    autocast: bool  # bf16 by autocast (DDP); FSDP2 casts by its MixedPrecisionPolicy instead (parallelize)
    dp_rank: int  # a tp group reads one batch
    dp_size: int
    batch_seqs: int

    def batch(self, source: data.Sampler) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = source.next_batch(self.dp_rank, self.dp_size, self.batch_seqs)
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def loss(self, x: torch.Tensor, y: torch.Tensor, module: torch.nn.Module | None = None) -> torch.Tensor:
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            try:
                return (self.net if module is None else module)(x, y)
            except torch._dynamo.exc.BackendCompilerFailed as e:  # train.compile: a requeue would fail alike
                raise preempt.Unrecoverable(
                    f"train.compile=true: torch.compile failed on {socket.gethostname()}: "
                    f"{str(e).splitlines()[0]}; fix it there or set train.compile=false"
                ) from e


def build(at: Attempt) -> Parts:
    """The model on this rank's device, parallelized, and its AdamW; the same initial weights on every rank."""
    tc, on_gpu = at.cfg.train, at.device.type == "cuda"
    torch.manual_seed(tc.seed)  # same initial weights on every rank (DDP also broadcasts rank 0's)
    model = GPT(at.cfg.model).to(at.device)
    model.activation_checkpointing = on_gpu if tc.activation_checkpointing is None else tc.activation_checkpointing
    bf16 = on_gpu if tc.bf16 is None else tc.bf16
    net = parallelize(model, tc, at.mesh, bf16)
    optimizer = make_optimizer(model, tc)
    dp, autocast = at.mesh["dp"], bf16 and tc.parallelism == "ddp"
    return Parts(
        model, net, optimizer, at.device, bf16, autocast, dp.get_local_rank(), dp.size(), tc.batch_seqs_per_rank
    )


def make_optimizer(model: torch.nn.Module, tc: TrainConfig, foreach: bool | None = None) -> torch.optim.AdamW:
    """AdamW over param_groups (one per mesh); foreach=None: torch's choice (on for CUDA tensors)."""
    return torch.optim.AdamW(
        param_groups(model),
        lr=tc.lr,
        betas=(tc.adam_beta1, tc.adam_beta2),
        eps=tc.adam_eps,
        weight_decay=tc.weight_decay,
        foreach=foreach,
    )


def warn_batch_changed(at: Attempt, step: int, configured: int, global_seqs: int, dp: int, grad_accum: int) -> None:
    at.event(
        journal.BATCH_CHANGED,
        step,
        global_batch_seqs=global_seqs,
        configured=configured,
        dp=dp,
        grad_accum_steps=grad_accum,
    )
    at.say(
        f"warning: global batch {configured} sequences does not divide over dp={dp} x "
        f"{at.cfg.train.batch_seqs_per_rank}; this attempt steps {global_seqs} sequences ({grad_accum} micro-batches)"
    )


def check_data(at: Attempt, step: int, sampler: data.Sampler, change: str) -> None:
    """A resume on other data than its checkpoint was trained on (a shard appended, removed or resized)
    visits other windows from `step` on than the uninterrupted run would: stop with the sentence and both
    fixes, unless data.allow_changed or the last `hpc-train resume` was given --allow-data-changed; then
    record the change and train on. The held-out split is not compared: evaluation reads it from position 0
    with no gradients, so it moves val_loss, never the weights."""
    dc, run = at.cfg.data, at.paths.run_dir
    what = f"data.path={dc.path!r}" if dc.source == "tokens" else "data=synthetic's corpus"
    if not (dc.allow_changed or journal.data_change_allowed(journal.read(run))):
        raise preempt.Unrecoverable(
            f"{what} is not the data checkpoint step {step} was trained on ({change}): resumed on it, the "
            f"windows read from step {step} on would not be the uninterrupted run's. Restore that data and "
            f"hpc-train resume {run}, or train on with the data as it is now: hpc-train resume {run} "
            f"--allow-data-changed (data.allow_changed=true for its attempts)"
        )
    was, now = sampler.saved_fingerprint, sampler.fingerprint
    at.event(journal.DATA_CHANGED, step, change=change, was=list(was or ()), now=list(now))
    at.say(
        f"warning: {what} changed since checkpoint step {step} ({change}); from step {step} on "
        f"the run reads other windows than the uninterrupted run would (data.allow_changed)"
    )


def train_step(
    p: Parts,
    sampler: data.Sampler,
    lr: float,
    grad_accum: int,
    grad_clip: float,
    window: Window,
    beat: Callable[[], None],
) -> tuple[torch.Tensor, torch.Tensor, float, float]:
    """One optimizer step of grad_accum micro-batches. Returns this rank's loss of the step (every
    micro-batch's, not the last one's), the gradient norm before clipping, and the seconds in next_batch:
    wall and this thread's CPU (the straggler window counts those as data, not compute)."""
    for group in p.optimizer.param_groups:
        group["lr"] = lr
    p.optimizer.zero_grad(set_to_none=True)
    data_s, data_cpu_s, step_loss = 0.0, 0.0, torch.zeros((), device=p.device)
    for _micro in range(grad_accum):
        t_data, cpu_data = time.monotonic(), time.thread_time()
        x, y = p.batch(sampler)
        data_s += time.monotonic() - t_data
        data_cpu_s += time.thread_time() - cpu_data
        window.forward_begins()
        loss = p.loss(x, y)
        beat()  # past its forward: at a hang, a rank that stopped before here is the one to blame
        window.forward_ends()
        # DDP all-reduces (FSDP2 reduce-scatters) gradients in backward; sum micro-batches as a mean.
        (loss / grad_accum if grad_accum > 1 else loss).backward()
        step_loss += loss.detach() / grad_accum
    if window.slow_drill_s:
        straggler.busy(window.slow_drill_s)  # `hpc-train chaos RUN slow-rank`: real work, as a slow core
    grad_norm = clip_grad_norm(p.model, grad_clip)
    p.optimizer.step()
    return step_loss, grad_norm, data_s, data_cpu_s


def evaluate(at: Attempt, p: Parts, val: data.Sampler | None, batches: int) -> float | None:
    """The mean loss of the same `batches` held-out batches per data-parallel rank every time (the val
    sampler restarts at 0), so values compare across steps and resumes. No gradients, no RNG and the raw
    model (not DDP's wrapper): training's numbers do not change. None when a stop signal came during it:
    the stop save must not wait for the rest."""
    assert val is not None
    val.position, losses = 0, []
    p.model.eval()
    with torch.no_grad():
        for i in range(batches):
            # Every 8 batches, counted, not timed: every rank must enter the all-reduce together, and
            # clocks differ. 4 bytes per 8 forwards costs <0.1%; a stop waits at most 8 forwards.
            if i and i % 8 == 0 and at.should_stop():
                losses = []
                break
            losses.append(p.loss(*p.batch(val), module=p.model).double())
            at.pulse.beat()  # a long evaluation is not a hang (watchdog.py)
    p.model.train()
    # FSDP2 keeps the root's parameters gathered after a forward for the backward that follows; with no
    # backward a checkpoint's state_dict then fails ("storage that is not resizable"). torchtitan: reshard.
    for module in p.model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    return global_mean(torch.stack(losses).mean()) if losses else None


@dataclass
class Log:
    """A logged step's record on rank 0: the metrics.jsonl row (docs/metrics.md), the trackers
    (metrics.tensorboard/wandb/mlflow), Prometheus (metrics.prometheus_*) and the console line."""

    at: Attempt
    tokens_per_step: int
    flops_per_token: float
    peak_flops: float | None
    tracker: Any  # tracking.open's: a Tracker, or one that does nothing
    exporter: prometheus.Exporter | None

    @classmethod
    def open(cls, at: Attempt, model: torch.nn.Module, tokens_per_step: int) -> Log:
        m = at.cfg.metrics
        flops_per_token = model_flops_per_token(model, at.cfg)
        peak_flops = peak_flops_per_device(at.cfg.train.peak_tflops_per_device)
        tracker = tracking.open(m, at.paths.run_dir, at.env.rank, at.event)
        exporter = (
            prometheus.start(
                m.prometheus_addr,
                m.prometheus_port,
                m.prometheus_textfile,
                at.env.job_id,
                lambda: prometheus.run_text(at.paths.run_dir, at.env.job_id),
                at.event,
            )
            if at.env.rank == 0
            else None
        )
        return cls(at, tokens_per_step, flops_per_token, peak_flops, tracker, exporter)

    def step(
        self,
        step: int,
        loss: torch.Tensor,
        grad_norm: torch.Tensor,
        step_time_s: float,
        eval_s: float,
        data_s: float,
        val_loss: float | None,
    ) -> None:
        """Collective (the loss is averaged over every rank); rank 0 writes."""
        mean_loss, at, steps = global_mean(loss), self.at, self.at.cfg.train.steps
        memory = at.memory.figures() if at.memory and not at.memory.off else {}  # this rank's, since the last row
        if at.env.rank != 0:
            return
        tokens_per_s = self.tokens_per_step / step_time_s
        row = {
            "time": time.time(),
            "step": step,
            "loss": mean_loss,
            "lr": lr_at(step - 1, at.cfg.train),
            "grad_norm": grad_norm.item(),
            "step_time_s": step_time_s,
            "eval_s": eval_s,  # a stop signal may wait for it: metrics.lead_warning counts it
            "data_wait_fraction": data_s / step_time_s,
            "tokens_per_s": tokens_per_s,
            "tokens_per_s_per_rank": tokens_per_s / at.env.world_size,
            "peak_memory_mb": peak_memory_mb(at.device),
            "mfu": mfu(self.flops_per_token, tokens_per_s / at.env.world_size, self.peak_flops),
            **({} if val_loss is None else {"val_loss": val_loss}),
            **memory,
        }
        append_line(at.paths.metrics, row)
        self.tracker.log(step, row)
        if self.exporter:
            self.exporter.tick()
        mfu_text = "n/a" if row["mfu"] is None else f"{row['mfu']:.1%}"
        val_text = "" if val_loss is None else f"  val {val_loss:.4f}"
        # 100 columns at most for runs under 10^5 steps (issue 29); the data wait and memory are in metrics.jsonl
        progress.info(
            f"step {step}/{steps}  loss {mean_loss:.4f}{val_text}  lr {row['lr']:.2e}  gnorm {row['grad_norm']:.3f}  "
            f"{step_time_s * 1e3:.1f} ms/step  {tokens_per_s:,.0f} tok/s  mfu {mfu_text}"
        )

    def close(self, finished: bool = False) -> None:
        self.tracker.close(finished=finished)  # the requeue leaves by os._exit: W&B writes its offline run only here
        if self.exporter:
            self.exporter.close()


@dataclass
class Window:
    """Stragglers (straggler.py): this rank's own seconds (compute, data, wall) summed over
    straggler.every_steps steps, then judged with every other rank's (name_stragglers); every_steps=0: off.
    GPU: compute = the forwards' kernel time (CUDA events; thread time would miss kernels). The slow-rank
    drill's busy loop is host work, invisible there: the drill is a CPU drill. Not run on a GPU yet."""

    at: Attempt
    judge: straggler.Judge = field(default_factory=straggler.Judge)
    forwards: list[tuple[torch.cuda.Event, torch.cuda.Event]] = field(default_factory=list)  # GPU only

    def __post_init__(self) -> None:
        self.cfg = self.at.cfg.straggler
        self.timed = self.at.device.type == "cuda" and self.cfg.every_steps > 0
        self.restart()

    def restart(self) -> None:
        self.sums, self.steps = [0.0, 0.0, 0.0], 0
        # `hpc-train chaos RUN slow-rank`: read at the attempt's start and after each window, not every step
        self.slow_drill_s = preempt.drill_seconds(self.at.paths.drills, f"slow_rank_{self.at.env.rank}")

    def forward_begins(self) -> None:
        if self.timed:
            self.forwards.append((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)))
            self.forwards[-1][0].record()

    def forward_ends(self) -> None:
        if self.timed:
            self.forwards[-1][1].record()

    def add(self, compute_s: float, data_s: float, wall_s: float) -> None:
        if self.cfg.every_steps:
            self.sums = [self.sums[0] + compute_s, self.sums[1] + data_s, self.sums[2] + wall_s]
            self.steps += 1

    def end_if_due(self, step: int) -> None:
        """Collective when due: at the same step on every rank."""
        if not (self.cfg.every_steps and step % self.cfg.every_steps == 0):
            return
        if self.forwards:  # GPU: the window's forwards, read once (one synchronize per window)
            self.forwards[-1][1].synchronize()
            self.sums[0] = sum(a.elapsed_time(b) for a, b in self.forwards) / 1e3
            self.forwards.clear()
        name_stragglers(self.at, self.sums, self.steps, self.judge, self.cfg, step)
        self.restart()


def name_stragglers(
    at: Attempt, sums: list[float], steps: int, judge: straggler.Judge, cfg: straggler.StragglerConfig, step: int
) -> None:
    """Collective, once per window: every rank's (compute, data, wall) seconds per step, in one all_gather
    of 3 floats; rank 0 judges (straggler.py) and names or clears ranks in events.jsonl and on its console."""
    mine = torch.tensor([s / steps for s in sums], dtype=torch.float64, device=at.device)
    every = [torch.zeros_like(mine) for _ in range(at.env.world_size)]
    dist.all_gather(every, mine)
    if at.env.rank != 0:
        return
    times = [t.tolist() for t in every]
    named, cleared, medians = straggler.judge(judge, [c + d for c, d, _ in times], cfg)
    for rank in named + cleared:
        (compute_s, data_s, wall_s), node = times[rank], at.env.nodes[rank // at.env.local_world_size]
        median = medians[rank]  # of the other ranks' own times
        fields = {
            "rank": rank,
            "node": node,
            "own_s": round(compute_s + data_s, 6),
            "median_own_s": round(median, 6),
            "compute_s": round(compute_s, 6),
            "data_s": round(data_s, 6),
            "comm_s": round(max(0.0, wall_s - compute_s - data_s), 6),
            "wall_s": round(wall_s, 6),
        }
        if rank in named:
            at.event(
                journal.STRAGGLER, step, **fields, windows=cfg.windows, every_steps=cfg.every_steps, factor=cfg.factor
            )
            at.say(
                f"straggler: rank {rank} on {node}: {(compute_s + data_s) * 1e3:.1f} ms/step of its own "
                f"(compute {compute_s * 1e3:.1f}, data {data_s * 1e3:.1f}) "
                f"vs the other ranks' median {median * 1e3:.1f} "
                f"ms, {cfg.windows} windows of {cfg.every_steps} steps in a row; the others wait for it in collectives"
            )
        else:
            at.event(journal.STRAGGLER_CLEARED, step, **fields)
            at.say(
                f"straggler cleared: rank {rank} on {node}: {(compute_s + data_s) * 1e3:.1f} ms/step "
                f"vs the others' median {median * 1e3:.1f} ms"
            )


def params_sha256(model: torch.nn.Module) -> str:
    """Hash of every parameter's bytes, in name order: equal hashes mean bit-identical weights.
    Collective under FSDP2 (full_tensor gathers each shard)."""
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        full = p.full_tensor() if hasattr(p, "full_tensor") else p  # FSDP2 shards: a collective, every rank calls
        h.update(name.encode())
        h.update(full.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def main(at: Attempt) -> dict[str, Any] | None:
    cfg, tc = at.cfg, at.cfg.train
    p = build(at)  # the model, parallelized, its AdamW: the same initial weights on every rank
    sampler = data.open_sampler(cfg.data, cfg.model.seq_len, cfg.model.vocab_size)
    val = data.open_sampler(cfg.data, cfg.model.seq_len, cfg.model.vocab_size, "val") if tc.eval_every_steps else None
    state = TrainState(p.model, p.optimizer, data=sampler)
    # The global batch is the full size's, cluster.nodes x tasks_per_node / tp ranks x batch_seqs_per_rank x
    # grad_accum_steps sequences; an attempt on fewer nodes (cluster.min_nodes) accumulates more micro-batches.
    global_seqs = cfg.cluster.nodes * cfg.cluster.tasks_per_node // tc.tp * tc.batch_seqs_per_rank * tc.grad_accum_steps
    grad_accum = grad_accum_for(global_seqs, p.dp_size, tc.batch_seqs_per_rank)
    batch = {"grad_accum_steps": grad_accum, "global_batch_seqs": p.dp_size * tc.batch_seqs_per_rank * grad_accum}

    # Resume: the newest checkpoint that verifies (model, optimizer, step, tokens, data position, RNG).
    at.resume(state, **batch)  # a DDP takes a throwaway forward and backward first: its rebuilt buckets
    # The data is not the checkpoint's on some rank (each node may read its own copy): every rank stops with
    # the sentence, or trains on if allowed; never some ranks alone.
    changes: list[Any] = [None] * at.env.world_size
    dist.all_gather_object(changes, sampler.changed())
    change = next((c if r == 0 else f"{c}, on rank {r}" for r, c in enumerate(changes) if c), "")
    if change:
        check_data(at, state.step, sampler, change)
    if batch["global_batch_seqs"] != global_seqs:
        warn_batch_changed(at, state.step, global_seqs, batch["global_batch_seqs"], p.dp_size, grad_accum)
    at.say(
        f"job {at.env.job_id} attempt {at.env.restart_count}: {at.env.world_size} ranks on "
        f"{at.env.num_nodes} node(s), mesh dp={p.dp_size} x tp={tc.tp}, {tc.parallelism}, {at.device.type}"
        f"{' bf16' if p.bf16 else ''}, starting at step {state.step}/{tc.steps}"
    )
    tokens_per_step = batch["global_batch_seqs"] * cfg.model.seq_len
    hang_drill = preempt.injected("hang") and at.env.rank == at.env.world_size - 1  # read once, not every step
    first_step, step_loss, val_loss = state.step, torch.tensor(float("nan")), None
    log, window = Log.open(at, p.model, tokens_per_step), Window(at)

    # Go!
    while state.step < tc.steps:
        t0, cpu0 = time.monotonic(), time.thread_time()
        if hang_drill and state.step == first_step + 3:
            time.sleep(10**9)  # a drill: the last rank stops, the others block in the next collective
        step_loss, grad_norm, data_s, data_cpu_s = train_step(
            p, sampler, lr_at(state.step, tc), grad_accum, tc.grad_clip, window, at.pulse.beat
        )
        state.step += 1
        state.tokens_seen += tokens_per_step
        # This rank's own seconds: before min_step_time_s's sleep, which is nobody's work.
        window.add(time.thread_time() - cpu0 - data_cpu_s, data_s, time.monotonic() - t0)
        if tc.min_step_time_s > 0:
            time.sleep(max(0.0, tc.min_step_time_s - (time.monotonic() - t0)))
        step_time_s = step_clock(p.device) - t0

        # Evaluation, then the stop check right after it: a stop signal that came during a long evaluation
        # is acted on now. One caught during the step skips the evaluation: the stop save comes first.
        val_loss, t_eval = None, time.monotonic()
        if tc.eval_every_steps and (state.step % tc.eval_every_steps == 0 or state.step == tc.steps):
            val_loss = None if at.should_stop() else evaluate(at, p, val, tc.eval_batches)
        eval_s = time.monotonic() - t_eval
        # Logged before the stop check, so the line of the step an attempt stops at (its val_loss) is kept.
        if state.step % tc.log_every_steps == 0 or val_loss is not None:
            log.step(state.step, step_loss, grad_norm, step_time_s, eval_s, data_s, val_loss)
        window.end_if_due(state.step)
        if at.step_end(state, tc.steps):  # every rank agreed to stop: saved (if it fit); the job requeues
            log.close()
            return None

    evaluated = {"val_loss": val_loss} if tc.eval_every_steps else {}  # the last step's, None if a signal skipped it
    log.tracker.close(finished=True)  # explicit, not only atexit: the MLflow run is FINISHED before summary.json exists
    summary = at.finish(state, final_loss=global_mean(step_loss), params_sha256=params_sha256(p.model), **evaluated)
    log.close()  # Prometheus after the finish event: the endpoint answers until the run's last word
    return summary
