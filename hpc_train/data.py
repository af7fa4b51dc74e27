"""Token data: shards from `hpc-train prepare-data`, read by memmap, or a corpus generated in-process.

    hpc-train prepare-data notes/*.txt --out data/notes        # byte tokens -> data/notes/shard_*.bin
    hpc-train prepare-data notes/ --out data/notes2 --val-fraction 0.05   # last 5% -> val_*.bin, held out
    hpc-train submit data=tokens data.path=data/notes model.seq_len=128

The tokenizer is bytes by default: token = byte value (vocab 256), documents joined by a NUL byte (text
holds none); `--tokenizer bpe:VOCAB` or `--tokenizer FILE.json` use Hugging Face tokenizers (tokenizer.py).
The sampler cuts the token stream into windows of seq_len + 1 and visits them in a seeded permutation,
a new one each epoch. Its position (sequences consumed, all ranks together) is saved in every checkpoint,
so a resumed run reads exactly the windows the uninterrupted run would have read, and so is a fingerprint
of the data it read (fingerprint: each shard's name and length): a resume on data that changed since (a shard
appended) is stopped with a sentence (changed) unless data.allow_changed. Evaluation reads the held-out split
(val_*.bin, or a further generated corpus) with a sampler of its own, always from position 0.

`prepare` and `read_meta` are torch-free: the login node runs them.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpc_train.tokenizer import open_encoder

META = "meta.json"


def prepare(
    inputs: list[Path], out_dir: Path, shard_tokens: int, tokenizer: str = "bytes", val_fraction: float = 0.0
) -> dict[str, Any]:
    """Write the tokens (tokenizer.py) of every file under `inputs` (sorted, recursively) into shards of at most
    `shard_tokens` tokens, plus meta.json; the last `val_fraction` of the tokens are held out (split_off_val).
    Writes into <out_dir>.tmp and renames it once complete, so an interrupted run leaves nothing that looks
    usable; refuses an existing out_dir rather than mixing."""
    if out_dir.exists():
        raise ValueError(
            f"--out {out_dir} already exists; give a new directory (existing shards are never overwritten)"
        )
    if shard_tokens < 1:
        raise ValueError(f"--shard-tokens {shard_tokens} must be >= 1")
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(
            f"--val-fraction {val_fraction} must be in [0, 1): the share of tokens held out for "
            f"evaluation, e.g. --val-fraction 0.01"
        )
    files: list[Path] = []
    for p in inputs:
        if p.is_dir():
            files += sorted(f for f in p.rglob("*") if f.is_file())
        elif p.is_file():
            files.append(p)
        else:
            raise ValueError(f"input {p} does not exist; give text files or directories of them")
    if not files:
        raise ValueError(f"no files under {[str(p) for p in inputs]}; give text files or directories of them")
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    if tmp.exists():
        raise ValueError(f"{tmp} exists (an interrupted prepare-data?); remove it and run again")
    enc = open_encoder(tokenizer, files)  # bytes (default); checks, or trains a BPE on the files, before tmp exists
    tmp.mkdir(parents=True)
    shards: list[dict[str, Any]] = []
    out = None

    def write(chunk: bytes) -> None:
        nonlocal out
        while chunk:
            if out is None or shards[-1]["tokens"] == shard_tokens:
                if out is not None:
                    out.close()
                shards.append({"file": f"shard_{len(shards):05d}.bin", "tokens": 0})
                out = open(tmp / shards[-1]["file"], "wb")
            room = (shard_tokens - shards[-1]["tokens"]) * enc.itemsize  # in bytes
            out.write(chunk[:room])
            shards[-1]["tokens"] += len(chunk[:room]) // enc.itemsize
            chunk = chunk[room:]

    for i, f in enumerate(files):
        for block in enc.encode_file(f):
            write(block)
        if i < len(files) - 1:
            write(enc.separator)
    if out is not None:
        out.close()
    enc.save(tmp)  # tokenizer.json beside the shards (not for bytes)
    meta = {**enc.meta, "documents": len(files), "tokens": sum(s["tokens"] for s in shards), "shards": shards}
    if val_fraction > 0:
        meta = split_off_val(tmp, meta, val_fraction)
    (tmp / META).write_text(json.dumps(meta, indent=1) + "\n")
    os.replace(tmp, out_dir)
    return meta


def split_off_val(folder: Path, meta: dict[str, Any], fraction: float) -> dict[str, Any]:
    """Move the last `fraction` of the token stream (at least one token) out of the training shards into
    val_00000.bin, ... in stream order: whole shards are renamed, the one cut in two is copied from its cut
    and truncated. meta's `shards` and `tokens` then count training tokens only; `val_shards` and
    `val_tokens` the held-out ones, which training never reads."""
    import shutil

    import numpy as np

    itemsize = np.dtype(meta["dtype"]).itemsize
    train = [dict(s) for s in meta["shards"]]
    left = max(1, round(fraction * meta["tokens"]))
    if left >= meta["tokens"]:
        shutil.rmtree(folder)
        raise ValueError(
            f"--val-fraction {fraction} of {meta['tokens']} tokens leaves none to train on; give more "
            f"text or a smaller fraction"
        )
    pieces: list[tuple[Path, int]] = []  # (file now holding it, tokens), in stream order
    while left:
        last = train[-1]
        src, take = folder / last["file"], min(left, last["tokens"])
        if take == last["tokens"]:
            train.pop()
        else:
            keep = last["tokens"] - take
            last["tokens"], src_tail = keep, folder / (last["file"] + ".tail")
            with open(src, "rb") as a, open(src_tail, "wb") as b:
                a.seek(keep * itemsize)
                shutil.copyfileobj(a, b)
            os.truncate(src, keep * itemsize)
            src = src_tail
        pieces.insert(0, (src, take))
        left -= take
    val = []
    for i, (src, tokens) in enumerate(pieces):
        val.append({"file": f"val_{i:05d}.bin", "tokens": tokens})
        os.replace(src, folder / val[-1]["file"])
    return {
        **meta,
        "tokens": sum(s["tokens"] for s in train),
        "shards": train,
        "val_tokens": sum(s["tokens"] for s in val),
        "val_shards": val,
    }


def read_meta(path: Path) -> dict[str, Any]:
    try:
        return json.loads((path / META).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(
            f"data.path={str(path)!r} has no readable {META} ({e}); write one with "
            f"`hpc-train prepare-data FILES... --out {path}`"
        ) from None


def fingerprint(names: list[str], shards: list[Any]) -> tuple[int, int, int]:
    """(digest, shards, tokens) of the data a sampler visits. The digest is the first 8 bytes of a sha256 over
    each shard's name, dtype and length in order, as an int64 (a checkpoint tensor): a shard added, removed,
    renamed or resized changes it, and so does the window order (Sampler.window). Lengths are the open
    arrays' (a memmap's file size, not meta.json's word for it), never their bytes: microseconds for any
    amount of data. A shard rewritten in place at the same length is not seen."""
    h = hashlib.sha256()
    for name, s in zip(names, shards, strict=True):
        h.update(f"{name}\0{s.dtype}\0{len(s)}\n".encode())
    return int.from_bytes(h.digest()[:8], "little", signed=True), len(shards), sum(len(s) for s in shards)


@dataclass
class Sampler:
    """Which token windows each data-parallel rank reads; `position` is all it needs to resume, and the
    fingerprint of its data (names: one per shard) is saved beside it."""

    shards: list[Any]  # 1-D uint8/int64 arrays: np.memmap over prepared shards, or the generated corpus
    seq_len: int
    seed: int
    position: int = 0  # sequences consumed so far, all data-parallel ranks together
    names: list[str] = field(default_factory=list)  # one per shard, for the fingerprint; [] names them by index
    saved_fingerprint: tuple[int, int, int] | None = None  # the loaded checkpoint's (None: none, or one without it)
    fingerprint: tuple[int, int, int] = field(init=False)  # of `shards` as they are now
    _starts: Any = field(init=False, repr=False)  # cumulative window counts per shard
    _perm: tuple[int, Any] = field(init=False, repr=False, default=(-1, None))  # (epoch, permutation)

    def __post_init__(self) -> None:
        import numpy as np

        self.fingerprint = fingerprint(self.names or [str(i) for i in range(len(self.shards))], self.shards)
        counts = [max(0, (len(s) - 1) // self.seq_len) for s in self.shards]
        self._starts = np.cumsum([0, *counts])
        if self._starts[-1] == 0:
            raise ValueError(
                f"no shard holds seq_len + 1 = {self.seq_len + 1} tokens; use a smaller model.seq_len or more text"
            )

    def window(self, sample: int) -> Any:
        import numpy as np

        n = int(self._starts[-1])
        epoch, k = divmod(sample, n)
        if self._perm[0] != epoch:  # ~10 ms per million windows, once per epoch
            self._perm = (epoch, np.random.default_rng([self.seed, epoch]).permutation(n))
        w = int(self._perm[1][k])
        shard = int(np.searchsorted(self._starts, w, side="right")) - 1
        offset = (w - int(self._starts[shard])) * self.seq_len
        return self.shards[shard][offset : offset + self.seq_len + 1]

    def state_dict(self) -> dict[str, Any]:  # the Stateful protocol: checkpointed with the model
        import torch

        return {"position": torch.tensor(self.position), "fingerprint": torch.tensor(self.fingerprint)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = int(state["position"])
        if "fingerprint" in state:  # a checkpoint written before fingerprints has none (checkpoint.py asks not)
            digest, shards, tokens = (int(v) for v in state["fingerprint"].tolist())
            self.saved_fingerprint = (digest, shards, tokens)

    def changed(self) -> str:
        """How the data differs from the loaded checkpoint's, in words; "" if it does not, or is not known."""
        was, now = self.saved_fingerprint, self.fingerprint
        if was is None or was == now:
            return ""
        if was[1:] == now[1:]:
            return f"the same {now[1]} shard(s) and {now[2]:,} tokens, but a shard renamed, reordered or resized"
        return f"shards {was[1]} -> {now[1]}, tokens {was[2]:,} -> {now[2]:,}"

    def next_batch(self, dp_rank: int, dp_size: int, batch_seqs: int) -> tuple[Any, Any]:
        """(inputs, targets) of shape (batch_seqs, seq_len) for this rank; advances past every rank's."""
        import numpy as np
        import torch

        first = self.position + dp_rank * batch_seqs
        windows = np.stack([self.window(first + i) for i in range(batch_seqs)]).astype(np.int64)
        self.position += dp_size * batch_seqs
        t = torch.from_numpy(windows)
        return t[:, :-1], t[:, 1:]


