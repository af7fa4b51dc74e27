"""Node reputation across runs (reputation.py): verdicts folded out of journals, their decay, what a submit leaves
out for them (never so many that the job cannot be placed), and the sentences `hpc-train submit` and `hpc-train
nodes` print. The dev-cluster proof is tests/test_slurm_reputation.py."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from conftest import HPC_TRAIN, fake_clients, names, run

from hpc_train import preempt, reputation
from hpc_train.reputation import HALF_LIFE_S, THRESHOLD, Record, Verdict

NOW = 1_800_000_000.0
H = 3600.0
SICK = "marked sick by `hpc-train chaos sick-node` (drills/sick_node.node3)"


def ev(event: str, t: float, restart: int = 0, **fields: Any) -> dict[str, Any]:
    return {"event": event, "time": t, "step": -1, "job_id": "7", "restart": restart, **fields}


def preflight(t: float, restart: int, sick: dict[str, str], passed: list[str]) -> dict[str, Any]:
    nodes = {n: {"sick": ""} for n in passed} | {n: {"sick": why} for n, why in sick.items()}
    return ev("preflight", t, restart, nodes=nodes, sick=sick)


def write_journal(run_dir: Path, events: list[dict[str, Any]], tail: str = "") -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "events.jsonl"
    path.write_text("".join(json.dumps(e, sort_keys=True) + "\n" for e in events) + tail)
    return path


def cluster(**kw: Any) -> SimpleNamespace:
    base = dict(partition="debug", nodes=2, spare_nodes=0, exclude=None, nodelist=None, reservation=None)
    base |= dict(constraint=None, gpus_per_node=0, tasks_per_node=2, cpus_per_task=1)
    return SimpleNamespace(**base | kw)


PARTS = {"debug": {"PartitionName": "debug", "Default": "YES", "Nodes": "node[1-4]"}}
NODES = {f"node{i}": {"NodeName": f"node{i}", "CPUTot": "8", "State": "IDLE"} for i in range(1, 5)}


# ---- verdicts out of a journal ---------------------------------------------------------------------------


def test_each_kind_of_verdict_is_read_once_per_node_and_attempt() -> None:
    events = [
        preflight(NOW - 5 * H, 1, {"node3": SICK}, ["node1"]),
        ev("node_excluded", NOW - 5 * H + 1, 1, node="node3", why=SICK),  # the same verdict: the preflight's
        ev(
            "node_excluded",
            NOW - 4 * H,
            2,
            node="node2",
            why="rank 3 on node2 hung: 8 heartbeats while the others reached 9",
        ),
        ev("node_excluded", NOW - 3 * H, 3, node="node4", why="node4 left the job's allocation, a node failure (...)"),
        ev(
            "node_not_excluded",
            NOW - 2 * H,
            4,
            nodes=["node5"],
            why="rank 0 on node5 failed with a hardware error (Xid)",
        ),
        ev("straggler", NOW - H, 5, rank=1, node="node6", own_s=0.028, median_own_s=0.0077),
        ev("straggler", NOW - H, 5, rank=2, node="node7", own_s=0.028, median_own_s=0.0077),
        ev("straggler_cleared", NOW - H + 60, 5, rank=2, node="node7"),  # back to speed: not the node
        ev("node_excluded", NOW, 6, node=["not", "a", "name"], why="edited by hand"),  # names no node
    ]
    found, passed = reputation.verdicts(events, "runs/a-1")
    assert [(v.node, v.kind, v.attempt) for v in found] == [
        ("node3", "preflight", 1),
        ("node2", "hang", 2),
        ("node4", "lost", 3),
        ("node5", "hardware", 4),
        ("node6", "straggler", 5),
    ]
    assert found[0].why == SICK and found[0].run == "runs/a-1"
    assert names(found[-1].why, "rank 1", "straggler", "28.0 ms/step", "median 7.7 ms")
    assert passed == {"node1": NOW - 5 * H}


def test_a_later_passed_preflight_clears_a_failed_one_but_not_a_hang() -> None:
    hang = "rank 1 on node3 hung: 2 heartbeats while the others reached 3"
    record = Record(
        verdicts=[
            Verdict("node3", "preflight", SICK, NOW - 2 * H, "r", 0),
            Verdict("node4", "hang", hang, NOW - 2 * H, "r", 0),
            Verdict("node2", "preflight", SICK, NOW - 2 * H, "r", 0),
        ],
        passed={"node3": NOW - H, "node4": NOW - H, "node2": NOW - 3 * H},  # node2 passed before it failed
    )
    score = reputation.scores(record, NOW)
    assert score["node3"] == 0.0 and score["node4"] >= THRESHOLD and score["node2"] >= THRESHOLD


def test_one_failed_preflight_keeps_a_node_out_for_one_half_life() -> None:
    record = Record(verdicts=[Verdict("node3", "preflight", SICK, NOW, "r", 0)])
    assert reputation.scores(record, NOW + 0.99 * HALF_LIFE_S)["node3"] >= THRESHOLD
    assert reputation.scores(record, NOW + 1.01 * HALF_LIFE_S)["node3"] < THRESHOLD
    assert reputation.out_for_s(reputation.scores(record, NOW)["node3"]) == pytest.approx(HALF_LIFE_S)
    twice = Record(verdicts=[*record.verdicts, Verdict("node3", "hang", "", NOW, "r", 1)])
    assert reputation.out_for_s(reputation.scores(twice, NOW)["node3"]) == pytest.approx(2 * HALF_LIFE_S)
    # one straggler naming is not enough alone, two on the day are
    slow = [Verdict("node5", "straggler", "", NOW - 60, "r", i) for i in range(2)]
    assert reputation.scores(Record(verdicts=slow[:1]), NOW)["node5"] < THRESHOLD
    assert reputation.scores(Record(verdicts=slow), NOW)["node5"] >= THRESHOLD


# ---- seeded random histories: the invariants ------------------------------------------------------------


def random_record(rng: random.Random, nodes: list[str]) -> Record:
    kinds = list(reputation.WEIGHTS)
    verdicts = [
        Verdict(rng.choice(nodes), rng.choice(kinds), "", NOW - rng.uniform(-HALF_LIFE_S, 8 * HALF_LIFE_S), "r", i)
        for i in range(rng.randint(0, 12))
    ]
    passed = {n: NOW - rng.uniform(0, 3 * HALF_LIFE_S) for n in nodes if rng.random() < 0.3}
    return Record(verdicts=verdicts, passed=passed)


@pytest.mark.parametrize("seed", range(300))
def test_random_histories_decay_and_never_leave_out_more_than_the_partition_can_spare(seed: int) -> None:
    rng = random.Random(seed)
    nodes = [f"n{i}" for i in range(rng.randint(1, 8))]
    record = random_record(rng, nodes)
    now = NOW + rng.uniform(-HALF_LIFE_S, HALF_LIFE_S)
    score = reputation.scores(record, now)
    later = reputation.scores(record, now + rng.uniform(0, 3 * HALF_LIFE_S))
    assert all(later[n] <= score[n] + 1e-12 for n in score)  # decay only ever lowers a score
    assert all(s >= 0 for s in score.values())
    most = {n: sum(reputation.WEIGHTS[v.kind] for v in record.verdicts if v.node == n) for n in score}
    assert all(score[n] <= most[n] + 1e-12 for n in score)  # a verdict from another node's future weighs as new
    states = {n: rng.choice(["idle", "idle", "mix", "alloc", "drain", "down*", "idle*"]) for n in nodes}
    exclude = {n for n in nodes if rng.random() < 0.15}
    required = {n for n in nodes if n not in exclude and rng.random() < 0.15}
    need = rng.randint(1, len(nodes))
    out, back, kept = reputation.leave_out(score, states, need, exclude, required)
    bad = {n for n, s in score.items() if s >= THRESHOLD and n not in exclude}
    usable = preempt.usable_nodes(states) - exclude
    assert set(out) <= bad - required and not set(out) & set(back)  # only bad nodes, never a required one
    assert set(kept) == bad & required and set(out) | set(back) | set(kept) == bad
    if len(usable) >= need:  # the job stays placeable
        assert len(usable - set(out)) >= need
    everyone = set(states) - exclude  # of every state: Slurm refuses an --exclude that leaves fewer than the job
    if out:
        assert len(everyone - set(out)) >= need
    if len(everyone) - len(bad - required - usable) >= need:  # a drained or down bad node costs nothing: out
        assert bad - required - usable <= set(out)
    back_usable = [score[n] for n in back if n in usable]
    if back_usable:  # room made by letting the lowest scores back in first (a drained one costs none: it stays out)
        assert max(back_usable) <= min((score[n] for n in out if n in usable), default=float("inf"))


def test_avoid_adds_after_the_users_exclude_and_counts_only_nodes_that_can_take_the_job() -> None:
    record = Record(verdicts=[Verdict(f"node{i}", "hang", "", NOW - H * i, "runs/x-1", 0) for i in (2, 3)])
    value, said = reputation.avoid(cluster(exclude="node1"), record, PARTS, NODES, NOW)
    out, kept = said.split("; keeping ")  # what is left out, then what is kept and why
    assert value == "node1,node2" and names(out, "leaving out node2", "(hung 2 h ago in runs/x-1)"), said
    assert names(kept, "node3 (hung 3 h ago in runs/x-1)", "needs 2", "partition debug's 3"), said
    # node4 cannot take a 16-CPU task set: only node1..3 count, node1 excluded by the user, so both bad ones stay
    small = NODES | {"node4": {**NODES["node4"], "CPUTot": "2"}}
    value, said = reputation.avoid(cluster(exclude="node1", tasks_per_node=4), record, PARTS, small, NOW)
    assert (
        value == "node1" and said.startswith("keeping ") and names(said, "node2 (hung 2 h ago", "node3 (hung 3 h ago")
    )
    value, said = reputation.avoid(cluster(reservation="maint"), record, PARTS, NODES, NOW)
    assert value is None and names(said, "cluster.reservation=maint", "own nodes")
    value, said = reputation.avoid(cluster(partition="other"), record, PARTS, NODES, NOW)  # validate_live says it
    assert (value, said) == (None, "")
    elsewhere = Record(verdicts=[Verdict("gpu7", "hang", "", NOW, "r", 0)])  # another partition's node
    assert reputation.avoid(cluster(), elsewhere, PARTS, NODES, NOW) == (None, "")


def test_features_and_gpus_decide_which_nodes_count() -> None:
    nodes = {
        "node1": {"CPUTot": "8", "State": "IDLE", "AvailableFeatures": "fast", "Gres": "gpu:a100:4"},
        "node2": {"CPUTot": "8", "State": "IDLE+DRAIN", "AvailableFeatures": "fast,ib", "Gres": "gpu:a100:4"},
        "node3": {"CPUTot": "8", "State": "MIXED", "AvailableFeatures": "slow", "Gres": "gpu:2"},
    }
    assert reputation.eligible(cluster(constraint="fast"), PARTS["debug"], nodes) == {"node1": "idle", "node2": "drain"}
    assert set(reputation.eligible(cluster(constraint="[fast|slow]"), PARTS["debug"], nodes)) == {
        "node1",
        "node2",
        "node3",
    }
    assert set(reputation.eligible(cluster(constraint="fast&ib"), PARTS["debug"], nodes)) == {"node2"}
    assert set(reputation.eligible(cluster(gpus_per_node=4, tasks_per_node=4), PARTS["debug"], nodes)) == {
        "node1",
        "node2",
    }


# ---- the harvest ------------------------------------------------------------------------------------------


def test_the_harvest_reads_runs_and_sweep_trials_skips_damage_and_keeps_its_bounds(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    now = time.time()
    runs = tmp_path / "runs"
    write_journal(
        runs / "demo-1",
        [ev("checkpoint_committed", now - 60), preflight(now - 50, 0, {"node3": SICK}, ["node1"])],
        tail='{"event": "node_excluded", "node": "node9", "ti',  # torn: its writer still writing
    )
    damaged = write_journal(runs / "demo-2", [ev("node_excluded", now - 40, 0, node="node2", why="x")])
    damaged.write_text('{"event": "preflight", oops\n' + damaged.read_text())  # an edited line
    (runs / "mix-1").mkdir()
    (runs / "mix-1" / "sweep.json").write_text("{}")
    write_journal(runs / "mix-1" / "0003", [ev("node_excluded", now - 30, 0, node="node4", why="x")])
    (runs / "latest").symlink_to(runs / "demo-1")  # read once
    old = write_journal(runs / "old-1", [ev("node_excluded", now - 30, 0, node="node5", why="x")])
    os.utime(old, (now - 8 * 86400, now - 8 * 86400))  # untouched for 8 days: not read
    record = reputation.harvest(runs, now)
    assert sorted(v.node for v in record.verdicts) == ["node2", "node3", "node4"]
    assert record.journals == 3 and record.left == 0 and record.passed == {"node1": now - 50}
    assert "skipped 1 line(s) of" in capsys.readouterr().err
    assert reputation.harvest(runs, now, max_journals=1).left == 2
    assert reputation.harvest(runs / "mix-1", now).journals == 1  # a sweep
    assert reputation.harvest(runs / "demo-1", now).journals == 1  # a run


# ---- what the user reads ------------------------------------------------------------------------------------

FAKE = {
    "scontrol": """case "$*" in
  ping*) echo "Slurmctld(primary) at fake is UP";;
  "show partition -o") echo "PartitionName=debug Default=YES State=UP TotalNodes=4 MaxNodes=UNLIMITED MaxTime=UNLIMITED Nodes=node[1-4]";;
  "show node -o") for i in 1 2 3 4; do echo "NodeName=node$i CPUTot=8 State=IDLE"; done;;
  "show config") printf 'ClusterName = fake\\nMaxArraySize = 1001\\n';;
  *) echo "scontrol $*: not faked" >&2; exit 1;;
