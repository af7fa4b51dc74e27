"""journal.py owns events.jsonl: names, the locked append, the tolerant read and the reducers. Seeded
random journals check what must always hold; an AST scan checks that no other module reads or writes
an event by a name of its own."""

from __future__ import annotations

import ast
import json
import random
from pathlib import Path

import pytest

from hpc_train import journal
from hpc_train.paths import RunPaths

PACKAGE = Path(__file__).resolve().parent.parent / "hpc_train"
NAMES = sorted(v for k, v in vars(journal).items() if k.isupper() and isinstance(v, str) and k not in ("BUDGET_KEYS",))


SPARES = 2  # cluster.spare_nodes of the random journals


def random_journal(rng: random.Random, n: int, truth: dict | None = None) -> list[dict]:
    """A run's events as attempts would write them: times rise, attempts rise after a requeue, a resume,
    an in-job restart (hot spares) or Slurm's own requeue (no event). truth: gets the spares the current
    allocation still holds and whether the run ever left its first allocation."""
    t, restart, step, out = 1000.0, 0, 0, []
    truth = {} if truth is None else truth
    truth.update(spares=SPARES, requeued=False)

    def add(name: str, **fields) -> None:
        nonlocal t
        t += rng.uniform(0.1, 30)
        out.append({"time": t, "event": name, "step": step, "job_id": "7", "restart": restart, **fields})

    add(journal.START, launched_at=t - 2, world_size=4)
    for _ in range(n):
        what = rng.choice(
            [
                "step",
                "commit",
                "commit",
                "signal",
                "requeue",
                "fail",
                "resume",
                "cancel",
                "straggler",
                "in_job",
                "slurm",
            ]
        )
        if what == "step":
            step += rng.randint(1, 20)
            add(journal.FIRST_STEP, step_time_s=0.1)
        elif what == "commit":
            step += rng.randint(0, 10)
            add(journal.CHECKPOINT_COMMITTED, reason=rng.choice(["periodic", "stop"]), save_s=1.0, stall_s=0.2)
        elif what == "signal":
            add(journal.SIGNAL, signals=["USR2"])
        elif what in ("requeue", "fail"):
            if what == "fail":
                add(journal.FAIL, rank=0, error="boom")
            add(
                journal.REQUEUE,
                reason=rng.choice(["failure", "preempt", "time_limit"]),
                by=rng.choice(["hpc_train", "slurm"]),
            )
            restart += 1
            step = max(journal.committed_steps(out), default=0)
            add(journal.START, launched_at=t - 3, world_size=rng.choice([2, 4]))
            truth.update(spares=SPARES, requeued=True)
        elif what == "in_job" and truth["spares"] > 0:
            truth["spares"] -= rng.randint(0, 1)  # a blamed node takes a spare; a crash alone does not
            add(journal.IN_JOB_RESTART, reason="failure", left_out=[], spares_left=truth["spares"])
            restart += 1
            step = max(journal.committed_steps(out), default=0)
            if rng.random() < 0.8:  # else its preflight fails before the start: the next restart decides
                add(journal.START, launched_at=t - 3, world_size=4)
        elif what == "slurm":  # Slurm requeues by itself (a node failure): the next attempt starts, nothing else
            restart += 1
            step = max(journal.committed_steps(out), default=0)
            add(journal.START, launched_at=t - 3, world_size=4)
            truth.update(spares=SPARES, requeued=True)
        elif what == "resume":
            add(journal.STOPPED, reason="budget spent")
            restart += 1
            add(journal.RESUME, budgets={"max_failures": rng.randint(0, 5)})
            truth.update(spares=SPARES, requeued=True)
        elif what == "cancel":
            add(journal.CANCEL, by="hpc-train cancel")
        else:
            add(journal.STRAGGLER, rank=rng.randint(0, 3), node="node1", own_s=0.2, median_own_s=0.1)
    return out


