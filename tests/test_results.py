"""`hpc-train results SWEEP_DIR`: a sweep's trials side by side, from a real two-trial local sweep
(one `submit -m`, ~35 s on 2 cores: the local executor runs the trials one after the other)."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest
from conftest import HPC_TRAIN, names, refused, run

from hpc_train.status import sort_results


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("results")
    proc = run(
        [HPC_TRAIN, "submit", "-m", f"out_dir={out}", "train.lr=1e-3,3e-3", "train.steps=6", "train.log_every_steps=2"],
        timeout_s=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # a local sweep speaks of the local executor, and of each trial as it ends (issue 29: "queued in 2 sbatch
    # call(s)", then 27 s of silence)
    assert names(proc.stderr, "hpc-train submit: 2 trial(s) run here", "(the local executor)")
    assert proc.stderr.count("trial(s) ended") == 2 and "hpc-train submit: 2/2 trial(s) ended" in proc.stderr
    assert names(proc.stdout, "2 trial(s) run here", "local executor") and "sbatch" not in proc.stdout
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
    common = [f"out_dir={sweep.parent}", "train.steps=6", "train.log_every_steps=2"]  # the overrides not swept
    assert lines[-1].startswith("in every trial: ") and lines[-1].split(": ", 1)[1].split() == common


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
    assert refused(proc, "results", "--sort lr", "no such column", "use one of ")
    columns = ["trial", "state", "step", "final_loss", "val_loss", "goodput", "run_dir", "out_dir"]
    overrides = ["train.lr", "train.steps", "train.log_every_steps"]
    assert proc.stderr.split("use one of ")[1].strip().split(", ") == [*columns, *overrides]
    proc = run([HPC_TRAIN, "results", str(sweep / "0000")])
    assert proc.returncode == 2 and names(proc.stderr, f"{sweep / '0000'} is not a sweep directory", "sweep.json")


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
    assert [(r["trial"], r["state"]) for r in json.loads(proc.stdout)] == [("0000", "missing"), ("0001", "NOT QUEUED")]
    proc = run([HPC_TRAIN, "status", str(sweep_dir), "--json"])
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    assert rows[0]["state"] == "missing" and rows[1]["total_steps"] == 60
    (warning,) = rows[0]["warnings"]
    assert names(warning, f"{sweep_dir}/0000/config.yaml", "does not exist")
    proc = run([HPC_TRAIN, "status", str(sweep_dir)])  # the table too
    assert proc.returncode == 0 and "missing" in proc.stdout, proc.stderr
    # the trial itself, named alone before any rank wrote an event (review: taken for no run)
    proc = run([HPC_TRAIN, "status", str(sweep_dir / "0001"), "--json"])
    assert proc.returncode == 0 and [r["run"] for r in json.loads(proc.stdout)] == ["mix-1/0001"], proc.stderr


def test_status_shows_a_runs_own_total_steps_never_another_loops() -> None:
    """train.steps is the built-in trainer's: a function's or a script's total is what its loop told (step_end's
    last_step in `first_step`, a script's hpc.log(total_steps=...)), else none."""
    from hpc_train.status import _total_steps, own_steps

    builtin = own_steps({"train": {"steps": 60}, "fn": {"_target_": ""}, "script": {"cmd": []}})
    function = own_steps({"train": {"steps": 60}, "fn": {"_target_": "byo_train.main"}})
    script = own_steps({"train": {"steps": 60}, "script": {"cmd": ["python", "train.py"]}})
    told = [
        {"event": "first_step", "step": 1, "total_steps": 300},
        {"event": "first_step", "step": 41, "total_steps": 200},
    ]
    assert _total_steps(builtin, [], []) == 60
    assert _total_steps(function, [], []) is None and _total_steps(script, [], []) is None
    assert _total_steps(function, told, []) == 200  # the newest attempt's
    assert _total_steps(script, [], [{"step": 5, "total_steps": 40}, {"step": 6}]) == 40


def test_each_trial_of_a_sweep_carries_the_brief_of_its_frozen_config(sweep: Path) -> None:
    """status reads a trial's brief from sweep.json, never its config.yaml (PyYAML: 5 to 13 ms a file); what
    submit wrote there is what the frozen config says."""
    import yaml

    from hpc_train.status import brief

    trials = json.loads((sweep / "sweep.json").read_text())["trials"]
    assert [t["brief"] for t in trials] == [
        brief(yaml.safe_load((Path(t["run_dir"]) / "config.yaml").read_text())) for t in trials
    ]
    assert trials[0]["brief"] == {
        "executor": "local",
        "signal_lead_s": trials[0]["brief"]["signal_lead_s"],
        "spare_nodes": 0,
        "max_failures": 2,  # conf/requeue's default
        "steps": 6,
    }


