"""What every training task shares: `TrainingTask`, the base of our LightningModules, and the
optimizer helpers it is built from.

The base owns the run's seed, the checkpoint metadata, the optimizer with its per-step
learning-rate schedule, the safety callbacks and the NaN guard; a task (vit.lit.ImageClassifier,
vit.language_model.LanguageModel) says only what is its own: the model, the loss and metrics,
and its schedule. Randomness inside a training step is a function of (seed, step, rank), which
makes resuming from a checkpoint exact.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import math
import os
import time
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, LearningRateMonitor
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn

from vit import lightning_compat as compat
from vit.data.sampling import carry_position, data_position
from vit.fault_tolerance import (
    HostCopy,
    InterruptCheckpoint,
    NonFiniteLossError,
    SafeCheckpoints,
    SynchronizedStop,
    nan_advice,
    non_finite,
    trainer_checkpoint_dir,
)
from vit.heads import is_head
from vit.optim import MuonAdamW, split_muon_groups
from vit.options import OptionError, is_number, number, require, upgrade, whole
from vit.schedule import DECAYS, find_budget, warmup_decay, warmup_decay_steps
from vit.seeds import Purpose, RunSeed, global_seed, step_seed

log = logging.getLogger(__name__)


# -- the recipe's option groups ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Optimizer:
    """The optimizer (`model.optimizer`).

    Args:
        name: "adamw"; "sgd" (momentum, Nesterov); or "muon" (Muon on the transformer blocks'
            weight matrices, AdamW on the rest, one lr: vit.optim.MuonAdamW).
        lr: the peak learning rate; with lr_base_batch_size set it is scaled by
            global_batch / lr_base_batch_size (linear scaling: a recipe keeps its rate per image
            on any number of GPUs). A run resumed with another lr trains at it.
        weight_decay: decoupled; none on norms, biases, position embeddings and the CLS token.
        betas: AdamW's (and Muon's AdamW part's). momentum: SGD's.
    """

    name: str = "adamw"
    lr: float = 1e-3
    lr_base_batch_size: int | None = None
    weight_decay: float = 0.05
    betas: tuple[float, float] = (0.9, 0.999)
    momentum: float = 0.9

    def __post_init__(self) -> None:
        name = "model.optimizer."
        require(self.name in ("adamw", "sgd", "muon"), name + "name", self.name, "adamw, sgd or muon")
        number(self.lr, name + "lr", "a learning rate above 0", 0, math.inf, open_low=True)
        if self.lr_base_batch_size is not None:
            whole(self.lr_base_batch_size, 1, name + "lr_base_batch_size", "the batch lr is given for; null: none")
        number(self.weight_decay, name + "weight_decay", "a decay of at least 0 (0 for none)", 0, math.inf)
        betas = self.betas
        pair = isinstance(betas, list | tuple) and len(betas) == 2
        require(pair and all(is_number(b, 0, 1, open_high=True) for b in betas), name + "betas", betas,
                "[beta1, beta2], each in [0, 1) (AdamW's: [0.9, 0.999])")  # fmt: skip
        object.__setattr__(self, "betas", tuple(betas))  # a list when read from YAML
        number(self.momentum, name + "momentum", "a momentum in [0, 1) (SGD's: 0.9)", 0, 1, open_high=True)


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The learning rate's shape over the run (`model.schedule`): linear warmup from ~0 to the
    peak, then decay to min_lr at the run's end (by steps, or by a vit.schedule.WallClockBudget's
    time).

    Args:
        warmup_epochs: warmup length in epochs (fractions allowed); warmup_steps, when given,
            counts optimizer steps instead; warmup_fraction, when given, is a fraction of the whole
            run (of its steps, or of its budget), so it scales with max_epochs or the budget. A
            warmup longer than half the run is cut to half, with a warning.
        min_lr: the rate at the end.
        decay_steps: end the decay at this step instead of the run's last (nanoGPT's
            lr_decay_iters); min_lr after it.
        decay: the decay's shape, "cosine" (half a cosine) or "linear" (a straight line to min_lr).
    """

    warmup_epochs: float = 0.0
    warmup_steps: int | None = None
    warmup_fraction: float | None = None
    min_lr: float = 0.0
    decay_steps: int | None = None
    decay: str = "cosine"

    def __post_init__(self) -> None:
        name = "model.schedule."
        require(self.decay in DECAYS, name + "decay", self.decay, " or ".join(DECAYS))
        number(self.warmup_epochs, name + "warmup_epochs", "epochs of warmup, at least 0", 0, math.inf)
        if self.warmup_steps is not None:
            whole(self.warmup_steps, 0, name + "warmup_steps", "optimizer steps of warmup")
        if self.warmup_fraction is not None:
            number(self.warmup_fraction, name + "warmup_fraction", "the share of the run spent warming up, in [0, 1)",
                   0, 1, open_high=True)  # fmt: skip
        number(self.min_lr, name + "min_lr", "the rate at the end, from 0 to the peak lr", 0, math.inf)
        if self.decay_steps is not None:
            whole(self.decay_steps, 1, name + "decay_steps", "the step the decay ends at")


