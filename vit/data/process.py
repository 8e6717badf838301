"""A loader's batches made in a process of their own (`data.data_process`).

Decoding and augmenting in threads of the training process (vit.data.prefetch) takes the
interpreter's lock from the thread that launches the model's kernels: on one H200 the ImageNet
recipes trained at 67-71% of the model's speed with no step waiting for data (SPDL measured the
same: data threads in a subprocess instead of the trainer, 1.22 -> 3.82 batches/s). Here one
process per loader runs the DataLoader (with its own workers) and the prepare stages, and writes
each finished batch into a ring of buffers shared with the training process once (shared memory on
the CPU, CUDA IPC on a GPU). The training process's work for a batch is reading a short message,
copying the buffer into tensors of its own (so the batch lives as long as the step wants it) and
handing the buffer back once that copy is done.

The order is the loader's sampler's: at each epoch the training process sends the sampler's plain
fields (epoch, resume position, seed, rank), so the process yields the batches (and each image's
augmentation, vit.data.sampling) the loader would have yielded itself. Leaving an epoch early stops
the process's at its next batch; an error there is raised where the batch is taken.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import pickle
import queue
import signal
import traceback
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import torch

log = logging.getLogger(__name__)

POLL = 0.5  # seconds between checks that the other process is alive while waiting on a queue


class DataProcessUnavailable(RuntimeError):
    """The data process cannot serve the training process: it did not start, or its batch buffers
    did not reach the training process. Raised before the first batch is handed out, so its loader
    can make that epoch itself instead."""


def _unavailable(reason: str) -> DataProcessUnavailable:
    return DataProcessUnavailable(f"the data process cannot serve the training process: {reason}")


def _not_started(error: BaseException, cuda: bool) -> DataProcessUnavailable:
    hint = " (it needs a CUDA context of its own, which a GPU in exclusive-process compute mode refuses)"
    return _unavailable(f"it did not start: {type(error).__name__}: {error}{hint if cuda else ''}")


def _not_shared(reason: str) -> DataProcessUnavailable:
    return _unavailable(
        f"its batch buffers could not be shared ({reason}). On a GPU they are shared by CUDA IPC, which "
        "needs both processes to map the same GPU; with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "
        "it also needs ptrace permission between them (pidfd_getfd), which some containers withhold"
    )


def sampler_state(sampler: Any) -> dict[str, Any]:
    """The sampler's plain fields (epoch, resume position, seed, rank, ...): what makes its order,
    without the dataset it holds."""
    return {k: v for k, v in vars(sampler).items() if v is None or isinstance(v, bool | int | float | str)}


class DataProcess:
    """Runs `make_loader()`'s iterations in a child process; `epoch(state)` yields its batches.

    `make_loader` builds, in the child, an iterable whose batches are tuples of tensors with the
    batch first (at most `batch_size` of it) and whose `.sampler` takes `state`. The first batch
    sets the shape of the `ring` buffers; `ring - 1` batches can wait ready while one is taken.
    """

    # How the child starts: None picks spawn on a GPU (CUDA cannot be used in a forked child of a
    # process that has used it) and fork on the CPU (quicker: no new interpreter to import torch).
    start_method: str | None = None

    def __init__(self, make_loader: Callable[[], Any], device: torch.device, ring: int, batch_size: int) -> None:
        if ring < 2:
            raise ValueError(f"a data process needs a ring of at least 2 buffers; got {ring}")
        self.make_loader, self.device, self.ring, self.batch_size = make_loader, device, ring, batch_size
        self.token = 0
        self.slots: list[tuple[torch.Tensor, ...]] | None = None
        self._pending: deque[tuple[int, torch.cuda.Event | None]] = deque()
        self._process: multiprocessing.process.BaseProcess | None = None

    def start(self) -> None:
        if self._process is not None and self._process.is_alive():
            return
        method = self.start_method or ("spawn" if self.device.type == "cuda" else "fork")
        context = torch.multiprocessing.get_context(method)
        self.orders, self.free, self.ready = context.Queue(), context.Queue(), context.Queue()
        for slot in range(self.ring):
            self.free.put(slot)
        self.slots, self._pending = None, deque()
        level = logging.getLogger("vit").getEffectiveLevel()
        args = (self.make_loader, self.device, self.ring, self.batch_size, self.orders, self.free, self.ready, level)
        # Not a daemon: a daemon may not start the loader's worker processes. It exits when this one does.
        self._process = context.Process(target=_serve, args=args, name="vit-data", daemon=False)
        try:  # spawn pickles the loader here
            self._process.start()
        except Exception as e:
            self._process = None
            raise _unavailable(f"its loader could not be sent to it: {type(e).__name__}: {e}") from e
        weakref.finalize(self, _stop, self._process, self.orders)

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def close(self) -> None:
        """Stops the child (it finishes the batch in hand); the next epoch starts another."""
        self.slots = None  # the child's buffers are let go before it ends (CUDA IPC: it owns their memory)
        if self._process is not None:
            _stop(self._process, self.orders)
            self._process = None

    def epoch(self, state: dict[str, Any]) -> Iterator[tuple[tuple[torch.Tensor, ...], list[tuple[float, float]]]]:
        """The batches of one pass of the loader, its sampler set to `state`, each with the (wall,
        CPU) seconds its stages took in the child (vit.data.prefetch.LoaderTimes)."""
        self.start()
        self.token += 1
        token = self.token
        self.orders.put(("epoch", token, state))
        while True:
            message = self._next_message()
            kind, sent_for = message[0], message[1]
            if kind == "not started":
                self.close()
                raise _not_started(message[2], self.device.type == "cuda") from message[2]
            if kind == "ring":  # sent once, with whichever epoch made the first batch
                self.slots = message[2]
                continue
            if sent_for != token:  # a batch of an epoch left early: its buffer goes back
                if kind == "batch":
                    self.free.put(message[2])
                continue
            if kind == "batch":
                if self.slots is None:  # the ring's message was lost on its way: the data process logged why
                    raise _not_shared("its message with the buffers did not arrive")
                _, _, slot, count, times = message
                yield self._take(slot, count), times
            elif kind == "end":
                return
            else:  # "error"
                raise message[2]

    def _take(self, slot: int, count: int) -> tuple[torch.Tensor, ...]:
        """Copies of buffer `slot`'s first `count` rows, queued on this thread's stream; the buffer
        goes back to the child once the copy is done (at once on the CPU)."""
        assert self.slots is not None
        batch = tuple(buffer[:count].clone() for buffer in self.slots[slot])
        self._pending.append((slot, self._copied()))
        self._release()
        return batch

    def _copied(self) -> Any:
        """An event marking the end of the copies just queued (None on the CPU, where they are done)."""
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def _release(self, wait: bool = False) -> None:
        """Hand back the buffers whose copies are done; with `wait`, the oldest one in any case,
        waiting for its copy (the child holds no buffer to write the next batch into)."""
        while self._pending:
            slot, event = self._pending[0]
            if event is not None and not event.query():
                if not wait:
                    return
                event.synchronize()
            self._pending.popleft()
            self.free.put(slot)
            wait = False

    def _next_message(self) -> tuple[Any, ...]:
        assert self._process is not None
        self._release(wait=len(self._pending) >= self.ring)
        while True:
            try:
                return self.ready.get(timeout=POLL)
            except queue.Empty:
                pass
            except Exception as e:  # only the ring's message carries tensors, to be mapped here
                raise _not_shared(f"{type(e).__name__}: {e}") from e
            self._release()  # copies done since: the child may be waiting for a buffer
            if not self._process.is_alive():
                code = self._process.exitcode
                self._process = None
                if self.slots is None:  # before its first batch: the loader can still make the epoch
                    raise _unavailable(f"it exited (exit code {code}) before its first batch")
                raise RuntimeError(f"the data process exited (exit code {code}) before its epoch's last batch")


def _stop(process: multiprocessing.process.BaseProcess, orders: Any) -> None:
    if process.is_alive():
        with contextlib.suppress(Exception):
            orders.put(("stop", 0, None))
        process.join(timeout=10)
    if process.is_alive():
        process.kill()
        process.join()


def _serve(
    make_loader: Callable[[], Any], device: torch.device, ring: int, batch_size: int,
    orders: Any, free: Any, ready: Any, log_level: int,
) -> None:  # fmt: skip
    """The child: runs an epoch of the loader for each order, until told to stop or its parent ends."""
    # Interrupts and SLURM's SIGTERM go to the whole process group: the training process decides.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(format="[vit data process] %(message)s")
    logging.getLogger("vit").setLevel(log_level)
    torch.set_num_threads(1)
    try:
        if device.type == "cuda":
            torch.cuda.set_device(device)
            torch.empty(1, device=device)  # its CUDA context, refused here by an exclusive-process GPU
        loader = make_loader()
    except Exception as e:  # the training process makes its batches itself instead
        ready.put(("not started", 0, _picklable(e)))
        return
    parent = multiprocessing.parent_process()
    server = _Server(loader, device, ring, batch_size, orders, free, ready, parent)
    order = server.wait_for_order()
    while order is not None and order[0] == "epoch":
        order = server.run_epoch(order[1], order[2])
        if order is None:
            order = server.wait_for_order()


class _Server:
    def __init__(self, loader: Any, device: torch.device, ring: int, batch_size: int,
                 orders: Any, free: Any, ready: Any, parent: Any) -> None:  # fmt: skip
        self.loader, self.device, self.ring, self.batch_size = loader, device, ring, batch_size
        self.orders, self.free, self.ready, self.parent = orders, free, ready, parent
        self.slots: list[tuple[torch.Tensor, ...]] | None = None

    def wait_for_order(self) -> tuple[Any, ...] | None:
        """The next order; None once the parent has ended."""
        while self.parent is None or self.parent.is_alive():
            with contextlib.suppress(queue.Empty):
                return self.orders.get(timeout=POLL)
        return None

    def new_order(self) -> tuple[Any, ...] | None:
        with contextlib.suppress(queue.Empty):
            return self.orders.get_nowait()
        return None

    def free_slot(self) -> tuple[int | None, tuple[Any, ...] | None]:
        """(a buffer the parent has handed back, None) or, if an order comes first, (None, it)."""
        while True:
            with contextlib.suppress(queue.Empty):
                return self.free.get(timeout=POLL / 5), None
            order = self.new_order()
            if order is not None:
                return None, order
            if self.parent is not None and not self.parent.is_alive():
                return None, ("stop", 0, None)

    def run_epoch(self, token: int, state: dict[str, Any]) -> tuple[Any, ...] | None:
        """One pass; an order that arrives during it ends the pass early and is returned."""
        vars(self.loader.sampler).update(state)
        try:
            for batch in self.loader:
                slot, order = self.free_slot()
                if order is not None:
                    return order
                count = self._write(slot, token, batch)
                stage = _stage_times(self.loader)
                self.ready.put(("batch", token, slot, count, stage))
                order = self.new_order()
                if order is not None:
                    return order
        except Exception as e:  # raised in the training process where the batch is taken
            self.ready.put(("error", token, _picklable(e)))
            return None
        self.ready.put(("end", token))
        return None

    def _write(self, slot: int, token: int, batch: Any) -> int:
        if not isinstance(batch, tuple | list) or not all(isinstance(t, torch.Tensor) for t in batch):
            raise TypeError(f"a data process hands over tuples of tensors; the loader gave {type(batch).__name__}")
        count = len(batch[0])
        if self.slots is None:
            self.slots = [self._buffers(batch) for _ in range(self.ring)]
            self.ready.put(("ring", token, self.slots))
        for buffer, tensor in zip(self.slots[slot], batch, strict=True):
            if tensor.shape[1:] != buffer.shape[1:] or len(tensor) != count:
                raise ValueError(
                    f"a batch of shape {tuple(tensor.shape)} does not fit the data process's buffers "
                    f"{tuple(buffer.shape)}: each batch needs the first one's shape, at most {self.batch_size} rows"
                )
            buffer[:count].copy_(tensor)
        if self.device.type == "cuda":  # the parent reads the buffer once it hears of it
            torch.cuda.current_stream(self.device).synchronize()
        return count

    def _buffers(self, batch: Any) -> tuple[torch.Tensor, ...]:
        buffers = []
        for tensor in batch:
            buffer = torch.empty((self.batch_size, *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
            buffers.append(buffer if buffer.is_cuda else buffer.share_memory_())
        return tuple(buffers)


def _stage_times(loader: Any) -> list[tuple[float, float]]:
    """(wall, CPU) seconds of each stage for the batch just made (vit.data.prefetch.LoaderTimes of
    the epoch, set when its iteration began)."""
    times = getattr(loader, "times", None)
    if times is None:
        return []
    return [(wall[-1], cpu[-1]) for wall, cpu in zip(times.prepared, times.prepared_cpu, strict=True) if wall]


def _picklable(error: BaseException) -> BaseException:
    """`error` with the child's traceback as a note, or a RuntimeError saying it if it does not pickle."""
    text = "".join(traceback.format_exception(error))
    try:
        error.add_note(f"raised in the data process:\n{text}")
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(f"in the data process: {type(error).__name__}: {error}\n{text}")
