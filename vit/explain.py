"""How faithful an explanation map is: the perturbation tests the literature scores maps with.

A map here is a relevance score per patch, (B, grid_h, grid_w), as `vit.relevance.rollout_maps`
returns for every method. The tests take the model, the normalised images (B, 3, H, W) and the maps,
remove (or insert) whole patches in the maps' order and re-classify; they call nothing but
`model(images) -> logits`, so they work for any classifier, ResNets included, with any map on a grid
that divides the image.

- Positive / negative perturbation (Chefer et al. CVPR 2021): remove a growing fraction of the
  patches, most relevant first (positive: a faithful map makes accuracy fall fast, low AUC is good)
  or least relevant first (negative: accuracy should hold, high AUC is good).
- Deletion / insertion (Petsiuk et al. 2018, RISE): the probability of the class, as the most
  relevant patches are deleted from the image (low AUC is good) or inserted into a blank canvas
  (high AUC is good).
- Baselines that look at no image: `random_maps` and the centred Gaussian (`baseline_maps`).
- Scores against object boxes: the pointing game and energy in box (`box_scores`); the centred
  Gaussian (`centre_gaussian`) is their baseline that looks at no image.
- `outlier_norm_fraction`: the share of patch tokens with outlier norms (the artefacts Darcet et al.
  2024 remove with register tokens), and `off_centre`: the images whose object box is far from the
  middle, where a centre prior cannot win the pointing game (`box_scores`).

A removed patch is replaced by a fill value, 0 by default: in normalised images that is the
dataset's mean colour. Everything runs under `torch.no_grad()`, batched over the images (one forward
per curve point); call it with the model in eval mode.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

FRACTIONS = tuple(i / 10 for i in range(10))  # 0, 0.1, ..., 0.9: Chefer et al.'s perturbation steps
BASELINES = ("random", "centre")


# -- ordering and removing patches --------------------------------------------------------------


def relevance_order(maps: torch.Tensor) -> torch.Tensor:
    """(B, grid_h, grid_w) maps -> (B, grid_h * grid_w) patch indices (row-major), most relevant first.

    Equal values keep their row-major order (a stable sort), so ties are broken the same way on
    every run and machine: a flat map removes patches from the top-left corner on.
    """
    return torch.sort(maps.detach().float().flatten(1), dim=1, descending=True, stable=True).indices


def cell_masks(order: torch.Tensor, counts: int | torch.Tensor, grid: Sequence[int]) -> torch.Tensor:
    """(B, grid_h, grid_w) bool masks, True on the first `counts` patches of each image's `order`.

    `order` is (B, n) as `relevance_order` gives it; `counts` one number for every image or (B,).
    """
    B, n = order.shape
    counts = torch.as_tensor(counts, device=order.device).expand(B)
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(n, device=order.device).expand(B, n))
    return (rank < counts[:, None]).reshape(B, *grid)


def patch_size_of(images: torch.Tensor, grid: Sequence[int]) -> tuple[int, int]:
    """The pixel size of a grid cell; the grid must divide the image exactly."""
    (H, W), (gh, gw) = images.shape[-2:], grid
    if H % gh or W % gw:
        raise ValueError(f"a {gh}x{gw} grid does not divide {H}x{W} images into whole patches")
    return H // gh, W // gw


def fill_cells(images: torch.Tensor, masks: torch.Tensor, fill: float | torch.Tensor = 0.0) -> torch.Tensor:
    """The images with every pixel of the masked cells (B, grid_h, grid_w) replaced by `fill`.

    `fill` is a number (0: the mean colour of normalised images) or a tensor broadcastable to the
    images (e.g. a blurred copy, or one value per channel as (3, 1, 1)). Pixels of unmasked cells are
    left bit for bit as they are.
    """
    ph, pw = patch_size_of(images, masks.shape[-2:])
    pixels = masks.repeat_interleave(ph, dim=1).repeat_interleave(pw, dim=2)[:, None]  # (B, 1, H, W)
    return torch.where(pixels, torch.as_tensor(fill, dtype=images.dtype, device=images.device), images)


def remove_patches(
    images: torch.Tensor, maps: torch.Tensor, counts: int | torch.Tensor, fill: float | torch.Tensor = 0.0
) -> torch.Tensor:
    """The images with their `counts` most relevant patches by `maps` replaced by `fill`."""
    return fill_cells(images, cell_masks(relevance_order(maps), counts, maps.shape[-2:]), fill)


def _counts(fractions: Sequence[float], n: int) -> list[int]:
    """Patches to remove per fraction: floor(fraction x n), + 1e-6 so that 0.3 x 10 is 3, not 2."""
    if any(not 0.0 <= f <= 1.0 for f in fractions):
        raise ValueError(f"fractions must lie in [0, 1], got {list(fractions)}")
    return [int(f * n + 1e-6) for f in fractions]


def _targets(model: nn.Module, images: torch.Tensor, targets: torch.Tensor | int | None) -> torch.Tensor:
    """(B,) class ids: the given ones, or the model's prediction on the unperturbed images."""
    if targets is None:
        return model(images).argmax(dim=-1)
    return torch.as_tensor(targets, device=images.device).long().expand(images.shape[0])


