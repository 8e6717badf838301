"""Checkpoint files, read safely and written: a state dict from any torch or safetensors file, our
Lightning `.ckpt` with its metadata and recorded score, and our `.safetensors` export.

Checkpoint files are untrusted input: a pickle can run arbitrary code when it is loaded, so we
only use `torch.load(weights_only=True)` (tensors, dicts, numbers, strings) or safetensors.
"""

from __future__ import annotations

import contextlib
import json
import pickle
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

_NESTED_KEYS = ("state_dict", "model", "model_state_dict", "module")


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
    obj = torch_load(path)
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


def torch_load(path: Path) -> Any:
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


def read_lightning_checkpoint(path: str | Path) -> dict:
    """A checkpoint written by our LightningModules, loaded without unpickling objects."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    checkpoint = torch_load(path)
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
    checkpoint = torch_load(path)
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


def model_weights(checkpoint: dict, path: Path, use_ema: bool) -> dict[str, torch.Tensor]:
    prefix = "ema.module." if use_ema else "model."
    state_dict = {k.removeprefix(prefix): v for k, v in checkpoint["state_dict"].items() if k.startswith(prefix)}
    if not state_dict:
        kept = ": its run kept no moving average (model.ema_decay was not set)" if use_ema else ""
        raise ValueError(f"{path} has no {'EMA ' if use_ema else ''}weights (no keys starting with {prefix!r}){kept}")
    return state_dict


def export_safetensors(ckpt_path: str | Path, out_path: str | Path, use_ema: bool = False) -> Path:
    """Write a checkpoint's model weights as `.safetensors`, with the model name and kwargs in the
    metadata so `load_model` rebuilds it without our checkpoint format (or Lightning)."""
    from safetensors.torch import save_file

    checkpoint = read_lightning_checkpoint(ckpt_path)
    state_dict = model_weights(checkpoint, Path(ckpt_path), use_ema)
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


def safetensors_model_meta(path: Path) -> dict[str, Any]:
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


def written_by_us(path: Path) -> bool:
    """Whether a .safetensors file carries our metadata (export_safetensors), which records its own preprocessing."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return "vit_model_name" in (f.metadata() or {})
    except Exception:  # not readable as safetensors: the loader says so, naming the file
        return False
