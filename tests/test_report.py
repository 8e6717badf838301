"""The report helpers the studies write with (benchmarks/report.py), and the commands installed with the package."""

from __future__ import annotations

import importlib
import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.report import OpCount, machine, markdown_table, write_report
from tests.conftest import ROOT


def test_markdown_table_aligns_numbers_right_and_renders_cells_as_text():
    lines = markdown_table(("model", "params", "top-1"), [("vit", "1.2M", "70.1%"), ("resnet20", 0.27, 69)], "lrr")
    assert lines == [
        "| model | params | top-1 |",
        "|---|---:|---:|",
        "| vit | 1.2M | 70.1% |",
        "| resnet20 | 0.27 | 69 |",
    ]
    assert markdown_table(("a", "b"), [])[1] == "|---|---|"  # left as the renderer likes it by default


def test_markdown_table_refuses_rows_that_do_not_fit_the_header():
    with pytest.raises(ValueError, match="2 cells for 3 columns"):
        markdown_table(("a", "b", "c"), [("x", "y")])
    with pytest.raises(ValueError, match="2 letters for 3 columns"):
        markdown_table(("a", "b", "c"), [], align="lr")


def test_regenerated_report_keeps_the_notes_below_the_marker(tmp_path):
    marker = "<!-- notes -->"
    path = tmp_path / "new" / "report.md"
    write_report(path, "# v1\n", marker)  # a new file (and folder) gets the marker and an empty notes part
    assert path.read_text() == "# v1\n<!-- notes -->\n"
    path.write_text(path.read_text() + "Read this row with care.\n")
    write_report(path, "# v2\n", marker)
    assert path.read_text() == "# v2\n<!-- notes -->\nRead this row with care.\n"
    write_report(path, "# plain\n")  # no marker: the whole file is the report
    assert path.read_text() == "# plain\n"


def test_op_count_counts_the_kernels_that_run_and_the_bytes_they_write():
    """What the data benchmarks read as a GPU's cost: views cost nothing, an in-place op writes its
    tensor, an indexed write only the rows it writes, a foreach op a kernel a tensor."""
    with OpCount() as ops:
        x = torch.zeros(4, 8)  # 128 bytes
        x[1:3].add_(1)  # a view (no kernel), then 2 rows written: 64 bytes
        x[torch.tensor([0, 3])] = torch.ones(2, 8)  # the ones (64 bytes), 2 rows written (64); the index is the host's
        torch._foreach_mul_([x[0], x[1]], 2.0)  # two kernels, 64 bytes
        y = x.sum(0)  # 32 bytes
    assert y.tolist() == [6.0] * 8
    assert (ops.kernels, ops.written) == (7, 128 + 64 + 64 + 64 + 64 + 32)
    assert ops.count > ops.kernels  # the views were dispatched too


def test_machine_line_names_the_vector_unit_threads_and_versions():
    line = machine()
    assert f"({torch.backends.cpu.get_cpu_capability()})" in line  # two "AMD EPYC"s differ by this
    assert f"{torch.get_num_threads()} threads" in line and f"torch {torch.__version__}" in line


# -- commands ------------------------------------------------------------------------------------


def _project_scripts() -> dict[str, str]:
    """pyproject.toml's [project.scripts] (no tomllib before Python 3.11)."""
    section = (ROOT / "pyproject.toml").read_text().split("[project.scripts]", 1)[1].split("\n[", 1)[0]
    return dict(re.findall(r'^([\w-]+) = "([\w.:]+)"$', section, flags=re.MULTILINE))


SCRIPTS = _project_scripts()


def test_the_installed_commands():
    assert sorted(SCRIPTS) == [
        "vit-bench", "vit-convert-streaming", "vit-export", "vit-predict", "vit-resize-folder", "vit-rollout",
        "vit-sample", "vit-train",
    ]  # fmt: skip


def _script(command: str) -> Path:
    module = SCRIPTS[command].partition(":")[0]
    return ROOT / "scripts" / f"{module.rsplit('.', 1)[1]}.py"


def _help(command: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> tuple[int, str]:
    """(exit code, output) of the checkout script's `--help`, run as `__main__` in this process."""
    from vit.cli import TrainCLI

    script = str(_script(command))
    monkeypatch.setattr(sys, "argv", [script, "--help"])
    monkeypatch.setattr(TrainCLI, "argv", TrainCLI.argv)  # vit.cli.main keeps the command line there
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(script, run_name="__main__")
    return exit_info.value.code or 0, capsys.readouterr().out


@pytest.mark.parametrize("command", sorted(SCRIPTS))
def test_installed_command_points_at_a_function_and_its_checkout_script_runs(command, monkeypatch, capsys):
    """`vit-x` (after pip install) and `python scripts/x.py` (in a checkout) run the same `cli`."""
    module, _, attr = SCRIPTS[command].partition(":")
    assert callable(getattr(importlib.import_module(module), attr))
    assert f"from {module} import {attr}" in _script(command).read_text()
    code, out = _help(command, monkeypatch, capsys)
    assert code == 0 and "usage:" in out.lower()


def test_a_checkout_script_runs_as_a_program_in_a_fresh_interpreter():
    """What the in-process runs above cannot show: nothing it needs was imported by the tests first."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(_script("vit-train")), "--help"], env=env, text=True,
                          capture_output=True, timeout=240)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "usage:" in done.stdout.lower()


def test_the_studies_read_data_and_weights_from_the_environment_or_the_project_folders(monkeypatch):
    """benchmarks/README.md: datasets from $VIT_DATA (default data/), checkpoints from $VIT_WEIGHTS
    (default weights/), unless a study's option names them."""
    from benchmarks import budget, finetune_study

    monkeypatch.delenv("VIT_DATA", raising=False)
    monkeypatch.delenv("VIT_WEIGHTS", raising=False)
    defaults = finetune_study.parse_args(["--vit-checkpoint", "v.ckpt"])
    assert (defaults.cifar_root, defaults.resnet_checkpoint) == ("data/cifar10", "weights/resnet56-4bfd9763.th")
    monkeypatch.setenv("VIT_DATA", "/datasets")
    monkeypatch.setenv("VIT_WEIGHTS", "/ckpts")
    moved = finetune_study.parse_args(["--vit-checkpoint", "v.ckpt"])
    assert (moved.cifar_root, moved.resnet_checkpoint) == ("/datasets/cifar10", "/ckpts/resnet56-4bfd9763.th")
    run = budget.parse_args(["run", "--name", "x", "--config", "c.yaml", "--minutes", "1"])
    assert run.data_root == "/datasets/cifar10"
    assert finetune_study.parse_args(["--vit-checkpoint", "v", "--cifar-root", "here"]).cifar_root == "here"
