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
    out.write_text("old tables\n" + finetune_study.NOTES_MARKER + "\nA note.\n")
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
    report = out.read_text()
    assert report.startswith("# Fine-tuning studies\n\n| study | setting |")  # the table leads
    before, after = rows[4].top1, rows[5].top1
    jpeg = f"| test top-1 | 93.39% | {before:.2f}% | {93.39 - before:.2f} points | {after:.2f}% |"
    assert jpeg in report and "of the loss) |" in report
    assert "```bash\npython -m benchmarks.finetune_study --vit-checkpoint" in report
    assert report.endswith(finetune_study.NOTES_MARKER + "\nA note.\n") and "old tables" not in report


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
    # decay 0.9999 keeps the moving average within 1% of the first weights over this run: scored, it is untrained
    ema = ["--", "--model.ema_decay", "0.9999"]
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
    # the summary leads with the final run of the one machine that has one; every run is beside it
    assert f"| ResNet-20 | 0.27M | {100 * final['top1']:.2f}% |" in out.read_text()
    table = (tmp_path / "budget_runs.md").read_text()
    assert "## Final runs (test set, scored once), machine 2" in table  # the tuned row's host came first
    assert f"## Tuning runs (held-out validation), machine 1\n\nMachine: {tuned['machine']}." in table
    assert re.search(r"\| resnet20 \(`resnet20`\) \| `configs/cifar10_resnet.yaml` \| --data.batch_size 16 \|", table)
    overlaid = f"| resnet20 (`resnet20`) | `configs/cifar10_resnet.yaml` + `{overlay}` | --model.ema_decay 0.9999 |"
    assert overlaid in table
    assert f"| {100 * tuned['top1']:.2f}% (EMA {100 * tuned['top1_ema']:.2f}%) |" in table
    assert plot.stat().st_size > 1000 and (tmp_path / "budget_machines.png").stat().st_size > 1000


def test_a_budget_run_stopped_by_sigterm_exits_143_says_so_and_writes_no_row(tmp_path, capsys):
    """A run cut short (a scheduler's SIGTERM after step 2 of a 1-minute budget) is not a result:
    scored, it would enter the tables as a budget it never had."""
    write_image_folder(tmp_path / "data", classes=3, train=40, val=20, val_dir="test", ext="jpg")
    results = tmp_path / "budget.jsonl"
    with pytest.raises(SystemExit) as stopped:
        budget.main([
            "run", "--name", "resnet20", "--config", "configs/cifar10_resnet.yaml", "--minutes", "1",
            "--data-root", str(tmp_path / "data"), "--workdir", str(tmp_path / "runs"), "--results", str(results),
            "--", "--data.batch_size", "16", "--trainer.callbacks+=tests.faults.SignalAt",
            "--trainer.callbacks.step=2", "--trainer.callbacks.signals=[SIGTERM]",
        ])  # fmt: skip
    assert stopped.value.code == 143
    assert not results.exists()
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.fullmatch(
        rf"budget run 'resnet20' stopped by SIGTERM after 0\.\d of 1 minutes \(step 2\): not scored, "
        rf"nothing written to {re.escape(str(results))}",
        line,
    ), line


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
    for run in (text, images):  # the clock, started before the data is read, stops training: the step that
        # passes 4 s is the last (4.003 s of steps once, the text run's data being read in no time)
        assert run["steps"] > 0 and 0 < run["train_seconds"] < 4 + 1 and run["wall_seconds"] < 60
    assert text["val_loss"] < math.log(len(set(verse)))  # learnt more than the uniform guess
    assert text["val_loss_at_4x_context"] is not None  # rope runs beyond its training context
    assert images["val_images"] == 30 and images["val_top1"] * 30 == pytest.approx(round(images["val_top1"] * 30))
    assert images["epochs"] == pytest.approx(images["samples"] / 90)  # the 90 training images not held out
    assert len(list((out / "cache").glob("images-*.npz"))) == 2  # the two splits, decoded once (vit.data.memory)

    md.write_text("old tables" + ablate.NOTES_MARKER + "\nA note.\n")
    ablate.main(["report", "--out", str(out), "--report", str(md)])
    report = md.read_text()
    assert report.startswith("# Ablations of the Block's options\n\n## Text: Tiny Shakespeare, nanoGPT's CPU GPT\n\n|")
    assert f"from the runs in `{out / 'results.jsonl'}`" in report
    assert re.search(r"\| rope \| `posemb='rope'` \| [\d,]+ \| [\d,]+ \|", report)  # the text table's row
    assert re.search(r"\| qk_norm \| `qk_norm=True` \| [\d,]+ \|.*\| \*\*\d+\.\d%\*\* \|", report)  # images
    assert report.endswith(ablate.NOTES_MARKER + "\nA note.\n") and "old tables" not in report


