"""The batch step's supervisor: it runs the training step's srun and stands between it and Slurm.

    exec python -u .../hpc_train/relay.py STEP_END_S STEP_KILL_S BEAT_S srun-options... FOLDER
    # what the batch script's srun() does (sbatch_templates/signal_relay.sh); FOLDER is srun's last word

Torch-free and stdlib only, run by its path: it imports nothing of hpc_train, so it starts in ~40 ms and
owns every file it shares with the ranks (the relaunch marker, the finished file, the beat), written and read
by the functions below.

Why a supervisor: Slurm sends some signals to the batch shell only (--signal=B:, scancel --batch, a
preemption under preempt_send_user_signal); untrapped, USR2 or TERM would end the job before any rank
saves. This process takes both and passes them on to srun as USR2, which srun forwards to every task: TERM
goes on as USR2 because srun (22.05, _srun_signal_mgr) answers its own TERM with SIGKILL to every task. The
ranks read the USR2 by the clock (preempt.stop_reason). A signal waits until srun has its handlers in
(/proc/PID/status, ~10 ms after its start): before that USR2 would end srun and the step would never start.

With hot spares (HPC_TRAIN_STEP_ARGS, exported by the batch script of a job with cluster.spare_nodes):
- the step runs --no-kill --kill-on-bad-exit=0, so a lost node's tasks die and not the deciding rank;
- the deciding rank writes FOLDER/.relaunch-JOBID (write_marker) holding the next step's srun options; read
  once and removed, so a crash loop ends within requeue.max_in_job_restarts;
- the ranks that finished the run write FOLDER/.finished-JOBID (write_finished): the job's status is 0 though
  a task an in-process restart replaced died (srun's 137);
- once either is there the step gets STEP_END_S to end, then srun a TERM (SIGKILL to every task, a stopped
  one too), then STEP_KILL_S before SIGKILL to srun itself (a task in D state);
- while the step runs this writes the time into FOLDER/.relay-JOBID every BEAT_S: a deciding rank that finds
  it silent (beat_at, requeue.relay_silent_s) takes this node for lost and requeues instead. The beat and the
  looks for both files run in a thread of their own (Watch): NFS holding one never holds a signal.
A signal that came while one step ended goes to the next as HPC_TRAIN_PENDING_SIGNAL=SIGUSR2@<Unix s>, the
time it came (preempt.install_handlers reads it).
"""

from __future__ import annotations

import os
import signal
import sys
import time


class Relay:
    """What the signal handler records (the first stop signal not yet handed to a step, and whether srun has
    not got it yet); the loop acts on it (STYLE 7: a handler only records)."""

    def __init__(self) -> None:
        # "SIGUSR2@<Unix s>": kept until a launch hands it to the next step; the batch shell's trap recorded one
        # that came during the setup
        self.pending = os.environ.get("HPC_TRAIN_PENDING_SIGNAL", "")
        self.undelivered = 0  # the signal of the running step's srun has not been sent yet: its number

    def on_signal(self, signum: int, _frame: object) -> None:
        self.pending = self.pending or f"SIGUSR2@{int(time.time())}"
        self.undelivered = signum


if __name__ == "__main__":  # handlers first: a USR2 in this process's first ms would end the job unsaved
    RELAY = Relay()
    for stop in (signal.SIGUSR2, signal.SIGTERM):
        signal.signal(stop, RELAY.on_signal)

import logging  # noqa: E402  after the handlers: ~30 ms of imports
import re  # noqa: E402
import stat  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
from pathlib import Path  # noqa: E402

log = logging.getLogger("hpc_train.relay")
STOP_SIGNALS = {signal.SIGUSR2, signal.SIGTERM}
POLL_S = 0.1  # how soon a recorded signal reaches srun
LOOK_S = 1.0  # how often the marker and the finished file are looked for (two stats: cheap on NFS too)
# A signal waits for srun's handlers at most this long, then goes anyway: srun 22.05 has them within ~10 ms;
# a site's srun wrapper that never catches USR2 would otherwise hold the signal for good.
SRUN_READY_WAIT_S = 10.0
# The only words a marker may hold: what decision._relaunch writes. They become srun options, and a
# group-writable folder must not let a teammate add --task-prolog or --export to this user's step.
MARKER_OPTIONS = re.compile(r"--nodes=[0-9]+ --ntasks=[0-9]+( --exclude=[A-Za-z0-9._,-]+)?")


