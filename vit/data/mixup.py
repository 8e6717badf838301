"""Mixup (Zhang et al. 2018) and CutMix (Yun et al. 2019) on whole batches, DeiT-style.

Each batch is mixed with itself reversed, using one lambda ~ Beta(alpha, alpha); when both are
enabled, a batch uses CutMix with probability `switch_prob`. Targets become soft (B, classes);
label smoothing is left to the loss (`F.cross_entropy(label_smoothing=...)` accepts soft targets).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch
import torch.nn.functional as F

from vit.options import number


@dataclasses.dataclass(frozen=True)
class Mixup:
    """Mixup and CutMix of training batches (`data.mixup`; timm's names).

    Args:
        mixup_alpha / cutmix_alpha: the Beta distributions' parameter (0 = off; DeiT: 0.8 / 1.0).
        prob: the fraction of batches mixed. switch_prob: the chance of CutMix when both are on.
    """

    mixup_alpha: float = 0.0
    cutmix_alpha: float = 0.0
    prob: float = 1.0
    switch_prob: float = 0.5

    def __post_init__(self) -> None:
        for field in ("mixup_alpha", "cutmix_alpha"):
            value = getattr(self, field)
            number(value, f"data.mixup.{field}", "a Beta parameter of at least 0 (0 turns it off)", 0, math.inf)
        for field in ("prob", "switch_prob"):
            number(getattr(self, field), f"data.mixup.{field}", "a probability from 0 to 1", 0, 1)

    @property
    def enabled(self) -> bool:
        return self.mixup_alpha > 0 or self.cutmix_alpha > 0


class MixupCutmix:
    def __init__(self, num_classes: int, options: Mixup) -> None:
        if not options.enabled:
            raise ValueError("MixupCutmix needs mixup_alpha > 0 or cutmix_alpha > 0")
        self.num_classes = num_classes
        self.mixup_alpha, self.cutmix_alpha = options.mixup_alpha, options.cutmix_alpha
        self.prob, self.switch_prob = options.prob, options.switch_prob

    def __call__(self, x: torch.Tensor, y: torch.Tensor, rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Images (B, C, H, W) and int labels (B,) -> mixed images and soft targets (B, classes)."""
        target = F.one_hot(y, self.num_classes).to(x.dtype)
        if rng.random() >= self.prob:
            return x, target
        use_cutmix = self.cutmix_alpha > 0 and (self.mixup_alpha <= 0 or rng.random() < self.switch_prob)
        if use_cutmix:
            lam = float(rng.beta(self.cutmix_alpha, self.cutmix_alpha))
            y0, y1, x0, x1 = cutmix_box(x.shape[-2], x.shape[-1], lam, rng)
            x = x.clone()
            x[..., y0:y1, x0:x1] = x.flip(0)[..., y0:y1, x0:x1]
            lam = 1.0 - (y1 - y0) * (x1 - x0) / (x.shape[-2] * x.shape[-1])  # the area actually kept
        else:
            lam = float(rng.beta(self.mixup_alpha, self.mixup_alpha))
            x = x * lam + x.flip(0) * (1.0 - lam)
        return x, target * lam + target.flip(0) * (1.0 - lam)


def cutmix_box(height: int, width: int, lam: float, rng: np.random.Generator) -> tuple[int, int, int, int]:
    """A box covering about (1 - lam) of the image, centred uniformly, clipped to the borders."""
    ratio = np.sqrt(1.0 - lam)
    cut_h, cut_w = int(height * ratio), int(width * ratio)
    cy, cx = int(rng.integers(height)), int(rng.integers(width))
    y0, y1 = np.clip([cy - cut_h // 2, cy + cut_h // 2], 0, height)
    x0, x1 = np.clip([cx - cut_w // 2, cx + cut_w // 2], 0, width)
    return int(y0), int(y1), int(x0), int(x1)
