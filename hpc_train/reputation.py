"""Node reputation across runs: every verdict the journals of a project's runs hold on a node (it failed the
preflight, a hardware error, a hang, lost from the job, a straggler), weighed by its age, and the nodes a
submit leaves out for their record, never so many that the job cannot be placed. Torch-free; reads files,
never writes them; the caller asks Slurm (plan.py: the partition and node records it validates with).

    hpc-train nodes                                  # every node with a verdict: its score, left out or not
    hpc-train nodes runs --json
    hpc-train submit cluster=mysite cluster.avoid_bad_nodes=false    # every node, whatever its record

    from hpc_train import reputation
    record = reputation.harvest(Path("runs"))        # the newest 200 journals of the last 7 days
    reputation.scores(record, time.time())           # node -> decayed score; >= THRESHOLD: left out

Why harvested and not a file of its own: a run's journal already records every verdict when it is made
(`preflight`, `node_excluded`, `node_not_excluded`, `straggler`), so the job side writes nothing more, a crash
loses no verdict, a dry run reads and writes nothing, and teammates' shared runs count too. What it costs: a
deleted run folder takes its verdicts with it.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpc_train import journal, preempt
from hpc_train.env import parse_nodelist
from hpc_train.paths import RunPaths

# A verdict weighs 1 (a straggler 0.5) and halves every 24 h; a node is left out while its score is >= 0.5. So one
# failed preflight keeps a node out for a day, two for two days, four for three: a node that fails again and again
# stays out longer, a passing fault (a full /tmp, a stuck process) is forgotten by tomorrow. Trusting a node too
# early costs one requeue (the next preflight finds it again); distrusting a healthy one costs its capacity.
HALF_LIFE_S = 24 * 3600.0
THRESHOLD = 0.5
# One straggler naming is no proof (a neighbour's job, noise: 0.5, never enough alone); two within a day are.
WEIGHTS = {"preflight": 1.0, "hardware": 1.0, "hang": 1.0, "lost": 1.0, "blamed": 1.0, "straggler": 0.5}
SAID = {
    "preflight": "failed the preflight",
    "hardware": "a hardware error",
    "hang": "hung",
    "lost": "lost from its job",
    "blamed": "blamed",
    "straggler": "a straggler",
}
# Journals read: the newest 200 changed in the last 7 half-lives. A verdict a week old weighs 1/128: it would take
# 64 of them to leave a node out. 200 journals of 570 KB each (114 MB, mostly checkpoint lines): 0.17 s here.
HORIZON_S = 7 * HALF_LIFE_S
MAX_JOURNALS = 200
NAMED = 3  # nodes named in the submit's one line; the rest counted (`hpc-train nodes` lists them all)


@dataclass(frozen=True)
class Verdict:
    node: str
    kind: str  # a key of WEIGHTS
    why: str
    time: float  # Unix s, the node's own clock where it wrote the journal
    run: str  # the run directory whose journal holds it
    attempt: int


@dataclass
class Record:
    verdicts: list[Verdict] = field(default_factory=list)
    passed: dict[str, float] = field(default_factory=dict)  # node -> when it last passed a preflight
    journals: int = 0  # read
    left: int = 0  # changed within HORIZON_S but past MAX_JOURNALS: not read


# ---- verdicts out of one journal (pure) ------------------------------------------------------------------


def kind_of(why: str) -> str:
    """A blame's kind from its reason's words (failure.hung_nodes, requeue.lost_nodes, failure.after_failure's
    hardware error; supervisor.py's for a script)."""
    if " hung: " in why:
        return "hang"
    if "left the job's allocation" in why:
        return "lost"
    if "hardware error" in why:
        return "hardware"
    return "blamed"


def verdicts(events: list[journal.Event], run: str) -> tuple[list[Verdict], dict[str, float]]:
    """(the verdicts a run's events hold, one per node and attempt (a straggler's apart), node -> when it last
    passed a preflight). A sick node's `preflight` comes before its `node_excluded`: one verdict, the preflight's.
    A straggler counts only when its `straggler_cleared` never came in that attempt: back to speed, it was the
    moment, not the node."""
    out: dict[tuple[int, str, bool], Verdict] = {}
    passed: dict[str, float] = {}

    def add(e: journal.Event, node: Any, kind: str, why: str) -> None:
        if isinstance(node, str) and node:
            out.setdefault(
                (e.get("restart", 0), node, kind == "straggler"),
                Verdict(node, kind, why, e["time"], run, e.get("restart", 0)),
            )

    for e in journal.named(events, journal.PREFLIGHT):
        for node, facts in _mapping(e.get("nodes")).items():
            if isinstance(facts, dict) and not facts.get("sick"):
                passed[node] = max(passed.get(node, 0.0), e["time"])
        sick, seen = _mapping(e.get("sick")), _mapping(e.get("nodes"))
        if len(sick) > 1 and set(sick) >= set(seen):  # every node sick: the run's own setup (N GPUs for M tasks,
            continue  # a matmul floor too high), no node to blame, as preflight judges a full disk
        for node, why in sick.items():
            add(e, node, "preflight", str(why))
    for e in journal.named(events, journal.NODE_EXCLUDED, journal.NODE_NOT_EXCLUDED):
        why = str(e.get("why", ""))
        nodes = e.get("nodes") if isinstance(e.get("nodes"), list) else [e.get("node")]
        for node in nodes:
            add(e, node, kind_of(why), why)
    for e in journal.uncleared_stragglers(events):
        own, median = e.get("own_s"), e.get("median_own_s")
        figures = (
            f": {own * 1e3:.1f} ms/step of its own vs the others' median {median * 1e3:.1f} ms"
            if _numbers(own, median)
            else ""
        )
        add(e, e.get("node"), "straggler", f"rank {e.get('rank')} a straggler{figures}")
    return list(out.values()), passed


def _mapping(x: Any) -> dict[str, Any]:
    return {k: v for k, v in x.items() if isinstance(k, str)} if isinstance(x, dict) else {}


def _numbers(*xs: Any) -> bool:
    return all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in xs)


