"""A Hydra app's job, frozen at submit and run in every rank's child: each trial's command under the hpc_train
launcher (hydra_plugins/hpc_train_launcher, docs/hydra.md).

    python app.py -m hydra/launcher=hpc_train lr=1e-3,3e-4           # what the user runs (docs/hydra.md)
    python .../hpc_train/hydra_job.py SWEEP/hydra_launch.json 0 1 -- lr=0.0003   # what each rank's child runs

At submit (hydra_launch.py) the app's composed config is frozen beside the trials: once per distinct set of
structural overrides (config-group choices, +key, ~key, an interpolation) as Hydra composed it, a pickle
(`hydra_base-K.pickle`: a structured config keeps its types), with `hydra_launch.json` naming the task function and
the submit's moment (every ${now:FMT} here gives it); each trial's overrides are frozen in its
config.yaml (script.cmd). Here the trial's config is that base with the trial's own `key=value` overrides applied
by Hydra's own code: nothing is composed from the app's config files again, so every attempt gets the same config.
Then Hydra's run_job, as Hydra's launchers call it: HydraConfig, the output folder (the trial's run directory,
pinned), .hydra/*.yaml, the job's logging, callbacks, env_set, hydra.job.chdir, and the task function, unchanged.
Its stop request is the signal it gets (script.stop_signal: TERM), `script_helper.stop_requested()` or its own
checkpoint file in its output folder; HPC_TRAIN_RUN_DIR, HPC_TRAIN_CKPT_DIR and HPC_TRAIN_RESTART_COUNT are set
(supervisor.child_env). Torch-free; rank 0 writes what the task returned to job_return.json (STOPPED for an
attempt hpc_train stopped: not the job's result).
"""

from __future__ import annotations

import sys

if __spec__ is None:  # run by its path (each trial's script.cmd): the package beside it, as start.py does
    import importlib.util
    import os

    _here = os.path.dirname(os.path.realpath(__file__))
    if sys.path and os.path.realpath(sys.path[0] or ".") == _here:  # its env.py, data.py... would shadow others
        del sys.path[0]
    _spec = importlib.util.spec_from_file_location(
        "hpc_train", os.path.join(_here, "__init__.py"), submodule_search_locations=[_here]
    )
    sys.modules["hpc_train"] = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
    _spec.loader.exec_module(sys.modules["hpc_train"])  # type: ignore[union-attr]

import contextlib  # noqa: E402
import functools  # noqa: E402
import importlib  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import pickle  # noqa: E402
import signal  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from datetime import datetime  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from hpc_train import journal  # noqa: E402
from hpc_train.paths import dir_mode, make_dir, untrusted, write_atomic  # noqa: E402

SPEC = "hydra_launch.json"  # in the sweep directory (a run alone: its run directory)
RETURN = "job_return.json"  # in the trial's run directory: what the task function returned, or raised


def base_file(k: int) -> str:
    return f"hydra_base-{k}.pickle"


def app_ref(fn: Callable[..., Any]) -> dict[str, Any]:
    """How a node finds the task function again (login side): its module by name, or the file Hydra's app ran as
    __main__; its name there; whether that name holds @hydra.main's wrapper of it. ValueError when a node could
    not find it by name (a function defined inside another)."""
    name, module = fn.__qualname__, fn.__module__
    if "<locals>" in name:
        raise ValueError(
            f"the task function {name} is defined inside another function; every rank imports it by name: define "
            f"it at the top level of its module"
        )
    main, file = module == "__main__", None
    if main:
        spec = getattr(sys.modules["__main__"], "__spec__", None)
        if spec is not None and spec.name:  # python -m pkg.app: imported by that name on the node
            module = spec.name
        elif getattr(sys.modules["__main__"], "__file__", None):
            module, file = None, os.path.abspath(sys.modules["__main__"].__file__)
        else:
            raise ValueError("the Hydra app runs from no file (python -c, a notebook); save it as app.py and run that")
    found: Any = sys.modules[fn.__module__]
    for part in name.split("."):
        found = getattr(found, part, None)
    wrapped = found is not fn and getattr(found, "__wrapped__", None) is fn  # @hydra.main's decorated_main
    if found is not fn and not wrapped:
        raise ValueError(f"{fn.__module__}.{name} is not the task function Hydra runs; name the function itself")
    return {"module": module, "file": file, "name": name, "wrapped": wrapped, "main": main}


