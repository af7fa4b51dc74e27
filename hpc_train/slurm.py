"""The one place that shells out to Slurm's clients (scontrol, squeue, sacct, scancel, srun, sinfo,
sacctmgr, sbatch --test-only), on the login node and inside the job (the job's fate and its requeue), with
one retry policy, and the one way to ask a job's state (job_states).

Every call has a timeout and exports SLURM_CONF when the cluster config names one (without it the
clients try a DNS SRV lookup). Parsers are pure functions of the clients' text, tested on captures.
Torch-free: the login node uses all of it.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from typing import Any, NamedTuple

from hpc_train.reasons import Fate

TRANSIENT = ("timed out", "unable to contact", "connection refused", "socket timed out", "try again")


STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR2)  # preempt.STOP_SIGNALS: a client call in the job must outlive them


class SlurmError(RuntimeError):
    pass


# Client calls started ahead of need (prefetch), by their arguments, with when they started (time.monotonic);
# call() takes their answer.
_PREFETCHED: dict[tuple[str, ...], tuple[subprocess.Popen[str], float]] = {}


def prefetch(*commands: list[str]) -> None:
    """Start these client calls now, each in its own process; the next call() with the same arguments takes
    its answer, one try: a call that failed is run again by call() under its retry policy, so errors read
    as they always did. The submit path asks the cluster's partitions and nodes, and the site's history (sacct),
    while it renders the batch script, which imports submitit (~25 ms): ~15 ms of round trips hidden."""
    conf = os.environ.get("SLURM_CONF")
    if conf and not os.path.isfile(conf):  # the clients would retry reading it for 60 s; call() says why
        return
    for args in commands:
        if tuple(args) not in _PREFETCHED:
            try:
                proc = subprocess.Popen(
                    args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True
                )
                _PREFETCHED[tuple(args)] = (proc, time.monotonic())
            except OSError:  # not installed, not runnable: call() says so
                pass


def drop_prefetched() -> None:
    """Stop the calls prefetch started that nobody will read (the controller is down: they would retry ~9 s)."""
    while _PREFETCHED:
        proc = _PREFETCHED.popitem()[1][0]
        proc.kill()
        proc.communicate()


def _prefetched(args: list[str], timeout_s: float, retries: int) -> str | None:
    proc, started = _PREFETCHED.pop(tuple(args), (None, 0.0))
    if proc is None:
        return None
    # timeout_s from its start: calls prefetched together (a sweep's sacct per partition) wait it once; but a second
    # at least to read one that answered meanwhile (communicate(timeout=0) raises even for a process that exited),
    # or waits in a full pipe (over 64 KiB: a month of sacct) until it is read
    left = max(timeout_s - (time.monotonic() - started), min(timeout_s, 1.0))
    try:
        out, err = proc.communicate(timeout=left)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        if retries == 0:  # one try asked for (the history's sacct): it had its timeout, not a second one
            raise SlurmError(f"`{' '.join(args)}` did not answer within {timeout_s:.0f} s") from None
        return None
    if proc.returncode != 0:
        return None
    return out + err if args[:2] == ["sbatch", "--test-only"] else out


def call(
    args: list[str], timeout_s: float = 30, retries: int = 3, input_text: str | None = None, ignore_term: bool = False
) -> str:
    """Run a Slurm client; retry transient controller errors with 1, 2, 4 s backoff; stdout on success."""
    conf = os.environ.get("SLURM_CONF")
    if conf and not os.path.isfile(conf):  # the clients would retry reading it for 60 s, then fail
        raise SlurmError(
            f"SLURM_CONF={conf} does not exist; set cluster.slurm_conf to your cluster's slurm.conf "
            f"(`scontrol show config | grep SLURM_CONF` on its login node)"
        )
    answer = _prefetched(args, timeout_s, retries) if _PREFETCHED else None
    if answer is not None:
        return answer
    err = ""
    for attempt in range(retries + 1):
        try:
            # ignore_term: a call the job makes around its own requeue; the stop signals sent to the job's
            # processes (TERM, the relayed USR2) killed it mid-answer (rc -15, -12, no output). Blocked in this
            # thread for the call: the child inherits the mask across exec and sees them only as pending.
            # Not preexec_fn: it forces fork() instead of vfork() in a multi-GB, multi-threaded rank (fails
            # under vm.overcommit_memory=2, and may deadlock on a lock another thread held). The handlers
            # only record, so this thread getting TERM a few seconds late changes nothing.
            mask = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS) if ignore_term else None
            try:
                proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout_s, input=input_text)
            finally:
                if mask is not None:
                    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        except subprocess.TimeoutExpired:
            err = f"`{' '.join(args)}` did not answer within {timeout_s:.0f} s"
        except FileNotFoundError:
            raise SlurmError(
                f"`{args[0]}` is not installed here (not on PATH); use cluster=local, or run on a Slurm login node"
            ) from None
        except OSError as e:  # on PATH but not runnable: no exec bit, a noexec mount, another architecture
            raise SlurmError(f"`{args[0]}` cannot run here: {e}") from None
        else:
            if proc.returncode == 0:
                return proc.stdout + proc.stderr if args[:2] == ["sbatch", "--test-only"] else proc.stdout
            err = (proc.stderr or proc.stdout).strip() or f"exit status {proc.returncode}, no output"
            if not any(word in err.lower() for word in TRANSIENT):
                break
        if attempt < retries:
            print(
                f"hpc-train: `{' '.join(args[:3])}`: {err.splitlines()[-1] if err else 'no answer'}; retrying in "
                f"{2**attempt} s",
                file=sys.stderr,
                flush=True,
            )
            time.sleep(2**attempt)
    if "configuration source" in err or "DNS SRV" in err:
        err += (
            "\nno Slurm configuration was found: set cluster.slurm_conf=/path/to/slurm.conf (or export "
            "SLURM_CONF), or run on the cluster's login node"
        )
    raise SlurmError(f"`{' '.join(args)}` failed: {err}")


def worst_s(timeout_s: float, retries: int) -> float:
    """The longest call() can take with this policy: every try times out, with the backoffs between them."""
    return (retries + 1) * timeout_s + sum(2**a for a in range(retries))


def parse_key_values(text: str) -> dict[str, str]:
    """`scontrol show ... -o` / `show config` text -> {key: value}. Values may hold spaces in `show config`."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        if " = " in line:  # show config: "MaxArraySize            = 1001"
            key, _, value = line.partition(" = ")
            out[key.strip()] = value.strip()
        else:
            for m in re.finditer(r"(\w+)=(\S*)", line):
                out[m.group(1)] = m.group(2)
    return out


