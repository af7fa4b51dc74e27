"""The job side on the real cluster: topology-aware placement and a rendezvous that fails fast."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from conftest import read_events, submit, wait_finished, wait_until

pytestmark = pytest.mark.slurm


def test_four_nodes_are_placed_by_switch(slurm_env: dict[str, str], tmp_path: Path) -> None:
    """The dev cluster interleaves names across switches (s1 = node1,node3; s2 = node2,node4)."""
    run_dir, job_id = submit(["cluster=dev", "cluster.nodes=4", "train.steps=4", "checkpoint.every_steps=4",
                              f"out_dir={tmp_path}", "name=placed"], env=slurm_env)
    wait_finished(run_dir, job_id, slurm_env)
    plan = json.loads((run_dir / "placement.json").read_text())
    assert plan["nodes"] == ["node1", "node3", "node2", "node4"]
    assert plan["ring_cross_switch_edges"] == {"placed": 2, "slurm_order": 4, "optimum": 2}
    assert [(r["rank"], r["node"], r["switch"]) for r in plan["ranks"]] == [
        (0, "node1", "root.s1"), (1, "node1", "root.s1"), (2, "node3", "root.s1"), (3, "node3", "root.s1"),
        (4, "node2", "root.s2"), (5, "node2", "root.s2"), (6, "node4", "root.s2"), (7, "node4", "root.s2")]
    # Every task agrees: each logged the rank it took, and ran where the plan says.
    logs = "".join(p.read_text() for p in (run_dir / "submitit").glob("*_log.out"))
    placed = {int(r): n for r, n in re.findall(r"placed task \d+ as rank (\d+) on (\w+)", logs)}
    assert placed == {r["rank"]: r["node"] for r in plan["ranks"]}
    start = read_events(run_dir)[0]
    assert start["rank_nodes"] == [r["node"] for r in plan["ranks"]]


def test_wrong_rendezvous_fails_fast_with_the_address(slurm_env: dict[str, str], tmp_path: Path) -> None:
    t0 = time.monotonic()
    run_dir, _ = submit(["cluster=dev", "train.rendezvous_timeout_s=10", "requeue.max_failures=0",
                         "+cluster.env.HPC_TRAIN_MASTER_ADDR=nowhere.invalid", f"out_dir={tmp_path}", "name=lost"],
                        env=slurm_env)
    wait_until(lambda: any(e["event"] == "stopped" for e in read_events(run_dir)), 90, "the run to give up")
    assert time.monotonic() - t0 < 90
    errors = [e["error"] for e in read_events(run_dir) if e["event"] == "fail"]
    assert errors and all(re.search(r"rendezvous at nowhere\.invalid:\d+ failed within train.rendezvous_timeout_s=10",
                                     e) for e in errors)
    assert "127.0.0.1" not in errors[0] and "localhost" not in errors[0]  # no silent fallback
