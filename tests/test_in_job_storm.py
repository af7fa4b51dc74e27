"""Issue 20's proof on the dev cluster (tests/in_job_storm.py): a seeded storm of 4 faults, one of each kind
(a killed rank, a hung rank, a lost node, a sick node), on 2 nodes + 2 spares of the 4-node `debug`
partition, with a competing job queued that would take any node given back. It proves: every fault was
recovered inside the one allocation (an in_job_restart each, the node faults leaving their node out for a
spare; no requeue, Slurm's Restarts=0, one job id in the events), the competing job never ran while the
run did, each attempt resumed from the newest committed checkpoint, no committed checkpoint was deleted
before a newer one was good, and the run ended with the uninterrupted run's params_sha256.
HPC_TRAIN_STORM_SEED replays another sequence; the seed is printed."""

from __future__ import annotations

import os
from pathlib import Path

import in_job_storm
import pytest

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("no_node_left_drained")]


def test_a_fault_storm_is_recovered_inside_the_allocation(slurm_env: dict[str, str], tmp_path: Path) -> None:
    seed = int(os.environ.get("HPC_TRAIN_STORM_SEED", "2026"))
    print(f"\nin-job storm seed {seed} (replay: HPC_TRAIN_STORM_SEED={seed})")
    result = in_job_storm.run_storm(slurm_env, tmp_path, seed, n_faults=4, steps=120)
    figures = in_job_storm.figures(result)
    print(f"in-job storm figures: {figures}")
    violations = in_job_storm.check(result)
    assert not violations, f"seed {seed}: {violations}"
    assert figures["faults"] == 4 and figures["finished"]
    assert sorted(f["fault"] for f in figures["per_fault"]) == sorted(in_job_storm.FAULTS)
