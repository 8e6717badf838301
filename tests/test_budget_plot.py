"""benchmarks/budget_machines.png reads without the tables: a point says its precision by its marker
(fp32 hollow squares, bf16 filled circles), and each panel says which ViT recipe it holds."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from benchmarks import budget


def run(name: str, minutes: int, top1: float, precision: str, params: float, date: str) -> dict:
    overrides = ["--trainer.precision", "bf16-mixed"] if precision == "bf16" else []
    return {"split": "test", "machine": "M, 2 threads", "name": name, "config": "c.yaml", "overrides": overrides,
            "params": params, "minutes": minutes, "top1": top1, "date": date}  # fmt: skip


def test_a_single_fp32_point_is_told_from_bf16_by_its_marker():
    final = [run("vit", 10, 0.79, "bf16", 1.2e6, "2026-11-25 10:00"),
             run("vit", 30, 0.83, "bf16", 1.2e6, "2026-11-25 11:00"),
             run("vit", 10, 0.77, "fp32", 1.2e6, "2026-11-25 12:00")]  # fmt: skip
    fig, ax = plt.subplots()
    budget._draw(ax, budget.newest(final, "M, 2 threads"), annotate=False, say_precision=True)
    lines = {line.get_label(): line for line in ax.get_lines()}
    plt.close(fig)
    assert set(lines) == {"ViT (bf16), 1.20M parameters", "ViT (fp32), 1.20M parameters"}
    bf16, fp32 = lines["ViT (bf16), 1.20M parameters"], lines["ViT (fp32), 1.20M parameters"]
    assert (bf16.get_marker(), fp32.get_marker()) == ("o", "s")
    assert fp32.get_markerfacecolor() == "white" and bf16.get_color() == fp32.get_color()  # one colour a model


def test_each_panel_says_whether_its_vit_is_the_shipped_recipe(tmp_path):
    earlier = run("vit", 10, 0.80, "bf16", 1.2e6, "2026-11-24 10:00") | {"machine": "Old, 2 threads"}
    shipped = run("vit", 10, 0.78, "bf16", 0.6e6, "2026-11-25 10:00")
    titles = budget.plot([earlier, shipped], tmp_path / "p.png", {"Old, 2 threads": 1, "M, 2 threads": 2})
    assert titles == ["machine 1: Old; ViT 1.20M, an earlier recipe", "machine 2: M; ViT 0.60M, as shipped"]


def test_a_config_that_evaluates_with_flip_tta_is_scored_with_it_and_one_that_does_not_plainly():
    """Every run is scored with and without flip averaging; the headline cell is the one its config
    evaluates with, so a baseline that ships `tta_flip: true` is compared as it would be used."""
    flips = run("resnet20", 10, 0.86, "bf16", 0.27e6, "2026-12-07 10:00") | {
        "top1_flip": 0.87, "recipe": {"model": {"init_args": {"tta_flip": True}}}}  # fmt: skip
    plain = run("vit", 10, 0.80, "bf16", 0.6e6, "2026-12-07 11:00") | {
        "top1_flip": 0.81, "recipe": {"model": {"init_args": {"tta_flip": False}}}}  # fmt: skip
    older = run("vit", 30, 0.83, "bf16", 0.6e6, "2026-11-25 11:00")  # no recipe recorded: plain
    lines = budget.headline([flips, plain, older], "M, 2 threads", {"M, 2 threads": 1}, "p.png")
    assert "| ResNet-20 | 0.27M | 87.00% | - |" in lines
    assert "| ViT | 0.60M | 80.00% | 83.00% |" in lines
