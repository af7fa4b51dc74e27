"""A PyTorch Lightning script, written as people write them: a LightningModule, Trainer(strategy="ddp"),
ModelCheckpoint(save_last=True) and fit(ckpt_path="last"). Nothing of hpc_train in it.

    python tests/scripts/lightning_train.py --max-steps 60 --ckpt-dir /tmp/lit
    hpc-train submit cluster=dev cluster.tasks_per_node=1 "script.checkpoint='{ckpt_dir}/last*.ckpt'" -- \
        python tests/scripts/lightning_train.py --ckpt-dir {ckpt_dir}

Lightning's own SIGTERM handling does the stop: its signal connector records the TERM, every rank learns it
at the start of the next batch (a broadcast from rank 0), and SIGTERMException ends fit(); ModelCheckpoint's
save_on_exception=True then writes a checkpoint and last.ckpt, which ckpt_path="last" resumes from.
"""

import argparse
import os
import time

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

p = argparse.ArgumentParser()
p.add_argument("--max-steps", type=int, default=60)
p.add_argument("--save-every", type=int, default=10)
p.add_argument("--step-time", type=float, default=0.1)  # a sleep per step: 60 steps last 6 s, a stop lands mid-run
p.add_argument("--ckpt-dir", default="checkpoints")
# as launched: Lightning refuses devices != SLURM_NTASKS_PER_NODE or num_nodes != SLURM_NNODES under Slurm
p.add_argument("--devices", type=int, default=int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
p.add_argument(
    "--num-nodes",
    type=int,
    default=int(os.environ.get("WORLD_SIZE", "1")) // int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
)
args = p.parse_args()


class Regression(pl.LightningModule):
    def __init__(self, step_time: float) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
        self.step_time = step_time

    def on_train_start(self) -> None:
        # what the test compares: Lightning's rank with the launcher's, and the step this attempt starts at
        env = os.environ
        print(
            f"lightning global_rank={self.trainer.global_rank} world_size={self.trainer.world_size}"
            f" RANK={env.get('RANK')} node={env.get('SLURMD_NODENAME', '-')}"
            f" attempt={env.get('TORCHELASTIC_RESTART_COUNT', '-')} start_step={self.global_step}",
            flush=True,
        )

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        if self.global_rank == 0:  # every step: a stop's save holds the last one printed
            print(f"step {self.global_step + 1} loss {loss.item():.6f}", flush=True)
        return loss

    def on_train_batch_end(self, outputs: object, batch: object, batch_idx: int) -> None:
        time.sleep(self.step_time)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


torch.set_num_threads(1)
g = torch.Generator().manual_seed(0)
x = torch.randn(4096, 16, generator=g)
data = DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True).sin()), batch_size=32, shuffle=True)

pl.seed_everything(0)
checkpoint = ModelCheckpoint(
    dirpath=args.ckpt_dir, save_last=True, every_n_train_steps=args.save_every, save_on_exception=True
)
trainer = pl.Trainer(
    accelerator="cpu",
    devices=args.devices,
    num_nodes=args.num_nodes,
    strategy="ddp",
    max_steps=args.max_steps,
    callbacks=[checkpoint],
    default_root_dir=args.ckpt_dir,
    logger=False,
    enable_progress_bar=False,
    enable_model_summary=False,
)
trainer.fit(Regression(args.step_time), data, ckpt_path="last")
if trainer.global_rank == 0:
    print(f"finished at step {trainer.global_step}", flush=True)
