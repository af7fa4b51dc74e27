"""A checkpoint tier in host memory: a relaunch inside the allocation resumes from the last few steps, not
the last disk checkpoint.

    hpc-train submit cluster=mysite cluster.nodes=8 cluster.spare_nodes=1 checkpoint.memory_every_steps=5

Every checkpoint.memory_every_steps (Attempt.step_end, the same step on every rank) each rank copies its state
(TrainState.state_dict() with DTensors as their local shards, and its RNGs) into host buffers reused from copy
to copy (on a GPU pinned, the copy queued non-blocking), and the loop goes on: a thread of its own torch.saves
the copy to bytes, writes them into node-local tmpfs and sends them to its buddy, rank (R + tasks_per_node) %
world on the next node, which writes them as the buddy copy, over a gloo group only that thread uses; then the
ranks agree, on that group, that every rank wrote both. One copy in flight at most: the next waits for it. One
folder per node, job and run (the node's name keeps the dev cluster's 4 "nodes", which share one /dev/shm,
apart: a rank only ever reads its own node's folder):

    <checkpoint.memory_dir>/hpc_train-<uid>/<job id>/<node>/<run key>/step-<S>/rank-<R>.pt   torch.save bytes
                                                                              rank-<R>.json  sha256, size, who
                                                                                             wrote it; last

At an attempt's start (Attempt.resume, before the disk resume) every rank lists its node's folder, the ranks
gather the lists, and `pick` (pure) chooses the newest step at which every rank's state is held somewhere,
if it is at least as new as the newest committed disk checkpoint and written by this world size and mesh;
each rank's bytes come from its own node when they are there, else from a holder by gloo send/recv; every
rank checks the sha256 and all must agree, else every rank resumes from disk. tmpfs outlives the training
step's processes but not the allocation: a folder is used only by the job (and Slurm restart count) that
wrote it, and removed when the run finishes, stops or is requeued (after a failure too, unless relaunched on
that node: failure.clean_memory).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import queue
import re
import shutil
import stat
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hpc_train.checkpoint import TrainState, drop_optimizer_state
from hpc_train.checkpoint_write import HostBuffers
from hpc_train.config import CheckpointConfig
from hpc_train.env import RankEnv
from hpc_train.paths import MARKER, make_dir, step_folders, untrusted, write_atomic

log = logging.getLogger(__name__)

STEP = re.compile(r"step-(\d+)")
TAG = 0x4D45  # the buddy exchange's gloo tag: never matched by another send


@dataclass(frozen=True)
class Held:
    """One rank's state at one step, as a node's folder holds it."""

    step: int
    rank: int  # whose state it is
    sha256: str
    bytes: int
    kind: str  # "own" (written by that rank) | "buddy" (received from it)
    world_size: int
    mesh: tuple[int, int]  # (dp, tp)


def pick(
    held: list[list[Held]], world_size: int, mesh: tuple[int, int], disk_step: int | None
) -> tuple[int | None, list[int], str]:
    """Which memory step to resume from, and which rank sends each rank's state (pure). held[h]: what rank h's
    node holds. Returns (step, holder of rank r's state for each r, "") or (None, [], why the disk is used): the
    newest step at which every rank's state is held, written by this world size and mesh, and not older than
    the newest committed disk checkpoint (equal: memory, no file system read). A rank's own node is preferred
    (no transfer), then a copy its own rank wrote, then the lowest holder."""
    by_step: dict[int, dict[int, list[tuple[bool, bool, int]]]] = {}
    other: set[tuple[int, tuple[int, int]]] = set()
    for h, items in enumerate(held):
        for x in items:
            if (x.world_size, x.mesh) != (world_size, mesh):
                other.add((x.world_size, x.mesh))
            elif 0 <= x.rank < world_size:
                by_step.setdefault(x.step, {}).setdefault(x.rank, []).append((h != x.rank, x.kind != "own", h))
    complete = [s for s, ranks in by_step.items() if len(ranks) == world_size]
    if not complete:
        if by_step:
            newest = max(by_step)
            missing = sorted(set(range(world_size)) - set(by_step[newest]))
            return None, [], f"memory step {newest} lacks the state of rank(s) {missing}: no node left holds it"
        if other:
            w, (dp, tp) = sorted(other)[-1]
            return (
                None,
                [],
                (
                    f"the memory copies were written by {w} ranks (mesh dp={dp} x tp={tp}); this attempt has "
                    f"{world_size} (dp={mesh[0]} x tp={mesh[1]})"
                ),
            )
        return None, [], "no memory copy on any node of this job"
    step = max(complete)
    if disk_step is not None and step < disk_step:
        return None, [], f"memory step {step} is older than the committed disk checkpoint of step {disk_step}"
    return step, [min(by_step[step][r])[2] for r in range(world_size)], ""


def run_key(run_dir: Path) -> str:
    """A run's folder name in tmpfs: its directory's name (for people) and a hash of its path (two runs of one
    name in two out_dirs)."""
    path = str(run_dir.resolve())
    return f"{run_dir.name}-{hashlib.sha256(path.encode()).hexdigest()[:12]}"


def _local(obj: Any) -> Any:
    """The state dict with each DTensor as this rank's shard: what torch.save writes and this rank loads back."""
    if isinstance(obj, DTensor):
        return obj.to_local()
    if isinstance(obj, dict):
        return {k: _local(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_local(v) for v in obj)
    return obj


def _restore(like: Any, saved: Any, key: str = "") -> Any:
    """`saved` shaped as `like` (this attempt's state dict): each shard a DTensor again on like's mesh and
    placements, each tensor on like's device. Raises ValueError on any other key or shape (other code)."""
    if isinstance(like, torch.Tensor):
        mine = like.to_local() if isinstance(like, DTensor) else like
        if not isinstance(saved, torch.Tensor) or saved.shape != mine.shape or saved.dtype != mine.dtype:
            got = f"{list(saved.shape)} {saved.dtype}" if isinstance(saved, torch.Tensor) else type(saved).__name__
            raise ValueError(f"{key} is {got} in memory but {list(mine.shape)} {mine.dtype} here")
        t = saved.to(mine.device)
        if isinstance(like, DTensor):
            return DTensor.from_local(
                t, like.device_mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride()
            )
        return t
    if isinstance(like, dict):
        if not isinstance(saved, dict) or set(saved) != set(like):
            raise ValueError(f"{key or 'the state'} has other keys in memory")
        return {k: _restore(like[k], saved[k], f"{key}.{k}".lstrip(".")) for k in like}
    if isinstance(like, (list, tuple)):
        if not isinstance(saved, (list, tuple)) or len(saved) != len(like):
            raise ValueError(f"{key} has another length in memory")
        return type(like)(_restore(a, b, f"{key}.{i}") for i, (a, b) in enumerate(zip(like, saved)))
    return saved


def _not_ours(base: Path) -> str:
    """Why `base` (in a tmpfs every user can write, sticky) is not ours alone, or "". Checked without following
    it: another user's symlink there (to a folder of ours) would pass a stat and could be pointed elsewhere
    between our reads; a real directory of ours with mode 0700 cannot be renamed or entered by anyone else."""
    st = os.lstat(base)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        return f"{base} is not a directory (a symlink or a file someone made); remove it"
    if st.st_uid != os.geteuid() or st.st_mode & 0o077:
        return f"{base} is not this user's alone (owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}); remove it"
    return ""


def newest_committed(root: Path) -> int | None:
    """The newest step folder with a commit marker (the disk resume verifies it; this only orders the tiers)."""
    return max((s for s, p in step_folders(root).items() if (p / MARKER).exists()), default=None)


@dataclass
class MemoryTier:
    """This rank's side of the tier for one attempt. `off`: why it is not used in this attempt ("" when it is)."""

    every_steps: int
    folder: Path  # this node's folder for this job and run
    base: Path  # <memory_dir>/hpc_train-<uid>: everything of ours in tmpfs, judged up to here
    rank: int
    world_size: int
    mesh: tuple[int, int]
    allocation: str  # job id and Slurm restart count: a requeued job (same id) is another allocation
    buddy: int | None  # the rank that keeps a copy of this rank's state; None on one node
    source: int | None  # the rank whose copy this rank keeps
    off: str = ""
    warned: bool = False
    say: Callable[[str], None] = log.info
    # The copy thread's own gloo group (build, once per attempt): its sends and its agreement never interleave
    # with training's collectives on the default group, which the loop runs meanwhile.
    group: Any = None
    buffers: HostBuffers = field(default_factory=HostBuffers)  # the snapshot: one state's worth of host memory
    # The copy thread, started at the first copy and kept for the attempt: a thread started per copy cost the
    # loop ~3 ms a copy, since Thread.start() waits until the new thread runs, and it runs into torch.save
    # holding the GIL (model=tiny, benchmarks/memory_tier.py).
    thread: threading.Thread | None = None
    todo: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)  # the next copy: (step, snapshot, ready)
    idle: threading.Event = field(default_factory=lambda: _set(threading.Event()))  # clear while one is in flight
    lock: threading.Lock = field(default_factory=threading.Lock)  # the copy thread holds it for each file it touches
    last: int = -1  # the newest step saved (or loaded) here and agreed complete on every rank
    abandoned: bool = False  # abandon(): the copy in flight writes and removes nothing more, and never counts
    error: str = ""  # the copy thread's collectives failed (a peer gone): raised at the next save
    blocked_s: float = 0.0  # the loop's seconds in save() (the snapshot, and any wait), since figures() last read
    wait_s: float = 0.0  # of those, waiting for the previous copy
    copy_s: float = 0.0  # the newest finished copy's seconds in its thread (serialise, hash, write, send, agree)
    copy_cpu_s: float = 0.0  # of which the thread's own CPU time: less when it waited for cores or the GIL
    warned_wait: bool = False
    warned_incomplete: bool = False
    device: int | None = None  # the training thread's CUDA device, set in the copy thread too (else GPU 0)

    @classmethod
    def build(
        cls,
        cfg: CheckpointConfig,
        env: RankEnv,
        run_dir: Path,
        mesh: tuple[int, int],
        say: Callable[[str], None],
        timeout_s: float = 960.0,  # preempt.collective_timeout_s at the default train.watchdog_s=900
    ) -> MemoryTier:
        """Collective (one all_gather_object): this node's folder made (0700), owned by us and writable by no
        one else on every rank, else the tier is off in this attempt on every rank alike."""
        node = os.environ.get("SLURMD_NODENAME") or env.nodes[env.node_rank]
        base = Path(cfg.memory_dir) / f"hpc_train-{os.geteuid()}"
        folder = base / env.job_id / node / run_key(run_dir)
        rank, world, per_node = env.rank, env.world_size, env.local_world_size
        two = world > per_node  # ranks are node-contiguous (placement): + per_node is the next node
        tier = cls(
            cfg.steps("memory_every_steps"),
            folder,
            base,
            rank,
            world,
            mesh,
            f"{env.job_id}.{os.environ.get('SLURM_RESTART_COUNT') or 0}",
            (rank + per_node) % world if two else None,
            (rank - per_node) % world if two else None,
            say=say,
        )
        why = ""
        try:
            if not Path(cfg.memory_dir).is_dir():
                raise OSError(f"no folder {cfg.memory_dir} on {node}; set checkpoint.memory_dir to a node-local tmpfs")
            for p in (base, base / env.job_id, folder.parent, folder):
                make_dir(p, exist_ok=True)
            why = _not_ours(base) or untrusted(folder, base)
        except OSError as e:
            why = f"cannot make {folder}: {e}" if Path(cfg.memory_dir).is_dir() else str(e)
        whys: list[Any] = [None] * world
        dist.all_gather_object(whys, why)
        tier.off = next((f"rank {r}: {w}" for r, w in enumerate(whys) if w), "")
        if not tier.off:  # on every rank alike: new_group is collective
            tier.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        if tier.off:
            say(f"warning: checkpoint.memory_every_steps is off in this attempt: {tier.off}")
        elif not two:
            say(
                "checkpoint.memory_every_steps: one node, so no buddy copy: a rank's crash is recovered "
                "from memory, its node's loss from disk"
            )
        return tier

    def due(self, step: int) -> bool:
        return not self.off and step % self.every_steps == 0

    def _write(self, step: int, rank: int, data: Any, digest: str, kind: str) -> str:
        """One copy, the data then its record (the record last: a copy without one is not listed); "" or why not.
        Nothing once abandoned: a folder clean() removed is not made again."""
        folder = self.folder / f"step-{step}"
        info = {"step": step, "rank": rank, "sha256": digest, "bytes": len(data), "kind": kind}
        info |= {"world_size": self.world_size, "mesh": list(self.mesh), "allocation": self.allocation}
        with self.lock:
            if self.abandoned:
                return "abandoned"
            try:
                make_dir(folder, exist_ok=True)
                write_atomic(folder / f"rank-{rank}.pt", data, private=True)
                write_atomic(folder / f"rank-{rank}.json", json.dumps(info), private=True)
            except OSError as e:  # a full tmpfs: this copy is missing, the buddy's may do
                return f"{folder}: {e}"
        return ""

    def save(self, state: TrainState) -> float:
        """At the step boundary, the same step on every rank: waits for the copy in flight (at most one; the
        first wait of an attempt is said, with the figures), copies this rank's state into the reused host
        buffers (GPU: queued on the stream, so the next step's kernels run after it) and starts the copy thread
        on them. Returns the seconds the loop was blocked. Raises RuntimeError when the previous copy's
        collectives failed (a peer gone): the attempt fails as it would in its next collective."""
        if self.off or self.abandoned:  # abandoned: its thread has ended
            return 0.0
        t0 = time.monotonic()
        busy = not self.idle.is_set()
        self.wait()
        waited = time.monotonic() - t0
        if self.error:
            raise RuntimeError(f"the memory copy before step {state.step} failed: {self.error}")
        if busy and not self.warned_wait:
            self.warned_wait = True
            self.say(
                f"warning: checkpoint.memory_every_steps={self.every_steps}: step {state.step}'s copy "
                f"waited {waited * 1e3:.1f} ms for the previous one (a copy takes {self.copy_s * 1e3:.0f} ms in "
                "the background): raise checkpoint.memory_every_steps so that one copy fits between two "
                "(metrics.jsonl: memory_wait_s)"
            )
        cuda = torch.cuda.is_available()
        snapshot = self.buffers.stage({"state": _local(state.state_dict()), "rng": state.rank_state()}, cuda)
        ready = None
        if cuda:  # the thread reads the pinned buffers once the copies queued before this event ran
            self.device = torch.cuda.current_device()
            ready = torch.cuda.Event()
            ready.record()
        self.idle.clear()
        self.todo.put((state.step, snapshot, ready))
        if self.thread is None:
            self.thread = threading.Thread(target=self._copies, name="hpc_train-memory", daemon=True)
            self.thread.start()
        blocked = time.monotonic() - t0
        self.blocked_s += blocked
        self.wait_s += waited
        return blocked

    def _copies(self) -> None:
        """The copy thread's life: one copy after another, as save() hands them over (daemon: a failure's
        os._exit, or the interpreter's exit, ends it wherever it is)."""
        while (item := self.todo.get()) is not None:
            if self.device is not None:  # a new thread's current device is 0: a context there for every rank
                torch.cuda.set_device(self.device)
            try:
                self._copy(*item)
            finally:
                self.idle.set()
        # abandon(): an in-process restart builds the next attempt's tier in this process; this one's host
        # buffers (a whole state, pinned on a GPU) and gloo group must not stay with a thread that waits forever
        self.buffers, self.group = HostBuffers(), None

    def _copy(self, step: int, snapshot: dict[str, Any], ready: Any) -> None:
        """The copy thread: the bytes and their sha256, the own copy, the buddy exchange, the buddy copy, then
        one all-reduce, all on self.group. A local failure (a full tmpfs, abandon()) makes the step incomplete
        but skips no collective, so every rank's thread makes the same calls and none is left waiting. Complete
        only when every rank wrote both its copies: then the older steps go, so a node holds one step (own +
        buddy) between copies; else this step goes and the last complete one stays."""
        t0, cpu0 = time.monotonic(), time.thread_time()
        try:
            data: Any = memoryview(b"")
            digest = hashlib.sha256(b"").hexdigest()
            try:  # anything local (CUDA, a MemoryError in torch.save): this step is incomplete, the calls still made
                if ready is not None:
                    ready.synchronize()
                buf = io.BytesIO()
                torch.save(snapshot, buf)
                data = buf.getbuffer()
                digest = hashlib.sha256(data).hexdigest()
                why = self._write(step, self.rank, data, digest, "own")
            except Exception as e:
                why, data = f"{type(e).__name__}: {str(e)[:200]}", memoryview(b"")
            if self.buddy is not None and self.source is not None:
                head = torch.tensor([len(data), *struct.unpack("<4q", bytes.fromhex(digest))], dtype=torch.int64)
                got = torch.empty(5, dtype=torch.int64)
                for r in [
                    dist.isend(head, self.buddy, group=self.group, tag=TAG),
                    dist.irecv(got, self.source, group=self.group, tag=TAG),
                ]:
                    r.wait()
                theirs = bytearray(int(got[0]))
                # the payloads only where there are bytes (each side knows both lengths now): none is waited for
                waits = []
                if len(data):
                    mine = torch.frombuffer(data, dtype=torch.uint8)
                    waits.append(dist.isend(mine, self.buddy, group=self.group, tag=TAG + 1))
                if theirs:
                    recv = torch.frombuffer(theirs, dtype=torch.uint8)
                    waits.append(dist.irecv(recv, self.source, group=self.group, tag=TAG + 1))
                for r in waits:
                    r.wait()
                sent = struct.pack("<4q", *got[1:].tolist()).hex()  # the sender's hash: a torn transfer never loads
                if theirs:  # written even if ours was not
                    why = self._write(step, self.source, theirs, sent, "buddy") or why
                else:
                    why = why or f"rank {self.source} sent no copy"
            del data
            if why and why != "abandoned" and not self.warned:
                self.warned = True
                log.warning(f"a copy in memory was not written ({why}); the disk checkpoints go on")
            ok = torch.tensor([0 if why or self.abandoned else 1], dtype=torch.int32)
            dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=self.group)
            with self.lock:
                if self.abandoned:  # after a complete agreement too: clean() or the failure path decides
                    return
                if ok.item():
                    self._remove(lambda s: s < step)
                    self.last = step
                else:
                    self._remove(lambda s: s == step)
                    if not self.warned_incomplete:  # rank 0 says it (say prints there), whichever rank's failed
                        self.warned_incomplete = True
                        self.say(
                            f"warning: step {step}'s copies in memory are incomplete on some rank (a full "
                            f"tmpfs? its log says why); a relaunch would read step {self.last} from memory, else disk"
                        )
        except Exception as e:  # gloo: a peer closed its connection; nothing was agreed, nothing removed
            self.error = f"{type(e).__name__}: {str(e)[:300]}"
        finally:
            self.copy_s, self.copy_cpu_s = time.monotonic() - t0, time.thread_time() - cpu0

    def wait(self, timeout_s: float | None = None) -> float:
        """Waits for the copy in flight (up to timeout_s); returns the seconds it took. Ends once every rank's
        thread has done the same collectives: call it on every rank (finish, a stop) or on none (a failure)."""
        t0 = time.monotonic()
        self.idle.wait(timeout_s)
        return time.monotonic() - t0

    def abandon(self) -> None:
        """For paths that cannot wait (a failure: a peer may be gone, the thread blocked in a collective with
        it until the process exits): from now the copy in flight writes and removes nothing, and this rank
        tells the agreement its step is incomplete, so the newest complete step stays on every node."""
        with self.lock:  # a file being written is finished first: none is written after this returns
            self.abandoned = True
        self.todo.put(None)  # the thread ends after the copy in flight (its collectives end on every rank alike)

    def figures(self) -> dict[str, float]:
        """The metrics row's fields (train.Log.step), since the previous row: the loop's seconds blocked by the
        copies (snapshot + waiting), of which waiting for the one in flight, and the newest copy's seconds in
        the background, wall and its thread's CPU."""
        out = {"memory_blocked_s": self.blocked_s, "memory_wait_s": self.wait_s, "memory_copy_s": self.copy_s}
        out["memory_copy_cpu_s"] = self.copy_cpu_s
        self.blocked_s = self.wait_s = 0.0
        return out

    def _remove(self, doomed: Callable[[int], bool]) -> None:
        if not self.folder.is_dir():
            return
        for p in self.folder.iterdir():
            if (m := STEP.fullmatch(p.name)) and doomed(int(m.group(1))):
                shutil.rmtree(p, ignore_errors=True)  # another rank of this node may remove it at once

    def listing(self) -> list[Held]:
        """What this node's folder holds for this allocation: each copy whose record is there and whose file
        has the size it names, in folders that are ours alone (paths.untrusted: torch.load reads them)."""
        out = []
        for step_folder in sorted(self.folder.iterdir()) if self.folder.is_dir() else []:
            if not (m := STEP.fullmatch(step_folder.name)):
                continue
            for record in step_folder.glob("rank-*.json"):
                try:
                    info = json.loads(record.read_text())
                    data = record.with_suffix(".pt")
                    if info["allocation"] != self.allocation or info["step"] != int(m.group(1)):
                        continue
                    if untrusted(data, self.base) or untrusted(record, self.base):
                        continue
                    if data.stat().st_size != info["bytes"]:
                        continue
                    held = Held(
                        info["step"],
                        info["rank"],
                        info["sha256"],
                        info["bytes"],
                        info["kind"],
                        info["world_size"],
                        (int(info["mesh"][0]), int(info["mesh"][1])),
                    )
                except (OSError, ValueError, KeyError, TypeError, IndexError):
                    continue
                out.append(held)
        return out

    def load(self, state: TrainState, checkpoints: Path) -> dict[str, Any]:
        """Collective: `state` (and this rank's RNGs) from the newest usable memory step, every rank or none.
        Returns what the start event records: {"step", "own", "buddy", "load_s"} when loaded, {"skipped": why}
        when the disk resume is to run. Afterwards this node keeps only the step loaded (the next save's
        cleanup then drops it in turn): a crashed attempt's partial step, or another job's, is never mixed in."""
        t0 = time.monotonic()
        if self.off:
            return {"skipped": self.off}
        mine = {"held": self.listing(), "disk": newest_committed(checkpoints) if self.rank == 0 else None}
        every: list[Any] = [None] * self.world_size
        dist.all_gather_object(every, mine)
        held = [e["held"] for e in every]
        step, holders, why = pick(held, self.world_size, self.mesh, every[0]["disk"])
        loaded = False
        if step is not None:
            expected = [
                next(x for x in held[holders[r]] if (x.step, x.rank) == (step, r)) for r in range(self.world_size)
            ]
            data = bytearray()
            for r in range(self.world_size):  # one order on every rank: each send meets its recv
                h, size = holders[r], expected[r].bytes
                if self.rank == h:
                    got = self._read(step, r, size)
                    if h == r:
                        data = got
                    else:
                        dist.send(torch.frombuffer(got, dtype=torch.uint8), r)
                elif self.rank == r:
                    data = bytearray(size)
                    dist.recv(torch.frombuffer(data, dtype=torch.uint8), h)
            why = "" if hashlib.sha256(data).hexdigest() == expected[self.rank].sha256 else "checksum differs"
            sd, lazy, rng = state.state_dict(), None, None  # on every rank: a wrapper's state_dict may be collective
            if not why:
                try:
                    saved = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")  # no pickle runs
                    lazy = set(sd["optim"]["state"]) - set(saved["state"]["optim"]["state"])
                    for fqn in lazy:
                        del sd["optim"]["state"][fqn]
                    sd, rng = _restore(sd, saved["state"]), saved["rng"]
                except Exception as e:  # other code wrote it, or torch.load refused it: every rank goes to disk
                    why = f"does not load: {type(e).__name__}: {str(e)[:200]}"
            whys: list[Any] = [None] * self.world_size
            dist.all_gather_object(whys, why)
            why = next((f"memory step {step}, rank {r}'s state: {w}" for r, w in enumerate(whys) if w), "")
            if not why:
                state.load_state_dict(sd, strict=not lazy)
                drop_optimizer_state(state, lazy or set())
                state.load_rank_state(rng)
                loaded = True
        self._remove(lambda s: not loaded or s != step)
        self._remove_other_jobs()
        self.last = step if loaded and step is not None else -1
        if not loaded:
            return {"skipped": why}
        own = sum(holders[r] == r for r in range(self.world_size))
        return {"step": step, "own": own, "buddy": self.world_size - own, "load_s": round(time.monotonic() - t0, 4)}

    def _read(self, step: int, rank: int, size: int) -> bytearray:
        """The copy as listed, or `size` zero bytes (a file removed or changed since: its checksum fails, and the
        rank waiting for it is sent something rather than left in recv until the collective timeout)."""
        try:
            got = bytearray((self.folder / f"step-{step}" / f"rank-{rank}.pt").read_bytes())
        except OSError:
            got = bytearray()
        return got if len(got) == size else bytearray(size)

    def _remove_other_jobs(self) -> None:
        """This run's folders on this node under other job ids: an earlier job SIGKILLed before its cleanup."""
        node, key = self.folder.parent.name, self.folder.name
        for other in self.base.glob(f"*/{node}/{key}"):
            if other != self.folder:
                shutil.rmtree(other, ignore_errors=True)
                clean_empty(other.parent, self.base)

    @property
    def node(self) -> str:
        """The node whose folder this is (SLURMD_NODENAME where the tier was built)."""
        return self.folder.parent.name

    def clean(self, join_s: float = 0.0) -> None:
        """Best effort, on every rank: this node's folder of this job and run goes (the run finished, stopped or
        is requeued: no relaunch inside this allocation will read it); then the empty folders above it. A copy
        still in flight writes nothing after it (abandon). join_s: wait that long for the copy thread to end,
        which lets go of its gloo group (the run's finish: nothing is in flight then)."""
        self.abandon()
        if join_s and self.thread is not None:
            # A daemon thread still in torch code (here: letting go of its gloo group) when the process exits can
            # die inside C++ ("terminate called without an active exception", exit 134, a finished job FAILED);
            # leave.py exits without finalizing, and joined here, the thread is done before that.
            self.thread.join(join_s)
            if self.thread.is_alive():  # on record, should the exit's crash come back
                log.warning(
                    f"the memory copy thread has not ended {join_s:.0f} s after the finish; the process exits with it"
                )
        shutil.rmtree(self.folder, ignore_errors=True)
        clean_empty(self.folder.parent, self.base)


def _set(event: threading.Event) -> threading.Event:
    event.set()
    return event


def clean_empty(folder: Path, base: Path) -> None:
    """rmdir `folder` and its parents up to (not including) `base` while they are empty."""
    for p in (folder, *folder.parents):
        if p == base or not p.is_relative_to(base):
            return
        try:
            p.rmdir()
        except OSError:
            return
