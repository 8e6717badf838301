"""Loading weights: reading checkpoint files safely, adapting them to a model, exporting ours.

One entry point, `load_pretrained(model, source)`, takes any of
  - our Lightning checkpoints (`.ckpt`, written by scripts/train.py),
  - timm-format state dicts (`.pth`, `.pt`, `.bin`, `.th`, `.safetensors`),
  - `timm:<model name>` (timm's pretrained weights; needs the network),
  - Google's original ViT `.npz` files (read by timm's converter),
and adapts the weights to the model: the position embedding is resampled to the model's patch
grid, the head is re-initialised for a new class count, and the CLS token / final norm follow a
switch between CLS and average pooling. Every key that is resampled, re-initialised, renamed or
dropped is logged by name; a mismatch that cannot be adapted is an error naming the key and both
shapes. The training config calls it as `--model.finetune.init_from PATH_OR_NAME`.

Checkpoint files are untrusted input: a pickle can run arbitrary code when it is loaded, so we
only use `torch.load(weights_only=True)` (tensors, dicts, numbers, strings) or safetensors.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import pickle
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from timm.layers import resample_abs_pos_embed, resample_abs_pos_embed_nhwc
from torch import nn

from vit.naflex import Inputs
from vit.position import resample_rel_pos
from vit.registry import create_model
from vit.timm_args import timm_kwargs
from vit.vision_transformer import VisionTransformer

log = logging.getLogger(__name__)

# Wrappers that training scripts put around a state dict, outermost first.
_NESTED_KEYS = ("state_dict", "model", "model_state_dict", "module")
_TORCH_SUFFIXES = (".pth", ".pt", ".bin", ".th", ".tar")


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of a checkpoint file as a flat state dict on the CPU.

    Accepts `.safetensors` and torch files (`.pth`, `.pt`, `.bin`, `.th`, `.ckpt`); unwraps
    `{"state_dict": ...}`-style containers and strips a DataParallel/DDP `module.` prefix.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        with _safetensors_read(path):
            return load_file(str(path), device="cpu")
    obj = _torch_load(path)
    for key in _NESTED_KEYS:
        if isinstance(obj, dict) and isinstance(obj.get(key), dict):
            obj = obj[key]
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise ValueError(f"{path} does not hold a state dict (a mapping of names to tensors)")
    if obj and all(k.startswith("module.") for k in obj):
        obj = {k.removeprefix("module."): v for k, v in obj.items()}
    return obj


class UnreadableCheckpointError(ValueError):
    """A file that is no checkpoint at all (not a torch archive, not safetensors), or an incomplete one."""


@contextlib.contextmanager
def _safetensors_read(path: Path) -> Iterator[None]:
    """While safetensors reads `path`: a file it cannot read (empty, truncated, not safetensors) is an
    UnreadableCheckpointError naming it, not safetensors' own error, which names no file."""
    from safetensors import SafetensorError

    try:
        yield
    except SafetensorError as e:
        raise UnreadableCheckpointError(
            f"cannot read {path} ({path.stat().st_size} bytes): it is not a readable safetensors file (empty, "
            f"truncated, e.g. by a full disk or a kill while it was written, or not safetensors). ({e})"
        ) from e


def _torch_load(path: Path) -> Any:
    with open(path, "rb") as f:
        head = f.read(4)
    # torch.save writes a zip archive ("PK"); files of torch < 1.6 begin with a pickle protocol opcode.
    if head and not (head.startswith(b"PK") or head.startswith(b"\x80")):
        raise UnreadableCheckpointError(
            f"{path} is not a PyTorch checkpoint (it begins {head!r}; torch.save writes a zip archive): expected "
            "our .ckpt, a .pth/.pt/.bin/.th state dict, or .safetensors"
        )
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise ValueError(
            f"refusing to load {path}: it holds Python objects besides tensors, and unpickling them "
            "can run arbitrary code. If you trust the file, convert it once: "
            "`sd = torch.load(path, weights_only=False)`, then save just the tensors with "
            f"`torch.save(sd['state_dict'], 'weights.pth')` or safetensors. ({e})"
        ) from e
    except (RuntimeError, EOFError) as e:  # PytorchStreamReader on a truncated zip; EOFError on an empty file
        raise UnreadableCheckpointError(
            f"cannot read {path} ({path.stat().st_size} bytes): the file is incomplete (empty or truncated, "
            f"e.g. by a full disk or a kill while it was written). ({type(e).__name__})"
        ) from e


