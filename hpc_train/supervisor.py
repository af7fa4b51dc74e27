"""The job side of `hpc-train submit ... -- CMD` (script.py holds its config and the login side): on every rank once
placed, the user's command as this rank's child with torchrun's variables; at a stop every child gets
script.stop_signal at once and SIGKILL before Slurm's; the attempt's start, signal and finish go through the one
attempt protocol (protocol.py), and job.py takes the one requeue decision with what supervise returns.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hpc_train import deadlines, journal, pipeline, preempt, protocol, slurm
from hpc_train.paths import RunPaths, make_dir
from hpc_train.reasons import Reason
from hpc_train.script import checkpoint_path, ckpt_dir, command, end_child, found_checkpoint
from hpc_train.task import Pulse, Task

log = logging.getLogger(__name__)

# The child ignores the stop signals Slurm sends that are not script.stop_signal (USR2 is Slurm's time-limit
# warning, TERM a preemption; proctrack delivers both to every process of the task, ours included): an
# unhandled USR2 would kill a script at the warning, before our ranks agree. It dies with us (PDEATHSIG).
CANNOT_RUN = "[hpc_train] cannot run"  # the shim's line when its exec failed: a program's own 127 is no such thing
_SHIM = (
    "import ctypes,os,signal,sys\n"
    "for s in sys.argv[1].split(','):\n"
    "    s and signal.signal(getattr(signal,'SIG'+s),signal.SIG_IGN)\n"
    "signal.signal(getattr(signal,'SIG'+sys.argv[2]),signal.SIG_DFL)\n"
    "try: ctypes.CDLL(None).prctl(1,9)\n"
    "except Exception: pass\n"
    "try: os.execvp(sys.argv[3],sys.argv[3:])\n"
    "except OSError as e:\n"
    "    print(f'" + CANNOT_RUN + " {sys.argv[3]!r}: {e.strerror}; check the command after --"
    " (installed on every node? on the PATH? executable?)',file=sys.stderr)\n"
    "    sys.exit(127 if e.errno==2 else 126)\n"  # a shell's codes: not found (ENOENT), found but not runnable
)
POLL_S = 0.25  # our ranks agree 4 times a second: the stop signal reaches every child within ~0.25 s
# After a preemption's signal, the child's SIGKILL comes this much before Slurm's, for the records (Slurm
# requeues a preempted job itself): at most a quarter of what is left. A time limit keeps job.py's reserve.
DECIDE_RESERVE_S = 10.0

TAIL_BYTES = 4000  # the child's last output, stdout and stderr together, for the fail event and the hardware check


@dataclass
class Output:
    """What the child's two echo threads write: its last output and when it came."""

    tail: bytearray = field(default_factory=bytearray)  # stdout and stderr together, the last TAIL_BYTES
    heard_at: float = field(default_factory=time.monotonic)  # this node's clock only: ranks compare ages, never times


def _echo(stream: Any, out: Any, output: Output) -> None:
    """Copy the child's output to our own stream (the rank's log) as it comes, and take any bytes as a
    heartbeat: a progress bar (tqdm) rewrites its line with '\r' and may print no '\n' for an hour."""
    fd = stream.fileno()
    while chunk := os.read(fd, 65536):  # what the pipe holds now, up to 64 KiB; b"": the child closed it
        out.write(chunk)
        out.flush()
        output.tail += chunk
        del output.tail[:-TAIL_BYTES]
        output.heard_at = time.monotonic()


def _mtime(path: Path) -> float:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return 0.0


def child_env(env: Any, placed_master: tuple[str, int], paths: RunPaths, stop_signal: str) -> dict[str, str]:
    """torchrun's variables for this placed rank, with the script's own rendezvous, and ours (pure but
    for os.environ)."""
    addr, port = placed_master
    return {
        **os.environ,
        "RANK": str(env.rank),
        "LOCAL_RANK": str(env.local_rank),
        "WORLD_SIZE": str(env.world_size),
        "LOCAL_WORLD_SIZE": str(env.local_world_size),
        "GROUP_RANK": str(env.node_rank),
        "MASTER_ADDR": addr,
        "MASTER_PORT": str(port),
        "TORCHELASTIC_RESTART_COUNT": str(env.restart_count),
        "HPC_TRAIN_RESTART_COUNT": str(env.restart_count),
        "HPC_TRAIN_RUN_DIR": str(paths.run_dir),
        "HPC_TRAIN_CKPT_DIR": str(ckpt_dir(paths.run_dir)),
        "HPC_TRAIN_JOB_ID": env.job_id,
        "HPC_TRAIN_STOP_SIGNAL": stop_signal,
        "PYTHONUNBUFFERED": os.environ.get("PYTHONUNBUFFERED", "1"),  # a pipe is block-buffered: lines late
        **({"OMP_NUM_THREADS": "1"} if one_thread(env.local_world_size) else {}),
        **slurm_rank_vars(env),
    }


