"""Live metrics for dashboards: the Prometheus text exposition format, from a run directory's files. Torch-free.

    hpc-train submit metrics.prometheus_port=9400           # rank 0 serves http://127.0.0.1:9400/metrics
    hpc-train submit metrics.prometheus_textfile=/var/lib/node_exporter/textfile/hpc_train.prom
    hpc-train status runs/ --prometheus > /var/lib/node_exporter/textfile/hpc_train.prom.tmp   # from cron

One function (`render`) writes the text for every reader: rank 0's endpoint on each scrape, rank 0's
textfile, and `hpc-train status --prometheus` for all runs in a folder. It reads events.jsonl whole (a
few lines per checkpoint) and only the tail of metrics.jsonl (a 10-step log of a 1 M-step run is 100 k
lines, ~30 MB: not re-read on every scrape).
"""

from __future__ import annotations

import math
import os
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any, Callable

from hpc_train.metrics import read_events
from hpc_train.paths import RunPaths

TAIL_BYTES = 256 * 1024  # ~800 metrics rows: the last row, and the median step time goodput() needs
TEXTFILE_EVERY_S = 15.0  # Prometheus' default scrape interval: a textfile written more often is read no more often

# name -> (help, where the value comes from); all gauges.
METRICS = {
    "hpc_train_step": "Last optimizer step logged to metrics.jsonl.",
    "hpc_train_loss": "Training loss at that step (mean over ranks).",
    "hpc_train_tokens_per_second": "Training tokens per second, all ranks together, at that step.",
    "hpc_train_mfu": "Model FLOPs utilization at that step (NaN on CPU: no peak to divide by).",
    "hpc_train_data_wait_fraction": "Share of that step's wall time rank 0 spent waiting for data.",
    "hpc_train_goodput": "Share of the allocated time so far that became committed training.",
    "hpc_train_attempt": "The attempt running now (Slurm restarts, 0 = the first).",
    "hpc_train_committed_step": "The newest step a committed checkpoint holds (NaN before the first).",
    "hpc_train_stragglers": "Ranks named as stragglers now (named and not cleared in this attempt).",
    "hpc_train_straggler_events": "Straggler events in the run so far, all attempts.",
    "hpc_train_last_row_timestamp_seconds": "Unix time of the last metrics.jsonl row (staleness).",
}


def tail_rows(path: Path, tail_bytes: int = TAIL_BYTES) -> list[dict[str, Any]]:
    """The complete JSON rows in the last tail_bytes of a .jsonl file (the first, cut, line is dropped)."""
    import json

    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - tail_bytes))
            lines = f.read().decode(errors="replace").splitlines()
    except FileNotFoundError:
        return []
    if size > tail_bytes:
        lines = lines[1:]
    rows = []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:  # a torn last line: the writer is mid-write
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), (int, float)):
            rows.append(row)
    return rows


def values(run_dir: Path) -> dict[str, float]:
    """Each metric's value for one run, from its events.jsonl and the tail of its metrics.jsonl (NaN: not yet)."""
    from hpc_train.ops import goodput
    from hpc_train.straggler import current

    events, rows = read_events(run_dir), tail_rows(RunPaths(run_dir).metrics)
    last = rows[-1] if rows else {}

    def number(x: Any) -> float:
        return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else math.nan

    commits = [e["step"] for e in events if e["event"] == "checkpoint_committed"]
    return {
        "hpc_train_step": number(last.get("step")),
        "hpc_train_loss": number(last.get("loss")),
        "hpc_train_tokens_per_second": number(last.get("tokens_per_s")),
        "hpc_train_mfu": number(last.get("mfu")),
        "hpc_train_data_wait_fraction": number(last.get("data_wait_fraction")),
        "hpc_train_goodput": goodput(events, rows)["goodput"] if events else math.nan,
        "hpc_train_attempt": float(max((e["restart"] for e in events if e["event"] in ("start", "resume")), default=0)),
        "hpc_train_committed_step": float(max(commits)) if commits else math.nan,
        "hpc_train_stragglers": float(len(current(events))),
        "hpc_train_straggler_events": float(sum(e["event"] == "straggler" for e in events)),
        "hpc_train_last_row_timestamp_seconds": number(last.get("time")),
    }


def _label(value: str) -> str:
    """A label value as the exposition format wants it: backslash, double quote and newline escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _value(x: float) -> str:
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "+Inf" if x > 0 else "-Inf"
    return repr(int(x)) if x.is_integer() and abs(x) < 2**53 else repr(x)


def render(samples: list[tuple[dict[str, str], dict[str, float]]]) -> str:
    """The exposition text for runs given as (labels, values): one HELP and TYPE per metric, then one
    line per run (the format wants a metric's lines together)."""
    out = []
    for name, help_text in METRICS.items():
        out += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge"]
        for labels, vals in samples:
            text = ",".join(f'{k}="{_label(v)}"' for k, v in labels.items())
            out.append(f"{name}{{{text}}} {_value(vals.get(name, math.nan))}")
    return "\n".join(out) + "\n"


def run_text(run_dir: Path, job: str, run: str) -> str:
    return render([({"job": job, "run": run}, values(run_dir))])


def write_atomic(path: Path, text: str) -> None:
    """Whole or absent for node-exporter's textfile collector: a tmp file beside it, then os.replace."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


@dataclass
class Exporter:
    """Rank 0's endpoint and textfile: tick() after each metrics row, close() at the end."""
    text: Callable[[], str]
    textfile: str = ""
    server: HTTPServer | None = None
    written_at: float = -math.inf

    def tick(self, force: bool = False) -> None:
        if self.textfile and (force or time.monotonic() - self.written_at >= TEXTFILE_EVERY_S):
            try:
                write_atomic(Path(self.textfile), self.text())
            except OSError as e:  # a dashboard's file never stops training
                print(f"[hpc_train] warning: metrics.prometheus_textfile={self.textfile}: {e}; not written again "
                      f"in this attempt", flush=True)
                self.textfile = ""
            self.written_at = time.monotonic()

    def close(self) -> None:
        self.tick(force=True)
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()


def start(addr: str, port: int, textfile: str, text: Callable[[], str],
          event: Callable[..., None]) -> Exporter:
    """The endpoint (a daemon thread; any path answers) when port > 0, the textfile when set. A port
    already in use logs a `prometheus_failed` event and training goes on without the endpoint."""
    exporter = Exporter(text, textfile)
    if port > 0:

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802  (http.server's name)
                body = text().encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:  # not one stderr line per scrape
                pass

        try:
            exporter.server = HTTPServer((addr, port), Handler)
        except OSError as e:
            event("prometheus_failed", -1, address=f"{addr}:{port}", error=str(e))
            print(f"[hpc_train] warning: metrics.prometheus_port={port} on {addr}: {e}; training goes on without "
                  f"the endpoint (pick a free port, or metrics.prometheus_textfile=PATH)", flush=True)
        else:
            threading.Thread(target=exporter.server.serve_forever, name="prometheus", daemon=True).start()
            event("prometheus", -1, address=f"http://{addr}:{port}/metrics")
    exporter.tick(force=True)
    return exporter
