"""timm's EVA family (timm.models.eva) on our VisionTransformer and Block: names, parameters, logits."""

from __future__ import annotations

import pytest
import timm
import torch
from timm.layers.pos_embed_sincos import RotaryEmbeddingCat, RotaryEmbeddingDinoV3, RotaryEmbeddingMixed

import vit
from tests.conftest import timm_and_ours
from vit.layers import Attention
from vit.position import MixedRope, apply_rope, rope_2d, rope_2d_dinov3

TIMM_EVA_NAMES = timm.list_models(module="eva")
# Small enough for a CPU test, timm's architecture otherwise: head_dim 32 (RoPE needs a multiple of 4).
SMALL = dict(depth=2, embed_dim=64, num_heads=2, num_classes=5)


def _pair(name: str, **kwargs) -> tuple[torch.nn.Module, torch.nn.Module]:
    return timm_and_ours(name, 0.05, **SMALL, **kwargs)


def test_every_timm_eva_name_is_built():
    supported, unsupported = set(vit.list_models()), vit.registry.unsupported_models()
    assert len(TIMM_EVA_NAMES) == 65  # timm 1.0.31; another timm: recount below and in docs/models.md
    refused = {n: unsupported.get(n) for n in TIMM_EVA_NAMES if n not in supported}
    assert not refused, refused
    assert isinstance(vit.create_model("eva02_tiny_patch14_224", depth=1), vit.Eva)
    assert isinstance(vit.create_model("vit_base_patch16_sapiens2", depth=1, num_kv_heads=None), vit.Eva)


def test_timm_eva_names_have_timms_parameter_names_and_shapes():
    """Every built name at full size, on the meta device (no memory, no arithmetic)."""
    for name in TIMM_EVA_NAMES:
        if name not in vit.list_models():
            continue
        with torch.device("meta"):
            ours, theirs = vit.create_model(name, num_classes=7), timm.create_model(name, num_classes=7)
        assert {k: v.shape for k, v in ours.named_parameters()} == {k: v.shape for k, v in theirs.named_parameters()}, (
            name
        )
        assert ours.state_dict().keys() == theirs.state_dict().keys(), name


