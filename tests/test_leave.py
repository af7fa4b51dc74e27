"""A finished task leaves by os._exit (hpc_train/leave.py), never through the interpreter's shutdown, where a
thread still inside a gloo call was killed mid-unwind: `terminate called without an active exception`, exit
134, and a finished run's job FAILED. Each case runs start.py, the task's real entry, on a job pickle."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import cloudpickle
import pytest
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
