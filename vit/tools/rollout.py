"""Export attention-rollout maps: per image a PNG (original | heatmap | overlay) and the raw
patch-grid map as .npy, plus an index.html gallery of the run that labels them and a gallery.png.

    vit-rollout --checkpoint runs/tiny_pretrain/checkpoints/last.ckpt photos/ cat.jpg
    vit-rollout --checkpoint runs/x/last.ckpt --config configs/tiny_imagenet_vit.yaml \
        --data-root ../shared/data/tiny-imagenet-200 --split val --limit 200 --out runs/rollout/tiny_val
    vit-rollout --checkpoint vit_b16.safetensors --model vit_base_patch16_224 --crop-pct 0.875 img/
    vit-rollout --checkpoint timm:vit_base_patch16_224 --method gradient img/   # needs the network
    vit-rollout --checkpoint runs/x/last.ckpt --method attention,gradient,last_attention,gradcam img/

(`python scripts/rollout.py ...` is the same command.)

The checkpoint is ours (.ckpt / .safetensors from scripts/train.py), a timm-format state dict with
--model naming the architecture, or timm:<name>. Images are files, folders (searched recursively)
or a dataset split from a training config. The model sees each image as its run's validation did,
with the preprocessing the checkpoint records (size, centre crop, mean and std: what vit-predict
reads), or, for timm's weights, timm's pretrained config gives; a --config's datamodule, then
--crop-pct, --mean and --std, replace single values, and a source that says none gets the model's
size, the whole image and ImageNet's mean and std. The
PNG shows the region the crop keeps, with the map resized to it bilinearly. A checkpoint whose run
validated on patch sequences (data.naflex, a patch budget) is explained one image at a time, at its
own aspect ratio on the grid validation gave it, and its maps are that grid (a 2:1 image's 11 x 22
of 256 patches); its PNG shows the image as validation resized it. `--method` takes any
of `vit.rollout.METHODS`, or several separated by commas: then every image gets one panel and one
map per method (`<image>_<method>.png` / `.npy`), and the gallery shows an image's methods side by
side in one row. `gallery.png` puts every image and method on one page (the image, then each
method's overlay; `--sheet-size` pixels a cell), headed by the model's name and size, its accuracy
as the checkpoint records it (or --accuracy) and the maps' colour scale. Predictions (on the page
and on gallery.png) are labelled with the class names the checkpoint carries (or the config's data
gives). An image's true class is shown next to them where it is known: the dataset's label with
--config, or, for image files, the name of the folder holding the image when a class has that name
(an image-folder layout such as `cifar10/test/cat/0006.jpg`).
"""

from __future__ import annotations

import argparse
import html
import importlib
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import yaml
from tqdm import tqdm

from vit.checkpoint import load_checkpoint, load_model_and_meta
from vit.checkpoint_files import RecordedScore, recorded_score
from vit.data.augment import center_crop_box
from vit.data.images import ImageArrays, ImageFiles, read_rgb
from vit.data.preprocess import Preprocess
from vit.export import image_spec
from vit.relevance import METHODS, check_vit, rollout_maps
from vit.render import contact_sheet, denormalise, render_panel
from vit.tools.args import image_files, positive_int
from vit.vision_transformer import VisionTransformer

METHOD_NAMES = {
    "attention": "attention rollout",
    "gradient": "gradient rollout",
    "last_attention": "last-block attention",
    "gradcam": "GradCAM",
}


# gallery.png is at least this many cells wide (an image and three maps): with fewer maps the header
# and the captions keep room to be read rather than wrapping into a narrow column.
SHEET_CELLS = 4


@dataclass
class Item:
    """One image to explain: a name for its files, how to read it, its label if known and the name
    of the folder it was found in (its class in an image-folder layout)."""

    name: str
    read: Callable[[], np.ndarray]
    label: int | None = None
    folder: str | None = None

    @property
    def title(self) -> str:
        """What the gallery calls it: folder/name, as two classes' folders may hold files of one name."""
        return f"{self.folder}/{self.name}" if self.folder else self.name


@dataclass
class Entry:
    """One image of the gallery: its name, top classes with their probabilities, true class if known,
    its (method, file stem) pairs in the order the methods were given and its panels' (width, height)."""

    name: str
    predictions: list[tuple[str, float]]
    true: str | None
    files: list[tuple[str, str]]
    panel_size: tuple[int, int]


