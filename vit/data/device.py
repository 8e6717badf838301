"""Image files decoded and augmented where the model runs (`data.device_decode`).

The per-sample path decodes and augments one image at a time in loader workers, on the CPU; on a
GPU node that, not the model, sets the speed. Here a loader worker reads a JPEG's bytes and its
header (for the image size), and draws the image's crop box, flip and RandAugment ops from its
sample seed (vit.data.sampling.ResumableSampler: a function of (seed, epoch, index), so resumed
runs draw the same); the batch is then decoded on the training device (`torchvision.io.decode_jpeg`:
nvjpeg on CUDA, libjpeg on the CPU) and augmented there (vit.data.augment: each image cropped and
resized, bilinear and antialiased, flipped, RandAugment, normalised). Evaluation takes the centred
square of side `crop_pct` x the shorter side, the region the per-sample path's resize + centre crop
keeps.

A worker hands a batch over as one tensor of its JPEGs' bytes end to end (EncodedBatch): one
shared-memory block a batch, where a tensor per file cost more than the decoding (on a 16-core GPU
node, 10 workers delivered 3,000 img/s as a list of tensors, 13,700 as one). Files that are not
baseline JPEGs (PNG and other formats; progressive or CMYK JPEGs: read_header) are decoded in the
worker by the per-sample path's decoder (PIL), in parallel, not in the training process; the JPEGs
`decode_jpeg` still refuses are decoded by that decoder too, where the batch is decoded, and
counted in the log, so a file is refused here exactly when the per-sample path refuses it. A
refused file raises CorruptImageError naming it. With `skip_corrupt` it is replaced as the
per-sample path replaces it (training: by the next readable file, with the sample seed's crop,
flip and RandAugment ops) or left out of the scores (evaluation).
"""

from __future__ import annotations

import io
import logging
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch
from PIL import Image
from torch.utils.data import get_worker_info
from torchvision.io import ImageReadMode, decode_jpeg

from vit.data.augment import (
    EVAL_RESIZE,
    RA_COLUMNS,
    TRAIN_RESIZE_DTYPE,
    Augment,
    Augmentation,
    center_crop_box,
    crop_resize_flip,
    draw_rand_augment,
    normalize,
    rand_augment,
    random_resized_crop_box,
)
from vit.data.images import (
    BASELINE,
    DECODE_ERRORS,
    JPEG_MAGIC,
    MISSING,
    CorruptImageError,
    ImageFiles,
    Sample,
    decode_rgb,
    jpeg_damage,
    jpeg_frame,
    jpeg_markers,
    undecodable,
)

log = logging.getLogger(__name__)

GOLDEN = (5**0.5 - 1) / 2  # EncodedFiles.decoded_here: n x GOLDEN mod 1 spreads evenly over [0, 1)
DEVICE_CROPS = ("rrc", "resize")


def channels_first(pixels: np.ndarray) -> torch.Tensor:
    """A decoded RGB image (H, W, 3), as the per-sample decoder gives it, as the device path's (3, H, W)."""
    return torch.from_numpy(np.ascontiguousarray(pixels.transpose(2, 0, 1)))


def image_size(data: bytes) -> tuple[int, int]:
    """(height, width) from the file's header, without decoding the pixels; a truncated JPEG
    raises ValueError (read_header)."""
    return read_header(data)[:2]


