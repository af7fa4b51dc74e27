"""A sweep costs the same per trial at 100 points and at 100,000: what each shortcut of the login path must
keep equal to the slow way it replaces (Hydra's parser, PyYAML, a manifest rewritten whole), and that the
work per trial stays constant (no Slurm call, manifest record or scan over all trials repeated per trial).
Figures: benchmarks/submit_bench.py (docs/benchmarks.md)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import yaml
from conftest import HPC_TRAIN, fake_clients, names, run
from test_cli import FAKE_SLURM

from hpc_train import plan, submit
from hpc_train.config import _plain_override, compose_trials

# Hydra's grammar has corners a hand-written reading gets wrong: these are the ones near what it reads itself.
OVERRIDES = [
    "train.seed=7",
    "train.seed=-3",
    "train.seed=0",
    "train.seed=007",
    "train.seed=1_000",
    "train.seed=+5",
    "train.lr=1e-3",
    "train.lr=3.0e-4",
    "train.lr=0.5",
    "train.lr=-0.25",
    "train.lr=.5",
    "train.lr=5.",
    "train.lr=1E5",
    "train.lr=1e+5",
    "train.lr=inf",
    "train.lr=-inf",
    "train.lr=nan",
    "name=abc",
    "name=a-b_c9",
    "name=True",
    "name=FALSE",
    "name=Null",
    "name=infinity",
    "name=nan_x",
    "name=e5",
    "name=a.b",
    "name=a/b",
    "name='quoted'",
    "name=a b",
    "name=",
    "name=${x}",
    "name=choice(a,b)",
    "name=[a,b]",
    "+train.x=1",
    "++train.x=1",
    "~train.x",
    "train.x@pkg=1",
    "train-x.y=1",
    "a.0.b=1",
]


@pytest.mark.parametrize("line", OVERRIDES)
def test_plain_overrides_read_as_hydras_parser_reads_them(line: str) -> None:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    plain = _plain_override(line)
    if plain is None:
        return  # left to Hydra's parser
    (o,) = OverridesParser.create().parse_overrides([line])
    assert o.type.name == "CHANGE" and o.package is None and not o.is_sweep_override()
    value = o.value()
    assert plain[0] == o.key_or_group and type(plain[1]) is type(value)
    assert plain[1] == value or (math.isnan(plain[1]) and math.isnan(value))


def test_the_plain_reading_takes_what_sweeps_produce() -> None:
    """range(), lists of numbers and of words: what a 10,000-point sweep is made of skips the ANTLR parse."""
    for line in ("train.seed=12345", "train.lr=0.003", "train.lr=1e-05", "name=lr-sweep", "model.n_heads=-1"):
        assert _plain_override(line) is not None, line


def test_trials_compose_as_hydra_composes_each() -> None:
    """The shortcut (one compose per group choice, plain values set on a copy) against one Hydra compose
    per trial, on trials mixing plain values, group choices, quoted strings and new keys."""
    from omegaconf import OmegaConf

    from hpc_train.config import compose

    trials = [
        ["train.lr=1e-3", "name=a-1", "train.steps=7"],
        ["model=small", "train.lr=0.5", "train.bf16=true"],
        ["cluster=dev", "cluster.partition=null", "train.seed=2"],
        ["train.lr=3e-4", "out_dir='runs here'", "+cluster.env.X=007"],
        ["train.min_step_time_s=1e-2", "cluster.setup=[a,b]", "data.corpus_words=100"],
    ]
    for trial, (resolved, _) in zip(trials, compose_trials(trials)):
        whole = OmegaConf.to_container(compose(trial), resolve=True)
        whole["model"]["vocab_size"] = resolved["model"]["vocab_size"]
        assert resolved == whole, trial


def test_frozen_yaml_is_what_pyyaml_writes() -> None:
    plain = [c for c, _ in compose_trials([["cluster=dev"], ["model=small", "+cluster.env.TOKEN=x y"]])]
    plain.append(
        {
            "s": ["", " lead", "a: b", "null", "1e3", "007", "yes", "tab\there", "ünï", "x" * 300 + " y" * 60],
            "n": [1, 1.0, -0.0, 0.0, True, None, 1e-10, float("inf"), 12345678901234567890],
            "empty": {"d": {}, "l": []},
            "nested": {"a": {"b": {"c": [False]}}},
            "123": "a key that reads as an int",
        }
    )
    others = [{"k" * 150: "a complex key"}, {"m": "line one\nline two"}, {"d": [[1, 2], {"a": 1}]}, {1: 2}, {}]
    for tree in plain + others:
        text = submit.frozen_yaml(tree)
        assert text == yaml.dump(tree, Dumper=yaml.CSafeDumper, sort_keys=False, width=2**31 - 1)
        assert json.dumps(yaml.safe_load(text)) == json.dumps(tree)
    for tree in plain:  # written by the fast path, not handed to PyYAML whole
        submit._yaml_block(tree, "", [])


def test_private_is_decided_once_per_plan() -> None:
    """Asked per trial while freezing, the scan over every run made a 10,000-point sweep quadratic."""

    class Cluster:
        reads = 0

        @property
        def env(self) -> dict[str, str]:
            Cluster.reads += 1
            return {}

    runs = [type("Run", (), {"cluster": Cluster()})() for _ in range(100)]
    p = plan.Plan(Path("/nowhere"), [], [], runs)  # type: ignore[arg-type]
    assert not any(p.private for _ in range(100))
    assert Cluster.reads == 100


def test_manifest_save_serializes_only_what_changed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Saved twice per array: a save that rewrote every record made a sweep's manifest writes quadratic."""
    n = 3000
    trials = [plan.Trial(i, [f"a={i}"], str(tmp_path / f"{i:04d}")) for i in range(n)]
    p = plan.Plan(tmp_path, trials, [], [], arrays=[plan.Array(list(range(k, k + 1000))) for k in (0, 1000, 2000)])
    submit._save_manifest(p, ["a=range(3000)"])
    dumped: list[object] = []
    real = json.dumps
    monkeypatch.setattr(json, "dumps", lambda obj, *a, **k: dumped.append(obj) or real(obj, *a, **k))
    for i in range(1000, 2000):
        trials[i].job_id = f"77_{i - 1000}"
    p.arrays[1].job_id = "77"
    submit._save_manifest(p, ["a=range(3000)"])
    assert len(dumped) == 1000 + 1 + 1  # the changed trials, the changed array, the head
    trials[2000].job_id = "78_0"
    submit._save_manifest(p, ["a=range(3000)"], changed=[2000])  # what submit() passes: only those looked at
    assert len(dumped) == 1000 + 1 + 1 + 2
    monkeypatch.undo()
    resumed = json.loads((tmp_path / "sweep.json").read_text())  # a resume rewrites it meanwhile
    resumed["trials"][7].update(job_id="99", previous_job_ids=["12"])
    (tmp_path / "sweep.json").write_text(json.dumps(resumed))
    submit._save_manifest(p, ["a=range(3000)"], changed=[])  # the file changed: every trial is looked at
    assert trials[7].job_id == "99" and json.loads((tmp_path / "sweep.json").read_text())["trials"][7]["job_id"] == "99"
    manifest = json.loads((tmp_path / "sweep.json").read_text())
    assert [t["job_id"] for t in manifest["trials"]][999:1001] == [None, "77_0"]
    assert [a["job_id"] for a in manifest["arrays"]] == [None, "77", None]
    assert manifest["trials"][5] == {"index": 5, "overrides": ["a=5"], "run_dir": str(tmp_path / "0005")} | {
        "job_id": None,
        "process": None,
        "brief": None,  # submit's freeze sets it (status.brief); this plan froze nothing
    }


