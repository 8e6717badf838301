"""Attention rollout: hand-computed examples, per-image discard, fused == explicit, CLS, average and
MAP-head pooling, timm ViTs loaded into ours, gradient rollout, last-layer attention and GradCAM against their
formulas, the export script and the TensorBoard callback."""

from __future__ import annotations

import html
import json
import re
from pathlib import Path

import numpy as np
import pytest
import timm
import torch
from PIL import Image

from vit import create_model, set_fused_attn
from vit.checkpoint import Preprocess, RecordedScore, load_model, load_pretrained, recorded_score
from vit.data.images import read_rgb
from vit.data.transforms import eval_transform
from vit.explain import box_scores, centre_gaussian
from vit.relevance import (
    METHODS,
    attention_rollout,
    discard_lowest,
    gradcam,
    gradient_rollout,
    gradient_rollout_joint,
    joint_to_map,
    last_layer_attention,
    rollout,
    rollout_maps,
    tokens_entering_last_block,
)
from vit.render import colorize, contact_sheet, render_panel
from vit.tools import rollout as export

ROOT = Path(__file__).resolve().parents[1]

# Three tokens: CLS and two patches (a 1x2 grid). Layer 1 has two heads, layer 2 two equal heads.
HEAD_1 = [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.5, 0.0, 0.5]]
HEAD_2 = [[0.0, 0.5, 0.5], [0.0, 1.0, 0.0], [0.5, 0.0, 0.5]]
LAYER_2 = [[0.0, 0.5, 0.5], [0.5, 0.5, 0.0], [0.0, 0.0, 1.0]]


def _two_layers() -> list[torch.Tensor]:
    return [torch.tensor([[HEAD_1, HEAD_2]]), torch.tensor([[LAYER_2, LAYER_2]])]  # each (1, 2, 3, 3)


def test_hand_computed_two_layer_rollout_with_mean_fusion():
    # Layer 1, mean of heads: [[.5,.25,.25],[0,1,0],[.5,0,.5]]; + I, rows / 2: [[.75,.125,.125],[0,1,0],[.25,0,.75]].
    # Layer 2: [[0,.5,.5],[.5,.5,0],[0,0,1]]; + I, rows / 2: [[.5,.25,.25],[.25,.75,0],[0,0,1]].
    # CLS row of A2 @ A1 = .5*[.75,.125,.125] + .25*[0,1,0] + .25*[.25,0,.75] = [.4375, .3125, .25].
    joint = rollout(_two_layers(), "mean")
    torch.testing.assert_close(joint[0, 0], torch.tensor([0.4375, 0.3125, 0.25]))
    # Patch rows: .25*[.75,.125,.125] + .75*[0,1,0] = [.1875,.78125,.03125] and [.25,0,.75].
    torch.testing.assert_close(joint[0, 1], torch.tensor([0.1875, 0.78125, 0.03125]))
    torch.testing.assert_close(joint[0, 2], torch.tensor([0.25, 0.0, 0.75]))
    torch.testing.assert_close(joint_to_map(joint, 1, "token", (1, 2)), torch.tensor([[[0.3125, 0.25]]]))
    # Average pooling: the mean of the patch rows over the patch columns, ([.78125,.03125] + [0,.75]) / 2.
    torch.testing.assert_close(joint_to_map(joint, 1, "avg", (1, 2)), torch.tensor([[[0.390625, 0.390625]]]))


def test_hand_computed_max_and_min_fusion_renormalise_rows_not_columns():
    # max: [[1,.5,.5],[0,1,0],[.5,0,.5]] + I has row sums 3, 2, 2 -> [[2/3,1/6,1/6],[0,1,0],[.25,0,.75]].
    # CLS row = .5*[2/3,1/6,1/6] + .25*[0,1,0] + .25*[.25,0,.75] = [19/48, 16/48, 13/48].
    joint = rollout(_two_layers(), "max")
    torch.testing.assert_close(joint[0, 0], torch.tensor([19 / 48, 16 / 48, 13 / 48]))
    torch.testing.assert_close(joint.sum(-1), torch.ones(1, 3))  # every row of the product still sums to one
    # vit-explain's `a / a.sum(dim=-1)` divides column j by row sum j; with unequal row sums that differs.
    a = torch.tensor([[1.0, 0.5, 0.5], [0.0, 1.0, 0.0], [0.5, 0.0, 0.5]]) + torch.eye(3)
    assert not torch.allclose(a / a.sum(dim=-1), a / a.sum(dim=-1, keepdim=True))
    # min: [[0,0,0],[0,1,0],[.5,0,.5]] + I -> [[1,0,0],[0,1,0],[.25,0,.75]]; CLS row = [.5625, .25, .1875].
    torch.testing.assert_close(rollout(_two_layers(), "min")[0, 0], torch.tensor([0.5625, 0.25, 0.1875]))
    # start_layer=1 keeps only layer 2: CLS row of (LAYER_2 + I) / 2.
    torch.testing.assert_close(rollout(_two_layers(), "mean", start_layer=1)[0, 0], torch.tensor([0.5, 0.25, 0.25]))


ATTN = [[0.5, 0.25, 0.25], [0.1, 0.6, 0.3], [0.2, 0.2, 0.6]]


def test_hand_computed_discard_spares_the_cls_row():
    # discard_ratio .5 of the 6 patch-row entries [.1,.6,.3,.2,.2,.6]: the lowest 3 (.1, .2, .2) become 0.
    # The CLS row keeps its .25s although they are below .3.
    a = torch.tensor([[ATTN]])  # (1 image, 1 head, 3, 3)
    expected = torch.tensor([[0.5, 0.25, 0.25], [0.0, 0.6, 0.3], [0.0, 0.0, 0.6]])
    torch.testing.assert_close(discard_lowest(a[:, 0], 0.5), expected[None])
    # + I and rows normalised: [[.75,.125,.125],[0,16/19,3/19],[0,0,1]]; two such layers, CLS row:
    # .75*[.75,.125,.125] + .125*[0,16/19,3/19] + .125*[0,0,1] = [342, 121, 145] / 608.
    joint = rollout([a, a], "mean", discard_ratio=0.5)
    torch.testing.assert_close(joint[0, 0], torch.tensor([342, 121, 145]) / 608)
    # Without discard the patch rows are [.05,.8,.15] and [.1,.1,.8]: a different answer.
    assert not torch.allclose(rollout([a, a], "mean")[0, 0], joint[0, 0])