esac""",
    "sbatch": """echo "sbatch: Job 1 to start at 2026-01-01T00:00:00 using 4 processors on nodes node1 in partition debug" >&2""",
    "srun": "exit 0",
}


@pytest.fixture()
def project(tmp_path: Path) -> tuple[dict[str, str], list[str], Path]:
    """(env with fake Slurm clients, submit's overrides, the project's runs folder holding one run whose preflight
    found node3 sick 2 h ago)."""
    bin_dir, _ = fake_clients(tmp_path, FAKE)
    (tmp_path / "slurm.conf").write_text("ClusterName=fake\n")
    runs = tmp_path / "runs"
    write_journal(runs / "health-1", [preflight(time.time() - 2 * H, 1, {"node3": SICK}, ["node1"])])
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    return env, ["cluster=slurm", f"cluster.slurm_conf={tmp_path / 'slurm.conf'}", f"out_dir={runs}"], runs


def test_a_dry_run_names_the_node_it_leaves_out_and_writes_nothing(project: tuple) -> None:
    env, overrides, runs = project
    before = sorted(runs.rglob("*"))
    proc = run([HPC_TRAIN, "submit", "--dry-run", *overrides, "cluster.nodes=2"], env=env)
    assert proc.returncode == 0, proc.stderr
    (said,) = [line for line in proc.stderr.splitlines() if line.startswith("hpc-train submit: leaving out ")]
    assert names(said, "node3", "failed the preflight 2 h ago", f"{runs}/health-1", "cluster.avoid_bad_nodes=false")
    assert "#SBATCH --exclude=node3\n" in proc.stdout and "  exclude: node3\n" in proc.stdout  # the frozen config
    assert sorted(runs.rglob("*")) == before
    mine = run([HPC_TRAIN, "submit", "--dry-run", *overrides, "cluster.exclude=node1"], env=env)
    assert "#SBATCH --exclude=node1,node3\n" in mine.stdout, mine.stdout + mine.stderr  # the user's first
    off = run([HPC_TRAIN, "submit", "--dry-run", *overrides, "cluster.avoid_bad_nodes=false"], env=env)
    assert off.returncode == 0 and "leaving out" not in off.stderr and "--exclude" not in off.stdout, off.stderr


def test_a_job_that_needs_every_node_keeps_the_bad_one_and_says_why(project: tuple) -> None:
    env, overrides, runs = project
    proc = run([HPC_TRAIN, "submit", "--dry-run", *overrides, "cluster.nodes=3", "cluster.spare_nodes=1"], env=env)
    assert proc.returncode == 0, proc.stderr
    (said,) = [line for line in proc.stderr.splitlines() if line.startswith("hpc-train submit: keeping ")]
    assert names(said, "node3", "failed the preflight 2 h ago", f"{runs}/health-1", "needs 4", "debug's 4 usable")
    assert "--exclude" not in proc.stdout


def test_hpc_train_nodes_lists_the_table_and_json(project: tuple) -> None:
    env, _, runs = project
    proc = run([HPC_TRAIN, "nodes", str(runs)], env=env)
    assert proc.returncode == 0, proc.stderr
    print(proc.stdout)
    assert max(len(line) for line in proc.stdout.splitlines() if str(runs) not in line) <= 100
    (row,) = [line for line in proc.stdout.splitlines() if line.startswith("│ node3 ")]
    assert [c.strip() for c in row.strip("│").split("│")] == [
        "node3",
        "0.94",
        "yes, 22 h more",
        "1",
        "preflight, 2 h ago",
        "health-1",
    ]
    assert f"node3: {SICK}\n" in proc.stdout and names(proc.stdout, "1 journal(s)", f"under {runs}", "last 7 d")
    rows = json.loads(run([HPC_TRAIN, "nodes", str(runs), "--json"], env=env).stdout)
    assert [(r["node"], r["left_out"], r["last"], r["run"]) for r in rows] == [("node3", True, "preflight", "health-1")]
    empty = run([HPC_TRAIN, "nodes", str(runs / "health-1" / "nope")], env=env)
    assert empty.returncode == 2 and names(empty.stderr, "nope is not a folder", "(out_dir)")


def test_hpc_train_nodes_never_imports_torch(project: tuple) -> None:
    env, _, runs = project
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "hpc_train.cli", "nodes", str(runs)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert "torch" not in {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if "|" in line}


def test_a_dry_run_without_a_controller_says_the_bad_nodes_were_not_left_out(project: tuple, tmp_path: Path) -> None:
    env, overrides, runs = project
    proc = run([HPC_TRAIN, "submit", "--dry-run", *overrides, f"cluster.slurm_conf={tmp_path / 'gone.conf'}"], env=env)
    assert proc.returncode == 0, proc.stderr
    (line,) = [line for line in proc.stdout.splitlines() if line.startswith("# NOT validated: nodes ")]
    assert names(line, "bad record", f"(hpc-train nodes {runs})", "not left out")
    assert "--exclude" not in proc.stdout and "leaving out" not in proc.stderr


def test_review_findings_a_drained_node_a_run_sick_everywhere_and_a_line_without_restart() -> None:
    """Review: (1) a bad node that is drained was left out of a job needing every node of the partition: Slurm
    refuses such an --exclude or holds the job for good, where it would have waited for the repair; (2) a preflight
    that found every node sick (the run's own setup: N GPUs for M tasks) marked them all bad for a day; (3) a
    preflight line without `restart` gave a KeyError traceback in every submit."""
    from hpc_train import reputation

    states = {"n1": "idle", "n2": "idle", "n3": "drain", "n4": "idle"}
    assert reputation.leave_out({"n3": 1.0}, states, 4, [], [])[0] == []
    assert reputation.leave_out({"n3": 1.0}, states, 3, [], [])[0] == ["n3"]
    everywhere = {"time": 10.0, "event": "preflight", "step": -1, "restart": 0}
    everywhere |= {"nodes": {"n1": {}, "n2": {}}, "sick": {"n1": "4 GPUs for 8 tasks", "n2": "4 GPUs for 8 tasks"}}
    one = {"time": 10.0, "event": "preflight", "step": -1, "nodes": {"n1": {}, "n2": {}}, "sick": {"n2": "Xid 79"}}
    found, _ = reputation.verdicts([everywhere, one], "runs/x-1")
    assert [v.node for v in found] == ["n2"]


def test_a_journal_with_an_infinite_time_or_markup_in_a_name_never_crashes_nodes(tmp_path: Path) -> None:
    """A verdict at time Infinity (json reads it) raised OverflowError in the rows and kept its node out for as long
    as the journal stayed; a node named "n2[/x]" was rich markup (MarkupError). Neither is an event / markup now."""
    runs = tmp_path / "runs"
    now = time.time()
    write_journal(runs / "inf-1", [preflight(now, 0, {"node9": SICK}, [])], tail="")
    (runs / "inf-1" / "events.jsonl").write_text(
        (runs / "inf-1" / "events.jsonl").read_text().replace(f'"time": {now}', '"time": Infinity')
    )
    write_journal(runs / "odd[x]-1", [preflight(now - H, 0, {"n2[/x]": SICK}, [])])
    proc = run([HPC_TRAIN, "nodes", str(runs)])
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    rows = json.loads(run([HPC_TRAIN, "nodes", str(runs), "--json"]).stdout)
    assert [r["node"] for r in rows] == ["n2[/x]"]  # node9's verdict is no event: skipped with a warning
    assert any(line.startswith("│ n2[/x] ") for line in proc.stdout.splitlines()), proc.stdout
