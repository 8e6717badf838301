"""Our batched augmentation kernels against the libraries that augment a whole batch with
per-image parameters: kornia.augmentation and torchvision.transforms.v2.

Ours (vit.data.augment, as the device path runs them through vit.data.device.DeviceSteps): each
image's crop box, flip and RandAugment ops drawn beforehand (in the loader workers; here once, before
the clock), then applied to the batch: `crop_resize_flip`, `rand_augment`, `normalize`. Three tasks,
for a batch of CIFAR-sized and of ImageNet-sized images:

- crop: random resized crop (area 0.08-1), resize (bilinear) and horizontal flip, a box an image;
- randaugment: 2 ops an image at 90% of the strongest (ours: magnitude 9 of 10; the libraries: 27 of
  30, their scales), each image its own ops;
- whole: crop, flip, RandAugment and normalise: the training augmentation.

kornia draws a crop box and a flip an image inside one call; its RandAugment draws one choice of ops
for the whole batch (`rand_selector`: one `randperm` a call), so each image's own ops take a call an
image. torchvision v2 draws one set of parameters a call, for every image of what it is given: per
image is a loop over the images (what is measured; vmap cannot run its draws in Python). The rows
"one draw a batch" time each library called once on the whole batch (torchvision: every image alike;
kornia: one choice of RandAugment ops for all): less than the task, for scale. Every contender
starts from the same float32 images (ours in 0..255, the libraries in 0..1, as each expects) on
--device; ms per batch, median over repetitions taken in turn (vit.tools.bench_measure.interleaved);
ratios are the libraries' time over ours (> 1: ours faster).

Then, where an operation is the same, how far the outputs are apart, in pixel levels (0..255), on
the same boxes and strengths: crop + resize + flip against torchvision's `resized_crop` (bilinear,
antialiased) and kornia's `crop_by_indices` (bilinear; without antialiasing, or with its Gaussian
one), and single RandAugment ops on whole levels against torchvision's uint8 ops and kornia's.

Run it alone: `flock /tmp/vit-bench.lock python -m benchmarks.data_kernels [--device cuda] [--quick]`
(about 2 CPU minutes on one core; `--cases ImageNet-like` for one batch size)."""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vit.data.augment import (
    LIGHTNESS,
    RA_COLUMNS,
    RA_OPS,
    TRAIN_RESIZE_DTYPE,
    crop_resize_flip,
    draw_rand_augment,
    normalize,
    rand_augment,
    random_resized_crop_box,
)
from vit.data.transforms import IMAGENET_MEAN, IMAGENET_STD
from vit.tools.bench_measure import Bench, interleaved, paired_ratio
from vit.tools.machine import markdown_table
from vit.tools.synthetic_imagenet import synthetic_photo

# (label, images, side, output side)
CASES = [("CIFAR-like", 256, 64, 32), ("ImageNet-like", 128, 256, 224)]
CASES_QUICK = [("tiny", 6, 24, 16)]
OPS, MAGNITUDE = 2, 9.0  # RandAugment: ops an image, strength on our 0..10 scale
LIBRARY_MAGNITUDE = 27  # the same 90% on kornia's and torchvision's 0..30 scales
CONTENDERS = ("ours", "kornia", "torchvision")
# RandAugment ops compared alone with the libraries' (op_agreement)
SAME_OPS = ("solarize", "posterize", "brightness", "equalize", "rotate")


def photos(count: int, side: int, seed: int = 0) -> torch.Tensor:
    """uint8 (count, 3, side, side): synthetic photos (vit.tools.synthetic_imagenet)."""
    rng = np.random.default_rng(seed)
    return torch.stack([torch.from_numpy(np.array(synthetic_photo(rng, side, side))).permute(2, 0, 1)
                        for _ in range(count)])  # fmt: skip


