"""LightningModules: image classification (any registered model) and its training recipe.

Optimisation: AdamW (or SGD) without weight decay on norms, biases, position embeddings and the
CLS token; per-step linear warmup then cosine decay; optional weight EMA. Randomness inside a
training step is a function of (seed, step, rank), which makes resuming from a checkpoint exact.
"""

from __future__ import annotations

import logging
import math
import os
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback, LearningRateMonitor
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torchmetrics.classification import MulticlassAccuracy

from vit.checkpoint import load_pretrained
from vit.data.sampling import mix_seed
from vit.fault_tolerance import (
    NAN_ADVICE,
    InterruptCheckpoint,
    NonFiniteLossError,
    SafeCheckpoints,
    last_good,
    non_finite,
)
from vit.layers import MoE
from vit.optim import MuonAdamW, split_muon_groups
from vit.registry import create_model
from vit.schedule import cosine_decay, find_budget
from vit.schedule import warmup_cosine as warmup_cosine_progress

log = logging.getLogger(__name__)


class Throughput(Callback):
    """Training images per second (data loading included, validation excluded), logged per epoch
    as `train/img_per_s`."""

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
        self._epoch_images += len(batch[0])

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        seconds = time.perf_counter() - self._epoch_start - self._val_seconds
        self.images += self._epoch_images
        self.seconds += seconds
        pl_module.log("train/img_per_s", self._epoch_images / seconds, sync_dist=True)

    @property
    def images_per_second(self) -> float:
        return self.images / self.seconds if self.seconds else float("nan")


def accuracy(num_classes: int, top_k: int) -> MulticlassAccuracy:
    """Top-k accuracy over samples (micro), synced across processes; torchmetrics' default is
    the per-class (macro) mean, which is not what papers report."""
    return MulticlassAccuracy(num_classes, top_k=min(top_k, num_classes), average="micro")


