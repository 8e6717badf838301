"""Sharded streaming data with Lightning's litdata: an image folder converted once into chunks of
encoded images (`scripts/convert_streaming.py`), read from a local folder, a shared filesystem or
object storage (`s3://bucket/prefix`; litdata downloads and caches the chunks it needs).

    DST/train/index.json, DST/train/chunk-*.bin    litdata's format; the index also holds "vit":
    DST/val/index.json,   DST/val/chunk-*.bin      the class folder names and every sample's label

A sample is {"image": the file's bytes (the longer side capped if asked), "label", "path" (its path
in the source folder)}. Training images are shuffled once when written, so that every chunk holds a
mix of classes. Training reads them by index, in the order of vit.data.sampling.ChunkedSampler
(each process reads its own share of the chunks, a few at a time); the datamodule decodes and
augments them as it does image files (on the device with `data.pipeline device`, else per sample).
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from vit.data.images import ImageFiles, Sample, Transform, read_rgb

log = logging.getLogger(__name__)

INDEX = "index.json"


def open_streaming(url: str, cache_dir: str | None = None, max_cache_size: str | None = None) -> Any:
    """litdata's StreamingDataset over `url` (a local folder or `s3://...`), read by index in our
    sampler's order: each read deserializes its own sample (`batch_decode=0`), where litdata's
    default deserializes a window of up to 256 around it, wasted on a shuffled order (it doubled a
    loader worker's time per 500x375 JPEG)."""
    from litdata import StreamingDataset

    options = {"max_cache_size": max_cache_size} if max_cache_size else {}
    return StreamingDataset(url, cache_dir=cache_dir, batch_decode=0, **options)


def check_local_split(url: str) -> None:
    """A local split without its index: FileNotFoundError saying why (a conversion that did not
    finish, none made, an image folder in its place) where litdata says only that the path does not
    exist. Object storage (`s3://...`) is left to litdata."""
    if re.match(r"[A-Za-z][A-Za-z0-9+.-]+:/", url) or (Path(url) / INDEX).is_file():
        return
    split = Path(url)
    root, tmp = split.parent, split.parent / f".{split.name}.tmp"  # convert_streaming's split being written
    if split.is_dir():
        raise FileNotFoundError(
            f"{split} has no {INDEX}, so it is not a split converted by scripts/convert_streaming.py: convert "
            f"the image folder with scripts/convert_streaming.py SRC {root}"
        )
    if tmp.is_dir():
        raise FileNotFoundError(
            f"the conversion at {root} did not finish ({tmp} is there but {split} is not): "
            "run scripts/convert_streaming.py again"
        )
    raise FileNotFoundError(
        f"{split} does not exist: convert the image folder with scripts/convert_streaming.py SRC {root}"
    )


def read_index(dataset: Any) -> dict[str, Any]:
    """The split's index.json (litdata keeps a local copy of a remote one where it reads the chunks)."""
    folder = dataset.input_dir.path or dataset.input_dir.url
    return json.loads((Path(folder) / INDEX).read_text())


class StreamingImages(ImageFiles):
    """One split of a converted dataset as an ImageFiles: `read_bytes` gives the stored file,
    `read_image` its decoded pixels (so both the device path and the per-sample path read it), and
    `chunk_of` the chunk that holds each sample. Each process opens the dataset on its first read."""

    def __init__(
        self,
        url: str,
        transform: Transform | None = None,
        skip_corrupt: bool = False,
        cache_dir: str | None = None,
        max_cache_size: str | None = None,
        positions: np.ndarray | None = None,
        index: dict[str, Any] | None = None,
    ) -> None:
        self.url, self.cache_dir, self.max_cache_size = url, cache_dir, max_cache_size
        self._dataset, self._pid = None, None
        if index is None:
            check_local_split(url)
            index = read_index(self._open())
        if "vit" not in index:
            raise ValueError(
                f"{url}/{INDEX} has no class names and labels: convert the image folder with "
                "scripts/convert_streaming.py (a litdata dataset written otherwise lacks them)"
            )
        self.index = index
        labels = np.asarray(index["vit"]["labels"], dtype=np.int64)
        self.positions = np.arange(len(labels)) if positions is None else np.asarray(positions)
        samples = [Sample(f"{url}[{i}]", int(labels[i])) for i in self.positions]
        super().__init__(samples, transform, skip_corrupt)
        sizes = [chunk["chunk_size"] for chunk in index["chunks"]]
        if sum(sizes) != len(labels):
            raise ValueError(f"{url}/{INDEX} lists {sum(sizes)} samples in its chunks but {len(labels)} labels")
        self.chunk_of = np.searchsorted(np.cumsum(sizes), self.positions, side="right")

    @property
    def classes(self) -> list[str]:
        return list(self.index["vit"]["classes"])

    @property
    def class_names(self) -> list[str]:
        return list(self.index["vit"]["class_names"])

    def _open(self) -> Any:
        if self._dataset is None or self._pid != os.getpid():  # a forked loader worker opens its own
            self._dataset, self._pid = open_streaming(self.url, self.cache_dir, self.max_cache_size), os.getpid()
        return self._dataset

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_dataset": None, "_pid": None}

    def read_item(self, position: int) -> dict[str, Any]:
        """Sample `position` as stored: {"image": the file's bytes, "label", "path" in the source folder}."""
        return self._open()[int(self.positions[position])]

    def read_bytes(self, position: int) -> bytes:
        return bytes(self.read_item(position)["image"])

    def read_image(self, position: int) -> np.ndarray:
        item = self.read_item(position)
        return read_rgb(io.BytesIO(bytes(item["image"])), f"{self.samples[position].path} ({item['path']})")

    def name(self, position: int) -> str:
        """`url[i]` and the file it was converted from (read from its chunk: an error's name only)."""
        try:
            return f"{self.samples[position].path} ({self.read_item(position)['path']})"
        except Exception:  # naming a sample must not raise a second error
            return self.samples[position].path

    def fingerprint(self) -> bytes:
        """The split's chunks (names, sizes) and labels, and which of its samples these are."""
        key = {"url": self.url, "chunks": self.index["chunks"], "vit": self.index["vit"]}
        return json.dumps(key, sort_keys=True).encode() + np.asarray(self.positions, dtype=np.int64).tobytes()

    def read_order(self, positions: Sequence[int]) -> Sequence[int]:
        """Chunk by chunk, each in stored order: litdata keeps only a few chunks mapped in each
        process, so a shuffled batch read as asked would map and unmap them sample by sample,
        each time asking the kernel to read the whole chunk ahead."""
        stored = self.positions[np.asarray(positions, dtype=np.int64)]
        return np.lexsort((stored, self.chunk_of[np.asarray(positions, dtype=np.int64)])).tolist()

    def subset(self, indices: Any, transform: Transform | None) -> StreamingImages:
        return StreamingImages(self.url, transform, self.skip_corrupt, self.cache_dir, self.max_cache_size,
                               self.positions[np.asarray(indices)], self.index)  # fmt: skip
