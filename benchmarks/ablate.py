"""Ablations of the Block's options: what RMSNorm, SwiGLU, sincos / rotary positions, qk-norm and
mixture of experts buy, for text and for images, at an equal wall-clock budget.

    # text: nanoGPT's CPU GPT (configs/gpt/cpu.yaml: 4 layers, 4 heads, width 128, context 64, batch 12)
    flock /tmp/vit-bench.lock .venv/bin/python -m benchmarks.ablate text --variant rope --seconds 120
    # images: vit_nano (width 128, 4 blocks) on CIFAR-10 at 32 px (8x8 patches), in memory
    flock /tmp/vit-bench.lock .venv/bin/python -m benchmarks.ablate images --variant rope --seconds 150
    # speed: every option's training throughput relative to the default block, side by side
    flock /tmp/vit-bench.lock .venv/bin/python -m benchmarks.ablate speed
    # the tables: benchmarks/ablations.md from the results collected so far
    .venv/bin/python -m benchmarks.ablate report

Each run appends one JSON line to <out>/results.jsonl (default runs/ablate/; the newest line per
suite/variant wins). The data is read from --data-root (default $VIT_DATA, else data/):
tinyshakespeare.txt and the CIFAR-10 JPEG folder cifar10/{train,test}/<class>/.

Each run is one `scripts/train.py fit` (vit.cli.main) with a vit.schedule.WallClockBudget: the
warmup (5% of the budget) and cosine follow the clock, so every variant gets a complete schedule in
the same time however fast its steps are. It is then validated once: text on TextDataModule's 1,000
fixed windows, images on 2,000 training images held out (stratified, fixed seed), never the test set.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.report import NOTES_MARKER, data_root, machine, markdown_table, write_report
from vit import create_model
from vit.cli import main as train
from vit.training import Throughput

ROOT = Path(__file__).resolve().parents[1]

TEXT_VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    "rmsnorm": {"norm": "rmsnorm"},
    "swiglu": {"mlp": "swiglu"},
    "sincos": {"posemb": "sincos"},
    "rope": {"posemb": "rope"},
    "qk_norm": {"qk_norm": True},
    "modern": {"norm": "rmsnorm", "mlp": "swiglu", "posemb": "rope"},
    "moe": {"num_experts": 4, "experts_top_k": 1},
}
IMAGE_VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    "sincos2d": {"posemb": "sincos2d"},
    "rope": {"posemb": "rope"},
    "rmsnorm": {"norm": "rmsnorm"},
    "swiglu": {"mlp": "swiglu"},
    "qk_norm": {"qk_norm": True},
    "modern": {"norm": "rmsnorm", "mlp": "swiglu", "posemb": "rope"},
    "moe": {"num_experts": 4, "experts_top_k": 1},
}
AUX_LOSS_WEIGHT = 0.01
# The image model: vit_nano at 32 px (an 8x8 patch grid, like vit_micro_patch4_32, at a third of its
# cost), so that a 2.5-minute budget on a shared CPU core sees ~half an epoch rather than a sixth.
IMAGE_MODEL, IMAGE_MODEL_KWARGS, IMAGE_BATCH = "vit_nano_patch4_16", {"img_size": 32, "num_classes": 10}, 64


WARMUP = 0.05  # of the budget
QUIET = ["--trainer.logger", "false", "--trainer.enable_progress_bar", "false"]
QUIET += ["--trainer.enable_model_summary", "false"]


def num_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def fit_on_the_clock(args: argparse.Namespace, suite: str, options: list[str]) -> tuple[Any, dict[str, float]]:
    """One `scripts/train.py fit` for `args.seconds` of wall clock (vit.schedule.WallClockBudget,
    warmup over its first 5%), no validation while it trains; the CLI and what the run did."""
    run = Path(args.out) / "runs" / f"{suite}-{args.variant}-s{args.seed}"
    cli = train([
        "fit", *options, "--trainer.default_root_dir", str(run), "--seed_everything", str(args.seed), *QUIET,
        "--trainer.max_epochs", "-1", "--trainer.max_steps", "-1", "--trainer.limit_val_batches", "0",
        "--trainer.callbacks+=vit.schedule.WallClockBudget", "--trainer.callbacks.minutes", f"{args.seconds / 60}",
        "--trainer.callbacks+=vit.training.Throughput",
        "--model.schedule", f"{{warmup_epochs: 0, warmup_steps: null, warmup_fraction: {WARMUP}, decay_steps: null}}",
    ])  # fmt: skip
    meter = next(cb for cb in cli.trainer.callbacks if isinstance(cb, Throughput))
    return cli, {"steps": cli.trainer.global_step, "samples": meter.images, "train_seconds": meter.seconds}


def validate(cli: Any) -> dict[str, float]:
    """The trained weights scored once on the validation split (all of it)."""
    cli.trainer.limit_val_batches = 1.0
    (metrics,) = cli.trainer.validate(cli.model, datamodule=cli.datamodule, verbose=False)
    return metrics


# -- text -----------------------------------------------------------------------------------------


def windows(tokens: torch.Tensor, starts: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of the windows starting at `starts`, as one batch."""
    idx = starts[:, None] + torch.arange(block_size + 1)
    chunk = tokens[idx]
    return chunk[:, :-1], chunk[:, 1:]


