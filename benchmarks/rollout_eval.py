"""Score explanation maps on any of our ViT checkpoints; write a markdown table and a JSON of every number.

    flock /tmp/vit-bench.lock python -m benchmarks.rollout_eval --dataset cifar10 --limit 1000 \
        --checkpoint runs/budget/vit-10min-val-s0-124456/checkpoints/last.ckpt \
        --json benchmarks/results/rollout_cifar10_reg0.json        # its report: runs/rollout/eval.md
    flock /tmp/vit-bench.lock python -m benchmarks.rollout_eval --checkpoint runs/tiny/checkpoints/last.ckpt \
        --dataset tiny-imagenet --limit 2000 --methods attention gradient
    python -m benchmarks.rollout_eval --out benchmarks/rollout.md --with-results benchmarks/results/rollout_*.json

Every method of `vit.rollout.METHODS` and rollout's fusion / discard variants (`VARIANTS`), or those
named by --methods, and two baselines that look at no image (a seeded uniform-random map and a
centred Gaussian) are scored on the same images, the first --limit of the split in a seeded order
that mixes the classes (`class_interleaved_order`):

  - positive / negative perturbation AUC (Chefer et al. 2021): accuracy against the labels as
    0%, 10%, ..., 90% of the patches are removed (set to the mean colour), most / least relevant first;
  - deletion / insertion AUC (Petsiuk et al. 2018): the probability of the class predicted on the
    clean image as the most relevant patches are deleted, or inserted into a mean-colour canvas;
  - on Tiny-ImageNet, also the pointing game and energy in box (`vit.rollout.box_scores`), over all
    images and over the off-centre subset, whose boxes hold none of the image's central pixels (where
    the centred Gaussian scores 0 pointing); the Gaussian is scored there at pixel resolution;
  - the time per image to compute each method's maps (around the map computation only).

Also the model's clean top-1 on those images and the fraction of patch tokens with outlier norms in
the last block's output (`vit.explain.outlier_norm_fraction`, prefix tokens excluded). Class-specific
maps (gradient rollout, GradCAM) explain the predicted class. --with-results adds earlier JSONs of
this script (other models) to the same report, each as its own section with its own command, after
a side-by-side table of every model's scores; without --checkpoint the report is only rewritten from
those JSONs, nothing measured (the last command above: the study in benchmarks/rollout.md). Notes
written by hand below the marker line that ends the report (`NOTES_MARKER`) are kept when it is rewritten.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

from benchmarks.report import NOTES_MARKER, data_root, machine, markdown_table, write_report
from vit.checkpoint import load_model
from vit.data.images import Sample, read_rgb, scan_image_folder, scan_tiny_imagenet
from vit.data.transforms import IMAGENET_MEAN, IMAGENET_STD, eval_transform
from vit.explain import (
    BASELINES,
    BETTER,
    FRACTIONS,
    baseline_maps,
    class_interleaved_order,
    mean_and_se,
    off_centre,
    outlier_norm_mask,
    perturbation_scores,
)
from vit.rollout import METHODS, box_scores, centre_gaussian, check_vit, rollout_maps

# Rollout's variants that vit-explain users and papers compare (max / min head fusion, discarding the
# weakest 90% of each fused attention): row name -> (a METHODS method, its keyword arguments).
VARIANTS = {
    "attention_max": ("attention", {"head_fusion": "max"}),
    "attention_min": ("attention", {"head_fusion": "min"}),
    "attention_discard": ("attention", {"discard_ratio": 0.9}),
    "attention_max_discard": ("attention", {"head_fusion": "max", "discard_ratio": 0.9}),
}
DATASETS = {"tiny-imagenet": "tiny-imagenet-200", "cifar10": "cifar10"}  # under $VIT_DATA
NAMES = {
    "attention": "attention rollout (mean fusion)",
    "attention_max": "attention rollout (max fusion)",
    "attention_min": "attention rollout (min fusion)",
    "attention_discard": "attention rollout (mean fusion, discard 0.9)",
    "attention_max_discard": "attention rollout (max fusion, discard 0.9)",
    "gradient": "gradient rollout (Chefer ICCV 2021)",
    "last_attention": "last-block attention",
    "gradcam": "GradCAM (pytorch-grad-cam)",
    "random": "baseline: uniform random",
    "centre": "baseline: centred Gaussian",
}
ARROW = {"lower": "↓", "higher": "↑"}
# The side-by-side tables: title, the two scores in each cell, whether they are fractions shown as %.
SIDE_BY_SIDE = (
    ("positive ↓ / negative ↑ perturbation AUC", ("positive", "negative"), False),
    ("deletion ↓ / insertion ↑ AUC", ("deletion", "insertion"), False),
    ("pointing ↑ / pointing, off-centre ↑ (images with boxes)", ("pointing", "pointing_off_centre"), True),
)


class EvalImages(Dataset):
    """(normalised image, label, box) per sample; the box is NaNs where the dataset has none."""

    def __init__(self, samples: list[Sample], img_size: int, mean, std, boxes: bool) -> None:
        self.samples, self.img_size, self.boxes = samples, img_size, boxes
        self.transform = eval_transform(img_size, 1.0, mean, std)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int, torch.Tensor]:
        sample = self.samples[i]
        image = read_rgb(sample.path)
        if self.boxes and image.shape[:2] != (self.img_size, self.img_size):
            raise ValueError(
                f"{sample.path} is {image.shape[1]}x{image.shape[0]}, not {self.img_size}x{self.img_size}: "
                "its box would not line up with the map"
            )
        box = torch.tensor(sample.box if self.boxes else (float("nan"),) * 4, dtype=torch.float32)
        return self.transform(image=image)["image"], sample.label, box


def dataset_samples(args: argparse.Namespace) -> tuple[list[str], list[Sample]]:
    root = Path(args.data_root) if args.data_root else data_root() / DATASETS[args.dataset]
    if args.dataset == "tiny-imagenet":
        return scan_tiny_imagenet(root, "val")
    return scan_image_folder(root / args.split)


def evaluate(args: argparse.Namespace, checkpoint: str) -> dict:
    model = check_vit(load_model(checkpoint), checkpoint).to(args.device).eval()
    img_size = model.patch_embed.img_size[0]
    classes, samples = dataset_samples(args)
    if model.num_classes != len(classes):
        raise ValueError(f"{checkpoint} has {model.num_classes} classes, the {args.dataset} split {len(classes)}")
    order = class_interleaved_order([s.label for s in samples], args.seed)
    samples = [samples[i] for i in order[: args.limit or None]]
    has_boxes = args.dataset == "tiny-imagenet"
    data = EvalImages(samples, img_size, args.mean, args.std, has_boxes)
    loader = DataLoader(data, batch_size=args.batch_size, num_workers=args.num_workers)
    names = [*args.methods, *BASELINES]
    scores = {name: defaultdict(list) for name in names}
    seconds = dict.fromkeys(names, 0.0)
    generator = torch.Generator().manual_seed(args.seed)  # the random baseline's maps, batch after batch
    correct, outliers, tokens, keep = 0, 0, 0, []
    start = time.perf_counter()
    for x, y, boxes in tqdm(loader, desc="rollout eval", unit="batch", disable=not sys.stderr.isatty()):
        x, y = x.to(args.device), y.to(args.device)
        with torch.no_grad():
            correct += int((model(x).argmax(dim=-1) == y).sum())
            last = model.forward_intermediates(x, indices=1, output_fmt="NLC", intermediates_only=True)[0]
        mask = outlier_norm_mask(last, args.outlier_factor)  # patch tokens only: no prefix to drop
        outliers, tokens = outliers + int(mask.sum()), tokens + mask.numel()
        if has_boxes:
            keep.append(off_centre(boxes, img_size, args.off_centre_dist, exclude_centre=True))
        for name in names:
            t0 = time.perf_counter()
            if name in BASELINES:
                maps = baseline_maps(name, len(x), model.patch_embed.grid_size, generator)
            else:
                method, options = VARIANTS.get(name, (name, {}))
                maps = rollout_maps(model, x, method, **options)[0]
            seconds[name] += time.perf_counter() - t0
            for key, value in perturbation_scores(model, x, y, maps, steps=args.steps).items():
                scores[name][key].append(value.cpu())
            if has_boxes:
                pixel_maps = centre_gaussian(len(x), img_size) if name == "centre" else maps.cpu()
                hits, energy = box_scores(pixel_maps, boxes, img_size)
                scores[name]["pointing"].append(hits)
                scores[name]["energy"].append(energy)
    n = len(samples)
    off = torch.cat(keep) if has_boxes else None
    rows = {}
    for name in names:
        s = {key: torch.cat(values, dim=-1) for key, values in scores[name].items()}
        row = {"ms_per_image": 1000 * seconds[name] / n}
        for key in ("positive", "negative", "deletion", "insertion"):
            row[key], row[f"{key}_se"] = mean_and_se(s[key])
            row[f"{key}_curve"] = s[f"{key}_curve"].mean(dim=1).tolist()
        if has_boxes:
            for key in ("pointing", "energy"):
                row[key], row[f"{key}_se"] = mean_and_se(s[key])
                row[f"{key}_off_centre"], row[f"{key}_off_centre_se"] = mean_and_se(s[key][off])
        rows[name] = row
    per_class = torch.bincount(torch.tensor([s.label for s in samples]), minlength=len(classes))
    return {
        "checkpoint": checkpoint,
        "model": type(model).__name__,
        "reg_tokens": getattr(model, "num_reg_tokens", None),
        "global_pool": model.global_pool,
        "dataset": args.dataset,
        "split": "val" if has_boxes else args.split,
        "num_images": n,
        "images_per_class": [int(per_class.min()), int(per_class.max())],
        "seed": args.seed,
        "clean_top1": correct / n,
        "outlier_norm_fraction": outliers / tokens,
        "outlier_factor": args.outlier_factor,
        "patch_tokens": tokens,
        "off_centre_images": int(off.sum()) if has_boxes else None,
        "off_centre_min_dist": args.off_centre_dist if has_boxes else None,
        "fractions": list(FRACTIONS),
        "deletion_steps": args.steps,
        "batch_size": args.batch_size,
        "seconds": time.perf_counter() - start,
        "machine": machine(),
        "rows": rows,
    }


def _score(row: dict, key: str, percent: bool = False) -> str:
    if percent:
        return f"{100 * row[key]:.1f} ± {100 * row[key + '_se']:.1f}%"
    return f"{row[key]:.3f} ± {row[key + '_se']:.3f}"


def _command(result: dict) -> str:
    """The command that measured a result; JSONs written before the script became a module name its old path."""
    return result["command"].replace("python scripts/rollout_eval.py", "python -m benchmarks.rollout_eval")


def section(result: dict) -> list[str]:
    """One model's part of the report: the table, the command that measured it, the machine, then
    what was scored."""
    boxes = result["off_centre_images"] is not None
    lo, hi = result["images_per_class"]
    per_class = f"{lo}" if lo == hi else f"{lo}-{hi}"
    header = ["method", "positive AUC ↓", "negative AUC ↑", "deletion AUC ↓", "insertion AUC ↑"]
    if boxes:
        header += ["pointing ↑", "pointing, off-centre ↑", "energy ↑", "energy, off-centre ↑"]
    header.append("ms / image ↓")
    table = []
    for name, row in result["rows"].items():
        cells = [NAMES.get(name, name), *(_score(row, k) for k in ("positive", "negative", "deletion", "insertion"))]
        if boxes:
            cells += [_score(row, k, True) for k in ("pointing", "pointing_off_centre", "energy", "energy_off_centre")]
        cells.append(f"{row['ms_per_image']:.2f}")
        table.append(cells)
    lines = [
        f"## `{result['checkpoint']}`",
        "",
        *markdown_table(header, table, "l" + "r" * (len(header) - 1)),
        "",
        "```bash",
        _command(result),
        "```",
        "",
        f"Machine: {result['machine']}; {result['seconds'] / 60:.1f} min.",
        "",
        f"- Model: {result['model']}, {result['reg_tokens']} register tokens, {result['global_pool']} pooling; "
        f"clean top-1 **{100 * result['clean_top1']:.2f}%** on these images.",
        f"- Images: {result['num_images']:,} {result['dataset']} {result['split']} images ({per_class} per class, "
        f"seed {result['seed']}).",
        f"- Patch tokens with outlier norms (last block's output, > {result['outlier_factor']:g}x the image's "
        f"median): **{100 * result['outlier_norm_fraction']:.2f}%** of {result['patch_tokens']:,}.",
    ]
    if boxes:
        lines.append(
            f"- Off-centre subset (box holds none of the image's central pixels, box centre "
            f">= {result['off_centre_min_dist']:g} px from the image centre): "
            f"**{result['off_centre_images']:,}** of {result['num_images']:,} images."
        )
    return [*lines, ""]


def side_by_side(results: list[dict], command: str | None) -> list[str]:
    """Every model's scores in one table per test, a column per model, so a method compares across
    models (with and without registers, one dataset and another) at a glance; then the command that
    wrote the report and the models. A model's own section below has the standard errors and the
    command that measured it. A method a run did not score shows "-"."""
    lines = []
    known = [*METHODS, *VARIANTS, *BASELINES]
    present = {name for r in results for name in r["rows"]}
    names = [n for n in known if n in present] + sorted(present - set(known))
    for title, keys, percent in SIDE_BY_SIDE:
        columns = [
            (i, r) for i, r in enumerate(results, 1) if all(k in row for row in r["rows"].values() for k in keys)
        ]
        if not columns:
            continue
        table = []
        for name in names:
            cells = [NAMES.get(name, name)]
            for _, r in columns:
                row = r["rows"].get(name)
                values = [f"{100 * row[k]:.1f}%" if percent else f"{row[k]:.3f}" for k in keys] if row else ["-"]
                cells.append(" / ".join(values))
            table.append(cells)
        header = ["method", *(f"({i}) {r['dataset']}, {r['reg_tokens']} reg" for i, r in columns)]
        lines += [f"**{title}**", "", *markdown_table(header, table, "l" + "r" * len(columns)), ""]
    if command:
        lines += ["```bash", command, "```", ""]
    models = [
        (f"({i})", f"`{r['checkpoint']}`", r["dataset"], r["reg_tokens"], f"{r['num_images']:,}",
         f"{100 * r['clean_top1']:.2f}%", f"{100 * r['outlier_norm_fraction']:.2f}%", r["machine"].split(";")[0])
        for i, r in enumerate(results, 1)
    ]  # fmt: skip
    header = ("model", "checkpoint", "dataset", "register tokens", "images", "clean top-1",
              "patch tokens with outlier norms", "machine")  # fmt: skip
    return lines + markdown_table(header, models, "lllrrrrl") + [""]


def markdown(results: list[dict], command: str | None = None) -> str:
    """The report: with several models, their scores side by side and the command that wrote it
    (`command`); each model's section; what the scores mean."""
    datasets = sorted({r["dataset"] for r in results})
    better = ", ".join(f"{key} {ARROW[way]}" for key, way in BETTER.items())
    lines = [f"# Which explanation map is faithful? {', '.join(datasets)}", ""]
    if len(results) > 1:
        lines += side_by_side(results, command)
    for result in results:
        lines += section(result)
    lines += [
        "## The scores",
        "",
        f"Direction of better (↓ lower, ↑ higher): {better}. ± is one standard error over the images. Every "
        "number is also in the JSON the command names.",
        "",
        "- **positive / negative AUC** (Chefer et al. 2021): top-1 against the labels as 0%, 10%, ..., 90% "
        "of the patches are set to the mean colour, most relevant first (positive: a faithful map makes "
        "accuracy fall fast) or least relevant first (negative: accuracy should hold); the area under "
        "that curve divided by 0.9, so a flat curve scores its height and the curve starts at the clean top-1.",
        "- **deletion / insertion AUC** (Petsiuk et al. 2018): the softmax probability of the class predicted "
        "on the clean image as the most relevant patches are deleted (set to the mean colour) or inserted "
        "into a mean-colour canvas, from none to all patches (one patch per step unless the JSON's "
        "`deletion_steps` says otherwise); area over 0..1.",
        "- **pointing / energy** (Tiny-ImageNet boxes): the peak of the map, upsampled bilinearly to the "
        "image, lies in the box; the share of the min-max scaled map's mass inside the box.",
        "- **ms / image**: the time to compute the maps (batch of the JSON's `batch_size`), nothing else; "
        "compare it within one machine. Class-specific maps (gradient rollout, GradCAM) explain the "
        "predicted class.",
        "",
        "",
    ]
    return "\n".join(lines)


