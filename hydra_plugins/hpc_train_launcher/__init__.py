"""hpc_train as a Hydra launcher: one override sends a `@hydra.main` app's jobs to hpc_train (docs/hydra.md).

    python app.py -m hydra/launcher=hpc_train hydra.launcher.partition=debug lr=1e-3,3e-4
    python app.py hydra/launcher=hpc_train                  # one run, without -m

Found by Hydra's plugin discovery (every module under the hydra_plugins namespace is imported at an app's start,
so this package imports nothing of hpc_train's until a launch): launcher.py holds the Launcher, the callback that
queues a run without -m, and the `hydra/launcher=hpc_train` config node.
"""
