"""Loading pretrained weights: every source, adaptation to a new grid / head / pooling, clear
refusals, and the fine-tuning recipe (layer decay, head lr, freezing)."""

from __future__ import annotations

import logging

import lightning as L
import numpy as np
import pytest
import timm
import torch
from safetensors.torch import save_file

from tests.conftest import quiet_trainer
from vit import create_model
from vit.checkpoint import (
    adapt_state_dict,
    export_safetensors,
    load_model,
    load_pretrained,
    read_state_dict,
    read_weights,
)
from vit.data import DigitsDataModule
from vit.lit import ImageClassifier
from vit.training import param_groups


def _timm_state_dict(name: str = "vit_tiny_patch16_224", **kwargs) -> dict[str, torch.Tensor]:
    model = timm.create_model(name, pretrained=False, **kwargs)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # not at init: every tensor is distinct
    return model.state_dict()


def test_timm_state_dict_from_disk_is_adapted_to_32px_and_10_classes(tmp_path, caplog):
    timm_sd = _timm_state_dict()
    torch.save(timm_sd, tmp_path / "vit_tiny.pth")
    model = create_model("vit_tiny_patch16_224", img_size=32, num_classes=10)
    with caplog.at_level(logging.INFO, logger="vit"):
        report = load_pretrained(model, tmp_path / "vit_tiny.pth")
    assert report.resampled == ["pos_embed (grid 14x14 -> 2x2)"]
    assert report.reinitialised == ["head.weight", "head.bias"]
    assert "head.weight" in caplog.text and "pos_embed (grid 14x14 -> 2x2)" in caplog.text
    ours = model.state_dict()
    for name, value in timm_sd.items():
        if name not in ("pos_embed", "head.weight", "head.bias"):
            assert torch.equal(ours[name], value), name
    expected_pos = timm.layers.resample_abs_pos_embed(timm_sd["pos_embed"], (2, 2), (14, 14), num_prefix_tokens=1)
    torch.testing.assert_close(ours["pos_embed"], expected_pos)


def test_fine_tuning_a_timm_checkpoint_starts_from_its_weights_and_trains_them(tmp_path):
    """init_from a timm safetensors file, at 32 px and 10 classes (the digits'): training starts from
    timm's weights (every tensor but the resampled pos_embed and the new head), and 4 steps change them."""
    timm_sd = _timm_state_dict()
    save_file(timm_sd, str(tmp_path / "vit_tiny.safetensors"))
    module = ImageClassifier(
        "vit_tiny_patch16_224",
        {"img_size": 32},
        finetune={"init_from": str(tmp_path / "vit_tiny.safetensors")},
        optimizer={"lr": 3e-4},
    )
    assert module.model is None  # num_classes comes from the datamodule: the model is built in fit

    class AtStart(L.Callback):
        def on_train_start(self, trainer, pl_module):
            self.weights = {k: v.clone() for k, v in pl_module.model.state_dict().items()}

    start = AtStart()
    trainer = quiet_trainer(tmp_path, max_epochs=1, limit_train_batches=4, limit_val_batches=2, callbacks=[start])
    trainer.fit(module, DigitsDataModule(img_size=32, batch_size=32, num_workers=0))
    assert trainer.global_step == 4 and module.model.head.out_features == 10
    kept = [name for name in timm_sd if name not in ("pos_embed", "head.weight", "head.bias")]
    assert all(torch.equal(start.weights[name], timm_sd[name]) for name in kept)
    trained = module.model.state_dict()
    assert all(not torch.equal(trained[name], timm_sd[name]) for name in kept if name.endswith("qkv.weight"))


