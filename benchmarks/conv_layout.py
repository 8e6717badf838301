"""Forward + backward time of each CIFAR config's model with its convolutions in NCHW and in NHWC
(`speed.channels_last`) memory order, bf16 autocast, batch 128, measured side by side in one run.

    flock /tmp/vit-bench.lock python -m benchmarks.conv_layout

Why: oneDNN's NHWC kernels are faster for convolutions and much faster for max pooling, so the
configs with convolutions (ResNet-20, the hybrid's pooled stem) train in channels_last; the plain
ViT has one patchify conv and gains nothing. Same results either way (tests/test_fast_training.py).
"""

from __future__ import annotations

import argparse
import statistics

import torch

from benchmarks.muon_step import median_ms, model_args
from vit.registry import create_model

CONFIGS = {
    "ResNet-20": ["configs/cifar10_resnet.yaml"],
    "ViT": ["configs/cifar10_vit.yaml"],
    "hybrid (pooled conv stem)": ["configs/cifar10_vit.yaml", "configs/cifar10_hybrid.yaml"],
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=10, help="steps timed per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=128)
    args = parser.parse_args(argv)
    labels = torch.randint(0, 10, (args.batch_size,))
    print(f"batch {args.batch_size}, bf16 autocast, {torch.get_num_threads()} threads")
    print("| model | config sets channels_last | NCHW ms | NHWC ms | NCHW / NHWC |")
    print("|---|---|---:|---:|---:|")
    for label, configs in CONFIGS.items():
        init = model_args(configs)
        steps = {}
        for layout in (torch.contiguous_format, torch.channels_last):
            torch.manual_seed(0)
            model = create_model(init["model_name"], num_classes=10, **(init.get("model_kwargs") or {}))
            model = model.to(memory_format=layout).train()
            images = torch.randn(args.batch_size, 3, 32, 32).contiguous(memory_format=layout)

            def forward_backward(model: torch.nn.Module = model, images: torch.Tensor = images) -> None:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = torch.nn.functional.cross_entropy(model(images), labels)
                loss.backward()

            steps[layout] = forward_backward
        # the layouts take turns, so a machine that drifts in speed moves both alike
        rounds = {layout: [] for layout in steps}
        for _ in range(args.rounds):
            for layout, step in steps.items():
                rounds[layout].append(median_ms(step, args.repeats))
        ms = {layout: statistics.median(times) for layout, times in rounds.items()}
        nchw, nhwc = ms[torch.contiguous_format], ms[torch.channels_last]
        config_sets = "yes" if (init.get("speed") or {}).get("channels_last") else "no"
        print(f"| {label} | {config_sets} | {nchw:.1f} | {nhwc:.1f} | {nchw / nhwc:.2f}x |")


if __name__ == "__main__":
    main()
