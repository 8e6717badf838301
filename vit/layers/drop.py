"""What scales a residual branch: stochastic depth (DropPath) and LayerScale."""

from __future__ import annotations

import torch
from torch import nn


class DropPath(nn.Module):
    """Stochastic depth: drop the whole residual branch for a random subset of samples.

    Kept samples are scaled by 1/keep_prob so the expected output is unchanged.
    """

    def __init__(self, drop_prob: float = 0.0) -> None:
        super().__init__()
        self.drop_prob = drop_prob

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.drop_prob == 0.0 or not self.training:
            return x
        keep_prob = 1.0 - self.drop_prob
        mask = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep_prob)
        return x * mask / keep_prob

    def extra_repr(self) -> str:
        return f"drop_prob={self.drop_prob}"


class LayerScale(nn.Module):
    """Per-channel learned scale of a residual branch (CaiT / DeiT-III), started small."""

    def __init__(self, dim: int, init_values: float = 1e-5) -> None:
        super().__init__()
        self.init_values = init_values
        self.gamma = nn.Parameter(torch.full((dim,), init_values))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma
