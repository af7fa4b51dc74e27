"""One `Task` per rank process: what the job side knows of itself beyond its RankEnv, made by job.run_job and
handed to the rendezvous, the watchdog, the failure path, Attempt, the script supervisor, the in-process rejoin and
the exit (torch-free). The job side keeps no other mutable state of its own."""

from __future__ import annotations

import dataclasses
import signal
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # not imported: preempt imports this module before the handlers go in (start.py)
    import subprocess


@dataclasses.dataclass
class Pulse:
    """This process's stop signals and heartbeat, written by its signal handlers (record) and its loop (beat), read
    by the hang watchdog, the failure path, Attempt, the script supervisor and the exit. One per process: the one
    its handlers record into, which install_handlers returns (job.run_job hands it on in the Task)."""

    received: list[str] = dataclasses.field(default_factory=list)  # the signals caught so far, in order
    received_at: list[float] = dataclasses.field(default_factory=list)  # time.monotonic() of each: the time to save
    last_beat: float = dataclasses.field(default_factory=time.monotonic)  # read by the hang watchdog (watchdog.py)
    step_reached: int = -1  # the last step the loop finished: what a failure event records
    # Heartbeats so far. Every rank beats at the same points (each step's end, after each micro-batch's forward,
    # each evaluation batch), so at a hang the rank whose count is behind the others' is the one that stopped;
    # the rest are blocked in a collective waiting for it (hung_ranks).
    ticks: int = 0
    installed_at: float = 0.0  # time.time() when the handlers went in: the "python" phase of a restart ends here

    def beat(self, step: int | None = None) -> None:
        self.last_beat = time.monotonic()
        self.ticks += 1
        if step is not None:
            self.step_reached = step

    def alive(self) -> None:
        """Progress that is not a step (checkpoint I/O moving bytes): the hang watchdog's clock restarts, but no
        tick is counted, since a hang's blame compares the ranks' ticks. Not once the watchdog was stood down."""
        if self.last_beat != float("inf"):
            self.last_beat = time.monotonic()

    def stand_down(self) -> None:
        """The hang watchdog has nothing left to watch (a verdict or the finish is being carried out)."""
        self.last_beat = float("inf")

    def record(self, signum: int, frame: object) -> None:
        """The signal handler: no I/O, no lock, no logging (it runs between any two bytecodes of the main thread)."""
        self.received_at.append(time.monotonic())
        self.received.append(signal.Signals(signum).name)


@dataclasses.dataclass
class Task:
    # The stop signals received and this process's heartbeat: the one its signal handlers record into
    # (preempt.install_handlers; a Task of a test's own has one no signal reaches).
    pulse: Pulse = dataclasses.field(default_factory=Pulse)
    # This task's RankEnv once placed by the rendezvous (ranks in topology order); None before: the failure path
    # and the watchdog then name Slurm's task numbering.
    placed: Any = None
    # This process claimed its attempt's failure: a second failing thread (the watchdog beside the main one) must
    # not end the process under the deciding one.
    deciding: bool = False
    # cluster.in_process_restart: this process's lock of its attempt's paths.alive file (rejoin.plan_rejoin reads
    # a free lock as a dead rank).
    alive_fd: int | None = None
    # checkpoint.memory_every_steps: this attempt's live memory tier (Attempt.build sets it), whose copies the
    # failure path abandons and cleans by the verdict (failure.clean_memory).
    memory: Any = None
    # A script run: this rank's child (script._launch), whose process group verdict.leave ends with the rank.
    child: subprocess.Popen[bytes] | None = None
