"""Hot spares (cluster.spare_nodes): a failure's requeue replaced by a relaunch of the training step inside the
allocation, the sick nodes left out (the relay reads the marker with the next step's srun options), or by an
in-process rejoin (cluster.in_process_restart, rejoin.py)."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hpc_train import deadlines, journal, preempt, rejoin, relay, slurm
from hpc_train.env import parse_nodelist
from hpc_train.paths import RunPaths


def in_job_restart(
    paths: RunPaths,
    env: Any,
    cfg: Any,
    reason: str,
    fate: str,
    events: list[dict[str, Any]],
    budgets: Any,
    sick: dict[str, str],
    signals: list[str],
    record: Callable[..., None],
    hang: bool = False,
) -> str:
    """Hot spares: relaunch the training step inside the allocation in place of the failure's requeue `decide`
    chose (preempt.in_job_restart), leaving the sick nodes out of the allocation (preempt.exclusion counting the
    allocation's nodes: the step starts there, whatever the partition holds)? "relaunch" once the marker is
    written and recorded, "rejoin" once an in-process restart is (cluster.in_process_restart, rejoin.plan_rejoin);
    "": the requeue path decides as without spares, counting the partition."""
    job_nodes = parse_nodelist(os.environ.get("SLURM_JOB_NODELIST", ""))
    excluded, not_out, stop = (
        preempt.exclusion(
            events,
            sick,
            budgets.max_excluded_nodes,
            len(job_nodes) - (cfg.cluster.min_nodes or cfg.cluster.nodes),
            allocation=job_nodes,
        )
        if sick
        else (sorted(journal.excluded_nodes(events)), "", "")
    )
    # A blamed node that could not be left out (its budget spent): relaunched, the step could land on it again.
    if stop or not_out:
        return ""
    # Time left: Slurm's EndTime (one scontrol call, 3 s at most), else the frozen time limit from the start
    # of the allocation the batch script noted.
    end = (
        slurm.end_time(env.job_id)[0]
        or float(os.environ.get("HPC_TRAIN_ALLOCATED_AT") or "inf") + cfg.cluster.timeout_min * 60
    )
    left_out = sorted(set(excluded) & set(job_nodes))
    used = journal.in_job_restarts_in_a_row(events)
    c = cfg.cluster
    facts = preempt.RestartFacts(
        c.spare_nodes,
        "requeue",
        reason,
        fate,
        list(signals),
        used,
        budgets.max_in_job_restarts,
        job_nodes,
        left_out,
        c.nodes,
        left_s=end - time.time(),
        startup_s=journal.startup_s(events),
        signal_lead_s=c.signal_lead_s,
        min_nodes=c.min_nodes,
    )
    n, why_not = preempt.in_job_restart(facts)
    if why_not:
        print(f"[hpc_train] not restarting inside the allocation: {why_not}", file=sys.stderr, flush=True)
        return ""
    if cfg.cluster.in_process_restart and rejoin.plan_rejoin(paths, env, events, sick, used, reason, record, hang):
        return "rejoin"
    return "relaunch" if relaunch(env, cfg.cluster, reason, job_nodes, left_out, used, record, n, sick) else ""


def relay_silent_s(folder: Path, slurm_job: str) -> float:
    """How long the batch script's relay has been silent (its node lost), or 0.0 when it lives or nobody knows
    (relay.beat_at). Older than deadlines.RELAY_SILENT_S by this node's clock, the beat is read once more
    deadlines.RELAY_RECHECK_S later: a changed one is a live relay on a node whose clock is behind, not a lost one."""
    beat = relay.beat_at(Path(folder), slurm_job)
    if beat is None or time.time() - beat <= deadlines.RELAY_SILENT_S:
        return 0.0
    time.sleep(deadlines.RELAY_RECHECK_S)
    return time.time() - beat if relay.beat_at(Path(folder), slurm_job) == beat else 0.0


def relaunch(
    env: Any,
    cluster: Any,
    reason: str,
    job_nodes: list[str],
    left_out: list[str],
    used: int,
    record: Callable[..., None],
    n: int,
    sick: dict[str, str] | None = None,
) -> bool:
    """Write the next training step's srun options (n nodes: cluster.nodes, fewer with cluster.min_nodes once
    no spare is left; preempt.in_job_restart) where the batch script's srun() looks (paths.relaunch_marker)
    and record the sick nodes left out and the in-job restart; False (requeue instead, nothing recorded) where
    no batch script of ours started the step or the marker could not be written."""
    folder, slurm_job = os.environ.get("SUBMITIT_FOLDER"), os.environ.get("SLURM_JOB_ID")
    if not (folder and slurm_job and os.environ.get("HPC_TRAIN_STEP_ARGS")):  # exported by our spares' batch script
        print(
            "[hpc_train] not restarting inside the allocation: this step was not started by hpc_train's batch script "
            "with hot spares (no HPC_TRAIN_STEP_ARGS, e.g. srun by hand); requeueing",
            file=sys.stderr,
            flush=True,
        )
        return False
    if silent := relay_silent_s(Path(folder), slurm_job):  # the relay's node is lost: nobody would read a marker
        print(
            f"[hpc_train] not restarting inside the allocation: the batch script's relay last wrote "
            f"{relay.beat_file(Path(folder), slurm_job)} {silent:.0f} s ago (its node lost?); requeueing",
            file=sys.stderr,
            flush=True,
        )
        return False
    spares = len(set(job_nodes) - set(left_out)) - n
    step = n + (spares if cluster.in_process_restart else 0)  # the spares left run the standbys again
    args = f"--nodes={step} --ntasks={step * cluster.tasks_per_node}" + (
        f" --exclude={','.join(left_out)}" if left_out else ""
    )
    try:
        relay.write_marker(Path(folder), slurm_job, args)
    except OSError as e:  # a full disk: the requeue still brings the run back
        print(f"[hpc_train] could not write the relaunch marker ({e}): requeueing", file=sys.stderr, flush=True)
        return False  # said here: the caller's sentence would have no reason to give
    for node, because in (sick or {}).items():
        record(journal.NODE_EXCLUDED, node=node, why=because)
    record(
        journal.IN_JOB_RESTART,
        reason=reason,
        left_out=left_out,
        nodes_next=n,
        spares_left=spares,
        in_job_restarts=used + 1,
        srun_args=args,
    )
    out = f" without {', '.join(left_out)}" if left_out else ""
    smaller = f", going on with {n} of cluster.nodes={cluster.nodes}" if n < cluster.nodes else ""
    print(
        f"[hpc_train] restarting inside the allocation{out} ({spares} spare(s) left{smaller}): srun {args}",
        file=sys.stderr,
        flush=True,
    )
    return True
