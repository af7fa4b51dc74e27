"""Login-node submission against the real cluster: sweeps as arrays, splitting, idempotent resubmit,
validation as the user reads it, and values that must stay inert in the batch script."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import cluster
import pytest
from conftest import HPC_TRAIN, first_start, names, read_events, run, wait_until

pytestmark = pytest.mark.slurm

QUICK = ["cluster=dev", "cluster.tasks_per_node=1", "train.steps=4", "checkpoint.every_steps=4"]  # 1 task: half the CPU


def _sweep(args: list[str], env: dict[str, str], tmp_path: Path, extra: list[str] = ()) -> dict:
    proc = run([HPC_TRAIN, "submit", "-m", *QUICK, f"out_dir={tmp_path}", *args, *extra], env=env, timeout_s=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    sweep_dir = Path(re.search(r"sweep directory (\S+)", proc.stdout).group(1))
    return json.loads((sweep_dir / "sweep.json").read_text())


def _queued_arrays(job_name: str, env: dict[str, str]) -> set[str]:
    """Array job ids of that name that Slurm knows and nobody cancelled."""
    out = run(["sacct", "-n", "-X", "-P", "--name", job_name, "-o", "JobID,State"], env=env).stdout
    ids = [line.split("|")[0] for line in out.splitlines() if line and "CANCELLED" not in line]
    ids += run(["squeue", "-h", "--name", job_name, "-o", "%F"], env=env).stdout.split()
    return {i.split("_")[0] for i in ids}


def _wait_summaries(manifest: dict) -> list[dict]:
    paths = [Path(t["run_dir"]) / "summary.json" for t in manifest["trials"]]
    wait_until(lambda: all(p.exists() for p in paths), 240, "every trial's summary.json")
    return [json.loads(p.read_text()) for p in paths]


def test_two_resource_shapes_land_as_two_arrays(slurm_env: dict[str, str], tmp_path: Path) -> None:
    manifest = _sweep(
        ["name=shapes", "cluster.tasks_per_node=2", "train.lr=1e-3,3e-3", "cluster.nodes=1,2"], slurm_env, tmp_path
    )
    trials = manifest["trials"]
    assert [t["overrides"][-2:] for t in trials] == [
        ["train.lr=0.001", "cluster.nodes=1"],
        ["train.lr=0.001", "cluster.nodes=2"],
        ["train.lr=0.003", "cluster.nodes=1"],
        ["train.lr=0.003", "cluster.nodes=2"],
    ]
    assert len(manifest["arrays"]) == 2
    one_node, two_nodes = (
        {t["job_id"].split("_")[0] for t in trials[0::2]},
        {t["job_id"].split("_")[0] for t in trials[1::2]},
    )
    assert len(one_node) == len(two_nodes) == 1 and one_node != two_nodes
    assert _queued_arrays(manifest["job_name"], slurm_env) == one_node | two_nodes
    assert Path(manifest["sweep_dir"], "sweep.json").stat().st_mode & 0o004  # no cluster.env: readable by all
    _wait_summaries(manifest)
    for t, world in zip(trials, [2, 4, 2, 4]):  # 2 tasks per node: the right tasks really ran
        start = first_start(Path(t["run_dir"]))
        assert start["world_size"] == world and len(set(start["nodes"])) == world // 2


def test_array_larger_than_max_array_size_is_split(slurm_env: dict[str, str], tmp_path: Path) -> None:
    cluster.reconfigure(max_array_size=3)
    try:
        # one node a trial: the split is the point, and 7 trials x 2 ranks cost 43 CPU-s of rank start-ups
        manifest = _sweep(
            ["name=split", "train.seed=range(7)", "cluster.nodes=1"], slurm_env, tmp_path, ["--max-parallel", "2"]
        )
    finally:
        cluster.reconfigure()
    assert [len(a["trials"]) for a in manifest["arrays"]] == [3, 3, 1]
    assert len(_queued_arrays(manifest["job_name"], slurm_env)) == 3
    scripts = [
        Path(manifest["sweep_dir"], "submitit", f"{a['job_id']}_submission.sh").read_text() for a in manifest["arrays"]
    ]
    assert ["#SBATCH --array=0-2%2" in s for s in scripts] == [True, True, False]  # a lone trial is a plain job
    assert len(_wait_summaries(manifest)) == 7


def test_resubmit_adds_only_missing_trials(slurm_env: dict[str, str], tmp_path: Path) -> None:
    """A sweep cut off after its first array (Ctrl-C, controller down): the manifest shows the second
    array unsubmitted. Re-running the same command with --sweep-dir submits exactly that array."""
    args = ["name=resume", "train.seed=1,2", "cluster.nodes=1,2"]
    manifest = _sweep(args, slurm_env, tmp_path)
    sweep_dir = Path(manifest["sweep_dir"])
    first, second = manifest["arrays"]
    cut = json.loads((sweep_dir / "sweep.json").read_text())
    run(["scancel", second["job_id"]], env=slurm_env)  # as if that sbatch had never happened (on a loaded
    # machine it may have started first, so the checks below leave it out of the count)
    cut["arrays"][1]["job_id"] = None
    for i in second["trials"]:
        cut["trials"][i]["job_id"] = None
    (sweep_dir / "sweep.json").write_text(json.dumps(cut))
    again = _sweep(args, slurm_env, tmp_path, ["--sweep-dir", str(sweep_dir)])
    assert again["arrays"][0]["job_id"] == first["job_id"]  # untouched
    assert again["arrays"][1]["job_id"] not in (None, second["job_id"])
    queued = _queued_arrays(manifest["job_name"], slurm_env) - {second["job_id"]}
    assert queued == {first["job_id"], again["arrays"][1]["job_id"]}
    # Died between sbatch and recording the id: the array is found by its job name, nothing is resubmitted.
    lost = json.loads((sweep_dir / "sweep.json").read_text())
    lost["arrays"][1].update(job_id=None, submitting=True)
    (sweep_dir / "sweep.json").write_text(json.dumps(lost))
    adopted = _sweep(args, slurm_env, tmp_path, ["--sweep-dir", str(sweep_dir)])
    assert adopted["arrays"][1]["job_id"] == again["arrays"][1]["job_id"]
    assert _queued_arrays(manifest["job_name"], slurm_env) - {second["job_id"]} == queued  # nothing new
    # Same directory, different sweep: refused.
    proc = run(
        [
            HPC_TRAIN,
            "submit",
            "-m",
            *QUICK,
            f"out_dir={tmp_path}",
            "name=resume",
            "train.seed=7,8",
            "--sweep-dir",
            str(sweep_dir),
        ],
        env=slurm_env,
    )
    assert proc.returncode == 2 and "resubmit it with the same overrides" in proc.stderr


# The submit dies right after sbatch returned: before submitit renamed the task pickles to
# <array>_<task>_submitted.pkl and before the manifest got the array's id.
CRASH_AFTER_SBATCH = """
import os, sys
from submitit.core import utils
utils.JobPaths.move_temporary_file = lambda *a, **k: os._exit(3)
from hpc_train.cli import main
main(sys.argv[1:])
"""


def test_lost_array_whose_pickles_were_never_renamed_runs_every_trial_once(
    slurm_env: dict[str, str], tmp_path: Path
) -> None:
    """Each adopted task waits 60 s for its pickle: the resubmit writes it. A task that already ended
    without starting (here cancelled) is queued again in a new array; no trial runs twice."""
    args = ["name=lost", "train.seed=1,2"]
    crashed = run(
        [sys.executable, "-c", CRASH_AFTER_SBATCH, "submit", "-m", *QUICK, f"out_dir={tmp_path}", *args], env=slurm_env
    )
    assert crashed.returncode == 3, crashed.stdout + crashed.stderr
    sweep_dir = next(tmp_path.glob("lost-*"))
    manifest = json.loads((sweep_dir / "sweep.json").read_text())
    assert manifest["arrays"] == [{"trials": [0, 1], "job_id": None, "submitting": True}]
    (lost,) = _queued_arrays(manifest["job_name"], slurm_env)
    assert not list((sweep_dir / "submitit").glob("*_submitted.pkl"))
    run(["scancel", f"{lost}_1"], env=slurm_env)
    wait_until(
        lambda: (
            f"{lost}_1"
            not in run(["squeue", "-h", "-r", "--name", manifest["job_name"], "-o", "%i"], env=slurm_env).stdout.split()
        ),
        30,
        f"task {lost}_1 to end",
    )
    again = _sweep(args, slurm_env, tmp_path, ["--sweep-dir", str(sweep_dir)])
    first, second = (t["job_id"] for t in again["trials"])
    assert first == f"{lost}_0" and (sweep_dir / "submitit" / f"{lost}_0_submitted.pkl").exists()
    assert second.split("_")[0] != lost
    assert _queued_arrays(manifest["job_name"], slurm_env) == {lost, second.split("_")[0]}
    _wait_summaries(again)
    for t in again["trials"]:
        starts = [e["job_id"] for e in read_events(Path(t["run_dir"])) if e["event"] == "start"]
        assert starts == [t["job_id"]]


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "cluster.partition=gpu",
            r"cluster.partition='gpu' does not exist on this cluster; use one of \['debug', 'high', 'low'\]",
        ),
        ("cluster.nodes=5", r"cluster.nodes=5 exceeds partition debug's limit of 4 nodes; use cluster.nodes<=4"),
        (
            "cluster.timeout_min=90",
            r"cluster.timeout_min=90 exceeds partition debug's MaxTime of 60 min; use cluster.timeout_min<=60",
        ),
        (
            "cluster.tasks_per_node=8",
            r"cluster.tasks_per_node=8 x cluster.cpus_per_task=1 = 8 CPUs per node, but partition debug's nodes have at most 4",
        ),
        ("cluster.gpus_per_node=2", r"cluster.gpus_per_node=2 but partition debug's nodes have at most 0 GPUs"),
        (
            "cluster.mem_gb=100",
            r"sbatch --test-only refused the request for partition debug: .*Requested node configuration is not available",
        ),
        (  # `low` preempts with GraceTime=30 (tests/cluster.py): the wait for Slurm's requeue would end first
            "cluster.partition=low cluster.preempt_grace_s=10",
            r"cluster.preempt_grace_s=10 is shorter than partition low's GraceTime of 30 s: a preempted run whose "
            r"requeue fails would exit before Slurm requeues it; set cluster.preempt_grace_s=30",
        ),
    ],
)
def test_validation_errors_queue_nothing(
    slurm_env: dict[str, str], tmp_path: Path, override: str, message: str
) -> None:
    before = set(run(["squeue", "-h", "-o", "%i"], env=slurm_env).stdout.split())
    proc = run([HPC_TRAIN, "submit", "cluster=dev", f"out_dir={tmp_path}", *override.split()], env=slurm_env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert re.search(message, proc.stderr), proc.stderr
    assert list(tmp_path.iterdir()) == []
    assert set(run(["squeue", "-h", "-o", "%i"], env=slurm_env).stdout.split()) <= before  # nothing new queued


def test_resume_only_warns_of_a_grace_time_raised_since_the_submit(
    slurm_env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run frozen with preempt_grace_s=10 before the site raised `low`'s GraceTime to 30: resume cannot
    change the frozen value, so refusing would strand the run for good (adversarial review). It checks the
    rest as submit does and says what the short grace costs."""
    from hpc_train import sbatch

    for k, v in slurm_env.items():
        monkeypatch.setenv(k, v)
    cluster = sbatch.ClusterConfig(executor="slurm", partition="low", tasks_per_node=1, preempt_grace_s=10)
    script = sbatch.render(cluster, "grace", tmp_path / "submitit")
    with pytest.raises(ValueError, match="set cluster.preempt_grace_s=30"):
        sbatch.validate_live(cluster, script, 1, None)
    warnings: list[str] = []
    assert sbatch.validate_live(cluster, script, 1, None, warnings=warnings) == []
    (warning,) = warnings
    assert names(
        warning, "cluster.preempt_grace_s=10", "partition low", "GraceTime of 30 s", "cluster.preempt_grace_s=30"
    )


