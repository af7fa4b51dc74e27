"""Checkpoint folders on disk: what counts, what resume picks, what retention keeps."""

from __future__ import annotations

import json
from pathlib import Path

from hpc_train.checkpoint import MARKER, _manifest, apply_retention, pick_resume, step_dir, verify
from hpc_train.config import CheckpointConfig

from conftest import HPC_TRAIN, read_events, run


def fake_checkpoint(root: Path, step: int, reason: str = "periodic", commit: bool = True) -> Path:
    folder = step_dir(root, step)
    folder.mkdir(parents=True)
    (folder / "__0_0.distcp").write_bytes(bytes(range(256)) * 4)
    (folder / ".metadata").write_bytes(b"meta")
    if commit:
        (folder / MARKER).write_text(json.dumps({"step": step, "reason": reason, "files": _manifest(folder)}))
    return folder


def test_resume_skips_torn_and_corrupt_checkpoints(tmp_path: Path) -> None:
    good = fake_checkpoint(tmp_path, 20)
    corrupt = fake_checkpoint(tmp_path, 40)
    fake_checkpoint(tmp_path, 60, commit=False)  # torn: the job died before the marker
    data = bytearray((corrupt / "__0_0.distcp").read_bytes())
    data[100] ^= 0xFF  # one flipped byte, same size
    (corrupt / "__0_0.distcp").write_bytes(data)
    folder, skipped = pick_resume(tmp_path)
    assert folder == good
    assert skipped == ["step_000040: __0_0.distcp checksum differs from the manifest"]
    (good / ".metadata").unlink()
    assert verify(good) == ".metadata is missing"
    assert pick_resume(tmp_path)[0] is None


def test_retention_keeps_last_k_every_nth_and_only_the_newest_stop_save(tmp_path: Path) -> None:
    for step, reason in [(10, "periodic"), (20, "periodic"), (23, "stop"), (30, "periodic"), (33, "stop"),
                         (40, "periodic"), (50, "periodic")]:
        fake_checkpoint(tmp_path, step, reason)
    fake_checkpoint(tmp_path, 45, commit=False)  # torn, older than the newest commit
    fake_checkpoint(tmp_path, 55, commit=False)  # maybe still being written: left alone
    apply_retention(tmp_path, CheckpointConfig(keep_last=2, keep_every_steps=20))
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step_000020", "step_000040", "step_000050", "step_000055"]
    fake_checkpoint(tmp_path, 52, "stop")
    apply_retention(tmp_path, CheckpointConfig(keep_last=2, keep_every_steps=20))
    assert "step_000052" in {p.name for p in tmp_path.iterdir()}  # the newest, even a stop save, stays


def test_local_crash_loop_stops_after_failure_budget(tmp_path: Path) -> None:
    proc = run([HPC_TRAIN, "submit", f"out_dir={tmp_path}", "requeue.max_failures=2",
                "+cluster.env.HPC_TRAIN_FAULT=raise_at_start_always"], timeout_s=240)
    assert proc.returncode == 1
    events = read_events(tmp_path / "demo-1")
    assert [e["reason"] for e in events if e["event"] == "requeue"] == ["failure", "failure"]
    assert [e["reason"] for e in events if e["event"] == "stopped"] == [
        "failure budget spent: 2 requeues for failure already (requeue.max_failures=2)"]