def open_sampler(cfg: Any, seq_len: int, vocab_size: int, split: str = "train") -> Sampler:
    """The run's data, its training split or its held-out "val" split: memmapped shards
    (data.source=tokens) or the generated corpus."""
    import numpy as np

    if cfg.source == "tokens":
        meta = read_meta(Path(cfg.path))
        key = "val_shards" if split == "val" else "shards"
        names = [s["file"] for s in meta.get(key, [])]
        shards = [np.memmap(Path(cfg.path) / name, dtype=meta["dtype"], mode="r") for name in names]
        if not shards:
            raise ValueError(
                f"data.path={cfg.path!r} has no held-out split; prepare it with `hpc-train prepare-data "
                f"... --val-fraction 0.01`, or set train.eval_every_steps=0"
            )
    elif split == "val":  # an eighth as many words again, from the same vocabulary
        shards = [synthetic_corpus(max(64, cfg.corpus_words // 8), cfg.seed, vocab_size, held_out=True)]
        names = ["synthetic held out"]
    else:
        shards = [synthetic_corpus(cfg.corpus_words, cfg.seed, vocab_size)]
        names = [f"synthetic corpus_words={cfg.corpus_words} seed={cfg.seed} vocab_size={vocab_size}"]
    return Sampler(shards, seq_len, cfg.seed, names=names)


def synthetic_corpus(words: int, seed: int, vocab_size: int, held_out: bool = False) -> Any:
    """64 random "words" (3-8 tokens each) strung together at random: enough structure for the loss to
    fall, generated in ~5 ms from the seed, the same on every rank, nothing downloaded. held_out: the
    same words strung in another order, from a second stream, for evaluation."""
    import numpy as np

    rng = np.random.default_rng(seed)
    vocab = [rng.integers(0, vocab_size, int(rng.integers(3, 9))) for _ in range(64)]
    order = np.random.default_rng([seed, 1]) if held_out else rng
    return np.concatenate([vocab[i] for i in order.integers(0, len(vocab), words)])
