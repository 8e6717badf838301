"""Time-to-accuracy on CIFAR-10: train a config for a fixed wall-clock budget, score it once.

    # tuning: hold out 5,000 training images and score on them (never on the test set)
    flock /tmp/vit-bench.lock python -m benchmarks.budget run --name vit --config configs/cifar10_vit.yaml \
        --minutes 10 --tune
    # the final run: all 50,000 training images, then the 10,000 test images once
    flock /tmp/vit-bench.lock python -m benchmarks.budget run --name vit --config configs/cifar10_vit.yaml --minutes 10
    # configs lay over each other as in train.py: the ViT with its long-budget changes
    flock /tmp/vit-bench.lock python -m benchmarks.budget run --name vit-cutmix --minutes 60 \
        --config configs/cifar10_vit.yaml --config configs/cifar10_vit_long.yaml
    python -m benchmarks.budget report   # budget.md, budget_runs.md and the plots from the results

The clock starts before the data is read: decoding the JPEGs (into a fresh cache in the run's
folder), augmentation, every training step and checkpointing all count. The learning-rate schedule
follows the clock (vit.schedule.WallClockBudget) and ends with the budget; evaluation after it does
not count. The config's data options (batch size, crop, flip, Mixup, ...) are applied to the JPEG
ImageFolder copy with the in-memory pipeline (vit.data.memory). Each run appends one JSON line to
the results file. Run one at a time, alone on the machine (`flock /tmp/vit-bench.lock`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import yaml
from lightning.pytorch import LightningDataModule, Trainer

from benchmarks.report import NOTES_MARKER, data_root, machine, markdown_table, write_report
from vit.cli import TrainCLI, show_our_logs
from vit.data import ImageDataModule
from vit.fault_tolerance import EXIT_CODES, stop_signal
from vit.lit import ImageClassifier
from vit.options import StillWorks, written
from vit.schedule import find_budget

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "budget.jsonl"
# Data options that belong to the torchvision CIFAR module, not to an image folder.
_NOT_FOLDER_OPTIONS = {"root", "dataset", "download", "pipeline", "memory", "val_holdout", "num_workers"}


def data_overrides(configs: list[Path], data_root: str, cache_dir: Path, holdout: int) -> list[str]:
    """The configs' data recipe (a later config's options win, as in train.py), moved onto the JPEG
    ImageFolder copy, in memory."""
    class_path, init_args = None, {}
    for config in configs:
        data = (yaml.safe_load(config.read_text()) or {}).get("data") or {}
        if data.get("class_path", class_path) != class_path:  # another datamodule: its own options only
            init_args = {}
        class_path = data.get("class_path", class_path)
        init_args |= data.get("init_args") or {}
    args = ["--data", "vit.data.ImageFolderDataModule", "--data.root", data_root, "--data.val_dir", "test"]
    args += ["--data.img_size", "32"]  # CIFAR's size unless the config says otherwise (the folder default is 224)
    for key, value in init_args.items():
        if key not in _NOT_FOLDER_OPTIONS:
            args += [f"--data.{key}", value if isinstance(value, str) else json.dumps(value)]
    args += ["--data.pipeline", "memory", "--data.memory.cache_dir", str(cache_dir), "--data.num_workers", "0"]
    if holdout:
        args += ["--data.val_holdout", str(holdout)]
    return args


def run(args: argparse.Namespace) -> dict:
    configs = [Path(c) for c in args.config]
    split = "val" if args.tune else "test"
    workdir = Path(args.workdir) / f"{args.name}-{args.minutes:g}min-{split}-s{args.seed}-{time.strftime('%H%M%S')}"
    cli_args = [
        *(a for c in configs for a in ("--config", str(c))),
        *data_overrides(configs, args.data_root, workdir / "cache", args.holdout if args.tune else 0),
        "--seed_everything", str(args.seed),
        "--trainer.default_root_dir", str(workdir),
        "--trainer.max_epochs", "100000", "--trainer.max_steps", "-1",
        "--trainer.limit_val_batches", "0", "--trainer.num_sanity_val_steps", "0", "--checkpoint.monitor", "null",
        "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
        "--trainer.callbacks+=vit.schedule.WallClockBudget", "--trainer.callbacks.minutes", str(args.minutes),
        *args.overrides,
    ]  # fmt: skip
    torch.set_float32_matmul_precision("high")
    show_our_logs()
    cli = TrainCLI(args=cli_args, run=False, save_config_kwargs={"overwrite": True})  # the clock starts here
    trainer, model, data = cli.trainer, cli.model, cli.datamodule
    # What the run really used (the config file may change later): model and data options, precision.
    used = cli.config.as_dict()
    recipe = {"model": used["model"], "data": used["data"], "precision": used["trainer"]["precision"]}
    budget = find_budget(trainer)
    try:
        trainer.fit(model, data)
    except (KeyboardInterrupt, SystemExit) as e:  # Lightning's SIGTERM is a SystemExit with status 0
        name = stop_signal(e)
        if name is None:
            raise
        print(
            f"budget run {args.name!r} stopped by {name} after {budget.elapsed() / 60:.1f} of {args.minutes:g} "
            f"minutes (step {trainer.global_step}): not scored, nothing written to {args.results}",
            file=sys.stderr, flush=True,
        )  # fmt: skip
        sys.exit(EXIT_CODES[name])
    wall = budget.elapsed()
    steps = trainer.global_step
    images = steps * data.batch_size * trainer.world_size
    top1 = score(trainer, model, data, split)
    result = {
        "name": args.name,
        "config": " + ".join(map(str, configs)),
        "overrides": args.overrides,
        "model_name": model.hparams.model_name,
        "params": sum(p.numel() for p in model.model.parameters()),
        "minutes": args.minutes,
        "seed": args.seed,
        "split": split,
        "top1": top1["plain"],
        "top1_flip": top1["flip"],
        **({"top1_ema": top1["ema"]} if "ema" in top1 else {}),
        "epochs": images / len(data.train_set),
        "steps": steps,
        "img_per_s": images / wall,
        "wall_minutes": wall / 60,
        "train_images": len(data.train_set),
        "machine": machine() + (f"; {args.machine_label}" if args.machine_label else ""),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "command": "python -m benchmarks.budget " + " ".join(sys.argv[1:]),
        "recipe": json.loads(json.dumps(recipe, default=str)),
    }
    Path(args.results).parent.mkdir(parents=True, exist_ok=True)
    with open(args.results, "a") as f:
        f.write(json.dumps(result) + "\n")
    print(json.dumps(result, indent=1))
    return result


def score(trainer: Trainer, model: ImageClassifier, data: LightningDataModule, split: str) -> dict[str, float]:
    """Top-1 on the whole split of the trained weights, without and with flip averaging, and
    (model.ema_decay) of their moving average: the EMA lever's effect is the difference."""
    trainer.limit_val_batches = trainer.limit_test_batches = 1.0  # the whole split, once

    def top1() -> float:
        evaluate = trainer.validate if split == "val" else trainer.test
        return evaluate(model, data, verbose=False)[0][f"{split}/acc1"]

    result = {}
    for name, flip in (("plain", False), ("flip", True)):  # the same weights scored both ways
        model.hparams.tta_flip = flip
        result[name] = top1()
    if model.ema is not None:  # the averaged weights (buffers too) in the model's place, scored plainly
        averaged, model.ema = model.ema, None
        model.model.load_state_dict(averaged.module.state_dict())
        model.hparams.tta_flip = False
        result["ema"] = top1()
    return result


