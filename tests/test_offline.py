"""timm's weights by name without a network: the cache is read at once, and weights that are not
there are said in one line naming the file, where to get it and HF_HUB_OFFLINE, not after a minute
of the hub client's retries."""

from __future__ import annotations

import socket
import time

import pytest
import timm
import torch
from huggingface_hub import constants
from safetensors.torch import save_file

import vit
from vit.checkpoint import PretrainedDownloadError, load_pretrained


@pytest.fixture
def no_network(monkeypatch, tmp_path):
    """No host can be reached (as on a machine without a network), and an empty Hugging Face cache."""

    def refused(*args, **kwargs):
        raise OSError("Name or service not known")

    monkeypatch.setattr(socket, "create_connection", refused)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    for proxy in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(proxy, raising=False)
    return tmp_path / "hub"


def test_weights_not_in_the_cache_are_refused_at_once_naming_the_file_and_where_to_get_it(no_network):
    model = vit.create_model("vit_tiny_patch16_224", num_classes=10)
    start = time.monotonic()
    with pytest.raises(PretrainedDownloadError) as error:
        load_pretrained(model, "timm:vit_tiny_patch16_224")
    assert time.monotonic() - start < 10  # the hub client alone retries for about a minute
    assert str(error.value) == (
        f"could not get timm's pretrained weights for 'vit_tiny_patch16_224' (https://huggingface.co cannot be "
        f"reached, and they are not in the cache {no_network}). Download model.safetensors from "
        "https://huggingface.co/timm/vit_tiny_patch16_224.augreg_in21k_ft_in1k (HF_HUB_OFFLINE=1 reads the cache "
        "without trying the network) and pass the file: --model.finetune.init_from /path/to/model.safetensors"
    )
    assert constants.HF_HUB_OFFLINE is False  # only for the call


def test_weights_in_the_cache_load_without_a_network(no_network):
    repo = no_network / "models--timm--vit_tiny_patch16_224.augreg_in21k_ft_in1k"
    commit = "0" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "snapshots" / commit).mkdir(parents=True)
    weights = timm.create_model("vit_tiny_patch16_224").state_dict()
    save_file(weights, repo / "snapshots" / commit / "model.safetensors")
    model = vit.create_model("vit_tiny_patch16_224")
    start = time.monotonic()
    load_pretrained(model, "timm:vit_tiny_patch16_224")
    assert time.monotonic() - start < 10
    assert torch.equal(model.state_dict()["blocks.0.attn.qkv.weight"], weights["blocks.0.attn.qkv.weight"])
