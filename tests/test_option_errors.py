"""An option set to a value it does not take is one line, `error: --data.X: got V, expected ...`
(or `--model.X`), exit 2 (as the CLI's other option errors), before any training: not a traceback
from deep inside the run, another library's text, a value trained with silently, or a "Done."."""

from __future__ import annotations

import math
import re

import pytest

import vit
from vit.cli import main
from vit.data import ImageFolderDataModule
from vit.options import OptionError

CASES = [
    ("num_workers", "-1", "a whole number of at least 0"),
    ("batch_size", "0", "a whole number of at least 1"),
    ("img_size", "0", "a whole number of at least 1"),
    ("val_holdout", "-5", "0 \\(none\\), a fraction below 1, or a whole number of training images"),
    ("val_holdout", "1.5", "0 \\(none\\), a fraction below 1, or a whole number of training images"),
    ("val_holdout", "5000", "holds out 1 to 1427 of them .* this holds out 5000"),  # 1,437 digits to train on
    ("eval_crop_pct", "0", "the share of the resized image kept, in \\(0, 1\\]"),
    ("eval_crop_pct", "1.5", "the share of the resized image kept, in \\(0, 1\\]"),
    ("device.prefetch", "-1", "a whole number of at least 0"),
    ("device.worker_decode", "2", "a share of the JPEGs decoded on the device, from 0 to 1"),
    ("pipeline", "in_memory", "per_sample \\(each image in a loader worker\\), memory .* or device"),
    ("std", "[0.2, 0, 0.2]", "3 numbers, one a channel, each above 0"),
    ("memory.train_sizes", "[[0.5, 0]]", "\\[\\[progress from 0 to 1, size in pixels\\], ...\\]"),
    ("memory.cache_dir", "cache", "null unless --data.pipeline memory \\(an option of the memory pipeline; --"),
    ("augment.crop_scale", "[1.0, 0.08]", "\\[low, high\\] area fractions with 0 < low <= high <= 1"),
    ("augment.randaugment_ops", "14", "at most the 13 ops there are"),
    ("augment.randaugment_magnitude", "11", "a strength from 0 to 10"),
    ("augment.cutout", "-2", "a whole number of at least 0"),
    ("mixup.prob", "2", "a probability from 0 to 1"),
    ("mixup.cutmix_alpha", "-1", "a Beta parameter of at least 0"),
    ("naflex.max_patches", "0", "a whole number of at least 1"),
    ("val_fraction", "1", "the share of the digits held out, in \\(0, 1\\)"),
    ("batch_size", "abc", "a whole number$"),  # the wrong type: jsonargparse's, in one line
    ("augment.hflip", "maybe", "true or false"),
    ("augment.crop_padding", "1000", "at most half the image side \\(8 of 16 px"),  # digits: pad_crop at 16 px
    ("augment.cutout", "17", "at most the image side \\(16 px"),
    ("img_size", "18", "a multiple of the patch size 4 \\(16 or 20\\)"),  # a pixel the patchify conv drops
    ("data_process", "sometimes", "true or false, or null"),
    ("naflex", "16", "its options one by one \\(--data.naflex.NAME VALUE\\), or null"),
    ("naflex.max_patches", "2.5", "a whole number$"),
]

# Each option of the model's groups and recipe, and the model's own arguments (model_kwargs).
MODEL_CASES = [
    ("optimizer.lr", "-1", "a learning rate above 0"),
    ("optimizer.lr_base_batch_size", "0", "a whole number of at least 1"),
    ("optimizer.weight_decay", "-1", "a decay of at least 0"),
    ("optimizer.betas", "[2, 0.9]", "\\[beta1, beta2\\], each in \\[0, 1\\)"),
    ("optimizer.momentum", "-1", "a momentum in \\[0, 1\\)"),
    ("optimizer.name", "adam", "adamw, sgd or muon"),
    ("schedule.min_lr", "-1", "the rate at the end, from 0 to the peak lr"),
    ("schedule.min_lr", "1", "at most model.optimizer.lr 0.002: the rate decays to it"),  # found as the run starts
    ("schedule.decay_steps", "-5", "a whole number of at least 1"),
    ("schedule.decay", "step", "expected cosine or linear"),
    ("schedule.warmup_fraction", "-0.1", "the share of the run spent warming up, in \\[0, 1\\)"),
    ("schedule.warmup_epochs", "-1", "epochs of warmup, at least 0"),
    ("finetune.layer_decay", "-1", "a decay in \\(0, 1\\]"),
    ("finetune.head_lr", "0", "a learning rate above 0"),
    ("finetune.freeze_blocks", "99", "at most the 4 transformer blocks of vit_nano_patch4_16"),
    ("label_smoothing", "-0.1", "a share of the target in \\[0, 1\\)"),
    ("label_smoothing", "1.5", "a share of the target in \\[0, 1\\)"),
    ("ema_decay", "1.0", "a decay in \\[0, 1\\) \\(e.g. 0.999\\), or null"),
    ("patch_drop_schedule", "[[0, 1.0]]", "rate in \\[0, 1\\)"),
    ("model_kwargs.drop_path_rate", "{drop_path_rate: 2.0}", "a rate in \\[0, 1\\)"),
    ("model_kwargs.depth", "{depth: 0}", "a whole number of at least 1 \\(transformer blocks\\)"),
    ("model_kwargs.depth", "{depth: three}", "a whole number$"),
    ("model_kwargs.num_heads", "{num_heads: 0}", "a whole number of at least 1"),
    ("model_kwargs.num_heads", "{num_heads: 3}", "a divisor of embed_dim 128"),
    ("model_kwargs", "{depth:0}", "a mapping .* \\(YAML needs a space after each colon"),
]


