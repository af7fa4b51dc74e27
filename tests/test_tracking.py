"""Experiment tracking: TensorBoard event files (always tested), W&B and MLflow (when installed), each
one run across a stop and resume, offline, rank 0 only; a missing package is refused at submit."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import struct
import subprocess
import sys
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import read_events, submit, wait_until
from hpc_train.metrics import read_metrics

HAVE = {m: importlib.util.find_spec(m) is not None for m in ("wandb", "mlflow")}
OFFLINE = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_API_KEY": "", "MLFLOW_TRACKING_URI": ""}


def tb_scalars(run_dir: Path, tag: str) -> list[tuple[int, float]]:
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def wandb_history(run_dir: Path) -> list[tuple[str, list[int]]]:
    """(run id, logged steps) of each offline attempt, read from its .wandb transaction log: LevelDB's
    log format (32 KiB blocks of crc32, length, type + payload) behind a 7-byte W&B header. wandb 0.19+
    ships no Python reader, so this reads the records itself."""
    from wandb.proto import wandb_internal_pb2 as pb

    out = []
    for f in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb")):
        raw, records, buf, pos = f.read_bytes(), [], b"", 7
        while pos + 7 <= len(raw):
            block_left = 32768 - (pos % 32768)
            if block_left < 7:  # a block's tail too short for a header is padding
                pos += block_left
                continue
            _crc, length, kind = struct.unpack("<IHB", raw[pos:pos + 7])
            buf += raw[pos + 7: pos + 7 + length]
            pos += 7 + length
            if kind in (1, 4):  # FULL or LAST fragment
                records.append(buf)
                buf = b""
        steps, run_id = [], ""
        for data in records:
            r = pb.Record()
            r.ParseFromString(data)
            if r.WhichOneof("record_type") == "history":
                steps.append(r.history.step.num)
            elif r.WhichOneof("record_type") == "run":
                run_id = r.run.run_id
        out.append((run_id, steps))
    return out


def test_tensorboard_wandb_mlflow_follow_one_run_across_a_crash_and_a_preemption(tmp_path: Path) -> None:
    """Attempt 0 hangs after step 3 (the hang drill; no checkpoint yet), attempt 1 replays steps 1-3 and
    is preempted (SIGTERM) past step 12, attempt 2 finishes. One TB folder, one W&B run id, one MLflow
    run; every step once in each, TB's loss values are metrics.jsonl's."""
    switches = ["metrics.tensorboard=true"] + [f"metrics.{m}=true" for m, ok in HAVE.items() if ok]
    run_dir, job_id = submit([f"out_dir={tmp_path}", "train.steps=24", "checkpoint.every_steps=10",
                              "train.log_every_steps=1", "train.min_step_time_s=0.1", "train.watchdog_s=3",
                              "+cluster.env.HPC_TRAIN_FAULT=hang", *switches, "--no-wait"], env=OFFLINE)
    wait_until(lambda: sum(e["event"] == "start" for e in read_events(run_dir)) == 2
               and max(m["step"] for m in read_metrics(run_dir)) >= 12, 120, "step 12 of the second attempt")
    os.kill(int(job_id), signal.SIGTERM)  # submitit's local controller forwards it to every rank
    wait_until(lambda: (run_dir / "summary.json").exists(), 240, "summary.json after the resume")
    starts = [e["step"] for e in read_events(run_dir) if e["event"] == "start"]
    assert starts[:2] == [0, 0] and len(starts) == 3 and 12 <= starts[2] < 24, starts

    rows = read_metrics(run_dir)
    jsonl = {m["step"]: m["loss"] for m in rows}
    assert [m["step"] for m in rows][:6] == [1, 2, 3, 1, 2, 3]  # the record keeps the crashed attempt's replay
    # train.py logs no row for the step a stop signal ends (step_end returns first)
    assert sorted(jsonl) == [s for s in range(1, 25) if s != starts[2]]
    tb = tb_scalars(run_dir, "loss")
    assert [s for s, _ in tb] == sorted(jsonl)  # every step once, across the attempts' event files
    assert all(abs(v - jsonl[s]) <= 1e-6 * abs(jsonl[s]) for s, v in tb)  # TB stores float32
    assert len(list((run_dir / "tensorboard").glob("events.out.tfevents.*"))) == 3  # one file per attempt
    ids = json.loads((run_dir / "tracking.json").read_text())
    assert ids["run_id"].startswith("demo-1-")

    if HAVE["wandb"]:
        attempts = wandb_history(run_dir)
        assert len(attempts) == 3 and attempts[0][1] == []  # the hung attempt never closed: W&B lost it
        assert [rid for rid, _ in attempts[1:]] == [ids["run_id"]] * 2  # `wandb sync` uploads both into one run
        assert attempts[1][1] + attempts[2][1] == sorted(jsonl)  # lost steps resent, none twice
        assert attempts[1][1][-1] == starts[2] - 1 and ids["wandb_logged_through"] == 24
    if HAVE["mlflow"]:
        from mlflow.tracking import MlflowClient

        os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
        client = MlflowClient(tracking_uri=f"file:{run_dir / 'mlruns'}")
        runs = client.search_runs(client.search_experiments()[0].experiment_id)
        assert len(runs) == 1 and runs[0].info.run_name == ids["run_id"] and runs[0].info.status == "FINISHED"
        assert runs[0].info.run_id == ids["mlflow_run_id"]
        history = client.get_metric_history(runs[0].info.run_id, "loss")
        assert sorted(m.step for m in history) == sorted(jsonl)  # no step twice
        assert all(abs(m.value - jsonl[m.step]) < 1e-9 for m in history)


def test_a_missing_tracking_package_is_refused_at_submit_with_the_pip_command(tmp_path: Path) -> None:
    """The login node may lack the package: find_spec says so before anything is written or queued.
    sys.modules[name] = None is how Python marks a module absent; the real `main` runs in a subprocess."""
    code = ("import sys; sys.modules['wandb'] = None; from hpc_train.cli import main; "
            f"sys.exit(main(['submit', 'out_dir={tmp_path}', 'metrics.wandb=true']))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert ("metrics.wandb=true needs the wandb package, which is not installed in this Python; run: "
            "pip install 'hpc_train[wandb]'") in proc.stderr, proc.stderr
    assert not any(tmp_path.iterdir())  # nothing written
