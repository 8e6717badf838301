"""Callbacks the fault-tolerance tests inject into real runs (`--trainer.callbacks`)."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import lightning as L


class SignalAt(L.Callback):
    """Sends `signals` (names such as "SIGTERM", in order) to this process after optimizer step
    `step`, on `rank` only, as a scheduler, Ctrl-C or the OOM killer would."""

    def __init__(self, step: int, signals: list[str], rank: int = 0) -> None:
        self.step, self.signals, self.rank = step, signals, rank

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step and trainer.global_rank == self.rank:
            for name in self.signals:
                os.kill(os.getpid(), getattr(signal, name))
                time.sleep(0.2)  # let the handler run before the next signal


class DiskFullAfter(L.Callback):
    """From optimizer step `step` on, no file may grow past `max_bytes` (RLIMIT_FSIZE: writes fail
    with EFBIG part-way, as on a full disk). The caller restores the limit."""

    def __init__(self, step: int, max_bytes: int) -> None:
        self.step, self.max_bytes = step, max_bytes

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            import resource

            resource.setrlimit(resource.RLIMIT_FSIZE, (self.max_bytes, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


class PoisonAt(L.Callback):
    """Sets the head's weights to NaN after optimizer step `step`, as a diverging update would
    (before that step's checkpoint is written: checkpoint callbacks run last)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if trainer.global_step == self.step:
            import torch

            with torch.no_grad():
                pl_module.model.head.weight.fill_(float("nan"))


class RecordLR(L.Callback):
    """The learning rate of the first parameter group at each optimizer step, in `lrs`."""

    def __init__(self) -> None:
        self.lrs: dict[int, float] = {}

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self.lrs[trainer.global_step] = trainer.optimizers[0].param_groups[0]["lr"]


class InterruptAt(L.Callback):
    """Presses Ctrl-C after the given optimizer step."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == self.step:
            raise KeyboardInterrupt
