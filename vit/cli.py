"""The command line of scripts/train.py: a LightningCLI with our checkpoint defaults and a summary."""

from __future__ import annotations

import dataclasses
import inspect
import logging
import math
import re
import shlex
import shutil
import sys
import sysconfig
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback, ProgressBar, TQDMProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

# --data's classes, so --help lists them among jsonargparse's known subclasses
import vit.data.datamodules
import vit.data.text  # noqa: F401
from vit.cli_errors import class_of, short_parse_error
from vit.data.images import CorruptImageError
from vit.data.process import DataProcessFailed
from vit.fault_tolerance import (
    EXIT_CODES,
    CheckpointConflictError,
    CheckpointWriteError,
    IncompleteCheckpointError,
    NonFiniteLossError,
    RunCheckpoint,
    checkpoint_complete,
    checkpoint_dir,
    destroy_process_group,
    failure_message,
    interruptible,
    remove_stale_temporaries,
    resume_checkpoint,
    sigterm_ends_data_waits,
    stop_message,
    stop_signal,
)
from vit.options import OptionError, StillWorks, group_default, option_groups
from vit.weights import timm_preprocessing

log = logging.getLogger(__name__)


class ConflictingOptionsError(ValueError):
    """Two options that must agree (a value set on the data and given to the model too) do not."""


def _checkpoint_dirpath(default_root_dir: str | None) -> str:
    return str(checkpoint_dir(default_root_dir))  # a string, as the config file shows it


# Set once, on the data; the model follows (TrainCLI).
LINKED_FROM_DATA = ("img_size", "num_classes")
# Model options a run resumed from a checkpoint file may change (the optimizer state is rescaled to
# the new lr: vit.training.rescale_lr); any other differing option is refused.
RESUMABLE_MODEL_OPTIONS = ("optimizer.lr",)


def _plain(value: Any) -> Any:
    """Config values as comparable plain data (tuples and lists alike, namespaces and option groups as dicts)."""
    if hasattr(value, "as_dict"):
        value = value.as_dict()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _by_dotted_name(values: dict[str, Any], groups: set[str]) -> dict[str, Any]:
    """Options by name, each group's fields by their own (`optimizer.lr`); model_kwargs stays one value."""
    flat: dict[str, Any] = {}
    for name, value in values.items():
        if name in groups and isinstance(value, dict):
            flat.update({f"{name}.{field}": v for field, v in value.items()})
        else:
            flat[name] = value
    return flat


def _null_group_fields(args: list[str]) -> list[str]:
    """`--model.finetune.layer_decay null` as `--model.finetune "{layer_decay: null}"`: jsonargparse
    (4.53) reads `null` given to a group's field of a subclass's init_args as the text "None",
    which a float field refuses and a str field keeps; given as the group's mapping it is None, and
    the group's other fields keep their values."""
    pattern = re.compile(r"--(model|data)\.(?!init_args\.|dict_kwargs\.)(\w+)\.(\w+)(?:=(null|None))?$")
    out, i = [], 0
    while i < len(args):
        arg = args[i]
        match = pattern.match(arg) if isinstance(arg, str) else None
        value = match and (match[4] or (args[i + 1] if i + 1 < len(args) and match[4] is None else None))
        if match and value in ("null", "None") and match[2] != "model_kwargs":
            out += [f"--{match[1]}.{match[2]}", f"{{{match[3]}: null}}"]
            i += 1 if match[4] else 2
            continue
        out.append(arg)
        i += 1
    return out


def _without_unset_old_options(cfg: Any) -> Any:
    """`cfg` without the data class's older options that still work (RENAMED's StillWorks) where
    they are None: not given, as their new spelling says what runs."""
    data = cfg.get("data") if hasattr(cfg, "get") else None
    init_args = getattr(data, "init_args", None) if data is not None and not isinstance(data, dict) else None
    if init_args is None or not getattr(data, "class_path", None):
        return cfg
    try:
        renamed = getattr(class_of(data.class_path), "RENAMED", {})
    except (ImportError, AttributeError):
        return cfg
    unset = [name for name, new in renamed.items() if isinstance(new, StillWorks) and name in init_args
             and init_args[name] is None]  # fmt: skip
    if not unset:
        return cfg
    cfg = cfg.clone()
    for name in unset:
        del cfg.data.init_args[name]
    return cfg


