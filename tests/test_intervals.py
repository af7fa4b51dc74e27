"""checkpoint.every_steps=auto (intervals.py): what a run measured and the site's rates into the goodput model's
intervals. Seeded random facts hold the choice's invariants; one Attempt on one gloo rank chooses at its resume,
saves once at the first interval, and chooses again from that save's cost."""

from __future__ import annotations

import dataclasses
import random
import time
from pathlib import Path

import pytest
from conftest import names

from hpc_train import history, intervals, journal
from hpc_train.config import CheckpointConfig
from hpc_train.paths import RunPaths


def rates(faults: int, node_hours: float = 20_000.0) -> history.Rates:
    return history.Rates(node_failures=faults, failures=faults // 4, node_hours=node_hours, jobs=50, source="sacct")


def commit(step: int, stall_s: float, save_s: float) -> dict:
    fields = {"reason": "periodic", "stall_s": stall_s, "save_s": save_s, "waited_s": 0.0}
    return {"time": 1000.0 + step, "event": journal.CHECKPOINT_COMMITTED, "step": step, "restart": 0, **fields}


def test_nothing_measured_keeps_the_first_interval_and_says_so() -> None:
    ck = CheckpointConfig(every_steps="auto", memory_every_steps="auto")
    choice = intervals.choose(ck, intervals.Measured(), rates(5), nodes=4, spares=True)
    assert (choice.every_steps, choice.memory_every_steps, choice.provisional) == (20, 5, True)
    fixed = intervals.choose(CheckpointConfig(every_steps=7), intervals.Measured(0.5, (1.0, 0.0)), rates(5), 4, False)
    assert fixed.every_steps == 7  # a number the user gave is kept


def test_measured_reads_periodic_commits_and_the_attempts_own_times() -> None:
    events = [commit(20, 0.5, 3.5), commit(40, 0.7, 2.7), {**commit(41, 9.0, 9.0), "reason": "stop"}]
    m = intervals.measured(events, [0.2, 0.3, 0.25, 0.0], [(0.1, 0.0), (0.2, 1.5)])
    assert m.step_s == 0.25 and m.disk == (0.6, 2.5) and m.memory == (0.2, 1.5)  # medians; a stop save not a sample


def test_a_resume_takes_the_step_time_and_copy_the_last_choice_rested_on() -> None:
    """An attempt that timed no step yet chooses from the last measured choice's inputs (not 20 steps again); its
    own step times, once it has them, win; a provisional choice's inputs are no measure."""
    memory = {"save_s": 0.1, "write_s": 1.0, "faults_per_h": 1.0, "restart_s": 7.0}
    before = {"time": 1030.0, "event": journal.INTERVAL, "step": 20, "restart": 0, "provisional": False}
    before["inputs"] = {"step_s": 0.5, "memory": memory}
    events = [commit(20, 0.5, 3.5), before, {**before, "provisional": True, "inputs": {"step_s": 9.0}}]
    m = intervals.measured(events, [], [])
    assert (m.step_s, m.disk, m.memory) == (0.5, (0.5, 3.0), (0.1, 1.0))
    assert intervals.measured(events, [0.2], [(0.3, 2.0)]).step_s == 0.2
    ck = CheckpointConfig(every_steps="auto", memory_every_steps="auto")
    borrowed = intervals.choose(ck, m, rates(5), nodes=4, spares=True)
    assert borrowed.provisional and borrowed.every_steps != 20  # chosen from it, and again once timed here
    own = intervals.measured(events, [0.2], [(0.3, 2.0)])
    assert not intervals.choose(ck, own, rates(5), nodes=4, spares=True).provisional
    assert intervals.measured([commit(20, 0.5, 3.5)], [], []).step_s is None


@pytest.mark.parametrize("seed", range(30))
def test_the_choice_holds_its_invariants_on_random_facts(seed: int) -> None:
    """More unannounced faults never lengthen the interval; a costlier save never shortens it; a memory copy is
    never rarer than the disk save; every interval is at least one step and the write."""
    rng = random.Random(seed)
    step_s = rng.choice([0.01, 0.2, 1.0, 5.0])
    save, write = rng.uniform(0.05, 60), rng.choice([0.0, rng.uniform(0.1, 120)])
    m = intervals.Measured(step_s, (save, write), (save / 10, write / 10), rng.uniform(5, 300))
    ck = CheckpointConfig(every_steps="auto", memory_every_steps=rng.choice([0, "auto"]))
    nodes, spares = rng.choice([1, 2, 8, 64]), rng.random() < 0.5
    few, many = rates(rng.randint(0, 3)), rates(rng.randint(20, 400))
    a, b = (intervals.choose(ck, m, r, nodes, spares) for r in (few, many))
    assert not a.provisional and b.every_steps <= a.every_steps, (a, b)
    costlier = intervals.choose(ck, dataclasses.replace(m, disk=(save * 4, write)), many, nodes, spares)
    assert costlier.every_steps >= b.every_steps
    for c in (a, b, costlier):
        assert c.every_steps >= max(1, int(write / step_s))
        assert c.memory_every_steps <= c.every_steps or ck.memory_every_steps == 0
        assert "every" in c.why and c.inputs["rates"]


def test_a_fault_heavy_history_saves_more_often_than_a_clean_one() -> None:
    """The issue's figure: the same run, the same save cost, two sites' histories."""
    ck, m = CheckpointConfig(every_steps="auto"), intervals.Measured(1.0, (2.0, 0.0), None, 60.0)
    heavy, clean = (intervals.choose(ck, m, rates(n), nodes=4, spares=False) for n in (400, 2))
    assert heavy.every_steps < clean.every_steps / 5, (heavy, clean)
    assert heavy.why.startswith(f"every {heavy.every_steps} steps: save 2")


def test_an_attempt_chooses_at_its_resume_and_again_after_its_first_save(tmp_path: Path) -> None:
    """One gloo rank: every_steps=auto saves first at step 20 (provisional, on record), then chooses from that
    save's cost, the step time it measured and the rates submit froze (history.json), on record again."""
    import torch.distributed as dist

    from hpc_train.attempt import Attempt
    from hpc_train.checkpoint import TrainState
    from hpc_train.config import RunConfig
    from hpc_train.env import RankEnv
    from hpc_train.paths import RunPaths

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        cfg = RunConfig()
        cfg.checkpoint = CheckpointConfig(every_steps="auto", async_save=False)
        intervals.write_rates(RunPaths(tmp_path).history, rates(400, 100.0), private=True)  # 5 faults an hour
        env = RankEnv("local", 0, 0, 1, 1, 0, 1, ("127.0.0.1",), "127.0.0.1", 0, "1", 0)
        at = Attempt.build(env, cfg, RunPaths(tmp_path), time.time(), {})
        import torch

        model = torch.nn.Linear(4, 4)
        state = TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
        at.resume(state)
        assert at.every_steps == 20
        while state.step < 60:
            state.step += 1
            time.sleep(0.01)
            at.step_end(state, 200)
        chosen = journal.named(journal.read(tmp_path), journal.INTERVAL)
        assert [c["provisional"] for c in chosen] == [True, False], chosen
        assert chosen[1]["step"] == 20 and chosen[1]["every_steps"] == at.every_steps
        assert chosen[1]["inputs"]["disk"]["faults_per_h"] > 4 and at.every_steps != 20
        # the next attempt (a resume) starts at that interval: what the first measured, not 20 steps again
        again = Attempt.build(env, cfg, RunPaths(tmp_path), time.time(), {})
        again.resume(TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1)))
        resumed = journal.named(journal.read(tmp_path), journal.INTERVAL)[-1]
        # ... chosen again after its own first save (its step time, perhaps at another size, is its own then)
        assert resumed["provisional"] is True and again.every_steps == resumed["every_steps"] != 20, resumed
        assert resumed["inputs"]["step_s"] == chosen[-1]["inputs"]["step_s"]
    finally:
        dist.destroy_process_group()


