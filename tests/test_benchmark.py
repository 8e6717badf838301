"""scripts/benchmark.py --quick: every section runs and the report has its fields and consistent ratios
(speeds themselves are measured by the benchmark, not asserted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import SHARED
from vit.tools.benchmark import SECTIONS, Bench, main, parse_models, section_vit


def test_quick_run_writes_a_complete_report(tmp_path: Path) -> None:
    report = main(
        ["--quick", "--reps", "1", "--threads", "1", "--out", str(tmp_path), "--data-root", str(SHARED / "data")]
    )

    saved = json.loads((tmp_path / "benchmark_quick.json").read_text())
    assert saved["command"] == report["command"]
    assert set(saved["sections"]) == set(SECTIONS)
    assert saved["machine"]["torch_threads"] >= 1
    assert saved["matmul"]["gflops"]["median"] > 0

    (row,) = saved["sections"]["vit"]["rows"]
    assert row["model"] == "vit_nano_patch4_16"
    assert row["max_abs_logit_diff"] < 1e-4  # the timm twin really is the same model
    for key in ("ratio_infer", "ratio_train", "ours_infer_img_s", "timm_train_img_s"):
        assert set(row[key]) == {"median", "min", "max"}
    for mode in ("infer", "train"):  # one repetition: each ratio is the two speeds' quotient
        ours, theirs = row[f"ours_{mode}_img_s"]["median"], row[f"timm_{mode}_img_s"]["median"]
        assert row[f"ratio_{mode}"]["median"] == pytest.approx(ours / theirs)
    assert row["ours_train_gflop_per_img"] < row["timm_train_gflop_per_img"]  # CLS-only last block

    for row in saved["sections"]["attention"]["rows"]:
        assert row["fused_train_ms"]["median"] > 0
        # The explicit path materialises the (heads, N, N) scores; the measured peak must show it.
        assert row["explicit_train_peak_bytes"] >= row["attn_matrix_bytes"]

    assert saved["sections"]["resnet"]["rows"][0]["nchw_infer_img_s"]["median"] > 0
    kinds = {r["kind"] for r in saved["sections"]["profile"]["rows"]}
    assert {"matmul", "attention kernel", "other"} <= kinds
    if (SHARED / "data" / "cifar10").exists():
        assert saved["sections"]["data"]["rows"][0]["albumentations_img_s"]["median"] > 0

    markdown = (tmp_path / "benchmark_quick.md").read_text()
    assert "ours/timm" in markdown and "vit_nano_patch4_16" in markdown


def test_unknown_section_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="unknown section"):
        main(["--quick", "--sections", "vit,nope", "--out", str(tmp_path)])


def test_models_option_and_mfu_against_a_given_peak() -> None:
    assert parse_models("vit_base_patch16_224:256:128, vit_nano_patch4_16:4:2") == [
        ("vit_base_patch16_224", 256, 128),
        ("vit_nano_patch4_16", 4, 2),
    ]
    with pytest.raises(SystemExit, match="NAME:INFER_BATCH:TRAIN_BATCH"):
        parse_models("vit_base_patch16_224:256")
    # On a GPU the peak is the data sheet's; here a made-up 1 TFLOP/s, so MFU = GFLOP/s / 1000.
    bench = Bench(
        device=torch.device("cpu"), dtype=torch.float32, compile=False, quick=True, reps=1, warmup=1,
        data_root=Path("."), min_sample_s=0.01, matmul_gflops=50.0, peak_tflops=1.0,
        vit_cases=[("vit_nano_patch4_16", 4, 2)],
    )  # fmt: skip
    section = section_vit(bench)
    (row,) = section.rows
    assert (row["model"], row["infer_batch"], row["train_batch"]) == ("vit_nano_patch4_16", 4, 2)
    for key in ("ours_infer", "ours_train", "timm_train"):
        assert row[f"{key}_mfu"] == pytest.approx(row[f"{key}_gflop_s"] / 1000.0)
        assert row[f"{key}_util"] == pytest.approx(row[f"{key}_gflop_s"] / 50.0)
    assert section.header[-2:] == ["MFU ours inf/train", "timm"]
    assert section.table[0][-2] == f"{100 * row['ours_infer_mfu']:.1f}% / {100 * row['ours_train_mfu']:.1f}%"