def relaunch_marker(folder: Path, job_id: str) -> Path:
    """The next training step's srun options after an in-job restart. In submitit's folder, the one path the
    batch shell knows (srun's last word); SLURM_JOB_ID, an array task's own id, keeps a sweep's tasks apart."""
    return Path(folder) / f".relaunch-{job_id}"


def finished_file(folder: Path, job_id: str) -> Path:
    return Path(folder) / f".finished-{job_id}"


def beat_file(folder: Path, job_id: str) -> Path:
    return Path(folder) / f".relay-{job_id}"


def _write_new(path: Path, text: str) -> None:
    """Whole or absent: a fresh temp file of ours (O_EXCL: never through a name a teammate planted in a
    group-writable folder), then renamed over path."""
    fd, tmp = tempfile.mkstemp(prefix=f"{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_marker(folder: Path, job_id: str, options: str) -> None:
    """The deciding rank's relaunch: the next step's srun options (MARKER_OPTIONS, else ValueError)."""
    if not MARKER_OPTIONS.fullmatch(options):
        raise ValueError(f"relaunch options {options!r} are not --nodes=N --ntasks=N [--exclude=NODES]")
    _write_new(relaunch_marker(folder, job_id), options + "\n")


def write_finished(folder: Path, job_id: str) -> None:
    _write_new(finished_file(folder, job_id), "finished\n")


def _ours(path: Path) -> bool:
    """A plain file of this user (a symlink or a teammate's file is never acted on)."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid()


def _there(path: Path) -> bool:
    """path exists; an error of the file system (ESTALE, EIO, EACCES of an expired Kerberos ticket: Path.exists
    raises them) is "not yet", asked again a second later, never the batch step's end under a running srun."""
    try:
        return path.exists()
    except OSError:
        return False


def _remove(path: Path) -> bool:
    """Remove path if it is there: False (said) when the file system will not now (the file is left; _ours and
    the job id keep another job from acting on it)."""
    try:
        path.unlink(missing_ok=True)
        return True
    except OSError as e:
        log.warning("cannot remove %s (%s); left", path, e)
        return False


def beat_at(folder: Path, job_id: str) -> float | None:
    """When the relay last wrote its beat (Unix s, the batch host's clock); None when unknown: no such file (a
    batch script from before it, or between two steps), a symlink, a file of another user, not a positive
    number."""
    beat = beat_file(folder, job_id)
    try:
        os.listdir(folder)  # NFS: revalidates the folder, so the name finds the newest rename, not a cached one
        if not _ours(beat):
            return None
        at = float(beat.read_text().strip())  # an open and a read: fresh on NFS (close-to-open)
    except (OSError, ValueError):
        return None
    return at if at > 0 else None


def take_marker(folder: Path, job_id: str) -> str:
    """The next step's srun options from the marker, which is removed; "" when there is none to act on."""
    marker = relaunch_marker(folder, job_id)
    if not os.path.lexists(marker):
        return ""
    options = ""
    if not _ours(marker):
        log.warning("%s is not a plain file owned by this user; not relaunching on it", marker)
    else:
        try:
            options = marker.read_text().split("\n", 1)[0]
        except OSError as e:
            log.warning("cannot read %s (%s); not relaunching on it", marker, e)
        if options and not MARKER_OPTIONS.fullmatch(options):
            log.warning("%s holds other than the srun options hpc_train writes; not relaunching on it", marker)
            options = ""
    # a marker left in place would end the relaunched step too (its look below), and relaunch it again: once
    return options if _remove(marker) else ""


def takes_usr2(pid: int) -> bool:
    """srun has its USR2 handler in (caught, blocked for its signal thread, or ignored): a USR2 no longer
    ends it. Unknown (no /proc) counts as yes."""
    try:
        with open(f"/proc/{pid}/status") as f:
            masks = [int(line.split()[1], 16) for line in f if line.startswith(("SigBlk:", "SigIgn:", "SigCgt:"))]
    except (OSError, ValueError, IndexError):
        return True
    bit = 1 << (signal.SIGUSR2 - 1)
    return any(mask & bit for mask in masks)


def _status(returncode: int) -> int:
    """A shell's view of srun's end: 128 + N for a death by signal N (what the batch script used to return)."""
    return 128 - returncode if returncode < 0 else returncode


class Watch:
    """A spares step's folder I/O, in a thread of its own: a beat write or a look that NFS holds for seconds
    never holds a signal on its way to srun. Writes the beat every beat_s and looks for the marker and the
    finished file every LOOK_S until either is there (`why` then says which); once `stop` is set, removes the
    beat itself, so that a write the file server held past the step's end cannot bring a stale beat back."""

    def __init__(self, folder: Path, job_id: str, beat_s: float) -> None:
        self.folder, self.job_id, self.beat_s = folder, job_id, beat_s
        self.why = ""
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="relay-watch", daemon=True)

    def _run(self) -> None:
        next_beat = next_look = time.monotonic()
        while not self.stop.is_set():
            try:
                next_beat, next_look = self._once(next_beat, next_look)
            except Exception:  # never a silent death: the marker and the finish would go unseen
                log.exception("the relay's look at %s failed; trying again", self.folder)
                next_beat = next_look = time.monotonic() + LOOK_S
            self.stop.wait(max(0.0, min(next_beat, next_look) - time.monotonic()))
        beat = beat_file(self.folder, self.job_id)
        try:
            stale = [beat, *self.folder.glob(f"{beat.name}.*")]  # a relaunch writes it anew at once
        except OSError:
            stale = [beat]
        for path in stale:
            _remove(path)

    def _once(self, next_beat: float, next_look: float) -> tuple[float, float]:
        """One round of the folder's I/O; returns when the next beat and the next look are due."""
        now = time.monotonic()
        if self.why:  # the step is ending: no more beats, nothing more to look for
            return now + LOOK_S, now + LOOK_S
        if now >= next_beat:
            next_beat = now + self.beat_s
            try:
                _write_new(beat_file(self.folder, self.job_id), f"{int(time.time())}\n")
            except OSError:
                pass  # a full disk: a deciding rank reads the beat as silent and requeues
        if now >= next_look:
            next_look = now + LOOK_S
            if _there(relaunch_marker(self.folder, self.job_id)):
                self.why = "its relaunch marker"
            elif _there(finished_file(self.folder, self.job_id)):
                self.why = f"its run's finish ({finished_file(self.folder, self.job_id).name})"
        return next_beat, next_look


