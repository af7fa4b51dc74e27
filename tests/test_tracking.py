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

from conftest import names, read_events, submit, wait_until
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from hpc_train.metrics import read_metrics

HAVE = {m: importlib.util.find_spec(m) is not None for m in ("wandb", "mlflow")}
OFFLINE = {
    **os.environ,
    "WANDB_MODE": "offline",
    "WANDB_SILENT": "true",
    "WANDB_API_KEY": "",
    "MLFLOW_TRACKING_URI": "",
}


SWITCHES = ["metrics.tensorboard=true"] + [f"metrics.{m}=true" for m, ok in HAVE.items() if ok]


def mlflow_steps(run_dir: Path, ids: dict) -> list[int]:
    """The loss steps of the run's one MLflow run (checked FINISHED, named by our run id), sorted."""
    from mlflow.tracking import MlflowClient

    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"  # MLflow 3's file store is opt-in
    client = MlflowClient(tracking_uri=f"file:{run_dir / 'mlruns'}")
    runs = client.search_runs(client.search_experiments()[0].experiment_id)
    assert len(runs) == 1 and runs[0].info.run_name == ids["run_id"] and runs[0].info.status == "FINISHED"
    assert runs[0].info.run_id == ids["mlflow_run_id"]
    return sorted(m.step for m in client.get_metric_history(runs[0].info.run_id, "loss"))


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
            _crc, length, kind = struct.unpack("<IHB", raw[pos : pos + 7])
            buf += raw[pos + 7 : pos + 7 + length]
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


def test_a_preempted_run_logs_into_one_tensorboard_folder_wandb_run_and_mlflow_run(tmp_path: Path) -> None:
    """The trainer's two calls, end to end: SIGTERM mid-run (a preemption), save, requeue, resume. The
    resumed attempt logs into the same TB folder, W&B run id and MLflow run, no step twice; TB's loss
    values are metrics.jsonl's."""
    run_dir, job_id = submit(
        [
            f"out_dir={tmp_path}",
            "train.steps=30",
            "checkpoint.every_steps=10",
            "train.log_every_steps=2",
            "train.min_step_time_s=0.1",
            *SWITCHES,
            "--no-wait",
        ],
        env=OFFLINE,
    )
    wait_until(lambda: max((m["step"] for m in read_metrics(run_dir)), default=0) >= 10, 120, "step 10")
    os.kill(int(job_id), signal.SIGTERM)  # submitit's local controller forwards it to every rank
    wait_until(lambda: (run_dir / "summary.json").exists(), 240, "summary.json after the resume")
    starts = [e["step"] for e in read_events(run_dir) if e["event"] == "start"]
    assert len(starts) == 2 and 10 <= starts[1] < 30, starts

    jsonl = {m["step"]: m["loss"] for m in read_metrics(run_dir)}
    # every logged step once: the step an attempt stops at is logged before its stop check (train.py), and
    # the resumed attempt starts after it
    assert sorted(jsonl) == list(range(2, 31, 2)), (starts, sorted(jsonl))
    tb = tb_scalars(run_dir, "loss")
    assert [s for s, _ in tb] == sorted(jsonl)  # every step once, across the attempts' event files
    assert all(abs(v - jsonl[s]) <= 1e-6 * abs(jsonl[s]) for s, v in tb)  # TB stores float32
    assert len(list((run_dir / "tensorboard").glob("events.out.tfevents.*"))) == 2  # one file per attempt
    ids = json.loads((run_dir / "tracking.json").read_text())
    assert ids["run_id"].startswith("demo-1-")
    if HAVE["wandb"]:
        attempts = wandb_history(run_dir)
        assert [rid for rid, _ in attempts] == [ids["run_id"]] * 2  # `wandb sync` uploads both into one run
        assert attempts[0][1] + attempts[1][1] == sorted(jsonl)
    if HAVE["mlflow"]:
        assert mlflow_steps(run_dir, ids) == sorted(jsonl)


ATTEMPT = """
import os, sys, time
from pathlib import Path
from hpc_train import tracking
from hpc_train.paths import append_line

run_dir, first, last, end = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
tracker = tracking.open(tracking.TrackingConfig(tensorboard=True, wandb=%s, mlflow=%s), run_dir, rank=0)
for step in range(first, last + 1):  # as train.py: the metrics.jsonl line, then the tracker
    row = {"time": time.time(), "step": step, "loss": 10.0 / step, "mfu": None}
    append_line(run_dir / "metrics.jsonl", row)
    tracker.log(step, row)
if end == "crash":
    os._exit(1)  # as job.py leaves a failed attempt: no atexit, nothing closed
tracker.close(finished=end == "finish")
"""


