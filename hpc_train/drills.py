"""`hpc-train chaos`: faults injected into a running job, or drills armed as files in its run directory that
the job fires, each recorded as a `chaos` event. One function per action, looked up in CHAOS. Torch-free
(login node); cli reads CHAOS for its help without a Slurm call.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpc_train import journal, slurm
from hpc_train.paths import RunPaths, make_dir, read_marker, step_dir, step_folders
from hpc_train.runs import Run
from hpc_train.straggler import MAX_SLOW_RANK_S


@dataclass
class Ask:
    """One `hpc-train chaos` request, as each action reads it."""

    run: Run
    action: str
    rank: int
    seconds: float | None
    node: str
    start: dict[str, Any] | None  # the last attempt's start event: world size, each rank's node and pid

    def drill(self, name: str) -> Path:
        """RUN/drills/NAME, its folder made: the job looks for these files."""
        drills = RunPaths(self.run.run_dir).drills
        make_dir(drills, exist_ok=True)
        return drills / name


def _signal(ask: Ask) -> str:
    """USR2 (time-limit) or TERM (preempt) to every task; batch-term: TERM to the batch shell only."""
    slurm.scancel([ask.run.job_id], "USR2" if ask.action == "time-limit" else "TERM", ask.action == "batch-term")
    return CHAOS[ask.action][1]


def _requeue(ask: Ask) -> str:
    if error := slurm.requeue(ask.run.job_id):
        raise slurm.SlurmError(error)
    return CHAOS[ask.action][1]


def _kill(ask: Ask) -> str:
    """kill-rank: SIGKILL to rank --rank; lose-node: to every rank on its node."""
    run, rank, start = ask.run, ask.rank, ask.start
    if start is None or "pids" not in start:
        raise ValueError(f"{run.label} has not started yet (no start event with rank pids); try again shortly")
    nodes, pids = start["rank_nodes"], start["pids"]
    targets = (
        [(nodes[rank], pids[rank])]
        if ask.action == "kill-rank"
        else [(n, p) for n, p in zip(nodes, pids) if n == nodes[rank]]
    )
    allocation = slurm.allocation_id(run.job_id)  # array task -> its own id
    if not allocation:
        raise ValueError(f"job {run.job_id} is not running; nothing to kill")
    slurm.kill(allocation, targets[0][0], [pid for _, pid in targets])  # every target is on one node
    if ask.action == "kill-rank":
        return f"SIGKILL to rank {rank} (pid {pids[rank]} on {nodes[rank]})"
    return f"SIGKILL to every rank on {nodes[rank]} ({len(targets)} processes), as a lost node"


def _write_seconds(drill: Path, seconds: float) -> None:
    """A drill file holding its extra seconds; 0 (or less) removes it: back to normal."""
    if seconds <= 0:
        drill.unlink(missing_ok=True)
    else:
        drill.write_text(f"{seconds}\n")


def _kill_during_save(ask: Ask) -> str:
    ask.drill("kill_rank_during_save").write_text("armed\n")
    return CHAOS[ask.action][1]


def _slow_storage(ask: Ask) -> str:
    seconds = 2.0 if ask.seconds is None else ask.seconds
    _write_seconds(ask.drill("slow_storage"), seconds)
    return f"checkpoint writes {seconds:g} s slower" if seconds > 0 else "checkpoint writes at normal speed"


def _corrupt_checkpoint(ask: Ask) -> str:
    paths = RunPaths(ask.run.run_dir)
    committed = [(s, m) for s, f in step_folders(paths.checkpoints).items() if (m := read_marker(f))]
    if not committed:
        raise ValueError(f"{ask.run.label} has no committed checkpoint to corrupt yet")
    step, marker = committed[-1]
    name = max(marker["files"], key=lambda n: marker["files"][n]["bytes"])
    target = step_dir(paths.checkpoints, step) / name
    with open(target, "r+b") as f:  # same size, one byte changed: only the checksum can tell
        f.seek(marker["files"][name]["bytes"] // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    return f"one byte flipped in {target.relative_to(ask.run.run_dir)}"


def _sick_node(ask: Ask) -> str:
    """A file on the shared filesystem: the node's own preflight finds it."""
    run, rank, node, start = ask.run, ask.rank, ask.node, ask.start
    if not node and (start is None or "rank_nodes" not in start):
        raise ValueError(f"{run.label} has not started yet, so rank {rank} has no node: give --node NAME")
    ranks = start["rank_nodes"] if start and "rank_nodes" in start else []
    if not node and not 0 <= rank < len(ranks):
        raise ValueError(f"--rank {rank}: {run.label}'s last attempt has ranks 0..{len(ranks) - 1}")
    if node and ranks and node not in ranks:  # a typo would arm a drill that never fires
        raise ValueError(
            f"--node {node}: {run.label}'s last attempt ran on {', '.join(dict.fromkeys(ranks))}; name one of them"
        )
    node = node or ranks[rank]
    drill = ask.drill(f"sick_node.{node}")
    drill.write_text("armed\n")
    return f"{node} fails every later preflight (rm {drill} to heal it)"


