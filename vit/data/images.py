"""Image sources: reading files safely, scanning folder layouts, and the two Dataset classes.

Every image comes out as an RGB uint8 array (H, W, 3): greyscale, palette and RGBA files are
converted, and a file that cannot be decoded raises an error naming it (or is skipped and counted,
where configured) instead of feeding garbage to the model.
"""

from __future__ import annotations

import io
import logging
import os
import re
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
from PIL import Image, UnidentifiedImageError
from torch.utils.data import Dataset

log = logging.getLogger(__name__)

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm")


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


@dataclass(frozen=True)
class Sample:
    path: str
    label: int
    box: tuple[float, float, float, float] | None = None  # x0, y0, x1, y1 in pixels, where known


def scan_image_folder(root: str | Path, classes: Sequence[str] | None = None) -> tuple[list[str], list[Sample]]:
    """`root/<class>/<image>` (ImageNet / torchvision ImageFolder layout) -> (class names, samples).

    Classes are the sorted sub-folder names unless given (a val split must use the train split's).
    """
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"image folder {root} does not exist; expected {root}/<class name>/<image files>")
    found = sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))
    if classes is None:
        classes = found
    elif missing := sorted(set(found) - set(classes)):
        raise ValueError(f"{root} has class folders that the training split does not: {', '.join(missing[:10])}")
    if not classes:
        raise FileNotFoundError(f"{root} has no class sub-folders; expected {root}/<class name>/<image files>")
    samples, ignored = [], []
    for label, name in enumerate(classes):
        folder = root / name
        if not folder.is_dir():
            log.warning("%s has no folder for class %r: it is not evaluated", root, name)
            continue
        files, others = _class_files(folder)
        ignored += others
        if not files:
            log.warning("%s has no images: class %r gets none (an empty folder still counts as a class)", folder, name)
        samples += [Sample(f, label) for f in files]
    if ignored:
        log.warning(
            "%s: %d file(s) without an image extension are not read, e.g. %s (images are %s)",
            root, len(ignored), ignored[0], ", ".join(IMAGE_EXTENSIONS),
        )  # fmt: skip
    if not samples:
        raise FileNotFoundError(f"no images ({', '.join(IMAGE_EXTENSIONS)}) under {root}/<class name>/")
    return list(classes), samples


def _class_files(folder: Path) -> tuple[list[str], list[str]]:
    """A class folder's image files, sub-folders included (as torchvision's ImageFolder reads them),
    and its other files; hidden files and folders (".*", macOS "._*" resource forks) are neither."""
    images, others, seen = [], [], set()
    top = os.path.realpath(folder)

    def walked(path: str) -> bool:  # a link up to the class folder or above it (a loop), or to one walked before
        real = os.path.realpath(path)
        return real in seen or top == real or top.startswith(real.rstrip(os.sep) + os.sep)

    for directory, subdirs, names in os.walk(folder, followlinks=True):
        seen.add(os.path.realpath(directory))
        subdirs[:] = sorted(d for d in subdirs if not d.startswith(".") and not walked(os.path.join(directory, d)))
        for name in sorted(names):
            if not name.startswith("."):
                path = os.path.join(directory, name)
                (images if name.lower().endswith(IMAGE_EXTENSIONS) else others).append(path)
    return images, others


def readable_class_names(classes: Sequence[str], root: str | Path) -> list[str]:
    """Class folder names as people read them: WordNet ids are looked up in `root/words.txt` when
    there is one (Tiny-ImageNet's "n01443537<TAB>goldfish, Carassius auratus" gives "goldfish");
    other names are kept as they are. Classes whose first words are the same (ImageNet's two
    "crane"s, the bird and the machine) keep their ids: "crane (n02012849)"."""
    words = Path(root) / "words.txt"
    if not words.is_file():
        return list(classes)
    lookup = dict(line.split("\t", 1) for line in words.read_text().splitlines() if "\t" in line)
    names = [lookup.get(c, c).split(",")[0].strip() or c for c in classes]
    taken = Counter(names)
    return [f"{name} ({c})" if taken[name] > 1 and name != c else name for name, c in zip(names, classes, strict=True)]


def same_class_names(saved: Sequence[str], names: Sequence[str]) -> bool:
    """Whether a checkpoint's class names are these: equal, or equal but for the ids that
    readable_class_names keeps where first words agree (a checkpoint saved before it kept them)."""
    return list(saved) == list(names) or list(saved) == [re.sub(r" \([^()]+\)$", "", name) for name in names]


