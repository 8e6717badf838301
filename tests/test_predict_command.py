"""`vit-predict`: each image's top classes are the softmax of the checkpoint's model on validation's
pixels, named as the checkpoint names the classes, from the .ckpt and from its ONNX export alike;
unreadable images and impossible options end the command with one line naming them."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from PIL import Image

from tests.conftest import quiet_trainer, write_image_folder
from vit.checkpoint import Preprocess, export_safetensors, load_checkpoint
from vit.data import ImageFolderDataModule
from vit.data.images import CorruptImageError, read_rgb
from vit.data.transforms import IMAGENET_MEAN, IMAGENET_STD
from vit.lit import ImageClassifier
from vit.tools import predict

CLASSES = ["goldfish", "heron", "tabby"]  # the folder names, sorted: label order
# Not the defaults (crop 1.0, ImageNet's mean and std): predictions must use the checkpoint's.
SETTINGS = {"img_size": 16, "crop_pct": 0.875, "mean": [0.5, 0.5, 0.5], "std": [0.25, 0.25, 0.25]}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    """vit_nano_patch4_16 trained 3 steps on three named classes, evaluated with SETTINGS."""
    root = tmp_path_factory.mktemp("run")
    data = write_image_folder(root / "data", classes=3, train=4, val=1, size=24)
    for c, name in enumerate(CLASSES):
        for split in ("train", "val"):
            (data / split / f"class{c}").rename(data / split / name)
    L.seed_everything(0)
    datamodule = ImageFolderDataModule(
        root=str(data), img_size=16, batch_size=4, num_workers=0, eval_crop_pct=0.875, mean=(0.5,) * 3, std=(0.25,) * 3
    )
    trainer = quiet_trainer(root, max_epochs=1, limit_train_batches=3, limit_val_batches=1)
    trainer.fit(ImageClassifier("vit_nano_patch4_16", optimizer={"lr": 3e-3}), datamodule)
    return root / "checkpoints" / "last.ckpt"


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> list[Path]:
    """Five images of other sizes and aspect ratios (the crop matters): four in a folder tree, one apart."""
    root = tmp_path_factory.mktemp("photos")
    rng = np.random.default_rng(1)
    paths = [root / "album" / "a.png", root / "album" / "b.jpg", root / "album" / "nested" / "c.png"]
    paths += [root / "album" / "nested" / "d.PNG", root / "e.png"]
    for i, path in enumerate(paths):
        height, width = 20 + 9 * i, 36 - 4 * i
        level = rng.uniform(40, 220)
        pixels = rng.normal(level, 25, (height, width, 3)) + np.linspace(-40, 40, width)[None, :, None]
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(path)
    return paths


def expected_probs(ckpt: Path, path: Path, settings: dict = SETTINGS) -> torch.Tensor:
    """The model's softmax on one image prepared by validation's transform with `settings`."""
    model, _ = load_checkpoint(ckpt)
    with torch.no_grad():
        return model(Preprocess.from_dict(settings)([read_rgb(path)])).softmax(-1)[0]


def read_csv(path: Path) -> tuple[list[str], list[list[str]]]:
    with open(path, newline="") as f:
        header, *rows = list(csv.reader(f))
    return header, rows


def test_the_csv_holds_the_models_softmax_on_validations_pixels_named_by_the_checkpoint(ckpt, photos, tmp_path, capsys):
    _, meta = load_checkpoint(ckpt)
    assert meta["class_names"] == CLASSES and meta["preprocess"] == SETTINGS  # what the run stored
    out = tmp_path / "preds.csv"
    # A batch of 2: the five images take three forward passes.
    predict.main(
        [str(ckpt), str(photos[0].parent), str(photos[4]), "--top-k", "3", "--out", str(out), "--batch-size", "2"]
    )
    header, rows = read_csv(out)
    assert header == ["path", "class_1", "prob_1", "class_2", "prob_2", "class_3", "prob_3"]
    # The folder's images, found recursively and sorted (d.PNG too), then the file given apart.
    assert [row[0] for row in rows] == [str(p) for p in photos]
    settings_matter = False
    for row, path in zip(rows, photos, strict=True):
        probs = expected_probs(ckpt, path)
        top = probs.topk(2)
        assert top.values[0] - top.values[1] > 1e-4  # no tie: the argmax is well defined
        assert row[1] == CLASSES[int(probs.argmax())]
        for name, prob in zip(row[1::2], row[2::2], strict=True):
            assert float(prob) == pytest.approx(float(probs[CLASSES.index(name)]), abs=1e-5)
        assert [float(p) for p in row[2::2]] == sorted((float(p) for p in row[2::2]), reverse=True)
        default = {"img_size": 16, "crop_pct": 1.0, "mean": IMAGENET_MEAN, "std": IMAGENET_STD}
        settings_matter |= bool((expected_probs(ckpt, path, default) - probs).abs().max() > 1e-3)
    assert settings_matter
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].split() == ["file", "top-1", "top-2", "top-3"]
    first = printed[1].split()
    assert (
        first[0] == str(photos[0])
        and first[1] == rows[0][1]
        and float(first[2]) == pytest.approx(float(rows[0][2]), abs=1e-3)
    )
    assert printed[-1] == f"wrote {out} (5 images, top 3)"


def test_json_holds_the_same_predictions_and_top_k_defaults_to_every_class_when_fewer_than_5(ckpt, photos, tmp_path):
    out = tmp_path / "preds.json"
    predictions = predict.main([str(ckpt), *map(str, photos[:2]), "--out", str(out)])
    saved = json.loads(out.read_text())
    assert [entry["path"] for entry in saved] == [str(p) for p in photos[:2]]
    for entry, prediction, path in zip(saved, predictions, photos[:2], strict=True):
        assert [p["class"] for p in entry["predictions"]] == [name for name, _ in prediction.top]
        assert sorted(p["class"] for p in entry["predictions"]) == sorted(CLASSES)  # top 3 of 3 classes
        probs = expected_probs(ckpt, path)
        for p in entry["predictions"]:
            assert p["prob"] == pytest.approx(float(probs[CLASSES.index(p["class"])]), abs=1e-5)


def test_the_safetensors_export_carries_the_settings_and_predicts_as_the_ckpt(ckpt, photos, tmp_path):
    weights = export_safetensors(ckpt, tmp_path / "model.safetensors")
    assert load_checkpoint(weights)[1]["preprocess"] == SETTINGS
    from_ckpt = predict.main([str(ckpt), *map(str, photos)])
    from_weights = predict.main([str(weights), *map(str, photos)])
    assert [(p.path, p.top) for p in from_weights] == [(p.path, p.top) for p in from_ckpt]


def test_the_onnx_export_carries_the_checkpoints_settings_and_predicts_as_it(ckpt, photos, tmp_path):
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    from vit.export import OnnxClassifier
    from vit.tools.export import main as export_main

    onnx_path = tmp_path / "model.onnx"
    export_main([str(ckpt), "--out", str(onnx_path)])
    onnx_model = OnnxClassifier(onnx_path)
    assert onnx_model.class_names == CLASSES and onnx_model.preprocess == Preprocess.from_dict(SETTINGS)
    from_ckpt = predict.main([str(ckpt), str(photos[0].parent), "--top-k", "3"])
    from_onnx = predict.main([str(onnx_path), str(photos[0].parent), "--top-k", "3"])
    assert [p.path for p in from_onnx] == [p.path for p in from_ckpt]
    for a, b in zip(from_ckpt, from_onnx, strict=True):
        assert [name for name, _ in a.top] == [name for name, _ in b.top]
        np.testing.assert_allclose([q for _, q in a.top], [q for _, q in b.top], atol=1e-5, rtol=0)


def run_cli(argv: list[str], monkeypatch, capsys) -> tuple[int, str]:
    """The installed command's exit status and stderr."""
    monkeypatch.setattr(sys, "argv", ["vit-predict", *argv])
    with pytest.raises(SystemExit) as exit_:
        predict.cli()
    return exit_.value.code, capsys.readouterr().err