def slurm_rank_vars(env: Any) -> dict[str, str]:
    """Slurm's rank variables told our placement, in a Slurm task only: a framework that reads them and not RANK
    (Lightning's SLURMEnvironment: SLURM_PROCID, SLURM_LOCALID, SLURM_NODEID, SLURM_NTASKS) would otherwise take
    Slurm's task numbering, and its rank 1 would run where placement.json, `logs --rank 1` and `chaos kill-rank
    --rank 1` put rank 2 (seen on 4 dev nodes). SLURM_NTASKS_PER_NODE: Lightning refuses SLURM_NTASKS > 1
    without it. The step's own (a spares job's standbys included) would not be the script's world either."""
    if "SLURM_PROCID" not in os.environ:
        return {}
    world, nodes = str(env.world_size), str(env.world_size // env.local_world_size)
    return {
        "SLURM_PROCID": str(env.rank),
        "SLURM_LOCALID": str(env.local_rank),
        "SLURM_NODEID": str(env.node_rank),
        "SLURM_NTASKS": world,
        "SLURM_NPROCS": world,
        "SLURM_NNODES": nodes,
        "SLURM_JOB_NUM_NODES": nodes,
        "SLURM_NTASKS_PER_NODE": str(env.local_world_size),
        "SLURM_STEP_NUM_TASKS": world,
        "SLURM_STEP_NUM_NODES": nodes,
    }


def one_thread(local_world_size: int) -> bool:
    """torchrun's default (torch/distributed/run.py): OMP_NUM_THREADS=1 in each of several processes of a
    node unless it is set. Without it each of 4 ranks sizes its intra-op pool to every core of the node: 4x
    oversubscribed (job.py measured 35x slower steps for its own ranks, 4 on 2 cores). Set
    +cluster.env.OMP_NUM_THREADS=N to choose."""
    return "OMP_NUM_THREADS" not in os.environ and local_world_size > 1


def _free_port() -> int:
    """A port free on this host now, for the script's own rendezvous (its rank 0 binds it within ~1 s). Not
    ours: our TCPStore holds MASTER_PORT for the whole attempt, so init_process_group("env://") there fails."""
    import socket

    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


@dataclass
class Child:
    """This rank's child and what its start decided, shared by supervise's three parts."""

    proc: subprocess.Popen[bytes]
    cmd: list[str]
    found: str  # the checkpoint it resumes from ("" for none), the same on every rank
    found_mtime: float  # rank 0's: that file's, against which the end's newest file is progress
    started_at: float  # time.monotonic() just before it started: a stop signal after it reached the child too
    output: Output  # its last output, stdout and stderr together, and when it came
    step: int  # the run's committed step at its start (rank 0's; 0 elsewhere)


def supervise(
    env: Any, cfg: Any, paths: RunPaths, config: dict[str, Any], launched_at: float, reserve_s: float, task: Task
) -> dict[str, Any]:
    """Collective, on every rank once placed: run the command as this rank's child until every child exits
    or a stop signal ends them. Returns {"outcome": "finished" | "stopped" | "failed" | "unrunnable", "reason",
    "step", "kill_deadline", "sick"} for job.py's one decision."""
    child = _launch(env, cfg, paths, config, launched_at, task)
    stopped_at, reason, kill_deadline, killed = _watch(env, cfg, paths, child, launched_at, reserve_s, task)
    code = child.proc.wait()
    time.sleep(0.2)  # the echo threads' last lines
    step, events = 0, []
    if env.rank == 0:
        events = journal.read(paths.run_dir)
        step = journal.committed_step(events) or 0
        _file_progress(config, paths, env, events, child.found_mtime, step)
    if stopped_at is not None:
        return {"outcome": "stopped", "reason": reason, "step": step, "kill_deadline": kill_deadline}
    failed = [None] * env.world_size
    node = os.environ.get("SLURMD_NODENAME") or env.nodes[env.node_rank]
    mine = {
        "rank": env.rank,
        "code": code,
        "node": node,
        "tail": child.output.tail.decode(errors="replace")[-2000:],
        "killed": killed,
        "gpu_node": preempt.gpu_node(),
    }
    if env.rank == 0:  # rank 0's view for judge: any checkpoint or metrics row of the run
        newest = found_checkpoint(config, paths.run_dir)
        mine["progress"] = bool(child.found or newest or journal.progress(events, paths.metrics))
    dist.all_gather_object(failed, mine)
    out = judge(failed, child.cmd, paths.run_dir)
    if out["outcome"] == "finished":
        return {**out, "step": step}
    if env.rank == out["first"]:
        journal.log(
            paths.run_dir,
            journal.FAIL,
            step,
            env.job_id,
            env.restart_count,
            rank=env.rank,
            error=f"script exited with code {code} on rank {env.rank} ({node})"
            + (f": {out['cause']}" if out.get("cause") else ""),
            output=mine["tail"][-1000:],
        )
    return {**out, "step": step}


def _launch(env: Any, cfg: Any, paths: RunPaths, config: dict[str, Any], launched_at: float, task: Task) -> Child:
    """Collective: one decision on rank 0 (the script's rendezvous, the checkpoint it resumes from), the child
    started on every rank, and the start event with every child's pid."""
    s = cfg.script
    facts: list[Any] = [None]
    found_mtime = 0.0
    if env.rank == 0:
        make_dir(ckpt_dir(paths.run_dir), exist_ok=True)
        found = found_checkpoint(config, paths.run_dir)
        found_mtime = _mtime(Path(found)) if found else 0.0
        # HPC_TRAIN_MASTER_ADDR names our rendezvous host; the script's rank 0 is the placed first node
        addr = os.environ.get("HPC_TRAIN_MASTER_ADDR") if env.nodes[0] == env.master_addr else None
        facts[0] = {"addr": addr or env.nodes[0], "port": _free_port(), "found": found}
        # the command filled once: {after.ckpt} (a stage's final checkpoint, pipeline.placeholders) the same on
        # every rank, whatever the stage commits meanwhile; a fill that fails fails every rank, none left waiting
        try:
            facts[0]["cmd"] = command(config, paths.run_dir, resuming=bool(found))
            if any(pipeline.PLACEHOLDER in w for w in config["script"]["cmd"] + config["script"]["resume_args"]):
                facts[0]["after_ckpt"] = pipeline.placeholders(pipeline.PLACEHOLDER, paths.run_dir)["after.ckpt"]
                if facts[0]["after_ckpt"] == pipeline.PLACEHOLDER:  # started before its stage ended: a failure
                    raise RuntimeError(
                        f"{pipeline.PLACEHOLDER}: the stage this run was queued after is still queued or running "
                        f"and has no checkpoint yet (its dependency lost?); not starting the script without it"
                    )
        except Exception as e:
            facts[0]["error"] = (isinstance(e, preempt.Unrecoverable), f"{type(e).__name__}: {e}")
    dist.broadcast_object_list(facts, src=0)  # one answer: a checkpoint written meanwhile resumes no rank alone
    if "error" in facts[0]:
        unrecoverable, why = facts[0]["error"]
        raise (preempt.Unrecoverable if unrecoverable else RuntimeError)(why)
    found, cmd = facts[0]["found"], facts[0]["cmd"]
    ignore = ",".join(x for x in ("USR2", "TERM") if x != s.stop_signal)
    proc = subprocess.Popen(
        [sys.executable, "-S", "-c", _SHIM, ignore, s.stop_signal, *cmd],
        env=child_env(env, (facts[0]["addr"], facts[0]["port"]), paths, s.stop_signal),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,  # its own process group: end_child reaches its workers too
    )
    # after the fork: a signal Slurm sent before it never reached the child (already_delivered)
    started_at = time.monotonic()
    task.child, output = proc, Output()
    for stream, out in ((proc.stdout, sys.stdout.buffer), (proc.stderr, sys.stderr.buffer)):
        threading.Thread(target=_echo, args=(stream, out, output), daemon=True).start()
    pids = [p[0] for p in protocol.gather_ints(env, [proc.pid])]
    step = (journal.committed_step(journal.read(paths.run_dir)) or 0) if env.rank == 0 else 0
    protocol.start_event(
        env,
        paths,
        step,
        target="script",
        launched_at=launched_at,
        pids=pids,
        resumed_from=found or None,
        cmd=cmd,
        master=f"{facts[0]['addr']}:{facts[0]['port']}",
        **({"after_ckpt": facts[0]["after_ckpt"]} if facts[0].get("after_ckpt") else {}),
    )
    if env.rank == 0:
        log.info("every rank runs: %s", " ".join(cmd))
        if one_thread(env.local_world_size):
            log.info(
                "OMP_NUM_THREADS=1 for each of the %d processes a node (torchrun's default), so they do not overload "
                "it; tune it with +cluster.env.OMP_NUM_THREADS=N",
                env.local_world_size,
            )
    return Child(proc, cmd, found, found_mtime, started_at, output, step)


def _watch(
    env: Any, cfg: Any, paths: RunPaths, child: Child, launched_at: float, reserve_s: float, task: Task
) -> tuple[float | None, Reason, float, bool]:
    """Collective, 4 times a second until every child exited: a stop signal on any rank sends every child its
    stop signal (once) and starts its grace; a failed child ends the others. Returns (when the stop came, or
    None; its reason; Slurm's kill deadline; whether this rank ended its child)."""
    s, pulse = cfg.script, task.pulse
    stopped_at, kill_at, reason, kill_deadline = None, float("inf"), Reason.PREEMPT, float("inf")
    killed = False  # this rank ended its child: a peer's failure, or the stop's grace ran out
    signals_at_stop = 0  # how many stop signals this rank had when the stop came: a SIGTERM after them ends the job
    # Rank 0 watches metrics.jsonl (script_helper.log) by its mtime changing, timed on its own clock: the
    # mtime is the file server's clock, which may be minutes off ours.
    metrics_mtime, metrics_at = _mtime(paths.metrics) if env.rank == 0 else 0.0, 0.0
    while True:
        time.sleep(POLL_S)
        code = child.proc.poll()
        if env.rank == 0 and (m := _mtime(paths.metrics)) != metrics_mtime:
            metrics_mtime, metrics_at = m, time.monotonic()
        # [any stop signal, any child failed, not every child exited, -(seconds since this rank's newest
        # output), Slurm's SIGTERM after the stop came]: an age measured on the node that saw the output, so a node
        # whose wall clock is off neither hides its output from the others nor renews their heartbeat for as long
        # as it is ahead
        ending = stopped_at is not None and "SIGTERM" in pulse.received[signals_at_stop:]
        t = torch.tensor(
            [
                1.0 if pulse.received else 0.0,
                1.0 if code not in (None, 0) else 0.0,
                1.0 if code is None else 0.0,
                -(time.monotonic() - max(child.output.heard_at, metrics_at)),
                1.0 if ending else 0.0,
            ],
            dtype=torch.float64,
        )
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if -t[3] < 2 * POLL_S:  # any rank's output beats every rank's watchdog (rank 0 prints)
            pulse.last_beat = time.monotonic()
        if t[0] and stopped_at is None:
            left, reason = protocol.time_left(env, cfg.cluster, pulse, launched_at)
            stopped_at, kill_deadline = time.monotonic(), time.monotonic() + left
            signals_at_stop = len(pulse.received)
            kill_at = stopped_at + grace_s(left, reason, reserve_s)
            delivered = already_delivered(env.executor, s.stop_signal, child.started_at, pulse)
            # the event first: a child that returns at the signal (hydra_job.stopped) finds its stop recorded; the
            # signal in any case: a journal write that fails (a full disk, EIO) must not keep the stop from the child
            try:
                protocol.signal_event(
                    env,
                    paths,
                    child.step,
                    pulse,
                    reason,
                    left,
                    sent=s.stop_signal,
                    resent=not delivered,
                    kill_after_s=round(kill_at - stopped_at, 2),
                )
            finally:
                if code is None and not delivered:
                    os.killpg(child.proc.pid, getattr(signal, f"SIG{s.stop_signal}"))
        if t[4] and time.monotonic() + deadlines.AFTER_TERM_S < kill_at:  # the job ends: decide within KillWait
            kill_at = time.monotonic() + deadlines.AFTER_TERM_S
        if stopped_at is None and t[1]:  # a child failed: the others would block on it in a collective
            killed = child.proc.poll() is None
            end_child(child.proc)
            break
        if not t[2]:
            break
        if time.monotonic() >= kill_at:
            log.warning("the script did not exit within %.0f s of SIG%s: SIGKILL", kill_at - stopped_at, s.stop_signal)
            end_child(child.proc)
            kill_at = float("inf")
    return stopped_at, reason, kill_deadline, killed


def _file_progress(
    config: dict[str, Any], paths: RunPaths, env: Any, events: list[Any], since: float, step: int
) -> None:
    """Rank 0, as the attempt ends: a checkpoint file newer than the one found at its start (mtime `since`, 0
    for none) is progress for the failure budget (journal.failures_in_a_row), unless script_helper.committed()
    spoke in this attempt: its steps say more than a file's time. With script.checkpoint set, an attempt that
    left no newer file says so too (path and mtime None): goodput then counts its work as lost, not unknown."""
    if any(e["restart"] == env.restart_count for e in journal.named(events, journal.CHECKPOINT_COMMITTED)):
        return
    if not checkpoint_path(config, paths.run_dir):  # nothing names the script's files: nothing to tell
        return
    newest = found_checkpoint(config, paths.run_dir)
    mtime = _mtime(Path(newest)) if newest else 0.0
    newer = mtime > since
    journal.log(
        paths.run_dir,
        journal.SCRIPT_CHECKPOINT,
        step,
        env.job_id,
        env.restart_count,
        path=newest if newer else None,
        mtime=mtime if newer else None,
    )


# A shell's exit codes for a command that never ran (bash, dash and our _SHIM alike): no requeue makes it run.
NOT_RUNNABLE = {
    126: (
        "was found but could not be executed (no execute permission, a directory, or a binary for another machine)",
        "chmod +x it and `hpc-train resume {run}`, or submit again running it through its interpreter (python FILE)",
    ),
    127: (
        "was not found (not installed on that node, or not on its PATH)",
        "install it on every node and `hpc-train resume {run}`, or submit again with its absolute path",
    ),
}


# A script's failure that no retry can mend, when the run has made no progress yet (no checkpoint, no metrics
# row): python could not find the file, an import or the syntax failed, the argument parser refused the command.
# After progress the same words are a failure with its budget: a module that imports at the start and not an hour
# later is a node's install, not the script.
NO_RETRY = re.compile(
    r".*can't open file .*\[Errno 2\].*"
    r"|(ModuleNotFoundError|ImportError|SyntaxError|IndentationError|TabError): .*"
    r"|\S+: error: (unrecognized arguments|the following arguments are required|argument ).*"
)
# The last word of a failed python: its exception's line (the one a traceback ends with), argparse's error, or
# python's own "can't open file". Only that one is judged: a script that printed a handled ImportError
# (traceback.print_exc of an optional `import wandb`), then died of an ECC error, is a sick node's failure.
LAST_WORD = re.compile(
    r"^(?:[A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt)(?::.*)?|\S+: error: .*|.*can't open file .*)$", re.M
)


def cause(tail: str, code: int | None) -> str:
    """The last word of a child's output (LAST_WORD) when it makes the failure one no retry mends (NO_RETRY, not
    preempt.TRANSIENT_IO), else "". An argument parser's error counts only with its exit code 2 (argparse's)."""
    said = [m.group(0).strip() for m in LAST_WORD.finditer(tail)]
    last = said[-1] if said else ""
    if not NO_RETRY.fullmatch(last) or preempt.TRANSIENT_IO.search(last):
        return ""
    return last if code == 2 or ": error: " not in last or "Error: " in last else ""


def judge(failed: list[dict[str, Any]], cmd: list[str], run_dir: str | Path) -> dict[str, Any]:
    """What every rank's exit says (pure). failed holds each rank's {"rank", "code", "node", "tail", "killed" (we
    ended it), "gpu_node" (preempt.gpu_node)}; rank 0's also "progress" (the run has a checkpoint or a metrics
    row). Returns {"outcome": "finished", "exit_codes"} when all exited 0; "unrunnable" with `why` when a child
    we did not end exited 126/127 (the command could not run) or, before any progress, with a cause no retry
    mends (`cause`): a sentence, no requeue, no budget; else "failed" with `sick` (nodes a hardware error
    blames). `first`: the rank whose exit is recorded."""
    bad = [f for f in failed if f and f["code"] not in (0, None)]
    if not bad:
        return {"outcome": "finished", "exit_codes": [f["code"] for f in failed]}
    bad = [f for f in bad if not f["killed"]] or bad  # the ranks that failed first, not those we ended
    first = min(bad, key=lambda f: f["rank"])
    # Only the shim's own exec failure: a script's exit 127 (bash run.sh whose last command is missing on one
    # node) is a failure to requeue, leaving a sick node out, not a stop of the whole run.
    unrunnable = [f for f in bad if f["code"] in NOT_RUNNABLE and not f["killed"] and CANNOT_RUN in f["tail"]]
    if unrunnable:
        f = unrunnable[0]
        what, fix = NOT_RUNNABLE[f["code"]]
        return {
            "outcome": "unrunnable",
            "first": f["rank"],
            "why": (
                f"the command after -- could not run: {cmd[0]!r} exited with {f['code']} on rank {f['rank']} "
                f"({f['node']}): it {what}; {fix.format(run=run_dir)}. Not requeued: no budget spent"
            ),
        }
    sick = {}
    for f in bad:
        marker = preempt.hardware_error(f["tail"], f.get("gpu_node", True))
        if marker:
            sick[f["node"]] = f"rank {f['rank']} on {f['node']} failed with a hardware error ({marker})"
    broken = [f for f in bad if not f["killed"] and cause(f["tail"], f["code"])]
    if broken and not sick and not failed[0].get("progress", True):  # a sick node's failure is the node's
        f = broken[0]
        return {
            "outcome": "unrunnable",
            "first": f["rank"],
            "cause": cause(f["tail"], f["code"]),
            "why": (
                f"the command after -- failed before any progress: {cmd[0]!r} exited with {f['code']} on rank "
                f"{f['rank']} ({f['node']}): {cause(f['tail'], f['code'])}; fix it and `hpc-train resume {run_dir}`. "
                "(no retry mends it: no budget spent)"
            ),
        }
    return {"outcome": "failed", "reason": Reason.FAILURE, "first": first["rank"], "sick": sick or None}


def already_delivered(executor: str, stop_signal: str, child_from: float, pulse: Pulse) -> bool:
    """Did the child get its stop signal from Slurm itself? Under proctrack/linuxproc Slurm signals every
    descendant of the step (kill_proc_tree), so a USR2 or TERM this rank received after the child started reached
    the child too: sending it again gave a handler that saves for longer than our 0.25 s poll two signals
    (Lightning logged 'Received SIGTERM' twice; a second-signal-quits handler died mid-save). Not under
    proctrack/cgroup, which signals the step's tasks only (its parent is slurmstepd) and any other process with
    SIGKILL alone (proctrack_cgroup.c: "only signal slurm tasks unless signal is SIGKILL"), nor proctrack/pgid
    (the task's process group, not the child's own session), nor on the local executor, whose controller signals
    the ranks only, nor for a signal relayed into this step (HPC_TRAIN_PENDING_SIGNAL), which came before it."""
    name = f"SIG{stop_signal}"
    if executor != "slurm" or slurm.proctrack_type(os.environ) != "proctrack/linuxproc":
        return False
    return any(n == name and at >= child_from for n, at in zip(pulse.received, pulse.received_at))


def grace_s(left_s: float, reason: Reason, reserve_s: float) -> float:
    """Seconds from the stop signal to the child's SIGKILL, of the left_s Slurm leaves (pure). A time
    limit's TIMEOUT is never requeued by Slurm: the decision's worst case (reserve_s, deadlines.decision_reserve_s:
    35 s, 50 s elastic) is kept whole, even if nothing is left for the script (submit warns:
    deadlines.reserve_warning). A preempted job Slurm requeues itself: a little for the records."""
    keep = reserve_s if reason == Reason.TIME_LIMIT else min(DECIDE_RESERVE_S, left_s / 4)
    return max(0.0, left_s - keep)


def finish(env: Any, paths: RunPaths, outcome: dict[str, Any]) -> dict[str, Any]:
    """Every child exited 0 without a stop signal: the run's finish (protocol.finish), its step the furthest any
    record tells (script_helper.log's metrics rows, committed()), None when none does."""
    from hpc_train.metrics import read_metrics

    rows = read_metrics(paths.run_dir) if env.rank == 0 else []
    losses = [r["loss"] for r in rows if isinstance(r.get("loss"), (int, float))]
    step = max([outcome["step"], *(int(r["step"]) for r in rows)])
    final_loss = {"final_loss": losses[-1]} if losses else {}
    return protocol.finish(env, paths, step or None, exit_codes=outcome["exit_codes"], **final_loss)