def show_config() -> dict[str, str]:
    return parse_key_values(call(["scontrol", "show", "config"]))


def _show(kind: str, name_key: str) -> dict[str, dict[str, str]]:
    """`scontrol show <kind> -o`: one line per object -> {name: fields}."""
    out = {}
    for line in call(["scontrol", "show", kind, "-o"]).splitlines():
        if f"{name_key}=" in line:  # not "No reservations in the system"
            fields = parse_key_values(line)
            out[fields[name_key]] = fields
    return out


def partitions() -> dict[str, dict[str, str]]:
    return _show("partition", "PartitionName")


def nodes() -> dict[str, dict[str, str]]:
    return _show("node", "NodeName")


def reservations() -> dict[str, dict[str, str]]:
    return _show("reservation", "ReservationName")


def unreachable(timeout_s: float = 5) -> str:
    """Why the controller cannot answer now, "" when it can: one `scontrol ping` (~10 ms when it is down
    on a reachable host; scontrol's other commands retry for ~9 s first), no retries."""
    try:
        call(["scontrol", "ping"], timeout_s=timeout_s, retries=0)
        return ""
    except SlurmError as e:
        lines = str(e).splitlines()  # the first says what failed; a last "no Slurm configuration" says the fix
        return lines[0] + (f"; {lines[-1]}" if lines[-1].startswith("no Slurm configuration") else "")


