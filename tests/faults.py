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