# -- the model ---------------------------------------------------------------------------------


def load_vit(source: str, model_name: str | None = None) -> tuple[VisionTransformer, dict]:
    """Any source `vit.checkpoint.load_model` reads (with `--model` for a timm-format file), as a ViT,
    and the metadata it carries (our checkpoints: model name, class names, preprocessing; timm's
    weights: their pretrained config's preprocessing)."""
    ours = model_name is None and Path(source).suffix in (".ckpt", ".safetensors") and Path(source).is_file()
    try:
        if not ours:
            model, meta = load_model_and_meta(source, model_name)
            return check_vit(model, source), meta
        model, meta = load_checkpoint(source)  # rebuilt from the file alone, with the run's metadata
    except ValueError as e:
        if model_name is None and (ours or "give the architecture" in str(e)):
            raise ValueError(f"{e}. For a timm-format file, pass --model <architecture>") from e
        raise
    return check_vit(model, source), meta


def eval_preprocess(model: VisionTransformer, meta: dict, *overrides: dict) -> Preprocess:
    """How the model sees an image: the evaluation preprocessing the checkpoint records (as vit-predict
    reads it), else `Preprocess.assumed` at the model's size; each of `overrides` in turn (the
    config's datamodule, the options given) replaces the values it holds that are not None."""
    values = meta.get("preprocess") or Preprocess.assumed(image_spec(model).img_size[0]).to_dict()
    for override in overrides:
        values = {**values, **{name: value for name, value in override.items() if value is not None}}
    return Preprocess.from_dict(values)


def params_text(count: int) -> str:
    """A parameter count in millions: 5.4M, or two significant digits below 0.1M (0.021M)."""
    return f"{count / 1e6:.1f}M" if count >= 100_000 else f"{count / 1e6:.2g}M"


def accuracy_text(score: RecordedScore | None) -> str:
    """The validation score the checkpoint records, as gallery.png states it; never an estimate."""
    if score is None:
        return "accuracy not recorded"
    value = f"{100 * score.value:.1f}%" if "acc" in score.monitor else f"{score.value:.4g}"
    if score.own:
        return f"{score.monitor}: {value}"
    return f"{score.monitor}: not recorded for these weights (the run's best: {value}, {score.best})"


def sheet_header(name: str, model: VisionTransformer, accuracy: str) -> list[str]:
    """gallery.png's first lines: which model (its name and size) and how accurate it is."""
    return [f"{name} ({params_text(sum(p.numel() for p in model.parameters()))} params)", accuracy]


# -- the images --------------------------------------------------------------------------------


def items_from_paths(paths: list[str]) -> list[Item]:
    """Image files and folders (searched recursively, sorted), in the order given."""
    files = image_files(paths)
    return [Item(f.stem, lambda f=f: read_rgb(f), folder=Path(os.path.abspath(f)).parent.name) for f in files]


def label_by_folder(items: list[Item], class_names: list[str]) -> None:
    """Give an unlabelled item the class its folder is named after, if one is (image-folder layout)."""
    index = {name: c for c, name in enumerate(class_names)}
    for item in items:
        if item.label is None and item.folder in index:
            item.label = index[item.folder]


def items_from_config(config: str, split: str, data_root: str | None) -> tuple[list[Item], list[str] | None, dict]:
    """A dataset split of a training config's datamodule: its items, class names and the eval
    geometry and normalisation the datamodule declares (crop_pct, mean, std)."""
    with open(config) as f:
        data = (yaml.safe_load(f) or {}).get("data")
    if not data or "class_path" not in data:
        raise ValueError(f"{config} has no data.class_path (a datamodule)")
    module, _, name = data["class_path"].rpartition(".")
    init_args = dict(data.get("init_args") or {})
    if data_root is not None:
        init_args["root"] = data_root
    datamodule = getattr(importlib.import_module(module), name)(**{**init_args, "num_workers": 0})
    datamodule.setup("fit")
    dataset = {"train": datamodule.train_set, "val": datamodule.val_set}[split]
    if isinstance(dataset, ImageFiles):
        files = enumerate(dataset.samples)  # image files or streaming chunks: ImageFiles.read_image reads either
        items = [Item(Path(s.path).stem, lambda i=i: dataset.read_image(i), s.label) for i, s in files]
    elif isinstance(dataset, ImageArrays):
        items = [
            Item(f"{split}_{i:05d}", lambda i=i: dataset.images[i], int(dataset.labels[i])) for i in range(len(dataset))
        ]
    else:
        raise ValueError(
            f"{data['class_path']}'s {split} set is a {type(dataset).__name__}; expected image files or arrays"
        )
    settings = {"crop_pct": datamodule.eval_crop_pct, "mean": tuple(datamodule.mean), "std": tuple(datamodule.std)}
    return items, datamodule.class_names, settings


