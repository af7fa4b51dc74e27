"""The requeue decision as data (decision.decide, pure): seeded facts of every kind through it, and what must always
hold of the decision that comes out; then requeue.apply's fallbacks, with Slurm's two calls faked (the real ones run
in the dev-cluster tests: test_in_job, test_elastic, test_slurm_preempt)."""

from __future__ import annotations

import copy
import functools
import random
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import names

from hpc_train import decision, journal, requeue, slurm
from hpc_train.config import compose, to_run_config
from hpc_train.decision import Action
from hpc_train.paths import RunPaths

REASONS = ("failure", "node_health", "preempt", "time_limit")
FATES = ("running", "unknown", "requeued", "cancelled", "batch_host_lost")
CONFIGS = [
    ["cluster=dev", "cluster.nodes=2"],
    ["cluster=dev", "cluster.nodes=3", "cluster.min_nodes=1"],
    ["cluster=dev", "cluster.nodes=2", "cluster.spare_nodes=1"],
    ["cluster=dev", "cluster.nodes=2", "cluster.spare_nodes=2", "cluster.min_nodes=1"],
    ["cluster=dev", "cluster.nodes=2", "cluster.spare_nodes=1", "cluster.in_process_restart=true"],
    ["cluster=local"],
]


@functools.cache
def composed(overrides: tuple[str, ...]) -> object:
    return to_run_config(compose(list(overrides)))  # ~0.1 s each: once per config, not per draw


def ev(name: str, restart: int, step: int, **f: object) -> dict:
    return {"time": 1000.0 + restart, "event": name, "step": step, "restart": restart, "job_id": "7", **f}


def random_facts(rng: random.Random, cfg: object, executor: str) -> decision.Facts:
    """A run's history (commits, failure and stop requeues, left-out nodes, in-job restarts, a resume raising a
    budget) and one moment's facts of Slurm, drawn at random."""
    pool = [f"n{i}" for i in range(1, 7)]
    events: list[dict] = [ev(journal.START, 0, 0, startup_s=rng.uniform(1, 60))]
    step = attempt = 0
    for _ in range(rng.randint(0, 12)):
        kind = rng.random()
        if kind < 0.25:
            step += rng.randint(1, 5)
            events.append(ev(journal.CHECKPOINT_COMMITTED, attempt, step))
        elif kind < 0.5:
            events.append(
                ev(journal.REQUEUE, attempt, step, reason=rng.choice(REASONS), by=rng.choice(["hpc_train", "slurm"]))
            )
            attempt += 1
        elif kind < 0.65:
            events.append(ev(journal.NODE_EXCLUDED, attempt, step, node=rng.choice(pool), why="Xid 79"))
        elif kind < 0.75:
            events.append(ev(journal.EXCLUDE_NODES, attempt, step, nodes="", ok=rng.random() < 0.5))
        elif kind < 0.9:
            events.append(ev(journal.IN_JOB_RESTART, attempt, step, left_out=[]))
            attempt += 1
        else:
            events.append(ev(journal.RESUME, attempt, step, budgets={"max_failures": rng.randint(0, 4)}))
    job_nodes = rng.sample(pool, k=rng.randint(1, 5))
    sick = {n: "Xid 79" for n in rng.sample(job_nodes, k=rng.randint(0, min(2, len(job_nodes))))} or None
    budgets = dataclass_replace(cfg.requeue, journal.budget_changes(events))  # type: ignore[attr-defined]
    reason = rng.choice(REASONS)
    queue = rng.choice(
        [None, decision.Queue(error="squeue did not answer"), decision.Queue({n: "idle" for n in pool}, [])]
    )
    inside = decision.Inside(
        job_nodes,
        left_s=rng.choice([float("inf"), rng.uniform(0, 900)]),
        relay_silent_s=rng.choice([0.0, 0.0, 45.0]),
        our_step=rng.random() < 0.8,
        scontrol=rng.random() < 0.9,
    )
    return decision.Facts(
        reason,
        reason in ("time_limit", "preempt"),
        events,
        rng.choice(FATES),
        budgets,
        rng.choice([None, slurm.Allocation("RUNNING", job_nodes, job_nodes[0])]),
        sick,
        rng.choice([[], [], ["SIGUSR2"], ["SIGTERM"]]),
        executor=executor,
        job_id="7",
        nodes=tuple(job_nodes),
        spare=rng.choice([None, 0, 1, 3]),
        queue=queue if executor == "slurm" else None,
        inside=inside if rng.random() < 0.9 else None,
        now=1000.0,
    )


