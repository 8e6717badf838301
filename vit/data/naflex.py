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
from collections.abc import Callable, Sequence
from typing import Any

import torch

from vit.data import host
from vit.naflex import pack
from vit.options import OptionError, require, whole

# The training crop's aspect ratio as a multiple of the image's, log-uniform (timm's NaFlex default):
# a wide image gives wide crops.
CROP_ASPECT = (3 / 4, 4 / 3)

# The largest patch budget taken: a 256 x 256 grid, far beyond the budgets NaFlex models are trained
# at (timm's loader: 128 to 1,024). The model attends over every padded token with a mask of
# max_patches^2 entries an image (vit.naflex.padding_mask): here 2^32, 17 GB an image in float32.
MAX_PATCHES = 2**16


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
        require(self.max_patches <= MAX_PATCHES, "data.naflex.max_patches", self.max_patches,
                f"at most {MAX_PATCHES:,} patches an image (e.g. 256, 576): the model's padding mask holds "
                "max_patches^2 entries an image")  # fmt: skip
        whole(self.patch_size, 1, "data.naflex.patch_size", "the model's patch side in pixels")

    def check_batch(self, batch_size: int) -> None:
        """OptionError naming max_patches when one batch padded to it cannot fit in the memory this
        machine has free: the loader builds its patches in float32 in RAM, and without CUDA the
        model's padding mask (max_patches^2 entries an image, at least 2 bytes each) is in RAM too.
        A lower bound on what a step takes: a budget refused here does not fit as the machine is. The GPU's
        memory is not asked: that would start CUDA in this process before the loaders fork, and a
        GPU out of memory says so itself, where the kernel's OOM killer ends a run unsaid."""
        available = host.available_memory()
        patches = batch_size * self.max_patches * 3 * self.patch_size**2 * 4
        mask = 0 if torch.cuda.is_available() else batch_size * self.max_patches**2 * 2
        if available is None or patches + mask <= available:
            return
        what = f"{gigabytes(patches)} of float32 patches" + (
            f" and {gigabytes(mask)} of attention mask" if mask else ""
        )
        raise OptionError(
            "data.naflex.max_patches", self.max_patches,
            f"a budget whose padded batch fits in memory: a batch of {batch_size} takes {what}, "
            f"and {gigabytes(available)} of RAM is free",
        )  # fmt: skip


def gigabytes(size: int) -> str:
    return f"{size / 1e9:,.1f} GB"


def sequence_grid(height: int, width: int, max_patches: int) -> tuple[int, int]:
    """The (rows, columns) of patches an image of height x width becomes: scaled by the largest
    factor whose grid, each side rounded up to whole patches, has at most max_patches patches
    (timm's get_image_size_for_seq, exactly rather than by bisecting the scale); at least one patch
    a side.

    Rows and columns only grow with the scale, so the largest scale is where one of them just
    reaches a whole number: the most rows r whose grid (r, ceil(width * r / height)) fits, or the
    most columns c whose grid (ceil(height * c / width), c) fits; the larger of the two grids."""
    rows = most(lambda r: r * -(-width * r // height) <= max_patches, max_patches)
    columns = most(lambda c: c * -(-height * c // width) <= max_patches, max_patches)
    grids = [(rows, -(-width * rows // height)), (-(-height * columns // width), columns)]
    return max(grid for grid in grids if min(grid) >= 1)


def sequence_size(height: int, width: int, naflex: NaFlex) -> tuple[int, int]:
    """The (height, width) in pixels an image of height x width is resized to: its sequence_grid in whole patches."""
    rows, columns = sequence_grid(height, width, naflex.max_patches)
    return rows * naflex.patch_size, columns * naflex.patch_size


def sequence_sizes(sizes: Sequence[tuple[int, int]], naflex: NaFlex) -> list[tuple[int, int]]:
    """sequence_size of each (height, width), in one call."""
    return [sequence_size(height, width, naflex) for height, width in sizes]


def most(fits: Callable[[int], bool], high: int) -> int:
    """The largest n in 0..high that `fits` (0 does, and `fits` holds up to some n and not after),
    by bisection: a few dozen steps for any budget, where a list of every n would take gigabytes."""
    low = 0
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(middle) else (low, middle - 1)
    return low


class PackSequences:
    """A loader's collate_fn for images (3, rows x patch, columns x patch) of any grids, with their
    labels: timm's NaFlex batch padded to the budget (a fixed shape for every batch) and the labels."""

    def __init__(self, naflex: NaFlex) -> None:
        self.patch_size, self.max_patches = naflex.patch_size, naflex.max_patches

    def __call__(self, samples: Sequence[tuple[torch.Tensor, Any]]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        images, labels = zip(*samples, strict=True)
        return pack(list(images), self.patch_size, self.max_patches), torch.as_tensor(labels, dtype=torch.int64)
