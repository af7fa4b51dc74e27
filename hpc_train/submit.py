"""What plan.py planned, written and queued: freeze run directories -> submitit -> job ids recorded.

Torch-free: this is the login-node path. A single run gets `<out_dir>/<name>-<n>/`; a sweep gets
`<out_dir>/<name>-<n>/` holding `sweep.json` and one run directory per trial, `0000/`, `0001/`, ...
Directories are keyed by sweep and trial index, never by time or job id, so a requeued attempt and a
resubmitted sweep always find them.

A run directory holds everything a (re)started attempt needs and everything it leaves:
    config.yaml      the resolved config, frozen at submit; attempts re-read it, never recompose
    code.json        which code validated it: version, package path, git commit (provenance.py)
    code.diff        uncommitted changes to tracked files at submit, if any (a sweep: in the sweep dir)
    submission.json  executor, job id, overrides
    submitit/        submitit's pickles and the per-task logs (<job>_<task>_log.out)
    checkpoints/     step_NNNNNN/ folders; only those with COMMITTED count
    events.jsonl     start / signal / checkpoint_committed / requeue / finish / fail, every attempt
    metrics.jsonl    loss, lr and step time per log interval
    summary.json     final_step, final_loss, params_sha256 (written at the end)
    init_from/       checkpoint.init_from's step folder, hardlinked at submit (source.json: the original)
    after.json       the stages it is queued after (--after; a sweep's in the sweep dir), frozen (pipeline.py)
    .lock            held by `hpc-train resume` until the new job id is recorded (sweep.json.lock: a sweep's)
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from hpc_train import journal, pipeline, status
from hpc_train.paths import STEP_DIR, RunPaths, locked, make_dir, untrusted, write_atomic
from hpc_train.plan import MANIFEST, Array, Plan, Trial, job_name, next_dir
from hpc_train.sbatch import make_executor


def claim_dir(wanted: Path, mode: int = 0o700) -> Path:
    """mkdir without exist_ok, so two submits never share a directory; on a race take the next n. out_dir
    itself keeps the umask's mode: it is the project's folder, which a team may share."""
    wanted.parent.mkdir(parents=True, exist_ok=True)
    while True:
        try:
            make_dir(wanted, mode)
            return wanted
        except FileExistsError:
            wanted = next_dir(wanted.parent, wanted.name.rsplit("-", 1)[0])


def _submitit_dir(folder: Path, private: bool, mode: int) -> Path:
    """Made before submitit writes the batch script, pickles and logs into it: 0700 when private (the
    script holds cluster.env), else `mode`. Raises ValueError when it, or the run or sweep directory
    holding it, is another user's or writable by others: start.py would refuse the job pickle in it."""
    make_dir(folder, 0o700 if private else mode, exist_ok=True)
    why = untrusted(folder, folder.parent)
    if why:
        raise ValueError(f"{why}; the job would refuse to load its pickle from {folder}")
    return folder


def frozen_yaml(config: dict[str, Any]) -> str:
    """config.yaml's text: exactly _yaml_dump(config), PyYAML's safe dump never folding a line (a long
    setup line stays one line), ~30x faster for the plain tree a composed config is. PyYAML's representer is
    Python even with libyaml, 0.5 ms a config, 5 s of a 10,000-point sweep; here each distinct scalar is
    rendered once by PyYAML itself and the block layout is written directly. A tree with anything else (a
    list holding containers, a key that is not a short word, a scalar PyYAML spreads over lines) is dumped
    whole by PyYAML."""
    lines: list[str] = []
    try:
        _yaml_block(config, "", lines)
    except (_NotPlain, TypeError):  # TypeError: an unhashable value PyYAML may still know (a set)
        return _yaml_dump(config)
    return "".join(lines) if lines else _yaml_dump(config)


class _NotPlain(Exception):
    pass


_YAML_KEY = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}")


def _yaml_dump(tree: Any) -> str:
    import yaml

    dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)  # libyaml where installed
    return yaml.dump(tree, Dumper=dumper, sort_keys=False, width=2**31 - 1)  # libyaml's width is a C int


