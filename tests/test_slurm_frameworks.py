"""Framework scripts launched unchanged (`submit ... -- CMD`) on the dev cluster, 2 nodes x 1 rank, each stopped
once and finished from its framework's own checkpoint (issue 29): a PyTorch Lightning Trainer (DDP,
ModelCheckpoint, fit(ckpt_path="last")) that saves at the TERM itself, and a Hugging Face Trainer (a tiny GPT-2
from a config, train(resume_from_checkpoint=...)) that has no handler and resumes from its last checkpoint-N/
folder. pip install -e '.[frameworks]' brings both; without them the module skips."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest
from conftest import HPC_TRAIN, read_events, run, submit, wait_finished, wait_until

# find_spec, not pytest.importorskip: every xdist worker collects this module, and importorskip would import
# pytorch_lightning (5 s of CPU on this 2-core machine) in each of the 4 workers before any test runs
for _package in ("pytorch_lightning", "transformers", "accelerate"):
    if importlib.util.find_spec(_package) is None:
        pytest.skip(f"{_package} is not installed: pip install -e '.[frameworks]'", allow_module_level=True)

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("no_node_left_drained")]

SCRIPTS = Path(__file__).resolve().parent / "scripts"
# 2 ranks on 2 nodes (a rank's start here is ~5 s of CPU, mostly the frameworks' imports); one thread each:
# OMP_NUM_THREADS is ours only at several ranks a node, and accelerate sizes an unset one to all cores; the hub
# never asked (the models are built from configs in the scripts)
COMMON = [
    "cluster=dev",
    "cluster.tasks_per_node=1",
    "+cluster.env.OMP_NUM_THREADS=1",
    "+cluster.env.HF_HUB_OFFLINE=1",
    "+cluster.env.TRANSFORMERS_OFFLINE=1",
]


def starts(run_dir: Path) -> list[dict]:
    return [e for e in read_events(run_dir) if e["event"] == "start"]


def attempt_logs(run_dir: Path) -> dict[int, str]:
    """Every task's output (the frameworks' stdout and stderr), by attempt: each attempt opens with our header."""
    out: dict[int, str] = {}
    for path in sorted((run_dir / "submitit").glob("*_log.out")):
        parts = re.split(r"^==== hpc_train attempt (\d+) rank \d+ ====$", path.read_text(errors="replace"), flags=re.M)
        for attempt, text in zip(parts[1::2], parts[2::2]):
            out[int(attempt)] = out.get(int(attempt), "") + text
    return out


def chaos(run_dir: Path, action: str, env: dict[str, str]) -> None:
    proc = run([HPC_TRAIN, "chaos", str(run_dir), action], env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def script_lines(log: str, prefix: str) -> list[dict[str, str]]:
    """The scripts' own `PREFIX key=value ...` lines, one dict each. A value ends at the first character that is
    not a word's: the child's stdout and stderr reach one log as they come, so a warning on stderr can land
    between a print's text and its newline (two writes, unbuffered)."""
    return [dict(re.findall(r"(\w+)=([\w-]+)", m.group(1))) for m in re.finditer(rf"^{prefix} (.*)$", log, re.M)]


