"""Image folder layouts: the samples (file, label, object box) of a tree of class folders
(torchvision's ImageFolder) or of Tiny-ImageNet's official layout, and class names as people read them.
"""

from __future__ import annotations

import logging
import os
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm")


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
