"""A script launched unchanged (script.py): the command line after --, placeholders, the sentences for bad
input, the dry run's exact command, and one local run of a torchrun-style DDP script to its end."""

from __future__ import annotations

import json
import os
import pickle
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import names, read_events, submit, wait_until

from hpc_train.config import ConfigSource, compose, to_run_config
from hpc_train.script import ScriptConfig, command, fill, override

ROOT = Path(__file__).resolve().parent.parent
HPC_TRAIN = [sys.executable, "-m", "hpc_train.cli"]
DDP = str(ROOT / "tests" / "scripts" / "ddp_train.py")


def test_any_words_after_the_double_dash_reach_the_script_exactly(tmp_path: Path) -> None:
    """Random words of quotes, backslashes, punctuation, spaces, $VAR and ${VAR} survive Hydra's override, the
    frozen config.yaml a requeued attempt reads, and the placeholder fill: what every rank runs is what was
    typed. Before (review): a ${HOME} typed in single quotes was Hydra's interpolation ("Interpolation key
    'HOME' not found" at submit; ${oc.env:HOME} the login node's value), so it was left out of this test."""
    from hpc_train.config import load_frozen
    from hpc_train.submit import frozen_yaml

    rng = random.Random(19)
    parts = ["a", "b", " ", "'", '"', "\\", "=", ",", "[", "]", "(", ")", ":", "-", "_", ".", "/", "$", "$HOME"]
    parts += ["${HOME}", "${oc.env:HOME}", "${train.lr}", "\\${HOME}"]
    for _ in range(40):
        words = ["".join(rng.choice(parts) for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 5))]
        config = compose([override(words)], ConfigSource())
        cfg = to_run_config(config)
        assert cfg.script.cmd == words
        (tmp_path / "config.yaml").write_text(frozen_yaml(__import__("dataclasses").asdict(cfg)))
        assert load_frozen(tmp_path).script.cmd == words  # the requeued attempt's copy
        assert command(__import__("dataclasses").asdict(cfg), tmp_path, resuming=False) == words


def test_a_shell_variable_after_the_double_dash_reaches_the_script_as_typed(tmp_path: Path) -> None:
    """No shell runs the command: `${HOME}` typed in single quotes is text, as under torchrun (the dry run
    shows it, quoted for a shell); `{ckpt_dir}` is ours."""
    proc = _submit(tmp_path, "--", "python", "t.py", "--out", "${HOME}/x", "$USER", "{ckpt_dir}", flags=("--dry-run",))
    assert proc.returncode == 0, proc.stderr
    runs = next(line for line in proc.stdout.splitlines() if "every rank runs:" in line)
    # quoted so that a shell reads back the words as typed
    ckpt = tmp_path / "demo-1" / "script_checkpoints"
    assert runs.startswith("# every rank runs: ") and "'${HOME}/x' '$USER'" in runs, runs
    assert shlex.split(runs.split(": ", 1)[1]) == ["python", "t.py", "--out", "${HOME}/x", "$USER", str(ckpt)], runs


def test_placeholders_take_config_values_and_run_folders() -> None:
    config = {"train": {"lr": 0.0003}, "script": {"vars": {"wd": 0.1}}}
    assert fill("--lr={train.lr}", config, "/r") == "--lr=0.0003"
    template = "{script.vars.wd} {ckpt_dir} {{train.lr}}"
    assert fill(template, config, "/r") == "0.1 /r/script_checkpoints {train.lr}"
    assert fill('{"a": 1}', config, "/r") == '{"a": 1}'  # JSON is not a placeholder
    with pytest.raises(ValueError, match=r"names \{train.lrr\}, which is not a config key .*keys under train: lr"):
        fill("--lr={train.lrr}", config, "/r")


