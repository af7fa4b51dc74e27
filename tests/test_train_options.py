"""Training options: config bounds, LR schedules, AdamW settings, grad norm, evaluation, torch.compile."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import HPC_TRAIN, names, read_events, refused, run, submit, wait_until
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from hpc_train.config import DataConfig, ModelConfig, TrainConfig
from hpc_train.data import open_sampler
from hpc_train.model import GPT
from hpc_train.train import clip_grad_norm, lr_at, parallelize


@pytest.mark.parametrize(
    "override, message",
    [
        ("model.n_layers=0", "model.n_layers=0 must be >= 1: transformer blocks; e.g. model.n_layers=2"),
        ("model.n_heads=0", "model.n_heads=0 must be >= 1: attention heads per block; e.g. model.n_heads=4"),
        (
            "model.seq_len=0",
            "model.seq_len=0 must be >= 1: tokens per training sequence, the context length; e.g. model.seq_len=32",
        ),
        (
            "train.log_every_steps=0",
            "train.log_every_steps=0 must be >= 1: a metrics line every this many steps; e.g. train.log_every_steps=10",
        ),
        (
            "data.seed=-1",
            "data.seed=-1 must be >= 0: numpy seeds the corpus and the window order with it; e.g. data.seed=0",
        ),
        ("train.adam_beta2=1.0", "train.adam_beta2=1.0 must be in [0, 1); e.g. train.adam_beta2=0.95"),
        (
            "train.lr_schedule=step",
            "train.lr_schedule='step' is not one of ('cosine', 'linear', 'constant', 'wsd'); "
            "e.g. train.lr_schedule=cosine",
        ),
    ],
)
def test_out_of_bounds_values_are_refused_with_the_fix(override: str, message: str) -> None:
    """Each was accepted before (n_heads=0 and log_every_steps=0 crashed later, with ZeroDivisionError)."""
    proc = run([HPC_TRAIN, "submit", "--cfg", "job", override])
    assert proc.returncode == 2 and f"hpc-train submit: error: {message}\n" in proc.stderr, proc.stderr


def test_lr_at_per_schedule() -> None:
    """100 steps, peak 1.0, 10 warm-up steps, floor 0.1: warm-up end, middle and last step of each schedule.
    The decays head for the floor at step 100, one past the last (step 99)."""
    base = TrainConfig(steps=100, lr=1.0, warmup_steps=10, min_lr_fraction=0.1)
    assert [lr_at(s, base) for s in (0, 4, 9)] == [0.1, 0.5, 1.0]  # warm-up: (step + 1) / 10, any schedule
    cosine, linear, constant = (replace(base, lr_schedule=k) for k in ("cosine", "linear", "constant"))
    assert lr_at(10, cosine) == 1.0 and lr_at(55, cosine) == pytest.approx(0.55)  # halfway: (1 + 0.1) / 2
    assert lr_at(99, cosine) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 89 / 90)))  # 0.10027
    assert (
        lr_at(10, linear) == 1.0
        and lr_at(55, linear) == pytest.approx(0.55)
        and lr_at(99, linear) == pytest.approx(0.11)
    )
    assert lr_at(10, constant) == lr_at(55, constant) == lr_at(99, constant) == 1.0
    wsd = replace(base, lr_schedule="wsd", decay_fraction=0.2)  # stable to step 79, linear over steps 80..99
    assert lr_at(10, wsd) == lr_at(55, wsd) == lr_at(79, wsd) == lr_at(80, wsd) == 1.0
    assert lr_at(90, wsd) == pytest.approx(0.55) and lr_at(99, wsd) == pytest.approx(1 - 0.9 * 19 / 20)
    # The default (cosine, floor 0.1) is bit for bit the first version's formula: default runs keep their numbers.
    default = TrainConfig()
    first_version = [default.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * ((s - 5) / 55)))) for s in range(5, 60)]
    assert [lr_at(s, default) for s in range(5, 60)] == first_version


def metrics(run_dir: Path) -> list[dict]:
    """metrics.jsonl's complete lines (while the run writes, its last may be half written)."""
    text = (run_dir / "metrics.jsonl").read_text() if (run_dir / "metrics.jsonl").exists() else ""
    return [json.loads(line) for line in text.splitlines(keepends=True) if line.endswith("\n")]


# Every option off its default, in both runs of the evaluation test: the checkpoint shows they reached AdamW.
OPTIONS = [
    "train.lr_schedule=wsd",
    "train.decay_fraction=0.5",
    "train.adam_beta1=0.8",
    "train.adam_beta2=0.99",
    "train.adam_eps=1e-6",
    "train.weight_decay=0.05",
]


