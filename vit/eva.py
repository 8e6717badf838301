"""timm's EVA family (`timm.models.eva`): EVA, EVA-02, DINOv3, Perception Encoder, Naver's RoPE-ViT,
timm's SBB RoPE ViTs and Meta's Sapiens2, built on the same VisionTransformer and Block, with timm's
parameter names.

What differs from a ViT is in the Block's options (q and v biases without a key bias, unfused q/k/v,
the attention's and the MLP's inner norms, EVA's SwiGLU layouts, `gamma_1`/`gamma_2` LayerScale or
`gamma_1` alone, grouped-query attention per block, interleaved rotary pairs: vit.layers.BlockConfig)
and here: the rotary tables, computed once per forward and given to every block (timm's
`RotaryEmbeddingCat`, `RotaryEmbeddingDinoV3` with its train-time rescaling, `RotaryEmbeddingMixed`:
vit.position), the attention-pool head over every token, timm's Eva init.
timm's names are read from its model functions at import, as vit.timm_args does for ViTs.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import timm
import torch
from torch import nn

from vit.layers import AttentionPoolLatent
from vit.position import MixedRope, rope_2d, rope_2d_dinov3
from vit.registry import register_timm_names
from vit.timm_args import record_timm_builder, timm_arg_names
from vit.vision_transformer import Rope, VisionTransformer, ViTConfig, keep_rope, rescale_block_outputs_

ROPE_TYPES = ("cat", "dinov3", "mixed")


@dataclass
class EvaConfig(ViTConfig):
    """The ViT's options (ViTConfig, BlockConfig) at timm's Eva defaults, and its rotary embedding.

    fc_norm None is timm's Eva rule: a norm after pooling for "avg" only (a ViT's: also max)."""

    global_pool: str = "avg"
    k_bias: bool = False  # timm's attn_type="eva"; True is attn_type="rope" (a biased key)
    layer_scale: str = "gamma"
    rope_rotate_half: bool = False
    use_rot_pos_emb: bool = False  # rotary q and k in every block, besides posemb ("learn" or "none")
    # "cat": axial, as vit.position.rope_2d (EVA-02, PE, Naver's RoPE-Axial, SBB); "dinov3": the grid
    # normalised to [-1, 1] (DINOv3); "mixed": learned frequencies per block and head (RoPE-Mixed).
    rope_type: str = "cat"
    rope_temperature: float = 10000.0
    rope_grid_offset: float = 0.0
    rope_grid_indexing: str = "ij"  # "xy": the first rotary half turns with the column
    ref_feat_shape: tuple[int, int] | None = None  # "cat": coordinates rescaled to span this grid
    # "dinov3" in train mode: each forward scales the coordinates by one factor drawn log-uniform in
    # [1/R, R] (timm's rope_rescale_coords, DINOv3's and Sapiens2's augmentation); eval: never.
    rope_rescale_coords: float | None = None
    attn_pool_num_heads: int | None = None  # global_pool="map": the head's heads; None: num_heads
    attn_pool_mlp_ratio: float | None = None  # and its MLP ratio; None: mlp_ratio
    head_init_scale: float = 0.001  # the head starts at this fraction of timm's init
    fix_init: bool = True  # timm's Eva init always rescales the blocks' outputs (BEiT's)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.fc_norm is None:
            self.fc_norm = self.global_pool == "avg"
        if self.posemb not in ("learn", "none"):
            raise ValueError(f"an Eva's posemb is 'learn' or 'none' (rotary: use_rot_pos_emb), got {self.posemb!r}")
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_type must be one of {ROPE_TYPES}, got {self.rope_type!r}")
        if self.rope_grid_indexing not in ("ij", "xy"):
            raise ValueError(f"rope_grid_indexing must be 'ij' or 'xy', got {self.rope_grid_indexing!r}")
        if self.use_rot_pos_emb and self.rope_type == "mixed" and self.rope_rotate_half:
            raise ValueError("rope_type='mixed' pairs channels 2j, 2j+1: it needs rope_rotate_half=False")
        if self.use_rot_pos_emb and self.rope_type == "mixed" and self.num_kv_heads is not None:
            raise ValueError("rope_type='mixed' turns every query head its own way: no num_kv_heads")
        if self.rope_rescale_coords is not None and (
            self.rope_type != "dinov3" or not math.isfinite(self.rope_rescale_coords) or self.rope_rescale_coords < 1
        ):
            raise ValueError(f"rope_rescale_coords is a factor >= 1 of rope_type='dinov3', got "
                             f"{self.rope_rescale_coords!r} with {self.rope_type!r}")  # fmt: skip


class Eva(VisionTransformer):
    """timm's `Eva`: a VisionTransformer with rotary tables of timm's kinds and timm's Eva head and
    init. `model.load_state_dict(timm.create_model(name).state_dict())` is strict for its names."""

    def __init__(self, config: EvaConfig) -> None:
        super().__init__(config)
        c = config
        head_dim = c.embed_dim // c.num_heads
        mixed = c.use_rot_pos_emb and c.rope_type == "mixed"
        self.rope = MixedRope(head_dim, c.depth, c.num_heads, c.rope_temperature) if mixed else None
        if c.global_pool == "map":  # timm's Eva head: its own heads and MLP ratio, GELU
            self.attn_pool = AttentionPoolLatent(
                c.embed_dim, c.attn_pool_num_heads or c.num_heads, c.attn_pool_mlp_ratio or c.mlp_ratio,
                norm=c.norm, norm_eps=c.norm_eps,
            )  # fmt: skip
            _init_linears(self.attn_pool)

    def init_weights(self) -> None:
        """timm's Eva init: trunc-normal(0.02) for Linear weights, position embedding and prefix
        tokens; zero biases; each block's output projections divided by sqrt(2 x its number) (BEiT, fix_init);
        the head scaled by head_init_scale; LayerScale at init_values, q and v biases at zero."""
        _init_linears(self)
        for p in (self.pos_embed, self.cls_token, self.reg_token):
            if isinstance(p, nn.Parameter):
                nn.init.trunc_normal_(p, std=0.02)
        if self.config.fix_init:
            rescale_block_outputs_(self.blocks)
        with torch.no_grad():
            if isinstance(self.head, nn.Linear):
                self.head.weight.mul_(self.config.head_init_scale)
                self.head.bias.mul_(self.config.head_init_scale)

    def no_weight_decay(self) -> set[str]:
        return super().no_weight_decay() | {"rope.freqs"}

    def _rope(self, images: torch.Tensor, kept: torch.Tensor | None) -> Rope:
        """The rotary tables of the images' patch grid: one for every block, or one per block (mixed);
        after patch dropout, each image's kept patches' rows."""
        c = self.config
        if not c.use_rot_pos_emb:
            return None
        grid, head_dim = self.patch_grid(images), c.embed_dim // c.num_heads
        if c.rope_type == "mixed":
            cos, sin = self.rope(grid, c.rope_grid_indexing)
            return [keep_rope((cos[i], sin[i]), kept, images.device, self.num_prefix_tokens) for i in range(len(cos))]
        if c.rope_type == "dinov3":
            scale = None
            if self.training and c.rope_rescale_coords is not None:
                # timm's draw, call for call on the CPU generator, so a seeded training step is timm's
                bound = math.log(c.rope_rescale_coords)
                scale = torch.empty(1, dtype=torch.float32).uniform_(-bound, bound).exp()
            tables = rope_2d_dinov3(
                grid, head_dim, c.rope_temperature, c.rope_grid_offset, c.rope_grid_indexing, c.rope_rotate_half, scale
            )  # fmt: skip
        else:
            tables = rope_2d(
                grid, head_dim, c.rope_temperature, c.rope_grid_offset, c.rope_grid_indexing, c.ref_feat_shape,
                c.rope_rotate_half,
            )  # fmt: skip
        return keep_rope(tables, kept, images.device, self.num_prefix_tokens)

    def pool(self, x: torch.Tensor) -> torch.Tensor:
        """As the ViT's, except that the attention-pool head reads the prefix tokens too (timm's Eva)."""
        return self.attn_pool(x) if self.attn_pool is not None else super().pool(x)


def _init_linears(module: nn.Module) -> None:
    for m in module.modules():
        if isinstance(m, nn.Linear):
            nn.init.trunc_normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)


# -- timm's names, read from timm's model functions ------------------------------------------------

# timm's Eva kwargs that are EvaConfig fields under another name.
_RENAMED = {"num_reg_tokens": "reg_tokens", "use_pre_transformer_norm": "pre_norm"}
# timm's Eva kwargs we have no equal for, when set away from timm's default, and why.
_REFUSED = {
    "rope_shift_coords": (None, "train-time RoPE coordinate shift"),
    "rope_jitter_coords": (None, "train-time RoPE per-axis coordinate scaling"),
    "rope_mrope_section": (None, "multimodal RoPE (mrope)"),
}


def timm_eva_args(name: str, **kwargs: object) -> dict:
    """The kwargs timm's `create_model(name, **kwargs)` builds its Eva with (vit.timm_args.record_timm_builder)."""
    import timm.models.eva as timm_eva

    return record_timm_builder(name, timm_eva, "_create_eva", **kwargs)


