"""The character GPT at nanoGPT's own budget: nanoGPT's CPU example timed on this machine, then our
recipes given the same wall clock, each scored on nanoGPT's validation text.

    # nanoGPT's CPU example as its README gives it (a checkout with data/shakespeare_char prepared)
    flock /tmp/vit-bench.lock .venv/bin/python -m benchmarks.gpt_budget nanogpt --nanogpt ../nanoGPT
    # one recipe, given the wall clock nanoGPT took (the newest nanogpt row), tuned on held-out text
    flock /tmp/vit-bench.lock .venv/bin/python -m benchmarks.gpt_budget run --recipe modern --val-holdout 0.1
    # the final rows: trained on all the training text, scored on nanoGPT's validation split
    flock /tmp/vit-bench.lock .venv/bin/python -m benchmarks.gpt_budget run --recipe best --seed 1
    # the tables in benchmarks/gpt_char.md
    .venv/bin/python -m benchmarks.gpt_budget report

Both sides are timed as whole commands (interpreter start-up, data, training and evaluation). Ours
is one `scripts/train.py fit` (vit.cli.main) in a child process with vit.schedule.WallClockBudget:
warmup (5%) and cosine decay follow the clock, so every recipe gets a whole schedule. The budget
given to that callback is nanoGPT's whole time less `--allowance` seconds, which cover our
start-up and the final scoring, so the whole command ends within nanoGPT's time (the row says
whether it did).

Scores are mean cross-entropy in nats per character over 1,000 fixed windows. `--val-holdout F`
holds out the last F of the training text: recipes are compared there (*val*), and nanoGPT's
validation split (*test*) is read only for the final rows. Rows are appended to
<out>/results.jsonl; the newest row per (recipe, holdout, seed) wins.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.report import NOTES_MARKER, data_root, machine, markdown_table, write_report

ROOT = Path(__file__).resolve().parents[1]

# nanoGPT's README CPU example.
NANOGPT_ARGS = [
    "config/train_shakespeare_char.py", "--device=cpu", "--compile=False", "--eval_iters=20", "--log_interval=1",
    "--block_size=64", "--batch_size=12", "--n_layer=4", "--n_head=4", "--n_embd=128", "--max_iters=2000",
    "--lr_decay_iters=2000", "--dropout=0.0",
]  # fmt: skip

# Each recipe: what it changes from configs/gpt/cpu.yaml (nanoGPT's CPU example, setting for setting),
# as options of scripts/train.py.
MODERN = {"norm": "rmsnorm", "mlp": "swiglu", "posemb": "rope"}
LR2 = {"model.optimizer.lr": 2e-3, "model.schedule.min_lr": 2e-4}  # nanoGPT's lr and min_lr, doubled
LR4 = {"model.optimizer.lr": 4e-3, "model.schedule.min_lr": 4e-4}
LR6 = {"model.optimizer.lr": 6e-3, "model.schedule.min_lr": 6e-4}
MUON = {"model.optimizer.name": "muon"}
RECIPES: dict[str, dict[str, Any]] = {
    "nanogpt": {},
    "fast": {"config": "configs/gpt/fast.yaml"},  # the shipped recipe: modern_muon_lr4_b24 by steps
    "modern": {"model_kwargs": MODERN},
    "modern_qknorm": {"model_kwargs": {**MODERN, "qk_norm": True}},
    "modern_relu2": {"model_kwargs": {**MODERN, "mlp": "gelu", "act_layer": "relu_squared"}},
    "modern_untied": {"model_kwargs": {**MODERN, "tie_head": False}},
    "modern_zero": {"model_kwargs": {**MODERN, "tie_head": False, "zero_init": True}},
    "modern_lr2": {"model_kwargs": MODERN, **LR2},
    "modern_lr4": {"model_kwargs": MODERN, "model.optimizer.lr": 4e-3, "model.schedule.min_lr": 4e-4},
    "modern_muon": {"model_kwargs": MODERN, **MUON},
    "modern_muon_lr2": {"model_kwargs": MODERN, **MUON, **LR2},
    "modern_b24": {"model_kwargs": MODERN, "data.batch_size": 24},
    "modern_qknorm_lr2": {"model_kwargs": {**MODERN, "qk_norm": True}, **LR2},
    "modern_muon_lr4": {"model_kwargs": MODERN, **MUON, **LR4},
    "modern_muon_lr2_qknorm": {"model_kwargs": {**MODERN, "qk_norm": True}, **MUON, **LR2},
    "modern_muon_lr2_b24": {"model_kwargs": MODERN, **MUON, **LR2, "data.batch_size": 24},
    "modern_muon_lr4_b24": {"model_kwargs": MODERN, **MUON, **LR4, "data.batch_size": 24},
    "modern_muon_lr6_b24": {"model_kwargs": MODERN, **MUON, **LR6, "data.batch_size": 24},
    "modern_muon_lr4_b48": {"model_kwargs": MODERN, **MUON, **LR4, "data.batch_size": 48},
    "modern_muon_lr6_b48": {"model_kwargs": MODERN, **MUON, **LR6, "data.batch_size": 48},
    "modern_muon_lr4_b24_qknorm": {"model_kwargs": {**MODERN, "qk_norm": True}, **MUON, **LR4, "data.batch_size": 24},
    "modern_muon_lr4_b24_d3": {"model_kwargs": {**MODERN, "depth": 3}, **MUON, **LR4, "data.batch_size": 24},
    "modern_ctx128": {"model_kwargs": MODERN, "data.block_size": 128},
    "modern_d6": {"model_kwargs": {**MODERN, "depth": 6}},
    "modern_w192": {"model_kwargs": {**MODERN, "embed_dim": 192, "num_heads": 6}},
}


def recipe_args(recipe: dict[str, Any]) -> list[str]:
    """A recipe as command-line options: model_kwargs as one JSON value, groups as `--a.b value`."""
    args: list[str] = []
    for key, value in recipe.items():
        if key == "model_kwargs":
            args += ["--model.model_kwargs", json.dumps(value)]
        else:
            args += [f"--{key}", value if isinstance(value, str) else json.dumps(value)]
    return args


def run_nanogpt(args: argparse.Namespace) -> dict[str, Any]:
    """nanoGPT's CPU example, the whole command timed; its last printed validation loss."""
    checkout = Path(args.nanogpt)
    if not (checkout / "data" / "shakespeare_char" / "train.bin").is_file():
        sys.exit(f"error: {checkout}/data/shakespeare_char/train.bin is missing: run its prepare.py first")
    out_dir = Path(args.out) / "nanogpt_out"
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "train.py", *NANOGPT_ARGS, f"--out_dir={out_dir.resolve()}"],
        cwd=checkout, capture_output=True, text=True,
    )  # fmt: skip
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(f"error: nanoGPT failed ({done.returncode}):\n{done.stderr[-2000:]}")
    losses = re.findall(r"step (\d+): train loss ([\d.]+), val loss ([\d.]+)", done.stdout)
    if not losses:
        tail = done.stdout[-1000:]
        sys.exit(f"error: nanoGPT printed no 'step N: train loss ..., val loss ...' line; its output ends:\n{tail}")
    step, _, val = losses[-1]
    return {"recipe": "nanoGPT", "seconds": seconds, "steps": int(step), "val_loss": None, "test_loss": float(val)}


