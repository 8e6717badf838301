"""The attention variants that change the math, each plugged into one hook of the core path
(vit.layers.attention._AttentionBase.self_attention):

- relative positions, a learned bias on the scores (`init_rel_pos`, `rel_pos_bias`: the `position_bias` hook);
- grouped key/value heads, fewer k/v heads read by several query heads (`split_qkv`, `expand_kv`);
- differential attention, two softmax maps, one subtracted (`init_differential`, `differential_attention`:
  the `attention` hook);
- locality self-attention, a learned temperature and no token attending to itself (`init_locality`,
  `locality_attention`: the `attention` hook);
- windows, the tokens cut into windows before the attention runs (`window_partition`, ...: WindowBlock).

The parameters a variant needs are registered on the attention layer itself, under timm's names
(`rel_pos`, `rel_pos_h`, `lambda_q1`, `sub_norm`, ...), so timm's state dicts load unchanged.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from vit.layers.sdpa import add_bias, attention_weights, fused_attention, merge_masks
from vit.position import RelPosBias, RelPosMlp, decomposed_rel_pos_bias

REL_POS_TYPES = ("", "bias", "mlp", "mlp_swin", "decomposed")


def init_rel_pos(
    attn: nn.Module, rel_pos_type: str, grid: tuple[int, int] | None, num_prefix_tokens: int, rel_pos_dim: int
) -> None:
    """Register the relative positions' parameters on `attn`: "bias" and "mlp" / "mlp_swin" are timm's
    RelPosBias and RelPosMlp (`rel_pos`, hidden width `rel_pos_dim`) over `grid` after `num_prefix_tokens`,
    "decomposed" SAM's `rel_pos_h`, `rel_pos_w` read by q (no prefix tokens); "": none."""
    if rel_pos_type and grid is None:
        raise ValueError(f"rel_pos_type={rel_pos_type!r} needs the token grid")
    attn.grid = grid
    attn.rel_pos = None
    if rel_pos_type == "bias":
        attn.rel_pos = RelPosBias(grid, attn.num_heads, num_prefix_tokens)
    elif rel_pos_type in ("mlp", "mlp_swin"):
        mode = "swin" if rel_pos_type == "mlp_swin" else "cr"
        attn.rel_pos = RelPosMlp(grid, attn.num_heads, rel_pos_dim, num_prefix_tokens, mode)
    elif rel_pos_type == "decomposed":
        if num_prefix_tokens:
            raise ValueError("decomposed relative positions are for patch tokens only, no prefix tokens")
        attn.rel_pos_h = nn.Parameter(torch.zeros(2 * grid[0] - 1, attn.head_dim))
        attn.rel_pos_w = nn.Parameter(torch.zeros(2 * grid[1] - 1, attn.head_dim))
    elif rel_pos_type:
        raise ValueError(f"unknown rel_pos_type {rel_pos_type!r}; expected one of {REL_POS_TYPES}")
    attn.decomposed = rel_pos_type == "decomposed"


def rel_pos_bias(attn: nn.Module, q: torch.Tensor, grid: tuple[int, int] | None) -> torch.Tensor | None:
    """The bias `init_rel_pos` set up, on the scores of queries q over `grid` (None: the built one):
    (B | 1, heads, N, N), or None without relative positions."""
    grid = attn.grid if grid is None else grid
    if attn.rel_pos is not None:
        return attn.rel_pos.get_bias(grid).to(q.dtype)
    if attn.decomposed:
        return decomposed_rel_pos_bias(q, attn.rel_pos_h, attn.rel_pos_w, grid)
    return None


