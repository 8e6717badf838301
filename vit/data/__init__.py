"""Datasets, augmentation and LightningDataModules: image classification and character-level text."""

from vit.data.augment import Augment
from vit.data.datamodules import (
    CIFARDataModule,
    DigitsDataModule,
    ImageDataModule,
    ImageFolderDataModule,
    StreamingDataModule,
    TinyImageNetDataModule,
)
from vit.data.images import CorruptImageError, ImageArrays, ImageFiles, read_rgb
from vit.data.mixup import Mixup
from vit.data.naflex import NaFlex
from vit.data.text import CharTokenizer, TextDataModule

__all__ = [
    "Augment",
    "CIFARDataModule",
    "CharTokenizer",
    "CorruptImageError",
    "DigitsDataModule",
    "ImageArrays",
    "ImageDataModule",
    "ImageFiles",
    "ImageFolderDataModule",
    "Mixup",
    "NaFlex",
    "StreamingDataModule",
    "TextDataModule",
    "TinyImageNetDataModule",
    "read_rgb",
]
