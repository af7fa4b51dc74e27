"""Experiment tracking: TensorBoard, W&B and MLflow, fed from the same rows as metrics.jsonl (the record).

    pip install 'hpc_train[tensorboard]'                  # or [wandb], [mlflow]
    hpc-train submit metrics.tensorboard=true             # -> RUN_DIR/tensorboard/, then:
    tensorboard --logdir runs/
    hpc-train submit metrics.wandb=true                   # offline into RUN_DIR/wandb/; `wandb sync RUN_DIR/wandb/offline-run-*`
    hpc-train submit metrics.mlflow=true                  # file store RUN_DIR/mlruns (or metrics.mlflow_tracking_uri=...)

Every attempt of a run logs into the same TensorBoard folder, the same W&B run and the same MLflow run:
the run's tracking id is made once and kept in RUN_DIR/tracking.json. A step already in metrics.jsonl
when an attempt starts is not sent again (a crashed attempt replays the steps after its last checkpoint);
W&B writes an offline run only when it is closed, so the steps a crashed attempt lost are sent again.
Rank 0 only. The config class is torch-free (the login node checks the packages at submit); the
backends are imported in the job, only when switched on.
"""

from __future__ import annotations

import atexit
import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# {"run_id", "mlflow_run_id", "wandb_logged_through"}: the same runs on every requeue
TRACKING_JSON = "tracking.json"
PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}  # config switch -> module


@dataclass
class TrackingConfig:  # tracking.py, the `metrics` section of the root config
    tensorboard: bool = False  # event files in RUN_DIR/tensorboard
    wandb: bool = False
    wandb_project: str = "hpc_train"
    wandb_entity: str = ""  # empty: your default entity
    # "offline": into RUN_DIR/wandb, no network (compute nodes often have none), `wandb sync` later;
    # "online" streams from the job.
    wandb_mode: str = "offline"
    mlflow: bool = False
    mlflow_tracking_uri: str = ""  # empty: the file store file:RUN_DIR/mlruns; or http://your-server:5000
    mlflow_experiment: str = "hpc_train"

    def __post_init__(self) -> None:
        import importlib.util

        if self.wandb_mode not in ("offline", "online"):
            raise ValueError(f"metrics.wandb_mode={self.wandb_mode!r} is not one of ('offline', 'online')")
        for switch, module in PACKAGES.items():
            if getattr(self, switch) and importlib.util.find_spec(module) is None:
                raise ValueError(f"metrics.{switch}=true needs the {module} package, which is not installed in "
                                 f"this Python; run: pip install 'hpc_train[{switch}]' (the job uses the same "
                                 f"environment), or set metrics.{switch}=false")


def run_id(run_dir: Path) -> dict[str, Any]:
    """RUN_DIR/tracking.json, made on the first call: the run directory's name + 8 random hex digits, so
    two `demo-1` runs in different folders are two W&B runs, and a requeue finds the same one."""
    path = run_dir / TRACKING_JSON
    if not path.exists():
        _write(path, {"run_id": f"{run_dir.name[:50]}-{secrets.token_hex(4)}"})
    return json.loads(path.read_text())


def _write(path: Path, record: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, path)


def _last_step(run_dir: Path) -> int:
    from hpc_train.metrics import read_metrics

    return max((int(m["step"]) for m in read_metrics(run_dir)), default=-1)