def run_text(args: argparse.Namespace) -> dict[str, Any]:
    """configs/gpt/cpu.yaml (nanoGPT's CPU recipe: AdamW 1e-3 -> 1e-4, betas (0.9, 0.99), weight
    decay 0.1, clip 1.0) with the variant's GPTConfig options, on the clock."""
    text = Path(args.data_root) / "tinyshakespeare.txt"
    cli, stats = fit_on_the_clock(args, "text", [
        "--config", str(ROOT / "configs/gpt/cpu.yaml"), "--data.path", str(text),
        "--model.model_kwargs", json.dumps(TEXT_VARIANTS[args.variant]),
    ])  # fmt: skip
    val_loss = validate(cli)["val/loss"]
    model, data = cli.model.model.eval(), cli.datamodule
    block_size, val, starts = data.block_size, data.val_set.tokens, torch.tensor(data.val_set.starts)
    long_loss = None
    if args.variant in ("rope", "sincos", "modern"):  # positions that run beyond the training context
        long_starts = starts[starts + 4 * block_size < len(val)][:100]  # the first 100 that fit 4x the context
        x, y = windows(val, long_starts, 4 * block_size)
        with torch.no_grad():
            long_loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item()
    return {
        **stats,
        "val_loss": float(val_loss),
        "val_loss_at_4x_context": long_loss,
        "params": num_params(model),
        "tokens_per_s": stats["samples"] * block_size / stats["train_seconds"],
    }


# -- images ---------------------------------------------------------------------------------------


def run_images(args: argparse.Namespace) -> dict[str, Any]:
    """vit_nano at 32 px on CIFAR-10 decoded once into memory (pad-4 crop + flip in batches), AdamW
    1e-3 -> 1e-5, weight decay 0.05, label smoothing 0.1, clip 1.0, batch 64; 2,000 training images
    held out to validate on."""
    variant = json.dumps(IMAGE_VARIANTS[args.variant])  # the image size and class count: the data's
    root, cache = Path(args.data_root) / "cifar10", Path(args.cache or Path(args.out) / "cache")
    options = [
        "--model", "vit.lit.ImageClassifier", "--model.model_name", IMAGE_MODEL, "--model.model_kwargs", variant,
        "--model.optimizer", "{lr: 1e-3, weight_decay: 0.05}", "--model.schedule.min_lr", "1e-5",
        "--model.label_smoothing", "0.1", "--trainer.gradient_clip_val", "1.0", "--trainer.precision", "32-true",
        "--trainer.accelerator", "cpu", "--trainer.devices", "1",
        "--data", "vit.data.ImageFolderDataModule", "--data.root", str(root), "--data.val_dir", "test",
        "--data.img_size", "32", "--data.batch_size", str(IMAGE_BATCH), "--data.pipeline", "memory",
        "--data.memory.cache_dir", str(cache), "--data.augment", "{crop: pad_crop, crop_padding: 4, hflip: true}",
        "--data.val_holdout", str(args.holdout),
    ]  # fmt: skip
    # One step first, off the clock, so that no variant's budget pays for decoding the images into the cache.
    train(["fit", *options, "--trainer.default_root_dir", str(Path(args.out) / "runs" / "warm-cache"), *QUIET,
           "--trainer.max_steps", "1", "--trainer.limit_val_batches", "0"])  # fmt: skip
    cli, stats = fit_on_the_clock(args, "images", options)
    top1 = validate(cli)["val/acc1"]
    return {
        **stats,
        "val_top1": float(top1),
        "val_images": len(cli.datamodule.val_set),
        "params": num_params(cli.model.model),
        "img_per_s": stats["samples"] / stats["train_seconds"],
        "epochs": stats["samples"] / len(cli.datamodule.train_set),
    }


