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

The order is the loader's sampler's: at each epoch the training process sends where the sampler's
order stands (`SamplerState`: epoch, seed, resume position), so the process yields the batches (and each image's
augmentation, vit.data.sampling) the loader would have yielded itself. Leaving an epoch early stops
the process's at its next batch; an error there is raised where the batch is taken.

The training process watches it: a batch that does not come in time (STALL_*), a process or loader
worker that dies, or a stop signal during the wait (`waits_end_when`) ends the wait with an error
naming which process and what happened, and the process is killed with its loader workers (its
own process group), whatever state it is in.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import pickle
import queue
import re
import signal
import time
import traceback
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger(__name__)

POLL = 0.5  # seconds between checks that the other process is alive while waiting on a queue

# How long the training process waits for a batch before it takes the data process for stopped or
# hung, in seconds: once an epoch runs, STALL_MARGIN times the slowest batch waited for so far and at
# least STALL_FLOOR (a slow disk, a busy machine: a minute is far past any batch, yet a stall is found
# soon); the first batch of an epoch also waits for the process and its loader workers to start
# (spawned: a new interpreter imports torch and makes a CUDA context; a streaming dataset fetches its
# first chunks), so STALL_START. Tests lower them.
STALL_FLOOR = 60.0
STALL_MARGIN = 10.0
STALL_START = 600.0
STOP_WAIT = 10.0  # seconds a data process asked to stop may take to finish its batch before it is killed

_stop_checks: list[Callable[[], BaseException | None]] = []  # see waits_end_when


class DataProcessUnavailable(RuntimeError):
    """The data process cannot serve the training process: it did not start, or its batch buffers
    did not reach the training process. Raised before the first batch is handed out, so its loader
    can make that epoch itself instead."""


class DataProcessFailed(RuntimeError):
    """During an epoch the data process, or a loader worker of it, died, or sent no batch in time
    (it is killed then): the epoch cannot go on. The message names the process and what happened."""


@contextlib.contextmanager
def waits_end_when(stopping: Callable[[], BaseException | None]) -> Iterator[None]:
    """While in it, a wait for a data process's batch checks `stopping()` every POLL seconds and
    raises what it returns: a run's stop signal must end the run even if the batch never comes."""
    _stop_checks.append(stopping)
    try:
        yield
    finally:
        _stop_checks.remove(stopping)


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


