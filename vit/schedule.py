"""How far a run has got, by steps or by wall-clock time, and the learning-rate shape over it.

A schedule that ends on time (`WallClockBudget`) is what makes equal-budget comparisons fair: each
model warms up and decays over exactly its budget, whatever its speed.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback

from vit.wording import counted

log = logging.getLogger(__name__)


class WallClockBudget(Callback):
    """Stops training once `minutes` of wall-clock time have passed since this callback was made,
    which with LightningCLI is before the data is read, so decoding and caching count too. The
    learning-rate schedule (and progressive resizing) then follow the fraction of the time used.

    Elapsed time is saved in checkpoints and carried on when a run resumes. Under DDP, rank 0's
    clock decides for every rank (broadcast each step), so all replicas use the same learning rate.
    A time-driven run is not bit-reproducible: where it stops depends on the machine's speed.
    """

    def __init__(self, minutes: float) -> None:
        if minutes <= 0:
            raise ValueError(f"WallClockBudget needs minutes > 0, got {minutes}")
        self.seconds = 60.0 * minutes
        self.start = time.monotonic()
        self._progress = 0.0

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def progress(self) -> float:
        """Fraction of the budget used, in [0, 1], as of the last training step."""
        return self._progress

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """A run resumed after its budget was used up is complete: it stops before training a step."""
        self._sync(trainer)
        if self._progress >= 1.0:
            trainer.should_stop = True
            if trainer.is_global_zero:
                budget = counted(self.seconds / 60, "minute")
                log.info(
                    f"The run's budget of {budget} was used up at step {trainer.global_step}, "
                    "when its checkpoint was saved: the run is complete, nothing more to train."
                )

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self._sync(trainer)
        if self._progress >= 1.0 and not trainer.should_stop:
            trainer.should_stop = True
            if trainer.is_global_zero:  # else the run seems to end early for no reason
                budget = counted(self.seconds / 60, "minute")
                log.info(
                    f"The run's budget of {budget} ended after step {trainer.global_step} "
                    f"(epoch {trainer.current_epoch}): training stops there."
                )

    def _sync(self, trainer: L.Trainer) -> None:
        self._progress = min(1.0, float(trainer.strategy.broadcast(self.elapsed() / self.seconds)))

    def state_dict(self) -> dict[str, float]:
        return {"elapsed": self.elapsed()}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.start = time.monotonic() - state["elapsed"]


def find_budget(trainer: L.Trainer | None) -> WallClockBudget | None:
    if trainer is None:
        return None
    return next((cb for cb in trainer.callbacks if isinstance(cb, WallClockBudget)), None)


def training_progress(trainer: L.Trainer) -> float:
    """Fraction of the run done: of the wall-clock budget if there is one, else of the optimizer steps."""
    budget = find_budget(trainer)
    if budget is not None:
        return budget.progress()
    total = trainer.estimated_stepping_batches
    return min(1.0, trainer.global_step / total) if math.isfinite(total) and total > 0 else 0.0


def stepwise(schedule: list[tuple[float, float]], progress: float) -> float:
    """The value of a sorted [(start, value), ...] schedule at `progress` (the first value before
    the first start): progressive image sizes, patch-dropout rates."""
    return next((value for start, value in reversed(schedule) if progress >= start), schedule[0][1])


DECAYS = ("cosine", "linear")


def warmup_decay(progress: float, warmup: float, min_ratio: float, decay: str = "cosine") -> float:
    """Learning-rate multiplier at `progress` in [0, 1]: linear warmup over the first `warmup`
    fraction, then `decay` (DECAYS) from 1 down to min_ratio at the end."""
    if progress < warmup:
        return max(progress / warmup, 1e-3)
    return decay_from_peak((progress - warmup) / max(1e-12, 1.0 - warmup), min_ratio, decay)


def warmup_decay_steps(
    step: int, warmup_steps: int, total_steps: int, min_ratio: float, decay: str = "cosine"
) -> float:
    """Learning-rate multiplier at optimizer step `step`: linear from ~0 to 1 over warmup_steps,
    then `decay` (DECAYS) down to min_ratio at total_steps."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    return decay_from_peak((step - warmup_steps) / max(1, total_steps - warmup_steps), min_ratio, decay)


def decay_from_peak(fraction: float, min_ratio: float, decay: str = "cosine") -> float:
    """From 1 at fraction 0 down to min_ratio at fraction 1 (and after), along half a cosine or a
    straight line."""
    fraction = min(1.0, fraction)
    if decay == "linear":
        return 1.0 - (1.0 - min_ratio) * fraction
    if decay != "cosine":
        raise ValueError(f"decay must be one of {DECAYS}, got {decay!r}")
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * fraction))
