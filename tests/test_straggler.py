"""Stragglers named and live metrics: the pure judge, the Prometheus text from plain files, `status
--prometheus`, rank 0's endpoint scraped while a local run trains, and on the dev cluster a clean
1,000-step run with no straggler, then the slow-rank drill named within a bounded number of steps."""

from __future__ import annotations

import json
import math
import re
import socket
import statistics
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from conftest import HPC_TRAIN, read_events, refused, run, submit, wait_finished, wait_until

from hpc_train import prometheus
from hpc_train.journal import straggler_episodes as straggler_rows
from hpc_train.journal import stragglers_now as current
from hpc_train.status import stragglers
from hpc_train.straggler import Judge, StragglerConfig, judge, medians_of_others

# One sample line of the text exposition format: name{label="value",...} value
SAMPLE = re.compile(
    r'^[a-zA-Z_:][a-zA-Z0-9_:]*\{([a-zA-Z_][a-zA-Z0-9_]*="(\\.|[^"\\\n])*",?)*\} '
    r"(NaN|[+-]Inf|-?[0-9.]+(e[+-]?[0-9]+)?)$"
)
COMMENT = re.compile(r"^# (HELP|TYPE) [a-zA-Z_:][a-zA-Z0-9_:]* .+$")


def parse(text: str) -> dict[tuple[str, str], float]:
    """{(metric, run label): value}; every line must be a sample or a HELP/TYPE comment."""
    out = {}
    for line in text.splitlines():
        assert SAMPLE.match(line) or COMMENT.match(line), line
        if not line.startswith("#"):
            name, rest = line.split("{", 1)
            run_label = re.search(r'run="((\\.|[^"\\])*)"', rest).group(1)
            out[(name, run_label)] = float(rest.rsplit(" ", 1)[1])
    return out


def test_judge_names_after_k_windows_ignores_noise_and_clears() -> None:
    cfg = StragglerConfig(every_steps=20, factor=1.5, floor_s=0.002, windows=3)
    j = Judge()
    slow = [0.005, 0.005, 0.005, 0.020]  # rank 3: 20 ms of its own per step, the others 5 ms
    assert judge(j, slow, cfg)[:2] == ([], [])  # the attempt's first window: not judged
    assert judge(j, slow, cfg)[:2] == ([], [])
    assert judge(j, slow, cfg)[:2] == ([], [])
    named, cleared, medians = judge(j, slow, cfg)  # the third slow window in a row
    assert (named, cleared, medians[3]) == ([3], [], 0.005)
    assert judge(j, slow, cfg)[:2] == ([], [])  # named once, not every window
    normal = [0.005] * 4
    assert judge(j, normal, cfg)[:2] == ([], []) and judge(j, normal, cfg)[:2] == ([], [])
    assert judge(j, normal, cfg)[:2] == ([], [3])  # three normal windows in a row: cleared
    # 1.9 ms on a 1 ms step is 1.9x, but 0.9 ms above the others: below floor_s, noise, never named
    # windows=1: the first window of an attempt (compilation, cold caches) names nobody; the second does
    once = StragglerConfig(every_steps=20, factor=1.5, floor_s=0.002, windows=1)
    fresh = Judge()
    assert [judge(fresh, slow, once)[0] for _ in range(2)] == [[], [3]]
    quiet = Judge()
    assert all(judge(quiet, [0.001, 0.001, 0.0019], cfg)[:2] == ([], []) for _ in range(10))
    # slow every other window: never `windows` in a row
    flapping = Judge()
    assert all(judge(flapping, [0.005, 0.005, 0.02 if k % 2 else 0.005], cfg)[:2] == ([], []) for k in range(10))
    # two ranks: the other's time is the yardstick (the median of both would hide a 3x slower rank)
    pair = Judge()
    assert [judge(pair, [0.005, 0.012], cfg)[0] for _ in range(4)] == [[], [], [], [1]]


