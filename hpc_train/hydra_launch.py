"""The hpc_train launcher for Hydra apps, its login side: Hydra's jobs -> frozen trials -> arrays queued, through
plan.py and submit.py as `hpc-train submit -m` queues its own. The plugin (hydra_plugins/hpc_train_launcher) only
hands over to this module; docs/hydra.md is the user's page. Torch-free.

    python app.py -m hydra/launcher=hpc_train hydra.launcher.partition=debug lr=1e-3,3e-4   # returns once queued
    python app.py hydra/launcher=hpc_train                                 # one run, no -m: in hydra.run.dir
    hpc-train status multirun/2026-01-02/10-00-00                          # the sweep, as any of hpc_train's

Each of Hydra's jobs is one trial, an hpc_train run in Hydra's own output folder (<hydra.sweep.dir>/<subdir>:
multirun.yaml and the .hydra/ folders where Hydra's tooling looks for them) whose command is the app's task
function, run by hydra_job.py from the config frozen here. Nothing is queued until every trial composed
(Hydra's own error for one that does not) and the request passed plan.py's checks against the live cluster.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import re
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from hydra.errors import CompactHydraException

log = logging.getLogger(__name__)

# hydra.launcher's keys and defaults, the node the plugin registers: every cluster option of hpc_train
# (sbatch.ClusterConfig, flat as submitit's are; a sweep runs on Slurm, one task a node as submitit's does), the
# requeue budgets and the preflight (config.RequeueConfig, preflight.PreflightConfig), then the launcher's own.
# Literal: Hydra imports every plugin at every app's start, and importing config.py would cost it ~45 ms;
# tests/test_hydra_launcher.py holds it equal to the classes.
CLUSTER = {
    "executor": "slurm",
    "partition": None,
    "nodes": 1,
    "min_nodes": None,
    "spare_nodes": 0,
    "in_process_restart": False,
    "tasks_per_node": 1,
    "cpus_per_task": 1,
    "gpus_per_node": 0,
    "mem_gb": None,
    "timeout_min": 60,
    "signal_lead_s": 120,
    "preempt_grace_s": 30,
    "slurm_conf": None,
    "template": None,
    "template_vars": {},
    "env": {},
    "setup": [],
    "launcher": [],
    "switches": None,
    "account": None,
    "qos": None,
    "constraint": None,
    "reservation": None,
    "exclusive": False,
    "mem_per_cpu_gb": None,
    "gres": None,
    "mail_type": None,
    "mail_user": None,
    "nodelist": None,
    "exclude": None,
    "avoid_bad_nodes": True,
    "sbatch_extra": {},
}
OWN = {
    "requeue": {
        "max_preemptions": -1,
        "max_time_limit_requeues": 100,
        "max_failures": 2,
        "max_excluded_nodes": 2,
        "shrink_after_s": 600.0,
        "max_in_job_restarts": 3,
    },
    "preflight": {
        "enabled": True,
        "min_free_disk_gb": 1.0,
        "max_clock_skew_s": 5.0,
        "min_matmul_tflops": 0.0,
        "min_allreduce_gbps": 0.0,
        "slow_fraction": 0.5,
    },
    "stop_signal": "TERM",  # what the task gets at a time-limit warning or a preemption (script.stop_signal)
    "checkpoint": "",  # the file (or glob) the task saves, relative to its output folder: progress, resumed_from
    "resume_overrides": [],  # Hydra overrides added once `checkpoint` exists, e.g. ['+resume=true']
    "max_parallel": None,  # at most this many trials at once (Slurm's %N; null: submitit's 256, as submit -m)
    "wait": False,  # true: block until every trial ended and return what each returned (an optimizing sweeper)
    "share_with_group": False,
}
NODE = {**CLUSTER, **OWN}
# hydra-submitit-launcher's keys that are not ours, and what to write instead (docs/hydra.md has every key)
SUBMITIT = {
    "submitit_folder": "nothing: the logs are in <sweep dir>/submitit/ (hpc-train logs TRIAL)",
    "name": "nothing: a sweep's jobs are named <sweep folder>.<6 hex of its path>",
    "stderr_to_stdout": "nothing: each rank keeps its own .out and .err (hpc-train logs TRIAL --rank N)",
    "signal_delay_s": "hydra.launcher.signal_lead_s",
    "max_num_timeout": "hydra.launcher.requeue.max_time_limit_requeues",
    "additional_parameters": "+hydra.launcher.sbatch_extra.NAME=VALUE",
    "array_parallelism": "hydra.launcher.max_parallel",
    "mem_per_cpu": "hydra.launcher.mem_per_cpu_gb (a number of GB)",
    "comment": "+hydra.launcher.sbatch_extra.comment=TEXT",
    "cpus_per_gpu": "hydra.launcher.cpus_per_task (one task a GPU)",
    "gpus_per_task": "hydra.launcher.gpus_per_node (one rank a GPU: tasks_per_node = gpus_per_node)",
    "mem_per_gpu": "hydra.launcher.mem_gb (per node)",
}
# Each trial's command: this file run by its path (hydra_job.py says why)
HYDRA_JOB = str(Path(__file__).with_name("hydra_job.py"))
TARGET = "hydra_plugins.hpc_train_launcher.launcher.HpcTrainLauncher"
# Held from the sweep folder's check (same_sweep) through its freeze and submit: two launches into one folder at
# once (the same fixed hydra.sweep.dir) take turns. Not sweep.json's lock, which submit takes itself.
LAUNCH_LOCK = ".hydra_launch.lock"


def literal(word: str) -> str:
    """A word of a trial's script.cmd with its braces doubled: script.fill reads {dotted.key} as a placeholder, and
    a path (hydra.sweep.dir='s{name}') or an override holding braces means them as they are."""
    return word.replace("{", "{{").replace("}", "}}")


class LaunchError(CompactHydraException):
    """A user's error: Hydra prints its one sentence, no traceback (run_and_report)."""


