"""LightningDataModules: the offline digits default, CIFAR-10/100, ImageNet-style folders, Tiny-ImageNet.

They share `ImageDataModule`, which owns the loader settings, the augmentation options and
Mixup/CutMix; a subclass only says where its images and labels come from.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from vit.data.images import ImageArrays, ImageFiles, scan_image_folder, scan_tiny_imagenet
from vit.data.mixup import MixupCutmix
from vit.data.sampling import ResumableLoader, ResumableSampler, mix_seed
from vit.data.transforms import IMAGENET_MEAN, IMAGENET_STD, eval_transform, train_transform


def default_num_workers() -> int:
    """Leave a core for the training process: 1 worker on a 2-core laptop, up to 8 per GPU process on a node."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    local_procs = max(1, torch.cuda.device_count())
    return max(0, min(8, cpus // local_procs - 1))


class ImageDataModule(L.LightningDataModule):
    """Shared options of every image datamodule.

    Args:
        img_size: side of the square images the model sees.
        batch_size: per process (the global batch is batch_size x devices x nodes).
        num_workers: loader processes; None picks one less than the CPUs available per GPU (max 8).
        pin_memory: None -> on when CUDA is available. persistent_workers: None -> on when num_workers > 0.
        crop: "rrc" (random resized crop), "pad_crop" (pad + random crop, CIFAR) or "resize".
        randaugment_ops / randaugment_magnitude: RandAugment-like ops per image (0 = off) and strength (0..10).
        mixup_alpha / cutmix_alpha: Beta parameters (0 = off); mixup_prob: fraction of batches mixed;
            mixup_switch_prob: chance of CutMix when both are on.
        eval_crop_pct: eval resize is img_size / eval_crop_pct before the centre crop.
        skip_corrupt: log and skip undecodable image files instead of stopping.
    """

    num_classes: int

    def __init__(
        self,
        img_size: int = 32,
        batch_size: int = 128,
        num_workers: int | None = None,
        pin_memory: bool | None = None,
        persistent_workers: bool | None = None,
        crop: str = "rrc",
        crop_scale: tuple[float, float] = (0.08, 1.0),
        crop_padding: int = 4,
        hflip: bool = True,
        randaugment_ops: int = 0,
        randaugment_magnitude: float = 9.0,
        mixup_alpha: float = 0.0,
        cutmix_alpha: float = 0.0,
        mixup_prob: float = 1.0,
        mixup_switch_prob: float = 0.5,
        eval_crop_pct: float = 1.0,
        mean: tuple[float, float, float] = IMAGENET_MEAN,
        std: tuple[float, float, float] = IMAGENET_STD,
        skip_corrupt: bool = False,
    ) -> None:
        super().__init__()
        self.img_size = img_size
        self.batch_size = batch_size
        self.num_workers = default_num_workers() if num_workers is None else num_workers
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.persistent_workers = self.num_workers > 0 if persistent_workers is None else persistent_workers
        self.skip_corrupt = skip_corrupt
        self.train_transform = train_transform(
            img_size, crop, crop_scale, crop_padding, hflip, randaugment_ops, randaugment_magnitude, mean, std
        )
        self.eval_transform = eval_transform(img_size, eval_crop_pct, mean, std)
        self.mixup_options = dict(
            mixup_alpha=mixup_alpha, cutmix_alpha=cutmix_alpha, prob=mixup_prob, switch_prob=mixup_switch_prob
        )
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None

    # Subclasses fill these two in `setup`.
    def setup(self, stage: str | None = None) -> None:
        raise NotImplementedError

    def _seed(self) -> int:
        return int(os.environ.get("PL_GLOBAL_SEED", 0))

    def train_dataloader(self) -> DataLoader:
        sampler = ResumableSampler(self.train_set, shuffle=True, seed=self._seed())
        loader = ResumableLoader(
            self.train_set,
            batch_size=self.batch_size,
            sampler=sampler,
            drop_last=len(sampler) > self.batch_size,  # no ragged last batch (BatchNorm, Mixup)
            **self._loader_options(),
        )
        trainer = self.trainer
        if trainer is not None:
            # Batches of this epoch whose training step finished: where Lightning itself resumes.
            loader.batches_done = lambda: trainer.fit_loop.epoch_loop.batch_progress.current.processed
        return loader

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size, shuffle=False, **self._loader_options())

    def test_dataloader(self) -> DataLoader:
        return self.val_dataloader()

    def predict_dataloader(self) -> DataLoader:
        return self.val_dataloader()

    def _loader_options(self) -> dict[str, Any]:
        return dict(
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            persistent_workers=self.persistent_workers and self.num_workers > 0,
        )

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Mixup/CutMix on the device, training batches only; its randomness is a function of
        (seed, step, rank), so resumed runs mix exactly like uninterrupted ones."""
        trainer = self.trainer
        if trainer is None or not trainer.training or not self.mixup_enabled:
            return batch
        x, y = batch
        rng = np.random.default_rng(mix_seed(self._seed(), trainer.global_step, trainer.global_rank, 1))
        return MixupCutmix(self.num_classes, **self.mixup_options)(x, y, rng)

    @property
    def mixup_enabled(self) -> bool:
        return self.mixup_options["mixup_alpha"] > 0 or self.mixup_options["cutmix_alpha"] > 0


class DigitsDataModule(ImageDataModule):
    """The offline default: scikit-learn's bundled 8x8 handwritten digits (1,797 images, 10 classes),
    upsampled to img_size. Needs no download; a fixed stratified split holds out val_fraction."""

    def __init__(
        self,
        val_fraction: float = 0.2,
        img_size: int = 16,
        crop: str = "pad_crop",
        crop_padding: int = 2,
        hflip: bool = False,  # digits are not mirror-symmetric
        **kwargs: Any,
    ) -> None:
        super().__init__(img_size=img_size, crop=crop, crop_padding=crop_padding, hflip=hflip, **kwargs)
        self.val_fraction = val_fraction
        self.num_classes = 10

    def setup(self, stage: str | None = None) -> None:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split

        digits = load_digits()
        images = np.round(digits.images * (255.0 / 16.0)).astype(np.uint8)  # 0..16 ink levels -> 0..255
        train_idx, val_idx = train_test_split(
            np.arange(len(images)), test_size=self.val_fraction, stratify=digits.target, random_state=0
        )
        self.train_set = ImageArrays(images[train_idx], digits.target[train_idx], self.train_transform)
        self.val_set = ImageArrays(images[val_idx], digits.target[val_idx], self.eval_transform)


class CIFARDataModule(ImageDataModule):
    """CIFAR-10 / CIFAR-100 through torchvision: downloaded into `root` when online, otherwise read
    from `root/cifar-10-batches-py` (or `cifar-100-python`). Val is the official test split."""

    _FOLDERS = {"cifar10": "cifar-10-batches-py", "cifar100": "cifar-100-python"}
    _URLS = {
        "cifar10": "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz",
        "cifar100": "https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz",
    }

    def __init__(
        self,
        root: str = "data",
        dataset: str = "cifar10",
        download: bool = True,
        img_size: int = 32,
        crop: str = "pad_crop",
        **kwargs: Any,
    ) -> None:
        if dataset not in self._FOLDERS:
            raise ValueError(f"dataset must be 'cifar10' or 'cifar100', got {dataset!r}")
        super().__init__(img_size=img_size, crop=crop, **kwargs)
        self.root, self.dataset, self.download = Path(root), dataset, download
        self.num_classes = 10 if dataset == "cifar10" else 100

    def _torchvision_dataset(self, train: bool, download: bool):
        import torchvision

        cls = torchvision.datasets.CIFAR10 if self.dataset == "cifar10" else torchvision.datasets.CIFAR100
        return cls(str(self.root), train=train, download=download)

    def prepare_data(self) -> None:
        if (self.root / self._FOLDERS[self.dataset]).is_dir() or not self.download:
            return
        try:
            self._torchvision_dataset(train=True, download=True)
            self._torchvision_dataset(train=False, download=True)
        except Exception as e:  # offline, proxy, disk full: say what to do instead
            raise FileNotFoundError(self._missing_message(f"downloading it failed ({e})")) from e

    def setup(self, stage: str | None = None) -> None:
        try:
            train, val = self._torchvision_dataset(True, False), self._torchvision_dataset(False, False)
        except RuntimeError as e:  # torchvision: "Dataset not found or corrupted"
            raise FileNotFoundError(self._missing_message(str(e))) from e
        self.train_set = ImageArrays(train.data, train.targets, self.train_transform)
        self.val_set = ImageArrays(val.data, val.targets, self.eval_transform)

    def _missing_message(self, reason: str) -> str:
        folder = self.root / self._FOLDERS[self.dataset]
        return (
            f"{self.dataset} is not in {folder} and {reason}. Download {self._URLS[self.dataset]} and extract it "
            f"into {self.root} (giving {folder}/), or set data.root to a folder that holds it. "
            "For a copy stored as image files (train/<class>/*.jpg), use vit.data.ImageFolderDataModule."
        )


class ImageFolderDataModule(ImageDataModule):
    """ImageNet-style trees: `root/<train_dir>/<class>/*` and `root/<val_dir>/<class>/*`.

    `eval_crop_pct=None` follows the training crop: 0.875 after random-resized-crop training (the
    ImageNet convention, objects at the scale training saw them), 1.0 (the whole image) after
    pad+crop or resize training, as for CIFAR-sized images, where a zoomed eval would cost accuracy.
    """

    def __init__(
        self,
        root: str = "data/imagenet",
        train_dir: str = "train",
        val_dir: str = "val",
        img_size: int = 224,
        eval_crop_pct: float | None = None,
        **kwargs: Any,
    ) -> None:
        if eval_crop_pct is None:
            eval_crop_pct = 0.875 if kwargs.get("crop", "rrc") == "rrc" else 1.0
        super().__init__(img_size=img_size, eval_crop_pct=eval_crop_pct, **kwargs)
        self.root, self.train_dir, self.val_dir = Path(root), train_dir, val_dir
        # Scan the class folders now: the model's num_classes is linked to this at instantiation.
        self.classes, self._train_samples = scan_image_folder(self.root / train_dir)
        self.num_classes = len(self.classes)

    def setup(self, stage: str | None = None) -> None:
        _, val_samples = scan_image_folder(self.root / self.val_dir, classes=self.classes)
        self.train_set = ImageFiles(self._train_samples, self.train_transform, self.skip_corrupt)
        self.val_set = ImageFiles(val_samples, self.eval_transform, self.skip_corrupt)


class TinyImageNetDataModule(ImageDataModule):
    """Tiny-ImageNet-200 (64x64, 200 classes) in its official layout; val labels come from
    `val/val_annotations.txt`. Samples keep their object boxes (used to score attention maps)."""

    def __init__(
        self,
        root: str = "data/tiny-imagenet-200",
        img_size: int = 64,
        crop: str = "rrc",
        crop_scale: tuple[float, float] = (0.35, 1.0),
        **kwargs: Any,
    ) -> None:
        super().__init__(img_size=img_size, crop=crop, crop_scale=crop_scale, **kwargs)
        self.root = Path(root)
        self.classes, self._train_samples = scan_tiny_imagenet(self.root, "train")
        self.num_classes = len(self.classes)

    def setup(self, stage: str | None = None) -> None:
        _, val_samples = scan_tiny_imagenet(self.root, "val")
        self.train_set = ImageFiles(self._train_samples, self.train_transform, self.skip_corrupt)
        self.val_set = ImageFiles(val_samples, self.eval_transform, self.skip_corrupt)