def test_the_forecast_says_the_goodput_where_it_comes_from_and_what_would_change_it_most() -> None:
    """Issue 30 D3: before submit, the expected goodput of this run at its size on its partition with its intervals,
    the site's history it rests on, and the one or two alternatives that would change it most (a spare node's idle
    hours counted against it), each with the overrides that make it."""
    from hpc_train.config import compose, to_run_config

    cfg = to_run_config(compose(["cluster=dev", "cluster.nodes=4", "checkpoint.every_steps=20"]))
    m = intervals.Measured(1.0, (2.0, 10.0), (0.2, 1.0), 60.0)
    heavy = intervals.forecast_lines(cfg.checkpoint, cfg.cluster, rates(400, 200.0), m)
    assert heavy[0].startswith("forecast: expected goodput ") and heavy[0].endswith("on debug at 4 node(s)")
    assert heavy[1].startswith("  the site: 1 unannounced fault per ")
    alternatives = [line for line in heavy if line.startswith("  with ")]
    now = float(heavy[0].split("expected goodput ")[1].split("%")[0])

    def change(line: str) -> float:
        return abs(float(line.split("expected goodput ")[1].split("%")[0]) - now)

    # the two that change it most of three (hot spares with the memory tier, auto intervals, half the nodes)
    auto = intervals.expected(dataclasses.replace(cfg.checkpoint, every_steps="auto"), m, rates(400, 200.0), 4, False)
    assert len(alternatives) == 2 and min(map(change, alternatives)) >= abs(auto.goodput * 100 - now) - 0.05
    assert auto.goodput * 100 >= now - 0.05  # the auto interval never does worse than the one given


