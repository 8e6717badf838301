"""Timed fits on synthetic tensors: the rows the GPU check (vit.tools.gpu_check) and the data
check (vit.tools.data_check) report, and the fit both time a model with (`run_fit`: a few steps
of training on one batch already on the device, so no data loading is in the measurement)."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from vit.tools.flops import forward_flops, mfu


@dataclass
class Row:
    check: str
    ok: bool
    img_per_s: float | None = None
    peak_memory: int | None = None  # bytes, the largest over the run's processes' reports (rank 0)
    mfu: float | None = None
    note: str = ""


def format_table(rows: list[Row]) -> str:
    lines = ["| check | result | img/s | peak memory | MFU | note |", "|---|---|---|---|---|---|"]
    for r in rows:
        speed = f"{r.img_per_s:,.0f}" if r.img_per_s is not None else "-"
        memory = f"{r.peak_memory / 2**30:.2f} GiB" if r.peak_memory is not None else "-"
        fit = r.img_per_s is not None and "data path" not in r.check  # a data path has no FLOPs
        util = f"{100 * r.mfu:.1f}%" if r.mfu is not None else ("unknown" if fit else "-")
        lines.append(f"| {r.check} | {'ok' if r.ok else 'FAILED'} | {speed} | {memory} | {util} | {r.note} |")
    return "\n".join(lines)


# -- one fit on synthetic data ------------------------------------------------------------------


class SyntheticBatches(Dataset):
    """`steps` batches of random images and labels, each the same tensors, moved once to the process's
    GPU on first use (no data loading or host-to-device copy in the measurement)."""

    def __init__(self, steps: int, batch: int, img_size: int, num_classes: int, cuda: bool) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(batch, 3, img_size, img_size, generator=generator)
        self.y = torch.randint(0, num_classes, (batch,), generator=generator)
        self.steps, self.cuda = steps, cuda

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.cuda and not self.x.is_cuda:  # Lightning has set this rank's device by now
            self.x, self.y = self.x.cuda(), self.y.cuda()
        return self.x, self.y


def square_side(img_size: int | tuple[int, int]) -> int:
    """A model's image side: its img_size, or the first of (height, width)."""
    return img_size[0] if isinstance(img_size, (tuple, list)) else img_size


@dataclass
class FitCase:
    check: str
    model: str
    steps: int
    batch: int
    device: str  # "cuda" or "cpu"
    compile: bool = False
    channels_last: bool = False
    img_size: int | None = None
    strategy: str = "auto"  # "auto" (one device), "ddp" or "sharded"
    devices: int = 1
    peak: float | None = None
    warmup: int | None = None  # steps not timed; None: min(10, steps // 3)


def run_fit(case: FitCase, task: Any = None) -> tuple[Row, str | None]:
    """Train `case.model` for `case.steps` steps (bf16-mixed on CUDA, float32 on CPU) and measure it;
    also the process group's backend (None on one device). `task`: a vit.lit.ImageClassifier to
    train instead of the default one (AdamW, 1000 classes)."""
    import lightning as L

    from vit.lit import ImageClassifier, Speed
    from vit.registry import model_config
    from vit.training import Optimizer, Schedule, StepTimer

    cuda = case.device == "cuda"
    img_size = square_side(case.img_size or getattr(model_config(case.model), "img_size", 224))
    sized = hasattr(model_config(case.model), "img_size")
    if task is None:
        task = ImageClassifier(
            case.model, num_classes=1000, img_size=img_size if sized else None, optimizer=Optimizer(lr=1e-4),
            schedule=Schedule(warmup_steps=0), speed=Speed(compile=case.compile, channels_last=case.channels_last),
        )  # fmt: skip
    classes = task.hparams.num_classes
    flops = 3 * forward_flops(task.model, img_size)
    strategy: Any = case.strategy
    if case.strategy == "sharded":
        from vit.sharding import ShardedStrategy

        strategy = ShardedStrategy()
    warmup = min(10, max(1, case.steps // 3)) if case.warmup is None else case.warmup
    timer = StepTimer(warmup)
    data = DataLoader(SyntheticBatches(case.steps, case.batch, img_size, classes, cuda), batch_size=None)
    with tempfile.TemporaryDirectory() as root:
        trainer = L.Trainer(
            accelerator="gpu" if cuda else "cpu", devices=case.devices, strategy=strategy,
            precision="bf16-mixed" if cuda else "32-true", max_steps=case.steps, limit_val_batches=0,
            logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            default_root_dir=root, callbacks=[timer], use_distributed_sampler=False,
        )  # fmt: skip
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        trainer.fit(task, train_dataloaders=data)
    if trainer.global_step != case.steps:
        raise RuntimeError(f"ran {trainer.global_step} of {case.steps} steps")
    speed = timer.images / timer.seconds if timer.seconds else None
    note = f"batch {case.batch}/device, {case.steps} steps, {'bf16-mixed' if cuda else 'fp32'}"
    if timer.backend is not None:
        note += f", {case.devices} processes, {timer.backend}"
    memory = torch.cuda.max_memory_allocated() if cuda else None
    util = mfu(speed, flops, case.peak, case.devices) if speed else None
    return Row(case.check, True, speed, memory, util, note), timer.backend
