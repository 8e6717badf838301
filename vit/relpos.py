"""timm's relative-position ViTs (`timm.models.vision_transformer_relpos`) on the same VisionTransformer
and Block, with timm's parameter names.

No absolute positions: every block adds a learned bias per pair of patches, from their offset on the
grid, to its attention scores (`blocks.N.attn.rel_pos`: vit.position.RelPosMlp, or RelPosBias), or one
module computes it once per forward for every block (`shared_rel_pos`, the `vit_srelpos_*` names). The
bias reaches the attention as an additive mask, so the fused (SDPA) path stays on. The `_rpn` names
have post-norm blocks (timm's ResPostRelPosBlock: BlockConfig.post_norm). timm's names are read from its
model functions at import, as vit.timm_args does for ViTs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, replace

import timm
import torch
from torch import nn

from vit.position import RelPosBias, RelPosMlp
from vit.timm_args import no_equivalent, timm_family, timm_norm
from vit.vision_transformer import Rope, VisionTransformer, ViTConfig


@dataclass
class RelPosConfig(ViTConfig):
    """The ViT's options at timm's VisionTransformerRelPos defaults (no CLS token, no absolute
    positions, avg pooling after the final norm, LayerScale at 1e-6, the MLP relative positions), and
    `shared_rel_pos`: one relative-position module for every block."""

    global_pool: str = "avg"
    class_token: bool = False
    fc_norm: bool | None = False
    posemb: str = "none"
    init_values: float | None = 1e-6
    rel_pos_type: str = "mlp"
    shared_rel_pos: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.shared_rel_pos and not self.rel_pos_type:
            raise ValueError("shared_rel_pos needs a rel_pos_type: 'bias', 'mlp' or 'mlp_swin'")


class VisionTransformerRelPos(VisionTransformer):
    """timm's `VisionTransformerRelPos`: a VisionTransformer whose blocks add relative positions to
    their scores. `model.load_state_dict(timm.create_model(name).state_dict())` is strict for its names."""

    def __init__(self, config: RelPosConfig) -> None:
        # Shared: the blocks have no relative positions of their own; the model's bias reaches them all.
        super().__init__(replace(config, rel_pos_type="", shared_rel_pos=False) if config.shared_rel_pos else config)
        self.config = c = config
        self.shared_rel_pos = None
        if c.shared_rel_pos:
            grid, prefix = self.patch_embed.grid_size, self.num_prefix_tokens
            if c.rel_pos_type == "bias":
                self.shared_rel_pos = RelPosBias(grid, c.num_heads, prefix)
            else:
                mode = "swin" if c.rel_pos_type == "mlp_swin" else "cr"
                self.shared_rel_pos = RelPosMlp(grid, c.num_heads, c.rel_pos_dim, prefix, mode)
            for m in self.shared_rel_pos.modules():  # timm's init of every Linear, as the blocks'
                if isinstance(m, nn.Linear):
                    nn.init.trunc_normal_(m.weight, std=0.02)
                    if m.bias is not None:
                        nn.init.zeros_(m.bias)

    def _run_blocks(self, x: torch.Tensor, rope: Rope, *args, **kwargs) -> tuple:
        """VisionTransformer._run_blocks, every block given the shared bias (computed once, for the
        tokens' `grid`) as its mask."""
        if self.shared_rel_pos is not None:
            kwargs["attn_mask"] = self.shared_rel_pos.get_bias(kwargs.get("grid")).to(x.dtype)
        return super()._run_blocks(x, rope, *args, **kwargs)


# -- timm's names, read from timm's model functions ------------------------------------------------


@timm_family(
    "relative-position ViT", timm.models.vision_transformer_relpos, "_create_vision_transformer_relpos",
    VisionTransformerRelPos, RelPosConfig, timm.models.vision_transformer_relpos.VisionTransformerRelPos,
)  # fmt: skip
def from_timm_relpos_args(args: dict) -> dict:
    """timm's VisionTransformerRelPos kwargs as RelPosConfig fields; anything without an equal is a ValueError."""
    import timm.models.vision_transformer_relpos as timm_relpos

    blocks = {timm_relpos.RelPosBlock: {}, timm_relpos.ResPostRelPosBlock: {"post_norm": True}}
    fields = {f.name for f in dataclasses.fields(RelPosConfig)}
    theirs = {  # timm's kwargs of the same name that mean the same
        "img_size", "patch_size", "in_chans", "num_classes", "global_pool", "embed_dim", "depth", "num_heads",
        "mlp_ratio", "qkv_bias", "qk_norm", "init_values", "class_token", "fc_norm", "shared_rel_pos", "drop_rate",
        "proj_drop_rate", "attn_drop_rate", "drop_path_rate", "fix_init",
    }  # fmt: skip
    out: dict = {}
    for key, value in args.items():
        if key == "block_fn" and value in blocks:
            out.update(blocks[value])
        elif key == "rel_pos_type" and isinstance(value, str):
            out[key] = ("mlp_swin" if "swin" in value else "mlp") if value.startswith("mlp") else "bias"
        elif key == "rel_pos_dim":
            if value:
                out[key] = value
        elif key == "norm_layer" and (value is None or timm_norm(value)):
            if value is not None:
                out["norm"], out["norm_eps"] = timm_norm(value)
        elif key == "act_layer" and value in (None, nn.GELU, "gelu"):
            pass
        elif key == "weight_init" and value in ("", "reset", "skip"):
            pass  # timm's default init, ours
        elif key in theirs and key in fields:
            out[key] = value
        else:
            raise no_equivalent("VisionTransformerRelPos", key, value)
    return out
