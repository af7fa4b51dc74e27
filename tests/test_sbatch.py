"""Golden files pin the batch script exactly as submitted. Refresh after an intended change with
    HPC_TRAIN_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/test_sbatch.py
and review the diff."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest
from conftest import names

import hpc_train
from hpc_train.config import compose, to_run_config
from hpc_train.sbatch import render

GOLDEN = Path(__file__).parent / "golden"

SITE = [
    "cluster=slurm",
    "cluster.account=research",
    "cluster.qos=long",
    "cluster.constraint='fast&[rack1|rack2]'",
    "cluster.reservation=maint",
    "cluster.exclusive=true",
    "cluster.mem_per_cpu_gb=2",
    "cluster.gres=gpu:a100:8",
    "cluster.gpus_per_node=8",
    "cluster.tasks_per_node=8",
    "cluster.mail_type='END,FAIL'",
    "cluster.mail_user=me@example.org",
    "cluster.nodelist='gpu[01-02]'",
    "cluster.exclude=gpu03",
    '+cluster.sbatch_extra.comment="it\'s #1 $(x)"',
    "+cluster.sbatch_extra.contiguous=''",
    "+cluster.sbatch_extra.mem_bind=local",
    "+cluster.sbatch_extra.wckey=proj42",
]


@pytest.mark.parametrize(
    "name, overrides, array_size, max_parallel",
    [
        ("dev", ["cluster=dev"], None, None),
        ("dev_spares", ["cluster=dev", "cluster.spare_nodes=1"], None, None),  # 3 nodes allocated, the step on 2
        ("dev_array", ["cluster=dev", '+cluster.env.MSG="it\'s $(x) `y`; z"'], 500, 16),
        (
            "apptainer",
            [
                "cluster=slurm",
                "cluster.template=apptainer",
                "+cluster.template_vars.image=/img/a b.sif",
                "cluster.launcher=[apptainer,exec,--nv,'/img/a b.sif']",
            ],
            None,
            None,
        ),
        (
            "slurm_gpu_setup",
            [
                "cluster=slurm",
                "cluster.gpus_per_node=8",
                "cluster.tasks_per_node=8",
                "cluster.mem_gb=480",
                "cluster.partition=gpu",
                "cluster.setup=['module load cuda/12.4','export NCCL_DEBUG=WARN']",
            ],
            None,
            None,
        ),
        ("site", SITE, None, None),
    ],
)
def test_rendered_script_matches_golden(
    name: str, overrides: list[str], array_size: int | None, max_parallel: int | None
) -> None:
    run = to_run_config(compose(overrides))
    matches_golden(name, render(run.cluster, "golden-1", Path("/runs/golden-1/submitit"), array_size, max_parallel))


def test_a_run_queued_after_others_renders_its_dependency() -> None:
    """`submit --after`: sbatch's --dependency on the stages' current jobs, and --kill-on-invalid-dep=yes so that a
    stage ended where no code of ours sees it never leaves this job pending as DependencyNeverSatisfied."""
    run = to_run_config(compose(["cluster=dev"]))
    path = Path("/runs/golden-1/submitit")
    matches_golden("dev_after", render(run.cluster, "golden-1", path, dependency="afterok:12:13_4,afterany:14"))
    assert "--dependency" not in render(run.cluster, "golden-1", path)


def matches_golden(name: str, script: str) -> None:
    script = script.replace(sys.executable, "/venv/bin/python")  # the golden file is machine-independent
    script = script.replace(str(Path(hpc_train.__file__).resolve().parent), "/venv/hpc_train")  # start.py
    path = GOLDEN / f"{name}.sbatch"
    if os.environ.get("HPC_TRAIN_UPDATE_GOLDEN"):
        path.write_text(script)
    assert path.exists(), f"no golden file {path}; create it with HPC_TRAIN_UPDATE_GOLDEN=1"
    assert script == path.read_text(), (
        f"rendered script differs from {path}; if the change is intended, refresh with "
        f"HPC_TRAIN_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/test_sbatch.py and review the diff"
    )


def test_switches_request() -> None:
    run = to_run_config(compose(["cluster=dev", "cluster.switches='1@30:00'"]))
    script = render(run.cluster, "s-1", Path("/runs/s-1/submitit"))
    assert "#SBATCH --switches=1@30:00\n" in script
    with pytest.raises(ValueError, match=r"cluster.switches='one' is not sbatch's <count>\[@<max wait>\]"):
        to_run_config(compose(["cluster=dev", "cluster.switches=one"]))


def test_every_site_option_is_rendered() -> None:
    """One line per option, values shell-quoted; GPUs only once (--gres, not also --gpus-per-node)."""
    run = to_run_config(compose(SITE))
    script = render(run.cluster, "s-1", Path("/runs/s-1/submitit"))
    for line in [
        "--account=research",
        "--qos=long",
        "--constraint='fast&[rack1|rack2]'",
        "--reservation=maint",
        "--exclusive",
        "--mem-per-cpu=2048M",
        "--gres=gpu:a100:8",
        "--mail-type=END,FAIL",
        "--mail-user=me@example.org",
        "--nodelist='gpu[01-02]'",
        "--exclude=gpu03",
        "--comment='it'\"'\"'s #1 $(x)'",
        "--contiguous",
        "--mem-bind=local",
        "--wckey=proj42",
    ]:
        assert f"#SBATCH {line}\n" in script
    assert "--gpus-per-node" not in script and "--mem=" not in script


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "+cluster.sbatch_extra.mem-bnd=local",
            r"cluster.sbatch_extra.mem-bnd: --mem-bnd is not an sbatch option "
            r"\(sbatch 22.05\); did you mean 'mem-bind'\?",
        ),
        (
            "+cluster.sbatch_extra.acount=x",
            r"--acount is not an sbatch option \(sbatch 22.05\); did you mean 'account'\? "
            r"\(use cluster.account\)",
        ),
        ("+cluster.sbatch_extra.bogus=1", r"--bogus is not an sbatch option \(sbatch 22.05\); see `sbatch --help`"),
        ("+cluster.sbatch_extra.signal=B:TERM@60", r"--signal is hpc_train's own; use cluster.signal_lead_s"),
        ("+cluster.sbatch_extra.requeue=''", r"--requeue is hpc_train's own; every run may be requeued already"),
        (
            "+cluster.sbatch_extra.output=x.log",
            r"--output is hpc_train's own; logs go to the run directory's submitit/",
        ),
        ("+cluster.sbatch_extra.array=0-3", r"--array is hpc_train's own; a sweep \(-m\) renders it"),
        ("+cluster.sbatch_extra.mem=4G", r"--mem is hpc_train's own; use cluster.mem_gb"),
        ("+cluster.sbatch_extra.comment='a\nb'", r"cluster.sbatch_extra.comment='a\\nb' contains a control character"),
        ("+cluster.sbatch_extra.contiguous=yes", r"--contiguous takes no value; set it to ''"),
        ("cluster.mem_per_cpu_gb=2", r"cluster.mem_gb=8.0 and cluster.mem_per_cpu_gb=2.0 are both set"),
        (
            "cluster.gres=gpu:4",
            r"cluster.gres='gpu:4' asks for 4 GPUs per node but cluster.gpus_per_node=0; "
            r"set cluster.gpus_per_node=4",
        ),
        ("cluster.gres='gpu 4'", r"cluster.gres='gpu 4' must be one word"),
        ("cluster.mail_user=me@x.org", r"cluster.mail_user='me@x.org' without cluster.mail_type sends no mail"),
        ("cluster.mail_type='END,SOMETIMES'", r"cluster.mail_type='END,SOMETIMES': \['SOMETIMES'\] not among sbatch's"),
        (
            "cluster.exclude='n[2-3]'",
            r"cluster.nodelist='n\[1-2\]' and cluster.exclude='n\[2-3\]' both name n2; drop it",
        ),
        ("cluster.account='my account'", r"cluster.account='my account' is not a Slurm account name"),
        (
            "+cluster.sbatch_extra.clusters=other",
            r"--clusters is hpc_train's own; status, logs, resume and cancel ask "
            r"the one cluster SLURM_CONF names",
        ),
        ("+cluster.sbatch_extra.M=other", r"--M is hpc_train's own; status, logs"),
        ("+cluster.sbatch_extra.cluster-constraint=x", r"--cluster-constraint is hpc_train's own; status, logs"),
        (
            "+cluster.sbatch_extra.export=NONE",
            r"--export is hpc_train's own; the job must inherit the submitting "
            r"environment \(its Python, SLURM_CONF\); use cluster.env",
        ),
        ("+cluster.sbatch_extra.export-file=f", r"--export-file is hpc_train's own; the job must inherit"),
        ("+cluster.sbatch_extra.get-user-env=''", r"--get-user-env is hpc_train's own; the job must inherit"),
        (
            "+cluster.sbatch_extra.gpus=8",
            r"--gpus is hpc_train's own; one rank per GPU, counted per node; "
            r"use cluster.gpus_per_node",
        ),
        ("+cluster.sbatch_extra.gpus-per-task=1", r"--gpus-per-task is hpc_train's own; one rank per GPU"),
        ("+cluster.sbatch_extra.gpus-per-socket=4", r"--gpus-per-socket is hpc_train's own; one rank per GPU"),
        ("+cluster.sbatch_extra.no-kill=''", r"--no-kill is hpc_train's own; a lost node must end the attempt"),
        ("+cluster.sbatch_extra.uid=0", r"--uid is hpc_train's own; the run directory and its requeues belong"),
        ("+cluster.sbatch_extra.gid=0", r"--gid is hpc_train's own; the run directory and its requeues belong"),
        ("+cluster.sbatch_extra.chdir=/tmp", r"--chdir is hpc_train's own; the frozen config's relative paths"),
        ("+cluster.sbatch_extra.D=/tmp", r"--D is hpc_train's own; the frozen config's relative paths"),
        (
            "+cluster.sbatch_extra.comment='a\\\\b'",
            r"cluster.sbatch_extra.comment='a(\\\\)+b' contains a backslash, "
            r"which sbatch's #SBATCH parser reads as an escape",
        ),
        ("cluster.mem_gb=nan", r"cluster.mem_gb=nan must be > 0 and finite"),
        ("cluster.mem_gb=0", r"cluster.mem_gb=0.0 must be > 0 and finite"),
    ],
)
def test_site_option_errors(override: str, message: str) -> None:
    overrides = (
        ["cluster=slurm", override]
        + (["cluster.mem_gb=8"] if "mem_per_cpu" in override else [])
        + (["cluster.nodelist='n[1-2]'"] if "exclude" in override else [])
    )
    with pytest.raises(ValueError, match=message):
        to_run_config(compose(overrides))


def test_memory_rounds_up_to_a_whole_mib() -> None:
    """int() rendered mem_gb=0.0005 as --mem=0M, which Slurm reads as all of the node's memory."""
    for key, option in (("mem_gb", "mem"), ("mem_per_cpu_gb", "mem-per-cpu")):
        script = render(
            to_run_config(compose(["cluster=slurm", f"cluster.{key}=0.0005"])).cluster,
            "m-1",
            Path("/runs/m-1/submitit"),
        )
        assert f"#SBATCH --{option}=1M\n" in script
        script = render(
            to_run_config(compose(["cluster=slurm", f"cluster.{key}=1.5"])).cluster, "m-1", Path("/runs/m-1/submitit")
        )
        assert f"#SBATCH --{option}=1536M\n" in script