def _shown(path: Path) -> str:
    return str(path.resolve().relative_to(ROOT)) if path.resolve().is_relative_to(ROOT) else str(path)


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.2f}%"


HEADER = (
    "model", "config", "recipe changes", "params", "budget (min)", "seed", "epochs", "img/s", "wall (min)", "top-1",
    "top-1, flip TTA",
)  # fmt: skip


def _cells(r: dict) -> list[str]:
    return [
        f"{r['name']} (`{r['model_name']}`)", _configs(r["config"]), _recipe(r), f"{r['params'] / 1e6:.2f}M",
        f"{r['minutes']:g}", str(r["seed"]), f"{r['epochs']:.1f}", f"{r['img_per_s']:.0f}",
        f"{r['wall_minutes']:.2f}", _top1(r["top1"], r.get("top1_ema")), _percent(r.get("top1_flip")),
    ]  # fmt: skip


def _top1(plain: float, ema: float | None) -> str:
    """The trained weights' top-1, and their moving average's where the run kept one."""
    return f"{100 * plain:.2f}%" + ("" if ema is None else f" (EMA {100 * ema:.2f}%)")


def _configs(config: str) -> str:
    return " + ".join(f"`{c}`" for c in config.split(" + "))  # several configs, laid over each other


def _recipe(r: dict) -> str:
    return " ".join(_current_names(r["overrides"])) or "(config as is)"


