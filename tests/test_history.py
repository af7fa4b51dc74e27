"""history.py, without Slurm: sacct's text as the dev cluster printed it (tests/test_slurm_history.py makes the same
history live), seeded random journals whose true counts are known, the reconciling of the two, the thin rule and
the sentence a person reads."""

from __future__ import annotations

import getpass
import itertools
import json
import random
import sys
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import names

from hpc_train import history, journal, preempt
from hpc_train.history import DEFAULTS, KINDS, Rates
from hpc_train.reasons import Fate

# ---- random journals ------------------------------------------------------------------------------------------


def random_run(
    rng: random.Random, job: str, t0: float, nodes: int = 0
) -> tuple[list[dict], Counter, float, list[float]]:
    """A run's events as its attempts write them, with what history must count from them: (events, stops by kind,
    node-hours, queue waits after its requeues). Each attempt ends as a kind would end it; several ranks may write
    their `fail`; the last attempt finishes, is cancelled or still runs. nodes: each attempt's (0: 1 to 8 at random)."""
    events: list[dict] = []
    truth: Counter = Counter()
    node_hours, waits, t = 0.0, [], t0
    attempts = rng.randint(1, 6)
    for restart in range(attempts):

        def add(name: str, at: float, **f: object) -> None:
            events.append({"time": at, "event": name, "step": 0, "job_id": job, "restart": restart, **f})

        names = [f"node{i}" for i in range(nodes or rng.randint(1, 8))]
        end = t + rng.uniform(60, 7200)
        add(journal.START, t + 3, nodes=names, world_size=2 * len(names), launched_at=t)
        add(journal.FIRST_STEP, t + 9, step_time_s=6.0)
        kind = rng.choice([*KINDS, "in_job_crash"]) if restart < attempts - 1 else rng.choice(["finish", "cancel", ""])
        for _ in range(rng.randint(1, 3) if kind in ("failures", "node_failures", "in_job_crash") else 0):
            add(journal.FAIL, end - 2, rank=rng.randrange(8), error="RuntimeError: Connection closed by peer")
        if kind in ("preemptions", "time_limits"):
            add(journal.SIGNAL, end - 5, reason="preempt" if kind == "preemptions" else "time_limit")
            add(journal.CHECKPOINT_COMMITTED, end - 2, reason="stop", save_s=1.0)
            if rng.random() < 0.3:  # a rank killed at KillWait on its way out: still the stop, not a failure
                add(journal.FAIL, end - 1, rank=1, error="RuntimeError: Connection closed by peer")
        if kind == "node_failures":
            add(journal.NODE_EXCLUDED, end - 1, node=names[-1], why="left the job's allocation")
        if kind in ("node_failures", "in_job_crash"):  # relaunched inside the allocation: held meanwhile
            add(journal.IN_JOB_RESTART, end, left_out=[names[-1]] if kind == "node_failures" else [], reason="failure")
            node_hours += len(names) * (end + 4 - t) / 3600
            t = end + 4
        else:
            add(journal.REQUEUE if kind in KINDS else journal.FINISH if kind == "finish" else journal.CANCEL, end)
            node_hours += len(names) * (end - t) / 3600
            waits += [rng.uniform(10, 900)] if kind in KINDS else []
            t = end + (waits[-1] if kind in KINDS else 0)
        truth[{"in_job_crash": "failures"}.get(kind, kind)] += kind in (*KINDS, "in_job_crash")
    return events, truth, node_hours, waits


def write_journal(run_dir: Path, events: list[dict], partition: str = "low") -> Path:
    run_dir.mkdir(parents=True)
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (run_dir / "config.yaml").write_text(
        f"name: x\ncluster:\n  executor: slurm\n  partition: {partition}\n  nodes: 2\n"
    )
    return run_dir


