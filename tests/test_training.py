"""Training: the CLI and its configs, the recipe, checkpoints, exact resume, and a NaN loss."""

from __future__ import annotations

import itertools
import logging
import math
import re
import signal
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml
from lightning.pytorch.callbacks import Callback

from tests.conftest import ROOT, quiet_trainer, shared_path, write_image, write_image_folder
from tests.faults import InterruptAt
from vit.checkpoint import load_model, read_lightning_checkpoint
from vit.cli import main
from vit.data import DigitsDataModule
from vit.data.transforms import IMAGENET_MEAN, IMAGENET_STD
from vit.fault_tolerance import NonFiniteLossError
from vit.lit import ImageClassifier
from vit.schedule import warmup_decay_steps
from vit.training import param_groups

CONFIGS = sorted([*(ROOT / "configs").glob("*.yaml"), *(ROOT / "configs/finetune").glob("*.yaml")])
QUIET = ["--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]


def fit(config: str, root: Path, *overrides: str):
    """Run `scripts/train.py fit` in-process and return the LightningCLI."""
    args = ["fit", "--config", str(ROOT / config), "--trainer.default_root_dir", str(root), *QUIET, *overrides]
    return main(args)


def documented_configs(config: Path) -> list[Path]:
    """The configs to run `config` with: the `fit --config A --config B` line of its header comment
    where it has one (a config laid over another names both), else itself alone."""
    usage = re.search(r"train\.py fit((?: --config \S+)+)", config.read_text())
    return [ROOT / p for p in usage[1].split()[1::2]] if usage else [config]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_every_config_parses_and_prints_its_resolved_form(config, capsys):
    configs = documented_configs(config)
    assert configs[-1] == config, f"{config}'s header runs {configs}, not itself last"
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", *(a for c in configs for a in ("--config", str(c))), "--print_config"])
    assert exit_info.value.code in (0, None)
    printed = capsys.readouterr().out
    assert "model:" in printed and "class_path: vit.lit.ImageClassifier" in printed and "checkpoint:" in printed


def test_command_line_overrides_config_values(capsys):
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(ROOT / "configs/default.yaml"), "--model.optimizer.lr", "3e-4",
              "--trainer.max_epochs", "5", "--print_config"])  # fmt: skip
    printed = capsys.readouterr().out
    assert "lr: 0.0003" in printed and "max_epochs: 5" in printed


@pytest.mark.parametrize(
    ("typo", "message"),
    [
        (["--model.lrr", "1e-3"], "--model.lrr is not an option of vit.lit.ImageClassifier; did you mean "
                                  "--model.optimizer.lr?"),
        (["--data.batchsize", "8"], "--data.batchsize is not an option of vit.data.DigitsDataModule; did you mean "
                                    "--data.batch_size?"),
        (["--trainer.max_epoch", "1"], "unknown option --trainer.max_epoch; did you mean --trainer.max_epochs?"),
    ],
)  # fmt: skip
def test_a_mistyped_option_is_one_line_with_the_closest_real_one(typo, message, capsys):
    """Not a 65-line usage dump, and no prefix taken as an abbreviation (max_epoch used to run as max_epochs)."""
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(ROOT / "configs/default.yaml"), *typo, "--print_config"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"error: {message}" or err[-1].startswith(f"error: {message} (run with --help")
    assert len(err) <= 3