class TrainingTask(L.LightningModule):
    """Base of the LightningModules: what every task trains with.

    - `seed`: the run's seed, taken from `seed_everything` when a run starts and from the
      checkpoint when it resumes (saved as `vit_seed`), so a resumed run draws what the
      uninterrupted one would even if the new process was seeded differently. The datamodules
      hold it as the task does (vit.seeds.RunSeed).
    - dropout and drop-path masks seeded by (seed, step, rank) before every step: exact resume,
      and ranks differ.
    - the NaN guard: a non-finite loss stops the run on every rank before it reaches the weights,
      without the host waiting for the device at each step.
    - checkpoints: `vit` holds the model name and kwargs (vit.checkpoint.load_model rebuilds the
      model from the file alone); a run resumed with another `lr` trains at it (rescale_lr).
    - the optimizer (`make_optimizer`, AdamW by default) at the peak rate (`peak_lr`), stepped
      each optimizer step by a LambdaLR with the task's multiplier (`lr_schedule`).
    - the callbacks every run carries (`default_callbacks`).

    A task's options are its `model_name` and `model_kwargs`, its `optimizer` (Optimizer) and
    `schedule` (Schedule) groups, and its own; it stores its groups with vit.options.set_option_groups and saves
    its hyperparameters, then builds `self.model` and `self.model_kwargs` in `configure_model`.
    Checkpoints saved before the options were grouped still load: `RENAMED` maps each old option
    to its place (upgrade_hparams).
    """

    model: nn.Module | None
    model_kwargs: dict[str, Any]
    optimizer: Optimizer  # the options; the torch optimizer is self.optimizers()
    schedule: Schedule
    # Flat options of checkpoints from before the groups, and where each went.
    RENAMED: ClassVar[dict[str, str]] = {
        "optimizer": "optimizer.name",
        "lr": "optimizer.lr",
        "lr_base_batch_size": "optimizer.lr_base_batch_size",
        "weight_decay": "optimizer.weight_decay",
        "betas": "optimizer.betas",
        "momentum": "optimizer.momentum",
        "warmup_epochs": "schedule.warmup_epochs",
        "warmup_steps": "schedule.warmup_steps",
        "warmup_fraction": "schedule.warmup_fraction",
        "min_lr": "schedule.min_lr",
    }

    def __init__(self) -> None:
        super().__init__()
        self.seed: int | None = None
        self._batch_idx = 0  # for the NaN guard's message
        # The NaN guard's, since the last optimizer step: (finite?, loss, (step, epoch, batch)).
        self._losses: list[tuple[HostCopy, torch.Tensor, tuple[int, int, int]]] = []

    @classmethod
    def upgrade_hparams(cls, hparams: Mapping[str, Any]) -> dict[str, Any]:
        """A checkpoint's hyperparameters in today's form: flat options of older checkpoints
        (`lr`, `optimizer: adamw`, ...) moved into their groups (`RENAMED`); others unchanged."""
        return upgrade(hparams, cls.RENAMED)

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path: Any, *args: Any, **kwargs: Any) -> Any:
        """Lightning's load_from_checkpoint, also for checkpoints from before the option groups:
        those are read once, their hyperparameters upgraded, and loaded from memory."""
        if isinstance(checkpoint_path, (str, os.PathLike)):
            checkpoint = torch.load(checkpoint_path, map_location="cpu", weights_only=True, mmap=True)
            saved = checkpoint.get("hyper_parameters", {})
            upgraded = cls.upgrade_hparams(saved)
            if upgraded != saved:
                checkpoint["hyper_parameters"] = upgraded
                buffer = io.BytesIO()
                torch.save(checkpoint, buffer)
                buffer.seek(0)
                checkpoint_path = buffer
        return super().load_from_checkpoint(checkpoint_path, *args, **kwargs)

    def setup(self, stage: str) -> None:
        # Before a checkpoint is read: on_load_checkpoint then puts the resumed run's seed in its place.
        self.seed = global_seed()

    # -- training -----------------------------------------------------------------------------

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        torch.manual_seed(step_seed(self.seed or 0, Purpose.DROPOUT, self.trainer, batch_idx))
        self._batch_idx = batch_idx

    def on_before_backward(self, loss: torch.Tensor) -> None:
        """Note whether the loss is finite (every rank's, reduced on the device) without waiting for
        the device: on_before_optimizer_step reads it. The loss is the one backpropagated (divided
        for gradient accumulation, scaled under fp16), which is non-finite exactly when the task's was."""
        bad = (~torch.isfinite(loss.detach())).to(torch.int32)
        if self.trainer.world_size > 1:  # queued on the device; Lightning's reduce would wait for it on the host
            torch.distributed.all_reduce(bad, op=torch.distributed.ReduceOp.MAX)
        where = (self.trainer.global_step, self.trainer.current_epoch, self._batch_idx)
        self._losses.append((HostCopy(bad), loss.detach(), where))

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """The NaN guard: stop on a non-finite loss, on every rank together, before the step changes
        the weights (and so before they reach a checkpoint). Here, after the backward pass is queued,
        the host waits only for the forward passes that made the losses, and the device keeps busy
        with the backward meanwhile; a check before the backward would leave it idle until the host
        queued that. Here, not in training_step, so every task is guarded."""
        self._check_losses()

    def on_train_start(self) -> None:
        self._losses = []  # none left from an earlier fit of this task

    def on_train_end(self) -> None:
        """The losses of batches the run stopped among before their optimizer step (a time budget or
        a signal in the middle of gradient accumulation) are checked too: no step took them, so the
        weights are as they were, but a non-finite one still ends the run as an error."""
        self._check_losses()

    def _check_losses(self) -> None:
        losses, self._losses = self._losses, []
        for bad, loss, (step, epoch, batch_idx) in losses:
            if not bad.get().item():
                continue
            trainer = self.trainer
            weights = non_finite(dict(self.named_parameters()))
            state = (
                f"the weights were already not finite ({', '.join(weights[:3])}): an earlier step made them so"
                if weights
                else "stopped before this step changed the weights"
            )
            value = loss.item()
            where = f"{value}" if not math.isfinite(value) else "not finite on another rank"
            raise NonFiniteLossError(
                f"training loss is {where} at step {step} (epoch {epoch}, batch {batch_idx}); {state}. "
                f"{nan_advice(trainer_checkpoint_dir(trainer))}"
            )

    def configure_optimizers(self) -> dict[str, Any]:
        lr, min_lr = self.peak_lr(), self.schedule.min_lr
        require(min_lr <= self.optimizer.lr, "model.schedule.min_lr", min_lr,
                f"at most model.optimizer.lr {self.optimizer.lr:g}: the rate decays to it")  # fmt: skip
        if min_lr > lr:  # lr_base_batch_size scaled the peak below it: keep the decay's shape
            rank_zero_warn(
                f"the peak lr {lr:g} (model.optimizer.lr {self.optimizer.lr:g} x global batch "
                f"{self.global_batch_size()} / lr_base_batch_size {self.optimizer.lr_base_batch_size}) is below "
                f"model.schedule.min_lr {min_lr:g}: the rate decays to {min_lr * self.lr_scale():g}, scaled alike"
            )
            min_lr *= self.lr_scale()
        optimizer = self.make_optimizer(lr)
        if self.trainer.is_global_zero:
            log.info(self._rates_line(lr, min_lr, [group["lr"] for group in optimizer.param_groups]))
        min_ratio = min_lr / lr
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, self.lr_schedule(min_ratio))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def peak_lr(self) -> float:
        return self.optimizer.lr * self.lr_scale()

    def lr_scale(self) -> float:
        """global batch / lr_base_batch_size when the latter is set (linear lr scaling), else 1."""
        base = self.optimizer.lr_base_batch_size
        return self.global_batch_size() / base if base else 1.0

    def global_batch_size(self) -> int:
        """Samples per optimizer step: the configured batch, or the whole (per-process) training set
        where that is smaller, as the loader then gives."""
        data, world = self.trainer.datamodule, self.trainer.world_size
        per_device = getattr(data, "batch_size", 1) if data is not None else 1
        train = getattr(data, "train_set", None)
        if train is not None:
            per_device = min(per_device, math.ceil(len(train) / world))
        return per_device * world * self.trainer.accumulate_grad_batches

    def _rates_line(self, lr: float, min_lr: float, rates: list[float]) -> str:
        """The rates the run trains at, as it starts: a scaled peak shows its sum, groups their range."""
        base = self.optimizer.lr_base_batch_size
        how = (f" = model.optimizer.lr {self.optimizer.lr:g} x global batch {self.global_batch_size()} / "
               f"lr_base_batch_size {base}") if base else ""  # fmt: skip
        spread = f"; parameter groups from {min(rates):.3g} to {max(rates):.3g}" if min(rates) != max(rates) else ""
        return f"learning rate: peak {lr:.3g}{how}{spread}; the peak decays to {min_lr:.3g}"

    def param_groups(self, lr: float) -> list[dict[str, Any]]:
        """The optimizer's parameter groups (vit.training.param_groups); a task may shape the rates."""
        return param_groups(self.model, self.optimizer.weight_decay, lr)

    def make_optimizer(self, lr: float) -> torch.optim.Optimizer:
        options, groups = self.optimizer, self.param_groups(lr)
        if options.name == "adamw":
            return adamw(groups, lr, options.betas, self.trainer)
        if options.name == "muon":
            hidden = {p for name, p in self.model.named_parameters() if p.ndim == 2 and name.startswith("blocks.")}
            if not any(p.requires_grad for p in hidden):
                raise OptionError(
                    "model.optimizer.name", "muon", f"adamw or sgd: {self.hparams.model_name} trains no weight matrix "
                    "of transformer blocks for Muon to orthogonalise (it has none, or they are frozen)",
                )  # fmt: skip
            # Newton-Schulz in bf16 where the run chose bf16 (GPUs, CPUs with bf16 units): on an
            # AVX512-BF16 CPU the CIFAR ViT's step is 0.65x float32's (benchmarks/muon_step.py).
            ns_dtype = torch.bfloat16 if str(self.trainer.precision).startswith("bf16") else None
            groups = split_muon_groups(groups, hidden)
            return MuonAdamW(groups, lr, options.betas, fused=can_fuse(self.trainer), ns_dtype=ns_dtype)
        return torch.optim.SGD(groups, lr=lr, momentum=options.momentum, nesterov=True)

    def lr_schedule(self, min_ratio: float) -> Callable[[int], float]:
        """The multiplier of the peak rate at each optimizer step, ending at min_ratio: warmup then
        the decay over the run's steps (or to schedule.decay_steps), or, with a WallClockBudget, over
        its time."""
        schedule = self.schedule
        budget = find_budget(self.trainer)
        if budget is not None:  # the schedule follows the clock and ends with the budget
            if schedule.warmup_steps is not None or schedule.warmup_epochs or schedule.decay_steps is not None:
                raise ValueError(
                    "with a WallClockBudget, give the warmup as schedule.warmup_fraction (of the budget), "
                    "and no decay_steps"
                )
            warmup = self._cap_warmup(schedule.warmup_fraction or 0.0, 1.0)
            return lambda step: warmup_decay(budget.progress(), warmup, min_ratio, schedule.decay)
        run = self.trainer.estimated_stepping_batches
        total = schedule.decay_steps or int(run)
        warmup = schedule.warmup_steps
        if schedule.warmup_fraction is not None:
            warmup = round(schedule.warmup_fraction * total)
        elif warmup is None:
            warmup = round(schedule.warmup_epochs * self._steps_per_epoch())
        warmup = self._cap_warmup(warmup, total)
        if schedule.decay_steps is not None and math.isfinite(run) and 0 < run < schedule.decay_steps:
            end = warmup_decay_steps(int(run) - 1, warmup, total, min_ratio, schedule.decay)
            rank_zero_warn(
                f"model.schedule.decay_steps ({schedule.decay_steps}) is past the run's last step ({int(run)}): "
                f"the rate ends at {end:.3g} of the peak, not at min_lr"
            )
        return lambda step: warmup_decay_steps(step, warmup, total, min_ratio, schedule.decay)

    def _steps_per_epoch(self) -> int:
        """Optimizer steps in one epoch. A run bounded by max_steps alone (max_epochs -1) has not
        built its train loader yet (estimated_stepping_batches is max_steps): build it to count."""
        trainer = self.trainer
        if trainer.num_training_batches == math.inf:
            compat.setup_train_data(trainer)  # the loader's resume position is read when the epoch starts
        batches = trainer.num_training_batches
        if batches == math.inf:  # an iterable without a length: the whole run counts as one epoch
            return int(trainer.estimated_stepping_batches)
        return max(1, math.ceil(batches / trainer.accumulate_grad_batches))

    def _cap_warmup(self, warmup: float, total: float) -> float:
        """A warmup longer than half the run leaves no time to learn at the peak rate and decay: cut it.
        A run without training steps (limit_train_batches 0, to validate a checkpoint) has none to cut."""
        if 0 < total / 2 < warmup:
            rank_zero_warn(
                f"warmup ({warmup:g}) is longer than half the run ({total:g}); using {total / 2:g}. "
                "Give it as model.schedule.warmup_fraction to scale it with the run's length."
            )
            return type(warmup)(total / 2)
        return warmup

    # -- checkpoints and callbacks --------------------------------------------------------------

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Enough to rebuild the bare model without Lightning: vit.checkpoint.load_model(path).
        checkpoint["vit"] = {"model_name": self.hparams.model_name, "model_kwargs": dict(self.model_kwargs)}
        checkpoint["vit_seed"] = self.seed
        trainer = compat.attached_trainer(self)
        if trainer is not None:  # what a resume with another batch or process count adapts
            checkpoint["vit_data"] = data_position(trainer)
            checkpoint["vit_peak_lr"] = self.peak_lr()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.seed = checkpoint.get("vit_seed", self.seed)
        trainer = compat.attached_trainer(self)
        if trainer is None:
            return
        datamodule = getattr(trainer, "datamodule", None)
        if isinstance(datamodule, RunSeed) and "vit_seed" in checkpoint:  # saved before datamodules held the seed
            checkpoint.setdefault(type(datamodule).__qualname__, {}).setdefault("seed", checkpoint["vit_seed"])
        if "vit_data" in checkpoint:
            carry_position(checkpoint, checkpoint["vit_data"], data_position(trainer))
        saved_peak = checkpoint.get("vit_peak_lr")
        if saved_peak is not None:  # the peak rate follows lr and, with lr_base_batch_size, the global batch
            rescale_lr(checkpoint, self.peak_lr() / saved_peak, f"peak lr {self.peak_lr():g}", f"{saved_peak:g}")
        else:  # a checkpoint from before vit_peak_lr was saved: the lr option alone
            old = self.upgrade_hparams(checkpoint.get("hyper_parameters", {})).get("optimizer", {}).get("lr")
            if old:
                lr = self.optimizer.lr
                rescale_lr(checkpoint, lr / old, f"lr {lr:g}", f"{old:g}")

    def configure_callbacks(self) -> list[Callback]:
        return default_callbacks(self.trainer)