def _user_error(e: Exception) -> LaunchError:
    """A ValueError (or a Slurm one) of plan/submit in the launcher's words: cluster.X is hydra.launcher.X here."""
    from hpc_train.config import explain

    text = explain(e)
    for ours, theirs in (
        (r"\bcluster\.", "hydra.launcher."),
        (r"\brequeue\.", "hydra.launcher.requeue."),
        (r"\bpreflight\.", "hydra.launcher.preflight."),
        (r"\bscript\.stop_signal", "hydra.launcher.stop_signal"),
        (r"\bscript\.checkpoint", "hydra.launcher.checkpoint"),
        (r"\bscript\.resume_args", "hydra.launcher.resume_overrides"),
    ):
        text = re.sub(ours, theirs, text)
    return LaunchError(f"hpc_train launcher: {text}")


def _is_user_error(e: Exception) -> bool:
    from hpc_train.slurm import SlurmError

    return isinstance(e, (ValueError, SlurmError, PermissionError))


@contextlib.contextmanager
def _said(config: Any) -> Iterator[None]:
    """An OmegaConf error resolving the app's config here (an unset ${oc.env:NAME}, a key that is not there) as one
    sentence: the key, its value as written, the fix; before anything is queued."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        yield
    except OmegaConfBaseException as e:
        key = str(getattr(e, "full_key", "") or "")
        parent, _, last = key.rpartition(".")
        raw: Any = "?"
        with contextlib.suppress(Exception):
            raw = OmegaConf.to_container(OmegaConf.select(config, parent) if parent else config, resolve=False)[last]
        cause = re.sub(r"^\w+ raised while resolving interpolation: ", "", str(e).splitlines()[0]).strip("'\"")
        env = re.search(r"\$\{oc\.env:([^,}]+)\}", str(raw))
        fix = (
            f"set it, or give a default: ${{oc.env:{env.group(1)},VALUE}}"
            if env
            else f"give {key} a value that resolves at the submit"
        )
        raise LaunchError(f"hpc_train launcher: {key}={raw}: {cause}; {fix}") from None


_MOMENT: list[str] = []


def submit_moment() -> str:
    """The submit's one moment for ${now:}, chosen the first time this process asks (hydra_job.freeze_now): from the
    QueueRun callback's first hook, before Hydra resolves anything of the launch."""
    from hpc_train import hydra_job

    if not _MOMENT:
        _MOMENT.append(hydra_job.freeze_now(datetime.now()))
    return _MOMENT[0]


def check_keys(config: Any) -> None:
    """hydra.launcher's keys resolve (an unset ${oc.env:NAME} does not): Hydra instantiates the launcher with them
    resolved, before any of its code runs, and would print OmegaConf's traceback; from the callbacks' first hook."""
    from omegaconf import OmegaConf

    submit_moment()
    with _said(config):
        OmegaConf.to_container(config.hydra.launcher, resolve=True)


def run_config(params: dict[str, Any], name: str) -> tuple[dict[str, Any], Any]:
    """hydra.launcher's values -> (the run's config as plain dicts, its validated RunConfig) every trial starts from
    (its script.cmd still to be filled). LaunchError names an unknown key, a submitit key's counterpart, a bad
    value."""
    import dataclasses

    from hpc_train.config import RunConfig, build, did_you_mean

    for key in params:
        if key in NODE:
            continue
        if key in SUBMITIT:
            raise LaunchError(
                f"hpc_train launcher: hydra.launcher.{key} is the submitit launcher's option; with hpc_train write "
                f"{SUBMITIT[key]} (docs/hydra.md maps every submitit key)"
            )
        raise LaunchError(
            f"hpc_train launcher: Key 'hydra.launcher.{key}' is not an option of the hpc_train launcher\n"
            f"valid keys under hydra.launcher: {', '.join(NODE)}{did_you_mean('hydra.launcher.' + key, 2, NODE)}"
        )
    own = {k: params.get(k, v) for k, v in OWN.items()}
    for key, ok, want in (
        (
            "max_parallel",
            own["max_parallel"] is None or (type(own["max_parallel"]) is int and own["max_parallel"] >= 1),
            "a number >= 1, or null",
        ),
        ("wait", type(own["wait"]) is bool, "true or false"),
        ("requeue", isinstance(own["requeue"], dict), f"a mapping of {', '.join(OWN['requeue'])}"),
        ("preflight", isinstance(own["preflight"], dict), f"a mapping of {', '.join(OWN['preflight'])}"),
    ):
        if not ok:
            raise LaunchError(f"hpc_train launcher: hydra.launcher.{key}={own[key]!r} must be {want}")
    data = {
        "name": re.sub(r"[^A-Za-z0-9._-]", "-", name)[:64].lstrip("._-") or "hydra",
        "share_with_group": own["share_with_group"],
        "cluster": {k: params.get(k, v) for k, v in CLUSTER.items()},
        "requeue": {**OWN["requeue"], **own["requeue"]},
        "preflight": {**OWN["preflight"], **own["preflight"]},
        "script": {
            "cmd": [literal(sys.executable), literal(HYDRA_JOB)],  # the trials' own words come after (Launch.trial)
            "stop_signal": own["stop_signal"],
            "checkpoint": own["checkpoint"],
            "resume_args": list(own["resume_overrides"] or []),
        },
    }
    try:
        run = build(RunConfig, data)
    except ValueError as e:
        raise _user_error(e) from None
    return dataclasses.asdict(run), run


