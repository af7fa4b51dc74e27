"""Sharded checkpoints with torch DCP; a checkpoint exists only once its commit marker does.

Layout of one checkpoint (one folder per step):
    checkpoints/step_000040/
        .metadata, __0_0.distcp, ...   DCP: model, optimizer, progress (step, tokens), data position + fingerprint
        rank_00000.pt ...              each rank's own state (torch's, Python's and numpy's RNG),
                                       torch.save of plain tensors
        COMMITTED                      JSON manifest: format (paths.FORMAT), step, reason, world size, size
                                       and sha256 of every file; written last

Write order: every rank writes and fsyncs its files (a periodic save in a background thread) and hashes
what it wrote, in that same writer -> at a step boundary the ranks gather their file lists -> rank 0
writes the manifest to a temp file, fsyncs it and os.replace()s it to COMMITTED. A job killed at any
point before the replace leaves a folder without COMMITTED, which resume ignores. Resume verifies the
newest committed folder with every rank hashing a share of its files, falling back to older ones.

The Saver at the bottom owns the policy: one save in flight at a time, periodic saves in the
background, final saves synchronous, stop saves bounded by the time Slurm leaves less the requeue's
reserve, retention that never deletes a committed checkpoint before a newer one is known good, and the
hang watchdog fed while checkpoint I/O moves bytes.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from hpc_train import journal, pipeline
from hpc_train.checkpoint_files import (
    _fed_while_bytes_move,
    _no_watchdog,
    _ours,
    apply_retention,
    rank_file,
    saved_metadata,
    shape_mismatch,
    shares,
    unknown_format,
    untrusted_checkpoint,
    verify,
)
from hpc_train.checkpoint_write import Pending, Writer, _helper_threads_single_threaded, commit, start_save
from hpc_train.config import CheckpointConfig
from hpc_train.paths import (
    MARKER,
    read_marker,
    step_dir,
    step_folders,
)
from hpc_train.preempt import Unrecoverable


@dataclass
class TrainState:
    """What a checkpoint holds, as torch's Stateful protocol (state_dict / load_state_dict): model and
    optimizer (sharded under FSDP2), step and tokens seen, and `data`, anything with its own
    state_dict / load_state_dict of tensors (the sampler's position). Each rank's RNG goes to its own
    rank file. Loop counters live here, so a resumed attempt needs nothing else."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    data: Any = None
    step: int = 0
    tokens_seen: int = 0

    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        sd: dict[str, Any] = {
            "model": model_sd,
            "optim": optim_sd,
            "progress": {"step": torch.tensor(self.step), "tokens_seen": torch.tensor(self.tokens_seen)},
        }
        if self.data is not None:
            sd["data"] = self.data.state_dict()
        return sd

    def load_state_dict(self, sd: dict[str, Any], strict: bool = True) -> None:
        """strict=False: parameters without optimizer state in `sd` keep none (Saver.resume, a lazy state)."""
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=sd["model"],
            optim_state_dict=sd["optim"],
            options=StateDictOptions(strict=strict),
        )
        self.step, self.tokens_seen = int(sd["progress"]["step"]), int(sd["progress"]["tokens_seen"])
        if self.data is not None:
            self.data.load_state_dict(sd["data"])

    @staticmethod
    def rank_state() -> dict[str, torch.Tensor]:
        """This rank's RNGs: torch's (CUDA's too), Python's `random` and numpy's global one (if numpy is
        installed), as plain tensors: the rank file is read with torch.load(weights_only=True)."""
        version, words, gauss = random.getstate()  # (3, 624 Mersenne Twister words + position, cached gauss)
        state = {
            "rng": torch.get_rng_state(),
            "py_rng": torch.tensor([version, *words], dtype=torch.int64),  # words < 2**32
            "py_rng_gauss": torch.tensor(math.nan if gauss is None else gauss, dtype=torch.float64),
        }
        if torch.cuda.is_available():
            state["cuda_rng"] = torch.cuda.get_rng_state()
        try:
            import numpy as np
        except ImportError:
            return state
        _, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)  # ("MT19937", 624 uint32, ...)
        state["np_rng"] = torch.tensor([*keys.tolist(), pos, has_gauss], dtype=torch.int64)
        state["np_rng_gauss"] = torch.tensor(cached, dtype=torch.float64)
        return state

    @staticmethod
    def load_rank_state(state: dict[str, torch.Tensor]) -> None:
        """The RNGs rank_state saved; one a rank file has no entry for (written before it was saved:
        Python's and numpy's) stays as it is."""
        torch.set_rng_state(state["rng"])
        if "cuda_rng" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda_rng"])
        if "py_rng" in state:
            version, *words = state["py_rng"].tolist()
            gauss = float(state["py_rng_gauss"])
            random.setstate((version, tuple(words), None if math.isnan(gauss) else gauss))
        if "np_rng" in state:
            import numpy as np

            *keys, pos, has_gauss = state["np_rng"].tolist()
            keys_u32 = np.array(keys, dtype=np.uint32)
            np.random.set_state(("MT19937", keys_u32, pos, has_gauss, float(state["np_rng_gauss"])))


