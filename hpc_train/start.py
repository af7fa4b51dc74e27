"""The first Python of every task, in place of submitit's `python -m submitit.core._submit FOLDER`.

    python -u -m hpc_train.start FOLDER     # what srun (or submitit's local controller) runs per task

submitit's entry installs its own USR2/TERM handlers, which requeue from inside the handler without a
save, and only after it has loaded the job's pickle; until our job code replaced them (after torch's
~1.5 s import) a time-limit warning or a preemption either killed the task or requeued it unsaved.
Here our record-only handlers go in before any other import, and this module then does what submitit's
entry does (wait for the pickle, run it, pickle the result), minus submitit's handlers.
"""

import sys

from hpc_train import preempt  # torch-free: signal, os, time

preempt.install_handlers()


def main(folder: str) -> None:
    import os
    import time
    import traceback

    from submitit.core import job_environment, utils

    os.environ["SUBMITIT_FOLDER"] = folder
    paths = job_environment.JobEnvironment().paths
    for _ in range(60):  # submitit renames the pickle into place right after sbatch returns
        if paths.submitted_pickle.exists():
            break
        time.sleep(1)
    else:
        raise RuntimeError(f"waited 60 s for {paths.submitted_pickle}, which submit should have written; "
                           f"resubmit the run (hpc-train submit ... --sweep-dir for a sweep)")
    delayed = utils.DelayedSubmission.load(paths.submitted_pickle)
    try:
        result = delayed.result()
    except Exception:
        with utils.temporary_save_path(paths.result_pickle) as tmp:
            utils.cloudpickle_dump(("error", traceback.format_exc()), tmp)
        raise
    with utils.temporary_save_path(paths.result_pickle) as tmp:
        utils.cloudpickle_dump(("success", result), tmp)


if __name__ == "__main__":
    main(sys.argv[1])
