"""How an image datamodule's splits become the model's batches: one pipeline a mode.

- `PerSample` (the default): each image decoded and augmented in a loader worker (albumentations,
  vit.data.transforms).
- `InMemory` (`in_memory`): decoded once into a uint8 tensor (vit.data.memory), whole batches
  augmented on the device.
- `FromFiles` (`device_decode`): loader workers read the files; batches decoded and augmented on
  the device (vit.data.device), in a data process or in threads (vit.data.prefetch).
- `Sequences` (`naflex`): as PerSample, each image at its own aspect ratio, batches packed as
  patch sequences for a NaFlexVit (vit.data.naflex).

A pipeline gives a split's training loader, its evaluation loader and its step on the device after
the batch is moved there (`on_device`); the datamodule adds Mixup/CutMix. It reads the datamodule's
options when it is called (so a batch-size finder's change holds), and keeps the forms of the
splits it reads (the decoded tensor, the encoded files) itself, made on first use.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from vit.data.augment import batch_augment, draw_rand_augment, normalize, rand_augment, resize_batch
from vit.data.device import DeviceSteps, EncodedFiles, collate_encoded
from vit.data.images import ImageFiles
from vit.data.memory import ResumableBatchSampler, TensorImages, to_tensor_images
from vit.data.naflex import CROP_ASPECT, PackSequences
from vit.data.prefetch import PreparedLoader
from vit.data.sampling import resumable_loader
from vit.schedule import stepwise, training_progress
from vit.seeds import Purpose, seed_for

if TYPE_CHECKING:
    from vit.data.datamodules import ImageDataModule


class PerSample:
    """Each image decoded and augmented in a loader worker by the split's own transform."""

    def train_loader(self, data: ImageDataModule, dataset: Dataset) -> DataLoader:
        sampler = data.train_sampler(dataset, data.seed)
        return resumable_loader(
            self.dataset(data, dataset, train=True), sampler, data.trainer, batch_size=data.batch_size,
            drop_last=len(sampler) > data.batch_size,  # no ragged last batch (BatchNorm, Mixup)
            **self.loader_options(data, dataset, train=True),
        )  # fmt: skip

    def eval_loader(self, data: ImageDataModule, dataset: Dataset) -> DataLoader:
        dataset = self.dataset(data, dataset, train=False)
        if isinstance(dataset, ImageFiles):  # a corrupt file is left out, not replaced by an image scored twice
            dataset.substitute = False
        options = self.loader_options(data, dataset, train=False)
        return PreparedLoader(dataset, batch_size=data.batch_size, shuffle=False, **options)

    def dataset(self, data: ImageDataModule, dataset: Dataset, train: bool) -> Dataset:
        """The split in the form this pipeline's loaders read."""
        return dataset

    def loader_options(self, data: ImageDataModule, dataset: Dataset, train: bool) -> dict[str, Any]:
        return dict(
            num_workers=data.num_workers,
            pin_memory=data.pin_memory,
            persistent_workers=data.persistent_workers and data.num_workers > 0,
        )

    def on_device(self, data: ImageDataModule, batch: Any) -> Any:
        """The batch on the training device: here already augmented and normalised by the workers."""
        return batch

    def describe(self, data: ImageDataModule) -> tuple[list[str], str]:
        """What the pipeline does first to a training image (words of the logged line), and what it
        says before evaluation's geometry."""
        size, augment = data.img_size, data.augment
        if augment.crop == "rrc":
            low, high = augment.crop_scale
            return [f"random resized crop {size} (scale {low:g}-{high:g})"], ""
        if augment.crop == "pad_crop":
            return [f"resize {size}x{size}, pad {augment.crop_padding} + random crop {size}"], ""
        return [f"resize {size}x{size}"], ""


class FromFiles(PerSample):
    """Loader workers read each file's bytes and draw its augmentation (vit.data.device.EncodedFiles);
    each batch is decoded, cropped, flipped, RandAugmented and normalised on the training device
    (DeviceSteps), in a data process of its own or in the training process's threads."""

    def __init__(self) -> None:
        self.encoded: dict[tuple[int, bool], tuple[Dataset, EncodedFiles]] = {}

    def dataset(self, data: ImageDataModule, dataset: Dataset, train: bool) -> EncodedFiles:
        if isinstance(dataset, EncodedFiles):
            return dataset
        if not isinstance(dataset, ImageFiles):
            raise ValueError(f"device_decode reads image files; {type(data).__name__} holds decoded arrays")
        key = (id(dataset), train)
        if key not in self.encoded:  # the source kept with it, so its id is not reused
            files = EncodedFiles(dataset, train, data.augment, data.eval_crop_pct, data.skip_corrupt,
                                 data.worker_decode)  # fmt: skip
            self.encoded[key] = (dataset, files)
        return self.encoded[key][1]

    def loader_options(self, data: ImageDataModule, dataset: Dataset, train: bool) -> dict[str, Any]:
        steps = DeviceSteps(self.dataset(data, dataset, train), data.img_size, data.mean, data.std)
        return super().loader_options(data, dataset, train) | dict(
            collate_fn=collate_encoded, prepare=steps.stages, device=data.training_device,
            ahead=data.device_prefetch, process=data.data_process,
        )  # fmt: skip

    def describe(self, data: ImageDataModule) -> tuple[list[str], str]:
        where = "decode on the training device" + (" from a data process" if data.data_process else "")
        if data.worker_decode:
            where += f" ({data.worker_decode:.0%} of the JPEGs in the loader workers)"
        crop, _ = super().describe(data)
        return [where, *crop], "decode on the training device, "


