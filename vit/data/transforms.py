"""Albumentations pipelines: train (crop, flip, RandAugment-like ops, normalise) and eval
(resize, centre crop, normalise). Inputs are RGB uint8 arrays; outputs float CHW tensors."""

from __future__ import annotations

import albumentations as A
import cv2
from albumentations.pytorch import ToTensorV2

from vit.data.augment import CROPS, SHARPEN_LIGHTNESS, Augment, rand_augment_ranges

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
            A.Resize(img_size, img_size, interpolation=cv2.INTER_CUBIC),
            A.PadIfNeeded(side, side, border_mode=cv2.BORDER_CONSTANT),
            A.RandomCrop(img_size, img_size),
        ]
    elif augment.crop == "resize":
        ops = [A.Resize(img_size, img_size, interpolation=cv2.INTER_CUBIC)]
    else:
        raise ValueError(f"crop must be one of {CROPS}, got {augment.crop!r}")
    if augment.hflip:
        ops.append(A.HorizontalFlip(p=0.5))
    if augment.randaugment_ops > 0:
        ra = rand_augment_ops(augment.randaugment_magnitude)
        ops.append(A.SomeOf(ra, n=augment.randaugment_ops, replace=False, p=1.0))
    return A.Compose([*ops, A.Normalize(mean=mean, std=std), ToTensorV2()])


def eval_transform(
    img_size: int,
    crop_pct: float = 1.0,
    mean: tuple[float, ...] = IMAGENET_MEAN,
    std: tuple[float, ...] = IMAGENET_STD,
) -> A.Compose:
    """Resize the shorter side to img_size / crop_pct, then take the centre img_size crop
    (crop_pct 0.875 is the ImageNet convention; 1.0 keeps the whole of a square image)."""
    resize = round(img_size / crop_pct)
    return A.Compose(
        [
            A.SmallestMaxSize(max_size=resize, interpolation=cv2.INTER_CUBIC),
            A.CenterCrop(img_size, img_size),
            A.Normalize(mean=mean, std=std),
            ToTensorV2(),
        ]
    )


def resize_transform(img_size: int, crop_pct: float = 1.0) -> A.Compose:
    """The eval transform's geometry without normalisation: uint8 in, uint8 (img_size, img_size, 3)
    out. Decodes images into memory at the size the model sees (vit.data.memory)."""
    return A.Compose(
        [
            A.SmallestMaxSize(max_size=round(img_size / crop_pct), interpolation=cv2.INTER_CUBIC),
            A.CenterCrop(img_size, img_size),
        ]
    )