# -- our own checkpoints ---------------------------------------------------------------------


@dataclass(frozen=True)
class Preprocess:
    """How evaluation feeds an image classifier (vit.data.transforms.eval_transform): the centred
    square of crop_pct x the shorter side, resized to img_size x img_size (bicubic, antialiased:
    vit.data.augment.EVAL_RESIZE), scaled to [0, 1] and normalised by mean and std. With a patch
    budget (`max_patches` of `patch_size` px: a run with `data.naflex`), the whole image at its own
    aspect ratio instead (vit.data.transforms.SequenceEvalTransform), packed as the evaluation loader
    packs it. Our checkpoints and exports carry their data's, so predictions see validation's pixels."""

    img_size: int
    crop_pct: float
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    max_patches: int | None = None
    patch_size: int | None = None

    @classmethod
    def of(cls, datamodule: Any) -> Preprocess | None:
        """An image datamodule's evaluation settings; None for data without them (text)."""
        size, crop, mean, std = (
            getattr(datamodule, name, None) for name in ("img_size", "eval_crop_pct", "mean", "std")
        )
        if any(value is None for value in (size, crop, mean, std)):
            return None
        values = {"img_size": size, "crop_pct": crop, "mean": mean, "std": std}
        naflex = getattr(datamodule, "naflex", None)
        if naflex is not None:
            values |= {"max_patches": naflex.max_patches, "patch_size": naflex.patch_size}
        return cls.from_dict(values)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Preprocess:
        """`to_dict`'s values; without max_patches and patch_size, no budget: square images."""
        floats = lambda v: tuple(float(x) for x in v)  # noqa: E731
        budget = [None if values.get(name) is None else int(values[name]) for name in ("max_patches", "patch_size")]
        if (budget[0] is None) != (budget[1] is None):
            raise ValueError(f"a patch budget needs both max_patches and patch_size, got {budget[0]} and {budget[1]}")
        return cls(
            int(values["img_size"]), float(values["crop_pct"]), floats(values["mean"]), floats(values["std"]), *budget
        )

    @classmethod
    def assumed(cls, img_size: int) -> Preprocess:
        """What a source that records no settings (timm weights, older checkpoints) is given: the
        whole image at the model's size, normalised by ImageNet's mean and std."""
        from vit.data.transforms import IMAGENET_MEAN, IMAGENET_STD

        return cls(img_size, 1.0, IMAGENET_MEAN, IMAGENET_STD)

    def to_dict(self) -> dict[str, Any]:
        values = {"img_size": self.img_size, "crop_pct": self.crop_pct, "mean": list(self.mean), "std": list(self.std)}
        if self.max_patches is not None:
            values |= {"max_patches": self.max_patches, "patch_size": self.patch_size}
        return values

    def tensors(self, images: list[np.ndarray]) -> list[torch.Tensor]:
        """RGB uint8 images (H, W, 3), any sizes, each as evaluation resizes and normalises it, not yet
        batched: (3, S, S) by vit.data.transforms.eval_transform with these settings; with a budget
        (3, rows x patch, columns x patch), the grid vit.data.transforms.SequenceEvalTransform gives it."""
        # vit.data loads Lightning: imported only where images are read
        from vit.data.naflex import NaFlex
        from vit.data.transforms import SequenceEvalTransform, eval_transform

        if self.max_patches is None:
            transform = eval_transform(self.img_size, self.crop_pct, self.mean, self.std)
        else:
            transform = SequenceEvalTransform(NaFlex(self.max_patches, self.patch_size), self.mean, self.std)
        return [transform(image=image)["image"] for image in images]

    def __call__(self, images: list[np.ndarray]) -> Inputs:
        """`tensors` as one batch of model inputs: (B, 3, S, S); with a budget, NaFlexVit.forward's dict
        of patch sequences padded to max_patches, as the evaluation loader makes it."""
        from vit.data.naflex import NaFlex, PackSequences

        if self.max_patches is None:
            return torch.stack(self.tensors(images))
        # The evaluation loader's collate_fn, so the padding is validation's too (the labels are unused).
        packed = PackSequences(NaFlex(self.max_patches, self.patch_size))
        return packed([(image, 0) for image in self.tensors(images)])[0]