def test_budget_report_leads_with_one_machine_and_keeps_every_run_beside_it(tmp_path):
    def row(split: str, machine: str, name: str = "vit", minutes: int = 10, top1: float = 0.77, **kw) -> dict:
        return {"split": split, "machine": machine, "name": name, "model_name": "m", "config": "c.yaml",
                "overrides": [], "params": 1.2e6, "minutes": minutes, "seed": 0, "epochs": 8.0, "img_per_s": 600.0,
                "wall_minutes": 10.0, "top1": top1, "top1_flip": None, "date": "2026-11-25 10:00"} | kw  # fmt: skip

    bf16 = {"overrides": ["--trainer.precision", "bf16-mixed"]}
    rows = [
        row("val", "A, 2 threads"),  # A only tuned: numbered first, in no summary
        row("test", "B, 2 threads", "resnet20", 10, 0.85),
        row("test", "B, 2 threads", "resnet20", 30, 0.88),
        row("test", "B, 2 threads", "vit", 10, 0.78, date="2026-11-25 09:00"),
        row("test", "B, 2 threads", "vit", 10, 0.80, date="2026-11-25 11:00", params=0.6e6),  # newest: the shipped
        row("test", "B, 2 threads", "vit-cutmix", 30, 0.83, params=0.6e6),  # a ViT recipe: the ViT's 30 minutes
        row("test", "C, 2 threads", "resnet20", 10, 0.80),  # fewer cells than B: not the headline
        row("test", "C, 2 threads", "vit", 10, 0.70, **bf16),  # C ran the ViT in both precisions
        row("test", "C, 2 threads", "vit", 30, 0.75, date="2026-11-25 12:00"),
    ]  # fmt: skip
    results, out = tmp_path / "budget.jsonl", tmp_path / "b.md"
    results.write_text("".join(json.dumps(r) + "\n" for r in rows))
    budget.main(["report", "--results", str(results), "--out", str(out), "--plot", str(tmp_path / "b.png")])
    text = out.read_text()
    assert text.index("machine 2:\nB, 2 threads), fp32,") < text.index("## Every machine")
    lead = [line for line in text.splitlines() if line.startswith(("| ResNet-20 |", "| ViT |"))][:2]
    assert lead == ["| ResNet-20 | 1.20M | 85.00% | 88.00% |", "| ViT | 0.60M | 80.00% | 83.00% |"]
    assert "- ViT: `c.yaml` (10, 30 min)" in text and "![Test top-1 against the budget, machine 2](b.png)" in text
    assert "| 3 | ViT (bf16) | 70.00% | - |" in text and "| 3 | ViT (fp32) | - | 75.00% |" in text
    assert "| 1 |" not in text.split("## Every machine")[1]  # the tuned-only machine has no final runs
    assert "[b_runs.md](b_runs.md)" in text
    runs = (tmp_path / "b_runs.md").read_text()
    assert [line for line in runs.splitlines() if line.startswith("## ")] == [
        "## Final runs (test set, scored once), machine 2",
        "## Final runs (test set, scored once), machine 3",
        "## Tuning runs (held-out validation), machine 1",
    ]
    assert budget.headline_machine([r for r in rows if r["split"] == "test"]) == "B, 2 threads"
    # the plots: the headline machine's lines, annotated; one panel per machine with final runs
    assert budget.plot_headline(rows[1:6], "B, 2 threads", tmp_path / "h.png", {}) == (
        "CIFAR-10 in a fixed time: B, 2 threads, fp32"
    )
    assert budget.plot(rows[1:], tmp_path / "p.png", {"B, 2 threads": 2, "C, 2 threads": 3}) == [
        "machine 2: B; ViT 0.60M, an earlier recipe", "machine 3: C; ViT 1.20M, as shipped"]  # fmt: skip


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
    text = (tmp_path / "b_runs.md").read_text()
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


