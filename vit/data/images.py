"""Image sources: reading files safely, scanning folder layouts, and the two Dataset classes.

Every image comes out as an RGB uint8 array (H, W, 3): greyscale, palette and RGBA files are
converted, and a file that cannot be decoded raises an error naming it (or is skipped and counted,
where configured) instead of feeding garbage to the model.
"""

from __future__ import annotations

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


def read_rgb(path: str | Path | BinaryIO, name: str | None = None) -> np.ndarray:
    """Decode an image file (or an open binary file, named `name` in errors) into an RGB uint8
    array (H, W, 3). 16-bit greyscale is scaled to 8 bits (PIL's own conversion clips it, turning
    most images white); float images have no standard range and are refused."""
    if name is None:
        name = str(path)
    try:
        with Image.open(path) as image:
            if image.mode in SIXTEEN_BIT_MODES:
                grey = np.clip(np.round(np.asarray(image, dtype=np.float64) / 257.0), 0, 255).astype(np.uint8)
                return np.repeat(grey[..., None], 3, axis=-1)
            if image.mode != "F":
                return np.asarray(image.convert("RGB"))
    except FileNotFoundError as e:
        if not isinstance(path, str | Path) or not os.path.islink(path):
            raise
        raise broken_link(path, name) from e
    except (UnidentifiedImageError, Image.DecompressionBombError, OSError, ValueError, SyntaxError) as e:
        raise CorruptImageError(f"cannot decode image {name}: {e}") from e
    raise ValueError(f"{name} is a 32-bit float image, which has no standard range: convert it to 8 or 16 bits")


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
        self.num_skipped = 0

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

    def skipped(self, error: CorruptImageError) -> None:
        """Log and count a file skipped for `error` (skip_corrupt)."""
        self.num_skipped += 1
        log.warning("skipped %s (%d corrupt images skipped so far in this process)", error, self.num_skipped)


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
