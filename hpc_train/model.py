"""A GPT-style decoder: token + position embeddings, pre-norm blocks, tied output head."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from hpc_train.config import ModelConfig


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.head_dim = cfg.d_model // cfg.n_heads
        self.ln1 = nn.LayerNorm(cfg.d_model)
        # One fused q/k/v projection (one GEMM, not three) whose output is laid out head by head,
        # [q k v of head 0, q k v of head 1, ...]: tensor parallelism's column shards then hold whole
        # heads, n_heads / tp of them, each with its own q, k and v.
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model, bias=False)
        self.fc_out = nn.Linear(4 * cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.ln1(x)
        # -1 heads: under tensor parallelism this rank's projection holds only its share of the heads
        q, k, v = (z.transpose(1, 2) for z in self.qkv(h).view(b, t, -1, 3, self.head_dim).unbind(3))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, -1))
        return x + self.fc_out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        # Recompute each block in backward: it then keeps only its input, 2*s*b*d bytes in bf16 instead
        # of ~34*s*b*d (Korthikanti et al. 2022), for one more forward (+1/3 of the step's FLOPs).
        self.activation_checkpointing = False
        for _name, p in self.named_parameters():  # GPT-2's init: std 0.02 keeps the first loss near ln(vocab)
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.activation_checkpointing else block(x)
        logits = self.ln_f(x) @ self.tok.weight.T  # tied head: vocab 256 x d_model weights shared
        # The loss in fp32 (a no-op in fp32): bf16 parameters (FSDP2's MixedPrecisionPolicy) give bf16
        # logits, whose log-softmax over the vocabulary would round to bf16's 8 bits of mantissa.
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
