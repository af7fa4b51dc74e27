"""Node health at every attempt start: job.py calls `check` on every rank right after the rendezvous,
before the training function builds anything. Seconds, not minutes (docs/benchmarks.md has the figure).

    hpc-train submit cluster=dev preflight.min_matmul_tflops=400 preflight.min_allreduce_gbps=100
    hpc-train chaos runs/demo-3 sick-node --node node3    # node3 fails every later preflight (a drill)

What each node checks (local rank 0 for the per-node facts, every rank for its own device):
    gpu        nvidia-smi: visible, uncorrected ECC errors, pending retired pages / row remaps (skipped on CPU)
    matmul     a square matmul on the rank's device, TFLOP/s; the node's figure is its slowest rank's
    allreduce  a 4 MiB all-reduce over the whole group, bus GB/s (as nccl-tests counts it)
    disk       free GB in the run's checkpoint folder: short on every node (a shared folder) stops the run,
               short on some (node-local folders) makes those sick
    clock      time.time() against the median node's, beyond the all-gather's own round trip

`judge` (pure) turns the gathered results into {node: why it is sick}, warnings and a run-level reason to
stop; rank 0 writes one `preflight` event. A sick node is left out of the next attempt (job.py, preempt.exclusion).
The module imports torch only inside `check`: config.py imports PreflightConfig on the login node.
"""

from __future__ import annotations

import logging
import math
import re
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hpc_train.paths import MARKER, RunPaths, read_marker, step_folders

log = logging.getLogger(__name__)


@dataclass
class PreflightConfig:  # preflight.py; a figure of 0 = record only
    enabled: bool = True
    min_free_disk_gb: float = 1.0  # in the checkpoint folder; the newest checkpoint's size is needed on top
    max_clock_skew_s: float = 5.0  # event times across nodes stay ordered; munge refuses skews past 300 s
    min_matmul_tflops: float = 0.0  # per device, bf16 on GPU (an H200 does ~600 on this 4096^3 test), fp32 on CPU
    min_allreduce_gbps: float = 0.0  # bus bandwidth of the whole group: below it is a warning (it names no node)
    # GPU only: a node whose matmul runs below this x the median node's is sick. Not on CPU, where ranks
    # share cores with everything else (2 cores for 4 nodes on the dev cluster: a 3x spread is noise).
    slow_fraction: float = 0.5

    def __post_init__(self) -> None:
        for key in ("min_free_disk_gb", "max_clock_skew_s", "min_matmul_tflops", "min_allreduce_gbps"):
            if not getattr(self, key) >= 0:
                raise ValueError(f"preflight.{key}={getattr(self, key)} must be >= 0 (0 = record only)")
        if not 0 <= self.slow_fraction < 1:
            raise ValueError(f"preflight.slow_fraction={self.slow_fraction} must be in [0, 1) (0 = off); e.g. 0.5")


# nvidia-smi --query-gpu fields; an older driver that lacks one refuses the whole query, then only BASIC.
GPU_FIELDS = (
    "index",
    "name",
    "ecc.errors.uncorrected.volatile.total",
    "retired_pages.pending",
    "remapped_rows.pending",
    "remapped_rows.failure",
)
BASIC_GPU_FIELDS = ("index", "name")
NVIDIA_SMI_TIMEOUT_S = 10  # a GPU that fell off the bus can hold nvidia-smi for minutes: that is an answer too
ALLREDUCE_BYTES = 4 * 2**20
SICK_DRILL = "sick_node"  # RUN/drills/sick_node.<node>, written by `hpc-train chaos RUN sick-node`


MEMORY_FIELDS = ("retired_pages.pending", "remapped_rows.pending", "remapped_rows.failure")


def gpu_problems(csv_text: str, fields: tuple[str, ...]) -> tuple[list[dict[str, str]], list[str], list[str]]:
    """nvidia-smi --format=csv,noheader,nounits lines -> (one dict per GPU, what is wrong, what could not
    be read) (pure). "[N/A]" / "[Not Supported]" is not "healthy": the ECC count, or the memory's pending
    retirement (page retirement before Ampere, row remapping since: one of them is enough), is "unknown"."""
    gpus, problems, unknown = [], [], []
    for line in csv_text.strip().splitlines():
        gpu = dict(zip(fields, (v.strip() for v in line.split(","))))
        gpus.append(gpu)
        name = f"GPU {gpu.get('index', '?')}"
        ecc = gpu.get("ecc.errors.uncorrected.volatile.total", "")
        if ecc.isdigit() and int(ecc) > 0:
            problems.append(f"{name}: {ecc} uncorrected ECC errors since boot")
        elif not ecc.isdigit():
            unknown.append(f"{name}: uncorrected ECC errors unknown ({ecc or 'not queried'})")
        for key in MEMORY_FIELDS:
            if gpu.get(key) == "Yes":
                problems.append(f"{name}: {key}=Yes (needs a reset)")
        if not any(gpu.get(key) in ("Yes", "No") for key in MEMORY_FIELDS):
            unknown.append(f"{name}: pending page retirement / row remapping unknown (neither field read)")
    return gpus, problems, unknown


