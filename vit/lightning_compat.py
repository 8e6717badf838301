"""Every private or undocumented Lightning member that vit uses, behind one door.

Lightning renames and reshapes its internals between releases; a member used here and there
broke four files at once on an upgrade. Here each one has an accessor, and `PRIVATE_MEMBERS`
lists them all (with the hooks our subclasses override), each with why no public API does, so
that `missing_private_members()` names the ones an installed Lightning lacks:
tests/test_lightning_compat.py fails with those names, and also when a file other than this one
reaches into Lightning's internals. Importing vit never fails for a missing member; a call does.
"""

from __future__ import annotations

import importlib
import logging
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import ModelParallelStrategy

CHECKPOINT = "lightning.pytorch.callbacks.ModelCheckpoint"
TRAINER = "lightning.pytorch.Trainer"
MODULE = "lightning.pytorch.LightningModule"
PARALLEL = "lightning.pytorch.strategies.ModelParallelStrategy"
CLI = "lightning.pytorch.cli.LightningCLI"

# (owner, member, why): every private member vit uses or overrides, a dotted path from the owner.
PRIVATE_MEMBERS: tuple[tuple[str, str, str], ...] = (
    # RunCheckpoint (vit.fault_tolerance) saves top-k at validations and last.ckpt at every save
    # point, re-using ModelCheckpoint's triggers and writers, which have no public form.
    (CHECKPOINT, "_every_n_train_steps", "the step trigger; no public getter"),
    (CHECKPOINT, "_train_time_interval", "the time trigger; no public getter"),
    (CHECKPOINT, "_every_n_epochs", "the epoch trigger, read with the other two as resolved at init"),
    (CHECKPOINT, "_last_time_checked", "the time trigger's clock, which RunCheckpoint runs"),
    (CHECKPOINT, "_last_global_step_saved", "whether this step is saved already"),
    (CHECKPOINT, "_monitor_candidates", "the metrics a checkpoint is ranked and named by"),
    (CHECKPOINT, "_save_topk_checkpoint", "rank and write best-*.ckpt at a validation"),
    (CHECKPOINT, "_save_last_checkpoint", "write last.ckpt outside Lightning's save points"),
    (CHECKPOINT, "_should_save_on_train_epoch_end", "where the epoch's save point is"),
    (CHECKPOINT, "_should_skip_saving_checkpoint", "Lightning's no-save cases (sanity check, fast_dev_run, ...)"),
    # The position in the epoch: resumable loading (vit.data.sampling), per-batch Mixup seeds (datamodules).
    (
        TRAINER,
        "fit_loop.epoch_loop.batch_progress.current.ready",
        "this batch's index while it is transferred (Mixup seeds)",
    ),
    (TRAINER, "fit_loop.epoch_loop.batch_progress.current.processed", "batches trained this epoch, restored on resume"),
    (TRAINER, "fit_loop.setup_data", "build the train loader early to count an epoch's steps (vit.training)"),
    (TRAINER, "_signal_connector.received_sigterm", "stop every DDP rank as SIGTERM stops one (SynchronizedStop)"),
    (MODULE, "_trainer", "the trainer or None: LightningModule.trainer raises when there is none"),
    # ShardedStrategy (vit.sharding) is FSDP2 over every process, its saves atomic.
    (PARALLEL, "_data_parallel_size", "one data-parallel dimension over all processes, not over nodes"),
    (PARALLEL, "_tensor_parallel_size", "no tensor parallelism"),
    (PARALLEL, "_save_distributed_checkpoint", "sharded saves go to a temporary name, then renamed"),
    ("lightning.fabric.utilities.load", "_load_distributed_checkpoint", "read a sharded checkpoint into one dict"),
    # TrainCLI (vit.cli) overrides it: `--ckpt_path last`, incomplete files and conflicting options.
    (CLI, "_parse_ckpt_path", "overridden: the one hook that sees ckpt_path before the model is built"),
)

# Keys of a saved checkpoint's loops (checkpoint["loops"]["fit_loop"][key]) that we read or rewrite:
# the progress counters are an undocumented format, with these fields.
CHECKPOINT_LOOP_KEYS: tuple[tuple[str, str], ...] = (
    ("epoch_loop.batch_progress", "a resumed epoch's position, carried to another batch size (vit.data.sampling)"),
    ("epoch_loop.val_loop.batch_progress", "a run stopped in validation validates again (vit.fault_tolerance)"),
)
PROGRESS_FIELDS = ("total", "current", "is_last_batch")
COUNTER_FIELDS = ("ready", "started", "processed", "completed")


# -- ModelCheckpoint --------------------------------------------------------------------------------


def checkpoint_triggers(callback: ModelCheckpoint) -> tuple[int, timedelta | None, int]:
    """every_n_train_steps, train_time_interval, every_n_epochs as ModelCheckpoint resolved them."""
    return callback._every_n_train_steps, callback._train_time_interval, callback._every_n_epochs


def last_time_checked(callback: ModelCheckpoint) -> float | None:
    """When the time trigger last fired (time.monotonic(); None before the first batch)."""
    return callback._last_time_checked


def set_last_time_checked(callback: ModelCheckpoint, when: float) -> None:
    callback._last_time_checked = when


def last_step_saved(callback: ModelCheckpoint) -> int:
    return callback._last_global_step_saved


