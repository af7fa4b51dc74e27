"""Pipelines: a run queued after others, its records, the one rule that turns its stages' state into Slurm's
dependency, and what a stage that stops for good does to the runs queued after it. Torch-free: the login side
(submit, resume, status, cancel) and the job side (requeue.apply's stop) share it.

    hpc-train submit cluster=dev name=pretrain train.steps=2000
    hpc-train submit cluster=dev name=eval --after runs/pretrain-1:any -- python eval.py --ckpt {after.ckpt}
    hpc-train submit cluster=dev name=ft --after runs/pretrain-1,runs/eval-1 checkpoint.init_from=runs/pretrain-1

A dependent's after.json (frozen at submit, as config.yaml; a sweep's in its sweep directory) names the stages it
runs after; each stage's dependents.jsonl names the runs queued after it with their job id, a line per submit or
resume of a dependent (the last one wins). Each queueing of a dependent (submit, resume) asks for the stages' job
ids of that moment (`dependency`): a stage requeued by Slurm or by us keeps its job id; one resumed gets a new one,
which `hpc-train resume` hands to the runs still waiting for it. Slurm is asked for `--kill-on-invalid-dep=yes`
too: a stage that dies where no code of ours sees it (an admin's scancel) never leaves its dependents pending
forever as DependencyNeverSatisfied.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpc_train import journal, preempt, slurm
from hpc_train.paths import STEP_DIR, RunPaths, append_line, read_marker, step_folders, write_atomic

log = logging.getLogger(__name__)

KINDS = ("ok", "any")  # sbatch's afterok (once it finished) and afterany (once it ended, however)
PLACEHOLDER = "{after.ckpt}"  # in a script's command: the first stage's final checkpoint, found at the job's start
# The stop path's one Slurm call when a stage stops with runs queued after it (settle_dependents without
# ask_slurm): one scancel of all of them, one try of 5 s inside what a time limit leaves (deadlines.REQUEUE_RESERVE_S);
# a run it misses is still cancelled by Slurm (--kill-on-invalid-dep), its journal told already. `hpc-train cancel`
# asks squeue the same way, one query a level of the cascade.
STOP_POLICY = (5.0, 0)


@dataclass(frozen=True)
class After:
    """One stage a run is queued after, as `--after` named it."""

    run: str  # absolute: a run directory, a sweep directory (every trial) or a sweep's trial
    kind: str = "ok"


@dataclass(frozen=True)
class Upstream:
    """One run of a stage as it stands now (stages.upstreams gathers it): what `dependency` decides on."""

    label: str  # "pretrain-1", "sweep-2/0003"
    run_dir: str
    kind: str  # the After's
    executor: str
    job_id: str  # its current job ("": never queued)
    finished: bool  # its journal's `finish`
    stopped: str  # why it will not come back by itself ("" while it may): its stop reason, or Slurm's end


def parse(values: list[str]) -> list[After]:
    """`--after` values (repeated, each comma-separated) -> After, paths made absolute. ValueError names the value
    and the fix. A path that exists whole is taken whole, colon and all."""
    out: dict[str, After] = {}
    for value in values:
        words = [w.strip() for w in value.split(",")]
        if not all(words):
            raise ValueError(f"--after {value!r} has an empty entry; give RUN[:ok|any], several comma-separated")
        for word in words:
            run, sep, kind = word.rpartition(":")
            if not sep or Path(word).exists():
                run, kind = word, "ok"
            if kind not in KINDS:
                raise ValueError(
                    f"--after {word}: {kind!r} is not a kind of dependency; write {run}:ok (start once it finished, "
                    f"the default) or {run}:any (start once it ended, finished or not)"
                )
            path = str(Path(run).expanduser().resolve())
            if path in out and out[path].kind != kind:
                raise ValueError(f"--after names {run} twice, as :{out[path].kind} and :{kind}; give it once")
            out[path] = After(path, kind)
    return list(out.values())


def after_file(run_dir: Path) -> Path:
    """A run's after.json, or its sweep's (one file for every trial of a sweep queued after a stage)."""
    own = RunPaths(run_dir).after
    if not own.exists() and (run_dir.parent / "sweep.json").exists():
        return RunPaths(run_dir.parent).after
    return own


def read_after(run_dir: Path) -> list[After]:
    """The stages `run_dir` (a run, a sweep's trial or a sweep) was queued after; [] for a run queued after none."""
    try:
        return [After(a["run"], a["kind"]) for a in json.loads(after_file(run_dir).read_text())]
    except FileNotFoundError:
        return []


def freeze_after(target: Path, afters: list[After], private: bool) -> None:
    """after.json in the run or sweep directory, written once, as config.yaml: a resubmitted sweep (--sweep-dir)
    with other stages, or with some where it had none, is refused rather than queued after other runs than its
    first trials."""
    path = RunPaths(target).after
    if path.exists():
        frozen = read_after(target)
        if frozen != afters:
            was = ",".join(f"{a.run}:{a.kind}" for a in frozen) or "none"
            raise ValueError(f"{target} was submitted --after {was}; resubmit it with the same --after")
        return
    if afters and (target / "sweep.json").exists():  # its trials queued so far wait for nothing
        raise ValueError(
            f"--sweep-dir {target} was submitted without --after: its trials queued then wait for no stage; "
            f"resubmit it without --after, or queue a new sweep after {afters[0].run} (drop --sweep-dir)"
        )
    if afters:
        write_atomic(path, json.dumps([{"run": a.run, "kind": a.kind} for a in afters], indent=1) + "\n", private)


def dependency(upstreams: list[Upstream]) -> str:
    """sbatch's --dependency value for these stages' runs ("" when none is left to wait for) (pure). A run that
    finished satisfies both kinds, and is left out (Slurm forgets a job MinJobAge after it ended: naming it then
    fails the sbatch); one that stopped for good satisfies :any and refuses :ok, with the fix; every other one is
    waited for by its current job, once (:ok wins over :any for a job named by both)."""
    ids: dict[str, list[str]] = {"ok": [], "any": []}
    for u in upstreams:
        if u.executor != "slurm":
            raise ValueError(
                f"--after {u.label}: it ran on the local executor, which Slurm cannot wait for; pipelines are "
                f"Slurm runs (run local stages one after another: hpc-train submit waits for a local run)"
            )
        if u.finished or (u.stopped and u.kind == "any"):
            continue
        if u.stopped:
            raise ValueError(
                f"--after {u.label}: it stopped for good ({u.stopped}) and will never finish; resume it first "
                f"(hpc-train resume {u.run_dir}), or wait for it to end however with --after {u.run_dir}:any"
            )
        if not u.job_id:
            raise ValueError(
                f"--after {u.label}: it was never queued (no job id); complete its submit first "
                f"(hpc-train submit ... --sweep-dir), then queue this run after it"
            )
        ids[u.kind] += [u.job_id] if u.job_id not in ids[u.kind] else []
    ids["any"] = [j for j in ids["any"] if j not in ids["ok"]]
    return ",".join(f"after{kind}:{':'.join(jobs)}" for kind, jobs in ids.items() if jobs)


def label(run_dir: Path) -> str:
    """A run's name as status shows it: "pretrain-1", a sweep's trial "sweep-2/0003"."""
    return f"{run_dir.parent.name}/{run_dir.name}" if (run_dir.parent / "sweep.json").exists() else run_dir.name


# ---- what a stage knows of the runs queued after it -----------------------------------------------------


def register(afters: list[After], queued: dict[str, str]) -> list[str]:
    """Each stage learns the runs just queued after it and their job ids (`queued`: run dir -> job id), a line in
    its dependents.jsonl (a sweep stage: its sweep directory's). Returns a warning per stage that could not be
    told (another user's run): if it stops for good, Slurm still cancels these runs, without a word in theirs."""
    warnings = []
    for a in afters:
        try:
            append_line(RunPaths(Path(a.run)).dependents, {"time": time.time(), "kind": a.kind, "runs": queued})
        except OSError as e:
            warnings.append(
                f"{a.run}: could not record the runs queued after it ({e.strerror}); if it stops for good they "
                f"are cancelled by Slurm, without a sentence in their events.jsonl"
            )
    return warnings


def dependents(run_dir: Path) -> dict[str, tuple[str, str]]:
    """The runs queued after `run_dir` (or after its sweep, for a trial) -> (their job id, kind), oldest first, the
    last registration of each winning (a resumed dependent registers its new job)."""
    records = []
    for folder in (run_dir, run_dir.parent) if (run_dir.parent / "sweep.json").exists() else (run_dir,):
        try:
            text = RunPaths(folder).dependents.read_text()
        except (FileNotFoundError, PermissionError):
            continue
        for line in text.splitlines():
            try:
                record = json.loads(line)
            except ValueError:  # a torn last line: its writer died mid-write
                continue
            if isinstance(record, dict) and isinstance(record.get("runs"), dict) and record.get("kind", "ok") in KINDS:
                records.append(record)
    out: dict[str, tuple[str, str]] = {}
    for record in sorted(records, key=_when):
        for dep, job_id in record["runs"].items():
            if "\0" in dep or not isinstance(job_id, (str, int)) or not str(job_id):  # edited by hand: unusable
                continue
            out.pop(dep, None)
            out[dep] = (str(job_id), record.get("kind", "ok"))
    return out


def _when(record: dict[str, Any]) -> float:
    """A registration's time, 0 for one edited into something else (a string, null): oldest."""
    t = record.get("time")
    return float(t) if isinstance(t, (int, float)) and not isinstance(t, bool) else 0.0


def waiting(events: list[journal.Event], state: str) -> bool:
    """Whether a dependent still waits for its stages (pure): never started since it was last queued, neither
    cancelled nor stopped since, and Slurm holds it pending ("" unknown; CANCELLED: Slurm's own cancel of a job whose
    dependency can never be satisfied, which leaves no word in its journal)."""
    since = journal.since_resume(events)
    return state in ("PENDING", "CANCELLED", "") and not journal.named(
        since, journal.START, journal.STOPPED, journal.CANCEL
    )


def settle_dependents(run_dir: Path | list[Path], why: str, ask_slurm: bool = True) -> list[str]:
    """`run_dir` (or each of several, settled together: `hpc-train cancel` of a sweep's trials) stopped for good
    (`why`): each run queued after it that still waits is told in its events.jsonl and, for :ok, cancelled (then the
    runs queued after that one, the same way); a run queued :any only gets the sentence (`released`): Slurm no longer
    holds it for this one. Returns the sentences (logged too). ask_slurm (`hpc-train cancel`): Slurm's states of
    each level's dependents, one query a level (a dependent Slurm ran already is left alone); without (the job's
    stop path, requeue.apply): no query, a dependent with no `start` since it was last queued counts as waiting, and
    the whole call is one scancel of at most 5 s plus the journals' writes. Never raises: a call Slurm does not
    answer, a damaged record, leaves the cancel to Slurm's --kill-on-invalid-dep."""
    said: list[str] = []
    cancel: list[str] = []
    try:
        level = [(d, d) for d in ([run_dir] if isinstance(run_dir, Path) else run_dir)]
        while level:  # a level's :ok dependents, cancelled, are the next level's stages (the root stays)
            level = _settle_level(level, why, ask_slurm, said, cancel)
    except Exception as e:
        log.warning("pipeline: the runs queued after %s were not all told it stopped (%s)", run_dir, e)
    if cancel:
        try:  # the stop path's one Slurm call: 5 s, no retry (STOP_POLICY); `hpc-train cancel` retries once
            retries = 1 if ask_slurm else STOP_POLICY[1]
            slurm.call(["scancel", *cancel], timeout_s=STOP_POLICY[0], retries=retries, ignore_term=True)
        except Exception as e:  # a job that ended meanwhile is an error too; Slurm cancels the others
            log.warning("pipeline: scancel of the runs queued after %s: %s", run_dir, e)
    return said


def _settle_level(
    level: list[tuple[Path, Path]], why: str, ask_slurm: bool, said: list[str], cancel: list[str]
) -> list[tuple[Path, Path]]:
    """One level of settle_dependents: the dependents of each (stage, root) told; returns the :ok ones told (each
    with its root), whose job ids are added to `cancel` and sentences to `said`."""
    pairs = [(stage, root, dep, job, kind) for stage, root in level for dep, (job, kind) in dependents(stage).items()]
    states: dict[str, str] = {}
    if ask_slurm and pairs:
        try:
            states = slurm.job_states([p[3] for p in pairs], retries=STOP_POLICY[1], timeout_s=STOP_POLICY[0])
        except Exception as e:  # SlurmError, or an answer we could not parse: the journals still say why
            log.warning("pipeline: no job states for the runs queued after %s (%s)", level[0][0], e)
    told = []
    for stage, root, dep, job_id, kind in pairs:
        try:
            text = _tell(stage, root, Path(dep), job_id, kind, why, states.get(job_id, ""))
        except Exception as e:  # another user's run, a folder deleted, a damaged path: Slurm cancels it unsaid
            log.warning("pipeline: could not tell %s that %s stopped (%s)", dep, stage, e)
            continue
        if text:
            said.append(f"{label(Path(dep))} (job {job_id}): {text}")
            log.info("pipeline: %s", said[-1])
            if kind == "ok":
                cancel.append(job_id)
                told.append((Path(dep), root))
    return told


def _tell(stage: Path, root: Path, dep_dir: Path, job_id: str, kind: str, why: str, state: str) -> str:
    """One dependent of `stage` told that it stopped for good (`root`'s stop): its sentence, "" when it does not
    wait (started, told or cancelled already, gone)."""
    events = journal.read(dep_dir)
    if not dep_dir.is_dir() or not waiting(events, state):
        return ""
    cause = "stopped for good" if root == stage else f"was cancelled as {label(root)} stopped for good"
    fields = {"upstream": str(stage), "root": str(root), "by": "pipeline"}
    attempt = journal.current_attempt(events)
    if kind == "any":
        told = journal.named(journal.since_resume(events), journal.RELEASED)
        if any(e.get("upstream") == str(stage) for e in told):  # the job's stop, then a cancel
            return ""
        text = f"{label(stage)}, which it runs after (:any), {cause}: {why}; this run does not wait for it"
        journal.log(dep_dir, journal.RELEASED, -1, job_id, attempt, reason=text, **fields)
        return text
    text = (
        f"cancelled before it started: {label(stage)}, which it runs after, {cause}: {why}; "
        f"`hpc-train resume {root}` queues it again, and this run after it"
    )
    journal.log(dep_dir, journal.STOPPED, -1, job_id, attempt, reason=text, **fields)
    return text


# ---- what a run starts from ---------------------------------------------------------------------------


def final_checkpoint(path: Path) -> Path | None:
    """The checkpoint a stage leaves the next: `path` itself when it names a step folder (whoever loads it checks
    its marker); else the newest committed step folder of the run directory `path` (hpc_train's own: the built-in
    trainer, a function); else the newest checkpoint file its script recorded (script.checkpoint at an attempt's
    end, script_helper.committed()); None when it left none."""
    if STEP_DIR.fullmatch(path.name):
        return path
    root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    committed = [f for f in step_folders(root).values() if read_marker(f) is not None]
    if committed:
        return committed[-1]
    events = journal.read(path)
    recorded = [e["path"] for e in journal.named(events, journal.CHECKPOINT_COMMITTED, journal.SCRIPT_CHECKPOINT)]
    found = [Path(p) for p in recorded if isinstance(p, str) and Path(p).exists()]
    return found[-1] if found else None


def placeholders(text: str, run_dir: str | Path) -> dict[str, str]:
    """{after.ckpt} for script.fill, when `text` names it (fill runs for every word of a command): the final
    checkpoint of the run's first stage, found as the job starts (an earlier attempt's, while it is there). Left as
    written for a run with no after.json (at submit, where plan insists on --after) and while the stage's job is
    queued or running (the job refuses to start the script so: supervisor._launch); preempt.Unrecoverable
    (no requeue gives the script a checkpoint) once the stage ended without one: finished or stopped, or its job gone
    from Slurm without a word in its journal (an admin's scancel)."""
    if PLACEHOLDER not in text:
        return {}
    afters = read_after(Path(run_dir))
    if not afters:
        return {"after.ckpt": PLACEHOLDER}
    # What an earlier attempt of this run started from, while it is there: every attempt the same, whatever the
    # stage (resumed meanwhile) committed since (the supervisor's start event records it)
    for e in reversed(journal.named(journal.read(Path(run_dir)), journal.START)):
        if isinstance(e.get("after_ckpt"), str) and Path(e["after_ckpt"]).exists():
            return {"after.ckpt": e["after_ckpt"]}
    stage = Path(afters[0].run)
    found = final_checkpoint(stage)
    if found is not None:
        return {"after.ckpt": str(found)}
    events = journal.read(stage)
    if journal.finished(events) or journal.stopped(events):
        how = "ended"
    else:
        job_id = _job_of(stage, events)
        # at the job's start, while the other ranks wait: 2 tries of 10 s, not job_states' 4 of 30; unanswered, the
        # SlurmError is a failure like any other, and the requeue asks again
        state = slurm.job_states([job_id], retries=1, timeout_s=10).get(job_id, "") if job_id else ""
        if state in slurm.ACTIVE_STATES:
            return {"after.ckpt": PLACEHOLDER}
        job = f"job {job_id}: {state or 'gone from Slurm'}" if job_id else "no job on record"
        how = f"ended ({job}, no finish or stop in its events.jsonl)"
    raise preempt.Unrecoverable(
        f"{PLACEHOLDER}: {stage} {how} without a checkpoint (no committed step folder, no checkpoint file its "
        f"script recorded with script.checkpoint or script_helper.committed()); nothing to start from, so this run "
        f"stops: once the stage has one, hpc-train resume {run_dir}"
    )


def _job_of(stage: Path, events: list[journal.Event]) -> str:
    """A stage's current job: its journal's last, else the one its submit recorded (submission.json, a trial's in
    its sweep's sweep.json); "" when none is known."""
    if events:
        return str(events[-1].get("job_id", ""))
    try:
        if (stage.parent / "sweep.json").exists():
            trials = json.loads((stage.parent / "sweep.json").read_text())["trials"]
            return next((str(t["job_id"] or "") for t in trials if t["run_dir"] == str(stage)), "")
        return str(json.loads(RunPaths(stage).submission.read_text()).get("job_id", ""))
    except (OSError, ValueError, KeyError, TypeError):
        return ""