STATES = ("PENDING", "RUNNING", "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NOT QUEUED", "missing", "REQUEUED")


def random_row(rng, label: str) -> dict:
    from hpc_train.status import COLUMNS

    state = rng.choice(STATES)
    stragglers = rng.random() < 0.1
    return {
        **dict.fromkeys(COLUMNS),
        "run": label,
        "job_id": f"{rng.randrange(10**6)}_{rng.randrange(10**4)}",
        "state": state,
        "attempts": rng.randrange(4),
        "world_size": rng.choice([None, 4, 512]),
        "committed_step": rng.choice([None, rng.randrange(10**6)]),
        "total_steps": rng.choice([None, 10**6]),
        "goodput": rng.choice([None, rng.random()]),
        "tokens_per_s": rng.choice([None, rng.uniform(1, 1e6)]),
        "since_last_event_s": rng.choice([None, rng.uniform(0, 1e5)]),
        "warnings": ["failure budget 2/3 used"] * (rng.random() < 0.1)
        + ["signal lead too short"] * (rng.random() < 0.05),
        "stragglers": 2 if stragglers else 0,
        "last_straggler": ("rank 3 on node12" + rng.choice(["", " (now)"])) if stragglers else "",
    }


def test_status_at_a_glance_keeps_every_invariant() -> None:
    """Random sweeps (seeded; HPC_TRAIN_GLANCE_SEED replays another) of 1 to 300 trials, printed as a pipe gets
    them: every line fits 100 columns; a sweep of more than GLANCE_ROWS trials shows its counts (summing to its
    size) and exactly its first GLANCE_ROWS trials that need a person, in order; a smaller one, or --all, every
    trial; a single run beside it always."""
    import io
    import os
    import random
    import re
    from contextlib import redirect_stdout

    from test_local_ops import table_rows

    from hpc_train.status import GLANCE_ROWS, needs_a_person, print_status

    seed = int(os.environ.get("HPC_TRAIN_GLANCE_SEED", "29"))
    rng = random.Random(seed)
    for case in range(60):
        n = rng.choice([1, GLANCE_ROWS, GLANCE_ROWS + 1, rng.randrange(1, 300)])
        trials = [random_row(rng, f"mix-{case}/{i:04d}") for i in range(n)]
        alone = random_row(rng, f"demo-{case}")
        for every in (False, True):
            out = io.StringIO()
            with redirect_stdout(out):
                print_status([alone, *trials], every=every)
            text = out.getvalue()
            where = f"seed {seed} case {case} (n={n}, every={every})"
            assert max(len(line) for line in text.splitlines()) <= 100, where
            shown = [r["run"] for r in table_rows(text, "run") if r["run"]]  # a wrapped cell's next line: no run
            if every or n <= GLANCE_ROWS:
                assert shown == [alone["run"], *(t["run"] for t in trials)], where
                continue
            flagged = [t["run"] for t in trials if needs_a_person(t)]
            assert shown == [alone["run"], *flagged[:GLANCE_ROWS]], where
            counts = re.search(rf"mix-{case}: ([\d,]+) trials: (.*?)\nmix-{case}: ", text, re.S)  # it may wrap
            assert counts and int(counts[1].replace(",", "")) == n, where
            assert sum(int(c.replace(",", "")) for c in re.findall(r"([\d,]+)\s+[A-Za-z]", counts[2])) == n, where
            assert f"mix-{case}: {len(flagged):,} need a person" in text, where


def test_needs_a_person_flags_failures_warnings_and_stragglers_now_only() -> None:
    from hpc_train.status import COLUMNS, needs_a_person

    row = {**dict.fromkeys(COLUMNS), "state": "RUNNING", "warnings": [], "last_straggler": ""}
    assert not needs_a_person(row) and not needs_a_person({**row, "state": "COMPLETED"})
    assert not needs_a_person({**row, "state": "NOT QUEUED"}) and not needs_a_person({**row, "state": "PENDING"})
    assert needs_a_person({**row, "state": "FAILED"}) and needs_a_person({**row, "state": "missing"})
    assert needs_a_person({**row, "warnings": ["no event for 20 min"]})
    assert needs_a_person({**row, "last_straggler": "rank 1 on node2 (now)"})
    assert not needs_a_person({**row, "last_straggler": "rank 1 on node2"})  # cleared since
    assert not needs_a_person({**row, "state": "CANCELLED", "finished": True})  # cancelled after its finish


