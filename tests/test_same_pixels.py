"""Evaluation sees the same pixels on every path: per sample (loader workers), in memory, decoded on
the device, streamed, and in export and rollout (the per-sample transform): one geometry (the
centred square of crop_pct x the shorter side) and one resize (bicubic, antialiased)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

import vit
from tests.conftest import shared_path
from vit.data.augment import normalize, resize_crops_together
from vit.data.device import EncodedFiles, collate_encoded, decode_and_augment
from vit.data.images import ImageFiles, Sample, scan_tiny_imagenet
from vit.data.memory import to_tensor_images
from vit.data.transforms import eval_transform
from vit.tools.data_check import synthetic_photo

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def _photos(folder, count: int = 12) -> list[Sample]:
    """JPEGs of many shapes, landscape and portrait, larger and smaller than the model's input."""
    folder.mkdir()
    rng = np.random.default_rng(0)
    samples = []
    for i in range(count):
        width, height = (int(v) for v in rng.integers(30, 300, 2))
        path = folder / f"{i}.jpg"
        synthetic_photo(rng, width, height).save(path, quality=90)
        samples.append(Sample(str(path), i % 3))
    return samples


def _levels(x: torch.Tensor) -> torch.Tensor:
    """Normalised images back in grey levels (0-255)."""
    return x * torch.tensor(STD).view(-1, 3, 1, 1) * 255 + torch.tensor(MEAN).view(-1, 3, 1, 1) * 255


def _every_path(samples: list[Sample], size: int, crop_pct: float) -> dict[str, torch.Tensor]:
    per_sample = ImageFiles(samples, eval_transform(size, crop_pct, MEAN, STD))
    memory = to_tensor_images(ImageFiles(samples), size, crop_pct)
    encoded = EncodedFiles(samples, train=False, crop_pct=crop_pct)
    device, _ = decode_and_augment(collate_encoded([encoded[i] for i in range(len(samples))]), "cpu", size, encoded)
    return {
        "per sample": torch.stack([per_sample[i][0] for i in range(len(samples))]),
        "in memory": normalize(memory.images, MEAN, STD),
        "on the device": normalize(device, MEAN, STD),
    }


@pytest.mark.parametrize(("size", "crop_pct"), [(48, 0.875), (64, 1.0), (224, 0.875)])
def test_every_path_evaluates_the_same_pixels(tmp_path, size, crop_pct):
    """Within a grey level: the paths differ only in the JPEG decoder (PIL or torchvision's libjpeg)
    and the in-memory copy's rounding to whole levels."""
    paths = _every_path(_photos(tmp_path / "photos"), size, crop_pct)
    reference = _levels(paths.pop("per sample"))
    for name, x in paths.items():
        difference = (_levels(x) - reference).abs()
        assert difference.mean() <= 1.0 and difference.quantile(0.99) <= 2.0, (name, float(difference.mean()))


def test_real_jpegs_evaluate_the_same_on_every_path():
    """Tiny-ImageNet's validation JPEGs (64 px) at 48 px, where the per-sample and device paths
    differed by 5.9 grey levels on average when one resized bicubic and the other bilinear."""
    root = shared_path("data/tiny-imagenet-200")
    if not root.is_dir():
        pytest.skip("../shared/data/tiny-imagenet-200 is not here")
    samples = scan_tiny_imagenet(root, "val")[1][:40]
    paths = _every_path(samples, 48, 0.875)
    reference = _levels(paths.pop("per sample"))
    for name, x in paths.items():
        difference = (_levels(x) - reference).abs()
        assert difference.mean() <= 1.0, (name, float(difference.mean()))


def test_the_resize_is_pils_bicubic_with_antialiasing_and_the_batched_one_equals_it():
    """The per-image resize is PIL's bicubic filter (timm evaluates with it); the GPU's batched
    matrix products give the same to float rounding, shrinking and enlarging."""
    rng = np.random.default_rng(1)
    image = np.asarray(synthetic_photo(rng, 150, 110))
    ours = eval_transform(56, 1.0, (0, 0, 0), (1, 1, 1))(image=image)["image"] * 255
    side = 110
    square = Image.fromarray(image).crop((20, 0, 20 + side, side))  # the centred square
    pil = torch.from_numpy(np.asarray(square.resize((56, 56), Image.BICUBIC))).permute(2, 0, 1).float()
    assert (ours - pil).abs().mean() < 0.6  # PIL rounds to whole levels and works in fixed point
    images = [
        torch.from_numpy(np.asarray(synthetic_photo(rng, w, h))).permute(2, 0, 1) for w, h in [(90, 70), (20, 30)]
    ]
    rows = [[5, 10, 60, 60, 0], [0, 0, 30, 20, 1]]
    box, flips = torch.tensor(rows)[:, :4], torch.tensor(rows)[:, 4].bool()
    for size in (16, 48):
        together = resize_crops_together(images, box, flips, size, "bicubic")
        for image, row, out in zip(images, rows, together, strict=True):
            top, left, height, width, flip = row
            crop = image[None, :, top : top + height, left : left + width].float()
            alone = F.interpolate(crop, size=(size, size), mode="bicubic", antialias=True).clamp(0, 255)[0]
            torch.testing.assert_close(out, alone.flip(-1) if flip else alone, atol=1e-3, rtol=0)


def test_a_model_scores_the_same_loss_through_the_per_sample_and_the_device_path(tmp_path):
    """What a checkpoint's validation loss is does not depend on which path fed it."""
    samples = _photos(tmp_path / "photos")
    paths = _every_path(samples, 32, 0.875)
    torch.manual_seed(0)
    model = vit.create_model("vit_micro_patch4_32", num_classes=3).eval()
    labels = torch.tensor([s.label for s in samples])
    with torch.no_grad():
        losses = {name: float(F.cross_entropy(model(x), labels)) for name, x in paths.items()}
    assert losses["on the device"] == pytest.approx(losses["per sample"], rel=1e-4), losses
    assert losses["in memory"] == pytest.approx(losses["per sample"], rel=1e-4), losses