def _copy(cfg: Any) -> Any:
    """A DictConfig's copy, ~3x faster than copy.deepcopy (1.5 ms against 4.9 for Hydra's whole tree here)."""
    return pickle.loads(pickle.dumps(cfg, pickle.HIGHEST_PROTOCOL))


class Memo:
    """Hydra's config loader, composing once per distinct set of structural overrides (config-group choices,
    +key, ~key, hydra.*, interpolations, lists...) and checking each distinct `key=value` override once on top.

    Hydra's sweepers check a batch before they launch it (Sweeper.validate_batch_is_legal: every job composed,
    and the config thrown away): 54 ms a job here, 54 s of a 1,000-point sweep before any launcher runs, most of
    the submitit launcher's 50 s. The launcher shares the sweeper's HydraContext and gives it this loader: that
    check then costs ~0.1 ms a job, and a job it refuses is composed by Hydra itself, so the error is Hydra's own.
    Anyone else asking for a job's config gets Hydra's compose, unchanged."""

    def __init__(self, loader: Any, master: Any) -> None:
        from hydra.plugins.sweeper import Sweeper

        self.loader, self.master = loader, master
        self.validating = Sweeper.validate_batch_is_legal.__code__
        self.index: dict[tuple[str, ...], int] = {}  # structural overrides -> base
        self.bases: list[Any] = []  # as Hydra composed them: what hydra_job.py starts each trial from
        self.scratch: list[Any] = []  # a copy of each, on which the `key=value` overrides are checked
        self.checked: set[tuple[int, str]] = set()
        self.plain: dict[str, tuple[str, Any] | None] = {}
        self.groups: dict[str, bool] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)

    def load_sweep_config(self, master_config: Any, sweep_overrides: list[str]) -> Any:
        if sys._getframe(1).f_code is not self.validating or master_config is not self.master:
            return self.loader.load_sweep_config(master_config, sweep_overrides)
        return self.scratch[self.check(list(sweep_overrides))[0]]  # thrown away by the check

    def _group(self, key: str) -> bool:
        if key not in self.groups:
            repo = getattr(self.loader, "repository", None)  # no repository to ask: compose it, to be safe
            self.groups[key] = repo is None or repo.group_exists(key)
        return self.groups[key]

    def split(self, overrides: list[str]) -> tuple[list[str], list[tuple[str, str, Any]]]:
        """(structural overrides, `key=value` ones as (line, key, value)) in order. Hydra applies a job's overrides
        in their order; ours go on top of a base composed with the structural ones, so a key a structural override
        of the same job names (`+x=1 x=2`) makes the whole job structural."""
        from hpc_train.config import _plain_override  # Hydra's typing of `key=literal`, without its parser

        structural, plain = [], []
        for line in overrides:
            if line not in self.plain:
                self.plain[line] = _plain_override(line)
            kv = self.plain[line]
            if kv is None or kv[0].startswith("hydra.") or self._group(kv[0]):
                structural.append(line)
            else:
                plain.append((line, *kv))
        if structural and any(key in s for _, key, _ in plain for s in structural):
            return list(overrides), []
        return structural, plain

    def base(self, structural: tuple[str, ...]) -> int:
        if structural not in self.index:
            cfg = self.loader.load_sweep_config(self.master, list(structural))  # Hydra's error for a bad one
            self.index[structural] = len(self.bases)
            self.bases.append(cfg)
            self.scratch.append(_copy(cfg))
        return self.index[structural]

    def check(self, overrides: list[str]) -> tuple[int, list[str]]:
        """(the base this job starts from, its overrides applied on top); raises Hydra's error for a job Hydra
        would not compose."""
        from omegaconf import OmegaConf

        structural, plain = self.split(overrides)
        k = self.base(tuple(structural))
        for line, key, value in plain:
            if (k, line) in self.checked:
                continue
            try:
                OmegaConf.update(self.scratch[k], key, value, merge=True)  # Hydra's own step for `key=value`
            except Exception:
                self.loader.load_sweep_config(self.master, list(overrides))  # raises, in Hydra's words
                return self.base(tuple(overrides)), []  # Hydra took it where we did not: a base of its own
            self.checked.add((k, line))
        return k, [line for line, _, _ in plain]


