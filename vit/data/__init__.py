"""Datasets, augmentation and LightningDataModules: image classification and character-level text.

The names below are imported on first use (PEP 562), so that importing one module of the package
(vit.data.preprocess for a checkpoint's evaluation settings, vit.data.images for reading a file) does
not import the datamodules and with them Lightning."""

from __future__ import annotations

import importlib
from typing import Any

# Each name and the module that defines it.
_EXPORTS = {
    "Augment": "vit.data.augment",
    "CIFARDataModule": "vit.data.datamodules",
    "DigitsDataModule": "vit.data.datamodules",
    "ImageDataModule": "vit.data.datamodules",
    "ImageFolderDataModule": "vit.data.datamodules",
    "StreamingDataModule": "vit.data.datamodules",
    "TinyImageNetDataModule": "vit.data.datamodules",
    "DeviceDecode": "vit.data.device",
    "CorruptImageError": "vit.data.images",
    "ImageArrays": "vit.data.images",
    "ImageFiles": "vit.data.images",
    "read_rgb": "vit.data.images",
    "Memory": "vit.data.memory",
    "Mixup": "vit.data.mixup",
    "NaFlex": "vit.data.naflex",
    "CharTokenizer": "vit.data.text",
    "TextDataModule": "vit.data.text",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later look-ups find it without this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
