"""What a run does when something goes wrong, so that it never loses work and never lies about it.

- A stop by signal (Ctrl-C, SIGTERM from a scheduler) saves `last-interrupted.ckpt`, prints one
  line naming it and the command that resumes, and exits 130 (SIGINT) or 143 (SIGTERM), as shells
  and schedulers expect of a killed job, so `&&` chains and job arrays do not take it for done; it
  does so within seconds even while the run waits for a data process that sends nothing. A data
  process lost (killed, stopped, hung) saves and says the same, with what happened to it, exit 1.
- Checkpoints are written atomically (a temporary file in the same directory, fsync, rename): a
  full disk or a kill mid-write leaves the previous file intact, never a partial one under a
  checkpoint's name, and a failed write stops the run with the path and the OS error.
- `--ckpt_path last` takes the complete `last*.ckpt` (file or sharded directory) saved at the
  latest step, warning about any it skips, in the run's checkpoint folder (`checkpoint_dir`).
- `best-*.ckpt` are chosen at validations only, from the state validated (RunCheckpoint);
  evaluation never touches a run's checkpoints, and a resume that fails while restoring writes
  none (InterruptCheckpoint).
- A distributed run that finished destroys its process group itself (`destroy_process_group`),
  rather than leaving it to interpreter teardown, where gloo's worker threads can abort the finished
  process (SIGABRT, "terminate called without an active exception"). A failed run does not: its
  peers may be inside a collective that the shutdown would wait for.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import shlex
import shutil
import signal
import time
import zipfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, OnExceptionCheckpoint
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException

from vit import lightning_compat as compat
from vit.data.process import waits_end_when

log = logging.getLogger(__name__)

EXIT_CODES = {"SIGINT": 130, "SIGTERM": 143}  # 128 + signal number, the shell's convention


def destroy_process_group() -> None:
    """Destroy the default process group, if there is one; call it after a run that succeeded.

    Lightning leaves the group to interpreter teardown, where gloo's threads may still hold work
    with Python references and abort the process (pytorch/pytorch#179291): a finished 2-process CPU
    run of ours once exited -6 that way. Not after a failure: NCCL's shutdown waits for the peers,
    which may be stuck in a collective the failed rank never joins (torchtitan destroys the group
    on success only, for the same reason).
    """
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


class HostCopy:
    """A small tensor's value for the host to read later, without waiting for the rest of the
    device's queue: on CUDA copied into pinned memory behind an event, and `get` waits for that
    event only (a `.item()` would wait for everything queued since, e.g. the whole backward pass).
    On the CPU a plain copy."""

    def __init__(self, value: torch.Tensor) -> None:
        self._ready: torch.cuda.Event | None = None
        if value.device.type == "cuda":
            self._host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
            self._host.copy_(value, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record(torch.cuda.current_stream(value.device))
        else:
            self._host = value.detach().clone()

    def get(self) -> torch.Tensor:
        if self._ready is not None:
            self._ready.synchronize()
        return self._host


class NonFiniteLossError(RuntimeError):
    """The training loss became NaN or infinite."""


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (disk full, no permission, ...)."""


class IncompleteCheckpointError(ValueError):
    """A checkpoint file that is empty or truncated (not a complete archive)."""


class CheckpointConflictError(ValueError):
    """A run resumed with options or data other than those its checkpoint was trained with."""


class AtomicCheckpointIO(TorchCheckpointIO):
    """torch.save into `.<name>.tmp` beside the target, fsync, then rename over it: the name only
    ever points at a complete file. A failure removes the temporary file and raises
    CheckpointWriteError naming the path and the OS error."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any = None) -> None:
        path = Path(path)
        bad = non_finite(checkpoint.get("state_dict", {}))
        if bad:
            raise NonFiniteLossError(
                f"the weights are not finite after step {checkpoint.get('global_step')} ({', '.join(bad[:3])}); "
                f"not saving {path}. {nan_advice(path.parent)}"
            )
        tmp = path.with_name(f".{path.name}.tmp")
        buffer = io.BytesIO()  # serialised first, as Lightning does: a failed write then raises the OS error itself
        torch.save(checkpoint, buffer)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(buffer.getbuffer())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError as e:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise CheckpointWriteError(f"could not write checkpoint {path}: {e.strerror or e}") from e
        _fsync_dir(path.parent)


def nan_advice(directory: str | Path) -> str:
    """What to do after a NaN: resume from the last good checkpoint in `directory`, if there is one
    (every checkpoint written holds finite weights), with a lower learning rate or clipping."""
    remedies = (
        "a lower learning rate ({how}--model.optimizer.lr <lower>{note}), gradient clipping "
        "(--trainer.gradient_clip_val 1.0), or check the data."
    )
    checkpoint = last_good(directory)
    if checkpoint is None:
        return "No checkpoint was saved before it; start again with " + remedies.format(how="", note="")
    return (
        f"The last good checkpoint is {checkpoint} (every checkpoint written holds finite weights). Resume from it "
        "with " + remedies.format(how="--ckpt_path last ", note=", which takes effect on resume")
    )


def non_finite(state_dict: dict[str, Any]) -> list[str]:
    """Names of the floating-point tensors holding NaN or inf."""
    return [k for k, v in state_dict.items() if torch.is_tensor(v) and v.is_floating_point() and not v.isfinite().all()]


def checkpoint_dir(default_root_dir: str | Path | None) -> Path:
    """Where a run's checkpoints live: `<default_root_dir>/checkpoints`, fixed per run (not per
    logger version), so `--ckpt_path last` finds them from a new process."""
    return Path(default_root_dir or ".") / "checkpoints"


def trainer_checkpoint_dir(trainer: L.Trainer) -> Path:
    """The folder `trainer` checkpoints into: its ModelCheckpoint's, when one names it, else the run's."""
    for cb in trainer.checkpoint_callbacks:
        if getattr(cb, "dirpath", None):
            return Path(cb.dirpath)
    return checkpoint_dir(trainer.default_root_dir)


def last_good(directory: str | Path) -> str | None:
    """The checkpoint `--ckpt_path last` resumes from in `directory`, if there is one."""
    newest, _ = resume_checkpoint(directory)
    return str(newest) if newest is not None else None


def _fsync_dir(directory: Path) -> None:
    """Make the rename itself durable (POSIX; a no-op where directories cannot be opened)."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class SafeCheckpoints(Callback):
    """Puts AtomicCheckpointIO in place of Lightning's plain writer (other CheckpointIO plugins are kept)."""

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:
            trainer.strategy.checkpoint_io = AtomicCheckpointIO()


