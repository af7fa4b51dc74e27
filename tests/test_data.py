"""Token data: `hpc-train prepare-data` shards, the memmap sampler, and a run trained on them."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import numpy as np
import pytest
from conftest import HPC_TRAIN, names, read_events, run, submit, wait_until

from hpc_train.config import DataConfig
from hpc_train.data import Sampler, fingerprint, open_sampler, prepare


def write_texts(folder: Path) -> list[bytes]:
    texts = [b"the quick brown fox\n" * 40, "pr\u00e9-\u00e9t\u00e9 \u2713\n".encode() * 30, b"lorem ipsum " * 50]
    for i, t in enumerate(texts):
        (folder / "sub").mkdir(parents=True, exist_ok=True)
        (folder / ("sub" if i == 2 else ".") / f"doc{i}.txt").write_bytes(t)
    return texts


def test_prepare_writes_byte_tokens_in_shards_and_refuses_an_existing_out(tmp_path: Path) -> None:
    texts = write_texts(tmp_path / "in")
    meta = prepare([tmp_path / "in"], tmp_path / "out", shard_tokens=500)
    stream = b"".join((tmp_path / "out" / s["file"]).read_bytes() for s in meta["shards"])
    assert stream == b"\x00".join(texts)  # sorted order: doc0, doc1, sub/doc2; NUL between documents
    assert [s["tokens"] for s in meta["shards"]] == [500] * (len(stream) // 500) + [len(stream) % 500]
    assert meta["vocab_size"] == 256 and meta["documents"] == 3
    before = sorted(p.name for p in (tmp_path / "out").iterdir())
    with pytest.raises(ValueError, match=r"--out .*out already exists; give a new directory"):
        prepare([tmp_path / "in"], tmp_path / "out", shard_tokens=500)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == before


def test_prepare_holds_out_the_last_tokens_as_val_shards(tmp_path: Path) -> None:
    """--val-fraction 0.3: the last 30% of the stream moves to val_*.bin (one shard cut in two, the
    whole ones after it renamed); the training shards keep the rest, and the two add up to the stream."""
    texts = write_texts(tmp_path / "in")
    stream = b"\x00".join(texts)
    meta = prepare([tmp_path / "in"], tmp_path / "out", shard_tokens=500, val_fraction=0.3)
    n_val = round(0.3 * len(stream))
    train = b"".join((tmp_path / "out" / s["file"]).read_bytes() for s in meta["shards"])
    val = b"".join((tmp_path / "out" / s["file"]).read_bytes() for s in meta["val_shards"])
    assert train == stream[:-n_val] and val == stream[-n_val:]
    assert (meta["tokens"], meta["val_tokens"]) == (len(stream) - n_val, n_val)
    assert [s["file"] for s in meta["val_shards"]] == ["val_00000.bin", "val_00001.bin"]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(
        ["meta.json"] + [s["file"] for s in meta["shards"] + meta["val_shards"]]
    )
    assert open_sampler(DataConfig(source="tokens", path=str(tmp_path / "out")), 32, 256, "val").shards[0][0] == val[0]
    with pytest.raises(ValueError, match=r"--val-fraction 1.0 must be in \[0, 1\)"):
        prepare([tmp_path / "in"], tmp_path / "bad", shard_tokens=500, val_fraction=1.0)
    with pytest.raises(ValueError, match=r"--val-fraction 0.9999 of 1\d{3} tokens leaves none to train on"):
        prepare([tmp_path / "in"], tmp_path / "bad", shard_tokens=500, val_fraction=0.9999)
    assert not (tmp_path / "bad.tmp").exists() and not (tmp_path / "bad").exists()


def test_held_out_split_of_bpe_tokens_cuts_whole_tokens(tmp_path: Path) -> None:
    """uint16 BPE ids: the cut falls between tokens (2 bytes each), and train + val is the full stream."""
    write_texts(tmp_path / "in")
    full = prepare([tmp_path / "in"], tmp_path / "full", shard_tokens=100, tokenizer="bpe:300")
    meta = prepare([tmp_path / "in"], tmp_path / "split", shard_tokens=100, tokenizer="bpe:300", val_fraction=0.25)
    assert meta["dtype"] == full["dtype"] == "uint16" and meta["tokens"] + meta["val_tokens"] == full["tokens"]

    def stream(folder: Path, shards: list[dict]) -> list[int]:
        return [int(t) for s in shards for t in np.fromfile(folder / s["file"], dtype=np.uint16)]

    assert stream(tmp_path / "split", meta["shards"]) + stream(tmp_path / "split", meta["val_shards"]) == stream(
        tmp_path / "full", full["shards"]
    )
    assert meta["val_tokens"] == round(0.25 * full["tokens"]) and (tmp_path / "split" / "tokenizer.json").exists()


def test_synthetic_data_has_a_held_out_corpus_of_the_same_words() -> None:
    cfg = DataConfig()
    train, val = (open_sampler(cfg, 32, 256, split).shards[0] for split in ("train", "val"))
    assert 9_000 < len(val) < len(train) // 6  # 2,048 words of 3-8 tokens against 16,384
    assert not any((train[i : i + len(val[:64])] == val[:64]).all() for i in range(len(train) - 64))  # another string
    assert set(val.tolist()) <= set(train.tolist())  # of the same 64 words' tokens


def test_sampler_visits_every_window_once_per_epoch_disjoint_across_ranks() -> None:
    shards = [np.arange(0, 101, dtype=np.int64), np.arange(1000, 1051, dtype=np.int64)]  # 10 + 5 windows of 10
    seen = []
    samplers = [Sampler(shards, seq_len=10, seed=3) for _ in range(3)]
    for _ in range(5):  # 5 steps x 3 ranks x 1 sequence = one epoch of 15 windows
        for rank, s in enumerate(samplers):
            x, y = s.next_batch(rank, 3, 1)
            assert (y[:, :-1] == x[:, 1:]).all()
            seen.append(int(x[0, 0]))
    starts = sorted([10 * w for w in range(10)] + [1000 + 10 * w for w in range(5)])
    assert sorted(seen) == starts  # every window once, none crosses a shard's end
    assert samplers[0].position == 15
    one = Sampler(shards, seq_len=10, seed=3)
    epochs = [[int(one.next_batch(0, 1, 1)[0][0, 0]) for _ in range(15)] for _ in range(2)]
    assert sorted(epochs[1]) == starts and epochs[1] != epochs[0]  # each epoch: a new permutation


def test_sampler_resumes_from_its_position() -> None:
    corpus = [np.arange(5000) % 256]
    straight = Sampler(corpus, 16, seed=0)
    batches = [straight.next_batch(1, 2, 4)[0] for _ in range(6)]
    resumed = Sampler(corpus, 16, seed=0, position=Sampler(corpus, 16, seed=0).position + 3 * 2 * 4)
    assert all((resumed.next_batch(1, 2, 4)[0] == b).all() for b in batches[3:])


def test_fingerprint_tells_every_change_of_shards_and_nothing_else() -> None:
    """Seeded random shard lists, each changed one way at a time: a shard added, removed, resized (one token
    more or fewer), renamed, or two swapped gives another digest; the same list, opened again, the same one."""
    rng = np.random.default_rng(19)
    for _ in range(200):
        lengths = [int(n) for n in rng.integers(1, 5000, int(rng.integers(1, 8)))]
        names = [f"shard_{i:05d}.bin" for i in range(len(lengths))]

        def fp(names: list[str], lengths: list[int]) -> tuple[int, int, int]:
            return fingerprint(names, [np.zeros(n, dtype=np.uint16) for n in lengths])

        digest, shards, tokens = base = fp(names, lengths)
        assert (shards, tokens) == (len(lengths), sum(lengths)) and base == fp(list(names), list(lengths))
        assert -(2**63) <= digest < 2**63  # an int64 checkpoint tensor holds it
        i = int(rng.integers(len(lengths)))
        grown = [*lengths[:i], lengths[i] + int(rng.choice([-1, 1]) if lengths[i] > 1 else 1), *lengths[i + 1 :]]
        changes = [
            fp([*names, f"shard_{len(names):05d}.bin"], [*lengths, int(rng.integers(1, 5000))]),  # appended
            fp(names[:i] + names[i + 1 :], lengths[:i] + lengths[i + 1 :]) if len(names) > 1 else None,  # removed
            fp(names, grown),  # resized by one token
            fp([*names[:i], "other.bin", *names[i + 1 :]], lengths),  # renamed
            fp(names[::-1], lengths[::-1]) if len(names) > 1 else None,  # reordered
        ]
        assert all(c[0] != digest for c in changes if c is not None), (lengths, i)


def test_open_sampler_reads_prepared_shards_by_memmap(tmp_path: Path) -> None:
    write_texts(tmp_path / "in")
    prepare([tmp_path / "in"], tmp_path / "out", shard_tokens=400)
    s = open_sampler(DataConfig(source="tokens", path=str(tmp_path / "out")), seq_len=32, vocab_size=256)
    assert all(isinstance(shard, np.memmap) for shard in s.shards) and len(s.shards) == 5
    x, _ = s.next_batch(0, 1, 8)
    assert x.shape == (8, 32) and int(x.max()) < 256


def test_train_on_prepared_text_from_the_command_line(tmp_path: Path) -> None:
    write_texts(tmp_path / "in")
    prepare([tmp_path / "in"], tmp_path / "no-val", shard_tokens=1000)
    no_val = run(
        [
            HPC_TRAIN,
            "submit",
            "--cfg",
            "job",
            "data=tokens",
            f"data.path={tmp_path / 'no-val'}",
            "train.eval_every_steps=10",
        ]
    )
    assert no_val.returncode == 2 and names(
        no_val.stderr,
        "train.eval_every_steps=10",
        "model.seq_len + 1 = 33",
        f"data.path='{tmp_path / 'no-val'}' has 0 held-out tokens",
        "--val-fraction 0.01",
        "train.eval_every_steps=0",
    )
    out = run(
        [
            HPC_TRAIN,
            "prepare-data",
            str(tmp_path / "in"),
            "--out",
            str(tmp_path / "tok"),
            "--shard-tokens",
            "1000",
            "--val-fraction",
            "0.2",
        ]
    )
    assert out.returncode == 0, out.stderr
    assert names(out.stdout, "+ 370 held out", "3 file(s)", "2 shard(s)")
    assert "data=tokens data.path=" in out.stdout and "train.eval_every_steps=100" in out.stdout
    again = run([HPC_TRAIN, "prepare-data", str(tmp_path / "in"), "--out", str(tmp_path / "tok")])
    assert again.returncode == 2 and "already exists; give a new directory" in again.stderr
    proc = run(
        [
            HPC_TRAIN,
            "submit",
            f"out_dir={tmp_path / 'runs'}",
            "data=tokens",
            f"data.path={tmp_path / 'tok'}",
            "train.steps=20",
            "checkpoint.every_steps=10",
            "train.eval_every_steps=10",
        ],
        timeout_s=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_dir = tmp_path / "runs" / "demo-1"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["final_loss"] < 4.0  # ln(256) = 5.5: repetitive English is learnt fast
    assert 0 < summary["val_loss"] < 8  # the held-out tail ("lorem ipsum"), partly unseen words
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(run_dir / "checkpoints" / "step_000020", tmp_path / "plain.pt")  # torch's own reader
    saved = torch.load(tmp_path / "plain.pt", weights_only=True)
    assert int(saved["data"]["position"]) == 20 * 2 * 8  # steps x data-parallel ranks x batch_seqs_per_rank
    assert int(saved["progress"]["step"]) == 20 and int(saved["progress"]["tokens_seen"]) == 20 * 2 * 8 * 32


def test_a_resume_on_changed_data_stops_with_a_sentence_unless_allowed(tmp_path: Path) -> None:
    """A shard appended while the run was preempted: its requeued attempt stops at once (no requeue, no
    crash loop) with what changed and both fixes; `hpc-train resume --allow-data-changed` trains on it to
    the end and records a data_changed event. Before, the resume read other windows without a word."""
    from hpc_train.runs import process_identity

    write_texts(tmp_path / "in")
    data = tmp_path / "tok"
    before = prepare([tmp_path / "in"], data, shard_tokens=1000)
    run_dir, job_id = submit(
        [
            f"out_dir={tmp_path / 'runs'}",
            "data=tokens",
            f"data.path={data}",
            "train.steps=20",
            "checkpoint.every_steps=5",
            "train.min_step_time_s=0.2",
            "--no-wait",
        ]
    )
    wait_until(lambda: any(e["event"] == "checkpoint_committed" for e in read_events(run_dir)), 120, "a checkpoint")
    (tmp_path / "in" / "zz.txt").write_bytes(b"a shard appended later\n" * 40)  # sorted last: the stream grows
    after = prepare([tmp_path / "in"], tmp_path / "tok-2", shard_tokens=1000)
    os.rename(data, tmp_path / "tok-1")
    os.rename(tmp_path / "tok-2", data)
    os.kill(int(job_id), signal.SIGTERM)  # a preemption: save, requeue in place, resume on the new data
    stopped = wait_until(
        lambda: next((e for e in read_events(run_dir) if e["event"] == "stopped"), None), 240, "the stop"
    )
    step = stopped["step"]
    assert [(e["restart"], e["step"]) for e in read_events(run_dir) if e["event"] == "start"] == [(0, 0), (1, step)]
    sentence = (
        f"data.path='{data}' is not the data checkpoint step {step} was trained on (shards "
        f"{len(before['shards'])} -> {len(after['shards'])}, tokens {before['tokens']:,} -> {after['tokens']:,}): "
        f"resumed on it, the windows read from step {step} on would not be the uninterrupted run's. Restore that "
        f"data and hpc-train resume {run_dir}, or train on with the data as it is now: hpc-train resume {run_dir} "
        f"--allow-data-changed (data.allow_changed=true for its attempts)"
    )
    assert (len(before["shards"]), len(after["shards"])) == (2, 3) and stopped["reason"] == sentence
    wait_until(lambda: process_identity(int(job_id)) is None, 120, "the stopped run's controller to exit")

    proc = run([HPC_TRAIN, "resume", str(run_dir), "--allow-data-changed"], timeout_s=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith(f"demo-1 stopped because {sentence}\n"), proc.stdout
    assert json.loads((run_dir / "summary.json").read_text())["final_step"] == 20
    changed = [e for e in read_events(run_dir) if e["event"] == "data_changed"]
    assert [(e["restart"], e["step"], e["change"]) for e in changed] == [
        (2, step, f"shards 2 -> 3, tokens {before['tokens']:,} -> {after['tokens']:,}")
    ]