def test_parse_associations() -> None:
    """`sacctmgr -n -P show user root withassoc format=DefaultAccount,Account,Partition,QOS` on the dev
    cluster, plus a partition-only association; "|||": a user with no association on that cluster."""
    from hpc_train.slurm import parse_associations

    text = (
        "research|research||long,normal\nresearch|teamb||long,normal\nresearch|root||normal\nresearch|gpu|a100|normal\n"
    )
    assert parse_associations(text) == (
        "research",
        [
            ("research", "", ["long", "normal"]),
            ("teamb", "", ["long", "normal"]),
            ("root", "", ["normal"]),
            ("gpu", "a100", ["normal"]),
        ],
    )
    assert parse_associations("|||\n") == ("", [])


@pytest.mark.parametrize("conf", ["no controller", "missing file"])
def test_dry_run_without_a_controller_answers_in_seconds(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, conf: str
) -> None:
    """Broken before: every Slurm call retried for ~40 s and the dry run failed. Now it asks the controller
    once (not at all without a slurm.conf), prints the script and says what it could not check, and why."""
    import shutil
    import socket
    import subprocess

    shims, calls = tmp_path_factory.mktemp("clients"), tmp_path_factory.mktemp("calls") / "calls"
    for tool in ("scontrol", "sinfo", "squeue", "sacct", "sacctmgr", "sbatch"):  # each call logged, then made
        if real := shutil.which(tool):
            (shims / tool).write_text(f'#!/bin/sh\necho "{tool} $*" >> {calls}\nexec {real} "$@"\n')
            (shims / tool).chmod(0o755)
    slurm_conf = tmp_path / "slurm.conf"
    if conf == "no controller":
        with socket.socket() as s:  # a port nothing listens on
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        slurm_conf.write_text(f"ClusterName=gone\nSlurmctldHost=localhost(127.0.0.1)\nSlurmctldPort={port}\n")
    proc = subprocess.run(
        [
            str(Path(sys.executable).parent / "hpc-train"),
            "submit",
            "--dry-run",
            "cluster=slurm",
            f"cluster.slurm_conf={slurm_conf}",
            f"out_dir={tmp_path}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PATH": f"{shims}:{os.environ['PATH']}"},
    )
    assert proc.returncode == 0, proc.stderr
    # The seconds it answers in, counted rather than timed: one `scontrol ping` and no retry of it, no other call.
    asked = calls.read_text().splitlines() if calls.exists() else []
    assert asked == (["scontrol ping"] if conf == "no controller" and shutil.which("scontrol") else []), asked
    assert "#SBATCH --signal=USR2@120\n" in proc.stdout
    reason = {
        "no controller": r"`scontrol ping` failed: Slurmctld\(primary\) at \S+ is DOWN"
        r"|`scontrol` is not installed",
        "missing file": rf"SLURM_CONF={slurm_conf} does not exist.*cluster\.slurm_conf",
    }[conf]
    (said,) = [line for line in proc.stdout.splitlines() if line.startswith("# NOT validated")]  # one comment line
    assert re.search(reason, said), said
    unchecked = ("partition", "account", "qos", "constraint", "reservation", "nodelist/exclude", "sbatch --test-only")
    assert names(said.partition("Unchecked: ")[2], *unchecked)
    assert list(tmp_path.iterdir()) == ([slurm_conf] if conf == "no controller" else [])  # nothing written
    if conf == "missing file":  # a real submit says so at once too (the clients would retry reading it for 60 s)
        proc = subprocess.run(
            [
                str(Path(sys.executable).parent / "hpc-train"),
                "submit",
                "cluster=slurm",
                f"cluster.slurm_conf={slurm_conf}",
                f"out_dir={tmp_path}",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 2 and f"error: SLURM_CONF={slurm_conf} does not exist" in proc.stderr, proc.stderr


def test_an_srun_in_the_setup_is_slurms_and_the_training_step_still_runs(tmp_path: Path) -> None:
    """Review: the relay's srun() was defined before cluster.setup, so a staging `srun ... mkdir` there exec'd the
    relay and the batch script ended with it (exit 0, COMPLETED, no training). The rendered script, run with a
    fake srun on PATH: the setup's srun and then the training step's, the second through relay.py."""
    import subprocess

    bin_dir, calls = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(f'#!/bin/bash\necho "$(cat /proc/$PPID/comm) $*" >> {calls}\n')
    (bin_dir / "srun").chmod(0o755)
    stage = f"srun -N1 mkdir -p {tmp_path}/stage"
    run = to_run_config(compose(["cluster=slurm", f"+cluster.setup=[{stage!r}]"]))
    script = tmp_path / "job.sh"
    script.write_text(render(run.cluster, "x-1", tmp_path / "submitit"))
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "5"}
    out = subprocess.run(["bash", str(script)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    (shell, staged), (relay, step) = (line.split(" ", 1) for line in calls.read_text().splitlines())
    assert staged == stage.removeprefix("srun ") and step.endswith(f"hpc_train/start.py {tmp_path / 'submitit'}")
    assert shell == "bash" and relay.startswith("python")  # the step's srun under relay.py (exec'd: one pid)
