"""Shared fixtures: the real Slurm test cluster (session scope) and helpers to drive `hpc-train`."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest


def worker_cluster(environ: Mapping[str, str]) -> dict[str, str]:
    """The cluster of pytest-xdist worker gwN, beside the one HPC_TRAIN_CLUSTER_DIR and _PORT_OFFSET name (so a
    cluster left up by hand is never touched): DIR-gwN, every port 100 x (N + 1) further. gw0 of the defaults:
    /tmp/hpc_train_cluster-gw0, slurmctld on 16917, job ids from 1001. Nothing outside xdist (-n0)."""
    worker = environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw"):
        return {}
    base = environ.get("HPC_TRAIN_CLUSTER_DIR") or "/tmp/hpc_train_cluster"  # tests/cluster.py's default
    offset = int(environ.get("HPC_TRAIN_CLUSTER_PORT_OFFSET") or 0) + 100 * (int(worker[2:]) + 1)
    return {"HPC_TRAIN_CLUSTER_DIR": f"{base}-{worker}", "HPC_TRAIN_CLUSTER_PORT_OFFSET": str(offset)}


# Before tests/cluster.py reads them at import; every command a test starts inherits them: hpc-train (cluster=dev's
# slurm_conf), Slurm's clients, the jobs.
os.environ.update(worker_cluster(os.environ))
sys.path.insert(0, str(Path(__file__).parent))
import cluster as test_cluster  # noqa: E402  (tests/cluster.py)


@pytest.fixture(autouse=True)
def _stop_handlers_per_test() -> Any:
    """Each test leaves USR2/TERM's handlers as it found them. An Attempt built without a Task installs hpc_train's
    record-only handlers (preempt.install_handlers) and they stayed for the worker's later tests: a test's own SIGUSR2
    went into that one Pulse, and every later Attempt of the worker saw a stop pending (step_end True), in whatever
    order xdist dealt the tests (4 test_checkpoint failures on one worker of a .ci/run)."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGUSR2, signal.SIGTERM)}
    import logging

    logging.getLogger("hpc_train").setLevel(logging.INFO)  # INFO records too for caplog (said), as a job has them
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)
    # and the `hpc_train` loggers as they were: a test that ran job code in-process (ranklog.configure) left them
    # not propagating, so a later test's caplog saw none of their records
    from hpc_train import ranklog

    for name in (ranklog.LOGGER, ranklog.PROGRESS):
        logger = logging.getLogger(name)
        for handler in [h for h in logger.handlers if getattr(h, "hpc_train", False)]:
            logger.removeHandler(handler)
        logger.propagate, logger.level = True, logging.NOTSET


HPC_TRAIN = str(Path(sys.executable).parent / "hpc-train")


def said(caplog: Any) -> str:
    """What hpc_train logged in this process since the last call, one message a line, then forgotten: job-side code
    run in-process speaks through `logging` (ranklog.py), which pytest's caplog holds, not stdout or stderr."""
    text = "\n".join(r.getMessage() for r in caplog.records if r.name.startswith("hpc_train"))
    caplog.clear()
    return text


def warned(caplog: Any, logger: str, level: str = "WARNING") -> list[tuple[str, ...]]:
    """The args of each record LOGGER logged at LEVEL in this process since the last call, as text, then all records
    forgotten: which values a warning named, not its sentence (STYLE: say it through `logging`)."""
    got = [tuple(str(a) for a in r.args) for r in caplog.records if r.name == logger and r.levelname == level]
    caplog.clear()
    return got


def names(text: str, *fragments: str) -> bool:
    """Whether TEXT, a sentence the user reads, names each of FRAGMENTS: the value, the constraint, the fix (STYLE 5),
    each a short piece (a key=value, a path, a number, a command), so that a message can be reworded without breaking
    the test while one that drops the value or the fix still fails it. Asserts, so pytest shows what is missing."""
    missing = [f for f in fragments if f not in text]
    assert not missing, f"{text!r} does not name {missing}"
    return True


def refused(proc: subprocess.CompletedProcess, command: str, *fragments: str) -> bool:
    """Whether `hpc-train COMMAND` refused as a user error should: exit status 2, no traceback, one line on stderr,
    `hpc-train COMMAND: error: ...`, that names each of FRAGMENTS (names)."""
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"hpc-train {command}: error: "), proc.stderr
    return names(lines[0], *fragments)


