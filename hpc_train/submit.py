"""compose -> validate -> freeze run directories -> group trials into arrays -> submitit -> sweep.json.

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
    .lock            held by `hpc-train resume` until the new job id is recorded (sweep.json.lock: a sweep's)
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import shutil
import signal
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpc_train import journal
from hpc_train.config import ConfigSource, RunConfig, check_environment, compose_trials, expand_sweep
from hpc_train.paths import RunPaths, dir_mode, locked, make_dir, untrusted, write_atomic
from hpc_train.sbatch import ClusterConfig, check_syntax, make_executor, render, validate_live

MANIFEST = "sweep.json"


@dataclass
class Trial:
    index: int
    overrides: list[str]
    run_dir: str
    job_id: str | None = None
    process: dict[str, Any] | None = None  # a local trial: runs.process_identity of its controller


@dataclass
class Array:
    """Trials with one resource request, submitted by one sbatch call (one array, or one plain job)."""

    trials: list[int]
    job_id: str | None = None
    submitting: bool = False  # set before sbatch, cleared after: a crash in between is recoverable


@dataclass
class Plan:
    target: Path  # the run directory of a single run, or the sweep directory
    trials: list[Trial]
    configs: list[dict[str, Any]]
    runs: list[RunConfig]
    arrays: list[Array] = field(default_factory=list)
    scripts: list[str] = field(default_factory=list)  # rendered batch script per array (Slurm only)
    unvalidated: str = ""  # a dry run with no controller answering: why the live checks were skipped
    unchecked: list[str] = field(default_factory=list)  # live checks that could not run (slurmdbd down)
    # What _save_manifest last wrote (each record and its JSON line), so a save re-serializes only what changed
    written: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @functools.cached_property
    def private(self) -> bool:
        """Owner-only files (0600, submitit/ 0700) when any cluster.env value is set: config.yaml, the
        manifests and the batch script then hold it, and cluster.env is where API keys go. Not always:
        runs sit in shared project folders, where teammates' `hpc-train status` should keep working. Computed
        once: asked per trial, the scan over every run made freezing a 10,000-point sweep quadratic."""
        return any(r.cluster.env for r in self.runs)

    @functools.cached_property
    def dir_mode(self) -> int:
        """The mode of every folder this submit creates: 0750 only when every trial asks to share_with_group."""
        return dir_mode(all(r.share_with_group for r in self.runs))


def next_dir(out_dir: Path, name: str) -> Path:
    """<out_dir>/<name>-<n> with the next free n (not created)."""
    taken = [int(p.name.rsplit("-", 1)[1]) for p in out_dir.glob(f"{name}-*") if p.name.rsplit("-", 1)[1].isdigit()]
    return (out_dir / f"{name}-{max(taken, default=0) + 1}").resolve()


def job_name(target: Path) -> str:
    """`<dir name>.<6 hex of its path>`: readable in squeue, unique across out_dirs, so a lost array can
    be found again by its name."""
    import hashlib

    return f"{target.name}.{hashlib.sha1(str(target).encode()).hexdigest()[:6]}"


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
SHAPE_FIELDS = ("vocab_size", "seq_len", "d_model", "n_layers")


def init_from_checkpoint(path: str, config: dict[str, Any]) -> Path:
    """checkpoint.init_from=PATH -> the committed step folder it names: PATH itself, or the newest committed
    one under a run directory or its checkpoints/. Raises ValueError when there is none, or when the source
    run's config.yaml has another model shape than `config` (both the built-in trainer). The job verifies
    the files' checksums before loading (reading them all here would take as long as a resume)."""
    import yaml

    from hpc_train.paths import MARKER, STEP_DIR, read_marker, step_folders

    p = Path(path).expanduser().resolve()
    if STEP_DIR.fullmatch(p.name):
        if read_marker(p) is None:
            raise ValueError(
                f"checkpoint.init_from={path}: {p} has no valid {MARKER} manifest (a save that never "
                f"finished, or not a checkpoint); give a committed step folder, or the run directory "
                f"for its newest"
            )
        folder = p
    else:
        root = p / "checkpoints" if (p / "checkpoints").is_dir() else p
        committed = [f for f in step_folders(root).values() if read_marker(f) is not None]
        if not committed:
            raise ValueError(
                f"checkpoint.init_from={path}: no committed checkpoint under {root} (no step_*/{MARKER}); "
                f"give a run directory that saved one, or one of its step folders"
            )
        folder = committed[-1]
    source_config = folder.parent.parent / "config.yaml"
    theirs = yaml.safe_load(source_config.read_text()) if source_config.is_file() else None
    if theirs and not (theirs.get("fn") or {}).get("_target_") and not config["fn"].get("_target_"):
        model = theirs.get("model") or {}
        differ = [k for k in SHAPE_FIELDS if k in model and model[k] != config["model"][k]]
        if differ:
            wrong = "; ".join(f"model.{k}={config['model'][k]} but the checkpoint has {model[k]}" for k in differ)
            raise ValueError(
                f"checkpoint.init_from={path}: {wrong} (its run's {source_config}); set "
                f"{' '.join(f'model.{k}={model[k]}' for k in differ)}, or drop checkpoint.init_from to "
                f"train from scratch"
            )
    return folder


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
        if not source or Path(source).is_relative_to(target):
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


