"""What the data work costs the training process, with the device pipeline's work in the training process
(on demand, or a batch ahead in a thread as on a GPU) and in a data process (`data.data_process`):
its CPU time a batch (all its threads; the loader workers and the data process not counted), its
main thread's, the torch ops it dispatches a batch, and the data path's img/s, on the synthetic
ImageNet-like tree (vit.tools.data_check). `--end-to-end`: instead, img/s through `scripts/train.py
fit` with the recipes' smallest models. Run it alone:
`flock /tmp/vit-bench.lock python -m benchmarks.data_process [--end-to-end]`."""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.report import OpCount

RECIPES = {"configs/imagenet_vit_b16.yaml": "vit_tiny_patch16_224", "configs/imagenet_resnet50.yaml": "resnet18"}
MODES = {
    "in the training process, on demand": ["--data.data_process", "false", "--data.device.prefetch", "0"],
    "in the training process, a thread a batch ahead": ["--data.data_process", "false", "--data.device.prefetch", "1"],
    "data process": ["--data.data_process", "true", "--data.device.prefetch", "1"],
}


def counted(stage: Callable[[Any, torch.device], Any], counter: list[int]) -> Callable[[Any, torch.device], Any]:
    def run(batch: Any, device: torch.device) -> Any:
        with OpCount() as mode:
            out = stage(batch, device)
        counter[0] += mode.count
        return out

    return run


def cost(config: str, root: Path, batch: int, workers: int, steps: int, warmup: int, mode: list[str]) -> dict:
    """img/s, the training process's CPU ms a batch (whole process, main thread) and its torch ops a batch."""
    from vit.tools.data_check import DataCase, build

    options = ["--data.batch_size", str(batch), "--data.num_workers", str(workers), "--data.pipeline", "device"]
    case = DataCase(config, root, "cpu", steps, warmup, [*options, *mode])
    device = torch.device("cpu")
    with tempfile.TemporaryDirectory() as workdir:
        data = build(case, workdir).datamodule
        data.setup("fit")
        loader = data.train_dataloader()
        loader.device = lambda: device
        epoch, drawn, timed = 0, 0, []
        while drawn < steps:  # epoch after epoch, each batch through the datamodule's device-side step
            loader.sampler.set_epoch(epoch)
            batches = iter(loader)
            while drawn < steps:
                wall, cpu, main = time.perf_counter(), time.process_time(), time.thread_time()
                item = next(batches, None)
                if item is None:
                    break
                data.on_after_batch_transfer(data.transfer_batch_to_device(item, device, 0), 0)
                drawn += 1
                if drawn > warmup:
                    timed.append((time.perf_counter() - wall, time.process_time() - cpu, time.thread_time() - main))
            epoch += 1
        # the ops, over a few more batches: the main thread's and, in the training process, the stages' threads'
        in_stages = [0]
        if not data.data_process and data.device.prefetch:  # the stages run in threads the main one does not see
            loader.stages = [counted(stage, in_stages) for stage in loader.stages]
        loader.sampler.set_epoch(epoch)
        batches, counts = iter(loader), []
        next(batches)
        for _ in range(4):
            before = in_stages[0]
            with OpCount() as main_ops:
                item = next(batches)
                data.on_after_batch_transfer(data.transfer_batch_to_device(item, device, 0), 0)
            counts.append(main_ops.count + in_stages[0] - before)
        del batches
        loader.close()
        del loader
        gc.collect()
    seconds = [sum(column) for column in zip(*timed, strict=True)]
    return {
        "img/s": len(timed) * batch / seconds[0],
        "cpu_ms": 1000 * seconds[1] / len(timed),
        "main_ms": 1000 * seconds[2] / len(timed),
        "ops": statistics.median(counts),
    }


