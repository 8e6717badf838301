"""Self- and cross-attention: masks, the key/value cache, the fused and the explicit path, the
MAP pooling head. timm's parameter names (`qkv`, `q_proj`, `proj`, `q_norm`, `latent`, ...)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from vit.layers.mlp import Mlp
from vit.layers.norm import make_norm
from vit.position import RelPosBias, RelPosMlp, apply_rope, decomposed_rel_pos_bias


def merge_masks(
    attn_mask: torch.Tensor | None, is_causal: bool, n_q: int, n_k: int, device: torch.device
) -> torch.Tensor | None:
    """Fold `is_causal` into `attn_mask` so both attention paths see one mask.

    Masks follow `scaled_dot_product_attention`: boolean True means "may attend", a float mask is
    added to the scores. The causal mask is aligned to the bottom-right, so the last query sees
    every key (this is what a key/value cache needs when n_q < n_k).
    """
    if not is_causal:
        return attn_mask
    causal = torch.ones(n_q, n_k, dtype=torch.bool, device=device).tril(diagonal=n_k - n_q)
    if attn_mask is None:
        return causal
    if attn_mask.dtype == torch.bool:
        return attn_mask & causal
    return attn_mask.masked_fill(~causal, float("-inf"))


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


def fused_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None, dropout_p: float, is_causal: bool
) -> torch.Tensor:
    """`F.scaled_dot_product_attention`, computed in fp32 for half-precision inputs on a CPU.

    PyTorch's CPU flash kernel in half precision is 3-6x slower than in fp32 at ViT sequence
    lengths (fwd+bwd, 32-64 tokens: 26.6 vs 4.1 ms; 197 tokens: 103 vs 100 ms), and under bf16
    autocast on an AMX Xeon it took over half of the ViT's training step; the matmuls around it
    stay in bf16. Autocast is switched off for the call, since it would cast the inputs back down.
    """
    if q.device.type != "cpu" or q.dtype not in (torch.bfloat16, torch.float16):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal)
    if attn_mask is not None and attn_mask.is_floating_point():
        attn_mask = attn_mask.float()
    with torch.autocast("cpu", enabled=False):
        x = F.scaled_dot_product_attention(
            q.float(), k.float(), v.float(), attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal
        )
    return x.to(q.dtype)


class _AttentionBase(nn.Module):
    """What self- and cross-attention share: heads, qk-norm, the two attention paths, the output
    projection. Subclasses compute q, k, v (B, heads, N, head_dim) and call `attend`, or, for
    self-attention, hand q, k, v side by side to `self_attention`.

    Two paths give the same output: the fused `F.scaled_dot_product_attention` (flash /
    memory-efficient kernels on GPU; the default) and an explicit softmax(QK^T/sqrt(d))V that can
    also return the attention weights. `fused_attn` is a per-module switch, and
    `return_attn=True` takes the explicit path for that one call only, so attention maps can be
    read while the rest of the model stays fused. `qk_norm=True` normalises q and k per head
    (timm's `q_norm`/`k_norm`; ViT-22B, for stable logits at scale), with the block's norm kind.

    `diff=True` is differential attention (Ye et al. 2024, "Differential Transformer"; timm's
    DiffAttention, its names): each head's q and k are split into two halves (heads 2h and 2h + 1 of
    head_dim / 2), giving two softmax maps A1, A2; the head reads v (full head width) through
    A1 - lambda A2, then a per-head RMSNorm (`sub_norm`) and the factor 1 - lambda_init, where
    lambda = exp(lambda_q1 . lambda_k1) - exp(lambda_q2 . lambda_k2) + lambda_init and lambda_init
    = 0.8 - 0.6 exp(-0.3 depth) for the block numbered `depth`. Its attention weights are
    A1 - lambda A2, (B, heads, N, N): rows sum to 1 - lambda, entries may be negative.
    `proj=False`: no output projection (a block that projects the heads itself).
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
        qk_norm: bool = False,
        norm: str = "layernorm",
        norm_eps: float = 1e-6,
        proj_bias: bool = True,
        diff: bool = False,
        depth: int = 0,
        proj: bool = True,
        **in_proj: nn.Module,
    ) -> None:
        super().__init__()
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
        self.q_norm = make_norm(norm, self.head_dim, norm_eps) if qk_norm else nn.Identity()
        self.k_norm = make_norm(norm, self.head_dim, norm_eps) if qk_norm else nn.Identity()
        self.attn_drop = nn.Dropout(attn_drop)
        self.diff = diff
        if diff:
            self.lambda_init = 0.8 - 0.6 * math.exp(-0.3 * depth)
            for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
                setattr(self, name, nn.Parameter(torch.randn(self.head_dim) * 0.1))
            self.sub_norm = nn.RMSNorm(2 * self.head_dim, eps=1e-5)  # timm's, whatever the block's norm
        if proj:
            self.proj = nn.Linear(dim, dim, bias=proj_bias)
            self.proj_drop = nn.Dropout(proj_drop)

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        """(B, N, dim) -> (B, heads, N, head_dim)."""
        return t.reshape(t.shape[0], t.shape[1], self.num_heads, self.head_dim).transpose(1, 2)

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        is_causal: bool = False,
        return_attn: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """softmax(q k^T / sqrt(d) + mask) v (diff: see the class), the heads side by side before the
        output projection: (B, Nq, heads x v's head width), and the weights if asked."""
        n_q, n_k = q.shape[2], k.shape[2]
        if attn_mask is not None or (is_causal and n_k != n_q):
            # SDPA refuses a mask together with is_causal, and aligns its causal mask top-left when
            # there are more keys than queries (a cache); one merged mask serves both paths.
            attn_mask, is_causal = merge_masks(attn_mask, is_causal, n_q, n_k, q.device), False
        dropout_p = self.attn_drop.p if self.training else 0.0
        attn = None
        if self.diff:
            lam = self.diff_lambda().type_as(q)
            if self.fused_attn and not return_attn:
                (q1, q2), (k1, k2) = (t.unflatten(1, (-1, 2)).unbind(2) for t in (q, k))
                x = fused_attention(q1, k1, v, attn_mask, dropout_p, is_causal)
                x = x - lam * fused_attention(q2, k2, v, attn_mask, dropout_p, is_causal)
            else:
                maps = attention_weights(q * self.scale, k, merge_masks(attn_mask, is_causal, n_q, n_k, q.device))
                maps = maps.unflatten(1, (-1, 2))  # (B, heads, 2, Nq, Nk): A1, A2 of each head
                attn = maps[:, :, 0] - lam * maps[:, :, 1]
                if self.training and self.attn_drop.p > 0:  # each map dropped on its own, as timm
                    dropped = self.attn_drop(maps)
                    x = (dropped[:, :, 0] - lam * dropped[:, :, 1]) @ v
                else:  # from the returned weights, so gradients can be taken of them (gradient rollout)
                    x = attn @ v
            x = self.sub_norm(x) * (1 - self.lambda_init)
        elif self.fused_attn and not return_attn:
            x = fused_attention(q, k, v, attn_mask, dropout_p, is_causal)
        else:
            attn = attention_weights(q * self.scale, k, merge_masks(attn_mask, is_causal, n_q, n_k, q.device))
            x = self.attn_drop(attn) @ v
        return x.transpose(1, 2).reshape(q.shape[0], n_q, -1), attn

    def diff_lambda(self) -> torch.Tensor:
        """Differential attention's lambda, a scalar (timm's `_compute_lambda`)."""
        lambda_1 = torch.exp(torch.sum(self.lambda_q1 * self.lambda_k1, dim=-1).float())
        lambda_2 = torch.exp(torch.sum(self.lambda_q2 * self.lambda_k2, dim=-1).float())
        return lambda_1 - lambda_2 + self.lambda_init

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        is_causal: bool = False,
        return_attn: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The attention, projected: (B, Nq, dim), and the weights if asked."""
        x, attn = self.attention(q, k, v, attn_mask, is_causal, return_attn)
        return self.proj_drop(self.proj(self.inner_norm(x))), attn

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
        """q, k, v side by side (B, N, 3 * dim) -> `attention` of them, before the output projection:
        q and k normed and rotated, the first `num_queries` tokens querying, keys and values cached.
        The arguments are Attention.forward's."""
        B, N = qkv.shape[:2]
        groups = self.num_heads // self.num_kv_heads
        if groups == 1:
            # Split on the "3" axis of (B, N, 3, heads, head_dim): in the backward, the stacked q/k/v
            # gradients then land in qkv's own layout. (permute(2, 0, 3, 1, 4).unbind(0) gives the same
            # views but makes the backward copy the whole qkv gradient once more.)
            q, k, v = qkv.reshape(B, N, 3, -1, self.head_dim).unbind(2)
        else:
            kv_dim = self.num_kv_heads * self.head_dim  # grouped-query attention: k and v are narrower than q
            parts = qkv.split([qkv.shape[-1] - 2 * kv_dim, kv_dim, kv_dim], dim=-1)
            q, k, v = (t.unflatten(-1, (-1, self.head_dim)) for t in parts)
        if self.diff:  # v: one head of twice the width per pair of q/k half-heads
            v = v.reshape(B, N, self.num_heads, 2 * self.head_dim)
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
            if attn_mask is not None and attn_mask.ndim >= 2 and attn_mask.shape[-2] == N:
                attn_mask = attn_mask[..., :num_queries, :]  # the queries' rows
        if kv_cache is not None:
            k, v = kv_cache.update(k, v)
        if groups > 1:
            # Grouped-query attention: query head h reads key/value head h // groups (timm's
            # repeat_interleave); expanded last, so norm, rotation and the cache keep the fewer heads.
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        return self.attention(q, k, v, attn_mask, self.causal, return_attn)

    def inner_norm(self, x: torch.Tensor) -> torch.Tensor:
        """The attention output before `proj`; self-attention may normalise it (scale_norm)."""
        return x

    def position_bias(self, q: torch.Tensor, grid: tuple[int, int] | None = None) -> torch.Tensor | None:
        """The relative positions' bias on the scores, (B | 1, heads, N, N), or None (see Attention)."""
        return None


