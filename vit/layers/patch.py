"""Images to patch tokens: the patchify conv (or a conv stem), a CNN's feature map (hybrid),
the whitening init, and dropping patch tokens while training."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vit.layers.norm import make_norm


def _pair(x: int | tuple[int, int]) -> tuple[int, int]:
    return (x, x) if isinstance(x, int) else (int(x[0]), int(x[1]))


class PatchEmbed(nn.Module):
    """Image to patch tokens: a Conv2d whose kernel and stride are the patch size, then flatten.

    With `stem_channels` it is instead a convolutional stem (Xiao et al. 2021, "Early convolutions
    help transformers see better"): one 3x3 stride-2 conv + BatchNorm + ReLU per entry, as many as
    halve the image down to the patch grid (so the patch size must be a power of two), then a 1x1
    conv to the width (`proj`). The model is then a hybrid, not a plain patchify ViT. With
    `stem_pool` each conv keeps stride 1 and a 3x3 stride-2 max pool halves the map after it
    (CCT's convolutional tokenizer, Hassani et al. 2021): every pixel is convolved, at 4x each
    conv's cost.

    With `shifted_patches` it is Shifted Patch Tokenization (Lee, Lee & Song 2021, "Vision
    Transformer for Small-Size Datasets"): the image and 4 copies shifted diagonally by half a patch
    (`shift_images`) side by side on the channels, each patch of those 5 x in_chans channels flattened,
    normalised (`patch_norm`, the paper's LN over the flattened patch, before the projection) and
    projected by `proj` (the patchify conv, 5 x in_chans inputs wide), so a token also sees the
    pixels its neighbours' patches hold.
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
        shifted_patches: bool = False,
        patch_norm: str = "layernorm",
        stem_pool: bool = False,
    ) -> None:
        super().__init__()
        if stem_pool and not stem_channels:
            raise ValueError("stem_pool pools after the convs of a conv stem: give stem_channels too")
        if shifted_patches and stem_channels:
            raise ValueError("shifted_patches (Shifted Patch Tokenization) and stem_channels (a conv stem) are "
                             "two patch embeddings: give one of them")  # fmt: skip
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
                stride = 1 if stem_pool else 2
                layers += [nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False), nn.BatchNorm2d(c_out)]
                layers.append(nn.ReLU(inplace=True))
                layers += [nn.MaxPool2d(3, stride=2, padding=1)] if stem_pool else []
            self.backbone = nn.Sequential(*layers)
            self.proj = nn.Conv2d(stem_channels[-1], embed_dim, kernel_size=1)
        else:
            in_chans *= 5 if shifted_patches else 1
            self.proj = nn.Conv2d(in_chans, embed_dim, self.patch_size, stride=self.patch_size, bias=bias)
        self.shifted_patches = shifted_patches
        if shifted_patches:
            self.patch_norm = make_norm(patch_norm, in_chans * self.patch_size[0] * self.patch_size[1], norm_eps)
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
        if self.shifted_patches:
            return self.norm(self._shifted_tokens(shift_images(x, self.patch_size)))
        return self.norm(self.proj(x).flatten(2).transpose(1, 2))

    def _shifted_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """SPT's (B, 5C, H, W) -> (B, L, D): each patch flattened in the conv's (channel, row, column)
        order, normalised, then `proj` as the linear map it is on one patch."""
        (ph, pw), (gh, gw) = self.patch_size, self.dynamic_feat_size(tuple(x.shape[-2:]))
        patches = x[..., : gh * ph, : gw * pw].unflatten(2, (gh, ph)).unflatten(4, (gw, pw))  # B, C, gh, ph, gw, pw
        patches = patches.permute(0, 2, 4, 1, 3, 5).flatten(3).flatten(1, 2)  # B, gh * gw, C * ph * pw
        return F.linear(self.patch_norm(patches), self.proj.weight.flatten(1), self.proj.bias)


def shift_images(x: torch.Tensor, patch_size: tuple[int, int]) -> torch.Tensor:
    """Shifted Patch Tokenization's input: (B, C, H, W) -> (B, 5C, H, W), the images then their copies
    moved by half a patch left-up, right-up, left-down and right-down (out[i, j] = x[i + dy, j + dx]
    for the left-up copy, dy, dx = half a patch), zero where the shift brings pixels in."""
    sy, sx = patch_size[0] // 2, patch_size[1] // 2
    padded = F.pad(x, (sx, sx, sy, sy))
    h, w = x.shape[-2:]
    # (dy, dx) of each copy's window into the padded images: content moves the other way
    windows = ((2 * sy, 2 * sx), (2 * sy, 0), (0, 2 * sx), (0, 0))
    return torch.cat([x, *(padded[..., dy : dy + h, dx : dx + w] for dy, dx in windows)], dim=1)


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
