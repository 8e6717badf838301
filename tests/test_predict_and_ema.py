"""Prediction (`trainer.predict`, `scripts/train.py predict`) and a run's EMA weights as the
checkpoint readers and the exports give them."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import quiet_trainer
from vit.checkpoint import export_safetensors, load_checkpoint, load_model
from vit.data import DigitsDataModule
from vit.lit import ImageClassifier


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
