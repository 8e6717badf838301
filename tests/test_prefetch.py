"""Batches prepared on the device ahead of the step (`data.device.prefetch`, vit.data.prefetch):
the same batches in the same order as when each is prepared on demand, errors raised where the
batch is drawn, and no thread left running when an epoch is left early."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import write_image_folder
from vit.data import ImageFolderDataModule
from vit.data.images import CorruptImageError
from vit.data.prefetch import PreparedLoader


def _preparing_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "vit-prepare-batches"]


def _device_pipeline(root, ahead: int, workers: int) -> ImageFolderDataModule:
    data = ImageFolderDataModule(
        str(root), img_size=48, batch_size=4, num_workers=workers, pipeline="device", device={"prefetch": ahead},
        augment={"crop": "rrc", "randaugment_ops": 2},
    )  # fmt: skip
    data.setup("fit")
    return data


@pytest.mark.parametrize("workers", [0, 1])
def test_prefetched_batches_equal_those_prepared_on_demand(tmp_path, workers):
    root = write_image_folder(tmp_path / "data", train=5, val=2, size=64, ext="jpg")
    epochs = {}
    for ahead in (0, 2):
        loader = _device_pipeline(root, ahead, workers).train_dataloader()
        epochs[ahead] = []
        for epoch in range(2):
            loader.sampler.set_epoch(epoch)  # as Lightning does
            epochs[ahead].append(list(loader))
    assert not _preparing_threads()
    assert len(epochs[0][0]) == 5  # 20 images, 4 a batch
    for on_demand, ahead in zip(epochs[0], epochs[2], strict=True):
        for (x0, y0), (x2, y2) in zip(on_demand, ahead, strict=True):
            assert x0.shape == (4, 3, 48, 48) and x0.dtype == torch.float32
            assert torch.equal(x0, x2) and torch.equal(y0, y2)
    assert not torch.equal(epochs[0][0][0][0], epochs[0][1][0][0])  # epochs differ: the same draws, not one batch


def test_a_file_that_does_not_decode_is_named_where_its_batch_is_drawn(tmp_path):
    root = write_image_folder(tmp_path / "data", train=5, val=2, size=64, ext="jpg")
    data = _device_pipeline(root, ahead=2, workers=0)
    loader = data.composed.eval_loader(data.spec, data.val_set, data.run())  # in order: 2 batches of 4
    broken = data.val_set.samples[5].path
    jpeg = Path(broken).read_bytes()  # its header is read in the worker; decoding fails (no scan)
    Path(broken).write_bytes(jpeg[:300] + bytes(len(jpeg) - 302) + jpeg[-2:])
    drawn = []
    with pytest.raises(CorruptImageError, match=f"cannot decode image {broken}"):
        for x, _ in loader:
            drawn.append(x)
    assert len(drawn) == 1  # the first batch came out; the error is the second's
    assert not _preparing_threads()


def test_leaving_an_epoch_early_stops_the_thread_and_the_next_epoch_is_whole(tmp_path):
    root = write_image_folder(tmp_path / "data", train=5, val=2, size=64, ext="jpg")
    loader = _device_pipeline(root, ahead=2, workers=1).train_dataloader()
    on_demand = list(_device_pipeline(root, ahead=0, workers=1).train_dataloader())
    batches = iter(loader)
    next(batches)
    time.sleep(0.5)  # the threads (decoding, augmenting) have filled their queues and wait
    assert len(_preparing_threads()) == 2
    again = list(loader)  # a new epoch before the last one ended (max_steps, an interruption)
    assert not _preparing_threads()
    assert len(again) == 5 and all(torch.equal(a[0], b[0]) for a, b in zip(again, on_demand, strict=True))
    del batches
    assert not _preparing_threads()


def test_the_thread_prepares_at_most_ahead_batches_before_they_are_drawn():
    prepared = []

    def prepare(batch, device):
        prepared.append(int(batch[0]))
        return batch * 10

    loader = PreparedLoader(torch.arange(40), batch_size=4, prepare=prepare, ahead=3)
    batches = iter(loader)
    assert next(batches).tolist() == [0, 10, 20, 30]
    time.sleep(0.5)
    assert len(prepared) == 1 + 3 + 1  # the one drawn, 3 waiting, 1 ready to join them
    assert [b.tolist()[0] for b in batches] == list(range(40, 400, 40))
    assert prepared == list(np.arange(0, 40, 4))


def test_by_default_only_a_gpu_gets_batches_prepared_ahead():
    """device.prefetch None: 1 on CUDA, 0 on the CPU, where a thread would only take cores from the model."""
    threads = []

    def prepare(batch, device):
        threads.append((threading.current_thread().name, device.type))
        return batch

    assert [b.tolist() for b in PreparedLoader(torch.arange(8), batch_size=4, prepare=prepare)] == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
    ]
    assert threads == [("MainThread", "cpu")] * 2
    threads.clear()
    list(PreparedLoader(torch.arange(8), batch_size=4, prepare=prepare, ahead=1))
    assert threads == [("vit-prepare-batches", "cpu")] * 2


def test_an_old_epoch_finished_late_does_not_forget_the_running_threads(tmp_path):
    root = write_image_folder(tmp_path / "data", train=5, val=2, size=64, ext="jpg")
    loader = _device_pipeline(root, ahead=1, workers=0).train_dataloader()
    old = iter(loader)
    next(old)
    new = iter(loader)  # the next epoch starts (and stops the old one's thread) before the old is closed
    next(new)
    old.close()  # the old epoch's generator ends late
    time.sleep(0.3)
    assert len(_preparing_threads()) == 2  # the new epoch's: decoding, augmenting
    list(loader)  # a third epoch stops the second's threads first
    assert not _preparing_threads()
    new.close()


def test_an_epoch_drawn_after_the_next_began_says_so_instead_of_waiting_forever():
    loader = PreparedLoader(torch.arange(40), batch_size=4, prepare=lambda batch, device: batch * 10, ahead=2)
    old = iter(loader)
    assert next(old).tolist() == [0, 10, 20, 30]
    new = iter(loader)  # stops the old epoch's thread
    assert next(new).tolist() == [0, 10, 20, 30]
    with pytest.raises(RuntimeError, match="a later iter\\(loader\\) began another epoch"):
        list(old)
    assert [batch[0].item() for batch in new] == [40, 80, 120, 160, 200, 240, 280, 320, 360]
    assert not _preparing_threads()


@pytest.mark.parametrize("ahead", [0, 1])
def test_the_loader_times_each_batchs_preparing_and_the_steps_wait_for_it(ahead):
    """A batch takes 50 ms to prepare, 10 of them on the CPU, and a step takes 100 ms: prepared on
    demand, each step waits the whole 50 ms; a batch ahead, the first step waits for most of the
    first batch (the thread starts when the epoch does, a little before the step asks) and the
    rest hardly wait."""

    def prepare(batch, device):
        end = time.thread_time() + 0.01
        while time.thread_time() < end:  # CPU time
            pass
        time.sleep(0.04)  # waiting, not on the CPU
        return batch

    loader = PreparedLoader(torch.arange(24), batch_size=4, prepare=prepare, ahead=ahead)
    for _ in loader:
        time.sleep(0.1)
    times = loader.times
    assert len(times.prepared) == len(times.prepared_cpu) == 1  # one stage
    (prepared,), (cpu,) = times.prepared, times.prepared_cpu
    assert len(prepared) == len(cpu) == len(times.waited) == 6
    assert all(p >= 0.05 for p in prepared)
    assert all(0.009 <= c <= p - 0.04 for c, p in zip(cpu, prepared, strict=True))
    if ahead:  # the thread had 100 ms a step to prepare the next batch in 50
        assert times.waited[0] >= 0.025 and max(times.waited[1:]) < 0.02
    else:
        assert all(w >= p for w, p in zip(times.waited, prepared, strict=True))


def test_stages_run_in_threads_of_their_own_and_overlap():
    """Decoding, then augmenting: with a thread a stage, one batch's first stage runs while the
    last batch is in its second, so 8 batches of two 30 ms stages take ~9 x 30 ms, not 16 x 30;
    the batches are those prepared on demand, in order."""
    threads = []

    def stage(scale):
        def run(batch, device):
            threads.append(threading.current_thread().name)
            time.sleep(0.03)  # waiting on the device, say: the interpreter's lock is free
            return batch * scale

        return run

    took = {}
    for ahead in (0, 1):
        loader = PreparedLoader(torch.arange(32), batch_size=4, prepare=[stage(10), stage(3)], ahead=ahead)
        start = time.perf_counter()
        took[ahead] = ([b.tolist() for b in loader], time.perf_counter() - start)
        assert [len(t) for t in loader.times.prepared] == [8, 8] and all(p >= 0.03 for p in loader.times.prepared[1])
    assert took[0][0] == took[1][0] == [[30 * i for i in range(j, j + 4)] for j in range(0, 32, 4)]
    assert took[0][1] >= 16 * 0.03 and took[1][1] < 13 * 0.03, took
    assert threads.count("MainThread") == 16 and threads.count("vit-prepare-batches") == 16
    assert not _preparing_threads()
