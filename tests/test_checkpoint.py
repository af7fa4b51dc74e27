"""Checkpoints on disk through the real Saver (torch DCP, a 1-rank gloo group in this process): what
counts, what resume picks, what retention keeps, and what happens when saves overlap or the clock runs out."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any

import conftest
import pytest
import torch
import torch.distributed as dist
from conftest import HPC_TRAIN, read_events, run

from hpc_train import deadlines
from hpc_train.checkpoint import MARKER, Saver, TrainState, Writer, apply_retention, step_dir, step_folders
from hpc_train.checkpoint_files import _sha256
from hpc_train.config import CheckpointConfig


@pytest.fixture(scope="module", autouse=True)
def one_rank_group():
    """torch.distributed with one rank, as in a 1-task job: the Saver's collectives run for real."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def make_state(seed: int = 0) -> TrainState:
    torch.manual_seed(seed)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    return TrainState(model, opt)


def make_saver(root: Path, events: list, **cfg: Any) -> Saver:
    def event(name: str, step: int, **fields: Any) -> None:
        events.append({"event": name, "step": step, **fields})

    return Saver(root / "checkpoints", CheckpointConfig(**cfg), root / "drills", event, expected_write_s=0.0)


def save_at(saver: Saver, state: TrainState, step: int, reason: str = "periodic") -> None:
    state.step = step
    saver.save(state, reason, background=False)


def names(root: Path) -> list[str]:
    return [p.name for p in step_folders(root / "checkpoints").values()]


def flip_a_byte(folder: Path) -> None:
    shard = folder / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one bit pattern changed
    shard.write_bytes(data)


def test_resume_picks_newest_that_verifies_and_restores_state(tmp_path: Path) -> None:
    events: list = []
    saver, state = make_saver(tmp_path, events, keep_last=5), make_state()
    for step in (20, 40):
        save_at(saver, state, step)
    want = {k: v.clone() for k, v in state.model.state_dict().items()}
    save_at(saver, state, 60)
    (step_dir(tmp_path / "checkpoints", 80)).mkdir()  # torn: a job killed before its marker
    flip_a_byte(step_dir(tmp_path / "checkpoints", 60))
    fresh, resumer = make_state(seed=1), make_saver(tmp_path, events)
    folder, verify_s, load_s = resumer.resume(fresh)
    assert folder == step_dir(tmp_path / "checkpoints", 40) and fresh.step == 40
    assert all(torch.equal(fresh.model.state_dict()[k], v) for k, v in want.items())
    (skipped,) = [e for e in events if e["event"] == "checkpoint_skipped"]
    assert sorted(skipped) == ["event", "reason", "step"] and skipped["step"] == 60
    assert conftest.names(skipped["reason"], "step_000060", "__0_0.distcp", "checksum differs")
    assert resumer.bad == {60} and resumer.verified == {40}


def test_the_data_fingerprint_is_saved_and_a_checkpoint_without_one_still_resumes(tmp_path: Path) -> None:
    """The sampler's fingerprint travels in the checkpoint, and a resume on other data knows what changed. A
    checkpoint written before the fingerprint existed (data: the position only) resumes with its position:
    before, DCP refused the key it lacks ("Missing key in checkpoint state_dict: data.fingerprint"), so every
    checkpoint of such a run was skipped and the attempt failed, requeue after requeue."""
    import numpy as np

    from hpc_train.data import Sampler

    def sampler(*lengths: int) -> Sampler:
        return Sampler(
            [np.zeros(n, dtype=np.uint8) for n in lengths], 16, 0, names=[f"s{i}" for i in range(3)][: len(lengths)]
        )

    old, new = make_state(), make_state()
    old.data, new.data = sampler(500, 500), sampler(500, 500, 300)
    old.data.position = 40
    save_at(make_saver(tmp_path / "a", []), old, 10)
    fresh = make_state(seed=1)
    fresh.data = sampler(500, 500, 300)
    assert make_saver(tmp_path / "a", []).resume(fresh)[0] is not None and fresh.data.position == 40
    assert fresh.data.changed() == "shards 2 -> 3, tokens 1,000 -> 1,300"

    class PositionOnly:  # what every checkpoint held as `data` before the fingerprint
        position = 24

        def state_dict(self) -> dict[str, Any]:
            return {"position": torch.tensor(self.position)}

    before = make_state()
    before.data = PositionOnly()
    save_at(make_saver(tmp_path / "b", []), before, 10)
    fresh = make_state(seed=1)
    fresh.data, events = sampler(500, 500), []
    folder, _, _ = make_saver(tmp_path / "b", events).resume(fresh)
    assert folder == step_dir(tmp_path / "b" / "checkpoints", 10) and fresh.step == 10, events
    assert fresh.data.position == 24 and fresh.data.saved_fingerprint is None and fresh.data.changed() == ""


def test_steps_past_a_million_sort_by_number(tmp_path: Path) -> None:
    """step_1000000 sorts before step_999980 as a string: resume picked 999,980 and retention deleted
    1,000,000 right after committing it."""
    events: list = []
    saver, state = make_saver(tmp_path, events, keep_last=1), make_state()
    save_at(saver, state, 999_980)
    save_at(saver, state, 1_000_000)
    assert names(tmp_path) == ["step_1000000"]  # keep_last=1: the older one went, the newer stayed
    fresh = make_state(seed=1)
    assert make_saver(tmp_path, []).resume(fresh)[0].name == "step_1000000" and fresh.step == 1_000_000


def test_retention_never_deletes_a_stop_save_because_a_corrupt_newer_one_exists(tmp_path: Path) -> None:
    """Step 60 committed but fails verification; resume falls back to 40; this attempt's stop save at 50
    must survive (it was deleted at once, because 60 was still the "newest")."""
    events: list = []
    saver, state = make_saver(tmp_path, events, keep_last=2), make_state()
    for step in (20, 40, 60):
        save_at(saver, state, step)
    assert names(tmp_path) == ["step_000040", "step_000060"]
    flip_a_byte(step_dir(tmp_path / "checkpoints", 60))
    attempt2, deleted_before = make_saver(tmp_path, events, keep_last=1), len(events)
    assert attempt2.resume(make_state())[0].name == "step_000040"
    save_at(attempt2, state, 50, "stop")
    assert names(tmp_path) == ["step_000040", "step_000050", "step_000060"]  # 60 is newer than the anchor, 50
    assert not [e for e in events[deleted_before:] if e["event"] == "checkpoint_deleted"]
    attempt3 = make_saver(tmp_path, events, keep_last=1)
    assert attempt3.resume(make_state())[0].name == "step_000050"
    save_at(attempt3, state, 70)  # a newer verified one: now 40 and 50 (a stop save) may go, and 60 (bad)
    assert names(tmp_path) == ["step_000070"]
    assert [(e["step"], e["anchor"]) for e in events[deleted_before:] if e["event"] == "checkpoint_deleted"] == [
        (40, 70),
        (50, 70),
        (60, 70),
    ]