def parse_associations(text: str) -> tuple[str, list[tuple[str, str, list[str]]]]:
    """`sacctmgr -n -P show user U withassoc format=DefaultAccount,Account,Partition,QOS` -> (default
    account, [(account, partition or "" for all, allowed QoS)]) (pure)."""
    default, rows = "", []
    for line in text.splitlines():
        fields = line.split("|")
        if len(fields) >= 4 and fields[1]:  # a user with no association on that cluster prints "|||"
            default = fields[0]
            rows.append((fields[1], fields[2], [q for q in fields[3].split(",") if q]))
    return default, rows


def associations(user: str, cluster_name: str) -> tuple[str, list[tuple[str, str, list[str]]]]:
    """parse_associations of what slurmdbd holds for this user on this cluster. One try of 5 s: with
    slurmdbd down, sacctmgr waits and the default retries made a submit hang for minutes."""
    return parse_associations(
        call(
            [
                "sacctmgr",
                "-n",
                "-P",
                "show",
                "user",
                user,
                "withassoc",
                "where",
                f"cluster={cluster_name}",
                "format=DefaultAccount,Account,Partition,QOS",
            ],
            timeout_s=5,
            retries=0,
        )
    )


def time_limit_min(text: str) -> float:
    """Slurm's time format ("UNLIMITED", "30", "1:00:00", "2-00:00:00", "1-12") -> minutes (inf if unlimited)."""
    if text in ("UNLIMITED", "INFINITE", "infinite"):
        return float("inf")
    days, _, rest = text.rpartition("-")
    parts = [int(p) for p in rest.split(":")]
    if days and len(parts) == 1:  # "d-h"
        parts = [parts[0], 0, 0]
    h, m, s = ([0, 0] + parts)[-3:] if len(parts) > 1 else (0, parts[0], 0)
    return int(days or 0) * 1440 + h * 60 + m + s / 60


def test_only(script_path: str) -> str:
    """`sbatch --test-only`: Slurm's own verdict on the request, queueing nothing."""
    return call(["sbatch", "--test-only", script_path], timeout_s=30, retries=1)


def parse_fate(text: str, restart_count: int) -> Fate:
    """`scontrol show job -o` of this job as its ranks stop -> what Slurm is doing with it (pure):
    "requeued" (Restarts passed ours: an operator's `scontrol requeue`, a node failure, or a preemption
    Slurm finished requeueing), "cancelled" (scancel: CANCELLED, or COMPLETING with Restarts unchanged
    and not for the time limit), "running" (a time-limit warning, the time limit itself, or a preemption
    in its grace time: we requeue), "batch_host_lost" (a --no-kill job, one with hot spares, whose batch
    script's node failed: Slurm took that node out and ended the job, JobLaunchFailure, without requeueing
    it as it would without --no-kill; we requeue, as a failure), "unknown"."""
    fields = parse_key_values(text)
    state, restarts = fields.get("JobState"), fields.get("Restarts", "")
    if state is None or not restarts.isdigit():
        return Fate.UNKNOWN
    if int(restarts) > restart_count:
        return Fate.REQUEUED
    if fields.get("Reason") == "TimeLimit" or state == "TIMEOUT":
        return Fate.RUNNING  # the limit came during the stop: a finished job can still be requeued
    if (job := parse_allocation(text)) and batch_host_lost(job):
        return Fate.BATCH_HOST_LOST
    if state in ("CANCELLED", "COMPLETING"):
        return Fate.CANCELLED
    return Fate.RUNNING


