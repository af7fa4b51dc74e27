"""Experiment tracking: TensorBoard, W&B and MLflow, fed from the same rows as metrics.jsonl (the record).

    pip install 'hpc_train[tensorboard]'                  # or [wandb], [mlflow]
    hpc-train submit metrics.tensorboard=true             # -> RUN_DIR/tensorboard/, then:
    tensorboard --logdir runs/
    hpc-train submit metrics.wandb=true                   # offline into RUN_DIR/wandb/ (then `wandb sync`)
    hpc-train submit metrics.mlflow=true                  # RUN_DIR/mlruns, or metrics.mlflow_tracking_uri=

Every attempt of a run logs into the same TensorBoard folder, the same W&B run and the same MLflow run:
the run's tracking id is made once and kept in RUN_DIR/tracking.json. A step already in metrics.jsonl
when an attempt starts is not sent again (a crashed attempt replays the steps after its last checkpoint);
W&B writes an offline run only when it is closed, so the steps a crashed attempt lost are sent again.
Rank 0 only. The config class is torch-free (config.check_environment finds the packages at submit); the
backends are imported in the job, only when switched on.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpc_train import journal
from hpc_train.paths import write_atomic

log = logging.getLogger(__name__)

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
    # Prometheus (prometheus.py), rank 0: an endpoint on prometheus_addr:prometheus_port (0 = off; loopback by
    # default: a scraper on the node, or an SSH tunnel) and/or node-exporter's textfile at this path ("" = off;
    # {job} in it becomes the Slurm job id: jobs sharing a node write one file each; removed when the attempt ends).
    prometheus_port: int = 0
    prometheus_addr: str = "127.0.0.1"
    prometheus_textfile: str = ""

    def __post_init__(self) -> None:
        if not 0 <= self.prometheus_port <= 65535:
            raise ValueError(
                f"metrics.prometheus_port={self.prometheus_port} must be 0 (off) or a TCP port 1-65535, "
                f"e.g. metrics.prometheus_port=9400"
            )
        if not self.prometheus_addr.strip():  # http.server binds "" to every interface: only when written as 0.0.0.0
            raise ValueError(
                f"metrics.prometheus_addr={self.prometheus_addr!r} is empty, which would serve on every "
                f"interface; give 127.0.0.1 (default: a scraper on the node or an SSH tunnel), the "
                f"node's address, or 0.0.0.0 to mean every interface"
            )
        if self.wandb_mode not in ("offline", "online"):
            raise ValueError(f"metrics.wandb_mode={self.wandb_mode!r} is not one of ('offline', 'online')")


def run_id(run_dir: Path) -> dict[str, Any]:
    """RUN_DIR/tracking.json, made on the first call: the run directory's name + 8 random hex digits, so
    two `demo-1` runs in different folders are two W&B runs, and a requeue finds the same one."""
    import secrets  # here: the login node imports this module for TrackingConfig

    path = run_dir / TRACKING_JSON
    if not path.exists():
        _write(path, {"run_id": f"{run_dir.name[:50]}-{secrets.token_hex(4)}"})
    return json.loads(path.read_text())


def _write(path: Path, record: dict[str, Any]) -> None:
    write_atomic(path, json.dumps(record, indent=1) + "\n")


def _last_step(run_dir: Path) -> int:
    from hpc_train.metrics import read_metrics

    return max((int(m["step"]) for m in read_metrics(run_dir)), default=-1)


class Tracker:
    """What train.py holds: log(step, row) after each metrics.jsonl line; close() before a requeue.

    A backend that fails (an MLflow server down, W&B online without a network) is switched off for the
    attempt after one `tracking_failed` event: training goes on, metrics.jsonl stays the record."""

    def __init__(
        self, cfg: TrackingConfig, run_dir: Path, config: dict[str, Any], event: Callable[..., None] | None = None
    ) -> None:
        self.cfg, self.run_dir, self.config, self.event = cfg, run_dir, config, event
        self.logged_through = _last_step(run_dir)  # sent by earlier attempts (they log right after metrics.jsonl)
        self.step = max(self.logged_through, 0)  # the step a failure is recorded at
        self.tb = self.wandb = self.mlflow = None
        self.mlflow_run = ""
        self.ids = run_id(run_dir)
        # W&B keeps an offline attempt only if it closed (a crash loses it): resend what it lost
        self.wandb_through = int(self.ids.get("wandb_logged_through", -1))
        for backend in ("tb", "wandb", "mlflow"):
            if getattr(cfg, {"tb": "tensorboard"}.get(backend, backend)):
                self._guard(backend, "open", getattr(self, f"_open_{backend}"), opening=True)
        atexit.register(self.close, finished=True)  # a requeue leaves by os._exit: train.py calls close() first

    def _guard(self, backend: str, during: str, call: Callable[[], None], opening: bool = False) -> None:
        if getattr(self, backend) is None and not opening:
            return
        try:
            call()
        except Exception as e:  # any backend error: network, server, disk, the package's own bugs
            setattr(self, backend, None)
            error = " ".join(f"{type(e).__name__}: {e}".split())[:300]
            name = {"tb": "tensorboard"}.get(backend, backend)
            log.warning(
                f"tracking: {name} failed during {during} ({error}); off for this attempt, metrics.jsonl has every row"
            )
            if self.event is not None:
                self.event(journal.TRACKING_FAILED, self.step, backend=name, during=during, error=error)

    def _open_tb(self) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.tb = SummaryWriter(str(self.run_dir / "tensorboard"))  # one event file per attempt; TB reads them all

    def _open_wandb(self) -> None:
        import wandb

        cfg, ids = self.cfg, self.ids
        self.wandb = wandb.init(
            id=ids["run_id"],
            resume="allow",
            name=self.run_dir.name,
            project=cfg.wandb_project,
            entity=cfg.wandb_entity or None,
            mode=cfg.wandb_mode,
            dir=str(self.run_dir),
            config=self.config,
            settings=wandb.Settings(console="off", silent=True),
        )

    def _open_mlflow(self) -> None:
        uri = self.cfg.mlflow_tracking_uri or f"file:{self.run_dir.resolve() / 'mlruns'}"
        if uri.startswith("file:"):  # MLflow 3 refuses its file store unless asked: no database, no server
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        # MLflow's HTTP defaults (7 retries with backoff, 120 s timeout) could hold a step, a stop save
        # included, for minutes while a server is down: one retry, 5 s each, then this backend is off.
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=uri)
        self.mlflow_run = self.ids.get("mlflow_run_id", "")
        if self.mlflow_run:
            client.update_run(self.mlflow_run, status="RUNNING")
        else:
            name, ids = self.cfg.mlflow_experiment, self.ids
            exp = client.get_experiment_by_name(name)
            exp_id = exp.experiment_id if exp else client.create_experiment(name)
            run = client.create_run(
                exp_id,
                run_name=ids["run_id"],
                tags={"hpc_train.run_id": ids["run_id"], "hpc_train.run_dir": str(self.run_dir)},
            )
            self.mlflow_run = run.info.run_id
            _write(self.run_dir / TRACKING_JSON, {**ids, "mlflow_run_id": self.mlflow_run})  # before any metric
        self.mlflow = client

    def log(self, step: int, row: dict[str, Any]) -> None:
        self.step = step
        values = {
            k: float(v)
            for k, v in row.items()
            if k not in ("time", "step") and isinstance(v, (int, float)) and not isinstance(v, bool)
        }  # mfu is None on CPU

        def wandb_log() -> None:
            self.wandb.log(values, step=step)  # type: ignore[union-attr]
            self.wandb_through = step

        def tb_log() -> None:
            for key, value in values.items():
                self.tb.add_scalar(key, value, step, walltime=row["time"])  # type: ignore[union-attr]
            self.tb.flush()  # type: ignore[union-attr]  # ~0.1 ms; a killed attempt keeps what it logged

        def mlflow_log() -> None:
            from mlflow.entities import Metric

            ms = int(row["time"] * 1000)
            self.mlflow.log_batch(
                self.mlflow_run,  # type: ignore[union-attr]
                metrics=[Metric(k, v, ms, step) for k, v in values.items()],
            )

        if step > self.wandb_through:
            self._guard("wandb", "log", wandb_log)
        if step <= self.logged_through:
            return
        self._guard("tb", "log", tb_log)
        self._guard("mlflow", "log", mlflow_log)

    def close(self, finished: bool = False) -> None:
        """Flush and let go; W&B writes its offline run only here. Safe to call twice."""

        def wandb_close() -> None:
            self.wandb.finish()  # type: ignore[union-attr]
            ids = json.loads((self.run_dir / TRACKING_JSON).read_text())
            _write(self.run_dir / TRACKING_JSON, {**ids, "wandb_logged_through": self.wandb_through})

        self._guard("tb", "close", lambda: self.tb.close())  # type: ignore[union-attr]
        self._guard("wandb", "close", wandb_close)
        if finished:
            self._guard("mlflow", "close", lambda: self.mlflow.set_terminated(self.mlflow_run, status="FINISHED"))  # type: ignore[union-attr]
        self.tb = self.wandb = self.mlflow = None


class _Off:
    def log(self, step: int, row: dict[str, Any]) -> None:
        pass

    def close(self, finished: bool = False) -> None:
        pass


def open(
    cfg: TrackingConfig,
    run_dir: Path,
    rank: int,  # noqa: A001 (tracking.open reads well)
    event: Callable[..., None] | None = None,
) -> Tracker | _Off:
    """Rank 0's tracker for this attempt, or one that does nothing (other ranks, or nothing switched on).
    event(name, step, **fields) records a backend's failure (train.py passes the Attempt's)."""
    if rank != 0 or not (cfg.tensorboard or cfg.wandb or cfg.mlflow):
        return _Off()
    import yaml

    config = yaml.safe_load((run_dir / "config.yaml").read_text()) if cfg.wandb else {}
    for key in ("env", "setup", "template_vars", "sbatch_extra"):  # may hold secrets or site paths: not for W&B
        config.get("cluster", {}).pop(key, None)
    return Tracker(cfg, run_dir, config, event)