def test_eval_leaves_training_unchanged_is_a_stop_boundary_and_resumes_exactly(tmp_path: Path) -> None:
    """val_loss at steps 20 and 30 on the synthetic held-out corpus, each evaluation ~3 s (300 batches,
    FSDP2 gathers every block for each) against ~20-80 ms per step. A SIGTERM sent three step times after
    step 9's line lands inside the evaluation of step 10 (before: 1 s after step 5's line, which a loaded CI
    machine's five steps outlasted): the evaluation is abandoned (checked every 8 batches) and the run stops at
    step 10, not 11, with no val_loss there. Resumed, its weights end bit-identical to an uninterrupted run
    without evaluation (evaluation draws no RNG, leaves the model in train mode; resume is exact). grad_norm
    and val_loss reach metrics.jsonl, the console line and `status`. Under FSDP2 (DDP: test_data.py's run on
    tokens)."""
    args = [
        f"out_dir={tmp_path}",
        "train.steps=30",
        "checkpoint.every_steps=10",
        *OPTIONS,
        "train.parallelism=fsdp",
    ]  # FSDP2: evaluation must leave the root's parameters sharded for the save
    plain, _ = submit([*args, "name=plain", "train.log_every_steps=5"])
    cut_args = ["name=cut", "train.log_every_steps=1", "train.eval_every_steps=10", "train.eval_batches=300"]
    cut, job_id = submit([*args, *cut_args, "--no-wait"])
    step_9 = wait_until(
        lambda: next((m for m in metrics(cut) if m["step"] == 9), None),
        240,
        "step 9's line",
        every_s=0.02,
    )
    # Step 10 takes about what step 9 took, the evaluation ~40 steps' worth: 3 step times land in it.
    time.sleep(3 * step_9["step_time_s"] + 0.05)
    os.kill(int(job_id), signal.SIGTERM)
    wait_until(lambda: (cut / "summary.json").exists() or "stopped" in str(read_events(cut)), 240, "the resumed run")
    plain_s, cut_s = (json.loads((d / "summary.json").read_text()) for d in (plain, cut))
    assert cut_s["params_sha256"] == plain_s["params_sha256"] and cut_s["final_loss"] == plain_s["final_loss"]
    events = read_events(cut)
    assert [e["step"] for e in events if e["event"] in ("signal", "start")] == [0, 10, 10]  # start, signal, start
    rows = metrics(cut)
    vals = {m["step"]: m["val_loss"] for m in rows if "val_loss" in m}
    assert sorted(vals) == [20, 30] and 0 < vals[30] == cut_s["val_loss"] < math.log(256)
    assert [m["step"] for m in rows] == list(range(1, 31))
    stop_row = rows[9]  # logged before the stop check: the evaluation began, was abandoned, and was timed
    assert "val_loss" not in stop_row and 0 < stop_row["eval_s"] < next(m["eval_s"] for m in rows if m["step"] == 20)
    assert all(m["grad_norm"] > 0 for m in rows) and all("val_loss" not in m for m in metrics(plain))
    status = json.loads(run([HPC_TRAIN, "status", str(cut), "--json"]).stdout)
    assert status[0]["val_loss"] == vals[30]
    log = next((cut / "submitit").glob("*_0_log.out")).read_text()
    last = rows[-1]
    assert f"loss {last['loss']:.4f}  val {vals[30]:.4f}  lr {last['lr']:.2e}  gnorm {last['grad_norm']:.3f}  " in log
    dcp_to_torch_save(cut / "checkpoints" / "step_000030", tmp_path / "plain.pt")
    group = torch.load(tmp_path / "plain.pt", weights_only=True)["optim"]["param_groups"][0]
    assert (group["betas"], group["eps"], group["weight_decay"]) == ((0.8, 0.99), 1e-6, 0.05)
    wsd = TrainConfig(steps=30, lr_schedule="wsd", decay_fraction=0.5)  # stable to step 14, then linear
    assert group["lr"] == lr_at(29, wsd) and rows[4]["lr"] == 3e-3  # step 5: warm-up done


