"""Batched augmentation on the training device (vit.data.augment): RandAugment's ops equal the
per-sample path's (albumentations) at the same strength, and draw ops and strengths with the same
distribution."""

from __future__ import annotations

import albumentations as A
import cv2
import numpy as np
import pytest
import torch
from scipy import stats

from vit.data.augment import (
    LIGHTNESS,
    RA_COLUMNS,
    RA_OPS,
    draw_rand_augment,
    rand_augment,
    rand_augment_ranges,
)
from vit.data.transforms import rand_augment_ops
from vit.tools.data_check import synthetic_photo

IMAGE = np.asarray(synthetic_photo(np.random.default_rng(0), 64, 64))
BORDER = cv2.BORDER_CONSTANT
GREY_ONLY = dict(brightness=0, contrast=0, saturation=0, hue=0, p=1)

# Each op at a fixed strength, and albumentations' op fixed at that strength.
FIXED = {
    "rotate": (20.0, A.Affine(rotate=(20, 20), border_mode=BORDER, p=1)),
    "shear_x": (15.0, A.Affine(shear={"x": (15, 15), "y": (0, 0)}, border_mode=BORDER, p=1)),
    "shear_y": (-15.0, A.Affine(shear={"x": (0, 0), "y": (-15, -15)}, border_mode=BORDER, p=1)),
    "translate_x": (0.3, A.Affine(translate_percent={"x": (0.3, 0.3), "y": (0, 0)}, border_mode=BORDER, p=1)),
    "translate_y": (-0.3, A.Affine(translate_percent={"x": (0, 0), "y": (-0.3, -0.3)}, border_mode=BORDER, p=1)),
    "brightness": (1.5, A.ColorJitter(**{**GREY_ONLY, "brightness": (1.5, 1.5)})),
    "contrast": (0.4, A.ColorJitter(**{**GREY_ONLY, "contrast": (0.4, 0.4)})),
    "saturation": (1.7, A.ColorJitter(**{**GREY_ONLY, "saturation": (1.7, 1.7)})),
    "sharpen": (0.6, A.Sharpen(alpha=(0.6, 0.6), lightness=(0.75, 0.75), p=1)),
    "posterize": (3.0, A.Posterize(num_bits=(3, 3), p=1)),
    "solarize": (0.4, A.Solarize(threshold_range=(0.4, 0.4), p=1)),
    "autocontrast": (0.0, A.AutoContrast(p=1)),
    "equalize": (0.0, A.Equalize(p=1)),
}


def _on_device(image: np.ndarray, params: np.ndarray) -> np.ndarray:
    x = torch.from_numpy(image.copy()).permute(2, 0, 1)[None].float().expand(len(params), -1, -1, -1)
    return rand_augment(x, torch.from_numpy(params)).permute(0, 2, 3, 1).numpy()


@pytest.mark.parametrize("op", RA_OPS)
def test_each_randaugment_op_equals_the_per_sample_op_at_the_same_strength(op):
    strength, per_sample = FIXED[op]
    params = np.full((1, RA_COLUMNS), np.nan)
    params[0, RA_OPS.index(op)], params[0, LIGHTNESS] = strength, 0.75
    ours = _on_device(IMAGE, params)[0]
    theirs = per_sample(image=IMAGE)["image"].astype(np.float32)
    floats = torch.from_numpy(IMAGE.copy()).permute(2, 0, 1)[None].float()
    rand_augment(floats, torch.from_numpy(params))
    assert torch.equal(floats[0].permute(1, 2, 0), torch.from_numpy(IMAGE).float())  # its input is left as it was
    difference = np.abs(ours - theirs)
    assert np.abs(theirs - IMAGE).mean() > 5  # the op changes the image
    assert difference.max() <= 1 and difference.mean() < 0.05, (difference.max(), difference.mean())


@pytest.mark.parametrize("op", RA_OPS)
def test_each_op_leaves_whole_levels_within_0_to_255_at_every_strength(op):
    """As the per-sample path's uint8 images after each op: each op rounds or clips what its own
    arithmetic can move off whole levels or out of range, across its strengths at magnitude 10, on a
    photo, black, white and an image of black and white pixels, from uint8 and from float input."""
    rng = np.random.default_rng(1)
    photo = torch.from_numpy(IMAGE.copy()).permute(2, 0, 1).float()
    speckle = torch.from_numpy(rng.integers(0, 2, size=photo.shape) * 255.0).float()
    images = torch.stack([photo, torch.zeros_like(photo), torch.full_like(photo, 255), speckle])
    low, high = rand_augment_ranges(10.0)[op]
    strengths = np.arange(low, high + 1) if op == "posterize" else np.linspace(low, high, 7)
    params = np.full((len(strengths) * len(images), RA_COLUMNS), np.nan)
    params[:, RA_OPS.index(op)], params[:, LIGHTNESS] = np.repeat(strengths, len(images)), 0.75
    batch = images.repeat(len(strengths), 1, 1, 1)
    for x in (batch, batch.to(torch.uint8)):
        out = rand_augment(x, torch.from_numpy(params))
        assert out.dtype == torch.float32 and torch.equal(out, out.round()), op
        assert out.min() >= 0 and out.max() <= 255, (op, out.min(), out.max())
    assert not torch.equal(out, batch)  # the op did something


COLOUR = {  # each colour op at a strong setting, and albumentations' at the same
    "brightness": (1.9, A.ColorJitter(**{**GREY_ONLY, "brightness": (1.9, 1.9)})),
    "contrast": (1.9, A.ColorJitter(**{**GREY_ONLY, "contrast": (1.9, 1.9)})),
    "saturation": (0.1, A.ColorJitter(**{**GREY_ONLY, "saturation": (0.1, 0.1)})),
    "posterize": (1.0, A.Posterize(num_bits=(1, 1), p=1)),
    "solarize": (0.5, A.Solarize(threshold_range=(0.5, 0.5), p=1)),
    "autocontrast": (0.0, A.AutoContrast(p=1)),
    "equalize": (0.0, A.Equalize(p=1)),
}


