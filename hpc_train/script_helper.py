"""An optional helper for a script launched with `hpc-train submit ... -- python train.py` (script.py).
Importing it does not import torch, and outside a job every call does nothing but return.

    from hpc_train import script_helper as hpc
    for step in range(start, steps):
        ...one optimizer step...
        hpc.log(step=step + 1, loss=loss.item(), tokens=tokens_seen, total_steps=steps)  # status, report
        if (step + 1) % 50 == 0 or hpc.stop_requested():
            torch.save(state, path); hpc.committed(step + 1, path)       # status: where it will resume
        if hpc.stop_requested():                                        # every rank agrees (one all-reduce)
            break

Importing it installs a record-only handler for the signal the job stops the script with
(HPC_TRAIN_STOP_SIGNAL, script.stop_signal) unless the script already has one of its own.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from hpc_train import journal
from hpc_train.paths import RunPaths, append_line

_received = [False]
_last = [0.0, 0]  # time and step of the previous log() call: its step time and throughput


def _record(signum: int, frame: object) -> None:
    _received[0] = True


_name = os.environ.get("HPC_TRAIN_STOP_SIGNAL", "")
# SIG_IGN too: an ignored signal survives exec, so a script started under nohup (HUP) or by a shell's `cmd &`
# (INT) would never see the stop; a handler of the script's own is a function, and is kept.
_not_handled = (signal.SIG_DFL, signal.SIG_IGN, signal.default_int_handler)
if _name and signal.getsignal(getattr(signal, f"SIG{_name}")) in _not_handled:
    signal.signal(getattr(signal, f"SIG{_name}"), _record)


def _run_dir() -> Path | None:
    d = os.environ.get("HPC_TRAIN_RUN_DIR")
    return Path(d) if d else None


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def stop_requested() -> bool:
    """True on every rank once the job's stop signal reached any of them: one all-reduce when
    torch.distributed is initialised (call it on every rank at the same point of the loop)."""
    flag = _received[0]
    torch = sys.modules.get("torch")
    if torch is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
        nccl = torch.distributed.get_backend() == "nccl"
        t = torch.tensor([1 if flag else 0], device=f"cuda:{torch.cuda.current_device()}" if nccl else "cpu")
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        flag = bool(t.item())
    return flag


def log(step: int, loss: float | None = None, tokens: int | None = None, **more: Any) -> None:
    """Rank 0 appends a metrics.jsonl row (docs/metrics.md): step, loss, tokens seen, step time and tokens/s
    since the previous call, and any other numbers given. Other ranks do nothing."""
    run_dir = _run_dir()
    if run_dir is None or _rank() != 0:
        return
    now = time.time()
    row: dict[str, Any] = {"time": now, "step": int(step), **({"loss": float(loss)} if loss is not None else {})}
    if _last[0] and step > _last[1]:
        row["step_time_s"] = (now - _last[0]) / (step - _last[1])
    if tokens is not None:
        row["tokens_seen"] = int(tokens)
        if len(_last) > 2 and "step_time_s" in row:
            row["tokens_per_s"] = (tokens - _last[2]) / (now - _last[0])
    row.update(more)
    _last[:] = [now, int(step), *([int(tokens)] if tokens is not None else [])]
    append_line(RunPaths(run_dir).metrics, row)


def committed(step: int, path: str | os.PathLike[str]) -> None:
    """Rank 0 records that the checkpoint at `path` holds `step` and is complete (call it after the file is
    written and renamed into place): status shows the step the run resumes from, and the failure budget
    counts it as progress. Other ranks do nothing."""
    run_dir = _run_dir()
    if run_dir is None or _rank() != 0:
        return
    job, restart = os.environ.get("HPC_TRAIN_JOB_ID", ""), int(os.environ.get("HPC_TRAIN_RESTART_COUNT", "0"))
    journal.log(run_dir, journal.CHECKPOINT_COMMITTED, int(step), job, restart, path=str(path), reason="script")