def monitor_candidates(callback: ModelCheckpoint, trainer: L.Trainer) -> dict[str, torch.Tensor]:
    return callback._monitor_candidates(trainer)


def save_topk(callback: ModelCheckpoint, trainer: L.Trainer, candidates: dict[str, torch.Tensor]) -> None:
    callback._save_topk_checkpoint(trainer, candidates)


def save_last(callback: ModelCheckpoint, trainer: L.Trainer, candidates: dict[str, torch.Tensor]) -> None:
    callback._save_last_checkpoint(trainer, candidates)


def saves_on_train_epoch_end(callback: ModelCheckpoint, trainer: L.Trainer) -> bool:
    return callback._should_save_on_train_epoch_end(trainer)


def skips_saving(callback: ModelCheckpoint, trainer: L.Trainer) -> bool:
    return callback._should_skip_saving_checkpoint(trainer)


# -- Trainer and LightningModule --------------------------------------------------------------------


def batches_ready(trainer: L.Trainer) -> int:
    """Batches of this epoch counted ready: in on_after_batch_transfer the index of the batch being
    transferred (it is counted after its transfer), from on_train_batch_start on one more."""
    return trainer.fit_loop.epoch_loop.batch_progress.current.ready


def batches_processed(trainer: L.Trainer) -> int:
    """Batches of this epoch whose training step finished; restored from a checkpoint on resume."""
    return trainer.fit_loop.epoch_loop.batch_progress.current.processed


def setup_train_data(trainer: L.Trainer) -> None:
    trainer.fit_loop.setup_data()


def stop_as_sigterm(trainer: L.Trainer) -> None:
    """Lightning raises SIGTERMException at the end of this step, as if SIGTERM had arrived."""
    trainer._signal_connector.received_sigterm = True


def attached_trainer(module: L.LightningModule) -> L.Trainer | None:
    return module._trainer


# -- ModelParallelStrategy and sharded checkpoints --------------------------------------------------


def set_parallel_sizes(strategy: ModelParallelStrategy, data_parallel: int, tensor_parallel: int) -> None:
    """The device mesh's sizes, set before setup_environment builds it (the constructor's 'auto'
    data-parallel size is the node count, and the process count is not known then)."""
    strategy._data_parallel_size = data_parallel
    strategy._tensor_parallel_size = tensor_parallel


def saves_distributed(strategy: ModelParallelStrategy) -> bool:
    return strategy._save_distributed_checkpoint


def load_distributed_checkpoint(path: str | Path) -> dict[str, Any]:
    from lightning.fabric.utilities.load import _load_distributed_checkpoint

    return _load_distributed_checkpoint(Path(path))


# -- a saved checkpoint's loop state ----------------------------------------------------------------


def saved_batch_progress(checkpoint: dict[str, Any]) -> dict[str, Any] | None:
    """The training epoch's progress counters in a checkpoint ({"current": {...}, ...}), if any."""
    return checkpoint.get("loops", {}).get("fit_loop", {}).get(CHECKPOINT_LOOP_KEYS[0][0])


def saved_val_batch_progress(checkpoint: dict[str, Any]) -> dict[str, Any] | None:
    return checkpoint.get("loops", {}).get("fit_loop", {}).get(CHECKPOINT_LOOP_KEYS[1][0])


# -- the check ---------------------------------------------------------------------------------------


def _quiet_trainer() -> L.Trainer:
    """A bare Trainer to look members up on, without its info lines (GPU available, ...)."""
    import lightning as L

    logger = logging.getLogger("lightning.pytorch")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        return L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    finally:
        logger.setLevel(level)


def _probe(owner: str) -> tuple[str, Any]:
    """The owner's display name ("ModelCheckpoint", a module's full name) and the class or module."""
    try:
        return owner, importlib.import_module(owner)  # a module: named in full
    except ImportError:
        module, _, name = owner.rpartition(".")
        return name, getattr(importlib.import_module(module), name, None)


def missing_private_members() -> list[str]:
    """The members of PRIVATE_MEMBERS and CHECKPOINT_LOOP_KEYS that the installed Lightning lacks,
    as "ModelCheckpoint._save_topk_checkpoint"; empty when all are there."""
    from lightning.pytorch import LightningModule
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import ModelParallelStrategy

    trainer = _quiet_trainer()
    instances = {"Trainer": trainer, "ModelCheckpoint": ModelCheckpoint(), "LightningModule": LightningModule(),
                 "ModelParallelStrategy": ModelParallelStrategy()}  # fmt: skip
    missing = []
    for owner, member, _why in PRIVATE_MEMBERS:
        name, found = _probe(owner)
        found = instances.get(name, found)
        for part in member.split("."):
            found = getattr(found, part, _MISSING)
            if found is _MISSING:
                missing.append(f"{name}.{member}")
                break
    loops = trainer.fit_loop.state_dict()
    for key, _why in CHECKPOINT_LOOP_KEYS:
        progress = loops.get(key)
        where = f'checkpoint["loops"]["fit_loop"]["{key}"]'
        if not isinstance(progress, dict):
            missing.append(where)
            continue
        missing += [f'{where}["{field}"]' for field in PROGRESS_FIELDS if field not in progress]
        for counters in ("total", "current"):
            have = progress.get(counters, {})
            missing += [f'{where}["{counters}"]["{field}"]' for field in COUNTER_FIELDS if field not in have]
    return missing


_MISSING = object()
