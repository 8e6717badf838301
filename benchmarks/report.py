"""What the studies in this folder share: the machine line and markdown tables (vit.tools.machine),
rewriting a report while keeping the notes written by hand below a marker, and where the data is.

Datasets are read from `$VIT_DATA` (default `data`: `data/cifar10`, `data/tiny-imagenet-200`,
`data/tinyshakespeare.txt`), checkpoints from `$VIT_WEIGHTS` (default `weights`); each study's
data option overrides it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from vit.tools.machine import cpu_name, machine, markdown_table

__all__ = [
    "NOTES_MARKER",
    "OpCount",
    "cpu_name",
    "data_root",
    "machine",
    "markdown_table",
    "weights_root",
    "write_report",
]

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


# In-place ops that write only where an index points, with the argument holding what they write.
_WRITES_FROM = {"aten.index_put_.default": 2, "aten.index_add_.default": 3, "aten.scatter_.src": 3}
_METADATA = {"aten.detach.default", "aten.lift_fresh.default", "aten._local_scalar_dense.default"}


class OpCount(TorchDispatchMode):
    """The torch ops dispatched in the threads it is entered in (`count`), and of those the ones that
    run work on the device (`kernels`: not views or metadata; a foreach op counts a kernel a tensor,
    as its strided tensors take on a GPU) and the bytes they write (`written`: the outputs, or what
    an in-place op writes). What a GPU's time for small, memory-bound kernels follows, measured on
    any device: a kernel launch costs the host a few microseconds, a byte written and read back the
    device's bandwidth."""

    def __init__(self) -> None:
        super().__init__()
        self.count, self.kernels, self.written = 0, 0, 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.count += 1
        name = str(func)
        if func.is_view or name.startswith("aten.empty") or name in _METADATA:
            return out
        if name in _WRITES_FROM:
            written = [args[_WRITES_FROM[name]]]
        elif func._schema.is_mutable:
            schema = func._schema.arguments
            written = [a for a, s in zip(args, schema, strict=False) if s.alias_info and s.alias_info.is_write]
        else:
            written = [out]
        tensors = [t for t in tree_leaves(written) if isinstance(t, torch.Tensor)]
        self.kernels += len(tensors) if name.startswith("aten._foreach") else 1
        self.written += sum(t.numel() * t.element_size() for t in tensors)
        return out
