"""How often to save: the goodput model of periodic checkpoints, the intervals that maximise it, and a
seeded simulation that checks both. Pure and torch-free (the standard library only).

    .venv/bin/python benchmarks/interval_bench.py        # auto vs the best swept vs every_steps=20, simulated
    .venv/bin/python -m pytest -n0 -q tests/test_planning.py

    >>> disk = Tier(save_s=2.1, write_s=0.0, faults_per_h=1 / 9.4, restart_s=120.0)
    >>> why(disk, step_s=1.0)
    'every 376 steps: save 2.1 s, 1 unannounced fault per 9.4 h, restart 120 s'
    >>> str(forecast(disk, 376.0, announced_per_h=1 / 4))
    'expected goodput 97.7% (saves 0.6%, lost work 0.6%, restarts 1.2%)'

One tier is Daly's single-level model (J. T. Daly, "A higher order estimate of the optimum checkpoint interval
for restart dumps", Future Generation Computer Systems 22(3), 2006) with the restart out of the faults' reach:
unannounced faults come at exponentially distributed times, mean M = 3600 / faults_per_h seconds of running;
every tau seconds of work the loop blocks C = save_s; a fault loses the work back to the last commit and pays
R = restart_s. Daly lets a fault interrupt the restart too (exp(R / M) where M + R stands below); on Slurm most
of R is the queue wait after the requeue, where nothing can fail the job, and the site's rates are per node-hour
a job held (history.py, from sacct), so faults strike running time only. The expected wall time per tau of work:

    T_wall / T_work = ((M + R) / tau) * (exp((tau + C) / M) - 1)

With an async save the commit comes W = write_s after the loop goes on: the first commit after a restart needs
tau + C + W of running, the next ones tau + C each (W <= tau; else the loop waits for the write, and commits
are C + W apart). Summing the commits between two faults (a renewal-reward argument) gives, for W <= tau,

    T_wall / T_work = ((M + R) / tau) * exp(W / M) * (exp((tau + C) / M) - 1)

so a fault loses W more and pays R whatever the interval, and neither moves the best interval (its stationary
point, tau = M * (1 - exp(-(tau + C) / M)), has no R or W in it) except that it is never below W. Announced
stops (a preemption, the time limit) are saved at their signal: they lose no work, and no periodic save is made
for them.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

MAX_INTERVAL_S = 7 * 24 * 3600.0  # 7 days of work: with no unannounced faults, save only at stops and the end


@dataclass(frozen=True)
class Tier:
    """One checkpoint tier, as this run measures it (docs/goodput.md). Disk, from checkpoint_committed: save_s =
    stall_s + waited_s, write_s = save_s - stall_s; restart_s = the requeue and queue wait + journal.startup_s.
    Memory: save_s = a copy's memory_blocked_s, write_s = memory_copy_s, restart_s = a relaunch on a spare."""

    save_s: float  # the loop's blocking seconds per save
    write_s: float = 0.0  # seconds from the loop going on to the commit (0: a synchronous save)
    faults_per_h: float = 0.0  # unannounced faults this tier recovers from, per hour of running
    restart_s: float = 0.0  # from such a fault to training again

    def __post_init__(self) -> None:
        values = {"save_s": self.save_s, "write_s": self.write_s}
        values |= {"faults_per_h": self.faults_per_h, "restart_s": self.restart_s}
        bad = {k: v for k, v in values.items() if not (math.isfinite(v) and v >= 0)}
        if bad:
            raise ValueError(f"Tier: {bad} must be finite and >= 0; e.g. Tier(save_s=2.0, faults_per_h=0.1)")


@dataclass(frozen=True)
class Forecast:
    """Fractions of wall time; they sum to 1. saves: the loop blocked by periodic and stop saves; lost_work:
    work (and saves) a fault threw away; restarts: from a fault or a stop to training again."""

    goodput: float
    saves: float
    lost_work: float
    restarts: float

    def __str__(self) -> str:
        return (
            f"expected goodput {self.goodput:.1%} (saves {self.saves:.1%}, lost work {self.lost_work:.1%}, "
            f"restarts {self.restarts:.1%})"
        )


