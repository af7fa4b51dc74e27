"""The stages a run is queued after, as they stand now: the runs each `--after` path names, with their job, Slurm's
state of it and their journal (pipeline.Upstream); the dependency a run gets each time it is queued; the chain
`status` shows; and, at `hpc-train resume` of a stage, the runs still waiting for its old job. Torch-free (login).

    from hpc_train import pipeline, stages
    stages.dependency(pipeline.parse(["runs/pretrain-1:any"]))     # "afterany:1002", or a ValueError with the fix
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hpc_train import journal, pipeline, slurm
from hpc_train.pipeline import After, Upstream
from hpc_train.runs import Run, find_runs


def runs_of(after: After, queued: Path | None = None) -> list[Run]:
    """The runs an --after path names: a run directory, a sweep's trial, or a sweep (every trial). ValueError for
    anything else (a folder of runs, a path that holds none), with the fix; `queued`: the run whose after.json
    names it (resume), to say so for a stage deleted since, with the way out."""
    path = Path(after.run)
    try:
        runs = find_runs(path) if path.is_dir() else []
    except ValueError:
        runs = []
    held = [r for r in runs if r.run_dir != path]  # a sweep's trials, or the runs of a folder of them
    if held and len(held) == len(runs) and not (path / "sweep.json").exists():
        raise ValueError(
            f"--after {after.run}: a folder of {len(held)} runs, not one; name the run or the sweep to wait for, "
            f"e.g. --after {held[0].run_dir}"
        )
    if not runs and queued:
        frozen = pipeline.after_file(queued)
        raise ValueError(
            f"{pipeline.label(queued)}: a stage it was queued after, {after.run}, is gone (no run there now); to "
            f"resume it without waiting for its stages: rm {frozen}, then hpc-train resume {queued}"
        )
    if not runs:
        raise ValueError(
            f"--after {after.run}: not a run or a sweep (no config.yaml of a submit, no sweep.json there); give a "
            f"run directory or a sweep directory that hpc-train status lists, e.g. --after runs/pretrain-1"
        )
    if denied := next((r.unreadable for r in runs if r.unreadable), ""):
        raise ValueError(f"--after {after.run}: {denied}")
    return runs


def facts(
    pairs: list[tuple[After, Run]],
    states: dict[str, str] | None,
    journals: dict[Path, list[journal.Event]] | None = None,
) -> list[Upstream]:
    """Each run as pipeline.dependency needs it, from its journal (`journals`, when read already) and Slurm's
    `states` (slurm.job_states; None when Slurm did not answer: then only the journal tells). A run will not come
    back by itself once its journal says it stopped (since its last resume), or once its job ended without its
    finish (an admin's scancel, a node lost for good)."""
    out = []
    for after, r in pairs:
        events = journal.read(r.run_dir) if journals is None else journals[r.run_dir]
        finished = journal.finished(events) is not None
        state = (states or {}).get(r.job_id, "")
        ended = states is not None and bool(r.job_id) and state not in slurm.ACTIVE_STATES
        stopped = ""
        if not finished and (journal.stopped(events) or ended):
            stopped = journal.stop_reason(events, r.job_id, state)
        out.append(Upstream(r.label, str(r.run_dir), after.kind, r.executor, r.job_id, finished, stopped))
    return out


def upstreams(afters: list[After], queued: Path | None = None) -> list[Upstream]:
    """Every run of these stages as it stands now: one Slurm query for all of their jobs (`queued`: runs_of's)."""
    pairs = [(a, r) for a in afters for r in runs_of(a, queued)]
    journals = {r.run_dir: journal.read(r.run_dir) for _, r in pairs}
    return facts(pairs, _states([r for _, r in pairs], journals), journals)


def _states(runs: list[Run], journals: dict[Path, list[journal.Event]], retries: int = 3) -> dict[str, str]:
    """Slurm's states of these runs' jobs, asked only of those whose journal does not say already how they ended
    (finished, or stopped since the last resume): Slurm forgets a job 5 minutes after it ended (MinJobAge), and
    without slurmdbd sacct then fails for it, though the stage finished days ago. SlurmError when Slurm does not
    answer for the others."""
    ended = {r.run_dir for r in runs if journal.finished(journals[r.run_dir]) or journal.stopped(journals[r.run_dir])}
    ids = [r.job_id for r in runs if r.executor == "slurm" and r.job_id and r.run_dir not in ended]
    return slurm.job_states(ids, retries=retries) if ids else {}


def dependency(afters: list[After], queued: Path | None = None) -> tuple[str, list[Upstream]]:
    """(sbatch's --dependency for a run queued after these stages now, their runs): ValueError when one can never
    satisfy it (pipeline.dependency). `queued`: the run queued again (resume), whose after.json names them."""
    found = upstreams(afters, queued)
    return pipeline.dependency(found), found


def waits_for(found: list[Upstream]) -> str:
    """What a run just queued waits for, in words: "after pretrain-1 (job 12, once it finished)"."""
    parts = []
    for u in found:
        if u.finished or u.stopped:
            parts.append(f"{u.label} ({'finished' if u.finished else 'stopped'}: nothing to wait for)")
        else:
            parts.append(f"{u.label} (job {u.job_id}, once it {'finished' if u.kind == 'ok' else 'ended'})")
    return "after " + ", ".join(parts) if parts else ""


def chain(runs: list[Run]) -> dict[Path, list[dict[str, Any]]]:
    """For each of these runs queued after others, its stages as `status` shows them: per --after path its label,
    kind, and each of its runs' job and state (COMPLETED once finished, Slurm's otherwise, "stopped" with why).
    One Slurm query for every stage's job; a sweep's after.json is read once for all its trials."""
    by_folder: dict[Path, list[After]] = {}
    wanted: dict[Path, list[After]] = {}
    for r in runs:
        folder = r.run_dir.parent if "/" in r.label else r.run_dir  # a trial's: its sweep's, one stat per sweep
        if folder not in by_folder:
            by_folder[folder] = [] if r.unreadable else pipeline.read_after(folder)
        if by_folder[folder]:
            wanted[r.run_dir] = by_folder[folder]
    if not wanted:
        return {}
    stages: dict[After, list[Run]] = {}
    for after in {a for afters in wanted.values() for a in afters}:
        try:
            stages[after] = runs_of(after)
        except ValueError:  # deleted since: said in its row
            stages[after] = []
    every = {r.run_dir: r for found in stages.values() for r in found}
    journals = {run_dir: journal.read(run_dir) for run_dir in every}
    states: dict[str, str] | None
    try:
        states = _states(list(every.values()), journals, retries=1)
    except slurm.SlurmError:  # status says once that Slurm did not answer; the chain says "unknown"
        states = None
    shown = {a: facts([(a, r) for r in found], states, journals) for a, found in stages.items()}
    return {run_dir: [_stage(a, shown[a], states or {}) for a in afters] for run_dir, afters in wanted.items()}


def _stage(after: After, found: list[Upstream], states: dict[str, str]) -> dict[str, Any]:
    path = Path(after.run)
    runs = [
        {
            "run": u.label,
            "job_id": u.job_id,
            "state": "COMPLETED" if u.finished else states.get(u.job_id) or ("stopped" if u.stopped else "unknown"),
            "stopped": u.stopped,
        }
        for u in found
    ]
    name = path.name if (path / "sweep.json").exists() or not runs else runs[0]["run"]
    return {"stage": name, "run_dir": after.run, "kind": after.kind, "runs": runs}


def chain_text(stages: list[dict[str, Any]]) -> str:
    """status's line for a run queued after others: "after pretrain-1:ok (RUNNING, job 12), s-1:any (3 COMPLETED)"."""
    parts = []
    for s in stages:
        runs = s["runs"]
        if not runs:
            what = "gone: no run there now"
        elif len(runs) == 1:
            r = runs[0]
            what = r["state"] + (f", job {r['job_id']}" if r["state"] not in ("COMPLETED", "stopped") else "")
        else:
            counts: dict[str, int] = {}
            for r in runs:
                counts[r["state"]] = counts.get(r["state"], 0) + 1
            what = ", ".join(f"{n} {state}" for state, n in counts.items())
        parts.append(f"{s['stage']}:{s['kind']} ({what})")
    return "after " + ", ".join(parts)


def after_resume(run_dir: Path) -> tuple[list[str], list[Path]]:
    """`hpc-train resume` of a stage just queued it under a new job. Each run queued after it that Slurm still holds
    pending now waits for that job (`scontrol update Dependency=`, a `repointed` event); each that never started
    and ended (cancelled because the stage stopped, by us or by Slurm's --kill-on-invalid-dep) is returned, for
    resume to queue again. Returns (sentences, runs to queue again)."""
    deps = pipeline.dependents(run_dir)
    try:
        states = slurm.job_states([j for j, _ in deps.values()]) if deps else {}
    except slurm.SlurmError as e:
        return [f"the runs queued after {pipeline.label(run_dir)} were not looked at: {e}"], []
    lines, again = [], []
    for dep, (job_id, _) in deps.items():
        dep_dir, state = Path(dep), states.get(job_id, "")
        try:
            events = journal.read(dep_dir) if dep_dir.is_dir() else []
            if not events and not dep_dir.is_dir():
                continue
            if state == "PENDING" and pipeline.waiting(events, state):
                lines.append(_repoint(dep_dir, job_id, run_dir, events))
            elif state not in slurm.ACTIVE_STATES and needs_queueing(dep_dir, events):
                again.append(dep_dir)
        except (OSError, ValueError) as e:  # another user's run (PermissionError), a damaged path
            lines.append(f"{pipeline.label(dep_dir)} (job {job_id}) was not looked at: {e}")
    return lines, again


def needs_queueing(dep_dir: Path, events: list[journal.Event]) -> bool:
    """A run queued after others that never started since it was last queued and is not queued now, though nobody
    cancelled it by hand: a stage's stop (or Slurm's --kill-on-invalid-dep) ended it (pure)."""
    since = journal.since_resume(events)
    return not journal.finished(events) and not journal.cancelled(events) and not journal.named(since, journal.START)


def to_queue_again(dep_dir: Path) -> bool:
    """needs_queueing, and its job (one Slurm query) is not queued or running now."""
    found = find_runs(dep_dir)
    if len(found) != 1 or found[0].unreadable:
        return False
    job_id = found[0].job_id
    state = slurm.job_states([job_id]).get(job_id, "") if job_id else ""
    return state not in slurm.ACTIVE_STATES and needs_queueing(dep_dir, journal.read(dep_dir))


def _repoint(dep_dir: Path, job_id: str, stage: Path, events: list[journal.Event]) -> str:
    """A pending dependent's dependency computed again from its stages now (the resumed stage's new job)."""
    who = f"{pipeline.label(dep_dir)} (job {job_id})"
    try:
        value, _ = dependency(pipeline.read_after(dep_dir), dep_dir)
    except (ValueError, slurm.SlurmError) as e:
        return f"{who} still waits for {pipeline.label(stage)}'s old job: {e}"
    err = slurm.update_job(job_id, {"Dependency": value})
    if err:
        return f"{who} could not be pointed at {pipeline.label(stage)}'s new job: {err}"
    attempt = journal.current_attempt(events)
    journal.log(dep_dir, journal.REPOINTED, -1, job_id, attempt, upstream=str(stage), dependency=value)
    return f"{who} now waits for {value or 'nothing: its stages finished'}"