def read_lightning_checkpoint(path: str | Path) -> dict:
    """A checkpoint written by our LightningModules, loaded without unpickling objects."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    checkpoint = _torch_load(path)
    if not isinstance(checkpoint, dict) or "vit" not in checkpoint or "state_dict" not in checkpoint:
        raise ValueError(
            f"{path} is not a checkpoint of scripts/train.py (it lacks the 'vit' entry with the model name and "
            "kwargs); for a plain state dict use read_state_dict and build the model with vit.create_model"
        )
    return checkpoint


@dataclass(frozen=True)
class RecordedScore:
    """The metric a run's ModelCheckpoint ranks by (`monitor`, e.g. val/acc1), as a checkpoint
    records it: the score of this file's own weights when the file is one of the run's best-k
    checkpoints (`own`); otherwise (last.ckpt, whose weights may be newer) the run's best so far,
    scored by the checkpoint named `best`."""

    monitor: str
    value: float
    own: bool
    best: str


def recorded_score(path: str | Path) -> RecordedScore | None:
    """What our `.ckpt` records of its validation score; None for a file without it (a `.safetensors`
    export, a state dict, a run without a monitored checkpoint, one saved before any validation)."""
    path = Path(path)
    if path.suffix != ".ckpt":
        return None
    checkpoint = _torch_load(path)
    states = checkpoint.get("callbacks", {}).values() if isinstance(checkpoint, dict) else []
    found = None
    for state in states:
        if not isinstance(state, dict) or not state.get("monitor") or state.get("best_model_score") is None:
            continue
        # Files are matched by name: a run folder may have been moved since the paths were saved.
        own = [score for saved, score in state.get("best_k_models", {}).items() if Path(saved).name == path.name]
        if own:
            return RecordedScore(state["monitor"], float(own[0]), True, path.name)
        found = found or RecordedScore(
            state["monitor"], float(state["best_model_score"]), False, Path(state.get("best_model_path", "")).name
        )
    return found


def _model_weights(checkpoint: dict, path: Path, use_ema: bool) -> dict[str, torch.Tensor]:
    prefix = "ema.module." if use_ema else "model."
    state_dict = {k.removeprefix(prefix): v for k, v in checkpoint["state_dict"].items() if k.startswith(prefix)}
    if not state_dict:
        kept = ": its run kept no moving average (model.ema_decay was not set)" if use_ema else ""
        raise ValueError(f"{path} has no {'EMA ' if use_ema else ''}weights (no keys starting with {prefix!r}){kept}")
    return state_dict


def load_checkpoint(path: str | Path, use_ema: bool = False) -> tuple[nn.Module, dict]:
    """Our `.ckpt` (or a `.safetensors` from `export_safetensors`) as its model, in eval mode, and the
    run's metadata (`model_name`, `model_kwargs`, and what the task stored: an image classifier's
    `class_names` in label order when its data named them and its data's evaluation settings as
    `preprocess` (`Preprocess.to_dict`), a GPT's `vocab`).

    `use_ema=True` loads the exponential-moving-average weights, when the run kept them.
    """
    path = Path(path)
    if path.suffix == ".safetensors":
        meta, state_dict = _safetensors_model_meta(path), read_state_dict(path)
    else:
        checkpoint = read_lightning_checkpoint(path)
        meta, state_dict = checkpoint["vit"], _model_weights(checkpoint, path, use_ema)
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


def export_safetensors(ckpt_path: str | Path, out_path: str | Path, use_ema: bool = False) -> Path:
    """Write a checkpoint's model weights as `.safetensors`, with the model name and kwargs in the
    metadata so `load_model` rebuilds it without our checkpoint format (or Lightning)."""
    from safetensors.torch import save_file

    checkpoint = read_lightning_checkpoint(ckpt_path)
    state_dict = _model_weights(checkpoint, Path(ckpt_path), use_ema)
    meta = checkpoint["vit"]
    metadata = {"vit_model_name": meta["model_name"], "vit_model_kwargs": json.dumps(meta["model_kwargs"])}
    if meta.get("class_names") is not None:
        metadata["vit_class_names"] = json.dumps(meta["class_names"])
    if meta.get("preprocess") is not None:
        metadata["vit_preprocess"] = json.dumps(meta["preprocess"])
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    # safetensors refuses tensors that share memory (tied weights); store each once, contiguous.
    save_file({k: v.contiguous().clone() for k, v in state_dict.items()}, str(out_path), metadata=metadata)
    return out_path


def _safetensors_model_meta(path: Path) -> dict[str, Any]:
    from safetensors import safe_open

    with _safetensors_read(path), safe_open(str(path), framework="pt") as f:
        metadata = f.metadata() or {}
    if "vit_model_name" not in metadata:
        raise ValueError(
            f"{path} has no vit_model_name in its metadata (it was not written by export_safetensors); "
            "build the model with vit.create_model and load it with load_pretrained(model, path)"
        )
    kwargs = json.loads(metadata.get("vit_model_kwargs", "{}"))
    meta: dict[str, Any] = {"model_name": metadata["vit_model_name"], "model_kwargs": kwargs}
    if "vit_class_names" in metadata:
        meta["class_names"] = json.loads(metadata["vit_class_names"])
    if "vit_preprocess" in metadata:
        meta["preprocess"] = json.loads(metadata["vit_preprocess"])
    return meta


# -- reading any source ----------------------------------------------------------------------


def read_weights(source: str | Path, model: nn.Module | None = None, use_ema: bool = False) -> dict[str, torch.Tensor]:
    """A state dict from a file (ours, timm-format, Google `.npz`) or `timm:<name>` (download)."""
    text = str(source)
    if text.startswith("timm:"):
        return _timm_pretrained(text.removeprefix("timm:"))
    path = Path(source)
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} does not exist; init_from takes a checkpoint file (.ckpt, .pth, .bin, .safetensors, .npz) "
            "or timm:<model name> for timm's pretrained weights"
        )
    if path.suffix == ".npz":
        if not isinstance(model, VisionTransformer):
            raise ValueError(f"{path}: Google .npz checkpoints hold Vision Transformers; the model is {type(model)}")
        return load_npz(path, model)
    if path.suffix == ".ckpt":
        checkpoint = _torch_load(path)
        if isinstance(checkpoint, dict) and "vit" in checkpoint and "state_dict" in checkpoint:
            return _model_weights(checkpoint, path, use_ema)
    return read_state_dict(path)


class PretrainedDownloadError(RuntimeError):
    """timm's pretrained weights for `name` could not be downloaded (offline, the hub unreachable or
    refusing); the library's error is the cause. The message says how to pass a file to training;
    a command that takes a file another way catches this class and says its own form."""

    def __init__(self, message: str, name: str = "", reason: str = "") -> None:  # unpickling passes message alone
        super().__init__(message)
        self.name, self.reason = name, reason or message


def _timm_pretrained(name: str) -> dict[str, torch.Tensor]:
    """timm's pretrained weights for `name` from the Hugging Face cache or hub. Without a network the
    hub's client retries for a minute before it gives up: where the hub cannot be reached, the cache
    is read alone (as with HF_HUB_OFFLINE=1), so a missing file is said at once."""
    import timm
    from huggingface_hub import constants

    offline = constants.HF_HUB_OFFLINE or not hub_reachable(constants.ENDPOINT)
    try:
        with _hub_offline(offline):
            return timm.create_model(name, pretrained=True).state_dict()
    except OSError as e:  # huggingface_hub's errors (LocalEntryNotFoundError offline, HfHubHTTPError) and urllib's
        reason = timm_weights_unavailable(name, e, offline)
        advice = "and pass the file: --model.finetune.init_from /path/to/model.safetensors"
        raise PretrainedDownloadError(f"{reason} {advice}", name, reason) from e


def timm_weights_unavailable(name: str, cause: BaseException, offline: bool) -> str:
    """Why timm's weights for `name` could not be had, and where to download them (the hub repository
    of the name's default tag: vit_base_patch16_224 -> timm/vit_base_patch16_224.augreg2_in21k_ft_in1k)."""
    import timm
    from huggingface_hub import constants

    try:
        repo = timm.models.get_pretrained_cfg(name).hf_hub_id or f"timm/{name}"
    except (AttributeError, RuntimeError):  # an unknown name or tag
        repo = f"timm/{name}"
    why = " ".join(f"{type(cause).__name__}: {cause}".split())
    if offline:
        where = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else f"{constants.ENDPOINT} cannot be reached"
        why = f"{where}, and they are not in the cache {constants.HF_HUB_CACHE}"
    return (
        f"could not get timm's pretrained weights for {name!r} ({why}). Download model.safetensors from "
        f"{constants.ENDPOINT}/{repo} (HF_HUB_OFFLINE=1 reads the cache without trying the network)"
    )