def dataclass_replace(budgets: object, changes: dict) -> object:
    import dataclasses

    return dataclasses.replace(budgets, **changes)  # type: ignore[type-var]


def check(f: decision.Facts, cfg: object, d: decision.Decision) -> None:
    """What every decision must hold, whatever the facts."""
    c = cfg.cluster  # type: ignore[attr-defined]
    before = journal.excluded_nodes(f.events)
    sick = f.sick or {}
    if f.fate == "cancelled":
        assert d.action == Action.STOP and "cancelled" in d.why
    if f.fate == "requeued":
        assert d.action in (Action.SLURM, Action.STOP)
    if d.action == Action.STOP:
        assert d.why, "a stop says why"
    if d.action in (Action.RELAUNCH, Action.REJOIN):
        # only in place of a failure's requeue of a hot-spares job Slurm still runs, without a stop signal
        assert c.spare_nodes and f.executor == "slurm" and not f.stopping and not f.signals
        assert f.reason in ("failure", "node_health") and f.fate in ("running", "unknown")
        assert journal.in_job_restarts_in_a_row(f.events) < f.budgets.max_in_job_restarts
        assert f.inside is not None and d.fallback is not None
        assert d.fallback.action in (Action.REQUEUE, Action.RELAUNCH, Action.STOP)
    if d.action == Action.RELAUNCH:
        assert f.inside is not None and f.inside.our_step and not f.inside.relay_silent_s
        args = dict(a.lstrip("-").split("=") for a in d.srun_args.split())
        left_out = args.get("exclude", "").split(",") if "exclude" in args else []
        assert set(left_out) <= set(f.inside.job_nodes) and list(d.excluded) == left_out
        n = int(args["nodes"])
        healthy = len(set(f.inside.job_nodes) - set(left_out))
        assert (c.min_nodes or c.nodes) <= n <= healthy and int(args["ntasks"]) == n * c.tasks_per_node
        assert d.records[-1][0] == journal.IN_JOB_RESTART and d.records[-1][1]["srun_args"] == d.srun_args
        assert f.inside.left_s >= journal.startup_s(f.events) + c.signal_lead_s
    if d.action in (Action.REQUEUE, Action.SLURM):
        # the left-out nodes grow by the sick ones, or stay; never past the budget unless they were already
        assert set(before) <= set(d.excluded) <= set(before) | set(sick)
        grown = set(d.excluded) - set(before)
        assert not grown or (len(d.excluded) <= f.budgets.max_excluded_nodes and f.executor == "slurm")
        assert not d.size or f.queue is not None
        if d.reason == "failure" and f.fate != "requeued" and f.budgets.max_failures != -1:
            assert journal.failures_in_a_row(f.events) < f.budgets.max_failures
        if f.fate != "requeued" and d.reason in journal.BUDGET_KEYS and d.reason != "failure":
            limit = getattr(f.budgets, journal.BUDGET_KEYS[d.reason])
            assert limit == -1 or journal.requeues_counted(f.events, d.reason) < limit
    named = [r[1].get("node") for r in d.records if r[0] == journal.NODE_EXCLUDED]
    assert set(named) <= set(sick) and len(named) == len(set(named)), d.records
    if d.fallback is not None:
        check(f, cfg, d.fallback)


