"""The study scripts run end to end (real data or a tiny stand-in, a couple of batches or seconds)
and write their tables."""

from __future__ import annotations

import json
import math
import re
import shutil

import pytest
import torch

from benchmarks import ablate, budget, finetune_study
from tests.conftest import shared_path, write_image_folder
from vit import create_model

pytestmark = pytest.mark.slow


def test_finetune_study_runs_every_row_and_reports_the_jpeg_recovery(tmp_path):
    shared, resnet56 = shared_path("data/cifar10"), shared_path("weights/resnet56-4bfd9763.th")
    root = tmp_path / "cifar10"  # 20 real images a class and split: the study decodes its data into memory
    for folder in sorted(shared.glob("*/*")):
        (root / folder.relative_to(shared)).mkdir(parents=True)
        for image in sorted(folder.iterdir())[:20]:
            shutil.copy(image, root / image.relative_to(shared))
    pretrained = create_model(  # what configs/tiny_imagenet_vit.yaml trains
        "vit_micro_patch8_64", num_classes=200, posemb="sincos2d", global_pool="avg", class_token=False
    )
    torch.save(pretrained.state_dict(), tmp_path / "tiny.pth")
    out = tmp_path / "finetune.md"
    rows = finetune_study.main([
        "--vit-checkpoint", str(tmp_path / "tiny.pth"), "--cifar-root", str(root), "--resnet-checkpoint", str(resnet56),
        "--epochs", "1", "--limit-batches", "2", "--num-workers", "0", "--workdir", str(tmp_path / "runs"),
        "--out", str(out),
    ])  # fmt: skip
    assert [r.setting for r in rows] == [
        "from scratch", "fine-tuned, layer decay 0.75", "fine-tuned, no layer decay",
        "linear probe (frozen backbone)", "checkpoint as is (no training)", "fine-tuned on the JPEG train split",
    ]  # fmt: skip
    assert rows[4].top1 > 50  # two batches of the real checkpoint on JPEG test images: well above chance
    assert "of the loss." in out.read_text()


def test_budget_run_stops_on_time_scores_once_and_reports(tmp_path):
    write_image_folder(tmp_path / "data", classes=3, train=40, val=20, val_dir="test", ext="jpg")
    results = tmp_path / "budget.jsonl"
    common = ["--config", "configs/cifar10_resnet.yaml", "--minutes", "0.1", "--data-root", str(tmp_path / "data"),
              "--workdir", str(tmp_path / "runs"), "--results", str(results)]  # fmt: skip
    # a second config lies over the first, as in train.py: its data options reach the image folder too
    overlay = tmp_path / "overlay.yaml"
    overlay.write_text(
        "model:\n  init_args:\n    optimizer:\n      lr: 0.05\ndata:\n  init_args:\n    batch_size: 16\n"
    )
    # decay 1.0 keeps the moving average at the weights after the first step: scored, it is untrained
    ema = ["--", "--model.ema_decay", "1.0"]
    host = ["--machine-label", "host B"]  # another host of the same type, slower say: its own tables
    budget.main(
        ["run", "--name", "resnet20", "--tune", "--holdout", "30", *common, "--config", str(overlay), *host, *ema]
    )
    budget.main(["run", "--name", "resnet20", *common, "--", "--data.batch_size", "16"])
    tuned, final = (json.loads(line) for line in results.read_text().splitlines())
    assert tuned["config"] == f"configs/cifar10_resnet.yaml + {overlay}"
    assert final["config"] == "configs/cifar10_resnet.yaml"
    assert tuned["recipe"]["model"]["init_args"]["optimizer"]["lr"] == 0.05
    assert final["recipe"]["model"]["init_args"]["optimizer"]["lr"] == 0.2
    assert tuned["split"] == "val" and tuned["train_images"] == 90  # 120 training images, 30 held out
    assert final["split"] == "test" and final["train_images"] == 120
    for r in (tuned, final):
        assert 0.1 <= r["wall_minutes"] < 0.2  # the clock (decoding included) stops the run
        assert r["steps"] > 0 and 0.0 <= r["top1"] <= 1.0 and 0.0 <= r["top1_flip"] <= 1.0
        assert r["top1"] > 0.5  # three classes told apart by brightness: learnt, not chance
        assert r["recipe"]["model"]["init_args"]["optimizer"]["name"] == "sgd"  # the ResNet config's, as run
        assert r["recipe"]["data"]["init_args"]["batch_size"] == 16 and r["recipe"]["precision"] == "32-true"
    assert tuned["top1_ema"] < 0.5 < tuned["top1"] and "top1_ema" not in final  # the average, not the weights
    assert tuned["machine"] == final["machine"] + "; host B"
    out, plot = tmp_path / "budget.md", tmp_path / "budget.png"
    budget.main(["report", "--results", str(results), "--out", str(out), "--plot", str(plot)])
    table = out.read_text()
    assert "## Final runs (test set, scored once), machine 2" in table  # the tuned row's host came first
    assert f"## Tuning runs (held-out validation), machine 1\n\nMachine: {tuned['machine']}." in table
    assert re.search(r"\| resnet20 \(`resnet20`\) \| `configs/cifar10_resnet.yaml` \| --data.batch_size 16 \|", table)
    assert f"| resnet20 (`resnet20`) | `configs/cifar10_resnet.yaml` + `{overlay}` | --model.ema_decay 1.0 |" in table
    assert f"| {100 * tuned['top1']:.2f}% (EMA {100 * tuned['top1_ema']:.2f}%) |" in table
    assert plot.stat().st_size > 1000