def hub_reachable(endpoint: str, timeout: float = 3.0) -> bool:
    """Whether a connection to the hub's host opens within `timeout` seconds; True behind a proxy,
    which the hub's client goes through and a direct connection would not."""
    import os
    import socket
    from urllib.parse import urlsplit

    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True
    url = urlsplit(endpoint)
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=timeout).close()
    except OSError:
        return False
    return True


@contextlib.contextmanager
def _hub_offline(offline: bool) -> Iterator[None]:
    """huggingface_hub reads the cache alone while its HF_HUB_OFFLINE constant is true."""
    from huggingface_hub import constants

    saved = constants.HF_HUB_OFFLINE
    constants.HF_HUB_OFFLINE = saved or offline
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE = saved


def load_npz(path: str | Path, model: VisionTransformer) -> dict[str, torch.Tensor]:
    """Google's ViT `.npz` (big_vision / the original release) as a timm-layout state dict: read by
    timm's converter into a timm ViT built to the file's shapes (grid, head, CLS) and the model's
    width and depth. `checkpoint_filter_fn` then fits it to the model."""
    import timm

    path = Path(path)
    with np.load(path, allow_pickle=False) as w:
        keys = set(w.files)
        prefix = next((p for p in ("", "opt/target/", "params/") if f"{p}embedding/kernel" in keys), None)
        if prefix is None:
            raise ValueError(f"{path} is not a Google ViT checkpoint (no embedding/kernel)")
        posemb = w.get(f"{prefix}Transformer/posembed_input/pos_embedding", w.get(f"{prefix}pos_embedding"))
        num_pos = posemb.shape[1]
        num_classes = w[f"{prefix}head/bias"].shape[0] if f"{prefix}head/bias" in keys else 0
        patch = w[f"{prefix}embedding/kernel"].shape[0]
        pool = "map" if f"{prefix}MAPHead_0/probe" in keys else "token" if f"{prefix}cls" in keys else "avg"
    has_cls = f"{prefix}cls" in keys
    # A hybrid's embedding kernel spans feature-map cells, each `feature_ratio` pixels wide.
    patch_px = patch * getattr(model.patch_embed, "feature_ratio", (1, 1))[0]
    config = replace(
        model.config, img_size=math.isqrt(num_pos - has_cls) * patch_px, patch_size=patch, num_classes=num_classes,
        global_pool=pool, class_token=has_cls, fc_norm=False,
    )  # fmt: skip
    source = timm.models.vision_transformer.VisionTransformer(**timm_kwargs(config))
    source.load_pretrained(str(path))
    return source.state_dict()


