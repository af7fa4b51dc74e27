"""A teammate in the same project folder: what we create is ours alone (0700 folders, or 0750 with
share_with_group, whatever the umask), and no pickle another user owns or could have replaced is ever
loaded (DCP's .metadata, submitit's job pickle), nor a planted symlink followed. This machine runs the
tests as root: files of "another user" are chowned to nobody (65534)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pickle
import shutil
import signal
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from conftest import names, read_events, submit, wait_until

from hpc_train import submit as submit_mod
from hpc_train.checkpoint import MARKER, Saver, TrainState, step_dir
from hpc_train.config import CheckpointConfig
from hpc_train.paths import make_dir, untrusted
from hpc_train.preempt import Unrecoverable

NOBODY = 65534


@pytest.fixture(scope="module", autouse=True)
def one_rank_group() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@contextlib.contextmanager
def umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def make_state(seed: int = 0) -> TrainState:
    torch.manual_seed(seed)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    return TrainState(model, opt)


def make_saver(run_dir: Path, events: list, share: bool = False, **cfg: Any) -> Saver:
    def event(name: str, step: int, **fields: Any) -> None:
        events.append({"event": name, "step": step, **fields})

    return Saver(
        run_dir / "checkpoints", CheckpointConfig(**cfg), run_dir / "drills", event, 0.0, share_with_group=share
    )


class Plant:
    """A pickle whose loading creates `marker`: the teammate's code, run as whoever unpickles it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.marker), "w"))


def plant_step(source: Path, folder: Path, marker: Path) -> None:
    """A copy of `source` whose .metadata is a planted pickle, with a COMMITTED whose checksums match."""
    shutil.copytree(source, folder)
    (folder / ".metadata").write_bytes(pickle.dumps(Plant(marker)))
    manifest = json.loads((folder / MARKER).read_text())
    for name, entry in manifest["files"].items():
        data = (folder / name).read_bytes()
        entry.update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    (folder / MARKER).write_text(json.dumps(manifest))


def chown_tree(folder: Path, uid: int) -> None:
    for p in [folder, *folder.rglob("*")]:
        os.chown(p, uid, uid)


def test_folders_and_files_are_ours_alone_whatever_the_umask(tmp_path: Path) -> None:
    """umask 002 (a team's usual): before, every run folder, checkpoints/ and step folder was 0775 and
    DCP's files 0664, so a group member could plant or change a checkpoint."""
    with umask(0o002):
        run_dir = submit_mod.claim_dir(tmp_path / "runs" / "demo-1")
        submitit = submit_mod._submitit_dir(run_dir / "submitit", private=False, mode=0o700)
        submit_mod._freeze(run_dir, {"a": 1}, False, 0o700, "{}\n")
        saver = make_saver(run_dir, [])
        saver.save(make_state(), "final", background=False)
        shared = make_saver(tmp_path / "shared", [], share=True)
        shared.save(make_state(), "final", background=False)
    step = step_dir(run_dir / "checkpoints", 0)
    assert [mode(p) for p in (run_dir, submitit, run_dir / "checkpoints", step)] == [0o700] * 4
    assert {p.name: mode(p) for p in step.iterdir()} == {
        ".metadata": 0o600,
        "__0_0.distcp": 0o600,
        "rank_00000.pt": 0o600,
        MARKER: 0o644,  # written whole (write_atomic): never group-writable, read as far as the folders let
    }
    assert mode(run_dir / "config.yaml") == 0o644
    shared_step = step_dir(tmp_path / "shared" / "checkpoints", 0)
    assert [mode(tmp_path / "shared" / "checkpoints"), mode(shared_step)] == [0o750, 0o750]
    assert {mode(p) for p in shared_step.iterdir() if p.name != MARKER} == {0o640}
    with umask(0o077):  # mkdir's mode is masked by the umask: 0750 is asked for again
        assert mode(make_dir(tmp_path / "g", 0o750)) == 0o750
        strict = make_saver(tmp_path / "strict", [], share=True)
        strict.save(make_state(), "final", background=False)
    # shared under umask 077: the marker too is the group's to read (0600 made a teammate's init_from fail)
    assert {mode(p) for p in step_dir(tmp_path / "strict" / "checkpoints", 0).iterdir()} == {0o640}
    # a stop save as the periodic and final ones (it was started without share_with_group: 0700 and 0600)
    with umask(0o077):
        stopping, state = make_saver(tmp_path / "stopped", [], share=True), make_state()
        state.step = 3
        stopping.stop(state, 60.0, lambda ok: ok)
    stopped = step_dir(tmp_path / "stopped" / "checkpoints", 3)
    assert mode(stopped) == 0o750 and {mode(p) for p in stopped.iterdir()} == {0o640}


