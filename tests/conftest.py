"""Shared test helpers: paths to the real data in ../shared (tests skip cleanly without it) and
small image folders written on the spot."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("VIT_SHARED", ROOT.parent / "shared"))


def shared_path(relative: str) -> Path:
    """A path under ../shared, or skip the test when it is absent (e.g. on a user's machine)."""
    path = SHARED / relative
    if not path.exists():
        pytest.skip(f"{path} is not available")
    return path


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def write_image_folder(
    root: Path, classes: int = 4, train: int = 8, val: int = 2, size: int = 32, val_dir: str = "val", ext: str = "png"
) -> Path:
    """`root/{train,<val_dir>}/class<c>/<i>.<ext>`: noise around a per-class grey level, so a small
    model can learn the classes in a few steps."""
    rng = np.random.default_rng(0)
    for split, n in (("train", train), (val_dir, val)):
        for c in range(classes):
            for i in range(n):
                pixels = rng.normal(60 + 60 * c, 30, (size, size, 3)).clip(0, 255).astype(np.uint8)
                path = root / split / f"class{c}" / f"{i}.{ext}"
                path.parent.mkdir(parents=True, exist_ok=True)
                Image.fromarray(pixels).save(path)
    return root
