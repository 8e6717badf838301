"""The shared building blocks: patch embedding, the two attention paths, drop-path, the Block."""

from __future__ import annotations

import inspect

import pytest
import torch

from vit.layers import (
    BLOCKS,
    Attention,
    AttnArgs,
    Block,
    BlockConfig,
    DropPath,
    LayerScale,
    ParallelScalingBlock,
    ParallelThingsBlock,
    PatchEmbed,
    ResPostBlock,
    WindowBlock,
    block_class,
    make_block,
)
from vit.layers.attention import _AttentionBase


def test_patch_embed_is_a_strided_conv_flattened_row_major():
    embed = PatchEmbed(img_size=32, patch_size=8, in_chans=3, embed_dim=16)
    x = torch.randn(2, 3, 32, 32)
    tokens = embed(x)
    assert tokens.shape == (2, 16, 16)
    # token (row 1, col 2) is the conv of the patch at pixels [8:16, 16:24]
    patch = x[:, :, 8:16, 16:24]
    expected = torch.einsum("bchw,dchw->bd", patch, embed.proj.weight) + embed.proj.bias
    torch.testing.assert_close(tokens[:, 1 * 4 + 2], expected, atol=1e-5, rtol=1e-5)


def test_patch_embed_rejects_sizes_not_divisible_by_the_patch():
    with pytest.raises(ValueError, match="30x30 is not divisible by patch size 8x8"):
        PatchEmbed(img_size=32, patch_size=8)(torch.randn(1, 3, 30, 30))
    # built for 30 px (timm builds SigLIP at 384 with 14-px patches): the conv leaves the remainder out
    assert PatchEmbed(img_size=30, patch_size=8, embed_dim=4)(torch.randn(1, 3, 30, 30)).shape == (1, 9, 4)


def _reference_attention(attn: Attention, x, mask=None, causal=False):
    """softmax(QK^T / sqrt(d) + mask) V written out by hand."""
    B, N, C = x.shape
    h, d = attn.num_heads, C // attn.num_heads
    q, k, v = attn.qkv(x).split(C, dim=-1)
    q, k, v = (t.reshape(B, N, h, d).transpose(1, 2) for t in (q, k, v))
    scores = q @ k.transpose(-1, -2) / d**0.5
    if causal:
        scores = scores.masked_fill(torch.ones(N, N).triu(1).bool(), float("-inf"))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    weights = scores.softmax(-1)
    out = (weights @ v).transpose(1, 2).reshape(B, N, C)
    return attn.proj(out), weights


MASKS = {
    "none": lambda B, N: None,
    "bool": lambda B, N: (torch.rand(B, 1, N, N) > 0.3) | torch.eye(N, dtype=torch.bool),
    "float": lambda B, N: torch.randn(B, 1, N, N),
}


