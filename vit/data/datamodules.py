"""LightningDataModules: the offline digits default, CIFAR-10/100, ImageNet-style folders (as files or
as streaming chunks), Tiny-ImageNet.

They share `ImageDataModule`, which holds its options as one checked, frozen vit.data.spec.DataSpec
(read as its attributes: `data.img_size`), the run's seed and Mixup/CutMix, and hands its splits
with the spec to the pipeline `pipeline` names (vit.data.pipelines: per sample, in memory, decoded on
the device; per sample as patch sequences with `naflex`) for their loaders; a subclass only says
where its images and labels come from.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import weakref
from pathlib import Path
from typing import Any, ClassVar

import lightning as L
import numpy as np
from torch.utils.data import DataLoader, Dataset

from vit import lightning_compat as compat
from vit.data.augment import Augment
from vit.data.device import DeviceDecode
from vit.data.images import (
    ImageArrays,
    ImageFiles,
    readable_class_names,
    scan_image_folder,
    scan_tiny_imagenet,
)
from vit.data.memory import Memory
from vit.data.mixup import Mixup, MixupCutmix
from vit.data.naflex import NaFlex
from vit.data.pipelines import Pipeline, pipeline_for
from vit.data.prefetch import PreparedLoader
from vit.data.sampling import ChunkedSampler, ResumableSampler
from vit.data.spec import SPEC_FIELDS, DataSpec, Run
from vit.data.streaming import StreamingImages
from vit.data.transforms import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    SequenceEvalTransform,
    SequenceTrainTransform,
    eval_transform,
    train_transform,
)
from vit.options import StillWorks, group_default, number, require, set_option_groups, still_working, whole
from vit.seeds import Purpose, RunSeed, step_seed

log = logging.getLogger(__name__)

# An image folder at this side or below is small (CIFAR, digits, Tiny-ImageNet-sized): see ImageFolderDataModule.
SMALL_IMAGE = 64


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
        pipeline: how images become batches (vit.data.pipelines):
            "per_sample": each image decoded and augmented in a loader worker.
            "memory": every image decoded once into a uint8 tensor and whole batches augmented on
            the training device (vit.data.memory): crop "pad_crop" or "resize", hflip, RandAugment,
            cutout and Mixup/CutMix; its options are `memory`.
            "device": image files only: loader workers read the encoded bytes, and the batch is
            decoded, cropped (crop "rrc" or "resize"), flipped, RandAugmented and normalised on the
            training device (vit.data.device); its options are `device`.
        memory: vit.data.Memory, the memory pipeline's options: `cache_dir`, `train_sizes`
            (progressive resizing).
        device: vit.data.DeviceDecode, the device pipeline's options: `prefetch` (batches a
            thread decodes ahead), `worker_decode` (a share of the JPEGs the loader workers decode).
        data_process: how the device pipeline's work runs: in a process of its own per loader
            (vit.data.process), which hands finished batches to the training process; None: on a
            GPU. In the training process's threads, the data work takes the interpreter's lock from
            the thread that launches the model's kernels.
        naflex: vit.data.NaFlex: for a NaFlexVit, each image at its own aspect ratio within a patch
            budget, batches of padded patch sequences (vit.data.naflex); None: square images at
            img_size. Per sample only (not Mixup/CutMix), crop "rrc" or "resize", the whole image
            in evaluation (eval_crop_pct 1).
        in_memory, device_decode, cache_dir, train_sizes, device_prefetch, worker_decode: the older
            spelling, which still works, saying the new one in a line (RENAMED): `in_memory: true`
            is `pipeline: memory`, `device_decode: true` is `pipeline: device`, `cache_dir` is
            `memory.cache_dir`, ..., `device_prefetch` is `device.prefetch`.

    A group given in Python as a dict changes only the fields it names of the class's default,
    e.g. `CIFARDataModule(augment={"cutout": 8})` keeps its pad-crop.
    """

    # Options from before the groups, and where each went: the CLI names the new place of a str;
    # a StillWorks option is taken as its new spelling, said in a line.
    RENAMED: ClassVar[dict[str, str | StillWorks]] = {
        **{name: f"augment.{name}" for name in ("crop", "crop_scale", "crop_padding", "hflip", "cutout")},
        **{name: f"augment.{name}" for name in ("randaugment_ops", "randaugment_magnitude")},
        "mixup_alpha": "mixup.mixup_alpha",
        "cutmix_alpha": "mixup.cutmix_alpha",
        "mixup_prob": "mixup.prob",
        "mixup_switch_prob": "mixup.switch_prob",
        "in_memory": StillWorks("pipeline", {True: "memory"}, off="per_sample"),
        "device_decode": StillWorks("pipeline", {True: "device"}, off="per_sample"),
        "cache_dir": StillWorks("memory.cache_dir"),
        "train_sizes": StillWorks("memory.train_sizes"),
        "device_prefetch": StillWorks("device.prefetch"),
        "worker_decode": StillWorks("device.worker_decode"),
    }
    augment: Augment
    mixup: Mixup
    naflex: NaFlex | None
    memory: Memory
    device: DeviceDecode

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
        pipeline: str = "per_sample",
        memory: Memory = Memory(),
        device: DeviceDecode = DeviceDecode(),
        data_process: bool | None = None,
        naflex: NaFlex | None = None,
        # the older spelling, which still works (RENAMED); None: not given
        in_memory: bool | None = None,
        device_decode: bool | None = None,
        cache_dir: str | None = None,
        train_sizes: list[tuple[float, int]] | None = None,
        device_prefetch: int | None = None,
        worker_decode: float | None = None,
    ) -> None:
        super().__init__()
        given = self.in_new_spelling(dict(
            pipeline=pipeline, memory=memory, device=device, in_memory=in_memory, device_decode=device_decode,
            cache_dir=cache_dir, train_sizes=train_sizes, device_prefetch=device_prefetch,
            worker_decode=worker_decode,
        ))  # fmt: skip
        set_option_groups(self, augment=augment, mixup=mixup, naflex=naflex, memory=given["memory"],
                          device=given["device"])  # fmt: skip
        names = ("augment", "mixup", "naflex", "memory", "device")
        groups = {name: vars(self).pop(name) for name in names}  # held by the spec
        self.spec = DataSpec(
            img_size=img_size, batch_size=batch_size, num_workers=num_workers, pin_memory=pin_memory,
            persistent_workers=persistent_workers, eval_crop_pct=eval_crop_pct, mean=mean, std=std,
            skip_corrupt=skip_corrupt, val_holdout=val_holdout, pipeline=given["pipeline"],
            data_process=data_process, **groups,
        )  # fmt: skip
        spec = self.spec
        if spec.naflex is None:
            self.train_transform = train_transform(img_size, spec.augment, mean, std)
            self.eval_transform = eval_transform(img_size, eval_crop_pct, mean, std)
        else:
            self.train_transform = SequenceTrainTransform(spec.naflex, spec.augment, mean, std)
            self.eval_transform = SequenceEvalTransform(spec.naflex, mean, std)
        self.composed: Pipeline = pipeline_for(spec)  # the pipeline `pipeline` names, its loaders and step
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None
        self.test_set: Dataset | None = None
        self._loaders: weakref.WeakSet[PreparedLoader] = weakref.WeakSet()  # their data processes end at teardown

    @classmethod
    def in_new_spelling(cls, options: dict[str, Any]) -> dict[str, Any]:
        """`options` with the older ones that still work (RENAMED's StillWorks: `in_memory: true`)
        in their new spelling (`pipeline: memory`), each said in one line; None is not given."""
        defaults = {"pipeline": group_default(cls, "pipeline")}
        upgraded, lines = still_working(options, cls.RENAMED, "data", defaults)
        for line in lines:
            log.warning(line)
        return upgraded

    def __getattr__(self, name: str) -> Any:
        """An option the spec holds, read as the datamodule's own (`data.img_size`, `data.augment`)."""
        spec = vars(self).get("spec")
        if spec is not None and name in SPEC_FIELDS:
            return getattr(spec, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        """An option set after the datamodule is made (a batch-size finder's `batch_size`) makes a new
        spec, checked again, which the next loaders are composed from."""
        if name in SPEC_FIELDS and "spec" in vars(self):
            name, value = "spec", self.spec.replace(**{name: value})
        super().__setattr__(name, value)

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
        if self.pipeline == "device" and not isinstance(train, ImageFiles):
            raise ValueError(f"the device pipeline reads image files; {type(self).__name__} holds decoded arrays")
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
        train, evaluation = self.composed.describe(self.spec, self.run())
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
        if self.memory.train_sizes:
            train.append("sizes " + ", ".join(f"{size} from {start:g}" for start, size in self.memory.train_sizes))
        if self.naflex is None:
            evaluation += f"centre crop {self.eval_crop_pct:g} of the shorter side, resize to {size}"
        evaluation += " (bicubic), normalise"
        return ", ".join(train), evaluation

    def run(self) -> Run:
        """What the pipeline is told of the run: its seed (restored on resume) and trainer."""
        return Run(self.seed, self.trainer)

    def train_dataloader(self) -> DataLoader:
        sampler = self.train_sampler(self.train_set, self.seed)
        return self._kept(self.composed.train_loader(self.spec, self.train_set, sampler, self.run()))

    def train_sampler(self, dataset: Dataset, seed: int) -> ResumableSampler:
        """The training order: a permutation by (seed, epoch), shared among the processes."""
        return ResumableSampler(dataset, shuffle=True, seed=seed)

    def val_dataloader(self) -> DataLoader:
        return self._kept(self.composed.eval_loader(self.spec, self.val_set, self.run()))

    def test_dataloader(self) -> DataLoader:
        return self._kept(self.composed.eval_loader(self.spec, self.test_set, self.run()))

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
        """Whether the device pipeline's work runs in a data process: as given, else on a GPU."""
        return self.spec.in_data_process(self.run().device())

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """On the device: the pipeline's step (in memory: augmented and normalised), then
        Mixup/CutMix, training batches only. All randomness is a function of (seed, step, rank) or
        (seed, epoch, index) (vit.seeds), so resumed runs augment and mix as uninterrupted ones."""
        batch = self.composed.on_device(self.spec, batch, self.run())
        trainer = self.trainer
        if trainer is None or not trainer.training or not self.mixup.enabled:
            return batch
        x, y = batch
        batch_idx = compat.batches_ready(trainer)  # this batch's: counted after its transfer
        rng = np.random.default_rng(step_seed(self.seed, Purpose.MIXUP, trainer, batch_idx))
        return MixupCutmix(self.num_classes, self.mixup)(x, y, rng)

    def train_size(self) -> int:
        """The training image size at this point of the run (memory.train_sizes), else img_size."""
        return self.composed.train_size(self.spec, self.run())


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


class FolderSplits(ImageDataModule):
    """What an image folder and its streaming conversion share: the splits `<train_dir>` and
    `<val_dir>` of their root, and the crop defaults that follow img_size (`folder_crop`)."""

    def __init__(
        self,
        train_dir: str = "train",
        val_dir: str = "val",
        img_size: int = 224,
        augment: Augment = Augment(crop=None, crop_padding=None),  # following img_size
        eval_crop_pct: float | None = None,
        **kwargs: Any,
    ) -> None:
        set_option_groups(self, augment=augment)
        kwargs = self.in_new_spelling(kwargs)  # the crop defaults follow the pipeline
        super().__init__(**folder_crop(img_size, self.augment, eval_crop_pct, kwargs), **kwargs)
        self.train_dir, self.val_dir = train_dir, val_dir


class ImageFolderDataModule(FolderSplits):
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

    def __init__(self, root: str = "data/imagenet", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.root = Path(root)
        train = self._train_folder()
        # Scan the class folders now: the CLI links num_classes to the model's at instantiation (vit.cli).
        self.classes, self._train_samples = scan_image_folder(train)
        val = self.root / self.val_dir
        if not self.val_holdout and not val.is_dir():
            layouts = _FOLDER_LAYOUTS.format(root=self.root, train=self.train_dir, val=self.val_dir)
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
        pipeline = options.get("pipeline")
        if crop == "pad_crop" and pipeline == "device":
            raise ValueError(
                f"data.img_size {img_size} is at most {SMALL_IMAGE}, where the image folder trains with pad + "
                "random crops by default, which the device pipeline does not do: set --data.augment.crop rrc (or "
                "resize) to keep --data.pipeline device, or --data.pipeline per_sample"
            )
        if crop == "rrc" and pipeline == "memory" and not naflex:  # naflex's own check names the pipeline
            raise ValueError(
                f"data.img_size {img_size} is above {SMALL_IMAGE}, where the image folder trains with random "
                "resized crops by default, which the memory pipeline does not do (it augments whole batches): set "
                "--data.augment.crop pad_crop (or resize) to keep --data.pipeline memory, or --data.pipeline per_sample"
            )
    if crop_padding is None:
        crop_padding = max(1, img_size // 8)
    if eval_crop_pct is None:
        eval_crop_pct = 0.875 if crop == "rrc" and not naflex else 1.0
    augment = dataclasses.replace(augment, crop=crop, crop_padding=crop_padding)
    return dict(img_size=img_size, augment=augment, eval_crop_pct=eval_crop_pct)


class StreamingDataModule(FolderSplits):
    """An image folder converted into litdata chunks by `scripts/convert_streaming.py`:
    `root/<train_dir>` and `root/<val_dir>`, where root is a local folder, a shared filesystem or
    object storage (`s3://bucket/prefix`, read with litdata's credentials and caching).

    Trained as an image folder is (the same crop defaults, augmentation, pipelines and exact
    resume), in the order of vit.data.sampling.ChunkedSampler: each process reads its own share of
    the chunks, `shuffle_window` chunks at a time, so nodes read disjoint parts of the data.
    `chunk_cache_dir` / `chunk_cache_size` (e.g. "200GB"): where and how much litdata caches of
    remote chunks (litdata's defaults when None; `memory.cache_dir` is the memory pipeline's).
    """

    order_per_process = True  # a mid-epoch resume with another process count restarts the epoch

    def __init__(
        self,
        root: str = "data/imagenet-streaming",
        shuffle_window: int = 8,
        chunk_cache_dir: str | None = None,
        chunk_cache_size: str | None = None,
        **kwargs: Any,
    ) -> None:
        whole(shuffle_window, 1, "data.shuffle_window", "chunks each process reads from at a time")
        super().__init__(**kwargs)
        self.root = root.rstrip("/")
        self.shuffle_window, self.stream_cache = shuffle_window, (chunk_cache_dir, chunk_cache_size)
        # Read the training split's index now: the CLI links num_classes to the model's at instantiation.
        self._train = StreamingImages(f"{self.root}/{self.train_dir}", self.train_transform, self.skip_corrupt,
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

    def train_sampler(self, dataset: StreamingImages, seed: int) -> ChunkedSampler:
        return ChunkedSampler(dataset, dataset.chunk_of, seed=seed, window=self.shuffle_window)


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
