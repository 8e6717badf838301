"""The Vision Transformer: timm parity, the size table, the registry, attention maps."""

from __future__ import annotations

import re
from functools import partial

import pytest
import timm
import torch

import vit
from vit import create_model
from vit.checkpoint import export_safetensors, load_model, load_pretrained


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
    assert _num_params("vit_huge_patch14_224", num_classes=1000) == 632_045_800  # the paper's 632M
    # timm's default vit_huge_patch14_224 is headless (its in21k weights), and so is ours: 630.8M
    assert _num_params("vit_huge_patch14_224") == 630_764_800
    with torch.device("meta"):
        assert _num_params("vit_huge_patch14_224", num_classes=1000) == sum(
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
        {"norm": "rmsnorm", "embed_norm": True, "mlp": "swiglu_split", "proj_bias": False, "scale_attn_inner": True},
        {"block_fn": "parallel_scaling", "qkv_bias": False, "init_values": 0.1},
        {"block_fn": "parallel_scaling", "attn_layer": "diff", "fuse_out_proj": True, "global_pool": "avg"},
        {"block_fn": "parallel_things", "scale_mlp": True, "pool_include_prefix": True, "global_pool": "avg"},
        {"post_norm": True, "init_values": 0.1, "attn_layer": "diff"},
    ],
)
def test_timm_kwargs_build_timms_model_with_our_names_and_logits(kwargs):
    ours = create_model("vit_nano_patch4_16", num_classes=3, **kwargs).eval()
    theirs = timm.models.vision_transformer.VisionTransformer(**vit.timm_args.timm_kwargs(ours.config))
    theirs.load_state_dict(ours.state_dict(), strict=True)
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs.eval()(x), atol=1e-5, rtol=1e-5)


def test_timm_kwargs_refuse_options_timm_builds_differently():
    config = create_model("vit_nano_patch4_16", mlp="swiglu", posemb="sincos2d").config
    with pytest.raises(ValueError, match=re.escape("no equivalent of {'posemb': 'sincos2d', 'mlp': 'swiglu'}")):
        vit.timm_args.timm_kwargs(config)
    config = create_model("vit_nano_patch4_16", block_fn="parallel_things", num_parallel=3).config
    with pytest.raises(ValueError, match=re.escape("{'block_fn': 'parallel_things', 'num_parallel': 3}")):
        vit.timm_args.timm_kwargs(config)


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


@pytest.mark.parametrize("name", ["naflexvit_base_patch16_gap", "eva02_tiny_patch14_224"])
def test_average_pooled_models_run_the_last_blocks_fc2_on_the_pooled_state_with_timms_gradients(name):
    """Average pooling with no norm between the last block and the pool: forward runs that block's fc2
    once an image; the logits, every gradient and the last block's hooks are as without the shortcut."""
    theirs = _perturbed_timm(name, num_classes=5, img_size=32, depth=2)
    ours = create_model(name, num_classes=5, img_size=32, depth=2)
    ours.load_state_dict(theirs.state_dict())
    assert ours._pools_last_block()
    x, y = torch.randn(3, 3, 32, 32), torch.tensor([0, 4, 2])
    seen = []
    ours.blocks[-1].register_forward_hook(lambda m, args, out: seen.append(out.shape))
    for model in (ours, theirs):
        torch.nn.functional.cross_entropy(model(x), y).backward()
    assert seen == [(3, ours.embed_dim)]  # the block was called as a module: its hooks ran
    theirs_grads = dict(theirs.named_parameters())
    for name_, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, theirs_grads[name_].grad, atol=1e-5, rtol=1e-4, msg=name_)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), ours.forward_head(ours.forward_features(x)), atol=1e-5, rtol=1e-5)


# -- timm's options: registers, pos-embed without prefix, pre/final norm, pools, padding --------