@dataclass(frozen=True)
class SamplerState:
    """Where a resumable sampler's order stands (vit.data.sampling.ResumableSampler): what the data
    process's copy of the sampler, made with the loader, takes at each epoch. Its rank, process
    count and dataset do not change during a run; these do (Lightning's `set_epoch`, a resume)."""

    epoch: int
    seed: int
    resume_epoch: int
    resume_position: int

    @classmethod
    def of(cls, sampler: Any) -> SamplerState | None:
        """The state of `sampler`; None for one whose order is fixed (evaluation's, in order)."""
        if not hasattr(sampler, "resume_position"):
            return None
        return cls(sampler.epoch, sampler.seed, sampler.resume_epoch, sampler.resume_position)

    def apply(self, sampler: Any) -> None:
        sampler.epoch, sampler.seed = self.epoch, self.seed
        sampler.resume_epoch, sampler.resume_position = self.resume_epoch, self.resume_position


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
        self.slowest = 0.0  # seconds, the longest wait for a batch other than an epoch's first
        self._waited = 0.0  # seconds the batch asked for has been waited for, over the messages before it
        self._pending: deque[tuple[int, torch.cuda.Event | None]] = deque()
        self._process: multiprocessing.process.BaseProcess | None = None
        self._finalizer: weakref.finalize | None = None

    def start(self) -> None:
        """Starts the child if none runs; one that died since the last epoch raises DataProcessFailed."""
        if self._process is not None:
            if self._process.is_alive():
                return
            pid, code = self._process.pid, self._process.exitcode
            self._end()  # its loader workers too
            raise DataProcessFailed(f"{_ended(f'the data process (pid {pid})', code)} between epochs")
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
        with contextlib.suppress(OSError):  # a group of its own (_serve); a spawned child sets it itself
            os.setpgid(self._process.pid, self._process.pid)
        self._finalizer = weakref.finalize(self, _stop, self._process, self.orders)

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def close(self) -> None:
        """Stops the child (it finishes the batch in hand); the next epoch starts another."""
        self._let_go()
        if self._process is not None:
            assert self._finalizer is not None
            self._finalizer()
            self._process = None

    def _end(self) -> None:
        """Kills the child and its loader workers at once (it may be stopped or hung); the next epoch
        starts another."""
        self._let_go()
        if self._process is not None:
            assert self._finalizer is not None
            self._finalizer.detach()
            _kill(self._process)
            self._process = None

    def epoch(self, state: SamplerState | None) -> Iterator[tuple[tuple[torch.Tensor, ...], list[tuple[float, float]]]]:
        """The batches of one pass of the loader, its sampler set to `state`, each with the (wall,
        CPU) seconds its stages took in the child (vit.data.prefetch.LoaderTimes)."""
        self.start()
        self.token += 1
        token = self.token
        self.orders.put(("epoch", token, state))
        first, self._waited = True, 0.0
        while True:
            try:
                message = self._next_message(first)
            except BaseException:  # a stop, Ctrl-C, the child dead or late: it is killed, not asked
                self._end()
                raise
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
                if not first:
                    self.slowest = max(self.slowest, self._waited)
                first, self._waited = False, 0.0
                yield self._take(slot, count), times
            elif kind == "end":
                return
            else:  # "error"
                if isinstance(message[2], DataProcessFailed):  # a loader worker lost: its loader cannot go on
                    self._end()
                raise message[2]

    def _let_go(self) -> None:
        """Lets go of the child's buffers before it ends (CUDA IPC: it owns their memory), once the
        copies out of them queued here are done."""
        for _, event in self._pending:
            if event is not None:
                event.synchronize()
        self._pending.clear()
        self.slots = None

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

    def _next_message(self, first: bool) -> tuple[Any, ...]:
        """The child's next message. Raises instead when a stop comes (`waits_end_when`), the child
        ends, or the batch (`first` of its epoch or not) has been waited for past its limit."""
        assert self._process is not None
        self._release(wait=len(self._pending) >= self.ring)
        while True:
            began = time.monotonic()
            try:
                message = self.ready.get(timeout=POLL)
            except queue.Empty:
                message = None
            except Exception as e:  # only the ring's message carries tensors, to be mapped here
                raise _not_shared(f"{type(e).__name__}: {e}") from e
            for stopping in _stop_checks:
                if (error := stopping()) is not None:
                    raise error
            if message is not None:
                return message
            # A slice far longer than POLL: this process was suspended (Ctrl-Z), not the child late.
            self._waited += min(time.monotonic() - began, 2 * POLL)
            self._release()  # copies done since: the child may be waiting for a buffer
            pid, code = self._process.pid, self._process.exitcode
            if code is not None:
                if self.slots is None:  # before its first batch: the loader can still make the epoch
                    raise _unavailable(f"it exited (exit code {code}) before its first batch")
                raise DataProcessFailed(_ended(f"the data process (pid {pid})", code))
            limit = STALL_START if first else max(STALL_FLOOR, STALL_MARGIN * self.slowest)
            if self._waited > limit:
                why = f"(the first of an epoch, allowed {limit:.0f} s)" if first else (
                    f"(the slowest so far took {self.slowest:.1f} s)")  # fmt: skip
                raise DataProcessFailed(f"the data process (pid {pid}) sent no batch for {self._waited:.0f} s {why}")


def _ended(who: str, code: int) -> str:
    """How a process ended, from its exit code (minus the signal that killed it)."""
    if code >= 0:
        return f"{who} exited with code {code}"
    hint = " (by the kernel's OOM killer?)" if -code == signal.SIGKILL else ""
    return f"{who} was killed by {_signal_name(-code)}{hint}"


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _stop(process: multiprocessing.process.BaseProcess, orders: Any) -> None:
    """Asks the child to stop (it finishes the batch in hand), and kills it if it has not in STOP_WAIT
    s, or at once if it is stopped (SIGSTOP): it would answer nothing."""
    if process.exitcode is None and not _stopped(process.pid):
        with contextlib.suppress(Exception):
            orders.put(("stop", 0, None))
        process.join(timeout=STOP_WAIT)
    if process.exitcode is None:
        _kill(process)