def test_discard_is_per_image():
    torch.manual_seed(0)
    attns = [torch.rand(4, 3, 10, 10).softmax(-1) for _ in range(3)]
    batch = rollout(attns, "max", discard_ratio=0.7)
    for i in range(4):
        alone = rollout([a[i : i + 1] for a in attns], "max", discard_ratio=0.7)
        torch.testing.assert_close(batch[i : i + 1], alone)
        # every image was discarded, not just the first (vit-explain's `flat[0, indices] = 0`)
        assert not torch.allclose(alone, rollout([a[i : i + 1] for a in attns], "max"))
    # each image loses its own lowest 70% of the 90 patch-row entries: 63 zeros per image
    fused = discard_lowest(attns[0].amax(1), 0.7)
    assert (fused[:, 1:] == 0).sum(dim=(1, 2)).tolist() == [63] * 4
    assert torch.equal(fused[:, 0], attns[0].amax(1)[:, 0])


def test_hand_computed_gradient_rollout():
    # cam = (grad * attn)^+ averaged over heads; R = I, then R <- R + cam @ R per layer.
    attn1 = torch.tensor([[0.2, 0.4, 0.4], [0.5, 0.5, 0.0], [0.0, 0.5, 0.5]])
    grad1 = torch.tensor([[1.0, 1.0, -1.0], [1.0, 0.0, 0.0], [0.0, 2.0, 1.0]])
    # cam1 = [[.2,.4,0],[.5,0,0],[0,1,.5]] -> R1 = [[1.2,.4,0],[.5,1,0],[0,1,1.5]]
    attn2 = torch.tensor([[0.5, 0.25, 0.25], [0.0, 1.0, 0.0], [0.5, 0.0, 0.5]])
    grad2 = torch.tensor([[0.0, 4.0, -4.0], [1.0, 1.0, 1.0], [2.0, 0.0, 0.0]])
    # cam2 = [[0,1,0],[0,1,0],[1,0,0]] -> R2 = R1 + cam2 @ R1 = [[1.7,1.4,0],[1,2,0],[1.2,1.4,1.5]]
    # A second head whose products are all <= 0 contributes nothing but halves the head mean.
    attns = [torch.stack([attn1, attn1])[None], torch.stack([attn2, attn2])[None]]
    grads = [torch.stack([grad1, -grad1.abs()])[None] * 2, torch.stack([grad2, -grad2.abs()])[None] * 2]
    joint = gradient_rollout_joint(attns, grads)
    torch.testing.assert_close(joint[0], torch.tensor([[1.7, 1.4, 0.0], [1.0, 2.0, 0.0], [1.2, 1.4, 1.5]]))
    torch.testing.assert_close(joint_to_map(joint, 1, "token", (1, 2)), torch.tensor([[[1.4, 0.0]]]))


# -- on models ----------------------------------------------------------------------------------


def _numpy_rollout(attns: list[np.ndarray], fusion: str, discard: float, prefix: int, pool: str) -> np.ndarray:
    """A plain per-image, per-row reference written separately from vit.rollout (no batching)."""
    fuse = {"mean": np.mean, "max": np.max, "min": np.min}[fusion]
    maps = []
    for b in range(attns[0].shape[0]):
        n = attns[0].shape[-1]
        joint = np.eye(n)
        for layer in attns:
            a = fuse(layer[b], axis=0).astype(np.float64)
            body = a[prefix:].copy()
            k = int(body.size * discard)
            if k:
                flat = body.reshape(-1)
                flat[np.argsort(flat, kind="stable")[:k]] = 0.0
                a[prefix:] = flat.reshape(body.shape)
            a = a + np.eye(n)
            for row in range(n):
                a[row] = a[row] / a[row].sum()
            joint = a @ joint
        maps.append(joint[0, prefix:] if pool == "token" else joint[prefix:, prefix:].mean(axis=0))
    return np.stack(maps)


def _nano(**kwargs) -> torch.nn.Module:
    model = create_model("vit_nano_patch4_16", num_classes=10, **kwargs).eval()
    with torch.no_grad():  # away from the init, so attention is not uniform
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return model


@pytest.mark.parametrize(
    "pool,class_token", [("token", True), ("avg", False), ("avg", True)], ids=["cls", "avg", "avg+cls"]
)
def test_cls_and_average_pool_models_match_a_per_image_reference(pool, class_token):
    model = _nano(global_pool=pool, class_token=class_token)
    x = torch.randn(3, 3, 16, 16)
    with torch.no_grad():
        logits_ref, attns = model.forward_with_attn(x)
        torch.testing.assert_close(logits_ref, model(x), atol=1e-5, rtol=1e-5)
    for fusion, discard in [("mean", 0.0), ("max", 0.9), ("min", 0.5)]:
        maps, logits = attention_rollout(model, x, fusion, discard)
        assert maps.shape == (3, 4, 4)
        expected = _numpy_rollout([a.numpy() for a in attns], fusion, discard, model.num_prefix_tokens, pool)
        np.testing.assert_allclose(maps.reshape(3, -1).numpy(), expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logits, logits_ref)


@pytest.mark.parametrize("method", METHODS)
def test_fused_and_explicit_attention_give_the_same_map_and_flags_are_left_alone(method):
    model = _nano()
    x = torch.randn(2, 3, 16, 16)
    assert all(b.attn.fused_attn for b in model.blocks)
    fused, _ = rollout_maps(model, x, method, head_fusion="max", discard_ratio=0.5)
    assert all(b.attn.fused_attn for b in model.blocks)  # no module flag was flipped
    set_fused_attn(model, False)
    explicit, _ = rollout_maps(model, x, method, head_fusion="max", discard_ratio=0.5)
    assert not any(b.attn.fused_attn for b in model.blocks)
    torch.testing.assert_close(fused, explicit, atol=1e-5, rtol=1e-4)  # gradcam: through the fused kernel or not
    assert fused.shape == (2, 4, 4)  # every method on the patch grid
    # the maps are not trivially uniform
    assert fused.std(dim=(1, 2)).min() > 1e-4


def test_timm_vit_loaded_into_ours_matches_rollout_of_timms_own_attention(tmp_path):
    kwargs = dict(img_size=32, patch_size=8, depth=3, num_classes=5)
    reference = timm.create_model("vit_tiny_patch16_224", pretrained=False, **kwargs).eval()
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    torch.save(reference.state_dict(), tmp_path / "timm_vit.pth")
    ours = create_model("vit_tiny_patch16_224", **kwargs).eval()
    load_pretrained(ours, tmp_path / "timm_vit.pth")

    # timm's own weights: hook attn_drop (what vit-explain does), which only runs with fused attention off.
    captured = []
    for block in reference.blocks:
        block.attn.fused_attn = False
        block.attn.attn_drop.register_forward_hook(lambda m, i, o: captured.append(o.detach()))
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        timm_logits = reference(x)
    maps, logits = attention_rollout(ours, x, "mean", 0.3)
    torch.testing.assert_close(logits, timm_logits, atol=1e-5, rtol=1e-5)
    expected = joint_to_map(rollout(captured, "mean", 0.3), 1, "token", (4, 4))
    torch.testing.assert_close(maps, expected, atol=1e-6, rtol=1e-5)