# Keys of state.data added after checkpoints without them were written: such a checkpoint still loads, and
# the data object sees the key absent. Any other key a checkpoint lacks is shape_mismatch's stop.
OPTIONAL_DATA_KEYS = ("fingerprint",)  # data.Sampler's, since issue 19


def _lazy_optimizer_state(sd: dict[str, Any], held: dict[str, Any]) -> set[str]:
    """The parameters (FQNs) whose optimizer state `sd` asks for and the checkpoint lacks: AdamW makes a
    parameter's state at its first gradient, so one no step reached before the save (an unused branch, an
    MoE expert) has none there; get_state_dict made it one (step 1, zero moments) that the uninterrupted
    run never had. Dropped from `sd` here; Saver.resume drops it from the optimizer after the load."""
    state = sd.get("optim", {}).get("state", {})
    lazy = {fqn for fqn in state if not any(k.startswith(f"optim.state.{fqn}.") for k in held)}
    for fqn in lazy:
        del state[fqn]
    return lazy


def drop_optimizer_state(state: TrainState, lazy: set[str]) -> None:
    """After a load that lacked `lazy` (_lazy_optimizer_state): those parameters hold no optimizer state, as in
    the uninterrupted run, where it is made at the parameter's first gradient."""
    if not lazy:
        return
    from torch.distributed.checkpoint.state_dict import _get_fqns

    for name, p in state.model.named_parameters():
        if _get_fqns(state.model, name) & lazy:
            state.optimizer.state.pop(p, None)


def _held_data_keys(sd: dict[str, Any], held: dict[str, Any]) -> dict[str, Any]:
    """`sd` without the OPTIONAL_DATA_KEYS of its `data` that the checkpoint (its DCP metadata: `held`)
    lacks: DCP refuses any key a checkpoint lacks ("Missing key in checkpoint state_dict")."""
    if "data" not in sd:
        return sd
    keep = {
        k: v
        for k, v in sd["data"].items()
        if k not in OPTIONAL_DATA_KEYS or any(f == f"data.{k}" or f.startswith(f"data.{k}.") for f in held)
    }
    return {**sd, "data": keep}


# ---- the saver: policy for one attempt -----------------------------------------------------------------