SMALL = dict(img_size=32, patch_size=8, embed_dim=64, depth=3, num_heads=4, num_classes=5)
TIMM_OPTION_CASES = [
    {"reg_tokens": 4},
    {"reg_tokens": 4, "no_embed_class": True, "init_values": 1e-5},  # DINOv2 with registers
    {"class_token": False, "global_pool": "avg", "no_embed_class": True},
    {"pre_norm": True},  # CLIP
    {"final_norm": False, "global_pool": "avg"},
    {"global_pool": "max", "reg_tokens": 2},
    {"global_pool": "avgmax"},
    {"global_pool": "map", "class_token": False, "reg_tokens": 1},
    {"global_pool": ""},
    {"posemb": "none"},
    {"dynamic_img_size": True, "dynamic_img_pad": True},
    {"pre_norm": True, "norm_eps": 1e-5, "act_layer": "quick_gelu"},  # OpenAI CLIP
    {"global_pool": "map", "class_token": False, "act_layer": "gelu_tanh"},  # SigLIP
    {"mlp": "glu", "act_layer": "silu", "mlp_ratio": 2.75, "norm": "rmsnorm", "qk_norm": True},  # SwiGLUPacked
]


def _timm_twin(ours: torch.nn.Module) -> torch.nn.Module:
    """timm's VisionTransformer built from our config by `timm_kwargs`, with our weights perturbed in."""
    theirs = timm.models.vision_transformer.VisionTransformer(**vit.timm_args.timm_kwargs(ours.config))
    with torch.no_grad():
        for p in theirs.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    ours.load_state_dict(theirs.state_dict(), strict=True)
    return theirs.eval()


@pytest.mark.parametrize("kwargs", TIMM_OPTION_CASES, ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()))
def test_timms_options_give_timms_parameters_and_outputs(kwargs):
    ours = create_model("vit_nano_patch4_16", **SMALL, **kwargs).eval()
    theirs = _timm_twin(ours)
    sizes = [(32, 32), (36, 28)] if kwargs.get("dynamic_img_pad") else [(32, 32)]
    with torch.no_grad():
        for size in sizes:
            x = torch.randn(2, 3, *size)
            torch.testing.assert_close(ours.forward_features(x), theirs.forward_features(x), atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(ours(x), theirs(x), atol=1e-5, rtol=1e-5)
    assert ours.num_prefix_tokens == theirs.num_prefix_tokens


@pytest.mark.parametrize(
    "options",
    [
        {"indices": 2, "output_fmt": "NCHW"},
        {"indices": [0, -1], "output_fmt": "NLC", "norm": True, "return_prefix_tokens": True},
        {"indices": [1], "intermediates_only": True, "stop_early": True},
    ],
)
def test_forward_intermediates_equal_timms(options):
    ours = create_model("vit_nano_patch4_16", **SMALL, reg_tokens=2).eval()
    theirs = _timm_twin(ours)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        got, expected = ours.forward_intermediates(x, **options), theirs.forward_intermediates(x, **options)
    if not options.get("intermediates_only"):
        torch.testing.assert_close(got[0], expected[0], atol=1e-5, rtol=1e-5)  # the final tokens
        got, expected = got[1], expected[1]
    assert len(got) == len(expected) == (2 if options["indices"] != [1] else 1)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    if options.get("output_fmt") == "NCHW":
        assert got[0].shape == (2, 64, 4, 4)


@pytest.mark.parametrize(("indices", "prune_norm"), [(2, False), ([0, 1], True)])
def test_prune_intermediate_layers_keeps_what_timm_keeps_and_the_same_features(indices, prune_norm):
    ours = create_model("vit_nano_patch4_16", **SMALL, reg_tokens=2).eval()
    theirs = _timm_twin(ours)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        before = ours.forward_intermediates(x, indices=indices, intermediates_only=True)
        assert ours.prune_intermediate_layers(indices, prune_norm) == theirs.prune_intermediate_layers(
            indices, prune_norm
        )
        assert sorted(ours.state_dict()) == sorted(theirs.state_dict())  # the same parts kept
        after = ours.forward_intermediates(x, indices=indices, intermediates_only=True)
        torch.testing.assert_close(ours(x), theirs(x), atol=1e-5, rtol=1e-5)  # pooled features, no head
    for a, b in zip(before, after, strict=True):
        torch.testing.assert_close(a, b)
    assert ours(x).shape == (2, 3 + 16, 64)  # no pooling, no head: CLS, 2 registers and 16 patch tokens


@pytest.mark.parametrize("global_pool", [None, "avg", ""])
def test_reset_classifier_gives_a_new_head_and_pooling_as_timm(global_pool):
    ours = create_model("vit_nano_patch4_16", **SMALL).eval()
    theirs = _timm_twin(ours)
    ours.reset_classifier(5, global_pool)
    theirs.reset_classifier(5, global_pool)
    ours.head.load_state_dict(theirs.head.state_dict())
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), atol=1e-5, rtol=1e-5)
    assert ours.get_classifier() is ours.head and ours.num_classes == ours.config.num_classes == 5
    if global_pool is not None:
        assert ours.config.global_pool == global_pool
    ours.reset_classifier(0)
    assert ours(x).shape == ((2, 64) if global_pool != "" else (2, 17, 64))
    with pytest.raises(ValueError, match="cannot add an attention-pool head"):
        ours.reset_classifier(5, "map")


