"""Every file of a run directory, named once (submitit's JobPaths is the model). Torch-free: the login
node (submit, status, report) and the job read and write the same names through this one object.

    runs/demo-1/
        config.yaml       the resolved config, frozen at submit; attempts re-read it, never recompose
        submission.json   executor, job id, overrides (local runs: the controller's pid and start time)
        code.json         which code validated it (version, package path, git commit); code.diff beside it
        submitit/         submitit's pickles and the per-task logs <job>_<task>_log.out
        checkpoints/      step_NNNNNN/ folders; only those with COMMITTED count
        events.jsonl      what happened, every attempt (docs/lifecycle.md lists the events)
        metrics.jsonl     loss, lr, step time per log interval
        summary.json      final_step, final_loss, params_sha256, written at the end
        placement.json    the rank order the planner chose
        drills/           fault drills armed by `hpc-train chaos` (kill-rank-during-save, slow-storage)
        profile/          profile.*: attempt_A.steps_F-L.rank_R.pt.trace.json per rank (+ .memory.pickle on GPU)
        after.json        the stages it was queued after (submit --after); dependents.jsonl: the runs queued after it
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import secrets
import stat
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MARKER = "COMMITTED"  # a checkpoint folder counts once this manifest is in it (checkpoint.py writes it last)
# The layout of a step folder that this code writes and reads (checkpoint.py): COMMITTED's "format". A
# manifest without one is format 1: every checkpoint written before the key existed has this layout.
FORMAT = 1
STEP_DIR = re.compile(r"step_(\d+)")
TRACE, MEMORY = "pt.trace.json", "memory.pickle"  # a profile's files: Perfetto / chrome://tracing; memory_viz
PROFILE_FILE = re.compile(r"attempt_(\d+)\.steps_(\d+)-(\d+)\.rank_(\d+)\.(pt\.trace\.json|memory\.pickle)")


@dataclass(frozen=True)
class RunPaths:
    run_dir: Path

    @property
    def config(self) -> Path:
        return self.run_dir / "config.yaml"

    @property
    def submission(self) -> Path:
        return self.run_dir / "submission.json"

    @property
    def code(self) -> Path:
        return self.run_dir / "code.json"

    @property
    def submitit(self) -> Path:
        return self.run_dir / "submitit"

    @property
    def checkpoints(self) -> Path:
        return self.run_dir / "checkpoints"

    @property
    def events(self) -> Path:
        return self.run_dir / "events.jsonl"

    @property
    def metrics(self) -> Path:
        return self.run_dir / "metrics.jsonl"

    @property
    def summary(self) -> Path:
        return self.run_dir / "summary.json"

    @property
    def history(self) -> Path:  # the site's fault rates as submit read them (intervals.py: checkpoint intervals)
        return self.run_dir / "history.json"

    @property
    def placement(self) -> Path:
        return self.run_dir / "placement.json"

    @property
    def nccl_trace(self) -> Path:  # NCCL's flight recorder dumps at a collective's timeout (env.nccl_env)
        return self.run_dir / "nccl_trace"

    @property
    def profile(self) -> Path:  # profile.*'s traces and memory snapshots (profiling.py)
        return self.run_dir / "profile"

    def profile_file(self, restart: int, first: int, last: int, rank: int, kind: str) -> Path:
        """One rank's trace (kind TRACE) or CUDA memory snapshot (MEMORY) of steps first..last. The attempt is
        in the name: an attempt that runs the same steps again (after a failure) writes beside, not over, it."""
        return self.profile / f"attempt_{restart}.steps_{first}-{last}.rank_{rank:05d}.{kind}"

    @property
    def report_png(self) -> Path:
        return self.run_dir / "report.png"

    @property
    def drills(self) -> Path:
        return self.run_dir / "drills"

    @property
    def after(self) -> Path:
        """The stages this run (or sweep) was queued after (`submit --after`), frozen at submit (pipeline.py)."""
        return self.run_dir / "after.json"

    @property
    def dependents(self) -> Path:
        """The runs queued after this one and their job ids, a line per queueing (pipeline.register)."""
        return self.run_dir / "dependents.jsonl"

    @property
    def lock(self) -> Path:
        """Held by `hpc-train resume` until the new job id and its `resume` event are recorded; a starting
        job reads its attempt number under it (shared)."""
        return self.run_dir / ".lock"

    @property
    def lease(self) -> Path:
        """Which job owns the run directory now (job.py): {job_id, host, expires_at}, renewed by its rank 0."""
        return self.run_dir / ".lease"

    def failure_claim(self, job_id: str, restart: int) -> Path:
        """Created O_EXCL by the first rank to fail in an attempt: that rank alone decides the requeue."""
        return self.run_dir / f".failed-{job_id}-{restart}"

    def rejoin_plan(self, job_id: str) -> Path:
        """cluster.in_process_restart: the deciding rank's plan for the next attempt in the same processes (who
        keeps its rank, which standby takes a dead one's; rejoin.plan_rejoin), rewritten at each one."""
        return self.run_dir / f".rejoin-{job_id}"

    def alive(self, job_id: str, restart: int) -> Path:
        """cluster.in_process_restart: one file per rank of an attempt, flocked by it for life (hold_for_life)."""
        return self.run_dir / f".alive-{job_id}-{restart}"

    def standbys(self, job_id: str) -> Path:
        """cluster.in_process_restart: one file per warm standby task (its Slurm task id), holding its node."""
        return self.run_dir / f".standby-{job_id}"


