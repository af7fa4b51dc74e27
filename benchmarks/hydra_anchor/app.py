"""The anchor: a minimal Hydra app swept through hydra-submitit-launcher (what users run today).

python benchmarks/hydra_anchor/app.py -m hydra/launcher=submitit_slurm lr=range(100)
"""

import hydra
from omegaconf import DictConfig


@hydra.main(version_base=None, config_path=".", config_name="config")
def main(cfg: DictConfig) -> float:
    return float(cfg.lr)


if __name__ == "__main__":
    main()