class RunCheckpoint(ModelCheckpoint):
    """ModelCheckpoint whose `last.ckpt` is always the newest state and whose `best-*.ckpt` always
    holds the weights that had its score.

    - Step (and time) checkpoints write `last.ckpt` only, from the first steps on; the top k by the
      monitored metric are chosen at each validation, from the state just validated. Lightning
      (2.6) ranks a step checkpoint by the last validation's score, so `best-*.ckpt` held weights
      trained for steps after the one that scored, and wrote nothing, not even `last.ckpt`, until
      the first validation (a crash in the first epoch lost all of it).
    - Lightning refreshes `last.ckpt` at a validation only when a top-k checkpoint was written at
      that step, so after an epoch that is not the best it kept an older state and a resume
      repeated the epochs since. Here it is written at every epoch's (or validation's) save point.
    - A run that stops between save points (a `WallClockBudget` running out in an epoch without a
      validation, `max_steps` mid-epoch, a stop request) ended with `last.ckpt` at the previous save
      point, so the last steps of training were lost. Here the final state is written at the end.
    """

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_end(trainer, pl_module)
        self._refresh_last(trainer)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # A run without validation (limit_val_batches 0) has no score to rank by: Lightning would warn
        # at every epoch that the monitored metric is missing, listing every logged one.
        scored = self.monitor is None or self.monitor in compat.monitor_candidates(self, trainer)
        if scored or sum(trainer.num_val_batches) > 0:
            super().on_train_epoch_end(trainer, pl_module)
        if compat.saves_on_train_epoch_end(self, trainer):
            self._refresh_last(trainer)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_validation_end(trainer, pl_module)
        if self._ranks_at_validation() and self._fitting(trainer):
            candidates = compat.monitor_candidates(self, trainer)
            if self.monitor in candidates:
                compat.save_topk(self, trainer, candidates)
                compat.save_last(self, trainer, candidates)
        if not compat.saves_on_train_epoch_end(self, trainer):
            self._refresh_last(trainer)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if not (self._ranks_at_validation() and pl_module.automatic_optimization):
            super().on_train_batch_end(trainer, pl_module, *args)  # no score to rank by: the newest k are kept
            return
        if self._step_save_due(trainer) and not compat.skips_saving(self, trainer):
            compat.save_last(self, trainer, compat.monitor_candidates(self, trainer))

    def _ranks_at_validation(self) -> bool:
        """Checkpoints by steps or time with a monitored metric: Lightning would rank them at step saves."""
        every_n_train_steps, train_time_interval, every_n_epochs = compat.checkpoint_triggers(self)
        by_steps = every_n_train_steps >= 1 or train_time_interval is not None
        return self.monitor is not None and by_steps and every_n_epochs < 1

    def _step_save_due(self, trainer: L.Trainer) -> bool:
        """Lightning's trigger: every `every_n_train_steps` steps, or `train_time_interval` (rank 0's clock)."""
        every_n_train_steps, train_time_interval, _ = compat.checkpoint_triggers(self)
        if every_n_train_steps >= 1:
            return trainer.global_step % every_n_train_steps == 0
        now, checked = time.monotonic(), compat.last_time_checked(self)
        due = checked is not None and now - checked >= train_time_interval.total_seconds()
        if trainer.strategy.broadcast(due):
            compat.set_last_time_checked(self, now)
            return True
        return False

    @staticmethod
    def _fitting(trainer: L.Trainer) -> bool:
        return trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking and not trainer.fast_dev_run

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """A run folder that was moved or copied keeps its best-k tracking and its `last.ckpt`: the
        saved paths are taken as names in this folder (Lightning dropped them, then wrote
        `last-v1.ckpt` beside the stale `last.ckpt` and forgot which checkpoints were best)."""
        old = state_dict.get("dirpath")
        if old is not None and self.dirpath is not None and Path(old) != Path(self.dirpath):
            here = Path(self.dirpath)

            def moved(path: str) -> str:
                return str(here / Path(path).name) if path and Path(path).parent == Path(old) else path

            state_dict = {
                **state_dict,
                "dirpath": self.dirpath,
                "best_model_path": moved(state_dict.get("best_model_path", "")),
                "kth_best_model_path": moved(state_dict.get("kth_best_model_path", "")),
                "last_model_path": moved(state_dict.get("last_model_path", "")),
                "best_k_models": {moved(k): v for k, v in state_dict.get("best_k_models", {}).items()},
            }
            log.info("this run's checkpoints were in %s; they are followed here, in %s", old, here)
        super().load_state_dict(state_dict)

    def _refresh_last(self, trainer: L.Trainer) -> None:
        saved_now = compat.last_step_saved(self) == trainer.global_step
        if self.save_last and not saved_now and not compat.skips_saving(self, trainer):
            compat.save_last(self, trainer, compat.monitor_candidates(self, trainer))


