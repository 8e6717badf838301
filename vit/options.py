"""Option groups: a model's or datamodule's related options as one frozen dataclass
(vit.training.Optimizer, vit.lit.FineTune, vit.data.Augment, ...), nested in the config.

A group is given as the dataclass (the CLI builds it from `--model.optimizer.lr 3e-4` or a config's
`optimizer: {lr: 3e-4}`), in Python as a mapping of the fields that differ from the class's default
for it, or None where that default is None. Where it is stored (hyperparameters, checkpoints) it is
a plain dict. A class lists its options from before the groups in `RENAMED`: an old name -> its
place ("group.field"), which the CLI names when the old one is given, while checkpoints with the old
names still load (vit.training.TrainingTask.upgrade_hparams); or -> `StillWorks`, an old option the
class still takes wherever it is given, saying its new spelling in one line (vit.data.ImageDataModule's
`in_memory`, now `pipeline: memory`).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import numbers
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

Group = TypeVar("Group")


def option_groups(cls: type) -> dict[str, type]:
    """The option groups of `cls.__init__` and of the bases it passes **kwargs to: name -> dataclass."""
    groups: dict[str, type] = {}
    for klass in reversed(cls.__mro__):
        if "__init__" not in vars(klass) or klass is object:
            continue
        for name, hint in typing.get_type_hints(klass.__init__).items():
            kind = next((t for t in (*typing.get_args(hint), hint) if dataclasses.is_dataclass(t)), None)
            if kind is not None:
                groups[name] = kind
    return groups


def group_default(cls: type, name: str) -> Any:
    """The default of argument `name` in the first `__init__` along the MRO that declares it."""
    for klass in cls.__mro__:
        if "__init__" in vars(klass):
            parameter = inspect.signature(klass.__init__).parameters.get(name)
            if parameter is not None:
                return parameter.default
    raise TypeError(f"{cls.__name__} has no option {name}")


def option_group(kind: type[Group], value: Group | Mapping[str, Any] | None, default: Group | None) -> Group | None:
    """`value` as the dataclass `kind`: a mapping changes only the fields it names of `default`."""
    if value is None or isinstance(value, kind):
        return value
    if not isinstance(value, Mapping):
        raise TypeError(f"expected a {kind.__name__} or a mapping of its options, got {value!r}")
    names = {f.name for f in dataclasses.fields(kind)}
    unknown = sorted(set(value) - names)
    if unknown:
        raise ValueError(f"{kind.__name__} has no option {', '.join(unknown)}; its options: {', '.join(sorted(names))}")
    return dataclasses.replace(default, **value) if default is not None else kind(**value)


def set_option_groups(obj: object, **given: Any) -> tuple[dict[str, Any] | None, ...]:
    """Each group given to `obj`'s __init__ set on `obj` under its name as its dataclass (defaults:
    those of `type(obj)`, a subclass's own); returned as plain dicts, in order, which is what
    hyperparameters hold (a checkpoint loads with weights_only=True; hparams.yaml reads as the config)."""
    kinds = option_groups(type(obj))
    plain = []
    for name, value in given.items():
        options = option_group(kinds[name], value, group_default(type(obj), name))
        setattr(obj, name, options)
        plain.append(None if options is None else dataclasses.asdict(options))
    return tuple(plain)


@dataclass(frozen=True)
class StillWorks:
    """An old option that still works: its value goes to `new` (an option, or a group's "group.field"),
    as `values` maps it; None: as it is. `off`, for a switch (`in_memory: true` is `pipeline:
    memory`): what its other value (false) sets `new` to where `new` holds one of `values`' (a
    config's `pipeline: memory` with `--data.in_memory false` trains per sample); elsewhere it sets
    nothing."""

    new: str
    values: Mapping[Any, Any] | None = None
    off: Any = None

    def line(self, owner: str, old: str, value: Any) -> str:
        """The line a run prints for the old option: `data.in_memory true is now data.pipeline memory; ...`."""
        if self.values is None:
            return f"{owner}.{old} is now {owner}.{self.new}; it still works"
        if value in self.values:
            return f"{owner}.{old} {written(value)} is now {owner}.{self.new} {self.values[value]}; it still works"
        on = " or ".join(str(v) for v in self.values.values())
        return f"{owner}.{old} {written(value)} is now {owner}.{self.new} {self.off} in place of {on}; it still works"


def written(value: Any) -> str:
    """A value as a config writes it (true, false, null)."""
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def upgrade(
    values: Mapping[str, Any], renamed: Mapping[str, str | StillWorks], defaults: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Flat options from before the groups (`lr`, `optimizer: adamw`) moved into their groups
    (`optimizer: {lr: ..., name: adamw}`), and old options that still work (`StillWorks`:
    `in_memory: true`) in their new spelling (`pipeline: memory`); options already in today's form
    are left as they are. An old option that still works and is None was not given: it is dropped.
    OptionError where two options set one to different values (`in_memory` and `device_decode` true;
    `in_memory: true` with `pipeline: device`, where `defaults` says `pipeline`'s default)."""
    upgraded, moved, by, offs = dict(values), {}, {}, []
    for old, new in renamed.items():
        if isinstance(new, StillWorks):
            value = upgraded.pop(old, None)
            if value is None:
                continue
            if new.values is not None and value not in new.values:
                offs.append(new)
                continue
            target = value if new.values is None else new.values[value]
            explicit = upgraded.get(new.new, (defaults or {}).get(new.new))
            if new.new in moved and moved[new.new] != target:  # in_memory and device_decode both true
                raise OptionError(old, value, f"left out with {by[new.new]} (they give {new.new} {moved[new.new]} "
                                              f"and {target})")  # fmt: skip
            if "." not in new.new and explicit not in (target, (defaults or {}).get(new.new)):
                raise OptionError(old, value, f"left out with {new.new} {explicit} (it gives {new.new} {target})")
            moved[new.new], by[new.new] = target, old
            continue
        group = new.split(".")[0]
        if old in upgraded and not (old == group and isinstance(upgraded[old], Mapping)):
            moved[new] = upgraded.pop(old)
    for new in offs:  # `in_memory: false`: per sample where the pipeline is memory
        if moved.get(new.new, upgraded.get(new.new)) in new.values.values():
            moved[new.new] = new.off
    for new, value in moved.items():
        if "." not in new:
            upgraded[new] = value
            continue
        group, field = new.split(".")
        given = upgraded.get(group)
        if dataclasses.is_dataclass(given) and not isinstance(given, type):
            upgraded[group] = dataclasses.replace(given, **{field: value})
        else:
            upgraded[group] = {**(given or {}), field: value}
    return upgraded


def still_working(
    given: Mapping[str, Any], renamed: Mapping[str, str | StillWorks], owner: str, defaults: Mapping[str, Any]
) -> tuple[dict[str, Any], list[str]]:
    """`given` with its old options that still work (those of `renamed` that are `StillWorks`) in
    their new spelling (vit.options.upgrade), and the line to print for each that is not None."""
    old = {name: v for name, v in given.items() if isinstance(renamed.get(name), StillWorks) and v is not None}
    lines = [renamed[name].line(owner, name, value) for name, value in old.items()]  # type: ignore[union-attr]
    try:
        return upgrade(given, renamed, defaults), lines
    except OptionError as e:
        raise e.placed(f"{owner}.{e.name}") from None


class OptionError(ValueError):
    """An option set to a value it does not take. `name` is its place in the config
    (`data.num_workers`); the CLI prints `error: --data.num_workers: got -1, expected ...` and
    exits 2, as for its other option errors, before any work."""

    def __init__(self, name: str, value: Any, expected: str) -> None:
        self.name, self.value, self.expected = name, value, expected
        super().__init__(f"{name}: got {value!r}, expected {expected}")

    def placed(self, name: str) -> OptionError:
        """The same error for the option as the config names it (a model's `depth` is
        `model.model_kwargs.depth` there)."""
        return OptionError(name, self.value, self.expected)

    def option_line(self) -> str:
        """The error as the command line names the option."""
        return f"--{self}"


def require(ok: bool, name: str, value: Any, expected: str) -> None:
    """OptionError unless `ok`: option `name` holds `value`, and `expected` says what it takes."""
    if not ok:
        raise OptionError(name, value, expected)


def whole(value: Any, low: int, name: str, what: str) -> None:
    """`value` must be a whole number of at least `low` (bools are not numbers here)."""
    ok = isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= low
    require(ok, name, value, f"a whole number of at least {low} ({what})")


def is_number(value: Any, low: float, high: float, open_low: bool = False, open_high: bool = False) -> bool:
    """Whether `value` is a finite number in [low, high] (bools are not numbers here); `open_low` /
    `open_high` leave out that end."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    return ok and (value > low if open_low else value >= low) and (value < high if open_high else value <= high)


def number(
    value: Any, name: str, expected: str, low: float, high: float, open_low: bool = False, open_high: bool = False
) -> None:
    """`value` must be a finite number in [low, high]; `open_low` / `open_high` leave out that end."""
    require(is_number(value, low, high, open_low, open_high), name, value, expected)