def test_steps_a_crashed_attempt_logged_are_not_sent_twice_and_those_wandb_lost_are_resent(tmp_path: Path) -> None:
    """Three attempts as processes: 1-3 then a crash (no checkpoint: the next replays from step 1),
    1-6 then a requeue, 7-9 and finish. TB and MLflow write as they go: they keep 1-3 and skip the replay.
    W&B writes an offline run only on close: the crashed attempt's run is empty and its steps are resent."""
    run_dir = tmp_path / "demo-1"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("name: demo\n")
    code = ATTEMPT % (HAVE["wandb"], HAVE["mlflow"])
    for args in (("1", "3", "crash"), ("1", "6", "requeue"), ("7", "9", "finish")):
        proc = subprocess.run(
            [sys.executable, "-c", code, str(run_dir), *args], env=OFFLINE, capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == (1 if args[2] == "crash" else 0), proc.stderr
    assert [m["step"] for m in read_metrics(run_dir)] == [1, 2, 3, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert [s for s, _ in tb_scalars(run_dir, "loss")] == list(range(1, 10))
    ids = json.loads((run_dir / "tracking.json").read_text())
    if HAVE["wandb"]:
        attempts = wandb_history(run_dir)
        assert [steps for _, steps in attempts] == [[], [1, 2, 3, 4, 5, 6], [7, 8, 9]]
        assert [rid for rid, _ in attempts[1:]] == [ids["run_id"]] * 2 and ids["wandb_logged_through"] == 9
    if HAVE["mlflow"]:
        assert mlflow_steps(run_dir, ids) == list(range(1, 10))


def test_a_missing_tracking_package_is_refused_at_submit_with_the_pip_command(tmp_path: Path) -> None:
    """The login node may lack the package: find_spec says so before anything is written or queued.
    sys.modules[name] = None is how Python marks a module absent; the real `main` runs in a subprocess."""
    code = (
        "import sys; sys.modules['wandb'] = None; from hpc_train.cli import main; "
        f"sys.exit(main(['submit', 'out_dir={tmp_path}', 'metrics.wandb=true']))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert names(proc.stderr, "metrics.wandb=true", "wandb package", "pip install 'hpc_train[wandb]'")
    assert not any(tmp_path.iterdir())  # nothing written


def test_an_mlflow_server_that_is_down_costs_one_event_and_the_run_finishes(tmp_path: Path) -> None:
    """Before: MLflow's connection error on rank 0 failed every attempt. Now one `tracking_failed` event,
    MLflow is off for the attempt, and metrics.jsonl has every row. W&B (offline) gets the config without
    cluster.env, setup, template_vars and sbatch_extra (secrets and site paths)."""
    import socket

    with socket.socket() as s:  # a loopback port nothing listens on: connection refused at once
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    wandb = (
        [
            "metrics.wandb=true",
            "cluster.setup=['echo SETUP_SECRET']",
            "+cluster.template_vars.tv=TV_SECRET",
            "+cluster.sbatch_extra.comment=EXTRA_SECRET",
            "+cluster.env.TOKEN=ENV_SECRET",
        ]
        if HAVE["wandb"]
        else []
    )
    run_dir, _ = submit(
        [
            f"out_dir={tmp_path}",
            "train.steps=6",
            "train.log_every_steps=2",
            "metrics.mlflow=true",
            f"metrics.mlflow_tracking_uri=http://127.0.0.1:{port}",
            *wandb,
        ],
        env=OFFLINE,
    )
    assert json.loads((run_dir / "summary.json").read_text())["final_step"] == 6
    assert [m["step"] for m in read_metrics(run_dir)] == [2, 4, 6]
    failed = [e for e in read_events(run_dir) if e["event"] == "tracking_failed"]
    assert [(e["backend"], e["during"], e["step"]) for e in failed] == [("mlflow", "open", 0)], failed
    assert "Connection" in failed[0]["error"] or "connect" in failed[0]["error"].lower(), failed[0]["error"]
    if HAVE["wandb"]:
        [log] = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")  # the config record's JSON is plain bytes
        sent = log.read_bytes()
        assert b"signal_lead_s" in sent and not any(
            f"{w}_SECRET".encode() in sent for w in ("SETUP", "TV", "EXTRA", "ENV")
        )


def test_an_empty_prometheus_addr_is_refused_not_bound_to_every_interface(tmp_path: Path) -> None:
    """http.server binds "" to 0.0.0.0: the endpoint would be open on every interface, logged as http://:PORT."""
    from conftest import HPC_TRAIN, run

    proc = run(
        [HPC_TRAIN, "submit", f"out_dir={tmp_path}", "metrics.prometheus_port=9400", "metrics.prometheus_addr=''"]
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert names(proc.stderr, "metrics.prometheus_addr=''", "every interface", "127.0.0.1")
    assert not any(tmp_path.iterdir())  # nothing written
    from hpc_train.tracking import TrackingConfig

    assert TrackingConfig(prometheus_addr="0.0.0.0").prometheus_addr == "0.0.0.0"  # written explicitly: allowed
