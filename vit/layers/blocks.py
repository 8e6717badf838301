"""The transformer blocks, built from one BlockConfig: the pre-norm Block every model shares and
timm's parallel blocks; `make_block` picks the class the config names."""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Unpack

import torch
from torch import nn

from vit.layers.attention import Attention, AttnArgs, _AttentionBase
from vit.layers.attention_variants import REL_POS_TYPES, window_attention_to_grid, window_partition, window_unpartition
from vit.layers.drop import DropPath, LayerScale
from vit.layers.mlp import MLP_KINDS, Mlp, make_mlp
from vit.layers.norm import make_act, make_norm
from vit.options import number, require, whole


@dataclass
class BlockConfig:
    """The options of the one transformer Block, listed once. ViTConfig and GPTConfig inherit them,
    so a model's kwargs stay flat with timm's names (`create_model(name, embed_dim=..., qk_norm=True)`)
    and the model hands its own config to every Block.

    Defaults are the ViT paper's / timm's block: norm "layernorm" | "rmsnorm" (eps norm_eps); mlp
    "gelu" | "swiglu" (hidden 2/3 x mlp_ratio x width: the same parameter count) | "glu" (timm's
    packed layout) | "swiglu_packed" | "swiglu_split" (timm's EVA layouts; see make_mlp), with
    act_layer "gelu" | "gelu_tanh" | "quick_gelu" | "silu" | "relu_squared"; num_experts > 1 for a mixture-of-experts
    MLP (experts_top_k experts per token, expert_capacity a capacity factor or None for dropless);
    qk_norm; init_values for LayerScale (None: none). The fields after expert_capacity are timm's
    EVA block options, under timm's names; after proj_bias, timm's other ViT blocks (`make_block`).
    """

    embed_dim: int = 768
    num_heads: int = 12
    mlp_ratio: float = 4.0
    qkv_bias: bool = True
    qk_norm: bool = False  # normalise q and k per head (ViT-22B)
    init_values: float | None = None  # LayerScale init; None: no LayerScale
    proj_drop_rate: float = 0.0  # dropout on the attention projection and in the MLP
    attn_drop_rate: float = 0.0  # dropout on the attention weights
    norm: str = "layernorm"
    norm_eps: float = 1e-6
    mlp: str = "gelu"
    act_layer: str | None = None  # the MLP's activation (timm's name); None: the mlp kind's own
    num_experts: int = 1  # > 1: mixture-of-experts MLP in every block (see MoE)
    experts_top_k: int = 2
    expert_capacity: float | None = None  # capacity factor; None: dropless
    qkv_fused: bool = True  # False: separate q_proj, k_proj, v_proj (EVA-02 B/L)
    k_bias: bool = True  # False: no key bias, q_bias and v_bias beside a fused qkv (BEiT, EVA)
    scale_attn_inner: bool = False  # a norm on the heads' output before attn.proj (`attn.norm`, EVA-CLIP)
    scale_mlp: bool = False  # a norm on the MLP's hidden layer before fc2 (`mlp.norm`, EVA-02 B/L)
    swiglu_align_to: int = 0  # mlp "swiglu_split": hidden width rounded up to a multiple of this
    layer_scale: str = "ls"  # LayerScale as "ls" modules (ls1.gamma: timm's ViT) or "gamma" (gamma_1: EVA)
    attn_only_layer_scale: bool = False  # LayerScale on the attention branch only (timm's name; Sapiens2)
    # Grouped-query attention (timm's name; needs qkv_fused=False): this many key/value heads, or one
    # count per block (a ViT's; Sapiens2 keeps full heads in its first and last blocks); None: num_heads.
    num_kv_heads: int | tuple[int, ...] | None = None
    rope_rotate_half: bool = True  # rotary pairs j, j + head_dim/2; False: 2j, 2j + 1 (EVA, timm's default)
    proj_bias: bool = True  # False: no bias in attn.proj nor in the MLP's linears (timm's name; AIMv2)
    post_norm: bool = False  # x = x + norm1(attn(x)), x = x + norm2(mlp(x)); init_values: the norms' init
    # "diff": differential attention (timm's DiffAttention; see _AttentionBase). "lsa": locality self-attention
    # (Lee et al. 2021, small datasets): scores / a learned temperature, a token's score with itself masked.
    attn_layer: str = "attn"
    # "block": Block; "parallel_scaling": ViT-22B's ParallelScalingBlock; "parallel_things":
    # ParallelThingsBlock, num_parallel attention then num_parallel MLP branches side by side.
    block_fn: str = "block"
    num_parallel: int = 2
    fuse_out_proj: bool = False  # parallel_scaling: one out_proj of attention and MLP together
    # Learned relative positions on the scores (Attention): "bias", "mlp", "mlp_swin" (timm's
    # vision_transformer_relpos), "decomposed" (SAM's); rel_pos_dim: the "mlp" kinds' hidden width.
    rel_pos_type: str = ""
    rel_pos_dim: int = 128
    window_size: int = 0  # attention within windows of this many patches a side (SAM, ViTDet); 0: global

    def __post_init__(self) -> None:
        whole(self.embed_dim, 1, "embed_dim", "the width of the tokens")
        whole(self.num_heads, 1, "num_heads", "attention heads")
        require(self.embed_dim % self.num_heads == 0, "num_heads", self.num_heads,
                f"a divisor of embed_dim {self.embed_dim} (each head takes an equal share of the width)")  # fmt: skip
        number(self.mlp_ratio, "mlp_ratio", "the MLP's width over the tokens', above 0", 0, math.inf, open_low=True)
        for name in ("proj_drop_rate", "attn_drop_rate"):
            number(getattr(self, name), name, "a dropout rate in [0, 1)", 0, 1, open_high=True)
        if isinstance(self.num_kv_heads, list):  # from a YAML or JSON config
            self.num_kv_heads = tuple(self.num_kv_heads)
        kv_heads = self.num_kv_heads if isinstance(self.num_kv_heads, tuple) else (self.num_kv_heads,)
        if any(h is not None and self.num_heads % h for h in kv_heads):
            raise ValueError(f"num_kv_heads {self.num_kv_heads} must divide num_heads {self.num_heads}")
        grouped = any(h not in (None, self.num_heads) for h in kv_heads)
        if grouped and (self.qkv_fused or self.block_fn != "block" or self.attn_layer != "attn"):
            raise ValueError("num_kv_heads (grouped-query attention) needs qkv_fused=False, block_fn='block' and "
                             "attn_layer='attn'")  # fmt: skip
        if self.attn_only_layer_scale and (self.block_fn != "block" or self.post_norm):
            raise ValueError("attn_only_layer_scale is an option of block_fn='block' without post_norm")
        if self.block_fn not in BLOCK_FNS:
            raise ValueError(f"unknown block_fn {self.block_fn!r}; expected one of {BLOCK_FNS}")
        if self.attn_layer not in ATTN_LAYERS:
            raise ValueError(f"attn_layer must be 'attn', 'diff' (differential attention) or 'lsa' (locality "
                             f"self-attention), got {self.attn_layer!r}")  # fmt: skip
        if self.block_fn == "parallel_scaling" and (
            self.mlp != "gelu" or self.num_experts > 1 or self.scale_attn_inner or self.scale_mlp or not self.qkv_fused
        ):
            raise ValueError("block_fn='parallel_scaling' has one fused in_proj and a plain MLP (mlp='gelu', no MoE, "
                             "qkv_fused, no scale_attn_inner / scale_mlp)")  # fmt: skip
        if self.post_norm and self.block_fn != "block":
            raise ValueError("post_norm is an option of block_fn='block'")
        if self.post_norm and self.window_size:
            raise ValueError("window_size is an option of pre-norm blocks (post_norm=False)")
        if self.layer_scale not in ("ls", "gamma"):
            raise ValueError(f"layer_scale must be 'ls' (timm's ViT) or 'gamma' (timm's EVA), got {self.layer_scale!r}")
        if self.mlp not in MLP_KINDS:
            raise ValueError(f"unknown mlp {self.mlp!r}; expected one of {MLP_KINDS}")
        if self.rel_pos_type not in REL_POS_TYPES:
            raise ValueError(f"unknown rel_pos_type {self.rel_pos_type!r}; expected one of {REL_POS_TYPES}")
        if (self.rel_pos_type or self.window_size) and (self.block_fn != "block" or self.attn_layer != "attn"):
            raise ValueError("rel_pos_type and window_size are options of block_fn='block' with attn_layer='attn'")


