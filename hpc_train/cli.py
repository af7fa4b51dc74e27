"""`hpc-train` command line. Argument parsing only; every import is lazy and none reaches torch.

    hpc-train submit                                          # demo: 2 ranks on this machine, waits
    hpc-train submit cluster=dev train.steps=200              # 2 nodes x 2 ranks on the test cluster
    hpc-train submit -m cluster=dev train.lr=1e-3,3e-3 cluster.nodes=1,2   # 4 trials as 2 job arrays
    hpc-train submit -m ... --sweep-dir runs/demo-3           # complete a half-submitted sweep
    hpc-train submit --dry-run -m cluster=dev train.seed=range(8)          # print scripts, queue nothing
    hpc-train submit --cfg job model.d_model=128              # print the composed config
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

USER_ERRORS = ("hydra", "omegaconf")


def _is_user_error(e: Exception) -> bool:
    from hpc_train.slurm import SlurmError

    return isinstance(e, (ValueError, SlurmError)) or type(e).__module__.split(".")[0] in USER_ERRORS


def _print_dry_run(p: object) -> None:
    import yaml

    for k, (array, script) in enumerate(zip(p.arrays, p.scripts)):  # type: ignore[attr-defined]
        print(f"# ---- array {k}: trials {array.trials[0]}..{array.trials[-1]} ({len(array.trials)}) ----")
        print(script)
    for trial, config in zip(p.trials, p.configs):  # type: ignore[attr-defined]
        print(f"# ---- trial {trial.index}: {' '.join(trial.overrides)} -> {trial.run_dir} ----")
        print(yaml.safe_dump(config, sort_keys=False), end="")
    print(f"# dry run: {len(p.trials)} trial(s) in {len(p.arrays)} sbatch call(s); nothing written or queued")  # type: ignore[attr-defined]


def _print_table(p: object) -> None:
    from rich.console import Console
    from rich.table import Table

    trials = p.trials  # type: ignore[attr-defined]
    table = Table(title=f"{len(trials)} trial(s) queued in {len(p.arrays)} sbatch call(s)")  # type: ignore[attr-defined]
    for col in ("trial", "overrides", "job id", "run directory"):
        table.add_column(col)
    shown = trials if len(trials) <= 20 else trials[:10] + trials[-10:]
    for t in shown:
        if len(trials) > 20 and t is trials[-10]:
            table.add_row("...", f"{len(trials) - 20} more in sweep.json", "", "")
        table.add_row(str(t.index), " ".join(t.overrides), t.job_id or "-", t.run_dir)
    Console(width=200).print(table)


def _submit(args: argparse.Namespace) -> int:
    from hpc_train.config import CONF_DIR, compose, explain

    config_dir = CONF_DIR
    if args.config_dir:  # searched after conf/: add options (cluster/mysite.yaml) without copying ours
        args.overrides.insert(0, f"hydra.searchpath=[file://{Path(args.config_dir).resolve()}]")
    try:
        if args.cfg:
            from omegaconf import OmegaConf

            from hpc_train.config import to_run_config

            cfg = compose(args.overrides, config_dir)
            to_run_config(cfg)
            print(OmegaConf.to_yaml(cfg, resolve=True), end="")
            return 0
        from hpc_train import submit

        from hpc_train.metrics import lead_warning

        p = submit.plan(args.overrides, args.multirun, args.sweep_dir, args.max_parallel, config_dir)
        slurm_run = p.runs[0].cluster.executor == "slurm"
        warning = slurm_run and lead_warning(submit.previous_runs(p), p.runs[0].cluster.signal_lead_s)
        if warning:
            print(f"hpc-train submit: warning: {warning}", file=sys.stderr)
        if args.dry_run:
            _print_dry_run(p)
            return 0
        with _progress(enabled=args.multirun) as progress:
            p, jobs = submit.submit(args.overrides, args.multirun, args.sweep_dir, args.max_parallel,
                                    config_dir, progress)
    except Exception as e:
        if not _is_user_error(e):
            raise
        print(f"hpc-train submit: error: {explain(e)}", file=sys.stderr)
        return 2
    if args.multirun:
        _print_table(p)
        print(f"sweep directory {p.target}")
        return 0
    print(f"submitted job {p.trials[0].job_id}; run directory {p.target}")
    if type(jobs[0]).__name__ != "LocalJob" or args.no_wait:
        return 0
    # Local executor: this machine is the cluster, so wait and show the outcome.
    try:
        summary = jobs[0].results()[0]  # rank 0 returns the summary
    except Exception as e:
        print(f"job failed; log: {p.target}/submitit\n{e}", file=sys.stderr)
        return 1
    print(f"finished: {summary}")
    return 0


class _progress:
    """A rich progress bar on stderr for sweeps being queued; silent for small ones."""

    def __init__(self, enabled: bool) -> None:
        self.enabled, self.bar, self.task = enabled, None, None

    def __enter__(self):  # type: ignore[no-untyped-def]
        return self.update if self.enabled else None

    def update(self, done: int, total: int) -> None:
        if self.bar is None:
            if total < 100:
                return
            from rich.progress import Progress

            self.bar = Progress(transient=True)
            self.bar.start()
            self.task = self.bar.add_task("queueing trials", total=total)
        self.bar.update(self.task, completed=done)

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hpc-train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("submit", help="compose a config, freeze run directories and submit")
    p.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. cluster=dev train.steps=200")
    p.add_argument("-m", "--multirun", action="store_true", help="expand sweeps (a=1,2 range() choice()) into trials")
    p.add_argument("--dry-run", action="store_true", help="print each array's batch script and each trial's config")
    p.add_argument("--sweep-dir", type=Path, help="an existing sweep directory: submit only its missing trials")
    p.add_argument("--max-parallel", type=int, help="at most this many tasks of an array run at once (%%N)")
    p.add_argument("--config-dir", help="your own config dir, searched too: e.g. DIR/cluster/mysite.yaml")
    p.add_argument("--cfg", choices=["job"], help="print the composed config and exit")
    p.add_argument("--no-wait", action="store_true", help="local executor: return once the job started")
    p.set_defaults(func=_submit)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
