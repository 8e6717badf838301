"""Shared test helpers: paths to the real data in ../shared (tests skip cleanly without it) and
small image folders written on the spot."""

from __future__ import annotations

import os
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("VIT_SHARED", ROOT.parent / "shared"))


def shared_path(relative: str) -> Path:
    """A path under ../shared, or skip the test when it is absent (e.g. on a user's machine)."""
    path = SHARED / relative
    if not path.exists():
        pytest.skip(f"{path} is not available")
    return path


@pytest.fixture
def file_size_limit():
    """Restores RLIMIT_FSIZE, which a test lowers to fill the disk part-way through a write
    (tests.faults.DiskFullAfter)."""
    import resource

    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    yield
    resource.setrlimit(resource.RLIMIT_FSIZE, limit)


@pytest.fixture
def one_thread():
    """Bit-identical comparisons across processes need the same number of threads in each."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


if os.environ.get("PYTEST_XDIST_WORKER"):
    # Under pytest-xdist (`make test`) the workers share the cores: one torch thread each, as a thread
    # a core in every worker oversubscribed the CPU (the default job's test: 27 s alone, 172 s so).
    torch.set_num_threads(1)


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


def write_image(path: Path, mode: str = "RGB", size: tuple[int, int] = (20, 12), value: int = 100) -> None:
    """One flat image file of `size` (width, height) in PIL `mode`, parent folders made."""
    path.parent.mkdir(parents=True, exist_ok=True)
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    array = np.full((size[1], size[0], channels), value, dtype=np.uint8).squeeze()
    Image.fromarray(array, mode=mode).save(path)


def quiet_trainer(root: Path, **kwargs) -> L.Trainer:
    """A CPU fp32 Trainer without logger, progress bar or sanity validation, keeping `best`/`last`
    checkpoints by val/acc1 under root/checkpoints; `kwargs` override or add (callbacks add)."""
    defaults = dict(
        default_root_dir=str(root), accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, callbacks=[], precision="32-true",
    )  # fmt: skip
    defaults.update(kwargs)
    checkpoints = ModelCheckpoint(dirpath=root / "checkpoints", monitor="val/acc1", mode="max", save_last=True)
    defaults["callbacks"] = [*defaults["callbacks"], checkpoints]
    return L.Trainer(**defaults)


def timm_and_ours(name: str, noise: float = 0.1, **kwargs) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(ours, timm's) model `name` built with `kwargs` in eval mode: timm's with every parameter moved
    off its init by `noise`, ours loaded strictly from its state dict."""
    import timm

    import vit

    theirs = timm.create_model(name, pretrained=False, **kwargs).eval()
    with torch.no_grad():
        for p in theirs.parameters():
            p.add_(torch.randn_like(p) * noise)
    ours = vit.create_model(name, **kwargs).eval()
    ours.load_state_dict(theirs.state_dict(), strict=True)
    return ours, theirs