# ---- the harvest (reads files) ---------------------------------------------------------------------------


def journal_files(root: Path) -> list[Path]:
    """Every run's events.jsonl under `root`: root itself (a run), its runs, and a sweep's trials (NNNN/), once each
    (runs/latest -> demo-3 is demo-3)."""
    found: dict[Path, Path] = {}

    def look(folder: Path) -> None:
        path = RunPaths(folder).events
        if path.is_file():
            found.setdefault(path.resolve(), path)

    look(root)
    for top in _folders(root):
        look(top)
        if (top / "sweep.json").is_file():
            for trial in _folders(top):
                if trial.name.isdigit():
                    look(trial)
    return list(found.values())


def _folders(path: Path) -> list[Path]:
    try:
        with os.scandir(path) as it:
            return [Path(d.path) for d in it if d.is_dir()]
    except OSError:  # not a folder, or not ours to list
        return []


def harvest(root: Path, now: float, horizon_s: float = HORIZON_S, max_journals: int = MAX_JOURNALS) -> Record:
    """The verdicts of the runs under `root` (a project's out_dir, a sweep, a run): the newest `max_journals`
    journals changed within `horizon_s`, and of each only the lines that can hold a verdict parsed (a journal is
    mostly checkpoints and steps). A damaged line is skipped (journal.parse: one warning per file), an unreadable
    journal too."""
    recent = []
    for path in journal_files(root):
        try:
            changed = path.stat().st_mtime
        except OSError:
            continue
        if changed >= now - horizon_s:
            recent.append((changed, path))
    recent.sort(reverse=True)
    record = Record(left=max(0, len(recent) - max_journals))
    for _, path in recent[:max_journals]:
        try:
            data = path.read_bytes()
        except OSError:
            continue
        record.journals += 1
        found, passed = verdicts(journal.parse(_verdict_lines(data), str(path)), str(path.parent))
        record.verdicts += [v for v in found if v.time >= now - horizon_s]
        for node, t in passed.items():
            record.passed[node] = max(record.passed.get(node, 0.0), t)
    return record