def read_header(data: bytes) -> tuple[int, int, bool]:
    """(height, width, whether the device decodes it) from the file's header, as image_size. The
    device takes baseline JPEGs in YCbCr or grey: nvJPEG's batched hardware decoder does not take
    progressive ones (torchvision decodes those one at a time, in the thread that feeds the model,
    waiting on the device after each), and PIL converts CMYK as the per-sample path does. The rest
    are decoded in the loader workers. A baseline JPEG is read from its frame header alone
    (jpeg_frame); anything else by PIL. A damaged JPEG (vit.data.images.jpeg_damage: cut short, or
    cut and filled with zeros) raises ValueError saying why, as every other path refuses it."""
    frame = None
    if data.startswith(JPEG_MAGIC):
        damage = jpeg_damage(data)
        if damage is not None:
            raise ValueError(damage)
        frame = jpeg_frame(data, jpeg_markers(data)[0])
    if frame is not None and frame[0] == BASELINE and frame[1] == 8 and frame[4] in (1, 3) and min(frame[2:4]) > 0:
        height, width = frame[2:4]
        if Image.MAX_IMAGE_PIXELS and height * width > 2 * Image.MAX_IMAGE_PIXELS:  # as Image.open refuses it
            raise Image.DecompressionBombError(
                f"{height * width} pixels exceeds twice PIL's limit of {Image.MAX_IMAGE_PIXELS}"
            )
        return height, width, True
    with Image.open(io.BytesIO(data)) as image:
        baseline = image.format == "JPEG" and image.mode in ("RGB", "L") and not image.info.get("progressive")
        return image.height, image.width, baseline


class EncodedFiles(ImageFiles):
    """The images of `source` (image files, or another ImageFiles' `read_bytes`: streaming shards)
    as (image, label, Augmentation), indexed by (index, sample seed) as the
    ResumableSampler yields them (by index alone in evaluation): a baseline JPEG as its bytes (uint8 (N,)),
    for the device to decode; any other image decoded here (uint8 (3, H, W)). Corrupt files are
    handled as ImageFiles handles them (`substitute` in training, a stand-in that is not scored in
    evaluation).

    `train`: `augment`'s random resized crop (crop "rrc") or the whole image (crop "resize"), flip
    and RandAugment ops, drawn from the sample seed; otherwise the evaluation crop (center_crop_box
    of `crop_pct`).
    """

    def __init__(
        self,
        source: ImageFiles | Sequence[Sample],
        train: bool,
        augment: Augment = Augment(),
        crop_pct: float = 1.0,
        skip_corrupt: bool = False,
        worker_decode: float = 0.0,
    ) -> None:
        if augment.crop not in DEVICE_CROPS:
            raise ValueError(f"device_decode crops with {' or '.join(DEVICE_CROPS)}, not {augment.crop!r}")
        if not 0.0 <= worker_decode <= 1.0:
            raise ValueError(f"worker_decode is a share of the JPEGs, from 0 to 1; got {worker_decode}")
        self.source = source if isinstance(source, ImageFiles) else ImageFiles(source)
        super().__init__(self.source.samples, skip_corrupt=skip_corrupt, substitute=train)
        self.train, self.augment, self.crop_pct, self.worker_decode = train, augment, crop_pct, worker_decode

    def decoded_here(self, position: int) -> bool:
        """Whether the worker decodes sample `position` even if the device could (`worker_decode`
        of them, spread evenly over the positions, the same ones every epoch)."""
        return ((position + 1) * GOLDEN) % 1.0 < self.worker_decode

    def __getitem__(self, item: int | tuple[int, int]) -> tuple[torch.Tensor, int, Augmentation]:
        index, seed = item if isinstance(item, tuple) else (item, None)
        found = self.first_readable(index, self._read)
        if found is None:  # evaluation: a stand-in the evaluation steps leave out of the scores
            return torch.zeros(3, 1, 1, dtype=torch.uint8), MISSING, self._draw(None, 1, 1, index)
        position, (image, height, width) = found
        return image, self.samples[position].label, self._draw(seed, height, width, position)

    def read_order(self, positions: Sequence[int]) -> Sequence[int]:
        return self.source.read_order(positions)

    def name(self, position: int) -> str:
        return self.source.name(position)

    def _read(self, position: int) -> tuple[torch.Tensor, int, int]:
        """(JPEG bytes or the decoded image, height, width); CorruptImageError naming the file if unreadable."""
        try:
            data = self.source.read_bytes(position)
            if data.startswith(JPEG_MAGIC):
                height, width, for_device = read_header(data)
                if for_device and not self.decoded_here(position):
                    return torch.frombuffer(bytearray(data), dtype=torch.uint8), height, width
        except CorruptImageError:
            raise
        except DECODE_ERRORS as e:
            raise undecodable(self.name(position), e) from e
        try:
            pixels = decode_rgb(data)
        except CorruptImageError as e:  # named here: a streaming sample's name costs a read
            raise undecodable(self.name(position), e) from e.__cause__
        except ValueError as e:  # an image decode_rgb refuses (a float one): the message goes on from the name
            raise ValueError(f"{self.name(position)} {e}") from e
        image = channels_first(pixels)
        return image, image.shape[1], image.shape[2]

    def _draw(self, seed: int | None, height: int, width: int, index: int) -> Augmentation:
        """The image's Augmentation (without the batch dimension): in training drawn from its sample
        seed, in evaluation the centred crop."""
        if not self.train:
            box, flip, ra = center_crop_box(height, width, self.crop_pct), False, np.full(RA_COLUMNS, np.nan)
        else:
            rng = random.Random(None if seed is None else int(seed))  # seeded in microseconds, numpy's in 12
            whole = (0, 0, height, width)
            augment = self.augment
            box = random_resized_crop_box(rng, height, width, augment.crop_scale) if augment.crop == "rrc" else whole
            flip = augment.hflip and rng.random() < 0.5
            ra = draw_rand_augment(rng, *augment.randaugment)[0]
        return Augmentation(
            torch.tensor(box), torch.tensor(flip), torch.from_numpy(ra), torch.tensor(index),
            torch.tensor(-1 if seed is None else int(seed)),
        )  # fmt: skip

    def substitute_for(self, position: int, seed: int) -> tuple[torch.Tensor, int, Augmentation]:
        """What stands in, in training, for sample `position` when it turns out not to decode after
        the worker took it: the next file the per-sample path's decoder reads (ImageFiles.first_readable
        from `position` + 1), drawn from the same sample seed, as the per-sample path substitutes."""
        found = self.first_readable((position + 1) % len(self.samples), self.source.read_image)
        assert found is not None  # training substitutes: first_readable raises when nothing decodes
        taken, pixels = found
        image = channels_first(pixels)
        drawn = self._draw(None if seed < 0 else seed, image.shape[1], image.shape[2], taken)
        return image, self.samples[taken].label, drawn