class InterruptCheckpoint(OnExceptionCheckpoint):
    """Saves `last-interrupted.ckpt` when a training run is stopped (Ctrl-C, SIGTERM, a crash) so no
    work is lost; `--ckpt_path last` resumes from it. A `fit` that completes removes it (its
    `last.ckpt` is newer); `validate`, `test` and `predict` never touch it (Lightning's callback
    deletes it at the end of every stage, so evaluating it lost it).

    Not written when the weights are not finite (that state is bad), before the first optimizer
    step (nothing to save), under DDP after an error on one rank (saving needs every rank), nor by
    a resumed run that has not finished restoring (a resume that fails on a changed option would
    save its half-restored state, an empty optimizer among it, as the newest checkpoint, and every
    later resume would pick it). `saved` is the path written, if any."""

    def __init__(self, dirpath: str | Path) -> None:
        super().__init__(dirpath, filename="last-interrupted")
        self.saved: Path | None = None
        self._training = False  # set once the run is restored and its fit loop has started
        self._in_validation = False  # while saving a run stopped during its validation

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._training = False

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._training = True  # Lightning restores the checkpoint (weights, optimizer, loops) before this

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit":  # called after a stage that succeeded only
            super().teardown(trainer, pl_module, stage)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if not self._training or isinstance(exception, (NonFiniteLossError, CheckpointWriteError)):
            return
        if trainer.global_step == 0:
            return
        if trainer.world_size > 1 and stop_signal(exception) is None:
            # One rank failed (a corrupt image, say): the others are not here to save with, and
            # waiting for them would hang every rank. Fail now; the others follow when their next
            # collective finds this process gone.
            return
        if not all(torch.isfinite(p).all() for p in pl_module.parameters()):
            return
        self._in_validation = trainer.validating
        try:
            super().on_exception(trainer, pl_module, exception)
        finally:
            self._in_validation = False
        self.saved = Path(self.ckpt_path)

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        """Stopped during a validation: saved as stopped at its first batch, so the resumed run
        validates that epoch again from the start (Lightning resumes mid-validation only when the stop
        fell inside a validation step, and would then score the remaining batches alone; otherwise
        it skipped the epoch's validation, and its best checkpoint)."""
        progress = compat.saved_val_batch_progress(checkpoint)
        if getattr(self, "_in_validation", False) and progress is not None:
            restart = {"ready": 1, "started": 1, "processed": 0, "completed": 0}
            progress.update(total=dict(restart), current=dict(restart), is_last_batch=False)


