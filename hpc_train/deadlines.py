"""Every deadline of the stop and failure paths, in one table (torch-free, pure). The batch step's supervisor
(relay.py, which imports nothing of hpc_train) gets STEP_END_S, STEP_KILL_S and RELAY_BEAT_S as its arguments
from the batch script (sbatch.relay_lines).

From a stop signal to the job's end (docs/lifecycle.md draws it):
    signal ........ the step boundary ........ the save ........ REQUEUE_RESERVE_S: rank 0's decision
    a failure ..... VERDICT_WAIT_S: the others wait for the deciding rank's verdict on record
    relaunch marker STEP_END_S: the step's tasks exit ........ STEP_KILL_S: srun TERM, then SIGKILL
"""

from __future__ import annotations

from typing import Any

from hpc_train import slurm

# How long a starting job waits for the run's lock (paths.locked) before it reads the journal without it: an
# `hpc-train resume` recording its event holds it for a second or so; a holder dead on NFSv3 keeps it for good.
RUN_LOCK_WAIT_S = 60.0

# What rank 0 runs between a stop save and the answer of `scontrol requeue`, at its worst: the job's fate
# (slurm.STOP_FATE, 10 s), the requeue (slurm.STOP_REQUEUE, 21 s) and 4 s for reading and appending
# events.jsonl and broadcasting the verdict: 35 s, kept out of a time-limit stop save's budget
# (Attempt.step_end). With the failure path's policies (33 s + 33 s) it would be 70 s of the default
# signal_lead_s=120. Retention deletes nothing on the stop path (the next resume does), and `scontrol
# update` comes after the requeue, under KillWait, either way.
REQUEUE_RESERVE_S = slurm.worst_s(*slurm.STOP_FATE) + slurm.worst_s(*slurm.STOP_REQUEUE) + 4.0
# An elastic run's queue snapshot before the requeue: 3 calls under slurm.STOP_SNAPSHOT, 15 s more.
ELASTIC_RESERVE_S = 3 * slurm.worst_s(*slurm.STOP_SNAPSHOT)
# The least a time-limit stop should leave for the save itself (the trainer's, or a script's save and exit)
# after the reserve: below it the trainer skips every stop save of any real model and a script is killed
# almost at once. Not a measurement: metrics.lead_warning judges the lead by the saves a run measured.
MIN_STOP_GRACE_S = 10.0

# How long a rank that did not decide waits for the verdict on record: the deciding rank's failure path at
# its worst, when Slurm does not answer: a hang's blame (30 s, failure.hung_nodes), the job's fate and, with hot
# spares, the nodes it holds (slurm.FATE, 33 s each), EndTime (3 s), sinfo for an exclusion (21 s), an elastic
# queue snapshot (3 x 21 s), the requeue and the ExcNodeList update (slurm.REQUEUE, 33 s each) and 10 s for the
# config and the records: 259 s. At 60 s a slower decision that came to a relaunch found the copies of the ranks
# that had left deleted. It ends as soon as the verdict is there (ms after the relay's marker).
VERDICT_WAIT_S = (
    30.0 + 2 * slurm.worst_s(*slurm.FATE) + 3.0 + 4 * slurm.worst_s(10.0, 1) + 2 * slurm.worst_s(*slurm.REQUEUE) + 10.0
)

# A script's child still running when Slurm's SIGTERM comes during a stop (the job is ending: a requeue the script
# made itself, as Lightning's auto_requeue does and then trains on, a scancel, the limit) gets this long, then
# SIGKILL: the decision after it must land within KillWait (30 s by default, 10 s on the dev cluster).
AFTER_TERM_S = 5.0

# The most a stop waits for the memory copy in flight before it leaves (a copy of a `1b` state takes ~10 s); the
# finish waits longer, since nothing kills it: a copy stuck on a gone peer is abandoned, the disk has the step.
STOP_MEMORY_WAIT_S = 60.0
FINISH_MEMORY_WAIT_S = 120.0


def stop_memory_wait_s(kill_deadline: float, now: float, keep_s: float) -> float:
    """How long a stop may wait for the memory copy in flight: STOP_MEMORY_WAIT_S, and never into the last
    `keep_s` before Slurm's SIGKILL (`kill_deadline` and `now` on time.monotonic(); inf: no signal's deadline)."""
    return max(0.0, min(kill_deadline - now - keep_s, STOP_MEMORY_WAIT_S))


# The relay writes its beat every RELAY_BEAT_S while the step runs: RELAY_SILENT_S is six missed beats (a loaded
# batch host, a slow shared file system), far under the SlurmdTimeout (300 s by default) after which Slurm itself
# takes a silent node out of the job. A beat that looks old is read again RELAY_RECHECK_S later: unchanged, the
# relay is gone; changed, its node's clock is behind.
RELAY_BEAT_S = 5
RELAY_SILENT_S = 30.0
RELAY_RECHECK_S = 6.0
# After the relaunch marker (or the finished file) the step's tasks get STEP_END_S to exit (the verdict goes on
# record right after the marker, and the ranks that did not decide poll for it every 0.5 s), then srun a TERM,
# which it turns into SIGKILL for every task; then STEP_KILL_S (twice slurmstepd's default UnkillableStepTimeout
# of 60 s for a D-state task) before SIGKILL to srun itself. HPC_TRAIN_STEP_END_S/_KILL_S in the job's environment
# (cluster.env) override them.
STEP_END_S = 90
STEP_KILL_S = 120

# cluster.in_process_restart: the deciding rank waits until every rank either said it survived (its heartbeat
# count, written as it fails: within one step of the crash) or is known dead (its lock of paths.alive is free:
# at once for a killed process), at most this long: a lost node's lock on NFS outlives it (~90 s), and a rank
# silent by then is taken for dead. One that was only late finds itself out of the plan and exits.
REJOIN_SETTLE_S = 2.0


def reserve_s(executor: str, is_elastic: bool) -> float:
    """Seconds a time-limit stop keeps after its save for the requeue decision; the local executor's decision
    calls no Slurm client: only its 4 s of records."""
    if executor != "slurm":
        return 4.0
    return REQUEUE_RESERVE_S + (ELASTIC_RESERVE_S if is_elastic else 0.0)


def decision_reserve_s(env: Any, cfg: Any) -> float:
    """reserve_s of this task's run: + ELASTIC_RESERVE_S for an elastic one (ClusterConfig.elastic)."""
    return reserve_s(env.executor, env.executor == "slurm" and cfg.cluster.elastic())


def reserve_warning(cluster: Any) -> str:
    """ "" when cluster.signal_lead_s leaves MIN_STOP_GRACE_S for a time-limit stop's save after the requeue
    decision's reserve (decision_reserve_s), else the warning submit prints."""
    is_elastic = cluster.executor == "slurm" and cluster.elastic()
    keep, lead = reserve_s(cluster.executor, is_elastic), cluster.signal_lead_s
    if lead >= keep + MIN_STOP_GRACE_S:
        return ""
    return (
        f"cluster.signal_lead_s={lead} leaves {max(0.0, lead - keep):.0f} s for a time-limit stop's save: "
        f"the requeue decision keeps {keep:.0f} s of it (deadlines.decision_reserve_s: scontrol's worst case"
        f"{', and an elastic run queue snapshot' if is_elastic else ''}), so the trainer would skip its stop save "
        f"and a script would get SIGKILL {max(0.0, lead - keep):.0f} s after its stop signal; use "
        f"cluster.signal_lead_s>={keep + MIN_STOP_GRACE_S:.0f}, or more: the slowest save and step, plus 60 s"
    )