class Tracker:
    """What train.py holds: log(step, row) after each metrics.jsonl line; close() before a requeue."""

    def __init__(self, cfg: TrackingConfig, run_dir: Path, config: dict[str, Any]) -> None:
        self.run_dir = run_dir
        self.logged_through = _last_step(run_dir)  # sent by earlier attempts (they log right after metrics.jsonl)
        self.tb = self.wandb = self.mlflow = None
        self.mlflow_run = ""
        ids = run_id(run_dir)
        # W&B keeps an offline attempt only if it closed (a crash loses it): resend what it lost
        self.wandb_through = int(ids.get("wandb_logged_through", -1))
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(run_dir / "tensorboard"))  # one event file per attempt; TB reads them all
        if cfg.wandb:
            import wandb

            self.wandb = wandb.init(id=ids["run_id"], resume="allow", name=run_dir.name, project=cfg.wandb_project,
                                    entity=cfg.wandb_entity or None, mode=cfg.wandb_mode, dir=str(run_dir),
                                    config=config, settings=wandb.Settings(console="off", silent=True))
        if cfg.mlflow:
            uri = cfg.mlflow_tracking_uri or f"file:{run_dir.resolve() / 'mlruns'}"
            if uri.startswith("file:"):  # MLflow 3 refuses its file store unless asked: no database, no server
                os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            from mlflow.tracking import MlflowClient

            self.mlflow = MlflowClient(tracking_uri=uri)
            self.mlflow_run = ids.get("mlflow_run_id", "")
            if self.mlflow_run:
                self.mlflow.update_run(self.mlflow_run, status="RUNNING")
            else:
                exp = self.mlflow.get_experiment_by_name(cfg.mlflow_experiment)
                exp_id = exp.experiment_id if exp else self.mlflow.create_experiment(cfg.mlflow_experiment)
                run = self.mlflow.create_run(exp_id, run_name=ids["run_id"], tags={"hpc_train.run_id": ids["run_id"],
                                                                                   "hpc_train.run_dir": str(run_dir)})
                self.mlflow_run = run.info.run_id
                _write(run_dir / TRACKING_JSON, {**ids, "mlflow_run_id": self.mlflow_run})  # before any metric
        atexit.register(self.close, finished=True)  # a requeue leaves by os._exit: train.py calls close() first

    def log(self, step: int, row: dict[str, Any]) -> None:
        values = {k: float(v) for k, v in row.items() if k not in ("time", "step") and isinstance(v, (int, float))
                  and not isinstance(v, bool)}  # mfu is None on CPU
        if self.wandb is not None and step > self.wandb_through:
            self.wandb.log(values, step=step)
            self.wandb_through = step
        if step <= self.logged_through:
            return
        if self.tb is not None:
            for key, value in values.items():
                self.tb.add_scalar(key, value, step, walltime=row["time"])
            self.tb.flush()  # ~0.1 ms; a killed attempt keeps what it logged
        if self.mlflow is not None:
            from mlflow.entities import Metric

            ms = int(row["time"] * 1000)
            self.mlflow.log_batch(self.mlflow_run, metrics=[Metric(k, v, ms, step) for k, v in values.items()])

    def close(self, finished: bool = False) -> None:
        """Flush and let go; W&B writes its offline run only here. Safe to call twice."""
        if self.tb is not None:
            self.tb.close()
            self.tb = None
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None
            ids = json.loads((self.run_dir / TRACKING_JSON).read_text())
            _write(self.run_dir / TRACKING_JSON, {**ids, "wandb_logged_through": self.wandb_through})
        if self.mlflow is not None:
            if finished:
                self.mlflow.set_terminated(self.mlflow_run, status="FINISHED")
            self.mlflow = None


class _Off:
    def log(self, step: int, row: dict[str, Any]) -> None:
        pass

    def close(self, finished: bool = False) -> None:
        pass


def open(cfg: TrackingConfig, run_dir: Path, rank: int) -> Tracker | _Off:  # noqa: A001 (tracking.open reads well)
    """Rank 0's tracker for this attempt, or one that does nothing (other ranks, or nothing switched on)."""
    if rank != 0 or not (cfg.tensorboard or cfg.wandb or cfg.mlflow):
        return _Off()
    import yaml

    config = yaml.safe_load((run_dir / "config.yaml").read_text()) if cfg.wandb else {}
    config.get("cluster", {}).pop("env", None)  # may hold secrets (cluster.env): never sent to W&B
    return Tracker(cfg, run_dir, config)
