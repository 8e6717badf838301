"""Faithfulness metrics on cases with known answers: a model that looks at one patch only, maps that
rank that patch first or last, closed-form areas, hand-made tokens and boxes; then batching on a ViT,
and benchmarks/rollout_eval.py on tiny image folders against the same scores computed directly."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

from benchmarks.report import NOTES_MARKER
from benchmarks.rollout_eval import VARIANTS
from benchmarks.rollout_eval import main as rollout_eval
from tests.conftest import write_image_folder
from tests.test_rollout import _nano
from vit import create_model
from vit.checkpoint import load_model
from vit.data.images import read_rgb, scan_image_folder
from vit.data.transforms import eval_transform
from vit.explain import (
    FRACTIONS,
    auc,
    baseline_maps,
    box_scores,
    cell_masks,
    centre_gaussian,
    class_interleaved_order,
    deletion_insertion_curves,
    fill_cells,
    mean_and_se,
    off_centre,
    outlier_norm_fraction,
    outlier_norm_mask,
    perturbation_curve,
    perturbation_scores,
    random_maps,
    relevance_order,
    remove_patches,
)
from vit.relevance import METHODS, attention_rollout

KEY = (1, 2)  # the one patch (row, column) of a 4x4 grid of 4x4-pixel patches the model looks at


class OnePatchModel(nn.Module):
    """Two classes decided by the mean m of one patch: logits (-m, m). A removed patch (all 0) gives
    the tie (0, 0), which argmax resolves to class 0: accuracy falls to chance, 0.5 on a balanced batch."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r, c = KEY
        m = x[:, :, 4 * r : 4 * r + 4, 4 * c : 4 * c + 4].mean(dim=(1, 2, 3))
        return torch.stack([-m, m], dim=1)


