"""The root config: composed by Hydra from conf/ on the login node, frozen as config.yaml at submit.

The trainer-side dataclasses live here rather than in model.py/train.py/checkpoint.py because those
import torch (~1.5 s), and the login node validates every config without importing torch. Each class
says which module it configures. ClusterConfig lives beside the executor code in sbatch.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpc_train.sbatch import ClusterConfig

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


@dataclass
class ModelConfig:  # model.py
    vocab_size: int = 256  # byte-level tokens
    seq_len: int = 32
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(f"model.d_model={self.d_model} must be divisible by model.n_heads={self.n_heads}; "
                             f"use n_heads in {[h for h in range(1, 17) if self.d_model % h == 0]}")


@dataclass
class TrainConfig:  # train.py
    steps: int = 60
    batch_seqs_per_rank: int = 8
    lr: float = 3e-3
    warmup_steps: int = 5
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    log_every_steps: int = 10
    # A floor on each step's wall time, for drills and tests that must land a signal mid-run. 0 = off.
    min_step_time_s: float = 0.0
    rendezvous_timeout_s: int = 120

    def __post_init__(self) -> None:
        if self.steps < 1 or self.batch_seqs_per_rank < 1:
            raise ValueError(f"train.steps={self.steps} and train.batch_seqs_per_rank={self.batch_seqs_per_rank} "
                             f"must both be >= 1")


@dataclass
class CheckpointConfig:  # checkpoint.py
    every_steps: int = 20  # periodic save; a stop signal also saves at the next step boundary
    keep_last: int = 2  # committed checkpoints kept; older ones are deleted after each commit

    def __post_init__(self) -> None:
        if self.every_steps < 1 or self.keep_last < 1:
            raise ValueError(f"checkpoint.every_steps={self.every_steps} and checkpoint.keep_last="
                             f"{self.keep_last} must both be >= 1")


@dataclass
class RunConfig:
    name: str = "demo"
    out_dir: str = "runs"  # run directories are created below this, one per submit
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)


def register_schema() -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="run_schema", node=RunConfig)


def compose(overrides: list[str], config_dir: Path = CONF_DIR) -> Any:
    """Compose conf/config.yaml with Hydra overrides; returns the DictConfig, typed by RunConfig."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    register_schema()
    with initialize_config_dir(config_dir=str(config_dir.resolve()), version_base=None):
        return hydra_compose(config_name="config", overrides=overrides)


def to_run_config(cfg: Any) -> RunConfig:
    """DictConfig -> dataclasses, once, at the entry point, so every __post_init__ check runs."""
    from omegaconf import OmegaConf

    merged = OmegaConf.merge(OmegaConf.structured(RunConfig), cfg)
    return OmegaConf.to_object(merged)  # type: ignore[return-value]


def load_frozen(run_dir: Path) -> RunConfig:
    """A (re)started job reads the config frozen at submit; it never recomposes."""
    from omegaconf import OmegaConf

    return to_run_config(OmegaConf.load(run_dir / "config.yaml"))


def explain(error: Exception) -> str:
    """Hydra/OmegaConf's message and its cause; for an unknown key, the valid keys beside it."""
    from dataclasses import fields, is_dataclass

    lines = [line for line in str(error).splitlines() if not line.startswith("To append to your config")]
    cause = error.__cause__
    if cause is not None:
        lines.append(str(cause))
    full_key = getattr(cause, "full_key", None) or ""
    if type(cause).__name__ in ("ConfigAttributeError", "ConfigKeyError") and full_key:
        node: Any = RunConfig
        *parents, _ = full_key.split(".")
        for part in parents:
            node = next((f.type for f in fields(node) if f.name == part), None)
            node = globals().get(node, node) if isinstance(node, str) else node
            if not is_dataclass(node):
                break
        if is_dataclass(node):
            where = ".".join(parents) or "the top level"
            lines.append(f"valid keys under {where}: {', '.join(f.name for f in fields(node))}")
    return "\n".join(lines)
