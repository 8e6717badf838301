"""The machine a number was measured on, in the same words everywhere (`machine()`), and the
markdown tables the commands and the studies (benchmarks/) print. Numbers measured on different
machines do not compare: benchmarks/budget.py groups its rows by the machine line."""

from __future__ import annotations

import contextlib
import platform
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else what `platform` knows."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "unknown CPU"


def machine() -> str:
    """One line naming the machine: CPU and its vector unit, torch threads, GPU, torch and Python.

    The vector unit matters as much as the name: two machines that both report "AMD EPYC" trained
    ResNet-20 at very different speeds (benchmarks/budget.md), so rows compare only when this is equal.
    """
    cpu = f"{cpu_name()} ({torch.backends.cpu.get_cpu_capability()})"
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    versions = f"torch {torch.__version__}, Python {platform.python_version()}"
    return f"{cpu}, {torch.get_num_threads()} threads, {gpu}; {versions}"


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[object]], align: str | None = None) -> list[str]:
    """The lines of a markdown table. `align` has one letter per column, "l" or "r" (numbers read
    best right-aligned); by default every column is left as the renderer likes it."""
    if align is not None and len(align) != len(header):
        raise ValueError(f"align {align!r} has {len(align)} letters for {len(header)} columns")
    rule = {"l": "---", "r": "---:"}
    lines = [f"| {' | '.join(header)} |", "|" + "".join(f"{rule[a]}|" for a in (align or "l" * len(header)))]
    for cells in rows:
        if len(cells) != len(header):
            raise ValueError(f"a row has {len(cells)} cells for {len(header)} columns: {cells}")
        lines.append(f"| {' | '.join(str(c) for c in cells)} |")
    return lines