def _one_patch_case(n: int = 8) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Balanced labels; the key patch is +1 (class 1) or -1 (class 0), the rest noise the model ignores.
    Returns images (n, 3, 16, 16), labels, and maps that rank the key patch first."""
    labels = torch.arange(n) % 2
    images = torch.randn(n, 3, 16, 16)
    r, c = KEY
    images[:, :, 4 * r : 4 * r + 4, 4 * c : 4 * c + 4] = (2.0 * labels - 1.0)[:, None, None, None]
    maps = torch.rand(n, 4, 4) * 0.5
    maps[:, r, c] = 1.0
    return images, labels, maps


def test_relevance_order_is_most_relevant_first_with_ties_in_row_major_order():
    maps = torch.tensor([[[1.0, 3.0], [3.0, 0.0]], [[0.0, 0.0], [0.0, 0.0]], [[0.0, 1.0], [2.0, 3.0]]])
    assert relevance_order(maps).tolist() == [[1, 2, 0, 3], [0, 1, 2, 3], [3, 2, 1, 0]]


def test_removing_patches_is_exact_on_the_grid():
    images = torch.randn(2, 3, 8, 12)  # a 2x3 grid of 4x4 patches
    maps = torch.tensor([[[0.0, 5.0, 1.0], [4.0, 2.0, 3.0]], [[6.0, 5.0, 4.0], [3.0, 2.0, 1.0]]])
    out = remove_patches(images, maps, 2)
    # image 0 loses cells 1 (5.0) and 3 (4.0): rows 0-3 x columns 4-7 and rows 4-7 x columns 0-3
    removed = torch.zeros(2, 1, 8, 12, dtype=torch.bool)
    removed[0, :, 0:4, 4:8] = removed[0, :, 4:8, 0:4] = True
    removed[1, :, 0:4, 0:8] = True  # image 1: cells 0 and 1
    assert torch.equal(out, torch.where(removed, 0.0, images))  # the rest untouched, bit for bit
    assert ((out == 0).sum(dim=(1, 2, 3)) == 2 * 3 * 16).all()
    # one count per image, and a fill per channel
    masks = cell_masks(relevance_order(maps), torch.tensor([0, 6]), (2, 3))
    assert masks.sum(dim=(1, 2)).tolist() == [0, 6]
    filled = fill_cells(images, masks, torch.tensor([1.0, 2.0, 3.0])[:, None, None])
    assert torch.equal(filled[0], images[0]) and filled[1, :, 5, 7].tolist() == [1.0, 2.0, 3.0]
    with pytest.raises(ValueError, match="does not divide 8x12"):
        remove_patches(images, torch.zeros(2, 3, 5), 1)


def test_perturbation_by_a_map_on_the_deciding_patch_drops_to_chance_at_once():
    model = OnePatchModel()
    images, labels, maps = _one_patch_case()
    # 16 patches; fractions 0, .1, ..., .9 remove 0, 1, 3, 4, 6, 8, 9, 11, 12 and 14 patches.
    positive = perturbation_curve(model, images, labels, maps)
    assert positive.tolist() == [1.0] + [0.5] * 9  # the key patch goes first: chance from 10% on
    negative = perturbation_curve(model, images, labels, maps, most_relevant_first=False)
    assert negative.tolist() == [1.0] * 10  # the key patch would be the 16th: never removed
    reversed_maps = -maps  # the key patch last
    assert perturbation_curve(model, images, labels, reversed_maps).tolist() == [1.0] * 10
    assert torch.equal(perturbation_curve(model, images, labels, reversed_maps, most_relevant_first=False), positive)
    # AUC over 0..0.9, normalised by the range: (0.1 x (1 + .5) / 2 + 0.8 x .5) / 0.9
    assert auc(FRACTIONS, positive) == pytest.approx(0.475 / 0.9)
    assert auc(FRACTIONS, negative) == pytest.approx(1.0)
    # targets None: the unperturbed prediction, which is right here, so the same curve
    assert torch.equal(perturbation_curve(model, images, None, maps), positive)
    hits = perturbation_curve(model, images, labels, maps, fractions=(0.0, 0.5), per_image=True)
    assert hits.tolist() == [[1.0] * 8, [1.0, 0.0] * 4]  # class 1 images are lost, class 0 ones kept by the tie


def test_deletion_and_insertion_on_the_deciding_patch():
    model = OnePatchModel()
    images, _, maps = _one_patch_case()
    p = 1 / (1 + math.exp(-2))  # softmax of (-1, 1) at the predicted class; 0.5 once the patch is gone
    curves = deletion_insertion_curves(model, images, None, maps)  # one patch per step: 17 points
    torch.testing.assert_close(curves.fractions, torch.arange(17) / 16)
    torch.testing.assert_close(curves.deletion, torch.tensor([p] + [0.5] * 16))
    torch.testing.assert_close(curves.insertion, torch.tensor([0.5] + [p] * 16))
    # closed forms of the trapezoid over 0..1 in steps of 1/16
    assert auc(curves.fractions, curves.deletion) == pytest.approx(((p + 0.5) / 2 + 15 * 0.5) / 16, rel=1e-6)
    assert auc(curves.fractions, curves.insertion) == pytest.approx(((p + 0.5) / 2 + 15 * p) / 16, rel=1e-6)
    late = deletion_insertion_curves(model, images, None, -maps, steps=4)  # key patch last; counts 0,4,...,16
    torch.testing.assert_close(late.fractions, torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0]))
    torch.testing.assert_close(late.deletion, torch.tensor([p] * 4 + [0.5]))
    torch.testing.assert_close(late.insertion, torch.tensor([0.5] * 4 + [p]))
    # a canvas other than the fill: the negated image says the other class until the patch is inserted
    flipped = deletion_insertion_curves(model, images, None, maps, steps=2, canvas=-images, per_image=True)
    torch.testing.assert_close(flipped.insertion, torch.tensor([[1 - p] * 8, [p] * 8, [p] * 8]))
    with pytest.raises(ValueError, match="steps"):
        deletion_insertion_curves(model, images, None, maps, steps=17)


def test_auc_closed_forms():
    xs = torch.linspace(0, 0.9, 10)
    assert auc(xs, 1 - xs) == pytest.approx(0.55)  # a line: its mean height, exact for the trapezoid rule
    assert auc([0.0, 1.0], [0.25, 0.25]) == pytest.approx(0.25)
    fine = torch.linspace(0, 1, 1001)
    assert auc(fine, fine**2) == pytest.approx(1 / 3, abs=1e-6)  # trapezoid error (1/6) / 1000^2
    per_image = auc([0.0, 0.5, 1.0], torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]]))
    torch.testing.assert_close(per_image, torch.tensor([0.75, 0.25], dtype=torch.float64))
    with pytest.raises(ValueError, match="two points"):
        auc([0.0], [1.0])


def test_baseline_maps():
    a = random_maps(3, (4, 4), torch.Generator().manual_seed(1))
    assert torch.equal(a, random_maps(3, (4, 4), torch.Generator().manual_seed(1)))  # seeded: repeatable
    assert a.shape == (3, 4, 4) and not torch.equal(a[0], a[1])  # a different order per image
    assert torch.equal(relevance_order(a).sort(dim=1).values, torch.arange(16).expand(3, 16))
    centre = baseline_maps("centre", 2, (4, 4))
    assert torch.equal(centre, centre_gaussian(2, 4))
    assert sorted(relevance_order(centre)[0, :4].tolist()) == [5, 6, 9, 10]  # the four middle cells first
    wide = baseline_maps("centre", 1, (3, 5))
    assert wide.shape == (1, 3, 5) and wide[0].argmax().item() == 1 * 5 + 2
    with pytest.raises(ValueError, match="baseline must be one of"):
        baseline_maps("uniform", 1, (2, 2))


def test_outlier_norm_fraction_on_constructed_tokens():
    tokens = torch.zeros(2, 1 + 100, 8)
    tokens[:, 0, 0] = 1000.0  # a CLS token with a huge norm: not a patch, never counted
    tokens[:, 1:, 0] = 1.0  # patch tokens of norm 1
    tokens[0, [5, 17, 60], 3] = 10.0  # image 0: three of norm ~10
    tokens[1, 1:6, 0] = 1.9  # image 1: five of norm 1.9, under twice the median
    mask = outlier_norm_mask(tokens, num_prefix_tokens=1)
    assert mask.shape == (2, 100) and mask[0].nonzero()[:, 0].tolist() == [4, 16, 59] and not mask[1].any()
    assert outlier_norm_fraction(tokens, num_prefix_tokens=1) == pytest.approx(3 / 200)
    assert outlier_norm_fraction(tokens, factor=1.5, num_prefix_tokens=1) == pytest.approx(8 / 200)
    assert outlier_norm_fraction(tokens) == pytest.approx(5 / 202)  # the CLS tokens counted as patches
    model = _nano()  # the documented way to get a ViT's patch tokens before the final norm
    x = torch.randn(2, 3, 16, 16)
    patches = model.forward_intermediates(x, indices=1, output_fmt="NLC", intermediates_only=True)[0]
    features = model.forward_features(x)  # every token after the final norm
    torch.testing.assert_close(model.norm(patches), features[:, model.num_prefix_tokens :])  # the same, before it
    assert outlier_norm_fraction(patches) == pytest.approx(outlier_norm_mask(patches).float().mean().item())


def test_off_centre_boxes_and_the_centre_prior_on_them():
    boxes = torch.tensor(
        [
            [16, 16, 47, 47],  # centred: distance 0
            [0, 0, 15, 15],  # corner: centre (7.5, 7.5), distance 24 sqrt(2) = 33.9
            [20, 0, 43, 30],  # top: centre (31.5, 15), distance 16.5, clear of the middle pixels 31-32
            [28, 0, 35, 40],  # centre (31.5, 20), distance 11.5
            [0, 0, 40, 40],  # centre (20, 20), distance 16.3, but it covers the middle
        ]
    )  # fmt: skip
    assert off_centre(boxes, 64, min_dist=16).tolist() == [False, True, True, False, True]
    kept = off_centre(boxes, 64, min_dist=16, exclude_centre=True)
    assert kept.tolist() == [False, True, True, False, False]
    hits, _ = box_scores(centre_gaussian(int(kept.sum()), 64), boxes[kept], size=64)
    assert hits.tolist() == [0.0, 0.0]  # where the centre prior cannot win
    all_hits, _ = box_scores(centre_gaussian(5, 64), boxes, size=64)
    assert all_hits.tolist() == [1.0, 0.0, 0.0, 1.0, 1.0]


def test_curves_on_a_vit_batch_equal_the_per_image_curves():
    model = _nano()
    x = torch.randn(4, 3, 16, 16)
    maps, logits = attention_rollout(model, x)
    labels = torch.tensor([0, 1, 2, 3])
    batch = perturbation_curve(model, x, labels, maps, per_image=True)
    curves = deletion_insertion_curves(model, x, None, maps, steps=4, per_image=True)
    for i in range(4):
        alone = perturbation_curve(model, x[i : i + 1], labels[i : i + 1], maps[i : i + 1], per_image=True)
        torch.testing.assert_close(batch[:, i : i + 1], alone)
        one = deletion_insertion_curves(model, x[i : i + 1], None, maps[i : i + 1], steps=4, per_image=True)
        torch.testing.assert_close(curves.deletion[:, i : i + 1], one.deletion, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(curves.insertion[:, i : i + 1], one.insertion, atol=1e-6, rtol=1e-5)
    assert perturbation_curve(model, x, None, maps)[0].item() == 1.0  # predicted class: all right unperturbed
    probs = logits.softmax(-1).max(-1).values
    torch.testing.assert_close(curves.deletion[0], probs, atol=1e-6, rtol=1e-5)  # nothing deleted yet
    torch.testing.assert_close(curves.insertion[-1], probs, atol=1e-6, rtol=1e-5)  # everything inserted


def test_perturbation_scores_are_per_image_aucs_of_the_curves():
    model = OnePatchModel()
    images, labels, maps = _one_patch_case()
    scores = perturbation_scores(model, images, labels, maps, steps=4)
    # per image: the key patch goes first, so class 1 images drop to 0 from 10% on, class 0 ones
    # keep the tie; the batch mean is the AUC of the accuracy curve, 0.475 / 0.9 as above
    lost = (0.1 * 0.5) / 0.9
    torch.testing.assert_close(scores["positive"], torch.tensor([1.0, lost] * 4))
    assert scores["positive"].mean().item() == pytest.approx(0.475 / 0.9)
    torch.testing.assert_close(scores["negative"], torch.ones(8))
    p = 1 / (1 + math.exp(-2))
    assert scores["deletion"].mean().item() == pytest.approx((p + 0.5) / 2 / 4 + 3 * 0.5 / 4, rel=1e-6)
    assert scores["insertion_curve"].shape == (5, 8) and scores["positive_curve"].shape == (10, 8)
    assert mean_and_se([0.0, 1.0, 1.0, 0.0]) == pytest.approx((0.5, math.sqrt(1 / 3) / 2))
    assert mean_and_se([0.25]) == (0.25, 0.0)


def test_class_interleaved_order_takes_one_image_per_class_in_turn():
    labels = [0] * 5 + [1] * 3 + [2] * 4
    order = class_interleaved_order(labels, seed=3)
    assert sorted(order) == list(range(12))
    assert [labels[i] for i in order] == [0, 1, 2] * 3 + [0, 2, 0]  # class 1 runs out after 3 rounds
    assert order == class_interleaved_order(labels, seed=3)
    assert order != class_interleaved_order(labels, seed=4)  # the images within a class are shuffled
    # the listing order of the files does not matter, only the labels and the seed
    assert class_interleaved_order(torch.tensor(labels), seed=3) == order


def _checkpoint(path: Path, num_classes: int) -> Path:
    """vit_nano_patch4_16 (16 px, 4x4 grid, CLS pooling) moved away from its init, in our .ckpt format."""
    model = create_model("vit_nano_patch4_16", num_classes=num_classes)
    with torch.no_grad():  # away from the init, so attention is not uniform
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    state_dict = {f"model.{k}": v for k, v in model.state_dict().items()}
    meta = {"model_name": "vit_nano_patch4_16", "model_kwargs": {"num_classes": num_classes}}
    torch.save({"vit": meta, "state_dict": state_dict}, path)
    return path


def test_rollout_eval_on_an_image_folder_equals_the_scores_computed_directly(tmp_path):
    root = write_image_folder(tmp_path / "cifar", classes=4, train=1, val=4, size=16, val_dir="test")
    ckpt = _checkpoint(tmp_path / "vit.ckpt", num_classes=4)
    out, js = tmp_path / "eval.md", tmp_path / "eval.json"
    argv = ["--checkpoint", str(ckpt), "--dataset", "cifar10", "--data-root", str(root), "--limit", "12"]
    argv += ["--batch-size", "5", "--steps", "4", "--out", str(out), "--json", str(js)]
    rollout_eval(argv)
    result = json.loads(js.read_text())
    assert list(result["rows"]) == [*METHODS, *VARIANTS, "random", "centre"]
    assert result["num_images"] == 12 and result["images_per_class"] == [3, 3]

    # the same 12 images, by hand: the seeded class-interleaved order of the test split
    _, samples = scan_image_folder(root / "test")
    chosen = [samples[i] for i in class_interleaved_order([s.label for s in samples], seed=0)[:12]]
    transform = eval_transform(16)
    x = torch.stack([transform(image=read_rgb(s.path))["image"] for s in chosen])
    y = torch.tensor([s.label for s in chosen])
    model = load_model(ckpt)
    with torch.no_grad():
        accuracy = (model(x).argmax(-1) == y).float().mean().item()
        patches = model.forward_intermediates(x, indices=1, output_fmt="NLC", intermediates_only=True)[0]
    assert result["clean_top1"] == pytest.approx(accuracy)
    assert result["outlier_norm_fraction"] == pytest.approx(outlier_norm_fraction(patches))
    assert result["patch_tokens"] == 12 * 16

    # the random baseline: one seeded generator, drawn batch after batch (5, 5, 2 images)
    generator = torch.Generator().manual_seed(0)
    noise = torch.cat([random_maps(b, (4, 4), generator) for b in (5, 5, 2)])
    random_row = result["rows"]["random"]
    max_discard = attention_rollout(model, x, "max", discard_ratio=0.9)[0]  # a variant's row: its options applied
    expected = auc(FRACTIONS, perturbation_curve(model, x, y, max_discard))
    assert result["rows"]["attention_max_discard"]["positive"] == pytest.approx(expected)
    assert random_row["positive"] == pytest.approx(auc(FRACTIONS, perturbation_curve(model, x, y, noise)))
    negative = perturbation_curve(model, x, y, noise, most_relevant_first=False)
    assert random_row["negative"] == pytest.approx(auc(FRACTIONS, negative))
    centre = deletion_insertion_curves(model, x, None, baseline_maps("centre", 12, (4, 4)), steps=4)
    assert result["rows"]["centre"]["deletion"] == pytest.approx(auc(centre.fractions, centre.deletion), abs=1e-6)
    assert result["rows"]["centre"]["insertion"] == pytest.approx(auc(centre.fractions, centre.insertion), abs=1e-6)
    for name, row in result["rows"].items():
        for key in ("positive", "negative", "deletion", "insertion"):
            assert 0.0 <= row[key] <= 1.0, (name, key)
        assert row["positive_curve"][0] == row["negative_curve"][0] == pytest.approx(accuracy)  # nothing removed
        assert len(row["deletion_curve"]) == 5 and "pointing" not in row  # no boxes in an image folder
        assert row["ms_per_image"] > 0

    text = out.read_text()
    assert result["command"] in text and result["machine"] in text
    assert "positive AUC ↓" in text and "insertion AUC ↑" in text and "baseline: centred Gaussian" in text
    # a second model's run reports the first one too, each with its own command
    second = [*argv[:6], "--limit", "4", "--methods", "attention", "--out", str(out)]
    rollout_eval([*second, "--json", str(tmp_path / "b.json"), "--with-results", str(js)])
    text = out.read_text()
    assert text.count("## `") == 2 and result["command"] in text and "--limit 4 --methods attention" in text


def test_rollout_eval_on_tiny_imagenet_boxes_scores_the_off_centre_subset(tmp_path):
    """Six 16x16 val images; the centred Gaussian (pixel resolution) peaks at pixel (7, 7), the first
    of the four central pixels, so it hits exactly the boxes that hold that pixel."""
    root = tmp_path / "tiny"
    boxes = [
        (0, 0, 15, 15),  # the whole image: hit
        (4, 4, 11, 11),  # centred: hit
        (0, 0, 5, 5),  # top-left corner: off-centre
        (10, 10, 15, 15),  # bottom-right corner: off-centre
        (0, 8, 15, 15),  # the bottom half: holds central pixels (row 8), but not the peak (7, 7)
        (8, 0, 15, 6),  # top right: off-centre
    ]
    wnids = ["n01", "n02", "n03"]
    (root / "val" / "images").mkdir(parents=True)
    (root / "wnids.txt").write_text("\n".join(wnids) + "\n")
    rng = np.random.default_rng(0)
    lines = []
    for i, box in enumerate(boxes):
        Image.fromarray(rng.integers(0, 255, (16, 16, 3), dtype=np.uint8)).save(
            root / "val" / "images" / f"val_{i}.JPEG"
        )
        lines.append("\t".join([f"val_{i}.JPEG", wnids[i % 3], *map(str, box)]))
    (root / "val" / "val_annotations.txt").write_text("\n".join(lines) + "\n")
    ckpt = _checkpoint(tmp_path / "vit.ckpt", num_classes=3)
    js = tmp_path / "eval.json"
    argv = ["--checkpoint", str(ckpt), "--data-root", str(root), "--methods", "attention", "--steps", "2"]
    rollout_eval([*argv, "--out", str(tmp_path / "eval.md"), "--json", str(js)])
    result = json.loads(js.read_text())
    assert result["dataset"] == "tiny-imagenet" and result["num_images"] == 6
    assert result["off_centre_images"] == 3
    centre = result["rows"]["centre"]
    assert centre["pointing"] == pytest.approx(2 / 6) and centre["pointing_off_centre"] == 0.0
    assert 0.0 <= centre["energy_off_centre"] < centre["energy"] <= 1.0
    # the attention rollout's box scores, directly, on the same images (all six: order does not matter)
    model = load_model(ckpt)
    transform = eval_transform(16)
    files = sorted((root / "val" / "images").iterdir())
    x = torch.stack([transform(image=read_rgb(f))["image"] for f in files])
    hits, energy = box_scores(attention_rollout(model, x)[0], torch.tensor(boxes), 16)
    assert result["rows"]["attention"]["pointing"] == pytest.approx(hits.mean().item())
    assert result["rows"]["attention"]["energy"] == pytest.approx(energy.mean().item(), rel=1e-5)
    assert "pointing, off-centre ↑" in (tmp_path / "eval.md").read_text()


def _result(dataset: str, reg_tokens: int, rows: dict[str, dict[str, float]]) -> dict:
    """A JSON of benchmarks/rollout_eval.py with these scores (each with a standard error of 0.01)."""
    boxes = "pointing" in next(iter(rows.values()))
    return {
        "checkpoint": f"runs/{dataset}_reg{reg_tokens}/last.ckpt",
        "model": "VisionTransformer",
        "reg_tokens": reg_tokens,
        "global_pool": "avg",
        "dataset": dataset,
        "split": "val" if boxes else "test",
        "num_images": 100,
        "images_per_class": [10, 10],
        "seed": 0,
        "clean_top1": 0.5,
        "outlier_norm_fraction": 0.01,
        "outlier_factor": 2.0,
        "patch_tokens": 6400,
        "off_centre_images": 20 if boxes else None,
        "off_centre_min_dist": 0.0 if boxes else None,
        "seconds": 60.0,
        "machine": "a test machine",
        "command": f"python benchmarks/rollout_eval.py --dataset {dataset} --reg {reg_tokens}",
        "rows": {
            name: {"ms_per_image": 1.0, **scores, **{f"{key}_se": 0.01 for key in scores}}
            for name, scores in rows.items()
        },
    }


def test_rollout_eval_without_a_checkpoint_rewrites_the_report_side_by_side_and_keeps_the_notes(tmp_path):
    def scores(positive, negative, deletion, insertion, **boxes):
        return {"positive": positive, "negative": negative, "deletion": deletion, "insertion": insertion, **boxes}

    box = {"pointing": 0.57, "pointing_off_centre": 0.241, "energy": 0.5, "energy_off_centre": 0.2}
    results = [
        _result("cifar10", 0, {"attention": scores(0.42, 0.41, 0.33, 0.33), "gradient": scores(0.31, 0.48, 0.24, 0.4)}),
        _result("cifar10", 4, {"attention": scores(0.4, 0.43, 0.3, 0.35)}),  # gradient rollout not scored
        _result("tiny-imagenet", 0, {"attention": scores(0.12, 0.15, 0.09, 0.11, **box)}),
    ]
    paths = []
    for i, result in enumerate(results):
        paths.append(tmp_path / f"r{i}.json")
        paths[-1].write_text(json.dumps(result))
    out = tmp_path / "rollout.md"
    out.write_text(f"an older report\n{NOTES_MARKER}\nmy reading of it\n")

    assert rollout_eval(["--out", str(out), "--with-results", *map(str, paths)]) == results
    text = out.read_text()
    assert "an older report" not in text and text.endswith(f"{NOTES_MARKER}\nmy reading of it\n")
    lines = text.splitlines()
    # the tables lead, one column per model; a method a model was not scored on shows "-"
    assert lines[2] == "**positive ↓ / negative ↑ perturbation AUC**"
    assert "| method | (1) cifar10, 0 reg | (2) cifar10, 4 reg | (3) tiny-imagenet, 0 reg |" in lines
    assert "| attention rollout (mean fusion) | 0.420 / 0.410 | 0.400 / 0.430 | 0.120 / 0.150 |" in lines
    assert "| gradient rollout (Chefer ICCV 2021) | 0.310 / 0.480 | - | - |" in lines
    assert "| gradient rollout (Chefer ICCV 2021) | 0.240 / 0.400 | - | - |" in lines  # deletion / insertion
    # pointing only for the model with boxes
    assert "| method | (3) tiny-imagenet, 0 reg |" in lines
    assert "| attention rollout (mean fusion) | 57.0% / 24.1% |" in lines
    # then the command that wrote the report and the models, numbered as the columns
    assert f"python -m benchmarks.rollout_eval --out {out} --with-results {' '.join(map(str, paths))}" in lines
    model = "| (3) | `runs/tiny-imagenet_reg0/last.ckpt` | tiny-imagenet | 0 | 100 | 50.00% | 1.00% | a test machine |"
    assert model in lines
    # then each model's own section with its command
    assert text.count("## `") == 3 and all(r["command"] in text for r in results)


def test_rollout_eval_names_the_file_when_an_earlier_result_is_not_one_of_its_jsons(tmp_path):
    with pytest.raises(SystemExit) as nothing:
        rollout_eval(["--out", str(tmp_path / "rollout.md")])
    assert nothing.value.code == 2  # neither a checkpoint to score nor results to report
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"checkpoint": "a.ckpt", "rows": {}}))
    with pytest.raises(SystemExit, match=r"other\.json.*missing \['dataset', 'reg_tokens', 'clean_top1'\]"):
        rollout_eval(["--out", str(tmp_path / "rollout.md"), "--with-results", str(other)])
    with pytest.raises(SystemExit, match=r"absent\.json: not a readable JSON"):
        rollout_eval(["--out", str(tmp_path / "rollout.md"), "--with-results", str(tmp_path / "absent.json")])
    assert not (tmp_path / "rollout.md").exists()  # nothing written
