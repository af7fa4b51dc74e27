"""A seeded team storm on the dev cluster (issue 18): two people ("shells", two threads each running real
`hpc-train` commands as subprocesses, with seeded choices and pauses) work on ONE sweep at once while a
fault storm hits its trials; then the invariants that must hold whatever the interleaving.
tests/test_slurm_team.py runs a short one in CI; benchmarks/team_storm_bench.py a longer one.

    .venv/bin/python benchmarks/team_storm_bench.py --actions 40 --faults 12 --seed 7

What a shell does, one action at a time, with a pause of 0.5-4 s between:
    submit     shell A's first act: `hpc-train submit -m ... train.seed=1,2,3` (the sweep)
    resubmit   `hpc-train submit -m ... --sweep-dir SWEEP` (shell B's first act, as soon as the folder
               shows, racing A's lock)
    resume     `hpc-train resume SWEEP/000k` (refused with exit 2 while it runs, is queued, or is held)
    cancel     `hpc-train cancel SWEEP/000k`; cancel-sweep: `hpc-train cancel SWEEP`
    status     `hpc-train status SWEEP`
    hangup     a resume or resubmit sent SIGHUP (its process group) 0.05-0.8 s after it started
    race       two of these started at the same moment: resume+resume of one trial, resume+resubmit,
               resumes of two trials, cancel+resume of one trial
Faults, once a trial's running attempt committed a checkpoint since the last fault on it: `hpc-train chaos
TRIAL time-limit|requeue|batch-term`, or preempt (a `high` job on the trial's node). The storm's last act
resumes every trial cancelled (or ended without a word) until every trial finished or stopped with a
reason. The seed replays the choices; the interleaving is the machine's.

Invariants (check):
    one live job per trial   squeue of the sweep's job name, sampled every second: per trial, at most one
                             job queued or running; every job of that name belongs to a trial
    a refused job trains not a job with `lease_refused` has no `start` in that trial
    deletions by the owner   every `checkpoint_deleted` comes from the job of the trial's latest `start`
    budgets counted once     no two `start` (or `requeue`) events of one (job, attempt); attempts increase;
                             the requeues counted per reason = the distinct attempts requeued for it
    every trial ends         finished (summary.json), or `stopped` with a reason
    no traceback             every command's output free of "Traceback", exit code 0 or 2
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from conftest import HPC_TRAIN, final_state, read_events, run

from hpc_train import journal
from hpc_train.plan import job_name

TRIALS = 3
FAULTS = ("time-limit", "requeue", "batch-term", "preempt")
STEP_S = 0.1
BUSY = "is being submitted or resumed by another hpc-train command right now"
# What a shell picks, with weights: status and resume are what people type most.
ACTIONS = {"status": 3, "resume": 3, "cancel": 2, "resubmit": 1.5, "cancel-sweep": 0.5, "race": 2, "hangup": 1}
# A race: two commands started at once, on one trial (k) or two (k, j).
RACES = (("resume", "resume"), ("resume", "resubmit"), ("resume", "resume-other"), ("cancel", "resume"))


def sweep_args(out: Path, steps: int) -> list[str]:
    return [
        "-m",
        "cluster=dev",
        "cluster.partition=low",
        "cluster.nodes=1",
        "cluster.tasks_per_node=1",
        f"train.steps={steps}",
        f"train.min_step_time_s={STEP_S}",
        "checkpoint.every_steps=10",
        "checkpoint.keep_last=2",
        f"out_dir={out}",
        "name=team",
        "train.seed=" + ",".join(str(s + 1) for s in range(TRIALS)),
    ]


@dataclass
class Command:
    shell: str
    kind: str
    argv: list[str]
    rc: int
    out: str
    err: str
    t0: float
    t1: float


@dataclass
class TeamStorm:
    seed: int
    out: Path
    steps: int
    sweep_dir: Path | None = None
    commands: list[Command] = field(default_factory=list)
    faults: list[dict[str, Any]] = field(default_factory=list)  # fault, trial, job_id, time (skipped: no trial ready)
    samples: list[tuple[float, list[tuple[str, str]]]] = field(default_factory=list)  # squeue: (job id, state)
    plans: dict[str, list[str]] = field(default_factory=dict)  # each shell's seeded choices, for the record
    wall_s: float = 0.0
    unsettled: list[str] = field(default_factory=list)  # trials the final phase could not bring to an end
    finished_jobs: dict[str, str] = field(default_factory=dict)  # the job that finished each trial: its sacct state
    lock: threading.Lock = field(default_factory=threading.Lock)

    def trial(self, k: int) -> Path:
        assert self.sweep_dir is not None
        return self.sweep_dir / f"{k:04d}"


def _hpc(
    storm: TeamStorm, env: dict[str, str], shell: str, kind: str, *args: str, hangup_s: float | None = None
) -> Command:
    """`hpc-train ARGS`; hangup_s: SIGHUP to its process group that much later, as a closed terminal or a
    dropped ssh session sends it (to sbatch too, if it is running then)."""
    t0 = time.time()
    proc = subprocess.Popen(
        [HPC_TRAIN, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=hangup_s if hangup_s is not None else 300)
    except subprocess.TimeoutExpired:
        if hangup_s is None:
            raise
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGHUP)
        out, err = proc.communicate(timeout=300)
    cmd = Command(shell, kind, [*args], proc.returncode, out, err, t0, time.time())
    with storm.lock:
        storm.commands.append(cmd)
    return cmd


def _sweep_dir(out: Path) -> Path | None:
    found = sorted(out.glob("team-*"))
    return found[0] if found else None


def _shell(storm: TeamStorm, env: dict[str, str], name: str, rng: random.Random, actions: int) -> None:
    """One person's session: a first act, then `actions` seeded choices with seeded pauses."""
    plan = storm.plans.setdefault(name, [])
    args = sweep_args(storm.out, storm.steps)
    if name == "A":
        plan.append("submit")
        _hpc(storm, env, name, "submit", "submit", *args)
    deadline = time.monotonic() + 300
    while (sweep := _sweep_dir(storm.out)) is None:
        assert time.monotonic() < deadline, "shell A's submit made no sweep directory in 300 s"
        time.sleep(0.05)
    if name == "B":  # a teammate's retry as soon as the folder shows, while the first may be queueing
        time.sleep(rng.uniform(0, 1.0))
        plan.append("resubmit")
        _act(storm, env, name, "resubmit", sweep, 0)
    while not (sweep / "sweep.json").exists():  # B's retry may have taken the sweep over
        assert time.monotonic() < deadline, f"no {sweep}/sweep.json in 300 s"
        time.sleep(0.2)
    for _ in range(actions):
        time.sleep(rng.uniform(0.5, 4.0))
        kind = rng.choices(list(ACTIONS), weights=list(ACTIONS.values()))[0]
        k = rng.randrange(TRIALS)
        if kind == "hangup":  # a resume or resubmit whose terminal closes a moment after it started
            what, after_s = rng.choice(("resume", "resubmit")), rng.uniform(0.05, 0.8)
            plan.append(f"hangup {what} {k} after {after_s:.2f} s")
            trial = str(sweep / f"{k:04d}")
            argv = ["resume", trial] if what == "resume" else ["submit", *args, "--sweep-dir", str(sweep)]
            _hpc(storm, env, name, f"hangup-{what}", *argv, hangup_s=after_s)
            continue
        if kind != "race":
            plan.append(kind if kind in ("status", "resubmit", "cancel-sweep") else f"{kind} {k}")
            _act(storm, env, name, kind, sweep, k)
            continue
        # Two commands at the same moment (two terminals, or both people at once): the locks decide.
        pair = rng.choice(RACES)
        j = (k + rng.randrange(1, TRIALS)) % TRIALS if pair[1] == "resume-other" else k
        plan.append(f"race {pair[0]} {k} + {pair[1]} {j}")
        both = [
            threading.Thread(target=_act, args=(storm, env, name, pair[0], sweep, k)),
            threading.Thread(target=_act, args=(storm, env, name, pair[1], sweep, j)),
        ]
        for t in both:
            t.start()
        for t in both:
            t.join()


