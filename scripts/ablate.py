"""Ablations of the Block's options (issue 8): what RMSNorm, SwiGLU, sincos / rotary positions,
qk-norm and mixture of experts buy, for text and for images, at an equal wall-clock budget.

    # text: nanoGPT's CPU GPT (4 layers, 4 heads, width 128, context 64, batch 12) on Tiny Shakespeare
    flock /tmp/vit-bench.lock .venv/bin/python scripts/ablate.py text --variant rope --seconds 120
    # images: vit_nano (width 128, 4 blocks) on CIFAR-10 at 32 px (8x8 patches; all 50k training
    # images, 2,000 fixed test images)
    flock /tmp/vit-bench.lock .venv/bin/python scripts/ablate.py images --variant rope --seconds 150
    # speed: every option's training throughput relative to the default block, side by side
    flock /tmp/vit-bench.lock .venv/bin/python scripts/ablate.py speed
    # the tables: benchmarks/ablations.md from the results collected so far
    .venv/bin/python scripts/ablate.py report

Each run appends one JSON line to <out>/results.jsonl (the newest line per suite/variant wins).
The training loops are compact on purpose (no Lightning, no loader processes): the budget is
spent on the model, the same way for every variant. The learning-rate schedule runs on the
clock (linear warmup over the first 5% of the budget, then cosine to min_lr at the end), so every
variant gets a complete schedule in the same time, however fast its steps are.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vit import create_model
from vit.data.images import read_rgb, scan_image_folder
from vit.data.text import CharTokenizer, read_text
from vit.data.transforms import IMAGENET_MEAN, IMAGENET_STD
from vit.lit import param_groups

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data"

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


def lr_at(progress: float, lr: float, min_lr: float, warmup: float = 0.05) -> float:
    """Linear warmup over the first `warmup` of the budget, then cosine down to min_lr at the end."""
    if progress < warmup:
        return lr * (progress + 1e-3) / warmup
    t = min(1.0, (progress - warmup) / (1 - warmup))
    return min_lr + (lr - min_lr) * 0.5 * (1 + math.cos(math.pi * t))


def num_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def train_for(
    model: torch.nn.Module,
    batches,
    loss_fn,
    seconds: float,
    lr: float,
    min_lr: float,
    weight_decay: float,
    betas: tuple[float, float],
) -> dict[str, float]:
    """Train until `seconds` of wall clock have passed; returns steps, samples and the final train loss."""
    optimizer = torch.optim.AdamW(param_groups(model, weight_decay, lr), lr=lr, betas=betas)
    model.train()
    steps, samples, smooth = 0, 0, None
    start = time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(elapsed / seconds, lr, min_lr)
        x, y = next(batches)
        loss = loss_fn(model(x), y)
        if hasattr(model, "aux_loss"):
            loss = loss + AUX_LOSS_WEIGHT * model.aux_loss()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        steps, samples = steps + 1, samples + len(x)
        smooth = loss.item() if smooth is None else 0.98 * smooth + 0.02 * loss.item()
    return {"steps": steps, "samples": samples, "train_seconds": time.perf_counter() - start, "train_loss": smooth}


# -- text -----------------------------------------------------------------------------------------


def shakespeare(block_size: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Train and validation token tensors (nanoGPT's 90/10 split) and the vocabulary size."""
    text = read_text(SHARED / "tinyshakespeare.txt")
    tokenizer = CharTokenizer.from_text(text)
    tokens = torch.tensor(tokenizer.encode(text), dtype=torch.long)
    n = int(len(tokens) * 0.9)
    return tokens[:n], tokens[n:], len(tokenizer)


