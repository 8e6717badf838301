"""One image's geometry, on every path: the evaluation crop (the centred square of crop_pct x the
shorter side), a box cropped and resized (antialiased, F.interpolate's filters), the per-sample
path's whole-image resize, and normalisation. Pixels are float in [0, 255] between the steps.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F


def center_crop_box(height: int, width: int, crop_pct: float) -> tuple[int, int, int, int]:
    """The centred square that resizing the shorter side to size / crop_pct and centre-cropping
    `size` keeps: side crop_pct x the shorter side."""
    side = max(1, round(min(height, width) * crop_pct))
    return (height - side) // 2, (width - side) // 2, side, side


# Evaluation's resize on every path (per sample, in memory, on the device, export and rollout):
# bicubic and antialiased, PIL's filter (timm's evaluation), clamped to the pixel range.
EVAL_RESIZE = "bicubic"
RESIZES = ("bilinear", "bicubic")


def resize_box(
    image: torch.Tensor,
    box: tuple[int, int, int, int],
    size: int | tuple[int, int],
    mode: str = EVAL_RESIZE,
    whole_levels: bool = False,
) -> torch.Tensor:
    """uint8 or float (3, H, W) -> float (1, 3, size, size) in [0, 255]: the box (top, left,
    height, width) cropped and resized, antialiased when shrinking (F.interpolate's filters).
    `whole_levels` (uint8 on the CPU): torch's uint8 kernel, about 5x faster, rounded to whole
    levels (0.3 of a level from the float result on average)."""
    top, left, height, width = box
    crop = image[None, :, top : top + height, left : left + width]
    if whole_levels and image.dtype == torch.uint8 and image.device.type == "cpu":
        crop = crop.contiguous(memory_format=torch.channels_last)  # the layout its fast kernel takes
        return F.interpolate(crop, size=_pair(size), mode=mode, antialias=True).float()
    out = F.interpolate(crop.float(), size=_pair(size), mode=mode, antialias=True, align_corners=False)
    return out.clamp_(0, 255) if mode == "bicubic" else out  # bicubic overshoots at edges


def resize_boxes(
    images: Sequence[torch.Tensor],
    boxes: Sequence[Sequence[int]],
    size: int,
    mode: str = EVAL_RESIZE,
    flips: Sequence[bool] | None = None,
) -> torch.Tensor:
    """resize_box for each image and its box, float (B, 3, size, size), one image at a time; each
    mirrored as it is made where `flips` says (no second pass over the whole batch)."""
    flips = flips or [False] * len(images)
    crops = (resize_box(i, tuple(b), size, mode) for i, b in zip(images, boxes, strict=True))
    return torch.cat([c.flip(-1) if f else c for c, f in zip(crops, flips, strict=True)])


def eval_resize(image: torch.Tensor, size: int, crop_pct: float, whole_levels: bool = False) -> torch.Tensor:
    """uint8 (3, H, W) -> float (3, size, size) in [0, 255]: evaluation's pixels on every path, the
    centred square of crop_pct x the shorter side (center_crop_box) resized with EVAL_RESIZE."""
    box = center_crop_box(image.shape[1], image.shape[2], crop_pct)
    return resize_box(image, box, size, whole_levels=whole_levels)[0]


def _pair(size: int | tuple[int, int]) -> tuple[int, int]:
    return (size, size) if isinstance(size, int) else size


def normalize(images: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """uint8, float16 or float32 0..255 (B, C, H, W) -> float32, (x / 255 - mean) / std, as albumentations'
    Normalize: x * scale + shift in one op (a pass over the batch, reading the input's own dtype)."""
    scale, shift = (
        torch.tensor(values, dtype=torch.float32).view(1, -1, 1, 1).to(images.device, non_blocking=True)
        for values in ([1 / (255 * s) for s in std], [-m / s for m, s in zip(mean, std, strict=True)])
    )  # made on the host and copied without waiting for the device
    return torch.addcmul(shift, images, scale)


def resized_crop(
    image: np.ndarray,
    box: tuple[int, int, int, int],
    size: tuple[int, int],
    flip: bool = False,
    uint8_op: Callable[..., dict] | None = None,
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
) -> torch.Tensor:
    """The box of an RGB uint8 image (H, W, 3) resized to `size` (bicubic, antialiased, whole levels:
    evaluation's resize), mirrored if `flip`, then `uint8_op` applied to it as uint8 (H, W, 3) (an
    albumentations pipeline: RandAugment), normalised if mean and std are given: float (3, h, w),
    else in [0, 255]. One image of the per-sample NaFlex path, in one call."""
    pixels = resize_box(chw(image), box, size, whole_levels=True)
    pixels = pixels.flip(-1) if flip else pixels
    if uint8_op is not None:
        pixels = chw(uint8_op(image=hwc(pixels[0]))["image"])[None]
    return pixels[0] if mean is None or std is None else normalize(pixels, mean, std)[0]


def resized_crops(
    images: Sequence[np.ndarray],
    boxes: Sequence[tuple[int, int, int, int]],
    sizes: Sequence[tuple[int, int]],
    flips: Sequence[bool],
    uint8_op: Any | None = None,
    op_seeds: Sequence[int] | None = None,
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
) -> list[torch.Tensor]:
    """resized_crop of each image of a batch, in one call; `uint8_op` (an albumentations pipeline)
    seeded with the image's `op_seeds` entry before it is applied to that image."""
    out = []
    for k, (image, box, size, flip) in enumerate(zip(images, boxes, sizes, flips, strict=True)):
        if uint8_op is not None and op_seeds is not None:
            uint8_op.set_random_seed(op_seeds[k])
        out.append(resized_crop(image, box, size, flip, uint8_op, mean, std))
    return out


def eval_pixels(image: np.ndarray, img_size: int, crop_pct: float = 1.0) -> np.ndarray:
    """The evaluation geometry without normalisation: RGB uint8 (H, W, 3) -> uint8 (img_size,
    img_size, 3), rounded. Decodes images into memory at the size the model sees (vit.data.memory)."""
    return hwc(eval_resize(chw(image), img_size, crop_pct, whole_levels=True))


class ResizeWhole:
    """The per-sample path's whole image resized to img_size x img_size as evaluation resizes
    (bicubic, antialiased): an albumentations Lambda's function, a class so that the pipeline
    pickles (loader workers under spawn)."""

    def __init__(self, img_size: int) -> None:
        self.img_size = img_size

    def __call__(self, image: np.ndarray, **_: object) -> np.ndarray:
        whole = (0, 0, image.shape[0], image.shape[1])
        return hwc(resize_box(chw(image), whole, self.img_size, whole_levels=True)[0])


def chw(image: np.ndarray) -> torch.Tensor:
    """(H, W, 3) -> a (3, H, W) view; a read-only array (PIL's) copied, as torch wants it writable."""
    image = np.ascontiguousarray(image)
    return torch.from_numpy(image if image.flags.writeable else image.copy()).permute(2, 0, 1)


def hwc(pixels: torch.Tensor) -> np.ndarray:
    """float (3, H, W) in [0, 255] -> rounded uint8 (H, W, 3)."""
    return pixels.round().to(torch.uint8).permute(1, 2, 0).numpy()
