"""Which code a run was validated with: recorded at submit (code.json, code.diff), checked when a job starts.

    hpc-train --version          # this version, where it is installed, its git commit
    cat runs/demo-1/code.json    # what validated the run

Torch-free: submit writes the record on the login node; the first task on every node compares it with
the code it imported. The git fields are filled only when this package's own files are tracked in a git
checkout (an editable install). code.diff holds `git diff HEAD` of the package's own tracked files only
(hpc_train/: not the rest of the repository, not untracked files such as a .env or a key file), as
bytes (a source file need not be UTF-8), owner-only, capped at DIFF_CAP_BYTES.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path
from typing import Any

import hpc_train

PACKAGE_DIR = Path(hpc_train.__file__).resolve().parent
COMPARED = ("version", "path", "git_commit", "git_diff_sha256")
DIFF_CAP_BYTES = 4 << 20  # a diff past 4 MiB is a vendored blob, not an edit: code.json keeps its full hash


def _git(*args: str) -> bytes | None:
    """git's stdout as bytes (a modified file may hold any bytes), or None when git is missing, slow (10 s)
    or says no."""
    try:
        proc = subprocess.run(["git", "-C", str(PACKAGE_DIR), *args], capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout if proc.returncode == 0 else None


def identity() -> tuple[dict[str, Any], bytes]:
    """(code.json's record, the diff of the package's tracked files against HEAD: b"" when clean or not a
    checkout)."""
    record: dict[str, Any] = {
        "version": hpc_train.__version__,
        "path": str(PACKAGE_DIR),
        "python": sys.executable,
        "git_commit": None,
        "git_dirty": None,
        "git_diff_sha256": None,
    }
    # A wheel inside a venv inside some repository is not that repository's code: ask for our own file.
    if _git("ls-files", "--error-unmatch", "__init__.py") is None:
        return record, ""
    # --relative with pathspec ".": only this package's folder, paths relative to it
    commit = _git("rev-parse", "HEAD")
    diff = _git("diff", "HEAD", "--no-color", "--no-ext-diff", "--relative", "--", ".")
    if commit is None or diff is None:
        return record, b""
    record.update(
        git_commit=commit.decode("ascii", "replace").strip(),
        git_dirty=bool(diff),
        git_diff_sha256=hashlib.sha256(diff).hexdigest(),
    )
    return record, diff


def capped(diff: bytes) -> bytes:
    """code.diff's content: the diff, or its first DIFF_CAP_BYTES and a line saying it was cut."""
    if len(diff) <= DIFF_CAP_BYTES:
        return diff
    return (
        diff[:DIFF_CAP_BYTES]
        + (
            f"\n# hpc-train: code.diff capped at {DIFF_CAP_BYTES} of {len(diff)} bytes; "
            f"code.json's git_diff_sha256 is the hash of the whole diff\n"
        ).encode()
    )


def describe() -> str:
    """One line for `hpc-train --version`."""
    record, diff = identity()
    git = f"; git {record['git_commit'][:12]}{' + uncommitted changes' if diff else ''}" if record["git_commit"] else ""
    return f"hpc-train {record['version']} from {record['path']}{git} (python {sys.executable})"


def differences(recorded: dict[str, Any]) -> str:
    """ "" when this process runs the code the run was validated with; else what changed, as a sentence.
    Git fields are compared only where git can answer here (a compute node may have no git)."""
    now, _ = identity()
    changed = [
        f"{key} {recorded.get(key)!r} -> {now[key]!r}"
        for key in COMPARED
        if recorded.get(key) != now[key] and not (key.startswith("git") and now["git_commit"] is None)
    ]
    if not changed:
        return ""
    return (
        f"this task runs other code than the code that validated the run at submit (code.json): "
        f"{'; '.join(changed)}. Resubmit to train with the new code under a new run, or put the old code back"
    )