def split_qkv(
    qkv: torch.Tensor, head_dim: int, groups: int = 1, v_head_dim: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v side by side (B, N, width) -> each (B, N, heads, head_dim). With `groups` > 1 (grouped-query
    attention) k and v have `groups` times fewer heads than q; `v_head_dim`: v's heads are that wide
    (differential attention's: twice head_dim)."""
    B, N, width = qkv.shape
    if groups == 1:
        # Split on the "3" axis of (B, N, 3, heads, head_dim): in the backward, the stacked q/k/v
        # gradients then land in qkv's own layout. (permute(2, 0, 3, 1, 4).unbind(0) gives the same
        # views but makes the backward copy the whole qkv gradient once more.)
        q, k, v = qkv.reshape(B, N, 3, -1, head_dim).unbind(2)
    else:
        kv_dim = width // (groups + 2)  # q is `groups` times as wide as k and as v
        q, k, v = (t.unflatten(-1, (-1, head_dim)) for t in qkv.split([width - 2 * kv_dim, kv_dim, kv_dim], dim=-1))
    if v_head_dim is not None and v_head_dim != head_dim:
        v = v.reshape(B, N, -1, v_head_dim)
    return q, k, v


def expand_kv(k: torch.Tensor, v: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped-query attention: query head h reads key/value head h // groups (timm's
    repeat_interleave); done last, so norm, rotation and the cache keep the fewer heads."""
    if groups == 1:
        return k, v
    return k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)


def init_differential(attn: nn.Module, depth: int) -> None:
    """Register differential attention's parameters on `attn` (timm's DiffAttention names): the lambda
    vectors and the per-head `sub_norm`; `depth`, the block's number, sets lambda_init."""
    attn.lambda_init = 0.8 - 0.6 * math.exp(-0.3 * depth)
    for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
        setattr(attn, name, nn.Parameter(torch.randn(attn.head_dim) * 0.1))
    attn.sub_norm = nn.RMSNorm(2 * attn.head_dim, eps=1e-5)  # timm's, whatever the block's norm


def diff_lambda(attn: nn.Module) -> torch.Tensor:
    """Differential attention's lambda, a scalar (timm's `_compute_lambda`)."""
    lambda_1 = torch.exp(torch.sum(attn.lambda_q1 * attn.lambda_k1, dim=-1).float())
    lambda_2 = torch.exp(torch.sum(attn.lambda_q2 * attn.lambda_k2, dim=-1).float())
    return lambda_1 - lambda_2 + attn.lambda_init


def differential_attention(
    attn: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None,
    is_causal: bool, return_attn: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """Differential attention (Ye et al. 2024, "Differential Transformer"; timm's DiffAttention): q and k
    (B, 2 x heads, N, head_dim) are each head's two halves, giving two softmax maps A1, A2; the head
    reads v (B, heads, N, 2 x head_dim) through A1 - lambda A2, then `sub_norm` and the factor
    1 - lambda_init. Returns (B, heads, Nq, 2 x head_dim) and, on the explicit path, the weights
    A1 - lambda A2 (B, heads, Nq, Nk): rows sum to 1 - lambda, entries may be negative."""
    lam = diff_lambda(attn).type_as(q)
    dropout_p = attn.attn_drop.p if attn.training else 0.0
    weights = None
    if attn.fused_attn and not return_attn:
        (q1, q2), (k1, k2) = (t.unflatten(1, (-1, 2)).unbind(2) for t in (q, k))
        x = fused_attention(q1, k1, v, attn_mask, dropout_p, is_causal)
        x = x - lam * fused_attention(q2, k2, v, attn_mask, dropout_p, is_causal)
    else:
        n_q, n_k = q.shape[2], k.shape[2]
        maps = attention_weights(q * attn.scale, k, merge_masks(attn_mask, is_causal, n_q, n_k, q.device))
        maps = maps.unflatten(1, (-1, 2))  # (B, heads, 2, Nq, Nk): A1, A2 of each head
        weights = maps[:, :, 0] - lam * maps[:, :, 1]
        if attn.training and attn.attn_drop.p > 0:  # each map dropped on its own, as timm
            dropped = attn.attn_drop(maps)
            x = (dropped[:, :, 0] - lam * dropped[:, :, 1]) @ v
        else:  # from the returned weights, so gradients can be taken of them (gradient rollout)
            x = weights @ v
    return attn.sub_norm(x) * (1 - attn.lambda_init), weights


def init_locality(attn: nn.Module) -> None:
    """Register locality self-attention's temperature on `attn`: one scalar a layer, tau = sqrt(head_dim)
    at the start (plain attention's scale). Kept as log(tau), so that tau stays positive and a step
    changes it by a factor rather than by an amount that could cross zero."""
    attn.log_temperature = nn.Parameter(torch.tensor(math.log(attn.head_dim**0.5)))


def locality_attention(
    attn: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None,
    is_causal: bool, return_attn: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """Locality self-attention (Lee, Lee & Song 2021, "Vision Transformer for Small-Size Datasets"):
    softmax(q k^T / tau + mask) v with tau learned (`init_locality`) and each query's score with the
    key of the same token at -inf, so a token's output is drawn from the other tokens only, which
    sharpens the maps a small dataset otherwise leaves flat. Query i is token i (the first Nq tokens:
    `num_queries` keeps that). Returns (B, heads, Nq, head_dim) and, on the explicit path, the weights."""
    if is_causal or attn.causal:
        raise ValueError("attn_layer='lsa' keeps each token from attending to itself: with causal attention the "
                         "first token would attend to nothing; use attn_layer='attn'")  # fmt: skip
    n_q, n_k = q.shape[2], k.shape[2]
    if n_k < 2:
        raise ValueError(f"attn_layer='lsa' needs at least 2 tokens (each attends to the others), got {n_k}")
    diagonal = torch.zeros(n_q, n_k, dtype=q.dtype, device=q.device).fill_diagonal_(float("-inf"))
    attn_mask = add_bias(attn_mask, diagonal)
    inverse_tau = attn.log_temperature.neg().exp().to(q.dtype)
    if attn.fused_attn and not return_attn:
        # SDPA multiplies by 1 / sqrt(head_dim) itself (a float, not a tensor): q carries the rest
        dropout_p = attn.attn_drop.p if attn.training else 0.0
        return fused_attention(q * (inverse_tau / attn.scale), k, v, attn_mask, dropout_p, False), None
    weights = attention_weights(q * inverse_tau, k, attn_mask)
    return attn.attn_drop(weights) @ v, weights


def window_attention_to_grid(attn: torch.Tensor, grid: tuple[int, int], size: int) -> torch.Tensor:
    """A windowed block's weights (B x windows, heads, size^2, size^2), windows as window_partition lays
    them out -> (B, heads, H*W, H*W) over the grid's tokens: each token's weights on the tokens of its
    window, zero elsewhere. The padding's columns are dropped (a row keeps its weight on real tokens)."""
    h, w = grid
    rows, cols = (h + size - 1) // size, (w + size - 1) // size
    width, n, heads, device = cols * size, rows * size * cols * size, attn.shape[1], attn.device
    # each window's tokens as indices into the padded grid, row-major, windows row-major
    ys = torch.arange(rows, device=device)[:, None, None, None] * size + torch.arange(size, device=device)[:, None]
    xs = torch.arange(cols, device=device)[:, None, None] * size + torch.arange(size, device=device)
    index = (ys * width + xs).reshape(rows * cols, size * size)
    flat = (index[:, :, None] * n + index[:, None, :]).flatten()
    values = attn.unflatten(0, (-1, rows * cols)).transpose(1, 2).flatten(2)  # (B, heads, windows x size^4)
    full = attn.new_zeros(values.shape[0], heads, n * n).index_copy(2, flat, values).view(-1, heads, n, n)
    keep = (torch.arange(h, device=device)[:, None] * width + torch.arange(w, device=device)).flatten()
    return full[:, :, keep][:, :, :, keep]


def window_partition(x: torch.Tensor, grid: tuple[int, int], size: int) -> tuple[torch.Tensor, tuple[int, int]]:
    """Tokens (B, H*W, C) of a row-major grid -> (B x windows, size*size, C), the grid zero-padded on the
    bottom and right to whole windows, windows row-major; and the padded grid (timm's SAM's)."""
    (h, w), c = grid, x.shape[-1]
    # Windows down and across; ONNX's integer Div truncates, so an exported -(-h // size) would round down.
    rows, cols = (h + size - 1) // size, (w + size - 1) // size
    x = F.pad(x.view(-1, h, w, c), (0, 0, 0, cols * size - w, 0, rows * size - h))
    x = x.view(-1, rows, size, cols, size, c).transpose(2, 3)
    return x.reshape(-1, size * size, c), (rows * size, cols * size)


def window_unpartition(
    windows: torch.Tensor, grid: tuple[int, int], padded: tuple[int, int], size: int
) -> torch.Tensor:
    """window_partition's inverse: (B x windows, size*size, C) -> (B, H*W, C), the padding dropped."""
    (h, w), (hp, wp), c = grid, padded, windows.shape[-1]
    x = windows.view(-1, hp // size, wp // size, size, size, c).transpose(2, 3).reshape(-1, hp, wp, c)
    return x[:, :h, :w].reshape(-1, h * w, c)