def windows(tokens: torch.Tensor, starts: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx = starts[:, None] + torch.arange(block_size + 1)
    chunk = tokens[idx]
    return chunk[:, :-1], chunk[:, 1:]


def run_text(args: argparse.Namespace) -> dict[str, Any]:
    block_size, batch_size = 64, 12
    train, val, vocab = shakespeare(block_size)
    torch.manual_seed(args.seed)
    model = create_model("gpt_char_cpu", vocab_size=vocab, **TEXT_VARIANTS[args.variant])
    gen = torch.Generator().manual_seed(args.seed)

    def batches():
        while True:
            yield windows(train, torch.randint(len(train) - block_size - 1, (batch_size,), generator=gen), block_size)

    def lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    # nanoGPT's shakespeare_char recipe: AdamW 1e-3 -> 1e-4, betas (0.9, 0.99), weight decay 0.1, clip 1.0.
    stats = train_for(model, batches(), lm_loss, args.seconds, 1e-3, 1e-4, 0.1, (0.9, 0.99))
    # Validation: 1,000 fixed windows of the held-out 10% (starts drawn with seed 0), 64k characters.
    starts = torch.randint(len(val) - block_size - 1, (1000,), generator=torch.Generator().manual_seed(0))
    model.eval()
    losses = []
    with torch.no_grad():
        for chunk in starts.split(100):
            x, y = windows(val, chunk, block_size)
            losses.append(lm_loss(model(x), y).item())
        long_x, long_y = windows(val, starts[:100], 4 * block_size)
        long_loss = lm_loss(model(long_x), long_y).item() if args.variant in ("rope", "sincos", "modern") else None
    return {
        **stats,
        "val_loss": statistics.fmean(losses),
        "val_loss_at_4x_context": long_loss,
        "params": num_params(model),
        "tokens_per_s": stats["samples"] * block_size / stats["train_seconds"],
    }


# -- images ---------------------------------------------------------------------------------------


def cifar_arrays(root: Path, cache: Path, split: str, limit: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """All images of root/split as one uint8 (N, 3, 32, 32) tensor and labels, decoded once and cached.
    With `limit`, a fixed (seed 0) random subset of that size."""
    path = cache / f"cifar10_{split}.pt"
    if path.is_file():
        images, labels = torch.load(path)
    else:
        _, samples = scan_image_folder(root / split)
        images = torch.from_numpy(np.stack([read_rgb(s.path) for s in samples])).permute(0, 3, 1, 2).contiguous()
        labels = torch.tensor([s.label for s in samples])
        cache.mkdir(parents=True, exist_ok=True)
        torch.save((images, labels), path)
    if limit is not None and limit < len(images):
        keep = torch.randperm(len(images), generator=torch.Generator().manual_seed(0))[:limit]
        images, labels = images[keep], labels[keep]
    return images, labels


MEAN = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1) * 255
STD = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1) * 255


