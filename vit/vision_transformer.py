"""Vision Transformer (Dosovitskiy et al. 2021) with timm's parameter names.

Patch embedding -> [CLS] + learned position embedding -> L pre-norm Blocks -> norm -> pool -> head.
`our_model.load_state_dict(timm_model.state_dict())` works for the matching configuration and gives
the same logits; the tests hold us to that. timm's other ViT names are read from timm's model
functions in vit.timm_args; checkpoints of other layouts are fitted to the model in vit.checkpoint.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from timm.layers import resample_abs_pos_embed
from torch import nn
from torch.utils.checkpoint import checkpoint

from vit.layers import (
    AttentionPoolLatent,
    Block,
    BlockConfig,
    HybridEmbed,
    PatchDropout,
    PatchEmbed,
    make_block,
    make_norm,
    mimetic_init_,
    moe_aux_loss,
)
from vit.options import OptionError, number, whole
from vit.position import rope_2d, sincos_2d

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
    fix_init: bool = False  # each block's attn.proj and mlp.fc2 start divided by sqrt(2 x its number, from 1) (timm)
    # Channels of a convolutional stem (vit.layers.PatchEmbed) replacing the patchify conv: a hybrid.
    stem_channels: tuple[int, ...] | None = None
    # The stem's convs at stride 1, each followed by a 3x3 stride-2 max pool (CCT's tokenizer).
    stem_pool: bool = False
    # Shifted Patch Tokenization (Lee et al. 2021, small datasets): the patches of the image and of 4 copies
    # shifted diagonally by half a patch, normed (`patch_embed.patch_norm`) then projected (vit.layers.PatchEmbed).
    shifted_patches: bool = False
    # A hybrid with one of timm's CNNs as patch embedding (vit.layers.HybridEmbed; the ViT paper's
    # R50+ViT-B/16): {"name": a key of HYBRID_BACKBONES, **that constructor's arguments}, e.g.
    # {"name": "resnetv2", "layers": [3, 4, 9]}. patch_size is then the kernel of the projection over
    # the backbone's feature map (1 for most of timm's hybrids), as in timm.
    backbone: dict[str, Any] | None = None
    backbone_proj: bool = True  # False: no projection, the feature map's channels are the width
    global_attn_indexes: tuple[int, ...] = ()  # with window_size: the blocks that attend globally (SAM's)

    def __post_init__(self) -> None:
        super().__post_init__()
        whole(self.depth, 1, "depth", "transformer blocks")
        for name in ("drop_rate", "pos_drop_rate", "drop_path_rate", "patch_drop_rate"):
            number(getattr(self, name), name, "a rate in [0, 1)", 0, 1, open_high=True)
        whole(self.reg_tokens, 0, "reg_tokens", "register tokens, 0 for none")
        if self.backbone is None:  # a hybrid's patch_size is over its backbone's feature map
            check_grid(self.img_size, self.patch_size, self.dynamic_img_pad, whole_patches=False)
        if self.posemb not in ("learn", "sincos2d", "rope", "none"):
            raise ValueError(f"posemb must be 'learn', 'sincos2d', 'rope' or 'none', got {self.posemb!r}")
        if self.weight_init not in ("", "mimetic"):
            raise ValueError(f"weight_init must be '' (timm's default) or 'mimetic', got {self.weight_init!r}")
        if self.fix_init and self.block_fn != "block":
            raise ValueError("fix_init rescales a Block's attn.proj and mlp.fc2: it needs block_fn='block'")
        if self.weight_init == "mimetic" and (self.block_fn != "block" or self.attn_layer != "attn"):
            raise ValueError("weight_init='mimetic' is for a Block's plain attention (block_fn, attn_layer default)")
        if self.posemb == "rope" and self.attn_layer == "diff":
            raise ValueError("posemb='rope' with attn_layer='diff' is not supported: rotary tables are per full head")
        if self.global_pool not in GLOBAL_POOLS:
            raise ValueError(f"global_pool must be one of {GLOBAL_POOLS}, got {self.global_pool!r}")
        if isinstance(self.num_kv_heads, tuple) and len(self.num_kv_heads) != self.depth:
            raise ValueError(f"num_kv_heads {self.num_kv_heads} needs one count per block (depth {self.depth})")
        if (self.rel_pos_type or self.window_size) and self.patch_drop_rate:
            raise ValueError("relative positions and windows need every patch of the grid: no patch_drop_rate")
        if self.rel_pos_type == "bias" and self.dynamic_img_size:
            raise ValueError("rel_pos_type='bias' is a table of the built grid's offsets: no dynamic_img_size")
        if self.global_pool == "token" and not self.class_token:
            raise ValueError("global_pool='token' needs class_token=True (use global_pool='avg' without it)")
        if self.shifted_patches and (self.stem_channels or self.backbone is not None):
            other = "stem_channels" if self.stem_channels else "backbone (a hybrid)"
            raise ValueError(f"shifted_patches (Shifted Patch Tokenization) replaces the patchify conv, as {other} "
                             "does: give one of them")  # fmt: skip
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


def check_grid(
    img_size: int | tuple[int, int], patch_size: int | tuple[int, int], pad: bool, whole_patches: bool
) -> None:
    """OptionError unless each side of img_size holds a patch (padded to whole patches with `pad`)
    and, with `whole_patches`, is whole patches: a patchify conv drops the pixels past the last
    whole patch (as timm's, and as some of its weights were trained: SigLIP so400m/14 at 384)."""
    sides, patches = ((v, v) if isinstance(v, int) else tuple(v) for v in (img_size, patch_size))
    for side, patch in zip(sides, patches, strict=True):
        whole(patch, 1, "patch_size", "a patch's side in pixels")
        whole(side, 1, "img_size", "the image side in pixels")
        if not pad and (side < patch or (whole_patches and side % patch)):
            near = sorted({patch * max(1, side // patch), patch * -(-side // patch)})
            raise OptionError(
                "img_size", img_size, f"a multiple of the patch size {patch} ({' or '.join(map(str, near))})"
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
                c.norm if c.embed_norm else None, c.norm_eps, c.shifted_patches, c.norm, c.stem_pool,
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
        and norms keep PyTorch's defaults. `weight_init="mimetic"` then re-initialises attention, and
        `fix_init` rescales the blocks' output projections (rescale_block_outputs_)."""
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
        if self.config.fix_init:
            rescale_block_outputs_(self.blocks)

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
        return keep_rope(tables, kept, images.device, self.num_prefix_tokens)

    def _embed(self, images: torch.Tensor) -> tuple[torch.Tensor, Rope]:
        """Images -> [CLS, registers] + patch tokens with their positions, as the blocks take them,
        and the rotary tables of those patches (posemb="rope", else None)."""
        x = self.patch_embed(images)
        grid = self.patch_grid(images)
        if self._grid_blocks() and not self.config.dynamic_img_size and grid != self.patch_embed.grid_size:
            raise ValueError(
                f"input of a {grid[0]}x{grid[1]} patch grid; this model's relative positions and windows are for "
                f"{self.patch_embed.grid_size[0]}x{self.patch_embed.grid_size[1]}: build it with that img_size, or "
                "with dynamic_img_size=True"
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

    def _grid_blocks(self) -> bool:
        """Whether the blocks need the tokens' patch grid: relative positions or windows."""
        return bool(self.config.rel_pos_type or self.config.window_size)

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
        return self.norm(self._run_blocks(*self._embed(x), grid=self.patch_grid(x))[0])

    def _run_blocks(
        self,
        x: torch.Tensor,
        rope: Rope,
        last_num_queries: int | None = None,
        return_attn: bool = False,
        take: Collection[int] = (),
        depth: int | None = None,
        attn_mask: torch.Tensor | None = None,
        grid: tuple[int, int] | None = None,
        last_mean_from: int | None = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
        """The first `depth` blocks (all by default) in order: the output, the attention weights of
        every block if `return_attn`, and the outputs of the blocks numbered in `take`. The last block
        returns only its first `last_num_queries` tokens if given, or with `last_mean_from` the mean of
        its tokens from that one on, (B, D) (Block's `mean_from`). `rope`: one table for every block,
        or a list of one per block (mixed RoPE); `attn_mask`: every block's (a shared bias); `grid`:
        the tokens' patch grid, for blocks with relative positions or windows (None: the built one)."""
        kwargs = {"grid": grid} if grid is not None and self._grid_blocks() else {}  # only such Blocks take it
        attns, taken = [], []
        blocks = self.blocks[:depth] if depth is not None else self.blocks
        for i, block in enumerate(blocks):
            last = i == len(blocks) - 1
            num_queries = last_num_queries if last else None
            table = rope[i] if isinstance(rope, list) else rope
            if last and last_mean_from is not None:
                kwargs["mean_from"] = last_mean_from
            if self.grad_checkpointing and torch.is_grad_enabled():
                out = checkpoint(
                    block, x, attn_mask, rope=table, num_queries=num_queries, return_attn=return_attn,
                    use_reentrant=False, **kwargs,
                )  # fmt: skip
            else:
                out = block(x, attn_mask, rope=table, num_queries=num_queries, return_attn=return_attn, **kwargs)
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
        grid = self.patch_grid(x)
        tokens, _, taken = self._run_blocks(*self._embed(x), take=set(take), depth=depth, grid=grid)
        prefix, out = self._intermediates(taken, norm, output_fmt, grid)
        if return_prefix_tokens:
            out = list(zip(out, prefix, strict=True))
        return out if intermediates_only else (self.norm(tokens), out)

    def _intermediates(
        self, taken: list[torch.Tensor], norm: bool, output_fmt: str, grid: tuple[int, int] | None
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Blocks' outputs as forward_intermediates returns them: their prefix tokens and their patches,
        after the final norm if `norm`; the patches (B, D, H, W) on `grid` with output_fmt "NCHW"."""
        taken = [self.norm(t) for t in taken] if norm else taken
        prefix = [t[:, : self.num_prefix_tokens] for t in taken]
        out = [t[:, self.num_prefix_tokens :] for t in taken]
        if output_fmt == "NCHW":
            h, w = grid
            out = [t.reshape(t.shape[0], h, w, -1).permute(0, 3, 1, 2).contiguous() for t in out]
        return prefix, out

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
        that block's work, which timm spends on outputs it throws away, is skipped. With average
        pooling straight after the blocks (the norm after pooling) the last block's fc2 runs on the
        pooled hidden state only (Block's `mean_from`).
        """
        grid = self.patch_grid(x)
        if self._pools_last_block():
            start = 0 if self.config.pool_include_prefix else self.num_prefix_tokens
            pooled = self._run_blocks(*self._embed(x), grid=grid, last_mean_from=start)[0]
            return self.head(self.head_drop(self.fc_norm(pooled)))
        last_num_queries = 1 + int(self.config.distilled) if self.global_pool == "token" else None
        x = self._run_blocks(*self._embed(x), last_num_queries, grid=grid)[0]
        return self.forward_head(self.norm(x))

    def _pools_last_block(self) -> bool:
        """Whether the head reads the plain mean of the last block's tokens (average pooling, no norm
        between them, no distillation head), which the last block computes cheaper (Block's `mean_from`)."""
        last = self.blocks[-1] if len(self.blocks) else None
        return (
            self.global_pool == "avg" and isinstance(self.norm, nn.Identity) and self.head_dist is None
            and isinstance(last, Block) and last.can_mean()
        )  # fmt: skip

    def forward_with_attn(self, x: torch.Tensor, raw: bool = False) -> tuple[torch.Tensor, list[Any]]:
        """Logits and every block's attention weights, each (B, heads, N, N) with N = prefix + patches.

        Uses the explicit attention path for this call only; the weights stay in the autograd graph
        unless called under `torch.no_grad()`. `raw`: each block's weights as its attention computed
        them (a windowed block's per window, a parallel block's per branch), the tensors its output
        was computed from, whose gradients gradient rollout takes; `grid_attention` places them.
        """
        grid = self.patch_grid(x)
        x, attns, _ = self._run_blocks(*self._embed(x), return_attn=True, grid=grid)
        return self.forward_head(self.norm(x)), attns if raw else self.grid_attention(attns, grid)

    def grid_attention(self, attns: list[Any], grid: tuple[int, int]) -> list[torch.Tensor]:
        """`forward_with_attn(raw=True)`'s weights (or their gradients) -> (B, heads, N, N) each."""
        return [block.grid_attention(a, grid) for block, a in zip(self.blocks, attns, strict=True)]


Table = tuple[torch.Tensor, torch.Tensor]
Rope = Table | list[Table] | None  # the rotary (cos, sin) tables: for every block, one per block, none


def keep_rope(tables: Table, kept: torch.Tensor | None, device: torch.device, num_prefix_tokens: int = 0) -> Table:
    """Rotary tables (..., N, head_dim) on `device`, after patch dropout the rows of each image's kept
    patches: (B, 1 or heads, kept, head_dim), the heads' axis where the attention broadcasts them.

    `num_prefix_tokens` rows of the identity rotation (cos 1, sin 0) go in front, for the prefix tokens,
    which stay as they are: the table then covers every token, and apply_rope rotates q and k whole
    instead of slicing off the prefix and concatenating it back in every block (fwd and bwd)."""
    cos, sin = (t.to(device) for t in tables)
    if kept is not None:

        def gather(t: torch.Tensor) -> torch.Tensor:  # (N, d) -> (B, 1, kept, d); (heads, N, d) -> (B, heads, kept, d)
            return t[kept][:, None] if t.ndim == 2 else t[..., kept, :].movedim(-3, 0)

        cos, sin = gather(cos), gather(sin)
    if num_prefix_tokens:
        pad = (0, 0, num_prefix_tokens, 0)
        cos, sin = F.pad(cos, pad, value=1.0), F.pad(sin, pad, value=0.0)
    return cos, sin


def rescale_block_outputs_(blocks: nn.Sequential) -> None:
    """Divide each block's attn.proj and mlp.fc2 weights by sqrt(2 x its number, from 1): timm's
    fix_init (and EVA's init, after BEiT), so deeper blocks add less to the residual stream at init."""
    with torch.no_grad():
        for i, block in enumerate(blocks):
            for layer in (block.attn.proj, getattr(block.mlp, "fc2", None)):
                if layer is not None:
                    layer.weight.div_(math.sqrt(2.0 * (i + 1)))


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

# The names vit.timm_args registers from the size table, vit_{size}_patch{patch size}_{image size}.
# ImageNet models carry timm's names.
VIT_NAMES = (
    "vit_tiny_patch16_224", "vit_small_patch16_224", "vit_base_patch16_224", "vit_base_patch16_384",
    "vit_large_patch16_224", "vit_huge_patch14_224",
    # CIFAR (32x32) and Tiny-ImageNet (64x64) sized inputs: 8x8 patch grids.
    "vit_tiny_patch4_32", "vit_small_patch4_32", "vit_micro_patch4_32", "vit_tiny_patch8_64", "vit_micro_patch8_64",
    # The offline default: 8x8 digits upsampled to 16x16, a 4x4 grid.
    "vit_nano_patch4_16",
)  # fmt: skip


def _vit_name_fields(name: str) -> tuple[str, int, int]:
    """A VIT_NAMES name as (its VIT_SIZES size, patch size, image size)."""
    size, patch, img = re.fullmatch(r"vit_([a-z]+)_patch(\d+)_(\d+)", name).groups()
    return {"tiny": "Ti", "small": "S", "base": "B", "large": "L", "huge": "H"}.get(size, size), int(patch), int(img)


VIT_MODELS: dict[str, tuple[str, int, int]] = {name: _vit_name_fields(name) for name in VIT_NAMES}


# -- hybrids: one of timm's CNNs as patch embedding ---------------------------------------------------

# The CNNs that timm's hybrid model functions (timm.models.vision_transformer_hybrid) build as patch
# embedding: our name (ViTConfig.backbone["name"]) -> the function or class of that module building it.
HYBRID_BACKBONES = {"resnetv2": "_resnetv2", "resnet26d": "resnet26d", "resnet50d": "resnet50d", "convstem": "ConvStem"}


def build_backbone(spec: dict[str, Any], in_chans: int = 3) -> nn.Module:
    """A hybrid's CNN (ViTConfig.backbone), built by timm's own constructor as timm's hybrid models build
    it. "resnetv2": ResNetV2 without pre-activation, weight-standardised convs with 'same' padding, the
    stages of `layers` (none: the stem only); the R50 of R50+ViT-B/16 is layers [3, 4, 9].
    "resnet26d" / "resnet50d": timm's ResNet-D with features_only; "convstem": MobileCLIP's stem."""
    import timm.models.vision_transformer_hybrid as timm_hybrid

    kwargs = dict(spec)
    return getattr(timm_hybrid, HYBRID_BACKBONES[kwargs.pop("name")])(**kwargs, in_chans=in_chans)
