"""Normalisation and activation layers by name (timm's names)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def make_norm(kind: str, dim: int, eps: float = 1e-6) -> nn.Module:
    """A normalisation layer by name. eps=1e-6 as in timm/big_vision ViTs (PyTorch's default is 1e-5,
    which CLIP's weights were trained with).

    "rmsnorm" (Zhang & Sennrich 2019; LLaMA) scales by the root mean square without centring and
    has no bias: a little cheaper, and in practice as good as LayerNorm."""
    if kind == "layernorm":
        return nn.LayerNorm(dim, eps=eps)
    if kind == "rmsnorm":
        return nn.RMSNorm(dim, eps=eps)
    raise ValueError(f"unknown norm {kind!r}; expected 'layernorm' or 'rmsnorm'")


class LayerNorm2d(nn.LayerNorm):
    """LayerNorm over the channels of a (B, C, H, W) map (timm's LayerNorm2d, eps 1e-6; SAM's neck)."""

    def __init__(self, num_channels: int, eps: float = 1e-6) -> None:
        super().__init__(num_channels, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.layer_norm(x.permute(0, 2, 3, 1), self.normalized_shape, self.weight, self.bias, self.eps)
        return x.permute(0, 3, 1, 2)


class QuickGELU(nn.Module):
    """x * sigmoid(1.702 x): the GELU approximation OpenAI's CLIP was trained with."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(1.702 * x)


class ReLUSquared(nn.Module):
    """relu(x)^2 (So et al. 2021, "Primer"): the MLP activation of modded-nanogpt's GPTs."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x).square()


ACTIVATIONS = {
    "gelu": nn.GELU,
    "gelu_tanh": lambda: nn.GELU(approximate="tanh"),  # SigLIP's
    "quick_gelu": QuickGELU,
    "silu": nn.SiLU,
    "relu_squared": ReLUSquared,
}


def make_act(name: str) -> nn.Module:
    """An activation by timm's name."""
    if name not in ACTIVATIONS:
        raise ValueError(f"unknown activation {name!r}; expected one of {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]()
