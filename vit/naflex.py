"""timm's NaFlexVit (`timm.models.naflexvit`): a ViT that takes images of any size and aspect ratio,
as batches of images or as padded sequences of patches (NaViT's packing, SigLIP 2's NaFlex), on the same
VisionTransformer and Block, with timm's parameter names.

What differs from a ViT is the embedding, timm's NaFlexEmbeds (`embeds`): a Linear over patches
flattened as (row, column, channel), positions stored on a grid (or one row and one column table,
NaViT's factorized ones) and resampled to each image's grid, the prefix tokens without positions. A
patch sequence comes with each patch's (row, column) and a mask of the real patches: the padding is
masked out of the attention and out of the pooling. timm's names are read from its model functions at
import, as vit.timm_args does for ViTs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vit.layers import ACTIVATIONS, AttentionPoolLatent, check_divisible
from vit.layers.patch import _pair
from vit.registry import register_timm_names
from vit.timm_args import record_timm_builder, timm_arg_names, timm_norm
from vit.vision_transformer import VisionTransformer, ViTConfig, _take_indices, rescale_block_outputs_

POS_EMBEDS = ("learned", "factorized", "none")


@dataclass
class NaFlexConfig(ViTConfig):
    """The ViT's options at timm's NaFlexVitCfg defaults (no CLS token, MAP pooling; fc_norm None: a norm
    after pooling for "avg" only), and the embedding's, under timm's names."""

    img_size: int | tuple[int, int] = 384  # only sizes the position grid, where pos_embed_grid_size is None
    global_pool: str = "map"
    class_token: bool = False
    posemb: str = "none"  # the ViT's table is off: the positions are the embedding's (pos_embed)
    embed_proj_type: str = "linear"  # "linear": a Linear over flattened patches; "conv": a Conv2d (images only)
    # "learned": a (1, H, W, D) table; "factorized": a row table plus a column table (NaViT); "none".
    pos_embed: str = "learned"
    pos_embed_grid_size: tuple[int, int] | None = (16, 16)  # the tables' grid; None: img_size // patch_size
    pos_embed_interp_mode: str = "bicubic"  # resampling of a "learned" table to another grid (F.interpolate)
    # Resample to a square of the grid's longer side, then keep the top-left rows and columns: a patch
    # keeps its position whatever the aspect ratio.
    pos_embed_ar_preserving: bool = False
    pos_embed_antialias: bool = True
    pos_embed_align_corners: bool = False
    attn_pool_num_heads: int | None = None  # global_pool="map": the head's heads; None: num_heads
    attn_pool_mlp_ratio: float | None = None  # and its MLP ratio; None: mlp_ratio
    fix_init: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.fc_norm is None:
            self.fc_norm = self.global_pool == "avg"
        if self.embed_proj_type not in ("linear", "conv"):
            raise ValueError(f"embed_proj_type must be 'linear' or 'conv', got {self.embed_proj_type!r}")
        if self.pos_embed not in POS_EMBEDS:
            raise ValueError(f"pos_embed must be one of {POS_EMBEDS}, got {self.pos_embed!r}")
        if self.pos_embed_grid_size is not None:
            self.pos_embed_grid_size = _pair(self.pos_embed_grid_size)
        vit_only = dict(posemb="none", distilled=False, no_embed_class=False, embed_norm=False, stem_channels=None,
                        stem_pool=False, backbone=None, rel_pos_type="", window_size=0,
                        shifted_patches=False)  # fmt: skip
        changed = [name for name, off in vit_only.items() if getattr(self, name) != off]
        if changed:
            raise ValueError(f"NaFlexVit's embedding has no {', '.join(changed)} (its positions: pos_embed)")


def patchify(images: torch.Tensor, patch_size: tuple[int, int]) -> torch.Tensor:
    """Images (B, C, H, W) -> patches (B, H/ph * W/pw, ph * pw * C), row-major over the grid, each
    flattened as (row, column, channel): NaFlex's layout (timm's batch_patchify)."""
    B, C, H, W = images.shape
    (ph, pw), (h, w) = patch_size, (H // patch_size[0], W // patch_size[1])
    return images.reshape(B, C, h, ph, w, pw).permute(0, 2, 4, 3, 5, 1).reshape(B, h * w, ph * pw * C)


def pack(
    images: list[torch.Tensor], patch_size: int | tuple[int, int] = 16, length: int | None = None
) -> dict[str, torch.Tensor]:
    """Images (C, H, W) of any sizes (multiples of the patch) as timm's NaFlex batch: "patches" (B,
    length, ph * pw * C), each image's in `patchify`'s layout then zeros; "patch_coord" (B, length, 2),
    each patch's (row, column); "patch_valid" (B, length), True for real patches. length: the longest's."""
    patch_size = _pair(patch_size)
    sequences = [patchify(image[None], patch_size)[0] for image in images]
    length = length or max(len(s) for s in sequences)
    batch = {
        "patches": sequences[0].new_zeros(len(images), length, sequences[0].shape[1]),
        "patch_coord": torch.zeros(len(images), length, 2, dtype=torch.long),
        "patch_valid": torch.zeros(len(images), length, dtype=torch.bool),
    }
    for b, (image, patches) in enumerate(zip(images, sequences, strict=True)):
        h, w = image.shape[1] // patch_size[0], image.shape[2] // patch_size[1]
        rows, columns = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        batch["patches"][b, : h * w] = patches
        batch["patch_coord"][b, : h * w] = torch.stack([rows, columns], dim=-1).reshape(-1, 2)
        batch["patch_valid"][b, : h * w] = True
    return batch


def padding_mask(
    patch_valid: torch.Tensor | None, num_prefix_tokens: int, dtype: torch.dtype, num_queries: int | None = None
) -> torch.Tensor | None:
    """The additive attention mask that keeps padding out (timm's create_attention_mask): (B, 1, N, N),
    a pair allowed where both tokens are real; or, with `num_queries`, (B, 1, num_queries, N) by the
    keys alone. Prefix tokens are real. finfo.min rather than -inf: a padding query then sees every key
    equally instead of giving NaN, which the next block's values would carry into the real tokens."""
    if patch_valid is None:
        return None
    valid = F.pad(patch_valid.bool(), (num_prefix_tokens, 0), value=True)
    if num_queries is None:
        allowed = (valid[:, :, None] & valid[:, None, :])[:, None]
    else:
        allowed = valid[:, None, None, :].expand(-1, 1, num_queries, -1)
    return torch.zeros(allowed.shape, dtype=dtype, device=valid.device).masked_fill_(~allowed, torch.finfo(dtype).min)


class NaFlexEmbeds(nn.Module):
    """timm's NaFlexEmbeds, its names: patches -> `proj` -> + positions (`pos_embed`, or `pos_embed_y` +
    `pos_embed_x`) for each image's grid -> [CLS (`cls_token`), registers (`reg_token`)] in front."""

    def __init__(self, c: NaFlexConfig) -> None:
        super().__init__()
        self.patch_size, self.dynamic_img_pad = _pair(c.patch_size), c.dynamic_img_pad
        self.interp = dict(mode=c.pos_embed_interp_mode, align_corners=c.pos_embed_align_corners,
                           antialias=c.pos_embed_antialias)  # fmt: skip
        self.ar_preserving = c.pos_embed_ar_preserving
        self.cls_token = nn.Parameter(torch.empty(1, 1, c.embed_dim)) if c.class_token else None
        self.reg_token = nn.Parameter(torch.empty(1, c.reg_tokens, c.embed_dim)) if c.reg_tokens else None
        ph, pw = self.patch_size
        self.linear = c.embed_proj_type == "linear"
        if self.linear:
            self.proj = nn.Linear(ph * pw * c.in_chans, c.embed_dim, bias=not c.pre_norm)
        else:
            self.proj = nn.Conv2d(c.in_chans, c.embed_dim, self.patch_size, stride=self.patch_size, bias=not c.pre_norm)
        grid = c.pos_embed_grid_size or tuple(s // p for s, p in zip(_pair(c.img_size), self.patch_size, strict=True))
        self.pos_embed = self.pos_embed_y = self.pos_embed_x = None
        if c.pos_embed == "learned":
            self.pos_embed = nn.Parameter(torch.empty(1, *grid, c.embed_dim))
        elif c.pos_embed == "factorized":
            self.pos_embed_y = nn.Parameter(torch.empty(1, grid[0], c.embed_dim))
            self.pos_embed_x = nn.Parameter(torch.empty(1, grid[1], c.embed_dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """timm's: prefix tokens normal(1e-6), positions normal(0.02); `proj` is the model's to initialise."""
        for token in (self.cls_token, self.reg_token):
            if token is not None:
                nn.init.normal_(token, std=1e-6)
        for table in (self.pos_embed, self.pos_embed_y, self.pos_embed_x):
            if table is not None:
                nn.init.normal_(table, std=0.02)

    def dynamic_feat_size(self, img_size: tuple[int, int]) -> tuple[int, int]:
        """The patch grid of an image size (rounded up with dynamic_img_pad; timm's name)."""
        (h, w), (ph, pw) = img_size, self.patch_size
        return (-(-h // ph), -(-w // pw)) if self.dynamic_img_pad else (h // ph, w // pw)

    def positions(self, grid: tuple[int, int], dtype: torch.dtype) -> torch.Tensor | None:
        """The positions of a (rows, columns) grid's patches, row-major: (1, rows x columns, D), the
        tables resampled where their grid differs (timm's); None without positions."""
        h, w = grid
        size = (max(grid), max(grid)) if self.ar_preserving else (h, w)
        if self.pos_embed is not None:
            table = self.pos_embed
            if tuple(table.shape[1:3]) != (h, w):
                table = F.interpolate(table.permute(0, 3, 1, 2).float(), size=size, **self.interp)
                table = table[:, :, :h, :w].permute(0, 2, 3, 1)
            return table.reshape(1, h * w, -1).to(dtype)
        if self.pos_embed_y is not None:
            rows = _resample_1d(self.pos_embed_y, size[0], dtype)[:, :h]
            columns = _resample_1d(self.pos_embed_x, size[1], dtype)[:, :w]
            return (rows[:, :, None] + columns[:, None]).flatten(1, 2)
        return None

    def forward(self, x: torch.Tensor, patch_coord: torch.Tensor | None = None) -> torch.Tensor:
        """Images (B, C, H, W), or patches (B, N, ph * pw * C) in `patchify`'s layout with their (row,
        column) on their image's grid, `patch_coord` (B, N, 2) -> tokens (B, prefix + N, D)."""
        if patch_coord is None:
            if self.dynamic_img_pad:  # zeros on the bottom and right to whole patches, as timm
                (ph, pw), (h, w) = self.patch_size, x.shape[-2:]
                x = F.pad(x, (0, (pw - w % pw) % pw, 0, (ph - h % ph) % ph))
            grid = self.dynamic_feat_size(tuple(x.shape[-2:]))
            if self.linear:
                check_divisible(tuple(x.shape[-2:]), self.patch_size)
                x = self.proj(patchify(x, self.patch_size))
            else:
                x = self.proj(x).flatten(2).transpose(1, 2)
            pos = self.positions(grid, x.dtype)
        else:
            if not self.linear:
                raise ValueError("patch sequences need embed_proj_type='linear'; a conv embedding takes images")
            x = self.proj(x.flatten(2))
            pos = self._sequence_positions(patch_coord, x)
        x = x if pos is None else x + pos
        prefix = [t.expand(x.shape[0], -1, -1) for t in (self.cls_token, self.reg_token) if t is not None]
        return torch.cat([*prefix, x], dim=1) if prefix else x

    def _sequence_positions(self, patch_coord: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
        """Each image's positions for the grid its coordinates span, on its first rows x columns tokens:
        timm places them by order, not by coordinate (its collator puts the real patches first,
        row-major, then the padding)."""
        if self.pos_embed is None and self.pos_embed_y is None:
            return None
        if torch.compiler.is_exporting():  # the loop below runs over the coordinates' values, which a graph cannot
            return self.token_positions(patch_coord, x.shape[1], x.dtype)
        grids = [tuple(g) for g in (patch_coord.amax(dim=1) + 1).tolist()]
        out = x.new_zeros(x.shape)
        for grid in dict.fromkeys(grids):  # each grid resampled once
            n = min(x.shape[1], grid[0] * grid[1])
            images = [b for b, g in enumerate(grids) if g == grid]
            out[images, :n] = self.positions(grid, x.dtype)[:, :n]
        return out

    def token_positions(self, patch_coord: torch.Tensor, length: int, dtype: torch.dtype) -> torch.Tensor:
        """_sequence_positions in tensor operations only, so one exported graph serves every grid: each
        token's position is its image's table entries weighted by `interpolation_weights` for its row and
        column, (B, length, D). Costs length x the table's entries x D, more than resampling per grid."""
        grid = patch_coord.amax(dim=1) + 1  # (B, 2): each image's rows and columns
        h, w = grid[:, :1], grid[:, 1:]
        token = torch.arange(length, device=patch_coord.device)
        rows, cols = token // w, token % w  # (B, length): row-major order, as _sequence_positions places them
        size_h, size_w = (torch.maximum(h, w),) * 2 if self.ar_preserving else (h, w)
        if self.pos_embed is not None:
            table = self.pos_embed[0].float()  # (rows, columns, D)
            stored = (h == table.shape[0]) & (w == table.shape[1])  # used as it is (positions()), square or not
            wy = interpolation_weights(rows, torch.where(stored, h, size_h), table.shape[0], **self.interp)
            wx = interpolation_weights(cols, torch.where(stored, w, size_w), table.shape[1], **self.interp)
            pos = torch.einsum("bnh,bnw,hwd->bnd", wy, wx, table)
        else:  # factorized: _resample_1d's linear interpolation of each table
            linear = dict(mode="linear", align_corners=False, antialias=False)
            wy = interpolation_weights(rows, size_h, self.pos_embed_y.shape[1], **linear)
            wx = interpolation_weights(cols, size_w, self.pos_embed_x.shape[1], **linear)
            pos = wy @ self.pos_embed_y[0].float() + wx @ self.pos_embed_x[0].float()
        return (pos * (token < h * w)[..., None]).to(dtype)  # tokens past the grid: none, as in _sequence_positions


def interpolation_weights(
    index: torch.Tensor, out_len: torch.Tensor, in_len: int, mode: str, align_corners: bool, antialias: bool
) -> torch.Tensor:
    """The weights (..., in_len) with which F.interpolate(table, out_len, mode, ...) makes its entries
    `index` from a table of in_len entries: sum_j w[..., j] table[j], as PyTorch's CPU kernels compute them.
    `out_len` broadcasts against `index`, so every token may have its own image's length. mode: "linear" /
    "bilinear" (per axis) or "bicubic"; antialias: PyTorch's (PIL's) kernels, widened when downsampling."""
    if mode not in ("linear", "bilinear", "bicubic"):
        raise ValueError(f"positions resampled with mode={mode!r} have no per-token form; linear, bilinear, bicubic do")
    out_len, pos = out_len.float(), index.float()[..., None]
    j = torch.arange(in_len, dtype=torch.float32, device=index.device)
    if align_corners:
        scale = torch.where(out_len > 1, (in_len - 1) / (out_len - 1).clamp(min=1), 0.0)[..., None]
    else:
        scale = (in_len / out_len)[..., None]
    cubic = mode == "bicubic"
    if antialias:  # the kernel stretched by the scale when downsampling, the weights normalised
        stretch = scale.clamp(min=1.0)
        support = (2.0 if cubic else 1.0) * stretch
        center = scale * (pos + 0.5)
        inside = (j >= (center - support + 0.5).floor()) & (j < (center + support + 0.5).floor())
        weights = _kernel((j - center + 0.5) / stretch, cubic, a=-0.5) * inside
        total = weights.sum(dim=-1, keepdim=True)
        return weights / torch.where(total == 0, 1.0, total)  # none for entries past the table, as PyTorch
    src = scale * pos if align_corners else scale * (pos + 0.5) - 0.5
    if not cubic:  # two taps, the source clamped to the first entry
        src = src.clamp(min=0.0)
        left = src.floor()
        frac = src - left
        return (1 - frac) * (j == left) + frac * (j == (left + 1).clamp(max=in_len - 1))
    left, weights = src.floor(), torch.zeros_like(j)
    for k in (-1, 0, 1, 2):  # four taps; past the table's ends its edge entry is read (PyTorch's bounded access)
        weights = weights + _kernel(src - (left + k), True, a=-0.75) * (j == (left + k).clamp(0, in_len - 1))
    return weights


def _kernel(x: torch.Tensor, cubic: bool, a: float) -> torch.Tensor:
    """The interpolation filter at distance x: the triangle, or Keys' cubic convolution with parameter `a`."""
    x = x.abs()
    if not cubic:
        return (1 - x).clamp(min=0)
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return torch.where(x < 1, near, torch.where(x < 2, far, 0.0))


def _resample_1d(table: torch.Tensor, length: int, dtype: torch.dtype) -> torch.Tensor:
    """A (1, L, D) table linearly resampled to `length` entries (timm's factorized positions)."""
    if table.shape[1] == length:
        return table.to(dtype)
    return F.interpolate(table.transpose(1, 2).float(), size=length, mode="linear").transpose(1, 2).to(dtype)


# A batch's model input: images (B, C, H, W), or patch sequences (`data.naflex`: NaFlexVit.forward's dict).
Inputs = torch.Tensor | dict[str, torch.Tensor]


class NaFlexVit(VisionTransformer):
    """timm's `NaFlexVit`: a VisionTransformer whose embedding is NaFlexEmbeds (`embeds`). It takes images
    of any size (the positions follow the grid), or patch sequences: `model(patches, patch_coord,
    patch_valid)` or timm's dict of them. `model.load_state_dict(timm.create_model(name).state_dict())`
    is strict for its names."""

    def __init__(self, config: NaFlexConfig) -> None:
        super().__init__(config)
        c = config
        # The embedding replaces the ViT's patch embedding and prefix tokens (timm's keys: `embeds.*`).
        del self.patch_embed, self.cls_token, self.reg_token
        self.embeds = NaFlexEmbeds(c)
        if c.global_pool == "map":  # timm's: its own heads and MLP ratio, the q and kv biases whatever qkv_bias
            self.attn_pool = AttentionPoolLatent(
                c.embed_dim, c.attn_pool_num_heads or c.num_heads, c.attn_pool_mlp_ratio or c.mlp_ratio,
                norm=c.norm, norm_eps=c.norm_eps, act=c.act_layer or "gelu",
            )  # fmt: skip
        self.init_weights()

    def init_weights(self) -> None:
        """timm's NaFlexVit init: trunc-normal(0.02) Linear weights, zero biases; with fix_init each block's
        attn.proj and mlp.fc2 divided by sqrt(2 x its number); the embedding's own (NaFlexEmbeds)."""
        if getattr(self, "embeds", None) is None:  # called by VisionTransformer.__init__; __init__ calls it once built
            return
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
        self.embeds.reset_parameters()
        if self.config.fix_init:
            rescale_block_outputs_(self.blocks)

    def no_weight_decay(self) -> set[str]:
        return {"embeds.pos_embed", "embeds.cls_token", "embeds.reg_token", "attn_pool.latent"}

    def patch_grid(self, images: torch.Tensor) -> tuple[int, int]:
        return self.embeds.dynamic_feat_size(tuple(images.shape[-2:]))

    def _embed(self, images: torch.Tensor) -> tuple[torch.Tensor, None]:
        """Images -> tokens as the blocks take them (VisionTransformer's forward paths); no rotary tables."""
        return self._tokens(images)[0], None

    def _tokens(
        self, x: torch.Tensor, patch_coord: torch.Tensor | None = None, patch_valid: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Images, or patches with coordinates -> tokens, and the mask of real patches, both after
        patch dropout."""
        x, kept = self.patch_drop(self.pos_drop(self.embeds(x, patch_coord)), return_indices=True)
        if kept is not None and patch_valid is not None:
            patch_valid = patch_valid.gather(1, kept)
        return self.norm_pre(x), patch_valid

    def forward_features(
        self,
        x: torch.Tensor,
        patch_coord: torch.Tensor | None = None,
        patch_valid: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        """Images -> normed tokens (B, prefix + patches, D); patches (B, N, ph * pw * C) with `patch_coord`
        (B, N, 2) and `patch_valid` (B, N, True for real patches) -> timm's {"patches": normed tokens,
        "patch_valid": the mask after patch dropout}. `attn_mask` replaces the one patch_valid gives."""
        if patch_coord is None:
            return super().forward_features(x)
        x, patch_valid = self._tokens(x, patch_coord, patch_valid)
        if attn_mask is None:
            attn_mask = padding_mask(patch_valid, self.num_prefix_tokens, x.dtype)
        x = self._run_blocks(x, None, attn_mask=attn_mask)[0]
        return {"patches": self.norm(x), "patch_valid": patch_valid}

    def forward_intermediates(
        self, x: torch.Tensor | dict[str, torch.Tensor], indices: int | list[int] | None = None,
        return_prefix_tokens: bool = False, norm: bool = False, stop_early: bool = False, output_fmt: str = "NCHW",
        intermediates_only: bool = False, output_dict: bool = False, patch_coord: torch.Tensor | None = None,
        patch_valid: torch.Tensor | None = None, attn_mask: torch.Tensor | None = None,
    ) -> list | tuple[torch.Tensor, list] | dict[str, Any]:  # fmt: skip
        """timm's NaFlexVit.forward_intermediates: VisionTransformer's for images; for patch sequences
        (timm's dict, or patches with `patch_coord`) each chosen block's tokens, (B, N, D) with padding
        ("NLC" only: each image has its own grid, which `patch_coord` places). `output_dict`: timm's
        {"image_intermediates", "image_intermediates_prefix" (with return_prefix_tokens), "patch_valid"
        (the real patches, after patch dropout), "image_features" (unless intermediates_only)}."""
        if isinstance(x, dict):
            patch_coord, patch_valid = x["patch_coord"], x.get("patch_valid", patch_valid)
            x, attn_mask = x["patches"], x.get("attn_mask", attn_mask)
        if output_fmt not in ("NCHW", "NLC"):
            raise ValueError(f"output_fmt must be 'NCHW' or 'NLC', got {output_fmt!r}")
        if patch_coord is not None and output_fmt == "NCHW":
            raise ValueError(
                "patch sequences have no one grid for output_fmt='NCHW': use 'NLC' (patch_coord places each token)"
            )
        if patch_coord is not None and self.training and self.config.patch_drop_rate and not output_dict:
            raise ValueError("patch dropout reorders the tokens: use output_dict=True, which returns their patch_valid")
        take = _take_indices(len(self.blocks), indices)
        depth = max(take) + 1 if stop_early else None
        tokens, patch_valid = self._tokens(x, patch_coord, patch_valid)
        if attn_mask is None:
            attn_mask = padding_mask(patch_valid, self.num_prefix_tokens, tokens.dtype)
        tokens, _, taken = self._run_blocks(tokens, None, take=set(take), depth=depth, attn_mask=attn_mask)
        prefix, out = self._intermediates(taken, norm, output_fmt, self.patch_grid(x) if output_fmt == "NCHW" else None)
        return_prefix_tokens = return_prefix_tokens and self.num_prefix_tokens > 0  # timm's: none to return
        if output_dict:
            result: dict[str, Any] = {"image_intermediates": out}
            if return_prefix_tokens:
                result["image_intermediates_prefix"] = prefix
            if patch_valid is not None:
                result["patch_valid"] = patch_valid
            if not intermediates_only:
                result["image_features"] = self.norm(tokens)
            return result
        if return_prefix_tokens:
            out = list(zip(out, prefix, strict=True))
        return out if intermediates_only else (self.norm(tokens), out)

    def pool(self, x: torch.Tensor, patch_valid: torch.Tensor | None = None) -> torch.Tensor:
        """As the ViT's, the padding left out: masked from the attention pool's keys, from mean and max
        (timm's global_pool_naflex)."""
        prefix, include = self.num_prefix_tokens, self.config.pool_include_prefix
        if self.attn_pool is not None:
            mask = padding_mask(patch_valid, prefix if include else 0, x.dtype, num_queries=1)
            return self.attn_pool(x if include else x[:, prefix:], attn_mask=mask)
        if patch_valid is None or self.global_pool not in ("avg", "max", "avgmax"):
            return super().pool(x)
        if include:
            patch_valid = F.pad(patch_valid.bool(), (prefix, 0), value=True)
        else:
            x = x[:, prefix:]
        valid = patch_valid[..., None].to(x.dtype)
        mean = (x * valid).sum(dim=1) / valid.sum(dim=1).clamp(min=1)
        if self.global_pool == "avg":
            return mean
        top = x.masked_fill(~patch_valid[..., None].bool(), torch.finfo(x.dtype).min).amax(dim=1)
        return top if self.global_pool == "max" else 0.5 * (mean + top)

    def forward_head(
        self, x: torch.Tensor, pre_logits: bool = False, patch_valid: torch.Tensor | None = None
    ) -> torch.Tensor:
        x = self.head_drop(self.fc_norm(self.pool(x, patch_valid)))
        return x if pre_logits else self.head(x)

    def forward(
        self,
        x: torch.Tensor | dict[str, torch.Tensor],
        patch_coord: torch.Tensor | None = None,
        patch_valid: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits of images (B, C, H, W), or of patch sequences (see forward_features), given as
        arguments or as timm's NaFlex dict ("patches", "patch_coord", "patch_valid", "attn_mask")."""
        if isinstance(x, dict):
            patch_coord, patch_valid = x.get("patch_coord", patch_coord), x.get("patch_valid", patch_valid)
            x, attn_mask = x["patches"], x.get("attn_mask", attn_mask)
        if patch_coord is None:
            return super().forward(x)
        features = self.forward_features(x, patch_coord, patch_valid, attn_mask)
        return self.forward_head(features["patches"], patch_valid=features["patch_valid"])


# -- timm's names, read from timm's model functions ------------------------------------------------

# NaFlexVitCfg fields that are NaFlexConfig fields of the same name and meaning.
_SAME = (
    "patch_size", "embed_dim", "depth", "num_heads", "mlp_ratio", "qkv_bias", "qk_norm", "proj_bias",
    "attn_drop_rate", "init_values", "drop_rate", "pos_drop_rate", "patch_drop_rate", "proj_drop_rate",
    "drop_path_rate", "class_token", "reg_tokens", "pos_embed", "pos_embed_grid_size", "pos_embed_interp_mode",
    "pos_embed_ar_preserving", "pos_embed_antialias", "pos_embed_align_corners", "dynamic_img_pad", "pre_norm",
    "final_norm", "fc_norm", "global_pool", "pool_include_prefix", "attn_pool_num_heads", "attn_pool_mlp_ratio",
    "fix_init", "embed_proj_type",
)  # fmt: skip
_RENAMED = {"scale_mlp_norm": "scale_mlp", "scale_attn_inner_norm": "scale_attn_inner"}
# NaFlexVitCfg fields we have no equal for, the value that leaves them off, and what they are. The rope_*
# details, qkv_fused and swiglu_align_to are read by timm's EVA blocks only, which these switch on.
_REFUSED = {
    "num_kv_heads": (None, "grouped-query attention"),
    "use_key_only_attn_mask": (False, "a key-only padding mask"),
    "pos_embed_use_grid_sample": (False, "positions sampled per patch by grid_sample"),
    "rope_type": (("", "none"), "rotary positions"),
    "rope_shift_coords": (None, "train-time RoPE coordinate augmentation"),
    "rope_jitter_coords": (None, "train-time RoPE coordinate augmentation"),
    "rope_rescale_coords": (None, "train-time RoPE coordinate augmentation"),
    "patchify_channels_last": (True, "patches flattened as (channel, row, column)"),
    "weight_init": ("", "timm's jax / moco init"),
    "input_norm_layer": (None, "a norm of the flattened patches"),
    "embed_norm_layer": (None, "a norm of the embedded patches"),
    "block_fn": (None, "another block class"),
    "mlp_layer": (None, "another MLP class"),
    "attn_layer": (None, "another attention class"),
    "attn_type": ("standard", "EVA's attention"),
    "attn_gated": (False, "gated attention"),
    "swiglu_mlp": (False, "EVA's SwiGLU MLP"),
    "attn_only_layer_scale": (False, "LayerScale on the attention branch only"),
    "enable_patch_interpolator": (False, "FlexiViT's patch-size interpolation"),
}
_EVA_ONLY = ("rope_temperature", "rope_ref_feat_shape", "rope_grid_offset", "rope_grid_indexing", "rope_rotate_half",
             "rope_mrope_section", "qkv_fused", "swiglu_align_to")  # fmt: skip


def timm_naflex_args(name: str, **kwargs: object) -> dict:
    """The kwargs timm's `create_model(name, **kwargs)` builds its NaFlexVit with: its NaFlexVitCfg (`cfg`),
    other kwargs and the pretrained config's (vit.timm_args.record_timm_builder)."""
    import timm.models.naflexvit as timm_naflex

    return record_timm_builder(name, timm_naflex, "_create_naflexvit", **kwargs)


def _timm_naflex_arg_names() -> frozenset[str]:
    """The arguments timm's NaFlexVit takes by name: its NaFlexVitCfg's fields and its own (in_chans, ...)."""
    import timm.models.naflexvit as timm_naflex

    cfg = {f.name for f in dataclasses.fields(timm_naflex.NaFlexVitCfg)}
    return timm_arg_names(timm_naflex.NaFlexVit) - {"cfg"} | cfg


def from_timm_naflex_args(args: dict) -> dict:
    """timm's NaFlexVit kwargs (a NaFlexVitCfg as `cfg`, in_chans, num_classes) as NaFlexConfig fields;
    anything without an equal is a ValueError."""
    args = dict(args)
    cfg = args.pop("cfg")
    out: dict = {}
    for key, value in {**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}, **args}.items():
        if key in _REFUSED:
            off, what = _REFUSED[key]
            if value not in (off if isinstance(off, tuple) else (off,)):
                raise ValueError(f"timm's NaFlexVit {key}={value!r} ({what}) has no equivalent here")
        elif key in _SAME or key in ("in_chans", "num_classes", "img_size"):
            out[key] = tuple(value) if isinstance(value, list) else value
        elif key in _RENAMED:
            out[_RENAMED[key]] = value
        elif key == "norm_layer" and (value is None or timm_norm(value)):
            out["norm"], out["norm_eps"] = timm_norm(value) if value else ("layernorm", 1e-6)  # timm's LayerNorm
        elif key == "act_layer" and (value is None or value in ACTIVATIONS):
            out["act_layer"] = value
        elif key not in _EVA_ONLY:
            raise ValueError(f"timm's NaFlexVit {key}={getattr(value, '__name__', value)!r} has no equivalent here")
    return out


register_timm_names(
    "NaFlexVit", [("*", "naflexvit")], NaFlexVit, NaFlexConfig,
    lambda name, **kw: from_timm_naflex_args(timm_naflex_args(name, **kw)),
    _timm_naflex_arg_names(),
)  # fmt: skip