def test_resume_args_only_when_resuming() -> None:
    config = {"script": {"cmd": ["python", "t.py"], "resume_args": ["--init_from=resume"], "checkpoint": "x"}}
    assert command(config, "/r", resuming=False) == ["python", "t.py"]
    assert command(config, "/r", resuming=True) == ["python", "t.py", "--init_from=resume"]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"stop_signal": "HUP"}, r"script.stop_signal='HUP' is not one of \('TERM', 'USR1', 'USR2', 'INT'\)"),
        ({"resume_args": ["--resume"]}, r"needs script.checkpoint=PATH"),
    ],
)
def test_bad_script_config_is_a_sentence(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ScriptConfig(cmd=["python"], **kwargs)
    assert ScriptConfig(cmd=["python"], stop_signal="sigusr1").stop_signal == "USR1"


def _submit(tmp_path: Path, *args: str, flags: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    (tmp_path / "t.py").touch()  # the script most cases name: submit refuses one that is not there
    return subprocess.run(
        [*HPC_TRAIN, "submit", *flags, f"out_dir={tmp_path}", *args],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=360,  # a hang's bound: past train.rendezvous_timeout_s (120 s) twice over; CI once took > 120 s
    )


def test_the_dry_run_shows_every_ranks_command_of_each_trial(tmp_path: Path) -> None:
    (tmp_path / "train.py").touch()
    proc = _submit(
        tmp_path,
        "train.lr=1e-3,3e-4",
        "script.checkpoint='{ckpt_dir}/ckpt.pt'",  # quoted: Hydra reads an unquoted { as a dict
        "script.resume_args=[--resume]",
        "--",
        "python",
        "train.py",
        "--lr={train.lr}",
        "--out",
        "{ckpt_dir}",
        flags=("--dry-run", "-m"),
    )
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if "runs:" in line or "exists:" in line]
    assert len(lines) == 4, proc.stdout
    for trial, lr in enumerate(["0.001", "0.0003"]):  # each trial: its command, then the resume's
        ckpt = tmp_path / "demo-1" / f"{trial:04d}" / "script_checkpoints"
        argv = ["python", "train.py", f"--lr={lr}", "--out", str(ckpt)]
        first, then = lines[2 * trial : 2 * trial + 2]
        assert first.startswith("# every rank runs: ") and shlex.split(first.split(": ", 1)[1]) == argv
        assert then.startswith(f"# once {ckpt}/ckpt.pt exists: ")
        assert shlex.split(then.split(" exists: ", 1)[1]) == [*argv, "--resume"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--"], r"error: nothing after --: give the command every rank runs"),
        (["--", "python", "t.py", "--lr={train.lrr}"], r"error: script.cmd: '--lr=\{train.lrr\}' names \{train.lrr\}"),
        (["script.stop_signal=KILL", "--", "python"], r"error: script.stop_signal='KILL' is not one of"),
        (["fn._target_=a.b", "--", "python"], r"fn._target_='a.b' and a command after -- \(script.cmd\) both"),
        # issue 29: a wrong script was queued and retried three times, its cause only in `logs`
        (
            ["--", "no-such-train-prog", "--lr=1"],
            r"error: script.cmd: 'no-such-train-prog' is not on PATH here; install",
        ),
        (
            ["--", "python", "-u", "nothere.py"],
            r"error: script.cmd: python would run 'nothere.py', which is not a file",
        ),
        (["--", "./t.py"], r"error: script.cmd: './t.py' is not an executable file .*chmod \+x"),
    ],
)
def test_bad_input_is_one_sentence_before_anything_is_queued(tmp_path: Path, args: list[str], message: str) -> None:
    proc = _submit(tmp_path, *args)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert __import__("re").search(message, proc.stderr), proc.stderr
    assert not list(tmp_path.glob("demo-*")), "nothing written"


def test_a_ddp_script_runs_to_its_end_on_the_local_executor(tmp_path: Path) -> None:
    """Two ranks on this machine: env:// finds the script's own port (ours is held by our TCPStore)."""
    proc = _submit(tmp_path, "--", sys.executable, DDP, "--steps", "20", "--out", "{ckpt_dir}", "--step-time", "0")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_dir = tmp_path / "demo-1"
    final = json.loads((run_dir / "script_checkpoints" / "final.json").read_text())
    assert final["step"] == 20
    assert json.loads((run_dir / "summary.json").read_text())["exit_codes"] == [0, 0]
    start = next(json.loads(line) for line in (run_dir / "events.jsonl").open() if '"start"' in line)
    assert start["target"] == "script" and start["cmd"][-1] == "0"
    # a drill of hpc_train's own saver would be armed and never fire on a script's run: refused, nothing armed
    chaos = subprocess.run([*HPC_TRAIN, "chaos", str(run_dir), "kill-rank-during-save"], capture_output=True, text=True)
    assert chaos.returncode == 2 and "Traceback" not in chaos.stderr, chaos.stderr
    assert "runs your script" in chaos.stderr and "sick-node" in chaos.stderr and not (run_dir / "drills").exists()


def test_a_command_that_cannot_run_is_one_sentence_and_a_shells_exit_code(tmp_path: Path) -> None:
    """A mistyped program after `--`: before (adversarial review), every rank printed a bare FileNotFoundError
    traceback naming no program; then it exited 1, a crash the failure budget retried (3 attempts, 100 s)."""
    from hpc_train.supervisor import _SHIM

    not_executable = tmp_path / "train.py"
    not_executable.write_text("print('hi')\n")
    for prog, code, why in (("no-such-train-prog", 127, "No such file or directory"), (not_executable, 126, "")):
        proc = subprocess.run(
            [sys.executable, "-c", _SHIM, "", "TERM", str(prog), "--lr=1"], capture_output=True, text=True
        )
        assert proc.returncode == code and "Traceback" not in proc.stderr, proc.stderr
        assert proc.stderr.startswith(f"[hpc_train] cannot run {str(prog)!r}: {why}"), proc.stderr


