"""An image datamodule's options as one frozen record, and what only the run knows.

`DataSpec` holds every option of vit.data.ImageDataModule as an explicit value and checks, when it
is made, each option alone and every rule between options: the one place that says which
combinations a run takes. The datamodule makes it from its arguments (and again when one of them is
set later: a batch-size finder's `batch_size`); the pipelines (vit.data.pipelines) are composed
from it and never read the datamodule. `Run` is what they are told when a loader is made: the run's
seed and its trainer (progress, rank, root folder, device).
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from vit.data.augment import Augment
from vit.data.device import DEVICE_CROPS, DeviceDecode
from vit.data.memory import Memory
from vit.data.mixup import Mixup
from vit.data.naflex import NaFlex
from vit.data.transforms import IMAGENET_MEAN, IMAGENET_STD
from vit.options import number, require, whole, written

if TYPE_CHECKING:
    import lightning as L


def default_num_workers() -> int:
    """Leave a core for the training process: 1 worker on a 2-core laptop, up to 8 per GPU process on a node."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    local_procs = max(1, torch.cuda.device_count())
    return max(0, min(8, cpus // local_procs - 1))


@dataclass(frozen=True)
class DataSpec:
    """The options of an image datamodule (ImageDataModule's arguments, documented there), checked.

    None for num_workers, pin_memory and persistent_workers is resolved when the spec is made (one
    less than the CPUs per GPU process; on with CUDA; on with workers), so the spec holds what runs.
    `data_process` None stays: it follows the training device, known when a loader is made
    (`in_data_process`). `pipeline` names one of PIPELINES; `memory` and `device` are the options of
    the pipelines of those names (PIPELINE_GROUPS).
    """

    img_size: int = 32
    batch_size: int = 128
    num_workers: int | None = None
    pin_memory: bool | None = None
    persistent_workers: bool | None = None
    augment: Augment = Augment()
    mixup: Mixup = Mixup()
    naflex: NaFlex | None = None
    eval_crop_pct: float = 1.0
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD
    skip_corrupt: bool = False
    val_holdout: float = 0
    pipeline: str = "per_sample"
    memory: Memory = Memory()
    device: DeviceDecode = DeviceDecode()
    data_process: bool | None = None

    def __post_init__(self) -> None:
        check_options(self)
        num_workers = default_num_workers() if self.num_workers is None else self.num_workers
        resolved = dict(
            num_workers=num_workers,
            pin_memory=torch.cuda.is_available() if self.pin_memory is None else self.pin_memory,
            persistent_workers=num_workers > 0 if self.persistent_workers is None else self.persistent_workers,
        )
        for name, value in resolved.items():
            object.__setattr__(self, name, value)

    def replace(self, **changes: Any) -> DataSpec:
        """This spec with `changes`, checked again."""
        return dataclasses.replace(self, **changes)

    def in_data_process(self, device: torch.device) -> bool:
        """Whether the device pipeline's work runs in a data process: as given, else on a GPU."""
        if self.data_process is not None:
            return self.data_process
        return self.pipeline == "device" and device.type == "cuda"


SPEC_FIELDS = frozenset(field.name for field in dataclasses.fields(DataSpec))
# The pipelines `data.pipeline` chooses from (vit.data.pipelines.pipeline_for), and the option group
# of each that has options of its own.
PIPELINES = ("per_sample", "memory", "device")
PIPELINE_GROUPS: dict[str, type] = {"memory": Memory, "device": DeviceDecode}


def check_options(spec: DataSpec) -> None:
    """OptionError naming the first option that holds a value it does not take, alone or with the
    others: every rule between the data options is here. vit.data.device, transforms and naflex
    take what passes."""
    check_values(spec)
    augment, crop, pipeline = spec.augment, spec.augment.crop, spec.pipeline
    check_pipeline_groups(spec)
    if spec.naflex is not None:
        check_naflex_options(crop, spec.eval_crop_pct, spec.mixup, pipeline)
        spec.naflex.check_batch(spec.batch_size)
    train_sizes = spec.memory.train_sizes
    check_augment_fits(augment, min([spec.img_size, *(size for _, size in train_sizes or [])]))
    require(pipeline == "memory" or not augment.cutout, "data.augment.cutout", augment.cutout,
            "0 unless --data.pipeline memory (cutout augments whole batches)")  # fmt: skip
    require(pipeline != "memory" or crop in ("pad_crop", "resize"), "data.augment.crop", crop,
            "pad_crop or resize with --data.pipeline memory (for rrc: --data.pipeline per_sample)")  # fmt: skip
    require(pipeline != "device" or crop in DEVICE_CROPS, "data.augment.crop", crop,
            f"{' or '.join(DEVICE_CROPS)} with --data.pipeline device")  # fmt: skip
    require(spec.data_process in (None, False) or pipeline == "device", "data.data_process", spec.data_process,
            "false or null unless --data.pipeline device (it runs the decoding and augmenting)")  # fmt: skip


def check_pipeline_groups(spec: DataSpec) -> None:
    """OptionError naming the first option of another pipeline's group (`data.memory.cache_dir`
    with `data.pipeline device`) that is not its default: an option the chosen pipeline would not read."""
    for name, kind in PIPELINE_GROUPS.items():
        group = getattr(spec, name)
        require(isinstance(group, kind), f"data.{name}", group, f"a {kind.__name__} (its options one by one)")
        if spec.pipeline == name:
            continue
        for field in dataclasses.fields(kind):
            value, default = getattr(group, field.name), field.default
            require(value == default, f"data.{name}.{field.name}", value,
                    f"{written(default)} unless --data.pipeline {name} (an option of the {name} pipeline; "
                    f"--data.pipeline is {spec.pipeline})")  # fmt: skip


def check_values(spec: DataSpec) -> None:
    """OptionError naming the first option whose value it does not take on its own."""
    whole(spec.img_size, 1, "data.img_size", "the side of the square images the model sees, in pixels")
    whole(spec.batch_size, 1, "data.batch_size", "images per batch and process")
    if spec.num_workers is not None:
        whole(spec.num_workers, 0, "data.num_workers", "loader processes; 0 loads in the training process")
    number(spec.eval_crop_pct, "data.eval_crop_pct",
           "the share of the resized image kept, in (0, 1] (ImageNet: 0.875)", 0, 1, open_low=True)  # fmt: skip
    for name, values, low in (("mean", spec.mean, -math.inf), ("std", spec.std, 0)):
        ok = isinstance(values, list | tuple) and len(values) == 3
        ok = ok and all(isinstance(v, int | float) and math.isfinite(v) and v > low for v in values)
        require(ok, f"data.{name}", values, "3 numbers, one a channel" + (", each above 0" if low == 0 else ""))
    holdout = spec.val_holdout
    holdout_ok = isinstance(holdout, int | float) and not isinstance(holdout, bool)
    holdout_ok = holdout_ok and (0 <= holdout < 1 or (holdout >= 1 and float(holdout).is_integer()))
    require(holdout_ok, "data.val_holdout", holdout,
            "0 (none), a fraction below 1, or a whole number of training images")  # fmt: skip
    require(spec.pipeline in PIPELINES, "data.pipeline", spec.pipeline,
            "per_sample (each image in a loader worker), memory (decoded once, whole batches augmented on the "
            "device) or device (decoded and augmented on the training device)")  # fmt: skip


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


def check_naflex_options(crop: Any, eval_crop_pct: Any, mixup: Mixup, pipeline: Any) -> None:
    """OptionError naming the first option set to what patch sequences (`data.naflex`) do not do."""
    with_naflex = "with --data.naflex"
    require(crop in ("rrc", "resize"), "data.augment.crop", crop,
            f"rrc or resize {with_naflex} (the crop keeps the image's aspect ratio)")  # fmt: skip
    require(eval_crop_pct == 1, "data.eval_crop_pct", eval_crop_pct,
            f"1 {with_naflex} (evaluation sees the whole image)")  # fmt: skip
    for name in ("mixup_alpha", "cutmix_alpha"):
        require(not getattr(mixup, name), f"data.mixup.{name}", getattr(mixup, name),
                f"0 {with_naflex} (Mixup and CutMix mix batches of square images)")  # fmt: skip
    require(pipeline == "per_sample", "data.pipeline", pipeline,
            f"per_sample {with_naflex} (the {pipeline} pipeline makes batches of square images)")  # fmt: skip


@dataclass(frozen=True)
class Run:
    """What a pipeline is told when it makes a loader or takes a batch, known only once a run sets
    the data up: the run's `seed` (vit.seeds.RunSeed, restored on resume) and its `trainer` (None
    outside a run): its progress (resume position, memory.train_sizes), its root folder (the memory
    pipeline's cache) and its device."""

    seed: int = 0
    trainer: L.Trainer | None = None

    def device(self) -> torch.device:
        """Where the model runs: the trainer's device; outside a run, the GPU if there is one."""
        if self.trainer is not None:
            return self.trainer.strategy.root_device
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
