"""A training batch walks forward through vit/: it turns back into a file it has left only a few
times a batch, and at most twice an image, on every image path.

The walk is traced as the issue measured it: `sys.setprofile` (and `threading.setprofile`, for a
thread that prepares batches ahead) over `next(iter(train_loader))` plus the datamodule's
`on_after_batch_transfer`, recording, in each thread, the innermost frame on the Python stack that
runs code of a file in vit/ each time that file changes. A *return* is an entry into a file the
batch has already left, counted in every thread. What counts as a file: a module of vit/, named by
its path; a package's `__init__.py` is not a visit (a re-export or a lazy attribute look-up says
where a name lives, not a step of the batch), nor a module's own top-level code (an import the first
batch triggers). Code that is not in vit/ (torch's loader, albumentations, numpy, the code a
dataclass or NamedTuple generates) leaves the batch in the vit/ file that called it.

The data: 40 small JPEGs of 4 classes written with PIL, 32 px, num_workers 0, RandAugment with 2
ops (so every stage of each path runs), the run seed 0. The loader is iterated once untraced first,
so that imports and caches the first batch fills do not count.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

import vit

VIT = os.path.dirname(os.path.abspath(vit.__file__)) + os.sep
MAX_RETURNS = 30  # a batch of 8, every path
MAX_PER_IMAGE = 2  # (batch of 8 - batch of 1) / 7

PATHS: dict[str, dict[str, Any]] = {
    "per_sample": {},
    "memory": dict(pipeline="memory"),
    "device": dict(pipeline="device", data_process=False, augment=dict(crop="rrc", randaugment_ops=2)),
    "naflex": dict(naflex="naflex"),
}


def vit_file(frame: Any) -> str | None:
    """The vit/ file (relative path) whose code runs innermost at `frame`, or None outside vit/."""
    while frame is not None:
        path = frame.f_code.co_filename
        if path.startswith(VIT) and not path.endswith("__init__.py") and frame.f_code.co_name != "<module>":
            return path[len(VIT) :]
        frame = frame.f_back
    return None


def walk(step: Callable[[], Any]) -> dict[str, list[str]]:
    """The files of vit/ that `step()` runs through, in order, one list per thread."""
    walks: dict[str, list[str]] = {}
    lock = threading.Lock()

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event not in ("call", "return"):
            return
        where = vit_file(frame if event == "call" else frame.f_back)
        if where is None:
            return
        with lock:
            files = walks.setdefault(threading.current_thread().name, [])
            if not files or files[-1] != where:
                files.append(where)

    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        step()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return walks


def returns(walks: dict[str, list[str]]) -> int:
    """Entries into a file the walk had left before, in every thread."""
    return sum(sum(f in files[:i] for i, f in enumerate(files)) for files in walks.values())


def image_folder(root: Path, n: int = 40) -> Path:
    rng = np.random.default_rng(0)
    for k in range(n):
        folder = root / f"c{k % 4}"
        folder.mkdir(parents=True, exist_ok=True)
        h, w = int(rng.integers(32, 64)), int(rng.integers(32, 64))
        pixels = np.clip(rng.integers(0, 256, (1, 1, 3)) + rng.integers(-50, 50, (h, w, 3)), 0, 255)
        Image.fromarray(pixels.astype(np.uint8)).save(folder / f"{k}.jpg", quality=90)
    return root


def batch_walk(root: Path, path: str, batch_size: int, cache: Path) -> dict[str, list[str]]:
    from vit.data import ImageFolderDataModule, NaFlex

    options = dict(PATHS[path])
    if options.get("naflex"):
        options["naflex"] = NaFlex(max_patches=16, patch_size=8)
    if options.get("pipeline") == "memory":
        options["memory"] = {"cache_dir": str(cache)}
    augment = {"randaugment_ops": 2, **options.pop("augment", {})}
    data = ImageFolderDataModule(
        root=str(root), img_size=32, batch_size=batch_size, num_workers=0, val_holdout=0.1, augment=augment,
        **options,
    )  # fmt: skip
    data.setup("fit")
    loader = data.train_dataloader()
    data.on_after_batch_transfer(next(iter(loader)), 0)  # imports and caches: not the batch's walk

    def step() -> None:
        data.on_after_batch_transfer(next(iter(loader)), 0)

    try:
        return walk(step)
    finally:
        if hasattr(loader, "close"):
            loader.close()


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return image_folder(tmp_path_factory.mktemp("walk") / "images")


@pytest.mark.parametrize("path", list(PATHS))
def test_a_batch_walks_forward(folder: Path, path: str, tmp_path: Path) -> None:
    one, eight = (returns(batch_walk(folder, path, b, tmp_path / "cache")) for b in (1, 8))
    per_image = (eight - one) / 7
    print(f"{path}: {one} returns at batch 1, {eight} at batch 8, {per_image:.1f} an image")
    assert eight <= MAX_RETURNS, f"{path}: a batch of 8 turned back {eight} times (at most {MAX_RETURNS})"
    assert per_image <= MAX_PER_IMAGE, f"{path}: {per_image:.1f} returns an image (at most {MAX_PER_IMAGE})"


def test_the_walk_counts_a_return_into_a_file_left() -> None:
    """The count on a walk written out: a > b > a > c > b turns back twice."""
    assert returns({"main": ["a", "b", "a", "c", "b"], "other": ["a", "c"]}) == 2
