"""The data options as one frozen record (vit.data.spec.DataSpec): the pipelines are composed from it
and the run's values (vit.data.spec.Run), never from the datamodule; an option set later (a
batch-size finder's batch_size) makes a new spec, checked as the first was; every rule between
options is the spec's."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.utilities.parsing import lightning_setattr

from tests.conftest import write_image_folder
from vit.data import ImageFolderDataModule
from vit.data.augment import Augment
from vit.data.device import DeviceDecode
from vit.data.memory import Memory
from vit.data.naflex import NaFlex
from vit.data.pipelines import FromFiles, InMemory, PerSample, Sequences, pipeline_for
from vit.data.sampling import ResumableSampler
from vit.data.spec import DataSpec, Run
from vit.options import OptionError


def test_the_spec_is_frozen_and_holds_what_runs():
    augment = Augment(crop="pad_crop", crop_padding=2)
    spec = DataSpec(img_size=16, batch_size=8, num_workers=2, pipeline="memory",
                    memory=Memory(train_sizes=[[0.5, 16], [0, 8]]), augment=augment)  # fmt: skip
    assert spec.persistent_workers is True and spec.num_workers == 2  # None resolved
    assert spec.memory.train_sizes == [(0.0, 8), (0.5, 16)]  # sorted by progress
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.batch_size = 4  # type: ignore[misc]
    assert spec.replace(batch_size=4).batch_size == 4 and spec.batch_size == 8


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(data_process=True), r"data\.data_process: got True, expected false or null unless --data\.pipeline dev"),
        (dict(pipeline="memory"), r"data\.augment\.crop: got .rrc., expected pad_crop or resize with --data\.pipel"),
        (dict(pipeline="device", augment=Augment(crop="pad_crop")),
         r"data\.augment\.crop: got .pad_crop., expected rrc or resize with --data\.pipeline device"),
        (dict(augment=Augment(cutout=4)), r"data\.augment\.cutout: got 4, expected 0 unless --data\.pipeline memory"),
        (dict(pipeline="memory", augment=Augment(crop="pad_crop"), naflex=NaFlex(max_patches=16)),
         r"data\.augment\.crop: got .pad_crop., expected rrc or resize with --data\.naflex"),
        (dict(pipeline="memory", augment=Augment(crop="resize"), naflex=NaFlex(max_patches=16)),
         r"data\.pipeline: got .memory., expected per_sample with --data\.naflex"),
        (dict(pipeline="in_memory"), r"data\.pipeline: got .in_memory., expected per_sample \(each image in a loader"),
    ],
)  # fmt: skip
def test_every_rule_between_options_is_checked_by_the_spec(options, message):
    with pytest.raises(OptionError, match=message):
        DataSpec(**options)


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(device=DeviceDecode(worker_decode=0.5)),
         r"^data\.device\.worker_decode: got 0\.5, expected 0\.0 unless --data\.pipeline device \(an option of the "
         r"device pipeline; --data\.pipeline is per_sample\)$"),
        (dict(pipeline="memory", augment=Augment(crop="pad_crop"), device=DeviceDecode(prefetch=1)),
         r"^data\.device\.prefetch: got 1, expected null unless --data\.pipeline device .*is memory\)$"),
        (dict(memory=Memory(train_sizes=[[0, 8]])),
         r"^data\.memory\.train_sizes: got \[\(0\.0, 8\)\], expected null unless --data\.pipeline memory"),
        (dict(pipeline="device", memory=Memory(cache_dir="cache")),
         r"^data\.memory\.cache_dir: got 'cache', expected null unless --data\.pipeline memory .*is device\)$"),
    ],
)  # fmt: skip
def test_an_option_of_another_pipeline_is_refused_naming_the_pipeline_it_belongs_to(options, message):
    with pytest.raises(OptionError, match=message):
        DataSpec(**options)


def test_a_group_checks_its_own_values():
    with pytest.raises(OptionError, match=r"^data\.device\.worker_decode: got 1\.5, expected a share of the JPEGs"):
        DeviceDecode(worker_decode=1.5)
    with pytest.raises(OptionError, match=r"^data\.device\.prefetch: got -1, expected a whole number of at least 0"):
        DeviceDecode(prefetch=-1)
    with pytest.raises(OptionError, match=r"^data\.memory\.train_sizes: got \[\[2, 8\]\], expected \[\[progress"):
        Memory(train_sizes=[[2, 8]])


def test_the_pipeline_is_the_one_the_pipeline_option_names():
    assert type(pipeline_for(DataSpec())) is PerSample
    assert type(pipeline_for(DataSpec(pipeline="memory", augment=Augment(crop="pad_crop")))) is InMemory
    assert type(pipeline_for(DataSpec(pipeline="device"))) is FromFiles
    assert type(pipeline_for(DataSpec(naflex=NaFlex(max_patches=16), augment=Augment(crop="rrc")))) is Sequences


def test_a_pipeline_made_from_the_spec_alone_gives_the_datamodules_batches(tmp_path):
    root = write_image_folder(tmp_path / "data", train=3, val=1, size=24, ext="jpg")
    data = ImageFolderDataModule(str(root), img_size=16, batch_size=4, num_workers=0, augment={"randaugment_ops": 2})
    data.setup("fit")
    spec, seed = data.spec, data.seed
    alone = PerSample().train_loader(spec, data.train_set, ResumableSampler(data.train_set, seed=seed), Run(seed))
    theirs = data.train_dataloader()
    for (x, y), (x2, y2) in zip(alone, theirs, strict=True):
        assert torch.equal(x, x2) and torch.equal(y, y2)


def test_a_batch_size_set_after_setup_makes_a_new_spec_the_next_loader_takes(tmp_path):
    """As Lightning's batch-size finder sets it (lightning_setattr, on the trainer's datamodule)."""
    root = write_image_folder(tmp_path / "data", train=3, val=1, size=24, ext="jpg")
    data = ImageFolderDataModule(str(root), img_size=16, batch_size=4, num_workers=0)
    data.setup("fit")
    first = data.spec
    assert [len(y) for _, y in data.train_dataloader()] == [4, 4, 4]
    model = SimpleNamespace(_trainer=SimpleNamespace(datamodule=data), hparams={})
    lightning_setattr(model, "batch_size", 5)
    assert data.batch_size == 5 and data.spec.batch_size == 5 and first.batch_size == 4
    assert [len(y) for _, y in data.train_dataloader()] == [5, 5]  # 12 images, no ragged last batch
    assert [len(y) for _, y in data.val_dataloader()] == [4]
    with pytest.raises(OptionError, match=r"data\.batch_size: got 0, expected a whole number of at least 1"):
        data.batch_size = 0  # checked again
    assert data.spec.batch_size == 5


def test_the_sampler_state_sent_to_the_data_process_is_what_makes_its_order(tmp_path):
    """vit.data.process.SamplerState: epoch, seed and resume position; a copy of the sampler given
    it yields what the sampler yields. A sampler whose order is fixed has none."""
    from torch.utils.data import SequentialSampler

    from vit.data.process import SamplerState

    sampler = ResumableSampler(range(20), seed=11)
    sampler.set_epoch(3)
    sampler.resume_epoch, sampler.resume_position = 3, 6
    state = SamplerState.of(sampler)
    assert state == SamplerState(epoch=3, seed=11, resume_epoch=3, resume_position=6)
    copy = ResumableSampler(range(20))
    state.apply(copy)
    theirs, ours = list(copy), list(sampler)  # each starts its epoch once at the resume position
    assert theirs == ours and len(ours) == 14
    assert SamplerState.of(SequentialSampler(range(4))) is None
