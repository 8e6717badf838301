"""The per-sample pipelines: train (albumentations: crop, flip, RandAugment-like ops, normalise)
and eval (the centred crop resized as every path resizes it, normalised); with `data.naflex`, both
at the image's own aspect ratio within a patch budget (SequenceTrainTransform, SequenceEvalTransform).
Inputs are RGB uint8 arrays; outputs float CHW tensors."""

from __future__ import annotations

from collections.abc import Sequence

import albumentations as A
import cv2
import numpy as np
import torch
from albumentations.pytorch import ToTensorV2

from vit.data.draws import CROPS, SHARPEN_LIGHTNESS, Augment, draw_crop_flip, draw_crop_flips, rand_augment_ranges
from vit.data.geometry import (
    ResizeWhole,
    eval_resize,
    normalize,
    resized_crop,
    resized_crops,
)
from vit.data.geometry import chw as _chw
from vit.data.naflex import CROP_ASPECT, NaFlex, sequence_size, sequence_sizes

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def rand_augment_ops(magnitude: float) -> list[A.BasicTransform]:
    """RandAugment's operations (Cubuk et al. 2020) with strength set by magnitude in [0, 10],
    in vit.data.draws.RA_OPS order with its ranges (the device path applies the same ops).

    Each op draws its strength uniformly up to the magnitude, like timm's `mstd` variant.
    """
    r = rand_augment_ranges(magnitude)
    border = cv2.BORDER_CONSTANT
    colour = dict(brightness=0, contrast=0, saturation=0, hue=0, p=1.0)
    return [
        A.Affine(rotate=r["rotate"], border_mode=border, p=1.0),
        A.Affine(shear={"x": r["shear_x"], "y": (0, 0)}, border_mode=border, p=1.0),
        A.Affine(shear={"x": (0, 0), "y": r["shear_y"]}, border_mode=border, p=1.0),
        A.Affine(translate_percent={"x": r["translate_x"], "y": (0, 0)}, border_mode=border, p=1.0),
        A.Affine(translate_percent={"x": (0, 0), "y": r["translate_y"]}, border_mode=border, p=1.0),
        A.ColorJitter(**{**colour, "brightness": r["brightness"]}),
        A.ColorJitter(**{**colour, "contrast": r["contrast"]}),
        A.ColorJitter(**{**colour, "saturation": r["saturation"]}),
        A.Sharpen(alpha=r["sharpen"], lightness=SHARPEN_LIGHTNESS, p=1.0),
        A.Posterize(num_bits=tuple(int(b) for b in r["posterize"]), p=1.0),
        A.Solarize(threshold_range=r["solarize"], p=1.0),
        A.AutoContrast(p=1.0),
        A.Equalize(p=1.0),
    ]


def train_transform(
    img_size: int,
    augment: Augment = Augment(),
    mean: tuple[float, ...] = IMAGENET_MEAN,
    std: tuple[float, ...] = IMAGENET_STD,
) -> A.Compose:
    """The per-sample training pipeline: augment's crop, flip and RandAugment (cutout is a batch
    augmentation: vit.data.crops), then normalise."""
    if augment.crop == "rrc":
        ops = [A.RandomResizedCrop(size=(img_size, img_size), scale=augment.crop_scale, interpolation=cv2.INTER_CUBIC)]
    elif augment.crop == "pad_crop":
        side = img_size + 2 * augment.crop_padding
        ops = [
            _resize(img_size),
            A.PadIfNeeded(side, side, border_mode=cv2.BORDER_CONSTANT),
            A.RandomCrop(img_size, img_size),
        ]
    elif augment.crop == "resize":
        ops = [_resize(img_size)]
    else:
        raise ValueError(f"crop must be one of {CROPS}, got {augment.crop!r}")
    if augment.hflip:
        ops.append(A.HorizontalFlip(p=0.5))
    if augment.randaugment_ops > 0:
        ra = rand_augment_ops(augment.randaugment_magnitude)
        ops.append(A.SomeOf(ra, n=augment.randaugment_ops, replace=False, p=1.0))
    return A.Compose([*ops, A.Normalize(mean=mean, std=std), ToTensorV2()])


