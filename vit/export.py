"""ONNX export of our image classifiers (ViTs, ResNets) with a dynamic batch and image size, and the
check that onnxruntime's logits equal ours.

`export_onnx` uses PyTorch's dynamo exporter (`torch.onnx.export(..., dynamo=True)`, which traces the
model with `torch.export`). The batch, height and width are symbolic in the graph: height and width
are any multiple of the patch size for a ViT, any size for a ResNet.

A ViT with a learned position embedding (`posemb="learn"`) resamples it to the input's patch grid at
run time, as `dynamic_img_size=True` does (bicubic, antialiased: timm's `resample_abs_pos_embed`),
so the exported model gives the PyTorch model's logits at any size, as if that model had been built
with `dynamic_img_size=True`; at the training size the resampling is an identity. In ONNX this is a
`Resize` with `antialias=1`, which needs opset 18 or later. `posemb="sincos2d"` and `"rope"` are
computed in closed form for every grid. NaFlexViT resamples its own tables (`embeds`) to each grid, as
timm's does. SAM and the relative-position ViTs lay their windows and relative positions on the input's
grid, as with `dynamic_img_size=True` (SAM's tables resampled, relpos's MLP evaluated at the grid's
offsets); only a table of relative-position biases (`rel_pos_type="bias"`, no timm name) holds one grid's
offsets and exports with `dynamic=False`, at its img_size (the batch stays free).

`inputs="patches"` exports a NaFlexViT's patch-sequence form instead: `patches` (B, N, ph*pw*C),
`patch_coord` (B, N, 2) and `patch_valid` (B, N), batch and sequence length free (vit.naflex.pack makes
them), so one file takes images of any aspect ratio in sequences of any length. The positions are
computed per token (NaFlexEmbeds.token_positions), as the graph cannot loop over each image's grid.

The file's metadata_props say how to feed it: the input's channels and size multiple, and, where
the export was given them, the evaluation preprocessing (`vit.eval_img_size`, `vit.eval_crop_pct`,
`vit.eval_interpolation`, `vit.mean`, `vit.std`; for a run with `data.naflex`, its patch budget
`vit.eval_max_patches` and `vit.eval_patch_size`) and `vit.class_names` (JSON), so a bare onnxruntime
session can prepare images and name its predictions (docs/export.md). A patch-sequence file adds
`vit.input` ("patches"), `vit.patch_size` and `vit.max_patches`, the length OnnxClassifier packs to.

`OnnxClassifier` runs an exported file with onnxruntime and refuses, with the reason, images that do
not fit it; `max_abs_diff` compares it with the PyTorch model on a batch. `scripts/export.py` does
both for any weights `vit.checkpoint.load_model` reads.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import json
import logging
import os
import shutil
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torchvision
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from vit.data.augment import EVAL_RESIZE
from vit.data.preprocess import Preprocess
from vit.layers.patch import _pair
from vit.naflex import NaFlexVit, pack
from vit.resnet import CifarResNet
from vit.vision_transformer import VisionTransformer

log = logging.getLogger(__name__)

OPSET = 18  # the first opset whose Resize has `antialias` (the ViT's position-embedding resampling)
MAX_SIZE = 8192  # the largest height or width the exported graph is declared for
INPUTS = ("images", "patches")  # what an export takes: image batches, or NaFlex's patch sequences


@dataclasses.dataclass(frozen=True)
class ImageSpec:
    """What the exported graph accepts: channels, a size multiple, and the fixed size of a static export."""

    in_chans: int
    multiple: tuple[int, int]  # height and width must be multiples of these
    img_size: tuple[int, int]  # the export size: the only one a static export takes
    dynamic: bool

    def metadata(self) -> dict[str, str]:
        return {
            "vit.in_chans": str(self.in_chans),
            "vit.size_multiple": f"{self.multiple[0]},{self.multiple[1]}",
            "vit.img_size": f"{self.img_size[0]},{self.img_size[1]}",
            "vit.dynamic": str(int(self.dynamic)),
        }

    @classmethod
    def from_metadata(cls, props: dict[str, str]) -> ImageSpec | None:
        if "vit.in_chans" not in props:
            return None
        pair = lambda text: tuple(int(v) for v in text.split(","))  # noqa: E731
        return cls(
            int(props["vit.in_chans"]), pair(props["vit.size_multiple"]), pair(props["vit.img_size"]),
            props["vit.dynamic"] == "1",
        )  # fmt: skip

    def check(self, shape: tuple[int, ...]) -> None:
        """Raise ValueError, saying why, for an image batch shape the graph does not take."""
        if len(shape) != 4:
            raise ValueError(f"expected images of shape (batch, {self.in_chans}, height, width), got {shape}")
        _, chans, height, width = shape
        if chans != self.in_chans:
            raise ValueError(f"expected {self.in_chans} channels (batch, {self.in_chans}, H, W), got shape {shape}")
        if not self.dynamic and (height, width) != self.img_size:
            raise ValueError(
                f"this model was exported with a fixed image size {self.img_size[0]}x{self.img_size[1]}, got "
                f"{height}x{width}; resize the images or export again with a dynamic size"
            )
        in_range = 0 < height <= MAX_SIZE and 0 < width <= MAX_SIZE
        if height % self.multiple[0] or width % self.multiple[1] or not in_range:
            raise ValueError(
                f"image size {height}x{width} is not a positive multiple of the patch size "
                f"{self.multiple[0]}x{self.multiple[1]} (up to {MAX_SIZE}); resize or crop the images"
            )


@dataclasses.dataclass(frozen=True)
class SequenceSpec:
    """A patch-sequence file's input (export_onnx's inputs="patches"): images of `patch_size` multiples
    packed by vit.naflex.pack into sequences of `max_patches`, the padding after each image's patches."""

    patch_size: tuple[int, int]
    max_patches: int

    def metadata(self) -> dict[str, str]:
        return {
            "vit.input": "patches",
            "vit.patch_size": f"{self.patch_size[0]},{self.patch_size[1]}",
            "vit.max_patches": str(self.max_patches),
        }

    @classmethod
    def from_metadata(cls, props: dict[str, str]) -> SequenceSpec | None:
        if props.get("vit.input") != "patches":
            return None
        return cls(tuple(int(v) for v in props["vit.patch_size"].split(",")), int(props["vit.max_patches"]))

    def check(self, height: int, width: int) -> None:
        """Raise ValueError, saying why, for an image of more patches than the sequences hold."""
        (ph, pw), patches = self.patch_size, (height // self.patch_size[0]) * (width // self.patch_size[1])
        if patches > self.max_patches:
            raise ValueError(
                f"a {height}x{width} image is {patches} patches of {ph}x{pw}, more than this file's sequences "
                f"hold (vit.max_patches = {self.max_patches}); resize the images, or export again with a larger "
                "max_patches"
            )

    def pack(self, images: np.ndarray) -> dict[str, np.ndarray]:
        """Images (B, C, H, W), multiples of the patch size, as the graph's inputs."""
        self.check(*images.shape[-2:])
        batch = pack([torch.from_numpy(image) for image in images], self.patch_size, length=self.max_patches)
        return {name: value.numpy() for name, value in batch.items()}


def preprocess_metadata(preprocess: Preprocess) -> dict[str, str]:
    """The evaluation preprocessing as metadata_props: plain numbers, comma-separated; a patch budget
    as vit.eval_max_patches and vit.eval_patch_size."""
    metadata = {
        "vit.eval_img_size": str(preprocess.img_size),
        "vit.eval_crop_pct": repr(preprocess.crop_pct),
        "vit.eval_interpolation": EVAL_RESIZE,
        "vit.mean": ",".join(map(repr, preprocess.mean)),
        "vit.std": ",".join(map(repr, preprocess.std)),
    }
    if preprocess.max_patches is not None:
        metadata |= {
            "vit.eval_max_patches": str(preprocess.max_patches),
            "vit.eval_patch_size": str(preprocess.patch_size),
        }
    return metadata


def preprocess_from_metadata(props: dict[str, str]) -> Preprocess | None:
    if "vit.eval_img_size" not in props:
        return None
    floats = lambda text: [float(v) for v in text.split(",")]  # noqa: E731
    values = {"img_size": props["vit.eval_img_size"], "crop_pct": props["vit.eval_crop_pct"]}
    values |= {"max_patches": props.get("vit.eval_max_patches"), "patch_size": props.get("vit.eval_patch_size")}
    return Preprocess.from_dict({**values, "mean": floats(props["vit.mean"]), "std": floats(props["vit.std"])})


def image_spec(
    model: nn.Module, img_size: int | tuple[int, int] | None = None, dynamic: bool = True, inputs: str = "images"
) -> ImageSpec:
    """The images `model` takes (`inputs="patches"`: the images a NaFlexViT's patch sequences are packed
    from, multiples of its patch size); `img_size` defaults to the ViT's own, 32 for CIFAR ResNets, else 224."""
    if inputs not in INPUTS:
        raise ValueError(f"inputs must be one of {INPUTS}, got {inputs!r}")
    if inputs == "patches" and not (isinstance(model, NaFlexVit) and model.embeds.linear):
        raise ValueError(
            f"inputs='patches' exports a NaFlexViT's patch-sequence form (embed_proj_type='linear'); "
            f"{type(model).__name__} takes images only"
        )
    if inputs == "patches" and not dynamic:
        raise ValueError("a patch-sequence export has a free batch and sequence length: dynamic=False is for images")
    if isinstance(model, NaFlexVit):  # its embedding replaces patch_embed; with dynamic_img_pad any size is padded
        embeds, in_chans = model.embeds, model.config.in_chans
        padded = embeds.dynamic_img_pad and inputs == "images"
        multiple, default = (1, 1) if padded else embeds.patch_size, _pair(model.config.img_size)
    elif isinstance(model, VisionTransformer):
        multiple, in_chans, default = model.patch_embed.patch_size, model.config.in_chans, model.patch_embed.img_size
    elif isinstance(model, (CifarResNet, torchvision.models.ResNet)):
        multiple, in_chans = (1, 1), model.conv1.in_channels
        default = (32, 32) if isinstance(model, CifarResNet) else (224, 224)
    else:
        raise TypeError(
            f"export_onnx exports image classifiers (VisionTransformer, the ResNets of vit.resnet), not "
            f"{type(model).__name__}"
        )
    size = default if img_size is None else (img_size, img_size) if isinstance(img_size, int) else img_size
    spec = ImageSpec(in_chans, tuple(multiple), tuple(size), dynamic)
    spec.check((1, in_chans, *size))
    return spec


def _fixed_grid(model: nn.Module) -> bool:
    """Whether the model takes one patch grid only: a table of relative-position biases holds the built grid's
    offsets (rel_pos_type="bias"; the config refuses dynamic_img_size with it)."""
    return isinstance(model, VisionTransformer) and model.config.rel_pos_type == "bias"


def _dynamic_vit(model: VisionTransformer) -> VisionTransformer:
    """A copy of the ViT that takes any grid (same weights): its learned position embedding resampled,
    relative positions and windows laid on the input's grid, as with dynamic_img_size=True."""
    c = model.config
    grid_bound = c.posemb == "learn" or c.rel_pos_type or c.window_size
    if not grid_bound or c.dynamic_img_size or _fixed_grid(model):
        return model
    log.info("export: positions and windows follow the input's grid (dynamic_img_size=True)")
    model = copy.copy(model)  # shares the modules and weights; only the config differs
    model.config = dataclasses.replace(model.config, dynamic_img_size=True)
    return model


def _naflex_trace_size(model: NaFlexVit, size: tuple[int, int], multiple: tuple[int, int]) -> tuple[int, int]:
    """A size whose patch rows and columns both differ from the lengths of NaFlex's position tables, which
    have their own grid (pos_embed_grid_size): on theirs the tables are used as stored, a branch the trace
    would bake in."""
    embeds = model.embeds
    tables = [t for t in (embeds.pos_embed, embeds.pos_embed_y, embeds.pos_embed_x) if t is not None]
    lengths = {n for t in tables for n in t.shape[1:-1]}
    while set(embeds.dynamic_feat_size(size)) & lengths:
        size = (size[0] + multiple[0], size[1] + multiple[1])
    return size


def export_onnx(
    model: nn.Module,
    path: str | os.PathLike,
    img_size: int | tuple[int, int] | None = None,
    dynamic: bool = True,
    opset: int = OPSET,
    preprocess: Preprocess | None = None,
    class_names: list[str] | None = None,
    inputs: str = "images",
    max_patches: int | None = None,
) -> Path:
    """Write `model` (in eval mode, float32, on the CPU) as an ONNX file taking `images` (B, C, H, W)
    and giving `logits` (B, classes).

    `dynamic=True`: batch, height and width are free (height and width multiples of a ViT's patch
    size). `dynamic=False`: the graph takes `img_size` (default: the model's) and any batch.
    `preprocess` and `class_names` (a checkpoint's: `vit.checkpoint.load_checkpoint`) go into the
    file's metadata, for whoever runs it to prepare images and name the classes.
    `inputs="patches"` (a NaFlexViT): the graph takes `patches`, `patch_coord` and `patch_valid`
    (vit.naflex.pack's batch), batch and sequence length free; `max_patches` (default: img_size's
    patches) is the length OnnxClassifier packs images to, written into the metadata; a `preprocess`
    with a patch budget (a run with data.naflex) needs this form and a max_patches of at least its budget.
    """
    spec = image_spec(model, img_size, dynamic, inputs)
    sequence = None
    if max_patches is not None and (inputs != "patches" or max_patches < 1):
        raise ValueError(f"max_patches ({max_patches}) is a positive sequence length, for inputs='patches' only")
    if inputs == "patches":
        max_patches = max_patches or (spec.img_size[0] // spec.multiple[0]) * (spec.img_size[1] // spec.multiple[1])
        sequence = SequenceSpec(spec.multiple, max_patches)
    if preprocess is not None and preprocess.max_patches is not None:  # its images: each at its own aspect ratio
        if sequence is None or (preprocess.patch_size,) * 2 != sequence.patch_size:
            raise ValueError(
                f"the preprocessing packs each image into at most {preprocess.max_patches} patches of "
                f"{preprocess.patch_size} px, which only a patch-sequence export of that patch size takes "
                "(inputs='patches'); give the square preprocessing (max_patches=None) for an image export"
            )
        if preprocess.max_patches > sequence.max_patches:
            raise ValueError(
                f"max_patches ({sequence.max_patches}) is shorter than the preprocessing's budget of "
                f"{preprocess.max_patches} patches an image: give at least {preprocess.max_patches}"
            )
    elif preprocess is not None:  # the graph must take the images the preprocessing makes
        spec.check((1, spec.in_chans, preprocess.img_size, preprocess.img_size))
        if sequence is not None:
            sequence.check(preprocess.img_size, preprocess.img_size)
    if isinstance(model, VisionTransformer) and model.config.num_experts > 1:
        raise ValueError(
            "a mixture-of-experts ViT cannot be exported: its routing loops over experts with data-dependent "
            "token counts (vit.layers MoE.forward), which torch.export cannot trace"
        )
    if dynamic and _fixed_grid(model):
        grid = model.patch_embed.grid_size
        raise ValueError(
            f"{type(model).__name__}'s relative-position bias table (rel_pos_type='bias') holds its "
            f"{grid[0]}x{grid[1]} patch grid's offsets only: export it with dynamic=False (scripts/export.py "
            "--static), at its img_size"
        )
    model = copy.deepcopy(model).float().cpu().eval()
    size = spec.img_size
    if isinstance(model, VisionTransformer) and dynamic and sequence is None:
        naflex_resize = (
            isinstance(model, NaFlexVit) and model.embeds.pos_embed is not None and model.embeds.interp["antialias"]
        )
        if (model.config.posemb == "learn" or naflex_resize) and opset < OPSET:
            raise ValueError(
                f"opset {opset} has no antialiased Resize, which the ViT's position-embedding resampling needs; "
                f"use opset >= {OPSET}, or dynamic=False"
            )
        model = _dynamic_vit(model)
        # Trace on a grid other than img_size's: on that grid the model returns its stored position
        # embedding without resampling, a Python branch the trace would bake in for every size.
        size = (spec.img_size[0] + spec.multiple[0], spec.img_size[1] + spec.multiple[1])
        if isinstance(model, NaFlexVit):
            size = _naflex_trace_size(model, size, spec.multiple)
    images = torch.randn(2, spec.in_chans, *size)  # batch 2: a batch of 1 would be specialised to 1
    batch = torch.export.Dim("batch", min=1, max=65536)
    shapes = {0: batch}
    if dynamic:
        shapes[2] = torch.export.Dim("height", min=1, max=MAX_SIZE // spec.multiple[0]) * spec.multiple[0]
        shapes[3] = torch.export.Dim("width", min=1, max=MAX_SIZE // spec.multiple[1]) * spec.multiple[1]
        if spec.multiple == (1, 1):  # Dim * 1 is not a derived dimension: use the plain ones
            shapes[2], shapes[3] = (torch.export.Dim(n, min=1, max=MAX_SIZE) for n in ("height", "width"))
    example, input_names, all_shapes = (images,), ["images"], (shapes,)
    if sequence is not None:
        example, input_names, all_shapes = _sequence_example(spec, batch)
    trace = functools.partial(_trace, model, example, all_shapes, input_names)
    program = trace(opset)
    if _opset_of(program.model) != opset:
        # The exporter keeps its graph's own opset where its conversion fails, saying so in a log only. Above
        # OPSET it translates at the opset asked; its graph at OPSET may still convert (onnx's converter).
        native = program if opset < OPSET else trace(OPSET)
        converted = _converted(native.model, opset)
        if converted is None:
            low, high = _opset_range(native.model)
            raise ValueError(
                f"opset {opset}: torch's exporter cannot convert {type(model).__name__}'s graph to it; this model "
                f"exports at opsets {low} to {high}"
            )
        program = native
        program.model = converted
    metadata = spec.metadata() | (sequence.metadata() if sequence is not None else {})
    if preprocess is not None:
        metadata.update(preprocess_metadata(preprocess))
    if class_names is not None:
        metadata["vit.class_names"] = json.dumps(list(class_names))
    program.model.metadata_props.update(metadata)
    return save_atomically(Path(path), program.save)


def output_name(model: nn.Module) -> str:
    """`logits` of a classifier; `features` (the pooled embedding) of a model without a head (num_classes 0)."""
    return "features" if getattr(model, "num_classes", None) == 0 else "logits"


def _trace(model: nn.Module, example: tuple, shapes: tuple, input_names: list[str], opset: int) -> Any:
    """torch's dynamo exporter's ONNXProgram of `model` on `example`; its graph may declare another opset
    than the one asked (export_onnx checks)."""
    # SDPA's math kernel: with a mask, the CPU's fused kernel is traced with an output layout its ONNX
    # decomposition (math) does not keep, and the view after it fails (SAM's, relpos's biases).
    with warnings.catch_warnings(), sdpa_kernel(SDPBackend.MATH), _conversion_logs_quiet():
        for category in (UserWarning, DeprecationWarning, FutureWarning):  # the tracer's notes on torch internals
            warnings.simplefilter("ignore", category)
        try:
            return torch.onnx.export(
                model, example, dynamo=True, dynamic_shapes=shapes, opset_version=opset,
                input_names=input_names, output_names=[output_name(model)], verbose=False,
            )  # fmt: skip
        except Exception as e:  # the exporter wraps torch.export's and the translator's errors
            raise RuntimeError(f"ONNX export of {type(model).__name__} failed: {e}") from e


@contextlib.contextmanager
def _conversion_logs_quiet() -> Iterator[None]:
    """The exporter logs a failed opset conversion (with a traceback) and goes on with the graph's own
    opset; export_onnx checks the opset itself and says so in one line."""
    names = ("onnxscript.version_converter", "torch.onnx._internal.exporter._compat")
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def _opset_of(graph: Any) -> int | None:
    """The ONNX opset (default domain) an exported onnx_ir model declares."""
    return graph.opset_imports.get("")


def _converted(graph: Any, opset: int) -> Any | None:
    """A copy of an exported onnx_ir model converted to `opset` as the exporter converts (onnxscript's
    converter, onnx's where that does not reach), or None where it cannot be."""
    from onnxscript import ir
    from onnxscript.version_converter import convert_version

    converted = ir.from_proto(ir.to_proto(graph))
    with _conversion_logs_quiet():
        try:
            convert_version(converted, opset, fallback=True)
        except Exception:  # onnxscript's converter raises where an op has no adapter; onnx's is only logged
            return None
    return converted if _opset_of(converted) == opset else None


def _opset_range(graph: Any) -> tuple[int, int]:
    """The lowest and highest opsets an exported graph at OPSET converts to: the converters go one opset
    at a time, so those it reaches are one run of opsets."""
    low = high = _opset_of(graph)
    while low > 1 and _converted(graph, low - 1) is not None:
        low -= 1
    while _converted(graph, high + 1) is not None:
        high += 1
    return low, high


def _sequence_example(spec: ImageSpec, batch: torch.export.Dim) -> tuple[tuple, list[str], tuple]:
    """A patch-sequence batch to trace with, its input names and dynamic shapes: two images of different
    aspect ratios (2x3 and 1x2 patches), padded to 7 patches, so no grid or length is a special one."""
    (ph, pw), chans = spec.multiple, spec.in_chans
    images = [torch.randn(chans, 2 * ph, 3 * pw), torch.randn(chans, ph, 2 * pw)]
    packed = pack(images, spec.multiple, length=7)
    names = ["patches", "patch_coord", "patch_valid"]
    length = torch.export.Dim("patches", min=1, max=(MAX_SIZE // ph) * (MAX_SIZE // pw))
    return tuple(packed[n] for n in names), names, tuple({0: batch, 1: length} for _ in names)


def save_atomically(path: Path, save: Callable[[Path], Any]) -> Path:
    """`save(file)` into a temporary folder beside `path`, then move what it wrote into place, `path`
    last (an ONNX model over protobuf's 2 GB writes its weights beside it, named after it): a full
    disk or a kill leaves the previous file, never a truncated one, under the requested name, and
    no temporary file; a failure is an OSError naming `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        save(tmp / path.name)
        for written in sorted(tmp.iterdir(), key=lambda p: p.name == path.name):  # `path` last
            os.replace(written, path.parent / written.name)
    except OSError as e:
        raise OSError(e.errno, f"could not write {path}: {e.strerror or e}") from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


class OnnxClassifier:
    """An exported file run by onnxruntime on the CPU: images (B, C, H, W) -> logits, as numpy.

    `preprocess` and `class_names` are what the file's metadata says (None where it does not);
    `prepare` turns RGB images into the inputs its preprocessing describes. A patch-sequence file
    (`sequence`, from its metadata) is fed images packed into max_patches-long sequences, or a
    vit.naflex.pack batch (a dict) as it is."""

    def __init__(self, path: str | os.PathLike) -> None:
        import onnxruntime as ort

        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"ONNX file {path} does not exist")
        try:
            self.session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        except Exception as e:  # onnxruntime's errors (InvalidProtobuf, ...) derive from Exception alone
            raise ValueError(f"onnxruntime cannot load {path}: {e}") from e
        self.input_name = self.session.get_inputs()[0].name
        props = self.session.get_modelmeta().custom_metadata_map
        self.path = path
        self.spec = ImageSpec.from_metadata(props)
        self.sequence = SequenceSpec.from_metadata(props)
        names = [i.name for i in self.session.get_inputs()]
        if self.sequence is None and len(names) > 1:
            raise ValueError(
                f"{path} takes {', '.join(names)}, and its metadata has no vit.input='patches' (with vit.patch_size "
                "and vit.max_patches) saying how images are packed into them: export it with vit-export --input "
                "patches, or run it with onnxruntime yourself"
            )
        self.preprocess = preprocess_from_metadata(props)
        self.class_names: list[str] | None = (
            json.loads(props["vit.class_names"]) if "vit.class_names" in props else None
        )

    def prepare(self, images: list[np.ndarray]) -> np.ndarray | dict[str, np.ndarray]:
        """RGB uint8 images (H, W, 3), any sizes, as the file's inputs: float32 (B, 3, S, S), prepared
        as evaluation prepares them (vit.data.transforms.eval_transform with the file's settings); with a
        patch budget in the metadata, vit.naflex.pack's batch of each image at its own aspect ratio."""
        if self.preprocess is None:
            raise ValueError(
                f"{self.path} does not say how to prepare images (no vit.eval_img_size in its metadata): "
                "export it from a checkpoint of ours with vit-export, or normalise the images yourself"
            )
        prepared = self.preprocess(images)
        if isinstance(prepared, dict):
            return {name: value.numpy() for name, value in prepared.items()}
        return prepared.numpy()

    def __call__(self, images: torch.Tensor | np.ndarray | dict[str, torch.Tensor]) -> np.ndarray:
        """Logits of images (B, C, H, W), or, for a patch-sequence file, of vit.naflex.pack's batch."""
        if isinstance(images, dict):
            if self.sequence is None:
                raise ValueError(f"{self.path} takes images (B, C, H, W), not patch sequences")
            dtypes = {"patches": np.float32, "patch_coord": np.int64, "patch_valid": np.bool_}
            return self.session.run(None, {n: np.asarray(images[n]).astype(t) for n, t in dtypes.items()})[0]
        images = images.detach().cpu().numpy() if isinstance(images, torch.Tensor) else np.asarray(images)
        if self.spec is not None:
            self.spec.check(tuple(images.shape))
        if not np.issubdtype(images.dtype, np.floating):
            raise ValueError(f"expected float images (normalised, float32), got dtype {images.dtype}")
        images = images.astype(np.float32, copy=False)
        if self.sequence is not None:
            return self.session.run(None, self.sequence.pack(images))[0]
        return self.session.run(None, {self.input_name: images})[0]


def max_abs_diff(model: nn.Module, onnx_model: OnnxClassifier, images: torch.Tensor | dict[str, torch.Tensor]) -> float:
    """The largest |onnxruntime logit - PyTorch logit| over a batch of images, or of patch sequences
    (vit.naflex.pack's dict); the PyTorch model runs as exported (eval mode, float32, positions and
    windows following the images' grid)."""
    model = copy.deepcopy(model).float().cpu().eval()
    if isinstance(model, VisionTransformer):
        model = _dynamic_vit(model)
    with torch.no_grad():
        expected = model(images if isinstance(images, dict) else images.float()).numpy()
    return float(np.abs(onnx_model(images) - expected).max())
