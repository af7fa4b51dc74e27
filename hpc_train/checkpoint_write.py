"""Writing a checkpoint: the state copied into reused host buffers (HostBuffers), DCP's files written by one
background thread (Writer), one save in flight (Pending) from start_save to its commit: every rank's files hashed
and gathered, rank 0's manifest written last, fsynced (paths.MARKER). checkpoint.py's Saver owns when.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

from hpc_train import __version__
from hpc_train.checkpoint_files import _fed_while_bytes_move, _fsync, _no_watchdog, manifest_of, own_files, rank_file
from hpc_train.paths import (
    FORMAT,
    MARKER,
    dir_mode,
    make_dir,
    step_dir,
    write_atomic,
)
from hpc_train.preempt import claim_drill, drill_seconds, injected

# ---- writing ------------------------------------------------------------------------------------------


def _layout(obj: Any) -> Any:
    """What host buffers made for `obj` fit (compared with ==): each container's keys or length and each
    tensor's type, dtype, shape and device (a DTensor's local shape, placements and mesh too), walked as
    torch's _create_cpu_state_dict walks it. Other leaves (int, float, str ...) count by type only: torch's
    _copy_state_dict takes their values from each save."""
    if isinstance(obj, DTensor):
        return (DTensor, obj.dtype, obj.shape, obj._local_tensor.shape, obj.placements, obj.device_mesh)
    if isinstance(obj, torch.Tensor):
        return (type(obj), obj.dtype, obj.shape, obj.device)
    if isinstance(obj, dict):
        return {k: _layout(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_layout(v) for v in obj]
    return type(obj)


class HostBuffers:
    """DCP's AsyncStager protocol: copy into host buffers reused from save to save, made again whenever
    the state's layout (_layout) differs from the one they were made for. torch's _copy_state_dict copies
    into whatever it is given: a tensor that shrank to 1 element was broadcast into the old size, one of
    another dtype cast to the old one, and the wrong values committed and verified. (torch's
    BlockingAsyncStager caches too, but pins memory, which fails on CPU-only machines.) Safe because at
    most one background save is in flight (Saver.periodic waits for the previous; MemoryTier.save too)."""

    should_synchronize_after_execute = False

    def __init__(self) -> None:
        self.buffers: Any = None
        self.layout: Any = None

    def stage(self, state_dict: dict[str, Any], non_blocking: bool = False) -> dict[str, Any]:
        """The copy in host memory. non_blocking (memory_tier.py, GPU): the device-to-host copies are only queued
        on the current stream; the caller waits for them (a CUDA event) before reading the buffers."""
        from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

        layout = _layout(state_dict)  # ~2.5 us a tensor, compare included: 20 ms for 8000, beside GBs copied
        if self.buffers is None or layout != self.layout:
            self.buffers = None  # the old ones go before the new ones are made: one state's worth of host memory
            self.buffers = _create_cpu_state_dict(state_dict, pin_memory=torch.cuda.is_available())
            self.layout = layout
        return _copy_state_dict(state_dict, self.buffers, non_blocking=non_blocking)

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


@dataclass
class Writer:
    """What background saves need, made once per attempt (collective): a gloo group kept apart from
    training's collectives, since the write runs in another thread; host buffers reused from save to
    save (allocating them afresh made the loop's stall 0.115x of a synchronous save instead of 0.04x,
    1.6 GB state, benchmarks/checkpoint_bench.py); one thread that waits for DCP's write and hashes it."""

    group: Any = field(default_factory=lambda: dist.new_group(backend="gloo"))
    stager: HostBuffers = field(default_factory=HostBuffers)
    pool: concurrent.futures.ThreadPoolExecutor = field(
        default_factory=lambda: concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hpc_train-ckpt")
    )


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


@dataclass
class Pending:
    """A save whose files are (being) written; it counts once commit() has written its marker."""

    folder: Path
    step: int
    reason: str  # "periodic" | "stop" | "final"
    future: concurrent.futures.Future  # -> (this rank's manifest entries, seconds its write took)
    started: float
    stall_s: float  # how long the training loop was blocked by start_save
    share_with_group: bool = False  # the folder becomes 0750 once committed
    alive: Callable[[], None] = _no_watchdog  # fed while commit waits for the write

    def done(self) -> bool:
        return self.future.done()


def _trickle(seconds: float, path: Path) -> None:
    """The slow_storage drill: this rank's save takes `seconds` longer, as on storage that slow, moving a
    few bytes every 0.2 s (re-reading its rank file) rather than none, as a stuck write would."""
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        with open(path, "rb") as f:
            f.read(4096)
        time.sleep(min(0.2, max(0.0, until - time.monotonic())))