@pytest.mark.parametrize("mask_kind", MASKS)
@pytest.mark.parametrize("causal", [False, True])
def test_fused_and_explicit_attention_agree_with_the_formula(mask_kind, causal):
    attn = Attention(dim=32, num_heads=4, causal=causal).eval()
    x = torch.randn(3, 10, 32)
    mask = MASKS[mask_kind](3, 10)
    expected, expected_weights = _reference_attention(attn, x, mask, causal)

    attn.fused_attn = True
    fused = attn(x, attn_mask=mask)
    attn.fused_attn = False
    explicit, weights = attn(x, attn_mask=mask, return_attn=True)

    torch.testing.assert_close(fused, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(explicit, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(weights, expected_weights, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(weights.sum(-1), torch.ones(3, 4, 10))


@pytest.mark.parametrize("mask_kind", MASKS)
@pytest.mark.parametrize("causal", [False, True])
def test_under_cpu_bf16_autocast_the_fused_path_attends_in_fp32(mask_kind, causal):
    """PyTorch's CPU flash kernel is several times slower in bf16 than in fp32 at ViT lengths, so the
    fused path attends in fp32 there: the output is only the fp32 result rounded to bf16."""
    attn = Attention(dim=32, num_heads=4, causal=causal)
    q, k, v = (torch.randn(3, 4, 10, 8).bfloat16().requires_grad_() for _ in range(3))
    mask = MASKS[mask_kind](3, 10)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = attn.attention(q, k, v, attn_mask=mask, is_causal=causal)
    scores = q.double() @ k.double().transpose(-1, -2) / 8**0.5
    if causal:
        scores = scores.masked_fill(torch.ones(10, 10).triu(1).bool(), float("-inf"))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.double()
    expected = (scores.softmax(-1) @ v.double()).transpose(1, 2).reshape(3, 10, 32)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), expected, rtol=2**-8, atol=1e-6)  # one bf16 rounding
    out.float().sum().backward()
    assert all(t.grad is not None and t.grad.dtype == torch.bfloat16 for t in (q, k, v))


def test_return_attn_uses_the_explicit_path_while_fused_stays_on():
    attn = Attention(dim=32, num_heads=4).eval()
    x = torch.randn(2, 5, 32)
    out, weights = attn(x, return_attn=True)
    assert attn.fused_attn  # not switched off
    assert weights.shape == (2, 4, 5, 5)
    torch.testing.assert_close(out, attn(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fused", [True, False])
def test_num_queries_is_slicing_the_output_for_less_work(fused):
    block = Block(BlockConfig(embed_dim=24, num_heads=3, init_values=0.5)).eval()
    block.attn.fused_attn = fused
    x = torch.randn(2, 7, 24)
    torch.testing.assert_close(block(x, num_queries=1), block(x)[:, :1], atol=1e-6, rtol=1e-5)
    out, weights = block(x, return_attn=True, num_queries=2)
    full_out, full_weights = block(x, return_attn=True)
    torch.testing.assert_close(out, full_out[:, :2], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(weights, full_weights[:, :, :2])
    with pytest.raises(ValueError, match="unmasked"):
        Block(BlockConfig(embed_dim=24, num_heads=3), causal=True)(x, num_queries=1)


@pytest.mark.parametrize("mlp", ["gelu", "swiglu"])
def test_mean_from_is_the_mean_of_the_output_for_less_work(mlp):
    """Average pooling straight after a block: fc2 on the mean hidden state gives the mean of the
    block's outputs and the same gradients; in training with drop path, under the same seed, too."""
    block = Block(BlockConfig(embed_dim=24, num_heads=3, init_values=0.5, mlp=mlp))
    x = torch.randn(4, 7, 24, requires_grad=True)
    for training in (False, True):
        block.train(training)
        if training:
            block.drop_path1 = block.drop_path2 = DropPath(0.5)
        torch.manual_seed(0)
        pooled = block(x, mean_from=2)
        (pooled_grad,) = torch.autograd.grad(pooled.square().sum(), x)
        torch.manual_seed(0)
        full = block(x)[:, 2:].mean(dim=1)
        (full_grad,) = torch.autograd.grad(full.square().sum(), x)
        torch.testing.assert_close(pooled, full, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(pooled_grad, full_grad, atol=1e-6, rtol=1e-5)
    flops = []
    for kwargs in ({"mean_from": 2}, {}):
        with torch.utils.flop_counter.FlopCounterMode(display=False) as counter:
            block(x, **kwargs)
        flops.append(counter.get_total_flops())
    assert flops[0] < 0.8 * flops[1]  # fc2 once an image, not once a token
    post_norm = make_block(BlockConfig(embed_dim=24, num_heads=3, post_norm=True))
    assert isinstance(post_norm, ResPostBlock) and not post_norm.can_mean()
    with pytest.raises(TypeError, match="mean_from"):  # a post-norm block's forward has no such shortcut
        post_norm(x, mean_from=0)
    with pytest.raises(ValueError, match="mean_from needs"):
        Block(BlockConfig(embed_dim=24, num_heads=3, proj_drop_rate=0.1)).train()(x, mean_from=0)


def test_drop_path_drops_whole_samples_and_keeps_the_expectation():
    drop = DropPath(0.25)
    x = torch.ones(4000, 3, 2)
    assert torch.equal(drop.eval()(x), x)
    y = drop.train()(x)
    per_sample = y.flatten(1)
    # each sample is either dropped entirely or scaled by 1/keep_prob
    torch.testing.assert_close(per_sample.unique(), torch.tensor([0.0, 1 / 0.75]))
    assert (per_sample == per_sample[:, :1]).all()
    assert abs(y.mean().item() - 1.0) < 0.05


def test_block_is_pre_norm_with_two_residuals():
    block = Block(BlockConfig(embed_dim=24, num_heads=3, init_values=0.5)).eval()
    x = torch.randn(2, 7, 24)
    h = x + block.ls1(block.attn(block.norm1(x)))
    expected = h + block.ls2(block.mlp(block.norm2(h)))
    torch.testing.assert_close(block(x), expected)
    assert isinstance(block.ls1, LayerScale) and torch.equal(block.ls1.gamma, torch.full((24,), 0.5))


def test_a_causal_block_equals_the_same_block_given_a_causal_mask():
    config = BlockConfig(embed_dim=16, num_heads=2)
    block, causal_block = Block(config).eval(), Block(config, causal=True).eval()
    causal_block.load_state_dict(block.state_dict())
    x = torch.randn(1, 6, 16)
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    torch.testing.assert_close(causal_block(x), block(x, attn_mask=causal), atol=1e-6, rtol=1e-5)
    assert not torch.allclose(causal_block(x), block(x), atol=1e-4)


@pytest.mark.parametrize(
    ("options", "cls"),
    [
        ({}, Block),
        ({"post_norm": True, "init_values": 0.5}, ResPostBlock),
        ({"window_size": 2}, WindowBlock),
        ({"block_fn": "parallel_scaling"}, ParallelScalingBlock),
        ({"block_fn": "parallel_things"}, ParallelThingsBlock),
    ],
)
def test_make_block_builds_the_class_the_config_describes_and_every_one_is_a_block(options, cls):
    config = BlockConfig(embed_dim=24, num_heads=3, **options)
    block = make_block(config, grid=(3, 3))
    assert type(block) is cls and block_class(config) is cls
    assert isinstance(block, BLOCKS)  # what sharding wraps and checkpointing recomputes, one unit a block
    assert block(torch.randn(2, 9, 24)).shape == (2, 9, 24)
    if cls is not Block:
        with pytest.raises(ValueError, match=r"build blocks with vit\.layers\.make_block"):
            Block(config, grid=(3, 3))


def test_a_post_norm_block_normalises_each_branch_after_it():
    block = make_block(BlockConfig(embed_dim=24, num_heads=3, post_norm=True, init_values=0.5)).eval()
    x = torch.randn(2, 7, 24)
    h = x + block.norm1(block.attn(x))
    torch.testing.assert_close(block(x), h + block.norm2(block.mlp(h)))
    assert torch.equal(block.norm1.weight, torch.full((24,), 0.5)) and block.gamma_1 is None  # no LayerScale
    with pytest.raises(ValueError, match="window_size is an option of pre-norm blocks"):
        BlockConfig(post_norm=True, window_size=2)


def test_attn_args_lists_every_keyword_the_attention_core_takes():
    """One list of what a call tells the attention (AttnArgs); blocks and layers pass it through as is."""
    core = inspect.signature(_AttentionBase.self_attention).parameters
    assert set(AttnArgs.__annotations__) == set(core) - {"self", "qkv", "attn_mask"}
    for cls in (Attention, Block, ResPostBlock, WindowBlock, ParallelScalingBlock, ParallelThingsBlock):
        kinds = {p.name: p.kind for p in inspect.signature(cls.forward).parameters.values()}
        assert kinds.get("kw") is inspect.Parameter.VAR_KEYWORD, cls
