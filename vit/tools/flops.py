"""Counting a model's FLOPs and the share of the GPU's peak they reach (MFU): the one definition,
for the GPU check, the data check and the speed benchmark.

FLOPs are torch's FlopCounterMode counts (matmuls, convolutions, attention; 2 per multiply-add).
MFU = (training FLOPs per image x images per second) / (peak FLOP/s x devices).
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

# Dense (no sparsity) bfloat16 tensor-core peaks with float32 accumulation, TFLOP/s, from NVIDIA's
# data sheets; matched against torch.cuda.get_device_name(), first match wins.
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    (r"H100.*PCIe", 756.0),
    (r"H100 NVL", 835.0),
    (r"H100|H200|GH200", 989.4),
    (r"A100", 312.0),
    (r"L40S", 362.0),
    (r"\bL4\b", 121.0),
    (r"RTX 4090", 165.2),
    (r"RTX 3090(?! Ti)", 71.0),
)


def peak_tflops(device_name: str) -> float | None:
    """The GPU's dense bf16 peak from PEAK_BF16_TFLOPS, or None for a GPU (or CPU) not in it."""
    for pattern, tflops in PEAK_BF16_TFLOPS:
        if re.search(pattern, device_name):
            return tflops
    return None


def count_flops(fn: Callable[[], object]) -> int:
    """FLOPs of one call of `fn` (a forward pass, or forward and backward), as torch counts them."""
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def forward_flops(model: nn.Module, img_size: int, device: torch.device | str = "cpu") -> int:
    """FLOPs of the model's forward pass on one image. Attention is counted on the explicit path
    (q k^T and the weights times v, the FLOPs the fused kernels do too), because torch counts no
    CPU attention kernel; training is about 3x this (forward + backward)."""
    fused = {m: m.fused_attn for m in model.modules() if hasattr(m, "fused_attn")}
    training = model.training
    try:
        for m in fused:
            m.fused_attn = False
        model.eval()
        x = torch.zeros(1, 3, img_size, img_size, device=device)
        with torch.no_grad():
            return count_flops(lambda: model(x))
    finally:
        model.train(training)
        for m, value in fused.items():
            m.fused_attn = value


def mfu(img_per_s: float, flops_per_img: float, peak: float | None, devices: int = 1) -> float | None:
    """Model FLOPs utilisation: achieved FLOP/s over `devices` x `peak` TFLOP/s (None: no peak known)."""
    if not peak:
        return None
    return img_per_s * flops_per_img / (peak * 1e12 * devices)
