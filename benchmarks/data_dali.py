"""NVIDIA DALI's CPU pipeline beside ours, on this machine: the data path's img/s and the training
process's CPU a batch for the ImageNet recipes' training augmentation, how far DALI's evaluation
pixels are from ours (the ones export, rollout and predict also use), and what DALI installs.

DALI is not a dependency; install it where this command finds it, e.g.
`pip install --target /tmp/dali nvidia-dali-cuda130` (then drop the numpy it brings along), and run
`PYTHONPATH=/tmp/dali flock /tmp/vit-bench.lock python -m benchmarks.data_dali`."""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.data_process import MODES, cost

RECIPES = {  # config: whether its training augmentation has RandAugment (2 ops at magnitude 9)
    "configs/imagenet_resnet50.yaml": False,
    "configs/imagenet_vit_b16.yaml": True,
}
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def dali_training(root: Path, batch: int, threads: int, size: int, randaugment: bool, steps: int, warmup: int) -> dict:
    """img/s of DALI's CPU pipeline with our recipes' training augmentation (random resized crop of
    8-100% of the area at aspect 3/4-4/3, decoded as a region; bilinear antialiased resize; RandAugment;
    flip; normalise to float CHW; no Mixup/CutMix, which ours adds to the ViT-B/16 recipe), and the
    process's and the calling thread's CPU ms a batch."""
    from nvidia.dali import fn, pipeline_def, types
    from nvidia.dali.auto_aug import rand_augment
    from nvidia.dali.plugin.pytorch import DALIGenericIterator

    @pipeline_def(enable_conditionals=randaugment)
    def training():
        files, labels = fn.readers.file(file_root=str(root), random_shuffle=True, name="files")
        images = fn.decoders.image_random_crop(
            files, device="cpu", output_type=types.RGB, random_area=[0.08, 1.0], random_aspect_ratio=[3 / 4, 4 / 3]
        )
        images = fn.resize(images, resize_x=size, resize_y=size, interp_type=types.INTERP_LINEAR, antialias=True)
        if randaugment:  # magnitude 9 of 10, as ours
            images = rand_augment.rand_augment(images, n=2, m=9, num_magnitude_bins=11)
        images = fn.crop_mirror_normalize(
            images, dtype=types.FLOAT, output_layout="CHW", mirror=fn.random.coin_flip(),
            mean=[m * 255 for m in MEAN], std=[s * 255 for s in STD],
        )  # fmt: skip
        return images, labels

    pipe = training(batch_size=batch, num_threads=threads, device_id=None, seed=0)
    pipe.build()
    batches = DALIGenericIterator([pipe], ["x", "y"], reader_name="files", auto_reset=True)
    drawn = 0
    while drawn < steps:  # epoch after epoch
        for _ in batches:
            drawn += 1
            if drawn == warmup:
                wall, cpu, main = time.perf_counter(), time.process_time(), time.thread_time()
            if drawn == steps:
                break
    timed = steps - warmup
    seconds = time.perf_counter() - wall
    cpu, main = (1e3 * (time.process_time() - cpu) / timed, 1e3 * (time.thread_time() - main) / timed)
    return {"img/s": timed * batch / seconds, "cpu_ms": cpu, "main_ms": main}


def eval_pixels(files: list[Path], size: int, crop_pct: float, geometry: str) -> np.ndarray:
    """|DALI's evaluation pixels - ours| per pixel, in grey levels (0-255, before normalising). Ours
    (vit.data.augment.eval_resize, every path's) crops the centre square of crop_pct x the shorter
    side and resizes it (bicubic, antialiased); DALI (`geometry`) resizes the shorter side to
    size / crop_pct (cubic, antialiased) and crops the centre ("shorter"), or resizes our square
    ("square"); "decoded": both decoders' images as they are."""
    import nvidia.dali.math as dmath
    from nvidia.dali import fn, pipeline_def, types

    from vit.data.augment import eval_resize
    from vit.data.images import decode_rgb

    @pipeline_def
    def evaluation():
        data, _ = fn.readers.file(files=[str(f) for f in files], name="files")
        images = fn.decoders.image(data, device="cpu", output_type=types.RGB)
        cubic = {"interp_type": types.INTERP_CUBIC, "antialias": True}
        if geometry == "decoded":
            return images
        if geometry == "shorter":
            images = fn.resize(images, resize_shorter=size / crop_pct, **cubic)
            return fn.crop(images, crop=(size, size), out_of_bounds_policy="trim_to_shape")
        height, width = images.shape(dtype=types.FLOAT)[0], images.shape(dtype=types.FLOAT)[1]
        side = dmath.floor(dmath.min(height, width) * crop_pct + 0.5)
        top, left = dmath.floor((height - side) / 2), dmath.floor((width - side) / 2)
        start, end = fn.stack(top, left), fn.stack(top + side, left + side)
        return fn.resize(images, size=(size, size), roi_start=start, roi_end=end, roi_relative=False, **cubic)

    pipe = evaluation(batch_size=len(files), num_threads=1, device_id=None)
    pipe.build()
    (theirs,) = pipe.run()
    differences = []
    for k, path in enumerate(files):
        pixels = torch.from_numpy(decode_rgb(path.read_bytes()).copy()).permute(2, 0, 1).contiguous()
        ours = pixels.float() if geometry == "decoded" else eval_resize(pixels, size, crop_pct)
        ours = ours.permute(1, 2, 0).numpy()
        differences.append(np.abs(np.asarray(theirs[k], dtype=np.float32) - ours).ravel())
    return np.concatenate(differences)


