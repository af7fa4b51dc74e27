"""Pipelines without Slurm (`submit --after`, pipeline.py, stages.py): the dependency a run gets from its stages'
state, on seeded random stages; what the user reads for a bad --after; what a stage's stop tells the runs queued
after it; {after.ckpt} and checkpoint.init_from=STAGE. tests/test_slurm_pipeline.py runs them on the cluster."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
from conftest import HPC_TRAIN, run

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
    assert got == {
        "done-1": (True, ""),
        "stop-1": (False, "failure budget spent"),
        "back-1": (False, ""),
        "killed-1": (False, "Slurm ended job 13 as CANCELLED without a word in events.jsonl"),
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
    assert stopped["reason"] == (
        f"cancelled before it started: pre-1, which it runs after, stopped for good: failure budget spent; "
        f"`hpc-train resume {up}` queues it again, and this run after it"
    )
    assert (stopped["upstream"], stopped["by"]) == (str(up), "pipeline")
    cascade = journal.stopped(journal.read(ft))["reason"]
    assert cascade.startswith("cancelled before it started: ev-1, which it runs after, was cancelled as pre-1 stopped")
    assert f"`hpc-train resume {up}` queues it again" in cascade
    released = journal.named(journal.read(anyone), journal.RELEASED)
    assert [e["reason"] for e in released] == [
        "pre-1, which it runs after (:any), stopped for good: failure budget spent; this run does not wait for it"
    ]
    assert pipeline.settle_dependents(up, "cancelled") == []
    assert pipeline.settle_dependents(tmp_path / "nothing-after-it", "x") == []


def committed_step(run_dir: Path, step: int) -> Path:
    folder = run_dir / "checkpoints" / f"step_{step:06d}"
    folder.mkdir(parents=True)
    files = {".metadata": {"bytes": 0, "sha256": ""}, "rank_00000.pt": {"bytes": 0, "sha256": ""}}
    (folder / MARKER).write_text(json.dumps({"files": files, "world_size": 1, "step": step}))
    return folder


def test_after_ckpt_is_the_first_stages_final_checkpoint_found_when_the_job_starts(tmp_path: Path) -> None:
    """Left as written at submit (no after.json yet) and while the stage runs; then its newest committed step folder
    (a script stage: the newest file it recorded); a stage that ended without one is a sentence."""
    from hpc_train.script import command

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
    with pytest.raises(ValueError, match=r"ended without a checkpoint \(no committed step folder"):
        command(config, other, resuming=False)
    (script_up / "ckpt.pt").write_bytes(b"x")
    journal.log(script_up, journal.SCRIPT_CHECKPOINT, 5, "2", 0, path=str(script_up / "ckpt.pt"), mtime=1.0)
    assert command(config, other, resuming=False)[-1] == str(script_up / "ckpt.pt")


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
    assert stages.chain_text(shown) == "after pre-1:ok (COMPLETED), ev-1:any (RUNNING, job 2)"
    assert [r.run_dir for r in runs if pipeline.read_after(r.run_dir)] == [dep]
