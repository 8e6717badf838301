"""Image files decoded and augmented where the model runs (`data.pipeline device`).

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

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch.utils.data import Dataset, get_worker_info
from torchvision.io import ImageReadMode, decode_jpeg

from vit.data.crops import TRAIN_RESIZE_DTYPE, crop_resize_flip
from vit.data.draws import Augment, Augmentation, draw_augmentation, draw_augmentations
from vit.data.geometry import EVAL_RESIZE, normalize
from vit.data.images import (
    JPEG_MAGIC,
    MISSING,
    CorruptImageError,
    FileSamples,
    ImageFiles,
    Sample,
    channels_first,
    decode_rgb,
    decoded_in_worker,
    undecodable,
)
from vit.data.randaugment import rand_augment
from vit.options import number, whole

log = logging.getLogger(__name__)

DEVICE_CROPS = ("rrc", "resize")


@dataclass(frozen=True)
class DeviceDecode:
    """The options of the pipeline that decodes on the training device (`data.pipeline device`).

    Args:
        prefetch: how many batches a thread decodes ahead of the step, on a CUDA stream of its own
            (vit.data.prefetch); 0: each when its step begins; None: 1 on a GPU, 0 on the CPU
            (there the thread only competes with the model for the cores).
        worker_decode: the share of the JPEGs (0 to 1, the same files every epoch) that the loader
            workers decode (PIL) instead of the device: decoding on a GPU takes its cores from the
            model, and workers with cores to spare can take part of it.
    """

    prefetch: int | None = None
    worker_decode: float = 0.0

    def __post_init__(self) -> None:
        if self.prefetch is not None:
            whole(self.prefetch, 0, "data.device.prefetch", "batches decoded ahead; 0 decodes each in its step")
        share = "a share of the JPEGs decoded on the device, from 0 to 1"
        number(self.worker_decode, "data.device.worker_decode", share, 0, 1)


class EncodedFiles(FileSamples, Dataset):
    """The images of `source` (image files, or another ImageFiles' `read_bytes`: streaming shards)
    as (image, label, Augmentation), indexed by (index, sample seed) as the ResumableSampler yields
    them (by index alone in evaluation): a baseline JPEG as its bytes (uint8 (N,)), for the device to
    decode; any other image decoded here (uint8 (3, H, W)): ImageFiles.read_encoded. Corrupt files
    are handled by FileSamples' policy (`substitute` in training, a stand-in that is not scored in
    evaluation).

    `train`: `augment`'s random resized crop (crop "rrc") or the whole image (crop "resize"), flip
    and RandAugment ops, drawn from the sample seed; otherwise the evaluation crop (center_crop_box
    of `crop_pct`): vit.data.draws.draw_augmentation. It takes the options as the datamodule's
    DataSpec passed them (crop "rrc" or "resize", worker_decode from 0 to 1: vit.data.spec).
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
        self.source = source if isinstance(source, ImageFiles) else ImageFiles(source)
        super().__init__(self.source.samples, skip_corrupt=skip_corrupt, substitute=train)
        self.read_order = self.source.read_order  # streaming shards: a batch's samples read chunk by chunk
        self.train, self.augment, self.crop_pct, self.worker_decode = train, augment, crop_pct, worker_decode

    def decoded_here(self, position: int) -> bool:
        """Whether the worker decodes sample `position` even if the device could (`worker_decode`)."""
        return decoded_in_worker(position, self.worker_decode)

    def __getitem__(self, item: int | tuple[int, int]) -> tuple[torch.Tensor, int, Augmentation]:
        return self.__getitems__([item])[0]

    def __getitems__(self, items: Sequence[int | tuple[int, int]]) -> list[tuple[torch.Tensor, int, Augmentation]]:
        """A loader worker's batch: every file read with its header (a corrupt one replaced or
        stood in for: FileSamples.read_batch), then every image's Augmentation drawn, a call each."""
        indices = [item[0] if isinstance(item, tuple) else item for item in items]
        seeds = [item[1] if isinstance(item, tuple) else None for item in items]
        read = functools.partial(self.source.read_encoded, worker_decode=self.worker_decode)
        found = self.read_batch(indices, read)
        stand_in = (torch.zeros(3, 1, 1, dtype=torch.uint8), 1, 1)  # evaluation: left out of the scores
        positions = [index if f is None else f[0] for index, f in zip(indices, found, strict=True)]
        images, heights, widths = zip(*(stand_in if f is None else f[1] for f in found), strict=True)
        labels = [MISSING if f is None else self.samples[f[0]].label for f in found]
        sizes = list(zip(heights, widths, strict=True))
        drawn = draw_augmentations(seeds, sizes, positions, self.augment if self.train else None, self.crop_pct)
        return list(zip(images, labels, drawn, strict=True))

    def name(self, position: int) -> str:
        return self.source.name(position)

    def substitute_for(self, position: int, seed: int) -> tuple[torch.Tensor, int, Augmentation]:
        """What stands in, in training, for sample `position` when it turns out not to decode after
        the worker took it: the next file the per-sample path's decoder reads (first_readable from
        `position` + 1), drawn from the same sample seed, as the per-sample path substitutes."""
        found = self.first_readable((position + 1) % len(self.samples), self.source.read_image)
        assert found is not None  # training substitutes: first_readable raises when nothing decodes
        taken, pixels = found
        image = channels_first(pixels)
        drawn = draw_augmentation(None if seed < 0 else seed, image.shape[1], image.shape[2], taken, self.augment)
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
    augmentation = Augmentation(*(torch.stack(field) for field in zip(*drawn, strict=True)))
    return EncodedBatch(data, lengths, pixels, sizes, labels, augmentation)


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
    batch: EncodedBatch, device: torch.device | str, size: int, files: EncodedFiles
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