# Scalars as PyYAML writes them after `key: ` (or before `:`), by type and value (1, 1.0 and True are equal in
# Python), a float by its repr (0.0 == -0.0); None for what is not plain (a key: not a short word).
_YAML_SCALARS: dict[tuple[type, Any, bool], str | None] = {}


def _yaml_scalar(value: Any, key: bool = False) -> str:
    cache = (type(value), repr(value) if type(value) is float else value, key)
    if cache not in _YAML_SCALARS:
        text = _yaml_dump({"k": value})
        plain = text.startswith("k: ") and text.count("\n") == 1
        if key:
            plain = plain and type(value) is str and _YAML_KEY.fullmatch(value) is not None
        if len(_YAML_SCALARS) > 100_000:  # a 100,000-point sweep over distinct strings
            _YAML_SCALARS.clear()
        _YAML_SCALARS[cache] = text[3:-1] if plain else None
    text = _YAML_SCALARS[cache]
    if text is None:
        raise _NotPlain
    return text


def _yaml_block(tree: dict[str, Any], indent: str, out: list[str]) -> None:
    """PyYAML's block style: a nested mapping indented 2 more, a list's items at its key's indent."""
    for key, value in tree.items():
        head = indent + _yaml_scalar(key, key=True) + ":"
        if type(value) is dict:
            if value:
                out.append(head + "\n")
                _yaml_block(value, indent + "  ", out)
            else:
                out.append(head + " {}\n")
        elif type(value) is list:
            out.append(head + "\n" if value else head + " []\n")
            for item in value:
                if type(item) in (dict, list):
                    raise _NotPlain
                out.append(indent + "- " + _yaml_scalar(item) + "\n")
        else:
            out.append(head + " " + _yaml_scalar(value) + "\n")


def _freeze(
    run_dir: Path, config: dict[str, Any], private: bool, mode: int, code: str, like: Path | None = None
) -> Path | None:
    """config.yaml and code.json, written once: a resubmit never overwrites what an attempt may already
    have read, and a job started by newer code says so (job.py compares code.json). `like`: a code.json
    this submit wrote with the same text, which this one becomes a hard link to: a sweep's trials share
    one file, as creating a file costs ~0.3 ms of kernel time on the dev machine's ext4 and a link ~10 us
    (every writer of code.json replaces it, never edits it in place). Returns the file the next trial may
    link to."""
    make_dir(run_dir, mode, exist_ok=True)
    if not (run_dir / "config.yaml").exists():
        write_atomic(run_dir / "config.yaml", frozen_yaml(config), private)
    path = RunPaths(run_dir).code
    if path.exists():  # perhaps older code's: never a link source
        return like
    if like is not None:
        try:
            os.link(like, path)
            return like
        except OSError:  # EMLINK (ext4 stops at 65,000 links), or no hard links on this file system
            pass
    write_atomic(path, code, private)
    return path


def _freeze_rates(target: Path, p: Plan) -> None:
    """history.json: the site's rates as this submit read them, for checkpoint.every_steps=auto (the job asks no
    sacct), each partition's for a sweep over them; a resubmit keeps the first."""
    if (p.rates is not None or p.elsewhere) and not RunPaths(target).history.exists():
        from hpc_train import history, intervals

        rates = p.rates or history.DEFAULTS  # trial 0's partition's could not be read: what the job takes then
        intervals.write_rates(RunPaths(target).history, rates, p.private, p.forecast, p.expected, p.elsewhere)


def _freeze_trial(t: Trial, config: dict[str, Any], p: Plan, code: str, like: Path | None) -> Path | None:
    """_freeze of a sweep's trial, and its brief (status.brief) from the config it holds now: a resubmit keeps
    a frozen trial's (conf/ may have changed since), a folder made again gets its new config's."""
    frozen = (Path(t.run_dir) / "config.yaml").exists()
    like = _freeze(Path(t.run_dir), config, p.private, p.dir_mode, code, like)
    t.brief = t.brief if frozen else status.brief(config)
    return like


