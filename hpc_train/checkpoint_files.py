"""A checkpoint's files: each rank's own file, the fsync, the sha256 of every file (fed to the hang watchdog while
bytes move), the manifest that commits a folder (paths.MARKER), its verification shared among the ranks, the
checks before anything is loaded (its owner, its format, its shapes), and retention: which folders go, a pure plan
that rank 0 applies. checkpoint.py's Saver uses them; torch for the metadata and the shapes.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from hpc_train import __version__
from hpc_train.config import CheckpointConfig
from hpc_train.paths import (
    FORMAT,
    MARKER,
    marker_format,
    read_marker,
    step_folders,
    untrusted,
)

# ---- files and hashes ---------------------------------------------------------------------------------


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _io_bytes(fd: int) -> tuple[int, int]:
    """(bytes this process passed to read() and write() so far, every thread and the page cache
    included, as /proc/self/io counts them; the length of this read of it, which that count will include)."""
    text = os.pread(fd, 4096, 0)
    fields = dict(line.split(b": ") for line in text.splitlines() if b": " in line)
    return int(fields[b"rchar"]) + int(fields[b"wchar"]), len(text)


def _no_watchdog() -> None:
    """The default of `alive`: no hang watchdog to feed (a benchmark's or a test's own save)."""


@contextmanager
def _fed_while_bytes_move(alive: Callable[[], None]) -> Iterator[None]:
    """Checkpoint I/O is not a hang while it moves bytes. The hang watchdog (job.py) fires train.watchdog_s
    after the loop's last heartbeat; a save, a wait for a background write or a resume longer than that
    (100 GB to slow storage) was judged a hang in every attempt. While this block runs, a thread feeds the
    watchdog (alive: the Task's Pulse.alive) each second in which this process read or wrote anything besides its own
    look at /proc/self/io: a write stuck in the kernel moves nothing and is caught watchdog_s later, as
    before. Without /proc/self/io nothing is fed."""
    done = threading.Event()

    def feed() -> None:
        try:
            fd = os.open("/proc/self/io", os.O_RDONLY)
        except OSError:
            return
        try:
            seen, own = _io_bytes(fd)
            while not done.wait(1.0):
                now, read = _io_bytes(fd)
                if now - seen > own:
                    alive()
                seen, own = now, read
        finally:
            os.close(fd)

    threading.Thread(target=feed, daemon=True, name="hpc_train-io-feed").start()
    try:
        yield
    finally:
        done.set()


def _sha256(path: Path, advance: Callable[[int], Any] = lambda n: None) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
            advance(len(block))
    return h.hexdigest()


def rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


def own_files(folder: Path, rank: int) -> list[Path]:
    """What this rank wrote into a checkpoint: its rank file, its DCP shards (`__<rank>_<i>.distcp`,
    rank = its rank in the writing group, which spans every rank in order) and, on rank 0, DCP's .metadata."""
    files = [folder / rank_file(rank), *sorted(folder.glob(f"__{rank}_*.distcp"))]
    return files + [folder / ".metadata"] if rank == 0 else files


def manifest_of(paths: list[Path]) -> dict[str, dict[str, Any]]:
    return {p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in paths}


def untrusted_checkpoint(folder: Path, names: list[str], top: Path) -> str:
    """ "" when the step folder, its COMMITTED and every file named, and each folder up to `top`, are ours
    and writable by no one else (paths.untrusted); else why not. DCP's .metadata is a pickle, and DCP
    unpickles the objects in its shards (torch.load, weights_only=False): a step folder someone else
    planted, with a COMMITTED whose checksums match their files, would otherwise run their code as us.
    Stat calls only, on rank 0, before any rank hashes or loads a byte."""
    why = untrusted(folder, top)
    for name in [MARKER, *names]:
        why = why or untrusted(folder / name, folder)
    return why


def _ours(paths: list[Path]) -> bool:
    """Every one of them is this user's (a mode another user could have set: never theirs to plant)."""
    try:
        return all(p.stat().st_uid == os.geteuid() for p in paths)
    except OSError:
        return False


def verify(folder: Path, files: dict[str, dict[str, Any]], advance: Callable[[int], Any] = lambda n: None) -> str:
    """ "" if these manifest entries match the folder, else the first reason they do not (never raises)."""
    for name, want in files.items():
        p = folder / name
        try:
            st = p.lstat()
            if not stat.S_ISREG(st.st_mode):
                return f"{name} is not a regular file"
            if st.st_size != want["bytes"]:
                return f"{name} has {st.st_size} bytes, manifest says {want['bytes']}"
            if _sha256(p, advance) != want["sha256"]:
                return f"{name} checksum differs from the manifest"
        except FileNotFoundError:
            return f"{name} is missing"
        except OSError as e:
            return f"{name} is unreadable: {e}"
    return ""


def shares(sizes: dict[str, int], world: int) -> list[list[str]]:
    """Files split over ranks for verification, largest first to the least loaded rank (pure): each
    rank hashes ~1/world of the bytes, so a 100 GB resume reads 100/world GB per rank, not 100 on rank 0."""
    load, out = [0] * world, [[] for _ in range(world)]
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        r = min(range(world), key=lambda i: (load[i], i))
        out[r].append(name)
        load[r] += sizes[name]
    return out


def shape_mismatch(saved: dict[str, Any], sd: dict[str, Any]) -> str:
    """ "" when every entry of `sd` (nested, as DCP flattens it: "model.tok.weight") is in the checkpoint's
    metadata, each tensor a tensor of the same global shape there, and no entry of the checkpoint under a
    part `sd` loads ("model", "optim" ...) is left over; else the first few differences, in words. One
    judgement for init_from and resume: DCP itself raises on a missing key ("CheckpointException ranks:
    dict_keys([0])") and loads a partial state without a word when the checkpoint has more."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, _ = flatten_state_dict(sd)
    wrong = []
    for key, t in flat.items():
        if key not in saved:
            wrong.append(f"{key} is not in the checkpoint")
        elif isinstance(t, torch.Tensor):
            have = getattr(saved[key], "size", None)  # TensorStorageMetadata.size: the global shape
            if have is None:
                wrong.append(f"{key} is not a tensor in the checkpoint")
            elif tuple(have) != tuple(t.shape):
                wrong.append(f"{key} is {list(have)} in the checkpoint but {list(t.shape)} here")
    # Left over in the optimizer's part is no sign of other code: an LR schedule's initial_lr in its groups,
    # the state of a layer frozen again before the resume (torch gives frozen parameters none).
    wrong += [
        f"{key} of the checkpoint has no place here"
        for key in saved
        if key.split(".", 1)[0] in sd and key.split(".", 1)[0] != "optim" and key not in flat
    ]
    return "; ".join(wrong[:3]) + (f" (and {len(wrong) - 3} more)" if len(wrong) > 3 else "")


def unknown_format(folder: Path, marker: dict[str, Any]) -> str:
    """ "" when this code reads the layout the manifest names (paths.FORMAT), else what it is, in words."""
    if marker_format(marker) == FORMAT:
        return ""
    by = f"hpc_train {marker['hpc_train']}" if isinstance(marker.get("hpc_train"), str) else "another hpc_train"
    return (
        f"{folder} is a checkpoint of format {marker_format(marker)}, written by {by}; this hpc_train "
        f"({__version__}) reads format {FORMAT}"
    )


def saved_metadata(folder: Path) -> dict[str, Any] | str:
    """Collective: the DCP metadata of a verified folder (key -> storage metadata), read by rank 0 and
    broadcast, so a folder deleted meanwhile fails every rank alike; else why not, in words. Only after
    verification: .metadata is a pickle, read once its checksum matched the manifest."""
    meta: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            meta[0] = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
        except Exception as e:  # deleted since it verified: every rank learns it below
            meta[0] = f"its .metadata is unreadable ({type(e).__name__}: {e})"
    dist.broadcast_object_list(meta, src=0)
    return meta[0]


# ---- retention (pure plan, then rank 0 deletes) --------------------------------------------------------


def retention_plan(
    folders: dict[int, str | None], cfg: CheckpointConfig, verified: set[int], bad: set[int], keep: set[int]
) -> set[int]:
    """Steps whose folders to delete (pure). folders: step -> its commit reason ("periodic", "stop",
    "final"), "" without COMMITTED, None for an unreadable COMMITTED; verified: steps known good in
    this attempt (resumed from, or committed by it); bad: failed verification; keep: this attempt's
    writes given up on (their threads may still write).

    A folder without COMMITTED and not in keep goes wherever it is: no write of this attempt owns it
    (the Saver runs retention with no save in flight), so it is an earlier attempt's torn save and can
    never be committed (a stop save torn by a full disk sat above the anchor and held that space for
    good). Committed folders: the anchor is the newest verified checkpoint, and none at or above it is
    deleted, so a committed checkpoint goes only once a newer one is known good. Below it: the last
    `keep_last` periodic (and final) ones and every `keep_every_steps`-th stay; stop saves and bad
    folders go."""
    torn = {s for s, r in folders.items() if r == "" and s not in keep}
    if not verified:
        return torn
    anchor = max(verified)
    good = [s for s, r in folders.items() if s <= anchor and r and s not in bad]
    periodic = sorted(s for s in good if folders[s] != "stop")
    stay = {anchor, *periodic[-cfg.keep_last :]}
    if cfg.keep_every_steps:
        stay |= {s for s in periodic if s % cfg.keep_every_steps == 0}
    return torn | {s for s in folders if s < anchor and s not in stay and s not in keep}


def apply_retention(
    root: Path, cfg: CheckpointConfig, verified: set[int], bad: set[int], keep: set[int]
) -> dict[int, str | None]:
    """Delete what retention_plan says; returns the steps deleted, in order, with their commit reason
    ("" for a torn folder, None for an unreadable COMMITTED)."""
    folders = step_folders(root)
    described = {
        s: (m.get("reason", "periodic") if (m := read_marker(p)) else None) if (p / MARKER).exists() else ""
        for s, p in folders.items()
    }
    doomed = sorted(retention_plan(described, cfg, verified, bad, keep))
    for s in doomed:
        shutil.rmtree(folders[s], ignore_errors=True)
    return {s: described[s] for s in doomed}
