"""cluster.in_process_restart: the warm standbys on the spares, the deciding rank's plan for the ranks that
survived a failure, and their rejoin in the same processes (a new rendezvous, the memory tier's copies)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hpc_train import deadlines, journal, leave, ranklog, rendezvous, verdict
from hpc_train.paths import RunPaths, hold_for_life, holder_gone, make_dir, untrusted, write_atomic
from hpc_train.task import Pulse, Task
from hpc_train.verdict import Verdict

log = logging.getLogger(__name__)


def split_standby(env: Any, cfg: Any) -> tuple[Any, bool]:
    """cluster.in_process_restart: the step spans the spares too (sbatch renders it so, a relaunch too);
    its first cluster.nodes nodes train, every task beyond them is a warm standby. (the training env, standby?)"""
    lws = env.local_world_size
    if not (cfg.cluster.in_process_restart and env.executor == "slurm" and os.environ.get("HPC_TRAIN_STEP_ARGS")):
        return env, False
    n = min(cfg.cluster.nodes, env.num_nodes)
    if n == env.num_nodes:  # a step gone on smaller (cluster.min_nodes): no spare left, no standby
        return env, False
    train = dataclasses.replace(env, world_size=n * lws, num_nodes=n, nodes=env.nodes[:n])
    return train, env.rank >= n * lws


def warm_up() -> None:
    """What a standby's first attempt would otherwise import on the clock: torch.optim's first optimizer imports
    torch._dynamo (2.9 s of a 4 s in-process restart here, before this), its first step the fused kernels."""
    import torch

    layer = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(layer.parameters())
    layer(torch.ones(1, 2)).sum().backward()
    optimizer.step()


def read_rejoin_plan(paths: RunPaths, job_id: str, said: set[str] | None = None) -> dict[str, Any] | None:
    """The plan for the next attempt in these processes, or None: none, not a plan, or one that may not be this
    user's alone (a symlink; a file or folder another user owns or can write: the hosts it names would be joined,
    and the new group's broadcast_object_list unpickles their bytes), which is said (once, given the `said` so far:
    a standby's poll reads every 20 ms)."""
    where = paths.rejoin_plan(job_id)
    try:
        # NFS: opening the folder revalidates it (close-to-open); else a standby's negative lookup of the plan (its
        # reads before it existed) or a survivor's of the previous plan stays cached up to acdirmax (60 s)
        os.listdir(paths.run_dir)
        text = where.read_text()
        why = f"{where} is a symlink; remove it" if where.is_symlink() else untrusted(where, paths.run_dir)
    except OSError:
        return None
    if why:
        if said is None or why not in said:
            if said is not None:
                said.add(why)
            log.warning(f"not rejoining by {where}: {why}")
        return None
    try:
        plan = json.loads(text)
    except ValueError:
        return None
    numbered = isinstance(plan, dict) and all(type(plan.get(k)) is int for k in ("from", "attempt"))
    return plan if numbered else None


def rejoin_plan_or_leave(paths: RunPaths, job_id: str, task: Task) -> dict[str, Any]:
    """The plan a `rejoin` verdict names; gone or refused between the verdict and this read (read_rejoin_plan says
    why), this rank leaves as a failed one: with no plan, Attempt.build ran on the destroyed group, failed, and the
    same verdict came again, a busy loop until the 900 s watchdog."""
    plan = read_rejoin_plan(paths, job_id)
    if plan is None:
        log.warning(f"no rejoin plan to read in {paths.rejoin_plan(job_id)}: leaving")
        verdict.leave(task, Verdict.STOP, 0.0)
    return plan


