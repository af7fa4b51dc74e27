"""The first Python of every task, in place of submitit's `python -m submitit.core._submit FOLDER`.

    python -u .../hpc_train/start.py FOLDER   # what srun (or submitit's local controller) runs per task

submitit's entry installs its own USR2/TERM handlers, which requeue from inside the handler without a
save, and only after it has loaded the job's pickle; until our job code replaced them (after torch's
~1.5 s import) a time-limit warning or a preemption either killed the task or requeued it unsaved.
Here our record-only handlers go in before any other import, and this module then does what submitit's
entry does (wait for the pickle, run it, pickle the result), minus submitit's handlers.
"""

import sys

if __spec__ is None:  # run by its path (sbatch.entry_command), not by -m: import the package beside it
    import importlib.util
    import os

    # sys.path[0] is this folder, whose env.py, data.py... would shadow top-level modules of those names.
    # hpc_train comes from exactly this folder, the package that validated the run, whatever sys.path
    # holds; the cwd (the submit folder, first on sys.path under -m) goes last: it is there only for
    # users' fn._target_ modules, and a ./hpc_train in it can no longer shadow us.
    here = os.path.dirname(os.path.realpath(__file__))
    if sys.path and os.path.realpath(sys.path[0] or ".") == here:  # not with -P / PYTHONSAFEPATH
        del sys.path[0]
    sys.path.append(os.getcwd())
    spec = importlib.util.spec_from_file_location(
        "hpc_train", os.path.join(here, "__init__.py"), submodule_search_locations=[here]
    )
    sys.modules["hpc_train"] = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(sys.modules["hpc_train"])  # type: ignore[union-attr]

from hpc_train import leave, preempt  # noqa: E402  torch-free: signal, os, time, threading

preempt.install_handlers()


def main(folder: str) -> None:
    import os
    import time
    import traceback

    from submitit.core import job_environment, utils

    from hpc_train import ranklog
    from hpc_train.paths import untrusted

    # Slurm's task number, or the local executor's, until job.py knows the rank (ranklog.py)
    ranklog.configure(os.environ.get("SLURM_PROCID") or os.environ.get("SUBMITIT_LOCAL_GLOBALID") or "?")
    os.environ["SUBMITIT_FOLDER"] = folder
    paths = job_environment.JobEnvironment().paths
    for _ in range(60):  # submitit renames the pickle into place right after sbatch returns
        if paths.submitted_pickle.exists():
            break
        time.sleep(1)
    else:
        raise RuntimeError(
            f"waited 60 s for {paths.submitted_pickle}, which submit should have written; "
            f"resubmit the run (hpc-train submit ... --sweep-dir for a sweep)"
        )
    # The pickle runs its author's code: refuse one another user owns or could have replaced (its folder,
    # the run or sweep directory above it). One line, no traceback: it is the run's files that are wrong.
    why = untrusted(paths.submitted_pickle, paths.folder.parent)
    if why:
        raise SystemExit(f"hpc_train: refusing to load the job pickle: {why}")
    delayed = utils.DelayedSubmission.load(paths.submitted_pickle)
    try:
        result = delayed.result()
    except SystemExit as e:  # sys.exit in the function (or argparse's): its code, never the interpreter's shutdown
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
        leave.process(code)
    except BaseException:  # KeyboardInterrupt too: the error on record, then the one way out
        _write_result(paths.result_pickle, ("error", traceback.format_exc()))
        traceback.print_exc()
        leave.process(1)
    _write_result(paths.result_pickle, ("success", result))
    del delayed, result  # the function's objects (a model, its process groups) are no longer ours to hold
    leave.process(0, finished=True)  # never through the interpreter's shutdown: leave.py says why


def _write_result(where: object, result: tuple[str, object]) -> None:
    """submitit's result pickle (through write_atomic, not its fixed-name `.save_tmp`, which open() follows if
    planted). A result that does not pickle (a lock, a generator in the function's return) or a write that fails
    is said in one line: the run's own records (summary.json, the finish event) are written already."""
    import logging

    import cloudpickle

    from hpc_train.paths import write_atomic

    log = logging.getLogger("hpc_train.start")

    try:
        data = cloudpickle.dumps(result)
    except Exception as e:
        log.warning(f"the function's result does not pickle ({type(e).__name__}: {e}); none kept")
        data = cloudpickle.dumps((result[0], None))
    try:
        write_atomic(where, data)  # type: ignore[arg-type]
    except OSError as e:
        log.warning(f"could not write the result to {where}: {e}")


if __name__ == "__main__":
    main(sys.argv[1])