def _act(storm: TeamStorm, env: dict[str, str], shell: str, kind: str, sweep: Path, k: int) -> None:
    trial = str(sweep / f"{k:04d}")
    if kind == "status":
        _hpc(storm, env, shell, kind, "status", str(sweep))
    elif kind in ("resume", "resume-other"):
        _hpc(storm, env, shell, "resume", "resume", trial)
    elif kind == "cancel":
        _hpc(storm, env, shell, kind, "cancel", trial)
    elif kind == "cancel-sweep":
        _hpc(storm, env, shell, kind, "cancel", str(sweep))
    else:
        _hpc(storm, env, shell, kind, "submit", *sweep_args(storm.out, storm.steps), "--sweep-dir", str(sweep))


def _recorded_job(trial: Path) -> str:
    manifest = json.loads((trial.parent / "sweep.json").read_text())
    return next(t["job_id"] or "" for t in manifest["trials"] if Path(t["run_dir"]) == trial)


def _ready(storm: TeamStorm, k: int, after: float) -> dict | None:
    """Trial k's running attempt, once it committed a checkpoint after `after` and is the job the sweep
    records (what `hpc-train chaos` signals)."""
    trial = storm.trial(k)
    events = read_events(trial)
    starts = [e for e in events if e["event"] == journal.START]
    if not starts or (trial / "summary.json").exists():
        return None
    start = starts[-1]
    later = events[events.index(start) + 1 :]
    if any(e["event"] in (*journal.ENDS, journal.CANCEL) for e in later):
        return None
    if not any(e["event"] == journal.CHECKPOINT_COMMITTED and e["time"] > after for e in later):
        return None
    return start if _recorded_job(trial) == start["job_id"] else None


