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

from hpc_train import submit
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
    p = submit.Plan(Path("/nowhere"), [], [], runs)  # type: ignore[arg-type]
    assert not any(p.private for _ in range(100))
    assert Cluster.reads == 100


def test_manifest_save_serializes_only_what_changed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Saved twice per array: a save that rewrote every record made a sweep's manifest writes quadratic."""
    n = 3000
    trials = [submit.Trial(i, [f"a={i}"], str(tmp_path / f"{i:04d}")) for i in range(n)]
    p = submit.Plan(tmp_path, trials, [], [], arrays=[submit.Array(list(range(k, k + 1000))) for k in (0, 1000, 2000)])
    submit._save_manifest(p, ["a=range(3000)"])
    dumped: list[object] = []
    real = json.dumps
    monkeypatch.setattr(json, "dumps", lambda obj, *a, **k: dumped.append(obj) or real(obj, *a, **k))
    for i in range(1000, 2000):
        trials[i].job_id = f"77_{i - 1000}"
    p.arrays[1].job_id = "77"
    submit._save_manifest(p, ["a=range(3000)"])
    assert len(dumped) == 1000 + 1 + 1  # the changed trials, the changed array, the head
    monkeypatch.undo()
    manifest = json.loads((tmp_path / "sweep.json").read_text())
    assert [t["job_id"] for t in manifest["trials"]][999:1001] == [None, "77_0"]
    assert [a["job_id"] for a in manifest["arrays"]] == [None, "77", None]
    assert manifest["trials"][5] == {"index": 5, "overrides": ["a=5"], "run_dir": str(tmp_path / "0005")} | {
        "job_id": None,
        "process": None,
    }


def test_a_sweeps_trials_share_one_code_json_and_keep_an_older_one(tmp_path: Path) -> None:
    code = '{"version": "new"}\n'
    (tmp_path / "0001").mkdir()
    (tmp_path / "0001" / "code.json").write_text('{"version": "old"}\n')  # frozen by an earlier submit
    like = None
    for i in range(4):
        like = submit._freeze(tmp_path / f"{i:04d}", {"a": i}, False, code, like)
    inodes = [os.stat(tmp_path / f"{i:04d}" / "code.json").st_ino for i in range(4)]
    assert inodes[0] == inodes[2] == inodes[3] != inodes[1]
    assert (tmp_path / "0001" / "code.json").read_text() == '{"version": "old"}\n'
    assert (tmp_path / "0003" / "code.json").read_text() == code
    assert yaml.safe_load((tmp_path / "0003" / "config.yaml").read_text()) == {"a": 3}
