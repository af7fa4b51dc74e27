"""`hpc-train` command line. Argument parsing only; every import is lazy and none reaches torch.

    hpc-train submit                                  # demo: 2 ranks on this machine, waits, prints summary
    hpc-train submit cluster=dev train.steps=200      # 2 nodes x 2 ranks on the test cluster, returns at once
    hpc-train submit --cfg job model.d_model=128      # print the composed config, submit nothing
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _submit(args: argparse.Namespace) -> int:
    from hpc_train.config import CONF_DIR, compose, explain, to_run_config

    config_dir = Path(args.config_dir) if args.config_dir else CONF_DIR
    try:
        if args.cfg:
            from omegaconf import OmegaConf

            cfg = compose(args.overrides, config_dir)
            to_run_config(cfg)
            print(OmegaConf.to_yaml(cfg, resolve=True), end="")
            return 0
        from hpc_train.submit import submit

        run_dir, job = submit(args.overrides, config_dir)
    except Exception as e:  # Hydra/OmegaConf/our checks: the message names the key, value and fix
        if type(e).__module__.split(".")[0] not in ("hydra", "omegaconf") and not isinstance(e, ValueError):
            raise
        print(f"hpc-train submit: error: {explain(e)}", file=sys.stderr)
        return 2
    print(f"submitted job {job.job_id}; run directory {run_dir}")
    if type(job).__name__ != "LocalJob" or args.no_wait:
        return 0
    # Local executor: this machine is the cluster, so wait and show the outcome.
    try:
        summary = job.results()[0]  # rank 0 returns the summary
    except Exception as e:
        print(f"job failed; log: {run_dir}/submitit\n{e}", file=sys.stderr)
        return 1
    print(f"finished: {summary}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hpc-train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("submit", help="compose a config, freeze a run directory and submit the job")
    p.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. cluster=dev train.steps=200")
    p.add_argument("--config-dir", help="a config tree to use instead of the packaged conf/")
    p.add_argument("--cfg", choices=["job"], help="print the composed config and exit")
    p.add_argument("--no-wait", action="store_true", help="local executor: return once the job started")
    p.set_defaults(func=_submit)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