class SynchronizedStop(Callback):
    """Under DDP every rank stops after the same optimizer step when a signal arrives, so the ranks
    save the interrupt checkpoint together instead of one waiting forever in a collective.

    A signal reaches the ranks at different moments (a scheduler signals each process, Ctrl-C the
    process group) or only rank 0 (`kill PID`). Lightning's own handler broadcasts from inside the
    signal handler, which can pair with another collective and hang both ranks. Here SIGTERM or a
    first Ctrl-C only marks the stop; after each training batch the ranks take the max of their
    marks (one scalar all-reduce, queued on the device) and read it after the next batch (reading
    it at once would make the host wait for the whole step), and if any rank was signalled, all
    stop there: SIGTERM as Lightning stops (SIGTERMException at the end of the step), Ctrl-C as a
    KeyboardInterrupt. A second Ctrl-C interrupts at once. A signal during validation takes
    effect at the next training batch but one. Single-process runs keep Lightning's own handling."""

    def __init__(self) -> None:
        self._marked = 0  # the signal number to stop for, 0 for none
        self._agreed: HostCopy | None = None  # the ranks' marks after the last batch, on their way to the host
        self._previous: dict[int, Any] = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.world_size < 2:
            return
        self._marked, self._agreed = 0, None
        # Installed after Lightning's handlers (registered before the fit loop starts), replacing them.
        self._previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        for signum in self._previous:
            signal.signal(signum, self._mark)

    def _mark(self, signum: int, frame: Any) -> None:
        if signum == signal.SIGINT and self._marked == signal.SIGINT:
            raise KeyboardInterrupt  # asked twice: stop now, in step or not
        self._marked = max(self._marked, signum)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if not self._previous:
            return
        agreed, self._agreed = self._agreed, None
        marks = torch.full((1,), self._marked, device=pl_module.device)  # not a copy from the host: that waits
        torch.distributed.all_reduce(marks, op=torch.distributed.ReduceOp.MAX)
        self._agreed = HostCopy(marks)
        signum = int(agreed.get().item()) if agreed is not None else 0
        if signum == signal.SIGTERM:
            compat.stop_as_sigterm(trainer)  # Lightning raises at the end of this step
        elif signum == signal.SIGINT:
            raise KeyboardInterrupt

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self._previous = {}


def stop_signal(exception: BaseException) -> str | None:
    """The signal that stopped a `trainer.fit`, from what it raised: Lightning turns SIGTERM into
    SIGTERMException and Ctrl-C's KeyboardInterrupt into `sys.exit(1)`."""
    if isinstance(exception, SIGTERMException):
        return "SIGTERM"
    if isinstance(exception, KeyboardInterrupt) or isinstance(exception.__context__, KeyboardInterrupt):
        return "SIGINT"
    return None


def stop_message(trainer: L.Trainer, signal_name: str, argv: Sequence[str]) -> str:
    """One line: the signal that stopped the run, where its state is, and the command that resumes it."""
    return f"Stopped by {signal_name} at step {trainer.global_step}; {_saved(trainer, argv)}"


def failure_message(trainer: L.Trainer, cause: str, argv: Sequence[str]) -> str:
    """One line for a run stopped by a failure outside the training step (its data process lost):
    `cause`, where the run's state is, and the command that resumes it."""
    return f"error: {cause}: stopped at step {trainer.global_step}; {_saved(trainer, argv)}"


def _saved(trainer: L.Trainer, argv: Sequence[str]) -> str:
    saved = next((cb.saved for cb in trainer.callbacks if isinstance(cb, InterruptCheckpoint)), None)
    if saved is not None:
        return f"saved {saved}. Resume with: {resume_command(argv)}"
    if trainer.global_step == 0:
        return "nothing trained yet, so no checkpoint."
    last = last_good(trainer_checkpoint_dir(trainer))
    if last is None:
        return "no checkpoint was saved."
    return f"not saved now; the last checkpoint is {last}. Resume with: {resume_command(argv)}"