def check_resume(extra: list[str], bases: list[Any]) -> None:
    """hydra.launcher.resume_overrides applied to a copy of every base now, by Hydra's own code as hydra_job applies
    them at a resume: one that cannot be is refused before anything is queued, not at a trial's first resume."""
    if not extra:
        return
    from hpc_train.hydra_job import apply_overrides, parse

    try:
        parsed = parse(extra)
        for base in bases:
            apply_overrides(_copy(base), parsed)
    except Exception as e:
        cause = f"; {e.__cause__}" if e.__cause__ else ""
        raise LaunchError(f"hpc_train launcher: hydra.launcher.resume_overrides={extra}: {e}{cause}") from None


class Launch:
    """One launch of a Hydra app's jobs: the launcher's options checked at setup, before the sweep writes anything
    (`hydra_context` None: a run alone, see run_alone)."""

    def __init__(self, hydra_context: Any, task_function: Callable[..., Any], config: Any) -> None:
        from omegaconf import OmegaConf

        from hpc_train import hydra_job

        self.now = submit_moment()
        self.config = config
        with _said(config):
            params = OmegaConf.to_container(config.hydra.launcher, resolve=True)
            name = str(config.hydra.job.name)
        assert isinstance(params, dict)
        params.pop("_target_", None)
        self.cfg, self.run = run_config(params, name)
        self.wait, self.max_parallel = bool(params.get("wait")), params.get("max_parallel")
        try:
            self.app = hydra_job.app_ref(task_function)
        except ValueError as e:
            raise LaunchError(f"hpc_train launcher: {e}") from None
        self.memo: Memo | None = None
        self.made = False
        if hydra_context is not None:
            one_batch(config)
            self.memo = Memo(hydra_context.config_loader, config)
            hydra_context.config_loader = self.memo
            self.made = self.sweep_folder()
        self.launched = False

    def sweep_folder(self) -> bool:
        """own_folder at setup, before Hydra's sweeper writes multirun.yaml; a timed folder claimed under the next
        name becomes hydra.sweep.dir, where the sweeper writes and launch queues. True when made here."""
        from omegaconf import OmegaConf, open_dict, read_write

        with _said(self.config):
            target = Path(str(self.config.hydra.sweep.dir)).resolve()
        timed = "${now:" in str(OmegaConf.to_container(self.config.hydra.sweep, resolve=False)["dir"])
        folder, made = own_folder(target, timed)
        if folder != target:
            with read_write(self.config.hydra), open_dict(self.config.hydra):
                self.config.hydra.sweep.dir = str(folder)
        return made

    def at(self, target: Path) -> None:
        """out_dir: the folder holding the sweep (or the run alone), where its neighbours are (reputation, rates)."""
        self.run.out_dir = self.cfg["out_dir"] = str(target.parent)

    def trial(self, spec: str, k: int, num: int, overrides: Sequence[str]) -> dict[str, Any]:
        """A trial's config: the launch's, its command naming its base, its number and its overrides (braces
        doubled: script.fill's placeholders are {dotted.key}), then `--`: the resume overrides come after it."""
        words = [literal(o) for o in overrides]
        cmd = [*self.cfg["script"]["cmd"], spec, str(k), str(num), "--", *words, "--"]
        return {**self.cfg, "script": {**self.cfg["script"], "cmd": cmd}}

    def plan(
        self, trials: list[list[str]], configs: list[dict[str, Any]], names: list[str], target: Path, multirun: bool
    ) -> Any:
        """plan.plan of these trials (nothing written): every check of `hpc-train submit`, the live cluster's too."""
        from hpc_train import plan

        try:
            return plan.plan(
                [],
                multirun,
                sweep_dir=target,
                max_parallel=self.max_parallel,
                given=(trials, [(c, self.run) for c in configs], names),
            )
        except Exception as e:
            if _is_user_error(e):
                raise _user_error(e) from None
            raise

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> list[Any]:
        from hpc_train import hydra_job, submit
        from hpc_train.paths import locked

        assert self.memo is not None
        if self.launched or initial_job_idx:
            raise LaunchError(
                "hpc_train launcher: this sweeper launches in batches (hydra.sweeper.max_batch_size, an optimizing "
                "sweeper); hpc_train queues a sweep at once: drop max_batch_size, or use the basic sweeper"
            )
        self.launched = True
        target = Path(str(self.config.hydra.sweep.dir)).resolve()
        self.settle(target)
        checked = [self.memo.check(list(o)) for o in job_overrides]  # done already by the sweeper's own check
        with _said(self.config):
            names = self.subdirs(job_overrides, checked)
        for k, base in enumerate(self.memo.bases):
            check_output_subdir(base, [target / n for (b, _), n in zip(checked, names) if b == k], "trial")
        self.at(target)
        spec = literal(str(target / hydra_job.SPEC))
        configs = [self.trial(spec, k, i, o) for i, ((k, _), o) in enumerate(zip(checked, job_overrides))]
        check_resume(self.cfg["script"]["resume_args"], self.memo.bases)
        busy = (
            f"hydra.sweep.dir={target} is being launched into by another command right now; wait "
            f"for it to return, then see what it queued with hpc-train status {target}"
        )
        try:
            with locked(target / LAUNCH_LOCK, wait=False, busy=busy):  # from its check through its submit
                self.same_sweep(target)
                p = self.plan([list(o) for o in job_overrides], configs, names, target, True)
                hydra_job.freeze(target, self.app, self.memo.bases, True, p.private, self.now, fresh=self.made)
                p, jobs = submit.submit(p, list(self.config.hydra.overrides.task), True, target, self.max_parallel)
        except Exception as e:
            if _is_user_error(e):
                raise _user_error(e) from None
            raise
        say_queued(p, jobs)
        return returns(p, self.wait)

    def settle(self, target: Path) -> None:
        """multirun.yaml, written by Hydra's sweeper since setup, holds hydra.launcher.env's values: owner-only when
        any is set (hpc_train's rule for cluster.env); then the folder own_folder made takes the sweep's mode."""
        from hpc_train.paths import dir_mode

        if self.run.cluster.env and (target / "multirun.yaml").exists():
            os.chmod(target / "multirun.yaml", 0o600)
        if self.made:
            os.chmod(target, dir_mode(self.run.share_with_group))

    def subdirs(self, job_overrides: Sequence[Sequence[str]], jobs: list[tuple[int, list[str]]]) -> list[str]:
        """Each trial's folder in the sweep directory, Hydra's hydra.sweep.subdir (by default its job number),
        known now: its run directory. One name each, no '/': a sweep's trials sit directly in it."""
        from omegaconf import OmegaConf

        raw = str(OmegaConf.to_container(self.config.hydra.sweep, resolve=False)["subdir"])
        if "hydra.job.id" in raw or "hydra:job.id" in raw:
            raise LaunchError(
                f"hpc_train launcher: hydra.sweep.subdir={raw} names each trial's folder by its Slurm job id, "
                f"which is known only once queued, after the folder is made; use ${{hydra.job.num}} (Hydra's "
                f"default) or ${{hydra.job.override_dirname}}"
            )
        names = [str(i) for i in range(len(jobs))]
        if raw != "${hydra.job.num}":  # composed whole for it: ~2 ms a trial
            read = "${hydra:" in raw
            names = [self.subdir(k, list(o), i, read) for i, ((k, _), o) in enumerate(zip(jobs, job_overrides))]
        bad = next((n for n in names if "/" in n or n in ("", ".", "..", "submitit") or n.startswith(".")), None)
        if bad is not None or len(set(names)) < len(names):
            raise LaunchError(
                f"hpc_train launcher: hydra.sweep.subdir={raw} gives "
                f"{repr(bad) if bad is not None else 'two trials one folder'}; each trial needs a folder of its own "
                f"directly in the sweep directory: use ${{hydra.job.num}} (Hydra's default)"
            )
        return names

    def subdir(self, k: int, overrides: list[str], num: int, read: bool) -> str:
        """One trial's hydra.sweep.subdir; `read`: it reads HydraConfig (${hydra:job.override_dirname}), set to the
        trial's config as run_job sets it before reading the subdir."""
        from hydra.core.hydra_config import HydraConfig
        from omegaconf import OmegaConf

        from hpc_train import hydra_job

        assert self.memo is not None
        cfg = hydra_job.trial_config(_copy(self.memo.bases[k]), overrides, num, "")
        if not read:
            return str(OmegaConf.select(cfg, "hydra.sweep.subdir"))
        held = HydraConfig.instance().cfg
        HydraConfig.instance().set_config(cfg)
        try:
            return str(OmegaConf.select(cfg, "hydra.sweep.subdir"))
        finally:
            HydraConfig.instance().cfg = held

    def same_sweep(self, target: Path) -> None:
        """A sweep directory that holds another sweep's trials (a fixed hydra.sweep.dir run again) is refused; the
        same sweep again queues what it did not (submit's --sweep-dir)."""
        import json

        manifest = target / "sweep.json"
        if manifest.exists() and json.loads(manifest.read_text())["overrides"] != list(
            self.config.hydra.overrides.task
        ):
            raise LaunchError(
                f"hpc_train launcher: hydra.sweep.dir={target} holds a sweep of other overrides "
                f"({json.loads(manifest.read_text())['overrides']}); give this one a folder of its own "
                f"(hydra.sweep.dir=...), or run that sweep's command again to queue what it did not"
            )


