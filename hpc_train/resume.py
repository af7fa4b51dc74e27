"""`hpc-train resume RUN`: a stopped, cancelled or failed run queued again under its own identity (run
directory, frozen config.yaml, events.jsonl), from its newest committed checkpoint. Torch-free.

    hpc-train resume runs/demo-1                      # after a cancel, a spent budget, a failed node
    hpc-train resume runs/demo-1 --max-failures 5     # with a budget raised (recorded in the resume event)
    hpc-train resume runs/demo-1 --allow-data-changed # on data changed since its checkpoint (a shard appended)
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from hpc_train import journal
from hpc_train.paths import RunPaths, dir_mode, locked
from hpc_train.plan import MANIFEST, job_name
from hpc_train.reasons import Reason
from hpc_train.sbatch import check_syntax, make_executor, render, validate_live
from hpc_train.slurm import ACTIVE_STATES, SlurmError
from hpc_train.submit import (
    _interrupts_held,
    _owner_writes_only,
    _sbatch_with_retry,
    _stdio_to_devnull,
    _submitit_dir,
    adopt_lost_job,
    record_job,
)

# A resume of another trial holds the sweep's lock for a few seconds: several trials resumed at once wait
# their turn. A submit still queueing the sweep (a local sweep: until its last trial ends) holds it longer.
SWEEP_LOCK_WAIT_S = 30.0


@contextlib.contextmanager
def _sweep_lock(lock_file: Path, busy: str) -> Iterator[None]:
    with locked(lock_file, wait_s=SWEEP_LOCK_WAIT_S) as got:
        if not got:
            raise ValueError(busy)
        yield


def resume(
    path: Path, budgets: dict[str, int], reason: str = "", allow_data_changed: bool = False, dependents: bool = True
) -> tuple[Any, list[str]]:
    """`hpc-train resume RUN`: queue a stopped, cancelled or failed run again under its own identity (run
    directory, frozen config.yaml, events.jsonl), to go on from its newest committed checkpoint. Refuses a
    run that is queued, running or finished. `budgets` (requeue.* keys) are recorded in the `resume` event
    and apply over the frozen config, which stays as submitted. Once sbatch succeeded, writes the `resume`
    event (the attempt it starts, who, why) and the new job id where status finds it (submission.json, or
    the sweep's sweep.json). allow_data_changed: recorded in that event too; the job then resumes on data
    other than its checkpoint's (journal.data_change_allowed). A run queued after others (`submit --after`) waits
    for their jobs of now; with `dependents`, the runs queued after this one follow it (_dependents_again).
    Returns (the submitit job, sentences for the user)."""
    from hpc_train.runs import find_runs

    runs = find_runs(path)
    if not runs:
        raise ValueError(
            f"{path} is not a run directory: it holds no run (no sweep.json, no config.yaml with the "
            f"events.jsonl or submission.json of a submit); give a run's folder, e.g. runs/demo-1 (hpc-train "
            f"status lists them)"
        )
    if len(runs) != 1:
        raise ValueError(f"{path} holds {len(runs)} runs; resume one of them, e.g. hpc-train resume {runs[0].run_dir}")
    run = runs[0]
    if run.unreadable:
        raise ValueError(run.unreadable)
    # Held from the state check until the new job id is recorded, and refused when held: a second resume of
    # this run, or a submit still queueing its sweep, would queue a second copy of the trial.
    target = run.log_dir.parent  # the run directory, or the sweep directory of a trial (its submitit/ and job name)
    busy = (
        f"{run.label} is being submitted or resumed by another hpc-train command right now; wait for it to "
        f"return, then follow it with hpc-train status {run.run_dir}"
    )
    sweep_busy = (
        f"{target} is being submitted or resumed by another hpc-train command right now (a sweep still being "
        f"queued, or another trial's resume); wait for it to return, then try again"
    )
    with (
        locked(RunPaths(run.run_dir).lock, wait=False, busy=busy),
        _sweep_lock(target / (MANIFEST + ".lock"), sweep_busy)
        if (target / MANIFEST).exists()
        else contextlib.nullcontext(),
    ):
        job, lines = _resume(find_runs(run.run_dir)[0], budgets, reason, allow_data_changed)
    return job, lines + (_dependents_again(run.run_dir) if dependents else [])


def _dependents_again(stage: Path) -> list[str]:
    """After `stage` was queued again: the runs still waiting for its old job wait for the new one
    (stages.after_resume), and those that ended unstarted because it stopped are resumed, each once every stage it
    runs after may finish again (a run after two cancelled stages comes back with the second), then the runs queued
    after them the same way. A sentence each."""
    from hpc_train import pipeline, stages

    lines, todo = stages.after_resume(stage)
    refused: dict[Path, str] = {}
    progress = True
    while todo and progress:
        progress = False
        for dep in list(todo):
            try:  # the stage is queued already: a dependent's error is its sentence, never the command's exit 2
                if not stages.to_queue_again(dep):  # queued meanwhile (a stage resumed in this loop took it along)
                    todo.remove(dep)
                    continue
                job, _ = resume(
                    dep, {}, f"{pipeline.label(stage)}, a stage it runs after, was resumed", dependents=False
                )
            except (ValueError, SlurmError, OSError) as e:  # OSError: another user's run (PermissionError)
                refused[dep] = str(e)
                continue
            todo.remove(dep)
            progress = True
            lines.append(f"{pipeline.label(dep)}, which never started, is queued again as job {job.job_id}")
            more_lines, more = stages.after_resume(dep)
            lines += more_lines
            todo += [d for d in more if d not in todo]
    return lines + [f"{pipeline.label(d)} is not queued again: {refused.get(d, '')}" for d in todo]


def _script_resumes_from(cfg: Any, run_dir: Path, events: list[dict[str, Any]]) -> str:
    """What a script's run resumes from: the file script.checkpoint names (resume_args appended), else the newest
    one its script_helper.committed() recorded, else the script's own business."""
    import dataclasses

    from hpc_train.script import found_checkpoint

    if cfg.script.checkpoint:
        found = found_checkpoint(dataclasses.asdict(cfg), run_dir)
        if found:
            extra = f", with {' '.join(cfg.script.resume_args)}" if cfg.script.resume_args else ""
            return f"your script resumes from {found}, the newest file script.checkpoint names{extra}"
        return f"no file matches script.checkpoint={cfg.script.checkpoint} yet: your script starts again from step 0"
    recorded = journal.named(events, journal.CHECKPOINT_COMMITTED)
    if recorded and recorded[-1].get("path"):
        return f"your script last recorded {recorded[-1]['path']} (step {recorded[-1]['step']}) with committed()"
    return "your script resumes from its own checkpoint files, if it keeps any (script.checkpoint names them)"


def _resume(run: Any, budgets: dict[str, int], reason: str, allow_data_changed: bool) -> tuple[Any, list[str]]:
    import getpass
    import socket

    from hpc_train import pipeline, runs, slurm, stages
    from hpc_train.config import check_environment, load_frozen
    from hpc_train.job import run_job
    from hpc_train.paths import read_marker, step_folders

    events = journal.read(run.run_dir)
    finish = journal.finished(events)
    if finish is not None:
        raise ValueError(
            f"{run.label} finished at step {finish['step']}: there is nothing to resume. To train on from "
            f"its weights, start a new run: hpc-train submit checkpoint.init_from={run.run_dir} ..."
        )
    cfg = load_frozen(run.run_dir)
    check_environment(cfg)  # it still runs from here: data path, fn._target_
    slurm.slurm_env(cfg.cluster.slurm_conf)
    state = _refuse_if_active(run)
    afters = pipeline.read_after(run.run_dir)  # queued after other runs: their jobs of now (ValueError: one stopped)
    dependency, found = stages.dependency(afters, run.run_dir) if afters else ("", [])
    events = journal.read(run.run_dir)  # again: the ranks of a job that was COMPLETING just wrote why they stopped
    why = journal.stop_reason(events, run.job_id, state)
    lines = [f"{run.label} stopped because {why}", *_budget_lines(cfg, events, budgets)]
    committed = [(s, f) for s, f in step_folders(RunPaths(run.run_dir).checkpoints).items() if read_marker(f)]
    lines.append(_resumes_from(run, cfg, events, [f for _, f in committed]))
    lines += _notes(RunPaths(run.run_dir), allow_data_changed)
    target = run.log_dir.parent
    private = bool(cfg.cluster.env)
    if cfg.cluster.executor == "slurm":
        script = render(cfg.cluster, job_name(target), target / "submitit", None, None, dependency)
        check_syntax(script)
        grace: list[str] = []
        validate_live(cfg.cluster, script, 1, None, warnings=grace)
        lines += [f"warning: {w}" for w in grace]
    attempt = journal.next_attempt(events)
    submitit_dir = _submitit_dir(target / "submitit", private, dir_mode(cfg.share_with_group))
    executor = make_executor(cfg.cluster, submitit_dir, job_name(target), dependency=dependency)
    tried: list[int] = []

    def queue() -> Any:
        # A try that timed out may have queued the job: look it up by name (minus every id recorded) first.
        if tried and cfg.cluster.executor == "slurm":
            lost = adopt_lost_job(target, [str(run.run_dir)], {run.job_id}, executor)
            if lost:
                return type("Adopted", (), {"job_id": lost})()
        tried.append(1)
        return executor.submit(run_job, str(run.run_dir))

    with _interrupts_held(), _owner_writes_only():  # until the new job id is recorded
        with _stdio_to_devnull() if cfg.cluster.executor == "local" else contextlib.nullcontext():
            job = _sbatch_with_retry(queue, str(run.run_dir))
        job_id = str(job.job_id)
        # After sbatch succeeded (a failed one resets no budget), still under the lock: the job reads
        # events.jsonl for its attempt number under the same lock (job.py), so it never starts before this.
        journal.log(
            run.run_dir,
            journal.RESUME,
            committed[-1][0] if committed else 0,
            job_id,
            attempt,
            by=f"{getpass.getuser()}@{socket.gethostname()}",
            reason=reason or "hpc-train resume",
            budgets=budgets,
            previous_job_id=run.job_id,
            stopped_because=why,
            **({"allow_data_changed": True} if allow_data_changed else {}),
        )
        process = runs.process_identity(int(job_id)) if cfg.cluster.executor == "local" else None
        record_job(target, run.run_dir, job_id, process, private, executor=cfg.cluster.executor, resumed_at=time.time())
    lines += [f"warning: {w}" for w in pipeline.register(afters, {str(run.run_dir): job_id})] if afters else []
    lines.append(f"resumed as job {job_id} (attempt {attempt}); run directory {run.run_dir}")
    return job, lines + ([f"it runs {stages.waits_for(found)}"] if found else [])


def _refuse_if_active(run: Any) -> str:
    """Slurm's state of the run's job ("" when none or local), once it is no longer COMPLETING; ValueError for a
    run still queued or running (Slurm's, or a local controller alive, here or on another host)."""
    import socket

    from hpc_train import runs, slurm

    state = ""
    if run.executor == "slurm" and run.job_id:
        try:
            state = slurm.job_states([run.job_id], strict=True).get(run.job_id, "")
        except slurm.SlurmError as e:
            raise slurm.SlurmError(
                f"cannot tell whether job {run.job_id} of {run.label} is still queued or running "
                f"({e}); try again once Slurm answers"
            ) from None
        # A job cancelled a moment ago stays COMPLETING while its ranks are killed (KillWait, 30 s by default,
        # plus the epilog): wait that out rather than send a user who just typed cancel; resume away.
        waited_until = time.monotonic() + 120
        if state == "COMPLETING":
            print(
                f"hpc-train resume: job {run.job_id} is COMPLETING (its ranks are being stopped); waiting up to "
                f"2 minutes for it to end",
                file=sys.stderr,
            )
        while state == "COMPLETING" and time.monotonic() < waited_until:
            time.sleep(2)
            try:
                state = slurm.job_states([run.job_id], strict=True).get(run.job_id, "")
            except slurm.SlurmError:
                break  # the state is known to be COMPLETING: refused below
        if state in ACTIVE_STATES:
            raise ValueError(
                f"{run.label} is still {state} (job {run.job_id}): there is nothing to resume; follow it "
                f"with hpc-train status {run.run_dir}, or stop it first with hpc-train cancel "
                f"{run.run_dir}"
            )
    elif (
        run.executor == "local"
        and run.process
        and run.process.get("host", socket.gethostname()) != socket.gethostname()
    ):
        raise ValueError(
            f"{run.label} ran on host {run.process['host']}, not here ({socket.gethostname()}): its local "
            f"controller can only be seen there; run hpc-train resume {run.run_dir} on "
            f"{run.process['host']}"
        )
    elif run.executor == "local" and (pid := runs.local_pid(run)):
        raise ValueError(
            f"{run.label} is still running (local controller pid {pid}): there is nothing to resume; "
            f"follow it with hpc-train logs -f {run.run_dir}, or stop it first with hpc-train cancel "
            f"{run.run_dir}"
        )
    return state


def _budget_lines(cfg: Any, events: list[dict[str, Any]], budgets: dict[str, int]) -> list[str]:
    """The budgets as this resume leaves them (ValueError for a negative one), and those still spent."""
    for k, v in budgets.items():
        if v < (-1 if k == "max_preemptions" else 0):
            flag, unlimited = f"--{k.replace('_', '-')}", " (or -1: unlimited)" if k == "max_preemptions" else ""
            raise ValueError(f"{flag} {v}: a budget is a count >= 0{unlimited}; e.g. {flag} 4")
    limits = replace(cfg.requeue, **{**journal.budget_changes(events), **budgets})
    used = {
        "max_preemptions": journal.requeues_counted(events, Reason.PREEMPT),
        "max_time_limit_requeues": journal.requeues_counted(events, Reason.TIME_LIMIT),
        "max_failures": 0,
    }  # a resume resets failures in a row: a person decided the cause is fixed
    what = {
        "max_preemptions": "preemptions",
        "max_time_limit_requeues": "time-limit requeues",
        "max_failures": "failures in a row",
    }
    spent = [k for k in used if getattr(limits, k) != -1 and used[k] >= getattr(limits, k)]
    budget_line = "budgets: " + ", ".join(
        f"{what[k]} {used[k]}/{'unlimited' if getattr(limits, k) == -1 else getattr(limits, k)}"
        f"{' (raised now)' if k in budgets else ''}"
        for k in used
    )
    if failures := journal.failures_in_a_row(events):
        budget_line += f" (was {failures}: reset by this resume)"
    lines = [budget_line]
    lines += [
        f"the {what[k]} budget is still spent: the next such stop ends the run; raise it with "
        f"--{k.replace('_', '-')} {used[k] + 2}"
        for k in spent
    ]
    return lines


def _resumes_from(run: Any, cfg: Any, events: list[dict[str, Any]], committed: list[Path]) -> str:
    """The sentence of what the resumed job starts from (ValueError: nothing it could start from is left)."""
    from hpc_train.paths import read_marker

    if cfg.script.cmd:  # the script's checkpoints are its own: hpc_train's step folders never hold one
        return _script_resumes_from(cfg, run.run_dir, events)
    if committed:
        return (
            f"resuming from {committed[-1]}, its newest committed checkpoint (verified when the job "
            f"starts; an older one if it does not verify)"
        )
    if init := cfg.checkpoint.init_from:
        from hpc_train.pipeline import final_checkpoint, read_after

        if final_checkpoint(Path(init)) is None and init in {a.run for a in read_after(run.run_dir)}:
            return f"no committed checkpoint of its own: starting from {init}'s newest when the job starts"
        if read_marker(final_checkpoint(Path(init)) or Path(init)) is None:
            raise ValueError(
                f"{run.label} has no committed checkpoint of its own and its checkpoint.init_from="
                f"{cfg.checkpoint.init_from} is no longer committed (deleted?); submit a new run instead"
            )
        return (
            f"no committed checkpoint of its own: starting again from checkpoint.init_from={cfg.checkpoint.init_from}"
        )
    return "no committed checkpoint: starting again from step 0"


def _notes(paths: RunPaths, allow_data_changed: bool) -> list[str]:
    """What the resumed job will do differently from its last attempt, said before anything is queued."""
    notes = []
    if paths.code.exists():  # the job records a `code_changed` event too
        from hpc_train.provenance import differences

        if differences(json.loads(paths.code.read_text())):
            notes.append(
                f"warning: this is not the code that validated the run ({paths.code}); the job will train with "
                f"it and record a code_changed event"
            )
    if allow_data_changed:
        notes.append(
            "--allow-data-changed: it resumes on the data as it is now, even if that is not its checkpoint's "
            "(a data_changed event then says what changed)"
        )
    return notes