def test_max_parallel_must_be_positive(slurm_env: dict[str, str], tmp_path: Path) -> None:
    proc = run(
        [HPC_TRAIN, "submit", "-m", *QUICK, f"out_dir={tmp_path}", "train.seed=1,2", "--max-parallel", "0"],
        env=slurm_env,
    )
    assert proc.returncode == 2 and "--max-parallel=0 must be >= 1" in proc.stderr


def test_injection_strings_stay_inert(slurm_env: dict[str, str], tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    evil = f'it\'s "$(touch {marker})" `touch {marker}`; touch {marker}'
    out_dir = tmp_path / "dir with space;$(touch x)"
    hydra_quoted = "'" + evil.replace("'", "\\'") + "'"  # Hydra's grammar: \' inside '...'
    proc = run(
        [
            HPC_TRAIN,
            "submit",
            *QUICK,
            f"out_dir='{out_dir}'",
            "name=inert",
            f"+cluster.env.EVIL={hydra_quoted}",
            'cluster.setup=[\'printf "EVIL=%s\\\\n" "$EVIL"\']',
        ],
        env=slurm_env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_dir = out_dir / "inert-1"
    wait_until(lambda: (run_dir / "summary.json").exists(), 120, "the job to finish")
    log = next((run_dir / "submitit").glob("*_0_log.out")).read_text()
    assert f"EVIL={evil}\n" in log  # printed literally by the batch shell
    assert not marker.exists() and not (tmp_path / "x").exists()


def test_submit_rides_out_a_controller_restart(slurm_env: dict[str, str], tmp_path: Path) -> None:
    """slurmctld goes down for 3 s just as a sweep is submitted: Slurm's clients wait for it (and our
    calls retry with backoff beyond that), and the sweep lands once, complete."""
    import threading

    outage = threading.Thread(target=cluster.restart_controller, args=(3.0,))
    outage.start()
    wait_until(lambda: run(["scontrol", "ping"], env=slurm_env).returncode != 0, 30, "slurmctld to be down", 0.1)
    proc = run(
        [HPC_TRAIN, "submit", "-m", *QUICK, f"out_dir={tmp_path}", "name=outage", "train.seed=1,2"],
        env=slurm_env,
        timeout_s=120,
    )
    outage.join()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    manifest = json.loads(next(tmp_path.glob("outage-*/sweep.json")).read_text())
    assert all(t["job_id"] for t in manifest["trials"])
    assert len(_queued_arrays(manifest["job_name"], slurm_env)) == 1
    assert len(_wait_summaries(manifest)) == 2
