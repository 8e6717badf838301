"""Vision Transformer (Dosovitskiy et al. 2021) with timm's parameter names.

Patch embedding -> [CLS] + learned position embedding -> L pre-norm Blocks -> norm -> pool -> head.
`our_model.load_state_dict(timm_model.state_dict())` works for the matching configuration and gives
the same logits; the tests hold us to that.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
from collections.abc import Callable, Collection
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any
from unittest import mock

import timm
import torch
import torch.nn.functional as F
from timm.layers import resample_abs_pos_embed
from torch import nn
from torch.utils.checkpoint import checkpoint

from vit.layers import (
    ACTIVATIONS,
    AttentionPoolLatent,
    BlockConfig,
    HybridEmbed,
    PatchDropout,
    PatchEmbed,
    make_block,
    make_norm,
    mimetic_init_,
    moe_aux_loss,
)
from vit.position import rope_2d, sincos_2d
from vit.registry import register_model, register_timm_names

GLOBAL_POOLS = ("token", "avg", "max", "avgmax", "map", "")


@dataclass
class ViTConfig(BlockConfig):
    """The ViT's options: the Block's (embed_dim, num_heads, mlp_ratio, qkv_bias, qk_norm,
    init_values, norm, mlp, MoE, dropouts; see BlockConfig) and these. timm's names where timm has
    the option."""

    img_size: int | tuple[int, int] = 224
    patch_size: int | tuple[int, int] = 16
    in_chans: int = 3
    num_classes: int = 1000  # 0: no head, forward returns pooled features
    # "token": the CLS token; "avg" / "max" / "avgmax": mean / max / their average over the patch
    # tokens; "map": a learned query attending to the patch tokens (big_vision's MAP head, SigLIP;
    # vit.layers.AttentionPoolLatent); "": no pooling (the head sees every token).
    global_pool: str = "token"
    pool_include_prefix: bool = False  # avg/max/map pooling reads the prefix tokens too (timm's name)
    depth: int = 12
    class_token: bool = True
    reg_tokens: int = 0  # register tokens after the CLS token (Darcet et al. 2024; DINOv2-reg)
    # DeiT's distillation token (after the CLS token) and its own head, trained on a teacher's
    # predictions (vit.lit.ImageClassifier's `teacher`); inference averages the two heads (timm's
    # VisionTransformerDistilled: its checkpoints load as they are).
    distilled: bool = False
    # The position embedding covers the patches only; prefix tokens get none (DeiT III, big_vision).
    no_embed_class: bool = False
    pre_norm: bool = False  # a norm before the blocks, and no patch-embed bias (CLIP)
    embed_norm: bool = False  # a norm on the patch tokens before positions are added (`patch_embed.norm`, AIMv2)
    final_norm: bool = True  # False: no norm after the blocks (nor after pooling)
    # Norm after pooling instead of before (timm/MAE convention for avg pooling); None: avg/max -> True.
    fc_norm: bool | None = None
    drop_rate: float = 0.0  # dropout before the head
    pos_drop_rate: float = 0.0
    drop_path_rate: float = 0.0  # stochastic depth, rising linearly from 0 to this over the blocks
    # Resample the position embedding on the fly when the input grid differs from img_size's.
    dynamic_img_size: bool = False
    dynamic_img_pad: bool = False  # pad inputs to a multiple of the patch size
    # "learn" (timm), "sincos2d" (fixed, big_vision; CLS gets no position), "rope" (2-D axial
    # rotary embedding of q and k in every block; CLS unrotated; no pos_embed parameter) or "none".
    posemb: str = "learn"
    # Fraction of patch tokens dropped at random per image while training.
    patch_drop_rate: float = 0.0
    # "" (timm's default init) or "mimetic": every self-attention layer starts with W_q W_k^T near
    # +identity and W_v W_proj near -identity (vit.layers.mimetic_init_). The paper found it faster on
    # small datasets; in our 10-minute CIFAR-10 runs with Muon it cost 1.5 points (benchmarks/budget.md).
    weight_init: str = ""
    # Channels of a convolutional stem (vit.layers.PatchEmbed) replacing the patchify conv: a hybrid.
    stem_channels: tuple[int, ...] | None = None
    # A hybrid with one of timm's CNNs as patch embedding (vit.layers.HybridEmbed; the ViT paper's
    # R50+ViT-B/16): {"name": a key of HYBRID_BACKBONES, **that constructor's arguments}, e.g.
    # {"name": "resnetv2", "layers": [3, 4, 9]}. patch_size is then the kernel of the projection over
    # the backbone's feature map (1 for most of timm's hybrids), as in timm.
    backbone: dict[str, Any] | None = None
    backbone_proj: bool = True  # False: no projection, the feature map's channels are the width
    global_attn_indexes: tuple[int, ...] = ()  # with window_size: the blocks that attend globally (SAM's)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.posemb not in ("learn", "sincos2d", "rope", "none"):
            raise ValueError(f"posemb must be 'learn', 'sincos2d', 'rope' or 'none', got {self.posemb!r}")
        if self.weight_init not in ("", "mimetic"):
            raise ValueError(f"weight_init must be '' (timm's default) or 'mimetic', got {self.weight_init!r}")
        if self.weight_init == "mimetic" and (self.block_fn != "block" or self.attn_layer != "attn"):
            raise ValueError("weight_init='mimetic' is for a Block's plain attention (block_fn, attn_layer default)")
        if self.posemb == "rope" and self.attn_layer == "diff":
            raise ValueError("posemb='rope' with attn_layer='diff' is not supported: rotary tables are per full head")
        if self.global_pool not in GLOBAL_POOLS:
            raise ValueError(f"global_pool must be one of {GLOBAL_POOLS}, got {self.global_pool!r}")
        if isinstance(self.num_kv_heads, tuple) and len(self.num_kv_heads) != self.depth:
            raise ValueError(f"num_kv_heads {self.num_kv_heads} needs one count per block (depth {self.depth})")
        if (self.rel_pos_type or self.window_size) and (self.patch_drop_rate or self.dynamic_img_size):
            raise ValueError("relative positions and windows are for the built grid: no patch_drop_rate nor "
                             "dynamic_img_size")  # fmt: skip
        if self.global_pool == "token" and not self.class_token:
            raise ValueError("global_pool='token' needs class_token=True (use global_pool='avg' without it)")
        if self.backbone is not None:
            if self.stem_channels:
                raise ValueError("give a hybrid's backbone or stem_channels, not both")
            if self.embed_norm:
                raise ValueError("embed_norm is a norm of the patchify embedding; a hybrid's backbone has none")
            if self.backbone.get("name") not in HYBRID_BACKBONES:
                raise ValueError(
                    f"backbone must be a dict with 'name' one of {sorted(HYBRID_BACKBONES)} and that constructor's "
                    f"arguments, got {self.backbone!r}"
                )


class VisionTransformer(nn.Module):
    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        self.config = c = config
        self.num_classes = c.num_classes
        self.global_pool = c.global_pool
        self.embed_dim = self.num_features = c.embed_dim
        self.num_prefix_tokens = int(c.class_token) + int(c.distilled) + c.reg_tokens
        self.num_reg_tokens = c.reg_tokens
        self.grad_checkpointing = False

        if c.backbone is not None:
            self.patch_embed = HybridEmbed(
                build_backbone(c.backbone, c.in_chans), c.img_size, c.patch_size, c.in_chans, c.embed_dim,
                c.backbone_proj, not c.pre_norm, c.dynamic_img_pad,
            )  # fmt: skip
        else:
            self.patch_embed = PatchEmbed(
                c.img_size, c.patch_size, c.in_chans, c.embed_dim, c.stem_channels, not c.pre_norm, c.dynamic_img_pad,
                c.norm if c.embed_norm else None, c.norm_eps,
            )  # fmt: skip
        self.cls_token = nn.Parameter(torch.zeros(1, 1, c.embed_dim)) if c.class_token else None
        self.dist_token = nn.Parameter(torch.zeros(1, 1, c.embed_dim)) if c.distilled else None
        self.reg_token = nn.Parameter(torch.zeros(1, c.reg_tokens, c.embed_dim)) if c.reg_tokens else None
        self.distilled_training = False  # training returns (class logits, distillation logits)
        # As in timm and the original ViT, the position embedding has entries for the prefix tokens
        # too, unless no_embed_class.
        self.num_pos_prefix = 0 if c.no_embed_class else self.num_prefix_tokens
        if c.posemb == "learn":
            self.pos_embed = nn.Parameter(
                torch.zeros(1, self.patch_embed.num_patches + self.num_pos_prefix, c.embed_dim)
            )
        elif c.posemb == "sincos2d":  # fixed: a buffer, recomputed rather than stored in checkpoints
            self.register_buffer("pos_embed", self._sincos_pos_embed(self.patch_embed.grid_size), persistent=False)
        else:  # rope: positions enter in every attention layer; or none
            self.pos_embed = None
        self.pos_drop = nn.Dropout(c.pos_drop_rate)
        self.patch_drop = PatchDropout(c.patch_drop_rate, self.num_prefix_tokens)
        self.norm_pre = make_norm(c.norm, c.embed_dim, c.norm_eps) if c.pre_norm else nn.Identity()

        dpr = [c.drop_path_rate * i / max(c.depth - 1, 1) for i in range(c.depth)]
        grid = self.patch_embed.grid_size
        self.blocks = nn.Sequential(*[
            make_block(replace(c, window_size=0) if i in c.global_attn_indexes else c, dpr[i], i, False, grid,
                       self.num_prefix_tokens)
            for i in range(c.depth)
        ])  # fmt: skip
        use_fc_norm = c.global_pool in ("avg", "max", "avgmax") if c.fc_norm is None else c.fc_norm
        self.norm = make_norm(c.norm, c.embed_dim, c.norm_eps) if c.final_norm and not use_fc_norm else nn.Identity()
        self.fc_norm = make_norm(c.norm, c.embed_dim, c.norm_eps) if c.final_norm and use_fc_norm else nn.Identity()
        self.attn_pool = None
        if c.global_pool == "map":
            self.attn_pool = AttentionPoolLatent(
                c.embed_dim, c.num_heads, c.mlp_ratio, c.qkv_bias, c.qk_norm, c.norm, c.norm_eps, c.act_layer or "gelu"
            )  # fmt: skip
        self.head_drop = nn.Dropout(c.drop_rate)
        self.head = nn.Linear(c.embed_dim, c.num_classes) if c.num_classes > 0 else nn.Identity()
        self.head_dist = None
        if c.distilled:
            self.head_dist = nn.Linear(c.embed_dim, c.num_classes) if c.num_classes > 0 else nn.Identity()
        self.init_weights()

    def init_weights(self) -> None:
        """timm's default: trunc-normal(0.02) for pos-embed and Linear weights, zero biases,
        CLS and register tokens normal(1e-6), the distillation token trunc-normal(0.02) (DeiT); conv
        and norms keep PyTorch's defaults. `weight_init="mimetic"` then re-initialises attention."""
        if isinstance(self.pos_embed, nn.Parameter):
            nn.init.trunc_normal_(self.pos_embed, std=0.02)
        if self.dist_token is not None:
            nn.init.trunc_normal_(self.dist_token, std=0.02)
        for token in (self.cls_token, self.reg_token):
            if token is not None:
                nn.init.normal_(token, std=1e-6)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
        if self.config.weight_init == "mimetic":
            for block in self.blocks:
                mimetic_init_(block.attn)

    def no_weight_decay(self) -> set[str]:
        """Parameter names (besides norms and biases) that weight decay should skip."""
        return {"pos_embed", "cls_token", "dist_token", "reg_token", "attn_pool.latent"}

    def set_distilled_training(self, enable: bool = True) -> None:
        """While training, return both heads' logits (class, distillation) for a distillation loss
        instead of their mean (timm's name)."""
        self.distilled_training = enable

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Recompute each block's activations in the backward pass: less memory, ~30% more compute."""
        self.grad_checkpointing = enable

    def aux_loss(self) -> torch.Tensor:
        """The MoE load-balancing loss of the last forward (summed over blocks); 0 without MoE."""
        return moe_aux_loss(self)

    def _sincos_pos_embed(self, grid: tuple[int, int]) -> torch.Tensor:
        """big_vision's 2-D sin-cos table for the patches, zeros for the prefix tokens: (1, N, D)."""
        table = sincos_2d(grid[0], grid[1], self.embed_dim)
        return F.pad(table, (0, 0, self.num_pos_prefix, 0))[None]

    def patch_grid(self, images: torch.Tensor) -> tuple[int, int]:
        """(rows, columns) of patch tokens the images give: the one definition (rollout maps use it)."""
        return self.patch_embed.dynamic_feat_size(tuple(images.shape[-2:]))

    def _rope(self, images: torch.Tensor, kept: torch.Tensor | None) -> Rope:
        """posemb="rope": the (cos, sin) tables of the images' patch grid, shared by every block;
        after patch dropout each image's kept patches' rows, (B, 1, kept, head_dim) for the heads."""
        if self.config.posemb != "rope":
            return None
        tables = rope_2d(self.patch_grid(images), self.embed_dim // self.config.num_heads)
        return keep_rope(tables, kept, images.device)

    def _embed(self, images: torch.Tensor) -> tuple[torch.Tensor, Rope]:
        """Images -> [CLS, registers] + patch tokens with their positions, as the blocks take them,
        and the rotary tables of those patches (posemb="rope", else None)."""
        x = self.patch_embed(images)
        grid = self.patch_grid(images)
        if (self.config.rel_pos_type or self.config.window_size) and grid != self.patch_embed.grid_size:
            raise ValueError(
                f"input of a {grid[0]}x{grid[1]} patch grid; this model's relative positions and windows are for "
                f"{self.patch_embed.grid_size[0]}x{self.patch_embed.grid_size[1]}: build it with that img_size"
            )
        pos_embed = self._pos_embed(grid, x.device) if self.pos_embed is not None else None
        if pos_embed is not None and self.config.no_embed_class:
            x = x + pos_embed  # the patches only
        tokens = (self.cls_token, self.dist_token, self.reg_token)
        prefix = [t.expand(x.shape[0], -1, -1) for t in tokens if t is not None]
        x = torch.cat([*prefix, x], dim=1) if prefix else x
        if pos_embed is not None and not self.config.no_embed_class:
            x = x + pos_embed  # prefix and patches
        x, kept = self.patch_drop(self.pos_drop(x), return_indices=True)
        return self.norm_pre(x), self._rope(images, kept)

    def _pos_embed(self, grid: tuple[int, int], device: torch.device) -> torch.Tensor:
        """The additive position embedding for a patch grid, resampled (or recomputed) off img_size's."""
        if grid == self.patch_embed.grid_size:
            return self.pos_embed
        if self.config.posemb == "sincos2d":  # a closed form: no resampling needed
            return self._sincos_pos_embed(grid).to(device)
        if not self.config.dynamic_img_size:
            raise ValueError(
                f"input of {grid[0] * grid[1]} patches ({grid[0]}x{grid[1]}) does not match the position "
                f"embedding's {self.patch_embed.grid_size[0]}x{self.patch_embed.grid_size[1]} grid "
                f"(img_size={self.config.img_size}); build the model with the new img_size "
                "(vit.checkpoint resamples the position embedding on load) or set dynamic_img_size=True"
            )
        return resample_abs_pos_embed(self.pos_embed, list(grid), list(self.patch_embed.grid_size), self.num_pos_prefix)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Images (B, C, H, W) -> normed tokens (B, prefix + patches, D)."""
        return self.norm(self._run_blocks(*self._embed(x))[0])

    def _run_blocks(
        self,
        x: torch.Tensor,
        rope: Rope,
        last_num_queries: int | None = None,
        return_attn: bool = False,
        take: Collection[int] = (),
        depth: int | None = None,
        attn_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
        """The first `depth` blocks (all by default) in order: the output, the attention weights of
        every block if `return_attn`, and the outputs of the blocks numbered in `take`. The last block
        returns only its first `last_num_queries` tokens if given. `rope`: one table for every block,
        or a list of one per block (mixed RoPE); `attn_mask`: every block's (a shared bias)."""
        attns, taken = [], []
        blocks = self.blocks[:depth] if depth is not None else self.blocks
        for i, block in enumerate(blocks):
            num_queries = last_num_queries if i == len(blocks) - 1 else None
            table = rope[i] if isinstance(rope, list) else rope
            if self.grad_checkpointing and torch.is_grad_enabled():
                out = checkpoint(block, x, attn_mask, table, None, num_queries, return_attn, use_reentrant=False)
            else:
                out = block(x, attn_mask, rope=table, num_queries=num_queries, return_attn=return_attn)
            if return_attn:
                out, attn = out
                attns.append(attn)
            x = out
            if i in take:
                taken.append(x)
        return x, attns, taken

    def forward_intermediates(
        self,
        x: torch.Tensor,
        indices: int | list[int] | None = None,
        return_prefix_tokens: bool = False,
        norm: bool = False,
        stop_early: bool = False,
        output_fmt: str = "NCHW",
        intermediates_only: bool = False,
    ) -> list | tuple[torch.Tensor, list]:
        """timm's feature API: the outputs of the blocks chosen by `indices` (an int n: the last n;
        a list: those, negatives from the end; None: all), for detection / segmentation heads.

        Each is (B, D, H, W) on the patch grid ("NCHW") or (B, patches, D) ("NLC"), prefix tokens
        removed (or paired with them, `return_prefix_tokens`), after the final norm if `norm`.
        Returns (final normed tokens, intermediates), or the intermediates only; `stop_early` skips
        the blocks after the last one asked for (the "final" tokens are then that block's, as in timm).
        """
        if output_fmt not in ("NCHW", "NLC"):
            raise ValueError(f"output_fmt must be 'NCHW' or 'NLC', got {output_fmt!r}")
        take = _take_indices(len(self.blocks), indices)
        depth = max(take) + 1 if stop_early else None
        tokens, _, taken = self._run_blocks(*self._embed(x), take=set(take), depth=depth)
        taken = [self.norm(t) for t in taken] if norm else taken
        prefix = [t[:, : self.num_prefix_tokens] for t in taken]
        out = [t[:, self.num_prefix_tokens :] for t in taken]
        if output_fmt == "NCHW":
            h, w = self.patch_grid(x)
            out = [t.reshape(t.shape[0], h, w, -1).permute(0, 3, 1, 2).contiguous() for t in out]
        if return_prefix_tokens:
            out = list(zip(out, prefix, strict=True))
        return out if intermediates_only else (self.norm(tokens), out)

    def prune_intermediate_layers(
        self, indices: int | list[int] = 1, prune_norm: bool = False, prune_head: bool = True
    ) -> list[int]:
        """timm's feature-extractor trim: drop the blocks after the last one `indices` takes (as in
        forward_intermediates), and the final norm and the head if asked; returns the kept indices."""
        take = _take_indices(len(self.blocks), indices)
        self.blocks = self.blocks[: max(take) + 1]
        if prune_norm:
            self.norm = nn.Identity()
        if prune_head:
            self.fc_norm = nn.Identity()
            self.reset_classifier(0, "")
        return take

    def get_classifier(self) -> nn.Module:
        return self.head

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        """A new, freshly initialised head for `num_classes` (0: none, the model returns features),
        and optionally another pooling; the attention-pool head can be removed, not added (timm)."""
        if global_pool is not None:
            if global_pool not in GLOBAL_POOLS:
                raise ValueError(f"global_pool must be one of {GLOBAL_POOLS}, got {global_pool!r}")
            if global_pool == "map" and self.attn_pool is None:
                raise ValueError(
                    "reset_classifier cannot add an attention-pool head; build the model with global_pool='map'"
                )
            if global_pool == "token" and not self.config.class_token:
                raise ValueError("global_pool='token' needs a CLS token; this model has none")
            if global_pool != "map":
                self.attn_pool = None
            self.global_pool = global_pool
        self.num_classes = num_classes
        self.config = replace(self.config, num_classes=num_classes, global_pool=self.global_pool)
        device = next(self.parameters()).device
        for name in ["head", "head_dist"] if self.head_dist is not None else ["head"]:
            head = nn.Linear(self.embed_dim, num_classes, device=device) if num_classes > 0 else nn.Identity()
            if num_classes > 0:
                nn.init.trunc_normal_(head.weight, std=0.02)
                nn.init.zeros_(head.bias)
            setattr(self, name, head)

    def pool(self, x: torch.Tensor) -> torch.Tensor:
        """Tokens (B, N, D) -> (B, D) by global_pool; all but "token" read the patch tokens only, unless
        pool_include_prefix."""
        if not self.global_pool:
            return x
        if self.global_pool == "token":
            return x[:, 0]
        patches = x if self.config.pool_include_prefix else x[:, self.num_prefix_tokens :]
        if self.attn_pool is not None:
            return self.attn_pool(patches)
        if self.global_pool == "avg":
            return patches.mean(dim=1)
        if self.global_pool == "max":
            return patches.amax(dim=1)
        return 0.5 * (patches.amax(dim=1) + patches.mean(dim=1))  # avgmax

    def forward_head(
        self, x: torch.Tensor, pre_logits: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Pooled tokens -> logits. A distilled model has a second head on its distillation token:
        its logits are averaged with the class head's, or, while training with distilled_training,
        returned beside them as (class logits, distillation logits)."""
        dist = self.fc_norm(x[:, int(self.config.class_token)]) if self.dist_token is not None else None
        x = self.head_drop(self.fc_norm(self.pool(x)))
        if dist is None:
            return x if pre_logits else self.head(x)
        if pre_logits:
            return (x + dist) / 2
        x, dist = self.head(x), self.head_dist(self.head_drop(dist))
        if self.distilled_training and self.training:
            return x, dist
        return (x + dist) / 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits, equal to `forward_head(forward_features(x))`.

        With CLS pooling the head reads one token, so the last block computes attention, projection
        and MLP for the CLS token only (its keys and values still come from every token): about 3/4 of
        that block's work, which timm spends on outputs it throws away, is skipped.
        """
        last_num_queries = 1 + int(self.config.distilled) if self.global_pool == "token" else None
        return self.forward_head(self.norm(self._run_blocks(*self._embed(x), last_num_queries)[0]))

    def forward_with_attn(self, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Logits and every block's attention weights, each (B, heads, N, N) with N = prefix + patches.

        Uses the explicit attention path for this call only; the weights stay in the autograd graph
        (for gradient-weighted rollout) unless called under `torch.no_grad()`.
        """
        x, attns, _ = self._run_blocks(*self._embed(x), return_attn=True)
        return self.forward_head(self.norm(x)), attns


Table = tuple[torch.Tensor, torch.Tensor]
Rope = Table | list[Table] | None  # the rotary (cos, sin) tables: for every block, one per block, none


def keep_rope(tables: Table, kept: torch.Tensor | None, device: torch.device) -> Table:
    """Rotary tables (..., N, head_dim) on `device`, after patch dropout the rows of each image's kept
    patches: (B, 1 or heads, kept, head_dim), the heads' axis where the attention broadcasts them."""
    cos, sin = (t.to(device) for t in tables)
    if kept is None:
        return cos, sin

    def gather(t: torch.Tensor) -> torch.Tensor:  # (N, d) -> (B, 1, kept, d); (heads, N, d) -> (B, heads, kept, d)
        return t[kept][:, None] if t.ndim == 2 else t[..., kept, :].movedim(-3, 0)

    return gather(cos), gather(sin)


def _take_indices(num_blocks: int, indices: int | list[int] | None) -> list[int]:
    """timm's block selection: None -> all, n -> the last n, a list -> those (negatives from the end)."""
    if indices is None or isinstance(indices, int):
        n = num_blocks if indices is None else indices
        if not 0 < n <= num_blocks:
            raise ValueError(f"indices={n}: the last n blocks needs 1 <= n <= {num_blocks}")
        return list(range(num_blocks - n, num_blocks))
    take = [i + num_blocks if i < 0 else i for i in indices]
    if not take or not all(0 <= i < num_blocks for i in take):
        raise ValueError(f"indices {indices} are not block numbers of a {num_blocks}-block model")
    return take


# The size table (ViT paper, Table 1; big_vision's `decode_variant`). MLP width is 4x embed_dim.
VIT_SIZES: dict[str, dict[str, int]] = {
    "Ti": dict(embed_dim=192, depth=12, num_heads=3),
    "S": dict(embed_dim=384, depth=12, num_heads=6),
    "B": dict(embed_dim=768, depth=12, num_heads=12),
    "L": dict(embed_dim=1024, depth=24, num_heads=16),
    "H": dict(embed_dim=1280, depth=32, num_heads=16),
    # Ours, not in the paper: small enough to train from scratch on a 2-core CPU.
    "micro": dict(embed_dim=192, depth=6, num_heads=3),
    "nano": dict(embed_dim=128, depth=4, num_heads=4),
}

# name -> (size, patch size, image size). ImageNet models carry timm's names.
VIT_MODELS: dict[str, tuple[str, int, int]] = {
    "vit_tiny_patch16_224": ("Ti", 16, 224),
    "vit_small_patch16_224": ("S", 16, 224),
    "vit_base_patch16_224": ("B", 16, 224),
    "vit_base_patch16_384": ("B", 16, 384),
    "vit_large_patch16_224": ("L", 16, 224),
    "vit_huge_patch14_224": ("H", 14, 224),
    # CIFAR (32x32) and Tiny-ImageNet (64x64) sized inputs: 8x8 patch grids.
    "vit_tiny_patch4_32": ("Ti", 4, 32),
    "vit_small_patch4_32": ("S", 4, 32),
    "vit_micro_patch4_32": ("micro", 4, 32),
    "vit_tiny_patch8_64": ("Ti", 8, 64),
    "vit_micro_patch8_64": ("micro", 8, 64),
    # The offline default: 8x8 digits upsampled to 16x16, a 4x4 grid.
    "vit_nano_patch4_16": ("nano", 4, 16),
}

for _name, (_size, _patch, _img) in VIT_MODELS.items():
    register_model(_name, VisionTransformer, ViTConfig, **VIT_SIZES[_size], patch_size=_patch, img_size=_img)


# -- every timm VisionTransformer by name, read from timm's own model functions ---------------------


# The CNNs that timm's hybrid model functions (timm.models.vision_transformer_hybrid) build as patch
# embedding: our name (ViTConfig.backbone["name"]) -> the function or class of that module building it.
HYBRID_BACKBONES = {"resnetv2": "_resnetv2", "resnet26d": "resnet26d", "resnet50d": "resnet50d", "convstem": "ConvStem"}
# Activation classes in timm's backbone arguments, by the name timm's constructors also take.
_ACT_NAMES = {nn.GELU: "gelu", nn.ReLU: "relu", nn.SiLU: "silu"}


def build_backbone(spec: dict[str, Any], in_chans: int = 3) -> nn.Module:
    """A hybrid's CNN (ViTConfig.backbone), built by timm's own constructor as timm's hybrid models build
    it. "resnetv2": ResNetV2 without pre-activation, weight-standardised convs with 'same' padding, the
    stages of `layers` (none: the stem only); the R50 of R50+ViT-B/16 is layers [3, 4, 9].
    "resnet26d" / "resnet50d": timm's ResNet-D with features_only; "convstem": MobileCLIP's stem."""
    import timm.models.vision_transformer_hybrid as timm_hybrid

    kwargs = dict(spec)
    return getattr(timm_hybrid, HYBRID_BACKBONES[kwargs.pop("name")])(**kwargs, in_chans=in_chans)


class _Recorded(Exception):
    pass


@dataclass(frozen=True)
class _RecordedBackbone:
    """What a hybrid model function asked a backbone constructor for, in place of the backbone."""

    spec: dict[str, Any]


def _backbone_recorder(name: str, build: Callable) -> Callable[..., _RecordedBackbone]:
    signature = inspect.signature(build)

    def record(*args: object, **kwargs: object) -> _RecordedBackbone:
        spec: dict[str, Any] = {"name": name}
        for key, value in signature.bind(*args, **kwargs).arguments.items():
            spec.update(value if signature.parameters[key].kind is inspect.Parameter.VAR_KEYWORD else {key: value})
        for key in ("pretrained", "in_chans", "device", "dtype"):  # no weights; in_chans is the config's
            spec.pop(key, None)
        for key, value in spec.items():
            if isinstance(value, type):
                if value not in _ACT_NAMES:
                    raise ValueError(f"timm's {name} backbone takes {key}={value.__name__}, which has no name here")
                spec[key] = _ACT_NAMES[value]
        return _RecordedBackbone(spec)

    return record


def timm_model_args(name: str) -> dict:
    """The kwargs timm's `create_model(name)` builds its VisionTransformer with: those its model function
    passes (read by calling it with the builders, of the ViT, of DeiT and of the hybrids, and the
    hybrids' backbone constructors swapped for recorders, so nothing is built) and the defaults its
    builder takes from the name's pretrained config (image size, classes). A DeiT built as
    VisionTransformerDistilled records distilled=True; a hybrid records timm's `embed_layer`, a
    HybridEmbed of a recorded backbone."""
    import timm.models.deit as timm_deit
    import timm.models.vision_transformer as timm_vit
    import timm.models.vision_transformer_hybrid as timm_hybrid

    recorded: dict = {}

    def record(variant: str, pretrained: bool = False, distilled: bool = False, **kwargs: object) -> None:
        recorded.update(kwargs, **({"distilled": True} if distilled else {}))
        raise _Recorded

    def record_hybrid(cls: type, variant: str, pretrained: bool, pretrained_filter_fn=None, feature_cfg=None, **kwargs):
        if cls is not timm_vit.VisionTransformer:
            raise ValueError(f"timm's {name} is a {cls.__name__}, not timm's VisionTransformer")
        recorded.update(kwargs)  # with timm's hybrid defaults: patch_size 1, embed_layer HybridEmbed
        raise _Recorded

    with contextlib.ExitStack() as patches:
        patches.enter_context(mock.patch.object(timm_vit, "_create_vision_transformer", record))
        patches.enter_context(mock.patch.object(timm_deit, "_create_deit", record))
        patches.enter_context(mock.patch.object(timm_hybrid, "build_model_with_cfg", record_hybrid))
        for ours, attr in HYBRID_BACKBONES.items():
            recorder = _backbone_recorder(ours, getattr(timm_hybrid, attr))
            patches.enter_context(mock.patch.object(timm_hybrid, attr, recorder))
        try:
            timm.models.model_entrypoint(name)()
        except _Recorded:
            pass
        else:
            raise ValueError(
                f"timm's {name} does not build a VisionTransformer through timm's ViT, DeiT or hybrid builder"
            )
    return timm_pretrained_defaults(name) | recorded


def record_timm_builder(name: str, module: object, builder: str) -> dict:
    """The kwargs timm's `create_model(name)` passes to `module.builder`, the private function that builds
    the model (called with it swapped for a recorder, so nothing is built), with the defaults it takes
    from the name's pretrained config (image size, classes)."""
    recorded: dict = {}

    def record(variant: str, pretrained: bool = False, **kwargs: object) -> None:
        recorded.update(kwargs)
        raise _Recorded

    with mock.patch.object(module, builder, record):
        try:
            timm.models.model_entrypoint(name)()
        except _Recorded:
            pass
        else:
            raise ValueError(f"timm's {name} does not build its model through timm's {builder}")
    return timm_pretrained_defaults(name) | recorded


def timm_pretrained_defaults(name: str) -> dict:
    """What timm's builder adds to a model function's kwargs from the name's default pretrained
    config (DINOv2: 518 px, no head)."""
    cfg = timm.models.get_pretrained_cfg(name)
    if cfg is None:
        return {}
    defaults = {"in_chans": cfg.input_size[0]}
    if cfg.num_classes is not None and cfg.num_classes >= 0:
        defaults["num_classes"] = cfg.num_classes
    if cfg.fixed_input_size:
        defaults["img_size"] = tuple(cfg.input_size[-2:])
    return defaults


def _timm_norm(value: object) -> tuple[str, float] | None:
    """timm's norm_layer (a class, a partial with eps, or timm's name) as (our norm kind, eps); None if
    it has no equal here."""
    from timm.layers import LayerNorm, RmsNorm

    if value in ("layernorm", "rmsnorm"):  # timm's get_norm_layer: its LayerNorm / RmsNorm, eps 1e-6
        return value, 1e-6
    func, keywords = getattr(value, "func", value), getattr(value, "keywords", {})
    if func not in (LayerNorm, RmsNorm, nn.LayerNorm, nn.RMSNorm) or set(keywords) - {"eps"}:
        return None
    kind = "layernorm" if func in (LayerNorm, nn.LayerNorm) else "rmsnorm"
    return kind, keywords.get("eps", 1e-5 if func is nn.LayerNorm else 1e-6)


# timm's VisionTransformer kwargs that are ViTConfig fields under another name.
_TIMM_RENAMED = {"scale_attn_norm": "scale_attn_inner", "scale_mlp_norm": "scale_mlp"}
# ViTConfig fields whose timm kwarg of the same name means something else (a class, not our name).
_NOT_TIMMS = ("norm", "mlp", "posemb", "act_layer", "embed_norm", "block_fn", "attn_layer", *_TIMM_RENAMED.values())


def _timm_blocks() -> dict[type, dict[str, Any]]:
    """timm's ViT block classes as our block options."""
    import timm.models.vision_transformer as timm_vit

    return {
        timm_vit.Block: {},
        timm_vit.ResPostBlock: {"post_norm": True},
        timm_vit.ParallelScalingBlock: {"block_fn": "parallel_scaling"},
        timm_vit.DiffParallelScalingBlock: dict(block_fn="parallel_scaling", attn_layer="diff", fuse_out_proj=True),
        timm_vit.ParallelThingsBlock: {"block_fn": "parallel_things"},
    }


def _timm_block_options(config: BlockConfig) -> dict[str, Any]:
    """The block options of a config that pick timm's block class (`_timm_blocks`)."""
    names = ("post_norm", "block_fn", "attn_layer", "fuse_out_proj", "num_parallel")
    return {name: getattr(config, name) for name in names}


def _timm_attentions() -> tuple[type, type]:
    """timm's ViT attention classes: plain, differential."""
    from timm.layers import Attention, DiffAttention

    return Attention, DiffAttention


def from_timm_args(args: dict) -> dict:
    """timm's VisionTransformer kwargs as ViTConfig fields; anything without an equal is a ValueError."""
    from timm.layers import GluMlp, SwiGLU
    from timm.layers import HybridEmbed as TimmHybridEmbed

    fields = {f.name for f in dataclasses.fields(ViTConfig)}
    out, embed_norm = {}, None
    for key, value in args.items():
        func, keywords = getattr(value, "func", value), getattr(value, "keywords", {})
        if key == "embed_layer" and func is TimmHybridEmbed:
            out.update(_from_timm_hybrid_embed(keywords))
            continue
        if key == "norm_layer" and _timm_norm(value):
            out["norm"], out["norm_eps"] = _timm_norm(value)
        elif key == "embed_norm_layer" and (value is None or _timm_norm(value)):
            embed_norm = value and _timm_norm(value)
        elif key == "act_layer" and (value in ACTIVATIONS or func in (nn.SiLU, nn.GELU)):
            out["act_layer"] = value if isinstance(value, str) else {nn.SiLU: "silu", nn.GELU: "gelu"}[func]
        elif key == "mlp_layer" and func is GluMlp and not keywords.get("gate_last", True):
            out["mlp"] = "glu"
        elif key == "mlp_layer" and func is SwiGLU and not set(keywords) - {"align_to"}:
            out.update(mlp="swiglu_split", swiglu_align_to=keywords.get("align_to", 0))
        elif key == "pos_embed" and value in ("learn", "none", ""):
            out["posemb"] = value or "none"
        elif key == "block_fn" and func in _timm_blocks() and set(keywords) <= {"num_parallel", "fuse_out_proj"}:
            out.update(_timm_blocks()[func], **keywords)
        elif key == "attn_layer" and (value in ("", "attn", "diff") or func in _timm_attentions()):
            out["attn_layer"] = "diff" if value == "diff" or func is _timm_attentions()[-1] else "attn"
        elif key in _TIMM_RENAMED:
            out[_TIMM_RENAMED[key]] = value
        elif key in fields and key not in _NOT_TIMMS:
            out[key] = value
        else:
            raise ValueError(f"timm's {key}={getattr(func, '__name__', value)!r} has no equivalent here")
    if embed_norm:  # ours is the blocks' norm: timm's must be the same kind and eps
        if embed_norm != (out.get("norm", "layernorm"), out.get("norm_eps", 1e-6)):
            raise ValueError(f"timm's embed_norm_layer {embed_norm} differs from its norm_layer; no equivalent here")
        out["embed_norm"] = True
    return out


def _from_timm_hybrid_embed(keywords: dict[str, Any]) -> dict[str, Any]:
    """timm's HybridEmbed arguments (a recorded backbone, `proj`) as ViTConfig fields."""
    backbone = keywords.get("backbone")
    if not isinstance(backbone, _RecordedBackbone):
        raise ValueError(
            f"timm's HybridEmbed backbone {type(backbone).__name__} is built by none of timm's constructors "
            f"rebuilt here ({', '.join(HYBRID_BACKBONES.values())} of timm.models.vision_transformer_hybrid)"
        )
    unknown = sorted(set(keywords) - {"backbone", "proj"})
    if unknown:
        raise ValueError(f"timm's HybridEmbed arguments {unknown} have no equivalent here")
    return {"backbone": backbone.spec, **({"backbone_proj": False} if keywords.get("proj") is False else {})}


# timm's ViT names we build identically; the rest are named unsupported, with the reason.
register_timm_names(
    "ViT", [("*", "vision_transformer"), ("deit*", "deit"), ("vit_*", "vision_transformer_hybrid")],
    VisionTransformer, ViTConfig, lambda name: from_timm_args(timm_model_args(name)), skip=VIT_MODELS,
)  # fmt: skip


# -- checkpoints: timm's kwargs, fix-ups of other layouts, Google's .npz files ------------------------

# Our options that timm's VisionTransformer builds the same way, under the same names.
_TIMM_FIELDS = (
    "img_size", "patch_size", "in_chans", "num_classes", "global_pool", "class_token", "embed_dim", "depth",
    "num_heads", "mlp_ratio", "qkv_bias", "qk_norm", "init_values", "fc_norm", "drop_rate", "pos_drop_rate",
    "proj_drop_rate", "attn_drop_rate", "drop_path_rate", "dynamic_img_size", "patch_drop_rate", "reg_tokens",
    "no_embed_class", "pre_norm", "final_norm", "dynamic_img_pad", "proj_bias", "pool_include_prefix",
)  # fmt: skip


def timm_kwargs(config: ViTConfig) -> dict:
    """The kwargs of timm's `VisionTransformer` that builds this config with the same parameter names,
    shapes and function; options timm has no equal for (set away from their defaults) are an error."""
    from timm.layers import GluMlp, LayerNorm, RmsNorm, SwiGLU

    default = ViTConfig()
    eva_options = ("qkv_fused", "k_bias", "layer_scale")  # timm's Eva has them
    others = ("rel_pos_type", "window_size", "global_attn_indexes")  # timm's relpos and SAM ViTs have them
    unmatched = {
        name: getattr(config, name)
        for name in ("num_experts", "stem_channels", *eva_options, *others)
        if getattr(config, name) != getattr(default, name)
    }
    if config.posemb not in ("learn", "none"):
        unmatched["posemb"] = config.posemb
    if config.mlp not in ("gelu", "glu", "swiglu_split"):  # timm's ViT has no SwiGLU of ours nor a packed one
        unmatched["mlp"] = config.mlp
    block = {k: v for k, v in _timm_block_options(config).items() if v != getattr(default, k)}
    diff_attn = "block_fn" not in block and block.pop("attn_layer", "attn") == "diff"  # timm's attn_layer="diff"
    blocks = [type_ for type_, options in _timm_blocks().items() if options == block]
    if len(blocks) != 1:  # num_parallel or fuse_out_proj where timm's class has them fixed
        unmatched.update(block)
    if unmatched:
        raise ValueError(f"timm's VisionTransformer has no equivalent of {unmatched}")
    kwargs = {name: getattr(config, name) for name in _TIMM_FIELDS}
    norm = partial(LayerNorm if config.norm == "layernorm" else RmsNorm, eps=config.norm_eps)
    kwargs.update(
        pos_embed=config.posemb, norm_layer=norm, block_fn=blocks[0], attn_layer="diff" if diff_attn else "",
        act_layer=config.act_layer or ("silu" if config.mlp == "swiglu_split" else "gelu"),
        scale_attn_norm=config.scale_attn_inner, scale_mlp_norm=config.scale_mlp,
    )  # fmt: skip
    if config.embed_norm:
        kwargs["embed_norm_layer"] = norm
    if config.mlp == "glu":
        kwargs["mlp_layer"] = partial(GluMlp, gate_last=False)
    if config.mlp == "swiglu_split":
        kwargs["mlp_layer"] = partial(SwiGLU, align_to=config.swiglu_align_to)
    if config.backbone is not None:  # a fresh backbone: timm's model gets its own modules
        from timm.layers import HybridEmbed as TimmHybridEmbed

        backbone = build_backbone(config.backbone, config.in_chans)
        kwargs["embed_layer"] = partial(TimmHybridEmbed, backbone=backbone, proj=config.backbone_proj)
    return kwargs


def checkpoint_filter_fn(
    state_dict: dict[str, torch.Tensor], model: VisionTransformer, log: Callable[[str, str], None] | None = None
) -> dict[str, torch.Tensor]:
    """A ViT state dict (ours or timm's) made to fit `model` (timm's function of that name): the
    position embedding is resampled to the model's grid, the CLS and register tokens and their
    positions follow the model (kept, dropped, or left at the model's init), and the final norm moves
    between before pooling (`norm`) and after it (`fc_norm`).
    `log(kind, what)` hears of each change: "resampled", "reinitialised", "renamed" or "dropped"."""
    log = log or (lambda kind, what: None)
    sd, target = dict(state_dict), model.state_dict()
    source_prefix = ("cls_token" in sd, sd["reg_token"].shape[1] if "reg_token" in sd else 0)
    for name in ("cls_token", "reg_token"):
        if name in sd and name in target and sd[name].shape[-1] != target[name].shape[-1]:
            continue  # another width: not adaptable, the caller reports it
        if name in sd and (name not in target or sd[name].shape != target[name].shape):
            del sd[name]  # no such token in the model, or another number of registers
            log("dropped", name)
        if name in target and name not in sd:
            sd[name] = target[name]
            log("reinitialised", name)

    # Final norm before pooling (norm) or after it (fc_norm, timm's avg pooling): same parameters.
    for old, new in (("norm", "fc_norm"), ("fc_norm", "norm")):
        for suffix in ("weight", "bias"):
            if f"{old}.{suffix}" in sd and f"{old}.{suffix}" not in target and f"{new}.{suffix}" in target:
                sd[f"{new}.{suffix}"] = sd.pop(f"{old}.{suffix}")
                log("renamed", f"{old}.{suffix} -> {new}.{suffix}")

    if "pos_embed" in sd and "pos_embed" in target:
        sd["pos_embed"] = _adapt_pos_embed(sd["pos_embed"], source_prefix, model, log)
    return sd


def _is_square(n: int) -> bool:
    return n >= 0 and math.isqrt(n) ** 2 == n


def _adapt_pos_embed(
    posemb: torch.Tensor, source_prefix: tuple[bool, int], model: VisionTransformer, log: Callable[[str, str], None]
) -> torch.Tensor:
    """Split off the prefix positions (CLS, registers) if the checkpoint has them, resample the patch
    grid to the model's, and give the model the prefix positions it expects."""
    has_cls, num_reg = source_prefix
    if not _is_square(posemb.shape[1] - has_cls - num_reg):  # DeiT III / no_embed_class: patches only
        has_cls, num_reg = False, 0
    if not _is_square(posemb.shape[1] - has_cls - num_reg):
        raise ValueError(f"pos_embed: cannot infer a square patch grid from shape {tuple(posemb.shape)}")
    cls, reg, grid = posemb.split([int(has_cls), num_reg, posemb.shape[1] - has_cls - num_reg], dim=1)
    side = math.isqrt(grid.shape[1])
    new_grid = model.patch_embed.grid_size
    if (side, side) != new_grid:
        grid = resample_abs_pos_embed(grid, list(new_grid), [side, side], num_prefix_tokens=0)
        log("resampled", f"pos_embed (grid {side}x{side} -> {new_grid[0]}x{new_grid[1]})")
    want_cls = model.cls_token is not None and model.num_pos_prefix > 0
    want_reg = model.num_reg_tokens if model.num_pos_prefix > 0 else 0
    parts = []
    for what, have, want in (("CLS", cls, int(want_cls)), ("registers", reg, want_reg)):
        if have.shape[1] == want:
            parts.append(have)
        elif want:  # the checkpoint has no (or other) positions for these tokens
            parts.append(grid.new_zeros(1, want, grid.shape[2]))
            had = f"has {have.shape[1]}, the model {want}" if have.shape[1] else f"has no {what} position"
            log("reinitialised", f"pos_embed[{what}] (zeros: the checkpoint {had})")
        else:
            log("dropped", f"pos_embed[{what}]")
    return torch.cat([*parts, grid], dim=1)


def load_npz(path: str | Path, model: VisionTransformer) -> dict[str, torch.Tensor]:
    """Google's ViT `.npz` (big_vision / the original release) as a timm-layout state dict: read by
    timm's converter into a timm ViT built to the file's shapes (grid, head, CLS) and the model's
    width and depth. `checkpoint_filter_fn` then fits it to the model."""
    import numpy as np
    import timm

    path = Path(path)
    with np.load(path, allow_pickle=False) as w:
        keys = set(w.files)
        prefix = next((p for p in ("", "opt/target/", "params/") if f"{p}embedding/kernel" in keys), None)
        if prefix is None:
            raise ValueError(f"{path} is not a Google ViT checkpoint (no embedding/kernel)")
        posemb = w.get(f"{prefix}Transformer/posembed_input/pos_embedding", w.get(f"{prefix}pos_embedding"))
        num_pos = posemb.shape[1]
        num_classes = w[f"{prefix}head/bias"].shape[0] if f"{prefix}head/bias" in keys else 0
        patch = w[f"{prefix}embedding/kernel"].shape[0]
        pool = "map" if f"{prefix}MAPHead_0/probe" in keys else "token" if f"{prefix}cls" in keys else "avg"
    has_cls = f"{prefix}cls" in keys
    # A hybrid's embedding kernel spans feature-map cells, each `feature_ratio` pixels wide.
    patch_px = patch * getattr(model.patch_embed, "feature_ratio", (1, 1))[0]
    config = replace(
        model.config, img_size=math.isqrt(num_pos - has_cls) * patch_px, patch_size=patch, num_classes=num_classes,
        global_pool=pool, class_token=has_cls, fc_norm=False,
    )  # fmt: skip
    source = timm.models.vision_transformer.VisionTransformer(**timm_kwargs(config))
    source.load_pretrained(str(path))
    return source.state_dict()