# Kernel-log XIDs of the NVIDIA driver that mean the GPU or its memory failed (NVIDIA's XID catalogue):
# 48 double-bit ECC, 63/64 row remapping, 74 NVLink, 79 fell off the bus, 92 high single-bit ECC rate,
# 94/95 contained/uncontained ECC, 119/120 GSP. Others (13, 31, 43: a program's own fault) are not the node's.
HARDWARE_XIDS = frozenset({48, 63, 64, 74, 79, 92, 94, 95, 119, 120})
XID_LINE = re.compile(r"NVRM: Xid \(([^)]*)\): (\d+),(.*)")


def xids(kernel_log: str) -> list[str]:
    """The hardware XIDs in kernel log lines, one "PCI:...: XID N, text" each, oldest first (pure)."""
    found = []
    for line in kernel_log.splitlines():
        m = XID_LINE.search(line)
        if m and int(m.group(2)) in HARDWARE_XIDS:
            found.append(f"{m.group(1)}: XID {m.group(2)},{m.group(3)[:120]}")
    return found


def read_xids() -> tuple[list[str], str]:
    """(hardware XIDs the kernel logged in the last 24 h, note). From journald without dmesg's privilege:
    readable where the user may read the kernel log (group adm or systemd-journal); else the note says so.
    Recorded in the event, never a verdict: an XID logged before a GPU reset says nothing of it now."""
    if shutil.which("journalctl") is None:
        return [], "XIDs not read: no journalctl"
    answer = _ask(["journalctl", "-k", "-q", "--no-pager", "--since=-24h", "-g", "NVRM: Xid"], NVIDIA_SMI_TIMEOUT_S)
    if answer is None or answer[0] not in (0, 1):  # 1: no line matched
        return [], "XIDs not read: journalctl -k " + ("timed out" if answer is None else f"failed (rc {answer[0]})")
    return xids(answer[1]), ""


def _ask(args: list[str], timeout_s: float) -> tuple[int, str, str] | None:
    """(returncode, stdout, stderr), or None when it did not answer in time. subprocess.run waits for the
    killed child without a timeout, and a child in D state (a GPU off the bus) never dies: then 1 s more
    after SIGKILL, and it is left behind."""
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        proc.kill()
        try:
            proc.wait(timeout=1)
        except subprocess.TimeoutExpired:
            pass
        return None


def query_gpus() -> tuple[list[dict[str, str]], list[str], str]:
    """(GPUs, problems, note) from nvidia-smi; the note says what was not read (nothing, or the counters
    this GPU or driver does not report: "unknown", not "healthy")."""
    if shutil.which("nvidia-smi") is None:
        return [], [], "no nvidia-smi on PATH: GPU counters not read"
    for fields in (GPU_FIELDS, BASIC_GPU_FIELDS):
        answer = _ask(
            ["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"], NVIDIA_SMI_TIMEOUT_S
        )
        if answer is None:
            return [], [f"nvidia-smi did not answer within {NVIDIA_SMI_TIMEOUT_S} s"], ""
        rc, out, err = answer
        if rc == 0:
            gpus, problems, unknown = gpu_problems(out, fields)
            lacks = "" if fields == GPU_FIELDS else "driver lacks the ECC/remap fields; "
            return gpus, problems, (lacks + "unknown: " + "; ".join(unknown)) if unknown else ""
        if "not a valid field" not in (out + err):
            break
    return [], [f"nvidia-smi failed (rc {rc}): {(err or out).strip()[:200]}"], ""


def needed_disk_gb(paths: RunPaths, min_free_disk_gb: float) -> float:
    """The configured floor plus the newest committed checkpoint's size: the next save writes as much."""
    newest = [m for f in reversed(step_folders(paths.checkpoints).values()) if (m := read_marker(f))][:1]
    return min_free_disk_gb + sum(e["bytes"] for e in newest[0]["files"].values()) / 1e9 if newest else min_free_disk_gb


