"""One option chooses the data pipeline (`data.pipeline`: per_sample, memory, device); the options of
a pipeline are its own group (`data.memory`, `data.device`), refused with another pipeline, naming
the one they belong to. The older spelling (`data.in_memory true`, `data.cache_dir`, ...) still works
wherever it is given (command line, config file, Python, a run's saved config), each old option said
in one line with its new spelling, and builds the same spec."""

from __future__ import annotations

import logging

import pytest
import yaml

from tests.conftest import ROOT, write_image_folder
from vit.cli import main
from vit.data import DigitsDataModule, ImageFolderDataModule
from vit.data.datamodules import ImageDataModule
from vit.data.device import DeviceDecode
from vit.data.memory import Memory
from vit.data.pipelines import FromFiles, InMemory, PerSample
from vit.options import OptionError, upgrade

# (old spelling, the same in the new spelling, the lines the old one prints)
SPELLINGS = [
    (dict(in_memory=True), dict(pipeline="memory"),
     ["data.in_memory true is now data.pipeline memory; it still works"]),
    (
        dict(in_memory=True, cache_dir="cache", train_sizes=[[0.5, 16], [0, 8]]),
        dict(pipeline="memory", memory={"cache_dir": "cache", "train_sizes": [[0, 8], [0.5, 16]]}),
        ["data.in_memory true is now data.pipeline memory; it still works",
         "data.cache_dir is now data.memory.cache_dir; it still works",
         "data.train_sizes is now data.memory.train_sizes; it still works"],
    ),
    (
        dict(device_decode=True, device_prefetch=2, worker_decode=0.25, augment={"crop": "rrc"}),
        dict(pipeline="device", device={"prefetch": 2, "worker_decode": 0.25}, augment={"crop": "rrc"}),
        ["data.device_decode true is now data.pipeline device; it still works",
         "data.device_prefetch is now data.device.prefetch; it still works",
         "data.worker_decode is now data.device.worker_decode; it still works"],
    ),
    (
        dict(in_memory=False, device_decode=True, augment={"crop": "resize"}),
        dict(pipeline="device", augment={"crop": "resize"}),
        ["data.in_memory false is now data.pipeline per_sample in place of memory; it still works",
         "data.device_decode true is now data.pipeline device; it still works"],
    ),
    (dict(in_memory=False, device_decode=False), dict(), [
        "data.in_memory false is now data.pipeline per_sample in place of memory; it still works",
        "data.device_decode false is now data.pipeline per_sample in place of device; it still works"]),
]  # fmt: skip


@pytest.mark.parametrize(("old", "new", "lines"), SPELLINGS, ids=[str(i) for i in range(len(SPELLINGS))])
def test_the_older_spelling_builds_the_spec_and_pipeline_of_the_new_one_saying_each_in_a_line(caplog, old, new, lines):
    with caplog.at_level(logging.WARNING, logger="vit"):
        before = DigitsDataModule(**old)
    assert caplog.messages == lines
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="vit"):
        after = DigitsDataModule(**new)
    assert caplog.messages == []  # the new spelling says nothing
    assert before.spec == after.spec and type(before.composed) is type(after.composed)


def test_each_pipeline_is_named_by_one_option_with_its_own_group(tmp_path):
    memory = DigitsDataModule(pipeline="memory", memory={"cache_dir": "c", "train_sizes": [[0.5, 16], [0, 8]]})
    assert type(memory.composed) is InMemory and memory.spec.memory == Memory("c", [(0.0, 8), (0.5, 16)])
    assert memory.memory.cache_dir == "c" and memory.pipeline == "memory"  # read as the datamodule's own
    assert type(DigitsDataModule().composed) is PerSample and DigitsDataModule().pipeline == "per_sample"
    folder = write_image_folder(tmp_path / "data", classes=2, train=2, val=1, size=32, ext="jpg")
    device = ImageFolderDataModule(str(folder), img_size=224, pipeline="device", device={"prefetch": 0})
    assert type(device.composed) is FromFiles and device.spec.device == DeviceDecode(prefetch=0, worker_decode=0.0)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(device={"prefetch": 1}), r"^data\.device\.prefetch: got 1, expected null unless --data\.pipeline device "
                                       r"\(an option of the device pipeline; --data\.pipeline is per_sample\)$"),
        (dict(pipeline="memory", device={"worker_decode": 0.5}),
         r"^data\.device\.worker_decode: got 0\.5, expected 0\.0 unless --data\.pipeline device .* is memory\)$"),
        (dict(memory={"cache_dir": "c"}),
         r"^data\.memory\.cache_dir: got 'c', expected null unless --data\.pipeline memory \(an option of the memory "
         r"pipeline; --data\.pipeline is per_sample\)$"),
        (dict(device_prefetch=1), r"^data\.device\.prefetch: got 1, expected null unless --data\.pipeline device"),
        (dict(in_memory=True, device_decode=True),
         r"^data\.device_decode: got True, expected left out with in_memory \(they give pipeline memory and device\)$"),
        (dict(pipeline="device", in_memory=True),
         r"^data\.in_memory: got True, expected left out with pipeline device \(it gives pipeline memory\)$"),
    ],
)  # fmt: skip
def test_an_option_of_another_pipeline_or_two_pipelines_at_once_are_refused(options, message):
    with pytest.raises(OptionError, match=message):
        DigitsDataModule(**options)


