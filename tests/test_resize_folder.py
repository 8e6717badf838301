"""scripts/resize_folder.py: a training copy of an image folder with the longer side capped."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from vit.data.images import scan_image_folder
from vit.tools.data_check import synthetic_photo
from vit.tools.resize_folder import main


def _tree(root):
    rng = np.random.default_rng(0)
    (root / "train" / "cat").mkdir(parents=True)
    (root / "train" / "dog" / "2024").mkdir(parents=True)
    synthetic_photo(rng, 600, 400).save(root / "train" / "cat" / "big.jpg", quality=90)
    synthetic_photo(rng, 300, 700).convert("L").save(root / "train" / "dog" / "2024" / "tall.JPEG", quality=90)
    synthetic_photo(rng, 800, 500).save(root / "train" / "dog" / "wide.png")
    synthetic_photo(rng, 200, 150).save(root / "train" / "cat" / "small.jpg", quality=90)
    (root / "train" / "cat" / "notes.txt").write_text("kept as it is")


def test_images_over_the_cap_are_resized_and_everything_else_is_copied(tmp_path):
    _tree(tmp_path / "src")
    out = main([str(tmp_path / "src"), str(tmp_path / "dst"), "--max-side", "256", "--workers", "1"])
    assert sorted(len(v) for v in out.values()) == [0, 0, 2, 3]  # 3 resized, 2 copied
    dst = tmp_path / "dst" / "train"
    expected = {"cat/big.jpg": (256, 171, "JPEG"), "dog/2024/tall.JPEG": (110, 256, "JPEG"),
                "dog/wide.png": (256, 160, "PNG"), "cat/small.jpg": (200, 150, "JPEG")}  # fmt: skip
    for name, (width, height, fmt) in expected.items():
        with Image.open(dst / name) as image:
            assert (image.width, image.height, image.format) == (width, height, fmt), name
    assert (dst / "cat" / "small.jpg").read_bytes() == (tmp_path / "src" / "train" / "cat" / "small.jpg").read_bytes()
    assert (dst / "cat" / "notes.txt").read_text() == "kept as it is"
    assert scan_image_folder(dst)[0] == scan_image_folder(tmp_path / "src" / "train")[0]
    again = main([str(tmp_path / "src"), str(tmp_path / "dst"), "--max-side", "256", "--workers", "2"])
    assert len(again["kept"]) == 5 and not again["resized"]  # an interrupted conversion goes on


def test_an_unreadable_image_is_named_or_left_out_and_the_copy_never_goes_inside_the_source(tmp_path, capsys):
    _tree(tmp_path / "src")
    bad = tmp_path / "src" / "train" / "cat" / "cut.jpg"
    bad.write_bytes((tmp_path / "src" / "train" / "cat" / "big.jpg").read_bytes()[:500])
    with pytest.raises(ValueError, match=f"cannot decode image {bad}"):
        main([str(tmp_path / "src"), str(tmp_path / "dst"), "--max-side", "256", "--workers", "1"])
    out = main([str(tmp_path / "src"), str(tmp_path / "dst"), "--max-side", "256", "--workers", "1", "--skip-corrupt"])
    assert len(out["corrupt"]) == 1 and not (tmp_path / "dst" / "train" / "cat" / "cut.jpg").exists()
    assert f"left out: cannot decode image {bad}" in capsys.readouterr().err
    assert not list((tmp_path / "dst").rglob(".*.tmp"))
    with pytest.raises(ValueError, match="inside"):
        main([str(tmp_path / "src"), str(tmp_path / "src" / "small"), "--workers", "1"])
