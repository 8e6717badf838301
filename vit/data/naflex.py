"""Images at their own aspect ratio, as the patch sequences a NaFlexVit takes (`data.naflex`).

timm's NaFlex loader's geometry, in our pipeline: each image is resized, its aspect ratio kept, to
the largest grid of whole patches within a patch budget (training crops first, at random, with an
aspect ratio near the image's), then a batch is packed as (patches, patch_coord, patch_valid) padded
to the budget (vit.naflex.pack), which vit.naflex.NaFlexVit.forward takes. The per-image transforms
are vit.data.transforms.SequenceTrainTransform and SequenceEvalTransform; the pipeline that loads
them is vit.data.pipelines.Sequences.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from vit.naflex import pack
from vit.options import whole

# The training crop's aspect ratio as a multiple of the image's, log-uniform (timm's NaFlex default):
# a wide image gives wide crops.
CROP_ASPECT = (3 / 4, 4 / 3)


@dataclasses.dataclass(frozen=True)
class NaFlex:
    """Images at their own aspect ratio as patch sequences, for a NaFlexVit (`data.naflex`; None:
    square images at img_size).

    Args:
        max_patches: each image's patch budget (timm's max_seq_len): it is resized to the largest
            grid of whole patches within it, its aspect ratio kept; every batch is padded to it.
        patch_size: the model's patch side in pixels (checked against the model's when a run starts).
    """

    max_patches: int
    patch_size: int = 16

    def __post_init__(self) -> None:
        whole(self.max_patches, 1, "data.naflex.max_patches", "the patches an image may have (e.g. 256, 576)")
        whole(self.patch_size, 1, "data.naflex.patch_size", "the model's patch side in pixels")


def sequence_grid(height: int, width: int, max_patches: int) -> tuple[int, int]:
    """The (rows, columns) of patches an image of height x width becomes: scaled by the largest
    factor whose grid, each side rounded up to whole patches, has at most max_patches patches
    (timm's get_image_size_for_seq, exactly rather than by bisection); at least one patch a side.

    Rows and columns only grow with the scale, so the largest scale is where one of them just
    reaches a whole number r (columns then ceil(width * r / height)) or c: the candidates below."""
    by_rows = [(r, -(-width * r // height)) for r in range(1, max_patches + 1)]
    by_columns = [(-(-height * c // width), c) for c in range(1, max_patches + 1)]
    return max(grid for grid in by_rows + by_columns if grid[0] * grid[1] <= max_patches)


class PackSequences:
    """A loader's collate_fn for images (3, rows x patch, columns x patch) of any grids, with their
    labels: timm's NaFlex batch padded to the budget (a fixed shape for every batch) and the labels."""

    def __init__(self, naflex: NaFlex) -> None:
        self.patch_size, self.max_patches = naflex.patch_size, naflex.max_patches

    def __call__(self, samples: Sequence[tuple[torch.Tensor, Any]]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        images, labels = zip(*samples, strict=True)
        return pack(list(images), self.patch_size, self.max_patches), torch.as_tensor(labels, dtype=torch.int64)
