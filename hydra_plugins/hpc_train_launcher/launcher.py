"""The plugin's three parts, each handing over to hpc_train.hydra_launch (the login side; torch-free):

- HpcTrainLauncher: Hydra's Launcher for a sweep (-m): setup checks hydra.launcher.* before the sweep writes
  anything; launch queues every job as an hpc_train trial and returns once they are queued.
- QueueRun: a run without -m never reaches a launcher (Hydra runs the task in its own process), so the node below
  adds this callback, whose on_run_start queues the run instead and ends the process before Hydra would run it;
  its on_multirun_start checks hydra.launcher's keys before Hydra instantiates the launcher with them.
- the ConfigStore node `hydra/launcher=hpc_train` (package `hydra`, for the callback beside the launcher): its
  keys are hpc_train_launcher's NODE, hpc_train's cluster options and the launcher's own.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.experimental.callback import Callback
from hydra.plugins.launcher import Launcher

from hpc_train.hydra_launch import NODE, TARGET


class HpcTrainLauncher(Launcher):
    def __init__(self, **params: Any) -> None:
        self.params = params  # read again from the config at setup, resolved
        self.launch_: Any = None

    def setup(self, *, hydra_context: Any, task_function: Any, config: Any) -> None:
        from hpc_train.hydra_launch import Launch

        self.launch_ = Launch(hydra_context, task_function, config)

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[Any]:
        return self.launch_.launch(job_overrides, initial_job_idx)


class QueueRun(Callback):
    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        """A sweep's launcher keys checked before Hydra instantiates the launcher (which resolves them in its own
        code: an unset ${oc.env:NAME} would be OmegaConf's traceback), and ${now:} made the submit's moment."""
        from hydra.errors import CompactHydraException

        from hpc_train import hydra_launch

        if config.hydra.launcher.get("_target_") != TARGET:
            return
        try:
            hydra_launch.check_keys(config)
        except CompactHydraException as e:  # Hydra's Callbacks turn an exception into a warning and go on
            print(e, file=sys.stderr)
            sys.exit(1)

    def on_run_start(self, config: Any, **kwargs: Any) -> None:
        """Queue the run (or run it through hpc_train's local executor) between the app's other callbacks'
        on_run_start and on_run_end, then exit: Hydra's Callbacks turn an exception into a warning and would go on
        to run the task here, so every way out is sys.exit."""
        from hydra.errors import CompactHydraException

        from hpc_train import hydra_launch

        if config.hydra.launcher.get("_target_") != TARGET:  # the callback kept, another launcher chosen
            return
        try:
            code = hydra_launch.queue_run(config, self, **kwargs)
        except CompactHydraException as e:
            print(e, file=sys.stderr)
            code = 1
        except Exception:
            import traceback

            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.exit(code)


ConfigStore.instance().store(
    group="hydra/launcher",
    name="hpc_train",
    package="hydra",
    node={
        "launcher": {"_target_": TARGET, **NODE},
        "callbacks": {"hpc_train": {"_target_": "hydra_plugins.hpc_train_launcher.launcher.QueueRun"}},
    },
    provider="hpc_train",
)