# -- adapting to a model ---------------------------------------------------------------------


@dataclass
class LoadReport:
    """What `adapt_state_dict` changed, by parameter name."""

    resampled: list[str] = field(default_factory=list)
    reinitialised: list[str] = field(default_factory=list)
    renamed: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)

    def add(self, kind: str, what: str) -> None:
        getattr(self, kind).append(what)

    def log(self, source: str) -> None:
        for kind, names in asdict(self).items():
            for name in names:
                log.info("%s: %s %s", source, kind, name)


# The classifier of our ViTs (and a distilled ViT's second head), torchvision ResNets, CIFAR ResNets.
HEAD_NAMES = ("head", "head_dist", "fc", "linear")


def is_head(name: str) -> bool:
    """Whether parameter `name` belongs to a classifier head."""
    return name.split(".")[0] in HEAD_NAMES


def checkpoint_filter_fn(
    state_dict: dict[str, torch.Tensor], model: VisionTransformer, log: Callable[[str, str], None] | None = None
) -> dict[str, torch.Tensor]:
    """A ViT state dict (ours or timm's) made to fit `model` (timm's function of that name): the
    position embedding is resampled to the model's grid, the CLS and register tokens and their
    positions follow the model (kept, dropped, or left at the model's init), and the final norm moves
    between before pooling (`norm`) and after it (`fc_norm`).
    `log(kind, what)` hears of each change: "resampled", "reinitialised", "renamed" or "dropped"."""
    log = log or (lambda kind, what: None)
    sd, target = dict(state_dict), model.state_dict()
    source_prefix = ("cls_token" in sd, sd["reg_token"].shape[1] if "reg_token" in sd else 0)
    for name in ("cls_token", "reg_token"):
        if name in sd and name in target and sd[name].shape[-1] != target[name].shape[-1]:
            continue  # another width: not adaptable, the caller reports it
        if name in sd and (name not in target or sd[name].shape != target[name].shape):
            del sd[name]  # no such token in the model, or another number of registers
            log("dropped", name)
        if name in target and name not in sd:
            sd[name] = target[name]
            log("reinitialised", name)

    # Final norm before pooling (norm) or after it (fc_norm, timm's avg pooling): same parameters.
    for old, new in (("norm", "fc_norm"), ("fc_norm", "norm")):
        for suffix in ("weight", "bias"):
            if f"{old}.{suffix}" in sd and f"{old}.{suffix}" not in target and f"{new}.{suffix}" in target:
                sd[f"{new}.{suffix}"] = sd.pop(f"{old}.{suffix}")
                log("renamed", f"{old}.{suffix} -> {new}.{suffix}")

    _adapt_sam_positions(sd, model, log)
    if "pos_embed" in sd and "pos_embed" in target and target["pos_embed"].ndim == 3:  # SAM's (1, H, W, D): above
        sd["pos_embed"] = _adapt_pos_embed(sd["pos_embed"], source_prefix, model, log)
    return sd


