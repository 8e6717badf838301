"""Shared test fixtures: paths to the real data in ../shared (tests skip cleanly without it)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

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
