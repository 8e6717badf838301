"""Predict the classes of image files with a trained checkpoint or its ONNX export: a table of each
image's top classes and their probabilities, and with --out the same as CSV or JSON.

    vit-predict runs/default/checkpoints/last.ckpt photos/ cat.jpg
    vit-predict runs/default/checkpoints/last.ckpt photos/ --top-k 3 --out preds.csv
    vit-predict last.onnx photos/ --out preds.json --skip-corrupt
    vit-predict runs/default/checkpoints/last.ckpt photos/ --ema

(`python scripts/predict.py ...` is the same command.)

CHECKPOINT is our .ckpt (or its .safetensors export) or an .onnx file written by vit-export. IMAGES
are files and folders (searched recursively for images, sorted). Each image is prepared as
validation prepared the run's images, with the settings the file carries (the centred crop_pct
square, resized to img_size, bicubic, normalised by mean and std: vit.data.transforms.eval_transform;
for a run with data.naflex, the whole image at its own aspect ratio within the patch budget, packed
as patch sequences: SequenceEvalTransform), and its probabilities are the softmax of the model's
logits; the classes are named as the checkpoint names them. --ema predicts with the moving average
of the weights that a .ckpt keeps when its run set model.ema_decay. A file without those settings is
read with the model's size, the whole image and ImageNet's mean and std, with a warning.

An image that cannot be read ends the command with an error naming it (exit status 1); with
--skip-corrupt it is named on stderr and left out. The CSV has the columns path, class_1, prob_1,
..., class_K, prob_K; the JSON is a list of {"path", "predictions": [{"class", "prob"}, ...]}.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from vit.checkpoint import load_checkpoint
from vit.data.images import read_rgb
from vit.data.preprocess import Preprocess
from vit.export import OnnxClassifier, image_spec, save_atomically
from vit.naflex import Inputs
from vit.tools.args import image_files, positive_int
from vit.wording import counted

DEFAULT_TOP_K = 5  # or every class, when the model has fewer
OUT_FORMATS = (".csv", ".json")
Logits = Callable[[Inputs], torch.Tensor]  # prepared images (Preprocess's batch) -> logits on the CPU


@dataclass
class Classifier:
    """A model to predict with: logits of a batch of prepared images (on the CPU), how images are
    prepared, and the class names in label order."""

    logits: Logits
    preprocess: Preprocess
    class_names: list[str]


@dataclass
class Prediction:
    """One image's top classes and their probabilities, most probable first."""

    path: Path
    top: list[tuple[str, float]]


# -- the model ---------------------------------------------------------------------------------


def load_classifier(path: Path, device: str = "auto", ema: bool = False) -> Classifier:
    """Our .ckpt / .safetensors (run by PyTorch on `device`) or a vit-export .onnx file (onnxruntime, CPU);
    `ema`: a .ckpt's moving average of the weights (the exports hold one set, the one exported)."""
    if ema and path.suffix != ".ckpt":
        raise ValueError(
            f"--ema: {path} holds one set of weights; give the run's .ckpt, or export its EMA weights "
            "(vit-export --ema, export_safetensors(use_ema=True))"
        )
    if path.suffix == ".onnx":
        logits, preprocess, names = _onnx(path, device)
    elif path.suffix in (".ckpt", ".safetensors"):
        logits, preprocess, names = _torch(path, device, ema)
    else:
        raise ValueError(
            f"CHECKPOINT {path}: expected our .ckpt (or its .safetensors export) or a vit-export .onnx file"
        )
    if names is None:  # the data did not name its classes: their indices
        blank = np.zeros((preprocess.img_size, preprocess.img_size, 3), np.uint8)
        classes = logits(preprocess([blank])).shape[-1]
        names = [str(c) for c in range(classes)]
    return Classifier(logits, preprocess, names)


def _torch(path: Path, device: str, ema: bool) -> tuple[Logits, Preprocess, list[str] | None]:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available here; use --device cpu")
    target = torch.device(device)
    model, meta = load_checkpoint(path, use_ema=ema)
    try:
        size = image_spec(model).img_size[0]
    except TypeError:
        raise ValueError(f"{path} holds a {type(model).__name__}, not an image classifier") from None
    model = model.float().to(target)

    def logits(images: Inputs) -> torch.Tensor:
        images = {n: v.to(target) for n, v in images.items()} if isinstance(images, dict) else images.to(target)
        with torch.inference_mode():
            return model(images).float().cpu()

    saved = meta.get("preprocess")
    preprocess = Preprocess.from_dict(saved) if saved is not None else _assumed(path, size)
    return logits, preprocess, meta.get("class_names")


def _onnx(path: Path, device: str) -> tuple[Logits, Preprocess, list[str] | None]:
    if device == "cuda":
        raise ValueError(f"--device cuda: {path} runs on onnxruntime's CPU provider; use the .ckpt for a GPU")
    try:
        model = OnnxClassifier(path)
    except ImportError as e:
        raise RuntimeError(f"running {path} needs onnxruntime: pip install -e '.[export]' ({e})") from e
    if model.spec is None:
        raise ValueError(f"{path} has no vit.* metadata (not written by vit-export): its input size is unknown")
    preprocess = model.preprocess or _assumed(path, model.spec.img_size[0])
    return (lambda images: torch.from_numpy(model(images))), preprocess, model.class_names