# How pyproject's `-n 4 --dist loadgroup` spreads the suite. A test on the cluster mostly waits (33 min of wall time
# for 3.4 min of CPU, serially): each is a unit of its own, run by whichever worker is free, on that worker's own
# cluster. Every other test runs with the rest of its module (module fixtures once), except SPREAD's tests, each a
# local-executor run of minutes. Units start longest first (queue_order), by tests/durations.json (a measured run's
# seconds per test; 1 s for a test it does not know): with one `local` group on one worker, that worker ran 2,381 s
# while the three others were done after 1,400-1,700 s. A module whose fixture runs on the cluster once for all its tests names
# its own group (test_secrets.py). xdist 3.8 passes a test's group to the scheduler by renaming the test, which
# pytest 9.2 ignores (pytest-xdist#1386: every group silently spread); so the workers write the groups to a file that
# the scheduler below reads.
GROUPS_FILE = Path(tempfile.gettempdir()) / f"hpc_train-xdist-groups-{os.getpid()}.json"  # named by the controller
DURATIONS = Path(__file__).with_name("durations.json")  # refresh: HPC_TRAIN_DURATIONS_OUT=tests/durations.json pytest
SPREAD = {"tests/test_local.py"}


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    node.workerinput["hpc_train_groups"] = str(GROUPS_FILE)


def unit_of(nodeid: str, marks: list[str], on_cluster: bool) -> str:
    """The unit of work a test belongs to: its xdist_group, itself, or its module."""
    module = nodeid.split("::")[0]
    return "_".join(marks) or (nodeid if on_cluster or module in SPREAD else module)


