"""What is drawn for each training image, once, from its sample seed: the augmentation options
(`data.augment`), the per-image draws (random resized crop box, flip, RandAugment's ops and
strengths) and the record that carries them to wherever the pixels are augmented (`Augmentation`).

The draws use a generator's random() alone, so a loader worker seeds a `random.Random` in
microseconds; the per-sample path draws its NaFlex crops with the same functions from numpy's.
RandAugment: the 13 ops of RA_OPS (vit.data.transforms has them as albumentations ops, vit.data.randaugment
as batched torch ops), each image taking `ops` of them without replacement, applied in list order,
each strength drawn uniformly up to the magnitude.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import random
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from vit.data.geometry import center_crop_box
from vit.options import number, require, whole

CROPS = ("rrc", "pad_crop", "resize")


@dataclasses.dataclass(frozen=True)
class Augment:
    """A training image's augmentation (`data.augment`), the same on every data path: per sample
    (vit.data.transforms), in batches of decoded files (vit.data.device) or of images in memory.

    Args:
        crop: "rrc" (random resized crop, ImageNet), "pad_crop" (resize, pad by crop_padding,
            random crop back: CIFAR) or "resize" (no crop). None (image folders only): follows
            img_size (vit.data.ImageFolderDataModule).
        crop_scale: the random resized crop's range of area fractions.
        crop_padding: pad_crop's padding; None (image folders only): img_size // 8.
        hflip: a horizontal flip with probability 1/2 (off for digits and text).
        randaugment_ops / randaugment_magnitude: RandAugment's ops per image (0 = off) and their
            strength (0..10).
        cutout: side of a square zeroed at a random place in each image (the memory pipeline only).
    """

    crop: str | None = "rrc"
    crop_scale: tuple[float, float] = (0.08, 1.0)
    crop_padding: int | None = 4
    hflip: bool = True
    randaugment_ops: int = 0
    randaugment_magnitude: float = 9.0
    cutout: int = 0

    def __post_init__(self) -> None:
        name = "data.augment."
        require(self.crop is None or self.crop in CROPS, name + "crop", self.crop, f"one of {', '.join(CROPS)}")
        scale = self.crop_scale
        require(
            isinstance(scale, list | tuple) and len(scale) == 2 and all(isinstance(v, int | float) for v in scale)
            and 0 < scale[0] <= scale[1] <= 1,
            name + "crop_scale", scale, "[low, high] area fractions with 0 < low <= high <= 1 (ImageNet: [0.08, 1])",
        )  # fmt: skip
        object.__setattr__(self, "crop_scale", tuple(scale))  # a list when read from YAML
        if self.crop_padding is not None:
            whole(self.crop_padding, 0, name + "crop_padding", "pixels of padding before pad_crop's random crop")
        whole(self.randaugment_ops, 0, name + "randaugment_ops", "RandAugment's ops per image, 0 for none")
        require(
            self.randaugment_ops <= len(RA_OPS), name + "randaugment_ops", self.randaugment_ops,
            f"at most the {len(RA_OPS)} ops there are (0 for none)",
        )  # fmt: skip
        number(self.randaugment_magnitude, name + "randaugment_magnitude", "a strength from 0 to 10", 0, 10)
        whole(self.cutout, 0, name + "cutout", "the side of the square zeroed, 0 for none")

    @property
    def randaugment(self) -> tuple[int, float]:
        return self.randaugment_ops, self.randaugment_magnitude


# RandAugment's ops in the order they are applied. Each image's parameters are one row of
# RA_COLUMNS floats: the strength of each op (NaN: not applied), then Sharpen's lightness.
RA_OPS = (
    "rotate", "shear_x", "shear_y", "translate_x", "translate_y", "brightness", "contrast", "saturation",
    "sharpen", "posterize", "solarize", "autocontrast", "equalize",
)  # fmt: skip
RA_COLUMNS = len(RA_OPS) + 1
LIGHTNESS = len(RA_OPS)
SHARPEN_LIGHTNESS = (0.5, 1.0)  # albumentations' Sharpen default


class Augmentation(NamedTuple):
    """What was drawn for each image of a batch, once, before the batch reaches the device (from
    the image's sample seed, vit.seeds.Purpose.SAMPLE), a row an image: the device applies it
    (crop_resize_flip, rand_augment), in a thread or process of any kind, to the same pixels."""

    box: torch.Tensor  # int64 (B, 4): the crop's top, left, height and width in the decoded image
    flip: torch.Tensor  # bool (B,): mirrored left to right after the crop
    rand_augment: torch.Tensor  # float64 (B, RA_COLUMNS): each op's strength (NaN: not applied), Sharpen's lightness
    index: torch.Tensor  # int64 (B,): the image's position in its dataset, to name its file
    seed: torch.Tensor  # int64 (B,): the sample seed it was drawn from (-1: none), to draw a substitute's alike

    def take(self, rows: torch.Tensor | list[int]) -> Augmentation:
        return Augmentation(*(field[rows] for field in self))


Rng = np.random.Generator | random.Random  # the draws below use its random() alone: uniform in [0, 1)


def _uniform(rng: Rng, low: float, high: float) -> float:
    return low + (high - low) * rng.random()


def _below(rng: Rng, n: int) -> int:
    """Uniform in 0..n-1."""
    return min(int(rng.random() * n), n - 1)


def random_resized_crop_box(
    rng: Rng,
    height: int,
    width: int,
    scale: tuple[float, float] = (0.08, 1.0),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
) -> tuple[int, int, int, int]:
    """(top, left, height, width) of a random resized crop: an area fraction uniform in `scale` and
    an aspect ratio log-uniform in `ratio`, up to 10 tries, else the whole image clamped to `ratio`.
    The algorithm of torchvision's RandomResizedCrop and albumentations', which the per-sample path uses."""
    area = height * width
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target = area * _uniform(rng, scale[0], scale[1])
        aspect = math.exp(_uniform(rng, *log_ratio))
        w = round(math.sqrt(target * aspect))
        h = round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            return _below(rng, height - h + 1), _below(rng, width - w + 1), h, w
    in_ratio = width / height
    if in_ratio < ratio[0]:
        w, h = width, round(width / ratio[0])
    elif in_ratio > ratio[1]:
        h, w = height, round(height * ratio[1])
    else:
        h, w = height, width
    return (height - h) // 2, (width - w) // 2, h, w


def rand_augment_ranges(magnitude: float) -> dict[str, tuple[float, float]]:
    """Each op's strength range at `magnitude` in [0, 10] (strengths drawn uniformly within it):
    degrees for rotate and shear, a fraction of the side for translate, a factor for the colour
    ops, Sharpen's alpha, bits kept for posterize (an integer range, inclusive), the solarize
    threshold as a fraction of 255. The one definition, for the per-sample ops too."""
    m = max(0.0, min(magnitude, 10.0)) / 10.0
    factor = (max(0.0, 1 - 0.9 * m), 1 + 0.9 * m)
    return {
        "rotate": (-30 * m, 30 * m),
        "shear_x": (-17 * m, 17 * m),
        "shear_y": (-17 * m, 17 * m),
        "translate_x": (-0.45 * m, 0.45 * m),
        "translate_y": (-0.45 * m, 0.45 * m),
        "brightness": factor,
        "contrast": factor,
        "saturation": factor,
        "sharpen": (0.0, 0.9 * m),
        "posterize": (max(1, round(8 - 4 * m)), 8),
        "solarize": (1.0 - m, 1.0),
        "autocontrast": (0.0, 0.0),
        "equalize": (0.0, 0.0),
    }


@functools.lru_cache(maxsize=8)
def _range_table(magnitude: float) -> tuple[tuple[float, float], ...]:
    ranges = rand_augment_ranges(magnitude)
    return tuple(ranges[name] for name in RA_OPS)


POSTERIZE = RA_OPS.index("posterize")


def draw_rand_augment(rng: Rng, ops: int, magnitude: float, count: int = 1) -> np.ndarray:
    """(count, RA_COLUMNS) float64 parameters: `ops` distinct ops per image, uniformly, each with
    its strength (all NaN with ops 0). A loader worker draws these for every image: plain Python
    draws, a few microseconds, where numpy's per-call overhead made them tens."""
    params = np.full((count, RA_COLUMNS), np.nan)
    if ops <= 0:
        return params
    table, n = _range_table(magnitude), len(RA_OPS)
    for row in params:
        pool = list(range(n))
        for j in range(min(ops, n)):  # distinct ops, uniformly: the first steps of a Fisher-Yates shuffle
            pick = j + _below(rng, n - j)
            pool[j], pool[pick] = pool[pick], pool[j]
            op, (low, high) = pool[j], table[pool[j]]
            row[op] = low + _below(rng, int(high - low) + 1) if op == POSTERIZE else _uniform(rng, low, high)
        row[LIGHTNESS] = _uniform(rng, *SHARPEN_LIGHTNESS)
    return params


def draw_crop_flip(
    rng: Rng, height: int, width: int, augment: Augment, ratio: tuple[float, float] = (3 / 4, 4 / 3)
) -> tuple[tuple[int, int, int, int], bool]:
    """An image's crop box (top, left, height, width) and flip, in that order from `rng`:
    `augment`'s random resized crop of aspect ratios `ratio` (crop "rrc") or the whole image, then
    its flip. The device path's draw and NaFlex's (which takes ratios near the image's)."""
    box = (0, 0, height, width)
    if augment.crop == "rrc":
        box = random_resized_crop_box(rng, height, width, augment.crop_scale, ratio)
    return box, augment.hflip and rng.random() < 0.5


def draw_crop_flips(
    rngs: Sequence[Rng], sizes: Sequence[tuple[int, int]], augment: Augment, ratios: Sequence[tuple[float, float]]
) -> list[tuple[tuple[int, int, int, int], bool]]:
    """draw_crop_flip for each image of a batch (its generator, (height, width) and ratios), in one call."""
    return [draw_crop_flip(rng, h, w, augment, ratio) for rng, (h, w), ratio in zip(rngs, sizes, ratios, strict=True)]


def draw_augmentation(
    seed: int | None, height: int, width: int, index: int, augment: Augment | None, crop_pct: float = 1.0
) -> Augmentation:
    """One image's Augmentation (without the batch dimension). In training (`augment`) drawn from
    its sample seed: `augment`'s random resized crop (crop "rrc") or the whole image (crop
    "resize"), then its flip, then its RandAugment ops. In evaluation (augment None): the centred
    crop of crop_pct (center_crop_box), no flip, no RandAugment."""
    if augment is None:
        box, flip, ra = center_crop_box(height, width, crop_pct), False, np.full(RA_COLUMNS, np.nan)
    else:
        rng = random.Random(None if seed is None else int(seed))  # seeded in microseconds, numpy's in 12
        box, flip = draw_crop_flip(rng, height, width, augment)
        ra = draw_rand_augment(rng, *augment.randaugment)[0]
    return Augmentation(
        torch.tensor(box), torch.tensor(flip), torch.from_numpy(ra), torch.tensor(index),
        torch.tensor(-1 if seed is None else int(seed)),
    )  # fmt: skip


def draw_augmentations(
    seeds: Sequence[int | None],
    sizes: Sequence[tuple[int, int]],
    indices: Sequence[int],
    augment: Augment | None,
    crop_pct: float = 1.0,
) -> list[Augmentation]:
    """draw_augmentation for each image of a batch (its seed, (height, width) and index), in one call."""
    return [
        draw_augmentation(seed, height, width, index, augment, crop_pct)
        for seed, (height, width), index in zip(seeds, sizes, indices, strict=True)
    ]
