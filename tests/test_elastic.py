"""Elastic resume (cluster.min_nodes): the node-range render, the accumulation rule, the queue estimate
and the next attempt's size (pure, plain data); then 4 -> 2 -> 4 nodes on the dev cluster."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpc_train import preempt, slurm
from hpc_train.config import compose, to_run_config
from hpc_train.sbatch import render


def test_min_nodes_renders_a_node_range() -> None:
    run = to_run_config(compose(["cluster=dev", "cluster.nodes=4", "cluster.min_nodes=2"]))
    assert "#SBATCH --nodes=2-4\n" in render(run.cluster, "e-1", Path("/runs/e-1/submitit"))
    run = to_run_config(compose(["cluster=dev", "cluster.nodes=4", "cluster.min_nodes=4"]))
    assert "#SBATCH --nodes=4\n" in render(run.cluster, "e-1", Path("/runs/e-1/submitit"))


@pytest.mark.parametrize("overrides, message", [
    (["cluster=dev", "cluster.nodes=2", "cluster.min_nodes=3"], r"cluster.min_nodes=3 must be between 1 and cluster.nodes=2"),
    (["cluster=dev", "cluster.min_nodes=0"], r"cluster.min_nodes=0 must be between 1"),
    (["cluster=local", "cluster.min_nodes=2"], r"cluster.min_nodes=2 must be between 1 and cluster.nodes=1"),
    (["requeue.shrink_after_s=-1"], r"requeue.shrink_after_s=-1.0 must be >= 0"),
])
def test_elastic_config_errors(overrides: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        to_run_config(compose(overrides))


def test_grad_accum_keeps_the_global_batch() -> None:
    from hpc_train.train import grad_accum_for

    assert grad_accum_for(32, 4, 8) == 1  # full size: 4 ranks x 8 sequences
    assert grad_accum_for(32, 2, 8) == 2  # on 2 nodes: two micro-batches, the same 32 sequences
    assert grad_accum_for(32, 1, 8) == 4
    assert grad_accum_for(32, 3, 8) == 1  # 32 / 24 does not divide: nearest, 24 sequences per step
    assert grad_accum_for(48, 5, 4) == 2  # 48 / 20 = 2.4 -> 2 (40 sequences)
    assert grad_accum_for(8, 16, 1) == 1  # never below one micro-batch


QUEUE = """\
101|RUNNING|2024-05-01T12:10:00|node[3-4]|
102|RUNNING|N/A|node5|
7|PENDING|N/A||node2
"""


def test_parse_queue() -> None:
    jobs = slurm.parse_queue(QUEUE)
    assert [j["id"] for j in jobs] == ["101", "102", "7"]
    assert jobs[0]["nodes"] == ["node3", "node4"] and jobs[0]["end"] is not None
    assert jobs[1]["end"] is None and jobs[2]["excluded"] == ["node2"] and jobs[2]["nodes"] == []


def test_full_size_wait() -> None:
    jobs = slurm.parse_queue(QUEUE)
    end_101 = jobs[0]["end"]
    wait = preempt.full_size_wait_s
    idle = {"node1": "comp", "node2": "comp", "node3": "idle", "node4": "idle", "node5": "alloc"}
    busy = {"node1": "comp", "node2": "comp", "node3": "alloc", "node4": "alloc", "node5": "alloc"}
    # Its own two nodes and two idle ones: all 4 now.
    assert wait(4, "7", ["node1", "node2"], idle, [], end_101) == 0.0
    # Two held by job 101 until its end time: the wait is that end, from now.
    assert wait(4, "8", ["node1", "node2"], busy, jobs, end_101 - 300) == 300.0
    # Job 7 excludes node2: node1 + node3-4 (at 101's end) make 3; the 4th is node5, held with no end: unknown.
    assert wait(4, "7", ["node1", "node2"], busy, jobs, end_101 - 300) is None
    assert wait(3, "7", ["node1", "node2"], busy, jobs, end_101 - 300) == 300.0
    # A lost node of its own (drained, down, not responding) does not come back with the requeue.
    lost = {**idle, "node2": "drng", "node4": "down*"}
    assert wait(3, "8", ["node1", "node2"], lost, [], 0.0) is None
    assert wait(2, "8", ["node1", "node2"], lost, [], 0.0) == 0.0
    assert wait(9, "8", [], busy, jobs, 0.0) is None  # not enough nodes even when everything ends


def test_next_size() -> None:
    assert preempt.next_size(2, 4, 2, 0.0, 600) == {"NumNodes": "4-4", "NumTasks": "8"}  # grow back
    assert preempt.next_size(2, 4, 2, 900.0, 600) == {"NumNodes": "2-4", "NumTasks": "4"}  # go on smaller
    assert preempt.next_size(2, 4, 1, None, 600) == {"NumNodes": "2-4", "NumTasks": "2"}  # unknown: smaller