def _assumed(path: Path, size: int) -> Preprocess:
    print(
        f"warning: {path} does not say how validation prepared images; assuming {size} px, the whole image "
        "(crop 1.0) and ImageNet's mean and std",
        file=sys.stderr,
    )
    return Preprocess.assumed(size)


# -- the images --------------------------------------------------------------------------------


def _read(path: Path) -> np.ndarray | ValueError:
    """The image, or why it cannot be read (CorruptImageError, a float image: the message names the file)."""
    try:
        return read_rgb(path)
    except ValueError as e:
        return e


def predict(
    classifier: Classifier, files: list[Path], top_k: int, batch_size: int = 32, skip_corrupt: bool = False
) -> tuple[list[Prediction], list[Path]]:
    """Each readable file's top_k classes, in the order given, and the files skipped (skip_corrupt)."""
    predictions: list[Prediction] = []
    skipped: list[Path] = []
    with ThreadPoolExecutor(max_workers=4) as pool:  # PIL decodes without holding the interpreter's lock
        for start in range(0, len(files), batch_size):
            batch = files[start : start + batch_size]
            paths, images = [], []
            for path, image in zip(batch, pool.map(_read, batch), strict=True):
                if isinstance(image, ValueError):
                    if not skip_corrupt:
                        raise image
                    print(f"skipped: {image}", file=sys.stderr)
                    skipped.append(path)
                    continue
                paths.append(path)
                images.append(image)
            if not images:
                continue
            probs = classifier.logits(classifier.preprocess(images)).softmax(dim=-1)
            top = probs.topk(top_k, dim=-1)
            for path, values, indices in zip(paths, top.values.tolist(), top.indices.tolist(), strict=True):
                names = [classifier.class_names[c] for c in indices]
                predictions.append(Prediction(path, list(zip(names, values, strict=True))))
    return predictions, skipped


# -- the output --------------------------------------------------------------------------------


def table(predictions: list[Prediction], top_k: int) -> str:
    header = ["file", *(f"top-{i}" for i in range(1, top_k + 1))]
    rows = [[str(p.path), *(f"{c} {q:.3f}" for c, q in p.top)] for p in predictions]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in [header, *rows]
    )


def write(out: Path, predictions: list[Prediction], top_k: int) -> None:
    """The predictions as CSV or JSON (by `out`'s suffix), written atomically: a full disk leaves the
    file that was there, and says so naming it."""
    if out.suffix == ".json":
        rows = [
            {"path": str(p.path), "predictions": [{"class": c, "prob": round(q, 6)} for c, q in p.top]}
            for p in predictions
        ]
        text = json.dumps(rows, indent=2) + "\n"
    else:
        buffer = io.StringIO(newline="")
        writer = csv.writer(buffer)
        writer.writerow(["path", *(f"{name}_{i}" for i in range(1, top_k + 1) for name in ("class", "prob"))])
        for p in predictions:
            writer.writerow([str(p.path), *(v for c, q in p.top for v in (c, f"{q:.6f}"))])
        text = buffer.getvalue()
    save_atomically(out, lambda file: file.write_text(text, newline=""))


# -- the command -------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> list[Prediction]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path, help="our .ckpt or .safetensors, or a vit-export .onnx file")
    parser.add_argument("images", nargs="+", help="image files and folders (searched recursively)")
    parser.add_argument(
        "--top-k", type=positive_int, help=f"classes per image (default {DEFAULT_TOP_K}, or all when fewer)"
    )
    parser.add_argument("--out", type=Path, help="also write the predictions to this .csv or .json file")
    parser.add_argument("--batch-size", type=positive_int, default=32)
    parser.add_argument(
        "--device", choices=["auto", "cpu", "cuda"], default="auto", help="auto: cuda when there is one"
    )
    parser.add_argument("--skip-corrupt", action="store_true", help="leave out images that cannot be read, naming them")
    parser.add_argument("--ema", action="store_true", help="predict with a .ckpt's EMA weights (model.ema_decay)")
    args = parser.parse_args(argv)
    if args.out is not None and args.out.suffix not in OUT_FORMATS:
        raise ValueError(f"--out {args.out}: expected a file ending in {' or '.join(OUT_FORMATS)}")

    files = image_files(args.images)
    classifier = load_classifier(args.checkpoint, args.device, args.ema)
    classes = len(classifier.class_names)
    top_k = args.top_k or min(DEFAULT_TOP_K, classes)
    if top_k > classes:
        raise ValueError(f"--top-k {top_k} is more than the {classes} classes of {args.checkpoint}")
    predictions, skipped = predict(classifier, files, top_k, args.batch_size, args.skip_corrupt)
    if not predictions:
        raise ValueError(f"none of the {len(files)} images could be read")
    print(table(predictions, top_k))
    if skipped:
        print(f"skipped {len(skipped)} of {len(files)} images that could not be read (named above)", file=sys.stderr)
    if args.out is not None:
        write(args.out, predictions, top_k)
        print(f"wrote {args.out} ({counted(len(predictions), 'image')}, top {top_k})")
    return predictions


def cli() -> None:
    """The `vit-predict` command: bad input ends with a one-line error and exit status 1."""
    try:
        main()
    except (OSError, ValueError, RuntimeError) as e:  # CorruptImageError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(1) from None


if __name__ == "__main__":
    cli()
