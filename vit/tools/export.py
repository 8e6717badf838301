"""Export a model to ONNX (dynamic batch and image size) and check it with onnxruntime against PyTorch.

    python scripts/export.py runs/cifar10_vit/checkpoints/last.ckpt --out vit.onnx
    python scripts/export.py x.safetensors --check_sizes 32 48 --images cat.jpg dog.png
    python scripts/export.py weights.pth --model vit_small_patch16_224 --check_sizes 224 320
    python scripts/export.py timm:vit_base_patch16_224 --atol 1e-3
    python scripts/export.py naflex.pth --model naflexvit_base_patch16_gap --input patches --max_patches 256

The source is anything vit.checkpoint.load_model reads: our .ckpt, an exported .safetensors,
timm:<name> (downloaded; offline, fetch its model.safetensors elsewhere and give that file with
--model <name>), or a timm-format state dict with --model NAME. After writing the file, onnxruntime runs
it on a batch at each --check_sizes size (default: the export size and 1.5 times it) and the script
prints the largest |logit difference| against the PyTorch model; it exits 1 when one exceeds --atol.
The images are random unless --images gives files (resized, centre-cropped and normalised as in
evaluation). The file's metadata carries the checkpoint's class names and evaluation preprocessing
(size, crop, mean, std; --crop_pct, --mean and --std replace the checkpoint's or, for other sources,
give it), which vit-predict and a bare onnxruntime session read. `--input patches` exports a
NaFlexViT's patch-sequence form (patches, patch_coord, patch_valid; any batch and sequence length),
checked on each size's images packed with a half-width copy of the first (two aspect ratios, padding).
A checkpoint trained with data.naflex exports that form by default, its sequences as long as its patch
budget, and its metadata carries the budget (--input and --max_patches still choose).
Installed (`pip install -e .`), the same command is `vit-export`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np
import torch

from vit.checkpoint import load_model_and_meta
from vit.data.images import read_rgb
from vit.data.preprocess import Preprocess
from vit.export import INPUTS, OPSET, ImageSpec, OnnxClassifier, export_onnx, image_spec, max_abs_diff
from vit.naflex import pack
from vit.tools.args import non_negative_float, positive_int
from vit.weights import PretrainedDownloadError


def default_out(source: str) -> Path:
    if source.startswith("timm:"):
        return Path(source.removeprefix("timm:").replace("/", "_") + ".onnx")
    return Path(source).with_suffix(".onnx")


def default_input(args: argparse.Namespace, meta: dict) -> tuple[str, int | None]:
    """--input and --max_patches as given, else what the checkpoint's preprocessing asks for: a run
    with data.naflex validated on patch sequences of its budget; any other source takes images."""
    budget = (meta.get("preprocess") or {}).get("max_patches")
    inputs = args.input or ("patches" if budget is not None else "images")
    if args.max_patches is not None:
        return inputs, args.max_patches
    return inputs, budget if inputs == "patches" else None


def file_preprocess(args: argparse.Namespace, meta: dict, size: int) -> Preprocess | None:
    """What the file's metadata says of preprocessing: the checkpoint's, with the options given
    replacing its values; for a source without it, the options given at the export size; else nothing.
    An image export of a checkpoint with a patch budget says square images (with a warning): its
    graph cannot batch images of their own aspect ratios."""
    given = {"crop_pct": args.crop_pct, "mean": args.mean, "std": args.std}
    given = {name: value for name, value in given.items() if value is not None}
    saved = meta.get("preprocess")
    if saved is None and not given:
        return None
    preprocess = Preprocess.from_dict({**(saved or Preprocess.assumed(size).to_dict()), **given})
    if preprocess.max_patches is not None and args.input == "images":
        print(
            f"warning: {args.source} was validated on patch sequences (at most {preprocess.max_patches} patches of "
            f"{preprocess.patch_size} px an image, at its own aspect ratio); this image export's metadata says "
            f"{preprocess.img_size} px squares instead, not validation's pixels (--input patches keeps them)",
            file=sys.stderr,
        )
        preprocess = dataclasses.replace(preprocess, max_patches=None, patch_size=None)
    return preprocess


def check_sizes(args: argparse.Namespace, spec: ImageSpec) -> list[int]:
    """The sizes onnxruntime and PyTorch are compared at: --check_sizes, each refused, saying why, where
    the file will not take it (before anything is written); by default the export size and 1.5 times it."""
    size, step = spec.img_size[0], max(spec.multiple)
    if not args.check_sizes:
        return [size] if args.static else [size, max(step, size * 3 // 2 // step * step)]
    for check_size in args.check_sizes:
        if args.static and check_size != size:
            raise ValueError(f"--check_sizes {check_size}: a --static export takes {size} px only")
        try:
            spec.check((1, spec.in_chans, check_size, check_size))
        except ValueError as e:
            raise ValueError(f"--check_sizes {check_size}: {e}") from None
    return args.check_sizes


def check_batch(args: argparse.Namespace, size: int, in_chans: int, preprocess: Preprocess | None) -> torch.Tensor:
    if not args.images:
        return torch.randn(args.batch_size, in_chans, size, size, generator=torch.Generator().manual_seed(size))
    preprocess = preprocess or Preprocess.assumed(size)
    # Square images at each check size, the budget left out: check_inputs packs them for a sequence file.
    square = dataclasses.replace(preprocess, img_size=size, max_patches=None, patch_size=None)
    return square([read_rgb(path) for path in args.images])


def check_inputs(
    args: argparse.Namespace, images: torch.Tensor, patch: tuple[int, int]
) -> tuple[torch.Tensor | dict, str]:
    """What both models are given at one size, and its description: the images, or with --input patches
    the images and the first one's left half (another aspect ratio) packed into padded sequences."""
    if args.input == "images":
        return images, "x".join(map(str, images.shape))
    half = images[0][..., : max(patch[1], images.shape[-1] // 2 // patch[1] * patch[1])]
    batch = pack([*images, half], patch)
    height, width = images.shape[-2:]
    shape = "x".join(map(str, batch["patches"].shape))
    return batch, f"{shape} patches ({len(images)} of {height}x{width} px, 1 of {height}x{half.shape[-1]})"


def load_source(args: argparse.Namespace) -> tuple[torch.nn.Module, dict]:
    try:
        return load_model_and_meta(args.source, args.model, use_ema=args.ema, **args.model_kwargs)
    except PretrainedDownloadError as e:  # its advice names the training option; this script takes a path
        architecture = args.model or e.name.split(".")[0]
        raise RuntimeError(
            f"{e.reason} and export the file: scripts/export.py /path/to/model.safetensors --model {architecture}"
        ) from e


def main(argv: list[str] | None = None) -> dict[int, float]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", help=".ckpt, .safetensors, timm:<name>, or a timm-format file with --model")
    parser.add_argument("--model", help="architecture of a timm-format state dict (or of timm:<name>)")
    parser.add_argument("--model_kwargs", type=json.loads, default={}, help="JSON, e.g. '{\"img_size\": 384}'")
    parser.add_argument("--ema", action="store_true", help="export a .ckpt's EMA weights")
    parser.add_argument("--out", type=Path, help="the .onnx file (default: the source's name, .onnx)")
    parser.add_argument(
        "--img_size", type=positive_int, help="export size (default: the model's); the fixed one with --static"
    )
    parser.add_argument("--static", action="store_true", help="fix the image size (the batch stays dynamic)")
    parser.add_argument(
        "--opset", type=positive_int, default=OPSET, help=f"ONNX opset (default {OPSET}, the least a ViT needs)"
    )
    parser.add_argument(
        "--check_sizes", type=positive_int, nargs="+", help="sizes to compare at (default: export size, 1.5x)"
    )
    parser.add_argument("--batch_size", type=positive_int, default=2, help="random images per check")
    parser.add_argument("--images", nargs="+", help="image files to check on instead of random images")
    parser.add_argument("--crop_pct", type=float, help="eval centre crop (default: the checkpoint's, else 1.0)")
    parser.add_argument("--mean", type=float, nargs=3, help="default: the checkpoint's, else ImageNet's")
    parser.add_argument("--std", type=float, nargs=3, help="default: the checkpoint's, else ImageNet's")
    parser.add_argument("--atol", type=non_negative_float, default=1e-4, help="largest |logit difference| accepted")
    parser.add_argument(
        "--input",
        choices=INPUTS,
        help="patches: a NaFlexViT's patch sequences (default for a data.naflex run; else images)",
    )
    parser.add_argument(
        "--max_patches",
        type=positive_int,
        help="--input patches: the length images are packed to (default: the run's budget)",
    )
    args = parser.parse_args(argv)

    model, meta = load_source(args)
    args.input, args.max_patches = default_input(args, meta)
    spec = image_spec(model, args.img_size, dynamic=not args.static, inputs=args.input)
    preprocess, class_names = file_preprocess(args, meta, spec.img_size[0]), meta.get("class_names")
    sizes = check_sizes(args, spec)
    out = args.out or default_out(args.source)
    out = export_onnx(
        model, out, args.img_size, not args.static, args.opset, preprocess, class_names, args.input, args.max_patches
    )  # fmt: skip
    carried = [] if preprocess is None else [f"{preprocess.img_size} px preprocessing"]
    if preprocess is not None and preprocess.max_patches is not None:
        carried = [f"{preprocess.max_patches}-patch preprocessing"]
    carried += [f"{len(class_names)} class names"] if class_names else []
    print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB, opset {args.opset}{''.join(f', {c}' for c in carried)})")

    onnx_model = OnnxClassifier(out)
    diffs = {}
    for check_size in sizes:
        inputs, shape = check_inputs(args, check_batch(args, check_size, spec.in_chans, preprocess), spec.multiple)
        diffs[check_size] = max_abs_diff(model, onnx_model, inputs)
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
