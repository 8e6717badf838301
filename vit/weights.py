"""Where weights come from: a checkpoint file of any format (ours, timm's, Google's `.npz`) or
`timm:<name>` (timm's pretrained weights from the Hugging Face hub, or its cache where the hub cannot
be reached), and how timm's weights were trained to see images (`timm_preprocessing`)."""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from vit.checkpoint_files import model_weights, read_state_dict, torch_load, written_by_us
from vit.timm_args import timm_kwargs
from vit.vision_transformer import VisionTransformer


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
        checkpoint = torch_load(path)
        if isinstance(checkpoint, dict) and "vit" in checkpoint and "state_dict" in checkpoint:
            return model_weights(checkpoint, path, use_ema)
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
        if path.suffix == ".ckpt" or (path.suffix == ".safetensors" and written_by_us(path)):
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
