"""Batches made ready on the training device ahead of the step that takes them.

With `data.pipeline device` the training process itself decodes and augments each batch
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

from vit.data.process import DataProcess, DataProcessUnavailable, SamplerState

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
    """A DataLoader whose batches pass through `prepare(batch, device)` before they are handed out.
    `prepare` may be a sequence of stages, each taking the last one's output. Who runs them is
    chosen when an epoch starts, before its first batch:

    - `InTrainingProcess`: in the caller's thread when each batch is drawn (`ahead` 0), or a thread
      a stage, up to `ahead` batches early (None: 1 on CUDA, 0 on the CPU, where the threads only
      compete with the model for the same cores);
    - `InDataProcess` (`process`): a process of its own (vit.data.process). If it cannot serve
      this process (it did not start, its buffers cannot be shared), the training process makes
      that epoch's batches and every later one's: the same batches, as the loader's sampler starts
      its epoch only once the data process has sent the first.

    `device()` names the device, read when an epoch starts. An exception in `prepare` (a file that
    does not decode) is raised where the batch is drawn. Leaving an epoch early (max_steps, an
    interruption) stops its threads before the next begins.
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
        self.device, self.ahead = device, ahead
        self.times = LoaderTimes()
        self.in_process = InTrainingProcess(self.stages)
        self.data_process = InDataProcess() if process else None

    @property
    def _data_process(self) -> DataProcess | None:
        """The running data process, if any."""
        return self.data_process.process if self.data_process is not None else None

    def __iter__(self) -> Iterator[Any]:
        self.in_process.stop()  # the last epoch's threads, if it was left early
        if not self.stages:
            return super().__iter__()
        stages = len(self.stages)
        self.times = LoaderTimes([[] for _ in range(stages)], [[] for _ in range(stages)])
        device = torch.device(self.device() if self.device is not None else "cpu")
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        ahead = self.ahead if self.ahead is not None else int(device.type == "cuda")
        if self.data_process is not None and self.data_process.serves:
            return self._from_process(device, ahead)
        return self.in_process.epoch(super().__iter__(), device, ahead, self.times)

    def _in_child(self, device: torch.device) -> Callable[[], PreparedLoader]:
        """This loader as the data process makes it: the same batches, prepared in its own threads."""
        return partial(
            PreparedLoader, self.dataset, batch_size=self.batch_size, drop_last=self.drop_last,
            sampler=self.sampler, num_workers=self.num_workers, collate_fn=self.collate_fn,
            pin_memory=self.pin_memory, persistent_workers=self.persistent_workers,
            prefetch_factor=self.prefetch_factor, worker_init_fn=self.worker_init_fn, prepare=self.stages,
            device=partial(torch.device, str(device)), ahead=self.ahead,
        )  # fmt: skip

    def _from_process(self, device: torch.device, ahead: int) -> Iterator[Any]:
        """The data process's batches; the training process's own if it cannot serve (said once)."""
        assert self.data_process is not None
        state = SamplerState.of(self.sampler)
        make = self._in_child(device)
        batches = self.data_process.epoch(make, device, ahead, self.batch_size or 1, state, self.times)
        try:
            first = next(batches, _DONE)
        except DataProcessUnavailable as e:
            log.warning("%s: this loader makes its batches in the training process instead "
                        "(data.data_process false), as fast on the CPU, slower on a GPU", e)  # fmt: skip
            yield from self.in_process.epoch(DataLoader.__iter__(self), device, ahead, self.times)
            return
        if hasattr(self.sampler, "begin_epoch"):  # the child's sampler started the epoch: this one moves on with it
            self.sampler.begin_epoch()
        if first is _DONE:
            return
        yield first
        yield from batches

    def close(self) -> None:
        """Stops this loader's threads and its data process, if running."""
        self.in_process.stop()
        if self.data_process is not None:
            self.data_process.close()


class InDataProcess:
    """A loader's batches made by a data process (vit.data.process); `serves` turns false for good
    when the process cannot serve this one."""

    def __init__(self) -> None:
        self.process: DataProcess | None = None
        self.serves = True

    def epoch(
        self,
        make: Callable[[], Any],
        device: torch.device,
        ahead: int,
        batch_size: int,
        state: SamplerState | None,
        times: LoaderTimes,
    ) -> Iterator[Any]:
        """One pass of the loader `make()` builds in the child, its sampler set to `state`: `ahead` + 1
        batches ready at most (at least 1), while the training step has the last one.
        DataProcessUnavailable, before the first batch, if the process cannot serve this one."""
        if self.process is None or self.process.device != device:
            self.close()
            self.process = DataProcess(make, device, ring=max(1, ahead) + 2, batch_size=batch_size)
        batches = self.process.epoch(state)
        while True:
            asked = time.perf_counter()
            try:
                item = next(batches, _DONE)
            except DataProcessUnavailable:
                self.close()
                self.serves = False
                raise
            if item is _DONE:
                return
            batch, stage_times = item
            times.waited.append(time.perf_counter() - asked)
            for k, (wall, cpu) in enumerate(stage_times):
                times.prepared[k].append(wall)
                times.prepared_cpu[k].append(cpu)
            yield batch

    def close(self) -> None:
        if self.process is not None:
            self.process.close()
            self.process = None


class InTrainingProcess:
    """The stages run in the training process, on CUDA streams of their own: each batch in the
    caller's thread when it is drawn (`ahead` 0), or a thread a stage, the last up to `ahead`
    batches early, one batch waiting between two."""

    def __init__(self, stages: list[Stage]) -> None:
        self.stages = stages
        self._stop_running: Callable[[], None] | None = None

    def stop(self) -> None:
        """Stops the last epoch's threads, if it was left early."""
        if self._stop_running is not None:
            self._stop_running()

    def epoch(self, batches: Iterator[Any], device: torch.device, ahead: int, times: LoaderTimes) -> Iterator[Any]:
        if ahead <= 0:
            return self._on_demand(batches, device, times)
        return self._ahead(batches, device, ahead, times)

    def _on_demand(self, batches: Iterator[Any], device: torch.device, times: LoaderTimes) -> Iterator[Any]:
        stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        while True:
            asked = time.perf_counter()
            batch = next(batches, _DONE)
            if batch is _DONE:
                return
            item = (batch, None)
            for k in range(len(self.stages)):
                item = self._prepared(k, item, device, stream, times)
            times.waited.append(time.perf_counter() - asked)
            yield _hand_over(*item, device)

    def _prepared(
        self, k: int, item: tuple[Any, Any], device: torch.device, stream: Any, times: LoaderTimes
    ) -> tuple[Any, Any]:
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
        times.prepared[k].append(time.perf_counter() - start)
        times.prepared_cpu[k].append(time.thread_time() - cpu)
        return out, event

    def _ahead(self, batches: Iterator[Any], device: torch.device, ahead: int, times: LoaderTimes) -> Iterator[Any]:
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
                        if stop.is_set() or not put(k, self._prepared(k, item, device, stream, times)):
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
        return self._hand_out(queues[last], stop, stop_running, device, times)

    def _hand_out(
        self,
        ready: queue.Queue,
        stop: threading.Event,
        stop_running: Callable[[], None],
        device: torch.device,
        times: LoaderTimes,
    ) -> Iterator[Any]:
        try:
            while True:
                asked = time.perf_counter()
                item = _get(ready, stop)
                if item is _DONE and stop.is_set():
                    raise RuntimeError("this epoch's batches were stopped: a later iter(loader) began another epoch")
                if item is _DONE:
                    return
                times.waited.append(time.perf_counter() - asked)
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
