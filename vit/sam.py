"""timm's SAM image encoders (`timm.models.vision_transformer_sam`, Segment Anything's ViT-B/L/H) on the
same VisionTransformer and Block, with timm's parameter names.

What differs from a ViT: most blocks attend within 14 x 14 windows of the patch grid, a few globally
(`window_size`, `global_attn_indexes`); every block adds SAM's decomposed relative positions to its
scores (`rel_pos_type="decomposed"`: `attn.rel_pos_h`, `attn.rel_pos_w`); positions are stored on the
grid (`pos_embed` (1, H, W, D)); no CLS token; and the output is a feature map: a neck of convs and
LayerNorm2d after the blocks (`neck`), then timm's pooled classifier head (`head.fc`).
timm's names are read from its model functions at import, as vit.timm_args does for ViTs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, replace

import timm
import torch
from timm.layers import resample_abs_pos_embed
from torch import nn

from vit.layers import LayerNorm2d
from vit.timm_args import no_equivalent, timm_family
from vit.vision_transformer import VisionTransformer, ViTConfig, _take_indices

SAM_POOLS = ("avg", "max", "avgmax", "")


@dataclass
class SamConfig(ViTConfig):
    """The ViT's options at timm's VisionTransformerSAM defaults (1024 px, no CLS token, PyTorch's
    LayerNorm eps, 14 x 14 windows, no norm after the blocks), and the neck: `neck_chans` channels
    (None or 0: a LayerNorm2d of the blocks' width only)."""

    img_size: int | tuple[int, int] = 1024
    num_classes: int = 768
    global_pool: str = "avg"
    class_token: bool = False
    norm_eps: float = 1e-5
    window_size: int = 14
    final_norm: bool = False
    fc_norm: bool | None = False
    neck_chans: int | None = 256

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.global_pool not in SAM_POOLS:
            raise ValueError(f"a SAM encoder's global_pool is one of {SAM_POOLS}, got {self.global_pool!r}")
        if self.class_token or self.reg_tokens or self.distilled:
            raise ValueError("a SAM encoder has no prefix tokens (class_token, reg_tokens, distilled)")
        if self.posemb not in ("learn", "none"):
            raise ValueError(f"a SAM encoder's posemb is 'learn' or 'none', got {self.posemb!r}")
        if self.final_norm or self.fc_norm:
            raise ValueError("a SAM encoder's norm after the blocks is its neck: final_norm and fc_norm are off")


class ClassifierHead(nn.Module):
    """Pool a (B, C, H, W) map over H and W ("avg", "max", "avgmax"; "": none), dropout, then `fc`
    (timm's ClassifierHead, its names)."""

    def __init__(self, dim: int, num_classes: int, global_pool: str = "avg", drop: float = 0.0) -> None:
        super().__init__()
        self.global_pool = global_pool
        self.drop = nn.Dropout(drop)
        self.fc = nn.Linear(dim, num_classes) if num_classes > 0 else nn.Identity()

    def forward(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        if self.global_pool == "avg":
            x = x.mean(dim=(2, 3))
        elif self.global_pool == "max":
            x = x.amax(dim=(2, 3))
        elif self.global_pool == "avgmax":
            x = 0.5 * (x.mean(dim=(2, 3)) + x.amax(dim=(2, 3)))
        x = self.drop(x)
        return x if pre_logits else self.fc(x)


class Sam(VisionTransformer):
    """timm's `VisionTransformerSAM`: forward_features gives the neck's (B, neck_chans, H, W) map,
    forward the pooled head's output (pooled features with num_classes=0, the SAM checkpoints' own).
    `model.load_state_dict(timm.create_model(name).state_dict())` is strict for its names.
    `forward_with_attn` places windowed blocks' weights on the patch grid (zero between windows);
    with `raw=True` it gives them per window, as the blocks computed them."""

    def __init__(self, config: SamConfig) -> None:
        super().__init__(replace(config, num_classes=0))
        self.config = c = config
        self.num_classes = c.num_classes
        grid = self.patch_embed.grid_size
        if c.posemb == "learn":  # on the grid, timm's layout; zeros as timm's
            self.pos_embed = nn.Parameter(torch.zeros(1, *grid, c.embed_dim))
        if c.neck_chans:
            self.neck = nn.Sequential(
                nn.Conv2d(c.embed_dim, c.neck_chans, kernel_size=1, bias=False), LayerNorm2d(c.neck_chans),
                nn.Conv2d(c.neck_chans, c.neck_chans, kernel_size=3, padding=1, bias=False), LayerNorm2d(c.neck_chans),
            )  # fmt: skip
        else:
            self.neck = LayerNorm2d(c.embed_dim)
        self.num_features = c.neck_chans or c.embed_dim
        self.head = ClassifierHead(self.num_features, c.num_classes, c.global_pool, c.drop_rate)

    def init_weights(self) -> None:
        """timm's SAM: PyTorch's default init of every layer, zero positions and relative positions."""

    def no_weight_decay(self) -> set[str]:
        return {"pos_embed"}

    def _pos_embed(self, grid: tuple[int, int], device: torch.device) -> torch.Tensor:
        """The positions of the grid: as stored on the built one, else resampled (bicubic, antialiased:
        timm's SAM resamples them in every forward; VisionTransformer._embed allows other grids with
        dynamic_img_size only)."""
        table = self.pos_embed.flatten(1, 2)
        if grid == self.patch_embed.grid_size:
            return table
        return resample_abs_pos_embed(table, list(grid), list(self.patch_embed.grid_size), num_prefix_tokens=0)

    def _to_map(self, tokens: torch.Tensor, images: torch.Tensor) -> torch.Tensor:
        """Tokens (B, H*W, D) -> (B, D, H, W)."""
        h, w = self.patch_grid(images)
        return tokens.transpose(1, 2).reshape(tokens.shape[0], -1, h, w)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Images (B, C, H, W) -> the neck's feature map (B, neck_chans, H/p, W/p)."""
        return self.neck(self._to_map(self._run_blocks(*self._embed(x), grid=self.patch_grid(x))[0], x))

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        return self.head(x, pre_logits=pre_logits)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))

    def forward_with_attn(self, x: torch.Tensor, raw: bool = False) -> tuple[torch.Tensor, list[torch.Tensor]]:
        grid = self.patch_grid(x)
        tokens, attns, _ = self._run_blocks(*self._embed(x), return_attn=True, grid=grid)
        logits = self.forward_head(self.neck(self._to_map(tokens, x)))
        return logits, attns if raw else self.grid_attention(attns, grid)

    def forward_intermediates(
        self,
        x: torch.Tensor,
        indices: int | list[int] | None = None,
        norm: bool = False,
        stop_early: bool = False,
        output_fmt: str = "NCHW",
        intermediates_only: bool = False,
    ) -> list | tuple[torch.Tensor, list]:
        """timm's SAM feature API: the chosen blocks' outputs as (B, D, H, W) maps (through the neck if
        `norm`); and the neck's map of the last block run."""
        if output_fmt != "NCHW":
            raise ValueError(f"a SAM encoder's intermediates are NCHW, got output_fmt={output_fmt!r}")
        take = _take_indices(len(self.blocks), indices)
        depth = max(take) + 1 if stop_early else None
        tokens, _, taken = self._run_blocks(*self._embed(x), take=set(take), depth=depth, grid=self.patch_grid(x))
        out = [self._to_map(t, x) for t in taken]
        out = [self.neck(t) for t in out] if norm else out
        return out if intermediates_only else (self.neck(self._to_map(tokens, x)), out)

    def prune_intermediate_layers(
        self, indices: int | list[int] = 1, prune_norm: bool = False, prune_head: bool = True
    ) -> list[int]:
        """As timm's: drop the blocks after the last one taken; the neck with `prune_norm` (then the head
        too, sized for the neck's channels), the head with `prune_head`."""
        take = _take_indices(len(self.blocks), indices)
        self.blocks = self.blocks[: max(take) + 1]
        if prune_norm:
            self.neck = nn.Identity()
            prune_head = prune_head or self.num_features != self.embed_dim
            self.num_features = self.embed_dim
        if prune_head:
            self.reset_classifier(0, "")
        return take

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        """A new, PyTorch-initialised head for `num_classes` (0: pooled features), optionally another pooling."""
        if global_pool is not None and global_pool not in SAM_POOLS:
            raise ValueError(f"global_pool must be one of {SAM_POOLS}, got {global_pool!r}")
        self.global_pool = self.global_pool if global_pool is None else global_pool
        self.num_classes = num_classes
        self.config = replace(self.config, num_classes=num_classes, global_pool=self.global_pool)
        device = next(self.parameters()).device
        self.head = ClassifierHead(self.num_features, num_classes, self.global_pool, self.config.drop_rate).to(device)