def standby_wait(paths: RunPaths, env: Any, pulse: Pulse) -> dict[str, Any]:
    """A standby's wait, warm: every 20 ms for a plan that names its Slurm task (then it returns it), every
    second for the step's end (step_left: it exits 0, so the step's status is the training ranks')."""
    procid, node = os.environ.get("SLURM_PROCID", "0"), os.environ.get("SLURMD_NODENAME", "")
    mine = paths.standbys(env.job_id) / procid
    make_dir(mine.parent, exist_ok=True)
    write_atomic(mine, node)
    held = hold_for_life(mine)  # freed by its death: plan_rejoin counts live standbys only
    log.info(f"task {procid} on {node}: warm standby (cluster.in_process_restart)")
    check, confirmed = 0.0, env.restart_count  # the newest plan's attempt whose verdict is on record
    said: set[str] = set()  # read_rejoin_plan's refusals said so far
    while True:
        plan = read_rejoin_plan(paths, env.job_id, said)
        # Only a plan whose in-process verdict is on record (its deciding rank may die between the two writes, and
        # the survivors then leave): the journal is read while a newer plan waits for it, ms in the normal case.
        if plan and plan["attempt"] > confirmed:
            if journal.rejoins(journal.verdict(journal.read(paths.run_dir), plan["from"])):
                confirmed = plan["attempt"]
        if plan and plan["attempt"] == confirmed > env.restart_count and procid in plan.get("standby", {}):
            mine.unlink(missing_ok=True)
            if held is not None:
                os.close(held)
            return plan
        if time.monotonic() >= check:
            check = time.monotonic() + 1.0
            if why := step_left(paths, env, plan if plan and plan["attempt"] == confirmed else None, pulse):
                log.info(f"task {procid} on {node}: standby leaves: {why}")
                mine.unlink(missing_ok=True)
                leave.process(0)
        time.sleep(0.02)


def step_left(paths: RunPaths, env: Any, plan: dict[str, Any] | None, pulse: Pulse) -> str:
    """Why a standby's training step is over, "" while it is not: a stop signal srun forwarded (the training ranks
    decide; nothing rejoins after one), the step's verdict on record (journal.step_over), or every training rank of
    the step's current attempt (the newest plan's, else the standby's own) gone without one (their paths.alive locks
    free: the deciding rank died, its verdict wait ran out, the user's function called sys.exit). Without the last
    two the standby alone kept srun's step, and the job, to its time limit. A rank not yet placed has no lock file:
    not gone (holder_gone), so a step still starting is not taken for over."""
    if pulse.received:
        return f"{pulse.received[0]} received"
    if journal.step_over(journal.read(paths.run_dir), env.restart_count):
        return "the step's verdict is on record"
    newer = plan is not None and plan.get("attempt", -1) > env.restart_count
    attempt, world = (plan["attempt"], plan["world_size"]) if plan and newer else (env.restart_count, env.world_size)
    locks = paths.alive(env.job_id, attempt)
    if all(holder_gone(locks / str(r)) for r in range(world)):
        return f"all {world} training ranks of attempt {attempt} are gone without a verdict"
    return ""


def _survivors(paths: RunPaths, env: Any) -> set[int]:
    """The ranks that said they survived (their heartbeat counts), once every other rank is known dead (its lock of
    paths.alive free) or deadlines.REJOIN_SETTLE_S passed: a rank silent by then is taken for dead."""
    hangs = paths.run_dir / f".hang-{env.job_id}-{env.restart_count}"
    locks, until = paths.alive(env.job_id, env.restart_count), time.monotonic() + deadlines.REJOIN_SETTLE_S
    while True:
        alive = {int(p.name) for p in hangs.iterdir() if p.name.isdigit()} if hangs.is_dir() else set()
        alive.add(env.rank)  # this one decides, so lives, though its heartbeat write failed (a full disk)
        gone = {r for r in set(range(env.world_size)) - alive if holder_gone(locks / str(r))}
        if len(alive | gone) >= env.world_size or time.monotonic() >= until:
            return alive
        time.sleep(0.01)


def _live_standbys(paths: RunPaths, job_id: str) -> dict[str, list[str]]:
    """{node: its standbys' Slurm task ids} of the standbys alive now (their registration's lock held)."""
    standbys: dict[str, list[str]] = {}
    for p in paths.standbys(job_id).iterdir() if paths.standbys(job_id).is_dir() else []:
        # A standby that died waiting (the relay's SIGKILL), or one of this job id's allocation before a Slurm
        # requeue: counted, the survivors waited train.rendezvous_timeout_s for it and the step relaunched.
        if holder_gone(p):
            continue
        try:
            standbys.setdefault(p.read_text().strip(), []).append(p.name)
        except OSError:
            continue
    return standbys