def _adapt_sam_positions(sd: dict[str, torch.Tensor], model: nn.Module, log: Callable[[str, str], None]) -> None:
    """SAM's positions at the model's patch grid, in place: a position embedding stored on the grid
    (1, H, W, D) resampled as timm's SAM resamples it at another input size (bicubic, antialiased), and
    the decomposed relative positions (`attn.rel_pos_h`, `attn.rel_pos_w`, 2 x side - 1 offsets by
    head_dim) interpolated linearly to the model's lengths, as SAM's `get_rel_pos` does: a global
    block's follow the grid, a windowed block's keep the window's."""
    target = model.state_dict()
    pos = sd.get("pos_embed")
    if pos is not None and pos.ndim == 4 and "pos_embed" in target and pos.shape[1:3] != target["pos_embed"].shape[1:3]:
        (h, w), (new_h, new_w) = pos.shape[1:3], target["pos_embed"].shape[1:3]
        sd["pos_embed"] = resample_abs_pos_embed_nhwc(pos, [new_h, new_w])
        log("resampled", f"pos_embed (grid {h}x{w} -> {new_h}x{new_w})")
    for name, table in list(sd.items()):
        want = target.get(name)
        if not name.endswith((".rel_pos_h", ".rel_pos_w")) or want is None or table.ndim != 2:
            continue
        if table.shape[1:] == want.shape[1:] and table.shape[0] != want.shape[0]:  # another head_dim: refused later
            sd[name] = resample_rel_pos(table, want.shape[0])
            log("resampled", f"{name} ({table.shape[0]} -> {want.shape[0]} offsets)")


