"""Reading checkpoint files safely.

Checkpoint files are untrusted input: a pickle can run arbitrary code when it is loaded, so we
only ever use `torch.load(weights_only=True)` (tensors, dicts, numbers, strings) or safetensors.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import torch
from torch import nn

from vit.registry import create_model

# Wrappers that training scripts put around a state dict, outermost first.
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


def _torch_load(path: Path) -> object:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise ValueError(
            f"refusing to load {path}: it holds Python objects besides tensors, and unpickling them "
            "can run arbitrary code. If you trust the file, convert it once: "
            "`sd = torch.load(path, weights_only=False)`, then save just the tensors with "
            f"`torch.save(sd['state_dict'], 'weights.pth')` or safetensors. ({e})"
        ) from e


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


def load_model(path: str | Path, use_ema: bool = False) -> nn.Module:
    """Rebuild the trained model from one of our `.ckpt` files alone (name + kwargs + weights), in eval mode.

    `use_ema=True` loads the exponential-moving-average weights, when the run kept them.
    """
    checkpoint = read_lightning_checkpoint(path)
    meta = checkpoint["vit"]
    model = create_model(meta["model_name"], **meta["model_kwargs"])
    prefix = "ema.module." if use_ema else "model."
    state_dict = {k.removeprefix(prefix): v for k, v in checkpoint["state_dict"].items() if k.startswith(prefix)}
    if not state_dict:
        raise ValueError(f"{path} has no {'EMA ' if use_ema else ''}weights (no keys starting with {prefix!r})")
    model.load_state_dict(state_dict, strict=True)
    return model.eval()
