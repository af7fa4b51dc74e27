"""The placement planner, tested with tables."""

from __future__ import annotations

import time

import pytest

from hpc_train.topology import mesh_shape, placement, plan_nodes

DEV = {"node1": "root.s1.node1", "node2": "root.s2.node2", "node3": "root.s1.node3", "node4": "root.s2.node4"}


@pytest.mark.parametrize(
    "addrs, order",
    [
        (DEV, ["node1", "node3", "node2", "node4"]),  # the dev cluster: names interleave switches
        ({"a": "a", "b": "b"}, ["a", "b"]),  # no topology plugin: Slurm's order
        # Uneven switches: s1 holds one node, s2 three; Slurm's order kept inside each switch.
        ({"n1": "r.s2.n1", "n2": "r.s1.n2", "n3": "r.s2.n3", "n4": "r.s2.n4"}, ["n1", "n3", "n4", "n2"]),
        # Two levels: spines x, y; leaves keep their subtree together.
        (
            {"n1": "r.x.l1.n1", "n2": "r.y.l3.n2", "n3": "r.x.l2.n3", "n4": "r.y.l3.n4", "n5": "r.x.l1.n5"},
            ["n1", "n5", "n3", "n2", "n4"],
        ),
    ],
)
def test_plan_nodes(addrs: dict[str, str], order: list[str]) -> None:
    assert plan_nodes(addrs) == order


def test_dev_placement_and_ring_quality() -> None:
    p = placement(DEV, ranks_per_node=2)
    assert [(r["rank"], r["node"], r["switch"]) for r in p["ranks"]][:4] == [
        (0, "node1", "root.s1"),
        (1, "node1", "root.s1"),
        (2, "node3", "root.s1"),
        (3, "node3", "root.s1"),
    ]
    assert p["ring_cross_switch_edges"] == {"placed": 2, "slurm_order": 4, "optimum": 2}
    assert p["mesh"] == {"dp": 8, "tp": 1}


def test_tp_must_stay_inside_a_node() -> None:
    assert mesh_shape(48, 6, 3) == {"dp": 16, "tp": 3}
    with pytest.raises(
        ValueError, match=r"train.tp=4 must divide cluster.tasks_per_node=6 .* use tp in \[1, 2, 3, 6\]"
    ):
        mesh_shape(48, 6, 4)


def test_100k_ranks() -> None:
    # 12,500 nodes x 8 ranks under 250 leaf switches, names interleaved across switches.
    def cluster(nodes: int, leaves: int) -> dict[str, str]:
        return {f"n{i:05d}": f"root.spine{i % 5}.leaf{i % leaves}.n{i:05d}" for i in range(nodes)}

    def cpu_s(addrs: dict[str, str]) -> tuple[float, dict]:
        t0 = time.process_time()  # CPU time: another process on the cores does not count
        p = placement(addrs, ranks_per_node=8)
        return time.process_time() - t0, p

    tenth = min(cpu_s(cluster(1_250, 25))[0] for _ in range(3))
    whole, p = cpu_s(cluster(12_500, 250))
    assert len(p["ranks"]) == 100_000
    q = p["ring_cross_switch_edges"]
    assert q["placed"] == q["optimum"] == 250 and q["slurm_order"] == 12_500
    # A sanity bound only, as a ratio: 10x the ranks cost 11-13x the CPU (a sort), a quadratic plan would cost
    # 100x; benchmarks/placement_bench.py reports the time.
    assert whole < 30 * tenth, (whole, tenth)
