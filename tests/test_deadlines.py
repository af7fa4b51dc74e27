"""One table of the stop and failure paths' deadlines (hpc_train/deadlines.py): the relay's bash defaults are its
numbers, and the reserves add up as their comments say."""

from __future__ import annotations

import re
from pathlib import Path

from hpc_train import deadlines, slurm

RELAY = Path(__file__).resolve().parents[1] / "sbatch_templates" / "signal_relay.sh"


def test_the_relays_defaults_are_the_tables() -> None:
    text = RELAY.read_text()
    assert set(re.findall(r"\$\{HPC_TRAIN_STEP_END_S:-(\d+)\}", text)) == {str(deadlines.STEP_END_S)}
    assert set(re.findall(r"\$\{HPC_TRAIN_STEP_KILL_S:-(\d+)\}", text)) == {str(deadlines.STEP_KILL_S)}
    assert re.search(rf"sleep {deadlines.RELAY_BEAT_S} >/dev/null", text), "the relay's beat interval"
    assert f"older than {deadlines.RELAY_SILENT_S:.0f} s (deadlines.RELAY_SILENT_S)" in text
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
