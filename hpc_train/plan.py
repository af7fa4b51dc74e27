"""The planner: overrides -> trials -> arrays of one resource request, each with its rendered batch script,
validated against this machine and the live cluster. Writes nothing (submit.py writes and queues what it
returns), so `hpc-train submit --dry-run` is this and a print. Torch-free.

    from hpc_train import plan
    p = plan.plan(["train.lr=1e-3,3e-4"], multirun=True)   # p.trials, p.arrays, p.scripts
"""

from __future__ import annotations

import functools
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpc_train.config import ConfigSource, RunConfig, check_environment, compose_trials, expand_sweep
from hpc_train.paths import dir_mode
from hpc_train.pipeline import PLACEHOLDER, After
from hpc_train.sbatch import ClusterConfig, check_syntax, render, validate_live
from hpc_train.script import check as check_script
from hpc_train.script import runnable

MANIFEST = "sweep.json"


@dataclass
class Trial:
    index: int
    overrides: list[str]
    run_dir: str
    job_id: str | None = None
    process: dict[str, Any] | None = None  # a local trial: runs.process_identity of its controller
    brief: dict[str, Any] | None = None  # what status reads of its frozen config (status.brief)


@dataclass
class Array:
    """Trials with one resource request, submitted by one sbatch call (one array, or one plain job)."""

    trials: list[int]
    job_id: str | None = None
    submitting: bool = False  # set before sbatch, cleared after: a crash in between is recoverable


@dataclass
class Plan:
    target: Path  # the run directory of a single run, or the sweep directory
    trials: list[Trial]
    configs: list[dict[str, Any]]
    runs: list[RunConfig]
    arrays: list[Array] = field(default_factory=list)
    scripts: list[str] = field(default_factory=list)  # rendered batch script per array (Slurm only)
    unvalidated: str = ""  # a dry run with no controller answering: why the live checks were skipped
    unchecked: list[str] = field(default_factory=list)  # live checks that could not run (slurmdbd down)
    after: list[After] = field(default_factory=list)  # `--after`: the stages every trial is queued after
    dependency: str = ""  # sbatch's --dependency on their current jobs (pipeline.dependency); "" none
    waits_for: str = ""  # the same in words, for the user (stages.waits_for)
    avoided: str = ""  # the nodes left out for their record (cluster.avoid_bad_nodes), in one sentence; "" none
    rates: Any = None  # history.Rates of trial 0's partition, for every_steps=auto (history.json); None: not asked
    forecast: list[str] = field(default_factory=list)  # the expected goodput, and the alternatives (intervals.py)
    expected: dict[str, float] = field(default_factory=dict)  # the forecast's numbers (planning.Forecast), {} none
    # a sweep's other partitions: each one's rates, forecast and numbers (history.json `partitions`), by name
    elsewhere: dict[str, dict[str, Any]] = field(default_factory=dict)
    # What _save_manifest last wrote (each record and its JSON line), so a save re-serializes only what changed
    written: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @functools.cached_property
    def private(self) -> bool:
        """Owner-only files (0600, submitit/ 0700) when any cluster.env value is set: config.yaml, the
        manifests and the batch script then hold it, and cluster.env is where API keys go. Not always:
        runs sit in shared project folders, where teammates' `hpc-train status` should keep working. Computed
        once: asked per trial, the scan over every run made freezing a 10,000-point sweep quadratic."""
        return any(r.cluster.env for r in self.runs)

    @functools.cached_property
    def dir_mode(self) -> int:
        """The mode of every folder this submit creates: 0750 only when every trial asks to share_with_group."""
        return dir_mode(all(r.share_with_group for r in self.runs))


def next_dir(out_dir: Path, name: str) -> Path:
    """<out_dir>/<name>-<n> with the next free n (not created)."""
    taken = [int(p.name.rsplit("-", 1)[1]) for p in out_dir.glob(f"{name}-*") if p.name.rsplit("-", 1)[1].isdigit()]
    return (out_dir / f"{name}-{max(taken, default=0) + 1}").resolve()


def job_name(target: Path) -> str:
    """`<dir name>.<6 hex of its path>`: readable in squeue, unique across out_dirs, so a lost array can
    be found again by its name."""
    import hashlib

    return f"{target.name}.{hashlib.sha1(str(target).encode()).hexdigest()[:6]}"


SHAPE_FIELDS = ("vocab_size", "seq_len", "d_model", "n_layers")


