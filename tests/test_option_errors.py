"""A data option set to a value it does not take is one line, `error: --data.X: got V, expected
...`, exit 2 (as the CLI's other option errors), before any training: not a traceback from deep
inside the run, another library's text, or a value taken silently."""

from __future__ import annotations

import re

import pytest

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
    ("device_prefetch", "-1", "a whole number of at least 0"),
    ("worker_decode", "2", "a share of device_decode's JPEGs, from 0 to 1"),
    ("std", "[0.2, 0, 0.2]", "3 numbers, one a channel, each above 0"),
    ("train_sizes", "[[0.5, 0]]", "\\[\\[progress from 0 to 1, size in pixels\\], ...\\]"),
    ("augment.crop_scale", "[1.0, 0.08]", "\\[low, high\\] area fractions with 0 < low <= high <= 1"),
    ("augment.randaugment_ops", "14", "at most the 13 ops there are"),
    ("augment.randaugment_magnitude", "11", "a strength from 0 to 10"),
    ("augment.cutout", "-2", "a whole number of at least 0"),
    ("mixup.prob", "2", "a probability from 0 to 1"),
    ("mixup.cutmix_alpha", "-1", "a Beta parameter of at least 0"),
    ("naflex.max_patches", "0", "a whole number of at least 1"),
    ("val_fraction", "1", "the share of the digits held out, in \\(0, 1\\)"),
    ("batch_size", "abc", "a whole number"),  # the wrong type: jsonargparse's, in one line
    ("augment.hflip", "maybe", "true or false"),
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


def test_in_python_an_option_error_names_the_option_and_is_a_value_error(tmp_path):
    with pytest.raises(OptionError, match=r"^data\.eval_crop_pct: got 0\.0, expected the share") as error:
        ImageFolderDataModule(str(tmp_path / "nowhere"), eval_crop_pct=0.0)  # refused before the folder is read
    assert isinstance(error.value, ValueError) and error.value.name == "data.eval_crop_pct"