class EncodedBatch(NamedTuple):
    """A batch as a loader worker hands it over: few tensors, each one shared-memory block."""

    data: torch.Tensor  # uint8 (N,): the batch's JPEGs, end to end
    lengths: torch.Tensor  # int64 (B,): each image's bytes in `data`; 0 for an image in `pixels`
    pixels: torch.Tensor  # uint8 (M,): the images decoded in the worker, each (3, H, W) flattened, end to end
    sizes: torch.Tensor  # int64 (D, 2): their (H, W), in batch order
    labels: torch.Tensor  # int64 (B,)
    augmentation: Augmentation  # what EncodedFiles drew for each image

    def decoded(self, device: torch.device | str | None = None) -> list[torch.Tensor]:
        """The images decoded in the worker, uint8 (3, H, W) views of `pixels` (moved to `device`
        in one copy)."""
        pixels = self.pixels if device is None else self.pixels.to(device, non_blocking=True)
        sizes = self.sizes.tolist()
        parts = pixels.split([3 * h * w for h, w in sizes])
        return [part.view(3, h, w) for part, (h, w) in zip(parts, sizes, strict=True)]

    def images(self, device: torch.device | str | None = None) -> list[torch.Tensor]:
        """Each image as EncodedFiles gave it: JPEG bytes (views into `data`) or decoded (on
        `device`, if given)."""
        lengths = self.lengths.tolist()
        decoded = iter(self.decoded(device))
        return [next(decoded) if n == 0 else jpeg for jpeg, n in zip(self.data.split(lengths), lengths, strict=True)]


