"""The data check (`scripts/gpu_check.py --checks data`): does the shipped ImageNet recipes' data
keep up with their models?

It writes a synthetic ImageNet-like JPEG tree (about 500x375 pixels, about 98 KB at quality 90, as
ImageNet's photos are; one image in 20 greyscale and one in 20 a PNG, which decoders treat apart),
then, for each recipe (`configs/imagenet_vit_b16.yaml`, `configs/imagenet_resnet50.yaml`, as
`scripts/train.py` builds them, on one device):

- the data path alone: images per second out of `train_dataloader()` (its workers and
  augmentation as configured) through the datamodule's work on the device;
- the model alone: a Lightning fit on synthetic tensors already on the device (vit.tools.gpu_check);
- end to end: `scripts/train.py fit` on the tree, eager and (on a GPU) compiled, and its share of
  the model's own speed, the number the data path has to bring to 100%.

Each recipe is measured as its config sets `data.pipeline` (device in the shipped ImageNet configs:
decoding and augmentation on the training device, vit.data.device, on a GPU a batch ahead of the
step: vit.data.prefetch); then, eager, with the other `device.prefetch` (0 on a GPU: each batch
decoded when its step begins; 1 on the CPU), with the other path (per sample, in the loader
workers), and from the tree converted to streaming chunks (vit.data.streaming), so one run
compares them. First it checks the device decoding itself: on a GPU, that it does not overwrite
memory the model's queued kernels still read (`decoder_race`) and makes the host wait for the
device once a batch (`host_syncs`); and that batches decoded ahead equal those decoded on demand
(`prefetch_agrees`).

Each speed is taken after the first `warmup` steps. On a CPU the same code runs at a small image
size and few steps (the tests use it); the numbers that matter come from a GPU node.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import os
import re
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vit.tools.fit_audit import DeviceBusy, SyncAudit, sync_sites
from vit.tools.fit_timing import FitCase, run_fit
from vit.tools.synthetic_imagenet import photo_jpeg

# Re-exported: the data studies (benchmarks/data_*.py) and tests import the synthetic ImageNet from here.
from vit.tools.synthetic_imagenet import synthetic_photo as synthetic_photo
from vit.tools.synthetic_imagenet import synthetic_tree_wanted as synthetic_tree_wanted
from vit.tools.synthetic_imagenet import write_synthetic_imagenet as write_synthetic_imagenet
from vit.training import StepTimer

RECIPES = ("configs/imagenet_vit_b16.yaml", "configs/imagenet_resnet50.yaml")
ROOT = Path(__file__).resolve().parents[2]


# -- the three speeds ----------------------------------------------------------------------------


@dataclass
class DataCase:
    """One recipe on one device: `overrides` are extra `scripts/train.py` options (the CPU's small sizes)."""

    config: str
    root: Path
    device: str  # "cuda" or "cpu"
    steps: int
    warmup: int
    overrides: list[str] = field(default_factory=list)
    streaming: bool = False  # root holds the tree converted to litdata chunks (vit.data.StreamingDataModule)
    switch_interval: float | None = None  # seconds: the interpreter's thread switch interval while measured
    sync_each_step: bool = False  # the host waits for the device after every step (StepTimer)

    def args(self, workdir: str, *extra: str) -> list[str]:
        """The recipe's `scripts/train.py fit` options, on one device, training only, nothing saved."""
        device = ["--trainer.accelerator", "gpu"] if self.device == "cuda" else [
            "--trainer.accelerator", "cpu", "--trainer.precision", "32-true"]  # fmt: skip
        source = ["--data", "vit.data.StreamingDataModule"] if self.streaming else []
        return [
            "--config", str(ROOT / self.config), *source, "--data.root", str(self.root), "--trainer.devices", "1",
            "--trainer.strategy", "auto", *device, "--trainer.default_root_dir", workdir,
            "--trainer.max_steps", str(self.steps), "--trainer.limit_val_batches", "0",
            "--trainer.num_sanity_val_steps", "0", "--trainer.logger", "false",
            "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
            "--checkpoint.save_last", "false", "--checkpoint.save_top_k", "0", *self.overrides, *extra,
        ]  # fmt: skip


def build(case: DataCase, workdir: str, *extra: str) -> Any:
    """The recipe's model and datamodule as `scripts/train.py` builds them (with `extra` options), not run."""
    from vit.cli import TrainCLI

    with _quiet():
        return TrainCLI(args=case.args(workdir, *extra), run=False)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Lightning warns when a CLI is given args while the process has its own command line: ours."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter")
        yield


