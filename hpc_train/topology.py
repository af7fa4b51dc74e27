"""Topology-aware rank placement: a pure planner over the nodes' switch paths.

Slurm tells every task its place in the switch tree (`SLURM_TOPOLOGY_ADDR=root.s2.node3`) but numbers
tasks in node-name order, and torchrun, submitit and Lightning keep that order. Ring and tree
collectives then cross switches at every step when names interleave switches. The planner orders
nodes so that nodes under one leaf switch are consecutive (whole subtrees consecutive, so upper
levels are crossed as rarely as possible too), keeps Slurm's order inside a switch, and numbers
ranks node-contiguously in that order. For a ring this is optimal: one crossing per leaf switch.

    order = plan_nodes({"node1": "root.s1.node1", "node2": "root.s2.node2", ...})
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence


def switch_path(topology_addr: str, node: str) -> tuple[str, ...]:
    """ "root.s2.node3" -> ("root", "s2"): the switches above the node; () without topology."""
    parts = [p for p in topology_addr.split(".") if p]
    if parts and parts[-1] == node:
        parts = parts[:-1]
    return tuple(parts)


def plan_nodes(topology_addr: Mapping[str, str]) -> list[str]:
    """Nodes in placement order. `topology_addr` maps node -> SLURM_TOPOLOGY_ADDR, in Slurm's order."""
    nodes = list(topology_addr)
    position = {n: i for i, n in enumerate(nodes)}
    # First appearance of each switch path prefix, so subtrees keep Slurm's relative order.
    first_seen: dict[tuple[str, ...], int] = {}
    for n in nodes:
        path = switch_path(topology_addr[n], n)
        for depth in range(len(path) + 1):
            first_seen.setdefault(path[:depth], position[n])
    key = {
        n: tuple(
            first_seen[switch_path(topology_addr[n], n)[: d + 1]] for d in range(len(switch_path(topology_addr[n], n)))
        )
        + (position[n],)
        for n in nodes
    }
    return sorted(nodes, key=key.__getitem__)


def ring_crossings(order: Sequence[str], leaf_of: Mapping[str, tuple[str, ...]]) -> int:
    """Edges of the rank ring (over nodes, wrapping around) whose ends hang under different leaf switches."""
    if len(order) < 2:
        return 0
    return sum(leaf_of[a] != leaf_of[b] for a, b in zip(order, [*order[1:], order[0]]))


def optimum_crossings(leaf_of: Mapping[str, tuple[str, ...]]) -> int:
    """A ring must enter and leave every leaf switch once: one crossing per switch, none for one switch."""
    switches = len(set(leaf_of.values()))
    return 0 if switches < 2 else switches


def mesh_shape(world_size: int, ranks_per_node: int, tp: int) -> dict[str, int]:
    """(dp, tp) with tensor parallel innermost: a tp group is tp consecutive ranks, so it stays on a node."""
    if tp < 1 or ranks_per_node % tp:
        divisors = [d for d in range(1, ranks_per_node + 1) if ranks_per_node % d == 0]
        raise ValueError(
            f"train.tp={tp} must divide cluster.tasks_per_node={ranks_per_node} so tensor-parallel "
            f"groups stay on one node; use tp in {divisors}"
        )
    return {"dp": world_size // tp, "tp": tp}


def placement(
    topology_addr: Mapping[str, str], ranks_per_node: int, tp: int = 1, order: Sequence[str] | None = None
) -> dict:
    """The plan as written to placement.json: rank -> node -> switch, the mesh, and its ring quality. order: the
    nodes as already placed (an in-process restart: its survivors keep their ranks), else plan_nodes'."""
    order = list(order) if order else plan_nodes(topology_addr)
    leaf_of = {n: switch_path(topology_addr[n], n) for n in topology_addr}
    return {
        "nodes": order,
        "ranks": [
            {"rank": i * ranks_per_node + local, "node": n, "local_rank": local, "switch": ".".join(leaf_of[n])}
            for i, n in enumerate(order)
            for local in range(ranks_per_node)
        ],
        "mesh": mesh_shape(len(order) * ranks_per_node, ranks_per_node, tp),
        "ring_cross_switch_edges": {
            "placed": ring_crossings(order, leaf_of),
            "slurm_order": ring_crossings(list(topology_addr), leaf_of),
            "optimum": optimum_crossings(leaf_of),
        },
    }
