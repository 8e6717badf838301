"""Position encodings that are not learned: sinusoidal tables and rotary embeddings (RoPE).

- `sincos_1d`: Vaswani et al. (2017), added to the token embeddings of the GPT (posemb="sincos").
- `sincos_2d`: big_vision's `posemb_sincos_2d`, added to the ViT's patch tokens (posemb="sincos2d");
  a fixed table does as well as a learned one on ImageNet (Beyer et al. 2022) and needs no resampling
  at a new resolution, it is simply recomputed.
- RoPE (Su et al. 2021): q and k are rotated by angles proportional to their positions, so
  q_m . k_n depends on m - n only. `rope_1d` for text, `rope_2d` for patch grids (axial: half of
  each head's rotation pairs turn with the row, the other half with the column; timm's
  `RotaryEmbeddingCat`, EVA-02's), `rope_2d_dinov3` (DINOv3's: grid normalised to [-1, 1], periods)
  and `MixedRope` (Heo et al. 2024: learned frequencies per block and head). Attention applies them
  with `apply_rope`; tokens before the table's positions (CLS, registers) are left unrotated.

By default the rotation pairs channel j with channel j + head_dim/2 ("rotate half", GPT-NeoX /
LLaMA layout); `rotate_half=False` pairs channel 2j with 2j + 1 (interleaved: EVA's, timm's
default). A table is (cos, sin), each (..., N, head_dim), every angle written twice in its layout.
"""

from __future__ import annotations

import math

import torch
from torch import nn


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
    # 1 / base^x rather than base^-x: timm's `freq_bands`, to the last bit.
    return 1.0 / base ** (torch.arange(num_pairs, dtype=torch.float32) / num_pairs)


