"""Prediction (`trainer.predict`, `scripts/train.py predict`) and a run's EMA weights as the
checkpoint readers, the exports and `vit-predict --ema` give them."""

from __future__ import annotations

import copy
import sys

import lightning as L
import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from tests.conftest import quiet_trainer
from vit.checkpoint import Preprocess, export_safetensors, load_checkpoint, load_model
from vit.data import DigitsDataModule
from vit.data.images import read_rgb
from vit.lit import ImageClassifier
from vit.tools import predict


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[ImageClassifier, DigitsDataModule, L.Trainer]:
    """vit_nano on the digits for 12 steps with an EMA of decay 0.5 (far from the raw weights)."""
    L.seed_everything(0)
    module = ImageClassifier("vit_nano_patch4_16", num_classes=10, ema_decay=0.5, optimizer={"lr": 2e-3})
    data = DigitsDataModule(batch_size=64, num_workers=0)
    trainer = quiet_trainer(tmp_path_factory.mktemp("run"), max_steps=12, limit_val_batches=1)
    trainer.fit(module, data)
    return module, data, trainer


def test_prediction_gives_each_validation_image_the_probabilities_validation_scores(trained, tmp_path):
    """predict_dataloader is the validation split in order; each row is a softmax over the classes;
    their argmax scores the accuracy `validate` reports on the whole split (no EMA in either)."""
    module, data, _ = trained
    trainer = quiet_trainer(tmp_path)
    probabilities = torch.cat(trainer.predict(module, datamodule=data))
    assert probabilities.shape == (360, 10)  # the 20% of the 1,797 digits held out
    torch.testing.assert_close(probabilities.sum(1), torch.ones(360))
    labels = torch.cat([y for _, y in data.val_dataloader()])
    accuracy = (probabilities.argmax(1) == labels).float().mean().item()
    (scores,) = trainer.validate(module, datamodule=data, verbose=False)
    assert accuracy == pytest.approx(scores["val/acc1"], abs=1e-6)


def test_the_ema_weights_load_and_export_apart_from_the_trained_ones(trained, tmp_path):
    module, _, trainer = trained
    ckpt = tmp_path / "run.ckpt"
    trainer.save_checkpoint(ckpt)
    ema = {k.removeprefix("module."): v for k, v in module.ema.state_dict().items() if k.startswith("module.")}
    raw = module.model.state_dict()
    assert any(not torch.equal(ema[name], raw[name]) for name in raw)  # decay 0.5: the average lags
    for use_ema, expected in ((True, ema), (False, raw)):
        model, _ = load_checkpoint(ckpt, use_ema=use_ema)
        assert all(torch.equal(model.state_dict()[name], expected[name]) for name in raw)
        exported = load_file(str(export_safetensors(ckpt, tmp_path / f"ema{use_ema}.safetensors", use_ema=use_ema)))
        assert all(torch.equal(exported[name], expected[name]) for name in raw)
        assert all(torch.equal(load_model(ckpt, use_ema=use_ema).state_dict()[n], expected[n]) for n in raw)


def test_vit_predict_ema_gives_the_averaged_weights_softmax_and_names_a_file_without_them(
    trained, tmp_path, capsys, monkeypatch
):
    """`vit-predict --ema`: the EMA model's softmax on validation's pixels, not the trained weights';
    a checkpoint whose run kept no average, and an export (one set of weights), are refused by name."""
    module, data, trainer = trained
    ckpt = tmp_path / "run.ckpt"
    trainer.save_checkpoint(ckpt)
    photo = tmp_path / "digit.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (20, 14, 3), dtype=np.uint8)).save(photo)
    pixels = Preprocess.of(data)([read_rgb(photo)])  # what the run's validation fed the model
    assert load_checkpoint(ckpt)[1]["preprocess"] == Preprocess.of(data).to_dict()
    with torch.no_grad():
        ema_probs = copy.deepcopy(module.ema.module).cpu().eval()(pixels).softmax(-1)[0]
        raw_probs = copy.deepcopy(module.model).cpu().eval()(pixels).softmax(-1)[0]
    assert (ema_probs - raw_probs).abs().max() > 1e-3  # decay 0.5: the two models differ on this image

    for argv, expected in ((["--ema"], ema_probs), ([], raw_probs)):
        (prediction,) = predict.main([str(ckpt), str(photo), "--top-k", "10", "--device", "cpu", *argv])
        got = {int(name): prob for name, prob in prediction.top}  # the digits' classes are named 0-9
        torch.testing.assert_close(torch.tensor([got[c] for c in range(10)]), expected, atol=1e-5, rtol=0)

    checkpoint = torch.load(ckpt, weights_only=True)
    checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if not k.startswith("ema.")}
    torch.save(checkpoint, tmp_path / "no_ema.ckpt")
    weights = export_safetensors(ckpt, tmp_path / "model.safetensors", use_ema=True)
    for path, message in (
        (tmp_path / "no_ema.ckpt", f"error: {tmp_path / 'no_ema.ckpt'} has no EMA weights"),
        (weights, f"error: --ema: {weights} holds one set of weights; give the run's .ckpt"),
    ):
        monkeypatch.setattr(sys, "argv", ["vit-predict", str(path), str(photo), "--ema"])
        with pytest.raises(SystemExit) as stop:
            predict.cli()
        err = capsys.readouterr().err
        assert stop.value.code == 1 and err.startswith(message) and err.count("\n") == 1, err
