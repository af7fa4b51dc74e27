"""Deterministic data: a generated corpus and a sampler whose position is just the step number.

The corpus is 64 random "words" (3-8 byte tokens each) strung together at random: enough structure
for the loss to fall, generated in ~5 ms from data.seed, so nothing is downloaded. Rank r's batch at
step s is a pure function of (seed, s, r): resuming at step s needs no sampler state beyond s.
"""

from __future__ import annotations

import torch

from hpc_train.config import DataConfig


def synthetic_corpus(cfg: DataConfig, vocab_size: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(cfg.seed)
    words = [torch.randint(0, vocab_size, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g)
             for _ in range(64)]
    order = torch.randint(0, len(words), (cfg.corpus_words,), generator=g)
    return torch.cat([words[i] for i in order.tolist()])


def batch(corpus: torch.Tensor, step: int, rank: int, world_size: int, batch_seqs: int,
          seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of shape (batch_seqs, seq_len); disjoint sample indices across ranks and steps."""
    first = (step * world_size + rank) * batch_seqs
    idx = torch.arange(first, first + batch_seqs, dtype=torch.int64)
    # Knuth's multiplicative hash scatters consecutive samples over the corpus.
    starts = (idx * 2654435761) % (corpus.numel() - seq_len - 1)
    windows = torch.stack([corpus[s: s + seq_len + 1] for s in starts.tolist()])
    return windows[:, :-1], windows[:, 1:]