def test_a_corrupt_image_is_named_or_with_skip_corrupt_left_out(ckpt, photos, tmp_path, monkeypatch, capsys):
    folder = tmp_path / "mixed"
    folder.mkdir()
    for path in photos[:2]:
        (folder / path.name).write_bytes(path.read_bytes())
    (folder / "broken.jpg").write_bytes(b"\xff\xd8\xff not a JPEG after all")
    code, err = run_cli([str(ckpt), str(folder)], monkeypatch, capsys)
    assert code == 1 and err.startswith(f"error: cannot decode image {folder / 'broken.jpg'}") and err.count("\n") == 1
    with pytest.raises(CorruptImageError, match=r"broken\.jpg"):
        predict.main([str(ckpt), str(folder)])

    out = tmp_path / "preds.csv"
    predictions = predict.main([str(ckpt), str(folder), "--skip-corrupt", "--out", str(out)])
    assert [p.path.name for p in predictions] == ["a.png", "b.jpg"]
    assert [Path(row[0]).name for row in read_csv(out)[1]] == ["a.png", "b.jpg"]
    err = capsys.readouterr().err
    assert f"skipped: cannot decode image {folder / 'broken.jpg'}" in err and "skipped 1 of 3 images" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["{ckpt}", "{photo}", "--top-k", "4"], "error: --top-k 4 is more than the 3 classes of {ckpt}"),
        (
            ["{ckpt}", "{photo}", "--out", "preds.txt"],
            "error: --out preds.txt: expected a file ending in .csv or .json",
        ),
        (["{photo}", "{photo}"], "error: CHECKPOINT {photo}: expected our .ckpt (or its .safetensors export) or a"),
        (["{ckpt}", "{missing}"], "error: image {missing} does not exist"),
        (["{ckpt}", "{empty}"], "error: no images (.jpg"),
    ],
    ids=["top-k", "out", "checkpoint", "missing image", "empty folder"],
)
def test_bad_input_is_one_line_naming_it_and_exit_status_1(ckpt, photos, tmp_path, monkeypatch, capsys, argv, message):
    (tmp_path / "empty").mkdir()
    names = {"ckpt": ckpt, "photo": photos[0], "missing": tmp_path / "nowhere.png", "empty": tmp_path / "empty"}
    code, err = run_cli([a.format(**names) for a in argv], monkeypatch, capsys)
    assert code == 1 and err.startswith(message.format(**names)) and err.count("\n") == 1, err