def model_view(image: np.ndarray, crop_pct: float) -> np.ndarray:
    """The part of the original image that the eval transform's centre crop keeps (full resolution)."""
    top, left, height, width = center_crop_box(*image.shape[:2], crop_pct)
    return image[top : top + height, left : left + width]


def model_inputs(preprocess: Preprocess, images: list[np.ndarray]) -> list[tuple[torch.Tensor, list[np.ndarray]]]:
    """The model's inputs for `images` as (batch, what each image's panels show) pairs. Square images:
    one batch, each shown as the region the centre crop keeps (`model_view`). With a patch budget: one
    (1, 3, H, W) image at a time, at the grid validation gave it, shown as those pixels. One image's
    patch sequence has no padding, so NaFlexVit gives this image the logits of its packed sequence, and
    the explanation methods, which take image tensors, see what validation saw."""
    if preprocess.max_patches is None:
        return [(preprocess(images), [model_view(image, preprocess.crop_pct) for image in images])]
    return [(x[None], [denormalise(x, preprocess.mean, preprocess.std)]) for x in preprocess.tensors(images)]


# -- the export --------------------------------------------------------------------------------


def _methods(text: str) -> list[str]:
    """`--method a,b`: the names, checked against METHODS (one method per map file and panel)."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in METHODS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"{', '.join(unknown) or repr(text)}: choose from {', '.join(METHODS)}")
    if len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"a method is named twice in {text!r}")
    return names


def batches(items: list[Item], size: int) -> Iterator[list[Item]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


def export(args: argparse.Namespace) -> Path:
    model, meta = load_vit(args.checkpoint, args.model)
    model = model.to(args.device)
    class_names = meta.get("class_names")
    data_settings: dict = {}
    if args.config:
        items, data_names, data_settings = items_from_config(args.config, args.split, args.data_root)
        class_names = data_names or class_names
    else:
        if not args.images:
            raise ValueError("give image files or folders, or --config (and --split) for a dataset split")
        items = items_from_paths(args.images)
    if args.class_names:
        class_names = [line.strip() for line in Path(args.class_names).read_text().splitlines() if line.strip()]
    elif class_names is None and model.num_classes == 1000:
        from timm.data import ImageNetInfo

        info = ImageNetInfo()
        class_names = [info.index_to_description(i).split(",")[0] for i in range(1000)]
    if class_names is not None and len(class_names) != model.num_classes:
        raise ValueError(f"{len(class_names)} class names for a model with {model.num_classes} classes")
    items = items[: args.limit] if args.limit else items
    if class_names is not None:
        label_by_folder(items, class_names)
    given = {"crop_pct": args.crop_pct, "mean": args.mean, "std": args.std}
    preprocess = eval_preprocess(model, meta, data_settings, given)
    if "preprocess" not in meta and not data_settings and all(value is None for value in given.values()):
        print(
            f"warning: {args.checkpoint} does not say how validation prepared images; assuming {preprocess.img_size} "
            "px, the whole image (crop 1.0) and ImageNet's mean and std (set them with --crop-pct, --mean, --std)",
            file=sys.stderr,
        )
    name = meta.get("model_name") or args.model or args.checkpoint.removeprefix("timm:")
    header = sheet_header(name, model, args.accuracy or accuracy_text(recorded_score(args.checkpoint)))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name_of = (lambda c: class_names[c]) if class_names else str
    entries, sheet_rows = [], []
    progress = tqdm(total=len(items), desc="rollout", unit="img")
    for batch in batches(items, args.batch_size):
        maps: dict[str, list[np.ndarray]] = {method: [] for method in args.method}  # each on its image's grid
        probs, views = [], []
        for x, shown in model_inputs(preprocess, [_read(item) for item in batch]):
            x = x.to(args.device)
            for method in args.method:
                found, logits = rollout_maps(
                    model, x, method, args.head_fusion, args.discard_ratio, args.start_layer, args.target
                )
                maps[method].extend(found.cpu().numpy())
            probs.extend(logits.float().softmax(dim=-1).cpu())
            views.extend(shown)
        for j, (item, view, p) in enumerate(zip(batch, views, probs, strict=True)):
            stem = f"{len(entries):05d}_{item.name}"
            top = p.topk(min(args.topk, len(p)))
            predictions = [(name_of(int(c)), float(v)) for v, c in zip(top.values, top.indices, strict=True)]
            true = None if item.label is None else name_of(item.label)
            files = []
            for method in args.method:  # one method: <stem>.png; several: <stem>_<method>.png
                file_stem = stem if len(args.method) == 1 else f"{stem}_{method}"
                panel = render_panel(view, maps[method][j], [], args.panel_size)
                panel.save(out / f"{file_stem}.png")
                np.save(out / f"{file_stem}.npy", maps[method][j].astype(np.float32))
                files.append((method, file_stem))
            entries.append(Entry(item.title, predictions, true, files, panel.size))
            lines = [item.title, *(f"{name}: {prob:.2f}" for name, prob in predictions), *_true_line(true)]
            sheet_rows.append((view, [maps[method][j] for method in args.method], lines))
            progress.update()
    progress.close()
    write_gallery(out, entries, args, header)
    titles = [METHOD_NAMES[m] for m in args.method]
    sheet = contact_sheet(sheet_rows, titles, args.sheet_size, header, min_width=SHEET_CELLS * args.sheet_size)
    sheet.save(out / "gallery.png")
    return out


def _read(item: Item) -> np.ndarray:
    image = item.read()
    if image.ndim == 2:
        image = np.repeat(image[..., None], 3, axis=-1)
    return image


def _true_line(true: str | None) -> list[str]:
    return [] if true is None else [f"true: {true}"]


def _caption(entry: Entry) -> str:
    """The image's name, its top classes and its true class, on one line that wraps as needed."""
    parts = [f"{html.escape(name)}: {prob:.2f}" for name, prob in entry.predictions]
    if entry.true is not None:
        right = entry.predictions[0][0] == entry.true
        verdict, mark = ("right", "&#10003;") if right else ("wrong", "&#10007;")
        parts.append(f'<span class="{verdict}">true: {html.escape(entry.true)} {mark}</span>')
    return f'<p class="caption"><b>{html.escape(entry.name)}</b> ' + " &middot; ".join(parts) + "</p>"