def augment(images: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """CIFAR's standard augmentation on a uint8 batch: pad 4 + random 32x32 crop, random flip; normalise."""
    b = len(images)
    padded = F.pad(images.float(), (4, 4, 4, 4))
    dy, dx = torch.randint(9, (b,), generator=gen), torch.randint(9, (b,), generator=gen)
    rows = (dy[:, None] + torch.arange(32))[:, None, :, None]  # (b, 1, 32, 1)
    cols = (dx[:, None] + torch.arange(32))[:, None, None, :]  # (b, 1, 1, 32)
    out = padded[torch.arange(b)[:, None, None, None], torch.arange(3)[None, :, None, None], rows, cols]
    flip = torch.rand(b, generator=gen) < 0.5
    out[flip] = out[flip].flip(-1)
    return (out - MEAN) / STD


def run_images(args: argparse.Namespace) -> dict[str, Any]:
    root, cache = SHARED / "cifar10", Path(args.cache)
    train_x, train_y = cifar_arrays(root, cache, "train", None)
    test_x, test_y = cifar_arrays(root, cache, "test", 2000)
    torch.manual_seed(args.seed)
    model = create_model(IMAGE_MODEL, **IMAGE_MODEL_KWARGS, **IMAGE_VARIANTS[args.variant])
    gen = torch.Generator().manual_seed(args.seed)
    batch_size = IMAGE_BATCH

    def batches():
        while True:
            for idx in torch.randperm(len(train_x), generator=gen).split(batch_size):
                if len(idx) == batch_size:
                    yield augment(train_x[idx], gen), train_y[idx]

    # configs/cifar10_vit.yaml's optimiser: AdamW 1e-3, weight decay 0.05, label smoothing 0.1.
    def ce(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits, y, label_smoothing=0.1)

    stats = train_for(model, batches(), ce, args.seconds, 1e-3, 1e-5, 0.05, (0.9, 0.999))
    model.eval()
    correct = 0
    with torch.no_grad():
        for x, y in zip(test_x.split(250), test_y.split(250), strict=True):
            correct += (model((x.float() - MEAN) / STD).argmax(-1) == y).sum().item()
    return {
        **stats,
        "val_top1": correct / len(test_y),
        "params": num_params(model),
        "img_per_s": stats["samples"] / stats["train_seconds"],
        "epochs": stats["samples"] / len(train_x),
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


NOTES_MARKER = "<!-- notes: everything below this line is kept when the tables are regenerated -->"


def write_report(out: Path, path: Path) -> None:
    results = load_results(out)
    lines = [
        "# Ablations of the Block's options (issue 8)",
        "",
        "Generated by `scripts/ablate.py report` from the runs in `/work/runs/ablate/results.jsonl`.",
        "Every run: one seed, a fixed wall-clock training budget, on a 2-core CPU shared with other jobs.",
        "With ~2-minute budgets, differences of a few hundredths of a nat (text) or about one point of",
        "accuracy (images) are within run-to-run noise; read the tables as rough evidence, not rankings.",
        "",
    ]
    text = [(v, results[("text", v)]) for v in TEXT_VARIANTS if ("text", v) in results]
    if text:
        r0 = text[0][1]
        lines += [
            "## Text: Tiny Shakespeare, nanoGPT's CPU GPT",
            "",
            f"`gpt_char_cpu` (4 layers, 4 heads, width 128, context 64, batch 12), {r0['seconds']:.0f} s of "
            f"training each, seed {r0['seed']}; AdamW 1e-3 -> 1e-4 (cosine on the clock, 5% warmup), betas "
            "(0.9, 0.99), weight decay 0.1, clip 1.0. Val loss: mean cross-entropy (nats/char) over 1,000 "
            "fixed 64-character windows of the held-out last 10%. *4x ctx*: val loss on 100 windows of 256 "
            "characters (4x the training context; learned positions cannot run there).",
            "",
            "| variant | options | params | steps | tokens/s (in run) | train loss | val loss | 4x ctx |",
            "|---|---|---:|---:|---:|---:|---:|---:|",
        ]
        for v, r in text:
            long = f"{r['val_loss_at_4x_context']:.3f}" if r.get("val_loss_at_4x_context") is not None else "-"
            lines.append(
                f"| {v} | {options_text(TEXT_VARIANTS[v])} | {r['params']:,} | {r['steps']:,} | "
                f"{r['tokens_per_s']:,.0f} | {r['train_loss']:.3f} | **{r['val_loss']:.3f}** | {long} |"
            )
        lines += ["", "```bash"]
        lines += [
            f"flock /tmp/vit-bench.lock .venv/bin/python scripts/ablate.py text --variant {v} "
            f"--seconds {r['seconds']:.0f} --seed {r['seed']}"
            for v, r in text
        ]
        lines += ["```", ""]
    images = [(v, results[("images", v)]) for v in IMAGE_VARIANTS if ("images", v) in results]
    if images:
        r0 = images[0][1]
        lines += [
            "## Images: CIFAR-10, vit_nano at 32 px",
            "",
            "`vit_nano_patch4_16` with `img_size=32` (width 128, 4 blocks, 4 heads, 4x4 patches: an 8x8 grid, "
            f"CLS pooling), {r0['seconds']:.0f} s of training each, seed {r0['seed']}, batch 64: all 50,000 training "
            "images (decoded once into memory), pad-4 random crop + horizontal flip; AdamW 1e-3 -> 1e-5 "
            "(cosine on the clock, 5% warmup), weight decay 0.05, label smoothing 0.1, clip 1.0. Val top-1 "
            "on a fixed 2,000-image subset of the 10,000 test images (random, seed 0), centre (whole) image.",
            "",
            "| variant | options | params | steps | epochs | img/s (in run) | train loss | val top-1 |",
            "|---|---|---:|---:|---:|---:|---:|---:|",
        ]
        for v, r in images:
            lines.append(
                f"| {v} | {options_text(IMAGE_VARIANTS[v])} | {r['params']:,} | {r['steps']:,} | "
                f"{r['epochs']:.2f} | {r['img_per_s']:,.0f} | {r['train_loss']:.3f} | **{100 * r['val_top1']:.1f}%** |"
            )
        lines += ["", "```bash"]
        lines += [
            f"flock /tmp/vit-bench.lock .venv/bin/python scripts/ablate.py images --variant {v} "
            f"--seconds {r['seconds']:.0f} --seed {r['seed']}"
            for v, r in images
        ]
        lines += ["```", ""]
    speed = results.get(("speed", "all"))
    if speed:
        lines += [
            "## Speed: cost of each option relative to the default block",
            "",
            f"Training steps (forward, backward, AdamW) per second, {speed['steps']} steps x {speed['rounds']} "
            "interleaved rounds per variant in one process, median round; relative = default's time / "
            "the variant's (above 1 is faster). Images: vit_nano at 32 px (8x8 grid), batch 64; text: "
            f"gpt_char_cpu, batch 12 x 64 tokens. Threads: {speed['threads']}; {speed['machine']}.",
            "",
            "| variant | options | ViT params | img/s | relative | GPT params | tokens/s | relative |",
            "|---|---|---:|---:|---:|---:|---:|---:|",
        ]
        img, txt = speed["images"], speed["text"]
        for v in IMAGE_VARIANTS:
            i, t = img.get(v), txt.get("sincos" if v == "sincos2d" else v)
            opts = options_text(IMAGE_VARIANTS[v])
            if v == "sincos2d":
                opts = "`posemb='sincos2d'` (ViT) / `posemb='sincos'` (GPT)"
            cells_i = f"{i['params']:,} | {i['per_s']:,.0f} | {i['relative']:.2f}" if i else "- | - | -"
            cells_t = f"{t['params']:,} | {t['per_s']:,.0f} | {t['relative']:.2f}" if t else "- | - | -"
            lines.append(f"| {v} | {opts} | {cells_i} | {cells_t} |")
        lines += [
            "",
            "```bash",
            f"flock /tmp/vit-bench.lock .venv/bin/python scripts/ablate.py speed --steps {speed['steps']} "
            f"--rounds {speed['rounds']}",
            "```",
            "",
        ]
    notes = ""
    if path.is_file() and NOTES_MARKER in path.read_text():
        notes = path.read_text().split(NOTES_MARKER, 1)[1]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + NOTES_MARKER + (notes or "\n"))
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("suite", choices=["text", "images", "speed", "report"])
    parser.add_argument("--variant", default="default")
    parser.add_argument("--seconds", type=float, default=None, help="training budget (text 120, images 150)")
    parser.add_argument("--seed", type=int, default=None, help="text 1337, images 0")
    parser.add_argument("--steps", type=int, default=5, help="speed: steps per round")
    parser.add_argument("--rounds", type=int, default=5, help="speed: interleaved rounds")
    parser.add_argument("--threads", type=int, default=1, help="1: robust when other jobs share the cores")
    parser.add_argument("--out", default="/work/runs/ablate")
    parser.add_argument("--cache", default="/work/runs/ablate/cache", help="decoded CIFAR-10 tensors")
    parser.add_argument("--report", default=str(ROOT / "benchmarks" / "ablations.md"))
    args = parser.parse_args()
    out = Path(args.out)
    if args.suite == "report":
        write_report(out, Path(args.report))
        return
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
        "machine": f"{platform.processor() or platform.machine()}, torch {torch.__version__}",
        "wall_seconds": time.time() - started,
        **result,
    }
    if args.suite == "speed":
        row["steps"] = args.steps  # per round; the training runs report their own step count
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "results.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
