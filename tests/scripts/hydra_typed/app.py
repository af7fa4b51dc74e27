"""A Hydra app with a structured config whose schema it defines itself (run as __main__) and a config group: what the
hpc_train launcher must freeze with its types (tests/test_hydra_launcher.py). It returns what it was given.

    python tests/scripts/hydra_typed/app.py -m hydra/launcher=hpc_train hydra.launcher.executor=local db=mysql,postgres
"""

from dataclasses import dataclass, field
from typing import Any

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import MISSING, DictConfig, OmegaConf


@dataclass
class Optim:
    lr: float = 1e-3
    momentum: float = 0.9


@dataclass
class Config:
    optim: Optim = field(default_factory=Optim)
    seed: int = 0
    db: Any = MISSING
    tag: str = "seed-${seed}"
    started: str = "${now:%H-%M-%S}"  # the sweep's time: Hydra's default sweep folder is named by it too


ConfigStore.instance().store(name="schema", node=Config)


@hydra.main(version_base=None, config_path="conf", config_name="config")
def main(cfg: DictConfig) -> dict:
    if cfg.seed < 0:
        raise ValueError(f"seed must be >= 0, got {cfg.seed}")
    obj = OmegaConf.to_object(cfg)  # the dataclass back: only a config that kept its types gives it
    hc = HydraConfig.get()
    return {
        "type": type(obj).__name__,
        "lr": obj.optim.lr,
        "seed": obj.seed,
        "db": cfg.db.driver,
        "tag": cfg.tag,
        "started": cfg.started,
        "output_dir": hc.runtime.output_dir,
        "num": hc.job.num if "num" in hc.job else None,
        "override_dirname": hc.job.override_dirname,
    }


if __name__ == "__main__":
    main()
