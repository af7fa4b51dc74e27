"""metrics.jsonl: loss, lr, step time per log interval, appended by rank 0 and read by status, report,
tracking and Prometheus. Torch-free. (events.jsonl, the run's journal, is journal.py's.)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hpc_train import journal
from hpc_train.paths import RunPaths


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """All complete records that are JSON objects; a torn last line (writer killed mid-write) is skipped."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """metrics.jsonl rows with a numeric `time` and `step`."""
    return [m for m in read_jsonl(RunPaths(run_dir).metrics) if _number(m.get("time")) and _number(m.get("step"))]


# Slurm may deliver the --signal warning up to 60 s before the requested lead (its sweep runs once a minute).
SLURM_SIGNAL_SLACK_S = 60


def lead_warning(run_dirs: list[Path], signal_lead_s: int) -> str:
    """ "" if signal_lead_s covers the slowest measured save + the slowest step + Slurm's slack in these
    runs, else a warning that names the measurements and the value to use."""
    return lead_warning_of([(journal.read(d), read_metrics(d)) for d in run_dirs], signal_lead_s)


def lead_warning_of(runs: list[tuple[list[dict[str, Any]], list[dict[str, Any]]]], signal_lead_s: int) -> str:
    """lead_warning of runs already read, as (events, metrics) pairs (pure)."""
    saves = [s for events, _ in runs for s in journal.save_times_s(events)]
    # a step's evaluation (eval_s) runs before its stop check: counted whole (a signal cuts it after 8 batches)
    steps = [
        m.get("step_time_s", 0.0) + (m.get("eval_s") if _number(m.get("eval_s")) else 0.0)
        for _, metrics in runs
        for m in metrics
        if _number(m.get("step_time_s", 0.0))
    ]
    steps += [s for events, _ in runs for s in journal.first_step_times_s(events)]
    saves, steps = [x for x in saves if _number(x)], [x for x in steps if _number(x)]
    if not saves:
        return ""
    needed = max(saves) + max(steps, default=0.0) + SLURM_SIGNAL_SLACK_S
    if signal_lead_s >= needed:
        return ""
    return (
        f"cluster.signal_lead_s={signal_lead_s} is shorter than measured: the slowest save took "
        f"{max(saves):.1f} s and the slowest step {max(steps, default=0.0):.1f} s, and Slurm may signal up to "
        f"{SLURM_SIGNAL_SLACK_S} s early; use cluster.signal_lead_s>={int(needed) + 1}"
    )


# Dense bf16 peak per GPU, TFLOP/s (vendor datasheets, no sparsity), by the exact name that
# `nvidia-smi --query-gpu=name` and torch.cuda.get_device_name() report. Exact, not by substring: "H100"
# is in the PCIe (756) and NVL (835) names as well as the SXM one (989).
PEAK_TFLOPS = {
    "NVIDIA B200": 2250.0,
    "NVIDIA GB200": 2500.0,
    "NVIDIA H200": 989.0,  # SXM
    "NVIDIA H200 NVL": 835.0,
    "NVIDIA GH200 480GB": 989.0,
    "NVIDIA H100 80GB HBM3": 989.0,  # SXM
    "NVIDIA H100 PCIe": 756.0,
    "NVIDIA H100 NVL": 835.0,
    "NVIDIA A100-SXM4-80GB": 312.0,
    "NVIDIA A100-SXM4-40GB": 312.0,
    "NVIDIA A100 80GB PCIe": 312.0,
    "NVIDIA A100-PCIE-40GB": 312.0,
    "NVIDIA L40S": 362.0,
    "NVIDIA L40": 181.0,
    "NVIDIA L4": 121.0,
    "NVIDIA A10": 125.0,
}


def peak_tflops(gpu_name: str) -> float | None:
    """The GPU's dense bf16 peak by its exact name (surrounding spaces and case aside); None for a name
    not in the table (MFU is then "n/a": set train.peak_tflops_per_device)."""
    wanted = gpu_name.strip().casefold()
    return next((tf for name, tf in PEAK_TFLOPS.items() if name.casefold() == wanted), None)
