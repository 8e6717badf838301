"""Faults a real run meets, and what each does: signals and kill -9 mid-epoch (exact resume),
failed checkpoint writes, a corrupt image under DDP, a NaN loss. Runs that receive signals run
in their own process (scripts/train.py), as a user's would."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import lightning as L
import pytest
import torch

from tests.conftest import ROOT, write_image_folder
from vit.cli import main

QUIET = ["--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]
TIMEOUT = 240


def cifar_recipe(data: Path, run: Path, *overrides: str) -> list[str]:
    """configs/cifar10_vit.yaml (in-memory data, Muon, patch dropout) on a small image folder:
    4 steps an epoch, 3 epochs, a checkpoint after every step."""
    return [
        "fit", "--config", str(ROOT / "configs/cifar10_vit.yaml"), "--trainer.default_root_dir", str(run), *QUIET,
        "--data", "vit.data.ImageFolderDataModule", "--data.root", str(data), "--data.val_dir", "val",
        "--data.batch_size", "8", "--data.num_workers", "0", "--trainer.max_epochs", "3",
        "--trainer.logger", "false", "--checkpoint.every_n_train_steps", "1", *overrides,
    ]  # fmt: skip


def signal_at(step: int, *signals: str, rank: int = 0) -> list[str]:
    """Arguments adding tests.faults.SignalAt: these signals to the run after optimizer step `step`."""
    return [
        "--trainer.callbacks+=tests.faults.SignalAt", f"--trainer.callbacks.step={step}",
        f"--trainer.callbacks.signals=[{','.join(signals)}]", f"--trainer.callbacks.rank={rank}",
    ]  # fmt: skip


def run_script(args: list[str], env: dict | None = None, timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    """scripts/train.py in a fresh process, one thread (as the in-process runs here use)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
    env.pop("LOCAL_RANK", None)  # DDP: Lightning starts the other rank itself
    # In a session of its own, so that a run past its time is killed with every rank it started.
    process = subprocess.Popen(
        [sys.executable, str(ROOT / "scripts/train.py"), *args],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, start_new_session=True,
    )  # fmt: skip
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        raise AssertionError(f"the run did not end in {timeout} s; its output:\n{stderr[-3000:]}") from None
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def weights(cli_or_path) -> dict[str, torch.Tensor]:
    if isinstance(cli_or_path, Path):
        return torch.load(cli_or_path, weights_only=True)["state_dict"]
    return cli_or_path.model.state_dict()


def assert_bit_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    different = [name for name in a if not torch.equal(a[name], b[name])]
    assert not different, f"{len(different)} of {len(a)} tensors differ, e.g. {different[:3]}"


def assert_stop_line(stopped: subprocess.CompletedProcess, signal_name: str, step: int, saved: Path) -> None:
    """The last line of stderr says what stopped the run, where it was saved and how to resume."""
    line = stopped.stderr.strip().splitlines()[-1]
    assert line.startswith(f"Stopped by {signal_name} at step {step}; saved {saved}. Resume with: python "), line
    assert line.endswith("--ckpt_path last") and line.count("--ckpt_path") == 1, line


@pytest.mark.slow
def test_sigterm_sigint_and_kill_9_mid_epoch_resume_to_the_same_weights(tmp_path, one_thread):
    """The shipped CIFAR-10 ViT recipe, stopped three times in the middle of an epoch and resumed
    each time with --ckpt_path last, ends bit-identical to a run that was never stopped."""
    data = write_image_folder(tmp_path / "data")
    run = tmp_path / "run"

    # SIGTERM after step 2 of epoch 0's 4: saved, 143
    stopped = run_script(cifar_recipe(data, run, *signal_at(2, "SIGTERM")))
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    interrupted = run / "checkpoints" / "last-interrupted.ckpt"
    assert torch.load(interrupted, weights_only=True)["global_step"] == 2
    assert_stop_line(stopped, "SIGTERM", 2, interrupted)

    # Ctrl-C after step 6 (epoch 1, batch 2): saved, 130
    stopped = run_script(cifar_recipe(data, run, "--ckpt_path", "last", *signal_at(6, "SIGINT")))
    assert stopped.returncode == 130, stopped.stderr[-3000:]
    assert torch.load(interrupted, weights_only=True)["global_step"] == 6
    assert_stop_line(stopped, "SIGINT", 6, interrupted)

    # kill -9 after step 10 (epoch 2, batch 2): nothing saved then; the step-9 checkpoint is the newest
    stopped = run_script(cifar_recipe(data, run, "--ckpt_path", "last", *signal_at(10, "SIGKILL")))
    assert stopped.returncode == -signal.SIGKILL, stopped.stderr[-3000:]
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 9

    resumed = main(cifar_recipe(data, run, "--ckpt_path", "last"))
    assert resumed.trainer.global_step == 12
    straight = main(cifar_recipe(data, tmp_path / "straight"))
    assert straight.trainer.global_step == 12
    assert_bit_identical(weights(resumed), weights(straight))


