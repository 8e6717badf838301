"""Self- and cross-attention: masks, the key/value cache, the fused and the explicit path, the
MAP pooling head. timm's parameter names (`qkv`, `q_proj`, `proj`, `q_norm`, `latent`, ...)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TypedDict, Unpack

import torch
import torch.nn.functional as F
from torch import nn

from vit.layers import attention_variants as variants
from vit.layers.mlp import Mlp
from vit.layers.norm import make_norm
from vit.layers.sdpa import add_bias, attention_weights, fused_attention, merge_masks
from vit.position import apply_rope


class KVCache:
    """The keys and values one Attention layer has seen, so generation feeds only the new token."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append (B, heads, N, head_dim) keys and values; return all of them so far."""
        if self.k is not None:
            k, v = torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2)
        self.k, self.v = k, v
        return k, v


class AttnArgs(TypedDict, total=False):
    """What one call may tell a self-attention layer besides the tokens and the mask: the keywords
    of Attention.forward and of every block's forward, listed once (`**kw: Unpack[AttnArgs]`).

    rope: (cos, sin) tables (vit.position) for the last len(cos) tokens, (N, head_dim) or per image
        and/or head (B | 1, heads | 1, N, head_dim); q and k are rotated (after qk-norm, before
        caching), earlier (prefix) tokens are not.
    kv_cache: the tokens are the new ones only; they attend to the cached ones too, and are cached.
    num_queries: only the first n tokens query (keys and values are still every token), so the
        output is (B, n, dim): for a classifier that reads only the CLS token. Not with masks.
    return_attn: also return the weights, (B, heads, Nq, Nk), from the explicit path for this call.
    grid: the patch grid of the tokens after the prefix (relative positions, windows); None: the built one.
    """

    rope: tuple[torch.Tensor, torch.Tensor] | None
    kv_cache: KVCache | None
    num_queries: int | None
    return_attn: bool
    grid: tuple[int, int] | None


