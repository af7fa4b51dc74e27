"""Which code runs: a plain (non-editable) install carries conf/ and sbatch_templates/, and a job imports
the package that validated it, never a ./hpc_train of the folder it was submitted from."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import HPC_TRAIN, names, read_events, run

import hpc_train
from hpc_train.provenance import differences, identity

REPO = Path(__file__).resolve().parent.parent


def plain_install(tmp_path: Path) -> Path:
    """`pip install .` (a wheel, not editable) of this checkout into TMP/site, as into a fresh venv whose
    dependencies are this one's; returns TMP/site, to put on PYTHONPATH."""
    src, site = tmp_path / "src", tmp_path / "site"
    src.mkdir()
    parts = ("pyproject.toml", "README.md", "hpc_train", "conf", "sbatch_templates", "hydra_plugins")
    for part in parts:  # built outside the repo:
        if (REPO / part).is_dir():  # no build/ left in it, no race with another build
            shutil.copytree(REPO / part, src / part, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(REPO / part, src / part)
    proc = run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--disable-pip-version-check",
            "--target",
            str(site),
            str(src),
        ],
        timeout_s=180,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return site


def test_non_editable_install_composes_configs_and_renders_scripts(tmp_path: Path) -> None:
    """`pip install .` as a wheel (into --target, as into a fresh venv), then a fresh empty folder: init,
    compose and render work from the installed copy alone. ~5 s: one wheel build, four interpreters."""
    site, fresh = plain_install(tmp_path), tmp_path / "fresh"
    shipped = {
        p.relative_to(REPO).as_posix()
        for d in ("conf", "sbatch_templates")
        for p in (REPO / d).rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }
    installed = {
        p.relative_to(site / "hpc_train").as_posix()
        for d in ("conf", "sbatch_templates")
        for p in (site / "hpc_train" / d).rglob("*")
        if p.is_file()
    }
    assert installed == shipped
    assert (site / "hpc_train" / "py.typed").is_file()  # PEP 561: type checkers read the annotations

    fresh.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site)}
    cli = [sys.executable, "-m", "hpc_train.cli"]
    version = run([*cli, "--version"], env=env, cwd=fresh)
    assert version.returncode == 0, version.stderr
    assert f"hpc-train {hpc_train.__version__} from {site.resolve()}/hpc_train" in version.stdout, version.stdout
    init = run([*cli, "init"], env=env, cwd=fresh)
    assert init.returncode == 0 and (fresh / "conf" / "cluster" / "dev.yaml").is_file(), init.stdout + init.stderr
    (fresh / "conf" / "train" / "default.yaml").write_text("steps: 7\n")  # the user's ./conf is the primary
    cfg = run([*cli, "submit", "--cfg", "job", "cluster=dev", "model=tiny"], env=env, cwd=fresh)
    assert cfg.returncode == 0, cfg.stderr
    assert "steps: 7" in cfg.stdout and "executor: slurm" in cfg.stdout and "d_model: 64" in cfg.stdout
    render = (
        "import hpc_train, sys\n"
        "from hpc_train.config import compose, to_run_config\n"
        "from hpc_train.sbatch import render\n"
        "run = to_run_config(compose(['cluster=slurm', 'cluster.template=apptainer', "
        "'+cluster.template_vars.image=/img.sif']))\n"
        "print(hpc_train.__file__)\n"
        "print(render(run.cluster, 'pkg-1', __import__('pathlib').Path('/runs/pkg-1/submitit')))\n"
    )
    out = run([sys.executable, "-c", render], env=env, cwd=fresh)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0] == str(site.resolve() / "hpc_train" / "__init__.py")  # not the repo's
    assert "test -r /img.sif" in out.stdout  # the site template shipped
    relay, start = (f"{site.resolve()}/hpc_train/{name}.py" for name in ("relay", "start"))  # the installed ones
    words = out.stdout.split()
    assert relay in words and start in words, out.stdout
    assert words[words.index(relay) - 2 : words.index(relay) + 4] == ["-S", "-u", relay, "90", "120", "5"]
    assert words[words.index(start) - 1 : words.index(start) + 2] == ["-u", start, "/runs/pkg-1/submitit"]