def _check(images: torch.Tensor, maps: torch.Tensor) -> None:
    if maps.ndim != 3 or maps.shape[0] != images.shape[0]:
        raise ValueError(f"maps must be (B, grid_h, grid_w) for {images.shape[0]} images, got {tuple(maps.shape)}")
    patch_size_of(images, maps.shape[-2:])


# -- the curves ---------------------------------------------------------------------------------


@torch.no_grad()
def perturbation_curve(
    model: nn.Module,
    images: torch.Tensor,
    targets: torch.Tensor | int | None,
    maps: torch.Tensor,
    fractions: Sequence[float] = FRACTIONS,
    most_relevant_first: bool = True,
    fill: float | torch.Tensor = 0.0,
    per_image: bool = False,
) -> torch.Tensor:
    """Chefer et al. 2021's perturbation test: accuracy after removing each fraction of the patches.

    For every fraction f, the floor(f x n) patches first in the maps' order (most relevant first, or
    least relevant first with `most_relevant_first=False`: the negative test) are set to `fill` and
    the images re-classified. Returns the accuracy against `targets` (the labels; None: the class
    predicted on the unperturbed images, so the curve starts at 1) at each fraction, (F,); or the
    0/1 hits per image, (F, B), with `per_image`. Summarise it with `auc(fractions, curve)`.
    """
    _check(images, maps)
    targets = _targets(model, images, targets)
    order = relevance_order(maps if most_relevant_first else -maps.float())
    hits = []
    for k in _counts(fractions, order.shape[1]):
        perturbed = fill_cells(images, cell_masks(order, k, maps.shape[-2:]), fill)
        hits.append((model(perturbed).argmax(dim=-1) == targets).float())
    hits = torch.stack(hits)
    return hits if per_image else hits.mean(dim=1)


class DeletionInsertion(NamedTuple):
    """Petsiuk et al.'s two curves over the fraction of patches deleted / inserted."""

    fractions: torch.Tensor  # (T,) k / n for k patches of n
    deletion: torch.Tensor  # (T,) mean class probability, or (T, B) per image
    insertion: torch.Tensor  # (T,) or (T, B)