def test_our_checkpoint_by_path_and_as_safetensors(tmp_path):
    module = ImageClassifier("vit_nano_patch4_16", num_classes=10)
    trainer = quiet_trainer(tmp_path, max_epochs=1, limit_train_batches=2, limit_val_batches=1)
    trainer.fit(module, DigitsDataModule(batch_size=32, num_workers=0))
    ckpt = tmp_path / "checkpoints" / "last.ckpt"

    fresh = create_model("vit_nano_patch4_16", num_classes=10)
    report = load_pretrained(fresh, ckpt)
    assert report.resampled == report.reinitialised == report.dropped == []
    for name, value in module.model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], value), name

    exported = export_safetensors(ckpt, tmp_path / "model.safetensors")
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(load_model(exported)(x), load_model(ckpt)(x))


def test_load_model_builds_a_timm_format_file_given_the_architecture(tmp_path):
    """The class count comes from the file's head; without the architecture the error says what to give."""
    state_dict = _timm_state_dict("vit_tiny_patch16_224", depth=2, num_classes=7)
    torch.save(state_dict, tmp_path / "weights.pth")
    model = load_model(tmp_path / "weights.pth", model_name="vit_tiny_patch16_224", depth=2)
    assert not model.training and model.head.out_features == 7
    for name, value in state_dict.items():
        assert torch.equal(model.state_dict()[name], value), name
    with pytest.raises(ValueError, match="give the architecture"):
        load_model(tmp_path / "weights.pth")


def test_a_new_class_count_from_our_checkpoint_via_init_from(tmp_path):
    module = ImageClassifier("vit_nano_patch4_16", num_classes=10)
    quiet_trainer(tmp_path, max_steps=1).fit(module, DigitsDataModule(batch_size=32, num_workers=0))
    finetune = ImageClassifier(
        "vit_nano_patch4_16", num_classes=4, finetune={"init_from": str(tmp_path / "checkpoints/last.ckpt")}
    )
    assert finetune.model.head.out_features == 4
    assert torch.equal(finetune.model.blocks[3].mlp.fc2.weight, module.model.blocks[3].mlp.fc2.weight)


def test_switching_cls_pooling_to_average_pooling(tmp_path):
    timm_sd = _timm_state_dict()
    model = create_model("vit_tiny_patch16_224", global_pool="avg", class_token=False, num_classes=1000)
    adapted, report = adapt_state_dict(timm_sd, model)
    assert report.dropped == ["cls_token", "pos_embed[CLS]"]
    assert report.renamed == ["norm.weight -> fc_norm.weight", "norm.bias -> fc_norm.bias"]
    assert torch.equal(adapted["pos_embed"], timm_sd["pos_embed"][:, 1:])
    model.load_state_dict(adapted, strict=True)
    assert model(torch.randn(1, 3, 224, 224)).shape == (1, 1000)

    back = create_model("vit_tiny_patch16_224")
    adapted, report = adapt_state_dict(model.state_dict(), back)
    assert report.reinitialised == ["cls_token", "pos_embed[CLS] (zeros: the checkpoint has no CLS position)"]
    assert torch.equal(adapted["pos_embed"][:, 0], torch.zeros(1, 192))


def test_mismatches_that_cannot_be_adapted_are_errors_naming_key_and_shapes(tmp_path):
    small = _timm_state_dict("vit_small_patch16_224")
    message = r"cls_token: the checkpoint has shape \(1, 1, 384\), the model \(1, 1, 192\); pos_embed: .* more\)"
    with pytest.raises(ValueError, match=message):
        load_pretrained(create_model("vit_tiny_patch16_224"), _save(small, tmp_path / "small.pth"))
    shallow = create_model("vit_tiny_patch16_224", depth=2)
    keys = r"120 keys the model does not have \(blocks\.2\.attn\.proj\.bias, [^,]*, [^,]*, \.\.\.\)"  # three
    with pytest.raises(ValueError, match=keys):
        adapt_state_dict(_timm_state_dict(), shallow)


def _save(state_dict: dict, path) -> str:
    torch.save(state_dict, path)
    return str(path)


class NotATensor:
    pass