def synthetic_sweep(root: Path, n: int, failed: set[int], finished: set[int]) -> Path:
    """A local sweep's folder as submit and its trials leave it, written directly: sweep.json with each
    trial's brief, a folder per trial; `finished` trials with a start, a finish and summary.json (final_loss
    = the index / 1000), `failed` ones with a start, a fail and a stop. The others have not run yet."""
    from hpc_train import journal

    sweep_dir = root / "big-1"
    brief = {"executor": "local", "signal_lead_s": 120, "spare_nodes": 0, "max_failures": 3, "steps": 60}
    trials = []
    for i in range(n):
        run_dir = sweep_dir / f"{i:04d}"
        (run_dir / "checkpoints").mkdir(parents=True)
        job = str(10**6 + i) if i in failed | finished else None
        trials.append({"index": i, "overrides": [f"train.lr={i}e-5"], "run_dir": str(run_dir), "job_id": job})
        trials[-1]["brief"] = brief
        if job is None:
            continue
        journal.log(run_dir, journal.START, 0, job, 0, world_size=1)
        if i in finished:
            (run_dir / "summary.json").write_text(json.dumps({"final_step": 60, "final_loss": i / 1000}))
            journal.log(run_dir, journal.FINISH, 60, job, 0, final_step=60)
        else:
            journal.log(run_dir, journal.FAIL, 10, job, 0, rank=0, error="boom")
            journal.log(run_dir, journal.STOPPED, 10, job, 0, reason=f"trial {i} failed: boom")
    (sweep_dir / "sweep.json").write_text(json.dumps({"sweep_dir": str(sweep_dir), "trials": trials}))
    return sweep_dir


def test_status_and_results_of_a_big_sweep_fit_one_screen(tmp_path: Path) -> None:
    """Before: one row per trial, 142 columns wide. Now a sweep of 300 trials, 2 failed: its counts and the 2
    failed trials, 100 columns wide; --all every trial; --json every row; results the 5 best and 5 worst."""
    from test_local_ops import table_rows

    sweep_dir = synthetic_sweep(tmp_path, 300, failed={17, 230}, finished=set(range(100, 150)))
    proc = run([HPC_TRAIN, "status", str(sweep_dir)])
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert names(lines[0], "big-1: 300 trials", "248 NOT QUEUED", "50 COMPLETED", "2 FAILED")
    assert names(proc.stdout, "big-1: 2 need a person", "--all")
    assert [r["run"] for r in table_rows(proc.stdout, "run") if r["run"]] == ["big-1/0017", "big-1/0230"]
    assert max(map(len, lines)) <= 100 and len(lines) < 25
    every = run([HPC_TRAIN, "status", str(sweep_dir), "--all"]).stdout
    assert len([r for r in table_rows(every, "run") if r["run"]]) == 300  # a wrapped warning: a row without a run
    assert len(json.loads(run([HPC_TRAIN, "status", str(sweep_dir), "--json"]).stdout)) == 300
    wide = run([HPC_TRAIN, "status", str(sweep_dir), "--wide"]).stdout
    assert {"restarts", "MFU"} <= set(table_rows(wide, "run")[0]) and "MFU" not in table_rows(proc.stdout, "run")[0]
    results = run([HPC_TRAIN, "results", str(sweep_dir)]).stdout
    trials = [r["trial"] for r in table_rows(results, "trial")]
    assert trials == ["0100", "0101", "0102", "0103", "0104", "...", "0145", "0146", "0147", "0148", "0149"]
    assert names(results, "5 first and last of 50 trials", "final_loss", "250 without", "--all")
    assert len(table_rows(run([HPC_TRAIN, "results", str(sweep_dir), "--all"]).stdout, "trial")) == 300


def test_the_help_names_the_glance_limits_status_uses() -> None:
    """cli writes them as numbers (it imports status only when a command runs)."""
    from hpc_train.status import GLANCE_ROWS, RESULTS_FEW, WIDE_WIDTH

    status_help = run([HPC_TRAIN, "status", "--help"]).stdout
    results_help = run([HPC_TRAIN, "results", "--help"]).stdout
    assert f"of more than {GLANCE_ROWS}" in " ".join(status_help.split()) and f"{WIDE_WIDTH} wide" in status_help
    assert f"the {RESULTS_FEW} first and last" in " ".join(results_help.split())


def test_status_says_unknown_for_a_scripts_goodput_nothing_tells(tmp_path: Path) -> None:
    import io
    from contextlib import redirect_stdout

    from test_local_ops import table_rows

    from hpc_train import journal
    from hpc_train.runs import Run
    from hpc_train.status import print_status, status_rows

    journal.log(tmp_path, journal.START, 0, "7", 0, target="script", launched_at=0.0)
    journal.log(tmp_path, journal.REQUEUE, 0, "7", 0, reason="preempt")
    brief = {"executor": "local", "signal_lead_s": 120, "spare_nodes": 0, "max_failures": 2, "steps": None}
    (row,) = status_rows([Run(tmp_path, "script-1", "7", "local", tmp_path / "submitit", brief=brief)])
    assert row["goodput"] is None and row["attempts"] == 1
    out = io.StringIO()
    with redirect_stdout(out):
        print_status([row])
    assert table_rows(out.getvalue(), "run")[0]["goodput"] == "unknown"