def default_callbacks(trainer: L.Trainer) -> list[Callback]:
    """The safety net every task carries: atomic checkpoint writes, a checkpoint on interruption
    (taken by every DDP rank after the same step), and the lr in the logs."""
    callbacks: list[Callback] = [
        SafeCheckpoints(),
        SynchronizedStop(),
        InterruptCheckpoint(trainer_checkpoint_dir(trainer)),
    ]
    if trainer.loggers:
        callbacks.append(LearningRateMonitor(logging_interval="step"))
    return callbacks


def rescale_lr(checkpoint: dict[str, Any], ratio: float, now: str, saved: str) -> None:
    """A run resumed with another `lr` (e.g. after a NaN loss), or, with lr_base_batch_size, another
    global batch, trains at its own peak rate: the optimizer's and the schedule's saved rates, which
    would otherwise win, are scaled by new / old, so warmup, cosine, layer decay and the head's rate
    keep their shape. Said in the log."""
    if ratio == 1:
        return
    for state in checkpoint.get("optimizer_states", []):
        for group in state["param_groups"]:
            for key in ("lr", "initial_lr"):
                if key in group:
                    group[key] *= ratio
    for state in checkpoint.get("lr_schedulers", []):
        for key in ("base_lrs", "_last_lr"):
            if key in state:
                state[key] = [v * ratio for v in state[key]]
    log.info("resuming with %s instead of the checkpoint's %s: the saved rates are scaled by %g", now, saved, ratio)