def test_gradient_rollout_matches_the_formula_and_depends_on_the_class():
    model = _nano()
    x = torch.randn(2, 3, 16, 16)
    logits, attns = model.forward_with_attn(x)
    for a in attns:
        a.retain_grad()
    logits[:, 3].sum().backward()
    cams = [(a.grad * a).clamp(min=0).mean(1).detach() for a in attns]
    joint = torch.eye(attns[0].shape[-1]).expand(2, -1, -1)
    for cam in cams:
        joint = joint + cam @ joint
    model.zero_grad(set_to_none=True)

    maps, _ = gradient_rollout(model, x, target=3)
    torch.testing.assert_close(maps, joint[:, 0, 1:].reshape(2, 4, 4))
    assert all(p.grad is None for p in model.parameters())  # parameter grads are left alone
    predicted, logits = gradient_rollout(model, x)
    per_image, _ = gradient_rollout(model, x, target=logits.argmax(-1))
    torch.testing.assert_close(predicted, per_image)
    other = (logits.argmax(-1) + 1) % 10
    assert not torch.allclose(gradient_rollout(model, x, target=other)[0], predicted)
    model.requires_grad_(False)  # a frozen model still has attention gradients through the input
    torch.testing.assert_close(gradient_rollout(model, x, target=3)[0], maps)
    with torch.inference_mode():  # as in Lightning's validation loop
        torch.testing.assert_close(gradient_rollout(model, x.clone(), target=3)[0], maps)


@pytest.mark.parametrize(
    "kwargs", [{}, {"global_pool": "avg", "class_token": False}, {"reg_tokens": 2}], ids=["cls", "avg", "cls+reg"]
)
def test_last_layer_attention_is_the_pooled_tokens_row_of_the_last_block(kwargs):
    model = _nano(**kwargs)
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        logits_ref, attns = model.forward_with_attn(x)
    last, p = attns[-1].mean(dim=1), model.num_prefix_tokens  # heads averaged, (2, N, N)
    # CLS: the CLS query's weights on the patches (registers dropped); no CLS: the mean over the patch queries
    expected = last[:, 0, p:] if model.global_pool == "token" else last[:, p:, p:].mean(dim=1)
    maps, logits = last_layer_attention(model, x)
    torch.testing.assert_close(maps, expected.reshape(2, 4, 4))
    torch.testing.assert_close(logits, logits_ref)
    torch.testing.assert_close(rollout_maps(model, x, "last_attention")[0], maps)
    fused = attns[-1].amax(dim=1)  # heads fused by max instead
    expected = fused[:, 0, p:] if model.global_pool == "token" else fused[:, p:, p:].mean(dim=1)
    torch.testing.assert_close(last_layer_attention(model, x, "max")[0], expected.reshape(2, 4, 4))


# MAP heads (a learned query attending to the tokens): the ViT's over the patches, with a CLS token and
# registers beside them; Perception Encoder's (Eva) and NaFlexViT's, small instances.
MAP_MODELS = {
    "vit": ("vit_nano_patch4_16", {"global_pool": "map", "reg_tokens": 2}, 16),
    "eva": ("vit_pe_core_tiny_patch16_384", {"img_size": 32, "patch_size": 8, "depth": 2}, 32),
    "naflex": ("naflexvit_base_patch16_map", {"img_size": 32, "patch_size": 8, "depth": 2, "embed_dim": 64,
                                              "num_heads": 2}, 32),
}  # fmt: skip


def _map_model(family: str) -> tuple[torch.nn.Module, torch.Tensor]:
    name, kwargs, size = MAP_MODELS[family]
    torch.manual_seed(0)
    model = create_model(name, num_classes=10, **kwargs).eval()
    with torch.no_grad():  # away from the init, so attention is not uniform
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return model, torch.randn(2, 3, size, size)