class _AttentionBase(nn.Module):
    """What self- and cross-attention share: heads, qk-norm, the two attention paths, the output
    projection. Self-attention hands q, k, v side by side to `self_attention`; cross-attention
    computes its q, k, v and calls `attention`.

    Two paths give the same output: the fused `F.scaled_dot_product_attention` (flash /
    memory-efficient kernels on GPU; the default) and an explicit softmax(QK^T/sqrt(d))V that can
    also return the attention weights. `fused_attn` is a per-module switch, and
    `return_attn=True` takes the explicit path for that one call only, so attention maps can be
    read while the rest of the model stays fused. `qk_norm=True` normalises q and k per head
    (timm's `q_norm`/`k_norm`; ViT-22B, for stable logits at scale), with the block's norm kind.

    The variants that change the math plug into three hooks of `self_attention` (their code:
    vit.layers.attention_variants): how qkv splits into heads (grouped key/value heads: `num_kv_heads`),
    a bias on the scores (`position_bias`: relative positions) and the attention itself (`attention`:
    `diff=True`, differential attention, whose heads split q and k in two halves of head_dim / 2
    and read v at full head width; `depth`, the block's number, sets its lambda_init; `lsa=True`,
    locality self-attention: a learned temperature, no token attending to itself).
    `proj=False`: no output projection (a block that projects the heads itself).
    """

    def __init__(
        self, dim: int, num_heads: int, attn_drop: float = 0.0, proj_drop: float = 0.0, qk_norm: bool = False,
        norm: str = "layernorm", norm_eps: float = 1e-6, proj_bias: bool = True, diff: bool = False, depth: int = 0,
        proj: bool = True, lsa: bool = False, **in_proj: nn.Module,
    ) -> None:  # fmt: skip
        super().__init__()
        if diff and lsa:
            raise ValueError("diff (differential attention) and lsa (locality self-attention): give one of them")
        if dim % (num_heads * (2 if diff else 1)):
            raise ValueError(f"width {dim} is not divisible by num_heads {num_heads}{' x 2 (diff)' if diff else ''}")
        # The subclass's input projections (qkv, or q and kv) come first, as they always did: the
        # registration order is the initialisation order, so the same seed gives the same weights.
        for name, module in in_proj.items():
            setattr(self, name, module)
        self.num_heads = self.num_kv_heads = num_heads  # Attention's num_kv_heads may be fewer
        self.head_dim = dim // num_heads // (2 if diff else 1)  # of q and k; diff: v's heads are twice as wide
        self.scale = self.head_dim**-0.5
        self.fused_attn = True
        self.causal, self.rope_half = False, True  # self-attention's options
        self.q_norm = make_norm(norm, self.head_dim, norm_eps) if qk_norm else nn.Identity()
        self.k_norm = make_norm(norm, self.head_dim, norm_eps) if qk_norm else nn.Identity()
        self.attn_drop = nn.Dropout(attn_drop)
        self.diff = diff
        if diff:
            variants.init_differential(self, depth)
        self.lsa = lsa
        if lsa:
            variants.init_locality(self)
        if proj:
            self.proj = nn.Linear(dim, dim, bias=proj_bias)
            self.proj_drop = nn.Dropout(proj_drop)

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        """(B, N, dim) -> (B, heads, N, head_dim)."""
        return t.reshape(t.shape[0], t.shape[1], self.num_heads, self.head_dim).transpose(1, 2)

    def self_attention(
        self,
        qkv: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        kv_cache: KVCache | None = None,
        num_queries: int | None = None,
        return_attn: bool = False,
        grid: tuple[int, int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """q, k, v side by side (B, N, width) -> their attention before the output projection,
        (B, Nq, heads x v's head width), and the weights (None unless `return_attn`). The keywords: AttnArgs."""
        groups = self.num_heads // self.num_kv_heads
        q, k, v = variants.split_qkv(qkv, self.head_dim, groups, 2 * self.head_dim if self.diff else None)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, heads, N, head_dim) each
        q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            if self.diff:
                raise ValueError("rotary positions with differential attention are not supported")
            q, k = apply_rope(q, *rope, half=self.rope_half), apply_rope(k, *rope, half=self.rope_half)
        attn_mask = add_bias(attn_mask, self.position_bias(q, grid))
        if num_queries is not None:
            if self.causal:
                raise ValueError("num_queries is for unmasked or explicitly masked attention, not a causal layer")
            q = q[:, :, :num_queries]
            if attn_mask is not None and attn_mask.ndim >= 2 and attn_mask.shape[-2] == qkv.shape[1]:
                attn_mask = attn_mask[..., :num_queries, :]  # the queries' rows
        if kv_cache is not None:
            k, v = kv_cache.update(k, v)
        k, v = variants.expand_kv(k, v, groups)
        return self.attention(q, k, v, attn_mask, self.causal, return_attn)

    def position_bias(self, q: torch.Tensor, grid: tuple[int, int] | None = None) -> torch.Tensor | None:
        """A bias on the scores, (B | 1, heads, N, N), or None: the relative positions' hook (Attention)."""
        return None

    def attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
        is_causal: bool = False, return_attn: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
        """softmax(q k^T / sqrt(d) + mask) v (diff: `variants.differential_attention`), the heads side by
        side before the output projection: (B, Nq, heads x v's head width), and the weights if asked."""
        n_q, n_k = q.shape[2], k.shape[2]
        if attn_mask is not None or (is_causal and n_k != n_q):
            # SDPA refuses a mask together with is_causal, and aligns its causal mask top-left when
            # there are more keys than queries (a cache); one merged mask serves both paths.
            attn_mask, is_causal = merge_masks(attn_mask, is_causal, n_q, n_k, q.device), False
        attn = None
        if self.diff:
            x, attn = variants.differential_attention(self, q, k, v, attn_mask, is_causal, return_attn)
        elif self.lsa:
            x, attn = variants.locality_attention(self, q, k, v, attn_mask, is_causal, return_attn)
        elif self.fused_attn and not return_attn:
            x = fused_attention(q, k, v, attn_mask, self.attn_drop.p if self.training else 0.0, is_causal)
        else:
            attn = attention_weights(q * self.scale, k, merge_masks(attn_mask, is_causal, n_q, n_k, q.device))
            x = self.attn_drop(attn) @ v
        return x.transpose(1, 2).reshape(q.shape[0], n_q, -1), attn

    def diff_lambda(self) -> torch.Tensor:
        """Differential attention's lambda, a scalar (timm's `_compute_lambda`)."""
        return variants.diff_lambda(self)


QKV_NAMES = ("q_proj", "k_proj", "v_proj")  # timm's unfused projections


class Attention(_AttentionBase):
    """Multi-head self-attention with one fused `qkv` projection (timm's names and layout).

    `causal=True` (the GPT's) lets token i attend to tokens <= i only; with a key/value cache the
    mask is aligned so that the newest token sees every cached one.

    timm's EVA layouts: `qkv_fused=False` gives separate `q_proj`, `k_proj`, `v_proj`; `k_bias=False`
    drops the key bias (BEiT, EVA: it adds the same score to every key of a query, which softmax
    ignores), the q and v biases then being `q_bias`, `v_bias` beside a bias-free `qkv`.
    `scale_norm` normalises the heads' output before `proj` (`norm`; EVA-CLIP's inner LayerNorm).
    `rope_half=False` takes rotary tables of interleaved pairs (EVA's; vit.position.rope_table).
    `num_kv_heads` < num_heads is grouped-query attention (timm's AttentionRope, Sapiens2): `k_proj`
    and `v_proj` give num_kv_heads heads, each read by num_heads // num_kv_heads query heads in a row.
    `diff=True`: differential attention (see _AttentionBase), `depth` the block's number; `lsa=True`:
    locality self-attention (see _AttentionBase; `log_temperature`).

    `rel_pos_type` adds learned relative positions to the scores, for tokens on a `grid` after
    `num_prefix_tokens` (vit.position): "bias" and "mlp" / "mlp_swin" are timm's RelPosBias and
    RelPosMlp (`rel_pos`, hidden width `rel_pos_dim`), "decomposed" SAM's `rel_pos_h`, `rel_pos_w`
    read by q (no prefix tokens). The bias joins `attn_mask`, so the fused path stays fused.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        qkv_bias: bool = True,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
        qk_norm: bool = False,
        norm: str = "layernorm",
        norm_eps: float = 1e-6,
        causal: bool = False,
        qkv_fused: bool = True,
        k_bias: bool = True,
        scale_norm: bool = False,
        rope_half: bool = True,
        proj_bias: bool = True,
        diff: bool = False,
        depth: int = 0,
        rel_pos_type: str = "",
        grid: tuple[int, int] | None = None,
        num_prefix_tokens: int = 0,
        rel_pos_dim: int = 128,
        num_kv_heads: int | None = None,
        lsa: bool = False,
    ) -> None:
        num_kv_heads = num_kv_heads or num_heads
        if num_heads % num_kv_heads or (num_kv_heads != num_heads and (qkv_fused or diff)):
            raise ValueError(f"num_kv_heads {num_kv_heads} must divide num_heads {num_heads}; fewer than num_heads "
                             "needs qkv_fused=False and no diff")  # fmt: skip
        kv_dim = dim // num_heads * num_kv_heads
        if qkv_fused:
            proj = {"qkv": nn.Linear(dim, dim * 3, bias=qkv_bias and k_bias)}
        else:
            widths = {"q_proj": dim, "k_proj": kv_dim, "v_proj": kv_dim}
            proj = {n: nn.Linear(dim, widths[n], bias=qkv_bias and (n != "k_proj" or k_bias)) for n in QKV_NAMES}
        super().__init__(
            dim, num_heads, attn_drop, proj_drop, qk_norm, norm, norm_eps, proj_bias, diff=diff, depth=depth, lsa=lsa,
            **proj,
        )  # fmt: skip
        self.num_kv_heads = num_kv_heads
        self.causal = causal
        if lsa and causal:
            raise ValueError("lsa (locality self-attention) keeps a token from attending to itself: with causal "
                             "attention the first token would attend to nothing")  # fmt: skip
        self.rope_half = rope_half
        separate = qkv_fused and qkv_bias and not k_bias
        self.q_bias = nn.Parameter(torch.zeros(dim)) if separate else None
        self.v_bias = nn.Parameter(torch.zeros(dim)) if separate else None
        self.norm = make_norm(norm, dim, norm_eps) if scale_norm else nn.Identity()
        variants.init_rel_pos(self, rel_pos_type, grid, num_prefix_tokens, rel_pos_dim)

    def position_bias(self, q: torch.Tensor, grid: tuple[int, int] | None = None) -> torch.Tensor | None:
        return variants.rel_pos_bias(self, q, grid)

    def _qkv(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, N, dim) -> (B, N, 3 * dim): q, k, v side by side, whichever the layout."""
        if not hasattr(self, "qkv"):
            return torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        if self.q_bias is None:
            return self.qkv(x)
        return F.linear(x, self.qkv.weight, torch.cat([self.q_bias, torch.zeros_like(self.q_bias), self.v_bias]))

    def forward(
        self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, **kw: Unpack[AttnArgs]
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """(B, N, dim) -> (B, N, dim), and the (B, heads, N, N) weights with `return_attn=True`.
        `attn_mask` follows SDPA (boolean True = may attend, or additive floats); the keywords: AttnArgs."""
        x, attn = self.with_weights(x, attn_mask, **kw)
        return (x, attn) if kw.get("return_attn") else x

    def with_weights(
        self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, **kw: Unpack[AttnArgs]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """forward's output and the weights, None unless `return_attn`: what a block reads."""
        x, attn = self.self_attention(self._qkv(x), attn_mask, **kw)
        return self.proj_drop(self.proj(self.norm(x))), attn


@torch.no_grad()
def mimetic_init_(attn: Attention, qk: tuple[float, float] = (0.7, 0.7), vo: tuple[float, float] = (0.4, 0.4)) -> None:
    """Initialise a self-attention layer so that, as in trained ViTs, each head's W_q W_k^T is near
    a scaled identity (tokens attend to themselves and to tokens with similar positions: local,
    convolution-like maps at step 0) and W_v W_proj near minus one (Trockman & Kolter, "Mimetic
    Initialization of Self-Attention Layers", ICML 2023, where ViTs trained with AdamW on small
    datasets learned faster; with Muon on CIFAR-10 it did not: benchmarks/budget.md).

    Per head, W_q W_k^T is the best rank-head_dim factorisation of a Z + b I (Z with N(0, 1/dim)
    entries, (a, b) = `qk`); W_v W_proj is a factorisation of a Z' - b' I ((a', b') = `vo`). The
    biases are zeroed. Shapes and parameter names do not change: only the starting point does."""
    dim = attn.proj.in_features
    if not hasattr(attn, "qkv") or attn.q_bias is not None or attn.qkv.in_features != dim:
        raise ValueError("mimetic init needs a width-preserving attention with one biased or bias-free qkv")
    eye = torch.eye(dim)

    def factors(a: float, b: float, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """L (dim, rank), R (rank, dim) with L @ R the best rank-`rank` approximation of a Z + b I."""
        u, s, vh = torch.linalg.svd(a * torch.randn(dim, dim) / dim**0.5 + b * eye)
        root = s[:rank].sqrt()
        return u[:, :rank] * root, root[:, None] * vh[:rank]

    w = attn.qkv.weight  # (3 dim, dim): q, k, v rows; nn.Linear computes x @ w.T
    for h in range(attn.num_heads):
        left, right = factors(*qk, attn.head_dim)  # q = x @ left, k = x @ right.T: q k^T = x (aZ + bI) x'^T
        rows = slice(h * attn.head_dim, (h + 1) * attn.head_dim)
        w[:dim][rows] = left.T.to(w)
        w[dim : 2 * dim][rows] = right.to(w)
    left, right = factors(vo[0], -vo[1], dim)  # v = x @ left, out = v @ right: W_v W_proj = a Z' - b' I
    w[2 * dim :] = left.T.to(w)
    attn.proj.weight.copy_(right.T)
    for bias in (attn.qkv.bias, attn.proj.bias):
        if bias is not None:
            bias.zero_()


class CrossAttention(_AttentionBase):
    """Queries from x, keys and values from another sequence (`context`, of width `context_dim`):
    separate `q` and `kv` projections, timm's names. Used by the attention-pool head."""

    def __init__(
        self, dim: int, num_heads: int = 8, context_dim: int | None = None, qkv_bias: bool = True,
        attn_drop: float = 0.0, proj_drop: float = 0.0, qk_norm: bool = False, norm: str = "layernorm",
        norm_eps: float = 1e-6,
    ) -> None:  # fmt: skip
        q, kv = nn.Linear(dim, dim, bias=qkv_bias), nn.Linear(context_dim or dim, dim * 2, bias=qkv_bias)
        super().__init__(dim, num_heads, attn_drop, proj_drop, qk_norm, norm, norm_eps, q=q, kv=kv)

    def forward(
        self,
        x: torch.Tensor,
        context: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        return_attn: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x (B, N, dim) attends to context (B, M, context_dim): (B, N, dim), and the (B, heads, N, M)
        weights with `return_attn=True`. `attn_mask` (B or 1, 1, N, M) follows SDPA."""
        B, M = context.shape[:2]
        kv = self.kv(context).reshape(B, M, 2, self.num_heads, self.head_dim)
        k, v = (t.transpose(1, 2) for t in kv.unbind(2))
        q, k = self.q_norm(self._heads(self.q(x))), self.k_norm(k)
        x, attn = self.attention(q, k, v, attn_mask, return_attn=return_attn)
        x = self.proj_drop(self.proj(x))
        return (x, attn) if return_attn else x


class AttentionPoolLatent(CrossAttention):
    """Multihead attention pooling (big_vision's MAP head; SigLIP's, timm's `global_pool="map"`):
    a learned query (`latent`) cross-attends to the tokens, then a residual MLP:
    y = proj(attn(latent, x)); y = y + mlp(norm(y)). Returns (B, dim). timm's parameter names."""

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        qk_norm: bool = False,
        norm: str = "layernorm",
        norm_eps: float = 1e-6,
        act: str = "gelu",
    ) -> None:
        super().__init__(dim, num_heads, qkv_bias=qkv_bias, qk_norm=qk_norm, norm=norm, norm_eps=norm_eps)
        self.latent = nn.Parameter(torch.zeros(1, 1, dim))
        nn.init.trunc_normal_(self.latent, std=dim**-0.5)
        self.norm = make_norm(norm, dim, norm_eps)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), act=act)  # a plain MLP whatever the blocks use, as timm
        self._recorded: list[torch.Tensor] | None = None

    def forward(
        self, x: torch.Tensor, return_attn: bool = False, attn_mask: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Tokens (B, N, dim) -> pooled (B, dim); with `return_attn`, also the query's (B, heads, 1, N) weights.
        `attn_mask` (B or 1, 1, 1, N) follows SDPA: padding tokens kept out of the pool (NaFlexVit)."""
        record = self._recorded is not None
        out = super().forward(self.latent.expand(x.shape[0], -1, -1), x, attn_mask, return_attn=return_attn or record)
        y, attn = out if return_attn or record else (out, None)
        if self._recorded is not None:
            self._recorded.append(attn)
        y = (y + self.mlp(self.norm(y)))[:, 0]
        return (y, attn) if return_attn else y

    @contextlib.contextmanager
    def recording(self) -> Iterator[list[torch.Tensor]]:
        """While open, each call also appends its query's weights (B, heads, 1, N) to the list it
        yields, computed explicitly: how attention rollout reads a MAP-pooled model, whichever
        family's pooling called the head."""
        self._recorded = []
        try:
            yield self._recorded
        finally:
            self._recorded = None