def _current_names(overrides: list[str]) -> list[str]:
    """A recorded run's options under today's names (`--model.lr` is `--model.optimizer.lr`)."""
    renamed = {"model": ImageClassifier.RENAMED, "data": ImageDataModule.RENAMED}
    named = list(overrides)
    for i, option in enumerate(overrides):
        part, _, old = option.removeprefix("--").partition(".")
        new = renamed.get(part, {}).get(old) if option.startswith("--") else None
        value = overrides[i + 1] if i + 1 < len(overrides) else ""
        if isinstance(new, StillWorks):  # `--data.in_memory true` is `--data.pipeline memory`
            named[i] = f"--{part}.{new.new}"
            if new.values is not None and i + 1 < len(overrides):
                named[i + 1] = next((str(v) for k, v in new.values.items() if written(k) == value), str(new.off))
        elif new is not None and not (new.split(".")[0] == old and value.startswith("{")):
            named[i] = f"--{part}.{new}"
    return named


MODELS = {"resnet20": "ResNet-20", "vit": "ViT", "hybrid": "ViT + conv stem (hybrid)"}


def family(name: str) -> str:
    """The model a run's name belongs to: `vit-cutmix` and `vit` are the ViT, `hybrid-...` the hybrid."""
    return name.split("-")[0]


def shipped_top1(r: dict) -> float:
    """Top-1 as the run's config evaluates: of its mirror-averaged logits where the config turns
    `tta_flip` on (every run is scored both ways; the tables of seeds show both)."""
    flip = ((r.get("recipe") or {}).get("model") or {}).get("init_args", {}).get("tta_flip")
    return r["top1_flip"] if flip else r["top1"]


def precision(r: dict) -> str:
    """bf16 or fp32, as the run trained (older rows record it only in their options)."""
    ran = (r.get("recipe") or {}).get("precision") or " ".join(r["overrides"])
    return "bf16" if "bf16" in str(ran) else "fp32"


def newest(final: list[dict], machine_line: str) -> dict[str, dict[float, dict]]:
    """One machine's newest test run of each model at each budget: the recipe as it was shipped when
    it ran (older runs of a model are earlier recipes; every one is in the runs file). Keyed by the
    model in plain words, with its precision where the machine ran the model in both."""
    mine = sorted((r for r in final if r["machine"] == machine_line), key=lambda r: r.get("date", ""))
    both = {
        f
        for f in map(family, (r["name"] for r in mine))
        if len({precision(r) for r in mine if family(r["name"]) == f}) > 1
    }
    out: dict[tuple, dict[float, dict]] = {}
    for r in mine:
        f = family(r["name"])
        out.setdefault((f, precision(r) if f in both else ""), {})[r["minutes"]] = r
    ordered = sorted(out, key=lambda k: (*_model_order(k[0]), k[1]))
    return {MODELS.get(f, f) + (f" ({p})" if p else ""): out[(f, p)] for f, p in ordered}


def _model_order(name: str) -> tuple[int, str]:
    return (list(MODELS).index(name) if name in MODELS else len(MODELS), name)


def headline_machine(final: list[dict]) -> str:
    """The machine with final runs of the most (model, budget) pairs; of equals, the newest."""
    machines = set(r["machine"] for r in final)
    cells = {m: sum(len(by) for by in newest(final, m).values()) for m in machines}
    latest = {m: max(r.get("date", "") for r in final if r["machine"] == m) for m in machines}
    return max(machines, key=lambda m: (cells[m], latest[m]))