@pytest.mark.parametrize("how", ["foreign folder", "foreign metadata", "group-writable folder", "writable metadata"])
def test_a_planted_step_folder_is_skipped_and_never_unpickled(tmp_path: Path, how: str) -> None:
    events: list = []
    saver = make_saver(tmp_path, events)
    state = make_state()
    state.step = 10
    saver.save(state, "periodic", background=False)
    planted, marker = step_dir(tmp_path / "checkpoints", 20), tmp_path / "their-code-ran"
    plant_step(step_dir(tmp_path / "checkpoints", 10), planted, marker)
    target = planted if "folder" in how else planted / ".metadata"
    if "foreign" in how:
        chown_tree(planted, NOBODY) if target == planted else os.chown(target, NOBODY, NOBODY)
    else:
        target.chmod(mode(target) | 0o020)
    resumed = make_saver(tmp_path, events)
    folder, _, _ = resumed.resume(make_state(seed=1))
    assert folder == step_dir(tmp_path / "checkpoints", 10)
    assert not marker.exists()
    skipped = [e for e in events if e["event"] == "checkpoint_skipped"]
    assert [e["step"] for e in skipped] == [20]
    why = (
        f"is owned by nobody (uid {NOBODY}), not by you (uid 0): loading it would run their code as you; remove it"
        if "foreign" in how
        else f"is writable by group (mode {mode(target):04o}): someone else could have replaced what is loaded "
        f"from it; chmod go-w {target}"
    )
    assert skipped[0]["reason"].startswith(f"step_000020: not loaded: {target} {why}"), skipped[0]["reason"]
    assert (20 in resumed.bad) == ("foreign" in how)  # our own loose folder is never retention's to delete


def test_a_run_whose_own_checkpoints_are_all_writable_by_others_stops_instead_of_starting_over(tmp_path: Path) -> None:
    """Checkpoints an older hpc_train wrote under umask 002 (or a chmod -R g+w since) are not loaded. Before
    (adversarial review): every one went into `bad`, training began again at step 0, and retention and the
    new saves deleted them, the run's whole progress. Now the attempt stops and says the one command."""
    from hpc_train.preempt import Unrecoverable

    saver = make_saver(tmp_path, [])
    state = make_state()
    for step in (10, 20):
        state.step = step
        saver.save(state, "periodic", background=False)
    root = tmp_path / "checkpoints"
    for folder in root.iterdir():
        folder.chmod(0o770)
    resumed = make_saver(tmp_path, [])
    with pytest.raises(Unrecoverable) as e:
        resumed.resume(make_state(seed=1))
    assert names(str(e.value), "2 committed checkpoint(s)", f"newest {step_dir(root, 20)}", "not loaded")
    assert str(e.value).endswith(f"chmod -R go-w {root} and hpc-train resume {tmp_path}")
    assert sorted(p.name for p in root.iterdir()) == ["step_000010", "step_000020"] and not resumed.bad


def test_init_from_refuses_another_users_checkpoint_and_verifies_before_unpickling(tmp_path: Path) -> None:
    source = make_saver(tmp_path / "src", [])
    state = make_state()
    state.step = 40
    source.save(state, "final", background=False)
    folder, marker = step_dir(tmp_path / "src" / "checkpoints", 40), tmp_path / "their-code-ran"
    new = make_saver(tmp_path / "new", [], init_from=str(folder))

    # 1. A .metadata that is not the one the manifest names: refused on its checksum, never unpickled
    # (before: rank 0 read it, running the pickle, before any checksum was compared).
    good = (folder / ".metadata").read_bytes()
    (folder / ".metadata").write_bytes(pickle.dumps(Plant(marker)))
    with pytest.raises(Unrecoverable, match=r"does not verify: .metadata (has \d+ bytes|checksum differs)"):
        new.init_from(make_state(seed=1))
    assert not marker.exists()

    # 2. Another user's folder, checksums and all: refused before a byte is hashed.
    (folder / ".metadata").write_bytes(good)
    chown_tree(folder, NOBODY)
    with pytest.raises(Unrecoverable) as e:
        new.init_from(make_state(seed=1))
    assert names(str(e.value), f"checkpoint.init_from={folder}", "not loaded", f"{folder} is owned by nobody")
    chown_tree(folder, 0)
    source_of, _, _ = new.init_from(make_state(seed=1))
    assert source_of["step"] == 40


