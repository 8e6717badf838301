"""Image sources: reading files safely (a JPEG's header, markers and completeness; decoding), and
the Dataset classes of files and of arrays (the folder layouts: vit.data.folders).

Every image comes out as an RGB uint8 array (H, W, 3): greyscale, palette and RGBA files are
converted, and a file that cannot be decoded raises an error naming it (or is skipped and counted,
where configured) instead of feeding garbage to the model.
"""

from __future__ import annotations

import io
import logging
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from torch.utils.data import Dataset

from vit.data.folders import (  # noqa: F401  (read from here too)
    IMAGE_EXTENSIONS,
    Sample,
    readable_class_names,
    same_class_names,
    scan_image_folder,
    scan_tiny_imagenet,
)

log = logging.getLogger(__name__)


class CorruptImageError(ValueError):
    """An image file that cannot be read or decoded (truncated, not an image, a decompression bomb,
    a broken symlink): `skip_corrupt` skips it."""


SIXTEEN_BIT_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I")  # PIL's 16-bit greyscale (PNG, TIFF)


# What counts as an image that does not decode, wherever a file is decoded or checked.
DECODE_ERRORS = (UnidentifiedImageError, Image.DecompressionBombError, OSError, ValueError, SyntaxError)

JPEG_MAGIC = b"\xff\xd8\xff"
BASELINE, EXTENDED, DHT, SOS, EOI = 0xC0, 0xC1, 0xC4, 0xDA, 0xD9  # JPEG markers (sequential frames, tables, scan, end)
_NOT_FRAMES = (DHT, 0xC8, 0xCC)  # markers in 0xC0..0xCF that start no frame (tables, reserved)
# A scan's data that ends in this many zero bytes was cut and filled (a preallocated file, an
# incomplete download) unless its tables write a flat block as zero bits (jpeg_damage).
CUT_ZEROS = 32
_SCAN_END = re.compile(rb"\xff[^\x00\xd0-\xd7]")  # the first marker after a scan's data (FF 00 and restarts are data)
# The symbol each standard Huffman table (JPEG Annex K) codes as all zero bits, for a file without tables.
_STANDARD_ZERO_SYMBOL = {(0, 0): 0x00, (0, 1): 0x00, (1, 0): 0x01, (1, 1): 0x00}


def jpeg_markers(data: bytes) -> tuple[list[tuple[int, int]], int]:
    """(offset, marker) of a JPEG's segments up to and including its first scan's (start-of-scan,
    FF DA), each segment skipped by its length, and the offset where the walk stopped: at that scan,
    at an end-of-image marker, at a byte that is not a marker, or, for a file cut short within its
    headers, at or past its end. Microseconds where PIL's header parsing (its tables included)
    takes tens: a loader worker reads one for every file."""
    markers, i, n = [], 2, len(data)
    while i + 4 <= n:
        if data[i] != 0xFF:
            break
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        markers.append((i, marker))
        if marker in (SOS, EOI):
            break
        if 0xD0 <= marker <= 0xD7 or marker == 0x01:  # markers without a length
            i += 2
            continue
        i += 2 + int.from_bytes(data[i + 2 : i + 4], "big")
    else:
        i = max(i, n)
    return markers, i


def jpeg_frame(data: bytes, markers: list[tuple[int, int]]) -> tuple[int, int, int, int, int] | None:
    """(start-of-frame marker, sample precision, height, width, components) from a JPEG's first
    frame header (`markers`: jpeg_markers'); None if it has none before its first scan or is cut short."""
    for i, marker in markers:
        if 0xC0 <= marker <= 0xCF and marker not in _NOT_FRAMES:
            if i + 10 > len(data):
                return None
            height, width = int.from_bytes(data[i + 5 : i + 7], "big"), int.from_bytes(data[i + 7 : i + 9], "big")
            return marker, data[i + 4], height, width, data[i + 9]
    return None