def collate_encoded(batch: Sequence[tuple[torch.Tensor, int, Augmentation]]) -> EncodedBatch:
    """EncodedFiles' samples -> an EncodedBatch; in a loader worker the bytes and the pixels are
    written straight into shared memory (as torch's default collate does), so handing them over
    copies nothing more (a tensor an image would cost a shared-memory block each)."""
    images, labels, drawn = zip(*batch, strict=True)
    jpegs = [image for image in images if image.dim() == 1]
    decoded = [image.flatten() for image in images if image.dim() == 3]
    data, pixels = (torch.empty(sum(len(part) for part in parts), dtype=torch.uint8) for parts in (jpegs, decoded))
    for block, parts in ((data, jpegs), (pixels, decoded)):
        if get_worker_info() is not None:
            block.share_memory_()
        if parts:
            torch.cat(parts, out=block)
    lengths = torch.tensor([len(image) if image.dim() == 1 else 0 for image in images], dtype=torch.int64)
    sizes = torch.tensor([image.shape[1:] for image in images if image.dim() == 3], dtype=torch.int64).view(-1, 2)
    labels = torch.tensor(labels, dtype=torch.int64)
    return EncodedBatch(data, lengths, pixels, sizes, labels, Augmentation.stack(drawn))


def decode_batch(data: Sequence[torch.Tensor], device: torch.device | str) -> list[torch.Tensor]:
    """RGB uint8 (3, H, W) images on `device` from encoded files (uint8 (N,)) and images already
    decoded (uint8 (3, H, W), moved there): JPEGs in one `decode_jpeg` call there, other files (and
    JPEGs it refuses) on the CPU by the per-sample path's decoder (vit.data.images.decode_rgb).
    Files neither decodes raise UndecodableError with their positions in `data` and the reasons."""
    device = torch.device(device)
    images: list[torch.Tensor | None] = [d.to(device, non_blocking=True) if d.dim() == 3 else None for d in data]
    jpegs = [i for i, d in enumerate(data) if d.dim() == 1 and d.numpy()[:3].tobytes() == JPEG_MAGIC]  # CPU bytes
    if jpegs:
        if device.type == "cuda":
            drain_before_decode(device)
        try:
            decoded = decode_jpeg([data[i] for i in jpegs], mode=ImageReadMode.RGB, device=device)
        except RuntimeError:  # a file the batch decoder refuses: each on its own, the rest on the CPU
            if device.type == "cuda":  # whatever the refused call queued on the decoder's stream ends first
                torch.cuda.synchronize(device)
            decoded = [_decode_one_jpeg(data[i], device) for i in jpegs]
        for i, image in zip(jpegs, decoded, strict=True):
            images[i] = image
    others = [i for i, image in enumerate(images) if image is None]
    failures = {}
    for i in others:  # the per-sample path's decoder: what it reads, every path reads
        try:
            pixels = decode_rgb(data[i].numpy().tobytes())
        except CorruptImageError as e:
            failures[i] = str(e)
            continue
        images[i] = channels_first(pixels).to(device, non_blocking=True)
    if others:
        log.debug("decoded %d of %d images on the CPU (JPEGs the device decoder refused)", len(others), len(data))
    if failures:
        raise UndecodableError(failures, images)
    return images  # type: ignore[return-value]


def drain_before_decode(device: torch.device) -> None:
    """Wait for the work queued on `device`'s current stream. torchvision's CUDA decoder allocates
    its output on that stream but writes it from a private stream that does not wait for it, so
    memory just freed there, still to be read by queued kernels, can be overwritten before they
    read it (pytorch/vision#9606; seen on H100s). Draining first leaves nothing queued to corrupt."""
    torch.cuda.current_stream(device).synchronize()


class UndecodableError(RuntimeError):
    """Images of a batch that could not be decoded: `failures` maps each one's position to the
    decoder's reason; `images` holds the batch's others, decoded (None where one failed)."""

    def __init__(self, failures: dict[int, str], images: list[torch.Tensor | None]) -> None:
        super().__init__(next(iter(failures.values())))
        self.failures, self.images = failures, images