def _code_identity(target: Path, private: bool) -> str:
    """code.json's text, computed once per submit (3 git calls, ~10 ms); the diff, if any, goes to
    <target>/code.diff once, not into each of a sweep's trials."""
    from hpc_train import provenance

    record, diff = provenance.identity()
    if diff:
        record["diff_file"] = str(target / "code.diff")
        if not (target / "code.diff").exists():  # owner-only always: a diff may hold what was never committed
            write_atomic(target / "code.diff", provenance.capped(diff), private=True)
    return json.dumps(record, indent=1) + "\n"


# Model fields that set a parameter's shape (n_heads only regroups the same q/k/v matrix).
def _link_or_copy(src: str, dst: str) -> None:
    """A link to a file of ours no one else can write; a copy (ours, 0600) of anything else: the job
    refuses to unpickle a file another user owns or can write (paths.untrusted), and a link would let
    them change it after this submit."""
    st = os.stat(src)
    if st.st_uid == os.geteuid() and not st.st_mode & 0o022:
        try:
            os.link(src, dst)  # instant, no space; the source run deleting its folder leaves this name
            return
        except OSError:  # another file system (EXDEV)
            pass
    shutil.copyfile(src, dst)
    os.chmod(dst, 0o600)


def pin_init_from(target: Path, configs: list[dict[str, Any]], mode: int = 0o700) -> None:
    """Each checkpoint.init_from step folder hardlinked (else copied) into <target>/init_from/<6 hex of its
    path>/, with source.json naming the original, and the frozen config pointed there: the source run's
    retention may delete its folder before this job starts (a job can wait in the queue for days). The
    copy is made under a random name (mkdtemp: never a path someone planted) and renamed whole."""
    import hashlib
    import tempfile

    for c in configs:
        source = c["checkpoint"].get("init_from")
        # a run directory: a stage of --after, whose final checkpoint the job finds when it starts (plan.py)
        if not source or Path(source).is_relative_to(target) or not STEP_DIR.fullmatch(Path(source).name):
            continue
        pinned = target / "init_from" / hashlib.sha1(source.encode()).hexdigest()[:6] / Path(source).name
        if not pinned.exists():  # a resubmitted sweep pinned it already
            make_dir(make_dir(target / "init_from", mode, exist_ok=True) / pinned.parent.name, mode, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{pinned.name}.", dir=pinned.parent))
            shutil.copytree(source, tmp, copy_function=_link_or_copy, dirs_exist_ok=True)
            os.chmod(tmp, mode)  # copytree gave it the source folder's mode
            os.replace(tmp, pinned)  # whole or absent: the COMMITTED marker never appears in a partial copy
            write_atomic(pinned.parent / "source.json", json.dumps({"init_from": source}) + "\n", private=False)
        c["checkpoint"]["init_from"] = str(pinned)


def _load_manifest(sweep_dir: Path, overrides: list[str], trials: list[Trial]) -> list[Array] | None:
    path = sweep_dir / MANIFEST
    if not path.exists():
        return None
    old = json.loads(path.read_text())
    if old["overrides"] != overrides or [t["overrides"] for t in old["trials"]] != [t.overrides for t in trials]:
        raise ValueError(
            f"{sweep_dir} holds a sweep of {old['overrides']}, not {overrides}; resubmit it with "
            f"the same overrides, or drop --sweep-dir to start a new sweep"
        )
    for t, saved in zip(trials, old["trials"]):
        t.job_id, t.process, t.brief = saved["job_id"], saved.get("process"), saved.get("brief")
    return [Array(**a) for a in old["arrays"]]


def _save_manifest(p: Plan, overrides: list[str], changed: list[int] | None = None) -> None:
    """The caller holds sweep.json.lock (submit, from reading the manifest to its last save). A trial an
    `hpc-train resume` queued before keeps the job id it recorded (those with previous_job_ids).

    Saved twice per array, so O(arrays x trials) work in all: it was quadratic (a 10,000-point sweep in
    10 arrays wrote and re-read the whole manifest ~40 times). Now the file is read again only when
    another process replaced it since this one wrote it, and each trial's and array's JSON line is
    rendered again only when its job id, process or state changed (index, overrides and run_dir are fixed
    once the sweep directory is claimed). One trial per line, so the file stays readable at 100,000.
    `changed`: the trials this submit changed since its last save, which alone are looked at (a loop over
    100,000 trials, 200 times, was 10 s of a 100,000-point sweep); None: every trial."""
    path = p.target / MANIFEST
    written = p.written
    signature = _signature(path)
    if "records" not in written or signature != written["signature"]:  # first save, or rewritten by another process
        disk = json.loads(path.read_text())["trials"] if signature else []
        written.update(records={t["index"]: t for t in disk}, lines={}, arrays={})
        changed = None
    records, lines, array_lines = written["records"], written["lines"], written["arrays"]
    for t in p.trials if changed is None else (p.trials[i] for i in changed):
        saved = records.get(t.index, {})
        if saved.get("previous_job_ids"):  # resumed: its record wins, and this submit learns it
            t.job_id, t.process = saved["job_id"], saved.get("process")
        if t.index not in lines or saved.get("job_id") != t.job_id or saved.get("process") != t.process:
            records[t.index] = {**saved, **vars(t)}  # only serialized: no deep copy (asdict) needed
            lines[t.index] = json.dumps(records[t.index])
    for a in p.arrays:
        key = (len(a.trials), a.job_id, a.submitting)  # an array's trials never change once it exists
        cached = array_lines.get(id(a))
        if cached is None or cached[0] is not a or cached[1] != key:  # the array object kept: ids are not reused
            array_lines[id(a)] = (a, key, json.dumps(vars(a)))
    head = {"sweep_dir": str(p.target), "job_name": job_name(p.target), "overrides": overrides}
    head["updated_at"] = time.time()
    text = (
        json.dumps(head, indent=1)[: -len("\n}")]
        + ',\n "trials": [\n  '
        + ",\n  ".join(lines[t.index] for t in p.trials)
        + '\n ],\n "arrays": [\n  '
        + ",\n  ".join(array_lines[id(a)][2] for a in p.arrays)
        + "\n ]\n}\n"
    )
    write_atomic(path, text, p.private)
    written["signature"] = _signature(path)


def _signature(path: Path) -> tuple[int, int, int] | None:
    """Which version of a file this is: a replace (new inode) or an edit in place (size, mtime) changes it."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


# submitit's process_job waits this long for its task's pickle, then fails the task.
SUBMITIT_PICKLE_WAIT_S = 60


def adopt_lost_job(target: Path, run_dirs: list[str], known: set[str], executor: Any) -> str | None:
    """The job a submit or resume queued and never recorded (sbatch timed out after queueing, or the command
    died between sbatch and the record): the one job under this target's job name that neither its
    manifests nor `known` record. Gives each of its tasks (one per run_dirs, in order) the pickle submitit
    would have renamed into place, so none waits 60 s for it and fails. Returns its id, or None when there
    is no such job or several (then queue anew: a cancelled one was given up on)."""
    from hpc_train import slurm

    found = slurm.jobs_named(job_name(target)) - _manifest_ids(target) - {i.split("_")[0] for i in known if i}
    if len(found) != 1:
        return None
    job_id = found.pop()
    for k, run_dir in enumerate(run_dirs):  # submitit queues a lone trial as a plain job
        task = f"{job_id}_{k}" if len(run_dirs) > 1 else job_id
        _write_task_pickle(target / "submitit" / f"{task}_submitted.pkl", run_dir, executor)
    return job_id


def _adopt_lost_array(p: Plan, array: Array, executor: Any) -> bool:
    """adopt_lost_job for a sweep's array. Trials whose task already ended without starting (it waited 60 s
    for a pickle, or was cancelled) go into a new array appended to p.arrays, so every trial runs, or is
    queued again, exactly once."""
    from hpc_train import slurm

    known = {a.job_id for a in p.arrays if a.job_id}  # incl. trials' resumed jobs, which the manifest has
    job_id = adopt_lost_job(p.target, [p.trials[i].run_dir for i in array.trials], known, executor)
    if job_id is None:
        return False
    array.job_id, array.submitting = job_id, False
    for k, i in enumerate(array.trials):
        p.trials[i].job_id = f"{job_id}_{k}" if len(array.trials) > 1 else job_id
    written = time.time()
    queued = slurm.queued_tasks(job_name(p.target))
    started = {i for i in array.trials if journal.named(journal.read(Path(p.trials[i].run_dir)), journal.START)}
    # A task that gave up on its pickle just before it was written dies within seconds: look again 10 s
    # after writing when a task still waiting may have been queued that long (Slurm's start <= python's).
    if any(
        queued.get(p.trials[i].job_id, written) <= written - SUBMITIT_PICKLE_WAIT_S + 10
        for i in array.trials
        if i not in started
    ):
        time.sleep(max(0.0, written + 10 - time.time()))
        queued = slurm.queued_tasks(job_name(p.target))
    ended = [i for i in array.trials if i not in started and p.trials[i].job_id not in queued]
    for i in ended:
        p.trials[i].job_id = None
    if ended:
        p.arrays.append(Array(trials=ended))
    return True


def record_job(
    target: Path, run_dir: Path, job_id: str, process: dict[str, Any] | None, private: bool, **fields: Any
) -> None:
    """The one writer of one run's job id: its trial's line in the sweep's sweep.json, else the run's
    submission.json (with `fields`). The id it replaces joins previous_job_ids, where status, cancel and
    adopt_lost_job still find it. A sweep's submit records many trials at once through _save_manifest.
    The caller holds the lock of what it writes (sweep.json.lock, or the run's .lock)."""
    if (target / MANIFEST).exists() and target != run_dir:  # a sweep's trial
        path = target / MANIFEST
        manifest, mode = json.loads(path.read_text()), path.stat().st_mode & 0o777
        for t in manifest["trials"]:
            if Path(t["run_dir"]) == run_dir:
                t["previous_job_ids"] = [*t.get("previous_job_ids", []), *([t["job_id"]] if t["job_id"] else [])]
                t["job_id"], t["process"] = job_id, process
        write_atomic(path, json.dumps(manifest, indent=1) + "\n", private)
        os.chmod(path, mode)  # as submit made it: shared, or owner-only
        return
    path = RunPaths(run_dir).submission
    record = json.loads(path.read_text()) if path.exists() else {}
    if record.get("job_id"):
        record["previous_job_ids"] = [*record.get("previous_job_ids", []), record["job_id"]]
    record.update(job_id=job_id, job_name=job_name(target), **fields)
    if process:  # a local job's id is its controller's pid, which the OS reuses
        record["process"] = process
    write_atomic(path, json.dumps(record, indent=1) + "\n", private)


def _manifest_ids(target: Path) -> set[str]:
    """Every job id sweep.json or submission.json records (base ids), now or before a resume."""
    ids: list[str] = []
    for name in (MANIFEST, "submission.json"):
        if (target / name).exists():
            record = json.loads((target / name).read_text())
            for r in [record, *record.get("trials", []), *record.get("arrays", [])]:
                ids += [r.get("job_id") or "", *r.get("previous_job_ids", [])]
    return {i.split("_")[0] for i in ids if i}


def _write_task_pickle(path: Path, run_dir: str, executor: Any) -> None:
    """The pickle submitit would have renamed into place after sbatch: the same call, the same timeout."""
    import cloudpickle
    from submitit.core.utils import DelayedSubmission

    from hpc_train.job import run_job

    if path.exists():
        return
    delayed = DelayedSubmission(run_job, run_dir)
    delayed.set_timeout(executor.parameters.get("time", 5), executor.max_num_timeout)  # as map_array does
    write_atomic(path, cloudpickle.dumps(delayed))  # a waiting task never loads half a pickle


# Held from just before sbatch until the job id is on disk: Ctrl-C, and the hang-up a closed terminal or a
# dropped ssh session sends the whole process group (sbatch too). SIGTERM is not held: the local
# executor's controller inherits the mask, and `hpc-train cancel` stops it with SIGTERM.
HELD_SIGNALS = (signal.SIGINT, signal.SIGHUP)


@contextlib.contextmanager
def _owner_writes_only() -> Iterator[None]:
    """The umask at least 022 while submitit writes the job pickle, batch script and logs (open() with
    0666: 0664 under umask 002), and so for the job: the local controller inherits it, sbatch passes it
    on (SLURM_UMASK). start.py refuses a job pickle the group could write. Only ever adds bits to the
    mask, so no file another thread creates meanwhile gets more permissive than it asked."""
    old = os.umask(0o077)  # the strictest while reading it: 022 for an instant loosened an old 077
    os.umask(old | 0o022)
    try:
        yield
    finally:
        os.umask(old)


@contextlib.contextmanager
def _interrupts_held() -> Iterator[None]:
    """Ctrl-C waits from just before sbatch until the job id is on disk (submission.json, sweep.json): in
    between it would leave a queued job that no file names, so status, cancel and resume could not find it.
    Blocked in this thread, so sbatch (a child: it inherits the mask) is not killed mid-request either; a
    handler records one that another thread (the progress bar) takes. Raised as KeyboardInterrupt after."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    # one ignored already stays so (a `hpc-train submit &` from a script, nohup): held, it was caught when it
    # reached another thread and dropped when still pending at the unblock below (a test under nohup: rc 0 or 130)
    held = {s for s in HELD_SIGNALS if signal.getsignal(s) is not signal.SIG_IGN}
    previous = {s: signal.signal(s, lambda sig, _: caught.append(sig)) for s in held}
    signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, held)  # a pending one is delivered here
    if signal.SIGHUP in caught:
        os.kill(os.getpid(), signal.SIGHUP)
    if signal.SIGINT in caught:
        raise KeyboardInterrupt


@contextlib.contextmanager
def _stdio_to_devnull() -> Iterator[None]:
    """The local executor's controller inherits our stdout/stderr and outlives us: holding them, it would
    keep `hpc-train submit --no-wait | tee log` (or a test's pipe) open until the job ends. Its own
    output goes to the per-task log files. It also inherits SIGINT and SIGHUP ignored, as do its ranks
    (Python keeps an inherited SIG_IGN): a Ctrl-C at the terminal, or closing it, reaches the whole
    foreground process group, and must stop only `hpc-train submit` waiting, never the run."""
    saved = [os.dup(1), os.dup(2)]
    handlers = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGHUP)}
    sys.stdout.flush()
    sys.stderr.flush()
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, devnull):
            os.close(fd)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def _sbatch_with_retry(submit_once: Callable[[], Any], what: str, attempts: int = 4, backoff_s: float = 1.0) -> Any:
    """sbatch through submitit, retried after 1, 2, 4 s when it fails (controller down or overloaded);
    each failure is reported on stderr, and the last one raises with what to do next."""
    from hpc_train.slurm import SlurmError

    for attempt in range(attempts):
        try:
            return submit_once()
        except Exception as e:  # submitit wraps sbatch's failure; its text says why
            reason = " ".join(str(e).split())[:300]
            if attempt == attempts - 1:
                raise SlurmError(f"sbatch failed {attempts} times for {what}: {reason}") from e
            print(
                f"hpc-train submit: sbatch failed for {what} ({reason}); retrying in {backoff_s * 2**attempt:.0f} s",
                file=sys.stderr,
                flush=True,
            )
            time.sleep(backoff_s * 2**attempt)


def submit(
    p: Plan,
    overrides: list[str],
    multirun: bool = False,
    sweep_dir: Path | None = None,
    max_parallel: int | None = None,
    progress: Callable[[int, int], None] | None = None,
    claimed: bool = False,
) -> tuple[Plan, list[Any]]:
    """Write and queue what plan() validated. Returns (the plan with job ids, submitit jobs submitted now).
    `claimed`: a single run's p.target is a folder the caller claimed already (claim_dir; hydra_launch.run_alone)."""
    if not multirun:
        run_dir = p.target = p.target if claimed else claim_dir(p.target, p.dir_mode)
        p.trials[0].run_dir = str(run_dir)
        # From the claim to the recorded job id: a resume meanwhile would find no job and queue a second.
        with locked(RunPaths(run_dir).lock, wait=False, busy=_busy(run_dir)):
            return _submit_run(p, overrides)

    # A sweep: one lock from reading the manifest to recording the last job id, so a second submit on
    # this sweep directory, or a resume of one of its trials, never queues a trial this one is queueing.
    if sweep_dir is None:
        p.target = claim_dir(p.target, p.dir_mode)
        for t in p.trials:
            t.run_dir = str(p.target / Path(t.run_dir).name)
    else:
        p.target.parent.mkdir(parents=True, exist_ok=True)
        make_dir(p.target, p.dir_mode, exist_ok=True)
        why = untrusted(p.target, p.target)  # before anything is written into another user's sweep
        if why:
            raise ValueError(f"--sweep-dir {p.target}: {why}")
    with locked(p.target / (MANIFEST + ".lock"), wait=False, busy=_busy(p.target)):
        return _submit_sweep(p, overrides, sweep_dir, max_parallel, progress)


def _busy(target: Path) -> str:
    return (
        f"{target} is being submitted or resumed by another hpc-train command right now; wait for it to "
        f"return, then see what it queued with hpc-train status {target}"
    )


def _submit_run(p: Plan, overrides: list[str]) -> tuple[Plan, list[Any]]:
    from hpc_train.job import run_job

    first, run_dir = p.runs[0], p.target
    pin_init_from(run_dir, p.configs, p.dir_mode)
    _freeze(run_dir, p.configs[0], p.private, p.dir_mode, _code_identity(run_dir, p.private))
    pipeline.freeze_after(run_dir, p.after, p.private)
    _freeze_rates(run_dir, p)
    submitit_dir = _submitit_dir(run_dir / "submitit", p.private, p.dir_mode)
    executor = make_executor(first.cluster, submitit_dir, job_name(run_dir), dependency=p.dependency)
    with _interrupts_held(), _owner_writes_only():
        with _stdio_to_devnull() if first.cluster.executor == "local" else contextlib.nullcontext():
            job = _sbatch_with_retry(lambda: executor.submit(run_job, str(run_dir)), str(run_dir))
        p.trials[0].job_id = p.arrays[0].job_id = str(job.job_id)
        process = None
        if first.cluster.executor == "local":
            from hpc_train.runs import process_identity

            process = process_identity(int(job.job_id))
        record_job(
            run_dir,
            run_dir,
            str(job.job_id),
            process,
            p.private,
            executor=first.cluster.executor,
            submitted_at=time.time(),
            overrides=overrides,
        )
    _tell_stages(p, [0])
    return p, [job]


def _tell_stages(p: Plan, queued: list[int]) -> None:
    """The stages of --after learn the trials just queued after them (pipeline.register), to cancel or release them
    if they stop for good."""
    queued_now = {p.trials[i].run_dir: str(p.trials[i].job_id) for i in queued if p.trials[i].job_id}
    for warning in pipeline.register(p.after, queued_now) if p.after and queued_now else []:
        print(f"hpc-train submit: warning: {warning}", file=sys.stderr)


def _submit_sweep(
    p: Plan,
    overrides: list[str],
    sweep_dir: Path | None,
    max_parallel: int | None,
    progress: Callable[[int, int], None] | None,
) -> tuple[Plan, list[Any]]:
    """Freeze every trial, record the manifest, then one sbatch per array; the caller holds sweep.json.lock."""
    if sweep_dir is not None:
        saved = _load_manifest(p.target, overrides, p.trials)
        if saved is not None:
            p.arrays = saved
    code = _code_identity(p.target, p.private)
    pipeline.freeze_after(p.target, p.after, p.private)  # one file for every trial (pipeline.after_file)
    _freeze_rates(p.target, p)  # one file for every trial too (intervals.read_rates)
    pin_init_from(p.target, p.configs, p.dir_mode)
    like = None
    for t in p.trials:
        like = _freeze_trial(t, p.configs[t.index], p, code, like)
    _save_manifest(p, overrides)
    jobs: list[Any] = []
    done = sum(1 for t in p.trials if t.job_id)
    for array in p.arrays:  # grows when an adopted array's tasks ended unstarted
        todo = [i for i in array.trials if not p.trials[i].job_id]
        if not todo or array.job_id:
            array.job_id = array.job_id or (p.trials[array.trials[0]].job_id or "").split("_")[0] or None
            array.submitting = False
            continue
        cluster = p.runs[todo[0]].cluster
        folder = _submitit_dir(p.target / "submitit", p.private, p.dir_mode)
        executor = make_executor(cluster, folder, job_name(p.target), max_parallel, p.dependency)
        lost = array.submitting and cluster.executor == "slurm"  # queued, but its id never reached the manifest
        if lost and _adopt_lost_array(p, array, executor):
            _save_manifest(p, overrides)
            _tell_stages(p, array.trials)
            continue
        array.submitting = True
        _save_manifest(p, overrides, changed=[])
        run = _run_local_trial if cluster.executor == "local" else _queue_array
        new = run(p, array, todo, executor, overrides)
        _tell_stages(p, todo)
        if not new:  # adopted: the job ids are recorded already
            continue
        jobs += new
        done += len(todo)
        if progress:
            progress(done, len(p.trials))
    _save_manifest(p, overrides, changed=[])  # the arrays skipped above: their state, no trial's
    return p, jobs


def _run_local_trial(p: Plan, array: Array, todo: list[int], executor: Any, overrides: list[str]) -> list[Any]:
    """The local executor: this machine is the cluster, one trial at a time; returns its job once it ended."""
    from hpc_train.job import run_job
    from hpc_train.runs import process_identity

    with _interrupts_held(), _owner_writes_only():
        with _stdio_to_devnull():
            new = [executor.submit(run_job, p.trials[todo[0]].run_dir)]
        # recorded before waiting: status, cancel and resume tell this controller from a later pid's owner
        p.trials[todo[0]].job_id = str(new[0].job_id)
        p.trials[todo[0]].process = process_identity(int(new[0].job_id))
        array.job_id, array.submitting = str(new[0].job_id), False
        _save_manifest(p, overrides, changed=todo)
    # Waits for the trial's end, never unpickling its result (a failed trial is in its events.jsonl)
    with contextlib.suppress(Exception):
        new[0].wait()
    return new


def _queue_array(p: Plan, array: Array, todo: list[int], executor: Any, overrides: list[str]) -> list[Any]:
    """One sbatch of the array's `todo` trials, their ids recorded; [] when a lost try's array was adopted instead
    (its ids recorded by _adopt_lost_array)."""
    from hpc_train.job import run_job

    what = (
        f"trials {todo[0]}..{todo[-1]} of {p.target} (the manifest has what is queued: rerun the same "
        f"command with --sweep-dir {p.target} to submit the rest)"
    )
    tried: list[int] = []

    def queue_array() -> list[Any]:
        # A try that timed out may still have queued the array: look it up before trying again.
        if tried and _adopt_lost_array(p, array, executor):
            return []
        tried.append(1)
        return executor.map_array(run_job, [p.trials[i].run_dir for i in todo])

    with _interrupts_held(), _owner_writes_only():
        new = _sbatch_with_retry(queue_array, what)
        for i, job in zip(todo, new):
            p.trials[i].job_id = str(job.job_id)
        if new:  # one save per sbatch records the trials' and the array's ids (two saved the same twice)
            array.job_id, array.submitting = str(new[0].job_id).split("_")[0], False
        _save_manifest(p, overrides, changed=todo if new else None)  # adopted: ids set elsewhere
    return new
