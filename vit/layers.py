"""The transformer building blocks shared by every model here (ViT and GPT).

Module and parameter names follow timm (`qkv`, `proj`, `fc1`, `fc2`, `norm1`, `ls1`, ...) so
that timm state dicts load into our models without renaming.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _pair(x: int | tuple[int, int]) -> tuple[int, int]:
    return (x, x) if isinstance(x, int) else (int(x[0]), int(x[1]))


def make_norm(kind: str, dim: int) -> nn.Module:
    """A normalisation layer by name. eps=1e-6 as in timm/big_vision ViTs (PyTorch's default is 1e-5)."""
    if kind == "layernorm":
        return nn.LayerNorm(dim, eps=1e-6)
    raise ValueError(f"unknown norm {kind!r}; expected 'layernorm'")


class PatchEmbed(nn.Module):
    """Image to patch tokens: a Conv2d whose kernel and stride are the patch size, then flatten."""

    def __init__(
        self,
        img_size: int | tuple[int, int] = 224,
        patch_size: int | tuple[int, int] = 16,
        in_chans: int = 3,
        embed_dim: int = 768,
    ) -> None:
        super().__init__()
        self.img_size = _pair(img_size)
        self.patch_size = _pair(patch_size)
        check_divisible(self.img_size, self.patch_size)
        self.grid_size = (self.img_size[0] // self.patch_size[0], self.img_size[1] // self.patch_size[1])
        self.num_patches = self.grid_size[0] * self.grid_size[1]
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=self.patch_size, stride=self.patch_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) -> (B, H/p * W/p, D), row-major over the patch grid."""
        if x.ndim != 4:
            raise ValueError(f"PatchEmbed expects images of shape (B, C, H, W), got {tuple(x.shape)}")
        check_divisible(tuple(x.shape[-2:]), self.patch_size)
        return self.proj(x).flatten(2).transpose(1, 2)


def check_divisible(img_size: tuple[int, ...], patch_size: tuple[int, int]) -> None:
    if img_size[0] % patch_size[0] or img_size[1] % patch_size[1]:
        raise ValueError(
            f"image size {img_size[0]}x{img_size[1]} is not divisible by patch size "
            f"{patch_size[0]}x{patch_size[1]}; resize or crop the images to a multiple of the patch size"
        )


def merge_masks(
    attn_mask: torch.Tensor | None, is_causal: bool, n_q: int, n_k: int, device: torch.device
) -> torch.Tensor | None:
    """Fold `is_causal` into `attn_mask` so both attention paths see one mask.

    Masks follow `scaled_dot_product_attention`: boolean True means "may attend", a float mask is
    added to the scores. The causal mask is aligned to the bottom-right, so the last query sees
    every key (this is what a key/value cache needs when n_q < n_k).
    """
    if not is_causal:
        return attn_mask
    causal = torch.ones(n_q, n_k, dtype=torch.bool, device=device).tril(diagonal=n_k - n_q)
    if attn_mask is None:
        return causal
    if attn_mask.dtype == torch.bool:
        return attn_mask & causal
    return attn_mask.masked_fill(~causal, float("-inf"))


class Attention(nn.Module):
    """Multi-head self-attention with one fused qkv projection.

    Two paths give the same output: the fused `F.scaled_dot_product_attention` (flash /
    memory-efficient kernels on GPU; the default) and an explicit softmax(QK^T/sqrt(d))V that can
    also return the attention weights. `fused_attn` is a per-module switch, and
    `forward(..., return_attn=True)` takes the explicit path for that one call only, so attention
    maps can be read while the rest of the model stays fused.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        qkv_bias: bool = True,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
    ) -> None:
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"width {dim} is not divisible by num_heads {num_heads}")
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim**-0.5
        self.fused_attn = True
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(
        self,
        x: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        is_causal: bool = False,
        return_attn: bool = False,
        num_queries: int | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """`num_queries=n`: only the first n tokens query (keys and values are still every token), so
        the output is (B, n, C); for a classifier that reads only the CLS token. Not with masks."""
        B, N, C = x.shape
        # Split on the "3" axis of (B, N, 3, heads, head_dim): in the backward, the stacked q/k/v
        # gradients then land in qkv's own layout. (permute(2, 0, 3, 1, 4).unbind(0) gives the same
        # views but makes the backward copy the whole qkv gradient once more.)
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))  # (B, heads, N, head_dim) each
        if num_queries is not None:
            if attn_mask is not None or is_causal:
                raise ValueError("num_queries is for unmasked attention; got a mask or is_causal")
            q = q[:, :, :num_queries]
        if attn_mask is not None:
            # SDPA refuses a mask together with is_causal; one merged mask serves both paths.
            attn_mask, is_causal = merge_masks(attn_mask, is_causal, N, N, x.device), False
        attn = None
        if self.fused_attn and not return_attn:
            dropout_p = self.attn_drop.p if self.training else 0.0
            x = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal)
        else:
            attn = attention_weights(q * self.scale, k, merge_masks(attn_mask, is_causal, N, N, x.device))
            x = self.attn_drop(attn) @ v
        x = self.proj_drop(self.proj(x.transpose(1, 2).reshape(B, q.shape[2], C)))
        return (x, attn) if return_attn else x


