"""Ablations of the Block's options (issue 8): what RMSNorm, SwiGLU, sincos / rotary positions,
qk-norm and mixture of experts buy, for text and for images, at an equal wall-clock budget.

    # text: nanoGPT's CPU GPT (4 layers, 4 heads, width 128, context 64, batch 12) on Tiny Shakespeare
    flock /tmp/vit-bench.lock .venv/bin/python -m benchmarks.ablate text --variant rope --seconds 120
    # images: vit_nano (width 128, 4 blocks) on CIFAR-10 at 32 px (8x8 patches; all 50k training
    # images, 2,000 fixed test images)
    flock /tmp/vit-bench.lock .venv/bin/python -m benchmarks.ablate images --variant rope --seconds 150
    # speed: every option's training throughput relative to the default block, side by side
    flock /tmp/vit-bench.lock .venv/bin/python -m benchmarks.ablate speed
    # the tables: benchmarks/ablations.md from the results collected so far
    .venv/bin/python -m benchmarks.ablate report

Each run appends one JSON line to <out>/results.jsonl (default runs/ablate/; the newest line per
suite/variant wins). The data is read from --data-root (default $VIT_DATA, else data/; ../shared/data next to the
checkout): tinyshakespeare.txt and the CIFAR-10 JPEG folder cifar10/{train,test}/<class>/.

The training loop is compact on purpose (no Lightning, no loader processes): the budget is spent
on the model, the same way for every variant. Everything else is the library's: the text split and
validation windows of vit.data.TextDataModule, CIFAR-10 decoded once by vit.data.memory and
augmented in batches there (pad-4 crop, flip), and the warmup + cosine of vit.schedule, run on the
clock (warmup over the first 5% of the budget), so every variant gets a complete schedule in the
same time, however fast its steps are.
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

from benchmarks.report import data_root, machine, markdown_table, write_report
from vit import create_model
from vit.data import ImageFiles, TextDataModule
from vit.data.augment import batch_augment, normalize
from vit.data.images import scan_image_folder
from vit.data.memory import to_tensor_images
from vit.data.transforms import IMAGENET_MEAN, IMAGENET_STD
from vit.schedule import warmup_cosine
from vit.training import param_groups

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
            group["lr"] = lr * warmup_cosine(elapsed / seconds, WARMUP, min_lr / lr)
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


def windows(tokens: torch.Tensor, starts: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of the windows starting at `starts`, as one batch."""
    idx = starts[:, None] + torch.arange(block_size + 1)
    chunk = tokens[idx]
    return chunk[:, :-1], chunk[:, 1:]


def run_text(args: argparse.Namespace) -> dict[str, Any]:
    block_size, batch_size = 64, 12
    # TextDataModule's split (the first 90% trains) and its 1,000 fixed validation windows (seed 0):
    # the val loss the training pipeline logs for configs/gpt.
    data = TextDataModule(str(Path(args.data_root) / "tinyshakespeare.txt"), block_size, batch_size, val_windows=1000)
    data.setup()
    train, val, starts = data.train_set.tokens, data.val_set.tokens, torch.tensor(data.val_set.starts)
    torch.manual_seed(args.seed)
    model = create_model("gpt_char_cpu", vocab_size=len(data.tokenizer), **TEXT_VARIANTS[args.variant])
    gen = torch.Generator().manual_seed(args.seed)

    def batches():
        while True:
            yield windows(train, torch.randint(len(train) - block_size - 1, (batch_size,), generator=gen), block_size)

    def lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    # nanoGPT's shakespeare_char recipe: AdamW 1e-3 -> 1e-4, betas (0.9, 0.99), weight decay 0.1, clip 1.0.
    stats = train_for(model, batches(), lm_loss, args.seconds, 1e-3, 1e-4, 0.1, (0.9, 0.99))
    model.eval()
    losses = []
    with torch.no_grad():
        for chunk in starts.split(100):
            x, y = windows(val, chunk, block_size)
            losses.append(lm_loss(model(x), y).item())
        long_starts = starts[starts + 4 * block_size < len(val)][:100]  # the first 100 that fit 4x the context
        long_x, long_y = windows(val, long_starts, 4 * block_size)
        long_loss = lm_loss(model(long_x), long_y).item() if args.variant in ("rope", "sincos", "modern") else None
    return {
        **stats,
        "val_loss": statistics.fmean(losses),
        "val_loss_at_4x_context": long_loss,
        "params": num_params(model),
        "tokens_per_s": stats["samples"] * block_size / stats["train_seconds"],
    }


