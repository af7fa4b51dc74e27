"""Tokenizers for `hpc-train prepare-data`: bytes (the default), a byte-level BPE trained on the corpus,
or your own tokenizer.json (Hugging Face `tokenizers`, an optional extra: pip install 'hpc_train[tokenizers]').

    hpc-train prepare-data notes/ --out data/notes                           # bytes: vocab 256, uint8
    hpc-train prepare-data notes/ --out data/notes-bpe --tokenizer bpe:8192  # trains, saves tokenizer.json
    hpc-train prepare-data notes/ --out data/notes-gpt2 --tokenizer gpt2/tokenizer.json
    hpc-train submit data=tokens data.path=data/notes-bpe                    # model.vocab_size from meta.json

The data directory keeps the tokenizer.json its tokens were made with, beside the shards: decode with
`tokenizers.Tokenizer.from_file("data/notes-bpe/tokenizer.json").decode(ids)`. Token ids are stored as
uint16 when the vocabulary fits (< 65,536 ids), else uint32. Nothing is downloaded.
"""

from __future__ import annotations

import importlib.util
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TOKENIZER_JSON = "tokenizer.json"
END_OF_TEXT = "<|endoftext|>"  # the BPE's one special token: between documents, as GPT-2's
# A user's tokenizer.json: the first of these it knows separates documents; else a blank line does.
SEPARATORS = (END_OF_TEXT, "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>", "[SEP]")
BLOCK_BYTES = 1 << 20  # encode ~1 MiB of lines at a time: a many-GB file never sits in memory


@dataclass
class Encoder:
    """What prepare() writes with: token bytes per file, the separator's bytes, and meta.json's fields."""

    meta: dict[str, Any]  # tokenizer, vocab_size, dtype (+ separator for a tokenizer.json)
    separator: bytes  # one document boundary, already in the shard dtype
    hf: Any = None  # tokenizers.Tokenizer; None: bytes
    source: str = ""  # the user's tokenizer.json, copied beside the shards; "": saved from `hf`

    def save(self, out_dir: Path) -> None:
        if self.source:
            shutil.copyfile(self.source, out_dir / TOKENIZER_JSON)
        elif self.hf is not None:
            self.hf.save(str(out_dir / TOKENIZER_JSON))

    @property
    def itemsize(self) -> int:
        return {"uint8": 1, "uint16": 2, "uint32": 4}[self.meta["dtype"]]

    def encode_file(self, path: Path) -> Iterator[bytes]:
        """The file's tokens in the shard dtype, block by block."""
        import numpy as np

        if self.hf is None:
            with open(path, "rb") as src:
                yield from iter(lambda: src.read(BLOCK_BYTES), b"")
            return
        with open(path, encoding="utf-8", newline="") as src:  # newline="": \r\n stays, decode gives the file back
            try:
                for lines in iter(lambda: src.readlines(BLOCK_BYTES), []):
                    ids = [i for e in self.hf.encode_batch_fast(lines, add_special_tokens=False) for i in e.ids]
                    yield np.asarray(ids, dtype=self.meta["dtype"]).tobytes()
            except UnicodeDecodeError as e:
                raise ValueError(
                    f"{path} is not UTF-8 text ({e.reason} at byte {e.start}); a BPE tokenizer reads "
                    f"text: convert the file, leave it out, or use the default byte tokens"
                ) from None


def dtype_for(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "uint32"  # ids 0..vocab_size-1


def check(spec: str) -> None:
    """Torch- and tokenizers-free check of --tokenizer before any file is read."""
    if spec == "bytes":
        return
    if spec.startswith("bpe:"):
        size = spec[4:]
        if not size.isdigit() or int(size) < 257 + 1:
            raise ValueError(
                f"--tokenizer {spec}: VOCAB must be a whole number above the 256 byte tokens + "
                f"{END_OF_TEXT}, e.g. bpe:8192"
            )
    elif not Path(spec).is_file():
        raise ValueError(f"--tokenizer {spec}: no such file; give bytes, bpe:VOCAB (e.g. bpe:8192) or a tokenizer.json")
    if importlib.util.find_spec("tokenizers") is None:
        raise ValueError(
            f"--tokenizer {spec} needs Hugging Face tokenizers, which is not installed in this Python; "
            f"run: pip install 'hpc_train[tokenizers]' (or use the default byte tokens)"
        )


def open_encoder(spec: str, files: list[Path]) -> Encoder:
    """bytes; or a byte-level BPE trained on `files` (14 MB: 9 s of CPU, training and encoding); or the
    user's tokenizer.json."""
    check(spec)
    if spec == "bytes":
        return Encoder({"tokenizer": "bytes", "vocab_size": 256, "dtype": "uint8"}, b"\x00")  # text holds no NUL
    import numpy as np
    from tokenizers import Tokenizer

    if spec.startswith("bpe:"):
        hf = train_bpe(files, int(spec[4:]))
        name, separator = spec, END_OF_TEXT
    else:
        hf = Tokenizer.from_file(spec)
        name = f"{TOKENIZER_JSON} from {Path(spec).resolve()}"
        separator = next((t for t in SEPARATORS if hf.token_to_id(t) is not None), "\n\n")
    # max id + 1, not the count: a user's vocabulary may skip ids (0, 5, 1000), and the model's embedding
    # must hold the largest one
    vocab = max(hf.get_vocab(with_added_tokens=True).values(), default=-1) + 1
    dtype = dtype_for(vocab)
    ids = [hf.token_to_id(separator)] if hf.token_to_id(separator) is not None else hf.encode(separator).ids
    meta = {
        "tokenizer": name,
        "tokenizer_file": TOKENIZER_JSON,
        "vocab_size": vocab,
        "dtype": dtype,
        "separator": separator,
    }
    return Encoder(meta, np.asarray(ids, dtype=dtype).tobytes(), hf, "" if spec.startswith("bpe:") else spec)


def train_bpe(files: list[Path], vocab_size: int) -> Any:
    """GPT-2's recipe: split text at GPT-2's regex over UTF-8 bytes shown as 256 printable characters
    (so every byte is a token and any text round-trips), then merge the most frequent pairs."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )

    def lines() -> Iterator[str]:
        for f in files:
            with open(f, encoding="utf-8", newline="") as src:
                try:
                    yield from iter(lambda: "".join(src.readlines(BLOCK_BYTES)), "")
                except UnicodeDecodeError as e:
                    raise ValueError(
                        f"{f} is not UTF-8 text ({e.reason} at byte {e.start}); a BPE tokenizer "
                        f"reads text: convert the file, leave it out, or use the default byte "
                        f"tokens"
                    ) from None

    hf.train_from_iterator(lines(), trainer=trainer)
    return hf