def attention_weights(q: torch.Tensor, k: torch.Tensor, attn_mask: torch.Tensor | None) -> torch.Tensor:
    """softmax(q k^T + mask) over the keys; q is already scaled. Returns (B, heads, Nq, Nk)."""
    scores = q @ k.transpose(-2, -1)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask
    return scores.softmax(dim=-1)


class Mlp(nn.Module):
    """fc1 -> GELU -> fc2, the transformer feed-forward layer."""

    def __init__(self, dim: int, hidden_dim: int, drop: float = 0.0) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden_dim)
        self.act = nn.GELU()
        self.drop1 = nn.Dropout(drop)
        self.fc2 = nn.Linear(hidden_dim, dim)
        self.drop2 = nn.Dropout(drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop2(self.fc2(self.drop1(self.act(self.fc1(x)))))


class DropPath(nn.Module):
    """Stochastic depth: drop the whole residual branch for a random subset of samples.

    Kept samples are scaled by 1/keep_prob so the expected output is unchanged.
    """

    def __init__(self, drop_prob: float = 0.0) -> None:
        super().__init__()
        self.drop_prob = drop_prob

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.drop_prob == 0.0 or not self.training:
            return x
        keep_prob = 1.0 - self.drop_prob
        mask = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep_prob)
        return x * mask / keep_prob

    def extra_repr(self) -> str:
        return f"drop_prob={self.drop_prob}"


class LayerScale(nn.Module):
    """Per-channel learned scale of a residual branch (CaiT / DeiT-III), started small."""

    def __init__(self, dim: int, init_values: float = 1e-5) -> None:
        super().__init__()
        self.init_values = init_values
        self.gamma = nn.Parameter(torch.full((dim,), init_values))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma


class Block(nn.Module):
    """Pre-norm transformer block, the one block of every model in this package:

    x = x + drop_path(ls1(attn(norm1(x))))
    x = x + drop_path(ls2(mlp(norm2(x))))
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        proj_drop: float = 0.0,
        attn_drop: float = 0.0,
        drop_path: float = 0.0,
        init_values: float | None = None,
        norm: str = "layernorm",
    ) -> None:
        super().__init__()
        self.norm1 = make_norm(norm, dim)
        self.attn = Attention(dim, num_heads, qkv_bias=qkv_bias, attn_drop=attn_drop, proj_drop=proj_drop)
        self.ls1 = LayerScale(dim, init_values) if init_values else nn.Identity()
        self.drop_path1 = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.norm2 = make_norm(norm, dim)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), drop=proj_drop)
        self.ls2 = LayerScale(dim, init_values) if init_values else nn.Identity()
        self.drop_path2 = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def forward(
        self,
        x: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        is_causal: bool = False,
        return_attn: bool = False,
        num_queries: int | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """`return_attn=True` also returns this block's attention weights, (B, heads, N, N).
        `num_queries=n` returns only the first n tokens, `block(x)[:, :n]` at a fraction of the cost."""
        y = self.attn(
            self.norm1(x), attn_mask=attn_mask, is_causal=is_causal, return_attn=return_attn, num_queries=num_queries
        )
        y, attn = y if return_attn else (y, None)
        if num_queries is not None:
            x = x[:, :num_queries]
        x = x + self.drop_path1(self.ls1(y))
        x = x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))
        return (x, attn) if return_attn else x


def set_fused_attn(model: nn.Module, enabled: bool) -> None:
    """Switch every Attention in `model` between the fused (SDPA) and the explicit path."""
    for module in model.modules():
        if isinstance(module, Attention):
            module.fused_attn = enabled