# (timeout s, retries) of each call the job makes; the stop path's are shorter, since they run between the
# stop save and Slurm's SIGKILL (deadlines.REQUEUE_RESERVE_S adds them up). The failure path has no deadline.
FATE, REQUEUE = (10.0, 2), (10.0, 2)  # 33 s each at worst
STOP_FATE = (10.0, 0)  # 10 s: a fate that does not answer is "unknown", and the run requeues anyway
STOP_REQUEUE = (10.0, 1)  # 10 + 1 + 10 = 21 s: the one call a time-limit stop cannot do without
STOP_SNAPSHOT = (5.0, 0)  # each of an elastic run's 3 queue-snapshot calls: 15 s in all


def job_fate(job_id: str, restart_count: int, policy: tuple[float, int] = FATE) -> Fate:
    """parse_fate of the live job; "unknown" when scontrol is missing (containers) or does not answer.
    Shielded from the stop signals: a second SIGTERM killed scontrol mid-answer."""
    timeout_s, retries = policy
    try:
        text = call(["scontrol", "show", "job", "-o", job_id], timeout_s=timeout_s, retries=retries, ignore_term=True)
        return parse_fate(text, restart_count)
    except SlurmError:
        return Fate.UNKNOWN


def parse_end_time(text: str) -> tuple[float | None, bool]:
    """`scontrol show job -o` of one job -> (EndTime as Unix s, None when Slurm names none; whether Slurm
    is preempting it) (pure). EndTime follows every change of the time limit: sbatch --time-min (the limit
    the scheduler chose), --deadline, an administrator's `scontrol update TimeLimit=`. Once Slurm preempts
    the job it sets PreemptTime and moves EndTime to PreemptTime + GraceTime (on the dev cluster: 12:36:16
    + 30 s on `low`), so that EndTime is the preemption's, not the time limit's. Times are the controller's
    local time, as in parse_queue."""
    from datetime import datetime

    fields = parse_key_values(text)
    try:
        end: float | None = datetime.fromisoformat(fields.get("EndTime", "")).timestamp()
    except ValueError:  # Unknown, None: pending, or no limit
        end = None
    return end, fields.get("PreemptTime", "None") not in ("None", "Unknown", "")


def end_time(job_id: str, timeout_s: float = 3) -> tuple[float | None, bool]:
    """parse_end_time of the live job; (None, False) when scontrol is missing or does not answer. One try of
    3 s: it answers in ~10 ms, and every rank waits in a collective meanwhile, inside a stop's time left."""
    try:
        text = call(["scontrol", "show", "job", "-o", job_id], timeout_s=timeout_s, retries=0, ignore_term=True)
    except SlurmError:
        return None, False
    return parse_end_time(text)


class Allocation(NamedTuple):
    """What `scontrol show job` says of a job's nodes now (parse_allocation)."""

    state: str  # JobState: RUNNING while the job runs; COMPLETING / FAILED ... once it ends
    nodes: list[str]  # NodeList: the allocation while RUNNING; once COMPLETING only the nodes still completing
    batch_host: str  # BatchHost: where the batch script (the relay) runs
    reason: str = ""  # Reason: JobLaunchFailure once a batch script killed by a signal ended the job


def parse_allocation(text: str) -> Allocation | None:
    """`scontrol show job -o` of one job -> its Allocation (pure); None without a JobState (not a job's line)."""
    from hpc_train.env import parse_nodelist

    fields = parse_key_values(text)
    if "JobState" not in fields:
        return None
    nodelist = fields.get("NodeList", "")
    nodes = parse_nodelist(nodelist) if nodelist not in ("", "(null)") else []
    return Allocation(fields["JobState"], nodes, fields.get("BatchHost", ""), fields.get("Reason", ""))


def batch_host_lost(job: Allocation) -> bool:
    """Has a --no-kill job (hot spares) lost its batch script's node? (pure) Slurm 22.05 takes a failed node out of
    NodeList first and kills the tasks there after, so a RUNNING job without its BatchHost has lost it (ms before
    _job_complete ends it); once it ended, its script killed by a signal (FAILED, Reason JobLaunchFailure) with its
    node out of NodeList, which while COMPLETING lists the nodes still completing: a cancel or a time limit whose
    batch host finished completing first reads otherwise."""
    if not (job.batch_host and job.nodes) or job.batch_host in job.nodes:
        return False
    return job.state == "RUNNING" or (job.state != "CANCELLED" and job.reason == "JobLaunchFailure")