def test_a_damaged_committed_file_is_skipped_never_fatal(tmp_path: Path) -> None:
    events: list = []
    saver, state = make_saver(tmp_path, events, keep_last=3), make_state()
    for step in (10, 20):
        save_at(saver, state, step)
    (step_dir(tmp_path / "checkpoints", 20) / MARKER).write_text('{"step": 20, "files": {')  # torn JSON
    save_at(saver, state, 30)  # retention reads every marker: it used to raise here, on every later save
    fresh = make_state(seed=1)
    resumer = make_saver(tmp_path, events, keep_last=3)
    assert resumer.resume(fresh)[0].name == "step_000030"
    save_at(resumer, fresh, 40)
    (step_dir(tmp_path / "checkpoints", 40) / MARKER).write_text("not json")
    (step_dir(tmp_path / "checkpoints", 30) / MARKER).write_text("[]")
    assert make_saver(tmp_path, events).resume(make_state())[0].name == "step_000010"
    assert [e["reason"] for e in events if e["event"] == "checkpoint_skipped"] == [
        "step_000040: unreadable COMMITTED",
        "step_000030: unreadable COMMITTED",
    ]
    assert [(e["step"], e["anchor"]) for e in events if e["event"] == "checkpoint_deleted"] == [
        (20, 30)
    ]  # below a good one


def test_overlapping_background_saves_all_commit(tmp_path: Path) -> None:
    """Storage slower than the save interval: a periodic save due while the previous write still runs
    waits for it and commits it first (it was replaced, never committed: with slow storage every periodic
    save was lost and a crash resumed from step 0)."""
    events: list = []
    saver, state = make_saver(tmp_path, events, keep_last=10), make_state()
    saver.writer = Writer()
    (tmp_path / "drills").mkdir()
    (tmp_path / "drills" / "slow_storage").write_text("0.5")
    for step in (1, 2, 3):
        state.step = step
        saver.periodic(state)
        assert not saver.written_here()  # still writing when the next save comes due
    saver.final(state.__class__(state.model, state.optimizer, step=4))
    committed = [(e["step"], e["reason"]) for e in events if e["event"] == "checkpoint_committed"]
    assert committed == [(1, "periodic"), (2, "periodic"), (3, "periodic"), (4, "final")]
    assert all(e["waited_s"] >= 0.3 for e in events if e["event"] == "checkpoint_committed" and e["step"] < 4)
    assert names(tmp_path) == ["step_000001", "step_000002", "step_000003", "step_000004"]


def test_stop_waits_for_a_write_in_flight_only_as_long_as_slurm_leaves(tmp_path: Path) -> None:
    """A stop with 1 s left and a background write that needs 5 s: the write is given up on (it never
    commits), the stop save is skipped (its measured write does not fit), and stop() returns while that
    write is still in flight: it did not wait for it."""
    events: list = []
    saver, state = make_saver(tmp_path, events), make_state()
    save_at(saver, state, 10)
    saver.writer = Writer()
    saver.expected_write_s = 0.8
    (tmp_path / "drills").mkdir()
    (tmp_path / "drills" / "slow_storage").write_text("5")
    state.step = 20
    saver.periodic(state)
    state.step = 21
    in_flight = saver.pending
    saver.stop(state, budget_s=1.0, agree=lambda ok: ok)
    assert in_flight is not None and not in_flight.done()  # an order, not a speed: returned before the 5 s write
    kinds = [(e["event"], e["step"]) for e in events if e["event"] != "checkpoint_deleted"]
    assert kinds == [("checkpoint_committed", 10), ("checkpoint_abandoned", 20), ("stop_save_skipped", 21)]
    assert make_saver(tmp_path, []).resume(make_state())[0].name == "step_000010"
    saver.writer.pool.shutdown(wait=True)


def test_a_stop_with_no_time_left_starts_no_save_even_with_nothing_committed(tmp_path: Path) -> None:
    """Nothing committed yet and no time left: the save used to be tried anyway ("nothing is lost by
    trying"), but a save SIGKILL cuts loses the requeue that must follow it (a TIMEOUT job is not
    requeued); the stop requeues from step 0 instead."""
    events: list = []
    saver, state = make_saver(tmp_path, events), make_state()
    state.step = 3
    saver.stop(state, budget_s=0.0, agree=lambda ok: ok)
    assert [(e["event"], e["step"]) for e in events] == [("stop_save_skipped", 3)]
    assert not (tmp_path / "checkpoints").exists()


def test_a_first_write_still_running_at_the_stop_is_not_followed_by_a_save(tmp_path: Path) -> None:
    """Issue 18, defect 1: the first attempt, nothing committed, its first background write (5 s) still
    running at the signal, 1 s of budget. The write is waited for that 1 s and given up on; no save starts
    after it (one was started with -0.01 s left, and ran 5 s past SIGKILL's time)."""
    events: list = []
    saver, state = make_saver(tmp_path, events), make_state()
    saver.writer = Writer()
    (tmp_path / "drills").mkdir()
    (tmp_path / "drills" / "slow_storage").write_text("5")
    state.step = 20
    saver.periodic(state)
    state.step = 21
    saver.stop(state, budget_s=1.0, agree=lambda ok: ok)
    # no save of step 21 was started once the budget was spent (a timing assert was here: events suffice)
    assert [(e["event"], e["step"]) for e in events] == [("checkpoint_abandoned", 20), ("stop_save_skipped", 21)]
    assert events[1]["left_s"] <= 0.0 and saver.pending is None and 21 not in saver.verified
    saver.writer.pool.shutdown(wait=True)


