"""Fine-tuning timm's EVA-family backbones (DINOv3, EVA-02) from a timm-format .safetensors file through
`scripts/train.py fit`, at another image size and class count: the file's weights are what training
starts from, the head is new, the positions follow the new grid as timm's do, and the run trains."""

from __future__ import annotations

import copy
import json
import logging
import math
from pathlib import Path
from typing import Any

import pytest
import timm
import torch
from safetensors.torch import save_file

import vit.lit
from tests.conftest import ROOT, write_image_folder
from vit.checkpoint import load_pretrained
from vit.cli import main

# timm's architecture at a CPU test's size: head_dim 32 (RoPE needs a multiple of 4).
SMALL = dict(depth=2, embed_dim=64, num_heads=2)
QUIET = ["--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]


def timm_file(tmp_path: Path, name: str, **kwargs: Any) -> tuple[Path, dict[str, torch.Tensor]]:
    """A random timm model saved as timm's releases are (model.safetensors, timm's key names), with
    every parameter moved off its init so that each tensor is distinct."""
    model = timm.create_model(name, pretrained=False, **SMALL, **kwargs)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    state_dict = {k: v.contiguous() for k, v in model.state_dict().items()}
    path = tmp_path / f"{name}.safetensors"
    save_file(state_dict, str(path))
    return path, state_dict


@pytest.fixture
def loaded(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The model as init_from left it (a copy, before any training step) and the load report."""
    seen: dict[str, Any] = {}

    def recording(model: torch.nn.Module, source: str, **kwargs: Any):
        report = load_pretrained(model, source, **kwargs)
        seen.update(model=copy.deepcopy(model).eval(), report=report)
        return report

    monkeypatch.setattr(vit.lit, "load_pretrained", recording)
    return seen


def finetune(tmp_path: Path, name: str, source: Path, img_size: int, *extra: str):
    """configs/finetune/dinov3_s16_folder.yaml (layer decay 0.75) for one epoch of two training steps and
    a validation batch: `name` from `source` on a 3-class image folder at `img_size`."""
    data = write_image_folder(tmp_path / "data", classes=3, train=4, val=2, size=32)
    return main([
        "fit", "--config", str(ROOT / "configs/finetune/dinov3_s16_folder.yaml"),
        "--trainer.default_root_dir", str(tmp_path / "run"), *QUIET, "--trainer.logger", "false",
        "--trainer.precision", "32-true", "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "2",
        "--trainer.limit_val_batches", "1", "--model.schedule.warmup_epochs", "0",
        "--data.root", str(data), "--data.img_size", str(img_size),
        "--data.batch_size", "4", "--data.num_workers", "0", "--model.model_name", name,
        "--model.model_kwargs", json.dumps(SMALL), "--model.finetune.init_from", str(source), *extra,
    ])  # fmt: skip


def features(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.forward_head(model.forward_features(x), pre_logits=True)


def test_dinov3_from_a_timm_file_at_a_new_size_and_class_count(tmp_path, loaded, caplog):
    """timm's DINOv3 files have no head (num_classes 0) and no pos_embed: a 3-class head is added, and
    the rotary tables of the 2x2 grid at 32 px replace the 4x4 grid's at 64 px with nothing loaded.
    Layer decay and freezing the first block work on its registers and blocks as on a ViT's."""
    source, timm_sd = timm_file(tmp_path, "vit_small_patch16_dinov3", img_size=64, num_classes=0)
    assert "pos_embed" not in timm_sd and "reg_token" in timm_sd
    with caplog.at_level(logging.INFO, logger="vit"):
        cli = finetune(tmp_path, "vit_small_patch16_dinov3", source, 32, "--model.finetune.freeze_blocks", "1")

    start, report = loaded["model"], loaded["report"]
    assert report.resampled == [] and report.reinitialised == ["head.weight", "head.bias"]
    assert "no pos_embed to resample: the rotary tables follow the patch grid (2x2)" in caplog.text
    weights = start.state_dict()
    assert all(torch.equal(weights[k], v) for k, v in timm_sd.items()), "a backbone tensor differs from the file's"
    assert start.head.weight.shape == (3, 64)
    theirs = timm.create_model("vit_small_patch16_dinov3", pretrained=False, **SMALL, img_size=32, num_classes=0)
    theirs.load_state_dict(timm_sd, strict=True)
    x = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(features(start, x), features(theirs.eval(), x), atol=1e-5, rtol=0)

    assert cli.trainer.global_step == 2
    assert all(math.isfinite(cli.trainer.callback_metrics[k]) for k in ("train/loss", "val/loss"))
    trained = cli.model.model.state_dict()
    frozen = [k for k in timm_sd if k.startswith(("patch_embed.", "cls_token", "reg_token", "blocks.0."))]
    assert len(frozen) > 10 and all(torch.equal(trained[k], timm_sd[k]) for k in frozen)
    assert not torch.equal(trained["blocks.1.attn.qkv.weight"], timm_sd["blocks.1.attn.qkv.weight"])

    names = {id(p): n for n, p in cli.model.model.named_parameters()}
    lrs = {names[id(p)]: g["lr"] for g in cli.model.param_groups(1.0) for p in g["params"]}
    assert not any(name in lrs for name in frozen)
    assert lrs["blocks.1.attn.qkv.weight"] == 0.75 and lrs["head.weight"] == 1.0  # decay^(depth + 1 - (1 + 1))


def test_eva02_from_a_timm_file_at_a_new_size_and_class_count(tmp_path, loaded, caplog):
    """EVA-02 has a learned pos_embed beside its rotary one: the pos_embed is resampled from 4x4 to
    2x2 (timm's resample_abs_pos_embed), the rotary tables follow the grid, the 5-class head becomes a
    3-class one, and every other tensor is the file's."""
    source, timm_sd = timm_file(tmp_path, "eva02_tiny_patch14_224", img_size=56, num_classes=5)
    with caplog.at_level(logging.INFO, logger="vit"):
        cli = finetune(tmp_path, "eva02_tiny_patch14_224", source, 28)

    start, report = loaded["model"], loaded["report"]
    assert report.resampled == ["pos_embed (grid 4x4 -> 2x2)"]
    assert sorted(report.reinitialised) == ["head.bias", "head.weight"]
    assert "the rotary tables follow the patch grid (2x2)" in caplog.text and "no pos_embed" not in caplog.text
    weights = start.state_dict()
    kept = [k for k in timm_sd if k not in ("pos_embed", "head.weight", "head.bias")]
    assert len(kept) > 20 and all(torch.equal(weights[k], timm_sd[k]) for k in kept)
    expected = timm.layers.resample_abs_pos_embed(timm_sd["pos_embed"], (2, 2), (4, 4), num_prefix_tokens=1)
    torch.testing.assert_close(weights["pos_embed"], expected)
    assert start.head.weight.shape == (3, 64)
    theirs = timm.create_model("eva02_tiny_patch14_224", pretrained=False, **SMALL, img_size=28, num_classes=5)
    theirs.load_state_dict(timm.models.eva.checkpoint_filter_fn(timm_sd, theirs), strict=True)
    x = torch.randn(2, 3, 28, 28)
    torch.testing.assert_close(features(start, x), features(theirs.eval(), x), atol=1e-5, rtol=0)

    assert cli.trainer.global_step == 2
    assert all(math.isfinite(cli.trainer.callback_metrics[k]) for k in ("train/loss", "val/loss"))
    trained = cli.model.model.state_dict()
    assert cli.model.model.head.out_features == 3
    assert not torch.equal(trained["blocks.0.attn.qkv.weight"], timm_sd["blocks.0.attn.qkv.weight"])
