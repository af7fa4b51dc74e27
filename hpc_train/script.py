"""Launch an existing script unchanged: every rank runs the command after `--` as a child process with
torchrun's variables, gets script.stop_signal at a stop, and the job takes the usual requeue decision.

    hpc-train submit cluster=dev -- python train.py --lr 3e-4
    hpc-train submit -m cluster=dev train.lr=1e-3,3e-4 -- python train.py --lr {train.lr} --out {ckpt_dir}
    hpc-train submit cluster=dev "script.checkpoint='{ckpt_dir}/ckpt.pt'" \\
        "script.resume_args=['--init_from=resume']" -- python train.py --out_dir={ckpt_dir}
    hpc-train submit --dry-run cluster=dev -- python train.py        # the exact command of every rank

Placeholders `{train.lr}` (any key of the composed config; `+script.vars.NAME=VALUE` adds your own),
`{run_dir}` and `{ckpt_dir}` are filled in the command, resume_args and checkpoint; `{{` and `}}` are
literal braces. docs/scripts.md has a worked example. Torch-free at import: config.py holds ScriptConfig;
`supervise` (the job side, called by job.py on every rank) imports torch when the job runs.
"""

from __future__ import annotations

import glob
import json
import os
import re
import signal
import stat
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

STOP_SIGNALS = ("TERM", "USR1", "USR2", "INT")


@dataclass
class ScriptConfig:  # script.py: a command every rank runs in place of a training function
    cmd: list[str] = field(default_factory=list)  # empty: fn._target_ (or the built-in trainer) runs instead
    # What every rank's process gets at a time-limit warning or a preemption, at the same moment; SIGKILL
    # follows when it has not exited within what Slurm leaves (signal_lead_s or preempt_grace_s).
    stop_signal: str = "TERM"
    resume_args: list[str] = field(default_factory=list)  # appended only when `checkpoint` exists
    # The path or glob of the file the script saves (relative to the run directory, or absolute); one that
    # ends in "/" names a folder (found_checkpoint: only non-empty files, or folders so named, count)
    checkpoint: str = ""
    vars: dict[str, Any] = field(default_factory=dict)  # your own values for placeholders: {script.vars.NAME}

    def __post_init__(self) -> None:
        if self.stop_signal.upper().removeprefix("SIG") not in STOP_SIGNALS:
            raise ValueError(
                f"script.stop_signal={self.stop_signal!r} is not one of {STOP_SIGNALS}; the signal your script "
                f"handles to save and exit, e.g. script.stop_signal=TERM (its default, as torchrun sends)"
            )
        self.stop_signal = self.stop_signal.upper().removeprefix("SIG")
        if self.resume_args and not self.checkpoint:
            raise ValueError(
                f"script.resume_args={self.resume_args} needs script.checkpoint=PATH (the file or glob your "
                f"script writes, e.g. '{{ckpt_dir}}/ckpt.pt'): they are appended only once it exists"
            )
        if any(not isinstance(a, str) for a in self.cmd) or (self.cmd and not self.cmd[0].strip()):
            raise ValueError(f"script.cmd={self.cmd!r} must be a list of strings starting with a program")


def override(cmd: list[str]) -> str:
    """The Hydra override that sets script.cmd to exactly these words (what cli makes of `-- CMD...`):
    each word single-quoted, its quotes and the backslashes before them escaped (Hydra's quoted strings)."""
    if not cmd:
        raise ValueError(
            "nothing after --: give the command every rank runs, e.g. hpc-train submit cluster=dev -- python train.py"
        )

    def quoted(word: str) -> str:  # Hydra escapes with \ before a quote, the end and ${ (its interpolation)
        word = re.sub(r"(\\*)(?='|$|\$\{)", r"\1\1", word)
        return "'" + word.replace("'", "\\'").replace("${", "\\${") + "'"

    return f"script.cmd=[{','.join(quoted(w) for w in cmd)}]"


def ckpt_dir(run_dir: str | Path) -> Path:
    """The per-run folder a script may keep its checkpoints in (HPC_TRAIN_CKPT_DIR, {ckpt_dir})."""
    return Path(run_dir) / "script_checkpoints"


# {dotted.key}, never ${NAME} (a shell's variable, passed on as written), and {{ }} for literal braces
_PLACE = re.compile(r"\{\{|\}\}|(?<!\$)\{([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)\}")


def fill(text: str, config: dict[str, Any], run_dir: str | Path, where: str = "script.cmd", escape: Any = str) -> str:
    """`text` with every {dotted.key} replaced by the config's value, {run_dir} and {ckpt_dir} by the run's
    folders (pure), each value passed through `escape` (glob.escape for a glob). Raises ValueError naming a
    placeholder that names no config key, and the fix."""
    from hpc_train.pipeline import placeholders  # {after.ckpt}: the checkpoint of a stage (submit --after)

    own = {"run_dir": str(run_dir), "ckpt_dir": str(ckpt_dir(run_dir)), **placeholders(text, run_dir)}

    def one(m: re.Match[str]) -> str:
        if m.group(0) in ("{{", "}}"):
            return m.group(0)[0]
        key = m.group(1)
        if key in own:
            return escape(own[key])
        node: Any = config
        for i, part in enumerate(key.split(".")):
            if not isinstance(node, dict) or part not in node:
                above = ".".join(key.split(".")[:i]) or "the top level"
                keys = ", ".join(node) if isinstance(node, dict) else f"none: {above} is a value"
                raise ValueError(
                    f"{where}: {text!r} names {{{key}}}, which is not a config key (keys under {above}: {keys}); "
                    f"write an existing key such as {{train.lr}}, {{run_dir}} or {{ckpt_dir}}, add your own with "
                    f"+script.vars.NAME=VALUE and write {{script.vars.NAME}}, or {{{{ }}}} for literal braces"
                )
            node = node[part]
        return escape(json.dumps(node) if isinstance(node, (dict, list)) else str(node))

    return _PLACE.sub(one, text)