# -- speed ----------------------------------------------------------------------------------------


def run_speed(args: argparse.Namespace) -> dict[str, Any]:
    """Training throughput (forward, backward, AdamW step) of every variant, measured in interleaved
    rounds in one process so that load from other processes hits all of them alike; the median
    round per variant, relative to the default block."""
    torch.manual_seed(args.seed)
    suites = {
        "images": (
            IMAGE_VARIANTS,
            lambda kw: create_model(IMAGE_MODEL, **IMAGE_MODEL_KWARGS, **kw),
            lambda: (torch.randn(IMAGE_BATCH, 3, 32, 32), torch.randint(10, (IMAGE_BATCH,))),
            F.cross_entropy,
            IMAGE_BATCH,
        ),
        "text": (
            TEXT_VARIANTS,
            lambda kw: create_model("gpt_char_cpu", vocab_size=65, **kw),
            lambda: (torch.randint(65, (12, 64)), torch.randint(65, (12, 64))),
            lambda logits, y: F.cross_entropy(logits.flatten(0, 1), y.flatten()),
            12 * 64,
        ),
    }
    result: dict[str, Any] = {}
    for suite, (variants, build, batch, loss_fn, per_step) in suites.items():
        setups = {}
        for name, kwargs in variants.items():
            model = build(kwargs)
            setups[name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-4), batch())
        times: dict[str, list[float]] = {name: [] for name in variants}
        for round_ in range(args.rounds + 1):
            for name, (model, optimizer, (x, y)) in setups.items():
                start = time.perf_counter()
                for _ in range(args.steps):
                    loss = loss_fn(model(x), y)
                    if hasattr(model, "aux_loss"):
                        loss = loss + AUX_LOSS_WEIGHT * model.aux_loss()
                    optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                    optimizer.step()
                if round_ > 0:  # round 0 warms up
                    times[name].append((time.perf_counter() - start) / args.steps)
        base = statistics.median(times["default"])
        result[suite] = {
            name: {
                "per_s": per_step / statistics.median(t),
                "relative": base / statistics.median(t),
                "params": num_params(setups[name][0]),
            }
            for name, t in times.items()
        }
    return result


# -- report ---------------------------------------------------------------------------------------


def load_results(out: Path) -> dict[tuple[str, str], dict[str, Any]]:
    results: dict[tuple[str, str], dict[str, Any]] = {}
    path = out / "results.jsonl"
    if path.is_file():
        for line in path.read_text().splitlines():
            row = json.loads(line)
            results[(row["suite"], row["variant"])] = row
    return results


def options_text(kwargs: dict[str, Any]) -> str:
    return ", ".join(f"`{k}={v!r}`" for k, v in kwargs.items()) or "(defaults)"


