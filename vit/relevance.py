"""Relevance maps: where in the image a trained ViT looks, as a map over the patch grid.

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
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from vit.layers import ParallelScalingBlock, ParallelThingsBlock
from vit.vision_transformer import VisionTransformer

HEAD_FUSIONS = ("mean", "max", "min")
METHODS = ("attention", "gradient", "last_attention", "gradcam")  # rollout, gradient rollout, ...


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