def test_a_checkpoint_with_registers_fits_a_model_with_another_grid_or_none():
    source = create_model("vit_nano_patch4_16", **SMALL, reg_tokens=4).eval()
    _timm_twin(source)  # random, distinct weights
    regrid = create_model("vit_nano_patch4_16", **{**SMALL, "img_size": 48}, reg_tokens=4)
    changes = []
    sd = vit.checkpoint_filter_fn(source.state_dict(), regrid, lambda kind, what: changes.append((kind, what)))
    regrid.load_state_dict(sd, strict=True)
    assert changes == [("resampled", "pos_embed (grid 4x4 -> 6x6)")]
    assert torch.equal(regrid.pos_embed[:, :5], source.pos_embed[:, :5])  # CLS and register positions kept
    assert torch.equal(regrid.reg_token, source.reg_token)

    plain = create_model("vit_nano_patch4_16", **SMALL)
    changes.clear()
    plain.load_state_dict(vit.checkpoint_filter_fn(source.state_dict(), plain, lambda *c: changes.append(c)))
    assert changes == [("dropped", "reg_token"), ("dropped", "pos_embed[registers]")]
    assert torch.equal(plain.pos_embed, torch.cat([source.pos_embed[:, :1], source.pos_embed[:, 5:]], dim=1))


# -- timm's model names ----------------------------------------------------------------------------

TIMM_VIT_NAMES = timm.list_models(module="vision_transformer") + timm.list_models("deit*", module="deit")


def test_every_timm_vision_transformer_name_is_built_or_refused_with_the_reason():
    supported = set(vit.list_models())
    unsupported = vit.registry.unsupported_models()
    assert all(name in supported or name in unsupported for name in TIMM_VIT_NAMES)
    # timm 1.0.31: 163 names in vision_transformer (138 vit_*, AIMv2, BEiT3, FlexiViT, ...), 16 in deit;
    # another timm: recount here and in docs/models.md.
    assert len(TIMM_VIT_NAMES) == 163 + 16
    refused = {n: unsupported[n] for n in TIMM_VIT_NAMES if n not in supported}
    assert refused == {}, refused
    assert {"deit_tiny_distilled_patch16_224", "deit3_small_patch16_224", "aimv2_large_patch14_224"} <= supported
    assert {"vit_base_patch16_xp_224", "vit_base_patch16_rpn_224", "vit_dwee_patch16_reg1_gap_256"} <= supported


def test_timm_names_take_the_defaults_of_timms_pretrained_config():
    config = vit.model_config("vit_base_patch14_dinov2")  # timm builds it at 518 px without a head
    assert (config.img_size, config.num_classes, config.init_values) == ((518, 518), 0, 1e-5)


def test_timm_names_have_timms_parameter_names_and_shapes():
    """Every supported timm name, built on the meta device (no memory): the same state dict layout."""
    for name in TIMM_VIT_NAMES:
        if name not in vit.list_models():
            continue
        with torch.device("meta"):  # one class count for both, whatever each name's default
            ours = create_model(name, num_classes=7)  # timm's init, skipped: on meta it runs Python decompositions
            theirs = timm.create_model(name, num_classes=7, weight_init="skip")
        assert {k: v.shape for k, v in ours.state_dict().items()} == {
            k: v.shape for k, v in theirs.state_dict().items()
        }, name


