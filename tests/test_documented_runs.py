"""Every `scripts/train.py` (`vit-train`) command README, docs/ and benchmarks/*.md show builds what it
would run: its config files and options parse, and its datamodule, model and Trainer are made with
them, so their constructors check each value (an option the datamodule does not take, a value a
class refuses, a model name that does not exist). The subcommand then stops before data is read or
a step runs.

Each command is built as on our machines: `../shared/...` and `data/...` (the command's or a config's)
are read from tests.conftest.SHARED, `data/x` as SHARED/data/x; the run writes under a temporary
folder, runs/ and a benchmark's absolute `.../runs/...` too, so no local run is resumed or moved
aside; the Trainer gets one CPU device, as where a run goes (GPUs, nodes, DDP) is not what it is;
and a model past BIG block weights is built on the meta device. A command whose data is not here is
skipped with the reason. Fine-tuning weights that a command downloads or takes from an earlier run
are left out: the rest is built, and the command is then skipped, naming them.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import torch
from jsonargparse import Namespace

from tests.conftest import ROOT, SHARED
from tests.test_documented_commands import COMMANDS, Command
from vit.cli import TrainCLI, _option_error, _raised_by_class
from vit.registry import model_config

TRAIN_COMMANDS = [c for c in COMMANDS if c.target == "scripts/train.py"]
# Transformers past this many block weights (ViT-L/16, ViT-H/14; not ViT-B/16) are built on the meta
# device: their constructors check the same options, without seconds of CPU initialising weights.
BIG = 100_000_000


def _here(path: str) -> str:
    """A path of a documented command (or config) as it is on this machine."""
    if path.startswith("../shared/"):
        return str(SHARED / path.removeprefix("../shared/"))
    if path == "data" or path.startswith("data/"):
        return str(SHARED / path)
    if path.startswith("configs/"):
        return str(ROOT / path)
    return re.sub(r"^/\S*?/runs/", "runs/", path)  # a benchmark's /work/runs/x: runs/x of the working folder


def _arg_here(word: str) -> str:
    option, equals, value = word.partition("=")
    return f"{option}={_here(value)}" if word.startswith("--") and equals else _here(word)


def _fit_to_this_machine(config: Namespace) -> list[str]:
    """The parsed config of one subcommand made to build here, in place: skips the command when its
    data is not here; returns the weights left out (finetune.init_from that is not a file here)."""
    for key, value in list(config.items()):
        if isinstance(value, str):
            config[key] = _here(value)
    root = config.get("data.init_args.root")
    if isinstance(root, str) and "://" in root:
        pytest.skip(f"its data is in object storage ({root})")
    if isinstance(root, str) and not Path(root).exists():
        pytest.skip(f"its data {root} is not here")
    config["trainer.accelerator"], config["trainer.devices"], config["trainer.num_nodes"] = "cpu", 1, 1
    strategy = config.get("trainer.strategy")
    if isinstance(strategy, str) and strategy.startswith("ddp"):
        config["trainer.strategy"] = "auto"  # one device; ShardedStrategy (a class) runs on one CPU as it is
    weights = config.get("model.init_args.finetune.init_from")
    if weights and not Path(weights).is_file():
        config["model.init_args.finetune.init_from"] = None
        return [f"model.finetune.init_from {weights}"]
    return []


def _big(config: Namespace) -> bool:
    """Whether the model is a transformer of more than BIG block weights (12 x depth x width^2)."""
    kwargs = config.get("model.init_args.model_kwargs") or {}
    try:
        shape = model_config(config.get("model.init_args.model_name"))
    except (ValueError, TypeError):
        return False  # a name that is not a model's: building it says so
    depth = kwargs.get("depth", getattr(shape, "depth", 0))
    width = kwargs.get("embed_dim", getattr(shape, "embed_dim", 0))
    return 12 * depth * width**2 > BIG


class BuildOnly(TrainCLI):
    """TrainCLI up to the subcommand: its data, model and Trainer are built, and the subcommand itself
    does nothing (TrainCLI's before_fit would move an earlier run's checkpoints aside)."""

    left_out: list[str]
    on_meta: bool

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand]
        self.left_out, self.on_meta = _fit_to_this_machine(config), _big(config)
        super().before_instantiate_classes()

    def instantiate_classes(self) -> None:
        with torch.device("meta") if self.on_meta else contextlib.nullcontext():
            super().instantiate_classes()

    def before_fit(self) -> None:
        pass

    def fit(self, model: Any, **kwargs: Any) -> None:
        pass

    validate = test = predict = fit

    def after_fit(self) -> None:
        pass


def _reason(e: Exception) -> str:
    """What the class that could not be built raised, without jsonargparse's wrapping."""
    option = _option_error(e)
    if option is not None:
        return option.option_line()
    cause = _raised_by_class(e)
    return f"{type(cause).__name__}: {cause}"


def test_the_docs_show_training_commands_each_with_its_subcommand():
    unread = [c.where for c in TRAIN_COMMANDS if c.argv[:1] not in (["fit"], ["validate"], ["test"], ["predict"])]
    assert len(TRAIN_COMMANDS) > 30 and not unread, unread


@pytest.mark.parametrize("command", TRAIN_COMMANDS, ids=lambda c: c.where)
def test_each_documented_training_command_builds_its_data_model_and_trainer(
    command: Command, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    # --print_config prints and stops before anything is built: build what the same options would.
    args = [_arg_here(word) for word in command.argv if word != "--print_config"]
    monkeypatch.setattr(TrainCLI, "argv", ["scripts/train.py", *args])  # as vit.cli.main sets it
    shown = f"{command.where}: scripts/train.py {shlex.join(command.argv)}"
    errors, failure = io.StringIO(), None
    try:
        with contextlib.redirect_stderr(errors):
            cli = BuildOnly(args=args, save_config_kwargs={"overwrite": True})
    except SystemExit:  # the parser's one-line error, on stderr
        failure = f"does not parse: {errors.getvalue().strip()}"
    except Exception as e:
        failure = f"fails when built: {_reason(e)}"
    if failure is not None:  # failed here, not in the except: the message alone, without the exceptions' chain
        pytest.fail(f"{shown}\n{failure}", pytrace=False)
    data, model = cli.datamodule, cli.model
    assert data is not None and cli.trainer.lightning_module is None  # built, not run
    if hasattr(data, "num_classes"):  # the model is made for the data's classes
        assert model.hparams.num_classes == data.num_classes
    if cli.left_out:
        pytest.skip(f"built without {', '.join(cli.left_out)} (a download or an earlier run's)")