@pytest.mark.parametrize("seed", range(100))
def test_reducers_on_random_journals(seed: int) -> None:
    rng = random.Random(seed)
    truth: dict = {}
    events = random_journal(rng, rng.randint(1, 40), truth)
    restarts = [e["restart"] for e in events]
    assert journal.next_attempt(events) == max(restarts) + 1
    assert journal.current_attempt(events) == next(
        e["restart"] for e in reversed(events) if e["event"] in (journal.START, journal.RESUME)
    )
    since = journal.since_resume(events)
    assert journal.RESUME not in [e["event"] for e in since] and since == events[len(events) - len(since) :]
    assert 0 <= journal.failures_in_a_row(events) <= len(journal.named(events, journal.REQUEUE))
    assert journal.committed_step(events) == max(journal.committed_steps(events), default=None)
    # every attempt on record is in the timeline once, in order; the goodput parts add up to the allocation
    atts = journal.attempts(events)
    assert [a["restart"] for a in atts] == sorted(set(restarts))
    parts = journal.goodput(events, [{"time": 0.0, "step": 1, "step_time_s": 0.5}])
    assert all(parts[k] >= 0 for k in parts)
    summed = parts["committed"] + parts["lost"] + parts["stall"] + parts["overhead"]
    assert summed == pytest.approx(parts["allocated"], rel=1e-9, abs=1e-9)
    assert 0.0 <= parts["goodput"] <= 1.0
    # an in-job restart keeps the allocation: its gap is allocated time, only a requeue's is queue wait;
    # the spares left are those of the allocation running now
    as_requeues = [{**e, "event": journal.REQUEUE} if e["event"] == journal.IN_JOB_RESTART else e for e in events]
    old = journal.goodput(as_requeues, [{"time": 0.0, "step": 1, "step_time_s": 0.5}])
    assert parts["queue_wait"] <= old["queue_wait"] + 1e-9
    assert parts["allocated"] - old["allocated"] == pytest.approx(old["queue_wait"] - parts["queue_wait"], abs=1e-9)
    assert truth["requeued"] or parts["queue_wait"] == 0.0
    assert journal.spares_left(events, SPARES) == truth["spares"]
    # a local run's state follows its journal
    ended = journal.stopped(events)
    expected = ("CANCELLED" if journal.cancelled(events) else "FAILED") if ended else "RUNNING"
    assert journal.local_state(events, alive=True) == expected
    assert journal.local_state(events, alive=False) == (
        expected if ended else "FAILED" if journal.failures(events) else "UNKNOWN"
    )
    # a reader of the written file sees exactly these events, whatever else is in it
    text = "".join(json.dumps(e) + "\n" for e in events)
    garbage = ["[1, 2]", "{}", '{"event": "x", "time": 1, "step": "7"}', "not json"]
    lines = text.splitlines(keepends=True)
    for g in garbage:
        lines.insert(rng.randint(0, len(lines)), g + "\n")
    assert journal.parse("".join(lines) + '{"event": "sig', f"seed{seed}") == events


def test_a_new_job_counts_its_attempt_from_the_last_resume() -> None:
    ev = lambda name, restart, **f: {"time": 1.0, "event": name, "step": 0, "restart": restart, **f}  # noqa: E731
    events = [ev("start", 0), ev("requeue", 0), ev("start", 1), ev("stopped", 1), ev("resume", 2)]
    assert journal.new_job_attempt(events, 0) == 2  # a resumed Slurm job: SLURM_RESTART_COUNT 0 again
    assert journal.new_job_attempt(events, 3) == 5
    assert journal.new_job_attempt(events, None) == 2  # the local controller: requeues since the resume
    assert journal.new_job_attempt([*events, ev("start", 2), ev("requeue", 2)], None) == 3
    assert journal.new_job_attempt([], None) == 0 and journal.new_job_attempt([], 1) == 1
    assert journal.decided([*events, ev("requeue", 2)], 2) and not journal.decided(events, 2)


def test_allow_data_changed_holds_until_the_next_resume() -> None:
    """`hpc-train resume --allow-data-changed` covers the attempts it starts, requeues included (the first may
    fail before it saves on the new data); a later resume without the flag is a person's word again."""
    ev = lambda name, restart, **f: {"time": 1.0, "event": name, "step": 0, "restart": restart, **f}  # noqa: E731
    events = [ev("start", 0), ev("stopped", 0, reason="data changed")]
    assert not journal.data_change_allowed(events)
    events += [ev("resume", 1, allow_data_changed=True), ev("start", 1), ev("requeue", 1), ev("start", 2)]
    assert journal.data_change_allowed(events)
    assert not journal.data_change_allowed([*events, ev("stopped", 2), ev("resume", 3)])


def test_a_malformed_line_warns_once_and_a_torn_one_not_at_all(tmp_path: Path, capsys) -> None:
    journal.log(tmp_path, journal.START, 0, "1", 0)
    with open(RunPaths(tmp_path).events, "a") as f:
        f.write("edited by hand\n")
    journal.log(tmp_path, journal.FINISH, 9, "1", 0)
    with open(RunPaths(tmp_path).events, "a") as f:
        f.write('{"time": 3.0, "event": "sig')  # its writer killed mid-line, or still writing
    for _ in range(3):
        assert [e["event"] for e in journal.read(tmp_path)] == ["start", "finish"]
    err = capsys.readouterr().err
    assert err.count("warning") == 1 and "skipped 1 line(s)" in err and "line 2" in err, err
    clean = tmp_path / "clean"
    clean.mkdir()
    journal.log(clean, journal.START, 0, "1", 0)
    with open(RunPaths(clean).events, "a") as f:
        f.write('{"time": 3.0, "event": "sig')
    assert len(journal.read(clean)) == 1 and capsys.readouterr().err == ""
    assert journal.read(tmp_path / "never-ran") == []