MARKS = (b'"preflight"', b'"node_excluded"', b'"node_not_excluded"', b'"straggler')  # straggler and _cleared


def _verdict_lines(data: bytes) -> str:
    """The lines that may be verdicts, each whole, in order; a torn last line (its writer still writing) left out,
    as journal.parse leaves it. Found by searching the bytes for each mark (a journal is mostly other lines: 200
    journals of 570 KB took 0.6 s split into lines and tested one by one)."""
    end = data.rfind(b"\n") + 1  # past it: torn or empty
    starts = set()
    for mark in MARKS:
        at = data.find(mark, 0, end)
        while at != -1:
            starts.add(data.rfind(b"\n", 0, at) + 1)
            at = data.find(mark, data.find(b"\n", at, end), end)  # from the next line on
    return "".join(data[s : data.find(b"\n", s) + 1].decode(errors="replace") for s in sorted(starts))


# ---- scores (pure) ---------------------------------------------------------------------------------------


def cleared(v: Verdict, passed: dict[str, float]) -> bool:
    """A failed preflight is cleared by a later passed one on the node (the same checks pass now: fixed, or it was
    passing); a hang, a hardware error or a loss is not (5 matmuls do not show that an Xid under hours of load is
    gone): those decay."""
    return v.kind == "preflight" and passed.get(v.node, -math.inf) > v.time


def weight(v: Verdict, now: float) -> float:
    """WEIGHTS[kind] halved every HALF_LIFE_S of age; a verdict from the future (another node's clock ahead) weighs
    as if new, never more."""
    return WEIGHTS.get(v.kind, 1.0) * 0.5 ** (max(0.0, now - v.time) / HALF_LIFE_S)


def scores(record: Record, now: float) -> dict[str, float]:
    """node -> the sum of its verdicts' weights now, cleared ones left out; every node with a verdict on record."""
    out: dict[str, float] = {}
    for v in record.verdicts:
        out[v.node] = out.get(v.node, 0.0) + (0.0 if cleared(v, record.passed) else weight(v, now))
    return out


def out_for_s(score: float) -> float:
    """Seconds until a node of this score is let back in (its score under THRESHOLD); 0 when it is already in."""
    return HALF_LIFE_S * math.log2(score / THRESHOLD) if score >= THRESHOLD else 0.0


# ---- what a submit leaves out (pure) ---------------------------------------------------------------------


def leave_out(
    score: dict[str, float], states: dict[str, str], need: int, exclude: Iterable[str], required: Iterable[str]
) -> tuple[list[str], list[str], list[str]]:
    """(the nodes left out, those kept in so that the job still fits, those kept in because cluster.nodelist
    requires them): the nodes whose score is >= THRESHOLD among `states` (the partition's nodes that could take the
    job -> their short state), less `exclude` (out anyway). The partition keeps `need` usable nodes beyond the ones
    left out (preempt.fit_exclusions): the lowest scores are let back in first; a node unusable anyway (drained,
    down) costs nothing and stays out."""
    exclude, required = set(exclude), set(required)
    bad = [n for n, s in score.items() if s >= THRESHOLD and n in states and n not in exclude]
    wanted = sorted((n for n in bad if n not in required), key=lambda n: (score[n], n))  # let in: lowest first
    out, back = preempt.fit_exclusions(wanted, states, need, sorted(exclude))
    # and of every state: a drained node left out too of a job that needs the whole partition is a request Slurm
    # refuses ("Requested node configuration is not available") or holds pending for good, not a wait for its repair
    while out and len([n for n in states if n not in exclude]) - len(out) < need:
        weakest = min(out, key=lambda n: (score[n], n))
        out, back = [n for n in out if n != weakest], sorted([*back, weakest])
    return out, back, sorted(n for n in bad if n in required)


