"""Commit and resume verification where hashing matters: 4 ranks, FSDP2-sharded fp32 weights + AdamW
moments (~2.1 GB of state), gloo, on this machine. Side by side in one run, best of 2:

    .venv/bin/python benchmarks/hash_bench.py                 # 11 x 4096x4096 layers: 0.74 GB weights, 2.2 GB state
    .venv/bin/python benchmarks/hash_bench.py --layers 4      # quicker

Prints (never asserts):
  - the DCP write alone (every rank writes its shard; the floor)
  - a synchronous save + commit before this change: after the write, rank 0 hashes every file of the
    checkpoint while the other ranks wait at a barrier; and now: each rank hashes what it wrote, one gather
  - a background save's commit at a step boundary, once the write is done: how long the loop is blocked
    (before: rank 0's hash of the whole checkpoint; now: one gather of the manifests)
  - resume verification: rank 0 alone (before) vs every rank a share (now)
Files are hashed right after they were written, from the page cache: sha256 is then CPU-bound, and this
machine's 2 cores cap the parallel speed-up at 2x whatever the rank count; on a cluster each rank hashes
on its own node's cores and its own storage client.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def timed(fn) -> float:  # noqa: ANN001
    dist.barrier()
    t0 = time.monotonic()
    fn()
    dist.barrier()
    return time.monotonic() - t0


def worker(rank: int, world: int, layers: int, root: str, port: int) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from hpc_train import checkpoint as ck
    from hpc_train import checkpoint_files as ck_files

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))
    model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096, bias=False) for _ in range(layers)])
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(2, 4096)).sum().backward()
    opt.step()  # AdamW's moments exist: state = 3 x weights
    state = ck.TrainState(model, opt, step=1)
    root_p, drills = Path(root), Path(root) / "drills"
    writer = ck.Writer()
    rows: dict[str, list[float]] = {}

    def add(name: str, seconds: float) -> None:
        rows.setdefault(name, []).append(seconds)

    for attempt in range(2):
        folder = root_p / f"plain_{attempt}"
        add("write", timed(lambda: dcp.save(state.state_dict(), checkpoint_id=folder)))

        def rank0_hashes_everything() -> None:
            if rank == 0:
                ck_files.manifest_of(sorted(p for p in folder.iterdir() if p.is_file()))

        add("old commit (rank 0 hashes all)", timed(rank0_hashes_everything))
        manifest = ck_files.manifest_of(sorted(p for p in folder.iterdir() if p.is_file())) if rank == 0 else {}
        add("old verify (rank 0 alone)", timed(lambda: rank == 0 and ck_files.verify(folder, manifest)))
        state.step = 10 + attempt
        pending: list = []
        add(
            "save+commit now (sync)",
            timed(
                lambda: (
                    pending.append(ck.start_save(root_p, state, "periodic", None, drills, False))
                    or ck.commit(pending[-1])
                )
            ),
        )
        add("write+own hash now (sync)", max(p.future.result()[1] for p in pending))
        state.step = 20 + attempt
        p = ck.start_save(root_p, state, "periodic", writer, drills, False)
        p.future.result()  # the background write and this rank's hash are done
        add("async commit stall now", timed(lambda: ck.commit(p)))
        marker = ck.read_marker(ck.step_dir(root_p, state.step))
        share = ck.shares({n: f["bytes"] for n, f in marker["files"].items()}, world)[rank]
        add(
            "verify now (every rank a share)",
            timed(lambda: ck_files.verify(ck.step_dir(root_p, state.step), {n: marker["files"][n] for n in share})),
        )
        for f in (folder, ck.step_dir(root_p, 10 + attempt), ck.step_dir(root_p, 20 + attempt)):
            dist.barrier()
            if rank == 0:
                shutil.rmtree(f)
    if rank == 0:
        state_bytes = 3 * sum(p.numel() * 4 for p in model.parameters())  # DTensor numel: the global size
        print(
            f"state: {layers} x 4096x4096 fp32 weights + AdamW moments = {state_bytes / 1e9:.2f} GB on {world} ranks "
            f"({state_bytes / world / 1e6:,.0f} MB per rank), {os.cpu_count()} CPUs"
        )
        w = min(rows["write"])
        for name, values in rows.items():
            best = min(values)
            extra = f"  ({state_bytes / 1e6 / best:,.0f} MB/s)" if name in ("write",) else ""
            print(f"{name:34s} {best:7.2f} s{extra}")
        old = min(rows["old commit (rank 0 hashes all)"])
        print(
            f"-> commit overhead after the write: before {old:.2f} s (all ranks wait), now "
            f"{min(rows['save+commit now (sync)']) - w:.2f} s; loop blocked at an async commit: before "
            f"{old:.2f} s, now {min(rows['async commit stall now']):.3f} s"
        )
        print(
            f"-> resume verification: before {min(rows['old verify (rank 0 alone)']):.2f} s, now "
            f"{min(rows['verify now (every rank a share)']):.2f} s"
        )
    writer.pool.shutdown(wait=True)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=11, help="4096x4096 fp32 layers (64 MiB each); state = 3x")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="hash_bench_", dir=args.dir)
    try:
        mp.spawn(worker, args=(args.ranks, args.layers, root, 29000 + os.getpid() % 1000), nprocs=args.ranks)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
