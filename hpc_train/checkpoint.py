"""Sharded checkpoints with torch DCP; a checkpoint exists only once its commit marker does.

Layout of one checkpoint (one folder per step):
    checkpoints/step_000040/
        .metadata, __0_0.distcp, ...   DCP: model + optimizer, readable by torch's own tools
        rank_00000.pt ...              per-rank extras (RNG states), torch.save of plain tensors
        COMMITTED                      JSON manifest: step, sizes and sha256 of every file; written last

Write order: every rank writes and fsyncs its files (periodic saves in a background thread) -> all
ranks agree every write is done -> barrier -> rank 0 hashes the files, writes the manifest to
COMMITTED.tmp, fsyncs it and os.replace()s it to COMMITTED -> barrier. A job killed at any point
before the replace leaves a folder without COMMITTED, which resume ignores.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from hpc_train.config import CheckpointConfig
from hpc_train.preempt import injected

MARKER = "COMMITTED"


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:06d}"


def step_of(folder: Path) -> int:
    """The step a step_dir() folder holds."""
    return int(folder.name.split("_")[1])


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path, advance: Callable[[int], Any] = lambda n: None) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
            advance(len(block))
    return h.hexdigest()


def _manifest(folder: Path) -> dict[str, dict[str, Any]]:
    return {p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p)}
            for p in sorted(folder.iterdir()) if p.is_file() and not p.name.startswith(MARKER)}


@dataclass
class Pending:
    """A save whose files are (being) written; it counts once commit() has written its marker."""
    folder: Path
    step: int
    reason: str  # "periodic" | "stop" | "final"
    future: Any  # DCP's background write, or None when the write was synchronous
    started: float
    stall_s: float  # how long the training loop was blocked by start_save


def background_writer() -> tuple[Any, Any]:
    """Collective, once per run: what start_save needs to write in the background. A gloo group kept
    apart from training's collectives (the writer's run in another thread), and a stager that copies
    the state into the same host buffers every time: allocating them afresh made the loop's stall
    0.115x of a synchronous save instead of <0.1x (1.6 GB state, benchmarks/checkpoint_bench.py)."""
    return dist.new_group(backend="gloo"), _ReusedHostBuffers()


class _ReusedHostBuffers:
    """DCP's AsyncStager protocol: copy into buffers allocated on the first save and reused after.
    (torch's BlockingAsyncStager caches too, but pins memory, which fails on CPU-only machines.)"""

    should_synchronize_after_execute = False

    def __init__(self) -> None:
        self.buffers: Any = None

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

        if self.buffers is None:
            self.buffers = _create_cpu_state_dict(state_dict, pin_memory=torch.cuda.is_available())
        return _copy_state_dict(state_dict, self.buffers)

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


@contextmanager
def _helper_threads_single_threaded() -> Iterator[None]:
    """DCP's collectives run torch ops on gloo's worker threads. A thread's first parallel op gives it
    an OpenMP team of torch.get_num_threads() threads, kept for its life; once libgomp manages more
    threads than the job has CPUs it stops spinning between parallel regions, and every later step
    pays futex wake-ups: on 2 CPUs, AdamW's step went 9 -> 24 ms and the whole step 1.3x slower after
    the first save. Threads that first run a parallel op inside this block get 1 thread instead."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)  # the main thread's own pool again


def start_save(root: Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
               extra: dict[str, Any], reason: str, background: tuple[Any, Any] | None = None) -> Pending:
    """Collective. Writes this rank's extras, then the DCP state: now, or, with `background` (from
    background_writer()), in a background thread after copying it to host memory; the loop is blocked
    only for that copy."""
    t0 = time.monotonic()
    folder = step_dir(root, step)
    rank = dist.get_rank()
    if rank == 0 and folder.exists():  # a torn save of this same step from a killed attempt
        shutil.rmtree(folder)
    dist.barrier()
    folder.mkdir(parents=True, exist_ok=True)
    rank_file = folder / f"rank_{rank:05d}.pt"
    torch.save(extra, rank_file)
    _fsync(rank_file)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    future = None
    if background is None:
        with _helper_threads_single_threaded():
            dcp.save(state, checkpoint_id=folder)  # fsyncs its files
    else:
        group, stager = background
        future = dcp.async_save(state, checkpoint_id=folder, process_group=group, async_stager=stager)
    if injected("kill_rank_during_save") and rank == dist.get_world_size() - 1 and committed(root):
        # A drill: the last rank dies mid-save once a committed checkpoint exists to fall back to.
        os.kill(os.getpid(), signal.SIGKILL)
    return Pending(folder, step, reason, future, t0, time.monotonic() - t0)


def written_everywhere(pending: Pending) -> bool:
    """Collective: True once every rank's background write has finished (one 4-byte all-reduce)."""
    flag = torch.tensor([1 if pending.future is None or pending.future.done() else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def commit(pending: Pending, root: Path, cfg: CheckpointConfig) -> float:
    """Collective. Waits for this rank's write, then rank 0 writes the marker after every rank is done.
    Returns seconds from start_save to commit."""
    if pending.future is not None:
        pending.future.result()  # raises if the background write failed: no marker, nothing counts
    dist.barrier()
    if dist.get_rank() == 0:
        marker = {"step": pending.step, "reason": pending.reason, "world_size": dist.get_world_size(),
                  "files": _manifest(pending.folder)}
        tmp = pending.folder / f"{MARKER}.tmp"
        tmp.write_text(json.dumps(marker, indent=1))
        _fsync(tmp)
        os.replace(tmp, pending.folder / MARKER)
        _fsync(pending.folder)
        apply_retention(root, cfg)
    dist.barrier()
    return time.monotonic() - pending.started


def committed(root: Path) -> list[Path]:
    """Committed checkpoint folders, oldest first."""
    if not root.exists():
        return []
    return sorted(p for p in root.glob("step_*") if (p / MARKER).exists())


def apply_retention(root: Path, cfg: CheckpointConfig) -> None:
    """Keep the newest checkpoint, the last `keep_last` periodic ones and every `keep_every_steps`-th.

    A stop save is kept only while it is the newest: repeated preemptions replace it rather than pile
    up. Torn folders (no marker) older than the newest commit are removed too; a newer one may be a
    save in progress."""
    done = committed(root)
    if not done:
        return
    newest = done[-1]
    reasons = {p: json.loads((p / MARKER).read_text()).get("reason", "periodic") for p in done}
    periodic = [p for p in done if reasons[p] != "stop"]
    keep = {newest, *periodic[-cfg.keep_last:]}
    if cfg.keep_every_steps:
        keep |= {p for p in periodic if step_of(p) % cfg.keep_every_steps == 0}
    for p in sorted(root.glob("step_*")):
        if p not in keep and p < newest:
            shutil.rmtree(p, ignore_errors=True)


def verify(folder: Path, advance: Callable[[int], Any] = lambda n: None) -> str:
    """"" if every file matches the manifest, else the first reason it does not."""
    try:
        marker = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError) as e:
        return f"unreadable {MARKER}: {e}"
    for name, want in marker["files"].items():
        p = folder / name
        if not p.exists():
            return f"{name} is missing"
        if p.stat().st_size != want["bytes"]:
            return f"{name} has {p.stat().st_size} bytes, manifest says {want['bytes']}"
        if _sha256(p, advance) != want["sha256"]:
            return f"{name} checksum differs from the manifest"
    return ""


def pick_resume(root: Path, show_progress: bool = False) -> tuple[Path | None, list[str]]:
    """Newest committed checkpoint that verifies; also why newer ones were skipped. With show_progress,
    a rich progress bar over the bytes hashed (minutes for a large checkpoint) goes to stdout."""
    from rich.progress import Progress

    skipped = []
    with Progress(disable=not show_progress or not committed(root)) as progress:  # no bar, no blank line
        for folder in reversed(committed(root)):
            try:
                total = sum(f["bytes"] for f in json.loads((folder / MARKER).read_text())["files"].values())
            except (OSError, ValueError, KeyError):
                total = None
            task = progress.add_task(f"verifying {folder.name}", total=total)
            why = verify(folder, lambda n: progress.advance(task, n))
            if not why:
                return folder, skipped
            skipped.append(f"{folder.name}: {why}")
    return None, skipped


def load(folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Collective. Loads model and optimizer in place; returns this rank's extras."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    with _helper_threads_single_threaded():
        dcp.load(state, checkpoint_id=folder)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    rank_file = folder / f"rank_{dist.get_rank():05d}.pt"
    if not rank_file.exists():
        raise RuntimeError(f"{rank_file} is missing: the checkpoint was written by a different world size "
                           f"({json.loads((folder / MARKER).read_text())['world_size']} ranks); resume with "
                           f"that many ranks")
    return torch.load(rank_file, weights_only=True)  # no pickle code runs on load


def resume(root: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
           on_skip: Callable[[str], Any] = lambda why: None) -> tuple[Path | None, dict[str, Any]]:
    """Collective. Rank 0 picks the newest checkpoint that verifies (reporting each newer one it skips),
    every rank loads that one. Returns (its folder, this rank's extras), or (None, {}) on a fresh run."""
    chosen = torch.tensor([-1])
    if dist.get_rank() == 0:
        folder, skipped = pick_resume(root, show_progress=True)
        for why in skipped:
            on_skip(why)
        chosen[0] = step_of(folder) if folder else -1
    dist.broadcast(chosen, src=0)
    if chosen < 0:
        return None, {}
    folder = step_dir(root, int(chosen))
    return folder, load(folder, model, optimizer)
