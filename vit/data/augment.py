"""Augmentation's names in one place, each defined in the module of its concept:

- vit.data.draws: the options (`Augment`), what is drawn for each image from its sample seed
  (crop box, flip, RandAugment's ops) and the record that carries it (`Augmentation`);
- vit.data.geometry: one image's crop boxes, resizes and normalisation, on every path;
- vit.data.crops: crops and resizes of whole batches on the training device;
- vit.data.randaugment: RandAugment's ops on whole batches.
"""

from vit.data.crops import (
    TOGETHER_SIDE,
    TRAIN_RESIZE_DTYPE,
    batch_augment,
    crop_resize_flip,
    resize_batch,
    resize_crops_together,
    resize_weights,
)
from vit.data.draws import (
    CROPS,
    LIGHTNESS,
    POSTERIZE,
    RA_COLUMNS,
    RA_OPS,
    SHARPEN_LIGHTNESS,
    Augment,
    Augmentation,
    Rng,
    draw_rand_augment,
    rand_augment_ranges,
    random_resized_crop_box,
)
from vit.data.geometry import EVAL_RESIZE, RESIZES, center_crop_box, eval_resize, normalize, resize_box
from vit.data.randaugment import GREY, WARPS, rand_augment

__all__ = [
    "CROPS",
    "EVAL_RESIZE",
    "GREY",
    "LIGHTNESS",
    "POSTERIZE",
    "RA_COLUMNS",
    "RA_OPS",
    "RESIZES",
    "SHARPEN_LIGHTNESS",
    "TOGETHER_SIDE",
    "TRAIN_RESIZE_DTYPE",
    "WARPS",
    "Augment",
    "Augmentation",
    "Rng",
    "batch_augment",
    "center_crop_box",
    "crop_resize_flip",
    "draw_rand_augment",
    "eval_resize",
    "normalize",
    "rand_augment",
    "rand_augment_ranges",
    "random_resized_crop_box",
    "resize_batch",
    "resize_box",
    "resize_crops_together",
    "resize_weights",
]
