"""timm's NaFlexVit (timm.models.naflexvit) on our VisionTransformer and Block: names, parameters, and
logits against timm's, on image batches and on padded patch sequences."""

from __future__ import annotations

import pytest
import timm
import torch
import torch.nn.functional as F

import vit
from tests.conftest import timm_and_ours
from vit.naflex import NaFlexEmbeds, interpolation_weights, pack, patchify

NAFLEX_NAMES = timm.list_models(module="naflexvit")
SMALL = dict(depth=2, embed_dim=64, num_heads=2, num_classes=5)


def _pair(name: str, **kwargs) -> tuple[torch.nn.Module, torch.nn.Module]:
    return timm_and_ours(name, 0.1, **{**SMALL, **kwargs})


def _sequences(sizes: list[tuple[int, int]], length: int) -> dict[str, torch.Tensor]:
    """timm's NaFlex batch of random images of `sizes`, padded with random values, which must not matter."""
    batch = pack([torch.randn(3, h, w) for h, w in sizes], length=length)
    batch["patches"][~batch["patch_valid"]] = torch.randn(int((~batch["patch_valid"]).sum()), 768)
    return batch


def test_every_naflexvit_name_is_built():
    assert len(NAFLEX_NAMES) == 14  # timm 1.0.31; another timm: recount in docs/models.md
    assert set(NAFLEX_NAMES) <= set(vit.list_models())
    model = vit.create_model("naflexvit_base_patch16_gap", depth=1)
    assert isinstance(model, vit.NaFlexVit) and model.embeds.pos_embed.shape == (1, 16, 16, 768)
    config = vit.model_config("naflexvit_so400m_patch16_radio_v4")
    assert (config.reg_tokens, config.pos_embed_grid_size, config.global_pool, config.final_norm) == (
        9, (128, 128), "token", False,
    )  # fmt: skip


@pytest.mark.parametrize("name", NAFLEX_NAMES)
def test_full_size_names_have_timms_parameters(name):
    """On the meta device: no memory, no arithmetic."""
    with torch.device("meta"):
        ours, theirs = vit.create_model(name), timm.create_model(name)
    assert {k: v.shape for k, v in ours.named_parameters()} == {k: v.shape for k, v in theirs.named_parameters()}
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    count = sum(p.numel() for p in theirs.parameters())
    assert sum(p.numel() for p in ours.parameters()) == count and count > 80e6


@pytest.mark.parametrize("name", NAFLEX_NAMES)
def test_image_batches_give_timms_logits_at_any_size(name):
    """The 16 x 16 position table as it is (256 px), resampled down (64 px) and to another aspect (48 x 80)."""
    ours, theirs = _pair(name)
    for size in ((256, 256), (64, 64), (48, 80)):
        x = torch.randn(2, 3, *size)
        with torch.no_grad():
            expected = theirs(x)
            torch.testing.assert_close(ours(x), expected, atol=1e-5, rtol=0)
            torch.testing.assert_close(ours.forward_features(x), theirs.forward_features(x), atol=1e-5, rtol=0)
        assert expected.abs().max() > 0.1  # a comparison of real numbers, not of zeros


@pytest.mark.parametrize("name", NAFLEX_NAMES)
def test_padded_patch_sequences_give_timms_logits(name):
    ours, theirs = _pair(name)
    batch = _sequences([(48, 80), (64, 64), (32, 96)], length=20)  # 15, 16 and 12 real patches
    with torch.no_grad():
        expected = theirs(batch)
        torch.testing.assert_close(ours(batch), expected, atol=1e-5, rtol=0)
        args = batch["patches"], batch["patch_coord"], batch["patch_valid"]
        features, features_t = ours.forward_features(*args), theirs.forward_features(*args)
    real = torch.nn.functional.pad(batch["patch_valid"], (ours.num_prefix_tokens, 0), value=True)
    torch.testing.assert_close(features["patches"][real], features_t["patches"][real], atol=1e-5, rtol=0)
    assert expected.abs().max() > 0.1


