"""The transformer building blocks shared by every model here (ViT and GPT).

Module and parameter names follow timm (`qkv`, `proj`, `fc1`, `fc2`, `norm1`, `ls1`, ...) so
that timm state dicts load into our models without renaming.
"""

from __future__ import annotations

import contextlib
import math
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from vit.options import number, require, whole
from vit.position import RelPosBias, RelPosMlp, apply_rope, decomposed_rel_pos_bias


def _pair(x: int | tuple[int, int]) -> tuple[int, int]:
    return (x, x) if isinstance(x, int) else (int(x[0]), int(x[1]))


def make_norm(kind: str, dim: int, eps: float = 1e-6) -> nn.Module:
    """A normalisation layer by name. eps=1e-6 as in timm/big_vision ViTs (PyTorch's default is 1e-5,
    which CLIP's weights were trained with).

    "rmsnorm" (Zhang & Sennrich 2019; LLaMA) scales by the root mean square without centring and
    has no bias: a little cheaper, and in practice as good as LayerNorm."""
    if kind == "layernorm":
        return nn.LayerNorm(dim, eps=eps)
    if kind == "rmsnorm":
        return nn.RMSNorm(dim, eps=eps)
    raise ValueError(f"unknown norm {kind!r}; expected 'layernorm' or 'rmsnorm'")


