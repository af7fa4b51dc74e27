"""Elastic resume (cluster.min_nodes): the node-range render, the accumulation rule, the queue estimate
and the next attempt's size (pure, plain data); then 4 -> 2 -> 4 nodes on the dev cluster."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from conftest import read_events, run, submit, wait_finished, wait_until

from hpc_train import decision, journal, preempt, requeue, slurm
from hpc_train.config import compose, to_run_config
from hpc_train.sbatch import render


def test_min_nodes_renders_a_node_range() -> None:
    run = to_run_config(compose(["cluster=dev", "cluster.nodes=4", "cluster.min_nodes=2"]))
    assert "#SBATCH --nodes=2-4\n" in render(run.cluster, "e-1", Path("/runs/e-1/submitit"))
    run = to_run_config(compose(["cluster=dev", "cluster.nodes=4", "cluster.min_nodes=4"]))
    assert "#SBATCH --nodes=4\n" in render(run.cluster, "e-1", Path("/runs/e-1/submitit"))
    # No --ntasks-per-node in the header (sbatch would set ntasks = 2 x 1 and Slurm never gives more nodes
    # than tasks): the tasks' CPUs per node as --mincpus, and srun places the ranks.
    run = to_run_config(
        compose(
            [
                "cluster=dev",
                "cluster.nodes=4",
                "cluster.min_nodes=2",
                "cluster.tasks_per_node=2",
                "cluster.cpus_per_task=3",
            ]
        )
    )
    script = render(run.cluster, "e-1", Path("/runs/e-1/submitit"))
    assert "--ntasks-per-node" not in script.split("# command")[0] and "#SBATCH --mincpus=6\n" in script
    (srun,) = [line.split() for line in script.splitlines() if line.startswith("srun ")]
    assert srun[:5] == ["srun", "--unbuffered", "--output", "/runs/e-1/submitit/%j_%t_log.out", "--ntasks-per-node=2"]
    assert "\nunset SLURM_NTASKS SLURM_NPROCS\n" in script  # an salloc shell's count would override the layout
    # A fixed-size run may still ask for --mincpus of its own; an elastic one at least its ranks' CPUs.
    run = to_run_config(compose(["cluster=dev", "+cluster.sbatch_extra.mincpus=8"]))
    assert "#SBATCH --mincpus=8\n" in render(run.cluster, "e-1", Path("/runs/e-1/submitit"))
    run = to_run_config(
        compose(["cluster=dev", "cluster.nodes=4", "cluster.min_nodes=2", "+cluster.sbatch_extra.mincpus=8"])
    )
    assert "#SBATCH --mincpus=8\n" in render(run.cluster, "e-1", Path("/runs/e-1/submitit"))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["cluster=dev", "cluster.nodes=2", "cluster.min_nodes=3"],
            r"cluster.min_nodes=3 must be between 1 and cluster.nodes=2",
        ),
        (["cluster=dev", "cluster.min_nodes=0"], r"cluster.min_nodes=0 must be between 1"),
        (["cluster=local", "cluster.min_nodes=2"], r"cluster.min_nodes=2 must be between 1 and cluster.nodes=1"),
        (["requeue.shrink_after_s=-1"], r"requeue.shrink_after_s=-1.0 must be >= 0"),
        (
            [
                "cluster=dev",
                "cluster.nodes=4",
                "cluster.min_nodes=2",
                "cluster.tasks_per_node=2",
                "+cluster.sbatch_extra.mincpus=1",
            ],
            r"cluster.sbatch_extra.mincpus=1 is below the 2 x 1 CPUs an elastic run's ranks need on each node",
        ),
        (
            ["cluster=dev", "cluster.nodes=4", "cluster.min_nodes=2", "+cluster.sbatch_extra.use_min_nodes=''"],
            r"--use-min-nodes is hpc_train's own; an elastic run",
        ),
    ],
)
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
    # Just back from `scontrol update State=RESUME`, a node shows idle* until it answers the controller's
    # ping (~1 s; seen on the dev cluster): Slurm starts nothing on it yet, so neither does the estimate.
    resumed = {**idle, "node3": "idle*"}
    assert wait(4, "8", ["node1", "node2"], resumed, [], 0.0) is None
    assert preempt.free_now(["node1", "node2"], resumed, []) == {"node1", "node2", "node4"}


def test_short_state() -> None:
    """scontrol's State as the estimate reads it (sinfo's own %t said "mix" for a resumed idle node)."""
    got = {
        s: slurm.short_state(s)
        for s in (
            "IDLE",
            "IDLE+NOT_RESPONDING",
            "MIXED",
            "MIXED+DRAIN",
            "IDLE+DRAIN",
            "ALLOCATED+COMPLETING",
            "DOWN+NOT_RESPONDING",
            "IDLE+POWERED_DOWN",
        )
    }
    assert list(got.values()) == ["idle", "idle*", "mix", "drng", "drain", "comp", "down*", "pow"]
    assert preempt.usable_nodes(dict(zip(got, got.values()))) == {"IDLE", "MIXED", "ALLOCATED+COMPLETING"}


def test_not_free_says_why() -> None:
    jobs = slurm.parse_queue(QUEUE)
    states = {"node1": "mix", "node2": "drng", "node3": "alloc", "node4": "alloc", "node5": "idle*", "node6": "idle"}
    free = preempt.free_now(["node1", "node2"], states, preempt.job_excluded("7", jobs))
    assert free == {"node1", "node6"}
    # node2: its own, drained under it and excluded; node3-5: held by running jobs (in the wait, not here).
    assert preempt.not_free("7", states, free, jobs) == {"node2": "drng excluded"}
    assert preempt.not_free("8", states, free, []) == {
        "node2": "drng",
        "node3": "alloc",
        "node4": "alloc",
        "node5": "idle*",
    }


def test_next_size() -> None:
    assert preempt.next_size(2, 4, 2, 0.0, 600) == {"NumNodes": "4-4", "NumTasks": "8"}  # grow back
    assert preempt.next_size(2, 4, 2, 900.0, 600) == {"NumNodes": "2-2", "NumTasks": "4"}  # go on smaller
    assert preempt.next_size(2, 4, 2, 900.0, 600, free_now=3) == {"NumNodes": "3-3", "NumTasks": "6"}  # what is free
    assert preempt.next_size(2, 4, 2, 900.0, 600, free_now=1) == {"NumNodes": "2-2", "NumTasks": "4"}  # >= min_nodes
    assert preempt.next_size(2, 4, 1, None, 600) == {"NumNodes": "2-2", "NumTasks": "2"}  # unknown: smaller


# 4 nodes x 1 rank, down to 2 nodes (cluster.min_nodes) and back: 4 -> 2 -> 4 nodes. 0.25 s per step
# lets a stop signal land mid-run.
ELASTIC_ARGS = [
    "cluster=dev",
    "cluster.nodes=4",
    "cluster.min_nodes=2",
    "cluster.tasks_per_node=1",
    "model=tiny",
    "train.steps=80",
    "train.min_step_time_s=0.25",
    "checkpoint.every_steps=20",
    "train.log_every_steps=1",
    "requeue.shrink_after_s=30",
]
LOSS_RTOL = 1e-4  # measured: 6.2e-8 worst step relative to the uninterrupted run (gloo, CPU)


def last_loss_per_step(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}  # a step redone after a requeue: its last value


def all_idle(env: dict[str, str]) -> bool:
    return run(["sinfo", "-h", "-p", "debug", "-t", "idle", "-o", "%D"], env=env).stdout.strip() == "4"


def node_state(node: str, env: dict[str, str]) -> str:
    """As the estimate reads it (slurm.queue_snapshot): the controller's State, in sinfo's short form."""
    return slurm.short_state(
        slurm.parse_key_values(run(["scontrol", "show", "node", node, "-o"], env=env).stdout)["State"]
    )


@pytest.mark.slurm
@pytest.mark.usefixtures("no_node_left_drained")
def test_shrink_and_grow_back_across_two_requeues(slurm_env: dict[str, str], tmp_path: Path) -> None:
    """Attempt 0 on all 4 idle nodes (--nodes=2-4); two of them are lost (drained) and the run is preempted:
    the requeue goes on with the 2 left (global batch kept by 2 micro-batches); the nodes come back and a
    second preemption grows it back to 4. Loss within LOSS_RTOL of an uninterrupted run; data position exact
    at every start."""
    # The reference without the 0.25 s steps (they only sleep): the same losses, 20 s sooner.
    ref_dir, ref_job = submit(
        [*ELASTIC_ARGS, "cluster.min_nodes=null", "train.min_step_time_s=0", f"out_dir={tmp_path}", "name=ref"],
        env=slurm_env,
    )
    ref = wait_finished(ref_dir, ref_job, slurm_env)
    wait_until(lambda: all_idle(slurm_env), 60, "4 idle nodes")
    lost = ["node3", "node4"]  # lost under the run (a failed switch, say): drained nodes never come back by themselves
    drained = False
    try:
        run_dir, job_id = submit([*ELASTIC_ARGS, f"out_dir={tmp_path}", "name=elastic"], env=slurm_env)

        def seen(event: str, restart: int) -> bool:
            return any(e["event"] == event and e["restart"] == restart for e in read_events(run_dir))

        def preempt() -> None:
            proc = run(["scancel", "--signal=TERM", job_id], env=slurm_env)
            assert proc.returncode == 0, proc.stderr

        wait_until(lambda: seen("checkpoint_committed", 0), 120, "a checkpoint in attempt 0")
        nodes = next(e for e in read_events(run_dir) if e["event"] == "start")["nodes"]
        assert sorted(nodes) == ["node1", "node2", "node3", "node4"], nodes  # the range's max when all are free
        drained = True
        for node in lost:
            proc = run(["scontrol", "update", f"NodeName={node}", "State=DRAIN", "Reason=elastic-test"], env=slurm_env)
            assert proc.returncode == 0, proc.stderr
        preempt()
        # Not a commit: the stop saves its own step, and 0.25 s x 20 steps is all the margin a commit leaves.
        wait_until(lambda: seen("first_step", 1), 180, "attempt 1 training")
        for node in lost:
            run(["scontrol", "update", f"NodeName={node}", "State=RESUME"], env=slurm_env)
        # Resumed, a node is IDLE+NOT_RESPONDING until it answers the controller's ping (~1 s): neither
        # Slurm nor the estimate counts it before, and a preemption in that second goes on with 2 nodes again.
        states: list[list[str]] = []
        try:
            wait_until(
                lambda: states.append([node_state(n, slurm_env) for n in lost]) or states[-1] == ["idle"] * 2,
                30,
                f"{lost} idle",
            )
        except AssertionError as e:
            show = run(["scontrol", "show", "node", *lost], env=slurm_env).stdout
            queue = run(["squeue", "-a", "-t", "all", "-o", "%i %T %N %C %e"], env=slurm_env).stdout
            raise AssertionError(f"{e}; scontrol said {states[:3]} ... {states[-3:]}\n{show}\n{queue}") from None
        preempt()
        summary = wait_finished(run_dir, job_id, slurm_env, timeout_s=240)
    finally:
        if drained:
            for node in lost:
                run(["scontrol", "update", f"NodeName={node}", "State=RESUME"], env=slurm_env)
    events = read_events(run_dir)
    starts = [e for e in events if e["event"] == "start"]
    requeues = [e for e in events if e["event"] == "requeue"]
    assert [s["world_size"] for s in starts] == [4, 2, 4], [(s["world_size"], s["nodes"]) for s in starts]
    assert [sorted(s["nodes"]) for s in starts] == [sorted(nodes), ["node1", "node2"], sorted(nodes)]
    assert [r["nodes_next"] for r in requeues] == ["2-2", "4-4"], requeues
    # Why, in the event: its own drained nodes never come back by themselves (no estimate), so it goes on with
    # the two free now; at the second requeue all four are free (no wait).
    assert requeues[0]["full_size_wait_s"] is None and requeues[1]["full_size_wait_s"] == 0.0, requeues
    assert requeues[0]["not_free"] == {n: "drng" for n in lost} and requeues[0]["free_nodes"] == ["node1", "node2"]
    assert requeues[1]["free_nodes"] == sorted(nodes) and requeues[1]["not_free"] == {}, requeues
    assert not any("nodes_update_error" in r for r in requeues), requeues
    assert [s.get("resharded_from") for s in starts] == [None, 4, 2]
    assert starts[1]["fresh_rng_ranks"] == [] and starts[2]["fresh_rng_ranks"] == [2, 3]
    global_seqs = 4 * 8  # 4 ranks x batch_seqs_per_rank 8 x grad_accum_steps 1
    assert [(s["grad_accum_steps"], s["global_batch_seqs"]) for s in starts] == [(1, 32), (2, 32), (1, 32)]
    for s in starts:  # no sequence skipped or repeated: the position is exactly step x global batch
        assert s["data"]["position"] == s["step"] * global_seqs, s
        assert s["tokens_seen"] == s["step"] * global_seqs * 32  # tiny: seq_len 32
    assert not [e for e in events if e["event"] == "batch_changed"]
    assert summary["final_step"] == ref["final_step"] == 80
    want, got = last_loss_per_step(ref_dir), last_loss_per_step(run_dir)
    assert sorted(got) == sorted(want) == list(range(1, 81))
    worst = max(abs(got[s] - want[s]) / abs(want[s]) for s in want)
    print(f"worst relative loss difference over 80 steps: {worst:.2e}")
    assert worst <= LOSS_RTOL


@pytest.mark.slurm
def test_elastic_header_places_two_ranks_of_two_cpus_per_node(slurm_env: dict[str, str], tmp_path: Path) -> None:
    """--mincpus=4 instead of --ntasks-per-node: the first attempt gets both idle nodes and srun places
    2 ranks of 2 CPUs on each (a node has 4), with the submitting shell's SLURM_NTASKS=1 (an salloc) unset."""
    wait_until(lambda: all_idle(slurm_env), 60, "4 idle nodes")
    run_dir, job_id = submit(
        [
            "cluster=dev",
            "cluster.nodes=2",
            "cluster.min_nodes=1",
            "cluster.tasks_per_node=2",
            "cluster.cpus_per_task=2",
            "model=tiny",
            "train.steps=5",
            f"out_dir={tmp_path}",
            "name=header",
        ],
        env={**slurm_env, "SLURM_NTASKS": "1", "SLURM_NPROCS": "1"},
    )
    summary = wait_finished(run_dir, job_id, slurm_env)
    assert summary["final_step"] == 5
    start = next(e for e in read_events(run_dir) if e["event"] == "start")
    assert start["world_size"] == 4 and len(set(start["nodes"])) == 2, start
    script = next((run_dir / "submitit").glob("*.sh")).read_text()
    assert "#SBATCH --mincpus=4\n" in script and "#SBATCH --nodes=1-2\n" in script


