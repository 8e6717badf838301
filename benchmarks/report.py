"""What the studies in this folder share: the machine line and markdown tables (vit.tools.machine),
rewriting a report while keeping the notes written by hand below a marker, and where the data is.

Datasets are read from `$VIT_DATA` (default `data`: `data/cifar10`, `data/tiny-imagenet-200`,
`data/tinyshakespeare.txt`), checkpoints from `$VIT_WEIGHTS` (default `weights`); each study's
data option overrides it.
"""

from __future__ import annotations

import os
from pathlib import Path

from vit.tools.machine import cpu_name, machine, markdown_table

__all__ = ["NOTES_MARKER", "cpu_name", "data_root", "machine", "markdown_table", "weights_root", "write_report"]

# Ends the generated part of a report; the notes written by hand below it survive a regeneration.
NOTES_MARKER = "<!-- notes: everything below this line is kept when the tables are regenerated -->"


def data_root() -> Path:
    """Where the studies find their datasets: `$VIT_DATA`, else `data`."""
    return Path(os.environ.get("VIT_DATA", "data"))


def weights_root() -> Path:
    """Where the studies find pretrained checkpoints: `$VIT_WEIGHTS`, else `weights`."""
    return Path(os.environ.get("VIT_WEIGHTS", "weights"))


def write_report(path: str | Path, text: str, notes_marker: str | None = None) -> Path:
    """Write a generated report, creating its folder. With `notes_marker`, the marker ends the
    generated part, and whatever followed it in the existing file (notes written by hand) is kept."""
    path = Path(path)
    if notes_marker is not None:
        old = path.read_text() if path.is_file() else ""
        notes = old.split(notes_marker, 1)[1] if notes_marker in old else "\n"
        text = text + notes_marker + notes
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path