def test_a_stop_save_of_unknown_length_is_waited_for_only_its_budget(tmp_path: Path) -> None:
    """No write measured yet: the stop save is tried, in the background writer, and given up on when the
    budget runs out (a synchronous save ran its 5 s whatever the budget said); the stop then returns, to
    requeue, and the save's folder never counts."""
    events: list = []
    saver, state = make_saver(tmp_path, events), make_state()
    saver.writer = Writer()
    (tmp_path / "drills").mkdir()
    (tmp_path / "drills" / "slow_storage").write_text("5")
    state.step = 7
    t0 = time.monotonic()
    saver.stop(state, budget_s=1.0, agree=lambda ok: ok)
    assert time.monotonic() - t0 < 4.0
    assert [(e["event"], e["step"], e["reason"]) for e in events] == [("checkpoint_abandoned", 7, "stop")]
    assert "not written within" in events[0]["error"]
    saver.writer.pool.shutdown(wait=True)


def test_retention_keeps_last_k_every_nth_and_only_the_newest_stop_save(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    for step, reason in [
        (10, "periodic"),
        (20, "periodic"),
        (23, "stop"),
        (30, "periodic"),
        (33, "stop"),
        (40, "periodic"),
        (50, "periodic"),
    ]:
        step_dir(root, step).mkdir(parents=True)
        files = {n: {"bytes": 0, "sha256": ""} for n in (".metadata", "rank_00000.pt")}
        (step_dir(root, step) / MARKER).write_text(
            json.dumps({"step": step, "reason": reason, "world_size": 1, "files": files})
        )
    step_dir(root, 45).mkdir()  # torn, older than the anchor
    step_dir(root, 55).mkdir()  # a write of this attempt given up on, maybe still writing: left alone
    step_dir(root, 60).mkdir()  # torn above the anchor: an earlier attempt's stop save on a full disk
    (step_dir(root, 60) / "__0_0.distcp").write_bytes(b"x" * 1000)
    cfg = CheckpointConfig(keep_last=2, keep_every_steps=20)
    assert list(apply_retention(root, cfg, verified={50}, bad=set(), keep={55})) == [10, 23, 30, 33, 45, 60]
    assert names(tmp_path) == ["step_000020", "step_000040", "step_000050", "step_000055"]
    # no anchor: no committed folder goes, torn ones still do
    assert apply_retention(root, cfg, verified=set(), bad=set(), keep=set()) == {55: ""}


def test_local_crash_loop_stops_after_failure_budget(tmp_path: Path) -> None:
    proc = run(
        [
            HPC_TRAIN,
            "submit",
            f"out_dir={tmp_path}",
            "requeue.max_failures=2",
            "+cluster.env.HPC_TRAIN_FAULT=raise_at_start_always",
        ],
        timeout_s=240,
    )
    assert proc.returncode == 1
    events = read_events(tmp_path / "demo-1")
    assert [e["reason"] for e in events if e["event"] == "requeue"] == ["failure", "failure"]
    (stopped,) = [e["reason"] for e in events if e["event"] == "stopped"]
    assert conftest.names(stopped, "failure budget spent", "2 failure requeues", "requeue.max_failures=2")


@pytest.fixture()
def our_handlers():
    """hpc_train's record-only USR2/TERM handlers in this process, as in a task; pytest's restored after."""
    import signal

    from hpc_train import preempt

    saved = {s: signal.getsignal(s) for s in preempt.STOP_SIGNALS}
    yield preempt.install_handlers()  # a fresh Pulse: pytest's handlers are in, not ours
    for s, h in saved.items():
        signal.signal(s, h)


def make_attempt(tmp_path: Path, reserve_s: float = 0.0) -> Any:
    from hpc_train.attempt import Attempt
    from hpc_train.config import RunConfig
    from hpc_train.env import RankEnv
    from hpc_train.paths import RunPaths

    env = RankEnv("local", 0, 0, 1, 1, 0, 1, ("127.0.0.1",), "127.0.0.1", 0, "1", 0)
    return Attempt.build(env, RunConfig(), RunPaths(tmp_path), time.time(), {}, reserve_s)


def test_a_signal_at_the_last_step_finishes_instead_of_requeueing(tmp_path: Path, our_handlers: Any) -> None:
    import signal

    at, state = make_attempt(tmp_path), make_state()
    at.resume(state)
    state.step = 60
    os.kill(os.getpid(), signal.SIGUSR2)
    assert at.step_end(state, last_step=60) is False and not at.stopped
    summary = at.finish(state, final_loss=1.0)
    assert summary == {"final_step": 60, "final_loss": 1.0}
    events = read_events(tmp_path)
    assert [(e["event"], e["step"]) for e in events if e["event"] in ("signal", "checkpoint_committed", "finish")] == [
        ("signal", 60),
        ("checkpoint_committed", 60),
        ("finish", 60),
    ]
    assert next(e for e in events if e["event"] == "signal")["finishing"] is True


def test_an_early_usr2_leaves_the_grace_time_not_the_signal_lead(tmp_path: Path, our_handlers: Any) -> None:
    """preempt_send_user_signal: USR2 at preemption, SIGKILL after GraceTime (preempt_grace_s=30), not
    after signal_lead_s=120; the stop save is budgeted against 30 s, with no requeue reserve: Slurm
    requeues a preempted job itself when it kills it."""
    import signal

    at, state = make_attempt(tmp_path, reserve_s=35.0), make_state()
    at.resume(state)
    state.step = 7
    os.kill(os.getpid(), signal.SIGUSR2)
    assert at.step_end(state, last_step=60) is True and at.stopped and at.stop_step == 7
    sig = next(e for e in read_events(tmp_path) if e["event"] == "signal")
    assert 29 <= sig["left_s"] <= 30 and sig["reserve_s"] == 0.0
    assert [(e["step"], e["reason"]) for e in read_events(tmp_path) if e["event"] == "checkpoint_committed"] == [
        (7, "stop")
    ]


def test_first_stop_of_an_attempt_is_judged_by_earlier_attempts_writes(tmp_path: Path, our_handlers: Any) -> None:
    """An earlier attempt measured a 100 s write; this attempt has saved nothing yet and gets a SIGTERM
    with 30 s of grace: the stop save cannot finish before SIGKILL, so it is skipped (it used to "fit",
    since each attempt started from 0 s)."""
    import signal

    from hpc_train import journal

    first, state = make_attempt(tmp_path), make_state()
    first.resume(state)
    save_at(first.saver, state, 5)  # something committed to fall back on
    journal.log(tmp_path, "checkpoint_committed", 5, "1", 0, reason="periodic", write_s=100.0)  # as measured then
    second = make_attempt(tmp_path)
    assert second.saver.expected_write_s == 100.0
    state = make_state()
    second.resume(state)
    state.step = 6
    os.kill(os.getpid(), signal.SIGTERM)
    assert second.step_end(state, last_step=60) is True
    skipped = [e for e in read_events(tmp_path) if e["event"] == "stop_save_skipped"]
    assert [(e["step"], e["expected_save_s"]) for e in skipped] == [(6, 100.0)] and skipped[0]["left_s"] <= 30


@pytest.mark.parametrize(
    "damage",
    [
        {"files": {"x": 5}},  # entries of another shape
        {
            "files": {
                "../outside": {"bytes": 1, "sha256": "0"},
                ".metadata": {"bytes": 1, "sha256": "0"},
                "rank_00000.pt": {"bytes": 1, "sha256": "0"},
            },
            "world_size": 1,
        },  # a file outside the folder
        {
            "files": {".metadata": {"bytes": 1, "sha256": "0"}, "rank_00000.pt": {"bytes": 1, "sha256": "0"}},
            "world_size": "1",
        },  # world size as a string
        {"files": {}, "world_size": 1},  # nothing listed: would "verify" and then fail to load
        {"files": {".": {"bytes": 1, "sha256": "0"}, "rank_00000.pt": {"bytes": 1, "sha256": "0"}}, "world_size": 1},
    ],
)
def test_a_valid_json_manifest_of_the_wrong_shape_is_skipped(tmp_path: Path, damage: dict) -> None:
    events: list = []
    saver, state = make_saver(tmp_path, events, keep_last=3), make_state()
    save_at(saver, state, 10)
    save_at(saver, state, 20)
    (step_dir(tmp_path / "checkpoints", 20) / MARKER).write_text(json.dumps({"step": 20, **damage}))
    assert make_saver(tmp_path, events).resume(make_state())[0].name == "step_000010"
    assert [e["reason"] for e in events if e["event"] == "checkpoint_skipped"] == ["step_000020: unreadable COMMITTED"]


def test_a_file_where_a_step_folder_goes_is_replaced(tmp_path: Path) -> None:
    events: list = []
    saver, state = make_saver(tmp_path, events), make_state()
    (tmp_path / "checkpoints").mkdir()
    step_dir(tmp_path / "checkpoints", 20).write_text("a stray file")
    save_at(saver, state, 20)
    assert [(e["event"], e["step"]) for e in events] == [("checkpoint_committed", 20)]


def test_failed_writes_are_abandoned_and_training_goes_on(tmp_path: Path) -> None:
    """Writes fail as on a full disk (RLIMIT_FSIZE: EFBIG past 1 KiB), in the background and in a
    synchronous save: each save is given up on (`checkpoint_abandoned`, never committed) and the next
    one commits once writes work again. DCP raises a CheckpointException, a BaseException: it used to
    escape every handler (no fail event, no requeue decision, a traceback)."""
    import resource
    import signal

    events: list = []
    saver, state = make_saver(tmp_path, events), make_state()
    saver.writer = Writer()
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel's SIGXFSZ ends the process
    try:
        resource.setrlimit(resource.RLIMIT_FSIZE, (1024, hard))
        state.step = 1
        saver.periodic(state)
        saver.pending.future.exception()  # the background write has failed
        state.step = 2
        saver.save(state, "stop", background=False)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old_handler)
    state.step = 3
    saver.periodic(state)
    saver.final(TrainState(state.model, state.optimizer, step=4))
    kinds = [(e["event"], e["step"]) for e in events if e["event"] != "checkpoint_deleted"]
    assert kinds == [
        ("checkpoint_abandoned", 1),
        ("checkpoint_abandoned", 2),
        ("checkpoint_committed", 3),
        ("checkpoint_committed", 4),
    ]
    assert "File too large" in next(e["error"] for e in events if e["event"] == "checkpoint_abandoned")
    assert make_saver(tmp_path, []).resume(make_state())[0].name == "step_000004"


