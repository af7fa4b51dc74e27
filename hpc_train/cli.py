"""`hpc-train` command line: argument parsing only; every import is lazy and none reaches torch (USAGE is what
`hpc-train --help` opens with)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

USAGE = """Slurm-native multi-node PyTorch training that survives preemption: one command turns a config, or a
sweep, into runs that save, requeue and resume by themselves. Docs: README.md and docs/ of the project.

hpc-train init                                            # ./conf: the starter configs, yours to edit
hpc-train submit                                          # demo: 2 ranks on this machine, waits
hpc-train submit cluster=dev train.steps=200              # 2 nodes x 2 ranks on the test cluster
hpc-train submit -m cluster=dev train.lr=1e-3,3e-3 cluster.nodes=1,2   # 4 trials as 2 job arrays
hpc-train submit -m ... --sweep-dir runs/demo-3           # complete a half-submitted sweep
hpc-train submit --dry-run -m cluster=dev train.seed=range(8)          # print scripts, queue nothing
hpc-train submit --cfg job model.d_model=128              # print the composed config
hpc-train submit cluster=dev -- python train.py --lr 3e-4 # your own script on every rank (docs/scripts.md)
hpc-train submit cluster=dev --after runs/demo-1 -- python eval.py --ckpt {after.ckpt}   # a pipeline's next stage
hpc-train results runs/demo-3 --sort train.lr             # a sweep's trials: overrides, state, loss
hpc-train nodes                                           # nodes with a bad record, left out by submit
hpc-train prepare-data notes/ --out data/notes            # text files -> byte-token shards
hpc-train prepare-data notes/ --out data/bpe --tokenizer bpe:8192   # ... or a BPE trained on them
hpc-train prepare-data notes/ --out data/n2 --val-fraction 0.05   # ... the last 5% held out for eval
hpc-train submit data=tokens data.path=data/notes         # train on them
"""

USER_ERRORS = ("hydra", "omegaconf")


def _is_user_error(e: Exception) -> bool:
    from hpc_train.preempt import Unrecoverable  # {after.ckpt} of a stage that ended without one, at a resubmit
    from hpc_train.slurm import SlurmError

    known = (ValueError, SlurmError, PermissionError, Unrecoverable)
    return isinstance(e, known) or type(e).__module__.split(".")[0] in USER_ERRORS


def _print_dry_run(p: object) -> None:
    from hpc_train.submit import frozen_yaml

    for k, (array, script) in enumerate(zip(p.arrays, p.scripts)):  # type: ignore[attr-defined]
        print(f"# ---- array {k}: trials {array.trials[0]}..{array.trials[-1]} ({len(array.trials)}) ----")
        print(script)
    for trial, config in zip(p.trials, p.configs):  # type: ignore[attr-defined]
        print(f"# ---- trial {trial.index}: {' '.join(trial.overrides)} -> {trial.run_dir} ----")
        print(frozen_yaml(config), end="")  # what config.yaml will hold
        if config["script"]["cmd"]:
            import shlex

            from hpc_train.script import checkpoint_path, command

            print(f"# every rank runs: {shlex.join(command(config, trial.run_dir, resuming=False))}")
            if config["script"]["resume_args"]:
                print(
                    f"# once {checkpoint_path(config, trial.run_dir)} exists: "
                    f"{shlex.join(command(config, trial.run_dir, resuming=True))}"
                )
    why, sweep = p.unvalidated, len(p.trials) > 1  # type: ignore[attr-defined]
    if why:
        print(
            f"# NOT validated against the live cluster: {why}. Unchecked: partition and its limits, account, qos, "
            f"constraint, reservation, nodelist/exclude, sbatch --test-only"
            f"{'; MaxArraySize taken as 1001' if sweep else ''}"
        )
    for note in dict.fromkeys(p.unchecked):  # type: ignore[attr-defined]
        print(f"# NOT validated: {note}")
    print(f"# dry run: {len(p.trials)} trial(s) in {len(p.arrays)} sbatch call(s); nothing written or queued")  # type: ignore[attr-defined]


def _print_table(p: object) -> None:
    from rich.table import Table

    from hpc_train.status import console

    trials = p.trials  # type: ignore[attr-defined]
    local = p.runs[0].cluster.executor == "local"  # type: ignore[attr-defined]
    how = "run here by the local executor" if local else f"queued in {len(p.arrays)} sbatch call(s)"  # type: ignore[attr-defined]
    table = Table(title=f"{len(trials)} trial(s) {how}")
    for col in ("trial", "overrides", "job id", "run directory"):
        table.add_column(col)
    shown = trials if len(trials) <= 20 else trials[:10] + trials[-10:]
    for t in shown:
        if len(trials) > 20 and t is trials[-10]:
            table.add_row("...", f"{len(trials) - 20} more in sweep.json", "", "")
        table.add_row(str(t.index), " ".join(t.overrides), t.job_id or "-", t.run_dir)
    console().print(table)


def _init(args: argparse.Namespace) -> int:
    import os
    import shutil

    from hpc_train.config import CONF_DIR

    target = Path(args.dir) / "conf"
    if Path(args.dir).exists() and not Path(args.dir).is_dir():
        raise ValueError(
            f"{args.dir} is a file, not a folder; give the folder to hold conf/ (default: this one), "
            f"e.g. hpc-train init {Path(args.dir).parent}"
        )
    if target.is_symlink() and not target.exists():
        raise ValueError(
            f"{target} is a symlink to {os.readlink(target)}, which does not exist; remove it (rm "
            f"{target}) or create what it points to, then run hpc-train init again"
        )
    if target.exists():
        raise ValueError(
            f"{target} exists already; init never overwrites a config. Edit it, or move it away "
            f"and run hpc-train init again for a fresh copy"
        )
    shutil.copytree(CONF_DIR, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    groups = sorted(d.name for d in target.iterdir() if d.is_dir())
    where = "" if Path(args.dir).resolve() == Path.cwd() else f"cd {args.dir} && "
    print(
        f"wrote {target}/: config.yaml and the groups {', '.join(groups)}\n"
        f"hpc-train submit run in {Path(args.dir).resolve()} now composes from it. Describe your cluster in "
        f"{target}/cluster/example_site.yaml, then: {where}hpc-train submit --cfg job cluster=example_site"
    )
    return 0


def _submit(args: argparse.Namespace) -> int:
    from hpc_train.config import ConfigSource, compose, expand_sweep, explain

    try:
        source = ConfigSource.find(args.config_path, args.config_name, args.config_dir)
        if args.cfg:
            from omegaconf import OmegaConf

            from hpc_train.config import check_environment, to_run_config

            expand_sweep(args.overrides, multirun=False)  # a sweep value: say "add -m" (Hydra: "Ambiguous value")
            cfg = compose(args.overrides, source)
            check_environment(to_run_config(cfg))
            print(OmegaConf.to_yaml(cfg, resolve=True), end="")
            return 0
        from hpc_train import pipeline, plan
        from hpc_train.metrics import lead_warning

        after = pipeline.parse(args.after)  # each --after RUN[:ok|any], comma-separated too
        p = plan.plan(
            args.overrides, args.multirun, args.sweep_dir, args.max_parallel, source, dry_run=args.dry_run, after=after
        )
        print(f"hpc-train submit: config {source.dir / source.name}.yaml", file=sys.stderr)  # ./conf, -cp or shipped
        slurm_run = p.runs[0].cluster.executor == "slurm"
        if not slurm_run:  # trials run here, one after another, for hours: collect as usual (see main)
            import gc

            gc.enable()
        from hpc_train.deadlines import reserve_warning

        warnings = {reserve_warning(r.cluster) for r in p.runs}  # a sweep may vary signal_lead_s
        warnings.add(slurm_run and lead_warning(plan.previous_runs(p), p.runs[0].cluster.signal_lead_s) or "")
        for warning in sorted(w for w in warnings if w):
            print(f"hpc-train submit: warning: {warning}", file=sys.stderr)
        if p.avoided:  # cluster.avoid_bad_nodes: in the script's --exclude and the frozen cluster.exclude
            print(f"hpc-train submit: {p.avoided}", file=sys.stderr)
        # the expected goodput (each partition's, for a sweep over them), and what would change it most
        forecasts = [p.forecast, *(r["forecast"] for r in p.elsewhere.values())]
        if args.dry_run:
            _print_dry_run(p)
            for line in (line for lines in forecasts for line in lines):  # docs/goodput.md
                print(f"# {line}")
            return 0
        for lines in (lines for lines in forecasts if lines):  # one line each; --dry-run gives the rest
            print(f"hpc-train submit: {lines[0]}", file=sys.stderr)
        from hpc_train import submit

        local_sweep = args.multirun and p.runs[0].cluster.executor == "local"
        if local_sweep:  # minutes of silence otherwise
            print(
                f"hpc-train submit: {len(p.trials)} trial(s) run here one after another (the local executor); "
                f"follow one with hpc-train logs -f {_shown(p.target)}/0000",
                file=sys.stderr,
                flush=True,
            )
        with _progress(enabled=args.multirun, local=local_sweep) as progress:
            p, jobs = submit.submit(p, args.overrides, args.multirun, args.sweep_dir, args.max_parallel, progress)
    except Exception as e:
        if not _is_user_error(e):
            raise
        _error("submit", explain(e))
        return 2
    if args.multirun:
        _print_table(p)
        print(f"sweep directory {p.target}" + (f"\nits trials run {p.waits_for}" if p.waits_for else ""))
        return 0
    print(f"submitted job {p.trials[0].job_id}; run directory {p.target}")
    if p.waits_for:
        print(f"it runs {p.waits_for}")
    if type(jobs[0]).__name__ != "LocalJob" or args.no_wait:
        return 0
    return _wait_local(jobs[0], Path(p.target))


def _shown(path: Path) -> str:
    """A path as the user would type it: relative when under the current folder."""
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _wait_local(job: object, run_dir: Path) -> int:
    """Local executor: this machine is the cluster, so wait and say how the run ended. Ctrl-C detaches:
    submit started the controller and its ranks ignoring SIGINT (and SIGHUP), so a Ctrl-C at the
    terminal, which reaches the whole foreground process group, stops only this wait."""
    run = _shown(run_dir)
    print(f"waiting for {run_dir.name} to finish (Ctrl-C detaches; the run goes on)", flush=True)
    try:
        job.wait()  # type: ignore[attr-defined]  # submitit polls the controller process once a second
    except KeyboardInterrupt:
        print(
            f"\ndetached: {run_dir.name} keeps running on this machine\n"
            f"  hpc-train logs {run} -f     # follow rank 0's log; returns when the run ends\n"
            f"  hpc-train status {run}      # state, step, goodput\n"
            f"  hpc-train cancel {run}      # stop it (it saves a checkpoint first)"
        )
        return 130  # the shell's code for "ended by Ctrl-C"
    code, text = _local_outcome(run_dir)
    print(text, file=sys.stdout if code == 0 else sys.stderr)
    return code


def _local_outcome(run_dir: Path) -> tuple[int, str]:
    """Exit code and the sentence for a local run whose controller exited: finished, cancelled or failed."""
    import json

    from hpc_train import journal
    from hpc_train.paths import RunPaths

    run, paths, events = _shown(run_dir), RunPaths(run_dir), journal.read(run_dir)
    if paths.summary.exists():
        summary = json.loads(paths.summary.read_text())
        loss = summary.get("final_loss")  # a script without script_helper.log reports none
        steps = f": {summary['final_step']} steps" if summary.get("final_step") is not None else ""
        return 0, (
            f"finished {run_dir.name}{steps}"
            f"{f', final loss {loss:.4f}' if isinstance(loss, (int, float)) else ''}; "
            f"the run lives in {run}\n"
            f"next: hpc-train report {run}   # where the time went, and {run}/report.png\n"
            f"      hpc-train logs {run}     # rank 0's log"
        )
    stopped, fails = journal.stopped(events), journal.failures(events)
    if stopped and journal.cancelled(events):
        return 1, f"{run_dir.name} was cancelled at step {stopped['step']}: {stopped['reason']}"
    if not fails:
        return 1, (
            f"{run_dir.name} ended without finishing (no summary.json, no failure recorded); "
            f"see its log: hpc-train logs {run}"
        )
    last = [e for e in fails if e["restart"] == fails[-1]["restart"]][0]  # the last attempt's first failure
    rank = last.get("rank", 0)
    return 1, (
        f"{run_dir.name} failed: {last['error']} (rank {rank}, attempt {last['restart']})"
        + (f"\nnot requeued: {stopped['reason']}" if stopped else "")
        + f"\nthe traceback: hpc-train logs {run} --rank {rank}"
    )


def _resume(args: argparse.Namespace) -> int:
    """A stopped, cancelled or failed run again, same run directory and config, from its last checkpoint."""
    from hpc_train import resume

    budgets = {
        k: v
        for k in ("max_preemptions", "max_time_limit_requeues", "max_failures", "max_excluded_nodes")
        if (v := getattr(args, k)) is not None
    }
    job, lines = resume.resume(Path(args.run), budgets, args.reason, args.allow_data_changed)
    print("\n".join(lines))
    if type(job).__name__ != "LocalJob" or args.no_wait:
        print(f"follow it: hpc-train status {args.run}")
        return 0
    return _wait_local(job, Path(args.run))  # local executor: wait and say how it ended, as submit does


def _runs(path: str, unreadable_ok: bool = False) -> list:
    from hpc_train.runs import find_runs

    runs = find_runs(Path(path))
    if not runs:
        raise ValueError(f"no runs under {path}")
    denied = [r.unreadable for r in runs if r.unreadable]
    if denied and not unreadable_ok:  # status shows them as rows instead
        raise ValueError(denied[0])
    return runs


def _status(args: argparse.Namespace) -> int:
    import json
    import time

    from hpc_train import status

    if args.prometheus:  # the files only, no Slurm query: cron may run it every minute
        from hpc_train import prometheus

        # one series per run: runs/latest -> demo-3 is demo-3 again
        runs = list({r.run_dir.resolve(): r for r in _runs(args.path, unreadable_ok=True) if not r.unreadable}.values())
        print(
            prometheus.render([(prometheus.labels(r.run_dir, r.job_id), prometheus.values(r.run_dir)) for r in runs]),
            end="",
        )
        return 0
    if args.path == "runs" and not (Path("runs").is_dir() and any(Path("runs").iterdir())):
        said = "no runs here yet (./runs is empty): hpc-train submit starts one; hpc-train status PATH reads others"
        print("[]" if args.json else said)
        return 0
    while True:
        rows = status.status_rows(_runs(args.path, unreadable_ok=True))
        if args.json:
            print(json.dumps(rows, indent=1))
        else:
            if args.watch:
                print("\033[2J\033[H", end="")  # clear the screen between refreshes
            status.print_status(rows, args.wide, args.every)
        if not args.watch:
            return 0
        time.sleep(args.watch)


def _logs(args: argparse.Namespace) -> int:
    from hpc_train import logs

    runs = _runs(args.run)
    if len(runs) != 1:
        raise ValueError(f"{args.run} holds {len(runs)} runs; name one, e.g. {runs[0].run_dir}")
    run = runs[0]
    out = logs.log_path(run, args.rank)
    err = logs.stderr_path(out)
    out_bytes, err_bytes = out.read_bytes(), err.read_bytes() if err.exists() else b""
    out_text, err_text = out_bytes.decode(errors="replace"), err_bytes.decode(errors="replace")
    labels = (f"---- rank {args.rank} stdout: {out} ----", f"---- rank {args.rank} stderr: {err} ----")
    print(logs.attempt_section(out_text, args.attempt), end="")
    errors = logs.attempt_section(err_text, args.attempt)  # job.py starts each attempt there with the header too
    if logs.has_output(errors):  # tracebacks, warnings, stack dumps: after the log, labelled
        print(labels[1])
        print(errors, end="" if errors.endswith("\n") else "\n")
    if args.follow:  # then both streams as they grow, labelled at each switch; returns when the run ends
        streams, unknown_since = [(out, len(out_bytes), labels[0]), (err, len(err_bytes), labels[1])], []
        logs.follow(
            streams,
            labels[1] if logs.has_output(errors) else labels[0],
            lambda: logs.run_ended(run, unknown_since),
            check_every_s=10.0 if run.executor == "slurm" else 0.5,
        )  # slurm.job_states: at most once per 10 s
    return 0


def _cancel(args: argparse.Namespace) -> int:
    from hpc_train import runs

    ids, dependents = runs.cancel(_runs(args.path))
    print(f"cancelled {len(ids)} job(s): {' '.join(ids)}")
    for line in dependents:  # queued after a cancelled run (submit --after)
        print(line)
    return 0


def _chaos(args: argparse.Namespace) -> int:
    from hpc_train import drills

    for run in _runs(args.run):
        print(f"{run.label}: {drills.chaos(run, args.action, args.rank, args.seconds, args.node)}")
    return 0


def _report(args: argparse.Namespace) -> int:
    from hpc_train import intervals, journal, report
    from hpc_train.paths import RunPaths
    from hpc_train.status import console as status_console

    for run in _runs(args.run):
        png = Path(args.png) if args.png else run.run_dir / "report.png"
        parts, atts, made = report.report(run, png)
        console = status_console(args.wide)
        console.print(_goodput_table(run.label, parts))
        console.print(_attempts_table(atts, report.cluster_nodes(run.run_dir), args.wide))
        events = journal.read(run.run_dir)
        if slow := journal.straggler_episodes(events):
            console.print(_stragglers_table(slow))
        if (chosen := journal.last(events, journal.INTERVAL)) is not None:  # checkpoint.every_steps=auto
            print(f"checkpoint interval (auto, at step {chosen['step']}): {chosen.get('why', '')}")
        said = intervals.forecast_said(RunPaths(run.run_dir).history, run.run_dir)
        if said:  # what submit expected, a share of wall time (queue waits in it), beside the same for the run
            wall = parts["allocated"] + parts.get("queue_wait", 0.0)
            done = report.share(parts["committed"] / wall if wall > 0 else 0.0)
            print(f"at submit, {said[0]}; this run: goodput {done} of its wall time so far (queue waits in it)")
        for line in report.profile_lines(run.run_dir):  # profile.*: the traces, and how to open them
            print(line)
        print(f"picture: {made}" if made.endswith(".png") else made)
    return 0


def _goodput_table(label: str, parts: dict[str, float]) -> Any:
    from rich.table import Table

    from hpc_train.report import share

    table = Table(title=f"{label}: goodput {share(parts['goodput'])} of {parts['allocated']:.1f} s allocated")
    for col in ("part", "seconds", "share"):
        table.add_column(col)
    for key, what in (
        ("committed", "committed training"),
        ("lost", "work lost (recomputed)"),
        ("stall", "checkpoint stall"),
        ("overhead", "restart overhead (launch -> training)"),
        *[("unknown", "unknown (a script's attempt: no steps, no checkpoint file)")] * bool(parts["unknown"]),
    ):
        table.add_row(
            what, f"{parts[key]:.1f}", f"{parts[key] / parts['allocated']:.1%}" if parts["allocated"] else "-"
        )
    table.add_row("queue wait (not allocated)", f"{parts['queue_wait']:.1f}", "")
    return table


def _attempts_table(atts: list[dict[str, Any]], nodes: Any, wide: bool = True) -> Any:
    """One row per attempt; its start-up phase by phase only when wide (a 100-column terminal has no room)."""
    from rich.table import Table

    from hpc_train import report

    attempts = Table(
        title="attempts (start-up: python imports rendezvous preflight setup verify load first-step, seconds)"
        if wide
        else "attempts (--wide: the start-up phase by phase)"
    )
    batches = report.batch_text(atts)  # a column only when the global batch or accumulation changed
    for col in (
        "attempt",
        "job",
        "ranks",
        *(["batch"] if batches else []),
        "steps",
        "resumed from",
        "wall s",
        "start-up s",
        *(["start-up by phase"] if wide else []),
        "ended by",
        "signals",
    ):
        attempts.add_column(col, overflow="fold")
    for i, a in enumerate(atts):
        phases = " ".join(
            f"{a['phases_s'][k]:.1f}" if k in a["phases_s"] else "-"
            for k in ("python", "imports", "rendezvous", "preflight", "setup", "verify", "load", "first_step")
        )
        attempts.add_row(
            str(a["restart"]),
            str(a["job_id"]),
            report.size_text(a),
            *([batches[i]] if batches else []),
            f"{a['start_step']}->{a['reached_step']}",
            a["resumed_from"] or "-",
            f"{a['end'] - a['launched']:.1f}",
            f"{(a['start'] or a['end']) - a['launched']:.1f}",
            *([phases] if wide else []),
            report.ended_text(a, nodes),
            ",".join(a["signals"]),
        )
    return attempts


def _stragglers_table(slow: list[dict[str, Any]]) -> Any:
    from rich.table import Table

    named = Table(title="stragglers (own = compute + data per step; comm = waiting in collectives)")
    for col in ("attempt", "named at step", "rank", "node", "own ms", "median ms", "comm ms", "cleared at step"):
        named.add_column(col)
    for r in slow:
        named.add_row(
            str(r["attempt"]),
            str(r["step"]),
            str(r["rank"]),
            r["node"],
            f"{r['own_ms']:.1f}",
            f"{r['median_ms']:.1f}",
            f"{r['comm_ms']:.1f}",
            "-" if r["cleared_step"] is None else str(r["cleared_step"]),
        )
    return named


def _nodes(args: argparse.Namespace) -> int:
    import json
    import time

    from hpc_train import reputation
    from hpc_train.status import console

    root = Path(args.path)
    if args.path == "runs" and not root.exists():
        print("[]" if args.json else "no runs here yet (no ./runs): hpc-train nodes PATH reads the runs under PATH")
        return 0
    if not root.is_dir():
        raise ValueError(
            f"{args.path} is not a folder; give the folder of your runs (out_dir), e.g. hpc-train nodes runs"
        )
    now = time.time()
    record = reputation.harvest(root, now)
    rows = reputation.rows(record, now, root)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    if rows:
        console().print(reputation.table(rows))
    else:
        print(f"no node has a verdict in the runs under {args.path}")
    for line in [*reputation.reasons(rows), *reputation.notes(record, root)]:
        print(line)
    return 0


def _results(args: argparse.Namespace) -> int:
    from hpc_train import status

    path = Path(args.sweep_dir)
    rows = status.sort_results(status.results_rows(path), args.sort, args.reverse)
    title = f"{path.name}: {len(rows)} trial(s), by {args.sort}{' (highest first)' if args.reverse else ''}"
    fmt = "json" if args.json else "csv" if args.csv else "table"
    status.print_results(rows, title, fmt, args.sort, args.wide, args.every)
    return 0


def _prepare_data(args: argparse.Namespace) -> int:
    from hpc_train import data

    meta = data.prepare(
        [Path(p) for p in args.inputs], Path(args.out), args.shard_tokens, args.tokenizer, args.val_fraction
    )
    held_out = f" + {meta['val_tokens']:,} held out for evaluation" if meta.get("val_shards") else ""
    print(
        f"{meta['tokens']:,} tokens{held_out} from {meta['documents']} file(s) in {len(meta['shards'])} shard(s) "
        f"under {args.out} ({meta['tokenizer']}, vocab {meta['vocab_size']:,}, {meta['dtype']})\n"
        f"train on them: hpc-train submit data=tokens data.path={args.out}"
        f"{' train.eval_every_steps=100' if held_out else ''}"
    )
    return 0


class _progress:
    """A rich progress bar on stderr for sweeps being queued, silent for small ones; a line per trial of a local
    sweep, which runs them here."""

    def __init__(self, enabled: bool, local: bool = False) -> None:
        self.enabled, self.local, self.bar, self.task = enabled, local, None, None

    def __enter__(self):  # type: ignore[no-untyped-def]
        return self.update if self.enabled else None

    def update(self, done: int, total: int) -> None:
        if self.local:
            print(f"hpc-train submit: {done}/{total} trial(s) ended", file=sys.stderr, flush=True)
            return
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


class _Version(argparse.Action):
    def __call__(self, parser: argparse.ArgumentParser, *args: object) -> None:
        from hpc_train.provenance import describe

        print(describe())
        parser.exit()


def _parser(argv: list[str]) -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """Every command and its arguments (argparse), and each command's own parser by its name; `chaos` names its
    actions only when it is the command."""
    parser = argparse.ArgumentParser(
        prog="hpc-train", description=USAGE, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--version",
        action=_Version,
        nargs=0,
        help="print the version, where it is installed and its git commit, and exit",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _add_run_commands(sub)
    _add_reading_commands(sub)
    _add_chaos(sub, argv)
    return parser, sub.choices


def _add_run_commands(sub: Any) -> None:
    """The commands that write runs: init, submit, resume, prepare-data."""
    p = sub.add_parser("init", help="copy the starter configs into ./conf (or DIR/conf), where submit finds them")
    p.add_argument("dir", nargs="?", default=".", help="the folder to hold conf/ (default: this one)")
    p.set_defaults(func=_init)
    p = sub.add_parser("submit", help="compose a config, freeze run directories and submit")
    p.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. cluster=dev train.steps=200")
    p.add_argument("-m", "--multirun", action="store_true", help="expand sweeps (a=1,2 range() choice()) into trials")
    p.add_argument("--dry-run", action="store_true", help="print each array's batch script and each trial's config")
    p.add_argument("--sweep-dir", type=Path, help="an existing sweep directory: submit only its missing trials")
    p.add_argument("--max-parallel", type=int, help="at most this many tasks of an array run at once (%%N)")
    p.add_argument(
        "--after",
        action="append",
        default=[],
        metavar="RUN[:ok|any]",
        help="queue after this run or sweep (repeated, or comma-separated): :ok (default) once it finished, :any "
        "once it ended; {after.ckpt} in a script, checkpoint.init_from=RUN: its final checkpoint (docs/submitting.md)",
    )
    # Hydra's three flags, with Hydra's meaning (hydra/_internal/utils.py): -cp replaces the primary config
    # directory, -cn picks its file, -cd adds a directory searched after it.
    p.add_argument(
        "-cp",
        "--config-path",
        help="the primary config directory (default: ./conf if it holds "
        "config.yaml, else the package's; `hpc-train init` writes ./conf)",
    )
    p.add_argument("-cn", "--config-name", help="the primary config file in it, without .yaml (default: config)")
    p.add_argument(
        "-cd",
        "--config-dir",
        action="append",
        default=[],
        help="a directory searched after the primary one: add options (DIR/cluster/mysite.yaml) "
        "without copying the rest; may be repeated",
    )
    p.add_argument("--cfg", choices=["job"], help="print the composed config and exit")
    p.add_argument("--no-wait", action="store_true", help="local executor: return once the job started")
    p.set_defaults(func=_submit)
    p = sub.add_parser(
        "resume",
        help="start a stopped, cancelled or failed run again, from its last checkpoint",
        description="Same run directory, frozen config.yaml and events.jsonl; a new attempt (and job). "
        "Budget options are recorded in the `resume` event and apply over config.yaml.",
    )
    p.add_argument("run", help="the run directory (a sweep's trial: SWEEP/0003)")
    p.add_argument("--reason", default="", help="why, for events.jsonl (who is recorded anyway)")
    p.add_argument("--max-failures", type=int, help="set requeue.max_failures (failure requeues in a row)")
    p.add_argument("--max-preemptions", type=int, help="set requeue.max_preemptions (-1: unlimited)")
    p.add_argument("--max-time-limit-requeues", type=int, help="set requeue.max_time_limit_requeues")
    p.add_argument("--max-excluded-nodes", type=int, help="set requeue.max_excluded_nodes (sick nodes left out)")
    p.add_argument(
        "--allow-data-changed",
        action="store_true",
        help="resume on data other than the checkpoint's (data.allow_changed=true for this resume's attempts)",
    )
    p.add_argument("--no-wait", action="store_true", help="local executor: return once the job started")
    p.set_defaults(func=_resume)
    p = sub.add_parser("prepare-data", help="local text files -> token shards (bytes, BPE) for data=tokens")
    p.add_argument("inputs", nargs="+", help="text files, or directories searched recursively")
    p.add_argument("--out", required=True, help="a new directory for shard_*.bin and meta.json")
    p.add_argument("--shard-tokens", type=int, default=256 * 2**20, help="tokens per shard (default 256 Mi)")
    p.add_argument(
        "--tokenizer",
        default="bytes",
        help="bytes (default, vocab 256); bpe:VOCAB trains a byte-level "
        "BPE on the inputs; or a tokenizer.json (both need: pip install 'hpc_train[tokenizers]')",
    )
    p.add_argument(
        "--val-fraction",
        type=float,
        default=0.0,
        help="hold out this share of the tokens, the last ones, as val_*.bin for train.eval_every_steps",
    )
    p.set_defaults(func=_prepare_data)


def _glance_flags(p: argparse.ArgumentParser, every: str) -> None:
    """--all and --wide of status and results (the numbers are status.GLANCE_ROWS, RESULTS_FEW and WIDE_WIDTH:
    cli imports status only when a command runs)."""
    p.add_argument("--all", action="store_true", dest="every", help=every)
    p.add_argument("--wide", action="store_true", help="every column, 220 wide (default: the terminal's width)")


def _add_reading_commands(sub: Any) -> None:
    """The commands that read runs (and cancel): status, logs, cancel, report, results."""
    p = sub.add_parser("status", help="one row per run or trial: Slurm state, progress, goodput, warnings")
    p.add_argument("path", nargs="?", default="runs", help="a run, a sweep, or a folder of them (default: runs)")
    p.add_argument("--watch", type=float, nargs="?", const=5.0, help="refresh every N seconds (default 5)")
    p.add_argument("--json", action="store_true", help="every row as JSON, for scripts")
    _glance_flags(p, "every trial of a sweep (default: of more than 20, its counts and the trials that need a person)")
    p.add_argument(
        "--prometheus",
        action="store_true",
        help="Prometheus text format instead (every run under PATH), for node-exporter's textfile from cron",
    )
    p.set_defaults(func=_status)
    p = sub.add_parser("logs", help="the log of one rank and attempt of a run")
    p.add_argument("run", help="the run directory (a sweep's trial: SWEEP/0003)")
    p.add_argument("--rank", type=int, default=0, help="this rank's log, as placed (default: 0)")
    p.add_argument("--attempt", type=int, help="only this attempt (0 = first); default: all")
    p.add_argument(
        "-f", "--follow", action="store_true", help="keep printing what both streams append; returns when the run ends"
    )
    p.set_defaults(func=_logs)
    p = sub.add_parser("cancel", help="cancel exactly this run's or sweep's jobs")
    p.add_argument("path", help="a run, a sweep, or a folder of them: every job they recorded")
    p.set_defaults(func=_cancel)
    p = sub.add_parser("report", help="goodput breakdown across attempts, as a table and a PNG")
    p.add_argument("run", help="the run directory (a sweep's trial: SWEEP/0003)")
    p.add_argument("--png", help="where to write the picture (default: RUN/report.png)")
    p.add_argument("--wide", action="store_true", help="every column (start-up by phase), 220 wide")
    p.set_defaults(func=_report)
    p = sub.add_parser(
        "nodes", help="the nodes with a bad verdict in the runs under PATH: score, and whether submit leaves them out"
    )
    p.add_argument("path", nargs="?", default="runs", help="a folder of runs, a sweep or a run (default: runs)")
    p.add_argument("--json", action="store_true", help="every row as JSON, for scripts")
    p.set_defaults(func=_nodes)
    p = sub.add_parser("results", help="a sweep's trials side by side: overrides, state, loss, goodput; sorted")
    p.add_argument("sweep_dir", help="the sweep directory `submit -m` printed, e.g. runs/mix-1")
    p.add_argument(
        "--sort",
        default="final_loss",
        help="a column or an override key, e.g. goodput, train.lr (default: final_loss, lowest first)",
    )
    p.add_argument("--reverse", action="store_true", help="highest first")
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true", help="the rows as JSON, for scripts")
    fmt.add_argument("--csv", action="store_true", help="the rows as CSV, one column per override key")
    _glance_flags(p, "every trial (default: of more than 20, the 5 first and last)")
    p.set_defaults(func=_results)


def _add_chaos(sub: Any, argv: list[str]) -> None:
    # drills (with slurm, journal, paths) only for `chaos`, whose actions are all argparse needs from it: every
    # other command, `submit --dry-run` first, would pay ~15 ms to import it (~30 ms with no .pyc to read)
    if argv[:1] == ["chaos"]:
        from hpc_train.drills import CHAOS  # torch-free, no Slurm call
    else:
        CHAOS = {}
    p = sub.add_parser(
        "chaos",
        help="inject a fault into a running job (drills); recorded in events.jsonl",
        description="actions:\n" + "\n".join(f"  {a:22s} {w}" for a, (_, w) in CHAOS.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run", help="the running run's directory (a sweep's trial: SWEEP/0003)")
    p.add_argument("action", choices=list(CHAOS), help="the fault (listed above)")
    p.add_argument(
        "--rank", type=int, default=0, help="kill-rank, slow-rank: this rank; lose-node: the node of this rank"
    )
    p.add_argument(
        "--seconds",
        type=float,
        help="slow-storage: seconds added to each write (default 2); slow-rank (required): to each step, "
        "0 to 10 (0: off)",
    )
    p.add_argument("--node", default="", help="sick-node: this node (default: the node of --rank)")
    p.set_defaults(func=_chaos)


def main(argv: list[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    parser, commands = _parser(words)
    if words and not words[0].startswith("-") and words[0] not in commands:
        import difflib

        near = difflib.get_close_matches(words[0], list(commands), n=1)
        parser.error(
            f"no command {words[0]!r}"
            + (f"; did you mean hpc-train {near[0]}?" if near else "")
            + f" (the commands: {', '.join(commands)}; hpc-train COMMAND --help says more)"
        )
    script_cmd = None
    if words[:1] == ["submit"] and "--" in words:  # everything after -- is the command every rank runs
        script_cmd, words = words[words.index("--") + 1 :], words[: words.index("--")]
    args, extra = parser.parse_known_args(words)
    if extra and (args.command != "submit" or any(w.startswith("-") for w in extra)):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if extra:  # a submit's overrides after an option (`a=1 --after R b=2`): argparse takes only the first run of them
        args.overrides += extra
    if script_cmd is not None:
        from hpc_train.script import override

        try:
            args.overrides.append(override(script_cmd))
        except ValueError as e:
            _error("submit", e)
            return 2
    if argv is None and args.func is _submit:
        import gc

        # A sweep's plan is millions of acyclic dicts and dataclasses that live until the process exits: the
        # collector can free none of them, and walked them all at each full collection (a fifth of the CPU
        # of a 30,000-point sweep, more the larger it is). On again for a local run, which submit waits for.
        gc.disable()
    try:
        return _run(args)
    except KeyboardInterrupt:  # submit and resume hold Ctrl-C until a queued job's id is on disk
        print(
            f"\nhpc-train {args.command}: interrupted (Ctrl-C); a job queued before it is recorded in its run "
            f"directory: `hpc-train status` shows it, `hpc-train cancel RUN_DIR` removes it",
            file=sys.stderr,
        )
        return 130
    finally:
        if argv is None:  # the program itself, about to exit (not a caller's main([...]))
            import gc

            # The interpreter's collections at exit walk every object Hydra, OmegaConf and submitit made:
            # ~40 ms of a 0.35 s dry run, seconds after a 100,000-point sweep. Frozen, they are skipped;
            # the memory goes back with the process, and every atexit handler still runs.
            gc.freeze()


def _run(args: argparse.Namespace) -> int:
    if args.func is _submit:
        return args.func(args)
    try:
        return args.func(args)
    except Exception as e:
        if not _is_user_error(e):
            raise
        _error(args.command, e)
        return 2


def _error(command: str, message: object) -> None:
    """One error on stderr: one line into a pipe or a file (what a script greps stays whole), wrapped to the
    terminal's width on one (a sentence that names the value and the fix ran to 379 columns), words and paths
    kept whole."""
    text = f"hpc-train {command}: error: {message}"
    if sys.stderr.isatty():
        import shutil
        import textwrap

        width = shutil.get_terminal_size().columns
        lines = [
            textwrap.fill(line, width, subsequent_indent="  ", break_long_words=False, break_on_hyphens=False)
            for line in text.splitlines()
        ]
        text = "\n".join(lines)
    print(text, file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