def group_arrays(runs: list[RunConfig], max_array_size: int) -> list[Array]:
    """Trials grouped by identical resource request, each group split at MaxArraySize (pure)."""
    groups: dict[str, list[int]] = {}
    for i, run in enumerate(runs):
        # vars, not asdict (which deep-copies, 0.1 ms a run): ClusterConfig holds no nested dataclass
        groups.setdefault(json.dumps(vars(run.cluster), sort_keys=True), []).append(i)
    return [
        Array(trials=idx[k : k + max_array_size]) for idx in groups.values() for k in range(0, len(idx), max_array_size)
    ]


def previous_runs(p: Plan) -> list[Path]:
    """The runs whose measurements predict this one: the sweep's trials on a resubmit, else the newest
    earlier run directory of the same name."""
    if (p.target / MANIFEST).exists():
        return [Path(t.run_dir) for t in p.trials]
    earlier = [d for d in p.target.parent.glob(f"{p.target.name.rsplit('-', 1)[0]}-*") if d.is_dir() and d != p.target]
    return [max(earlier, key=lambda d: d.stat().st_mtime)] if earlier else []


def plan(
    overrides: list[str],
    multirun: bool,
    sweep_dir: Path | None = None,
    max_parallel: int | None = None,
    source: ConfigSource = ConfigSource(),
    validate: bool = True,
    dry_run: bool = False,
) -> Plan:
    """Everything up to, not including, writing and submitting. Raises ValueError on any bad input."""
    from hpc_train import slurm

    trial_overrides = expand_sweep(overrides, multirun)
    composed = compose_trials(trial_overrides, source)
    # This machine: fn._target_ importable, the compiler, data.path's meta.json; asked once per distinct
    # question (a 10,000-point sweep over train.lr asks one), and the vocab size raised to the data's frozen.
    asked: dict[str, int] = {}
    for c, r in composed:
        question = repr((r.train.compile, r.fn._target_, r.metrics, r.data, r.train.eval_every_steps, r.model))
        if question not in asked:
            check_environment(r)
            asked[question] = r.model.vocab_size
        r.model.vocab_size = c["model"]["vocab_size"] = asked[question]
    configs, runs = [c for c, _ in composed], [r for _, r in composed]
    for c in configs:  # a requeued attempt may start in another directory: freeze the data path absolute
        if c["data"].get("path"):
            c["data"]["path"] = str(Path(c["data"]["path"]).resolve())
        if c["checkpoint"].get("init_from"):  # frozen as one step folder: every attempt starts from the same
            c["checkpoint"]["init_from"] = str(init_from_checkpoint(c["checkpoint"]["init_from"], c))
    first: ClusterConfig = runs[0].cluster
    if first.slurm_conf:
        slurm.slurm_env(first.slurm_conf)
    if first.executor == "slurm" and any(r.cluster.executor != "slurm" for r in runs):
        raise ValueError("a sweep must use one executor; sweep cluster= over Slurm clusters only")
    target = sweep_dir.resolve() if sweep_dir else next_dir(Path(runs[0].out_dir), runs[0].name)
    trials = [Trial(i, o, str(target / f"{i:04d}") if multirun else str(target)) for i, o in enumerate(trial_overrides)]
    result = Plan(target, trials, configs, runs)
    if first.executor == "local":
        result.arrays = [Array(trials=[i]) for i in range(len(runs))]  # local trials run one at a time
        return result
    facts = [["scontrol", "show", "partition", "-o"], ["scontrol", "show", "node", "-o"]] if validate else []
    facts += [["scontrol", "show", "config"]] if multirun else []
    if dry_run:  # answer in seconds without a controller (each client call would retry for ~40 s): one ping
        result.unvalidated = slurm.unreachable()
    # Asked now, read once the scripts are rendered (submitit's import, ~25 ms): the round trips overlap it.
    if not result.unvalidated:
        slurm.prefetch(*facts)
    max_array = (
        1
        if not multirun
        else (
            1001
            if result.unvalidated  # Slurm's default
            else int(slurm.show_config().get("MaxArraySize", "1001"))
        )
    )
    result.arrays = group_arrays(runs, max_array)
    for array in result.arrays:
        size = len(array.trials) if multirun else None
        result.scripts.append(
            render(runs[array.trials[0]].cluster, job_name(target), target / "submitit", size, max_parallel)
        )
    if result.unvalidated:
        validate = False
        slurm.drop_prefetched()
    checked: dict[tuple[str, str], list[str]] = {}  # a 100,000-point sweep is 100 arrays of one shape and size
    try:
        for array, script in zip(result.arrays, result.scripts):
            cluster = runs[array.trials[0]].cluster
            shape = (json.dumps(vars(cluster), sort_keys=True), script)  # as group_arrays keys a shape
            if shape not in checked:  # bash -n and 4 Slurm calls, ~30 ms: once per distinct request
                check_syntax(script)
                checked[shape] = validate_live(cluster, script, len(array.trials), max_parallel) if validate else []
            result.unchecked += checked[shape]
    finally:
        slurm.drop_prefetched()  # what a failed check left unread: never a later call's stale answer
    return result


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
        t.job_id, t.process = saved["job_id"], saved.get("process")
    return [Array(**a) for a in old["arrays"]]