def test_a_time_limit_stop_keeps_the_requeue_reserve(tmp_path: Path, our_handlers: Any, monkeypatch: Any) -> None:
    """Issue 18, defect 1: the time-limit warning leaves signal_lead_s=120 s before SIGKILL, and the requeue
    decision after the save may take deadlines.REQUEUE_RESERVE_S (35 s). A save measured at 100 s "fit" the 120 s,
    so SIGKILL could land before `scontrol requeue` (a TIMEOUT job is not requeued: the run just ended).
    Now it is skipped and the stop requeues from step 5; the signal event names the reserve."""
    import signal

    from hpc_train import journal
    from hpc_train.config import RunConfig

    first, state = make_attempt(tmp_path), make_state()
    first.resume(state)
    save_at(first.saver, state, 5)
    journal.log(tmp_path, "checkpoint_committed", 5, "1", 0, reason="periodic", write_s=100.0)  # as measured then
    c = RunConfig().cluster
    monkeypatch.setenv("HPC_TRAIN_ALLOCATED_AT", str(time.time() - (c.timeout_min * 60 - c.signal_lead_s)))
    second, state = make_attempt(tmp_path, reserve_s=deadlines.REQUEUE_RESERVE_S), make_state()
    second.resume(state)
    state.step = 6
    os.kill(os.getpid(), signal.SIGUSR2)
    assert second.step_end(state, last_step=60) is True and second.stop_reason == "time_limit"
    events = read_events(tmp_path)
    sig = next(e for e in events if e["event"] == "signal")
    assert sig["reason"] == "time_limit" and sig["reserve_s"] == 35.0 and sig["left_s"] > 100
    skipped = [e for e in events if e["event"] == "stop_save_skipped"]
    assert [(e["step"], e["expected_save_s"]) for e in skipped] == [(6, 100.0)] and skipped[0]["left_s"] <= 85


