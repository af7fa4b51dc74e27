"""The job side's logging: every module logs through `logging.getLogger(__name__)`, a child of "hpc_train", and each
task puts one pair of handlers on "hpc_train" (configure): INFO to stdout, warnings and errors to stderr (a Slurm
task's two are one file), every line "[hpc_train rank R] ..." so that a merged log says which rank spoke. Not the
root logger: a user's function keeps its own logging as it set it up (torch's, Lightning's, its own).

    [hpc_train rank 0] placed task 2 as rank 0 on node3
    [hpc_train rank 1] warning: job 41 took this run's lease
    step 20/30  loss 4.1162  val 4.0920  lr 1.40e-03  gnorm 0.826  99.3 ms/step  10,314 tok/s  mfu n/a

The last is the loop's step line (PROGRESS), rank 0's only, unprefixed so that it fits 100 columns.

Torch-free; imports logging and sys only.
"""

from __future__ import annotations

import logging
import os
import sys
import types
from typing import Any, TextIO

LOGGER = "hpc_train"
# The loop's step line, rank 0's console row: unprefixed, so that it fits 100 columns (19 more would not).
PROGRESS = "hpc_train.progress"


def _lower_level(record: logging.LogRecord) -> bool:
    record.level_word = record.levelname.lower()  # "warning", "error": read as a sentence's first word
    return True


def _current(name: str) -> Any:
    """sys.stdout or sys.stderr as it is when a line is written, not when configure ran (a test's capture swaps it)."""
    return types.SimpleNamespace(
        write=lambda text: getattr(sys, name).write(text), flush=lambda: getattr(sys, name).flush()
    )


def configure(rank: int | str, stdout: TextIO | None = None, stderr: TextIO | None = None) -> None:
    """(Re)install this task's handlers with `rank` in their prefix: at the task's start (Slurm's task number, or
    "?"), again once placement has named its rank (rendezvous.join, a rejoin). Idempotent: the earlier pair goes."""
    enable()
    logger, progress = logging.getLogger(LOGGER), logging.getLogger(PROGRESS)
    for lg in (logger, progress):
        for handler in [h for h in lg.handlers if getattr(h, "hpc_train", False)]:
            lg.removeHandler(handler)
    out = logging.StreamHandler(stdout or _current("stdout"))
    out.addFilter(lambda record: record.levelno < logging.WARNING)
    out.setFormatter(logging.Formatter(f"[hpc_train rank {rank}] %(message)s"))
    err = logging.StreamHandler(stderr or _current("stderr"))
    err.setLevel(logging.WARNING)
    err.addFilter(_lower_level)
    err.setFormatter(logging.Formatter(f"[hpc_train rank {rank}] %(level_word)s: %(message)s"))
    plain = logging.StreamHandler(stdout or _current("stdout"))
    for lg, handler in ((logger, out), (logger, err), (progress, plain)):
        handler.hpc_train = True  # type: ignore[attr-defined]  # ours to replace, not a handler a user added
        lg.addHandler(handler)
        lg.setLevel(logging.INFO)
        lg.propagate = False  # a user's root handlers would print every line a second time


def enable() -> None:
    """Every `hpc_train` logger on again: a user's function that calls logging.config.dictConfig (its default
    disable_existing_loggers=True) silences every logger that exists by then, ours too, and the stop's or the
    finish's lines would vanish. Called after the function returns or raises, and by configure."""
    for name, logger in list(logging.root.manager.loggerDict.items()):
        if (name == LOGGER or name.startswith(LOGGER + ".")) and isinstance(logger, logging.Logger):
            logger.disabled = False


def header(attempt: int, rank: int) -> None:
    """The line `hpc-train logs --attempt` cuts a rank's log at, written raw (not a log record: a marker) once per
    file: to stdout, and to stderr where it is another file (a Slurm job's two are one: stderr_to_stdout, where
    the header came out twice)."""
    try:
        same = os.path.samestat(os.fstat(sys.stdout.fileno()), os.fstat(sys.stderr.fileno()))
    except (OSError, ValueError, AttributeError):  # a stream without a file (a test's capture)
        same = False
    for stream in [sys.stdout] if same else [sys.stdout, sys.stderr]:
        print(f"==== hpc_train attempt {attempt} rank {rank} ====", file=stream, flush=True)
