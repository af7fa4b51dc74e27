"""A finished task leaves by os._exit (hpc_train/leave.py), never through the interpreter's shutdown, where a
thread still inside a gloo call was killed mid-unwind: `terminate called without an active exception`, exit
134, and a finished run's job FAILED. Each case runs start.py, the task's real entry, on a job pickle."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import cloudpickle
import pytest
from conftest import names
from submitit.core.utils import DelayedSubmission

from hpc_train import leave
from hpc_train.paths import make_dir

START = Path(leave.__file__).parent / "start.py"


def busy_gloo_then_return(marker: str, non_daemon_s: float) -> dict:
    """A function that returns while a daemon thread spins in all_reduce (as a user's function may leave one,
    or DDP's reducer), a non-daemon thread still writes a file and an atexit handler is registered."""
    import atexit
    import tempfile
    import threading
    import time

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(tempfile.mktemp(), 1), rank=0, world_size=1)
    group = dist.new_group(backend="gloo")

    def spin() -> None:
        t = torch.ones(1 << 16)
        while True:
            dist.all_reduce(t, group=group)

    def late_write() -> None:
        time.sleep(non_daemon_s)
        Path(marker + ".thread").write_text("done")

    threading.Thread(target=spin, daemon=True).start()
    threading.Thread(target=late_write).start()
    atexit.register(lambda: Path(marker + ".atexit").write_text("ran"))
    time.sleep(0.2)  # the spinning thread is inside gloo by now
    return {"final_step": 1}


