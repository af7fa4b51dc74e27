"""checkpoint.every_steps=auto and checkpoint.memory_every_steps=auto: what this run measured (a save's cost, the step
time, the start-up) and the site's fault rates (history.py, frozen at submit in history.json, with this run's own
journal) into the goodput model's intervals (planning.py). Pure but for the readers at the bottom; torch-free. The
Attempt chooses at its start and again after its first measured save, and records each choice as an `interval`
event with its inputs (docs/goodput.md).

    hpc-train submit cluster=mysite checkpoint.every_steps=auto
    hpc-train submit cluster=mysite cluster.spare_nodes=1 checkpoint.every_steps=auto checkpoint.memory_every_steps=auto
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpc_train import history, journal, planning
from hpc_train.config import AUTO, CheckpointConfig

RECENT = 5  # a running estimate: the median of the newest saves (a first save pays for warming caches)
# Until this run measured a start-up (journal.startup_s): launch -> first step on the dev cluster was 13-18 s, a
# requeue's start-up on a real site with a large model more; 60 s is on the safe side of both (a longer restart
# never moves the optimum, planning's docstring: it only lowers the forecast)
DEFAULT_STARTUP_S = 60.0


@dataclass(frozen=True)
class Measured:
    """What this run's records say, each None until measured: seconds a step (median), a disk save's blocking and
    background seconds and a memory copy's (running estimates), and the slowest launch to first step."""

    step_s: float | None = None
    disk: tuple[float, float] | None = None  # (save_s: the loop blocked, write_s: the background write after it)
    memory: tuple[float, float] | None = None
    startup_s: float | None = None
    # the step time or copy is an earlier attempt's (a resume, perhaps at another size): chosen from it, and again
    # once this attempt measured its own (after its first save)
    borrowed: bool = False


@dataclass(frozen=True)
class Choice:
    """The intervals in steps for this attempt (a number the user gave is kept as given), the sentence that says
    why, whether a measurement is still missing (then chosen again after the next save), and the inputs."""

    every_steps: int
    memory_every_steps: int
    why: str
    provisional: bool
    inputs: dict[str, Any]


def measured(events: list[journal.Event], step_times_s: list[float], copies: list[tuple[float, float]]) -> Measured:
    """Measured from the run's journal and what the Attempt timed itself (pure): the step time between two
    step_end calls (any training function's, the built-in trainer's too), each memory copy's (blocked, background)
    seconds. A periodic disk save's blocking part is stall_s + waited_s (the snapshot, and the wait at its commit),
    its background part save_s - stall_s (checkpoint.py's checkpoint_committed)."""
    saves = [
        (
            e["stall_s"] + (e.get("waited_s") if _positive(e.get("waited_s")) else 0.0),
            max(0.0, e["save_s"] - e["stall_s"]),
        )
        for e in journal.named(events, journal.CHECKPOINT_COMMITTED)
        if e.get("reason") == "periodic" and _positive(e.get("save_s")) and _seconds(e.get("stall_s"))
    ][-RECENT:]
    steps = [t for t in step_times_s if _positive(t)]
    startup = journal.startup_s(events)
    step_s, copy = _chosen_from(events)
    own_copy = _median_pair([c for c in copies if _positive(c[1])][-RECENT:])
    return Measured(
        statistics.median(steps) if steps else step_s,
        _median_pair(saves),
        own_copy or copy,
        startup or None,
        borrowed=(not steps and step_s is not None) or (own_copy is None and copy is not None),
    )


def _chosen_from(events: list[journal.Event]) -> tuple[float | None, tuple[float, float] | None]:
    """The step time and memory copy the run's last measured choice rested on (its `interval` event's inputs), for an
    attempt that has timed neither yet (a resume): it then saves at the chosen interval from its first step, not
    at the first 20 steps again; (None, None) before any."""
    chosen = [e.get("inputs") for e in journal.named(events, journal.INTERVAL) if e.get("provisional") is False]
    inputs = chosen[-1] if chosen and isinstance(chosen[-1], dict) else {}
    memory = inputs.get("memory") if isinstance(inputs.get("memory"), dict) else {}
    copy = (memory.get("save_s"), memory.get("write_s"))
    step_s = inputs.get("step_s")
    return (step_s if _positive(step_s) else None), (copy if _seconds(copy[0]) and _positive(copy[1]) else None)


