"""timm's other ViT blocks and layouts on our one Block: parallel, post-norm, differential attention,
AIMv2, BEiT3 and the other names of timm's vision_transformer module; logits against timm's."""

from __future__ import annotations

import pytest
import torch

import vit
from tests.conftest import timm_and_ours
from vit.layers import Attention, Block, BlockConfig, ParallelScalingBlock, set_fused_attn


def _pair(name: str, **kwargs) -> tuple[torch.nn.Module, torch.nn.Module]:
    return timm_and_ours(name, 0.1, depth=2, num_classes=5, **kwargs)  # 2 blocks deep


NARROW = dict(embed_dim=64, num_heads=2)


@pytest.mark.parametrize(
    ("name", "kwargs"),
    [
        ("aimv2_large_patch14_224", dict(img_size=56, **NARROW)),  # RMSNorm, bias-free split SwiGLU, patch norm
        ("beit3_base_patch16_224", dict(img_size=64, **NARROW)),  # the attention's and the MLP's inner norms
        ("eva_large_patch14_196", dict(img_size=56, **NARROW)),  # avg pooling, fc_norm
        ("flexivit_small", dict(img_size=64)),  # positions for the patches only
        ("test_vit3", dict(img_size=64)),  # MAP head over the register token too (pool_include_prefix)
        ("test_vit4", dict(img_size=64)),  # norm_layer by timm's name "rmsnorm"
        ("vit_small_patch16_18x2_224", dict(img_size=64, **NARROW)),  # ParallelThingsBlock, CLS pooling
        ("vit_base_patch16_rpn_224", dict(img_size=64, **NARROW)),  # ResPostBlock: post-norm
        ("vit_base_patch16_xp_224", dict(img_size=64, **NARROW)),  # ParallelScalingBlock, qk-norm, mlp_bias
        ("vit_pwee_patch16_reg1_gap_256", dict(img_size=64)),  # ParallelScalingBlock with qkv (and MLP) bias
        ("vit_dwee_patch16_reg1_gap_256", dict(img_size=64)),  # differential attention
        ("vit_dpwee_patch16_reg1_gap_256", dict(img_size=64)),  # DiffParallelScalingBlock: fused out_proj
    ],
)
def test_timm_models_load_strictly_and_give_timms_logits_on_both_attention_paths(name, kwargs):
    ours, theirs = _pair(name, **kwargs)
    size = kwargs["img_size"]
    x = torch.randn(2, 3, size, size)
    with torch.no_grad():
        expected = theirs(x)
        torch.testing.assert_close(ours(x), expected, atol=1e-5, rtol=0)
        torch.testing.assert_close(
            ours.forward_head(ours.forward_features(x), pre_logits=True),
            theirs.forward_head(theirs.forward_features(x), pre_logits=True),
            atol=1e-5,
            rtol=0,
        )
        logits, attns = ours.forward_with_attn(x)  # the explicit path, attention weights returned
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=0)
    n = ours.num_prefix_tokens + (size // ours.config.patch_size) ** 2
    heads = ours.config.num_heads * (ours.config.num_parallel if ours.config.block_fn == "parallel_things" else 1)
    assert len(attns) == 2 and all(a.shape == (2, heads, n, n) for a in attns)
    assert expected.abs().max() > 0.1  # a comparison of real numbers, not of zeros


def test_differential_attention_weights_are_the_difference_map_and_give_the_output():
    """A1 - lambda A2: rows sum to 1 - lambda, and the explicit path equals the fused one."""
    attn = Attention(64, num_heads=2, diff=True, depth=3).eval()
    x = torch.randn(2, 9, 64)
    with torch.no_grad():
        fused = attn(x)
        explicit, weights = attn(x, return_attn=True)
        lam = attn.diff_lambda()
    torch.testing.assert_close(explicit, fused, atol=1e-6, rtol=0)
    assert weights.shape == (2, 2, 9, 9) and (weights < 0).any()
    torch.testing.assert_close(weights.sum(-1), torch.full((2, 2, 9), 1 - lam.item()))
    assert attn.lambda_init == pytest.approx(0.8 - 0.6 * torch.exp(torch.tensor(-0.9)).item())


@pytest.mark.parametrize(
    "options",
    [
        dict(block_fn="parallel_scaling", qkv_bias=False, init_values=1e-5, qk_norm=True),
        dict(block_fn="parallel_scaling", attn_layer="diff", fuse_out_proj=True),
        dict(block_fn="parallel_things", init_values=0.1),
        dict(post_norm=True, init_values=0.1),
        dict(attn_layer="diff"),
    ],
)
def test_new_blocks_train_with_drop_path_and_grad_checkpointing(options):
    model = vit.create_model("vit_nano_patch4_16", num_classes=3, drop_path_rate=0.1, **options)
    model.set_grad_checkpointing(True)
    model.train()
    model(torch.randn(2, 3, 16, 16)).square().sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    set_fused_attn(model, False)  # every block's attention follows the switch, parallel blocks too
    assert not any(getattr(m, "fused_attn", False) for m in model.modules())


def test_block_options_refuse_what_they_cannot_build():
    with pytest.raises(ValueError, match="make_block"):
        Block(BlockConfig(block_fn="parallel_scaling"))
    with pytest.raises(ValueError, match="plain MLP"):
        BlockConfig(block_fn="parallel_scaling", mlp="swiglu")
    with pytest.raises(ValueError, match="post_norm"):
        BlockConfig(block_fn="parallel_things", post_norm=True)
    with pytest.raises(ValueError, match="rope"):
        vit.create_model("vit_nano_patch4_16", posemb="rope", attn_layer="diff")
    assert isinstance(vit.create_model("vit_dpwee_patch16_reg1_gap_256", depth=1).blocks[0], ParallelScalingBlock)


@pytest.mark.parametrize("block_fn", ["parallel_scaling", "parallel_things"])
def test_sharding_takes_parallel_blocks_as_units_too(block_fn):
    """ShardedStrategy shards one unit a block (vit.layers.BLOCKS): the parallel blocks are blocks too."""
    from vit.sharding import check_shardable

    check_shardable(None, vit.create_model("vit_nano_patch4_16", num_classes=3, block_fn=block_fn))
