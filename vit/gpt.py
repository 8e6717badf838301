"""A small decoder-only GPT built from the same `Block` as the ViT, run with `is_causal=True`.

Token + learned position embeddings -> L Blocks (causal) -> norm -> LM head tied to the token
embedding (nanoGPT's layout, with our shared Block).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from vit.layers import Block, make_norm
from vit.registry import register_model


@dataclass
class GPTConfig:
    vocab_size: int = 65  # set from the tokenizer by the text datamodule
    block_size: int = 256  # context length
    embed_dim: int = 384
    depth: int = 6
    num_heads: int = 6
    mlp_ratio: float = 4.0
    dropout: float = 0.0
    norm: str = "layernorm"

    def __post_init__(self) -> None:
        if self.embed_dim % self.num_heads:
            raise ValueError(f"embed_dim {self.embed_dim} is not divisible by num_heads {self.num_heads}")


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = c = config
        self.tok_embed = nn.Embedding(c.vocab_size, c.embed_dim)
        self.pos_embed = nn.Embedding(c.block_size, c.embed_dim)
        self.drop = nn.Dropout(c.dropout)
        self.blocks = nn.ModuleList(
            [
                Block(c.embed_dim, c.num_heads, c.mlp_ratio, proj_drop=c.dropout, attn_drop=c.dropout, norm=c.norm)
                for _ in range(c.depth)
            ]
        )
        self.norm = make_norm(c.norm, c.embed_dim)
        self.lm_head = nn.Linear(c.embed_dim, c.vocab_size, bias=False)
        self.lm_head.weight = self.tok_embed.weight  # weight tying (Press & Wolf 2017)
        self.init_weights()

    def init_weights(self) -> None:
        """GPT-2's: normal(0.02), zero biases; the projections into the residual stream get
        std 0.02/sqrt(2*depth) so the stream's variance does not grow with depth."""
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)
        for block in self.blocks:
            for proj in (block.attn.proj, block.mlp.fc2):
                nn.init.normal_(proj.weight, std=0.02 / math.sqrt(2 * self.config.depth))

    def no_weight_decay(self) -> set[str]:
        return {"pos_embed.weight"}

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T) -> next-token logits (B, T, vocab_size)."""
        T = idx.shape[1]
        if self.config.block_size < T:
            raise ValueError(f"sequence of length {T} exceeds block_size {self.config.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.tok_embed(idx) + self.pos_embed(pos))
        for block in self.blocks:
            x = block(x, is_causal=True)
        return self.lm_head(self.norm(x))

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Sample `max_new_tokens` tokens after `idx` (B, T); the context is cropped to block_size.

        temperature 0 is greedy decoding; `generator` makes sampling reproducible.
        """
        for _ in range(max_new_tokens):
            logits = self(idx[:, -self.config.block_size :])[:, -1, :]
            idx_next = sample_next(logits, temperature, top_k, generator)
            idx = torch.cat([idx, idx_next], dim=1)
        return idx


def sample_next(
    logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None, generator: torch.Generator | None = None
) -> torch.Tensor:
    """One token per row from (B, vocab) logits: greedy at temperature 0, else top-k sampling."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, [-1]]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(F.softmax(logits, dim=-1), num_samples=1, generator=generator)


# nanoGPT's character-level Shakespeare models: its CPU example and its GPU config.
register_model("gpt_char_cpu", GPT, GPTConfig, block_size=64, embed_dim=128, depth=4, num_heads=4, dropout=0.0)
register_model("gpt_char_small", GPT, GPTConfig, block_size=256, embed_dim=384, depth=6, num_heads=6, dropout=0.2)
