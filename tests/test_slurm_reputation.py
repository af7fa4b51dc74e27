"""Node reputation on the real cluster (issue 30): a node that failed the preflight in one run is left out of the
next run's allocation, named in its dry run and its submit line, and listed by `hpc-train nodes`."""

from __future__ import annotations

import json

import pytest
from conftest import HPC_TRAIN, names, read_events, run, submit, wait_finished, wait_until

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("no_node_left_drained")]

ARGS = ["cluster=dev", "cluster.tasks_per_node=1", "train.steps=10", "checkpoint.every_steps=5"]


def test_a_node_that_failed_the_preflight_is_left_out_of_the_next_run(slurm_env: dict[str, str], tmp_path) -> None:
    # Run 1 on node3 only, queued on hold and marked sick before it may start: its first preflight fails there.
    held = [*ARGS, "cluster.nodes=1", "cluster.nodelist=node3", "+cluster.sbatch_extra.hold=''", f"out_dir={tmp_path}"]
    first, first_job = submit([*held, "name=sick"], env=slurm_env)
    try:
        marked = run([HPC_TRAIN, "chaos", str(first), "sick-node", "--node", "node3"], env=slurm_env)
        assert marked.returncode == 0 and "node3 fails every later preflight" in marked.stdout, marked.stderr
        assert run(["scontrol", "release", first_job], env=slurm_env).returncode == 0
        wait_until(
            lambda: any(e["event"] == "node_excluded" for e in read_events(first)), 120, "node3 left out of run 1"
        )
    finally:  # cluster.nodelist requires node3: its requeue would find it sick again and again
        run([HPC_TRAIN, "cancel", str(first)], env=slurm_env)
    verdicts = [e for e in read_events(first) if e["event"] == "preflight" and e["sick"]]
    assert [(e["restart"], list(e["sick"])) for e in verdicts][:1] == [(0, ["node3"])], verdicts

    # Run 2: its dry run names node3 and leaves it out; a job of all 4 nodes keeps it, saying why.
    dry = run([HPC_TRAIN, "submit", "--dry-run", *ARGS, "cluster.nodes=3", f"out_dir={tmp_path}"], env=slurm_env)
    print(dry.stderr)  # docs/operations.md's capture (pytest -s)
    said = "hpc-train submit: leaving out node3 (failed the preflight "
    assert dry.returncode == 0 and said in dry.stderr, dry.stdout + dry.stderr
    assert names(dry.stderr, f" ago in {first})", "cluster.avoid_bad_nodes=false")
    assert "#SBATCH --exclude=node3\n" in dry.stdout, dry.stdout
    full = run([HPC_TRAIN, "submit", "--dry-run", *ARGS, "cluster.nodes=4", f"out_dir={tmp_path}"], env=slurm_env)
    assert full.returncode == 0 and "--exclude" not in full.stdout, full.stdout + full.stderr
    assert names(full.stderr, "in despite its record", "needs 4 of partition debug's 4 usable nodes")

    # ... and queued: 3 of the 4 nodes, never node3.
    second, second_job = submit([*ARGS, "cluster.nodes=3", f"out_dir={tmp_path}", "name=next"], env=slurm_env)
    job = run(["scontrol", "show", "job", "-o", second_job], env=slurm_env).stdout
    assert "ExcNodeList=node3 " in job, job
    wait_finished(second, second_job, slurm_env, timeout_s=240)
    starts = [e["nodes"] for e in read_events(second) if e["event"] == "start"]
    assert starts and all(sorted(s) == ["node1", "node2", "node4"] for s in starts), starts
    nodelist = run(["sacct", "-X", "-n", "-P", "-o", "NodeList", "-j", second_job], env=slurm_env).stdout.split()
    assert nodelist and all(n == "node[1-2,4]" for n in nodelist), nodelist

    listed = run([HPC_TRAIN, "nodes", str(tmp_path)], env=slurm_env)
    print(listed.stdout)  # docs/operations.md's capture
    assert listed.returncode == 0 and "│ node3 │" in listed.stdout and "│ yes, " in listed.stdout, listed.stdout
    rows = json.loads(run([HPC_TRAIN, "nodes", str(tmp_path), "--json"], env=slurm_env).stdout)
    assert [(r["node"], r["left_out"], r["last"], r["run"]) for r in rows] == [("node3", True, "preflight", "sick-1")]
