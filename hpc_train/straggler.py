"""Stragglers named: which rank is slow, from each rank's own time, judged on rank 0. Torch-free.

    hpc-train submit cluster=dev train.steps=2000 straggler.every_steps=20 straggler.windows=3
    hpc-train chaos runs/demo-1 slow-rank --rank 3 --seconds 0.02    # a drill: rank 3 works 20 ms more per step
    hpc-train chaos runs/demo-1 slow-rank --rank 3 --seconds 0       # back to normal

Why not wall time: in synchronous DDP/FSDP every rank's wall step time is the same, because fast ranks
wait inside the gradient all-reduce for the slow one. Measured on the dev cluster (4 ranks on 2 nodes,
model=tiny): with rank 3 slowed by 20 ms of work per step, rank 0's logged step_time_s rose from ~18 ms
to 30-60 ms while its own time stayed 7.7 ms; rank 3's own time was 27.9 ms. So each rank measures its
OWN time per step:

    compute  CPU: the main thread's CPU time (time.thread_time()) over forward, backward and optimizer.
             A rank blocked in a gloo wait uses no CPU; intra-op threads are 1 per rank on the dev
             cluster (job.py set_num_threads), so the main thread does the rank's work. A rank starved of
             CPU by its neighbours is not named: runnable-but-waiting time is not its own work.
             GPU: CUDA events around each forward (DDP's forward holds no collective; FSDP2's holds its
             all-gathers, so a peer's slowness can leak in there). Not verified here: no GPU on the dev cluster.
    data     wall time in next_batch (the sampler and the host->device copy).
    comm     wall - compute - data: the time in collectives, waiting for the others, and off-CPU.

Each rank sums these over straggler.every_steps steps; then one all_gather of 3 floats per rank (the
only collective this adds: 24 bytes x world size every every_steps steps). Rank 0 compares each rank's
own time per step (compute + data) with the median of the other ranks: above factor x median, and more than
floor_s above it (1 ms of noise on a 5 ms step is not a straggler), for `windows` windows in a row ->
a `straggler` event; `windows` windows in a row back under -> `straggler_cleared`. An attempt's first
window is not judged: it holds compilation, cold caches and the first batches' loading, unevenly per rank.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field


@dataclass
class StragglerConfig:  # straggler.py, the `straggler` section of the root config
    every_steps: int = 20  # a window: each rank sums its times over this many steps, then one all_gather; 0 = off
    factor: float = 1.5  # a rank is slow when its own time per step is above factor x the median of all ranks
    floor_s: float = 0.002  # ... and more than this above the median, per step (noise on a fast step is not slowness)
    windows: int = 3  # named after this many slow windows in a row; cleared after as many normal ones

    def __post_init__(self) -> None:
        if self.every_steps < 0 or self.windows < 1 or not self.factor > 1.0 or not self.floor_s >= 0:
            raise ValueError(
                f"straggler.every_steps={self.every_steps} (>= 0, 0 = off), straggler.windows="
                f"{self.windows} (>= 1), straggler.factor={self.factor} (> 1) and straggler.floor_s="
                f"{self.floor_s} (>= 0) are out of range; e.g. every_steps=20 windows=3 factor=1.5 "
                f"floor_s=0.002"
            )


@dataclass
class Judge:
    """Rank 0's memory between windows: slow and normal windows in a row per rank, who is named."""

    slow_in_a_row: dict[int, int] = field(default_factory=dict)
    normal_in_a_row: dict[int, int] = field(default_factory=dict)
    named: set[int] = field(default_factory=set)
    windows_seen: int = 0


def medians_of_others(xs: list[float]) -> list[float]:
    """For each i, the median of xs without xs[i] (nan for one value). Not the median of all: with 2 ranks
    that is the mean of the slow and the fast one, so a rank 3x slower would only be 1.5x "the median".
    O(n log n): one sort, then each leave-one-out median from two indices (4,096 ranks: 2.4 ms measured)."""
    order = sorted(xs)
    m = len(xs) - 1  # values left once one is taken out
    out = []
    for x in xs:
        if m == 0:
            out.append(math.nan)
            continue
        k = bisect.bisect_left(order, x)  # the taken-out copy; equal values are interchangeable
        lo, hi = (m - 1) // 2, m // 2  # middle positions among the m left; position j is order[j + (j >= k)]
        out.append((order[lo + (lo >= k)] + order[hi + (hi >= k)]) / 2)
    return out


def judge(j: Judge, own_s: list[float], cfg: StragglerConfig) -> tuple[list[int], list[int], list[float]]:
    """One window's verdict (pure but for `j`): own_s[rank] is each rank's own time per step (compute +
    data). Returns (ranks named now, ranks cleared now, each rank's median of the others)."""
    medians = medians_of_others(own_s)
    named, cleared = [], []
    j.windows_seen += 1
    if j.windows_seen == 1:  # the attempt's first window holds compilation and cold caches: not judged
        return named, cleared, medians
    for rank, (own, median) in enumerate(zip(own_s, medians)):
        slow = own > cfg.factor * median and own - median > cfg.floor_s
        j.slow_in_a_row[rank] = j.slow_in_a_row.get(rank, 0) + 1 if slow else 0
        j.normal_in_a_row[rank] = 0 if slow else j.normal_in_a_row.get(rank, 0) + 1
        if rank not in j.named and j.slow_in_a_row[rank] >= cfg.windows:
            j.named.add(rank)
            named.append(rank)
        elif rank in j.named and j.normal_in_a_row[rank] >= cfg.windows:
            j.named.discard(rank)
            cleared.append(rank)
    return named, cleared, medians


# The slow-rank drill's most per step: a drilled step stays far under train.watchdog_s (900 s by default), and
# the drill file outlives the attempt (every requeue re-reads it), so a typo like 1e9 must not hang a rank.
MAX_SLOW_RANK_S = 10.0


def busy(seconds: float) -> None:
    """The slow-rank drill's extra work: burn `seconds` of this thread's CPU (thread time sees it, as it
    would a slow core; a sleep would look like waiting); at most MAX_SLOW_RANK_S, none for NaN (a
    hand-edited drill file)."""
    import time

    end = time.thread_time() + (min(seconds, MAX_SLOW_RANK_S) if seconds == seconds else 0.0)
    while time.thread_time() < end:
        pass