def dali_resume(root: Path, batch: int) -> dict[int, tuple[bool, bool]]:
    """DALI's checkpoint (enable_checkpointing) taken after 2 batches, restored into a pipeline of
    the same batch size and of half of it: {batch size: (the next 2 x `batch` images are the same
    files, with the same pixels)} against the run that went on."""
    from nvidia.dali import fn, pipeline_def, types

    @pipeline_def(enable_checkpointing=True)
    def training():
        files, labels = fn.readers.file(file_root=str(root), random_shuffle=True, name="files")
        images = fn.decoders.image_random_crop(files, device="cpu", output_type=types.RGB)
        images = fn.resize(images, resize_x=32, resize_y=32, antialias=True)
        return fn.flip(images, horizontal=fn.random.coin_flip()), labels

    def images(pipe: object, count: int) -> list[tuple[np.ndarray, int]]:
        out = []
        while len(out) < count:
            pixels, labels = pipe.run()
            out += [(np.asarray(pixels[i]), int(np.asarray(labels[i]).ravel()[0])) for i in range(len(labels))]
        return out

    first = training(batch_size=batch, num_threads=1, device_id=None, seed=0)
    first.build()
    images(first, 2 * batch)
    checkpoint = first.checkpoint()
    expected = images(first, 2 * batch)
    result = {}
    for size in (batch, batch // 2):
        resumed = training(batch_size=size, num_threads=1, device_id=None, seed=0, checkpoint=checkpoint)
        resumed.build()
        got = images(resumed, 2 * batch)
        same_files = [label for _, label in got] == [label for _, label in expected]
        same_pixels = all(np.array_equal(a, b) for (a, _), (b, _) in zip(got, expected, strict=True))
        result[size] = (same_files, same_pixels)
    return result


# DALI's wheel and the codec libraries it installs with it
DISTRIBUTIONS = ("nvidia-dali-cuda130", "nvidia-nvimgcodec-cu13", "nvidia-libnvcomp-cu13", "nvidia-nvjpeg",
                 "nvidia-nvjpeg2k-cu13", "nvidia-nvtiff-cu13")  # fmt: skip


def installed_mb() -> float:
    """Megabytes DALI and its codec libraries take once installed (those installed here)."""
    total = 0
    for name in DISTRIBUTIONS:
        try:
            files = importlib.metadata.distribution(name).files or []
        except importlib.metadata.PackageNotFoundError:
            continue
        total += sum(f.size or 0 for f in files)
    return total / 1e6


def main() -> None:
    from vit.tools.data_check import synthetic_tree_wanted, write_synthetic_imagenet

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, help="the tree (default: 400 synthetic images in a temp dir)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--workers", type=int, default=1, help="our loader workers")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="DALI's threads")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--warmup", type=int, default=4)
    args = parser.parse_args()
    try:
        import nvidia.dali  # noqa: F401
    except ImportError:
        raise SystemExit("DALI is not installed here: " + __doc__.split("\n\n")[1].replace("\n", " ")) from None
    root = args.root or Path(tempfile.mkdtemp(prefix="vit-data-dali-")) / "original"
    if synthetic_tree_wanted(root):
        write_synthetic_imagenet(root, train=400, val=40, classes=10)

    print(f"224 px, batch {args.batch}, {args.steps - args.warmup} batches timed after {args.warmup}; ours: "
          f"{args.workers} loader worker(s); DALI: {args.threads} threads")  # fmt: skip
    print("| recipe | data path | img/s | training process CPU ms a batch (calling thread) |\n|---|---|---:|---:|")
    ours = {name: MODES[name] for name in ("in the training process, a thread a batch ahead", "data process")}
    for config, randaugment in RECIPES.items():
        for name, mode in ours.items():
            r = cost(config, root, args.batch, args.workers, args.steps, args.warmup, mode)
            print(f"| {Path(config).stem} | ours, {name} | {r['img/s']:,.0f} | {r['cpu_ms']:.1f} "
                  f"({r['main_ms']:.1f}) |", flush=True)  # fmt: skip
        r = dali_training(root / "train", args.batch, args.threads, 224, randaugment, args.steps, args.warmup)
        print(f"| {Path(config).stem} | DALI, CPU operators | {r['img/s']:,.0f} | {r['cpu_ms']:.1f} "
              f"({r['main_ms']:.1f}) |", flush=True)  # fmt: skip

    files = sorted(p for p in (root / "val").rglob("*") if p.is_file())
    print(f"\nEvaluation pixels, DALI's against ours, {len(files)} images at 224 px, crop 0.875, grey levels")
    print("| DALI's geometry | mean | 99th percentile | max |\n|---|---:|---:|---:|")
    geometries = {"decoded": "none: the decoded images", "shorter": "shorter side resized, centre cropped",
                  "square": "our centre square, resized"}  # fmt: skip
    for geometry, name in geometries.items():
        difference = eval_pixels(files, 224, 0.875, geometry)
        print(f"| {name} | {difference.mean():.2f} | {np.percentile(difference, 99):.0f} | {difference.max():.0f} |")
    print(f"\nDALI's checkpoint after 2 batches of {args.batch}, the next {2 * args.batch} images resumed:")
    for size, (files_equal, pixels_equal) in dali_resume(root / "train", args.batch).items():
        print(f"- at batch size {size}: the same files {files_equal}, the same pixels {pixels_equal}")
    print(f"DALI installed with its codec libraries: {installed_mb():,.0f} MB")


if __name__ == "__main__":
    main()
