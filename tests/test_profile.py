"""profile.*: torch.profiler over a window of global steps, one trace per rank (profiling.py), on CPU. The
window's rules in-process (resume inside or past it, a stop inside it, a run that ends inside it, off at no
cost); the built-in trainer and a user's function through the local executor; the config's sentences.
profile.memory's CUDA snapshot needs a GPU: here only its one line on CPU is tested."""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import pytest
import torch
from conftest import HPC_TRAIN, names, read_events, run, submit, wait_until

from hpc_train.config import ProfileConfig
from hpc_train.paths import RunPaths
from hpc_train.profiling import Profile

EXAMPLES = str(Path(__file__).resolve().parent.parent / "docs" / "examples")


def profiled_steps(trace: Path) -> list[int]:
    """The steps a Chrome trace holds ("ProfilerStep#N" ranges), in order; asserts it is valid JSON with ops."""
    events = json.loads(trace.read_text())["traceEvents"]
    ops = {e.get("name", "") for e in events}
    assert {"aten::mm", "aten::addmm"} & ops, sorted(ops)[:20]  # the steps' matmuls are in it
    return sorted(int(m[1]) for n in ops if (m := re.fullmatch(r"ProfilerStep#(\d+)", n)))


def trace(attempt: int, first: int, last: int, rank: int = 0) -> str:
    """A trace's file name: its attempt, the global steps it holds and its rank."""
    return f"attempt_{attempt}.steps_{first}-{last}.rank_{rank:05d}.pt.trace.json"


def run_steps(prof: Profile, first: int, last: int, stop_at: int = 0) -> list[str]:
    """A loop as a training function's: resume at step first - 1, then a matmul per step and step_end's call."""
    said: list[str] = []
    prof.say = said.append
    prof.step(first - 1)
    x = torch.randn(16, 16)
    for step in range(first, last + 1):
        torch.mm(x, x)
        prof.step(step, last, stopping=step == stop_at)
        if step == stop_at:
            return said
    prof.close()  # Attempt.finish: nothing left to write when step_end saw the last step
    return said


def make(tmp_path: Path, restart: int = 0, **cfg: int | bool) -> Profile:
    return Profile(ProfileConfig(**cfg), RunPaths(tmp_path), 0, restart, False, print)  # type: ignore[arg-type]


def files(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in (tmp_path / "profile").iterdir()) if (tmp_path / "profile").exists() else []


def test_the_window_is_in_global_steps_whatever_the_attempt_runs(tmp_path: Path) -> None:
    # A whole run: warm-up step 3 unrecorded, steps 4-6 recorded, labelled with the run's own step numbers.
    said = run_steps(make(tmp_path, start_step=4, active_steps=3, warmup_steps=1), 1, 10)
    assert files(tmp_path) == [trace(0, 4, 6)]
    assert profiled_steps(tmp_path / "profile" / files(tmp_path)[0]) == [4, 5, 6]
    assert names(said[0], "profiling steps 4-6", "every rank", str(tmp_path / "profile"))
    # Attempt 1 resumed at step 4, inside the window: it records 5-6, beside (not over) attempt 0's.
    run_steps(make(tmp_path, 1, start_step=4, active_steps=3), 5, 10)
    assert profiled_steps(tmp_path / "profile" / trace(1, 5, 6)) == [5, 6]
    # Attempt 2 resumed past it: nothing. A run that ends inside it (train.steps=5): what it recorded.
    run_steps(make(tmp_path, 2, start_step=4, active_steps=3), 8, 10)
    run_steps(make(tmp_path, 3, start_step=4, active_steps=3), 1, 5)
    run_steps(make(tmp_path, 4, start_step=4, active_steps=3, warmup_steps=0), 1, 3)  # ends just before it
    assert profiled_steps(tmp_path / "profile" / trace(3, 4, 5)) == [4, 5]
    assert len(files(tmp_path)) == 3


def test_a_stop_inside_the_window_drops_the_recording_and_stops_the_profiler(tmp_path: Path) -> None:
    prof = make(tmp_path, start_step=4, active_steps=3)
    said = run_steps(prof, 1, 10, stop_at=5)
    assert files(tmp_path) == [] and prof.torch is None
    assert names(said[-1], "a stop inside steps 3-6", "dropped")
    assert not torch.autograd._profiler_enabled()
    run_steps(make(tmp_path, start_step=4, active_steps=3), 1, 10)  # a profiler left running would refuse this one
    assert files(tmp_path) == [trace(0, 4, 6)]


