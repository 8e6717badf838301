"""Attention rollout: where in the image a trained ViT looks, as a map over the patch grid.

Attention rollout (Abnar & Zuidema 2020) follows information from the input patches to the pooled
token through all layers: per layer, fuse the heads, optionally zero the weakest entries, add the
identity (the residual connection), renormalise every row, and multiply the layers together. The
map is the row of the pooled token: the CLS row for `global_pool="token"`, the mean of the patch
rows for average pooling, and for a MAP head (`global_pool="map"`: SigLIP, Perception Encoder,
NaFlexViT) its learned query's attention over the tokens it pools times the joint attention (the
head has no residual from the tokens, so no identity is added there). Gradient rollout (Chefer et
al. 2021) weights each layer's attention by its gradient for one class, so the map is
class-specific: the rule of Chefer et al. ICCV 2021 ("Generic Attention-model Explainability for
Interpreting Bi-Modal and Encoder-Decoder Transformers", eqs. 5-6): R = I, then per layer
R <- R + mean_heads((grad * attn)^+) @ R, gradients of the class logit (a MAP head's row:
mean_heads((grad * attn)^+) @ R). Their CVPR 2021 method ("Transformer Interpretability Beyond
Attention Visualization"), LRP relevance propagated through every layer, is not implemented: it
needs a hand-written relevance rule for every module on the path (linear, norm, activation, softmax,
the two attention matmuls, each residual sum with its renormalisation), kept in step with every
option our blocks take (rope, SwiGLU, RMSNorm, layer scale, experts, registers, MAP pooling), and
the ICCV paper presents the gradient rule as the simpler replacement that needs none of that.

Two more methods users compare against: the raw attention of the last block (the pooled token's
row, heads averaged: `last_layer_attention`) and GradCAM (Selvaraju et al. 2017) on the patch tokens
entering the last block, computed by the pytorch-grad-cam library (`gradcam`; `pip install
'vit[explain]'`). `rollout_maps` runs any of `METHODS` by name; `vit.explain` scores the maps.

Everything is batched and per image: each image gets its own discard threshold and its own row
sums. The weights come from `VisionTransformer.forward_with_attn`, which takes the explicit
attention path for that call only, so no module flag is touched and fused attention may stay on.
(The popular vit-explain script hooks `attn_drop`, which the fused path never calls, divides by
the row sums without `keepdim` (the wrong axis), and discards for the first image of a batch only.)

The rendering helpers (colour map, overlay, the original | heatmap | overlay panel) live here too,
shared by the export (`vit.tools.rollout`) and the `RolloutLogger` callback, and so do the scores
against object boxes (pointing game, energy in box) with their centred-Gaussian baseline.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import lightning as L
import numpy as np
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from PIL import Image, ImageDraw, ImageFont
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from vit.layers import ParallelScalingBlock, ParallelThingsBlock
from vit.vision_transformer import VisionTransformer

log = logging.getLogger(__name__)

HEAD_FUSIONS = ("mean", "max", "min")
METHODS = ("attention", "gradient", "last_attention", "gradcam")  # rollout, gradient rollout, ...


# -- the method -------------------------------------------------------------------------------


def fuse_heads(attn: torch.Tensor, head_fusion: str) -> torch.Tensor:
    """(B, heads, N, N) -> (B, N, N) by the mean, max or min over the heads."""
    if head_fusion == "mean":
        return attn.mean(dim=1)
    if head_fusion == "max":
        return attn.amax(dim=1)
    if head_fusion == "min":
        return attn.amin(dim=1)
    raise ValueError(f"head_fusion must be one of {HEAD_FUSIONS}, got {head_fusion!r}")


def discard_lowest(attn: torch.Tensor, discard_ratio: float, num_prefix_tokens: int = 1) -> torch.Tensor:
    """Zero the lowest `discard_ratio` of each image's entries of a fused (B, N, N) attention.

    The rows of the prefix (CLS) tokens are never touched: they carry the map. The threshold is
    per image, so one image's weak entries never decide what another image loses.
    """
    if not 0.0 <= discard_ratio < 1.0:
        raise ValueError(f"discard_ratio must be in [0, 1), got {discard_ratio}")
    B, N, _ = attn.shape
    body = attn[:, num_prefix_tokens:].reshape(B, -1)  # the patch-query rows, flattened per image
    k = int(body.shape[1] * discard_ratio + 1e-6)  # + 1e-6: 90 * 0.7 is 62.99999 in floating point
    if k == 0:
        return attn
    # Keep the n - k highest rather than zero the k lowest: the same entries, and topk is faster
    # for the smaller count (discard ratios are usually high, e.g. 0.9).
    keep = body.topk(body.shape[1] - k, dim=1).indices
    body = torch.zeros_like(body).scatter(1, keep, body.gather(1, keep)).reshape(B, N - num_prefix_tokens, N)
    return torch.cat([attn[:, :num_prefix_tokens], body], dim=1)


def rollout(
    attns: list[torch.Tensor],
    head_fusion: str = "mean",
    discard_ratio: float = 0.0,
    start_layer: int = 0,
    num_prefix_tokens: int = 1,
) -> torch.Tensor:
    """Attention rollout of per-layer weights [(B, heads, N, N)] -> the joint (B, N, N) attention.

    joint = A_L ... A_start with A = rownorm(discard(fuse(attn)) + I), rows normalised per image.
    """
    _check_layers(attns, start_layer)
    B, _, N, _ = attns[0].shape
    eye = torch.eye(N, device=attns[0].device)
    joint = eye.expand(B, N, N)
    for attn in attns[start_layer:]:
        a = discard_lowest(fuse_heads(attn.float(), head_fusion), discard_ratio, num_prefix_tokens)
        a = a + eye
        a = a / a.sum(dim=-1, keepdim=True)  # each row sums to one (keepdim: divide rows, not columns)
        joint = a @ joint
    return joint


def gradient_rollout_joint(attns: list[torch.Tensor], grads: list[torch.Tensor], start_layer: int = 0) -> torch.Tensor:
    """Chefer et al. ICCV 2021's gradient x attention rule (not their CVPR 2021 LRP): R = I; per layer
    R <- R + mean_heads((grad * attn)^+) @ R, no renormalisation. Returns (B, N, N)."""
    _check_layers(attns, start_layer)
    if len(grads) != len(attns):
        raise ValueError(f"{len(attns)} attention tensors but {len(grads)} gradients")
    B, _, N, _ = attns[0].shape
    joint = torch.eye(N, device=attns[0].device).expand(B, N, N)
    for attn, grad in zip(attns[start_layer:], grads[start_layer:], strict=True):
        cam = (grad.float() * attn.float()).clamp(min=0).mean(dim=1)
        joint = joint + cam @ joint
    return joint


def joint_to_map(
    joint: torch.Tensor,
    num_prefix_tokens: int,
    global_pool: str,
    grid_size: tuple[int, int],
    pool_row: torch.Tensor | None = None,
) -> torch.Tensor:
    """The pooled token's row of the joint attention over the patches, as (B, grid_h, grid_w).

    CLS pooling reads the CLS row; average pooling averages the patch rows (the pooled vector is
    their mean, so its attribution is the mean of theirs); a MAP head's `pool_row` (B, n), its
    query's weights (heads fused) over the last n tokens (the patches, or every token where the
    head pools the prefix too), weighs the rows: pool_row @ joint.
    """
    p = num_prefix_tokens
    if global_pool == "token":
        if p == 0:
            raise ValueError("global_pool='token' needs a CLS token")
        row = joint[:, 0, p:]
    elif global_pool == "avg":
        row = joint[:, p:, p:].mean(dim=1)
    elif global_pool == "map":
        if pool_row is None:
            raise ValueError("global_pool='map' needs the MAP head's attention (pool_row)")
        row = (pool_row[:, None].to(joint.dtype) @ joint[:, -pool_row.shape[1] :])[:, 0, p:]
    else:
        raise ValueError(
            f"attention maps read the pooled token's row of the attention; global_pool={global_pool!r} reads each "
            "channel from whichever token is largest there (avgmax: half of it), so no row describes it "
            "(explained: 'token', 'avg', 'map')"
        )
    return row.reshape(joint.shape[0], *grid_size)


def check_vit(model: nn.Module, source: str = "the model") -> VisionTransformer:
    """Rollout needs our VisionTransformer (forward_with_attn); say so for anything else."""
    if not isinstance(model, VisionTransformer):
        raise TypeError(
            f"{source} is a {type(model).__name__}, not a vit.VisionTransformer: attention rollout needs a "
            "ViT's attention weights (for a timm ViT, load its weights into ours: "
            "vit.checkpoint.load_pretrained(vit.create_model(name), path))"
        )
    return model


def _check_layers(attns: list[torch.Tensor], start_layer: int) -> None:
    if not attns:
        raise ValueError("no attention weights given")
    if not 0 <= start_layer < len(attns):
        raise ValueError(f"start_layer must be in [0, {len(attns) - 1}], got {start_layer}")


def attention_rollout(
    model: nn.Module,
    images: torch.Tensor,
    head_fusion: str = "mean",
    discard_ratio: float = 0.0,
    start_layer: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rollout maps (B, grid_h, grid_w) and logits (B, classes) for a batch of normalised images.

    Call with the model in eval mode (dropout would make the maps random).
    """
    model = check_vit(model)
    with torch.no_grad():
        logits, attns, pool = forward_with_pool_attn(model, images)
    joint = rollout(attns, head_fusion, discard_ratio, start_layer, model.num_prefix_tokens)
    pool_row = None if pool is None else fuse_heads(pool.float(), head_fusion)[:, 0]
    grid = model.patch_grid(images)
    return joint_to_map(joint, model.num_prefix_tokens, model.global_pool, grid, pool_row), logits


