"""A small decoder-only GPT built from the same `Block` as the ViT, made causal.

Token + learned position embeddings -> L Blocks (causal) -> norm -> LM head tied to the token
embedding (nanoGPT's layout, with our shared Block). The config switches on the newer options of
the Block (RMSNorm, SwiGLU, ReLU², mixture of experts, qk-norm), the position encoding ("learn", a
fixed "sincos" table, or "rope": rotary q/k, which runs at contexts longer than block_size), and
modded-nanogpt's untied head and zero-initialised output projections.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from vit.layers import BlockConfig, KVCache, make_block, make_norm, moe_aux_loss
from vit.position import rope_1d, sincos_1d
from vit.registry import register_model


@dataclass
class GPTConfig(BlockConfig):
    """The GPT's options: the Block's (see vit.layers.BlockConfig) and these."""

    vocab_size: int = 65  # set from the tokenizer by the text datamodule
    block_size: int = 256  # context length
    embed_dim: int = 384
    depth: int = 6
    num_heads: int = 6
    # nanoGPT's one dropout rate: on the embeddings, and the blocks' attn_drop_rate and proj_drop_rate
    # unless those are set.
    dropout: float = 0.0
    posemb: str = "learn"  # "learn", "sincos" (fixed, Vaswani et al.) or "rope" (rotary q and k)
    tie_head: bool = True  # the LM head shares the token embedding's weights; False: a head of its own
    # Zero-initialised attn.proj, fc2 and untied head (modded-nanogpt): each block starts as the
    # identity and the first steps learn from the embeddings alone.
    zero_init: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.posemb not in ("learn", "sincos", "rope"):
            raise ValueError(f"posemb must be 'learn', 'sincos' or 'rope', got {self.posemb!r}")
        if isinstance(self.num_kv_heads, tuple):  # the GPT's blocks are built alike, without their numbers
            raise ValueError("a GPT's num_kv_heads is one count for every block")
        self.attn_drop_rate = self.attn_drop_rate or self.dropout
        self.proj_drop_rate = self.proj_drop_rate or self.dropout


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = c = config
        self.tok_embed = nn.Embedding(c.vocab_size, c.embed_dim)
        self.pos_embed = nn.Embedding(c.block_size, c.embed_dim) if c.posemb == "learn" else None
        self.drop = nn.Dropout(c.dropout)
        self.blocks = nn.ModuleList([make_block(c, causal=True) for _ in range(c.depth)])
        self.norm = make_norm(c.norm, c.embed_dim, c.norm_eps)
        self.lm_head = nn.Linear(c.embed_dim, c.vocab_size, bias=False)
        if c.tie_head:
            self.lm_head.weight = self.tok_embed.weight  # weight tying (Press & Wolf 2017)
        self.init_weights()

    def init_weights(self) -> None:
        """GPT-2's: normal(0.02), zero biases; the projections into the residual stream get
        std 0.02/sqrt(2*depth) so the stream's variance does not grow with depth (0 with zero_init,
        as does an untied head)."""
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)
        c = self.config
        for name, p in self.blocks.named_parameters():  # every expert's fc2 too
            if name.endswith(("attn.proj.weight", "fc2.weight")):
                if c.zero_init:
                    nn.init.zeros_(p)
                else:
                    nn.init.normal_(p, std=0.02 / math.sqrt(2 * c.depth))
        if c.zero_init and not c.tie_head:
            nn.init.zeros_(self.lm_head.weight)

    def no_weight_decay(self) -> set[str]:
        return {"pos_embed.weight"}

    def aux_loss(self) -> torch.Tensor:
        """The MoE load-balancing loss of the last forward (summed over blocks); 0 without MoE.
        A training step adds `weight * model.aux_loss()` to the language-modelling loss."""
        return moe_aux_loss(self)

    def _positions(self, pos: torch.Tensor) -> tuple[torch.Tensor | None, tuple[torch.Tensor, torch.Tensor] | None]:
        """(what to add to the token embeddings, rotary tables for the attention) at positions `pos`."""
        c = self.config
        if c.posemb == "learn":
            return self.pos_embed(pos), None
        if c.posemb == "rope":
            return None, rope_1d(pos, c.embed_dim // c.num_heads)
        # Vaswani et al. add sqrt(d) * embedding + table, two parts of similar size; our embeddings
        # start at std 0.02, so the table (std 1/sqrt(2)) is scaled to that std too.
        table = sincos_1d(int(pos[-1]) + 1, c.embed_dim).to(pos.device)[pos]
        return table * (0.02 * math.sqrt(2)), None

    def forward(self, idx: torch.Tensor, kv_caches: list[KVCache] | None = None) -> torch.Tensor:
        """Token ids (B, T) -> next-token logits (B, T, vocab_size).

        With `kv_caches` (one per block), idx continues the cached tokens: its positions start after
        them, and it attends to them without recomputing their keys and values.
        """
        T = idx.shape[1]
        past = len(kv_caches[0]) if kv_caches is not None else 0
        if self.config.posemb == "learn" and self.config.block_size < past + T:
            what = f"{past} cached + {T} new tokens" if past else f"sequence of length {T}"
            raise ValueError(f"{what} exceeds block_size {self.config.block_size}")
        pos = torch.arange(past, past + T, device=idx.device)
        pos_embed, rope = self._positions(pos)
        x = self.tok_embed(idx)
        x = self.drop(x + pos_embed if pos_embed is not None else x)
        for i, block in enumerate(self.blocks):
            x = block(x, rope=rope, kv_cache=kv_caches[i] if kv_caches is not None else None)
        return self.lm_head(self.norm(x))

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
        use_cache: bool = True,
    ) -> torch.Tensor:
        """Sample `max_new_tokens` tokens after `idx` (B, T); the context is cropped to block_size.

        temperature 0 is greedy decoding; `generator` makes sampling reproducible. `use_cache` runs
        only the newest token through the model while the sequence fits in block_size; past it, the
        window slides, every position changes and each step recomputes the window, as without the
        cache, so both give the same tokens.
        """
        block_size = self.config.block_size
        caches: list[KVCache] | None = None
        for _ in range(max_new_tokens):
            if caches is not None and idx.shape[1] <= block_size:
                logits = self(idx[:, -1:], caches)[:, -1, :]
            else:
                caches = [KVCache() for _ in self.blocks] if use_cache else None
                logits = self(idx[:, -block_size:], caches)[:, -1, :]
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