def _stopped(pid: int) -> bool:
    """Whether process `pid` is stopped, from its state in /proc (Linux; elsewhere False)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def _kill(process: multiprocessing.process.BaseProcess) -> None:
    """SIGKILL to the child and its loader workers, its process group: a stopped process ends on
    nothing else, and workers left behind would go on until they notice their parent gone."""
    with contextlib.suppress(OSError):  # no group yet (spawned, not started), or none left
        os.killpg(process.pid, signal.SIGKILL)
    process.kill()
    process.join()


def _serve(
    make_loader: Callable[[], Any], device: torch.device, ring: int, batch_size: int,
    orders: Any, free: Any, ready: Any, log_level: int,
) -> None:  # fmt: skip
    """The child: runs an epoch of the loader for each order, until told to stop or its parent ends."""
    # A group of its own, with its loader workers: Ctrl-C and a SIGTERM to the run's group reach the
    # training process only, which decides (torch's workers die on a SIGTERM not from their parent),
    # and killing the group ends the workers too. A signal to each process (SLURM's) is ignored here.
    os.setpgid(0, 0)
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
        self.lost: BaseException | None = None  # a loader worker lost between epochs, said at the next
        self.death: BaseException | None = None  # what torch's SIGCHLD handler raised, held (_hold_deaths)

    def wait_for_order(self) -> tuple[Any, ...] | None:
        """The next order; None once the parent has ended."""
        while self.parent is None or self.parent.is_alive():
            try:
                return self.orders.get(timeout=POLL)
            except queue.Empty:
                pass
            except Exception as e:  # torch's SIGCHLD handler raised before _hold_deaths wrapped it
                self.lost = _reported(e)
            finally:
                if self.death is not None and self.lost is None:
                    self.lost, self.death = _reported(self.death), None
        return None

    def _hold_deaths(self) -> None:
        """Wraps the SIGCHLD handler torch installs with a loader's first workers so that what it
        raises is held, not raised: raised wherever this process is, it could land inside the except
        clause reporting the same death and escape as a second traceback. The loader itself raises
        the death within its status check (5 s), and the held error, naming the signal, is said."""
        handler = signal.getsignal(signal.SIGCHLD)
        if not callable(handler) or getattr(handler, "held_by", None) is self:
            return

        def held(signum: int, frame: Any) -> None:
            try:
                handler(signum, frame)
            except Exception as e:
                self.death = self.death or e

        held.held_by = self  # type: ignore[attr-defined]
        signal.signal(signal.SIGCHLD, held)

    def _await_death(self, seconds: float = 1.0) -> None:
        """Asks torch's (held) SIGCHLD handler for up to `seconds` whether a loader worker died: one
        killed while it sends a batch breaks the pipe (ConnectionResetError) before it is a zombie
        that the loader or the handler can see, and the error alone would not name it."""
        handler = signal.getsignal(signal.SIGCHLD)
        if getattr(handler, "held_by", None) is not self:
            return
        end = time.monotonic() + seconds
        while self.death is None and time.monotonic() < end:
            handler(signal.SIGCHLD, None)  # type: ignore[operator]
            time.sleep(0.05)

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

    def run_epoch(self, token: int, state: SamplerState | None) -> tuple[Any, ...] | None:
        """One pass; an order that arrives during it ends the pass early and is returned."""
        if self.lost is not None:  # its loader cannot make the pass
            self.ready.put(("error", token, self.lost))
            return None
        if state is not None:
            state.apply(self.loader.sampler)
        try:
            for batch in self.loader:
                self._hold_deaths()  # the loader's workers, and torch's handler, are there by its first batch
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
            if isinstance(e, ConnectionError | EOFError) and self.death is None:
                self._await_death()
            error = _reported(e)
            if self.death is not None:  # torch's handler has said the same death, naming the signal
                error, self.death = _reported(self.death), None
            self.ready.put(("error", token, error))
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


# How torch says that a loader worker died (raised from its SIGCHLD handler, or when its queue times out).
_WORKER_KILLED = re.compile(r"DataLoader worker \(pid (\d+)\) is killed by signal: ([^.]+)\.")
_WORKER_EXITED = re.compile(
    r"DataLoader worker \(pid(?:\(s\))? ([\d, ]+)\) exited unexpectedly(?: with exit code (\d+))?"
)
_SIGNALS_BY_TEXT = {signal.strsignal(s): s for s in signal.Signals}


def _reported(error: BaseException) -> BaseException:
    """What the training process is sent for `error`: a loader worker's death as a DataProcessFailed
    naming the worker, this process and how the worker ended; anything else `_picklable`."""
    me = f"the data process (pid {os.getpid()})"
    if match := _WORKER_KILLED.search(str(error)):
        signum = _SIGNALS_BY_TEXT.get(match[2])
        worker = f"a loader worker (pid {match[1]}) of {me}"
        return DataProcessFailed(_ended(worker, -signum) if signum else f"{worker} was killed by {match[2]}")
    if match := _WORKER_EXITED.search(str(error)):
        worker = f"a loader worker (pid {match[1]}) of {me}"
        return DataProcessFailed(_ended(worker, int(match[2])) if match[2] else f"{worker} exited unexpectedly")
    return _picklable(error)


def _picklable(error: BaseException) -> BaseException:
    """`error` with the child's traceback as a note, or a RuntimeError saying it if it does not pickle."""
    text = "".join(traceback.format_exception(error))
    try:
        error.add_note(f"raised in the data process:\n{text}")
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(f"in the data process: {type(error).__name__}: {error}\n{text}")