def import_app(ref: dict[str, Any]) -> Any:
    """The app's module, imported as `python app.py` or `python -m pkg.app` would find it (its folder, or the
    submit folder, first on sys.path), never run as __main__; an app that ran as __main__ is also aliased as
    __main__, so the pickled config finds the classes it defined there (what multiprocessing's spawn does)."""
    if ref["file"]:
        sys.path.insert(0, os.path.dirname(ref["file"]))
        spec = importlib.util.spec_from_file_location("__mp_main__", ref["file"])
        if spec is None or spec.loader is None:
            raise FileNotFoundError(f"{ref['file']}: the Hydra app's file, gone since the submit")
        module = importlib.util.module_from_spec(spec)
        sys.modules["__mp_main__"] = module
        spec.loader.exec_module(module)
        # again: importing multiprocessing (torch does) points __mp_main__ back at this file, and the app's own
        # classes then no longer pickle (torch.save of its config); no __spec__, so that spawn runs it by its path
        sys.modules["__mp_main__"], module.__spec__ = module, None
    else:
        sys.path.insert(0, os.getcwd())
        module = importlib.import_module(ref["module"])
    if ref["main"]:
        sys.modules["__main__"] = module
    return module


def task_function(ref: dict[str, Any]) -> Callable[..., Any]:
    found = import_app(ref)
    for part in ref["name"].split("."):
        found = getattr(found, part)
    return found.__wrapped__ if ref["wrapped"] else found


def freeze(
    folder: Path,
    ref: dict[str, Any],
    bases: list[Any],
    multirun: bool,
    private: bool,
    now: str = "",
    fresh: bool = False,
) -> Path:
    """hydra_launch.json and each base's pickle in `folder`, written once: a resubmitted sweep keeps the config
    its trials were frozen with (the app's conf/ may have changed since). A run alone's, or a sweep's in a folder
    made for it (`fresh`), is never a resubmit: the spec, created first and exclusively (O_EXCL), is the launch's
    claim on the folder, and a second launch into it at the same moment is refused, never handed the first's app.
    `now`: the submit's moment (freeze_now). Returns the spec's path. ValueError for a config that does not pickle
    (a value built by a resolver of the app's own), or a folder another launch claimed."""
    spec = folder / SPEC
    if spec.exists() and multirun and not fresh:  # a resubmit: what it froze, once it is this user's alone
        if why := untrusted(spec, folder):
            raise ValueError(f"refusing the sweep's frozen files: {why}")
        if missing := _missing_base(spec, len(bases)):
            raise ValueError(
                f"{spec} names a frozen config {missing} that is not there (a launch stopped while it froze the "
                f"sweep, or the file was removed since): its trials cannot load it; to freeze the app again, remove "
                f"{SPEC} and the hydra_base-*.pickle files from {folder}, or launch into another folder "
                f"(hydra.sweep.dir=...)"
            )
        if why := next((untrusted(folder / base_file(k), folder) for k in range(len(bases))), ""):
            raise ValueError(f"refusing the sweep's frozen files: {why}")
        return spec
    blobs = []
    for base in bases:
        try:
            blobs.append(pickle.dumps(base, pickle.HIGHEST_PROTOCOL))
        except Exception as e:
            raise ValueError(f"the app's composed config does not pickle ({type(e).__name__}: {e})") from None
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
    try:
        fd = os.open(spec, flags, 0o600 if private else 0o644)
    except FileExistsError:
        raise ValueError(
            f"{folder} holds {SPEC}: another launch froze its app there at the same time; see it with hpc-train "
            f"status {folder}, and give this one a folder of its own"
        ) from None
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps({"app": ref, "bases": len(bases), "multirun": multirun, "now": now}, indent=1) + "\n")
    for k, data in enumerate(blobs):
        write_atomic(folder / base_file(k), data, private)
    return spec