def init_from_checkpoint(path: str, config: dict[str, Any], stages: frozenset[Path] = frozenset()) -> Path:
    """checkpoint.init_from=PATH -> the committed step folder it names: PATH itself, or the newest committed
    one under a run directory or its checkpoints/. Raises ValueError when there is none, or when the source
    run's config.yaml has another model shape than `config` (both the built-in trainer). The job verifies
    the files' checksums before loading (reading them all here would take as long as a resume). A run of
    `stages` (the runs --after names) stays its run directory, checkpoint or not: the job starts after it, from
    the newest checkpoint it has then (pipeline.final_checkpoint), its final one once it finished."""
    from hpc_train.paths import MARKER, STEP_DIR, read_marker, step_folders, untrusted

    p = Path(path).expanduser().resolve()
    stage = p.parent if p.name == "checkpoints" else p
    if stage in stages:
        _same_shape(path, stage / "config.yaml", config)
        return stage
    if STEP_DIR.fullmatch(p.name):
        if read_marker(p) is None:
            raise ValueError(
                f"checkpoint.init_from={path}: {p} has no valid {MARKER} manifest (a save that never "
                f"finished, or not a checkpoint); give a committed step folder, or the run directory "
                f"for its newest"
            )
        folder = p
    else:
        root = p / "checkpoints" if (p / "checkpoints").is_dir() else p
        committed = [f for f in step_folders(root).values() if read_marker(f) is not None]
        if not committed:
            raise ValueError(
                f"checkpoint.init_from={path}: no committed checkpoint under {root} (no step_*/{MARKER}); "
                f"give a run directory that saved one, or one of its step folders"
            )
        folder = committed[-1]
    files = (read_marker(folder) or {}).get("files", {})
    why = untrusted(folder, folder) or next((w for n in [MARKER, *files] if (w := untrusted(folder / n, folder))), "")
    if why:  # its .metadata is a pickle: run by the job as you, though another user wrote it
        raise ValueError(
            f"checkpoint.init_from={path}: {why}. Its .metadata is a pickle, and loading it runs its author's "
            f"code as you: if you trust them, copy it (cp -r {folder} <a folder of yours>) and give the copy"
        )
    _same_shape(path, folder.parent.parent / "config.yaml", config)
    return folder


def _same_shape(path: str, source_config: Path, config: dict[str, Any]) -> None:
    """ValueError when the source run's config.yaml builds another model shape than `config` (both the built-in
    trainer), with the overrides that fix it."""
    import yaml

    theirs = yaml.safe_load(source_config.read_text()) if source_config.is_file() else None
    if theirs and not (theirs.get("fn") or {}).get("_target_") and not config["fn"].get("_target_"):
        model = theirs.get("model") or {}
        differ = [k for k in SHAPE_FIELDS if k in model and model[k] != config["model"][k]]
        if differ:
            wrong = "; ".join(f"model.{k}={config['model'][k]} but the checkpoint has {model[k]}" for k in differ)
            raise ValueError(
                f"checkpoint.init_from={path}: {wrong} (its run's {source_config}); set "
                f"{' '.join(f'model.{k}={model[k]}' for k in differ)}, or drop checkpoint.init_from to "
                f"train from scratch"
            )


def group_arrays(runs: list[RunConfig], max_array_size: int) -> list[Array]:
    """Trials grouped by identical resource request, each group split at MaxArraySize (pure)."""
    groups: dict[str, list[int]] = {}
    for i, run in enumerate(runs):
        # vars, not asdict (which deep-copies, 0.1 ms a run): ClusterConfig holds no nested dataclass
        groups.setdefault(json.dumps(vars(run.cluster), sort_keys=True), []).append(i)
    return [
        Array(trials=idx[k : k + max_array_size]) for idx in groups.values() for k in range(0, len(idx), max_array_size)
    ]


def previous_runs(p: Plan) -> list[Path]:
    """The runs whose measurements predict this one: the sweep's trials on a resubmit, else the newest
    earlier run directory of the same name."""
    if (p.target / MANIFEST).exists():
        return [Path(t.run_dir) for t in p.trials]
    earlier = [d for d in p.target.parent.glob(f"{p.target.name.rsplit('-', 1)[0]}-*") if d.is_dir() and d != p.target]
    return [max(earlier, key=lambda d: d.stat().st_mtime)] if earlier else []


def _freeze_paths(configs: list[dict[str, Any]], stages: frozenset[Path]) -> None:
    """A requeued attempt may start in another directory: data.path frozen absolute; checkpoint.init_from frozen as
    one step folder, so every attempt starts from the same (a run of `stages`: its run directory)."""
    for c in configs:
        if c["data"].get("path"):
            c["data"]["path"] = str(Path(c["data"]["path"]).resolve())
        if c["checkpoint"].get("init_from"):
            c["checkpoint"]["init_from"] = str(init_from_checkpoint(c["checkpoint"]["init_from"], c, stages))