def report(args: argparse.Namespace) -> str:
    rows = [json.loads(line) for line in Path(args.results).read_text().splitlines() if line.strip()]
    out = Path(args.out)
    runs_out = Path(args.runs_out) if args.runs_out else out.with_name(out.stem + "_runs.md")
    plot_path = Path(args.plot)
    machines_plot = plot_path.with_name(plot_path.stem + "_machines" + plot_path.suffix)
    # Speeds differ between machines, so each one gets its own tables; a machine keeps one number in
    # every table (its order of first appearance in the results file), as the notes refer to it.
    number = {m: i for i, m in enumerate(dict.fromkeys(r["machine"] for r in rows), 1)}
    final = [r for r in rows if r["split"] == "test"]
    lines = ["# Time to accuracy on CIFAR-10: ViT against ResNet-20 at equal wall-clock budgets", ""]
    if final:
        head = headline_machine(final)
        lines += headline(final, head, number, plot_path.name)
        lines += summary(final, number, machines_plot.name)
        tuned = [r for r in rows if r["split"] == "val"]
        # The headline machine's levers, and the newest machine's where levers were tuned since
        latest = max(tuned, key=lambda r: r.get("date", ""))["machine"] if tuned else head
        lines += seed_tables([r for r in tuned if r["machine"] in (head, latest)], number, short=True)
    else:
        lines += ["No test-set runs yet.", ""]
    lines += [
        f"Every run, with its options, speed and epochs: [{runs_out.name}]({runs_out.name}) (generated by",
        f"`python -m benchmarks.budget report` from `{_shown(Path(args.results))}`).",
        "",
    ]
    text = "\n".join(lines) + "\n"
    write_report(out, text, NOTES_MARKER)
    write_report(runs_out, every_run(rows, number, args.results))
    if final:
        plot_headline(final, head, plot_path, number)
        plot(final, machines_plot, number)
    print(text)
    return text


def headline(final: list[dict], head: str, number: dict[str, int], plot_name: str) -> list[str]:
    """The result first: one machine's test top-1 per model and budget, the configs behind each cell."""
    budgets = sorted({r["minutes"] for r in final if r["machine"] == head})
    body, recipes = [], []
    for f, by in newest(final, head).items():
        params = "/".join(dict.fromkeys(f"{r['params'] / 1e6:.2f}M" for _, r in sorted(by.items())))
        body.append([f, params, *(f"{100 * shipped_top1(by[b]):.2f}%" if b in by else "-" for b in budgets)])
        ran: dict[str, list[str]] = {}
        for b, r in sorted(by.items()):
            changes = " ".join(o for o in _current_names(r["overrides"]) if o not in PRECISION)
            ran.setdefault(_configs(r["config"]) + (f" with `{changes}`" if changes else ""), []).append(f"{b:g}")
        recipes.append(f"- {f}: " + "; ".join(f"{c} ({', '.join(m)} min)" for c, m in ran.items()))
    return [
        f"CIFAR-10 test top-1 after a fixed wall-clock budget on one machine (machine {number[head]}:",
        f"{head.split(';')[0]}), {_precisions(final, head)}, one seed, each model's shipped config of the day it ran:",
        "",
        *markdown_table(("model", "params", *(f"{b:g} min" for b in budgets)), body, align="ll" + "r" * len(budgets)),
        "",
        f"![Test top-1 against the budget, machine {number[head]}]({plot_name})",
        "",
        *recipes,
        "",
        "One cell: `flock /tmp/vit-bench.lock python -m benchmarks.budget run --minutes 30 --name vit --config",
        "configs/cifar10_vit.yaml --config configs/cifar10_vit_long.yaml -- --trainer.precision bf16-mixed`;",
        "the tables and plots: `python -m benchmarks.budget report`.",
        "",
        "The clock includes JPEG decoding, augmentation, training and checkpoints, and the learning-rate",
        "schedule ends with the budget. Final (test) runs train on all 50,000 images and are scored once on",
        "the 10,000 test images; tuning runs hold 5,000 training images out and are scored on them. The",
        "JPEG copy (quality 75) makes these numbers comparable with each other, not with papers' CIFAR-10 tables.",
        "A config with `tta_flip: true` is scored as it evaluates, on the mean logits of each image and its",
        "mirror image.",
        "",
    ]


PRECISION = ("--trainer.precision", "bf16-mixed")


