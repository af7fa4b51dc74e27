"""One rank of supervisor.supervise, alone, whose journal cannot be written (protocol.signal_event raises EIO, as a
full or failing disk does), for tests/test_script.py: the stop signal must still reach the child.

    python tests/scripts/supervise_journal_fails.py PORT RUN_DIR CMD_JSON

Prints one JSON line: {"raised": the error supervise raised, or ""}.
"""

import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch.distributed as dist

from hpc_train import preempt, protocol, supervisor
from hpc_train.paths import RunPaths
from hpc_train.sbatch import ClusterConfig
from hpc_train.task import Task

port, run_dir, cmd = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])


def fails(*args: object, **kwargs: object) -> None:
    raise OSError(5, "Input/output error")


protocol.signal_event = fails
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
env = SimpleNamespace(
    rank=0,
    world_size=1,
    local_rank=0,
    local_world_size=1,
    node_rank=0,
    nodes=("127.0.0.1",),
    master_addr="127.0.0.1",
    restart_count=0,
    job_id="1",
    executor="local",
)
cfg = SimpleNamespace(script=SimpleNamespace(stop_signal="TERM"), cluster=ClusterConfig(executor="local"))
config = {"script": {"cmd": cmd, "resume_args": [], "checkpoint": ""}}
task = Task(preempt.install_handlers())
try:
    supervisor.supervise(env, cfg, RunPaths(run_dir), config, time.time(), 10.0, task)
    raised = ""
except OSError as e:
    raised = str(e)
print(json.dumps({"raised": raised}), flush=True)
