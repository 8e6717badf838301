"""Does fine-tuning help? Two studies on real data, written to a markdown table.

    python -m benchmarks.finetune_study --vit-checkpoint runs/tiny_imagenet_vit/checkpoints/last.ckpt \
        --cifar-root ../shared/data/cifar10 --resnet-checkpoint ../shared/weights/resnet56-4bfd9763.th \
        --out benchmarks/finetune.md

1. Transfer: the ViT pretrained on Tiny-ImageNet (64x64, 200 classes) fine-tuned on CIFAR-10
   resized to its 64 px (new 10-class head), next to the same model trained from scratch with the
   from-scratch recipe (configs/tiny_imagenet_vit.yaml's optimizer and schedule) and a linear probe,
   all with the same epochs, data and augmentation (configs/finetune/tiny_to_cifar10_cpu.yaml).
2. JPEG shift: the ResNet-56 checkpoint trained on the original CIFAR-10 PNGs, evaluated on the JPEG
   copy before and after a short fine-tune there (configs/finetune/resnet56_cifar10_jpeg.yaml); the
   table says how much of the accuracy lost to JPEG the fine-tune recovers.

Every row is `scripts/train.py` with a config plus overrides: fine-tuning is a config, not code.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.report import NOTES_MARKER, data_root, machine, markdown_table, weights_root, write_report
from vit.cli import main as train
from vit.training import Throughput

ROOT = Path(__file__).resolve().parents[1]
VIT_CONFIG = "configs/finetune/tiny_to_cifar10_cpu.yaml"
RESNET_CONFIG = "configs/finetune/resnet56_cifar10_jpeg.yaml"
# The from-scratch row trains with the from-scratch recipe (configs/tiny_imagenet_vit.yaml, tuned as
# configs/cifar10_vit.yaml), not with the fine-tuning optimizer: a fair baseline is the best one.
SCRATCH = [
    "--model.finetune.layer_decay", "null",
    "--model.optimizer", "{name: muon, lr: 4e-3, lr_base_batch_size: 128, betas: [0.9, 0.99]}",
    "--model.schedule", "{warmup_epochs: 0, warmup_fraction: 0.05, min_lr: 0}",
]  # fmt: skip
RESNET_PNG_TOP1 = 93.39  # akamaster/pytorch_resnet_cifar10's reported ResNet-56 test accuracy on the PNGs


@dataclass
class Row:
    study: str
    setting: str
    overrides: str
    epochs: int
    wall_minutes: float
    img_per_s: float
    top1: float


def _run(subcommand: str, config: str, workdir: Path, overrides: list[str]):
    args = [subcommand, "--config", str(ROOT / config), "--trainer.default_root_dir", str(workdir)]
    args += ["--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]
    if subcommand == "fit":
        args += ["--trainer.callbacks+=vit.training.Throughput"]
    start = time.perf_counter()
    cli = train(args + overrides)
    return cli, (time.perf_counter() - start) / 60


def study(args: argparse.Namespace) -> list[Row]:
    data = ["--data.root", args.cifar_root]
    if args.precision is not None:
        data += ["--trainer.precision", args.precision]
    if args.num_workers is not None:
        data += ["--data.num_workers", str(args.num_workers)]
    if args.limit_batches is not None:
        data += ["--trainer.limit_train_batches", str(args.limit_batches)]
        data += ["--trainer.limit_val_batches", str(args.limit_batches)]
    work = Path(args.workdir)
    rows = []

    # The ViT rows read CIFAR-10 in memory at 64 px: decoded once into one cache for all four rows.
    vit_data = [*data, "--data.memory.cache_dir", str(work / "cache")]

    def fit(study_name: str, setting: str, config: str, name: str, epochs: int, overrides: list[str],
            inputs: list[str] = vit_data) -> None:  # fmt: skip
        cli, minutes = _run("fit", config, work / name, [*inputs, "--trainer.max_epochs", str(epochs), *overrides])
        meter = next(cb for cb in cli.trainer.callbacks if isinstance(cb, Throughput))
        top1 = 100 * float(cli.trainer.callback_metrics["val/acc1"])
        rows.append(Row(study_name, setting, " ".join(overrides), epochs, minutes, meter.images_per_second, top1))
        print(rows[-1], flush=True)

    vit = "ViT transfer (Tiny-ImageNet -> CIFAR-10 @64)"
    pretrained = ["--model.finetune.init_from", args.vit_checkpoint]
    fit(vit, "from scratch", VIT_CONFIG, "vit_scratch", args.epochs, ["--model.finetune.init_from", "null", *SCRATCH])
    fit(vit, "fine-tuned, layer decay 0.75", VIT_CONFIG, "vit_finetune", args.epochs, pretrained)
    fit(vit, "fine-tuned, no layer decay", VIT_CONFIG, "vit_finetune_flat", args.epochs,
        [*pretrained, "--model.finetune.layer_decay", "null"])  # fmt: skip
    probe = ["--model.finetune", "{freeze_backbone: true, layer_decay: null}", "--model.optimizer.lr", "5e-3"]
    fit(vit, "linear probe (frozen backbone)", VIT_CONFIG, "vit_probe", args.epochs, [*pretrained, *probe])

    jpeg = "ResNet-56 PNG checkpoint on JPEG CIFAR-10"
    resnet = [*data, "--model.finetune.init_from", args.resnet_checkpoint]  # the data and the weights, as inputs
    cli, minutes = _run("validate", RESNET_CONFIG, work / "resnet56_before", resnet)
    before = 100 * float(cli.trainer.callback_metrics["val/acc1"])
    rows.append(Row(jpeg, "checkpoint as is (no training)", "validate", 0, minutes, 0.0, before))
    fit(jpeg, "fine-tuned on the JPEG train split", RESNET_CONFIG, "resnet56_finetune", args.resnet_epochs, [], resnet)
    return rows


def to_markdown(rows: list[Row], args: argparse.Namespace, command: str) -> str:
    """The tables, the command that measured them, the machine, then what the columns mean."""
    lines = ["# Fine-tuning studies", ""]
    lines += markdown_table(
        ("study", "setting", "epochs", "train img/s", "wall (min)", "test top-1", "overrides"),
        [
            (r.study, r.setting, r.epochs, f"{r.img_per_s:.0f}" if r.img_per_s else "-", f"{r.wall_minutes:.1f}",
             f"{r.top1:.2f}%", f"`{r.overrides}`" if r.overrides else "(config as is)")
            for r in rows
        ],
        "llrrrrl",
    )  # fmt: skip
    resnet = [r for r in rows if r.study.startswith("ResNet")]
    if len(resnet) == 2:
        before, after = resnet[0].top1, resnet[1].top1
        lost = RESNET_PNG_TOP1 - before
        lines += [""]
        lines += markdown_table(
            ("JPEG shift, ResNet-56", "PNG test set (published)", "JPEG test set", "lost", "after the fine-tune",
             "recovered"),
            [("test top-1", f"{RESNET_PNG_TOP1}%", f"{before:.2f}%", f"{lost:.2f} points", f"{after:.2f}%",
              f"{after - before:.2f} points ({100 * (after - before) / lost:.0f}% of the loss)")],
            "lrrrrr",
        )  # fmt: skip
    lines += [
        "",
        "```bash",
        command,
        "```",
        "",
        f"Machine: {machine()}. Date: {time.strftime('%Y-%m-%d')}.",
        "",
        f"- Data: `{args.cifar_root}`, CIFAR-10 re-encoded as JPEG quality 75 (train 50,000 / test 10,000): "
        "the rows compare with each other, not with papers' CIFAR-10 tables.",
        "- *test top-1*: the full test split after the last epoch. *wall*: the whole `scripts/train.py` call, "
        "data loading included. *overrides*: the options on top of the study's config "
        f"(`{VIT_CONFIG}` for the ViT, `{RESNET_CONFIG}` for the ResNet).",
        "",
        "",
    ]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vit-checkpoint", required=True, help="our Tiny-ImageNet ViT (.ckpt or .safetensors)")
    p.add_argument("--cifar-root", default=str(data_root() / "cifar10"), help="default $VIT_DATA/cifar10")
    p.add_argument(
        "--resnet-checkpoint", default=str(weights_root() / "resnet56-4bfd9763.th"), help="default under $VIT_WEIGHTS"
    )
    p.add_argument("--epochs", type=int, default=2, help="ViT rows (all the same)")
    p.add_argument("--resnet-epochs", type=int, default=1)
    p.add_argument("--num-workers", type=int, default=None)
    p.add_argument("--precision", default=None, help="e.g. bf16-mixed (GPUs, CPUs with AMX or AVX512-BF16)")
    p.add_argument("--limit-batches", type=int, default=None, help="train/val batches per epoch (smoke tests)")
    p.add_argument("--workdir", default="runs/finetune_study")
    p.add_argument("--out", default="benchmarks/finetune.md")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> list[Row]:
    args = parse_args(argv)
    rows = study(args)
    command = "python -m benchmarks.finetune_study " + " ".join(sys.argv[1:] if argv is None else argv)
    print(write_report(args.out, to_markdown(rows, args, command), NOTES_MARKER).read_text())
    return rows


if __name__ == "__main__":
    main()