def _pool_query_weights(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The MAP head's query weights (B, heads, 1, n) over exactly the tokens the model handed it."""
    handed = []
    hook = model.attn_pool.register_forward_pre_hook(lambda m, args, kwargs: handed.append((args, kwargs)),
                                                     with_kwargs=True)  # fmt: skip
    with torch.no_grad():
        model(x)
    hook.remove()
    (tokens, *_), kwargs = handed[0]
    return model.attn_pool(tokens, return_attn=True, attn_mask=kwargs.get("attn_mask"))[1]


@pytest.mark.parametrize("family", MAP_MODELS)
def test_a_map_head_model_is_explained_through_its_querys_attention(family):
    """Attention rollout: the head's query weights (heads fused) over the tokens it pools, times the
    joint attention of the blocks; the last-layer map is those weights on the patches. The logits
    are the model's."""
    model, x = _map_model(family)
    p, grid = model.num_prefix_tokens, model.patch_grid(x)
    query = _pool_query_weights(model, x)  # (2, heads, 1, n)
    with torch.no_grad():
        logits_ref, attns = model.forward_with_attn(x)
    n, tokens = query.shape[-1], attns[0].shape[-1]
    assert n in (tokens, tokens - p)  # the patches, or every token where the head pools the prefix too
    for fusion in ("mean", "max"):
        row = query.amax(1) if fusion == "max" else query.mean(1)  # (2, 1, n)
        joint = rollout(attns, fusion)
        expected = (row @ joint[:, tokens - n :])[:, 0, p:].reshape(2, *grid)
        maps, logits = attention_rollout(model, x, fusion)
        torch.testing.assert_close(maps, expected, atol=1e-6, rtol=1e-5)
        scale = float(logits_ref.abs().max())  # logits up to ~70: fused and explicit attention round apart
        torch.testing.assert_close(logits, model(x).detach(), atol=1e-5 * scale, rtol=0)
        last, _ = last_layer_attention(model, x, fusion)
        torch.testing.assert_close(last, row[:, 0, n - grid[0] * grid[1] :].reshape(2, *grid))
    assert maps.std(dim=(1, 2)).min() > 1e-5
    torch.testing.assert_close(logits, logits_ref, atol=1e-5 * scale, rtol=0)
    assert model.attn_pool._recorded is None  # the head records nothing once the call is over


@pytest.mark.parametrize("family", MAP_MODELS)
def test_gradient_rollout_of_a_map_head_model_weighs_its_querys_attention_by_the_class_gradient(family):
    model, x = _map_model(family)
    p, grid = model.num_prefix_tokens, model.patch_grid(x)
    with model.attn_pool.recording() as recorded:
        logits, attns = model.forward_with_attn(x)
    for a in [*attns, *recorded]:
        a.retain_grad()
    logits[:, 3].sum().backward()
    joint = torch.eye(attns[0].shape[-1]).expand(2, -1, -1)
    for a in attns:
        joint = joint + (a.grad * a).clamp(min=0).mean(1).detach() @ joint
    query = recorded[0]
    row = (query.grad * query).clamp(min=0).mean(1).detach()  # (2, 1, n): no identity, the head has no residual
    expected = (row @ joint[:, joint.shape[-1] - query.shape[-1] :])[:, 0, p:].reshape(2, *grid)
    model.zero_grad(set_to_none=True)

    maps, _ = gradient_rollout(model, x, target=3)
    torch.testing.assert_close(maps, expected, atol=1e-7, rtol=1e-4)
    assert maps.abs().sum() > 0
    other = (logits.argmax(-1) + 1) % 10
    assert not torch.allclose(gradient_rollout(model, x, target=other)[0], gradient_rollout(model, x)[0])


# Blocks whose attention is not one (B, heads, N, N) tensor read by a pre-normed input: SAM's windows
# (a 5x5 grid in padded windows of 2, one global block), parallel branches, differential attention,
# post-norm, a parallel scaling block.
NARROW = {"embed_dim": 64, "num_heads": 2}
BLOCK_KINDS = {
    "windows": ("samvit_base_patch16", {"img_size": 80, "depth": 3, "window_size": 2, "global_attn_indexes": (1,)}),
    "parallel branches": ("vit_small_patch16_18x2_224", {"img_size": 32, "depth": 2, **NARROW}),
    "differential": ("vit_dwee_patch16_reg1_gap_256", {"img_size": 32, "depth": 2}),
    "post-norm": ("vit_base_patch16_rpn_224", {"img_size": 32, "depth": 2, **NARROW}),
    "parallel scaling": ("vit_base_patch16_xp_224", {"img_size": 32, "depth": 2, **NARROW}),
}


@pytest.mark.parametrize("kind", BLOCK_KINDS)
def test_every_method_explains_every_kind_of_block(kind):
    """Attention rollout: the reference on the weights placed on the patch grid. Gradient rollout:
    the formula on the gradients of the weights each output was computed from (per window, per
    branch), placed as the weights are. GradCAM: on the tokens the last block reads."""
    name, kwargs = BLOCK_KINDS[kind]
    torch.manual_seed(0)
    model = create_model(name, num_classes=10, **kwargs).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    x = torch.randn(2, 3, kwargs["img_size"], kwargs["img_size"])
    p, grid, pool = model.num_prefix_tokens, model.patch_grid(x), model.global_pool
    with torch.no_grad():
        _, placed = model.forward_with_attn(x)
    n = p + grid[0] * grid[1]
    assert all(a.shape[0] == 2 and a.shape[-2:] == (n, n) for a in placed)
    maps, _ = attention_rollout(model, x)
    expected = _numpy_rollout([a.numpy() for a in placed], "mean", 0.0, p, pool)
    np.testing.assert_allclose(maps.reshape(2, -1).numpy(), expected, rtol=1e-5, atol=1e-6)

    logits, raw = model.forward_with_attn(x, raw=True)
    leaves = [t for a in raw for t in (a if isinstance(a, tuple) else (a,))]
    for t in leaves:
        t.retain_grad()
    logits[:, 3].sum().backward()
    grads = [tuple(t.grad for t in a) if isinstance(a, tuple) else a.grad for a in raw]
    assert all(t.grad is not None for t in leaves)  # every weight tensor is on its output's path
    weights = model.grid_attention([tuple(t.detach() for t in a) if isinstance(a, tuple) else a.detach() for a in raw],
                                   grid)  # fmt: skip
    joint = torch.eye(n).expand(2, n, n)
    for a, g in zip(weights, model.grid_attention(grads, grid), strict=True):
        joint = joint + (g * a).clamp(min=0).mean(1) @ joint
    model.zero_grad(set_to_none=True)
    maps, _ = gradient_rollout(model, x, target=3)
    torch.testing.assert_close(maps, joint_to_map(joint, p, pool, grid), atol=1e-6, rtol=1e-4)
    assert maps.abs().sum() > 0

    entering, layer_io = [], []
    layer = tokens_entering_last_block(model)
    hooks = [model.blocks[-1].register_forward_pre_hook(lambda m, args: entering.append(args[0])),
             layer.register_forward_hook(lambda m, args, out: layer_io.append((args, out)))]  # fmt: skip
    with torch.no_grad():
        model(x)
    for hook in hooks:
        hook.remove()
    (args, out), tokens = layer_io[0], entering[0]
    assert torch.equal(out, tokens) if kind == "post-norm" else torch.equal(args[0], tokens)
    cam, _ = gradcam(model, x, target=3)
    assert cam.shape == (2, *grid) and cam.amax() > 0


def test_gradcam_is_the_gradcam_formula_on_the_tokens_entering_the_last_block():
    model = _nano()
    x = torch.randn(3, 3, 16, 16)
    captured = []

    def keep(module, inputs, out):  # returns None: the output is left as it is
        out.retain_grad()
        captured.append(out)

    hook = model.blocks[-1].norm1.register_forward_hook(keep)
    logits = model(x)
    logits[:, 3].sum().backward()
    hook.remove()
    tokens = captured[0][:, 1:].detach()  # (3, 16 patches, D), the CLS token dropped
    grads = captured[0].grad[:, 1:]
    weights = grads.mean(dim=1)  # one per channel: the gradient's mean over the patches
    cam = (tokens * weights[:, None]).sum(dim=-1).clamp(min=0)  # relu of the weighted sum of channels

    def min_max(c: torch.Tensor) -> torch.Tensor:  # the library's scaling, (c - min) / (max + 1e-7)
        c = c - c.amin(dim=1, keepdim=True)
        return c / (c.amax(dim=1, keepdim=True) + 1e-7)

    # Scaled twice, as the library does (per layer, then after averaging the layers): with a tiny
    # positive part (the third image's largest value is ~6e-4) the 1e-7 shows at the 1e-4 level.
    cam = min_max(min_max(cam))
    model.zero_grad(set_to_none=True)

    maps, out = gradcam(model, x, target=3)
    assert maps.shape == (3, 4, 4)
    torch.testing.assert_close(maps, cam.reshape(3, 4, 4), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(out, logits.detach())
    assert all(p.grad is None and p.requires_grad for p in model.parameters())  # weights left as they were
    assert not model.training  # the mode is kept (the library switches to eval)
    predicted = gradcam(model, x)[0]
    torch.testing.assert_close(predicted, gradcam(model, x, target=logits.argmax(-1))[0])
    assert not torch.allclose(predicted, gradcam(model, x, target=(logits.argmax(-1) + 1) % 10)[0])
    model.requires_grad_(False)  # frozen, and under inference_mode (Lightning's validation)
    with torch.inference_mode():
        torch.testing.assert_close(gradcam(model, x.clone(), target=3)[0], maps)
    assert not any(p.requires_grad for p in model.parameters())


@pytest.mark.parametrize("pool", ["max", "avgmax"])
def test_max_pooled_models_are_refused_with_the_reason(pool):
    model = _nano(global_pool=pool, class_token=False)
    with pytest.raises(ValueError, match=f"global_pool='{pool}' reads each channel from whichever token"):
        attention_rollout(model, torch.randn(1, 3, 16, 16))


def test_a_non_vit_is_refused_by_name():
    with pytest.raises(TypeError, match=r"CifarResNet, not a vit\.VisionTransformer"):
        attention_rollout(create_model("resnet20", num_classes=10), torch.randn(1, 3, 32, 32))
    with pytest.raises(ValueError, match="head_fusion"):
        rollout(_two_layers(), "median")
    with pytest.raises(ValueError, match="discard_ratio"):
        rollout(_two_layers(), discard_ratio=1.0)
    with pytest.raises(ValueError, match="start_layer"):
        rollout(_two_layers(), start_layer=2)
    with pytest.raises(ValueError, match="method must be one of"):
        rollout_maps(_nano(), torch.randn(1, 3, 16, 16), "chefer")


# -- scores against object boxes ------------------------------------------------------------------


def test_box_scores_on_hand_made_maps():
    """4x4 maps on 4x4 images (no upsampling); box (x0, y0, x1, y1) = (2, 2, 3, 3), inclusive: 4 pixels."""
    inside_peak = torch.zeros(4, 4)
    inside_peak[3, 2] = 1.0  # row 3, column 2: the only mass, in the box
    outside_peak = torch.zeros(4, 4)
    outside_peak[0, 0], outside_peak[2, 2] = 1.0, 0.5  # the peak outside; a third of the mass inside
    shifted_flat = torch.full((4, 4), 7.0)  # min-max scaling removes the offset: nothing to point with
    boxes = torch.tensor([[2, 2, 3, 3]] * 3)
    hits, energy = box_scores(torch.stack([inside_peak, outside_peak, shifted_flat]), boxes, size=4)
    assert hits.tolist() == [1.0, 0.0, 0.0]  # a flat map's "peak" is its first pixel, (0, 0)
    torch.testing.assert_close(energy, torch.tensor([1.0, 1 / 3, 4 / 16]))  # flat: the box's share of the image


def test_box_scores_upsample_the_patch_grid_to_the_image():
    grid = torch.tensor([[[0.0, 0.0], [0.0, 1.0]]])  # the bottom-right patch of a 2x2 grid
    hits, energy = box_scores(grid, torch.tensor([[4, 4, 7, 7]]), size=8)  # that patch's pixels
    assert hits.item() == 1.0 and 0.5 < energy.item() < 1.0  # bilinear spreads some mass outside


def test_centre_gaussian_peaks_in_the_middle_with_the_asked_sigma():
    g = centre_gaussian(batch=2, size=9, sigma_frac=2 / 9)  # sigma = 2 pixels around pixel (4, 4)
    assert g.shape == (2, 9, 9) and torch.equal(g[0], g[1])
    assert g[0, 4, 4].item() == 1.0 and g[0].argmax().item() == 4 * 9 + 4
    torch.testing.assert_close(g[0, 4, 6], torch.tensor(np.exp(-0.5), dtype=torch.float32))  # one sigma away
    torch.testing.assert_close(g[0], g[0].T)
    hits, _ = box_scores(g, torch.tensor([[3, 3, 5, 5]] * 2), size=9)
    assert hits.tolist() == [1.0, 1.0]


def test_render_panel_is_original_heatmap_overlay():
    image = np.zeros((16, 16, 3), dtype=np.uint8)
    grid_map = np.zeros((4, 4))
    grid_map[0, 3] = 1.0  # top-right hot
    panel = np.asarray(render_panel(image, grid_map, ["cat 0.90"], panel_size=32))
    assert panel.shape[1] == 96 and panel.shape[0] > 32
    heat = panel[:32, 32:64].astype(int)
    assert heat[2, 29].tolist() == [128, 0, 0]  # jet's dark red where the map is highest
    assert heat[29, 2].tolist() == [0, 0, 128]  # and dark blue where it is lowest
    assert (panel[:32, :32] == 0).all()  # the original, untouched


def test_contact_sheet_puts_each_map_overlay_in_its_column():
    image = np.zeros((16, 16, 3), dtype=np.uint8)
    image[..., 1] = 255  # green, to find it on the sheet
    hot_right, hot_left = np.zeros((4, 4)), np.zeros((4, 4))
    hot_right[:, 3], hot_left[:, 0] = 1.0, 1.0
    sheet = np.asarray(contact_sheet([(image, [hot_right, hot_left], ["cat 0.9"])] * 2, ["a", "b"], panel_size=32))
    assert sheet.shape[1] == 3 * 32
    green = (sheet[:, 16] == [0, 255, 0]).all(-1).nonzero()[0]
    top = green[0]  # the first row's image starts under the column titles
    assert len(green) == 2 * 32 and (green[:32] == np.arange(top, top + 32)).all()
    row = sheet[top : top + 32]
    for column, hot_col in ((1, 31), (2, 0)):  # each map's overlay is reddest where that map is hot
        cell = row[:, column * 32 : (column + 1) * 32].astype(int)
        assert cell[:, hot_col, 0].mean() > cell[:, 31 - hot_col, 0].mean() + 50
    with pytest.raises(ValueError, match="row 0 has 1 maps for 2 titles"):
        contact_sheet([(image, [hot_right], [])], ["a", "b"])


def test_a_wide_grid_is_drawn_at_its_aspect_ratio_on_the_panel_and_the_sheet():
    """A NaFlex image's 3 x 5 patch grid on its 24 x 40 pixels: panels 3:5 with the longer side
    panel_size and the map stretched over the image as it lies; on the sheet the image fills its
    square cell's width, at the top."""
    image = np.zeros((24, 40, 3), dtype=np.uint8)
    image[..., 1] = 255  # green, to find it on the sheet
    grid_map = np.zeros((3, 5))
    grid_map[0, 4] = 1.0  # the top-right patch
    panel = np.asarray(render_panel(image, grid_map, [], panel_size=80))
    assert panel.shape[:2] == (48 + 6, 3 * 80)  # 6: the margin under the panels
    heat = panel[:48, 80:160].astype(int)
    assert heat[2, 77].tolist() == [128, 0, 0] and heat[45, 2].tolist() == [0, 0, 128]  # jet's ends
    assert (panel[:48, :80] == [0, 255, 0]).all()

    sheet = np.asarray(contact_sheet([(image, [grid_map], [])], ["a"], panel_size=40))
    green = (sheet[:, :40] == [0, 255, 0]).all(-1)
    rows = green.any(axis=1).nonzero()[0]
    assert len(rows) == 24 and green[rows].all() and rows[-1] - rows[0] == 23  # 24 x 40, in one piece
    assert (sheet[rows[-1] + 1 :, :40] == 255).all()  # the rest of the cell below it is white


def test_the_sheet_is_headed_by_the_model_its_accuracy_and_the_colour_scale():
    """Header lines above everything else, then a bar of the maps' colour map from its low end (left)
    to its high end (right), labelled low and high."""
    image = np.zeros((16, 16, 3), dtype=np.uint8)
    image[..., 1] = 255  # green: its overlays never hold the colour map's pure ends
    rows = [(image, [np.eye(4)], ["cat 0.9"])]
    header = ["vit_nano_patch4_16 (0.8M params)", "val/acc1: 87.5%"]
    plain = np.asarray(contact_sheet(rows, ["attention rollout"], 96))
    headed = np.asarray(contact_sheet(rows, ["attention rollout"], 96, header))
    other = np.asarray(contact_sheet(rows, ["attention rollout"], 96, [header[0], "val/acc1: 12.5%"]))
    extra = headed.shape[0] - plain.shape[0]  # two lines of text
    assert extra > 0 and extra % 2 == 0 and headed.shape[1] == plain.shape[1] == 2 * 96
    np.testing.assert_array_equal(headed[extra:], plain)  # the header is added above, nothing else moves
    assert (headed[2:extra] < 100).any()  # drawn in black
    first = extra // 2 + 2
    np.testing.assert_array_equal(headed[:first], other[:first])  # the model's line is the same
    assert not np.array_equal(headed[first:extra], other[first:extra])  # the accuracy's is not

    low, high = [0, 0, 128], [128, 0, 0]  # jet's ends: dark blue, dark red
    assert colorize(np.array([0.0, 1.0])).tolist() == [low, high]
    ys, xs = np.nonzero((headed == low).all(-1))
    ys_high, xs_high = np.nonzero((headed == high).all(-1))
    left, right = xs.min(), xs_high.max()
    assert (xs == left).all() and (xs_high == right).all() and ys.tolist() == ys_high.tolist()
    assert extra < ys.min() and ys.max() < plain.shape[0] - 96 and right - left > 96  # above the rows, wide
    bar = headed[ys.min() : ys.max() + 1, left : right + 1]
    np.testing.assert_array_equal(bar, np.broadcast_to(colorize(np.linspace(0, 1, right - left + 1)), bar.shape))
    band = headed[ys.min() : ys.max() + 1]
    assert (band[:, :left] < 100).any() and (band[:, right + 1 :] < 100).any()  # "low" and "high" beside it


# -- export script and TensorBoard callback -----------------------------------------------------


def _our_checkpoint(path: Path, name: str = "vit_nano_patch4_16", **kwargs) -> Path:
    """A checkpoint in scripts/train.py's format (model name + kwargs + `model.` weights), no training."""
    model = create_model(name, **kwargs)
    state_dict = {f"model.{k}": v for k, v in model.state_dict().items()}
    torch.save({"vit": {"model_name": name, "model_kwargs": kwargs}, "state_dict": state_dict}, path)
    return path


def _scored_checkpoint(path: Path, best: str, score: float) -> Path:
    """Our checkpoint with the state RunCheckpoint saves: its monitor, the best-k files and their scores."""
    _our_checkpoint(path, num_classes=3)
    checkpoint = torch.load(path, weights_only=True)
    best_path = f"/elsewhere/run/checkpoints/{best}"  # the run folder was moved: files are found by name
    checkpoint["callbacks"] = {
        "RunCheckpoint{'monitor': 'val/acc1', 'mode': 'max'}": {
            "monitor": "val/acc1",
            "best_model_score": torch.tensor(score),
            "best_model_path": best_path,
            "best_k_models": {best_path: torch.tensor(score)},
        }
    }
    torch.save(checkpoint, path)
    return path


def test_the_gallery_states_the_accuracy_the_checkpoint_records_and_only_that(tmp_path):
    best = _scored_checkpoint(tmp_path / "best-epoch003-step40.ckpt", "best-epoch003-step40.ckpt", 0.875)
    last = _scored_checkpoint(tmp_path / "last.ckpt", "best-epoch003-step40.ckpt", 0.875)
    bare = _our_checkpoint(tmp_path / "bare.ckpt", num_classes=3)
    assert recorded_score(best) == RecordedScore("val/acc1", 0.875, True, "best-epoch003-step40.ckpt")
    assert recorded_score(last) == RecordedScore("val/acc1", 0.875, False, "best-epoch003-step40.ckpt")
    assert recorded_score(bare) is None
    assert export.params_text(5_400_000) == "5.4M" and export.params_text(21_345) == "0.021M"

    image = tmp_path / "images" / "a.png"
    image.parent.mkdir()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (16, 16, 3), dtype=np.uint8)).save(image)
    cases = [
        (best, [], "val/acc1: 87.5%"),  # the score of these very weights
        (last, [], "val/acc1: not recorded for these weights (the run's best: 87.5%, best-epoch003-step40.ckpt)"),
        (bare, [], "accuracy not recorded"),
        (bare, ["--accuracy", "75.7% test top-1"], "75.7% test top-1"),
    ]
    for i, (ckpt, option, accuracy) in enumerate(cases):
        argv = ["--checkpoint", str(ckpt), str(image.parent), "--sheet-size", "48", "--out", str(tmp_path / f"o{i}")]
        out = export.main([*argv, *option])
        header = ["vit_nano_patch4_16 (0.8M params)", accuracy]  # 802,307 parameters
        assert sum(p.numel() for p in load_model(ckpt).parameters()) == 802_307
        gallery = np.asarray(Image.open(out / "gallery.png").convert("RGB"))
        wide = export.SHEET_CELLS * 48
        expected = np.asarray(contact_sheet([], ["attention rollout"], 48, header, wide))  # the header, bar and titles
        np.testing.assert_array_equal(gallery[: expected.shape[0]], expected)
        assert " &middot; ".join(map(html.escape, header)) in (out / "index.html").read_text()