def _figure(file_stem: str, width: int, height: int, method: str | None) -> str:
    """A panel scaled to its column (width/height give the aspect ratio before it loads), titled
    with the method's name when the row shows several, and a link to its raw map."""
    stem = html.escape(file_stem)
    title = "" if method is None else f"<b>{html.escape(METHOD_NAMES[method])}</b> &middot; "
    return (
        f'<figure><a href="{stem}.png"><img src="{stem}.png" width="{width}" height="{height}" alt="{stem}"'
        ' loading="lazy"></a>'
        f'<figcaption>{title}<a href="{stem}.npy">map (.npy)</a></figcaption></figure>'
    )


def write_gallery(out: Path, entries: list[Entry], args: argparse.Namespace, header: list[str]) -> None:
    """index.html, one static page: the model and its accuracy (`header`), then each image's name,
    predictions and true class, then its panel, or with several methods its panels side by side,
    methods in the order given.

    Every label is printed once, as HTML text, and the panel PNGs carry none: text in the page
    reflows, follows the browser's font size and can be searched and copied, where text drawn into
    a panel shrinks with it (gallery.png is the picture with its labels drawn in). Panels scale
    down to their column, so a row fits the window's width without scrolling sideways; on a narrow
    screen an image's panels stack.
    """
    methods = args.method
    what = ", ".join(
        METHOD_NAMES[m] + (f" ({args.head_fusion} fusion, discard {args.discard_ratio})" if m == "attention" else "")
        for m in methods
    )
    several = len(methods) > 1
    sections = "\n".join(
        f'<section>{_caption(entry)}<div class="row">'
        + "".join(_figure(stem, *entry.panel_size, method if several else None) for method, stem in entry.files)
        + "</div></section>"
        for entry in entries
    )
    # one method: as many images a row as fit at 26em or more each; several: an image a row, its
    # methods in equal columns (stacked below 48em)
    images_per_row = "minmax(0, 1fr)" if several else "repeat(auto-fill, minmax(min(100%, 26em), 1fr))"
    page = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>Explanation maps: {html.escape(args.checkpoint)}</title>
