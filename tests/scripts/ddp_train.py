"""A torchrun-style DDP script, written as people write them: env://, its own torch.save checkpoint, a
SIGTERM handler that sets a flag checked each step. Nothing of hpc_train in it.

    torchrun --nproc-per-node 2 tests/scripts/ddp_train.py --steps 200 --out /tmp/ddp
    hpc-train submit cluster=dev -- python tests/scripts/ddp_train.py --steps 200 --out {ckpt_dir}

--no-handler: no signal handler (a TERM kills it); it resumes only when given --resume.
--crash-at N: exit 1 at step N of every attempt (a crash loop).
"""

import argparse
import hashlib
import json
import os
import signal
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=200)
p.add_argument("--lr", type=float, default=0.05)
p.add_argument("--out", required=True)
p.add_argument("--save-every", type=int, default=20)
p.add_argument("--step-time", type=float, default=0.05)
p.add_argument("--no-handler", action="store_true")
p.add_argument("--resume", action="store_true")
p.add_argument("--crash-at", type=int, default=-1)
p.add_argument("--stop-save-s", type=float, default=0.0)  # a slow stop save: a second TERM would come within it
args = p.parse_args()

stop = False
terms = 0
if not args.no_handler:

    def on_term(signum, frame):
        global stop, terms
        stop = True
        terms += 1

    signal.signal(signal.SIGTERM, on_term)

dist.init_process_group("gloo")  # env://: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
rank, world = dist.get_rank(), dist.get_world_size()
torch.set_num_threads(1)
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)))
opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
os.makedirs(args.out, exist_ok=True)
ckpt = os.path.join(args.out, "ckpt.pt")
step, loss = 0, torch.tensor(float("nan"))
if os.path.exists(ckpt) and (args.resume or not args.no_handler):
    state = torch.load(ckpt)
    model.module.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    step, loss = state["step"], state["loss"]
    print(f"rank {rank}: resumed at step {step}", flush=True)


def save():
    if rank == 0:
        tmp = ckpt + ".tmp"
        torch.save(
            {"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step, "loss": loss.detach()}, tmp
        )
        os.replace(tmp, ckpt)
        print(f"saved step {step}", flush=True)
    dist.barrier()


while step < args.steps:
    g = torch.Generator().manual_seed(1000 * step + rank)  # the data of a step: the same in any attempt
    x = torch.randn(32, 16, generator=g)
    y = x.sum(dim=1, keepdim=True).sin()
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    step += 1
    time.sleep(args.step_time)
    if step == args.crash_at:
        raise SystemExit(f"rank {rank}: crash at step {step}")
    if rank == 0 and step % 10 == 0:
        print(f"step {step} loss {loss.item():.6f}", flush=True)
    flag = torch.tensor([1 if stop else 0])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # every rank stops at the same step
    if flag.item():
        save()
        time.sleep(args.stop_save_s)
        print(f"rank {rank}: stopping at step {step} after {terms} TERM(s)", flush=True)
        dist.destroy_process_group()
        raise SystemExit(0)
    if step % args.save_every == 0:
        save()

total = torch.tensor([loss.item()], dtype=torch.float64)
dist.all_reduce(total)
if rank == 0:
    weights = b"".join(p.detach().numpy().tobytes() for p in model.module.parameters())
    result = {"step": step, "loss": total.item() / world, "params_sha256": hashlib.sha256(weights).hexdigest()}
    with open(os.path.join(args.out, "final.json"), "w") as f:
        json.dump(result, f)
    print(f"final {json.dumps(result)}", flush=True)
dist.barrier()  # no destroy_process_group at the very end: gloo's teardown raced a peer's (SIGABRT, 1 in 4)
