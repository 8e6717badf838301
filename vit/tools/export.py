"""Export a model to ONNX (dynamic batch and image size) and check it with onnxruntime against PyTorch.

    python scripts/export.py runs/cifar10_vit/checkpoints/last.ckpt --out vit.onnx
    python scripts/export.py x.safetensors --check_sizes 32 48 --images cat.jpg dog.png
    python scripts/export.py weights.pth --model vit_small_patch16_224 --check_sizes 224 320
    python scripts/export.py timm:vit_base_patch16_224 --atol 1e-3

The source is anything vit.checkpoint.load_model reads: our .ckpt, an exported .safetensors,
timm:<name> (downloaded; offline, fetch its model.safetensors elsewhere and give that file with
--model <name>), or a timm-format state dict with --model NAME. After writing the file, onnxruntime runs
it on a batch at each --check_sizes size (default: the export size and 1.5 times it) and the script
prints the largest |logit difference| against the PyTorch model; it exits 1 when one exceeds --atol.
The images are random unless --images gives files (resized, centre-cropped and normalised as in
evaluation). The file's metadata carries the checkpoint's class names and evaluation preprocessing
(size, crop, mean, std; --crop_pct, --mean and --std replace the checkpoint's or, for other sources,
give it), which vit-predict and a bare onnxruntime session read. Installed (`pip install -e .`),
the same command is `vit-export`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np
import torch

from vit.checkpoint import Preprocess, load_model_and_meta
from vit.data.images import read_rgb
from vit.data.transforms import IMAGENET_MEAN, IMAGENET_STD
from vit.export import OPSET, OnnxClassifier, export_onnx, image_spec, max_abs_diff


def default_out(source: str) -> Path:
    if source.startswith("timm:"):
        return Path(source.removeprefix("timm:").replace("/", "_") + ".onnx")
    return Path(source).with_suffix(".onnx")


def file_preprocess(args: argparse.Namespace, meta: dict, size: int) -> Preprocess | None:
    """What the file's metadata says of preprocessing: the checkpoint's, with the options given
    replacing its values; for a source without it, the options given at the export size; else nothing."""
    given = {"crop_pct": args.crop_pct, "mean": args.mean, "std": args.std}
    given = {name: value for name, value in given.items() if value is not None}
    saved = meta.get("preprocess")
    if saved is None and not given:
        return None
    defaults = {"img_size": size, "crop_pct": 1.0, "mean": IMAGENET_MEAN, "std": IMAGENET_STD}
    return Preprocess.from_dict({**(saved or defaults), **given})


def check_batch(args: argparse.Namespace, size: int, in_chans: int, preprocess: Preprocess | None) -> torch.Tensor:
    if not args.images:
        return torch.randn(args.batch_size, in_chans, size, size, generator=torch.Generator().manual_seed(size))
    preprocess = preprocess or Preprocess(size, 1.0, IMAGENET_MEAN, IMAGENET_STD)
    return dataclasses.replace(preprocess, img_size=size)([read_rgb(path) for path in args.images])


def load_source(args: argparse.Namespace) -> tuple[torch.nn.Module, dict]:
    try:
        return load_model_and_meta(args.source, args.model, use_ema=args.ema, **args.model_kwargs)
    except RuntimeError as e:
        # vit.checkpoint's advice for a failed timm download names the training option; this script takes a path.
        if not (args.source.startswith("timm:") and str(e).startswith("could not get timm's pretrained weights")):
            raise
        name = args.source.removeprefix("timm:")
        raise RuntimeError(timm_download_advice(name, args.model or name.split(".")[0], e.__cause__)) from e


def timm_download_advice(name: str, architecture: str, cause: BaseException | None) -> str:
    """One line: why timm's weights for `name` could not be had, and how to export a downloaded file instead."""
    import timm

    try:  # the hub repository carries the default tag (vit_base_patch16_224 -> ...augreg2_in21k_ft_in1k)
        repo = timm.models.get_pretrained_cfg(name).hf_hub_id or f"timm/{name}"
    except (AttributeError, RuntimeError):  # an unknown name or tag
        repo = f"timm/{name}"
    why = " ".join(f"{type(cause).__name__}: {cause}".split()) if cause is not None else "no reason given"
    return (
        f"could not get timm's pretrained weights for {name!r} ({why}). Offline, download model.safetensors from "
        f"https://huggingface.co/{repo} elsewhere and export the file: "
        f"scripts/export.py /path/to/model.safetensors --model {architecture}"
    )


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
    parser.add_argument("--crop_pct", type=float, help="eval centre crop (default: the checkpoint's, else 1.0)")
    parser.add_argument("--mean", type=float, nargs=3, help="default: the checkpoint's, else ImageNet's")
    parser.add_argument("--std", type=float, nargs=3, help="default: the checkpoint's, else ImageNet's")
    parser.add_argument("--atol", type=float, default=1e-4, help="largest |logit difference| accepted")
    args = parser.parse_args(argv)

    model, meta = load_source(args)
    spec = image_spec(model, args.img_size, dynamic=not args.static)
    preprocess, class_names = file_preprocess(args, meta, spec.img_size[0]), meta.get("class_names")
    out = args.out or default_out(args.source)
    out = export_onnx(model, out, args.img_size, not args.static, args.opset, preprocess, class_names)
    carried = [f"{preprocess.img_size} px preprocessing"] if preprocess else []
    carried += [f"{len(class_names)} class names"] if class_names else []
    print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB, opset {args.opset}{''.join(f', {c}' for c in carried)})")

    size = spec.img_size[0]
    step = max(spec.multiple)
    sizes = args.check_sizes or ([size] if args.static else [size, max(step, size * 3 // 2 // step * step)])
    onnx_model = OnnxClassifier(out)
    diffs = {}
    for check_size in sizes:
        images = check_batch(args, check_size, spec.in_chans, preprocess)
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
