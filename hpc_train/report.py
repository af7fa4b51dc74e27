"""`hpc-train report`: a run's goodput, its attempts, and a PNG of them (matplotlib, imported only to draw
it). Torch-free (login node).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hpc_train import journal
from hpc_train.metrics import read_metrics
from hpc_train.paths import MEMORY, RunPaths, profile_files
from hpc_train.runs import Run


def share(goodput: float | None) -> str:
    """A goodput as a percentage; "unknown" when a script's attempt leaves it untold (journal.goodput)."""
    return "unknown" if goodput is None else f"{goodput:.1%}"


def size_text(att: dict[str, Any]) -> str:
    """An attempt's size for `report`: "4 on node1,node3" (ranks on nodes); past 4 nodes, their count."""
    if not att.get("world_size"):
        return "-"
    nodes = att.get("nodes") or []
    return f"{att['world_size']} on {','.join(nodes) if len(nodes) <= 4 else f'{len(nodes)} nodes'}"


def ended_text(att: dict[str, Any], nodes: int | None) -> str:
    """How an attempt ended, for `report`: an elastic requeue's next size always ("requeue (next: 2-2 nodes)",
    what Slurm may start it on), an in-job restart's only when it goes on smaller than cluster.nodes (`nodes`;
    None: not known, shown) since a relaunch on a spare keeps the size; then the nodes it left out."""
    end, nxt = att["ended_by"], att["nodes_next"]
    smaller = end != journal.IN_JOB_RESTART or not isinstance(nxt, int) or nodes is None or nxt < nodes
    left, replaced = att["left_out"], att.get("replaced")
    swaps = replaced.items() if isinstance(replaced, dict) else ()  # a hand-edited journal must not crash report
    return (
        end
        + (f" (next: {nxt} nodes)" if nxt and smaller else "")
        + (
            f" (left out: {','.join(map(str, left))}; {att['spares_left']} spare(s) left)"
            if left and isinstance(left, list)
            else ""
        )
        + (" (in process" + "".join(f"; {dead} -> {new}" for dead, new in swaps) + ")" if att.get("in_process") else "")
    )


def cluster_nodes(run_dir: Path) -> int | None:
    """The frozen cluster.nodes of a run (config.yaml), None when it cannot be read."""
    import yaml

    try:
        nodes = yaml.safe_load((run_dir / "config.yaml").read_text())["cluster"]["nodes"]
    except (OSError, ValueError, KeyError, TypeError, yaml.YAMLError):
        return None
    return nodes if isinstance(nodes, int) else None


def batch_text(atts: list[dict[str, Any]]) -> list[str] | None:
    """Per attempt "32 seqs x1" (global batch, micro-batches per step) when it differs between attempts
    (an elastic resume accumulates more, or a batch_changed one steps fewer sequences), else None."""
    seen = {(a.get("global_batch_seqs"), a.get("grad_accum_steps")) for a in atts if a.get("world_size")}
    if len(seen) < 2:
        return None
    return [
        f"{a['global_batch_seqs']} seqs x{a['grad_accum_steps']}" if a.get("global_batch_seqs") else "-" for a in atts
    ]


def profile_lines(run_dir: Path) -> list[str]:
    """Where profile.* wrote its files, one line per attempt and window, and how to open them ([] if none)."""
    folder = RunPaths(run_dir).profile
    groups: dict[tuple[int, int, int, str], list[tuple[int, Path]]] = {}
    for attempt, first, last, rank, kind, path in profile_files(folder):
        groups.setdefault((attempt, first, last, kind), []).append((rank, path))
    if not groups:
        return []
    lines = [f"profiles in {folder}:"]
    for (attempt, first, last, kind), ranks in groups.items():
        what = "memory snapshots" if kind == MEMORY else "traces"
        numbers = [r for r, _ in ranks]
        span = f"{numbers[0]}-{numbers[-1]}" if numbers == list(range(numbers[0], numbers[-1] + 1)) else numbers
        lines.append(
            f"  attempt {attempt}, steps {first}-{last}: {len(ranks)} {what} (ranks {span}), e.g. {ranks[0][1].name}"
        )
    lines.append("  open a trace at https://ui.perfetto.dev (Open trace file) or in Chrome at chrome://tracing (Load)")
    if any(kind == MEMORY for *_, kind in groups):
        lines.append("  open a memory snapshot at https://pytorch.org/memory_viz (drag the .memory.pickle in)")
    return lines


