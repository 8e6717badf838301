"""How long one optimizer step of the CIFAR ViT (configs/cifar10_vit.yaml) takes on this machine:
AdamW, Muon with its Newton-Schulz iteration in float32 and in bfloat16, beside the model's forward
and backward at batch 128 in bf16 autocast, measured side by side in one run.

    flock /tmp/vit-bench.lock python -m benchmarks.muon_step

Why: a run in bf16-mixed orthogonalises in bf16 (vit.training.TrainingTask.make_optimizer); on a
CPU with bf16 units that is the cheaper step. Without them bf16 matrix products are slow, which this
prints too.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import yaml

from vit.optim import MuonAdamW, split_muon_groups
from vit.registry import create_model
from vit.training import param_groups

ROOT = Path(__file__).resolve().parents[1]


def model_args(configs: list[str]) -> dict[str, Any]:
    """The model's init_args of configs laid over each other (each key given whole, as the CLI does)."""
    args: dict[str, Any] = {}
    for config in configs:
        args.update(yaml.safe_load((ROOT / config).read_text())["model"].get("init_args", {}))
    return args


def cifar_vit() -> torch.nn.Module:
    config = model_args(["configs/cifar10_vit.yaml"])
    torch.manual_seed(0)
    return create_model(config["model_name"], num_classes=10, **config["model_kwargs"])


def median_ms(fn: Callable[[], None], repeats: int, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=128)
    args = parser.parse_args(argv)
    model = cifar_vit().train()
    hidden = {p for name, p in model.named_parameters() if p.ndim == 2 and name.startswith("blocks.")}
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3

    def optimizer(name: str) -> torch.optim.Optimizer:
        groups = param_groups(model, 0.05, 4e-3)
        if name == "adamw":
            return torch.optim.AdamW(groups, lr=4e-3)
        return MuonAdamW(split_muon_groups(groups, hidden), 4e-3, ns_dtype=torch.bfloat16 if "bf16" in name else None)

    rows = {}
    for name in ("adamw", "muon, Newton-Schulz in float32", "muon, Newton-Schulz in bf16"):
        opt = optimizer(name)
        rows[f"optimizer step: {name}"] = median_ms(opt.step, args.repeats)

    images = torch.randn(args.batch_size, 3, 32, 32)
    labels = torch.randint(0, 10, (args.batch_size,))

    def forward_backward() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(images), labels)
        loss.backward()

    rows[f"forward + backward, batch {args.batch_size}, bf16 autocast"] = median_ms(forward_backward, args.repeats)
    fp32 = rows["optimizer step: muon, Newton-Schulz in float32"]
    params = sum(p.numel() for p in model.parameters())
    print(f"configs/cifar10_vit.yaml's ViT: {params / 1e6:.2f}M parameters, {torch.get_num_threads()} threads")
    print("| what | ms (median) | vs Muon in float32 |")
    print("|---|---:|---:|")
    for name, ms in rows.items():
        print(f"| {name} | {ms:.1f} | {ms / fp32:.2f}x |")


if __name__ == "__main__":
    main()
