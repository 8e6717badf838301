"""LanguageModel: next-character prediction with a registered GPT, trained by the same pipeline.

The recipe is nanoGPT's: AdamW (no weight decay on norms, biases and the position embedding),
linear warmup then cosine decay to min_lr, loss in nats per character. The checkpoint holds the
vocabulary, so `scripts/sample.py` needs only the .ckpt file.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from vit import lightning_compat as compat
from vit.data.text import CharTokenizer
from vit.gpt import GPT
from vit.options import set_option_groups
from vit.registry import create_model, model_config
from vit.training import Optimizer, Schedule, TrainingTask


class LanguageModel(TrainingTask):
    """Trains a registered GPT (`gpt_char_cpu`, `gpt_char_small`, ...) on a TextDataModule.

    Args:
        model_name: registry name of a GPT.
        model_kwargs: overrides of its GPTConfig (depth, embed_dim, dropout, ...); vocab_size comes
            from the vocabulary and block_size, unless given, from the datamodule.
        vocab: the tokenizer's characters; None takes the datamodule's (a checkpoint stores it).
        optimizer, schedule: vit.training.Optimizer and Schedule; nanoGPT's for small character
            models by default: AdamW at lr 1e-3, weight decay 0.1, betas (0.9, 0.99), 100 warmup
            steps, cosine to 1e-4 at the run's last step (or schedule.decay_steps).
        aux_loss_weight: weight of a mixture-of-experts model's load-balancing loss (GPTConfig
            num_experts > 1) in the training loss; train/loss stays the language-modelling loss.
    """

    RENAMED: ClassVar[dict[str, str]] = {**TrainingTask.RENAMED, "lr_decay_steps": "schedule.decay_steps"}
    monitor = "val/loss"  # the metric TrainCLI's ModelCheckpoint keeps the best of, and its mode
    monitor_mode = "min"

    def __init__(
        self,
        model_name: str = "gpt_char_cpu",
        model_kwargs: dict[str, Any] | None = None,
        vocab: str | None = None,
        optimizer: Optimizer = Optimizer(lr=1e-3, weight_decay=0.1, betas=(0.9, 0.99)),
        schedule: Schedule = Schedule(warmup_steps=100, min_lr=1e-4),
        aux_loss_weight: float = 0.01,
    ) -> None:
        super().__init__()
        optimizer, schedule = set_option_groups(self, optimizer=optimizer, schedule=schedule)  # as plain dicts
        self.save_hyperparameters()
        self.model: GPT | None = None
        if vocab is not None:
            self.configure_model()

    def configure_model(self) -> None:
        """Build the model, once, sized by the vocabulary and the datamodule's block_size."""
        if self.model is not None:
            return
        hp = self.hparams
        trainer = compat.attached_trainer(self)
        datamodule = trainer.datamodule if trainer is not None else None
        tokenizer = getattr(datamodule, "tokenizer", None)
        if tokenizer is not None and hp.vocab is not None and tokenizer.vocab != hp.vocab:
            raise ValueError(
                f"the text's vocabulary ({len(tokenizer)} characters) differs from the model's ({len(hp.vocab)}); "
                "a model can only continue training on text with the same characters"
            )
        if hp.vocab is None:
            if tokenizer is None:
                raise ValueError("vocab is not set and there is no text datamodule (with a tokenizer) to take it from")
            hp.vocab = tokenizer.vocab
        kwargs = {**(hp.model_kwargs or {}), "vocab_size": len(hp.vocab)}
        data_block_size = getattr(datamodule, "block_size", None)
        if data_block_size is not None:
            kwargs.setdefault("block_size", data_block_size)
            if data_block_size > model_config(hp.model_name, **kwargs).block_size:
                raise ValueError(
                    f"the datamodule's block_size {data_block_size} exceeds the model's {kwargs['block_size']}"
                )
        self.model_kwargs = kwargs
        self.model = create_model(hp.model_name, **kwargs)
        if not isinstance(self.model, GPT):
            raise ValueError(f"{hp.model_name} is not a GPT; LanguageModel trains the gpt_* models")

    @property
    def tokenizer(self) -> CharTokenizer:
        return CharTokenizer(self.hparams.vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Mean cross-entropy of every next-character prediction, in nats per character."""
        x, y = batch
        return F.cross_entropy(self(x).flatten(0, 1), y.flatten())

    # -- training -----------------------------------------------------------------------------

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("train/loss", loss, prog_bar=True)
        if self.model.config.num_experts > 1:
            aux = self.model.aux_loss()
            self.log("train/aux_loss", aux)
            loss = loss + self.hparams.aux_loss_weight * aux
        return loss

    # -- evaluation ---------------------------------------------------------------------------

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        loss = self.loss(batch)
        self.log("val/loss", loss, prog_bar=True, sync_dist=True)
        self.log("val/bits_per_char", loss / math.log(2), sync_dist=True)

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("test/loss", self.loss(batch), sync_dist=True)

    # -- checkpoints ----------------------------------------------------------------------------

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # With the vocabulary, scripts/sample.py needs nothing but the checkpoint.
        super().on_save_checkpoint(checkpoint)
        checkpoint["vit"]["vocab"] = self.hparams.vocab
        checkpoint["hyper_parameters"]["vocab"] = self.hparams.vocab  # resolved from the data
        checkpoint["hyper_parameters"]["model_kwargs"] = dict(self.model_kwargs)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        saved = checkpoint.get("hyper_parameters", {}).get("vocab")
        if saved is not None and self.hparams.vocab is not None and saved != self.hparams.vocab:
            raise ValueError(
                f"the checkpoint's vocabulary ({len(saved)} characters) differs from this text's "
                f"({len(self.hparams.vocab)}); resume on the text the run was trained on"
            )
        super().on_load_checkpoint(checkpoint)