def test_export_writes_png_npy_and_gallery_for_a_tiny_model(tmp_path):
    ckpt = _our_checkpoint(tmp_path / "tiny.ckpt", num_classes=3)
    images = tmp_path / "images"
    (images / "sub").mkdir(parents=True)
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 255, (20, 24, 3), dtype=np.uint8)).save(images / "wide.png")
    Image.fromarray(rng.integers(0, 255, (16, 16), dtype=np.uint8)).save(images / "sub" / "grey.jpg")
    out = tmp_path / "out"
    export.main(["--checkpoint", str(ckpt), str(images), "--out", str(out), "--panel-size", "32"])

    for stem in ("00000_grey", "00001_wide"):  # sorted over the folder tree: sub/grey.jpg, wide.png
        panel = Image.open(out / f"{stem}.png")
        assert panel.width == 3 * 32 and panel.height > 32
        assert np.load(out / f"{stem}.npy").shape == (4, 4)
    gallery = (out / "index.html").read_text()
    assert gallery.count("<figure>") == 2 and 'src="00001_wide.png"' in gallery and "00001_wide.npy" in gallery
    # the saved map is the rollout of the centre-cropped image (20x24 -> 16x19 -> the middle 16x16)
    model = load_model(ckpt)
    x = eval_transform(16)(image=np.asarray(Image.open(images / "wide.png")))["image"][None]
    np.testing.assert_allclose(np.load(out / "00001_wide.npy"), attention_rollout(model, x)[0][0].numpy(), rtol=1e-5)