def test_exit_126_or_127_is_a_sentence_not_a_crash_to_retry() -> None:
    from hpc_train.supervisor import judge

    def rank(r: int, code: int, killed: bool = False, tail: str = "") -> dict:
        shim = "[hpc_train] cannot run 'x': No such file or directory" if code in (126, 127) and not tail else ""
        return {"rank": r, "code": code, "node": f"n{r // 2}", "tail": tail or shim, "killed": killed}

    out = judge([rank(0, -9, killed=True), rank(1, -9, killed=True), rank(2, 127), rank(3, 0)], ["trainx"], "/r")
    assert out["outcome"] == "unrunnable" and out["first"] == 2
    assert names(
        out["why"],
        "'trainx' exited with 127",
        "rank 2 (n1)",
        "not found",
        "PATH",
        "`hpc-train resume /r`",
        "absolute path",
        "Not requeued: no budget spent",
    )
    assert "chmod +x it" in judge([rank(0, 126)], ["./t.py"], "/r")["why"]
    # an exit 127 we caused (SIGKILL-ed ranks report -9, never 127) and any other code are failures
    assert judge([rank(0, 1), rank(1, 0)], ["python"], "/r") == {
        "outcome": "failed",
        "reason": "failure",
        "first": 0,
        "sick": None,
    }
    # a program's own 127 (review: `bash run.sh` whose last command is missing on one node) is a failure too
    own = judge([rank(0, 127, tail="run.sh: line 3: torchrun: command not found"), rank(1, 0)], ["bash"], "/r")
    assert own["outcome"] == "failed"
    ecc = judge([rank(0, 1, tail="CUDA error: uncorrectable ECC error encountered")], ["python"], "/r")
    assert list(ecc["sick"]) == ["n0"] and names(
        ecc["sick"]["n0"], "rank 0 on n0", "hardware error", "uncorrectable ECC"
    )
    assert judge([rank(0, 0), rank(1, 0)], ["python"], "/r") == {"outcome": "finished", "exit_codes": [0, 0]}


def test_a_missing_program_stops_the_run_at_once_on_the_local_executor(tmp_path: Path) -> None:
    """One attempt, a `stopped` naming the program and the fix, no requeue (before: 3 attempts, budget spent). The
    program is there at submit (an executable file) but cannot run on the node (its interpreter is missing), as a
    node without the login node's install would have it."""
    prog = tmp_path / "no-such-train-prog"
    prog.write_text("#!/no/such/interpreter\n")
    prog.chmod(0o755)
    proc = _submit(tmp_path, "--", "./no-such-train-prog", "--lr=1")
    events = [json.loads(line) for line in (tmp_path / "demo-1" / "events.jsonl").open()]
    seen = [e["event"] for e in events]
    assert seen.count("start") == 1 and "requeue" not in seen, seen
    stopped = next(e for e in events if e["event"] == "stopped")
    assert names(stopped["reason"], "could not run", "'./no-such-train-prog' exited with 127")
    assert names(proc.stdout + proc.stderr, "not requeued", "could not run")


@pytest.mark.parametrize(
    "source, args, cause",
    [
        ("import nothere_mod_xyz\n", [], "ModuleNotFoundError: No module named 'nothere_mod_xyz'"),
        ("def f(:\n", [], "SyntaxError: "),
        (
            "import argparse\np = argparse.ArgumentParser(prog='t.py')\np.add_argument('--lr', required=True)\n"
            "p.parse_args()\n",
            [],
            "t.py: error: the following arguments are required: --lr",
        ),
    ],
)
def test_a_script_that_fails_before_any_progress_stops_at_once_with_its_cause(
    tmp_path: Path, source: str, args: list[str], cause: str
) -> None:
    """Issue 29: an import error, a syntax error or the argument parser's refusal before any checkpoint or metrics
    row is one attempt, not three: `fail` and `stopped` carry the cause's line, the local submit's output says it,
    no requeue (before: 3 attempts, 'failure budget spent', the cause only in `logs`)."""
    (tmp_path / "t.py").write_text(source)
    proc = subprocess.run(
        [*HPC_TRAIN, "submit", f"out_dir={tmp_path}", "--", "python", "t.py", *args],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=360,
    )
    events = [json.loads(line) for line in (tmp_path / "demo-1" / "events.jsonl").open()]
    seen = [e["event"] for e in events]
    assert seen.count("start") == 1 and "requeue" not in seen, seen
    fail = next(e for e in events if e["event"] == "fail")
    stopped = next(e for e in events if e["event"] == "stopped")
    assert cause in fail["error"] and cause in stopped["reason"], (fail, stopped)
    assert "failed before any progress" in stopped["reason"]
    assert cause in proc.stdout + proc.stderr, proc.stdout + proc.stderr


def test_no_retry_causes_only_count_before_any_progress() -> None:
    """judge: the same import error after a checkpoint or a metrics row (rank 0's `progress`) is a failure with
    its budget (a node's broken install an hour in); a usage line counts only with argparse's exit code 2; a
    rank we ended is never the cause."""
    from hpc_train.supervisor import cause, judge

    tail = "Traceback (most recent call last):\nModuleNotFoundError: No module named 'x'\n"

    def rank(r: int, code: int, progress: bool | None = None, killed: bool = False, t: str = tail) -> dict:
        out = {"rank": r, "code": code, "node": f"n{r}", "tail": t, "killed": killed}
        return out if progress is None else {**out, "progress": progress}

    assert judge([rank(0, 1, progress=False), rank(1, 0)], ["python"], "/r")["outcome"] == "unrunnable"
    assert judge([rank(0, 1, progress=True), rank(1, 0)], ["python"], "/r")["outcome"] == "failed"
    assert judge([rank(0, 1), rank(1, 0)], ["python"], "/r")["outcome"] == "failed"  # unknown: as progress
    ended = [rank(0, 0, progress=False), rank(1, -9, killed=True)]
    assert judge(ended, ["python"], "/r")["outcome"] == "failed"
    usage = "usage: t.py [-h]\nt.py: error: unrecognized arguments: --x\n"
    assert cause(usage, 2) == usage.splitlines()[-1] and cause(usage, 1) == ""  # argparse's own line, for exit 2
    assert cause("RuntimeError: Connection reset by peer\n", 1) == ""