def test_a_teammates_init_from_checkpoint_is_copied_at_submit_so_it_is_ours(tmp_path: Path) -> None:
    """A hard link keeps its owner: the job would refuse it (and they could change it after submit)."""
    source = make_saver(tmp_path / "theirs", [])
    state = make_state()
    state.step = 40
    source.save(state, "final", background=False)
    folder = step_dir(tmp_path / "theirs" / "checkpoints", 40)
    chown_tree(tmp_path / "theirs", NOBODY)
    target = make_dir(tmp_path / "mine")
    configs = [{"checkpoint": {"init_from": str(folder)}}]
    with umask(0o002):
        submit_mod.pin_init_from(target, configs)
    pinned = Path(configs[0]["checkpoint"]["init_from"])
    files = sorted(pinned.iterdir())
    assert [(p.stat().st_uid, mode(p)) for p in files] == [(0, 0o600)] * len(files)
    assert [mode(pinned), mode(pinned.parent), mode(target / "init_from")] == [0o700] * 3
    assert untrusted(pinned / ".metadata", target) == ""
    assert [p.name for p in target.glob("init_from/*/.*")] == []  # no temp folder left behind


def test_submit_refuses_an_init_from_another_user_could_have_written(tmp_path: Path) -> None:
    """Copied at submit, a teammate's checkpoint would be ours, and its .metadata pickle with it: the job's
    owner check could no longer see whose code it is (adversarial review). Refused, with the explicit way."""
    from hpc_train.plan import init_from_checkpoint

    source = make_saver(tmp_path / "theirs", [])
    state = make_state()
    state.step = 40
    source.save(state, "final", background=False)
    folder = step_dir(tmp_path / "theirs" / "checkpoints", 40)
    config = {"fn": {"_target_": "x"}, "model": {}}
    assert init_from_checkpoint(str(folder), config) == folder  # our own: fine
    chown_tree(tmp_path / "theirs", NOBODY)
    with pytest.raises(ValueError) as e:
        init_from_checkpoint(str(folder), config)
    assert names(str(e.value), f"checkpoint.init_from={folder}", f"{folder} is owned by nobody", f"cp -r {folder} ")


