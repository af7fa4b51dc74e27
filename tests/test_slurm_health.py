"""A sick node on the real cluster: marked by the drill, found by the next attempt's preflight, left out
with ExcNodeList, and the run finishes elsewhere with the uninterrupted run's weights."""

from __future__ import annotations

import pytest
from conftest import HPC_TRAIN, RUN_ARGS, names, read_events, run, submit, wait_finished, wait_until

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("no_node_left_drained")]


def test_sick_node_is_left_out_and_the_run_finishes_bit_exact(
    slurm_env: dict[str, str], tmp_path, reference: dict
) -> None:
    run_dir, job_id = submit([*RUN_ARGS, f"out_dir={tmp_path}", "name=health"], env=slurm_env)
    wait_until(lambda: any(e["event"] == "checkpoint_committed" for e in read_events(run_dir)), 120, "a checkpoint")
    first = next(e for e in read_events(run_dir) if e["event"] == "start")
    sick = first["rank_nodes"][-1]
    # The requeued job must land on the sick node again, for its preflight to find it: a job of our own holds the
    # other two nodes until then (left free, Slurm once gave the requeued job node1,node3 after node2,node4, and the
    # sick node was never tried). It ends once attempt 1's preflight has spoken, and the run finishes without it.
    others = ",".join(sorted({"node1", "node2", "node3", "node4"} - set(first["nodes"])))
    hold = ["sbatch", "--parsable", "-p", "debug", "-N", "2", "-w", others, "--exclusive", "-t", "10"]
    held_by = run([*hold, "-o", "/dev/null", "--wrap", "sleep 300"], env=slurm_env)
    holder = held_by.stdout.strip()
    assert held_by.returncode == 0 and holder, held_by.stderr
    try:
        held = ["squeue", "-h", "-j", holder, "-o", "%T"]
        wait_until(lambda: run(held, env=slurm_env).stdout.strip() == "RUNNING", 60, f"the job holding {others}")
        marked = run(
            [HPC_TRAIN, "chaos", str(run_dir), "sick-node", "--rank", str(first["world_size"] - 1)], env=slurm_env
        )
        assert marked.returncode == 0 and f"{sick} fails every later preflight" in marked.stdout, (
            marked.stdout + marked.stderr
        )
        assert run([HPC_TRAIN, "chaos", str(run_dir), "requeue"], env=slurm_env).returncode == 0
        wait_until(
            lambda: any(e["event"] == "preflight" and e["restart"] == 1 for e in read_events(run_dir)),
            120,
            "attempt 1's preflight",
        )
    finally:
        run(["scancel", holder], env=slurm_env)

    summary = wait_finished(run_dir, job_id, slurm_env, timeout_s=300)
    assert summary["params_sha256"] == reference["params_sha256"]
    events = read_events(run_dir)
    starts = {e["restart"]: e["nodes"] for e in events if e["event"] == "start"}
    checks = [e for e in events if e["event"] == "preflight"]
    assert all(len(c["nodes"]) == 2 and c["wall_s"] > 0 for c in checks)
    failed = [c for c in checks if c["sick"]]
    assert [(c["restart"], list(c["sick"])) for c in failed] == [(1, [sick])], (
        f"attempt 1 did not land on {sick} (preflights: {[(c['restart'], list(c['nodes'])) for c in checks]}); busy cluster?"
    )
    assert "drills/sick_node." in failed[0]["sick"][sick] and 1 not in starts  # no training on attempt 1
    assert [(e["node"], e["restart"]) for e in events if e["event"] == "node_excluded"] == [(sick, 1)]
    assert [(e["nodes"], e["ok"]) for e in events if e["event"] == "exclude_nodes"] == [(sick, True)]
    assert [e["reason"] for e in events if e["event"] == "requeue" and e["by"] == "hpc_train"] == ["node_health"]
    assert sick in starts[0] and sick not in starts[2]
    job = run(["scontrol", "show", "job", "-o", job_id], env=slurm_env).stdout  # kept MinJobAge=300 s after the end
    assert f"ExcNodeList={sick} " in job, job
    status = run([HPC_TRAIN, "status", str(run_dir)], env=slurm_env)
    print(status.stdout)  # docs/operations.md's capture (pytest -s)
    (line,) = [x for x in status.stdout.splitlines() if x.startswith(f"{run_dir.name}: {sick} left out")]
    assert names(line, "hpc-train chaos sick-node")


def test_a_hung_ranks_node_is_left_out(slurm_env: dict[str, str], tmp_path) -> None:
    """The `hang` drill stops the last rank before its 4th step; the others get past their forward and
    block in backward's all-reduce. Every watchdog fires; the stopped rank's heartbeat count is behind,
    so its node is left out and the next attempt runs elsewhere and finishes. watchdog_s=20: the watchdog is
    armed at the rendezvous, and the set-up before the first step must not reach it on loaded cores."""
    run_dir, job_id = submit(
        [
            "cluster=dev",
            "cluster.tasks_per_node=1",  # 2 ranks, one per node: the hung rank's node is the one to leave out
            "train.steps=30",
            "train.watchdog_s=20",
            "checkpoint.every_steps=10",
            "+cluster.env.HPC_TRAIN_FAULT=hang",
            f"out_dir={tmp_path}",
            "name=hung",
        ],
        env=slurm_env,
    )
    wait_finished(run_dir, job_id, slurm_env, timeout_s=300)
    events = read_events(run_dir)
    starts = {e["restart"]: e for e in events if e["event"] == "start"}
    stopped = starts[0]["rank_nodes"][-1]  # the drill's rank: the last
    excluded = [e for e in events if e["event"] == "node_excluded"]
    assert [(e["node"], e["restart"]) for e in excluded] == [(stopped, 0)], excluded
    assert excluded[0]["why"].startswith(f"rank {starts[0]['world_size'] - 1} on {stopped} hung: ")
    assert [e["reason"] for e in events if e["event"] == "requeue"] == ["failure"]
    assert stopped not in starts[1]["nodes"] and events[-1]["event"] == "finish"