def _split(run_s: float, tier: Tier, survive: float = 1.0) -> Forecast:
    """Daly's model for segments of run_s seconds of running (the tier's own saves aside), as fractions of wall
    time; `goodput` is the share of running kept. Between two faults (mean M of running, then the restart's R)
    commits come at L1 = run_s + C + W, then every L = max(run_s, W) + C: with a = exp(-L
    / M) their expected number is exp(-L1 / M) / (1 - a), and with each commit kept with probability p (another
    tier's faults kill a write in flight) the expected index of the last one kept is exp(-L1 / M) p / ((1 - a)
    (1 - (1 - p) a)). Whatever ran after it is lost."""
    span = max(run_s, tier.write_s) + tier.save_s  # L: from one snapshot to the next
    if tier.faults_per_h == 0:
        return Forecast(run_s / span, (span - run_s) / span, 0.0, 0.0)
    m = 3600.0 / tier.faults_per_h
    a = math.exp(-span / m)
    kept_commits = math.exp(-(run_s + tier.save_s + tier.write_s) / m) * survive / (-math.expm1(-span / m))
    kept_commits /= 1 - (1 - survive) * a
    per_wall = 1.0 / (m + tier.restart_s)  # a cycle's expected wall time, M + R, inverted
    kept, saves = run_s * kept_commits * per_wall, (span - run_s) * kept_commits * per_wall
    restarts = tier.restart_s * per_wall  # R / (M + R): the restarts' share of a cycle
    return Forecast(kept, saves, max(0.0, 1.0 - kept - saves - restarts), restarts)


def goodput(interval_s: float, tier: Tier) -> float:
    """The expected fraction of wall time that is useful work when saving every interval_s seconds of work:
    tau / T_wall per segment in Daly's form above (module docstring), tau / (tau + C) with no faults."""
    return forecast(tier, interval_s).goodput


def forecast(
    disk: Tier,
    disk_interval_s: float,
    memory: Tier | None = None,
    memory_interval_s: float = 0.0,
    *,
    announced_per_h: float = 0.0,
    announced_restart_s: float | None = None,
) -> Forecast:
    """A run's expected goodput and where the rest goes (docs/goodput.md). With the memory tier the two nest:
    the memory tier is Daly's model over its segments between copies (its faults lose back to the last copy),
    and the disk tier Daly's model whose segment is the wall time the memory tier takes for disk_interval_s
    of work and one disk save, so a disk fault loses the memory tier's saves and restarts too. To first order
    the wastes add (C_m / tau_m + C_d / tau_d + each tier's faults' losses) rather than the efficiencies
    multiplying: both tiers' saves block the same loop, so per second of work their costs add.
    announced_per_h counts stops per hour of running; each costs a stop save (save_s + write_s: the loop
    waits for its commit) and announced_restart_s (default: the disk tier's restart_s), and loses nothing."""
    if not disk_interval_s > 0 or (memory is not None and not memory_interval_s > 0):
        raise ValueError(
            f"disk_interval_s={disk_interval_s:g} and memory_interval_s={memory_interval_s:g} (with a memory tier) "
            f"must be > 0: seconds of work between two saves"
        )
    if memory is None:
        out = _split(disk_interval_s, disk)
    elif memory_interval_s > disk_interval_s:
        raise ValueError(
            f"memory_interval_s={memory_interval_s:g} must be <= disk_interval_s={disk_interval_s:g}: a copy in "
            f"memory less often than the disk checkpoint covers nothing the disk does not; lower "
            f"checkpoint.memory_every_steps, or set it to 0"
        )
    else:
        # Per disk interval the memory tier runs tau_d / tau_m segments between its copies: all tau_m of work
        # but one, which holds the disk save's blocking too (tau_m + C_d: its faults strike there as well).
        # In Daly's model each segment's expected wall time is independent of the others: its run / goodput.
        plain, with_save = _split(memory_interval_s, memory), _split(memory_interval_s + disk.save_s, memory)
        if min(plain.goodput, with_save.goodput) <= 0:
            return Forecast(0.0, 0.0, 0.0, 1.0)
        plain_s = (disk_interval_s / memory_interval_s - 1) * memory_interval_s / plain.goodput
        save_s = (memory_interval_s + disk.save_s) / with_save.goodput
        period_s = plain_s + save_s  # the memory tier's wall time for tau_d of work and one disk save
        # A memory-covered fault during a disk write drops that commit when a memory copy after its step
        # committed first: the relaunch resumes past the step and saves to disk only at the next multiple of
        # every_steps (before that copy, it saves the step again: the memory tier's loss above). A copy commits
        # tau_m / 2 + C_m + W_m after the disk save's step, on average.
        exposed_s = max(0.0, disk.write_s - memory_interval_s / 2 - memory.save_s - memory.write_s)
        survive = math.exp(-memory.faults_per_h * exposed_s / 3600.0)
        outer = _split(period_s, Tier(0.0, disk.write_s, disk.faults_per_h, disk.restart_s), survive)
        k = outer.goodput / period_s  # per second of the memory tier's time, in the outer tier's kept running
        out = Forecast(
            k * disk_interval_s,
            outer.saves + k * (disk.save_s + plain_s * plain.saves + save_s * with_save.saves),
            outer.lost_work + k * (plain_s * plain.lost_work + save_s * with_save.lost_work),
            outer.restarts + k * (plain_s * plain.restarts + save_s * with_save.restarts),
        )
    # announced stops come per hour of running (a time limit counts running time; nothing preempts a restart):
    # x = stops' seconds per second outside them, so they take x / (1 + x) of the wall time
    restart_s = disk.restart_s if announced_restart_s is None else announced_restart_s
    stop_s = disk.save_s + disk.write_s
    x = announced_per_h * (1.0 - out.restarts) * (stop_s + restart_s) / 3600.0
    if x == 0:
        return out
    stops, scale = x / (1 + x), 1 / (1 + x)
    stop_saves = stops * stop_s / (stop_s + restart_s)
    return Forecast(
        scale * out.goodput,
        scale * out.saves + stop_saves,
        scale * out.lost_work,
        scale * out.restarts + stops - stop_saves,
    )


