"""Image files decoded and augmented where the model runs (`data.device_decode`).

The per-sample path decodes and augments one image at a time in loader workers, on the CPU; on a
GPU node that, not the model, sets the speed. Here a loader worker only reads a file's bytes and
its header (for the image size), and draws the image's crop box and flip from its sample seed
(vit.data.sampling.ResumableSampler: a function of (seed, epoch, index), so resumed runs draw the
same); the batch is then decoded on the training device (`torchvision.io.decode_jpeg`: nvjpeg on
CUDA, libjpeg on the CPU), each image cropped and resized (bilinear, antialiased), flipped and
normalised there. Evaluation takes the centred square of side `crop_pct` x the shorter side, the
region the per-sample path's resize + centre crop keeps.

Files `decode_jpeg` cannot take (PNG and other formats, JPEGs it refuses) are decoded on the CPU by
`torchvision.io.decode_image` and counted in the log; a file nothing decodes raises
CorruptImageError naming it. With `skip_corrupt` a file whose header cannot be read is replaced by
the next readable one (training) or left out of the scores (evaluation), as in the per-sample path.
"""

from __future__ import annotations

import io
import logging
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torchvision.io import ImageReadMode, decode_image, decode_jpeg

from vit.data.images import MISSING, CorruptImageError, ImageFiles, Sample

log = logging.getLogger(__name__)

JPEG_MAGIC = b"\xff\xd8\xff"
DEVICE_CROPS = ("rrc", "resize")
# The per-image parameters a worker sends with the bytes: crop top, left, height, width, flip (0/1),
# and the index of the file read (to name it if it does not decode).
TOP, LEFT, HEIGHT, WIDTH, FLIP, INDEX = range(6)


def random_resized_crop_box(
    rng: np.random.Generator,
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
        target = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(*log_ratio))
        w = round(math.sqrt(target * aspect))
        h = round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            return int(rng.integers(0, height - h + 1)), int(rng.integers(0, width - w + 1)), h, w
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


def image_size(data: bytes) -> tuple[int, int]:
    """(height, width) from the file's header, without decoding the pixels. A JPEG without its
    end-of-image marker (FF D9, which cannot occur inside the compressed data) is truncated: libjpeg
    would decode it with grey below the cut, where the per-sample path (PIL) refuses it."""
    if data.startswith(JPEG_MAGIC) and data.rfind(b"\xff\xd9") < max(0, len(data) - 4096):
        raise ValueError("the JPEG is truncated (no end-of-image marker)")
    with Image.open(io.BytesIO(data)) as image:
        return image.height, image.width


class EncodedFiles(ImageFiles):
    """Image files as (bytes, label, crop parameters), indexed by (index, sample seed) as the
    ResumableSampler yields them (by index alone in evaluation); corrupt files are handled as
    ImageFiles handles them (`substitute` in training, a stand-in that is not scored in evaluation).

    `train`: a random resized crop (`crop` "rrc", area fraction in `scale`) or the whole image
    (`crop` "resize") and, with `hflip`, a flip with probability 1/2, drawn from the sample seed;
    otherwise the evaluation crop (center_crop_box of `crop_pct`).
    """

    def __init__(
        self,
        samples: Sequence[Sample],
        train: bool,
        crop: str = "rrc",
        scale: tuple[float, float] = (0.08, 1.0),
        hflip: bool = True,
        crop_pct: float = 1.0,
        skip_corrupt: bool = False,
    ) -> None:
        if crop not in DEVICE_CROPS:
            raise ValueError(f"device_decode crops with {' or '.join(DEVICE_CROPS)}, not {crop!r}")
        super().__init__(samples, skip_corrupt=skip_corrupt, substitute=train)
        self.train, self.crop, self.scale, self.hflip, self.crop_pct = train, crop, tuple(scale), hflip, crop_pct

    def __getitem__(self, item: int | tuple[int, int]) -> tuple[torch.Tensor, int, torch.Tensor]:
        index, seed = item if isinstance(item, tuple) else (item, None)
        found = self.first_readable(index, _read_encoded)
        if found is None:  # evaluation: a stand-in the evaluation steps leave out of the scores
            stand_in = torch.frombuffer(bytearray(_BLACK_PNG), dtype=torch.uint8)
            return stand_in, MISSING, torch.tensor([0, 0, 1, 1, 0, index])
        position, (data, height, width) = found
        params = self._params(seed, height, width)
        label = self.samples[position].label
        return torch.frombuffer(bytearray(data), dtype=torch.uint8), label, torch.tensor([*params, position])

    def _params(self, seed: int | None, height: int, width: int) -> tuple[int, ...]:
        if not self.train:
            return (*center_crop_box(height, width, self.crop_pct), 0)
        rng = np.random.default_rng(seed)
        box = random_resized_crop_box(rng, height, width, self.scale) if self.crop == "rrc" else (0, 0, height, width)
        return (*box, int(self.hflip and rng.random() < 0.5))


