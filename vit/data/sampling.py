"""Reproducible, resumable data order.

The training sampler's shuffle depends only on (seed, epoch), and each sample gets its own
augmentation seed from (seed, epoch, index) (vit.seeds). Together with the per-step seeding in
`vit.training`, a run interrupted and resumed from a checkpoint, even mid-epoch, sees exactly the
batches and augmentations an uninterrupted run would have seen.
"""

from __future__ import annotations

import functools
import itertools
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import lightning as L
import numpy as np
import torch.distributed as dist
from torch.utils.data import Dataset, DistributedSampler

from vit import lightning_compat as compat
from vit.data.prefetch import PreparedLoader
from vit.seeds import Purpose, sample_seeds, seed_for

log = logging.getLogger(__name__)

SEED_RUN = 1024  # sample seeds drawn at a time: a few milliseconds, where a whole ImageNet epoch's take seconds


class ResumableSampler(DistributedSampler):
    """Shuffles by (seed, epoch) and shards across ranks like DistributedSampler (so Lightning
    keeps it as is under DDP and calls `set_epoch`); yields `(index, sample_seed)` pairs; and can
    start part-way through an epoch."""

    def __init__(
        self, dataset: Dataset, shuffle: bool = True, seed: int = 0, drop_last: bool = False,
        num_replicas: int | None = None, rank: int | None = None,
    ) -> None:  # fmt: skip
        if num_replicas is None or rank is None:  # this process's place in the run
            distributed = dist.is_available() and dist.is_initialized()
            num_replicas, rank = (dist.get_world_size(), dist.get_rank()) if distributed else (1, 0)
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
        self.resume_epoch, self.resume_position = 0, 0

    def __iter__(self) -> Iterator[tuple[int, int]]:
        """The epoch's (index, sample seed) pairs from its start (or resume position), their seeds
        drawn SEED_RUN indices at a time: a call a run, not a resumed generator an index."""
        start = self.begin_epoch()
        indices = self.epoch_order()[start:]
        runs = (indices[i : i + SEED_RUN] for i in range(0, len(indices), SEED_RUN))
        return itertools.chain.from_iterable(map(functools.partial(sample_seeds, self.seed, self.epoch), runs))

    def begin_epoch(self) -> int:
        """Where this epoch starts: the resume position once, after a resume into it, else 0."""
        start = self.resume_position if self.epoch == self.resume_epoch else 0
        self.resume_position = 0
        return start

    def epoch_order(self) -> list[int]:
        """This process's indices for the epoch: DistributedSampler's (a permutation by (seed, epoch),
        every num_replicas-th index from rank on), so the first k of each process are the first
        k x num_replicas of one order, whatever the number of processes."""
        return list(super().__iter__())


class ChunkedSampler(ResumableSampler):
    """A ResumableSampler for data stored in chunks (vit.data.streaming): reads stay within a few
    chunks at a time, and each process reads its own share of them.

    Each epoch permutes the chunks by (seed, epoch), gives each of the processes a contiguous
    share of that order (the same number of samples each, as DistributedSampler pads), and shuffles
    the samples of a share within windows of `window` chunks' worth. `chunk_of[i]`: the chunk that
    holds sample i. The order depends on the number of processes, so a run resumed mid-epoch with
    another count restarts that epoch (vit.data.sampling.carry_position).
    """

    order_per_process = True

    def __init__(
        self, dataset: Dataset, chunk_of: Sequence[int], seed: int = 0, window: int = 8,
        num_replicas: int | None = None, rank: int | None = None,
    ) -> None:  # fmt: skip
        super().__init__(dataset, shuffle=True, seed=seed, num_replicas=num_replicas, rank=rank)
        self.chunk_of, self.window = np.asarray(chunk_of), max(1, window)
        if len(self.chunk_of) != len(dataset):  # type: ignore[arg-type]
            raise ValueError(f"chunk_of has {len(self.chunk_of)} entries for {len(dataset)} samples")  # type: ignore[arg-type]

    def epoch_order(self) -> list[int]:
        n = len(self.chunk_of)
        rng = np.random.default_rng(seed_for(self.seed, Purpose.CHUNK_ORDER, self.epoch))
        chunks, chunk_index = np.unique(self.chunk_of, return_inverse=True)
        chunk_rank = rng.permutation(len(chunks))[chunk_index]
        order = np.lexsort((rng.random(n), chunk_rank))  # chunk by chunk, in the epoch's chunk order
        total = self.num_samples * self.num_replicas
        order = np.resize(order, total)  # wrapped round to an equal share each, as DistributedSampler pads
        share = order[self.rank * self.num_samples : (self.rank + 1) * self.num_samples]
        width = self.window * max(1, round(n / len(chunks)))
        local = np.random.default_rng(seed_for(self.seed, Purpose.CHUNK_WINDOWS, self.epoch, self.rank))
        return np.concatenate([local.permutation(share[i : i + width]) for i in range(0, len(share), width)]).tolist()