def test_a_sweeps_trials_share_one_code_json_and_keep_an_older_one(tmp_path: Path) -> None:
    code = '{"version": "new"}\n'
    (tmp_path / "0001").mkdir()
    (tmp_path / "0001" / "code.json").write_text('{"version": "old"}\n')  # frozen by an earlier submit
    like = None
    for i in range(4):
        like = submit._freeze(tmp_path / f"{i:04d}", {"a": i}, False, 0o700, code, like)
    inodes = [os.stat(tmp_path / f"{i:04d}" / "code.json").st_ino for i in range(4)]
    assert inodes[0] == inodes[2] == inodes[3] != inodes[1]
    assert (tmp_path / "0001" / "code.json").read_text() == '{"version": "old"}\n'
    assert (tmp_path / "0003" / "code.json").read_text() == code
    assert yaml.safe_load((tmp_path / "0003" / "config.yaml").read_text()) == {"a": 3}


def test_a_large_sweep_is_validated_once_per_distinct_request_and_queued_array_by_array(tmp_path: Path) -> None:
    """2,500 trials, MaxArraySize 1001: three arrays, two distinct scripts (1001 tasks, 498 tasks), so two
    sbatch --test-only calls, three sbatch calls, and a manifest that names every task."""
    sbatch = FAKE_SLURM["sbatch"].replace("--test-only)", '--test-only) echo >> "$STATE/test_only";', 1)
    sbatch = sbatch.replace("*) touch", '*) echo >> "$STATE/sbatch"; touch', 1)
    bin_dir, state = fake_clients(tmp_path, {**FAKE_SLURM, "sbatch": sbatch})
    (tmp_path / "slurm.conf").write_text("ClusterName=fake\n")
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    args = [HPC_TRAIN, "submit", "-m", "cluster=slurm", f"cluster.slurm_conf={tmp_path / 'slurm.conf'}"]
    args += [f"out_dir={tmp_path / 'runs'}", "name=big", "train.seed=range(2500)"]
    dry = run([*args, "--dry-run"], env=env)
    assert dry.returncode == 0, dry.stderr
    (said,) = [line for line in dry.stdout.splitlines() if line.startswith("# dry run")]
    assert names(said, "2500 trial(s)", "3 sbatch call(s)")
    assert (state / "test_only").read_text().count("\n") == 2
    proc = run(args, env=env, timeout_s=300)
    assert proc.returncode == 0, proc.stderr
    assert (state / "test_only").read_text().count("\n") == 4 and (state / "sbatch").read_text().count("\n") == 3
    sweep = tmp_path / "runs" / "big-1"
    manifest = json.loads((sweep / "sweep.json").read_text())
    assert [t["job_id"] for t in manifest["trials"]][999:1002] == ["4242_999", "4242_1000", "4242_0"]
    assert [(len(a["trials"]), a["job_id"], a["submitting"]) for a in manifest["arrays"]] == [
        (1001, "4242", False),
        (1001, "4242", False),
        (498, "4242", False),
    ]
    assert yaml.safe_load((sweep / "2499" / "config.yaml").read_text())["train"]["seed"] == 2499
    assert os.stat(sweep / "0000" / "code.json").st_ino == os.stat(sweep / "2499" / "code.json").st_ino
    assert names(proc.stdout, "2500 trial(s) queued", "3 sbatch call(s)")