def _argmax(f: Callable[[float], float], lo: float, hi: float) -> float:
    """Golden-section search on log(interval) over [lo, hi], for a unimodal f (Daly's goodput is log-concave
    in tau above the write: 1 / tau - exp(a) / (M (exp(a) - 1)), a = (tau + C) / M, falls as tau grows, since
    2 M sinh(a / 2) > tau + C > tau). 80 evaluations, deterministic; the optimum to ~1e-6 of the interval,
    where goodput is flat to a float's last bits."""
    if hi <= lo:
        return lo
    g = (math.sqrt(5) - 1) / 2
    a, b = math.log(lo), math.log(hi)
    c, d = b - g * (b - a), a + g * (b - a)
    fc, fd = f(math.exp(c)), f(math.exp(d))
    for _ in range(80):
        if fc >= fd:
            b, d, fd = d, c, fc
            c = b - g * (b - a)
            fc = f(math.exp(c))
        else:
            a, c, fc = c, d, fd
            d = a + g * (b - a)
            fd = f(math.exp(d))
    return max((lo, hi, math.exp((a + b) / 2)), key=f)  # an optimum on a bound stays on it


def daly_interval_s(tier: Tier) -> float:
    """Daly's higher-order closed form: sqrt(2 C M) (1 + sqrt(C / 2M) / 3 + C / 18M) - C for C < 2M,
    else M. Young's sqrt(2 C M) is its first term. For comparison; best_interval_s is the exact optimum."""
    if tier.faults_per_h == 0:
        return MAX_INTERVAL_S
    m, c = 3600.0 / tier.faults_per_h, tier.save_s
    if c >= 2 * m:
        return m
    return math.sqrt(2 * c * m) * (1 + math.sqrt(c / (2 * m)) / 3 + c / (18 * m)) - c


def best_interval_s(tier: Tier, step_s: float) -> float:
    """The seconds of work between saves that maximise goodput: never below one step or the write (a shorter
    interval makes the loop wait for it), never above MAX_INTERVAL_S (which it is with no unannounced faults)."""
    return _argmax(lambda t: goodput(t, tier), max(step_s, tier.write_s), MAX_INTERVAL_S)