@pytest.mark.parametrize(
    "tail, code, want",
    [
        ("python: can't open file '/r/t.py': [Errno 2] No such file or directory\n", 2, "can't open file"),
        # the file system, not the script: another attempt may read it (review)
        ("python: can't open file '/r/t.py': [Errno 116] Stale file handle\n", 2, ""),
        ("python: can't open file '/r/t.py': [Errno 5] Input/output error\n", 2, ""),
        ("t.py: error: argument --data: can't open 'd.txt': [Errno 5] Input/output error\n", 2, ""),
        ("ImportError: libcuda.so.1: cannot open shared object file: No such file or directory\n", 1, ""),
        ("ImportError: /home/u/.triton/cache/x/cuda_utils.so: cannot read file data: Stale file handle\n", 1, ""),
        # a handled ImportError printed earlier, then another death: judged by the last exception only
        ("ModuleNotFoundError: No module named 'wandb'\nstep 3\nRuntimeError: CUDA error: an illegal memory\n", 1, ""),
        ("ImportError: no\nDuring handling of the above exception\nOSError: [Errno 110] Connection timed out\n", 1, ""),
        ("warning: x\nModuleNotFoundError: No module named 'nothere'\n", 1, "ModuleNotFoundError"),
    ],
)
def test_only_the_last_word_of_a_failure_and_never_the_file_system_stops_a_run(tail: str, code: int, want: str) -> None:
    from hpc_train.supervisor import cause

    got = cause(tail, code)
    assert (want in got) if want else got == "", got


def test_a_hardware_error_before_any_progress_blames_the_node_whatever_else_was_printed() -> None:
    """Review: a handled `import wandb` traceback, then an ECC error, stopped the run as unrunnable (wandb's
    import named as the cause) and the sick node was never left out."""
    from hpc_train.supervisor import judge

    tail = (
        "ModuleNotFoundError: No module named 'wandb'\nRuntimeError: CUDA error: uncorrectable ECC error encountered\n"
    )
    out = judge([{"rank": 0, "code": 1, "node": "g7", "tail": tail, "killed": False, "progress": False}], ["p"], "/r")
    assert out["outcome"] == "failed" and list(out["sick"]) == ["g7"], out
    tail = "RuntimeError: CUDA error: uncorrectable ECC error encountered\nModuleNotFoundError: No module named 'x'\n"
    out = judge([{"rank": 0, "code": 1, "node": "g7", "tail": tail, "killed": False, "progress": False}], ["p"], "/r")
    assert out["outcome"] == "failed" and list(out["sick"]) == ["g7"], out


def test_output_without_a_newline_is_forwarded_and_beats_at_once() -> None:
    """A progress bar (tqdm) rewrites its line with '\\r' only: before, the reader waited for a '\\n' that
    never came, so an hour of progress bars was no heartbeat (and reached the log only at the end)."""
    import io
    import os
    import threading
    import time

    from hpc_train import supervisor

    r, w = os.pipe()
    out, output = io.BytesIO(), supervisor.Output(heard_at=0.0)
    reader = threading.Thread(target=supervisor._echo, args=(os.fdopen(r, "rb"), out, output), daemon=True)
    reader.start()
    os.write(w, b" 10%|#   | 1/10\r 20%|##  | 2/10\r")
    until = time.monotonic() + 5
    while output.heard_at == 0.0 and time.monotonic() < until:
        time.sleep(0.01)
    assert output.heard_at > 0.0, "no heartbeat from output without a newline"
    assert out.getvalue() == b" 10%|#   | 1/10\r 20%|##  | 2/10\r"  # forwarded intact, before any newline
    os.write(w, b"x" * 10_000 + b"done\n")
    os.close(w)
    reader.join(5)
    assert out.getvalue().endswith(b"x" * 10_000 + b"done\n") and len(out.getvalue()) == 10_037
    assert bytes(output.tail) == (b"x" * 10_000 + b"done\n")[-supervisor.TAIL_BYTES :]


