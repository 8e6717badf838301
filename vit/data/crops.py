"""Crops and resizes of whole batches on the training device: each decoded image's crop box
resized and flipped (the device path, vit.data.device: one at a time on the CPU, as two batched
matrix products on a GPU), pad + random crop, flip and cutout of images held in memory
(vit.data.memory), and a batch resized to another size (progressive resizing).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from vit.data.geometry import resize_boxes


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
    return resize_boxes(images, box.tolist(), size, mode, flips=flip.tolist())


# x size: longer images are resized one at a time (a batch of 128 padded to 560 px, at 224: 0.5 GB of floats)
TOGETHER_SIDE = 2.5
# Training's crops on a GPU: float16 holds every pixel level exactly and its weights to 11 bits (TF32's
# 10 of float32 matmuls, as training runs them), and its matrix products run at twice TF32's rate.
TRAIN_RESIZE_DTYPE = torch.float16


def resize_crops_together(
    images: Sequence[torch.Tensor], box: torch.Tensor, flip: torch.Tensor, size: int, mode: str = "bilinear",
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:  # fmt: skip
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


def resize_batch(images: torch.Tensor, size: int) -> torch.Tensor:
    """Float images to size x size (bilinear, antialiased when shrinking); identity at the same size."""
    if images.shape[-1] == size and images.shape[-2] == size:
        return images
    return F.interpolate(images, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
