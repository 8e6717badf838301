"""Vision Transformer (Dosovitskiy et al. 2021) with timm's parameter names.

Patch embedding -> [CLS] + learned position embedding -> L pre-norm Blocks -> norm -> pool -> head.
`our_model.load_state_dict(timm_model.state_dict())` works for the matching configuration and gives
the same logits; the tests hold us to that.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from vit.layers import Block, PatchDropout, PatchEmbed, _pair, make_norm, moe_aux_loss
from vit.position import rope_2d, sincos_2d
from vit.registry import register_model


@dataclass
class ViTConfig:
    img_size: int | tuple[int, int] = 224
    patch_size: int | tuple[int, int] = 16
    in_chans: int = 3
    num_classes: int = 1000  # 0: no head, forward returns pooled features
    global_pool: str = "token"  # "token": the CLS token; "avg": mean of the patch tokens
    embed_dim: int = 768
    depth: int = 12
    num_heads: int = 12
    mlp_ratio: float = 4.0
    qkv_bias: bool = True
    class_token: bool = True
    # Norm after pooling instead of before (timm/MAE convention for avg pooling); None: avg -> True.
    fc_norm: bool | None = None
    init_values: float | None = None  # LayerScale init; None: no LayerScale
    drop_rate: float = 0.0  # dropout before the head
    pos_drop_rate: float = 0.0
    proj_drop_rate: float = 0.0
    attn_drop_rate: float = 0.0
    drop_path_rate: float = 0.0  # stochastic depth, rising linearly from 0 to this over the blocks
    # Resample the position embedding on the fly when the input grid differs from img_size's.
    dynamic_img_size: bool = False
    norm: str = "layernorm"  # or "rmsnorm"
    mlp: str = "gelu"  # or "swiglu" (hidden 2/3 x mlp_ratio x width: the same parameter count)
    # "learn" (timm), "sincos2d" (fixed, big_vision; CLS gets no position) or "rope" (2-D axial
    # rotary embedding of q and k in every block; CLS unrotated; no pos_embed parameter).
    posemb: str = "learn"
    qk_norm: bool = False  # normalise q and k per head (ViT-22B)
    num_experts: int = 1  # > 1: mixture-of-experts MLP in every block (see vit.layers.MoE)
    experts_top_k: int = 2
    expert_capacity: float | None = None  # capacity factor; None: dropless
    # Fraction of patch tokens dropped at random per image while training (not with rope).
    patch_drop_rate: float = 0.0
    # Channels of a convolutional stem (vit.layers.PatchEmbed) replacing the patchify conv: a hybrid.
    stem_channels: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.posemb not in ("learn", "sincos2d", "rope"):
            raise ValueError(f"posemb must be 'learn', 'sincos2d' or 'rope', got {self.posemb!r}")
        if self.global_pool not in ("token", "avg"):
            raise ValueError(f"global_pool must be 'token' or 'avg', got {self.global_pool!r}")
        if self.global_pool == "token" and not self.class_token:
            raise ValueError("global_pool='token' needs class_token=True (use global_pool='avg' without it)")
        if self.patch_drop_rate and self.posemb == "rope":
            raise ValueError("patch_drop_rate needs additive position embeddings (posemb 'learn' or 'sincos2d')")
        if self.embed_dim % self.num_heads:
            raise ValueError(f"embed_dim {self.embed_dim} is not divisible by num_heads {self.num_heads}")


class VisionTransformer(nn.Module):
    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        self.config = c = config
        self.num_classes = c.num_classes
        self.global_pool = c.global_pool
        self.embed_dim = self.num_features = c.embed_dim
        self.num_prefix_tokens = 1 if c.class_token else 0
        self.grad_checkpointing = False

        self.patch_embed = PatchEmbed(c.img_size, c.patch_size, c.in_chans, c.embed_dim, c.stem_channels)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, c.embed_dim)) if c.class_token else None
        # As in timm and the original ViT, the position embedding has an entry for the CLS token too.
        num_pos = self.patch_embed.num_patches + self.num_prefix_tokens
        if c.posemb == "learn":
            self.pos_embed = nn.Parameter(torch.zeros(1, num_pos, c.embed_dim))
        elif c.posemb == "sincos2d":  # fixed: a buffer, recomputed rather than stored in checkpoints
            self.register_buffer("pos_embed", self._sincos_pos_embed(self.patch_embed.grid_size), persistent=False)
        else:  # rope: positions enter in every attention layer
            self.pos_embed = None
        self.pos_drop = nn.Dropout(c.pos_drop_rate)
        self.patch_drop = PatchDropout(c.patch_drop_rate, self.num_prefix_tokens)

        dpr = [c.drop_path_rate * i / max(c.depth - 1, 1) for i in range(c.depth)]
        self.blocks = nn.Sequential(
            *[
                Block(
                    c.embed_dim,
                    c.num_heads,
                    c.mlp_ratio,
                    qkv_bias=c.qkv_bias,
                    proj_drop=c.proj_drop_rate,
                    attn_drop=c.attn_drop_rate,
                    drop_path=dpr[i],
                    init_values=c.init_values,
                    norm=c.norm,
                    mlp=c.mlp,
                    qk_norm=c.qk_norm,
                    num_experts=c.num_experts,
                    experts_top_k=c.experts_top_k,
                    expert_capacity=c.expert_capacity,
                )
                for i in range(c.depth)
            ]
        )
        use_fc_norm = c.global_pool == "avg" if c.fc_norm is None else c.fc_norm
        self.norm = nn.Identity() if use_fc_norm else make_norm(c.norm, c.embed_dim)
        self.fc_norm = make_norm(c.norm, c.embed_dim) if use_fc_norm else nn.Identity()
        self.head_drop = nn.Dropout(c.drop_rate)
        self.head = nn.Linear(c.embed_dim, c.num_classes) if c.num_classes > 0 else nn.Identity()
        self.init_weights()

    def init_weights(self) -> None:
        """timm's default: trunc-normal(0.02) for pos-embed and Linear weights, zero biases,
        CLS token normal(1e-6); conv and norms keep PyTorch's defaults."""
        if isinstance(self.pos_embed, nn.Parameter):
            nn.init.trunc_normal_(self.pos_embed, std=0.02)
        if self.cls_token is not None:
            nn.init.normal_(self.cls_token, std=1e-6)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)

    def no_weight_decay(self) -> set[str]:
        """Parameter names (besides norms and biases) that weight decay should skip."""
        return {"pos_embed", "cls_token"}

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Recompute each block's activations in the backward pass: less memory, ~30% more compute."""
        self.grad_checkpointing = enable

    def aux_loss(self) -> torch.Tensor:
        """The MoE load-balancing loss of the last forward (summed over blocks); 0 without MoE."""
        return moe_aux_loss(self)

    def _sincos_pos_embed(self, grid: tuple[int, int]) -> torch.Tensor:
        """big_vision's 2-D sin-cos table for the patches, zeros for the prefix tokens: (1, N, D)."""
        table = sincos_2d(grid[0], grid[1], self.embed_dim)
        return F.pad(table, (0, 0, self.num_prefix_tokens, 0))[None]

    def _grid(self, x: torch.Tensor) -> tuple[int, int]:
        return (x.shape[-2] // self.patch_embed.patch_size[0], x.shape[-1] // self.patch_embed.patch_size[1])

    def _rope(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """posemb="rope": the (cos, sin) tables of the images' patch grid, shared by every block."""
        if self.config.posemb != "rope":
            return None
        cos, sin = rope_2d(self._grid(images), self.embed_dim // self.config.num_heads)
        return cos.to(images.device), sin.to(images.device)

    def _embed(self, x: torch.Tensor) -> torch.Tensor:
        grid = self._grid(x)
        x = self.patch_embed(x)
        pos_embed = self.pos_embed
        if pos_embed is None:  # rope: positions enter in the attention
            if self.cls_token is not None:
                x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
            return self.pos_drop(x)
        if grid != self.patch_embed.grid_size and self.config.posemb == "sincos2d":
            pos_embed = self._sincos_pos_embed(grid).to(x.device)  # a closed form: no resampling needed
        elif grid != self.patch_embed.grid_size:
            if not self.config.dynamic_img_size:
                raise ValueError(
                    f"input of {x.shape[1]} patches ({grid[0]}x{grid[1]}) does not match the position "
                    f"embedding's {self.patch_embed.grid_size[0]}x{self.patch_embed.grid_size[1]} grid "
                    f"(img_size={self.config.img_size}); build the model with the new img_size "
                    "(vit.checkpoint resamples the position embedding on load) or set dynamic_img_size=True"
                )
            pos_embed = resample_pos_embed(pos_embed, grid, self.patch_embed.grid_size, self.num_prefix_tokens)
        if self.cls_token is not None:
            x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        return self.patch_drop(self.pos_drop(x + pos_embed))

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Images (B, C, H, W) -> normed tokens (B, prefix + patches, D)."""
        return self.norm(self._run_blocks(self._embed(x), rope=self._rope(x)))

    def _run_blocks(
        self,
        x: torch.Tensor,
        last_num_queries: int | None = None,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The blocks in order; the last one returns only its first `last_num_queries` tokens if given."""
        for i, block in enumerate(self.blocks):
            num_queries = last_num_queries if i == len(self.blocks) - 1 else None
            if self.grad_checkpointing and torch.is_grad_enabled():
                x = checkpoint(block, x, num_queries=num_queries, rope=rope, use_reentrant=False)
            else:
                x = block(x, num_queries=num_queries, rope=rope)
        return x

    def pool(self, x: torch.Tensor) -> torch.Tensor:
        if self.global_pool == "token":
            return x[:, 0]
        return x[:, self.num_prefix_tokens :].mean(dim=1)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        x = self.head_drop(self.fc_norm(self.pool(x)))
        return x if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits, equal to `forward_head(forward_features(x))`.

        With CLS pooling the head reads one token, so the last block computes attention, projection
        and MLP for the CLS token only (its keys and values still come from every token): about 3/4 of
        that block's work, which timm spends on outputs it throws away, is skipped.
        """
        if self.global_pool == "token":
            return self.forward_head(self.norm(self._run_blocks(self._embed(x), 1, rope=self._rope(x))))
        return self.forward_head(self.forward_features(x))

    def forward_with_attn(self, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Logits and every block's attention weights, each (B, heads, N, N) with N = prefix + patches.

        Uses the explicit attention path for this call only; the weights stay in the autograd graph
        (for gradient-weighted rollout) unless called under `torch.no_grad()`.
        """
        rope = self._rope(x)
        x = self._embed(x)
        attns = []
        for block in self.blocks:
            x, attn = block(x, return_attn=True, rope=rope)
            attns.append(attn)
        return self.forward_head(self.norm(x)), attns


def resample_pos_embed(
    posemb: torch.Tensor,
    new_grid: tuple[int, int] | list[int],
    old_grid: tuple[int, int] | list[int] | None = None,
    num_prefix_tokens: int = 1,
    interpolation: str = "bicubic",
    antialias: bool = True,
) -> torch.Tensor:
    """Resample a (1, prefix + H*W, D) position embedding to a new patch grid.

    The patch part is interpolated as an image (bicubic with antialiasing, like timm's
    `resample_abs_pos_embed`); prefix tokens (CLS) are kept as they are. Identity at the same grid.
    """
    new_grid = _pair(tuple(new_grid) if not isinstance(new_grid, int) else new_grid)
    num_patches = posemb.shape[1] - num_prefix_tokens
    if old_grid is None:
        side = math.isqrt(num_patches)
        if side * side != num_patches:
            raise ValueError(f"position embedding has {num_patches} patch entries, not a square grid; pass old_grid")
        old_grid = (side, side)
    old_grid = _pair(tuple(old_grid) if not isinstance(old_grid, int) else old_grid)
    if old_grid[0] * old_grid[1] != num_patches:
        raise ValueError(
            f"position embedding of shape {tuple(posemb.shape)} has {num_patches} patch entries, "
            f"not {old_grid[0]}x{old_grid[1]} (+{num_prefix_tokens} prefix)"
        )
    if new_grid == old_grid:
        return posemb
    prefix, grid = posemb[:, :num_prefix_tokens], posemb[:, num_prefix_tokens:]
    dim = posemb.shape[-1]
    grid = grid.float().reshape(1, old_grid[0], old_grid[1], dim).permute(0, 3, 1, 2)
    grid = F.interpolate(grid, size=new_grid, mode=interpolation, antialias=antialias, align_corners=False)
    grid = grid.permute(0, 2, 3, 1).reshape(1, new_grid[0] * new_grid[1], dim).to(posemb.dtype)
    return torch.cat([prefix, grid], dim=1)


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