@pytest.mark.parametrize("op", COLOUR)
def test_colour_ops_on_flat_and_saturated_images_equal_the_per_sample_ops(op):
    """White, black and grey images, one with a channel all 255 (as brightness leaves a bright one)
    and one of two values: each colour op as albumentations does it, within a level."""
    rng = np.random.default_rng(0)
    red = np.dstack([np.full((16, 16), 255), rng.integers(0, 200, (16, 16, 2))]).astype(np.uint8)
    images = [np.full((16, 16, 3), v, np.uint8) for v in (255, 0, 128)]
    images += [red, np.where(rng.random((16, 16, 3)) < 0.5, 100, 255).astype(np.uint8)]
    strength, per_sample = COLOUR[op]
    params = np.full((1, RA_COLUMNS), np.nan)
    params[0, RA_OPS.index(op)], params[0, LIGHTNESS] = strength, 0.75
    for image in images:
        ours, theirs = _on_device(image, params)[0], per_sample(image=image)["image"].astype(np.float32)
        assert np.abs(ours - theirs).max() <= 1, (op, image[0, 0])


def test_each_image_gets_the_asked_number_of_distinct_ops_uniformly():
    params = draw_rand_augment(np.random.default_rng(0), 2, 9.0, count=6500)
    chosen = np.isfinite(params[:, : len(RA_OPS)])
    assert (chosen.sum(1) == 2).all()
    counts = chosen.sum(0)  # each op in 2/13 of the images: 1,000 expected
    assert stats.chisquare(counts).pvalue > 1e-3, counts
    strengths = params[chosen[:, 0], 0]  # rotate: uniform on (-27, 27) degrees at magnitude 9
    assert stats.kstest(strengths, stats.uniform(-27, 54).cdf).pvalue > 1e-3
    assert np.isnan(draw_rand_augment(np.random.default_rng(0), 0, 9.0)).all()


def _image_statistics(images: np.ndarray) -> dict[str, np.ndarray]:
    images = images.astype(np.float32)
    return {
        "brightness": images.mean((1, 2, 3)),
        "contrast": images.std((1, 2, 3)),
        "change": np.abs(images - IMAGE.astype(np.float32)).mean((1, 2, 3)),
    }


def test_randaugment_on_the_device_has_the_per_sample_paths_distribution():
    """400 draws of each path on one image: two-sample KS tests on each augmented image's mean,
    spread and change from the original agree; one op instead of two is told apart (the test has power)."""
    n = 400
    per_sample = A.SomeOf(rand_augment_ops(9.0), n=2, replace=False, p=1.0)
    per_sample.set_random_seed(0)
    theirs = _image_statistics(np.stack([per_sample(image=IMAGE)["image"] for _ in range(n)]))
    rng = np.random.default_rng(1)
    ours = _image_statistics(_on_device(IMAGE, draw_rand_augment(rng, 2, 9.0, count=n)))
    one_op = _image_statistics(_on_device(IMAGE, draw_rand_augment(rng, 1, 9.0, count=n)))
    for name in theirs:
        assert stats.ks_2samp(ours[name], theirs[name]).pvalue > 1e-3, name
    assert stats.ks_2samp(one_op["change"], theirs["change"]).pvalue < 1e-3


def test_an_image_taking_two_warps_gets_them_in_order_each_rounded_as_one_op_at_a_time():
    """The warps run in passes (each image's first warp, then its second): the result is the ops
    applied one after another in RA_OPS order, rounded after each, beside images taking one op."""
    image = torch.from_numpy(IMAGE.copy()).permute(2, 0, 1)[None].float()
    both, rotate, shift, grey = (np.full((1, RA_COLUMNS), np.nan) for _ in range(4))
    both[0, [RA_OPS.index("rotate"), RA_OPS.index("translate_x")]] = 20.0, 0.2
    rotate[0, RA_OPS.index("rotate")], shift[0, RA_OPS.index("translate_x")] = 20.0, 0.2
    grey[0, RA_OPS.index("saturation")] = 0.0
    batch = rand_augment(image.expand(3, -1, -1, -1), torch.from_numpy(np.concatenate([both, rotate, grey])))
    one_by_one = rand_augment(rand_augment(image, torch.from_numpy(rotate)), torch.from_numpy(shift))
    assert torch.equal(batch[0], one_by_one[0]) and not torch.equal(batch[0], batch[1])
    assert torch.equal(batch[1], rand_augment(image, torch.from_numpy(rotate))[0])
    assert torch.equal(batch[2], rand_augment(image, torch.from_numpy(grey))[0])


def test_each_image_of_a_batch_is_augmented_as_it_would_be_alone():
    """Images taking 0 to 3 warps and colour ops, mixed in one batch: the passes group each
    image's k-th warp and every op's images, and no image's result depends on the others'."""
    rng = np.random.default_rng(2)
    params = np.concatenate([draw_rand_augment(rng, ops, 9.0, count=8) for ops in (0, 1, 3, 5)])
    images = torch.from_numpy(rng.integers(0, 256, (len(params), 3, 24, 24)).astype(np.float32))
    batch = rand_augment(images, torch.from_numpy(params))
    assert (np.isfinite(params[:, :5]).sum(1) >= 3).any()  # some image takes three warps
    for i in range(len(params)):
        assert torch.equal(batch[i], rand_augment(images[i : i + 1], torch.from_numpy(params[i : i + 1]))[0]), i
    assert torch.equal(batch[:8], images[:8].round())  # no ops: unchanged