class InMemory(PerSample):
    """Each split decoded once at the evaluation geometry into a uint8 tensor (cached on disk,
    vit.data.memory); training batches gathered by index and augmented whole on the device (pad +
    random crop, flip, RandAugment, cutout, the run's size of `train_sizes`), evaluation batches
    normalised. Randomness comes from each batch's seed (vit.seeds.Purpose.BATCH)."""

    def __init__(self) -> None:
        self.decoded: dict[tuple[int, bool], tuple[Dataset, TensorImages]] = {}

    def train_loader(self, data: ImageDataModule, dataset: Dataset) -> DataLoader:
        images = self.dataset(data, dataset, train=True)
        sampler = ResumableBatchSampler(images, data.batch_size, shuffle=True, seed=data.seed, drop_last=True)
        return resumable_loader(images, sampler, data.trainer, batch_size=None, pin_memory=data.pin_memory)

    def eval_loader(self, data: ImageDataModule, dataset: Dataset) -> DataLoader:
        images = self.dataset(data, dataset, train=False)
        sampler = ResumableBatchSampler(images, data.batch_size, shuffle=False)
        return DataLoader(images, batch_size=None, sampler=sampler, pin_memory=data.pin_memory)

    def dataset(self, data: ImageDataModule, dataset: Dataset, train: bool) -> TensorImages:
        """The split decoded, on first use (a tuning run never decodes the test set)."""
        if isinstance(dataset, TensorImages):
            return dataset
        key = (id(dataset), train)
        if key not in self.decoded:
            cache = data.cache_dir
            if cache is None and data.trainer is not None:
                cache = Path(data.trainer.default_root_dir) / "cache"
            images = to_tensor_images(dataset, data.img_size, 1.0 if train else data.eval_crop_pct, cache)
            self.decoded[key] = (dataset, images)
        return self.decoded[key][1]

    def on_device(self, data: ImageDataModule, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if len(batch) == 2:  # evaluation: uint8 at img_size, normalise only
            return normalize(batch[0], data.mean, data.std), batch[1]
        x, y, seed = batch  # training, with the batch's augmentation seed
        generator = torch.Generator(device=x.device).manual_seed(seed)
        augment = data.augment
        padding = augment.crop_padding if augment.crop == "pad_crop" else 0
        x = batch_augment(x, generator, padding, augment.hflip)
        if augment.randaugment_ops > 0:  # before cutout, as RandAugment precedes random erasing in timm
            rng = np.random.default_rng(seed_for(seed, Purpose.BATCH_RANDAUGMENT))  # keyed by the batch's seed
            x = rand_augment(x, torch.from_numpy(draw_rand_augment(rng, *augment.randaugment, count=len(x))))
        x = batch_augment(x, generator, cutout=augment.cutout)  # the generator's draws in the order of one call
        x = normalize(x, data.mean, data.std)
        return resize_batch(x, self.train_size(data)), y

    def train_size(self, data: ImageDataModule) -> int:
        """The training image size at this point of the run (`train_sizes`), else img_size."""
        if not data.train_sizes or data.trainer is None:
            return data.img_size
        return int(stepwise(data.train_sizes, training_progress(data.trainer)))

    def describe(self, data: ImageDataModule) -> tuple[list[str], str]:
        size, augment = data.img_size, data.augment
        words = [f"decode once at {size} (shorter side, centre crop)"]
        if augment.crop == "pad_crop":
            words.append(f"pad {augment.crop_padding} + random crop {size}")
        return words, ""


class Sequences(PerSample):
    """Each image resized at its own aspect ratio within the patch budget by the split's transform
    in a loader worker (vit.data.transforms.SequenceTrainTransform, SequenceEvalTransform); the
    batch packed as patch sequences padded to the budget (vit.data.naflex.PackSequences)."""

    def loader_options(self, data: ImageDataModule, dataset: Dataset, train: bool) -> dict[str, Any]:
        return super().loader_options(data, dataset, train) | dict(collate_fn=PackSequences(data.naflex))

    def describe(self, data: ImageDataModule) -> tuple[list[str], str]:
        naflex, augment = data.naflex, data.augment
        budget = f"at most {naflex.max_patches} patches of {naflex.patch_size} px"
        low, high = augment.crop_scale
        aspect = f"{CROP_ASPECT[0]:.2g}-{CROP_ASPECT[1]:.2g}x the image's"
        crop = f"random resized crop (scale {low:g}-{high:g}, aspect {aspect}) " if augment.crop == "rrc" else ""
        return [f"{crop}resized at its aspect to {budget}"], f"the whole image resized at its aspect to {budget}"


Pipeline = PerSample | FromFiles | InMemory | Sequences
