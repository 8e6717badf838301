"""Where `data.pipeline device`'s time goes, part by part, on this machine's GPU (or CPU): the loader
workers handing batches of encoded files over, and on one batch in the training process the
decoder, the crop + resize + flip, RandAugment and normalising, each timed alone: wall time, the
host's CPU time and, on a GPU, the device's busy time. Work that keeps the GPU busy cannot hide
behind a model's step on the same GPU; work that keeps the host busy can, in another thread (the
data path runs its stages beside the model: vit.data.prefetch); here the parts run one after
another in one thread.
Last, on any machine, what the GPU's batched steps dispatch for the batch: kernels and bytes written
(`benchmarks.report.OpCount`), which their GPU time follows (small, memory-bound kernels).
Run it alone: `flock /tmp/vit-bench.lock python -m benchmarks.data_parts [--batch 128 --workers 10]`."""

from __future__ import annotations

import argparse
import itertools
import math
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from benchmarks.report import OpCount


def timed(fn: Callable[[], object], device: torch.device, reps: int, warmup: int = 2) -> tuple[float, float]:
    """Milliseconds per call of `fn`, the device's queued work included, and the calling thread's
    CPU time in the calls, the final wait for the device left out (a wait inside a call, the
    decoder's, spins and counts): near the whole on a GPU, the host's work sets the pace."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start, cpu = time.perf_counter(), time.thread_time()
    for _ in range(reps):
        fn()
    cpu = time.thread_time() - cpu
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / reps * 1e3, cpu / reps * 1e3


def device_busy(fn: Callable[[], object], device: torch.device, reps: int) -> tuple[float | str | None, str]:
    """Milliseconds per call the GPU spent running `fn`'s kernels and copies (summed from torch's
    profiler; on one stream they do not overlap): near the wall time, the device sets the pace and
    the work does not hide behind a model's step on the same GPU; far below it, the host does.
    None on the CPU; the error's text if the profiler cannot read the device. And the kernels that
    took longest, with their ms per call: what to make cheaper first."""
    if device.type != "cuda":
        return None, ""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    try:
        fn()
        torch.cuda.synchronize(device)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                fn()
            torch.cuda.synchronize(device)
        kernels: dict[str, float] = {}
        for event in prof.events():
            if event.device_type == DeviceType.CUDA:
                kernels[event.name] = kernels.get(event.name, 0.0) + event.device_time_total / reps / 1e3
    except Exception as e:  # the table's other columns still print
        return f"{type(e).__name__}: {e}"[:80], ""
    longest = sorted(kernels.items(), key=lambda item: -item[1])[:4]
    return sum(kernels.values()), "; ".join(f"{name[:60]} {ms:.2f}" for name, ms in longest)


def main() -> None:
    from lightning_utilities.core.apply_func import apply_to_collection
    from torch.utils.data import DataLoader

    from vit.data.augment import (
        TRAIN_RESIZE_DTYPE,
        Augment,
        crop_resize_flip,
        normalize,
        rand_augment,
        resize_crops_together,
    )
    from vit.data.device import EncodedFiles, collate_encoded, decode_batch
    from vit.data.images import scan_image_folder
    from vit.data.transforms import IMAGENET_MEAN, IMAGENET_STD
    from vit.tools.data_check import synthetic_tree_wanted, write_synthetic_imagenet

    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, help="an ImageNet-like tree (default: a synthetic one in a temp dir)")
    parser.add_argument("--images", type=int, default=1280 if cuda else 256, help="the synthetic tree's size")
    parser.add_argument("--batch", type=int, default=128 if cuda else 32)
    parser.add_argument("--workers", type=int, default=min(10, max(1, (os.cpu_count() or 2) - 1)))
    parser.add_argument("--size", type=int, default=224, help="the crop's side")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument(
        "--worker-decode", type=float, default=0.0, help="data.device.worker_decode (1: workers' decode rate)"
    )
    args = parser.parse_args()
    device = torch.device("cuda" if cuda else "cpu")
    torch.set_float32_matmul_precision("high")  # as scripts/train.py runs: the crops' resizing uses TF32 on a GPU

    root = args.root or Path(tempfile.mkdtemp(prefix="vit-data-parts-"))
    if synthetic_tree_wanted(root):
        write_synthetic_imagenet(root, train=args.images, val=0, classes=10)
    _, samples = scan_image_folder(root / "train")
    augment = Augment(crop="rrc", hflip=True, randaugment_ops=2, randaugment_magnitude=9.0)
    dataset = EncodedFiles(samples, train=True, augment=augment, worker_decode=args.worker_decode)
    rng = np.random.default_rng(0)
    order = [(int(i), int(i)) for i in rng.permutation(len(samples))]  # (index, sample seed), shuffled

    rows: list[tuple[str, float, float | None, float | str | None]] = []  # (part, img/s, CPU ms, GPU ms a batch)
    longest: dict[str, str] = {}  # part: its longest kernels
    # Before the first batch is asked for, the workers prepare prefetch_factor (2) batches each: the
    # clock starts after those are drawn (up to workers - 1 batches finished before it still count).
    ahead, timed_batches = 2 * args.workers + 1, 30
    passes = math.ceil((ahead + timed_batches) * args.batch / len(order))
    loader = DataLoader(dataset, batch_size=args.batch, sampler=order * passes, collate_fn=collate_encoded,
                        num_workers=args.workers, drop_last=True, pin_memory=cuda)  # fmt: skip
    batches = iter(loader)
    for _ in range(ahead):
        next(batches)
    start, images = time.perf_counter(), 0
    for batch in batches:
        images += len(batch.labels)
    decoding = f"{args.worker_decode:.0%} of the JPEGs and the other files" if args.worker_decode else "non-JPEGs"
    rows.append((f"hand-over: {args.workers} loader workers read files, decode {decoding}, draw parameters", images
                 / (time.perf_counter() - start), None, None))  # fmt: skip
    del batches
    chunks = itertools.cycle([order[k : k + args.batch] for k in range(0, len(order) - args.batch + 1, args.batch)])
    ms, cpu = timed(lambda: collate_encoded(dataset.__getitems__(next(chunks))), torch.device("cpu"), args.reps)
    rows.append(("one worker's own work, in this process (no hand-over): the same for a batch", args.batch / ms * 1e3,
                 cpu, None))  # fmt: skip

    batch = collate_encoded([dataset[item] for item in order[: args.batch]])
    if cuda:  # as the datamodule's loader hands it over (pin_memory on CUDA): the decoder copies each file
        batch = apply_to_collection(batch, torch.Tensor, torch.Tensor.pin_memory)
    drawn = batch.augmentation
    images = decode_batch(batch.images(device), device)
    half = TRAIN_RESIZE_DTYPE
    cropped = crop_resize_flip(images, drawn.box, drawn.flip, args.size, dtype=half)
    parts = {
        "decode (nvjpeg on CUDA, libjpeg on the CPU)": lambda: decode_batch(batch.images(device), device),
        "crop + resize + flip (on a GPU in float16, as training)": lambda: crop_resize_flip(
            images, drawn.box, drawn.flip, args.size, dtype=half
        ),
        "the same in float32 (TF32 products)": lambda: crop_resize_flip(images, drawn.box, drawn.flip, args.size),
        "RandAugment, 2 ops at magnitude 9": lambda: rand_augment(cropped, drawn.rand_augment),
        "normalise": lambda: normalize(cropped, IMAGENET_MEAN, IMAGENET_STD),
    }
    parts["all four, one after another"] = lambda: normalize(
        rand_augment(crop_resize_flip(decode_batch(batch.images(device), device), drawn.box, drawn.flip, args.size,
                                      dtype=half), drawn.rand_augment),
        IMAGENET_MEAN, IMAGENET_STD,
    )  # fmt: skip
    for name, part in parts.items():
        ms, cpu = timed(part, device, args.reps)
        busy, longest[name] = device_busy(part, device, args.reps)
        rows.append((name, args.batch / ms * 1e3, cpu, busy))

    name = torch.cuda.get_device_name(device) if cuda else f"CPU, {os.cpu_count()} cores"
    others = len(batch.sizes)
    print(f"\n{name}; torch {torch.__version__}; batch {args.batch} of {len(samples)} images from {root} "
          f"({others} of this batch decoded in the worker)\n")  # fmt: skip
    print("| part | img/s | ms per batch | the host's CPU time | the GPU's busy time |\n|---|---:|---:|---:|---:|")
    for name, speed, cpu, busy in rows:
        cells = ["-" if v is None else v if isinstance(v, str) else f"{v:.1f}" for v in (cpu, busy)]
        print(f"| {name} | {speed:,.0f} | {args.batch / speed * 1e3:.1f} | {' | '.join(cells)} |")
    if any(longest.values()):
        print("\n| part | the GPU's longest kernels, ms per batch |\n|---|---|")
        for name, kernels in longest.items():
            print(f"| {name} | {kernels} |")
    # the GPU's steps for this batch, counted on this device (on the CPU, training crops one image at a time)
    steps = {
        "crop + resize + flip: two batched products in float16": lambda: resize_crops_together(
            images, drawn.box, drawn.flip, args.size, dtype=half
        ),
        "RandAugment, 2 ops at magnitude 9": lambda: rand_augment(cropped, drawn.rand_augment),
        "normalise": lambda: normalize(cropped, IMAGENET_MEAN, IMAGENET_STD),
    }
    print(f"\n| the GPU's step, batch of {args.batch} | kernels | MB written |\n|---|---:|---:|")
    for name, step in steps.items():
        with OpCount() as ops:
            step()
        print(f"| {name} | {ops.kernels} | {ops.written / 1e6:,.0f} |")
    # the GPU's batched resize (on this device) in float16 against float32, in pixel levels
    together = [resize_crops_together(images, drawn.box, drawn.flip, args.size, dtype=d) for d in (half, torch.float32)]
    error = (together[0] - together[1]).abs()
    print(f"\nCrops resized together in float16 vs float32: mean {error.mean():.3f}, max {error.max():.3f} levels")


if __name__ == "__main__":
    main()
