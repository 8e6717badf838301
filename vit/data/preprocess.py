"""How evaluation prepares an image for a classifier, as one record that our checkpoints and exports
carry, so predictions see validation's pixels."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vit.naflex import Inputs


@dataclass(frozen=True)
class Preprocess:
    """How evaluation feeds an image classifier (vit.data.transforms.eval_transform): the centred
    square of crop_pct x the shorter side, resized to img_size x img_size (bicubic, antialiased:
    vit.data.augment.EVAL_RESIZE), scaled to [0, 1] and normalised by mean and std. With a patch
    budget (`max_patches` of `patch_size` px: a run with `data.naflex`), the whole image at its own
    aspect ratio instead (vit.data.transforms.SequenceEvalTransform), packed as the evaluation loader
    packs it. Our checkpoints and exports carry their data's, so predictions see validation's pixels."""

    img_size: int
    crop_pct: float
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    max_patches: int | None = None
    patch_size: int | None = None

    @classmethod
    def of(cls, datamodule: Any) -> Preprocess | None:
        """An image datamodule's evaluation settings; None for data without them (text)."""
        size, crop, mean, std = (
            getattr(datamodule, name, None) for name in ("img_size", "eval_crop_pct", "mean", "std")
        )
        if any(value is None for value in (size, crop, mean, std)):
            return None
        values = {"img_size": size, "crop_pct": crop, "mean": mean, "std": std}
        naflex = getattr(datamodule, "naflex", None)
        if naflex is not None:
            values |= {"max_patches": naflex.max_patches, "patch_size": naflex.patch_size}
        return cls.from_dict(values)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Preprocess:
        """`to_dict`'s values; without max_patches and patch_size, no budget: square images."""
        floats = lambda v: tuple(float(x) for x in v)  # noqa: E731
        budget = [None if values.get(name) is None else int(values[name]) for name in ("max_patches", "patch_size")]
        if (budget[0] is None) != (budget[1] is None):
            raise ValueError(f"a patch budget needs both max_patches and patch_size, got {budget[0]} and {budget[1]}")
        return cls(
            int(values["img_size"]), float(values["crop_pct"]), floats(values["mean"]), floats(values["std"]), *budget
        )

    @classmethod
    def assumed(cls, img_size: int) -> Preprocess:
        """What a source that records no settings (timm weights, older checkpoints) is given: the
        whole image at the model's size, normalised by ImageNet's mean and std."""
        from vit.data.transforms import IMAGENET_MEAN, IMAGENET_STD

        return cls(img_size, 1.0, IMAGENET_MEAN, IMAGENET_STD)

    def to_dict(self) -> dict[str, Any]:
        values = {"img_size": self.img_size, "crop_pct": self.crop_pct, "mean": list(self.mean), "std": list(self.std)}
        if self.max_patches is not None:
            values |= {"max_patches": self.max_patches, "patch_size": self.patch_size}
        return values

    def tensors(self, images: list[np.ndarray]) -> list[torch.Tensor]:
        """RGB uint8 images (H, W, 3), any sizes, each as evaluation resizes and normalises it, not yet
        batched: (3, S, S) by vit.data.transforms.eval_transform with these settings; with a budget
        (3, rows x patch, columns x patch), the grid vit.data.transforms.SequenceEvalTransform gives it."""
        # vit.data.transforms loads albumentations and OpenCV: imported only where images are read
        from vit.data.naflex import NaFlex
        from vit.data.transforms import SequenceEvalTransform, eval_transform

        if self.max_patches is None:
            transform = eval_transform(self.img_size, self.crop_pct, self.mean, self.std)
        else:
            transform = SequenceEvalTransform(NaFlex(self.max_patches, self.patch_size), self.mean, self.std)
        return [transform(image=image)["image"] for image in images]

    def __call__(self, images: list[np.ndarray]) -> Inputs:
        """`tensors` as one batch of model inputs: (B, 3, S, S); with a budget, NaFlexVit.forward's dict
        of patch sequences padded to max_patches, as the evaluation loader makes it."""
        from vit.data.naflex import NaFlex, PackSequences

        if self.max_patches is None:
            return torch.stack(self.tensors(images))
        # The evaluation loader's collate_fn, so the padding is validation's too (the labels are unused).
        packed = PackSequences(NaFlex(self.max_patches, self.patch_size))
        return packed([(image, 0) for image in self.tensors(images)])[0]