@pytest.mark.parametrize(
    ("name", "img_size"),
    [
        ("eva_giant_patch14_224", 56),  # EVA: learned positions, GELU MLP, q_bias/v_bias, avg pool + fc_norm
        ("eva02_tiny_patch14_224", 56),  # EVA-02: axial RoPE at a reference grid, packed SwiGLU
        ("eva02_base_patch14_224", 56),  # unfused q/k/v without a key bias, split SwiGLU with its norm
        ("eva02_base_patch16_clip_224", 64),  # + the attention's inner norm, CLS pooling
        ("eva02_enormous_patch14_clip_224", 56),  # post-norm blocks (timm's EvaBlockPostNorm), q_bias/v_bias
        ("vit_small_patch16_dinov3", 64),  # DINOv3: its RoPE, registers, gamma LayerScale, no qkv bias
        ("vit_small_patch16_dinov3_qkvb", 64),  # q and v biases
        ("vit_huge_plus_patch16_dinov3", 64),  # split SwiGLU aligned to 8
        ("vit_small_patch16_lingbot", 64),  # DINOv3 RoPE, CLS pooling
        ("vit_pe_core_tiny_patch16_384", 64),  # PE: pre-norm, "xy" RoPE offset by 1, MAP head over every token
        ("vit_pe_lang_large_patch14_448", 56),  # no norm after the blocks
        ("vit_small_patch16_rope_224", 64),  # Naver RoPE-Axial, temperature 100, "xy"
        ("vit_small_patch16_rope_mixed_224", 64),  # Naver RoPE-Mixed: learned frequencies per block and head
        ("vit_small_patch16_rope_mixed_ape_224", 64),  # + learned positions for the patches only
        ("vit_medium_patch16_rope_reg1_gap_256", 64),  # timm's SBB: a register, no CLS, avg pooling
    ],
)
def test_timm_eva_models_load_strictly_and_give_timms_logits(name, img_size):
    ours, theirs = _pair(name, img_size=img_size)
    x = torch.randn(2, 3, img_size, img_size)
    with torch.no_grad():
        expected = theirs(x)
        torch.testing.assert_close(ours(x), expected, atol=1e-5, rtol=0)
        torch.testing.assert_close(
            ours.forward_head(ours.forward_features(x), pre_logits=True),
            theirs.forward_head(theirs.forward_features(x), pre_logits=True),
            atol=1e-5,
            rtol=0,
        )
        logits, attns = ours.forward_with_attn(x)  # the explicit attention path, rotary tables and all
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=0)
    assert len(attns) == 2 and attns[0].shape[-1] == ours.num_prefix_tokens + (img_size // ours.config.patch_size) ** 2
    assert expected.abs().max() > 0.1  # a comparison of real numbers, not of zeros


FEATURE_NAMES = ["eva02_tiny_patch14_224", "vit_small_patch16_dinov3", "vit_small_patch16_rope_mixed_224"]


@pytest.mark.parametrize("name", FEATURE_NAMES)
def test_forward_intermediates_equal_timms(name):
    ours, theirs = _pair(name, img_size=64 if "patch16" in name else 56)
    x = torch.randn(2, 3, ours.config.img_size, ours.config.img_size)
    options = dict(indices=[0, 1], norm=True, return_prefix_tokens=True)
    with torch.no_grad():
        final, feats = ours.forward_intermediates(x, **options)
        final_t, feats_t = theirs.forward_intermediates(x, **options)
    torch.testing.assert_close(final, final_t, atol=1e-5, rtol=0)
    for (patches, prefix), (patches_t, prefix_t) in zip(feats, feats_t, strict=True):
        torch.testing.assert_close(patches, patches_t, atol=1e-5, rtol=0)  # (B, D, H, W)
        torch.testing.assert_close(prefix, prefix_t, atol=1e-5, rtol=0)


def test_dinov3_takes_other_image_sizes_as_timm_does():
    """DINOv3's names are dynamic: the rotary grid follows the input, normalised to [-1, 1]."""
    ours, theirs = _pair("vit_small_patch16_dinov3", img_size=64)
    x = torch.randn(1, 3, 48, 80)  # a 3x5 grid
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["eva02_tiny_patch14_224", "vit_small_patch16_rope_mixed_224"])
def test_training_with_patch_dropout_and_grad_checkpointing_keeps_each_patchs_rotation(name):
    """Dropped patches take their rotary rows with them: with every patch kept in a new order the
    output is the same, per image, as without dropout."""
    model = vit.create_model(name, img_size=56 if "patch14" in name else 64, patch_drop_rate=0.5, **SMALL)
    model.set_grad_checkpointing(True)
    x = torch.randn(2, 3, model.config.img_size, model.config.img_size)
    model.train()
    loss = model(x).square().sum()
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for p in model.blocks.parameters())
    model.eval()
    tokens, rope = model._embed(x)
    n = tokens.shape[1] - model.num_prefix_tokens
    order = torch.stack([torch.randperm(n), torch.randperm(n)])  # "kept": every patch, shuffled
    prefix, patches = tokens[:, : model.num_prefix_tokens], tokens[:, model.num_prefix_tokens :]
    shuffled = torch.cat([prefix, patches.gather(1, order[..., None].expand(-1, -1, patches.shape[2]))], dim=1)
    with torch.no_grad():
        out = model._run_blocks(shuffled, model._rope(x, order))[0]
        base = model._run_blocks(tokens, rope)[0]
    restored = torch.empty_like(base[:, model.num_prefix_tokens :]).scatter_(
        1, order[..., None].expand(-1, -1, base.shape[2]), out[:, model.num_prefix_tokens :]
    )
    torch.testing.assert_close(restored, base[:, model.num_prefix_tokens :], atol=1e-5, rtol=0)


# -- the layers ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=10000.0, ref_feat_shape=(16, 16)),  # EVA-02
        dict(temperature=100.0, grid_indexing="xy"),  # Naver RoPE-Axial
        dict(temperature=10000.0, grid_indexing="xy", grid_offset=1.0, ref_feat_shape=(24, 24)),  # PE
        dict(temperature=10000.0, rotate_half=True),  # our posemb="rope"
    ],
)
def test_rope_2d_is_timms_rotary_embedding_cat(kwargs):
    theirs = RotaryEmbeddingCat(dim=32, in_pixels=False, feat_shape=[5, 7], **kwargs)
    sin, cos = theirs.get_embed().chunk(2, dim=-1)
    ours = rope_2d(
        (5, 7), 32, kwargs["temperature"], kwargs.get("grid_offset", 0.0), kwargs.get("grid_indexing", "ij"),
        kwargs.get("ref_feat_shape"), kwargs.get("rotate_half", False),
    )  # fmt: skip
    assert torch.equal(ours[0], cos) and torch.equal(ours[1], sin)


