"""RandAugment on whole batches (B, 3, H, W) where the model runs: each image's ops and strengths
drawn beforehand (vit.data.draws.draw_rand_augment, a row of RA_COLUMNS an image), so the ops
themselves are deterministic and a resumed run augments as an uninterrupted one did. The per-sample
path's distribution, op for op (tests/test_augment.py compares the two).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from vit.data.draws import LIGHTNESS, RA_OPS

GREY = (0.299, 0.587, 0.114)  # RGB -> grey weights (OpenCV's, as albumentations' colour ops use)


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