def test_a_stop_save_torn_by_a_full_disk_goes_at_the_next_resume(tmp_path: Path) -> None:
    """Issue 18, defect 6b: a stop save failing as on a full disk (RLIMIT_FSIZE: EFBIG past 1 KiB) leaves a
    folder without COMMITTED above the newest committed one. Retention kept everything above its anchor,
    so that folder (and the space it holds) stayed for good; the next attempt's resume deletes it."""
    import resource
    import signal

    events: list = []
    saver, state = make_saver(tmp_path, events), make_state()
    save_at(saver, state, 10)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:
        resource.setrlimit(resource.RLIMIT_FSIZE, (1024, hard))
        state.step = 12
        saver.stop(state, budget_s=60.0, agree=lambda ok: ok)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old_handler)
    assert [(e["event"], e["step"]) for e in events[1:]] == [("checkpoint_abandoned", 12)]
    assert names(tmp_path) == ["step_000010", "step_000012"]  # the attempt that tore it leaves it: maybe writing
    resumer = make_saver(tmp_path, events)
    assert resumer.resume(make_state())[0].name == "step_000010"
    resumer.retain()  # as Attempt.resume does, once its start event is written
    assert names(tmp_path) == ["step_000010"]
    deleted = [(e["step"], e["anchor"], e.get("torn")) for e in events if e["event"] == "checkpoint_deleted"]
    assert deleted == [(12, 10, True)]


def test_checkpoint_io_feeds_the_hang_watchdog_only_while_bytes_move(tmp_path: Path) -> None:
    """Issue 18, defect 4: a save, a wait for a background write or a resume longer than train.watchdog_s
    was judged a hang. Inside checkpoint I/O the watchdog's clock restarts while this process moves bytes
    (the slow-storage drill trickles them), with no heartbeat tick (a hang's blame compares ticks); a write
    stuck in the kernel moves none and is left to the watchdog."""
    from hpc_train import checkpoint_files, checkpoint_write
    from hpc_train.task import Pulse

    data = tmp_path / "rank_00000.pt"
    data.write_bytes(b"x" * 8192)
    long_ago = time.monotonic() - 1000
    pulse = Pulse(last_beat=long_ago, ticks=7)
    with checkpoint_files._fed_while_bytes_move(pulse.alive):
        checkpoint_write._trickle(2.5, data)
    assert pulse.last_beat > long_ago + 990 and pulse.ticks == 7
    pulse.last_beat = long_ago
    with checkpoint_files._fed_while_bytes_move(pulse.alive):
        time.sleep(2.5)  # nothing moves
    assert pulse.last_beat == long_ago


def test_a_scripts_stop_is_judged_as_the_trainers(our_handlers: Any, monkeypatch: Any) -> None:
    """A user's script (supervisor.py) and the built-in trainer take one judgement of a stop (protocol.time_left).
    Before (adversarial review), script.py still called stop_reason with the signature it had before Slurm's
    EndTime was read: every time-limit warning of a script was judged a preemption (30 s left, not 120;
    charged to the unlimited preemption budget), so a script that never progressed requeued for ever."""
    import signal
    import types

    from hpc_train import protocol
    from hpc_train.config import RunConfig

    c = RunConfig().cluster
    monkeypatch.setenv("HPC_TRAIN_ALLOCATED_AT", str(time.time() - (c.timeout_min * 60 - c.signal_lead_s)))
    env = types.SimpleNamespace(executor="local", job_id="1", rank=0)
    os.kill(os.getpid(), signal.SIGUSR2)
    left, reason = protocol.time_left(env, c, our_handlers, time.time())
    assert reason == "time_limit" and c.signal_lead_s - 5 < left <= c.signal_lead_s
    os.kill(os.getpid(), signal.SIGTERM)  # one rank's SIGTERM: a preemption, its grace time
    left, reason = protocol.time_left(env, c, our_handlers, time.time())
    assert reason == "preempt" and left <= c.preempt_grace_s


# ---- a user's own state survives exactly (issue 19, part 4) ---------------------------------------------


class ChangingData:
    """A user's `state.data` whose state_dict changes between saves as real ones do: a tensor that shrinks,
    grows or changes dtype, keys that come and go, plain ints, floats and strings, a list of tensors."""

    def __init__(self) -> None:
        self.sd: dict[str, Any] = {}
        self.extras: list[str] = []
        self.seen = 1

    def mutate(self, rng: Any) -> None:
        if rng.random() < 0.3:  # keys and lengths change less often than shapes, dtypes and values
            self.extras, self.seen = [f"extra_{i}" for i in range(3) if rng.random() < 0.5], rng.randint(1, 3)
        shape = rng.choice([(), (0,), (1,), (rng.randint(2, 6),), (rng.randint(1, 3), rng.randint(1, 3))])
        dtype = rng.choice([torch.float32, torch.int64, torch.bfloat16])
        self.sd = {
            "buf": (torch.rand(shape) * 100).to(dtype),
            "count": rng.randint(0, 10**6),
            "ratio": rng.random(),
            "name": rng.choice(["a", "bb", "shard_0003"]),
            "seen": [torch.randint(0, 99, (rng.randint(1, 4),)) for _ in range(self.seen)],
            **{k: torch.rand(2) for k in self.extras},
        }

    def state_dict(self) -> dict[str, Any]:
        return self.sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.sd = sd