@pytest.fixture
def keep_threads():
    """ablate.py sets the thread count (one by default); other tests must not inherit it."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_ablation_runs_train_on_the_clock_and_report_a_row_each(tmp_path, keep_threads):
    data = tmp_path / "data"
    write_image_folder(data / "cifar10", classes=3, train=40, val=20, val_dir="test", ext="jpg")
    verse = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n\n"
    (data / "tinyshakespeare.txt").write_text(verse * 50)
    out, md = tmp_path / "out", tmp_path / "ablations.md"
    common = ["--seconds", "4", "--data-root", str(data), "--out", str(out)]
    text = ablate.main(["text", "--variant", "rope", *common])
    images = ablate.main(["images", "--variant", "qk_norm", "--holdout", "30", *common])
    for run in (text, images):  # the clock, started before the data is read, stops training
        assert run["steps"] > 0 and 0 < run["train_seconds"] < 4 and run["wall_seconds"] < 60
    assert text["val_loss"] < math.log(len(set(verse)))  # learnt more than the uniform guess
    assert text["val_loss_at_4x_context"] is not None  # rope runs beyond its training context
    assert images["val_images"] == 30 and images["val_top1"] * 30 == pytest.approx(round(images["val_top1"] * 30))
    assert images["epochs"] == pytest.approx(images["samples"] / 90)  # the 90 training images not held out
    assert len(list((out / "cache").glob("images-*.npz"))) == 2  # the two splits, decoded once (vit.data.memory)

    md.write_text("old tables" + ablate.NOTES_MARKER + "\nA note.\n")
    ablate.main(["report", "--out", str(out), "--report", str(md)])
    report = md.read_text()
    assert f"from the runs in `{out / 'results.jsonl'}`" in report
    assert re.search(r"\| rope \| `posemb='rope'` \| [\d,]+ \| [\d,]+ \|", report)  # the text table's row
    assert re.search(r"\| qk_norm \| `qk_norm=True` \| [\d,]+ \|.*\| \*\*\d+\.\d%\*\* \|", report)  # images
    assert report.endswith(ablate.NOTES_MARKER + "\nA note.\n") and "old tables" not in report


def test_budget_report_numbers_each_machine_once_and_plots_each_recipe_as_its_own_curve(tmp_path):
    def row(split: str, machine: str) -> dict:
        return {"split": split, "machine": machine, "name": "vit", "model_name": "vit_micro_patch4_32",
                "config": "c.yaml", "overrides": [], "params": 1.2e6, "minutes": 10, "seed": 0, "epochs": 8.0,
                "img_per_s": 600.0, "wall_minutes": 10.0, "top1": 0.77, "top1_flip": None}  # fmt: skip

    results = tmp_path / "budget.jsonl"  # machine A only tuned; B has final runs and tuning runs
    rows = [row("val", "A"), row("val", "B"), row("test", "B")]
    results.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "b.md"
    budget.main(["report", "--results", str(results), "--out", str(out), "--plot", str(tmp_path / "b.png")])
    text = out.read_text()
    headings = [line for line in text.splitlines() if line.startswith("## ")]
    assert headings == [
        "## Summary: test top-1 against the budget",
        "## Final runs (test set, scored once), machine 2",
        "## Tuning runs (held-out validation), machine 1",
        "## Tuning runs (held-out validation), machine 2",
    ]
    # the summary leads: each machine's best final run per model and budget
    summary = budget.summary([row("test", "B"), row("test", "B") | {"top1": 0.8}, row("test", "A") | {"minutes": 30}],
                             {"A": 1, "B": 2})  # fmt: skip
    assert summary[4:8] == ["| machine | model | 10 min | 30 min |", "|---|---|---:|---:|",
                            "| 1 | vit | - | 77.00% |", "| 2 | vit | 80.00% | - |"]  # fmt: skip
    # the plot: one curve per model and recipe, seeds averaged, a recipe change never averaged in
    rows = [row("test", "B") | {"minutes": m, "top1": t, "seed": seed, "overrides": o}
            for m, t, seed, o in ((10, 0.77, 0, []), (10, 0.75, 1, []), (30, 0.82, 0, []),
                                  (10, 0.79, 0, ["--trainer.precision", "bf16-mixed"]))]  # fmt: skip
    # every machine with final runs gets its own panel, numbered as in the tables
    titles = budget.plot([*rows, row("test", "A")], tmp_path / "p.png", {"A": 1, "B": 2})
    assert titles == ["machine 1: A", "machine 2: B"] and (tmp_path / "p.png").stat().st_size > 1000
    curves = budget.curves(rows)
    assert curves.keys() == {"vit (1.20M)", "vit (1.20M), trainer.precision bf16-mixed"}
    assert [(m, round(t, 6)) for m, t in curves["vit (1.20M)"]] == [(10, 76.0), (30, 82.0)]
    assert [(m, round(t, 6)) for m, t in curves["vit (1.20M), trainer.precision bf16-mixed"]] == [(10, 79.0)]
    # the config changed its model (fewer blocks): its own curve
    assert budget.curves([*rows, rows[0] | {"params": 0.6e6, "top1": 0.78}]).keys() == curves.keys() | {"vit (0.60M)"}


def test_budget_report_puts_seeds_side_by_side_with_each_recipes_difference_from_vit(tmp_path):
    def row(name: str, overrides: list[str], seed: int, top1: float, minutes: int = 10) -> dict:
        return {"split": "val", "machine": "A", "name": name, "model_name": "m", "config": "c.yaml",
                "overrides": overrides, "params": 1e6, "minutes": minutes, "seed": seed, "epochs": 10.0 + seed,
                "img_per_s": 1000.0, "wall_minutes": 10.0, "top1": top1, "top1_flip": top1 + 0.01}  # fmt: skip

    bf16, nodrop = ["--trainer.precision", "bf16-mixed"], ["--trainer.precision", "bf16-mixed", "--x", "0"]
    rows = [row("vit", bf16, 0, 0.80), row("vit", bf16, 1, 0.79),  # the baseline: fewest changes
            row("vit-nodrop", nodrop, 0, 0.775), row("vit-nodrop", nodrop, 1, 0.785),
            row("vit-once", bf16, 0, 0.99),  # one seed: no noise to read, not in the seed table
            row("vit", bf16, 0, 0.70, minutes=5), row("vit", bf16, 1, 0.72, minutes=5)]  # fmt: skip
    results, out = tmp_path / "budget.jsonl", tmp_path / "b.md"
    results.write_text("".join(json.dumps(r) + "\n" for r in rows))
    budget.main(["report", "--results", str(results), "--out", str(out), "--plot", str(tmp_path / "b.png")])
    text = out.read_text()
    five, ten = text.split("## Seeds side by side: 5 minutes, held-out validation, machine 1")[1].split(
        "## Seeds side by side: 10 minutes, held-out validation, machine 1"
    )
    row5 = "| vit (`m`, 1.00M) | `c.yaml` | --trainer.precision bf16-mixed | 70.00, 72.00 | 71.00% | 2.00 | 72.00% |"
    assert row5 in five
    table = [line for line in ten.splitlines() if line.startswith("| vit")]
    assert table == [  # best mean first; the difference of means against the vit baseline
        "| vit (`m`, 1.00M) | `c.yaml` | --trainer.precision bf16-mixed | 80.00, 79.00 | 79.50% | 1.00 | 80.50% | 10.5 "
        "| 1000 | - |",
        "| vit-nodrop (`m`, 1.00M) | `c.yaml` | --trainer.precision bf16-mixed --x 0 | 77.50, 78.50 | 78.00% | 1.00 "
        "| 79.00% | 10.5 | 1000 | -1.50 |",
    ]