def _save_manifest(p: Plan, overrides: list[str], changed: list[int] | None = None) -> None:
    """Under sweep.json's lock: a trial `hpc-train resume` queued meanwhile keeps the job id it recorded
    (those with previous_job_ids), not the one this submit knew.

    Saved twice per array, so O(arrays x trials) work in all: it was quadratic (a 10,000-point sweep in
    10 arrays wrote and re-read the whole manifest ~40 times). Now the file is read again only when
    another process replaced it since this one wrote it, and each trial's and array's JSON line is
    rendered again only when its job id, process or state changed (index, overrides and run_dir are fixed
    once the sweep directory is claimed). One trial per line, so the file stays readable at 100,000.
    `changed`: the trials this submit changed since its last save, which alone are looked at (a loop over
    100,000 trials, 200 times, was 10 s of a 100,000-point sweep); None: every trial."""
    with locked(p.target / (MANIFEST + ".lock")):
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


def _adopt_lost_array(p: Plan, array: Array, job_name: str, executor: Any) -> bool:
    """A previous submit died between sbatch and recording the array's id, perhaps before submitit renamed
    the task pickles: find that array by its job name and give every task its pickle. Trials whose task
    already ended without starting (it waited 60 s for a pickle, or was cancelled) go into a new array
    appended to p.arrays, so every trial runs, or is queued again, exactly once."""
    from hpc_train import slurm

    known = {a.job_id for a in p.arrays if a.job_id} | _manifest_ids(p.target)  # incl. trials' resumed jobs
    found = slurm.jobs_named(job_name) - known  # a cancelled array was given up on: resubmit instead
    if len(found) != 1:
        return False
    array.job_id, array.submitting = found.pop(), False
    for k, i in enumerate(array.trials):  # submitit queues a lone trial as a plain job
        p.trials[i].job_id = f"{array.job_id}_{k}" if len(array.trials) > 1 else array.job_id
        _write_task_pickle(p.target / "submitit" / f"{p.trials[i].job_id}_submitted.pkl", p.trials[i].run_dir, executor)
    written = time.time()
    queued = slurm.queued_tasks(job_name)
    started = {i for i in array.trials if journal.named(journal.read(Path(p.trials[i].run_dir)), journal.START)}
    # A task that gave up on its pickle just before it was written dies within seconds: look again 10 s
    # after writing when a task still waiting may have been queued that long (Slurm's start <= python's).
    if any(
        queued.get(p.trials[i].job_id, written) <= written - SUBMITIT_PICKLE_WAIT_S + 10
        for i in array.trials
        if i not in started
    ):
        time.sleep(max(0.0, written + 10 - time.time()))
        queued = slurm.queued_tasks(job_name)
    ended = [i for i in array.trials if i not in started and p.trials[i].job_id not in queued]
    for i in ended:
        p.trials[i].job_id = None
    if ended:
        p.arrays.append(Array(trials=ended))
    return True


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


@contextlib.contextmanager
def _owner_writes_only() -> Iterator[None]:
    """The umask at least 022 while submitit writes the job pickle, batch script and logs (open() with
    0666: 0664 under umask 002), and so for the job: the local controller inherits it, sbatch passes it
    on (SLURM_UMASK). start.py refuses a job pickle the group could write. Only ever adds bits to the
    mask, so no file another thread creates meanwhile gets more permissive than it asked."""
    old = os.umask(0o022)
    os.umask(old | 0o022)
    try:
        yield
    finally:
        os.umask(old)


