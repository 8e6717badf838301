"""Weights fitted to a model: the position embedding resampled to the model's patch grid, a head of
another class count re-initialised, the CLS and register tokens and the final norm following the
model's pooling. Every key that is resampled, re-initialised, renamed or dropped is reported by name;
a mismatch that cannot be adapted is an error naming the key and both shapes."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
from timm.layers import resample_abs_pos_embed, resample_abs_pos_embed_nhwc
from torch import nn

from vit.heads import is_head
from vit.position import resample_rel_pos
from vit.vision_transformer import VisionTransformer

log = logging.getLogger(__name__)


@dataclass
class LoadReport:
    """What `adapt_state_dict` changed, by parameter name."""

    resampled: list[str] = field(default_factory=list)
    reinitialised: list[str] = field(default_factory=list)
    renamed: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)

    def add(self, kind: str, what: str) -> None:
        getattr(self, kind).append(what)

    def log(self, source: str) -> None:
        for kind, names in asdict(self).items():
            for name in names:
                log.info("%s: %s %s", source, kind, name)


def checkpoint_filter_fn(
    state_dict: dict[str, torch.Tensor], model: VisionTransformer, log: Callable[[str, str], None] | None = None
) -> dict[str, torch.Tensor]:
    """A ViT state dict (ours or timm's) made to fit `model` (timm's function of that name): the
    position embedding is resampled to the model's grid, the CLS and register tokens and their
    positions follow the model (kept, dropped, or left at the model's init), and the final norm moves
    between before pooling (`norm`) and after it (`fc_norm`).
    `log(kind, what)` hears of each change: "resampled", "reinitialised", "renamed" or "dropped"."""
    log = log or (lambda kind, what: None)
    sd, target = dict(state_dict), model.state_dict()
    source_prefix = ("cls_token" in sd, sd["reg_token"].shape[1] if "reg_token" in sd else 0)
    for name in ("cls_token", "reg_token"):
        if name in sd and name in target and sd[name].shape[-1] != target[name].shape[-1]:
            continue  # another width: not adaptable, the caller reports it
        if name in sd and (name not in target or sd[name].shape != target[name].shape):
            del sd[name]  # no such token in the model, or another number of registers
            log("dropped", name)
        if name in target and name not in sd:
            sd[name] = target[name]
            log("reinitialised", name)

    # Final norm before pooling (norm) or after it (fc_norm, timm's avg pooling): same parameters.
    for old, new in (("norm", "fc_norm"), ("fc_norm", "norm")):
        for suffix in ("weight", "bias"):
            if f"{old}.{suffix}" in sd and f"{old}.{suffix}" not in target and f"{new}.{suffix}" in target:
                sd[f"{new}.{suffix}"] = sd.pop(f"{old}.{suffix}")
                log("renamed", f"{old}.{suffix} -> {new}.{suffix}")

    _adapt_sam_positions(sd, model, log)
    if "pos_embed" in sd and "pos_embed" in target and target["pos_embed"].ndim == 3:  # SAM's (1, H, W, D): above
        sd["pos_embed"] = _adapt_pos_embed(sd["pos_embed"], source_prefix, model, log)
    return sd


def _adapt_sam_positions(sd: dict[str, torch.Tensor], model: nn.Module, log: Callable[[str, str], None]) -> None:
    """SAM's positions at the model's patch grid, in place: a position embedding stored on the grid
    (1, H, W, D) resampled as timm's SAM resamples it at another input size (bicubic, antialiased), and
    the decomposed relative positions (`attn.rel_pos_h`, `attn.rel_pos_w`, 2 x side - 1 offsets by
    head_dim) interpolated linearly to the model's lengths, as SAM's `get_rel_pos` does: a global
    block's follow the grid, a windowed block's keep the window's."""
    target = model.state_dict()
    pos = sd.get("pos_embed")
    if pos is not None and pos.ndim == 4 and "pos_embed" in target and pos.shape[1:3] != target["pos_embed"].shape[1:3]:
        (h, w), (new_h, new_w) = pos.shape[1:3], target["pos_embed"].shape[1:3]
        sd["pos_embed"] = resample_abs_pos_embed_nhwc(pos, [new_h, new_w])
        log("resampled", f"pos_embed (grid {h}x{w} -> {new_h}x{new_w})")
    for name, table in list(sd.items()):
        want = target.get(name)
        if not name.endswith((".rel_pos_h", ".rel_pos_w")) or want is None or table.ndim != 2:
            continue
        if table.shape[1:] == want.shape[1:] and table.shape[0] != want.shape[0]:  # another head_dim: refused later
            sd[name] = resample_rel_pos(table, want.shape[0])
            log("resampled", f"{name} ({table.shape[0]} -> {want.shape[0]} offsets)")


def _is_square(n: int) -> bool:
    return n >= 0 and math.isqrt(n) ** 2 == n


def _adapt_pos_embed(
    posemb: torch.Tensor, source_prefix: tuple[bool, int], model: VisionTransformer, log: Callable[[str, str], None]
) -> torch.Tensor:
    """Split off the prefix positions (CLS, registers) if the checkpoint has them, resample the patch
    grid to the model's, and give the model the prefix positions it expects."""
    has_cls, num_reg = source_prefix
    if not _is_square(posemb.shape[1] - has_cls - num_reg):  # DeiT III / no_embed_class: patches only
        has_cls, num_reg = False, 0
    if not _is_square(posemb.shape[1] - has_cls - num_reg):
        raise ValueError(f"pos_embed: cannot infer a square patch grid from shape {tuple(posemb.shape)}")
    cls, reg, grid = posemb.split([int(has_cls), num_reg, posemb.shape[1] - has_cls - num_reg], dim=1)
    side = math.isqrt(grid.shape[1])
    new_grid = model.patch_embed.grid_size
    if (side, side) != new_grid:
        grid = resample_abs_pos_embed(grid, list(new_grid), [side, side], num_prefix_tokens=0)
        log("resampled", f"pos_embed (grid {side}x{side} -> {new_grid[0]}x{new_grid[1]})")
    want_cls = model.cls_token is not None and model.num_pos_prefix > 0
    want_reg = model.num_reg_tokens if model.num_pos_prefix > 0 else 0
    parts = []
    for what, have, want in (("CLS", cls, int(want_cls)), ("registers", reg, want_reg)):
        if have.shape[1] == want:
            parts.append(have)
        elif want:  # the checkpoint has no (or other) positions for these tokens
            parts.append(grid.new_zeros(1, want, grid.shape[2]))
            had = f"has {have.shape[1]}, the model {want}" if have.shape[1] else f"has no {what} position"
            log("reinitialised", f"pos_embed[{what}] (zeros: the checkpoint {had})")
        else:
            log("dropped", f"pos_embed[{what}]")
    return torch.cat([*parts, grid], dim=1)


def adapt_state_dict(state_dict: dict[str, torch.Tensor], model: nn.Module) -> tuple[dict, LoadReport]:
    """Make `state_dict` fit `model`: resample the position embedding, re-initialise a head with
    another class count, follow CLS <-> avg pooling switches. Raises on anything else that differs."""
    target = model.state_dict()
    sd = dict(state_dict)
    report = LoadReport()

    if isinstance(model, VisionTransformer):
        sd = checkpoint_filter_fn(sd, model, report.add)

    # A classifier head of another size (new class count): keep the model's fresh initialisation.
    for name in list(sd):
        head = is_head(name)
        if head and name in target and sd[name].shape != target[name].shape:
            sd[name] = target[name]
            report.reinitialised.append(name)
        elif head and name not in target:  # num_classes=0: a headless model
            del sd[name]
            report.dropped.append(name)
    for name in target:
        if is_head(name) and name not in sd:
            sd[name] = target[name]
            report.reinitialised.append(name)

    # Checkpoints from before PyTorch 0.4.1 (e.g. the classic CIFAR ResNets) have no BatchNorm step
    # counter; it only matters for momentum=None, so the model's own value is kept, as torch does.
    for name in target:
        if name.endswith(".num_batches_tracked") and name not in sd:
            sd[name] = target[name]
    missing = sorted(set(target) - set(sd), key=_natural)
    unexpected = sorted(set(sd) - set(target), key=_natural)
    if missing or unexpected:
        parts = [f"{what.format(len(keys))} ({', '.join(keys[:3])}{', ...' if len(keys) > 3 else ''})"
                 for what, keys in (("{} of the model's keys missing", missing),
                                    ("{} keys the model does not have", unexpected)) if keys]  # fmt: skip
        raise WeightsMismatchError("; ".join(parts))
    mismatched = [
        f"{name}: the checkpoint has shape {tuple(value.shape)}, the model {tuple(target[name].shape)}"
        for name, value in sd.items()
        if value.shape != target[name].shape
    ]
    if mismatched:
        more = f" (and {len(mismatched) - 3} more)" if len(mismatched) > 3 else ""
        raise WeightsMismatchError("; ".join(mismatched[:3]) + more)
    return sd, report


class WeightsMismatchError(ValueError):
    """Weights that do not fit a model, in what cannot be adapted (only the position embedding and
    the head are): `details` names a few of the keys or shapes that differ."""

    def __init__(self, details: str, what: str = "the weights do not fit the model") -> None:
        self.details = details
        super().__init__(f"{what}: {details}; only the position embedding and the head are adapted")


def _natural(key: str) -> list:
    """blocks.2 before blocks.10."""
    return [int(t) if t.isdigit() else t for t in key.split(".")]
