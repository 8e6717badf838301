"""Lee, Lee & Song 2021, "Vision Transformer for Small-Size Datasets", as two ViT options:
Shifted Patch Tokenization (`shifted_patches=True`: the patches of the image and of 4 diagonal
half-patch shifts, normed, then projected) and Locality Self-Attention (`attn_layer="lsa"`: scores
over a learned temperature, each token's score with itself masked). Both switch on through
`model_kwargs`, on the CIFAR ViT's own options (sincos2d, avg pooling, no CLS, patch dropout)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tests.test_recipe_options import default_run
from vit.cli import main
from vit.layers import Attention, BlockConfig, PatchEmbed, make_block
from vit.layers.patch import shift_images
from vit.lit import ImageClassifier
from vit.registry import create_model
from vit.timm_args import timm_kwargs
from vit.vision_transformer import ViTConfig

CIFAR_VIT = dict(
    embed_dim=128, num_heads=4, depth=3, posemb="sincos2d", global_pool="avg", class_token=False, patch_drop_rate=0.5
)  # configs/cifar10_vit.yaml's model_kwargs


def cifar_vit(**options: object) -> torch.nn.Module:
    torch.manual_seed(0)
    return create_model("vit_micro_patch4_32", num_classes=10, **{**CIFAR_VIT, **options})


def count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# Shifted Patch Tokenization


def test_the_tokenizers_input_is_the_image_and_its_four_diagonal_half_patch_shifts_zero_filled():
    image = torch.arange(1.0, 17.0).reshape(1, 1, 4, 4)  # 1..16, so a zero is always fill
    shifted = shift_images(image, (4, 4))  # half a patch: 2 pixels
    assert shifted.shape == (1, 5, 4, 4)
    zero = [0.0, 0.0]
    expected = [
        image[0, 0].tolist(),
        [[11, 12, *zero], [15, 16, *zero], [0] * 4, [0] * 4],  # left-up: out[i, j] = x[i + 2, j + 2]
        [[*zero, 9, 10], [*zero, 13, 14], [0] * 4, [0] * 4],  # right-up: x[i + 2, j - 2]
        [[0] * 4, [0] * 4, [3, 4, *zero], [7, 8, *zero]],  # left-down: x[i - 2, j + 2]
        [[0] * 4, [0] * 4, [*zero, 1, 2], [*zero, 5, 6]],  # right-down: x[i - 2, j - 2]
    ]
    assert shifted[0].tolist() == expected
    # with several channels: the image's channels, then each shifted copy's channels in that order
    rgb = torch.randn(2, 3, 8, 8)
    shifted = shift_images(rgb, (4, 4))
    assert torch.equal(shifted[:, :3], rgb)
    assert torch.equal(shifted[:, 3:6, :6, :6], rgb[:, :, 2:, 2:]) and shifted[:, 3:6, 6:].abs().sum() == 0
    assert torch.equal(shifted[:, 12:15, 2:, 2:], rgb[:, :, :6, :6]) and shifted[:, 12:15, :2].abs().sum() == 0


def test_each_token_is_its_flattened_shifted_patch_normed_then_projected_by_the_wider_patchify_conv():
    torch.manual_seed(0)
    embed = PatchEmbed(8, 4, in_chans=3, embed_dim=16, shifted_patches=True)
    assert embed.proj.in_channels == 15 and embed.patch_norm.normalized_shape == (15 * 4 * 4,)
    with torch.no_grad():  # a norm that is not the identity, so the reference must apply it
        embed.patch_norm.weight.uniform_(0.5, 1.5)
        embed.patch_norm.bias.uniform_(-0.5, 0.5)
    images = torch.randn(2, 3, 8, 8)
    patches = F.unfold(shift_images(images, (4, 4)), 4, stride=4).transpose(1, 2)  # (2, 4, 240): (c, row, col)
    normed = F.layer_norm(patches, (240,), embed.patch_norm.weight, embed.patch_norm.bias, eps=1e-6)
    reference = normed @ embed.proj.weight.flatten(1).T + embed.proj.bias
    assert torch.allclose(embed(images), reference, atol=1e-5)
    # without the norm it is the patchify conv on the 15-channel input
    embed.patch_norm = torch.nn.Identity()
    conv = F.conv2d(shift_images(images, (4, 4)), embed.proj.weight, embed.proj.bias, stride=4)
    assert torch.allclose(embed(images), conv.flatten(2).transpose(1, 2), atol=1e-5)


def test_the_cifar_vit_with_shifted_patches_trains_and_evaluates_and_grows_by_the_wider_conv_and_the_norm():
    plain, spt = cifar_vit(), cifar_vit(shifted_patches=True)
    # 4 more copies of 3 channels into the 4x4 conv to 128, and the norm's weight and bias over 15 x 4 x 4
    assert count(spt) - count(plain) == 4 * 3 * 4 * 4 * 128 + 2 * 15 * 4 * 4 == 25_056
    assert (count(plain), count(spt)) == (602_634, 627_690)
    assert [n for n, _ in spt.patch_embed.named_parameters()] == ["proj.weight", "proj.bias", "patch_norm.weight",
                                                                  "patch_norm.bias"]  # fmt: skip
    images = torch.randn(4, 3, 32, 32)
    for training in (True, False):
        spt.train(training)
        spt.zero_grad()
        logits = spt(images)
        logits.sum().backward()
        assert logits.shape == (4, 10) and torch.isfinite(logits).all()
        assert (
            spt.patch_embed.proj.weight.grad.abs().sum() > 0 and spt.patch_embed.patch_norm.weight.grad.abs().sum() > 0
        )


def test_shifted_patches_refuse_a_conv_stem_or_a_hybrid_backbone_naming_both():
    with pytest.raises(ValueError, match=r"shifted_patches.*stem_channels"):
        cifar_vit(shifted_patches=True, stem_channels=(32, 64))
    with pytest.raises(ValueError, match=r"shifted_patches.*backbone"):
        ViTConfig(shifted_patches=True, backbone={"name": "resnetv2", "layers": [3, 4, 9]})
    with pytest.raises(ValueError, match=r"shifted_patches.*stem_channels"):
        PatchEmbed(32, 4, shifted_patches=True, stem_channels=(32, 64))


# Locality Self-Attention


def lsa_reference(attn: Attention, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q k^T / tau, the diagonal at -inf) v, then the projection, written out; and the weights."""
    b, n, dim = x.shape
    q, k, v = attn.qkv(x).reshape(b, n, 3, attn.num_heads, -1).permute(2, 0, 3, 1, 4)
    scores = q @ k.transpose(-2, -1) / attn.log_temperature.exp()
    weights = scores.masked_fill(torch.eye(n, dtype=torch.bool), float("-inf")).softmax(-1)
    return attn.proj((weights @ v).transpose(1, 2).reshape(b, n, dim)), weights


