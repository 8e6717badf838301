"""vit-bench's data section (vit.tools.benchmark): the per-sample path's train transform
(albumentations, in a loader worker) against torchvision's transforms v2 running the same ops, one
image at a time in one worker, with decoding timed apart."""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch

from vit.tools.bench_measure import Bench, Section, fmt_spread, interleaved, rate


def section_data(bench: Bench) -> Section:
    """The albumentations train transform, one worker (one process, one thread), vs torchvision v2."""
    import cv2
    import torchvision.transforms.v2 as T

    from vit.data.augment import Augment
    from vit.data.images import read_rgb
    from vit.data.transforms import IMAGENET_MEAN, IMAGENET_STD, train_transform

    n = 16 if bench.quick else 256
    # (label, folder, glob, output size, crop, re-encode at this size first)
    cases = [
        ("CIFAR-10 JPEG 32px -> 32, pad-crop 4", "cifar10/train", "*/*.jpg", 32, "pad_crop", None),
        ("Tiny-ImageNet JPEG 64px -> 224, RRC", "tiny-imagenet-200/train", "*/images/*.JPEG", 224, "rrc", None),
        (
            "ImageNet-sized JPEG 500x375 -> 224, RRC",
            "tiny-imagenet-200/train",
            "*/images/*.JPEG",
            224,
            "rrc",
            (500, 375),
        ),
    ]
    if bench.quick:
        cases = cases[:1]
    threads, cv2_threads = torch.get_num_threads(), cv2.getNumThreads()
    torch.set_num_threads(1)
    cv2.setNumThreads(1)
    rows = []
    tmp = tempfile.TemporaryDirectory(prefix="vit-bench-")
    try:
        for label, folder, pattern, size, crop, reencode in cases:
            root = bench.data_root / folder
            files = sorted(root.glob(pattern))
            if not files:
                print(f"[data] {root} has no images; skipping {label}")
                continue
            files = files[:: max(1, len(files) // n)][:n]
            if reencode:
                files = reencoded_copies(files, reencode, Path(tmp.name))
            decoded = [read_rgb(f) for f in files]
            tensors = [torch.tensor(a).permute(2, 0, 1).contiguous() for a in decoded]
            alb = train_transform(size, Augment(crop=crop, crop_scale=(0.08, 1.0), randaugment_ops=2))
            if crop == "rrc":
                crop_ops = [T.RandomResizedCrop(size, scale=(0.08, 1.0), interpolation=T.InterpolationMode.BICUBIC)]
            else:
                crop_ops = [T.Resize(size, interpolation=T.InterpolationMode.BICUBIC), T.RandomCrop(size, padding=4)]
            tv = T.Compose(
                [
                    *crop_ops,
                    T.RandomHorizontalFlip(),
                    T.RandAugment(num_ops=2, magnitude=9),
                    T.ToDtype(torch.float32, scale=True),
                    T.Normalize(IMAGENET_MEAN, IMAGENET_STD),
                ]
            )
            fns = {
                "decode": lambda files=files: [read_rgb(f) for f in files],
                "albumentations": lambda d=decoded, alb=alb: [alb(image=a)["image"] for a in d],
                "torchvision_v2": lambda t=tensors, tv=tv: [tv(x) for x in t],
            }
            times = interleaved(bench, fns, reps=max(2, bench.reps // 2))
            row: dict[str, Any] = {"case": label, "images": len(files), "img_size": size}
            for key, seconds in times.items():
                row[f"{key}_img_s"] = rate(seconds, len(files))
            decode_s = statistics.median(times["decode"])
            for key in ("albumentations", "torchvision_v2"):
                total = decode_s + statistics.median(times[key])
                row[f"{key}_with_decode_img_s"] = len(files) / total
                row[f"{key}_workers_for_1000_img_s"] = 1000 / row[f"{key}_with_decode_img_s"]
            rows.append(row)
            print(f"[data] {label}: albumentations {row['albumentations_img_s']['median']:.0f} img/s")
    finally:
        torch.set_num_threads(threads)
        cv2.setNumThreads(cv2_threads)
        tmp.cleanup()
    header = ["images (source -> size)", "decode (PIL) img/s", "albumentations img/s", "torchvision v2 img/s"]
    header += ["decode + alb.", "decode + tv2", "workers for 1,000 img/s (alb. / tv2)"]
    table = [
        [
            r["case"],
            fmt_spread(r["decode_img_s"]),
            fmt_spread(r["albumentations_img_s"]),
            fmt_spread(r["torchvision_v2_img_s"]),
            f"{r['albumentations_with_decode_img_s']:.0f}",
            f"{r['torchvision_v2_with_decode_img_s']:.0f}",
            f"{r['albumentations_workers_for_1000_img_s']:.1f} / {r['torchvision_v2_workers_for_1000_img_s']:.1f}",
        ]
        for r in rows
    ]
    notes = [
        f"Per worker: one process with 1 torch and 1 OpenCV thread, {n} images from `{bench.data_root}`. "
        "Train transform = `vit.data.transforms.train_transform` (crop, flip, 2 RandAugment ops at "
        "magnitude 9, normalise, to tensor); torchvision v2 runs the same ops on uint8 tensors "
        "(its RandAugment has its own op list and magnitude scale). Decoding (PIL, as `vit.data` does) "
        "is timed separately and added. ImageNet-sized: Tiny-ImageNet images upscaled to 500x375 (about "
        "ImageNet's mean size) and saved as JPEG quality 90, so decoding costs what it would on ImageNet.",
    ]
    return Section("Data pipeline, per worker", header, table, rows, notes)


def reencoded_copies(files: list[Path], size: tuple[int, int], folder: Path) -> list[Path]:
    """The images resized to `size` (bicubic) and saved as JPEG quality 90 under `folder`: real photos
    at the pixel count of an ImageNet JPEG, for a decode cost we do not have real files for here."""
    from PIL import Image

    copies = []
    for i, f in enumerate(files):
        with Image.open(f) as image:
            path = folder / f"{i:05d}_{size[0]}x{size[1]}.jpg"
            image.convert("RGB").resize(size, Image.Resampling.BICUBIC).save(path, quality=90)
        copies.append(path)
    return copies
