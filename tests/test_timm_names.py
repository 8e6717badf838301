"""timm's argument names for timm's model names: `vit.create_model(name, **kwargs)` takes the kwargs of
`timm.create_model(name, **kwargs)` with timm's meaning, or refuses one in a line saying why."""

from __future__ import annotations

import math
from unittest import mock

import pytest
import timm
import torch

import vit
from tests.conftest import timm_and_ours

DINOV3 = "vit_small_patch16_dinov3"

# (name, timm's argument, its value) -> (our config field, the value it takes)
TIMM_ARGUMENTS = [
    ("vit_tiny_patch16_224", "pos_embed", "none", "posemb", "none"),
    ("vit_tiny_patch16_224", "scale_attn_norm", True, "scale_attn_inner", True),
    ("vit_tiny_patch16_224", "scale_mlp_norm", True, "scale_mlp", True),
    ("vit_tiny_patch16_224", "norm_layer", "rmsnorm", "norm", "rmsnorm"),
    ("vit_tiny_patch16_224", "fix_init", True, "fix_init", True),
    ("vit_base_patch16_clip_224", "pos_embed", "none", "posemb", "none"),  # read from timm's model function
    ("vit_relpos_small_patch16_224", "fix_init", True, "fix_init", True),
    (DINOV3, "num_reg_tokens", 2, "reg_tokens", 2),
    (DINOV3, "use_abs_pos_emb", True, "posemb", "learn"),
    (DINOV3, "swiglu_mlp", True, "mlp", "swiglu_packed"),  # timm's GluMlp: no inner norm, no alignment
    (DINOV3, "attn_type", "rope", "k_bias", True),
    (DINOV3, "use_post_norm", True, "post_norm", True),
    (DINOV3, "use_pre_transformer_norm", True, "pre_norm", True),
    (DINOV3, "use_post_transformer_norm", False, "final_norm", False),
    (DINOV3, "use_fc_norm", True, "fc_norm", True),
    ("samvit_base_patch16", "use_abs_pos", False, "posemb", "none"),
    ("samvit_base_patch16", "use_rel_pos", False, "rel_pos_type", ""),
    ("samvit_base_patch16", "use_rope", False, "rel_pos_type", "decomposed"),  # timm's default: nothing changes
    ("samvit_base_patch16", "head_hidden_size", None, "num_classes", 0),
    ("samvit_base_patch16", "ref_feat_shape", None, "window_size", 14),
    ("naflexvit_base_patch16_gap", "scale_mlp_norm", True, "scale_mlp", True),
    ("naflexvit_base_patch16_gap", "scale_attn_inner_norm", True, "scale_attn_inner", True),
]


@pytest.mark.parametrize(("name", "theirs", "value", "ours", "expected"), TIMM_ARGUMENTS)
def test_timms_argument_sets_our_field(name, theirs, value, ours, expected):
    assert getattr(vit.model_config(name, **{theirs: value}), ours) == expected


def test_timms_argument_keeps_the_names_other_defaults_and_ours_win():
    default, changed = vit.model_config(DINOV3), vit.model_config(DINOV3, num_reg_tokens=2)
    assert {k: v for k, v in vars(changed).items() if v != getattr(default, k)} == {"reg_tokens": 2}
    assert vit.model_config(DINOV3, num_reg_tokens=2, reg_tokens=1).reg_tokens == 1


@pytest.mark.parametrize(
    ("name", "kwargs", "message"),
    [
        ("samvit_base_patch16", {"use_rope": True}, r"use_rope=True \(rotary .*no equivalent here: .*use_rel_pos"),
        ("samvit_base_patch16", {"head_hidden_size": 64}, r"head_hidden_size=64 .*no equivalent here: .*Linear"),
        ("samvit_base_patch16", {"ref_feat_shape": (8, 8)}, r"ref_feat_shape=\(8, 8\) .*no equivalent here"),
        # neither ours nor timm's: the fields are listed
        ("vit_tiny_patch16_224", {"num_class": 3}, r"no option\(s\) num_class;.*num_classes.*or timm's arguments"),
    ],
)
def test_an_argument_without_an_equivalent_is_refused_in_one_line(name, kwargs, message):
    with pytest.raises(ValueError, match=message) as caught:
        vit.create_model(name, **kwargs)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    ("name", "kwargs", "size"),
    [
        ("vit_tiny_patch16_224", dict(pos_embed="none", scale_attn_norm=True, scale_mlp_norm=True), 32),
        (DINOV3, dict(num_reg_tokens=2, use_abs_pos_emb=True, use_fc_norm=True, use_post_transformer_norm=False), 32),
        ("samvit_base_patch16", dict(use_abs_pos=False, embed_dim=64, num_heads=2, neck_chans=32), 64),
    ],
)
def test_timms_arguments_build_timms_model(name, kwargs, size):
    """The same kwargs to timm.create_model and to ours: timm's state dict loads strictly, the logits agree."""
    ours, theirs = timm_and_ours(name, 0.1, depth=2, num_classes=5, img_size=size, **kwargs)
    x = torch.randn(2, 3, size, size)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), atol=1e-5, rtol=0)


def test_fix_init_divides_each_blocks_output_projections_as_timms():
    """timm's fix_init: block i's attn.proj and mlp.fc2 weights divided by sqrt(2 (i + 1)) after the init."""
    small = dict(depth=3, img_size=32, num_classes=0)
    torch.manual_seed(0)
    plain = vit.create_model("vit_tiny_patch16_224", **small)
    torch.manual_seed(0)
    fixed = vit.create_model("vit_tiny_patch16_224", fix_init=True, **small)
    for i, (a, b) in enumerate(zip(plain.blocks, fixed.blocks, strict=True)):
        torch.testing.assert_close(b.attn.proj.weight, a.attn.proj.weight / math.sqrt(2 * (i + 1)))
        torch.testing.assert_close(b.mlp.fc2.weight, a.mlp.fc2.weight / math.sqrt(2 * (i + 1)))
        torch.testing.assert_close(b.attn.qkv.weight, a.attn.qkv.weight)


def _timms_default_class_count(name: str) -> int:
    """The num_classes timm's builder gives `timm.create_model(name)`: its model function's, else its
    pretrained config's (timm's _update_default_model_kwargs), read there, before anything is built."""
    import timm.models._builder as builder

    update = builder._update_default_model_kwargs

    class Read(Exception):
        pass

    def read(pretrained_cfg, kwargs, kwargs_filter) -> None:
        update(pretrained_cfg, kwargs, kwargs_filter)
        raise Read(kwargs["num_classes"])

    with mock.patch.object(builder, "_update_default_model_kwargs", read), torch.device("meta"):
        try:
            timm.models.model_entrypoint(name)()
        except Read as e:
            return e.args[0]
    raise AssertionError(f"timm's {name} was built without its builder")


def test_every_timm_name_has_timms_default_class_count():
    names = [n for n in vit.list_models() if n in set(timm.list_models())]
    assert len(names) == 293  # timm 1.0.31: the 290 ViT-family names and 3 ResNets
    differ = {n: (vit.model_config(n).num_classes, _timms_default_class_count(n)) for n in names}
    assert {n: counts for n, counts in differ.items() if counts[0] != counts[1]} == {}
    assert vit.model_config("vit_huge_patch14_224").num_classes == 0  # timm's in21k weights: no head


def test_vit_huge_loads_timms_default_state_dict_strictly():
    with torch.device("meta"):
        ours = vit.create_model("vit_huge_patch14_224")
        theirs = timm.create_model("vit_huge_patch14_224", pretrained=False, weight_init="skip")
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in theirs.state_dict().items()}