def own_folder(target: Path, timed: bool) -> tuple[Path, bool]:
    """(the sweep folder, made here): made at setup, before Hydra's sweeper makes it (mkdir: 0775 under umask 002,
    which the job's trust check refuses) and 0700 until settle: multirun.yaml may hold hydra.launcher.env's values.
    A timed one (${now:} in it) that exists is another launch's of the same second: the next name is claimed
    (claim_next). A fixed one that exists is judged now (usable), before Hydra writes multirun.yaml in it."""
    from hpc_train.paths import make_dir

    key = f"hydra.sweep.dir={target}"
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        if timed:
            return claim_next(target, 0o700), True
        with contextlib.suppress(FileExistsError):
            return make_dir(target, 0o700), True
    except OSError as e:  # a parent one cannot write, a file where a folder should be
        raise _cannot_make(e, key, "the sweep") from None
    usable(target, key, "the sweep")
    return target, False


def claim_next(target: Path, mode: int) -> Path:
    """`target` made, or the first free <name>-1, <name>-2, ...: Hydra's timed folder of a launch in the same second
    as another's (mkdir is the claim: two launches never share one). Not submit.claim_dir, whose name-N is
    hpc_train's own run naming: it would name 16-39-11's second claim 16-39-12, a folder of another second."""
    from hpc_train.paths import make_dir
    from hpc_train.plan import next_dir

    wanted = target
    while True:
        try:
            return make_dir(wanted, mode)
        except FileExistsError:
            wanted = next_dir(target.parent, target.name)