def summary(final: list[dict], number: dict[str, int], plot_name: str | None = None) -> list[str]:
    """Every machine's newest test top-1 per model and budget: the same comparison on other CPUs."""
    if not final:
        return []
    budgets = sorted({r["minutes"] for r in final})
    machines = sorted({r["machine"] for r in final}, key=number.__getitem__)
    rows = [
        (str(number[m]), f, *(f"{100 * shipped_top1(by[b]):.2f}%" if b in by else "-" for b in budgets))
        for m in machines
        for f, by in newest(final, m).items()
    ]
    machines = [(str(number[m]), m, _precisions(final, m)) for m in machines]
    return [
        "## Every machine",
        "",
        "The newest test run of each model at each budget on each machine (speeds differ up to 2x between",
        "these CPUs, so a budget buys different epochs on each).",
        "",
        *markdown_table(("machine", "model", *(f"{b:g} min" for b in budgets)), rows, align="ll" + "r" * len(budgets)),
        "",
        *markdown_table(("machine", "what it is", "trained in"), machines, align="rll"),
        "",
        *([f"![Test top-1 against the budget on each machine]({plot_name})", ""] if plot_name else []),
    ]


def every_run(rows: list[dict], number: dict[str, int], results: str) -> str:
    """Every run's table, per split and machine, and every seed table: the data behind the summary."""
    lines = [
        "# Time to accuracy on CIFAR-10: every run",
        "",
        f"Generated by `python -m benchmarks.budget report` from `{_shown(Path(results))}` (each row's",
        "command and whole recipe are in that file); the summary and notes are in [budget.md](budget.md).",
        "",
    ]
    for split, title in (("test", "Final runs (test set, scored once)"), ("val", "Tuning runs (held-out validation)")):
        chosen = [r for r in rows if r["split"] == split]
        for m in sorted(dict.fromkeys(r["machine"] for r in chosen), key=number.__getitem__):
            lines += [f"## {title}, machine {number[m]}", "", f"Machine: {m}.", ""]
            on_m = sorted((r for r in chosen if r["machine"] == m), key=lambda r: (r["minutes"], r["name"], r["seed"]))
            lines += markdown_table(HEADER, [_cells(r) for r in on_m], align="lllrrrrrrrr")
            lines.append("")
    lines += seed_tables(rows, number)
    if not rows:
        lines.append("No runs yet.")
    return "\n".join(lines) + "\n"


SEED_HEADER = (
    "model", "config", "recipe changes", "top-1 by seed", "mean", "spread", "mean, flip TTA", "epochs", "img/s",
    "vs `vit`",
)  # fmt: skip


