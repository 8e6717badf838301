"""Augmentation of whole batches where the model runs, for every source of batched images.

The per-sample path (vit.data.transforms, albumentations in loader workers) augments one image at a
time on the CPU. Here the same augmentations run on a batch (B, 3, H, W) on the training device:
random resized crop and flip of decoded files (vit.data.device), pad + random crop, flip and cutout
of images held in memory (vit.data.memory), RandAugment for both, and normalisation. Each image's
random parameters are drawn beforehand (by a loader worker from the image's seed, or from the
batch's seed), so the ops themselves are deterministic and a resumed run augments as an
uninterrupted one did.

RandAugment: the 13 ops of `rand_augment_ops` (vit.data.transforms), each image taking `ops` of them
without replacement, applied in list order, each strength drawn uniformly up to the magnitude:
the per-sample path's distribution, op for op (tests/test_augment.py compares the two).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import random
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

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
        cutout: side of a square zeroed at a random place in each image (in_memory only).
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
GREY = (0.299, 0.587, 0.114)  # RGB -> grey weights (OpenCV's, as albumentations' colour ops use)


class Augmentation(NamedTuple):
    """What was drawn for each image of a batch, once, before the batch reaches the device (from
    the image's sample seed, vit.seeds.Purpose.SAMPLE), a row an image: the device applies it
    (crop_resize_flip, rand_augment), in a thread or process of any kind, to the same pixels."""

    box: torch.Tensor  # int64 (B, 4): the crop's top, left, height and width in the decoded image
    flip: torch.Tensor  # bool (B,): mirrored left to right after the crop
    rand_augment: torch.Tensor  # float64 (B, RA_COLUMNS): each op's strength (NaN: not applied), Sharpen's lightness
    index: torch.Tensor  # int64 (B,): the image's position in its dataset, to name its file
    seed: torch.Tensor  # int64 (B,): the sample seed it was drawn from (-1: none), to draw a substitute's alike

    @classmethod
    def stack(cls, rows: Sequence[Augmentation]) -> Augmentation:
        """One record of many images' (each with the batch dimension left out)."""
        return cls(*(torch.stack(field) for field in zip(*rows, strict=True)))

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


def eval_resize(image: torch.Tensor, size: int, crop_pct: float, whole_levels: bool = False) -> torch.Tensor:
    """uint8 (3, H, W) -> float (3, size, size) in [0, 255]: evaluation's pixels on every path, the
    centred square of crop_pct x the shorter side (center_crop_box) resized with EVAL_RESIZE."""
    box = center_crop_box(image.shape[1], image.shape[2], crop_pct)
    return resize_box(image, box, size, whole_levels=whole_levels)[0]


def _pair(size: int | tuple[int, int]) -> tuple[int, int]:
    return (size, size) if isinstance(size, int) else size


def crop_resize_flip(
    images: Sequence[torch.Tensor],
    box: torch.Tensor,
    flip: torch.Tensor,
    size: int,
    mode: str = "bilinear",
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Float (B, 3, size, size) in [0, 255]: each image's `box` (top, left, height, width) cropped
    and resized (`mode` "bilinear" or "bicubic", antialiased when shrinking: F.interpolate's), then
    mirrored where `flip` is set (Augmentation's fields). On a GPU the crops are resized together
    (`resize_crops_together`, its arithmetic in `dtype`): one at a time, the host launching two
    kernels an image sets the pace there. On the CPU, where the arithmetic does, one at a time in
    float32 (the batched products would also multiply the padding)."""
    if images and images[0].device.type == "cuda":
        return resize_crops_together(images, box, flip, size, mode, dtype)
    return _resize_each(images, box, flip, size, mode)


def _resize_each(
    images: Sequence[torch.Tensor], box: torch.Tensor, flip: torch.Tensor, size: int, mode: str = "bilinear"
) -> torch.Tensor:
    boxes = box.tolist()
    batch = torch.cat([resize_box(i, tuple(b), size, mode) for i, b in zip(images, boxes, strict=True)])
    flip = flip.to(batch.device, non_blocking=True)  # a copy the host does not wait for
    return torch.where(flip[:, None, None, None], batch.flip(-1), batch)


# x size: longer images are resized one at a time (a batch of 128 padded to 560 px, at 224: 0.5 GB of floats)
TOGETHER_SIDE = 2.5
# Training's crops on a GPU: float16 holds every pixel level exactly and its weights to 11 bits (TF32's
# 10 of float32 matmuls, as training runs them), and its matrix products run at twice TF32's rate.
TRAIN_RESIZE_DTYPE = torch.float16


def resize_crops_together(
    images: Sequence[torch.Tensor],
    box: torch.Tensor,
    flip: torch.Tensor,
    size: int,
    mode: str = "bilinear",
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """crop_resize_flip as two batched matrix products: the images copied into one tensor, padded
    to the largest, then (rows' weights) @ image @ (columns' weights)^T, with F.interpolate's
    antialiased weights over each crop (`resize_weights`) and a flipped image's columns
    reversed: a copy an image (queued from one call) and about 100 more kernels a batch, where
    resizing each crop alone takes two kernels and five Python-level calls an image. The images
    lie as (B, H, 3, W) so that both products are plain batched products (no broadcast copies).
    In `dtype`, the result float32: float32 equals resizing one at a time up to float rounding
    (the sums run in another order; within a quarter of a level where matmuls may use TF32, as
    the CLI allows); float16 within 0.03 of a level on average, a quarter at most. Images longer than
    TOGETHER_SIDE x size (rare in photos) are resized one at a time, in float32."""
    device, limit = images[0].device, TOGETHER_SIDE * size
    alone = [i for i, image in enumerate(images) if max(image.shape[1:]) > limit]
    if alone:
        together = sorted(set(range(len(images))) - set(alone))
        out = torch.empty(len(images), 3, size, size, device=device)
        if together:
            index = torch.tensor(together)
            chosen = [images[i] for i in together]
            out[index.to(device)] = resize_crops_together(chosen, box[index], flip[index], size, mode, dtype)
        index = torch.tensor(alone)
        out[index.to(device)] = _resize_each([images[i] for i in alone], box[index], flip[index], size, mode)
        return out
    batch, height, width = len(images), *(max(image.shape[axis] for image in images) for axis in (1, 2))
    # zeros: the weights are zero on the padding, but 0 x a stale NaN would not be
    padded = torch.zeros(batch, height, 3, width, dtype=dtype, device=device)
    views = [v[: i.shape[1], :, : i.shape[2]].transpose(0, 1) for v, i in zip(padded, images, strict=True)]
    torch._foreach_copy_(views, list(images))  # uint8 -> dtype in the copy
    # one copy the host does not wait for: top, left, height, width, flip
    boxes = torch.cat([box, flip[:, None]], 1).float().to(device, non_blocking=True)
    tops, lefts, heights, widths, flipped = boxes.unbind(1)
    rows = resize_weights(tops, heights, size, height, mode, dtype)
    columns = resize_weights(lefts, widths, size, width, mode, dtype, flip=flipped > 0)
    resized_rows = torch.bmm(rows, padded.view(batch, height, 3 * width))  # (B, size, 3 W)
    out = torch.bmm(resized_rows.view(batch, size * 3, width), columns.transpose(1, 2))  # (B, size 3, size)
    out = out.view(batch, size, 3, size).transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
    return out.clamp_(0, 255) if mode == "bicubic" else out


def resize_weights(
    starts: torch.Tensor,
    lengths: torch.Tensor,
    size: int,
    span: int,
    mode: str = "bilinear",
    dtype: torch.dtype = torch.float32,
    flip: torch.Tensor | None = None,
) -> torch.Tensor:
    """(B, size, span) in `dtype`: row o of image b weighs its input pixels starts[b] ..
    starts[b] + lengths[b] - 1 into output pixel o, as F.interpolate(mode=`mode`, antialias=True,
    align_corners=False) resizes that crop: its triangle ("bilinear") or cubic ("bicubic", a = -0.5
    as PIL's) filter, stretched by the scale when shrinking; each row summing to 1 (in float32);
    the rows in reverse order where `flip` is set.

    Worked out on the few pixels each row's filter reaches, then placed in a zeroed matrix by one
    scatter: on a GPU this is bound by the bytes written, and the whole matrix is written once."""
    reach = 1.0 if mode == "bilinear" else 2.0  # the filter's half-width in output pixels
    taps = math.ceil(2 * reach * max(1.0, span / size)) + 3  # more than any row's filter reaches
    arange = functools.partial(torch.arange, device=lengths.device, dtype=torch.float32)
    scale = (lengths / size)[:, None, None]
    stretch = scale.clamp(min=1.0)
    centres = scale * (arange(size)[None, :, None] + 0.5)
    first = (centres - reach * stretch - 0.5).floor_().clamp_(min=0)
    pixels = first + arange(taps)  # (B, size, taps), from the crop's first pixel
    x = ((pixels + 0.5 - centres) / stretch).abs()
    if mode == "bilinear":
        weights = (1 - x).clamp_(min=0)
    else:  # Keys' cubic with a = -0.5, zero from |x| = 2 on
        near, far = (1.5 * x - 2.5) * x * x + 1, ((-0.5 * x + 2.5) * x - 4) * x + 2
        weights = torch.where(x < 1, near, torch.where(x < 2, far, torch.zeros_like(x)))
    weights *= pixels < lengths[:, None, None]
    weights = weights / weights.sum(-1, keepdim=True)
    index = (pixels + starts[:, None, None]).long()
    if flip is not None:
        weights, index = (torch.where(flip[:, None, None], t.flip(1), t) for t in (weights, index))
    # taps past the crop (weight 0) land in `taps` spare columns, so no two taps of a row share a column
    dense = torch.zeros(len(lengths), size, span + taps, dtype=dtype, device=lengths.device)
    return dense.scatter_(2, index, weights.to(dtype))[..., :span]


def batch_augment(
    images: torch.Tensor,
    generator: torch.Generator,
    crop_padding: int = 0,
    hflip: bool = False,
    cutout: int = 0,
) -> torch.Tensor:
    """Random crop after zero padding, horizontal flip and cutout on a uint8 batch (B, C, H, W).

    Same distribution as the per-sample path's pad + random crop + flip: offsets uniform in
    [0, 2 * crop_padding] per image, each image flipped with probability 1/2. Cutout zeroes one
    cutout x cutout square per image, centred uniformly (clipped at the border, DeVries & Taylor 2017).
    """
    b, c, h, w = images.shape
    device = images.device
    if crop_padding > 0:
        p = crop_padding
        padded = F.pad(images, (p, p, p, p))
        dy = torch.randint(0, 2 * p + 1, (b,), generator=generator, device=device)
        dx = torch.randint(0, 2 * p + 1, (b,), generator=generator, device=device)
        rows = (dy[:, None] + torch.arange(h, device=device))[:, None, :, None]
        cols = (dx[:, None] + torch.arange(w, device=device))[:, None, None, :]
        batch = torch.arange(b, device=device)[:, None, None, None]
        channel = torch.arange(c, device=device)[None, :, None, None]
        images = padded[batch, channel, rows, cols]
    if hflip:
        flip = torch.rand(b, generator=generator, device=device) < 0.5
        images = torch.where(flip[:, None, None, None], images.flip(-1), images)
    if cutout > 0:
        cy = torch.randint(0, h, (b, 1, 1), generator=generator, device=device)
        cx = torch.randint(0, w, (b, 1, 1), generator=generator, device=device)
        ys, xs = torch.arange(h, device=device)[None, :, None], torch.arange(w, device=device)[None, None, :]
        top, left = cy - cutout // 2, cx - cutout // 2
        inside = (ys >= top) & (ys < top + cutout) & (xs >= left) & (xs < left + cutout)
        images = images.masked_fill(inside[:, None], 0)
    return images


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


def rand_augment(images: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """uint8 or float (B, 3, H, W) in [0, 255] -> float with RandAugment applied: each op to the
    images whose row of `params` (B, RA_COLUMNS) selects it, in RA_OPS order, values rounded and
    clipped to 0..255 after each op as the per-sample path's uint8 images are.

    The warps (rotate, shear, translate: first in RA_OPS) run as at most `ops` passes, the k-th
    taking each image's k-th warp, with every image's matrix worked out on the host from `params`;
    each colour op runs on the images that take it. Which images take what is read on the host, and
    nothing here waits for the device (no host syncs): on a GPU the host queues every op while the
    first ones run, a few kernels an op (the host's launching sets the pace there). The images and
    strengths of all steps cross to the device in two copies. Each op rounds or clips only where its
    arithmetic can leave whole levels in 0..255: on a GPU these ops are bound by the bytes they move."""
    params, device = params.detach().to("cpu", torch.float64).numpy(), images.device
    if images.dtype == torch.uint8:
        images = images.float()
    else:  # round() makes the copy the ops below write into
        images = images.float().round().clamp_(0, 255)
    steps = _warp_passes(params, images.shape[-1])
    chosen = np.isfinite(params)
    for op in range(len(WARPS), len(RA_OPS)):
        index = np.flatnonzero(chosen[:, op])
        if len(index):
            values = np.zeros((len(index), 6))
            values[:, 0], values[:, 1] = params[index, op], params[index, LIGHTNESS]
            steps.append((_RA_FUNCTIONS[RA_OPS[op]], index, values))
    if not steps:
        return images
    lengths = [len(index) for _, index, _ in steps]
    index_all = torch.from_numpy(np.concatenate([index for _, index, _ in steps]))
    values_all = torch.from_numpy(np.concatenate([values for _, _, values in steps]).astype(np.float32))
    index_all, values_all = (t.to(device, non_blocking=True).split(lengths) for t in (index_all, values_all))
    for (function, _, _), index, values in zip(steps, index_all, values_all, strict=True):
        images[index] = function(images[index], values)
    return images


WARPS = ("rotate", "shear_x", "shear_y", "translate_x", "translate_y")  # RA_OPS[:5]


def _warp_passes(params: np.ndarray, side: int) -> list[tuple[Callable, np.ndarray, np.ndarray]]:
    """(_warp, image indices, (n, 6) flattened 2x3 matrices) for pass k = 0, 1, ...: each image's
    k-th warp op in RA_OPS order. An image's warps are then applied in the order rand_augment
    applied them one op at a time, each to the pixels the previous left. Worked out for the whole
    batch in a few numpy calls: this runs in the thread that feeds the model."""
    chosen = np.isfinite(params[:, : len(WARPS)])
    image, op = np.nonzero(chosen)  # row-major: each image's warps in RA_OPS order
    if not len(image):
        return []
    k = np.cumsum(chosen, 1)[image, op] - 1  # the pass each (image, op) belongs to
    order = np.lexsort((image, k))  # by pass, then by image
    image, op, k = image[order], op[order], k[order]
    matrices = _warp_matrices(op, params[image, op], side).reshape(len(image), 6)
    starts = np.cumsum(np.bincount(k))[:-1]
    passes = zip(np.split(image, starts), np.split(matrices, starts), strict=True)
    return [(_warp, index, values) for index, values in passes]


def _warp_matrices(op: np.ndarray, strength: np.ndarray, side: int) -> np.ndarray:
    """(n, 2, 3) affine_grid matrices for warp ops `op` (indices into WARPS) at `strength`: the
    inverse of q = matrix @ p + shift about the centre (pixel units, x right, y down), the transform
    albumentations' Affine builds, in affine_grid's normalised coordinates."""
    n = len(op)
    matrix, shift = np.tile(np.eye(2), (n, 1, 1)), np.zeros((n, 2))
    angle = np.deg2rad(strength.astype(np.float32))
    rotate = op == 0
    cos, sin = np.cos(angle[rotate]), np.sin(angle[rotate])
    matrix[rotate] = np.stack([np.stack([cos, sin], -1), np.stack([-sin, cos], -1)], 1)
    for axis, which in ((0, 1), (1, 2)):  # shear_x, shear_y: albumentations negates the angle
        matrix[op == which, axis, 1 - axis] = np.tan(-angle[op == which])
    for axis, which in ((0, 3), (1, 4)):  # translate_x, translate_y: whole pixels, as albumentations
        shift[op == which, axis] = np.trunc(strength[op == which].astype(np.float32) * np.float32(side))
    (a, b), (c, d) = matrix[:, 0].T, matrix[:, 1].T
    inverse = np.stack([np.stack([d, -b], -1), np.stack([-c, a], -1)], 1) / (a * d - b * c)[:, None, None]
    offset = -(inverse @ (shift * 2 / side)[:, :, None])
    return np.concatenate([inverse, offset], axis=2)


# Each op below takes and returns whole levels in 0..255 (float), as the per-sample path's uint8 images.


def _warp(images: torch.Tensor, matrices: torch.Tensor) -> torch.Tensor:
    """Bilinear warp of square images by (n, 6) flattened affine_grid matrices, black outside (a
    mean of levels with weights summing to at most 1: within 0..255 before rounding)."""
    grid = F.affine_grid(matrices.view(-1, 2, 3), list(images.shape), align_corners=False)
    return F.grid_sample(images, grid, mode="bilinear", padding_mode="zeros", align_corners=False).round_()


def _grey(images: torch.Tensor) -> torch.Tensor:
    r, g, b = images.split(1, dim=1)
    return (r * GREY[0] + g * GREY[1] + b * GREY[2]).round()


def _brightness(images: torch.Tensor, factor: torch.Tensor, _: torch.Tensor) -> torch.Tensor:
    return (images * factor.view(-1, 1, 1, 1)).trunc_().clamp_(max=255)  # albumentations' uint8 multiply truncates


def _contrast(images: torch.Tensor, factor: torch.Tensor, _: torch.Tensor) -> torch.Tensor:
    factor = factor.view(-1, 1, 1, 1)
    return (images * factor + _grey(images).mean((1, 2, 3), keepdim=True) * (1 - factor)).trunc_().clamp_(0, 255)


def _saturation(images: torch.Tensor, factor: torch.Tensor, _: torch.Tensor) -> torch.Tensor:
    factor = factor.view(-1, 1, 1, 1)
    return (images * factor + _grey(images) * (1 - factor)).round_().clamp_(0, 255)


def _sharpen(images: torch.Tensor, alpha: torch.Tensor, lightness: torch.Tensor) -> torch.Tensor:
    """albumentations' Sharpen: the 3x3 kernel (1 - alpha) * identity + alpha * [[-1, -1, -1],
    [-1, 8 + lightness, -1], [-1, -1, -1]], borders reflected."""
    b, c, h, w = images.shape
    kernels = -alpha.view(-1, 1, 1) * torch.ones(b, 3, 3, device=images.device)
    kernels[:, 1, 1] = 1 - alpha + alpha * (8 + lightness)
    padded = F.pad(images.reshape(1, b * c, h, w), (1, 1, 1, 1), mode="reflect")
    out = F.conv2d(padded, kernels.repeat_interleave(c, 0).unsqueeze(1), groups=b * c).view(b, c, h, w)
    return out.round_().clamp_(0, 255)


def _posterize(images: torch.Tensor, bits: torch.Tensor, _: torch.Tensor) -> torch.Tensor:
    step = (2 ** (8 - bits)).view(-1, 1, 1, 1)
    return torch.div(images, step, rounding_mode="floor") * step


def _solarize(images: torch.Tensor, threshold: torch.Tensor, _: torch.Tensor) -> torch.Tensor:
    return torch.where(images >= threshold.view(-1, 1, 1, 1) * 255, 255 - images, images)


def _lut(images: torch.Tensor, hist: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Per-channel histogram stretch, each value read as a bin of `hist` (as albumentations' lookup
    tables are): v -> 255 x (pixels in bins lo..v, less bin lo's) / (pixels in bins lo..hi, less bin
    lo's), where lo and hi are the first and last bins used; 0 below, 255 above; a channel with one
    bin used, or none (autocontrast leaves 255 out: a channel all 255), is left as it is. Worked out
    as a (rows, 256) table, then read once at every pixel: the cumulative count is below bin lo's
    count before lo and the total after hi, so clipping to 0..255 gives the 0 and 255 there."""
    cdf = hist.cumsum(1)
    total = cdf[:, -1:]
    at_lo = torch.where(cdf > 0, cdf, total).amin(1, keepdim=True)  # the first bin used holds that many
    stretched = ((cdf - at_lo) * 255 / (total - at_lo).clamp(min=1)).round_().clamp_(0, 255)
    table = torch.where(total > at_lo, stretched, torch.arange(256, device=hist.device, dtype=hist.dtype))
    return table.gather(1, values).view(images.shape)


def _histogram(bins: torch.Tensor) -> torch.Tensor:
    """(rows, 256) counts of each row's `bins`, leaving bin 256 out: one index_add_ over
    row-offset bins (not bincount: that reads the largest bin on the host)."""
    rows, columns = bins.shape[0], 257
    offset = (bins + columns * torch.arange(rows, device=bins.device)[:, None]).flatten()
    counts = torch.zeros(rows * columns, device=bins.device)
    counts.index_add_(0, offset, torch.ones(len(offset), device=bins.device))
    return counts.view(rows, columns)[:, :256]


def _equalize(images: torch.Tensor, *_: torch.Tensor) -> torch.Tensor:
    """Histogram equalisation of each channel, as OpenCV's equalizeHist (albumentations' Equalize)."""
    b, c, h, w = images.shape
    values = images.reshape(b * c, h * w).long()
    return _lut(images, _histogram(values), values)


def _autocontrast(images: torch.Tensor, *_: torch.Tensor) -> torch.Tensor:
    """albumentations' AutoContrast (its default "cdf" method): the same stretch over a histogram
    of range (0, 255) in 256 bins, which puts value v in bin floor(v x 256 / 255) and leaves 255 out
    (its bin would be 256)."""
    b, c, h, w = images.shape
    values = images.reshape(b * c, h * w).long()
    return _lut(images, _histogram(values * 256 // 255), values)


_COLOUR_OPS = {
    "brightness": _brightness,
    "contrast": _contrast,
    "saturation": _saturation,
    "sharpen": _sharpen,
    "posterize": _posterize,
    "solarize": _solarize,
    "autocontrast": _autocontrast,
    "equalize": _equalize,
}
_RA_FUNCTIONS = {
    name: (lambda images, values, fn=fn: fn(images, values[:, 0], values[:, 1])) for name, fn in _COLOUR_OPS.items()
}


def normalize(images: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """uint8, float16 or float32 0..255 (B, C, H, W) -> float32, (x / 255 - mean) / std, as albumentations'
    Normalize: x * scale + shift in one op (a pass over the batch, reading the input's own dtype)."""
    scale, shift = (
        torch.tensor(values, dtype=torch.float32).view(1, -1, 1, 1).to(images.device, non_blocking=True)
        for values in ([1 / (255 * s) for s in std], [-m / s for m, s in zip(mean, std, strict=True)])
    )  # made on the host and copied without waiting for the device
    return torch.addcmul(shift, images, scale)


def resize_batch(images: torch.Tensor, size: int) -> torch.Tensor:
    """Float images to size x size (bilinear, antialiased when shrinking); identity at the same size."""
    if images.shape[-1] == size and images.shape[-2] == size:
        return images
    return F.interpolate(images, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
