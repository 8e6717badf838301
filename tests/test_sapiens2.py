"""Meta's Sapiens2 (timm's `*_sapiens2`, in timm.models.eva): grouped-query attention in the middle blocks,
LayerScale on the attention only, DINOv3's RoPE rescaled at random while training. Names, logits, layers."""

from __future__ import annotations

import math

import pytest
import timm
import torch
from timm.layers import AttentionRope, RmsNorm
from timm.layers.pos_embed_sincos import RotaryEmbeddingDinoV3

import vit
from tests.conftest import timm_and_ours
from vit.layers import Attention, Block, BlockConfig, KVCache, set_fused_attn
from vit.position import rope_2d_dinov3

# timm 1.0.31's parameter counts (num_classes=0, as the names come): 0.1B, 0.4B, 0.8B, "1B" and 5B.
PARAMS = {
    "vit_base_patch16_sapiens2": 113_993_472,
    "vit_large_patch16_sapiens2": 395_450_368,
    "vit_huge_patch16_sapiens2": 814_283_520,
    "vit_giant_patch16_sapiens2": 1_455_474_176,
    "vit_5b_patch16_sapiens2": 5_066_902_976,
}
# Each name at 64 wide and a few blocks, its heads-to-kv-heads layout kept: full heads first and last,
# half (or fewer) in between; the 0.1B has no grouped block at all (12 blocks <= 2 x 8 full ones).
SMALL = {
    "vit_base_patch16_sapiens2": dict(depth=2, num_heads=4, num_kv_heads=(4, 4)),
    "vit_large_patch16_sapiens2": dict(depth=3, num_heads=4, num_kv_heads=(4, 2, 4)),
    "vit_huge_patch16_sapiens2": dict(depth=4, num_heads=4, num_kv_heads=(4, 2, 2, 4)),
    "vit_giant_patch16_sapiens2": dict(depth=3, num_heads=8, num_kv_heads=(8, 4, 8)),  # head_dim 8
    "vit_5b_patch16_sapiens2": dict(depth=3, num_heads=4, num_kv_heads=(4, 1, 4)),  # one k/v head: MQA
}
IMG = (64, 48)  # portrait, as Sapiens2's 1024 x 768


def _pair(name: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    return timm_and_ours(name, 0.05, embed_dim=64, num_classes=5, img_size=IMG, **SMALL[name])


def test_every_sapiens2_name_builds_on_the_meta_device_with_timms_parameters():
    assert sorted(n for n in timm.list_models(module="eva") if "sapiens2" in n) == sorted(PARAMS)
    for name, count in PARAMS.items():
        with torch.device("meta"):
            ours, theirs = vit.create_model(name), timm.create_model(name)
        shapes = {k: v.shape for k, v in ours.named_parameters()}
        assert shapes == {k: v.shape for k, v in theirs.named_parameters()}, name
        assert ours.state_dict().keys() == theirs.state_dict().keys(), name
        assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in theirs.parameters()) == count
    # vit_large: blocks 0-7 and 16-23 full, 8-15 with 8 of 16 key/value heads; no gamma_2 anywhere.
    config = vit.model_config("vit_large_patch16_sapiens2")
    assert config.num_kv_heads == (16,) * 8 + (8,) * 8 + (16,) * 8
    with torch.device("meta"):
        large = vit.create_model("vit_large_patch16_sapiens2")
    assert large.blocks[7].attn.k_proj.weight.shape == (1024, 1024)
    assert large.blocks[8].attn.k_proj.weight.shape == large.blocks[8].attn.v_proj.weight.shape == (512, 1024)
    assert large.blocks[0].gamma_1.shape == (1024,) and all(b.gamma_2 is None for b in large.blocks)


