"""Live metrics for dashboards: the Prometheus text exposition format, from a run directory's files. Torch-free.

    hpc-train submit metrics.prometheus_port=9400           # rank 0 serves http://127.0.0.1:9400/metrics
    hpc-train submit 'metrics.prometheus_textfile=/var/lib/node_exporter/textfile/hpc_train_{job}.prom'
    hpc-train status runs/ --prometheus > /var/lib/node_exporter/textfile/hpc_train.prom.tmp   # from cron

One function (`render`) writes the text for every reader: rank 0's endpoint on each scrape, rank 0's
textfile, and `hpc-train status --prometheus` for all runs in a folder. It parses each events.jsonl once
and then only the bytes appended since (rank 0 reads it every 15 s on its training thread: 30 k events
parsed whole took 0.34 s), and only the tail of metrics.jsonl (a 10-step log of a 1 M-step run is 100 k
lines, ~30 MB: not re-read on every scrape).
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from hpc_train import journal
from hpc_train.paths import RunPaths, write_atomic

log = logging.getLogger(__name__)

TAIL_BYTES = 256 * 1024  # ~800 metrics rows: the last row, and the median step time goodput() needs
CLOSE_WAIT_S = 2.0  # the most close() waits for the server loop to stop (it polls every 0.5 s): then server_close
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
    "hpc_train_in_job_restarts": "Training steps relaunched inside the allocation (hot spares) since the last resume.",
    "hpc_train_spares_left": "Hot spares left after the allocation's last in-job restart (NaN: none in it).",
    "hpc_train_committed_step": "The newest step a committed checkpoint holds (NaN before the first).",
    "hpc_train_stragglers": "Ranks named as stragglers now (named and not cleared in this attempt).",
    "hpc_train_straggler_events": "Straggler events in the run so far, all attempts.",
    "hpc_train_last_row_timestamp_seconds": "Unix time of the last metrics.jsonl row (staleness).",
}


def _or_nan(x: float | None) -> float:
    """A gauge's value: NaN for one not known (a script's goodput, journal.goodput)."""
    return math.nan if x is None else x


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


@dataclass
class Journal:
    """What events_of() has parsed of one events.jsonl: the file (device, inode), the bytes through the last
    complete line, its events, and how many bytes the last call parsed."""

    file: tuple[int, int]
    offset: int = 0
    events: list[dict[str, Any]] = field(default_factory=list)
    read_bytes: int = 0


JOURNALS: dict[Path, Journal] = {}
_journals_lock = threading.Lock()  # the training thread's tick and the endpoint's scrapes share JOURNALS


def events_of(run_dir: Path) -> list[dict[str, Any]]:
    """journal.read(run_dir), parsing only what was appended since the last call (a file replaced or
    cut short is parsed again from its start). A torn last line waits for its newline."""
    path = RunPaths(run_dir).events
    with _journals_lock:
        try:
            with open(path, "rb") as f:
                st = os.fstat(f.fileno())
                j = JOURNALS.get(path)
                if j is None or j.file != (st.st_dev, st.st_ino) or st.st_size < j.offset:
                    j = JOURNALS[path] = Journal((st.st_dev, st.st_ino))
                f.seek(j.offset)
                chunk = f.read(st.st_size - j.offset)
        except FileNotFoundError:
            JOURNALS.pop(path, None)
            return []
        j.read_bytes = chunk.rfind(b"\n") + 1
        new = journal.parse(chunk[: j.read_bytes].decode(errors="replace"), str(path))
        j.offset += j.read_bytes
        if new:
            j.events = j.events + new  # a new list: a scrape may be reading the old one
        return j.events


def values(run_dir: Path) -> dict[str, float]:
    """Each metric's value for one run, from its events.jsonl and the tail of its metrics.jsonl (NaN: not yet)."""
    events, rows = events_of(run_dir), tail_rows(RunPaths(run_dir).metrics)
    last = rows[-1] if rows else {}

    def number(x: Any) -> float:
        return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else math.nan

    committed = journal.committed_step(events)
    return {
        "hpc_train_step": number(last.get("step")),
        "hpc_train_loss": number(last.get("loss")),
        "hpc_train_tokens_per_second": number(last.get("tokens_per_s")),
        "hpc_train_mfu": number(last.get("mfu")),
        "hpc_train_data_wait_fraction": number(last.get("data_wait_fraction")),
        "hpc_train_goodput": _or_nan(journal.goodput(events, rows, live=True)["goodput"]) if events else math.nan,
        "hpc_train_attempt": float(journal.current_attempt(events)),
        "hpc_train_in_job_restarts": float(len(journal.in_job_restarts(events))),
        "hpc_train_spares_left": journal.spares_left(events, math.nan),
        "hpc_train_committed_step": float(committed) if committed is not None else math.nan,
        "hpc_train_stragglers": float(len(journal.stragglers_now(events))),
        "hpc_train_straggler_events": float(len(journal.named(events, journal.STRAGGLER))),
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


def labels(run_dir: Path, job: str) -> dict[str, str]:
    """One run's labels, the same from its endpoint, its textfile and `status --prometheus` (or a trial would
    be two series): `run` is the run directory's name, SWEEP/NAME for a sweep's trial (as status shows it);
    `slurm_job`, not `job`, which Prometheus sets on every scraped series itself (ours would become exported_job)."""
    run = f"{run_dir.parent.name}/{run_dir.name}" if (run_dir.parent / "sweep.json").exists() else run_dir.name
    return {"slurm_job": job, "run": run}


def run_text(run_dir: Path, job: str) -> str:
    return render([(labels(run_dir, job), values(run_dir))])


@dataclass
class Exporter:
    """Rank 0's endpoint and textfile: tick() after each metrics row, close() at the end."""

    text: Callable[[], str]
    textfile: str = ""
    server: ThreadingHTTPServer | None = None
    written_at: float = -math.inf
    warned: bool = False

    def warn_once(self, e: Exception) -> str:
        """One line for a render that failed (a row someone edited into another shape, a bug of ours):
        printed once per attempt, not once per scrape; a dashboard never stops training."""
        line = " ".join(f"{type(e).__name__}: {e}".split())[:300]
        if not self.warned:
            self.warned = True
            log.warning(
                f"the Prometheus metrics could not be rendered ({line}); training goes "
                f"on, the endpoint answers 500 and the textfile keeps its last values until it renders again"
            )
        return line

    def tick(self, force: bool = False) -> None:
        if self.textfile and (force or time.monotonic() - self.written_at >= TEXTFILE_EVERY_S):
            try:
                write_atomic(Path(self.textfile), self.text())  # whole or absent for the collector
            except OSError as e:  # the folder is gone or read-only: not tried again
                log.warning(f"metrics.prometheus_textfile={self.textfile}: {e}; not written again in this attempt")
                self.textfile = ""
            except Exception as e:  # noqa: BLE001  (the run's files: tried again at the next tick)
                self.warn_once(e)
            self.written_at = time.monotonic()

    def close(self) -> None:
        """The textfile goes: this node no longer runs the attempt, and node-exporter would export its
        frozen values for ever (Prometheus keeps their history; a requeued attempt writes its own file)."""
        if self.textfile:
            Path(self.textfile).unlink(missing_ok=True)
        if self.server is not None:  # bounded: a stop save's requeue decision or the finish must not wait on a scraper
            stopper = threading.Thread(target=self.server.shutdown, daemon=True)
            stopper.start()
            stopper.join(CLOSE_WAIT_S)
            self.server.server_close()


def start(
    addr: str, port: int, textfile: str, job: str, text: Callable[[], str], event: Callable[..., None]
) -> Exporter:
    """The endpoint (a daemon thread; any path answers) when port > 0, the textfile when set ({job} in its
    path: this Slurm job's id, so the jobs that share a node, sweep trials among them, write one file each).
    A port already in use logs a `prometheus_failed` event and training goes on without the endpoint."""
    exporter = Exporter(text, textfile.replace("{job}", job))
    if port > 0:

        class Handler(BaseHTTPRequestHandler):
            timeout = 5  # seconds: a client that connects and sends nothing is dropped, not served forever

            def do_GET(self) -> None:  # noqa: N802  (http.server's name)
                try:
                    body, code = text().encode(), 200
                except Exception as e:  # noqa: BLE001  one line to the scraper, not a traceback per scrape
                    body, code = (
                        f"hpc_train: the metrics could not be rendered: {exporter.warn_once(e)}\n".encode(),
                        500,
                    )
                self.send_response(code)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:  # not one stderr line per scrape
                pass

        try:
            exporter.server = ThreadingHTTPServer((addr, port), Handler)
            exporter.server.daemon_threads = True  # one thread per scrape; a stuck one never holds the exit
        except OSError as e:
            event(journal.PROMETHEUS_FAILED, -1, address=f"{addr}:{port}", error=str(e))
            log.warning(
                f"metrics.prometheus_port={port} on {addr}: {e}; training goes on without "
                f"the endpoint (pick a free port, or metrics.prometheus_textfile=PATH)"
            )
        else:
            threading.Thread(target=exporter.server.serve_forever, name="prometheus", daemon=True).start()
            event(journal.PROMETHEUS, -1, address=f"http://{addr}:{port}/metrics")
    exporter.tick(force=True)
    return exporter