def draws(count: int, side: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each image's crop box (top, left, height, width), flip and RandAugment row, as a loader worker draws them."""
    rng = np.random.default_rng(seed)
    box = torch.tensor([random_resized_crop_box(rng, side, side) for _ in range(count)])
    flip = torch.from_numpy(rng.random(count) < 0.5)
    params = torch.from_numpy(draw_rand_augment(rng, OPS, MAGNITUDE, count))
    return box, flip, params


def contenders(images: torch.Tensor, size: int, seed: int = 0) -> dict[str, dict[str, Callable[[], object]]]:
    """task -> {name: a call that augments the batch}; `images` float32 0..255 on the device."""
    import kornia.augmentation as K
    import torchvision.transforms.v2 as T
    from kornia.augmentation.auto import RandAugment as KorniaRandAugment

    box, flip, params = draws(len(images), images.shape[-1], seed)
    unit = images / 255  # the libraries' range
    listed = list(images)
    dtype = TRAIN_RESIZE_DTYPE if images.device.type == "cuda" else torch.float32  # as training resizes
    cropped = crop_resize_flip(listed, box, flip, size, dtype=dtype)
    cropped_unit = cropped / 255

    def ours_crop() -> torch.Tensor:
        return crop_resize_flip(listed, box, flip, size, dtype=dtype)

    def ours_whole() -> torch.Tensor:
        return normalize(rand_augment(ours_crop(), params), IMAGENET_MEAN, IMAGENET_STD)

    k_crop = K.AugmentationSequential(K.RandomResizedCrop((size, size), scale=(0.08, 1.0)), K.RandomHorizontalFlip())
    k_ra = KorniaRandAugment(n=OPS, m=LIBRARY_MAGNITUDE)
    k_norm = K.Normalize(torch.tensor(IMAGENET_MEAN), torch.tensor(IMAGENET_STD))

    def k_each(x: torch.Tensor) -> torch.Tensor:  # each image its own ops: a call an image
        return torch.cat([k_ra(x[i : i + 1]) for i in range(len(x))])

    t_crop = T.Compose([T.RandomResizedCrop(size, scale=(0.08, 1.0), antialias=True), T.RandomHorizontalFlip()])
    t_ra = T.RandAugment(num_ops=OPS, magnitude=LIBRARY_MAGNITUDE)
    t_whole = T.Compose([t_crop, t_ra, T.Normalize(IMAGENET_MEAN, IMAGENET_STD)])

    def t_each(transform: Callable, x: torch.Tensor) -> torch.Tensor:  # one draw a call: a call an image
        return torch.stack([transform(image) for image in x])

    return {
        "crop": {
            "ours": ours_crop,
            "kornia": lambda: k_crop(unit),
            "torchvision": lambda: t_each(t_crop, unit),
            "torchvision, one draw a batch": lambda: t_crop(unit),
        },
        "randaugment": {
            "ours": lambda: rand_augment(cropped, params),
            "kornia": lambda: k_each(cropped_unit),
            "torchvision": lambda: t_each(t_ra, cropped_unit),
            "kornia, one draw a batch": lambda: k_ra(cropped_unit),
            "torchvision, one draw a batch": lambda: t_ra(cropped_unit),
        },
        "whole": {
            "ours": ours_whole,
            "kornia": lambda: k_norm(k_each(k_crop(unit))),
            "torchvision": lambda: t_each(t_whole, unit),
            "kornia, one draw a batch": lambda: k_norm(k_ra(k_crop(unit))),
            "torchvision, one draw a batch": lambda: t_whole(unit),
        },
    }


def crop_agreement(images: torch.Tensor, size: int, seed: int = 0) -> list[tuple[str, int, float, float]]:
    """(comparison, images, max, mean |ours - theirs| in levels): each image cropped at its own box,
    resized (bilinear) and flipped, against torchvision's resized_crop + horizontal_flip
    (antialiased, as ours) and kornia's crop_by_indices + hflip (align_corners=False, as ours),
    without and with its Gaussian antialiasing, apart for the crops enlarged both ways (no
    antialiasing applies) and the crops shrunk in a direction."""
    import kornia
    import torchvision.transforms.v2.functional as TF

    box, flip, _ = draws(len(images), images.shape[-1], seed)
    flipped = flip[:, None, None, None].to(images.device)
    ours = crop_resize_flip(list(images), box, flip, size)  # float32 on every device: the reference
    tv = [
        TF.resized_crop(image, *b, [size, size], antialias=True) for image, b in zip(images, box.tolist(), strict=True)
    ]
    diff = {
        "torchvision resized_crop (antialias)": (
            ours - torch.where(flipped, torch.stack(tv).flip(-1), torch.stack(tv))
        ).abs()
    }
    top, left, height, width = box.unbind(1)
    corners = torch.stack([torch.stack([left, top], 1), torch.stack([left + width - 1, top], 1),
                           torch.stack([left + width - 1, top + height - 1], 1),
                           torch.stack([left, top + height - 1], 1)], 1).to(images.device)  # fmt: skip
    for antialias in (False, True):
        k = kornia.geometry.transform.crop_by_indices(images, corners, (size, size), "bilinear", False, antialias)
        diff["kornia crop_by_indices" + (" (Gaussian antialias)" if antialias else "")] = (
            ours - torch.where(flipped, k.flip(-1), k)
        ).abs()
    enlarged = ((height <= size) & (width <= size)).to(images.device)
    rows = []
    for name, d in diff.items():
        parts = [("", torch.ones_like(enlarged))] if name.startswith("torchvision") else [
            (", crops enlarged both ways", enlarged), (", crops shrunk in a direction", ~enlarged)]  # fmt: skip
        for part, chosen in parts:
            if chosen.any():
                rows.append((name + part, int(chosen.sum()), d[chosen].max().item(), d[chosen].mean().item()))
    return rows


def op_agreement(images: torch.Tensor, seed: int = 0) -> dict[str, dict[str, float]]:
    """op -> {library: max |ours - theirs| in levels} for single RandAugment ops at one strength an
    image, on whole levels: ours on 0..255 floats, torchvision on uint8, kornia on 0..1 floats.
    Brightness is multiplicative in ours and torchvision, additive in kornia (not compared there)."""
    import kornia
    import torchvision.transforms.v2.functional as TF

    rng = np.random.default_rng(seed)
    count = len(images)
    levels = images.round().clamp(0, 255)
    unit, whole = levels / 255, levels.to(torch.uint8)
    strength = {
        "solarize": rng.uniform(0.1, 1.0, count),  # threshold, a fraction of 255
        "posterize": rng.integers(1, 9, count).astype(np.float64),  # bits kept
        "brightness": rng.uniform(0.1, 1.9, count),
        "equalize": np.zeros(count),
        "rotate": rng.uniform(-27, 27, count),  # degrees
    }
    out: dict[str, dict[str, float]] = {}
    for op in SAME_OPS:
        params = torch.full((count, RA_COLUMNS), math.nan, dtype=torch.float64)
        params[:, RA_OPS.index(op)] = torch.from_numpy(strength[op])
        params[:, LIGHTNESS] = 1.0
        ours = rand_augment(levels, params)
        s = strength[op].tolist()
        if op == "solarize":
            tv = [TF.solarize(x, math.ceil(t * 255)) for x, t in zip(whole, s, strict=True)]  # ours: x >= t x 255
            k = kornia.enhance.solarize(unit, torch.tensor(s, dtype=torch.float32, device=unit.device))
        elif op == "posterize":
            tv = [TF.posterize(x, int(b)) for x, b in zip(whole, s, strict=True)]
            k = kornia.enhance.posterize(unit, torch.tensor(s, device=unit.device).long())
        elif op == "brightness":
            tv, k = [TF.adjust_brightness(x, f) for x, f in zip(whole, s, strict=True)], None
        elif op == "equalize":
            tv, k = [TF.equalize(x) for x in whole], kornia.enhance.equalize(unit)
        else:
            tv = [TF.rotate(x, a, interpolation=TF.InterpolationMode.BILINEAR) for x, a in zip(whole, s, strict=True)]
            angle = torch.tensor(s, dtype=torch.float32, device=unit.device)
            k = kornia.geometry.transform.rotate(unit, angle, mode="bilinear", align_corners=False)
        out[op] = {"torchvision": (ours - torch.stack(tv).float()).abs().max().item()}
        if k is not None:
            out[op]["kornia"] = (ours - (k * 255).round()).abs().max().item()
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--quick", action="store_true", help="a tiny batch and one repetition: a smoke test")
    p.add_argument("--threads", type=int, default=1, help="torch threads on the CPU (default 1: one core)")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions (default 5, quick 1)")
    p.add_argument("--cases", default=",".join(label for label, *_ in CASES), help="which batches, comma-separated")
    p.add_argument("--json", type=Path, help="also write the numbers here")
    args = p.parse_args(argv)
    args.cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    if unknown := [c for c in args.cases if c not in {label for label, *_ in CASES}]:
        p.error(f"--cases: unknown {', '.join(unknown)}; choose from {', '.join(label for label, *_ in CASES)}")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import kornia
    import torchvision

    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    bench = Bench(device=device, dtype=torch.float32, compile=False, quick=args.quick,
                  reps=args.reps or (1 if args.quick else 5), warmup=1, data_root=Path("."),
                  min_sample_s=0.0 if args.quick else 0.3)  # fmt: skip
    start = time.perf_counter()
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} thread(s)"
    print(f"{where}; torch {torch.__version__}, torchvision {torchvision.__version__}, kornia {kornia.__version__}; "
          f"{bench.reps} repetitions\n")  # fmt: skip
    report: dict[str, Any] = {"device": where, "timings": [], "agreement": {}}
    for label, count, side, size in CASES_QUICK if args.quick else [c for c in CASES if c[0] in args.cases]:
        images = photos(count, side).to(device).float()
        case = f"{label}: {count} x 3x{side}x{side} -> {size}"
        draw_start = time.perf_counter()
        draws(count, side)
        report.setdefault("draw_ms", {})[case] = 1e3 * (time.perf_counter() - draw_start)
        for task, fns in contenders(images, size).items():
            times = interleaved(bench, fns)
            row = {"case": case, "task": task, **{f"{n}_ms": 1e3 * statistics.median(t) for n, t in times.items()}}
            for name in ("kornia", "torchvision"):
                row[f"{name}_over_ours"] = paired_ratio(times["ours"], times[name])["median"]
            report["timings"].append(row)
            print(f"[data-kernels] {case}, {task}: " + ", ".join(f"{n} {row[f'{n}_ms']:.1f} ms" for n in CONTENDERS),
                  flush=True)  # fmt: skip
        report["agreement"][case] = {
            "crop": crop_agreement(images, size),
            "ops": op_agreement(images[:, :, :size, :size]),
        }
    report["wall_s"] = time.perf_counter() - start
    print("\n" + "\n".join(tables(report)))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return report


