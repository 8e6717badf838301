"""Relevance maps in TensorBoard during training: `RolloutLogger` draws the maps of a fixed set of
validation images every N epochs.

The maps themselves are computed in vit.relevance (attention rollout, gradient rollout, last-block
attention, GradCAM), drawn in vit.render and scored against object boxes in vit.explain.
"""

from __future__ import annotations

import logging

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import Callback

from vit.explain import box_scores, centre_gaussian
from vit.relevance import METHODS, check_vit, fuse_heads, rollout_maps
from vit.render import denormalise, render_panel

log = logging.getLogger(__name__)

# Names benchmarks/rollout_eval.py and tests/test_naflex_data.py import from here.
__all__ = ["METHODS", "RolloutLogger", "box_scores", "centre_gaussian", "check_vit", "rollout_maps"]


class RolloutLogger(Callback):
    """Logs rollout overlays of a fixed set of validation images to TensorBoard every N epochs
    (`method`: any of `METHODS`; the class-specific ones explain the predicted class).

    The images are `num_images` evenly spaced over the val set (the same ones every time, so the
    maps can be compared across epochs). In a config:
    `--trainer.callbacks+=vit.rollout.RolloutLogger --trainer.callbacks.every_n_epochs 5`.
    """

    def __init__(
        self,
        every_n_epochs: int = 5,
        num_images: int = 8,
        method: str = "attention",
        head_fusion: str = "mean",
        discard_ratio: float = 0.0,
        panel_size: int = 128,
    ) -> None:
        if every_n_epochs < 1 or num_images < 1:
            raise ValueError(f"every_n_epochs and num_images must be >= 1, got {every_n_epochs}, {num_images}")
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        fuse_heads(torch.zeros(1, 1, 1, 1), head_fusion)  # validate the name now, not after an epoch
        self.every_n_epochs = every_n_epochs
        self.num_images = num_images
        self.maps = (method, head_fusion, discard_ratio)  # how rollout_maps makes them
        self.panel_size = panel_size

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        check_vit(getattr(pl_module, "model", pl_module), "RolloutLogger's model")

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or not trainer.is_global_zero or (trainer.current_epoch + 1) % self.every_n_epochs:
            return
        writer = _tensorboard(trainer)
        dataset = getattr(trainer.datamodule, "val_set", None) if trainer.datamodule is not None else None
        if writer is None or dataset is None or len(dataset) == 0:
            log.warning("RolloutLogger: needs a TensorBoard logger and a datamodule with a val_set; skipped")
            return
        items = [dataset[i] for i in self.indices(len(dataset))]  # (normalised CHW tensor, label)
        x = torch.stack([image for image, _ in items]).to(pl_module.device)
        model = getattr(pl_module, "model", pl_module)
        maps, logits = rollout_maps(model, x, *self.maps)
        probs = logits.float().softmax(dim=-1).cpu()
        mean, std = getattr(trainer.datamodule, "mean", None), getattr(trainer.datamodule, "std", None)
        panels = []
        for (image, label), m, p in zip(items, maps.cpu().numpy(), probs, strict=True):
            prob, pred = p.max(dim=-1)
            lines = [f"true {int(label)}  pred {int(pred)} ({float(prob):.2f})"]
            panels.append(np.asarray(render_panel(denormalise(image, mean, std), m, lines, self.panel_size)))
        writer.add_image("rollout/overlays", np.concatenate(panels, axis=0), trainer.global_step, dataformats="HWC")

    def indices(self, n: int) -> list[int]:
        """`num_images` indices evenly spaced over a dataset of n images (fixed across epochs)."""
        k = min(self.num_images, n)
        return [round(i * (n - 1) / max(k - 1, 1)) for i in range(k)]


def _tensorboard(trainer: L.Trainer):
    from lightning.pytorch.loggers import TensorBoardLogger

    for logger in trainer.loggers:
        if isinstance(logger, TensorBoardLogger):
            return logger.experiment
    return None
