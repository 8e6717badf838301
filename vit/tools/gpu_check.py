"""One command that runs every GPU path of the pipeline and says whether it works and how fast:
`scripts/gpu_check.py` (`make gpu-check`).

On a machine with CUDA GPUs, in a few minutes: a bf16-mixed fit of ViT-S/16 on synthetic data,
eager and under torch.compile; our attention under `sdpa_kernel([SDPBackend.FLASH_ATTENTION])`
(forward and backward; the flash kernel must be the one that ran); a channels-last ResNet-50
bf16-mixed fit; vit.sharding.ShardedStrategy (FSDP2) over every visible GPU; NCCL DDP when there
are two or more. `--checks data` adds the data check (vit.tools.data_check): whether decoding on
the GPU leaves memory in use alone and gives the same batches ahead of the step, then the ImageNet
recipes' loader, model and end-to-end speeds on a synthetic JPEG tree. It prints a table (what
ran, img/s, peak memory, model FLOPs utilisation against the GPU's dense bf16 peak) and exits 1 if
anything failed. Without a CUDA GPU it says so and exits 0.

`--device cpu` runs the same code on the CPU in float32 (a debug path: `--steps 3 --model
vit_nano_patch4_16`, under a minute), with batches of 8 and a ResNet-18 at 32 px unless --batch,
--resnet and --resnet-img-size say otherwise; the tests use it, so the table, the FLOP count and the
MFU arithmetic are checked without a GPU.

MFU = (training FLOPs per image x images per second) / (peak FLOP/s x GPUs), with training FLOPs
= 3 x the forward's (the backward is twice the forward; recomputation by activation checkpointing is
not counted, the usual convention), the forward's counted by torch's FlopCounterMode over matmuls,
convolutions and attention (2 FLOPs per multiply-add).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from vit.tools.data_check import (
    ROOT,
    VARIANTS,
    DataCase,
    check_recipe,
    decoder_race,
    host_syncs,
    prefetch_agrees,
    unknown_variants,
)
from vit.tools.fit_timing import FitCase, Row, format_table, run_fit, square_side
from vit.tools.flops import mfu, peak_tflops
from vit.tools.synthetic_imagenet import synthetic_tree_wanted, write_synthetic_imagenet

# -- the flash attention check ------------------------------------------------------------------


def check_flash(model_name: str, device: str, batch: int = 8) -> Row:
    """Forward and backward of `model_name` with SDPA restricted to the flash kernel (an error if
    our attention cannot use it), and the profiler's proof that a flash kernel ran."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from vit.registry import create_model, model_config

    img_size = square_side(model_config(model_name).img_size)
    model = create_model(model_name).to(device).train()
    x = torch.randn(batch, 3, img_size, img_size, device=device)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device == "cuda" else contextlib.nullcontext()
    with (
        sdpa_kernel([SDPBackend.FLASH_ATTENTION]),
        autocast,
        torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof,
    ):
        model(x).float().sum().backward()
    ops = {e.key for e in prof.key_averages()}
    flash = sorted(op for op in ops if "flash_attention" in op)
    if not any("backward" not in op for op in flash):
        attention = sorted(op for op in ops if "attention" in op)
        raise AssertionError(f"no flash attention kernel ran; attention ops: {attention}")
    return Row(f"flash SDPA ({model_name}, fwd+bwd)", True, note=", ".join(flash))


# -- the plan ---------------------------------------------------------------------------------


CHECKS = ("fit", "compile", "flash", "resnet", "sharded", "ddp", "data")  # --checks, in the order they run
DEFAULT_CHECKS = CHECKS[:-1]  # the data check (vit.tools.data_check) writes a tree and runs 7 fits a recipe: on request


