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

Relative positions, learned, add a bias per pair of tokens to the attention scores, from the
tokens' offset on the patch grid: `RelPosBias` (a table per offset; Swin, BEiT), `RelPosMlp` (an
MLP of log-spaced offsets; Swin-V2 and timm's variant) and `decomposed_rel_pos_bias` (MViTv2 and
SAM: per-axis embeddings read by the query). Attention adds them as a float mask, fused or not.

By default the rotation pairs channel j with channel j + head_dim/2 ("rotate half", GPT-NeoX /
LLaMA layout); `rotate_half=False` pairs channel 2j with 2j + 1 (interleaved: EVA's, timm's
default). A table is (cos, sin), each (..., N, head_dim), every angle written twice in its layout.
"""

from __future__ import annotations

import math
from collections import OrderedDict

import torch
import torch.nn.functional as F
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
    coord_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DINOv3's 2-D RoPE (timm's `RotaryEmbeddingDinoV3`): angles 2 pi x / period for coordinates x
    normalised to [-1, 1] whatever the grid size, periods temperature^(i / (head_dim/4)).
    `coord_scale` multiplies the coordinates (timm's train-time `rescale_coords` draw, see vit.eva)."""
    if head_dim % 4:
        raise ValueError(f"2-D RoPE needs a head_dim divisible by 4, got {head_dim}")
    coords = grid_coords(grid, offset, indexing, centered=True)
    if coord_scale is not None:
        coords = coords * coord_scale
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
        return torch.addcmul(x * cos, turn(x), sin)  # x cos + turn(x) sin, one pass fewer
    prefix, rest = x[..., :-n, :], x[..., -n:, :]
    return torch.cat([prefix, torch.addcmul(rest * cos, turn(rest), sin)], dim=-2)


# -- relative positions ----------------------------------------------------------------------------


def relative_position_index(grid: tuple[int, int], class_token: bool = False) -> torch.Tensor:
    """(N, N) index of each pair's grid offset into a (2H-1)(2W-1) table, row-major over the grid (timm's
    `gen_relative_position_index`). With `class_token` (BEiT's) the index is padded by one token, whose
    pairs take the table's 3 last entries: token to CLS, CLS to token, CLS to itself."""
    h, w = grid
    coords = torch.stack(torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")).flatten(1)  # (2, N)
    offsets = coords[:, :, None] - coords[:, None, :]  # (2, N, N)
    index = (offsets[0] + h - 1) * (2 * w - 1) + offsets[1] + w - 1
    if class_token:
        size = (2 * h - 1) * (2 * w - 1)
        index = F.pad(index, [1, 0, 1, 0])
        index[0, :], index[:, 0], index[0, 0] = size, size + 1, size + 2
    return index


def relative_log_coords(grid: tuple[int, int], mode: str = "cr") -> torch.Tensor:
    """(2H-1, 2W-1, 2) grid offsets, log-spaced: sign(d) log(1 + |d|) ("cr", timm's), or Swin-V2's
    offsets scaled to [-8, 8] then sign(d) log2(1 + |d|) / 3 ("swin")."""
    axes = [torch.arange(-(n - 1), n).float() for n in grid]
    if mode == "swin":  # timm divides by size - 1; sym_max keeps a traced grid symbolic
        axes = [a / torch.sym_max(n - 1, 1) * 8 for a, n in zip(axes, grid, strict=True)]
    coords = torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=-1)
    if mode == "swin":
        return torch.sign(coords) * torch.log2(1.0 + coords.abs()) / math.log2(8)
    return torch.sign(coords) * torch.log(1.0 + coords.abs())


class RelPosBias(nn.Module):
    """A learned bias per head for every grid offset (Swin-V1, BEiT; timm's `RelPosBias`, its names):
    `relative_position_bias_table` ((2H-1)(2W-1) (+ 3 with a CLS token), heads)."""

    def __init__(self, grid: tuple[int, int], num_heads: int, prefix_tokens: int = 0) -> None:
        super().__init__()
        if prefix_tokens > 1:
            raise ValueError(f"a relative position table has entries for one prefix token, not {prefix_tokens}")
        self.grid, self.prefix_tokens = tuple(grid), prefix_tokens
        size = (2 * grid[0] - 1) * (2 * grid[1] - 1) + 3 * prefix_tokens
        self.relative_position_bias_table = nn.Parameter(torch.zeros(size, num_heads))
        nn.init.trunc_normal_(self.relative_position_bias_table, std=0.02)
        index = relative_position_index(self.grid, class_token=prefix_tokens > 0).flatten()
        self.register_buffer("relative_position_index", index, persistent=False)  # timm's: not in checkpoints

    def get_bias(self, grid: tuple[int, int] | None = None) -> torch.Tensor:
        """(1, heads, N, N), N = prefix + H*W: the scores' bias (timm's name). The table holds the built
        grid's offsets only: another `grid` is a ValueError."""
        if grid is not None and tuple(grid) != self.grid:
            raise ValueError(f"a relative position bias table of a {self.grid[0]}x{self.grid[1]} grid cannot bias a "
                             f"{grid[0]}x{grid[1]} one; build the model with that img_size")  # fmt: skip
        n = self.grid[0] * self.grid[1] + self.prefix_tokens
        return self.relative_position_bias_table[self.relative_position_index].view(n, n, -1).permute(2, 0, 1)[None]


