"""prepare-data --tokenizer: a byte-level BPE trained on the corpus, a user's tokenizer.json, the shard
dtype by vocabulary size, and a run whose model vocabulary comes from meta.json."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import HPC_TRAIN, names, read_events, refused, run
from tokenizers import Tokenizer, models, pre_tokenizers

from hpc_train.data import prepare
from hpc_train.tokenizer import dtype_for


def write_corpus(folder: Path, docs: int = 6) -> list[str]:
    """~60 KB of made-up prose from a seeded word list: accents, CJK, an emoji, tabs and \\r\\n, so the
    round trip covers multi-byte UTF-8 and line endings."""
    rng = random.Random(0)
    syllables = ["ka", "lo", "mi", "ne", "su", "ta", "ri", "vo", "zé", "ñu", "字", "🙂"]
    words = ["".join(rng.choices(syllables, k=rng.randint(1, 4))) for _ in range(400)]
    texts = []
    for d in range(docs):
        lines = [
            " ".join(rng.choices(words, k=rng.randint(3, 14))) + rng.choice([".", "!", "?\t", ","]) for _ in range(150)
        ]
        texts.append(("\r\n" if d == 1 else "\n").join(lines) + "\n")
    folder.mkdir(parents=True, exist_ok=True)
    for d, text in enumerate(texts):
        (folder / f"doc{d}.txt").write_bytes(text.encode())
    return texts


def stream(out: Path, meta: dict) -> np.ndarray:
    return np.concatenate([np.fromfile(out / s["file"], dtype=meta["dtype"]) for s in meta["shards"]])


def test_bpe_round_trips_every_document_and_records_vocab_and_dtype(tmp_path: Path) -> None:
    texts = write_corpus(tmp_path / "in")
    meta = prepare([tmp_path / "in"], tmp_path / "out", shard_tokens=3000, tokenizer="bpe:512")
    assert (meta["tokenizer"], meta["vocab_size"], meta["dtype"]) == ("bpe:512", 512, "uint16")
    assert meta["tokenizer_file"] == "tokenizer.json" and meta["documents"] == len(texts)
    tok = Tokenizer.from_file(str(tmp_path / "out" / "tokenizer.json"))
    ids = stream(tmp_path / "out", meta)
    assert len(ids) == meta["tokens"] == sum(s["tokens"] for s in meta["shards"]) and len(meta["shards"]) > 1
    assert all(s["tokens"] == 3000 for s in meta["shards"][:-1])
    assert int(ids.max()) < 512 and meta["tokens"] < sum(len(t.encode()) for t in texts) / 2  # merges compress
    eot = tok.token_to_id("<|endoftext|>")
    cuts = [-1, *np.flatnonzero(ids == eot), len(ids)]
    docs = [ids[a + 1 : b].tolist() for a, b in zip(cuts, cuts[1:])]
    assert [tok.decode(d) for d in docs] == texts  # sorted order doc0..doc5, \r\n and emoji intact
    assert tok.decode(tok.encode(texts[1]).ids) == texts[1]


def test_a_users_tokenizer_json_is_copied_beside_the_shards_and_large_vocabularies_take_uint32(tmp_path: Path) -> None:
    """A 70,000-word vocabulary does not fit uint16: the shards are uint32 and hold the ids above 65,535."""
    words = [f"w{i}" for i in range(70_000)]
    tok = Tokenizer(
        models.WordLevel({**{w: i for i, w in enumerate(words)}, "<eos>": 70_000, "[UNK]": 70_001}, unk_token="[UNK]")
    )
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "mine.json"))
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text("w1 w69999 w65536\nw2\n")
    (tmp_path / "in" / "b.txt").write_text("w3 nope\n")
    proc = run(
        [
            HPC_TRAIN,
            "prepare-data",
            str(tmp_path / "in"),
            "--out",
            str(tmp_path / "out"),
            "--tokenizer",
            str(tmp_path / "mine.json"),
        ]
    )
    assert proc.returncode == 0, proc.stderr
    assert "(tokenizer.json from " in proc.stdout and "vocab 70,002, uint32)" in proc.stdout
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert (meta["vocab_size"], meta["dtype"], meta["separator"]) == (70_002, "uint32", "<eos>")
    assert stream(tmp_path / "out", meta).tolist() == [1, 69_999, 65_536, 2, 70_000, 3, 70_001]
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == (tmp_path / "mine.json").read_bytes()
    assert (dtype_for(256), dtype_for(65_536), dtype_for(65_537)) == ("uint16", "uint16", "uint32")


def test_a_tokenizer_json_with_gaps_in_its_ids_sizes_the_vocabulary_by_the_largest_id(tmp_path: Path) -> None:
    """Three words with ids 0, 5 and 1000 need an embedding of 1001 rows, not 4 (the count)."""
    tok = Tokenizer(models.WordLevel({"a": 0, "b": 5, "<eos>": 1000, "[UNK]": 7}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "gaps.json"))
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text("a b zz\n")
    proc = run(
        [
            HPC_TRAIN,
            "prepare-data",
            str(tmp_path / "in"),
            "--out",
            str(tmp_path / "out"),
            "--tokenizer",
            str(tmp_path / "gaps.json"),
        ]
    )
    assert proc.returncode == 0, proc.stderr
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert meta["vocab_size"] == 1001 and "vocab 1,001, uint16)" in proc.stdout
    assert stream(tmp_path / "out", meta).tolist() == [0, 5, 7]


@pytest.mark.parametrize(
    "spec, says",
    [
        (
            "bpe:100",
            "--tokenizer bpe:100: VOCAB must be a whole number above the 256 byte tokens + <|endoftext|>, "
            "e.g. bpe:8192",
        ),
        (
            "nothere.json",
            "--tokenizer nothere.json: no such file; give bytes, bpe:VOCAB (e.g. bpe:8192) or a tokenizer.json",
        ),
    ],
)
def test_a_bad_tokenizer_is_refused_before_anything_is_written(tmp_path: Path, spec: str, says: str) -> None:
    write_corpus(tmp_path / "in", docs=1)
    proc = run([HPC_TRAIN, "prepare-data", str(tmp_path / "in"), "--out", str(tmp_path / "out"), "--tokenizer", spec])
    assert proc.returncode == 2 and f"hpc-train prepare-data: error: {says}" in proc.stderr, proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]


def test_a_file_that_is_not_utf8_is_named_and_nothing_is_left_behind(tmp_path: Path) -> None:
    write_corpus(tmp_path / "in", docs=1)
    (tmp_path / "in" / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    proc = run(
        [HPC_TRAIN, "prepare-data", str(tmp_path / "in"), "--out", str(tmp_path / "out"), "--tokenizer", "bpe:300"]
    )
    assert proc.returncode == 2, proc.stderr
    assert names(proc.stderr, f"{tmp_path / 'in' / 'latin1.txt'} is not UTF-8", "byte 3")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]


def test_train_on_bpe_tokens_the_model_vocabulary_comes_from_meta_json(tmp_path: Path) -> None:
    write_corpus(tmp_path / "in")
    out = run(
        [HPC_TRAIN, "prepare-data", str(tmp_path / "in"), "--out", str(tmp_path / "bpe"), "--tokenizer", "bpe:512"]
    )
    assert out.returncode == 0, out.stderr
    assert "(bpe:512, vocab 512, uint16)" in out.stdout
    proc = run(
        [
            HPC_TRAIN,
            "submit",
            f"out_dir={tmp_path / 'runs'}",
            "data=tokens",
            f"data.path={tmp_path / 'bpe'}",
            "train.steps=20",
            "checkpoint.every_steps=20",
        ],
        timeout_s=300,
    )  # model.vocab_size stays 256 here
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_dir = tmp_path / "runs" / "demo-1"
    assert "  vocab_size: 512\n" in (run_dir / "config.yaml").read_text()  # frozen: a requeue builds the same model
    assert [e["vocab_size"] for e in read_events(run_dir) if e["event"] == "start"] == [512]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["final_loss"] < math.log(512) - 1.0  # 6.24 at random init


def test_without_hugging_face_tokenizers_the_error_names_the_pip_command(tmp_path: Path) -> None:
    """sys.modules[name] = None is how Python marks a module absent; the real `main` runs in a subprocess."""
    write_corpus(tmp_path / "in", docs=1)
    code = (
        "import sys; sys.modules['tokenizers'] = None; from hpc_train.cli import main; "
        f"sys.exit(main(['prepare-data', '{tmp_path / 'in'}', '--out', '{tmp_path / 'out'}', '--tokenizer', "
        "'bpe:512']))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert refused(proc, "prepare-data", "--tokenizer bpe:512", "tokenizers", "pip install 'hpc_train[tokenizers]'")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]