def report_marks(atts: list[dict[str, Any]], metrics: list[dict[str, Any]]) -> dict[str, Any]:
    """What the report's axes show, chosen without drawing (pure): one integer tick per attempt, the
    attempt boundaries (seconds since the first launch; the step each later attempt resumed from), and
    a tokens/s axis from 0, so 0.3 tok/s of noise on 4,000 stays a flat line instead of a cliff."""
    t0 = atts[0]["launched"] if atts else 0.0
    rates = [m["tokens_per_s"] for m in metrics if isinstance(m.get("tokens_per_s"), (int, float))]
    return {
        "t0": t0,
        "attempt_ticks": [a["restart"] for a in atts],
        "boundaries_s": [a["launched"] - t0 for a in atts[1:]],
        "boundary_steps": [a["start_step"] for a in atts[1:] if a["start_step"] is not None],
        "tokens_per_s_ylim": (0.0, max(rates, default=0.0) * 1.1 or 1.0),  # 10% headroom above the top point
    }


def report(run: Run, png: Path | None) -> tuple[dict[str, Any], list[dict[str, Any]], str]:
    """Goodput parts, attempts, and the PNG path written ('' when matplotlib is missing)."""
    events, metrics = journal.read(run.run_dir), read_metrics(run.run_dir)
    parts, atts = journal.goodput(events, metrics), journal.attempts(events)
    if png is None:
        return parts, atts, ""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return parts, atts, "matplotlib is not installed: pip install 'hpc_train[plot]' (or matplotlib) for the PNG"
    png.parent.mkdir(parents=True, exist_ok=True)
    marks = report_marks(atts, metrics)
    t0 = marks["t0"]
    fig, (ax_t, ax_l, ax_s) = plt.subplots(3, 1, figsize=(10, 8), height_ratios=[1.2, 1, 1])
    for k, a in enumerate(atts):
        ax_t.barh(
            a["restart"],
            a["end"] - a["launched"],
            left=a["launched"] - t0,
            color="#9ecae1",
            label="training" if k == 0 else None,
        )
        if a["start"]:
            ax_t.barh(
                a["restart"],
                a["start"] - a["launched"],
                left=a["launched"] - t0,
                color="#fdae6b",
                label="start-up" if k == 0 else None,
            )
    commits = journal.named(events, journal.CHECKPOINT_COMMITTED)
    ax_t.scatter(
        [e["time"] - t0 for e in commits],
        [e["restart"] for e in commits],
        marker="|",
        s=200,
        color="green",
        label="checkpoint committed",
    )
    sig = journal.named(events, journal.SIGNAL, journal.CHAOS, journal.FAIL)
    ax_t.scatter(
        [e["time"] - t0 for e in sig],
        [e["restart"] for e in sig],
        marker="x",
        s=80,
        color="red",
        label="signal / injected / failure",
    )
    ax_t.set_yticks(marks["attempt_ticks"])
    ax_t.set(
        xlabel="seconds since first launch", ylabel="attempt", title=f"{run.label}: goodput {share(parts['goodput'])}"
    )
    ax_t.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)  # beside the bars, never over them
    ax_l.plot([m["step"] for m in metrics], [m.get("loss", float("nan")) for m in metrics], ".-")
    ax_l.set(xlabel="step", ylabel="loss")
    ax_s.plot([m["time"] - t0 for m in metrics], [m.get("tokens_per_s", 0) for m in metrics], ".-")
    ax_s.set(
        xlabel="seconds since first launch", ylabel="tokens/s", ylim=marks["tokens_per_s_ylim"], xlim=ax_t.get_xlim()
    )  # the same clock as the timeline above, boundaries aligned
    for ax, xs in ((ax_t, marks["boundaries_s"]), (ax_s, marks["boundaries_s"]), (ax_l, marks["boundary_steps"])):
        for k, x in enumerate(xs):
            ax.axvline(
                x, color="gray", linestyle="--", linewidth=1, label="next attempt" if k == 0 and ax is ax_l else None
            )
    if marks["boundary_steps"]:
        ax_l.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return parts, atts, str(png)
