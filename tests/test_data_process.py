"""The data process (`data.data_process`): the device pipeline's decoding and augmenting in a process of
its own, handing finished batches to the training process, with the batches the training process
would have made itself."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from functools import partial
from pathlib import Path
from typing import ClassVar

import lightning as L
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.conftest import ROOT, write_image_folder
from tests.test_device_data import _recipe
from tests.test_fault_tolerance import assert_bit_identical, signal_at, weights
from vit.cli import main
from vit.data import ImageFolderDataModule
from vit.data.images import CorruptImageError
from vit.data.prefetch import PreparedLoader
from vit.data.process import DataProcess, DataProcessFailed


def _module(data: Path, **options) -> ImageFolderDataModule:
    module = ImageFolderDataModule(
        str(data), img_size=40, batch_size=4, pipeline="device", augment={"crop": "rrc", "randaugment_ops": 2},
        **{"num_workers": 0, **options},
    )  # fmt: skip
    module.setup("fit")
    return module


def _batches(loader) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [tuple(t.clone() for t in batch) for batch in loader]


@pytest.fixture
def jpegs(tmp_path: Path) -> Path:
    return write_image_folder(tmp_path / "data", train=5, val=3, size=56, ext="jpg")


@pytest.mark.parametrize("start", ["fork", "spawn"])
def test_the_data_process_makes_the_batches_the_training_process_makes(jpegs, start, monkeypatch):
    """Training (random resized crops, flips, RandAugment, two epochs) and evaluation (a ragged last
    batch), bit for bit; spawned as on a GPU, the loader and its dataset travel by pickle."""
    monkeypatch.setattr(DataProcess, "start_method", start)
    here, there = _module(jpegs, data_process=False), _module(jpegs, data_process=True)
    assert not here.data_process and there.data_process
    for make in ("train_dataloader", "val_dataloader"):
        mine, theirs = getattr(here, make)(), getattr(there, make)()
        for epoch in range(2 if make == "train_dataloader" else 1):
            mine.sampler.set_epoch(epoch) if hasattr(mine.sampler, "set_epoch") else None
            theirs.sampler.set_epoch(epoch) if hasattr(theirs.sampler, "set_epoch") else None
            expected, got = _batches(mine), _batches(theirs)
            assert [len(x) for x, _ in got] == ([4] * 5 if make == "train_dataloader" else [4, 4, 4])
            for (x, y), (x2, y2) in zip(expected, got, strict=True):
                assert torch.equal(x, x2) and torch.equal(y, y2)
        assert theirs._data_process.pid != os.getpid()
    there.teardown("fit")
    assert all(loader._data_process is None for loader in there._loaders)


def _refused(*args: object) -> None:
    raise RuntimeError("pidfd_getfd: Operation not permitted")


def _busy(*args: object, **kwargs: object) -> None:
    raise RuntimeError("CUDA error: all CUDA-capable devices are busy or unavailable")


def _exit(*args: object, **kwargs: object) -> None:
    os._exit(3)


# How a data process fails to serve the training process, and what the warning then says
UNAVAILABLE = {
    "its buffers refused where they are mapped (CUDA IPC in a container without ptrace)": "pidfd_getfd",
    "its buffers refused where they are sent": "did not arrive",
    "its start refused (an exclusive-process GPU)": "all CUDA-capable devices are busy",
    "it exits before its first batch": "it exited (exit code 3) before its first batch",
    "its loader does not pickle (spawned, as on a GPU)": "its loader could not be sent to it",
}


@pytest.mark.parametrize("failure", UNAVAILABLE)
def test_a_data_process_that_cannot_serve_leaves_the_batches_to_the_training_process(
    jpegs, failure, monkeypatch, caplog
):
    """The loader says why once and makes the same batches itself, that epoch and the next,
    whichever way the data process cannot serve it before its first batch."""
    from multiprocessing.reduction import ForkingPickler

    from torch.multiprocessing import reductions

    here, there = (
        _module(jpegs, data_process=False).train_dataloader(),
        _module(jpegs, data_process=True).train_dataloader(),
    )
    monkeypatch.setattr(DataProcess, "start_method", "fork")  # the refusals below reach the child
    if failure.startswith("its buffers refused where they are mapped"):
        monkeypatch.setattr(reductions, "rebuild_storage_fd", _refused)
    elif failure.startswith("its buffers refused where they are sent"):
        monkeypatch.setitem(ForkingPickler._extra_reducers, torch.UntypedStorage, _refused)
    elif failure.startswith("its start refused"):
        monkeypatch.setattr(PreparedLoader, "__init__", _busy)  # the loaders here are made: the child's is not
    elif failure.startswith("it exits"):
        monkeypatch.setattr(PreparedLoader, "__init__", _exit)
    else:
        monkeypatch.setattr(DataProcess, "start_method", "spawn")
        there.dataset.note = lambda: None
    with caplog.at_level("WARNING", logger="vit"):
        for epoch in range(2):
            here.sampler.set_epoch(epoch), there.sampler.set_epoch(epoch)
            for (x, y), (x2, y2) in zip(_batches(here), _batches(there), strict=True):
                assert torch.equal(x, x2) and torch.equal(y, y2)
    assert caplog.text.count("the data process cannot serve the training process") == 1
    assert UNAVAILABLE[failure] in caplog.text and "data.data_process false" in caplog.text
    assert there._data_process is None and not there.data_process.serves  # the training process makes them from now on


def test_an_epoch_left_early_is_dropped_and_a_resumed_one_starts_at_its_next_batch(jpegs):
    module = _module(jpegs, data_process=True)
    loader = module.train_dataloader()
    whole = _batches(loader)
    for _ in zip(loader, range(2), strict=False):  # left after 2 of 5 batches, the process ahead of it
        pass
    assert all(torch.equal(a[0], b[0]) for a, b in zip(_batches(loader), whole, strict=True))
    loader.load_state_dict({"epoch": 0, "position": 3 * 4, "seed": loader.sampler.seed})
    rest = _batches(loader)
    assert len(rest) == 2 and all(torch.equal(a[0], b[0]) for a, b in zip(rest, whole[3:], strict=True))
    loader.close()


def test_a_corrupt_file_is_named_in_the_training_process_or_skipped(jpegs, caplog):
    bad = jpegs / "train" / "class2" / "1.jpg"
    data = bad.read_bytes()
    bad.write_bytes(data[:200] + bytes(len(data) - 202) + data[-2:])
    loader = _module(jpegs, data_process=True).train_dataloader()
    with pytest.raises(CorruptImageError, match=f"{bad}"):
        _batches(loader)
    loader.close()
    loader = _module(jpegs, data_process=True, skip_corrupt=True).train_dataloader()
    assert [len(x) for x, _ in _batches(loader)] == [4] * 5
    loader.close()


def test_the_training_process_dispatches_four_ops_a_batch_whatever_its_size(jpegs):
    """The training process's whole work for a batch: a message, a copy of the images and one of the
    labels; decoding and augmenting there dispatch an op or more an image."""

    class Count(TorchDispatchMode):
        ops: ClassVar[list[str]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    counts = {}
    for process in (False, True):
        for batch_size in (4, 8):
            module = ImageFolderDataModule(str(jpegs), img_size=72, batch_size=batch_size, num_workers=0,
                                           pipeline="device", data_process=process)  # fmt: skip
            module.setup("fit")
            loader = module.train_dataloader()
            batches = iter(loader)
            next(batches)  # the process started and the buffers shared
            Count.ops = []
            with Count():
                next(batches)
            counts[process, batch_size] = len(Count.ops)
            loader.close()
    assert counts[True, 4] == counts[True, 8] == 4  # a view of the buffer and a copy of it, twice
    assert counts[False, 8] > counts[False, 4] > 50  # 68 and 100 in torch 2.14


def test_a_data_process_that_dies_is_said_where_the_batch_is_taken(jpegs):
    loader = _module(jpegs, data_process=True).train_dataloader()
    batches = iter(loader)
    next(batches)
    pid = loader._data_process.pid
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(DataProcessFailed, match=rf"^the data process \(pid {pid}\) was killed by SIGKILL \("):
        list(batches)
    assert len(_batches(loader)) == 5  # the next epoch starts another
    loader.close()


@pytest.mark.parametrize("whom", ["process", "worker"])
def test_a_data_process_or_its_worker_lost_between_epochs_is_said_at_the_next(jpegs, whom):
    """Killed while it waits for the next epoch, the data process (or its persistent loader worker,
    when the data process printed a traceback and died) was replaced at the next epoch as if nothing
    had happened. That epoch now raises what happened, and the one after starts afresh."""
    module = _module(jpegs, data_process=True, num_workers=1)
    loader = module.train_dataloader()
    assert len(_batches(loader)) == 5
    pid = loader._data_process.pid
    (worker,) = (int(w) for w in Path(f"/proc/{pid}/task/{pid}/children").read_text().split())
    os.kill(pid if whom == "process" else worker, signal.SIGKILL)
    time.sleep(0.5)
    said = {
        "process": rf"^the data process \(pid {pid}\) was killed by SIGKILL \(.*\) between epochs$",
        "worker": rf"^a loader worker \(pid {worker}\) of the data process \(pid {pid}\) was killed by SIGKILL \(",
    }
    with pytest.raises(DataProcessFailed, match=said[whom]):
        _batches(loader)
    assert not _left(pid, worker)
    assert len(_batches(loader)) == 5
    loader.close()


def test_a_stopped_data_process_is_killed_at_once_with_its_worker_when_closed(jpegs):
    """Asked to stop, a data process finishes its batch first, for up to STOP_WAIT s (10); a stopped
    one (SIGSTOP) never answers, and a run stopped by a signal mid-step waited those 10 s at exit,
    then left its loader worker behind."""
    loader = _module(jpegs, data_process=True, num_workers=1).train_dataloader()
    next(iter(loader))
    pid = loader._data_process.pid
    (worker,) = (int(w) for w in Path(f"/proc/{pid}/task/{pid}/children").read_text().split())
    os.kill(pid, signal.SIGSTOP)
    while Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":  # stopped by now
        time.sleep(0.01)
    began = time.monotonic()
    loader.close()
    assert time.monotonic() - began < 2
    assert not _left(pid, worker)


@pytest.mark.slow
def test_a_sigterm_to_the_runs_process_group_stops_it_with_its_stop_line_alone(tmp_path):
    """`kill -TERM -PGID` (a scheduler's SIGTERM to the job's process group) reached the data
    process's loader workers, which torch makes die on a SIGTERM not from their parent: the data
    process printed their death's traceback beside the run's stop line. Its group is its own now."""
    from tests.test_fault_tolerance import assert_stop_line, run_script
    from tests.test_run_safety import base

    data = write_image_folder(tmp_path / "data", train=12, val=4, ext="jpg")
    options = ["--data.pipeline", "device", "--data.data_process", "true",
               "--data.augment.crop", "rrc", "--data.batch_size", "4", "--data.num_workers", "1",
               "--trainer.max_epochs", "1", "--trainer.callbacks+=tests.test_data_process.SignalDataProcess",
               "--trainer.callbacks.signal=SIGTERM", "--trainer.callbacks.whom=group"]  # fmt: skip
    stopped = run_script(base(data, tmp_path / "run", *options))
    assert stopped.returncode == 143 and "Traceback" not in stopped.stderr, stopped.stderr[-3000:]
    assert_stop_line(stopped, "SIGTERM", 3, tmp_path / "run" / "checkpoints" / "last-interrupted.ckpt")
    pids = [int(pid) for pid in stopped.stdout.split("data process and workers:")[1].split()[:2]]
    assert not _left(*pids)


def test_the_data_process_ends_with_the_training_process_and_outlives_its_signals(jpegs, tmp_path):
    """SIGTERM and SIGINT reach a whole process group (SLURM, Ctrl-C): the training process decides
    when to stop. Killed outright, it leaves no data process behind."""
    script = tmp_path / "train.py"
    script.write_text(
        "import os, signal, sys, time\n"
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"  # pytest-xdist's workers ignore it
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "from tests.test_data_process import _module\n"
        "from pathlib import Path\n"
        f"loader = _module(Path({str(jpegs)!r}), data_process=True).train_dataloader()\n"
        "batches = iter(loader)\n"
        "next(batches)\n"
        "try:\n"
        "    print(loader._data_process.pid, flush=True)\n"
        "    time.sleep(60)\n"
        "except KeyboardInterrupt:\n"  # as Lightning takes Ctrl-C: the run goes on to shut down
        "    print('interrupted', flush=True)\n"
        "    time.sleep(60)\n"
    )
    run = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, start_new_session=True)
    child = int(run.stdout.readline())
    os.killpg(run.pid, signal.SIGINT)
    assert run.stdout.readline() == "interrupted\n"
    os.kill(child, signal.SIGTERM)
    time.sleep(0.5)
    assert _alive(child)
    os.kill(run.pid, signal.SIGKILL)
    run.wait()
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _left(*pids: int, within: float = 2.0) -> list[int]:
    """Those of `pids` still alive after `within` seconds (a SIGKILLed process takes a moment to end)."""
    deadline = time.monotonic() + within
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [pid for pid in pids if _alive(pid)]


def test_the_data_process_needs_the_device_pipeline():
    expected = r"data\.data_process: got True, expected false or null unless --data\.pipeline device"
    with pytest.raises(ValueError, match=expected):
        ImageFolderDataModule(str(ROOT / "tests"), img_size=224, data_process=True)


def test_a_batch_that_does_not_fit_the_buffers_is_said():
    def grow(batch, device):
        return (torch.zeros(len(batch), int(batch[0]) + 1),)

    loader = PreparedLoader(torch.arange(8), batch_size=4, prepare=grow, process=True)
    with pytest.raises(ValueError, match=r"a batch of shape \(4, 5\) does not fit the data process's buffers \(4, 1\)"):
        list(loader)
    loader.close()


@pytest.mark.slow
def test_a_recipe_fed_by_the_data_process_resumes_mid_epoch_to_the_weights_of_one_fed_in_process(tmp_path, one_thread):
    """configs/imagenet_resnet50.yaml's recipe (tests.test_device_data._recipe) with the data
    process: SIGTERM after step 6 (epoch 1, batch 2 of 4), resumed with --ckpt_path last, equals an
    uninterrupted run whose data work ran in the training process, bit for bit."""
    data = write_image_folder(tmp_path / "data", train=8, val=2, size=96, ext="jpg")
    with pytest.raises(SystemExit) as stopped:
        main(_recipe(data, tmp_path / "run", "--data.data_process", "true", *signal_at(6, "SIGTERM")))
    assert stopped.value.code == 143
    resumed = main(_recipe(data, tmp_path / "run", "--data.data_process", "true", "--ckpt_path", "last"))
    straight = main(_recipe(data, tmp_path / "straight", "--data.data_process", "false"))
    assert resumed.datamodule.data_process and not straight.datamodule.data_process
    lines = [run.datamodule.describe_transforms()[0] for run in (resumed, straight)]
    assert lines[0].startswith("decode on the training device from a data process (50% of the JPEGs in the loader")
    assert lines[1].startswith("decode on the training device (50% of the JPEGs in the loader workers)")
    assert resumed.trainer.global_step == straight.trainer.global_step == 12
    assert_bit_identical(weights(resumed), weights(straight))
    assert all(loader._data_process is None for loader in resumed.datamodule._loaders)  # ended at teardown


@pytest.mark.parametrize("start", ["fork", "spawn"])
def test_the_data_process_reads_streaming_chunks_as_the_training_process_does(tmp_path, start, monkeypatch):
    """The litdata source in a data process (spawned as on a GPU: the dataset travels by pickle)
    gives the training process's batches, in ChunkedSampler's order, with a loader worker."""
    pytest.importorskip("litdata")
    from vit.data import StreamingDataModule
    from vit.tools.convert_streaming import convert_image_folder

    monkeypatch.setattr(DataProcess, "start_method", start)
    convert_image_folder(write_image_folder(tmp_path / "src", train=5, val=2, size=56, ext="jpg"), tmp_path / "s")
    loaders = []
    for process in (False, True):
        module = StreamingDataModule(str(tmp_path / "s"), img_size=40, batch_size=4, num_workers=1,
                                     pipeline="device", data_process=process,
                                     augment={"crop": "rrc", "randaugment_ops": 2})  # fmt: skip
        module.setup("fit")
        loaders.append(module.train_dataloader())
    expected, got = (_batches(loader) for loader in loaders)
    assert len(got) == 5
    for (x, y), (x2, y2) in zip(expected, got, strict=True):
        assert torch.equal(x, x2) and torch.equal(y, y2)
    loaders[1].close()


def test_buffers_whose_copies_are_still_queued_are_waited_for_only_when_the_child_has_none_left():
    """On a GPU the copy out of a buffer is queued, and the buffer goes back when its event says the
    copy is done. With every buffer's copy still queued the child could write nothing: the training
    process then waits for the oldest copy, and only then."""

    class Queued:  # a CUDA event whose copy never finishes on its own
        synchronized = 0

        def query(self) -> bool:
            return False

        def synchronize(self) -> None:
            Queued.synchronized += 1

    class OnADevice(DataProcess):
        def _copied(self) -> Queued:
            return Queued()

    def stage(batch, device):
        return (batch.float(),)

    process = OnADevice(partial(PreparedLoader, torch.arange(24), batch_size=4, prepare=stage), torch.device("cpu"),
                        ring=3, batch_size=4)  # fmt: skip

    def deadlocked(*_):
        raise TimeoutError("the training process and the data process wait for each other")

    before = signal.signal(signal.SIGALRM, deadlocked)
    signal.alarm(60)  # a deadlock fails the test instead of hanging it
    try:
        batches = [batch[0].tolist() for batch, _ in process.epoch(None)]
        waits = Queued.synchronized
        process.close()
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, before)
        process.close()
    assert batches == [[float(i) for i in range(k, k + 4)] for k in range(0, 24, 4)]
    assert waits == 6 - 3 + 1  # from the 4th batch on, one wait each: never with a buffer free
    assert Queued.synchronized == waits + 2  # and, before the child ends, for the two copies still queued


# A run whose data process is stopped, killed or signalled mid-epoch: configs/cifar10_vit.yaml on
# JPEGs decoded by a data process with one loader worker (tests.test_run_safety.base), 12 steps an
# epoch, a checkpoint every 3 steps. SignalDataProcess acts after step 3; the batches already in the
# ring are trained on, then the run waits for the next.


class SignalDataProcess(L.Callback):
    """After optimizer step `step`: `signal` to the training loader's data process (`whom`
    "process"), its loader worker ("worker") or the run's process group ("group", as `kill -TERM
    -PGID` or a scheduler would); with `then`, `then` to this process once the run waits for a batch
    (DataProcess._waited > 0). `sent` is when that was, `pids` (printed too) the data process and its
    workers. Whatever else happens, its pids are SIGKILLed after 60 s, so no test hangs."""

    sent: float | None = None
    pids: ClassVar[list[int]] = []

    def __init__(self, signal: str, whom: str = "process", then: str | None = None, step: int = 3) -> None:
        self.signal, self.whom, self.then, self.step = signal, whom, then, step
        SignalDataProcess.sent, SignalDataProcess.pids = None, []

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        if trainer.global_step != self.step:
            return
        pid = trainer.train_dataloader._data_process.pid
        workers = [int(w) for w in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
        SignalDataProcess.pids = [pid, *workers]
        print("data process and workers:", *SignalDataProcess.pids, flush=True)
        if self.whom == "group":
            os.killpg(os.getpgid(0), getattr(signal, self.signal))
            return
        os.kill(workers[0] if self.whom == "worker" else pid, getattr(signal, self.signal))
        threading.Thread(target=self._guard, daemon=True).start()
        if self.then is not None:
            threading.Thread(target=self._when_waiting, args=(trainer,), daemon=True).start()

    def _when_waiting(self, trainer: L.Trainer) -> None:
        data = trainer.train_dataloader._data_process
        while getattr(data, "_waited", 0) == 0:  # the run has waited for the next batch for a while
            time.sleep(0.05)
        SignalDataProcess.sent = time.monotonic()
        os.kill(os.getpid(), getattr(signal, self.then))

    @staticmethod
    def _guard() -> None:
        pids = SignalDataProcess.pids
        time.sleep(60)
        for pid in pids if pids is SignalDataProcess.pids else []:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def _new_shm(before: set[str], pids: list[int]) -> set[str]:
    """What /dev/shm holds that it did not hold `before`, less what a process outside this run made:
    names that carry their maker's pid (`sem.loky-<pid>-...`, `torch_<pid>_...`) and name another
    process are another test's, beside this one under pytest-xdist."""
    ours = {os.getpid(), *pids}
    maker = re.compile(r"(?:loky|torch)[-_](\d+)[-_]")
    made = {name: maker.search(name) for name in set(os.listdir("/dev/shm")) - before}
    return {name for name, pid in made.items() if pid is None or int(pid.group(1)) in ours}


def _stopped_run(tmp_path: Path, capfd, *callback: str) -> tuple[int, str, list[int]]:
    """Runs `base` with SignalDataProcess(`callback`); its exit code, the last line of stderr and the
    pids of the data process and its worker, checked gone, with /dev/shm as it was."""
    from tests.test_run_safety import base

    data = write_image_folder(tmp_path / "data", train=12, val=4, ext="jpg")
    shm = set(os.listdir("/dev/shm"))
    options = ["--data.pipeline", "device", "--data.data_process", "true",
               "--data.augment.crop", "rrc", "--data.batch_size", "4", "--data.num_workers", "1",
               "--trainer.max_epochs", "1", "--trainer.callbacks+=tests.test_data_process.SignalDataProcess",
               *(f"--trainer.callbacks.{option}" for option in callback)]  # fmt: skip
    with pytest.raises(SystemExit) as stopped:
        main(base(data, tmp_path / "run", *options))
    pids = SignalDataProcess.pids
    SignalDataProcess.pids = []  # the guard has nothing left to kill
    assert len(pids) == 2 and not _left(*pids)  # no process left, stopped or orphaned
    assert _new_shm(shm, pids) == set()
    err = capfd.readouterr().err
    assert "Traceback" not in err, err[-3000:]
    return stopped.value.code, err.strip().splitlines()[-1], pids


def _resumable(line: str, run: Path) -> int:
    """The step the stop line names; its checkpoint holds that step and the line the command resuming it."""
    match = re.search(rf" at step (\d+); saved {run}/checkpoints/last-interrupted\.ckpt\. Resume with: python ", line)
    assert match and line.endswith("--ckpt_path last"), line
    step = int(match[1])
    assert torch.load(run / "checkpoints" / "last-interrupted.ckpt", weights_only=True)["global_step"] == step >= 3
    return step


def test_a_data_process_that_sends_no_batch_stops_the_run_naming_it(tmp_path, capfd, monkeypatch):
    """Stopped (SIGSTOP), the data process hung the run for good: SIGTERM did nothing. Now a batch
    waited for past STALL_MARGIN x the slowest one and STALL_FLOOR stops the run, saved, in one
    line, and the process is killed with its worker."""
    monkeypatch.setattr("vit.data.process.STALL_FLOOR", 3.0)
    code, line, (pid, _) = _stopped_run(tmp_path, capfd, "signal=SIGSTOP")
    said = re.match(rf"error: the data process \(pid {pid}\) sent no batch for (\d+) s \(the slowest so far took "
                    r"(\d+\.\d) s\): stopped at step", line)  # fmt: skip
    assert code == 1 and said, line
    waited, slowest = int(said[1]), float(said[2])
    assert max(3.0, 10 * slowest) - 1 <= waited <= max(3.0, 10 * slowest) + 2  # rounded as said
    _resumable(line, tmp_path / "run")


@pytest.mark.parametrize(("signal_name", "code"), [("SIGTERM", 143), ("SIGINT", 130)])
def test_a_signal_ends_a_run_whose_data_process_is_stopped_within_seconds(tmp_path, capfd, signal_name, code):
    """A scheduler's SIGTERM (or Ctrl-C) while the run waits for a batch from a stopped data process
    stops it as at any other time, within seconds, far before the stall would be found."""
    code_, line, _ = _stopped_run(tmp_path, capfd, "signal=SIGSTOP", f"then={signal_name}")
    assert time.monotonic() - SignalDataProcess.sent < 10
    assert code_ == code and line.startswith(f"Stopped by {signal_name} at step "), line
    _resumable(line, tmp_path / "run")


@pytest.mark.parametrize("whom", ["process", "worker"])
def test_a_data_process_or_its_worker_killed_mid_epoch_is_said_in_one_line(tmp_path, capfd, whom):
    """kill -9 (the OOM killer's signal) of the data process, or of its loader worker, ended the run
    with one or two tracebacks and no word of the checkpoint it saved."""
    code, line, (pid, worker) = _stopped_run(tmp_path, capfd, "signal=SIGKILL", f"whom={whom}")
    who = f"the data process (pid {pid})" if whom == "process" else (
        f"a loader worker (pid {worker}) of the data process (pid {pid})")  # fmt: skip
    assert code == 1
    assert line.startswith(f"error: {who} was killed by SIGKILL (by the kernel's OOM killer?): stopped at step "), line
    _resumable(line, tmp_path / "run")


class _SaidLate(RuntimeError):
    """The loader's own word of a worker's death; torch's SIGCHLD handler runs while it is being read."""

    def __str__(self) -> str:
        if not self.args[1]:
            self.args[1].append(True)
            os.kill(os.getpid(), signal.SIGCHLD)
        return self.args[0]


def _one_epoch(loader):
    """A data process's server (in this process) run through one epoch of `loader`: the server, its
    order queue and the messages it sent."""
    import queue

    from vit.data.process import _Server

    orders, free, ready = queue.Queue(), queue.Queue(), queue.Queue()
    free.put(0)
    server = _Server(loader, torch.device("cpu"), 1, 2, orders, free, ready, None)
    assert server.run_epoch(1, None) is None
    return server, orders, [ready.get_nowait() for _ in range(ready.qsize())]


def test_a_worker_killed_while_sending_a_batch_is_named_not_left_as_a_broken_pipe():
    """kill -9 of a loader worker mid-send broke the data process's pipe (ConnectionResetError) a moment
    before the worker was a zombie torch could name, and that error went to the run as a traceback."""
    calls = []

    def torch_handler(signum, frame):  # the worker is seen dead from the handler's second look on
        calls.append(signum)
        if len(calls) >= 2:
            raise RuntimeError("DataLoader worker (pid 4242) is killed by signal: Killed.")

    class Loader:
        def __iter__(self):
            yield (torch.zeros(2, 3),)
            raise ConnectionResetError(104, "Connection reset by peer")

    previous = signal.signal(signal.SIGCHLD, torch_handler)
    try:
        server, _, messages = _one_epoch(Loader())
        error = messages[-1][2]
        assert isinstance(error, DataProcessFailed), error
        assert str(error).startswith(
            f"a loader worker (pid 4242) of the data process (pid {os.getpid()}) was killed by SIGKILL"
        )
        assert len(calls) == 2 and server.death is None
    finally:
        signal.signal(signal.SIGCHLD, previous)


def test_a_worker_death_raised_by_torchs_sigchld_handler_inside_the_report_is_said_once():
    """torch's SIGCHLD handler raises a loader worker's death wherever the data process is. When it
    landed inside the except clause reporting the loader's own error for that death, it escaped the
    data process as a second traceback instead of the one line naming the signal."""

    def torch_handler(signum, frame):
        raise RuntimeError("DataLoader worker (pid 4242) is killed by signal: Killed.")

    class Loader:
        def __iter__(self):
            yield (torch.zeros(2, 3),)
            raise _SaidLate("DataLoader worker (pid(s) 4242) exited unexpectedly", [])

    previous = signal.signal(signal.SIGCHLD, torch_handler)
    try:
        server, orders, messages = _one_epoch(Loader())
        assert [m[0] for m in messages] == ["ring", "batch", "error"]
        error = messages[-1][2]
        assert isinstance(error, DataProcessFailed)
        assert str(error).startswith(
            f"a loader worker (pid 4242) of the data process (pid {os.getpid()}) was killed by SIGKILL"
        )
        assert server.death is None
        # Between epochs a death is held too, and said at the next order.
        os.kill(os.getpid(), signal.SIGCHLD)
        orders.put(("epoch", 2, None))
        assert server.wait_for_order() == ("epoch", 2, None)
        assert "killed by SIGKILL" in str(server.lost)
    finally:
        signal.signal(signal.SIGCHLD, previous)
