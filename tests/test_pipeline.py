"""Pipelines without Slurm (`submit --after`, pipeline.py, stages.py): the dependency a run gets from its stages'
state, on seeded random stages; what the user reads for a bad --after; what a stage's stop tells the runs queued
after it; {after.ckpt} and checkpoint.init_from=STAGE. tests/test_slurm_pipeline.py runs them on the cluster."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import HPC_TRAIN, fake_clients, names, refused, run, warned

from hpc_train import journal, pipeline, stages
from hpc_train.paths import MARKER
from hpc_train.pipeline import After, Upstream
from hpc_train.runs import Run


def random_upstream(rng: random.Random, i: int) -> Upstream:
    finished = rng.random() < 0.3
    stopped = "" if finished or rng.random() < 0.5 else rng.choice(["budget spent", "cancelled", "node lost"])
    job = "" if rng.random() < 0.05 else rng.choice([str(100 + i), f"{200 + i % 3}_{i}", str(300 + i % 4)])
    return Upstream(f"r{i}", f"/runs/r{i}", rng.choice(pipeline.KINDS), "slurm", job, finished, stopped)


def test_the_dependency_from_random_stages_keeps_its_invariants() -> None:
    """A finished stage never appears (Slurm forgets its job); one stopped for good refuses :ok with the fix and
    satisfies :any; every other job id appears exactly once, :ok winning over :any; a never-queued one refuses."""
    for seed in range(500):
        check_random_stages(random.Random(seed))


def check_random_stages(rng: random.Random) -> None:
    ups = [random_upstream(rng, i) for i in range(rng.randint(0, 6))]
    stopped_ok = [u for u in ups if u.stopped and u.kind == "ok"]
    unqueued = [u for u in ups if not u.finished and not u.stopped and not u.job_id]
    if stopped_ok or unqueued:
        with pytest.raises(ValueError) as e:
            pipeline.dependency(ups)
        first = next(u for u in ups if u in stopped_ok or u in unqueued)
        assert str(e.value).startswith(f"--after {first.label}: ")
        if first in stopped_ok:
            assert f"resume it first (hpc-train resume {first.run_dir})" in str(e.value)
        return
    value = pipeline.dependency(ups)
    waited = {u.job_id: u.kind for u in ups if not u.finished and not u.stopped}
    for u in ups:
        if not u.finished and not u.stopped and u.kind == "ok":
            waited[u.job_id] = "ok"
    parts = dict(p.split(":", 1) for p in value.split(",")) if value else {}
    named = [(kind.removeprefix("after"), j) for kind, jobs in parts.items() for j in jobs.split(":")]
    assert sorted(named) == sorted((k, j) for j, k in waited.items())  # each live job once, of its strongest kind
    assert set(parts) <= {"afterok", "afterany"} and list(parts) == sorted(parts, reverse=True)  # ok first


def test_a_local_stage_is_refused() -> None:
    local = Upstream("l-1", "/runs/l-1", "ok", "local", "4242", False, "")
    with pytest.raises(ValueError, match=r"^--after l-1: it ran on the local executor, which Slurm cannot wait for"):
        pipeline.dependency([local])


@pytest.mark.parametrize(
    "args, message",
    [
        (["--after", "runs/x:maybe"], r"--after runs/x:maybe: 'maybe' is not a kind of dependency; write runs/x:ok"),
        (["--after", "a,,b"], r"--after 'a,,b' has an empty entry; give RUN\[:ok\|any\]"),
        (["--after", "a:ok", "--after", "a:any"], r"--after names a twice, as :ok and :any; give it once"),
        (["--after", "nope", "cluster=dev"], r"--after \S+/nope: not a run or a sweep \(no config.yaml of a submit"),
        (["--after", "nope"], r"--after needs Slurm \(cluster=dev, or your cluster\): the local executor runs one"),
        (
            ["--", "python", "-c", "pass", "{after.ckpt}"],
            r"\{after.ckpt\} is the final checkpoint of the run this one is queued after; name that run with --after",
        ),
    ],
)
def test_a_bad_after_is_refused_with_the_fix(tmp_path: Path, args: list[str], message: str) -> None:
    proc = run([HPC_TRAIN, "submit", f"out_dir={tmp_path / 'out'}", *args], cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.startswith("hpc-train submit: error:") and re.search(message, proc.stderr), proc.stderr
    assert not (tmp_path / "out").exists()  # nothing written, nothing queued


def test_after_values_parse_repeated_and_comma_separated(tmp_path: Path) -> None:
    odd = tmp_path / "a:b"  # a path with a colon that exists is taken whole
    odd.mkdir()
    got = pipeline.parse([f"{tmp_path}/p-1,{tmp_path}/e-1:any", f"{odd}", f"{tmp_path}/p-1:ok"])
    assert got == [After(f"{tmp_path}/p-1", "ok"), After(f"{tmp_path}/e-1", "any"), After(str(odd), "ok")]


def make_run(root: Path, name: str, job_id: str, *events: tuple[str, dict]) -> Path:
    """A Slurm run's folder as submit leaves it, with these events."""
    run_dir = root / name
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text("cluster: {executor: slurm}\n")
    (run_dir / "submission.json").write_text(json.dumps({"executor": "slurm", "job_id": job_id}))
    for event, fields in events:
        journal.log(run_dir, event, fields.pop("step", -1), job_id, fields.pop("restart", 0), **fields)
    return run_dir