def queue_order(weight: dict[str, float], first: dict[str, int], long_s: float = 100.0) -> list[str]:
    """Longest first, every other unit one of the long (> long_s) ones: 20 tests of 100-350 s make half the
    suite's seconds, and the four longest started together (a fault storm, three multi-rank runs) slowed one
    another on 2 cores until a 240 s deadline passed (CI at 7e3bc84). Alternating keeps about two of them
    running beside two workers' shorter units."""
    ranked = sorted(weight, key=lambda unit: (-weight[unit], first[unit]))
    long, rest = [u for u in ranked if weight[u] > long_s], [u for u in ranked if weight[u] <= long_s]
    mixed = [u for pair in zip(long, rest) for u in pair]
    return mixed + long[len(mixed) // 2 :] + rest[len(mixed) // 2 :]


@pytest.hookimpl(trylast=True)  # the test ids as the controller will see them
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not hasattr(config, "workerinput"):
        return
    groups = {}
    for item in items:
        marks = sorted(str(m.args[0] if m.args else m.kwargs["name"]) for m in item.iter_markers("xdist_group"))
        groups[item.nodeid] = unit_of(item.nodeid, marks, "slurm_env" in item.fixturenames)
    seconds = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    weight: dict[str, float] = {}
    for nodeid, unit in groups.items():
        weight[unit] = weight.get(unit, 0.0) + seconds.get(nodeid, 1.0)
    first = {unit: i for i, unit in reversed(list(enumerate(groups.values())))}
    order = {unit: i for i, unit in enumerate(queue_order(weight, first))}
    # A unit's tests together and in their own order (--no-loadscope-reorder keeps it).
    items.sort(key=lambda item: order[groups[item.nodeid]])
    path = Path(config.workerinput["hpc_train_groups"])
    tmp = path.with_name(f"{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(groups))
    os.replace(tmp, path)  # every worker collects the same tests: any one file is the whole answer


_seconds: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if os.environ.get("HPC_TRAIN_DURATIONS_OUT"):
        _seconds[report.nodeid] = round(_seconds.get(report.nodeid, 0.0) + report.duration, 1)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getoption("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class LoadGroupFromFile(LoadScopeScheduling):
        """xdist's loadgroup (units of work by size, largest first), with the groups the workers wrote."""

        def _split_scope(self, nodeid: str) -> str:
            if not hasattr(self, "groups"):  # first called once every worker has collected, so written
                self.groups = json.loads(GROUPS_FILE.read_text())
            return self.groups.get(nodeid, nodeid)

    return LoadGroupFromFile(config, log)


def pytest_unconfigure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):
        GROUPS_FILE.unlink(missing_ok=True)
        if os.environ.get("HPC_TRAIN_DURATIONS_OUT") and _seconds:
            Path(os.environ["HPC_TRAIN_DURATIONS_OUT"]).write_text(
                json.dumps(_seconds, indent=0, sort_keys=True) + "\n"
            )


@pytest.fixture(scope="session")
def slurm_env() -> dict[str, str]:
    """Start the four-node cluster (or reuse one already up) and stop it after the session if we started it.

    A test that needs the cluster fails, never skips, when it cannot start.
    """
    started = not test_cluster.is_up()
    if started:
        try:
            took = test_cluster.up()
        except (RuntimeError, subprocess.SubprocessError) as e:
            # Once more from scratch (up() stops what it started first): four clusters starting at once on two
            # cores, a daemon's first start can miss its bound, and a failed session fixture errors every
            # cluster test of this worker. A second failure is the test's.
            print(f"\n[cluster] up failed ({e}); starting it once more", file=sys.stderr)
            took = test_cluster.up()
        print(f"\n[cluster] up in {took:.1f} s")
    yield test_cluster.client_env()
    if started and not os.environ.get("HPC_TRAIN_KEEP_CLUSTER"):
        test_cluster.down()


@pytest.fixture()
def no_node_left_drained(slurm_env: dict[str, str]):
    """After the test: no node drained, down or failed (a test that takes a node away puts it back)."""
    yield
    states = run(["sinfo", "-h", "-N", "-o", "%N %t"], env=slurm_env).stdout
    assert not re.search(r"drain|down|fail", states), states


# Every deadline of wait_until and run is PATIENCE times the seconds its caller names: the caller names a bound
# for this 2-core machine running the suite (its waits reached 0.76 of their bound, HPC_TRAIN_WAITS_OUT), and
# the CI machine ran the same tests up to 1.7x slower (the fault storm: 578 s there, 345 s here); a deadline
# only catches a hang, so a green run never waits for it.
PATIENCE = 3.0


def _record_wait(what: str, began: float, timeout_s: float) -> None:
    """HPC_TRAIN_WAITS_OUT=FILE: one line per wait (its caller, seconds waited, its deadline), to find the
    deadlines a slower CI machine would outlast (a deadline catches a hang; it is no speed target)."""
    if out := os.environ.get("HPC_TRAIN_WAITS_OUT"):
        ours = [f for f in traceback.extract_stack() if Path(f.filename).parent == Path(__file__).parent]
        # a test's line, else a fixture's (conftest's own frames: _record_wait, its caller, the fixture)
        frame = next((f for f in ours[::-1] if f.filename != __file__), ours[max(0, len(ours) - 3)])
        row = {"at": f"{Path(frame.filename).name}:{frame.lineno}", "what": what[:80], "timeout_s": timeout_s}
        with open(out, "a") as f:
            f.write(json.dumps({**row, "waited_s": round(time.monotonic() - began, 1)}) + "\n")


def run(
    cmd: list[str], env: dict[str, str] | None = None, timeout_s: float = 120, **kw: Any
) -> subprocess.CompletedProcess:
    began = time.monotonic()
    try:
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s * PATIENCE, **kw)
    finally:
        _record_wait(" ".join(map(str, cmd[:3])), began, timeout_s)


def wait_until(predicate: Callable[[], Any], timeout_s: float, what: str, every_s: float = 0.5) -> Any:
    began = time.monotonic()
    deadline = began + timeout_s * PATIENCE
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            _record_wait(what, began, timeout_s)
            return value
        time.sleep(every_s)
    _record_wait(what, began, timeout_s)
    raise AssertionError(
        f"timed out after {timeout_s * PATIENCE:.0f} s ({PATIENCE:g} x {timeout_s:.0f}) waiting for {what}"
    )


def read_events(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def first_start(run_dir: Path) -> dict[str, Any]:
    """The run's first `start` event (each attempt's `preflight` event comes before it)."""
    return next(e for e in read_events(run_dir) if e["event"] == "start")


def submit(args: list[str], env: dict[str, str] | None = None, cwd: Path | None = None) -> tuple[Path, str]:
    """Run `hpc-train submit ARGS` as a user would; returns (run_dir, job_id)."""
    proc = run([HPC_TRAIN, "submit", *args], env=env, cwd=cwd, timeout_s=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    line = next(l for l in proc.stdout.splitlines() if l.startswith("submitted job"))
    job_id, run_dir = line.split()[2].rstrip(";"), Path(line.split("run directory ")[1])
    return run_dir, job_id


def fake_clients(tmp_path: Path, scripts: dict[str, str]) -> tuple[Path, Path]:
    """Slurm client commands that answer as a cluster would where the real one cannot be made to (an sbatch
    that queued and timed out, a slurmdbd that is down): TMP/fakebin/NAME run `sh` with STATE=TMP/fakestate.
    Returns (the bin folder to put first on PATH, the state folder)."""
    bin_dir, state = tmp_path / "fakebin", tmp_path / "fakestate"
    bin_dir.mkdir()
    state.mkdir()
    for name, body in scripts.items():
        (bin_dir / name).write_text(f"#!/bin/sh\nSTATE={state}\n{body}\n")
        (bin_dir / name).chmod(0o755)
    return bin_dir, state


def sacct_state(job_id: str, env: dict[str, str]) -> str:
    """The job's state in sacct: its last record's (a --no-kill job that lost a node has a RESIZING one first), first
    word ("CANCELLED by 0" is CANCELLED)."""
    out = [
        line.split()[0]
        for line in run(["sacct", "-X", "-n", "-P", "-o", "State", "-j", job_id], env=env).stdout.splitlines()
        if line.split()
    ]
    return out[-1] if out else ""


# sacct states a job no longer leaves (REQUEUED is left: the job runs again)
ENDED_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL"}


def final_state(job_id: str, env: dict[str, str], timeout_s: float = 60) -> str:
    """The job's sacct state once it has ended (a finished run's job must end COMPLETED, never FAILED by an
    abort after its result); what sacct says at timeout_s otherwise."""
    deadline = time.monotonic() + timeout_s
    while (state := sacct_state(job_id, env)) not in ENDED_STATES and time.monotonic() < deadline:
        time.sleep(1.0)
    return state


def wait_finished(run_dir: Path, job_id: str, env: dict[str, str], timeout_s: float = 240) -> dict[str, Any]:
    """Wait for summary.json and for Slurm to call the job COMPLETED; return the summary."""
    wait_until(
        lambda: (run_dir / "summary.json").exists() or _stopped(run_dir),
        timeout_s,
        f"{run_dir}/summary.json (job {job_id})",
    )
    assert not _stopped(run_dir), (
        f"run stopped: {[e for e in read_events(run_dir) if e['event'] in ('fail', 'stopped')]}"
    )
    wait_until(lambda: sacct_state(job_id, env) == "COMPLETED", 60, f"job {job_id} COMPLETED in sacct")
    return json.loads((run_dir / "summary.json").read_text())


def _stopped(run_dir: Path) -> bool:
    """A `stopped` event since the last `resume` (hpc-train resume brings a stopped run back)."""
    events = read_events(run_dir)
    last_resume = max((i for i, e in enumerate(events) if e["event"] == "resume"), default=-1)
    return any(e["event"] == "stopped" for e in events[last_resume + 1 :])


# 2 ranks on 2 nodes (one task each): multi-node at half the CPU of cluster=dev's 2 x 2 (a rank's start is
# ~3 CPU-s, mostly torch's import, and the suite is CPU-bound on 2 cores: a USR2 test took 31 CPU-s, 56 at
# 4 ranks). Tests of two tasks on a node (the storm, TP pairs, placement) add cluster.tasks_per_node=2.
# 0.25 s per step keeps the run ~15 s long so a signal lands mid-run.
RUN_ARGS = [
    "cluster=dev",
    "cluster.partition=low",
    "cluster.tasks_per_node=1",
    "train.steps=60",
    "train.min_step_time_s=0.25",
    "checkpoint.every_steps=20",
]


@pytest.fixture(scope="session")
def reference(slurm_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The uninterrupted run every interrupted one is compared with."""
    out = tmp_path_factory.mktemp("reference")
    run_dir, job_id = submit([*RUN_ARGS, f"out_dir={out}", "name=ref"], env=slurm_env)
    summary = wait_finished(run_dir, job_id, slurm_env)
    events = [e["event"] for e in read_events(run_dir)]
    assert events.count("start") == 1 and "requeue" not in events and events[-1] == "finish"
    return summary


def interrupted_run(
    slurm_env: dict[str, str], tmp_path: Path, name: str, interrupt: Callable[[str], None], extra: list[str] = ()
) -> tuple[dict, list[dict]]:
    """Submit RUN_ARGS, call interrupt(job_id) once the first checkpoint committed, wait for the end."""
    run_dir, job_id = submit([*RUN_ARGS, f"out_dir={tmp_path}", f"name={name}", *extra], env=slurm_env)
    wait_until(
        lambda: any(e["event"] == "checkpoint_committed" for e in read_events(run_dir)),
        120,
        "the first committed checkpoint",
    )
    interrupt(job_id)
    summary = wait_finished(run_dir, job_id, slurm_env, timeout_s=300)
    return summary, read_events(run_dir)


def high_job_preempting(slurm_env: dict[str, str], high_ids: list[str], nodes: str = "") -> Callable[[str], None]:
    """An interrupt: a `high` job needing all four nodes (or `nodes`) exclusively evicts `low` jobs there."""

    def preempt(job_id: str) -> None:
        where = ["-w", nodes, "-N", str(len(nodes.split(",")))] if nodes else ["-N", "4"]
        proc = run(
            ["sbatch", "--parsable", "-p", "high", *where, "--exclusive", "-o", "/dev/null", "--wrap", "sleep 2"],
            env=slurm_env,
        )
        assert proc.returncode == 0, proc.stderr
        high_ids.append(proc.stdout.strip())

    return preempt
