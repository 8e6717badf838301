"""The data path on this machine against the source images' size: PIL decode alone (one core) and
a recipe's data path alone (vit.tools.data_check.loader_speed: per-sample, with device_decode, and
from litdata chunks with device_decode), on a synthetic ImageNet-like tree and on copies with the
longer side capped (vit.tools.resize_folder). Run it alone:
`flock /tmp/vit-bench.lock python -m benchmarks.data_caps [--config configs/imagenet_vit_b16.yaml]`."""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path


def main() -> None:
    from vit.data.images import read_rgb
    from vit.tools.convert_streaming import convert_image_folder
    from vit.tools.data_check import DataCase, loader_speed, write_synthetic_imagenet
    from vit.tools.resize_folder import resize_folder

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, help="the tree (default: 400 synthetic images in a temp dir)")
    parser.add_argument("--caps", type=int, nargs="+", default=[384, 256])
    parser.add_argument("--workers", type=int, default=1, help="loader workers")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--config", default="configs/imagenet_resnet50.yaml", help="the recipe")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="vit-data-caps-"))
    root = args.root or work / "original"
    if not (root / "train").is_dir():
        write_synthetic_imagenet(root, train=400, val=40, classes=10)
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
        for decode in ("false", "true"):
            case = DataCase(args.config, tree, args.device, 24, 4, [*options, "--data.device_decode", decode])
            speeds.append(loader_speed(case)[0])
        stream = tree.with_name(f"{tree.name}-streaming")
        convert_image_folder(tree, stream, workers=2)
        case = DataCase(args.config, stream, args.device, 24, 4, [*options, "--data.device_decode", "true"], True)
        speeds.append(loader_speed(case)[0])
        print(f"| {name} | " + " | ".join(f"{s:,.0f}" for s in speeds) + " |", flush=True)


if __name__ == "__main__":
    main()
