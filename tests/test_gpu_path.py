"""The GPU path on a machine without a GPU (issue 19, part 3). Each test says what CPU can show of it;
what needs a GPU (CUDA_VISIBLE_DEVICES reaching torch, NCCL, CUDA events, bf16 kernels) is for
benchmarks/gpu_check.sh on a GPU machine.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import HPC_TRAIN, names, read_events, refused, run, submit, wait_until

from hpc_train import rendezvous
from hpc_train.config import ModelConfig, TrainConfig
from hpc_train.env import gpu_sharing_error, nccl_env
from hpc_train.metrics import peak_tflops
from hpc_train.model import GPT
from hpc_train.sbatch import ClusterConfig, executor_parameters, make_executor
from hpc_train.task import Task


def test_local_executor_is_given_the_gpu_count(tmp_path: Path) -> None:
    """submitit's local executor sets CUDA_VISIBLE_DEVICES to its first gpus_per_node GPUs, "" without
    the parameter: a GPU run on cluster=local trained on the CPU. Through submitit's own executor: the
    variable its controller would export. (On CPU torch sees no GPU either way.)"""
    cluster = ClusterConfig(gpus_per_node=2, tasks_per_node=2)
    assert executor_parameters(cluster, "x")["gpus_per_node"] == 2
    executor = make_executor(cluster, tmp_path, "x")
    n = executor.parameters.get("gpus_per_node", 0)
    assert ",".join(str(k) for k in range(n)) == "0,1"  # submitit.local.local.LocalExecutor._submit_command


def test_local_job_sees_its_gpus(tmp_path: Path) -> None:
    """End to end on the local executor: each rank of `hpc-train submit cluster.gpus_per_node=2` reads
    CUDA_VISIBLE_DEVICES=0,1 (it read "" before); the start event names every rank's device. CPU shows
    the variable and the event, not that torch then uses the GPUs (gpu_check.sh: gpu_mfu.py fails
    unless every rank says cuda)."""
    (tmp_path / "cvd_probe.py").write_text(
        "import os\n"
        "from hpc_train import train\n"
        "def main(at):\n"
        "    (at.paths.run_dir / f'cvd.{at.env.rank}').write_text(os.environ.get('CUDA_VISIBLE_DEVICES', 'unset'))\n"
        "    return train.main(at)\n"
    )
    out = tmp_path / "runs"
    run_dir, _ = submit(
        [
            f"out_dir={out}",
            "fn._target_=cvd_probe.main",
            "cluster.gpus_per_node=2",
            "train.steps=2",
            "preflight.enabled=false",
        ],
        cwd=tmp_path,
    )
    wait_until(lambda: (run_dir / "summary.json").exists(), 120, "summary.json")
    assert [(run_dir / f"cvd.{r}").read_text() for r in (0, 1)] == ["0,1", "0,1"]
    start = next(e for e in read_events(run_dir) if e["event"] == "start")
    assert start["devices"] == ["cpu", "cpu"]


def test_gpus_per_node_must_equal_tasks_per_node_at_submit(tmp_path: Path) -> None:
    """Two ranks on one GPU make NCCL fail once the job runs; the submit refuses it, writing nothing."""
    proc = run([HPC_TRAIN, "submit", f"out_dir={tmp_path}", "cluster.gpus_per_node=1", "cluster.tasks_per_node=2"])
    assert proc.returncode == 2 and list(tmp_path.iterdir()) == []
    assert refused(proc, "submit", "cluster.gpus_per_node=1", "cluster.tasks_per_node=2", "one rank per GPU")
    assert names(proc.stderr, "set cluster.tasks_per_node=1", "or cluster.gpus_per_node=2")  # either fix


def test_too_few_visible_gpus_is_a_sentence() -> None:
    """job.py stops an attempt (preempt.Unrecoverable, not a requeue) when 1 < visible GPUs < local ranks;
    one GPU per task is Slurm's per-task binding and fine. Pure: the GPU count is torch's on a GPU node."""
    assert gpu_sharing_error(1, 8) == gpu_sharing_error(8, 8) == gpu_sharing_error(0, 2) == ""
    said = gpu_sharing_error(2, 4)
    assert names(said, "2 GPUs visible", "(CUDA_VISIBLE_DEVICES)", "for 4 ranks", "share a GPU")
    assert names(said, "cluster.tasks_per_node=2", "cluster.gpus_per_node=2", "4 GPUs per node")  # the fixes


def test_nccl_env_keeps_the_deciding_process_alive(tmp_path: Path) -> None:
    """The variables job.py sets before init_process_group on a GPU (names as torch 2.13's
    ProcessGroupNCCL.hpp reads them). A site's dump settings are kept; error handling is always 2
    (CleanUpOnly: a timed-out collective raises, it does not SIGABRT the process whose watchdog thread is
    deciding the hang's requeue). That NCCL honours them needs a GPU and a hang: not shown here."""
    env = nccl_env(str(tmp_path / "nccl_trace"), {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"})
    assert env == {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": f"{tmp_path}/nccl_trace/rank_",
        "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "900",
    }
    assert nccl_env("x", {"TORCH_NCCL_TRACE_BUFFER_SIZE": "20000"}).keys() == env.keys() - {
        "TORCH_NCCL_TRACE_BUFFER_SIZE"
    }
    header = Path(torch.__file__).parent / "include/torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp"
    if header.exists():  # the names as this torch spells them
        text = header.read_text()
        assert all(f'"{name}"' in text for name in env if name != "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")


# nvidia-smi --query-gpu=name as these GPUs answer it (torch.cuda.get_device_name() says the same).
@pytest.mark.parametrize(
    "name, tflops",
    [
        ("NVIDIA H100 80GB HBM3", 989.0),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H100 NVL", 835.0),
        ("NVIDIA H200", 989.0),
        ("NVIDIA H200 NVL", 835.0),
        ("NVIDIA GH200 480GB", 989.0),
        ("NVIDIA B200", 2250.0),
        ("NVIDIA GB200", 2500.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA A100-SXM4-40GB", 312.0),
        ("NVIDIA A100-PCIE-40GB", 312.0),
        ("NVIDIA A100 80GB PCIe", 312.0),
        ("NVIDIA L40S", 362.0),
        ("NVIDIA L40", 181.0),
        ("NVIDIA L4", 121.0),
        ("NVIDIA A10", 125.0),
        ("NVIDIA A10G", None),  # not in the table: MFU "n/a" rather than the A10's figure
        ("Tesla V100-SXM2-32GB", None),  # no bf16
        (" NVIDIA H100 PCIe \n", 756.0),
    ],
)
def test_peak_tflops_by_exact_gpu_name(name: str, tflops: float | None) -> None:
    """Before: "H100" in the name gave the PCIe and NVL cards SXM's 989; B200 and GB200 had none."""
    assert peak_tflops(name) == tflops


def test_step_clock_syncs_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The step's clock is read after torch.cuda.synchronize on a GPU (kernels are queued, not run, when
    the host returns). torch.cuda.synchronize is replaced: CPU can show the call, not the time it waits."""
    from hpc_train.train import step_clock

    synced: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(device))
    step_clock(torch.device("cpu"))
    assert synced == []
    step_clock(torch.device("cuda", 0))
    assert synced == [torch.device("cuda", 0)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ranks(fn: object, world: int, *args: object) -> None:
    """fn(rank, world, port, *args) on `world` gloo ranks (fork: the test module need not be importable)."""
    port = _free_port()
    mp.start_processes(fn, args=(world, port, *args), nprocs=world, join=True, start_method="fork")


def _init(rank: int, world: int, port: int) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)


def _fsdp_tp_foreach(rank: int, world: int, port: int, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from hpc_train.train import clip_grad_norm, make_optimizer, parallelize

    _init(rank, world, port)
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        tc = TrainConfig(parallelism="fsdp", tp=2)
        torch.manual_seed(0)
        model = GPT(ModelConfig())
        net = parallelize(model, tc, mesh)
        optimizer = make_optimizer(model, tc, foreach=True)  # CUDA's default path, forced on CPU
        x = torch.randint(0, 256, (2, 32))
        for _ in range(2):
            net(x, x).backward()
            clip_grad_norm(model, 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        Path(out, str(rank)).write_text(str(len(optimizer.param_groups)))
    finally:
        dist.destroy_process_group()


def test_fsdp_tp_adamw_foreach_steps(tmp_path: Path) -> None:
    """FSDP2 x TP on a 2x2 mesh (4 gloo ranks): AdamW with foreach=True, as on CUDA, steps, with one param
    group per mesh. Measured: torch 2.13 also steps one group over both meshes with foreach=True on CPU (the
    "cross-mesh" failure issue 19 read did not reproduce), so before the change only the group count
    failed here. What CPU cannot show: CUDA's foreach kernels (tp needs 2 GPUs: not in gpu_check.sh)."""
    _ranks(_fsdp_tp_foreach, 4, str(tmp_path))
    assert [(tmp_path / str(r)).read_text() for r in range(4)] == ["2"] * 4  # (dp, tp) and dp


def _fsdp_bf16(rank: int, world: int, port: int, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from hpc_train.train import make_optimizer, parallelize

    _init(rank, world, port)
    try:
        mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "tp"))
        x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(rank))
        result = {}
        for bf16 in (False, True):
            tc = TrainConfig(parallelism="fsdp")
            torch.manual_seed(0)
            model = GPT(ModelConfig())
            net = parallelize(model, tc, mesh, bf16=bf16)
            seen: list[torch.dtype] = []
            model.blocks[0].qkv.register_forward_pre_hook(lambda m, _: seen.append(m.weight.dtype))
            optimizer = make_optimizer(model, tc)
            losses = []
            for _ in range(3):
                loss = net(x, x)
                losses.append(loss.item())
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            shard = next(model.parameters())
            result[str(bf16)] = {
                "losses": losses,
                "loss_dtype": str(loss.dtype),
                "compute_dtype": str(seen[0]),
                "master_dtype": str(shard.dtype),
            }
        Path(out, str(rank)).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def test_fsdp_bf16_by_mixed_precision_policy_matches_fp32(tmp_path: Path) -> None:
    """train.bf16 under FSDP2 (2 gloo ranks, model=tiny): the blocks compute with bf16 weights that FSDP2
    all-gathered (before: fp32, autocast's own copies), the master weights AdamW steps stay fp32, the loss
    is fp32, and 3 steps track the fp32 run's losses within bf16's precision. CPU's bf16 matmuls are not a
    GPU's kernels: the figures and memory are gpu_check.sh's."""
    _ranks(_fsdp_bf16, 2, str(tmp_path))
    for r in range(2):
        result = json.loads((tmp_path / str(r)).read_text())
        fp32, bf16 = result["False"], result["True"]
        assert fp32["compute_dtype"] == "torch.float32" and bf16["compute_dtype"] == "torch.bfloat16"
        assert bf16["master_dtype"] == "torch.float32" and bf16["loss_dtype"] == "torch.float32"
        assert bf16["losses"] == pytest.approx(fp32["losses"], rel=2e-2)
        assert bf16["losses"] != fp32["losses"]  # bf16 did run


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-n0", "-p", "no:cacheprovider"]))


def test_a_scripts_rank_process_never_touches_cuda(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Our rank process of a script (script.py) must leave the child's GPU alone. Before (review): the
    rendezvous set the device (cudaSetDevice makes a context, ~0.5 GB, since CUDA 12) and joined NCCL, and
    the preflight timed a matmul and an all-reduce on the GPU, holding a context, cached blocks and NCCL's
    buffers there for the whole run. CPU shows it with torch.cuda answering as on a 1-GPU node and every
    call that would touch the device recorded; a GPU machine shows it with nvidia-smi (benchmarks/gpu_check.sh)."""

    from hpc_train import preflight
    from hpc_train.config import ConfigSource, compose, to_run_config
    from hpc_train.env import RankEnv
    from hpc_train.paths import RunPaths
    from hpc_train.script import override

    touched: list[str] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for name in ("set_device", "current_device", "synchronize", "init", "Event"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, _name=name, **k: touched.append(_name) or 0)
    monkeypatch.setattr(preflight, "query_gpus", lambda: ([{"index": 0}], [], ""))  # nvidia-smi: another process
    monkeypatch.setattr(preflight, "read_xids", lambda: ([], ""))
    cfg = to_run_config(compose([override(["python", "train.py"])], ConfigSource()))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = RankEnv("local", 0, 0, 1, 1, 0, 1, ("127.0.0.1",), "127.0.0.1", port, "1", 0)
    paths = RunPaths(tmp_path)
    monkeypatch.setenv("SLURMD_NODENAME", "127.0.0.1")
    try:
        placed = rendezvous.join(env, cfg, paths, Task())
        assert dist.get_backend() == "gloo"
        sick = preflight.check(placed, cfg.preflight, paths, time_gpu=not cfg.script.cmd)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert touched == [] and sick == {}
    event = next(json.loads(line) for line in (tmp_path / "events.jsonl").open() if '"preflight"' in line)
    assert event["nodes"]["127.0.0.1"]["device"] == "cpu" and event["nodes"]["127.0.0.1"]["gpus"] == 1