def test_the_runs_own_exclusions_are_not_counted_free(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by an adversarial read: node4 left out by the run, its ExcNodeList not set (the update failed,
    or Slurm requeued the job itself) and idle: it was counted free, the wait was 0 and the next attempt
    asked for 4-4 on 3 usable nodes (pending for good on this 4-node partition)."""
    from types import SimpleNamespace

    states = {f"node{i}": "idle" for i in range(1, 5)}
    for snapshot_jobs in (
        [{"id": "7", "state": "RUNNING", "end": None, "nodes": ["node1", "node2", "node3"], "excluded": []}],
        [],
    ):  # the job in squeue's answer, or not
        monkeypatch.setattr(slurm, "queue_snapshot", lambda partition, job_id, policy: (states, snapshot_jobs))
        env = SimpleNamespace(executor="slurm", job_id="7", nodes=("node1", "node2", "node3", "node4"))
        cfg = to_run_config(compose(["cluster=dev", "cluster.nodes=4", "cluster.min_nodes=2"]))
        facts = decision.Facts(
            "time_limit",
            True,
            [],
            "running",
            cfg.requeue,
            None,
            None,
            [],
            job_id="7",
            nodes=env.nodes,
            queue=requeue.snapshot(env, cfg, True),
        )
        wait = decision.queue_wait(facts, cfg, ["node4"])
        assert wait == (None, {"free_nodes": ["node1", "node2", "node3"], "not_free": {"node4": "idle excluded"}})
        size, fields = decision.next_size(facts, cfg, ["node4"])
        assert size == {"NumNodes": "3-3", "NumTasks": "6"} and fields["nodes_next"] == "3-3"


def test_collectives_outlast_the_hang_watchdog() -> None:
    """Found by an adversarial read: with the collective timeout equal to train.watchdog_s (both 900 s by
    default), gloo's own timeout usually fired before the watchdog (it polls every <= 5 s): the hang went down
    as an ordinary failure and the hung node was not left out."""
    from hpc_train.preempt import collective_timeout_s

    for watchdog_s in (1.0, 8.0, 900.0):
        assert collective_timeout_s(watchdog_s) >= watchdog_s + min(5.0, watchdog_s / 10) + 30  # + the blame's wait


def test_exclusion_and_next_size_go_in_one_scontrol_update(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both land or neither: ExcNodeList alone, with NumNodes lost, left NumTasks=8 on too few usable nodes.
    (The real update is exercised by the dev-cluster tests; this pins how the fields are combined.)"""
    from types import SimpleNamespace

    from hpc_train import slurm

    calls: list[dict[str, str]] = []
    answer = [""]
    monkeypatch.setattr(slurm, "update_job", lambda job_id, fields: calls.append(fields) or answer[0])
    events: list[tuple[str, dict]] = []
    record = lambda name, **f: events.append((name, f))  # noqa: E731
    monkeypatch.setattr(slurm, "node_states", lambda partition, policy: {})  # the partition unknown: all stay out
    env = SimpleNamespace(executor="slurm", job_id="7")
    cluster = SimpleNamespace(exclude="node9", nodelist=None, nodes=2, spare_nodes=0, min_nodes=1, partition="debug")
    size = {"NumNodes": "2-2", "NumTasks": "4"}
    assert requeue.update_next_attempt(env, cluster, ["node3"], size, record) == ""
    assert calls == [{"ExcNodeList": "node3,node9", "NumNodes": "2-2", "NumTasks": "4"}]
    assert events == [("exclude_nodes", {"nodes": "node3,node9", "ok": True})]
    answer[0] = "scontrol did not answer"
    assert requeue.update_next_attempt(env, cluster, [], size, record) == "scontrol did not answer"
    assert calls[-1] == size and len(events) == 1  # no exclusion: no exclude_nodes event
    assert requeue.update_next_attempt(env, cluster, [], {}, record) == "" and len(calls) == 2  # nothing to set


STATES = ["idle", "idle", "alloc", "mix", "comp", "drng", "drain", "down*", "idle*", "resv"]


def random_snapshot(rng: random.Random) -> tuple[str, list[str], dict[str, str], list[dict]]:
    """One queue snapshot as slurm.queue_snapshot gives it: node states, this job (id "7") with its own nodes
    and ExcNodeList, other running jobs on disjoint nodes with an end time or none."""
    nodes = [f"node{i}" for i in range(1, rng.randint(2, 9))]
    states = {n: rng.choice(STATES) for n in nodes}
    rest = list(nodes)
    rng.shuffle(rest)
    own = [rest.pop() for _ in range(rng.randint(1, len(rest)))]
    jobs = [
        {
            "id": "7",
            "state": "PENDING",
            "end": None,
            "nodes": [],
            "excluded": rng.sample(nodes, rng.randint(0, min(2, len(nodes)))),
        }
    ]
    while rest and rng.random() < 0.8:
        held = [rest.pop() for _ in range(rng.randint(1, len(rest)))]
        jobs.append(
            {
                "id": str(100 + len(jobs)),
                "state": rng.choice(["RUNNING", "RUNNING", "RUNNING", "PENDING"]),
                "end": None if rng.random() < 0.25 else 1000.0 + rng.randint(0, 3600),
                "nodes": held,
                "excluded": [],
            }
        )
        for n in held:  # mostly busy, sometimes lost under the other job
            states[n] = rng.choice(["alloc", "mix", "alloc", "mix", "comp", rng.choice(STATES)])
    return "7", own, states, jobs


@pytest.mark.parametrize("seed", range(200))
def test_elastic_decisions_random_snapshots(seed: int) -> None:
    """Random snapshots: what the estimate and the next size must always hold. The free nodes are ones Slurm
    could start on now (idle, or the job's own not lost) and never excluded; the wait is the first moment
    enough usable nodes are free, None exactly when running jobs with end times never free enough; every
    node is free, held by another job or listed in not_free with its state; the next size is an exact
    count in [min_nodes, nodes] with NumTasks = count x tasks_per_node, the full size exactly when the wait
    is known and within shrink_after_s."""
    rng = random.Random(seed)
    job_id, own, states, jobs = random_snapshot(rng)
    need, now = rng.randint(1, len(states) + (rng.random() < 0.1)), 1000.0
    excluded = preempt.job_excluded(job_id, jobs)
    usable = preempt.usable_nodes(states)
    free = preempt.free_now(own, states, excluded)
    assert free <= ({n for n, st in states.items() if st == "idle"} | set(own)) and free <= usable
    assert not free & set(excluded)
    wait = preempt.full_size_wait_s(need, job_id, own, states, jobs, now)
    running = [j for j in jobs if j["id"] != job_id and j["state"] == "RUNNING"]

    def free_at(t: float) -> set[str]:  # free now plus the usable nodes of jobs ended by t
        return free | {n for j in running if j["end"] is not None and j["end"] <= t for n in j["nodes"]} & usable - set(
            excluded
        )

    if wait is None:
        assert len(free_at(float("inf"))) < need
    else:
        assert (wait == 0.0) == (len(free) >= need)
        assert len(free_at(now + wait)) >= need  # enough by then ...
        earlier = [j["end"] for j in running if j["end"] is not None and j["end"] < now + wait]
        assert all(len(free_at(t)) < need for t in earlier)  # ... and not at any earlier end
    held = {n for j in running for n in j["nodes"]}
    nf = preempt.not_free(job_id, states, free, jobs)
    assert set(states) == free | held | set(nf) and not set(nf) & (free | held)
    assert all(st.split()[0] == states[n] and (st.endswith(" excluded") == (n in excluded)) for n, st in nf.items())
    min_nodes = rng.randint(1, need)
    tpn, shrink_after_s = rng.choice([1, 2, 8]), rng.choice([0.0, 30.0, 600.0])
    size = preempt.next_size(min_nodes, need, tpn, wait, shrink_after_s, len(free))
    low, high = map(int, size["NumNodes"].split("-"))
    assert low == high and min_nodes <= low <= need and int(size["NumTasks"]) == low * tpn
    if wait is not None and wait <= shrink_after_s:
        assert low == need
    else:
        assert low == min(need, max(min_nodes, len(free)))


@pytest.mark.parametrize("seed", range(200))
def test_exclusion_random_histories(seed: int) -> None:
    """Random histories of sick nodes, exclusions that took or not, and resumes: a node once left out stays
    out until a resume; never more nodes out than the budget allows (or the partition spares); a run stops
    only for a node sick again after its exclusion took or was set twice; one answer at a time."""
    rng = random.Random(seed)
    nodes = [f"node{i}" for i in range(1, 7)]
    events: list[dict] = []
    budget = rng.choice([0, 1, 2, 4])
    for _ in range(rng.randint(0, 12)):
        sick = {n: "ecc" for n in rng.sample(nodes, rng.randint(1, 2))}
        spare = rng.choice([None, 0, 1, 2, 5])
        before = journal.excluded_nodes(events)
        out, why_not, stop = preempt.exclusion(events, sick, budget, spare)
        assert not (why_not and stop)
        if stop:
            node = next(n for n in sick if n in before and f"{n} failed again" in stop)
            took, times = journal.exclusion_took(events, node)
            assert took or times >= 2
            assert out == []
            events.append({"event": "resume", "restart": 0})  # a person fixed it
            continue
        assert set(before) <= set(out) and out == sorted(out)
        new = set(out) - set(before)
        if new:
            assert new == set(sick) - set(before) and not why_not
            assert len(out) <= budget and (spare is None or len(out) <= spare)
        else:
            assert set(out) == set(before)
            assert bool(why_not) == bool(set(sick) - set(before))  # a new sick node not left out says why
        for n in new:
            events.append({"event": "node_excluded", "node": n, "why": sick[n]})
        if new or rng.random() < 0.3:  # the scontrol update lands, or not
            events.append({"event": "exclude_nodes", "nodes": ",".join(out), "ok": rng.random() < 0.7})
        if rng.random() < 0.1:
            events.append({"event": "resume", "restart": 0})
    assert len(journal.excluded_nodes(events)) <= budget