# Every other shipped from-scratch image recipe (its optimizer, schedule, augmentation, EMA, mixup,
# drop path), trained on a small image folder at 32 px on the CPU; where the config's model is too
# big to train here in seconds, a small one of the same family stands in.
RECIPES = {
    "default.yaml": ["--trainer.limit_train_batches", "4", "--trainer.limit_val_batches", "1"],  # digits
    "cifar10_resnet.yaml": [],
    "cifar100_vit.yaml": [],
    "tiny_imagenet_vit.yaml": ["--model.model_kwargs", "{drop_path_rate: 0.1, img_size: 32}"],
    # the device pipeline
    "imagenet_vit_b16.yaml": ["--model.model_name", "vit_tiny_patch4_32", "--data.augment.crop", "rrc"],
    "imagenet_resnet50.yaml": ["--model.model_name", "resnet18", "--data.augment.crop", "rrc"],
}


@pytest.mark.slow
@pytest.mark.parametrize("config", RECIPES)
def test_every_shipped_recipe_resumes_mid_epoch_to_the_same_weights(tmp_path, one_thread, config):
    """SIGTERM after step 6 (epoch 1 of 3, batch 2 of 4), resumed with --ckpt_path last: the final
    model, EMA and optimizer state equal those of a run that was never stopped."""
    data = [] if config == "default.yaml" else [
        "--data", "vit.data.ImageFolderDataModule", "--data.root", str(write_image_folder(tmp_path / "data")),
        "--data.val_dir", "val", "--data.img_size", "32",
    ]  # fmt: skip

    def recipe(run: str, *extra: str) -> list[str]:
        return [
            "fit", "--config", str(ROOT / "configs" / config), *QUIET,
            "--trainer.default_root_dir", str(tmp_path / run), "--trainer.accelerator", "cpu",
            "--trainer.devices", "1", "--trainer.strategy", "auto",
            "--trainer.precision", "32-true", "--trainer.max_epochs", "3", "--trainer.logger", "false",
            *data, "--data.batch_size", "8", "--data.num_workers", "0", *RECIPES[config], *extra,
        ]  # fmt: skip

    with pytest.raises(SystemExit) as stopped:
        main(recipe("run", *signal_at(6, "SIGTERM")))
    assert stopped.value.code == 143
    assert torch.load(tmp_path / "run/checkpoints/last-interrupted.ckpt", weights_only=True)["global_step"] == 6
    resumed = main(recipe("run", "--ckpt_path", "last"))
    straight = main(recipe("straight"))
    assert resumed.trainer.global_step == straight.trainer.global_step == 12
    assert_bit_identical(weights(resumed), weights(straight))  # the model and its EMA, if any
    a, b = (cli.trainer.optimizers[0].state_dict()["state"] for cli in (resumed, straight))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[i][k], b[i][k]) for i in a for k in a[i] if torch.is_tensor(a[i][k]))


DIGITS = ["--trainer.logger", "false", "--trainer.limit_val_batches", "1"]


def test_a_full_disk_stops_the_run_loudly_and_keeps_the_previous_checkpoint(tmp_path, capsys, file_size_limit):
    """configs/default.yaml, checkpointing every 5 steps; after step 7 the disk is full: the step-10
    save fails part-way. The run exits 1 naming the file and the OS error; every file under a
    checkpoint name is complete (the step-5 last.ckpt), and no temporary file is left behind."""
    with pytest.raises(SystemExit) as exit_info:
        main([
            "fit", "--config", str(ROOT / "configs/default.yaml"), "--trainer.default_root_dir", str(tmp_path), *QUIET,
            *DIGITS, "--trainer.max_epochs", "1", "--checkpoint.every_n_train_steps", "5",
            "--trainer.callbacks+=tests.faults.DiskFullAfter", "--trainer.callbacks.step=7",
            "--trainer.callbacks.max_bytes=100000",
        ])  # fmt: skip
    assert exit_info.value.code == 1
    checkpoints = tmp_path / "checkpoints"
    last_line = capsys.readouterr().err.strip().splitlines()[-1]
    assert last_line == f"error: could not write checkpoint {checkpoints / 'last.ckpt'}: File too large"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["last.ckpt"]
    assert torch.load(checkpoints / "last.ckpt", weights_only=True)["global_step"] == 5