def run_ours(args: argparse.Namespace) -> dict[str, Any]:
    """One recipe in a child process (`one`), the whole command timed."""
    results = load(Path(args.out))
    nanogpt = [r for r in results if r["recipe"] == "nanoGPT"]
    budget = args.seconds if args.seconds is not None else (nanogpt[-1]["seconds"] if nanogpt else None)
    if budget is None:
        sys.exit("error: no nanogpt row yet: run `gpt_budget nanogpt` first, or pass --seconds")
    child = [
        sys.executable, "-m", "benchmarks.gpt_budget", "one", "--recipe", args.recipe, "--seed", str(args.seed),
        "--train-seconds", str(budget - args.allowance), "--val-holdout", str(args.val_holdout),
        "--out", str(Path(args.out).resolve()), "--data-root", str(Path(args.data_root).resolve()),
    ]  # fmt: skip
    start = time.perf_counter()
    done = subprocess.run(child, cwd=ROOT, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(f"error: the run failed ({done.returncode}):\n{done.stderr[-3000:]}")
    row = json.loads(done.stdout.strip().splitlines()[-1])
    return {**row, "seconds": seconds, "budget": budget, "within_budget": seconds <= budget}


def one(args: argparse.Namespace) -> None:
    """Train one recipe, then score it: prints one JSON line. A recipe with a `config` is that
    shipped config as it is (its own steps); the others run configs/gpt/cpu.yaml on the clock."""
    from vit.cli import main as train
    from vit.training import Throughput

    recipe = dict(RECIPES[args.recipe])
    config = recipe.pop("config", "configs/gpt/cpu.yaml")
    clock = [
        "--trainer.max_epochs", "-1", "--trainer.max_steps", "-1",
        "--trainer.callbacks+=vit.schedule.WallClockBudget",
        "--trainer.callbacks.minutes", f"{args.train_seconds / 60}",
        "--model.schedule", "{warmup_epochs: 0, warmup_steps: null, warmup_fraction: 0.05, decay_steps: null}",
    ]  # fmt: skip
    run_dir = Path(args.out) / "runs" / f"{args.recipe}-h{args.val_holdout}-s{args.seed}"
    cli = train([
        "fit", "--config", str(ROOT / config), *recipe_args(recipe),
        "--data.path", str(Path(args.data_root) / "tinyshakespeare.txt"),
        "--data.val_holdout", str(args.val_holdout),
        "--trainer.default_root_dir", str(run_dir), "--seed_everything", str(args.seed),
        "--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
        "--trainer.enable_model_summary", "false", "--trainer.limit_val_batches", "0",
        "--trainer.callbacks+=vit.training.Throughput", *(clock if config == "configs/gpt/cpu.yaml" else []),
    ])  # fmt: skip
    meter = next(cb for cb in cli.trainer.callbacks if isinstance(cb, Throughput))
    trainer, model, data = cli.trainer, cli.model, cli.datamodule
    trainer.limit_val_batches = trainer.limit_test_batches = 1.0
    val = trainer.validate(model, datamodule=data, verbose=False)[0]["val/loss"] if args.val_holdout else None
    test = None if args.val_holdout else trainer.test(model, datamodule=data, verbose=False)[0]["test/loss"]
    row = {
        "recipe": args.recipe, "seed": args.seed, "val_holdout": args.val_holdout, "steps": trainer.global_step,
        "train_seconds": meter.seconds, "params": sum(p.numel() for p in model.model.parameters()),
        "chars_per_s": meter.images * data.block_size / meter.seconds,
        "val_loss": None if val is None else float(val), "test_loss": None if test is None else float(test),
    }  # fmt: skip
    print(json.dumps(row))


def load(out: Path) -> list[dict[str, Any]]:
    path = out / "results.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def fmt(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def changes(name: str) -> str:
    """A recipe in a table cell: its config, or its options as `field=value`."""
    recipe = RECIPES.get(name, {})
    if "config" in recipe:
        return f"`{recipe['config']}`"
    options = dict(recipe.get("model_kwargs", {}))
    options.update((k.split(".")[-1], v) for k, v in recipe.items() if k != "model_kwargs")
    return ", ".join(f"`{k}={json.dumps(v).strip(chr(34))}`" for k, v in options.items()) or "-"


def report(out: Path, path: Path) -> None:
    """gpt_char.md's generated part: every nanoGPT run and our final rows (test), then the tuning
    rows (held-out val); for ours the newest row per (recipe, holdout, seed)."""
    nanogpt, newest = [], {}
    for row in load(out):
        if row["recipe"] == "nanoGPT":
            nanogpt.append(row)
        else:
            newest[(row["recipe"], row["val_holdout"], row["seed"])] = row
    header = ("recipe", "changes from nanoGPT's CPU example", "seed", "steps", "whole command (s)", "budget (s)")
    header += ("loss",)

    def line(r: dict[str, Any], key: str) -> tuple[str, ...]:
        budget = "-" if "budget" not in r else f"{r['budget']:.1f}" + ("" if r["within_budget"] else " (over)")
        return (
            r["recipe"], changes(r["recipe"]), str(r.get("seed", "-")), f"{r['steps']:,}", f"{r['seconds']:.1f}",
            budget, f"**{fmt(r[key])}**",
        )  # fmt: skip

    final = nanogpt + [r for r in newest.values() if not r["val_holdout"]]
    tuning = [r for r in newest.values() if r["val_holdout"]]
    lines = ["# Character-level GPT on Tiny Shakespeare at nanoGPT's budget", ""]
    fast = [r for r in final if r["recipe"] == "fast"]
    if nanogpt and fast:
        times, ours = sorted(r["seconds"] for r in nanogpt), sorted(r["seconds"] for r in fast)
        losses = sorted(r["test_loss"] for r in fast)
        lines += [
            f"`configs/gpt/fast.yaml` reaches **{losses[0]:.3f}-{losses[-1]:.3f}** nats/char on nanoGPT's validation "
            f"text in {ours[0]:.0f}-{ours[-1]:.0f} s (median {statistics.median(ours):.0f} s, {len(fast)} seeds); "
            f"nanoGPT's CPU example reaches {nanogpt[-1]['test_loss']:.3f} in {times[0]:.0f}-{times[-1]:.0f} s "
            f"(median {statistics.median(times):.0f} s, {len(nanogpt)} runs), on the same machine, one run at a time.",
            "",
        ]
    lines += ["## At nanoGPT's wall clock, scored on nanoGPT's validation text", ""]
    lines += markdown_table(header, [line(r, "test_loss") for r in final], align="lllrrrr")
    if tuning:
        lines += ["", "## Tuning: the same budget, scored on held-out training text", ""]
        lines += markdown_table(header, [line(r, "val_loss") for r in tuning], align="lllrrrr")
    lines += ["", f"Machine: {machine()}.", "", ""]
    print(f"wrote {write_report(path, chr(10).join(lines), NOTES_MARKER)}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["nanogpt", "run", "one", "report"])
    parser.add_argument("--recipe", default="nanogpt", choices=sorted(RECIPES))
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--val-holdout", type=float, default=0.0, help="share of the training text to tune on")
    parser.add_argument("--seconds", type=float, default=None, help="the budget (default: nanoGPT's newest time)")
    parser.add_argument("--allowance", type=float, default=9.5, help="seconds of the budget for start-up and scoring")
    parser.add_argument("--train-seconds", type=float, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--nanogpt", default="../nanoGPT", help="a nanoGPT checkout with shakespeare_char prepared")
    parser.add_argument("--data-root", default=str(data_root()), help="has tinyshakespeare.txt (default $VIT_DATA)")
    parser.add_argument("--out", default="runs/gpt_budget")
    parser.add_argument("--report", default=str(ROOT / "benchmarks" / "gpt_char.md"))
    args = parser.parse_args(argv)
    out = Path(args.out)
    if args.command == "one":
        one(args)
        return
    if args.command == "report":
        report(out, Path(args.report))
        return
    row = run_nanogpt(args) if args.command == "nanogpt" else run_ours(args)
    row = {**row, "machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M")}
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "results.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row))


if __name__ == "__main__":
    main()