@contextlib.contextmanager
def switch_interval(seconds: float | None) -> Iterator[None]:
    """Python's thread switch interval at `seconds` inside (None: as it is), restored after."""
    before = sys.getswitchinterval()
    if seconds is not None:
        sys.setswitchinterval(seconds)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


def loader_speed(case: DataCase) -> tuple[float, str]:
    """Images per second out of the recipe's train loader over its batches after the first
    `warmup` of `steps` (epoch after epoch, as training draws them), each moved to the device and
    through the datamodule's device-side work (decoding and cropping, with the device pipeline;
    normalising): the data path alone. And what it does."""
    device = torch.device("cuda" if case.device == "cuda" else "cpu")
    with tempfile.TemporaryDirectory() as workdir:
        data = build(case, workdir).datamodule
        data.setup("fit")
        loader = data.train_dataloader()
        loader.device = lambda: device  # where the device pipeline decodes (no trainer to say)
        drawn, images, start, epoch = 0, 0, time.perf_counter(), 0
        while drawn < case.steps:
            loader.sampler.set_epoch(epoch)
            before = drawn
            for batch in loader:
                x, _ = data.on_after_batch_transfer(data.transfer_batch_to_device(batch, device, 0), 0)
                if case.device == "cuda":
                    torch.cuda.synchronize()
                drawn += 1
                if drawn == case.warmup:
                    start = time.perf_counter()
                elif drawn > case.warmup:
                    images += len(x)
                if drawn == case.steps:
                    break
            if drawn == before:
                raise RuntimeError(f"the train loader of {case.config} gave no batch")
            epoch += 1
        seconds = time.perf_counter() - start
        del loader
        gc.collect()  # its workers end now: not garbage-collected later inside the next loader's forked workers
    how = f"{data.num_workers} workers: {data.describe_transforms()[0]}" + switched()
    return images / seconds, how + (f"; {litdata_reads(data.train_set)}" if case.streaming else "")


def switched() -> str:
    """A note's words for Python's thread switch interval when it is not the default 5 ms."""
    seconds = sys.getswitchinterval()
    return "" if abs(seconds - 0.005) < 1e-9 else f"; threads switched every {seconds * 1e6:.0f} us"


def litdata_reads(dataset: Any) -> str:
    """How litdata reads the chunks of a vit.data.streaming set (as a loader worker's first read
    sets it up here): mapped in place, or copied into its cache first."""
    source = getattr(dataset, "source", dataset)
    source.read_bytes(0)
    stored = source._open()
    reader = getattr(getattr(stored, "cache", None), "_reader", None)
    if getattr(reader, "_posix_fast", False):
        return f"litdata maps the chunks in place, {getattr(reader, '_posix_keep', '?')} a process at a time"
    return f"litdata copies the chunks into its cache ({getattr(stored, 'cache_dir', None) or 'its default'}) first"


def model_speed(case: DataCase, compile: bool) -> tuple[float, str]:
    """The recipe's training step (its model, optimizer, drop-path, label smoothing and batch) on
    synthetic tensors already on the device (vit.tools.gpu_check), timed over the steps after the
    first `warmup` of `steps` as end to end is: what end to end would reach if the data cost nothing."""
    with tempfile.TemporaryDirectory() as workdir:
        cli = build(case, workdir, "--model.speed.compile", str(compile).lower())
    name, batch = cli.model.hparams.model_name, cli.datamodule.batch_size
    fit = FitCase("model", name, case.steps, batch, case.device, img_size=cli.datamodule.img_size, warmup=case.warmup)
    row, _ = run_fit(fit, cli.model)
    return row.img_per_s, f"{name}, the recipe's step, batch {batch}, synthetic tensors on the device"