def best_intervals(
    disk: Tier,
    step_s: float,
    memory: Tier | None = None,
    *,
    disk_interval_s: float | None = None,
    memory_interval_s: float | None = None,
) -> tuple[float, float]:
    """(disk, memory) seconds of work between saves that maximise forecast(...).goodput, the memory interval
    never above the disk's; pass one to fix it (checkpoint.every_steps=20 with memory_every_steps=auto). No
    memory tier: (best_interval_s, 0.0). Each interval is optimised in turn, from the tiers' own optima:
    they barely interact (the disk tier sees the memory tier through its goodput), so 3 rounds settle them."""
    if memory is None:
        return (disk_interval_s or best_interval_s(disk, step_s)), 0.0
    d = disk_interval_s or max(best_interval_s(disk, step_s), best_interval_s(memory, step_s))
    m = min(memory_interval_s or best_interval_s(memory, step_s), d)
    for _ in range(3):
        if memory_interval_s is None:
            m = _argmax(lambda t: forecast(disk, d, memory, t).goodput, min(d, max(step_s, memory.write_s)), d)
        if disk_interval_s is None:
            lo = max(step_s, disk.write_s, m)
            d = _argmax(lambda t: forecast(disk, t, memory, m).goodput, lo, max(lo, MAX_INTERVAL_S))
    return d, m


def steps(interval_s: float, step_s: float, tier: Tier) -> int:
    """An interval in whole steps: the nearest, at least 1 and at least the write (ceil(write_s / step_s))."""
    return max(1, math.ceil(tier.write_s / step_s - 1e-9), math.floor(interval_s / step_s + 0.5))


def every_steps(tier: Tier, step_s: float) -> int:
    """checkpoint.every_steps=auto for one tier: best_interval_s in whole steps."""
    return steps(best_interval_s(tier, step_s), step_s, tier)


def _per(hours: float) -> str:
    if hours >= 48:
        return f"{hours / 24:.3g} days"
    return f"{hours:.3g} h" if hours >= 1 else f"{hours * 60:.3g} min"


def why(tier: Tier, step_s: float, every: int | None = None) -> str:
    """One line saying an interval (default every_steps) and what it rests on, with the inputs' numbers:
    'every 376 steps: save 2.1 s (+ 8 s written in the background), 1 unannounced fault per 9.4 h, restart
    45 s'. forecast(...) says the goodput."""
    n = every_steps(tier, step_s) if every is None else every
    write = f" (+ {tier.write_s:.3g} s written in the background)" if tier.write_s else ""
    faults = f"1 unannounced fault per {_per(1 / tier.faults_per_h)}" if tier.faults_per_h else "no unannounced faults"
    return f"every {n} steps: save {tier.save_s:.3g} s{write}, {faults}, restart {tier.restart_s:.3g} s"


# ---- the check: a seeded simulation of the same run ------------------------------------------------------------


def _fault_times(per_h: float, horizon_s: float, rng: random.Random) -> list[float]:
    """Poisson arrivals over [0, horizon_s): exponential gaps, stratified in blocks of 256 (each block's
    uniforms one per 1/256 slice, shuffled), which keeps the exponential law and cuts the sampling noise."""
    out: list[float] = []
    t, m = 0.0, 3600.0 / per_h if per_h > 0 else math.inf
    while t < horizon_s and m < math.inf:
        block = [(i + rng.random()) / 256 for i in range(256)]
        rng.shuffle(block)
        for u in block:
            t -= m * math.log1p(-u)
            if t >= horizon_s:
                break
            out.append(t)
    return out


def _last(ok: Callable[[int], bool], lo: int, guess: int) -> int:
    """The largest k >= lo with ok(k) (true, then false as k grows), lo - 1 if none: galloping from a guess
    that is mostly right, so two calls of ok mostly do."""
    k = max(lo, guess)
    if ok(k):
        step = 1
        while ok(k + step):
            k, step = k + step, step * 2
        hi = k + step
    else:
        hi, step = k, 1
        while True:
            k = hi - step
            if k <= lo:
                if not ok(lo):
                    return lo - 1
                k = lo
                break
            if ok(k):
                break
            hi, step = k, step * 2
    while hi - k > 1:
        mid = (k + hi) // 2
        k, hi = (mid, hi) if ok(mid) else (k, mid)
    return k


def _events(disk: Tier, memory: Tier | None, announced_per_h: float, horizon_s: float, seed: int) -> list[tuple]:
    """Every tier's unannounced faults and the announced stops of one seeded run, in time order: (time, kind)."""
    rng = random.Random(seed)
    events = [(f, "disk") for f in _fault_times(disk.faults_per_h, horizon_s, rng)]
    if memory is not None:
        events += [(f, "memory") for f in _fault_times(memory.faults_per_h, horizon_s, rng)]
    events += [(f, "stop") for f in _fault_times(announced_per_h, horizon_s, rng)]
    return sorted(events)


