"""A rank's failure: its `fail` event, its heartbeat count, the claim (the first failing rank of an attempt
decides, requeue.requeue_or_stop), the others' wait for the verdict on record, and the memory tier's copies after
it."""

from __future__ import annotations

import logging
import os
import time
import traceback
from pathlib import Path
from typing import Any, NoReturn

from hpc_train import deadlines, journal, preempt, ranklog, rejoin, requeue, verdict
from hpc_train.paths import RunPaths
from hpc_train.reasons import Reason
from hpc_train.task import Task
from hpc_train.verdict import Verdict

log = logging.getLogger(__name__)


def failed(paths: RunPaths, env: Any, task: Task, e: BaseException) -> tuple[str, float]:
    """This rank's `fail` event, then the one decision (after_failure): (verdict, grace_s)."""
    # Past the rendezvous, the placed rank: the watchdog writes its heartbeat count under it, and the
    # deciding rank maps counts to nodes in placement order (Slurm's task id collided with another rank's).
    env = task.placed or env
    ranklog.enable()  # the function may have silenced our loggers (dictConfig): the decision must speak
    log_fail(paths, env, task, f"{type(e).__name__}: {e}", traceback=traceback.format_exc(limit=5))
    return after_failure(paths, env, task, e)


def log_fail(paths: RunPaths, env: Any, task: Task, error: str, **extra: Any) -> None:
    """This rank's `fail` event at the step it reached (a crash, or the watchdog's hang)."""
    journal.log(
        paths.run_dir,
        journal.FAIL,
        task.pulse.step_reached,
        env.job_id,
        env.restart_count,
        rank=env.rank,
        error=error,
        **extra,
    )


def leave_after_failure(task: Task, chosen: str, grace_s: float, env: Any) -> NoReturn:
    traceback.print_exc()  # this rank's log keeps the whole story
    leave_by(task, chosen, grace_s, env)


def leave_by(task: Task, chosen: str, grace_s: float, env: Any) -> NoReturn:
    """Leave as a failure's verdict says: WAIT and RELAUNCH as they are, REQUEUE on the local executor (144: its
    controller restarts every task in place); anything else (a Slurm requeue is Slurm's to bring back, a rank that
    did not decide) exits 1."""
    if chosen in (Verdict.WAIT, Verdict.RELAUNCH, Verdict.FINISHED) or (
        chosen == Verdict.REQUEUE and env.executor == "local"
    ):
        verdict.leave(task, chosen, grace_s)
    verdict.leave(task, Verdict.STOP, 0.0)


def _finished(paths: RunPaths, env: Any) -> bool:
    """Attempt env.restart_count's `finish` is on record."""
    return any(
        e.get("restart") == env.restart_count for e in journal.named(journal.read(paths.run_dir), journal.FINISH)
    )


