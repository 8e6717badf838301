"""How vit-bench (vit.tools.benchmark) measures: the run's settings (`Bench`), a section's output
(`Section`), timing contenders in turn (`interleaved`), the spreads and ratios reported, peak
memory, the machine's matmul rate, and the numbers' formatting in the tables.

Everything compared is timed in turn within each repetition (order alternating), after warm-up, so
a change in machine load hits all contenders alike; the median and the min-max over repetitions are
reported, and ratios as the median of per-repetition ratios.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn


@dataclass
class Bench:
    """Run-wide settings every section reads."""

    device: torch.device
    dtype: torch.dtype
    compile: bool
    quick: bool
    reps: int
    warmup: int
    data_root: Path
    min_sample_s: float = 0.5  # a timed sample repeats short calls until it lasts this long
    matmul_gflops: float | None = None  # the same-run matmul rate utilisation is measured against
    peak_tflops: float | None = None  # the GPU's data-sheet bf16 peak (MFU), None on a CPU or unknown GPU
    vit_cases: list[tuple[str, int, int]] | None = None  # --models; None: the device's default cases

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def prepare(self, model: nn.Module) -> nn.Module:
        model = model.to(self.device)
        return torch.compile(model) if self.compile else model


@dataclass
class Section:
    """One section's output: raw rows for the JSON, a formatted table and notes for the markdown."""

    title: str
    header: list[str]
    table: list[list[str]]
    rows: list[dict[str, Any]]
    notes: list[str] = field(default_factory=list)


def interleaved(bench: Bench, fns: dict[str, Callable[[], object]], reps: int | None = None) -> dict[str, list[float]]:
    """Seconds per call of each fn, one sample per fn per repetition, in alternating order, so a drift
    in machine load (other jobs on a shared CPU) affects every contender alike. A sample repeats a
    short call until it lasts `bench.min_sample_s`, so one preemption of a thread does not dominate it."""
    names = list(fns)
    calls = {}
    for name in names:
        for _ in range(max(1, bench.warmup)):
            bench.sync()
            start = time.perf_counter()
            fns[name]()
            bench.sync()
        calls[name] = max(1, math.ceil(bench.min_sample_s / (time.perf_counter() - start)))
    times: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(bench.reps if reps is None else reps):
        for name in names if rep % 2 == 0 else names[::-1]:
            bench.sync()
            start = time.perf_counter()
            for _ in range(calls[name]):
                fns[name]()
            bench.sync()
            times[name].append((time.perf_counter() - start) / calls[name])
    return times


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def rate(seconds: list[float], items: int) -> dict[str, float]:
    """Items per second: median and min-max over repetitions."""
    return spread([items / s for s in seconds])


def paired_ratio(ours: list[float], theirs: list[float]) -> dict[str, float]:
    """Speed ratio ours/theirs per repetition (their time / our time), then median and min-max."""
    return spread([t / o for o, t in zip(ours, theirs, strict=True)])


def peak_memory(bench: Bench, fn: Callable[[], object]) -> int:
    """Peak bytes allocated during one call, above what was allocated before it.

    CUDA: the caching allocator's peak. CPU: every allocation and free the profiler records (the
    kernels' own scratch buffers included), replayed in time order; this counts tensor memory, not
    the process RSS, and does not depend on what the allocator keeps cached."""
    if bench.device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [
        e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]" and e.device_type().name == "CPU"
    ]
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        live += event.nbytes()
        peak = max(peak, live)
    return peak


def matmul_peak(bench: Bench) -> dict[str, Any]:
    """GFLOP/s of a large square matmul: the practical compute limit of this machine and dtype."""
    n = 512 if bench.quick else 8192 if bench.device.type == "cuda" else 2048
    a = torch.randn(n, n, device=bench.device, dtype=bench.dtype)
    b = torch.randn(n, n, device=bench.device, dtype=bench.dtype)
    seconds = interleaved(bench, {"mm": lambda: a @ b}, reps=3 if bench.quick else 10)["mm"]
    gflops = spread([2 * n**3 / s / 1e9 for s in seconds])
    return {"n": n, "dtype": str(bench.dtype), "gflops": gflops}


def fmt_num(x: float) -> str:
    return f"{x:.0f}" if abs(x) >= 100 else f"{x:.1f}" if abs(x) >= 10 else f"{x:.2f}"


def fmt_spread(s: dict[str, float]) -> str:
    return f"{fmt_num(s['median'])} ({fmt_num(s['min'])}-{fmt_num(s['max'])})"


def fmt_ratio(s: dict[str, float]) -> str:
    return f"**{s['median']:.2f}** ({s['min']:.2f}-{s['max']:.2f})"


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"