def from_timm_eva_args(args: dict) -> dict:
    """timm's Eva kwargs as EvaConfig fields; anything without an equal is a ValueError."""
    from timm.layers import LayerNorm, RmsNorm

    fields = {f.name for f in dataclasses.fields(EvaConfig)}
    out: dict = {}
    for key, value in args.items():
        func, keywords = getattr(value, "func", value), getattr(value, "keywords", {})
        if key in _REFUSED:
            default, what = _REFUSED[key]
            if value != default:
                raise ValueError(f"timm's {key} ({what}) has no equivalent here")
        elif key == "norm_layer" and func in (LayerNorm, RmsNorm, nn.LayerNorm, nn.RMSNorm):
            out["norm"] = "layernorm" if func in (LayerNorm, nn.LayerNorm) else "rmsnorm"
            out["norm_eps"] = keywords.get("eps", 1e-5 if func is nn.LayerNorm else 1e-6)
        elif key == "use_post_norm":
            out["post_norm"] = value  # timm's EvaBlockPostNorm: ResPostBlock's computation, EVA's attention
        elif key == "attn_type" and value in ("eva", "rope"):
            out["k_bias"] = value == "rope"
        elif key == "use_abs_pos_emb":
            out["posemb"] = "learn" if value else "none"
        elif key == "ref_feat_shape":
            out[key] = (value, value) if isinstance(value, int) else tuple(value)
        elif key in _RENAMED:
            out[_RENAMED[key]] = value
        elif key in ("swiglu_mlp", "use_fc_norm", "use_post_transformer_norm", "swiglu_align_to", "scale_mlp"):
            out[key] = value  # resolved below, together
        elif key in fields and key not in ("norm", "posemb", "k_bias", "fc_norm", "final_norm", "mlp"):
            out[key] = value
        else:
            raise ValueError(f"timm's Eva {key}={getattr(func, '__name__', value)!r} has no equivalent here")
    # timm's SwiGLU: split gate and value when it has an inner norm or an aligned width, else packed.
    if out.pop("swiglu_mlp", False):
        out["mlp"] = "swiglu_split" if out.get("scale_mlp") or out.get("swiglu_align_to") else "swiglu_packed"
    # timm's norms after the blocks: fc_norm (after pooling) by default for avg pooling, the final
    # norm by default where fc_norm is off; ours is one or the other, or neither (final_norm=False).
    fc, post = out.pop("use_fc_norm", None), out.pop("use_post_transformer_norm", None)
    fc_on = fc if fc is not None else out.get("global_pool", "avg") == "avg"
    post_on = post if post is not None else not fc_on
    if fc_on and post_on:
        raise ValueError("timm's use_fc_norm with use_post_transformer_norm: a norm before and after pooling")
    out.update(fc_norm=fc, final_norm=fc_on or post_on)
    if out.get("post_norm"):
        out.pop("init_values", None)  # timm's EvaBlockPostNorm ignores it
    return out


register_timm_names(
    "EVA", [("*", "eva")], Eva, EvaConfig, lambda name, **kw: from_timm_eva_args(timm_eva_args(name, **kw)),
    timm_arg_names(timm.models.eva.Eva),
)  # fmt: skip