def freeze_now(moment: datetime) -> str:
    """Hydra's ${now:FMT} made one moment, whatever the format: the submit's (login side, before anything is
    resolved) and again on the node from the spec, so no attempt resolves a format Hydra had not cached at the
    submit (its sweep folder's two) to its own, later time. A naive local time, as Hydra's datetime.now(): the
    node gives every field as the submit did. Returns it as the spec keeps it."""
    from omegaconf import OmegaConf

    OmegaConf.register_new_resolver("now", moment.strftime, use_cache=True, replace=True)
    return moment.isoformat()


def _missing_base(spec: Path, bases: int) -> str:
    """The first base file a spec names (its `bases`, or this launch's count where it cannot be read) that is not
    beside it, "" when all are: a launch stopped between its claim and its pickles leaves a spec without them."""
    try:
        bases = int(json.loads(spec.read_text())["bases"])
    except (OSError, ValueError, KeyError, TypeError, OverflowError):  # OverflowError: "bases": Infinity
        pass
    return next((base_file(k) for k in range(bases) if not (spec.parent / base_file(k)).exists()), "")


def load_base(folder: Path, k: int) -> Any:
    """A frozen base, once it is known to be this user's alone (a pickle runs its writer's code)."""
    path = folder / base_file(k)
    why = untrusted(path, folder)
    if why:
        raise SystemExit(f"hpc_train: refusing to load the app's frozen config: {why}")
    return pickle.loads(path.read_bytes())


def parse(lines: list[str]) -> list[Any]:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create().parse_overrides(list(lines))


def apply_overrides(cfg: Any, parsed: list[Any]) -> None:
    """Hydra's own step for each parsed override on a composed config (changed in place), in their order; Hydra
    raises for one it would refuse (its words)."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl  # no public API applies overrides to a config

    ConfigLoaderImpl._apply_overrides_to_config(parsed, cfg)


def trial_config(cfg: Any, overrides: list[str], num: int | None, job_id: str, extra: list[str] | None = None) -> Any:
    """`cfg`, a base (changed in place), made this trial's: the overrides it was not composed with applied by Hydra's
    own code, in their order, then the hydra fields Hydra sets per job (load_configuration, its launchers):
    overrides.task, job.override_dirname, and for a sweep's job job.num and job.id (Slurm's, as submitit's).
    `extra`: the resume overrides (hydra.launcher.resume_overrides), applied last and listed in overrides.task as
    Hydra lists them, but kept out of job.override_dirname: the job, its name and its folder, stay the submit's."""
    from hydra._internal.config_loader_impl import get_overrides_dirname
    from omegaconf import open_dict

    parsed, held = parse(overrides), set(cfg.hydra.overrides.task)
    apply_overrides(cfg, [o for o in parsed if o.input_line not in held])
    apply_overrides(cfg, parse(extra or []))
    job = cfg.hydra.job
    with open_dict(cfg.hydra):
        cfg.hydra.overrides.task = [*overrides, *(extra or [])]
        job.override_dirname = get_overrides_dirname(
            overrides=parsed,
            exclude_keys=list(job.config.override_dirname.exclude_keys),
            item_sep=job.config.override_dirname.item_sep,
            kv_sep=job.config.override_dirname.kv_sep,
        )
        if num is not None:
            job.num, job.id = num, job_id
    return cfg


def pin_output(cfg: Any, run_dir: Path, multirun: bool) -> None:
    """The output folder Hydra's run_job computes is the trial's run directory, whatever ${now:} says today."""
    from omegaconf import open_dict

    with open_dict(cfg.hydra):
        if multirun:
            cfg.hydra.sweep.dir, cfg.hydra.sweep.subdir = str(run_dir.parent), run_dir.name
        else:
            cfg.hydra.run.dir = str(run_dir)


def run_task(fn: Callable[..., Any], cfg: Any, multirun: bool) -> Any:
    """Hydra's run_job, as its launchers call it on a node; returns its JobReturn."""
    from hydra._internal.callbacks import Callbacks  # run_job takes them in a HydraContext, as Hydra builds it
    from hydra.core.utils import JobRuntime, run_job
    from hydra.types import HydraContext

    JobRuntime.instance().set("name", cfg.hydra.job.name)
    context = HydraContext(config_loader=None, callbacks=Callbacks(cfg))  # type: ignore[arg-type]
    keys = ("hydra.sweep.dir", "hydra.sweep.subdir") if multirun else ("hydra.run.dir", None)
    return run_job(task_function=fn, config=cfg, job_dir_key=keys[0], job_subdir_key=keys[1], hydra_context=context)


