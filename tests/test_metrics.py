"""The journals' readers: what the login-node tools conclude from events.jsonl and metrics.jsonl."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import names

from hpc_train import journal
from hpc_train.metrics import lead_warning, read_jsonl
from hpc_train.paths import RunPaths, append_line


def test_signal_lead_warning_names_measurements_and_the_value_to_use(tmp_path: Path) -> None:
    journal.log(tmp_path, "checkpoint_committed", 20, "1", 0, save_s=41.2)
    journal.log(tmp_path, "checkpoint_committed", 40, "1", 0, save_s=12.0)
    append_line(RunPaths(tmp_path).metrics, {"time": 1.0, "step": 10, "step_time_s": 3.1})
    assert lead_warning([tmp_path], 120) == ""  # 41.2 + 3.1 + 60 = 104.3 fits
    said = lead_warning([tmp_path], 90)
    assert names(said, "cluster.signal_lead_s=90", "save took 41.2 s", "step 3.1 s", "60 s early")
    assert names(said, "use cluster.signal_lead_s>=105")  # the fix: 41.2 + 3.1 + 60, rounded up
    assert lead_warning([tmp_path / "never-ran"], 1) == ""
    append_line(RunPaths(tmp_path).metrics, {"time": 2.0, "step": 20, "step_time_s": 3.0, "eval_s": 20.0})
    assert "the slowest step 23.0 s" in lead_warning([tmp_path], 120)  # an evaluation delays the stop check too


def test_torn_last_line_is_skipped(tmp_path: Path) -> None:
    events = RunPaths(tmp_path).events
    append_line(events, {"event": "start"})
    with open(events, "a") as f:
        f.write('{"event": "sig')  # the writer was killed mid-line
    assert read_jsonl(events) == [{"event": "start"}]


def test_lines_of_another_shape_are_skipped_by_every_reader(tmp_path: Path) -> None:
    """Someone edited events.jsonl: a list, an empty object, a string step. The decisions and `status`
    index e["event"], e["time"], e["step"]; those lines are left out rather than crash them."""
    journal.log(tmp_path, "start", 0, "1", 0)
    with open(RunPaths(tmp_path).events, "a") as f:
        for odd in ([1, 2], {}, {"event": "requeue"}, {"event": "requeue", "time": 1.0, "step": "7"}, "text"):
            f.write(json.dumps(odd) + "\n")
    journal.log(tmp_path, "finish", 60, "1", 0)
    assert [e["event"] for e in journal.read(tmp_path)] == ["start", "finish"]
    assert len(read_jsonl(RunPaths(tmp_path).events)) == 5  # the dicts; read_events keeps the well-formed ones