@contextlib.contextmanager
def _sigint_held() -> Iterator[None]:
    """Ctrl-C waits from just before sbatch until the job id is on disk (submission.json, sweep.json): in
    between it would leave a queued job that no file names, so status, cancel and resume could not find it.
    Blocked in this thread, so sbatch (a child: it inherits the mask) is not killed mid-request either; a
    handler records one that another thread (the progress bar) takes. Raised as KeyboardInterrupt after."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda *_: caught.append(1))
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # a pending Ctrl-C is delivered here
    if caught:
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
) -> tuple[Plan, list[Any]]:
    """Write and queue what plan() validated. Returns (the plan with job ids, submitit jobs submitted now)."""
    from hpc_train.job import run_job

    first = p.runs[0]
    if not multirun:
        run_dir = p.target = claim_dir(p.target, p.dir_mode)
        p.trials[0].run_dir = str(run_dir)
        pin_init_from(run_dir, p.configs, p.dir_mode)
        _freeze(run_dir, p.configs[0], p.private, p.dir_mode, _code_identity(run_dir, p.private))
        submitit_dir = _submitit_dir(run_dir / "submitit", p.private, p.dir_mode)
        executor = make_executor(first.cluster, submitit_dir, job_name(run_dir))
        with _sigint_held(), _owner_writes_only():
            with _stdio_to_devnull() if first.cluster.executor == "local" else contextlib.nullcontext():
                job = _sbatch_with_retry(lambda: executor.submit(run_job, str(run_dir)), str(run_dir))
            p.trials[0].job_id = p.arrays[0].job_id = str(job.job_id)
            record = {
                "executor": first.cluster.executor,
                "job_id": str(job.job_id),
                "job_name": job_name(run_dir),
                "submitted_at": time.time(),
                "overrides": overrides,
            }
            if first.cluster.executor == "local":  # the job id is the controller's pid, which the OS reuses
                from hpc_train.runs import process_identity

                record["process"] = process_identity(int(job.job_id))
            write_atomic(run_dir / "submission.json", json.dumps(record, indent=1) + "\n", p.private)
        return p, [job]

    # A sweep: freeze every trial, record the manifest, then one sbatch per array.
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
        saved = _load_manifest(p.target, overrides, p.trials)
        if saved is not None:
            p.arrays = saved
    code = _code_identity(p.target, p.private)
    pin_init_from(p.target, p.configs, p.dir_mode)
    like = None
    for t in p.trials:
        like = _freeze(Path(t.run_dir), p.configs[t.index], p.private, p.dir_mode, code, like)
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
        executor = make_executor(
            cluster, _submitit_dir(p.target / "submitit", p.private, p.dir_mode), job_name(p.target), max_parallel
        )
        lost = array.submitting and cluster.executor == "slurm"  # queued, but its id never reached the manifest
        if lost and _adopt_lost_array(p, array, job_name(p.target), executor):
            _save_manifest(p, overrides)
            continue
        array.submitting = True
        _save_manifest(p, overrides, changed=[])
        if cluster.executor == "local":  # this machine is the cluster: one trial at a time
            from hpc_train.runs import process_identity

            with _sigint_held(), _owner_writes_only():
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
        else:
            what = (
                f"trials {todo[0]}..{todo[-1]} of {p.target} (the manifest has what is queued: rerun the same "
                f"command with --sweep-dir {p.target} to submit the rest)"
            )
            tried: list[int] = []

            def queue_array() -> list[Any]:
                # A try that timed out may still have queued the array: look it up before trying again.
                if tried and _adopt_lost_array(p, array, job_name(p.target), executor):
                    return []
                tried.append(1)
                return executor.map_array(run_job, [p.trials[i].run_dir for i in todo])

            with _sigint_held(), _owner_writes_only():
                new = _sbatch_with_retry(queue_array, what)
                for i, job in zip(todo, new):
                    p.trials[i].job_id = str(job.job_id)
                if new:  # one save per sbatch records the trials' and the array's ids (two saved the same twice)
                    array.job_id, array.submitting = str(new[0].job_id).split("_")[0], False
                _save_manifest(p, overrides, changed=todo if new else None)  # adopted: ids set elsewhere
            if not new:  # adopted: the job ids are recorded already
                continue
        jobs += new
        done += len(todo)
        if progress:
            progress(done, len(p.trials))
    _save_manifest(p, overrides, changed=[])  # the arrays skipped above: their state, no trial's
    return p, jobs