def plan(args: argparse.Namespace, peak: float | None) -> list[tuple[str, Callable[[], Row | Iterable[Row]]]]:
    """(name, check) in the order they run, those --checks names; the distributed ones in
    subprocesses (Lightning starts one process per device by running the command again)."""
    device, steps, batch = args.device, args.steps, args.batch
    short = re.sub(r"^vit_|_224$", "", args.model)

    def fit(check: str, **kw: Any) -> Callable[[], Row]:
        return lambda: run_fit(FitCase(check, steps=steps, batch=batch, device=device, peak=peak, **kw))[0]

    checks = [("fit", f"{short} fit", fit(f"{short} fit, eager", model=args.model))]
    if device == "cuda" or args.compile_on_cpu:
        checks.append(
            ("compile", f"{short} compile", fit(f"{short} fit, torch.compile", model=args.model, compile=True))
        )
    checks.append(("flash", "flash", lambda: check_flash(args.model, device)))
    resnet = fit(
        f"{args.resnet} channels-last fit", model=args.resnet, channels_last=True, img_size=args.resnet_img_size
    )
    checks.append(("resnet", args.resnet, resnet))
    if args.processes >= 1:
        checks.append(("sharded", "sharded", lambda: run_worker(args, "sharded", peak)))
    if args.processes >= 2:
        checks.append(("ddp", "ddp", lambda: run_worker(args, "ddp", peak)))
    if args.data_recipes:
        checks.append(("data", "device decoding", lambda: check_device_decoding(args)))
    for recipe in args.data_recipes:
        checks.append(("data", f"data: {recipe}", lambda recipe=recipe: run_data_check(args, recipe, peak)))
    return [(label, check) for key, label, check in checks if key in args.checks]


def _small_model(recipe: str) -> str:
    """The CPU's stand-in for a recipe's model: the smallest of its family (ViT-Ti/16, ResNet-18)."""
    import yaml

    name = yaml.safe_load((ROOT / recipe).read_text())["model"]["init_args"]["model_name"]
    return "resnet18" if name.startswith("resnet") else "vit_tiny_patch16_224"


def check_device_decoding(args: argparse.Namespace, iterations: int = 100) -> list[Row]:
    """Decoding on the device gives the right pixels: on CUDA, it does not overwrite memory that
    kernels queued on the caller's stream have yet to read (vit.tools.data_check.decoder_race:
    torchvision's decoder alone counted beside ours, to show whether this GPU races at all) and
    makes the host wait for the device once a batch (host_syncs); and the first data recipe's
    batches decoded ahead by a thread equal those decoded on demand."""

    rows = []
    if args.device == "cuda":
        corrupted = decoder_race(args.device, iterations)
        ours, theirs = corrupted["vit decode_batch"], corrupted["torchvision decode_jpeg"]
        note = (f"iterations with memory overwritten before queued kernels read it: vit decode_batch "
                f"{ours}/{iterations}, torchvision decode_jpeg alone {theirs}/{iterations}")  # fmt: skip
        if theirs == 0:
            note += " (the race did not show on this GPU: the check could not fail here)"
        rows.append(Row("nvJPEG decode vs queued kernels", ours == 0, note=note))
        syncs = host_syncs(args.device)
        note = (f"{len(syncs)} in decoding, augmenting and normalising 32 images, at {', '.join(syncs) or '-'} "
                f"(1 expected: the drain before the decoder)")  # fmt: skip
        rows.append(Row("host waits for the device, one batch", len(syncs) <= 1, note=note))
    same, note = prefetch_agrees(_data_case(args, args.data_recipes[0]))
    rows.append(Row("batches decoded ahead = on demand", same, note=note))
    return rows


