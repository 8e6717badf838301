"""A run's checkpoints and labels survive what users do between runs: evaluating in the run folder,
resuming with a wrong option, renaming a class folder, corrupt files, step checkpoints. Each test
runs scripts/train.py's `main` as a user runs the command."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image

from tests.conftest import ROOT, write_image_folder
from tests.test_fault_tolerance import QUIET, signal_at
from vit.cli import main


def base(data: Path, run: Path, *overrides: str, command: str = "fit") -> list[str]:
    """configs/cifar10_vit.yaml on a small image folder, in memory: 48 training images of 4 classes,
    batch 12, so 4 steps an epoch; 2 epochs; a checkpoint every 3 steps (README's advice against
    kill -9)."""
    return [
        command, "--config", str(ROOT / "configs/cifar10_vit.yaml"), "--trainer.default_root_dir", str(run), *QUIET,
        "--data", "vit.data.ImageFolderDataModule", "--data.root", str(data), "--data.val_dir", "val",
        "--data.img_size", "32", "--data.pipeline", "memory", "--data.batch_size", "12", "--data.num_workers", "0",
        "--trainer.logger", "false", *(["--trainer.max_epochs", "2", "--checkpoint.every_n_train_steps", "3"]
                                       if command == "fit" else []), *overrides,
    ]  # fmt: skip


@pytest.fixture
def data(tmp_path) -> Path:
    return write_image_folder(tmp_path / "data", train=12, val=4, ext="jpg")


def interrupted_run(data: Path, run: Path, step: int = 5) -> Path:
    """A run stopped by SIGTERM after `step` (epoch 1, after step 4's last.ckpt): its interrupt checkpoint."""
    with pytest.raises(SystemExit) as stopped:
        main(base(data, run, *signal_at(step, "SIGTERM")))
    assert stopped.value.code == 143
    interrupted = run / "checkpoints" / "last-interrupted.ckpt"
    assert torch.load(interrupted, weights_only=True)["global_step"] == step
    return interrupted


def last_error(capsys) -> str:
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_validate_test_and_predict_in_a_run_folder_leave_its_checkpoints_alone(tmp_path, data):
    """Evaluating the interrupt checkpoint (README's own command) used to delete it at the end: the
    next `--ckpt_path last` resumed from the older last.ckpt and the steps since were lost."""
    run = tmp_path / "run"
    interrupted = interrupted_run(data, run)
    before = {p.name: p.read_bytes() for p in (run / "checkpoints").glob("*.ckpt")}
    for command in ("validate", "test", "predict"):
        main(base(data, run, "--ckpt_path", str(interrupted), command=command))
    assert {p.name: p.read_bytes() for p in (run / "checkpoints").glob("*.ckpt")} == before
    resumed = main(base(data, run, "--ckpt_path", "last", "--trainer.max_steps", "6"))
    assert resumed.trainer.global_step == 6
    assert not interrupted.exists()  # a fit that finished has no use for it: last.ckpt is newer


@pytest.mark.parametrize("option", [["--model.optimizer.name", "adamw"], ["--model.finetune.head_lr", "0.01"]])
def test_a_resume_with_a_changed_option_is_refused_and_leaves_the_run_resumable(tmp_path, data, capsys, option):
    """`--ckpt_path last` with an option the checkpoint's optimizer state cannot take used to fail
    with a traceback and, failing, write a new last-interrupted.ckpt with an empty optimizer
    state, which every later resume then picked and failed on."""
    run = tmp_path / "run"
    interrupted = interrupted_run(data, run)
    before = interrupted.read_bytes()
    with pytest.raises(SystemExit) as refused:
        main(base(data, run, "--ckpt_path", "last", *option))
    assert refused.value.code == 1
    message = last_error(capsys)
    name = option[0].removeprefix("--")
    assert message.startswith(f"error: --ckpt_path last ({interrupted}) resumes the run it was saved from, but {name}")
    assert interrupted.read_bytes() == before
    resumed = main(base(data, run, "--ckpt_path", "last"))
    assert resumed.trainer.global_step == 8


def test_a_resume_that_fails_while_restoring_writes_no_checkpoint(tmp_path, data):
    """Whatever fails before the restored run trains (here: an optimizer with other parameter groups,
    past the CLI's option check), the run's checkpoints are left as they were."""
    import lightning as L

    from vit.data import ImageFolderDataModule
    from vit.fault_tolerance import InterruptCheckpoint, checkpoint_dir
    from vit.lit import ImageClassifier

    run = tmp_path / "run"
    interrupted = interrupted_run(data, run)
    before = {p.name: p.read_bytes() for p in (run / "checkpoints").glob("*.ckpt")}
    saved = torch.load(interrupted, weights_only=True)["hyper_parameters"]
    hparams = {k: v for k, v in saved.items() if k[0] != "_"}
    # the run's model, with one more parameter group
    module = ImageClassifier(**{**hparams, "finetune": {"head_lr": 0.01}})
    datamodule = ImageFolderDataModule(str(data), val_dir="val", img_size=32, batch_size=12, num_workers=0)
    trainer = L.Trainer(default_root_dir=run, logger=False, max_epochs=2, enable_progress_bar=False)
    with pytest.raises((ValueError, RuntimeError)):
        trainer.fit(module, datamodule, ckpt_path=interrupted)
    callback = next(cb for cb in trainer.callbacks if isinstance(cb, InterruptCheckpoint))
    assert callback.saved is None and Path(callback.dirpath) == checkpoint_dir(run)
    assert {p.name: p.read_bytes() for p in (run / "checkpoints").glob("*.ckpt")} == before


@pytest.mark.parametrize("pipeline", ["memory", "per_sample"])
@pytest.mark.parametrize("split", ["train", "val"])
def test_a_truncated_jpeg_stops_the_run_naming_the_file(tmp_path, data, capsys, pipeline, split):
    corrupt = data / split / "class1" / "0.jpg"
    corrupt.write_bytes(corrupt.read_bytes()[:400])
    with pytest.raises(SystemExit) as stopped:
        main(base(data, tmp_path / "run", "--data.pipeline", pipeline))
    assert stopped.value.code == 1
    assert last_error(capsys).startswith(f"error: cannot decode image {corrupt}: ")


def test_a_truncated_jpeg_read_by_a_loader_worker_is_named_in_one_line(tmp_path, data, capsys):
    corrupt = data / "train" / "class2" / "3.jpg"
    corrupt.write_bytes(corrupt.read_bytes()[:400])
    with pytest.raises(SystemExit) as stopped:
        main(base(data, tmp_path / "run", "--data.pipeline", "per_sample", "--data.num_workers", "1"))
    assert stopped.value.code == 1
    assert last_error(capsys).startswith(f"error: cannot decode image {corrupt}: ")


def test_decompression_bombs_and_broken_symlinks_are_named_and_skipped_with_skip_corrupt(
    tmp_path, data, capsys, caplog, monkeypatch
):
    """PIL refuses images over twice Image.MAX_IMAGE_PIXELS (a 15000x12000 PNG by default): lowered
    here, so that a 64x64 image is one."""
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    bomb = data / "train" / "class2" / "bomb.png"
    Image.new("RGB", (64, 64)).save(bomb)
    with pytest.raises(SystemExit) as stopped:
        main(base(data, tmp_path / "run", "--data.pipeline", "per_sample"))
    assert stopped.value.code == 1
    message = last_error(capsys)
    assert message.startswith(f"error: cannot decode image {bomb}: ") and "decompression bomb" in message

    (data / "val" / "class3" / "gone.jpg").symlink_to(tmp_path / "nowhere.jpg")
    with caplog.at_level("WARNING", logger="vit"):
        done = main(base(data, tmp_path / "run2", "--data.pipeline", "per_sample", "--data.skip_corrupt", "true"))
    assert done.trainer.global_step == 8
    assert f"skipped cannot decode image {bomb}" in caplog.text
    gone = data / "val" / "class3" / "gone.jpg"
    assert f"skipped cannot read image {gone}" in caplog.text

    bomb.unlink()  # the link alone, in memory and decoded on the device: named as such, skipped with skip_corrupt
    caplog.clear()
    with caplog.at_level("WARNING", logger="vit"):
        done = main(base(data, tmp_path / "run3", "--data.skip_corrupt", "true"))
    assert done.trainer.global_step == 8 and f"skipped cannot read image {gone}: it is a broken symlink" in caplog.text
    device = ["--data.pipeline", "device", "--data.augment.crop", "rrc"]
    with pytest.raises(SystemExit) as stopped:
        main(base(data, tmp_path / "run4", *device))
    assert stopped.value.code == 1
    assert last_error(capsys).startswith(f"error: cannot read image {gone}: it is a broken symlink (to ")


def test_read_rgb_names_a_real_decompression_bomb(tmp_path):
    from vit.data.images import CorruptImageError, read_rgb

    bomb = tmp_path / "bomb.png"
    Image.new("1", (15000, 12000)).save(bomb)  # 180 megapixels, 22 KB on disk
    with pytest.raises(CorruptImageError, match=f"cannot decode image {bomb}: .*decompression bomb"):
        read_rgb(bomb)


def test_best_checkpoints_hold_the_weights_that_had_their_score(tmp_path, data):
    """Step checkpoints (every 3 steps) between validations (after steps 4 and 8) used to enter the
    top-k with the score of the last validation: best-*.ckpt held weights that never had it."""
    run = tmp_path / "run"
    done = main(base(data, run, "--trainer.max_epochs", "3", "--checkpoint.save_top_k", "3"))
    ckpt = done.trainer.checkpoint_callback
    best = sorted((run / "checkpoints").glob("best-*.ckpt"))
    assert best and {torch.load(p, weights_only=True)["global_step"] for p in best} <= {4, 8, 12}
    validated = main(base(data, run, "--ckpt_path", ckpt.best_model_path, command="validate"))
    score = validated.trainer.callback_metrics["val/acc1"]
    assert float(score) == pytest.approx(float(ckpt.best_model_score))


def test_renamed_or_added_class_folders_are_refused_on_resume_with_both_lists(tmp_path, data, capsys):
    """A renamed class folder sorted elsewhere used to shift every label silently under the trained head."""
    run = tmp_path / "run"
    interrupted_run(data, run)
    for split in ("train", "val"):
        (data / split / "class0").rename(data / split / "zebra")
    with pytest.raises(SystemExit) as refused:
        main(base(data, run, "--ckpt_path", "last"))
    assert refused.value.code == 1
    message = last_error(capsys)
    assert "was trained on the classes ['class0', 'class1', 'class2', 'class3']" in message
    assert "the data has ['class1', 'class2', 'class3', 'zebra']" in message
    assert "--model.finetune.init_from" in message

    for split in ("train", "val"):
        (data / split / "zebra").rename(data / split / "class0")
        shutil.copytree(data / split / "class3", data / split / "class4")
    with pytest.raises(SystemExit) as refused:
        main(base(data, run, "--ckpt_path", "last"))
    assert refused.value.code == 1
    message = last_error(capsys)
    assert "was trained on the classes ['class0', 'class1', 'class2', 'class3']" in message
    assert "the data has ['class0', 'class1', 'class2', 'class3', 'class4']" in message


def test_last_is_chosen_by_saved_step_and_stray_temporaries_are_removed(tmp_path, data):
    """`--ckpt_path last` took the newest file by time: a copy or restore that touched an older
    checkpoint made it win. Temporary files of a write killed part-way stayed, up to a
    checkpoint's size, until the next save."""
    import os

    run = tmp_path / "run"
    interrupted = interrupted_run(data, run)  # step 5; last.ckpt is step 4
    checkpoints = run / "checkpoints"
    os.utime(checkpoints / "last.ckpt")  # touched after the interrupt checkpoint, as a copy back would
    stray = checkpoints / ".last.ckpt.tmp"
    stray.write_bytes(b"\0" * 1000)
    recorder = "--trainer.callbacks+=tests.faults.RecordLR"
    resumed = main(base(data, run, "--ckpt_path", "last", recorder))
    assert resumed.trainer.ckpt_path == str(interrupted)
    first_step = min(next(cb for cb in resumed.trainer.callbacks if hasattr(cb, "lrs")).lrs)
    assert first_step == 5 and resumed.trainer.global_step == 8
    assert not stray.exists()


def test_a_moved_run_folder_resumes_with_its_last_and_best_checkpoints(tmp_path, data):
    """Resuming in a copied or moved folder wrote last-v1.ckpt beside a stale last.ckpt and forgot
    which checkpoints were best."""
    interrupted_run(data, tmp_path / "run")
    shutil.move(tmp_path / "run", tmp_path / "moved")
    resumed = main(base(data, tmp_path / "moved", "--ckpt_path", "last", "--checkpoint.save_top_k", "2"))
    checkpoints = tmp_path / "moved" / "checkpoints"
    names = sorted(p.name for p in checkpoints.glob("*.ckpt"))
    assert "last-v1.ckpt" not in names and "last.ckpt" in names
    assert torch.load(checkpoints / "last.ckpt", weights_only=True)["global_step"] == 8
    ckpt = resumed.trainer.checkpoint_callback
    assert sorted(Path(p).name for p in ckpt.best_k_models) == sorted(n for n in names if n.startswith("best-"))
    assert len(ckpt.best_k_models) == 2 and all(Path(p).parent == checkpoints for p in ckpt.best_k_models)


def test_sharded_checkpoints_with_a_truncated_shard_are_skipped_and_consolidation_names_the_problem(tmp_path, capsys):
    """A truncated shard stopped both ranks with EOFError; consolidating a plain file or a missing
    path said "not a complete sharded checkpoint"."""
    import torch.distributed.checkpoint as dcp

    from vit.fault_tolerance import METADATA, newest_complete
    from vit.sharding import main as consolidate_main

    def sharded(name: str, step: int) -> Path:
        folder = tmp_path / name
        dcp.save({"state_dict": {"w": torch.arange(1000.0)}}, checkpoint_id=folder)  # one process, no group
        torch.save({"global_step": step}, folder / METADATA)
        return folder

    older, newer = sharded("last.ckpt", 4), sharded("last-interrupted.ckpt", 5)
    assert newest_complete([older, newer]) == newer
    (shard,) = newer.glob("*.distcp")
    shard.write_bytes(shard.read_bytes()[:100])
    assert newest_complete([older, newer]) == older

    for path, message in [
        (newer, f"{newer} is not a complete sharded checkpoint: its index (.metadata) or meta.pt is missing"),
        (tmp_path / "nowhere", f"{tmp_path / 'nowhere'} does not exist; expected a sharded checkpoint directory"),
        (shard, f"{shard} is a file, not a sharded checkpoint directory: it is one checkpoint already"),
    ]:
        with pytest.raises(SystemExit) as failed:
            consolidate_main([str(path), str(tmp_path / "out.ckpt")])
        assert str(failed.value.code).startswith(f"error: {message}")
    assert not (tmp_path / "out.ckpt").exists()


def test_resuming_a_budget_run_that_ended_trains_nothing_and_says_it_is_complete(tmp_path, data, caplog):
    budget = ["--trainer.callbacks+=vit.schedule.WallClockBudget", "--trainer.callbacks.minutes", "0.02",
              "--trainer.max_epochs", "50"]  # fmt: skip
    ended = main(base(data, tmp_path / "run", *budget))
    steps = ended.trainer.global_step
    assert 0 < steps < 200  # the budget, not max_epochs, ended it
    with caplog.at_level("INFO", logger="vit"):
        resumed = main(base(data, tmp_path / "run", *budget, "--ckpt_path", "last"))
    assert resumed.trainer.global_step == steps
    assert f"minutes was used up at step {steps}, when its checkpoint was saved: the run is complete" in caplog.text


def test_a_resume_with_another_batch_size_continues_after_the_images_seen_and_rescales_the_lr(tmp_path, data, caplog):
    """The position in the epoch was counted in batches: resumed with batch_size 6 instead of 12, the
    run restarted the epoch after 6 images, not 12 (and with 24, after 24); the learning rate,
    scaled by the global batch (lr_base_batch_size), stayed the old batch's."""
    run = tmp_path / "run"
    interrupted_run(data, run)  # step 5: epoch 1 after its first batch of 12
    with caplog.at_level("INFO", logger="vit"):
        resumed = main(base(data, run, "--ckpt_path", "last", "--data.batch_size", "6"))
    assert resumed.trainer.global_step == 5 + 6  # epoch 1's last 36 images in batches of 6
    assert "the epoch goes on after the 12 images already seen (0 of them again)" in caplog.text
    assert "resuming with peak lr 0.0001875 instead of the checkpoint's 0.000375" in caplog.text  # 4e-3 x B / 128


@pytest.mark.parametrize(("before", "after"), [((12, 1), (3, 2)), ((4, 2), (5, 1)), ((3, 2), (8, 2))])
def test_the_images_of_an_epoch_are_each_seen_once_across_a_change_of_batch_size_and_process_count(before, after):
    """The samplers' order depends on (seed, epoch) alone, each process takes every W-th image:
    whatever the batch size and process count before and after, nothing is skipped and less than
    one global batch is seen twice."""
    from vit.data.memory import ResumableBatchSampler
    from vit.data.sampling import carry_position

    dataset = torch.utils.data.TensorDataset(torch.arange(48))
    (b, w), (b2, w2) = before, after

    def batches(batch_size: int, world: int, rank: int, start: int = 0) -> list[list[int]]:
        sampler = ResumableBatchSampler(dataset, batch_size, shuffle=True, seed=3, num_replicas=world, rank=rank)
        sampler.set_epoch(1)
        sampler.resume_epoch, sampler.resume_position = 1, start * batch_size
        return [batch.tolist() for batch, _ in sampler]

    done = 2  # batches each process finished before the stop
    seen = [i for rank in range(w) for batch in batches(b, w, rank)[:done] for i in batch]
    progress = {"current": {"ready": done, "started": done, "processed": done, "completed": done}}
    checkpoint = {"loops": {"fit_loop": {"epoch_loop.batch_progress": progress}}}
    carry_position(checkpoint, {"batch_size": b, "world_size": w}, {"batch_size": b2, "world_size": w2,
                                                                    "train_images": 48})  # fmt: skip
    start = progress["current"]["processed"]
    rest = [i for rank in range(w2) for batch in batches(b2, w2, rank, start) for i in batch]
    assert set(seen) | set(rest) == set(range(48))
    assert len(seen) + len(rest) - 48 < b2 * w2


@pytest.mark.parametrize("hook", ["batch_end", "step"])
def test_ctrl_c_during_validation_resumes_into_the_whole_validation_of_that_epoch(tmp_path, data, hook):
    """Stopped during epoch 0's validation (in a hook after a batch, or inside a validation step),
    the resumed run validated that epoch never (or on its remaining batches only) and kept no best
    checkpoint of it. It validates it from the first batch, with the uninterrupted run's score."""
    record = "--trainer.callbacks+=tests.faults.RecordValidations"
    stop = ["--trainer.callbacks+=tests.faults.InterruptInValidation", "--trainer.callbacks.epoch=0"]
    if hook == "step":
        stop.append("--trainer.callbacks.in_step=true")
    with pytest.raises(SystemExit) as stopped:
        main(base(data, tmp_path / "run", *stop))
    assert stopped.value.code == 130
    resumed = main(base(data, tmp_path / "run", "--ckpt_path", "last", record))
    straight = main(base(data, tmp_path / "straight", record))
    validations = [next(cb for cb in cli.trainer.callbacks if hasattr(cb, "validations")).validations
                   for cli in (resumed, straight)]  # fmt: skip
    assert validations[0] == validations[1] and [v[:2] for v in validations[0]] == [(0, 4), (1, 8)]
    assert (tmp_path / "run" / "checkpoints" / "best-epoch000-step4.ckpt").exists() == (
        (tmp_path / "straight" / "checkpoints" / "best-epoch000-step4.ckpt").exists()
    )


def test_images_added_before_a_resume_are_said_with_both_counts(tmp_path, data, caplog):
    run = tmp_path / "run"
    interrupted_run(data, run)
    for i in range(12, 16):
        shutil.copy(data / "train" / "class0" / "0.jpg", data / "train" / "class0" / f"{i}.jpg")
    with caplog.at_level("WARNING", logger="vit"):
        main(base(data, run, "--ckpt_path", "last"))
    assert "the training set had 48 images when the checkpoint was saved and has 52 now" in caplog.text


@pytest.mark.slow
def test_a_one_process_run_resumed_on_two_ddp_ranks_goes_on_after_the_images_seen(tmp_path, data):
    """1 process, batch 12, stopped after the first batch of epoch 1 (12 of its 48 images seen);
    resumed on 2 gloo ranks of batch 3 (6 images a step), per-sample loading: the epoch's other
    36 images take 6 steps (counted in batches, the old position skipped only 6 images: 7 steps),
    and the peak learning rate follows the global batch (4e-3 x 6 / 128)."""
    from tests.test_fault_tolerance import _free_port, run_script

    run, per_sample = tmp_path / "run", ["--data.pipeline", "per_sample"]
    with pytest.raises(SystemExit):
        main(base(data, run, *per_sample, *signal_at(5, "SIGTERM")))
    ddp = ["--trainer.accelerator", "cpu", "--trainer.strategy", "ddp", "--trainer.devices", "2"]
    resumed = run_script(
        base(data, run, *per_sample, *ddp, "--data.batch_size", "3", "--ckpt_path", "last"),
        env={"MASTER_PORT": str(_free_port())}, timeout=180,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 5 + 6
    assert "the epoch goes on after the 12 images already seen (0 of them again)" in resumed.stderr
    assert "resuming with peak lr 0.0001875 instead of the checkpoint's 0.000375" in resumed.stderr