def usable(target: Path, key: str, what: str) -> None:
    """A folder that exists, judged before anything is written into it: a folder, this user's alone, writable."""
    from hpc_train.paths import untrusted

    fix = f"give {what} a folder of its own ({key.split('=')[0]}=...)"
    if not target.is_dir():
        raise LaunchError(f"hpc_train launcher: {key} is a file; {fix}")
    why = untrusted(target, target)
    if not why and not os.access(target, os.W_OK | os.X_OK):
        why = f"you cannot write in it; {fix}"
    if why:
        raise LaunchError(f"hpc_train launcher: {key}: {why}")


def _cannot_make(e: OSError, key: str, what: str) -> LaunchError:
    return LaunchError(
        f"hpc_train launcher: {key}: cannot make it ({e.filename}: {e.strerror}); give {what} a folder you can "
        f"write ({key.split('=')[0]}=...)"
    )


def check_output_subdir(config: Any, folders: list[Path], what: str) -> None:
    """Hydra's run_job writes config.yaml, hydra.yaml and overrides.yaml in <output folder>/<hydra.output_subdir>:
    refused where that is the output folder itself, whose config.yaml is hpc_train's frozen run config, or outside
    it (`..`: the sweep folder, its mode and config.yaml changed by every trial)."""
    from omegaconf import OmegaConf

    with _said(config):
        sub = OmegaConf.select(config, "hydra.output_subdir")
    if sub is None:
        return
    fix = "hydra.output_subdir=.hydra (Hydra's default), or hydra.output_subdir=null for none"
    for f in folders:
        where = Path(os.path.normpath(f / str(sub)))
        if where == f:
            raise LaunchError(
                f"hpc_train launcher: hydra.output_subdir={sub} puts Hydra's config.yaml on the {what}'s own "
                f"config.yaml (hpc_train's frozen run config); give Hydra's files a folder of their own: {fix}"
            )
        if not where.is_relative_to(f):
            raise LaunchError(
                f"hpc_train launcher: hydra.output_subdir={sub} puts Hydra's files at {where}, outside the {what}'s "
                f"folder {f}, where every {what} would write over the others'; keep them in it: {fix}"
            )


BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"


def one_batch(config: Any) -> None:
    """A sweep is queued at once (one manifest, its arrays): a sweeper that launches in batches (max_batch_size, an
    optimizing sweeper that asks for the next points from the last results) is refused before anything is written."""
    sweeper = config.hydra.sweeper
    if sweeper.get("_target_") != BASIC_SWEEPER or sweeper.get("max_batch_size") is not None:
        raise LaunchError(
            f"hpc_train launcher: the sweeper {sweeper.get('_target_')} (max_batch_size="
            f"{sweeper.get('max_batch_size')}) launches in batches, and hpc_train queues a sweep at once; use "
            f"Hydra's basic sweeper without hydra.sweeper.max_batch_size"
        )


def say_queued(p: Any, jobs: list[Any]) -> None:
    """What was queued (`jobs`: by this command; a sweep run again queues only what it had not) and where to watch
    it, through Hydra's logging as its launchers say theirs."""
    local = p.runs[0].cluster.executor == "local"
    calls = len({str(j.job_id).split("_")[0] for j in jobs})
    how = "ran here" if local else f"queued in {calls} sbatch call(s)"
    if not jobs:
        how = "queued already (its sweep.json): nothing queued again"
    log.info(f"hpc_train: {len(p.trials)} trial(s) {how}; sweep directory {p.target}")
    shown = p.trials if len(p.trials) <= 20 else [*p.trials[:10], None, *p.trials[-10:]]
    for t in shown:
        if t is None:
            log.info(f"\t... {len(p.trials) - 20} more in {p.target}/sweep.json")
            continue
        log.info(f"\t#{t.index} : {' '.join(t.overrides)} -> job {t.job_id}, {t.run_dir}")
    log.info(f"hpc_train: hpc-train status {p.target}   # state, steps, goodput (results, logs, report, chaos too)")