def test_configs_laid_over_the_vit_change_only_what_they_say(capsys):
    def resolved(*configs: str) -> dict:
        with pytest.raises(SystemExit):
            main(["fit", *(a for c in configs for a in ("--config", str(ROOT / c))), "--print_config"])
        return yaml.safe_load(capsys.readouterr().out)

    vit = resolved("configs/cifar10_vit.yaml")
    long = resolved("configs/cifar10_vit.yaml", "configs/cifar10_vit_long.yaml")
    hybrid = resolved("configs/cifar10_vit.yaml", "configs/cifar10_hybrid.yaml")
    assert hybrid["data"] == vit["data"]
    assert {k: v for k, v in long["data"]["init_args"].items() if vit["data"]["init_args"][k] != v} == {
        "mixup": {"mixup_alpha": 0.0, "cutmix_alpha": 1.0, "prob": 0.5, "switch_prob": 0.5}}  # fmt: skip
    assert long["model"] == vit["model"]  # the long runs' model is the config's (3 blocks)
    changed = {k for k, v in hybrid["model"]["init_args"].items() if vit["model"]["init_args"][k] != v}
    assert changed == {"model_kwargs", "speed", "patch_drop_schedule"}  # 2 of the ViT's blocks after a conv stem
    assert hybrid["model"]["init_args"]["speed"] == vit["model"]["init_args"]["speed"] | {"channels_last": True}
    kwargs = vit["model"]["init_args"]["model_kwargs"]
    stem = {"stem_channels": [32, 64], "stem_pool": True}
    assert hybrid["model"]["init_args"]["model_kwargs"] == kwargs | stem | {"depth": 2, "patch_drop_rate": 0.65}
    assert hybrid["model"]["init_args"]["patch_drop_schedule"] == [[0, 0.65], [0.8, 0.0]]  # then every token


def test_a_config_that_only_changes_options_run_alone_says_what_it_lays_over(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(ROOT / "configs/cifar10_vit_long.yaml"), "--print_config"])
    assert exit_info.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("error: --data.mixup.cutmix_alpha is given but no data class is: a config that only")
    assert "--config configs/cifar10_vit.yaml --config configs/cifar10_vit_long.yaml" in last


def test_a_missing_data_root_is_the_last_line_the_user_sees(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(ROOT / "configs/cifar10_vit.yaml"), "--data", "vit.data.ImageFolderDataModule",
              "--data.root", str(tmp_path / "nowhere"), "--data.val_dir", "test"])  # fmt: skip
    assert exit_info.value.code == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    root = tmp_path / "nowhere"
    assert last == f"error: image folder {root / 'train'} does not exist: expected {root}/train/<class>/<images> " \
        f"and {root}/test/<class>/<images>, or {root}/<class>/<images> (or train/ alone) with --data.val_holdout 0.1 " \
        "to hold out a stratified 10% for validation"  # fmt: skip


