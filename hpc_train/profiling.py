"""profile.*: torch.profiler over a window of global steps, one Chrome/Perfetto trace per rank under the run's
profile/, and on a GPU a CUDA memory snapshot of the same steps.

    hpc-train submit profile.start_step=10 profile.active_steps=3                  # steps 10-12 on every rank
    hpc-train submit profile.start_step=10 profile.active_steps=3 profile.memory=true   # + memory (GPU)
    hpc-train report runs/demo-1                                                   # where they are, how to open

Attempt.step_end calls Profile.step after every optimizer step (and Attempt.resume once, at the step it
resumed from), so the built-in trainer and every function get it without a line of their own. The window
is in global step numbers: an attempt records the part of it that it runs, and one that resumes past it
records nothing. A stop inside the window (time limit, preemption) drops that attempt's recording: writing
a trace takes as long as it takes, and the stop save comes first. docs/profiling.md says how to read them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from hpc_train.config import ProfileConfig
from hpc_train.paths import MEMORY, TRACE, RunPaths, dir_mode, make_dir, write_atomic

log = logging.getLogger(__name__)

# CUDA allocator events kept for the snapshot (torch's own default): ~100 bytes each on the host, ~10 MB.
MEMORY_ENTRIES = 100_000


@dataclass
class Profile:
    cfg: ProfileConfig
    paths: RunPaths
    rank: int
    restart: int  # the attempt, in the file names
    cuda: bool
    say: Callable[[str], None]  # one line on rank 0's console
    share_with_group: bool = False
    torch: Any = None  # the running torch.profiler.profile inside the window; None outside it
    recorded_from: int = 0  # the first step this attempt records: start_step, or later after a resume inside

    @property
    def first(self) -> int:  # the first warm-up step
        return self.cfg.start_step - self.cfg.warmup_steps

    @property
    def last(self) -> int:
        return self.cfg.start_step + self.cfg.active_steps - 1

    def step(self, done: int, end: int | None = None, stopping: bool = False) -> None:
        """On every rank after step `done` (at resume: the step resumed from); the next step is done + 1, and
        `end` the run's last (step_end's last_step). Starts the profiler before the window's first step this
        attempt runs, steps it, and stops it after the window's last or the run's (the trace is written
        then). stopping: a stop signal, the recording is dropped."""
        if self.torch is not None:
            if stopping or done >= self.last or done == end:
                self.close(write=not stopping)
            else:
                self.torch.step()
        elif self.cfg.active_steps and self.first <= done + 1 <= self.last and not stopping and done != end:
            self._start(done)

    def _start(self, done: int) -> None:
        from torch.profiler import ProfilerAction, ProfilerActivity, profile

        first, start, last = self.first, self.cfg.start_step, self.last

        def action(step: int) -> ProfilerAction:  # of global step `step`, the one about to run
            if not first <= step <= last:
                return ProfilerAction.NONE
            if step < start:
                return ProfilerAction.WARMUP
            return ProfilerAction.RECORD if step < last else ProfilerAction.RECORD_AND_SAVE

        make_dir(self.paths.profile, dir_mode(self.share_with_group), exist_ok=True)
        self.recorded_from = max(start, done + 1)
        if self.cfg.memory and self.cuda:
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_ENTRIES)
        elif self.cfg.memory:
            self.say("profile.memory=true: no CUDA here, so no memory snapshot; the CPU trace is written")
        activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if self.cuda else [])]
        prof = profile(activities=activities, schedule=action, on_trace_ready=self._write)
        # The profiler counts steps from 0 and labels each "ProfilerStep#N": from the global step instead, so
        # a trace's steps are the run's. start() opens step `done` (action NONE); step() enters done + 1.
        prof.step_num = done
        prof.start()
        prof.step()
        self.torch = prof
        resumed = f" (this attempt resumed at step {done}, inside the window)" if done + 1 > first else ""
        self.say(f"profiling steps {self.recorded_from}-{last} on every rank{resumed}: traces in {self.paths.profile}")

    def _write(self, prof: Any) -> None:
        """on_trace_ready, from close()'s stop: steps recorded_from .. step_num (the step still open, the last
        label in the trace) -> this rank's files. One that cannot be written (disk full) costs a line, not the run."""
        steps = (self.restart, self.recorded_from, prof.step_num, self.rank)
        trace = self.paths.profile_file(*steps, TRACE)
        try:
            write_atomic(trace, prof.export_chrome_trace)
            if self.cfg.memory and self.cuda:
                write_atomic(self.paths.profile_file(*steps, MEMORY), torch.cuda.memory._dump_snapshot)
        except OSError as e:
            log.warning(f"profile: could not write {trace}: {e}")
            return
        self.say(
            f"profile of steps {steps[1]}-{steps[2]} written: one trace per rank, e.g. {trace} "
            f"(hpc-train report {self.paths.run_dir} says how to open them)"
        )

    def close(self, write: bool = True, first: str = "the stop save") -> None:
        """Stop the profiler if it runs: write what it recorded, or (write=False, a stop) drop it because
        `first` must not wait. At the window's end, at finish, before a stop save or a requeue decision;
        never raises (the stop path must go on)."""
        prof, self.torch = self.torch, None
        if prof is None:
            return
        if not write:
            prof.on_trace_ready = None
        try:
            prof.stop()
            if self.cfg.memory and self.cuda:
                torch.cuda.memory._record_memory_history(enabled=None)
        except Exception as e:  # a profiler fault must never cost a stop save, a requeue or a finish
            log.warning(f"profile: the profiler failed to stop: {e!r}")
        if not write:
            self.say(
                f"profile: a stop inside steps {self.first}-{self.last} (warm-up included): this "
                f"attempt's recording is dropped ({first} comes first); the attempt that resumes records the rest"
            )