def hung_nodes(hangs: Path, env: Any, wait_s: float) -> dict[str, str]:
    """At a hang, the nodes of the ranks that stopped (preempt.hung_ranks), from the heartbeat counts every
    failing rank writes into `hangs`; waits up to wait_s for them all (the blocked ranks' watchdogs fire
    a forward pass later than the stopped rank's and poll every <= 5 s; others fail as peers exit)."""
    until = time.monotonic() + wait_s
    while len([p for p in hangs.iterdir() if p.name.isdigit()]) < env.world_size and time.monotonic() < until:
        time.sleep(0.5)
    counts = {}
    for p in hangs.iterdir():
        try:
            counts[int(p.name)] = int(p.read_text())
        except ValueError:
            pass
    out: dict[str, str] = {}
    for r in preempt.hung_ranks(counts, env.world_size):
        node = env.nodes[r // env.local_world_size]
        out[node] = f"rank {r} on {node} hung: {counts[r]} heartbeats while the others reached {max(counts.values())}"
    return out if len(out) < len(set(env.nodes)) or env.executor != "slurm" else {}


def after_failure(
    paths: RunPaths, env: Any, task: Task, error: BaseException | None = None, hang: bool = False
) -> tuple[str, float]:
    """The first rank to fail in an attempt decides (an O_EXCL file); the others die with it (gloo
    sees the closed peer). Returns (its verdict, or "" for the others; the partition's grace time).
    Every failing rank first writes its heartbeat count, from which the deciding rank blames a hang
    (hang=True: the watchdog fired) on the ranks that stopped first (hung_nodes). A failure after the attempt's
    `finish` is on record (a peer gone at the closing barrier, a copy stuck at the finish) is no failure of the run:
    FINISHED, it leaves 0, never a requeue of a finished run."""
    from hpc_train.config import check_environment, load_frozen

    if _finished(paths, env):
        log.warning("the run finished (its finish is on record) before this failure: leaving 0")
        return Verdict.FINISHED, 0.0
    hangs = rejoin.write_heartbeats(paths, env, task.pulse.ticks)
    try:
        claim = paths.failure_claim(env.job_id, env.restart_count)
        os.close(os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except FileExistsError:
        return _await_verdict(paths, env, task, hang)
    task.deciding = True
    try:
        cfg = load_frozen(paths.run_dir)
        check_environment(cfg)
    except Exception as e:  # the config itself, or what it needs of this node, is what fails: no point in retrying
        return _stop(
            paths,
            env,
            task,
            f"the frozen config or this node's environment failed ({type(e).__name__}: {e}); fix it, then "
            f"hpc-train resume {paths.run_dir}",
        )
    if isinstance(error, preempt.Unrecoverable):
        return _stop(paths, env, task, str(error))
    # the code's, the same on every node and attempt; not one the file system failed (preempt.TRANSIENT_IO)
    no_retry = isinstance(error, (ImportError, SyntaxError)) and not preempt.TRANSIENT_IO.search(str(error))
    if no_retry and not journal.progress(journal.read(paths.run_dir), paths.metrics):
        return _stop(
            paths,
            env,
            task,
            f"{type(error).__name__}: {error}, before any progress (no retry mends it: no budget spent); fix it, then "
            f"hpc-train resume {paths.run_dir}",
        )
    text = f"{type(error).__name__}: {error}" if error is not None else ""
    marker = preempt.hardware_error(text, preempt.gpu_node())
    node = os.environ.get("SLURMD_NODENAME") or env.nodes[env.node_rank]
    # env is Slurm's task numbering (this runs outside the placed rendezvous too): name the task, not a rank
    who = f"{'Slurm task' if env.executor == 'slurm' else 'task'} {env.rank}"
    sick = {node: f"{who} on {node} failed with a hardware error ({marker}): {text[:200]}"} if marker else None
    if hang:
        sick = hung_nodes(hangs, env, min(30.0, cfg.train.watchdog_s)) or None
    step, signals = task.pulse.step_reached, task.pulse.received
    chosen = requeue.requeue_or_stop(paths, env, cfg, Reason.FAILURE, step, sick, hang, signals=signals)
    # by the verdict on record, as the other ranks judge it: a relaunch that leaves this rank's node out
    # (its own hardware error, its hang) has no rank here to read this node's copies
    clean_memory(journal.verdict(journal.read(paths.run_dir), env.restart_count), env.executor == "local", task.memory)
    return chosen, cfg.cluster.preempt_grace_s


def _await_verdict(paths: RunPaths, env: Any, task: Task, hang: bool) -> tuple[str, float]:
    """A rank that did not claim the failure: ("rejoin", 0.0) where the verdict on record is an in-process restart
    whose plan names it a survivor (and it did not hang), else ("", 0.0): it leaves."""
    # The watchdog thread decides while the main thread sees the peers' exits (gloo: closed peer), or
    # the other way round: this thread must not end the process under the deciding one, which exits.
    while task.deciding:
        time.sleep(1)
    # Another rank decides: stay until its verdict is on record. Exiting at once closed this rank's
    # sockets, failing the blocked ranks before they wrote their heartbeat counts, and under a site's
    # KillOnBadExit=1 srun would kill the deciding rank with us. Still none by deadlines.VERDICT_WAIT_S (the
    # deciding rank died): this node's copies stay, since a relaunch could still come and read them.
    until = time.monotonic() + deadlines.VERDICT_WAIT_S
    while (end := journal.verdict(journal.read(paths.run_dir), env.restart_count)) is None:
        if time.monotonic() >= until:
            log.warning(
                f"no verdict on record {deadlines.VERDICT_WAIT_S:.0f} s after this rank failed: "
                f"leaving without it, this node's memory copies kept for a relaunch that may still come"
            )
            break
        time.sleep(0.5)
    clean_memory(end, env.executor == "local", task.memory)
    plan = rejoin.read_rejoin_plan(paths, env.job_id)  # and the verdict: a plan alone may be a deciding rank's last act
    mine = plan and plan["from"] == env.restart_count and env.rank in plan.get("survivors", [])
    if not hang and mine and journal.rejoins(end):
        return Verdict.REJOIN, 0.0
    return Verdict.NONE, 0.0


def _stop(paths: RunPaths, env: Any, task: Task, why: str) -> tuple[str, float]:
    """The deciding rank's stop without a decision: what failed is no thing a requeue mends. On record, so that
    the other ranks' verdict wait and a standby's (journal.step_over) end now."""
    try:
        journal.log(paths.run_dir, journal.STOPPED, task.pulse.step_reached, env.job_id, env.restart_count, reason=why)
    except OSError:
        pass
    log.error(f"not requeueing: {why}")
    requeue.settle(paths, why)
    return Verdict.STOP, 0.0


def clean_memory(end: dict[str, Any] | None, local: bool, tier: Any) -> None:
    """checkpoint.memory_every_steps: this node's copies (`tier`, the Task's; None: no tier in this attempt) go
    unless the failed attempt's verdict `end` starts the step again in this allocation on this node
    (journal.keeps_memory): a requeue's allocation (another Slurm restart count) never reads them, and nothing
    else removes them from a node the run does not come back to (RAM until the node's reboot)."""
    if tier is not None:
        tier.abandon()  # the copy in flight either way (a peer may be gone): a relaunch reads complete steps only
        if not journal.keeps_memory(end, tier.node, local):
            tier.clean()