def test_appends_from_many_processes_stay_whole_lines(tmp_path: Path) -> None:
    """Four writers x 200 events, each a single locked O_APPEND write: every line parses."""
    import multiprocessing

    def write(k: int) -> None:
        for i in range(200):
            journal.log(tmp_path, journal.CHAOS, i, str(k), 0, injected="x" * (k * 500))

    procs = [multiprocessing.get_context("fork").Process(target=write, args=(k,)) for k in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    lines = RunPaths(tmp_path).events.read_text().splitlines()
    assert len(lines) == 800 and len(journal.read(tmp_path)) == 800


def _event_literals(path: Path) -> list[str]:
    """Places that read an event's name (`e["event"] == ...`, `e.get("event")`) or write one by a string
    literal (`log(run_dir, "start", ...)`, `at.event("start", ...)`, `record("stopped", ...)`)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and node.slice.value == "event":
            found.append(f"{path.name}:{node.lineno} reads e['event']")
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name == "get" and node.args and isinstance(node.args[0], ast.Constant) and node.args[0].value == "event":
                found.append(f"{path.name}:{node.lineno} reads e.get('event')")
            literal = [a.value for a in node.args[:2] if isinstance(a, ast.Constant) and a.value in NAMES]
            if name in ("log", "event", "record", "log_event") and literal:
                found.append(f"{path.name}:{node.lineno} writes {literal[0]!r} by its literal")
    return found


def test_no_module_but_the_journal_names_an_event_by_itself() -> None:
    found = [f for p in sorted(PACKAGE.glob("*.py")) if p.name != "journal.py" for f in _event_literals(p)]
    assert not found, "use journal's names and reducers:\n" + "\n".join(found)


def test_the_scan_sees_a_literal(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text('if e["event"] == "start":\n    at.event("finish", 3)\nx = e.get("event")\n')
    assert len(_event_literals(probe)) == 3


def test_an_append_never_waits_long_for_a_held_lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another process holds the journal's lock (a writer that died on NFSv3 keeps it until its node
    reboots): the line goes in unlocked after APPEND_LOCK_WAIT_S, never blocking a rank's decision."""
    import fcntl
    import os
    import time

    from hpc_train import paths

    monkeypatch.setattr(paths, "APPEND_LOCK_WAIT_S", 0.3)
    journal.log(tmp_path, journal.START, 0, "1", 0)
    holder = os.fork()
    if holder == 0:  # the child holds the lock for 60 s
        fd = os.open(RunPaths(tmp_path).events, os.O_WRONLY)
        fcntl.flock(fd, fcntl.LOCK_EX)
        (tmp_path / "held").touch()
        time.sleep(60)
        os._exit(0)
    try:
        while not (tmp_path / "held").exists():
            time.sleep(0.01)
        journal.log(tmp_path, journal.FINISH, 9, "1", 0)
        assert os.waitpid(holder, os.WNOHANG) == (0, 0)  # written while the holder still held the lock
        assert [e["event"] for e in journal.read(tmp_path)] == ["start", "finish"]
    finally:
        os.kill(holder, 9)
        os.waitpid(holder, 0)


def test_an_append_goes_in_when_flock_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno
    import fcntl

    def broken(fd: int, op: int) -> None:
        raise OSError(errno.EIO, "Input/output error")  # a lost NFS lock

    monkeypatch.setattr(fcntl, "flock", broken)
    journal.log(tmp_path, journal.START, 0, "1", 0)
    assert [e["event"] for e in journal.read(tmp_path)] == ["start"]


def test_write_atomic_never_touches_the_process_umask(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A job's checkpoint thread creates files while rank 0 writes summary.json or the Prometheus textfile:
    setting the process umask to 0 for a moment made one of 20,000 of them 0666 (adversarial review)."""
    import os
    import stat

    from hpc_train.paths import write_atomic

    def no_umask(mask: int) -> int:
        raise AssertionError("write_atomic changed the process umask")

    old = os.umask(0o027)
    try:
        monkeypatch.setattr(os, "umask", no_umask)
        write_atomic(tmp_path / "shared.json", "{}\n")
        write_atomic(tmp_path / "secret.json", "{}\n", private=True)
        write_atomic(tmp_path / "marker", b"x", fsync=True)
    finally:
        monkeypatch.undo()
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "shared.json").stat().st_mode) == 0o640  # 0666 less the umask, as open()
    assert stat.S_IMODE((tmp_path / "secret.json").stat().st_mode) == 0o600
    assert (tmp_path / "marker").read_bytes() == b"x"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["marker", "secret.json", "shared.json"]  # no temp left


def test_preempt_imports_nothing_before_the_handlers_go_in() -> None:
    """start.py imports preempt first and installs its handlers right after: what preempt imports at the top
    widens the window in which a TERM kills the task unsaved (journal pulled json, tempfile, fcntl in)."""
    import ast
    import subprocess
    import sys

    code = (
        "import sys; from hpc_train import preempt; print(sorted(m for m in sys.modules if m.startswith('hpc_train')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    # task: its Pulse; reasons: three Enums (enum is in every interpreter already: `re` imports it)
    assert ast.literal_eval(out) == ["hpc_train", "hpc_train.preempt", "hpc_train.reasons", "hpc_train.task"], out
    code = "import sys; from hpc_train import preempt; print('subprocess' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"


def test_a_scripts_goodput_counts_the_work_after_its_last_checkpoint_file_as_lost_or_says_unknown() -> None:
    """Issue 29: a script without script_helper (it tells no steps) counted all its running time as committed:
    93.2% for a run whose epochs after each snapshot were redone. Now an unfinished attempt lost the time after
    its newest checkpoint file (script_checkpoint's mtime); without one known, the goodput is unknown (None),
    not a guess; a finished attempt lost nothing."""

    def attempt(restart: int, t0: float, end: str, file_at: float | None = None) -> list[dict]:
        evs = [{"time": t0 + 5, "event": journal.START, "step": 0, "job_id": "7", "restart": restart}]
        evs[0].update(launched_at=t0, target="script")
        if file_at is not None:
            evs.append({**evs[0], "event": journal.SCRIPT_CHECKPOINT, "time": t0 + 105, "mtime": file_at})
            del evs[-1]["launched_at"], evs[-1]["target"]
        evs.append({"time": t0 + 105, "event": end, "step": 0, "job_id": "7", "restart": restart})
        return evs

    # 100 s of work each; the requeued attempt's file was written 70 s in: 30 s redone
    events = [*attempt(0, 0.0, journal.REQUEUE, file_at=75.0), *attempt(1, 200.0, journal.FINISH)]
    parts = journal.goodput(events, [])
    assert (parts["lost"], parts["unknown"], parts["committed"]) == (30.0, 0.0, 170.0)
    assert parts["goodput"] == 170.0 / 210.0
    # a file from the server's clock ahead of ours, or from before this attempt: within the attempt
    assert journal.goodput(attempt(0, 0.0, journal.REQUEUE, file_at=999.0), [])["lost"] == 0.0
    assert journal.goodput(attempt(0, 0.0, journal.REQUEUE, file_at=-50.0), [])["lost"] == 100.0
    unknown = journal.goodput([*attempt(0, 0.0, journal.REQUEUE), *attempt(1, 200.0, journal.FINISH)], [])
    assert unknown["unknown"] == 100.0 and unknown["goodput"] is None
    # its end looked (script.checkpoint set) and found no newer file: all of it redone, not unknown
    looked = [*attempt(0, 0.0, journal.REQUEUE, file_at=75.0), *attempt(1, 200.0, journal.FAIL)]
    for e in looked[3:]:
        if e["event"] == journal.SCRIPT_CHECKPOINT:
            e["mtime"] = None
    looked.insert(4, {**looked[0], "event": journal.SCRIPT_CHECKPOINT, "restart": 1, "time": 305.0, "mtime": None})
    del looked[4]["launched_at"], looked[4]["target"]
    parts = journal.goodput(looked, [])
    assert (parts["lost"], parts["unknown"]) == (130.0, 0.0) and parts["goodput"] == 70.0 / 210.0
    assert not journal.progress(looked[4:5], Path("/nonexistent"))  # "none newer" is no progress
    # a script that commits through script_helper tells its steps: the step account, not the file's time
    helper = [
        *attempt(0, 0.0, journal.REQUEUE),
        {**attempt(1, 200.0, journal.FINISH)[0], "event": journal.CHECKPOINT_COMMITTED},
    ]
    assert journal.goodput(helper, [])["unknown"] == 0.0
    # a trainer's attempt (no target="script") is as before: every step it did not commit was lost, by steps
    trainer = [{**e, "target": None} for e in attempt(0, 0.0, journal.REQUEUE)]
    assert journal.goodput(trainer, [])["goodput"] == 100.0 / 105.0
