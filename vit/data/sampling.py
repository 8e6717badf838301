"""Reproducible, resumable data order.

The training sampler's shuffle depends only on (seed, epoch), and each sample gets its own
augmentation seed from (seed, epoch, index). Together with the per-step seeding in
`vit.training`, a run interrupted and resumed from a checkpoint, even mid-epoch, sees exactly the
batches and augmentations an uninterrupted run would have seen.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import lightning as L
import numpy as np
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler


def mix_seed(*values: int) -> int:
    """A well-mixed 32-bit seed from several integers (e.g. seed, epoch, index)."""
    return int(np.random.SeedSequence([int(v) % 2**63 for v in values]).generate_state(1)[0])


def run_seed(trainer: L.Trainer | None) -> int:
    """The seed of the run `trainer` is in: its task's (vit.training.TrainingTask.seed, the
    checkpoint's on resume, so data and model agree on it); 0 outside a run."""
    seed = getattr(trainer.lightning_module, "seed", None) if trainer is not None else None
    return seed or 0


class ResumableSampler(DistributedSampler):
    """Shuffles by (seed, epoch) and shards across ranks like DistributedSampler (so Lightning
    keeps it as is under DDP and calls `set_epoch`); yields `(index, sample_seed)` pairs; and can
    start part-way through an epoch."""

    def __init__(self, dataset: Dataset, shuffle: bool = True, seed: int = 0, drop_last: bool = False) -> None:
        distributed = dist.is_available() and dist.is_initialized()
        num_replicas, rank = (dist.get_world_size(), dist.get_rank()) if distributed else (1, 0)
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
        self.resume_epoch, self.resume_position = 0, 0

    def __iter__(self) -> Iterator[tuple[int, int]]:
        start = self.resume_position if self.epoch == self.resume_epoch else 0
        self.resume_position = 0
        indices = list(super().__iter__())
        for i in indices[start:]:
            yield i, mix_seed(self.seed, self.epoch, i)


class ResumableLoader(DataLoader):
    """A DataLoader that starts an epoch at its next unseen batch after a resume.

    `batches_done` reports how many batches of the current epoch were trained on; `resumable_loader`
    points it at Lightning's own progress counter. Each epoch's iteration starts there, read when
    the first batch is drawn: by then Lightning has restored the counter from the checkpoint.
    (Lightning's other route, `load_state_dict`, reaches only a loader built after the checkpoint
    was read, and `trainer.estimated_stepping_batches` in `configure_optimizers` builds it
    before: mid-epoch resumes of `max_epochs` runs replayed the epoch from batch 0.)

    Without `batches_done` (no trainer), `state_dict` / `load_state_dict` count the batches handed out.
    """

    sampler: ResumableSampler
    batches_done: Callable[[], int] | None = None

    def __iter__(self) -> Iterator[Any]:
        if self.batches_done is not None:
            self.load_state_dict(self.state_dict())
        self._handed_out = 0
        for batch in super().__iter__():
            self._handed_out += 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        done = self.batches_done() if self.batches_done is not None else getattr(self, "_handed_out", 0)
        return {"epoch": self.sampler.epoch, "position": done * (self.batch_size or 1), "seed": self.sampler.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.sampler.resume_epoch = state["epoch"]
        self.sampler.resume_position = state["position"]
        self.sampler.seed = state["seed"]


def resumable_loader(
    dataset: Dataset, sampler: DistributedSampler, trainer: L.Trainer | None, **loader_options: Any
) -> ResumableLoader:
    """A ResumableLoader over `sampler` that starts each epoch where `trainer` resumes: after the
    batches of that epoch whose training step finished, Lightning's own count, which it restores
    from the checkpoint. Without a trainer it counts the batches it hands out."""
    loader = ResumableLoader(dataset, sampler=sampler, **loader_options)
    if trainer is not None:
        loader.batches_done = lambda: trainer.fit_loop.epoch_loop.batch_progress.current.processed
    return loader