def _faults(storm: TeamStorm, env: dict[str, str], rng: random.Random, n: int, stop: threading.Event) -> None:
    last: dict[int, float] = {}
    for _ in range(n):
        if stop.wait(rng.uniform(3.0, 8.0)):
            return
        fault, order = rng.choice(FAULTS), rng.sample(range(TRIALS), TRIALS)
        found, deadline = None, time.monotonic() + 60
        while found is None and time.monotonic() < deadline and not stop.is_set():
            found = next(((k, s) for k in order if (s := _ready(storm, k, last.get(k, 0.0)))), None)
            if found is None:
                time.sleep(1.0)
        if found is None:
            storm.faults.append({"fault": fault, "trial": None, "time": time.time(), "skipped": True})
            continue
        k, start = found
        trial, t0 = storm.trial(k), time.time()
        if fault == "preempt":
            node = start["nodes"][0]
            proc = run(
                ["sbatch", "--parsable", "-p", "high", "-w", node, "-N", "1", "--exclusive"]
                + ["-o", "/dev/null", "--wrap", "sleep 2"],
                env=env,
            )
            assert proc.returncode == 0, proc.stderr
            journal.log(
                trial,
                journal.CHAOS,
                -1,
                start["job_id"],
                start["restart"],
                action=fault,
                injected=f"high job {proc.stdout.strip()} on {node}",
            )
            rc = 0
        else:
            rc = _hpc(storm, env, "faults", "chaos", "chaos", str(trial), fault).rc
        storm.faults.append(
            {"fault": fault, "trial": k, "job_id": start["job_id"], "attempt": start["restart"], "time": t0, "rc": rc}
        )
        last[k] = time.time()


def _sample(storm: TeamStorm, env: dict[str, str], stop: threading.Event) -> None:
    """squeue of the sweep's job name every second (every array task on its own line, -r)."""
    while not stop.is_set():
        if storm.sweep_dir is None and (found := _sweep_dir(storm.out)) is not None:
            storm.sweep_dir = found
        if storm.sweep_dir is not None:
            proc = run(["squeue", "-h", "-r", "-n", job_name(storm.sweep_dir), "-o", "%i %T"], env=env)
            if proc.returncode == 0:
                rows = [tuple(line.split()) for line in proc.stdout.splitlines() if line.strip()]
                storm.samples.append((time.time(), [(r[0], r[1]) for r in rows if len(r) == 2]))
        stop.wait(1.0)


def trial_jobs(sweep_dir: Path) -> dict[str, int]:
    """job id -> trial index: sweep.json's job_id and previous_job_ids, and every job id in each trial's
    journal (start, lease_refused, resume's new job, requeue, ...)."""
    owners: dict[str, int] = {}
    for t in json.loads((sweep_dir / "sweep.json").read_text())["trials"]:
        for j in [t["job_id"], *t.get("previous_job_ids", [])]:
            if j:
                owners[j] = t["index"]
        for e in read_events(Path(t["run_dir"])):
            if e.get("job_id"):
                owners.setdefault(str(e["job_id"]), t["index"])
    return owners


def _live(storm: TeamStorm, env: dict[str, str]) -> dict[int, list[str]]:
    assert storm.sweep_dir is not None
    proc = run(["squeue", "-h", "-r", "-n", job_name(storm.sweep_dir), "-o", "%i"], env=env)
    owners = trial_jobs(storm.sweep_dir)
    live: dict[int, list[str]] = {}
    for j in proc.stdout.split():
        live.setdefault(owners.get(j, -1), []).append(j)
    return live


