"""Placement quality and planner time on synthetic fat-trees: ours vs Slurm's name order vs the optimum.

    .venv/bin/python benchmarks/placement_bench.py

Prints, per tree, the rank ring's cross-switch edges (over nodes) for the three orders, and the
planner's time at 100,000 ranks (target <= 1 s). Never asserts.
"""

from __future__ import annotations

import time

from hpc_train.topology import placement


def fat_tree(nodes: int, leaves: int, spines: int, interleave: bool) -> dict[str, str]:
    """Nodes named n00000..; with interleave, consecutive names hang under different leaves."""
    per_leaf = nodes // leaves
    addrs = {}
    for i in range(nodes):
        leaf = i % leaves if interleave else i // per_leaf
        addrs[f"n{i:05d}"] = f"root.spine{leaf % spines}.leaf{leaf}.n{i:05d}"
    return addrs


def main() -> None:
    print(f"{'tree':48s} {'ranks':>8s} {'ours':>6s} {'slurm':>7s} {'optimum':>8s} {'plan time':>10s}")
    for nodes, leaves, spines, inter in [
        (4, 2, 1, True),
        (64, 8, 2, True),
        (64, 8, 2, False),
        (1024, 32, 4, True),
        (12_500, 250, 5, True),
    ]:
        addrs = fat_tree(nodes, leaves, spines, inter)
        t0 = time.perf_counter()
        p = placement(addrs, ranks_per_node=8)
        dt = time.perf_counter() - t0
        q = p["ring_cross_switch_edges"]
        name = f"{nodes} nodes, {leaves} leaves, {spines} spines, {'interleaved' if inter else 'contiguous'} names"
        print(f"{name:48s} {nodes * 8:8d} {q['placed']:6d} {q['slurm_order']:7d} {q['optimum']:8d} {dt:9.3f}s")


if __name__ == "__main__":
    main()
