"""The data path on this machine against the source images' size: PIL decode alone (one core) and
a recipe's data path alone (vit.tools.data_check.loader_speed: per-sample, with the device pipeline,
and from litdata chunks with it), on a synthetic ImageNet-like tree and on copies with the
longer side capped (vit.tools.resize_folder). `--prefetch`: instead, end to end through
`scripts/train.py fit` with the device pipeline, each batch decoded when its step begins against a batch
ahead in a thread (`data.device.prefetch` 0 / 1), both recipes with their smallest models. Run it
alone: `flock /tmp/vit-bench.lock python -m benchmarks.data_caps [--config ...] [--prefetch]`."""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path


def main() -> None:
    from vit.data.images import read_rgb
    from vit.tools.convert_streaming import convert_image_folder
    from vit.tools.data_check import DataCase, loader_speed, synthetic_tree_wanted, write_synthetic_imagenet
    from vit.tools.resize_folder import resize_folder

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, help="the tree (default: 400 synthetic images in a temp dir)")
    parser.add_argument("--caps", type=int, nargs="+", default=[384, 256])
    parser.add_argument("--workers", type=int, default=1, help="loader workers")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--config", default="configs/imagenet_resnet50.yaml", help="the recipe")
    parser.add_argument("--prefetch", action="store_true", help="compare data.device.prefetch 0 and 1 end to end")
    parser.add_argument("--reps", type=int, default=3, help="--prefetch: runs of each, alternating")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="vit-data-caps-"))
    root = args.root or work / "original"
    if synthetic_tree_wanted(root):
        write_synthetic_imagenet(root, train=400, val=40, classes=10)
    if args.prefetch:
        prefetch_table(root, args)
        return
    trees = {"original": root}
    for cap in args.caps:
        resize_folder(root, work / f"max{cap}", cap, workers=2)
        trees[f"longer side <= {cap}"] = work / f"max{cap}"
    print(f"{args.config}, batch {args.batch}, {args.workers} loader worker(s), {args.device}")
    print("| images | PIL decode, 1 core | per-sample | device_decode | streaming + device_decode |")
    print("|---|---:|---:|---:|---:|")
    for name, tree in trees.items():
        files = sorted((tree / "train").rglob("*.*"))
        start = time.perf_counter()
        for path in files:
            read_rgb(path)
        speeds = [len(files) / (time.perf_counter() - start)]
        options = ["--data.batch_size", str(args.batch), "--data.num_workers", str(args.workers)]
        for pipeline in ("per_sample", "device"):
            case = DataCase(args.config, tree, args.device, 24, 4, [*options, "--data.pipeline", pipeline])
            speeds.append(loader_speed(case)[0])
        stream = tree.with_name(f"{tree.name}-streaming")
        convert_image_folder(tree, stream, workers=2)
        case = DataCase(args.config, stream, args.device, 24, 4, [*options, "--data.pipeline", "device"], True)
        speeds.append(loader_speed(case)[0])
        print(f"| {name} | " + " | ".join(f"{s:,.0f}" for s in speeds) + " |", flush=True)


def prefetch_table(root: Path, args: argparse.Namespace) -> None:
    """End-to-end img/s with the device pipeline, device.prefetch 0 and 1 (median of `reps`, alternating)."""
    import statistics

    from vit.tools.data_check import DataCase, end_to_end_speed

    recipes = {
        "configs/imagenet_resnet50.yaml": "resnet18",
        "configs/imagenet_vit_b16.yaml": "vit_tiny_patch16_224",
    }
    print(f"128 px, batch {args.batch // 2}, {args.workers} loader worker(s), 30 steps timed after 6, {args.device}")
    print("| recipe (model) | device_prefetch 0 | device_prefetch 1 | 1 / 0 |")
    print("|---|---:|---:|---:|")
    for config, model in recipes.items():
        speeds: dict[str, list[float]] = {"0": [], "1": []}
        for _ in range(args.reps):
            for ahead in speeds:
                options = ["--model.model_name", model, "--data.img_size", "128", "--data.batch_size",
                           str(args.batch // 2), "--data.num_workers", str(args.workers), "--data.pipeline",
                           "device", "--data.device.prefetch", ahead]  # fmt: skip
                speeds[ahead].append(end_to_end_speed(DataCase(config, root, args.device, 36, 6, options), False)[0])
        off, on = (statistics.median(speeds[a]) for a in ("0", "1"))
        print(f"| {config} ({model}) | {off:,.1f} | {on:,.1f} | {on / off:.2f} |", flush=True)


if __name__ == "__main__":
    main()