def same(a: Any, b: Any, where: str = "") -> list[str]:
    """Where a and b differ: keys, lengths, tensors' dtype, shape and values, other values."""
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{where}: keys {sorted(a)} != {sorted(b)}"]
        return [d for k in a for d in same(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{where}: length {len(a)} != {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in same(x, y, f"{where}.{i}")]
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        ok = a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        return (
            [] if ok else [f"{where}: {a.dtype} {list(a.shape)} {a.tolist()} != {b.dtype} {list(b.shape)} {b.tolist()}"]
        )
    return [] if a == b and type(a) is type(b) else [f"{where}: {a!r} != {b!r}"]


@pytest.mark.parametrize("seed", range(4))
def test_a_changing_state_is_written_as_it_was_at_each_save(tmp_path: Path, seed: int) -> None:
    """Background saves (a Writer: host buffers reused from save to save) of a state that changes between
    saves in a seeded random sequence: a data tensor of another shape or dtype, keys that come and go, new
    plain values, a layer unfrozen so the optimizer gains its state. Invariant: each committed checkpoint,
    read back whole, is what state_dict() was at its save. Before: every save was staged into the first
    save's buffers (a tensor that shrank to 1 element was written broadcast to the old size, one of another
    dtype cast to the old one, and both committed and verified; a key more or a larger tensor failed the save)."""
    import copy
    import random

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    rng = random.Random(seed)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    model[1].requires_grad_(False)  # unfrozen at a random save below
    data = ChangingData()
    state = TrainState(model, torch.optim.AdamW(model.parameters(), lr=1e-2), data=data)
    events: list = []
    saver = make_saver(tmp_path, events, keep_last=100)
    saver.writer = Writer()
    unfreeze_at, saved = rng.randint(2, 6), {}
    for step in range(1, 9):
        model[1].requires_grad_(step >= unfreeze_at)
        model(torch.randn(3, 4)).pow(2).sum().backward()
        state.optimizer.step()
        state.optimizer.zero_grad()
        data.mutate(rng)
        state.step = step
        saved[step] = copy.deepcopy(state.state_dict())
        saver.periodic(state)
        saver.commit_pending()  # read back at once: a wrong checkpoint is named before a later save fails loudly
        dcp_to_torch_save(step_dir(tmp_path / "checkpoints", step), tmp_path / f"{step}.pt")
        assert same(torch.load(tmp_path / f"{step}.pt", weights_only=False), saved[step], f"step {step}") == []
    assert [e["step"] for e in events if e["event"] == "checkpoint_committed"] == list(saved)
    assert set(saved[1]["optim"]["state"]) == {"0.weight", "0.bias"} and len(saved[8]["optim"]["state"]) == 4


def test_a_checkpoint_of_another_format_stops_with_a_sentence(tmp_path: Path) -> None:
    """COMMITTED names its layout's format. One this code does not know is a clear stop (Unrecoverable: no
    requeue), not a fallback to an older folder that this attempt's saves and retention would then bury;
    a manifest without the key (every checkpoint written before it existed) is format 1 and loads."""
    from hpc_train import __version__
    from hpc_train.preempt import Unrecoverable

    events: list = []
    saver, state = make_saver(tmp_path, events, keep_last=5), make_state()
    save_at(saver, state, 10)
    save_at(saver, state, 20)
    marker_path = step_dir(tmp_path / "checkpoints", 20) / MARKER
    marker = json.loads(marker_path.read_text())
    assert (marker["format"], marker["hpc_train"]) == (1, __version__)
    marker_path.write_text(json.dumps({k: v for k, v in marker.items() if k not in ("format", "hpc_train")}))
    assert make_saver(tmp_path, events).resume(make_state(seed=1))[0].name == "step_000020"  # written before
    marker_path.write_text(json.dumps({**marker, "format": 2, "hpc_train": "0.9.0"}))
    with pytest.raises(Unrecoverable) as e:
        make_saver(tmp_path, events).resume(make_state(seed=1))
    folder = step_dir(tmp_path / "checkpoints", 20)
    assert conftest.names(
        str(e.value),
        f"{folder} is a checkpoint of format 2",
        "hpc_train 0.9.0",
        f"({__version__}) reads format 1",
        f"hpc-train resume {tmp_path}",
        "nothing was loaded or deleted",
    )
    assert names(tmp_path) == ["step_000010", "step_000020"]
    (tmp_path / "new").mkdir()
    with pytest.raises(Unrecoverable, match=rf"^checkpoint.init_from={folder}: {folder} is a checkpoint of format 2"):
        make_saver(tmp_path / "new", [], init_from=str(folder)).init_from(make_state(seed=1))


def test_a_checkpoint_that_does_not_fit_the_state_stops_with_a_sentence(tmp_path: Path) -> None:
    """The user's code gained a buffer and a `state.data` since its checkpoints were written: resume stops
    with the missing keys and the fix, once, before loading anything. Before: DCP raised "CheckpointException
    ranks: dict_keys([0])" on every folder, the attempt failed and the requeue did the same again until the
    failure budget was spent. Every older folder has the same layout: none is tried, none deleted."""
    from hpc_train.preempt import Unrecoverable

    class Position:
        def state_dict(self) -> dict[str, Any]:
            return {"position": torch.tensor(7)}

        def load_state_dict(self, sd: dict[str, Any]) -> None:
            pass

    events: list = []
    saver, state = make_saver(tmp_path, events, keep_last=5), make_state()
    save_at(saver, state, 10)
    save_at(saver, state, 20)
    grown = make_state(seed=1)
    grown.model.register_buffer("scale", torch.ones(8))
    grown.data = Position()
    with pytest.raises(Unrecoverable) as e:
        make_saver(tmp_path, events).resume(grown)
    folder = step_dir(tmp_path / "checkpoints", 20)
    assert conftest.names(
        str(e.value),
        f"{folder} does not fit",
        "model.scale is not in the checkpoint",
        "data.position is not in",
        f"hpc-train resume {tmp_path}",
        f"checkpoint.init_from={folder}",
        "nothing was loaded or deleted",
    )
    assert not torch.equal(grown.model.weight, state.model.weight)  # nothing loaded
    assert not [e for e in events if e["event"] == "checkpoint_skipped"] and len(names(tmp_path)) == 2
    model = torch.nn.Linear(8, 8, bias=False)  # a parameter removed: the checkpoint's has no place
    shrunk = TrainState(model, torch.optim.AdamW(model.parameters()))
    with pytest.raises(
        Unrecoverable, match=r"does not fit this run's state: model.bias of the checkpoint has no place"
    ):
        make_saver(tmp_path, events).resume(shrunk)


def test_python_and_numpy_rngs_resume_where_they_were(tmp_path: Path) -> None:
    """A user's function drawing from `random` and numpy's global RNG (a data order, a dropout of its own)
    draws after a resume what the uninterrupted process would have drawn, a cached Gaussian included. A
    rank file written before these were saved still loads; those RNGs then stay as they are."""
    import random

    import numpy as np

    saver, state = make_saver(tmp_path, []), make_state()
    random.seed(1)
    np.random.seed(2)
    random.gauss(0, 1)  # each caches its second Gaussian: part of the state
    np.random.randn()
    save_at(saver, state, 10)
    uninterrupted = (random.random(), random.gauss(0, 1), np.random.randn(3).tolist(), np.random.randint(1 << 30))
    random.seed(99)  # a new process: other seeds
    np.random.seed(99)
    make_saver(tmp_path, []).resume(make_state(seed=1))
    assert (random.random(), random.gauss(0, 1), np.random.randn(3).tolist(), np.random.randint(1 << 30)) == (
        uninterrupted
    )
    rank_path = step_dir(tmp_path / "checkpoints", 10) / "rank_00000.pt"
    rank_path.chmod(0o600)
    torch.save({"rng": torch.get_rng_state()}, rank_path)  # an older rank file: torch's RNG alone
    marker = json.loads((rank_path.parent / MARKER).read_text())
    marker["files"][rank_path.name] = {"bytes": rank_path.stat().st_size, "sha256": _sha256(rank_path)}
    (rank_path.parent / MARKER).write_text(json.dumps(marker))
    random.seed(5)
    before = random.getstate()
    assert make_saver(tmp_path, []).resume(make_state(seed=1))[0] == rank_path.parent
    assert random.getstate() == before


def test_init_from_without_the_optimizer_leaves_a_fresh_optimizer(tmp_path: Path) -> None:
    """checkpoint.init_from without init_from_optimizer: N steps from there are bit-identical to N steps of
    the same weights loaded by hand with a fresh AdamW. Before: the load asked for the optimizer's state
    dict too, whose first call on a fresh optimizer takes a zero-lr step (torch's _init_optim_state): AdamW
    began at step 2 of its bias correction with zero moments, its first update 0.74x a fresh one's."""
    source = make_state()
    make_saver(tmp_path / "src", []).save(source, "final", background=False)
    folder = step_dir(tmp_path / "src" / "checkpoints", 0)

    def fresh() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(7)
        model = torch.nn.Linear(8, 8)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    def train(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(3)
        for _ in range(5):
            model(torch.randn(4, 8, generator=gen)).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
        return [p.detach().clone() for p in model.parameters()]

    by_hand = fresh()
    by_hand[0].load_state_dict(source.model.state_dict())
    model, opt = fresh()
    (tmp_path / "new").mkdir()
    make_saver(tmp_path / "new", [], init_from=str(folder)).init_from(TrainState(model, opt))
    assert not opt.state  # as fresh as by_hand's
    assert all(torch.equal(a, b) for a, b in zip(train(model, opt), train(*by_hand)))


class Masked(torch.nn.Module):
    """What a throwaway forward must leave as it was (review): a buffer registered None that the first
    forward fills (ahead of BatchNorm's in named_buffers once filled: put back by position, it took the
    running mean's values), Python's RNG drawn in the forward, a dataclass output."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mask", None, persistent=False)
        self.bn, self.lin = torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> Out:
        if self.mask is None:
            self.mask = torch.ones(16)
        return Out(self.lin(self.bn(x)) * self.mask * (1 + random.random() * 1e-3))


@dataclasses.dataclass
class Out:
    y: torch.Tensor


class DDPLoop:
    """docs/byo.md's loop over a DDP with dropout, BatchNorm and an LR schedule outside TrainState (as
    torchrun scripts have them), in this 1-rank group, one step at a time; `micro` no_sync micro-batches
    before each step's syncing one."""

    def __init__(self, at: Any, micro: int = 0) -> None:
        from torch.nn.parallel import DistributedDataParallel as DDP

        torch.manual_seed(0)
        self.pre = torch.nn.Linear(8, 8)  # outside the DDP: its input has a graph of the caller's
        self.model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.1), Masked())
        self.net = DDP(self.model)
        self.head = torch.nn.Linear(16, 1)
        params = [*self.pre.parameters(), *self.model.parameters(), *self.head.parameters()]
        self.state = TrainState(
            torch.nn.ModuleList([self.pre, self.model, self.head]), torch.optim.AdamW(params, lr=1e-2)
        )
        self.at, self.micro = at, micro
        self.schedule = torch.optim.lr_scheduler.LambdaLR(self.state.optimizer, lambda s: 1.0 / (1 + s))
        at.resume(self.state)  # the optimizer's LR as saved; the schedule counts on from the step
        self.schedule.last_epoch = self.state.step
        self.lrs: list[float] = []

    def step(self) -> None:
        gen = torch.Generator().manual_seed(self.state.step)
        self.state.optimizer.zero_grad()
        for _ in range(self.micro):
            with self.net.no_sync():
                self.head(self.net(self.pre(torch.randn(4, 8, generator=gen))).y).square().mean().backward()
        self.head(self.net(self.pre(torch.randn(4, 8, generator=gen))).y).square().mean().backward()
        self.lrs.append(self.state.optimizer.param_groups[0]["lr"])
        self.state.optimizer.step()
        self.schedule.step()
        self.state.step += 1

    def weights(self) -> list[torch.Tensor]:
        return [t.detach().clone() for t in [*self.state.model.parameters(), *self.state.model.buffers()]]