def test_median_of_the_others_matches_the_definition() -> None:
    cases = [[1.0], [1.0, 2.0], [3.0, 1.0, 2.0], [1.0, 1.0, 5.0, 2.0], [4.0, 4.0, 4.0, 4.0, 9.0]]
    for xs in cases:
        got = medians_of_others(xs)
        for i in range(len(xs)):
            rest = xs[:i] + xs[i + 1 :]
            assert (math.isnan(got[i]) and not rest) or got[i] == statistics.median(rest), (xs, i, got)


def write_run(run_dir: Path, events: list[dict], metrics: list[dict], job_id: str = "77") -> Path:
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text("cluster: {executor: local}\n")
    (run_dir / "submission.json").write_text(json.dumps({"executor": "local", "job_id": job_id}))
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    return run_dir


def ev(t: float, name: str, step: int, restart: int = 0, **fields) -> dict:
    return {"time": t, "event": name, "step": step, "job_id": "77", "restart": restart, **fields}


EVENTS = [
    ev(100, "start", 0, launched_at=90.0),
    ev(101, "first_step", 1, step_time_s=0.5),
    ev(110, "checkpoint_committed", 20, reason="periodic", stall_s=0.1),
    ev(111, "straggler", 20, rank=3, node="node4", own_s=0.02, median_own_s=0.005, comm_s=0.0),
    ev(112, "straggler_cleared", 40, rank=3, node="node4", own_s=0.005, median_own_s=0.005),
    ev(113, "straggler", 60, rank=1, node="node2", own_s=0.03, median_own_s=0.005, comm_s=0.001),
    ev(114, "checkpoint_committed", 60, reason="periodic", stall_s=0.1),
]


def test_prometheus_text_from_plain_files(tmp_path: Path) -> None:
    rows = [
        {
            "time": 100.0 + s,
            "step": s,
            "loss": 2.0 / s,
            "tokens_per_s": 1000.0 * s,
            "mfu": None,
            "data_wait_fraction": 0.01,
            "step_time_s": 0.5,
        }
        for s in range(10, 70, 10)
    ]
    run_dir = write_run(tmp_path / 'we"ird\\run', EVENTS, rows)
    text = prometheus.run_text(run_dir, "77")
    values = parse(text)
    label = 'we\\"ird\\\\run'  # escaped as the format says: \" and \\
    assert values[("hpc_train_step", label)] == 60 and values[("hpc_train_loss", label)] == 2.0 / 60
    assert values[("hpc_train_tokens_per_second", label)] == 60000.0
    assert math.isnan(values[("hpc_train_mfu", label)])  # CPU: no peak, NaN, no crash
    assert values[("hpc_train_committed_step", label)] == 60 and values[("hpc_train_attempt", label)] == 0
    assert values[("hpc_train_stragglers", label)] == 1 and values[("hpc_train_straggler_events", label)] == 2
    assert 0 < values[("hpc_train_goodput", label)] < 1
    assert text.count("# TYPE hpc_train_step gauge") == 1
    # status and report read the same events
    assert stragglers(EVENTS) == (2, "rank 1 on node2 (now)")
    assert [(r["rank"], r["cleared_step"]) for r in straggler_rows(EVENTS)] == [(3, 40), (1, None)]
    assert current([*EVENTS, ev(200, "start", 60, restart=1)]) == {}  # a new attempt starts with none named


def test_tail_rows_reads_only_the_end(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"time": 1.0, "step": s, "loss": 1.0}) + "\n" for s in range(20000)))
    rows = prometheus.tail_rows(path, tail_bytes=4096)
    assert (
        rows[-1]["step"] == 19999
        and 0 < len(rows) < 200
        and [r["step"] for r in rows] == list(range(rows[0]["step"], 20000))
    )