def _read_encoded(sample: Sample) -> tuple[bytes, int, int]:
    """A file's bytes and (height, width) from its header; CorruptImageError naming it if unreadable."""
    try:
        data = Path(sample.path).read_bytes()
        return (data, *image_size(data))
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        raise CorruptImageError(f"cannot decode image {sample.path}: {e}") from e


def _black_png() -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (1, 1)).save(buffer, "PNG")
    return buffer.getvalue()


_BLACK_PNG = _black_png()


def collate_encoded(
    batch: list[tuple[torch.Tensor, int, torch.Tensor]],
) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """(list of byte tensors, labels (B,), crop parameters (B, 5)): the bytes differ in length."""
    data, labels, params = zip(*batch, strict=True)
    return list(data), torch.tensor(labels, dtype=torch.int64), torch.stack(params)


def decode_batch(data: Sequence[torch.Tensor], device: torch.device | str) -> list[torch.Tensor]:
    """RGB uint8 (3, H, W) images on `device`: JPEGs in one `decode_jpeg` call there, the others
    (and JPEGs it refuses) by `decode_image` on the CPU. A file neither decodes raises
    UndecodableError with its position in `data`."""
    device = torch.device(device)
    images: list[torch.Tensor | None] = [None] * len(data)
    jpegs = [i for i, d in enumerate(data) if bytes(d[:3].tolist()) == JPEG_MAGIC]
    if jpegs:
        try:
            decoded = decode_jpeg([data[i] for i in jpegs], mode=ImageReadMode.RGB, device=device)
        except RuntimeError:  # a file the batch decoder refuses: each on its own, the rest on the CPU
            decoded = [_decode_one_jpeg(data[i], device) for i in jpegs]
        for i, image in zip(jpegs, decoded, strict=True):
            images[i] = image
    others = [i for i, image in enumerate(images) if image is None]
    for i in others:
        try:
            images[i] = decode_image(data[i], mode=ImageReadMode.RGB).to(device, non_blocking=True)
        except RuntimeError as e:
            raise UndecodableError(i, str(e)) from e
    if others:
        log.debug("decoded %d of %d images on the CPU (not JPEGs the device decoder takes)", len(others), len(data))
    return images  # type: ignore[return-value]


class UndecodableError(RuntimeError):
    """The image at `position` of a batch could not be decoded."""

    def __init__(self, position: int, reason: str) -> None:
        super().__init__(reason)
        self.position = position


def _decode_one_jpeg(data: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    try:
        return decode_jpeg(data, mode=ImageReadMode.RGB, device=device)
    except RuntimeError:
        return None


def crop_resize_flip(images: Sequence[torch.Tensor], params: torch.Tensor, size: int) -> torch.Tensor:
    """Float (B, 3, size, size) in [0, 255]: each image's box cropped and resized (bilinear,
    antialiased when shrinking), then flipped where its flag is set."""
    out = []
    for image, (top, left, height, width) in zip(images, params[:, :4].tolist(), strict=True):
        crop = image[:, top : top + height, left : left + width].unsqueeze(0).float()
        out.append(F.interpolate(crop, size=(size, size), mode="bilinear", antialias=True, align_corners=False))
    batch = torch.cat(out)
    flip = params[:, FLIP].to(batch.device, dtype=torch.bool)
    return torch.where(flip[:, None, None, None], batch.flip(-1), batch)


def decode_and_augment(
    batch: tuple[list[torch.Tensor], torch.Tensor, torch.Tensor], device: torch.device | str, size: int,
    samples: Sequence[Sample],
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """A collated batch (bytes on the CPU) -> (float images on `device`, 0-255, size x size; labels).
    `samples` name a file that does not decode."""
    data, labels, params = batch
    try:
        images = decode_batch(data, device)
    except UndecodableError as e:
        path = samples[int(params[e.position, INDEX])].path
        raise CorruptImageError(f"cannot decode image {path}: {e}") from e
    return crop_resize_flip(images, params, size), labels.to(device)