def test_a_lightning_script_saves_at_the_stop_and_resumes_from_last(slurm_env: dict[str, str], tmp_path: Path) -> None:
    cmd = [sys.executable, str(SCRIPTS / "lightning_train.py"), "--ckpt-dir", "{ckpt_dir}", "--max-steps", "60"]
    run_dir, job_id = submit(
        [*COMMON, f"out_dir={tmp_path}", "name=lightning", "script.checkpoint='{ckpt_dir}/last*.ckpt'", "--", *cmd],
        env=slurm_env,
    )
    ckpt_dir = run_dir / "script_checkpoints"
    wait_until(lambda: (ckpt_dir / "last.ckpt").exists(), 120, "Lightning's first save (step 10)", every_s=0.1)
    chaos(run_dir, "time-limit", slurm_env)  # USR2 to our ranks; every child gets TERM, Lightning's default
    wait_finished(run_dir, job_id, slurm_env)  # summary.json, and COMPLETED in sacct

    events = read_events(run_dir)
    assert events[-1]["event"] == "finish"
    assert [e["sent"] for e in events if e["event"] == "signal"] == ["TERM"]
    first, *later = starts(run_dir)
    assert first["resumed_from"] is None and later
    assert later[-1]["resumed_from"] == str(ckpt_dir / "last.ckpt")
    logs = attempt_logs(run_dir)
    stopped, resumed = logs[first["restart"]], logs[later[-1]["restart"]]
    # Lightning's own words: the TERM seen, the attempt's end raised on every rank; the restore
    assert stopped.count("Received SIGTERM") == 2 and "finished at step" not in stopped, stopped[-3000:]
    assert f"Restored all states from the checkpoint at {ckpt_dir / 'last.ckpt'}" in resumed
    # Nothing after the last step of the stopped attempt was lost: save_on_exception saved at the TERM (or the
    # step-10 save had just run: "already saved at the last step", no second save), and every rank went on from it
    last_step = re.findall(r"^step (\d+) loss", stopped, re.M)[-1]
    lines = {attempt: script_lines(text, "lightning") for attempt, text in logs.items()}
    assert int(last_step) > 0 and {line["start_step"] for line in lines[later[-1]["restart"]]} == {last_step}, lines
    assert "finished at step 60" in resumed
    # Lightning's global rank is the RANK we placed, on the node placement chose for it, in every attempt
    for start in starts(run_dir):
        ours = lines[start["restart"]]
        assert sorted(int(line["global_rank"]) for line in ours) == list(range(start["world_size"])) == [0, 1], ours
        for line in ours:
            assert line["global_rank"] == line["RANK"] and line["world_size"] == "2", line
            assert line["node"] == start["rank_nodes"][int(line["RANK"])], (line, start["rank_nodes"])


def test_a_hugging_face_trainer_resumes_from_its_last_checkpoint_folder(
    slurm_env: dict[str, str], tmp_path: Path
) -> None:
    # Saves every 20 steps of >= 0.15 s (3 s apart) and the stop right after the first: the Trainer writes a
    # checkpoint-N/ in place, and a TERM inside that write would leave a folder it cannot resume from
    cmd = [
        sys.executable,
        str(SCRIPTS / "hf_train.py"),
        "--out",
        "{ckpt_dir}",
        "--max-steps",
        "50",
        "--save-every",
        "20",
    ]
    run_dir, job_id = submit(
        [*COMMON, f"out_dir={tmp_path}", "name=hf", "script.checkpoint='{ckpt_dir}/checkpoint-*/'", "--", *cmd],
        env=slurm_env,
    )
    first_save = run_dir / "script_checkpoints" / "checkpoint-20" / "trainer_state.json"  # the save's last file
    wait_until(first_save.exists, 120, "the Trainer's first save (checkpoint-20)", every_s=0.1)
    chaos(run_dir, "preempt", slurm_env)  # TERM to every task: the Trainer has no handler, it dies
    wait_finished(run_dir, job_id, slurm_env)

    events = read_events(run_dir)
    assert events[-1]["event"] == "finish"
    first, *later = starts(run_dir)
    assert first["resumed_from"] is None and later
    found = re.fullmatch(rf"{re.escape(str(run_dir))}/script_checkpoints/checkpoint-(\d+)", later[-1]["resumed_from"])
    assert found and int(found.group(1)) >= 20, later[-1]["resumed_from"]
    step = found.group(1)
    resumed = attempt_logs(run_dir)[later[-1]["restart"]]
    # the Trainer's own words, and the step every process began the last attempt at: the folder we named
    assert f"Resuming training from checkpoint with epoch 0 and global step {step}" in resumed, resumed[-3000:]
    lines = script_lines(resumed, "hf")
    assert sorted(line["process_index"] for line in lines) == ["0", "1"], lines
    assert all(line["process_index"] == line["RANK"] and line["start_step"] == step for line in lines), lines
    assert "finished at step 50" in resumed
