"""Batches made ready on the training device ahead of the step that takes them.

With `data.device_decode` the training process itself decodes and augments each batch
(vit.data.device). Done on the model's stream when the step asks for the batch, the two take
turns: every host sync in the data work (the decoder makes several) first waits for the model's
queued kernels, and the model waits for the data. A `PreparedLoader` queues that work on a CUDA
stream of its own and, on a GPU, runs it in a thread `ahead` batches before the batch is wanted,
so the next batch is decoded while the model trains on this one (as timm's PrefetchLoader and
DALI's pipelines overlap theirs). The batches are the same either way: each image's augmentation
comes from the loader (vit.data.sampling), not from when it is applied.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch.utils.data import DataLoader

_DONE = object()


@dataclass
class LoaderTimes:
    """Seconds, per batch of the current epoch: `prepared`, wall time in `prepare`; `prepared_cpu`,
    the CPU time of the thread preparing it over that span (the rest it waited: for the device, or
    for the interpreter's lock while another thread ran Python); `waited`, how long the consumer
    (the training step) waited for the batch once it asked (0 when it was ready). What the data
    check reports to say whether the data path or its sharing of the process limits a run."""

    prepared: list[float] = field(default_factory=list)
    prepared_cpu: list[float] = field(default_factory=list)
    waited: list[float] = field(default_factory=list)


class PreparedLoader(DataLoader):
    """A DataLoader whose batches pass through `prepare(batch, device)` before they are handed out:
    in a thread, up to `ahead` batches early (0: in the caller's thread, when each is drawn; None:
    1 on CUDA, 0 on the CPU, where the thread only competes with the model for the same cores).
    `device()` names the device, read when an epoch's iteration starts.

    An exception in `prepare` (a file that does not decode) is raised where the batch is drawn.
    Leaving an epoch early (max_steps, an interruption) stops the thread before the next begins.
    """

    def __init__(
        self,
        dataset: Any,
        *args: Any,
        prepare: Callable[[Any, torch.device], Any] | None = None,
        device: Callable[[], torch.device] | None = None,
        ahead: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(dataset, *args, **kwargs)
        self.prepare, self.device, self.ahead = prepare, device, ahead
        self.times = LoaderTimes()
        self._stop_running: Callable[[], None] | None = None

    def __iter__(self) -> Iterator[Any]:
        if self._stop_running is not None:  # the last epoch's thread, if it was left early
            self._stop_running()
        batches = super().__iter__()
        if self.prepare is None:
            return batches
        self.times = LoaderTimes()
        device = torch.device(self.device() if self.device is not None else "cpu")
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        ahead = self.ahead if self.ahead is not None else int(device.type == "cuda")
        if ahead <= 0:
            return self._on_demand(batches, device, stream)
        return self._ahead(batches, device, stream, ahead)

    def _on_demand(self, batches: Iterator[Any], device: torch.device, stream: Any) -> Iterator[Any]:
        while True:
            asked = time.perf_counter()
            batch = next(batches, _DONE)
            if batch is _DONE:
                return
            prepared = self._prepared(batch, device, stream)
            self.times.waited.append(time.perf_counter() - asked)
            yield _hand_over(*prepared, device)

    def _prepared(self, batch: Any, device: torch.device, stream: Any) -> tuple[Any, Any]:
        """`prepare(batch)` and, on CUDA, an event marking its end on `stream`: the work is queued
        there, not on the stream the model's kernels are queued on, so a host sync inside it (the
        decoder's) waits for the data work only."""
        start, cpu = time.perf_counter(), time.thread_time()
        if stream is None:
            out, event = self.prepare(batch, device), None  # type: ignore[misc]
        else:
            with torch.cuda.stream(stream):
                out = self.prepare(batch, device)  # type: ignore[misc]
                event = torch.cuda.Event()
                event.record(stream)
        self.times.prepared.append(time.perf_counter() - start)
        self.times.prepared_cpu.append(time.thread_time() - cpu)
        return out, event

    def _ahead(self, batches: Iterator[Any], device: torch.device, stream: Any, ahead: int) -> Iterator[Any]:
        ready: queue.Queue = queue.Queue(maxsize=ahead)
        stop = threading.Event()

        def put(item: Any) -> bool:
            while not stop.is_set():
                with contextlib.suppress(queue.Full):
                    ready.put(item, timeout=0.1)
                    return True
            return False

        def work() -> None:
            try:
                if device.type == "cuda":
                    torch.cuda.set_device(device)  # a new thread starts on device 0
                with torch.no_grad():
                    for batch in batches:
                        if stop.is_set() or not put(self._prepared(batch, device, stream)):
                            return
            except BaseException as e:  # raised in the consumer's thread, at this batch
                put(e)
                return
            put(_DONE)

        thread = threading.Thread(target=work, name="vit-prepare-batches", daemon=True)

        def stop_running() -> None:
            stop.set()
            thread.join()
            if self._stop_running is stop_running:  # not a later epoch's
                self._stop_running = None

        self._stop_running = stop_running
        thread.start()
        return self._hand_out(ready, stop_running, device)

    def _hand_out(self, ready: queue.Queue, stop_running: Callable[[], None], device: torch.device) -> Iterator[Any]:
        try:
            while True:
                asked = time.perf_counter()
                item = ready.get()
                if item is _DONE:
                    return
                self.times.waited.append(time.perf_counter() - asked)
                if isinstance(item, BaseException):
                    raise item
                yield _hand_over(*item, device)
        finally:
            stop_running()


def _hand_over(out: Any, event: Any, device: torch.device) -> Any:
    """A batch prepared on its own stream, made safe to use on the caller's: the caller's stream
    waits for it, and its memory is not reused until the caller's work queued on it is done."""
    if event is not None:
        current = torch.cuda.current_stream(device)
        current.wait_event(event)
        apply_to_collection(out, torch.Tensor, lambda tensor: tensor.record_stream(current))
    return out