def _validate(
    cluster: ClusterConfig, script: str, size: int, max_parallel: int | None, after: list[After] | None
) -> list[str]:
    """validate_live; a refusal while queued after stages is first judged against their state now: a stage that
    stopped for good since `_stages` read it (its job just ended) makes Slurm's will-run test refuse with
    "Requested operation is presently disabled" (kill-on-invalid-dep), which names neither the stage nor the fix."""
    from hpc_train import stages

    try:
        return validate_live(cluster, script, size, max_parallel)
    except ValueError:
        if after:
            stages.dependency(after)  # raises the stage's own sentence (pipeline.dependency) when one stopped
        raise


def _stages(
    after: list[After], configs: list[dict[str, Any]], runs: list[RunConfig]
) -> tuple[str, str, frozenset[Path]]:
    """`--after`: (sbatch's --dependency on the stages' current jobs, the same in words, their run directories),
    before anything is written. ValueError for a local run, a stage that can never finish (pipeline.dependency),
    {after.ckpt} without --after or after a sweep (whose checkpoint?), a second dependency in sbatch_extra."""
    from hpc_train import stages

    s = [c["script"] for c in configs]
    if not after and any(PLACEHOLDER in w for x in s for w in (*x["cmd"], *x["resume_args"], x["checkpoint"])):
        raise ValueError(
            f"{PLACEHOLDER} is the final checkpoint of the run this one is queued after; name that run with --after, "
            f"e.g. hpc-train submit --after runs/pretrain-1 ... -- python eval.py --ckpt {PLACEHOLDER}"
        )
    if not after:
        return "", "", frozenset()
    if runs[0].cluster.executor != "slurm":
        raise ValueError(
            "--after needs Slurm (cluster=dev, or your cluster): the local executor runs one job here and cannot "
            "queue one after another; run local stages one after another instead (hpc-train submit waits for a "
            "local run; then submit the next, with checkpoint.init_from=RUN for its weights)"
        )
    extra = {k.replace("_", "-") for r in runs for k in r.cluster.sbatch_extra}
    if extra & {"dependency", "kill-on-invalid-dep"}:
        raise ValueError(
            "cluster.sbatch_extra.dependency and --after both set a dependency; name the runs to wait for with "
            "--after RUN[:ok|any] (it follows them across resumes), and drop the sbatch_extra one"
        )
    # a sweep of one trial too: the job looks for the checkpoint in the path --after names, and a sweep holds none
    if any(PLACEHOLDER in str(c["script"]) for c in configs) and (Path(after[0].run) / MANIFEST).exists():
        raise ValueError(
            f"{PLACEHOLDER} is the final checkpoint of the first --after, but {after[0].run} is a sweep: whose? "
            f"name one of its trials first, e.g. --after {after[0].run}/0000"
        )
    dependency, found = stages.dependency(after)
    return dependency, stages.waits_for(found), frozenset(Path(u.run_dir) for u in found)


def _check_commands(runs: list[RunConfig]) -> None:
    """Each distinct script.cmd of the trials once: its program resolves, an interpreter's script file exists."""
    for cmd in {tuple(r.script.cmd) for r in runs if r.script.cmd}:
        if why := runnable(list(cmd), Path.cwd()):
            raise ValueError(why)


def _speakers(p: Plan) -> list[RunConfig]:
    """The first trial queued on each partition the trials use, trial 0's first: each speaks for its partition's
    history and forecast (at its size and intervals: a sweep over cluster.nodes forecasts its first size)."""
    first: dict[str, RunConfig] = {}
    for r in p.runs:
        first.setdefault(r.cluster.partition, r)
    return list(first.values())


def _accounting_calls(p: Plan, now_s: float) -> list[list[str]]:
    """The sacct _site_rates asks (history.site_rates at now_s), one per partition of the trials, to start beside the
    other Slurm calls: their answers (up to 10 s on a busy slurmdbd, counted from their start: all of them at once)
    then overlap theirs and the render."""
    from hpc_train import history

    return [
        history.accounting_args(r.cluster.partition, r.cluster.nodes, r.checkpoint.history_window_days, now_s)
        for r in _speakers(p)
    ]