def test_report_and_status_say_the_interval_and_the_forecast_beside_the_outcome(tmp_path: Path) -> None:
    """Issue 30 D1, D3: status and report say the auto interval and why; report puts what submit forecast (frozen in
    history.json) beside the goodput the run had."""
    import json
    import subprocess
    import sys

    from hpc_train.paths import RunPaths

    run_dir = tmp_path / "auto-1"
    run_dir.mkdir()
    from omegaconf import OmegaConf

    from hpc_train.config import compose
    from hpc_train.submit import frozen_yaml

    config = OmegaConf.to_container(compose(["checkpoint.every_steps=auto"]), resolve=True)
    (run_dir / "config.yaml").write_text(frozen_yaml(config))  # as submit froze it
    (run_dir / "submission.json").write_text(json.dumps({"executor": "local", "job_id": "77"}))
    why = "every 376 steps: save 2.1 s, 1 unannounced fault per 9.4 h, restart 120 s"
    events = [
        {"time": 100.0, "event": "start", "step": 0, "job_id": "77", "restart": 0, "launched_at": 90.0},
        {"time": 101.0, "event": "first_step", "step": 1, "job_id": "77", "restart": 0, "step_time_s": 0.5},
        {"time": 130.0, "event": "interval", "step": 20, "job_id": "77", "restart": 0, "why": why, "every_steps": 376},
        {"time": 150.0, "event": "requeue", "step": 300, "job_id": "77", "restart": 0, "reason": "preempt"},
        {"time": 170.0, "event": "start", "step": 300, "job_id": "77", "restart": 1, "launched_at": 165.0},
        {"time": 200.0, "event": "finish", "step": 400, "job_id": "77", "restart": 1},
    ]
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    said = ["forecast: expected goodput 97.7% (saves 0.6%, lost work 0.6%, restarts 1.2%) on low at 4 node(s)"]
    intervals.write_rates(RunPaths(run_dir).history, rates(3), private=True, forecast=said)
    hpc_train = str(Path(sys.executable).parent / "hpc-train")
    report = subprocess.run([hpc_train, "report", str(run_dir)], capture_output=True, text=True, check=True).stdout
    (chosen,) = [line for line in report.splitlines() if why in line]  # the interval's event, as it said it
    assert names(chosen, "checkpoint interval", "auto", "at step 20")
    # the run's goodput of its wall time, as the forecast is: committed / (allocated + queue wait)
    parts = journal.goodput(journal.read(run_dir), [])
    assert parts["queue_wait"] > 0
    wall = f"{parts['committed'] / (parts['allocated'] + parts['queue_wait']):.1%}"
    (compared,) = [line for line in report.splitlines() if said[0] in line]  # the forecast beside the run's own
    assert names(compared, "at submit", f"goodput {wall}", "wall time")
    status = subprocess.run([hpc_train, "status", str(run_dir)], capture_output=True, text=True, check=True).stdout
    (line,) = [line for line in status.splitlines() if "checkpoint interval" in line]
    assert names(line, "auto-1", "(auto)", "every 376 steps")