@pytest.mark.parametrize(
    "name", ["naflexvit_base_patch16_gap", "naflexvit_base_patch16_map", "naflexvit_base_patch16_radio_v3"]
)
def test_a_padded_sequence_gives_each_images_own_logits(name):
    """The padding is masked out of the attention and the pooling: an image packed with others and
    padding gets the logits it gets alone, as an image."""
    model, _ = _pair(name)
    images = [torch.randn(3, 48, 80), torch.randn(3, 32, 32)]
    batch = pack(images, length=18)  # 15 and 4 patches
    batch["patches"][~batch["patch_valid"]] = 100.0  # padding far from any real patch
    with torch.no_grad():
        packed = model(batch)
        for b, image in enumerate(images):
            torch.testing.assert_close(packed[b], model(image[None])[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["naflexvit_base_patch16_gap", "naflexvit_base_patch16_radio_v3"])  # no prefix; CLS+7
def test_padded_patch_sequences_give_timms_intermediates(name):
    """Per token ("NLC": each image its own grid), padding included; timm's tuple and dict forms."""
    ours, theirs = _pair(name)
    batch = _sequences([(48, 80), (64, 64), (32, 96)], length=20)  # 15, 16 and 12 real patches
    real = batch["patch_valid"]
    with_prefix = F.pad(real, (ours.num_prefix_tokens, 0), value=True)
    with torch.no_grad():
        final, feats = ours.forward_intermediates(batch, indices=2, norm=True, output_fmt="NLC")
        final_t, feats_t = theirs.forward_intermediates(batch, indices=2, norm=True, output_fmt="NLC")
        kwargs = dict(indices=[0], return_prefix_tokens=True, output_fmt="NLC", output_dict=True)
        result, result_t = ours.forward_intermediates(batch, **kwargs), theirs.forward_intermediates(batch, **kwargs)
    assert [f.shape for f in feats] == [(3, 20, 64)] * 2
    for mine, timms in zip(feats, feats_t, strict=True):
        torch.testing.assert_close(mine[real], timms[real], atol=1e-5, rtol=0)
    torch.testing.assert_close(final[with_prefix], final_t[with_prefix], atol=1e-5, rtol=0)
    assert result.keys() == result_t.keys()
    assert torch.equal(result["patch_valid"], result_t["patch_valid"])
    torch.testing.assert_close(result["image_intermediates"][0][real], result_t["image_intermediates"][0][real])
    torch.testing.assert_close(result["image_features"][with_prefix], result_t["image_features"][with_prefix])
    if ours.num_prefix_tokens:
        torch.testing.assert_close(result["image_intermediates_prefix"], result_t["image_intermediates_prefix"])
    with torch.no_grad():  # the same sequences as arguments
        coord = batch["patch_coord"]
        _, same = ours.forward_intermediates(batch["patches"], 2, False, True, output_fmt="NLC", patch_coord=coord,
                                             patch_valid=real)  # fmt: skip
    assert all(torch.equal(a, b) for a, b in zip(same, feats, strict=True))
    for model in (ours, theirs):
        with pytest.raises(ValueError, match="NLC"):
            model.forward_intermediates(batch)  # NCHW: no one grid


def test_positions_are_timms_resampling_of_the_tables():
    """A 4 x 4 table is the 4 x 4 grid's positions; other grids resample it (bicubic, antialiased down),
    or, preserving the aspect, resample to the longer side's square and keep its top-left corner."""
    config = vit.model_config("naflexvit_base_patch16_gap", embed_dim=8, num_heads=2, pos_embed_grid_size=(4, 4))
    embeds = NaFlexEmbeds(config)
    table = embeds.pos_embed
    torch.testing.assert_close(embeds.positions((4, 4), torch.float32), table.reshape(1, 16, 8))
    plain = torch.nn.functional.interpolate(table.permute(0, 3, 1, 2), size=(2, 6), mode="bicubic", antialias=True)
    torch.testing.assert_close(embeds.positions((2, 6), torch.float32), plain.flatten(2).transpose(1, 2))
    embeds.ar_preserving = True
    square = torch.nn.functional.interpolate(table.permute(0, 3, 1, 2), size=(6, 6), mode="bicubic", antialias=True)
    expected = square[:, :, :2, :6].flatten(2).transpose(1, 2)
    torch.testing.assert_close(embeds.positions((2, 6), torch.float32), expected)


@pytest.mark.parametrize("name", NAFLEX_NAMES)
def test_per_token_positions_are_the_per_grid_resampling(name):
    """token_positions (the exported graph's, tensor operations only) gives each token of a padded batch
    the position the per-grid resampling gives it: each name's tables (16x16, radio's 128x128,
    factorized; and a 6x9 one) and resampling (bicubic or bilinear, antialiased or not, corners aligned
    or not, aspect-preserving), grids of 3x5, 8x8, 6x9, 1x1 and 2x6 patches, tokens past a grid.
    Unit-variance tables: the two differ by float32's rounding of the sample points (up to 7e-5 on
    radio's, as far as F.interpolate is from exact)."""
    batch = pack([torch.randn(3, h, w) for h, w in [(48, 80), (128, 128), (96, 144), (16, 16), (32, 96)]], length=70)
    for grid in (None, (6, 9)):  # the names' own; one a grid of the batch takes as stored
        config = vit.model_config(name, embed_dim=8, num_heads=2, **({"pos_embed_grid_size": grid} if grid else {}))
        embeds = NaFlexEmbeds(config)
        for table in (embeds.pos_embed, embeds.pos_embed_y, embeds.pos_embed_x):
            if table is not None:
                torch.nn.init.normal_(table)
        with torch.no_grad():
            expected = embeds._sequence_positions(batch["patch_coord"], torch.zeros(5, 70, 8))
            got = embeds.token_positions(batch["patch_coord"], 70, torch.float32)
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
        assert expected[0, :15].abs().min() > 0 and expected[0, 15:].abs().max() == 0  # 3x5 positions, then none


def test_interpolation_weights_reproduce_f_interpolate():
    """Each output entry of F.interpolate as weights over the input: every mode, aligned or not,
    antialiased or not, 1 to 24 entries resampled to 1 to 39 (float32, values of unit variance)."""
    torch.manual_seed(0)
    for in_len, out_len in [(1, 5), (3, 1), (3, 10), (16, 5), (16, 16), (16, 39), (24, 7)]:
        table = torch.randn(in_len, 4)
        for mode, align_corners, antialias in [
            ("linear", False, False), ("linear", True, False), ("bilinear", False, True), ("bilinear", True, False),
            ("bicubic", False, True), ("bicubic", False, False), ("bicubic", True, True),
        ]:  # fmt: skip
            if mode == "linear":
                expected = F.interpolate(table.T[None], out_len, mode=mode, align_corners=align_corners)[0].T
            else:  # two columns: PyTorch's antialiased kernels mishandle an axis of one
                grid = table.T[None, :, :, None].expand(-1, -1, -1, 2)
                expected = F.interpolate(grid, (out_len, 2), mode=mode, align_corners=align_corners,
                                         antialias=antialias)[0, :, :, 0].T  # fmt: skip
            index, length = torch.arange(out_len), torch.tensor(out_len)
            weights = interpolation_weights(index, length, in_len, mode, align_corners, antialias)
            torch.testing.assert_close(weights @ table, expected, atol=5e-5, rtol=0)
    with pytest.raises(ValueError, match="mode='nearest' have no per-token form"):
        interpolation_weights(torch.arange(2), torch.tensor(2), 4, "nearest", False, False)


def test_patchify_is_row_major_over_patches_and_row_column_channel_within_and_pack_pads_after():
    image = torch.arange(2 * 4 * 6, dtype=torch.float32).reshape(1, 2, 4, 6)  # 2 channels, 2 x 3 patches of 2
    patches = patchify(image, (2, 2))
    assert patches.shape == (1, 6, 8)
    # Patch 1 is row 0, column 1: pixels (0, 2), (0, 3), (1, 2), (1, 3), each channel 0 then channel 1.
    assert patches[0, 1].tolist() == [2, 26, 3, 27, 8, 32, 9, 33]
    batch = pack([image[0], image[0, :, :2, :4]], patch_size=2)  # 6 patches; 2 and padding
    assert torch.equal(batch["patches"][0], patches[0]) and torch.equal(batch["patches"][1, 1], patches[0, 1])
    assert batch["patch_coord"][0].tolist() == [[0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [1, 2]]
    assert batch["patch_coord"][1].tolist() == [[0, 0], [0, 1], [0, 0], [0, 0], [0, 0], [0, 0]]
    assert batch["patch_valid"].tolist() == [[True] * 6, [True] * 2 + [False] * 4]
    assert batch["patches"][1, 2:].abs().sum() == 0


def test_naflex_trains_with_patch_dropout_and_grad_checkpointing_and_gives_attention_maps():
    model = vit.create_model("naflexvit_base_patch16_map", **SMALL, patch_drop_rate=0.25, drop_path_rate=0.1)
    model.set_grad_checkpointing(True)
    model.train()
    batch = _sequences([(48, 80), (64, 64)], length=18)
    (model(batch).square().sum() + model(torch.randn(2, 3, 64, 64)).square().sum()).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    model.eval()
    x = torch.randn(2, 3, 64, 96)
    with torch.no_grad():
        logits, attns = model.forward_with_attn(x)  # the explicit attention path
        torch.testing.assert_close(logits, model(x), atol=1e-5, rtol=0)
    assert [a.shape for a in attns] == [(2, 2, 1 + 24, 1 + 24)] * 2  # the register token and a 4 x 6 grid


def test_naflex_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="pos_embed must be one of"):
        vit.create_model("naflexvit_base_patch16_gap", pos_embed="rope")
    with pytest.raises(ValueError, match="NaFlexVit's embedding has no posemb"):
        vit.create_model("naflexvit_base_patch16_gap", posemb="learn")
    model = vit.create_model("naflexvit_base_patch16_gap", embed_proj_type="conv", **SMALL)
    assert model(torch.randn(1, 3, 32, 48)).shape == (1, 5)
    with pytest.raises(ValueError, match="patch sequences need embed_proj_type='linear'"):
        model(_sequences([(32, 48)], length=6))
    with pytest.raises(ValueError, match="not divisible by patch size"):
        vit.create_model("naflexvit_base_patch16_gap", **SMALL)(torch.randn(1, 3, 40, 48))
