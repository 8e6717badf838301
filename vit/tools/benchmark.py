"""Benchmarks: our ViTs against timm's, attention against sequence length, ResNet baselines, data loading.

    flock /tmp/vit-bench.lock .venv/bin/python scripts/benchmark.py --threads 1   # the committed run, ~6 min
    .venv/bin/python scripts/benchmark.py --quick                                  # CI smoke run, ~10 s
    vit-bench --device cuda --dtype bf16 --compile                                 # the same on a GPU node

Writes `benchmark.json` and `benchmark.md` (`benchmark_quick.*` with --quick) to --out.

Sections (`--sections`, each one function returning a `Section`; add one to SECTIONS):
  vit        ours vs timm, same configuration and weights: inference and training-step (forward,
             backward, AdamW) img/s, GFLOP/s and utilisation of a matmul peak measured in the same run;
             on CUDA ViT-B/16 and ViT-L/16 at 224 and, in bf16, MFU against the GPU's data-sheet peak
  attention  one attention layer, fused (SDPA) vs explicit, time and peak memory from 65 to 4097 tokens
  resnet     ResNet baselines, NCHW vs channels-last
  profile    where a ViT training step spends its time, by kind of op, ours and timm's
  data       the albumentations train transform per worker vs torchvision transforms v2, same ops

Method (vit.tools.bench_measure): everything compared is timed in turn within each repetition
(order alternating), after warm-up, so a change in machine load hits all contenders alike; we
report the median and the min-max over repetitions, and ratios as the median of per-repetition
ratios. The data section lives in vit.tools.bench_data.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import vit
from vit.layers import Attention
from vit.timm_args import timm_kwargs
from vit.tools.bench_data import section_data
from vit.tools.bench_measure import (
    Bench,
    Section,
    fmt_bytes,
    fmt_ratio,
    fmt_spread,
    interleaved,
    matmul_peak,
    paired_ratio,
    peak_memory,
    rate,
    spread,
)
from vit.tools.flops import count_flops, mfu, peak_tflops
from vit.tools.machine import cpu_name, markdown_table

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# (model name, inference batch, training batch). Small batches keep the full run under 10 minutes here.
VIT_CASES = [
    ("vit_tiny_patch16_224", 16, 8),
    ("vit_small_patch16_224", 8, 8),
    ("vit_base_patch16_224", 4, 4),
    ("vit_tiny_patch4_32", 64, 64),
    ("vit_micro_patch4_32", 64, 64),
]
VIT_CASES_QUICK = [("vit_nano_patch4_16", 8, 8)]
# On a GPU: the sizes issue #17 measures (ViT-B/16 and ViT-L/16 at 224), batches that fill one GPU.
VIT_CASES_CUDA = [("vit_base_patch16_224", 512, 256), ("vit_large_patch16_224", 256, 128)]
# (label, image size, patch size): sequence length = (img / patch)^2 + 1 CLS token.
ATTN_CASES = [("32px / 4", 32, 4), ("224px / 16", 224, 16), ("224px / 8", 224, 8), ("224px / 4", 224, 4)]
ATTN_CASES += [("256px / 4", 256, 4)]
ATTN_CASES_QUICK = [("16px / 4", 16, 4), ("32px / 4", 32, 4)]
RESNET_CASES = [("resnet18", 224, 16, 8), ("resnet50", 224, 8, 8)]  # name, image size, inference/train batch
RESNET_CASES_QUICK = [("resnet20", 32, 8, 8)]


# --------------------------------------------------------------------------- sections


def timm_twin(model: vit.VisionTransformer, name: str | None = None) -> nn.Module:
    """timm's model in the same configuration, with the same weights: timm's own builder of `name`
    where timm has that name (every family: EVA, NaFlexViT, ...), else its VisionTransformer built
    from our config."""
    import timm
    from timm.models.vision_transformer import VisionTransformer as TimmViT

    if name is not None and timm.is_model(name):
        theirs = timm.create_model(name, pretrained=False, num_classes=model.num_classes)
    else:
        theirs = TimmViT(**timm_kwargs(model.config))
    theirs.load_state_dict(model.state_dict())
    return theirs


def step_fns(
    bench: Bench,
    model: nn.Module,
    batch: int,
    img_size: tuple[int, int],
    num_classes: int,
    train_batch: int,
    channels_last: bool = False,
    compile: bool = True,
) -> tuple[Callable[[], object], Callable[[], object], Callable[[], object]]:
    """(inference, training step, forward+backward) closures over fixed random inputs.
    `compile=False` skips --compile (FLOP counting runs the eager model)."""
    layout = torch.channels_last if channels_last else torch.contiguous_format
    x = torch.randn(batch, 3, *img_size, device=bench.device).contiguous(memory_format=layout)
    xt = torch.randn(train_batch, 3, *img_size, device=bench.device).contiguous(memory_format=layout)
    y = torch.randint(0, num_classes, (train_batch,), device=bench.device)
    runner = bench.prepare(model) if compile else model.to(bench.device)
    # A tiny learning rate: the weights stay put over the repetitions; the work per step is the same.
    # fused: one kernel per step; the default per-tensor AdamW costs ~5x more here (0.42 vs 0.08 s for
    # ViT-B's 86M parameters on one core), time that is the same for every model and hides the models' own.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-8, weight_decay=0.05, fused=True)

    def infer() -> object:
        model.eval()
        with torch.inference_mode(), bench.autocast():
            return runner(x)

    def forward_backward() -> None:
        model.train()
        with bench.autocast():
            loss = F.cross_entropy(runner(xt).float(), y)
        loss.backward()

    def train_step() -> None:
        opt.zero_grad(set_to_none=True)
        forward_backward()
        opt.step()

    return infer, train_step, forward_backward


def section_vit(bench: Bench) -> Section:
    """Ours vs timm, same config and weights, interleaved: the ratio is the headline."""
    if bench.matmul_gflops is None:
        bench.matmul_gflops = matmul_peak(bench)["gflops"]["max"]
    rows = []
    for name, batch, train_batch in vit_cases(bench):
        torch.manual_seed(0)
        ours = vit.create_model(name)
        if not ours.num_classes:  # a backbone without a head (DINOv3): time it with ImageNet's
            ours = vit.create_model(name, num_classes=1000)
        ours = ours.to(bench.device)
        theirs = timm_twin(ours, name).to(bench.device)
        size = ours.config.img_size
        img = (size, size) if isinstance(size, int) else tuple(size)
        x = torch.randn(2, 3, *img, device=bench.device)
        with torch.inference_mode():
            max_diff = (ours.eval()(x) - theirs.eval()(x)).abs().max().item()
        fns, flops = {}, {}
        for who, model in (("ours", ours), ("timm", theirs)):
            infer, train, _ = step_fns(bench, model, batch, img, ours.num_classes, train_batch)
            fns[f"{who}_infer"], fns[f"{who}_train"] = infer, train
            infer, _, fwd_bwd = step_fns(bench, model, batch, img, ours.num_classes, train_batch, compile=False)
            flops[f"{who}_infer"] = count_flops(infer) / batch
            flops[f"{who}_train"] = count_flops(fwd_bwd) / train_batch
            model.zero_grad(set_to_none=True)
        infer_times = interleaved(bench, {k: fns[k] for k in ("ours_infer", "timm_infer")})
        train_times = interleaved(bench, {k: fns[k] for k in ("ours_train", "timm_train")})
        times = {**infer_times, **train_times}
        row: dict[str, Any] = {
            "model": name,
            "params": sum(p.numel() for p in ours.parameters()),
            "img_size": img[0],
            "tokens": math.prod(ours.patch_grid(x)) + ours.num_prefix_tokens,
            "infer_batch": batch,
            "train_batch": train_batch,
            "timm_fused_attn": bool(getattr(theirs.blocks[0].attn, "fused_attn", False)),
            "max_abs_logit_diff": max_diff,
        }
        for key, seconds in times.items():
            items = batch if key.endswith("infer") else train_batch
            row[f"{key}_img_s"] = rate(seconds, items)
            row[f"{key}_gflop_per_img"] = flops[key] / 1e9
            row[f"{key}_gflop_s"] = flops[key] * row[f"{key}_img_s"]["median"] / 1e9
            row[f"{key}_util"] = row[f"{key}_gflop_s"] / bench.matmul_gflops
            row[f"{key}_mfu"] = mfu(row[f"{key}_img_s"]["median"], flops[key], bench.peak_tflops)
        row["ratio_infer"] = paired_ratio(times["ours_infer"], times["timm_infer"])
        row["ratio_train"] = paired_ratio(times["ours_train"], times["timm_train"])
        rows.append(row)
        print(
            f"[vit] {name}: inference {row['ratio_infer']['median']:.3f}, training {row['ratio_train']['median']:.3f}"
        )
        del ours, theirs, fns
    header = ["model", "tokens", "batch inf/train", "inference img/s ours", "timm", "**ours/timm**"]
    header += ["training img/s ours", "timm", "**ours/timm**", "GFLOP/s ours inf/train", "util. inf/train"]
    if bench.peak_tflops:
        header += ["MFU ours inf/train", "timm"]
    table = [
        [
            f"`{r['model']}`",
            str(r["tokens"]),
            f"{r['infer_batch']}/{r['train_batch']}",
            fmt_spread(r["ours_infer_img_s"]),
            fmt_spread(r["timm_infer_img_s"]),
            fmt_ratio(r["ratio_infer"]),
            fmt_spread(r["ours_train_img_s"]),
            fmt_spread(r["timm_train_img_s"]),
            fmt_ratio(r["ratio_train"]),
            f"{r['ours_infer_gflop_s']:.0f} / {r['ours_train_gflop_s']:.0f}",
            f"{100 * r['ours_infer_util']:.0f}% / {100 * r['ours_train_util']:.0f}%",
        ]
        + (
            [
                f"{100 * r['ours_infer_mfu']:.1f}% / {100 * r['ours_train_mfu']:.1f}%",
                f"{100 * r['timm_infer_mfu']:.1f}% / {100 * r['timm_train_mfu']:.1f}%",
            ]
            if bench.peak_tflops
            else []
        )
        for r in rows
    ]
    notes = [
        "Same configuration and weights (timm's model of the same name, or its `VisionTransformer` built from "
        "our config, our state dict loaded strictly; logits agree to the `max_abs_logit_diff` in the JSON). "
        "Training step = forward, cross-entropy, backward, AdamW step (`fused=True`). img/s: median (min-max) "
        "over the repetitions; ours/timm: median (min-max) of the per-repetition ratios.",
        f"GFLOP/s = counted FLOPs per image (torch's FlopCounterMode; training = forward + backward) x img/s; "
        f"utilisation is against {bench.matmul_gflops:.0f} GFLOP/s, the best rate of a large matmul timed in this run. "
        "Ours counts fewer FLOPs than timm (the last block computes the CLS token only; see the JSON).",
    ]
    if bench.peak_tflops:
        notes.append(
            f"MFU (model FLOPs utilisation) = each model's own counted GFLOP/s over the GPU's data-sheet dense "
            f"bf16 peak, {bench.peak_tflops:.1f} TFLOP/s (`vit.tools.flops.PEAK_BF16_TFLOPS`)."
        )
    return Section("ViT: ours vs timm", header, table, rows, notes)


def vit_cases(bench: Bench) -> list[tuple[str, int, int]]:
    """(model, inference batch, training batch) of the vit section: --models, else the device's default."""
    if bench.vit_cases is not None:
        return bench.vit_cases
    if bench.quick:
        return VIT_CASES_QUICK
    return VIT_CASES_CUDA if bench.device.type == "cuda" else VIT_CASES


