"""How long the batch step's relay takes to put its signal handlers in, with and without site imports (-S).

Between the batch script's `trap '' USR2 TERM` and relay.py's handlers a stop signal sent to the batch shell is
ignored, so lost: this is that window. It is the interpreter's start and the four imports relay.py makes before
its handlers (os, signal, sys, time), timed N times each way as a whole process, side by side.

    .venv/bin/python benchmarks/relay_start.py [N]
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time

# what relay.py runs before its handlers go in: the interpreter, then os, signal, sys, time
PROBE = "import os, signal, sys, time"


def timed(flags: list[str], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, *flags, "-c", PROBE], check=True)
        out.append((time.perf_counter() - t0) * 1000)
    return out


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    for label, flags in (("python -u (before)", ["-u"]), ("python -S -u (relay now)", ["-S", "-u"])):
        ms = timed(flags, n)
        print(f"{label:26s} median {statistics.median(ms):6.1f} ms  max {max(ms):6.1f} ms  ({n} starts)")


if __name__ == "__main__":
    main()