def run_step(relay: Relay, srun: list[str], folder: Path, job_id: str, spares: bool, limits: tuple[float, ...]) -> int:
    """One training step, to its end: the recorded signals passed on; with spares, the beat and the end of a
    step that outlives its marker or its run's finish (Watch). Returns srun's status."""
    end_s, kill_s, beat_s = limits
    # Taken with the signals held: one that comes meanwhile is not lost between the read and the reset, but
    # recorded as soon as they are let through, and sent to this step's srun.
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    env = {**os.environ, "HPC_TRAIN_PENDING_SIGNAL": relay.pending}
    relay.pending, relay.undelivered = "", 0
    watch = Watch(folder, job_id, beat_s) if spares else None
    if watch:  # started under the mask, which it keeps: the kernel hands the stop signals to this thread only
        watch.thread.start()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # before the launch: srun would inherit the mask
    proc = subprocess.Popen(srun, env=env)
    started = time.monotonic()
    end_at = kill_at = killed_at = None
    while proc.poll() is None:
        now = time.monotonic()
        if relay.undelivered and (takes_usr2(proc.pid) or now - started > SRUN_READY_WAIT_S):
            if relay.undelivered == signal.SIGTERM:
                log.info("the batch shell got SIGTERM; sent SIGUSR2 to srun, which would turn TERM into SIGKILL")
            relay.undelivered = 0
            proc.send_signal(signal.SIGUSR2)
        if watch and end_at is None and watch.why:
            end_at = now + end_s
        elif end_at is not None and kill_at is None and now >= end_at:
            log.warning(
                "the training step did not end within %g s of %s; sent srun SIGTERM, which kills every task",
                end_s,
                watch.why if watch else "",
            )
            proc.terminate()
            kill_at = now + kill_s
        elif kill_at is not None and killed_at is None and now >= kill_at:
            log.warning(
                "srun still runs %g s after SIGTERM, a task stuck in D state?; sent srun SIGKILL, so Slurm "
                "kills the step",
                kill_s,
            )
            proc.kill()
            killed_at = now
        time.sleep(POLL_S)
    if watch:  # it removes the beat as it ends; a write NFS still holds finishes first
        watch.stop.set()
        watch.thread.join(timeout=LOOK_S + 1)
    return _status(proc.returncode)