def report(out: Path, path: Path) -> None:
    """The markdown tables of every suite run so far, above the notes kept from the existing file:
    per suite the table, the commands that measured it, the machine, then what the columns mean."""
    results = load_results(out)
    lines = ["# Ablations of the Block's options", ""]
    text = [(v, results[("text", v)]) for v in TEXT_VARIANTS if ("text", v) in results]
    if text:
        r0 = text[0][1]
        header = ("variant", "options", "params", "steps", "tokens/s (in run)", "val loss", "4x ctx")
        rows = []
        for v, r in text:
            long = f"{r['val_loss_at_4x_context']:.3f}" if r.get("val_loss_at_4x_context") is not None else "-"
            rows.append((
                v, options_text(TEXT_VARIANTS[v]), f"{r['params']:,}", f"{r['steps']:,}", f"{r['tokens_per_s']:,.0f}",
                f"**{r['val_loss']:.3f}**", long,
            ))  # fmt: skip
        lines += ["## Text: Tiny Shakespeare, nanoGPT's CPU GPT", "", *markdown_table(header, rows, align="llrrrrr")]
        lines += ["", "```bash"]
        lines += [
            f"flock /tmp/vit-bench.lock .venv/bin/python -m benchmarks.ablate text --variant {v} "
            f"--seconds {r['seconds']:.0f} --seed {r['seed']}"
            for v, r in text
        ]
        lines += [
            "```",
            "",
            f"Machine: {r0['machine']}.",
            "",
            f"- Model: `gpt_char_cpu` (4 layers, 4 heads, width 128, context 64, batch 12), {r0['seconds']:.0f} s of "
            f"training each (`configs/gpt/cpu.yaml` on the clock), seed {r0['seed']}; AdamW 1e-3 -> 1e-4 (cosine "
            "on the clock, 5% warmup), betas (0.9, 0.99), weight decay 0.1, clip 1.0.",
            "- *val loss*: mean cross-entropy (nats/char) over 1,000 fixed 64-character windows of the held-out "
            "last 10%. *4x ctx*: val loss on 100 windows of 256 characters (4x the training context; learned "
            "positions cannot run there).",
            "",
        ]
    images = [(v, results[("images", v)]) for v in IMAGE_VARIANTS if ("images", v) in results]
    if images:
        r0 = images[0][1]
        header = ("variant", "options", "params", "steps", "epochs", "img/s (in run)", "val top-1")
        rows = [
            (v, options_text(IMAGE_VARIANTS[v]), f"{r['params']:,}", f"{r['steps']:,}", f"{r['epochs']:.2f}",
             f"{r['img_per_s']:,.0f}", f"**{100 * r['val_top1']:.1f}%**")
            for v, r in images
        ]  # fmt: skip
        lines += ["## Images: CIFAR-10, vit_nano at 32 px", "", *markdown_table(header, rows, align="llrrrrr")]
        lines += ["", "```bash"]
        lines += [
            f"flock /tmp/vit-bench.lock .venv/bin/python -m benchmarks.ablate images --variant {v} "
            f"--seconds {r['seconds']:.0f} --seed {r['seed']}"
            for v, r in images
        ]
        lines += [
            "```",
            "",
            f"Machine: {r0['machine']}.",
            "",
            "- Model: `vit_nano_patch4_16` with `img_size=32` (width 128, 4 blocks, 4 heads, 4x4 patches: an 8x8 "
            f"grid, CLS pooling), {r0['seconds']:.0f} s of training each, seed {r0['seed']}, batch 64; AdamW "
            "1e-3 -> 1e-5 (cosine on the clock, 5% warmup), weight decay 0.05, label smoothing 0.1, clip 1.0.",
            f"- Data: the CIFAR-10 training images but {r0.get('val_images', 2000):,} held out (stratified, fixed "
            "seed), decoded once into memory, pad-4 random crop + horizontal flip. *val top-1*: on the held-out "
            "images, whole image.",
            "",
        ]
    speed = results.get(("speed", "all"))
    if speed:
        header = ("variant", "options", "ViT params", "img/s", "relative", "GPT params", "tokens/s", "relative")
        img, txt = speed["images"], speed["text"]
        rows = []
        for v in IMAGE_VARIANTS:
            i, t = img.get(v), txt.get("sincos" if v == "sincos2d" else v)
            opts = options_text(IMAGE_VARIANTS[v])
            if v == "sincos2d":
                opts = "`posemb='sincos2d'` (ViT) / `posemb='sincos'` (GPT)"
            cells_i = [f"{i['params']:,}", f"{i['per_s']:,.0f}", f"{i['relative']:.2f}"] if i else ["-"] * 3
            cells_t = [f"{t['params']:,}", f"{t['per_s']:,.0f}", f"{t['relative']:.2f}"] if t else ["-"] * 3
            rows.append((v, opts, *cells_i, *cells_t))
        lines += [
            "## Speed: cost of each option relative to the default block",
            "",
            *markdown_table(header, rows, align="llrrrrrr"),
            "",
            "```bash",
            f"flock /tmp/vit-bench.lock .venv/bin/python -m benchmarks.ablate speed --steps {speed['steps']} "
            f"--rounds {speed['rounds']}",
            "```",
            "",
            f"Machine: {speed['machine']}.",
            "",
            f"- Training steps (forward, backward, AdamW) per second, {speed['steps']} steps x {speed['rounds']} "
            "interleaved rounds per variant in one process, median round. Images: vit_nano at 32 px (8x8 grid), "
            "batch 64; text: gpt_char_cpu, batch 12 x 64 tokens.",
            "- *relative*: default's time / the variant's (above 1 is faster).",
            "",
        ]
    lines += [
        "Every training run is one `scripts/train.py fit` with one seed and a fixed wall-clock budget, alone on "
        "a 2-core CPU (`flock`). With ~2-minute budgets, differences of a few hundredths of a nat (text) or about "
        "one point of accuracy (images) are within run-to-run noise: rough evidence, not rankings. Tables: "
        f"`python -m benchmarks.ablate report` from the runs in `{out / 'results.jsonl'}`.",
        "",
        "",
    ]
    written = write_report(path, "\n".join(lines), NOTES_MARKER)
    print(f"wrote {written}")


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    """Run one suite and append its row to <out>/results.jsonl (returned), or write the report."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("suite", choices=["text", "images", "speed", "report"])
    parser.add_argument("--variant", default="default")
    parser.add_argument("--seconds", type=float, default=None, help="training budget (text 120, images 150)")
    parser.add_argument("--seed", type=int, default=None, help="text 1337, images 0")
    parser.add_argument("--steps", type=int, default=5, help="speed: steps per round")
    parser.add_argument("--rounds", type=int, default=5, help="speed: interleaved rounds")
    parser.add_argument("--threads", type=int, default=1, help="1: robust when other jobs share the cores")
    parser.add_argument(
        "--data-root", default=str(data_root()), help="has tinyshakespeare.txt and cifar10/ (default $VIT_DATA)"
    )
    parser.add_argument("--out", default="runs/ablate", help="results.jsonl goes here")
    parser.add_argument("--cache", default=None, help="decoded CIFAR-10 tensors (default: <out>/cache)")
    parser.add_argument("--holdout", type=int, default=2000, help="images: training images held out to validate on")
    parser.add_argument("--report", default=str(ROOT / "benchmarks" / "ablations.md"))
    args = parser.parse_args(argv)
    out = Path(args.out)
    if args.suite == "report":
        report(out, Path(args.report))
        return None
    torch.set_num_threads(args.threads)
    variants = {"text": TEXT_VARIANTS, "images": IMAGE_VARIANTS}.get(args.suite)
    if variants is not None and args.variant not in variants:
        parser.error(f"unknown {args.suite} variant {args.variant!r}; choose from {', '.join(variants)}")
    args.seconds = args.seconds or {"text": 120.0, "images": 150.0}.get(args.suite, 0.0)
    args.seed = args.seed if args.seed is not None else {"text": 1337}.get(args.suite, 0)
    run = {"text": run_text, "images": run_images, "speed": run_speed}[args.suite]
    started = time.time()
    result = run(args)
    row = {
        "suite": args.suite,
        "variant": args.variant if args.suite != "speed" else "all",
        "seconds": args.seconds,
        "seed": args.seed,
        "rounds": args.rounds,
        "threads": args.threads,
        "machine": machine(),
        "wall_seconds": time.time() - started,
        **result,
    }
    if args.suite == "speed":
        row["steps"] = args.steps  # per round; the training runs report their own step count
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "results.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row, indent=1))
    return row


if __name__ == "__main__":
    main()