def test_status_prometheus_prints_every_run_in_a_folder(tmp_path: Path) -> None:
    write_run(tmp_path / "runs" / "a-1", EVENTS, [{"time": 1.0, "step": 60, "loss": 0.5}])
    write_run(tmp_path / "runs" / "b-1", [], [], job_id="78")  # submitted, nothing logged yet
    proc = run([HPC_TRAIN, "status", str(tmp_path / "runs"), "--prometheus"])
    assert proc.returncode == 0, proc.stderr
    values = parse(proc.stdout)
    assert values[("hpc_train_step", "a-1")] == 60 and values[("hpc_train_stragglers", "a-1")] == 1
    assert math.isnan(values[("hpc_train_step", "b-1")]) and values[("hpc_train_straggler_events", "b-1")] == 0
    assert 'slurm_job="78"' in proc.stdout
    (tmp_path / "runs" / "latest").symlink_to("a-1")  # a link to a run: still one series
    again = run([HPC_TRAIN, "status", str(tmp_path / "runs"), "--prometheus"]).stdout
    assert again == proc.stdout and again.count("hpc_train_step{") == 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_endpoint_scraped_while_training_and_a_busy_port_is_not_fatal(tmp_path: Path) -> None:
    """Local executor, 2 ranks: rank 0's endpoint answers mid-run with the values of a metrics.jsonl row.
    A second run whose port is taken trains on, says why in events.jsonl, and writes its textfile."""
    port = free_port()
    run_dir, _ = submit(
        [
            "train.steps=400",
            "train.min_step_time_s=0.02",
            f"metrics.prometheus_port={port}",
            f"out_dir={tmp_path}",
            "name=scraped",
            "--no-wait",
        ]
    )

    def scrape() -> dict:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                return parse(r.read().decode())
        except OSError:
            return {}

    seen = wait_until(
        lambda: (v := scrape()).get(("hpc_train_step", run_dir.name), 0) >= 50 and v,
        120,
        "the endpoint to show step 50",
    )
    rows = {m["step"]: m for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}
    step = int(seen[("hpc_train_step", run_dir.name)])
    assert seen[("hpc_train_loss", run_dir.name)] == rows[step]["loss"]
    assert seen[("hpc_train_tokens_per_second", run_dir.name)] == rows[step]["tokens_per_s"]
    assert math.isnan(seen[("hpc_train_mfu", run_dir.name)])

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        taken_dir, job = submit(
            [
                "train.steps=30",
                "train.min_step_time_s=0.2",
                f"metrics.prometheus_port={taken.getsockname()[1]}",
                f'metrics.prometheus_textfile="{tmp_path}/hpc_{{job}}.prom"',
                f"out_dir={tmp_path}",
                "name=taken",
                "--no-wait",
            ]
        )
        textfile = tmp_path / f"hpc_{job}.prom"  # {job}: the job id (here the local controller's pid)
        wait_until(textfile.exists, 120, "the textfile")
        assert ("hpc_train_attempt", "taken-1") in parse(textfile.read_text())
        wait_until(lambda: (taken_dir / "summary.json").exists(), 120, "the run with a taken port to finish")
    failed = [e for e in read_events(taken_dir) if e["event"] == "prometheus_failed"]
    assert failed and "in use" in failed[0]["error"]
    wait_until(lambda: not textfile.exists(), 30, "the textfile removed at the end")
    assert not list(tmp_path.glob("*.prom*")) and not list(tmp_path.glob(".hpc_*"))
    wait_until(lambda: (run_dir / "summary.json").exists(), 120, "the scraped run to finish")


