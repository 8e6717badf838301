"""Score attention-rollout maps against Tiny-ImageNet's object boxes; write a markdown table.

    flock /tmp/vit-bench.lock python scripts/rollout_eval.py \
        --checkpoint runs/tiny_pretrain/checkpoints/last.ckpt --data-root ../shared/data/tiny-imagenet-200 \
        --out benchmarks/rollout.md

Two scores per map, on the val images (one box each, from val/val_annotations.txt):
  - pointing game: the map's peak (after bilinear upsampling to the image) lies inside the box;
  - energy in box: the share of the map's mass inside the box, after min-max scaling the upsampled
    map to [0, 1] (so a constant offset, which rollout's identity term adds, does not count).
Every method is measured the same way, next to two baselines that look at no image: a centred
Gaussian (sigma = image side / 4) and a uniform-random map on the patch grid.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

from vit.checkpoint import load_model
from vit.data.images import Sample, read_rgb, scan_tiny_imagenet
from vit.data.transforms import eval_transform
from vit.report import machine, markdown_table, write_report
from vit.rollout import (
    attention_gradients,
    box_scores,
    centre_gaussian,
    check_vit,
    forward_with_attn_graph,
    gradient_rollout_joint,
    joint_to_map,
    rollout,
)


class BoxedImages(Dataset):
    """Val images with their boxes; the model sees the whole image, so box and map share pixels."""

    def __init__(self, samples: list[Sample], img_size: int) -> None:
        self.samples, self.img_size = samples, img_size
        self.transform = eval_transform(img_size)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int, torch.Tensor]:
        sample = self.samples[i]
        image = read_rgb(sample.path)
        if image.shape[:2] != (self.img_size, self.img_size):
            raise ValueError(
                f"{sample.path} is {image.shape[1]}x{image.shape[0]}, not {self.img_size}x{self.img_size}: "
                "its box would not line up with the map (Tiny-ImageNet images are all 64x64)"
            )
        return self.transform(image=image)["image"], sample.label, torch.tensor(sample.box)


@dataclass
class Scores:
    hits: list[float]
    energy: list[float]
    correct: list[bool]

    def row(self) -> dict[str, float]:
        hits, energy, correct = np.array(self.hits), np.array(self.energy), np.array(self.correct, dtype=bool)
        n = len(hits)
        return {
            "pointing": float(hits.mean()),
            "pointing_se": float(hits.std(ddof=1) / np.sqrt(n)) if n > 1 else 0.0,
            "energy": float(energy.mean()),
            "energy_se": float(energy.std(ddof=1) / np.sqrt(n)) if n > 1 else 0.0,
            "pointing_correct": float(hits[correct].mean()) if correct.any() else float("nan"),
        }


def evaluate(args: argparse.Namespace) -> dict:
    model = check_vit(load_model(args.checkpoint), str(args.checkpoint)).to(args.device)
    if model.global_pool != "token":
        print(f"note: {args.checkpoint} uses global_pool={model.global_pool!r}: maps are the mean of the patch rows")
    img_size = model.patch_embed.img_size[0]
    classes, samples = scan_tiny_imagenet(args.data_root, "val")
    if model.num_classes != len(classes):
        raise ValueError(f"{args.checkpoint} has {model.num_classes} classes, Tiny-ImageNet {len(classes)}")
    samples = samples[: args.limit] if args.limit else samples
    loader = DataLoader(BoxedImages(samples, img_size), batch_size=args.batch_size, num_workers=args.num_workers)
    depth = len(model.blocks)
    methods = {  # name -> (head fusion, discard ratio, start layer) for the attention rollouts
        "rollout, mean fusion": ("mean", 0.0, 0),
        "rollout, max fusion": ("max", 0.0, 0),
        "rollout, min fusion": ("min", 0.0, 0),
        "rollout, mean fusion, discard 0.9": ("mean", 0.9, 0),
        "rollout, max fusion, discard 0.9": ("max", 0.9, 0),
        f"last layer only (mean fusion, start_layer={depth - 1})": ("mean", 0.0, depth - 1),
    }
    names = [*methods, "gradient rollout, predicted class", "gradient rollout, true class"]
    names += ["baseline: centred Gaussian", "baseline: uniform random"]
    scores = {name: Scores([], [], []) for name in names}
    generator = torch.Generator().manual_seed(args.seed)
    top1 = top5 = 0
    start = time.perf_counter()
    for x, y, boxes in tqdm(loader, desc="rollout eval", unit="batch", disable=not sys.stderr.isatty()):
        x = x.to(args.device)
        # One forward for every method: the attention rollouts use its weights, the gradient
        # rollouts its graph (for two targets).
        logits, attns = forward_with_attn_graph(model, x)
        grads_predicted = attention_gradients(logits, attns, None, retain_graph=True)
        grads_true = attention_gradients(logits, attns, y.to(args.device))
        attns, logits, p = [a.detach() for a in attns], logits.detach().cpu(), model.num_prefix_tokens
        correct = (logits.argmax(-1) == y).tolist()
        top1 += sum(correct)
        top5 += (logits.topk(5, dim=-1).indices == y[:, None]).any(-1).sum().item()
        grid = model.patch_embed.grid_size
        maps = {}
        for name, (fusion, discard, start_layer) in methods.items():
            joint = rollout(attns, fusion, discard, start_layer, p)
            maps[name] = joint_to_map(joint, p, model.global_pool, grid).cpu()
        for name, grads in (("predicted", grads_predicted), ("true", grads_true)):
            joint = gradient_rollout_joint(attns, grads)
            maps[f"gradient rollout, {name} class"] = joint_to_map(joint, p, model.global_pool, grid).cpu()
        maps["baseline: centred Gaussian"] = centre_gaussian(len(x), img_size)
        maps["baseline: uniform random"] = torch.rand(len(x), *grid, generator=generator)
        for name, m in maps.items():
            hits, energy = box_scores(m, boxes, img_size)
            scores[name].hits += hits.tolist()
            scores[name].energy += energy.tolist()
            scores[name].correct += correct
    n = len(samples)
    box_area = np.mean([(s.box[2] - s.box[0] + 1) * (s.box[3] - s.box[1] + 1) / img_size**2 for s in samples])
    return {
        "checkpoint": str(args.checkpoint),
        "model": type(model).__name__,
        "num_images": n,
        "val_top1": top1 / n,
        "val_top5": top5 / n,
        "mean_box_area": float(box_area),
        "seconds": time.perf_counter() - start,
        "rows": {name: s.row() for name, s in scores.items()},
    }


def markdown(result: dict, command: str) -> str:
    rows = result["rows"]
    centre = rows["baseline: centred Gaussian"]
    subset = "the full val set" if result["num_images"] == 10000 else f"the first {result['num_images']} val images"
    lines = [
        "# Attention rollout on Tiny-ImageNet: does the map point at the object?",
        "",
        f"Model: `{result['checkpoint']}`, val top-1 **{100 * result['val_top1']:.2f}%** "
        f"(top-5 {100 * result['val_top5']:.2f}%) on {subset} ({result['num_images']:,} images, one box each).",
        f"Mean box area: {100 * result['mean_box_area']:.1f}% of the image (what a uniform map scores in both "
        "columns, in expectation).",
        "",
        "```bash",
        command,
        "```",
        "",
        f"{result['seconds'] / 60:.1f} min on {machine()}.",
        "",
        "Pointing: the peak of the map (upsampled bilinearly from the 8x8 patch grid to 64x64) is inside the box. "
        "Energy: the share of the min-max scaled, upsampled map inside the box. ± is one standard error. "
        '"pointing, correct" counts only the images the model classifies correctly. '
        "Δ is the difference to the centred Gaussian.",
        "",
    ]
    table = []
    for name, r in rows.items():
        dp, de = r["pointing"] - centre["pointing"], r["energy"] - centre["energy"]
        baseline = name.startswith("baseline: centred")
        table.append((
            name, f"{100 * r['pointing']:.1f} ± {100 * r['pointing_se']:.1f}%", "" if baseline else f"{100 * dp:+.1f}",
            f"{100 * r['energy']:.1f} ± {100 * r['energy_se']:.1f}%", "" if baseline else f"{100 * de:+.1f}",
            f"{100 * r['pointing_correct']:.1f}%",
        ))  # fmt: skip
    header = ("method", "pointing", "Δ pointing", "energy in box", "Δ energy", "pointing, correct")
    return "\n".join(lines + markdown_table(header, table)) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="our .ckpt / .safetensors of a Tiny-ImageNet ViT")
    parser.add_argument("--data-root", default="../shared/data/tiny-imagenet-200")
    parser.add_argument("--limit", type=int, default=None, help="the first N val images (default: all 10,000)")
    parser.add_argument("--batch-size", type=int, default=200)
    parser.add_argument("--num-workers", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0, help="for the uniform-random baseline")
    parser.add_argument("--out", default="benchmarks/rollout.md", help="the markdown table")
    parser.add_argument("--json", default="runs/rollout/eval.json", help="all numbers, machine-readable")
    args = parser.parse_args(argv)
    if not Path(args.checkpoint).is_file():
        parser.error(f"checkpoint {args.checkpoint} does not exist")
    result = evaluate(args)
    command = "flock /tmp/vit-bench.lock python scripts/rollout_eval.py " + shlex.join(argv or sys.argv[1:])
    text = markdown(result, command)
    write_report(args.out, text)
    write_report(args.json, json.dumps(result, indent=2))
    print(text)
    print(f"wrote {args.out} and {args.json}")
    return result


if __name__ == "__main__":
    main()