def _seconds(environ: dict[str, str], name: str, default: str) -> float:
    """A deadline the site may set (+cluster.env.NAME=SECONDS); one that is no number is said and the table's
    taken: the training must not fail for it before it starts."""
    try:
        return float(environ.get(name) or default)
    except ValueError:
        log.warning("%s=%r is not a number of seconds; taking %s (set it as e.g. 90)", name, environ[name], default)
        return float(default)


def supervise(relay: Relay, argv: list[str], environ: dict[str, str]) -> int:
    """The batch step: the training step, relaunched inside the allocation as long as its decision says so.
    Returns the job's exit status: the last srun's, or 0 once the ranks finished the run."""
    limits = (
        _seconds(environ, "HPC_TRAIN_STEP_END_S", argv[0]),
        _seconds(environ, "HPC_TRAIN_STEP_KILL_S", argv[1]),
        float(argv[2]),
    )
    srun_args = argv[3:]
    folder, job_id = Path(srun_args[-1]), environ.get("SLURM_JOB_ID", "")
    options = environ.get("HPC_TRAIN_STEP_ARGS", "")
    spares = bool(options)
    if spares:  # a requeued job's leftovers: never act on them
        _remove(relaunch_marker(folder, job_id))
        _remove(finished_file(folder, job_id))
    while True:
        # --no-kill: a failed node's tasks die, not the step's; --kill-on-bad-exit=0: a site's KillOnBadExit=1
        # would kill every task at the first one to die, the deciding one too
        extra = ["--no-kill", "--kill-on-bad-exit=0", *options.split()] if spares else []
        status = run_step(relay, ["srun", *extra, *srun_args], folder, job_id, spares, limits)
        if not spares:
            return status
        if status != 0:  # NFS: a listing revalidates the folder (close-to-open) after another node wrote in it
            try:
                os.listdir(folder)
            except OSError:
                pass
        if _ours(finished_file(folder, job_id)):  # the run finished; a task that died after is no fault
            _remove(finished_file(folder, job_id))
            _remove(relaunch_marker(folder, job_id))
            return 0
        options = take_marker(folder, job_id)
        if not options:
            return status
        log.info("training step ended with status %d; relaunching it inside the allocation: srun %s", status, options)


def main(relay: Relay, argv: list[str]) -> None:
    """The one way out of the batch step: srun's status (or the finished run's 0) as the job's, by os._exit."""
    logging.basicConfig(level=logging.INFO, format="hpc_train relay: %(message)s", stream=sys.stderr)
    try:
        status = supervise(relay, argv, dict(os.environ))
    except Exception as e:  # srun not on PATH, a folder gone: one sentence in the job's log, not a traceback
        log.error("the training step could not run: %s: %s", type(e).__name__, e)
        status = 1
    logging.shutdown()
    # os._exit, not sys.exit: the interpreter's shutdown puts USR2 and TERM back at their default, so a stop
    # signal in its last ms would end the job by signal 12 (3 times in 5 in the test of a signal every 20 ms)
    os._exit(status)


if __name__ == "__main__":
    main(RELAY, sys.argv[1:])
