"""The study scripts run end to end on real data (a couple of batches) and write their tables."""

from __future__ import annotations

import re

import torch

from scripts import compare, finetune_study
from tests.conftest import shared_path
from vit import create_model


def test_vit_vs_resnet_comparison_writes_a_row_per_model(tmp_path):
    root = shared_path("data/cifar10")
    out = tmp_path / "table.md"
    results = compare.main([
        "--data-root", str(root), "--val-dir", "test", "--epochs", "1", "--limit-batches", "2",
        "--batch-size", "8", "--num-workers", "0", "--workdir", str(tmp_path / "runs"), "--out", str(out),
        "--models", "vit=configs/cifar10_vit.yaml", "resnet20=configs/cifar10_resnet.yaml",
    ])  # fmt: skip
    assert [r.model_name for r in results] == ["vit_micro_patch4_32", "resnet20"]
    table = out.read_text()
    assert re.search(r"\| vit \| `vit_micro_patch4_32` \| 2\.\d\dM \| 1 \|", table)
    assert re.search(r"\| resnet20 \| `resnet20` \| 0\.27M \| 1 \|", table)


def test_finetune_study_runs_every_row_and_reports_the_jpeg_recovery(tmp_path):
    root = shared_path("data/cifar10")
    shared_path("weights/resnet56-4bfd9763.th")
    pretrained = create_model("vit_micro_patch8_64", num_classes=200)
    torch.save(pretrained.state_dict(), tmp_path / "tiny.pth")
    out = tmp_path / "finetune.md"
    rows = finetune_study.main([
        "--vit-checkpoint", str(tmp_path / "tiny.pth"), "--cifar-root", str(root), "--epochs", "1",
        "--limit-batches", "2", "--num-workers", "0", "--workdir", str(tmp_path / "runs"), "--out", str(out),
    ])  # fmt: skip
    assert [r.setting for r in rows] == [
        "from scratch", "fine-tuned, layer decay 0.75", "fine-tuned, no layer decay",
        "linear probe (frozen backbone)", "checkpoint as is (no training)", "fine-tuned on the JPEG train split",
    ]  # fmt: skip
    assert rows[4].top1 > 50  # two batches of the real checkpoint on JPEG test images: well above chance
    assert "of the loss." in out.read_text()