def simulate(
    disk: Tier,
    disk_every: int,
    step_s: float,
    *,
    hours: float,
    seed: int,
    memory: Tier | None = None,
    memory_every: int = 0,
    announced_per_h: float = 0.0,
    announced_restart_s: float | None = None,
) -> float:
    """The realised goodput (work kept / hours) of one run that saves at the steps that are multiples of disk_every
    (and memory_every), as hpc_train does, under each tier's unannounced faults and announced stops drawn from
    `seed`: the same seed, the same fault times, whatever the intervals (common random numbers). A memory-covered
    fault resumes from the newer of the last memory copy and disk commit after memory.restart_s, any other from the
    last disk commit after disk.restart_s; nothing strikes a requeue's restart (the job waits in the queue: faults
    strike running time, as in the model), only a disk fault a memory relaunch, which holds the allocation (the
    forecast's disk tier spans the memory tier's wall time); an in-flight write dies with its process. An announced
    stop saves at the step reached (the loop waits save_s + write_s), then restarts. The work reached counts."""
    horizon = hours * 3600.0
    tiers = [(disk, disk_every)] + ([(memory, memory_every)] if memory is not None else [])
    if min(e for _, e in tiers) < 1 or (memory is not None and any(e * step_s < t.write_s for t, e in tiers)):
        raise ValueError(
            f"simulate: disk_every={disk_every} and memory_every={memory_every} must be >= 1 and, with two tiers, "
            f"cover each tier's write (every * step_s >= write_s)"
        )
    # the loop waits for the previous write when it is longer than the interval (one save in flight); only a
    # lone tier can be that short, so the wait is the same each time
    wait = [max(0.0, t.write_s - e * step_s) for t, e in tiers]
    rate = step_s + sum((t.save_s + w) / e for (t, e), w in zip(tiers, wait))  # wall seconds per step, on average
    events = _events(disk, memory, announced_per_h, horizon, seed)
    t0, p0 = 0.0, 0  # the running phase began at wall time t0 from step p0
    last = [0, 0]  # the newest committed step on disk, in memory

    def wall(x: int) -> float:  # when step x is reached (the saves before it done, not its own)
        t = t0 + (x - p0) * step_s
        for (tier, e), w in zip(tiers, wait):
            n = (x - 1) // e - p0 // e if x > p0 else 0
            t += n * tier.save_s + max(0, n - 1) * w
        return t

    def committed(i: int, f: float) -> int:  # the newest step tier i committed in this running phase by f
        tier, e = tiers[i]
        first = p0 // e + 1

        def done(k: int) -> bool:
            q = k * e
            t = wall(q) + (wait[i] if k > first else 0.0) + tier.save_s + tier.write_s
            if i == 0 and memory is not None and q % memory_every == 0:
                t += memory.save_s  # at a step of both, the memory copy's snapshot comes first
            return t <= f

        k = _last(done, first, (p0 + int((f - t0) / rate)) // e)
        return k * e if k >= first else last[i]

    def reached(f: float) -> int:
        return _last(lambda x: wall(x) <= f, p0, p0 + int((f - t0) / rate))

    relaunch = False  # the restart under way (f < t0) is a memory relaunch inside the allocation
    for f, kind in events:
        if f < t0:
            if relaunch and kind == "disk":
                p0, last[1], t0, relaunch = last[0], last[0], f + disk.restart_s, False
            continue
        relaunch = kind == "memory" and memory is not None
        if kind == "stop":
            p0 = last[0] = last[1] = reached(f)
            restart_s = disk.restart_s if announced_restart_s is None else announced_restart_s
            t0 = f + disk.save_s + disk.write_s + restart_s
            continue
        last = [committed(i, f) for i in range(len(tiers))] + last[len(tiers) :]
        if kind == "disk":
            p0 = last[1] = last[0]
            t0 = f + disk.restart_s
        elif memory is not None:
            p0 = max(last)
            t0 = f + memory.restart_s
    work = reached(horizon) if t0 < horizon else p0
    return work * step_s / horizon