def allocation(job_id: str, policy: tuple[float, int] = FATE) -> Allocation | None:
    """parse_allocation of the live job; None when scontrol is missing or does not answer. A job with hot spares
    is --no-kill: once Slurm takes a failed node out of it (22.05's kill_running_job_by_node_name: "Removing
    failed node", its tasks SIGKILLed) NodeList is shorter than the SLURM_JOB_NODELIST of the batch script and
    its steps, which keep the first list. The failure path's policy: it has no deadline."""
    timeout_s, retries = policy
    try:
        text = call(["scontrol", "show", "job", "-o", job_id], timeout_s=timeout_s, retries=retries, ignore_term=True)
    except SlurmError:
        return None
    return parse_allocation(text)


def requeue(job_id: str, policy: tuple[float, int] = REQUEUE) -> str:
    """`scontrol requeue` this job (`<array>_<task>` for an array task): "" on success, else why not.
    A preempted job is being requeued by Slurm already; scontrol then refuses at once, and that is harmless.
    Shielded from the stop signals: the requeue itself has Slurm send the job SIGTERM."""
    timeout_s, retries = policy
    try:
        call(["scontrol", "requeue", job_id], timeout_s=timeout_s, retries=retries, ignore_term=True)
        return ""
    except SlurmError as e:
        return str(e)


def update_job(job_id: str, fields: dict[str, str]) -> str:
    """`scontrol update JobId=<id> Key=Value ...` for the next attempt of a job just requeued: "" on
    success, else why not. Slurm 22.05 refuses ExcNodeList and NumNodes on a running job ("Job is no longer
    pending execution"), but right after `scontrol requeue` the job is PENDING+COMPLETING and accepts them;
    it cannot start again before AuthInfo cred_expire (120 s by default) has passed."""
    if not fields:
        return ""
    # Inside the job, scontrol reads SLURM_JOB_ID and takes NumNodes as a resize of its own allocation
    # ("slurm_allocation_lookup: Job is pending execution", the update fails): ask as from outside.
    inside = {k: os.environ.pop(k) for k in ("SLURM_JOB_ID", "SLURM_JOBID") if k in os.environ}
    try:
        call(
            ["scontrol", "update", f"JobId={job_id}", *(f"{k}={v}" for k, v in fields.items())],
            timeout_s=10,
            retries=2,
            ignore_term=True,
        )
        return ""
    except SlurmError as e:
        return str(e)
    finally:
        os.environ.update(inside)


def parse_squeue_states(text: str) -> dict[str, str]:
    """`squeue -h -r -o %i|%T` -> {job id: state}. -r lists each pending array task (123_4) rather than
    one line `123_[4-7]`, so a pending task is found by its own id."""
    return dict(line.split("|", 1) for line in text.splitlines() if "|" in line)


# Slurm states of a job that is queued, running or coming back: a run in one of them is not resumed.
ACTIVE_STATES = (
    "PENDING",
    "RUNNING",
    "REQUEUED",
    "REQUEUE_HOLD",
    "REQUEUE_FED",
    "RESV_DEL_HOLD",
    "CONFIGURING",
    "COMPLETING",
    "SUSPENDED",
    "RESIZING",
    "SIGNALING",
    "STAGE_OUT",
    "STOPPED",
)


