"""Weights files the commands and training cannot use: an empty or truncated .safetensors, and the
weights of another architecture, end `vit-predict`, `vit-export` and `--model.finetune.init_from`
with one line naming the file (and, for a mismatch, both models), not safetensors' error or a list
of keys that names neither."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.conftest import write_image
from vit import create_model
from vit.tools import export, predict


def write_safetensors(path: Path, name: str, **kwargs) -> Path:
    """A model's weights as export_safetensors writes them: its name and kwargs in the metadata."""
    state_dict = create_model(name, **kwargs).state_dict()
    metadata = {"vit_model_name": name, "vit_model_kwargs": json.dumps(kwargs)}
    save_file({k: v.contiguous() for k, v in state_dict.items()}, str(path), metadata=metadata)
    return path


def run(command, argv: list[str], monkeypatch, capsys) -> tuple[int, str]:
    """An installed command's exit status and stderr."""
    monkeypatch.setattr(sys, "argv", ["vit-command", *argv])
    with pytest.raises(SystemExit) as stop:
        command.cli()
    return stop.value.code, capsys.readouterr().err


def train(argv: list[str], root: Path, capsys) -> tuple[int, str]:
    """scripts/train.py's exit status and its last line on stderr, with the default config for an epoch."""
    from vit.cli import main

    with pytest.raises(SystemExit) as stop:
        main(["fit", "--config", "configs/default.yaml", "--trainer.max_epochs", "1", "--trainer.logger", "false",
              "--trainer.default_root_dir", str(root), *argv])  # fmt: skip
    return stop.value.code, capsys.readouterr().err.strip().splitlines()[-1]


@pytest.fixture
def broken(tmp_path) -> list[Path]:
    """An empty .safetensors, and one cut after its first 1,000 bytes (as a full disk leaves it)."""
    whole = write_safetensors(tmp_path / "whole.safetensors", "vit_nano_patch4_16", num_classes=3)
    (tmp_path / "empty.safetensors").write_bytes(b"")
    (tmp_path / "cut.safetensors").write_bytes(whole.read_bytes()[:1000])
    return [tmp_path / "empty.safetensors", tmp_path / "cut.safetensors"]


def test_an_empty_or_truncated_safetensors_is_one_line_naming_it(broken, tmp_path, monkeypatch, capsys):
    image, out = tmp_path / "a.png", tmp_path / "x.onnx"
    write_image(image)
    for path in broken:
        expected = f"error: cannot read {path} ({path.stat().st_size} bytes): it is not a readable safetensors file"
        for command, argv in ((predict, [str(path), str(image)]), (export, [str(path), "--out", str(out)])):
            code, err = run(command, argv, monkeypatch, capsys)
            assert code == 1 and err.startswith(expected) and err.count("\n") == 1, err
        code, last = train(["--model.finetune.init_from", str(path)], tmp_path / "run", capsys)
        assert code == 1 and last.startswith(expected), last
    assert not out.exists()


def test_weights_of_another_architecture_name_the_file_and_both_models(tmp_path, monkeypatch, capsys):
    nano = write_safetensors(tmp_path / "nano.safetensors", "vit_nano_patch4_16", num_classes=3)
    code, err = run(export, [str(nano), "--model", "vit_tiny_patch16_224"], monkeypatch, capsys)
    assert code == 1 and err.count("\n") == 1, err
    assert err.startswith(
        f"error: {nano} (weights of vit_nano_patch4_16) does not fit vit_tiny_patch16_224 (VisionTransformer, "
        "embed_dim 192, depth 12): 96 of the model's keys missing (blocks.4.attn.proj.bias, "
        "blocks.4.attn.proj.weight, blocks.4.attn.qkv.bias, ...); only the position embedding and the head are adapted"
    )

    # Training's model (the default config's vit_nano_patch4_16, depth 4) from a two-block ViT-Tiny's weights.
    tiny = write_safetensors(tmp_path / "tiny.safetensors", "vit_tiny_patch16_224", depth=2)
    code, last = train(["--model.finetune.init_from", str(tiny)], tmp_path / "run", capsys)
    assert code == 1 and last.startswith(
        f"error: {tiny} (weights of vit_tiny_patch16_224) does not fit the model (VisionTransformer, embed_dim 128, "
        "depth 4): 24 of the model's keys missing (blocks.2.attn.proj.bias, blocks.2.attn.proj.weight, "
        "blocks.2.attn.qkv.bias, ...)"
    ), last
    # A plain state dict records no architecture.
    plain = tmp_path / "plain.pth"
    torch.save(create_model("vit_tiny_patch16_224", depth=2).state_dict(), plain)
    code, last = train(["--model.finetune.init_from", str(plain)], tmp_path / "run", capsys)
    assert code == 1 and last.startswith(f"error: {plain} does not fit the model (VisionTransformer, embed_dim 128,")
