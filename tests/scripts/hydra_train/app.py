"""A Hydra app as people write one, that trains a small model and keeps its own checkpoint: it saves ckpt.pt in its
output folder every `save_every` steps and when SIGTERM comes (a handler that sets a flag the loop checks), and
resumes from that file at start. Nothing in it knows hpc_train (tests/test_slurm_hydra.py launches it unchanged).

    python tests/scripts/hydra_train/app.py lr=0.05                          # here, as always
    python tests/scripts/hydra_train/app.py -m hydra/launcher=hpc_train lr=0.01,0.02,0.05   # a sweep on Slurm
"""

import os
import signal
import time

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

STOP = []


def train(steps: int, lr: float, seed: int, ckpt: str, step_time_s: float = 0.0, save_every: int = 10) -> float:
    """Full-batch gradient descent on a fixed regression: deterministic, so a resumed run ends as an uninterrupted
    one does, to the bit."""
    g = torch.Generator().manual_seed(seed)
    x, w_true = torch.randn(64, 8, generator=g), torch.randn(8, 1, generator=g)
    y = x @ w_true
    model = torch.nn.Linear(8, 1)
    torch.nn.init.zeros_(model.weight), torch.nn.init.zeros_(model.bias)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    step = 0
    if os.path.exists(ckpt):
        state = torch.load(ckpt)
        model.load_state_dict(state["model"]), opt.load_state_dict(state["opt"])
        step = state["step"]
        print(f"resumed at step {step}", flush=True)
    loss = torch.nn.functional.mse_loss(model(x), y)
    while step < steps:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        step += 1
        time.sleep(step_time_s)
        if step % save_every == 0 or STOP:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, ckpt + ".tmp")
            os.replace(ckpt + ".tmp", ckpt)
            print(f"saved step {step}", flush=True)
        if STOP:
            print(f"stopping at step {step}", flush=True)
            break
    return loss.item()


@hydra.main(version_base=None, config_path=".", config_name="config")
def main(cfg: DictConfig) -> float:
    signal.signal(signal.SIGTERM, lambda signum, frame: STOP.append(signum))
    ckpt = os.path.join(HydraConfig.get().runtime.output_dir, "ckpt.pt")
    return train(cfg.steps, cfg.lr, cfg.seed, ckpt, cfg.step_time_s, cfg.save_every)


if __name__ == "__main__":
    main()
