"""The transformer building blocks shared by every model here (ViT and GPT), one concept a file:

norm.py                make_norm, make_act, LayerNorm2d, QuickGELU
patch.py               PatchEmbed, HybridEmbed, whiten_patch_embed_, PatchDropout
sdpa.py                softmax(q k^T + mask) v fused and written out, the masks both take
attention.py           Attention, CrossAttention, AttentionPoolLatent, KVCache, mimetic_init_
attention_variants.py  what changes the math: relative positions, grouped k/v heads, differential
                       attention, windows
mlp.py                 Mlp, SwiGLU, MoE, make_mlp
drop.py                DropPath, LayerScale
blocks.py              BlockConfig, Block, ResPostBlock, WindowBlock, ParallelScalingBlock,
                       ParallelThingsBlock, make_block, set_fused_attn

Module and parameter names follow timm (`qkv`, `proj`, `fc1`, `fc2`, `norm1`, `ls1`, ...) so that timm
state dicts load into our models without renaming. Import from here: `from vit.layers import Block`.
"""

from vit.layers.attention import (
    QKV_NAMES,
    Attention,
    AttentionPoolLatent,
    AttnArgs,
    CrossAttention,
    KVCache,
    mimetic_init_,
)
from vit.layers.attention_variants import (
    REL_POS_TYPES,
    window_attention_to_grid,
    window_partition,
    window_unpartition,
)
from vit.layers.blocks import (
    BLOCK_FNS,
    BLOCKS,
    Block,
    BlockConfig,
    ParallelScalingBlock,
    ParallelThingsBlock,
    ResPostBlock,
    WindowBlock,
    block_class,
    make_block,
    set_fused_attn,
)
from vit.layers.drop import DropPath, LayerScale
from vit.layers.mlp import MLP_KINDS, Mlp, MoE, SwiGLU, make_mlp, moe_aux_loss, swiglu_hidden_dim
from vit.layers.norm import ACTIVATIONS, LayerNorm2d, QuickGELU, make_act, make_norm
from vit.layers.patch import (
    HybridEmbed,
    PatchDropout,
    PatchEmbed,
    check_divisible,
    whiten_patch_embed_,
)
from vit.layers.sdpa import add_bias, attention_weights, fused_attention, merge_masks

__all__ = [
    "ACTIVATIONS",
    "BLOCKS",
    "BLOCK_FNS",
    "MLP_KINDS",
    "QKV_NAMES",
    "REL_POS_TYPES",
    "Attention",
    "AttentionPoolLatent",
    "AttnArgs",
    "Block",
    "BlockConfig",
    "CrossAttention",
    "DropPath",
    "HybridEmbed",
    "KVCache",
    "LayerNorm2d",
    "LayerScale",
    "Mlp",
    "MoE",
    "ParallelScalingBlock",
    "ParallelThingsBlock",
    "PatchDropout",
    "PatchEmbed",
    "QuickGELU",
    "ResPostBlock",
    "SwiGLU",
    "WindowBlock",
    "add_bias",
    "attention_weights",
    "block_class",
    "check_divisible",
    "fused_attention",
    "make_act",
    "make_block",
    "make_mlp",
    "make_norm",
    "merge_masks",
    "mimetic_init_",
    "moe_aux_loss",
    "set_fused_attn",
    "swiglu_hidden_dim",
    "whiten_patch_embed_",
    "window_attention_to_grid",
    "window_partition",
    "window_unpartition",
]