def job_states(job_ids: list[str], retries: int = 3, strict: bool = False, timeout_s: float = 30) -> dict[str, str]:
    """State per job id, the one answer every command gets (status, logs -f, resume). slurmctld first:
    squeue knows every job it holds, at once (a requeued job is PENDING there while accounting may lag the
    controller by seconds). sacct for the ids squeue no longer holds (the controller forgets a job
    MinJobAge, 300 s by default, after it ended), and for all of them when squeue cannot answer (the
    controller down: accounting still knows how they ended). An id neither knows is left out, unless
    squeue failed: then whether it is still queued is unknown, and squeue's error is raised.

    strict (resume's safety check, "may a second job start on this run?"): when squeue cannot answer,
    raise at once. Accounting records CANCELLED while the controller still shows the job COMPLETING, its
    ranks saving in KillWait; trusting it would start a second job on the same run directory."""
    ids = [j for j in job_ids if j]
    if not ids:
        return {}
    listed: dict[str, str] = {}
    unanswered: SlurmError | None = None
    try:
        squeue = ["squeue", "-h", "-r", "-j", ",".join(ids), "-o", "%i|%T"]
        listed = parse_squeue_states(call(squeue, timeout_s, retries))
    except SlurmError as e:
        if "invalid job id" not in str(e).lower():  # squeue's answer for a job it no longer holds
            if strict:
                raise
            unanswered = e
    out: dict[str, str] = {}
    for j in ids:  # an array's own id: the state of any task it still holds
        state = listed.get(j) or next((s for k, s in listed.items() if k.startswith(f"{j}_")), "")
        if state:
            out[j] = state
    missing = [j for j in ids if j not in out]
    if missing:
        sacct = ["sacct", "-X", "-n", "-P", "-j", ",".join(missing), "-o", "JobID,State"]
        found = parse_sacct_states(call(sacct, timeout_s, retries), missing)
        out.update(found if unanswered else {j: unqueued(s) for j, s in found.items()})
    if unanswered and any(j not in out for j in ids):
        raise unanswered
    return out


# Accounting's word for a job the controller no longer holds, where it says the job waits: stale. Requeued and
# cancelled within a second (22.05), accounting keeps the old run's REQUEUED and never records the cancel of the
# pending one (reproduced on the dev cluster: `scontrol requeue J; scancel J`); nothing else ends a pending job.
NEVER_STARTED = ("PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED")


def unqueued(state: str) -> str:
    """sacct's state of a job squeue answered for and no longer holds (pure): a waiting one was cancelled."""
    return "CANCELLED" if state in NEVER_STARTED else state


def parse_sacct_states(text: str, job_ids: list[str]) -> dict[str, str]:
    """`sacct -X -n -P -o JobID,State` -> {job id: state} for these ids; "CANCELLED by 1000" is CANCELLED."""
    out = {}
    for line in text.splitlines():
        job, _, state = line.partition("|")
        if job in job_ids and state.split():
            out[job] = state.split()[0]
    return out


ACCOUNTING_FIELDS = "JobID,State,Partition,NNodes,ElapsedRaw,Submit,Start,End"


def accounting_args(
    since_s: float,
    *,
    partition: str = "",
    nodes: tuple[int, int] | None = None,
    account: str = "",
    all_users: bool = False,
) -> list[str]:
    """`sacct -X -P -n --duplicates` of the jobs since `since_s` (Unix s) until now: one record per run of a job, a
    requeued one included (--duplicates: without it 22.05 prints only a job's last run), fields ACCOUNTING_FIELDS;
    on `partition`, of min-max `nodes`, in `account`; this user's jobs unless all_users (-a: another user's show only
    where slurmdbd's PrivateData allows). The same arguments for the same facts: prefetch matches them."""
    import getpass

    start = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(since_s))  # sacct reads the local time
    args = ["sacct", "-X", "-P", "-n", "--duplicates", "-S", start, "-E", "now", "-o", ACCOUNTING_FIELDS]
    args += ["-a"] if all_users else ["-u", getpass.getuser()]
    args += [f"--partition={partition}"] if partition else []
    args += [f"--accounts={account}"] if account else []
    args += [f"--nnodes={nodes[0]}-{nodes[1]}"] if nodes else []
    return args