def start_save(
    root: Path,
    state: Any,  # a checkpoint.TrainState
    reason: str,
    writer: Writer | None,
    drills: Path,
    fallback_exists: bool,
    share_with_group: bool = False,
    alive: Callable[[], None] = _no_watchdog,
) -> Pending:
    """Collective. Writes this rank's rank file, then the DCP state: now, or with a Writer in a
    background thread after copying the state to host memory (the loop is blocked only for that copy).
    Either way this rank then makes what it wrote 0600 (0640 shared: DCP's files take the umask, 0664
    under umask 002) and hashes it, in the same writer. The step folder stays 0700 until commit, so no
    one else can open a file in it before that chmod."""
    t0 = time.monotonic()
    folder = step_dir(root, state.step)
    rank = dist.get_rank()
    failed: list[Any] = [""]
    if rank == 0:  # a torn or known-bad save of this step from an earlier attempt, or a stray file by its name
        try:
            if folder.is_dir() and not folder.is_symlink():
                shutil.rmtree(folder)
            elif folder.exists() or folder.is_symlink():
                folder.unlink()
            root.parent.mkdir(parents=True, exist_ok=True)  # the run directory (a test's fresh folder)
            make_dir(root, dir_mode(share_with_group), exist_ok=True)
            make_dir(folder)  # 0700 while written; commit() opens it to the group when shared
        except OSError as e:
            failed[0] = f"cannot make {folder}: {e}"
    dist.broadcast_object_list(failed, src=0)  # every rank raises, or none
    if failed[0]:
        raise RuntimeError(failed[0])
    try:
        torch.save(state.rank_state(), folder / rank_file(rank))
        _fsync(folder / rank_file(rank))
        rank_file_error: Exception | None = None
    except Exception as e:  # torch.save says RuntimeError for EFBIG/ENOSPC; reported at commit, by every rank
        rank_file_error = e
    sd = state.state_dict()

    def hashed(write: Any) -> tuple[dict[str, dict[str, Any]], float]:
        if write is not None:
            write.result()  # raises if the background write failed: no marker, nothing counts
        if rank_file_error is not None:
            raise rank_file_error
        _trickle(drill_seconds(drills, "slow_storage"), folder / rank_file(rank))
        for f in own_files(folder, rank):
            os.chmod(f, 0o640 if share_with_group else 0o600)
        return manifest_of(own_files(folder, rank)), time.monotonic() - t0

    if writer is None:
        future: concurrent.futures.Future = concurrent.futures.Future()
        try:  # a failed write or hash is this save's error, reported at commit on every rank
            with _fed_while_bytes_move(alive):
                with _helper_threads_single_threaded():
                    dcp.save(sd, checkpoint_id=folder)  # fsyncs its files; raises on every rank alike
                future.set_result(hashed(None))
        except (Exception, CheckpointException) as e:
            future.set_exception(e)
    else:
        write = dcp.async_save(sd, checkpoint_id=folder, process_group=writer.group, async_stager=writer.stager)
        future = writer.pool.submit(hashed, write)
    last = rank == dist.get_world_size() - 1
    if last and fallback_exists and (injected("kill_rank_during_save") or claim_drill(drills, "kill_rank_during_save")):
        os.kill(os.getpid(), signal.SIGKILL)  # a drill: the last rank dies mid-save, with something to fall back on
    return Pending(folder, state.step, reason, future, t0, time.monotonic() - t0, share_with_group, alive)


def commit(pending: Pending, timeout_s: float | None = None) -> tuple[str, float]:
    """Collective. Waits (up to timeout_s) for this rank's write and hash, gathers every rank's manifest
    entries and, if every rank wrote, rank 0 writes the marker. Returns ("", slowest rank's write
    seconds) once committed, else (why not, 0). Never hangs on a failed rank: each rank sends its error."""
    try:
        with _fed_while_bytes_move(pending.alive):
            files, write_s = pending.future.result(timeout=timeout_s)
        mine: dict[str, Any] = {"files": files, "write_s": write_s}
    except concurrent.futures.TimeoutError:
        mine = {"error": f"not written within {timeout_s:.1f} s"}
    except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
        mine = {"error": f"{type(e).__name__}: {e}"}
    pieces: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(pieces, mine)
    why = next((f"rank {r}: {p['error']}" for r, p in enumerate(pieces) if "error" in p), "")
    if dist.get_rank() == 0 and not why:
        marker = {
            "format": FORMAT,
            "hpc_train": __version__,  # who wrote it: what to install when another version cannot read it
            "step": pending.step,
            "reason": pending.reason,
            "world_size": len(pieces),
            "files": {name: entry for p in pieces for name, entry in sorted(p["files"].items())},
        }
        try:
            write_atomic(pending.folder / MARKER, json.dumps(marker, indent=1), fsync=True)
            if pending.share_with_group:  # as the files: a teammate's init_from reads it under any umask (077: 0600)
                os.chmod(pending.folder / MARKER, 0o640)
            _fsync(pending.folder)
            os.chmod(pending.folder, dir_mode(pending.share_with_group))
        except OSError as e:
            why = f"rank 0 could not write {MARKER}: {e}"
    verdict = [why]
    dist.broadcast_object_list(verdict, src=0)
    return verdict[0], (0.0 if verdict[0] else max(p["write_s"] for p in pieces))