def test_an_unwritable_checkpoint_directory_fails_the_run(tmp_path, capsys):
    (tmp_path / "checkpoints").write_text("a file where the checkpoint directory should be")
    with pytest.raises(SystemExit) as exit_info:
        main([
            "fit", "--config", str(ROOT / "configs/default.yaml"), "--trainer.default_root_dir", str(tmp_path), *QUIET,
            *DIGITS, "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "2",
        ])  # fmt: skip
    assert exit_info.value.code not in (0, None)
    err = capsys.readouterr().err
    assert str(tmp_path / "checkpoints") in err.strip().splitlines()[-1]


def test_resume_from_last_skips_incomplete_files_and_a_truncated_path_is_named(tmp_path, capsys, caplog):
    args = ["fit", "--config", str(ROOT / "configs/default.yaml"), "--trainer.default_root_dir", str(tmp_path),
            *QUIET, *DIGITS, "--trainer.limit_train_batches", "3"]  # fmt: skip
    main([*args, "--trainer.max_epochs", "1"])
    checkpoints = tmp_path / "checkpoints"
    good = (checkpoints / "last.ckpt").read_bytes()
    (checkpoints / "last-interrupted.ckpt").write_bytes(b"")  # newer, as a full disk left them before
    (checkpoints / "last-v1.ckpt").write_bytes(good[: len(good) // 2])

    with caplog.at_level("WARNING", logger="vit"):
        resumed = main([*args, "--trainer.max_epochs", "2", "--ckpt_path", "last"])
    assert resumed.trainer.global_step == 6  # continued from last.ckpt's 3 steps
    for name in ("last-interrupted.ckpt", "last-v1.ckpt"):
        assert f"skipping {checkpoints / name}: it is not a complete checkpoint" in caplog.text

    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--trainer.max_epochs", "3", "--ckpt_path", str(checkpoints / "last-v1.ckpt")])
    assert exit_info.value.code == 1
    last_line = capsys.readouterr().err.strip().splitlines()[-1]
    assert last_line.startswith(f"error: checkpoint {checkpoints / 'last-v1.ckpt'} is incomplete")


def test_a_checkpoint_file_is_not_resumed_as_another_model_but_takes_a_new_lr(tmp_path, capsys, caplog):
    """--ckpt_path FILE used to replace --model.* with the checkpoint's options silently (asked for
    resnet20, trained the ViT again; a new lr was dropped): a differing option is refused with both
    values, a new lr is used and said."""
    args = ["fit", "--config", str(ROOT / "configs/default.yaml"), "--trainer.default_root_dir", str(tmp_path),
            *QUIET, *DIGITS, "--trainer.limit_train_batches", "3"]  # fmt: skip
    main([*args, "--trainer.max_epochs", "1"])
    last = tmp_path / "checkpoints" / "last.ckpt"
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--trainer.max_epochs", "2", "--ckpt_path", str(last), "--model.model_name", "resnet20"])
    assert exit_info.value.code == 1
    message = capsys.readouterr().err.strip().splitlines()[-1]
    assert message.startswith(f"error: --ckpt_path {last} resumes the run it was saved from, but ")
    assert "model.model_name is 'resnet20' here but 'vit_nano_patch4_16' in the checkpoint" in message
    with caplog.at_level("INFO", logger="vit"):
        resumed = main([*args, "--trainer.max_epochs", "2", "--ckpt_path", str(last), "--model.optimizer.lr", "1e-3"])
    assert "resuming with peak lr 0.001 instead of the checkpoint's 0.002" in caplog.text
    assert resumed.model.optimizer.lr == 1e-3 and resumed.trainer.global_step == 6


def test_nan_weights_are_never_saved_and_the_advice_to_resume_with_a_lower_lr_works(tmp_path, capsys, caplog):
    """Weights turn NaN after step 5 of 8 (checkpoints every step): the step-5 save is refused,
    the run exits 1 naming last.ckpt (step 4, finite) as the one to resume from; resuming with
    --model.optimizer.lr halved really trains at half the rate, and says so."""
    from vit.schedule import warmup_decay_steps

    args = ["fit", "--config", str(ROOT / "configs/default.yaml"), "--trainer.default_root_dir", str(tmp_path),
            *QUIET, *DIGITS, "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "8",
            "--checkpoint.every_n_train_steps", "1"]  # fmt: skip
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--trainer.callbacks+=tests.faults.PoisonAt", "--trainer.callbacks.step=5"])
    assert exit_info.value.code == 1
    last = tmp_path / "checkpoints" / "last.ckpt"
    message = capsys.readouterr().err.strip().splitlines()[-1]
    assert message.startswith("error: the weights are not finite after step 5 (model.head.weight); not saving")
    assert f"not saving {last}. The last good checkpoint is {last} " in message
    assert "--ckpt_path last --model.optimizer.lr <lower>" in message
    checkpoint = torch.load(last, weights_only=True)
    assert checkpoint["global_step"] == 4 and checkpoint["hyper_parameters"]["optimizer"]["lr"] == 2e-3
    assert all(v.isfinite().all() for v in checkpoint["state_dict"].values() if v.is_floating_point())
    assert not (tmp_path / "checkpoints" / "last-interrupted.ckpt").exists()

    with caplog.at_level("INFO", logger="vit"):
        resumed = main(
            [*args, "--ckpt_path", "last", "--model.optimizer.lr", "1e-3", "--trainer.callbacks+=tests.faults.RecordLR"]
        )
    assert "resuming with peak lr 0.001 instead of the checkpoint's 0.002" in caplog.text
    lrs = next(cb for cb in resumed.trainer.callbacks if hasattr(cb, "lrs")).lrs
    # the schedule of default.yaml over these 8 steps (warmup cut to 4), peak 1e-3, min_lr 1e-5
    expected = {step: 1e-3 * warmup_decay_steps(step, 4, 8, 1e-5 / 1e-3) for step in range(4, 8)}
    assert lrs == pytest.approx(expected, rel=1e-9)


def test_a_nan_before_any_checkpoint_says_to_start_again_not_to_resume(tmp_path, capsys):
    args = ["fit", "--config", str(ROOT / "configs/default.yaml"), "--trainer.default_root_dir", str(tmp_path),
            *QUIET, *DIGITS, "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "4"]  # fmt: skip
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--trainer.callbacks+=tests.faults.PoisonAt", "--trainer.callbacks.step=2"])
    assert exit_info.value.code == 1
    message = capsys.readouterr().err.strip().splitlines()[-1]
    assert message.startswith("error: training loss is nan at step 2 ")
    assert message.endswith(
        "No checkpoint was saved before it; start again with a lower learning rate (--model.optimizer.lr <lower>), "
        "gradient clipping (--trainer.gradient_clip_val 1.0), or check the data."
    )
    assert not list((tmp_path / "checkpoints").glob("*.ckpt"))


@pytest.mark.slow
def test_a_corrupt_image_under_ddp_stops_every_rank_with_the_error(tmp_path):
    """2 processes (gloo), per-sample loading, one truncated JPEG: the rank that reads it fails
    with the file's name, the other follows (its collective finds the peer gone): no hang, no save."""
    data = write_image_folder(tmp_path / "data", ext="jpg")
    corrupt = data / "train" / "class0" / "3.jpg"
    corrupt.write_bytes(corrupt.read_bytes()[:300])
    stopped = run_script(
        cifar_recipe(data, tmp_path / "run", "--data.pipeline", "per_sample", "--trainer.accelerator", "cpu",
                     "--trainer.strategy", "ddp", "--trainer.devices", "2", "--data.batch_size", "4"),
        env={"MASTER_PORT": str(_free_port())}, timeout=120,  # it hung forever before
    )  # fmt: skip
    assert stopped.returncode != 0
    assert f"error: cannot decode image {corrupt}: " in stopped.stderr  # not PIL's bare "Truncated File Read"
    assert not list((tmp_path / "run" / "checkpoints").glob("last-interrupted*.ckpt"))


@pytest.mark.slow
def test_a_nan_loss_on_one_ddp_rank_stops_every_rank_at_the_same_step(tmp_path):
    """Rank 1's weights turn NaN after step 2 of a 2-process run: at step 2 both ranks stop with
    the NaN error before the update (rank 0's own loss was finite), neither waits for the other
    forever, and no checkpoint of the NaN state is written."""
    data = write_image_folder(tmp_path / "data")
    stopped = run_script(
        cifar_recipe(data, tmp_path / "run", "--data.pipeline", "per_sample", "--trainer.accelerator", "cpu",
                     "--trainer.strategy", "ddp", "--trainer.devices", "2", "--data.batch_size", "4",
                     "--trainer.callbacks+=tests.faults.PoisonAt", "--trainer.callbacks.step=2",
                     "--trainer.callbacks.rank=1"),
        env={"MASTER_PORT": str(_free_port())}, timeout=180,
    )  # fmt: skip
    assert stopped.returncode != 0
    assert "training loss is nan at step 2 (epoch 0, batch 2); the weights were already not finite" in stopped.stderr
    assert "training loss is not finite on another rank at step 2 (epoch 0, batch 2); stopped before" in stopped.stderr
    saved = sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("*.ckpt"))
    assert saved and all(torch.load(tmp_path / "run" / "checkpoints" / name, weights_only=True)["global_step"] <= 2
                         for name in saved)  # fmt: skip


@pytest.mark.slow
def test_skip_corrupt_under_ddp_keeps_the_ranks_in_step_to_the_end(tmp_path):
    """The same with --data.skip_corrupt: a corrupt training image is replaced by the next one and a
    corrupt validation image left out, every batch keeps its size, so both ranks finish together."""
    data = write_image_folder(tmp_path / "data")
    for path in (data / "train" / "class0" / "3.png", data / "val" / "class1" / "0.png"):
        path.write_bytes(path.read_bytes()[:300])
    done = run_script(
        cifar_recipe(data, tmp_path / "run", "--data.pipeline", "per_sample", "--trainer.accelerator", "cpu",
                     "--trainer.strategy", "ddp", "--trainer.devices", "2", "--data.batch_size", "4",
                     "--data.skip_corrupt", "true", "--trainer.max_epochs", "2"),
        env={"MASTER_PORT": str(_free_port())}, timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "class0/3.png" in done.stderr and "class1/0.png" in done.stderr  # logged by name
    last = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)
    assert last["global_step"] == 8  # 32 images, 2 ranks x 4 a batch: 4 steps an epoch, 2 epochs


@pytest.mark.slow
@pytest.mark.parametrize(
    ("signal_name", "rank", "exit_code"), [("SIGTERM", 0, 143), ("SIGTERM", 1, 143), ("SIGINT", 1, 130)]
)
def test_a_signal_to_one_ddp_rank_stops_every_rank_after_the_same_step_and_saves_once(
    tmp_path, signal_name, rank, exit_code
):
    """A signal to one process of a 2-process run (`kill PID` reaches rank 0 only, a scheduler or
    Ctrl-C each rank at its own moment), after step 5: the ranks agree to stop after the next step
    (their marks, reduced on the device, are read a step later), save one interrupt checkpoint
    together, the run says how to resume and exits 128 + the signal; resuming finishes the run."""
    data = write_image_folder(tmp_path / "data")
    ddp = ["--data.pipeline", "per_sample", "--trainer.accelerator", "cpu", "--trainer.strategy", "ddp",
           "--trainer.devices", "2", "--data.batch_size", "4"]  # fmt: skip
    stopped = run_script(
        cifar_recipe(data, tmp_path / "run", *ddp, *signal_at(5, signal_name, rank=rank)),
        env={"MASTER_PORT": str(_free_port())}, timeout=180,
    )  # fmt: skip
    assert stopped.returncode == exit_code, stopped.stderr[-3000:]
    assert stopped.stderr.count(f"Stopped by {signal_name} at step 6; saved") == 1, stopped.stderr[-3000:]
    checkpoints = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in checkpoints.glob("last-interrupted*.ckpt")) == ["last-interrupted.ckpt"]
    assert torch.load(checkpoints / "last-interrupted.ckpt", weights_only=True)["global_step"] == 6
    if rank == 0:  # resuming is the same for every row; run it once
        resumed = run_script(
            cifar_recipe(data, tmp_path / "run", *ddp, "--ckpt_path", "last"), env={"MASTER_PORT": str(_free_port())},
            timeout=180,
        )  # fmt: skip
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert torch.load(checkpoints / "last.ckpt", weights_only=True)["global_step"] == 12


class InterruptWhenBuilt(L.Callback):
    """Sends SIGINT to this process when the command line builds it: before training starts."""

    def __init__(self) -> None:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.5)  # its handler runs here


