"""A synthetic ImageNet for the data check (vit.tools.data_check) and the data studies
(benchmarks/data_*.py): photo-like images of ImageNet's size and JPEG weight, written as an image
folder tree, and one such photo as the encoded bytes a loader worker hands over."""

from __future__ import annotations

import io
import multiprocessing
import os
from pathlib import Path

import numpy as np
import torch
from PIL import Image


def synthetic_photo(rng: np.random.Generator, width: int, height: int) -> Image.Image:
    """Smooth colour regions, mid-frequency texture and grain: JPEG-encodes at quality 90 to about
    4 bits a pixel (98 KB at 500x375), as ImageNet's photos do."""
    low = rng.integers(0, 256, (height // 25 + 2, width // 25 + 2, 3), dtype=np.uint8)
    mid = rng.integers(0, 256, (height // 4 + 1, width // 4 + 1, 3), dtype=np.uint8)
    base = np.asarray(Image.fromarray(low).resize((width, height), Image.BICUBIC), dtype=np.float32)
    texture = np.asarray(Image.fromarray(mid).resize((width, height), Image.BILINEAR), dtype=np.float32) - 128
    pixels = base + 0.35 * texture + rng.normal(0, 14, (height, width, 3))
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


def _write_one(job: tuple[Path, int, tuple[int, int]]) -> int:
    path, seed, (width, height) = job
    rng = np.random.default_rng(seed)
    w, h = (
        int(rng.integers(width * 4 // 5, width * 6 // 5 + 1)),
        int(rng.integers(height * 4 // 5, height * 6 // 5 + 1)),
    )
    image = synthetic_photo(rng, w, h)
    buffer = io.BytesIO()
    if path.suffix == ".png":
        image.save(buffer, "PNG")
    else:
        (image.convert("L") if seed % 20 == 1 else image).save(buffer, "JPEG", quality=90)
    path.write_bytes(buffer.getvalue())
    return len(buffer.getvalue())


SPAWN_PIXELS = 10**8  # write_synthetic_imagenet's pixels (~20 s in one process) worth starting workers for


def write_synthetic_imagenet(
    root: str | Path, train: int, val: int, classes: int = 100, size: tuple[int, int] = (500, 375),
    workers: int | None = None,
) -> dict[str, float]:  # fmt: skip
    """`root/{train,val}/n<class>/<i>.JPEG` (every 20th a greyscale JPEG, every 20th from the 10th a
    PNG), sizes within 20% of `size`; returns the image count and mean file size in KB. `workers`
    (None: one a core, if the tree is large enough to repay starting them) write it in parallel.
    A tree cut short while written is marked so (synthetic_tree_wanted)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    (root / WRITING).touch()
    jobs = []
    for split, count in (("train", train), ("val", val)):
        for i in range(count):
            folder = root / split / f"n{i % classes:08d}"
            folder.mkdir(parents=True, exist_ok=True)
            seed = i if split == "train" else 10**6 + i
            jobs.append((folder / f"{i}.{'png' if i % 20 == 10 else 'JPEG'}", seed, size))
    if workers is None:  # a worker takes seconds to start (it imports torch); an image ~0.2 us a pixel
        small = len(jobs) * size[0] * size[1] < SPAWN_PIXELS
        workers = 1 if small else min(16, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1)
    if workers > 1:
        with multiprocessing.get_context("spawn").Pool(workers) as pool:
            sizes = pool.map(_write_one, jobs, chunksize=16)
    else:
        sizes = [_write_one(job) for job in jobs]
    (root / WRITING).unlink()
    return {"images": len(sizes), "mean_kb": float(np.mean(sizes)) / 1e3}


WRITING = ".writing"  # in a synthetic tree's root while write_synthetic_imagenet writes it


def synthetic_tree_wanted(root: str | Path) -> bool:
    """Whether `root` lacks an image tree, or holds a synthetic one whose writing was cut short:
    a tree of one's own (no mark) is used as it is."""
    return not (Path(root) / "train").is_dir() or (Path(root) / WRITING).exists()


def photo_jpeg(rng: np.random.Generator) -> torch.Tensor:
    """A 500x375 synthetic photo as JPEG bytes (quality 90), as a loader worker hands them over."""
    buffer = io.BytesIO()
    synthetic_photo(rng, 500, 375).save(buffer, "JPEG", quality=90)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