def images_in(batch: Any) -> int:
    """The images of a training batch: an (inputs, targets) pair counts its targets (the inputs may
    be a dict of patch sequences, data.naflex); any other batch the rows of its first tensor."""
    if isinstance(batch, tuple | list):
        if len(batch) >= 2 and isinstance(batch[1], torch.Tensor):
            return len(batch[1])
        batch = batch[0]
    if isinstance(batch, Mapping):
        batch = next(iter(batch.values()))
    return len(batch)


class StepTimer(Callback):
    """Images per second over the optimizer steps after the first `warmup` (compilation, autotuning,
    loader start-up), data loading included. On CUDA the span is read from events queued on the
    training stream, so the host never waits for the device inside it, as in a run that does not
    read a value back each step; `sync_each_step` makes it wait after every step, as Lightning's
    progress bar does when it shows the logged loss (`prog_bar=True`) at every step.
    `backend`: the process group's, under DDP. What the GPU and data checks (vit.tools) measure;
    Throughput is the per-epoch figure a run logs (`--trainer.callbacks+=vit.training.Throughput`)."""

    def __init__(self, warmup: int = 0, sync_each_step: bool = False) -> None:
        self.warmup, self.sync_each_step = warmup, sync_each_step
        self.images = 0
        self.backend: str | None = None
        self._start: float | torch.cuda.Event | None = None
        self._end: float | torch.cuda.Event | None = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            self.backend = torch.distributed.get_backend()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        cuda = trainer.strategy.root_device.type == "cuda"
        if cuda and self.sync_each_step:
            torch.cuda.synchronize()
        if trainer.global_step == self.warmup:
            self._start = _now(cuda)
        elif trainer.global_step > self.warmup:
            self._end = _now(cuda)
            self.images += images_in(batch) * trainer.world_size

    @property
    def seconds(self) -> float:
        """From the end of the warmup's last step to the end of the last step timed (0 before)."""
        if self._start is None or self._end is None:
            return 0.0
        if isinstance(self._end, torch.cuda.Event):
            self._end.synchronize()
            return self._start.elapsed_time(self._end) / 1e3
        return self._end - self._start

    @property
    def images_per_second(self) -> float | None:
        return self.images / self.seconds if self.seconds else None


