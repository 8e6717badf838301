"""Position encodings that are not learned: sinusoidal tables and rotary embeddings (RoPE).

- `sincos_1d`: Vaswani et al. (2017), added to the token embeddings of the GPT (posemb="sincos").
- `sincos_2d`: big_vision's `posemb_sincos_2d`, added to the ViT's patch tokens (posemb="sincos2d");
  a fixed table does as well as a learned one on ImageNet (Beyer et al. 2022) and needs no resampling
  at a new resolution, it is simply recomputed.
- RoPE (Su et al. 2021): q and k are rotated by angles proportional to their positions, so
  q_m . k_n depends on m - n only. `rope_1d` for text, `rope_2d` for patch grids (axial: half of
  each head's rotation pairs turn with the row, the other half with the column). Attention applies
  them with `apply_rope`; tokens before the table's positions (CLS) are left unrotated.

The rotation pairs channel j with channel j + head_dim/2 ("rotate half", GPT-NeoX / LLaMA layout);
a table is (cos, sin), each (N, head_dim), both halves repeating the same N x head_dim/2 angles.
"""

from __future__ import annotations

import torch


def sincos_1d(length: int, dim: int, temperature: float = 10000.0) -> torch.Tensor:
    """(length, dim): PE[p, 2i] = sin(p / T^(2i/dim)), PE[p, 2i+1] = cos(p / T^(2i/dim))."""
    if dim % 2:
        raise ValueError(f"sincos_1d needs an even width, got {dim}")
    pos = torch.arange(length, dtype=torch.float32)[:, None]
    omega = temperature ** (-torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    angles = pos * omega  # (length, dim/2)
    return torch.stack([angles.sin(), angles.cos()], dim=-1).reshape(length, dim)


def sincos_2d(height: int, width: int, dim: int, temperature: float = 10000.0) -> torch.Tensor:
    """(height * width, dim), row-major over the grid, as big_vision's `posemb_sincos_2d`:
    omega_i = T^(-i / (dim/4 - 1)) for i < dim/4, and the table is
    [sin(x omega), cos(x omega), sin(y omega), cos(y omega)] with x the column and y the row."""
    if dim % 4:
        raise ValueError(f"sincos_2d needs a width divisible by 4, got {dim}")
    quarter = dim // 4
    y, x = torch.meshgrid(torch.arange(height), torch.arange(width), indexing="ij")
    omega = temperature ** (-torch.arange(quarter, dtype=torch.float32) / max(quarter - 1, 1))
    y = y.flatten().float()[:, None] * omega[None]
    x = x.flatten().float()[:, None] * omega[None]
    return torch.cat([x.sin(), x.cos(), y.sin(), y.cos()], dim=1)


def rope_frequencies(num_pairs: int, base: float = 10000.0) -> torch.Tensor:
    """The (num_pairs,) rotation speeds base^(-i/num_pairs): from one radian per position down to
    ~1/base, so some pairs resolve neighbours and others distances of thousands of positions."""
    return base ** (-torch.arange(num_pairs, dtype=torch.float32) / num_pairs)


def _cos_sin(angles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.cat([angles, angles], dim=-1)  # channel j and j + head_dim/2 turn together
    return angles.cos(), angles.sin()


def rope_1d(positions: torch.Tensor, head_dim: int, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each (len(positions), head_dim), for tokens at these (integer) positions.

    Positions, not just a length, so a key/value cache passes `past + arange(T)` and the new
    tokens are rotated as they would have been in one full pass."""
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
    freqs = rope_frequencies(head_dim // 2, base).to(positions.device)
    return _cos_sin(positions.float()[:, None] * freqs[None])


def rope_2d(
    grid: tuple[int, int], head_dim: int, base: float = 10000.0, offset: tuple[int, int] = (0, 0)
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each (H*W, head_dim), for a row-major H x W patch grid (axial 2-D RoPE).

    The first head_dim/4 rotation pairs turn with the row index, the last head_dim/4 with the
    column, each at the 1-D frequencies; so q.k depends on (row offset, column offset) only.
    `offset` shifts the grid (the tests use it to check that property)."""
    if head_dim % 4:
        raise ValueError(f"2-D RoPE needs a head_dim divisible by 4, got {head_dim}")
    rows, cols = torch.meshgrid(torch.arange(grid[0]), torch.arange(grid[1]), indexing="ij")
    freqs = rope_frequencies(head_dim // 4, base)
    rows = (rows.flatten().float() + offset[0])[:, None] * freqs[None]
    cols = (cols.flatten().float() + offset[1])[:, None] * freqs[None]
    return _cos_sin(torch.cat([rows, cols], dim=-1))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) on the two halves of the last axis: a 90-degree turn of every pair."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the last N tokens of x (..., tokens, head_dim) by an (N, head_dim) table.

    Tokens before them (CLS and other prefix tokens) have no grid position and are left as they
    are, so they attend to and are attended by every patch the same way wherever it is."""
    n = cos.shape[-2]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    if n == x.shape[-2]:
        return x * cos + rotate_half(x) * sin
    prefix, rest = x[..., :-n, :], x[..., -n:, :]
    return torch.cat([prefix, rest * cos + rotate_half(rest) * sin], dim=-2)