def end_to_end_speed(case: DataCase, compile: bool) -> tuple[float, str]:
    """`scripts/train.py fit` on the tree: images per second after `warmup` steps."""
    from vit.cli import main

    with tempfile.TemporaryDirectory() as workdir:
        timer = ["--trainer.callbacks+=vit.training.StepTimer", f"--trainer.callbacks.warmup={case.warmup}",
                 f"--trainer.callbacks.sync_each_step={str(case.sync_each_step).lower()}",
                 "--trainer.callbacks+=vit.tools.fit_audit.DeviceBusy",  # the last warmup steps: not timed
                 f"--trainer.callbacks.start={max(case.warmup - 7, 0)}",
                 f"--trainer.callbacks.stop={max(case.warmup - 3, 0)}",
                 "--trainer.callbacks+=vit.tools.fit_audit.SyncAudit",
                 f"--trainer.callbacks.start={max(case.warmup - 3, 0)}",
                 f"--trainer.callbacks.stop={case.warmup}"]  # fmt: skip
        with _quiet():
            cli = main(["fit", *case.args(workdir, "--model.speed.compile", str(compile).lower(), *timer)])
    timer = next(cb for cb in cli.trainer.callbacks if isinstance(cb, StepTimer))
    audit = next(cb for cb in cli.trainer.callbacks if isinstance(cb, SyncAudit))
    busy = next(cb for cb in cli.trainer.callbacks if isinstance(cb, DeviceBusy))
    if cli.trainer.global_step != case.steps:
        raise RuntimeError(f"ran {cli.trainer.global_step} of {case.steps} steps")
    note = f"batch {cli.datamodule.batch_size}, {case.steps - case.warmup} steps timed" + switched()
    note += ", the host waiting for the device after each" if timer.sync_each_step else ""
    note += busy.summary() + audit.summary()
    return timer.images_per_second, note + data_times(cli.trainer.train_dataloader, case.steps - case.warmup)


def data_times(loader: Any, batches: int) -> str:
    """The loader's medians over its last `batches` (vit.data.prefetch.LoaderTimes), in ms: how
    long the step waited for a batch, and how long preparing one took in each stage (on the CPU);
    "" for a loader that prepares nothing in the training process."""
    times = getattr(loader, "times", None)
    if times is None or not times.prepared or not times.prepared[0]:
        return ""

    def ms(values: list[float]) -> str:
        return f"{1e3 * float(np.median(values[-batches:])):.1f}"

    return (f"; the step waited {ms(times.waited)} ms a batch for data; preparing one took "
            f"{' + '.join(ms(t) for t in times.prepared)} ms ({' + '.join(ms(t) for t in times.prepared_cpu)} "
            "on the CPU)")  # fmt: skip


def recipe_name(config: str) -> str:
    return Path(config).stem.removeprefix("imagenet_").replace("_", " ")


VARIANTS = ("prefetch", "decode", "streaming")  # check_recipe's variants of a recipe, in the order they run
SYNC = "sync"  # and, only if asked, "sync" (after them): the host waits for the device after every step
CAP = re.compile(r"cap(\d+)")  # and "cap<N>" (after them): a copy of the tree with the longer side capped at N
WORKER_DECODE = re.compile(r"worker-decode(\d*\.?\d+)")  # "worker-decode<share>": data.device.worker_decode <share>
SWITCH = re.compile(r"switch(\d+)")  # "switch<us>": Python's thread switch interval (sys.setswitchinterval), in us
OPTION = re.compile(r"((?:data|model|trainer)(?:\.\w+)+)=(\S+)")  # "<option>=<value>": any scripts/train.py option


