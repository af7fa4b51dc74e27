"""One table of the stop and failure paths' deadlines (hpc_train/deadlines.py): the relay runs with its
numbers, and the reserves add up as their comments say."""

from __future__ import annotations

from hpc_train import deadlines, sbatch, slurm


def test_the_relay_runs_with_the_tables_deadlines() -> None:
    """The batch script hands relay.py the table's numbers (it imports nothing of hpc_train): no second copy."""
    line = next(line for line in sbatch.relay_lines() if " exec " in line and not line.lstrip().startswith("#"))
    words = line.split("relay.py", 1)[1].split()
    assert words[:3] == [str(deadlines.STEP_END_S), str(deadlines.STEP_KILL_S), str(deadlines.RELAY_BEAT_S)], line
    assert words[3] == '"$@"'
    # six missed beats before a relay is taken for gone, well under Slurm's SlurmdTimeout (300 s)
    assert deadlines.RELAY_SILENT_S == 6 * deadlines.RELAY_BEAT_S < 300


def test_the_reserves_and_the_verdict_wait_add_up() -> None:
    assert deadlines.REQUEUE_RESERVE_S == 35.0  # fate 10 s + requeue 21 s + 4 s of records
    assert deadlines.ELASTIC_RESERVE_S == 15.0
    assert deadlines.reserve_s("slurm", False) == 35.0 and deadlines.reserve_s("slurm", True) == 50.0
    assert deadlines.reserve_s("local", True) == 4.0
    assert deadlines.VERDICT_WAIT_S == 259.0
    # the slowest decision a waiting rank outlasts: every Slurm call of the failure path at its worst
    assert deadlines.VERDICT_WAIT_S > 2 * slurm.worst_s(*slurm.FATE) + 2 * slurm.worst_s(*slurm.REQUEUE)