def jpeg_damage(data: bytes) -> str | None:
    """Why the JPEG file `data` is damaged, or None: the one rule of every path that reads images.

    A JPEG is cut short when no end-of-image marker (FF D9, which cannot occur inside compressed
    data) follows where its headers end; PIL decodes some such files without an error, with grey
    or garbage below the cut. Bytes after the marker (a phone's appended video) are no harm, and a
    marker within the headers (an embedded thumbnail's) does not count. A sequential JPEG whose scan
    data ends in CUT_ZEROS or more zero bytes was cut and filled with zeros (PIL decodes the zeros
    as texture), unless its Huffman tables code a flat block (no change of the DC term, then
    end-of-block) as zero bits: then zeros are what a flat end of the image looks like, and only
    the end marker decides. Progressive files are checked by their end marker alone."""
    markers, headers_end = jpeg_markers(data)
    last_end = data.rfind(b"\xff\xd9")
    if last_end < headers_end:
        return "the JPEG is truncated (no end-of-image marker after its headers)"
    if any(data[max(headers_end, last_end - CUT_ZEROS) : last_end]):  # the common case, without reading the scan
        return None
    frame = jpeg_frame(data, markers)
    if not markers or markers[-1][1] != SOS or frame is None or frame[0] not in (BASELINE, EXTENDED):
        return None
    start = headers_end + 2 + int.from_bytes(data[headers_end + 2 : headers_end + 4], "big")
    end = _SCAN_END.search(data, start)
    if end is None or data[end.start() + 1] != EOI or end.start() - start < CUT_ZEROS:
        return None  # more scans follow (a non-interleaved file): left to the end marker
    if any(data[end.start() - CUT_ZEROS : end.start()]) or _zeros_code_flat_blocks(data, markers):
        return None
    zeros = end.start() - start - len(data[start : end.start()].rstrip(b"\0"))
    return f"the JPEG's compressed data ends in {zeros} zero bytes (a file cut short and filled with zeros)"


