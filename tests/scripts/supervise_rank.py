"""One rank of script.supervise outside Slurm and job.py, for tests/test_script.py: two of these on one machine
form a gloo group, run the command as their children, and print how stale the hang watchdog's heartbeat got.

    python tests/scripts/supervise_rank.py RANK PORT RUN_DIR CLOCK_OFFSET_S CMD_JSON [CHECKPOINT]

CLOCK_OFFSET_S skews this process's wall clock (time.time), as a node whose clock is off by that much.
Prints one JSON line: {"max_quiet_s": the longest the heartbeat went unrenewed, "outcome": supervise's}.
"""

import json
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

rank, port, run_dir, offset, cmd = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
checkpoint = sys.argv[6] if len(sys.argv) > 6 else ""  # script.checkpoint
wall = time.time
time.time = lambda: wall() + offset  # this "node's" clock; monotonic clocks are never compared across nodes

import torch.distributed as dist  # noqa: E402

from hpc_train import preempt, supervisor  # noqa: E402
from hpc_train.paths import RunPaths  # noqa: E402
from hpc_train.task import Task  # noqa: E402

dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
env = SimpleNamespace(
    rank=rank,
    world_size=2,
    local_rank=rank,
    local_world_size=2,
    node_rank=0,
    nodes=("127.0.0.1",),
    master_addr="127.0.0.1",
    restart_count=0,
    job_id="1",
    executor="local",
)
cfg = SimpleNamespace(script=SimpleNamespace(stop_signal="TERM"))
config = {"script": {"cmd": json.loads(cmd), "resume_args": [], "checkpoint": checkpoint}}
worst, done = [0.0], threading.Event()


def sample() -> None:
    while not done.wait(0.05):
        worst[0] = max(worst[0], time.monotonic() - task.pulse.last_beat)


dist.barrier()
task = Task(preempt.install_handlers())
threading.Thread(target=sample, daemon=True).start()
out = supervisor.supervise(env, cfg, RunPaths(run_dir), config, time.time(), 10.0, task)
done.set()
print(json.dumps({"max_quiet_s": round(worst[0], 2), "outcome": out["outcome"]}), flush=True)
dist.destroy_process_group()