def test_review_of_the_glance_an_unreadable_trial_a_remade_folder_and_a_silent_slurm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review: (1) a trial made owner-only after submit wrote its brief was a PermissionError traceback (the brief
    skipped the config read that used to say `unreadable`); (2) a trial folder deleted and made again by a
    resubmit kept the brief of the config it had; (3) with squeue and sacct down every trial was "needing a
    person"; (4) a trial with a node left out was not listed, so its note was never printed."""
    import io
    from contextlib import redirect_stdout
    from types import SimpleNamespace

    from hpc_train import journal, submit
    from hpc_train.plan import Trial
    from hpc_train.runs import Run
    from hpc_train.status import COLUMNS, needs_a_person, print_status, status_rows

    brief = {"executor": "local", "signal_lead_s": 120, "spare_nodes": 0, "max_failures": 2, "steps": 60}
    journal.log(tmp_path, journal.START, 0, "7", 0)
    real_read = journal.read

    def denied(run_dir: Path) -> list:
        raise PermissionError(13, "Permission denied", str(run_dir / "events.jsonl"))

    monkeypatch.setattr(journal, "read", denied)
    (row,) = status_rows([Run(tmp_path, "s-1/0003", "7", "local", tmp_path / "submitit", brief=brief)])
    assert row["state"] == "unreadable: permission denied" and "events.jsonl" in row["warnings"][0]
    monkeypatch.setattr(journal, "read", real_read)

    def config(steps: int) -> dict:
        return {
            "cluster": {"executor": "local", "signal_lead_s": 120},
            "requeue": {"max_failures": 2},
            "train": {"steps": steps},
        }

    p = SimpleNamespace(private=False, dir_mode=0o755)
    kept = Trial(0, [], str(tmp_path / "0000"), brief={**brief, "steps": 60})
    submit._freeze_trial(kept, config(60), p, "{}", None)
    submit._freeze_trial(kept, config(999), p, "{}", None)  # frozen already: conf/ changed since, the brief stays
    assert kept.brief["steps"] == 60
    remade = Trial(1, [], str(tmp_path / "0001"), brief={**brief, "steps": 60})  # its folder was deleted
    submit._freeze_trial(remade, config(500), p, "{}", None)
    assert remade.brief["steps"] == 500 and (tmp_path / "0001" / "config.yaml").exists()

    row = {**dict.fromkeys(COLUMNS), "run": "s-1/0001", "state": "unknown", "warnings": [], "state_error": "down"}
    assert not needs_a_person(row)
    assert needs_a_person({**row, "state": "RUNNING", "state_error": None, "excluded_nodes": {"node2": "sick"}})
    rows = [{**row, "run": f"big-1/{i:04d}", "state": "RUNNING", "state_error": None} for i in range(30)]
    rows[7]["excluded_nodes"] = {"node2": "marked sick"}
    out = io.StringIO()
    with redirect_stdout(out):
        print_status(rows)
    assert "big-1/0007: node2 left out: marked sick" in out.getvalue()


def test_a_squeezed_table_wraps_a_long_label_and_keeps_the_warnings_readable() -> None:
    """Review: every column but the warnings was cut at 100 columns (`pretrain-llama-ablation-7/012` for /0123,
    `1200/500` for 1200/5000, `RUNNIN`), and the warnings column could be squeezed to nothing: now a cell
    wraps whole, and the warnings keep 24 columns."""
    import io
    from contextlib import redirect_stdout

    from hpc_train.status import COLUMNS, print_status

    row = {**dict.fromkeys(COLUMNS), "run": "pretrain-llama-ablation-7/0123", "job_id": "1234567_123"}
    row.update(state="RUNNING", attempts=3, committed_step=1200, total_steps=5000, goodput=0.5, tokens_per_s=123456.0)
    row.update(mfu=0.41, since_last_event_s=12.0, warnings=["failure budget 2/3 used", "signal lead too short"])
    out = io.StringIO()
    with redirect_stdout(out):
        print_status([row])
    text = out.getvalue()
    cells = "".join(line.replace("│", " ") for line in text.splitlines())
    for word in ("pretrain-llama-ablati", "1200/5000", "RUNNING", "failure", "budget", "2/3", "signal", "lead"):
        assert word in cells, (word, text)
    assert max(len(line) for line in text.splitlines()) <= 100