def tables(report: dict[str, Any]) -> list[str]:
    """The markdown tables benchmarks/data.md shows: speeds side by side, then the agreement."""
    header = ["images", "task", "ours ms", "kornia ms", "torchvision v2 ms", "kornia / ours", "torchvision / ours",
              "one draw a batch: kornia ms", "torchvision ms"]  # fmt: skip
    rows = []
    for r in report["timings"]:
        ms = [
            f"{r[k]:.1f}" if k in r else "-"
            for k in (*(f"{n}_ms" for n in CONTENDERS), *(f"{n}, one draw a batch_ms" for n in CONTENDERS[1:]))
        ]
        ratios = [f"**{r[f'{n}_over_ours']:.2f}**" for n in CONTENDERS[1:]]
        rows.append([r["case"], r["task"], *ms[:3], *ratios, *ms[3:]])
    lines = markdown_table(header, rows, "llrrrrrrr")
    draws_ms = ", ".join(f"{case.split(':')[0]} {ms:.1f} ms" for case, ms in report["draw_ms"].items())
    lines += [
        "",
        f"Drawing a batch's parameters (ours, in Python in the loader workers; not timed above): {draws_ms}.",
        "",
    ]
    header = ["images", "crop + resize + flip, same boxes, against", "images", "max abs diff (levels)", "mean"]
    rows = [[case, name, count, f"{most:.4f}", f"{mean:.4f}"] for case, agreement in report["agreement"].items()
            for name, count, most, mean in agreement["crop"]]  # fmt: skip
    lines += [*markdown_table(header, rows, "llrrr"), ""]
    header = ["images", "RandAugment op, same strengths", "torchvision max abs diff (levels)", "kornia"]
    rows = [[case, op, f"{d['torchvision']:.0f}", f"{d['kornia']:.0f}" if "kornia" in d else "-"]
            for case, agreement in report["agreement"].items() for op, d in agreement["ops"].items()]  # fmt: skip
    return lines + markdown_table(header, rows, "llrr")


if __name__ == "__main__":
    main()
