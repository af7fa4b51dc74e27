"""The suite's own schedule (conftest.queue_order): every unit once, longest first within each kind, and never
two long units in a row while a short one is left (the four longest, started together, slowed one another past
a deadline on CI's 2 cores)."""

from __future__ import annotations

import random

from conftest import queue_order, unit_of


def test_queue_order_keeps_every_unit_and_alternates_the_long_ones() -> None:
    rng = random.Random(17)
    for _ in range(300):
        weight = {
            f"u{i}": rng.choice([1.0, 5.0, 40.0, 99.0, 100.0, 101.0, 150.0, 345.0]) for i in range(rng.randint(0, 30))
        }
        first = {unit: i for i, unit in enumerate(rng.sample(list(weight), len(weight)))}
        order = queue_order(weight, first)
        assert sorted(order) == sorted(weight)
        long = [u for u in order if weight[u] > 100]
        rest = [u for u in order if weight[u] <= 100]
        for kind in (long, rest):  # longest first, ties in collection order
            assert kind == sorted(kind, key=lambda u: (-weight[u], first[u]))
        for a, b in zip(order, order[1:]):
            if weight[a] > 100 and weight[b] > 100:  # two long in a row: only once no short one is left
                assert all(order.index(u) < order.index(a) for u in rest)


def test_a_cluster_test_is_its_own_unit_and_the_rest_go_with_their_module() -> None:
    assert unit_of("tests/test_slurm_ops.py::test_a", [], on_cluster=True) == "tests/test_slurm_ops.py::test_a"
    assert unit_of("tests/test_cli.py::test_b", [], on_cluster=False) == "tests/test_cli.py"
    assert unit_of("tests/test_local.py::test_c", [], on_cluster=False) == "tests/test_local.py::test_c"
    assert unit_of("tests/test_secrets.py::test_d", ["secrets"], on_cluster=True) == "secrets"
