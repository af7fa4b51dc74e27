"""status and cancel of local runs: the job id is a PID, trusted only while it is still the controller
submit recorded (start time and boot id), and a cancel stops the run at a checkpoint."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path

import pytest
from conftest import HPC_TRAIN, names, read_events, run, submit, wait_until

from hpc_train.report import report_marks

CONFIG = "cluster: {executor: local, signal_lead_s: 120}\nrequeue: {max_failures: 3}\ntrain: {steps: 40}\n"


def identity(pid: int) -> dict:
    """Field 22 of /proc/<pid>/stat (start time, clock ticks after boot), this boot's id, this host."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return {
        "start_time": int(stat.rsplit(")", 1)[1].split()[19]),
        "boot_id": Path("/proc/sys/kernel/random/boot_id").read_text().strip(),
        "host": socket.gethostname(),
    }


def alive(pid: int, recorded: dict) -> bool:
    """Still that process: same start time and boot, and not a zombie (its parent, submit, has exited)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z" and identity(pid) == recorded
    except FileNotFoundError:
        return False


def local_run(run_dir: Path, pid: int, process: dict, events: list[dict] = ()) -> Path:
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(CONFIG)
    (run_dir / "submission.json").write_text(json.dumps({"executor": "local", "job_id": str(pid), "process": process}))
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return run_dir


def state(run_dir: Path) -> str:
    proc = run([HPC_TRAIN, "status", str(run_dir), "--json"])
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)[0]["state"]


def test_a_reused_pid_is_neither_running_nor_signalled(tmp_path: Path) -> None:
    sleep = subprocess.Popen(["sleep", "60"])
    try:
        real = identity(sleep.pid)
        started = [{"time": 1.0, "event": "start", "step": 0, "job_id": str(sleep.pid), "restart": 2}]
        stranger = local_run(tmp_path / "stranger", sleep.pid, {**real, "start_time": real["start_time"] + 1}, started)
        assert state(stranger) == "UNKNOWN"
        assert run([HPC_TRAIN, "cancel", str(stranger)]).stdout == "cancelled 0 job(s): \n"
        assert sleep.poll() is None and not [e for e in read_events(stranger) if e["event"] == "cancel"]
        ours = local_run(tmp_path / "ours", sleep.pid, real, started)
        assert state(ours) == "RUNNING"
        assert run([HPC_TRAIN, "cancel", str(ours)]).stdout == f"cancelled 1 job(s): {sleep.pid}\n"
        assert sleep.wait(timeout=10) == -15  # SIGTERM, which submitit's controller forwards to every task
        cancel = [e for e in read_events(ours) if e["event"] == "cancel"]
        assert [(e["restart"], e["by"]) for e in cancel] == [(2, "hpc-train cancel")]  # the current attempt
    finally:
        sleep.kill()
        sleep.wait()
    with (ours / "events.jsonl").open("a") as f:
        f.write(
            json.dumps(
                {
                    "time": 2.0,
                    "event": "stopped",
                    "step": 5,
                    "job_id": str(sleep.pid),
                    "restart": 2,
                    "reason": "cancelled (hpc-train cancel): saved, not requeueing",
                }
            )
            + "\n"
        )
    assert state(ours) == "CANCELLED"


def test_cancel_of_a_local_run_saves_and_stops_without_requeue(tmp_path: Path) -> None:
    """End to end: the cancel event first, then SIGTERM to the controller; the ranks save at the next step
    boundary, see the cancel, and stop (exit 1, so the controller does not restart them)."""
    run_dir, job_id = submit(
        [f"out_dir={tmp_path}", "train.steps=40", "checkpoint.every_steps=10", "train.min_step_time_s=0.2", "--no-wait"]
    )
    sub = json.loads((run_dir / "submission.json").read_text())
    assert sub["process"] == identity(int(job_id))
    wait_until(lambda: any(e["event"] == "checkpoint_committed" for e in read_events(run_dir)), 120, "a checkpoint")
    assert state(run_dir) == "RUNNING"
    proc = run([HPC_TRAIN, "cancel", str(run_dir)])
    assert proc.returncode == 0 and proc.stdout == f"cancelled 1 job(s): {job_id}\n", proc.stdout + proc.stderr
    wait_until(lambda: not alive(int(job_id), sub["process"]), 120, "the controller to exit")
    events = read_events(run_dir)
    names = [e["event"] for e in events]
    cancel = names.index("cancel")
    # One stop save, the last commit; a periodic write in flight at the cancel may commit before it (CI).
    after = [e["reason"] for e in events[cancel:] if e["event"] == "checkpoint_committed"]
    assert after[-1:] == ["stop"] and after.count("stop") == 1 and set(after) <= {"periodic", "stop"}, after
    stopped = [e for e in events if e["event"] == "stopped"]
    assert len(stopped) == 1 and stopped[0]["reason"].startswith("cancelled"), stopped
    assert names.count("start") == 1 and "requeue" not in names, names
    assert state(run_dir) == "CANCELLED"


SACCT_ERROR = (
    "sacct: error: slurm_persist_conn_open: Something happened with the receiving/processing of the "
    "persistent connection init message to localhost:6819: Unspecified error\n"
    "sacct: error: Problem talking to the database: Unspecified error"
)


def slurm_run(tmp_path: Path, job_id: str, state: str = "RUNNING") -> tuple[Path, dict[str, str]]:
    """A Slurm run directory, and an env whose `sacct` fails while the file `fail` exists (removed at the
    first failure when `fail` says "once"), else gives the job this state. A fake: no cluster here, and a
    real sacct cannot be made to fail on demand (with no controller it spends 30 s per try)."""
    run_dir = tmp_path / "r1"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(CONFIG.replace("executor: local", "executor: slurm"))
    (run_dir / "submission.json").write_text(json.dumps({"executor": "slurm", "job_id": job_id}))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fail = tmp_path / "fail"
    (bin_dir / "sacct").write_text(
        f"#!/bin/sh\nif [ -e {fail} ]; then\n  grep -q once {fail} && rm {fail}\n"
        f"  printf '%s\\n' '{SACCT_ERROR.splitlines()[0]}' '{SACCT_ERROR.splitlines()[1]}' >&2\n  exit 1\nfi\n"
        f"echo '{job_id}|{state}'\n"
    )
    (bin_dir / "sacct").chmod(0o755)
    return run_dir, {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}


def test_status_asks_sacct_again_when_it_fails_once(tmp_path: Path) -> None:
    run_dir, env = slurm_run(tmp_path, "4242")
    (tmp_path / "fail").write_text("once")
    proc = run([HPC_TRAIN, "status", str(run_dir), "--json"], env=env)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)[0]["state"] == "RUNNING" and not (tmp_path / "fail").exists()


def test_status_says_unknown_and_the_whole_sacct_error_below_the_table(tmp_path: Path) -> None:
    run_dir, env = slurm_run(tmp_path, "4242")
    (tmp_path / "fail").write_text("always")
    row = json.loads(run([HPC_TRAIN, "status", str(run_dir), "--json"], env=env).stdout)[0]
    error = f"`sacct -X -n -P -j 4242 -o JobID,State` failed: {SACCT_ERROR}"
    assert (row["state"], row["state_error"]) == ("unknown", error)
    proc = run([HPC_TRAIN, "status", str(run_dir)], env=env)
    assert proc.returncode == 0, proc.stderr
    assert table_rows(proc.stdout, "run")[0]["state"] == "unknown"
    assert proc.stdout.endswith(f"┘\nstate unknown: {error}\n")


def test_report_marks_integer_attempts_boundaries_and_a_rate_axis_from_zero() -> None:
    atts = [
        {"restart": 0, "launched": 100.0, "start_step": 0},
        {"restart": 1, "launched": 130.5, "start_step": 20},
        {"restart": 2, "launched": 171.0, "start_step": 40},
    ]
    metrics = [{"step": s, "time": 100.0 + s, "tokens_per_s": 4000.0 + 0.3 * (s % 20 == 10)} for s in range(0, 60, 10)]
    marks = report_marks(atts, metrics)
    assert marks["attempt_ticks"] == [0, 1, 2]  # one tick per attempt, no 0.5
    assert marks["boundaries_s"] == [30.5, 71.0] and marks["boundary_steps"] == [20, 40]
    assert marks["tokens_per_s_ylim"] == (0.0, 4000.3 * 1.1)  # 0.3 tok/s of noise stays flat
    assert report_marks([], [])["tokens_per_s_ylim"] == (0.0, 1.0)


def test_logs_follow_of_a_slurm_job_in_a_final_state_prints_both_streams_and_returns(tmp_path: Path) -> None:
    run_dir, env = slurm_run(tmp_path, "4242", state="COMPLETED")
    (run_dir / "submitit").mkdir()
    head = "==== hpc_train attempt 0 rank 0 ====\n"  # what the job writes at an attempt's start
    out_text, err_text = f"{head}step 10/10\n", f"{head}UserWarning: something\n"
    (run_dir / "submitit" / "4242_0_log.out").write_text(out_text)
    err = run_dir / "submitit" / "4242_0_log.err"
    err.write_text(err_text)
    proc = run([HPC_TRAIN, "logs", str(run_dir), "-f"], env=env, timeout_s=20)
    assert proc.returncode == 0, proc.stderr
    # stdout's log, then a line naming the stderr file, then that file
    assert proc.stdout == f"{out_text}---- rank 0 stderr: {err} ----\n{err_text}"


def test_an_attempt_killed_mid_line_ends_before_the_next_attempts_header() -> None:
    """A script without a handler dies at the stop signal, maybe between a line's text and its newline
    (unbuffered, print writes them apart): the next attempt's header then began mid-line. Before (seen in
    test_script.py's nanoGPT run: `iter 55: ... mfu 0.00%==== hpc_train attempt 1 rank 0 ====`), `logs
    --attempt 1` printed nothing and attempt 0 held both attempts."""
    from hpc_train.logs import attempt_section

    head = [f"==== hpc_train attempt {a} rank 0 ====\n" for a in (0, 1)]  # what the job writes at an attempt's start
    text = f"{head[0]}iter 55: loss 4.1575{head[1]}iter 50\n"
    assert attempt_section(text, 0) == f"{head[0]}iter 55: loss 4.1575\n"
    assert attempt_section(text, 1) == f"{head[1]}iter 50\n"
    assert attempt_section(text, None) == attempt_section(text, 0) + attempt_section(text, 1)


@pytest.mark.parametrize("job_id", ["", "4242"])
def test_logs_follow_gives_up_once_neither_squeue_nor_sacct_knows_the_job(
    tmp_path: Path, job_id: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: `logs -f` waited forever for a job id never recorded, or one gone from accounting. The fake
    clients answer as Slurm does for such a job: sacct prints nothing, squeue says "Invalid job id"."""

    from hpc_train import logs, runs

    run_dir, env = slurm_run(tmp_path, job_id)
    bin_dir = tmp_path / "bin"
    (bin_dir / "sacct").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "squeue").write_text("#!/bin/sh\necho 'slurm_load_jobs error: Invalid job id specified' >&2\nexit 1\n")
    (bin_dir / "squeue").chmod(0o755)
    monkeypatch.setenv("PATH", env["PATH"])
    monkeypatch.setattr(logs, "UNKNOWN_GIVE_UP_S", 1.0)  # 60 s in use; the waiting is the same
    log = tmp_path / "0_log.out"
    log.write_text("step 1\n")
    [run_] = runs.find_runs(run_dir)
    unknown_since: list[float] = []
    checks: list[bool] = []

    def ended() -> bool:
        checks.append(logs.run_ended(run_, unknown_since))
        return checks[-1]

    logs.follow([(log, 0, "out")], "out", ended, check_every_s=0.2, every_s=0.05)
    # It gave up at the first check UNKNOWN_GIVE_UP_S after the first one: checks come >= 0.2 s apart, so that is
    # the 6th at the latest, however slow the machine (counted, not timed).
    assert checks[-1] and len(checks) <= logs.UNKNOWN_GIVE_UP_S / 0.2 + 2, checks
    out, err = capsys.readouterr()
    assert out == "step 1\n"
    (said,) = err.splitlines()
    assert said.startswith("hpc-train logs: stopped following")
    assert names(said, "squeue", "sacct", f"job {job_id or '(none recorded)'} ", "1 s", f"`hpc-train status {run_dir}`")


def test_report_and_status_show_each_attempts_size(tmp_path: Path) -> None:
    """An elastic run (cluster.min_nodes) as its events tell it: 4 ranks on 2 nodes, 2 on 1 (two micro-batches
    keep the global batch), 4 again. The report's attempts table names ranks and nodes, the batch (it
    changed), and what each requeue chose; status shows the current world size."""

    def attempt(restart: int, t: float, step: int, world: int, nodes: list[str], accum: int) -> list[dict]:
        base = {"job_id": "4242", "restart": restart}
        return [
            {
                **base,
                "time": t,
                "event": "start",
                "step": step,
                "launched_at": t - 5,
                "world_size": world,
                "nodes": nodes,
                "grad_accum_steps": accum,
                "global_batch_seqs": 32,
            },
            {**base, "time": t + 1, "event": "first_step", "step": step + 1},
        ]

    requeue = {"job_id": "4242", "event": "requeue", "reason": "preempt", "by": "hpc_train"}
    events = [
        *attempt(0, 100.0, 0, 4, ["node1", "node3"], 1),
        {**requeue, "restart": 0, "time": 110.0, "step": 20, "nodes_next": "1-2", "full_size_wait_s": 594.7},
        *attempt(1, 130.0, 20, 2, ["node1"], 2),
        {**requeue, "restart": 1, "time": 140.0, "step": 40, "nodes_next": "2-2", "full_size_wait_s": 0.0},
        *attempt(2, 160.0, 40, 4, ["node1", "node3"], 1),
    ]
    run_dir = local_run(tmp_path / "el", 999999, {"start_time": 0, "boot_id": "gone", "host": "gone"}, events)
    proc = run([HPC_TRAIN, "report", str(run_dir), "--png", str(tmp_path / "r.png"), "--wide"])
    assert proc.returncode == 0, proc.stderr
    got = table_rows(proc.stdout, "attempt")
    assert [(r["ranks"], r["batch"], r["ended by"]) for r in got] == [
        ("4 on node1,node3", "32 seqs x1", "requeue (next: 1-2 nodes)"),
        ("2 on node1", "32 seqs x2", "requeue (next: 2-2 nodes)"),
        ("4 on node1,node3", "32 seqs x1", "running"),
    ], proc.stdout
    assert json.loads(run([HPC_TRAIN, "status", str(run_dir), "--json"]).stdout)[0]["world_size"] == 4
    assert table_rows(run([HPC_TRAIN, "status", str(run_dir), "--wide"]).stdout, "run")[0]["ranks"] == "4"


def table_rows(text: str, first_column: str) -> list[dict[str, str]]:
    """The rows of the rich table whose first column is `first_column`, as {column: cell}."""
    rows = [
        [c.strip() for c in line.strip("│┃").replace("┃", "│").split("│")]
        for line in text.splitlines()
        if line.startswith(("│", "┃"))
    ]
    at = next(i for i, r in enumerate(rows) if r[0] == first_column)
    width = len(rows[at])
    out = []
    for r in rows[at + 1 :]:
        if len(r) != width:
            break
        out.append(dict(zip(rows[at], r)))
    return out


def test_the_attempt_header_is_written_once_per_file(tmp_path: Path) -> None:
    """Issue 29: a Slurm rank's stdout and stderr are one file (stderr_to_stdout), where the header written to
    both came out twice; separate files (the local executor's) each get it, for `logs --attempt`."""
    import subprocess
    import sys

    code = "from hpc_train.ranklog import header; header(3, 1)"
    line = "==== hpc_train attempt 3 rank 1 ====\n"
    with open(tmp_path / "one", "w") as one:
        subprocess.run([sys.executable, "-c", code], stdout=one, stderr=one, check=True)
    with open(tmp_path / "out", "w") as out, open(tmp_path / "err", "w") as err:
        subprocess.run([sys.executable, "-c", code], stdout=out, stderr=err, check=True)
    assert (tmp_path / "one").read_text() == line
    assert (tmp_path / "out").read_text() == (tmp_path / "err").read_text() == line


def test_chaos_preempt_on_a_local_run_says_the_local_way(tmp_path: Path) -> None:
    """Issue 29 D3: refused on the local executor, `chaos preempt` pointed to cluster=dev only, which a new user does
    not have; it says the local way too (a TERM to the controller, the job id). Nothing is recorded."""
    from hpc_train import drills
    from hpc_train.runs import Run

    run = Run(tmp_path, "demo-1", "5122", "local", tmp_path / "submitit")
    with pytest.raises(ValueError, match=r"needs Slurm \(cluster=dev\); a preemption here: kill -TERM 5122 "):
        drills.chaos(run, "preempt")
    with pytest.raises(ValueError) as other:
        drills.chaos(run, "kill-rank")
    assert "kill -TERM" not in str(other.value) and not (tmp_path / "events.jsonl").exists()