class ResumableLoader(PreparedLoader):
    """A DataLoader that starts an epoch at its next unseen batch after a resume.

    `batches_done` reports how many batches of the current epoch were trained on; `resumable_loader`
    points it at Lightning's own progress counter. Each epoch's iteration starts there, read when
    the first batch is drawn: by then Lightning has restored the counter from the checkpoint.
    (Lightning's other route, `load_state_dict`, reaches only a loader built after the checkpoint
    was read, and `trainer.estimated_stepping_batches` in `configure_optimizers` builds it
    before: mid-epoch resumes of `max_epochs` runs replayed the epoch from batch 0.)

    Without `batches_done` (no trainer), `state_dict` / `load_state_dict` count the batches handed out.
    Batches prepared ahead on the device (vit.data.prefetch) are not counted until handed out.
    """

    sampler: ResumableSampler
    batches_done: Callable[[], int] | None = None

    def __iter__(self) -> Iterator[Any]:
        if self.batches_done is not None:
            self.load_state_dict(self.state_dict())
        sampler = self.sampler  # without batches_done, a resumed epoch's count starts at the batches it skips
        resumed = sampler.resume_position if sampler.epoch == sampler.resume_epoch else 0
        self._handed_out = resumed // self.images_per_batch
        for batch in super().__iter__():
            self._handed_out += 1
            yield batch

    @property
    def images_per_batch(self) -> int:
        """The loader's batch size, or its batch sampler's (in-memory batches)."""
        return self.batch_size or getattr(self.sampler, "batch_size", 1)

    def state_dict(self) -> dict[str, int]:
        """Where the epoch is, in images (every sampler's count)."""
        done = self.batches_done() if self.batches_done is not None else getattr(self, "_handed_out", 0)
        return {"epoch": self.sampler.epoch, "position": done * self.images_per_batch, "seed": self.sampler.seed}

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
        loader.batches_done = lambda: compat.batches_processed(trainer)
    return loader


# -- a position carried across runs with other batch sizes or process counts ----------------------


def data_position(trainer: L.Trainer) -> dict[str, int | None]:
    """What a mid-epoch position is counted in (images per batch and process, processes) and the
    training set's size: saved with each checkpoint (vit.training.TrainingTask)."""
    datamodule = trainer.datamodule
    train = getattr(datamodule, "train_set", None)
    return {
        "batch_size": getattr(datamodule, "batch_size", None),
        "world_size": trainer.world_size,
        "train_images": len(train) if train is not None else None,
        "order_per_process": getattr(datamodule, "order_per_process", False),
    }


def carry_position(checkpoint: dict[str, Any], saved: dict[str, int | None], now: dict[str, int | None]) -> None:
    """Adapt a checkpoint's place in its epoch to this run before Lightning restores it.

    The epoch's order is one permutation of the training set by (seed, epoch); each of W
    processes takes every W-th image of it, B at a time, so after k batches the first k * B * W
    images are seen, whatever B and W. A run resumed with another batch size or process count
    continues after those: its position, counted in its own batches, is k * B * W // (B' * W')
    (at most one global batch is seen twice, none skipped). Lightning would otherwise count the
    saved k batches in the new size and skip or repeat part of the epoch. A training set with
    more or fewer images than when the checkpoint was saved is said, with both counts."""
    if None not in (saved.get("train_images"), now["train_images"]) and saved["train_images"] != now["train_images"]:
        log.warning(
            "the training set had %d images when the checkpoint was saved and has %d now: the resumed epoch's "
            "order is a permutation of the new set, so some images of it may be seen twice or not at all",
            saved["train_images"], now["train_images"],
        )  # fmt: skip
    if None in (saved.get("batch_size"), saved.get("world_size"), now["batch_size"]):
        return
    per_batch, per_batch_now = saved["batch_size"] * saved["world_size"], now["batch_size"] * now["world_size"]
    progress = compat.saved_batch_progress(checkpoint)
    if not progress or progress.get("is_last_batch"):
        return
    current = progress["current"]
    if now.get("order_per_process") and saved["world_size"] != now["world_size"] and current["processed"]:
        log.warning(
            "resuming mid-epoch with %d processes instead of %d: each process's share of this data's chunks depends "
            "on the number of processes, so the epoch in progress restarts from its first batch",
            now["world_size"], saved["world_size"],
        )  # fmt: skip
        for key in current:
            current[key] = 0
        return
    if per_batch == per_batch_now:
        return
    seen = current["processed"] * per_batch
    shift = current["processed"] - seen // per_batch_now
    if shift:
        for key in current:
            current[key] = max(0, current[key] - shift)
        log.info(
            "resuming mid-epoch with %d images a step (batch_size %d x %d processes) instead of %d: the epoch goes on "
            "after the %d images already seen (%d of them again)",
            per_batch_now, now["batch_size"], now["world_size"], per_batch, seen, seen % per_batch_now,
        )  # fmt: skip
