"""How an image datamodule's splits become the model's batches: one pipeline a mode.

- `PerSample` (`pipeline: per_sample`, the default): each image decoded and augmented in a loader
  worker (albumentations, vit.data.transforms).
- `InMemory` (`pipeline: memory`, its options `memory`): decoded once into a uint8 tensor
  (vit.data.memory), whole batches augmented on the device.
- `FromFiles` (`pipeline: device`, its options `device`): loader workers read the files; batches
  decoded and augmented on the device (vit.data.device), in a data process or in threads
  (vit.data.prefetch).
- `Sequences` (per sample with `naflex`): as PerSample, each image at its own aspect ratio, batches
  packed as patch sequences for a NaFlexVit (vit.data.naflex).

A pipeline is composed from the datamodule's options (vit.data.spec.DataSpec) and told what only the
run knows (vit.data.spec.Run: seed, trainer) when it makes a loader or takes a batch; it never reads
the datamodule. It gives a split's training loader (over the datamodule's `sampler`), its evaluation
loader and its step on the device after the batch is moved there (`on_device`); the datamodule adds
Mixup/CutMix. The spec is passed at each call (a batch-size finder's change holds); the forms of the
splits a pipeline reads (the decoded tensor, the encoded files) it keeps itself, made on first use.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from vit.data.augment import batch_augment, draw_rand_augment, normalize, rand_augment, resize_batch
from vit.data.device import DeviceSteps, EncodedFiles, collate_encoded
from vit.data.images import ImageFiles
from vit.data.memory import ResumableBatchSampler, TensorImages, to_tensor_images
from vit.data.naflex import CROP_ASPECT, PackSequences
from vit.data.prefetch import PreparedLoader
from vit.data.sampling import resumable_loader
from vit.data.spec import DataSpec, Run
from vit.schedule import stepwise, training_progress
from vit.seeds import Purpose, seed_for


class PerSample:
    """Each image decoded and augmented in a loader worker by the split's own transform."""

    def train_loader(self, spec: DataSpec, dataset: Dataset, sampler: Sampler, run: Run) -> DataLoader:
        """The training loader over `dataset` in `sampler`'s order (yielding (index, sample seed))."""
        return resumable_loader(
            self.dataset(spec, dataset, run, train=True), sampler, run.trainer, batch_size=spec.batch_size,
            drop_last=len(sampler) > spec.batch_size,  # no ragged last batch (BatchNorm, Mixup)
            **self.loader_options(spec, dataset, run, train=True),
        )  # fmt: skip

    def eval_loader(self, spec: DataSpec, dataset: Dataset, run: Run) -> DataLoader:
        dataset = self.dataset(spec, dataset, run, train=False)
        if isinstance(dataset, ImageFiles):  # a corrupt file is left out, not replaced by an image scored twice
            dataset.substitute = False
        options = self.loader_options(spec, dataset, run, train=False)
        return PreparedLoader(dataset, batch_size=spec.batch_size, shuffle=False, **options)

    def dataset(self, spec: DataSpec, dataset: Dataset, run: Run, train: bool) -> Dataset:
        """The split in the form this pipeline's loaders read."""
        return dataset

    def loader_options(self, spec: DataSpec, dataset: Dataset, run: Run, train: bool) -> dict[str, Any]:
        return dict(
            num_workers=spec.num_workers,
            pin_memory=spec.pin_memory,
            persistent_workers=spec.persistent_workers and spec.num_workers > 0,
        )

    def on_device(self, spec: DataSpec, batch: Any, run: Run) -> Any:
        """The batch on the training device: here already augmented and normalised by the workers."""
        return batch

    def train_size(self, spec: DataSpec, run: Run) -> int:
        """The side of the training images at this point of the run."""
        return spec.img_size

    def describe(self, spec: DataSpec, run: Run) -> tuple[list[str], str]:
        """What the pipeline does first to a training image (words of the logged line), and what it
        says before evaluation's geometry."""
        size, augment = spec.img_size, spec.augment
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

    def dataset(self, spec: DataSpec, dataset: Dataset, run: Run, train: bool) -> EncodedFiles:
        if isinstance(dataset, EncodedFiles):
            return dataset
        key = (id(dataset), train)
        if key not in self.encoded:  # the source kept with it, so its id is not reused
            files = EncodedFiles(dataset, train, spec.augment, spec.eval_crop_pct, spec.skip_corrupt,
                                 spec.device.worker_decode)  # fmt: skip
            self.encoded[key] = (dataset, files)
        return self.encoded[key][1]

    def loader_options(self, spec: DataSpec, dataset: Dataset, run: Run, train: bool) -> dict[str, Any]:
        steps = DeviceSteps(self.dataset(spec, dataset, run, train), spec.img_size, spec.mean, spec.std)
        return super().loader_options(spec, dataset, run, train) | dict(
            collate_fn=collate_encoded, prepare=steps.stages, device=run.device,
            ahead=spec.device.prefetch, process=spec.in_data_process(run.device()),
        )  # fmt: skip

    def describe(self, spec: DataSpec, run: Run) -> tuple[list[str], str]:
        where = "decode on the training device" + (" from a data process" if spec.in_data_process(run.device()) else "")
        if spec.device.worker_decode:
            where += f" ({spec.device.worker_decode:.0%} of the JPEGs in the loader workers)"
        crop, _ = super().describe(spec, run)
        return [where, *crop], "decode on the training device, "