def gradient_rollout(
    model: nn.Module,
    images: torch.Tensor,
    target: int | torch.Tensor | None = None,
    start_layer: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Class-specific maps (B, grid_h, grid_w) and logits by Chefer et al. ICCV 2021's rule
    (`gradient_rollout_joint`). `target`: a class id for every image, one per image (B,), or None for
    each image's predicted class.

    Only the attention tensors get gradients (torch.autograd.grad): parameter `.grad`s are left
    alone, and frozen models work (the input is what requires grad).
    """
    model = check_vit(model)
    logits, raw, pool = forward_with_attn_graph(model, images)
    # Gradients of the weights the outputs were computed from (a windowed block's per window, a
    # parallel block's per branch), then placed on the grid as the weights are.
    leaves, layout = tree_flatten(raw)
    grads = attention_gradients(logits, leaves if pool is None else [*leaves, pool], target)
    grid = model.patch_grid(images)
    attns = model.grid_attention(tree_map(torch.Tensor.detach, raw), grid)
    attn_grads = model.grid_attention(tree_unflatten(grads[: len(leaves)], layout), grid)
    joint = gradient_rollout_joint(attns, attn_grads, start_layer)
    # the MAP head's row by the same rule, without the identity (no residual from the tokens)
    pool_row = None if pool is None else (grads[-1] * pool.detach()).clamp(min=0).mean(dim=1)[:, 0]
    return joint_to_map(joint, model.num_prefix_tokens, model.global_pool, grid, pool_row), logits.detach()


def forward_with_pool_attn(
    model: VisionTransformer, images: torch.Tensor, raw: bool = False
) -> tuple[torch.Tensor, list, torch.Tensor | None]:
    """`forward_with_attn(images, raw)`, and for a MAP-pooled model its head's query weights
    (B, heads, 1, n) over the n tokens it pooled (None for other pools)."""
    head = model.attn_pool if model.global_pool == "map" else None
    if head is None:
        return *model.forward_with_attn(images, raw=raw), None
    with head.recording() as recorded:
        logits, attns = model.forward_with_attn(images, raw=raw)
    return logits, attns, recorded[-1]


def forward_with_attn_graph(
    model: VisionTransformer, images: torch.Tensor
) -> tuple[torch.Tensor, list, torch.Tensor | None]:
    """`forward_with_pool_attn(raw=True)` with the attention weights in the autograd graph, even under
    no_grad, inference_mode (Lightning's validation) or for a frozen model (the input requires grad)."""
    with torch.inference_mode(False), torch.enable_grad():
        return forward_with_pool_attn(model, images.clone().requires_grad_(True), raw=True)


def attention_gradients(
    logits: torch.Tensor,
    attns: list[torch.Tensor],
    target: int | torch.Tensor | None = None,
    retain_graph: bool = False,
) -> list[torch.Tensor]:
    """d logit[target] / d attention, per layer (B, heads, N, N); target None: the predicted class.
    `retain_graph=True` keeps the graph for another target."""
    if target is None:
        target = logits.argmax(dim=-1)
    with torch.inference_mode(False), torch.enable_grad():
        target = torch.as_tensor(target, device=logits.device).long().expand(logits.shape[0]).clone()
        # Images in a batch do not interact, so the gradient of the summed scores is each image's own.
        score = logits.gather(1, target[:, None]).sum()
        return list(torch.autograd.grad(score, attns, retain_graph=retain_graph))


def last_layer_attention(
    model: nn.Module, images: torch.Tensor, head_fusion: str = "mean"
) -> tuple[torch.Tensor, torch.Tensor]:
    """The raw attention of the last block over the patches, (B, grid_h, grid_w), and the logits.

    The pooled token's row, heads fused (averaged by default): for CLS pooling the CLS token's
    attention to each patch; for a model without a CLS token (average pooling) the mean over the
    patch queries of their attention to each patch (as `joint_to_map` reads rollout); for a MAP
    head its query's attention to each patch. Prefix tokens
    (CLS, registers) are never part of the map. No identity, no renormalisation, no other layer.
    """
    model = check_vit(model)
    with torch.no_grad():
        logits, attns, pool = forward_with_pool_attn(model, images)
    last = fuse_heads(attns[-1].float(), head_fusion)
    pool_row = None if pool is None else fuse_heads(pool.float(), head_fusion)[:, 0]
    if pool_row is not None:  # the MAP head's own weights: the last attention that reads the patches
        last = torch.eye(last.shape[-1], device=last.device).expand_as(last)
    grid = model.patch_grid(images)
    return joint_to_map(last, model.num_prefix_tokens, model.global_pool, grid, pool_row), logits


def gradcam(
    model: nn.Module, images: torch.Tensor, target: int | torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """GradCAM maps (B, grid_h, grid_w) and logits, computed by pytorch-grad-cam's `GradCAM`.

    The layer is the last block's `norm1`: the patch tokens entering the last block, as a
    (D, grid_h, grid_w) feature map per image (prefix tokens dropped); for other blocks the layer
    that gives the same (`tokens_entering_last_block`). Not the block's output: with
    CLS pooling the head reads only the CLS token of the last block, so the gradient on that block's
    output patches is zero; pytorch-grad-cam's ViT guide picks `blocks[-1].norm1` for this reason.
    Per image: weights = the mean over the patches of d logit[target] / d tokens, map =
    relu(sum over channels of weight x tokens), min-max scaled to [0, 1] by the library. The library
    normally resizes the map to the image; here it is kept on the patch grid, like every other map.
    `target`: one class id for all, (B,) ids, or None for the predicted class.

    Needs `pip install 'vit[explain]'` (grad-cam). Parameter gradients, `requires_grad` flags and
    the train/eval mode are left as they were; it works under no_grad and inference_mode.
    """
    try:
        from pytorch_grad_cam import GradCAM
        from pytorch_grad_cam.utils.model_targets import ClassifierOutputTarget
    except ImportError as e:
        raise ImportError("gradcam needs pytorch-grad-cam: pip install 'vit[explain]' (or 'grad-cam>=1.5')") from e
    model = check_vit(model)
    gh, gw = model.patch_grid(images)
    prefix = model.num_prefix_tokens

    class GridGradCAM(GradCAM):
        def get_target_width_height(self, input_tensor: torch.Tensor) -> tuple[int, int]:
            return gw, gh  # the size the library resizes its maps to: keep the patch grid

    def to_feature_map(tokens: torch.Tensor) -> torch.Tensor:  # (B, N, D) -> (B, D, gh, gw)
        return tokens[:, prefix:].reshape(tokens.shape[0], gh, gw, -1).permute(0, 3, 1, 2)

    targets = None
    if target is not None:
        ids = torch.as_tensor(target).long().expand(images.shape[0]).tolist()
        targets = [ClassifierOutputTarget(i) for i in ids]
    params = list(model.parameters())
    saved = [(p.requires_grad, p.grad) for p in params]
    was_training = model.training
    layer = tokens_entering_last_block(model)
    cam = GridGradCAM(model, [layer], reshape_transform=to_feature_map)  # sets eval mode
    try:
        with torch.inference_mode(False), torch.enable_grad():
            model.requires_grad_(False)  # gradients reach the tokens through the input, not the weights
            maps = cam(images.clone().requires_grad_(True), targets)
            logits = cam.outputs.detach()
    finally:
        cam.activations_and_grads.release()
        for p, (requires_grad, grad) in zip(params, saved, strict=True):
            p.requires_grad_(requires_grad)
            p.grad = grad
        model.train(was_training)
    return torch.from_numpy(maps).to(images.device), logits


def tokens_entering_last_block(model: VisionTransformer) -> nn.Module:
    """The layer whose output is the tokens the last block reads, normed as its attention reads
    them: `norm1` (a pre-norm Block), `in_norm` (a parallel scaling block), the first branch's norm
    (parallel branches); a post-norm block reads its input unnormed, the previous block's output."""
    block = model.blocks[-1]
    if isinstance(block, ParallelThingsBlock):
        return block.attns[0].norm
    if isinstance(block, ParallelScalingBlock):
        return block.in_norm
    if block.post_norm:
        return model.blocks[-2] if len(model.blocks) > 1 else model.norm_pre
    return block.norm1


def rollout_maps(
    model: nn.Module,
    images: torch.Tensor,
    method: str = "attention",
    head_fusion: str = "mean",
    discard_ratio: float = 0.0,
    start_layer: int = 0,
    target: int | torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Maps on the patch grid (B, grid_h, grid_w) and logits by any of `METHODS`, by name (for
    scripts and configs): "attention" (`attention_rollout`: head_fusion, discard_ratio, start_layer),
    "gradient" (`gradient_rollout`: target, start_layer), "last_attention" (`last_layer_attention`:
    head_fusion) and "gradcam" (`gradcam`: target). Other arguments are ignored by a method."""
    if method == "attention":
        return attention_rollout(model, images, head_fusion, discard_ratio, start_layer)
    if method == "gradient":
        return gradient_rollout(model, images, target, start_layer)
    if method == "last_attention":
        return last_layer_attention(model, images, head_fusion)
    if method == "gradcam":
        return gradcam(model, images, target)
    raise ValueError(f"method must be one of {METHODS}, got {method!r}")


# -- scoring against object boxes ---------------------------------------------------------------


def box_scores(maps: torch.Tensor, boxes: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """How well (B, h, w) maps find the objects in (B, 4) boxes on size x size images: pointing
    hits and energy-in-box fractions, (B,) each. Boxes are (x0, y0, x1, y1), inclusive pixel
    coordinates, as in Tiny-ImageNet's annotations.

    Pointing: the peak of the map, upsampled bilinearly to the image, lies inside the box. Energy:
    the share of the upsampled map's mass inside the box after min-max scaling it to [0, 1], so a
    constant offset (which rollout's identity term adds) does not count; a flat map scores the box's
    share of the image.
    """
    m = maps.float()[:, None]
    if m.shape[-1] != size:
        m = F.interpolate(m, size=(size, size), mode="bilinear", align_corners=False)
    m = m[:, 0].flatten(1)
    lo, hi = m.min(dim=1, keepdim=True).values, m.max(dim=1, keepdim=True).values
    m = (m - lo) / (hi - lo).clamp(min=1e-12)
    pixels = torch.arange(size, dtype=torch.float32)
    ys, xs = pixels[:, None].expand(size, size).flatten(), pixels[None, :].expand(size, size).flatten()
    x0, y0, x1, y1 = (boxes[:, i : i + 1].float() for i in range(4))
    inside = (xs >= x0) & (xs <= x1) & (ys >= y0) & (ys <= y1)  # (B, size * size)
    hits = inside.gather(1, m.argmax(dim=1, keepdim=True))[:, 0].float()
    total = m.sum(dim=1)
    energy = torch.where(total > 0, (m * inside).sum(dim=1) / total.clamp(min=1e-12), inside.float().mean(dim=1))
    return hits, energy


def centre_gaussian(batch: int, size: int | tuple[int, int], sigma_frac: float = 0.25) -> torch.Tensor:
    """(batch, size, size) Gaussians centred on the image (sigma = sigma_frac x size): the baseline
    that looks at no image, the prior that objects sit in the middle. `size` (h, w) gives (batch, h, w)
    with sigma_frac x h and sigma_frac x w along the two axes (e.g. on a patch grid)."""
    h, w = (size, size) if isinstance(size, int) else size
    ry = (torch.arange(h, dtype=torch.float32) - (h - 1) / 2) / (sigma_frac * h)
    rx = (torch.arange(w, dtype=torch.float32) - (w - 1) / 2) / (sigma_frac * w)
    g = torch.exp(-(ry[:, None] ** 2 + rx[None, :] ** 2) / 2)
    return g.expand(batch, h, w)


# -- rendering --------------------------------------------------------------------------------


def resize_map(grid_map: np.ndarray | torch.Tensor, size: tuple[int, int]) -> np.ndarray:
    """A (h, w) map resized to (H, W) by bilinear interpolation (pixel centres aligned)."""
    m = torch.as_tensor(grid_map, dtype=torch.float32)[None, None]
    return F.interpolate(m, size=size, mode="bilinear", align_corners=False)[0, 0].numpy()


def to_unit(m: np.ndarray) -> np.ndarray:
    """Min-max scale to [0, 1]; a constant map becomes zeros."""
    lo, hi = float(m.min()), float(m.max())
    return (m - lo) / (hi - lo) if hi > lo else np.zeros_like(m)


def colorize(m: np.ndarray) -> np.ndarray:
    """A [0, 1] map -> RGB uint8 in the "jet" colour map (blue low, red high), written as three ramps."""
    m = np.clip(m, 0.0, 1.0)[..., None]
    rgb = np.clip(1.5 - np.abs(4.0 * m - np.array([3.0, 2.0, 1.0])), 0.0, 1.0)
    return (rgb * 255).round().astype(np.uint8)


def overlay(image: np.ndarray, m: np.ndarray, alpha: float = 0.5) -> np.ndarray:
    """Blend the coloured [0, 1] map (same H, W as the image) onto an RGB uint8 image."""
    blended = (1 - alpha) * image.astype(np.float32) + alpha * colorize(m).astype(np.float32)
    return blended.round().astype(np.uint8)


def fit(image: np.ndarray, size: int) -> np.ndarray:
    """An RGB uint8 image resized (bicubic) so its longer side is `size`, its aspect ratio kept (a square:
    size x size; a NaFlex image on a 3 x 5 patch grid: 3/5 size x size)."""
    height, width = image.shape[:2]
    scale = size / max(height, width)
    shape = (max(1, round(width * scale)), max(1, round(height * scale)))
    return np.asarray(Image.fromarray(image).resize(shape, Image.Resampling.BICUBIC))


def render_panel(
    image: np.ndarray, grid_map: np.ndarray, lines: Sequence[str] = (), panel_size: int = 224
) -> Image.Image:
    """original | heatmap | overlay, each the image's aspect ratio with its longer side panel_size
    (`fit`), with caption lines underneath.

    `image` is the RGB uint8 region the model saw; the grid map is resized to it bilinearly.
    """
    shown = fit(image, panel_size)
    height, width = shown.shape[:2]
    m = to_unit(resize_map(grid_map, (height, width)))
    font = ImageFont.load_default(size=max(11, panel_size // 16))
    line_height = int(font.size * 1.3) if hasattr(font, "size") else 14
    canvas = Image.new("RGB", (3 * width, height + line_height * len(lines) + 6), "white")
    for i, panel in enumerate((shown, colorize(m), overlay(shown, m))):
        canvas.paste(Image.fromarray(panel), (i * width, 0))
    draw = ImageDraw.Draw(canvas)
    for i, line in enumerate(lines):
        draw.text((4, height + 3 + i * line_height), line, fill="black", font=font)
    return canvas


COLOUR_SCALE = "relevance, each map scaled to its own min..max:"


def colour_bar(width: int, height: int) -> np.ndarray:
    """The maps' colour scale as an RGB uint8 strip (height, width, 3): lowest at the left, highest at the right."""
    return np.repeat(colorize(np.linspace(0.0, 1.0, width))[None], height, axis=0)


def wrap(text: str, font: ImageFont.ImageFont | ImageFont.FreeTypeFont, width: int) -> list[str]:
    """Greedy word wrap to `width` pixels; a word wider than that gets a line of its own."""
    lines: list[str] = []
    for word in text.split():
        if lines and font.getlength(f"{lines[-1]} {word}") <= width:
            lines[-1] += f" {word}"
        else:
            lines.append(word)
    return lines


def shorten(text: str, font: ImageFont.ImageFont | ImageFont.FreeTypeFont, width: int) -> str:
    """`text`, or its start and end around "...", to fit `width` pixels (a file name keeps its end)."""
    keep = len(text)
    shown = text
    while keep > 1 and font.getlength(shown) > width:
        keep -= 1
        shown = f"{text[: (keep + 1) // 2]}...{text[len(text) - keep // 2 :]}"
    return shown


def contact_sheet(
    rows: Sequence[tuple[np.ndarray, Sequence[np.ndarray], Sequence[str]]],
    titles: Sequence[str],
    panel_size: int = 96,
    header: Sequence[str] = (),
    min_width: int = 0,
) -> Image.Image:
    """One image for a page: the `header` lines (which model, how accurate), the maps' colour scale
    (a bar from low to high), then a row per image (the region the model saw, then its overlay for
    each map, in `titles` order) with its caption lines under the image; `titles` head the columns.
    A cell is panel_size square; an image of another aspect ratio is `fit` into its top-left corner.
    The sheet is at least `min_width` wide; header lines wrap at word boundaries to its width, and a
    caption line wider than it is shortened in the middle. The rows are at the bottom."""
    font = ImageFont.load_default(size=max(10, panel_size // 9))
    line_height = int(font.size * 1.3) if hasattr(font, "size") else 14
    grid_width = max((1 + len(titles)) * panel_size, min_width)
    text = [line for paragraph in [*header, COLOUR_SCALE] for line in wrap(paragraph, font, grid_width - 6)]
    width = max(grid_width, 6 + max(int(font.getlength(line)) + 1 for line in text))
    lines_per_row = max((len(lines) for _, _, lines in rows), default=0)
    row_height = panel_size + line_height * lines_per_row + 6
    bar_top = 2 + line_height * len(text)
    titles_top = bar_top + line_height + 4
    canvas = Image.new("RGB", (width, titles_top + line_height + 4 + row_height * len(rows)), "white")
    draw = ImageDraw.Draw(canvas)
    for i, line in enumerate(text):
        draw.text((3, 2 + i * line_height), line, fill="black", font=font)
    low, high = 3 + int(font.getlength("low ")), width - 3 - int(font.getlength(" high"))
    canvas.paste(Image.fromarray(colour_bar(max(1, high - low), line_height - 4)), (low, bar_top + 2))
    draw.text((3, bar_top), "low", fill="black", font=font)
    draw.text((high + int(font.getlength(" ")), bar_top), "high", fill="black", font=font)
    for c, title in enumerate(["image", *titles]):
        draw.text((c * panel_size + 3, titles_top), title, fill="black", font=font)
    for r, (image, maps, lines) in enumerate(rows):
        if len(maps) != len(titles):
            raise ValueError(f"row {r} has {len(maps)} maps for {len(titles)} titles")
        top = titles_top + line_height + 4 + r * row_height
        shown = fit(image, panel_size)
        canvas.paste(Image.fromarray(shown), (0, top))
        for c, grid_map in enumerate(maps, 1):
            m = to_unit(resize_map(grid_map, shown.shape[:2]))
            canvas.paste(Image.fromarray(overlay(shown, m)), (c * panel_size, top))
        for i, line in enumerate(lines):
            draw.text(
                (3, top + panel_size + 3 + i * line_height), shorten(line, font, width - 6), fill="black", font=font
            )
    return canvas


# -- TensorBoard during training --------------------------------------------------------------


class RolloutLogger(Callback):
    """Logs rollout overlays of a fixed set of validation images to TensorBoard every N epochs
    (`method`: any of `METHODS`; the class-specific ones explain the predicted class).

    The images are `num_images` evenly spaced over the val set (the same ones every time, so the
    maps can be compared across epochs). In a config:
    `--trainer.callbacks+=vit.rollout.RolloutLogger --trainer.callbacks.every_n_epochs 5`.
    """

    def __init__(
        self,
        every_n_epochs: int = 5,
        num_images: int = 8,
        method: str = "attention",
        head_fusion: str = "mean",
        discard_ratio: float = 0.0,
        panel_size: int = 128,
    ) -> None:
        if every_n_epochs < 1 or num_images < 1:
            raise ValueError(f"every_n_epochs and num_images must be >= 1, got {every_n_epochs}, {num_images}")
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        fuse_heads(torch.zeros(1, 1, 1, 1), head_fusion)  # validate the name now, not after an epoch
        self.every_n_epochs = every_n_epochs
        self.method = method
        self.num_images = num_images
        self.head_fusion = head_fusion
        self.discard_ratio = discard_ratio
        self.panel_size = panel_size

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        check_vit(getattr(pl_module, "model", pl_module), "RolloutLogger's model")

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or not trainer.is_global_zero or (trainer.current_epoch + 1) % self.every_n_epochs:
            return
        writer = _tensorboard(trainer)
        dataset = getattr(trainer.datamodule, "val_set", None) if trainer.datamodule is not None else None
        if writer is None or dataset is None or len(dataset) == 0:
            log.warning("RolloutLogger: needs a TensorBoard logger and a datamodule with a val_set; skipped")
            return
        items = [dataset[i] for i in self.indices(len(dataset))]  # (normalised CHW tensor, label)
        x = torch.stack([image for image, _ in items]).to(pl_module.device)
        model = getattr(pl_module, "model", pl_module)
        maps, logits = rollout_maps(model, x, self.method, self.head_fusion, self.discard_ratio)
        probs = logits.float().softmax(dim=-1).cpu()
        mean, std = getattr(trainer.datamodule, "mean", None), getattr(trainer.datamodule, "std", None)
        panels = []
        for (image, label), m, p in zip(items, maps.cpu().numpy(), probs, strict=True):
            prob, pred = p.max(dim=-1)
            lines = [f"true {int(label)}  pred {int(pred)} ({float(prob):.2f})"]
            panels.append(np.asarray(render_panel(denormalise(image, mean, std), m, lines, self.panel_size)))
        writer.add_image("rollout/overlays", np.concatenate(panels, axis=0), trainer.global_step, dataformats="HWC")

    def indices(self, n: int) -> list[int]:
        """`num_images` indices evenly spaced over a dataset of n images (fixed across epochs)."""
        k = min(self.num_images, n)
        return [round(i * (n - 1) / max(k - 1, 1)) for i in range(k)]


def denormalise(x: torch.Tensor, mean: tuple[float, ...] | None, std: tuple[float, ...] | None) -> np.ndarray:
    """A normalised (3, H, W) input back to RGB uint8 (H, W, 3); min-max scaled when mean/std are unknown."""
    x = x.detach().float().cpu()
    if mean is not None and std is not None:
        x = x * torch.tensor(std)[:, None, None] + torch.tensor(mean)[:, None, None]
    else:
        x = (x - x.min()) / (x.max() - x.min() + 1e-12)
    return (x.clamp(0, 1) * 255).round().byte().permute(1, 2, 0).numpy()


def _tensorboard(trainer: L.Trainer):
    from lightning.pytorch.loggers import TensorBoardLogger

    for logger in trainer.loggers:
        if isinstance(logger, TensorBoardLogger):
            return logger.experiment
    return None