def test_pickled_objects_are_refused_with_the_reason_and_a_way_out(tmp_path):
    path = tmp_path / "suspicious.pth"
    torch.save({"state_dict": {"w": torch.zeros(1)}, "extra": NotATensor()}, path)
    with pytest.raises(ValueError, match=r"refusing to load .*suspicious\.pth.*arbitrary code.*convert it once"):
        read_state_dict(path)
    with pytest.raises(FileNotFoundError, match=r"nope\.pth does not exist; init_from takes"):
        read_weights(tmp_path / "nope.pth")


def test_timm_name_offline_says_how_to_pass_a_file(monkeypatch):
    """Offline (the hub's own switch, read at import time, so set on its constants), a timm: name
    fails at once with the hub's offline error as the cause and the way to pass a local file."""
    from huggingface_hub import constants
    from huggingface_hub.errors import OfflineModeIsEnabled

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    pattern = r"could not get timm's pretrained weights.*--model\.finetune\.init_from /path"
    with pytest.raises(RuntimeError, match=pattern) as e:
        read_weights("timm:vit_tiny_patch16_224.augreg_in21k")
    cause = e.value.__cause__
    while cause is not None and not isinstance(cause, OfflineModeIsEnabled):
        cause = cause.__cause__ or cause.__context__
    assert isinstance(cause, OfflineModeIsEnabled), f"not the offline error: {e.value.__cause__!r}"


def test_the_cli_prints_that_advice_not_the_network_error_beneath_it(monkeypatch, tmp_path, capsys):
    """scripts/train.py printed only the innermost error ("offline mode is enabled", or "Name or
    service not known"), losing how to pass a local file."""
    from huggingface_hub import constants

    from vit.cli import main

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(SystemExit) as stop:
        main(["fit", "--config", "configs/default.yaml", "--trainer.default_root_dir", str(tmp_path),
              "--model.finetune.init_from", "timm:vit_tiny_patch16_224.augreg_in21k"])  # fmt: skip
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert stop.value.code == 1 and last.startswith("error: could not get timm's pretrained weights")
    assert last.endswith("--model.finetune.init_from /path/to/model.safetensors")


def _to_google_npz(model: torch.nn.Module, path) -> None:
    """Write a timm ViT in the layout of Google's original ViT .npz checkpoints."""
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    heads, dim = model.blocks[0].attn.num_heads, model.embed_dim
    w = {
        "embedding/kernel": sd["patch_embed.proj.weight"].transpose(2, 3, 1, 0),
        "embedding/bias": sd["patch_embed.proj.bias"],
        "cls": sd["cls_token"],
        "Transformer/posembed_input/pos_embedding": sd["pos_embed"],
        "Transformer/encoder_norm/scale": sd["norm.weight"],
        "Transformer/encoder_norm/bias": sd["norm.bias"],
        "head/kernel": sd["head.weight"].T,
        "head/bias": sd["head.bias"],
    }
    for i in range(len(model.blocks)):
        b, p = f"blocks.{i}.", f"Transformer/encoderblock_{i}/"
        w[p + "LayerNorm_0/scale"], w[p + "LayerNorm_0/bias"] = sd[b + "norm1.weight"], sd[b + "norm1.bias"]
        w[p + "LayerNorm_2/scale"], w[p + "LayerNorm_2/bias"] = sd[b + "norm2.weight"], sd[b + "norm2.bias"]
        qkv_w, qkv_b = sd[b + "attn.qkv.weight"], sd[b + "attn.qkv.bias"]
        for j, name in enumerate(("query", "key", "value")):
            kernel = qkv_w[j * dim : (j + 1) * dim].T.reshape(dim, heads, dim // heads)
            w[p + f"MultiHeadDotProductAttention_1/{name}/kernel"] = kernel
            w[p + f"MultiHeadDotProductAttention_1/{name}/bias"] = qkv_b[j * dim : (j + 1) * dim].reshape(heads, -1)
        w[p + "MultiHeadDotProductAttention_1/out/kernel"] = sd[b + "attn.proj.weight"].T.reshape(heads, -1, dim)
        w[p + "MultiHeadDotProductAttention_1/out/bias"] = sd[b + "attn.proj.bias"]
        for j, fc in enumerate(("fc1", "fc2")):
            w[p + f"MlpBlock_3/Dense_{j}/kernel"] = sd[b + f"mlp.{fc}.weight"].T
            w[p + f"MlpBlock_3/Dense_{j}/bias"] = sd[b + f"mlp.{fc}.bias"]
    np.savez(path, **w)


def test_google_npz_checkpoints_load_through_timms_converter(tmp_path):
    reference = timm.create_model("vit_tiny_patch16_224", pretrained=False, depth=2, num_classes=7).eval()
    reference.load_state_dict(_timm_state_dict("vit_tiny_patch16_224", depth=2, num_classes=7))
    _to_google_npz(reference, tmp_path / "ViT-Ti_16.npz")
    model = create_model("vit_tiny_patch16_224", depth=2, num_classes=7).eval()
    report = load_pretrained(model, tmp_path / "ViT-Ti_16.npz")
    assert report.resampled == report.reinitialised == []
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference(x), atol=1e-5, rtol=1e-5)