@pytest.mark.parametrize(("option", "value", "expected"), CASES, ids=[f"{o}={v}" for o, v, _ in CASES])
def test_a_data_option_out_of_range_is_one_line_naming_it_with_exit_2(tmp_path, capsys, option, value, expected):
    run = tmp_path / "run"
    args = ["fit", "--config", "configs/default.yaml", "--trainer.default_root_dir", str(run),
            "--trainer.max_epochs", "1", "--trainer.logger", "false", f"--data.{option}", value]  # fmt: skip
    with pytest.raises(SystemExit) as stop:
        main(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2, err  # an exception, not this error, would end the run with a traceback
    assert err[-1].startswith(f"error: --data.{option}: got ") and sum(line.startswith("error") for line in err) == 1
    assert re.search(expected, err[-1]), err[-1]
    assert not list(run.rglob("*.ckpt"))  # nothing trained, nothing saved


@pytest.mark.parametrize(
    ("option", "value", "expected"), MODEL_CASES, ids=[f"{o}={v}" for o, v, _ in MODEL_CASES]
)  # fmt: skip
def test_a_model_option_out_of_range_is_one_line_naming_it_with_exit_2(tmp_path, capsys, option, value, expected):
    run = tmp_path / "run"
    flag = "--model.model_kwargs" if option.startswith("model_kwargs") else f"--model.{option}"
    args = ["fit", "--config", "configs/default.yaml", "--trainer.default_root_dir", str(run),
            "--trainer.max_epochs", "1", "--trainer.logger", "false", flag, value]  # fmt: skip
    with pytest.raises(SystemExit) as stop:
        main(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2, err
    assert err[-1].startswith(f"error: --model.{option}: got ") and sum(line.startswith("error") for line in err) == 1
    assert re.search(expected, err[-1]), err[-1]
    assert not list(run.rglob("*.ckpt"))


def test_a_mistyped_field_of_a_group_is_named_with_its_group(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["fit", "--config", "configs/default.yaml", "--data.naflex.max_patchs", "16"])
    assert stop.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: --data.naflex.max_patchs is not an option of vit.data.DigitsDataModule; "
        "did you mean --data.naflex.max_patches?"
    )


def test_in_python_an_option_error_names_the_option_and_is_a_value_error(tmp_path):
    with pytest.raises(OptionError, match=r"^data\.eval_crop_pct: got 0\.0, expected the share") as error:
        ImageFolderDataModule(str(tmp_path / "nowhere"), eval_crop_pct=0.0)  # refused before the folder is read
    assert isinstance(error.value, ValueError) and error.value.name == "data.eval_crop_pct"


def _run(tmp_path, *options: str) -> None:
    """The default job with `options`, four steps at most."""
    main(["fit", "--config", "configs/default.yaml", "--trainer.default_root_dir", str(tmp_path / "run"),
          "--trainer.max_steps", "4", "--trainer.limit_val_batches", "1", "--trainer.logger", "false",
          "--trainer.enable_progress_bar", "false", *options])  # fmt: skip


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        (["--model.optimizer.name", "muon", "--model.finetune.freeze_blocks", "4"],
         "error: --model.optimizer.name: got 'muon', expected adamw or sgd: vit_nano_patch4_16 trains no weight "
         "matrix of transformer blocks for Muon to orthogonalise (it has none, or they are frozen)"),
        (["--data.pipeline", "memory", "--data.memory.train_sizes", "[[0, 12], [0.5, 16]]"],
         "error: --model.model_kwargs.dynamic_img_size: got False, expected true to train at [12] px "
         "(data.memory.train_sizes): the position embedding is resampled from the 16 px grid to each"),
        (["--data.pipeline", "memory", "--data.memory.train_sizes", "[[0, 14]]", "--data.augment.crop_padding", "1"],
         "error: --data.memory.train_sizes: got [14], expected sizes a multiple of the patch size 4 (12 or 16)"),
    ],
)  # fmt: skip
def test_options_that_do_not_go_together_are_refused_before_training(tmp_path, capsys, options, expected):
    with pytest.raises(SystemExit) as stop:
        _run(tmp_path, *options)
    assert stop.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == expected
    assert not list(tmp_path.rglob("*.ckpt"))