@pytest.mark.parametrize(
    "name",
    [
        "vit_base_patch16_clip_quickgelu_224",  # pre-norm, eps 1e-5, quick GELU
        "vit_base_patch16_siglip_224",  # MAP head, tanh GELU, no CLS
        "vit_small_patch14_reg4_dinov2",  # registers, pos-embed without prefix, LayerScale
        "vit_medium_patch16_reg1_gap_256",  # avg pool, one register
        "deit_small_distilled_patch16_224",  # distillation token and head (timm's VisionTransformerDistilled)
        "deit3_small_patch16_224",  # LayerScale, pos-embed without the CLS token
    ],
)
def test_timm_named_models_give_timms_logits(name):
    small = dict(depth=2, num_classes=4)
    theirs = _perturbed_timm(name, **small)
    ours = create_model(name, **small).eval()
    ours.load_state_dict(theirs.state_dict(), strict=True)
    size = ours.config.img_size if isinstance(ours.config.img_size, int) else ours.config.img_size[0]
    x = torch.randn(1, 3, size, size)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), atol=1e-4, rtol=1e-4)


# -- hybrids: one of timm's CNNs as patch embedding ------------------------------------------------

TIMM_HYBRID_NAMES = timm.list_models("vit_*", module="vision_transformer_hybrid")


def _shapes(model: torch.nn.Module) -> dict[str, torch.Size]:
    return {k: v.shape for k, v in model.state_dict().items()}


def test_every_timm_hybrid_is_built_with_timms_layout_or_refused_with_the_reason():
    supported, unsupported = set(vit.list_models()), vit.registry.unsupported_models()
    assert all(name in supported or unsupported.get(name) for name in TIMM_HYBRID_NAMES)
    built = [name for name in TIMM_HYBRID_NAMES if name in supported]
    expected = {"vit_tiny_r_s16_p8_224", "vit_small_r26_s32_224", "vit_base_r50_s16_384", "vit_large_r50_s32_224"}
    assert expected | {"vit_base_resnet50d_224", "vit_base_mci_224"} <= set(built)
    assert vit.model_config("vit_base_r50_s16_384").backbone == {"name": "resnetv2", "layers": (3, 4, 9)}
    assert vit.model_config("vit_base_r50_s16_384").patch_size == 1  # timm's: a 1x1 projection of the features
    for name in built:  # on the meta device: no memory, no arithmetic
        with torch.device("meta"):
            ours, theirs = create_model(name, num_classes=7), timm.create_model(name, num_classes=7)
        assert isinstance(ours.patch_embed, vit.layers.HybridEmbed), name
        assert _shapes(ours) == _shapes(theirs), name
        assert ours.patch_embed.grid_size == theirs.patch_embed.grid_size, name
    # A backbone built by a constructor we do not rebuild is refused, naming the ones we do.
    embed = partial(timm.layers.HybridEmbed, backbone=torch.nn.Identity())
    with pytest.raises(ValueError, match=r"backbone Identity is built by none of timm's constructors.*_resnetv2"):
        vit.timm_args.from_timm_args({"embed_layer": embed})


def _perturb_buffers(model: torch.nn.Module) -> None:
    """BatchNorm's running statistics away from 0 and 1, so they are compared too."""
    with torch.no_grad():
        for buffer in model.buffers():
            if buffer.is_floating_point():
                buffer.add_(torch.rand_like(buffer) * 0.1)


@pytest.mark.parametrize(
    "name",
    [
        "vit_tiny_r_s16_p8_224",  # ResNetV2 stem only, 8x8 projection
        "vit_small_r26_s32_224",  # ResNetV2 2-2-2-2, stride 32
        "vit_base_r50_s16_224",  # the ViT paper's R50+ViT-B/16
        "vit_small_resnet26d_224",  # timm's ResNet-26D (BatchNorm), features_only
        "vit_base_mci_224",  # MobileCLIP's conv stem, no projection, pos-embed without the CLS token
    ],
)
def test_timm_hybrids_load_strictly_and_give_timms_logits(name):
    small = dict(img_size=64, depth=2, num_classes=4)
    theirs = _perturbed_timm(name, **small)
    _perturb_buffers(theirs)
    ours = create_model(name, **small).eval()
    assert _shapes(ours) == _shapes(theirs)
    ours.load_state_dict(theirs.state_dict(), strict=True)
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        expected = theirs(x)
        torch.testing.assert_close(ours(x), expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ours.forward_features(x), theirs.forward_features(x), atol=1e-5, rtol=1e-5)
    assert expected.abs().max() > 0.1