def test_export_sees_the_pixels_vit_predict_sees_by_the_checkpoints_preprocessing(tmp_path):
    """A run trained at 24 px on its own mean, std and crop records them; rollout prepares an image
    exactly as vit-predict does (not at the defaults), and its map is the rollout of that tensor."""
    from vit.tools import predict

    settings = {"img_size": 24, "crop_pct": 0.75, "mean": [0.5, 0.5, 0.5], "std": [0.25, 0.25, 0.25]}
    ckpt = _our_checkpoint(tmp_path / "run.ckpt", num_classes=3, img_size=24)
    checkpoint = torch.load(ckpt, weights_only=True)
    checkpoint["vit"]["preprocess"] = settings
    torch.save(checkpoint, ckpt)
    photo = tmp_path / "photos" / "photo.png"
    photo.parent.mkdir()
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (40, 30, 3), dtype=np.uint8)).save(photo)

    model, meta = export.load_vit(str(ckpt))
    seen = export.eval_preprocess(model, meta)([read_rgb(photo)])
    by_predict = predict.load_classifier(ckpt, "cpu").preprocess([read_rgb(photo)])
    assert seen.shape == (1, 3, 24, 24) and torch.equal(seen, by_predict)
    assert not torch.allclose(seen, Preprocess.assumed(24)([read_rgb(photo)]), atol=0.1)  # the defaults differ
    out = export.main(["--checkpoint", str(ckpt), str(photo.parent), "--out", str(tmp_path / "out")])
    saved = np.load(out / "00000_photo.npy")
    np.testing.assert_allclose(saved, attention_rollout(model, seen)[0][0].numpy(), rtol=1e-5)

    # An option replaces its own value only; the other recorded values stay.
    given = {"crop_pct": 1.0, "mean": None, "std": None}
    assert export.eval_preprocess(model, meta, given) == Preprocess(24, 1.0, (0.5,) * 3, (0.25,) * 3)


