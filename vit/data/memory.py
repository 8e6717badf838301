"""Datasets that fit in memory: decode once into a uint8 tensor, then augment whole batches on the device.

The per-sample path (a DataLoader worker decoding and augmenting one image at a time) costs a CPU
core on a laptop and starves a GPU at CIFAR scale. Here the images are decoded once (and cached on
disk, keyed by the source files), batches are gathered by index from one tensor, and augmented
whole where the model runs (vit.data.augment), with no per-sample Python.
Randomness is a function of (seed, epoch, batch, rank) (vit.seeds), so resumed runs see the same batches.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from vit.data import host
from vit.data.augment import EVAL_RESIZE
from vit.data.geometry import eval_pixels
from vit.data.images import ImageArrays, ImageFiles
from vit.data.sampling import ResumableSampler
from vit.options import require
from vit.seeds import Purpose, seed_for

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Memory:
    """The options of the in-memory pipeline (`data.pipeline memory`).

    Args:
        cache_dir: where the decoded splits are cached; None: `<default_root_dir>/cache`.
        train_sizes: progressive resizing, [[progress, size], ...]: training at `size` from that
            fraction of the run on (e.g. [[0, 16], [0.5, 24], [0.75, 32]]); validation stays at
            img_size. The model must accept other sizes (rope/sincos2d, or dynamic_img_size).
            Held sorted by progress.
    """

    cache_dir: str | None = None
    train_sizes: list[tuple[float, int]] | None = None

    def __post_init__(self) -> None:
        for entry in self.train_sizes or []:
            ok = isinstance(entry, list | tuple) and len(entry) == 2 and isinstance(entry[0], int | float)
            ok = ok and 0 <= entry[0] <= 1 and isinstance(entry[1], int) and entry[1] >= 1
            require(ok, "data.memory.train_sizes", self.train_sizes, "[[progress from 0 to 1, size in pixels], ...]")
        if self.train_sizes:
            object.__setattr__(self, "train_sizes", sorted((float(p), int(size)) for p, size in self.train_sizes))


class TensorImages(Dataset):
    """uint8 images (N, 3, H, W) and labels (N,), indexed by whole batches of indices.

    `dataset[indices]` -> (images, labels); `dataset[(indices, seed)]` -> (images, labels, seed),
    the seed (a Python int) travelling with the batch to the device-side augmentation. Not a
    tensor: that would move to the device with the batch and be read back each step, the host
    waiting there for the device.
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        if images.dtype != torch.uint8 or images.ndim != 4 or images.shape[1] != 3:
            raise ValueError(f"expected uint8 images (N, 3, H, W), got {images.dtype} {tuple(images.shape)}")
        if len(images) != len(labels):
            raise ValueError(f"{len(images)} images but {len(labels)} labels")
        self.images, self.labels = images, labels.long()

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, item):
        if isinstance(item, tuple):
            indices, seed = item
            return self.images[indices], self.labels[indices], seed
        return self.images[item], self.labels[item]


class ResumableBatchSampler(ResumableSampler):
    """Whole batches of indices (a tensor each) of the ResumableSampler's order: shuffled by
    (seed, epoch), shared among the processes as DistributedSampler shares it (Lightning keeps it
    under DDP and calls `set_epoch`).

    With `shuffle`, each batch comes with its augmentation seed (vit.seeds: Purpose.BATCH).
    `resume_epoch` / `resume_position` start an epoch part-way, counted in images as every
    ResumableSampler counts (ResumableLoader sets them): at the batch that holds that image.
    """

    def __init__(
        self,
        dataset: Dataset,
        batch_size: int,
        shuffle: bool,
        seed: int = 0,
        drop_last: bool = False,
        num_replicas: int | None = None,
        rank: int | None = None,
    ) -> None:
        super().__init__(dataset, shuffle=shuffle, seed=seed, num_replicas=num_replicas, rank=rank)
        self.batch_size, self.drop_batch = batch_size, drop_last

    def _batches(self) -> list[torch.Tensor]:
        batches = list(torch.tensor(self.epoch_order(), dtype=torch.int64).split(self.batch_size))
        if self.drop_batch and len(batches) > 1 and len(batches[-1]) < self.batch_size:
            batches.pop()
        return batches

    def __len__(self) -> int:
        full, rest = divmod(self.num_samples, self.batch_size)
        return full + (1 if rest and not (self.drop_batch and full >= 1) else 0)

    def __iter__(self) -> Iterator:
        start = self.begin_epoch() // self.batch_size
        batches = self._batches()
        for b in range(start, len(batches)):
            if not self.shuffle:
                yield batches[b]
                continue
            yield batches[b], seed_for(self.seed, Purpose.BATCH, self.epoch, b, self.rank)


