"""An image folder is read as people keep it: the ImageNet layout (`train/` and `val/`), `train/`
alone, or a folder of class folders as it is (`pets/<class>/*`); without a validation split,
`val_holdout` holds out a stratified share of the training images, and a missing split says both
layouts and the option."""

from __future__ import annotations

import shutil
from collections import Counter
from pathlib import Path

import pytest

from tests.conftest import ROOT, write_image_folder
from vit.cli import main
from vit.data import ImageFolderDataModule


def _flat(root: Path) -> Path:
    """An ImageNet-layout tree's training classes moved to `root/flat/<class>/*`, nothing else."""
    write_image_folder(root / "tree", classes=3, train=8, val=2)
    flat = root / "flat"
    shutil.move(root / "tree" / "train", flat)
    return flat


def _classes(dataset) -> Counter:
    return Counter(int(label) for label in dataset.labels)


def test_a_folder_of_class_folders_trains_with_a_stratified_holdout(tmp_path):
    data = ImageFolderDataModule(str(_flat(tmp_path)), img_size=32, batch_size=4, num_workers=0, val_holdout=0.25)
    data.setup("fit")
    assert data.classes == ["class0", "class1", "class2"]
    assert _classes(data.train_set) == {0: 6, 1: 6, 2: 6} and _classes(data.val_set) == {0: 2, 1: 2, 2: 2}
    assert data.test_set is data.val_set  # no other split to test on
    held_out = {s.path for s in data.val_set.samples}
    assert not held_out & {s.path for s in data.train_set.samples}
    again = ImageFolderDataModule(str(tmp_path / "flat"), img_size=32, num_workers=0, val_holdout=0.25)
    again.setup("fit")
    assert {s.path for s in again.val_set.samples} == held_out  # the same images every run


def test_a_training_split_alone_holds_out_its_validation_and_keeps_the_val_folder_when_there_is_one(tmp_path):
    write_image_folder(tmp_path, classes=2, train=8, val=3)
    with_val = ImageFolderDataModule(str(tmp_path), img_size=32, num_workers=0, val_holdout=2)
    with_val.setup("fit")
    assert len(with_val.val_set) == 2 and len(with_val.test_set) == 6  # test: the val folder, as before
    shutil.rmtree(tmp_path / "val")
    alone = ImageFolderDataModule(str(tmp_path), img_size=32, num_workers=0, val_holdout=2)
    alone.setup("fit")
    assert len(alone.train_set) == 14 and alone.test_set is alone.val_set and len(alone.val_set) == 2


@pytest.mark.parametrize("layout", ["flat", "train alone"])
def test_a_missing_validation_split_is_one_line_showing_both_layouts_and_the_option(tmp_path, capsys, layout):
    if layout == "flat":
        root, missing = _flat(tmp_path), "has no train/ folder"
    else:
        root = tmp_path / "tree"
        write_image_folder(root, classes=2, train=4, val=1)
        shutil.rmtree(root / "val")
        missing = f"{root / 'val'} does not exist"
    with pytest.raises(SystemExit) as stop:
        main(
            [
                "fit",
                "--config",
                str(ROOT / "configs/cifar10_vit.yaml"),
                "--data",
                "vit.data.ImageFolderDataModule",
                "--data.root",
                str(root),
                "--trainer.logger",
                "false",
                "--trainer.default_root_dir",
                str(tmp_path),
            ]
        )
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert stop.value.code == 1
    assert last.startswith("error: ") and missing in last
    assert f"expected {root}/train/<class>/<images> and {root}/val/<class>/<images>, or {root}/<class>/<images> " \
           "(or train/ alone) with --data.val_holdout 0.1" in last  # fmt: skip