def _now(cuda: bool) -> float | torch.cuda.Event:
    """The time, or on CUDA an event the current stream reaches once the work queued so far is done."""
    if not cuda:
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


class Throughput(Callback):
    """Training images per second, data loading included and validation excluded: logged per
    epoch as `train/img_per_s` (the mean over ranks) and, for the whole run, `images_per_second`,
    which benchmarks/finetune_study.py reads after `fit`.

    Kept beside Lightning's ThroughputMonitor, which reports something else: rates over its last
    `window_size` batches (each window leaving out its first batch's time), to a logger only, on
    rank 0 only, with nothing a script can read back (it does give FLOPs and MFU, from a model's
    `flops_per_batch`). Both on one run (vit_nano_patch4_16 on the digits, batch 64, 4 epochs of
    22 steps, 2-core CPU): ours 467, 465, 467, 474 img/s per epoch and 468.5 for the run; its
    22-batch windows ending with each epoch 469, 468, 469, 476, those across an epoch's end
    (validation, checkpoints) 456-457, and its run totals 463.3 (train/samples / train/time).
    """

    def __init__(self) -> None:
        self.images, self.seconds = 0, 0.0
        self._epoch_start: float | None = None

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._epoch_start, self._val_seconds, self._epoch_images = time.perf_counter(), 0.0, 0

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._val_start = time.perf_counter()

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._epoch_start is not None:  # not the sanity check before training
            self._val_seconds += time.perf_counter() - self._val_start

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        self._epoch_images += images_in(batch)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        seconds = time.perf_counter() - self._epoch_start - self._val_seconds
        self.images += self._epoch_images
        self.seconds += seconds
        pl_module.log("train/img_per_s", self._epoch_images / seconds, sync_dist=True)

    @property
    def images_per_second(self) -> float:
        return self.images / self.seconds if self.seconds else float("nan")


