"""scripts/gpu_check.py without a GPU: it says so and exits 0; its checks, table, FLOP count and MFU
arithmetic on the CPU debug path (float32, a tiny ViT)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tests.conftest import ROOT
from vit.registry import create_model
from vit.tools.fit_timing import Row, format_table
from vit.tools.flops import forward_flops, mfu, peak_tflops
from vit.tools.gpu_check import main
from vit.tools.resize_folder import check_copy, resize_file

CPU_DEBUG = ["--device", "cpu", "--steps", "3", "--batch", "4", "--model", "vit_nano_patch4_16",
             "--resnet", "resnet18", "--resnet-img-size", "32"]  # fmt: skip


def vit_forward_flops(tokens: int, dim: int, depth: int, mlp: int, patch_in: int, patches: int, classes: int,
                      last_queries: int | None) -> int:  # fmt: skip
    """A ViT's forward FLOPs by hand (2 per multiply-add): patch projection, per block qkv, q k^T,
    weights x v, proj, fc1, fc2; the last block for `last_queries` tokens (keys and values for all),
    or, averaged (None), its fc1 for the patches and its fc2 once, on their mean hidden state; the
    head on one token (CLS) or the pooled tokens."""

    def block(queries: int, fc1_rows: int, fc2_rows: int) -> int:
        qkv = 2 * tokens * dim * 3 * dim
        attention = 2 * (2 * queries * tokens * dim)
        return qkv + attention + 2 * queries * dim * dim + 2 * fc1_rows * dim * mlp + 2 * fc2_rows * mlp * dim

    last = block(last_queries, last_queries, last_queries) if last_queries else block(tokens, patches, 1)
    return 2 * patches * patch_in * dim + (depth - 1) * block(tokens, tokens, tokens) + last + 2 * dim * classes


@pytest.mark.parametrize(("pool", "last_queries"), [("token", 1), ("avg", None)])
def test_forward_flops_is_the_hand_count(pool, last_queries):
    # vit_nano_patch4_16: 16 px, patch 4 -> 16 patches (+ CLS = 17 tokens) of 3 x 4 x 4 = 48 values,
    # width 128, depth 4, MLP 512, 10 classes. With CLS pooling the last block computes the CLS row only;
    # averaged, its MLP reads the patches and its fc2 runs once, on their mean.
    model = create_model("vit_nano_patch4_16", num_classes=10, global_pool=pool)
    expected = vit_forward_flops(17, 128, 4, 512, 48, 16, 10, last_queries)
    assert forward_flops(model, 16) == expected
    assert expected == {"token": 22_671_872, "avg": 25_301_504}[pool]
    assert all(m.fused_attn for m in model.modules() if hasattr(m, "fused_attn"))  # switched back on


def test_mfu_and_the_peak_table():
    # 1000 img/s x 3 x 22.67 MFLOP (forward + backward) on a 1 TFLOP/s device: 6.8%; over two devices half
    assert mfu(1000, 3 * 22_671_872, 1.0) == pytest.approx(0.068015616)
    assert mfu(1000, 3 * 22_671_872, 1.0, devices=2) == pytest.approx(0.034007808)
    assert mfu(1000, 1e6, None) is None
    assert peak_tflops("NVIDIA H100 80GB HBM3") == 989.4 and peak_tflops("NVIDIA H200") == 989.4
    assert peak_tflops("NVIDIA H100 PCIe") == 756.0 and peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert peak_tflops("NVIDIA L4") == 121.0 and peak_tflops("NVIDIA L40S") == 362.0
    assert peak_tflops("NVIDIA GeForce RTX 3090") == 71.0 and peak_tflops("NVIDIA GeForce RTX 4090") == 165.2
    assert peak_tflops("NVIDIA GeForce RTX 3090 Ti") is None and peak_tflops("Tesla V100-SXM2-16GB") is None
    table = format_table([Row("a", True, 1234.5, 3 * 2**30, None, "x"), Row("b", False, note="boom")])
    assert "| a | ok | 1,234 | 3.00 GiB | unknown | x |" in table and "| b | FAILED | - | - | - | boom |" in table


def test_without_a_gpu_it_says_so_and_exits_0():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py")], env=env,
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert "No CUDA GPU found" in result.stdout


def test_cpu_debug_run_measures_every_single_device_check(tmp_path, capsys):
    out = tmp_path / "rows.json"
    assert main([*CPU_DEBUG, "--peak-tflops", "0.01", "--json", str(out)]) == 0
    rows = {r["check"]: r for r in json.loads(out.read_text())}
    fit, resnet = rows["nano_patch4_16 fit, eager"], rows["resnet18 channels-last fit"]
    flash = next(r for name, r in rows.items() if name.startswith("flash SDPA"))
    assert all(r["ok"] for r in rows.values()) and len(rows) == 3  # no compile, no processes on the CPU
    assert "flash_attention" in flash["note"]  # the flash kernel (the CPU's) ran our attention
    assert fit["img_per_s"] > 0 and resnet["img_per_s"] > 0
    flops = vit_forward_flops(17, 128, 4, 512, 48, 16, 1000, 1)  # the check's model has 1000 classes
    assert fit["mfu"] == pytest.approx(fit["img_per_s"] * 3 * flops / 0.01e12)
    assert "| nano_patch4_16 fit, eager | ok |" in capsys.readouterr().out


def test_the_cpu_debug_path_defaults_to_small_batches_and_a_small_resnet():
    """The documented quick form (`--device cpu --steps 3 --model vit_nano_patch4_16`) ran past 300 s
    on a GPU-sized ResNet-50 fit (128 images of 224 px a step); on the CPU the defaults are small."""
    from vit.tools.gpu_check import parse_args

    cpu = parse_args(["--device", "cpu", "--steps", "3", "--model", "vit_nano_patch4_16"])
    assert (cpu.resnet, cpu.resnet_img_size, cpu.batch) == ("resnet18", 32, 8)
    gpu = parse_args([])
    assert (gpu.resnet, gpu.resnet_img_size, gpu.batch) == ("resnet50", 224, 128)
    given = parse_args(["--device", "cpu", "--resnet", "resnet50", "--resnet-img-size", "64", "--batch", "2"])
    assert (given.resnet, given.resnet_img_size, given.batch) == ("resnet50", 64, 2)


def test_checks_option_runs_only_the_named_checks(tmp_path):
    out = tmp_path / "rows.json"
    assert main([*CPU_DEBUG, "--checks", "flash,fit", "--json", str(out)]) == 0
    rows = [r["check"] for r in json.loads(out.read_text())]
    assert rows[0] == "nano_patch4_16 fit, eager" and rows[1].startswith("flash SDPA") and len(rows) == 2
    with pytest.raises(SystemExit):
        main([*CPU_DEBUG, "--checks", "fit,nope"])
    refused = ("streamin", "cap", "cap0", "capx", "prefetch,cap-1", "worker-decode0", "worker-decode1.5", "switch0",
               "switch", "syncs", "data.pin_memory", "pin_memory=false", "data.pin_memory=")  # fmt: skip
    for variants in refused:  # before any check runs
        with pytest.raises(SystemExit):
            main([*CPU_DEBUG, "--checks", "data", "--data-variants", variants])


@pytest.mark.slow
def test_cpu_debug_run_of_the_sharded_and_ddp_fits(tmp_path):
    out = tmp_path / "rows.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    command = [
        sys.executable,
        str(ROOT / "scripts" / "gpu_check.py"),
        *CPU_DEBUG,
        "--checks",
        "sharded,ddp",  # the others run in test_cpu_debug_run_measures_every_single_device_check
        "--processes",
        "2",
        "--json",
        str(out),
    ]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    rows = {r["check"]: r for r in json.loads(out.read_text())}
    for name in ("nano_patch4_16 ShardedStrategy (FSDP2) x 2", "nano_patch4_16 DDP x 2"):
        assert rows[name]["ok"] and rows[name]["img_per_s"] > 0 and "2 processes, gloo" in rows[name]["note"]


def test_the_synthetic_imagenet_is_imagenet_like(tmp_path):
    """About 500x375 (within 20%), about 4 bits a pixel at JPEG quality 90 (ImageNet's photos: 3.7,
    110 KB), one image in 20 greyscale and one in 20 a PNG."""
    from PIL import Image

    from vit.tools.synthetic_imagenet import write_synthetic_imagenet

    made = write_synthetic_imagenet(tmp_path, train=40, val=4, classes=4, workers=1)
    files = sorted((tmp_path / "train").rglob("*.*"))
    assert made["images"] == 44 and len(files) == 40 and len(list((tmp_path / "train").iterdir())) == 4
    modes, bits = [], []
    for path in files:
        with Image.open(path) as image:
            assert 400 <= image.width <= 600 and 300 <= image.height <= 450
            modes.append((image.format, image.mode))
            if image.format == "JPEG" and image.mode == "RGB":
                bits.append(8 * path.stat().st_size / (image.width * image.height))
    assert modes.count(("PNG", "RGB")) == 2 and modes.count(("JPEG", "L")) == 2 and len(bits) == 36
    assert 3.0 < float(np.mean(bits)) < 5.0


def test_a_synthetic_tree_cut_short_is_written_again_and_a_tree_of_ones_own_is_kept(tmp_path, monkeypatch):
    import vit.tools.synthetic_imagenet as synthetic

    synthetic.write_synthetic_imagenet(tmp_path / "synthetic", train=4, val=1, classes=2, size=(40, 30), workers=1)
    assert not synthetic.synthetic_tree_wanted(tmp_path / "synthetic")
    (tmp_path / "own" / "train" / "a").mkdir(parents=True)  # another tree: no mark, used as it is
    assert not synthetic.synthetic_tree_wanted(tmp_path / "own") and synthetic.synthetic_tree_wanted(tmp_path / "no")
    monkeypatch.setattr(synthetic, "_write_one", lambda job: 1 / 0)  # the writing stops at its first image
    with pytest.raises(ZeroDivisionError):
        synthetic.write_synthetic_imagenet(tmp_path / "cut", train=4, val=1, classes=2, size=(40, 30), workers=1)
    assert (tmp_path / "cut" / "train").is_dir() and synthetic.synthetic_tree_wanted(tmp_path / "cut")


def test_the_data_check_times_the_data_path_over_epochs_and_the_model_as_its_recipe_trains_it(tmp_path, monkeypatch):
    """9 batches of 4 from a tree of 16 images (4 a batch: three epochs), the clock started after 2;
    the model alone is the recipe's step (ResNet-50's: SGD, label smoothing 0.1, channels-last),
    timed over the same steps as end to end."""
    import vit.tools.data_check as data_check
    from vit.data import ImageFolderDataModule

    root = tmp_path / "tree"
    data_check.write_synthetic_imagenet(root, train=16, val=4, classes=4, size=(120, 90), workers=1)
    small = ["--data.img_size", "72", "--data.batch_size", "4", "--data.num_workers", "0",
             "--model.model_name", "resnet18"]  # fmt: skip
    case = data_check.DataCase("configs/imagenet_resnet50.yaml", root, "cpu", 9, 2, small)
    drawn = []
    transfer = ImageFolderDataModule.on_after_batch_transfer
    monkeypatch.setattr(ImageFolderDataModule, "on_after_batch_transfer",
                        lambda self, batch, i: drawn.append(len(batch[1])) or transfer(self, batch, i))  # fmt: skip
    speed, _ = data_check.loader_speed(case)
    assert speed > 0 and drawn == [4] * 9

    fits = []
    run_fit = data_check.run_fit
    monkeypatch.setattr(data_check, "run_fit", lambda fit, task: fits.append((fit, task)) or run_fit(fit, task))
    speed, note = data_check.model_speed(case, compile=False)
    ((fit, task),) = fits
    assert speed > 0 and "the recipe's step" in note and (fit.steps, fit.warmup, fit.batch) == (9, 2, 4)
    assert task.optimizer.name == "sgd" and task.hparams.label_smoothing == 0.1 and task.speed.channels_last


def _fit_seven_steps_of_five_images(timer: object, root: Path) -> None:
    """A linear model trained 7 SGD steps of 5 images each on the CPU, `timer` among its callbacks."""
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    class Linear(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)

        def training_step(self, batch, batch_idx):
            return self.layer(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = L.Trainer(max_steps=7, callbacks=[timer], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=root)  # fmt: skip
    trainer.fit(Linear(), DataLoader(TensorDataset(torch.randn(40, 2)), batch_size=5))


def test_the_step_timer_counts_the_images_after_the_warmup_steps(tmp_path):
    from vit.training import StepTimer

    timer = StepTimer(warmup=2)
    _fit_seven_steps_of_five_images(timer, tmp_path)
    assert timer.images == (7 - 2) * 5 and timer.images_per_second == pytest.approx(25 / timer.seconds)


def test_on_cuda_the_step_timer_reads_its_span_from_events_not_waiting_inside_it(tmp_path, monkeypatch):
    """The span runs from the event queued at the end of the warmup's last step to the one queued
    at the end of the last step (each event standing here for the step it ends), read once, after."""
    import vit.training
    from vit.training import StepTimer

    class StepEvent(torch.cuda.Event):  # reached at "second" = the step it was queued after
        def __new__(cls, step: int) -> StepEvent:
            return super().__new__(cls, enable_timing=True)

        def __init__(self, step: int) -> None:
            self.step, self.waited = step, False

        def synchronize(self) -> None:
            self.waited = True

        def elapsed_time(self, end: StepEvent) -> float:  # milliseconds, as CUDA's
            return (end.step - self.step) * 1e3

    queued: list[StepEvent] = []
    monkeypatch.setattr(vit.training, "_now", lambda cuda: queued.append(StepEvent(len(queued) + 1)) or queued[-1])
    timer = StepTimer(warmup=2)
    _fit_seven_steps_of_five_images(timer, tmp_path)
    assert [e.waited for e in queued] == [False] * 6  # steps 2..7 queued one each; none waited on yet
    assert timer.seconds == 5.0 and timer.images_per_second == 25 / 5.0  # steps 3..7, 5 images each
    assert queued[-1].waited and not queued[0].waited


@pytest.mark.slow
def test_the_data_check_runs_both_imagenet_recipes_on_the_cpu(tmp_path):
    """`--checks data` on the CPU: the recipes as scripts/train.py builds them (random resized crops,
    RandAugment, Mixup/CutMix for the ViT), at 96 px, on a written tree; each end-to-end row states
    its share of the model alone, computed from the two rows."""
    out = tmp_path / "rows.json"
    assert main(["--device", "cpu", "--checks", "data", "--data-root", str(tmp_path / "tree"), "--json", str(out)]) == 0
    rows = {r["check"]: r for r in json.loads(out.read_text())}
    assert list(rows) == [
        "batches decoded ahead = on demand",
        "vit b16: model alone, eager", "vit b16: data path alone", "vit b16: end to end, eager",
        "vit b16 (prefetch 1): data path alone", "vit b16 (prefetch 1): end to end, eager",
        "vit b16 (per-sample): data path alone", "vit b16 (per-sample): end to end, eager",
        "vit b16 (streaming): data path alone", "vit b16 (streaming): end to end, eager",
        "resnet50: model alone, eager", "resnet50: data path alone", "resnet50: end to end, eager",
        "resnet50 (prefetch 1): data path alone", "resnet50 (prefetch 1): end to end, eager",
        "resnet50 (per-sample): data path alone", "resnet50 (per-sample): end to end, eager",
        "resnet50 (streaming): data path alone", "resnet50 (streaming): end to end, eager",
    ]  # fmt: skip
    assert all(r["ok"] for r in rows.values()) and len(list((tmp_path / "tree" / "train").rglob("*.*"))) == 48
    for name in ("vit b16", "vit b16 (per-sample)"):
        assert "RandAugment 2 ops at magnitude 9" in rows[f"{name}: data path alone"]["note"]
        assert "Mixup 0.8 / CutMix 1" in rows[f"{name}: data path alone"]["note"]
    assert "RandAugment" not in rows["resnet50: data path alone"]["note"]
    for name in ("vit b16", "resnet50"):  # the shipped configs decode on the device; the other rows do not
        assert "decode on the training device" in rows[f"{name}: data path alone"]["note"]
        assert "decode on the training device" not in rows[f"{name} (per-sample): data path alone"]["note"]
    streaming = rows["vit b16 (streaming): data path alone"]["note"]
    assert "decode on the training device" in streaming
    assert re.search(r"litdata maps the chunks in place, \d+ a process at a time", streaming)
    ms, two = r"\d+\.\d", r"\d+\.\d \+ \d+\.\d"
    stages = rf"waited {ms} ms a batch for data; preparing one took {two} ms \({two} on the CPU\)"
    for name in ("vit b16", "vit b16 (prefetch 1)", "vit b16 (streaming)", "resnet50"):  # decoding, then augmenting
        assert re.search(stages, rows[f"{name}: end to end, eager"]["note"])
    assert "waited" not in rows["vit b16 (per-sample): end to end, eager"]["note"]
    variants = "worker-decode.5,data.num_workers=0,cap60,sync,switch100"
    first = next((tmp_path / "tree" / "train").rglob("*.JPEG"))  # a copy cut short after its first image
    check_copy(tmp_path / "tree-cap60", 60, 90)  # its record of how it is made, written before any file
    resize_file(first, tmp_path / "tree-cap60" / first.relative_to(tmp_path / "tree"), 60, 90)
    chosen = ["--data-recipes", "configs/imagenet_resnet50.yaml", "--data-variants", variants]
    assert main(["--device", "cpu", "--checks", "data", "--data-root", str(tmp_path / "tree"), *chosen,
                 "--json", str(tmp_path / "chosen.json")]) == 0  # fmt: skip
    assert [r["check"] for r in json.loads((tmp_path / "chosen.json").read_text())] == [
        "batches decoded ahead = on demand", "resnet50: model alone, eager", "resnet50: data path alone",
        "resnet50: end to end, eager", "resnet50 (worker_decode 0.5): data path alone",
        "resnet50 (worker_decode 0.5): end to end, eager", "resnet50 (data.num_workers 0): data path alone",
        "resnet50 (data.num_workers 0): end to end, eager", "resnet50 (longer side <= 60): data path alone",
        "resnet50 (longer side <= 60): end to end, eager", "resnet50 (host sync each step): data path alone",
        "resnet50 (host sync each step): end to end, eager", "resnet50 (switch interval 100 us): data path alone",
        "resnet50 (switch interval 100 us): end to end, eager",
    ]  # fmt: skip
    chosen_rows = json.loads((tmp_path / "chosen.json").read_text())
    assert "decode on the training device (50% of the JPEGs in the loader workers)" in chosen_rows[-10]["note"]
    assert chosen_rows[-8]["note"].startswith("0 workers: ") and chosen_rows[2]["note"].startswith("1 workers: ")
    synced = [row["check"] for row in chosen_rows if "the host waiting for the device after each" in row["note"]]
    assert synced == ["resnet50 (host sync each step): end to end, eager"]
    for row in chosen_rows[-2:]:  # read while it was measured; the other rows ran at Python's 5 ms
        assert "threads switched every 100 us" in row["note"]
    assert not any("threads switched" in row["note"] for row in chosen_rows[:-2])
    assert sys.getswitchinterval() == 0.005
    capped = [Image.open(f).size for f in (tmp_path / "tree-cap60" / "train").rglob("*.*")]
    assert len(capped) == 48 and max(max(size) for size in capped) == 60  # the ~120x90 tree's copy
    for name in ("vit b16", "vit b16 (per-sample)", "vit b16 (streaming)", "resnet50", "resnet50 (per-sample)"):
        model = name.split(" (")[0]
        fit, alone = rows[f"{name}: end to end, eager"]["img_per_s"], rows[f"{model}: model alone, eager"]["img_per_s"]
        assert rows[f"{name}: end to end, eager"]["note"].endswith(f"; {round(100 * fit / alone)}% of the model alone")


def test_a_data_check_cut_short_keeps_each_row_it_measured(tmp_path, monkeypatch):
    """A recipe's rows reach --json as each is measured (a 10-minute call on a GPU node can end
    mid-recipe); a check that fails after some rows keeps them and adds its failure row."""
    import vit.tools.gpu_check as gpu_check

    out = tmp_path / "rows.json"

    def two_rows_then_a_failure(case, compiled, variants):
        yield ("recipe: model alone, eager", 100.0, "model", 0)
        yield ("recipe: data path alone", 50.0, "data", 0)
        on_disk = [r["check"] for r in json.loads(out.read_text())]
        assert on_disk == ["recipe: model alone, eager", "recipe: data path alone"]
        raise RuntimeError("the call ended here")

    monkeypatch.setattr(gpu_check, "check_device_decoding", lambda args: [])
    monkeypatch.setattr(gpu_check, "_data_case", lambda args, recipe: None)
    monkeypatch.setattr(gpu_check, "check_recipe", two_rows_then_a_failure)
    recipe = "configs/imagenet_vit_b16.yaml"
    assert main(["--device", "cpu", "--checks", "data", "--data-recipes", recipe, "--json", str(out)]) == 1
    rows = json.loads(out.read_text())
    assert [(r["check"], r["ok"], r["img_per_s"]) for r in rows] == [
        ("recipe: model alone, eager", True, 100.0),
        ("recipe: data path alone", True, 50.0),
        (f"data: {recipe}", False, None),
    ]
    assert rows[2]["note"] == "RuntimeError: the call ended here"


def test_the_gpu_busy_shares_count_overlaps_once_and_part_the_busiest_stream_from_the_others():
    """Kernels as (stream, start, end) over a window of 100: stream 7 at 0-40 and 30-60 (60
    covered), stream 13 at 50-70, stream 17 at 80-90: busy 80%, the busiest stream 60%, the others
    30% (13's 50-60 overlaps 7's and counts in both, once in the total)."""
    from torch.profiler import ProfilerActivity, profile

    from vit.tools.fit_audit import DeviceBusy, busy_shares, spans

    shares = busy_shares([(7, 0, 40), (7, 30, 60), (13, 50, 70), (17, 80, 90)], 100)
    assert shares == pytest.approx({"any": 0.8, "busiest": 0.6, "others": 0.3})
    assert busy_shares([], 100) == {"any": 0.0, "busiest": 0.0, "others": 0.0}
    with profile(activities=[ProfilerActivity.CPU]) as ran:  # the spans the profiler records: here ops on the CPU
        torch.ones(64, 64).matmul(torch.ones(64, 64))
    ops = spans(ran, "cpu")
    assert ops and all(start <= end for _, start, end in ops) and not spans(ran, "cuda")
    busy = DeviceBusy(start=3, stop=7)
    assert busy.summary() == ""  # nothing measured (a CPU run)
    busy.shares = shares
    assert busy.summary() == "; GPU busy 80% of 4 steps (its busiest stream 60%, the others 30%)"
    busy.error = "RuntimeError: no CUPTI"  # a profiler that failed: said, not fatal
    assert busy.summary() == "; GPU busy not measured (RuntimeError: no CUPTI)"


def test_the_sync_audit_counts_each_threads_waits_a_step_and_where_and_shows_other_warnings():
    """SyncAudit over steps 3 and 4, the waits (warnings, as set_sync_debug_mode reports them)
    raised by `wait`: twice in this thread (the training thread's), once in another; any other
    warning is shown as before, and so is a wait after the audit."""
    import threading
    import warnings

    from vit.tools.fit_audit import SYNC_WARNING, SyncAudit

    def wait() -> None:
        warnings.warn(SYNC_WARNING, stacklevel=1)

    audit = SyncAudit(start=3, stop=5)
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        audit.begin(cuda=False)
        wait()
        wait()
        thread = threading.Thread(target=wait)
        thread.start()
        thread.join()
        warnings.warn("something else", stacklevel=1)
        audit.end()
        wait()
    site = f"test_gpu_check.py:{wait.__code__.co_firstlineno + 1}"
    assert audit.summary() == (
        f"; host waits a step (2 steps): 1.0 in the training thread ({site} x2), 0.5 in the data threads ({site} x1)"
    )
    assert [str(w.message) for w in shown] == ["something else", SYNC_WARNING]


def test_host_waits_count_the_syncs_torch_reports_and_not_its_prototype_notice():
    """torch.cuda.set_sync_debug_mode("warn") warns at each host wait and, once, that the mode is a
    prototype (the texts of torch 2.11's libc10_cuda / libtorch_python): only the waits count."""
    import warnings

    from vit.tools.fit_audit import sync_sites

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.warn_explicit(
            "Synchronization debug mode is a prototype feature and does not yet detect all synchronizing "
            "operations", UserWarning, "/torch/cuda/__init__.py", 1270,
        )  # fmt: skip
        warnings.warn_explicit("called a synchronizing CUDA operation", UserWarning, "/torch/cuda/streams.py", 108)
    assert sync_sites(caught) == ["streams.py:108"]


def test_the_tools_import_each_other_one_way():
    """No circle among vit.tools' modules (a circle hides behind imports inside functions)."""
    import ast

    tools = ROOT / "vit" / "tools"
    graph = {
        path.stem: {
            node.module.rsplit(".", 1)[-1]
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("vit.tools.")
        }
        for path in tools.glob("*.py")
    }

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(n == goal or (n not in seen and reaches(n, goal, seen | {n})) for n in graph.get(start, ()))

    assert "data_check" in graph["gpu_check"] and "fit_timing" in graph["data_check"]  # real edges are seen
    assert [m for m in graph if reaches(m, m, set())] == []


WORKER_EXITS = [(0, True, True), (-6, True, True), (-6, False, False), (1, True, False)]  # (code, row written, ok)


@pytest.mark.parametrize(("code", "writes", "ok"), WORKER_EXITS)
def test_a_distributed_worker_aborting_after_its_row_keeps_the_row_and_says_so(monkeypatch, code, writes, ok):
    """A SIGABRT at exit after the fit (torch's process-group teardown) is not a failed fit; any
    other exit code, or an abort before the row is written, is."""
    import argparse

    from vit.tools import gpu_check

    def run(command, **kwargs):
        if writes:
            Path(command[command.index("--json") + 1]).write_text(json.dumps({"check": "sharded", "ok": True}))
        return subprocess.CompletedProcess(command, code, "", "terminate called without an active exception")

    monkeypatch.setattr(gpu_check.subprocess, "run", run)
    args = argparse.Namespace(device="cpu", processes=2, model="m", steps=3, batch=8, timeout=10)
    if not ok:
        with pytest.raises(RuntimeError, match=f"worker exited {code}: terminate called"):
            gpu_check.run_worker(args, "sharded", None)
        return
    row = gpu_check.run_worker(args, "sharded", None)
    assert row.ok and row.note.endswith("aborted at exit, after the fit (process-group teardown)") == (code == -6)