def _differs(given: Any, saved: Any) -> bool:
    """A dict option (model_kwargs) differs when a key given has another value in the checkpoint; keys
    only the checkpoint has were filled in by the run (a language model's vocab_size, from its data)."""
    if isinstance(given, dict) and isinstance(saved, dict):
        return any(key not in saved or _differs(value, saved[key]) for key, value in given.items())
    return given != saved


class TrainArgumentParser(LightningArgumentParser):
    """jsonargparse's parser with short errors: a mistyped option is named with the closest real
    one (not a 65-line usage dump), and option prefixes are not taken as abbreviations
    (`--trainer.max_epoch` is an error, not max_epochs)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def dump(self, cfg: Any, *args: Any, **kwargs: Any) -> str:
        """The config as jsonargparse writes it, less the data's older options left unset: `--print_config`
        and a run's config.yaml spell each option once, the new way (vit.options.StillWorks)."""
        return super().dump(_without_unset_old_options(cfg), *args, **kwargs)

    def error(self, message: str, ex: Exception | None = None) -> Any:
        short = short_parse_error(message, self, TrainCLI.argv) if self.exit_on_error else None
        if short is None:
            return super().error(message, ex)
        sys.stderr.write(f"error: {short}\n")
        sys.exit(2)


class StepsProgressBar(TQDMProgressBar):
    """TQDM's bar, which counts batches only when it refreshes: at the end of a run that stops
    mid-epoch (max_steps, a time budget, a signal) it shows every batch trained, not the count of
    its last refresh."""

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        super().on_train_batch_end(trainer, pl_module, *args)
        self.trained = args[-1] + 1  # batch_idx

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        bar = self.train_progress_bar
        if not bar.disable and getattr(self, "trained", bar.n) != bar.n:
            bar.n = self.trained
            bar.refresh()
        super().on_train_end(trainer, pl_module)


