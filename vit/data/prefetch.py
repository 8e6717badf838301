"""Batches made ready on the training device ahead of the step that takes them.

With `data.device_decode` the training process itself decodes and augments each batch
(vit.data.device). Done on the model's stream when the step asks for the batch, the two take
turns: every host sync in the data work (the decoder makes several) first waits for the model's
queued kernels, and the model waits for the data. A `PreparedLoader` queues that work on CUDA
streams of its own and, on a GPU, runs it in threads `ahead` batches before the batch is wanted,
so the next batch is decoded while the model trains on this one (as timm's PrefetchLoader and
DALI's pipelines overlap theirs). Its work may come in stages (decoding, then augmenting), each in
a thread of its own: while one batch's decode waits on the device, the last one is augmented. The
batches are the same either way: each image's augmentation comes from the loader
(vit.data.sampling), not from when it is applied.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch.utils.data import DataLoader

from vit.data.process import DataProcess, DataProcessUnavailable, sampler_state

log = logging.getLogger(__name__)

_DONE = object()
Stage = Callable[[Any, torch.device], Any]


@dataclass
class LoaderTimes:
    """Seconds, per batch of the current epoch: `prepared[k]`, wall time in stage k of `prepare`;
    `prepared_cpu[k]`, the CPU time of the thread running it over that span (the rest it waited for
    the interpreter's lock while another thread ran Python, or slept on the device; a wait that
    spins on the device, as CUDA's do with cores to spare, counts as CPU); `waited`, how
    long the consumer (the training step) waited for the batch once it asked (0 when it was ready).
    What the data check reports to say whether the data path or its sharing of the process limits
    a run."""

    prepared: list[list[float]] = field(default_factory=list)
    prepared_cpu: list[list[float]] = field(default_factory=list)
    waited: list[float] = field(default_factory=list)


class PreparedLoader(DataLoader):
    """A DataLoader whose batches pass through `prepare(batch, device)` before they are handed out:
    in threads, up to `ahead` batches early (0: in the caller's thread, when each is drawn; None:
    1 on CUDA, 0 on the CPU, where the threads only compete with the model for the same cores).
    `prepare` may be a sequence of stages, each taking the last one's output: a thread each, one
    batch waiting between two. `device()` names the device, read when an epoch's iteration starts.

    An exception in `prepare` (a file that does not decode) is raised where the batch is drawn.
    Leaving an epoch early (max_steps, an interruption) stops the threads before the next begins.
    """

    def __init__(
        self,
        dataset: Any,
        *args: Any,
        prepare: Stage | Sequence[Stage] | None = None,
        device: Callable[[], torch.device] | None = None,
        ahead: int | None = None,
        process: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(dataset, *args, **kwargs)
        self.stages: list[Stage] = [] if prepare is None else [prepare] if callable(prepare) else list(prepare)
        self.device, self.ahead, self.process = device, ahead, process
        self.times = LoaderTimes()
        self._stop_running: Callable[[], None] | None = None
        self._data_process: DataProcess | None = None

    def __iter__(self) -> Iterator[Any]:
        if self._stop_running is not None:  # the last epoch's threads, if it was left early
            self._stop_running()
        if not self.stages:
            return super().__iter__()
        stages = len(self.stages)
        self.times = LoaderTimes([[] for _ in range(stages)], [[] for _ in range(stages)])
        device = torch.device(self.device() if self.device is not None else "cpu")
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        ahead = self.ahead if self.ahead is not None else int(device.type == "cuda")
        if self.process:
            return self._from_process(device, ahead)
        batches = super().__iter__()
        if ahead <= 0:
            return self._on_demand(batches, device)
        return self._ahead(batches, device, ahead)

    def _from_process(self, device: torch.device, ahead: int) -> Iterator[Any]:
        """The batches made by this loader's data process (vit.data.process): `ahead` + 1 of them
        ready at most (at least 1), while the training step has the last one."""
        if self._data_process is None or self._data_process.device != device:
            if self._data_process is not None:
                self._data_process.close()
            make = partial(
                PreparedLoader, self.dataset, batch_size=self.batch_size, drop_last=self.drop_last,
                sampler=self.sampler, num_workers=self.num_workers, collate_fn=self.collate_fn,
                pin_memory=self.pin_memory, persistent_workers=self.persistent_workers,
                prefetch_factor=self.prefetch_factor, worker_init_fn=self.worker_init_fn, prepare=self.stages,
                device=partial(torch.device, str(device)), ahead=self.ahead,
            )  # fmt: skip
            self._data_process = DataProcess(make, device, ring=max(1, ahead) + 2, batch_size=self.batch_size or 1)
        state = sampler_state(self.sampler)
        if hasattr(self.sampler, "begin_epoch"):  # the child's sampler starts the epoch: this one moves on with it
            self.sampler.begin_epoch()
        return self._taken(self._data_process.epoch(state), state)

    def close(self) -> None:
        """Stops this loader's threads and its data process, if running."""
        if self._stop_running is not None:
            self._stop_running()
        if self._data_process is not None:
            self._data_process.close()
            self._data_process = None

    def _taken(self, batches: Iterator[Any], state: dict[str, Any]) -> Iterator[Any]:
        """The data process's batches; if it cannot serve this process (it did not start, or its
        buffers cannot reach this process), the loader makes them itself from then on (the same
        batches: the sampler's `state` from before the epoch)."""
        handed_out = False
        while True:
            asked = time.perf_counter()
            try:
                item = next(batches, _DONE)
            except DataProcessUnavailable as e:
                if handed_out:
                    raise
                log.warning("%s: this loader makes its batches in the training process instead "
                            "(data.data_process false), as fast on the CPU, slower on a GPU", e)  # fmt: skip
                self.close()
                self.process = False
                vars(self.sampler).update(state)
                yield from iter(self)
                return
            if item is _DONE:
                return
            handed_out = True
            batch, stage_times = item
            self.times.waited.append(time.perf_counter() - asked)
            for k, (wall, cpu) in enumerate(stage_times):
                self.times.prepared[k].append(wall)
                self.times.prepared_cpu[k].append(cpu)
            yield batch

    def _on_demand(self, batches: Iterator[Any], device: torch.device) -> Iterator[Any]:
        stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        while True:
            asked = time.perf_counter()
            batch = next(batches, _DONE)
            if batch is _DONE:
                return
            item = (batch, None)
            for k in range(len(self.stages)):
                item = self._prepared(k, item, device, stream)
            self.times.waited.append(time.perf_counter() - asked)
            yield _hand_over(*item, device)

    def _prepared(self, k: int, item: tuple[Any, Any], device: torch.device, stream: Any) -> tuple[Any, Any]:
        """Stage k on `item` (the last stage's output and, on CUDA, the event marking its end) and,
        on CUDA, an event marking this stage's end on `stream`: the work is queued there, not on the
        stream the model's kernels are queued on, so a host sync inside it (the decoder's) waits
        for the data work only."""
        start, cpu = time.perf_counter(), time.thread_time()
        if stream is None:
            out, event = self.stages[k](item[0], device), None
        else:
            with torch.cuda.stream(stream):
                out = self.stages[k](_hand_over(*item, device), device)
                event = torch.cuda.Event()
                event.record(stream)
        self.times.prepared[k].append(time.perf_counter() - start)
        self.times.prepared_cpu[k].append(time.thread_time() - cpu)
        return out, event

    def _ahead(self, batches: Iterator[Any], device: torch.device, ahead: int) -> Iterator[Any]:
        stop = threading.Event()
        last = len(self.stages) - 1
        queues: list[queue.Queue] = [queue.Queue(maxsize=ahead if k == last else 1) for k in range(last + 1)]

        def put(k: int, item: Any) -> bool:
            while not stop.is_set():
                with contextlib.suppress(queue.Full):
                    queues[k].put(item, timeout=0.1)
                    return True
            return False

        def taken(k: int) -> Iterator[Any]:
            """What stage k - 1 hands over, until it is done or the epoch is stopped."""
            while (item := _get(queues[k - 1], stop)) is not _DONE:
                yield item

        def work(k: int) -> None:
            try:
                if device.type == "cuda":
                    torch.cuda.set_device(device)  # a new thread starts on device 0
                stream = torch.cuda.Stream(device) if device.type == "cuda" else None
                with torch.no_grad():
                    for item in ((batch, None) for batch in batches) if k == 0 else taken(k):
                        if isinstance(item, BaseException):  # an earlier stage's: passed on to the consumer
                            put(k, item)
                            return
                        if stop.is_set() or not put(k, self._prepared(k, item, device, stream)):
                            return
            except BaseException as e:  # raised in the consumer's thread, at this batch
                put(k, e)
                return
            put(k, _DONE)

        threads = [threading.Thread(target=work, args=(k,), name="vit-prepare-batches", daemon=True) for k in
                   range(last + 1)]  # fmt: skip

        def stop_running() -> None:
            stop.set()
            for thread in threads:
                thread.join()
            if self._stop_running is stop_running:  # not a later epoch's
                self._stop_running = None

        self._stop_running = stop_running
        for thread in threads:
            thread.start()
        return self._hand_out(queues[last], stop, stop_running, device)

    def _hand_out(
        self, ready: queue.Queue, stop: threading.Event, stop_running: Callable[[], None], device: torch.device
    ) -> Iterator[Any]:
        try:
            while True:
                asked = time.perf_counter()
                item = _get(ready, stop)
                if item is _DONE and stop.is_set():
                    raise RuntimeError("this epoch's batches were stopped: a later iter(loader) began another epoch")
                if item is _DONE:
                    return
                self.times.waited.append(time.perf_counter() - asked)
                if isinstance(item, BaseException):
                    raise item
                yield _hand_over(*item, device)
        finally:
            stop_running()


def _get(ready: queue.Queue, stop: threading.Event) -> Any:
    """The next item of `ready`; _DONE once `stop` is set with nothing there."""
    while not stop.is_set():
        with contextlib.suppress(queue.Empty):
            return ready.get(timeout=0.1)
    return _DONE


def _hand_over(out: Any, event: Any, device: torch.device) -> Any:
    """A batch prepared on another stream, made safe to use on the caller's: the caller's stream
    waits for it, and its device memory is not reused until the caller's work queued on it is done."""
    if event is not None:
        current = torch.cuda.current_stream(device)
        current.wait_event(event)
        apply_to_collection(out, torch.Tensor, lambda tensor: tensor.record_stream(current) if tensor.is_cuda else None)
    return out