def accounting(
    since_s: float,
    *,
    partition: str = "",
    nodes: tuple[int, int] | None = None,
    account: str = "",
    all_users: bool = False,
    timeout_s: float = 10,
) -> str:
    """accounting_args' sacct, one try (history.site_rates: no answer means journals only, not a wait); a submit
    started it ahead (prefetch), beside its other Slurm calls."""
    args = accounting_args(since_s, partition=partition, nodes=nodes, account=account, all_users=all_users)
    return call(args, timeout_s=timeout_s, retries=0)


def jobs_named(job_name: str) -> set[str]:
    """Ids (an array's base id) of this user's jobs of that name, queued or run in 7 days, not cancelled."""
    out = call(["sacct", "-X", "-n", "-P", "--name", job_name, "-o", "JobID,State", "-S", "now-7days"])
    ids = [line.split("|")[0] for line in out.splitlines() if line and "CANCELLED" not in line]
    ids += call(["squeue", "-h", "--name", job_name, "-o", "%F"]).split()
    return {i.split("_")[0] for i in ids}


def queued_tasks(job_name: str) -> dict[str, float]:
    """Tasks Slurm still holds (pending, running, requeued...) by id, with their start time (now for
    pending ones); one line per array task (-r), so `7_[2-5]` is never left unexpanded."""
    from datetime import datetime

    out: dict[str, float] = {}
    for line in call(["squeue", "-h", "-r", "--name", job_name, "-o", "%i|%S"]).splitlines():
        task, _, start = line.partition("|")
        try:
            out[task] = datetime.fromisoformat(start).timestamp()
        except ValueError:  # N/A: not started
            out[task] = time.time()
    return out


def scancel(job_ids: list[str], signal_name: str = "", batch_only: bool = False) -> None:
    """`scancel` these jobs; with signal_name (USR2, TERM) only signal them, as Slurm's time-limit warning
    or a preemption would; batch_only: the batch shell alone (--batch), as an operator's signal."""
    call(
        [
            "scancel",
            *([f"--signal={signal_name}"] if signal_name else []),
            *(["--batch"] if batch_only else []),
            *job_ids,
        ]
    )


def allocation_id(job_id: str) -> str:
    """The numeric id of a job's allocation (an array task `123_4` has its own, squeue's %A), for srun
    --jobid; "" when squeue lists nothing for it."""
    ids = call(["squeue", "-h", "-j", job_id, "-o", "%A"]).split()
    return ids[0] if ids else ""


def kill(allocation: str, node: str, pids: list[int]) -> None:
    """SIGKILL processes of a running job on one node through srun into its allocation, so it reaches a
    real cluster's compute node too; one try, of at most 60 s. One step for all of them: the first SIGKILL
    fails the job, whose requeue revokes the credential a second srun would need (on loaded cores it came
    first: "Task launch ... failed on node node2: Job credential revoked")."""
    call(
        ["srun", "--overlap", f"--jobid={allocation}", "-w", node, "-N1", "-n1", "kill", "-KILL", *map(str, pids)],
        timeout_s=60,
        retries=0,
    )


def slurm_env(slurm_conf: str | None) -> None:
    if slurm_conf:
        os.environ["SLURM_CONF"] = slurm_conf


def parse_queue(text: str) -> list[dict[str, Any]]:
    """`squeue -h -o %i|%T|%e|%N|%x` -> [{"id", "state", "end" (Unix s; None for N/A, NONE, Unknown),
    "nodes", "excluded"}], node lists expanded. End times are the controller's local time."""
    from datetime import datetime

    from hpc_train.env import parse_nodelist

    jobs = []
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) != 5:
            continue
        job, state, end, nodes, excluded = parts
        try:
            end_s: float | None = datetime.fromisoformat(end).timestamp()
        except ValueError:
            end_s = None
        jobs.append(
            {
                "id": job,
                "state": state,
                "end": end_s,
                "nodes": parse_nodelist(nodes) if nodes and nodes != "(null)" else [],
                "excluded": parse_nodelist(excluded) if excluded and excluded != "(null)" else [],
            }
        )
    return jobs


