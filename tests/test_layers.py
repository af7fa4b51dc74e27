"""Imports point down (docs/architecture.md draws these layers): each module of hpc_train imports only
modules of lower layers, at the top or inside a function alike, so there is no circle and no upward
arrow. The job side (what runs in the allocation) never imports the login side (cli, submit, status...)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "hpc_train"

# Low to high. A module may import only modules of the layers before its own.
LAYERS: list[tuple[str, ...]] = [
    (
        "__init__",
        "paths",
        "env",
        "topology",
        "tokenizer",
        "straggler",
        "leave",
        "task",
        "relay",
        "reasons",
        "ranklog",
        "planning",
    ),  # facts and names, torch-free; the stop path's words (Reason, Fate, Action); the job side's logging;
    # the goodput model (planning); the exit; a rank process's own state; the batch step's supervisor
    ("journal", "slurm"),  # the run's records; the one caller of Slurm's clients
    ("metrics", "preempt", "provenance", "data", "deadlines"),  # deadlines: the stop and failure paths' table
    ("pipeline",),  # a run queued after others: after.json, dependents.jsonl, the dependency rule, a stop's settling
    # script: ScriptConfig (config.py holds it), its placeholders and the checks at submit;
    # script_helper: what a user's script imports (torch-free)
    # hydra_job: a Hydra app's task run from its frozen config in a script's child (the launcher plugin, docs/hydra.md)
    ("tracking", "prometheus", "preflight", "sbatch", "script", "script_helper", "hydra_job"),
    # the root config, composed from the dataclasses beside their code; the verdicts; the requeue decision (pure);
    # reputation: the nodes' verdicts across a project's runs and what a submit leaves out for them
    ("config", "verdict", "decision", "reputation"),
    ("history",),  # the site's fault rates from sacct and the project's journals (reputation finds them), torch-free
    ("intervals",),  # checkpoint.every_steps=auto: this run's measurements and the site's rates into planning's
    # the job side from here; profiling: profile.*, which Attempt steps; protocol: one attempt protocol (start,
    # time left, signal, finish) for a training function and a script alike
    ("model", "checkpoint_files"),
    ("checkpoint_write",),  # a save's writing, the one in flight, its commit
    ("checkpoint", "profiling", "protocol"),
    ("memory_tier",),  # checkpoint.memory_every_steps: copies of TrainState in node-local tmpfs and a buddy's
    ("attempt", "supervisor"),  # supervisor: a script's child per rank, through the same protocol
    # the job side's protocols, each in its own module (job.py's docstring lists them)
    ("lease", "rendezvous"),
    ("rejoin",),
    ("requeue",),
    ("failure",),
    ("watchdog",),
    ("job", "train"),
    ("start",),
    ("runs",),  # the login side from here: which runs a path names
    ("stages",),  # the stages of a pipeline as they stand (runs, journal, Slurm): dependency, status's chain, resume
    ("status", "logs", "report", "drills", "plan"),  # commands that write no run: on runs that exist, a dry run
    ("submit",),
    ("resume", "hydra_launch"),  # hydra_launch: the Hydra launcher plugin's login side, above submit as cli is
    ("cli",),
]
JOB_SIDE = {"model", "checkpoint", "profiling", "memory_tier", "attempt", "job", "train", "start", "task", "deadlines"}
JOB_SIDE |= {"protocol", "supervisor", "ranklog", "checkpoint_files", "checkpoint_write"}
JOB_SIDE |= {"relay", "verdict", "lease", "rendezvous", "rejoin", "decision", "requeue", "failure", "watchdog"}
LOGIN_SIDE = {"runs", "status", "logs", "report", "drills", "plan", "submit", "resume", "cli", "stages"}
JOB_SIDE |= {"hydra_job"}  # a Hydra app's child, as a script's: never the login side
LOGIN_SIDE |= {"hydra_launch"}


def imports_of(path: Path) -> set[str]:
    """The hpc_train modules a file imports anywhere in it (`from hpc_train import x` names module x, or
    __init__ for a name defined there)."""
    modules = {p.stem for p in PACKAGE.glob("*.py")}
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "hpc_train":
            out |= {a.name if a.name in modules else "__init__" for a in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hpc_train."):
            out.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            out |= {a.name.split(".")[1] for a in node.names if a.name.startswith("hpc_train.")}
    out.discard(path.stem)
    return out


def test_every_module_has_a_layer() -> None:
    placed = [m for layer in LAYERS for m in layer]
    assert len(placed) == len(set(placed)), "a module is in two layers"
    missing = sorted({p.stem for p in PACKAGE.glob("*.py")} - set(placed))
    assert not missing, f"add {missing} to LAYERS in tests/test_layers.py (and to docs/architecture.md)"


def test_imports_point_down() -> None:
    rank = {m: i for i, layer in enumerate(LAYERS) for m in layer}
    upward = [
        f"{p.stem} (layer {rank[p.stem]}) imports {dep} (layer {rank.get(dep, '?')})"
        for p in sorted(PACKAGE.glob("*.py"))
        for dep in sorted(imports_of(p))
        if rank.get(dep, len(LAYERS)) >= rank[p.stem]
    ]
    assert not upward, "imports that do not point down:\n" + "\n".join(upward)


def test_the_job_side_never_imports_the_login_side() -> None:
    crossing = {m: sorted(imports_of(PACKAGE / f"{m}.py") & LOGIN_SIDE) for m in JOB_SIDE}
    assert not any(crossing.values()), crossing


def test_the_check_sees_an_upward_import(tmp_path: Path) -> None:
    """The parser finds imports inside functions too (most of ours are lazy, to keep torch off the login node)."""
    probe = tmp_path / "journal.py"
    probe.write_text("def f():\n    from hpc_train import status\n    from hpc_train.submit import plan\n")
    assert imports_of(probe) == {"status", "submit"}


def test_the_relay_imports_only_the_standard_library() -> None:
    """relay.py runs by its path as the batch step (any python 3.8+, nothing of hpc_train on sys.path)."""
    import sys

    tree = ast.parse((PACKAGE / "relay.py").read_text())
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert names - {"__future__"} <= set(sys.stdlib_module_names), names - set(sys.stdlib_module_names)


def module_state(path: Path) -> list[str]:
    """The mutable containers a module binds at its top level under a name that is not a CONSTANT's (a table in
    capitals is read, never changed): the module state issue 28 moved into the Task (preempt's received,
    last_beat, step_reached, ticks; script's children)."""
    mutable = (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)
    found = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            target = node.targets[0] if isinstance(node, ast.Assign) else node.target
            name = ast.unparse(target)
            call = isinstance(node.value, ast.Call) and ast.unparse(node.value.func) in ("list", "dict", "set")
            if (isinstance(node.value, mutable) or call) and not name.isupper() and name != "__all__":
                found.append(f"{path.stem}.{name} (line {node.lineno})")
    return found


def test_the_job_side_keeps_no_module_state() -> None:
    """A rank process's state lives in its Task (task.py), handed to who needs it: signals and beats in its Pulse,
    the script's child, the placement, the deciding flag, the memory tier."""
    job_side = sorted(JOB_SIDE | {"preempt", "script"})
    found = [line for m in job_side for line in module_state(PACKAGE / f"{m}.py")]
    assert not found, found


def test_the_module_state_check_sees_a_one_element_list(tmp_path: Path) -> None:
    probe = tmp_path / "preempt.py"
    probe.write_text("ticks = [0]\nreceived: list[str] = []\nseen = set()\nTABLE = {1: 2}\n__all__ = ['x']\n")
    assert module_state(probe) == ["preempt.ticks (line 1)", "preempt.received (line 2)", "preempt.seen (line 3)"]