def test_only_a_complete_checkpoint_counts_for_resume_args(tmp_path: Path) -> None:
    """Before (adversarial review): glob.glob(pattern) + os.path.exists: a run directory named exp[1] never
    found its checkpoint ([1] is a character class), and an empty file, or a folder a glob matched, counted."""
    from hpc_train.script import found_checkpoint

    def found(checkpoint: str, run_dir: Path) -> str:
        return found_checkpoint({"script": {"checkpoint": checkpoint}}, run_dir)

    run = tmp_path / "exp[1]"  # brackets in a real path: the run directory is not a pattern
    (run / "script_checkpoints").mkdir(parents=True)
    assert found("{ckpt_dir}/ckpt_*.pt", run) == found("{ckpt_dir}/", run) == ""  # {ckpt_dir} is made empty
    (run / "script_checkpoints" / "ckpt_10.pt").write_bytes(b"")  # opened for writing, nothing in it yet
    (run / "script_checkpoints" / "ckpt_tmp.pt").mkdir()  # a folder matching a file's glob
    assert found("{ckpt_dir}/ckpt_*.pt", run) == ""
    (run / "script_checkpoints" / "ckpt_10.pt").write_bytes(b"state")
    assert found("{ckpt_dir}/ckpt_*.pt", run) == str(run / "script_checkpoints" / "ckpt_10.pt")
    assert found("script_checkpoints/ckpt_1?.pt", run) == str(run / "script_checkpoints" / "ckpt_10.pt")
    literal = str(run / "script_checkpoints" / "ckpt_10.pt")  # the user's own absolute path with brackets
    assert found(literal, tmp_path) == literal
    os.utime(literal, (1, 1))  # older than the next save
    (run / "script_checkpoints" / "ckpt_20.pt").write_bytes(b"newer")
    assert found("{ckpt_dir}/ckpt_*.pt", run).endswith("ckpt_20.pt")  # the newest
    assert found("{ckpt_dir}/", run) == str(run / "script_checkpoints")  # a folder, named as one, not empty
    assert found("{ckpt_dir}/ckpt_tmp.pt/", run) == ""  # empty
    assert found("script_checkpoints", run) == ""  # a folder never counts for a file's name


def _supervise_two_ranks(
    run_dir: Path, child: str, offsets: tuple[float, float] = (0.0, 0.0), checkpoint: str = ""
) -> list[dict]:
    """supervisor.supervise on two gloo ranks of this machine (tests/scripts/supervise_rank.py), running `python -c
    child` as each rank's child; each rank's {"max_quiet_s", "outcome"}."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    cmd = json.dumps([sys.executable, "-c", child])
    procs = [
        subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "scripts" / "supervise_rank.py"), str(r), port, str(run_dir)]
            + [str(offsets[r]), cmd, checkpoint],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
        )
        for r in range(2)
    ]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


@pytest.mark.parametrize(
    "offset_s, rank0_prints, quiet",
    [
        (-1000.0, True, False),  # rank 0's clock 1000 s behind, printing all along: no rank may go quiet
        (+1000.0, False, True),  # rank 0's clock 1000 s ahead, one line then silence: no rank may see beats
    ],
)
def test_a_skewed_clock_neither_hides_nor_fakes_the_heartbeat(
    tmp_path: Path, offset_s: float, rank0_prints: bool, quiet: bool
) -> None:
    """Two ranks of supervisor.supervise, rank 0 on a "node" whose wall clock is off by 1000 s. Before (review):
    the ranks all-reduced the wall time of their newest output and compared it with their own clock, so a
    clock behind hid rank 0's output from rank 1 (a live job judged hung after train.watchdog_s) and a clock
    ahead beat every rank's watchdog for 1000 s (a hang never caught)."""
    child = (
        "import os,time\n"
        f"talk = os.environ['RANK'] == '0' and {rank0_prints}\n"
        "print('start', flush=True)\n"
        "for i in range(40):\n"
        "    talk and print(i, flush=True)\n"
        "    time.sleep(0.1)\n"
    )
    results = _supervise_two_ranks(tmp_path, child, offsets=(offset_s, 0.0))
    assert all(r["outcome"] == "finished" for r in results), results
    worst = [r["max_quiet_s"] for r in results]
    if quiet:  # 4 s of silence after the first line: the heartbeat goes unrenewed for most of it on every rank
        assert min(worst) > 2.0, worst
    else:  # output every 0.1 s: renewed within a poll or two (0.25 s each), on every rank
        assert max(worst) < 1.5, worst


def test_several_ranks_a_node_get_omp_num_threads_1_unless_it_is_set(monkeypatch: pytest.MonkeyPatch) -> None:
    """As torchrun does (torch/distributed/run.py). Before (review): unset, so 4 ranks of a node each sized
    torch's thread pool to every core."""
    from types import SimpleNamespace

    from hpc_train.paths import RunPaths
    from hpc_train.supervisor import child_env

    def omp(local_world_size: int) -> str | None:
        env = SimpleNamespace(
            rank=1,
            local_rank=1,
            world_size=8,
            local_world_size=local_world_size,
            node_rank=0,
            restart_count=0,
            job_id="7",
        )
        return child_env(env, ("n0", 29500), RunPaths(Path("/r")), "TERM").get("OMP_NUM_THREADS")

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert (omp(4), omp(1)) == ("1", None)  # one process a node: nothing to share, torch's default
    monkeypatch.setenv("OMP_NUM_THREADS", "12")  # the user's (cluster.env.OMP_NUM_THREADS=12)
    assert omp(4) == "12"