def test_a_stage_is_stopped_for_good_by_its_journal_or_by_slurm(tmp_path: Path) -> None:
    """stages.facts: a finish wins over every Slurm state; a `stopped` since the last resume wins over a running job
    (its ranks are leaving); a job that ended without a finish (an admin's scancel) is stopped too; a requeued
    or resumed one is live."""
    done = make_run(tmp_path, "done-1", "11", (journal.FINISH, {"step": 60}))
    stop = make_run(tmp_path, "stop-1", "12", (journal.STOPPED, {"reason": "failure budget spent"}))
    back = make_run(tmp_path, "back-1", "20", (journal.STOPPED, {"reason": "x"}), (journal.RESUME, {"restart": 1}))
    killed = make_run(tmp_path, "killed-1", "13")
    live = make_run(tmp_path, "live-1", "14", (journal.REQUEUE, {"reason": "preempt"}))
    states = {"11": "FAILED", "12": "RUNNING", "20": "PENDING", "13": "CANCELLED", "14": "PENDING"}
    pairs = [(After(str(d), "ok"), stages.runs_of(After(str(d)))[0]) for d in (done, stop, back, killed, live)]
    got = {Path(u.run_dir).name: (u.finished, u.stopped) for u in stages.facts(pairs, states)}
    finished, why = got.pop("killed-1")
    assert not finished and names(why, "job 13", "CANCELLED", "events.jsonl")
    assert got == {
        "done-1": (True, ""),
        "stop-1": (False, "failure budget spent"),
        "back-1": (False, ""),
        "live-1": (False, ""),
    }
    assert pipeline.dependency(stages.facts(pairs[2:3] + pairs[4:], states)) == "afterok:20:14"
    unanswered = {Path(u.run_dir).name: u.stopped for u in stages.facts(pairs, None)}  # Slurm down: the journal only
    assert unanswered == {"done-1": "", "stop-1": "failure budget spent", "back-1": "", "killed-1": "", "live-1": ""}


def test_a_folder_of_runs_is_not_a_stage(tmp_path: Path) -> None:
    make_run(tmp_path, "a-1", "1")
    with pytest.raises(
        ValueError, match=rf"--after {tmp_path}: a folder of 1 runs, not one; name the run or the sweep"
    ):
        stages.runs_of(After(str(tmp_path)))
    with pytest.raises(ValueError, match=r"not a run or a sweep \(no config.yaml of a submit, no sweep.json there\)"):
        stages.runs_of(After(str(tmp_path / "none")))


def test_the_last_registration_of_a_dependent_wins_and_a_trial_hears_its_sweeps(tmp_path: Path) -> None:
    sweep = tmp_path / "s-1"
    (sweep / "0000").mkdir(parents=True)
    (sweep / "sweep.json").write_text("{}")
    pipeline.register([After(str(sweep), "any")], {"/runs/eval-1": "7"})
    pipeline.register([After(str(sweep / "0000"), "ok")], {"/runs/ft-1": "8"})
    pipeline.register([After(str(sweep / "0000"), "ok")], {"/runs/ft-1": "9"})  # ft-1 resumed: its new job
    with open(sweep / "0000" / "dependents.jsonl", "a") as f:
        f.write('{"time": 9e9, "runs": {"/runs/x": ')  # torn by a writer killed mid-line
    assert pipeline.dependents(sweep / "0000") == {"/runs/eval-1": ("7", "any"), "/runs/ft-1": ("9", "ok")}
    assert pipeline.dependents(sweep) == {"/runs/eval-1": ("7", "any")}