def run_start(folder: Path) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "SUBMITIT_EXECUTOR": "local",
        "SUBMITIT_LOCAL_JOB_ID": "7",
        "SUBMITIT_LOCAL_NTASKS": "1",
        "SUBMITIT_LOCAL_NODEID": "0",
        "SUBMITIT_LOCAL_JOB_NUM_NODES": "1",
        "SUBMITIT_LOCAL_GLOBALID": "0",
        "SUBMITIT_LOCAL_LOCALID": "0",
    }
    return subprocess.run(
        [sys.executable, "-u", str(START), str(folder)], env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("attempt", range(3))
def test_a_finished_task_with_a_thread_in_gloo_exits_0_after_its_threads_and_atexit(
    tmp_path: Path, attempt: int
) -> None:
    """Before leave.py: 4 of 4 such runs aborted (exit -6, SIGABRT) after writing their result."""
    folder = make_dir(make_dir(tmp_path / "run") / "submitit")
    marker = str(tmp_path / "marker")
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    DelayedSubmission(busy_gloo_then_return, marker, 1.0).dump(folder / "7_submitted.pkl")
    proc = run_start(folder)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "terminate called" not in proc.stderr
    status, result = cloudpickle.loads((folder / "7_0_result.pkl").read_bytes())
    assert (status, result) == ("success", {"final_step": 1})
    assert Path(marker + ".thread").read_text() == "done"  # a non-daemon thread is joined, as Python would
    assert Path(marker + ".atexit").read_text() == "ran"  # atexit handlers run, as Python would


def test_the_thread_join_is_bounded_and_names_what_it_left() -> None:
    import threading

    stop = threading.Event()
    stuck = threading.Thread(target=stop.wait, name="stuck-upload")
    stuck.start()
    try:
        assert leave.join_threads(0.3) == ["stuck-upload"]
    finally:
        stop.set()
        stuck.join()
    assert leave.join_threads(0.3) == []


def busy_gloo_then_exit(code: object) -> None:
    """sys.exit in the function (argparse's usage error, a user's early exit) while a thread spins in gloo."""
    busy_gloo_then_return(os.devnull + "-unused", 0.0)
    raise SystemExit(code)


def busy_gloo_then_an_unpicklable_result() -> dict:
    import threading

    busy_gloo_then_return(os.devnull + "-unused", 0.0)
    return {"final_step": 1, "lock": threading.Lock()}


@pytest.mark.parametrize(("code", "rc"), [(0, 0), (None, 0), (3, 3), ("usage: train.py [-h]", 1)])
def test_a_function_that_calls_sys_exit_leaves_by_os_exit_with_its_code(tmp_path: Path, code: object, rc: int) -> None:
    """Review: SystemExit went past start.py's `except Exception` into the interpreter's shutdown, with the gloo
    thread alive: SIGABRT (rc -6)."""
    folder = make_dir(make_dir(tmp_path / "run") / "submitit")
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    DelayedSubmission(busy_gloo_then_exit, code).dump(folder / "7_submitted.pkl")
    proc = run_start(folder)
    assert proc.returncode == rc, proc.stderr[-2000:]
    assert "terminate called" not in proc.stderr
    assert (str(code) in proc.stderr) == isinstance(code, str)


def test_a_result_that_does_not_pickle_is_said_and_the_task_still_exits_0(tmp_path: Path) -> None:
    """Review: cloudpickle.dumps raised after the finish was on record: a traceback, then the abort at shutdown."""
    folder = make_dir(make_dir(tmp_path / "run") / "submitit")
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    DelayedSubmission(busy_gloo_then_an_unpicklable_result).dump(folder / "7_submitted.pkl")
    proc = run_start(folder)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "result does not pickle (TypeError" in proc.stderr
    assert cloudpickle.loads((folder / "7_0_result.pkl").read_bytes()) == ("success", None)


def test_an_atexit_handler_that_never_returns_does_not_hold_the_exit(tmp_path: Path) -> None:
    """Review: a finished task ran the atexit handlers unbounded (an online tracker's upload, a multiprocessing
    child that never ends): the task held its job to the time limit. They get join_s; then os._exit."""
    code = (
        "import atexit, time\nfrom hpc_train import leave\n"
        "atexit.register(time.sleep, 600)\nleave.process(5, finished=True, join_s=0.5)\n"
    )
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 5 and time.monotonic() - t0 < 30, proc.stderr
    assert names(proc.stderr, "atexit handlers", "still running after", "leaving")


SCRIPTS = str(Path(__file__).resolve().parent / "scripts")
BUSY = ["fn._target_=busy_finish.main", "+fn.kwargs.steps=3"]


def with_scripts(env: dict[str, str]) -> dict[str, str]:
    return {**env, "PYTHONPATH": os.pathsep.join(filter(None, [SCRIPTS, env.get("PYTHONPATH")]))}


def test_a_local_run_whose_function_leaves_a_gloo_thread_finishes_without_an_abort(tmp_path: Path) -> None:
    """The real finish (job.run_job, Attempt.finish, start.py) on 2 ranks: before leave.py both ranks of 3 of
    3 such runs printed `terminate called without an active exception` after summary.json."""
    from conftest import submit

    run_dir, _ = submit(
        [f"out_dir={tmp_path}", "name=busy", "cluster.tasks_per_node=2", *BUSY], env=with_scripts(dict(os.environ))
    )
    assert json.loads((run_dir / "summary.json").read_text())["spinning"] is True
    from hpc_train.runs import find_runs
    from hpc_train.status import status_rows

    assert status_rows(find_runs(run_dir))[0]["total_steps"] == 3  # the function's own steps, not train.steps (60)
    logs = sorted((run_dir / "submitit").glob("*_log.err"))
    assert len(logs) == 2 and not [p.name for p in logs if "terminate called" in p.read_text()]


@pytest.mark.slurm
@pytest.mark.parametrize("spare_nodes", [0, 1])
def test_a_finished_multi_node_run_with_a_gloo_thread_ends_completed_in_sacct(
    slurm_env: dict[str, str], tmp_path: Path, spare_nodes: int
) -> None:
    """2 nodes, a thread in gloo at the finish: the job is COMPLETED (with spares, the relay's finished file)."""
    from conftest import submit, wait_finished

    args = [f"out_dir={tmp_path}", "name=busy", "cluster=dev", "cluster.nodes=2", "cluster.tasks_per_node=1"]
    run_dir, job_id = submit([*args, f"cluster.spare_nodes={spare_nodes}", *BUSY], env=with_scripts(slurm_env))
    assert wait_finished(run_dir, job_id, slurm_env)["spinning"] is True  # waits for COMPLETED in sacct


def test_a_function_that_returns_at_its_own_stop_check_is_requeued_at_the_step_it_reached(tmp_path: Path) -> None:
    """Its stop used to be recorded at step -1 with no deadline, and the stop then waited for the memory copy in
    flight without a bound; now the last step step_end saw (6), the memory copy waited for within the signal's time."""
    from conftest import read_events, submit

    args = [f"out_dir={tmp_path}", "name=own", "cluster.tasks_per_node=2", "checkpoint.every_steps=5"]
    fn = ["fn._target_=own_stop_check.main", "+fn.kwargs.steps=12", "checkpoint.memory_every_steps=1"]
    run_dir, _ = submit([*args, *fn], env=with_scripts(dict(os.environ)))
    events = read_events(run_dir)
    assert [(e["step"], e["reason"]) for e in events if e["event"] == "requeue"] == [(6, "preempt")]  # step_end saw 6
    starts = [e for e in events if e["event"] == "start"]
    assert [e["step"] for e in starts] == [0, 6] and starts[1]["resumed_from"].startswith("memory step")
    assert json.loads((run_dir / "summary.json").read_text())["final_step"] == 12


@pytest.mark.parametrize(
    ("reached", "last", "stops"), [(6, 10, True), (10, 10, False), (12, 10, False), (6, None, True)]
)
def test_a_function_that_returns_at_its_last_step_finishes_whenever_the_signal_came(
    monkeypatch: pytest.MonkeyPatch, reached: int, last: int | None, stops: bool
) -> None:
    """Review: a stop signal during the last step (step_end finishes at it) or after it (a final evaluation), then
    a return without finish(): Attempt.returned took it for a stop at its own check, and the finished run was
    requeued. At or past step_end's last_step it is a finish; before it (or no step_end) a stop."""
    from types import SimpleNamespace

    from hpc_train.attempt import Attempt
    from hpc_train.task import Pulse

    at = SimpleNamespace(finished=None, stopped=False, _last_step=last, should_stop=lambda: True)
    at.pulse = Pulse(step_reached=reached)
    at.time_left_s = lambda: (30.0, "preempt")
    Attempt.returned(at)  # type: ignore[arg-type]
    assert at.stopped is stops
    assert not stops or (at.stop_step, at.stop_reason) == (reached, "preempt")


def test_a_finished_rank_stands_its_own_watchdog_down_whatever_handler_the_function_left(tmp_path: Path) -> None:
    """Review: start.py stood the watchdog down through install_handlers(), which made a fresh Pulse when the
    user's function had left a SIGTERM handler of its own: the Task's Pulse, the one the watchdog reads, kept
    running through the ~60 s exit (a hang dump and a fail event after the finish). job.run_job stands its own
    Task's Pulse down once the attempt finished. In a process of its own (run_job sets the rank's environment)."""
    import subprocess
    import sys

    code = (
        "import signal\n"
        "from hpc_train import job\n"
        "seen = {}\n"
        "def fake_run(paths, env, task, process_start, phases_s):\n"
        "    seen['pulse'] = task.pulse\n"
        "    signal.signal(signal.SIGTERM, lambda *a: None)  # the user's own handler, left in place\n"
        "    return {'final_step': 3}\n"
        "job._run = fake_run\n"
        f"assert job.run_job({str(tmp_path)!r}) == {{'final_step': 3}}\n"
        "print(seen['pulse'].last_beat)\n"
    )
    env = {**os.environ, "SUBMITIT_LOCAL_JOB_ID": "5", "SUBMITIT_LOCAL_NTASKS": "1"}
    env |= {"SUBMITIT_LOCAL_GLOBALID": "0", "SUBMITIT_LOCAL_LOCALID": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip().splitlines()[-1] == "inf", out.stdout + out.stderr