def _site_rates(p: Plan, now_s: float) -> tuple[Any, list[str], dict[str, float]]:
    """The site's fault rates for trial 0's partition and size at now_s, its forecast and its numbers (_site)."""
    return _site(p.runs[0], now_s)


def _elsewhere(p: Plan, now_s: float) -> dict[str, dict[str, Any]]:
    """history.json's record (intervals.record) of each other partition a sweep's trials are queued on, by name: a
    trial reads its own partition's rates and forecast, not trial 0's; the defaults where they could not be read,
    as a run without a history.json takes them, with the sentence that says why."""
    from hpc_train import history, intervals

    out: dict[str, dict[str, Any]] = {}
    for r in _speakers(p)[1:]:
        rates, lines, expected = _site(r, now_s)
        out[r.cluster.partition] = intervals.record(rates or history.DEFAULTS, lines, expected)
    return out


def _site(run: RunConfig, now_s: float) -> tuple[Any, list[str], dict[str, float]]:
    """The site's fault rates (history.site_rates: one sacct of 10 s at most, the project's journals) for the run's
    partition and size at now_s, and its forecast (intervals.forecast_lines: the expected goodput with its
    intervals and the alternatives that change it most, from what the project's earlier runs measured), and its
    numbers."""
    from hpc_train import history, intervals

    c, ck, runs_dir = run.cluster, run.checkpoint, Path(run.out_dir)
    # advisory: a damaged journal of the project or history never stops a submit; rates read before a forecast
    # that failed (another run's odd metrics row) are still the job's (history.json)
    try:
        window, min_jobs = ck.history_window_days, ck.history_min_jobs
        rates = history.site_rates(
            c.partition, c.nodes, runs_dir=runs_dir, window_days=window, min_jobs=min_jobs, now_s=now_s
        )
    except Exception as e:
        return None, [f"forecast: none ({type(e).__name__}: {e}); checkpoint.every_steps=auto uses the defaults"], {}
    try:
        m = intervals.project_measured(runs_dir)
        expected = dict(vars(intervals.at_submit(ck, c, rates, m)))  # a frozen dataclass's fields
        return rates, intervals.forecast_lines(ck, c, rates, m), expected
    except Exception as e:
        return rates, [f"forecast: none ({type(e).__name__}: {e}); the site's rates are kept for auto"], {}


def _avoid_bad_nodes(p: Plan, validate: bool) -> str:
    """cluster.avoid_bad_nodes: the nodes with a bad record in the runs of out_dir (reputation.py) added to each
    trial's cluster.exclude, frozen with it (a requeue's ExcNodeList and a resume keep them out), as far as the
    partition can spare them; the sentence that says so ("" none). Slurm is asked only when a node has a verdict:
    the partitions and nodes validate_live reads, asked again for it."""
    from hpc_train import reputation, slurm

    wanted = [i for i, r in enumerate(p.runs) if r.cluster.avoid_bad_nodes]
    now = time.time()
    record = reputation.harvest(Path(p.runs[0].out_dir), now) if wanted else reputation.Record()
    if not record.verdicts:
        return ""
    if p.unvalidated:
        p.unchecked.append(f"nodes with a bad record (hpc-train nodes {p.runs[0].out_dir}) not left out")
        return ""
    parts, nodes = slurm.partitions(), slurm.nodes()
    if validate:  # taken from prefetch above
        slurm.prefetch(["scontrol", "show", "partition", "-o"], ["scontrol", "show", "node", "-o"])
    said: dict[tuple[Any, ...], tuple[str | None, str]] = {}
    for i in wanted:
        c = p.runs[i].cluster
        # what reputation.avoid reads; not vars(c) in JSON: ~30 us a trial, seconds for a 100,000-point sweep
        key = (c.partition, c.nodes, c.spare_nodes, c.exclude, c.nodelist, c.reservation, c.constraint)
        key += (c.gpus_per_node, c.tasks_per_node, c.cpus_per_task)
        if key not in said:
            said[key] = reputation.avoid(c, record, parts, nodes, now)
        c.exclude = p.configs[i]["cluster"]["exclude"] = said[key][0]
    return " | ".join(dict.fromkeys(s for _, s in said.values() if s))


def _check_here(composed: list[tuple[dict[str, Any], RunConfig]]) -> None:
    """This machine: fn._target_ importable, the compiler, data.path's meta.json; asked once per distinct
    question (a 10,000-point sweep over train.lr asks one), and the vocab size raised to the data's frozen; each
    distinct command's program."""
    asked: dict[str, int] = {}
    for c, r in composed:
        question = repr((r.train.compile, r.fn._target_, r.metrics, r.data, r.train.eval_every_steps, r.model))
        if question not in asked:
            check_environment(r)
            asked[question] = r.model.vocab_size
        r.model.vocab_size = c["model"]["vocab_size"] = asked[question]
    _check_commands([r for _, r in composed])