BLOCK_FNS = ("block", "parallel_scaling", "parallel_things")
ATTN_LAYERS = ("attn", "diff", "lsa")


def _attention(
    c: BlockConfig,
    causal: bool = False,
    depth: int = 0,
    grid: tuple[int, int] | None = None,
    num_prefix_tokens: int = 0,
) -> Attention:
    """The self-attention layer of a BlockConfig; `depth`: the block's number (differential attention,
    per-block num_kv_heads); `grid`, `num_prefix_tokens`: the tokens it sees (relative positions)."""
    kv_heads = c.num_kv_heads[depth] if isinstance(c.num_kv_heads, tuple) else c.num_kv_heads
    return Attention(
        c.embed_dim, num_heads=c.num_heads, qkv_bias=c.qkv_bias, attn_drop=c.attn_drop_rate,
        proj_drop=c.proj_drop_rate, qk_norm=c.qk_norm, norm=c.norm, norm_eps=c.norm_eps, causal=causal,
        qkv_fused=c.qkv_fused, k_bias=c.k_bias, scale_norm=c.scale_attn_inner, rope_half=c.rope_rotate_half,
        proj_bias=c.proj_bias, diff=c.attn_layer == "diff", depth=depth, rel_pos_type=c.rel_pos_type, grid=grid,
        num_prefix_tokens=num_prefix_tokens, rel_pos_dim=c.rel_pos_dim, num_kv_heads=kv_heads,
        lsa=c.attn_layer == "lsa",
    )  # fmt: skip