@pytest.mark.slurm
def test_dev_cluster_clean_1000_steps_then_the_slow_rank_is_named(slurm_env: dict[str, str], tmp_path: Path) -> None:
    """4 ranks on 2 nodes: no straggler in the first 1,000 steps (the dev cluster's ranks share 2 cores with
    every other process: the noisiest place we have), then `chaos slow-rank` makes rank 3 work 20 ms more
    per step; it is named within (windows + 1) x every_steps steps of the step it was armed at (the last
    metrics row logged before the `chaos` event: up to one log interval, 10 steps, early), with its node,
    and cleared once the drill is off."""
    every, windows = 20, 3
    run_dir, job_id = submit(
        [
            "cluster=dev",
            "cluster.nodes=2",
            "train.steps=1500",  # 1,000 clean, named within ~90, cleared within ~70: ~300 to spare (it was 2,000)
            "checkpoint.every_steps=500",
            f"straggler.every_steps={every}",
            f"straggler.windows={windows}",
            f"out_dir={tmp_path}",
            "name=slow",
        ],
        env=slurm_env,
    )

    def last_step() -> int:
        path = run_dir / "metrics.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        return json.loads(lines[-2 if len(lines) > 1 else -1])["step"] if lines else 0  # [-1] may be mid-write

    wait_until(lambda: last_step() >= 1000, 240, "1,000 clean steps")
    drill_s = 0.02
    chaos = run(
        [HPC_TRAIN, "chaos", str(run_dir), "slow-rank", "--rank", "3", "--seconds", str(drill_s)], env=slurm_env
    )
    assert chaos.returncode == 0, chaos.stderr
    named = wait_until(lambda: [e for e in read_events(run_dir) if e["event"] == "straggler"], 120, "a straggler event")
    armed_at = next(e["time"] for e in read_events(run_dir) if e["event"] == "chaos")  # just after the drill file
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()[:-1]]
    armed_after = max(m["step"] for m in rows if m["time"] <= armed_at)
    assert armed_after >= 1000
    start = next(e for e in read_events(run_dir) if e["event"] == "start")
    assert [(e["rank"], e["node"]) for e in named] == [(3, start["rank_nodes"][3])]  # nobody named before the drill
    assert named[0]["step"] - armed_after <= (windows + 1) * every + 10, (named[0]["step"], armed_after)
    # The drill's CPU is in rank 3's compute time and not in the others' own time, whose median stays below rank
    # 3's by most of it (they wait for rank 3 in comm). An order, not a speed: the others' own time per step was
    # 7.7 ms on an idle dev cluster (straggler.py), 16.7 ms on a loaded machine, where "< 15 ms" failed.
    assert named[0]["compute_s"] >= drill_s and named[0]["compute_s"] - named[0]["median_own_s"] > drill_s / 2, named
    status = json.loads(run([HPC_TRAIN, "status", str(run_dir), "--json"], env=slurm_env).stdout)[0]
    print(run([HPC_TRAIN, "status", str(run_dir), "--wide"], env=slurm_env).stdout)  # docs/operations.md (pytest -s)
    assert status["stragglers"] == 1 and status["last_straggler"] == f"rank 3 on {start['rank_nodes'][3]} (now)"
    run([HPC_TRAIN, "chaos", str(run_dir), "slow-rank", "--rank", "3", "--seconds", "0"], env=slurm_env)
    wait_finished(run_dir, job_id, slurm_env)
    events = read_events(run_dir)
    assert [e["rank"] for e in events if e["event"] == "straggler_cleared"] == [3]
    assert [e["rank"] for e in events if e["event"] == "straggler"] == [3]
    logs = (run_dir / "submitit").glob("*_0_log.out")
    said = [
        line for p in logs for line in p.read_text().splitlines() if line.startswith("[hpc_train rank 0] straggler: ")
    ]
    assert any(re.search(r"rank 3 on \w+: [\d.]+ ms/step", line) for line in said), said
    report = run([HPC_TRAIN, "report", str(run_dir)], env=slurm_env)
    assert report.returncode == 0 and "stragglers" in report.stdout, report.stdout + report.stderr


def test_an_idle_connection_neither_blocks_a_scrape_nor_close(tmp_path: Path) -> None:
    """A client that connects and sends nothing (a port scanner, a stuck scraper): another scrape is
    answered and close() returns, or rank 0 would never reach its requeue decision or its exit."""
    import threading

    port = free_port()
    exporter = prometheus.start("127.0.0.1", port, "", "1", lambda: "hpc_train_step 1\n", lambda *a, **k: None)
    idle = socket.create_connection(("127.0.0.1", port))
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            assert r.read() == b"hpc_train_step 1\n"
        closer = threading.Thread(target=exporter.close, daemon=True)
        closer.start()
        closer.join(10)  # a bound on a hang (forever before), not a speed figure
        assert not closer.is_alive(), "Exporter.close() hangs while a connection is idle"
    finally:
        idle.close()