def test_a_memory_tier_that_is_off_never_keeps_the_disk_interval_provisional() -> None:
    """Review: memory_every_steps=auto with the tier off in this attempt (no memory_dir, one node) never measured a
    copy, so the disk interval stayed at its first 20 steps and was chosen again (an event) at every commit."""
    ck = CheckpointConfig(every_steps="auto", memory_every_steps="auto")
    m = intervals.Measured(1.0, (2.0, 0.0), None, 60.0)
    off = intervals.choose(ck, m, rates(400, 200.0), nodes=4, spares=False)  # the Attempt: spares and the tier on
    assert not off.provisional and off.every_steps != 20
    assert intervals.choose(ck, m, rates(400, 200.0), nodes=4, spares=True).provisional  # on: a copy to measure


def test_stops_whose_save_does_not_fit_count_as_faults() -> None:
    """Review: on a preemptible partition (30 s of grace) a save that blocks 5 s and writes 100 s cannot be made at a
    stop (Saver.stop skips it), yet auto chose an interval of ~1.8 h from unannounced faults alone: every
    preemption lost up to that much. Such stops count as faults of the disk tier, and the interval shortens."""
    ck = CheckpointConfig(every_steps="auto")
    m = intervals.Measured(1.0, (5.0, 100.0), None, 60.0)
    preempted = dataclasses.replace(rates(5), preemptions=20_000)  # one preemption per node-hour
    fits = intervals.choose(ck, m, preempted, nodes=4, spares=False, stop_budgets_s={"preemptions": 300.0})
    lost = intervals.choose(ck, m, preempted, nodes=4, spares=False, stop_budgets_s={"preemptions": 30.0})
    assert lost.inputs["lost_kinds"] == ["preemptions"] and "lost_kinds" not in fits.inputs
    assert lost.every_steps * 1.0 < 3600 / 4 < fits.every_steps, (lost.every_steps, fits.every_steps)


def test_each_kind_of_stop_is_judged_by_what_it_leaves_for_its_save() -> None:
    """Review: time limits were judged against the preemption's grace (min of the two): a save of 5 + 60 s with the
    default 30 s grace made every time limit a fault, though a time-limit stop has the lead less the reserve."""
    from hpc_train import deadlines
    from hpc_train.sbatch import ClusterConfig

    ck = CheckpointConfig(every_steps="auto")
    m = intervals.Measured(1.0, (5.0, 60.0), None, 60.0)
    limits = dataclasses.replace(rates(5), time_limits=20_000)  # time limits only, one per node-hour
    cluster = ClusterConfig(preempt_grace_s=30, signal_lead_s=120)
    budgets = intervals.stop_budgets(cluster, deadlines.REQUEUE_RESERVE_S)
    assert budgets == {"preemptions": 30.0, "requeues": 30.0, "time_limits": 120 - deadlines.REQUEUE_RESERVE_S}
    chosen = intervals.choose(ck, m, limits, nodes=4, spares=False, stop_budgets_s=budgets)
    assert "lost_kinds" not in chosen.inputs  # 65 s fit in the 85 s a time limit leaves
    preempted = dataclasses.replace(rates(5), preemptions=20_000)
    assert intervals.choose(ck, m, preempted, 4, False, budgets).inputs["lost_kinds"] == ["preemptions"]
    # the forecast charges the time limits a stop save and a restart, not lost work
    f = intervals.expected(ck, m, limits, 4, False, budgets)
    assert f.lost_work < intervals.expected(ck, m, limits, 4, False, {"time_limits": 30.0}).lost_work


