"""Pure parsers of Slurm's text and the requeue decisions, tested on captured output (no cluster)."""

from __future__ import annotations

import pytest
from conftest import names

from hpc_train.config import RequeueConfig
from hpc_train.preempt import decide, stop_reason
from hpc_train.sbatch import _gpu_count
from hpc_train.slurm import parse_key_values, time_limit_min

# Captured from the dev cluster (scontrol show partition -o / show config), trimmed.
PARTITION = (
    "PartitionName=debug AllowGroups=ALL Default=YES MaxNodes=UNLIMITED MaxTime=01:00:00 MinNodes=0 "
    "Nodes=node[1-4] PriorityTier=1 State=UP TotalCPUs=16 TotalNodes=4"
)
CONFIG = "MaxArraySize            = 1001\nSlurmctldParameters     = preempt_send_user_signal\nSLURM_VERSION           = 22.05.8\n"


def test_parse_key_values() -> None:
    part = parse_key_values(PARTITION)
    assert (part["PartitionName"], part["MaxTime"], part["Nodes"], part["TotalNodes"]) == (
        "debug",
        "01:00:00",
        "node[1-4]",
        "4",
    )
    conf = parse_key_values(CONFIG)
    assert conf["MaxArraySize"] == "1001" and conf["SLURM_VERSION"] == "22.05.8"


@pytest.mark.parametrize(
    "text, minutes",
    [
        ("UNLIMITED", float("inf")),
        ("30", 30),
        ("30:00", 30),
        ("01:00:00", 60),
        ("2-00:00:00", 2880),
        ("1-12", 2160),
        ("0:90", 1.5),
    ],
)
def test_time_limit_min(text: str, minutes: float) -> None:
    assert time_limit_min(text) == minutes


@pytest.mark.parametrize(
    "gres, gpus", [("", 0), ("(null)", 0), ("gpu:8", 8), ("gpu:a100:8(S:0-1)", 8), ("gpu:a100:4,gpu:v100:2,shard:8", 6)]
)
def test_gpu_count(gres: str, gpus: int) -> None:
    assert _gpu_count(gres) == gpus


@pytest.mark.parametrize(
    "signals, end_in_s, preempted, reason",
    [
        (["SIGTERM"], 100, False, "preempt"),
        (["SIGUSR2"], 3595, False, "preempt"),  # early USR2: preempt_send_user_signal or a drill, not the time limit
        (["SIGUSR2"], 120 + 100, False, "time_limit"),  # within lead + 120 s of Slurm's EndTime
        (["SIGUSR2"], 30, True, "preempt"),  # preempt_send_user_signal: EndTime is PreemptTime + GraceTime
        (["SIGUSR2", "SIGTERM"], 100, False, "preempt"),
    ],
)
def test_stop_reason(signals: list[str], end_in_s: float, preempted: bool, reason: str) -> None:
    assert stop_reason(signals, end_in_s, signal_lead_s=120, preempted=preempted) == reason


# `scontrol show job -o` on the dev cluster (Slurm 22.05), trimmed: a running job whose TimeLimit an
# administrator cut from 10 to 3 min, the same job 7 s later once a `high` job preempted it, and a pending one.
SHORTENED = (
    "JobId=30003 JobName=wrap JobState=RUNNING Reason=None Restarts=0 RunTime=00:00:03 TimeLimit=00:03:00 "
    "TimeMin=N/A SubmitTime=2026-12-01T12:36:09 StartTime=2026-12-01T12:36:09 EndTime=2026-12-01T12:39:09 "
    "Deadline=N/A PreemptEligibleTime=2026-12-01T12:36:09 PreemptTime=None SuspendTime=None Partition=low"
)
PREEMPTED = SHORTENED.replace("EndTime=2026-12-01T12:39:09", "EndTime=2026-12-01T12:36:46").replace(
    "PreemptTime=None", "PreemptTime=2026-12-01T12:36:16"
)
PENDING = "JobId=30005 JobState=PENDING Reason=Priority StartTime=Unknown EndTime=Unknown PreemptTime=None"


def test_parse_end_time() -> None:
    from datetime import datetime

    from hpc_train.slurm import parse_end_time

    at = lambda text: datetime.fromisoformat(text).timestamp()  # noqa: E731  (the controller's local time)
    assert parse_end_time(SHORTENED) == (at("2026-12-01T12:39:09"), False)
    assert parse_end_time(PREEMPTED) == (at("2026-12-01T12:36:46"), True)
    assert parse_end_time(PENDING) == (None, False)
    assert parse_end_time("slurm_load_jobs error: Invalid job id specified") == (None, False)


def test_budgets_count_only_their_own_reason() -> None:
    events = [{"event": "requeue", "reason": "preempt"}] * 5 + [{"event": "requeue", "reason": "failure"}]
    budgets = RequeueConfig(max_failures=2, max_time_limit_requeues=0)
    assert decide("preempt", events, budgets, "running") == ("requeue", "")  # -1: unlimited
    assert decide("failure", events, budgets, "running") == ("requeue", "")
    action, why = decide("failure", events + events[-1:], budgets, "running")
    assert action == "stop" and names(why, "failure budget spent", "2 failure requeues", "requeue.max_failures=2")
    assert decide("time_limit", [], budgets, "running")[0] == "stop"


def test_sacct_states_take_a_jobs_last_record() -> None:
    """A --no-kill job (hot spares) that lost a node has two records in `sacct -X` (captured on the dev cluster):
    the allocation before Slurm took the node out, RESIZING, then the rest. Its state is the last one's."""
    from hpc_train.slurm import parse_sacct_states

    text = "30|RESIZING\n30|COMPLETED\n31|RUNNING\n"
    assert parse_sacct_states(text, ["30", "31"]) == {"30": "COMPLETED", "31": "RUNNING"}
    assert parse_sacct_states("30|RESIZING\n", ["30"]) == {"30": "RESIZING"}