def _data_case(args: argparse.Namespace, recipe: str) -> Any:
    """vit.tools.data_check's case for `recipe` on the synthetic tree (written once, on first use)."""

    cuda = args.device == "cuda"
    if args.data_root is None:
        args.data_root = tempfile.mkdtemp(prefix="vit-data-check-")
    root = Path(args.data_root)
    if synthetic_tree_wanted(root):
        images = args.data_images or (4000 if cuda else 48)
        size, classes = ((500, 375), 100) if cuda else ((120, 90), 4)
        made = write_synthetic_imagenet(root, train=images, val=max(classes, images // 10), classes=classes, size=size)
        print(f"[gpu-check] wrote {made['images']} images of ~{size[0]}x{size[1]} ({made['mean_kb']:.0f} KB mean) "
              f"in {root}", flush=True)  # fmt: skip
    steps, warmup = args.data_steps or (60 if cuda else 3), args.data_warmup or (20 if cuda else 1)
    small = [] if cuda else [
        "--data.img_size", "96", "--data.batch_size", "8", "--data.num_workers", "1",
        "--model.model_name", _small_model(recipe),
    ]  # fmt: skip
    return DataCase(recipe, root, args.device, steps + warmup, warmup, small)


def run_data_check(args: argparse.Namespace, recipe: str, peak: float | None) -> Iterator[Row]:
    """vit.tools.data_check for one recipe, on the synthetic tree (written once, on first use):
    its rows as they are measured."""

    case = _data_case(args, recipe)
    compiled = args.device == "cuda" or args.compile_on_cpu
    for check, speed, note, flops in check_recipe(case, compiled, args.data_variants):
        yield Row(check, True, speed, note=note, mfu=mfu(speed, flops, peak) if flops else None)


def run_worker(args: argparse.Namespace, strategy: str, peak: float | None) -> Row:
    """A distributed fit in its own process group: `python -m vit.tools.gpu_check --worker ...`."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "row.json"
        command = [
            sys.executable, "-m", "vit.tools.gpu_check", "--worker", strategy, "--json", str(out),
            "--device", args.device, "--processes", str(args.processes), "--model", args.model,
            "--steps", str(args.steps), "--batch", str(args.batch), "--peak-tflops", str(peak or 0),
        ]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE")}
        result = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout, env=env)
        # An abort once the fit is done and its row written is torch's process-group teardown
        # (gloo's threads at exit, seen on loaded CPUs): the fit stands, and the row says so.
        aborted_after = result.returncode == -signal.SIGABRT and out.is_file()
        if (result.returncode != 0 and not aborted_after) or not out.is_file():
            tail = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["no output"]
            raise RuntimeError(f"worker exited {result.returncode}: {tail[0]}")
        row = Row(**json.loads(out.read_text()))
        if aborted_after:
            row.note += "; the worker aborted at exit, after the fit (process-group teardown)"
        return row


def worker(args: argparse.Namespace) -> None:
    """One distributed fit; rank 0 writes its row to --json."""
    from vit.fault_tolerance import destroy_process_group

    short = re.sub(r"^vit_|_224$", "", args.model)
    name = "ShardedStrategy (FSDP2)" if args.worker == "sharded" else "DDP"
    case = FitCase(
        f"{short} {name} x {args.processes}", args.model, args.steps, args.batch, args.device,
        strategy=args.worker, devices=args.processes, peak=args.peak_tflops or None,
    )  # fmt: skip
    row, backend = run_fit(case)
    if args.device == "cuda" and backend != "nccl":
        raise RuntimeError(f"{name} on GPUs ran on {backend}, not nccl")
    if int(os.environ.get("LOCAL_RANK", 0)) == 0 and int(os.environ.get("NODE_RANK", 0)) == 0:
        Path(args.json).write_text(json.dumps(asdict(row)))
    destroy_process_group()  # exit 0 after a good fit, not a teardown abort


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto", help="cpu: the float32 debug path")
    p.add_argument("--model", default="vit_small_patch16_224")
    p.add_argument(
        "--resnet", help="the channels-last ResNet fit's model (default resnet50; resnet18 with --device cpu)"
    )
    p.add_argument("--resnet-img-size", type=int, help="its image size (default 224; 32 with --device cpu)")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps per fit (timed after the first 10)")
    p.add_argument("--batch", type=int, help="images per device and step (default 128; 8 with --device cpu)")
    p.add_argument("--processes", type=int, default=None, help="for the sharded and DDP fits (default: every GPU)")
    p.add_argument("--peak-tflops", type=float, default=None, help="bf16 peak per device (default: the GPU table)")
    p.add_argument("--compile-on-cpu", action="store_true", help="also run the torch.compile fit with --device cpu")
    p.add_argument("--checks", default=",".join(DEFAULT_CHECKS),
                   help=f"comma-separated, from {', '.join(CHECKS)} (default: all but data)")  # fmt: skip
    p.add_argument("--timeout", type=int, default=900, help="seconds for each distributed fit")
    p.add_argument("--data-recipes", default="configs/imagenet_vit_b16.yaml,configs/imagenet_resnet50.yaml",
                   help="the data check's configs, comma-separated")  # fmt: skip
    p.add_argument("--data-root", help="the data check's image tree (default: a synthetic one, written to a temp dir)")
    p.add_argument("--data-images", type=int, help="synthetic training images (default 4000; 48 on the CPU)")
    p.add_argument("--data-steps", type=int, help="timed steps per data measurement (default 60; 3 on the CPU)")
    p.add_argument("--data-warmup", type=int, help="untimed steps before them (default 20; 1 on the CPU)")
    p.add_argument("--data-variants", default=",".join(VARIANTS),
                   help="each recipe's variants, comma-separated (none: ''): prefetch (the other "
                        "device.prefetch), decode (the other pipeline), streaming (litdata chunks), "
                        "worker-decode<share> (data.device.worker_decode, e.g. worker-decode0.5), "
                        "cap<N> (a copy with the longer side capped at N, e.g. cap320), "
                        "switch<us> (Python's thread switch interval, e.g. switch100), "
                        "<option>=<value> (a scripts/train.py option, e.g. data.pin_memory=false), "
                        "sync (the host waits for the device after every step, as a progress bar does)")  # fmt: skip
    p.add_argument("--json", help="write the rows here (a worker: its row)")
    p.add_argument("--worker", choices=("sharded", "ddp"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    # The CPU is a debug path: a GPU-sized ResNet-50 fit (128 images of 224 px a step) takes minutes there.
    cpu = args.device == "cpu"
    defaults = {
        "resnet": "resnet18" if cpu else "resnet50",
        "resnet_img_size": 32 if cpu else 224,
        "batch": 8 if cpu else 128,
    }
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.checks = [c.strip() for c in args.checks.split(",") if c.strip()]
    args.data_recipes = [c.strip() for c in args.data_recipes.split(",") if c.strip()]
    args.data_variants = [v.strip() for v in args.data_variants.split(",") if v.strip()]
    if unknown := unknown_variants(args.data_variants):
        p.error(f"--data-variants: unknown {', '.join(unknown)}; choose from {', '.join(VARIANTS)}, "
                "sync, worker-decode<share>, cap<N>, switch<us> or <option>=<value>")  # fmt: skip
    if unknown := [c for c in args.checks if c not in CHECKS]:
        p.error(f"--checks: unknown {', '.join(unknown)}; choose from {', '.join(CHECKS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "none"
    if args.device in ("cuda", "none") and not torch.cuda.is_available():
        print(
            "No CUDA GPU found: nothing to check (the GPU paths were not run). "
            "`--device cpu` runs the checks' code on the CPU."
        )
        return 0
    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    if args.processes is None:
        args.processes = gpus
    name = torch.cuda.get_device_name(0) if args.device == "cuda" else "CPU"
    peak = args.peak_tflops if args.peak_tflops is not None else peak_tflops(name)
    print(f"{name} x {gpus or 1}; bf16 peak {f'{peak:g} TFLOP/s' if peak else 'unknown'}; torch {torch.__version__}"
          + (f", CUDA {torch.version.cuda}" if args.device == "cuda" else ""), flush=True)  # fmt: skip
    rows: list[Row] = []

    def keep(row: Row) -> None:
        rows.append(row)
        if args.json:  # after each row, so a run cut short keeps what it measured
            Path(args.json).write_text(json.dumps([asdict(r) for r in rows], indent=1))

    for label, check in plan(args, peak):
        print(f"[gpu-check] {label} ...", flush=True)
        try:
            done = check()
            for row in [done] if isinstance(done, Row) else done:  # a check's rows as they are measured
                keep(row)
        except Exception as e:  # every failure is a row; the run goes on to the next check
            traceback.print_exc()
            keep(Row(label, False, note=f"{type(e).__name__}: {e}".replace("\n", " ")[:300]))
        finally:
            if args.device == "cuda":
                torch.cuda.empty_cache()
    print()
    print(format_table(rows))
    failed = [r.check for r in rows if not r.ok]
    if failed:
        print(f"\nFAILED: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


def cli() -> None:
    sys.exit(main())


if __name__ == "__main__":
    cli()
