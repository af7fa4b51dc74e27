"""CPU seconds of each test's processes (the trainer's ranks, the CLI calls): a `.pth` file in the venv makes
every Python process append its own getrusage at exit (os._exit too: a requeue leaves by it) to LOG; `report`
sums them by the pytest tmp folder in the process's argv (a rank's run folder is under it), so a Slurm job's
ranks count for the test that queued them. A SIGKILLed process (the storm's kills) is missed.

    python benchmarks/cpu_by_test.py install .venv /tmp/cpu.jsonl
    HPC_TRAIN_CPU_LOG=/tmp/cpu.jsonl .venv/bin/python -m pytest
    python benchmarks/cpu_by_test.py remove .venv
    python benchmarks/cpu_by_test.py report /tmp/cpu.jsonl 40

The hook does nothing without HPC_TRAIN_CPU_LOG, and never fails a process (test_secrets runs the CLI as
nobody: install makes the log world-writable)."""

from __future__ import annotations

import collections
import json
import re
import sys
from pathlib import Path

HOOK = """import os
if os.environ.get("HPC_TRAIN_CPU_LOG"):
    import atexit, json, resource, sys
    _done = []
    def _log():
        if _done:
            return
        _done.append(1)
        r = resource.getrusage(resource.RUSAGE_SELF)
        line = json.dumps({"argv": " ".join(sys.argv)[:300], "cpu": r.ru_utime + r.ru_stime}) + "\\n"
        try:
            fd = os.open(os.environ["HPC_TRAIN_CPU_LOG"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
            os.write(fd, line.encode())
            os.close(fd)
        except OSError:
            pass
    atexit.register(_log)
    _exit = os._exit
    def _logged_exit(code):
        _log()
        _exit(code)
    os._exit = _logged_exit
"""


def site_packages(venv: Path) -> Path:
    return next(venv.glob("lib/python3*/site-packages"))


def report(log: Path, top: int) -> None:
    by_test: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for line in log.read_text().splitlines():
        row = json.loads(line)
        argv = row["argv"]
        m = re.search(r"popen-gw\d+/([^/ ]+?)\d*(?:/|\s|$)", argv)
        m = m or re.search(r"pytest-\d+/(?!popen)([^/ ]+?)\d*/", argv)  # -n0
        test = m.group(1) if m else "(pytest itself, or no tmp folder)"
        kind = "rank" if "start.py" in row["argv"] or "/scripts/" in row["argv"] else "other"
        by_test[test][kind] += row["cpu"]
        by_test[test][kind + "s"] += 1
    total = sum(c["rank"] + c["other"] for c in by_test.values())
    print(f"{total:.0f} CPU-s in {sum(c['ranks'] + c['others'] for c in by_test.values())} processes")
    print(" CPU-s   ranks (n)   other (n)  test (its tmp folder, cut at 30 characters)")
    for test, c in sorted(by_test.items(), key=lambda kv: -(kv[1]["rank"] + kv[1]["other"]))[:top]:
        both = c["rank"] + c["other"]
        print(f"{both:6.0f}  {c['rank']:6.0f} ({c['ranks']:3d})  {c['other']:5.0f} ({c['others']:3d})  {test}")


def main(argv: list[str]) -> None:
    if argv[:1] == ["install"]:
        log = Path(argv[2])
        log.unlink(missing_ok=True)
        log.touch()
        log.chmod(0o666)  # past the umask: test_secrets runs the CLI as nobody
        sp = site_packages(Path(argv[1]))
        (sp / "_hpc_train_cpu_log.py").write_text(HOOK)
        (sp / "zz_hpc_train_cpu_log.pth").write_text("import _hpc_train_cpu_log\n")
    elif argv[:1] == ["remove"]:
        sp = site_packages(Path(argv[1]))
        for name in ("_hpc_train_cpu_log.py", "zz_hpc_train_cpu_log.pth"):
            (sp / name).unlink(missing_ok=True)
    elif argv[:1] == ["report"]:
        report(Path(argv[1]), int(argv[2]) if len(argv) > 2 else 40)
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