class LogCadence(Callback):
    """For a run whose `log_every_n_steps` was not given: about 50 points of each training curve,
    one every `batches // 50` (at least 1, at most Lightning's 50), so a short run draws its loss
    curve in TensorBoard rather than nothing until step 50."""

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        batches = trainer.estimated_stepping_batches * trainer.accumulate_grad_batches
        if math.isfinite(batches):
            trainer.log_every_n_steps = min(50, max(1, int(batches) // 50))


def _use_weights_preprocessing(config: Any) -> None:
    """Weights from timm (`model.finetune.init_from`) are fine-tuned with their own mean, std and
    evaluation crop (timm's pretrained config: SigLIP's 0.5, CLIP's and EVA-02's own, ...), which
    the checkpoint then records for vit-predict and the exports. A value the data was given (not its
    class's default) wins, said in one line naming both."""
    model, data = config.get("model"), config.get("data")
    model_args = getattr(model, "init_args", None) or {}
    data_args = getattr(data, "init_args", None) or {}
    init_from = getattr(model_args.get("finetune"), "init_from", None)
    options = ("mean", "std", "eval_crop_pct")
    if not init_from or not all(name in data_args for name in options) or not model_args.get("model_name"):
        return
    found = timm_preprocessing(init_from, model_args["model_name"])
    if found is None:
        return
    weights, where = found
    data_class, used = class_of(data.class_path), {}
    crop_pct = weights["crop_pct"] if data_args.get("naflex") is None else 1.0  # patch sequences see whole images
    for name, value in (("mean", weights["mean"]), ("std", weights["std"]), ("eval_crop_pct", crop_pct)):
        given, default = data_args[name], group_default(data_class, name)
        if given is None or _plain(given) == _plain(default):
            data_args[name] = used[name] = value
        elif _plain(given) != _plain(value):
            log.warning("--data.%s %s is used, not %s of %s", name, _plain(given), _plain(value), where)
    if used:
        log.info("the weights' preprocessing (%s): %s", where, ", ".join(f"{k} {_plain(v)}" for k, v in used.items()))
    if weights.get("interpolation") not in (None, "bicubic"):
        log.warning("%s resizes %s; evaluation here resizes bicubic", where, weights["interpolation"])


def _not_a_tip(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("💡 Tip:")


def quiet_lightning_notices() -> None:
    """Leave out what Lightning says on every run that a user of this command cannot act on: its tips
    to install litlogger and litmodels (Lightning has no option to turn them off), torch's
    FutureWarning at Lightning's own use of `LeafSpec`, and that the checkpoint folder is not empty
    (it holds `earlier/`, where before_fit moves an earlier run's checkpoints: the runs never mix)."""
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(_not_a_tip)
    warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")
    warnings.filterwarnings(
        "ignore",
        message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
        category=FutureWarning,
        module=r"lightning\.pytorch\.utilities\._pytree",
    )


def _as_typed(path: Path) -> str:
    """A path as one shell word, relative to the working folder when it is inside it."""
    path = path.absolute()
    if path.is_relative_to(Path.cwd()):
        path = path.relative_to(Path.cwd())
    return shlex.quote(str(path))


def tensorboard_command(log_dir: str) -> str:
    """The command that shows a run's logs, as it runs when pasted into the shell that started the run:
    a virtual environment's own `tensorboard` by its path (`.venv/bin/tensorboard`, which works
    whether the environment is activated or not), else the one on PATH; without TensorBoard, the
    command that installs it into this Python."""
    program = Path(sysconfig.get_path("scripts")) / "tensorboard"
    logs = shlex.quote(str(log_dir))
    in_venv = sys.prefix != sys.base_prefix
    if program.is_file() and (in_venv or shutil.which("tensorboard") != str(program)):
        return f"{_as_typed(program)} --logdir {logs}"
    if shutil.which("tensorboard"):
        return f"tensorboard --logdir {logs}"
    return f"TensorBoard is not installed: {_as_typed(Path(sys.executable))} -m pip install tensorboard"


class TrainCLI(LightningCLI):
    """`checkpoint:` configures the ModelCheckpoint every run has: the best (by `monitor`) and the
    last checkpoint, in <trainer.default_root_dir>/checkpoints, so `--ckpt_path last` resumes.

    The image side and the class count are set once, on the data: `data.img_size` and
    `data.num_classes` (an image folder counts its class folders) become the model's `img_size` and
    `num_classes` when the classes are instantiated (`link_arguments`, apply_on="instantiate"). A
    value the user also gives the model (`--model.num_classes`, `model_kwargs.img_size`, or one read
    back from a checkpoint) must agree: otherwise the run stops before training with both values.
    Data without them (vit.data.TextDataModule) and models without them (LanguageModel) are left
    alone; the language model takes its vocabulary from the data itself.
    """

    argv: list[str] = sys.argv  # the command line, for the resume command printed when a run is stopped

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("parser_class", TrainArgumentParser)
        super().__init__(*args, **kwargs)

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_lightning_class_args(RunCheckpoint, "checkpoint")
        parser.set_defaults(
            {
                "checkpoint.monitor": "val/acc1",
                "checkpoint.mode": "max",
                "checkpoint.save_last": True,
                "checkpoint.filename": "best-epoch{epoch:03d}-step{step}",
                "checkpoint.auto_insert_metric_name": False,
            }
        )
        parser.link_arguments("trainer.default_root_dir", "checkpoint.dirpath", compute_fn=_checkpoint_dirpath)
        for name in LINKED_FROM_DATA:
            parser.link_arguments(f"data.{name}", f"model.init_args.{name}", apply_on="instantiate")

    def before_instantiate_classes(self) -> None:
        """Note what the model was given for the linked values (the link overwrites them), and: a
        model class that names its own metric (class attributes `monitor` and `monitor_mode`, e.g.
        LanguageModel's val/loss, lower is better) replaces the image default val/acc1, max, unless
        the checkpoint's monitor was set to something else."""
        config = self.config[self.subcommand] if self.subcommand else self.config
        init_args = getattr(config.get("model"), "init_args", None) or {}
        self._given_to_model = {name: init_args.get(name) for name in LINKED_FROM_DATA if name in init_args}
        _use_weights_preprocessing(config)
        class_path = getattr(config.get("model"), "class_path", None)
        if not class_path or config.get("checkpoint") is None or config.checkpoint.monitor != "val/acc1":
            return
        model_cls = class_of(class_path)
        if hasattr(model_cls, "monitor"):
            config.checkpoint.monitor = model_cls.monitor
            config.checkpoint.mode = getattr(model_cls, "monitor_mode", "min")

    def after_instantiate_classes(self) -> None:
        super().after_instantiate_classes()
        for name, given in getattr(self, "_given_to_model", {}).items():
            data_value = getattr(self.datamodule, name, None)
            if given is not None and data_value is not None and given != data_value:
                raise ConflictingOptionsError(
                    f"model.{name} is {given} but data.{name} is {data_value}; set it once, on the data "
                    "(the model follows it)"
                )

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        """Unless a progress bar is configured or the bar is off, it refreshes every
        `log_every_n_steps` steps, when the loggers read the logged values anyway: Lightning's
        default bar shows the loss after every step, reading it back from the device, so the host
        would wait for each step to finish before queueing the next."""
        # The trainer's options, under the subcommand if any: LightningCLI's private _get, from public attributes.
        config = self.config_init.get(str(self.subcommand), self.config_init).get("trainer", {})
        callbacks = config.get("callbacks") or []
        callbacks = callbacks if isinstance(callbacks, list) else [callbacks]
        extra: list[Callback] = [] if config.get("log_every_n_steps") else [LogCadence()]
        if config.get("enable_progress_bar") is not False and not any(isinstance(c, ProgressBar) for c in callbacks):
            every = config.get("log_every_n_steps") or 50  # Lightning's default
            extra.append(StepsProgressBar(refresh_rate=every))
        if extra:
            kwargs.setdefault("callbacks", [*callbacks, *extra])
        return super().instantiate_trainer(**kwargs)

    def before_fit(self) -> None:
        """A fresh run must not mix its checkpoints with an earlier run's in the same directory:
        move those aside (never delete them), so `last` and `best` are unambiguous. Temporary files
        that a kill during a write left behind are removed (a resumed run's too)."""
        if not self.trainer.is_global_zero:
            return
        ckpt_dir = Path(self.trainer.checkpoint_callback.dirpath)
        for tmp in remove_stale_temporaries(ckpt_dir):
            log.info("removed %s, left by a write that was interrupted", tmp)
        if self.config.fit.get("ckpt_path") is not None:
            return
        old = sorted(ckpt_dir.glob("*.ckpt")) if ckpt_dir.is_dir() else []
        if old:
            archive = ckpt_dir / "earlier" / time.strftime("%Y%m%d-%H%M%S")
            archive.mkdir(parents=True)
            for path in old:
                path.rename(archive / path.name)
            print(f"Moved {len(old)} checkpoint(s) of an earlier run to {archive} (resume it with --ckpt_path PATH)")

    # Overrides a private hook of LightningCLI (listed in vit.lightning_compat.PRIVATE_MEMBERS).
    def _parse_ckpt_path(self) -> None:
        """`--ckpt_path last` becomes the newest complete `last*.ckpt` of the run's checkpoint
        folder (by saved step; incomplete ones skipped with a warning); a named file that is
        incomplete is refused by name. Both before Lightning reads the hyperparameters.

        Lightning then replaces the model options with the checkpoint's. Options the user set (in
        the config or on the command line: values other than the model class's defaults) that
        differ from the checkpoint's would be dropped silently, or fail half-way through restoring
        (another optimizer): refuse them, naming both values, except RESUMABLE_MODEL_OPTIONS, which
        keep the user's value. The values set on the data (LINKED_FROM_DATA) come from the data;
        the checkpoint's are checked against them when it is loaded (vit.lit.ImageClassifier)."""
        subcommand = self.config.get("subcommand")
        if not subcommand:
            return super()._parse_ckpt_path()
        config = self.config[subcommand]
        ckpt_path, named = config.get("ckpt_path"), config.get("ckpt_path")
        if ckpt_path == "last":
            ckpt_path = self._resolve_last(config)
            if ckpt_path is None:
                return None  # nothing saved yet: Lightning warns and starts from scratch
            config.ckpt_path, named = str(ckpt_path), f"last ({ckpt_path})"
        if not (ckpt_path and Path(ckpt_path).is_file()):
            return super()._parse_ckpt_path()
        if not checkpoint_complete(ckpt_path):
            raise IncompleteCheckpointError(
                f"checkpoint {ckpt_path} is incomplete ({Path(ckpt_path).stat().st_size} bytes: empty or "
                "truncated, e.g. by a full disk or a kill while it was written); resume from another one"
            )
        model_class = self._model_class_of(subcommand)
        groups = set(option_groups(model_class)) if model_class is not None else set()
        given = self._model_options_given(subcommand, groups)
        saved = torch.load(ckpt_path, weights_only=True, map_location="cpu", mmap=True).get("hyper_parameters", {})
        saved_class = class_of(saved["_class_path"]) if "_class_path" in saved else model_class
        upgrade = getattr(saved_class, "upgrade_hparams", None)  # a checkpoint from before the option groups
        saved = upgrade(saved) if upgrade is not None else dict(saved)
        flat_saved = _by_dotted_name(_plain(saved), groups)
        conflicts = [
            f"model.{name} is {value!r} here but {flat_saved[name]!r} in the checkpoint"
            for name, value in given.items()
            if name in flat_saved and name not in RESUMABLE_MODEL_OPTIONS and _differs(value, flat_saved[name])
        ]
        if conflicts:
            raise CheckpointConflictError(
                f"--ckpt_path {named} resumes the run it was saved from, but " + "; ".join(conflicts)
                + ". Drop these options to resume as it was, or start a new run from its weights with "
                f"--model.finetune.init_from {ckpt_path}"
            )  # fmt: skip
        self._use_checkpoint_options(subcommand, saved)
        init_args = self.config[subcommand].model.init_args
        for name in RESUMABLE_MODEL_OPTIONS:
            if name in given:
                init_args[name] = given[name]
        for name in LINKED_FROM_DATA:
            init_args.pop(name, None)
        return None

    def _use_checkpoint_options(self, subcommand: str, hparams: dict[str, Any]) -> None:
        """Lightning's reading of a checkpoint's model options into the config (LightningCLI's
        _parse_ckpt_path), from the hyperparameters as upgrade_hparams left them."""
        hparams = dict(hparams)
        hparams.pop("_instantiator", None)
        if not hparams:
            return
        if "_class_path" in hparams:
            hparams = {"class_path": hparams.pop("_class_path"), "dict_kwargs": hparams}
        self.config = self.parser.parse_object({subcommand: {"model": hparams}}, self.config)

    def _model_class_of(self, subcommand: str) -> type | None:
        class_path = getattr(self.config[subcommand].get("model"), "class_path", None)
        return class_of(class_path) if class_path else None

    def _resolve_last(self, config: Any) -> Path | None:
        checkpoint = config.get("checkpoint")
        directory = checkpoint.get("dirpath") if checkpoint is not None else None
        directory = directory or checkpoint_dir(config.get("trainer", {}).get("default_root_dir"))
        newest, candidates = resume_checkpoint(directory)
        if newest is None and candidates:
            raise IncompleteCheckpointError(
                f"--ckpt_path last: none of {', '.join(map(str, candidates))} is a complete checkpoint"
            )
        return newest

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        self._cli_args = list(args) if isinstance(args, (list, tuple)) else sys.argv[1:] if args is None else []
        nulled = _null_group_fields(self._cli_args)
        if nulled == self._cli_args:
            return super().parse_arguments(parser, args)
        with warnings.catch_warnings():  # the arguments are the command line's, rewritten
            warnings.filterwarnings("ignore", message="LightningCLI's args parameter")
            return super().parse_arguments(parser, nulled)

    def _model_options_given(self, subcommand: str, groups: set[str]) -> dict[str, Any]:
        """The model's options the user set, by dotted name (`optimizer.lr`): named on the command
        line, or differing from the class's defaults (in a config file)."""
        model = self.config[subcommand].get("model")
        class_path, init_args = getattr(model, "class_path", None), getattr(model, "init_args", None)
        if not class_path or init_args is None:
            return {}
        signature = inspect.signature(class_of(class_path)).parameters
        defaults = _by_dotted_name(
            {k: _plain(p.default) for k, p in signature.items() if p.default is not inspect.Parameter.empty}, groups
        )
        values = _by_dotted_name(_plain(init_args), groups)
        named = set()
        for arg in getattr(self, "_cli_args", []):
            if isinstance(arg, str) and arg.startswith("--model."):
                parts = arg.split("=")[0].removeprefix("--model.").removeprefix("init_args.").split(".")
                named.add(".".join(parts[:2]) if parts[0] in groups else parts[0])
        return {
            k: v
            for k, v in values.items()
            if k.split(".")[0] in signature
            and (k not in defaults or v != defaults[k] or k in named)
            and k not in LINKED_FROM_DATA
        }

    def fit(self, model: Any, **kwargs: Any) -> None:
        """`trainer.fit`, stopped honestly: after a signal, one line naming the checkpoint and the
        command that resumes, then exit 130 (SIGINT) or 143 (SIGTERM); after its data process was
        lost (killed, stopped, hung), the same line with what happened to it, then exit 1."""
        with sigterm_ends_data_waits(self.trainer):
            try:
                self.trainer.fit(model, **kwargs)
            except (KeyboardInterrupt, SystemExit) as e:
                name = stop_signal(e)
                if name is None:
                    raise
                if self.trainer.is_global_zero:
                    print(stop_message(self.trainer, name, self.argv), file=sys.stderr, flush=True)
                sys.exit(EXIT_CODES[name])
            except DataProcessFailed as e:  # this process's own: said on whichever rank it is
                print(failure_message(self.trainer, str(e), self.argv), file=sys.stderr, flush=True)
                sys.exit(1)

    def after_fit(self) -> None:
        """Say where the results went."""
        trainer = self.trainer
        if not trainer.is_global_zero:
            return
        ckpt = trainer.checkpoint_callback
        lines = ["", "Done."]
        if ckpt is not None and ckpt.best_model_score is not None:
            lines.append(f"  best {ckpt.monitor}: {float(ckpt.best_model_score):.4f}  ({ckpt.best_model_path})")
        if ckpt is not None and ckpt.last_model_path:
            lines.append(f"  last checkpoint: {ckpt.last_model_path}")
        if trainer.logger is not None and trainer.logger.log_dir:
            log_dir = trainer.logger.log_dir
            lines.append(f"  TensorBoard logs: {log_dir}  ({tensorboard_command(log_dir)})")
        print("\n".join(lines), flush=True)


def main(args: list[str] | None = None) -> Any:
    # Tensor cores: TF32 matmuls on Ampere+ GPUs; no effect on CPU.
    torch.set_float32_matmul_precision("high")
    show_our_logs()
    quiet_lightning_notices()
    TrainCLI.argv = ["scripts/train.py", *args] if args is not None else sys.argv
    # SIGINT stops the command from here on, as it stops training, even if the shell started it with
    # SIGINT ignored (interruptible); before training nothing is saved, so it stops at once.
    with interruptible():
        try:
            cli = TrainCLI(
                args=args,
                save_config_kwargs={"overwrite": True},
            )
        except KeyboardInterrupt:  # during training, fit says where the run was saved
            print("Stopped by SIGINT before training started; nothing trained, so no checkpoint.", file=sys.stderr)
            sys.exit(EXIT_CODES["SIGINT"])
        except (
            NonFiniteLossError,
            CheckpointWriteError,
            IncompleteCheckpointError,
            CheckpointConflictError,
            CorruptImageError,
            ConflictingOptionsError,
        ) as e:
            print(f"\nerror: {_message(e)}", file=sys.stderr)
            sys.exit(1)
        except OSError as e:
            if not _raised_by_us(e):  # a library's or the system's: its traceback is the evidence
                raise
            # Data that is not there (a CIFAR root, a failed download): our message already says what to do.
            print(f"\nerror: {e}", file=sys.stderr)
            sys.exit(1)
        except ValueError as e:
            option = _option_error(e)
            if option is not None:  # a value an option does not take, found when it was set
                print(f"error: {option.option_line()}", file=sys.stderr)
                sys.exit(2)
            cause = _root_cause(e)
            if cause is e or not (isinstance(cause, OSError) or "Does not validate against any" in str(e)):
                raise
            # A class that could not be built from the config (e.g. a data root that does not exist, an
            # option its constructor refuses): jsonargparse wraps the reason in a dump of every subtype
            # tried; say the reason alone, as the class raised it (its advice with the library's cause).
            print(f"\nerror: {_raised_by_class(e)}", file=sys.stderr)
            sys.exit(1)
    destroy_process_group()  # a finished DDP or sharded run exits 0, not a teardown abort
    return cli


def _message(e: BaseException) -> str:
    """The exception's own message; for one re-raised from a DataLoader worker ("Caught X in
    DataLoader worker process 0. Original Traceback ..."), the original's last line."""
    text = str(e)
    if "Original Traceback" in text:
        last = text.strip().splitlines()[-1]
        text = last.split(": ", 1)[1] if ": " in last else last
    return text


def _raised_by_us(e: BaseException) -> bool:
    """Whether `e` is an OSError a line of the vit package raised with its own message: no errno, as
    `raise FileNotFoundError("...")` has and a bare `open()` of a missing file has not."""
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None or not str(e) or getattr(e, "errno", None) is not None:
        return False
    return Path(tb.tb_frame.f_code.co_filename).resolve().is_relative_to(Path(__file__).resolve().parent)


def _option_error(e: BaseException | None) -> OptionError | None:
    """The OptionError behind `e` (jsonargparse wraps what a class raises while it is built)."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, OptionError):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def _raised_by_class(e: BaseException) -> BaseException:
    """The error under jsonargparse's wrappers: what the class being built raised."""
    wrapper = re.compile(r"Does not validate against any|Problem with given class_path")
    while e.__cause__ is not None and wrapper.match(str(e)):
        e = e.__cause__
    return e


def _root_cause(e: BaseException) -> BaseException:
    while e.__cause__ is not None:
        e = e.__cause__
    return e


class _Stderr(logging.StreamHandler):
    """A handler writing to sys.stderr as it is when a line is logged (redirected, or a test's
    capture), not as it was when the handler was made: that stream may be closed by then."""

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:  # StreamHandler.__init__ sets it; sys.stderr is read instead
        pass


def show_our_logs() -> None:
    """Our INFO lines (e.g. which checkpoint keys were resampled or re-initialised) on stderr."""
    logger = logging.getLogger("vit")
    if not logger.handlers:
        handler = _Stderr()
        handler.setFormatter(logging.Formatter("[vit] %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


if __name__ == "__main__":
    main()