@pytest.mark.parametrize("micro", [0, 2])
def test_the_first_step_after_a_ddp_resume_runs_in_rebuilt_buckets_and_once(tmp_path: Path, micro: int) -> None:
    """After a resume, the first syncing forward of a DDP first takes a throwaway forward and backward,
    so DDP rebuilds its buckets before the real step's gradients are reduced, as in the uninterrupted run
    (4 ranks: tests/test_local.py). The loop's step runs once: weights, BatchNorm's statistics, the
    RNG, gradients of no_sync micro-batches and an LR schedule outside TrainState end as uninterrupted.
    Before (a replay of the first step after a second load) the schedule stepped twice, the LR off by one
    step for the rest of the run."""
    ref = DDPLoop(make_attempt(tmp_path), micro)
    for _ in range(3):
        ref.step()
        ref.at.step_end(ref.state, last_step=6)
    ref.at.saver.save(ref.state, "periodic", background=False)
    for _ in range(3):
        ref.step()
    rng, py_rng = torch.get_rng_state(), random.getstate()

    cut = DDPLoop(make_attempt(tmp_path), micro)  # resumes at step 3
    assert cut.state.step == 3 and cut.net._has_rebuilt_buckets is False
    for _ in range(3):
        cut.step()
        assert cut.net._has_rebuilt_buckets is True  # at the real forward, before its backward
        assert cut.at.step_end(cut.state, last_step=6) is False
    assert cut.state.step == 6 and cut.lrs == ref.lrs[3:]
    assert all(torch.equal(a, b) for a, b in zip(cut.weights(), ref.weights()))
    assert torch.equal(torch.get_rng_state(), rng) and random.getstate() == py_rng  # the throwaway drew nothing
    first = [e for e in read_events(tmp_path) if e["event"] == "first_step"]
    assert first[-1]["step"] == 4 and 0 < first[-1]["ddp_rebucket_s"] < first[-1]["step_time_s"]