def eligible(cluster: Any, part: dict[str, str], node_info: dict[str, dict[str, str]]) -> dict[str, str]:
    """The partition's nodes that could take one of the job's nodes (its CPUs, its GPUs, its plain features), ->
    their short state from the controller's own record (slurm.short_state: sinfo said "mix" for 30 s after a
    drained node's resume). Counting the others would let a bad node out for room the job cannot use."""
    from hpc_train.sbatch import _gpu_count
    from hpc_train.slurm import short_state

    members = set(parse_nodelist(part.get("Nodes", "")))
    words = [w for w in re.split(r"[&|,\[\]()!*\s]+", cluster.constraint or "") if w and not w.isdigit()]
    either = "|" in (cluster.constraint or "")  # "a|b", "[a|b]": any of them; else "a&b", "a,b": every one
    out = {}
    for node, info in node_info.items():
        features = set(info.get("AvailableFeatures", "").split(","))
        fits = (
            node in members
            and int(info.get("CPUTot", "0") or 0) >= cluster.tasks_per_node * cluster.cpus_per_task
            and _gpu_count(info.get("Gres", "")) >= cluster.gpus_per_node
            and (any if either else all)(w in features for w in words)
        )
        if fits:
            out[node] = short_state(info.get("State", ""))
    return out


def avoid(
    cluster: Any, record: Record, parts: dict[str, dict[str, str]], node_info: dict[str, dict[str, str]], now: float
) -> tuple[str | None, str]:
    """(cluster.exclude with the nodes left out for their record added after the user's own, the sentence that
    says which and why; "" when no node of the partition has a bad record). The job's full size (nodes +
    spare_nodes, an elastic run's cluster.nodes) must stay placeable: a bad record never shrinks a run."""
    name = cluster.partition or next((p for p, f in parts.items() if f.get("Default") == "YES"), "")
    if name not in parts:
        return cluster.exclude, ""  # validate_live says what is wrong with the partition
    states = eligible(cluster, parts[name], node_info)
    score = {n: s for n, s in scores(record, now).items() if n in states}
    exclude = parse_nodelist(cluster.exclude or "")
    if cluster.reservation:  # the reservation's nodes, which this does not count, are where the job runs
        bad = sorted(n for n, s in score.items() if s >= THRESHOLD and n not in exclude)
        why = f"cluster.reservation={cluster.reservation} places the job on its own nodes"
        return cluster.exclude, _keeping(bad, record, now, why) if bad else ""
    need = cluster.nodes + cluster.spare_nodes
    out, back, required = leave_out(score, states, need, exclude, parse_nodelist(cluster.nodelist or ""))
    usable = len(preempt.usable_nodes(states) - set(exclude))
    said = []
    if out:
        use = f"cluster.avoid_bad_nodes=false to use {_them(out)}"
        said.append(f"leaving out {_named(out, record, now)} for {_their(out)} record; {use}")
    if back:
        said.append(_keeping(back, record, now, f"the job needs {need} of partition {name}'s {usable} usable nodes"))
    if required:
        said.append(_keeping(required, record, now, f"cluster.nodelist names {_them(required)}"))
    value = ",".join([*([cluster.exclude] if cluster.exclude else []), *out]) or None
    return value, "; ".join(said)


def _keeping(nodes: list[str], record: Record, now: float, why: str) -> str:
    return f"keeping {_named(nodes, record, now)} in despite {_their(nodes)} record: {why}"


def _their(nodes: list[str]) -> str:
    return "its" if len(nodes) == 1 else "their"


def _them(nodes: list[str]) -> str:
    return "it" if len(nodes) == 1 else "them"


def _named(nodes: list[str], record: Record, now: float) -> str:
    """ "node3 (failed the preflight 2 h ago in runs/demo-4), node5 (hung 3 d ago in runs/x-1; 2 verdicts)",
    NAMED of them, then how many more."""
    shown = []
    for node in nodes[:NAMED]:
        live = _live(record, node)
        last = live[-1]
        more = f"; {len(live)} verdicts" if len(live) > 1 else ""
        shown.append(f"{node} ({SAID[last.kind]} {span(now - last.time)} ago in {shown_path(last.run)}{more})")
    rest = f" and {len(nodes) - NAMED} more (hpc-train nodes lists them)" if len(nodes) > NAMED else ""
    return ", ".join(shown) + rest


