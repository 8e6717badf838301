"""A task's and a datamodule's options come in groups (optimizer, schedule, finetune, distillation,
speed; augment, mixup): each group is one dataclass with its defaults and checks, the config nests
it, and checkpoints saved while the options were flat still load, resume and evaluate."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT
from tests.test_fault_tolerance import QUIET
from vit.cli import TrainCLI, main
from vit.data import Augment, DigitsDataModule, Mixup
from vit.language_model import LanguageModel
from vit.lit import Distillation, FineTune, ImageClassifier, Speed
from vit.training import Optimizer, Schedule

# The hyperparameters of a checkpoint saved by `scripts/train.py fit --config configs/default.yaml`
# before the options were grouped, as torch.load read them back from its last.ckpt.
FLAT_HPARAMS = {
    "_class_path": "vit.lit.ImageClassifier", "model_name": "vit_nano_patch4_16", "model_kwargs": None,
    "num_classes": 10, "img_size": 16, "optimizer": "adamw", "lr": 0.002, "lr_base_batch_size": None,
    "weight_decay": 0.05, "betas": [0.9, 0.999], "momentum": 0.9, "warmup_epochs": 3.0, "warmup_steps": None,
    "warmup_fraction": None, "min_lr": 1e-05, "label_smoothing": 0.1, "tta_flip": False, "ema_decay": None,
    "compile": False, "channels_last": False, "grad_checkpointing": False, "init_from": None, "layer_decay": None,
    "head_lr": None, "freeze_backbone": False, "freeze_blocks": 0, "aux_loss_weight": 0.01, "teacher": None,
    "teacher_model": None, "distillation": "hard", "distillation_alpha": 0.5, "distillation_tau": 1.0,
    "patch_drop_schedule": None, "whiten_patch_embed": False,
    "_instantiator": "lightning.pytorch.cli.instantiate_module",
}  # fmt: skip


def default_run(run: Path, *overrides: str, command: str = "fit") -> list[str]:
    """configs/default.yaml (the digits), 2 steps an epoch, no logger."""
    limits = ["--trainer.limit_train_batches", "2", "--trainer.max_epochs", "1"] if command == "fit" else []
    return [
        command, "--config", str(ROOT / "configs/default.yaml"), "--trainer.default_root_dir", str(run), *QUIET,
        "--trainer.logger", "false", "--trainer.limit_val_batches", "2", *limits, *overrides,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def flat_checkpoint(tmp_path_factory) -> Path:
    """A checkpoint of configs/default.yaml whose hyperparameters are the flat ones older versions
    saved (weights and everything else as saved today, which the grouping did not change)."""
    run = tmp_path_factory.mktemp("flat")
    main(default_run(run))
    checkpoint = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    checkpoint["hyper_parameters"] = dict(FLAT_HPARAMS)
    path = run / "flat.ckpt"
    torch.save(checkpoint, path)
    return path


def test_the_config_nests_each_group_and_the_hyperparameters_hold_them_as_plain_dicts(tmp_path):
    cli = main(default_run(tmp_path))
    module = cli.model
    assert module.optimizer == Optimizer(lr=2e-3)  # configs/default.yaml's lr; the rest Optimizer's defaults
    assert module.schedule == Schedule(warmup_epochs=3, min_lr=1e-5)
    assert (module.finetune, module.distillation, module.speed) == (FineTune(), None, Speed())
    saved = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)["hyper_parameters"]
    assert saved["optimizer"] == {
        "name": "adamw", "lr": 2e-3, "lr_base_batch_size": None, "weight_decay": 0.05, "betas": [0.9, 0.999],
        "momentum": 0.9,
    }  # fmt: skip
    assert saved["schedule"]["warmup_epochs"] == 3 and saved["distillation"] is None


def test_a_group_given_as_a_dict_changes_only_the_fields_it_names():
    model = LanguageModel(optimizer={"lr": 3e-3}, schedule={"decay_steps": 50})
    assert model.optimizer == Optimizer(lr=3e-3, weight_decay=0.1, betas=(0.9, 0.99))  # LanguageModel's defaults
    assert model.schedule == Schedule(warmup_steps=100, min_lr=1e-4, decay_steps=50)
    assert model.hparams.optimizer["weight_decay"] == 0.1
    image = ImageClassifier(num_classes=10, optimizer=Optimizer(name="sgd", lr=0.1), speed={"channels_last": True})
    assert image.optimizer.name == "sgd" and image.optimizer.weight_decay == 0.05 and image.speed.channels_last


def test_each_group_checks_its_own_values():
    with pytest.raises(ValueError, match=r"^model\.optimizer\.name: got 'adam', expected adamw, sgd or muon$"):
        Optimizer(name="adam")
    with pytest.raises(ValueError, match=r"^model\.distillation\.kind: got 'warm', expected hard or soft$"):
        Distillation("teacher.ckpt", kind="warm")
    with pytest.raises(ValueError, match="Schedule has no option warmup; its options: decay, decay_steps, min_lr, w"):
        ImageClassifier(num_classes=10, schedule={"warmup": 3})


def test_flat_hyperparameters_move_into_their_groups():
    upgraded = ImageClassifier.upgrade_hparams(FLAT_HPARAMS)
    assert upgraded["optimizer"] == {
        "name": "adamw", "lr": 0.002, "lr_base_batch_size": None, "weight_decay": 0.05, "betas": [0.9, 0.999],
        "momentum": 0.9,
    }  # fmt: skip
    assert upgraded["schedule"] == {"warmup_epochs": 3.0, "warmup_steps": None, "warmup_fraction": None, "min_lr": 1e-5}
    assert upgraded["speed"] == {"compile": False, "channels_last": False, "grad_checkpointing": False}
    assert upgraded["distillation"] is None  # trained without a teacher
    assert "lr" not in upgraded and upgraded["label_smoothing"] == 0.1
    assert ImageClassifier.upgrade_hparams(upgraded) == upgraded  # today's form is left as it is
    with_teacher = ImageClassifier.upgrade_hparams({**FLAT_HPARAMS, "teacher": "t.ckpt", "distillation": "soft"})
    assert with_teacher["distillation"] == {
        "teacher": "t.ckpt", "teacher_model": None, "kind": "soft", "alpha": 0.5, "tau": 1.0,
    }  # fmt: skip
    text = LanguageModel.upgrade_hparams({"lr": 2e-3, "lr_decay_steps": 4050, "warmup_steps": 100})
    assert text == {"optimizer": {"lr": 2e-3}, "schedule": {"decay_steps": 4050, "warmup_steps": 100}}


def test_a_checkpoint_with_flat_options_loads_in_python_with_its_weights_and_recipe(flat_checkpoint):
    module = ImageClassifier.load_from_checkpoint(flat_checkpoint)
    assert module.optimizer == Optimizer(lr=0.002) and module.schedule == Schedule(warmup_epochs=3, min_lr=1e-5)
    assert module.hparams.label_smoothing == 0.1 and module.distillation is None
    saved = torch.load(flat_checkpoint, weights_only=True)["state_dict"]
    assert all(torch.equal(value, saved[name]) for name, value in module.state_dict().items())


def test_a_checkpoint_with_flat_options_validates_and_resumes_from_the_command_line(flat_checkpoint, tmp_path, capsys):
    today = flat_checkpoint.parent / "checkpoints" / "last.ckpt"
    scores = [
        main(default_run(tmp_path / "eval", "--ckpt_path", str(path), command="validate")).trainer.callback_metrics
        for path in (flat_checkpoint, today)
    ]
    assert float(scores[0]["val/acc1"]) == float(scores[1]["val/acc1"])
    resumed = main(default_run(tmp_path / "resumed", "--ckpt_path", str(flat_checkpoint), "--trainer.max_epochs", "2",
                               "--model.optimizer.lr", "1e-3"))  # fmt: skip
    assert resumed.trainer.global_step == 4 and resumed.model.optimizer.lr == 1e-3
    assert resumed.model.schedule == Schedule(warmup_epochs=3, min_lr=1e-5)  # the checkpoint's recipe
    with pytest.raises(SystemExit) as refused:
        main(default_run(tmp_path / "refused", "--ckpt_path", str(flat_checkpoint), "--model.optimizer.name", "sgd"))
    assert refused.value.code == 1
    assert "model.optimizer.name is 'sgd' here but 'adamw' in the checkpoint" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("option", "message"),
    [
        (["--model.lr", "0.1"], "--model.lr is now --model.optimizer.lr (the options of vit.lit.ImageClassifier are"),
        (["--model.teacher", "t.ckpt"], "--model.teacher is now --model.distillation.teacher"),
        (["--model.optimizer", "sgd"], "--model.optimizer is now --model.optimizer.name"),
        (["--data.cutmix_alpha", "1"], "--data.cutmix_alpha is now --data.mixup.cutmix_alpha (the options of "
                                       "vit.data.DigitsDataModule are grouped)"),
        (["--model.speed", "1"], "--model.speed is a group of options: set one as --model.speed.NAME VALUE"),
        (["--model.optimizer.lrr", "0.1"], "--model.optimizer.lrr is not an option of vit.lit.ImageClassifier; "
                                           "did you mean --model.optimizer.lr?"),
    ],
)  # fmt: skip
def test_an_option_from_before_the_groups_names_its_new_place(tmp_path, capsys, option, message):
    with pytest.raises(SystemExit) as exit_info:
        main(default_run(tmp_path, *option))
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(f"error: {message}")


def test_null_given_to_a_groups_field_on_the_command_line_is_none_and_keeps_the_other_fields(tmp_path):
    """jsonargparse alone reads it as the text "None" (refused by a float field, kept by a str one)."""
    args = ["--config", str(ROOT / "configs/finetune/tiny_to_cifar10_cpu.yaml"), "--data", "vit.data.DigitsDataModule",
            "--data.img_size", "16", "--trainer.default_root_dir", str(tmp_path)]  # fmt: skip
    cli = TrainCLI(args=[*args, "--model.finetune.init_from", "null", "--model.finetune.layer_decay=null"], run=False)
    assert cli.model.finetune == FineTune()
    cli = TrainCLI(args=[*args, "--model.finetune.init_from", "None"], run=False)
    assert cli.model.finetune == FineTune(layer_decay=0.75)  # the config's, kept


def test_recorded_study_options_are_reported_under_todays_names():
    from benchmarks.budget import _current_names

    recorded = ["--model.optimizer", "muon", "--model.lr", "4e-3", "--model.optimizer", "{lr: 1e-3}"]
    recorded += ["--data.crop", "rrc", "--data.mixup", "{prob: 0.5}"]
    recorded += ["--data.in_memory", "true", "--data.train_sizes", "[[0, 16], [0.5, 32]]"]
    recorded += ["--data.device_decode", "false"]
    assert _current_names(recorded) == [
        "--model.optimizer.name", "muon", "--model.optimizer.lr", "4e-3", "--model.optimizer", "{lr: 1e-3}",
        "--data.augment.crop", "rrc", "--data.mixup", "{prob: 0.5}",
        "--data.pipeline", "memory", "--data.memory.train_sizes", "[[0, 16], [0.5, 32]]",
        "--data.pipeline", "per_sample",
    ]  # fmt: skip


def test_a_datamodules_groups_keep_its_own_defaults_for_the_fields_not_named(tmp_path):
    digits = DigitsDataModule(augment={"randaugment_ops": 2}, mixup={"cutmix_alpha": 1.0})
    assert digits.augment == Augment(crop="pad_crop", crop_padding=2, hflip=False, randaugment_ops=2)
    assert digits.mixup == Mixup(cutmix_alpha=1.0)
    cli = TrainCLI(args=default_run(tmp_path, "--data.augment.randaugment_ops", "2")[1:], run=False)
    assert cli.datamodule.augment == digits.augment  # the command line names one field; the rest are the digits'
    with pytest.raises(ValueError, match=r"data\.augment\.crop: got .center., expected one of rrc"):
        DigitsDataModule(augment={"crop": "center"})