def unknown_variants(variants: Sequence[str]) -> list[str]:
    def known(v: str) -> bool:
        cap, share, switch = CAP.fullmatch(v), WORKER_DECODE.fullmatch(v), SWITCH.fullmatch(v)
        return (v in (*VARIANTS, SYNC) or bool(cap and int(cap[1]) > 0) or bool(share and 0 < float(share[1]) <= 1)
                or bool(switch and int(switch[1]) > 0) or bool(OPTION.fullmatch(v)))  # fmt: skip

    return [v for v in variants if not known(v)]


def check_recipe(
    case: DataCase, compiled: bool, variants: Sequence[str] = VARIANTS
) -> Iterator[tuple[str, float, str, int]]:
    """(what ran, img/s, note, training FLOPs per image), each printed and yielded as it is
    measured: the model alone, the data path alone and the whole fit, eager and, with `compiled`,
    compiled; the fits' notes give end to end as a share of the model alone. Then, eager and
    labelled, the `variants` of the recipe: "prefetch", the other `device.prefetch` (0 on a GPU, 1 on
    the CPU); "decode", the other `pipeline` (device or per_sample); "streaming", from the tree converted to
    litdata chunks (`case.root`-streaming, written on first use); "worker-decode<share>", with
    `data.device.worker_decode` <share> (recipes that decode on the device); "cap<N>", from a copy of the
    tree with each image's longer side capped at N (`case.root`-capN, vit.tools.resize_folder);
    "switch<us>", with Python's thread switch interval at us microseconds (default 5,000): how long
    a thread that holds the interpreter's lock keeps the others, the thread launching the model's
    kernels among them, waiting; "<option>=<value>", with that `scripts/train.py` option (e.g.
    data.pin_memory=false; the model-alone rows run without it); "sync", the host waiting for the
    device after every step (as a progress bar showing the loss at every step makes it; the other
    fits never wait inside the timed steps)."""
    if unknown := unknown_variants(variants):
        raise ValueError(
            f"unknown data check variants {unknown}; choose from {', '.join(VARIANTS)}, {SYNC}, worker-decode<share>, "
            "cap<N>, switch<us> or <option>=<value>"
        )
    from vit.tools.convert_streaming import convert_image_folder
    from vit.tools.flops import forward_flops
    from vit.tools.resize_folder import resize_folder

    name = recipe_name(case.config)
    torch.set_float32_matmul_precision("high")  # as vit.cli.main sets it for a fit: the data path resizes with TF32
    with tempfile.TemporaryDirectory() as workdir:
        cli = build(case, workdir)
    flops = 3 * forward_flops(cli.model.model, cli.datamodule.img_size)
    configured = cli.datamodule.pipeline == "device"

    def streaming() -> DataCase:
        stream_root = case.root.with_name(f"{case.root.name}-streaming")
        convert_image_folder(case.root, stream_root, workers=max(1, (os.cpu_count() or 1) - 1))
        return replace(case, root=stream_root, streaming=True)

    modes = ("eager", "compiled") if compiled else ("eager",)
    paths = [("", lambda: case, modes)]
    if configured and "prefetch" in variants:  # each batch decoded when its step begins, or a batch ahead
        ahead = cli.datamodule.device.prefetch
        ahead = int(case.device == "cuda") if ahead is None else ahead
        label = " (no prefetch)" if ahead else " (prefetch 1)"
        paths.append((label, lambda: variant_of(case, "--data.device.prefetch", "0" if ahead else "1"), ("eager",)))
    if "decode" in variants:
        other = " (per-sample)" if configured else " (device_decode)"
        decode = "per_sample" if configured else "device"
        paths.append((other, lambda: variant_of(case, "--data.pipeline", decode), ("eager",)))
    if "streaming" in variants and importlib.util.find_spec("litdata") is None:
        print("[data-check] litdata is not installed (pip install -e '.[stream]'): no streaming rows", flush=True)
    elif "streaming" in variants:
        paths.append((" (streaming)", streaming, ("eager",)))

    for share in (WORKER_DECODE.fullmatch(v)[1] for v in variants if WORKER_DECODE.fullmatch(v)):
        if configured:  # the share of the JPEGs decoded in the loader workers, not on the device
            label = f" (worker_decode {float(share):g})"
            share_of = partial(variant_of, case, "--data.device.worker_decode", share)
            paths.append((label, share_of, ("eager",)))

    def capped(side: int) -> DataCase:
        capped_root = case.root.with_name(f"{case.root.name}-cap{side}")
        # every time: a copy an earlier call cut short is completed (resize_folder keeps the files written)
        resize_folder(case.root, capped_root, side, workers=max(1, (os.cpu_count() or 1) - 1))
        return replace(case, root=capped_root)

    for key, value in (m.groups() for m in map(OPTION.fullmatch, variants) if m):
        paths.append((f" ({key} {value})", lambda k=key, v=value: variant_of(case, f"--{k}", v), ("eager",)))
    for side in (int(v[3:]) for v in variants if CAP.fullmatch(v)):
        paths.append((f" (longer side <= {side})", lambda side=side: capped(side), ("eager",)))
    if SYNC in variants:
        paths.append((" (host sync each step)", lambda: replace(case, sync_each_step=True), ("eager",)))
    for us in (int(SWITCH.fullmatch(v)[1]) for v in variants if SWITCH.fullmatch(v)):
        label = f" (switch interval {us} us)"
        paths.append((label, lambda us=us: replace(case, switch_interval=us / 1e6), ("eager",)))

    models = {}

    def shown(row: tuple[str, float, str, int]) -> tuple[str, float, str, int]:
        print(f"[data-check] {row[0]}: {row[1]:,.0f} img/s ({row[2]})", flush=True)
        return row

    for mode in modes:
        models[mode], model_note = model_speed(case, compile=mode == "compiled")
        yield shown((f"{name}: model alone, {mode}", models[mode], model_note, flops))
    for label, make, fit_modes in paths:
        path = make()
        with switch_interval(path.switch_interval):
            speed, note = loader_speed(path)
        yield shown((f"{name}{label}: data path alone", speed, note, 0))
        for mode in fit_modes:
            with switch_interval(path.switch_interval):
                fit, fit_note = end_to_end_speed(path, compile=mode == "compiled")
            share = f"{fit_note}; {100 * fit / models[mode]:.0f}% of the model alone"
            yield shown((f"{name}{label}: end to end, {mode}", fit, share, flops))