def test_a_prefetched_client_call_is_read_once_and_a_failed_one_runs_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """plan() asks the cluster's facts while the script renders; call() must still read as it always did."""
    import time

    from hpc_train import slurm

    bin_dir, state = fake_clients(
        tmp_path,
        {
            "scontrol": """[ "$1" = ping ] || echo x >> "$STATE/calls"
case "$*" in
  "show node -o") [ "$(wc -l < "$STATE/calls")" -eq 1 ] && { echo "not yet" >&2; exit 1; }; echo NodeName=n1;;
  "show partition -o") echo PartitionName=p;;
  ping) exec sleep 60;;
esac""",
        },
    )
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.delenv("SLURM_CONF", raising=False)
    calls = lambda: len((state / "calls").read_text().split())  # noqa: E731
    slurm.prefetch(["scontrol", "show", "node", "-o"])
    assert slurm.call(["scontrol", "show", "node", "-o"], retries=0) == "NodeName=n1\n"  # failed once, run again
    assert calls() == 2
    slurm.prefetch(["scontrol", "show", "partition", "-o"], ["scontrol", "ping"])
    assert slurm.partitions() == {"p": {"PartitionName": "p"}} and calls() == 3
    assert slurm.partitions() == {"p": {"PartitionName": "p"}} and calls() == 4  # read once: asked again
    t0 = time.monotonic()
    slurm.drop_prefetched()  # the ping nobody reads: stopped, not waited for
    assert time.monotonic() - t0 < 10 and not slurm._PREFETCHED