def test_a_hybrid_checkpoint_fits_another_image_size_as_timm_resamples_it(tmp_path):
    small = dict(depth=2, num_classes=4)
    theirs = _perturbed_timm("vit_small_r26_s32_224", img_size=64, **small)  # a 2x2 grid
    torch.save(theirs.state_dict(), tmp_path / "r26.pth")
    ours = load_model(tmp_path / "r26.pth", "vit_small_r26_s32_224", img_size=96, depth=2)
    assert ours.patch_embed.grid_size == (3, 3) and ours.patch_embed.patch_size == (32, 32)
    report = load_pretrained(ours, tmp_path / "r26.pth")
    assert report.resampled == ["pos_embed (grid 2x2 -> 3x3)"] and report.reinitialised == []
    theirs.set_input_size(img_size=96)  # timm resamples its own position embedding
    x = torch.randn(2, 3, 96, 96)
    with torch.no_grad():
        torch.testing.assert_close(ours.pos_embed, theirs.pos_embed)
        torch.testing.assert_close(ours(x), theirs(x), atol=1e-5, rtol=1e-5)


def test_a_hybrid_config_builds_timms_model_and_survives_our_checkpoints(tmp_path):
    """Any ViT takes a backbone; its config is plain data, so timm_kwargs, .ckpt and .safetensors rebuild it."""
    kwargs = dict(SMALL, patch_size=1, backbone={"name": "resnetv2", "layers": [1, 1]})  # stride 8
    ours = create_model("vit_nano_patch4_16", **kwargs).eval()
    theirs = _timm_twin(ours)
    assert ours.patch_embed.grid_size == theirs.patch_embed.grid_size == (4, 4)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        expected = ours(x)
        torch.testing.assert_close(expected, theirs(x), atol=1e-5, rtol=1e-5)
    weights = {f"model.{k}": v for k, v in ours.state_dict().items()}
    meta = {"model_name": "vit_nano_patch4_16", "model_kwargs": kwargs}
    torch.save({"vit": meta, "state_dict": weights}, tmp_path / "hybrid.ckpt")
    exported = export_safetensors(tmp_path / "hybrid.ckpt", tmp_path / "hybrid.safetensors")
    for source in (tmp_path / "hybrid.ckpt", exported):  # kwargs through torch's safe unpickler, and JSON
        with torch.no_grad():
            torch.testing.assert_close(load_model(source)(x), expected)


@pytest.mark.parametrize("change", ["renamed", "new_argument"])
def test_a_change_inside_timm_costs_its_names_with_a_warning_never_the_import(change):
    """`import vit` reads timm's ViT names through timm's private builders. With the ViT builder
    renamed, or a model function passing an argument we do not know of, vit still imports: our own
    names build; timm's affected names are listed unsupported with the error; one warning says so."""
    import subprocess
    import sys

    from tests.conftest import ROOT

    simulate = {
        "renamed": "del timm_vit._create_vision_transformer",
        "new_argument": "import timm.models._registry as registry\n"
        "registry._model_entrypoints['vit_small_patch14_dinov2'] = lambda pretrained=False, **kw: "
        "timm_vit._create_vision_transformer('x', pretrained, new_option=3, **kw)",
    }[change]
    program = f"""
import warnings
import timm.models.vision_transformer as timm_vit
{simulate}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import vit
print([str(w.message) for w in caught if "timm's ViT names" in str(w.message)])
print(vit.create_model("vit_tiny_patch4_32", num_classes=3)(__import__("torch").zeros(1, 3, 32, 32)).shape)
print(vit.registry.unsupported_models().get("vit_base_patch16_224", "supported"))
print(vit.registry.unsupported_models().get("vit_small_patch16_224", "supported"))
print(vit.registry.unsupported_models().get("vit_small_patch14_dinov2", "supported"))
"""
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    warned, shape, base, small, dinov2 = result.stdout.strip().splitlines()
    assert shape == "torch.Size([1, 3])"  # our own names build
    assert base == small == "supported"  # VIT_MODELS names never depend on timm's builders
    if change == "renamed":
        assert "could not be read from timm" in dinov2 and "_create_vision_transformer" in dinov2
        assert "of timm's ViT names could not be read" in warned
    else:  # an argument with no equivalent here: that name is refused with the reason, nothing else
        assert dinov2 == "timm's new_option=3 has no equivalent here" and warned == "[]"