def _live(record: Record, node: str) -> list[Verdict]:
    """The node's verdicts not cleared, oldest first."""
    return sorted(
        (v for v in record.verdicts if v.node == node and not cleared(v, record.passed)), key=lambda v: v.time
    )


def span(seconds: float) -> str:
    """A duration in the unit that reads best: 40 s, 12 min, 5 h, 3 d (status.ago's units)."""
    seconds = max(0.0, seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= 2 * size:
            return f"{seconds / size:.0f} {unit}"
    return f"{seconds:.0f} s"


def shown_path(path: str) -> str:
    """A path as the user would type it: relative when under the current folder."""
    try:
        return str(Path(path).relative_to(Path.cwd()))
    except ValueError:
        return path


# ---- `hpc-train nodes` -----------------------------------------------------------------------------------


def rows(record: Record, now: float, root: Path) -> list[dict[str, Any]]:
    """One row per node with a verdict on record, the highest score first: score, left out now (score >=
    THRESHOLD) and for how long more, its verdicts (and how many a later passed preflight cleared), the newest:
    kind, age, run (relative to `root`), why."""
    score = scores(record, now)
    out = []
    for node in sorted(score, key=lambda n: (-score[n], n)):
        live = _live(record, node)
        last = live[-1] if live else max((v for v in record.verdicts if v.node == node), key=lambda v: v.time)
        out.append(
            {
                "node": node,
                "score": math.floor(score[node] * 1000) / 1000,  # rounded down: 0.4996 is in, never "0.5"
                "left_out": score[node] >= THRESHOLD,
                "out_for_s": round(out_for_s(score[node])),
                "verdicts": len(live),
                "cleared": sum(1 for v in record.verdicts if v.node == node) - len(live),
                "last": last.kind,
                "age_s": round(now - last.time),
                "run": _under(last.run, root),
                "why": last.why,
            }
        )
    return out


def _under(run: str, root: Path) -> str:
    try:
        return str(Path(run).resolve().relative_to(root.resolve())) or "."
    except ValueError:
        return run


def table(found: list[dict[str, Any]]) -> Any:
    """The rows as a rich Table of 6 short columns (each reason is a line below it: `reasons`)."""
    from rich.markup import escape
    from rich.table import Table

    t = Table(title=f"nodes with a verdict: left out by a submit while the score is >= {THRESHOLD:g}")
    for col in ("node", "score", "left out", "verdicts", "last verdict", "run"):
        t.add_column(col, overflow="fold")
    for r in found:
        t.add_row(  # names and paths from journals: "[/x]" in one is text, not rich markup
            escape(r["node"]),
            f"{math.floor(r['score'] * 100) / 100:.2f}",  # 0.498 is not 0.50: it is in
            f"yes, {span(r['out_for_s'])} more" if r["left_out"] else "no",
            str(r["verdicts"]) + (f" (+{r['cleared']} cleared)" if r["cleared"] else ""),
            escape(f"{r['last']}, {span(r['age_s'])} ago"),
            escape(r["run"]),
        )
    return t


def reasons(found: list[dict[str, Any]]) -> list[str]:
    """Each row's newest verdict in words, below the table."""
    return [f"{r['node']}: {r['why']}" for r in found]


def notes(record: Record, root: Path) -> list[str]:
    """What the table rests on, below it."""
    return [
        f"from {record.journals} journal(s) under {root} changed in the last {span(HORIZON_S)}"
        + (f" (the newest {MAX_JOURNALS}; {record.left} older not read)" if record.left else ""),
        f"a verdict weighs 1 (a straggler {WEIGHTS['straggler']:g}), halving every {span(HALF_LIFE_S)}; a passed "
        f"preflight clears a failed one",
        "a submit leaves out the nodes marked yes as far as the partition can spare them",
        "(cluster.avoid_bad_nodes=false: none)",
    ]