def test_a_min_lr_above_the_batch_scaled_peak_is_scaled_alike_and_said(tmp_path, caplog):
    """lr 2e-3 at batch 8 of lr_base_batch_size 256 peaks at 6.25e-5, below min_lr 1e-3: the rate
    decays from the peak to min_lr x 8/256 (3.125e-5) instead of rising to min_lr. The rates the run
    trains at are said as it starts, the parameter groups' range with layer decay."""
    said = re.escape("the peak lr 6.25e-05 (model.optimizer.lr 0.002 x global batch 8 / lr_base_batch_size 256) "
                     "is below model.schedule.min_lr 0.001: the rate decays to 3.125e-05, scaled alike")  # fmt: skip
    with pytest.warns(UserWarning, match=said):
        cli = main(["fit", "--config", "configs/default.yaml", "--trainer.default_root_dir", str(tmp_path),
                    "--trainer.max_steps", "4", "--trainer.limit_val_batches", "1", "--trainer.logger", "false",
                    "--data.batch_size", "8", "--model.optimizer.lr_base_batch_size", "256",
                    "--model.schedule.min_lr", "1e-3", "--model.schedule.warmup_epochs", "0",
                    "--model.finetune.layer_decay", "0.5"])  # fmt: skip
    rates = cli.trainer.lr_scheduler_configs[0].scheduler.get_last_lr()
    assert max(rates) == pytest.approx(3.125e-5)  # the last blocks' and the head's; earlier blocks less
    # vit_nano_patch4_16: 4 blocks, the embeddings at 0.5^5 of the peak
    assert "learning rate: peak 6.25e-05 = model.optimizer.lr 0.002 x global batch 8 / lr_base_batch_size 256; " \
           "parameter groups from 1.95e-06 to 6.25e-05; the peak decays to 3.13e-05" in caplog.messages  # fmt: skip


def test_a_decay_past_the_runs_end_is_said_with_the_rate_it_ends_at(tmp_path):
    # cosine over 8 steps, the last of 4 at step 3: 0.5 * (1 + cos(3/8 pi)) of the way from min_lr (1e-5 of 2e-3)
    end = 0.005 + 0.995 * 0.5 * (1 + math.cos(math.pi * 3 / 8))
    said = re.escape(f"model.schedule.decay_steps (8) is past the run's last step (4): the rate ends at {end:.3g} of")
    with pytest.warns(UserWarning, match=said):
        _run(tmp_path, "--model.schedule.decay_steps", "8", "--model.schedule.warmup_epochs", "0")


def test_a_models_arguments_are_checked_by_name_as_it_is_built():
    for kwargs, name, expected in [
        ({"depth": 0}, "depth", "a whole number of at least 1"),
        ({"depth": "three"}, "depth", "a whole number"),
        ({"qkv_bias": "yes"}, "qkv_bias", "true or false"),
        ({"img_size": 3}, "img_size", "a multiple of the patch size 4 \\(4\\)"),
        ({"embed_dim": 130}, "num_heads", "a divisor of embed_dim 130"),
        ({"drop_path_rate": 1.0}, "drop_path_rate", "a rate in \\[0, 1\\)"),
    ]:
        with pytest.raises(OptionError, match=f"^{name}: got .*, expected {expected}") as error:
            vit.create_model("vit_nano_patch4_16", **kwargs)
        assert error.value.name == name
    # In Python, as in timm, a side that is not whole patches is the model's to take: SigLIP so400m/14 was
    # trained at 384 px (27 patches a side, 6 px dropped); only the data's img_size is held to whole patches.
    assert vit.create_model("vit_nano_patch4_16", img_size=18).patch_embed.grid_size == (4, 4)
    assert vit.model_config("vit_so400m_patch14_siglip_384").img_size in (384, (384, 384))