# -- decoding once, with a cache -------------------------------------------------------------------


def to_tensor_images(
    dataset: ImageFiles | ImageArrays, img_size: int, crop_pct: float = 1.0, cache_dir: str | Path | None = None
) -> TensorImages:
    """Decode a dataset into memory at img_size x img_size (shorter side resized to
    img_size / crop_pct, centre crop: the eval geometry), caching the result in cache_dir.

    The cache file's name is a hash of what determines its content: the source files' paths,
    labels, sizes and modification times (or the array bytes), the geometry, and skip_corrupt (a
    cache that left corrupt files out is not one a strict run may use). A changed folder is
    decoded again; a file rewritten with the same size and modification time is not (delete the
    cache, `<default_root_dir>/cache` by default, after such a change). A cache file that cannot be
    read is decoded again, with a warning; one that cannot be written (a full disk) is skipped,
    with a warning naming it. With skip_corrupt, undecodable files are left out and counted.
    """
    path = None
    if cache_dir is not None:
        path = Path(cache_dir) / f"images-{_content_key(dataset, img_size, crop_pct)}.npz"
        _remove_orphaned_temporaries(path)
        if path.is_file():
            try:
                with np.load(path) as cached:
                    return _tensor_images(cached["images"], cached["labels"])
            except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as e:
                log.warning("the image cache %s cannot be read (%s: %s); decoding the images again", path,
                            type(e).__name__, e)  # fmt: skip
    start = time.perf_counter()
    images, labels = _decode(dataset, img_size, crop_pct)
    log.info("decoded %d images into memory in %.1f s", len(images), time.perf_counter() - start)
    if path is not None:
        _write_cache(path, images, labels)
    return _tensor_images(images, labels)


def _write_cache(path: Path, images: np.ndarray, labels: np.ndarray) -> None:
    """Write the cache atomically (a reader never sees a partial file); a failure only costs the cache."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            np.savez(f, images=images, labels=labels)
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        log.warning("could not write the image cache %s (%s); training goes on without it", path, e.strerror or e)


def _remove_orphaned_temporaries(path: Path) -> None:
    """Temporary cache files of processes that were killed while writing (`.<name>.<pid>.tmp`)."""
    for tmp in path.parent.glob(f".{path.name}.*.tmp") if path.parent.is_dir() else []:
        pid = tmp.name.removeprefix(f".{path.name}.").removesuffix(".tmp")
        if pid.isdigit() and not _running(int(pid)):
            with contextlib.suppress(OSError):
                tmp.unlink()


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _tensor_images(images: np.ndarray, labels: np.ndarray) -> TensorImages:
    return TensorImages(torch.from_numpy(np.ascontiguousarray(images.transpose(0, 3, 1, 2))), torch.from_numpy(labels))


def _decode(dataset: ImageFiles | ImageArrays, img_size: int, crop_pct: float) -> tuple[np.ndarray, np.ndarray]:
    needed = 2 * len(dataset) * img_size * img_size * 3  # the decoded list, then the stacked copy
    available = host.available_memory()
    if available is not None and needed > available:
        raise MemoryError(
            f"the memory pipeline: {len(dataset):,} images at {img_size}x{img_size} need about "
            f"{needed / 2**30:.1f} GiB to decode, more than the {available / 2**30:.1f} GiB available; check "
            "img_size or use --data.pipeline per_sample"
        )
    images, labels = [], []
    for i in range(len(dataset)):
        if isinstance(dataset, ImageFiles):  # with skip_corrupt, an unreadable file is logged and left out
            found = dataset.first_readable(i, dataset.read_image, substitute=False)
            if found is None:
                continue
            image, label = found[1], dataset.samples[i].label
        else:
            image, label = dataset.images[i], int(dataset.labels[i])
        if crop_pct != 1.0 or image.shape[:2] != (img_size, img_size):
            image = eval_pixels(image, img_size, crop_pct)
        images.append(image)
        labels.append(label)
    if not images:
        raise ValueError("no images could be decoded")
    return np.stack(images), np.asarray(labels, dtype=np.int64)


def _content_key(dataset: ImageFiles | ImageArrays, img_size: int, crop_pct: float) -> str:
    h = hashlib.sha1()
    if isinstance(dataset, ImageFiles):
        h.update(dataset.fingerprint())
    else:
        h.update(f"{dataset.images.shape}|{dataset.images.dtype}\n".encode())
        h.update(np.ascontiguousarray(dataset.images).tobytes())
        h.update(dataset.labels.tobytes())
    h.update(json.dumps([img_size, crop_pct, EVAL_RESIZE, bool(getattr(dataset, "skip_corrupt", False))]).encode())
    return h.hexdigest()[:16]
