"""Hot spares (cluster.spare_nodes): a failure relaunches the training step inside the allocation instead of
requeueing. The pure decision over seeded fault sequences, the attempt count, the config's sentences; then
on the dev cluster a killed rank and a sick node recovered inside one allocation, bit-exact."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import HPC_TRAIN, RUN_ARGS, names, read_events, run, said, submit, wait_finished, wait_until

from hpc_train import (
    deadlines,
    decision,
    failure,
    journal,
    preempt,
    rejoin,
    rendezvous,
    requeue,
    sbatch,
    slurm,
    watchdog,
)
from hpc_train.config import compose, to_run_config
from hpc_train.env import from_env
from hpc_train.task import Pulse, Task

REASONS = ("failure", "node_health", "preempt", "time_limit")
FATES = ("running", "unknown", "requeued", "cancelled", "batch_host_lost")


def ev(name: str, restart: int = 0, step: int = 0, **f: object) -> dict:
    return {"time": 1.0, "event": name, "step": step, "restart": restart, "job_id": "7", **f}


def inside_decision(
    cfg: object,
    nodes: list[str],
    left_out: list[str] = (),  # type: ignore[assignment]
    sick: dict[str, str] | None = None,
    record: object = None,
    apply: bool = True,
) -> decision.Decision:
    """The deciding rank's decision for a failure of a hot-spares job on `nodes` (its allocation, RUNNING), `left_out`
    of them left out by earlier in-job restarts, as requeue.gather would make it from this process's environment
    (SUBMITIT_FOLDER, SLURM_JOB_ID, HPC_TRAIN_STEP_ARGS, the relay's beat); a RELAUNCH is applied (the marker written,
    its records through `record`). No Slurm call: EndTime is unknown (the time limit from HPC_TRAIN_ALLOCATED_AT)."""
    env = SimpleNamespace(executor="slurm", job_id="7", restart_count=0, nodes=tuple(nodes))
    events = [
        {
            "time": time.time(),
            "event": journal.NODE_EXCLUDED,
            "step": 1,
            "job_id": "7",
            "restart": 0,
            "node": n,
            "why": "-",
        }
        for n in left_out
    ]
    saved, slurm.end_time = slurm.end_time, lambda job_id, timeout_s=3: (None, False)
    try:
        os.environ["SLURM_JOB_NODELIST"] = ",".join(nodes)
        facts = decision.Facts(
            "failure",
            False,
            events,
            "running",
            cfg.requeue,  # type: ignore[attr-defined]
            slurm.Allocation("RUNNING", list(nodes), nodes[0]),
            sick,
            [],
            job_id="7",
            nodes=tuple(nodes),
            inside=requeue._inside_facts(env, cfg),
            now=time.time(),
        )
    finally:
        slurm.end_time = saved
        del os.environ["SLURM_JOB_NODELIST"]
    d = decision.decide(facts, cfg)
    if apply and d.action == decision.Action.RELAUNCH:
        noop = lambda *a, **k: None  # noqa: E731
        assert requeue.apply(None, env, cfg, facts, d, record or noop) == "relaunch"  # type: ignore[arg-type]
    return d


@pytest.mark.parametrize("seed", range(40))
def test_a_relaunch_only_replaces_a_failure_requeue_within_budget_and_spares(seed: int) -> None:
    """A seeded run of faults, commits and stop signals through the one decision: an in-job restart never
    follows a stop signal, a requeue `decide` did not choose, or a run without spares; never more than
    requeue.max_in_job_restarts in a row without a newer checkpoint; never onto fewer healthy nodes than
    cluster.min_nodes (None: cluster.nodes), never on more than cluster.nodes, never on a left-out node.
    Without a spare left (and min_nodes reached) it requeues as before, and the requeue's new allocation has
    all its spares again. min_nodes=None decides as cluster.nodes did before min_nodes counted here."""
    rng = random.Random(seed)
    nodes, spares, budget = rng.randint(1, 4), rng.randint(0, 2), rng.randint(0, 3)
    min_nodes = rng.choice([None, rng.randint(1, nodes)])
    floor = min_nodes or nodes
    new_allocation = lambda: [f"n{rng.randint(0, 99)}-{i}" for i in range(nodes + spares)]  # noqa: E731
    job_nodes, left_out, events, step, attempt = new_allocation(), [], [], 0, 0
    relaunched = 0
    for _ in range(60):
        what = rng.random()
        if what < 0.3:
            step += rng.randint(1, 5)
            events.append(ev(journal.CHECKPOINT_COMMITTED, attempt, step))
            continue
        reason, fate = rng.choice(REASONS), rng.choice(FATES)
        signals = rng.choice([[], [], ["SIGUSR2"], ["SIGTERM"]])
        action = rng.choice(["requeue", "requeue", "stop", "slurm"])
        if rng.random() < 0.5:  # a fault a relaunch may replace: else 1 in 25 is, and 40 seeds never shrank
            reason, fate, signals, action = rng.choice(["failure", "node_health"]), "running", [], "requeue"
        blamed = rng.sample(sorted(set(job_nodes) - set(left_out)), k=min(1, len(set(job_nodes) - set(left_out))))
        out = sorted({*left_out, *blamed}) if rng.random() < 0.7 else left_out
        used = journal.in_job_restarts_in_a_row(events)
        # seconds to EndTime; the slowest start-up so far; cluster.signal_lead_s
        left_s, startup_s, lead_s = rng.uniform(0, 900), rng.uniform(0, 300), rng.choice([60, 120, 300])
        facts = (spares, action, reason, fate, signals, used, budget, job_nodes, out, nodes, left_s, startup_s, lead_s)
        n, why = preempt.in_job_restart(preempt.RestartFacts(*facts, min_nodes=min_nodes))
        fixed_n, fixed_why = preempt.in_job_restart(preempt.RestartFacts(*facts))  # min_nodes=None: the fixed size
        healthy = len(set(job_nodes) - set(out))
        replaces = spares and action == "requeue" and reason in ("failure", "node_health") and not signals
        # within budget, and time to train before the time-limit warning (issue 20)
        may = replaces and fate in ("running", "unknown") and used < budget and left_s >= startup_s + lead_s
        assert (why == "") is bool(may and healthy >= floor), why
        # without min_nodes: cluster.nodes or a requeue, as before min_nodes counted here
        assert (fixed_n, fixed_why == "") == ((nodes, True) if may and healthy >= nodes else (0, False)), fixed_why
        if min_nodes == nodes:  # the same decision; its sentence names cluster.min_nodes
            assert (n, why == "") == (fixed_n, fixed_why == "")
        if why == "":
            assert floor <= n <= nodes and n == min(healthy, nodes)  # as many healthy nodes as it may use
            left_out, attempt, relaunched = out, attempt + 1, relaunched + 1
            events.append(ev(journal.IN_JOB_RESTART, attempt - 1, step, left_out=out))
            assert journal.in_job_restarts_in_a_row(events) <= budget
        else:
            assert n == 0
            if replaces:
                if fate in ("running", "unknown") and used < budget and healthy < floor:
                    assert why.startswith("no spare left")
                elif fate in ("running", "unknown") and used < budget:
                    assert left_s < startup_s + lead_s and "s left before the time limit" in why
            if action == "requeue" or action == "slurm":  # a new allocation: all its spares again
                job_nodes, left_out, attempt = new_allocation(), [], attempt + 1
                events.append(ev(journal.REQUEUE, attempt - 1, step, reason=reason))
    assert journal.in_job_restarts_in_a_row(events) <= budget
    assert len(journal.in_job_restarts(events)) == relaunched


def test_the_reasons_it_requeues_instead() -> None:
    nodes = ["node1", "node2", "node3"]
    args = dict(fate="running", signals=[], used=0, budget=3, job_nodes=nodes, nodes=2)

    def relaunch(**kw: object) -> str:
        given = {"spare_nodes": 1, "action": "requeue", "reason": "failure", "left_out": ["node2"], **args, **kw}
        n, why = preempt.in_job_restart(preempt.RestartFacts(**given))  # type: ignore[arg-type]
        assert (n == 0) is (why != ""), (n, why)
        return why

    assert relaunch() == "" and relaunch(reason="node_health") == ""
    assert relaunch(spare_nodes=0) == "no spares asked for"
    assert relaunch(reason="time_limit").startswith("a stop signal (time_limit")
    assert relaunch(signals=["SIGTERM"]).startswith("a stop signal (failure, ['SIGTERM'])")
    # the job's end TERMs the tasks too: the sentence names the lost batch host, not the signal
    lost = relaunch(fate="batch_host_lost", signals=["SIGTERM"])
    assert names(lost, "batch script's node was lost", "requeueing") and "SIGTERM" not in lost
    assert names(relaunch(used=3), "in-job restart budget spent", "3 in a row", "requeue.max_in_job_restarts=3")
    assert names(
        relaunch(left_out=["node1", "node2"]), "1 healthy nodes", "(node3; left out: node1, node2)", "cluster.nodes=2"
    )
    assert names(
        relaunch(left_s=150.0, startup_s=40.0, signal_lead_s=120),
        "150 s left",
        "160 s",
        "40 s",
        "cluster.signal_lead_s=120",
        "requeueing",
    )
    assert relaunch(left_s=160.0, startup_s=40.0, signal_lead_s=120) == ""
    # cluster.min_nodes: with no spare left it goes on with the healthy nodes, never more than cluster.nodes
    shrink = {**args, "spare_nodes": 1, "action": "requeue", "reason": "failure", "min_nodes": 1}
    for left_out, n in ((["node1", "node2"], 1), (["node2"], 2), ([], 2)):
        assert preempt.in_job_restart(preempt.RestartFacts(**{**shrink, "left_out": left_out})) == (n, "")  # type: ignore[arg-type]
    assert names(
        relaunch(left_out=["node1", "node2"], min_nodes=2),
        "1 healthy nodes",
        "(node3; left out: node1, node2)",
        "cluster.min_nodes=2",
    )
    assert names(
        relaunch(left_out=["node1", "node2", "node3"], min_nodes=1),
        "0 healthy nodes",
        "(none; left out: node1, node2, node3)",
        "cluster.min_nodes=1",
    )


def test_a_node_slurm_took_out_of_the_job_is_blamed() -> None:
    """requeue.lost_nodes: a --no-kill job's nodes at its start (SLURM_JOB_NODELIST) against what Slurm says it holds
    now, less those left out already; once the job ends only a missing batch host (COMPLETING lists the nodes still
    completing, which an idle spare leaves in ms: it was blamed too, review); nothing when Slurm did not answer."""
    running = slurm.Allocation("RUNNING", ["node1", "node3"], "node1", "None")
    lost = requeue.lost_nodes("node[1-3]", running)
    assert list(lost) == ["node2"] and names(lost["node2"], "node2 left", "node failure", "NodeList is now node1,node3")
    assert list(requeue.lost_nodes("node[1-4]", running._replace(nodes=["node3"]))) == ["node1", "node2", "node4"]
    assert requeue.lost_nodes("node[1-3]", running._replace(nodes=["node1", "node2", "node3"])) == {}
    assert (
        requeue.lost_nodes("node[1-3]", None) == {}
        and requeue.lost_nodes("node[1-3]", running._replace(nodes=[])) == {}
    )
    # left out already (a later failure of the same allocation): not blamed again, which stopped the storm's run
    assert list(requeue.lost_nodes("node[1-4]", running._replace(nodes=["node3"]), {"node2": "earlier"})) == [
        "node1",
        "node4",
    ]
    ended = slurm.Allocation("COMPLETING", ["node2"], "node1")  # the batch host lost, node3 done completing
    lost = requeue.lost_nodes("node[1-3]", ended, batch_host_lost=True)
    assert list(lost) == ["node1"] and names(lost["node1"], "node1, the batch script's node", "node failure")
    # a cancel or a time limit whose batch host finished completing first: not lost (review: fate first)
    assert requeue.lost_nodes("node[1-3]", ended) == {}
    assert requeue.lost_nodes("node[1-3]", ended._replace(nodes=["node1"]), batch_host_lost=True) == {}
    failed = ended._replace(state="FAILED")
    assert requeue.lost_nodes("node[1-3]", failed, batch_host_lost=True) == requeue.lost_nodes(
        "node[1-3]", ended, (), True
    )
    assert requeue.lost_nodes("node[1-3]", ended, {"node1": "earlier"}, batch_host_lost=True) == {}
    # one line of `scontrol show job -o`, as the dev cluster printed it after node2 went DOWN
    line = "JobId=6 JobName=lose-1.b JobState=RUNNING Reason=None NodeList=node[1,3] BatchHost=node1 NumNodes=2"
    assert slurm.parse_allocation(line) == running
    gone, pending = "slurm_load_jobs error: Invalid job id specified", "JobId=6 JobState=PENDING NodeList=(null)"
    assert slurm.parse_allocation(gone) is None
    assert slurm.parse_allocation(pending) == slurm.Allocation("PENDING", [], "")
    ended_line = "JobId=8 JobState=FAILED Reason=JobLaunchFailure NodeList=node[2-3] BatchHost=node1"
    assert slurm.parse_allocation(ended_line) == slurm.Allocation(
        "FAILED", ["node2", "node3"], "node1", "JobLaunchFailure"
    )
    assert slurm.batch_host_lost(slurm.parse_allocation(ended_line)) and not slurm.batch_host_lost(running)
    assert slurm.batch_host_lost(running._replace(nodes=["node2", "node3"]))  # RUNNING: taken out, ending in ms


def test_a_relaunch_needs_the_relay_alive(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """_relaunch writes no marker once the batch script's relay has not written its beat (FOLDER/.relay-JOBID) for
    RELAY_SILENT_S: its node is lost and nobody would read the marker (the step would end, and the job with it, at
    SlurmdTimeout, FAILED, without a requeue); the run requeues. A beat that is missing (a batch script from before
    it), a symlink or not a number is no evidence: the relaunch goes on, as before."""

    from hpc_train.relay import beat_at as relay_beat

    monkeypatch.setattr(deadlines, "RELAY_RECHECK_S", 0.2)
    folder = tmp_path / "submitit"
    folder.mkdir()
    monkeypatch.setenv("SUBMITIT_FOLDER", str(folder))
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("HPC_TRAIN_STEP_ARGS", "--nodes=2 --ntasks=2")
    cfg = to_run_config(
        compose(["cluster=dev", "cluster.tasks_per_node=1", "cluster.nodes=2", "cluster.spare_nodes=1"])
    )
    recorded: list[dict] = []
    record = lambda name, **f: recorded.append({"event": name, **f})  # noqa: E731
    nodes, beat, marker = ["node1", "node2", "node3"], folder / ".relay-7", folder / ".relaunch-7"

    def relaunched() -> bool:
        marker.unlink(missing_ok=True)
        return inside_decision(cfg, nodes, ["node2"], record=record).action == decision.Action.RELAUNCH

    assert relay_beat(folder, "7") is None and relaunched() and marker.exists()  # no beat: as before
    beat.write_text(f"{time.time() - 10:.0f}\n")
    assert relaunched() and marker.exists()
    beat.write_text(f"{time.time() - deadlines.RELAY_SILENT_S - 5:.0f}\n")
    assert not relaunched() and not marker.exists() and len(recorded) == 2  # nothing recorded: the requeue decides
    for junk in ("garbage", "0\n"):  # 0: a bash without EPOCHSECONDS (4.4, RHEL 8), before printf's %(%s)T
        beat.write_text(junk)
        assert relay_beat(folder, "7") is None and relaunched()
    # old by this node's clock but written again within RELAY_RECHECK_S: a live relay on a node whose clock is behind
    monkeypatch.setattr(deadlines, "RELAY_RECHECK_S", 2.0)  # 40 x the Timer's 0.05 s: a loaded machine starts it late
    beat.write_text(f"{time.time() - 300:.0f}\n")
    threading.Timer(0.05, lambda: beat.write_text(f"{time.time() - 295:.0f}\n")).start()
    assert relaunched() and marker.exists()
    beat.unlink()
    old = tmp_path / "old"
    old.write_text("1")
    beat.symlink_to(old)  # a teammate's planted name: not the relay's word
    assert relay_beat(folder, "7") is None and relaunched()


def test_the_watchdog_requeues_when_the_batch_host_died_under_a_blocked_collective(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node that crashes sends no reset: the survivors' collective blocks, and when Slurm takes the batch host out
    (SlurmdTimeout) it ends the --no-kill job with no requeue and TERMs them, then SIGKILLs them after KillWait. The
    watchdog thread asks (watchdog.batch_host_lost): only at a SIGTERM, only with the relay silent past RELAY_SILENT_S
    (a preemption TERMs every rank: no Slurm call from each; a beat that looks old is read again RELAY_RECHECK_S
    later), and then believes Slurm's fate (a fake scontrol: a real one cannot be made to show a crashed batch host in
    a test's time)."""
    from conftest import fake_clients

    folder = tmp_path / "submitit"
    folder.mkdir()
    line = "JobId=7 JobState={state} Reason=JobLaunchFailure Restarts=0 NodeList=node[2-3] BatchHost={host}"
    bin_dir, state = fake_clients(tmp_path, {"scontrol": 'echo called >> "$STATE/calls"; cat "$STATE/show"'})
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    for key, value in {"SUBMITIT_FOLDER": str(folder), "SLURM_JOB_ID": "7", "HPC_TRAIN_STEP_ARGS": "--nodes=2"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    env = SimpleNamespace(executor="slurm", job_id="7")
    beat = folder / ".relay-7"
    monkeypatch.setattr(deadlines, "RELAY_RECHECK_S", 0.05)

    def asks(beat_age_s: float | None, show: str) -> tuple[bool, int]:
        (state / "show").write_text(show + "\n")
        (state / "calls").write_text("")
        if beat_age_s is None:
            beat.unlink(missing_ok=True)
        else:
            beat.write_text(f"{time.time() - beat_age_s:.0f}\n")
        lost = watchdog.batch_host_lost(env)
        return lost, len((state / "calls").read_text().splitlines())

    lost_host = line.format(state="COMPLETING", host="node1")
    assert asks(300, lost_host) == ("lost", 1)
    assert asks(300, line.format(state="COMPLETING", host="node2")) == ("alive", 1)  # its host still completing
    assert asks(300, lost_host.replace("JobLaunchFailure", "None")) == ("alive", 1)  # a cancel: its host done first
    assert asks(5, lost_host) == ("", 0)  # the relay lives: no Slurm call, asked again at the next poll
    assert asks(None, lost_host) == ("", 0)  # no beat (an older batch script): as before
    monkeypatch.delenv("HPC_TRAIN_STEP_ARGS")  # no spares
    assert asks(300, lost_host) == ("alive", 0)
    # the watchdog asks only while the loop has not beaten since the TERM: a loop saving for the stop beat first
    pulse = Pulse(["SIGUSR2", "SIGTERM"], [100.0, 200.0], last_beat=150.0)
    assert watchdog.blocked_at_term(pulse)
    pulse.last_beat = 201.0
    assert not watchdog.blocked_at_term(pulse)
    assert not watchdog.blocked_at_term(Pulse(["SIGUSR2"], [100.0], last_beat=150.0))


def test_the_start_up_an_in_job_restart_expects_is_the_slowest_measured() -> None:
    """journal.startup_s: launch -> first step of each attempt that reached one (a relaunch's own included)."""
    events = [
        {**ev("start", 0), "time": 20.0, "launched_at": 10.0},
        {**ev(journal.FIRST_STEP, 0), "time": 25.0},
        {**ev("start", 1), "time": 150.0, "launched_at": 100.0},
        {**ev(journal.FIRST_STEP, 1), "time": 160.0},
        {**ev("start", 2), "time": 300.0, "launched_at": 200.0},  # failed before its first step: no measure
    ]
    assert journal.startup_s(events) == 60.0 and journal.startup_s(events[:2]) == 15.0
    assert journal.startup_s([]) == 0.0


@pytest.mark.parametrize("seed", range(40))
def test_an_in_job_exclusion_counts_the_allocation_a_requeue_the_partition(seed: int) -> None:
    """Issue 20: on a partition of exactly nodes + spare_nodes nodes a blamed node was never left out inside the
    allocation, because the check counted the partition's nodes beyond the job's (none). Seeded partitions, often
    exactly that size; earlier exclusions in and out of this allocation. Inside it, a sick node is left out iff
    the budget allows and cluster.nodes healthy nodes of the allocation remain; for a requeue iff the partition
    keeps the job's nodes + spares besides every left-out node."""
    rng = random.Random(seed)
    nodes, spares = rng.randint(1, 4), rng.randint(1, 2)
    partition = [f"node{i}" for i in range(nodes + spares + rng.choice([0, 0, 1, 3]))]
    job_nodes = sorted(rng.sample(partition, nodes + spares))
    keep = rng.choice(job_nodes)  # at least one node of the allocation is newly sick
    before = rng.sample(
        [n for n in partition if n != keep], min(len(partition) - 1, rng.randint(0, 2))
    )  # an earlier ExcNodeList, or in-job
    events = [ev(journal.NODE_EXCLUDED, node=n, why="earlier") for n in before]
    fresh = [n for n in job_nodes if n not in before]
    sick = {n: "Xid 79" for n in rng.sample(fresh, min(len(fresh), rng.randint(1, 2)))}
    budget = rng.randint(1, 5)
    after, fits = {*before, *sick}, len({*before, *sick}) <= budget
    inside, not_in, stop_in = preempt.exclusion(events, sick, budget, len(job_nodes) - nodes, allocation=job_nodes)
    room = len(partition) - (nodes + spares)  # requeue.spare_nodes: usable nodes beyond nodes + spare_nodes
    outside, not_out, stop_out = preempt.exclusion(events, sick, budget, room)
    assert not stop_in and not stop_out
    assert (inside == sorted(after)) is (fits and len(set(job_nodes) - after) >= nodes) is (not not_in)
    assert (outside == sorted(after)) is (fits and len(after) <= room) is (not not_out)
    if not_in and fits:
        assert "the allocation holds" in not_in
    if len(partition) == nodes + spares and fits and len(set(job_nodes) - after) >= nodes:
        assert inside == sorted(after) and "the partition has 0 usable nodes" in not_out


@pytest.mark.parametrize("seed", range(60))
def test_a_requeue_leaves_out_only_what_the_partition_can_spare_the_newest_blames_first(seed: int) -> None:
    """Review of issue 20: an in-job restart counts its allocation only, so the run's exclusions grew past what
    the partition can spare, and a later requeue's ExcNodeList (all of them) left the job pending for good.
    Seeded partitions, blames (oldest first; a node blamed again is the newest) and needs: the job keeps room
    for `need` usable nodes when the partition has them, lets in the fewest, the longest ago blamed first, and
    keeps out what is unusable anyway; the journal then counts the let-in nodes as no longer left out."""
    rng = random.Random(seed)
    nodes = [f"n{i}" for i in range(rng.randint(2, 8))]
    states = {n: rng.choice(["idle", "idle", "mix", "alloc", "drain", "down*", "idle*"]) for n in nodes}
    exclude = rng.sample(nodes, rng.randint(0, 1))
    need = rng.randint(1, len(nodes))
    blames = [rng.choice(nodes) for _ in range(rng.randint(0, 6))]
    events = [ev(journal.NODE_EXCLUDED, node=n, why=f"blame {i}") for i, n in enumerate(blames)]
    order = list(journal.excluded_nodes(events))
    assert order == [n for i, n in enumerate(blames) if n not in blames[i + 1 :]]  # by the latest blame
    kept, let_in = preempt.fit_exclusions(order, states, need, exclude)
    usable = preempt.usable_nodes(states) - set(exclude)
    assert sorted(kept + let_in) == sorted(order) and not set(kept) & set(let_in)
    assert set(let_in) <= usable  # an unusable node costs nothing: it stays out
    if len(usable) >= need:
        assert len(usable - set(kept)) >= need  # the requeued job fits
        if let_in:  # no fewer would do: one more left out would not fit
            assert len(usable - set(kept)) == need
    else:
        assert not set(kept) & usable  # it cannot fit: nothing usable is held back from it
    rank = {n: i for i, n in enumerate(order)}
    assert all(rank[a] < rank[b] for a in let_in for b in kept if b in usable)  # the longest ago blamed go first
    after = [*events, ev(journal.EXCLUDE_NODES, nodes=",".join(kept), ok=True, let_in=let_in)]
    assert list(journal.excluded_nodes(after)) == [n for n in order if n in kept]
    for n in let_in:
        assert journal.exclusion_took(after, n) == (False, 0)  # blamed again: a new exclusion, not "took"


@pytest.mark.parametrize("seed", range(20))
def test_a_requeue_never_leaves_out_a_node_cluster_nodelist_requires(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review of the fix above: with cluster.nodelist (--nodelist, nodes the job must have) a required node in
    ExcNodeList kept the job pending for good whatever the partition's room. Seeded: the required ones are let
    in and said, the rest judged by the partition's room as before."""
    from types import SimpleNamespace

    rng = random.Random(seed)
    nodes = [f"n{i}" for i in range(rng.randint(2, 8))]
    states = {n: rng.choice(["idle", "mix", "alloc", "drain"]) for n in nodes}
    monkeypatch.setattr(slurm, "node_states", lambda partition, policy: states)
    required = rng.sample(nodes, rng.randint(0, len(nodes)))
    blamed = rng.sample(nodes, rng.randint(1, len(nodes)))
    cluster = SimpleNamespace(
        nodes=1, spare_nodes=0, min_nodes=None, partition="p", exclude=None, nodelist=",".join(required) or None
    )
    kept, let_in, why = requeue.fit_exclusions(cluster, blamed)
    assert not set(kept) & set(required) and set(blamed) & set(required) <= set(let_in)
    assert sorted(kept + let_in) == sorted(blamed)
    assert ("cluster.nodelist requires them" in why) == bool(set(blamed) & set(required))
    rest = [n for n in blamed if n not in required]
    assert sorted(kept) == preempt.fit_exclusions(rest, states, 1, [])[0]  # the rest as the partition allows


def test_an_in_job_restart_is_a_new_attempt_of_the_same_job() -> None:
    """SLURM_RESTART_COUNT does not move at an in-job restart: the attempt counts this job's relaunches."""
    # the ranks that did not decide log their `fail` after the verdict: the verdict still ends the attempt
    events = [ev("start", 0), ev("fail", 0), ev(journal.IN_JOB_RESTART, 0, left_out=["node2"], spares_left=0)]
    events.append(ev("fail", 0))
    assert journal.new_job_attempt(events, 0, "7") == 1
    assert journal.new_job_attempt(events, 0, "8") == 0  # another job's (a resumed run's old job id)
    assert journal.new_job_attempt([*events, ev("start", 1), ev("requeue", 1)], 1, "7") == 2  # then requeued
    assert journal.decided(events, 0) and not journal.decided(events, 1)  # the others' wait ends
    assert journal.spares_left(events, 1) == 0 and journal.spares_left([*events, ev("requeue", 1)], 1) == 1
    att = journal.attempts(events)[0]
    assert (att["ended_by"], att["left_out"], att["spares_left"]) == (journal.IN_JOB_RESTART, ["node2"], 0)
    # the budget counts in a row without a newer checkpoint, and a resume clears it
    assert journal.in_job_restarts_in_a_row([*events, *events[1:]]) == 2
    assert journal.in_job_restarts_in_a_row([*events, ev(journal.CHECKPOINT_COMMITTED, 1, 5), *events[1:]]) == 1
    assert journal.in_job_restarts_in_a_row([*events, ev("resume", 1)]) == 0


def test_a_stop_is_judged_by_when_its_signal_came_not_when_a_relaunched_step_reads_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Review of issue 20: a USR2 held by the relay while the failed step ended was judged as if it came when
    the relaunched step first checked: one that came 800 s before the end (a preemption's USR2, far from the
    time limit's 2-minute lead) was judged a time limit once the relaunch had brought the end near."""
    from types import SimpleNamespace

    cluster = SimpleNamespace(signal_lead_s=120, preempt_grace_s=60, timeout_min=60)
    for ago, end_in, reason, left in ((600.0, 200.0, 2.0, 60 - 600), (10.0, 200.0, 1.0, 120 - 10)):
        pulse = Pulse(received=["SIGUSR2"], received_at=[time.monotonic() - ago])
        got_left, got_reason = preempt.time_left(pulse, cluster, time.time() + end_in, False, 0.0, 0.0)
        assert got_reason == reason and abs(got_left - min(left, end_in)) < 2, (ago, got_left, got_reason)


def test_a_step_on_fewer_nodes_than_the_job_has_places_by_the_steps_nodes() -> None:
    env = {
        "SLURM_PROCID": "3",
        "SLURM_LOCALID": "1",
        "SLURM_NTASKS": "4",
        "SLURM_NTASKS_PER_NODE": "2",
        "SLURM_NODEID": "1",
        "SLURM_JOB_NODELIST": "node[1-3]",  # the allocation, a spare included
        "SLURM_STEP_NODELIST": "node[1,3]",  # the step, node2 left out
        "SLURM_JOB_ID": "7",
    }
    got = from_env(env)
    assert got.nodes == ("node1", "node3") and got.num_nodes == 2 and got.world_size == 4


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["cluster=dev", "cluster.spare_nodes=-1"], r"cluster.spare_nodes=-1 must be >= 0 \(0: no hot spares\)"),
        (["cluster=local", "cluster.spare_nodes=1"], r"cluster.spare_nodes=1 but the local executor runs on this"),
        (["requeue.max_in_job_restarts=-1"], r"requeue budgets must be >= 0"),
        (
            ["cluster=dev", "cluster.in_process_restart=true"],
            r"cluster.in_process_restart=true needs a warm standby on a spare node; set cluster.spare_nodes=1",
        ),
        (
            ["cluster=dev", "cluster.spare_nodes=1", "cluster.in_process_restart=true", "script.cmd=[echo]"],
            r"a command after -- \(script.cmd\) runs in processes of its own; set cluster.in_process_restart=false",
        ),
        (
            [
                "cluster=dev",
                "cluster.spare_nodes=1",
                "cluster.in_process_restart=true",
                "+cluster.sbatch_extra.distribution=cyclic",
            ],
            r"cluster.sbatch_extra.distribution='cyclic' puts the step's tasks on its nodes in another order.*"
            r"drop it, keep its node part block \(e.g. block:cyclic\), or set cluster.in_process_restart=false",
        ),
    ],
)
def test_spare_config_errors(overrides: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        to_run_config(compose(overrides))


def test_spares_with_min_nodes_keep_a_fixed_allocation_of_nodes_plus_spares() -> None:
    """cluster.min_nodes with hot spares (refused before): the batch script is the spares job's own, byte for
    byte (--nodes=3, no --nodes=1-2 range, no --mincpus), and a requeue is not elastic: no queue snapshot,
    no NumNodes update, so Slurm requeues the job as it was queued, nodes + spare_nodes."""
    from types import SimpleNamespace

    import hpc_train
    from hpc_train.sbatch import render

    cfg = to_run_config(compose(["cluster=dev", "cluster.spare_nodes=1", "cluster.min_nodes=1"]))
    script = render(cfg.cluster, "golden-1", Path("/runs/golden-1/submitit"))
    script = script.replace(sys.executable, "/venv/bin/python")  # as tests/test_sbatch.py renders its goldens
    script = script.replace(str(Path(hpc_train.__file__).resolve().parent), "/venv/hpc_train")
    assert script == (Path(__file__).parent / "golden" / "dev_spares.sbatch").read_text()
    assert "#SBATCH --nodes=3\n" in script
    env = SimpleNamespace(executor="slurm", job_id="7", nodes=("node1", "node2", "node3"))
    assert not requeue.elastic(env, cfg) and requeue.snapshot(env, cfg, False) is None  # no call: slurm is not asked
    facts = decision.Facts("failure", False, [], "running", cfg.requeue, None, None, [], job_id="7", nodes=env.nodes)
    assert decision.next_size(facts, cfg, []) == ({}, {})  # requeued as it was queued: nodes + spare_nodes
    assert deadlines.decision_reserve_s(env, cfg) == deadlines.REQUEUE_RESERVE_S  # nor reserved for


def test_in_process_restart_runs_the_step_on_the_spares_whose_tasks_stand_by(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """cluster.in_process_restart: the step spans nodes + spares (rendered, and again at a relaunch), its first
    cluster.nodes nodes train and the tasks beyond are standbys; a step gone on smaller has none; without the
    option, or srun by hand (no HPC_TRAIN_STEP_ARGS), nothing changes."""

    from hpc_train.sbatch import executor_parameters

    overrides = ["cluster=dev", "cluster.spare_nodes=1", "cluster.tasks_per_node=2", "cluster.in_process_restart=true"]
    cfg = to_run_config(compose(overrides))
    to_run_config(compose([*overrides, "+cluster.sbatch_extra.distribution=block:cyclic"]))  # nodes still in block

    def step_args(setup: list[str]) -> list[str]:  # what the batch script exports for the relay, one line
        return [line.split("=", 1)[1] for line in setup if line.startswith("export HPC_TRAIN_STEP_ARGS=")]

    assert step_args(executor_parameters(cfg.cluster, "x")["setup"]) == ["'--nodes=3 --ntasks=6'"]
    off = to_run_config(compose(overrides[:-1]))
    assert step_args(executor_parameters(off.cluster, "x")["setup"]) == ["'--nodes=2 --ntasks=4'"]

    def task(procid: int, nodes: str = "node[1-3]") -> dict[str, str]:
        n = len(nodes.split(",")) if "[" not in nodes else 3
        return {
            "SLURM_PROCID": str(procid),
            "SLURM_LOCALID": str(procid % 2),
            "SLURM_NTASKS": str(2 * n),
            "SLURM_NTASKS_PER_NODE": "2",
            "SLURM_NODEID": str(procid // 2),
            "SLURM_JOB_NODELIST": "node[1-3]",
            "SLURM_STEP_NODELIST": nodes,
            "SLURM_JOB_ID": "7",
        }

    monkeypatch.setenv("HPC_TRAIN_STEP_ARGS", "--nodes=3 --ntasks=6")
    split = [rejoin.split_standby(from_env(task(r)), cfg) for r in range(6)]
    assert [standby for _, standby in split] == [False] * 4 + [True] * 2
    assert {(e.world_size, e.nodes) for e, _ in split} == {(4, ("node1", "node2"))}
    smaller = rejoin.split_standby(from_env(task(1, "node1")), cfg)[0]
    assert smaller == from_env(task(1, "node1"))  # no spare left: every task trains
    assert rejoin.split_standby(from_env(task(5)), off) == (from_env(task(5)), False)
    # a relaunch (the in-process path could not take it) starts the standbys on the spares left again
    monkeypatch.setenv("SUBMITIT_FOLDER", str(tmp_path))
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    marker, nodes = tmp_path / ".relaunch-7", ["node1", "node2", "node3"]
    rejoining = inside_decision(cfg, nodes)
    assert rejoining.action == decision.Action.REJOIN and rejoining.fallback is not None
    relaunch_decision = rejoining.fallback  # the plan could not be made (requeue.apply): relaunched
    assert (
        relaunch_decision.action == decision.Action.RELAUNCH and relaunch_decision.srun_args == "--nodes=3 --ntasks=6"
    )
    assert inside_decision(off, nodes, apply=False).srun_args == "--nodes=2 --ntasks=4"  # without: the spare waits
    assert inside_decision(cfg, nodes, ["node2"]).fallback.srun_args == "--nodes=2 --ntasks=4 --exclude=node2"  # type: ignore[union-attr]
    assert not marker.exists()  # a rejoin decision writes no marker until its plan fails
    monkeypatch.delenv("HPC_TRAIN_STEP_ARGS")  # srun by hand: no standby
    assert rejoin.split_standby(from_env(task(5)), cfg) == (from_env(task(5)), False)


def test_the_rejoin_plan_replaces_only_whole_dead_nodes_by_standbys(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """rejoin.plan_rejoin: a rank is alive once it wrote its heartbeat count, dead once its life lock is free (or after
    REJOIN_SETTLE_S); each dead node needs all its ranks dead and a standby node; else (a node blamed that is not
    dead whole, no first step in this attempt) the step is relaunched, saying why."""
    from types import SimpleNamespace

    from hpc_train.paths import RunPaths, hold_for_life

    monkeypatch.setattr(deadlines, "REJOIN_SETTLE_S", 0.2)
    trained = [ev(journal.FIRST_STEP, 0)]

    def plan(world: int, per: int, wrote: list[int], held: list[int], standbys: dict[str, str], **kw: object):
        run = tmp_path / f"run{len(list(tmp_path.iterdir()))}"
        paths, nodes = RunPaths(run), tuple(f"node{i + 1}" for i in range(world // per))
        for folder in (paths.alive("7", 0), paths.run_dir / ".hang-7-0", paths.standbys("7")):
            folder.mkdir(parents=True)
        fds = [hold_for_life(paths.alive("7", 0) / str(r)) for r in held]  # a second open file: a live holder
        for r in range(world):
            (paths.alive("7", 0) / str(r)).touch()
        for r in wrote:
            (paths.run_dir / ".hang-7-0" / str(r)).write_text("5")
        for task, node in standbys.items():
            (paths.standbys("7") / task).write_text(node)
        stale = kw.get("stale", [])  # died waiting, or an earlier allocation's: their life locks free
        fds += [hold_for_life(paths.standbys("7") / task) for task in standbys if task not in stale]  # type: ignore[operator]
        env = SimpleNamespace(job_id="7", restart_count=0, world_size=world, local_world_size=per, nodes=nodes, rank=0)
        recorded: list[dict] = []
        args = (kw.get("events", trained), kw.get("sick", {}), 0, "failure")
        hang = bool(kw.get("hang"))
        ok = rejoin.plan_rejoin(paths, env, *args, lambda name, **f: recorded.append({"event": name, **f}), hang)
        for fd in fds:
            os.close(fd)  # type: ignore[arg-type]
        return ok, rejoin.read_rejoin_plan(paths, "7") if ok else None, recorded

    monkeypatch.setattr(deadlines, "REJOIN_SETTLE_S", 5.0)
    t0 = time.monotonic()
    ok, got, recorded = plan(2, 1, [0], [], {"2": "node3"})  # rank 1's lock free: dead at once, not after 5 s
    assert time.monotonic() - t0 < 1.0
    monkeypatch.setattr(deadlines, "REJOIN_SETTLE_S", 0.2)
    assert ok and (got["nodes"], got["survivors"], got["standby"], got["attempt"]) == (
        ["node1", "node3"],
        [0],
        {"2": 1},
        1,
    )
    assert recorded[0]["in_process"] and recorded[0]["replaced"] == {"node2": "node3"}
    assert recorded[0]["spares_left"] == 0 and recorded[0]["in_job_restarts"] == 1
    ok, got, _ = plan(2, 1, [0], [1], {"2": "node3"})  # rank 1 silent but holding its lock: dead after the wait
    assert ok and got["survivors"] == [0]
    ok, got, _ = plan(2, 1, [0, 1], [], {"2": "node3"})  # an exception, no death: everyone rejoins, no standby
    assert ok and got["standby"] == {} and got["nodes"] == ["node1", "node2"]
    ok, got, _ = plan(4, 2, [0, 1, 2], [], {"4": "node3", "5": "node3"})  # rank 3 dead, rank 2 beside it alive
    assert not ok and "ranks on node2 survived beside the dead" in said(caplog)
    ok, got, _ = plan(4, 2, [0, 1], [], {"4": "node3", "5": "node3"})  # node2 lost whole: its 2 ranks by the 2 standbys
    assert ok and got["standby"] == {"4": 2, "5": 3} and got["nodes"] == ["node1", "node3"]
    ok, _, _ = plan(2, 1, [0], [], {})
    assert not ok and names(said(caplog), "1 node(s) lost", "0 warm standby")
    ok, _, _ = plan(2, 1, [0], [], {"2": "node3"}, stale=["2"])
    assert not ok and names(said(caplog), "1 node(s) lost", "0 warm standby")
    ok, got, _ = plan(2, 1, [0], [], {"2": "node3", "3": "node4"}, stale=["2"])  # the live one is taken
    assert ok and got["standby"] == {"3": 1} and got["nodes"] == ["node1", "node4"]
    ok, _, _ = plan(2, 1, [0], [], {"2": "node3"}, events=[])
    assert not ok and "failed before its first step" in said(caplog)
    ok, _, _ = plan(2, 1, [0], [], {"2": "node3"}, sick={"node1": "Xid 79"})  # blamed, its rank alive
    assert not ok and "a node was blamed (node1)" in said(caplog)
    # blamed and dead whole (a node failure Slurm took out of the job, requeue.lost_nodes): replaced, and left out
    ok, got, recorded = plan(2, 1, [0], [], {"2": "node3"}, sick={"node2": "node2 left the job's allocation"})
    assert ok and got["nodes"] == ["node1", "node3"] and recorded[-1]["left_out"] == ["node2"]
    assert recorded[0] == {"event": journal.NODE_EXCLUDED, "node": "node2", "why": "node2 left the job's allocation"}
    ok, got, _ = plan(2, 1, [1], [0], {"2": "node3"})  # the deciding rank 0's own heartbeat write failed: it lives
    assert ok and got["survivors"] == [0, 1] and got["standby"] == {}
    # every rank hung level (no node blamed): the watchdog's rank leaves its process, so nobody may rejoin
    ok, _, _ = plan(2, 1, [0, 1], [], {"2": "node3"}, hang=True)
    assert not ok and "a hang (train.watchdog_s)" in said(caplog)


def test_a_standby_leaves_once_its_step_has_no_training_rank_or_a_stop_signal_came(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """_step_left: with no verdict on record, a standby still leaves once every training rank of the step's current
    attempt is gone (their life locks free), or srun forwarded a stop signal; not while one holds its lock, nor
    before the ranks are placed (no lock files). A config failure's stop is on record (journal.step_over)."""
    from types import SimpleNamespace

    from hpc_train.paths import RunPaths, hold_for_life

    paths = RunPaths(tmp_path)
    env = SimpleNamespace(job_id="7", restart_count=0, world_size=2, rank=0)
    pulse = Pulse()
    assert rejoin.step_left(paths, env, None, pulse) == ""  # not placed yet: no lock files
    paths.alive("7", 0).mkdir()
    fd = hold_for_life(paths.alive("7", 0) / "0")
    (paths.alive("7", 0) / "1").touch()  # rank 1 died
    assert rejoin.step_left(paths, env, None, pulse) == ""  # rank 0 lives
    os.close(fd)  # type: ignore[arg-type]
    assert names(rejoin.step_left(paths, env, None, pulse), "all 2 training ranks", "attempt 0")
    plan = {"attempt": 1, "world_size": 2, "standby": {}}  # rejoined without this standby: attempt 1's ranks count
    paths.alive("7", 1).mkdir()
    fd = hold_for_life(paths.alive("7", 1) / "1")
    assert rejoin.step_left(paths, env, plan, pulse) == ""
    assert rejoin.step_left(paths, env, plan, Pulse(received=["SIGTERM"])) == "SIGTERM received"
    os.close(fd)  # type: ignore[arg-type]

    def leave(code: int) -> None:
        raise SystemExit(code)

    monkeypatch.setattr(os, "_exit", leave)
    monkeypatch.setenv("SLURM_PROCID", "2")
    with pytest.raises(SystemExit):  # the wait itself leaves (exit 0), its registration removed
        rejoin.standby_wait(paths, env, pulse)
    assert not list(paths.standbys("7").iterdir())
    assert names(said(caplog), "standby leaves", "all 2 training ranks", "attempt 0")
    (tmp_path / "no-config").mkdir()
    failing = Task(Pulse(step_reached=3))
    assert failure.after_failure(RunPaths(tmp_path / "no-config"), env, failing) == ("stop", 0.0)  # no config.yaml
    (stopped,) = journal.named(journal.read(tmp_path / "no-config"), journal.STOPPED)
    assert stopped["step"] == 3  # the step the failing rank reached
    assert names(stopped["reason"], "frozen config", "FileNotFoundError", f"hpc-train resume {tmp_path / 'no-config'}")
    assert journal.step_over([stopped], 0)


def test_after_a_rejoin_every_rank_counts_heartbeats_from_the_same_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """_rejoin: a survivor's heartbeat count restarts as a standby's does (the standby's watchdog beats once, before
    its _rejoin), so a later hang's blame (preempt.hung_ranks) compares this attempt's steps only: a survivor's
    5000 beats of the failed attempt against a standby's 12 blamed the standby."""
    from hpc_train.paths import RunPaths

    def task(procid: int) -> dict[str, str]:
        return {
            "SLURM_PROCID": str(procid),
            "SLURM_LOCALID": "0",
            "SLURM_NTASKS": "3",
            "SLURM_NTASKS_PER_NODE": "1",
            "SLURM_NODEID": str(procid),
            "SLURM_JOB_NODELIST": "node[1-3]",
            "SLURM_STEP_NODELIST": "node[1-3]",
            "SLURM_JOB_ID": "7",
        }

    plan = {"from": 0, "attempt": 1, "world_size": 2, "nodes": ["node1", "node3"], "master_port": 29000}
    plan |= {"survivors": [0], "standby": {"2": 1}, "at": time.time()}
    monkeypatch.setattr(rendezvous, "join", lambda env, cfg, paths, task, keep_order: env)
    monkeypatch.setenv("HPC_TRAIN_ATTEMPT", "0")
    counts = {}
    for procid, beats, standby in ((0, 5000, False), (2, 0, True)):
        rank_task = Task(Pulse(ticks=beats))
        monkeypatch.setenv("SLURM_PROCID", str(procid))
        if standby:
            rank_task.pulse.beat()  # the standby's _start_watchdog, just before its _rejoin
        placed = rejoin.join(RunPaths(tmp_path), None, plan, from_env(task(procid)), rank_task, standby=standby)[0]
        counts[placed.rank] = rank_task.pulse.ticks
    assert counts == {0: 1, 1: 1} and preempt.hung_ranks({0: counts[0] + 7, 1: counts[1] + 7}, 2) == []


def test_a_plan_without_its_verdict_on_record_is_not_joined(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The deciding rank writes the plan, then records the in-process `in_job_restart`; dead between the two, no rank
    may rejoin by the plan alone: a survivor leaves after its verdict wait, a standby once no training rank is left.
    With the verdict on record both rejoin."""
    from types import SimpleNamespace

    from hpc_train.paths import RunPaths

    paths = RunPaths(tmp_path)
    env = SimpleNamespace(job_id="7", restart_count=0, world_size=2, rank=1, executor="slurm")
    plan = {"from": 0, "attempt": 1, "world_size": 2, "nodes": ["node1", "node3"], "master_port": 29000}
    paths.rejoin_plan("7").write_text(json.dumps(plan | {"survivors": [1], "standby": {"2": 0}, "at": 1.0}))
    paths.failure_claim("7", 0).touch()  # rank 0 claimed the decision
    paths.alive("7", 0).mkdir()
    for r in range(2):
        (paths.alive("7", 0) / str(r)).touch()  # their locks free: both training ranks gone

    def leave(code: int) -> None:
        raise SystemExit(code)

    monkeypatch.setattr(deadlines, "VERDICT_WAIT_S", 0.2)
    monkeypatch.setattr(os, "_exit", leave)
    monkeypatch.setenv("SLURM_PROCID", "2")
    assert failure.after_failure(paths, env, Task()) == ("", 0.0)
    with pytest.raises(SystemExit):
        rejoin.standby_wait(paths, env, Pulse())
    journal.log(paths.run_dir, journal.IN_JOB_RESTART, 5, "7", 0, in_process=True, replaced={"node2": "node3"})
    assert failure.after_failure(paths, env, Task()) == ("rejoin", 0.0)
    assert rejoin.standby_wait(paths, env, Pulse())["standby"] == {"2": 0}


def test_a_rejoin_plan_another_user_could_have_written_is_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """read_rejoin_plan: a plan names the hosts every rank joins (whose bytes the new group unpickles): one in a
    folder others can write, or a symlink, is not read, and the refusal names the fix; a torn one is none."""
    from hpc_train.paths import RunPaths

    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    paths = RunPaths(run)
    assert rejoin.read_rejoin_plan(paths, "7") is None  # none yet
    paths.rejoin_plan("7").write_text('{"from": 0, "attempt": 1}\n')
    assert rejoin.read_rejoin_plan(paths, "7") == {"from": 0, "attempt": 1}
    run.chmod(0o770)
    assert rejoin.read_rejoin_plan(paths, "7") is None
    assert names(said(caplog), f"not rejoining by {paths.rejoin_plan('7')}", f"{run} is writable by group")
    run.chmod(0o700)
    (tmp_path / "planted").write_text('{"from": 0, "attempt": 1}\n')
    paths.rejoin_plan("7").unlink()
    paths.rejoin_plan("7").symlink_to(tmp_path / "planted")
    assert rejoin.read_rejoin_plan(paths, "7") is None
    assert "is a symlink; remove it" in said(caplog)
    paths.rejoin_plan("7").unlink()
    for text in ('{"from": 0, "attempt": 1', '{"from": 0, "attempt": "1"}', "[1]"):  # torn, not a plan
        paths.rejoin_plan("7").write_text(text)
        assert rejoin.read_rejoin_plan(paths, "7") is None, text


KEEP_SCRIPT = """
import os, socket, sys, time
from pathlib import Path
from types import SimpleNamespace
import torch, torch.distributed as dist
from hpc_train import rejoin
from hpc_train.task import Pulse, Task
from hpc_train.env import from_env
from hpc_train.paths import RunPaths

run, port = Path(sys.argv[1]), int(sys.argv[2])
nodes, switch = ["localhost", "nodeC", "nodeB"], {"localhost": "s2", "nodeC": "s1", "nodeB": "s2"}
plan = {"from": 0, "attempt": 1, "world_size": 3, "nodes": nodes, "master_port": port, "survivors": [0, 1, 2]}
plan |= {"standby": {}, "at": time.time()}
train = SimpleNamespace(rendezvous_timeout_s=60, tp=1, watchdog_s=60)
cfg = SimpleNamespace(train=train, script=SimpleNamespace(cmd=[]), cluster=SimpleNamespace(in_process_restart=False))
kids = []
for r in range(3):
    pid = os.fork()
    if pid == 0:
        os.environ |= {"SLURMD_NODENAME": nodes[r], "SLURM_TOPOLOGY_ADDR": f"{switch[nodes[r]]}.{nodes[r]}"}
        task = {"SLURM_PROCID": str(r), "SLURM_LOCALID": "0", "SLURM_NTASKS": "3", "SLURM_NTASKS_PER_NODE": "1"}
        task |= {"SLURM_NODEID": str(r), "SLURM_JOB_NODELIST": "n[1-3]", "SLURM_JOB_ID": "7"}
        placed = rejoin.join(RunPaths(run), cfg, plan, from_env(task), Task())[0]
        dist.barrier()
        print(f"rank {r} -> {placed.rank}", flush=True)
        os._exit(0)
    kids.append(pid)
for pid in kids:
    os.waitpid(pid, 0)
"""


def test_a_rejoin_keeps_the_plans_ranks_though_the_switches_would_order_them_otherwise(tmp_path: Path) -> None:
    """3 processes rejoin a plan whose node order the topology planner would change (localhost and nodeB on switch
    s2, nodeC on s1: re-planned [localhost, nodeB, nodeC]): each keeps the plan's rank, so a survivor's state and
    memory copies stay its own (they swapped ranks 1 and 2 before)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = subprocess.run(
        [sys.executable, "-c", KEEP_SCRIPT, str(tmp_path), str(port)], capture_output=True, text=True, timeout=120
    )
    assert sorted(re.findall(r"rank \d -> \d", done.stdout)) == ["rank 0 -> 0", "rank 1 -> 1", "rank 2 -> 2"], done
    assert [r["node"] for r in json.loads((tmp_path / "placement.json").read_text())["ranks"]] == [
        "localhost",
        "nodeC",
        "nodeB",
    ]


CUT_SCRIPT = """
import os, sys, time
from types import SimpleNamespace
import torch, torch.distributed as dist
from hpc_train import rejoin

def rank_main(rank, store, cut):
    dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=3)
    t = torch.zeros(1)
    dist.barrier()
    if rank == 2:  # dies
        time.sleep(0.5)
        os._exit(9)
    if rank == 1:  # fails on the dead rank, then drops its group, cut or not; lives on
        try:
            dist.recv(t, src=2)
        except RuntimeError:
            pass
        held = dist.group.WORLD  # as the trainer's traceback holds it (frames -> model -> DDP -> group)
        if cut:
            rejoin.drop_group(SimpleNamespace(nodes=("localhost",), master_addr="127.0.0.1"))
        else:
            dist.destroy_process_group()
        time.sleep(8)
        os._exit(0 if held else 1)
    t0 = time.time()  # rank 0: blocked on rank 1, alive
    try:
        dist.recv(t, src=1)
    except RuntimeError:
        pass
    print(f"blocked for {time.time() - t0:.1f} s", flush=True)
    os._exit(0)

store, cut = sys.argv[1], sys.argv[2] == "cut"
kids = []
for r in range(3):
    pid = os.fork()
    if pid == 0:
        rank_main(r, store, cut)
    kids.append(pid)
os.waitpid(kids[0], 0)
for pid in kids[1:]:
    os.kill(pid, 9)
"""


def test_a_failing_rank_cuts_its_connections_so_a_peer_blocked_on_it_fails_too(tmp_path: Path) -> None:
    """3 gloo processes: rank 2 dies, rank 1 fails on it and drops its group (rejoin.drop_group) but lives on; rank 0,
    blocked in a recv from rank 1, fails at once. destroy_process_group closes gloo's sockets only with the group's
    last reference, which a failing trainer's traceback still holds: rank 0 then stays blocked until rank 1 exits
    (after 8 s here)."""
    out = {}
    for how in ("cut", "destroy"):
        done = subprocess.run(
            [sys.executable, "-c", CUT_SCRIPT, str(tmp_path / f"store-{how}"), how],
            capture_output=True,
            text=True,
            timeout=120,
        )
        out[how] = float(done.stdout.split("blocked for ")[1].split()[0])
    assert out["cut"] < 3.0 and out["destroy"] > 5.0, out


def test_a_failing_rank_says_it_lives_before_its_group_is_torn_down(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """rejoin.drop_group(env, paths): the heartbeat count (the deciding rank's sign of a survivor, rejoin.plan_rejoin) is written
    before destroy_process_group, whose teardown can outlast REJOIN_SETTLE_S (2 s): a live survivor taken for dead
    relaunched the step. Here the teardown only notes whether the count was already there."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from hpc_train.paths import RunPaths

    paths, seen = RunPaths(tmp_path), []
    env = SimpleNamespace(job_id="7", restart_count=0, rank=1, nodes=("localhost",), master_addr="127.0.0.1")
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "destroy_process_group", lambda: seen.append((tmp_path / ".hang-7-0" / "1").exists()))
    rejoin.drop_group(env, paths)
    assert seen == [True]


def test_a_standby_leaves_when_its_step_ends() -> None:
    """journal.step_over: a verdict since the standby's attempt other than an in-process restart, or the finish."""
    base = [ev("start", 2), ev(journal.IN_JOB_RESTART, 1, in_process=True)]
    assert not journal.step_over(base, 2)
    assert not journal.step_over([*base, ev(journal.IN_JOB_RESTART, 2, in_process=True)], 2)  # keeps the step
    for end in (journal.IN_JOB_RESTART, "requeue", "requeue_failed", "stopped", "finish", "lease_refused"):
        assert journal.step_over([*base, ev(end, 3)], 2), end
    assert not journal.step_over([*base, ev("requeue", 1)], 2)  # an earlier step's
    restart = ev(journal.IN_JOB_RESTART, 0, in_process=True, replaced={"node2": "node3"}, left_out=[], spares_left=0)
    (att,) = journal.attempts([ev("start", 0), restart])
    assert (att["ended_by"], att["in_process"], att["replaced"]) == (journal.IN_JOB_RESTART, True, {"node2": "node3"})


def test_a_signal_the_batch_shell_held_reaches_the_relaunched_step() -> None:
    """A stop signal trapped while the failed step ended is recorded as received when the next step's
    handlers go in: its stop save and requeue happen, not a step that never heard of the time limit."""
    code = (
        "from hpc_train import preempt; p = preempt.install_handlers(); import os, time; print(p.received, "
        "'HPC_TRAIN_PENDING_SIGNAL' in os.environ, [round(time.monotonic() - t, -1) for t in p.received_at])"
    )
    root = str(Path(__file__).resolve().parents[1])
    # the relay's "SIGUSR2@<Unix s>": as when it came (review: as if it came when the relaunched step started)
    came = int(time.time()) - 40
    for pending, want in (
        ("SIGUSR2", "['SIGUSR2'] False [0.0]"),
        (f"SIGUSR2@{came}", "['SIGUSR2'] False [40.0]"),
        (f"SIGTERM@{came + 3600}", "['SIGTERM'] False [0.0]"),  # a clock ahead of ours: now
        ("SIGUSR2@0", "['SIGUSR2'] False [0.0]"),  # bash before 5.0 has no EPOCHSECONDS
        ("", "[] False []"),
        ("bogus@12", "[] False []"),
    ):
        out = subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONPATH": root, "HPC_TRAIN_PENDING_SIGNAL": pending},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.stdout.strip() == want, out.stderr


@pytest.mark.slurm
@pytest.mark.usefixtures("no_node_left_drained")
def test_a_killed_rank_and_a_sick_node_are_recovered_inside_the_allocation(
    slurm_env: dict[str, str], tmp_path: Path, reference: dict
) -> None:
    """2 nodes + 1 spare. Once a checkpoint committed, the last rank's node is marked sick and that rank is killed:
    the step is relaunched inside the allocation on the same nodes (attempt 1), whose preflight finds the
    sick node; relaunched again without it, on the spare (attempt 2): one job, Slurm's Restarts still 0.
    Then TERM to the batch shell: its srun() relays it to the relaunched step as before, which saves and
    requeues (attempt 3, without the sick node) and finishes with the uninterrupted run's weights."""
    # 0.5 s a step, not 0.25: attempt 2 trains its last 20 steps in ~10 s, time for the checks below and the TERM
    # (at 0.25 s it finished in 4.9 s, before the batch-term: the job was gone, scancel "Invalid job id")
    slower = [a for a in RUN_ARGS if not a.startswith("train.min_step_time_s=")] + ["train.min_step_time_s=0.5"]
    run_dir, job_id = submit([*slower, "cluster.spare_nodes=1", f"out_dir={tmp_path}", "name=spares"], env=slurm_env)
    wait_until(lambda: any(e["event"] == "checkpoint_committed" for e in read_events(run_dir)), 180, "a checkpoint")
    first = next(e for e in read_events(run_dir) if e["event"] == "start")
    last = first["world_size"] - 1
    sick = first["rank_nodes"][last]
    for action in ("sick-node", "kill-rank"):
        done = run([HPC_TRAIN, "chaos", str(run_dir), action, "--rank", str(last)], env=slurm_env)
        assert done.returncode == 0, done.stdout + done.stderr

    wait_until(
        lambda: any(e["event"] == "first_step" and e["restart"] == 2 for e in read_events(run_dir)),
        420,
        "attempt 2's first step",
    )
    job = run(["scontrol", "show", "job", "-o", job_id], env=slurm_env).stdout
    assert " Restarts=0 " in job and " NumNodes=3 " in job, job
    status = run([HPC_TRAIN, "status", str(run_dir)], env=slurm_env).stdout
    assert f"{run_dir.name}: 2 in-job restart(s); 0 spare node(s) left" in status, status
    done = run([HPC_TRAIN, "chaos", str(run_dir), "batch-term"], env=slurm_env)
    assert done.returncode == 0, done.stdout + done.stderr

    summary = wait_finished(run_dir, job_id, slurm_env, timeout_s=420)
    assert summary["params_sha256"] == reference["params_sha256"]
    events = read_events(run_dir)
    restarts = [e for e in events if e["event"] == "in_job_restart"]
    assert [(e["restart"], e["reason"], e["left_out"], e["spares_left"]) for e in restarts] == [
        (0, "failure", [], 1),
        (1, "node_health", [sick], 0),
    ], restarts
    assert [(e["restart"], e["reason"], e["by"]) for e in events if e["event"] == "requeue"] == [
        (2, "preempt", "hpc_train")
    ]
    starts = {e["restart"]: e for e in events if e["event"] == "start"}
    assert sorted(starts) == [0, 2, 3] and {e["job_id"] for e in events if e.get("job_id")} == {job_id}
    assert sick not in starts[3]["nodes"]
    assert sick not in starts[2]["nodes"] and len(set(starts[2]["nodes"])) == 2
    assert starts[2]["step"] == max(
        e["step"] for e in events if e["event"] == "checkpoint_committed" and e["restart"] == 0
    )
    job = run(["scontrol", "show", "job", "-o", job_id], env=slurm_env).stdout  # kept MinJobAge=300 s after the end
    assert " Restarts=1 " in job and f" ExcNodeList={sick} " in job, job
    status = run([HPC_TRAIN, "status", str(run_dir)], env=slurm_env).stdout
    assert f"{run_dir.name}: 2 in-job restart(s); 1 spare node(s) left" in status, status  # the new allocation's
    assert [(e["node"], e["restart"]) for e in events if e["event"] == "node_excluded"] == [(sick, 1)]


def _finished_after_node_down(node: str, run_dir: Path, job_id: str, env: dict[str, str]) -> dict:
    """`node` set DOWN, as slurmctld does to a node silent for SlurmdTimeout; the run's summary once its job ended;
    the node put back (ReturnToService=2 returns it once its slurmd registers; make sure)."""
    try:
        proc = run(["scontrol", "update", f"NodeName={node}", "State=DOWN", "Reason=test"], env=env)
        assert proc.returncode == 0, proc.stderr
        return wait_finished(run_dir, job_id, env, timeout_s=300)
    finally:
        run(["scontrol", "update", f"NodeName={node}", "State=RESUME"], env=env)
        # responding again (not idle*) before the next test asks for nodes: Slurm starts nothing there until then
        states = lambda: set(run(["sinfo", "-h", "-n", node, "-o", "%t"], env=env).stdout.split())  # noqa: E731
        wait_until(lambda: states() and states() <= {"idle", "mix", "alloc"}, 30, f"{node} to respond again")


@pytest.mark.slurm
@pytest.mark.usefixtures("no_node_left_drained")
@pytest.mark.parametrize("victim", ["last", "first", "node", "down"])
def test_a_killed_rank_is_replaced_in_process_by_the_warm_standby(
    slurm_env: dict[str, str], tmp_path: Path, reference: dict, victim: str
) -> None:
    """cluster.in_process_restart, 2 nodes + 1 spare whose tasks wait warm. Once a checkpoint committed a rank is
    SIGKILLed (the last; or rank 0, whose process held the rendezvous store; or, 2 ranks per node, both of the last
    node, `lose-node`), or the last rank's node fails as Slurm sees it (`down`: State=DOWN, so Slurm takes it out of
    the --no-kill job and kills its task): the survivors drop their process groups and rejoin, in the same
    processes, with the standbys in the dead ranks' places; all resume from the memory tier (the standbys from the
    buddy copies); one job id, Slurm's Restarts still 0, the job COMPLETED, and (one rank per node) the
    uninterrupted run's weights. With 2 per node a survivor once waited, blocked on the other survivor, until it was
    taken for dead (gloo's sockets stayed open after destroy_process_group): the step was relaunched instead."""
    args = [*RUN_ARGS, "cluster.spare_nodes=1", "cluster.in_process_restart=true", "checkpoint.memory_every_steps=1"]
    args += ["cluster.tasks_per_node=2"] if victim == "node" else []
    run_dir, job_id = submit([*args, f"out_dir={tmp_path}", f"name=inproc-{victim}"], env=slurm_env)
    wait_until(lambda: any(e["event"] == "checkpoint_committed" for e in read_events(run_dir)), 180, "a checkpoint")
    first = next(e for e in read_events(run_dir) if e["event"] == "start")
    per = 2 if victim == "node" else 1
    dead = [0] if victim == "first" else list(range(first["world_size"] - per, first["world_size"]))
    lost = first["rank_nodes"][dead[0]]
    # the job's own spare: Slurm may start it on any 3 nodes (node1 just back from a DOWN shows idle* for a second)
    held = slurm.parse_allocation(run(["scontrol", "show", "job", "-o", job_id], env=slurm_env).stdout)
    assert held and len(held.nodes) == 3, held
    spare = next(n for n in held.nodes if n not in first["nodes"])
    if victim == "down":
        summary = _finished_after_node_down(lost, run_dir, job_id, slurm_env)
    else:
        action = "lose-node" if victim == "node" else "kill-rank"
        done = run([HPC_TRAIN, "chaos", str(run_dir), action, "--rank", str(dead[-1])], env=slurm_env)
        assert done.returncode == 0, done.stdout + done.stderr
        summary = wait_finished(run_dir, job_id, slurm_env, timeout_s=300)
    if per == 1:  # the reference has one rank per node
        assert summary["params_sha256"] == reference["params_sha256"]
    events = read_events(run_dir)
    (restart,) = [e for e in events if e["event"] == "in_job_restart"]
    assert (restart["restart"], restart["in_process"], restart["spares_left"]) == (0, True, 0), restart
    assert restart["replaced"] == {lost: spare}
    # a node Slurm took out is left out for the rest of the allocation (a relaunch's --exclude); a killed rank's is not
    assert restart["left_out"] == ([lost] if victim == "down" else []), restart
    starts = {e["restart"]: e for e in events if e["event"] == "start"}
    assert sorted(starts) == [0, 1] and {e["job_id"] for e in events if e.get("job_id")} == {job_id}
    for r in range(first["world_size"]):  # no new process for a rank that survived; the standby's for a dead one
        assert (starts[1]["pids"][r] == first["pids"][r]) == (r not in dead), (r, starts[1]["pids"], first["pids"])
        assert (starts[1]["rank_nodes"][r] == spare) == (r in dead)
    failed_at = max(e["step"] for e in events if e["event"] == "fail")
    # memory_every_steps=1 loses at most 2 steps: the failure can cut the copy still in flight (of the step before
    # the one reached: the dead rank's half of the buddy exchange never comes), and the one before it is the newest
    # complete. .ci/run saw 26 reached, 25 cut, 24 resumed with the `down` victim.
    assert starts[1]["resumed_from"].startswith("memory step") and failed_at - starts[1]["step"] <= 2, starts[1]
    assert starts[1]["memory"]["buddy"] == per  # the standbys' states came from the survivors' buddy copies
    job = run(["scontrol", "show", "job", "-o", job_id], env=slurm_env).stdout
    assert " Restarts=0 " in job, job
    status = run([HPC_TRAIN, "status", str(run_dir)], env=slurm_env).stdout
    assert "1 in-job restart(s) (1 in process)" in status, status
    log = "".join(p.read_text(errors="replace") for p in (run_dir / "submitit").glob("*_log.out"))
    assert f"] warning: restarting in process ({first['rank_nodes'][dead[0]]} by the standby on {spare})" in log
    report = run([HPC_TRAIN, "report", str(run_dir), "--wide"], env=slurm_env).stdout
    # down: the table wraps the row's end ("(in process; ..." on the next line), as in the shrink test
    end = f" (left out: {lost}; 0 spare(s) left)" if victim == "down" else f" (in process; {lost} -> {spare})"
    assert f"in_job_restart{end}" in report, report


@pytest.mark.slurm
@pytest.mark.usefixtures("no_node_left_drained")
def test_losing_the_batch_scripts_node_requeues_the_job_without_it(
    slurm_env: dict[str, str], tmp_path: Path, reference: dict
) -> None:
    """2 nodes + 1 spare (sbatch --no-kill). The batch script's node fails (State=DOWN): Slurm takes it out and
    ends the job (FAILED, JobLaunchFailure) without the requeue a job without --no-kill gets, and no relay is left to
    relaunch a step. The surviving rank reads the fate batch_host_lost and requeues the job as a failure, without
    that node; the next attempt resumes from the last commit and finishes with the uninterrupted run's weights."""
    run_dir, job_id = submit(
        [*RUN_ARGS, "cluster.spare_nodes=1", f"out_dir={tmp_path}", "name=batchhost"], env=slurm_env
    )
    wait_until(lambda: any(e["event"] == "checkpoint_committed" for e in read_events(run_dir)), 180, "a checkpoint")
    fields = slurm.parse_key_values(run(["scontrol", "show", "job", "-o", job_id], env=slurm_env).stdout)
    host = fields["BatchHost"]
    summary = _finished_after_node_down(host, run_dir, job_id, slurm_env)
    assert summary["params_sha256"] == reference["params_sha256"]
    events = read_events(run_dir)
    (requeue,) = [e for e in events if e["event"] == "requeue"]
    assert (requeue["restart"], requeue["reason"], requeue["by"], requeue["fate"]) == (
        0,
        "failure",
        "hpc_train",
        "batch_host_lost",
    )
    assert [(e["node"], e["restart"]) for e in events if e["event"] == "node_excluded"] == [(host, 0)]
    assert not [e for e in events if e["event"] in ("in_job_restart", "stopped", "requeue_failed")], events
    starts = {e["restart"]: e for e in events if e["event"] == "start"}
    assert sorted(starts) == [0, 1] and host not in starts[1]["nodes"]
    job = run(["scontrol", "show", "job", "-o", job_id], env=slurm_env).stdout  # kept MinJobAge=300 s after the end
    assert " Restarts=1 " in job and f" ExcNodeList={host} " in job and " NumNodes=3 " in job, job
    log = "".join(p.read_text(errors="replace") for p in (run_dir / "submitit").glob("*_log.out"))
    assert names(log, "not restarting inside the allocation", "the batch script's node was lost")


@pytest.mark.slurm
@pytest.mark.usefixtures("no_node_left_drained")
def test_hot_spares_still_relaunch_in_a_container_without_slurms_clients(
    slurm_env: dict[str, str], tmp_path: Path, reference: dict
) -> None:
    """The ranks have no scontrol (a container; here PATH without it, for the ranks only): the nodes the job holds
    cannot be asked, and a killed rank is still relaunched inside the allocation, as before they were asked (review:
    it requeued, the requeue failed without scontrol, and the run stopped)."""
    args = [*RUN_ARGS, "cluster.spare_nodes=1", "cluster.launcher=[env,'PATH=/nonexistent']"]
    run_dir, job_id = submit([*args, f"out_dir={tmp_path}", "name=noclients"], env=slurm_env)
    wait_until(lambda: any(e["event"] == "checkpoint_committed" for e in read_events(run_dir)), 180, "a checkpoint")
    done = run([HPC_TRAIN, "chaos", str(run_dir), "kill-rank", "--rank", "1"], env=slurm_env)
    assert done.returncode == 0, done.stdout + done.stderr
    summary = wait_finished(run_dir, job_id, slurm_env, timeout_s=300)
    assert summary["params_sha256"] == reference["params_sha256"]
    events = read_events(run_dir)
    assert [e["event"] for e in events if e["event"] in ("in_job_restart", "requeue", "requeue_failed", "stopped")] == [
        "in_job_restart"
    ], events


# An elastic resume is not bit-exact: the global batch is kept by 2 micro-batches on 1 rank (final loss measured
# 4.2e-8 from the uninterrupted run's; test_elastic.py's requeue shrink, 6.2e-8 at worst over 80 steps).
LOSS_RTOL = 1e-4


@pytest.mark.slurm
@pytest.mark.usefixtures("no_node_left_drained")
def test_with_no_spare_left_the_step_goes_on_smaller_inside_the_allocation(
    slurm_env: dict[str, str], tmp_path: Path, reference: dict
) -> None:
    """2 nodes + 1 spare, cluster.min_nodes=1. A sick node and its rank killed after the first commit: relaunched
    on the same nodes, whose preflight finds it, then on the spare (attempts 1, 2). The same to the other original
    node: no spare left, so the step goes on with the one healthy node (attempt 4, world size 1, 2 micro-batches)
    inside the same job (Slurm's Restarts still 0), and finishes with the uninterrupted run's loss."""
    args = [*RUN_ARGS, "cluster.partition=debug", "cluster.spare_nodes=1", "cluster.min_nodes=1"]
    # 4 relaunches before a newer commit may land (requeue.max_in_job_restarts, default 3, counts them in a
    # row); 0.5 s steps (0.25 in the reference: they only sleep) so the second fault lands before step 60.
    args += ["requeue.max_in_job_restarts=4", "train.min_step_time_s=0.5", f"out_dir={tmp_path}", "name=shrink"]
    run_dir, job_id = submit(args, env=slurm_env)

    def seen(event: str, restart: int) -> dict | None:
        return next((e for e in read_events(run_dir) if e["event"] == event and e["restart"] == restart), None)

    def sicken(rank: int) -> None:
        for action in ("sick-node", "kill-rank"):
            done = run([HPC_TRAIN, "chaos", str(run_dir), action, "--rank", str(rank)], env=slurm_env)
            assert done.returncode == 0, done.stdout + done.stderr

    wait_until(lambda: seen("checkpoint_committed", 0), 180, "a checkpoint")
    first = seen("start", 0)
    assert first
    sicken(first["world_size"] - 1)
    wait_until(lambda: seen("first_step", 2), 300, "attempt 2's first step, on the spare")
    second = seen("start", 2)
    assert second
    sick = [first["rank_nodes"][-1], first["rank_nodes"][0]]
    sicken(second["rank_nodes"].index(sick[1]))

    def gave_up() -> list[dict]:
        return [e for e in read_events(run_dir) if e["event"] in ("requeue", "stopped", "node_not_excluded")]

    wait_until(lambda: seen("first_step", 4) or gave_up(), 300, "attempt 4's first step, on one node")
    assert not gave_up(), gave_up()  # before: node_not_excluded (the allocation counted beyond cluster.nodes), requeue
    job = run(["scontrol", "show", "job", "-o", job_id], env=slurm_env).stdout
    assert " Restarts=0 " in job and " NumNodes=3 " in job, job

    summary = wait_finished(run_dir, job_id, slurm_env, timeout_s=300)
    events = read_events(run_dir)
    restarts = [e for e in events if e["event"] == "in_job_restart"]
    assert [(e["restart"], e["reason"], e["left_out"], e["nodes_next"], e["spares_left"]) for e in restarts] == [
        (0, "failure", [], 2, 1),
        (1, "node_health", sick[:1], 2, 0),
        (2, "failure", sick[:1], 2, 0),
        (3, "node_health", sorted(sick), 1, 0),
    ], restarts
    assert restarts[-1]["srun_args"] == f"--nodes=1 --ntasks=1 --exclude={','.join(sorted(sick))}"
    starts = {e["restart"]: e for e in events if e["event"] == "start"}
    assert sorted(starts) == [0, 2, 4] and {e["job_id"] for e in events if e.get("job_id")} == {job_id}
    assert not [e for e in events if e["event"] in ("requeue", "batch_changed")], events
    (last,) = set(starts[4]["nodes"])
    assert last not in sick and (starts[4]["world_size"], starts[4]["grad_accum_steps"]) == (1, 2), starts[4]
    assert starts[4]["resharded_from"] == 2 and starts[4]["global_batch_seqs"] == starts[0]["global_batch_seqs"]
    assert summary["final_step"] == reference["final_step"] == 60
    worst = abs(summary["final_loss"] - reference["final_loss"]) / reference["final_loss"]
    print(f"final loss {summary['final_loss']} vs {reference['final_loss']} uninterrupted: {worst:.2e} relative")
    assert worst <= LOSS_RTOL
    atts = journal.attempts(events)
    assert [a["nodes_next"] for a in atts if a["ended_by"] == journal.IN_JOB_RESTART] == [2, 2, 2, 1]
    report = run([HPC_TRAIN, "report", str(run_dir), "--wide"], env=slurm_env).stdout
    # the table wraps the left-out nodes onto the row's next line
    assert "in_job_restart (next: 1 nodes)" in report and f"│ 1 on {last} " in report, report
    log = "".join(p.read_text(errors="replace") for p in (run_dir / "submitit").glob("*_log.out"))
    out = ", ".join(sorted(sick))
    assert (
        f"] warning: restarting inside the allocation without {out} (0 spare(s) left, going on with 1 of "
        f"cluster.nodes=2): srun {restarts[-1]['srun_args']}\n" in log
    ), log


def test_status_and_prometheus_count_in_job_restarts(tmp_path: Path) -> None:
    import io
    from contextlib import redirect_stdout

    from hpc_train import prometheus
    from hpc_train.status import COLUMNS, print_status

    for e in (ev("start", 0), ev(journal.IN_JOB_RESTART, 0, left_out=["node2"], spares_left=0)):
        journal.log(
            tmp_path,
            e["event"],
            e["step"],
            "7",
            e["restart"],
            **{k: e[k] for k in ("left_out", "spares_left") if k in e},
        )
    got = prometheus.values(tmp_path)
    assert (got["hpc_train_in_job_restarts"], got["hpc_train_spares_left"]) == (1.0, 0.0)
    row = {**dict.fromkeys(COLUMNS), "run": "spares-1", "job_id": "7", "state": "RUNNING", "warnings": []}
    out = io.StringIO()
    with redirect_stdout(out):
        print_status([{**row, "in_job_restarts": 1, "spares_left": 0.0}])
    assert names(out.getvalue(), "spares-1: 1 in-job restart(s)", "0 spare node(s) left")
    with redirect_stdout(out):
        print_status([{**row, "in_job_restarts": 2, "in_process_restarts": 1, "spares_left": 0.0}])
    assert names(out.getvalue(), "spares-1: 2 in-job restart(s)", "(1 in process)")


def test_report_names_the_next_size_of_an_in_job_restart_only_when_it_is_smaller(tmp_path: Path) -> None:
    """Review of issue 20: every in-job row said `(next: 2 nodes)`, a relaunch on a spare at full size too;
    only going on smaller than cluster.nodes (min_nodes, no spare left) is news. Here cluster.nodes=2 + 1
    spare: a kill (same nodes), a sick node (its spare), a second sick node (one node left)."""
    from test_local_ops import local_run, table_rows

    def attempt(restart: int, t: float, nodes: list[str], **end: object) -> list[dict]:
        base = {"job_id": "4242", "restart": restart, "step": 10 * restart}
        start = {**base, "time": t, "event": "start", "launched_at": t - 5, "world_size": len(nodes), "nodes": nodes}
        return [start, *([{**base, "time": t + 5, "event": journal.IN_JOB_RESTART, **end}] if end else [])]

    events = [
        *attempt(0, 100.0, ["n1", "n2"], left_out=[], nodes_next=2, spares_left=1),
        *attempt(1, 120.0, ["n1", "n2"], left_out=["n2"], nodes_next=2, spares_left=0),
        *attempt(2, 140.0, ["n1", "n3"], left_out=["n2", "n3"], nodes_next=1, spares_left=0),
        *attempt(3, 160.0, ["n1"]),
    ]
    run_dir = local_run(tmp_path / "spares", 999999, {"start_time": 0, "boot_id": "gone", "host": "gone"}, events)
    (run_dir / "config.yaml").write_text("cluster: {executor: local, nodes: 2, spare_nodes: 1}\n")
    proc = run([HPC_TRAIN, "report", str(run_dir), "--png", str(tmp_path / "r.png"), "--wide"])
    assert proc.returncode == 0, proc.stderr
    ended = [r["ended by"] for r in table_rows(proc.stdout, "attempt")]
    assert len(ended) == 4 and (ended[0], ended[3]) == ("in_job_restart", "running"), proc.stdout
    assert names(ended[1], "in_job_restart", "left out: n2;", "0 spare(s) left") and "next:" not in ended[1]
    assert names(ended[2], "in_job_restart", "next: 1 nodes", "left out: n2,n3;", "0 spare(s) left")


def test_report_names_an_in_process_restarts_replacements_and_survives_a_malformed_field() -> None:
    """report.ended_text: `replaced` (dead node -> standby node) as recorded; one that is not a mapping (a
    hand-edited or foreign journal line) is left out instead of crashing `hpc-train report`."""
    from hpc_train import report

    att = {"ended_by": journal.IN_JOB_RESTART, "nodes_next": 2, "left_out": [], "in_process": True}
    assert report.ended_text({**att, "replaced": {"n2": "n3"}}, 2) == "in_job_restart (in process; n2 -> n3)"
    for bad in (["n2"], "n2", 3, None):
        assert report.ended_text({**att, "replaced": bad}, 2) == "in_job_restart (in process)", bad


def _relay(
    tmp_path: Path, step_args: str, marker_at_start: str | None, fake_srun: str, shell: str = "set -u", **extra_env: str
) -> tuple[int, list[str], Path, str]:
    """The batch script's srun() (sbatch.relay_lines: hpc_train/relay.py) around a fake srun on PATH, the export of
    step_args after it as sbatch.py renders it, and a value inherited from a job that submitted this one in the
    environment: (the function's status, each srun call's arguments, the marker's path, its stderr)."""
    folder, bin_dir = tmp_path / "submitit", tmp_path / "bin"
    folder.mkdir(parents=True, exist_ok=bool(extra_env.pop("folder_exists", "")))
    bin_dir.mkdir()
    marker = folder / ".relaunch-77"
    if marker_at_start is not None:
        marker.write_text(marker_at_start)
    (bin_dir / "srun").write_text(f'#!/bin/bash\necho "$*" >> {tmp_path}/calls\nMARKER={marker}\n{fake_srun}\n')
    (bin_dir / "srun").chmod(0o755)
    export = f"export HPC_TRAIN_STEP_ARGS='{step_args}'\n" if step_args else ""
    relay = "\n".join(sbatch.relay_lines())
    script = f"{shell}\n{relay}\n{export}srun --unbuffered python -m submitit.core._submit {folder}\n"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "77", **extra_env}
    env["HPC_TRAIN_STEP_ARGS"] = "--nodes=9 --ntasks=9"  # the submitting job's step, inherited (review)
    proc = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=30)
    calls = (tmp_path / "calls").read_text().splitlines() if (tmp_path / "calls").exists() else []
    return proc.returncode, calls, marker, proc.stderr


# The options our spares batch script gives srun (--no-kill: a lost node's tasks die, not the step's).
SPARES_STEP = "--no-kill --kill-on-bad-exit=0 --nodes=2 --ntasks=4"
# The fake step: its first run plays the deciding rank (writes the marker, exits 145), the next ones end 0.
DECIDES_ONCE = 'if [ ! -e "$MARKER.done" ]; then touch "$MARKER.done"; echo "--nodes=2 --ntasks=4 --exclude=node2" > "$MARKER"; exit 145; fi; exit 0'


def test_the_batch_scripts_srun_relaunches_on_the_marker_only_with_spares(tmp_path: Path) -> None:
    """With spares: the marker's options start the next step, the marker is consumed, the last step's status is
    the job's. Without spares (no HPC_TRAIN_STEP_ARGS): one step, as before this feature, whatever a file says
    (review: the relaunch code ran, and listed the folder, for every job). A marker left by the job's last
    allocation never relaunches."""
    status, calls, marker, _ = _relay(tmp_path / "a", "--nodes=2 --ntasks=4", None, DECIDES_ONCE)
    assert status == 0 and not marker.exists()
    assert [c.split(" python")[0] for c in calls] == [
        f"{SPARES_STEP} --unbuffered",
        f"{SPARES_STEP} --exclude=node2 --unbuffered",
    ]
    status, calls, marker, _ = _relay(tmp_path / "b", "", None, DECIDES_ONCE)
    assert status == 145 and len(calls) == 1 and calls[0].startswith("--unbuffered python")
    status, calls, marker, _ = _relay(tmp_path / "c", "--nodes=2 --ntasks=4", "--nodes=2 --exclude=old", "exit 3")
    assert status == 3 and len(calls) == 1 and not marker.exists()  # the stale marker: removed, not used


def test_a_finished_run_ends_its_job_completed_though_a_replaced_task_died(tmp_path: Path) -> None:
    """cluster.in_process_restart: a task the in-process restart replaced died by SIGKILL, so srun's status is
    137; the ranks finished the run (job._run_function wrote .finished-JOBID): the job's status is 0, the file consumed.
    Without the file the status stays 137; a leftover from the job's last allocation is removed at the start."""
    finish = 'touch "$(dirname "$MARKER")/.finished-77"; exit 137'
    status, calls, marker, _ = _relay(tmp_path / "a", "--nodes=3 --ntasks=3", None, finish)
    assert status == 0 and len(calls) == 1 and not (marker.parent / ".finished-77").exists()
    status, calls, marker, _ = _relay(tmp_path / "b", "--nodes=3 --ntasks=3", None, "exit 137")
    assert status == 137 and len(calls) == 1
    (tmp_path / "c" / "submitit").mkdir(parents=True)
    (tmp_path / "c" / "submitit" / ".finished-77").touch()
    status, calls, marker, _ = _relay(tmp_path / "c", "--nodes=3 --ntasks=3", None, "exit 137", folder_exists="1")
    assert status == 137


def test_the_relaunch_survives_set_e_and_runs_only_our_own_options(tmp_path: Path) -> None:
    """Review: under a site template's `set -euo pipefail` the bare `wait` of a step that exited 145 ended the
    batch shell, so the run was neither relaunched nor requeued. A marker that is a symlink, not this user's,
    or holds other words than decision._relaunch writes (--task-prolog, --export: code run as this user) is not used:
    the step's status is the job's, the marker removed."""
    status, calls, marker, _ = _relay(tmp_path / "e", "--nodes=2 --ntasks=4", None, DECIDES_ONCE, "set -euo pipefail")
    assert status == 0 and len(calls) == 2 and calls[1].startswith(f"{SPARES_STEP} --exclude=node2 ")
    plant = {
        "prolog": 'echo "--nodes=2 --ntasks=4 --task-prolog=/tmp/x" > "$MARKER"; exit 145',
        "export": 'echo "--nodes=2 --ntasks=4 --export=ALL,LD_PRELOAD=/tmp/x.so" > "$MARKER"; exit 145',
        "link": 'echo "--nodes=2 --ntasks=4" > "$MARKER.real"; ln -s "$MARKER.real" "$MARKER"; exit 145',
        "owner": 'echo "--nodes=2 --ntasks=4" > "$MARKER"; chown 65534 "$MARKER"; exit 145',
    }
    for name, fake in plant.items():
        status, calls, marker, err = _relay(tmp_path / name, "--nodes=2 --ntasks=4", None, fake)
        assert status == 145 and len(calls) == 1 and not marker.is_symlink() and not marker.exists(), (name, err)
        assert "not relaunching on it" in err, (name, err)


# The fake step writes the marker and then one task never exits: srun answers TERM as Slurm's does (SIGKILL to
# every task, a stopped one too, then it exits), or, with a task in D state, not at all.
OUTLIVES_MARKER = (
    'if [ ! -e "$MARKER.done" ]; then touch "$MARKER.done"; echo "--nodes=2 --ntasks=4 --exclude=node2" > "$MARKER"; '
    "sleep 20 >/dev/null 2>&1 & s=$!; trap %s TERM; wait $s; exit 1; fi; exit 0"
)


@pytest.mark.parametrize("unkillable", [False, True])
def test_a_step_that_outlives_its_relaunch_marker_is_ended_then_relaunched(tmp_path: Path, unkillable: bool) -> None:
    """Issue 20: a rank that never exits (SIGSTOP, D state) after the deciding rank wrote the marker held srun and
    the batch shell until the time limit. The relay gives the step HPC_TRAIN_STEP_END_S, then TERMs srun; a srun
    still waiting HPC_TRAIN_STEP_KILL_S later gets SIGKILL; either way the step is relaunched from the marker."""
    fake = OUTLIVES_MARKER % ("''" if unkillable else "'kill $s; exit 143'")
    status, calls, marker, err = _relay(
        tmp_path, "--nodes=2 --ntasks=4", None, fake, HPC_TRAIN_STEP_END_S="1", HPC_TRAIN_STEP_KILL_S="1"
    )
    assert status == 0 and not marker.exists(), err
    assert [c.split(" python")[0] for c in calls] == [
        f"{SPARES_STEP} --unbuffered",
        f"{SPARES_STEP} --exclude=node2 --unbuffered",
    ], err
    assert names(err, "did not end within 1 s", "relaunch marker", "sent srun SIGTERM")
    assert ("sent srun SIGKILL" in err) is unkillable and ("still runs 1 s after SIGTERM" in err) is unkillable
    assert f"step ended with status {137 if unkillable else 143}; relaunching" in err


def test_the_relay_writes_its_beat_while_the_step_runs(tmp_path: Path) -> None:
    """With spares the relay writes the time into FOLDER/.relay-JOBID while the step runs (requeue.apply and the
    watchdog read it: a silent relay is a lost batch host), through a fresh mktemp file each time (no temp name a
    teammate could plant a symlink at), and removes it with any temp file once the step ended; without spares it
    writes nothing. The fake step copies what it sees after 2 s."""
    t0 = time.time()
    seen = 'sleep 2; cp "$(dirname "$MARKER")/.relay-77" "$MARKER.seen" 2>/dev/null; exit 0'
    status, calls, marker, err = _relay(tmp_path / "a", "--nodes=2 --ntasks=4", None, seen)
    assert status == 0 and len(calls) == 1, err
    assert t0 - 1 <= int(Path(f"{marker}.seen").read_text()) <= time.time()
    assert not [p.name for p in marker.parent.iterdir() if p.name.startswith(".relay")]  # removed at the end
    status, calls, marker, err = _relay(tmp_path / "b", "", None, seen)
    assert status == 0 and not Path(f"{marker}.seen").exists(), err


def test_a_file_system_error_at_the_relays_looks_never_ends_the_running_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Review: Path.exists raises ESTALE, EIO and EACCES (NFS, an expired Kerberos ticket); at the relay's look for
    the marker that ended the batch step with 1 under a running srun (the job FAILED mid-training). Now such a
    look is "not yet", a file it cannot remove is left, and a site's HPC_TRAIN_STEP_END_S that is no number is
    said and the table's taken: the step runs to its end and its status is the job's."""
    import errno

    from hpc_train import relay

    bin_dir, folder = tmp_path / "bin", tmp_path / "submitit"
    bin_dir.mkdir()
    folder.mkdir()
    (bin_dir / "srun").write_text(f"#!/bin/bash\nsleep 2.5\ntouch {tmp_path}/ran\nexit 0\n")
    (bin_dir / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    real_exists, real_unlink = Path.exists, Path.unlink

    def stale(self: Path, *a: object, **k: object) -> bool:
        if self.name.startswith((".relaunch-", ".finished-")):
            raise OSError(errno.ESTALE, "Stale file handle", str(self))
        return real_exists(self, *a, **k)

    def refused(self: Path, *a: object, **k: object) -> None:
        if self.name.startswith((".relaunch-", ".finished-", ".relay-")):
            raise OSError(errno.EIO, "Input/output error", str(self))
        real_unlink(self, *a, **k)

    monkeypatch.setattr(Path, "exists", stale)
    monkeypatch.setattr(Path, "unlink", refused)
    environ = {"SLURM_JOB_ID": "77", "HPC_TRAIN_STEP_ARGS": "--nodes=2 --ntasks=2", "HPC_TRAIN_STEP_END_S": "90s"}
    with caplog.at_level("WARNING", logger="hpc_train.relay"):
        status = relay.supervise(relay.Relay(), ["90", "120", "5", "python", str(folder)], environ)
    assert status == 0 and (tmp_path / "ran").exists()
    (bad,) = [r for r in caplog.records if r.args and r.args[0] == "HPC_TRAIN_STEP_END_S"]
    assert bad.levelname == "WARNING" and bad.args[1:] == ("90s", "90"), bad.args  # the value, and what is taken
    assert "cannot remove" in caplog.text


def test_a_beat_write_the_file_system_holds_never_holds_a_signal_on_its_way_to_srun(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review: the relay wrote its beat (and looked for the marker) in the loop that passes signals on, so a
    write NFS held for seconds held a preemption's USR2 as long, out of the ranks' grace. Now the folder's I/O
    has its own thread (relay.Watch): here every beat write takes 3 s, and a stop signal recorded 1 s into the
    step reaches the fake srun within a second."""
    from hpc_train import relay

    bin_dir, folder = tmp_path / "bin", tmp_path / "submitit"
    bin_dir.mkdir()
    folder.mkdir()
    got = tmp_path / "got"
    (bin_dir / "srun").write_text(
        f"#!/bin/bash\ntrap 'date +%s.%N > {got}' USR2\nfor i in $(seq 50); do sleep 0.1; done\nexit 0\n"
    )
    (bin_dir / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    real_write = relay._write_new

    def held(path: Path, text: str) -> None:
        time.sleep(3.0)  # a file server that holds the write
        real_write(path, text)

    monkeypatch.setattr(relay, "_write_new", held)
    r = relay.Relay()
    sent: list[float] = []

    def stop_signal() -> None:  # what the handler records when Slurm's USR2 comes
        time.sleep(1.0)
        sent.append(time.time())
        r.on_signal(signal.SIGUSR2, None)

    threading.Thread(target=stop_signal, daemon=True).start()
    environ = {"SLURM_JOB_ID": "77", "HPC_TRAIN_STEP_ARGS": "--nodes=2 --ntasks=2"}
    assert relay.supervise(r, ["90", "120", "5", "python", str(folder)], environ) == 0
    assert got.exists() and float(got.read_text()) - sent[0] < 1.0, (sent, got.read_text() if got.exists() else None)


def test_an_error_in_the_relays_watch_never_stops_it_from_seeing_the_finish(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Review: the Watch thread caught OSError only; any other error ended it silently, and a step that outlived
    its run's finish was never ended. Here its first look raises ValueError: it says so, looks again, sees the
    finished file and ends the step within end_s, and the beat file is gone afterwards."""
    from hpc_train import relay

    bin_dir, folder = tmp_path / "bin", tmp_path / "submitit"
    bin_dir.mkdir()
    folder.mkdir()
    relay.write_finished(folder, "77")
    (bin_dir / "srun").write_text("#!/bin/bash\ntrap 'exit 143' TERM\nfor i in $(seq 300); do sleep 0.1; done\n")
    (bin_dir / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    real_there, calls = relay._there, []

    def flaky(path: Path) -> bool:
        calls.append(path.name)
        if len(calls) == 1:
            raise ValueError("a surprise")
        return real_there(path)

    monkeypatch.setattr(relay, "_there", flaky)
    t0 = time.monotonic()
    with caplog.at_level("ERROR", logger="hpc_train.relay"):
        status = relay.run_step(relay.Relay(), ["srun", "x"], folder, "77", True, (1.0, 5.0, 5.0))
    assert time.monotonic() - t0 < 10 and status == 143, status  # ended by TERM 1 s after the finish was seen
    assert "the relay's look at" in caplog.text and len(calls) >= 2
    assert not relay.beat_file(folder, "77").exists()


def test_a_marker_the_relay_cannot_remove_relaunches_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Review: left in place, the marker would end the relaunched step at the relay's next look, and relaunch it
    again, until the time limit. Not removed, it is not acted on: the job ends with the step's status."""
    import errno

    from hpc_train import relay

    relay.write_marker(tmp_path, "77", "--nodes=2 --ntasks=4")
    assert relay.take_marker(tmp_path, "77") == "--nodes=2 --ntasks=4"  # removable: taken
    relay.write_marker(tmp_path, "77", "--nodes=2 --ntasks=4")
    real_unlink = Path.unlink

    def refused(self: Path, *a: object, **k: object) -> None:
        if self.name.startswith(".relaunch-"):
            raise OSError(errno.EACCES, "Permission denied", str(self))
        real_unlink(self, *a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(Path, "unlink", refused)
    assert relay.take_marker(tmp_path, "77") == ""


def test_a_step_that_outlives_its_runs_finish_is_ended_completed(tmp_path: Path) -> None:
    """cluster.in_process_restart: a task taken for dead (SIGSTOP, D state) that never exits held the step after the
    ranks finished the run (.finished-JOBID) until the time limit: the relay ends it as after a relaunch marker,
    and the job's status is the finished run's, 0."""
    fake = 'touch "$(dirname "$MARKER")/.finished-77"; sleep 20 >/dev/null 2>&1 & s=$!; trap "kill $s; exit 143" TERM; wait $s'
    status, calls, _, err = _relay(tmp_path, "--nodes=3 --ntasks=3", None, fake, HPC_TRAIN_STEP_END_S="1")
    assert status == 0 and len(calls) == 1, err
    assert names(err, "did not end within 1 s", ".finished-77", "sent srun SIGTERM")


def test_a_signal_caught_while_the_step_ends_reaches_the_relaunched_step(tmp_path: Path) -> None:
    """A time-limit warning (USR2 to the batch shell) that comes as the failed step ends is not lost: the relay
    holds it and hands it to the relaunched step (HPC_TRAIN_PENDING_SIGNAL; preempt.install_handlers records it)."""
    fake = (
        'echo "pending=${HPC_TRAIN_PENDING_SIGNAL:-}" >> "$MARKER.pending"; '
        'if [ ! -e "$MARKER.done" ]; then touch "$MARKER.done"; echo "--nodes=2 --ntasks=4" > "$MARKER"; '
        "trap '' USR2; kill -USR2 $PPID; sleep 0.5; exit 145; fi; exit 0"
    )
    status, calls, marker, err = _relay(tmp_path, "--nodes=2 --ntasks=4", None, fake)
    assert status == 0 and len(calls) == 2, err
    first, second = Path(f"{marker}.pending").read_text().split()
    assert first == "pending=" and re.fullmatch(r"pending=SIGUSR2@\d+", second), second
    assert abs(int(second.split("@")[1]) - time.time()) < 30  # when it came, in Unix s


def test_no_relaunch_marker_without_our_spares_batch_script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step srun started by hand (salloc + srun, an older rendered script) has SUBMITIT_FOLDER and SLURM_JOB_ID
    but no HPC_TRAIN_STEP_ARGS: nobody would read a marker, so the decision requeues (review: it exited 145 and
    the run stopped silently)."""

    recorded: list[str] = []
    cfg = to_run_config(
        compose(["cluster=dev", "cluster.nodes=2", "cluster.tasks_per_node=2", "cluster.spare_nodes=1"])
    )
    monkeypatch.setenv("SUBMITIT_FOLDER", str(tmp_path))
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.delenv("HPC_TRAIN_STEP_ARGS", raising=False)
    nodes, record = ["n1", "n2", "n3"], lambda name, **f: recorded.append(name)
    d = inside_decision(cfg, nodes, ["n2"], record=record)
    assert d.action == decision.Action.REQUEUE and not list(tmp_path.iterdir()) and recorded == []
    assert len(d.said) == 1 and d.said[0].startswith(decision.NOT_INSIDE)
    assert names(d.said[0], "no HPC_TRAIN_STEP_ARGS", "srun by hand", "requeueing")
    monkeypatch.setenv("HPC_TRAIN_STEP_ARGS", "--nodes=2 --ntasks=4")
    assert inside_decision(cfg, nodes, ["n2"], record=record).action == "relaunch" and recorded == [
        journal.IN_JOB_RESTART
    ]
    assert (tmp_path / ".relaunch-77").read_text() == "--nodes=2 --ntasks=4 --exclude=n2\n"
    # no spare left, cluster.min_nodes=1: the step goes on with the one healthy node
    smaller = to_run_config(
        compose(
            [
                "cluster=dev",
                "cluster.nodes=2",
                "cluster.tasks_per_node=2",
                "cluster.spare_nodes=1",
                "cluster.min_nodes=1",
            ]
        )
    )
    assert inside_decision(smaller, nodes, ["n2"], {"n1": "Xid 79"}, record).action == "relaunch"
    assert (tmp_path / ".relaunch-77").read_text() == "--nodes=1 --ntasks=2 --exclude=n1,n2\n"
    assert recorded[-2:] == [journal.NODE_EXCLUDED, journal.IN_JOB_RESTART]


@pytest.mark.slurm
def test_a_partition_of_exactly_nodes_plus_spares_still_leaves_a_sick_node_out_inside_the_allocation(
    slurm_env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 20 on the dev cluster: cluster.nodes=3 + 1 spare is the whole 4-node `debug` partition. A real
    allocation of it (a sleeping batch job) and the deciding rank's requeue_or_stop for a node's hardware error:
    the sick node is left out of the relaunched step, the allocation holding one spare (before: the partition's
    count, 4 usable - 4 needed = 0, said node_not_excluded and requeued). With the job's time limit cut to a
    minute (Slurm's EndTime, read by scontrol) it requeues instead: 60 s is less than cluster.signal_lead_s=90."""
    from types import SimpleNamespace

    from hpc_train.env import parse_nodelist
    from hpc_train.paths import RunPaths

    for key, value in slurm_env.items():
        monkeypatch.setenv(key, value)
    cfg = to_run_config(compose(["cluster=dev", "cluster.nodes=3", "cluster.spare_nodes=1"]))
    sub = ["sbatch", "--parsable", "-p", "debug", "-N", "4", "-t", "10", "-o", "/dev/null", "--wrap", "sleep 300"]
    job_id = run(sub, env=slurm_env).stdout.strip()
    try:
        wait_until(
            lambda: "RUNNING" in run(["squeue", "-h", "-j", job_id, "-o", "%T"], env=slurm_env).stdout, 60, "4 nodes"
        )
        nodelist = run(["squeue", "-h", "-j", job_id, "-o", "%N"], env=slurm_env).stdout.strip()
        sick = parse_nodelist(nodelist)[1]
        folder = tmp_path / "submitit"
        folder.mkdir()
        for key, value in {
            "SLURM_JOB_ID": job_id,
            "SLURM_JOB_NODELIST": nodelist,
            "SUBMITIT_FOLDER": str(folder),
            "HPC_TRAIN_STEP_ARGS": "--nodes=3 --ntasks=6",
            "HPC_TRAIN_ALLOCATED_AT": "",
        }.items():
            monkeypatch.setenv(key, value)
        env = SimpleNamespace(executor="slurm", job_id=job_id, restart_count=0, nodes=tuple(parse_nodelist(nodelist)))
        run_dir = tmp_path / "run"
        run_dir.mkdir()
        verdict = requeue.requeue_or_stop(RunPaths(run_dir), env, cfg, "failure", 5, {sick: "Xid 79"}, signals=[])
        events = read_events(run_dir)
        assert verdict == "relaunch", events
        assert (folder / f".relaunch-{job_id}").read_text() == f"--nodes=3 --ntasks=6 --exclude={sick}\n"
        assert [(e["event"], e.get("node"), e.get("spares_left")) for e in events] == [
            (journal.NODE_EXCLUDED, sick, None),
            (journal.IN_JOB_RESTART, None, 0),
        ]

        assert run(["scontrol", "update", f"JobId={job_id}", "TimeLimit=1"], env=slurm_env).returncode == 0
        again = tmp_path / "again"
        again.mkdir()
        verdict = requeue.requeue_or_stop(RunPaths(again), env, cfg, "failure", 5, {sick: "Xid 79"}, signals=[])
        events = read_events(again)
        assert verdict == "requeue" and journal.IN_JOB_RESTART not in [e["event"] for e in events], events
        # the requeue counts the partition: no node beyond the job's own 4 to leave this one out of
        assert [e["event"] for e in events][:1] == [journal.NODE_NOT_EXCLUDED], events
        text = said(caplog)
        assert names(text, "not restarting inside the allocation", "s left before the time limit", "under the 90 s")
    finally:
        run(["scancel", job_id], env=slurm_env)


@pytest.mark.slurm
def test_a_requeue_after_in_job_exclusions_lets_the_oldest_back_in_so_the_job_fits(
    slurm_env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Review of issue 20 on the dev cluster: cluster.nodes=2 + 1 spare on the 4-node `debug` partition, two
    nodes left out by in-job restarts (they count the allocation), then a time-limit requeue of the real job.
    ExcNodeList held both: 2 usable nodes for a 3-node job, pending for good. Now it keeps the newest blame
    out and lets the older one in (exclude_nodes event with let_in, a line in the job log); the requeued job
    runs again, not on the node still left out. Then as a 4-node job (3 + 1): none to spare, ExcNodeList
    cleared."""
    from types import SimpleNamespace

    from hpc_train.env import parse_nodelist
    from hpc_train.paths import RunPaths

    for key, value in slurm_env.items():
        monkeypatch.setenv(key, value)
    cfg = to_run_config(compose(["cluster=dev", "cluster.nodes=2", "cluster.spare_nodes=1"]))
    sub = ["sbatch", "--parsable", "--requeue", "-p", "debug", "-N", "3", "-t", "10", "-o", "/dev/null"]
    job_id = run([*sub, "--wrap", "sleep 300"], env=slurm_env).stdout.strip()

    def state() -> str:
        return run(["squeue", "-h", "-j", job_id, "-o", "%T"], env=slurm_env).stdout.strip()

    try:
        wait_until(lambda: state() == "RUNNING", 60, "3 nodes")
        nodelist = run(["squeue", "-h", "-j", job_id, "-o", "%N"], env=slurm_env).stdout.strip()
        old, new = parse_nodelist(nodelist)[:2]
        monkeypatch.setenv("SLURM_JOB_ID", job_id)
        monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
        run_dir = tmp_path / "run"
        run_dir.mkdir()
        for node in (old, new):  # as two in-job restarts record them
            journal.log(run_dir, journal.NODE_EXCLUDED, 5, job_id, 0, node=node, why="Xid 79")
        env = SimpleNamespace(executor="slurm", job_id=job_id, restart_count=0, nodes=tuple(parse_nodelist(nodelist)))
        assert requeue.requeue_or_stop(RunPaths(run_dir), env, cfg, "time_limit", 5, signals=["SIGUSR2"]) == "requeue"
        (exc,) = [e for e in read_events(run_dir) if e["event"] == journal.EXCLUDE_NODES]
        assert (exc["nodes"], exc["let_in"], exc["ok"]) == (new, [old], True), exc
        assert list(journal.excluded_nodes(read_events(run_dir))) == [new]
        said = [r.getMessage() for r in caplog.records if r.name == "hpc_train.requeue"]
        assert names(" ".join(said), f"ExcNodeList lets {old} back in", "left out longest ago", "needs 3 nodes")
        shown = run(["scontrol", "show", "job", "-o", job_id], env=slurm_env).stdout
        assert f" ExcNodeList={new} " in shown, shown
        wait_until(lambda: state() == "RUNNING", 90, "the requeued job running again")
        again = run(["squeue", "-h", "-j", job_id, "-o", "%N"], env=slurm_env).stdout.strip()
        assert new not in parse_nodelist(again), again
        # a job of all 4 nodes has none to spare: the last one left out is let in, ExcNodeList cleared
        whole = to_run_config(compose(["cluster=dev", "cluster.nodes=3", "cluster.spare_nodes=1"]))
        monkeypatch.setenv("SLURM_RESTART_COUNT", "1")  # this allocation's: Slurm requeued it once
        assert requeue.requeue_or_stop(RunPaths(run_dir), env, whole, "time_limit", 6, signals=["SIGUSR2"]) == "requeue"
        last = [e for e in read_events(run_dir) if e["event"] == journal.EXCLUDE_NODES][-1]
        assert (last["nodes"], last["let_in"], last["ok"]) == ("", [new], True), last
        assert journal.excluded_nodes(read_events(run_dir)) == {}
        shown = run(["scontrol", "show", "job", "-o", job_id], env=slurm_env).stdout
        assert " ExcNodeList=(null) " in shown, shown
    finally:
        run(["scancel", job_id], env=slurm_env)


def test_a_rank_takes_its_life_lock_while_another_node_probes_it(tmp_path: Path) -> None:
    """holder_gone's probe flocks the file for an instant: a hold_for_life at that instant used to get None (the
    rank then counted as one with no flock, and a probe read it as gone). It waits the probe out; a lock
    that stays held (a live holder) still ends in None, within paths.HOLD_WAIT_S."""
    import fcntl
    import threading
    import time

    from hpc_train import paths as paths_mod
    from hpc_train.paths import hold_for_life, holder_gone

    lock = tmp_path / "0"
    lock.touch()
    probe = os.open(lock, os.O_RDWR)
    fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the probe, caught holding it (kept 0.2 s here)
    threading.Timer(0.2, os.close, [probe]).start()
    fd = hold_for_life(lock)
    assert fd is not None and not holder_gone(lock)
    t0 = time.monotonic()
    assert hold_for_life(lock) is None  # held by a live holder (fd): not taken
    assert paths_mod.HOLD_WAIT_S <= time.monotonic() - t0 < paths_mod.HOLD_WAIT_S + 1.0
    os.close(fd)
    assert holder_gone(lock)


def test_a_rejoin_verdict_whose_plan_is_gone_leaves_instead_of_rebuilding_on_a_dead_group(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With no plan to read, the loop in job._run_function built an Attempt on the destroyed group, failed, got the same
    verdict and read nothing again: a busy loop until the watchdog. The rank now leaves (exit 1)."""
    from hpc_train import leave
    from hpc_train.paths import RunPaths

    def exit_(code: int, finished: bool = False) -> None:
        raise SystemExit(code)

    monkeypatch.setattr(leave, "process", exit_)
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    paths = RunPaths(run)
    paths.rejoin_plan("7").write_text('{"from": 0, "attempt": 1}\n')
    assert rejoin.rejoin_plan_or_leave(paths, "7", Task()) == {"from": 0, "attempt": 1}
    paths.rejoin_plan("7").unlink()
    with pytest.raises(SystemExit) as left:
        rejoin.rejoin_plan_or_leave(paths, "7", Task())
    assert left.value.code == 1


def test_a_signal_caught_between_steps_reaches_the_relaunch_with_its_time_on_a_bash_without_epochseconds(
    tmp_path: Path,
) -> None:
    """bash 4.4 (RHEL 8) has no EPOCHSECONDS: the traps wrote SIGUSR2@0, which the next step reads as "now", so its
    stop save was given the relaunch's seconds too. printf's %(%s)T is in bash 4.2. EPOCHSECONDS unset here
    is bash 4.4's case on any bash."""
    fake = (
        'if [ ! -e "$MARKER.done" ]; then trap "" USR2; touch "$MARKER.done"; kill -USR2 $PPID; sleep 0.5; '
        'echo "--nodes=2 --ntasks=4" > "$MARKER"; exit 145; fi; echo "$HPC_TRAIN_PENDING_SIGNAL" > "$MARKER.pending"'
    )
    before = int(time.time())
    status, calls, marker, err = _relay(
        tmp_path, "--nodes=2 --ntasks=4", None, fake, shell="set -u; unset EPOCHSECONDS"
    )
    assert status == 0 and len(calls) == 2, err
    name, _, at = Path(f"{marker}.pending").read_text().strip().partition("@")
    assert name == "SIGUSR2" and before <= int(at) <= time.time() + 1


@pytest.mark.parametrize("spares", ["", "--nodes=2 --ntasks=4"])
def test_a_stop_signal_at_any_moment_of_the_start_reaches_the_step_and_never_ends_the_job(
    tmp_path: Path, spares: str
) -> None:
    """USR2 to the batch shell every 20 ms from the relay's lines on (the second line of the batch script; a
    preemption as the job starts), through a setup of 0.3 s (a module load), under a site template's
    set -euo pipefail: the batch step is never ended by it, and the step gets it, through
    HPC_TRAIN_PENDING_SIGNAL or as a USR2 to its srun. The fake srun catches USR2 only 0.5 s after it started,
    as a real srun has its handlers in only once it runs: a USR2 before that ends it (relay.takes_usr2; the bash
    relay sent it at once, and the step never started)."""
    folder, bin_dir = tmp_path / "submitit", tmp_path / "bin"
    folder.mkdir()
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(
        f'#!/bin/bash\nsleep 0.5\ngot=""\ntrap \'got=USR2\' USR2\necho "pending=${{HPC_TRAIN_PENDING_SIGNAL:-}}" > {tmp_path}/seen\n'
        f'for i in $(seq 20); do sleep 0.05; done\necho "got=$got" >> {tmp_path}/seen\n'
    )
    (bin_dir / "srun").chmod(0o755)
    export = f"export HPC_TRAIN_STEP_ARGS='{spares}'\n" if spares else ""
    relay = "\n".join(sbatch.relay_lines())
    script = f"set -euo pipefail\n{relay}\n: > {tmp_path}/started\nsleep 0.3\n{export}srun python x {folder}\n"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "77"}
    for _ in range(3):  # a signal in bash's or in relay.py's first ms each time: the timing varies
        (tmp_path / "seen").unlink(missing_ok=True)
        (tmp_path / "started").unlink(missing_ok=True)
        proc = subprocess.Popen(["bash", "-c", script], env=env, stderr=subprocess.PIPE, text=True)
        wait_until(lambda: (tmp_path / "started").exists() or proc.poll() is not None, 10, "the batch script's start")
        while proc.poll() is None:
            proc.send_signal(signal.SIGUSR2)
            time.sleep(0.02)
        err = proc.stderr.read() if proc.stderr else ""
        assert proc.returncode == 0, (proc.returncode, err)
        seen = (tmp_path / "seen").read_text()
        assert re.search(r"pending=SIGUSR2@\d+|got=USR2", seen), seen


def test_a_failure_after_the_finish_is_on_record_leaves_0_and_decides_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review: a peer gone at the closing barrier (or a copy stuck at the finish) after `finish` was on record went
    down the failure path: a claim, a requeue decision, a finished run requeued (or its job FAILED). The attempt's
    finish on record: FINISHED, exit 0, no claim; another attempt's finish does not count."""
    from types import SimpleNamespace

    from hpc_train.paths import RunPaths
    from hpc_train.verdict import Verdict

    paths = RunPaths(tmp_path)
    env = SimpleNamespace(job_id="7", restart_count=1, world_size=2, rank=1, executor="slurm")
    journal.log(tmp_path, journal.FINISH, 9, "7", 0, final_step=9)  # attempt 0's: not this one
    monkeypatch.setattr(deadlines, "VERDICT_WAIT_S", 0.2)
    paths.failure_claim("7", 1).touch()  # so that the path that does not know of the finish waits, then gives up
    assert failure.after_failure(paths, env, Task(), RuntimeError("peer gone")) == ("", 0.0)
    paths.failure_claim("7", 1).unlink()
    journal.log(tmp_path, journal.FINISH, 10, "7", 1, final_step=10)
    assert failure.after_failure(paths, env, Task(), RuntimeError("peer gone")) == (Verdict.FINISHED, 0.0)
    assert not paths.failure_claim("7", 1).exists()

    def leave(code: int) -> None:
        raise SystemExit(code)

    monkeypatch.setattr(os, "_exit", leave)
    with pytest.raises(SystemExit) as left:
        failure.leave_by(Task(), Verdict.FINISHED, 0.0, env)
    assert left.value.code == 0


def test_the_lease_is_claimed_over_another_jobs_and_refused_to_a_live_one(tmp_path: Path) -> None:
    """Review of the job side's split: a local variable named like the function it called made every claim over
    another job's lease a TypeError (a resume could never train again). Here: another job's lease expired, held by
    a local controller that is gone (taken), or by one alive on this host (refused, the owner's lease returned)."""
    import socket
    from types import SimpleNamespace

    from hpc_train import lease
    from hpc_train.paths import RunPaths

    paths = RunPaths(tmp_path)
    me = SimpleNamespace(job_id="222", executor="local")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = socket.gethostname()
    paths.lease.write_text(json.dumps({"job_id": str(dead.pid), "host": host, "renewed_at": 0, "expires_at": 1}))
    assert lease.claim(paths, me) is None and lease.read(paths)["job_id"] == "222"
    now = time.time()
    live = {"job_id": str(os.getpid()), "host": host, "renewed_at": now, "expires_at": now + 180}
    paths.lease.write_text(json.dumps(live))
    assert lease.claim(paths, me) == live and lease.read(paths) == live