# -- a decoder that overwrites memory still in use ------------------------------------------------


def decoder_race(device: str, iterations: int = 100, images: int = 32) -> dict[str, int]:
    """How many of `iterations` left tensors that kernels queued on the caller's stream had yet to
    read corrupted after a batch decode on `device` (CUDA): torchvision's `decode_jpeg` as it is
    (its private stream does not wait for the caller's: pytorch/vision#9606) and
    vit.data.device.decode_batch (which drains the caller's stream first).

    Each iteration fills tensors the size of the decoded images with a known value, queues a long
    kernel and then a sum of each tensor behind it, frees the tensors (the allocator may hand their
    memory to the decoder at once, as stream order would make safe) and decodes; a sum that is not
    value x size was read after the decoder wrote there. The first count shows whether this GPU and
    driver race at all; the second must be 0."""
    from torchvision.io import ImageReadMode, decode_jpeg

    from vit.data.device import decode_batch

    rng = np.random.default_rng(0)
    data = [photo_jpeg(rng) for _ in range(images)]
    decoders = {
        "torchvision decode_jpeg": lambda: decode_jpeg(data, mode=ImageReadMode.RGB, device=device),
        "vit decode_batch": lambda: decode_batch(data, device),
    }
    sizes = [image.numel() for image in decoders["vit decode_batch"]()]
    corrupted = {}
    for name, decode in decoders.items():
        corrupted[name] = 0
        for i in range(iterations):
            value = 1 + i % 250
            blocks = [torch.full((n,), value, dtype=torch.uint8, device=device) for n in sizes]
            torch.cuda.synchronize(device)
            torch.cuda._sleep(50_000_000)  # some tens of milliseconds of GPU time, queued first
            sums = [block.sum(dtype=torch.int64) for block in blocks]
            del blocks
            decode()
            torch.cuda.synchronize(device)
            corrupted[name] += any(int(total) != value * n for total, n in zip(sums, sizes, strict=True))
    return corrupted


