"""Every task's one way out: its streams flushed, then `os._exit`, never the interpreter's shutdown.

CPython's shutdown kills a thread that takes the GIL once finalization has begun with `pthread_exit`; a
thread of torch's (a gloo worker, a user's thread in a collective) then unwinds through a `noexcept` frame,
and `std::terminate` aborts the process: exit 134 after `finished at step N` and summary.json, and a
finished run's job ends FAILED (2 of 5 full suites; 4 of 4 runs of a function that returns with one daemon
thread in `all_reduce`, tests/test_leave.py). `os._exit` does not finalize, so no thread is killed.

What a finished task still owes the Python it leaves is done first, in Python's own order: the threads it
would have joined (non-daemon, `concurrent.futures` pools told to end), bounded, then the `atexit` handlers
(a tracker's own finish, logging's flush). A stop or a failure leaves at once, as before: its checkpoint is
committed or given up, and a handler must not hold a requeue past KillWait.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
from typing import NoReturn

# A finished task waits up to this long for the non-daemon threads its function left (an upload, a pool's
# last write); Python's own exit would wait for ever, and a thread stuck in a dead peer's collective never ends.
THREAD_JOIN_S = 30.0
# A stop's or a failure's flush of stdout/stderr (a log on a stalled NFS mount) is given this long.
FLUSH_S = 5.0

log = logging.getLogger(__name__)


def process(code: int, finished: bool = False, join_s: float = THREAD_JOIN_S) -> NoReturn:
    """Leave with `code`. finished: join the threads Python would have joined (join_s in all) and run the
    atexit handlers first, those within join_s more: a handler that blocks (an online tracker's upload, a
    multiprocessing child that never ends) or a stream stuck on a full pipe never holds the exit."""
    if finished:
        left = join_threads(join_s)
        if left:
            log.warning("leaving with threads still running after %.0f s: %s", join_s, ", ".join(left))
    guard = threading.Timer(join_s if finished else FLUSH_S, _exit_now, (code, join_s if finished else FLUSH_S))
    guard.daemon = True
    guard.start()
    try:
        if finished:
            atexit._run_exitfuncs()  # CPython's own list, as Py_Finalize runs it (logging.shutdown is one)
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed or broken stream: nothing left to say there
                pass
        os._exit(code)
    finally:  # reached only where os._exit returned (a test's stand-in): the guard must not exit later
        guard.cancel()


def _exit_now(code: int, after_s: float) -> None:
    """The guard's exit: a raw write (the streams' locks may be what is stuck), then os._exit."""
    try:
        os.write(
            2, f"hpc_train: atexit handlers or stream flushes still running after {after_s:.0f} s: leaving\n".encode()
        )
    except OSError:
        pass
    os._exit(code)


def join_threads(budget_s: float) -> list[str]:
    """What threading._shutdown does at exit, bounded by budget_s: the callbacks that tell concurrent.futures'
    idle workers to end (and join them, unbounded: so in a daemon thread of its own), then a join of every
    other non-daemon thread. Returns the names of those still alive."""
    me = threading.current_thread()
    others = [t for t in threading.enumerate() if t is not me and not t.daemon]

    def run_callbacks() -> None:
        for callback in list(getattr(threading, "_threading_atexits", ())):
            try:
                callback()
            except Exception:  # one pool's failure must not keep another's threads from their join
                log.exception("a thread-exit callback failed")

    deadline = time.monotonic() + budget_s
    helper = threading.Thread(target=run_callbacks, name="hpc_train-leave", daemon=True)
    helper.start()
    for t in [helper, *others]:
        t.join(max(0.0, deadline - time.monotonic()))
    return [t.name for t in others if t.is_alive()]