def hide_records(cfg: Any, run_dir: Path) -> tuple[Path, int] | None:
    """Hydra's .hydra/ folder made before run_job makes it with the umask's mode (0775 under umask 002): the run's
    folder mode (paths.dir_mode), or owner-only when hydra.launcher.env holds values: its hydra.yaml has them, and
    hpc_train's rule for cluster.env is that every file holding one is its owner's alone (docs/submitting.md,
    secrets), share_with_group or not. Returns the folder and the mode its files take (tighten_records)."""
    sub = cfg.hydra.output_subdir
    if sub is None:
        return None
    launcher = cfg.hydra.launcher
    mode = 0o700 if launcher.get("env") else dir_mode(bool(launcher.get("share_with_group")))
    folder = run_dir / str(sub)
    folder.parent.mkdir(parents=True, exist_ok=True)
    make_dir(folder, mode, exist_ok=True)
    os.chmod(folder, mode)  # one an older attempt made as Hydra makes it (0755)
    return folder, mode & 0o666  # 0600, or 0640 with share_with_group


def tighten_records(records: tuple[Path, int] | None) -> None:
    """The files run_job wrote into .hydra/ (config.yaml, hydra.yaml, overrides.yaml: with the umask's mode, 0664
    under umask 002, a teammate could edit the record) take the run's file mode; a link is left alone."""
    if records is None:
        return
    folder, mode = records
    with contextlib.suppress(OSError):  # a record's mode never fails the run (the folder gone, a file not ours)
        for path in folder.iterdir():
            if path.is_file() and not path.is_symlink():
                with contextlib.suppress(OSError):  # the others are still tightened
                    os.chmod(path, mode)


class AttemptStopped(Exception):
    """The task returned because hpc_train stopped its attempt (a preemption, a time limit, a cancel): what it
    returned is not the job's result, and Hydra's callbacks must not see it as COMPLETED."""


def stop_pipe() -> int:
    """The read end of a pipe Python writes each signal's number to as it comes (signal.set_wakeup_fd), whatever
    handler the app installs for it (most install their own for TERM); -1 where none can be set."""
    r, w = os.pipe()
    os.set_blocking(r, False)
    os.set_blocking(w, False)
    try:
        signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    except ValueError:  # not the main thread
        return -1
    return r


def stopped(run_dir: Path, restart: int, pipe: int, stop_signal: str) -> bool:
    """Whether the job asked this attempt to stop: its rank 0 records the stop (the journal's signal event) as it
    signals the task, and a task that returns at once may be back first, so a stop signal seen here waits up to
    2 s for that record; one the job did not send (the app's own kill) is no stop."""
    seen = False
    if pipe >= 0:
        try:
            seen = bytes([signal.Signals[f"SIG{stop_signal}"].value]) in os.read(pipe, 65536)
        except (BlockingIOError, KeyError):
            pass
    deadline = time.monotonic() + (2.0 if seen else 0.0)
    while not any(e["restart"] == restart for e in journal.named(journal.read(run_dir), journal.SIGNAL)):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
    return True


def judged(fn: Callable[..., Any], run_dir: Path, records: tuple[Path, int] | None = None) -> Callable[..., Any]:
    """The task function as run_job calls it (after it wrote its records: tighten_records first), its return judged:
    one that came after hpc_train stopped the attempt raises AttemptStopped, so Hydra's JobReturn (callbacks'
    on_job_end) is not COMPLETED for it; so does an error it raised after the stop (an app unwinding from its signal
    handler), which is not the job's failure."""
    restart = int(os.environ.get("HPC_TRAIN_RESTART_COUNT", "0"))
    stop_signal = os.environ.get("HPC_TRAIN_STOP_SIGNAL", "TERM")
    pipe = stop_pipe()

    @functools.wraps(fn)
    def task(cfg: Any) -> Any:
        tighten_records(records)
        try:
            value = fn(cfg)
        except BaseException as e:  # a TERM handler that raises (or exits) to unwind: a stop all the same
            if stopped(run_dir, restart, pipe, stop_signal):
                raise AttemptStopped(
                    f"attempt {restart} was stopped by hpc_train (SIG{stop_signal}) and its task raised "
                    f"{type(e).__name__}: {str(e)[:200]}; the next attempt resumes the job"
                ) from e
            raise
        if stopped(run_dir, restart, pipe, stop_signal):
            raise AttemptStopped(
                f"attempt {restart} was stopped by hpc_train (SIG{stop_signal}) and its task returned "
                f"{repr(value)[:200]} early; the next attempt resumes the job"
            )
        return value

    return task


