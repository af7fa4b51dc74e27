"""A real four-node Slurm 22.05 cluster on this one machine, owned by the test suite.

    python tests/cluster.py up        # ~4 s: munge, MariaDB, slurmdbd, slurmctld, accounts (1.6 s), 4 x slurmd
    python tests/cluster.py status    # daemons alive? prints `sinfo`
    python tests/cluster.py down      # stops exactly what `up` started (its pidfiles; munged once no cluster uses it)
    eval "$(python tests/cluster.py env)"   # export SLURM_CONF for sbatch/squeue/sacct by hand

Everything lives under $HPC_TRAIN_CLUSTER_DIR (default /tmp/hpc_train_cluster): etc/, log/, run/,
spool/, db/. Every daemon listens on 127.0.0.1 only. Each slurmd runs in its own UTS + mount namespace
with hostname nodeN and a bind-mounted hosts file (node1..node4 -> 127.0.0.1), so inside a job
`hostname` and MASTER_ADDR=node1 behave as on a real cluster.

Topology: two leaf switches under one root that *interleave* node names (s1 = node1,node3;
s2 = node2,node4), so that name order is not topology order.
Partitions: debug (default, never preempted), low (preemptible by requeue, GraceTime), high.
Accounting as on a real site: AccountingStorageEnforce=associations,qos; the user who ran `up` has
accounts research (default) and teamb, each allowing QoS normal (default) and long; an unknown account
or QoS is refused by Slurm. Node features: node1,node2 have cpu,fast; node3,node4 have cpu.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

CLUSTER_DIR = Path(os.environ.get("HPC_TRAIN_CLUSTER_DIR", "/tmp/hpc_train_cluster"))
NODES = ["node1", "node2", "node3", "node4"]
CPUS_PER_NODE = 4  # advertised through config_overrides; this machine has 2 cores
# HPC_TRAIN_CLUSTER_PORT_OFFSET=100 (with its own HPC_TRAIN_CLUSTER_DIR) runs a second cluster beside the
# first: every port moves by the offset and job ids start at 1 + 10 x offset, so two clusters' jobs never
# share a rendezvous port (env.rendezvous_port hashes job id and attempt). munged is shared.
PORT_OFFSET = int(os.environ.get("HPC_TRAIN_CLUSTER_PORT_OFFSET") or 0)
CTLD_PORT, DBD_PORT, DB_PORT, SLURMD_PORT0 = (p + PORT_OFFSET for p in (16817, 16819, 16306, 17001))
LOW_GRACE_S = 30  # SIGTERM at preemption, SIGKILL this much later
DAEMON_PIDFILES = ["slurmctld", "slurmdbd", "mariadb"] + [f"slurmd-{n}" for n in NODES]
ACCOUNTS = ["research", "teamb"]  # the first is the user's default
QOS = ["normal", "long"]  # normal: slurmdbd's own, every association's default
FAST_NODES = ["node1", "node2"]  # Features=cpu,fast (the others: cpu)


def paths(root: Path = CLUSTER_DIR) -> dict[str, Path]:
    return {k: root / k for k in ("etc", "log", "run", "spool", "db")}


def slurm_conf_text(
    root: Path, max_array_size: int = 1001, ctld_parameters: str = "", max_job_count: int | None = None
) -> str:
    """max_job_count: None keeps Slurm's 10,000, which counts every array task (and each cancelled one for
    MinJobAge=300 s): benchmarks/submit_bench.py's 100,000-point sweep needs more."""
    p = paths(root)
    extra = f"SlurmctldParameters={ctld_parameters}\n" if ctld_parameters else ""
    extra += f"MaxJobCount={max_job_count}\n" if max_job_count else ""
    return (
        extra
        + f"""\
ClusterName=hpcdev
FirstJobId={1 + 10 * PORT_OFFSET}
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={CTLD_PORT}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CryptoType=crypto/munge
# A requeued job may only restart after cred_expire; the default 120 s makes every resume test slow.
AuthInfo=cred_expire=10
StateSaveLocation={p["spool"]}/ctld
SlurmdSpoolDir={p["spool"]}/%n
SlurmctldPidFile={p["run"]}/slurmctld.pid
SlurmdPidFile={p["run"]}/slurmd-%n.pid
SlurmctldLogFile={p["log"]}/slurmctld.log
SlurmdLogFile={p["log"]}/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0,sched_interval=5,bf_interval=5
KillWait=10
MinJobAge=300
MaxArraySize={max_array_size}
SlurmdParameters=config_overrides
CommunicationParameters=NoInAddrAny
TopologyPlugin=topology/tree
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort={DBD_PORT}
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
# A job's account and QoS must be an association of its user (sacctmgr): as on a real site, so a wrong
# cluster.account or cluster.qos is refused by Slurm too, not only by hpc-train's own check.
AccountingStorageEnforce=associations,qos
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
NodeName=node[1-2] NodeAddr=127.0.0.1 NodeHostname=node[1-2] Port=[{SLURMD_PORT0}-{SLURMD_PORT0 + 1}] \
CPUs={CPUS_PER_NODE} RealMemory=4000 Features=cpu,fast State=UNKNOWN
NodeName=node[3-4] NodeAddr=127.0.0.1 NodeHostname=node[3-4] Port=[{SLURMD_PORT0 + 2}-{SLURMD_PORT0 + 3}] \
CPUs={CPUS_PER_NODE} RealMemory=4000 Features=cpu State=UNKNOWN
PartitionName=debug Nodes=node[1-4] Default=YES MaxTime=60 State=UP PriorityTier=1 PreemptMode=OFF
PartitionName=low Nodes=node[1-4] MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=REQUEUE GraceTime={LOW_GRACE_S}
PartitionName=high Nodes=node[1-4] MaxTime=INFINITE State=UP PriorityTier=10 PreemptMode=OFF
"""
    )