def test_the_scripts_grace_keeps_the_requeue_reserve() -> None:
    from hpc_train.supervisor import grace_s

    assert grace_s(90.0, "time_limit", 35.0) == 55.0  # cluster=dev: 90 s lead, 35 s for scontrol
    assert grace_s(90.0, "time_limit", 50.0) == 40.0  # elastic: the queue snapshot too
    assert grace_s(20.0, "time_limit", 35.0) == 0.0  # nothing left: the reserve wins (submit warned)
    assert grace_s(30.0, "preempt", 35.0) == 22.5  # Slurm requeues a preemption: a quarter, at most 10 s
    assert grace_s(300.0, "preempt", 35.0) == 290.0


def test_a_signal_lead_within_the_requeue_reserve_is_a_warning_at_submit(tmp_path: Path) -> None:
    """Before (review): nothing said that cluster.signal_lead_s=40 on Slurm leaves 5 s for a stop save."""
    from hpc_train.deadlines import reserve_warning
    from hpc_train.sbatch import ClusterConfig

    dev = ClusterConfig(executor="slurm", nodes=2, signal_lead_s=40)
    assert names(
        reserve_warning(dev),
        "cluster.signal_lead_s=40",
        "leaves 5 s",
        "keeps 35 s",
        "deadlines.decision_reserve_s",
        "SIGKILL",
        "use cluster.signal_lead_s>=45",
    )
    assert "keeps 50 s" in reserve_warning(ClusterConfig(executor="slurm", nodes=2, min_nodes=1, signal_lead_s=55))
    assert reserve_warning(ClusterConfig(executor="slurm", nodes=2, signal_lead_s=45)) == ""
    assert reserve_warning(ClusterConfig(executor="local", signal_lead_s=14)) == ""  # the local decision: 4 s
    proc = _submit(tmp_path, "cluster.signal_lead_s=10", "--", "python", "t.py", flags=("--dry-run",))
    assert proc.returncode == 0, proc.stderr
    (warning,) = [line for line in proc.stderr.splitlines() if "cluster.signal_lead_s=10" in line]
    assert warning.startswith("hpc-train submit: warning: ") and names(warning, "leaves 6 s", "cluster.signal_lead_s>=")


def test_a_newer_checkpoint_file_is_progress_for_the_failure_budget(tmp_path: Path) -> None:
    """A script that saves without script_helper.committed() and then crashes made progress: before (issue 19,
    "progress known from the checkpoint file's time"), nothing recorded it, so occasional crashes of a script
    that trained for hours between them stopped the run at requeue.max_failures as a crash loop would."""
    ckpt = tmp_path / "script_checkpoints" / "ckpt.pt"
    ckpt.parent.mkdir()
    ckpt.write_bytes(b"step 10")
    os.utime(ckpt, (1000.0, 1000.0))  # the last attempt's save
    # Rank 1's child fails only once rank 0's saved: a failure ends every rank's child, and on a loaded CI
    # machine rank 1's failed first, so rank 0's child was ended before its save (no event, test failed).
    child = (
        f"import os, time\nif os.environ['RANK'] == '0': open({str(ckpt)!r}, 'wb').write(b'step 20')\n"
        f"while os.path.getmtime({str(ckpt)!r}) == 1000.0: time.sleep(0.05)\nraise SystemExit(1)\n"
    )
    results = _supervise_two_ranks(tmp_path, child, checkpoint="script_checkpoints/ckpt.pt")
    assert [r["outcome"] for r in results] == ["failed", "failed"]
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").open()]
    (progress,) = [e for e in events if e["event"] == "script_checkpoint"]
    assert progress["path"] == str(ckpt) and progress["mtime"] == ckpt.stat().st_mtime > 1000.0


NANOGPT = ROOT / "tests" / "scripts" / "nanogpt"  # karpathy/nanoGPT's own files, unmodified (its README.md)


def test_the_nanogpt_files_are_upstreams_own() -> None:
    """Byte for byte the blobs its README.md names (git's blob id: sha1 of "blob SIZE\\0" + the bytes)."""
    import hashlib

    named = re.findall(r"^    (\S+) +([0-9a-f]{40})$", (NANOGPT / "README.md").read_text(), re.M)
    assert [name for name, _ in named] == ["train.py", "model.py", "configurator.py", "LICENSE"]
    for name, blob in named:
        data = (NANOGPT / name).read_bytes()
        assert hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest() == blob, f"{name} differs from upstream"


