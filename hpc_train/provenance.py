"""Which code a run was validated with: recorded at submit (code.json, code.diff), checked when a job starts.

    hpc-train --version          # this version, where it is installed, its git commit
    cat runs/demo-1/code.json    # what validated the run

Torch-free: submit writes the record on the login node; the first task on every node compares it with
the code it imported. The git fields are filled only when this package's own files are tracked in a git
checkout (an editable install); code.diff holds `git diff HEAD` of tracked files only, so untracked
files (a .env, a key file) never land in a run directory.
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


def _git(*args: str) -> str | None:
    """git's stdout, or None when git is missing, slow (10 s) or says no."""
    try:
        proc = subprocess.run(["git", "-C", str(PACKAGE_DIR), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout if proc.returncode == 0 else None


def identity() -> tuple[dict[str, Any], str]:
    """(code.json's record, the diff of tracked files against HEAD: "" when clean or not a checkout)."""
    record: dict[str, Any] = {"version": hpc_train.__version__, "path": str(PACKAGE_DIR), "python": sys.executable,
                              "git_commit": None, "git_dirty": None, "git_diff_sha256": None}
    # A wheel inside a venv inside some repository is not that repository's code: ask for our own file.
    if _git("ls-files", "--error-unmatch", "__init__.py") is None:
        return record, ""
    commit, diff = _git("rev-parse", "HEAD"), _git("diff", "HEAD", "--no-color", "--no-ext-diff")
    if commit is None or diff is None:
        return record, ""
    record.update(git_commit=commit.strip(), git_dirty=bool(diff),
                  git_diff_sha256=hashlib.sha256(diff.encode()).hexdigest())
    return record, diff


def describe() -> str:
    """One line for `hpc-train --version`."""
    record, diff = identity()
    git = f"; git {record['git_commit'][:12]}{' + uncommitted changes' if diff else ''}" if record["git_commit"] else ""
    return f"hpc-train {record['version']} from {record['path']}{git} (python {sys.executable})"


def differences(recorded: dict[str, Any]) -> str:
    """"" when this process runs the code the run was validated with; else what changed, as a sentence.
    Git fields are compared only where git can answer here (a compute node may have no git)."""
    now, _ = identity()
    changed = [f"{key} {recorded.get(key)!r} -> {now[key]!r}" for key in COMPARED
               if recorded.get(key) != now[key] and not (key.startswith("git") and now["git_commit"] is None)]
    if not changed:
        return ""
    return (f"this task runs other code than the code that validated the run at submit (code.json): "
            f"{'; '.join(changed)}. Resubmit to train with the new code under a new run, or put the old code back")