def returns(p: Any, wait: bool) -> list[Any]:
    """Hydra's JobReturns. Queued (the default): placeholders, status COMPLETED and no value: the trials have not
    run, and Hydra has no status for "queued". Waited for (wait, or the local executor, which runs them here):
    each trial's return value, or its failure (Hydra raises it, as for a job it ran)."""
    from hydra.core.utils import JobReturn, JobStatus

    from hpc_train import hydra_job
    from hpc_train.paths import RunPaths

    local = p.runs[0].cluster.executor == "local"
    if not (wait or local):
        return [JobReturn(overrides=t.overrides, status=JobStatus.COMPLETED, working_dir=t.run_dir) for t in p.trials]
    if not local:
        wait_for(p)
    out = []
    for t in p.trials:
        record = hydra_job.read_return(Path(t.run_dir)) or {}
        finished = RunPaths(Path(t.run_dir)).summary.exists()  # a stopped attempt's task returned too
        if finished and record.get("status") == "COMPLETED":
            value = record.get("value", record.get("repr"))
            out.append(JobReturn(overrides=t.overrides, status=JobStatus.COMPLETED, working_dir=t.run_dir))
            out[-1].return_value = value
            continue
        why = record["error"] if record.get("status") == "FAILED" else _why_ended(Path(t.run_dir))
        error = RuntimeError(f"trial {t.run_dir}: {why}; see hpc-train logs {t.run_dir}")
        out.append(JobReturn(overrides=t.overrides, status=JobStatus.FAILED, working_dir=t.run_dir))
        out[-1].return_value = error
    return out


def _why_ended(run_dir: Path) -> str:
    from hpc_train import journal

    stop = journal.stopped(journal.read(run_dir))
    return f"stopped: {stop.get('reason')}" if stop else "ended without finishing (no job_return.json)"


# Slurm's states of a job that will not run again (a requeued one is PENDING again)
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


def wait_for(p: Any, every_s: float = 10.0) -> None:
    """Until every trial ended, every 10 s: by Slurm's word (one squeue, and sacct for the jobs squeue no longer
    holds: status_rows), or by every trial's own records and squeue's answer alone (_over), which a site without
    accounting must rely on (sacct fails there once squeue forgot a job, and every state reads "unknown")."""
    from hpc_train import runs, status

    log.info(f"hpc_train: waiting for {len(p.trials)} trial(s) to end (hydra.launcher.wait=true)")
    said = False
    while True:
        rows = status.status_rows(runs.find_runs(p.target))
        if all(r["finished"] or str(r["state"]).split()[0] in ENDED | {"missing", "unreadable:"} for r in rows):
            return
        error = next((str(r["state_error"]) for r in rows if r.get("state_error")), "")
        if error and not said:
            log.warning(
                f"hpc_train: Slurm cannot say how the trials' jobs ended ({error.splitlines()[0]}); waiting on each "
                f"trial's own records instead (summary.json, its stop or cancel in events.jsonl, or squeue no longer "
                f"listing its job)"
            )
            said = True
        queued = still_queued([str(t.job_id or "") for t in p.trials]) if error else None
        if all(_over(Path(t.run_dir), str(t.job_id or ""), queued) for t in p.trials):
            return
        time.sleep(every_s)


def still_queued(job_ids: list[str]) -> set[str] | None:
    """The ids squeue still lists (an array's own id: any of its tasks), asked alone: where sacct fails, job_states
    raises and its squeue answer is lost. None when squeue cannot answer either."""
    from hpc_train import slurm

    ids = [j for j in job_ids if j]
    if not ids:
        return set()
    try:
        listed = slurm.parse_squeue_states(
            slurm.call(["squeue", "-h", "-r", "-j", ",".join(ids), "-o", "%i|%T"], 30, 1)
        )
    except slurm.SlurmError as e:
        if "invalid job id" not in str(e).lower():  # squeue's answer when it holds none of them
            return None
        listed = {}
    return {j for j in ids if j in listed or any(k.startswith(f"{j}_") for k in listed)}


def _over(run_dir: Path, job_id: str, queued: set[str] | None) -> bool:
    """Whether a trial ended, by its own records: summary.json, a `stopped` event (it will not requeue by itself),
    an `hpc-train cancel` (of a pending trial: no job ever wrote `stopped`); or, where squeue answered (`queued`),
    a job it no longer lists whose run holds no live lease (a job Slurm killed before its requeue decision writes
    no event; a lease not renewed for 60 s has no job behind it)."""
    from hpc_train import journal, lease, preempt
    from hpc_train.paths import RunPaths

    paths, events = RunPaths(run_dir), journal.read(run_dir)
    if paths.summary.exists() or journal.stopped(events) or journal.cancelled(events):
        return True
    if queued is None or not job_id or job_id in queued:
        return False
    try:
        held = lease.read(paths)
    except OSError:  # unreadable now: whether a job still owns the run is unknown
        return False
    return preempt.lease_verdict(held, "", time.time(), None)