def _slow_rank(ask: Ask) -> str:
    """The rank re-reads its file once per straggler window (train.py)."""
    run, rank, seconds = ask.run, ask.rank, ask.seconds
    world = ask.start.get("world_size") if ask.start else None
    if seconds is None or not 0 <= seconds <= MAX_SLOW_RANK_S:  # NaN and inf fail this too
        given = "needs --seconds" if seconds is None else f"--seconds {seconds:g}"
        raise ValueError(
            f"chaos slow-rank {given}: give the extra seconds per step, 0 to "
            f"{MAX_SLOW_RANK_S:g} (0: back to normal), e.g. --seconds 0.02"
        )
    if not isinstance(world, int) or not 0 <= rank < world:
        raise ValueError(
            f"chaos slow-rank --rank {rank}: "
            + (
                f"{run.label} has {world} ranks; give 0 to {world - 1}"
                if isinstance(world, int)
                else f"{run.label} has not started yet, so its ranks are "
                f"unknown; try again once `hpc-train status` shows it running"
            )
        )
    _write_seconds(ask.drill(f"slow_rank_{rank}"), seconds)
    return f"rank {rank} works {seconds:g} s more per step" if seconds > 0 else f"rank {rank} at normal speed"


# action -> (what does it, what it injects: the help, and the `chaos` event's `injected` unless it says more)
CHAOS: dict[str, tuple[Callable[[Ask], str], str]] = {
    "time-limit": (_signal, "USR2 to every task, as Slurm's time-limit warning"),
    "preempt": (_signal, "SIGTERM to every task, as a preemption"),
    "batch-term": (_signal, "SIGTERM to the batch shell only (scancel --batch), as --signal=B:TERM or an operator"),
    "requeue": (_requeue, "scontrol requeue"),
    "kill-rank": (_kill, "SIGKILL to one rank"),
    "lose-node": (_kill, "SIGKILL to every rank on one node, as a lost node"),
    "kill-rank-during-save": (_kill_during_save, "the last rank SIGKILLs itself in the middle of its next save (once)"),
    "slow-storage": (_slow_storage, "every later checkpoint write takes --seconds longer (0: back to normal)"),
    "corrupt-checkpoint": (
        _corrupt_checkpoint,
        "one byte flipped in the newest committed checkpoint (the next resume skips it)",
    ),
    "sick-node": (
        _sick_node,
        "--node (else rank --rank's node) fails every later preflight until RUN/drills/sick_node.NODE goes",
    ),
    "slow-rank": (
        _slow_rank,
        "rank --rank works --seconds longer each step, as a slow GPU or core (0: back to normal)",
    ),
}
DRILLS = (
    "kill-rank-during-save",
    "slow-storage",
    "corrupt-checkpoint",
    "sick-node",
    "slow-rank",
)  # files: local runs too


# Drills that hpc_train's own saver or loop fires: a script (`submit ... -- CMD`) saves and steps by itself, so
# armed on its run they would say "armed" and never fire.
TRAINER_ONLY = ("kill-rank-during-save", "slow-storage", "corrupt-checkpoint", "slow-rank")


def _is_script(run_dir: Path) -> bool:
    import yaml

    try:
        return bool((yaml.safe_load((run_dir / "config.yaml").read_text()).get("script") or {}).get("cmd"))
    except (OSError, AttributeError, yaml.YAMLError):
        return False


def chaos(run: Run, action: str, rank: int = 0, seconds: float | None = None, node: str = "") -> str:
    """Inject a fault into a running job (or arm a drill the job fires) and record it in events.jsonl."""
    if action not in CHAOS:
        raise ValueError(f"chaos action {action!r}: use one of {list(CHAOS)}")
    if action in TRAINER_ONLY and _is_script(run.run_dir):
        works = [a for a in CHAOS if a not in TRAINER_ONLY and (run.executor == "slurm" or a in DRILLS)]
        raise ValueError(
            f"chaos {action} acts on hpc_train's own checkpoints and steps, and {run.label} runs your script, which "
            f"writes its own: it would never fire; on this run use one of {', '.join(works)}"
        )
    if run.executor != "slurm" and action not in DRILLS:
        # the local executor's preemption: its controller (the job id) forwards a TERM to every rank, which save,
        # and restarts them in place (docs/operations.md)
        local_way = f"; a preemption here: kill -TERM {run.job_id} (its local controller)" * (action == "preempt")
        raise ValueError(
            f"{run.label} runs on the local executor; chaos {action} needs Slurm (cluster=dev){local_way}; "
            f"local runs take {', '.join(DRILLS)}"
        )
    start = journal.last(journal.read(run.run_dir), journal.START)
    what = CHAOS[action][0](Ask(run, action, rank, seconds, node, start))
    journal.log(
        run.run_dir,
        journal.CHAOS,
        start["step"] if start else -1,
        run.job_id,
        journal.current_attempt(journal.read(run.run_dir)),
        action=action,
        injected=what,
    )
    return what
