"""Auto checkpoint intervals against the best fixed one and the default (issue 30), in a seeded simulation:

    .venv/bin/python benchmarks/interval_bench.py                  # ~30 s on one core
    .venv/bin/python benchmarks/interval_bench.py --faults 4000 --restart-s 300

One tier (the disk): for each unannounced-fault rate (1 per 10 min .. 1 per week), blocking save cost (0.1 ..
60 s) and background write (0, 30 s), the interval planning.every_steps chooses and its goodput in
planning.simulate, the best fixed interval found by sweeping in the same simulation (the same fault times:
every_steps from auto / 8 to auto x 8 by factors of 2, then by 2^(1/16) around the best), and the default
checkpoint.every_steps=20. At 1 s a step (--step-s), so every_steps is seconds of work; every fault costs
--restart-s (a requeue, its queue wait and the start-up); --faults unannounced faults are drawn per row.

Two tiers (the memory tier's figures from the dev cluster, docs/benchmarks.md: the loop blocked 0.07 s and
both copies written 0.98 s for 201 MB a rank, a relaunch on a spare 6.7 s), 90% of the faults covered by
the memory tier: planning.best_intervals' pair simulated, the forecast (nested) beside the two first-order
readings (wastes adding; efficiencies multiplying), the best pair of a 5 x 5 sweep around it, and the same
run without the memory tier (every fault requeues from disk). Never asserts.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from hpc_train.planning import Tier, best_intervals, every_steps, forecast, goodput, simulate, steps

RATES_PER_H = [("10 min", 6.0), ("1 h", 1.0), ("6 h", 1 / 6), ("1 day", 1 / 24), ("1 week", 1 / 168)]
SAVES_S = [0.1, 1.0, 10.0, 60.0]
WRITES_S = [0.0, 30.0]
DEFAULT_EVERY = 20  # checkpoint.every_steps's default (config.CheckpointConfig)


def swept(sim: Callable[[int], float], auto: int) -> tuple[int, float]:
    """The best every_steps by simulated goodput: factors of 2 from auto / 8 to auto x 8, then factors of 2^(1/16)
    (4.4%) up to 1.41x either side of the best of those."""
    seen: dict[int, float] = {}

    def at(n: int) -> float:
        n = max(1, n)
        if n not in seen:
            seen[n] = sim(n)
        return seen[n]

    best = max((max(1, round(auto * 2.0**j)) for j in range(-3, 4)), key=at)
    for j in range(-8, 9):
        at(round(best * 2.0 ** (j / 16)))
    return max(seen.items(), key=lambda kv: kv[1])


def one_tier(a: argparse.Namespace) -> None:
    print(f"one tier: {a.step_s:g} s a step, restart {a.restart_s:g} s, {a.faults} faults a row, seed {a.seed}")
    print(
        f"{'1 fault per':>11} {'save s':>6} {'write s':>7} | {'auto every':>10} {'model':>7} {'sim':>7} | "
        f"{'best every':>10} {'sim':>7} {'auto -':>7} | {'every=20':>8} {'loss':>7}"
    )
    worst = 0.0
    for name, per_h in RATES_PER_H:
        for save_s in SAVES_S:
            for write_s in WRITES_S:
                tier = Tier(save_s=save_s, write_s=write_s, faults_per_h=per_h, restart_s=a.restart_s)

                def sim(n: int) -> float:
                    return simulate(tier, n, a.step_s, hours=a.faults / per_h, seed=a.seed)

                auto = every_steps(tier, a.step_s)
                g_auto = sim(auto)
                best, g_best = swept(sim, auto)
                g_best = max(g_best, g_auto)
                g_default = sim(DEFAULT_EVERY)
                gap = 1 - g_auto / g_best
                worst = max(worst, gap)
                print(
                    f"{name:>11} {save_s:6g} {write_s:7g} | {auto:10d} {goodput(auto * a.step_s, tier):7.2%} "
                    f"{g_auto:7.2%} | {best:10d} {g_best:7.2%} {gap:7.3%} | {g_default:8.2%} "
                    f"{1 - g_default / g_best:7.2%}"
                )
    print(f"auto's worst shortfall from the best swept interval: {worst:.3%} of its goodput (relative)\n")


def two_tiers(a: argparse.Namespace) -> None:
    print(
        f"two tiers: memory save 0.07 s, write 0.98 s, relaunch 6.7 s; disk restart {a.restart_s:g} s; "
        f"90% of faults covered by memory"
    )
    print(
        f"{'1 fault per':>11} {'disk save':>9} {'write':>5} | {'every d/m':>10} {'sim':>7} {'nested':>7} "
        f"{'add':>7} {'product':>7} | {'best d/m':>10} {'sim':>7} | {'disk only':>9} {'sim':>7}"
    )
    for name, per_h in RATES_PER_H[:2] + RATES_PER_H[3:4]:
        for save_s, write_s in ((2.0, 0.0), (60.0, 120.0)):
            memory = Tier(save_s=0.07, write_s=0.98, faults_per_h=0.9 * per_h, restart_s=6.7)
            disk = Tier(save_s=save_s, write_s=write_s, faults_per_h=0.1 * per_h, restart_s=a.restart_s)
            hours = a.faults / per_h

            def sim(d: int, m: int) -> float:
                return simulate(disk, d, a.step_s, hours=hours, seed=a.seed, memory=memory, memory_every=m)

            d_s, m_s = best_intervals(disk, a.step_s, memory)
            d, m = steps(d_s, a.step_s, disk), steps(m_s, a.step_s, memory)
            g = sim(d, m)
            g_mem, g_disk = goodput(m * a.step_s, memory), goodput(d * a.step_s, disk)
            pairs = {
                (dd, mm): sim(dd, mm)
                for dd in {max(1, round(d * 2 ** (j / 2))) for j in range(-2, 3)}
                for mm in {max(1, round(m * 2 ** (j / 2))) for j in range(-2, 3)}
                if mm <= dd and mm * a.step_s >= memory.write_s and dd * a.step_s >= disk.write_s
            }
            (bd, bm), g_best = max(pairs.items(), key=lambda kv: kv[1])
            alone = Tier(save_s=save_s, write_s=write_s, faults_per_h=per_h, restart_s=a.restart_s)
            n_alone = every_steps(alone, a.step_s)
            g_alone = simulate(alone, n_alone, a.step_s, hours=hours, seed=a.seed)
            print(
                f"{name:>11} {save_s:9g} {write_s:5g} | {f'{d}/{m}':>10} {g:7.2%} "
                f"{forecast(disk, d * a.step_s, memory, m * a.step_s).goodput:7.2%} "
                f"{g_mem + g_disk - 1:7.2%} {g_mem * g_disk:7.2%} | {f'{bd}/{bm}':>10} {max(g_best, g):7.2%} | "
                f"{n_alone:9d} {g_alone:7.2%}"
            )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--faults", type=int, default=2000, help="unannounced faults drawn per row")
    ap.add_argument("--step-s", type=float, default=1.0)
    ap.add_argument("--restart-s", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    t0 = time.monotonic()
    one_tier(a)
    two_tiers(a)
    print(f"\n{time.monotonic() - t0:.0f} s")


if __name__ == "__main__":
    main()
