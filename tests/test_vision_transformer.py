"""The Vision Transformer: timm parity, the size table, the registry, attention maps."""

from __future__ import annotations

import re

import pytest
import timm
import torch

import vit
from vit import create_model


def _perturbed_timm(name: str, **kwargs) -> torch.nn.Module:
    """A timm model with every parameter randomised, so norms and biases are not at their init."""
    model = timm.create_model(name, pretrained=False, **kwargs).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


PARITY_CASES = [
    ("vit_tiny_patch16_224", {}),
    ("vit_small_patch16_224", {}),
    ("vit_tiny_patch16_224", {"global_pool": "avg", "class_token": False}),
    ("vit_small_patch16_224", {"global_pool": "avg"}),  # avg pooling with a (unused) CLS token
]


@pytest.mark.parametrize(("name", "kwargs"), PARITY_CASES)
def test_timm_state_dict_loads_strictly_and_logits_match(name, kwargs):
    theirs = _perturbed_timm(name, **kwargs)
    ours = create_model(name, **kwargs).eval()
    ours.load_state_dict(theirs.state_dict(), strict=True)
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        expected, got = theirs(x), ours(x)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(
            ours.forward_head(ours.forward_features(x), pre_logits=True),
            theirs.forward_head(theirs.forward_features(x), pre_logits=True),
            atol=1e-5,
            rtol=1e-5,
        )
    assert expected.abs().max() > 0.1  # a comparison of real numbers, not of zeros


def test_our_state_dict_has_exactly_timms_names_and_shapes():
    theirs = timm.create_model("vit_tiny_patch16_224", pretrained=False)
    ours = create_model("vit_tiny_patch16_224")
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in theirs.state_dict().items()}


def _num_params(name: str, **kwargs) -> int:
    with torch.device("meta"):  # count without allocating 2.5 GB for ViT-H
        return sum(p.numel() for p in create_model(name, **kwargs).parameters())


def test_parameter_counts_equal_timms_published_sizes():
    # At 1000 classes. timm: 86,567,656 / 304,326,632 / 632,045,800.
    assert _num_params("vit_base_patch16_224") == 86_567_656  # 86.6M
    assert _num_params("vit_large_patch16_224") == 304_326_632  # 304.3M
    assert _num_params("vit_huge_patch14_224") == 632_045_800  # the paper's 632M
    # timm's default vit_huge_patch14_224 is headless (its in21k weights): 630.8M
    assert _num_params("vit_huge_patch14_224", num_classes=0) == 630_764_800
    with torch.device("meta"):
        assert _num_params("vit_huge_patch14_224") == sum(
            p.numel() for p in timm.create_model("vit_huge_patch14_224", num_classes=1000).parameters()
        )


def test_size_table_has_the_published_widths_depths_and_heads():
    expected = {"Ti": (192, 12, 3), "S": (384, 12, 6), "B": (768, 12, 12), "L": (1024, 24, 16), "H": (1280, 32, 16)}
    for size, (width, depth, heads) in expected.items():
        assert vit.vision_transformer.VIT_SIZES[size] == dict(embed_dim=width, depth=depth, num_heads=heads)
    assert vit.model_config("vit_huge_patch14_224").patch_size == 14
    assert vit.model_config("vit_base_patch16_224").mlp_ratio == 4.0


def test_registry_lists_models_and_explains_mistakes():
    names = vit.list_models()
    assert {"vit_tiny_patch16_224", "vit_tiny_patch4_32", "resnet20", "resnet50", "gpt_char_cpu"} <= set(names)
    assert vit.list_models("resnet*") == sorted(n for n in names if n.startswith("resnet"))
    with pytest.raises(ValueError, match=r"unknown model 'vit_tiny_patch16'.*Did you mean.*vit_tiny_patch16_224"):
        create_model("vit_tiny_patch16")
    with pytest.raises(ValueError, match=r"no option.*num_class\b.*fields are:.*num_classes"):
        create_model("vit_tiny_patch4_32", num_class=10)
    with pytest.raises(ValueError, match="global_pool='token' needs class_token=True"):
        create_model("vit_tiny_patch4_32", class_token=False)


def test_small_image_variants_take_cifar_sized_inputs():
    model = create_model("vit_tiny_patch4_32", num_classes=10)
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    assert model.patch_embed.grid_size == (8, 8) and model.pos_embed.shape == (1, 65, 192)
    headless = create_model("vit_nano_patch4_16", num_classes=0)
    assert headless(torch.randn(2, 3, 16, 16)).shape == (2, 128)


