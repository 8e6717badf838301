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
    (before that step's checkpoint is written: checkpoint callbacks run last); on `rank` only if given."""

    def __init__(self, step: int, rank: int | None = None) -> None:
        self.step, self.rank = step, rank

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if trainer.global_step == self.step and self.rank in (None, trainer.global_rank):
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


class InterruptInValidation(L.Callback):
    """Presses Ctrl-C during the validation of epoch `epoch`: after its first batch, or, with
    `in_step`, inside its second validation step (by making the step raise)."""

    def __init__(self, epoch: int, in_step: bool = False) -> None:
        self.epoch, self.in_step = epoch, in_step

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, *args) -> None:
        if self._now(trainer) and self.in_step and batch_idx == 1:
            step = pl_module.validation_step

            def interrupted(*args, **kwargs):
                pl_module.validation_step = step
                raise KeyboardInterrupt

            pl_module.validation_step = interrupted

    def on_validation_batch_end(self, trainer, *args) -> None:
        if self._now(trainer) and not self.in_step:
            raise KeyboardInterrupt

    def _now(self, trainer) -> bool:
        return trainer.current_epoch == self.epoch and not trainer.sanity_checking


class RecordValidations(L.Callback):
    """(epoch, global step, val/acc1) of each validation that ran to its end, in `validations`."""

    def __init__(self) -> None:
        self.validations: list[tuple[int, int, float]] = []

    def on_validation_end(self, trainer, *args) -> None:
        if not trainer.sanity_checking:
            score = float(trainer.callback_metrics["val/acc1"])
            self.validations.append((trainer.current_epoch, trainer.global_step, score))