class LayerNorm2d(nn.LayerNorm):
    """LayerNorm over the channels of a (B, C, H, W) map (timm's LayerNorm2d, eps 1e-6; SAM's neck)."""

    def __init__(self, num_channels: int, eps: float = 1e-6) -> None:
        super().__init__(num_channels, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.layer_norm(x.permute(0, 2, 3, 1), self.normalized_shape, self.weight, self.bias, self.eps)
        return x.permute(0, 3, 1, 2)


class QuickGELU(nn.Module):
    """x * sigmoid(1.702 x): the GELU approximation OpenAI's CLIP was trained with."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(1.702 * x)


ACTIVATIONS = {
    "gelu": nn.GELU,
    "gelu_tanh": lambda: nn.GELU(approximate="tanh"),  # SigLIP's
    "quick_gelu": QuickGELU,
    "silu": nn.SiLU,
}


def make_act(name: str) -> nn.Module:
    """An activation by timm's name."""
    if name not in ACTIVATIONS:
        raise ValueError(f"unknown activation {name!r}; expected one of {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]()


class PatchEmbed(nn.Module):
    """Image to patch tokens: a Conv2d whose kernel and stride are the patch size, then flatten.

    With `stem_channels` it is instead a convolutional stem (Xiao et al. 2021, "Early convolutions
    help transformers see better"): one 3x3 stride-2 conv + BatchNorm + ReLU per entry, as many as
    halve the image down to the patch grid (so the patch size must be a power of two), then a 1x1
    conv to the width (`proj`). The model is then a hybrid, not a plain patchify ViT.
    """

    def __init__(
        self,
        img_size: int | tuple[int, int] = 224,
        patch_size: int | tuple[int, int] = 16,
        in_chans: int = 3,
        embed_dim: int = 768,
        stem_channels: tuple[int, ...] | None = None,
        bias: bool = True,
        dynamic_img_pad: bool = False,
        norm: str | None = None,
        norm_eps: float = 1e-6,
    ) -> None:
        super().__init__()
        self.img_size = _pair(img_size)
        self.patch_size = _pair(patch_size)
        self.dynamic_img_pad = dynamic_img_pad
        # An img_size that is not a multiple of the patch is taken as timm does (SigLIP at 384 with
        # 14-pixel patches): the conv leaves out the last rows and columns. Other inputs must divide.
        self.grid_size = self.dynamic_feat_size(self.img_size)
        self.num_patches = self.grid_size[0] * self.grid_size[1]
        self.backbone = None
        if stem_channels:
            p = self.patch_size[0]
            if self.patch_size[0] != self.patch_size[1] or p & (p - 1) or 2 ** len(stem_channels) != p:
                raise ValueError(
                    f"a conv stem of {len(stem_channels)} stride-2 convs reduces by {2 ** len(stem_channels)}, "
                    f"not by the patch size {self.patch_size}; give log2(patch size) stem_channels"
                )
            layers: list[nn.Module] = []
            for c_in, c_out in zip((in_chans, *stem_channels[:-1]), stem_channels, strict=True):
                layers += [nn.Conv2d(c_in, c_out, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(c_out)]
                layers.append(nn.ReLU(inplace=True))
            self.backbone = nn.Sequential(*layers)
            self.proj = nn.Conv2d(stem_channels[-1], embed_dim, kernel_size=1)
        else:
            self.proj = nn.Conv2d(in_chans, embed_dim, self.patch_size, stride=self.patch_size, bias=bias)
        self.norm = make_norm(norm, embed_dim, norm_eps) if norm else nn.Identity()  # timm's norm_layer (AIMv2)

    def dynamic_feat_size(self, img_size: tuple[int, int]) -> tuple[int, int]:
        """The patch grid of an image size (rounded up with `dynamic_img_pad`; timm's name)."""
        (h, w), (ph, pw) = img_size, self.patch_size
        return (-(-h // ph), -(-w // pw)) if self.dynamic_img_pad else (h // ph, w // pw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) -> (B, H/p * W/p, D), row-major over the patch grid. With `dynamic_img_pad`
        the image is zero-padded on the bottom and right to a multiple of the patch size (timm's)."""
        if x.ndim != 4:
            raise ValueError(f"PatchEmbed expects images of shape (B, C, H, W), got {tuple(x.shape)}")
        if self.dynamic_img_pad:
            (ph, pw), (h, w) = self.patch_size, x.shape[-2:]
            x = F.pad(x, (0, (pw - w % pw) % pw, 0, (ph - h % ph) % ph))
        if tuple(x.shape[-2:]) != self.img_size:
            check_divisible(tuple(x.shape[-2:]), self.patch_size)
        if self.backbone is not None:
            x = self.backbone(x)
        return self.norm(self.proj(x).flatten(2).transpose(1, 2))


@torch.no_grad()
def whiten_patch_embed_(proj: nn.Conv2d, images: torch.Tensor, eps: float = 1e-2) -> None:
    """Set a patchify conv (kernel = stride, no padding) to whiten the patches of `images`: its
    outputs on them have zero mean and, along each of the C*p*p directions the patch pixels span,
    variance lambda / (lambda + eps) (lambda the direction's own variance: near 1 where lambda >> eps;
    on CIFAR-10's 4x4 patches 14 of 48 directions reach 0.9 at eps 0.01). airbench's whitening init
    of its first conv (Jordan 2024; Coates & Ng 2011 before it), here for a ViT's patch embedding: a
    linear patchify sees decorrelated pixels from step 0 instead of learning to. `eps` (in the units
    of `images`' variance) keeps near-empty directions, pixel noise and JPEG artefacts, from being
    blown up.

    With more output channels than patch pixels (CIFAR's 4x4x3 = 48 into 128) a fixed orthonormal
    map, seeded apart from the global RNG, spreads the whitened directions over all channels; with
    fewer, the strongest directions are kept. Without a bias the outputs are not centred."""
    kernel, c_out = tuple(proj.kernel_size), proj.out_channels
    if tuple(proj.stride) != kernel or tuple(proj.padding) != (0, 0) or proj.groups != 1 or proj.dilation != (1, 1):
        raise ValueError(
            f"whitening needs a patchify conv (kernel = stride, no padding, groups or dilation), got kernel "
            f"{kernel}, stride {tuple(proj.stride)}, padding {proj.padding}, groups {proj.groups}"
        )
    if images.ndim != 4 or images.shape[1] != proj.in_channels:
        raise ValueError(f"whitening needs images (B, {proj.in_channels}, H, W), got {tuple(images.shape)}")
    patches = F.unfold(images.float(), kernel, stride=kernel).transpose(1, 2).flatten(0, 1)  # (B*L, C*p*p)
    if len(patches) < 2 * patches.shape[1]:
        raise ValueError(
            f"whitening {patches.shape[1]}-pixel patches needs at least {2 * patches.shape[1]} of them, "
            f"got {len(patches)} from images {tuple(images.shape)}"
        )
    mean = patches.mean(0)
    variances, directions = torch.linalg.eigh(torch.cov(patches.T.double()))  # ascending
    white = (directions / (variances.clamp(min=0) + eps).sqrt()).T.float()  # rows: directions, scaled
    if c_out >= len(white):
        generator = torch.Generator().manual_seed(0)
        spread, _ = torch.linalg.qr(torch.randn(c_out, len(white), generator=generator))  # orthonormal columns
        weight = spread.to(white) @ white
    else:
        weight = white[-c_out:]
    proj.weight.copy_(weight.reshape(proj.weight.shape))
    if proj.bias is not None:
        proj.bias.copy_(-weight @ mean.float())


class HybridEmbed(nn.Module):
    """A CNN's feature map as patch tokens: the ViT paper's hybrid (R50+ViT-B/16), as timm's
    HybridEmbed, with its parameter names (`backbone.*`, `proj.*`).

    `backbone` takes the images and returns a (B, C, h, w) feature map (or a list of them: the last
    is used); `proj` is a conv with kernel and stride `proj_size` over that map to the width (1x1 in
    most of timm's hybrids), or, with `proj=False`, nothing (the map's channels are the width).
    The token grid is the backbone's output size at `img_size` divided by `proj_size`, found as timm
    does, by running the backbone once (here on the meta device: shapes only, no arithmetic).
    `patch_size` is, as in PatchEmbed, the side in pixels of the image patch one token stands for
    (the backbone's reduction times `proj_size`): the multiple other input sizes must be of.
    """

    def __init__(
        self,
        backbone: nn.Module,
        img_size: int | tuple[int, int] = 224,
        proj_size: int | tuple[int, int] = 1,
        in_chans: int = 3,
        embed_dim: int = 768,
        proj: bool = True,
        bias: bool = True,
        dynamic_img_pad: bool = False,
    ) -> None:
        super().__init__()
        self.backbone = backbone
        self.img_size, self.proj_size = _pair(img_size), _pair(proj_size)
        self.dynamic_img_pad = dynamic_img_pad
        feature_dim, *self.feature_size = _feature_map_shape(backbone, in_chans, self.img_size)
        # timm's definition: image size // feature size, so other sizes get timm's grid.
        self.feature_ratio = (self.img_size[0] // self.feature_size[0], self.img_size[1] // self.feature_size[1])
        self.patch_size = (self.feature_ratio[0] * self.proj_size[0], self.feature_ratio[1] * self.proj_size[1])
        (h, w), (ph, pw) = self.feature_size, self.proj_size
        if not dynamic_img_pad and (h % ph or w % pw):
            raise ValueError(
                f"the backbone's {h}x{w} feature map (at img_size {self.img_size}) is not divisible by the "
                f"projection's {ph}x{pw} kernel (patch_size); change img_size or set dynamic_img_pad"
            )
        self.grid_size = (h // ph, w // pw)  # timm's, also with dynamic_img_pad
        self.num_patches = self.grid_size[0] * self.grid_size[1]
        if proj:
            self.proj = nn.Conv2d(feature_dim, embed_dim, self.proj_size, stride=self.proj_size, bias=bias)
        elif feature_dim != embed_dim:
            raise ValueError(
                f"without a projection the backbone's {feature_dim} channels must equal embed_dim {embed_dim}"
            )
        else:
            self.proj = nn.Identity()

    def dynamic_feat_size(self, img_size: tuple[int, int]) -> tuple[int, int]:
        """The token grid of an image size (timm's formula; rounded up with `dynamic_img_pad`)."""
        h, w = img_size[0] // self.feature_ratio[0], img_size[1] // self.feature_ratio[1]
        (ph, pw) = self.proj_size
        return (-(-h // ph), -(-w // pw)) if self.dynamic_img_pad else (h // ph, w // pw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) -> (B, grid_h * grid_w, D), row-major over the grid. With `dynamic_img_pad` the
        feature map is zero-padded on the bottom and right to a multiple of `proj_size` (timm's)."""
        if x.ndim != 4:
            raise ValueError(f"HybridEmbed expects images of shape (B, C, H, W), got {tuple(x.shape)}")
        if tuple(x.shape[-2:]) != self.img_size:
            check_divisible(tuple(x.shape[-2:]), self.feature_ratio if self.dynamic_img_pad else self.patch_size)
        x = self.backbone(x)
        if isinstance(x, (list, tuple)):
            x = x[-1]
        if self.dynamic_img_pad:
            (ph, pw), (h, w) = self.proj_size, x.shape[-2:]
            x = F.pad(x, (0, (pw - w % pw) % pw, 0, (ph - h % ph) % ph))
        return self.proj(x).flatten(2).transpose(1, 2)


def _feature_map_shape(backbone: nn.Module, in_chans: int, img_size: tuple[int, int]) -> tuple[int, int, int]:
    """(C, h, w) of the backbone's (last) feature map for an image of `img_size`, from a run in eval
    mode on the meta device: every tensor is a shape without data, so nothing is computed."""
    tensors = {name: t.to("meta") for name, t in [*backbone.named_parameters(), *backbone.named_buffers()]}
    modes = [(m, m.training) for m in backbone.modules()]
    backbone.eval()
    try:
        with torch.no_grad():
            out = torch.func.functional_call(backbone, tensors, torch.zeros(1, in_chans, *img_size, device="meta"))
    finally:
        for module, mode in modes:
            module.training = mode
    out = out[-1] if isinstance(out, (list, tuple)) else out
    return tuple(out.shape[1:])


class PatchDropout(nn.Module):
    """While training, keep a random `1 - prob` of each image's patch tokens (prefix tokens always
    stay), so every block runs on fewer tokens: a cheaper step that also regularises (timm's
    `patch_drop_rate`, as in FLIP and MAE). Identity at evaluation."""

    def __init__(self, prob: float, num_prefix_tokens: int) -> None:
        super().__init__()
        if not 0.0 <= prob < 1.0:
            raise ValueError(f"patch_drop_rate must be in [0, 1), got {prob}")
        self.prob, self.num_prefix_tokens = prob, num_prefix_tokens

    def forward(
        self, x: torch.Tensor, return_indices: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        """With `return_indices` (as in timm), also the kept patches' indices (B, kept) in the
        patch grid, None when nothing was dropped: rotary positions (posemb="rope") follow them."""
        if not self.training or self.prob == 0.0:
            return (x, None) if return_indices else x
        prefix, patches = x[:, : self.num_prefix_tokens], x[:, self.num_prefix_tokens :]
        b, n, d = patches.shape
        keep = max(1, round(n * (1.0 - self.prob)))
        order = torch.rand(b, n, device=x.device).argsort(dim=1)[:, :keep].sort(dim=1).values
        x = torch.cat([prefix, patches.gather(1, order[..., None].expand(-1, -1, d))], dim=1)
        return (x, order) if return_indices else x


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


class KVCache:
    """The keys and values one Attention layer has seen, so generation feeds only the new token."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append (B, heads, N, head_dim) keys and values; return all of them so far."""
        if self.k is not None:
            k, v = torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2)
        self.k, self.v = k, v
        return k, v


def fused_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None, dropout_p: float, is_causal: bool
) -> torch.Tensor:
    """`F.scaled_dot_product_attention`, computed in fp32 for half-precision inputs on a CPU.

    PyTorch's CPU flash kernel in half precision is 3-6x slower than in fp32 at ViT sequence
    lengths (fwd+bwd, 32-64 tokens: 26.6 vs 4.1 ms; 197 tokens: 103 vs 100 ms), and under bf16
    autocast on an AMX Xeon it took over half of the ViT's training step; the matmuls around it
    stay in bf16. Autocast is switched off for the call, since it would cast the inputs back down.
    """
    if q.device.type != "cpu" or q.dtype not in (torch.bfloat16, torch.float16):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal)
    if attn_mask is not None and attn_mask.is_floating_point():
        attn_mask = attn_mask.float()
    with torch.autocast("cpu", enabled=False):
        x = F.scaled_dot_product_attention(
            q.float(), k.float(), v.float(), attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal
        )
    return x.to(q.dtype)


class _AttentionBase(nn.Module):
    """What self- and cross-attention share: heads, qk-norm, the two attention paths, the output
    projection. Subclasses compute q, k, v (B, heads, N, head_dim) and call `attend`, or, for
    self-attention, hand q, k, v side by side to `self_attention`.

    Two paths give the same output: the fused `F.scaled_dot_product_attention` (flash /
    memory-efficient kernels on GPU; the default) and an explicit softmax(QK^T/sqrt(d))V that can
    also return the attention weights. `fused_attn` is a per-module switch, and
    `return_attn=True` takes the explicit path for that one call only, so attention maps can be
    read while the rest of the model stays fused. `qk_norm=True` normalises q and k per head
    (timm's `q_norm`/`k_norm`; ViT-22B, for stable logits at scale), with the block's norm kind.

    `diff=True` is differential attention (Ye et al. 2024, "Differential Transformer"; timm's
    DiffAttention, its names): each head's q and k are split into two halves (heads 2h and 2h + 1 of
    head_dim / 2), giving two softmax maps A1, A2; the head reads v (full head width) through
    A1 - lambda A2, then a per-head RMSNorm (`sub_norm`) and the factor 1 - lambda_init, where
    lambda = exp(lambda_q1 . lambda_k1) - exp(lambda_q2 . lambda_k2) + lambda_init and lambda_init
    = 0.8 - 0.6 exp(-0.3 depth) for the block numbered `depth`. Its attention weights are
    A1 - lambda A2, (B, heads, N, N): rows sum to 1 - lambda, entries may be negative.
    `proj=False`: no output projection (a block that projects the heads itself).
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
        qk_norm: bool = False,
        norm: str = "layernorm",
        norm_eps: float = 1e-6,
        proj_bias: bool = True,
        diff: bool = False,
        depth: int = 0,
        proj: bool = True,
        **in_proj: nn.Module,
    ) -> None:
        super().__init__()
        if dim % (num_heads * (2 if diff else 1)):
            raise ValueError(f"width {dim} is not divisible by num_heads {num_heads}{' x 2 (diff)' if diff else ''}")
        # The subclass's input projections (qkv, or q and kv) come first, as they always did: the
        # registration order is the initialisation order, so the same seed gives the same weights.
        for name, module in in_proj.items():
            setattr(self, name, module)
        self.num_heads = self.num_kv_heads = num_heads  # Attention's num_kv_heads may be fewer
        self.head_dim = dim // num_heads // (2 if diff else 1)  # of q and k; diff: v's heads are twice as wide
        self.scale = self.head_dim**-0.5
        self.fused_attn = True
        self.q_norm = make_norm(norm, self.head_dim, norm_eps) if qk_norm else nn.Identity()
        self.k_norm = make_norm(norm, self.head_dim, norm_eps) if qk_norm else nn.Identity()
        self.attn_drop = nn.Dropout(attn_drop)
        self.diff = diff
        if diff:
            self.lambda_init = 0.8 - 0.6 * math.exp(-0.3 * depth)
            for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
                setattr(self, name, nn.Parameter(torch.randn(self.head_dim) * 0.1))
            self.sub_norm = nn.RMSNorm(2 * self.head_dim, eps=1e-5)  # timm's, whatever the block's norm
        if proj:
            self.proj = nn.Linear(dim, dim, bias=proj_bias)
            self.proj_drop = nn.Dropout(proj_drop)

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        """(B, N, dim) -> (B, heads, N, head_dim)."""
        return t.reshape(t.shape[0], t.shape[1], self.num_heads, self.head_dim).transpose(1, 2)

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        is_causal: bool = False,
        return_attn: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """softmax(q k^T / sqrt(d) + mask) v (diff: see the class), the heads side by side before the
        output projection: (B, Nq, heads x v's head width), and the weights if asked."""
        n_q, n_k = q.shape[2], k.shape[2]
        if attn_mask is not None or (is_causal and n_k != n_q):
            # SDPA refuses a mask together with is_causal, and aligns its causal mask top-left when
            # there are more keys than queries (a cache); one merged mask serves both paths.
            attn_mask, is_causal = merge_masks(attn_mask, is_causal, n_q, n_k, q.device), False
        dropout_p = self.attn_drop.p if self.training else 0.0
        attn = None
        if self.diff:
            lam = self.diff_lambda().type_as(q)
            if self.fused_attn and not return_attn:
                (q1, q2), (k1, k2) = (t.unflatten(1, (-1, 2)).unbind(2) for t in (q, k))
                x = fused_attention(q1, k1, v, attn_mask, dropout_p, is_causal)
                x = x - lam * fused_attention(q2, k2, v, attn_mask, dropout_p, is_causal)
            else:
                maps = attention_weights(q * self.scale, k, merge_masks(attn_mask, is_causal, n_q, n_k, q.device))
                maps = maps.unflatten(1, (-1, 2))  # (B, heads, 2, Nq, Nk): A1, A2 of each head
                attn = maps[:, :, 0] - lam * maps[:, :, 1]
                if self.training and self.attn_drop.p > 0:  # each map dropped on its own, as timm
                    dropped = self.attn_drop(maps)
                    x = (dropped[:, :, 0] - lam * dropped[:, :, 1]) @ v
                else:  # from the returned weights, so gradients can be taken of them (gradient rollout)
                    x = attn @ v
            x = self.sub_norm(x) * (1 - self.lambda_init)
        elif self.fused_attn and not return_attn:
            x = fused_attention(q, k, v, attn_mask, dropout_p, is_causal)
        else:
            attn = attention_weights(q * self.scale, k, merge_masks(attn_mask, is_causal, n_q, n_k, q.device))
            x = self.attn_drop(attn) @ v
        return x.transpose(1, 2).reshape(q.shape[0], n_q, -1), attn

    def diff_lambda(self) -> torch.Tensor:
        """Differential attention's lambda, a scalar (timm's `_compute_lambda`)."""
        lambda_1 = torch.exp(torch.sum(self.lambda_q1 * self.lambda_k1, dim=-1).float())
        lambda_2 = torch.exp(torch.sum(self.lambda_q2 * self.lambda_k2, dim=-1).float())
        return lambda_1 - lambda_2 + self.lambda_init

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        is_causal: bool = False,
        return_attn: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The attention, projected: (B, Nq, dim), and the weights if asked."""
        x, attn = self.attention(q, k, v, attn_mask, is_causal, return_attn)
        return self.proj_drop(self.proj(self.inner_norm(x))), attn

    def self_attention(
        self,
        qkv: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        kv_cache: KVCache | None = None,
        num_queries: int | None = None,
        return_attn: bool = False,
        grid: tuple[int, int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """q, k, v side by side (B, N, 3 * dim) -> `attention` of them, before the output projection:
        q and k normed and rotated, the first `num_queries` tokens querying, keys and values cached.
        The arguments are Attention.forward's."""
        B, N = qkv.shape[:2]
        groups = self.num_heads // self.num_kv_heads
        if groups == 1:
            # Split on the "3" axis of (B, N, 3, heads, head_dim): in the backward, the stacked q/k/v
            # gradients then land in qkv's own layout. (permute(2, 0, 3, 1, 4).unbind(0) gives the same
            # views but makes the backward copy the whole qkv gradient once more.)
            q, k, v = qkv.reshape(B, N, 3, -1, self.head_dim).unbind(2)
        else:
            kv_dim = self.num_kv_heads * self.head_dim  # grouped-query attention: k and v are narrower than q
            parts = qkv.split([qkv.shape[-1] - 2 * kv_dim, kv_dim, kv_dim], dim=-1)
            q, k, v = (t.unflatten(-1, (-1, self.head_dim)) for t in parts)
        if self.diff:  # v: one head of twice the width per pair of q/k half-heads
            v = v.reshape(B, N, self.num_heads, 2 * self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, heads, N, head_dim) each
        q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            if self.diff:
                raise ValueError("rotary positions with differential attention are not supported")
            q, k = apply_rope(q, *rope, half=self.rope_half), apply_rope(k, *rope, half=self.rope_half)
        attn_mask = add_bias(attn_mask, self.position_bias(q, grid))
        if num_queries is not None:
            if self.causal:
                raise ValueError("num_queries is for unmasked or explicitly masked attention, not a causal layer")
            q = q[:, :, :num_queries]
            if attn_mask is not None and attn_mask.ndim >= 2 and attn_mask.shape[-2] == N:
                attn_mask = attn_mask[..., :num_queries, :]  # the queries' rows
        if kv_cache is not None:
            k, v = kv_cache.update(k, v)
        if groups > 1:
            # Grouped-query attention: query head h reads key/value head h // groups (timm's
            # repeat_interleave); expanded last, so norm, rotation and the cache keep the fewer heads.
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        return self.attention(q, k, v, attn_mask, self.causal, return_attn)

    def inner_norm(self, x: torch.Tensor) -> torch.Tensor:
        """The attention output before `proj`; self-attention may normalise it (scale_norm)."""
        return x

    def position_bias(self, q: torch.Tensor, grid: tuple[int, int] | None = None) -> torch.Tensor | None:
        """The relative positions' bias on the scores, (B | 1, heads, N, N), or None (see Attention)."""
        return None


def add_bias(attn_mask: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor | None:
    """An SDPA mask (boolean or additive) with an additive bias added: one float mask, the bias's dtype."""
    if bias is None:
        return attn_mask
    if attn_mask is None:
        return bias
    if attn_mask.dtype == torch.bool:
        return bias.masked_fill(~attn_mask, float("-inf"))
    return attn_mask.to(bias.dtype) + bias


QKV_NAMES = ("q_proj", "k_proj", "v_proj")  # timm's unfused projections
REL_POS_TYPES = ("", "bias", "mlp", "mlp_swin", "decomposed")


class Attention(_AttentionBase):
    """Multi-head self-attention with one fused `qkv` projection (timm's names and layout).

    `causal=True` (the GPT's) lets token i attend to tokens <= i only; with a key/value cache the
    mask is aligned so that the newest token sees every cached one.

    timm's EVA layouts: `qkv_fused=False` gives separate `q_proj`, `k_proj`, `v_proj`; `k_bias=False`
    drops the key bias (BEiT, EVA: it adds the same score to every key of a query, which softmax
    ignores), the q and v biases then being `q_bias`, `v_bias` beside a bias-free `qkv`.
    `scale_norm` normalises the heads' output before `proj` (`norm`; EVA-CLIP's inner LayerNorm).
    `rope_half=False` takes rotary tables of interleaved pairs (EVA's; vit.position.rope_table).
    `num_kv_heads` < num_heads is grouped-query attention (timm's AttentionRope, Sapiens2): `k_proj`
    and `v_proj` give num_kv_heads heads, each read by num_heads // num_kv_heads query heads in a row.
    `diff=True`: differential attention (see _AttentionBase), `depth` the block's number.

    `rel_pos_type` adds learned relative positions to the scores, for tokens on a `grid` after
    `num_prefix_tokens` (vit.position): "bias" and "mlp" / "mlp_swin" are timm's RelPosBias and
    RelPosMlp (`rel_pos`, hidden width `rel_pos_dim`), "decomposed" SAM's `rel_pos_h`, `rel_pos_w`
    read by q (no prefix tokens). The bias joins `attn_mask`, so the fused path stays fused.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        qkv_bias: bool = True,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
        qk_norm: bool = False,
        norm: str = "layernorm",
        norm_eps: float = 1e-6,
        causal: bool = False,
        qkv_fused: bool = True,
        k_bias: bool = True,
        scale_norm: bool = False,
        rope_half: bool = True,
        proj_bias: bool = True,
        diff: bool = False,
        depth: int = 0,
        rel_pos_type: str = "",
        grid: tuple[int, int] | None = None,
        num_prefix_tokens: int = 0,
        rel_pos_dim: int = 128,
        num_kv_heads: int | None = None,
    ) -> None:
        num_kv_heads = num_kv_heads or num_heads
        if num_heads % num_kv_heads or (num_kv_heads != num_heads and (qkv_fused or diff)):
            raise ValueError(f"num_kv_heads {num_kv_heads} must divide num_heads {num_heads}; fewer than num_heads "
                             "needs qkv_fused=False and no diff")  # fmt: skip
        kv_dim = dim // num_heads * num_kv_heads
        if qkv_fused:
            proj = {"qkv": nn.Linear(dim, dim * 3, bias=qkv_bias and k_bias)}
        else:
            widths = {"q_proj": dim, "k_proj": kv_dim, "v_proj": kv_dim}
            proj = {n: nn.Linear(dim, widths[n], bias=qkv_bias and (n != "k_proj" or k_bias)) for n in QKV_NAMES}
        super().__init__(
            dim, num_heads, attn_drop, proj_drop, qk_norm, norm, norm_eps, proj_bias, diff=diff, depth=depth, **proj
        )  # fmt: skip
        self.num_kv_heads = num_kv_heads
        self.causal = causal
        self.rope_half = rope_half
        separate = qkv_fused and qkv_bias and not k_bias
        self.q_bias = nn.Parameter(torch.zeros(dim)) if separate else None
        self.v_bias = nn.Parameter(torch.zeros(dim)) if separate else None
        self.norm = make_norm(norm, dim, norm_eps) if scale_norm else nn.Identity()
        if rel_pos_type and grid is None:
            raise ValueError(f"rel_pos_type={rel_pos_type!r} needs the token grid")
        self.grid = grid
        self.rel_pos = None
        if rel_pos_type == "bias":
            self.rel_pos = RelPosBias(grid, num_heads, num_prefix_tokens)
        elif rel_pos_type in ("mlp", "mlp_swin"):
            mode = "swin" if rel_pos_type == "mlp_swin" else "cr"
            self.rel_pos = RelPosMlp(grid, num_heads, rel_pos_dim, num_prefix_tokens, mode)
        elif rel_pos_type == "decomposed":
            if num_prefix_tokens:
                raise ValueError("decomposed relative positions are for patch tokens only, no prefix tokens")
            self.rel_pos_h = nn.Parameter(torch.zeros(2 * grid[0] - 1, self.head_dim))
            self.rel_pos_w = nn.Parameter(torch.zeros(2 * grid[1] - 1, self.head_dim))
        elif rel_pos_type:
            raise ValueError(f"unknown rel_pos_type {rel_pos_type!r}; expected one of {REL_POS_TYPES}")
        self.decomposed = rel_pos_type == "decomposed"

    def inner_norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x)

    def position_bias(self, q: torch.Tensor, grid: tuple[int, int] | None = None) -> torch.Tensor | None:
        grid = self.grid if grid is None else grid
        if self.rel_pos is not None:
            return self.rel_pos.get_bias(grid).to(q.dtype)
        if self.decomposed:
            return decomposed_rel_pos_bias(q, self.rel_pos_h, self.rel_pos_w, grid)
        return None

    def _qkv(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, N, dim) -> (B, N, 3 * dim): q, k, v side by side, whichever the layout."""
        if not hasattr(self, "qkv"):
            return torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        if self.q_bias is None:
            return self.qkv(x)
        return F.linear(x, self.qkv.weight, torch.cat([self.q_bias, torch.zeros_like(self.q_bias), self.v_bias]))

    def forward(
        self,
        x: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        kv_cache: KVCache | None = None,
        num_queries: int | None = None,
        return_attn: bool = False,
        grid: tuple[int, int] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """(B, N, dim) -> (B, N, dim), and the (B, heads, N, N) weights with `return_attn=True`.

        `attn_mask` follows SDPA (boolean True = may attend, or additive floats).
        `rope`: (cos, sin) tables (vit.position) for the last len(cos) tokens of x, (N, head_dim) or
        per image and/or head (B | 1, heads | 1, N, head_dim); q and k are rotated (after qk-norm,
        before caching), earlier (prefix) tokens are not.
        `kv_cache`: x holds only new tokens; they attend to the cached ones too, and are cached.
        `num_queries=n`: only the first n tokens query (keys and values are still every token), so
        the output is (B, n, dim): for a classifier that reads only the CLS token. Not with masks.
        `grid`: the patch grid of the tokens after the prefix, for relative positions; None: the built one.
        """
        x, attn = self.self_attention(self._qkv(x), attn_mask, rope, kv_cache, num_queries, return_attn, grid)
        x = self.proj_drop(self.proj(self.norm(x)))
        return (x, attn) if return_attn else x


@torch.no_grad()
def mimetic_init_(attn: Attention, qk: tuple[float, float] = (0.7, 0.7), vo: tuple[float, float] = (0.4, 0.4)) -> None:
    """Initialise a self-attention layer so that, as in trained ViTs, each head's W_q W_k^T is near
    a scaled identity (tokens attend to themselves and to tokens with similar positions: local,
    convolution-like maps at step 0) and W_v W_proj near minus one (Trockman & Kolter, "Mimetic
    Initialization of Self-Attention Layers", ICML 2023, where ViTs trained with AdamW on small
    datasets learned faster; with Muon on CIFAR-10 it did not: benchmarks/budget.md).

    Per head, W_q W_k^T is the best rank-head_dim factorisation of a Z + b I (Z with N(0, 1/dim)
    entries, (a, b) = `qk`); W_v W_proj is a factorisation of a Z' - b' I ((a', b') = `vo`). The
    biases are zeroed. Shapes and parameter names do not change: only the starting point does."""
    dim = attn.proj.in_features
    if not hasattr(attn, "qkv") or attn.q_bias is not None or attn.qkv.in_features != dim:
        raise ValueError("mimetic init needs a width-preserving attention with one biased or bias-free qkv")
    eye = torch.eye(dim)

    def factors(a: float, b: float, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """L (dim, rank), R (rank, dim) with L @ R the best rank-`rank` approximation of a Z + b I."""
        u, s, vh = torch.linalg.svd(a * torch.randn(dim, dim) / dim**0.5 + b * eye)
        root = s[:rank].sqrt()
        return u[:, :rank] * root, root[:, None] * vh[:rank]

    w = attn.qkv.weight  # (3 dim, dim): q, k, v rows; nn.Linear computes x @ w.T
    for h in range(attn.num_heads):
        left, right = factors(*qk, attn.head_dim)  # q = x @ left, k = x @ right.T: q k^T = x (aZ + bI) x'^T
        rows = slice(h * attn.head_dim, (h + 1) * attn.head_dim)
        w[:dim][rows] = left.T.to(w)
        w[dim : 2 * dim][rows] = right.to(w)
    left, right = factors(vo[0], -vo[1], dim)  # v = x @ left, out = v @ right: W_v W_proj = a Z' - b' I
    w[2 * dim :] = left.T.to(w)
    attn.proj.weight.copy_(right.T)
    for bias in (attn.qkv.bias, attn.proj.bias):
        if bias is not None:
            bias.zero_()


class CrossAttention(_AttentionBase):
    """Queries from x, keys and values from another sequence (`context`, of width `context_dim`):
    separate `q` and `kv` projections, timm's names. Used by the attention-pool head."""

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        context_dim: int | None = None,
        qkv_bias: bool = True,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
        qk_norm: bool = False,
        norm: str = "layernorm",
        norm_eps: float = 1e-6,
    ) -> None:
        q, kv = nn.Linear(dim, dim, bias=qkv_bias), nn.Linear(context_dim or dim, dim * 2, bias=qkv_bias)
        super().__init__(dim, num_heads, attn_drop, proj_drop, qk_norm, norm, norm_eps, q=q, kv=kv)

    def forward(
        self,
        x: torch.Tensor,
        context: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        return_attn: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x (B, N, dim) attends to context (B, M, context_dim): (B, N, dim), and the (B, heads, N, M)
        weights with `return_attn=True`. `attn_mask` (B or 1, 1, N, M) follows SDPA."""
        B, M = context.shape[:2]
        kv = self.kv(context).reshape(B, M, 2, self.num_heads, self.head_dim)
        k, v = (t.transpose(1, 2) for t in kv.unbind(2))
        q, k = self.q_norm(self._heads(self.q(x))), self.k_norm(k)
        x, attn = self.attend(q, k, v, attn_mask, return_attn=return_attn)
        return (x, attn) if return_attn else x


class AttentionPoolLatent(CrossAttention):
    """Multihead attention pooling (big_vision's MAP head; SigLIP's, timm's `global_pool="map"`):
    a learned query (`latent`) cross-attends to the tokens, then a residual MLP:
    y = proj(attn(latent, x)); y = y + mlp(norm(y)). Returns (B, dim). timm's parameter names."""

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        qk_norm: bool = False,
        norm: str = "layernorm",
        norm_eps: float = 1e-6,
        act: str = "gelu",
    ) -> None:
        super().__init__(dim, num_heads, qkv_bias=qkv_bias, qk_norm=qk_norm, norm=norm, norm_eps=norm_eps)
        self.latent = nn.Parameter(torch.zeros(1, 1, dim))
        nn.init.trunc_normal_(self.latent, std=dim**-0.5)
        self.norm = make_norm(norm, dim, norm_eps)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), act=act)  # a plain MLP whatever the blocks use, as timm
        self._recorded: list[torch.Tensor] | None = None

    def forward(
        self, x: torch.Tensor, return_attn: bool = False, attn_mask: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Tokens (B, N, dim) -> pooled (B, dim); with `return_attn`, also the query's (B, heads, 1, N) weights.
        `attn_mask` (B or 1, 1, 1, N) follows SDPA: padding tokens kept out of the pool (NaFlexVit)."""
        record = self._recorded is not None
        out = super().forward(self.latent.expand(x.shape[0], -1, -1), x, attn_mask, return_attn=return_attn or record)
        y, attn = out if return_attn or record else (out, None)
        if self._recorded is not None:
            self._recorded.append(attn)
        y = (y + self.mlp(self.norm(y)))[:, 0]
        return (y, attn) if return_attn else y

    @contextlib.contextmanager
    def recording(self) -> Iterator[list[torch.Tensor]]:
        """While open, each call also appends its query's weights (B, heads, 1, N) to the list it
        yields, computed explicitly: how attention rollout reads a MAP-pooled model, whichever
        family's pooling called the head."""
        self._recorded = []
        try:
            yield self._recorded
        finally:
            self._recorded = None


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
    """fc1 -> GELU (or `act`) -> fc2, the transformer feed-forward layer. `norm` (a make_norm kind)
    normalises the hidden layer before fc2 (timm's `norm_layer`, NormFormer's; EVA's scale_mlp).
    `bias=False`: fc1 and fc2 without biases (timm's `proj_bias`, AIMv2)."""

    def __init__(
        self, dim: int, hidden_dim: int, drop: float = 0.0, act: str = "gelu", norm: str | None = None,
        norm_eps: float = 1e-6, bias: bool = True,
    ) -> None:  # fmt: skip
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden_dim, bias=bias)
        self.act = make_act(act)
        self.drop1 = nn.Dropout(drop)
        self.norm = make_norm(norm, hidden_dim, norm_eps) if norm else nn.Identity()
        self.fc2 = nn.Linear(hidden_dim, dim, bias=bias)
        self.drop2 = nn.Dropout(drop)

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        """Everything before fc2: forward(x) is output(hidden(x))."""
        return self.norm(self.drop1(self.act(self.fc1(x))))

    def output(self, h: torch.Tensor) -> torch.Tensor:
        return self.drop2(self.fc2(h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output(self.hidden(x))


class SwiGLU(nn.Module):
    """fc2(SiLU(gate) * value): the gated feed-forward layer of PaLM and LLaMA (Shazeer 2020).

    fc1 computes value and gate in one matmul (first half value, second half gate). Three
    dim x hidden matrices instead of two, so `make_mlp` gives it 2/3 of the GELU MLP's hidden
    width to keep the parameter count (and FLOPs) about the same. `gate_first=True` is timm's
    packed layout (`GluMlp`, `SwiGLUPacked`: the first half is the gate); `split=True` is timm's
    `SwiGLU`, gate and value in two matrices `fc1_g`, `fc1_x`. `norm`, `bias`: as in Mlp.
    """

    def __init__(
        self, dim: int, hidden_dim: int, drop: float = 0.0, act: str = "silu", gate_first: bool = False,
        split: bool = False, norm: str | None = None, norm_eps: float = 1e-6, bias: bool = True,
    ) -> None:  # fmt: skip
        super().__init__()
        self.gate_first = gate_first
        if split:
            self.fc1_g, self.fc1_x = nn.Linear(dim, hidden_dim, bias=bias), nn.Linear(dim, hidden_dim, bias=bias)
        else:
            self.fc1 = nn.Linear(dim, 2 * hidden_dim, bias=bias)
        self.act = make_act(act)
        self.drop1 = nn.Dropout(drop)
        self.norm = make_norm(norm, hidden_dim, norm_eps) if norm else nn.Identity()
        self.fc2 = nn.Linear(hidden_dim, dim, bias=bias)
        self.drop2 = nn.Dropout(drop)

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        """Everything before fc2: forward(x) is output(hidden(x))."""
        if hasattr(self, "fc1_g"):
            value, gate = self.fc1_x(x), self.fc1_g(x)
        else:
            value, gate = self.fc1(x).chunk(2, dim=-1)
            if self.gate_first:
                value, gate = gate, value
        return self.norm(self.drop1(self.act(gate) * value))

    def output(self, h: torch.Tensor) -> torch.Tensor:
        return self.drop2(self.fc2(h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output(self.hidden(x))


def swiglu_hidden_dim(mlp_hidden_dim: int, multiple_of: int = 8) -> int:
    """2/3 of a GELU MLP's hidden width, to the nearest multiple of 8: 8/3 x width for mlp_ratio 4."""
    return max(multiple_of, multiple_of * round(2 * mlp_hidden_dim / 3 / multiple_of))


class MoE(nn.Module):
    """Mixture-of-experts feed-forward layer: E expert MLPs, each token processed by its top-k.

    Why: the parameter count grows with E while each token still costs k MLPs (Shazeer et al.
    2017, GShard, Switch Transformer, Mixtral).

    Routing: a linear router gives every token a softmax over the experts; the token goes to its
    k most probable experts and their outputs are summed, weighted by those probabilities,
    renormalised over the k chosen when k > 1 (GShard, Mixtral) and left as they are when k = 1
    (Switch), so that the router still gets a gradient from the task loss.

    Load balancing: left alone, the router sends most tokens to the few experts that got ahead
    early. Every forward stores `self.aux_loss` = E * sum_i f_i * P_i (Switch Transformer, eq. 4),
    with f_i the fraction of the N*k routing slots that went to expert i and P_i the mean router
    probability of expert i. It is 1 for uniform routing and grows to E when every token goes to
    one expert (with P following f it is E * sum f_i^2 >= 1, equality iff f is uniform). The model's
    `aux_loss()` sums these and the training step adds `aux_loss_weight * aux` (0.01 in Switch).

    Capacity: `capacity_factor=None` is dropless: each expert takes every token routed to it (one
    device, variable-size batches per expert, nothing lost). With a factor c, expert i takes at
    most ceil(c * N * k / E) slots, first come (token order) first served; the overflow is dropped,
    contributes zero and the token carries on through the residual connection. That fixed size is
    what accelerator implementations need; `dropped_fraction` reports what it cost on the last batch.
    """

    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        num_experts: int,
        top_k: int = 2,
        capacity_factor: float | None = None,
        kind: str = "gelu",
        drop: float = 0.0,
        act: str | None = None,
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be between 1 and num_experts={num_experts}, got {top_k}")
        if capacity_factor is not None and capacity_factor <= 0:
            raise ValueError(f"capacity_factor must be positive (or None for dropless), got {capacity_factor}")
        self.num_experts, self.top_k, self.capacity_factor = num_experts, top_k, capacity_factor
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.experts = nn.ModuleList([make_mlp(kind, dim, hidden_dim, drop, act=act) for _ in range(num_experts)])
        self.aux_loss: torch.Tensor | None = None
        self.dropped_fraction = 0.0

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Tokens (N, dim) -> (expert ids (N, k), their weights (N, k), router probabilities (N, E))."""
        probs = self.router(x).float().softmax(dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.top_k > 1:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights, probs

    def capacity(self, num_tokens: int) -> int | None:
        """Routing slots each expert accepts for a batch of num_tokens tokens; None: no limit."""
        if self.capacity_factor is None:
            return None
        return math.ceil(self.capacity_factor * num_tokens * self.top_k / self.num_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        experts, weights, probs = self.route(x)
        slots_per_expert = torch.bincount(experts.flatten(), minlength=self.num_experts).float()
        self.aux_loss = self.num_experts * (slots_per_expert / experts.numel() * probs.mean(dim=0)).sum()

        token_of_slot = torch.arange(x.shape[0], device=x.device).repeat_interleave(self.top_k)
        expert_of_slot, weight_of_slot = experts.flatten(), weights.flatten().to(x.dtype)
        capacity, dropped = self.capacity(x.shape[0]), 0
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            slots = (expert_of_slot == i).nonzero().squeeze(1)  # in token order
            if capacity is not None and len(slots) > capacity:
                dropped += len(slots) - capacity
                slots = slots[:capacity]
            if len(slots) == 0:
                continue
            tokens = token_of_slot[slots]
            out = out.index_add(0, tokens, expert(x[tokens]) * weight_of_slot[slots, None])
        self.dropped_fraction = dropped / experts.numel()
        return out.reshape(shape)


def make_mlp(
    kind: str,
    dim: int,
    hidden_dim: int,
    drop: float = 0.0,
    num_experts: int = 1,
    top_k: int = 2,
    capacity_factor: float | None = None,
    act: str | None = None,
    norm: str | None = None,
    norm_eps: float = 1e-6,
    align_to: int = 0,
    bias: bool = True,
) -> nn.Module:
    """The feed-forward layer by name: "gelu" (Mlp, timm's; GELU unless `act` names another),
    "swiglu" (SwiGLU at 2/3 of hidden_dim, the same parameter count) or "glu" (timm's packed
    GluMlp in a ViT: fc1 is hidden_dim wide, its first half the gate; GELU unless `act`: with "silu"
    it is timm's SwiGLUPacked). timm's EVA SwiGLUs have hidden_dim gate and hidden_dim value
    channels: "swiglu_packed" in one fc1 (gate first), "swiglu_split" in fc1_g and fc1_x, hidden_dim
    rounded up to a multiple of `align_to`. `norm`: a norm before fc2 (not for "swiglu"/"glu");
    `bias=False`: no biases in its linears (dense layers only).
    num_experts > 1 makes it a MoE of such MLPs; with num_experts = 1 it is the dense layer itself."""
    if num_experts > 1:
        return MoE(dim, hidden_dim, num_experts, top_k, capacity_factor, kind, drop, act)
    if kind == "gelu":
        return Mlp(dim, hidden_dim, drop, act or "gelu", norm, norm_eps, bias)
    if kind == "swiglu":
        return SwiGLU(dim, swiglu_hidden_dim(hidden_dim), drop, act or "silu", bias=bias)
    if kind == "glu":
        return SwiGLU(dim, hidden_dim // 2, drop, act or "gelu", gate_first=True, bias=bias)
    if kind == "swiglu_packed":
        return SwiGLU(dim, hidden_dim, drop, act or "silu", gate_first=True, norm=norm, norm_eps=norm_eps, bias=bias)
    if kind == "swiglu_split":
        hidden_dim += -hidden_dim % align_to if align_to else 0
        return SwiGLU(dim, hidden_dim, drop, act or "silu", split=True, norm=norm, norm_eps=norm_eps, bias=bias)
    raise ValueError(f"unknown mlp {kind!r}; expected one of {MLP_KINDS}")


MLP_KINDS = ("gelu", "swiglu", "glu", "swiglu_packed", "swiglu_split")


def moe_aux_loss(model: nn.Module) -> torch.Tensor:
    """Sum of the load-balancing losses every MoE layer of `model` stored in its last forward;
    a zero tensor when the model has none (so a training step can always add it)."""
    losses = [m.aux_loss for m in model.modules() if isinstance(m, MoE) and m.aux_loss is not None]
    return torch.stack(losses).sum() if losses else torch.zeros(())


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


@dataclass
class BlockConfig:
    """The options of the one transformer Block, listed once. ViTConfig and GPTConfig inherit them,
    so a model's kwargs stay flat with timm's names (`create_model(name, embed_dim=..., qk_norm=True)`)
    and the model hands its own config to every Block.

    Defaults are the ViT paper's / timm's block: norm "layernorm" | "rmsnorm" (eps norm_eps); mlp
    "gelu" | "swiglu" (hidden 2/3 x mlp_ratio x width: the same parameter count) | "glu" (timm's
    packed layout) | "swiglu_packed" | "swiglu_split" (timm's EVA layouts; see make_mlp), with
    act_layer "gelu" | "gelu_tanh" | "quick_gelu" | "silu"; num_experts > 1 for a mixture-of-experts
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
    attn_layer: str = "attn"  # "diff": differential attention (timm's DiffAttention; see _AttentionBase)
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
        if self.attn_layer not in ("attn", "diff"):
            raise ValueError(f"attn_layer must be 'attn' or 'diff' (differential attention), got {self.attn_layer!r}")
        if self.block_fn == "parallel_scaling" and (
            self.mlp != "gelu" or self.num_experts > 1 or self.scale_attn_inner or self.scale_mlp or not self.qkv_fused
        ):
            raise ValueError("block_fn='parallel_scaling' has one fused in_proj and a plain MLP (mlp='gelu', no MoE, "
                             "qkv_fused, no scale_attn_inner / scale_mlp)")  # fmt: skip
        if self.post_norm and self.block_fn != "block":
            raise ValueError("post_norm is an option of block_fn='block'")
        if self.layer_scale not in ("ls", "gamma"):
            raise ValueError(f"layer_scale must be 'ls' (timm's ViT) or 'gamma' (timm's EVA), got {self.layer_scale!r}")
        if self.mlp not in MLP_KINDS:
            raise ValueError(f"unknown mlp {self.mlp!r}; expected one of {MLP_KINDS}")
        if self.rel_pos_type not in REL_POS_TYPES:
            raise ValueError(f"unknown rel_pos_type {self.rel_pos_type!r}; expected one of {REL_POS_TYPES}")
        if (self.rel_pos_type or self.window_size) and (self.block_fn != "block" or self.attn_layer != "attn"):
            raise ValueError("rel_pos_type and window_size are options of block_fn='block' with attn_layer='attn'")


BLOCK_FNS = ("block", "parallel_scaling", "parallel_things")


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
    (timm's EVA names) and ls1, ls2 stay identities. `post_norm=True` is timm's ResPostBlock,
    x = x + drop_path(norm1(attn(x))), x = x + drop_path(norm2(mlp(x))), with init_values the norms'
    initial scale instead of a LayerScale. `attn_only_layer_scale`: ls2 / gamma_2 stay off (Sapiens2).

    `grid` (rows, columns) is the patch grid of the tokens after `num_prefix_tokens`, which relative
    positions and windows need. `window_size` > 0 (SAM's, ViTDet's): the attention runs within each
    window_size x window_size window of the grid, the normed grid zero-padded on the bottom and right
    to whole windows (padding tokens are keys too, as in SAM); its weights are then per window,
    (B x windows, heads, window_size^2, window_size^2).
    """

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
        if c.window_size and (grid is None or num_prefix_tokens):
            raise ValueError("window_size needs the patch grid and no prefix tokens")
        self.post_norm = c.post_norm
        self.grid, self.window_size = grid, c.window_size
        self.norm1 = make_norm(c.norm, dim, c.norm_eps)
        attn_grid = (c.window_size, c.window_size) if c.window_size else grid
        self.attn = _attention(c, causal, depth, attn_grid, num_prefix_tokens)
        ls_modules = c.init_values and c.layer_scale == "ls" and not c.post_norm
        gammas = c.init_values is not None and c.layer_scale == "gamma" and not c.post_norm  # timm's EVA: also at 0
        self.ls1 = LayerScale(dim, c.init_values) if ls_modules else nn.Identity()
        self.gamma_1 = nn.Parameter(torch.full((dim,), float(c.init_values))) if gammas else None
        self.drop_path1 = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.norm2 = make_norm(c.norm, dim, c.norm_eps)
        self.mlp = _mlp(c)
        mlp_ls = not c.attn_only_layer_scale
        self.ls2 = LayerScale(dim, c.init_values) if ls_modules and mlp_ls else nn.Identity()
        self.gamma_2 = nn.Parameter(torch.full((dim,), float(c.init_values))) if gammas and mlp_ls else None
        self.drop_path2 = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        if c.post_norm and c.init_values is not None:
            with torch.no_grad():
                self.norm1.weight.fill_(c.init_values)
                self.norm2.weight.fill_(c.init_values)

    def forward(
        self,
        x: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        kv_cache: KVCache | None = None,
        num_queries: int | None = None,
        return_attn: bool = False,
        grid: tuple[int, int] | None = None,
        mean_from: int | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """`return_attn=True` also returns this block's attention weights, (B, heads, N, N).
        `num_queries=n` returns only the first n tokens, `block(x)[:, :n]` at a fraction of the cost.
        `mean_from=s` returns `block(x)[:, s:].mean(1)`, (B, dim), for average pooling straight after
        the block (`can_mean`): fc2, the LayerScale and the drop path are linear per image, so fc2
        runs once on the mean hidden state instead of on every token (a third of the MLP's work).
        `attn_mask`, `rope`, `kv_cache`: see Attention.forward (per window with window_size).
        `grid`: the tokens' patch grid when it is not the built one (windows, relative positions)."""
        if mean_from is not None and not self.can_mean():
            raise ValueError("mean_from needs a pre-norm block without windows, a dense MLP, no dropout after fc2")
        grid = self.grid if grid is None else grid
        y = x if self.post_norm else self.norm1(x)
        if self.window_size:
            if num_queries is not None or kv_cache is not None:
                raise ValueError("windowed attention takes neither num_queries nor a key/value cache")
            y, padded = window_partition(y, grid, self.window_size)
        y = self.attn(
            y, attn_mask=attn_mask, rope=rope, kv_cache=kv_cache, num_queries=num_queries, return_attn=return_attn,
            grid=None if self.window_size else grid,  # a window's grid is its own
        )  # fmt: skip
        y, attn = y if return_attn else (y, None)
        if self.window_size:
            y = window_unpartition(y, grid, padded, self.window_size)
        if num_queries is not None:
            x = x[:, :num_queries]
        if self.post_norm:
            x = x + self.drop_path1(self.norm1(y))
            x = x + self.drop_path2(self.norm2(self.mlp(x)))
            return (x, attn) if return_attn else x
        x = x + self.drop_path1(self.ls1(y) if self.gamma_1 is None else self.gamma_1 * y)
        if mean_from is not None:
            x = x[:, mean_from:]
            y = self.mlp.output(self.mlp.hidden(self.norm2(x)).mean(dim=1))
            x = x.mean(dim=1)
        else:
            y = self.mlp(self.norm2(x))
        x = x + self.drop_path2(self.ls2(y) if self.gamma_2 is None else self.gamma_2 * y)
        return (x, attn) if return_attn else x

    def can_mean(self) -> bool:
        """Whether forward takes `mean_from`: a pre-norm block without windows, a dense MLP, and no
        dropout after fc2 while training (a per-token mask does not commute with the mean)."""
        mlp = self.mlp
        return (
            not self.post_norm and not self.window_size and isinstance(mlp, (Mlp, SwiGLU))
            and not (self.training and mlp.drop2.p > 0)
        )  # fmt: skip

    def grid_attention(self, attn: torch.Tensor, grid: tuple[int, int] | None = None) -> torch.Tensor:
        """forward's `return_attn` weights -> (B, heads, N, N) over the block's tokens: a windowed
        block's per-window weights placed on the patch grid (`window_attention_to_grid`)."""
        if not self.window_size:
            return attn
        return window_attention_to_grid(attn, self.grid if grid is None else grid, self.window_size)


def window_attention_to_grid(attn: torch.Tensor, grid: tuple[int, int], size: int) -> torch.Tensor:
    """A windowed block's weights (B x windows, heads, size^2, size^2), windows as window_partition lays
    them out -> (B, heads, H*W, H*W) over the grid's tokens: each token's weights on the tokens of its
    window, zero elsewhere. The padding's columns are dropped (a row keeps its weight on real tokens)."""
    h, w = grid
    rows, cols = (h + size - 1) // size, (w + size - 1) // size
    width, n, heads, device = cols * size, rows * size * cols * size, attn.shape[1], attn.device
    # each window's tokens as indices into the padded grid, row-major, windows row-major
    ys = torch.arange(rows, device=device)[:, None, None, None] * size + torch.arange(size, device=device)[:, None]
    xs = torch.arange(cols, device=device)[:, None, None] * size + torch.arange(size, device=device)
    index = (ys * width + xs).reshape(rows * cols, size * size)
    flat = (index[:, :, None] * n + index[:, None, :]).flatten()
    values = attn.unflatten(0, (-1, rows * cols)).transpose(1, 2).flatten(2)  # (B, heads, windows x size^4)
    full = attn.new_zeros(values.shape[0], heads, n * n).index_copy(2, flat, values).view(-1, heads, n, n)
    keep = (torch.arange(h, device=device)[:, None] * width + torch.arange(w, device=device)).flatten()
    return full[:, :, keep][:, :, :, keep]


def window_partition(x: torch.Tensor, grid: tuple[int, int], size: int) -> tuple[torch.Tensor, tuple[int, int]]:
    """Tokens (B, H*W, C) of a row-major grid -> (B x windows, size*size, C), the grid zero-padded on the
    bottom and right to whole windows, windows row-major; and the padded grid (timm's SAM's)."""
    (h, w), c = grid, x.shape[-1]
    # Windows down and across; ONNX's integer Div truncates, so an exported -(-h // size) would round down.
    rows, cols = (h + size - 1) // size, (w + size - 1) // size
    x = F.pad(x.view(-1, h, w, c), (0, 0, 0, cols * size - w, 0, rows * size - h))
    x = x.view(-1, rows, size, cols, size, c).transpose(2, 3)
    return x.reshape(-1, size * size, c), (rows * size, cols * size)


def window_unpartition(
    windows: torch.Tensor, grid: tuple[int, int], padded: tuple[int, int], size: int
) -> torch.Tensor:
    """window_partition's inverse: (B x windows, size*size, C) -> (B, H*W, C), the padding dropped."""
    (h, w), (hp, wp), c = grid, padded, windows.shape[-1]
    x = windows.view(-1, hp // size, wp // size, size, size, c).transpose(2, 3).reshape(-1, hp, wp, c)
    return x[:, :h, :w].reshape(-1, h * w, c)


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
            diff=c.attn_layer == "diff", depth=depth, proj=False, in_norm=make_norm(c.norm, dim, c.norm_eps),
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
        self,
        x: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        kv_cache: KVCache | None = None,
        num_queries: int | None = None,
        return_attn: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """As Block.forward."""
        h, qkv = self.in_proj(self.in_norm(x)).split(self.in_split, dim=-1)
        y, attn = self.self_attention(qkv, attn_mask, rope, kv_cache, num_queries, return_attn)
        if num_queries is not None:
            x, h = x[:, :num_queries], h[:, :num_queries]
        h = self.mlp_drop(self.mlp_act(h if self.mlp_bias is None else h + self.mlp_bias))
        if self.out_proj is not None:
            y = self.out_proj(torch.cat((y, h), dim=-1))
        else:
            y = self.attn_out_proj(y) + self.mlp_out_proj(h)
        x = x + self.drop_path(self.ls(y))
        return (x, attn) if return_attn else x

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
        self,
        x: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        kv_cache: KVCache | None = None,
        num_queries: int | None = None,
        return_attn: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """As Block.forward, without a key/value cache (each branch would need its own)."""
        if kv_cache is not None:
            raise ValueError("a ParallelThingsBlock keeps no key/value cache")
        outs, attns = [], []
        for b in self.attns:
            y = b.attn(b.norm(x), attn_mask=attn_mask, rope=rope, num_queries=num_queries, return_attn=return_attn)
            y, attn = y if return_attn else (y, None)
            outs.append(b.drop_path(b.ls(y)))
            attns.append(attn)
        x = (x if num_queries is None else x[:, :num_queries]) + torch.stack(outs).sum(dim=0)
        x = x + torch.stack([ffn(x) for ffn in self.ffns]).sum(dim=0)
        return (x, tuple(attns)) if return_attn else x

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
    """The block `config.block_fn` names: Block, ParallelScalingBlock or ParallelThingsBlock. `grid`,
    `num_prefix_tokens`: the tokens' patch grid after the prefix tokens (Block's relative positions, windows)."""
    if config.block_fn == "block":
        return Block(
            config, drop_path=drop_path, causal=causal, depth=depth, grid=grid, num_prefix_tokens=num_prefix_tokens
        )
    cls = {"parallel_scaling": ParallelScalingBlock, "parallel_things": ParallelThingsBlock}
    return cls[config.block_fn](config, drop_path=drop_path, causal=causal, depth=depth)


def set_fused_attn(model: nn.Module, enabled: bool) -> None:
    """Switch every attention layer in `model` between the fused (SDPA) and the explicit path."""
    for module in model.modules():
        if isinstance(module, _AttentionBase):
            module.fused_attn = enabled
