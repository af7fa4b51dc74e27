"""The embedded default: submitit's local executor on this machine, no Slurm involved."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from pathlib import Path

import torch
from conftest import HPC_TRAIN, names, read_events, run, submit, wait_until
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

# 2 ranks: the local runs' lifecycle at the fewest ranks that all-reduce (each rank's start is ~4.5 CPU-s on the
# suite's 2 cores, torch's import and DDP's of torch._dynamo); the tests that need more say so (4 below).
ARGS = ["train.steps=40", "checkpoint.every_steps=10", "cluster.tasks_per_node=2"]


def test_demo_runs_checkpoints_and_finishes(tmp_path: Path) -> None:
    """`hpc-train submit` with no overrides waits for the local job and prints its summary."""
    proc = run([HPC_TRAIN, "submit", f"out_dir={tmp_path}"], timeout_s=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_dir = tmp_path / "demo-1"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["final_step"] == 60 and summary["final_loss"] < 5.0
    finished, report, logs = proc.stdout.splitlines()[-3:]
    assert names(finished, "finished demo-1", "60 steps", f"final loss {summary['final_loss']:.4f}", str(run_dir))
    # the next commands, as one pastes them
    assert report.startswith("next: ") and report.split("#")[0].split()[1:] == ["hpc-train", "report", str(run_dir)]
    assert f"{run_dir}/report.png" in report and logs.split("#")[0].split() == ["hpc-train", "logs", str(run_dir)]
    assert [e["event"] for e in read_events(run_dir)][:2] == ["preflight", "start"]  # every node checked first
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_000040", "step_000060"]  # keep_last=2
    assert (run_dir / "config.yaml").exists()


def test_checkpoint_is_readable_by_torch_tools(tmp_path: Path) -> None:
    run_dir, _ = submit([f"out_dir={tmp_path}", *ARGS, "train.steps=10"])
    wait_until(lambda: (run_dir / "summary.json").exists(), 240, "summary.json")
    dcp_to_torch_save(run_dir / "checkpoints" / "step_000010", tmp_path / "plain.pt")
    state = torch.load(tmp_path / "plain.pt", weights_only=True)
    assert state["model"]["tok.weight"].shape == (256, 64)
    assert set(state["optim"]["state"]["tok.weight"]) == {"step", "exp_avg", "exp_avg_sq"}


def test_sigterm_resume_is_bit_exact(tmp_path: Path) -> None:
    """SIGTERM to the local job (as a preemption would) -> save, requeue in place, resume, same weights."""
    ref_dir, _ = submit([f"out_dir={tmp_path}", "name=ref", *ARGS])
    run_dir, job_id = submit([f"out_dir={tmp_path}", "name=cut", *ARGS, "train.min_step_time_s=0.2", "--no-wait"])
    wait_until(
        lambda: any(e["event"] == "checkpoint_committed" for e in read_events(run_dir)), 120, "the first checkpoint"
    )
    os.kill(int(job_id), signal.SIGTERM)  # submitit's local controller forwards it to every rank
    wait_until(lambda: (run_dir / "summary.json").exists(), 240, "summary.json after resume")
    wait_until(lambda: (ref_dir / "summary.json").exists(), 240, "the reference summary")
    ref = json.loads((ref_dir / "summary.json").read_text())
    cut = json.loads((run_dir / "summary.json").read_text())
    assert cut == ref
    events = read_events(run_dir)
    names = [e["event"] for e in events]
    assert names.count("start") == 2 and "requeue" in names and names[-1] == "finish"
    signal_step = next(e["step"] for e in events if e["event"] == "signal")
    assert [e["step"] for e in events if e["event"] == "start"] == [0, signal_step]


def test_status_logs_and_report_of_a_local_run(tmp_path: Path) -> None:
    run_dir, _ = submit([f"out_dir={tmp_path}", *ARGS, "train.steps=20"])
    wait_until(lambda: (run_dir / "summary.json").exists(), 240, "summary.json")
    rows = json.loads(run([HPC_TRAIN, "status", str(tmp_path), "--json"]).stdout)
    assert [(r["run"], r["state"], r["attempts"], r["committed_step"], r["total_steps"]) for r in rows] == [
        ("demo-1", "COMPLETED", 1, 20, 20)
    ]
    assert rows[0]["tokens_per_s"] > 0 and rows[0]["mfu"] is None
    log = run([HPC_TRAIN, "logs", str(run_dir), "--rank", "1", "--attempt", "0"]).stdout
    assert log.startswith("==== hpc_train attempt 0 rank 1 ====")
    missing = run([HPC_TRAIN, "logs", str(run_dir), "--rank", "7"])
    assert missing.returncode == 2 and "no log for rank 7 of demo-1" in missing.stderr
    report = run([HPC_TRAIN, "report", str(run_dir)])
    assert report.returncode == 0 and "goodput" in report.stdout and (run_dir / "report.png").exists()
    png = tmp_path / "not" / "yet" / "r.png"  # a folder that does not exist is made
    report = run([HPC_TRAIN, "report", str(run_dir), "--png", str(png)])
    assert report.returncode == 0 and f"picture: {png}" in report.stdout, report.stderr
    assert png.read_bytes().startswith(b"\x89PNG")


def test_ctrl_c_while_waiting_detaches_and_the_run_finishes(tmp_path: Path) -> None:
    """Ctrl-C at a terminal signals the whole foreground process group: the CLI, submitit's controller
    and every rank. Done here with killpg on the CLI's own group: the CLI says how to follow the run and
    exits at once, the ranks go on, and `logs -f` started meanwhile returns when the run has finished."""
    proc = subprocess.Popen(
        [HPC_TRAIN, "submit", f"out_dir={tmp_path}", "train.steps=20", "train.min_step_time_s=0.2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(
            signal.SIGINT, signal.SIG_DFL
        ),  # as at a terminal: a shell's `cmd &` ignores it
    )
    run_dir = tmp_path / "demo-1"
    try:
        wait_until(lambda: any(e["event"] == "start" for e in read_events(run_dir)), 120, "the ranks to start")
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130 and "Traceback" not in err, out + err
    detached, *commands = out.splitlines()[-4:]
    assert names(detached, "detached: demo-1", "keeps running")
    assert [c.split("#")[0].split() for c in commands] == [
        ["hpc-train", "logs", str(run_dir), "-f"],
        ["hpc-train", "status", str(run_dir)],
        ["hpc-train", "cancel", str(run_dir)],
    ]
    assert not (run_dir / "summary.json").exists()  # it was still training
    follow = run([HPC_TRAIN, "logs", str(run_dir), "-f"], timeout_s=120)
    assert follow.returncode == 0 and (run_dir / "summary.json").exists(), follow.stderr
    assert "step 20/20  loss" in follow.stdout and "] finished at step 20: " in follow.stdout
    assert [e["event"] for e in read_events(run_dir)].count("start") == 1


def test_a_failed_run_names_the_rank_and_logs_shows_its_traceback(tmp_path: Path) -> None:
    """The wait ends with what failed and the command to type (not submitit's `job.stderr(0)`); `logs`
    shows that rank's stderr after its log, labelled; `logs -f` of a run that has ended returns."""
    proc = run(
        [
            HPC_TRAIN,
            "submit",
            f"out_dir={tmp_path}",
            "train.steps=10",
            "requeue.max_failures=0",
            "+cluster.env.HPC_TRAIN_FAULT=raise_at_start",
        ],
        timeout_s=240,
    )
    run_dir = tmp_path / "demo-1"
    assert proc.returncode == 1 and "job.stderr" not in proc.stderr, proc.stdout + proc.stderr
    m = re.search(
        r"^demo-1 failed: RuntimeError: injected fault: raise_at_start \(HPC_TRAIN_FAULT\) "
        r"\(rank (\d), attempt 0\)\nnot requeued: failure budget spent: .*\n"
        rf"the traceback: hpc-train logs {run_dir} --rank (\d)\n$",
        proc.stderr,
        re.M,
    )
    assert m and m.group(1) == m.group(2), proc.stderr
    rank = m.group(1)
    log = run([HPC_TRAIN, "logs", str(run_dir), "--rank", rank])
    err_file = next((run_dir / "submitit").glob(f"*_{rank}_log.err"))
    assert log.returncode == 0 and log.stdout.startswith(f"==== hpc_train attempt 0 rank {rank} ====\n")
    stderr_part = log.stdout.split(f"---- rank {rank} stderr: {err_file} ----\n")[1]
    assert "Traceback (most recent call last)" in stderr_part
    last = stderr_part.splitlines()[-1]  # the traceback's own last line
    assert stderr_part.endswith("\n") and last.startswith("RuntimeError: ") and names(last, "raise_at_start")
    assert run([HPC_TRAIN, "logs", str(run_dir), "--rank", rank, "--attempt", "0"]).stdout == log.stdout
    follow = run([HPC_TRAIN, "logs", str(run_dir), "--rank", rank, "-f"], timeout_s=30)
    assert follow.returncode == 0 and follow.stdout == log.stdout


def test_ddp_fsdp2_and_fsdp2_tp_reach_the_same_loss_and_resume_exactly(tmp_path: Path) -> None:
    """Same data, same init: DDP, FSDP2 (sharded params, grads, AdamW state) and FSDP2 x TP on a 2x2
    mesh agree to 1e-6 relative (summation orders differ: all-reduce, reduce-scatter, TP's partial sums).
    Every run has 2 data-parallel ranks of 16 sequences (the TP run's pairs on 4 ranks; DDP and FSDP2 on 2, at
    half the CPU of 4 x 8, which read the same 32 a step). Sharded DCP checkpoints resume bit-exactly under
    FSDP2 x TP too."""
    args = [f"out_dir={tmp_path}", "train.steps=30", "checkpoint.every_steps=10", "train.batch_seqs_per_rank=16"]
    dp = ["cluster.tasks_per_node=2"]
    tp = ["cluster.tasks_per_node=4", "train.parallelism=fsdp", "train.tp=2"]
    ddp_dir, _ = submit([*args, "name=ddp", *dp])
    fsdp_dir, _ = submit([*args, "name=fsdp", *dp, "train.parallelism=fsdp"])
    tp_dir, _ = submit([*args, "name=tp", *tp])
    cut_dir, job_id = submit([*args, "name=cut", *tp, "train.min_step_time_s=0.2", "--no-wait"])
    wait_until(lambda: any(e["event"] == "checkpoint_committed" for e in read_events(cut_dir)), 120, "a checkpoint")
    os.kill(int(job_id), signal.SIGTERM)
    wait_until(lambda: (cut_dir / "summary.json").exists(), 240, "the resumed FSDP2 x TP run")
    ddp, fsdp, tp_run, cut = (
        json.loads((d / "summary.json").read_text()) for d in (ddp_dir, fsdp_dir, tp_dir, cut_dir)
    )
    assert abs(ddp["final_loss"] - fsdp["final_loss"]) <= 1e-6 * abs(ddp["final_loss"])
    assert abs(ddp["final_loss"] - tp_run["final_loss"]) <= 1e-6 * abs(ddp["final_loss"])
    assert cut == tp_run  # bit-exact resume under FSDP2 x TP
    starts = [e for e in read_events(cut_dir) if e["event"] == "start"]
    assert len(starts) == 2 and starts[0]["mesh"] == {"dp": 2, "tp": 2}


def test_bf16_and_activation_checkpointing_run_on_cpu(tmp_path: Path) -> None:
    """The GPU defaults, forced on CPU: recomputing blocks in fp32 changes nothing, bit for bit; bf16
    autocast trains to a loss near fp32's (measured 8e-5 apart after 20 steps; bf16 keeps 8 mantissa bits)."""
    args = [f"out_dir={tmp_path}", "train.steps=20"]
    plain, _ = submit([*args, "name=plain"])
    ac, _ = submit([*args, "name=ac", "train.activation_checkpointing=true"])
    bf16, _ = submit([*args, "name=bf16", "train.bf16=true"])
    plain_s, ac_s, bf16_s = (json.loads((d / "summary.json").read_text()) for d in (plain, ac, bf16))
    assert ac_s == plain_s
    assert (
        bf16_s["params_sha256"] != plain_s["params_sha256"] and abs(bf16_s["final_loss"] - plain_s["final_loss"]) < 0.01
    )
    rank0, rank1 = (next((bf16 / "submitit").glob(f"*_{r}_log.out")).read_text() for r in (0, 1))
    (mesh,) = [line for line in rank0.splitlines() if "mesh dp=" in line]
    assert names(mesh, "mesh dp=2 x tp=1", "ddp", "cpu bf16", "step 0/20")
    (line,) = [line for line in rank0.splitlines() if line.startswith("step 10/20 ")]
    fields = line.split("  ")  # a progress line's fields, two spaces apart
    assert [re.sub(r"\d[\d.,e+-]*", "N", f) for f in fields] == [
        "step N/N",
        "loss N",
        "lr N",
        "gnorm N",
        "N ms/step",
        "N tok/s",
        "mfu n/a",
    ], line
    assert re.fullmatch(r"loss \d\.\d{4}", fields[1]), line
    assert "loss" not in rank1  # console lines come from rank 0 only


def test_hang_watchdog_dumps_stacks_fails_and_requeues(tmp_path: Path) -> None:
    """The last rank stops at its 4th step; the others block in the next all-reduce. Within
    train.watchdog_s every rank dumps its stack, the failure requeues, and the next attempt finishes.
    watchdog_s=20, not 4: the watchdog is armed at the rendezvous, and on 2 loaded cores (the suite runs
    side by side) the set-up before the first step took over 4 s, so it fired there, on every rank alike."""
    proc = run(
        [
            HPC_TRAIN,
            "submit",
            f"out_dir={tmp_path}",
            *ARGS,
            "train.steps=20",
            "train.watchdog_s=20",
            "+cluster.env.HPC_TRAIN_FAULT=hang",
        ],
        timeout_s=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_dir = tmp_path / "demo-1"
    events = read_events(run_dir)
    # The blocked ranks' watchdogs fire; a rank may instead see its peer's exit first (gloo: closed peer).
    hangs = [e for e in events if e["event"] == "fail" and e["error"].startswith("hang:")]
    assert hangs and names(hangs[0]["error"], "no step finished", "train.watchdog_s=20")
    assert [e["reason"] for e in events if e["event"] == "requeue"] == ["failure"]
    # The stopped rank (the last) is named by its heartbeats; one machine: nowhere to leave it out.
    blamed = [e for e in events if e["event"] == "node_not_excluded"]
    assert len(blamed) == 1 and "rank 1 on 127.0.0.1 hung" in blamed[0]["why"], blamed
    assert events[-1]["event"] == "finish" and events[-1]["final_step"] == 20
    log = (run_dir / "submitit").glob("*_1_log.err")
    assert any("Thread 0x" in p.read_text() and "in train" in p.read_text() for p in log)  # the stack dump


def test_saves_slower_than_the_hang_watchdog_are_not_a_hang(tmp_path: Path) -> None:
    """Issue 18, defect 4: storage so slow that each save takes 25 s (the slow-storage drill, which
    trickles bytes as such storage would) with train.watchdog_s=20. The final save, and the wait for the
    periodic write before it, were judged a hang in every attempt (nothing in checkpoint.py fed the
    watchdog) until the failure budget stopped the run; now both commit and the run finishes."""
    run_dir, _ = submit(
        [
            f"out_dir={tmp_path}",
            *ARGS,
            "train.steps=20",
            "train.watchdog_s=20",
            "train.min_step_time_s=0.3",
            "--no-wait",
        ]
    )
    (run_dir / "drills").mkdir(exist_ok=True)
    (run_dir / "drills" / "slow_storage").write_text("25")  # `hpc-train chaos RUN slow-storage --seconds 25`
    fails = lambda: [e for e in read_events(run_dir) if e["event"] == "fail"]  # noqa: E731
    wait_until(lambda: (run_dir / "summary.json").exists() or fails(), 300, "the run's end or a failure")
    assert not fails(), fails()
    wait_until(lambda: (run_dir / "summary.json").exists(), 60, "summary.json")
    commits = [e for e in read_events(run_dir) if e["event"] == "checkpoint_committed"]
    assert (commits[-1]["step"], commits[-1]["reason"]) == (20, "final") and commits[-1]["write_s"] >= 25


def test_stop_save_that_cannot_fit_is_skipped(tmp_path: Path) -> None:
    """With no grace left (cluster.preempt_grace_s=0) a SIGTERM skips the stop save: the run requeues
    at once and resumes from its last periodic checkpoint, still bit-exact."""
    args = [f"out_dir={tmp_path}", *ARGS, "cluster.preempt_grace_s=0"]
    ref_dir, _ = submit([*args, "name=ref"])
    run_dir, job_id = submit([*args, "name=cut", "train.min_step_time_s=0.2", "--no-wait"])
    wait_until(lambda: any(e["event"] == "checkpoint_committed" for e in read_events(run_dir)), 120, "a checkpoint")
    os.kill(int(job_id), signal.SIGTERM)
    wait_until(lambda: (run_dir / "summary.json").exists(), 240, "the resumed run")
    wait_until(lambda: (ref_dir / "summary.json").exists(), 240, "the reference")
    events = read_events(run_dir)
    skipped = [e for e in events if e["event"] == "stop_save_skipped"]
    assert len(skipped) == 1
    resumed = [e for e in events if e["event"] == "start"][1]
    assert resumed["step"] % 10 == 0 and resumed["step"] < skipped[0]["step"]  # the last periodic checkpoint
    assert json.loads((run_dir / "summary.json").read_text()) == json.loads((ref_dir / "summary.json").read_text())


BYO = ["fn._target_=byo_train.main", "+fn.kwargs.steps=200", "cluster.tasks_per_node=4"]
EXAMPLES = str(Path(__file__).resolve().parent.parent / "docs" / "examples")


def test_byo_function_at_4_ranks_resumes_bit_exactly_through_two_stops(tmp_path: Path) -> None:
    """docs/examples/byo_train.py (DDP, dropout, AdamW groups) on 4 ranks, written as docs/byo.md shows: a
    SIGTERM mid-run reaches step_end, it saves, the job requeues and resumes; twice. It ends with the
    uninterrupted run's weights, bit for bit. 4 ranks, not 2: a sum of two gradients is exact in any order,
    of four it is not, and the first step after a resume runs in DDP's initial bucket layout unless
    step_end replays it (without the replay the weights differed after these two stops)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [EXAMPLES, os.environ.get("PYTHONPATH")]))}
    ref_dir, _ = submit([f"out_dir={tmp_path}", "name=ref", *BYO], env=env)
    run_dir, job_id = submit([f"out_dir={tmp_path}", "name=cut", *BYO, "+fn.kwargs.step_s=0.05", "--no-wait"], env=env)

    def committed_in(restart: int) -> bool:
        return any(e["event"] == "checkpoint_committed" and e["restart"] == restart for e in read_events(run_dir))

    for restart in (0, 1):  # a stop after this attempt's first checkpoint: every resume is from a stop save
        wait_until(lambda r=restart: committed_in(r), 120, f"a checkpoint of attempt {restart}")
        os.kill(int(job_id), signal.SIGTERM)  # submitit's local controller forwards it to every rank
    wait_until(lambda: (run_dir / "summary.json").exists(), 240, "the resumed run")
    ref, cut = (json.loads((d / "summary.json").read_text()) for d in (ref_dir, run_dir))
    assert cut == ref and cut["final_step"] == 200
    events = read_events(run_dir)
    stop_saves = [e["step"] for e in events if e["event"] == "checkpoint_committed" and e["reason"] == "stop"]
    assert [e["step"] for e in events if e["event"] == "start"] == [0, *stop_saves] and len(stop_saves) == 2
    assert [e["reason"] for e in events if e["event"] == "requeue"] == ["preempt", "preempt"]


def test_byo_target_that_does_not_import_is_refused_before_submit(tmp_path: Path) -> None:
    proc = run([HPC_TRAIN, "submit", f"out_dir={tmp_path}", "fn._target_=no_such_pkg.train.main"])
    assert proc.returncode == 2 and list(tmp_path.iterdir()) == []
    assert names(
        proc.stderr,
        "fn._target_='no_such_pkg.train.main'",
        "'no_such_pkg.train' is not importable",
        "pip install -e .",
        "PYTHONPATH",
    )


def test_a_function_that_cannot_start_stops_after_one_attempt_with_its_cause(tmp_path: Path) -> None:
    """Issue 29: a training function whose module fails to import (the module is there: submit finds it), or whose
    fn.kwargs do not fit it, before any progress: one attempt, `stopped` with the cause, no requeue, the cause in
    the local submit's output (before: 3 attempts and 'failure budget spent')."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "badimport.py").write_text("import nothere_mod_xyz\n\ndef main(at):\n    pass\n")
    (pkg / "kwfn.py").write_text("def main(at, lr=1.0):\n    return {'ok': 1}\n")
    env = {**os.environ, "PYTHONPATH": str(pkg)}
    cases = {
        "badimport": (["fn._target_=badimport.main"], "ModuleNotFoundError: No module named 'nothere_mod_xyz'"),
        "kwargs": (["fn._target_=kwfn.main", "+fn.kwargs.lrr=2"], "got an unexpected keyword argument 'lrr'"),
    }
    for name, (args, cause) in cases.items():
        out = tmp_path / name
        proc = subprocess.run(
            [HPC_TRAIN, "submit", f"out_dir={out}", *args], capture_output=True, text=True, env=env, timeout=300
        )
        events = read_events(out / "demo-1")
        names = [e["event"] for e in events]
        assert names.count("start") <= 1 and "requeue" not in names, (name, names)
        stopped = next(e for e in events if e["event"] == "stopped")
        assert cause in stopped["reason"], (name, stopped)
        assert "not requeued: " in proc.stdout + proc.stderr and cause in proc.stdout + proc.stderr, proc.stderr