class Zeros:
    """A stage that makes a batch of `side` x `side` images and does nothing else."""

    def __init__(self, side: int) -> None:
        self.side = side

    def __call__(self, batch: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros(len(batch), 3, self.side, self.side), batch


def hand_over(batch: int, batches: int = 60) -> None:
    """The training process's CPU ms a batch for taking batches from a data process alone, at 8 px
    (the message and buffer bookkeeping) and at 224 px (plus the copy out of the buffer, which a
    GPU makes on the device)."""
    from vit.data.prefetch import PreparedLoader

    for side in (8, 224):
        loader = PreparedLoader(torch.arange(batch * batches), batch_size=batch, prepare=Zeros(side), process=True)
        taken = iter(loader)
        next(taken)
        cpu, main, n = time.process_time(), time.thread_time(), 0
        for _ in taken:
            n += 1
        cpu, main = (1000 * (time.process_time() - cpu) / n, 1000 * (time.thread_time() - main) / n)
        print(f"| hand-over alone, {side} px | {cpu:.2f} ({main:.2f}) |", flush=True)
        loader.close()


def main() -> None:
    from vit.tools.data_check import synthetic_tree_wanted, write_synthetic_imagenet

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, help="the tree (default: 400 synthetic images in a temp dir)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--workers", type=int, default=1, help="loader workers")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--end-to-end", action="store_true", help="img/s through scripts/train.py fit instead")
    parser.add_argument("--reps", type=int, default=3, help="--end-to-end: runs of each, alternating")
    args = parser.parse_args()
    root = args.root or Path(tempfile.mkdtemp(prefix="vit-data-process-")) / "original"
    if synthetic_tree_wanted(root):
        write_synthetic_imagenet(root, train=400, val=40, classes=10)
    if args.end_to_end:
        end_to_end(root, args)
        return
    print(f"batch {args.batch}: the training process's CPU ms a batch (main thread)")
    print("| what | ms |\n|---|---:|")
    hand_over(args.batch)
    print(f"224 px, batch {args.batch}, {args.workers} loader worker(s), {args.steps - args.warmup} batches timed")
    print("| recipe | device_decode's work | data path img/s | training process CPU ms a batch (main thread) "
          "| torch ops a batch in the training process |")  # fmt: skip
    print("|---|---|---:|---:|---:|")
    for config in RECIPES:
        for name, mode in MODES.items():
            r = cost(config, root, args.batch, args.workers, args.steps, args.warmup, mode)
            print(f"| {Path(config).stem} | {name} | {r['img/s']:,.0f} | {r['cpu_ms']:.1f} ({r['main_ms']:.1f}) "
                  f"| {r['ops']:.0f} |", flush=True)  # fmt: skip


def end_to_end(root: Path, args: argparse.Namespace) -> None:
    """scripts/train.py fit img/s, 128 px, the data work in the training process (a batch at a time)
    against the data process, median of `reps` alternating runs."""
    from vit.tools.data_check import DataCase, end_to_end_speed

    modes = {k: MODES[k] for k in ("in the training process, on demand", "data process")}
    print(f"128 px, batch {args.batch // 2}, {args.workers} loader worker(s), 30 steps timed after 6")
    print("| recipe (model) | " + " | ".join(modes) + " | data process / on demand |")
    print("|---|---:|---:|---:|")
    for config, model in RECIPES.items():
        speeds: dict[str, list[float]] = {name: [] for name in modes}
        for _ in range(args.reps):
            for name, mode in modes.items():
                options = ["--model.model_name", model, "--data.img_size", "128", "--data.batch_size",
                           str(args.batch // 2), "--data.num_workers", str(args.workers), "--data.pipeline",
                           "device", *mode]  # fmt: skip
                speeds[name].append(end_to_end_speed(DataCase(config, root, "cpu", 36, 6, options), False)[0])
        here, there = (statistics.median(v) for v in speeds.values())
        print(f"| {Path(config).stem} ({model}) | {here:,.1f} | {there:,.1f} | {there / here:.2f} |", flush=True)


if __name__ == "__main__":
    main()