def test_layer_decay_and_head_lr_give_each_layer_its_rate():
    model = create_model("vit_nano_patch4_16", num_classes=3)  # 4 blocks
    groups = param_groups(model, weight_decay=0.05, lr=1.0, layer_decay=0.5, head_lr=2.0)
    lr_of = {id(p): g["lr"] for g in groups for p in g["params"]}
    named = dict(model.named_parameters())
    assert lr_of[id(named["pos_embed"])] == 0.5**5
    assert lr_of[id(named["patch_embed.proj.weight"])] == 0.5**5
    assert lr_of[id(named["blocks.0.attn.qkv.weight"])] == 0.5**4
    assert lr_of[id(named["blocks.3.mlp.fc1.bias"])] == 0.5**1
    assert lr_of[id(named["norm.weight"])] == 1.0
    assert lr_of[id(named["head.weight"])] == 2.0
    with pytest.raises(ValueError, match="layer_decay needs a model with transformer blocks"):
        param_groups(create_model("resnet20"), 0.0, 1.0, layer_decay=0.5)


def test_linear_probe_trains_only_the_head_with_the_backbone_in_eval_mode(tmp_path):
    modes = []

    class Spy(L.Callback):
        def on_train_batch_start(self, trainer, module, *args):
            modes.append((module.model.blocks[0].training, module.model.head.training))

    module = ImageClassifier(
        "vit_nano_patch4_16", {"drop_path_rate": 0.5}, num_classes=10, finetune={"freeze_backbone": True}
    )
    start = {k: v.clone() for k, v in module.model.state_dict().items()}
    quiet_trainer(tmp_path, max_epochs=1, limit_train_batches=3, limit_val_batches=1, callbacks=[Spy()]).fit(
        module, DigitsDataModule(batch_size=32, num_workers=0)
    )
    changed = {k for k, v in module.model.state_dict().items() if not torch.equal(v, start[k])}
    assert changed == {"head.weight", "head.bias"}
    assert set(modes) == {(False, True)}


def test_freezing_the_first_blocks(tmp_path):
    module = ImageClassifier("vit_nano_patch4_16", num_classes=10, finetune={"freeze_blocks": 2})
    trainable = {n for n, p in module.model.named_parameters() if p.requires_grad}
    assert not any(n.startswith(("patch_embed", "pos_embed", "cls_token", "blocks.0.", "blocks.1.")) for n in trainable)
    assert any(n.startswith("blocks.2.") for n in trainable) and "head.weight" in trainable


def test_checkpoints_without_batchnorm_step_counters_load(tmp_path):
    # The classic CIFAR ResNet checkpoints predate PyTorch 0.4.1's num_batches_tracked buffers.
    source = create_model("resnet20")
    old = {k: v for k, v in source.state_dict().items() if not k.endswith("num_batches_tracked")}
    model = create_model("resnet20")
    load_pretrained(model, _save(old, tmp_path / "old.th"))
    for name, value in old.items():
        assert torch.equal(model.state_dict()[name], value), name
