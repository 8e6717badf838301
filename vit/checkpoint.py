"""Loading weights: a model from any source, and any weights into a model.

One entry point, `load_pretrained(model, source)`, takes any of
  - our Lightning checkpoints (`.ckpt`, written by scripts/train.py),
  - timm-format state dicts (`.pth`, `.pt`, `.bin`, `.th`, `.safetensors`),
  - `timm:<model name>` (timm's pretrained weights; needs the network),
  - Google's original ViT `.npz` files (read by timm's converter),
and adapts the weights to the model (vit.adapt): the position embedding is resampled to the model's
patch grid, the head is re-initialised for a new class count, and the CLS token / final norm follow a
switch between CLS and average pooling. Every key that is resampled, re-initialised, renamed or
dropped is logged by name; a mismatch that cannot be adapted is an error naming the key and both
shapes. The training config calls it as `--model.finetune.init_from PATH_OR_NAME`. `load_model`
builds the model too, from our checkpoints alone or from a name.

The parts, each in its own module and importable from here: reading and writing checkpoint files
safely (vit.checkpoint_files), where weights come from (vit.weights), fitting them to a model
(vit.adapt), the classifier head's names (vit.heads), evaluation's preprocessing (vit.data.preprocess).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from torch import nn

from vit.adapt import LoadReport, WeightsMismatchError, adapt_state_dict, checkpoint_filter_fn
from vit.checkpoint_files import (
    RecordedScore,
    UnreadableCheckpointError,
    export_safetensors,
    model_weights,
    read_lightning_checkpoint,
    read_state_dict,
    recorded_score,
    safetensors_model_meta,
    torch_load,
)
from vit.data.preprocess import Preprocess
from vit.heads import HEAD_NAMES, is_head
from vit.registry import create_model
from vit.vision_transformer import VisionTransformer
from vit.weights import (
    PretrainedDownloadError,
    hub_reachable,
    load_npz,
    read_weights,
    timm_preprocessing,
    timm_weights_unavailable,
)

log = logging.getLogger(__name__)

_torch_load = torch_load  # the name tests/test_missing_data.py imports

__all__ = [
    "HEAD_NAMES",
    "LoadReport",
    "Preprocess",
    "PretrainedDownloadError",
    "RecordedScore",
    "UnreadableCheckpointError",
    "WeightsMismatchError",
    "adapt_state_dict",
    "checkpoint_filter_fn",
    "export_safetensors",
    "hub_reachable",
    "is_head",
    "load_checkpoint",
    "load_model",
    "load_model_and_meta",
    "load_npz",
    "load_pretrained",
    "read_lightning_checkpoint",
    "read_state_dict",
    "read_weights",
    "recorded_score",
    "timm_preprocessing",
    "timm_weights_unavailable",
]


def load_checkpoint(path: str | Path, use_ema: bool = False) -> tuple[nn.Module, dict]:
    """Our `.ckpt` (or a `.safetensors` from `export_safetensors`) as its model, in eval mode, and the
    run's metadata (`model_name`, `model_kwargs`, and what the task stored: an image classifier's
    `class_names` in label order when its data named them and its data's evaluation settings as
    `preprocess` (`Preprocess.to_dict`), a GPT's `vocab`).

    `use_ema=True` loads the exponential-moving-average weights, when the run kept them.
    """
    path = Path(path)
    if path.suffix == ".safetensors":
        meta, state_dict = safetensors_model_meta(path), read_state_dict(path)
    else:
        checkpoint = read_lightning_checkpoint(path)
        meta, state_dict = checkpoint["vit"], model_weights(checkpoint, path, use_ema)
    model = create_model(meta["model_name"], **meta["model_kwargs"])
    model.load_state_dict(state_dict, strict=True)
    return model.eval(), meta


def load_model(
    source: str | Path, model_name: str | None = None, use_ema: bool = False, **model_kwargs: Any
) -> nn.Module:
    """Any weights as a model in eval mode; the one loader behind the scripts.

    - our `.ckpt` or exported `.safetensors`: rebuilt from the file alone (`model_name` not needed);
    - `timm:<name>`: timm's pretrained weights for our model of that name (or `model_name`);
    - a timm-format state dict or Google `.npz`: give `model_name` (and `model_kwargs` where the
      file differs from that name's defaults); the class count follows the file's head, and the
      weights are adapted as `load_pretrained` does.
    """
    return load_model_and_meta(source, model_name, use_ema, **model_kwargs)[0]


def load_model_and_meta(
    source: str | Path, model_name: str | None = None, use_ema: bool = False, **model_kwargs: Any
) -> tuple[nn.Module, dict[str, Any]]:
    """`load_model`'s model, and the run's metadata where the source is our `.ckpt` or `.safetensors`
    (`load_checkpoint`'s: class names, preprocessing); for timm's weights, the preprocessing timm's
    pretrained config gives them at the model's size (`timm_preprocessing`); else {}."""
    text = str(source)
    if text.startswith("timm:"):
        model = create_model(model_name or text.removeprefix("timm:"), **model_kwargs)
        load_pretrained(model, text)
        return model.eval(), _timm_meta(model, text, model_name or text.removeprefix("timm:"))
    path = Path(source)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    if model_name is None:
        try:
            return load_checkpoint(path, use_ema)
        except UnreadableCheckpointError:
            raise
        except ValueError as e:
            raise ValueError(f"{e}. For a timm-format state dict, give the architecture (model_name)") from e
    state_dict = read_weights(path) if path.suffix != ".npz" else {}  # an .npz is read for a built model
    head = next((f"{name}.weight" for name in HEAD_NAMES if f"{name}.weight" in state_dict), None)
    if head is not None:  # the class count follows the file's classifier (head, fc or linear)
        model_kwargs.setdefault("num_classes", state_dict[head].shape[0])
    elif path.suffix != ".npz":  # a backbone without a classifier (DINOv3's releases): its pooled features
        model_kwargs.setdefault("num_classes", 0)
    model = create_model(model_name, **model_kwargs)
    load_pretrained(model, path, use_ema=use_ema, model_name=model_name)
    return model.eval(), _timm_meta(model, path, model_name)


def _timm_meta(model: nn.Module, source: str | Path, model_name: str) -> dict[str, Any]:
    """{"preprocess": ...} of timm's weights at the model's image size, or {} where timm has none."""
    found = timm_preprocessing(source, model_name)
    size = getattr(getattr(model, "config", None), "img_size", None)
    if found is None or size is None:
        return {}
    weights, where = found
    log.info("preprocessing of %s: %s", source, where)
    side = size if isinstance(size, int) else size[0]
    return {
        "preprocess": Preprocess(side, weights["crop_pct"], tuple(weights["mean"]), tuple(weights["std"])).to_dict()
    }


def _describe(model: nn.Module, name: str | None = None) -> str:
    """The model as an error names it: its registry name where known, its class and size."""
    config = getattr(model, "config", None)
    size = [f"{field} {getattr(config, field)}" for field in ("embed_dim", "depth") if hasattr(config, field)]
    kind = ", ".join([type(model).__name__, *size])
    return f"{name} ({kind})" if name else f"the model ({kind})"


def _recorded_model_name(source: str | Path) -> str | None:
    """The architecture a source names: timm:<name>'s, or the model name our .ckpt or .safetensors
    records; None for a file that records none."""
    text, path = str(source), Path(source)
    if text.startswith("timm:"):
        return text.removeprefix("timm:")
    try:
        if path.suffix == ".safetensors":
            return safetensors_model_meta(path)["model_name"]
        if path.suffix == ".ckpt":
            return read_lightning_checkpoint(path)["vit"]["model_name"]
    except (ValueError, KeyError, TypeError):  # a file without our metadata
        return None
    return None


def load_pretrained(
    model: nn.Module, source: str | Path, use_ema: bool = False, model_name: str | None = None
) -> LoadReport:
    """Load weights from `source` into `model`, adapting them (see `adapt_state_dict`); logs and
    returns what was resampled, re-initialised, renamed or dropped. Weights that do not fit are a
    WeightsMismatchError naming the source, the model (`model_name`, where the caller knows it) and
    the architecture the source records."""
    state_dict = read_weights(source, model, use_ema=use_ema)
    try:
        adapted, report = adapt_state_dict(state_dict, model)
    except WeightsMismatchError as e:
        held = _recorded_model_name(source)
        held = f" (weights of {held})" if held else ""
        raise WeightsMismatchError(e.details, f"{source}{held} does not fit {_describe(model, model_name)}") from None
    model.load_state_dict(adapted, strict=True)
    report.log(str(source))
    rotary = _rotary_positions(model)
    if rotary:
        log.info("%s: %s", source, rotary)
    return report


def _rotary_positions(model: nn.Module) -> str | None:
    """What a model with rotary position embeddings needs at a new grid: nothing, as its tables are
    computed for the input's grid at every forward; said so the load report's silence is not a question."""
    config = getattr(model, "config", None)
    if not isinstance(model, VisionTransformer) or not (
        getattr(config, "use_rot_pos_emb", False) or getattr(config, "posemb", None) == "rope"
    ):
        return None
    h, w = model.patch_embed.grid_size
    tables = f"the rotary tables follow the patch grid ({h}x{w}), computed at every forward"
    # EVA-02 keeps a learned pos_embed beside its rotary one (resampled above); DINOv3 has none.
    return tables if "pos_embed" in model.state_dict() else f"no pos_embed to resample: {tables}"
