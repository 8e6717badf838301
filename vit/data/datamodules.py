"""LightningDataModules: the offline digits default, CIFAR-10/100, ImageNet-style folders (as files or
as streaming chunks), Tiny-ImageNet.

They share `ImageDataModule`, which owns the loader settings, the augmentation options, the run's
seed and Mixup/CutMix, and hands its splits to one pipeline (vit.data.pipelines: per sample, in
memory, or decoded on the device) for their loaders; a subclass only says where its images and
labels come from.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import weakref
from pathlib import Path
from typing import Any, ClassVar

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from vit import lightning_compat as compat
from vit.data.augment import Augment
from vit.data.device import DEVICE_CROPS, EncodedFiles
from vit.data.images import (
    ImageArrays,
    ImageFiles,
    readable_class_names,
    scan_image_folder,
    scan_tiny_imagenet,
)
from vit.data.mixup import Mixup, MixupCutmix
from vit.data.naflex import NaFlex
from vit.data.pipelines import FromFiles, InMemory, PerSample, Pipeline, Sequences
from vit.data.prefetch import PreparedLoader
from vit.data.sampling import ChunkedSampler, ResumableSampler
from vit.data.streaming import StreamingImages
from vit.data.transforms import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    SequenceEvalTransform,
    SequenceTrainTransform,
    eval_transform,
    train_transform,
)
from vit.options import number, require, set_option_groups, whole
from vit.seeds import Purpose, RunSeed, step_seed

log = logging.getLogger(__name__)

# An image folder at this side or below is small (CIFAR, digits, Tiny-ImageNet-sized): see ImageFolderDataModule.
SMALL_IMAGE = 64


def default_num_workers() -> int:
    """Leave a core for the training process: 1 worker on a 2-core laptop, up to 8 per GPU process on a node."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    local_procs = max(1, torch.cuda.device_count())
    return max(0, min(8, cpus // local_procs - 1))


class ImageDataModule(RunSeed, L.LightningDataModule):
    """Shared options of every image datamodule.

    Args:
        img_size: side of the square images the model sees. With `num_classes` (set by each subclass
            when it is built), the CLI passes it on to the model (vit.cli.TrainCLI), so it is set once.
        batch_size: per process (the global batch is batch_size x devices x nodes).
        num_workers: loader processes; None picks one less than the CPUs available per GPU (max 8).
        pin_memory: None -> on when CUDA is available. persistent_workers: None -> on when num_workers > 0.
        augment: vit.data.Augment: crop, flip, RandAugment, cutout (each datamodule its own defaults).
        mixup: vit.data.Mixup: Mixup / CutMix of training batches (off by default).
        eval_crop_pct: eval resize is img_size / eval_crop_pct before the centre crop.
        mean / std: the per-channel normalisation of pixels in [0, 1]. Kept, with eval_crop_pct, as
            attributes of the same names: what turns a model input back into the image (rollout).
        skip_corrupt: log and skip undecodable image files instead of stopping.
        val_holdout: hold out this many training images (a fraction if below 1; stratified, fixed
            seed) as the validation set, for tuning; the original validation split becomes the test
            set (`trainer.test`). 0: validation is the original split, as is the test set.
        in_memory: decode every image once into a uint8 tensor (cached in cache_dir) and augment
            whole batches on the training device (vit.data.memory): crop "pad_crop" or "resize",
            hflip, RandAugment, cutout and Mixup/CutMix. cache_dir None: `<default_root_dir>/cache`.
        train_sizes: progressive resizing, in_memory only: [[progress, size], ...] trains at `size`
            from that fraction of the run on (e.g. [[0, 16], [0.5, 24], [0.75, 32]]); validation
            stays at img_size. The model must accept other sizes (rope/sincos2d, or dynamic_img_size).
        device_decode: image files only: loader workers read the encoded bytes, and the batch is
            decoded, cropped (crop "rrc" or "resize"), flipped, RandAugmented and normalised on the
            training device (vit.data.device).
        device_prefetch: with device_decode, how many batches a thread decodes ahead of the step,
            on a CUDA stream of its own (vit.data.prefetch); 0: each when its step begins; None: 1
            on a GPU, 0 on the CPU (there the thread only competes with the model for the cores).
        data_process: with device_decode, decode and augment in a process of its own per loader
            (vit.data.process), which hands finished batches to the training process; None: on a
            GPU. In the training process's threads, the data work takes the interpreter's lock from
            the thread that launches the model's kernels.
        worker_decode: with device_decode, the share of the JPEGs (0 to 1, the same files every
            epoch) that the loader workers decode (PIL) instead of the device: decoding on a GPU
            takes its cores from the model, and workers with cores to spare can take part of it.
        naflex: vit.data.NaFlex: for a NaFlexVit, each image at its own aspect ratio within a patch
            budget, batches of padded patch sequences (vit.data.naflex); None: square images at
            img_size. Per sample only (not in_memory, device_decode, Mixup/CutMix), crop "rrc" or
            "resize", the whole image in evaluation (eval_crop_pct 1).

    A group given in Python as a dict changes only the fields it names of the class's default,
    e.g. `CIFARDataModule(augment={"cutout": 8})` keeps its pad-crop.
    """

    # Options from before the groups, and where each went (the CLI names the new place).
    RENAMED: ClassVar[dict[str, str]] = {
        **{name: f"augment.{name}" for name in ("crop", "crop_scale", "crop_padding", "hflip", "cutout")},
        **{name: f"augment.{name}" for name in ("randaugment_ops", "randaugment_magnitude")},
        "mixup_alpha": "mixup.mixup_alpha",
        "cutmix_alpha": "mixup.cutmix_alpha",
        "mixup_prob": "mixup.prob",
        "mixup_switch_prob": "mixup.switch_prob",
    }
    augment: Augment
    mixup: Mixup
    naflex: NaFlex | None

    num_classes: int
    # The classes' names in label order, as people read them; checkpoints carry them, so exports
    # label predictions by name. None where the data does not name its classes.
    class_names: list[str] | None = None

    def __init__(
        self,
        img_size: int = 32,
        batch_size: int = 128,
        num_workers: int | None = None,
        pin_memory: bool | None = None,
        persistent_workers: bool | None = None,
        augment: Augment = Augment(),
        mixup: Mixup = Mixup(),
        eval_crop_pct: float = 1.0,
        mean: tuple[float, float, float] = IMAGENET_MEAN,
        std: tuple[float, float, float] = IMAGENET_STD,
        skip_corrupt: bool = False,
        val_holdout: float = 0,
        in_memory: bool = False,
        cache_dir: str | None = None,
        train_sizes: list[tuple[float, int]] | None = None,
        device_decode: bool = False,
        device_prefetch: int | None = None,
        worker_decode: float = 0.0,
        data_process: bool | None = None,
        naflex: NaFlex | None = None,
    ) -> None:
        super().__init__()
        check_loader_options(img_size, batch_size, num_workers, eval_crop_pct, mean, std, val_holdout,
                             train_sizes, device_prefetch, worker_decode)  # fmt: skip
        self.img_size = img_size
        self.batch_size = batch_size
        self.num_workers = default_num_workers() if num_workers is None else num_workers
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.persistent_workers = self.num_workers > 0 if persistent_workers is None else persistent_workers
        self.skip_corrupt = skip_corrupt
        set_option_groups(self, augment=augment, mixup=mixup, naflex=naflex)
        augment, crop = self.augment, self.augment.crop
        if self.naflex is None:
            self.train_transform = train_transform(img_size, augment, mean, std)
            self.eval_transform = eval_transform(img_size, eval_crop_pct, mean, std)
        else:
            check_naflex_options(crop, eval_crop_pct, self.mixup, in_memory, device_decode)
            self.naflex.check_batch(batch_size)
            self.train_transform = SequenceTrainTransform(self.naflex, augment, mean, std)
            self.eval_transform = SequenceEvalTransform(self.naflex, mean, std)
        self.val_holdout = val_holdout
        self.in_memory, self.cache_dir = in_memory, cache_dir
        self.eval_crop_pct, self.mean, self.std = eval_crop_pct, mean, std
        self.train_sizes = sorted((float(p), int(size)) for p, size in train_sizes) if train_sizes else None
        check_augment_fits(augment, min([img_size, *(size for _, size in train_sizes or [])]))
        require(in_memory or not augment.cutout, "data.augment.cutout", augment.cutout,
                "0 unless --data.in_memory true (cutout augments whole batches)")  # fmt: skip
        require(in_memory or not train_sizes, "data.train_sizes", train_sizes,
                "null unless --data.in_memory true (the size changes between whole batches)")  # fmt: skip
        require(not in_memory or crop in ("pad_crop", "resize"), "data.augment.crop", crop,
                "pad_crop or resize with --data.in_memory true (for rrc: --data.in_memory false)")  # fmt: skip
        self.device_decode, self.device_prefetch, self.worker_decode = device_decode, device_prefetch, worker_decode
        require(not worker_decode or device_decode, "data.worker_decode", worker_decode,
                "0 unless --data.device_decode true (it is a share of the JPEGs decoded on the device)")  # fmt: skip
        require(not (device_decode and in_memory), "data.device_decode", device_decode,
                "false with --data.in_memory true (in memory, images are decoded once, before training)")  # fmt: skip
        require(not device_decode or crop in DEVICE_CROPS, "data.augment.crop", crop,
                f"{' or '.join(DEVICE_CROPS)} with --data.device_decode true")  # fmt: skip
        require(data_process in (None, False) or device_decode, "data.data_process", data_process,
                "false or null unless --data.device_decode true (it runs the decoding and augmenting)")  # fmt: skip
        self._data_process = data_process
        self.pipeline: Pipeline = (
            Sequences() if self.naflex else InMemory() if in_memory else FromFiles() if device_decode else PerSample()
        )
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None
        self.test_set: Dataset | None = None
        self._loaders: weakref.WeakSet[PreparedLoader] = weakref.WeakSet()  # their data processes end at teardown

    def load_splits(self) -> tuple[ImageFiles | ImageArrays, ImageFiles | ImageArrays]:
        """The (train, val) datasets with the train and eval transforms; each subclass says where they come from."""
        raise NotImplementedError

    def setup(self, stage: str | None = None) -> None:
        self.take_run_seed()  # a resume then restores the checkpoint's (RunSeed)
        if self.train_set is not None:
            return
        if self.trainer is None or self.trainer.is_global_zero:
            train_line, eval_line = self.describe_transforms()
            log.info("train transform: %s", train_line)
            log.info("eval transform: %s", eval_line)
        train, val = self.load_splits()
        test = val
        if self.val_holdout:
            no_val_split = val is train  # validation and test then both read the held-out images
            train_idx, val_idx = holdout_indices(train.labels, self.val_holdout)
            train, val = train.subset(train_idx, self.train_transform), train.subset(val_idx, self.eval_transform)
            test = val if no_val_split else test
        self.train_set, self.val_set, self.test_set = train, val, test

    def describe_transforms(self) -> tuple[str, str]:
        """One line each for what training and evaluation do to an image (logged at setup)."""
        size, augment = self.img_size, self.augment
        train, evaluation = self.pipeline.describe(self)
        train += ["flip"] if augment.hflip else []
        ops, magnitude = augment.randaugment
        train += [f"RandAugment {ops} ops at magnitude {magnitude:g}"] if ops > 0 else []
        train += [f"cutout {augment.cutout}"] if augment.cutout else []
        train.append("normalise")
        mixup = self.mixup
        if mixup.enabled:
            share = "per batch" if mixup.prob >= 1 else f"on {mixup.prob:.0%} of batches"
            mixing = f"Mixup {mixup.mixup_alpha:g} / CutMix {mixup.cutmix_alpha:g}"
            if mixup.mixup_alpha > 0 and mixup.cutmix_alpha > 0:
                mixing += f" (CutMix on {mixup.switch_prob:.0%})"
            train.append(f"{mixing} {share}")
        if self.train_sizes:
            train.append("sizes " + ", ".join(f"{size} from {start:g}" for start, size in self.train_sizes))
        if self.naflex is None:
            evaluation += f"centre crop {self.eval_crop_pct:g} of the shorter side, resize to {size}"
        evaluation += " (bicubic), normalise"
        return ", ".join(train), evaluation

    def train_dataloader(self) -> DataLoader:
        return self._kept(self.pipeline.train_loader(self, self.train_set))

    def train_sampler(self, dataset: Dataset, seed: int) -> ResumableSampler:
        """The training order: a permutation by (seed, epoch), shared among the processes."""
        return ResumableSampler(dataset, shuffle=True, seed=seed)

    def val_dataloader(self) -> DataLoader:
        return self._kept(self.pipeline.eval_loader(self, self.val_set))

    def test_dataloader(self) -> DataLoader:
        return self._kept(self.pipeline.eval_loader(self, self.test_set))

    def predict_dataloader(self) -> DataLoader:
        return self.val_dataloader()

    def _kept(self, loader: DataLoader) -> DataLoader:
        if isinstance(loader, PreparedLoader):
            self._loaders.add(loader)
        return loader

    def teardown(self, stage: str) -> None:
        for loader in list(self._loaders):
            loader.close()

    @property
    def data_process(self) -> bool:
        """Whether device_decode's work runs in a data process: as given, else on a GPU."""
        if self._data_process is not None:
            return self._data_process
        return self.device_decode and self.training_device().type == "cuda"

    def training_device(self) -> torch.device:
        """Where the model runs: the trainer's device; outside a run, the GPU if there is one."""
        if self.trainer is not None:
            return self.trainer.strategy.root_device
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """On the device: the pipeline's step (in memory: augmented and normalised), then
        Mixup/CutMix, training batches only. All randomness is a function of (seed, step, rank) or
        (seed, epoch, index) (vit.seeds), so resumed runs augment and mix as uninterrupted ones."""
        batch = self.pipeline.on_device(self, batch)
        trainer = self.trainer
        if trainer is None or not trainer.training or not self.mixup.enabled:
            return batch
        x, y = batch
        batch_idx = compat.batches_ready(trainer)  # this batch's: counted after its transfer
        rng = np.random.default_rng(step_seed(self.seed, Purpose.MIXUP, trainer, batch_idx))
        return MixupCutmix(self.num_classes, self.mixup)(x, y, rng)

    def train_size(self) -> int:
        """The training image size at this point of the run (train_sizes, in memory), else img_size."""
        return self.pipeline.train_size(self) if isinstance(self.pipeline, InMemory) else self.img_size


def check_loader_options(
    img_size: Any, batch_size: Any, num_workers: Any, eval_crop_pct: Any, mean: Any, std: Any, val_holdout: Any,
    train_sizes: Any, device_prefetch: Any, worker_decode: Any,
) -> None:  # fmt: skip
    """OptionError naming the first of ImageDataModule's options that holds a value it does not take."""
    whole(img_size, 1, "data.img_size", "the side of the square images the model sees, in pixels")
    whole(batch_size, 1, "data.batch_size", "images per batch and process")
    if num_workers is not None:
        whole(num_workers, 0, "data.num_workers", "loader processes; 0 loads in the training process")
    number(eval_crop_pct, "data.eval_crop_pct", "the share of the resized image kept, in (0, 1] (ImageNet: 0.875)",
           0, 1, open_low=True)  # fmt: skip
    for name, values, low in (("mean", mean, -math.inf), ("std", std, 0)):
        ok = isinstance(values, list | tuple) and len(values) == 3
        ok = ok and all(isinstance(v, int | float) and math.isfinite(v) and v > low for v in values)
        require(ok, f"data.{name}", values, "3 numbers, one a channel" + (", each above 0" if low == 0 else ""))
    holdout_ok = isinstance(val_holdout, int | float) and not isinstance(val_holdout, bool)
    holdout_ok = holdout_ok and (0 <= val_holdout < 1 or (val_holdout >= 1 and float(val_holdout).is_integer()))
    require(holdout_ok, "data.val_holdout", val_holdout,
            "0 (none), a fraction below 1, or a whole number of training images")  # fmt: skip
    for entry in train_sizes or []:
        ok = isinstance(entry, list | tuple) and len(entry) == 2 and isinstance(entry[0], int | float)
        ok = ok and 0 <= entry[0] <= 1 and isinstance(entry[1], int) and entry[1] >= 1
        require(ok, "data.train_sizes", train_sizes, "[[progress from 0 to 1, size in pixels], ...]")
    if device_prefetch is not None:
        whole(device_prefetch, 0, "data.device_prefetch", "batches decoded ahead; 0 decodes each in its step")
    number(worker_decode, "data.worker_decode", "a share of device_decode's JPEGs, from 0 to 1", 0, 1)


def check_augment_fits(augment: Augment, side: int) -> None:
    """OptionError if the augmentation would leave images of `side` pixels mostly blank: padding
    beyond half the side lets pad_crop's crops hold more padding than image; a cutout beyond the side
    blanks the whole image."""
    name = "data.augment."
    if augment.crop == "pad_crop" and augment.crop_padding is not None:
        require(augment.crop_padding <= side // 2, name + "crop_padding", augment.crop_padding,
                f"at most half the image side ({side // 2} of {side} px; CIFAR: 4 of 32)")  # fmt: skip
    require(augment.cutout <= side, name + "cutout", augment.cutout,
            f"at most the image side ({side} px; CIFAR: 16 of 32)")  # fmt: skip


def check_naflex_options(crop: Any, eval_crop_pct: Any, mixup: Mixup, in_memory: Any, device_decode: Any) -> None:
    """OptionError naming the first option set to what patch sequences (`data.naflex`) do not do."""
    with_naflex = "with --data.naflex"
    require(crop in ("rrc", "resize"), "data.augment.crop", crop,
            f"rrc or resize {with_naflex} (the crop keeps the image's aspect ratio)")  # fmt: skip
    require(eval_crop_pct == 1, "data.eval_crop_pct", eval_crop_pct,
            f"1 {with_naflex} (evaluation sees the whole image)")  # fmt: skip
    for name in ("mixup_alpha", "cutmix_alpha"):
        require(not getattr(mixup, name), f"data.mixup.{name}", getattr(mixup, name),
                f"0 {with_naflex} (Mixup and CutMix mix batches of square images)")  # fmt: skip
    for name, value in (("in_memory", in_memory), ("device_decode", device_decode)):
        require(not value, f"data.{name}", value, f"false {with_naflex} (it makes batches of square images)")


class DigitsDataModule(ImageDataModule):
    """The offline default: scikit-learn's bundled 8x8 handwritten digits (1,797 images, 10 classes),
    upsampled to img_size. Needs no download; a fixed stratified split holds out val_fraction."""

    def __init__(
        self,
        val_fraction: float = 0.2,
        img_size: int = 16,
        augment: Augment = Augment(crop="pad_crop", crop_padding=2, hflip=False),  # digits are not mirror-symmetric
        **kwargs: Any,
    ) -> None:
        number(val_fraction, "data.val_fraction", "the share of the digits held out, in (0, 1)", 0, 1, open_low=True)
        require(val_fraction < 1, "data.val_fraction", val_fraction, "the share of the digits held out, in (0, 1)")
        super().__init__(img_size=img_size, augment=augment, **kwargs)
        self.val_fraction = val_fraction
        self.num_classes = 10
        self.class_names = [str(digit) for digit in range(10)]

    def load_splits(self) -> tuple[ImageArrays, ImageArrays]:
        from sklearn.datasets import load_digits

        digits = load_digits()
        images = np.round(digits.images * (255.0 / 16.0)).astype(np.uint8)  # 0..16 ink levels -> 0..255
        count = math.ceil(self.val_fraction * len(images))
        train_idx, val_idx = holdout_indices(digits.target, count, option="data.val_fraction")
        return (
            ImageArrays(images[train_idx], digits.target[train_idx], self.train_transform),
            ImageArrays(images[val_idx], digits.target[val_idx], self.eval_transform),
        )


class CIFARDataModule(ImageDataModule):
    """CIFAR-10 / CIFAR-100 through torchvision: downloaded into `root` when online, otherwise read
    from `root/cifar-10-batches-py` (or `cifar-100-python`). Val is the official test split."""

    _FOLDERS: ClassVar[dict[str, str]] = {"cifar10": "cifar-10-batches-py", "cifar100": "cifar-100-python"}
    _URLS: ClassVar[dict[str, str]] = {
        "cifar10": "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz",
        "cifar100": "https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz",
    }

    def __init__(
        self,
        root: str = "data",
        dataset: str = "cifar10",
        download: bool = True,
        img_size: int = 32,
        augment: Augment = Augment(crop="pad_crop"),
        **kwargs: Any,
    ) -> None:
        require(dataset in self._FOLDERS, "data.dataset", dataset, "cifar10 or cifar100")
        super().__init__(img_size=img_size, augment=augment, **kwargs)
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

    def load_splits(self) -> tuple[ImageArrays, ImageArrays]:
        try:
            train, val = self._torchvision_dataset(True, False), self._torchvision_dataset(False, False)
        except RuntimeError as e:  # torchvision: "Dataset not found or corrupted"
            raise FileNotFoundError(self._missing_message(str(e))) from e
        self.class_names = list(train.classes)  # torchvision reads them from the dataset's meta file
        return ImageArrays(train.data, train.targets, self.train_transform), ImageArrays(
            val.data, val.targets, self.eval_transform
        )

    def _missing_message(self, reason: str) -> str:
        folder = self.root / self._FOLDERS[self.dataset]
        return (
            f"{self.dataset} is not in {folder} and {reason}. Download {self._URLS[self.dataset]} and extract it "
            f"into {self.root} (giving {folder}/), or set data.root to a folder that holds it. "
            "For a copy stored as image files (train/<class>/*.jpg), use vit.data.ImageFolderDataModule."
        )


class ImageFolderDataModule(ImageDataModule):
    """ImageNet-style trees: `root/<train_dir>/<class>/*` and `root/<val_dir>/<class>/*`; or a
    folder of class folders as it is, `root/<class>/*`, with `val_holdout` (a stratified share held
    out for validation, the same images every run). With `val_holdout`, `<val_dir>` is not needed:
    validation and test read the held-out images.

    The crop follows the image size unless it is given (`augment.crop`). Small images (img_size <=
    64: CIFAR, digits, Tiny-ImageNet-sized) get the CIFAR module's augmentation: resize, pad by
    img_size // 8 (`augment.crop_padding`; 4 px at 32) and a random crop back, plus a flip.
    ImageNet's random resized crop (scale 0.08-1) would keep as little as 8% of a 32-pixel image.
    Larger images get that random resized crop (`augment.crop_scale`) and a flip.
    `augment.hflip: false` for images that are not mirror-symmetric (digits, text). The pipelines
    are logged when the data is set up.

    `eval_crop_pct=None` follows the training crop: 0.875 after random-resized-crop training (the
    ImageNet convention, objects at the scale training saw them), 1.0 (the whole image) after
    pad+crop or resize training, as for CIFAR-sized images, where a zoomed eval would cost accuracy.
    With `naflex` (images at their own aspect ratio) the crop is the random resized crop whatever
    img_size, and evaluation sees the whole image.
    """

    def __init__(
        self,
        root: str = "data/imagenet",
        train_dir: str = "train",
        val_dir: str = "val",
        img_size: int = 224,
        augment: Augment = Augment(crop=None, crop_padding=None),  # following img_size
        eval_crop_pct: float | None = None,
        **kwargs: Any,
    ) -> None:
        set_option_groups(self, augment=augment)
        super().__init__(**folder_crop(img_size, self.augment, eval_crop_pct, kwargs), **kwargs)
        self.root, self.train_dir, self.val_dir = Path(root), train_dir, val_dir
        train = self._train_folder()
        # Scan the class folders now: the CLI links num_classes to the model's at instantiation (vit.cli).
        self.classes, self._train_samples = scan_image_folder(train)
        val = self.root / val_dir
        if not self.val_holdout and not val.is_dir():
            layouts = _FOLDER_LAYOUTS.format(root=self.root, train=train_dir, val=val_dir)
            raise FileNotFoundError(f"{val} does not exist: {layouts}")
        self.num_classes = len(self.classes)
        self.class_names = readable_class_names(self.classes, self.root)

    def _train_folder(self) -> Path:
        """`root/<train_dir>`, or root itself when it holds the class folders and val_holdout is set."""
        root, train, val = self.root, self.root / self.train_dir, self.root / self.val_dir
        layouts = _FOLDER_LAYOUTS.format(root=root, train=self.train_dir, val=self.val_dir)
        if train.is_dir():
            return train
        if root.is_dir() and not val.is_dir() and self.val_holdout:
            return root  # root/<class>/*
        if root.is_dir() and not val.is_dir():
            raise FileNotFoundError(f"{root} has no {self.train_dir}/ folder: {layouts}")
        raise FileNotFoundError(f"image folder {train} does not exist: {layouts}")

    def load_splits(self) -> tuple[ImageFiles, ImageFiles]:
        train = ImageFiles(self._train_samples, self.train_transform, self.skip_corrupt)
        if self.val_holdout and not (self.root / self.val_dir).is_dir():
            return train, train  # validation and test: the images setup holds out
        _, val_samples = scan_image_folder(self.root / self.val_dir, classes=self.classes)
        return train, ImageFiles(val_samples, self.eval_transform, self.skip_corrupt)


# The image folder layouts, for an error naming a missing split.
_FOLDER_LAYOUTS = (
    "expected {root}/{train}/<class>/<images> and {root}/{val}/<class>/<images>, or {root}/<class>/<images> "
    "(or {train}/ alone) with --data.val_holdout 0.1 to hold out a stratified 10% for validation"
)


def folder_crop(
    img_size: int, augment: Augment, eval_crop_pct: float | None, options: dict[str, Any]
) -> dict[str, Any]:
    """An image folder's geometry options with the defaults that follow img_size (ImageFolderDataModule)."""
    crop, crop_padding = augment.crop, augment.crop_padding
    naflex = options.get("naflex") is not None  # images at their own size: img_size says nothing of them
    if crop is None:
        crop = "pad_crop" if img_size <= SMALL_IMAGE and not naflex else "rrc"
        if crop == "pad_crop" and options.get("device_decode"):
            raise ValueError(
                f"data.img_size {img_size} is at most {SMALL_IMAGE}, where the image folder trains with pad + "
                "random crops by default, which device_decode does not do: set --data.augment.crop rrc (or resize) "
                "to keep device_decode, or --data.device_decode false"
            )
        if crop == "rrc" and options.get("in_memory") and not naflex:  # naflex's own check names in_memory
            raise ValueError(
                f"data.img_size {img_size} is above {SMALL_IMAGE}, where the image folder trains with random "
                "resized crops by default, which in_memory=True does not do (it augments whole batches): set "
                "--data.augment.crop pad_crop (or resize) to keep in_memory, or --data.in_memory false"
            )
    if crop_padding is None:
        crop_padding = max(1, img_size // 8)
    if eval_crop_pct is None:
        eval_crop_pct = 0.875 if crop == "rrc" and not naflex else 1.0
    augment = dataclasses.replace(augment, crop=crop, crop_padding=crop_padding)
    return dict(img_size=img_size, augment=augment, eval_crop_pct=eval_crop_pct)


class StreamingDataModule(ImageDataModule):
    """An image folder converted into litdata chunks by `scripts/convert_streaming.py`:
    `root/<train_dir>` and `root/<val_dir>`, where root is a local folder, a shared filesystem or
    object storage (`s3://bucket/prefix`, read with litdata's credentials and caching).

    Trained as an image folder is (the same crop defaults, augmentation, device_decode and exact
    resume), in the order of vit.data.sampling.ChunkedSampler: each process reads its own share of
    the chunks, `shuffle_window` chunks at a time, so nodes read disjoint parts of the data.
    `chunk_cache_dir` / `chunk_cache_size` (e.g. "200GB"): where and how much litdata caches of
    remote chunks (litdata's defaults when None; `cache_dir` stays in_memory's).
    """

    order_per_process = True  # a mid-epoch resume with another process count restarts the epoch

    def __init__(
        self,
        root: str = "data/imagenet-streaming",
        train_dir: str = "train",
        val_dir: str = "val",
        img_size: int = 224,
        augment: Augment = Augment(crop=None, crop_padding=None),  # following img_size
        eval_crop_pct: float | None = None,
        shuffle_window: int = 8,
        chunk_cache_dir: str | None = None,
        chunk_cache_size: str | None = None,
        **kwargs: Any,
    ) -> None:
        whole(shuffle_window, 1, "data.shuffle_window", "chunks each process reads from at a time")
        set_option_groups(self, augment=augment)
        super().__init__(**folder_crop(img_size, self.augment, eval_crop_pct, kwargs), **kwargs)
        self.root, self.train_dir, self.val_dir = root.rstrip("/"), train_dir, val_dir
        self.shuffle_window, self.stream_cache = shuffle_window, (chunk_cache_dir, chunk_cache_size)
        # Read the training split's index now: the CLI links num_classes to the model's at instantiation.
        self._train = StreamingImages(f"{self.root}/{train_dir}", self.train_transform, self.skip_corrupt,
                                      *self.stream_cache)  # fmt: skip
        self.classes, self.class_names = self._train.classes, self._train.class_names
        self.num_classes = len(self.classes)

    def load_splits(self) -> tuple[StreamingImages, StreamingImages]:
        val = StreamingImages(f"{self.root}/{self.val_dir}", self.eval_transform, self.skip_corrupt, *self.stream_cache)
        if val.classes != self.classes:
            raise ValueError(
                f"{self.root}/{self.val_dir} was converted with other classes than {self.root}/{self.train_dir} "
                f"({len(val.classes)} against {len(self.classes)}): convert both splits in one run"
            )
        return self._train, val

    def train_sampler(self, dataset: Dataset, seed: int) -> ChunkedSampler:
        source = dataset.source if isinstance(dataset, EncodedFiles) else dataset
        return ChunkedSampler(dataset, source.chunk_of, seed=seed, window=self.shuffle_window)


class TinyImageNetDataModule(ImageDataModule):
    """Tiny-ImageNet-200 (64x64, 200 classes) in its official layout; val labels come from
    `val/val_annotations.txt`. Samples keep their object boxes (used to score attention maps)."""

    def __init__(
        self,
        root: str = "data/tiny-imagenet-200",
        img_size: int = 64,
        augment: Augment = Augment(crop_scale=(0.35, 1.0)),
        **kwargs: Any,
    ) -> None:
        super().__init__(img_size=img_size, augment=augment, **kwargs)
        self.root = Path(root)
        self.classes, self._train_samples = scan_tiny_imagenet(self.root, "train")
        self.num_classes = len(self.classes)
        self.class_names = readable_class_names(self.classes, self.root)

    def load_splits(self) -> tuple[ImageFiles, ImageFiles]:
        _, val_samples = scan_tiny_imagenet(self.root, "val")
        return (
            ImageFiles(self._train_samples, self.train_transform, self.skip_corrupt),
            ImageFiles(val_samples, self.eval_transform, self.skip_corrupt),
        )


def holdout_indices(
    labels: np.ndarray, holdout: float, seed: int = 0, option: str = "data.val_holdout"
) -> tuple[np.ndarray, np.ndarray]:
    """(train, val) indices: exactly `holdout` images (a fraction if below 1) taken from every class
    in proportion (largest remainders get the images left over from rounding down, so 5 of 10
    balanced classes hold out 5 images, not 0), at random with a fixed seed, so every run and model
    tunes on the same images. Every class keeps at least one image to train on; a holdout that
    cannot is an OptionError of `option`, with the most it can be."""
    labels = np.asarray(labels)
    n_val = round(holdout * len(labels)) if holdout < 1 else int(holdout)
    classes, counts = np.unique(labels, return_counts=True)
    room = counts - 1  # each class keeps one image to train on
    require(
        0 < n_val <= room.sum(), option, holdout,
        f"a share or number of the {len(labels)} training images that holds out 1 to {room.sum()} of them "
        f"(each of the {len(classes)} classes keeps one to train on); this holds out {n_val}",
    )  # fmt: skip
    quota = n_val * counts / len(labels)
    take = np.minimum(np.floor(quota).astype(int), room)
    for _ in range(n_val - take.sum()):  # one more each for the largest remainders, among classes with room
        take[np.argmax(np.where(take < room, quota - take, -np.inf))] += 1
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(labels))
    val = [order[labels[order] == c][:k] for c, k in zip(classes, take, strict=True)]
    val_idx = np.sort(np.concatenate(val))
    return np.setdiff1d(np.arange(len(labels)), val_idx), val_idx
