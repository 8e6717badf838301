"""Gradient accumulation (`trainer.accumulate_grad_batches`): k micro-batches of b images are one
optimizer step of k*b images, in the update, in the learning-rate scaling and in the schedule."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from vit.data import DigitsDataModule
from vit.lit import ImageClassifier


class FirstStep(L.Callback):
    """Records the weights after the first optimizer step, the peak lr, the schedule's length and
    its multiplier at every step, then stops the run."""

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args) -> None:
        if trainer.global_step != 1:
            return
        self.weights = {k: v.detach().clone() for k, v in pl_module.model.state_dict().items()}
        self.peak_lr = pl_module.peak_lr()
        self.total = int(trainer.estimated_stepping_batches)
        scheduler = trainer.lr_scheduler_configs[0].scheduler
        self.multipliers = [scheduler.lr_lambdas[0](step) for step in range(self.total)]
        trainer.should_stop = True


def tiny_vit(**recipe) -> ImageClassifier:
    """vit_nano_patch4_16 without dropout or drop-path, seeded: both runs start from the same weights."""
    L.seed_everything(0)
    return ImageClassifier("vit_nano_patch4_16", {"drop_path_rate": 0.0, "drop_rate": 0.0}, 10, 16, **recipe)


def first_step(batch_size: int, accumulate: int, optimizer: str) -> FirstStep:
    # no Mixup, no random crop or flip: the two runs see the same images in the same order
    model = tiny_vit(
        optimizer={"name": optimizer, "lr": 1e-2, "lr_base_batch_size": 16},
        schedule={"warmup_epochs": 1, "min_lr": 1e-4},
    )
    data = DigitsDataModule(batch_size=batch_size, num_workers=0, augment={"crop": "resize"})
    record = FirstStep()
    trainer = L.Trainer(
        accelerator="cpu", devices=1, precision="32-true", max_epochs=3, limit_train_batches=4 * accumulate,
        accumulate_grad_batches=accumulate, limit_val_batches=0, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[record],
    )  # fmt: skip
    trainer.fit(model, data)
    return record


@pytest.mark.parametrize(("optimizer", "atol"), [("sgd", 1e-7), ("adamw", 2e-4)])
def test_accumulating_k_batches_of_b_is_one_batch_of_k_times_b(optimizer, atol):
    accumulated, whole = first_step(8, 4, optimizer), first_step(32, 1, optimizer)
    # the same global batch (8 x 4 = 32 images) for linear lr scaling: lr x 32 / 16
    assert accumulated.peak_lr == whole.peak_lr == pytest.approx(2e-2)
    # the same schedule: 4 optimizer steps per epoch (16 micro-batches / 4), 12 in the run, warmup 4
    assert accumulated.total == whole.total == 12
    assert accumulated.multipliers == whole.multipliers
    assert accumulated.multipliers[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    # the same first update, to float tolerance: the gradient is summed in another order. SGD's update
    # is linear in it (1e-7, every weight); AdamW's first is lr g / (|g| + eps), which turns rounding
    # noise into up to one step (lr 2e-2 x warmup 0.25 = 5e-3) where the gradient is about zero in
    # exact arithmetic (e.g. the key bias of attention): every weight within a step, and all but one
    # in 10,000 within 2e-4
    step = accumulated.peak_lr * accumulated.multipliers[0]
    for name, value in whole.weights.items():
        difference = (accumulated.weights[name] - value).abs()
        if optimizer == "sgd":
            torch.testing.assert_close(accumulated.weights[name], value, atol=atol, rtol=0, msg=name)
        else:
            assert difference.max() <= step and (difference > atol).float().mean() < 1e-4, name
    init = tiny_vit().model.state_dict()
    moved = max((whole.weights[k] - init[k]).abs().max().item() for k in init)
    assert moved > 10 * atol  # the step did move the weights


class Draws(L.Callback):
    """Per training batch: (batch_idx, optimizer step, the torch seed the step set, the mixed targets)."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, int, int, torch.Tensor]] = []

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx) -> None:
        self.step = trainer.global_step  # the step this batch belongs to (it moves once the step is taken)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        self.rows.append((batch_idx, self.step, torch.initial_seed(), batch[1].clone()))


def _mixed_run(tmp_path, max_steps: int, accumulate: int, ckpt_path: str | None = None) -> Draws:
    every_step = L.pytorch.callbacks.ModelCheckpoint(tmp_path / "ckpt", every_n_train_steps=1, save_top_k=-1)
    draws = Draws()
    trainer = L.Trainer(
        default_root_dir=tmp_path, accelerator="cpu", devices=1, max_steps=max_steps, limit_val_batches=0,
        accumulate_grad_batches=accumulate, logger=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[every_step, draws],
    )  # fmt: skip
    data = DigitsDataModule(batch_size=16, pipeline="memory", mixup={"mixup_alpha": 0.8})
    trainer.fit(tiny_vit(), data, ckpt_path=ckpt_path)
    return draws


def test_each_batch_of_an_accumulated_step_draws_its_own_mixup_and_dropout_and_a_resume_the_same(tmp_path):
    """With 2 batches a step, the two mix with their own lambda and run the model under their own
    seed; resumed after the first step, the next batches draw as the uninterrupted run's did. One
    batch a step is keyed by (step, rank) alone."""
    from vit.seeds import Purpose, seed_for

    whole = _mixed_run(tmp_path / "whole", max_steps=3, accumulate=2)
    assert [(i, step) for i, step, _, _ in whole.rows] == [(0, 0), (1, 0), (2, 1), (3, 1), (4, 2), (5, 2)]
    for first, second in zip(whole.rows[::2], whole.rows[1::2], strict=True):
        assert first[2] != second[2] and first[3].max(1).values.min() != second[3].max(1).values.min()
    resumed = _mixed_run(tmp_path / "resumed", 3, 2, str(tmp_path / "whole" / "ckpt" / "epoch=0-step=1.ckpt"))
    assert [row[:3] for row in resumed.rows] == [row[:3] for row in whole.rows[2:]]
    assert all(torch.equal(a[3], b[3]) for a, b in zip(resumed.rows, whole.rows[2:], strict=True))

    single = _mixed_run(tmp_path / "single", max_steps=2, accumulate=1)
    assert [seed for _, _, seed, _ in single.rows] == [seed_for(0, Purpose.DROPOUT, step, 0) for step in (0, 1)]
