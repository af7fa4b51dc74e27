"""CPU seconds by kind of process while something runs (the test suite): samples /proc every 2 s, counts
each process's CPU since it was first seen, and writes the totals as JSON at SIGTERM or every minute.

    python benchmarks/suite_cpu.py /tmp/suite_cpu.json & echo $! > /tmp/suite_cpu.pid
    .ci/run
    kill $(cat /tmp/suite_cpu.pid); cat /tmp/suite_cpu.json

A process that lives under 2 s is missed (the CLI's Slurm calls); the trainer's ranks live longer."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

HZ = os.sysconf("SC_CLK_TCK")
KINDS = ("hpc_train/start.py", "ddp_train.py", "exec(eval(sys.stdin", "submitit.local", "supervise_rank", "-m pytest")
KINDS += ("hpc-train ", "slurmctld", "slurmdbd", "slurmd", "slurmstepd", "srun", "mariadbd", "munged")


def kind(cmdline: str) -> str:
    """The first of KINDS in the command line (the xdist workers are `exec(eval(sys.stdin`), else its program."""
    text = cmdline.replace("\0", " ")
    return next((k for k in KINDS if k in text), text.split(" ")[0].rsplit("/", 1)[-1][:30])


def main(out: Path) -> None:
    seen: dict[tuple[str, str], list] = {}  # (pid, start time) -> [kind, CPU s since first seen, CPU s then]

    def dump(*_: object) -> None:
        totals: dict[str, list[float]] = {}
        for name, cpu_s, _first in seen.values():
            row = totals.setdefault(name, [0, 0.0])
            row[0], row[1] = row[0] + 1, row[1] + cpu_s
        rows = sorted(totals.items(), key=lambda kv: -kv[1][1])
        out.write_text(json.dumps({k: {"procs": n, "cpu_s": round(s, 1)} for k, (n, s) in rows}, indent=1) + "\n")

    signal.signal(signal.SIGTERM, lambda *_: (dump(), sys.exit(0)))
    last = time.monotonic()
    while True:
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                cpu_s, key = (int(fields[11]) + int(fields[12])) / HZ, (pid, fields[19])
                if key in seen:
                    seen[key][1] = cpu_s - seen[key][2]
                else:
                    seen[key] = [kind(Path(f"/proc/{pid}/cmdline").read_text()), 0.0, cpu_s]
            except (OSError, IndexError, ValueError):  # it ended while read
                continue
        if time.monotonic() - last > 60:
            dump()
            last = time.monotonic()
        time.sleep(2)


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "suite_cpu.json"))