@pytest.mark.parametrize("seed", range(60))
def test_every_decision_holds_whatever_the_facts(seed: int) -> None:
    """Seeded facts of every kind through decide: the invariants of `check` hold for the decision and its fallbacks,
    the facts are not changed, and the same facts give the same decision (pure)."""
    rng = random.Random(seed)
    for _ in range(40):
        overrides = rng.choice(CONFIGS)
        cfg = composed(tuple(overrides))
        executor = "local" if "cluster=local" in overrides else "slurm"
        f = random_facts(rng, cfg, executor)
        kept = copy.deepcopy(f)
        d = decision.decide(f, cfg)
        check(f, cfg, d)
        assert f == kept and decision.decide(f, cfg) == d


def failure_facts(cfg: object, sick: dict[str, str] | None, signals: list[str], **kw: object) -> decision.Facts:
    """A failure of a 3-node hot-spares job Slurm still runs, its relay alive (kw: the Inside's fields)."""
    nodes = ["n1", "n2", "n3"]
    spare = kw.pop("spare", None)
    return decision.Facts(
        "failure",
        False,
        [],
        "running",
        cfg.requeue,  # type: ignore[attr-defined]
        slurm.Allocation("RUNNING", nodes, "n1"),
        sick,
        signals,
        job_id="7",
        nodes=tuple(nodes),
        spare=spare,  # type: ignore[arg-type]
        inside=decision.Inside(nodes, float("inf"), **kw),  # type: ignore[arg-type]
        now=time.time(),
    )


def test_a_relaunch_whose_marker_cannot_be_written_takes_its_fallback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """requeue.apply: the marker's folder gone (a full or lost disk) turns the relaunch into its fallback's requeue,
    said, with the sick node left out by that requeue's records, not the relaunch's (none written)."""
    cfg = to_run_config(compose(["cluster=dev", "cluster.nodes=2", "cluster.spare_nodes=1"]))
    nodes = ["n1", "n2", "n3"]
    f = failure_facts(cfg, {"n2": "Xid 79"}, [], spare=2)
    d = decision.decide(f, cfg)
    assert d.action == Action.RELAUNCH and d.srun_args == "--nodes=2 --ntasks=4 --exclude=n2"
    assert d.fallback is not None and d.fallback.action == Action.REQUEUE and d.fallback.excluded == ("n2",)
    monkeypatch.setenv("SUBMITIT_FOLDER", str(tmp_path / "gone"))
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    asked: list[str] = []
    monkeypatch.setattr(slurm, "requeue", lambda job_id, policy: asked.append("requeue") or "")
    monkeypatch.setattr(slurm, "update_job", lambda job_id, fields: asked.append(f"update {fields}") or "")
    monkeypatch.setattr(slurm, "node_states", lambda partition, policy: {})
    recorded: list[tuple[str, dict]] = []
    env = SimpleNamespace(executor="slurm", job_id="7", restart_count=0, nodes=tuple(nodes))
    verdict = requeue.apply(RunPaths(tmp_path), env, cfg, f, d, lambda name, **k: recorded.append((name, k)))
    assert verdict == "requeue" and asked == ["requeue", "update {'ExcNodeList': 'n2'}"]
    assert [name for name, _ in recorded] == [journal.NODE_EXCLUDED, journal.EXCLUDE_NODES, journal.REQUEUE]
    said = [r.getMessage() for r in caplog.records if r.name == "hpc_train.requeue" and r.levelname == "WARNING"]
    assert any(m.startswith("could not write the relaunch marker") for m in said), said


