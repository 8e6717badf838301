"""What a timed fit's GPU did, watched from Lightning callbacks (vit.tools.data_check's end-to-end
rows): where the host waited for the device, in which thread (`SyncAudit`), and how busy the GPU's
streams were (`DeviceBusy`)."""

from __future__ import annotations

import threading
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

SYNC_WARNING = "called a synchronizing CUDA operation"  # what set_sync_debug_mode("warn") says at each wait


class SyncAudit(Callback):
    """Where the host waits for the device during training steps `start` .. `stop` - 1, by thread,
    as torch.cuda.set_sync_debug_mode("warn") reports the waits (on CUDA only; a CPU never waits).
    A wait in the training thread stops it queueing the next kernels while the device works
    through those queued; a data thread's wait holds up only that thread. Each wait's site is the
    innermost frame outside torch (file:line)."""

    def __init__(self, start: int = 0, stop: int = 0) -> None:
        self.start, self.stop = start, stop
        self.waits: list[tuple[bool, str]] = []  # (in the training thread, site)
        self.audited = False
        self._caught: warnings.catch_warnings | None = None
        self._cuda = False

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self.start < self.stop and trainer.strategy.root_device.type == "cuda":
            self.begin(cuda=True)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if trainer.global_step >= self.stop:
            self.end()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self.end()

    def begin(self, cuda: bool) -> None:
        """Record the waits from here on: every thread's, the calling one's as the training thread's."""
        self._caught, self._cuda, self.audited = warnings.catch_warnings(), cuda, True
        self._caught.__enter__()
        warnings.simplefilter("always")
        training, show = threading.current_thread(), warnings.showwarning

        def record(message: Any, category: Any, filename: str, lineno: int, *rest: Any) -> None:
            if SYNC_WARNING in str(message):
                self.waits.append((threading.current_thread() is training, _site(traceback.extract_stack()[:-1])))
            else:
                show(message, category, filename, lineno, *rest)

        warnings.showwarning = record
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")

    def end(self) -> None:
        if self._caught is None:
            return
        if self._cuda:
            torch.cuda.set_sync_debug_mode("default")
        self._caught.__exit__(None, None, None)
        self._caught = None

    def summary(self) -> str:
        """The note's words: waits a step in each kind of thread, and where; "" if nothing was audited."""
        if not self.audited:
            return ""
        steps, parts = max(self.stop - self.start, 1), []
        for training, who in ((True, "the training thread"), (False, "the data threads")):
            sites = Counter(site for in_training, site in self.waits if in_training == training)
            where = ", ".join(f"{site} x{n}" for site, n in sites.most_common(3))
            parts.append(f"{sum(sites.values()) / steps:.1f} in {who}" + (f" ({where})" if where else ""))
        return f"; host waits a step ({steps} steps): " + ", ".join(parts)


class DeviceBusy(Callback):
    """How busy the GPU was over training steps `start` .. `stop` - 1, from torch's profiler (its
    kernels and copies, CUDA activity only, so the host is not slowed by recording its ops): the
    share of the wall time some stream was running, and the shares of the busiest stream (the
    model's) and of the others (the data path's). Near 100%, the GPU sets the pace and cheaper
    kernels are what helps; well below it, the host does not queue work fast enough. CUDA only.
    A profiler that fails is named in the note; the run goes on."""

    def __init__(self, start: int = 0, stop: int = 0) -> None:
        self.start, self.stop = start, stop
        self.shares: dict[str, float] | None = None
        self.error: str | None = None
        self._profile: Any = None
        self._began = 0

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if trainer.global_step == self.start < self.stop and trainer.strategy.root_device.type == "cuda":
            from torch.profiler import ProfilerActivity, profile

            torch.cuda.synchronize()  # the window starts with nothing queued
            try:
                self._profile = profile(activities=[ProfilerActivity.CUDA])
                self._profile.__enter__()
            except Exception as e:
                self._profile, self.error = None, f"{type(e).__name__}: {e}"[:80]
            self._began = time.perf_counter_ns()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if self._profile is None or trainer.global_step < self.stop:
            return
        torch.cuda.synchronize()
        wall = time.perf_counter_ns() - self._began
        profile, self._profile = self._profile, None
        try:
            profile.__exit__(None, None, None)
            self.shares = busy_shares(spans(profile, "cuda"), wall)
        except Exception as e:
            self.error = f"{type(e).__name__}: {e}"[:80]

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if self._profile is not None:
            self._profile.__exit__(None, None, None)
            self._profile = None

    def summary(self) -> str:
        """The note's words; "" if nothing was measured."""
        if self.error is not None:
            return f"; GPU busy not measured ({self.error})"
        if self.shares is None:
            return ""
        s = self.shares
        return (
            f"; GPU busy {s['any']:.0%} of {self.stop - self.start} steps (its busiest stream {s['busiest']:.0%}, "
            f"the others {s['others']:.0%})"
        )


def spans(profile: Any, device: str) -> list[tuple[int, int, int]]:
    """(stream, start_ns, end_ns) of each of a finished torch.profiler run's events on `device`
    ("cuda": kernels and copies, by stream; "cpu": ops, by thread)."""
    from torch.autograd import DeviceType

    kind = DeviceType.CUDA if device == "cuda" else DeviceType.CPU
    events = profile.profiler.kineto_results.events()
    return [(e.device_resource_id(), e.start_ns(), e.end_ns()) for e in events if e.device_type() == kind]


def busy_shares(intervals: Sequence[tuple[int, int, int]], wall_ns: int) -> dict[str, float]:
    """Shares of `wall_ns` covered by (stream, start_ns, end_ns) intervals: by any stream (`any`),
    by the stream that covers most (`busiest`), and by the other streams together (`others`);
    overlapping intervals count once."""

    def covered(spans: Sequence[tuple[int, int]]) -> int:
        total, reach = 0, None
        for start, end in sorted(spans):
            if reach is None or start > reach:
                total, reach = total + end - start, end
            elif end > reach:
                total, reach = total + end - reach, end
        return total

    streams: dict[int, list[tuple[int, int]]] = {}
    for stream, start, end in intervals:
        streams.setdefault(stream, []).append((start, end))
    busiest = max(streams, key=lambda s: covered(streams[s]), default=None)
    others = [span for s, spans in streams.items() if s != busiest for span in spans]
    wall = max(wall_ns, 1)
    return {
        "any": covered([span for spans in streams.values() for span in spans]) / wall,
        "busiest": covered(streams.get(busiest, [])) / wall,
        "others": covered(others) / wall,
    }


def _site(stack: traceback.StackSummary) -> str:
    """file:line of the innermost frame outside torch and the warnings module."""
    skipped = (str(Path(torch.__file__).parent), warnings.__file__)
    for frame in reversed(stack):
        if not frame.filename.startswith(skipped):
            return f"{Path(frame.filename).name}:{frame.lineno}"
    return "?"


def sync_sites(caught: Sequence[warnings.WarningMessage]) -> list[str]:
    """file:line of each host wait among `caught` warnings. Setting the mode also warns once that
    it is "a prototype feature and does not yet detect all synchronizing operations": not a wait."""
    return [f"{Path(w.filename).name}:{w.lineno}" for w in caught if SYNC_WARNING in str(w.message)]