def _settle(storm: TeamStorm, env: dict[str, str], timeout_s: float) -> None:
    """The storm's last act: resume every trial cancelled or ended without a word, until every trial
    finished or stopped with a reason and no job of the sweep is left."""
    deadline = time.monotonic() + timeout_s
    last: dict[int, str] = {}  # each trial's last answer to a resume here: why a trial did not settle
    live: dict[int, list[str]] = {}
    while time.monotonic() < deadline:
        live, open_ = _live(storm, env), []
        for k in range(TRIALS):
            trial = storm.trial(k)
            events = journal.read(trial)
            if (trial / "summary.json").exists() and not live.get(k):
                continue
            if live.get(k):
                open_.append(k)
            elif journal.cancelled(events) or not journal.stopped(events):
                open_.append(k)
                answer = _hpc(storm, env, "final", "resume", "resume", str(trial))
                last[k] = f"the last resume exited {answer.rc}: {(answer.err or answer.out).strip()[-600:]}"
        if not open_ and not live:
            return
        time.sleep(3.0)
    storm.unsettled = [
        f"{storm.trial(k)} ({last.get(k, 'never resumed here')}; squeue: {live.get(k, [])}; its last events: "
        + "; ".join(f"{e['event']} job {e['job_id']} attempt {e['restart']}" for e in read_events(storm.trial(k))[-6:])
        + ")"
        for k in range(TRIALS)
        if not (storm.trial(k) / "summary.json").exists()
    ]


def _finished_jobs(storm: TeamStorm, env: dict[str, str]) -> dict[str, str]:
    """Each finished trial's finishing job (its `finish` event's) and sacct's state of it once it ended."""
    jobs = [journal.named(journal.read(storm.trial(k)), journal.FINISH) for k in range(TRIALS)]
    return {f[-1]["job_id"]: final_state(f[-1]["job_id"], env) for f in jobs if f}


