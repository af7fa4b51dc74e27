"""`hpc-train logs`: one rank's stdout and stderr of a run, one attempt of them, or followed (-f) until
the run ends. Torch-free (login node).
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hpc_train import slurm
from hpc_train.runs import Run, denied, local_pid


def log_path(run: Run, rank: int) -> Path:
    """submitit's file for this rank: <job>_<rank>_log.out, or <array>_<task>_<rank>_log.out."""
    path = run.log_dir / f"{run.job_id}_{rank}_log.out"
    if run.log_dir.exists() and not os.access(run.log_dir, os.R_OK | os.X_OK):  # else exists() says False
        raise ValueError(denied(run.log_dir))
    if not path.exists():
        raise ValueError(
            f"no log for rank {rank} of {run.label} at {path}; has the job started? "
            f"(ranks: {sorted(p.name for p in run.log_dir.glob(f'{run.job_id}_*_log.out'))})"
        )
    return path


# job.py's header of each attempt, where it began mid-line: a script killed between a line's text and its
# newline (unbuffered, print writes them apart; a script without a handler dies at the stop signal)
_HEADER_MID_LINE = re.compile(r"(?<=[^\n])(==== hpc_train attempt \d+ rank \d+ ====)")


def attempt_section(text: str, attempt: int | None) -> str:
    """The lines of one attempt: each attempt's ranks print `==== hpc_train attempt K rank R ====` first;
    one that began mid-line starts a line of its own here."""
    text = _HEADER_MID_LINE.sub(r"\n\1", text)
    if attempt is None:
        return text
    out, inside = [], False
    for line in text.splitlines(keepends=True):
        if line.startswith("==== hpc_train attempt "):
            inside = line.split()[3] == str(attempt)
        if inside:
            out.append(line)
    return "".join(out)


def stderr_path(out: Path) -> Path:
    """The rank's stderr beside its stdout: <job>_<rank>_log.err (tracebacks, warnings, stack dumps)."""
    return out.with_name(out.name.removesuffix(".out") + ".err")


def has_output(text: str) -> bool:
    """More than the attempt headers job.py prints to both streams."""
    return any(line.strip() and not line.startswith("==== hpc_train attempt ") for line in text.splitlines())


# Slurm states after which nothing more is written to a job's logs. Not PREEMPTED: our jobs are requeued.
FINAL_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "BOOT_FAIL", "DEADLINE")


# `logs -f` stops after squeue and sacct have both known nothing of the job for this long: a job id never
# recorded, or one that left accounting. 60 s: sacct may lag a fresh sbatch by a few seconds, never a minute.
UNKNOWN_GIVE_UP_S = 60.0


def run_ended(run: Run, unknown_since: list[float] | None = None) -> bool:
    """Whether the run's ranks will write no more: a local controller that is gone (it outlives every
    attempt of its ranks), or a Slurm job in a final state (a requeue goes through PENDING, not final).
    With unknown_since (a list this keeps its first time in): also once Slurm has not known the job for
    UNKNOWN_GIVE_UP_S, saying so on stderr."""
    if run.executor != "slurm":
        return local_pid(run) is None
    try:
        state = slurm.job_states([run.job_id], retries=0).get(run.job_id, "")
    except Exception:  # no answer this time: keep following, ask again at the next check
        return False
    if state or unknown_since is None:
        if unknown_since:
            unknown_since.clear()
        return state.rstrip("+") in FINAL_STATES
    unknown_since[:] = unknown_since or [time.monotonic()]
    if time.monotonic() - unknown_since[0] < UNKNOWN_GIVE_UP_S:
        return False
    print(
        f"hpc-train logs: stopped following: neither squeue nor sacct has known job "
        f"{run.job_id or '(none recorded)'} for {UNKNOWN_GIVE_UP_S:.0f} s (never queued, or gone from "
        f"accounting); see `hpc-train status {run.run_dir}`",
        file=sys.stderr,
        flush=True,
    )
    return True


def follow(
    streams: list[tuple[Path, int, str]],
    last_label: str,
    ended: Callable[[], bool],
    check_every_s: float,
    every_s: float = 0.5,
) -> None:
    """`tail -f` of several files (path, bytes already shown, label), each chunk under its label whenever
    the stream changes; returns on Ctrl-C, or once ended() says nothing more will be written and what
    was written before that is shown."""
    files: dict[Path, Any] = {}
    next_check = 0.0  # at once: following a run that has ended prints what is left and returns
    try:
        while True:
            done = False
            if time.monotonic() >= next_check:  # asked before reading, so the last read sees every last line
                done, next_check = ended(), time.monotonic() + check_every_s
            quiet = True
            for path, offset, label in streams:
                if path not in files:
                    if not path.exists():
                        continue
                    files[path] = open(path, errors="replace")  # noqa: SIM115  (closed below)
                    files[path].seek(offset)
                chunk = files[path].read()
                if chunk:
                    if label != last_label:
                        print(label, flush=True)
                        last_label = label
                    print(chunk, end="", flush=True)
                    quiet = False
            if done:
                return
            if quiet:
                time.sleep(every_s)
    except KeyboardInterrupt:
        return
    finally:
        for f in files.values():
            f.close()
