"""The attempt lifecycle's pure decisions, driven by seeded random sequences: what must always hold, not
only the cases we thought of. Each test prints its seed on failure (pytest shows the parameter)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from conftest import names

from hpc_train import deadlines, journal, preempt, requeue
from hpc_train.checkpoint_files import retention_plan, shares
from hpc_train.config import CheckpointConfig, RequeueConfig
from hpc_train.slurm import parse_fate

# `scontrol show job -o` of one job, captured on the dev cluster (Slurm 22.05), fields cut to the ones read.
RUNNING = "JobId=135 JobName=wrap JobState=RUNNING Reason=None Requeue=1 Restarts=0 BatchFlag=1 ExitCode=0:0"
REQUEUED = "JobId=135 JobName=wrap JobState=PENDING Reason=BeginTime Requeue=1 Restarts=1 BatchFlag=1 ExitCode=0:0"
CANCELLED = "JobId=135 JobName=wrap JobState=CANCELLED Reason=None Requeue=1 Restarts=1 BatchFlag=1 ExitCode=0:15"


def test_job_fate_from_scontrol_captures() -> None:
    assert parse_fate(RUNNING, restart_count=0) == "running"  # time-limit warning or preemption grace
    assert parse_fate(REQUEUED, restart_count=0) == "requeued"  # scontrol requeue / node failure: Slurm did it
    assert parse_fate(CANCELLED, restart_count=1) == "cancelled"
    assert parse_fate(RUNNING.replace("RUNNING", "COMPLETING"), restart_count=0) == "cancelled"
    # the time limit struck during the stop save: COMPLETING too, but nobody cancelled (Slurm can requeue it)
    assert (
        parse_fate(RUNNING.replace("RUNNING", "COMPLETING").replace("Reason=None", "Reason=TimeLimit"), 0) == "running"
    )
    gone = "slurm_load_jobs error: Invalid job id specified"  # scontrol's answer once the job left its memory
    assert parse_fate(gone, restart_count=0) == "unknown"


# A --no-kill job (hot spares) whose batch host, node1, was set DOWN on the dev cluster: Slurm took node1 out and
# ended the job without a requeue (FAILED, COMPLETING while its tasks die); without --no-kill it would requeue it.
BATCH_HOST_LOST = (
    "JobId=8 JobName=losebatch-1.b JobState=FAILED Reason=JobLaunchFailure Requeue=1 Restarts=0 BatchFlag=1 "
    "ExitCode=0:9 NodeList=node[2-3] BatchHost=node1 NumNodes=2"
)


def test_a_job_that_lost_its_batch_host_is_requeued_by_us() -> None:
    assert parse_fate(BATCH_HOST_LOST, restart_count=0) == "batch_host_lost"
    assert parse_fate(BATCH_HOST_LOST.replace("FAILED", "COMPLETING"), restart_count=0) == "batch_host_lost"
    # its batch host kept (another node was lost): running as before; Slurm's own requeue first
    kept = BATCH_HOST_LOST.replace("NodeList=node[2-3]", "NodeList=node[1,3]")
    assert parse_fate(kept.replace("FAILED", "COMPLETING"), 0) == "cancelled"
    assert parse_fate(RUNNING + " NodeList=node[1,3] BatchHost=node1", 0) == "running"
    # Slurm takes the node out of NodeList before it ends the job: a fate read in those ms (review: a requeue without
    # ExcNodeList followed, Slurm started the job on the node again, "Duplicate jobid", drained, the job held)
    assert parse_fate(RUNNING + " NodeList=node[2-3] BatchHost=node1", 0) == "batch_host_lost"
    assert parse_fate(BATCH_HOST_LOST.replace("Restarts=0", "Restarts=1"), 0) == "requeued"
    assert parse_fate(REQUEUED + " NodeList=(null) BatchHost=node1", 0) == "requeued"
    assert parse_fate(RUNNING + " NodeList=(null) BatchHost=node1", 0) == "running"
    # a cancel or a time limit whose batch host finished completing before the others: not lost (review)
    assert parse_fate(BATCH_HOST_LOST.replace("FAILED", "COMPLETING").replace("JobLaunchFailure", "None"), 0) == (
        "cancelled"
    )
    assert parse_fate(BATCH_HOST_LOST.replace("JobLaunchFailure", "TimeLimit"), 0) == "running"
    assert parse_fate(BATCH_HOST_LOST.replace("FAILED", "CANCELLED"), 0) == "cancelled"
    b = RequeueConfig(max_failures=2)
    assert preempt.decide("failure", [], b, "batch_host_lost") == ("requeue", "")  # as a failure, in its budget
    assert preempt.decide("failure", [{"event": "requeue", "reason": "failure"}] * 2, b, "batch_host_lost")[0] == "stop"


def test_stop_reason_and_time_to_kill() -> None:
    # 120 s lead: a USR2 in the last 120 + 120 s of slack before Slurm's EndTime is the time-limit warning
    assert preempt.stop_reason(["SIGUSR2"], 200, 120) == "time_limit"
    assert preempt.stop_reason(["SIGUSR2"], 3000, 120) == "preempt"  # preempt_send_user_signal, chaos
    assert preempt.stop_reason(["SIGUSR2"], 30, 120, preempted=True) == "preempt"  # PreemptTime set
    assert preempt.stop_reason(["SIGUSR2", "SIGTERM"], 200, 120) == "preempt"
    # after a USR2 preemption Slurm kills after GraceTime, not signal_lead_s
    assert preempt.seconds_to_kill("preempt", 120, 30) == 30
    assert preempt.seconds_to_kill("time_limit", 120, 30) == 120


def ev(name: str, step: int = 0, **f: object) -> dict:
    return {"event": name, "step": step, **f}


def test_decide_cases() -> None:
    b = RequeueConfig(max_preemptions=-1, max_time_limit_requeues=2, max_failures=2)
    assert preempt.decide("preempt", [], b, "cancelled")[0] == "stop"
    action, why = preempt.decide("failure", [], b, "requeued")
    assert action == "slurm" and names(why, "Slurm requeued the job itself", "no budget spent")
    assert preempt.decide("preempt", [ev("requeue", reason="preempt")] * 500, b, "running") == ("requeue", "")
    assert preempt.decide("preempt", [], b, "unknown") == ("requeue", "")  # scontrol silent: keep the run alive
    tl = [ev("requeue", reason="time_limit")] * 2
    action, why = preempt.decide("time_limit", tl, b, "running")
    assert action == "stop" and names(why, "time_limit budget spent", "2 requeues", "requeue.max_time_limit_requeues=2")
    # Requeues Slurm did by itself (an operator's, a node failure) cost nothing
    assert (
        preempt.decide("time_limit", [ev("requeue", reason="time_limit", by="slurm")] * 5, b, "running")[0] == "requeue"
    )


def test_failure_budget_counts_failures_in_a_row_not_a_lifetime() -> None:
    """Three node faults a month apart, each after progress, no longer stop a run; a crash loop does."""
    b = RequeueConfig(max_failures=2)
    fault = ev("requeue", reason="failure", by="hpc_train")
    spaced = [
        ev("checkpoint_committed", 100),
        fault,
        ev("checkpoint_committed", 200),
        fault,
        ev("checkpoint_committed", 300),
        fault,
        ev("checkpoint_committed", 400),
    ]
    assert journal.failures_in_a_row(spaced) == 0 and preempt.decide("failure", spaced, b, "running")[0] == "requeue"
    loop = [
        ev("checkpoint_committed", 100),
        fault,
        ev("checkpoint_committed", 100),
        fault,
    ]  # same step again: no progress
    assert journal.failures_in_a_row(loop) == 2
    action, why = preempt.decide("failure", loop, b, "running")
    assert action == "stop" and names(
        why, "failure budget spent", "2 failure requeues in a row", "requeue.max_failures=2"
    )


def test_a_scripts_newer_checkpoint_file_is_progress() -> None:
    """A script without script_helper.committed(): its checkpoint file's mtime, newer than any before, is
    progress (script.py's script_checkpoint event); the same file again is not. Before: ignored."""
    b = RequeueConfig(max_failures=1)
    fault = ev("requeue", reason="failure", by="hpc_train")
    saved = lambda mtime: ev(journal.SCRIPT_CHECKPOINT, 0, path="ckpt.pt", mtime=mtime)  # noqa: E731
    spaced = [saved(100.0), fault, saved(200.0), fault, saved(300.0)]
    assert journal.failures_in_a_row(spaced) == 0 and preempt.decide("failure", spaced, b, "running")[0] == "requeue"
    loop = [saved(100.0), fault, saved(100.0), fault]  # a file no newer: no progress
    assert journal.failures_in_a_row(loop) == 2 and preempt.decide("failure", loop, b, "running")[0] == "stop"


@pytest.mark.parametrize("seed", range(20))
def test_decide_random_histories(seed: int) -> None:
    """Random event logs, random budgets and fates: the invariants of the one requeue decision."""
    rng = random.Random(seed)
    budgets = RequeueConfig(
        max_preemptions=rng.choice([-1, 0, 1, 3]),
        max_time_limit_requeues=rng.choice([0, 1, 3]),
        max_failures=rng.choice([0, 1, 2, 5]),
    )
    events: list[dict] = []
    step = 0
    for _ in range(rng.randint(0, 60)):
        kind = rng.choice(["commit", "requeue", "requeue_slurm", "requeue_inside_job", "signal", "cancel"])
        if kind == "commit":
            step += rng.choice([0, 10, 20])
            events.append(ev("checkpoint_committed", step))
        elif kind.startswith("requeue"):
            events.append(
                ev(
                    "requeue",
                    reason=rng.choice(list(journal.BUDGET_KEYS)),
                    by={"requeue_slurm": "slurm", "requeue_inside_job": "inside_job"}.get(kind, "hpc_train"),
                )
            )
        else:
            events.append(ev(kind))
    for reason in journal.BUDGET_KEYS:
        for fate in ("running", "requeued", "cancelled", "unknown", "batch_host_lost"):
            action, why = preempt.decide(reason, events, budgets, fate)
            limit = getattr(budgets, journal.BUDGET_KEYS[reason])
            if fate == "cancelled":
                assert action == "stop" and why.startswith("cancelled")
            elif fate == "requeued" and reason != "time_limit":
                assert action == "slurm"  # never a second requeue, never budget
            elif fate == "requeued":  # requeued from inside the job at the time-limit warning: its budget counts
                used = journal.requeues_counted(events, reason)
                assert action == ("stop" if limit != -1 and used >= limit else "slurm"), (used, limit, action)
                assert (why == preempt.REQUEUED_INSIDE) == (action == "slurm")
            elif limit == -1:
                assert action == "requeue"
            else:
                used = (
                    journal.failures_in_a_row(events)
                    if reason == "failure"
                    else journal.requeues_counted(events, reason)
                )
                assert (action == "stop") == (used >= limit) and (action == "stop") == (why != "")
        # Requeueing again and again for one reason stops after exactly `limit` more requeues (no progress between)
        limit = getattr(budgets, journal.BUDGET_KEYS[reason])
        if limit != -1:
            log, more = list(events), 0
            while preempt.decide(reason, log, budgets, "running")[0] == "requeue":
                log.append(ev("requeue", reason=reason, by="hpc_train"))
                more += 1
            used = (
                journal.failures_in_a_row(events) if reason == "failure" else journal.requeues_counted(events, reason)
            )
            assert more == max(0, limit - used)
            if reason == "time_limit":  # a script that requeues itself at every warning is bounded alike
                log, more = list(events), 0
                while preempt.decide(reason, log, budgets, "requeued")[0] == "slurm":
                    log.append(ev("requeue", reason=reason, by="inside_job"))
                    more += 1
                assert more == max(0, limit - used)
    last = max((e.get("restart", 0) for e in events if e["event"] == "requeue"), default=0)
    assert journal.local_fate(events + [ev("cancel", restart=last)]) == "cancelled"
    # a cancel that raced its own attempt's requeue still counts; a later attempt's requeue supersedes it
    assert journal.local_fate(events + [ev("cancel", restart=last + 1), ev("requeue", restart=last + 1)]) == "cancelled"
    assert journal.local_fate(events + [ev("cancel", restart=last + 1), ev("requeue", restart=last + 2)]) == "running"


def random_folders(rng: random.Random, n: int) -> dict[int, str | None]:
    steps = rng.sample(range(1, 2_000_000, 7), n)
    return {s: rng.choice(["periodic", "periodic", "periodic", "stop", "final", "", None]) for s in steps}


@pytest.mark.parametrize("seed", range(50))
def test_retention_plan_invariants(seed: int) -> None:
    rng = random.Random(seed)
    folders = random_folders(rng, rng.randint(0, 30))
    committed = [s for s, r in folders.items() if r]
    verified = set(rng.sample(committed, rng.randint(0, min(3, len(committed)))))
    bad = set(
        rng.sample(sorted(set(committed) - verified), rng.randint(0, max(0, len(committed) - len(verified)) // 2))
    )
    keep = set(rng.sample(sorted(folders), rng.randint(0, min(2, len(folders)))))
    cfg = CheckpointConfig(keep_last=rng.randint(1, 4), keep_every_steps=rng.choice([0, 7, 70]))
    doomed = retention_plan(folders, cfg, verified, bad, keep)
    assert doomed <= set(folders) and not doomed & keep
    # A folder without COMMITTED that no write of this attempt holds is garbage wherever it is: a stop save
    # torn by a full disk above the anchor held its space for good, and the next preflight refused.
    torn = {s for s, r in folders.items() if r == "" and s not in keep}
    assert torn <= doomed
    if not verified:
        assert doomed == torn  # no checkpoint known good in this attempt: no committed one may go
        return
    anchor = max(verified)
    assert all(s < anchor for s in doomed - torn)  # a committed checkpoint goes only once a newer one is known good
    good_periodic = sorted(s for s, r in folders.items() if s <= anchor and r and r != "stop" and s not in bad)
    assert not doomed & set(good_periodic[-cfg.keep_last :])
    if cfg.keep_every_steps:
        assert not {s for s in doomed if s % cfg.keep_every_steps == 0 and s in good_periodic}
    torn_or_bad_below = {s for s, r in folders.items() if s < anchor and (not r or s in bad) and s not in keep}
    assert torn_or_bad_below <= doomed  # junk below the anchor never piles up


@pytest.mark.parametrize("seed", range(30))
def test_checkpoint_folder_storm_model(seed: int) -> None:
    """A model of the checkpoint folder through a random storm: commits and stop saves (retention by the
    real plan after each), torn saves, and between attempts a flipped byte or a garbled COMMITTED in the
    newest folder. Resume is modelled as Saver.resume does it. What must hold: every deletion has a newer
    checkpoint known good at that moment, and every attempt resumes from the newest good folder on disk."""
    rng = random.Random(seed)
    cfg = CheckpointConfig(keep_last=rng.randint(1, 3), keep_every_steps=rng.choice([0, 50]))
    folders: dict[int, str | None] = {}
    corrupt: set[int] = set()
    verified: set[int] = set()
    bad: set[int] = set()
    step = 0
    for _ in range(200):
        what = rng.choice(["commit", "commit", "commit", "stop", "torn", "corrupt", "garble", "restart"])
        if what in ("commit", "stop"):
            step += rng.randint(1, 30)
            folders[step] = "periodic" if what == "commit" else "stop"  # a save replaces a torn folder
            corrupt.discard(step)
            verified.add(step)
            for s in retention_plan(folders, cfg, verified, bad, set()):
                if folders[s] != "":  # a committed one (torn folders are never a fallback)
                    assert any(v > s and v in folders and v not in corrupt for v in verified), (seed, s, verified)
                del folders[s]
            continue
        if what == "torn":
            folders.setdefault(step + rng.randint(1, 30), "")
            continue
        if what in ("corrupt", "garble") and folders:  # between attempts, on the newest folder
            newest = max(folders)
            corrupt.add(newest)
            if what == "garble" and folders[newest]:
                folders[newest] = None
        # a new attempt: every committed folder, newest first, until one verifies
        verified, bad = set(), set()
        for s in sorted((s for s, r in folders.items() if r != ""), reverse=True):
            if s in corrupt or folders[s] is None:
                bad.add(s)
            else:
                verified.add(s)
                break
        good = [s for s, r in folders.items() if r and s not in corrupt]
        assert max(verified, default=None) == max(good, default=None)  # the newest good one, never an older
        step = max(verified, default=0)


def test_verification_shares_cover_every_file_once_and_balance() -> None:
    sizes = {
        ".metadata": 25_000,
        **{f"__{r}_0.distcp": 500_000_000 + r for r in range(8)},
        **{f"rank_{r:05d}.pt": 6_654 for r in range(8)},
    }
    split = shares(sizes, 4)
    assert sorted(n for part in split for n in part) == sorted(sizes)
    loads = [sum(sizes[n] for n in part) for part in split]
    assert max(loads) - min(loads) <= 500_000_000 * 0.01  # two shards each, within 1%
    assert shares(sizes, 1) == [sorted(sizes, key=lambda n: (-sizes[n], n))]


@pytest.mark.parametrize("seed", range(50))
def test_a_live_lease_owner_is_never_displaced(seed: int) -> None:
    """One owner renews its lease every LEASE_RENEW_S (+ up to 5 s of watchdog polling) until it dies at a
    random time; challengers ask at random times, with Slurm saying "active" or nothing while it lives and
    "gone" or nothing after. While it lives no challenger may take the run; once it is gone every one may,
    at once when Slurm says so, else within two renewal periods of its last renewal. A live owner Slurm
    names is not displaced even when its lease expired (suspended, or its renewals failing on a full disk).
    The owner itself (a requeued attempt, same job id) always may."""
    rng = random.Random(seed)
    died_at = rng.uniform(0, 600)
    renewals = [0.0]
    while renewals[-1] + preempt.LEASE_RENEW_S < died_at:
        renewals.append(renewals[-1] + preempt.LEASE_RENEW_S + rng.uniform(0, 5))
    for _ in range(200):
        now = rng.uniform(0, 900)
        last = max(r for r in renewals if r <= now) if now >= 0 else 0.0
        lease = {"job_id": "100", "renewed_at": last, "expires_at": last + preempt.LEASE_S}
        alive = now < died_at
        says = rng.choice([True, None]) if alive else rng.choice([False, None])
        may = preempt.lease_verdict(lease, "200", now, says)
        assert preempt.lease_verdict(lease, "100", now, says), "the owner's own next attempt"
        if alive:
            assert not may, f"seed {seed}: displaced a live owner at {now:.0f} s (renewed {last:.0f}, Slurm {says})"
        elif says is False or now >= last + 2 * preempt.LEASE_RENEW_S:
            assert may, f"seed {seed}: a gone owner still holds the run at {now:.0f} s (renewed {last:.0f})"
    stale = {"job_id": "100", "renewed_at": 0.0, "expires_at": preempt.LEASE_S}
    assert not preempt.lease_verdict(stale, "200", 10 * preempt.LEASE_S, True), "an expired lease of a live owner"
    assert preempt.lease_verdict(stale, "200", 10 * preempt.LEASE_S, None) and preempt.lease_verdict(None, "2", 0, None)


def test_a_job_starts_within_the_bound_while_another_process_holds_the_run_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A holder of the run's lock that died on NFSv3 keeps it until its node reboots. run_job reads the
    attempt number under it before the hang watchdog runs: it must go on without the lock after
    deadlines.RUN_LOCK_WAIT_S, with one warning line, not block every rank until the time limit."""
    import fcntl
    import os
    import signal
    import time

    from hpc_train import env as rank_env
    from hpc_train import job
    from hpc_train.paths import RunPaths

    class Reached(Exception):
        pass

    def reached(environ: object) -> None:
        raise Reached

    monkeypatch.setattr(deadlines, "RUN_LOCK_WAIT_S", 0.5, raising=False)
    monkeypatch.setattr(rank_env, "from_env", reached)  # the step right after the read: stop there
    journal.log(tmp_path, journal.START, 0, "1", 0)
    holder = os.fork()
    if holder == 0:  # the child holds the lock for 20 s
        fd = os.open(RunPaths(tmp_path).lock, os.O_RDWR | os.O_CREAT)
        fcntl.flock(fd, fcntl.LOCK_EX)
        (tmp_path / "held").touch()
        time.sleep(20)
        os._exit(0)
    handlers = {s: signal.getsignal(s) for s in preempt.STOP_SIGNALS}  # run_job installs its own
    try:
        while not (tmp_path / "held").exists():
            time.sleep(0.01)
        t0 = time.monotonic()
        with pytest.raises(Reached):
            job.run_job(str(tmp_path))
        took = time.monotonic() - t0
        assert os.waitpid(holder, os.WNOHANG) == (0, 0)  # the holder still holds it
        assert 0.5 <= took < 5, took
        warnings = [r for r in caplog.records if r.levelname == "WARNING" and "lock" in r.getMessage()]
        assert len(warnings) == 1 and "RUN_LOCK_WAIT_S" not in warnings[0].getMessage(), warnings
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
        os.kill(holder, 9)
        os.waitpid(holder, 0)


def test_the_stop_paths_requeue_outlives_a_second_sigterm(tmp_path, monkeypatch) -> None:
    """Issue 18, defect 1: after the stop save rank 0 asks the job's fate and requeues it while Slurm may
    TERM every process of the job again (the time limit itself, the requeue's own TERM). A client killed
    by it (rc -15) made the fate "unknown" and the requeue fail: `requeue_failed`, and a TIMEOUT job is
    never requeued. Here each scontrol call TERMs itself first; the whole decision stays inside the reserve."""
    import time
    from pathlib import Path
    from types import SimpleNamespace

    from conftest import fake_clients, read_events

    from hpc_train.config import compose, to_run_config
    from hpc_train.paths import RunPaths

    bin_dir, _ = fake_clients(
        tmp_path,
        {
            "scontrol": 'kill -TERM $$\n[ "$1" = show ] && echo "JobId=7 JobState=RUNNING Reason=None Restarts=0"\nexit 0'
        },
    )
    monkeypatch.setenv("PATH", f"{bin_dir}:{Path('/usr/bin')}:{Path('/bin')}")
    monkeypatch.delenv("SLURM_CONF", raising=False)
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    env = SimpleNamespace(executor="slurm", job_id="7", restart_count=0, nodes=("node1",))
    cfg = to_run_config(compose(["cluster=dev"]))
    t0 = time.monotonic()
    assert requeue.requeue_or_stop(RunPaths(tmp_path), env, cfg, "time_limit", 12, signals=["SIGUSR2"]) == "requeue"
    assert time.monotonic() - t0 < deadlines.decision_reserve_s(env, cfg)
    decided = [e for e in read_events(tmp_path) if e["event"] in ("requeue", "requeue_failed", "stopped")]
    assert [(e["event"], e["by"], e["fate"]) for e in decided] == [("requeue", "hpc_train", "running")]


def test_the_requeue_reserve_is_the_stop_paths_worst_case() -> None:
    """The reserve adds up what the stop path's Slurm calls may take (every try timing out, 1 s backoff)
    and stays well inside the default signal_lead_s=120; the failure path's policies alone were 66 s."""
    from types import SimpleNamespace

    from hpc_train import slurm
    from hpc_train.config import compose, to_run_config
    from hpc_train.sbatch import ClusterConfig

    assert slurm.worst_s(*slurm.FATE) + slurm.worst_s(*slurm.REQUEUE) == 66.0
    assert deadlines.REQUEUE_RESERVE_S == 10.0 + 21.0 + 4.0 and deadlines.ELASTIC_RESERVE_S == 15.0
    on_slurm = SimpleNamespace(executor="slurm")
    assert deadlines.decision_reserve_s(on_slurm, to_run_config(compose(["cluster=dev"]))) == 35.0
    elastic = to_run_config(compose(["cluster=dev", "cluster.nodes=4", "cluster.min_nodes=2"]))
    assert deadlines.decision_reserve_s(on_slurm, elastic) == 50.0 < ClusterConfig().signal_lead_s / 2
    assert deadlines.decision_reserve_s(SimpleNamespace(executor="local"), elastic) == 4.0


def test_a_term_during_a_refused_requeue_makes_it_a_wait_for_slurms(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review: the decision's facts held a copy of the signals received, so a preemption's TERM during the failure
    path's `scontrol requeue` (which retries for up to 33 s) was not seen: a refused requeue stopped the rank inside
    the grace time, and Slurm never requeued the job. The facts read the Pulse's own list."""
    from types import SimpleNamespace

    from hpc_train import decision, requeue, slurm
    from hpc_train.config import RunConfig
    from hpc_train.paths import RunPaths

    received: list[str] = []

    def refused(job_id: str, policy: object) -> str:
        received.append("SIGTERM")  # the preemption's TERM, recorded by the handler while scontrol retried
        return "Job is being requeued, can not requeue"

    monkeypatch.setattr(slurm, "requeue", refused)
    env = SimpleNamespace(executor="slurm", job_id="7", restart_count=0, nodes=("n1",))
    cfg, record = RunConfig(), lambda *a, **k: None
    facts = decision.Facts("failure", False, [], "", cfg.requeue, None, None, received)
    chosen = decision.decide(facts, cfg)
    assert chosen.action == decision.Action.REQUEUE
    assert requeue.apply(RunPaths(tmp_path), env, cfg, facts, chosen, record) == "wait"
    received.clear()
    copied = decision.Facts("failure", False, [], "", cfg.requeue, None, None, list(received))
    assert requeue.apply(RunPaths(tmp_path), env, cfg, copied, chosen, record) == "stop"
    assert (
        requeue.gather(
            RunPaths(tmp_path), SimpleNamespace(executor="local", job_id="7"), RunConfig(), "failure", None, received
        ).signals
        is received
    )


def test_a_job_that_starts_after_its_run_stopped_for_good_leaves_and_cancels_itself(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review: a stop for good whose job was requeued meanwhile (a script's own scontrol requeue that the stop's
    scancel lost to, Slurm's requeue at a preemption's end, a pipeline's cancel that failed) trained again at the
    next start, the stop on record. It leaves at once, its job cancelled; after `hpc-train resume` it trains."""
    from types import SimpleNamespace

    from hpc_train import job, journal, slurm
    from hpc_train.paths import RunPaths

    cancelled: list[list[str]] = []
    monkeypatch.setattr(slurm, "scancel", lambda ids, *a, **k: cancelled.append(list(ids)))
    env = SimpleNamespace(executor="slurm", job_id="7", restart_count=1, rank=0, local_rank=1, nodes=("n1",))
    journal.log(tmp_path, journal.STOPPED, 5, "7", 1, reason="a peer of this attempt failed first")
    monkeypatch.setattr(job.preempt, "injected", lambda name: name == "raise_at_start")
    with pytest.raises(RuntimeError, match="raise_at_start"):  # this attempt's own stop: its failure path's
        job._before_rendezvous(RunPaths(tmp_path), env, None)
    monkeypatch.setattr(job.preempt, "injected", lambda name: False)
    assert not cancelled
    journal.log(tmp_path, journal.STOPPED, 5, "7", 0, reason="time_limit budget spent")
    env.restart_count = 2
    with pytest.raises(SystemExit) as left:
        job._before_rendezvous(RunPaths(tmp_path), env, None)
    assert left.value.code == 1 and cancelled == [["7"]]
    journal.log(tmp_path, journal.RESUME, -1, "8", 1)
    monkeypatch.setattr(job.preempt, "injected", lambda name: name == "raise_at_start")  # past the guard: trains
    with pytest.raises(RuntimeError, match="raise_at_start"):
        job._before_rendezvous(RunPaths(tmp_path), env, None)
