"""The job side's logging (ranklog.py): the rank in every line, warnings on stderr, the step line unprefixed, the
attempt header once per file, and a user's dictConfig never silencing the lines of a stop or a finish."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

CODE = """
import logging, logging.config
from hpc_train import ranklog
ranklog.configure("?")
logging.getLogger("hpc_train.start").info("before placement")
ranklog.configure(2)                      # placement named the rank
logging.getLogger("hpc_train.rendezvous").info("placed task 0 as rank 2 on node3")
logging.getLogger("hpc_train.lease").warning("job 41 took this run's lease")
logging.getLogger(ranklog.PROGRESS).info("step 20/30  loss 4.1162")
logging.getLogger("user").warning("the user's own line")   # not ours: Python's last resort, as without us
requeue = logging.getLogger("hpc_train.requeue")  # as at import of hpc_train.requeue
logging.config.dictConfig({"version": 1})  # a user's function: disable_existing_loggers=True
requeue.error("silenced")
ranklog.enable()                           # what job.py and failure.py do after the function
requeue.error("not requeueing: budget spent")
"""


def fields(line: str) -> tuple[str | None, str | None, str]:
    """(rank, level, message) of a line: `[hpc_train rank R] ` then `warning: ` or `error: ` above INFO; (None,
    None, line) for a line without our prefix."""
    m = re.fullmatch(r"\[hpc_train rank (\S+)\] (?:(warning|error): )?(.*)", line)
    return (m[1], m[2], m[3]) if m else (None, None, line)


def test_lines_carry_the_rank_warnings_go_to_stderr_and_the_step_line_is_bare(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, check=True)
    assert [fields(line) for line in proc.stdout.splitlines()] == [
        ("?", None, "before placement"),
        ("2", None, "placed task 0 as rank 2 on node3"),
        (None, None, "step 20/30  loss 4.1162"),  # the progress line: bare
    ]
    assert [fields(line) for line in proc.stderr.splitlines()] == [
        ("2", "warning", "job 41 took this run's lease"),
        (None, None, "the user's own line"),
        ("2", "error", "not requeueing: budget spent"),  # a user's dictConfig did not silence it
    ]


def test_the_attempt_header_once_per_file_and_lines_follow_a_swapped_stream(tmp_path: Path) -> None:
    """The handlers write to sys.stdout/sys.stderr as they are when a line is written (a test's capture swaps
    them), not as they were when configure ran."""
    import io
    import logging

    from hpc_train import ranklog

    ranklog.configure(0)
    swapped = io.StringIO()
    old, sys.stdout = sys.stdout, swapped
    try:
        logging.getLogger("hpc_train.x").info("to the stream of now")
        ranklog.header(1, 0)
    finally:
        sys.stdout = old
    assert swapped.getvalue().splitlines()[0] == "[hpc_train rank 0] to the stream of now"
    assert "==== hpc_train attempt 1 rank 0 ====" in swapped.getvalue()