def prefetch_agrees(case: DataCase, batches: int = 8) -> tuple[bool, str]:
    """Whether the recipe's first `batches` training batches, decoded a batch ahead by a thread on
    a stream of its own (vit.data.prefetch), are the batches decoded on demand: each batch is summed
    per image on the consumer's stream as soon as it is handed over and then freed, and a long
    kernel (on CUDA) stands for the step while the thread decodes the next. A sum read before the
    thread's stream finished writing, or after its memory went to the next batch, differs."""
    device = torch.device("cuda" if case.device == "cuda" else "cpu")
    sums: dict[int, list[torch.Tensor]] = {}
    for ahead in (0, 1):
        with tempfile.TemporaryDirectory() as workdir:
            data = build(variant_of(case, "--data.device.prefetch", str(ahead)), workdir).datamodule
        data.setup("fit")
        loader = data.train_dataloader()
        loader.device = lambda: device
        sums[ahead] = []
        batches = min(batches, len(loader))
        for i, (x, _) in enumerate(loader):
            sums[ahead].append(x.double().sum((1, 2, 3)))  # queued behind the last "step", then x is freed
            del x
            if device.type == "cuda":
                torch.cuda._sleep(20_000_000)  # the "step": the thread decodes the next batch meanwhile
            if i + 1 == batches:
                break
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    same = len(sums[0]) == len(sums[1]) == batches and all(
        torch.equal(a, b) for a, b in zip(sums[0], sums[1], strict=True)
    )
    images = sum(len(s) for s in sums[1])
    return same, f"{images} images in {batches} batches, summed per image: {'equal' if same else 'DIFFERENT'}"


def variant_of(case: DataCase, *options: str) -> DataCase:
    """`case` with more `scripts/train.py` options."""
    return replace(case, overrides=[*case.overrides, *options])


def host_syncs(device: str, images: int = 32) -> list[str]:
    """Where (file:line) decoding and augmenting one batch on `device` (CUDA) makes the host wait
    for the device (torch.cuda.set_sync_debug_mode reports them; the decoder's own waits, inside
    torchvision, are not seen): each wait stops the host queueing the rest while the device works.
    1 expected: the drain before the decoder (vit.data.device.drain_before_decode)."""
    from vit.data.augment import draw_rand_augment, normalize, random_resized_crop_box
    from vit.data.device import collate_encoded, decode_and_augment
    from vit.data.images import ImageFiles, Sample
    from vit.data.transforms import IMAGENET_MEAN, IMAGENET_STD

    rng = np.random.default_rng(0)
    batch = []
    for i in range(images):
        data = photo_jpeg(rng)
        box = random_resized_crop_box(rng, 375, 500)
        params = torch.tensor([*box, i % 2, *draw_rand_augment(rng, 2, 9.0)[0], i], dtype=torch.float64)
        batch.append((data, i % 10, params))
    collated, files = collate_encoded(batch), ImageFiles([Sample(f"synthetic {i}", i % 10) for i in range(images)])

    def run() -> torch.Tensor:
        return normalize(decode_and_augment(collated, device, 224, files)[0], IMAGENET_MEAN, IMAGENET_STD)

    run()  # first use: the decoder's and kernels' set-up
    torch.cuda.synchronize(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sync_sites(caught)