def resume_command(argv: Sequence[str]) -> str:
    """The command line that was run, with `--ckpt_path last` in place of any --ckpt_path."""
    args, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--ckpt_path":
            skip = True
        elif not arg.startswith("--ckpt_path="):
            args.append(arg)
    return shlex.join(["python", *args, "--ckpt_path", "last"])


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """Ctrl-C (SIGINT) raises KeyboardInterrupt while in it, even in a process started with SIGINT
    ignored (a background job of a non-interactive shell): a run stops saved and resumable rather
    than ignore a signal sent to stop it (`kill -INT`, a supervisor's stop signal); every handler is
    as before afterwards (Lightning leaves SIGINT ignored after a Ctrl-C)."""
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)


def sigterm_ends_data_waits(trainer: L.Trainer) -> contextlib.AbstractContextManager[None]:
    """While in it, a SIGTERM that reaches `trainer` while it waits for its data process's next
    batch stops the run at once, as Lightning would have after the step (SIGTERMException): no step
    is in hand, and the batch may never come (the process stopped or hung)."""
    return waits_end_when(lambda: SIGTERMException() if trainer.received_sigterm else None)


METADATA = "meta.pt"  # a sharded checkpoint's file of everything but the weights and optimizer states (Lightning)
DCP_METADATA = ".metadata"  # its index of the shards (torch.distributed.checkpoint), written after all of them


def checkpoint_complete(path: str | Path) -> bool:
    """A file: a torch zip archive with its central directory (written last, so a truncated file
    lacks it). A directory (a sharded checkpoint of vit.sharding.ShardedStrategy): its index and
    metadata exist, and every shard file is as long as the index says (a truncated shard would
    stop every rank with EOFError when it is read)."""
    path = Path(path)
    if path.is_dir():
        return _sharded_complete(path)
    try:
        with zipfile.ZipFile(path) as archive:
            return bool(archive.namelist())
    except (OSError, zipfile.BadZipFile):
        return False


def _sharded_complete(path: Path) -> bool:
    from torch.distributed.checkpoint import FileSystemReader

    if not ((path / DCP_METADATA).is_file() and (path / METADATA).is_file() and checkpoint_complete(path / METADATA)):
        return False
    try:
        storage = FileSystemReader(str(path)).read_metadata().storage_data
    except Exception:  # an index that cannot be read, whatever pickle raises for it
        return False
    needed: dict[str, int] = {}
    for info in storage.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    try:
        return all((path / name).stat().st_size >= size for name, size in needed.items())
    except OSError:
        return False


def saved_step(path: str | Path) -> int:
    """The optimizer step a complete checkpoint (file or sharded directory) was saved at, read
    without loading its tensors (memory-mapped)."""
    path = Path(path)
    source = path / METADATA if path.is_dir() else path
    return int(torch.load(source, map_location="cpu", weights_only=True, mmap=True).get("global_step", 0))


def newest_complete(candidates: Sequence[str | Path]) -> Path | None:
    """The complete checkpoint (file or sharded directory) of `candidates` saved at the latest
    step, the newest file among equals; a warning for each incomplete one skipped. By step, not by
    file time: a copy or a restore from backup reorders the times."""
    ranked = []
    for path in map(Path, candidates):
        if checkpoint_complete(path):
            ranked.append((saved_step(path), path.stat().st_mtime_ns, path))
        else:
            log.warning("skipping %s: it is not a complete checkpoint (empty or truncated)", path)
    return max(ranked)[2] if ranked else None


def resume_checkpoint(directory: str | Path) -> tuple[Path | None, list[Path]]:
    """What `--ckpt_path last` resumes from in `directory`: (the newest complete `last*.ckpt`, or
    None, and every candidate looked at)."""
    candidates = sorted(Path(directory).glob("last*.ckpt"))
    return newest_complete(candidates), candidates


def remove_stale_temporaries(directory: str | Path) -> list[Path]:
    """Delete the temporary files (`.<name>.tmp`, up to a checkpoint's size) that a kill or Ctrl-C
    during a write left in `directory`; a new run's first save would otherwise find the disk
    fuller by that much. Returns what it removed."""
    removed = []
    for tmp in Path(directory).glob(".*.ckpt.tmp") if Path(directory).is_dir() else []:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                tmp.unlink()
        removed.append(tmp)
    return removed
