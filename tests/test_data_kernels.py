"""benchmarks.data_kernels --quick: our batched augmentation kernels and the libraries' run side by
side, and where an operation is the same the outputs agree (speeds are the study's to measure, not
asserted here)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("kornia")

pytestmark = pytest.mark.slow


def test_quick_run_times_every_task_and_agrees_with_the_libraries_where_the_ops_are_the_same(tmp_path, capsys):
    from benchmarks.data_kernels import CONTENDERS, main

    report = main(["--quick", "--json", str(tmp_path / "kernels.json")])

    assert json.loads((tmp_path / "kernels.json").read_text())["agreement"].keys() == report["agreement"].keys()
    assert [row["task"] for row in report["timings"]] == ["crop", "randaugment", "whole"]
    for row in report["timings"]:
        assert all(row[f"{name}_ms"] > 0 for name in CONTENDERS)
    ((case, agreement),) = report["agreement"].items()
    crop = {name: (count, most, mean) for name, count, most, mean in agreement["crop"]}
    # The same resize (F.interpolate, bilinear, antialiased) on the same boxes: torchvision's equals ours.
    assert crop["torchvision resized_crop (antialias)"][1] < 1e-3
    # kornia does not antialias: the same where a crop is enlarged both ways, levels apart where it shrinks.
    assert crop["kornia crop_by_indices, crops enlarged both ways"][1] < 1e-2
    assert crop["kornia crop_by_indices, crops shrunk in a direction"][1] > 1
    ops = agreement["ops"]
    for op in ("solarize", "posterize"):  # the same definition on whole levels: equal to the level
        assert ops[op] == {"torchvision": 0.0, "kornia": 0.0}
    assert ops["brightness"] == {"torchvision": 0.0}  # multiplicative, truncated to whole levels, as uint8 ops are
    assert ops["rotate"]["torchvision"] <= 1 and ops["rotate"]["kornia"] <= 1  # bilinear about the centre, rounded
    assert ops["equalize"]["torchvision"] > 1  # ours is OpenCV's equalizeHist (albumentations'), not PIL's

    printed = capsys.readouterr().out
    assert "| kornia / ours | torchvision / ours |" in printed and case in printed