@pytest.mark.parametrize("name", sorted(SMALL))
def test_small_sapiens2_loads_timms_state_dict_and_gives_its_logits(name):
    ours, theirs = _pair(name)
    assert ours.state_dict().keys() == theirs.state_dict().keys()  # and timm_and_ours loaded it strictly
    x = torch.randn(2, 3, *IMG)
    other = torch.randn(1, 3, 80, 32)  # another grid (5 x 2): the rotary grid follows the input
    with torch.no_grad():
        expected = theirs(x)
        torch.testing.assert_close(ours(x), expected, atol=1e-5, rtol=0)
        torch.testing.assert_close(ours(other), theirs(other), atol=1e-5, rtol=0)
        features = ours.forward_features(x)
        torch.testing.assert_close(features, theirs.forward_features(x), atol=1e-5, rtol=0)
        logits, attns = ours.forward_with_attn(x)  # the explicit path, query heads' weights
        set_fused_attn(ours, False)
        explicit = ours(x)
    assert expected.abs().max() > 0.1  # real numbers, not zeros
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(explicit, expected, atol=1e-5, rtol=0)
    heads, tokens = SMALL[name]["num_heads"], 1 + 8 + (IMG[0] // 16) * (IMG[1] // 16)  # CLS, 8 registers
    assert [a.shape for a in attns] == [(2, heads, tokens, tokens)] * len(attns)
    torch.testing.assert_close(attns[-1].sum(-1), torch.ones(2, heads, tokens))


def test_training_rescales_the_rotary_coordinates_as_timm_does():
    """timm draws one log-uniform factor in [1/2, 2] per forward for the patch coordinates; ours draws
    it the same way, so under one seed a training forward (and its gradients) is timm's."""
    name = "vit_large_patch16_sapiens2"
    ours, theirs = _pair(name)
    ours.train(), theirs.train()
    x = torch.randn(2, 3, *IMG)
    outputs = []
    for model in (ours, theirs):
        torch.manual_seed(1)
        out = model(x)
        out.square().sum().backward()
        outputs.append(out)
    torch.testing.assert_close(outputs[0], outputs[1], atol=1e-5, rtol=0)
    grad, grad_t = ours.blocks[1].attn.k_proj.weight.grad, theirs.blocks[1].attn.k_proj.weight.grad
    torch.testing.assert_close(grad, grad_t, atol=1e-4, rtol=1e-4)
    with torch.no_grad():
        torch.manual_seed(2)
        other_draw = ours(x)
        ours.eval()
        evaluated = ours(x)
    assert (outputs[0] - other_draw).abs().max() > 1e-3  # another seed, another scale
    assert (outputs[0] - evaluated).abs().max() > 1e-3  # eval does not rescale
    torch.testing.assert_close(evaluated, ours(x).detach(), atol=0, rtol=0)  # and is deterministic


def test_the_rescaled_table_is_timms_for_the_same_draw():
    """rope_2d_dinov3's coord_scale is the factor timm's RotaryEmbeddingDinoV3 draws in train mode."""
    theirs = RotaryEmbeddingDinoV3(dim=16, temperature=100, rescale_coords=2.0).train()
    torch.manual_seed(3)
    sin, cos = theirs.get_embed(shape=[3, 4]).chunk(2, dim=-1)
    torch.manual_seed(3)
    scale = torch.empty(1).uniform_(-math.log(2.0), math.log(2.0)).exp()  # timm's draw: log-uniform in [1/2, 2]
    ours = rope_2d_dinov3((3, 4), 16, 100.0, coord_scale=scale)
    assert torch.equal(ours[0], cos) and torch.equal(ours[1], sin)
    assert abs(scale.item() - 1) > 0.05 and not torch.equal(ours[0], rope_2d_dinov3((3, 4), 16, 100.0)[0])


# -- the layers ------------------------------------------------------------------------------------


def _perturbed(module: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return module.eval()


def test_grouped_query_attention_is_timms_attention_rope():
    theirs = _perturbed(
        AttentionRope(32, num_heads=4, qkv_fused=False, num_prefix_tokens=1, norm_layer=RmsNorm, qk_norm=True,
                      rotate_half=True, num_kv_heads=2)
    )  # fmt: skip
    ours = Attention(32, num_heads=4, qkv_fused=False, qk_norm=True, norm="rmsnorm", num_kv_heads=2).eval()
    ours.load_state_dict(theirs.state_dict())  # strict: q_proj (32, 32), k_proj and v_proj (16, 32)
    assert ours.k_proj.weight.shape == ours.v_proj.weight.shape == (16, 32)
    x, table = torch.randn(2, 1 + 6, 32), rope_2d_dinov3((2, 3), 8, 100.0)
    with torch.no_grad():
        expected = theirs(x, rope=torch.cat([table[1], table[0]], dim=-1))  # timm's: sin then cos
        torch.testing.assert_close(ours(x, rope=table), expected, atol=1e-6, rtol=0)
        explicit, weights = ours(x, rope=table, return_attn=True)
    torch.testing.assert_close(explicit, expected, atol=1e-6, rtol=0)
    assert weights.shape == (2, 4, 7, 7)


def test_grouped_query_attention_is_multi_head_attention_with_shared_keys_and_values():
    """Query heads 2g and 2g + 1 read key/value head g: the same as 4 full heads whose k and v
    projections repeat each group's rows."""
    gqa = _perturbed(Attention(32, num_heads=4, qkv_fused=False, num_kv_heads=2))
    mha = Attention(32, num_heads=4, qkv_fused=False).eval()
    state = gqa.state_dict()
    for key in ("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias"):
        state[key] = state[key].unflatten(0, (2, 8)).repeat_interleave(2, dim=0).flatten(0, 1)  # heads 0,0,1,1
    mha.load_state_dict(state)
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        torch.testing.assert_close(gqa(x), mha(x), atol=1e-6, rtol=0)
        torch.testing.assert_close(gqa(x, return_attn=True)[1], mha(x, return_attn=True)[1], atol=1e-6, rtol=0)


def test_grouped_query_attention_caches_the_fewer_heads():
    attn = _perturbed(Attention(32, num_heads=4, qkv_fused=False, num_kv_heads=1, causal=True))
    x, cache = torch.randn(1, 6, 32), KVCache()
    with torch.no_grad():
        full = attn(x)
        steps = torch.cat([attn(x[:, i : i + 1], kv_cache=cache) for i in range(6)], dim=1)
    torch.testing.assert_close(steps, full, atol=1e-6, rtol=0)
    assert cache.k.shape == cache.v.shape == (1, 1, 6, 8)


@pytest.mark.parametrize("layer_scale", ["gamma", "ls"])
def test_attn_only_layer_scale_scales_the_attention_branch_only(layer_scale):
    config = BlockConfig(
        embed_dim=32, num_heads=2, init_values=0.5, layer_scale=layer_scale, attn_only_layer_scale=True
    )
    block = Block(config).eval()
    names = {n for n, _ in block.named_parameters()}
    assert names & {"gamma_1", "ls1.gamma"} and not names & {"gamma_2", "ls2.gamma"}
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        y = x + 0.5 * block.attn(block.norm1(x))
        torch.testing.assert_close(block(x), y + block.mlp(block.norm2(y)), atol=1e-6, rtol=0)


def test_configs_refuse_what_grouped_query_attention_and_the_rescaling_do_not_fit():
    with pytest.raises(ValueError, match="must divide num_heads"):
        BlockConfig(embed_dim=32, num_heads=4, num_kv_heads=3, qkv_fused=False)
    with pytest.raises(ValueError, match="needs qkv_fused=False"):
        BlockConfig(embed_dim=32, num_heads=4, num_kv_heads=2)
    with pytest.raises(ValueError, match="one count per block"):
        vit.create_model("vit_large_patch16_sapiens2", depth=2)  # timm refuses it too: 24 counts for 2 blocks
    with pytest.raises(ValueError, match="one count for every block"):
        vit.GPTConfig(qkv_fused=False, num_kv_heads=(6, 3, 3, 3, 3, 6))
    with pytest.raises(ValueError, match="rope_rescale_coords is a factor >= 1 of rope_type='dinov3'"):
        vit.create_model("eva02_tiny_patch14_224", rope_rescale_coords=2.0)