def run_storm(
    env: dict[str, str],
    out: Path,
    seed: int,
    actions: int = 12,
    faults: int = 4,
    steps: int = 300,
    settle_s: float = 300,
    say: Any = print,
) -> TeamStorm:
    say(f"team storm seed {seed}: {actions} actions per shell, {faults} faults, {TRIALS} trials of {steps} steps")
    storm = TeamStorm(seed, out, steps)
    rng = random.Random(seed)
    shell_rngs = {name: random.Random(rng.random()) for name in ("A", "B")}
    fault_rng = random.Random(rng.random())
    stop, t0 = threading.Event(), time.monotonic()
    sampler = threading.Thread(target=_sample, args=(storm, env, stop), daemon=True)
    sampler.start()
    errors: list[BaseException] = []

    def guarded(fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except BaseException as e:  # reported by the caller, after the other threads ended
            errors.append(e)
            stop.set()

    shells = [threading.Thread(target=guarded, args=(_shell, storm, env, n, r, actions)) for n, r in shell_rngs.items()]
    for s in shells:
        s.start()
    while storm.sweep_dir is None and any(s.is_alive() for s in shells):
        time.sleep(0.2)
    storm_faults = threading.Thread(target=guarded, args=(_faults, storm, env, fault_rng, faults, stop))
    storm_faults.start()
    for s in shells:
        s.join()
    storm_faults.join()
    if errors:
        stop.set()
        sampler.join()
        raise errors[0]
    say(f"team storm seed {seed}: shells done after {time.monotonic() - t0:.0f} s; settling")
    _settle(storm, env, settle_s)
    stop.set()
    sampler.join()
    storm.wall_s = time.monotonic() - t0
    storm.finished_jobs = _finished_jobs(storm, env)
    return storm


def check(storm: TeamStorm) -> list[str]:
    """What must hold after any team storm; returns the violations (empty when all hold)."""
    bad: list[str] = []
    if storm.sweep_dir is None:
        return ["no sweep directory was made"]
    owners = trial_jobs(storm.sweep_dir)
    for when, rows in storm.samples:
        per_trial: dict[int, set[str]] = {}
        for job, state in rows:
            if job not in owners:
                bad.append(f"{time.strftime('%X', time.localtime(when))}: job {job} ({state}) belongs to no trial")
                continue
            per_trial.setdefault(owners[job], set()).add(job)
        bad += [
            f"{time.strftime('%X', time.localtime(when))}: trial {k} has {len(jobs)} live jobs {sorted(jobs)}"
            for k, jobs in per_trial.items()
            if len(jobs) > 1
        ]
    for k in range(TRIALS):
        trial = storm.trial(k)
        events = read_events(trial)
        label = f"trial {k}"
        starts = [e for e in events if e["event"] == journal.START]
        refused = {e["job_id"] for e in events if e["event"] == journal.LEASE_REFUSED}
        bad += [f"{label}: job {j} was refused the lease but started" for j in refused & {s["job_id"] for s in starts}]
        latest: dict | None = None
        for e in events:
            if e["event"] == journal.START:
                latest = e
            elif e["event"] == journal.CHECKPOINT_DELETED and (latest is None or latest["job_id"] != e["job_id"]):
                owner = latest["job_id"] if latest else "none"
                bad.append(f"{label}: job {e['job_id']} deleted step {e['step']} while job {owner} owned the run")
        for name in (journal.START, journal.REQUEUE):
            seen = Counter((e["job_id"], e["restart"]) for e in events if e["event"] == name)
            bad += [f"{label}: {n} `{name}` events of job {j} attempt {r}" for (j, r), n in seen.items() if n > 1]
        restarts = [s["restart"] for s in starts]
        if restarts != sorted(set(restarts)):
            bad.append(f"{label}: attempts started out of order or twice: {restarts}")
        for reason in journal.BUDGET_KEYS:
            attempts = {
                (e["job_id"], e["restart"])
                for e in events
                if e["event"] == journal.REQUEUE and e.get("reason") == reason and e.get("by") != "slurm"
            }
            if journal.requeues_counted(events, reason) != len(attempts):
                bad.append(
                    f"{label}: {journal.requeues_counted(events, reason)} {reason} requeues counted for "
                    f"{len(attempts)} attempts"
                )
        if not (trial / "summary.json").exists() and not (journal.stopped(events) and not journal.cancelled(events)):
            bad.append(f"{label} neither finished nor stopped with a reason: {journal.stop_reason(events)}")
    for c in storm.commands:
        hung_up = c.kind.startswith("hangup") and c.rc == -signal.SIGHUP
        if "Traceback" in c.out + c.err or not (c.rc in (0, 2) or hung_up):
            bad.append(f"shell {c.shell}: hpc-train {' '.join(c.argv[:3])} exited {c.rc}: {(c.err or c.out)[-400:]}")
    bad += [f"not settled: {t}" for t in storm.unsettled]
    bad += [
        f"job {j} finished its trial but ended {s or 'unknown'} in sacct"
        for j, s in storm.finished_jobs.items()
        if s != "COMPLETED"
    ]
    return bad


def figures(storm: TeamStorm) -> dict[str, Any]:
    """Commands run and refused per kind, lease refusals, faults, attempts, live-job samples, wall time."""
    events = {k: read_events(storm.trial(k)) for k in range(TRIALS)} if storm.sweep_dir else {}
    per = lambda name: sum(1 for ev in events.values() for e in ev if e["event"] == name)  # noqa: E731
    owners = trial_jobs(storm.sweep_dir) if storm.sweep_dir else {}
    most = max(
        (max(Counter(owners.get(j, -1) for j, _ in rows).values(), default=0) for _, rows in storm.samples), default=0
    )
    return {
        "commands": dict(Counter(c.kind for c in storm.commands)),
        "refused": dict(Counter(c.kind for c in storm.commands if c.rc == 2)),
        "command_s_max": {
            k: round(max(c.t1 - c.t0 for c in storm.commands if c.kind == k), 1)
            for k in {c.kind for c in storm.commands}
        },
        "refused_busy": sum(1 for c in storm.commands if BUSY in c.err),
        "lease_refused": per(journal.LEASE_REFUSED),
        "faults": dict(Counter(f["fault"] for f in storm.faults if not f.get("skipped"))),
        "faults_skipped": sum(1 for f in storm.faults if f.get("skipped")),
        "attempts": per(journal.START),
        "requeues": per(journal.REQUEUE),
        "checkpoints_deleted": per(journal.CHECKPOINT_DELETED),
        "finished": sum(1 for k in range(TRIALS) if storm.sweep_dir and (storm.trial(k) / "summary.json").exists()),
        "squeue_samples": len(storm.samples),
        "most_live_jobs_per_trial": most,
        "wall_s": round(storm.wall_s, 1),
    }