def scan_tiny_imagenet(root: str | Path, split: str) -> tuple[list[str], list[Sample]]:
    """Tiny-ImageNet-200 in its official layout, with each image's object box.

    train: `train/<wnid>/images/*.JPEG`, boxes in `train/<wnid>/<wnid>_boxes.txt`;
    val: `val/images/*.JPEG`, labels and boxes in `val/val_annotations.txt`.
    """
    root = Path(root)
    wnids_file = root / "wnids.txt"
    if not wnids_file.is_file():
        raise FileNotFoundError(
            f"{wnids_file} not found; expected the official Tiny-ImageNet layout under {root}: "
            "wnids.txt, train/<wnid>/images/*.JPEG, val/images/*.JPEG and val/val_annotations.txt"
        )
    classes = sorted(line.strip() for line in wnids_file.read_text().splitlines() if line.strip())
    index = {wnid: i for i, wnid in enumerate(classes)}
    samples = []
    if split == "train":
        for wnid in classes:
            boxes = _read_boxes(root / "train" / wnid / f"{wnid}_boxes.txt", with_label=False)
            folder = root / "train" / wnid / "images"
            if not folder.is_dir():
                raise FileNotFoundError(f"{folder} not found (class {wnid} listed in {wnids_file})")
            for name in sorted(os.listdir(folder)):
                if name.lower().endswith(IMAGE_EXTENSIONS) and not name.startswith("."):  # macOS "._*" too
                    box = boxes[name][0] if name in boxes else None
                    samples.append(Sample(str(folder / name), index[wnid], box))
    elif split == "val":
        annotations = root / "val" / "val_annotations.txt"
        if not annotations.is_file():
            raise FileNotFoundError(f"{annotations} not found; it holds the val labels (file, wnid, x0, y0, x1, y1)")
        for name, (wnid, box) in sorted(_read_boxes(annotations, with_label=True).items()):
            if wnid not in index:
                raise ValueError(f"{annotations}: {name} has class {wnid}, which is not in {wnids_file}")
            samples.append(Sample(str(root / "val" / "images" / name), index[wnid], box))
    else:
        raise ValueError(f"Tiny-ImageNet split must be 'train' or 'val', got {split!r}")
    return classes, samples


def _read_boxes(path: Path, with_label: bool) -> dict:
    """`file [wnid] x0 y0 x1 y1` per line -> {file: ([wnid,] box)}; missing file -> {}."""
    if not path.is_file():
        return {}
    out = {}
    for line_no, line in enumerate(path.read_text().splitlines(), 1):
        parts = line.split()
        if not parts:
            continue
        expected = 6 if with_label else 5
        if len(parts) != expected:
            raise ValueError(f"{path}:{line_no}: expected {expected} fields, got {len(parts)}: {line!r}")
        box = tuple(float(v) for v in parts[-4:])
        out[parts[0]] = (parts[1], box) if with_label else (box,)
    return out


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


class ImageFiles(_SeededTransform):
    """Images read from files. With `skip_corrupt`, an undecodable file is logged by name, counted,
    and, instead of stopping the run, replaced by the next sample (`substitute`, for training) or by
    a black image labelled MISSING (evaluation, where a substitute would be scored twice: the
    evaluation steps leave MISSING out of the scores). Either way every batch keeps its size, so
    DDP ranks stay in step."""

    def __init__(
        self,
        samples: Sequence[Sample],
        transform: Transform | None = None,
        skip_corrupt: bool = False,
        substitute: bool = True,
    ) -> None:
        self.samples = list(samples)
        self.transform = transform
        self.skip_corrupt = skip_corrupt
        self.substitute = substitute
        self.skipped_files: set[str] = set()  # each file's error, as logged: a file read again is not counted again

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def labels(self) -> np.ndarray:
        return np.array([s.label for s in self.samples], dtype=np.int64)

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

    def name(self, position: int) -> str:
        """Sample `position` as errors name it: its file."""
        return self.samples[position].path

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

    def read_order(self, positions: Sequence[int]) -> Sequence[int]:
        """The order to read a batch's samples in (indices into `positions`): as asked, for files."""
        return range(len(positions))

    def __getitems__(self, items: Sequence[int | tuple[int, int]]) -> list[Any]:
        """A loader worker's batch: the samples read in `read_order`, returned in the order asked.
        Each sample depends only on its own (index, seed), so the order read changes nothing else."""
        out: list[Any] = [None] * len(items)
        for k in self.read_order([item[0] if isinstance(item, tuple) else item for item in items]):
            out[k] = self[items[k]]
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