def warmup_cosine(step: int, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """Learning-rate multiplier: linear from ~0 to 1 over warmup_steps, then cosine down to min_ratio."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    return cosine_decay((step - warmup_steps) / max(1, total_steps - warmup_steps), min_ratio)


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
        if head_lr is not None and _is_head(name):
            group_lr = head_lr
        groups.setdefault((group_lr, wd), []).append(p)
    return [{"params": ps, "lr": group_lr, "weight_decay": wd} for (group_lr, wd), ps in groups.items()]


def _layer_id(name: str, depth: int) -> int:
    """0 for the embeddings, i + 1 for block i, depth + 1 for the final norm and the head."""
    if name.startswith(("patch_embed", "cls_token", "pos_embed")):
        return 0
    if name.startswith("blocks."):
        return int(name.split(".")[1]) + 1
    return depth + 1


HEAD_NAMES = ("head", "fc", "linear")  # the classifier of our ViTs, torchvision ResNets, CIFAR ResNets


def _is_head(name: str) -> bool:
    return name.split(".")[0] in HEAD_NAMES


def adamw(groups: list[dict], lr: float, betas: tuple[float, float], trainer: L.Trainer) -> torch.optim.AdamW:
    """AdamW with its fused kernel: one pass over all parameters instead of a loop of small ops
    (ViT-B's step on a CPU core: 0.42 s -> 0.08 s, benchmarks/README.md). Not under fp16 loss
    scaling, where Lightning must unscale the gradients itself before clipping them."""
    return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=can_fuse(trainer))


def can_fuse(trainer: L.Trainer) -> bool:
    """Fused optimizer kernels, except under fp16 loss scaling (Lightning unscales before clipping)."""
    return str(trainer.precision) != "16-mixed"


class ImageClassifier(L.LightningModule):
    """Trains any registered model (`vit.list_models()`) as an image classifier.

    Args:
        model_name: registry name, e.g. "vit_small_patch16_224" or "resnet20".
        model_kwargs: overrides of the model's config (img_size, drop_path_rate, global_pool, ...).
        num_classes: None takes the datamodule's.
        optimizer: "adamw", "sgd" (momentum, nesterov) or "muon" (Muon on the transformer blocks'
            weight matrices, AdamW on the rest, one lr: vit.optim.MuonAdamW).
        lr: peak learning rate; with lr_base_batch_size set it is scaled by global_batch / lr_base_batch_size.
        warmup_epochs: linear warmup length (fractions allowed), then cosine decay to min_lr;
            warmup_steps, when given, counts optimizer steps instead; warmup_fraction, when given,
            is a fraction of the whole run (of its steps, or of a vit.schedule.WallClockBudget),
            so it scales with max_epochs or the budget. A warmup longer than half the run is cut
            to half, with a warning.
        label_smoothing: for the cross-entropy loss (works with Mixup's soft targets too).
        tta_flip: evaluate (validation, test, predict) on the mean of the logits of the image and
            its mirror image.
        ema_decay: keep an exponential moving average of the weights; validation also reports it.
        compile: run the model through torch.compile (the checkpoint keeps the plain weights).
        channels_last: keep conv weights and input batches in NHWC memory order, which oneDNN and
            cuDNN convolutions run faster (ResNet-20 training on an AVX2 CPU: +9%); same results.
        grad_checkpointing: recompute block activations in backward (ViT-L/H at larger batches).
        init_from: start from these weights (our .ckpt, a timm .pth/.bin/.safetensors, a Google .npz,
            or timm:<name>), adapted to the model (position embedding resampled, new head); see
            vit.checkpoint.load_pretrained.
        layer_decay: layer-wise lr decay for fine-tuning ViTs (e.g. 0.75); head_lr: the head's own lr
            (also scaled by the batch size).
        freeze_backbone: train only the head (a linear probe); freeze_blocks: freeze the patch and
            position embeddings and the first K blocks. Frozen parts run in eval mode.
        aux_loss_weight: weight of a mixture-of-experts model's load-balancing loss
            (`model.aux_loss()`, logged as train/aux_loss) in the training loss; 0.01 as in Switch.
    """

    def __init__(
        self,
        model_name: str = "vit_nano_patch4_16",
        model_kwargs: dict[str, Any] | None = None,
        num_classes: int | None = None,
        optimizer: str = "adamw",
        lr: float = 1e-3,
        lr_base_batch_size: int | None = None,
        weight_decay: float = 0.05,
        betas: tuple[float, float] = (0.9, 0.999),
        momentum: float = 0.9,
        warmup_epochs: float = 0.0,
        warmup_steps: int | None = None,
        warmup_fraction: float | None = None,
        min_lr: float = 0.0,
        label_smoothing: float = 0.0,
        tta_flip: bool = False,
        ema_decay: float | None = None,
        compile: bool = False,
        channels_last: bool = False,
        grad_checkpointing: bool = False,
        init_from: str | None = None,
        layer_decay: float | None = None,
        head_lr: float | None = None,
        freeze_backbone: bool = False,
        freeze_blocks: int = 0,
        aux_loss_weight: float = 0.01,
    ) -> None:
        super().__init__()
        if optimizer not in ("adamw", "sgd", "muon"):
            raise ValueError(f"optimizer must be 'adamw', 'sgd' or 'muon', got {optimizer!r}")
        self.save_hyperparameters()
        self.model: nn.Module | None = None
        if num_classes is not None:
            self.configure_model()

    def configure_model(self) -> None:
        """Build the model, once; num_classes comes from the datamodule unless it was given."""
        if self.model is not None:
            return
        hp = self.hparams
        if hp.num_classes is None:
            datamodule = self.trainer.datamodule if self._trainer is not None else None
            if datamodule is None or not hasattr(datamodule, "num_classes"):
                raise ValueError("num_classes is not set and there is no datamodule with a num_classes to take it from")
            hp.num_classes = datamodule.num_classes
        self.model_kwargs = {**(hp.model_kwargs or {}), "num_classes": hp.num_classes}
        self.model = create_model(hp.model_name, **self.model_kwargs)
        if hp.channels_last:
            self.model.to(memory_format=torch.channels_last)
        self.has_aux_loss = any(isinstance(m, MoE) for m in self.model.modules())
        if hp.init_from:
            load_pretrained(self.model, hp.init_from)
        self._freeze()
        if hp.grad_checkpointing:
            if not hasattr(self.model, "set_grad_checkpointing"):
                raise ValueError(f"{hp.model_name} does not support grad_checkpointing (only the ViTs do)")
            self.model.set_grad_checkpointing(True)
        self.ema = None
        if hp.ema_decay is not None:
            self.ema = AveragedModel(self.model, multi_avg_fn=get_ema_multi_avg_fn(hp.ema_decay), use_buffers=True)
            self.ema.requires_grad_(False)  # not trained by the optimizer; DDP must not wait for its grads
        # Kept out of the module tree so checkpoints hold the plain model's weights, not `_orig_mod.` copies.
        self.__dict__["_compiled"] = torch.compile(self.model) if hp.compile else None
        self.train_acc1 = accuracy(hp.num_classes, top_k=1)
        self.val_acc1 = accuracy(hp.num_classes, top_k=1)
        self.val_acc5 = accuracy(hp.num_classes, top_k=5)
        self.val_ema_acc1 = accuracy(hp.num_classes, top_k=1)
        self.test_acc1 = accuracy(hp.num_classes, top_k=1)
        self.test_acc5 = accuracy(hp.num_classes, top_k=5)

    def setup(self, stage: str) -> None:
        """A head for another number of classes than the data's fails late and cryptically ("Target
        7 is out of bounds") or trains silently with unused outputs: refuse it before the run."""
        data = self.trainer.datamodule
        classes = getattr(data, "num_classes", None)
        if classes is not None and self.hparams.num_classes is not None and classes != self.hparams.num_classes:
            raise ValueError(
                f"model.num_classes is {self.hparams.num_classes} but the data has {classes} classes; "
                "leave num_classes unset to take the data's"
            )

    def _freeze(self) -> None:
        hp = self.hparams
        if hp.freeze_backbone:
            for name, p in self.model.named_parameters():
                p.requires_grad_(_is_head(name))
            if not any(p.requires_grad for p in self.model.parameters()):
                raise ValueError(f"freeze_backbone: {hp.model_name} has no head named {' / '.join(HEAD_NAMES)}")
        if hp.freeze_blocks:
            if not hasattr(self.model, "blocks"):
                raise ValueError(f"freeze_blocks needs a model with transformer blocks, not {hp.model_name}")
            frozen = [self.model.patch_embed, *self.model.blocks[: hp.freeze_blocks]]
            for module in frozen:
                module.requires_grad_(False)
            for name in ("cls_token", "pos_embed"):
                if getattr(self.model, name, None) is not None:
                    getattr(self.model, name).requires_grad_(False)

    def on_train_epoch_start(self) -> None:
        # Frozen parts behave as at inference: no dropout/drop-path, BatchNorm statistics kept.
        for module in self.model.modules():
            params = list(module.parameters())
            if params and not any(p.requires_grad for p in params):
                module.eval()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        model = self._compiled if self._compiled is not None else self.model
        if self.hparams.channels_last and x.ndim == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        return model(x)

    def eval_logits(self, x: torch.Tensor) -> torch.Tensor:
        """Logits for evaluation: with tta_flip, the mean over the image and its mirror image."""
        logits = self(x)
        return (logits + self(x.flip(-1))) / 2 if self.hparams.tta_flip else logits

    def loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits, target, label_smoothing=self.hparams.label_smoothing)

    # -- training -----------------------------------------------------------------------------

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # Dropout and drop-path masks depend only on (seed, step, rank): exact resume, and ranks differ.
        torch.manual_seed(mix_seed(_global_seed(), self.global_step, self.global_rank, 2))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, target = batch  # target: class ids (B,), or soft (B, classes) after Mixup/CutMix
        logits = self(x)
        loss = self.loss(logits, target)
        if self.has_aux_loss:  # mixture of experts: keep the routers balanced
            aux = self.model.aux_loss()
            self.log("train/aux_loss", aux)
            loss = loss + self.hparams.aux_loss_weight * aux
        check_finite(self, loss, batch_idx)
        self.log("train/loss", loss, prog_bar=True)
        if target.ndim == 1:
            self.train_acc1(logits, target)
            self.log("train/acc1", self.train_acc1, on_step=False, on_epoch=True)
        return loss

    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        super().optimizer_step(*args, **kwargs)
        if self.ema is not None:
            self.ema.update_parameters(self.model)

    def configure_optimizers(self) -> dict[str, Any]:
        hp = self.hparams
        scale = self.global_batch_size() / hp.lr_base_batch_size if hp.lr_base_batch_size else 1.0
        lr, head_lr = hp.lr * scale, hp.head_lr * scale if hp.head_lr is not None else None
        groups = param_groups(self.model, hp.weight_decay, lr, hp.layer_decay, head_lr)
        if hp.optimizer == "adamw":
            optimizer = adamw(groups, lr, tuple(hp.betas), self.trainer)
        elif hp.optimizer == "muon":
            hidden = {p for name, p in self.model.named_parameters() if p.ndim == 2 and name.startswith("blocks.")}
            optimizer = MuonAdamW(split_muon_groups(groups, hidden), lr, tuple(hp.betas), fused=can_fuse(self.trainer))
        else:
            optimizer = torch.optim.SGD(groups, lr=lr, momentum=hp.momentum, nesterov=True)
        min_ratio = hp.min_lr / lr if lr > 0 else 0.0
        budget = find_budget(self.trainer)
        if budget is not None:  # the schedule follows the clock and ends with the budget
            if hp.warmup_steps is not None or hp.warmup_epochs:
                raise ValueError("with a WallClockBudget, give the warmup as warmup_fraction (of the budget)")
            warmup = self._cap_warmup(hp.warmup_fraction or 0.0, 1.0)
            schedule = lambda step: warmup_cosine_progress(budget.progress(), warmup, min_ratio)  # noqa: E731
        else:
            total = int(self.trainer.estimated_stepping_batches)
            warmup = hp.warmup_steps
            if hp.warmup_fraction is not None:
                warmup = round(hp.warmup_fraction * total)
            elif warmup is None:
                batches = self.trainer.num_training_batches  # known once estimated_stepping_batches ran
                per_epoch = math.ceil(batches / self.trainer.accumulate_grad_batches) if batches != math.inf else total
                warmup = round(hp.warmup_epochs * per_epoch)
            warmup = self._cap_warmup(warmup, total)
            schedule = lambda step: warmup_cosine(step, warmup, total, min_ratio)  # noqa: E731
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def _cap_warmup(self, warmup: float, total: float) -> float:
        """A warmup longer than half the run leaves no time to learn at the peak rate and decay: cut it."""
        if warmup > total / 2:
            rank_zero_warn(
                f"warmup ({warmup:g}) is longer than half the run ({total:g}); using {total / 2:g}. "
                "Give it as model.warmup_fraction to scale it with the run's length."
            )
            return type(warmup)(total / 2)
        return warmup

    def global_batch_size(self) -> int:
        """Images per optimizer step: the configured batch, or the whole (per-process) training set
        where that is smaller, as the loader then gives."""
        data, world = self.trainer.datamodule, self.trainer.world_size
        per_device = data.batch_size if data is not None else 1
        train = getattr(data, "train_set", None)
        if train is not None:
            per_device = min(per_device, math.ceil(len(train) / world))
        return per_device * world * self.trainer.accumulate_grad_batches

    # -- evaluation ---------------------------------------------------------------------------

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self.eval_logits(x)
        self.log("val/loss", F.cross_entropy(logits, y), prog_bar=True, sync_dist=True)
        self.val_acc1(logits, y)
        self.val_acc5(logits, y)
        self.log("val/acc1", self.val_acc1, prog_bar=True)
        self.log("val/acc5", self.val_acc5)
        if self.ema is not None:
            self.val_ema_acc1(self.ema(x), y)
            self.log("val/ema_acc1", self.val_ema_acc1)

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self.eval_logits(x)
        self.log("test/loss", F.cross_entropy(logits, y), sync_dist=True)
        self.test_acc1(logits, y)
        self.test_acc5(logits, y)
        self.log("test/acc1", self.test_acc1)
        self.log("test/acc5", self.test_acc5)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x = batch[0] if isinstance(batch, (tuple, list)) else batch
        return self.eval_logits(x).softmax(dim=-1)

    # -- checkpoints and callbacks --------------------------------------------------------------

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Enough to rebuild the bare model without Lightning: vit.checkpoint.load_model(path).
        checkpoint["vit"] = {"model_name": self.hparams.model_name, "model_kwargs": dict(self.model_kwargs)}
        checkpoint["hyper_parameters"]["num_classes"] = self.hparams.num_classes  # resolved from the data
        checkpoint["vit_seed"] = _global_seed()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if "vit_seed" in checkpoint:
            os.environ["PL_GLOBAL_SEED"] = str(checkpoint["vit_seed"])
        rescale_lr(checkpoint, self.hparams.lr)

    def configure_callbacks(self) -> list[Callback]:
        return default_callbacks(self.trainer)


def default_callbacks(trainer: L.Trainer) -> list[Callback]:
    """The safety net every task carries: atomic checkpoint writes, a checkpoint on interruption,
    and the lr in the logs."""
    callbacks: list[Callback] = [SafeCheckpoints(), InterruptCheckpoint(checkpoint_dir(trainer))]
    if trainer.loggers:
        callbacks.append(LearningRateMonitor(logging_interval="step"))
    return callbacks


def checkpoint_dir(trainer: L.Trainer) -> Path:
    """Where a run's checkpoints live: fixed per run directory (not per logger version), so
    `--ckpt_path last` finds them from a new process."""
    for cb in trainer.checkpoint_callbacks:
        if getattr(cb, "dirpath", None):
            return Path(cb.dirpath)
    return Path(trainer.default_root_dir) / "checkpoints"


def rescale_lr(checkpoint: dict[str, Any], lr: float) -> None:
    """A run resumed with another `lr` (e.g. after a NaN loss) uses it: the optimizer's and the
    schedule's saved rates, which would otherwise win, are scaled by new / old, so warmup, cosine,
    layer decay and the head's rate keep their shape. Said in the log."""
    old = checkpoint.get("hyper_parameters", {}).get("lr")
    if not old or old == lr:
        return
    ratio = lr / old
    for state in checkpoint.get("optimizer_states", []):
        for group in state["param_groups"]:
            for key in ("lr", "initial_lr"):
                if key in group:
                    group[key] *= ratio
    for state in checkpoint.get("lr_schedulers", []):
        for key in ("base_lrs", "_last_lr"):
            if key in state:
                state[key] = [v * ratio for v in state[key]]
    checkpoint["hyper_parameters"]["lr"] = lr
    log.info("resuming with lr %g instead of the checkpoint's %g: the saved rates are scaled by %g", lr, old, ratio)


def check_finite(module: L.LightningModule, loss: torch.Tensor, batch_idx: int) -> None:
    """Stop on a NaN/inf loss, on every rank together, before it reaches a checkpoint (and, where
    the weights are still finite, before it reaches them)."""
    bad = not bool(torch.isfinite(loss.detach()))
    trainer = module.trainer
    if trainer.world_size > 1:
        bad = trainer.strategy.reduce_boolean_decision(bad, all=False)
    if not bad:
        return
    weights = non_finite(dict(module.named_parameters()))
    state = (
        f"the weights were already not finite ({', '.join(weights[:3])}): an earlier step made them so"
        if weights
        else "stopped before this step changed the weights"
    )
    raise NonFiniteLossError(
        f"training loss is {loss.item()} at step {trainer.global_step} (epoch {trainer.current_epoch}, "
        f"batch {batch_idx}); {state}. {NAN_ADVICE.format(checkpoint=last_good(checkpoint_dir(trainer)))}"
    )


def _global_seed() -> int:
    return int(os.environ.get("PL_GLOBAL_SEED", 0))