# -- images ---------------------------------------------------------------------------------------


def cifar_tensors(root: Path, split: str, cache: Path, limit: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The images of root/split as one uint8 (N, 3, 32, 32) tensor and their labels, decoded once
    (vit.data.memory, cached in `cache`). With `limit`, a fixed (seed 0) random subset of that size."""
    _, samples = scan_image_folder(root / split)
    data = to_tensor_images(ImageFiles(samples), img_size=32, cache_dir=cache)
    images, labels = data.images, data.labels
    if limit is not None and limit < len(images):
        keep = torch.randperm(len(images), generator=torch.Generator().manual_seed(0))[:limit]
        images, labels = images[keep], labels[keep]
    return images, labels


def augment(images: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """CIFAR's standard augmentation on a uint8 batch, as the in-memory pipeline does it: pad 4 +
    random 32x32 crop, random flip; normalised."""
    return normalize(batch_augment(images, gen, crop_padding=4, hflip=True), IMAGENET_MEAN, IMAGENET_STD)


def run_images(args: argparse.Namespace) -> dict[str, Any]:
    root, cache = Path(args.data_root) / "cifar10", Path(args.cache or Path(args.out) / "cache")
    train_x, train_y = cifar_tensors(root, "train", cache)
    test_x, test_y = cifar_tensors(root, "test", cache, limit=2000)
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
            correct += (model(normalize(x, IMAGENET_MEAN, IMAGENET_STD)).argmax(-1) == y).sum().item()
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


def report(out: Path, path: Path) -> None:
    """The markdown tables of every suite run so far, above the notes kept from the existing file."""
    results = load_results(out)
    lines = [
        "# Ablations of the Block's options (issue 8)",
        "",
        f"Generated by `benchmarks/ablate.py report` from the runs in `{out / 'results.jsonl'}`.",
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
        ]
        header = ("variant", "options", "params", "steps", "tokens/s (in run)", "train loss", "val loss", "4x ctx")
        rows = []
        for v, r in text:
            long = f"{r['val_loss_at_4x_context']:.3f}" if r.get("val_loss_at_4x_context") is not None else "-"
            rows.append((
                v, options_text(TEXT_VARIANTS[v]), f"{r['params']:,}", f"{r['steps']:,}", f"{r['tokens_per_s']:,.0f}",
                f"{r['train_loss']:.3f}", f"**{r['val_loss']:.3f}**", long,
            ))  # fmt: skip
        lines += markdown_table(header, rows, align="llrrrrrr")
        lines += ["", "```bash"]
        lines += [
            f"flock /tmp/vit-bench.lock .venv/bin/python -m benchmarks.ablate text --variant {v} "
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
        ]
        header = ("variant", "options", "params", "steps", "epochs", "img/s (in run)", "train loss", "val top-1")
        rows = [
            (v, options_text(IMAGE_VARIANTS[v]), f"{r['params']:,}", f"{r['steps']:,}", f"{r['epochs']:.2f}",
             f"{r['img_per_s']:,.0f}", f"{r['train_loss']:.3f}", f"**{100 * r['val_top1']:.1f}%**")
            for v, r in images
        ]  # fmt: skip
        lines += markdown_table(header, rows, align="llrrrrrr")
        lines += ["", "```bash"]
        lines += [
            f"flock /tmp/vit-bench.lock .venv/bin/python -m benchmarks.ablate images --variant {v} "
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
        ]
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
        lines += markdown_table(header, rows, align="llrrrrrr")
        lines += [
            "",
            "```bash",
            f"flock /tmp/vit-bench.lock .venv/bin/python -m benchmarks.ablate speed --steps {speed['steps']} "
            f"--rounds {speed['rounds']}",
            "```",
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