def _last_error_line(args: list[str], capsys, code: int) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == code
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_a_config_that_is_not_yaml_is_named_with_the_line(tmp_path, capsys):
    """jsonargparse's message named `"<unicode string>", line 3` after a 65-line dump."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  max_epochs: [1\n  foo: 2\n")
    last = _last_error_line(["fit", "--config", str(ROOT / "configs/default.yaml"), "--config", str(bad)], capsys, 2)
    assert last == (
        f"error: {bad} is not valid YAML, line 3, column 6: expected ',' or ']', but got ':' "
        "(while parsing a flow sequence at line 2)"
    )


@pytest.mark.parametrize(
    ("given", "message"),
    [
        (["--data", "vit.data.ImageFoldrDataModule"],
         "--data vit.data.ImageFoldrDataModule: there is no ImageFoldrDataModule in vit.data; did you mean "
         "vit.data.ImageFolderDataModule?"),
        (["--model", "vit.lt.ImageClassifier"], "--model vit.lt.ImageClassifier: there is no module vit.lt; did you "
                                                "mean vit.lit?"),
    ],
)  # fmt: skip
def test_a_mistyped_class_path_is_one_line_with_the_closest_real_one(given, message, capsys):
    last = _last_error_line(["fit", "--config", str(ROOT / "configs/default.yaml"), *given], capsys, 2)
    assert last == f"error: {message}"


def test_an_option_a_class_refuses_is_its_own_message_not_a_dump(tmp_path, capsys):
    """--data.img_size 96 on the in-memory CIFAR recipe: the crop the folder picks for 96 px is the
    random resized crop, which the memory pipeline cannot do; the message says so, not `crop='rrc'` in 75 lines."""
    folder = write_image_folder(tmp_path / "data", classes=2, train=2, val=1)
    args = ["fit", "--config", str(ROOT / "configs/cifar10_vit.yaml"), "--data", "vit.data.ImageFolderDataModule",
            "--data.root", str(folder), "--data.val_dir", "val", "--data.img_size", "96"]  # fmt: skip
    last = _last_error_line(args, capsys, 1)
    assert last.startswith("error: data.img_size 96 is above 64, where the image folder trains with random resized")
    assert "--data.augment.crop pad_crop" in last and "--data.pipeline per_sample" in last


def test_image_size_and_class_count_are_set_once_on_the_data_and_reach_the_model(tmp_path, capsys):
    """`--data.img_size 24` and a folder of 3 classes build the model (vit_nano_patch4_16, 16 px and
    10 classes by default) for 24 px and 3 classes; a model value that agrees is accepted, one that
    disagrees stops the run with both values."""
    for cls in ("ant", "bee", "cow"):
        for split in ("train", "val"):
            write_image(tmp_path / "data" / split / cls / "0.png", size=(30, 30), value=50 * len(cls))

    def run(name: str, *overrides: str):
        return main([
            "fit", "--model", "vit.lit.ImageClassifier", "--data", "vit.data.ImageFolderDataModule",
            "--data.root", str(tmp_path / "data"), "--data.img_size", "24", "--data.batch_size", "3",
            "--data.num_workers", "0", "--trainer.max_steps", "1", "--trainer.default_root_dir", str(tmp_path / name),
            *QUIET, *overrides,
        ])  # fmt: skip

    cli = run("once")
    model = cli.model.model
    assert cli.model.model_kwargs == {"img_size": 24, "num_classes": 3}  # what the checkpoint rebuilds it from
    assert model.pos_embed.shape[1] == 1 + (24 // 4) ** 2 and model.head.out_features == 3
    assert cli.trainer.global_step == 1

    agreeing = run("agreeing", "--model.num_classes", "3", "--model.model_kwargs", "{img_size: 24}")
    assert agreeing.model.model_kwargs == {"img_size": 24, "num_classes": 3}
    capsys.readouterr()
    for name, given, message in [
        ("more_classes", ["--model.num_classes", "5"], "model.num_classes is 5 but data.num_classes is 3"),
        ("other_size", ["--model.model_kwargs", "{img_size: 32}"],
         "model.model_kwargs.img_size is 32 but model.img_size is 24"),
    ]:  # fmt: skip
        with pytest.raises(SystemExit) as exit_info:
            run(name, *given)
        assert exit_info.value.code == 1
        assert capsys.readouterr().err.strip().splitlines()[-1].startswith(f"error: {message}")


def shape(text: str) -> list[str]:
    """Lines with their paths and numbers blanked: what `make train` prints, whatever the run."""
    return [re.sub(r"\d+", "N", re.sub(r"[^\s()]*/", "P/", line)) for line in text.strip("\n").splitlines()]


def test_default_job_learns_and_leaves_checkpoints_that_rebuild_the_model(tmp_path, capsys):
    cli = fit("configs/default.yaml", tmp_path, "--trainer.max_epochs", "6", "--model.schedule.warmup_epochs", "1")
    # it ends by printing what README's quick start shows, line for line
    readme = (ROOT / "README.md").read_text()
    shown = re.search(r"prints\s+where everything went:\n\n```\n(.*?)```", readme, re.S)[1]
    assert shape(capsys.readouterr().out.split("\nDone.\n")[-1]) == shape(shown)[1:]
    ckpt = cli.trainer.checkpoint_callback
    # 10 classes, 360 images: chance is 0.10 +- 0.016; after 6 epochs 0.28 (1 thread) and 0.32 (2) measured here
    assert float(ckpt.best_model_score) > 0.2
    assert Path(ckpt.best_model_path).is_file() and (tmp_path / "checkpoints" / "last.ckpt").is_file()
    assert list((tmp_path / "lightning_logs").glob("version_0/events.out.tfevents.*"))

    meta = read_lightning_checkpoint(ckpt.last_model_path)["vit"]
    assert meta == {  # the offline default's classes are the ten digits it draws
        "model_name": "vit_nano_patch4_16",
        "model_kwargs": {"img_size": 16, "num_classes": 10},
        "class_names": [str(digit) for digit in range(10)],
        "preprocess": {"img_size": 16, "crop_pct": 1.0, "mean": list(IMAGENET_MEAN), "std": list(IMAGENET_STD)},
    }
    model = load_model(ckpt.last_model_path)  # from the file alone
    x = torch.randn(3, 3, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(model(x), cli.model.model.eval()(x))


def test_fit_on_the_real_cifar10_image_folder(tmp_path):
    root = shared_path("data/cifar10")
    cli = fit(
        "configs/cifar10_vit.yaml", tmp_path, "--data", "vit.data.ImageFolderDataModule", "--data.root", str(root),
        "--data.val_dir", "test", "--data.batch_size", "16", "--data.num_workers", "0",
        "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "3", "--trainer.limit_val_batches", "2",
    )  # fmt: skip
    assert cli.trainer.global_step == 3 and cli.model.hparams.num_classes == 10
    assert math.isfinite(cli.trainer.callback_metrics["val/loss"])


def test_fit_on_the_real_tiny_imagenet_layout(tmp_path):
    root = shared_path("data/tiny-imagenet-200")
    cli = fit(
        "configs/tiny_imagenet_vit.yaml", tmp_path, "--data.root", str(root), "--data.batch_size", "16",
        "--data.num_workers", "0", "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "3",
        "--trainer.limit_val_batches", "2",
    )  # fmt: skip
    assert cli.trainer.global_step == 3 and cli.model.model.head.out_features == 200


def test_the_cpu_finetune_config_moves_a_tiny_imagenet_run_to_cifar10(tmp_path, caplog):
    """configs/finetune/tiny_to_cifar10_cpu.yaml: a 200-class Tiny-ImageNet run becomes a 10-class
    CIFAR-10 model at the backbone's 64 px, by config alone: same blocks, new head."""
    tiny, cifar = shared_path("data/tiny-imagenet-200"), shared_path("data/cifar10")
    # Per-sample loading: decoding both datasets into memory would take a minute.
    few = ["--data.batch_size", "16", "--data.num_workers", "0", "--trainer.max_epochs", "1", "--data.pipeline",
           "per_sample", "--trainer.limit_train_batches", "2", "--trainer.limit_val_batches", "1"]  # fmt: skip
    pretrained = fit("configs/tiny_imagenet_vit.yaml", tmp_path / "pre", "--data.root", str(tiny), *few)
    source = pretrained.trainer.checkpoint_callback.last_model_path
    with caplog.at_level(logging.INFO, logger="vit"):
        cli = fit(
            "configs/finetune/tiny_to_cifar10_cpu.yaml", tmp_path / "ft", "--model.finetune.init_from", source,
            "--data.root", str(cifar), *few[:8], "--trainer.limit_train_batches", "0",
            "--trainer.limit_val_batches", "1",
        )  # fmt: skip
    assert "reinitialised head.weight" in caplog.text
    model, theirs = cli.model.model, pretrained.model.model.state_dict()
    assert cli.datamodule.img_size == 64 and model.pos_embed.shape == (1, 64, 192)  # the 8x8 grid it learned on
    assert model.head.weight.shape == (10, 192) and pretrained.model.model.head.weight.shape == (200, 192)
    assert torch.equal(model.state_dict()["blocks.5.mlp.fc2.weight"], theirs["blocks.5.mlp.fc2.weight"])  # no step