# -- timm's names, read from timm's model functions ------------------------------------------------


# timm's VisionTransformerSAM kwargs we have no equal for, when set away from timm's default: what they
# are, and what to use instead.
_REFUSED = {
    "use_rope": (
        False,
        "rotary positions in every block",
        "SAM's relative positions are use_rel_pos; rotary ViTs are the EVA family's (eva02_*, use_rot_pos_emb)",
    ),
    "head_hidden_size": (None, "timm's NormMlpClassifierHead", "the head is one Linear over the pooled neck features"),
    "ref_feat_shape": (None, "the grid use_rope's positions are scaled to", "use_rope has none either"),
}


@timm_family(
    "SAM", timm.models.vision_transformer_sam, "_create_vision_transformer", Sam, SamConfig,
    timm.models.vision_transformer_sam.VisionTransformerSAM,
)  # fmt: skip
def from_timm_sam_args(args: dict) -> dict:
    """timm's VisionTransformerSAM kwargs as SamConfig fields; anything without an equal is a ValueError."""
    fields = {f.name for f in dataclasses.fields(SamConfig)}
    theirs = {  # timm's kwargs of the same name that mean the same
        "img_size", "patch_size", "in_chans", "num_classes", "embed_dim", "depth", "num_heads", "mlp_ratio",
        "qkv_bias", "qk_norm", "init_values", "pre_norm", "drop_rate", "pos_drop_rate", "patch_drop_rate",
        "proj_drop_rate", "attn_drop_rate", "drop_path_rate", "window_size", "neck_chans", "global_pool",
    }  # fmt: skip
    out: dict = {}
    for key, value in args.items():
        if key in _REFUSED:
            default, what, instead = _REFUSED[key]
            if value != default:
                raise ValueError(
                    f"timm's VisionTransformerSAM {key}={value!r} ({what}) has no equivalent here: {instead}"
                )
        elif key == "use_rel_pos":
            out["rel_pos_type"] = "decomposed" if value else ""
        elif key == "use_abs_pos":
            out["posemb"] = "learn" if value else "none"
        elif key == "global_attn_indexes":
            out[key] = tuple(value)
        elif key == "weight_init" and value == "":
            pass
        elif key in theirs and key in fields:
            out[key] = value
        else:
            raise no_equivalent("VisionTransformerSAM", key, value)
    return out