@dataclass
class Saver:
    """This attempt's checkpoints. One save in flight at a time: a periodic save due while the previous
    background write still runs first waits for that write and commits it (before, the older save was
    silently replaced and never committed). Final saves are synchronous; a stop save is bounded by the
    time Slurm leaves before SIGKILL less the requeue decision's reserve (stop)."""

    root: Path
    cfg: CheckpointConfig
    drills: Path
    event: Callable[..., None]  # rank 0's events.jsonl
    expected_write_s: float  # slowest write this run has recorded (every attempt's events, this one's)
    writer: Writer | None = None
    pending: Pending | None = None
    verified: set[int] = field(default_factory=set)  # resumed from, or committed by this attempt
    bad: set[int] = field(default_factory=set)  # failed verification at resume
    abandoned: set[int] = field(default_factory=set)  # writes given up on: their threads may still write
    saved_world_size: int = 0  # ranks that wrote the checkpoint resume() loaded (0: none loaded)
    share_with_group: bool = False  # the run's share_with_group: folders 0750 and files 0640, not 0700/0600
    alive: Callable[[], None] = _no_watchdog  # fed while checkpoint I/O moves bytes: the Task's Pulse.alive

    def resume(self, state: TrainState) -> tuple[Path | None, float, float]:
        """Collective: load the newest committed checkpoint that verifies into `state`. Rank 0 lists the
        candidates; every rank hashes its share of each until one verifies everywhere. Returns (its
        folder or None, seconds verifying, seconds loading)."""
        from rich.progress import Progress

        rank = dist.get_rank()
        listing: list[Any] = [self._candidates() if rank == 0 else None]
        dist.broadcast_object_list(listing, src=0)
        t0 = time.monotonic()
        load_failed = ""
        loose: list[Path] = []
        with (
            _fed_while_bytes_move(self.alive),
            Progress(disable=rank != 0 or not listing[0]) as progress,  # rank 0's share, on its log
        ):
            for step, marker, distrust, ours in listing[0]:
                folder = step_dir(self.root, step)
                if distrust and ours:  # this run's own, left writable (older hpc_train, a chmod -R g+w since)
                    loose.append(folder)
                    self.event(journal.CHECKPOINT_SKIPPED, step, reason=f"{folder.name}: not loaded: {distrust}")
                    continue  # not `bad`: retention must not delete what may be this run's only progress
                why = self._verified_everywhere(folder, marker, distrust, progress)
                verify_s, t1 = time.monotonic() - t0, time.monotonic()
                if not why:
                    why, partial = self._load(step, folder, marker, state)
                    load_failed = why if partial else load_failed
                if not why:
                    return folder, verify_s, time.monotonic() - t1
                self.bad.add(step)
                self.event(journal.CHECKPOINT_SKIPPED, step, reason=f"{folder.name}: {why}")
        if loose:  # starting over would lose them to this attempt's saves and retention: a person decides
            raise Unrecoverable(
                f"{len(loose)} committed checkpoint(s) of this run, newest {loose[0]}, are not loaded: others "
                f"can write them, and whoever can write them can run code as you. If nobody else did: chmod -R "
                f"go-w {self.root} and hpc-train resume {self.root.parent}"
            )
        if load_failed:  # the model may hold part of that checkpoint: a fresh start would not be one
            raise RuntimeError(
                f"no checkpoint loaded and a partial load may have changed the model ({load_failed}); "
                f"the next attempt starts clean"
            )
        return None, time.monotonic() - t0, 0.0

    def _candidates(self) -> list[tuple[int, dict[str, Any] | None, str, bool]]:
        """Rank 0's listing, newest first: (step, its manifest, why not to trust it (another user's or writable by
        others), whether it is this run's own)."""
        return [
            (s, m, untrusted_checkpoint(p, names, self.root.parent), _ours([p, *(p / n for n in [MARKER, *names])]))
            for s, p in reversed(step_folders(self.root).items())
            if (p / MARKER).exists()
            for m in [read_marker(p)]
            for names in [list(m["files"]) if m else []]
        ]

    def _verified_everywhere(self, folder: Path, marker: dict[str, Any] | None, distrust: str, progress: Any) -> str:
        """Collective: "" when every rank's share of `folder` verifies, else the first rank's reason not to load it.
        Raises Unrecoverable for a format this hpc_train does not know (judged alike on every rank: all have the
        same listing)."""
        rank, world = dist.get_rank(), dist.get_world_size()
        if distrust:
            why = f"not loaded: {distrust}"
        elif marker is None:
            why = f"unreadable {MARKER}"
        elif unknown_format(folder, marker):
            raise Unrecoverable(  # falling back would have this attempt's saves and retention bury it
                f"{unknown_format(folder, marker)}. Resume with the hpc_train that wrote it (install "
                f"it, then hpc-train resume {self.root.parent}); nothing was loaded or deleted"
            )
        else:
            share = shares({n: f["bytes"] for n, f in marker["files"].items()}, world)[rank]
            task = progress.add_task(f"verifying {folder.name}", total=sum(marker["files"][n]["bytes"] for n in share))
            why = verify(folder, {n: marker["files"][n] for n in share}, lambda n: progress.advance(task, n))
        whys: list[Any] = [None] * world
        dist.all_gather_object(whys, why)
        return next((w for w in whys if w), "")

    def _load(self, step: int, folder: Path, marker: dict[str, Any], state: TrainState) -> tuple[str, bool]:
        """Load the verified `folder` into `state` on every rank: ("", False) once loaded, else (why not, whether
        the model may hold part of it: DCP failed midway). Raises Unrecoverable for a checkpoint whose shapes do
        not fit the model."""
        sd = state.state_dict()
        meta = saved_metadata(folder)
        if isinstance(meta, str):
            return meta, False
        sd = _held_data_keys(sd, meta)
        lazy = _lazy_optimizer_state(sd, meta)
        if wrong := shape_mismatch(meta, sd):  # every older folder was written by the same code: none would fit
            raise Unrecoverable(
                f"{folder} does not fit this run's state: {wrong}. It was written by other code (a "
                f"parameter, buffer, optimizer state or state.data added, removed or reshaped since). "
                f"Run the code that wrote it (then hpc-train resume {self.root.parent}), or start a "
                f"new run from its weights with checkpoint.init_from={folder} (when the model still "
                f"fits them); nothing was loaded or deleted"
            )
        try:  # DCP raises on every rank alike, so every rank goes on to the next folder
            with _helper_threads_single_threaded():
                dcp.load(sd, checkpoint_id=folder)
            state.load_state_dict(sd, strict=not lazy)  # shape_mismatch judged the model's keys
            drop_optimizer_state(state, lazy)
            # Another world size (elastic resume): DCP resharded model and optimizer above; a rank the checkpoint had
            # no file for keeps its fresh seed (Attempt.resume says so).
            if (folder / rank_file(dist.get_rank())).exists():
                state.load_rank_state(torch.load(folder / rank_file(dist.get_rank()), weights_only=True))  # no pickle
        except CheckpointException as e:
            return f"verified but did not load: {str(e).splitlines()[0][:300]}", True
        self.verified.add(step)
        self.saved_world_size = int(marker["world_size"])
        return "", False

    def init_source(self) -> Path:
        """checkpoint.init_from as one step folder, the same for every attempt of this run: a step folder as given
        (pinned at submit); a run directory, a stage this run was queued after (submit --after), its final
        checkpoint (pipeline.final_checkpoint), or the one an earlier attempt of this run started from while that
        still has its marker: the stage, resumed meanwhile, may have committed newer ones."""
        given = Path(self.cfg.init_from)
        for e in reversed(journal.named(journal.read(self.root.parent), journal.START)):
            earlier = e.get("init_from")
            if (
                isinstance(earlier, dict)
                and isinstance(earlier.get("path"), str)
                and read_marker(Path(earlier["path"]))
            ):
                return Path(earlier["path"])
        return pipeline.final_checkpoint(given) or given

    def init_from(self, state: TrainState) -> tuple[dict[str, Any], float, float]:
        """Collective: a new run's weights (and optimizer state, with checkpoint.init_from_optimizer) from
        another run's committed checkpoint, verified as a resume verifies (every rank hashes a share). Step,
        tokens, data position and RNG stay fresh: it is a new run. Any world size: DCP reshards on load.
        Raises Unrecoverable (no requeue can fix it) when the folder does not verify or the shapes differ.
        Returns (what the start event records, seconds verifying, seconds loading)."""
        with_optim = self.cfg.init_from_optimizer
        rank, world = dist.get_rank(), dist.get_world_size()
        t0 = time.monotonic()
        # Rank 0 chooses and reads, every rank gets its answer: a folder deleted meanwhile fails all ranks
        # together, none waiting in the all_gather below for one that raised (as resume lists for every rank),
        # and no two ranks start from two checkpoints of a stage that committed another meanwhile.
        # Pinned at submit under this run's (or its sweep's) directory: judged up to there.
        run_dir = self.root.parent
        found: list[Any] = [None]
        if rank == 0:
            folder = self.init_source()
            top = next((d for d in (run_dir, run_dir.parent) if folder.is_relative_to(d)), folder)
            marker = read_marker(folder)
            found[0] = (str(folder), marker, untrusted_checkpoint(folder, list(marker["files"]), top) if marker else "")
        dist.broadcast_object_list(found, src=0)
        folder, marker, distrust = Path(found[0][0]), found[0][1], found[0][2]
        if marker is None:
            raise Unrecoverable(
                f"checkpoint.init_from={folder}: no readable {MARKER} manifest there (deleted by its "
                f"run's retention, or never committed); submit again with another committed step "
                f"folder of that run"
            )
        if distrust:
            raise Unrecoverable(f"checkpoint.init_from={folder} is not loaded: {distrust}")
        if unknown_format(folder, marker):
            raise Unrecoverable(
                f"checkpoint.init_from={folder}: {unknown_format(folder, marker)}; submit with the hpc_train "
                f"that wrote it, or with another committed step folder"
            )
        share = shares({n: f["bytes"] for n, f in marker["files"].items()}, world)[rank]
        whys: list[Any] = [None] * world
        with _fed_while_bytes_move(self.alive):
            dist.all_gather_object(whys, verify(folder, {n: marker["files"][n] for n in share}))
        why = next((w for w in whys if w), "")
        if why:
            raise Unrecoverable(
                f"checkpoint.init_from={folder} does not verify: {why}; submit again with another "
                f"committed step folder of that run"
            )
        # Only now is the pickle read: its checksum (read_marker insists .metadata is in the manifest) matched.
        meta = saved_metadata(folder)
        if isinstance(meta, str):
            raise Unrecoverable(
                f"checkpoint.init_from={folder}: {meta}; submit again with another committed step folder of that run"
            )
        verify_s, t1 = time.monotonic() - t0, time.monotonic()
        # Without the optimizer, the model's state dict alone: get_state_dict(model, optimizer) gives a fresh
        # AdamW state by a zero-lr step (torch's _init_optim_state), so training began at step 2 of Adam's
        # bias correction, with zero moments, unlike a fresh optimizer.
        if with_optim:
            model_sd, optim_sd = get_state_dict(state.model, state.optimizer)
            sd: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
        else:
            sd = {"model": get_model_state_dict(state.model)}
        wrong = shape_mismatch(meta, sd)
        if wrong:
            raise Unrecoverable(
                f"checkpoint.init_from={folder}: {wrong}; build the model that checkpoint was "
                f"trained with (its run's config.yaml), or drop checkpoint.init_from"
            )
        with _fed_while_bytes_move(self.alive), _helper_threads_single_threaded():
            dcp.load(sd, checkpoint_id=folder)  # only the keys asked for: a partial load of that checkpoint
        if with_optim:
            set_state_dict(state.model, state.optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        else:
            set_model_state_dict(state.model, sd["model"])
        source = {"path": str(folder), "step": marker.get("step"), "optimizer": with_optim}
        return source, verify_s, time.monotonic() - t1

    def written_here(self) -> bool:
        """This rank's part of the save in flight is written (or none is in flight); no collective."""
        return self.pending is None or self.pending.done()

    def commit_pending(self, timeout_s: float | None = None, retain: bool = True) -> bool:
        """Collective: commit the save in flight (waiting up to timeout_s for its writes), then apply
        retention (unless retain=False: the stop path leaves it to the next resume); on failure record why
        and leave its folder to a later attempt's retention."""
        p, self.pending = self.pending, None
        if p is None:
            return True
        t0 = time.monotonic()
        why, write_s = commit(p, timeout_s)
        if why:
            self.abandoned.add(p.step)
            self.event(journal.CHECKPOINT_ABANDONED, p.step, reason=p.reason, error=why)
            return False
        self.verified.add(p.step)
        self.bad.discard(p.step)  # a bad folder this attempt saved again is good now
        self.expected_write_s = max(self.expected_write_s, write_s)
        self.event(
            journal.CHECKPOINT_COMMITTED,
            p.step,
            path=str(p.folder),
            reason=p.reason,
            save_s=round(time.monotonic() - p.started, 4),
            write_s=round(write_s, 4),
            stall_s=round(p.stall_s, 4),
            waited_s=round(time.monotonic() - t0, 4),
        )
        if retain:
            self.retain()
        return True

    def retain(self) -> None:
        """Rank 0 deletes what retention_plan says (no collective); one event per folder, `torn` for one
        that was never committed. After each commit but a stop's, and once resumed (Attempt.resume)."""
        if dist.get_rank() == 0:
            for s, reason in apply_retention(self.root, self.cfg, self.verified, self.bad, self.abandoned).items():
                torn = {"torn": True} if reason == "" else {}
                self.event(journal.CHECKPOINT_DELETED, s, anchor=max(self.verified, default=None), **torn)

    def save(self, state: TrainState, reason: str, background: bool) -> None:
        """Collective: start a save of this step (a step already known good is not saved twice), after
        committing the one in flight: one save at a time, so none is ever replaced before it commits and
        two writes never share the host buffers."""
        self.commit_pending()
        if state.step in self.verified:
            return
        self.pending = start_save(
            self.root,
            state,
            reason,
            self.writer if background else None,
            self.drills,
            fallback_exists=bool(self.verified),
            share_with_group=self.share_with_group,
            alive=self.alive,
        )
        if not background:
            self.commit_pending()

    def periodic(self, state: TrainState) -> None:
        self.save(state, "periodic", background=self.writer is not None)  # waits for a write still running

    def stop(self, state: TrainState, budget_s: float, agree: Callable[[bool], bool]) -> None:
        """Collective, at a stop signal. budget_s, the same on every rank: the time Slurm leaves before
        SIGKILL less what the requeue decision needs after the save (Attempt.reserve_s). Nothing here runs
        past it: the write in flight is committed if it finishes in time (leaving room for this step's
        save once something is committed to fall back on), and this step is saved only if time is left
        and the slowest write this run has seen fits in it; with a background writer the save is waited
        for only that long. A stop whose save does not fit requeues from the last committed checkpoint.
        Retention is left to the next attempt's resume: its deletes would run before the requeue."""
        t0 = time.monotonic()

        def left() -> float:
            return budget_s - (time.monotonic() - t0)

        busy = False  # a write given up on below still holds the writer's one thread and its host buffers
        if self.pending is not None:
            # Room for this step's save after it only when that save can fit at all: else the write in
            # flight gets the whole budget (it abandoned a write 5 s from done when the save would not fit).
            fits = self.verified and self.expected_write_s <= budget_s
            room = budget_s - self.expected_write_s if fits else budget_s
            busy = not self.commit_pending(timeout_s=max(0.0, room), retain=False)
        if state.step in self.verified:
            return
        need = self.expected_write_s  # the write just committed counts too
        if not agree(0.0 < left() and need <= left()):
            self.event(journal.STOP_SAVE_SKIPPED, state.step, expected_save_s=round(need, 3), left_s=round(left(), 3))
            return
        writer = None if busy else self.writer  # in the background when it can be, so the wait below bounds it
        self.pending = start_save(
            self.root,
            state,
            "stop",
            writer,
            self.drills,
            fallback_exists=bool(self.verified),
            share_with_group=self.share_with_group,
            alive=self.alive,
        )
        self.commit_pending(timeout_s=max(0.0, left()), retain=False)

    def final(self, state: TrainState) -> None:
        self.save(state, "final", background=False)