def test_a_stop_signal_during_gathering_is_the_decisions_and_never_a_relaunch() -> None:
    """The facts hold the Pulse's own list: a SIGTERM recorded before decide runs makes the hot-spares failure a
    requeue (the preemption's stop save and requeue give the allocation back), never a relaunch."""
    cfg = to_run_config(compose(["cluster=dev", "cluster.nodes=2", "cluster.spare_nodes=1"]))
    received: list[str] = []
    f = failure_facts(cfg, None, received)
    assert decision.decide(f, cfg).action == Action.RELAUNCH
    received.append("SIGTERM")
    d = decision.decide(f, cfg)
    assert d.action == Action.REQUEUE and d.said and d.said[0].startswith(decision.NOT_INSIDE + "a stop signal")


def test_gather_asks_only_what_the_decision_can_use(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Review: gather asked the partition's spare nodes (sinfo, up to 21 s), EndTime and the relay (up to 6 s) and an
    elastic queue snapshot whatever the decision, so a stop (cancelled, a budget spent) or a relaunch waited on calls
    it never used. Now: nothing after a stop, no restart's facts after a stop signal, no sinfo for a relaunch."""
    asked: list[str] = []
    fate = ["cancelled"]
    monkeypatch.setattr(slurm, "job_fate", lambda job_id, restarts, policy: fate[0])
    monkeypatch.setattr(slurm, "node_states", lambda partition, policy=None: asked.append("sinfo") or {})
    monkeypatch.setattr(slurm, "queue_snapshot", lambda *a: asked.append("squeue") or ({}, []))
    monkeypatch.setattr(slurm, "end_time", lambda job_id, timeout_s=3: asked.append("EndTime") or (None, False))
    nodes = ["n1", "n2", "n3"]
    monkeypatch.setattr(slurm, "allocation", lambda job_id, policy: slurm.Allocation("RUNNING", nodes, "n1"))
    monkeypatch.setenv("SLURM_JOB_NODELIST", "n[1-3]")
    for key, value in {
        "SUBMITIT_FOLDER": str(tmp_path),
        "SLURM_JOB_ID": "7",
        "HPC_TRAIN_STEP_ARGS": "--nodes=2",
    }.items():
        monkeypatch.setenv(key, value)
    env = SimpleNamespace(executor="slurm", job_id="7", restart_count=0, nodes=tuple(nodes))
    paths, sick = RunPaths(tmp_path), {"n2": "Xid 79"}
    elastic = composed(("cluster=dev", "cluster.nodes=3", "cluster.min_nodes=1"))
    spares = composed(("cluster=dev", "cluster.nodes=2", "cluster.spare_nodes=1"))

    def gathered(cfg: object, reason: str = "failure", signals: tuple[str, ...] = ()) -> list[str]:
        asked.clear()
        f = requeue.gather(paths, env, cfg, reason, dict(sick), list(signals))
        assert f.queue is None or "squeue" in asked
        return list(asked)

    assert gathered(elastic) == [] and gathered(spares) == []  # cancelled: a stop, nothing more asked
    fate[0] = "running"
    assert gathered(elastic) == ["squeue", "sinfo"]  # a requeue: its size, and the room to leave n2 out
    assert gathered(spares) == ["EndTime"]  # a relaunch: it counts the allocation, not the partition
    assert gathered(spares, signals=("SIGTERM",)) == ["sinfo"]  # a crash inside a preemption's grace: a requeue
    assert gathered(spares, "time_limit", ("SIGUSR2",)) == ["sinfo"]


def test_a_rejoin_that_falls_back_to_a_requeue_says_both_sentences() -> None:
    """Review: the fallback of a rejoin with no relaunch to fall to (srun by hand) replaced the requeue's own sentences
    by the "not restarting" one: a sick node that could not be left out was recorded (node_not_excluded) but not
    said."""
    cfg = composed(("cluster=dev", "cluster.nodes=2", "cluster.spare_nodes=1", "cluster.in_process_restart=true"))
    f = failure_facts(cfg, {"n2": "Xid 79"}, [], spare=0, our_step=False)  # spare 0: n2 cannot be left out
    d = decision.decide(f, cfg)
    assert d.action == Action.REJOIN and d.fallback is not None and d.fallback.action == Action.REQUEUE
    assert [r[0] for r in d.fallback.records] == [journal.NODE_NOT_EXCLUDED]
    assert len(d.fallback.said) == 2 and d.fallback.said[0].startswith(decision.NOT_INSIDE + "this step was not")
    assert names(d.fallback.said[1], "leaving out 1 sick nodes", "too few")


def test_a_requeue_made_inside_the_job_at_the_time_limit_is_recorded_as_such_and_spends_its_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 29: with script.stop_signal=USR1, Lightning's own auto-requeue ran `scontrol requeue` inside the job at
    the time-limit warning, and we recorded Slurm's requeue with no budget spent: a script that requeues itself
    at every warning ran for ever. Slurm never requeues a job for its time limit, so such a requeue is the job's
    own: recorded by="inside_job", counted under requeue.max_time_limit_requeues, and once that is spent the run
    stops and the requeued job is cancelled (scancel faked here; test_slurm_script runs the real one)."""
    from hpc_train import pipeline

    monkeypatch.setattr(slurm, "job_fate", lambda job_id, restarts, policy: "requeued")
    cancelled: list[list[str]] = []
    order: list[str] = []
    monkeypatch.setattr(slurm, "call", lambda args, **k: cancelled.append(args[1:]) or order.append(args[0]) or "")
    monkeypatch.setattr(pipeline, "settle_dependents", lambda *a, **k: order.append("settle") or [])
    env = SimpleNamespace(executor="slurm", job_id="7", restart_count=0, nodes=("n1",))
    paths = RunPaths(tmp_path)
    cfg = composed(("cluster=dev", "cluster.nodes=1", "requeue.max_time_limit_requeues=1"))

    def decided(reason: str) -> str:
        return requeue.requeue_or_stop(paths, env, cfg, reason, 5, signals=["SIGUSR2"])

    assert decided("time_limit") == "requeue" and not cancelled
    first = journal.last(journal.read(tmp_path), journal.REQUEUE)
    assert first is not None and first["by"] == "inside_job" and first["reason"] == "time_limit"
    assert decided("preempt") == "requeue"  # a preempted job Slurm requeues itself: by slurm, no budget
    assert journal.last(journal.read(tmp_path), journal.REQUEUE)["by"] == "slurm"
    assert decided("time_limit") == "stop" and cancelled == [["7"]]  # max_time_limit_requeues=1 spent
    stopped = journal.last(journal.read(tmp_path), journal.STOPPED)
    assert stopped is not None and "time_limit budget spent" in stopped["reason"]
    # Review: the cancel came last, after the dependents' settling (21 s a level): KillWait had ended by then
    assert order == ["scancel", "settle"], order


def test_a_requeue_refused_because_the_job_was_requeued_meanwhile_is_that_requeue(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review: the fate read at the decision said running (or scontrol did not answer in 10 s) while the script
    requeued its job itself; our scontrol requeue was then refused, recorded as requeue_failed, and a time-limit
    stop stopped the run though the job comes back. Read again after the refusal, the requeue is on record."""
    fates = iter(["unknown", "requeued"])
    monkeypatch.setattr(slurm, "job_fate", lambda job_id, restarts, policy: next(fates))
    monkeypatch.setattr(slurm, "requeue", lambda job_id, policy: "Requested operation is presently disabled")
    env = SimpleNamespace(executor="slurm", job_id="7", restart_count=0, nodes=("n1",))
    cfg = composed(("cluster=dev", "cluster.nodes=1"))
    assert requeue.requeue_or_stop(RunPaths(tmp_path), env, cfg, "time_limit", 5, signals=["SIGUSR2"]) == "requeue"
    events = journal.read(tmp_path)
    (requeued,) = journal.named(events, journal.REQUEUE)
    assert requeued["by"] == "inside_job" and not journal.named(events, journal.REQUEUE_FAILED), events