class EvalTransform:
    """The evaluation pipeline of every path: the centred square of crop_pct x the shorter side,
    resized to img_size (bicubic, antialiased: vit.data.geometry.eval_resize, which the in-memory
    and device paths use too), normalised. RGB uint8 (H, W, 3) in, float (3, img_size, img_size)
    out, called as albumentations' pipelines are: `transform(image=array)["image"]`. crop_pct 0.875
    is the ImageNet convention; 1.0 keeps the whole of a square image."""

    def __init__(
        self,
        img_size: int,
        crop_pct: float = 1.0,
        mean: tuple[float, ...] = IMAGENET_MEAN,
        std: tuple[float, ...] = IMAGENET_STD,
    ) -> None:
        self.img_size, self.crop_pct, self.mean, self.std = img_size, crop_pct, mean, std

    def __call__(self, *, image: np.ndarray) -> dict[str, torch.Tensor]:
        pixels = eval_resize(_chw(image), self.img_size, self.crop_pct, whole_levels=True)
        return {"image": normalize(pixels[None], self.mean, self.std)[0]}


eval_transform = EvalTransform  # the name beside train_transform


class SequenceEvalTransform:
    """Evaluation with `data.naflex`: the whole image resized, its aspect ratio kept, to the largest
    grid of whole patches within the budget (vit.data.naflex.sequence_grid), as EvalTransform
    resizes (bicubic, antialiased), normalised. RGB uint8 (H, W, 3) in, float (3, rows x patch,
    columns x patch) out."""

    def __init__(
        self, naflex: NaFlex, mean: tuple[float, ...] = IMAGENET_MEAN, std: tuple[float, ...] = IMAGENET_STD
    ) -> None:
        self.naflex, self.mean, self.std = naflex, mean, std

    def __call__(self, *, image: np.ndarray) -> dict[str, torch.Tensor]:
        height, width = image.shape[:2]
        size = sequence_size(height, width, self.naflex)
        return {"image": resized_crop(image, (0, 0, height, width), size, mean=self.mean, std=self.std)}


class SequenceTrainTransform:
    """Training with `data.naflex`: augment's crop (rrc: a random resized crop whose aspect ratio is
    the image's times vit.data.naflex.CROP_ASPECT, so it stays near the image's; resize: the whole
    image) resized as SequenceEvalTransform resizes it, then the flip and RandAugment, normalised.
    Each image's draws come from its sample seed (`set_random_seed`, as albumentations' pipelines
    take it), so a resumed run sees the same crops. It takes the crop as the datamodule's DataSpec
    passed it (rrc or resize: vit.data.spec.check_naflex_options)."""

    def __init__(
        self,
        naflex: NaFlex,
        augment: Augment = Augment(),
        mean: tuple[float, ...] = IMAGENET_MEAN,
        std: tuple[float, ...] = IMAGENET_STD,
    ) -> None:
        self.naflex, self.augment, self.mean, self.std = naflex, augment, mean, std
        ops, magnitude = augment.randaugment
        some = [A.SomeOf(rand_augment_ops(magnitude), n=ops, replace=False, p=1.0)] if ops > 0 else []
        self.rand_augment = A.Compose(some) if some else None
        self.rng = np.random.default_rng()

    def set_random_seed(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        if self.rand_augment is not None:  # a stream of its own: the sample seed's would repeat the crop's draws
            self.rand_augment.set_random_seed(int(self.rng.integers(2**32)))

    def __call__(self, *, image: np.ndarray) -> dict[str, torch.Tensor]:
        height, width = image.shape[:2]
        ratio = (width / height * CROP_ASPECT[0], width / height * CROP_ASPECT[1])
        box, flip = draw_crop_flip(self.rng, height, width, self.augment, ratio)
        size = sequence_size(box[2], box[3], self.naflex)
        return {"image": resized_crop(image, box, size, flip, self.rand_augment, self.mean, self.std)}

    def apply_batch(self, images: Sequence[np.ndarray], seeds: Sequence[int]) -> list[torch.Tensor]:
        """Each image as `set_random_seed(seed)` then `__call__` transform it, the batch's crop draws,
        sizes and pixels a call each (a loader worker's batch: vit.data.images.ImageFiles.__getitems__)."""
        rngs = [np.random.default_rng(seed) for seed in seeds]
        op_seeds = None if self.rand_augment is None else [int(rng.integers(2**32)) for rng in rngs]
        shapes = [image.shape[:2] for image in images]
        ratios = [(w / h * CROP_ASPECT[0], w / h * CROP_ASPECT[1]) for h, w in shapes]
        drawn = draw_crop_flips(rngs, shapes, self.augment, ratios)
        boxes, flips = [box for box, _ in drawn], [flip for _, flip in drawn]
        sizes = sequence_sizes([box[2:] for box in boxes], self.naflex)
        return resized_crops(images, boxes, sizes, flips, self.rand_augment, op_seeds, self.mean, self.std)


def _resize(img_size: int) -> A.Lambda:
    """The whole image resized to img_size x img_size as evaluation resizes (bicubic, antialiased)."""
    return A.Lambda(image=ResizeWhole(img_size), p=1.0)