def write_return(run_dir: Path, ret: Any) -> None:
    """job_return.json: {"status": "COMPLETED", "value": ...} (JSON, or its repr), {"status": "FAILED", "error"}, or
    {"status": "STOPPED", "restart"} for an attempt hpc_train stopped (the next one writes the job's result)."""
    from hydra.core.utils import JobStatus

    value = ret._return_value  # JobReturn.return_value raises a failure's exception
    if ret.status == JobStatus.COMPLETED:
        try:
            record = {"status": "COMPLETED", "value": json.loads(json.dumps(value))}
        except (TypeError, ValueError):  # not JSON (a tensor, an object): its repr
            record = {"status": "COMPLETED", "repr": repr(value)[:2000]}
    elif isinstance(value, AttemptStopped):
        record = {"status": "STOPPED", "restart": int(os.environ.get("HPC_TRAIN_RESTART_COUNT", "0"))}
    else:
        record = {"status": "FAILED", "error": f"{type(value).__name__}: {value}"[:2000]}
    write_atomic(run_dir / RETURN, json.dumps(record) + "\n")


def read_return(run_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((run_dir / RETURN).read_text())
    except (OSError, ValueError):
        return None


def split_args(words: list[str]) -> tuple[list[str], list[str]]:
    """(the trial's overrides, the resume overrides) of `-- OVERRIDES -- RESUME...` (script.cmd ends with the
    second `--`, resume_args come after it); a command queued without it holds overrides only."""
    words = words[1:] if words[:1] == ["--"] else words
    if "--" not in words:  # no Hydra override is `--`
        return words, []
    i = words.index("--")
    return words[:i], words[i + 1 :]


def main(argv: list[str]) -> int:
    from hydra.core.utils import setup_globals

    spec_path, k, num = Path(argv[0]), int(argv[1]), int(argv[2])
    overrides, extra = split_args(argv[3:])
    why = untrusted(spec_path, spec_path.parent)  # before anything it names is imported: it runs as this user
    if why:
        raise SystemExit(f"hpc_train: refusing to run the app the sweep's spec names: {why}")
    spec = json.loads(spec_path.read_text())
    if not os.environ.get("HPC_TRAIN_RUN_DIR"):
        raise SystemExit("hpc_train: hydra_job.py runs inside an hpc_train job (HPC_TRAIN_RUN_DIR is not set)")
    run_dir = Path(os.environ["HPC_TRAIN_RUN_DIR"])
    setup_globals()  # the now, hydra and python_version resolvers, as Hydra's main registers them
    if spec.get("now"):
        freeze_now(datetime.fromisoformat(spec["now"]))
    fn = task_function(spec["app"])  # first: the pickle may name classes the app defines
    multirun, job_id = spec["multirun"], os.environ.get("HPC_TRAIN_JOB_ID", "")
    cfg = trial_config(load_base(spec_path.parent, k), overrides, num if multirun else None, job_id, extra)
    pin_output(cfg, run_dir, multirun)
    records = hide_records(cfg, run_dir)
    ret = run_task(judged(fn, run_dir, records), cfg, multirun)
    if os.environ.get("RANK", "0") == "0":
        write_return(run_dir, ret)
    if isinstance(ret._return_value, AttemptStopped):
        return 0  # the app's own way out of a stop: the job decides the requeue
    ret.return_value  # noqa: B018  the task's exception, raised here: its traceback, exit 1 (as Hydra's run)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
