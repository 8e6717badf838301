"""Export a model to ONNX (dynamic batch and image size) and check it with onnxruntime against PyTorch.

    python scripts/export.py runs/cifar10_vit/checkpoints/last.ckpt --out vit.onnx
    python scripts/export.py x.safetensors --check_sizes 32 48 --images cat.jpg dog.png
    python scripts/export.py weights.pth --model vit_small_patch16_224 --check_sizes 224 320
    python scripts/export.py timm:vit_base_patch16_224 --atol 1e-3

The source is anything vit.checkpoint.load_model reads: our .ckpt, an exported .safetensors,
timm:<name>, or a timm-format state dict with --model NAME. After writing the file, onnxruntime runs
it on a batch at each --check_sizes size (default: the export size and 1.5 times it) and the script
prints the largest |logit difference| against the PyTorch model; it exits 1 when one exceeds --atol.
The images are random unless --images gives files (resized, centre-cropped and normalised as in
evaluation). Installed (`pip install -e .`), the same command is `vit-export`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

from vit.checkpoint import load_model
from vit.data.images import read_rgb
from vit.data.transforms import IMAGENET_MEAN, IMAGENET_STD, eval_transform
from vit.export import OPSET, OnnxClassifier, export_onnx, image_spec, max_abs_diff


def default_out(source: str) -> Path:
    if source.startswith("timm:"):
        return Path(source.removeprefix("timm:").replace("/", "_") + ".onnx")
    return Path(source).with_suffix(".onnx")


def check_batch(args: argparse.Namespace, size: int, in_chans: int) -> torch.Tensor:
    if not args.images:
        return torch.randn(args.batch_size, in_chans, size, size, generator=torch.Generator().manual_seed(size))
    transform = eval_transform(size, args.crop_pct, tuple(args.mean), tuple(args.std))
    return torch.stack([transform(image=read_rgb(path))["image"] for path in args.images])


def main(argv: list[str] | None = None) -> dict[int, float]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", help=".ckpt, .safetensors, timm:<name>, or a timm-format file with --model")
    parser.add_argument("--model", help="architecture of a timm-format state dict (or of timm:<name>)")
    parser.add_argument("--model_kwargs", type=json.loads, default={}, help="JSON, e.g. '{\"img_size\": 384}'")
    parser.add_argument("--ema", action="store_true", help="export a .ckpt's EMA weights")
    parser.add_argument("--out", type=Path, help="the .onnx file (default: the source's name, .onnx)")
    parser.add_argument("--img_size", type=int, help="export size (default: the model's); the fixed one with --static")
    parser.add_argument("--static", action="store_true", help="fix the image size (the batch stays dynamic)")
    parser.add_argument("--opset", type=int, default=OPSET, help=f"ONNX opset (default {OPSET}, the least a ViT needs)")
    parser.add_argument("--check_sizes", type=int, nargs="+", help="sizes to compare at (default: export size, 1.5x)")
    parser.add_argument("--batch_size", type=int, default=2, help="random images per check")
    parser.add_argument("--images", nargs="+", help="image files to check on instead of random images")
    parser.add_argument("--crop_pct", type=float, default=1.0)
    parser.add_argument("--mean", type=float, nargs=3, default=IMAGENET_MEAN)
    parser.add_argument("--std", type=float, nargs=3, default=IMAGENET_STD)
    parser.add_argument("--atol", type=float, default=1e-4, help="largest |logit difference| accepted")
    args = parser.parse_args(argv)

    model = load_model(args.source, args.model, use_ema=args.ema, **args.model_kwargs)
    spec = image_spec(model, args.img_size, dynamic=not args.static)
    out = export_onnx(model, args.out or default_out(args.source), args.img_size, not args.static, args.opset)
    print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB, opset {args.opset})")

    size = spec.img_size[0]
    step = max(spec.multiple)
    sizes = args.check_sizes or ([size] if args.static else [size, max(step, size * 3 // 2 // step * step)])
    onnx_model = OnnxClassifier(out)
    diffs = {}
    for check_size in sizes:
        images = check_batch(args, check_size, spec.in_chans)
        diffs[check_size] = max_abs_diff(model, onnx_model, images)
        shape = f"{len(images)}x{spec.in_chans}x{check_size}x{check_size}"
        print(f"{shape}: max |onnxruntime - torch| = {diffs[check_size]:.2e}")
    worst = max(diffs.values())
    if not np.isfinite(worst) or worst > args.atol:
        print(f"error: the ONNX logits differ from PyTorch's by {worst:.2e} > --atol {args.atol:g}", file=sys.stderr)
        raise SystemExit(1)
    print(f"OK: within {args.atol:g} at {', '.join(map(str, sizes))} px")
    return diffs


def cli() -> None:
    """The `vit-export` command: bad input ends with the message, not a traceback."""
    try:
        main()
    except (OSError, ValueError, TypeError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(1) from None


if __name__ == "__main__":
    cli()