@pytest.mark.parametrize("key", ["every_steps", "memory_every_steps"])
def test_auto_for_a_script_is_refused_with_the_key_named(key: str) -> None:
    """A script saves when it decides: auto would change nothing of it, and a user who set it would believe it did."""
    from hpc_train import script

    config = {
        "script": {"cmd": ["python", "-c", "pass"], "resume_args": [], "checkpoint": ""},
        "checkpoint": {key: "auto"},
    }
    with pytest.raises(ValueError, match=f"checkpoint.{key}=auto"):
        script.check(config, "/tmp/run")
    script.check({**config, "checkpoint": {key: 50}}, "/tmp/run")  # a number is the script's business too: kept


def test_a_forecast_that_fails_keeps_the_site_rates_for_the_job(monkeypatch: pytest.MonkeyPatch) -> None:
    """Review: one `try` around the rates and the forecast: another run's odd metrics row made the forecast fail, and
    the good rates went with it (no history.json: the job took the defaults)."""
    from types import SimpleNamespace

    from hpc_train import plan
    from hpc_train.config import RunConfig

    seen = rates(9)
    monkeypatch.setattr(history, "site_rates", lambda *a, **k: seen)

    def broken(runs_dir: Path) -> None:
        raise TypeError("'<' not supported between instances of 'NoneType' and 'float'")

    monkeypatch.setattr(intervals, "project_measured", broken)
    got, said, expected = plan._site_rates(SimpleNamespace(runs=[RunConfig()]), time.time())  # type: ignore[arg-type]
    assert got is seen and expected == {} and said[0].startswith("forecast: none (TypeError")


def test_a_plain_runs_parent_made_to_look_like_a_sweep_by_another_hand_is_not_read(tmp_path: Path) -> None:
    """Review: a run without its own history.json read its parent's whenever the parent had a sweep.json; in a
    group-writable out_dir another user could set its intervals (0 faults: every 604,800 steps)."""
    out = tmp_path / "runs"
    run_dir = out / "mine-1"
    run_dir.mkdir(parents=True, mode=0o700)
    (out / "sweep.json").write_text("{}")
    intervals.write_rates(out / "history.json", rates(0, 10_000.0), private=False)
    out.chmod(0o770)  # a shared out_dir: the group writes it
    assert intervals.read_rates(RunPaths(run_dir).history, run_dir) == history.DEFAULTS
    out.chmod(0o700)  # a sweep's own folder: its history is the trial's
    assert intervals.read_rates(RunPaths(run_dir).history, run_dir).node_hours == 10_000.0