@pytest.mark.slow
def test_sigint_stops_a_run_started_with_sigint_ignored_before_training_too(tmp_path):
    """A shell script's background job (`python scripts/train.py ... &`) starts with SIGINT ignored.
    A SIGINT (`kill -INT`, a supervisor's stop signal) stopped its training, but one sent while the
    command was set up was dropped and the run went on. It stops the command at once, in one line,
    exit 130."""
    data = write_image_folder(tmp_path / "data", train=4, val=2)
    args = cifar_recipe(data, tmp_path / "run", "--trainer.callbacks+=tests.test_fault_tolerance.InterruptWhenBuilt")
    stopped = subprocess.run(
        [sys.executable, str(ROOT / "scripts/train.py"), *args], capture_output=True, text=True, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}, timeout=TIMEOUT,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),  # as the shell starts it
    )  # fmt: skip
    assert stopped.returncode == 130, stopped.stderr[-3000:]
    last = stopped.stderr.strip().splitlines()[-1]
    assert last == "Stopped by SIGINT before training started; nothing trained, so no checkpoint."
    assert not list((tmp_path / "run").rglob("*.ckpt"))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("num_classes", [7, 20])
def test_a_head_for_another_class_count_than_the_data_is_refused_before_training(tmp_path, num_classes):
    import lightning as L

    from vit.data import DigitsDataModule
    from vit.lit import ImageClassifier

    trainer = L.Trainer(default_root_dir=tmp_path, logger=False, max_steps=1, enable_progress_bar=False)
    message = f"model.num_classes is {num_classes} but the data has 10 classes"
    with pytest.raises(ValueError, match=message):
        trainer.fit(ImageClassifier(num_classes=num_classes), DigitsDataModule(batch_size=8, num_workers=0))
    assert trainer.global_step == 0


