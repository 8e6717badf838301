"""Every random draw of a run comes from one seed scheme: `seed_for(run_seed, purpose, *keys)`.

The keys are what the draw belongs to (an epoch and an image, an optimizer step and a rank), never
when it happens to be drawn, so a run resumed mid-epoch, or one whose batches are made in another
process or a thread ahead, draws exactly what an uninterrupted run draws. A purpose names what the
draw is for, so no two kinds of draw share a stream.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from enum import IntEnum
from typing import Any

import numpy as np


class Purpose(IntEnum):
    """What a seed is for, and its keys after the run seed."""

    SAMPLE = 1  # (epoch, index): one image's crop box, flip and RandAugment ops; a text window's offset
    BATCH = 2  # (epoch, batch, rank): an in-memory batch's crops, flips and cutout squares
    BATCH_RANDAUGMENT = 3  # (epoch, batch, rank): an in-memory batch's RandAugment ops
    CHUNK_ORDER = 4  # (epoch,): the order of a streaming dataset's chunks
    CHUNK_WINDOWS = 5  # (epoch, rank): the shuffle within one process's windows of chunks
    MIXUP = 6  # (step, rank[, micro-batch]): a training batch's Mixup/CutMix
    DROPOUT = 7  # (step, rank[, micro-batch]): the model's dropout and drop-path masks in a training step


def seed_for(run_seed: int, purpose: Purpose, *keys: int) -> int:
    """A well-mixed 32-bit seed for `purpose` from the run's seed and the draw's keys (numpy's
    SeedSequence: nearby keys give unrelated streams)."""
    values = (run_seed, int(purpose), *keys)
    return int(np.random.SeedSequence([int(v) % 2**63 for v in values]).generate_state(1)[0])


def sample_seeds(run_seed: int, epoch: int, indices: Sequence[int]) -> list[tuple[int, int]]:
    """(index, its sample seed) for each of `indices` in `epoch` (Purpose.SAMPLE): a sampler's
    pairs for a run of its order, drawn in one call."""
    return [(i, seed_for(run_seed, Purpose.SAMPLE, epoch, i)) for i in indices]


def step_seed(run_seed: int, purpose: Purpose, trainer: Any, batch_idx: int) -> int:
    """The seed of the epoch's training batch `batch_idx` for `purpose` (MIXUP, DROPOUT): keyed by
    the optimizer step and rank, which Lightning restores on resume, and, with gradient
    accumulation, by the batch's place among its step's, so each batch of a step draws its own."""
    micro = batch_idx % trainer.accumulate_grad_batches
    keys = (trainer.global_step, trainer.global_rank, *((micro,) if micro else ()))
    return seed_for(run_seed, purpose, *keys)


def global_seed() -> int:
    """The seed `seed_everything` set (LightningCLI's `seed_everything:`, or `L.seed_everything` in
    a script), 0 if none. Lightning keeps it only in the environment variable PL_GLOBAL_SEED, so
    this is the one place that reads it: the task and the datamodule take it when a run starts."""
    return int(os.environ.get("PL_GLOBAL_SEED", 0))


class RunSeed:
    """A datamodule's hold on the run's seed: taken from `seed_everything` when a run sets the data
    up (call `take_run_seed` in `setup`), saved in the checkpoint (Lightning saves a datamodule's
    `state_dict`) and restored from it on resume, after `setup`, so a resumed run draws what the
    uninterrupted one drew even if its process was seeded differently. 0 outside a run."""

    seed: int = 0

    def take_run_seed(self) -> None:
        self.seed = global_seed()

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.seed = int(state_dict.get("seed", self.seed))