def test_a_lever_is_compared_with_the_config_of_its_day():
    """When the config changed its model (6 blocks -> 3), each lever's `vs vit` is against the config's
    runs nearest in time, not against today's config."""

    def row(name: str, params: float, seed: int, top1: float, date: str) -> dict:
        return {"split": "val", "machine": "A", "name": name, "model_name": "m", "config": "c.yaml",
                "overrides": [] if name == "vit" else ["--y", "1"], "params": params, "minutes": 10, "seed": seed,
                "epochs": 10.0, "img_per_s": 1000.0, "wall_minutes": 10.0, "top1": top1, "top1_flip": None,
                "date": date}  # fmt: skip

    rows = [
        row("vit", 1.2e6, 0, 0.75, "2026-11-25 10:00"),
        row("vit", 1.2e6, 1, 0.75, "2026-11-25 10:10"),
        row("vit-ema", 1.2e6, 0, 0.74, "2026-11-25 10:20"),
        row("vit-ema", 1.2e6, 1, 0.74, "2026-11-25 10:30"),
        row("vit", 0.6e6, 0, 0.78, "2026-11-26 02:00"),
        row("vit", 0.6e6, 1, 0.78, "2026-11-26 02:10"),
        row("vit-wd0", 0.6e6, 0, 0.77, "2026-11-26 02:20"),
        row("vit-wd0", 0.6e6, 1, 0.775, "2026-11-26 02:30"),
    ]
    lines = budget.seed_tables(rows, {"A": 1}, short=True)  # fmt: skip
    assert lines[0] == "## Each lever at 10 minutes, two seeds or more (held-out validation, machine 1)"
    vs = {line.split(" | ")[0].removeprefix("| "): line.split(" | ")[-1].removesuffix(" |") for line in lines
          if line.startswith("| vit")}  # fmt: skip
    assert vs == {"vit (0.60M)": "-", "vit-wd0 (0.60M)": "-0.75", "vit (1.20M)": "-", "vit-ema (1.20M)": "-1.00"}


def test_budget_report_shows_the_levers_of_the_headline_machine_and_of_the_newest_tuned_one(tmp_path):
    def row(machine: str, name: str, seed: int, top1: float, date: str, split: str = "val") -> dict:
        return {"split": split, "machine": f"{machine}, 2 threads", "name": name, "model_name": "m", "config": "c.yaml",
                "overrides": [] if name == "vit" else ["--y", "1"], "params": 1e6, "minutes": 10, "seed": seed,
                "epochs": 10.0, "img_per_s": 1000.0, "wall_minutes": 10.0, "top1": top1, "top1_flip": None,
                "date": date}  # fmt: skip

    rows = [
        row("A", "vit", 0, 0.70, "2026-11-01 10:00"), row("A", "vit", 1, 0.70, "2026-11-01 10:10"),  # older
        row("B", "vit", 0, 0.75, "2026-11-25 10:00"), row("B", "vit", 1, 0.75, "2026-11-25 10:10"),
        row("B", "vit", 0, 0.76, "2026-11-25 11:00", "test"), row("B", "resnet20", 0, 0.80, "2026-11-25 12:00", "test"),
        row("C", "vit", 0, 0.80, "2026-12-07 10:00"), row("C", "vit", 1, 0.81, "2026-12-07 10:10"),
        row("C", "vit-spt", 0, 0.82, "2026-12-07 10:20"), row("C", "vit-spt", 1, 0.83, "2026-12-07 10:30"),
    ]  # fmt: skip
    results, out = tmp_path / "budget.jsonl", tmp_path / "b.md"
    results.write_text("".join(json.dumps(r) + "\n" for r in rows))
    budget.main(["report", "--results", str(results), "--out", str(out), "--plot", str(tmp_path / "b.png")])
    titles = [line for line in out.read_text().splitlines() if line.startswith("## Each lever")]
    assert titles == ["## Each lever at 10 minutes, two seeds or more (held-out validation, machine 2)",
                      "## Each lever at 10 minutes, two seeds or more (held-out validation, machine 3)"]  # fmt: skip
    assert "| vit-spt (1.00M) | `c.yaml` | --y 1 | 82.00, 83.00 | 82.50% |" in out.read_text()