def _is_square(n: int) -> bool:
    return n >= 0 and math.isqrt(n) ** 2 == n


def _adapt_pos_embed(
    posemb: torch.Tensor, source_prefix: tuple[bool, int], model: VisionTransformer, log: Callable[[str, str], None]
) -> torch.Tensor:
    """Split off the prefix positions (CLS, registers) if the checkpoint has them, resample the patch
    grid to the model's, and give the model the prefix positions it expects."""
    has_cls, num_reg = source_prefix
    if not _is_square(posemb.shape[1] - has_cls - num_reg):  # DeiT III / no_embed_class: patches only
        has_cls, num_reg = False, 0
    if not _is_square(posemb.shape[1] - has_cls - num_reg):
        raise ValueError(f"pos_embed: cannot infer a square patch grid from shape {tuple(posemb.shape)}")
    cls, reg, grid = posemb.split([int(has_cls), num_reg, posemb.shape[1] - has_cls - num_reg], dim=1)
    side = math.isqrt(grid.shape[1])
    new_grid = model.patch_embed.grid_size
    if (side, side) != new_grid:
        grid = resample_abs_pos_embed(grid, list(new_grid), [side, side], num_prefix_tokens=0)
        log("resampled", f"pos_embed (grid {side}x{side} -> {new_grid[0]}x{new_grid[1]})")
    want_cls = model.cls_token is not None and model.num_pos_prefix > 0
    want_reg = model.num_reg_tokens if model.num_pos_prefix > 0 else 0
    parts = []
    for what, have, want in (("CLS", cls, int(want_cls)), ("registers", reg, want_reg)):
        if have.shape[1] == want:
            parts.append(have)
        elif want:  # the checkpoint has no (or other) positions for these tokens
            parts.append(grid.new_zeros(1, want, grid.shape[2]))
            had = f"has {have.shape[1]}, the model {want}" if have.shape[1] else f"has no {what} position"
            log("reinitialised", f"pos_embed[{what}] (zeros: the checkpoint {had})")
        else:
            log("dropped", f"pos_embed[{what}]")
    return torch.cat([*parts, grid], dim=1)