def _zeros_code_flat_blocks(data: bytes, markers: list[tuple[int, int]]) -> bool:
    """Whether, for every component of the scan, all zero bits decode as a flat block: its DC
    table's all-zero code is category 0 and its AC table's is end-of-block. The all-zero code of a
    table is its first symbol (the shortest code, counting up from zero)."""
    zero_symbol = dict(_STANDARD_ZERO_SYMBOL)
    for i, marker in markers:
        if marker != DHT:
            continue
        j, end = i + 4, i + 2 + int.from_bytes(data[i + 2 : i + 4], "big")
        while j + 17 <= end:
            count = sum(data[j + 1 : j + 17])
            if count and j + 17 < len(data):
                zero_symbol[(data[j] >> 4, data[j] & 0x0F)] = data[j + 17]
            j += 17 + count
    sos = markers[-1][0]
    tables = data[sos + 6 : sos + 5 + 2 * data[sos + 4] : 2]  # each component's DC << 4 | AC table
    return all(zero_symbol.get((0, t >> 4)) == 0x00 and zero_symbol.get((1, t & 0x0F)) == 0x00 for t in tables)


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
    (jpeg_frame); anything else by PIL. A damaged JPEG (jpeg_damage: cut short, or cut and filled
    with zeros) raises ValueError saying why, as every other path refuses it."""
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


def read_file(path: str | Path) -> bytes:
    """An image file's bytes. CorruptImageError for a broken symlink (named as such) or a file that
    cannot be read; a missing file that is not a link is a missing dataset, not a corrupt image:
    FileNotFoundError."""
    try:
        return Path(path).read_bytes()
    except FileNotFoundError as e:
        if not os.path.islink(path):
            raise
        raise broken_link(path, str(path)) from e
    except OSError as e:
        raise CorruptImageError(f"cannot read image {path}: {e}") from e


def broken_link(path: str | Path, name: str) -> CorruptImageError:
    return CorruptImageError(f"cannot read image {name}: it is a broken symlink (to {os.readlink(path)})")


def read_rgb(source: str | Path | bytes | BinaryIO, name: str | None = None) -> np.ndarray:
    """Decode an image file (a path, its bytes, or an open binary file, named `name` in errors)
    into an RGB uint8 array (H, W, 3): decode_rgb, with CorruptImageError naming the file."""
    if isinstance(source, str | Path):
        name, data = str(source) if name is None else name, read_file(source)
    else:
        data = source if isinstance(source, bytes) else source.read()
        name = "<image bytes>" if name is None else name
    try:
        return decode_rgb(data)
    except CorruptImageError as e:
        raise undecodable(name, e) from e.__cause__
    except ValueError as e:  # a float image: the message goes on from the file's name
        raise ValueError(f"{name} {e}") from e


def decode_rgb(data: bytes) -> np.ndarray:
    """An encoded image as an RGB uint8 array (H, W, 3). A damaged JPEG (jpeg_damage) or data that
    does not decode raises CorruptImageError saying why (the caller names the file). 16-bit
    greyscale is scaled to 8 bits (PIL's own conversion clips it, turning most images white);
    float images have no standard range: ValueError."""
    damage = jpeg_damage(data) if data.startswith(JPEG_MAGIC) else None
    if damage is not None:
        raise CorruptImageError(damage)
    try:
        with Image.open(io.BytesIO(data)) as image:
            if image.mode in SIXTEEN_BIT_MODES:
                grey = np.clip(np.round(np.asarray(image, dtype=np.float64) / 257.0), 0, 255).astype(np.uint8)
                return np.repeat(grey[..., None], 3, axis=-1)
            if image.mode != "F":
                return np.asarray(image.convert("RGB"))
    except DECODE_ERRORS as e:
        raise CorruptImageError(str(e) or type(e).__name__) from e  # named by the caller: undecodable
    raise ValueError("is a 32-bit float image, which has no standard range: convert it to 8 or 16 bits")


def undecodable(name: str, error: BaseException | str) -> CorruptImageError:
    """The error for image `name` that does not decode, with the decoder's reason less the
    in-memory file it names (PIL: "cannot identify image file <_io.BytesIO object at 0x...>")."""
    reason = re.sub(r"\s*<_io\.BytesIO object at 0x[0-9a-fA-F]+>", "", str(error))
    reason = re.sub(r"^\w+, \S+\.(?:cpp|h):\d+, ", "", reason)  # torchvision's source location
    return CorruptImageError(f"cannot decode image {name}: {reason or type(error).__name__}")


Transform = Callable[..., dict]  # an albumentations Compose: transform(image=array) -> {"image": ...}


class _SeededTransform(Dataset):
    """Applies the transform with the per-sample seed the ResumableSampler passes as (index, seed)."""

    transform: Transform | None

    def __getitem__(self, item: int | tuple[int, int]):
        index, seed = item if isinstance(item, tuple) else (item, None)
        image, label = self.load(index)
        if self.transform is not None:
            if seed is not None:
                self.transform.set_random_seed(seed)
            image = self.transform(image=image)["image"]
        return image, label

    def load(self, index: int) -> tuple[np.ndarray, int]:
        raise NotImplementedError


MISSING = -1  # the label of a corrupt file's stand-in in evaluation (skip_corrupt): not scored


class FileSamples:
    """Samples read from files one at a time, with `skip_corrupt`'s policy: an undecodable file is
    logged by name, counted, and, instead of stopping the run, replaced by the next sample
    (`substitute`, for training) or by a stand-in labelled MISSING (evaluation, where a substitute
    would be scored twice: the evaluation steps leave MISSING out of the scores). Either way every
    batch keeps its size, so DDP ranks stay in step. What ImageFiles and the device path's
    EncodedFiles (vit.data.device) read their samples with."""

    def __init__(self, samples: Sequence[Sample], skip_corrupt: bool = False, substitute: bool = True) -> None:
        self.samples = list(samples)
        self.skip_corrupt = skip_corrupt
        self.substitute = substitute
        self.skipped_files: set[str] = set()  # each file's error, as logged: a file read again is not counted again

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def labels(self) -> np.ndarray:
        return np.array([s.label for s in self.samples], dtype=np.int64)

    def name(self, position: int) -> str:
        """Sample `position` as errors name it: its file."""
        return self.samples[position].path

    def read_order(self, positions: Sequence[int]) -> Sequence[int]:
        """The order to read a batch's samples in (indices into `positions`): as asked, for files."""
        return range(len(positions))

    def read_batch(self, indices: Sequence[int], read: Callable[[int], Any]) -> list[tuple[int, Any] | None]:
        """first_readable(index, read) for each of `indices`, read in `read_order`, in the order given."""
        out: list[tuple[int, Any] | None] = [None] * len(indices)
        for k in self.read_order(indices):
            out[k] = self.first_readable(indices[k], read)
        return out

    def first_readable(
        self, index: int, read: Callable[[int], Any], substitute: bool | None = None
    ) -> tuple[int, Any] | None:
        """(position, read(position)) for the sample at `index`; with skip_corrupt, a sample whose
        read raises CorruptImageError is logged, counted and replaced by the next readable one
        (`substitute`, by default the dataset's), or gives None (evaluation: the caller's stand-in is
        not scored; decoding into memory: left out)."""
        substitute = self.substitute if substitute is None else substitute
        for offset in range(len(self.samples) if substitute else 1):
            position = (index + offset) % len(self.samples)
            try:
                return position, read(position)
            except CorruptImageError as e:
                if not self.skip_corrupt:
                    raise
                self.skipped(e)
        if not substitute:
            return None
        raise CorruptImageError(f"none of the {len(self.samples)} images could be decoded")

    @property
    def num_skipped(self) -> int:
        """The files this process has skipped (skip_corrupt), each counted once however often it is read."""
        return len(self.skipped_files)

    def skipped(self, error: CorruptImageError) -> None:
        """Log and count a file skipped for `error` (skip_corrupt), the first time it is skipped."""
        if str(error) in self.skipped_files:
            return
        self.skipped_files.add(str(error))
        count = self.num_skipped
        log.warning("skipped %s (%d corrupt images skipped so far in this split, in this process)", error, count)


GOLDEN = (5**0.5 - 1) / 2  # decoded_in_worker: n x GOLDEN mod 1 spreads evenly over [0, 1)


def decoded_in_worker(position: int, share: float) -> bool:
    """Whether a loader worker decodes sample `position` even if the device could (the device
    path's `worker_decode`: `share` of them, spread evenly over the positions, the same every epoch)."""
    return ((position + 1) * GOLDEN) % 1.0 < share


class ImageFiles(_SeededTransform, FileSamples):
    """Images read from files (FileSamples: with skip_corrupt's policy), decoded and transformed in
    a loader worker; or read for the device path as it takes them (`read_encoded`)."""

    def __init__(
        self,
        samples: Sequence[Sample],
        transform: Transform | None = None,
        skip_corrupt: bool = False,
        substitute: bool = True,
    ) -> None:
        FileSamples.__init__(self, samples, skip_corrupt, substitute)
        self.transform = transform

    def subset(self, indices: Sequence[int], transform: Transform | None) -> ImageFiles:
        """These samples with another transform (e.g. a held-out validation split)."""
        return ImageFiles([self.samples[i] for i in indices], transform, self.skip_corrupt)

    def load(self, index: int) -> tuple[np.ndarray, int]:
        found = self.first_readable(index, self.read_image)
        if found is None:
            return np.zeros((32, 32, 3), dtype=np.uint8), MISSING
        position, image = found
        return image, self.samples[position].label

    def read_image(self, position: int) -> np.ndarray:
        """The decoded RGB image of sample `position`; CorruptImageError naming it if it does not decode."""
        return read_rgb(self.samples[position].path)

    def fingerprint(self) -> bytes:
        """What the samples' content depends on, for a cache of them decoded (vit.data.memory): each
        file's path, label, size and modification time."""
        lines = []
        for s in self.samples:
            try:
                st = os.stat(s.path)
            except FileNotFoundError:  # a broken link: its own stat (reading it then names it)
                st = os.lstat(s.path)
            lines.append(f"{os.path.abspath(s.path)}|{s.label}|{st.st_size}|{st.st_mtime_ns}\n")
        return "".join(lines).encode()

    def read_bytes(self, position: int) -> bytes:
        """The encoded file of sample `position`, as stored; CorruptImageError naming it if it cannot be read."""
        return read_file(self.samples[position].path)

    def read_encoded(self, position: int, worker_decode: float = 0.0) -> tuple[torch.Tensor, int, int]:
        """Sample `position` as the device path takes it, with its height and width: a JPEG the
        device decodes (read_header) as its bytes, uint8 (N,), unless it is one of `worker_decode`'s
        share (decoded_in_worker); any other image decoded here, uint8 (3, H, W).
        CorruptImageError naming the file if it is unreadable."""
        try:
            data = self.read_bytes(position)
            if data.startswith(JPEG_MAGIC):
                height, width, for_device = read_header(data)
                if for_device and not decoded_in_worker(position, worker_decode):
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

    def __getitems__(self, items: Sequence[int | tuple[int, int]]) -> list[Any]:
        """A loader worker's batch: the samples read in `read_order`, returned in the order asked.
        Each sample depends only on its own (index, seed), so the order read changes nothing else.
        A transform with `apply_batch(images, seeds)` (NaFlex's) takes the batch's images in one call."""
        out: list[Any] = [None] * len(items)
        order = self.read_order([item[0] if isinstance(item, tuple) else item for item in items])
        apply_batch = getattr(self.transform, "apply_batch", None)
        if apply_batch is None or not all(isinstance(item, tuple) for item in items):
            for k in order:
                out[k] = self[items[k]]
            return out
        for k in order:
            out[k] = self.load(items[k][0])  # type: ignore[index]
        images = apply_batch([image for image, _ in out], [item[1] for item in items])  # type: ignore[index]
        return [(image, label) for image, (_, label) in zip(images, out, strict=True)]


def channels_first(pixels: np.ndarray) -> torch.Tensor:
    """A decoded RGB image (H, W, 3), as the per-sample decoder gives it, as the device path's (3, H, W)."""
    return torch.from_numpy(np.ascontiguousarray(pixels.transpose(2, 0, 1)))


class ImageArrays(_SeededTransform):
    """Images held in memory: uint8 (N, H, W, 3), or (N, H, W) greyscale, with integer labels."""

    def __init__(self, images: np.ndarray, labels: Sequence[int], transform: Transform | None = None):
        if images.ndim == 3:
            images = np.repeat(images[..., None], 3, axis=-1)
        if images.ndim != 4 or images.shape[-1] != 3 or images.dtype != np.uint8:
            raise ValueError(f"expected uint8 images (N, H, W, 3), got {images.dtype} {images.shape}")
        if len(images) != len(labels):
            raise ValueError(f"{len(images)} images but {len(labels)} labels")
        self.images = images
        self.labels = np.asarray(labels, dtype=np.int64)
        self.transform = transform

    def __len__(self) -> int:
        return len(self.images)

    def subset(self, indices: Sequence[int], transform: Transform | None) -> ImageArrays:
        """These images with another transform (e.g. a held-out validation split)."""
        indices = np.asarray(indices, dtype=np.int64)
        return ImageArrays(self.images[indices], self.labels[indices], transform)

    def load(self, index: int) -> tuple[np.ndarray, int]:
        return self.images[index], int(self.labels[index])
