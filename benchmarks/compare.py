"""Train a ViT and ResNet baselines on the same data, augmentation and budget; write a markdown table.

    python -m benchmarks.compare --data-root ../shared/data/cifar10 --val-dir test --minutes 25 \
        --out benchmarks/vit_vs_resnet.md

Each model keeps its own optimiser recipe (its config: AdamW for the ViT, SGD for the ResNets);
the data options (crop, flip, RandAugment, Mixup) are the same for all. The budget is epochs
(--epochs) or wall-clock minutes per model (--minutes: a short probe measures each model's
training speed, then the epoch count is set so the learning-rate schedule ends on time).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.report import machine, markdown_table, write_report
from vit.cli import main as train
from vit.training import Throughput

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODELS = ["vit=configs/cifar10_vit.yaml", "resnet20=configs/cifar10_resnet.yaml"]


@dataclass
class Result:
    name: str
    model_name: str
    params: int
    epochs: int
    img_per_s: float
    wall_minutes: float
    best_top1: float
    last_top1: float


def _run(config: str, root: Path, overrides: list[str]) -> tuple[object, Throughput, float]:
    """One `scripts/train.py fit` in this process; returns the CLI, its throughput meter, wall seconds."""
    args = ["fit", "--config", str(ROOT / config), "--trainer.default_root_dir", str(root)]
    args += ["--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]
    args += ["--trainer.callbacks+=vit.training.Throughput", *overrides]
    start = time.perf_counter()
    cli = train(args)
    wall = time.perf_counter() - start
    meter = next(cb for cb in cli.trainer.callbacks if isinstance(cb, Throughput))
    return cli, meter, wall


def compare(args: argparse.Namespace) -> list[Result]:
    data = [
        "--data", "vit.data.ImageFolderDataModule", "--data.root", args.data_root, "--data.val_dir", args.val_dir,
        "--data.img_size", "32", "--data.batch_size", str(args.batch_size),
        "--data.augment", f"{{crop: pad_crop, crop_padding: 4, hflip: true, randaugment_ops: {args.randaugment_ops}}}",
        "--data.mixup", "{mixup_alpha: 0, cutmix_alpha: 0}",
    ]  # fmt: skip
    if args.num_workers is not None:
        data += ["--data.num_workers", str(args.num_workers)]
    if args.limit_batches is not None:  # smoke tests
        data += ["--trainer.limit_train_batches", str(args.limit_batches)]
        data += ["--trainer.limit_val_batches", str(args.limit_batches)]
    results = []
    for spec in args.models:
        name, config = spec.split("=", 1)
        config, _, model_name = config.partition(":")
        model = ["--model.model_name", model_name] if model_name else []
        out = Path(args.workdir) / name
        epochs = args.epochs
        if args.minutes:
            probe_args = ["--trainer.max_epochs", "1", "--trainer.limit_train_batches", str(args.probe_batches)]
            _, probe, _ = _run(config, out / "probe", [*data, *model, *probe_args, "--trainer.limit_val_batches", "0"])
            train_images = _train_size(args)
            epochs = max(1, math.floor(args.minutes * 60 * probe.images_per_second / train_images))
            print(f"[{name}] probe: {probe.images_per_second:.0f} img/s -> {epochs} epochs in {args.minutes} min")
        # A short budget must not end inside a config's warmup (the ViT's is 5 epochs): every model
        # warms up for the first 10% of its budget, then decays on its own schedule.
        schedule = ["--trainer.max_epochs", str(epochs), "--model.schedule.warmup_epochs", f"{0.1 * epochs:g}"]
        cli, meter, wall = _run(config, out / "run", [*data, *model, *schedule])
        ckpt = cli.trainer.checkpoint_callback
        results.append(
            Result(
                name=name,
                model_name=cli.model.hparams.model_name,
                params=sum(p.numel() for p in cli.model.model.parameters()),
                epochs=epochs,
                img_per_s=meter.images_per_second,
                wall_minutes=wall / 60,
                best_top1=float(ckpt.best_model_score),
                last_top1=float(cli.trainer.callback_metrics["val/acc1"]),
            )
        )
        print(results[-1], flush=True)
    return results


def _train_size(args: argparse.Namespace) -> int:
    from vit.data.images import scan_image_folder

    return len(scan_image_folder(Path(args.data_root) / "train")[1])


def to_markdown(results: list[Result], args: argparse.Namespace, command: str) -> str:
    budget = f"{args.minutes} wall-clock minutes per model" if args.minutes else f"{args.epochs} epochs per model"
    lines = [
        "# ViT vs ResNet on CIFAR-10 (JPEG copy), same data, augmentation and budget",
        "",
        f"Command: `{command}`",
        "",
        f"Machine: {machine()}. Date: {time.strftime('%Y-%m-%d')}.",
        "",
        f"Budget: {budget}. Data: `{args.data_root}` (train 50,000 / test 10,000), pad-4 + random crop + "
        f"flip, RandAugment ops {args.randaugment_ops}, no Mixup; batch {args.batch_size}. Each model uses its "
        "own config's optimiser (ViT: AdamW; ResNet: SGD-Nesterov), with linear warmup over the first 10% of "
        "the budget, then cosine decay. The budget is whole epochs, at least one: a model slower than one "
        "epoch in the budget gets one epoch (see its wall time).",
        "",
    ]
    header = ("model", "name", "params", "epochs", "train img/s", "wall time (min)", "best val top-1", "last val top-1")
    lines += markdown_table(
        header,
        [
            (r.name, f"`{r.model_name}`", f"{r.params / 1e6:.2f}M", r.epochs, f"{r.img_per_s:.0f}",
             f"{r.wall_minutes:.1f}", f"{100 * r.best_top1:.2f}%", f"{100 * r.last_top1:.2f}%")
            for r in results
        ],
    )  # fmt: skip
    lines += [
        "",
        "This CIFAR-10 copy is re-encoded as JPEG (quality 75), so accuracies are comparable with each other, "
        "not with papers' CIFAR-10 tables.",
    ]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-root", required=True, help="ImageFolder root with train/<class>/ and <val-dir>/<class>/")
    p.add_argument("--val-dir", default="val")
    p.add_argument("--models", nargs="+", default=DEFAULT_MODELS, help="name=config[:model_name] entries")
    budget = p.add_mutually_exclusive_group(required=True)
    budget.add_argument("--epochs", type=int)
    budget.add_argument("--minutes", type=float)
    p.add_argument("--probe-batches", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--randaugment-ops", type=int, default=0)
    p.add_argument("--num-workers", type=int, default=None)
    p.add_argument("--limit-batches", type=int, default=None, help="train/val batches per epoch (smoke tests)")
    p.add_argument("--workdir", default="runs/compare")
    p.add_argument("--out", default="benchmarks/vit_vs_resnet.md")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> list[Result]:
    args = parse_args(argv)
    results = compare(args)
    command = "python -m benchmarks.compare " + " ".join(sys.argv[1:] if argv is None else argv)
    print(write_report(args.out, to_markdown(results, args, command)).read_text())
    return results


if __name__ == "__main__":
    main()
