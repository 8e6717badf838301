"""Windowed attention's token layout (SAM, ViTDet): a grid's tokens cut into windows and put back,
and per-window attention weights placed on the whole grid."""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