TOPOLOGY_CONF = """\
SwitchName=s1 Nodes=node1,node3
SwitchName=s2 Nodes=node2,node4
SwitchName=root Switches=s1,s2
"""


def slurmdbd_conf_text(root: Path) -> str:
    p = paths(root)
    return f"""\
AuthType=auth/munge
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort={DBD_PORT}
SlurmUser=root
LogFile={p["log"]}/slurmdbd.log
PidFile={p["run"]}/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort={DB_PORT}
StorageUser=slurm
StoragePass=slurm
StorageLoc=slurm_acct_db
"""


def client_env(root: Path = CLUSTER_DIR) -> dict[str, str]:
    """Environment for Slurm client calls: without SLURM_CONF they try a DNS SRV lookup."""
    return {**os.environ, "SLURM_CONF": str(paths(root)["etc"] / "slurm.conf")}


def _run(cmd: list[str], root: Path, timeout_s: float = 30, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=client_env(root), capture_output=True, text=True, timeout=timeout_s, check=check)


def _read_pid(pidfile: Path) -> int | None:
    """The pid in a pidfile if that process is alive *and* is the daemon the file is named after.

    After a machine restart a stale pidfile may name a recycled pid; we never signal a stranger.
    """
    try:
        pid = int(pidfile.read_text().split()[0])
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (OSError, ValueError, IndexError):
        return None
    comm, state = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2]
    if state in "ZX":  # a zombie is dead; it waits only for a parent that may never reap it
        return None
    daemon = pidfile.stem.split("-")[0]  # slurmd-node1.pid -> slurmd
    expected = {"mariadb": "mariadbd"}.get(daemon, daemon)
    return pid if comm.startswith(expected[:15]) else None  # comm is cut at 15 characters