class InMemory(PerSample):
    """Each split decoded once at the evaluation geometry into a uint8 tensor (cached on disk,
    vit.data.memory); training batches gathered by index and augmented whole on the device (pad +
    random crop, flip, RandAugment, cutout, the run's size of `memory.train_sizes`), evaluation batches
    normalised. Randomness comes from each batch's seed (vit.seeds.Purpose.BATCH)."""

    def __init__(self) -> None:
        self.decoded: dict[tuple[int, bool], tuple[Dataset, TensorImages]] = {}

    def train_loader(self, spec: DataSpec, dataset: Dataset, sampler: Sampler, run: Run) -> DataLoader:
        """The training loader: whole batches of the decoded split, by a batch sampler of its own
        (the per-image `sampler` is not used: a batch's images are gathered at once)."""
        images = self.dataset(spec, dataset, run, train=True)
        batches = ResumableBatchSampler(images, spec.batch_size, shuffle=True, seed=run.seed, drop_last=True)
        return resumable_loader(images, batches, run.trainer, batch_size=None, pin_memory=spec.pin_memory)

    def eval_loader(self, spec: DataSpec, dataset: Dataset, run: Run) -> DataLoader:
        images = self.dataset(spec, dataset, run, train=False)
        sampler = ResumableBatchSampler(images, spec.batch_size, shuffle=False)
        return DataLoader(images, batch_size=None, sampler=sampler, pin_memory=spec.pin_memory)

    def dataset(self, spec: DataSpec, dataset: Dataset, run: Run, train: bool) -> TensorImages:
        """The split decoded, on first use (a tuning run never decodes the test set)."""
        if isinstance(dataset, TensorImages):
            return dataset
        key = (id(dataset), train)
        if key not in self.decoded:
            cache = spec.memory.cache_dir
            if cache is None and run.trainer is not None:
                cache = Path(run.trainer.default_root_dir) / "cache"
            images = to_tensor_images(dataset, spec.img_size, 1.0 if train else spec.eval_crop_pct, cache)
            self.decoded[key] = (dataset, images)
        return self.decoded[key][1]

    def on_device(self, spec: DataSpec, batch: Any, run: Run) -> tuple[torch.Tensor, torch.Tensor]:
        if len(batch) == 2:  # evaluation: uint8 at img_size, normalise only
            return normalize(batch[0], spec.mean, spec.std), batch[1]
        x, y, seed = batch  # training, with the batch's augmentation seed
        generator = torch.Generator(device=x.device).manual_seed(seed)
        augment = spec.augment
        padding = augment.crop_padding if augment.crop == "pad_crop" else 0
        x = batch_augment(x, generator, padding, augment.hflip)
        if augment.randaugment_ops > 0:  # before cutout, as RandAugment precedes random erasing in timm
            rng = np.random.default_rng(seed_for(seed, Purpose.BATCH_RANDAUGMENT))  # keyed by the batch's seed
            x = rand_augment(x, torch.from_numpy(draw_rand_augment(rng, *augment.randaugment, count=len(x))))
        x = batch_augment(x, generator, cutout=augment.cutout)  # the generator's draws in the order of one call
        x = normalize(x, spec.mean, spec.std)
        return resize_batch(x, self.train_size(spec, run)), y

    def train_size(self, spec: DataSpec, run: Run) -> int:
        """The training image size at this point of the run (`memory.train_sizes`), else img_size."""
        if not spec.memory.train_sizes or run.trainer is None:
            return spec.img_size
        return int(stepwise(spec.memory.train_sizes, training_progress(run.trainer)))

    def describe(self, spec: DataSpec, run: Run) -> tuple[list[str], str]:
        size, augment = spec.img_size, spec.augment
        words = [f"decode once at {size} (shorter side, centre crop)"]
        if augment.crop == "pad_crop":
            words.append(f"pad {augment.crop_padding} + random crop {size}")
        return words, ""


class Sequences(PerSample):
    """Each image resized at its own aspect ratio within the patch budget by the split's transform
    in a loader worker (vit.data.transforms.SequenceTrainTransform, SequenceEvalTransform); the
    batch packed as patch sequences padded to the budget (vit.data.naflex.PackSequences)."""

    def loader_options(self, spec: DataSpec, dataset: Dataset, run: Run, train: bool) -> dict[str, Any]:
        return super().loader_options(spec, dataset, run, train) | dict(collate_fn=PackSequences(spec.naflex))

    def describe(self, spec: DataSpec, run: Run) -> tuple[list[str], str]:
        naflex, augment = spec.naflex, spec.augment
        budget = f"at most {naflex.max_patches} patches of {naflex.patch_size} px"
        low, high = augment.crop_scale
        aspect = f"{CROP_ASPECT[0]:.2g}-{CROP_ASPECT[1]:.2g}x the image's"
        crop = f"random resized crop (scale {low:g}-{high:g}, aspect {aspect}) " if augment.crop == "rrc" else ""
        return [f"{crop}resized at its aspect to {budget}"], f"the whole image resized at its aspect to {budget}"


Pipeline = PerSample | FromFiles | InMemory | Sequences


PIPELINE_CLASSES: dict[str, type[PerSample]] = {"per_sample": PerSample, "memory": InMemory, "device": FromFiles}


def pipeline_for(spec: DataSpec) -> Pipeline:
    """The pipeline `spec.pipeline` names; per sample with `naflex`, its patch sequences."""
    if spec.naflex is not None:  # the spec's rules leave naflex per sample only
        return Sequences()
    return PIPELINE_CLASSES[spec.pipeline]()