def test_lr_scaling_uses_the_real_batch_when_the_data_is_smaller_than_one(tmp_path):
    """16 images, batch_size 64, lr 1e-3 per 64 images: every step sees 16, so the lr is 2.5e-4."""
    import lightning as L

    from tests.faults import RecordLR
    from vit.data import ImageFolderDataModule
    from vit.lit import ImageClassifier

    data = write_image_folder(tmp_path / "data", train=4)
    module = ImageClassifier("vit_nano_patch4_16", {"img_size": 32}, optimizer={"lr": 1e-3, "lr_base_batch_size": 64})
    datamodule = ImageFolderDataModule(str(data), val_dir="val", img_size=32, batch_size=64, num_workers=0)
    record = RecordLR()
    trainer = L.Trainer(default_root_dir=tmp_path, logger=False, max_steps=1, enable_progress_bar=False,
                        callbacks=[record], limit_val_batches=0)  # fmt: skip
    trainer.fit(module, datamodule)
    assert record.lrs == {0: pytest.approx(1e-3 * 16 / 64)}


def _linear_module(score: Callable[[int], float]):
    """A one-layer LightningModule that logs `score(epoch)` as "score" at each validation."""
    import lightning as L

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)

        def training_step(self, batch, batch_idx):
            return self.layer(batch[0]).pow(2).mean()

        def validation_step(self, batch, batch_idx):
            self.log("score", score(self.current_epoch))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Module()