def test_chaos_slow_rank_refuses_what_would_hang_or_do_nothing(tmp_path: Path) -> None:
    """--seconds inf/1e9 would hang the rank every step until the watchdog (and the drill file re-fires on
    every attempt), NaN and --rank 99 would arm nothing yet report success, no --seconds took slow-storage's 2 s."""
    from hpc_train import drills, runs

    run_dir = write_run(tmp_path / "slow-1", [ev(100, "start", 0, world_size=4)], [])
    run_ = runs.find_runs(run_dir)[0]
    for rank, seconds, says in [
        (99, 0.02, "slow-1 has 4 ranks; give 0 to 3"),
        (-1, 0.02, "give 0 to 3"),
        (3, math.inf, "--seconds inf"),
        (3, math.nan, "--seconds nan"),
        (3, 1e9, "0 to 10"),
        (3, None, "needs --seconds"),
    ]:
        with pytest.raises(ValueError, match=re.escape(says)):
            drills.chaos(run_, "slow-rank", rank, seconds)
    assert not (run_dir / "drills").exists() or not list((run_dir / "drills").iterdir())
    assert drills.chaos(run_, "slow-rank", 3, 0.02) == "rank 3 works 0.02 s more per step"
    assert (run_dir / "drills" / "slow_rank_3").read_text() == "0.02\n"
    proc = run([HPC_TRAIN, "chaos", str(run_dir), "slow-rank", "--rank", "99", "--seconds", "0.02"])
    assert refused(proc, "chaos", "slow-rank --rank 99", "slow-1 has 4 ranks")
    proc = run([HPC_TRAIN, "chaos", str(run_dir), "slow-rank", "--rank", "1"])
    assert proc.returncode == 2 and "needs --seconds" in proc.stderr and proc.stderr.strip().count("\n") == 0


def test_events_are_parsed_once_then_only_what_was_appended(tmp_path: Path) -> None:
    """Rank 0 renders every 15 s on its training thread and on every scrape: 30 k events parsed whole took
    0.34 s each time. The second read parses only the appended line; a torn line waits for its newline."""
    from hpc_train.journal import read as read_all

    events = [ev(100 + k, "checkpoint_committed", k, reason="periodic", stall_s=0.0) for k in range(30000)]
    run_dir = write_run(tmp_path / "long-1", [ev(99, "start", 0), *events], [])
    path = run_dir / "events.jsonl"
    first = prometheus.values(run_dir)
    assert first["hpc_train_committed_step"] == 29999
    assert prometheus.JOURNALS[path].read_bytes == path.stat().st_size  # the first read: the whole file
    line = json.dumps(ev(200000, "checkpoint_committed", 40000, reason="periodic", stall_s=0.0)) + "\n"
    with open(path, "a") as f:
        f.write(line[:20])  # the writer is mid-line
    assert prometheus.values(run_dir)["hpc_train_committed_step"] == 29999
    assert prometheus.JOURNALS[path].read_bytes == 0
    with open(path, "a") as f:
        f.write(line[20:])
    assert prometheus.values(run_dir)["hpc_train_committed_step"] == 40000
    assert prometheus.JOURNALS[path].read_bytes == len(line)  # only the appended line, not 30 k events again
    assert prometheus.events_of(run_dir) == read_all(run_dir)
    path.write_text(json.dumps(ev(1, "start", 0)) + "\n")  # replaced (a new inode or shorter): read again
    assert prometheus.events_of(run_dir) == read_all(run_dir) and len(read_all(run_dir)) == 1


def test_textfile_per_job_and_removed_when_the_attempt_ends(tmp_path: Path) -> None:
    """Two jobs on one node with the same setting write two files ({job}); each goes when its attempt ends,
    so node-exporter does not export a finished run's frozen values."""
    pattern = str(tmp_path / "hpc_train_{job}.prom")
    a = prometheus.start("127.0.0.1", 0, pattern, "11_0", lambda: "hpc_train_step 1\n", lambda *a, **k: None)
    b = prometheus.start("127.0.0.1", 0, pattern, "11_1", lambda: "hpc_train_step 2\n", lambda *a, **k: None)
    assert (tmp_path / "hpc_train_11_0.prom").read_text() == "hpc_train_step 1\n"
    assert (tmp_path / "hpc_train_11_1.prom").read_text() == "hpc_train_step 2\n"
    a.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hpc_train_11_1.prom"]
    b.close()
    assert not list(tmp_path.iterdir())


