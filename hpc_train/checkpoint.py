"""Sharded checkpoints with torch DCP; a checkpoint exists only once its commit marker does.

Layout of one checkpoint (one folder per step):
    checkpoints/step_000040/
        .metadata, __0_0.distcp, ...   DCP: model + optimizer, readable by torch's own tools
        rank_00000.pt ...              per-rank extras (RNG states), torch.save of plain tensors
        COMMITTED                      JSON manifest: step, sizes and sha256 of every file; written last

Write order: every rank writes and fsyncs its files -> barrier -> rank 0 hashes them, writes the
manifest to COMMITTED.tmp, fsyncs it and os.replace()s it to COMMITTED -> barrier. A job killed at any
point before the replace leaves a folder without COMMITTED, which resume ignores.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from hpc_train.config import CheckpointConfig

MARKER = "COMMITTED"


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:06d}"


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _manifest(folder: Path) -> dict[str, dict[str, Any]]:
    return {p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p)}
            for p in sorted(folder.iterdir()) if p.is_file() and not p.name.startswith(MARKER)}


def save(root: Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
         extra: dict[str, Any], cfg: CheckpointConfig) -> tuple[Path, float]:
    """Collective: every rank calls it with the same step. Returns (folder, seconds)."""
    t0 = time.monotonic()
    folder = step_dir(root, step)
    rank = dist.get_rank()
    if rank == 0 and folder.exists():  # a torn save of this same step from a killed attempt
        shutil.rmtree(folder)
    dist.barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=folder)  # fsyncs its files
    rank_file = folder / f"rank_{rank:05d}.pt"
    torch.save(extra, rank_file)
    _fsync(rank_file)
    dist.barrier()
    if rank == 0:
        marker = {"step": step, "world_size": dist.get_world_size(), "files": _manifest(folder)}
        tmp = folder / f"{MARKER}.tmp"
        tmp.write_text(json.dumps(marker, indent=1))
        _fsync(tmp)
        os.replace(tmp, folder / MARKER)
        _fsync(folder)
        _apply_retention(root, cfg.keep_last)
    dist.barrier()
    return folder, time.monotonic() - t0


def committed(root: Path) -> list[Path]:
    """Committed checkpoint folders, oldest first."""
    if not root.exists():
        return []
    return sorted(p for p in root.glob("step_*") if (p / MARKER).exists())


def _apply_retention(root: Path, keep_last: int) -> None:
    """Keep the newest keep_last committed checkpoints; drop older ones and torn folders below them."""
    done = committed(root)
    if not done:
        return
    keep = set(done[-keep_last:])
    newest = done[-1]
    for p in sorted(root.glob("step_*")):
        if p not in keep and p < newest:
            shutil.rmtree(p, ignore_errors=True)


def verify(folder: Path) -> str:
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
        if _sha256(p) != want["sha256"]:
            return f"{name} checksum differs from the manifest"
    return ""


def pick_resume(root: Path) -> tuple[Path | None, list[str]]:
    """Newest committed checkpoint that verifies; also the reasons older-than-newest ones were skipped."""
    skipped = []
    for folder in reversed(committed(root)):
        why = verify(folder)
        if not why:
            return folder, skipped
        skipped.append(f"{folder.name}: {why}")
    return None, skipped


def load(folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Collective. Loads model and optimizer in place; returns this rank's extras."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=folder)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    rank_file = folder / f"rank_{dist.get_rank():05d}.pt"
    if not rank_file.exists():
        raise RuntimeError(f"{rank_file} is missing: the checkpoint was written by a different world size "
                           f"({json.loads((folder / MARKER).read_text())['world_size']} ranks); resume with "
                           f"that many ranks")
    return torch.load(rank_file, weights_only=True)  # no pickle code runs on load