def test_last_checkpoint_is_the_final_state_when_the_final_epoch_is_not_the_best(tmp_path):
    """Lightning 2.6 refreshes last.ckpt only when a top-k checkpoint is written at that step; a
    resume from it would repeat every epoch since the best one."""
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from vit.fault_tolerance import RunCheckpoint

    data = DataLoader(TensorDataset(torch.randn(8, 2)), batch_size=4)
    ckpt = RunCheckpoint(dirpath=tmp_path, monitor="score", mode="max", save_last=True, save_top_k=1)
    trainer = L.Trainer(max_epochs=3, callbacks=[ckpt], logger=False, enable_progress_bar=False,
                        enable_model_summary=False)  # fmt: skip
    module = _linear_module(lambda epoch: 1.0 / (1 + epoch))  # best at epoch 0, worse after
    trainer.fit(module, data, data)
    last = torch.load(ckpt.last_model_path, weights_only=True)
    assert torch.load(ckpt.best_model_path, weights_only=True)["global_step"] == 2  # epoch 0 was the best
    assert last["global_step"] == trainer.global_step == 6
    assert torch.equal(last["state_dict"]["layer.weight"], module.layer.weight.detach())


def test_last_checkpoint_is_the_final_state_when_a_budget_stops_the_run_between_validations(tmp_path):
    """A time budget that runs out in an epoch without a validation (here: a stop after step 5 of 2
    an epoch, validating every 2nd epoch) must not leave last.ckpt at step 4."""
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from vit.fault_tolerance import RunCheckpoint

    class StopAfter(L.Callback):  # what WallClockBudget does when the time is up
        def on_train_batch_end(self, trainer, *args) -> None:
            trainer.should_stop = trainer.global_step >= 5

    data = DataLoader(TensorDataset(torch.randn(8, 2)), batch_size=4)
    ckpt = RunCheckpoint(dirpath=tmp_path, monitor="score", mode="max", save_last=True, save_top_k=1)
    trainer = L.Trainer(max_epochs=10, check_val_every_n_epoch=2, callbacks=[StopAfter(), ckpt], logger=False,
                        enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    module = _linear_module(lambda epoch: 1.0)
    trainer.fit(module, data, data)
    assert torch.load(ckpt.best_model_path, weights_only=True)["global_step"] == 4  # the one validation
    last = torch.load(ckpt.last_model_path, weights_only=True)
    assert last["global_step"] == trainer.global_step == 5
    assert torch.equal(last["state_dict"]["layer.weight"], module.layer.weight.detach())


def test_a_finished_ddp_run_destroys_its_process_group_before_exit(tmp_path):
    """Not left to interpreter teardown, where gloo's threads can abort a finished run (exit -6, seen
    once in the CPU gpu-check here). A one-process DDP run through `vit.cli.main`, as
    scripts/train.py runs it; atexit shows what teardown would find."""
    data = write_image_folder(tmp_path / "data")
    code = (
        "import atexit, sys, torch.distributed as dist\n"
        "destroy = dist.destroy_process_group\n"
        "def traced(*args, **kwargs):\n"
        "    print('destroying a group of', dist.get_world_size())\n"
        "    return destroy(*args, **kwargs)\n"
        "dist.destroy_process_group = traced\n"
        "atexit.register(lambda: print('at exit, a group:', dist.is_initialized()))\n"
        "from vit.cli import main\n"
        "main(sys.argv[1:])\n"
    )
    args = cifar_recipe(data, tmp_path / "run", "--trainer.accelerator", "cpu", "--trainer.strategy", "ddp",
                        "--trainer.devices", "1", "--trainer.max_epochs", "1")  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "MASTER_PORT": str(_free_port())}
    env.pop("LOCAL_RANK", None)
    done = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith(("destroying", "at exit"))]
    assert lines == ["destroying a group of 1", "at exit, a group: False"], done.stdout[-3000:]


