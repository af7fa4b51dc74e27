"""The training loop, top to bottom: resume, step, stop check, save, log.

    hpc-train submit                                # 2 ranks on this machine (local executor)
    hpc-train submit cluster=dev train.steps=200    # 2 nodes x 2 ranks on the test cluster

Called by job.py on every rank once torch.distributed is up. Returns ("finished" | "requeue", step);
the caller exits accordingly. Bit-exact on CPU: a run stopped and resumed any number of times ends with the
same weights as an uninterrupted one, because data, LR and RNG are functions of the saved state.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from hpc_train import checkpoint, data, preempt
from hpc_train.config import RunConfig, TrainConfig
from hpc_train.env import RankEnv
from hpc_train.metrics import METRICS, append_jsonl, log_event
from hpc_train.model import GPT


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to 10% of the peak at the last step."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


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


# Dense bf16 peak per device, TFLOP/s (vendor datasheets, no sparsity).
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0, "V100": 125.0}


def peak_flops_per_device(configured_tflops: float) -> float | None:
    """Configured, else looked up by the GPU's name; None on CPU (MFU is then "n/a", not invented)."""
    if configured_tflops > 0:
        return configured_tflops * 1e12
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((tf * 1e12 for key, tf in PEAK_TFLOPS.items() if key in name), None)


def mfu(flops_per_token: float, tokens_per_s_per_device: float, peak: float | None) -> float | None:
    return None if peak is None else flops_per_token * tokens_per_s_per_device / peak