def test_dinov3_and_mixed_rope_are_timms():
    sin, cos = RotaryEmbeddingDinoV3(dim=32, temperature=100, feat_shape=[5, 7]).get_embed().chunk(2, dim=-1)
    ours = rope_2d_dinov3((5, 7), 32, 100.0)
    assert torch.equal(ours[0], cos) and torch.equal(ours[1], sin)
    theirs = RotaryEmbeddingMixed(dim=64, depth=3, num_heads=2, feat_shape=[5, 7], grid_indexing="xy")
    mixed = MixedRope(head_dim=32, depth=3, num_heads=2)
    assert mixed.freqs.shape == theirs.freqs.shape
    with torch.no_grad():
        mixed.freqs.copy_(theirs.freqs)
    sin, cos = theirs.get_embed().chunk(2, dim=-1)  # (depth, heads, N, head_dim)
    ours = mixed((5, 7), "xy")
    assert torch.equal(ours[0], cos) and torch.equal(ours[1], sin)


@pytest.mark.parametrize("per_head", [False, True])
def test_interleaved_rope_keeps_norms_prefix_and_relative_positions(per_head):
    q, k = torch.randn(2, 2, 1 + 12, 16), torch.randn(2, 2, 1 + 12, 16)
    freqs = MixedRope(16, 1, 2)((3, 4)) if per_head else None
    table = (freqs[0][0], freqs[1][0]) if per_head else rope_2d((3, 4), 16, rotate_half=False)
    rotated = apply_rope(q, *table, half=False)
    torch.testing.assert_close(rotated.norm(dim=-1), q.norm(dim=-1))
    assert torch.equal(rotated[:, :, 0], q[:, :, 0])  # the CLS token is not turned
    if not per_head:  # shifting the grid leaves every score as it was
        shifted = rope_2d((3, 4), 16, offset=(5.0, 2.0), rotate_half=False)
        scores = apply_rope(q, *table, half=False) @ apply_rope(k, *table, half=False).transpose(-2, -1)
        moved = apply_rope(q, *shifted, half=False) @ apply_rope(k, *shifted, half=False).transpose(-2, -1)
        torch.testing.assert_close(moved[..., 1:, 1:], scores[..., 1:, 1:], atol=1e-4, rtol=1e-4)  # patches


@pytest.mark.parametrize(
    "options",
    [
        dict(k_bias=False),  # q_bias, v_bias beside a bias-free qkv
        dict(qkv_fused=False, k_bias=False, scale_norm=True),  # q_proj, k_proj (no bias), v_proj; attn.norm
        dict(qkv_fused=False),  # all three biased (timm's AttentionRope)
    ],
)
def test_eva_attention_layouts_have_timms_names_and_both_paths_agree(options):
    attn = Attention(32, num_heads=2, rope_half=False, **options).eval()
    names = {n for n, _ in attn.named_parameters()}
    if options.get("qkv_fused", True):
        assert {"qkv.weight", "q_bias", "v_bias"} <= names and "qkv.bias" not in names
    else:
        assert {"q_proj.bias", "v_proj.bias"} <= names
        assert ("k_proj.bias" in names) == options.get("k_bias", True)
        assert ("norm.weight" in names) == options.get("scale_norm", False)
    with torch.no_grad():
        for p in attn.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    x, table = torch.randn(2, 1 + 6, 32), rope_2d((2, 3), 16, rotate_half=False)
    with torch.no_grad():
        fused = attn(x, rope=table)
        explicit, weights = attn(x, rope=table, return_attn=True)
    torch.testing.assert_close(explicit, fused, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 2, 7))


def test_eva_config_refuses_what_an_eva_does_not_have():
    with pytest.raises(ValueError, match="posemb is 'learn' or 'none'"):
        vit.create_model("eva02_tiny_patch14_224", posemb="rope")
    with pytest.raises(ValueError, match="rope_type must be one of"):
        vit.create_model("eva02_tiny_patch14_224", rope_type="mrope")
    with pytest.raises(ValueError, match="has no equivalent here"):
        vit.eva.from_timm_eva_args({"rope_shift_coords": 0.5})


def test_a_change_inside_timm_costs_the_eva_names_with_a_warning_never_the_import():
    import subprocess
    import sys

    from tests.conftest import ROOT

    program = """
import warnings
import timm.models.eva as timm_eva
del timm_eva._create_eva
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import vit
print(sum("timm's EVA names" in str(w.message) for w in caught))
print(vit.registry.unsupported_models()["eva02_tiny_patch14_224"])
print(vit.create_model("vit_tiny_patch4_32", num_classes=3)(__import__("torch").zeros(1, 3, 32, 32)).shape)
"""
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    warned, reason, shape = result.stdout.strip().splitlines()
    assert warned == "1" and "could not be read from timm" in reason and "_create_eva" in reason
    assert shape == "torch.Size([1, 3])"