def test_export_of_a_dataset_split_from_a_config(tmp_path):
    ckpt = _our_checkpoint(tmp_path / "tiny.ckpt", num_classes=10)
    argv = ["--checkpoint", str(ckpt), "--config", str(ROOT / "configs/default.yaml"), "--split", "val"]
    out = export.main([*argv, "--limit", "3", "--out", str(tmp_path / "out"), "--panel-size", "32"])
    assert sorted(p.name for p in out.glob("*.npy")) == [f"0000{i}_val_0000{i}.npy" for i in range(3)]
    assert (out / "index.html").read_text().count(">true: ") == 3  # the split's labels are shown


def test_export_from_a_config_sees_images_as_its_datamodule_declares(tmp_path):
    config = tmp_path / "digits.yaml"
    config.write_text(
        "data:\n  class_path: vit.data.DigitsDataModule\n  init_args:\n    eval_crop_pct: 0.8\n"
        "    mean: [0.5, 0.5, 0.5]\n    std: [0.25, 0.25, 0.25]\n"
    )
    items, _, settings = export.items_from_config(str(config), "val", None)
    assert settings == {"crop_pct": 0.8, "mean": (0.5, 0.5, 0.5), "std": (0.25, 0.25, 0.25)}
    assert len(items) == 360 and items[0].label is not None  # the 20% of the digits held out


def test_export_from_a_timm_state_dict_file_maps_with_the_timm_weights(tmp_path):
    """A timm ViT's state dict (`--model` names the architecture): the saved map is the rollout of
    a model holding those weights on the photo as --crop-pct 0.875 crops it, normalised as timm's
    pretrained config of the architecture says (augreg: mean and std 0.5); the default init's is not."""
    state = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=4).state_dict()
    torch.save(state, tmp_path / "t.pth")
    photo = np.random.default_rng(0).integers(0, 256, (300, 200, 3), dtype=np.uint8)
    Image.fromarray(photo).save(tmp_path / "photo.png")
    argv = ["--checkpoint", str(tmp_path / "t.pth"), "--model", "vit_tiny_patch16_224", "--crop-pct", "0.875"]
    out = export.main([*argv, str(tmp_path / "photo.png"), "--out", str(tmp_path / "out")])
    saved = np.load(out / "00000_photo.npy")
    x = eval_transform(224, crop_pct=0.875, mean=(0.5,) * 3, std=(0.5,) * 3)(image=photo)["image"][None]
    model = create_model("vit_tiny_patch16_224", num_classes=4).eval()
    other = attention_rollout(model, x)[0][0].numpy()
    model.load_state_dict(state)
    np.testing.assert_allclose(saved, attention_rollout(model, x)[0][0].numpy(), rtol=1e-4, atol=1e-6)
    assert not np.allclose(saved, other, rtol=1e-2)
    assert "00000_photo.png" in (out / "index.html").read_text()