def test_a_sweep_trial_is_one_series_from_its_endpoint_and_from_status(tmp_path: Path) -> None:
    """The endpoint (train.py's run_text) and `status --prometheus` label a trial alike (SWEEP/0003), or
    one trial would be two series; `slurm_job`, since Prometheus renames a target's own `job` label."""
    sweep = tmp_path / "mix-1"
    trial = write_run(sweep / "0003", EVENTS, [{"time": 1.0, "step": 60, "loss": 0.5}], job_id="12_3")
    (sweep / "sweep.json").write_text(json.dumps({"trials": [{"run_dir": str(trial), "job_id": "12_3"}]}))
    proc = run([HPC_TRAIN, "status", str(sweep), "--prometheus"])
    assert proc.returncode == 0, proc.stderr

    def label_sets(text: str) -> set[str]:
        return {line[line.index("{") : line.index("}") + 1] for line in text.splitlines() if not line.startswith("#")}

    assert (
        label_sets(prometheus.run_text(trial, "12_3"))
        == label_sets(proc.stdout)
        == {'{slurm_job="12_3",run="mix-1/0003"}'}
    )


def test_a_malformed_row_never_stops_training_nor_prints_a_traceback_per_scrape(tmp_path: Path, capsys, caplog) -> None:
    """step_time_s null in metrics.jsonl (goodput's median) and a straggler event without a rank (current)
    are rendered around; any other failure warns once, tick() goes on and the endpoint answers 500."""
    run_dir = write_run(
        tmp_path / "odd-1",
        [*EVENTS, ev(115, "straggler", 70, node="node9")],
        [{"time": 120.0, "step": 70, "loss": 0.5, "step_time_s": None}],
    )
    got = prometheus.values(run_dir)
    assert got["hpc_train_step"] == 70 and got["hpc_train_stragglers"] == 1 and 0 <= got["hpc_train_goodput"] <= 1

    def broken() -> str:
        raise TypeError("'<' not supported between instances of 'NoneType' and 'float'")

    port = free_port()
    exporter = prometheus.start("127.0.0.1", port, str(tmp_path / "x.prom"), "1", broken, lambda *a, **k: None)
    exporter.tick(force=True)  # no raise: the training thread goes on
    with pytest.raises(urllib.error.HTTPError) as answer:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10)
    assert answer.value.code == 500 and answer.value.read().decode().count("\n") == 1
    exporter.close()
    said = [r for r in caplog.records if r.name == "hpc_train.prometheus"]
    assert len(said) == 1 and said[0].levelname == "WARNING" and "TypeError" in said[0].getMessage()  # not per scrape
    assert "Traceback" not in capsys.readouterr().err


def test_goodput_gauge_moves_while_an_attempt_runs_and_report_figures_stay(tmp_path: Path) -> None:
    """A running attempt ended at its last event (a checkpoint): the gauge froze between checkpoints.
    live=True ends it at the last metrics row, the steps since the commit lost; report's figures unchanged."""
    from hpc_train.journal import goodput

    events = [
        ev(100, "start", 0, launched_at=90.0),
        ev(110, "checkpoint_committed", 20, reason="periodic", stall_s=0.0),
    ]
    rows = [{"time": 100.0 + s, "step": s, "step_time_s": 0.5} for s in range(10, 60, 10)]
    early = prometheus.values(write_run(tmp_path / "a", events, rows[:2]))["hpc_train_goodput"]  # step 20 at t=120
    later = prometheus.values(write_run(tmp_path / "b", events, rows))["hpc_train_goodput"]  # step 50 at t=150
    assert early != later
    parts = goodput(events, rows, live=True)  # 90 -> 150: 10 s overhead, 30 steps x 0.5 s lost
    assert (parts["allocated"], parts["overhead"], parts["lost"]) == (60.0, 10.0, 15.0)
    assert goodput(events, rows)["allocated"] == 20.0  # without live (report, status): to the last event
    finished = [*events, ev(160, "finish", 50)]
    assert goodput(finished, rows, live=True) == goodput(finished, rows)  # a finished attempt: as report says