def test_resnet_baseline_trains_through_the_same_pipeline(tmp_path):
    for split, n in (("train", 8), ("val", 4)):
        for cls in ("cat", "dog", "frog"):
            for i in range(n):
                write_image(tmp_path / "data" / split / cls / f"{i}.png", size=(32, 32), value=40 * len(cls) + i)
    cli = fit(
        "configs/cifar10_resnet.yaml", tmp_path / "run", "--data", "vit.data.ImageFolderDataModule",
        "--data.root", str(tmp_path / "data"), "--data.batch_size", "8", "--data.num_workers", "0",
        "--trainer.max_epochs", "2",
    )  # fmt: skip
    assert cli.trainer.global_step == 6 and cli.model.model.linear.out_features == 3


def test_warmup_then_cosine_schedule():
    lrs = [warmup_decay_steps(s, warmup_steps=4, total_steps=14, min_ratio=0.1) for s in range(15)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]
    assert lrs[4] == 1.0 and lrs[9] == pytest.approx(0.55) and lrs[14] == pytest.approx(0.1)
    assert all(a >= b for a, b in itertools.pairwise(lrs[3:]))


def test_warmup_then_linear_schedule_falls_by_equal_steps_to_min_lr():
    lrs = [warmup_decay_steps(s, 4, 14, 0.1, decay="linear") for s in range(15)]
    assert lrs[:5] == [0.25, 0.5, 0.75, 1.0, 1.0]
    assert lrs[6] == pytest.approx(0.82) and lrs[14] == pytest.approx(0.1)  # cosine: 0.914 at step 6
    assert [a - b for a, b in itertools.pairwise(lrs[4:])] == pytest.approx([0.09] * 10)