def choose(
    ck: CheckpointConfig,
    m: Measured,
    rates: history.Rates,
    nodes: int,
    spares: bool,
    stop_budgets_s: dict[str, float] | None = None,
) -> Choice:
    """The intervals for a run of `nodes` nodes (pure). Unannounced faults only (planning.py): a memory copy
    survives a rank's crash and a node's loss while its buddy lives and a spare relaunches the step inside the
    allocation (`spares`), all but the batch host's node (1 of `nodes`); the disk tier the rest. An announced stop
    is saved at its signal, unless a save and its write do not fit in what a stop of its kind leaves (stop_budgets_s,
    history.ANNOUNCED kind -> s: stop_budgets): then it loses work as a fault does, and counts as one. Until a save
    of a tier is measured that tier keeps config.FIRST_AUTO_STEPS (provisional)."""
    startup = m.startup_s or DEFAULT_STARTUP_S
    per_node = {k: rates.per_node_h(k) for k in history.UNANNOUNCED}
    node_faults, crashes = nodes * per_node["node_failures"], nodes * per_node["failures"]
    with_memory = ck.memory_every_steps not in (0, "0") and spares
    covered = (crashes + node_faults * (1 - 1 / nodes)) if with_memory else 0.0
    disk_faults = crashes + node_faults - covered
    disk_restart = (rates.queue_wait_s or 0.0) + startup
    auto_disk, auto_memory = ck.every_steps == AUTO, ck.memory_every_steps == AUTO
    provisional = (
        m.step_s is None or (auto_disk and m.disk is None) or (auto_memory and with_memory and m.memory is None)
    )
    every, memory_every = ck.steps("every_steps"), ck.steps("memory_every_steps")
    inputs: dict[str, Any] = {"rates": rates.describe(nodes), "step_s": m.step_s, "startup_s": startup}
    if provisional or m.step_s is None:
        why = "a first save to measure (checkpoint.every_steps=auto): then chosen from its cost"
        return Choice(every, memory_every, why, True, inputs)
    save_s, write_s = m.disk if m.disk is not None else (0.0, 0.0)
    budgets = stop_budgets_s or {}
    lost = [k for k in history.ANNOUNCED if getattr(rates, k) and save_s + write_s > budgets.get(k, math.inf)]
    if lost:  # Saver.stop skips a save it cannot finish: such a stop loses the work
        disk_faults += nodes * sum(rates.per_node_h(k) for k in lost)
        leaves = ", ".join(f"{k.replace('_', ' ')} {budgets[k]:.0f} s" for k in lost)
        inputs["stops_lose_work"] = f"a save takes {save_s + write_s:.0f} s, a stop leaves {leaves}"
        inputs["lost_kinds"] = lost
    disk = planning.Tier(save_s, write_s, disk_faults, disk_restart)
    memory = None
    if with_memory:
        msave, mwrite = m.memory if m.memory is not None else (0.0, 0.0)
        memory = planning.Tier(msave, mwrite, covered, startup)
    fixed_disk = None if auto_disk else every * m.step_s
    fixed_memory = None if (auto_memory or memory is None) else memory_every * m.step_s
    disk_s, memory_s = planning.best_intervals(
        disk, m.step_s, memory, disk_interval_s=fixed_disk, memory_interval_s=fixed_memory
    )
    if auto_disk:
        every = planning.steps(disk_s, m.step_s, disk)
    if auto_memory and memory is not None:
        memory_every = min(every, planning.steps(memory_s, m.step_s, memory))
    parts = [planning.why(disk, m.step_s, every)]
    if memory is not None:
        parts.append("memory " + planning.why(memory, m.step_s, memory_every))
    inputs |= {"disk": dataclasses.asdict(disk), "memory": dataclasses.asdict(memory) if memory else None}
    return Choice(every, memory_every, "; ".join(parts), m.borrowed, inputs)