def seed_tables(rows: list[dict], number: dict[str, int], short: bool = False) -> list[str]:
    """The recipes run with two or more seeds, their seeds side by side, so a lever's effect can be
    read against the noise: one table per machine, split and budget. `vs vit` is the difference of
    means against the `vit` recipe with the fewest changes in the same table; where the config changed
    its model (runs are grouped by parameter count too, so a 6-block and a 3-block config under one
    name are two rows), against the one whose runs are nearest in time, the config of the lever's day.
    `short` titles them as the levers' tables of the summary and leaves out what every row shares
    (the model's name, bf16)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        key = (r["machine"], r["split"], r["minutes"], r["name"], r["config"], tuple(r["overrides"]), r["params"])
        groups.setdefault(key, []).append(r)
    repeated = {k: sorted(v, key=lambda r: r["seed"]) for k, v in groups.items() if len({r["seed"] for r in v}) > 1}
    lines = []
    for where in sorted({k[:3] for k in repeated}, key=lambda w: (number[w[0]], w[1] == "val", w[2])):
        machine, split, minutes = where
        mine = {k: v for k, v in repeated.items() if k[:3] == where}
        mean = {k: _mean(v, "top1") for k, v in mine.items()}
        fewest = min((len(k[5]) for k in mine if k[3] == "vit"), default=None)
        plain = [k for k in mine if k[3] == "vit" and len(k[5]) == fewest]
        body = []
        for k, v in sorted(mine.items(), key=lambda kv: -mean[kv[0]]):
            base = _config_of_its_day(v, {b: mine[b] for b in plain})
            changes = [o for o in _current_names(v[0]["overrides"]) if not (short and o in PRECISION)]
            body.append([
                f"{k[3]} ({k[6] / 1e6:.2f}M)" if short else f"{k[3]} (`{v[0]['model_name']}`, {k[6] / 1e6:.2f}M)",
                _configs(k[4]), " ".join(changes) or "(config as is)",
                ", ".join(f"{100 * r['top1']:.2f}" for r in v), _top1(mean[k], _mean(v, "top1_ema")),
                f"{100 * (max(r['top1'] for r in v) - min(r['top1'] for r in v)):.2f}",
                _percent(_mean(v, "top1_flip")),
                f"{_mean(v, 'epochs'):.1f}", f"{_mean(v, 'img_per_s'):.0f}",
                "-" if base is None or k == base else f"{100 * (mean[k] - mean[base]):+.2f}",
            ])  # fmt: skip
        which = "held-out validation" if split == "val" else "test set"
        if short:
            lines += [
                f"## Each lever at {minutes:g} minutes, two seeds or more ({which}, machine {number[machine]})",
                "",
                "Each row changes one thing in the config of its day (a `vit` row); `vs vit` is the difference",
                "of means from that row.",
                "",
            ]
        else:
            lines += [f"## Seeds side by side: {minutes:g} minutes, {which}, machine {number[machine]}", ""]
        lines += markdown_table(SEED_HEADER, body, align="llllrrrrrr")
        lines.append("")
    return lines


def _config_of_its_day(runs: list[dict], plain: dict[tuple, list[dict]]) -> tuple | None:
    """Of the config's groups, the one with a run nearest in time to one of `runs` (the newest where
    runs carry no dates)."""
    if not plain:
        return None

    def when(r: dict) -> float:
        return time.mktime(time.strptime(r["date"], "%Y-%m-%d %H:%M")) if r.get("date") else 0.0

    def gap(k: tuple) -> tuple[float, float]:
        nearest = min(abs(when(a) - when(b)) for a in runs for b in plain[k])
        return (nearest, -max(when(b) for b in plain[k]))

    return min(plain, key=gap)


def _mean(rows: list[dict], key: str) -> float | None:
    """The mean of a value every row has, else None (older rows lack the flip score, non-EMA runs the EMA's)."""
    values = [r[key] for r in rows if r.get(key) is not None]
    return sum(values) / len(values) if values and len(values) == len(rows) else None


# One colour a model on every panel, whatever the panel holds; fp32 hollow squares on a dashed line
# beside bf16's filled circles on a solid one, so that a single point says its precision too.
MODEL_COLOURS = {"ResNet-20": "tab:blue", "ViT": "tab:orange", "ViT + conv stem (hybrid)": "tab:green"}
PRECISION_STYLES = {
    "bf16": {"marker": "o", "linestyle": "-"},
    "fp32": {"marker": "s", "linestyle": "--", "markerfacecolor": "white", "markeredgewidth": 1.5},
}


def _params(rows: list[dict]) -> str:
    return "/".join(dict.fromkeys(f"{r['params'] / 1e6:.2f}M" for r in rows))


def shipped_params(final: list[dict]) -> dict[str, int]:
    """Each model's parameter count in its newest test run: the recipe as shipped now. A run of
    another count ran an earlier recipe of the model (the ViT's 6 blocks before its 3, for one)."""
    return {family(r["name"]): r["params"] for r in sorted(final, key=lambda r: r.get("date", ""))}


def _draw(ax, mine: dict[str, dict[float, dict]], annotate: bool, say_precision: bool = False) -> None:
    """One line per model (its newest runs), budgets on x, test top-1 on y, in plain words; with
    `say_precision`, each label names its precision (panels of machines that ran one differ)."""
    for f, by in mine.items():
        xs = sorted(by)
        ys = [100 * shipped_top1(by[x]) for x in xs]
        rows = [by[x] for x in xs]
        model = f.split(" (bf16)")[0].split(" (fp32)")[0]
        words = f"{model} ({precision(rows[0])})" if say_precision else f
        style = {"color": MODEL_COLOURS.get(model), **PRECISION_STYLES[precision(rows[0])]}
        (line,) = ax.plot(xs, ys, label=f"{words}, {_params(rows)} parameters", **style)
        if annotate:
            for x, y in zip(xs, ys, strict=True):
                ax.annotate(f"{y:.1f}%", (x, y), textcoords="offset points", xytext=(0, 7), ha="center",
                            fontsize=9, color=line.get_color())  # fmt: skip
    budgets = sorted({b for by in mine.values() for b in by})
    ax.set_xticks(budgets, [f"{b:g}" for b in budgets])
    ax.set_xlim(0, max(budgets) * 1.08)
    low, high = ax.get_ylim()
    ax.set_ylim(low, high + 0.06 * (high - low))  # room for the values above the top points
    ax.set_xlabel("training time (minutes, wall clock)")
    ax.set_ylabel("CIFAR-10 test top-1 (%)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=9, loc="best")


def plot_headline(final: list[dict], head: str, path: Path, number: dict[str, int]) -> str:
    """The summary's one panel: each model's test top-1 against the budget on the headline machine.
    Returns its title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    _draw(ax, newest(final, head), annotate=True)
    cpu = cpu_of(head).replace("(", "").replace(")", "")
    title = f"CIFAR-10 in a fixed time: {cpu}, {head.split(', ')[1]}, {_precisions(final, head)}"
    ax.set_title(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return title


def _precisions(final: list[dict], machine_line: str) -> str:
    return " and ".join(sorted({precision(r) for r in final if r["machine"] == machine_line}))


def cpu_of(machine_line: str) -> str:
    """The processor's words of a machine line: 'AMD EPYC (AVX512), 2 threads, ...' -> 'AMD EPYC (AVX512)'."""
    return machine_line.split(",")[0].replace("(R)", "")


def plot(final: list[dict], path: Path, number: dict[str, int]) -> list[str]:
    """The same lines on every machine with final runs, one panel each (times on different machines
    do not share an axis), numbered as in the tables. Returns the panels' titles."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    machines = sorted(dict.fromkeys(r["machine"] for r in final), key=number.__getitem__)
    cols = min(2, len(machines))
    nrows = -(-len(machines) // cols)
    # One y scale: the panels compare machines; the parameter counts are each run's model, as in the tables.
    fig, axes = plt.subplots(nrows, cols, figsize=(6.5 * cols, 4.2 * nrows + 0.6), squeeze=False, sharey=True)
    shipped = shipped_params(final)
    titles = []
    for ax, where in zip(axes.flat, machines, strict=False):
        mine = newest(final, where)
        _draw(ax, mine, annotate=False, say_precision=True)
        vits = [r for by in mine.values() for r in by.values() if family(r["name"]) == "vit"]
        recipe = "as shipped" if all(r["params"] == shipped["vit"] for r in vits) else "an earlier recipe"
        titles.append(f"machine {number[where]}: {cpu_of(where)}; ViT {_params(vits)}, {recipe}")
        ax.set_title(titles[-1], fontsize=10)
        ax.yaxis.set_tick_params(labelleft=True)
    for ax in axes.flat[len(machines) :]:
        ax.axis("off")
    untested = [str(n) for m, n in number.items() if m not in machines]
    note = f"; machines {', '.join(untested)} ran tuning runs only" if untested else ""
    fig.suptitle(f"CIFAR-10 test top-1 in a fixed training time, each machine numbered as in budget.md{note}\n"
                 "each model's recipe as on the day it ran (ViT and hybrid: 6 blocks, now 3); "
                 "bf16 filled circles, fp32 hollow squares", fontsize=12)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return titles


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="one budgeted training run")
    r.add_argument("--name", required=True, help="the model's row label, e.g. vit or resnet20")
    r.add_argument("--config", required=True, action="append", help="a train.py config; repeat to lay one over another")
    r.add_argument("--minutes", type=float, required=True)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--tune", action="store_true", help="hold out --holdout training images and score on them")
    r.add_argument("--holdout", type=int, default=5000)
    r.add_argument("--data-root", default=str(data_root() / "cifar10"), help="default $VIT_DATA/cifar10")
    r.add_argument("--workdir", default="runs/budget")
    r.add_argument("--results", default=str(RESULTS))
    r.add_argument(
        "--machine-label",
        help="added to the machine line, so rows from another host of the same type (the same line, "
        "a different speed) get their own tables",
    )
    r.add_argument("overrides", nargs="*", help="more train.py options after --, e.g. -- --model.optimizer.lr 2e-3")
    s = sub.add_parser("report", help="markdown table and plot from the results")
    s.add_argument("--results", default=str(RESULTS))
    s.add_argument("--out", default=str(ROOT / "benchmarks" / "budget.md"))
    s.add_argument("--runs-out", help="every run's tables; default: beside --out, as budget_runs.md")
    s.add_argument(
        "--plot",
        default=str(ROOT / "benchmarks" / "budget.png"),
        help="the summary's plot; the other machines' goes beside it (budget_machines.png)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    run(args) if args.command == "run" else report(args)


if __name__ == "__main__":
    main()
