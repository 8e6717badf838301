"""A callback for the distributed tests: each rank writes its final weights and metrics."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import torch


class RankReport(L.Callback):
    """`orders`: also the training sampler's order of each epoch run (the samples this rank read)."""

    def __init__(self, dirpath: str, orders: bool = False) -> None:
        self.dirpath = Path(dirpath)
        self.orders = orders

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.dirpath.mkdir(parents=True, exist_ok=True)
        rank = trainer.global_rank
        torch.save(pl_module.model.state_dict(), self.dirpath / f"rank{rank}.pt")
        report = {
            "global_step": trainer.global_step,
            "world_size": trainer.world_size,
            "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
        }
        if self.orders:
            sampler = trainer.train_dataloader.sampler
            report["orders"] = []
            for epoch in range(trainer.current_epoch):
                sampler.set_epoch(epoch)
                report["orders"].append(sampler.epoch_order())
        (self.dirpath / f"rank{rank}.json").write_text(json.dumps(report))