def rope_table(angles: torch.Tensor, rotate_half: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., N, head_dim/2) angles -> (cos, sin), each (..., N, head_dim), in the rotation's layout:
    [a0, a1, ..., a0, a1, ...] for rotate-half pairs, [a0, a0, a1, a1, ...] for interleaved ones."""
    angles = torch.cat([angles, angles], dim=-1) if rotate_half else angles.repeat_interleave(2, dim=-1)
    return angles.cos(), angles.sin()


def rope_1d(positions: torch.Tensor, head_dim: int, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each (len(positions), head_dim), for tokens at these (integer) positions.

    Positions, not just a length, so a key/value cache passes `past + arange(T)` and the new
    tokens are rotated as they would have been in one full pass."""
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
    freqs = rope_frequencies(head_dim // 2, base).to(positions.device)
    return rope_table(positions.float()[:, None] * freqs[None])


def grid_coords(
    grid: tuple[int, int],
    offset: float | tuple[float, float] = 0.0,
    indexing: str = "ij",
    ref_grid: tuple[int, int] | None = None,
    centered: bool = False,
) -> torch.Tensor:
    """(H*W, 2) coordinates of a row-major H x W patch grid, as timm's `_build_grid` makes them.

    Row and column indices plus `offset` (one for both, or (row, column)); with `ref_grid` rescaled
    so the grid spans the reference one (EVA-02 fine-tuned at another size keeps its pretraining
    range); `centered` (DINOv3): patch centres (i + 0.5 + offset) / size mapped to [-1, 1].
    `indexing` "ij" gives (row, column) pairs, "xy" (column, row)."""
    offsets = offset if isinstance(offset, tuple) else (offset, offset)
    axes = []
    for i, size in enumerate(grid):
        if centered:
            t = (torch.arange(0.5, size, dtype=torch.float32) + offsets[i]) / size
        else:
            t = torch.arange(size).float() + offsets[i]
            t = t / size * ref_grid[i] if ref_grid is not None else t
        axes.append(t)
    rows, cols = torch.meshgrid(*axes, indexing="ij")
    coords = torch.stack([rows, cols] if indexing == "ij" else [cols, rows], dim=-1).reshape(-1, 2)
    return 2.0 * coords - 1.0 if centered else coords


def rope_2d(
    grid: tuple[int, int],
    head_dim: int,
    base: float = 10000.0,
    offset: float | tuple[float, float] = 0.0,
    indexing: str = "ij",
    ref_grid: tuple[int, int] | None = None,
    rotate_half: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each (H*W, head_dim), for a row-major H x W patch grid (axial 2-D RoPE; timm's
    `RotaryEmbeddingCat` with in_pixels=False, `base` its temperature).

    The first head_dim/4 rotation pairs turn with the first coordinate (the row for "ij", the
    column for "xy"), the last head_dim/4 with the other, each at the 1-D frequencies; so q.k
    depends on (row offset, column offset) only. `offset`, `ref_grid`: see grid_coords."""
    if head_dim % 4:
        raise ValueError(f"2-D RoPE needs a head_dim divisible by 4, got {head_dim}")
    coords = grid_coords(grid, offset, indexing, ref_grid)
    angles = (coords[:, :, None] * rope_frequencies(head_dim // 4, base)).flatten(1)  # (N, 2 * head_dim/4)
    return rope_table(angles, rotate_half)


def rope_2d_dinov3(
    grid: tuple[int, int],
    head_dim: int,
    temperature: float = 100.0,
    offset: float = 0.0,
    indexing: str = "ij",
    rotate_half: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DINOv3's 2-D RoPE (timm's `RotaryEmbeddingDinoV3`): angles 2 pi x / period for coordinates x
    normalised to [-1, 1] whatever the grid size, periods temperature^(i / (head_dim/4))."""
    if head_dim % 4:
        raise ValueError(f"2-D RoPE needs a head_dim divisible by 4, got {head_dim}")
    coords = grid_coords(grid, offset, indexing, centered=True)
    periods = temperature ** (2.0 * torch.arange(head_dim // 4, dtype=torch.float32) / (head_dim // 2))
    angles = (2 * math.pi * coords[:, :, None] / periods).flatten(1)  # timm's order of operations
    return rope_table(angles, rotate_half)


class MixedRope(nn.Module):
    """RoPE-Mixed (Heo et al. 2024, timm's `RotaryEmbeddingMixed`): every block and head turns its
    pairs by learned frequencies of both coordinates, f_x x + f_y y, so a head can follow diagonals.
    `freqs` (2, depth, heads, head_dim/2) is the one parameter (timm's name); interleaved pairs."""

    def __init__(self, head_dim: int, depth: int, num_heads: int, temperature: float = 10.0) -> None:
        super().__init__()
        if head_dim % 4:
            raise ValueError(f"mixed RoPE needs a head_dim divisible by 4, got {head_dim}")
        # Axial speeds, each head's pair of axes turned by a random angle (the paper's init).
        speed = 1.0 / temperature ** (torch.arange(0, head_dim, 4, dtype=torch.float32) / head_dim)
        turn = torch.rand(depth, num_heads, 1) * 2 * torch.pi
        fx = torch.cat([speed * turn.cos(), speed * (turn + torch.pi / 2).cos()], dim=-1)
        fy = torch.cat([speed * turn.sin(), speed * (turn + torch.pi / 2).sin()], dim=-1)
        self.freqs = nn.Parameter(torch.stack([fx, fy]))

    def forward(self, grid: tuple[int, int], indexing: str = "ij") -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each (depth, heads, H*W, head_dim): block i's table is [i]."""
        coords = grid_coords(grid, indexing=indexing).to(self.freqs.device)
        freqs = self.freqs.float()
        angles = coords[:, 0, None] * freqs[0][..., None, :] + coords[:, 1, None] * freqs[1][..., None, :]
        cos, sin = rope_table(angles, rotate_half=False)
        return cos.to(self.freqs.dtype), sin.to(self.freqs.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) on the two halves of the last axis: a 90-degree turn of every pair."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    """[x0, x1, x2, x3, ...] -> [-x1, x0, -x3, x2, ...]: the same turn for interleaved pairs."""
    return torch.stack([-x[..., 1::2], x[..., ::2]], dim=-1).reshape(x.shape)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, half: bool = True) -> torch.Tensor:
    """Rotate the last N tokens of x (..., tokens, head_dim) by an (..., N, head_dim) table, whose
    pairs are rotate-half (default) or interleaved (`half=False`, timm's name); see rope_table.

    Tokens before them (CLS and other prefix tokens) have no grid position and are left as they
    are, so they attend to and are attended by every patch the same way wherever it is."""
    n = cos.shape[-2]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    turn = rotate_half if half else rotate_pairs
    if n == x.shape[-2]:
        return x * cos + turn(x) * sin
    prefix, rest = x[..., :-n, :], x[..., -n:, :]
    return torch.cat([prefix, rest * cos + turn(rest) * sin], dim=-2)