def test_off_costs_nothing_and_memory_on_cpu_is_one_line(tmp_path: Path) -> None:
    prof = make(tmp_path)  # the defaults: active_steps=0
    assert run_steps(prof, 1, 20) == [] and not (tmp_path / "profile").exists()
    said = run_steps(make(tmp_path, start_step=2, active_steps=1, memory=True), 1, 3)
    assert names(said[0], "profile.memory=true", "no CUDA", "no memory snapshot")
    assert files(tmp_path) == [trace(0, 2, 2)]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["profile.active_steps=3", "profile.start_step=1"],
            "profile.start_step=1 must be >= 2: the first step is 1 and profile.warmup_steps=1 steps come before "
            "the first recorded one; e.g. profile.start_step=2, or profile.warmup_steps=0",
        ),
        (
            ["profile.active_steps=-1"],
            "profile.active_steps=-1 must be >= 0: steps recorded, 0 = off (a trace of 3 steps is the usual size); "
            "e.g. profile.active_steps=0",
        ),
        (
            ["profile.memory=true"],
            "profile.memory=true snapshots CUDA memory over the profiled steps, and profile.active_steps=0 "
            "profiles none; e.g. profile.active_steps=3",
        ),
        (
            ["profile.active_steps=3", "--", "python", "train.py"],
            "profile.active_steps=3 profiles the built-in trainer and functions (fn._target_) through "
            "Attempt.step_end; a command after -- runs its own loop: use torch.profiler in the script "
            "(docs/profiling.md), or set profile.active_steps=0",
        ),
        (
            ["profile.active_steps=3", "profile.start_step=100", "train.steps=60"],
            "profile.start_step=100 is past train.steps=60: nothing would be profiled; e.g. profile.start_step=30",
        ),
    ],
)
def test_a_window_that_cannot_be_is_refused_with_the_fix(overrides: list[str], message: str) -> None:
    proc = run([HPC_TRAIN, "submit", "--cfg", "job", *overrides])
    assert proc.returncode == 2 and f"hpc-train submit: error: {message}\n" in proc.stderr, proc.stderr


def test_the_trainer_and_a_function_write_one_trace_per_rank_and_report_names_them(tmp_path: Path) -> None:
    window = ["profile.start_step=4", "profile.active_steps=2"]  # steps 4-5; step 3 the warm-up
    trainer, _ = submit([f"out_dir={tmp_path}", "name=trainer", "train.steps=7", *window])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [EXAMPLES, os.environ.get("PYTHONPATH")]))}
    byo = ["fn._target_=byo_train.main", "+fn.kwargs.steps=7"]
    function, _ = submit([f"out_dir={tmp_path}", "name=function", *byo, *window], env=env)
    for run_dir in (trainer, function):
        wait_until(lambda: (run_dir / "summary.json").exists(), 240, "summary.json")  # noqa: B023
        traces = [run_dir / "profile" / trace(0, 4, 5, r) for r in (0, 1)]
        assert sorted((run_dir / "profile").iterdir()) == traces
        assert [profiled_steps(t) for t in traces] == [[4, 5], [4, 5]]
    report = run([HPC_TRAIN, "report", str(trainer)])
    assert report.returncode == 0, report.stderr
    section = report.stdout.split(f"profiles in {trainer / 'profile'}:\n")[1]
    line, how = section.splitlines()[:2]
    assert names(line, "attempt 0", "steps 4-5", "2 traces", "(ranks 0-1)", trace(0, 4, 5)), report.stdout
    assert names(how, "https://ui.perfetto.dev", "chrome://tracing"), report.stdout


def test_a_stop_inside_the_window_saves_requeues_and_the_resumed_attempt_records_the_rest(tmp_path: Path) -> None:
    """SIGTERM (a preemption) while steps 5-24 are being recorded: the profiler is dropped before the stop save,
    the job requeues, and attempt 1 records the window's steps after the one it resumed from."""
    args = ["train.steps=30", "train.min_step_time_s=0.3", "profile.start_step=5", "profile.active_steps=20"]
    run_dir, job_id = submit([f"out_dir={tmp_path}", *args, "--no-wait"])
    log = run_dir / "submitit" / f"{job_id}_0_log.out"
    wait_until(lambda: log.exists() and "profiling steps" in log.read_text(), 120, "the profiler")
    os.kill(int(job_id), signal.SIGTERM)  # submitit's local controller forwards it to every rank
    wait_until(lambda: (run_dir / "summary.json").exists(), 240, "the resumed run's summary")
    events = read_events(run_dir)
    stop = next(e for e in events if e["event"] == "checkpoint_committed" and e["reason"] == "stop")["step"]
    assert 4 <= stop < 24 and [e["event"] for e in events].count("requeue") == 1
    first = max(5, stop + 1)
    assert files(run_dir) == [trace(1, first, 24, r) for r in (0, 1)]
    assert profiled_steps(run_dir / "profile" / files(run_dir)[0]) == list(range(first, 25))
    text = log.read_text()
    # step_end stopped it, not job.py after the function returned
    assert names(text, "profile: a stop inside steps 4-24", "recording is dropped")
    assert names(text, f"profiling steps {first}-24 on every rank", f"resumed at step {stop}")