def test_a_nan_loss_in_a_step_the_run_stops_before_taking_is_still_an_error(tmp_path):
    """2 batches a step; batch 4 (the first of step 2) has a NaN loss and the run is told to stop
    after it (a time budget, a signal): no step takes it, yet the run ends with the error, not as if
    it were fine; the same task trained again starts with no stale loss to report."""
    import lightning as L

    from tests.conftest import quiet_trainer
    from vit.data import DigitsDataModule
    from vit.lit import ImageClassifier
    from vit.training import NonFiniteLossError

    class NaNAt4(ImageClassifier):
        poisoned = True

        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            return loss * float("nan") if self.poisoned and batch_idx == 4 else loss

    class StopAfter4(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            trainer.should_stop = trainer.should_stop or batch_idx == 4

    task = NaNAt4("vit_nano_patch4_16", num_classes=10)
    trainer = quiet_trainer(tmp_path / "a", max_epochs=2, accumulate_grad_batches=2, limit_val_batches=0,
                            callbacks=[StopAfter4()])  # fmt: skip
    with pytest.raises(NonFiniteLossError, match=r"training loss is nan at step 2 \(epoch 0, batch 4\)"):
        trainer.fit(task, DigitsDataModule(batch_size=64, num_workers=0))
    assert trainer.global_step == 2
    task.poisoned = False
    again = quiet_trainer(tmp_path / "b", max_steps=1, limit_val_batches=0)
    again.fit(task, DigitsDataModule(batch_size=64, num_workers=0))
    assert again.global_step == 1