def test_predictions_are_labelled_with_the_class_names_the_training_data_gave(tmp_path):
    """A run stores its data's class names in the checkpoint (and its .safetensors export); the
    export labels predictions with them. WordNet-id folders read as words.txt names them."""
    from tests.conftest import quiet_trainer, write_image_folder
    from vit.checkpoint import export_safetensors, load_checkpoint
    from vit.data import ImageFolderDataModule
    from vit.lit import ImageClassifier

    data = write_image_folder(tmp_path / "data", classes=3, train=4, val=1, size=16)
    for c, wnid in enumerate(["n01", "n02", "n03"]):
        for split in ("train", "val"):
            (data / split / f"class{c}").rename(data / split / wnid)
    (data / "words.txt").write_text("n01\tgoldfish, Carassius auratus\nn02\ttabby, tabby cat\n")  # n03: none
    trainer = quiet_trainer(tmp_path, max_epochs=1, limit_train_batches=1, limit_val_batches=1)
    datamodule = ImageFolderDataModule(root=str(data), img_size=16, batch_size=4, num_workers=0)
    trainer.fit(ImageClassifier("vit_nano_patch4_16"), datamodule)
    ckpt = tmp_path / "checkpoints" / "last.ckpt"
    assert load_checkpoint(ckpt)[1]["class_names"] == ["goldfish", "tabby", "n03"]
    weights = export_safetensors(ckpt, tmp_path / "model.safetensors")
    assert load_checkpoint(weights)[1]["class_names"] == ["goldfish", "tabby", "n03"]

    for source in (ckpt, weights):
        out = export.main(["--checkpoint", str(source), str(data / "val" / "n02"), "--out", str(tmp_path / "out")])
        gallery = (out / "index.html").read_text()
        assert re.search(r"(goldfish|tabby|n03): \d\.\d\d", gallery) and not re.search(r">\d: \d\.\d\d", gallery)


def test_export_refuses_bad_input_naming_the_file(tmp_path, capsys):
    good = tmp_path / "ok.png"
    Image.fromarray(np.zeros((16, 16, 3), dtype=np.uint8)).save(good)
    (tmp_path / "broken.jpg").write_bytes(b"not a jpeg")
    resnet = _our_checkpoint(tmp_path / "resnet.ckpt", "resnet20", num_classes=10)
    vit_ckpt = _our_checkpoint(tmp_path / "vit.ckpt", num_classes=3)
    plain = tmp_path / "plain.pth"
    torch.save(create_model("vit_nano_patch4_16").state_dict(), plain)
    cases = [
        (["--checkpoint", str(tmp_path / "missing.ckpt"), str(good)], "missing.ckpt does not exist"),
        (["--checkpoint", str(vit_ckpt), str(tmp_path / "broken.jpg")], "cannot decode image"),
        (["--checkpoint", str(vit_ckpt), str(tmp_path / "nowhere.png")], "nowhere.png does not exist"),
        (["--checkpoint", str(resnet), str(good)], "resnet.ckpt is a CifarResNet, not a vit.VisionTransformer"),
        (["--checkpoint", str(plain), str(good)], "plain.pth is not a checkpoint of scripts/train.py"),
    ]
    for argv, message in cases:
        with pytest.raises(SystemExit):
            export.main([*argv, "--out", str(tmp_path / "out")])
        assert message in capsys.readouterr().err


def test_rollout_logger_writes_overlays_to_tensorboard(tmp_path):
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tests.conftest import quiet_trainer
    from vit.data import DigitsDataModule
    from vit.lit import ImageClassifier
    from vit.rollout import RolloutLogger

    logger = TensorBoardLogger(tmp_path, name="tb")
    trainer = quiet_trainer(
        tmp_path, max_epochs=2, limit_train_batches=1, limit_val_batches=1, logger=logger,
        callbacks=[RolloutLogger(every_n_epochs=2, num_images=3, method="gradient", panel_size=32)],
    )  # fmt: skip
    trainer.fit(ImageClassifier("vit_nano_patch4_16", num_classes=10), DigitsDataModule(batch_size=16, num_workers=0))
    events = EventAccumulator(logger.log_dir, size_guidance={"images": 0})
    events.Reload()
    images = events.Images("rollout/overlays")
    assert [e.step for e in images] == [2]  # epoch 2 only (every 2 epochs), not the first
    assert images[0].width == 3 * 32 and images[0].height > 3 * 32  # a column of 3 panels with captions


def test_a_batch_size_of_zero_is_a_usage_error_naming_the_option(tmp_path, capsys):
    """It ended in "range() arg 3 must not be zero" after the model was loaded."""
    from vit.tools.rollout import main as rollout_main

    with pytest.raises(SystemExit) as exit_info:
        rollout_main([str(tmp_path), "--checkpoint", "timm:vit_tiny_patch16_224", "--batch-size", "0"])
    assert exit_info.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.endswith("error: argument --batch-size: must be a whole number of at least 1, got 0")


def test_a_naflex_file_without_recorded_preprocessing_is_explained_at_the_models_own_size(tmp_path, capsys):
    """A NaFlexVit has no patch_embed: what vit-rollout assumes for a file that records no
    preprocessing comes from the model's image size, as vit-predict assumes it."""
    from safetensors.torch import save_file

    kwargs = dict(
        embed_dim=32, depth=2, num_heads=2, num_classes=3, img_size=32, patch_size=8, pos_embed_grid_size=(4, 4)
    )
    model = create_model("naflexvit_base_patch16_gap", **kwargs)
    weights = tmp_path / "naflex.safetensors"
    metadata = {"vit_model_name": "naflexvit_base_patch16_gap", "vit_model_kwargs": json.dumps(kwargs)}
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(weights), metadata=metadata)
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (48, 40, 3), dtype=np.uint8)).save(tmp_path / "a.png")
    export.main(["--checkpoint", str(weights), "--out", str(tmp_path / "out"), str(tmp_path / "a.png")])
    assert "assuming 32 px" in capsys.readouterr().err
    assert np.load(tmp_path / "out" / "00000_a.npy").shape == (4, 4)
