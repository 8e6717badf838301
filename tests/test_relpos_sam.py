"""timm's relative-position ViTs (vision_transformer_relpos) and SAM encoders (vision_transformer_sam) on
our VisionTransformer and Block: names, parameters, logits and feature maps against timm's."""

from __future__ import annotations

import pytest
import timm
import torch
import torch.nn.functional as F

import vit
from tests.conftest import timm_and_ours
from vit.layers import Attention, BlockConfig, WindowBlock, make_block, window_partition, window_unpartition

RELPOS_NAMES = timm.list_models(module="vision_transformer_relpos")
SAM_NAMES = timm.list_models(module="vision_transformer_sam")


SMALL = dict(depth=2, embed_dim=64, num_heads=2, num_classes=5)


def _pair(name: str, **kwargs) -> tuple[torch.nn.Module, torch.nn.Module]:
    return timm_and_ours(name, 0.1, **{**SMALL, **kwargs})


def test_every_relpos_and_sam_name_is_built():
    assert len(RELPOS_NAMES) == 14 and len(SAM_NAMES) == 4  # timm 1.0.31; another timm: recount in docs/models.md
    assert set(RELPOS_NAMES + SAM_NAMES) <= set(vit.list_models())
    assert isinstance(vit.create_model("vit_srelpos_small_patch16_224", depth=1), vit.VisionTransformerRelPos)
    assert isinstance(vit.create_model("samvit_base_patch16_224", depth=1), vit.Sam)


def test_timms_vit_family_count():
    """The count docs/models.md and README give: timm 1.0.31's 7 ViT-family modules, 290 of 290 names."""
    modules = ("vision_transformer", "deit", "vision_transformer_hybrid", "eva", "vision_transformer_relpos",
               "vision_transformer_sam", "naflexvit")  # fmt: skip
    names = [n for m in modules for n in timm.list_models(module=m)]
    built = set(vit.list_models())
    unsupported = vit.registry.unsupported_models()
    # A changed private builder of timm's shows here with the reason ("could not be read from timm ...").
    refused = {n: unsupported.get(n, "neither built nor listed unsupported") for n in names if n not in built}
    assert refused == {}, refused
    assert len(names) == 290


@pytest.mark.parametrize("name", RELPOS_NAMES + SAM_NAMES)
def test_full_size_names_and_shapes_are_timms(name):
    with torch.device("meta"):
        ours, theirs = vit.create_model(name, num_classes=7), timm.create_model(name, num_classes=7)
    assert {k: v.shape for k, v in ours.named_parameters()} == {k: v.shape for k, v in theirs.named_parameters()}
    assert ours.state_dict().keys() == theirs.state_dict().keys()  # the index buffers are not saved, as timm's