def parse_models(text: str) -> list[tuple[str, int, int]]:
    """`name:infer_batch:train_batch,...` (e.g. `vit_base_patch16_224:256:128`) into vit cases."""
    cases = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        parts = item.split(":")
        if len(parts) != 3 or not parts[1].isdigit() or not parts[2].isdigit():
            example = "vit_base_patch16_224:256:128"
            raise SystemExit(f"--models: {item!r} is not NAME:INFER_BATCH:TRAIN_BATCH (e.g. {example})")
        cases.append((parts[0], int(parts[1]), int(parts[2])))
    return cases


def section_attention(bench: Bench) -> Section:
    """One ViT-S attention layer (qkv, attention, proj), fused SDPA vs the explicit softmax(QK^T)V."""
    dim, heads = (64, 2) if bench.quick else (384, 6)
    rows = []
    for label, img, patch in ATTN_CASES_QUICK if bench.quick else ATTN_CASES:
        n = (img // patch) ** 2 + 1
        torch.manual_seed(0)
        attn = Attention(dim, heads).to(bench.device)
        x = torch.randn(1, n, dim, device=bench.device)

        fns = {
            f"{path}_{mode}": attention_call(bench, attn, x, path == "fused", mode == "train")
            for path in ("fused", "explicit")
            for mode in ("infer", "train")
        }
        times = interleaved(bench, fns, reps=bench.reps if bench.quick else max(3, bench.reps // 2))
        element = torch.finfo(bench.dtype).bits // 8
        row: dict[str, Any] = {
            "case": label,
            "tokens": n,
            "dim": dim,
            "heads": heads,
            "attn_matrix_bytes": heads * n * n * element,  # one (heads, N, N) score matrix, batch 1
        }
        for key, fn in fns.items():
            row[f"{key}_ms"] = spread([1e3 * s for s in times[key]])
            row[f"{key}_peak_bytes"] = peak_memory(bench, fn)
        row["speedup_train"] = paired_ratio(times["fused_train"], times["explicit_train"])
        rows.append(row)
        print(f"[attention] {n} tokens: fused {row['fused_train_ms']['median']:.1f} ms, explicit "
              f"{row['explicit_train_ms']['median']:.1f} ms (fwd+bwd)")  # fmt: skip
    header = ["input / patch", "tokens", "(H,N,N) matrix", "fwd ms fused", "explicit"]
    header += ["fwd+bwd ms fused", "explicit", "fused speed-up", "fwd peak fused", "explicit"]
    header += ["fwd+bwd peak fused", "explicit"]
    table = [
        [
            r["case"],
            str(r["tokens"]),
            fmt_bytes(r["attn_matrix_bytes"]),
            fmt_spread(r["fused_infer_ms"]),
            fmt_spread(r["explicit_infer_ms"]),
            fmt_spread(r["fused_train_ms"]),
            fmt_spread(r["explicit_train_ms"]),
            fmt_ratio(r["speedup_train"]),
            fmt_bytes(r["fused_infer_peak_bytes"]),
            fmt_bytes(r["explicit_infer_peak_bytes"]),
            fmt_bytes(r["fused_train_peak_bytes"]),
            fmt_bytes(r["explicit_train_peak_bytes"]),
        ]
        for r in rows
    ]
    notes = [
        f"`vit.layers.Attention({dim}, num_heads={heads})` (qkv and proj included), batch 1, "
        "`fused_attn` on (SDPA) or off (explicit softmax(QK^T/sqrt(d))V). ms: median (min-max).",
        "Peak: bytes allocated during the call above what was live before it; "
        + (
            "CUDA: `torch.cuda.max_memory_allocated`."
            if bench.device.type == "cuda"
            else "CPU: the profiler's allocation/free events (`profile_memory=True`) replayed in order, the "
            "kernels' scratch buffers included; tensor memory, not process RSS."
        )
        + " The explicit path holds the scores and the softmax, (H,N,N) each (and, training, their "
        "gradients): O(N^2); the fused kernel works in tiles and keeps O(N).",
    ]
    return Section("Attention: fused (SDPA) vs explicit against sequence length", header, table, rows, notes)


def attention_call(bench: Bench, attn: Attention, x: torch.Tensor, fused: bool, train: bool) -> Callable[[], None]:
    """One forward (inference) or forward + backward (training) of `attn` on the chosen path."""
    xg = x.clone().requires_grad_(True)

    def call() -> None:
        attn.fused_attn = fused
        attn.train(train)
        if not train:
            with torch.inference_mode(), bench.autocast():
                attn(x)
            return
        with bench.autocast():
            out = attn(xg)
        out.float().sum().backward()
        attn.zero_grad(set_to_none=True)
        xg.grad = None

    return call


def section_resnet(bench: Bench) -> Section:
    """ResNet baselines in the same run, NCHW and channels-last interleaved."""
    rows = []
    for name, img, batch, train_batch in RESNET_CASES_QUICK if bench.quick else RESNET_CASES:
        torch.manual_seed(0)
        fns, flops = {}, {}
        models = {}
        for layout in ("nchw", "channels_last"):
            model = vit.create_model(name).to(bench.device)
            if layout == "channels_last":
                model = model.to(memory_format=torch.channels_last)
            models[layout] = model
            num_classes = model.fc.out_features if hasattr(model, "fc") else model.linear.out_features
            args = (bench, model, batch, (img, img), num_classes, train_batch, layout == "channels_last")
            infer, train, _ = step_fns(*args)
            fns[f"{layout}_infer"], fns[f"{layout}_train"] = infer, train
            infer, _, fwd_bwd = step_fns(*args, compile=False)
            flops["infer"] = count_flops(infer) / batch
            flops["train"] = count_flops(fwd_bwd) / train_batch
            model.zero_grad(set_to_none=True)
        times = interleaved(bench, {k: v for k, v in fns.items() if k.endswith("infer")})
        times |= interleaved(bench, {k: v for k, v in fns.items() if k.endswith("train")})
        row: dict[str, Any] = {
            "model": name,
            "params": sum(p.numel() for p in models["nchw"].parameters()),
            "img_size": img,
            "infer_batch": batch,
            "train_batch": train_batch,
            "gflop_per_img_infer": flops["infer"] / 1e9,
            "gflop_per_img_train": flops["train"] / 1e9,
        }
        for key, seconds in times.items():
            row[f"{key}_img_s"] = rate(seconds, batch if key.endswith("infer") else train_batch)
        for mode in ("infer", "train"):
            row[f"gflop_s_{mode}"] = flops[mode] * row[f"nchw_{mode}_img_s"]["median"] / 1e9
        rows.append(row)
        print(f"[resnet] {name}: inference {row['nchw_infer_img_s']['median']:.1f} img/s")
    header = ["model", "params", "batch inf/train", "inference img/s NCHW", "channels-last"]
    header += ["training img/s NCHW", "channels-last", "GFLOP/s inf/train (NCHW)"]
    table = [
        [
            f"`{r['model']}` ({r['img_size']}px)",
            f"{r['params'] / 1e6:.1f}M",
            f"{r['infer_batch']}/{r['train_batch']}",
            fmt_spread(r["nchw_infer_img_s"]),
            fmt_spread(r["channels_last_infer_img_s"]),
            fmt_spread(r["nchw_train_img_s"]),
            fmt_spread(r["channels_last_train_img_s"]),
            f"{r['gflop_s_infer']:.0f} / {r['gflop_s_train']:.0f}",
        ]
        for r in rows
    ]
    notes = ["torchvision ResNets as registered in `vit.resnet`; training step as for the ViTs (AdamW here)."]
    return Section("Baselines: ResNet", header, table, rows, notes)


OP_KINDS = [
    ("matmul", ("aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "aten::matmul", "aten::baddbmm")),
    ("attention kernel", ("scaled_dot_product", "flash_attention", "efficient_attention")),
    ("convolution", ("convolution",)),
    ("layer norm", ("layer_norm",)),
    ("GELU", ("gelu",)),
    ("copy / cat / fill", ("aten::copy_", "aten::cat", "aten::fill_", "aten::zero_", "aten::clone", "aten::stack")),
    ("bias / norm grad sums", ("aten::sum",)),
    ("residual adds", ("aten::add", "aten::add_")),
    (
        "optimizer (AdamW)",
        ("_fused_adam", "_foreach", "aten::lerp", "aten::addcdiv", "aten::addcmul", "aten::sqrt", "aten::mul_"),
    ),
]


def op_kind(name: str) -> str:
    for kind, patterns in OP_KINDS:
        if any(name == p or (not p.startswith("aten::") and p in name) for p in patterns):
            return kind
    return "other"


def section_profile(bench: Bench) -> Section:
    """Where a ViT training step spends its time: self time per kind of op, ours and timm's."""
    name, batch = ("vit_nano_patch4_16", 8) if bench.quick else ("vit_small_patch16_224", 8)
    torch.manual_seed(0)
    ours = vit.create_model(name).to(bench.device)
    theirs = timm_twin(ours).to(bench.device)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if bench.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    totals: dict[str, dict[str, float]] = {}
    counts: dict[str, dict[str, int]] = {}
    for who, model in (("ours", ours), ("timm", theirs)):
        _, train, _ = step_fns(bench, model, 1, ours.patch_embed.img_size, ours.num_classes, batch)
        for _ in range(max(1, bench.warmup)):
            train()
        with torch.profiler.profile(activities=activities) as prof:
            train()
            bench.sync()
        per_kind: dict[str, float] = {}
        calls: dict[str, int] = {}
        for event in prof.key_averages():
            self_us = event.self_device_time_total if bench.device.type == "cuda" else event.self_cpu_time_total
            kind = op_kind(event.key)
            per_kind[kind] = per_kind.get(kind, 0.0) + self_us / 1e3
            calls[kind] = calls.get(kind, 0) + event.count
        totals[who], counts[who] = per_kind, calls
    kinds = [k for k, _ in OP_KINDS] + ["other"]
    rows = [
        {
            "kind": k,
            "ours_ms": totals["ours"].get(k, 0.0),
            "timm_ms": totals["timm"].get(k, 0.0),
            "ours_calls": counts["ours"].get(k, 0),
            "timm_calls": counts["timm"].get(k, 0),
        }
        for k in kinds
    ]
    sums = {who: sum(totals[who].values()) for who in totals}
    table = [
        [
            r["kind"],
            f"{r['ours_ms']:.0f} ({100 * r['ours_ms'] / sums['ours']:.0f}%)",
            str(r["ours_calls"]),
            f"{r['timm_ms']:.0f} ({100 * r['timm_ms'] / sums['timm']:.0f}%)",
            str(r["timm_calls"]),
        ]
        for r in rows
    ]
    table.append(["total", f"{sums['ours']:.0f}", "", f"{sums['timm']:.0f}", ""])
    device = "device" if bench.device.type == "cuda" else "CPU"
    notes = [
        f"`{name}`, one training step (batch {batch}, forward + backward + AdamW) under `torch.profiler`, "
        f"self {device} time in ms by kind of op (one step each, so absolute times are noisy; see the ViT "
        "section for speed). Calls: number of op invocations.",
    ]
    return Section(f"Where the time goes: {name} training step", ["kind of op", "ours ms", "calls", "timm ms", "calls"],
                   table, rows, notes)  # fmt: skip


SECTIONS: dict[str, Callable[[Bench], Section]] = {
    "vit": section_vit,
    "attention": section_attention,
    "resnet": section_resnet,
    "profile": section_profile,
    "data": section_data,
}


# --------------------------------------------------------------------------- report


def machine(bench: Bench) -> dict[str, Any]:
    info: dict[str, Any] = {
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "mkldnn": torch.backends.mkldnn.is_available(),
        "device": str(bench.device),
        "dtype": str(bench.dtype),
        "compile": bench.compile,
    }
    with contextlib.suppress(ImportError):
        import timm

        info["timm"] = timm.__version__
    with contextlib.suppress(ImportError):
        import albumentations

        info["albumentations"] = albumentations.__version__
    if bench.device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(bench.device)
    with contextlib.suppress(OSError):
        info["load_average_start"] = os.getloadavg()
    return info


def to_markdown(report: dict[str, Any], sections: dict[str, Section]) -> str:
    m = report["machine"]
    lines = [
        "# Benchmark results",
        "",
        f"Command: `{report['command']}`",
        "",
        f"Machine: {m['cpu']}, {m['cpu_count']} CPUs, torch threads: {m['torch_threads']}; "
        f"{m['device']}{' (' + m['gpu'] + ')' if 'gpu' in m else ''}, {m['dtype']}, compile={m['compile']}; "
        f"torch {m['torch']}, timm {m.get('timm', '-')}, Python {m['python']}. "
        f"Load average at start/end: {fmt_load(m.get('load_average_start'))} / {fmt_load(m.get('load_average_end'))}.",
        "",
        f"Date {report['date']}; {report['repetitions']} repetitions after {report['warmup']} warm-up; "
        f"matmul peak ({report['matmul']['n']}^2, {report['matmul']['dtype']}): "
        f"{fmt_spread(report['matmul']['gflops'])} GFLOP/s; wall time {report['wall_seconds']:.0f} s.",
    ]
    for section in sections.values():
        lines += ["", f"## {section.title}", ""]
        lines += markdown_table(section.header, section.table)
        lines += [""] + [f"{note}\n" for note in section.notes]
    return "\n".join(lines).rstrip() + "\n"


def fmt_load(load: Any) -> str:
    return "-" if not load else ", ".join(f"{x:.1f}" for x in load)


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, from {', '.join(SECTIONS)}")
    p.add_argument("--quick", action="store_true", help="tiny configs and few repetitions (CI smoke run)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="compute dtype (autocast unless fp32)")
    p.add_argument("--compile", action="store_true", help="torch.compile every model (ours and timm's alike)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: the CPUs this process may use)")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions (default 5, quick 2)")
    p.add_argument("--warmup", type=int, default=None, help="untimed warm-up calls (default 1, 2 with --compile)")
    p.add_argument("--models", default=None, help="vit section cases NAME:INFER_BATCH:TRAIN_BATCH,... (default: "
                   "ViT-B/16 and ViT-L/16 at 224 on CUDA, small ViTs on the CPU)")  # fmt: skip
    # Relative to the working directory: the defaults suit a run from the checkout, as documented.
    p.add_argument("--data-root", default="../shared/data", help="holds cifar10/, tiny-imagenet-200/")
    p.add_argument("--out", default="benchmarks/results", help="directory for the JSON and markdown")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    names = [s.strip() for s in args.sections.split(",") if s.strip()]
    if unknown := [s for s in names if s not in SECTIONS]:
        raise SystemExit(f"unknown section(s) {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    threads = args.threads or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())
    torch.set_num_threads(threads)
    bench = Bench(
        device=torch.device(args.device),
        dtype=DTYPES[args.dtype],
        compile=args.compile,
        quick=args.quick,
        reps=args.reps or (2 if args.quick else 5),
        warmup=args.warmup if args.warmup is not None else (2 if args.compile else 1),
        data_root=Path(args.data_root),
        min_sample_s=0.02 if args.quick else 0.5,
        vit_cases=parse_models(args.models) if args.models else None,
    )
    if bench.device.type == "cuda" and bench.dtype == torch.bfloat16:
        bench.peak_tflops = peak_tflops(torch.cuda.get_device_name(bench.device))
    command = "python scripts/benchmark.py " + " ".join(sys.argv[1:] if argv is None else argv)
    report: dict[str, Any] = {
        "command": command.strip(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": machine(bench),
        "repetitions": bench.reps,
        "warmup": bench.warmup,
    }
    sections: dict[str, Section] = {}
    start = time.perf_counter()
    report["matmul"] = matmul_peak(bench)
    bench.matmul_gflops = report["matmul"]["gflops"]["max"]  # the best rate seen: the machine's limit
    print(f"[matmul] {bench.matmul_gflops:.0f} GFLOP/s", flush=True)
    report["section_seconds"] = {}
    for name in names:
        section_start = time.perf_counter()
        sections[name] = SECTIONS[name](bench)
        report["section_seconds"][name] = time.perf_counter() - section_start
    report["wall_seconds"] = time.perf_counter() - start
    with contextlib.suppress(OSError):
        report["machine"]["load_average_end"] = os.getloadavg()
    report["sections"] = {name: {"title": s.title, "notes": s.notes, "rows": s.rows} for name, s in sections.items()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "benchmark_quick" if args.quick else "benchmark"
    (out / f"{stem}.json").write_text(json.dumps(report, indent=1) + "\n")
    markdown = to_markdown(report, sections)
    (out / f"{stem}.md").write_text(markdown)
    print(markdown)
    return report


def cli() -> None:
    """The `vit-bench` command (an entry point's return value would become the exit status)."""
    main()


if __name__ == "__main__":
    cli()