def add_bias(attn_mask: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor | None:
    """An SDPA mask (boolean or additive) with an additive bias added: one float mask, the bias's dtype."""
    if bias is None:
        return attn_mask
    if attn_mask is None:
        return bias
    if attn_mask.dtype == torch.bool:
        return bias.masked_fill(~attn_mask, float("-inf"))
    return attn_mask.to(bias.dtype) + bias


QKV_NAMES = ("q_proj", "k_proj", "v_proj")  # timm's unfused projections
REL_POS_TYPES = ("", "bias", "mlp", "mlp_swin", "decomposed")


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
    `diff=True`: differential attention (see _AttentionBase), `depth` the block's number.

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
            dim, num_heads, attn_drop, proj_drop, qk_norm, norm, norm_eps, proj_bias, diff=diff, depth=depth, **proj
        )  # fmt: skip
        self.num_kv_heads = num_kv_heads
        self.causal = causal
        self.rope_half = rope_half
        separate = qkv_fused and qkv_bias and not k_bias
        self.q_bias = nn.Parameter(torch.zeros(dim)) if separate else None
        self.v_bias = nn.Parameter(torch.zeros(dim)) if separate else None
        self.norm = make_norm(norm, dim, norm_eps) if scale_norm else nn.Identity()
        if rel_pos_type and grid is None:
            raise ValueError(f"rel_pos_type={rel_pos_type!r} needs the token grid")
        self.grid = grid
        self.rel_pos = None
        if rel_pos_type == "bias":
            self.rel_pos = RelPosBias(grid, num_heads, num_prefix_tokens)
        elif rel_pos_type in ("mlp", "mlp_swin"):
            mode = "swin" if rel_pos_type == "mlp_swin" else "cr"
            self.rel_pos = RelPosMlp(grid, num_heads, rel_pos_dim, num_prefix_tokens, mode)
        elif rel_pos_type == "decomposed":
            if num_prefix_tokens:
                raise ValueError("decomposed relative positions are for patch tokens only, no prefix tokens")
            self.rel_pos_h = nn.Parameter(torch.zeros(2 * grid[0] - 1, self.head_dim))
            self.rel_pos_w = nn.Parameter(torch.zeros(2 * grid[1] - 1, self.head_dim))
        elif rel_pos_type:
            raise ValueError(f"unknown rel_pos_type {rel_pos_type!r}; expected one of {REL_POS_TYPES}")
        self.decomposed = rel_pos_type == "decomposed"

    def inner_norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x)

    def position_bias(self, q: torch.Tensor, grid: tuple[int, int] | None = None) -> torch.Tensor | None:
        grid = self.grid if grid is None else grid
        if self.rel_pos is not None:
            return self.rel_pos.get_bias(grid).to(q.dtype)
        if self.decomposed:
            return decomposed_rel_pos_bias(q, self.rel_pos_h, self.rel_pos_w, grid)
        return None

    def _qkv(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, N, dim) -> (B, N, 3 * dim): q, k, v side by side, whichever the layout."""
        if not hasattr(self, "qkv"):
            return torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        if self.q_bias is None:
            return self.qkv(x)
        return F.linear(x, self.qkv.weight, torch.cat([self.q_bias, torch.zeros_like(self.q_bias), self.v_bias]))

    def forward(
        self,
        x: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        kv_cache: KVCache | None = None,
        num_queries: int | None = None,
        return_attn: bool = False,
        grid: tuple[int, int] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """(B, N, dim) -> (B, N, dim), and the (B, heads, N, N) weights with `return_attn=True`.

        `attn_mask` follows SDPA (boolean True = may attend, or additive floats).
        `rope`: (cos, sin) tables (vit.position) for the last len(cos) tokens of x, (N, head_dim) or
        per image and/or head (B | 1, heads | 1, N, head_dim); q and k are rotated (after qk-norm,
        before caching), earlier (prefix) tokens are not.
        `kv_cache`: x holds only new tokens; they attend to the cached ones too, and are cached.
        `num_queries=n`: only the first n tokens query (keys and values are still every token), so
        the output is (B, n, dim): for a classifier that reads only the CLS token. Not with masks.
        `grid`: the patch grid of the tokens after the prefix, for relative positions; None: the built one.
        """
        x, attn = self.self_attention(self._qkv(x), attn_mask, rope, kv_cache, num_queries, return_attn, grid)
        x = self.proj_drop(self.proj(self.norm(x)))
        return (x, attn) if return_attn else x


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
        self,
        dim: int,
        num_heads: int = 8,
        context_dim: int | None = None,
        qkv_bias: bool = True,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
        qk_norm: bool = False,
        norm: str = "layernorm",
        norm_eps: float = 1e-6,
    ) -> None:
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
        x, attn = self.attend(q, k, v, attn_mask, return_attn=return_attn)
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


def attention_weights(q: torch.Tensor, k: torch.Tensor, attn_mask: torch.Tensor | None) -> torch.Tensor:
    """softmax(q k^T + mask) over the keys; q is already scaled. Returns (B, heads, Nq, Nk)."""
    scores = q @ k.transpose(-2, -1)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask
    return scores.softmax(dim=-1)
