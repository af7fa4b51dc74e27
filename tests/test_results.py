"""`hpc-train results SWEEP_DIR`: a sweep's trials side by side, from a real two-trial local sweep
(one `submit -m`, ~35 s on 2 cores: the local executor runs the trials one after the other)."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest
from conftest import HPC_TRAIN, run

from hpc_train.status import sort_results


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("results")
    proc = run(
        [HPC_TRAIN, "submit", "-m", f"out_dir={out}", "train.lr=1e-3,3e-3", "train.steps=6", "train.log_every_steps=2"],
        timeout_s=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    sweep_dir = out / "demo-1"
    # An evaluating trainer logs val_loss in metrics.jsonl; these trials do not evaluate, so give trial 0 one.
    with (sweep_dir / "0000" / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"time": 1.0, "step": 6, "val_loss": 4.25}) + "\n")
    return sweep_dir


def final_loss(run_dir: Path) -> float:
    return json.loads((run_dir / "summary.json").read_text())["final_loss"]


def test_results_table_is_sorted_by_final_loss(sweep: Path) -> None:
    proc = run([HPC_TRAIN, "results", str(sweep)])
    assert proc.returncode == 0, proc.stderr
    best, worst = sorted(["0000", "0001"], key=lambda t: final_loss(sweep / t))
    lines = proc.stdout.splitlines()
    assert "demo-1: 2 trial(s), by final_loss" in lines[0]
    header = next(l for l in lines if "trial" in l and "state" in l)
    assert [c.strip() for c in header.strip("┃").split("┃")] == [
        "trial",
        "train.lr",
        "state",
        "step",
        "final loss",
        "val loss",
        "goodput",
    ]  # only the swept key
    rows = [[c.strip() for c in l.strip("│").split("│")] for l in lines if l.startswith("│")]
    assert [r[0] for r in rows] == [best, worst]
    by_trial = {r[0]: r for r in rows}
    assert by_trial["0000"][1:6] == ["0.001", "COMPLETED", "6", f"{final_loss(sweep / '0000'):.4f}", "4.2500"]
    assert by_trial["0001"][1:6] == ["0.003", "COMPLETED", "6", f"{final_loss(sweep / '0001'):.4f}", "-"]
    assert by_trial["0000"][6].endswith("%")
    assert lines[-1] == f"in every trial: out_dir={sweep.parent} train.steps=6 train.log_every_steps=2"


def test_results_json_and_csv_sorted_by_an_override(sweep: Path) -> None:
    rows = json.loads(run([HPC_TRAIN, "results", str(sweep), "--json", "--sort", "train.lr", "--reverse"]).stdout)
    assert [r["trial"] for r in rows] == ["0001", "0000"]  # 3e-3 first
    assert rows[1]["overrides"] == {
        "out_dir": str(sweep.parent),
        "train.lr": "0.001",
        "train.steps": "6",
        "train.log_every_steps": "2",
    }
    assert rows[1]["val_loss"] == 4.25 and rows[0]["val_loss"] is None
    assert rows[1]["final_loss"] == final_loss(sweep / "0000") and rows[1]["state"] == "COMPLETED"
    assert 0 < rows[1]["goodput"] <= 1 and rows[1]["run_dir"] == str(sweep / "0000")
    proc = run([HPC_TRAIN, "results", str(sweep), "--csv", "--sort", "train.lr"])
    table = list(csv.DictReader(io.StringIO(proc.stdout)))
    assert [(r["trial"], r["train.lr"], r["val_loss"]) for r in table] == [
        ("0000", "0.001", "4.25"),
        ("0001", "0.003", ""),
    ]
    assert list(table[0]) == [
        "trial",
        "out_dir",
        "train.lr",
        "train.steps",
        "train.log_every_steps",
        "state",
        "step",
        "final_loss",
        "val_loss",
        "goodput",
        "run_dir",
    ]


def test_results_refuses_an_unknown_sort_key_and_a_run_that_is_not_a_sweep(sweep: Path) -> None:
    proc = run([HPC_TRAIN, "results", str(sweep), "--sort", "lr"])
    assert proc.returncode == 2 and proc.stderr == (
        "hpc-train results: error: --sort lr: no such column; use one of trial, state, step, final_loss, val_loss, "
        "goodput, run_dir, out_dir, train.lr, train.steps, train.log_every_steps\n"
    )
    proc = run([HPC_TRAIN, "results", str(sweep / "0000")])
    assert proc.returncode == 2 and f"{sweep / '0000'} is not a sweep directory (no sweep.json)" in proc.stderr


def test_sort_puts_missing_values_last_and_compares_numbers_as_numbers() -> None:
    def row(trial: str, lr: str, loss: float | None) -> dict:
        return {"trial": trial, "overrides": {"train.lr": lr}, "final_loss": loss}

    rows = [row("a", "1e-3", None), row("b", "3e-4", 2.0), row("c", "2e-3", 1.0)]
    assert [r["trial"] for r in sort_results(rows, "final_loss")] == ["c", "b", "a"]
    assert [r["trial"] for r in sort_results(rows, "final_loss", reverse=True)] == ["b", "c", "a"]
    assert [r["trial"] for r in sort_results(rows, "train.lr")] == ["b", "a", "c"]  # 3e-4 < 1e-3 < 2e-3


def test_a_deleted_trial_folder_is_a_missing_row_in_results_and_status(tmp_path: Path) -> None:
    """Broken before: FileNotFoundError traceback from the first trial's config.yaml. Trial 0000 is gone,
    0001 holds the composed config (what submit freezes) and nothing else yet."""
    sweep_dir = tmp_path / "mix-1"
    (sweep_dir / "0001").mkdir(parents=True)
    (sweep_dir / "0001" / "config.yaml").write_text(run([HPC_TRAIN, "submit", "--cfg", "job"]).stdout)
    trials = [
        {"run_dir": str(sweep_dir / t), "job_id": "", "overrides": [f"train.lr={lr}"]}
        for t, lr in (("0000", "1e-3"), ("0001", "3e-3"))
    ]
    (sweep_dir / "sweep.json").write_text(json.dumps({"trials": trials}))
    proc = run([HPC_TRAIN, "results", str(sweep_dir), "--json"])
    assert proc.returncode == 0, proc.stderr
    assert [(r["trial"], r["state"]) for r in json.loads(proc.stdout)] == [("0000", "missing"), ("0001", "UNKNOWN")]
    proc = run([HPC_TRAIN, "status", str(sweep_dir), "--json"])
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    assert rows[0]["state"] == "missing" and rows[1]["total_steps"] == 60
    assert rows[0]["warnings"] == [f"{sweep_dir}/0000/config.yaml does not exist (deleted?)"]
    proc = run([HPC_TRAIN, "status", str(sweep_dir)])  # the table too
    assert proc.returncode == 0 and "missing" in proc.stdout, proc.stderr
    # the trial itself, named alone before any rank wrote an event (review: taken for no run)
    proc = run([HPC_TRAIN, "status", str(sweep_dir / "0001"), "--json"])
    assert proc.returncode == 0 and [r["run"] for r in json.loads(proc.stdout)] == ["mix-1/0001"], proc.stderr


def test_status_shows_a_runs_own_total_steps_never_another_loops() -> None:
    """train.steps is the built-in trainer's: a function's or a script's total is what its loop told (step_end's
    last_step in `first_step`, a script's hpc.log(total_steps=...)), else none."""
    from hpc_train.status import _total_steps

    builtin = {"train": {"steps": 60}, "fn": {"_target_": ""}, "script": {"cmd": []}}
    function = {**builtin, "fn": {"_target_": "byo_train.main"}}
    script = {**builtin, "script": {"cmd": ["python", "train.py"]}}
    told = [
        {"event": "first_step", "step": 1, "total_steps": 300},
        {"event": "first_step", "step": 41, "total_steps": 200},
    ]
    assert _total_steps(builtin, [], []) == 60
    assert _total_steps(function, [], []) is None and _total_steps(script, [], []) is None
    assert _total_steps(function, told, []) == 200  # the newest attempt's
    assert _total_steps(script, [], [{"step": 5, "total_steps": 40}, {"step": 6}]) == 40
