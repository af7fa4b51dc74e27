"""What the node-health preflight costs at each attempt start, per node:

    .venv/bin/python benchmarks/preflight_bench.py RUN_DIR [RUN_DIR...]   # from runs' `preflight` events
    .venv/bin/python benchmarks/preflight_bench.py --ranks 4 --repeat 5   # here: 4 gloo ranks on this machine

Prints (never asserts) each check's figures and the preflight's wall time per node (the slowest rank of
the node, from the rendezvous to the verdict), and its share of the attempt's start-up where the run's
`start` event says. On GPUs the matmul and the all-reduce are timed on the device (see preflight.py).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path


def from_runs(run_dirs: list[Path]) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from hpc_train.journal import read as read_events

    walls = []
    for run_dir in run_dirs:
        events = read_events(run_dir)
        starts = {e["restart"]: e for e in events if e["event"] == "start"}
        for e in (e for e in events if e["event"] == "preflight"):
            start = starts.get(e["restart"])
            startup = (start["time"] - start["launched_at"]) if start else None
            share = f"{e['wall_s'] / startup:.1%} of a {startup:.1f} s start-up" if startup else "no start event"
            print(
                f"{run_dir.name} attempt {e['restart']}: preflight {e['wall_s']:.3f} s ({share}), all-reduce "
                f"{e['allreduce_gbps']:.3f} GB/s"
            )
            for node, f in e["nodes"].items():
                walls.append(f["wall_s"])
                print(
                    f"  {node}: {f['wall_s']:.3f} s, {f['device']} matmul {f['matmul_tflops']:.4f} TFLOP/s, "
                    f"disk {f.get('disk_free_gb', '-')} GB free, clock {f['skew_s']:+.4f} s, "
                    f"{'SICK: ' + f['sick'] if f['sick'] else 'healthy'}"
                )
    if walls:
        print(
            f"per node: median {statistics.median(walls):.3f} s, max {max(walls):.3f} s over {len(walls)} node checks"
        )


def _rank(rank: int, world: int, port: int, out: str, repeat: int) -> None:
    import torch.distributed as dist

    from hpc_train.env import RankEnv  # noqa: F401  (the fields check() reads, set by hand below)
    from hpc_train.paths import RunPaths
    from hpc_train.preflight import PreflightConfig, check

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    env = argparse.Namespace(
        rank=rank,
        local_rank=rank % 2,
        local_world_size=2,
        world_size=world,
        node_rank=rank // 2,
        nodes=tuple(f"node{i}" for i in range(world // 2)),
        job_id="bench",
        restart_count=0,
    )
    for _ in range(repeat):
        check(env, PreflightConfig(), RunPaths(Path(out)))
    dist.destroy_process_group()


def here(ranks: int, repeat: int) -> None:
    import torch
    import torch.multiprocessing as mp

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_rank, args=(ranks, 29771, out, repeat), nprocs=ranks)
        from_runs([Path(out)])


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dirs", nargs="*", type=Path)
    parser.add_argument("--ranks", type=int, default=4, help="here: ranks, 2 per pretend node")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    from_runs(args.run_dirs) if args.run_dirs else here(args.ranks, args.repeat)