def _decode_one_jpeg(data: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    try:
        return decode_jpeg(data, mode=ImageReadMode.RGB, device=device)
    except RuntimeError:
        return None


class DecodedBatch(NamedTuple):
    """A batch between decoding and augmenting: its images on the device, as decoded."""

    images: list[torch.Tensor]  # uint8 (3, H, W)
    labels: torch.Tensor
    augmentation: Augmentation


def decode_encoded(batch: EncodedBatch, device: torch.device | str, files: EncodedFiles) -> DecodedBatch:
    """A collated batch (on the CPU) of `files`' samples decoded on `device`. A file that does not
    decode here (nor by the per-sample path's decoder, decode_batch) raises CorruptImageError naming
    it; with `files.skip_corrupt` it is logged and counted, and then replaced as the per-sample path
    replaces it (training: the next readable file, drawn from the same sample seed,
    EncodedFiles.substitute_for) or given a stand-in left out of the scores (evaluation: label
    MISSING), so the batch keeps its size."""
    try:
        return DecodedBatch(decode_batch(batch.images(device), device), batch.labels, batch.augmentation)
    except UndecodableError as e:
        failures, images = e.failures, e.images
    labels, drawn = batch.labels.clone(), Augmentation(*(field.clone() for field in batch.augmentation))
    for position, reason in failures.items():
        error = undecodable(files.name(int(drawn.index[position])), reason)
        if not files.skip_corrupt:
            raise error
        files.skipped(error)
        if files.substitute:
            image, labels[position], row = files.substitute_for(int(drawn.index[position]), int(drawn.seed[position]))
            images[position] = image.to(device, non_blocking=True)
            for field, value in zip(drawn, row, strict=True):
                field[position] = value
        else:
            images[position] = torch.zeros(3, 1, 1, dtype=torch.uint8, device=device)
            labels[position] = MISSING
            drawn.box[position], drawn.flip[position] = torch.tensor([0, 0, 1, 1]), False  # the whole 1x1 stand-in
    return DecodedBatch(images, labels, drawn)  # type: ignore[arg-type]


def augment_decoded(batch: DecodedBatch, size: int, train: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(float images, 0-255, size x size, cropped, flipped and RandAugmented as the batch's
    Augmentation says; labels), on the images' device. Training resizes bilinear, in float16 on a
    GPU; evaluation as every path evaluates (vit.data.augment.EVAL_RESIZE, float32)."""
    device, drawn = batch.images[0].device, batch.augmentation
    mode, dtype = ("bilinear", TRAIN_RESIZE_DTYPE) if train else (EVAL_RESIZE, torch.float32)
    images = crop_resize_flip(batch.images, drawn.box, drawn.flip, size, mode, dtype)
    if drawn.rand_augment.isfinite().any():
        images = rand_augment(images, drawn.rand_augment)
    return images, batch.labels.to(device, non_blocking=True)


def decode_and_augment(
    batch: EncodedBatch, device: torch.device | str, size: int, files: ImageFiles
) -> tuple[torch.Tensor, torch.Tensor]:
    """decode_encoded, then augment_decoded, in one call (DeviceSteps runs them as two stages and normalises)."""
    return augment_decoded(decode_encoded(batch, device, files), size, files.train)


@dataclass(frozen=True)
class DeviceSteps:
    """The work on the device for a batch of `files`, in the two stages a PreparedLoader runs
    (vit.data.prefetch; in threads or in a data process, which is why it is a plain, picklable
    object): `decode` (a file that does not decode is named, or skipped as the loader workers skip
    one: skip_corrupt), then `augment` (cropped, flipped, RandAugmented in training, normalised)."""

    files: EncodedFiles
    size: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]

    def decode(self, batch: EncodedBatch, device: torch.device) -> DecodedBatch:
        return decode_encoded(batch, device, self.files)

    def augment(self, batch: DecodedBatch, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = augment_decoded(batch, self.size, self.files.train)
        return normalize(x, self.mean, self.std), y

    @property
    def stages(self) -> tuple[Callable[[Any, torch.device], Any], ...]:
        return self.decode, self.augment