def test_a_ddp_whose_buckets_were_rebuilt_takes_no_throwaway(tmp_path: Path) -> None:
    """A DDP that rebuilt its buckets before the resume (a loop that took a throwaway of its own) pays for
    no second throwaway."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    ref = DDPLoop(make_attempt(tmp_path))
    ref.step()
    ref.at.saver.save(ref.state, "periodic", background=False)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.1), Masked())
    net = DDP(model)
    for _ in range(2):  # the second forward rebuilds
        net(torch.randn(4, 8)).y.sum().backward()
    assert net._has_rebuilt_buckets
    at = make_attempt(tmp_path)
    whole = torch.nn.ModuleList([torch.nn.Linear(8, 8), model, torch.nn.Linear(16, 1)])
    state = TrainState(whole, torch.optim.AdamW(whole.parameters(), lr=1e-2))
    at.resume(state)
    net(torch.randn(4, 8)).y.sum().backward()
    state.step += 1
    at.step_end(state, last_step=10)
    assert "ddp_rebucket_s" not in [e for e in read_events(tmp_path) if e["event"] == "first_step"][-1]


class Branchy(torch.nn.Module):
    """A branch no step reaches before `late`: AdamW has no state for it at an earlier save."""

    def __init__(self, late: int) -> None:
        super().__init__()
        self.trunk, self.branch, self.late, self.step = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), late, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.branch(self.trunk(x)) if self.step >= self.late else self.trunk(x)


def test_optimizer_state_no_step_made_before_the_save_resumes_as_uninterrupted(tmp_path: Path) -> None:
    """A parameter with no AdamW state at the save (no gradient reached it yet) resumed: the load asked for
    a state get_state_dict invented (step 1, zero moments) and the checkpoint lacks, and every attempt
    failed ("CheckpointException"; then a stop saying other code wrote it). Now it resumes, and that
    parameter's state is made at its first gradient, as in the uninterrupted run: bit-identical."""

    def run(at: Any, steps: int) -> TrainState:
        torch.manual_seed(0)
        model = Branchy(late=3)
        state = TrainState(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        at.resume(state)
        while state.step < steps:
            model.step = state.step
            model(torch.randn(2, 4, generator=torch.Generator().manual_seed(state.step))).sum().backward()
            state.optimizer.step()
            state.optimizer.zero_grad()
            state.step += 1
            if state.step == 2:
                at.saver.save(state, "periodic", background=False)
        return state

    (tmp_path / "ref").mkdir()
    (tmp_path / "cut").mkdir()
    ref = run(make_attempt(tmp_path / "ref"), 6)
    run(make_attempt(tmp_path / "cut"), 2)
    cut = run(make_attempt(tmp_path / "cut"), 6)
    assert cut.step == 6
    assert all(torch.equal(a, b) for a, b in zip(cut.model.state_dict().values(), ref.model.state_dict().values()))


def test_the_finish_is_on_record_before_the_memory_copy_is_waited_for(tmp_path: Path, our_handlers: Any) -> None:
    """Review: Attempt.finish waited for the memory copy in flight (up to 120 s + 10 s) before summary.json and the
    finish event; a copy stuck on a slow buddy at a time limit's last step let SIGKILL find the run unfinished (its
    afterok dependents cancelled). The finish is on record before the wait begins."""
    import types

    from hpc_train import journal

    at, state = make_attempt(tmp_path), make_state()
    seen: list[bool] = []

    def wait(timeout_s: float) -> bool:  # the copy in flight, as MemoryTier's: what is on record by now
        seen.append((tmp_path / "summary.json").exists() and journal.finished(journal.read(tmp_path)) is not None)
        return True

    at.memory = types.SimpleNamespace(
        idle=types.SimpleNamespace(is_set=lambda: bool(seen)),
        wait=wait,
        abandon=lambda: None,
        clean=lambda join_s: None,
    )
    at.finish(state)
    assert seen == [True]


def test_init_from_a_stage_starts_every_attempt_from_the_same_checkpoint(tmp_path: Path) -> None:
    """Review: checkpoint.init_from=RUN (a stage the run is queued after, submit --after) was resolved by every rank
    at every attempt: a stage resumed meanwhile had committed a newer checkpoint (ranks could differ; a requeued
    attempt before its first save took another start than the first). Rank 0 chooses once: the stage's final
    checkpoint, or the one an earlier attempt of this run started from while it still has its marker."""
    from hpc_train import journal

    stage, run = tmp_path / "pre-1", tmp_path / "ft-1"
    stage_saver, state = make_saver(stage, [], keep_last=5), make_state()
    for step in (10, 20):
        save_at(stage_saver, state, step, "final")
    run.mkdir()
    ft = make_saver(run, [], init_from=str(stage))
    assert ft.init_source() == stage / "checkpoints" / "step_000020"  # the stage's final one
    source, _, _ = ft.init_from(make_state(1))
    journal.log(run, journal.START, 0, "9", 0, init_from=source)  # what Attempt.resume records
    save_at(stage_saver, state, 30, "final")  # the stage resumed and went on meanwhile
    assert ft.init_source() == stage / "checkpoints" / "step_000020"  # the first attempt's, still there
    shutil.rmtree(stage / "checkpoints" / "step_000020")
    assert ft.init_source() == stage / "checkpoints" / "step_000030"  # gone: the stage's final one now