def test_the_wheel_ships_the_hydra_launcher_plugin_where_hydra_finds_it(tmp_path: Path) -> None:
    """hydra_plugins/hpc_train_launcher/ in the wheel, beside hpc_train, and no hydra_plugins/__init__.py (Hydra's
    namespace, shared with every other plugin: one would hide theirs); Hydra's own discovery finds the Launcher in
    the plain install, and `hydra/launcher=hpc_train` composes from it (docs/hydra.md)."""
    site = plain_install(tmp_path)
    shipped = sorted(p.relative_to(site).as_posix() for p in (site / "hydra_plugins").rglob("*.py"))
    plugin = "hydra_plugins/hpc_train_launcher"
    assert shipped == [f"{plugin}/__init__.py", f"{plugin}/launcher.py"]
    probe = (
        "import hydra_plugins.hpc_train_launcher.launcher as l, sys\n"
        "from hydra.core.plugins import Plugins\n"
        "from hydra.plugins.launcher import Launcher\n"
        "print(l.__file__)\n"
        "print([c.__name__ for c in Plugins.instance().discover(Launcher)])\n"
        "print('torch' in sys.modules)\n"
    )
    out = run([sys.executable, "-c", probe], env={**os.environ, "PYTHONPATH": str(site)}, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    where, found, torch = out.stdout.splitlines()
    assert where == str(site.resolve() / "hydra_plugins" / "hpc_train_launcher" / "launcher.py")
    assert "HpcTrainLauncher" in found and torch == "False"  # discovery at every app's start stays torch-free


def test_job_imports_the_package_that_validated_it_and_says_when_code_changed(tmp_path: Path) -> None:
    """Submitted from a folder holding a ./hpc_train that dies on import: the job still trains (before,
    `python -m hpc_train.start` put the submit folder first on sys.path and every rank died). The trial's
    code.json was frozen by an older version (a sweep resubmitted after an upgrade keeps its trials'
    code.json): the job trains, and records a `code_changed` event naming the change."""
    shadow = tmp_path / "hpc_train"
    shadow.mkdir()
    for name in ("__init__.py", "start.py"):
        (shadow / name).write_text("raise SystemExit('SHADOWED: imported ./hpc_train of the submit folder')\n")
    sweep = tmp_path / "runs" / "sweep-1"
    recorded, _ = identity()
    (sweep / "0000").mkdir(parents=True)
    (sweep / "0000" / "code.json").write_text(json.dumps({**recorded, "version": "0.0.9"}))
    proc = run(
        [HPC_TRAIN, "submit", "-m", "--sweep-dir", str(sweep), "train.steps=2", "checkpoint.async_save=false"],
        cwd=tmp_path,
        timeout_s=180,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    trial = sweep / "0000"
    events = read_events(trial)
    assert [e["event"] for e in events if e["event"] == "finish"] == ["finish"], events
    changed = [e for e in events if e["event"] == "code_changed"]
    assert len(changed) == 1, events
    assert names(
        changed[0]["detail"], f"version '0.0.9' -> '{hpc_train.__version__}'", "other code", "validated the run"
    )
    assert "SHADOWED" not in "".join(p.read_text() for p in (sweep / "submitit").glob("*_log.*"))


def test_code_identity_of_this_checkout(tmp_path: Path) -> None:
    """code.json's fields for an editable install in a git checkout; the job's comparison finds no change
    against itself, and names each field that differs."""
    record, diff = identity()
    assert (
        record["path"] == str(Path(hpc_train.__file__).resolve().parent) and record["version"] == hpc_train.__version__
    )
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode == 0 and (REPO / ".git").exists():
        assert record["git_commit"] == head.stdout.strip() and record["git_dirty"] == bool(diff)
    assert differences(record) == ""
    moved = differences({**record, "path": "/elsewhere/hpc_train"})
    assert f"path '/elsewhere/hpc_train' -> '{record['path']}'" in moved and "Resubmit" in moved


def test_code_diff_is_bytes_of_the_package_only_and_owner_only(tmp_path: Path) -> None:
    """A checkout whose tracked hpc_train/model.py holds a non-UTF-8 byte (before: --version and submit
    died in UnicodeDecodeError), and a modified file outside the package (README.md, before: in the diff):
    code.diff holds the package's change only, as bytes, 0600 even for a run that is not private."""
    repo = tmp_path / "repo"
    for part in ("hpc_train", "conf", "sbatch_templates"):
        shutil.copytree(REPO / part, repo / part, ignore=shutil.ignore_patterns("__pycache__"))
    (repo / "README.md").write_text("secret notes\n")
    git = ["git", "-C", str(repo), "-c", "user.email=t@t", "-c", "user.name=t"]
    for args in (["init", "-q"], ["add", "."], ["commit", "-q", "-m", "x"]):
        subprocess.run([*git, *args], check=True, capture_output=True)
    with open(repo / "hpc_train" / "model.py", "ab") as f:
        f.write(b"# caf\xe9 in latin-1\n")
    (repo / "README.md").write_text("secret notes, edited\n")
    env = {**os.environ, "PYTHONPATH": str(repo)}
    version = run([sys.executable, "-m", "hpc_train.cli", "--version"], env=env, cwd=tmp_path)
    assert version.returncode == 0 and "+ uncommitted changes" in version.stdout, version.stdout + version.stderr
    code = (
        "import hashlib, json, os, pathlib, sys\n"
        "from hpc_train.submit import _code_identity\n"
        "out = pathlib.Path(sys.argv[1]); out.mkdir()\n"
        "record = json.loads(_code_identity(out, private=False))\n"
        "diff = (out / 'code.diff').read_bytes()\n"
        "print(oct(os.stat(out / 'code.diff').st_mode & 0o777), record['git_diff_sha256'] == "
        "hashlib.sha256(diff).hexdigest())\n"
        "sys.stdout.buffer.write(diff)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "run")], env=env, cwd=tmp_path, capture_output=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")
    first, _, diff = proc.stdout.partition(b"\n")
    assert first == b"0o600 True"
    assert b"+# caf\xe9 in latin-1" in diff and b"model.py" in diff
    assert b"README" not in diff and b"secret" not in diff


def test_a_huge_diff_is_capped_and_says_so() -> None:
    from hpc_train.provenance import DIFF_CAP_BYTES, capped

    assert capped(b"+one line\n") == b"+one line\n"
    big = capped(b"x" * (DIFF_CAP_BYTES + 10))
    head, note = big[:DIFF_CAP_BYTES], big[DIFF_CAP_BYTES:].decode()
    assert head == b"x" * DIFF_CAP_BYTES and note.startswith("\n# ") and note.endswith("\n") and note.count("\n") == 2
    assert names(note, "code.diff", f"capped at {DIFF_CAP_BYTES} of {DIFF_CAP_BYTES + 10} bytes", "git_diff_sha256")


def test_every_shipped_config_group_is_a_declared_package() -> None:
    """A conf/ group missing from pyproject's `packages` makes setuptools print ~50 warning lines per install
    (it still ships the files): a new group must be listed there."""
    import tomllib

    declared = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    groups = {f"hpc_train.conf.{p.name}" for p in (REPO / "conf").iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert groups <= declared, f"add {sorted(groups - declared)} to [tool.setuptools] packages in pyproject.toml"