def torn_gb(paths: RunPaths) -> float:
    """What the step folders without COMMITTED take on disk: earlier attempts' torn saves (a stop save on a
    full disk), which this attempt's resume deletes before its first save (checkpoint_files.retention_plan), so
    their space counts as free here (it held the run's folder short for good)."""
    blocks = 0
    for folder in step_folders(paths.checkpoints).values():
        try:
            if not (folder / MARKER).exists():
                blocks += sum(f.lstat().st_blocks for f in folder.iterdir())
        except OSError:  # deleted meanwhile, or unreadable: nothing counted
            pass
    return blocks * 512 / 1e9


def _free(node: dict[str, Any]) -> str:
    torn = node.get("disk_torn_gb", 0.0)
    return f"{node['disk_free_gb']:.1f} GB free" + (
        f" (counting {torn:.1f} GB of torn step folders resume deletes)" if torn else ""
    )


def _by_node(results: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every rank's result folded into its node's (pure): a node is as fast as its slowest device, as skewed as
    its most skewed rank, its problems all of its ranks'."""
    nodes: dict[str, dict[str, Any]] = {}
    for r in results:
        n = nodes.setdefault(r["node"], {"ranks": 0, "problems": [], "matmul_tflops": float("inf"), "wall_s": 0.0})
        n["ranks"] += 1
        n["problems"] += r["problems"]
        n["matmul_tflops"] = min(n["matmul_tflops"], r["matmul_tflops"])
        n["wall_s"] = max(n["wall_s"], r["wall_s"])
        n["device"] = r["device"]
        n["skew_s"] = r["skew_s"] if abs(r["skew_s"]) > abs(n.get("skew_s", 0.0)) else n.get("skew_s", 0.0)
        for key in ("disk_free_gb", "disk_torn_gb", "disk_needed_gb", "disk_folder", "gpus", "gpu_note", "xids"):
            if key in r:
                n[key] = r[key]
    return nodes


def _skewed(nodes: dict[str, dict[str, Any]], rtt_s: float, cfg: PreflightConfig) -> tuple[list[str], list[str]]:
    """The nodes whose clock is off (each node's skew_s made relative to the median node's), and a warning when
    no majority agrees on the time to say which (pure but for skew_s)."""
    import statistics

    # Skew against the median node, not rank 0: rank 0's node 10 s fast made every other node sick (3 of 4:
    # past the exclusion budget, the run stopped). A node is named only when most nodes agree with the median.
    mid_s = statistics.median(n["skew_s"] for n in nodes.values())
    for n in nodes.values():
        n["skew_s"] = round(n["skew_s"] - mid_s, 4)
    skewed = [
        name for name, n in nodes.items() if cfg.max_clock_skew_s and abs(n["skew_s"]) - rtt_s > cfg.max_clock_skew_s
    ]
    spread_s = max(n["skew_s"] for n in nodes.values()) - min(n["skew_s"] for n in nodes.values())
    if (
        cfg.max_clock_skew_s
        and (not skewed or 2 * len(skewed) >= len(nodes))
        and spread_s - rtt_s > cfg.max_clock_skew_s
    ):
        return [], [
            f"clocks differ by {spread_s:.2f} s (+-{rtt_s:.3f} s) > preflight.max_clock_skew_s="
            f"{cfg.max_clock_skew_s:g} across {', '.join(nodes)}, and no majority of nodes agrees on the "
            f"time to say which is wrong: no node left out; check NTP/chrony on them"
        ]
    return skewed, []


def judge(results: list[dict[str, Any]], cfg: PreflightConfig) -> tuple[dict[str, dict[str, Any]], list[str], str]:
    """Every rank's result -> ({node: its figures, with "sick": why or ""}, group warnings, why the whole run
    stops or "") (pure).
    The same gathered list on every rank gives every rank the same verdict, without a broadcast."""
    import statistics  # here, not at the top: the login node imports this module for PreflightConfig

    nodes = _by_node(results)
    rtt_s = max(r["rtt_s"] for r in results)
    median = statistics.median(n["matmul_tflops"] for n in nodes.values())
    skewed, warnings = _skewed(nodes, rtt_s, cfg)
    # The checkpoint folder is usually shared: short on every node, no node is to blame and leaving nodes out
    # frees nothing. The run stops (a requeue would find the same folder as full); a person frees space.
    short = [
        n
        for n in nodes.values()
        if cfg.min_free_disk_gb and n.get("disk_free_gb", float("inf")) < n.get("disk_needed_gb", 0.0)
    ]
    stop = ""
    if short and len(short) == len(nodes):
        f = min(short, key=lambda n: n["disk_free_gb"])
        stop = (
            f"{_free(f)} in the checkpoint folder {f.get('disk_folder', '')} on every node "
            f"< {f['disk_needed_gb']:.1f} GB needed (preflight.min_free_disk_gb={cfg.min_free_disk_gb:g} + the "
            f"newest checkpoint): no node is to blame, and a requeue would find the folder as full, so the run "
            f"stops; free space there (or keep fewer checkpoints with checkpoint.keep_last, or lower "
            f"preflight.min_free_disk_gb), then `hpc-train resume RUN`"
        )
        short = []
    for name, n in nodes.items():
        why = list(dict.fromkeys(n.pop("problems")))
        if any(n is s for s in short):  # node-local folders: this node's is short, others' are not
            why.append(
                f"{_free(n)} in the checkpoint folder < {n['disk_needed_gb']:.1f} GB "
                f"needed (preflight.min_free_disk_gb={cfg.min_free_disk_gb:g} + the newest checkpoint)"
            )
        if name in skewed:
            why.append(
                f"clock {n['skew_s']:+.2f} s from the median node's (+-{rtt_s:.3f} s) > "
                f"preflight.max_clock_skew_s={cfg.max_clock_skew_s:g}"
            )
        if cfg.min_matmul_tflops and n["matmul_tflops"] < cfg.min_matmul_tflops:
            why.append(
                f"matmul {n['matmul_tflops']:.2f} TFLOP/s < preflight.min_matmul_tflops={cfg.min_matmul_tflops:g}"
            )
        elif n["device"] == "cuda" and cfg.slow_fraction and n["matmul_tflops"] < cfg.slow_fraction * median:
            why.append(
                f"matmul {n['matmul_tflops']:.1f} TFLOP/s < {cfg.slow_fraction:g} x the median node's "
                f"{median:.1f} (preflight.slow_fraction)"
            )
        n["sick"] = "; ".join(why)
    gbps = min(r["allreduce_gbps"] for r in results)
    if cfg.min_allreduce_gbps and 0 < gbps < cfg.min_allreduce_gbps:
        warnings.append(
            f"all-reduce {gbps:.2f} GB/s < preflight.min_allreduce_gbps={cfg.min_allreduce_gbps:g} "
            f"(one all-reduce over the group cannot say which node is slow: no node left out)"
        )
    return nodes, warnings, stop


MATMUL_MIN_GPU_S = 0.1  # an idle GPU's clocks ramp up over tens of ms: ~1 ms of matmuls read a healthy GPU as slow


def timed_reps(run: Callable[[int], float], min_s: float, reps: int = 5) -> tuple[int, float]:
    """Run `run(reps)` (-> seconds it took), with more reps each time (x2 to x16, aiming at 1.2 x min_s)
    until one run takes >= min_s: the shorter runs before it are the warm-up. Returns (reps, seconds) of
    that last run (pure but for `run`)."""
    seconds = run(reps)
    while seconds < min_s:
        reps = min(16 * reps, max(2 * reps, math.ceil(1.2 * min_s / max(seconds, 1e-9) * reps)))
        seconds = run(reps)
    return reps, seconds


def _matmul_tflops(device: Any) -> float:
    """A square matmul on the device, TFLOP/s. GPU: 4096^3 in bf16 (~0.2 ms each on an H200), 2 warm-up,
    then timed by CUDA events until one run lasts >= 100 ms. CPU: 512^3 in fp32 (~10-30 ms with one
    thread), 2 warm-up and 5 timed by the wall clock."""
    import torch

    cuda = device.type == "cuda"
    n, dtype = (4096, torch.bfloat16) if cuda else (512, torch.float32)
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(2):
        a @ b

    def run(reps: int) -> float:
        if not cuda:
            t0 = time.perf_counter()
            for _ in range(reps):
                a @ b
            return time.perf_counter() - t0
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            a @ b
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    reps, seconds = timed_reps(run, MATMUL_MIN_GPU_S if cuda else 0.0)
    return reps * 2 * n**3 / seconds / 1e12


def _allreduce_gbps(device: Any, world_size: int) -> float:
    """Bus bandwidth of a 4 MiB fp32 all-reduce (1 warm-up, 3 timed): bytes x 2(n-1)/n per second."""
    import torch
    import torch.distributed as dist

    if world_size == 1:
        return 0.0
    x = torch.ones(ALLREDUCE_BYTES // 4, device=device)
    dist.all_reduce(x)
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(3):
        dist.all_reduce(x)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return 3 * ALLREDUCE_BYTES * 2 * (world_size - 1) / world_size / (time.perf_counter() - t0) / 1e9


def check(env: Any, cfg: PreflightConfig, paths: RunPaths, time_gpu: bool = True) -> dict[str, str]:
    """Collective, on every rank: measure, gather, judge; rank 0 writes the `preflight` event.
    Returns {node: why} for the sick nodes (the same on every rank); raises Unrecoverable on every rank when
    the run itself cannot go on (its checkpoint folder short of space on every node). time_gpu=False (a
    script's rank process, script.py): no CUDA call at all, the matmul and all-reduce timed on the CPU; a
    context, the timing's cached blocks and NCCL's buffers would stay on the child's GPU for the whole run.
    The node's GPUs are still read, from other processes (nvidia-smi, the kernel log's XIDs)."""
    import torch
    import torch.distributed as dist

    from hpc_train import journal
    from hpc_train.preempt import Unrecoverable

    t0 = time.perf_counter()
    node = env.nodes[env.node_rank]
    gpus_here = torch.cuda.is_available()  # the driver's device count: no context
    device = torch.device("cuda", torch.cuda.current_device()) if gpus_here and time_gpu else torch.device("cpu")
    mine: dict[str, Any] = {"node": node, "rank": env.rank, "device": device.type, "problems": []}
    if env.local_rank == 0:  # the node's own facts, once per node
        # Only with GPUs: on a CPU job, nvidia-smi on a GPU-less node exits 6 or 9 ("No devices were found")
        gpus, problems, note = query_gpus() if gpus_here else ([], [], "CPU run: GPU counters not read")
        if gpus_here and torch.cuda.device_count() < env.local_world_size and not gpus:
            problems.append(f"{torch.cuda.device_count()} GPUs visible for {env.local_world_size} tasks")
        mine.update(gpus=len(gpus), gpu_note=note or (f"{len(gpus)} GPUs healthy" if not problems else ""))
        if gpus_here:
            mine["xids"], xid_note = read_xids()
            mine["gpu_note"] = "; ".join(n for n in (mine["gpu_note"], xid_note) if n)
        mine["problems"] += problems
        folder = paths.checkpoints if paths.checkpoints.exists() else paths.run_dir
        mine["disk_folder"] = str(folder)
        torn = torn_gb(paths)
        mine["disk_free_gb"] = round(shutil.disk_usage(folder).free / 1e9 + torn, 1)  # torn folders: freed at resume
        mine["disk_torn_gb"] = round(torn, 3)
        mine["disk_needed_gb"] = round(needed_disk_gb(paths, cfg.min_free_disk_gb), 3)
        if (paths.drills / f"{SICK_DRILL}.{node}").exists():
            mine["problems"].append(f"marked sick by `hpc-train chaos sick-node` (drills/{SICK_DRILL}.{node})")
    mine["matmul_tflops"] = round(_matmul_tflops(device), 4)
    mine["allreduce_gbps"] = round(_allreduce_gbps(device, env.world_size), 3)
    dist.barrier()  # then every rank reads its clock at once, within the all-gather's round trip
    now = time.time()
    clocks = [torch.zeros(1, dtype=torch.float64) for _ in range(env.world_size)]
    dist.all_gather(clocks, torch.tensor([now], dtype=torch.float64))
    mine["rtt_s"] = time.time() - now
    mine["skew_s"] = round(now - float(clocks[0]), 4)
    mine["wall_s"] = round(time.perf_counter() - t0, 3)
    results: list[Any] = [None] * env.world_size
    dist.all_gather_object(results, mine)
    nodes, warnings, stop = judge(results, cfg)
    sick = {n: f["sick"] for n, f in nodes.items() if f["sick"]}
    if env.rank == 0:
        journal.log(
            paths.run_dir,
            journal.PREFLIGHT,
            -1,
            env.job_id,
            env.restart_count,
            nodes=nodes,
            sick=sick,
            warnings=warnings,
            **({"stop": stop} if stop else {}),
            allreduce_gbps=min(r["allreduce_gbps"] for r in results),
            wall_s=round(time.perf_counter() - t0, 3),
        )
        for line in [*(f"node {n} failed the preflight: {why}" for n, why in sick.items()), *warnings]:
            log.warning(f"preflight: {line}")
    if stop:
        raise Unrecoverable(f"preflight: {stop}")
    return sick