def hydra_run() -> dict[str, Any]:
    """The locals of the Hydra.run that calls the callbacks: its task function and its Callbacks (a callback is
    given neither)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "run" and callable(frame.f_locals.get("task_function")):
            return frame.f_locals
        frame = frame.f_back  # type: ignore[assignment]
    raise LaunchError("hpc_train launcher: no Hydra run on the stack to take the task function from")


def _notify(callbacks: Sequence[Any], hook: str, **kwargs: Any) -> None:
    """Each callback's hook, as Hydra's Callbacks calls it: one that raises is a warning, and the others go on."""
    for c in callbacks:
        try:
            getattr(c, hook)(**kwargs)
        except Exception as e:
            warnings.warn(f"Callback {type(c).__name__}.{hook} raised {type(e).__name__}: {e}", stacklevel=2)


def queue_run(config: Any, me: Any, **kwargs: Any) -> int:
    """A run without -m, from the QueueRun callback's on_run_start: the app's other callbacks' on_run_start that
    Hydra has not called yet (those after ours), the run queued (or run here), then every other callback's
    on_run_end with its JobReturn, last first: what Hydra.run does around run_job. Returns the exit code."""
    run = hydra_run()
    callbacks = list(getattr(run.get("callbacks"), "callbacks", []))
    others = [c for c in callbacks if c is not me]
    after = callbacks[callbacks.index(me) + 1 :] if me in callbacks else []
    _notify(after, "on_run_start", config=config, **kwargs)
    code, ret = run_alone(config, run["task_function"])
    if ret is not None:  # None: detached from a run the local executor goes on with
        _notify(others[::-1], "on_run_end", config=config, job_return=ret, **kwargs)
    return code


def run_folder(target: Path, mode: int, timed: bool) -> Path:
    """A run alone's folder, claimed: Hydra's timed default takes the next free name (claim_next); a hydra.run.dir
    of the user's own (no ${now:}) is used as it is, as Hydra uses it (fixed_run_dir)."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        return claim_next(target, mode) if timed else fixed_run_dir(target, mode)
    except OSError as e:  # a parent one cannot write, a file where a folder should be
        raise _cannot_make(e, f"hydra.run.dir={target}", "the run") from None


def fixed_run_dir(target: Path, mode: int) -> Path:
    """A hydra.run.dir of the user's own made when it is not there; one that holds a run already, or that someone
    else could write, is refused with the fix. Its claim is the frozen spec (hydra_job.freeze), made exclusively."""
    from hpc_train.hydra_job import SPEC
    from hpc_train.paths import make_dir

    with contextlib.suppress(FileExistsError):
        return make_dir(target, mode)
    usable(target, f"hydra.run.dir={target}", "the run")
    held = next((n for n in (SPEC, "config.yaml", "submission.json") if (target / n).exists()), "")
    if held:
        raise LaunchError(
            f"hpc_train launcher: hydra.run.dir={target} holds a run already ({held}); see it with "
            f"hpc-train status {target} (hpc-train resume {target} goes on with it if it stopped), or give this run "
            f"a folder of its own: hydra.run.dir=..."
        )
    return target


def run_alone(config: Any, task_function: Callable[..., Any]) -> tuple[int, Any]:
    """`python app.py hydra/launcher=hpc_train ...` without -m: one run in Hydra's hydra.run.dir, queued (Slurm)
    or run here and waited for (the local executor). Returns the exit code and its JobReturn (None: detached)."""
    from omegaconf import OmegaConf

    from hpc_train import hydra_job, submit

    launch = Launch(None, task_function, config)
    with _said(config):
        target = Path(str(config.hydra.run.dir)).resolve()
    timed = "${now:" in str(OmegaConf.to_container(config.hydra.run, resolve=False)["dir"])
    overrides = list(config.hydra.overrides.task)
    check_output_subdir(config, [target], "run")
    launch.at(target)
    check_resume(launch.cfg["script"]["resume_args"], [config])
    c = launch.trial("{run_dir}/" + hydra_job.SPEC, 0, 0, overrides)  # the folder is claimed below: its name then
    p = launch.plan([overrides], [c], [target.name], target, False)
    try:
        # Hydra's default folder is named by the time: a second run in the same second takes the next name
        p.target = run_folder(p.target, p.dir_mode, timed)
        p.trials[0].run_dir = str(p.target)
        hydra_job.freeze(p.target, launch.app, [config], False, p.private, launch.now)
        p, jobs = submit.submit(p, overrides, False, claimed=True)
    except Exception as e:
        if _is_user_error(e):
            raise _user_error(e) from None
        raise
    return ended(p, jobs, launch.wait)


def ended(p: Any, jobs: list[Any], wait: bool) -> tuple[int, Any]:
    """A run alone after its submit: its exit code and JobReturn, once it ended (the local executor, or wait) or
    queued (a placeholder, as a sweep's)."""
    if p.runs[0].cluster.executor == "local":
        log.info(f"hpc_train: running {p.target} here (the local executor); Ctrl-C detaches")
        try:
            jobs[0].wait()
        except KeyboardInterrupt:  # the run goes on: submit started it ignoring SIGINT
            log.info(f"hpc_train: detached; {p.target} runs on here: hpc-train logs {p.target} -f")
            return 130, None
        except Exception:  # a failed run: its journal says why
            pass
    elif wait:
        wait_for(p)
    else:
        log.info(f"hpc_train: submitted job {p.trials[0].job_id}; run directory {p.target}")
        log.info(f"hpc_train: hpc-train status {p.target}   # state, steps, goodput (logs, report, chaos too)")
        return 0, returns(p, False)[0]
    ret = returns(p, True)[0]
    if ret.status.name == "COMPLETED":
        log.info(f"hpc_train: finished {p.target}; it returned {ret.return_value!r}")
        return 0, ret
    log.error(f"hpc_train: {ret._return_value}")
    return 1, ret