def command(config: dict[str, Any], run_dir: str | Path, resuming: bool) -> list[str]:
    """The exact command every rank runs (pure): script.cmd, plus resume_args when resuming, filled."""
    s = config["script"]
    args = [*s["cmd"], *(s["resume_args"] if resuming else [])]
    return [fill(a, config, run_dir) for a in args]


def checkpoint_path(config: dict[str, Any], run_dir: str | Path, as_glob: bool = False) -> str:
    """script.checkpoint filled and made absolute (relative ones are under the run directory); "" if unset.
    as_glob: the run directory and every filled value glob-escaped (a folder named exp[1] is that folder,
    not exp1), the user's own text keeping its wildcards."""
    raw = config["script"]["checkpoint"]
    if not raw:
        return ""
    escape = glob.escape if as_glob else str
    filled = fill(raw, config, run_dir, "script.checkpoint", escape)
    return filled if os.path.isabs(filled) else os.path.join(escape(str(run_dir)), filled)  # keeps a trailing /


def found_checkpoint(config: dict[str, Any], run_dir: str | Path) -> str:
    """The newest checkpoint script.checkpoint names (its path as written, or what its glob matches); ""
    when none exists yet. A checkpoint is a regular file that is not empty (one just opened for writing is
    not), or, when script.checkpoint ends in "/", a folder that is not empty: a folder never matches a
    file's name or glob (ckpt* would match the ckpt_tmp/ a save writes into), and {ckpt_dir} itself exists,
    empty, before the first save."""
    literal = checkpoint_path(config, run_dir)
    if not literal:
        return ""
    folder = literal.endswith("/")
    found: list[tuple[float, str]] = []
    for p in {literal, *glob.glob(checkpoint_path(config, run_dir, as_glob=True))}:
        p = p.rstrip("/") or "/"
        try:
            st = os.stat(p)
            if folder and stat.S_ISDIR(st.st_mode):
                with os.scandir(p) as entries:
                    ok = any(entries)
            else:
                ok = not folder and stat.S_ISREG(st.st_mode) and st.st_size > 0
        except OSError:  # gone since the glob, or a folder we may not read
            continue
        if ok:
            found.append((st.st_mtime, p))
    return max(found)[1] if found else ""


def check(config: dict[str, Any], run_dir: str | Path) -> None:
    """At submit, before anything is queued: an empty command or a placeholder naming no key is a sentence."""
    s = config.get("script") or {}
    if not s.get("cmd"):
        if s.get("resume_args") or s.get("checkpoint"):
            raise ValueError(
                "script.resume_args and script.checkpoint need a command: put it after --, e.g. "
                "hpc-train submit cluster=dev -- python train.py"
            )
        return
    command(config, run_dir, resuming=True)
    checkpoint_path(config, run_dir)
    ck = config.get("checkpoint") or {}
    auto = [k for k in ("every_steps", "memory_every_steps") if ck.get(k) == "auto"]
    if auto:  # hpc_train saves nothing of a script's: its interval is the script's own
        raise ValueError(
            f"checkpoint.{auto[0]}=auto chooses when hpc_train's trainer saves, and a script saves when it decides; "
            f"drop it (the submit's forecast line still says what this run can expect: docs/goodput.md)"
        )


# An interpreter whose first word that is not an option is the file it runs (python's -m and -c name none).
_RUNS_A_FILE = re.compile(r"(python[0-9.]*|bash|sh|zsh|perl|ruby|Rscript)$")
_OPTION_WITH_VALUE = {"-W", "-X", "-Q", "-o", "-O"}  # python -W arg, -X opt: the next word is the option's


def runnable(cmd: list[str], cwd: str | Path) -> str:
    """At submit, before anything is queued: "" where the command's program resolves (on PATH, or the path it
    gives) and, for an interpreter, the script file it names exists relative to `cwd` (the submit folder, where
    every rank runs it); else the sentence that names the word and the fix. A word with a {placeholder} is the
    run's to fill: not checked."""
    import shutil

    program = cmd[0]
    if "{" in program:
        return ""
    if "/" in program:
        path = Path(cwd, program)
        if not (path.is_file() and os.access(path, os.X_OK)):
            return f"script.cmd: {program!r} is not an executable file (from {cwd}); check the path, or chmod +x it"
    elif shutil.which(program) is None:
        return (
            f"script.cmd: {program!r} is not on PATH here; install it, activate the environment that has it, or "
            f"give its full path (every node must have it too)"
        )
    if not _RUNS_A_FILE.match(Path(program).name):
        return ""
    words = iter(cmd[1:])
    for word in words:
        if word in ("-m", "-c", "-"):  # a module, a string of code, stdin: no file to look for
            return ""
        if word in _OPTION_WITH_VALUE:
            next(words, None)
            continue
        if word.startswith("-"):
            continue
        if "{" not in word and not Path(cwd, word).is_file():
            return (
                f"script.cmd: {program} would run {word!r}, which is not a file in {cwd} (the command runs in the "
                f"folder you submit from); check the name, or cd to the folder that has it"
            )
        return ""
    return ""


def end_child(child: subprocess.Popen[bytes] | None) -> None:
    """SIGKILL the child's process group (its data-loader workers too), even once the child exited: its data
    loaders and daemons may live on; verdict.leave calls it before exiting."""
    if child is not None:
        try:
            os.killpg(child.pid, signal.SIGKILL)
        except OSError:  # ESRCH: the whole group is gone
            pass