@pytest.mark.parametrize("seed", range(40))
def test_random_journals_are_counted_as_they_were_written(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    runs = [random_run(rng, str(1000 + i), 1e6 + i * 1e5) for i in range(rng.randint(1, 5))]
    dirs = [write_journal(tmp_path / f"r{i}", events) for i, (events, *_) in enumerate(runs)]
    got = history.from_journals(dirs)
    truth = sum((t for _, t, _, _ in runs), Counter())
    assert {k: getattr(got, k) for k in KINDS} == {k: truth[k] for k in KINDS}
    assert got.node_hours == pytest.approx(sum(h for _, _, h, _ in runs))
    assert got.queue_waits_s == pytest.approx(sorted(w for *_, ws in runs for w in ws))
    assert (got.jobs, got.source) == (len(runs), "journals")
    # per run, merged in any order: the same Rates
    parts = [history.from_journals([d]) for d in dirs]
    for order in itertools.islice(itertools.permutations(parts), 6):
        assert history.merge(*order) == replace(got, window_days=0.0)
    # rates scale with the run's size, and with node-hours
    if got.node_hours:
        assert got.unannounced_per_h(8) == pytest.approx(2 * got.unannounced_per_h(4))
        double = replace(got, node_hours=2 * got.node_hours)
        assert double.announced_per_h(4) == pytest.approx(got.announced_per_h(4) / 2)


def test_attempts_before_the_window_are_left_out(tmp_path: Path) -> None:
    events, truth, _, _ = random_run(random.Random(3), "77", 1e6)
    run_dir = write_journal(tmp_path / "r", events)
    assert history.from_journals([run_dir], window_days=1, now_s=1e6 + 400 * 86400).jobs == 0
    whole = history.from_journals([run_dir], window_days=400, now_s=1e6 + 86400)
    assert {k: getattr(whole, k) for k in KINDS} == {k: truth[k] for k in KINDS}


def test_a_cancelled_attempt_is_no_fault() -> None:
    """scancel: the ranks get SIGTERM (a signal event, reason preempt) and stop with preempt.decide's own words."""
    why = preempt.decide("preempt", [], None, Fate.CANCELLED)[1]
    e = lambda name, **f: {"time": 1.0, "event": name, "step": 5, "job_id": "9", "restart": 0, **f}  # noqa: E731
    assert history.attempt_kind([e("signal", reason="preempt"), e("stopped", reason=why)]) is None
    assert history.attempt_kind([e("signal", reason="preempt"), e("requeue", reason="preempt")]) == "preemptions"
    assert history.attempt_kind([e("signal", reason="time_limit"), e("fail", rank=1)]) == "time_limits"
    assert history.attempt_kind([e("requeue", reason="preempt", by="slurm")]) == "requeues"


def test_journal_runs_are_those_queued_on_the_partition(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    low = write_journal(runs / "a-1", [], "low")
    write_journal(runs / "b-1", [], "debug")
    trial = write_journal(runs / "sweep-1" / "0000", [], "low")
    (runs / "sweep-1" / "sweep.json").write_text("{}")
    (runs / "latest").symlink_to(low)  # counted once
    local = write_journal(runs / "c-1", [], "low")
    (local / "config.yaml").write_text("cluster:\n  executor: local\n  partition: low\n")
    assert sorted(d.resolve() for d in history.journal_runs(runs, "low")) == sorted([low, trial])


# ---- sacct ----------------------------------------------------------------------------------------------------

# slurm.accounting(now - 1 day, partition="low", nodes=(1, 2)) on the dev cluster, Slurm 22.05 (2026-12-05), after:
# 30003 --time=1 (TIMEOUT after 87 s: Slurm checks limits every ~30 s), 30004 `sleep 2; kill -KILL $$` (FAILED), 30005 `true`, 30006 scancel, 30007
# `scontrol requeue`, 30008 on node3 set DOWN (NODE_FAIL, Slurm requeued it), 30009 preempted by a `high` job on its
# node (PREEMPTED after GraceTime, requeued); the reruns of 30007-9 cancelled at the end (CANCELLED, no fault).
# --duplicates: one record per run (without it, the REQUEUED, NODE_FAIL and PREEMPTED lines are not printed); a
# rerun's Submit is the requeue, and it starts 13-15 s later (AuthInfo cred_expire=10, then the scheduler's pass).
CAPTURE = """\
30003|TIMEOUT|low|1|87|2026-12-05T16:19:15|2026-12-05T16:19:17|2026-12-05T16:20:44
30004|FAILED|low|1|2|2026-12-05T16:19:15|2026-12-05T16:19:17|2026-12-05T16:19:19
30005|COMPLETED|low|1|0|2026-12-05T16:19:15|2026-12-05T16:19:17|2026-12-05T16:19:17
30006|CANCELLED by 0|low|1|3|2026-12-05T16:19:15|2026-12-05T16:19:17|2026-12-05T16:19:20
30007|REQUEUED|low|1|4|2026-12-05T16:19:15|2026-12-05T16:19:17|2026-12-05T16:19:21
30008|NODE_FAIL|low|1|4|2026-12-05T16:19:15|2026-12-05T16:19:17|2026-12-05T16:19:21
30009|PREEMPTED|low|1|47|2026-12-05T16:19:15|2026-12-05T16:19:17|2026-12-05T16:20:04
30007|CANCELLED by 0|low|1|72|2026-12-05T16:19:21|2026-12-05T16:19:34|2026-12-05T16:20:46
30008|CANCELLED by 0|low|1|72|2026-12-05T16:19:21|2026-12-05T16:19:34|2026-12-05T16:20:46
30009|CANCELLED by 0|low|1|27|2026-12-05T16:20:04|2026-12-05T16:20:19|2026-12-05T16:20:46
"""


def test_sacct_capture_counts_each_kind_once_and_cancels_as_nothing() -> None:
    rates = history.from_sacct(CAPTURE, window_days=1, min_fault_s=0)
    counts = {k: getattr(rates, k) for k in KINDS}
    assert counts == {"preemptions": 1, "time_limits": 1, "requeues": 1, "node_failures": 1, "failures": 1}
    assert rates.jobs == 7  # distinct job ids, not records
    assert rates.node_hours * 3600 == pytest.approx(87 + 2 + 0 + 3 + 4 + 4 + 47 + 72 + 72 + 27)
    assert rates.queue_waits_s == (13.0, 13.0, 15.0)  # the requeue's end -> the next run's start
    assert rates.unannounced_per_h(2) == pytest.approx(2 * 2 / (318 / 3600))
    assert rates.announced_per_h(1) == pytest.approx(3 / (318 / 3600))
    faults, stops, wait = rates.describe(1).split("; ")  # one line, a clause each
    assert names(faults, "1 unannounced fault per 2.65 min", "at 1 node", "node failures 1, failures 1")
    assert names(faults, "in 0.088 node-hours", "of 7 jobs", "1 day on low")
    assert names(stops, "1 announced stop per 1.77 min", "preemptions 1, time limits 1", "requeues 1")
    assert names(wait, "queue wait", "13 s", "(median of 3)")


def test_a_record_of_another_shape_is_skipped() -> None:
    text = "sacct: error: something\n" + CAPTURE.splitlines()[1] + "\n30099|30099|RUNNING|low|x|5|a|b|c|d\n\n"
    assert [r.state for r in history.parse_accounting(text)] == ["FAILED"]
    assert history.from_sacct("") == Rates(source="sacct")


def test_a_reused_job_id_is_no_queue_wait() -> None:
    """--duplicates lists a different job that reused an id (ids reset): it follows a COMPLETED run, no wait."""
    again = CAPTURE.splitlines()[2].replace("2026-12-05", "2026-12-06")  # 30005 COMPLETED, then 30005 again
    assert history.from_sacct(CAPTURE + again + "\n").queue_waits_s == (13.0, 13.0, 15.0)


# ---- the two together, the thin rule, the sentence --------------------------------------------------------------


def test_a_job_in_both_is_counted_once_with_sacct_node_failures_and_node_hours() -> None:
    """An hpc_train run whose node went DOWN reads from inside as a SIGTERM (a signal, reason preempt, and Slurm's own
    requeue); sacct says NODE_FAIL. A failure hpc_train requeued is REQUEUED in sacct; its journal says failure."""
    accounting = history.sacct_jobs(history.parse_accounting(CAPTURE), min_fault_s=0)
    journals = {
        "30008": Rates(preemptions=1, node_hours=0.02, jobs=1, queue_waits_s=(20.0,)),
        "30007": Rates(failures=1, node_hours=0.02, jobs=1),
        "555": Rates(failures=2, node_hours=1.0, jobs=1),  # a job sacct did not list (another window, node count)
    }
    merged = history.merge(*history.reconcile(accounting, journals))
    counts = {k: getattr(merged, k) for k in KINDS}
    assert counts == {"preemptions": 1, "time_limits": 1, "requeues": 0, "node_failures": 1, "failures": 4}
    assert merged.jobs == 8
    assert merged.node_hours == pytest.approx(318 / 3600 + 1.0)  # sacct's for 30007 and 30008
    assert merged.queue_waits_s == (13.0, 13.0, 15.0)  # sacct's, where it measured one


def test_thin_below_either_threshold_and_the_sentence() -> None:
    many = Rates(node_failures=2, failures=1, node_hours=812.0, jobs=40, window_days=30, partition="low")
    assert history.thin(many) == ""
    assert names(
        history.thin(replace(many, jobs=3)), "3 jobs", "30 days on partition low", "the defaults", "than 10 jobs"
    )
    few = history.thin(replace(many, failures=0))
    assert names(few, "2 unannounced faults", "812 node-hours", "30 days on partition low", "the defaults")
    assert names(few, "3 faults or 15,000 node-hours")  # the threshold it fell short of
    assert history.thin(replace(many, failures=0, node_hours=20_000.0)) == ""
    assert history.thin(replace(many, jobs=3), min_jobs=1) == ""
    many = replace(many, preemptions=9, time_limits=4, queue_waits_s=(30.0, 45.0, 60.0), source="sacct")
    faults, stops, wait = many.describe(4).split("; ")
    assert names(faults, "1 unannounced fault per 2.82 days", "at 4 nodes", "node failures 2, failures 1")
    assert names(faults, "in 812 node-hours", "of 40 jobs", "30 days on low")
    assert names(stops, "1 announced stop per 15.6 h", "(preemptions 9, time limits 4)")
    assert names(wait, "queue wait", "45 s", "(median of 3)")
    (defaults,) = DEFAULTS.describe(4).split("; ")  # no announced stops, no queue wait measured
    assert names(defaults, "1 unannounced fault per 52.1 days", "at 4 nodes", "node failures 4, failures 1")
    assert names(defaults, "in 25,000 node-hours", "the defaults")


def test_the_defaults_are_one_unannounced_fault_per_5000_node_hours() -> None:
    assert DEFAULTS.unannounced_per_h(1) == pytest.approx(1 / 5000)
    assert DEFAULTS.announced_per_h(16) == 0.0 and DEFAULTS.queue_wait_s is None
    assert history.MIN_NODE_HOURS == pytest.approx(15_000)


def test_site_rates_without_an_answer_from_sacct_reads_the_journals_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """slurmdbd down: sacct's own error (a fake: the real cluster's slurmdbd is shared by every test of a worker)."""
    refused = "sacct: error: Problem talking to the database: Connection refused"
    state = fake_sacct(tmp_path, monkeypatch, f'echo "$@" > $STATE/args; echo "{refused}" >&2; exit 1')
    events, truth, _, _ = random_run(random.Random(5), "4242", time.time() - 3600, nodes=2)
    write_journal(tmp_path / "runs" / "r-1", events)
    rates = history.site_rates("low", 2, runs_dir=tmp_path / "runs", min_jobs=1, min_node_hours=0)
    assert rates.source == "journals" and rates.jobs == 1
    assert {k: getattr(rates, k) for k in KINDS} == {k: truth[k] for k in KINDS}
    assert names(rates.note, "sacct did not answer", "journals only", "(`sacct -X -P -n --duplicates -S ")
    assert rates.note.endswith(f"failed: {refused})")  # sacct's own words
    args = (state / "args").read_text().split()  # this user's jobs on low, of 1 to 4 nodes for a run of 2
    assert args[-4:] == ["-u", getpass.getuser(), "--partition=low", "--nnodes=1-4"], args
    thin = history.site_rates("low", 2, runs_dir=tmp_path / "runs")
    assert (thin.source, thin.node_failures) == ("defaults", 4)
    assert names(thin.thin, "1 job in 30 days", "on partition low", "using the defaults", "fewer than 10 jobs")
    assert thin.describe(2).endswith(f"{thin.thin}; {thin.note}")
    # a run of 2 nodes is no history for one of 8 (sacct is asked for 4 to 16 nodes too)
    assert history.site_rates("low", 8, runs_dir=tmp_path / "runs", min_jobs=1, min_node_hours=0).jobs == 0


def test_a_crash_at_start_up_is_not_a_site_fault() -> None:
    """Review: ten 2-node debug jobs that FAILED 45 s in (a wrong path, an import) made the site's history say one
    fault per 0.7 min, and auto save every few steps for hours. A failure within MIN_FAULT_ELAPSED_S of its start,
    or an attempt's `fail` before its first step, is its start-up's, the same at every try: not counted."""
    rows = [f"{100 + i}|FAILED|low|2|45|2026-12-01T10:00:00|2026-12-01T10:00:05|2026-12-01T10:00:50" for i in range(10)]
    rows.append("200|FAILED|low|2|3600|2026-12-01T11:00:00|2026-12-01T11:00:05|2026-12-01T12:00:05")
    rates = history.from_sacct("\n".join(rows) + "\n")
    assert rates.failures == 1 and rates.jobs == 11, rates
    early = [
        {"time": 10.0, "event": "start", "step": 0, "job_id": "7", "restart": 0, "launched_at": 5.0, "nodes": ["a"]},
        {"time": 11.0, "event": "fail", "step": 0, "job_id": "7", "restart": 0, "error": "ImportError: x"},
    ]
    assert history.attempt_kind(early) is None
    assert history.attempt_kind([*early[:1], {**early[0], "event": "first_step", "step": 1}, early[1]]) == "failures"


def test_the_sacct_a_submit_prefetches_is_the_one_site_rates_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A Slurm submit starts the history's sacct beside its other Slurm calls (plan._accounting_calls): site_rates at
    the same moment takes that answer, and sacct runs once."""
    from hpc_train import slurm

    record = "77|NODE_FAIL|low|1|60|2026-01-01T00:00:00|2026-01-01T00:00:00|2026-01-01T00:01:00"
    state = fake_sacct(tmp_path, monkeypatch, f'echo run >> $STATE/runs; echo "{record}"')
    now = time.time() - 5  # not this second: a site_rates that asked for another moment would run sacct again
    slurm.prefetch(history.accounting_args("low", 1, 30, now))
    try:
        rates = history.site_rates("low", 1, runs_dir=tmp_path / "runs", min_jobs=1, min_node_hours=0, now_s=now)
    finally:
        slurm.drop_prefetched()
    assert (rates.node_failures, rates.jobs, rates.source) == (1, 1, "sacct")
    assert (state / "runs").read_text().split() == ["run"]


def test_a_history_with_no_unannounced_fault_still_counts_one_and_auto_keeps_saving() -> None:
    """Review: 0 faults in 16,000 node-hours was a rate of 0, the interval the 7-day cap, and the first crash lost a
    whole time-limit segment. None seen is at most 1 in the history's node-hours, split 4:1 as the defaults."""
    from hpc_train import intervals
    from hpc_train.config import CheckpointConfig

    clean = Rates(node_hours=16_000.0, jobs=40, source="sacct", window_days=30, partition="low")
    assert clean.unannounced_per_h(16) == pytest.approx(16 / 16_000)
    assert clean.per_node_h("node_failures") == pytest.approx(4 * clean.per_node_h("failures"))
    assert clean.describe(16).startswith("at most 1 unannounced fault per ")
    m = intervals.Measured(1.0, (2.0, 10.0), None, 60.0)
    choice = intervals.choose(CheckpointConfig(every_steps="auto"), m, clean, nodes=16, spares=False)
    assert choice.every_steps < 7 * 86400  # the cap's 604,800 steps of 1 s
    one = replace(clean, failures=1)  # a fault seen: its own rate, not the floor's
    assert one.unannounced_per_h(16) == pytest.approx(16 / 16_000) and one.per_node_h("node_failures") == 0


def test_a_boot_fail_is_no_fault_but_its_requeues_wait_counts() -> None:
    """Review: BOOT_FAIL (a node that never came up: nothing ran, nothing lost) counted as a node failure."""
    text = "\n".join(
        [
            "5|BOOT_FAIL|low|4|0|2026-01-01T00:00:00|2026-01-01T00:00:00|2026-01-01T00:00:00",
            "5|COMPLETED|low|4|3600|2026-01-01T00:00:00|2026-01-01T00:01:00|2026-01-01T01:01:00",
        ]
    )
    job = history.sacct_jobs(history.parse_accounting(text))["5"]
    assert (job.node_failures, job.failures, job.queue_waits_s) == (0, 0, (60.0,))


def test_a_prefetched_sacct_that_does_not_answer_is_not_asked_twice(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Review: a prefetched sacct past its timeout was run again with a timeout of its own (20 s, not 10)."""
    from hpc_train import slurm

    state = fake_sacct(tmp_path, monkeypatch, "echo run >> $STATE/runs; exec sleep 30")
    args = history.accounting_args("low", 1, 30, time.time())
    slurm.prefetch(args)
    try:
        with pytest.raises(slurm.SlurmError, match="did not answer within 1 s"):
            slurm.call(args, timeout_s=1, retries=0)
    finally:
        slurm.drop_prefetched()
    assert (state / "runs").read_text().split() == ["run"]


@pytest.mark.parametrize("days", [1e12, 0, -1, float("nan")])
def test_a_history_window_out_of_range_is_a_sentence(days: float) -> None:
    """Review: 1e12 days reached time.localtime (OSError: a traceback at submit)."""
    from hpc_train.config import CheckpointConfig

    with pytest.raises(ValueError, match=r"checkpoint.history_window_days=.* must be in \(0, 3650\]"):
        CheckpointConfig(history_window_days=days)


def test_sacct_calls_prefetched_together_wait_their_timeout_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Review: a sweep over 3 partitions prefetches 3 sacct calls; each read gave its call a fresh 10 s, so a silent
    slurmdbd held the submit 30 s. A prefetched call's timeout counts from its start: all three, ~one timeout."""
    from hpc_train import slurm

    fake_sacct(tmp_path, monkeypatch, "exec sleep 30")  # exec: the kill reaches it, and its pipe closes
    now = time.time()
    asked = [history.accounting_args(p, 1, 30, now) for p in ("low", "high", "mid")]
    slurm.prefetch(*asked)
    began = time.monotonic()
    try:
        for args in asked:
            with pytest.raises(slurm.SlurmError, match="did not answer within 2 s"):
                slurm.call(args, timeout_s=2, retries=0)
    finally:
        slurm.drop_prefetched()
    assert time.monotonic() - began < 4.5  # 3 x 2 s read one after another; each waited from its own start


def test_a_prefetched_answer_that_came_while_the_submit_was_busy_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """Review: with the timeout counted from the start, an answer read after it had passed was thrown away
    (communicate(timeout=0) raises even for a process that exited), and so was one waiting in a full pipe (a month
    of sacct is over 64 KiB): the user read 'did not answer' and got the defaults. A second at least to read it."""
    from hpc_train import slurm

    fake_sacct(tmp_path, monkeypatch, "head -c 200000 /dev/zero | tr '\\0' x")
    asked = history.accounting_args("low", 1, 30, time.time())
    slurm.prefetch(asked)
    try:
        time.sleep(2.5)  # the submit scanning the project's journals meanwhile
        assert len(slurm.call(asked, timeout_s=2, retries=0)) == 200_000
    finally:
        slurm.drop_prefetched()


def fake_sacct(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str) -> Path:
    """An sacct that runs `body` first on PATH, with no SLURM_CONF (conftest.fake_clients: a slurmdbd refusing, slow
    or silent, as the real cluster's, shared by every test of a worker, is not made to be); its state folder."""
    from conftest import fake_clients

    bin_dir, state = fake_clients(tmp_path, {"sacct": body})
    monkeypatch.setenv("PATH", f"{bin_dir}:{Path(sys.executable).parent}:/usr/bin:/bin")
    monkeypatch.delenv("SLURM_CONF", raising=False)
    return state