@torch.no_grad()
def deletion_insertion_curves(
    model: nn.Module,
    images: torch.Tensor,
    targets: torch.Tensor | int | None,
    maps: torch.Tensor,
    steps: int | None = None,
    fill: float | torch.Tensor = 0.0,
    canvas: float | torch.Tensor | None = None,
    per_image: bool = False,
) -> DeletionInsertion:
    """Deletion and insertion (Petsiuk et al. 2018): the softmax probability of the target class
    (None: the class predicted on the unperturbed images) as the maps' most relevant patches are

    - deleted from the image (replaced by `fill`), and
    - inserted into a blank image (`canvas`, by default the same `fill`; RISE uses a blurred copy),

    at `steps` + 1 evenly spaced counts from none to all n patches (`steps` None: one patch per step,
    n + 1 points). Both curves come from one forward per step (deleted and inserted images batched
    together). Summarise each with `auc(curves.fractions, curves.deletion)`.
    """
    _check(images, maps)
    n = maps.shape[-2] * maps.shape[-1]
    steps = n if steps is None else steps
    if not 1 <= steps <= n:
        raise ValueError(f"steps must be in [1, {n}] (the patch count), got {steps}")
    counts = [(2 * i * n + steps) // (2 * steps) for i in range(steps + 1)]  # round(i n / steps), exact
    targets = _targets(model, images, targets)
    order = relevance_order(maps)
    canvas = fill if canvas is None else canvas
    B = images.shape[0]
    deletion, insertion = [], []
    for k in counts:
        chosen = cell_masks(order, k, maps.shape[-2:])
        both = torch.cat([fill_cells(images, chosen, fill), fill_cells(images, ~chosen, canvas)])
        probs = model(both).float().softmax(dim=-1).gather(1, targets.repeat(2)[:, None])[:, 0]
        deletion.append(probs[:B])
        insertion.append(probs[B:])
    deletion, insertion = torch.stack(deletion), torch.stack(insertion)
    if not per_image:
        deletion, insertion = deletion.mean(dim=1), insertion.mean(dim=1)
    return DeletionInsertion(torch.tensor(counts, dtype=torch.float32) / n, deletion, insertion)


def auc(xs: Sequence[float] | torch.Tensor, ys: Sequence[float] | torch.Tensor) -> float | torch.Tensor:
    """Area under the curve by the trapezoid rule, divided by the x range: the curve's mean height.

    On Chefer et al.'s fractions 0..0.9 the result is the mean accuracy over that range (a constant
    curve c scores c); on deletion/insertion's 0..1 it is the plain area. `ys` (T,) gives a float,
    (T, B) per-image curves give (B,).
    """
    xs = torch.as_tensor(xs, dtype=torch.float64)
    ys = torch.as_tensor(ys, dtype=torch.float64)
    if xs.ndim != 1 or len(xs) < 2 or ys.shape[0] != len(xs):
        raise ValueError(f"need at least two points with one y per x, got xs {tuple(xs.shape)}, ys {tuple(ys.shape)}")
    span = xs[-1] - xs[0]
    if span <= 0:
        raise ValueError("xs must increase")
    area = torch.trapezoid(ys, xs, dim=0) / span
    return float(area) if ys.ndim == 1 else area


# -- baselines ----------------------------------------------------------------------------------


def random_maps(batch: int, grid: Sequence[int], generator: torch.Generator | None = None) -> torch.Tensor:
    """(batch, grid_h, grid_w) uniform noise: a random patch order per image (values are distinct
    almost surely, so no tie-breaking enters). Pass a seeded generator for a repeatable baseline."""
    return torch.rand((batch, *grid), generator=generator)


def baseline_maps(name: str, batch: int, grid: Sequence[int], generator: torch.Generator | None = None) -> torch.Tensor:
    """The maps that look at no image, by name: "random" (`random_maps`) or "centre" (the centred
    Gaussian of `centre_gaussian` on the patch grid, sigma a quarter of each side)."""
    if name == "random":
        return random_maps(batch, grid, generator)
    if name == "centre":
        return centre_gaussian(batch, tuple(grid))
    raise ValueError(f"baseline must be one of {BASELINES}, got {name!r}")


# -- registers and boxes ------------------------------------------------------------------------


def outlier_norm_mask(tokens: torch.Tensor, factor: float = 2.0, num_prefix_tokens: int = 0) -> torch.Tensor:
    """(B, n) True for the patch tokens whose L2 norm exceeds `factor` x the median patch-token norm
    of the same image (torch's median: the lower middle value for even n).

    Darcet et al. 2024 ("Vision Transformers Need Registers") find a few percent of patch tokens
    with norms several times the rest, a separate mode, in the background of large ViTs; a multiple
    of the median needs no model-specific threshold (theirs was 150 for DINOv2 ViT-g) and stays put
    while those few tokens sit far in the tail. `tokens` is (B, N, D); the first `num_prefix_tokens`
    (CLS, registers) are dropped. Measure the residual stream, before the final norm, which would
    scale every token to the same size: e.g. the last block's output,
    `model.forward_intermediates(x, indices=1, output_fmt="NLC", intermediates_only=True)[0]`
    (patch tokens only, so `num_prefix_tokens=0`).
    """
    norms = tokens[:, num_prefix_tokens:].float().norm(dim=-1)
    return norms > factor * norms.median(dim=1, keepdim=True).values


def outlier_norm_fraction(tokens: torch.Tensor, factor: float = 2.0, num_prefix_tokens: int = 0) -> float:
    """The fraction of all patch tokens in the batch with outlier norms (see `outlier_norm_mask`)."""
    return float(outlier_norm_mask(tokens, factor, num_prefix_tokens).float().mean())


def off_centre(boxes: torch.Tensor, size: int, min_dist: float, exclude_centre: bool = False) -> torch.Tensor:
    """(B,) True for the images whose object box lies away from the image centre.

    Boxes are (x0, y0, x1, y1), inclusive pixel coordinates on size x size images (as
    `box_scores` takes them). An image is kept when the Euclidean distance from the box
    centre ((x0 + x1) / 2, (y0 + y1) / 2) to the image centre ((size - 1) / 2, both axes) is at least
    `min_dist` pixels; with `exclude_centre` the box must also hold none of the image's central
    pixels (one for odd sizes, four for even), so a centred map's peak misses every kept box and the
    centre prior scores 0 in the pointing game there.
    """
    b = boxes.float()
    c = (size - 1) / 2
    dist = torch.hypot((b[:, 0] + b[:, 2]) / 2 - c, (b[:, 1] + b[:, 3]) / 2 - c)
    keep = dist >= min_dist
    if exclude_centre:
        lo, hi = (size - 1) // 2, size // 2  # the central pixel index range on each axis
        covers_x = (b[:, 0] <= hi) & (b[:, 2] >= lo)
        covers_y = (b[:, 1] <= hi) & (b[:, 3] >= lo)
        keep = keep & ~(covers_x & covers_y)
    return keep


# -- scoring a method over a dataset ------------------------------------------------------------

# Which way is better for each score `benchmarks/rollout_eval.py` reports.
BETTER = {
    "positive": "lower",  # accuracy should fall fast when the most relevant patches go
    "negative": "higher",  # and hold when the least relevant go
    "deletion": "lower",
    "insertion": "higher",
    "pointing": "higher",
    "energy": "higher",
    "ms_per_image": "lower",
}


@torch.no_grad()
def perturbation_scores(
    model: nn.Module,
    images: torch.Tensor,
    labels: torch.Tensor,
    maps: torch.Tensor,
    fractions: Sequence[float] = FRACTIONS,
    steps: int | None = None,
    fill: float | torch.Tensor = 0.0,
) -> dict[str, torch.Tensor]:
    """The four perturbation tests of one batch of maps, per image.

    "positive" / "negative": each image's AUC (`auc` over `fractions`) of its 0/1 hits against
    `labels` as patches are removed most / least relevant first (`perturbation_curve`); averaged
    over images they are the AUC of the accuracy curve, which starts at the clean accuracy.
    "deletion" / "insertion": each image's AUC of the probability of the class the model predicts
    on the unperturbed image (`deletion_insertion_curves` with `steps`). (B,) each, and the curves
    under "<name>_curve", (points, B), to average into the mean curve.
    """
    positive = perturbation_curve(model, images, labels, maps, fractions, True, fill, per_image=True)
    negative = perturbation_curve(model, images, labels, maps, fractions, False, fill, per_image=True)
    curves = deletion_insertion_curves(model, images, None, maps, steps, fill, per_image=True)
    scores = {}
    for name, xs, ys in (
        ("positive", fractions, positive),
        ("negative", fractions, negative),
        ("deletion", curves.fractions, curves.deletion),
        ("insertion", curves.fractions, curves.insertion),
    ):
        scores[name] = auc(xs, ys).float()
        scores[f"{name}_curve"] = ys.float()
    return scores


def mean_and_se(values: torch.Tensor | Sequence[float]) -> tuple[float, float]:
    """The mean of per-image scores and its standard error (sample std / sqrt(n); 0 for one value,
    NaN for none)."""
    v = torch.as_tensor(values, dtype=torch.float64).flatten()
    if len(v) == 0:
        return float("nan"), float("nan")
    se = float(v.std() / len(v) ** 0.5) if len(v) > 1 else 0.0
    return float(v.mean()), se


def class_interleaved_order(labels: Sequence[int] | torch.Tensor, seed: int = 0) -> list[int]:
    """Every index of `labels` once, in a fixed order that mixes the classes: each class's images
    are shuffled (seeded), then taken one per class in turn (classes in id order) until all are used.

    The first N of the order therefore hold every class equally, up to one image (a class with fewer
    images drops out when it runs out), whatever order the files were listed in; the same seed and
    labels give the same order on every machine.
    """
    labels = torch.as_tensor(labels).long()
    generator = torch.Generator().manual_seed(seed)
    keyed = []
    for c in torch.unique(labels).tolist():
        members = (labels == c).nonzero()[:, 0]
        shuffled = members[torch.randperm(len(members), generator=generator)].tolist()
        keyed += [(rank, c, index) for rank, index in enumerate(shuffled)]
    return [index for _, _, index in sorted(keyed)]


# -- scoring against object boxes ---------------------------------------------------------------


def box_scores(maps: torch.Tensor, boxes: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """How well (B, h, w) maps find the objects in (B, 4) boxes on size x size images: pointing
    hits and energy-in-box fractions, (B,) each. Boxes are (x0, y0, x1, y1), inclusive pixel
    coordinates, as in Tiny-ImageNet's annotations.

    Pointing: the peak of the map, upsampled bilinearly to the image, lies inside the box. Energy:
    the share of the upsampled map's mass inside the box after min-max scaling it to [0, 1], so a
    constant offset (which rollout's identity term adds) does not count; a flat map scores the box's
    share of the image.
    """
    m = maps.float()[:, None]
    if m.shape[-1] != size:
        m = F.interpolate(m, size=(size, size), mode="bilinear", align_corners=False)
    m = m[:, 0].flatten(1)
    lo, hi = m.min(dim=1, keepdim=True).values, m.max(dim=1, keepdim=True).values
    m = (m - lo) / (hi - lo).clamp(min=1e-12)
    pixels = torch.arange(size, dtype=torch.float32)
    ys, xs = pixels[:, None].expand(size, size).flatten(), pixels[None, :].expand(size, size).flatten()
    x0, y0, x1, y1 = (boxes[:, i : i + 1].float() for i in range(4))
    inside = (xs >= x0) & (xs <= x1) & (ys >= y0) & (ys <= y1)  # (B, size * size)
    hits = inside.gather(1, m.argmax(dim=1, keepdim=True))[:, 0].float()
    total = m.sum(dim=1)
    energy = torch.where(total > 0, (m * inside).sum(dim=1) / total.clamp(min=1e-12), inside.float().mean(dim=1))
    return hits, energy


def centre_gaussian(batch: int, size: int | tuple[int, int], sigma_frac: float = 0.25) -> torch.Tensor:
    """(batch, size, size) Gaussians centred on the image (sigma = sigma_frac x size): the baseline
    that looks at no image, the prior that objects sit in the middle. `size` (h, w) gives (batch, h, w)
    with sigma_frac x h and sigma_frac x w along the two axes (e.g. on a patch grid)."""
    h, w = (size, size) if isinstance(size, int) else size
    ry = (torch.arange(h, dtype=torch.float32) - (h - 1) / 2) / (sigma_frac * h)
    rx = (torch.arange(w, dtype=torch.float32) - (w - 1) / 2) / (sigma_frac * w)
    g = torch.exp(-(ry[:, None] ** 2 + rx[None, :] ** 2) / 2)
    return g.expand(batch, h, w)