def _wait_for(what: str, ok, timeout_s: float, root: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ok():
            return
        time.sleep(0.1)
    raise RuntimeError(f"cluster up: {what} not ready after {timeout_s:.0f} s; see logs in {paths(root)['log']}")


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _munge_ok() -> bool:
    enc = subprocess.run(["munge", "-n"], capture_output=True, timeout=10)
    if enc.returncode != 0:
        return False
    return subprocess.run(["unmunge"], input=enc.stdout, capture_output=True, timeout=10).returncode == 0


# munged is one per machine, shared by every cluster on it (the test suite's xdist workers each run one, side
# by side): each `up` adds its cluster dir to MUNGE_USERS, each `down` takes it out, under one lock, and the last
# one out stops munged if one of them started it (MUNGE_STARTED). Before, the first cluster down took munged with
# it, and every other cluster's jobs failed to authenticate.
MUNGE_RUN = Path("/run/munge")
MUNGE_USERS, MUNGE_STARTED = MUNGE_RUN / "hpc_train.users", MUNGE_RUN / "munged-hpc_train.pid"


@contextlib.contextmanager
def _munge_lock() -> Iterator[set[str]]:
    """The cluster dirs using munged, under an exclusive lock; what the caller leaves in the set is saved."""
    with open(MUNGE_RUN / "hpc_train.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        users = set(MUNGE_USERS.read_text().split()) if MUNGE_USERS.exists() else set()
        yield users
        MUNGE_USERS.write_text("".join(f"{u}\n" for u in sorted(users)))


def _start_munge(root: Path) -> None:
    """Start munged only if none answers (remember that we did, so only ours is ever stopped); count this
    cluster among its users."""
    MUNGE_RUN.mkdir(parents=True, exist_ok=True)
    with _munge_lock() as users:
        if not _munge_ok():
            shutil.chown(MUNGE_RUN, "munge", "munge")
            subprocess.run(["runuser", "-u", "munge", "--", "/usr/sbin/munged"], check=True, timeout=30)
            _wait_for("munged", _munge_ok, 10, root)
            pid = _read_pid(MUNGE_RUN / "munged.pid")
            if pid is not None:
                MUNGE_STARTED.write_text(f"{pid}\n")
        users.add(str(root))


def _stop_munge(root: Path) -> None:
    """This cluster no longer uses munged; stop it if no other cluster does and one of ours started it."""
    if not MUNGE_RUN.exists():
        return
    with _munge_lock() as users:
        users.discard(str(root))
        pid = None if users else _read_pid(MUNGE_STARTED)
        if pid is not None:
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline and _read_pid(MUNGE_STARTED) == pid:
                time.sleep(0.05)
        if not users:
            MUNGE_STARTED.unlink(missing_ok=True)


def _start_mariadb(root: Path) -> None:
    p = paths(root)
    sock = p["run"] / "mariadb.sock"
    install = [
        "mariadb-install-db",
        "--no-defaults",
        f"--datadir={p['db']}",
        "--user=root",
        "--auth-root-authentication-method=socket",
        "--skip-test-db",
    ]
    for tries_left in (1, 0):  # it exited 1 once in 4 at a suite's start (4 clusters, 2 busy cores): once more
        done = subprocess.run(install, capture_output=True, text=True, timeout=120)
        if done.returncode == 0:
            break
        if not tries_left:
            raise RuntimeError(f"mariadb-install-db exited {done.returncode}: {(done.stdout + done.stderr)[-1500:]}")
        shutil.rmtree(p["db"], ignore_errors=True)
        p["db"].mkdir(parents=True)
    with open(p["log"] / "mariadb.log", "ab") as log:
        subprocess.Popen(
            [
                "mariadbd",
                "--no-defaults",
                f"--datadir={p['db']}",
                f"--socket={sock}",
                f"--port={DB_PORT}",
                "--bind-address=127.0.0.1",
                "--skip-name-resolve",
                f"--pid-file={p['run']}/mariadb.pid",
                "--user=root",
                "--innodb-buffer-pool-size=32M",
                "--skip-log-bin",
            ],
            stdout=log,
            stderr=log,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    _wait_for("mariadb", lambda: sock.exists() and _port_open(DB_PORT), 60, root)
    sql = (
        "CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY 'slurm';"
        "GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1'; FLUSH PRIVILEGES;"
    )
    subprocess.run(
        ["mariadb", "--no-defaults", f"--socket={sock}", "-u", "root", "-e", sql],
        check=True,
        capture_output=True,
        timeout=30,
    )


def _add_associations(root: Path) -> subprocess.Popen:
    """QoS, accounts and this user's associations: one sacctmgr process (a commit per command, ~1 s in
    all), started once slurmctld has registered the cluster (it does so before it answers a ping) and
    run while the slurmds start; slurmdbd pushes each change to slurmctld."""
    user = pwd.getpwuid(os.getuid()).pw_name
    commands = [
        *(f"add qos {q}" for q in QOS if q != "normal"),
        f"add account {','.join(ACCOUNTS)} cluster=hpcdev",
        f"add user {user} account={','.join(ACCOUNTS)} defaultaccount={ACCOUNTS[0]} qos={','.join(QOS)} "
        f"defaultqos={QOS[0]} cluster=hpcdev",
    ]
    proc = subprocess.Popen(
        ["sacctmgr", "-i"],
        env=client_env(root),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    proc.stdin.write("\n".join(commands) + "\n")  # type: ignore[union-attr]
    proc.stdin.close()  # type: ignore[union-attr]
    return proc


def _associations_added(proc: subprocess.Popen, root: Path) -> None:
    out = proc.stdout.read()  # type: ignore[union-attr]
    if proc.wait(timeout=60) != 0 or "error" in out.lower():
        raise RuntimeError(f"cluster up: sacctmgr failed: {out}")
    # slurmdbd pushes the changes to slurmctld asynchronously: wait until it accepts every combination.
    for account in ACCOUNTS:
        test = ["sbatch", "--test-only", f"--account={account}", f"--qos={QOS[-1]}", "--wrap=true"]
        _wait_for(
            f"slurmctld to know account {account}", lambda: _run(test, root, check=False).returncode == 0, 30, root
        )


def _start_slurmd(node: str, root: Path) -> None:
    """One slurmd per node name, in its own UTS + mount namespace (hostname, /etc/hosts)."""
    p = paths(root)
    (p["spool"] / node).mkdir(parents=True, exist_ok=True)
    script = f"hostname {node} && mount --bind {p['etc']}/hosts /etc/hosts && exec slurmd -N {node}"
    subprocess.run(
        ["unshare", "--uts", "--mount", "sh", "-c", script],
        env=client_env(root),
        check=True,
        capture_output=True,
        timeout=30,
    )


def _nodes_idle(root: Path) -> bool:
    out = _run(["sinfo", "-h", "-N", "-p", "debug", "-o", "%N %t"], root, check=False).stdout.split("\n")
    states = dict(line.split() for line in out if line.strip())
    return all(states.get(n) == "idle" for n in NODES)


def up(root: Path = CLUSTER_DIR, max_array_size: int = 1001, max_job_count: int | None = None) -> float:
    """Start a fresh cluster (job ids restart at 1). Returns the seconds it took."""
    t0 = time.monotonic()
    down(root)  # whatever a previous `up` left running, by its pidfiles
    if root.exists():
        shutil.rmtree(root)
    p = paths(root)
    for d in p.values():
        d.mkdir(parents=True, exist_ok=True)
    (p["spool"] / "ctld").mkdir()
    (p["etc"] / "slurm.conf").write_text(slurm_conf_text(root, max_array_size, max_job_count=max_job_count))
    (p["etc"] / "topology.conf").write_text(TOPOLOGY_CONF)
    dbd = p["etc"] / "slurmdbd.conf"
    dbd.write_text(slurmdbd_conf_text(root))
    dbd.chmod(0o600)  # slurmdbd refuses a config others can read (it holds the DB password)
    (p["etc"] / "hosts").write_text("127.0.0.1 localhost " + " ".join(NODES) + "\n")

    _start_munge(root)
    _start_mariadb(root)
    _run(["slurmdbd"], root)
    _wait_for("slurmdbd", lambda: _port_open(DBD_PORT), 30, root)
    _run(["slurmctld", "-c"], root)  # -c: no state from a previous cluster
    _wait_for("slurmctld", lambda: _run(["scontrol", "ping"], root, check=False).returncode == 0, 30, root)
    sacctmgr = _add_associations(root)
    for node in NODES:
        _start_slurmd(node, root)
    _wait_for("4 idle nodes", lambda: _nodes_idle(root), 60, root)
    _associations_added(sacctmgr, root)
    return time.monotonic() - t0


def reconfigure(root: Path = CLUSTER_DIR, max_array_size: int = 1001, ctld_parameters: str = "") -> None:
    """Rewrite slurm.conf and apply it to the running daemons (`scontrol reconfigure`, ~1 s).

    E.g. ctld_parameters="preempt_send_user_signal" makes preemption send the --signal signal. The
    MaxJobCount `up` set is kept: slurmctld reads it only when it starts.
    """
    conf = paths(root)["etc"] / "slurm.conf"
    kept = re.search(r"^MaxJobCount=(\d+)$", conf.read_text(), re.M)
    # whole or not at all (a temp file renamed over it): an srun of a running job reads slurm.conf as it starts,
    # and found it empty mid-write ("s_p_parse_file: file ... is empty": an array task never ran, CI timed out)
    fresh = conf.with_name("slurm.conf.new")
    fresh.write_text(slurm_conf_text(root, max_array_size, ctld_parameters, int(kept.group(1)) if kept else None))
    os.replace(fresh, conf)
    _run(["scontrol", "reconfigure"], root)
    want = ctld_parameters or "(null)"
    _wait_for(
        f"SlurmctldParameters={want}",
        lambda: f"SlurmctldParameters     = {want}" in _run(["scontrol", "show", "config"], root).stdout,
        30,
        root,
    )


def restart_controller(down_s: float, root: Path = CLUSTER_DIR) -> None:
    """Stop slurmctld (by its pidfile), keep it down for down_s, start it again with its saved state:
    the controller outage a login node sees during a maintenance or a crash."""
    run = paths(root)["run"]
    pid = _read_pid(run / "slurmctld.pid")
    if pid is not None:
        os.kill(pid, signal.SIGTERM)
        _wait_for("slurmctld to stop", lambda: _read_pid(run / "slurmctld.pid") is None, 30, root)
    time.sleep(down_s)
    _run(["slurmctld"], root)  # no -c: jobs and state survive
    _wait_for("slurmctld", lambda: _run(["scontrol", "ping"], root, check=False).returncode == 0, 30, root)
    _wait_for("4 idle nodes", lambda: _nodes_idle(root), 60, root)


def is_up(root: Path = CLUSTER_DIR) -> bool:
    run = paths(root)["run"]
    return all(_read_pid(run / f"{name}.pid") is not None for name in DAEMON_PIDFILES)


def down(root: Path = CLUSTER_DIR) -> None:
    """Stop exactly the daemons `up` started, by their pidfiles, and the jobs' processes with them."""
    run = paths(root)["run"]
    if not run.exists():
        return
    if is_up(root):
        # Cancel every job and wait for the jobs to end before stopping the daemons. Otherwise a job's
        # slurmstepd outlives its slurmd, and later reports "job 5 done" to the *next* cluster's
        # controller, whose job 5 is another job (ids restart at 1): seen once, it killed a test's sweep.
        _run(["scancel", "--full", "--user=root"], root, check=False, timeout_s=10)
        deadline = time.monotonic() + 30  # KillWait=10 s, then SIGKILL
        while time.monotonic() < deadline and _run(["squeue", "-h", "-o", "%i"], root, check=False).stdout.strip():
            time.sleep(0.5)
    order = [f"slurmd-{n}" for n in NODES] + ["slurmctld", "slurmdbd", "mariadb"]
    for name in order:
        pid = _read_pid(run / f"{name}.pid")
        if pid is None:
            continue
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and _read_pid(run / f"{name}.pid") == pid:
            time.sleep(0.05)
        if _read_pid(run / f"{name}.pid") == pid:
            os.kill(pid, signal.SIGKILL)
        (run / f"{name}.pid").unlink(missing_ok=True)
    _stop_munge(root)


def status(root: Path = CLUSTER_DIR) -> str:
    run = paths(root)["run"]
    lines = [
        f"{name:16s} {f'up (pid {pid})' if (pid := _read_pid(run / f'{name}.pid')) else 'down'}"
        for name in DAEMON_PIDFILES
    ]
    if is_up(root):
        lines.append(_run(["sinfo"], root, check=False).stdout)
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    cmd = argv[1] if len(argv) > 1 else "status"
    if cmd == "up":
        print(f"cluster up in {up():.1f} s; export SLURM_CONF={paths()['etc'] / 'slurm.conf'}")
    elif cmd == "down":
        down()
        print("cluster down")
    elif cmd == "status":
        print(status())
        return 0 if is_up() else 1
    elif cmd == "env":
        print(f"export SLURM_CONF={paths()['etc'] / 'slurm.conf'}")
    else:
        print(f"unknown command {cmd!r}; use one of: up, down, status, env", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
