"""Site options on the real cluster: accounts, QoS and node features set up by tests/cluster.py
(accounts research and teamb, QoS normal and long, Features=cpu,fast on node1 and node2). A run with
them lands with them; a wrong one is refused, with what is valid, before anything is queued."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import cluster
import pytest
from conftest import HPC_TRAIN, read_events, run, submit, wait_finished
from test_packaging import plain_install

pytestmark = pytest.mark.slurm

QUICK = ["cluster=dev", "cluster.tasks_per_node=1", "train.steps=4", "checkpoint.every_steps=4"]  # 1 task: half the CPU


def test_account_qos_constraint_land_on_the_job(slurm_env: dict[str, str], tmp_path: Path) -> None:
    comment = "it's #1 $(x)"  # sbatch_extra, through submitit's quoting and sbatch's own #SBATCH parser
    hydra_quoted = "'" + comment.replace("'", "\\'") + "'"  # Hydra's grammar: \' inside '...'
    run_dir, job_id = submit(
        [
            *QUICK,
            f"out_dir={tmp_path}",
            "name=site",
            "cluster.account=teamb",
            "cluster.qos=long",
            "cluster.constraint=fast",
            f"+cluster.sbatch_extra.comment={hydra_quoted}",
        ],
        env=slurm_env,
    )
    job = run(["scontrol", "show", "job", "-o", job_id], env=slurm_env).stdout
    assert "Account=teamb " in job and "QOS=long " in job and "Features=fast " in job, job
    assert f"Comment={comment} " in job, job
    wait_finished(run_dir, job_id, slurm_env)
    acct = run(["sacct", "-X", "-n", "-P", "-j", job_id, "-o", "Account,QOS,NodeList"], env=slurm_env).stdout.split()
    assert cluster.FAST_NODES == ["node1", "node2"] and acct == ["teamb|long|node[1-2]"]  # only they are fast


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "cluster.account=nope",
            r"cluster.account='nope' is not an account of user \w+ on cluster hpcdev \(partition "
            r"debug\); use cluster.account= one of \['research', 'root', 'teamb'\]",
        ),
        (
            "cluster.qos=huge",
            r"cluster.qos='huge' is not allowed for account research \(your default\) of user \w+; use "
            r"cluster.qos= one of \['long', 'normal'\]",
        ),
        (
            "cluster.constraint=gpu",
            r"cluster.constraint='gpu': no node of partition debug has the feature 'gpu'; "
            r"features there: \['cpu', 'fast'\]",
        ),
        ("cluster.reservation=maint", r"cluster.reservation='maint' does not exist; this cluster has none now"),
        (
            "cluster.nodelist='node[4-5]'",
            r"cluster.nodelist='node\[4-5\]': node5 not in partition debug; its nodes are "
            r"node\[1-4\]",
        ),
    ],
)
def test_wrong_site_option_is_refused_before_anything_is_queued(
    slurm_env: dict[str, str], tmp_path: Path, override: str, message: str
) -> None:
    before = set(run(["squeue", "-h", "-o", "%i"], env=slurm_env).stdout.split())
    proc = run([HPC_TRAIN, "submit", *QUICK, f"out_dir={tmp_path}", override], env=slurm_env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert re.search(r"hpc-train submit: error: " + message, proc.stderr), proc.stderr
    assert list(tmp_path.iterdir()) == []
    assert set(run(["squeue", "-h", "-o", "%i"], env=slurm_env).stdout.split()) <= before


def test_slurm_itself_refuses_an_unknown_account(slurm_env: dict[str, str]) -> None:
    """The dev cluster enforces associations as a real site does: our check is not the only one."""
    proc = run(["sbatch", "--test-only", "--account=nope", "--wrap=true"], env=slurm_env)
    assert proc.returncode != 0 and "Invalid account" in proc.stderr, proc.stderr
    proc = run(["sbatch", "--test-only", "--account=teamb", "--qos=huge", "--wrap=true"], env=slurm_env)
    assert proc.returncode != 0 and "Invalid qos" in proc.stderr, proc.stderr


def test_a_plain_install_in_a_fresh_folder_submits_with_account_and_qos(
    slurm_env: dict[str, str], tmp_path: Path
) -> None:
    """Issue 11's "done when": `pip install .` (not editable), `hpc-train init` in an empty folder, then a
    run on the cluster with account and QoS set; the job trains with the installed copy, not the checkout."""
    site, fresh = plain_install(tmp_path), tmp_path / "fresh"
    fresh.mkdir()
    env = {**slurm_env, "PYTHONPATH": str(site)}
    cli = [sys.executable, "-m", "hpc_train.cli"]
    init = run([*cli, "init"], env=env, cwd=fresh)
    assert init.returncode == 0, init.stdout + init.stderr
    proc = run(
        [*cli, "submit", *QUICK, "name=plain", "cluster.account=teamb", "cluster.qos=long"],
        env=env,
        cwd=fresh,
        timeout_s=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"config {fresh}/conf/config.yaml" in proc.stderr, proc.stderr
    line = next(l for l in proc.stdout.splitlines() if l.startswith("submitted job"))
    job_id, run_dir = line.split()[2].rstrip(";"), Path(line.split("run directory ")[1])
    run_dir = run_dir if run_dir.is_absolute() else fresh / run_dir
    wait_finished(run_dir, job_id, slurm_env)
    acct = run(["sacct", "-X", "-n", "-P", "-j", job_id, "-o", "Account,QOS,State"], env=slurm_env).stdout.split()
    assert acct == ["teamb|long|COMPLETED"], acct
    code = json.loads((run_dir / "code.json").read_text())
    assert code["path"].startswith(str(site)), code
    assert not any(e["event"] == "code_changed" for e in read_events(run_dir))  # the job imported that copy