def start_task(folder: Path, job_id: str = "123") -> subprocess.CompletedProcess:
    """start.py as submitit's local controller runs it, for task 0 of job `job_id`."""
    env = {
        **os.environ,
        "SUBMITIT_EXECUTOR": "local",
        "SUBMITIT_LOCAL_JOB_ID": job_id,
        "SUBMITIT_LOCAL_NTASKS": "1",
        "SUBMITIT_LOCAL_NODEID": "0",
        "SUBMITIT_LOCAL_JOB_NUM_NODES": "1",
        "SUBMITIT_LOCAL_GLOBALID": "0",
        "SUBMITIT_LOCAL_LOCALID": "0",
    }
    start = Path(submit_mod.__file__).parent / "start.py"
    return subprocess.run(
        [sys.executable, "-u", str(start), str(folder)], env=env, capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize("how", ["foreign pickle", "group-writable submitit folder"])
def test_the_job_refuses_a_job_pickle_another_user_could_have_written(tmp_path: Path, how: str) -> None:
    import cloudpickle

    folder = make_dir(make_dir(tmp_path / "run") / "submitit")
    marker = tmp_path / "their-code-ran"
    pkl = folder / "123_submitted.pkl"
    pkl.write_bytes(cloudpickle.dumps(Plant(marker)))
    if how == "foreign pickle":
        os.chown(pkl, NOBODY, NOBODY)
    else:
        folder.chmod(0o770)
    proc = start_task(folder)
    assert proc.returncode == 1 and not marker.exists(), proc.stdout + proc.stderr
    last = proc.stderr.splitlines()[-1]
    assert last.startswith("hpc_train: ") and names(last, "refusing", "job pickle"), proc.stderr
    assert "Traceback" not in proc.stderr
    assert ("owned by nobody" if how == "foreign pickle" else f"{folder} is writable by group") in proc.stderr


def test_the_job_result_never_follows_a_planted_symlink(tmp_path: Path) -> None:
    """submitit writes its result through the fixed name <result>.save_tmp, which open() follows: a
    teammate's symlink there had the job write wherever it pointed, as you."""
    import cloudpickle
    from submitit.core.utils import DelayedSubmission

    folder = make_dir(make_dir(tmp_path / "run") / "submitit")
    (folder / "123_submitted.pkl").write_bytes(cloudpickle.dumps(DelayedSubmission(len, [1, 2, 3])))
    victim = tmp_path / "victim"
    (folder / "123_0_result.pkl.save_tmp").symlink_to(victim)
    proc = start_task(folder)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not victim.exists()
    result = folder / "123_0_result.pkl"
    assert not result.is_symlink() and pickle.loads(result.read_bytes()) == ("success", 3)


def test_a_real_run_skips_a_planted_step_folder_and_their_code_never_runs(tmp_path: Path) -> None:
    """A local run under umask 002: its folders are 0700; a step folder planted by another user (with a
    COMMITTED that matches its files) is skipped at the requeue with checkpoint_skipped, the run resumes
    from its own checkpoint and finishes, and the planted pickle never runs."""
    args = ["train.steps=40", "checkpoint.every_steps=10", "cluster.tasks_per_node=2", "train.min_step_time_s=0.2"]
    with umask(0o002):  # the controller and its ranks inherit it
        run_dir, job_id = submit([f"out_dir={tmp_path}", *args, "--no-wait"])
    ckpts = run_dir / "checkpoints"
    wait_until(lambda: any(e["event"] == "checkpoint_committed" for e in read_events(run_dir)), 120, "a checkpoint")
    own = step_dir(ckpts, next(e["step"] for e in read_events(run_dir) if e["event"] == "checkpoint_committed"))
    marker = tmp_path / "their-code-ran"
    planted = step_dir(ckpts, 90)  # above anything this run saves: retention never removes it
    plant_step(own, planted, marker)
    chown_tree(planted, NOBODY)
    os.kill(int(job_id), signal.SIGTERM)  # requeue in place: the next attempt looks for a checkpoint
    wait_until(lambda: (run_dir / "summary.json").exists(), 240, "summary.json after the requeue")
    events = read_events(run_dir)
    skipped = [e for e in events if e["event"] == "checkpoint_skipped"]
    assert [e["step"] for e in skipped] == [90] and "is owned by nobody" in skipped[0]["reason"], skipped
    starts = [e for e in events if e["event"] == "start"]
    assert len(starts) == 2 and 0 < starts[1]["step"] < 90
    assert not marker.exists()
    assert [mode(p) for p in (run_dir, run_dir / "submitit", ckpts, step_dir(ckpts, 40))] == [0o700] * 4
    assert mode(step_dir(ckpts, 40) / ".metadata") == 0o600


def test_a_default_acl_on_the_project_folder_does_not_reach_into_our_folders(tmp_path: Path) -> None:
    """`setfacl -d -m g::rwx project/` (a common shared-project setup) made every file created in a run
    folder group-writable through the ACL mask, whatever the umask: submitit's job pickle came out 0664 and
    every task refused it (adversarial review). make_dir drops the inherited default ACL."""
    import struct

    # system.posix_acl_default, version 2: user::rwx group::rwx mask::rwx other::r-x (no setfacl here)
    entries = [(0x01, 7), (0x04, 7), (0x10, 7), (0x20, 5)]
    acl = struct.pack("<I", 2) + b"".join(struct.pack("<HHI", tag, perm, 0xFFFFFFFF) for tag, perm in entries)
    project = tmp_path / "project"
    project.mkdir()
    try:
        os.setxattr(project, "system.posix_acl_default", acl)
    except OSError as e:
        pytest.skip(f"this file system takes no POSIX ACL ({e})")
    with umask(0o022):
        (project / "plain").mkdir()
        (project / "plain" / "f").write_text("x")
        run = make_dir(project / "run", 0o700)
        (run / "job.pkl").write_text("x")
    assert mode(project / "plain" / "f") == 0o664  # what the ACL does to a folder we did not make
    assert mode(run / "job.pkl") == 0o644 and untrusted(run / "job.pkl", run) == ""