def test_a_stop_during_a_long_evaluation_waits_for_a_few_batches_not_all(tmp_path: Path) -> None:
    """Before: the stop check came only after all train.eval_batches (here 10000, ~40 s on 2 cores). The
    SIGTERM lands in the last step's evaluation; it is abandoned within 8 batches (val_loss None) and
    the run finishes. eval_s in metrics.jsonl measures the evaluation, for the signal lead warning."""
    run_dir, job_id = submit(
        [
            f"out_dir={tmp_path}",
            "train.steps=2",
            "train.log_every_steps=1",
            "train.eval_every_steps=2",
            "train.eval_batches=10000",
            "--no-wait",
        ]
    )
    wait_until(
        lambda: (run_dir / "metrics.jsonl").exists() and (run_dir / "metrics.jsonl").read_text(),
        120,
        "step 1's line",
        every_s=0.02,
    )
    # Step 2 takes about as long as step 1 (~0.1 s, on a loaded machine more), the evaluation ~400 of them: 20
    # step times in, the evaluation is under way, on a fast machine or a loaded one (the check below says so).
    step_s = metrics(run_dir)[0]["step_time_s"]
    time.sleep(max(1.0, 20 * step_s))
    sent = time.time()
    os.kill(int(job_id), signal.SIGTERM)
    wait_until(lambda: (run_dir / "summary.json").exists(), 60, "summary.json")
    [signalled] = [e for e in read_events(run_dir) if e["event"] == "signal"]
    assert signalled["step"] == 2 and signalled["finishing"], signalled
    assert json.loads((run_dir / "summary.json").read_text())["val_loss"] is None
    rows = metrics(run_dir)
    assert [m["step"] for m in rows] == [1, 2] and "val_loss" not in rows[1]
    # Orders and ratios, not speeds: the SIGTERM came during step 2's evaluation (the wall-clock span its eval_s
    # measured), which stopped within 20 step times of it (all 10000 batches: ~400); step 1 evaluated nothing.
    evaluated = (rows[1]["time"] - rows[1]["eval_s"], rows[1]["time"])
    assert evaluated[0] < sent < evaluated[1] < sent + 20 * step_s, (sent, evaluated, step_s)
    assert rows[0]["eval_s"] < rows[1]["eval_s"] / 100, rows


def test_eval_batches_is_bounded() -> None:
    with pytest.raises(
        ValueError,
        match=r"train.eval_batches=10001 must be <= 10000: an evaluation holds up "
        r"training and must stay short; e.g. train.eval_batches=4",
    ):
        TrainConfig(eval_batches=10_001)


needs_cxx = pytest.mark.skipif(
    shutil.which(os.environ.get("CXX", "g++")) is None, reason="torch.compile on CPU needs a C++ compiler ($CXX or g++)"
)


@needs_cxx
def test_compiled_training_matches_eager_on_cpu() -> None:
    """The trainer's parallelize() with train.compile=true (each block compiled, then DDP, on a one-rank
    group) against eager: 5 AdamW steps of model=tiny on the same batches. Compiled kernels sum in
    another order, so the losses agree to 1e-5 relative, not bit for bit (measured ~1e-7). Compilation:
    ~25 s on a cold inductor cache on the 2-core test machine, ~4 s warm."""
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
        losses: dict[bool, list[float]] = {False: [], True: []}
        for compiled in losses:
            tc = TrainConfig(steps=5, compile=compiled)
            torch.manual_seed(0)
            model = GPT(ModelConfig())
            net = parallelize(model, tc, mesh)
            optimizer = torch.optim.AdamW(model.parameters(), betas=(tc.adam_beta1, tc.adam_beta2))
            sampler = open_sampler(DataConfig(), seq_len=32, vocab_size=256)
            for step in range(tc.steps):
                optimizer.param_groups[0]["lr"] = lr_at(step, tc)
                loss = net(*sampler.next_batch(0, 1, tc.batch_seqs_per_rank))
                loss.backward()
                clip_grad_norm(model, tc.grad_clip)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                losses[compiled].append(loss.item())
    finally:
        dist.destroy_process_group()
    assert losses[True] == pytest.approx(losses[False], rel=1e-5) and losses[False][-1] < losses[False][0]


def test_compile_without_a_compiler_is_refused_before_submit(tmp_path: Path) -> None:
    env = {**os.environ, "CXX": "/nonexistent/g++"}
    proc = run([HPC_TRAIN, "submit", f"out_dir={tmp_path}", "train.compile=true"], env=env)
    assert list(tmp_path.iterdir()) == []
    assert refused(
        proc,
        "submit",
        "train.compile=true",
        "C++ compiler",
        "'/nonexistent/g++'",
        "apt-get install g++",
        "train.compile=false",
    )


@needs_cxx
def test_compile_that_fails_in_the_job_stops_the_run(tmp_path: Path) -> None:
    """The compute node's compiler does not work (CXX=/bin/false there, an empty inductor cache): the
    first forward raises, and the run stops with the reason instead of requeueing into the same failure."""
    proc = run(
        [
            HPC_TRAIN,
            "submit",
            f"out_dir={tmp_path}",
            "train.steps=1",
            "cluster.tasks_per_node=1",
            "train.compile=true",
            "+cluster.env.CXX=/bin/false",
            f"+cluster.env.TORCHINDUCTOR_CACHE_DIR={tmp_path / 'inductor'}",
        ],
        timeout_s=240,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    stopped = [e for e in read_events(tmp_path / "demo-1") if e["event"] == "stopped"]
    assert len(stopped) == 1 and names(stopped[0]["reason"], "train.compile=true", "torch.compile failed on ")
    assert stopped[0]["reason"].endswith("train.compile=false")  # the fix
    assert "InvalidCxxCompiler" in stopped[0]["reason"]