# -- optimizer ---------------------------------------------------------------------------------


def param_groups(
    model: nn.Module,
    weight_decay: float,
    lr: float,
    layer_decay: float | None = None,
    head_lr: float | None = None,
) -> list[dict[str, Any]]:
    """Optimizer groups by (learning rate, weight decay).

    No weight decay on norms, biases and the model's `no_weight_decay()` names (pos_embed,
    cls_token). With `layer_decay` (BEiT/MAE fine-tuning), a ViT's block i gets
    lr * layer_decay ** (depth - i) and the embeddings lr * layer_decay ** (depth + 1), so early
    layers move less; `head_lr` sets the classifier head's rate. Frozen parameters are left out.
    """
    skip = model.no_weight_decay() if hasattr(model, "no_weight_decay") else set()
    depth = len(model.blocks) if layer_decay is not None and hasattr(model, "blocks") else None
    if layer_decay is not None and depth is None:
        raise ValueError(f"layer_decay needs a model with transformer blocks, not {type(model).__name__}")
    groups: dict[tuple[float, float], list[nn.Parameter]] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        wd = 0.0 if p.ndim <= 1 or name in skip else weight_decay
        group_lr = lr
        if depth is not None:
            group_lr = lr * layer_decay ** (depth + 1 - _layer_id(name, depth))
        if head_lr is not None and is_head(name):
            group_lr = head_lr
        groups.setdefault((group_lr, wd), []).append(p)
    return [{"params": ps, "lr": group_lr, "weight_decay": wd} for (group_lr, wd), ps in groups.items()]


def _layer_id(name: str, depth: int) -> int:
    """0 for the embeddings (NaFlexVit's: `embeds`), i + 1 for block i, depth + 1 for the final norm and the head."""
    if name.startswith(("patch_embed", "embeds.", "cls_token", "dist_token", "reg_token", "pos_embed")):
        return 0
    if name.startswith("blocks."):
        return int(name.split(".")[1]) + 1
    return depth + 1


def adamw(groups: list[dict], lr: float, betas: tuple[float, float], trainer: L.Trainer) -> torch.optim.AdamW:
    """AdamW with its fused kernel: one pass over all parameters instead of a loop of small ops
    (ViT-B's step on a CPU core: 0.42 s -> 0.08 s, benchmarks/README.md). Not under fp16 loss
    scaling, where Lightning must unscale the gradients itself before clipping them."""
    return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=can_fuse(trainer))


def can_fuse(trainer: L.Trainer) -> bool:
    """Fused optimizer kernels, except under fp16 loss scaling (Lightning unscales before clipping)."""
    return str(trainer.precision) != "16-mixed"