def _mlp(c: BlockConfig) -> nn.Module:
    """The feed-forward layer of a BlockConfig."""
    return make_mlp(
        c.mlp, c.embed_dim, int(c.embed_dim * c.mlp_ratio), drop=c.proj_drop_rate, num_experts=c.num_experts,
        top_k=c.experts_top_k, capacity_factor=c.expert_capacity, act=c.act_layer,
        norm=c.norm if c.scale_mlp else None, norm_eps=c.norm_eps, align_to=c.swiglu_align_to, bias=c.proj_bias,
    )  # fmt: skip


class Block(nn.Module):
    """Pre-norm transformer block, the one block of every model in this package:

    x = x + drop_path(ls1(attn(norm1(x))))
    x = x + drop_path(ls2(mlp(norm2(x))))

    Built from a BlockConfig; `drop_path` (stochastic depth) varies by depth, so the model passes
    it, and `depth`, the block's number (differential attention's lambda_init depends on it);
    `causal=True` makes the self-attention causal (the GPT). Rotary tables come in forward.
    With layer_scale="gamma" the LayerScale vectors are the block's own `gamma_1`, `gamma_2`
    (timm's EVA names) and ls1, ls2 stay identities. `attn_only_layer_scale`: ls2 / gamma_2 stay off
    (Sapiens2). `grid` (rows, columns) is the patch grid of the tokens after `num_prefix_tokens`,
    which relative positions need.

    Its variants share its parameters and names: ResPostBlock (post_norm) and WindowBlock
    (window_size); `make_block` builds the one a config describes.
    """

    post_norm = False

    def __init__(
        self,
        config: BlockConfig,
        drop_path: float = 0.0,
        causal: bool = False,
        depth: int = 0,
        grid: tuple[int, int] | None = None,
        num_prefix_tokens: int = 0,
    ) -> None:
        super().__init__()
        c, dim = config, config.embed_dim
        if c.block_fn != "block":
            raise ValueError(f"block_fn={c.block_fn!r} is not a Block; build blocks with vit.layers.make_block")
        if block_class(c) is not type(self):
            raise ValueError(f"this config describes a {block_class(c).__name__}, not a {type(self).__name__}; "
                             "build blocks with vit.layers.make_block")  # fmt: skip
        self.grid = grid
        self.norm1 = make_norm(c.norm, dim, c.norm_eps)
        self.attn = _attention(c, causal, depth, self.attention_grid(c, grid, num_prefix_tokens), num_prefix_tokens)
        ls_modules = c.init_values and c.layer_scale == "ls" and not self.post_norm
        gammas = c.init_values is not None and c.layer_scale == "gamma" and not self.post_norm  # timm's EVA: also at 0
        self.ls1 = LayerScale(dim, c.init_values) if ls_modules else nn.Identity()
        self.gamma_1 = nn.Parameter(torch.full((dim,), float(c.init_values))) if gammas else None
        self.drop_path1 = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.norm2 = make_norm(c.norm, dim, c.norm_eps)
        self.mlp = _mlp(c)
        mlp_ls = not c.attn_only_layer_scale
        self.ls2 = LayerScale(dim, c.init_values) if ls_modules and mlp_ls else nn.Identity()
        self.gamma_2 = nn.Parameter(torch.full((dim,), float(c.init_values))) if gammas and mlp_ls else None
        self.drop_path2 = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def attention_grid(
        self, config: BlockConfig, grid: tuple[int, int] | None, num_prefix_tokens: int
    ) -> tuple[int, int] | None:
        """The grid the attention's relative positions span: the tokens' own (a window's in WindowBlock)."""
        return grid

    def forward(
        self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, mean_from: int | None = None,
        **kw: Unpack[AttnArgs],
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """(B, N, dim) -> (B, N, dim); `return_attn=True` also returns this block's attention weights,
        (B, heads, N, N); `num_queries=n` returns only the first n tokens, `block(x)[:, :n]` at a fraction
        of the cost; `attn_mask` and the other keywords: Attention.forward (AttnArgs).
        `mean_from=s` returns `block(x)[:, s:].mean(1)`, (B, dim), for average pooling straight after
        the block (`can_mean`): fc2, the LayerScale and the drop path are linear per image, so fc2
        runs once on the mean hidden state instead of on every token (a third of the MLP's work)."""
        if mean_from is not None and not self.can_mean():
            raise ValueError("mean_from needs a pre-norm block without windows, a dense MLP, no dropout after fc2")
        y, attn = self.attn.with_weights(self.norm1(x), attn_mask, **kw)
        x = _queries(x, kw) + self.drop_path1(_scaled(y, self.ls1, self.gamma_1))
        if mean_from is None:
            x = x + self.drop_path2(_scaled(self.mlp(self.norm2(x)), self.ls2, self.gamma_2))
        else:
            x = x[:, mean_from:]
            y = self.mlp.output(self.mlp.hidden(self.norm2(x)).mean(dim=1))
            x = x.mean(dim=1) + self.drop_path2(_scaled(y, self.ls2, self.gamma_2))
        return (x, attn) if kw.get("return_attn") else x

    def can_mean(self) -> bool:
        """Whether forward takes `mean_from`: a pre-norm block (not a variant), a dense MLP, and no
        dropout after fc2 while training (a per-token mask does not commute with the mean)."""
        mlp = self.mlp
        return type(self) is Block and isinstance(mlp, Mlp) and not (self.training and mlp.drop2.p > 0)

    def grid_attention(self, attn: torch.Tensor, grid: tuple[int, int] | None = None) -> torch.Tensor:
        """forward's `return_attn` weights -> (B, heads, N, N) over the block's tokens (WindowBlock
        places its per-window weights on the grid)."""
        return attn


class ResPostBlock(Block):
    """Post-norm block (timm's ResPostBlock; EVA's post-norm block, relpos's ResPostRelPosBlock), the
    norms after the branches and init_values their initial scale instead of a LayerScale:

    x = x + drop_path(norm1(attn(x)))
    x = x + drop_path(norm2(mlp(x)))
    """

    post_norm = True

    def __init__(self, config: BlockConfig, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        if config.init_values is not None:
            with torch.no_grad():
                self.norm1.weight.fill_(config.init_values)
                self.norm2.weight.fill_(config.init_values)

    def forward(
        self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, **kw: Unpack[AttnArgs]
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """As Block.forward, without `mean_from`."""
        y, attn = self.attn.with_weights(x, attn_mask, **kw)
        x = _queries(x, kw) + self.drop_path1(self.norm1(y))
        x = x + self.drop_path2(self.norm2(self.mlp(x)))
        return (x, attn) if kw.get("return_attn") else x


class WindowBlock(Block):
    """Pre-norm block whose attention runs within each window_size x window_size window of the patch
    grid (SAM's, ViTDet's): the normed grid is zero-padded on the bottom and right to whole windows
    (padding tokens are keys too, as in SAM). Relative positions span a window. Its weights are per
    window, (B x windows, heads, window_size^2, window_size^2); `grid_attention` places them."""

    def __init__(self, config: BlockConfig, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        self.window_size = config.window_size

    def attention_grid(
        self, config: BlockConfig, grid: tuple[int, int] | None, num_prefix_tokens: int
    ) -> tuple[int, int] | None:
        if grid is None or num_prefix_tokens:
            raise ValueError("window_size needs the patch grid and no prefix tokens")
        return (config.window_size, config.window_size)

    def forward(
        self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, **kw: Unpack[AttnArgs]
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """As Block.forward, without `num_queries`, `kv_cache` or `mean_from`; `attn_mask` and `rope` per window."""
        if kw.get("num_queries") is not None or kw.get("kv_cache") is not None:
            raise ValueError("windowed attention takes neither num_queries nor a key/value cache")
        grid = kw.pop("grid", None) or self.grid
        y, padded = window_partition(self.norm1(x), grid, self.window_size)
        y, attn = self.attn.with_weights(y, attn_mask, **kw)  # a window's grid is its own
        x = x + self.drop_path1(_scaled(window_unpartition(y, grid, padded, self.window_size), self.ls1, self.gamma_1))
        x = x + self.drop_path2(_scaled(self.mlp(self.norm2(x)), self.ls2, self.gamma_2))
        return (x, attn) if kw.get("return_attn") else x

    def grid_attention(self, attn: torch.Tensor, grid: tuple[int, int] | None = None) -> torch.Tensor:
        return window_attention_to_grid(attn, self.grid if grid is None else grid, self.window_size)


def _queries(x: torch.Tensor, kw: AttnArgs) -> torch.Tensor:
    """The residual stream of the tokens that queried: the first `num_queries`, or all."""
    n = kw.get("num_queries")
    return x if n is None else x[:, :n]


def _scaled(y: torch.Tensor, ls: nn.Module, gamma: torch.Tensor | None) -> torch.Tensor:
    """A branch's output through its LayerScale: the `ls` module (timm's ViT) or the `gamma` vector (EVA)."""
    return ls(y) if gamma is None else gamma * y


def block_class(config: BlockConfig) -> type[nn.Module]:
    """The block class a config describes: its block_fn, and for "block" post_norm or window_size."""
    if config.block_fn == "parallel_scaling":
        return ParallelScalingBlock
    if config.block_fn == "parallel_things":
        return ParallelThingsBlock
    return ResPostBlock if config.post_norm else WindowBlock if config.window_size else Block


class ParallelScalingBlock(_AttentionBase):
    """ViT-22B's parallel block (Dehghani et al. 2023; timm's ParallelScalingBlock, its parameter
    names): attention and MLP read the same normed input, and one matmul, `in_proj`, gives the MLP's
    hidden layer and q, k, v:

    h, qkv = in_proj(in_norm(x))
    x = x + drop_path(ls(attn_out_proj(attention(qkv)) + mlp_out_proj(act(h + mlp_bias))))

    `fuse_out_proj`: one `out_proj` of both, concatenated. The attention is the Attention's
    (_AttentionBase: both paths, the weights, qk-norm, rotary tables); attn_layer="diff" makes it
    timm's DiffParallelScalingBlock. A layer of its own rather than an option of Block: timm keeps
    the MLP's first layer inside the attention's input projection and q_norm, k_norm, the output
    projections and the LayerScale `ls` on the block itself, so no `attn` or `mlp` submodule exists.
    """

    def __init__(self, config: BlockConfig, drop_path: float = 0.0, causal: bool = False, depth: int = 0) -> None:
        c, dim = config, config.embed_dim
        hidden = int(c.mlp_ratio * dim)
        super().__init__(
            dim, c.num_heads, c.attn_drop_rate, qk_norm=c.qk_norm, norm=c.norm, norm_eps=c.norm_eps,
            diff=c.attn_layer == "diff", depth=depth, proj=False, lsa=c.attn_layer == "lsa",
            in_norm=make_norm(c.norm, dim, c.norm_eps),
            in_proj=nn.Linear(dim, hidden + 3 * dim, bias=c.qkv_bias),
        )  # fmt: skip
        self.causal, self.rope_half = causal, c.rope_rotate_half
        self.in_split = [hidden, 3 * dim]
        # With qkv_bias the MLP's bias is part of in_proj.bias.
        self.mlp_bias = None if c.qkv_bias else nn.Parameter(torch.zeros(hidden))
        self.mlp_drop = nn.Dropout(c.proj_drop_rate)
        self.mlp_act = make_act(c.act_layer or "gelu")
        if c.fuse_out_proj:
            self.out_proj = nn.Linear(dim + hidden, dim, bias=c.proj_bias)
            self.attn_out_proj = self.mlp_out_proj = None
        else:
            self.out_proj = None
            self.attn_out_proj = nn.Linear(dim, dim, bias=c.proj_bias)
            self.mlp_out_proj = nn.Linear(hidden, dim, bias=c.proj_bias)
        self.ls = LayerScale(dim, c.init_values) if c.init_values is not None else nn.Identity()
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def forward(
        self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, **kw: Unpack[AttnArgs]
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """As Block.forward."""
        h, qkv = self.in_proj(self.in_norm(x)).split(self.in_split, dim=-1)
        y, attn = self.self_attention(qkv, attn_mask, **kw)
        x, h = _queries(x, kw), _queries(h, kw)
        h = self.mlp_drop(self.mlp_act(h if self.mlp_bias is None else h + self.mlp_bias))
        if self.out_proj is not None:
            y = self.out_proj(torch.cat((y, h), dim=-1))
        else:
            y = self.attn_out_proj(y) + self.mlp_out_proj(h)
        x = x + self.drop_path(self.ls(y))
        return (x, attn) if kw.get("return_attn") else x

    def grid_attention(self, attn: torch.Tensor, grid: tuple[int, int] | None = None) -> torch.Tensor:
        """As Block.grid_attention: the weights as they are (no windows)."""
        return attn


class ParallelThingsBlock(nn.Module):
    """`num_parallel` attention branches side by side, then as many MLP branches (Touvron et al. 2022,
    "Three things everyone should know about Vision Transformers"; timm's ParallelThingsBlock):

    x = x + sum_i attns[i].drop_path(attns[i].ls(attns[i].attn(attns[i].norm(x))))
    x = x + sum_i ffns[i](x)

    `return_attn` gives each branch's weights, a tuple (the tensors its output was computed from);
    `grid_attention` puts every branch's heads side by side, (B, num_parallel x heads, N, N).
    A layer of its own rather than an option of Block: timm nests each branch's norm, attention or
    MLP and LayerScale under `attns.i` / `ffns.i`.
    """

    def __init__(self, config: BlockConfig, drop_path: float = 0.0, causal: bool = False, depth: int = 0) -> None:
        super().__init__()
        c, dim = config, config.embed_dim

        def branch(name: str, layer: nn.Module) -> nn.Sequential:
            return nn.Sequential(OrderedDict([
                ("norm", make_norm(c.norm, dim, c.norm_eps)), (name, layer),
                ("ls", LayerScale(dim, c.init_values) if c.init_values else nn.Identity()),
                ("drop_path", DropPath(drop_path) if drop_path > 0 else nn.Identity()),
            ]))  # fmt: skip

        self.attns = nn.ModuleList([branch("attn", _attention(c, causal, depth)) for _ in range(c.num_parallel)])
        self.ffns = nn.ModuleList([branch("mlp", _mlp(c)) for _ in range(c.num_parallel)])

    def forward(
        self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, **kw: Unpack[AttnArgs]
    ) -> torch.Tensor | tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """As Block.forward, without a key/value cache (each branch would need its own)."""
        if kw.get("kv_cache") is not None:
            raise ValueError("a ParallelThingsBlock keeps no key/value cache")
        outs, attns = [], []
        for b in self.attns:
            y, attn = b.attn.with_weights(b.norm(x), attn_mask, **kw)
            outs.append(b.drop_path(b.ls(y)))
            attns.append(attn)
        x = _queries(x, kw) + torch.stack(outs).sum(dim=0)
        x = x + torch.stack([ffn(x) for ffn in self.ffns]).sum(dim=0)
        return (x, tuple(attns)) if kw.get("return_attn") else x

    def grid_attention(self, attn: tuple[torch.Tensor, ...], grid: tuple[int, int] | None = None) -> torch.Tensor:
        """forward's per-branch weights -> (B, num_parallel x heads, N, N), the branches side by side."""
        return torch.cat(attn, dim=1)


def make_block(
    config: BlockConfig,
    drop_path: float = 0.0,
    depth: int = 0,
    causal: bool = False,
    grid: tuple[int, int] | None = None,
    num_prefix_tokens: int = 0,
) -> nn.Module:
    """The block the config describes (`block_class`): Block, ResPostBlock, WindowBlock, ParallelScalingBlock
    or ParallelThingsBlock. `grid`, `num_prefix_tokens`: the tokens' patch grid after the prefix tokens
    (relative positions, windows; the parallel blocks have neither)."""
    cls = block_class(config)
    if issubclass(cls, Block):
        return cls(config, drop_path, causal, depth, grid, num_prefix_tokens)
    return cls(config, drop_path=drop_path, causal=causal, depth=depth)


BLOCKS = (Block, ParallelScalingBlock, ParallelThingsBlock)  # every block class; Block's variants subclass it


def set_fused_attn(model: nn.Module, enabled: bool) -> None:
    """Switch every attention layer in `model` between the fused (SDPA) and the explicit path."""
    for module in model.modules():
        if isinstance(module, _AttentionBase):
            module.fused_attn = enabled