def params_sha256(model: torch.nn.Module) -> str:
    """Hash of every parameter's bytes, in name order: equal hashes mean bit-identical weights.
    Collective under FSDP2 (full_tensor gathers each shard)."""
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        full = p.full_tensor() if hasattr(p, "full_tensor") else p  # FSDP2 shards: a collective, every rank calls
        h.update(name.encode())
        h.update(full.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def train(cfg: RunConfig, env: RankEnv, run_dir: Path, launched_at: float) -> tuple[str, int]:
    tc = cfg.train
    torch.manual_seed(tc.seed)  # same initial weights on every rank (DDP also broadcasts rank 0's)
    model = GPT(cfg.model)
    if tc.parallelism == "fsdp":  # FSDP2: each block's parameters, grads and AdamW state sharded over ranks
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (env.world_size,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        net = fully_shard(model, mesh=mesh)
    else:
        net = DDP(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=tc.lr, betas=(0.9, 0.95), weight_decay=tc.weight_decay)
    corpus = data.synthetic_corpus(cfg.data, cfg.model.vocab_size)
    ck, ckpt_root = cfg.checkpoint, run_dir / "checkpoints"
    background = checkpoint.background_writer() if ck.async_save else None
    pending: checkpoint.Pending | None = None
    say = print if env.rank == 0 else (lambda *a, **k: None)

    def event(name: str, step: int, **fields: object) -> None:
        if env.rank == 0:
            log_event(run_dir, name, step, env.job_id, env.restart_count, **fields)

    slowest_save_s = [0.0]  # this attempt's; background saves count whole, so it errs long

    def commit(p: checkpoint.Pending) -> None:
        save_s = checkpoint.commit(p, ckpt_root, ck)
        slowest_save_s[0] = max(slowest_save_s[0], save_s)
        event("checkpoint_committed", p.step, path=str(p.folder), reason=p.reason, save_s=round(save_s, 4),
              stall_s=round(p.stall_s, 4))

    # Resume: rank 0 picks the newest checkpoint that verifies, and every rank loads that one.
    step, last_loss = 0, float("nan")
    resume_step = torch.tensor([-1])
    if env.rank == 0:
        folder, skipped = checkpoint.pick_resume(ckpt_root, show_progress=True)
        for why in skipped:
            event("checkpoint_skipped", 0, reason=why)
        resume_step[0] = int(folder.name.split("_")[1]) if folder else -1
    dist.broadcast(resume_step, src=0)
    folder = checkpoint.step_dir(ckpt_root, int(resume_step)) if resume_step >= 0 else None
    if folder is not None:
        extra = checkpoint.load(folder, model, optimizer)
        step, last_loss = int(extra["step"]), float(extra["loss"])
        torch.set_rng_state(extra["rng"])
        if tc.parallelism == "ddp":
            # DDP re-buckets gradients by their ready order after its first backward, and the bucket layout
            # sets the summation order of gloo's ring all-reduce. The uninterrupted run took this step with
            # re-bucketed gradients, so take one throwaway backward first; without it 4 ranks ended 2e-8 apart.
            net(*data.batch(corpus, step, env.rank, env.world_size, tc.batch_seqs_per_rank, cfg.model.seq_len)).backward()
            optimizer.zero_grad(set_to_none=True)
    pids = [torch.zeros(1, dtype=torch.int64) for _ in range(env.world_size)]
    dist.all_gather(pids, torch.tensor([os.getpid()]))  # for `hpc-train chaos kill-rank` and post-mortems
    event("start", step, resumed_from=str(folder) if folder else None, world_size=env.world_size,
          nodes=list(env.nodes), launched_at=launched_at, pids=[int(p) for p in pids],
          rank_nodes=[env.nodes[r // env.local_world_size] for r in range(env.world_size)])  # placed: node-contiguous
    first_step = step
    say(f"[hpc_train] job {env.job_id} attempt {env.restart_count}: {env.world_size} ranks on "
        f"{env.num_nodes} node(s), starting at step {step}/{tc.steps}", flush=True)

    flops_per_token = model_flops_per_token(model, cfg)
    peak_flops = peak_flops_per_device(tc.peak_tflops_per_device)

    hang_drill = preempt.injected("hang") and env.rank == env.world_size - 1  # read once, not every step

    # Go!
    while step < tc.steps:
        t0 = time.monotonic()
        preempt.beat()  # the hang watchdog (job.py) restarts its clock
        if hang_drill and step == first_step + 3:
            time.sleep(10**9)  # a drill: the last rank stops, the others block in the next collective
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, tc)
        optimizer.zero_grad(set_to_none=True)
        data_s = 0.0
        for micro in range(tc.grad_accum_steps):
            t_data = time.monotonic()
            x, y = data.batch(corpus, step * tc.grad_accum_steps + micro, env.rank, env.world_size,
                              tc.batch_seqs_per_rank, cfg.model.seq_len)
            data_s += time.monotonic() - t_data
            loss = net(x, y)
            # DDP all-reduces (FSDP2 reduce-scatters) gradients in backward; sum micro-batches as a mean.
            (loss / tc.grad_accum_steps if tc.grad_accum_steps > 1 else loss).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
        optimizer.step()
        step += 1
        if tc.min_step_time_s > 0:
            time.sleep(max(0.0, tc.min_step_time_s - (time.monotonic() - t0)))
        step_time_s = time.monotonic() - t0
        if step == first_step + 1:  # start -> first step is the restart overhead a report counts
            event("first_step", step, step_time_s=round(step_time_s, 4))

        stop = preempt.should_stop()  # every rank gets the same answer
        if stop:
            event("signal", step, signals=list(preempt.received))
        if pending and (stop or checkpoint.written_everywhere(pending)):
            commit(pending)  # a stop waits for the background write: one save at a time
            pending = None
        if stop and not preempt.save_fits(slowest_save_s[0], cfg.cluster.signal_lead_s, cfg.cluster.preempt_grace_s):
            # SIGKILL would land mid-save: leave the last committed checkpoint as it is and go.
            event("stop_save_skipped", step, expected_save_s=round(slowest_save_s[0], 3))
            return "requeue", step
        final = step == tc.steps
        if stop or final or step % ck.every_steps == 0:
            last_loss = global_mean(loss)
            tokens_seen = step * tc.grad_accum_steps * tc.batch_seqs_per_rank * cfg.model.seq_len * env.world_size
            extra = {"step": torch.tensor(step), "tokens_seen": torch.tensor(tokens_seen),
                     "loss": torch.tensor(last_loss, dtype=torch.float64), "rng": torch.get_rng_state()}
            in_background = background is not None and not (stop or final)
            pending = checkpoint.start_save(ckpt_root, step, model, optimizer, extra,
                                            "stop" if stop else "final" if final else "periodic",
                                            background if in_background else None)
            if not in_background:
                commit(pending)
                pending = None
        if stop:
            return "requeue", step
        if step % tc.log_every_steps == 0:
            last_loss = global_mean(loss)
            if env.rank == 0:
                tokens = env.world_size * tc.batch_seqs_per_rank * tc.grad_accum_steps * cfg.model.seq_len
                tokens_per_s = tokens / step_time_s
                append_jsonl(run_dir / METRICS, {
                    "time": time.time(), "step": step, "loss": last_loss, "lr": lr_at(step - 1, tc),
                    "step_time_s": step_time_s, "data_wait_fraction": data_s / step_time_s,
                    "tokens_per_s": tokens_per_s, "tokens_per_s_per_rank": tokens_per_s / env.world_size,
                    "mfu": mfu(flops_per_token, tokens_per_s / env.world_size, peak_flops)})
            say(f"step {step:6d}  loss {last_loss:.4f}  {step_time_s * 1e3:.1f} ms/step", flush=True)

    summary = {"final_step": step, "final_loss": last_loss, "params_sha256": params_sha256(model)}
    if env.rank == 0:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    event("finish", step, **summary)
    say(f"[hpc_train] finished: {json.dumps(summary)}", flush=True)
    return "finished", step