def plan(
    overrides: list[str],
    multirun: bool,
    sweep_dir: Path | None = None,
    max_parallel: int | None = None,
    source: ConfigSource = ConfigSource(),
    validate: bool = True,
    dry_run: bool = False,
    after: list[After] | None = None,
    given: tuple[list[list[str]], list[tuple[dict[str, Any], RunConfig]], list[str]] | None = None,
) -> Plan:
    """Everything up to, not including, writing and submitting. Raises ValueError on any bad input. `after`: the
    stages every trial is queued after (`--after`, pipeline.parse). `given`: trials the caller composed (their
    overrides, configs and folder names: a Hydra app's jobs, hydra_launch.py) in place of `overrides`' sweep."""
    from hpc_train import slurm

    trial_overrides = expand_sweep(overrides, multirun) if given is None else given[0]
    composed = compose_trials(trial_overrides, source) if given is None else given[1]
    _check_here(composed)
    configs, runs = [c for c, _ in composed], [r for _, r in composed]
    first: ClusterConfig = runs[0].cluster
    if first.slurm_conf:
        slurm.slurm_env(first.slurm_conf)
    dependency, waits_for, stages = _stages(after or [], configs, runs)
    _freeze_paths(configs, stages)
    if first.executor == "slurm" and any(r.cluster.executor != "slurm" for r in runs):
        raise ValueError("a sweep must use one executor; sweep cluster= over Slurm clusters only")
    target = sweep_dir.resolve() if sweep_dir else next_dir(Path(runs[0].out_dir), runs[0].name)
    names = [f"{i:04d}" for i in range(len(trial_overrides))] if given is None else given[2]
    trials = [Trial(i, o, str(target / names[i]) if multirun else str(target)) for i, o in enumerate(trial_overrides)]
    for trial, c in zip(trials, configs):  # every placeholder names a key, before anything is written
        check_script(c, trial.run_dir)
    result = Plan(target, trials, configs, runs, after=after or [], dependency=dependency, waits_for=waits_for)
    if first.executor == "local":
        result.arrays = [Array(trials=[i]) for i in range(len(runs))]  # local trials run one at a time
        return result
    facts = [["scontrol", "show", "partition", "-o"], ["scontrol", "show", "node", "-o"]] if validate else []
    facts += [["scontrol", "show", "config"]] if multirun else []
    if dry_run:  # answer in seconds without a controller (each client call would retry for ~40 s): one ping
        result.unvalidated = slurm.unreachable()
    # Asked now, read once the scripts are rendered (submitit's import, ~25 ms): the round trips overlap it.
    now = time.time()  # the sacct of the site's history, asked now and read by _site_rates: the same arguments
    if not result.unvalidated:
        slurm.prefetch(*facts, *_accounting_calls(result, now))
    try:  # the prefetched calls a failed step left unread are dropped: never a later call's stale answer
        result.avoided = _avoid_bad_nodes(result, validate)
        if not result.unvalidated:
            result.rates, result.forecast, result.expected = _site_rates(result, now)
            result.elsewhere = _elsewhere(result, now)
        max_array = (
            1
            if not multirun
            else (
                1001
                if result.unvalidated  # Slurm's default
                else int(slurm.show_config().get("MaxArraySize", "1001"))
            )
        )
        result.arrays = group_arrays(runs, max_array)
        for array in result.arrays:
            size = len(array.trials) if multirun else None
            result.scripts.append(
                render(
                    runs[array.trials[0]].cluster, job_name(target), target / "submitit", size, max_parallel, dependency
                )
            )
        validate = validate and not result.unvalidated
        checked: dict[tuple[str, str], list[str]] = {}  # a 100,000-point sweep is 100 arrays of one shape and size
        for array, script in zip(result.arrays, result.scripts):
            cluster = runs[array.trials[0]].cluster
            shape = (json.dumps(vars(cluster), sort_keys=True), script)  # as group_arrays keys a shape
            if shape not in checked:  # bash -n and 4 Slurm calls, ~30 ms: once per distinct request
                check_syntax(script)
                checked[shape] = _validate(cluster, script, len(array.trials), max_parallel, after) if validate else []
            result.unchecked += checked[shape]
    finally:
        slurm.drop_prefetched()
    return result