<style>
body {{ font-family: sans-serif; margin: 1em; }}
h1 {{ font-size: 1.4em; margin: 0 0 0.3em; }}
.about {{ margin: 0 0 1em; color: #333; overflow-wrap: anywhere; }}
main {{ display: grid; grid-template-columns: {images_per_row}; gap: 1.2em 1.5em; }}
section {{ min-width: 0; }}
.caption {{ margin: 0 0 0.3em; }}
.row {{ display: grid; grid-template-columns: repeat({len(methods)}, minmax(0, 1fr)); gap: 0.8em; }}
@media (max-width: 48em) {{ .row {{ grid-template-columns: minmax(0, 1fr); }} }}
figure {{ margin: 0; min-width: 0; }}
img {{ display: block; max-width: 100%; height: auto; }}
figcaption {{ font-size: 0.9em; margin-top: 0.2em; }}
.right {{ color: #060; }} .wrong {{ color: #b00; }}
</style></head><body>
<h1>Explanation maps</h1>
<p class="about">{html.escape(args.checkpoint)} &middot; {" &middot; ".join(map(html.escape, header))}<br>
{html.escape(what)} &middot; start layer {args.start_layer}
&middot; {len(entries)} images<br>
Each panel: the image as the model saw it | the map (blue low, red high) | the map over the image.
Above it: the top classes with their probabilities, and the true class where it is known
(&#10003; when it is the top one, &#10007; when not).</p>
<main>
{sections}
</main></body></html>
"""
    (out / "index.html").write_text(page)


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("images", nargs="*", help="image files and folders")
    parser.add_argument("--checkpoint", required=True, help="our .ckpt/.safetensors, a timm state dict, or timm:<name>")
    parser.add_argument("--model", help="architecture for a timm-format state dict, e.g. vit_base_patch16_224")
    parser.add_argument("--config", help="a training config whose datamodule supplies the images")
    parser.add_argument("--split", default="val", choices=["train", "val"])
    parser.add_argument("--data-root", help="override the config's data.root")
    parser.add_argument("--limit", type=positive_int, help="only the first N images")
    parser.add_argument("--out", default="runs/rollout/export", help="output folder")
    parser.add_argument(
        "--method",
        type=_methods,
        default=["attention"],
        help=f"one or several of {', '.join(METHODS)}, comma-separated",
    )
    parser.add_argument("--head-fusion", default="mean", choices=["mean", "max", "min"])
    parser.add_argument("--discard-ratio", type=float, default=0.0)
    parser.add_argument("--start-layer", type=int, default=0)
    parser.add_argument("--target", type=int, help="class for gradient and gradcam (default: the predicted one)")
    parser.add_argument("--topk", type=positive_int, default=3, help="predicted classes shown per image")
    parser.add_argument("--class-names", help="a text file with one class name per line")
    parser.add_argument("--crop-pct", type=float, help="eval centre crop (default: the checkpoint's, else 1.0)")
    parser.add_argument("--mean", type=float, nargs=3, help="default: the checkpoint's, else ImageNet's")
    parser.add_argument("--std", type=float, nargs=3, help="default: the checkpoint's, else ImageNet's")
    parser.add_argument(
        "--accuracy", help="the accuracy gallery.png states, e.g. '75.7%% test top-1' (default: the checkpoint's)"
    )
    parser.add_argument("--panel-size", type=positive_int, default=224, help="pixels per panel in the PNGs")
    parser.add_argument(
        "--sheet-size", type=int, default=96, help="pixels per cell of gallery.png (every image x method on one page)"
    )
    parser.add_argument("--batch-size", type=positive_int, default=32)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    try:
        out = export(args)
    except (FileNotFoundError, ValueError, TypeError) as e:  # bad input: the message names the file
        parser.exit(2, f"error: {e}\n")
    print(f"wrote {out / 'index.html'} and {out / 'gallery.png'}")
    return out


def cli() -> None:
    """The `vit-rollout` command (an entry point's return value would become the exit status)."""
    main()


if __name__ == "__main__":
    cli()