def node_states(partition: str, policy: tuple[float, int] = (10.0, 1)) -> dict[str, str]:
    """The partition's nodes -> sinfo's short state ("idle", "mix", "drain", "down*", ...), from inside the job."""
    timeout_s, retries = policy
    return dict(
        line.split("|", 1)
        for line in call(
            ["sinfo", "-h", "-N", "-p", partition, "-o", "%N|%t"],
            timeout_s=timeout_s,
            retries=retries,
            ignore_term=True,
        ).split()
        if "|" in line
    )


# scontrol's node State flags as sinfo's short states (preempt.UNUSABLE); the first that applies wins.
SHORT_FLAGS = (
    ("DRAIN", "drain"),
    ("COMPLETING", "comp"),
    ("MAINTENANCE", "maint"),
    ("RESERVED", "resv"),
    ("REBOOT", "boot"),
    ("POWER", "pow"),
    ("INVALID_REG", "inval"),
    ("PLANNED", "plnd"),
)


def short_state(state: str) -> str:
    """`scontrol show node` State (IDLE, MIXED+DRAIN, IDLE+NOT_RESPONDING, ...) in sinfo's short form (idle,
    drng, idle*, ...). Not sinfo's own %t: on the dev cluster it said "mix" for 30 s after a drained node's
    resume while scontrol said State=IDLE CPUAlloc=0, and Slurm started the requeued job on that node."""
    base, *flags = state.split("+")
    short = {"IDLE": "idle", "MIXED": "mix", "ALLOCATED": "alloc", "DOWN": "down", "FUTURE": "futr"}.get(base, "unk")
    for flag, name in SHORT_FLAGS:
        if any(f.startswith(flag) for f in flags):
            short = "drng" if name == "drain" and base in ("MIXED", "ALLOCATED") else name
            break
    return short + ("*" if "NOT_RESPONDING" in flags else "")


def queue_snapshot(
    partition: str, job_id: str, policy: tuple[float, int] = (10.0, 1)
) -> tuple[dict[str, str], list[dict[str, Any]]]:
    """(the partition's nodes and their short states, from the controller's own node records; running jobs,
    any partition, holding its nodes, and job `job_id` with what it excludes) for preempt.full_size_wait_s.
    Node lists keep only the partition's nodes. Three calls, each under `policy` (timeout s, retries)."""
    timeout_s, retries = policy
    states = {}
    for line in call(
        ["scontrol", "show", "node", "-o"], timeout_s=timeout_s, retries=retries, ignore_term=True
    ).splitlines():
        node = parse_key_values(line)
        if "NodeName" in node and partition in node.get("Partitions", "").split(","):
            states[node["NodeName"]] = short_state(node.get("State", ""))
    form = ["-o", "%i|%T|%e|%N|%x"]
    jobs = parse_queue(
        call(["squeue", "-h", "-t", "R", *form], timeout_s=timeout_s, retries=retries, ignore_term=True)
        + call(["squeue", "-h", "-j", job_id, *form], timeout_s=timeout_s, retries=retries, ignore_term=True)
    )
    for j in jobs:
        j["nodes"] = [n for n in j["nodes"] if n in states]
    return states, jobs


def proctrack_type(environ: Mapping[str, str]) -> str:
    """slurm.conf's ProctrackType ("proctrack/cgroup", ...), read from the file this node's Slurm reads (SLURM_CONF,
    a configless node's /run/slurm/conf, /etc/slurm); "" when none says."""
    paths = [environ.get("SLURM_CONF", ""), "/run/slurm/conf/slurm.conf", "/etc/slurm/slurm.conf"]
    for path in filter(None, paths):
        try:
            # an administrator's comment in Latin-1 is no reason to fail a stop (read at a stop signal)
            with open(path, encoding="utf-8", errors="replace") as f:
                for line in f:
                    key, _, value = line.partition("=")
                    if key.strip().lower() == "proctracktype":
                        return value.split("#")[0].strip()
        except OSError:
            continue
        return ""
    return ""
