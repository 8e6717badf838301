"""Datasets, augmentation and LightningDataModules for image classification."""

from vit.data.datamodules import (
    CIFARDataModule,
    DigitsDataModule,
    ImageDataModule,
    ImageFolderDataModule,
    TinyImageNetDataModule,
)
from vit.data.images import CorruptImageError, ImageArrays, ImageFiles, read_rgb

__all__ = [
    "CIFARDataModule",
    "CorruptImageError",
    "DigitsDataModule",
    "ImageArrays",
    "ImageDataModule",
    "ImageFiles",
    "ImageFolderDataModule",
    "TinyImageNetDataModule",
    "read_rgb",
]
