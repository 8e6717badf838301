"""The per-sample pipelines: train (albumentations: crop, flip, RandAugment-like ops, normalise)
and eval (the centred crop resized as every path resizes it, normalised). Inputs are RGB uint8
arrays; outputs float CHW tensors."""

from __future__ import annotations

import albumentations as A
import cv2
import numpy as np
import torch
from albumentations.pytorch import ToTensorV2

from vit.data.augment import (
    CROPS,
    SHARPEN_LIGHTNESS,
    Augment,
    eval_resize,
    normalize,
    rand_augment_ranges,
    resize_box,
)

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def rand_augment_ops(magnitude: float) -> list[A.BasicTransform]:
    """RandAugment's operations (Cubuk et al. 2020) with strength set by magnitude in [0, 10],
    in vit.data.augment.RA_OPS order with its ranges (the device path applies the same ops).

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
    augmentation: vit.data.augment), then normalise."""
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
    resized to img_size (bicubic, antialiased: vit.data.augment.eval_resize, which the in-memory
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


def eval_pixels(image: np.ndarray, img_size: int, crop_pct: float = 1.0) -> np.ndarray:
    """The evaluation geometry without normalisation: RGB uint8 (H, W, 3) -> uint8 (img_size,
    img_size, 3), rounded. Decodes images into memory at the size the model sees (vit.data.memory)."""
    return _hwc(eval_resize(_chw(image), img_size, crop_pct, whole_levels=True))


def _resize(img_size: int) -> A.Lambda:
    """The whole image resized to img_size x img_size as evaluation resizes (bicubic, antialiased)."""
    return A.Lambda(image=_ResizeWhole(img_size), p=1.0)


class _ResizeWhole:
    """A.Lambda's function, a class so that the pipeline pickles (loader workers under spawn)."""

    def __init__(self, img_size: int) -> None:
        self.img_size = img_size

    def __call__(self, image: np.ndarray, **_: object) -> np.ndarray:
        whole = (0, 0, image.shape[0], image.shape[1])
        return _hwc(resize_box(_chw(image), whole, self.img_size, whole_levels=True)[0])


def _chw(image: np.ndarray) -> torch.Tensor:
    """(H, W, 3) -> a (3, H, W) view; a read-only array (PIL's) copied, as torch wants it writable."""
    image = np.ascontiguousarray(image)
    return torch.from_numpy(image if image.flags.writeable else image.copy()).permute(2, 0, 1)


def _hwc(pixels: torch.Tensor) -> np.ndarray:
    """float (3, H, W) in [0, 255] -> rounded uint8 (H, W, 3)."""
    return pixels.round().to(torch.uint8).permute(1, 2, 0).numpy()