@pytest.mark.parametrize("name", RELPOS_NAMES)
def test_relpos_models_give_timms_logits_on_both_attention_paths(name):
    ours, theirs = _pair(name, img_size=64, **({"rel_pos_dim": 32} if "srelpos" in name else {}))
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        expected = theirs(x)
        torch.testing.assert_close(ours(x), expected, atol=1e-5, rtol=0)
        torch.testing.assert_close(ours.forward_features(x), theirs.forward_features(x), atol=1e-5, rtol=0)
        logits, attns = ours.forward_with_attn(x)  # the explicit path: the bias added to the scores
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=0)
    n = ours.num_prefix_tokens + (64 // ours.config.patch_size) ** 2
    assert len(attns) == 2 and all(a.shape == (2, 2, n, n) for a in attns)
    assert expected.abs().max() > 0.1  # a comparison of real numbers, not of zeros


@pytest.mark.parametrize("name", SAM_NAMES)
@pytest.mark.parametrize(("img_size", "num_classes"), [(64, 5), (80, 0)])  # 80: a 5x5 grid, padded windows
def test_sam_encoders_give_timms_features_and_logits(name, img_size, num_classes):
    ours, theirs = _pair(
        name, img_size=img_size, num_classes=num_classes, depth=3, window_size=2, global_attn_indexes=(1,)
    )
    x = torch.randn(2, 3, img_size, img_size)
    with torch.no_grad():
        features = theirs.forward_features(x)  # the neck's map
        torch.testing.assert_close(ours.forward_features(x), features, atol=1e-5, rtol=0)
        expected = theirs(x)
        torch.testing.assert_close(ours(x), expected, atol=1e-5, rtol=0)
        logits, attns = ours.forward_with_attn(x)
        raw = ours.forward_with_attn(x, raw=True)[1]
        final, feats = ours.forward_intermediates(x, indices=[0, 2], norm=True)
        final_t, feats_t = theirs.forward_intermediates(x, indices=[0, 2], norm=True)
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(final, final_t, atol=1e-5, rtol=0)
    for ours_map, theirs_map in zip(feats, feats_t, strict=True):
        torch.testing.assert_close(ours_map, theirs_map, atol=1e-5, rtol=0)
    side = img_size // 16
    windows = 2 * (-(-side // 2)) ** 2
    assert [a.shape for a in raw] == [(windows, 2, 4, 4), (2, 2, side**2, side**2), (windows, 2, 4, 4)]
    assert all(a.shape == (2, 2, side**2, side**2) for a in attns)  # windows placed on the grid
    assert features.abs().max() > 0.1


@pytest.mark.parametrize(
    ("name", "kwargs"),
    [
        ("vit_relpos_base_patch16_cls_224", {}),
        ("vit_srelpos_small_patch16_224", {"rel_pos_dim": 32}),
        ("samvit_base_patch16_224", {"depth": 3, "window_size": 2, "global_attn_indexes": (1,)}),
    ],
)
def test_with_dynamic_img_size_other_grids_give_timms_logits(name, kwargs):
    """Built at 64 px with dynamic_img_size=True, at 96 and 80x112 px (windows padded): SAM's as timm's,
    which resamples its positions and global blocks' relative positions in every forward; relpos's as
    timm's after set_input_size, its MLP read at the new grid's offsets."""
    ours, theirs = _pair(name, img_size=64, **kwargs)
    dynamic = vit.create_model(name, **{**SMALL, "img_size": 64, **kwargs}, dynamic_img_size=True).eval()
    dynamic.load_state_dict(ours.state_dict())
    for size in ((96, 96), (80, 112)):
        if not name.startswith("sam"):
            theirs.set_input_size(img_size=size)
        x = torch.randn(2, 3, *size)
        with torch.no_grad():
            expected = theirs(x)
            torch.testing.assert_close(dynamic(x), expected, atol=1e-5, rtol=0)
        assert expected.abs().max() > 0.1
    with pytest.raises(ValueError, match="build it with that img_size, or with dynamic_img_size=True"):
        ours(torch.randn(1, 3, 96, 96))


def _sams_get_rel_pos_table(rel_pos: torch.Tensor, q_size: int, k_size: int) -> torch.Tensor:
    """segment_anything's get_rel_pos: the (L, C) table linearly interpolated to 2 max(q, k) - 1 rows."""
    n = 2 * max(q_size, k_size) - 1
    resized = F.interpolate(rel_pos.reshape(1, rel_pos.shape[0], -1).permute(0, 2, 1), size=n, mode="linear")
    return resized.reshape(-1, n).permute(1, 0)


def test_sam_weights_load_at_another_img_size_with_sams_resized_relative_positions(tmp_path):
    """SAM-style weights of a 64 px model (a 4x4 grid: global tables of 7 offsets) loaded at 64 px as they
    are, and at 96 px (6x6: 11 offsets): the global block's tables as SAM's get_rel_pos resizes them, the
    windowed blocks' kept, the grid's positions resampled as timm's SAM does; the logits are then those
    timm's 64 px model gives a 96 px image, as it resizes both in every forward."""
    from vit.checkpoint import load_pretrained

    small = dict(SMALL, depth=3, window_size=2, global_attn_indexes=(1,))
    _, theirs = _pair("samvit_base_patch16", img_size=64, **small)
    torch.save(theirs.state_dict(), tmp_path / "sam64.pth")
    same = vit.create_model("samvit_base_patch16", img_size=64, **small).eval()
    assert load_pretrained(same, tmp_path / "sam64.pth").resampled == []
    bigger = vit.create_model("samvit_base_patch16", img_size=96, **small).eval()
    report = load_pretrained(bigger, tmp_path / "sam64.pth")
    assert report.resampled == [
        "pos_embed (grid 4x4 -> 6x6)", "blocks.1.attn.rel_pos_h (7 -> 11 offsets)",
        "blocks.1.attn.rel_pos_w (7 -> 11 offsets)",
    ]  # fmt: skip
    source = theirs.state_dict()
    for name in ("blocks.1.attn.rel_pos_h", "blocks.1.attn.rel_pos_w"):
        torch.testing.assert_close(bigger.state_dict()[name], _sams_get_rel_pos_table(source[name], 6, 6))
    for name in ("blocks.0.attn.rel_pos_h", "blocks.2.attn.rel_pos_w"):  # windows of 2: 3 offsets, kept
        assert torch.equal(bigger.state_dict()[name], source[name])
    with torch.no_grad():
        x = torch.randn(2, 3, 64, 64)
        torch.testing.assert_close(same(x), theirs(x), atol=1e-5, rtol=0)
        x = torch.randn(2, 3, 96, 96)
        expected = theirs(x)
        torch.testing.assert_close(bigger(x), expected, atol=1e-5, rtol=0)
    assert expected.abs().max() > 0.1


@pytest.mark.parametrize("rel_pos_type", ["bias", "mlp", "mlp_swin", "decomposed"])
def test_relative_positions_keep_both_attention_paths_equal(rel_pos_type):
    prefix = 0 if rel_pos_type == "decomposed" else 1
    attn = Attention(32, num_heads=2, rel_pos_type=rel_pos_type, grid=(3, 4), num_prefix_tokens=prefix).eval()
    with torch.no_grad():
        for p in attn.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    x = torch.randn(2, prefix + 12, 32)
    with torch.no_grad():
        fused = attn(x)
        explicit, weights = attn(x, return_attn=True)
        plain = attn.position_bias(attn._heads(x))
    torch.testing.assert_close(explicit, fused, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 2, prefix + 12))
    assert plain.abs().max() > 0  # a bias, not zeros
    if prefix:  # CLS pooling: the first query alone, its row of the bias
        with torch.no_grad():
            torch.testing.assert_close(attn(x, num_queries=1), fused[:, :1], atol=1e-6, rtol=1e-5)


def test_windowed_weights_placed_on_the_grid_give_the_windowed_attentions_output():
    """A 5x5 grid in windows of 2 (padded to 6x6): each token's weights on its own window's tokens,
    zero elsewhere; times the tokens' values they give what the block's attention computed."""
    torch.manual_seed(0)
    block = make_block(BlockConfig(embed_dim=32, num_heads=2, window_size=2, qkv_bias=False), grid=(5, 5)).eval()
    assert isinstance(block, WindowBlock)
    x = torch.randn(3, 25, 32)
    computed = []  # the attention's output before its projection, per window
    hook = block.attn.proj.register_forward_hook(lambda m, args, out: computed.append(args[0]))
    with torch.no_grad():
        _, raw = block(x, return_attn=True)
    hook.remove()
    assert raw.shape == (3 * 9, 2, 4, 4)
    weights = block.grid_attention(raw)
    assert weights.shape == (3, 2, 25, 25)
    window = (torch.arange(5)[:, None] // 2 * 3 + torch.arange(5) // 2).flatten()  # each token's window
    assert (weights[:, :, window[:, None] != window[None, :]] == 0).all()
    with torch.no_grad():  # without a qkv bias the padding's values are zero: the real tokens' suffice
        v = block.attn.qkv(block.norm1(x)).unflatten(-1, (3, 2, 16))[:, :, 2].transpose(1, 2)  # (3, heads, 25, 16)
    expected = window_unpartition(computed[0], (5, 5), (6, 6), 2)
    torch.testing.assert_close((weights @ v).transpose(1, 2).flatten(2), expected, atol=1e-6, rtol=0)


def test_window_partition_round_trips_and_pads_the_bottom_right():
    x = torch.randn(2, 5 * 7, 8)
    windows, padded = window_partition(x, (5, 7), 3)
    assert windows.shape == (2 * 2 * 3, 9, 8) and padded == (6, 9)
    assert torch.equal(window_unpartition(windows, (5, 7), padded, 3), x)
    assert torch.equal(windows[0, :3], x[0, :3]) and torch.equal(windows[0, 3:6], x[0, 7:10])  # row-major


def test_windowed_relpos_blocks_train_with_drop_path_and_grad_checkpointing():
    for name in ("vit_relpos_small_patch16_rpn_224", "vit_srelpos_small_patch16_224", "samvit_base_patch16"):
        kwargs = dict(img_size=64, depth=2, num_classes=3, drop_path_rate=0.1)
        if name.startswith("sam"):
            kwargs.update(window_size=3, global_attn_indexes=(1,), embed_dim=64, num_heads=2)
        model = vit.create_model(name, **kwargs)
        model.set_grad_checkpointing(True)
        model.train()
        model(torch.randn(2, 3, 64, 64)).square().sum().backward()
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters()), name


def test_relative_positions_and_windows_refuse_what_they_cannot_do():
    with pytest.raises(ValueError, match="block_fn='block'"):
        BlockConfig(rel_pos_type="mlp", block_fn="parallel_things")
    with pytest.raises(ValueError, match="unknown rel_pos_type"):
        BlockConfig(rel_pos_type="rope")
    with pytest.raises(ValueError, match="grid"):
        make_block(BlockConfig(embed_dim=32, num_heads=2, window_size=2))
    with pytest.raises(ValueError, match="patch_drop_rate"):
        vit.create_model("vit_relpos_small_patch16_224", patch_drop_rate=0.5)
    with pytest.raises(ValueError, match="build it with that img_size"):
        vit.create_model("samvit_base_patch16_224", depth=1, embed_dim=64, num_heads=2)(torch.zeros(1, 3, 240, 240))