def test_init_follows_timm_defaults():
    model = create_model("vit_small_patch16_224")
    assert abs(model.pos_embed.std().item() - 0.02) < 0.002
    assert model.cls_token.std() < 1e-5
    qkv = model.blocks[0].attn.qkv
    assert abs(qkv.weight.std().item() - 0.02) < 0.001 and torch.count_nonzero(qkv.bias) == 0


def test_wrong_input_size_is_a_clear_error_unless_dynamic():
    model = create_model("vit_nano_patch4_16").eval()
    with pytest.raises(ValueError, match=r"8x8.*does not match the position embedding's 4x4 grid"):
        model(torch.randn(1, 3, 32, 32))
    dynamic = create_model("vit_nano_patch4_16", dynamic_img_size=True).eval()
    dynamic.load_state_dict(model.state_dict())
    assert dynamic(torch.randn(1, 3, 32, 32)).shape == (1, 1000)


def test_dynamic_img_size_resamples_the_position_embedding_as_timm_does():
    kwargs = dict(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=4, num_classes=5, dynamic_img_size=True)
    theirs = timm.models.vision_transformer.VisionTransformer(**kwargs).eval()
    ours = create_model("vit_nano_patch4_16", **kwargs).eval()
    ours.load_state_dict(theirs.state_dict())
    with torch.no_grad():
        theirs.pos_embed.normal_()  # a position embedding worth resampling
        ours.pos_embed.copy_(theirs.pos_embed)
        for size in ((48, 48), (24, 40)):
            x = torch.randn(2, 3, *size)
            torch.testing.assert_close(ours(x), theirs(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"global_pool": "avg", "class_token": False, "qk_norm": True, "init_values": 0.1},
        {"global_pool": "map", "class_token": False, "fc_norm": False, "mlp_ratio": 2.0},
    ],
)
def test_timm_kwargs_build_timms_model_with_our_names_and_logits(kwargs):
    ours = create_model("vit_nano_patch4_16", num_classes=3, **kwargs).eval()
    theirs = timm.models.vision_transformer.VisionTransformer(**vit.vision_transformer.timm_kwargs(ours.config))
    theirs.load_state_dict(ours.state_dict(), strict=True)
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs.eval()(x), atol=1e-5, rtol=1e-5)


def test_timm_kwargs_refuse_options_timm_builds_differently():
    config = create_model("vit_nano_patch4_16", norm="rmsnorm", posemb="sincos2d").config
    with pytest.raises(ValueError, match=re.escape("no equivalent of {'norm': 'rmsnorm', 'posemb': 'sincos2d'}")):
        vit.vision_transformer.timm_kwargs(config)


@pytest.mark.parametrize("kwargs", [{}, {"global_pool": "avg", "class_token": False}])
def test_forward_with_attn_returns_every_layers_weights_and_the_same_logits(kwargs):
    model = create_model("vit_nano_patch4_16", num_classes=5, **kwargs).eval()
    x = torch.randn(3, 3, 16, 16)
    with torch.no_grad():
        logits, attns = model.forward_with_attn(x)
        torch.testing.assert_close(logits, model(x), atol=1e-5, rtol=1e-5)
    n = 16 + model.num_prefix_tokens
    assert len(attns) == 4 and all(a.shape == (3, 4, n, n) for a in attns)
    torch.testing.assert_close(attns[-1].sum(-1), torch.ones(3, 4, n))
    assert all(b.attn.fused_attn for b in model.blocks)  # fused attention was never turned off


def test_grad_checkpointing_gives_identical_gradients():
    model = create_model("vit_nano_patch4_16", num_classes=3)
    x, y = torch.randn(4, 3, 16, 16), torch.tensor([0, 1, 2, 0])

    def grads():
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    plain = grads()
    model.set_grad_checkpointing(True)
    checkpointed = grads()
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], atol=0, rtol=0, msg=name)


def test_training_gradients_match_timm_although_the_last_block_skips_unused_tokens():
    # forward() runs the last block for the CLS query only; every gradient must still be timm's.
    theirs = _perturbed_timm("vit_tiny_patch16_224", num_classes=5, img_size=64)
    ours = create_model("vit_tiny_patch16_224", num_classes=5, img_size=64)
    ours.load_state_dict(theirs.state_dict())
    x, y = torch.randn(3, 3, 64, 64), torch.tensor([0, 4, 2])
    for model in (ours, theirs):
        torch.nn.functional.cross_entropy(model(x), y).backward()
    theirs_grads = dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, theirs_grads[name].grad, atol=1e-5, rtol=1e-4, msg=name)