# A journal line waits at most this long for another writer's lock, then goes in unlocked: a holder that
# died on NFSv3 keeps its lock until its node reboots, and a rank blocked here would hang its attempt.
APPEND_LOCK_WAIT_S = 5.0


def append_line(path: Path, record: dict[str, Any]) -> None:
    """One line per record, in a single O_APPEND write (concurrent writers never interleave on a local file
    system), under an flock when one can be had within APPEND_LOCK_WAIT_S (NFS does not make O_APPEND
    atomic). No flock (ENOLCK, EIO after a lost NFS lock, anything else) never costs the line."""
    line = (json.dumps(record, sort_keys=True) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        with contextlib.suppress(OSError):
            _flock_within(fd, fcntl.LOCK_EX, APPEND_LOCK_WAIT_S)
        os.write(fd, line)
    finally:
        os.close(fd)  # releases the lock


def _flock_within(fd: int, operation: int, wait_s: float) -> bool:
    """flock within wait_s, trying every 10 ms; False when another holder kept it that long (other
    OSErrors raise: ENOLCK, EIO after a lost NFS lock, no flock on this file system)."""
    until = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, operation | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= until:
                return False
            time.sleep(0.01)


def write_atomic(
    path: Path,
    data: str | bytes | bytearray | memoryview | Callable[[str], object],
    private: bool = False,
    fsync: bool = False,
) -> None:
    """Whole or absent, for every file we write whole: a temp file of a random name in the same folder,
    created O_EXCL | O_NOFOLLOW (a planted symlink is never followed, two writers never share one), then
    os.replace. private: 0600, never readable by others, not for a moment; else 0644 less the umask (a
    default ACL's mask at most r--): never writable by group or others, whatever the umask (002 made it
    0664), and read by the group only as far as the run's folders let it (make_dir). The kernel applies
    the mode; the process umask is never touched (a job's other threads create checkpoint files
    meanwhile). fsync: the bytes are on disk before the name is (a commit marker must never name torn data).
    A callable `data` writes the temp file by its name itself (torch's export_chrome_trace, _dump_snapshot)."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(tmp, flags, 0o600 if private else 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            if callable(data):
                data(str(tmp))
            else:
                f.write(data.encode() if isinstance(data, str) else data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def locked(
    lock_file: Path, wait: bool = True, busy: str = "", shared: bool = False, wait_s: float | None = None
) -> Iterator[bool]:
    """flock on lock_file, a file never replaced (so every holder locks the same inode). wait=False: raise
    ValueError(busy) at once when another process holds it. wait_s: wait at most that long, then go on
    unlocked and yield False (a holder that died on NFSv3 keeps its lock until its node reboots); True
    otherwise. A file system without flock (Lustre mounted without -o flock) goes on unlocked, yielding
    True (no other process can hold it either): the lock narrows a race, nothing depends on it to be correct."""
    fd = os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o644)
    operation = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
    try:
        try:
            if wait_s is not None:
                ok = _flock_within(fd, operation, wait_s)
            else:
                fcntl.flock(fd, operation | (0 if wait else fcntl.LOCK_NB))
                ok = True
        except BlockingIOError:
            raise ValueError(busy) from None
        except OSError as e:
            if e.errno not in (errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP):
                raise
            ok = True
        yield ok
    finally:
        os.close(fd)  # closing releases the lock


# How long hold_for_life waits for a lock held by someone else: a probe's (holder_gone's) lasts microseconds.
HOLD_WAIT_S = 2.0


def hold_for_life(lock_file: Path) -> int | None:
    """flock lock_file and keep it (the fd stays open) while this process lives: its death frees it at once, so
    another node can tell a dead process from a slow one (holder_gone). None where the file system has no flock."""
    fd = os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o600)
    # Another node's holder_gone holds it for microseconds: wait that out (HOLD_WAIT_S), never block for good.
    deadline = time.monotonic() + HOLD_WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() < deadline:
                time.sleep(0.01)
                continue
            os.close(fd)
            return None
        except OSError:  # no flock on this file system
            os.close(fd)
            return None


def holder_gone(lock_file: Path) -> bool:
    """Whether the process that holds lock_file (hold_for_life) is gone: the lock is free. False when unknown (no
    such file, no flock; a lost node's lock on NFS stays until its lease ends, ~90 s)."""
    try:
        fd = os.open(lock_file, os.O_RDWR)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def dir_mode(share_with_group: bool) -> int:
    """0700, or 0750 with share_with_group: never writable by anyone else (docs/cluster.md, file modes)."""
    return 0o750 if share_with_group else 0o700


def make_dir(path: Path, mode: int = 0o700, exist_ok: bool = False) -> Path:
    """mkdir with exactly `mode` when this call creates it: mkdir's mode is masked by the umask (0750
    under umask 077 is 0700) and a default ACL's mask may grant more (group write under umask 002 or a
    project ACL), so chmod says it again. A folder that exists is left as it is: `untrusted` judges it
    before anything in it is unpickled."""
    try:
        path.mkdir(mode=mode & 0o700)  # no group or other bit until the chmod: nobody else is ever let in early
    except FileExistsError:
        if exist_ok and path.is_dir():
            return path
        raise
    os.chmod(path, mode)
    # A default ACL inherited from the project folder would give every file created in here (submitit's
    # job pickle: 0664 through the ACL mask, whatever the umask) group write, and the job refuses such a
    # pickle: files in what we own take their mode from us alone.
    with contextlib.suppress(OSError):
        os.removexattr(path, "system.posix_acl_default")
    return path


def untrusted(path: Path, top: Path) -> str:
    """ "" when `path` and every folder from it up to `top` (inclusive; `path` alone when it is not under
    `top`) are owned by this user (or root, who can run anything as anyone already) and writable by no
    one else; else what is wrong, with the fix. Asked before anything there is unpickled (DCP's .metadata,
    submitit's job pickle): a pickle runs its author's code as whoever loads it, and a folder another user
    can write lets them replace the file after it was checked. A default ACL's named entries show in the
    group bits (the ACL mask), so `mode & 0o022` covers them. Follows symlinks: what is read is judged."""
    import pwd

    me = os.geteuid()
    chain = [path, *(p for p in path.parents if p.is_relative_to(top))] if path.is_relative_to(top) else [path]
    for p in chain:
        try:
            st = os.stat(p)
        except OSError as e:
            return f"{p}: {e.strerror}"
        if st.st_uid not in (me, 0):
            try:
                who = f"{pwd.getpwuid(st.st_uid).pw_name} (uid {st.st_uid})"
            except KeyError:
                who = f"uid {st.st_uid}"
            return (
                f"{p} is owned by {who}, not by you (uid {me}): loading it would run their code as you; "
                f"remove it, or copy it as yourself (cp -r) if you trust them"
            )
        if st.st_mode & 0o022:
            return (
                f"{p} is writable by {'group' if st.st_mode & 0o020 else 'others'} (mode "
                f"{stat.S_IMODE(st.st_mode):04o}): someone else could have replaced what is loaded from it; "
                f"chmod go-w {p} if all in it is yours"
            )
    return ""


def profile_files(root: Path) -> list[tuple[int, int, int, int, str, Path]]:
    """(attempt, first step, last step, rank, kind, path) of every profile file under root, in that order."""
    if not root.is_dir():
        return []
    found = [(p, PROFILE_FILE.fullmatch(p.name)) for p in root.iterdir()]
    return sorted((int(m[1]), int(m[2]), int(m[3]), int(m[4]), m[5], p) for p, m in found if m)


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:06d}"  # 7+ digits past step 999,999: every reader sorts by number


def step_folders(root: Path) -> dict[int, Path]:
    """Every step folder under root by its step, in numeric order (step_1000000 after step_999980)."""
    if not root.is_dir():
        return {}
    found = {int(m.group(1)): p for p in root.iterdir() if (m := STEP_DIR.fullmatch(p.name)) and p.is_dir()}
    return dict(sorted(found.items()))


def read_marker(folder: Path) -> dict[str, Any] | None:
    """The COMMITTED manifest, or None when it is missing, torn, or not of our shape (never raises): every
    entry a plain file name in this folder with an int size and a sha256, DCP's .metadata and one rank
    file per rank among them, an int world size, an int format if any (marker_format). A foreign or damaged
    manifest is skipped, not trusted."""
    try:
        marker = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(marker, dict) or not isinstance(marker.get("files"), dict):
        return None
    files, world = marker["files"], marker.get("world_size")
    shaped = all(
        isinstance(n, str)
        and Path(n).name == n
        and n not in (".", "..")
        and isinstance(e, dict)
        and type(e.get("bytes")) is int
        and e["bytes"] >= 0
        and isinstance(e.get("sha256"), str)
        for n, e in files.items()
    )
    complete = (
        type(marker.get("format", 1)) is int
        and type(world) is int
        and world >= 1
        and ".metadata" in files
        and all(f"rank_{r:05d}.pt" in files for r in range(world))
    )
    return marker if shaped and complete else None


def marker_format(marker: dict[str, Any]) -> int:
    """The layout a manifest read_marker accepted describes; FORMAT is the one this code reads."""
    return int(marker.get("format", 1))