def test_lsa_matches_a_written_out_softmax_with_the_diagonal_masked_and_the_learned_temperature():
    torch.manual_seed(0)
    attn = Attention(32, num_heads=4, lsa=True)
    assert attn.log_temperature.shape == () and attn.log_temperature.item() == pytest.approx(math.log(math.sqrt(8)))
    with torch.no_grad():
        attn.log_temperature.fill_(math.log(1.7))  # away from its start, so the temperature matters
    x = torch.randn(2, 6, 32)
    expected, expected_weights = lsa_reference(attn, x)
    fused = attn(x)  # SDPA with the additive diagonal mask
    explicit, weights = attn(x, return_attn=True)
    assert torch.allclose(fused, expected, atol=1e-6) and torch.allclose(explicit, expected, atol=1e-6)
    assert torch.allclose(weights, expected_weights, atol=1e-6)
    assert torch.all(weights.diagonal(dim1=-2, dim2=-1) == 0)  # exactly: no token attends to itself
    assert torch.allclose(weights.sum(-1), torch.ones(2, 4, 6), atol=1e-6)


def test_the_temperature_is_trained():
    torch.manual_seed(0)
    attn = Attention(32, num_heads=4, lsa=True)
    attn(torch.randn(2, 6, 32)).square().sum().backward()
    grad = attn.log_temperature.grad
    assert grad is not None and torch.isfinite(grad) and grad.abs() > 1e-4
    assert "log_temperature" in dict(attn.named_parameters())


def test_at_initialisation_lsa_is_plain_attention_with_each_tokens_own_score_masked():
    torch.manual_seed(0)
    lsa = make_block(BlockConfig(embed_dim=32, num_heads=4, attn_layer="lsa")).attn
    plain = make_block(BlockConfig(embed_dim=32, num_heads=4)).attn
    state = lsa.state_dict()
    assert state.pop("log_temperature").item() == pytest.approx(math.log(math.sqrt(8)))
    plain.load_state_dict(state)  # the same names otherwise: timm's qkv, proj
    x = torch.randn(3, 7, 32)
    others = ~torch.eye(7, dtype=torch.bool)  # SDPA: True = may attend
    assert torch.allclose(lsa(x), plain(x, attn_mask=others), atol=1e-6)
    assert not torch.allclose(lsa(x), plain(x), atol=1e-3)


