"""A script that requeues its own job at its stop signal, as Lightning's auto_requeue does (its SLURMEnvironment:
SIGUSR1 -> save, then rank 0 runs `scontrol requeue $SLURM_JOB_ID`, and the handler returns: training goes on
until Slurm kills the job), for tests/test_slurm_script.py. Torch-free: one step every 0.1 s, its step in
OUT/ckpt.json, written at the stop. The SIGTERM of the requeue is ignored (the supervisor starts its child so).

    python self_requeue.py OUT
"""

import json
import os
import signal
import subprocess
import sys
import time

path = os.path.join(sys.argv[1], "ckpt.json")
step = json.load(open(path))["step"] if os.path.exists(path) else 0
print(f"rank {os.environ['RANK']}: from step {step}", flush=True)
stop: list[int] = []
signal.signal(signal.SIGUSR1, lambda *_: stop.append(1))
while True:
    time.sleep(0.1)
    step += 1
    if stop:
        break
if os.environ["RANK"] == "0":
    with open(path + ".tmp", "w") as f:
        json.dump({"step": step}, f)
    os.replace(path + ".tmp", path)
    subprocess.run(["scontrol", "requeue", os.environ["SLURM_JOB_ID"]], check=True)
    print(f"saved step {step} and requeued job {os.environ['SLURM_JOB_ID']}", flush=True)
while True:  # as Lightning after its requeue: the loop goes on until the job is killed
    time.sleep(0.1)