def plan_rejoin(
    paths: RunPaths,
    env: Any,
    events: list[dict[str, Any]],
    sick: dict[str, str],
    used: int,
    reason: str,
    record: Callable[..., None],
    hang: bool = False,
) -> bool:
    """The deciding rank, once an in-job restart is decided (cluster.in_process_restart): can the ranks that
    survived rejoin in their processes, each dead node replaced by a standby's? True once the plan is written
    (paths.rejoin_plan) and recorded (`in_job_restart`, in_process); False (said why): the step is relaunched.
    hang: the watchdog fired, every rank leaves its process (watchdog.start), so none rejoins."""
    from hpc_train.env import rendezvous_port

    per = env.local_world_size
    alive = _survivors(paths, env)
    dead_nodes = sorted({r // per for r in set(range(env.world_size)) - alive})
    standbys = _live_standbys(paths, env.job_id)
    free = [n for n, tasks in sorted(standbys.items()) if len(tasks) == per and n not in env.nodes]
    mixed = [env.nodes[n] for n in dead_nodes if any(n * per + i in alive for i in range(per))]
    trained = journal.trained(events, env.restart_count)
    # A blamed node whose ranks all died (a node failure Slurm took out of the job, requeue.lost_nodes) is replaced
    # like any dead node, and left out (recorded) so that no later relaunch of this allocation lands on it.
    gone_nodes = {env.nodes[n] for n in dead_nodes} - set(mixed)
    blamed = [n for n in sick if n not in gone_nodes]
    why = (
        # Every rank blocked together (a deadlock, a storage stall) blames no node, yet the watchdog's rank exits
        # and the others' wait ends with no rank to rejoin: the plan was held until the time limit.
        "a hang (train.watchdog_s): its ranks leave their processes"
        if hang
        else f"a node was blamed ({', '.join(blamed)}): it is left out by a relaunch"
        if blamed
        else "this attempt failed before its first step (while rejoining?)"
        if not trained
        else f"ranks on {', '.join(mixed)} survived beside the dead: a standby replaces whole nodes"
        if mixed
        else f"{len(dead_nodes)} node(s) lost, {len(free)} warm standby node(s) left"
        if len(free) < len(dead_nodes)
        else ""
    )
    if why:
        log.warning(f"not restarting in process: {why}; relaunching the step")
        return False
    nodes, standby = list(env.nodes), {}
    for n, node in zip(dead_nodes, free):
        nodes[n] = node
        for i, task in enumerate(sorted(standbys[node], key=int)):  # block distribution: task order = local id
            standby[task] = n * per + i
    attempt = env.restart_count + 1
    plan = {"from": env.restart_count, "attempt": attempt, "world_size": env.world_size, "nodes": nodes}
    plan |= {"master_port": rendezvous_port(env.job_id, attempt), "survivors": sorted(alive), "standby": standby}
    try:
        write_atomic(paths.rejoin_plan(env.job_id), json.dumps(plan | {"at": time.time()}) + "\n")
    except OSError as e:
        log.warning(f"could not write the rejoin plan ({e}): relaunching the step")
        return False
    replaced = {env.nodes[n]: nodes[n] for n in dead_nodes}
    for node, because in sick.items():
        record(journal.NODE_EXCLUDED, node=node, why=because)
    record(
        journal.IN_JOB_RESTART,
        reason=reason,
        in_process=True,
        replaced=replaced,
        left_out=sorted(sick),
        nodes_next=len(nodes),
        spares_left=len(free) - len(dead_nodes),
        in_job_restarts=used + 1,
    )
    swaps = ", ".join(f"{a} by the standby on {b}" for a, b in replaced.items()) or "no node lost"
    log.warning(f"restarting in process ({swaps}): the ranks that survived rejoin")
    return True


def drop_group(env: Any, paths: RunPaths | None = None, ticks: int = 0) -> None:
    """A failed rank that will rejoin: cut its connections to the job's nodes (gloo's and the old store's), so a
    peer blocked on this rank fails now too, write its heartbeat count (with `paths`: before the teardown, which
    can take longer than the deciding rank's deadlines.REJOIN_SETTLE_S, 2 s, and a live rank silent that long is
    taken for dead), then destroy its process groups. destroy_process_group (and
    ProcessGroupGloo.abort) close gloo's sockets only with the group's last reference, and the exception's traceback
    still holds one (frames -> model -> DDP -> group): a peer blocked in recv failed only when this process exited
    (torch 2.13), and with 2 ranks per node a survivor was silent for deadlines.REJOIN_SETTLE_S and taken for dead.
    No gc.collect(): 0.5 s of a loaded core here; the old model goes with the exception."""
    import torch.distributed as dist

    cut_connections({*env.nodes, env.master_addr})
    if paths is not None:
        write_heartbeats(paths, env, ticks)
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception as e:  # a group a failure left half torn down: the new one does not need it
        log.warning(f"destroying the failed process group: {type(e).__name__}: {e}")


def cut_connections(hosts: set[str]) -> None:
    """shutdown(2) every TCP connection of this process to one of `hosts` (its fds stay open, for their owners to
    close): the peer reads EOF at once. Only the job's nodes by their names: a tracker's or Prometheus' connections
    elsewhere are left alone (gloo on an interface other than the names' would be too: the watchdog then)."""
    import socket

    addresses = set()
    for host in hosts:
        try:
            addresses |= {str(a[4][0]) for a in socket.getaddrinfo(host, None)}
        except OSError:
            continue
    for name in os.listdir("/proc/self/fd"):
        try:
            sock = socket.socket(fileno=os.dup(int(name)))  # a dup: closing it leaves the fd to its owner
        except (OSError, ValueError):
            continue
        try:
            if sock.type == socket.SOCK_STREAM and sock.family in (socket.AF_INET, socket.AF_INET6):
                if str(sock.getpeername()[0]).removeprefix("::ffff:") in addresses:
                    sock.shutdown(socket.SHUT_RDWR)
        except OSError:  # not connected (a listening socket), or already shut
            pass
        finally:
            sock.close()


def join(
    paths: RunPaths, cfg: Any, plan: dict[str, Any], env: Any, task: Task, standby: bool = False
) -> tuple[Any, float, dict[str, float]]:
    """Join the plan's attempt in this process: a survivor under its rank, a standby under the dead rank it
    replaces; rendezvous.join on the plan's nodes and port. Returns (placed env, the attempt's
    start: the plan's time, its phases)."""
    rank = plan["standby"][os.environ.get("SLURM_PROCID", "")] if standby else env.rank
    nodes, per = tuple(plan["nodes"]), env.local_world_size
    env = dataclasses.replace(
        env,
        rank=rank,
        local_rank=rank % per,
        world_size=plan["world_size"],
        node_rank=rank // per,
        num_nodes=len(nodes),
        nodes=nodes,
        master_addr=nodes[0],
        master_port=plan["master_port"],
        restart_count=plan["attempt"],
    )
    os.environ["HPC_TRAIN_ATTEMPT"] = str(env.restart_count)
    task.deciding = False  # this attempt's failure, if any, is decided afresh
    # Heartbeats from 1 on every rank, as a first attempt's (_start_watchdog's beat): a survivor kept the failed
    # attempt's count (5000 against the standby's 12: a later hang was blamed on the standby's node). The beat
    # also restarts a survivor's watchdog clock.
    task.pulse.ticks = 0
    task.pulse.beat()
    ranklog.header(env.restart_count, env.rank)
    task.placed = env  # a failure in the rendezvous is this attempt's (not yet trained: plan_rejoin relaunches)
    placed = rendezvous.join(env, cfg, paths, task, keep_order=True)
    return placed, float(plan["at"]), {"rejoin": time.time() - float(plan["at"])}


def write_heartbeats(paths: RunPaths, env: Any, ticks: int) -> Path:
    """This failing rank's heartbeat count, in the attempt's folder of them (returned): a hang's blame
    (failure.hung_nodes) and, with cluster.in_process_restart, its word that it lives (plan_rejoin)."""
    hangs = paths.run_dir / f".hang-{env.job_id}-{env.restart_count}"
    try:
        make_dir(hangs, exist_ok=True)
        write_atomic(hangs / str(env.rank), str(ticks))
    except OSError:
        pass  # the deciding rank counts itself; another is then taken for dead after deadlines.REJOIN_SETTLE_S
    return hangs