def test_the_cifar_vit_with_lsa_masks_each_kept_token_under_patch_dropout_and_adds_one_scalar_a_block():
    plain, lsa = cifar_vit(), cifar_vit(attn_layer="lsa")
    assert count(lsa) - count(plain) == 3 == CIFAR_VIT["depth"]
    images = torch.randn(2, 3, 32, 32)
    lsa.train()
    logits, attns = lsa.forward_with_attn(images)  # the explicit path, after patch dropout
    logits.sum().backward()
    assert logits.shape == (2, 10) and torch.isfinite(logits).all()
    for weights in attns:
        assert weights.shape == (2, 4, 32, 32)  # half of the 8 x 8 patches kept, no CLS
        assert torch.all(weights.diagonal(dim1=-2, dim2=-1) == 0)
    assert all(block.attn.log_temperature.grad.abs() > 0 for block in lsa.blocks)
    lsa.eval()
    with torch.no_grad():
        fused, (_, attns) = lsa(images), lsa.forward_with_attn(images)
    assert attns[0].shape == (2, 4, 64, 64) and torch.all(attns[0].diagonal(dim1=-2, dim2=-1) == 0)
    assert torch.allclose(fused, lsa.forward_with_attn(images)[0].detach(), atol=1e-5)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"rel_pos_type": "bias"}, "rel_pos_type and window_size .* attn_layer='attn'"),
        ({"window_size": 4}, "rel_pos_type and window_size .* attn_layer='attn'"),
        ({"num_kv_heads": 2, "qkv_fused": False}, "num_kv_heads .* attn_layer='attn'"),
    ],
)
def test_lsa_refuses_relative_positions_windows_and_grouped_kv_heads(options, message):
    with pytest.raises(ValueError, match=message):
        BlockConfig(embed_dim=32, num_heads=4, attn_layer="lsa", **options)


def test_lsa_refuses_causal_attention_and_an_unknown_attn_layer_lists_it():
    with pytest.raises(ValueError, match=r"lsa .*causal"):
        Attention(32, num_heads=4, lsa=True, causal=True)
    with pytest.raises(ValueError, match=r"'attn', 'diff' .* or 'lsa'"):
        BlockConfig(attn_layer="local")


# From a config


def test_both_options_reach_the_model_through_model_kwargs():
    classifier = ImageClassifier(
        model_name="vit_micro_patch4_32", num_classes=10,
        model_kwargs={**CIFAR_VIT, "shifted_patches": True, "attn_layer": "lsa"},
    )  # fmt: skip
    names = dict(classifier.model.named_parameters())
    assert "patch_embed.patch_norm.weight" in names and names["patch_embed.proj.weight"].shape == (128, 15, 4, 4)
    assert all(f"blocks.{i}.attn.log_temperature" in names for i in range(3))


def test_a_fit_from_the_command_line_with_both_options_saves_their_parameters(tmp_path):
    options = "{shifted_patches: true, attn_layer: lsa, posemb: sincos2d, global_pool: avg, class_token: false}"
    main(default_run(tmp_path, "--model.model_kwargs", options))
    state = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    assert state["model.patch_embed.proj.weight"].shape[1] == 15  # vit_nano_patch4_16 on the 16x16 digits
    temperatures = [v for k, v in state.items() if k.endswith("attn.log_temperature")]
    assert temperatures and all(torch.isfinite(t) for t in temperatures)


def test_timm_has_neither_option_so_a_config_with_one_is_not_handed_to_timm():
    for options in ({"shifted_patches": True}, {"attn_layer": "lsa"}):
        with pytest.raises(
            ValueError, match=r"timm's VisionTransformer has no equivalent of \{'(shifted_patches|attn_layer)"
        ):
            timm_kwargs(ViTConfig(**options))


@pytest.mark.parametrize("block_fn", ["parallel_scaling", "parallel_things"])
def test_lsa_masks_each_tokens_own_score_in_the_parallel_blocks_too(block_fn):
    vit = cifar_vit(attn_layer="lsa", block_fn=block_fn, patch_drop_rate=0.0).eval()
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        fused, (explicit, attns) = vit(images), vit.forward_with_attn(images)
    assert len(attns) == 3 and all(torch.all(w.diagonal(dim1=-2, dim2=-1) == 0) for w in attns)
    assert torch.allclose(fused, explicit, atol=1e-5)
