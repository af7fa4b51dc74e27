"""The journals' readers: what the login-node tools conclude from events.jsonl and metrics.jsonl."""

from __future__ import annotations

from pathlib import Path

from hpc_train.metrics import EVENTS, METRICS, append_jsonl, lead_warning, read_jsonl


def test_signal_lead_warning_names_measurements_and_the_value_to_use(tmp_path: Path) -> None:
    append_jsonl(tmp_path / EVENTS, {"event": "checkpoint_committed", "save_s": 41.2})
    append_jsonl(tmp_path / EVENTS, {"event": "checkpoint_committed", "save_s": 12.0})
    append_jsonl(tmp_path / METRICS, {"step": 10, "step_time_s": 3.1})
    assert lead_warning([tmp_path], 120) == ""  # 41.2 + 3.1 + 60 = 104.3 fits
    assert lead_warning([tmp_path], 90) == (
        "cluster.signal_lead_s=90 is shorter than measured: the slowest save took 41.2 s and the slowest step "
        "3.1 s, and Slurm may signal up to 60 s early; use cluster.signal_lead_s>=105")
    assert lead_warning([tmp_path / "never-ran"], 1) == ""


def test_torn_last_line_is_skipped(tmp_path: Path) -> None:
    append_jsonl(tmp_path / EVENTS, {"event": "start"})
    with open(tmp_path / EVENTS, "a") as f:
        f.write('{"event": "sig')  # the writer was killed mid-line
    assert read_jsonl(tmp_path / EVENTS) == [{"event": "start"}]
