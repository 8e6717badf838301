"""ImageClassifier: image classification with any registered model, and its training recipe.

Optimisation: AdamW, SGD or Muon, without weight decay on norms, biases, position embeddings and
the CLS token; per-step linear warmup then cosine decay, by steps or by a wall-clock budget;
layer-wise lr decay and frozen parts for fine-tuning; optional weight EMA. What every task shares
(seeding, checkpoint metadata, the NaN guard, the safety callbacks) is vit.training.TrainingTask.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torchmetrics.classification import MulticlassAccuracy

from vit import lightning_compat as compat
from vit.checkpoint import load_model, load_pretrained
from vit.data.images import MISSING, same_class_names
from vit.data.preprocess import Preprocess
from vit.fault_tolerance import CheckpointConflictError
from vit.heads import HEAD_NAMES, is_head
from vit.layers import MoE, PatchDropout, PatchEmbed, whiten_patch_embed_
from vit.naflex import Inputs, NaFlexConfig
from vit.options import OptionError, is_number, number, require, set_option_groups, whole
from vit.registry import create_model, model_config
from vit.schedule import stepwise, training_progress
from vit.training import Optimizer, Schedule, TrainingTask, param_groups
from vit.vision_transformer import ViTConfig, check_grid


class EMA(AveragedModel):
    """An exponential moving average of a model's weights and buffers, as
    AveragedModel(multi_avg_fn=get_ema_multi_avg_fn(decay), use_buffers=True) keeps it, with its
    checkpoint keys (`ema.module.*`, `ema.n_averaged`), updated without reading the device:
    AveragedModel tests its update count, a tensor there, at every update, so the host would wait
    for the device each step. Here the count is mirrored on the host, read from the buffer once."""

    def __init__(self, model: nn.Module, decay: float) -> None:
        super().__init__(model, multi_avg_fn=get_ema_multi_avg_fn(decay), use_buffers=True)
        self._updates: int | None = None  # n_averaged on the host; None until read

    @torch.no_grad()
    def update_parameters(self, model: nn.Module) -> None:
        if self._updates is None:
            self._updates = int(self.n_averaged)
        averaged = [*self.module.parameters(), *self.module.buffers()]
        current = [t.detach() for t in (*model.parameters(), *model.buffers())]
        if self._updates == 0:
            torch._foreach_copy_(averaged, current)
        else:
            by_dtype: dict[torch.dtype, tuple[list, list]] = defaultdict(lambda: ([], []))
            for mine, theirs in zip(averaged, current, strict=True):
                by_dtype[mine.dtype][0].append(mine)
                by_dtype[mine.dtype][1].append(theirs)
            for mine, theirs in by_dtype.values():
                self.multi_avg_fn(mine, theirs, self.n_averaged)
        self.n_averaged += 1
        self._updates += 1

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        self._updates = None  # the loaded count, read at the next update
        super()._load_from_state_dict(*args, **kwargs)


def accuracy(num_classes: int, top_k: int) -> MulticlassAccuracy:
    """Top-k accuracy over samples (micro), synced across processes; torchmetrics' default is
    the per-class (macro) mean, which is not what papers report."""
    return MulticlassAccuracy(num_classes, top_k=min(top_k, num_classes), average="micro")


@dataclasses.dataclass(frozen=True)
class FineTune:
    """Starting from trained weights (`model.finetune`).

    Args:
        init_from: start from these weights (our .ckpt, a timm .pth/.bin/.safetensors, a Google
            .npz, or timm:<name>), adapted to the model (position embedding resampled, new head);
            see vit.checkpoint.load_pretrained.
        layer_decay: layer-wise lr decay for ViTs (e.g. 0.75: BEiT, MAE); head_lr: the head's own
            lr (also scaled by the batch size with optimizer.lr_base_batch_size).
        freeze_backbone: train only the head (a linear probe); freeze_blocks: freeze the patch and
            position embeddings, the CLS and register tokens and the first K blocks. Frozen parts run
            in eval mode.
    """

    init_from: str | None = None
    layer_decay: float | None = None
    head_lr: float | None = None
    freeze_backbone: bool = False
    freeze_blocks: int = 0

    def __post_init__(self) -> None:
        name = "model.finetune."
        if self.layer_decay is not None:
            number(self.layer_decay, name + "layer_decay", "a decay in (0, 1] (BEiT, MAE: 0.75)", 0, 1, open_low=True)
        if self.head_lr is not None:
            number(self.head_lr, name + "head_lr", "a learning rate above 0", 0, math.inf, open_low=True)
        whole(self.freeze_blocks, 0, name + "freeze_blocks", "the first blocks frozen, 0 for none")


@dataclasses.dataclass(frozen=True)
class Distillation:
    """Knowledge distillation (DeiT, Touvron et al. 2021) from a frozen teacher (`model.distillation`).

    Args:
        teacher: any vit.checkpoint.load_model source (our .ckpt, a state dict with `teacher_model`
            naming its architecture, e.g. the CIFAR ResNet-56 .th files, or timm:<name>). It sees
            the same augmented batch as the student and runs outside the checkpoint (not saved,
            not trained). A ViT with `distilled: true` learns the teacher on its distillation
            token's head and the labels on its class head (DeiT); any other model learns both on
            its one output.
        teacher_model: the teacher's architecture, for a state dict that does not name it.
        kind: "hard" (cross-entropy to the teacher's top class, DeiT's best) or "soft" (KL
            divergence to the teacher's softmax at temperature tau, Hinton et al.).
        alpha: the teacher term's weight; the label term gets 1 - alpha (DeiT: 0.5).
    """

    teacher: str
    teacher_model: str | None = None
    kind: str = "hard"
    alpha: float = 0.5
    tau: float = 1.0

    def __post_init__(self) -> None:
        name = "model.distillation."
        require(bool(self.teacher), name + "teacher", self.teacher, "a checkpoint file or timm:<name>")
        require(self.kind in ("hard", "soft"), name + "kind", self.kind, "hard or soft")
        number(self.alpha, name + "alpha", "the teacher term's weight, from 0 to 1 (DeiT: 0.5)", 0, 1)
        number(self.tau, name + "tau", "a temperature above 0", 0, math.inf, open_low=True)


@dataclasses.dataclass(frozen=True)
class Speed:
    """How the model runs, not what it learns (`model.speed`).

    Args:
        compile: run the model through torch.compile (the checkpoint keeps the plain weights).
        channels_last: keep conv weights and input batches in NHWC memory order, which oneDNN and
            cuDNN convolutions and max pools run faster (benchmarks/conv_layout.py); same results.
        grad_checkpointing: recompute block activations in backward (ViT-L/H at larger batches).
    """

    compile: bool = False
    channels_last: bool = False
    grad_checkpointing: bool = False


def check_recipe(label_smoothing: Any, ema_decay: Any, aux_loss_weight: Any, patch_drop_schedule: Any) -> None:
    """OptionError naming the first of ImageClassifier's own recipe options set out of its range."""
    number(label_smoothing, "model.label_smoothing", "a share of the target in [0, 1) (ImageNet recipes: 0.1)",
           0, 1, open_high=True)  # fmt: skip
    if ema_decay is not None:  # 1 would never move the average off the first weights
        number(ema_decay, "model.ema_decay", "a decay in [0, 1) (e.g. 0.999), or null for no average",
               0, 1, open_high=True)  # fmt: skip
    number(aux_loss_weight, "model.aux_loss_weight", "a weight of at least 0", 0, math.inf)
    for entry in patch_drop_schedule or []:
        ok = isinstance(entry, list | tuple) and len(entry) == 2 and is_number(entry[0], 0, 1)
        require(ok and is_number(entry[1], 0, 1, open_high=True), "model.patch_drop_schedule", patch_drop_schedule,
                "[[progress from 0 to 1, rate in [0, 1)], ...]")  # fmt: skip


class ImageClassifier(TrainingTask):
    """Trains any registered model (`vit.list_models()`) as an image classifier.

    Args:
        model_name: registry name, e.g. "vit_small_patch16_224" or "resnet20".
        model_kwargs: overrides of the model's config (drop_path_rate, global_pool, ...).
        num_classes / img_size: the head's class count and the input side. Under the CLI both come
            from the data (`data.num_classes`, `data.img_size`: vit.cli.TrainCLI links them), so they
            are set once, on the data; a different value given here or in model_kwargs is an error
            naming both. Without the CLI, num_classes None takes the datamodule's when training
            starts, and img_size None keeps the model's (model_kwargs, else the registry's). Models
            without an img_size (the convolutional ResNets) take any size and ignore it.
        optimizer, schedule: vit.training.Optimizer and Schedule (AdamW at lr 1e-3, no warmup,
            cosine to 0 by default).
        finetune: FineTune: the weights to start from, layer-wise lr decay, frozen parts.
        distillation: Distillation from a teacher; None trains on the labels alone.
        speed: Speed: torch.compile, channels-last, gradient checkpointing.
        label_smoothing: for the cross-entropy loss (works with Mixup's soft targets too).
        tta_flip: evaluate (validation, test, predict) on the mean of the logits of the image and
            its mirror image.
        ema_decay: keep an exponential moving average of the weights; validation also reports it.
        aux_loss_weight: weight of a mixture-of-experts model's load-balancing loss
            (`model.aux_loss()`, logged as train/aux_loss) in the training loss; 0.01 as in Switch.
        patch_drop_schedule: [[progress, rate], ...]: the ViT's patch dropout rate from each point of
            the run (a fraction of its steps, or of its WallClockBudget) on, replacing its
            patch_drop_rate; e.g. [[0, 0.5], [0.8, 0.0]] trains the last 20% on every patch, the
            token count it is evaluated on (FLIP's unmasked tuning, on the clock).
        whiten_patch_embed: at the start of a fresh run (not a resumed one), set the ViT's patchify
            conv to whiten the patches of the first training batch (vit.layers.whiten_patch_embed_,
            airbench's init of its first conv); every rank takes rank 0's. Not with
            finetune.init_from (it would replace the pretrained patch embedding) nor with a conv stem.

    With data of patch sequences (`data.naflex`) every step feeds the model NaFlexVit.forward's
    dict: the model must be a NaFlexVit of the data's patch size, and tta_flip and distillation
    (which need image tensors) are refused when the run starts.

    A group given in Python as a dict changes only the fields it names, e.g.
    `ImageClassifier("resnet20", optimizer={"name": "sgd", "lr": 0.1})`.
    """

    RENAMED: ClassVar[dict[str, str]] = {
        **TrainingTask.RENAMED,
        "init_from": "finetune.init_from",
        "layer_decay": "finetune.layer_decay",
        "head_lr": "finetune.head_lr",
        "freeze_backbone": "finetune.freeze_backbone",
        "freeze_blocks": "finetune.freeze_blocks",
        "teacher": "distillation.teacher",
        "teacher_model": "distillation.teacher_model",
        "distillation": "distillation.kind",
        "distillation_alpha": "distillation.alpha",
        "distillation_tau": "distillation.tau",
        "compile": "speed.compile",
        "channels_last": "speed.channels_last",
        "grad_checkpointing": "speed.grad_checkpointing",
    }
    finetune: FineTune
    distillation: Distillation | None
    speed: Speed

    def __init__(
        self,
        model_name: str = "vit_nano_patch4_16",
        model_kwargs: dict[str, Any] | None = None,
        num_classes: int | None = None,
        img_size: int | None = None,
        optimizer: Optimizer = Optimizer(),
        schedule: Schedule = Schedule(),
        finetune: FineTune = FineTune(),
        distillation: Distillation | None = None,
        speed: Speed = Speed(),
        label_smoothing: float = 0.0,
        tta_flip: bool = False,
        ema_decay: float | None = None,
        aux_loss_weight: float = 0.01,
        patch_drop_schedule: list[tuple[float, float]] | None = None,
        whiten_patch_embed: bool = False,
    ) -> None:
        super().__init__()
        optimizer, schedule, finetune, distillation, speed = set_option_groups(
            self, optimizer=optimizer, schedule=schedule, finetune=finetune, distillation=distillation, speed=speed
        )  # the hyperparameters hold the groups as plain dicts
        check_recipe(label_smoothing, ema_decay, aux_loss_weight, patch_drop_schedule)
        if (model_kwargs or {}).get("distilled") and self.distillation is None:
            raise ValueError(
                "model_kwargs.distilled trains a distillation head, which needs a teacher (model.distillation.teacher)"
            )
        if whiten_patch_embed and self.finetune.init_from:
            raise ValueError(
                "whiten_patch_embed would replace the patch embedding finetune.init_from loads; use one or the other"
            )
        self.save_hyperparameters()
        self._patch_drop_schedule = sorted((float(p), float(r)) for p, r in patch_drop_schedule or [])
        self._whitened = False
        self.model: nn.Module | None = None
        if num_classes is not None:
            self.configure_model()

    @classmethod
    def upgrade_hparams(cls, hparams: Mapping[str, Any]) -> dict[str, Any]:
        upgraded = super().upgrade_hparams(hparams)
        if isinstance(upgraded.get("distillation"), Mapping) and upgraded["distillation"].get("teacher") is None:
            upgraded["distillation"] = None  # an old checkpoint trained without a teacher
        return upgraded

    def configure_model(self) -> None:
        """Build the model, once; num_classes comes from the datamodule unless it was given."""
        if self.model is not None:
            return
        hp = self.hparams
        if hp.num_classes is None:
            trainer = compat.attached_trainer(self)
            datamodule = trainer.datamodule if trainer is not None else None
            if datamodule is None or not hasattr(datamodule, "num_classes"):
                raise ValueError("num_classes is not set and there is no datamodule with a num_classes to take it from")
            hp.num_classes = datamodule.num_classes
        self.model_kwargs = self._resolved_model_kwargs()
        self.model = self._create_model()
        if self.speed.channels_last:
            self.model.to(memory_format=torch.channels_last)
        self.has_aux_loss = any(isinstance(m, MoE) for m in self.model.modules())
        distill = self.distillation
        self.__dict__["_teacher"] = self._load_teacher(distill) if distill else None  # outside the module tree
        if distill and getattr(self.model, "dist_token", None) is not None:
            self.model.set_distilled_training(True)
        if self.finetune.init_from:
            load_pretrained(self.model, self.finetune.init_from)
        self._freeze()
        if hp.patch_drop_schedule and not isinstance(getattr(self.model, "patch_drop", None), PatchDropout):
            raise ValueError(f"patch_drop_schedule needs a ViT (a model with patch dropout); {hp.model_name} has none")
        embed = getattr(self.model, "patch_embed", None)
        if hp.whiten_patch_embed and not (isinstance(embed, PatchEmbed) and embed.backbone is None):
            raise ValueError(
                f"whiten_patch_embed needs a ViT with a patchify conv; {hp.model_name} has none (or a stem)"
            )
        if self.speed.grad_checkpointing:
            if not hasattr(self.model, "set_grad_checkpointing"):
                raise ValueError(f"{hp.model_name} does not support grad_checkpointing (only the ViTs do)")
            self.model.set_grad_checkpointing(True)
        self.ema = None
        if hp.ema_decay is not None:
            self.ema = EMA(self.model, hp.ema_decay)
            self.ema.requires_grad_(False)  # not trained by the optimizer; DDP must not wait for its grads
        # Kept out of the module tree so checkpoints hold the plain model's weights, not `_orig_mod.` copies.
        self.__dict__["_compiled"] = torch.compile(self.model) if self.speed.compile else None
        self.train_acc1 = accuracy(hp.num_classes, top_k=1)
        self.val_acc1 = accuracy(hp.num_classes, top_k=1)
        self.val_acc5 = accuracy(hp.num_classes, top_k=5)
        self.val_ema_acc1 = accuracy(hp.num_classes, top_k=1)
        self.test_acc1 = accuracy(hp.num_classes, top_k=1)
        self.test_acc5 = accuracy(hp.num_classes, top_k=5)

    def _load_teacher(self, distill: Distillation) -> nn.Module:
        """The frozen teacher, in eval mode and NHWC order (faster convolutions), checked against
        the student's class count."""
        hp = self.hparams
        teacher = load_model(distill.teacher, distill.teacher_model).requires_grad_(False).eval()
        classes = getattr(teacher, "num_classes", None)
        if classes is None:  # the CIFAR / torchvision ResNets: their classifier's width
            head = next((m for name, m in teacher.named_children() if name in HEAD_NAMES), None)
            classes = getattr(head, "out_features", None)
        if classes != hp.num_classes:
            raise ValueError(
                f"the teacher {distill.teacher} predicts {classes} classes but the model has {hp.num_classes}"
            )
        return teacher.to(memory_format=torch.channels_last)

    def on_fit_start(self) -> None:
        super().on_fit_start()
        if self._teacher is not None:
            self._teacher.to(self.device)

    def _create_model(self) -> nn.Module:
        """The model of model_name and the resolved kwargs. An option it does not take is named as the
        config names it; the data's img_size (one not the name's own) must be whole patches."""
        hp, kwargs = self.hparams, self.model_kwargs
        from_data = {name for name in ("num_classes", "img_size") if hp[name] is not None}
        try:
            config = model_config(hp.model_name, **kwargs)
            own_size = isinstance(config, ViTConfig) and config.img_size == model_config(hp.model_name).img_size
            if "img_size" in from_data and isinstance(config, ViTConfig) and config.backbone is None and not own_size:
                check_grid(config.img_size, config.patch_size, config.dynamic_img_pad, whole_patches=True)
            return create_model(hp.model_name, **kwargs)
        except OptionError as error:
            raise error.placed(f"data.{error.name}" if error.name in from_data else
                               f"model.model_kwargs.{error.name}") from None  # fmt: skip

    def _resolved_model_kwargs(self) -> dict[str, Any]:
        """model_kwargs with num_classes and img_size filled in; each value must be given once, or agree."""
        hp = self.hparams
        kwargs = dict(hp.model_kwargs or {})
        sized = hasattr(model_config(hp.model_name), "img_size")
        for name, value in (("num_classes", hp.num_classes), ("img_size", hp.img_size if sized else None)):
            if value is None:
                continue
            if kwargs.get(name, value) != value:
                raise ValueError(
                    f"model.model_kwargs.{name} is {kwargs[name]} but model.{name} is {value} (under the CLI, "
                    f"data.{name}); set it once, on the data"
                )
            kwargs[name] = value
        return kwargs

    def setup(self, stage: str) -> None:
        """A head for another number of classes than the data's fails late and cryptically ("Target
        7 is out of bounds") or trains silently with unused outputs: refuse it before the run."""
        super().setup(stage)
        data = self.trainer.datamodule
        classes = getattr(data, "num_classes", None)
        if classes is not None and self.hparams.num_classes is not None and classes != self.hparams.num_classes:
            raise ValueError(
                f"model.num_classes is {self.hparams.num_classes} but the data has {classes} classes; "
                "leave num_classes unset to take the data's"
            )
        if getattr(data, "naflex", None) is not None:
            self._check_patch_sequences(data.naflex.patch_size)
        train_sizes = getattr(getattr(data, "memory", None), "train_sizes", None)
        if train_sizes:
            self._check_train_sizes([size for _, size in train_sizes])

    def _check_train_sizes(self, sizes: list[int]) -> None:
        """A ViT trained at other sizes (`data.memory.train_sizes`) takes each as whole patches, with positions
        for each grid: refused by name before the run, not at the step where the size changes."""
        config = model_config(self.hparams.model_name, **self.model_kwargs)
        if not isinstance(config, ViTConfig) or config.backbone is not None:
            return
        for size in sizes:
            try:
                check_grid(size, config.patch_size, config.dynamic_img_pad, whole_patches=True)
            except OptionError as error:
                raise OptionError("data.memory.train_sizes", sizes, f"sizes {error.expected}") from None
        built = (config.img_size,) * 2 if isinstance(config.img_size, int) else tuple(config.img_size)
        other = [size for size in sizes if (size, size) != built]
        if other and config.posemb == "learn" and not config.dynamic_img_size:
            raise OptionError("model.model_kwargs.dynamic_img_size", False,
                              f"true to train at {other} px (data.memory.train_sizes): the position embedding is "
                              f"resampled from the {config.img_size} px grid to each")  # fmt: skip

    def _check_patch_sequences(self, patch_size: int) -> None:
        """With `data.naflex` every step's input is a dict of patch sequences: a NaFlexVit with a
        linear embedding of that patch size takes it; the options that need image tensors (the
        teacher's input, the flipped image) are refused by name."""
        hp = self.hparams
        config = model_config(hp.model_name, **(hp.model_kwargs or {}))
        takes = "a NaFlexVit (naflexvit_*) with --data.naflex, which gives the model patch sequences"
        if not isinstance(config, NaFlexConfig):
            raise OptionError("model.model_name", hp.model_name, takes)
        if config.embed_proj_type != "linear":
            raise OptionError("model.model_kwargs.embed_proj_type", config.embed_proj_type, f"linear for {takes}")
        model_patch = config.patch_size if isinstance(config.patch_size, int) else tuple(config.patch_size)
        if model_patch not in (patch_size, (patch_size, patch_size)):
            raise OptionError(
                "data.naflex.patch_size", patch_size, f"{model_patch}, the patch size of model {hp.model_name}"
            )
        for name, value in (("tta_flip", hp.tta_flip), ("distillation", self.distillation)):
            if value:
                raise OptionError(f"model.{name}", value, "off with --data.naflex (it needs image tensors)")

    def _freeze(self) -> None:
        name, options = self.hparams.model_name, self.finetune
        if options.freeze_backbone:
            for param_name, p in self.model.named_parameters():
                p.requires_grad_(is_head(param_name))
            if not any(p.requires_grad for p in self.model.parameters()):
                raise ValueError(f"freeze_backbone: {name} has no head named {' / '.join(HEAD_NAMES)}")
        if options.freeze_blocks:
            blocks = len(getattr(self.model, "blocks", ()))
            require(0 < options.freeze_blocks <= blocks, "model.finetune.freeze_blocks", options.freeze_blocks,
                    f"at most the {blocks} transformer blocks of {name}")  # fmt: skip
            embedding = self.model.embeds if hasattr(self.model, "embeds") else self.model.patch_embed  # NaFlexVit's
            frozen = [embedding, *self.model.blocks[: options.freeze_blocks]]
            for module in frozen:
                module.requires_grad_(False)
            for name in ("cls_token", "reg_token", "pos_embed"):  # registers: DINOv3, timm's reg ViTs
                if getattr(self.model, name, None) is not None:
                    getattr(self.model, name).requires_grad_(False)

    def on_train_epoch_start(self) -> None:
        # Frozen parts behave as at inference: no dropout/drop-path, BatchNorm statistics kept.
        for module in self.model.modules():
            params = list(module.parameters())
            if params and not any(p.requires_grad for p in params):
                module.eval()

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        if self.hparams.whiten_patch_embed and self.global_step == 0 and not self._whitened:
            proj = self.model.patch_embed.proj
            whiten_patch_embed_(proj, batch[0])
            state = {name: value.cpu() for name, value in proj.state_dict().items()}
            proj.load_state_dict(self.trainer.strategy.broadcast(state, src=0))  # the replicas stay equal
            self._whitened = True

    def forward(self, x: Inputs) -> torch.Tensor:
        """Logits of images, or of patch sequences (`data.naflex`: a dict for NaFlexVit.forward)."""
        model = self._compiled if self._compiled is not None else self.model
        if self.speed.channels_last and isinstance(x, torch.Tensor) and x.ndim == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        return model(x)

    def eval_logits(self, x: Inputs) -> torch.Tensor:
        """Logits for evaluation: with tta_flip, the mean over the image and its mirror image."""
        logits = self(x)
        return (logits + self(x.flip(-1))) / 2 if self.hparams.tta_flip else logits

    def loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits, target, label_smoothing=self.hparams.label_smoothing)

    def distillation_loss(
        self, x: torch.Tensor, outputs: torch.Tensor | tuple[torch.Tensor, torch.Tensor], target: torch.Tensor
    ) -> torch.Tensor:
        """(1 - alpha) * label loss on the class logits + alpha * teacher loss on the distillation
        logits (a distilled ViT's second head; otherwise the same logits)."""
        options = self.distillation
        logits, dist = outputs if isinstance(outputs, tuple) else (outputs, outputs)
        with torch.no_grad():
            teacher = self._teacher(x.contiguous(memory_format=torch.channels_last)).float()
        if options.kind == "hard":
            teacher_loss = F.cross_entropy(dist, teacher.argmax(dim=-1))
        else:
            tau = options.tau
            student, soft = F.log_softmax(dist / tau, dim=-1), F.log_softmax(teacher / tau, dim=-1)
            teacher_loss = F.kl_div(student, soft, reduction="batchmean", log_target=True) * tau * tau
        self.log("train/teacher_loss", teacher_loss)
        return (1 - options.alpha) * self.loss(logits, target) + options.alpha * teacher_loss

    # -- training -----------------------------------------------------------------------------

    def training_step(self, batch: tuple[Inputs, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, target = batch  # target: class ids (B,), or soft (B, classes) after Mixup/CutMix
        if self.hparams.patch_drop_schedule:
            self.model.patch_drop.prob = self.patch_drop_rate()
        logits = self(x)
        if self._teacher is not None:
            loss = self.distillation_loss(x, logits, target)
            logits = (logits[0] + logits[1]) / 2 if isinstance(logits, tuple) else logits
        else:
            loss = self.loss(logits, target)
        if self.has_aux_loss:  # mixture of experts: keep the routers balanced
            aux = self.model.aux_loss()
            self.log("train/aux_loss", aux)
            loss = loss + self.hparams.aux_loss_weight * aux
        self.log("train/loss", loss, prog_bar=True)
        if target.ndim == 1:
            self.train_acc1(logits, target)
            self.log("train/acc1", self.train_acc1, on_step=False, on_epoch=True)
        return loss

    def patch_drop_rate(self) -> float:
        """patch_drop_schedule's rate at this point of the run (of its steps, or of its budget)."""
        return stepwise(self._patch_drop_schedule, training_progress(self.trainer))

    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        super().optimizer_step(*args, **kwargs)
        if self.ema is not None:
            self.ema.update_parameters(self.model)

    def param_groups(self, lr: float) -> list[dict[str, Any]]:
        """With finetune.layer_decay and head_lr: early blocks move less, the head at its own rate."""
        options = self.finetune
        head_lr = options.head_lr * self.lr_scale() if options.head_lr is not None else None
        return param_groups(self.model, self.optimizer.weight_decay, lr, options.layer_decay, head_lr)

    # -- evaluation ---------------------------------------------------------------------------

    def validation_step(self, batch: tuple[Inputs, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        logits, y, x = self._scored(self.eval_logits(x), y, x)
        if not len(y):
            return
        self.log("val/loss", F.cross_entropy(logits, y), prog_bar=True, sync_dist=True)
        self.val_acc1(logits, y)
        self.val_acc5(logits, y)
        self.log("val/acc1", self.val_acc1, prog_bar=True)
        self.log("val/acc5", self.val_acc5)
        if self.ema is not None:
            self.val_ema_acc1(self.ema(x), y)
            self.log("val/ema_acc1", self.val_ema_acc1)

    def test_step(self, batch: tuple[Inputs, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        logits, y, _ = self._scored(self.eval_logits(x), y, x)
        if not len(y):
            return
        self.log("test/loss", F.cross_entropy(logits, y), sync_dist=True)
        self.test_acc1(logits, y)
        self.test_acc5(logits, y)
        self.log("test/acc1", self.test_acc1)
        self.log("test/acc5", self.test_acc5)

    @staticmethod
    def _scored(logits: torch.Tensor, y: torch.Tensor, x: Inputs) -> tuple[torch.Tensor, torch.Tensor, Inputs]:
        """Leave out the stand-ins of corrupt files (label MISSING, data.skip_corrupt); the model
        still ran on them, so every DDP rank ran the same forward passes."""
        keep = y != MISSING
        if y.ndim != 1 or bool(keep.all()):
            return logits, y, x
        kept = {name: value[keep] for name, value in x.items()} if isinstance(x, dict) else x[keep]
        return logits[keep], y[keep], kept

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x = batch[0] if isinstance(batch, (tuple, list)) else batch
        return self.eval_logits(x).softmax(dim=-1)

    # -- checkpoints ----------------------------------------------------------------------------

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """A run resumed on data with other classes, or other class names in another order (a
        renamed folder sorts elsewhere), would shift every label under the trained head: refuse it,
        with both lists, before the weights are loaded."""
        trainer = compat.attached_trainer(self)
        datamodule = trainer.datamodule if trainer is not None else None
        if datamodule is not None:
            path = trainer.ckpt_path or "the checkpoint"
            saved_names = checkpoint.get("vit", {}).get("class_names")
            names = getattr(datamodule, "class_names", None)
            saved_count = checkpoint.get("hyper_parameters", {}).get("num_classes")
            count = getattr(datamodule, "num_classes", None)
            if saved_names is not None and names is not None and not same_class_names(saved_names, names):
                trained, now = f"the classes {list(saved_names)}", f"the data has {list(names)}"
            elif saved_count is not None and count is not None and saved_count != count:
                trained, now = f"{saved_count} classes", f"the data has {count}"
            else:
                trained = None
            if trained is not None:
                raise CheckpointConflictError(
                    f"{path} was trained on {trained}, but {now}: a resumed run must see the same classes in the "
                    "same order (each output of the head is one class). Put the class folders back as they were, "
                    f"or train on these classes from its weights with --model.finetune.init_from {path}"
                )
        super().on_load_checkpoint(checkpoint)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint["hyper_parameters"]["num_classes"] = self.hparams.num_classes  # resolved from the data
        # The data's class names in label order, so exports label predictions "ship", not "8".
        trainer = compat.attached_trainer(self)
        datamodule = trainer.datamodule if trainer is not None else None
        names = getattr(datamodule, "class_names", None)
        if names is not None and len(names) == self.hparams.num_classes:
            checkpoint["vit"]["class_names"] = list(names)
        preprocess = Preprocess.of(datamodule)  # what vit-predict and the ONNX export feed the model
        if preprocess is not None:
            checkpoint["vit"]["preprocess"] = preprocess.to_dict()