def test_nanogpt_resumes_across_two_preemptions(tmp_path: Path) -> None:
    """Issue 19: an unmodified public script resumes across preemptions as docs/scripts.md describes. nanoGPT
    has no signal handler: each SIGTERM (as a preemption sends) kills it, the run requeues, the next attempt
    gets --init_from=resume (ckpt.pt exists) and goes on from the checkpoint's iter_num, not from 0; the last
    attempt ends at max_iters, exit 0, finished. One process: nanoGPT enters DDP whenever RANK is set and then
    takes cuda:LOCAL_RANK, so on a CPU the command unsets RANK. Not bit-exact (nanoGPT reseeds and draws new
    batches at a resume), so the losses are only checked to be there."""
    import numpy as np
    import torch

    from hpc_train.logs import attempt_section

    work = tmp_path / "nanoGPT"  # a checkout: nanoGPT reads configurator.py and data/<dataset>/ from its cwd
    shutil.copytree(NANOGPT, work)
    (work / "data" / "tiny").mkdir(parents=True)
    rng = np.random.default_rng(0)
    for split, tokens in (("train", 20_000), ("val", 2_000)):
        rng.integers(0, 64, tokens, dtype=np.uint16).tofile(work / "data" / "tiny" / f"{split}.bin")
    (work / "data" / "tiny" / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": 64}))
    # An iteration takes 3 ms on this idle machine and 100 ms at a load of 20; a stop lands <= 0.35 s after a
    # save (our poll 0.05 s, the ranks' 0.25 s), <= ~120 iterations here: each attempt resumes <= 150 further on
    max_iters, every = 600, 50
    nanogpt = ["env", "-u", "RANK", "-u", "LOCAL_RANK", "-u", "WORLD_SIZE", sys.executable, "train.py"]
    nanogpt += ["--device=cpu", "--compile=False", "--dtype=float32", "--backend=gloo", "--dataset=tiny"]
    nanogpt += ["--n_layer=2", "--n_head=2", "--n_embd=32", "--block_size=32", "--batch_size=4"]
    nanogpt += ["--gradient_accumulation_steps=1", "--warmup_iters=0", f"--lr_decay_iters={max_iters}"]
    nanogpt += [f"--eval_interval={every}", "--eval_iters=2", "--always_save_checkpoint=True"]
    nanogpt += [f"--max_iters={max_iters}", "--out_dir={ckpt_dir}"]
    docs = ["script.checkpoint=script_checkpoints/ckpt.pt", "script.resume_args=['--init_from=resume']"]
    args = [f"out_dir={tmp_path}", "name=nanogpt", "cluster.tasks_per_node=1", *docs, "--no-wait", "--", *nanogpt]
    # One intra-op thread: with torch's default two on these two shared cores, 200 iterations took 98 s at a
    # load of 20 (threads spinning on each other), with one 27 s. Submitted from the checkout, as a user would.
    run_dir, job_id = submit(args, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=work)
    ckpt = run_dir / "script_checkpoints" / "ckpt.pt"

    def evals(attempt: int) -> list[int]:  # "step N: train loss ..." of this attempt: a save follows each N > 0
        text = "".join(p.read_text(errors="replace") for p in (run_dir / "submitit").glob("*_0_log.out"))
        return [int(n) for n in re.findall(r"^step (\d+): train loss", attempt_section(text, attempt), re.M)]

    def saved() -> int:
        try:
            return int(torch.load(ckpt, weights_only=True)["iter_num"])
        except Exception:  # not there yet, or half written: nanoGPT prints "saving" and then writes in place
            return -1

    seen = []
    for attempt in (0, 1):  # a stop after this attempt's first save of its own (a resume saves its iteration again)
        wait_until(
            lambda a=attempt: len(e := evals(a)) > 1 and saved() >= e[1], 120, f"a save of attempt {attempt}", 0.05
        )
        seen.append(saved())
        os.kill(int(job_id), signal.SIGTERM)  # submitit's local controller forwards it to every rank
    wait_until(lambda: (run_dir / "summary.json").exists(), 180, "the resumed run's end")

    events = read_events(run_dir)
    assert [e["reason"] for e in events if e["event"] == "requeue"] == ["preempt", "preempt"]
    starts = [e for e in events if e["event"] == "start"]
    filled = [*nanogpt[:-1], f"--out_dir={ckpt.parent}"]
    assert [s["cmd"] for s in starts] == [filled, [*filled, "--init_from=resume"], [*filled, "--init_from=resume"]]
    assert [s["resumed_from"] for s in starts] == [None, str(ckpt), str(ckpt)]
    assert events[-1]["event"] == "finish" and json.loads((run_dir / "summary.json").read_text())["exit_codes"] == [0]
    assert torch.load(ckpt, weights_only=True)["iter_num"] == max_iters  # saved at its last eval

    proc = subprocess.run([*HPC_TRAIN, "logs", str(run_dir)], capture_output=True, text=True, timeout=60)
    iters = [
        [int(n) for n in re.findall(r"^iter (\d+): loss \d+\.\d+", attempt_section(proc.stdout, a), re.M)]
        for a in range(3)
    ]
    assert iters[0][0] == 0 and iters[2][-1] == max_iters, proc.stdout
    # each attempt goes on from the checkpoint the stop left: at or after the one seen before the SIGTERM
    # (nanoGPT may save once more before the signal reaches it), on an eval_interval, and moving forward
    assert seen[0] <= iters[1][0] < seen[1] <= iters[2][0] < max_iters, (seen, [it[0] for it in iters])
    assert all(it[0] % every == 0 and it == list(range(it[0], it[-1] + 1)) for it in iters[1:]), iters
    assert "Resuming training from" in attempt_section(proc.stdout, 2), proc.stdout


def test_a_scripts_slurm_rank_variables_are_our_placement(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 29: in a Slurm task the child's SLURM_PROCID, SLURM_LOCALID, SLURM_NODEID and the counts are the placed
    RANK, LOCAL_RANK, GROUP_RANK and world (here placed rank 2 runs in Slurm's task 0, on Slurm's first node), so
    Lightning's SLURMEnvironment gets our placement; without Slurm nothing is added."""
    from types import SimpleNamespace

    from hpc_train.paths import RunPaths
    from hpc_train.supervisor import child_env

    env = SimpleNamespace(
        rank=2, local_rank=0, world_size=8, local_world_size=2, node_rank=1, restart_count=0, job_id="7"
    )
    for key, value in {"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_NTASKS": "10"}.items():
        monkeypatch.setenv(key, value)  # Slurm's numbering: task 0 of a 5-node step (a spare's standbys in it)
    child = child_env(env, ("n1", 29500), RunPaths(Path("/r")), "TERM")
    pairs = [("SLURM_PROCID", "RANK"), ("SLURM_LOCALID", "LOCAL_RANK"), ("SLURM_NODEID", "GROUP_RANK")]
    pairs += [("SLURM_NTASKS", "WORLD_SIZE"), ("SLURM_NTASKS_PER_NODE", "LOCAL_WORLD_SIZE")]
    assert all(child[slurm] == child[ours] for slurm, ours in pairs), {k: child[k] for p in pairs for k in p}
    assert (child["RANK"], child["SLURM_NNODES"]) == ("2", "4")
    for key in ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_NTASKS"):
        monkeypatch.delenv(key)
    assert not [k for k in child_env(env, ("n1", 29500), RunPaths(Path("/r")), "TERM") if k.startswith("SLURM_")]


def test_a_stop_signal_slurm_delivered_to_the_child_is_not_sent_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 29: Slurm signals every process of the step under proctrack/cgroup or linuxproc, the child too: a TERM
    this rank got after the child started is not sent again (Lightning logged 'Received SIGTERM' twice). Sent as
    before on the local executor, for a signal that came before the child (relayed into the step), for another
    signal than the child's, and where slurm.conf says proctrack/pgid or nothing."""
    from hpc_train import slurm
    from hpc_train.supervisor import already_delivered
    from hpc_train.task import Pulse

    pulse = Pulse(["SIGTERM"], [100.0])  # a TERM this rank received at 100.0 (time.monotonic())
    conf = tmp_path / "slurm.conf"
    monkeypatch.setenv("SLURM_CONF", str(conf))
    # cgroup signals the step's tasks only (the rank), the child with SIGKILL alone (review, proctrack_cgroup.c)
    for proctrack, delivered in (("proctrack/cgroup", False), ("proctrack/linuxproc", True), ("proctrack/pgid", False)):
        conf.write_text(f"ClusterName=x\n  ProctrackType = {proctrack}  # comment\n")
        assert slurm.proctrack_type({"SLURM_CONF": str(conf)}) == proctrack
        assert already_delivered("slurm", "TERM", 99.0, pulse) is delivered, proctrack
    conf.write_text("ProctrackType=proctrack/linuxproc\n")
    assert not already_delivered("local", "TERM", 99.0, pulse)
    assert not already_delivered("slurm", "TERM", 101.0, pulse)  # came before the child: relayed, not delivered to it
    assert not already_delivered("slurm", "USR1", 99.0, pulse)
    conf.write_text("ClusterName=x\n")
    assert slurm.proctrack_type({"SLURM_CONF": str(conf)}) == "" and not already_delivered("slurm", "TERM", 99.0, pulse)
    conf.write_bytes(b"# modifi\xe9 par l'admin\nProctrackType=proctrack/linuxproc\n")  # Latin-1: read all the same
    assert slurm.proctrack_type({"SLURM_CONF": str(conf)}) == "proctrack/linuxproc"


def test_the_stop_reaches_the_child_though_the_journal_cannot_be_written(tmp_path: Path) -> None:
    """The supervisor records the stop before it signals the child (a child that returns at the signal finds it on
    record); a journal write that fails there (a full disk, EIO) must still let the signal through."""
    import signal
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    ready, stopped = tmp_path / "ready", tmp_path / "stopped"
    child = (
        "import signal, sys, time, pathlib\n"
        f"signal.signal(signal.SIGTERM, lambda *a: (pathlib.Path({str(stopped)!r}).touch(), sys.exit(0)))\n"
        f"pathlib.Path({str(ready)!r}).touch()\n"
        "time.sleep(120)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "scripts" / "supervise_journal_fails.py"), port, str(tmp_path)]
        + [json.dumps([sys.executable, "-c", child])],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
    )
    try:
        wait_until(ready.exists, 60, "the child to start")
        proc.send_signal(signal.SIGUSR2)  # a stop, as the relay passes Slurm's on
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill() if proc.poll() is None else None
    assert json.loads(out.strip().splitlines()[-1])["raised"] == "[Errno 5] Input/output error", err[-3000:]
    assert stopped.exists(), err[-3000:]  # the child got its TERM
