"""Weights from timm are fine-tuned with their own preprocessing (timm's pretrained config: mean,
std, evaluation crop), which the checkpoint records for prediction and export; what the user gave
the data wins, said in one line."""

from __future__ import annotations

import json

import pytest
import timm
import torch
from safetensors.torch import save_file

from tests.conftest import ROOT, write_image_folder
from vit.checkpoint import timm_preprocessing
from vit.cli import main

CLIP_MEAN, CLIP_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


@pytest.mark.parametrize(
    ("source", "model", "mean", "std", "crop_pct"),
    [
        ("timm:vit_base_patch16_siglip_224.webli", "vit_base_patch16_siglip_224", (0.5,) * 3, (0.5,) * 3, 0.9),
        ("timm:eva02_small_patch14_224.mim_in22k", "eva02_small_patch14_224", CLIP_MEAN, CLIP_STD, 0.9),
        ("timm:vit_base_patch16_clip_224.openai", "vit_base_patch16_clip_224", CLIP_MEAN, CLIP_STD, 0.9),
        ("timm:vit_small_patch16_dinov3.lvd1689m", "vit_small_patch16_dinov3", IMAGENET_MEAN, IMAGENET_STD, 1.0),
        ("weights/eva/model.safetensors", "eva02_small_patch14_224", CLIP_MEAN, CLIP_STD, 0.9),  # default tag's
    ],
)  # fmt: skip
def test_each_tags_preprocessing_is_timms_pretrained_config(source, model, mean, std, crop_pct):
    values, where = timm_preprocessing(source, model)
    assert (values["mean"], values["std"], values["crop_pct"]) == (mean, std, crop_pct)
    assert where.startswith(f"timm's pretrained config of {model}.")


def test_weights_that_are_not_timms_have_none(tmp_path):
    assert timm_preprocessing(tmp_path / "last.ckpt", "vit_tiny_patch16_224") is None  # ours record their own
    assert timm_preprocessing(tmp_path / "w.pth", "vit_nano_patch4_16") is None  # no timm name


def test_the_hubs_config_beside_a_file_is_read_first(tmp_path):
    config = {"architecture": "vit_tiny_patch16_224", "pretrained_cfg": {"mean": [0.1, 0.2, 0.3], "std": [1, 1, 1],
              "crop_pct": 0.8, "interpolation": "bicubic", "input_size": [3, 224, 224]}}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    values, where = timm_preprocessing(tmp_path / "model.safetensors", "vit_tiny_patch16_224")
    assert values["mean"] == [0.1, 0.2, 0.3] and values["crop_pct"] == 0.8 and where == str(tmp_path / "config.json")


def _fine_tune(tmp_path, *options: str):
    """vit_tiny_patch16_224 from a timm-format file (its default tag: augreg, mean and std 0.5) on a
    folder of class folders at 32 px, two steps."""
    write_image_folder(tmp_path / "data", classes=2, train=6, val=1)
    weights = tmp_path / "weights" / "model.safetensors"
    weights.parent.mkdir()
    save_file(timm.create_model("vit_tiny_patch16_224", num_classes=0).state_dict(), weights)
    return main(["fit", "--config", str(ROOT / "configs/default.yaml"), "--data", "vit.data.ImageFolderDataModule",
                 "--data.root", str(tmp_path / "data"), "--data.img_size", "32", "--data.batch_size", "4",
                 "--data.num_workers", "0", "--model.model_name", "vit_tiny_patch16_224",
                 "--model.finetune.init_from", str(weights), "--trainer.max_steps", "2", "--trainer.logger", "false",
                 "--trainer.default_root_dir", str(tmp_path / "run"), *options])  # fmt: skip


def test_a_fine_tune_of_timm_weights_uses_and_records_their_preprocessing(tmp_path, caplog):
    cli = _fine_tune(tmp_path)
    data = cli.datamodule
    assert (tuple(data.mean), tuple(data.std), data.eval_crop_pct) == ((0.5,) * 3, (0.5,) * 3, 0.9)
    saved = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)["vit"]["preprocess"]
    assert (saved["mean"], saved["std"], saved["crop_pct"]) == ([0.5] * 3, [0.5] * 3, 0.9)
    said = [m for m in caplog.messages if m.startswith("the weights' preprocessing")]
    assert said == ["the weights' preprocessing (timm's pretrained config of vit_tiny_patch16_224."
                    "augreg_in21k_ft_in1k): mean [0.5, 0.5, 0.5], std [0.5, 0.5, 0.5], eval_crop_pct 0.9"]  # fmt: skip


def test_the_datas_own_mean_wins_and_both_are_named(tmp_path, caplog):
    cli = _fine_tune(tmp_path, "--data.mean", "[0.4, 0.4, 0.4]")
    assert tuple(cli.datamodule.mean) == (0.4, 0.4, 0.4) and tuple(cli.datamodule.std) == (0.5,) * 3
    assert "--data.mean [0.4, 0.4, 0.4] is used, not [0.5, 0.5, 0.5] of timm's pretrained config of " \
           "vit_tiny_patch16_224.augreg_in21k_ft_in1k" in caplog.messages  # fmt: skip