class RelPosMlp(nn.Module):
    """The bias of every grid offset computed by a 2-layer MLP of the log-spaced offset (Swin-V2's
    continuous position bias; timm's `RelPosMlp`, its names): `mlp.fc1`, ReLU, dropout 0.125 (while
    training), `mlp.fc2` to one value per head. mode "cr" (timm's) uses it as it is; "swin" scales
    16 sigmoid(.) and has no fc2 bias. Prefix tokens get no bias."""

    def __init__(
        self, grid: tuple[int, int], num_heads: int, hidden_dim: int = 128, prefix_tokens: int = 0, mode: str = "cr"
    ) -> None:
        super().__init__()
        if mode not in ("cr", "swin"):
            raise ValueError(f"RelPosMlp mode must be 'cr' or 'swin', got {mode!r}")
        self.grid, self.prefix_tokens, self.mode = tuple(grid), prefix_tokens, mode
        self.mlp = nn.Sequential(OrderedDict([
            ("fc1", nn.Linear(2, hidden_dim)), ("act", nn.ReLU()), ("drop1", nn.Dropout(0.125)),
            ("fc2", nn.Linear(hidden_dim, num_heads, bias=mode != "swin")),
        ]))  # fmt: skip
        self.register_buffer("relative_position_index", relative_position_index(self.grid).flatten(), persistent=False)
        self.register_buffer("rel_coords_log", relative_log_coords(self.grid, mode), persistent=False)

    def get_bias(self, grid: tuple[int, int] | None = None) -> torch.Tensor:
        """(1, heads, N, N), N = prefix + H*W: the scores' bias (timm's name), for the built grid or
        another `grid`, whose offsets go through the same MLP (timm's `set_window_size`)."""
        if grid is None or tuple(grid) == self.grid:
            grid, coords, index = self.grid, self.rel_coords_log, self.relative_position_index
        else:  # tensor ops of the grid's sizes, so an exported graph computes them for any grid
            device = self.rel_coords_log.device
            coords = relative_log_coords(grid, self.mode).to(device)
            index = relative_position_index(grid).flatten().to(device)
        n = grid[0] * grid[1]
        table = self.mlp(coords).flatten(0, 1)  # ((2H-1)(2W-1), heads)
        bias = table[index].view(n, n, -1).permute(2, 0, 1)
        if self.mode == "swin":
            bias = 16 * torch.sigmoid(bias)
        return F.pad(bias, [self.prefix_tokens, 0, self.prefix_tokens, 0])[None]


def decomposed_rel_pos_bias(
    q: torch.Tensor, rel_pos_h: torch.Tensor, rel_pos_w: torch.Tensor, grid: tuple[int, int]
) -> torch.Tensor:
    """MViTv2's and SAM's decomposed relative positions (timm's `get_decomposed_rel_pos_bias`): the bias
    of query (i, j) for key (k, l) is q . rel_pos_h[i - k + H - 1] + q . rel_pos_w[j - l + W - 1], q
    unscaled. q (B, heads, H*W, head_dim), rel_pos_h (2H-1, head_dim), rel_pos_w (2W-1, head_dim);
    returns (B, heads, H*W, H*W). Tables of another grid's length are resampled linearly to 2H-1 and
    2W-1 (timm's `get_rel_pos`)."""
    h, w = grid
    ih, iw = torch.arange(h, device=q.device), torch.arange(w, device=q.device)
    rh = resample_rel_pos(rel_pos_h, 2 * h - 1)[ih[:, None] - ih[None, :] + h - 1]  # (H, H, head_dim)
    rw = resample_rel_pos(rel_pos_w, 2 * w - 1)[iw[:, None] - iw[None, :] + w - 1]  # (W, W, head_dim)
    r_q = q.unflatten(-2, (h, w))  # (B, heads, H, W, head_dim)
    rel_h = torch.einsum("...hwc,hkc->...hwk", r_q, rh.to(q.dtype))
    rel_w = torch.einsum("...hwc,wkc->...hwk", r_q, rw.to(q.dtype))
    return (rel_h[..., :, None] + rel_w[..., None, :]).flatten(-4, -3).flatten(-2)


def resample_rel_pos(table: torch.Tensor, length: int) -> torch.Tensor:
    """A (L, C) table of relative positions linearly resampled to `length` rows (SAM's and timm's
    `get_rel_pos`); vit.checkpoint fits a checkpoint's tables to a model's grid with it."""
    if table.shape[0] == length:
        return table
    return F.interpolate(table.T[None], size=length, mode="linear")[0].T