def test_a_dependent_waits_until_it_started_stopped_or_was_cancelled() -> None:
    ev = lambda name, restart=0: {"time": 1.0, "event": name, "step": -1, "restart": restart}  # noqa: E731
    assert pipeline.waiting([], "PENDING") and pipeline.waiting([], "CANCELLED") and pipeline.waiting([], "")
    assert not pipeline.waiting([], "RUNNING") and not pipeline.waiting([], "COMPLETED")
    assert not pipeline.waiting([ev(journal.START)], "PENDING")
    assert not pipeline.waiting([ev(journal.STOPPED)], "CANCELLED")  # told already
    assert not pipeline.waiting([ev(journal.CANCEL)], "CANCELLED")  # a person's cancel
    assert pipeline.waiting([ev(journal.STOPPED), ev(journal.RESUME, 1)], "PENDING")  # resumed since


def test_settling_without_an_answer_from_slurm_still_tells_each_dependent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stop path never raises: squeue and scancel failing (here: no Slurm at all), the :ok dependent still gets
    its `stopped` with the reason and the fix, the one queued after it the cascade's, the :any one `released`;
    a second settle (the job's stop, then `hpc-train cancel`) adds nothing."""
    monkeypatch.setenv("PATH", str(tmp_path / "nobin"))
    up = make_run(tmp_path, "pre-1", "10")
    ev = make_run(tmp_path, "ev-1", "11")
    ft = make_run(tmp_path, "ft-1", "12")
    anyone = make_run(tmp_path, "any-1", "13")
    pipeline.register([After(str(up), "ok")], {str(ev): "11"})
    pipeline.register([After(str(up), "any")], {str(anyone): "13"})
    pipeline.register([After(str(ev), "ok")], {str(ft): "12"})
    said = pipeline.settle_dependents(up, "failure budget spent")
    assert [s.split(":")[0] for s in said] == ["ev-1 (job 11)", "any-1 (job 13)", "ft-1 (job 12)"]
    stopped = journal.stopped(journal.read(ev))
    assert (stopped["upstream"], stopped["root"], stopped["by"]) == (str(up), str(up), "pipeline")
    assert names(stopped["reason"], "cancelled before it started", "pre-1", "failure budget spent", f"resume {up}`")
    cascade = journal.stopped(journal.read(ft))
    assert (cascade["upstream"], cascade["root"], cascade["by"]) == (str(ev), str(up), "pipeline")
    assert names(
        cascade["reason"], "cancelled before it started", "ev-1", "cancelled as pre-1 stopped", f"resume {up}`"
    )
    (released,) = journal.named(journal.read(anyone), journal.RELEASED)
    assert (released["upstream"], released["root"], released["by"]) == (str(up), str(up), "pipeline")
    assert names(released["reason"], "pre-1", "(:any)", "failure budget spent", "does not wait")
    assert pipeline.settle_dependents(up, "cancelled") == []
    assert pipeline.settle_dependents(tmp_path / "nothing-after-it", "x") == []


# Every client records its command line, then hangs as a controller that does not answer would
HANGING = {name: f'echo "{name} $*" >> "$STATE/calls"; exec sleep 30' for name in ("squeue", "sacct", "scancel")}


def a_cascade(tmp_path: Path) -> tuple[Path, Path, Path, Path]:
    """pre-1 <- ev-1 (:ok) <- ft-1 (:ok), and pre-1 <- any-1 (:any), each registered as submit does."""
    up, ev, ft, anyone = (
        make_run(tmp_path, f"{n}-1", str(j)) for n, j in (("pre", 10), ("ev", 11), ("ft", 12), ("any", 13))
    )
    pipeline.register([After(str(up), "ok")], {str(ev): "11"})
    pipeline.register([After(str(up), "any")], {str(anyone): "13"})
    pipeline.register([After(str(ev), "ok")], {str(ft): "12"})
    return up, ev, ft, anyone


def test_the_stop_path_asks_slurm_nothing_and_cancels_the_cascade_in_one_scancel_of_5_s(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ask_slurm=False (requeue.apply's stop, inside what the time limit leaves): no squeue or sacct, the cascade told
    from the journals alone, then one scancel of every :ok run, given up after 5 s (before: a query and a scancel a
    level, 21 s a level measured, each of them retried)."""
    bin_dir, state = fake_clients(tmp_path, HANGING)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    up, ev, ft, anyone = a_cascade(tmp_path)
    began = time.monotonic()
    said = pipeline.settle_dependents(up, "failure budget spent", ask_slurm=False)
    assert time.monotonic() - began < 8  # the scancel's 5 s and the journals
    assert (state / "calls").read_text() == "scancel 11 12\n"
    assert [s.split(":")[0] for s in said] == ["ev-1 (job 11)", "any-1 (job 13)", "ft-1 (job 12)"]
    assert journal.stopped(journal.read(ft))["root"] == str(up)
    assert [e["upstream"] for e in journal.named(journal.read(anyone), journal.RELEASED)] == [str(up)]


def test_damaged_dependents_records_are_skipped_and_settling_never_raises(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    """A dependents.jsonl edited by hand (a time that is a string, a path with a NUL byte, runs that are a list, an
    unknown kind): the records it cannot use are skipped, `hpc-train cancel` tells the others (before: a traceback
    from the sort). Whatever else fails while settling is a warning, never the stop path's exception."""
    bin_dir, state = fake_clients(tmp_path, FORGOTTEN)
    up, ev, ft, any1 = a_cascade(tmp_path)
    with open(up / "dependents.jsonl", "a") as f:
        for record in (
            {"time": "yesterday", "kind": "ok", "runs": {str(ev): "21"}},
            {"time": 1, "runs": {f"{tmp_path}/x\0y": "5"}},
            {"time": 2, "runs": [str(ft)]},
            {"time": 3, "kind": "maybe", "runs": {str(ft): "6"}},
            {"time": None, "runs": {str(ft): ["7"]}},
        ):
            f.write(json.dumps(record) + "\n")
    assert pipeline.dependents(up) == {str(ev): ("11", "ok"), str(tmp_path / "any-1"): ("13", "any")}
    proc = run([HPC_TRAIN, "cancel", str(up)], env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"})
    assert proc.returncode == 0 and proc.stderr == "", proc.stdout + proc.stderr
    assert proc.stdout.splitlines()[:2] == [
        "cancelled 1 job(s): 10",
        f"ev-1 (job 11): {journal.stopped(journal.read(ev))['reason']}",
    ]

    def broken(*args: Any) -> Any:
        raise RuntimeError("a bug")

    caplog.clear()
    monkeypatch.setattr(journal, "read", broken)  # for each dependent: (dependent, stage, error)
    assert pipeline.settle_dependents(up, "x", ask_slurm=False) == []
    assert warned(caplog, "hpc_train.pipeline") == [(str(d), str(up), "a bug") for d in (ev, any1)]
    monkeypatch.setattr(pipeline, "dependents", broken)  # for all of them: (stage, error)
    assert pipeline.settle_dependents(up, "x") == []
    assert warned(caplog, "hpc_train.pipeline") == [(str(up), "a bug")]


# squeue has forgotten every job (it ended over 5 minutes ago), accounting answers for none; scancel says why it
# cannot when $STATE/refuse exists (another user's job), and every call is recorded
FORGOTTEN = {
    "squeue": 'echo "squeue $*" >> "$STATE/calls"; echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1',
    "sacct": 'echo "sacct $*" >> "$STATE/calls"',
    "scancel": """echo "scancel $*" >> "$STATE/calls"
if [ -e "$STATE/refuse" ]; then echo "scancel: error: Kill job error on job id $1: Access/permission denied" >&2; exit 1; fi""",
}


def test_cancel_scancels_the_stage_first_then_settles_its_runs_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """runs.cancel: a scancel of the stage that fails leaves the runs queued after it as they were (before: told and
    cancelled, the stage running on); a sweep's trials cancelled together settle the runs queued after the sweep
    with one squeue (before: one a trial)."""
    from hpc_train import runs, slurm

    bin_dir, state = fake_clients(tmp_path, FORGOTTEN)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    up, ev, _, _ = a_cascade(tmp_path)
    (state / "refuse").touch()
    with pytest.raises(slurm.SlurmError, match="Access/permission denied"):
        runs.cancel(stages.runs_of(After(str(up))))
    assert journal.read(ev) == [] and (state / "calls").read_text() == "scancel 10\n"

    (state / "refuse").unlink()
    (state / "calls").unlink()
    sweep = tmp_path / "s-1"
    trials = [make_run(sweep, f"{i:04d}", f"40_{i}") for i in range(3)]
    (sweep / "sweep.json").write_text("{}")
    dep = make_run(tmp_path, "after-sweep-1", "41")
    pipeline.register([After(str(sweep), "ok")], {str(dep): "41"})
    cancelled, said = runs.cancel([Run(t, f"s-1/{t.name}", f"40_{t.name[-1]}", "slurm", sweep) for t in trials])
    assert cancelled == ["40_0", "40_1", "40_2"] and [s.split(":")[0] for s in said] == ["after-sweep-1 (job 41)"]
    calls = (state / "calls").read_text().splitlines()
    assert [c.split()[0] for c in calls] == ["scancel", "squeue", "sacct", "scancel"], calls
    assert calls[0] == "scancel 40_0 40_1 40_2" and calls[-1] == "scancel 41"


def committed_step(run_dir: Path, step: int) -> Path:
    folder = run_dir / "checkpoints" / f"step_{step:06d}"
    folder.mkdir(parents=True)
    files = {".metadata": {"bytes": 0, "sha256": ""}, "rank_00000.pt": {"bytes": 0, "sha256": ""}}
    (folder / MARKER).write_text(json.dumps({"files": files, "world_size": 1, "step": step}))
    return folder


# squeue holds job 1 running and has forgotten every other; accounting says job 3 was cancelled (an admin's scancel)
STAGE_JOBS = {
    "squeue": """case "$*" in
  *"-j 1 "*) echo "1|RUNNING";;
  *) echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1;;
esac""",
    "sacct": "printf '3|CANCELLED by 0\\n'",
}


def test_after_ckpt_is_the_first_stages_final_checkpoint_found_when_the_job_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Left as written at submit (no after.json yet) and while the stage's job is queued or running; then its newest
    committed step folder (a script stage: the newest file it recorded). A stage that ended without one, finished,
    stopped or gone from Slurm without a word, stops the run (Unrecoverable): no requeue gives it a checkpoint, and
    the script never gets the placeholder as written."""
    from hpc_train.preempt import Unrecoverable
    from hpc_train.script import command

    bin_dir, _ = fake_clients(tmp_path, STAGE_JOBS)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    up, script_up, dep = make_run(tmp_path, "pre-1", "1"), make_run(tmp_path, "scr-1", "2"), tmp_path / "ev-1"
    config = {"script": {"cmd": ["python", "eval.py", "--ckpt", "{after.ckpt}"], "resume_args": []}}
    assert command(config, dep, resuming=False)[-1] == "{after.ckpt}"
    dep.mkdir()
    pipeline.freeze_after(dep, [After(str(up))], private=False)
    assert command(config, dep, resuming=False)[-1] == "{after.ckpt}"  # pre-1 runs on: none yet
    committed_step(up, 20)
    final = committed_step(up, 60)
    assert command(config, dep, resuming=False)[-1] == str(final)
    with pytest.raises(ValueError, match=r"ev-1 was submitted --after"):
        pipeline.freeze_after(dep, [After(str(script_up))], private=False)  # frozen, as config.yaml
    other = tmp_path / "ev-2"
    other.mkdir()
    pipeline.freeze_after(other, [After(str(script_up))], private=False)
    journal.log(script_up, journal.FINISH, 5, "2", 0)
    with pytest.raises(Unrecoverable, match=r"scr-1 ended without a checkpoint \(no committed step folder.*this run "):
        command(config, other, resuming=False)
    (script_up / "ckpt.pt").write_bytes(b"x")
    journal.log(script_up, journal.SCRIPT_CHECKPOINT, 5, "2", 0, path=str(script_up / "ckpt.pt"), mtime=1.0)
    assert command(config, other, resuming=False)[-1] == str(script_up / "ckpt.pt")
    killed, third = make_run(tmp_path, "killed-1", "3"), tmp_path / "ev-3"
    third.mkdir()
    pipeline.freeze_after(third, [After(str(killed), "any")], private=False)
    with pytest.raises(Unrecoverable) as e:
        command(config, third, resuming=False)
    assert names(
        str(e.value),
        f"{{after.ckpt}}: {killed} ended",
        "job 3: CANCELLED",
        "without a checkpoint",
        "script.checkpoint",
        "script_helper.committed()",
        f"hpc-train resume {third}",
    )


def test_init_from_a_stage_stays_its_run_directory_and_is_not_pinned(tmp_path: Path) -> None:
    """checkpoint.init_from=RUN with --after RUN: accepted without a checkpoint yet, frozen as the run directory
    (the job loads its final checkpoint, pipeline.final_checkpoint); the model shape is still checked now."""
    from hpc_train.plan import init_from_checkpoint
    from hpc_train.submit import pin_init_from

    up = make_run(tmp_path, "pre-1", "1")
    (up / "config.yaml").write_text("model: {d_model: 64, n_layers: 2}\n")
    config = {"fn": {"_target_": None}, "model": {"d_model": 64, "n_layers": 2, "vocab_size": 256, "seq_len": 32}}
    with pytest.raises(ValueError, match=r"no committed checkpoint under"):
        init_from_checkpoint(str(up), config)  # not a stage: as before
    assert init_from_checkpoint(str(up / "checkpoints"), config, frozenset({up})) == up
    with pytest.raises(ValueError, match=r"model.d_model=128 but the checkpoint has 64"):
        init_from_checkpoint(str(up), {**config, "model": {**config["model"], "d_model": 128}}, frozenset({up}))
    configs = [{"checkpoint": {"init_from": str(up)}}]
    pin_init_from(tmp_path / "ft-1", configs)
    assert configs[0]["checkpoint"]["init_from"] == str(up) and not (tmp_path / "ft-1").exists()
    final = committed_step(up, 40)
    assert pipeline.final_checkpoint(up) == final and pipeline.final_checkpoint(final) == final


def test_status_says_the_chain_in_one_line(tmp_path: Path) -> None:
    done = make_run(tmp_path, "pre-1", "1", (journal.FINISH, {"step": 60}))
    live = make_run(tmp_path, "ev-1", "2")
    dep = make_run(tmp_path, "ft-1", "3")
    pipeline.freeze_after(dep, [After(str(done)), After(str(live), "any")], private=False)
    runs = [Run(dep, "ft-1", "3", "slurm", dep / "submitit"), Run(live, "ev-1", "2", "slurm", live / "submitit")]
    shown = [
        stages._stage(a, stages.facts([(a, stages.runs_of(a)[0])], {"2": "RUNNING"}), {"2": "RUNNING"})
        for a in pipeline.read_after(dep)
    ]
    assert [(s["stage"], s["kind"], [(r["state"], r["job_id"]) for r in s["runs"]]) for s in shown] == [
        ("pre-1", "ok", [("COMPLETED", "1")]),
        ("ev-1", "any", [("RUNNING", "2")]),
    ]
    text = stages.chain_text(shown)
    assert "\n" not in text and names(text, "pre-1:ok (COMPLETED)", "ev-1:any (RUNNING, job 2)")
    assert [r.run_dir for r in runs if pipeline.read_after(r.run_dir)] == [dep]


def test_every_stop_for_good_tells_the_runs_queued_after_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Review: only requeue.apply's STOP settled a stage's dependents; a cause no requeue mends (failure._stop: an
    Unrecoverable, a config that fails, an import error before progress) and an unrunnable script stopped the stage
    with its :ok dependents left to Slurm's silent cancel. Each now settles them, never raising."""
    from types import SimpleNamespace

    from hpc_train import failure, journal, pipeline, requeue
    from hpc_train.paths import RunPaths
    from hpc_train.task import Pulse, Task

    settled: list[tuple[str, str]] = []
    monkeypatch.setattr(pipeline, "settle_dependents", lambda run_dir, why, **k: settled.append((run_dir, why)) or [])
    env = SimpleNamespace(executor="slurm", job_id="7", restart_count=0)
    verdict, _ = failure._stop(RunPaths(tmp_path), env, Task(Pulse()), "ImportError: no module named x")
    assert verdict == "stop" and settled == [(tmp_path, "ImportError: no module named x")]
    assert journal.stopped(journal.read(tmp_path)) is not None

    def broken(*a: object, **k: object) -> list[str]:
        raise ValueError("embedded null byte")  # a damaged dependents.jsonl

    monkeypatch.setattr(pipeline, "settle_dependents", broken)
    requeue.settle(RunPaths(tmp_path), "budget spent")  # logged, never raised on the stop path


def test_after_ckpt_after_a_sweep_of_one_trial_is_refused_at_submit(tmp_path: Path) -> None:
    """The job looks for {after.ckpt} in the path --after names, and a sweep directory holds no checkpoint: refused
    for a sweep of one trial too (before: let through, its job then found none)."""
    sweep = tmp_path / "s-1"
    trial = make_run(sweep, "0000", "")
    (sweep / "sweep.json").write_text(json.dumps({"trials": [{"run_dir": str(trial), "job_id": ""}]}))
    cmd = [HPC_TRAIN, "submit", "cluster=dev", f"out_dir={tmp_path / 'out'}", "--after", str(sweep)]
    proc = run([*cmd, "--", "python", "-c", "pass", "{after.ckpt}"], cwd=tmp_path)
    assert refused(proc, "submit", "{after.ckpt}", "first --after", f"{sweep} is a sweep", f"--after {sweep}/0000")


def test_a_sweep_first_queued_without_after_is_not_given_one_at_a_resubmit(tmp_path: Path) -> None:
    """--sweep-dir DIR --after X where DIR's trials were queued without --after: refused (before: after.json written,
    and the trials queued earlier looked as if they waited for X)."""
    sweep, up = tmp_path / "s-1", make_run(tmp_path, "pre-1", "1")
    sweep.mkdir()
    (sweep / "sweep.json").write_text("{}")
    with pytest.raises(ValueError) as e:
        pipeline.freeze_after(sweep, [After(str(up))], private=False)
    assert names(str(e.value), f"--sweep-dir {sweep}", "without --after", f"new sweep after {up}", "drop --sweep-dir")
    assert not (sweep / "after.json").exists()
    pipeline.freeze_after(sweep, [], private=False)  # without --after, as first submitted: fine


# Slurm without slurmdbd: squeue has forgotten the jobs that ended (MinJobAge) and holds job 2 running; sacct fails
NO_ACCOUNTING = {
    "squeue": """case "$*" in
  *"-j 2 "*) echo "2|RUNNING";;
  *) echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1;;
esac""",
    "sacct": 'echo "sacct: error: Slurm accounting storage is disabled" >&2; exit 1',
}


def test_a_stage_whose_journal_says_how_it_ended_is_not_asked_about(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--after a stage that finished (or stopped) long ago, on a cluster without slurmdbd: Slurm is asked only about
    the stages still running, so neither the dependency nor status's chain fails on sacct (before: SlurmError)."""
    bin_dir, _ = fake_clients(tmp_path, NO_ACCOUNTING)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    done = make_run(tmp_path, "pre-1", "1", (journal.FINISH, {"step": 60}))
    stop = make_run(tmp_path, "bad-1", "3", (journal.STOPPED, {"reason": "failure budget spent"}))
    live = make_run(tmp_path, "ev-1", "2")
    afters = [After(str(done)), After(str(stop), "any"), After(str(live))]
    assert stages.dependency(afters)[0] == "afterok:2"
    dep = make_run(tmp_path, "ft-1", "4")
    pipeline.freeze_after(dep, afters, private=False)
    chain = stages.chain([Run(dep, "ft-1", "4", "slurm", dep / "submitit")])
    assert [(s["stage"], s["kind"], [(r["state"], r["job_id"]) for r in s["runs"]]) for s in chain[dep]] == [
        ("pre-1", "ok", [("COMPLETED", "1")]),
        ("bad-1", "any", [("stopped", "3")]),
        ("ev-1", "ok", [("RUNNING", "2")]),
    ]


def slurm_run(root: Path, name: str, job_id: str) -> Path:
    """A Slurm run as submit leaves it, with the whole frozen config (what resume loads)."""
    import yaml

    from hpc_train.config import compose_trials

    run_dir = make_run(root, name, job_id)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(compose_trials([["cluster=slurm"]])[0][0]))
    return run_dir


# The stage's job 100 and its dependent's job 200 ended (accounting has them), resume's sbatch queues job 556, which
# squeue then holds pending
RESUMED = {
    "squeue": """case "$*" in
  *"-j 556 "*) echo "556|PENDING";;
  *) echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1;;
esac""",
    "sacct": "printf '100|CANCELLED by 1000\\n200|CANCELLED by 0\\n'",
    "sbatch": 'echo "Submitted batch job 556"',
}


def test_resume_of_a_stage_says_each_dependent_it_could_not_queue_again_and_queues_the_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """hpc-train resume STAGE: once the stage is queued again, a dependent that cannot be looked at (here a sweep's
    trial whose sweep.json is damaged: ValueError) is a sentence, and the next one is still queued again (before: the
    error escaped, exit 2 after the stage was queued, its "resumed as job" line never printed)."""
    from hpc_train import resume

    bin_dir, _ = fake_clients(tmp_path, RESUMED)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setattr(resume, "validate_live", lambda *a, **k: None)
    stage = slurm_run(tmp_path, "sl-1", "100")
    journal.log(stage, journal.STOPPED, 5, "100", 0, reason="failure budget spent")
    trial = make_run(tmp_path / "s-1", "0000", "300")
    (tmp_path / "s-1" / "sweep.json").write_text('{"trials": [')  # torn
    dep = slurm_run(tmp_path, "ev-1", "200")
    for d, job_id in ((trial, "300"), (dep, "200")):
        pipeline.freeze_after(d, [After(str(stage))], private=False)
        pipeline.register([After(str(stage))], {str(d): job_id})
    _, lines = resume.resume(stage, {})
    resumed, queued, not_queued = lines[-3:]
    assert names(resumed, "job 556", "(attempt 1)", str(stage))
    assert names(queued, "ev-1", "never started", "job 556")
    assert names(not_queued, "s-1/0000", "not queued again", "Expecting value")


def test_resume_of_a_run_whose_stage_was_deleted_says_so_and_the_way_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stage of after.json deleted since: `hpc-train resume` names it as a stage the run was queued after, and how to
    resume without it (before: `--after PATH: not a run or a sweep`, an --after the user never typed)."""
    import shutil

    bin_dir, _ = fake_clients(tmp_path, RESUMED)
    up = make_run(tmp_path, "pre-1", "100")
    dep = slurm_run(tmp_path, "ev-1", "200")
    pipeline.freeze_after(dep, [After(str(up))], private=False)
    shutil.rmtree(up)
    proc = run([HPC_TRAIN, "resume", str(dep)], env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"})
    assert refused(proc, "resume", "ev-1", f"{up}, is gone", f"rm {dep / 'after.json'}", f"hpc-train resume {dep}")


def test_after_ckpt_is_the_same_for_every_attempt_of_the_run(tmp_path: Path) -> None:
    """Review: {after.ckpt} was resolved again at every attempt (and on every rank): a stage resumed meanwhile had
    committed a newer checkpoint, and a requeued evaluation judged another one than its first attempt. The first
    attempt's, recorded in its start event (after_ckpt), is kept while it exists."""
    from hpc_train.script import command

    up, dep = make_run(tmp_path, "pre-1", "1"), tmp_path / "ev-1"
    dep.mkdir()
    pipeline.freeze_after(dep, [After(str(up))], private=False)
    config = {"script": {"cmd": ["python", "eval.py", "--ckpt", "{after.ckpt}"], "resume_args": []}}
    first = committed_step(up, 20)
    assert command(config, dep, resuming=False)[-1] == str(first)
    journal.log(dep, journal.START, 0, "5", 0, target="script", after_ckpt=str(first))  # as the supervisor records
    newer = committed_step(up, 60)  # the stage, resumed, went on
    assert command(config, dep, resuming=True)[-1] == str(first)
    shutil.rmtree(first)  # gone (the stage's retention): the stage's final one now
    assert command(config, dep, resuming=True)[-1] == str(newer)


@pytest.mark.parametrize("stopped", ["", "failure budget spent"])
def test_a_will_run_refusal_after_a_stage_that_stopped_meanwhile_names_the_stage(
    monkeypatch: pytest.MonkeyPatch, stopped: str
) -> None:
    """A stage whose job ends between the dependency and sbatch --test-only: Slurm's will-run test refuses with
    "Requested operation is presently disabled" (its dependency can never be satisfied). The stage's state asked
    again says which run and the fix; a refusal with every stage still waitable keeps Slurm's words."""
    from hpc_train import plan

    refused = "sbatch --test-only refused the request for partition low: allocation failure: Requested operation"

    def validate_live(*args: Any) -> list[str]:
        raise ValueError(refused)

    up = Upstream("bad-1", "/runs/bad-1", "ok", "slurm", "77", False, stopped)
    monkeypatch.setattr(plan, "validate_live", validate_live)
    monkeypatch.setattr(stages, "upstreams", lambda afters, queued=None: [up])
    with pytest.raises(ValueError) as e:
        plan._validate(None, "#!/bin/bash", 1, None, [After("/runs/bad-1")])  # type: ignore[arg-type]
    expected = "--after bad-1: it stopped for good (failure budget spent)" if stopped else refused
    assert str(e.value).startswith(expected)