def adapt_state_dict(state_dict: dict[str, torch.Tensor], model: nn.Module) -> tuple[dict, LoadReport]:
    """Make `state_dict` fit `model`: resample the position embedding, re-initialise a head with
    another class count, follow CLS <-> avg pooling switches. Raises on anything else that differs."""
    target = model.state_dict()
    sd = dict(state_dict)
    report = LoadReport()

    if isinstance(model, VisionTransformer):
        sd = checkpoint_filter_fn(sd, model, report.add)

    # A classifier head of another size (new class count): keep the model's fresh initialisation.
    for name in list(sd):
        head = is_head(name)
        if head and name in target and sd[name].shape != target[name].shape:
            sd[name] = target[name]
            report.reinitialised.append(name)
        elif head and name not in target:  # num_classes=0: a headless model
            del sd[name]
            report.dropped.append(name)
    for name in target:
        if is_head(name) and name not in sd:
            sd[name] = target[name]
            report.reinitialised.append(name)

    # Checkpoints from before PyTorch 0.4.1 (e.g. the classic CIFAR ResNets) have no BatchNorm step
    # counter; it only matters for momentum=None, so the model's own value is kept, as torch does.
    for name in target:
        if name.endswith(".num_batches_tracked") and name not in sd:
            sd[name] = target[name]
    missing = sorted(set(target) - set(sd), key=_natural)
    unexpected = sorted(set(sd) - set(target), key=_natural)
    if missing or unexpected:
        parts = [f"{what.format(len(keys))} ({', '.join(keys[:3])}{', ...' if len(keys) > 3 else ''})"
                 for what, keys in (("{} of the model's keys missing", missing),
                                    ("{} keys the model does not have", unexpected)) if keys]  # fmt: skip
        raise WeightsMismatchError("; ".join(parts))
    mismatched = [
        f"{name}: the checkpoint has shape {tuple(value.shape)}, the model {tuple(target[name].shape)}"
        for name, value in sd.items()
        if value.shape != target[name].shape
    ]
    if mismatched:
        more = f" (and {len(mismatched) - 3} more)" if len(mismatched) > 3 else ""
        raise WeightsMismatchError("; ".join(mismatched[:3]) + more)
    return sd, report


class WeightsMismatchError(ValueError):
    """Weights that do not fit a model, in what cannot be adapted (only the position embedding and
    the head are): `details` names a few of the keys or shapes that differ."""

    def __init__(self, details: str, what: str = "the weights do not fit the model") -> None:
        self.details = details
        super().__init__(f"{what}: {details}; only the position embedding and the head are adapted")


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
            return _safetensors_model_meta(path)["model_name"]
        if path.suffix == ".ckpt":
            return read_lightning_checkpoint(path)["vit"]["model_name"]
    except (ValueError, KeyError, TypeError):  # a file without our metadata
        return None
    return None


def _natural(key: str) -> list:
    """blocks.2 before blocks.10."""
    return [int(t) if t.isdigit() else t for t in key.split(".")]


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


def timm_preprocessing(source: str | Path, model_name: str) -> tuple[dict[str, Any], str] | None:
    """How weights from timm were trained to see images, from timm's pretrained config: (mean, std,
    crop_pct, interpolation, input_size) and where they were read. For `timm:NAME.TAG`, that tag's;
    for a file, the hub's config.json beside it where there is one, else the default tag of
    `model_name`. None for weights that are not timm's (our checkpoints record their own) or a name
    timm has no pretrained config for."""
    import timm

    text = str(source)
    if text.startswith("timm:"):
        name, config_file = text.removeprefix("timm:"), None
    else:
        path = Path(text)
        if path.suffix == ".ckpt" or (path.suffix == ".safetensors" and _written_by_us(path)):
            return None
        name, config_file = model_name, path.with_name("config.json")
    if config_file is not None and config_file.is_file():
        try:
            config = json.loads(config_file.read_text()).get("pretrained_cfg")
        except (OSError, ValueError):
            config = None
        if isinstance(config, dict) and {"mean", "std"} <= config.keys():
            keys = ("mean", "std", "crop_pct", "interpolation", "input_size")
            return {key: config.get(key) for key in keys}, str(config_file)
    try:
        config = timm.models.get_pretrained_cfg(name)
    except (AttributeError, RuntimeError):  # not a timm name (our own models), or an unknown tag
        return None
    if config is None:
        return None
    tag = f"{name}.{config.tag}" if config.tag and "." not in name else name
    values = {"mean": config.mean, "std": config.std, "crop_pct": config.crop_pct,
              "interpolation": config.interpolation, "input_size": config.input_size}  # fmt: skip
    return values, f"timm's pretrained config of {tag}"


def _written_by_us(path: Path) -> bool:
    """Whether a .safetensors file carries our metadata (export_safetensors), which records its own preprocessing."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return "vit_model_name" in (f.metadata() or {})
    except Exception:  # not readable as safetensors: the loader says so, naming the file
        return False