def _seconds(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x >= 0


def _positive(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0


def _median_pair(pairs: list[tuple[float, float]]) -> tuple[float, float] | None:
    if not pairs:
        return None
    return statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)


# ---- the site's rates as submit froze them --------------------------------------------------------------------


def record(rates: history.Rates, forecast: list[str] | None = None, expected: dict[str, float] | None = None) -> dict:
    """history.json's record of one partition: the site's rates as submit read them, and the forecast it said, in
    words and as numbers (planning.Forecast's fractions: report puts it beside what the run did)."""
    return {"rates": dataclasses.asdict(rates), "forecast": forecast or [], "expected": expected or {}}


def write_rates(
    path: Path,
    rates: history.Rates,
    private: bool,
    forecast: list[str] | None = None,
    expected: dict[str, float] | None = None,
    partitions: dict[str, dict[str, Any]] | None = None,
) -> None:
    """history.json in a run directory (the job asks no sacct): record(rates, forecast, expected), and for a sweep
    over cluster.partition each other partition's record by name (`partitions`), which its trials read instead."""
    from hpc_train.paths import write_atomic

    data = record(rates, forecast, expected) | ({"partitions": partitions} if partitions else {})
    write_atomic(path, json.dumps(data, indent=1) + "\n", private)


def _frozen(path: Path, run_dir: Path) -> dict[str, Any]:
    if not path.exists() and (run_dir.parent / "sweep.json").exists():
        # a trial's is its sweep's (submit writes one), read only as the job pickle's folder is trusted: in a
        # group-writable out_dir another user could make a plain run's parent look like a sweep, with 0 faults
        from hpc_train.paths import untrusted

        path = run_dir.parent / path.name
        if untrusted(path, run_dir.parent):
            return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    partitions = data.get("partitions")
    if isinstance(partitions, dict) and partitions:  # a sweep over cluster.partition: this trial's own
        mine = partitions.get(history.queued_on(run_dir / "config.yaml")[1])
        return mine if isinstance(mine, dict) else data
    return data


def read_rates(path: Path, run_dir: Path) -> history.Rates:
    """The frozen site rates merged with this run's own journal (history.from_journals); the defaults where submit
    froze none (a run queued before, or the local executor)."""
    try:
        data = _frozen(path, run_dir)["rates"]
        site = history.Rates(**{**data, "queue_waits_s": tuple(data.get("queue_waits_s", ()))})
    except (KeyError, TypeError):
        site = history.DEFAULTS
    own = history.from_journals([run_dir])
    return history.merge(site, own) if own.node_hours else site


def forecast_said(path: Path, run_dir: Path) -> list[str]:
    """What submit forecast for this run (history.json), [] when it said nothing (a local run, one queued before)."""
    lines = _frozen(path, run_dir).get("forecast")
    return [line for line in lines if isinstance(line, str)] if isinstance(lines, list) else []


def forecast_expected(path: Path, run_dir: Path) -> planning.Forecast | None:
    """The numbers of submit's forecast for this run (history.json's `expected`); None where it froze none."""
    try:
        return planning.Forecast(**_frozen(path, run_dir)["expected"])
    except (KeyError, TypeError):
        return None


# ---- the forecast at submit -------------------------------------------------------------------------------------

# What a forecast assumes of a run none of the project's earlier runs measured (each said in the line): a step of
# 1 s, a disk save blocking 2 s then 10 s in the background, a memory copy blocking 0.2 s then 2 s
ASSUMED = Measured(step_s=1.0, disk=(2.0, 10.0), memory=(0.2, 2.0), startup_s=DEFAULT_STARTUP_S)


def project_measured(runs_dir: Path) -> Measured:
    """What the project's newest earlier run that saved measured (its journal and metrics.jsonl: step time, a
    periodic save's cost, a memory copy's), ASSUMED's values where none did."""
    from hpc_train.metrics import read_metrics
    from hpc_train.reputation import journal_files

    for events_file in sorted(journal_files(runs_dir), key=lambda p: p.stat().st_mtime, reverse=True)[:20]:
        events = journal.read(events_file.parent)
        if not journal.named(events, journal.CHECKPOINT_COMMITTED):
            continue
        rows = read_metrics(events_file.parent)
        copies = [
            (r.get("memory_blocked_s", 0.0), r["memory_copy_s"]) for r in rows if _positive(r.get("memory_copy_s"))
        ]
        m = measured(events, [r.get("step_time_s", 0.0) for r in rows], copies)
        disk = m.disk or ASSUMED.disk
        # a copy in RAM unmeasured: a tenth of the disk save's (the dev cluster's 1b state: ~10 s vs ~100 s)
        memory = m.memory or (disk[0] / 10, disk[1] / 10)
        return Measured(m.step_s or ASSUMED.step_s, disk, memory, m.startup_s or ASSUMED.startup_s)
    return ASSUMED


def stop_budgets(cluster: Any, reserve_s: float) -> dict[str, float]:
    """What a stop of each announced kind leaves for its save: a preemption (or a requeue, which Slurm signals the
    same way) its grace, a time limit its lead less the requeue decision's reserve (deadlines.reserve_s)."""
    grace = float(cluster.preempt_grace_s)
    return {"preemptions": grace, "requeues": grace, "time_limits": cluster.signal_lead_s - reserve_s}


def expected(
    ck: CheckpointConfig,
    m: Measured,
    rates: history.Rates,
    nodes: int,
    spares: bool,
    stop_budgets_s: dict[str, float] | None = None,
) -> planning.Forecast:
    """The expected goodput of a run with these intervals (choose's, from `m` complete), its announced stops (each
    a stop save and a restart) and unannounced faults (planning.forecast)."""
    c = choose(ck, m, rates, nodes, spares, stop_budgets_s)
    lost = c.inputs.get("lost_kinds", [])
    step_s = m.step_s or ASSUMED.step_s
    disk = planning.Tier(**c.inputs["disk"])
    memory = planning.Tier(**c.inputs["memory"]) if c.inputs.get("memory") else None
    memory_s = min(c.memory_every_steps, c.every_steps) * step_s if memory is not None else 0.0
    return planning.forecast(
        disk,
        c.every_steps * step_s,
        memory,
        memory_s,
        # stops whose save does not fit are in the disk tier's faults already (choose)
        announced_per_h=nodes * sum(rates.per_node_h(k) for k in history.ANNOUNCED if k not in lost),
        announced_restart_s=disk.restart_s,
    )


def _budgets(cluster: Any) -> dict[str, float]:
    """stop_budgets of a Slurm run as submit sees it (the job's own reserve: deadlines.decision_reserve_s)."""
    from hpc_train import deadlines

    return stop_budgets(cluster, deadlines.reserve_s("slurm", cluster.elastic()))


def at_submit(ck: CheckpointConfig, cluster: Any, rates: history.Rates, m: Measured) -> planning.Forecast:
    """The expected goodput of a Slurm run as submit forecasts it: its size, spares, and the save a stop leaves room
    for (the preemption's grace or the time limit's lead)."""
    spares = bool(cluster.spare_nodes or cluster.in_process_restart)
    return expected(ck, m, rates, cluster.nodes, spares, _budgets(cluster))


def forecast_lines(ck: CheckpointConfig, cluster: Any, rates: history.Rates, m: Measured) -> list[str]:
    """What submit says of a Slurm run before it is queued: its expected goodput at its size on its partition,
    then the alternatives that would change it most (hot spares with the memory tier, auto intervals, half the
    nodes), each with the overrides that make it. A spare's idle node counts against it: goodput of the
    allocation's node-hours."""
    nodes, spares = cluster.nodes, bool(cluster.spare_nodes or cluster.in_process_restart)
    budget = _budgets(cluster)  # what a stop leaves for its save
    held = nodes / (nodes + cluster.spare_nodes)
    base = at_submit(ck, cluster, rates, m)
    where = f"on {cluster.partition or 'the default partition'} at {nodes} node(s)"
    lines = [f"forecast: {base} {where}", f"  the site: {rates.describe(nodes)}"]
    if m.step_s == ASSUMED.step_s and m.disk == ASSUMED.disk:
        lines.append("  no run here measured a save yet: 1 s a step, a 2 s save + 10 s written assumed")
    options: list[tuple[float, str]] = []
    if not spares and nodes > 1:
        auto = dataclasses.replace(ck, memory_every_steps=AUTO)
        g = expected(auto, m, rates, nodes, True, budget).goodput * nodes / (nodes + 1)
        options.append((g, "cluster.spare_nodes=1 checkpoint.memory_every_steps=auto"))
    if ck.every_steps != AUTO:
        options.append(
            (
                expected(dataclasses.replace(ck, every_steps=AUTO), m, rates, nodes, spares, budget).goodput * held,
                "checkpoint.every_steps=auto",
            )
        )
    if nodes > 1:
        options.append(
            (expected(ck, m, rates, nodes // 2, spares, budget).goodput * held, f"cluster.nodes={nodes // 2}")
        )
    for g, how in sorted(options, key=lambda o: -abs(o[0] - base.goodput * held))[:2]:
        lines.append(f"  with {how}: expected goodput {g:.1%} (now {base.goodput * held:.1%})")
    return lines