def test_a_runs_saved_config_with_the_older_spelling_builds_its_datamodule(tmp_path, caplog):
    """As vit-rollout builds a run's datamodule from its config.yaml (vit.tools.rollout.items_from_config),
    and as the options upgrade in a stored mapping (vit.options.upgrade, what checkpoints' use)."""
    saved = {"class_path": "vit.data.DigitsDataModule",
             "init_args": {"batch_size": 32, "in_memory": True, "cache_dir": str(tmp_path / "cache"),
                           "train_sizes": None, "device_decode": False, "device_prefetch": None,
                           "worker_decode": 0.0, "data_process": None}}  # fmt: skip
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"data": saved}))
    init_args = yaml.safe_load((tmp_path / "config.yaml").read_text())["data"]["init_args"]
    with caplog.at_level(logging.WARNING, logger="vit"):
        data = DigitsDataModule(**init_args)
    assert data.pipeline == "memory" and data.memory.cache_dir == str(tmp_path / "cache")
    assert len(caplog.messages) == 4  # in_memory, cache_dir, device_decode false, worker_decode (not the Nones)
    upgraded = upgrade(init_args, ImageDataModule.RENAMED, {"pipeline": "per_sample"})
    assert upgraded == {"batch_size": 32, "data_process": None, "pipeline": "memory",
                        "memory": {"cache_dir": str(tmp_path / "cache")}, "device": {"worker_decode": 0.0}}  # fmt: skip
    assert DigitsDataModule(**upgraded).spec == data.spec


def _fit(tmp_path, *options: str):
    return main(["fit", "--config", "configs/default.yaml", "--trainer.default_root_dir", str(tmp_path / "run"),
                 "--trainer.max_steps", "2", "--trainer.limit_val_batches", "1", "--trainer.logger", "false",
                 "--trainer.enable_progress_bar", "false", "--data.num_workers", "0", *options])  # fmt: skip


def test_old_flags_on_the_command_line_train_saying_each_once(tmp_path, capsys):
    cli = _fit(tmp_path, "--data.in_memory", "true", "--data.cache_dir", str(tmp_path / "cache"))
    err = capsys.readouterr().err.splitlines()
    said = [line for line in err if "it still works" in line]
    assert said == ["[vit] data.in_memory true is now data.pipeline memory; it still works",
                    "[vit] data.cache_dir is now data.memory.cache_dir; it still works"]  # fmt: skip
    assert cli.trainer.global_step == 2 and type(cli.datamodule.composed) is InMemory
    assert cli.datamodule.memory.cache_dir == str(tmp_path / "cache")
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["data"]["init_args"]
    assert saved["pipeline"] == "per_sample" and saved["in_memory"] is True  # as given; not the unset old ones
    assert "device_prefetch" not in saved and "worker_decode" not in saved


def test_an_old_flag_turns_off_the_pipeline_a_new_config_chooses(tmp_path, caplog):
    """configs/cifar10_vit.yaml says `pipeline: memory`; `--data.in_memory false` trains per sample."""
    folder = write_image_folder(tmp_path / "data", classes=2, train=2, val=1, size=32)
    args = ["fit", "--config", str(ROOT / "configs/cifar10_vit.yaml"), "--data", "vit.data.ImageFolderDataModule",
            "--data.root", str(folder), "--data.in_memory", "false", "--trainer.max_steps", "1",
            "--trainer.limit_val_batches", "1", "--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
            "--trainer.default_root_dir", str(tmp_path / "run"), "--data.num_workers", "0",
            "--data.batch_size", "2"]  # fmt: skip
    cli = main(args)
    assert cli.datamodule.pipeline == "per_sample" and type(cli.datamodule.composed) is PerSample


def test_an_option_of_another_pipeline_on_the_command_line_is_one_line_naming_its_pipeline(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        _fit(tmp_path, "--data.device.prefetch", "1")
    assert stop.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: --data.device.prefetch: got 1, expected null unless --data.pipeline device (an option of the "
        "device pipeline; --data.pipeline is per_sample)"
    )


def test_print_config_shows_the_pipeline_and_its_groups_and_not_the_older_spelling(capsys):
    with pytest.raises(SystemExit):
        main(["fit", "--config", "configs/cifar10_vit.yaml", "--data.memory.cache_dir", "c", "--print_config"])
    data = yaml.safe_load(capsys.readouterr().out)["data"]["init_args"]
    assert data["pipeline"] == "memory" and data["memory"] == {"cache_dir": "c", "train_sizes": None}
    assert data["device"] == {"prefetch": None, "worker_decode": 0.0} and data["data_process"] is None
    assert not {"in_memory", "device_decode", "cache_dir", "train_sizes", "device_prefetch", "worker_decode"} & set(
        data
    )


def test_a_config_file_in_the_older_spelling_trains_saying_each_once(tmp_path, capsys):
    old = tmp_path / "old.yaml"
    old.write_text(yaml.safe_dump({"data": {"init_args": {"in_memory": True, "train_sizes": [[0, 16]]}}}))
    cli = _fit(tmp_path, "--config", str(old))
    said = [line for line in capsys.readouterr().err.splitlines() if "it still works" in line]
    assert said == ["[vit] data.in_memory true is now data.pipeline memory; it still works",
                    "[vit] data.train_sizes is now data.memory.train_sizes; it still works"]  # fmt: skip
    assert cli.datamodule.spec.memory.train_sizes == [(0.0, 16)] and type(cli.datamodule.composed) is InMemory