def test_no_weight_decay_on_norms_biases_pos_embed_and_cls_token():
    module = ImageClassifier("vit_nano_patch4_16", num_classes=3)
    decay, no_decay = sorted(param_groups(module.model, 0.05, lr=1e-3), key=lambda g: -g["weight_decay"])
    names = {id(p): n for n, p in module.model.named_parameters()}
    no_decay_names = {names[id(p)] for p in no_decay["params"]}
    assert {"pos_embed", "cls_token", "blocks.0.norm1.weight", "blocks.0.attn.qkv.bias", "norm.bias"} <= no_decay_names
    assert {names[id(p)] for p in decay["params"]} >= {"blocks.0.attn.qkv.weight", "patch_embed.proj.weight"}
    assert not {names[id(p)] for p in decay["params"]} & no_decay_names and no_decay["weight_decay"] == 0.0


@pytest.mark.parametrize("decay", ["cosine", "linear"])
def test_lr_is_scaled_by_the_global_batch_and_follows_the_schedule(tmp_path, decay):
    seen = []

    class RecordLR(Callback):
        def on_train_batch_start(self, trainer, *args):
            seen.append(trainer.optimizers[0].param_groups[0]["lr"])

    module = ImageClassifier(
        "vit_nano_patch4_16",
        optimizer={"lr": 1e-3, "lr_base_batch_size": 32},
        schedule={"warmup_epochs": 1, "min_lr": 0.0, "decay": decay},
    )
    data = DigitsDataModule(batch_size=64, num_workers=0)
    trainer = quiet_trainer(tmp_path, max_epochs=2, callbacks=[RecordLR()])
    trainer.fit(module, data)
    steps = trainer.global_step  # 22 per epoch
    peak = 1e-3 * 64 / 32
    expected = [peak * warmup_decay_steps(s, steps // 2, steps, 0.0, decay) for s in range(steps)]
    torch.testing.assert_close(torch.tensor(seen), torch.tensor(expected), rtol=1e-6, atol=1e-12)


def test_ema_follows_the_weights_at_the_configured_rate(tmp_path):
    weights = []

    class Record(Callback):
        def on_train_batch_end(self, trainer, module, *args):
            weights.append({k: v.clone() for k, v in module.model.state_dict().items()})

    for decay in (0.0, 0.5):
        weights.clear()
        module = ImageClassifier("vit_nano_patch4_16", num_classes=10, ema_decay=decay)
        data = DigitsDataModule(batch_size=32, num_workers=0)
        quiet_trainer(tmp_path / str(decay), max_steps=3, callbacks=[Record()]).fit(module, data)
        # the first update copies the weights; each later one keeps `decay` of the average
        expected = weights[0]
        for w in weights[1:]:
            expected = {k: decay * expected[k] + (1 - decay) * w[k] for k in w}
        for name, value in module.ema.module.state_dict().items():
            torch.testing.assert_close(value, expected[name], rtol=1e-5, atol=1e-6, msg=name)
        assert not torch.equal(module.ema.module.head.weight, weights[0]["head.weight"])


def test_ema_averages_as_torchs_ema_does_without_reading_its_count_back_each_update():
    """vit.lit.EMA against AveragedModel with torch's EMA function, on a model with float weights
    and an integer buffer (BatchNorm's count): equal after every update, and after a load_state_dict
    part-way. Its count is read from the device once: moved to the meta device (no values to
    read), the next update still runs."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    from vit.lit import EMA

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4))
    ours, torchs = EMA(model, 0.9), AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True)
    for step in range(4):
        model(torch.randn(2, 3, 5, 5))  # BatchNorm's running statistics and count move
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        if step == 2:
            ours.load_state_dict(torchs.state_dict())
        ours.update_parameters(model)
        torchs.update_parameters(model)
        for (name, a), b in zip(ours.state_dict().items(), torchs.state_dict().values(), strict=True):
            assert torch.equal(a, b), (step, name)
    ours.to("meta").update_parameters(model.to("meta"))
    with pytest.raises(RuntimeError, match="cannot be called on meta tensors"):  # AveragedModel reads its count
        torchs.to("meta").update_parameters(model)


def test_mixup_applies_to_training_batches_only(tmp_path):
    targets = {}

    class Spy(Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            targets["train"] = batch[1]

        def on_validation_batch_start(self, trainer, module, batch, batch_idx, dataloader_idx=0):
            targets["val"] = batch[1]

    data = DigitsDataModule(batch_size=32, num_workers=0, mixup={"mixup_alpha": 0.8, "cutmix_alpha": 1.0})
    trainer = quiet_trainer(tmp_path, max_epochs=1, limit_train_batches=2, limit_val_batches=1, callbacks=[Spy()])
    trainer.fit(ImageClassifier(num_classes=10), data)
    assert targets["train"].shape == (32, 10) and targets["train"].dtype == torch.float32
    torch.testing.assert_close(targets["train"].sum(1), torch.ones(32))
    assert targets["val"].ndim == 1 and targets["val"].dtype == torch.int64


def _recipe() -> tuple[ImageClassifier, DigitsDataModule]:
    """Every source of randomness on: dropout, drop-path, augmentation, Mixup/CutMix."""
    module = ImageClassifier(
        "vit_nano_patch4_16", {"drop_path_rate": 0.2, "proj_drop_rate": 0.1}, num_classes=10, label_smoothing=0.1,
        optimizer={"lr": 2e-3}, schedule={"warmup_epochs": 0.5},
    )  # fmt: skip
    data = DigitsDataModule(
        batch_size=64, num_workers=0, augment={"randaugment_ops": 1}, mixup={"mixup_alpha": 0.8, "cutmix_alpha": 1.0}
    )
    return module, data


@pytest.mark.parametrize("interrupt_at", [13, 22], ids=["mid-epoch", "epoch-end"])
def test_resume_after_interruption_matches_an_uninterrupted_run(tmp_path, interrupt_at):
    L.seed_everything(7)
    module, data = _recipe()
    quiet_trainer(tmp_path / "straight", max_steps=30).fit(module, data)
    expected = module

    L.seed_everything(7)
    module, data = _recipe()
    previous_handler = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(SystemExit):
            quiet_trainer(tmp_path / "run", max_steps=30, callbacks=[InterruptAt(interrupt_at)]).fit(module, data)
    finally:
        signal.signal(signal.SIGINT, previous_handler)
    interrupted = tmp_path / "run" / "checkpoints" / "last-interrupted.ckpt"
    assert torch.load(interrupted, weights_only=True)["global_step"] == interrupt_at

    L.seed_everything(123)  # a new process would not share the first one's RNG state
    module, data = _recipe()
    trainer = quiet_trainer(tmp_path / "run", max_steps=30)
    trainer.fit(module, data, ckpt_path="last")  # picks last-interrupted.ckpt, the newest
    assert not interrupted.exists()  # superseded by the completed run's last.ckpt

    assert trainer.global_step == 30
    for name, value in expected.model.state_dict().items():
        torch.testing.assert_close(module.model.state_dict()[name], value, rtol=1e-5, atol=1e-6, msg=name)
    opt_expected = expected.trainer.optimizers[0].state_dict()["state"]
    opt_resumed = trainer.optimizers[0].state_dict()["state"]
    assert opt_resumed.keys() == opt_expected.keys()
    for key in opt_expected:
        for field in ("step", "exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(opt_resumed[key][field], opt_expected[key][field], rtol=1e-5, atol=1e-7)


def test_nan_loss_stops_with_a_clear_error_and_keeps_the_last_good_checkpoint(tmp_path):
    class PoisonWeights(Callback):
        def on_train_batch_end(self, trainer, module, *args):
            if trainer.global_step == 25:  # after the epoch-end checkpoint at step 22
                with torch.no_grad():
                    module.model.head.weight.fill_(float("nan"))

    module = ImageClassifier("vit_nano_patch4_16", num_classes=10)
    trainer = quiet_trainer(tmp_path, max_epochs=3, callbacks=[PoisonWeights()])
    message = r"training loss is nan at step 25 .*last good checkpoint is .*last\.ckpt"
    with pytest.raises(NonFiniteLossError, match=message):
        trainer.fit(module, DigitsDataModule(batch_size=64, num_workers=0))
    checkpoint = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)
    assert checkpoint["global_step"] == 22
    assert all(torch.isfinite(v).all() for v in checkpoint["state_dict"].values() if v.is_floating_point())
    assert not (tmp_path / "checkpoints" / "last-interrupted.ckpt").exists()


def test_the_nan_guard_reads_each_loss_once_its_backward_is_queued_not_before(tmp_path, monkeypatch):
    """Reading a device value makes the host wait for it; the guard reads each micro-batch's
    finiteness only after the backward passes of its optimizer step are queued (and before the
    step), so on a GPU the backward runs while the host waits for the forward passes' results."""
    from vit.fault_tolerance import HostCopy

    order: list[str] = []
    get = HostCopy.get
    monkeypatch.setattr(HostCopy, "get", lambda self: order.append("read") or get(self))

    class Order(Callback):
        def on_after_backward(self, *args):
            order.append("backward")

        def on_before_optimizer_step(self, *args):  # callbacks' hooks run before the module's
            order.append("step")

    module = ImageClassifier("vit_nano_patch4_16", num_classes=10)
    trainer = quiet_trainer(tmp_path, max_steps=3, accumulate_grad_batches=2, callbacks=[Order()])
    trainer.fit(module, DigitsDataModule(batch_size=16, num_workers=0))
    assert order == ["backward", "backward", "step", "read", "read"] * 3


def test_the_progress_bar_reads_the_logged_loss_back_only_when_the_loggers_do(tmp_path, monkeypatch):
    """Showing the loss reads it back from the device (the host waits for the step); Lightning's
    default bar does so after every step. A run's bar refreshes every log_every_n_steps (10 in
    default.yaml; 22 steps an epoch) and at epoch and run ends; a bar the config names is kept."""
    from lightning.pytorch.callbacks import TQDMProgressBar

    reads: list[int] = []
    get_metrics = TQDMProgressBar.get_metrics
    monkeypatch.setattr(
        TQDMProgressBar,
        "get_metrics",
        lambda bar, trainer, module: reads.append(trainer.global_step) or get_metrics(bar, trainer, module),
    )
    on = ["--trainer.enable_progress_bar", "true", "--trainer.max_steps", "25", "--trainer.num_sanity_val_steps", "0"]
    cli = fit("configs/default.yaml", tmp_path, *on)
    assert set(reads) == {10, 20, 22, 25}
    assert cli.trainer.progress_bar_callback.train_progress_bar.n == 3  # the batches of epoch 2 trained, not 0
    configured = ["--trainer.callbacks+=TQDMProgressBar", "--trainer.callbacks.refresh_rate", "3",
                  "--trainer.max_steps", "1"]  # fmt: skip
    cli = fit("configs/default.yaml", tmp_path / "configured", *on, *configured)
    assert cli.trainer.progress_bar_callback.refresh_rate == 3


def test_fresh_run_moves_an_earlier_runs_checkpoints_aside(tmp_path):
    fit("configs/default.yaml", tmp_path, "--trainer.max_epochs", "1")
    first_last = (tmp_path / "checkpoints" / "last.ckpt").read_bytes()
    fit("configs/default.yaml", tmp_path, "--trainer.max_epochs", "1")
    archived = list((tmp_path / "checkpoints" / "earlier").glob("*/last.ckpt"))
    assert len(archived) == 1 and archived[0].read_bytes() == first_last
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("*.ckpt"))[-1] == "last.ckpt"


def test_accuracy_is_over_samples_not_a_mean_over_classes():
    from vit.lit import accuracy

    metric = accuracy(3, top_k=1)
    logits = torch.eye(3)[[0, 0, 0, 0, 1]]  # predicts class 0 four times, class 1 once
    metric.update(logits, torch.tensor([0, 0, 0, 0, 2]))
    assert metric.compute().item() == pytest.approx(0.8)  # 4 of 5; the per-class mean would be 0.33


def test_throughput_counts_the_training_images_over_the_training_time_alone(tmp_path):
    """Validation made slow on purpose (0.3 s a batch, 2 batches an epoch, 2 epochs: 1.2 s asleep):
    the run's img/s counts the 2 x 3 batches of 64 training images over a time that leaves the
    sleeping out, and each epoch logs its own rate."""
    import time

    from vit.training import Throughput

    class SlowValidation(Callback):
        def on_validation_batch_end(self, *args, **kwargs) -> None:
            time.sleep(0.3)

    throughput = Throughput()
    trainer = quiet_trainer(tmp_path, max_epochs=2, limit_train_batches=3, limit_val_batches=2,
                            num_sanity_val_steps=0, callbacks=[throughput, SlowValidation()])  # fmt: skip
    start = time.perf_counter()
    trainer.fit(ImageClassifier("vit_nano_patch4_16", num_classes=10), DigitsDataModule(batch_size=64, num_workers=0))
    wall = time.perf_counter() - start
    assert throughput.images == 2 * 3 * 64
    assert 0 < throughput.seconds < wall - 1.2
    assert throughput.images_per_second == pytest.approx(throughput.images / throughput.seconds)
    assert float(trainer.callback_metrics["train/img_per_s"]) > throughput.images / (wall - 1.2)


@pytest.mark.parametrize(("given", "every"), [("null", 1), ("4", 4)])
def test_a_short_run_draws_its_loss_curve_unless_the_cadence_is_given(tmp_path, given, every):
    """20 steps: Lightning's default (every 50) would log no training loss at all; without a given
    log_every_n_steps a run logs about 50 points of it, here every step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cli = fit("configs/default.yaml", tmp_path, "--trainer.max_steps", "20", "--trainer.limit_val_batches", "1",
              "--trainer.log_every_n_steps", given)  # fmt: skip
    assert cli.trainer.log_every_n_steps == every
    events = EventAccumulator(str(Path(cli.trainer.logger.log_dir))).Reload()
    steps = [e.step for e in events.Scalars("train/loss")]
    assert steps == list(range(every - 1, 20, every))