def test_a_full_disk_keeps_the_previous_predictions_and_names_the_file(
    ckpt, photos, tmp_path, monkeypatch, capsys, file_size_limit
):
    """--out was written in place: a full disk left a CSV cut mid-row (or, fresh, a partial file) and an
    error naming no file."""
    import resource

    out = tmp_path / "preds.csv"
    predict.main([str(ckpt), *map(str, photos), "--out", str(out)])
    previous = out.read_bytes()
    assert len(previous) > 200
    resource.setrlimit(resource.RLIMIT_FSIZE, (200, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))  # fills mid-file
    for path in (out, tmp_path / "fresh.json"):
        code, err = run_cli([str(ckpt), *map(str, photos), "--out", str(path)], monkeypatch, capsys)
        assert code == 1 and err.count("\n") == 1 and f"could not write {path}: File too large" in err, err
    assert out.read_bytes() == previous
    assert sorted(p.name for p in tmp_path.iterdir()) == ["preds.csv"]  # no partial or temporary file


def test_broken_and_looping_links_in_a_folder_are_named_as_unreadable_images(
    ckpt, photos, tmp_path, monkeypatch, capsys
):
    """The folder's scan left them out unsaid; given by name they were an error naming them."""
    folder = tmp_path / "album"
    folder.mkdir()
    for path in photos[:2]:
        (folder / path.name).write_bytes(path.read_bytes())
    (folder / "gone.png").symlink_to(tmp_path / "nowhere.png")
    (folder / "loop.jpg").symlink_to(folder / "loop.jpg")
    code, err = run_cli([str(ckpt), str(folder)], monkeypatch, capsys)
    assert code == 1 and err.count("\n") == 1, err
    assert err.startswith(f"error: cannot read image {folder / 'gone.png'}: it is a broken symlink")

    predictions = predict.main([str(ckpt), str(folder), "--skip-corrupt"])
    assert [p.path.name for p in predictions] == ["a.png", "b.jpg"]
    err = capsys.readouterr().err
    assert f"skipped: cannot read image {folder / 'gone.png'}" in err and f"image {folder / 'loop.jpg'}" in err
    assert "skipped 2 of 4 images" in err