def test_a_sweep_over_partitions_gives_each_trial_its_own_partitions_history(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review: a sweep over cluster.partition froze trial 0's rates and forecast for every trial, so a trial on a
    clean partition saved as often as one on a fault-heavy one. Submit asks one sacct per partition (its first
    trial's size) and history.json keeps each other partition's record; a trial reads its own partition's."""
    from types import SimpleNamespace

    from hpc_train import plan
    from hpc_train.config import RunConfig

    base = RunConfig()
    on = {p: dataclasses.replace(base, cluster=dataclasses.replace(base.cluster, partition=p)) for p in ("low", "high")}
    sweep = SimpleNamespace(runs=[on["low"], on["high"], on["low"], on["high"]])
    asked = plan._accounting_calls(sweep, time.time())  # type: ignore[arg-type]
    assert [[a for a in call if a.startswith("--partition=")] for call in asked] == [
        ["--partition=low"],
        ["--partition=high"],
    ], asked
    site = {"low": rates(400, 200.0), "high": rates(0, 20_000.0)}
    monkeypatch.setattr(history, "site_rates", lambda partition, nodes, **k: site[partition])
    monkeypatch.setattr(intervals, "project_measured", lambda runs_dir: intervals.ASSUMED)
    low, said, expected = plan._site_rates(sweep, time.time())  # type: ignore[arg-type]
    elsewhere = plan._elsewhere(sweep, time.time())  # type: ignore[arg-type]
    assert low is site["low"] and list(elsewhere) == ["high"] and names(elsewhere["high"]["forecast"][0], "on high")

    folder = tmp_path / "both-1"
    folder.mkdir(mode=0o700)
    (folder / "sweep.json").write_text("{}")
    intervals.write_rates(folder / "history.json", low, True, said, expected, elsewhere)
    read = {}
    for i, partition in enumerate(["low", "high", "other"]):
        trial = folder / f"{i:04d}"
        trial.mkdir()
        (trial / "config.yaml").write_text(f"cluster:\n  executor: slurm\n  partition: {partition}\n")
        read[partition] = intervals.read_rates(RunPaths(trial).history, trial).node_hours
        forecast = intervals.forecast_expected(RunPaths(trial).history, trial)
        assert forecast is not None and intervals.forecast_said(RunPaths(trial).history, trial)
        if partition == "high":  # no fault in 20,000 node-hours: the clean partition's forecast, not low's
            assert forecast.restarts < expected["restarts"] / 100 < forecast.goodput - expected["goodput"], forecast
    assert read == {"low": 200.0, "high": 20_000.0, "other": 200.0}  # a partition not asked: trial 0's


def test_a_partition_whose_history_cannot_be_read_keeps_the_others(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Review: a partition whose sacct failed was left out of history.json, so its trials read trial 0's rates; and
    when trial 0's failed no history.json was written, the other partitions' good records lost with it."""
    from types import SimpleNamespace

    from hpc_train import plan, submit
    from hpc_train.config import RunConfig

    base = RunConfig()
    on = {p: dataclasses.replace(base, cluster=dataclasses.replace(base.cluster, partition=p)) for p in ("low", "high")}

    def site_rates(partition: str, nodes: int, **_: object) -> history.Rates:
        if partition == "low":
            raise history.slurm.SlurmError("`sacct ...` did not answer within 10 s")
        return rates(0, 20_000.0)

    monkeypatch.setattr(history, "site_rates", site_rates)
    monkeypatch.setattr(intervals, "project_measured", lambda runs_dir: intervals.ASSUMED)
    sweep = SimpleNamespace(runs=[on["high"], on["low"]])
    elsewhere = plan._elsewhere(sweep, time.time())  # type: ignore[arg-type]
    assert elsewhere["low"]["rates"] == dataclasses.asdict(history.DEFAULTS)
    assert names(elsewhere["low"]["forecast"][0], "forecast: none", "SlurmError", "did not answer")

    got, said, expected = plan._site_rates(SimpleNamespace(runs=[on["low"], on["high"]]), time.time())  # type: ignore[arg-type]
    high = plan._elsewhere(SimpleNamespace(runs=[on["low"], on["high"]]), time.time())  # type: ignore[arg-type]
    folder = tmp_path / "both-1"
    folder.mkdir(mode=0o700)
    (folder / "sweep.json").write_text("{}")
    frozen = SimpleNamespace(rates=got, forecast=said, expected=expected, elsewhere=high, private=True)
    submit._freeze_rates(folder, frozen)  # type: ignore[arg-type]
    trial = folder / "0001"
    trial.mkdir()
    (trial / "config.yaml").write_text("cluster:\n  executor: slurm\n  partition: high\n")
    assert got is None and intervals.read_rates(RunPaths(trial).history, trial).node_hours == 20_000.0