def read_result(path: str) -> dict:
    """An earlier JSON of this script, or an error that names the file and what was expected."""
    try:
        result = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise SystemExit(f"--with-results {path}: not a readable JSON of benchmarks/rollout_eval.py ({err})") from err
    keys = ("checkpoint", "dataset", "reg_tokens", "clean_top1", "rows")
    missing = [key for key in keys if key not in result] if isinstance(result, dict) else list(keys)
    if missing:
        raise SystemExit(f"--with-results {path}: not a JSON of benchmarks/rollout_eval.py (missing {missing})")
    return result


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--checkpoint",
        help="our .ckpt / .safetensors of a ViT (any load_model source); without it, only rewrite the report "
        "from --with-results",
    )
    parser.add_argument("--dataset", default="tiny-imagenet", choices=list(DATASETS))
    parser.add_argument("--data-root", help="default: " + ", ".join(f"{k}: {v}" for k, v in DATASETS.items()))
    parser.add_argument("--split", default="test", help="the image-folder split for cifar10 (Tiny-ImageNet: val)")
    parser.add_argument("--limit", type=int, default=None, help="the first N images of the mixed order (default: all)")
    methods = [*METHODS, *VARIANTS]
    parser.add_argument("--methods", nargs="+", default=methods, choices=methods)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=None, help="deletion/insertion steps (default: one per patch)")
    parser.add_argument("--mean", type=float, nargs=3, default=IMAGENET_MEAN, help="the model's normalisation")
    parser.add_argument("--std", type=float, nargs=3, default=IMAGENET_STD)
    parser.add_argument("--outlier-factor", type=float, default=2.0, help="outlier norm: > factor x the median")
    parser.add_argument("--off-centre-dist", type=float, default=0.0, help="and box centre this far from the middle")
    parser.add_argument("--num-workers", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0, help="the image order and the random baseline")
    parser.add_argument("--out", default="runs/rollout/eval.md", help="the markdown report")
    parser.add_argument("--json", default="runs/rollout/eval.json", help="all numbers of this run")
    parser.add_argument("--with-results", nargs="*", default=[], help="earlier JSONs of this script to report too")
    args = parser.parse_args(argv)
    if args.checkpoint is None and not args.with_results:
        parser.error("give --checkpoint to score a model, or --with-results to rewrite the report from earlier JSONs")
    if args.checkpoint is not None and not Path(args.checkpoint).is_file():
        parser.error(f"checkpoint {args.checkpoint} does not exist")
    earlier = [read_result(path) for path in args.with_results]
    command = "python -m benchmarks.rollout_eval " + shlex.join(sys.argv[1:] if argv is None else argv)
    if args.checkpoint is None:
        write_report(args.out, markdown(earlier, command), NOTES_MARKER)
        print(f"wrote {args.out} from {len(earlier)} earlier results (nothing measured)")
        return earlier
    result = evaluate(args, args.checkpoint)
    result["command"] = "flock /tmp/vit-bench.lock " + command
    text = markdown([*earlier, result], result["command"])
    write_report(args.out, text, NOTES_MARKER)
    write_report(args.json, json.dumps(result, indent=2))
    print(text)
    print(f"wrote {args.out} and {args.json}")
    return [*earlier, result]


if __name__ == "__main__":
    main()
