"""Option groups: a model's or datamodule's related options as one frozen dataclass
(vit.training.Optimizer, vit.lit.FineTune, vit.data.Augment, ...), nested in the config.

A group is given as the dataclass (the CLI builds it from `--model.optimizer.lr 3e-4` or a config's
`optimizer: {lr: 3e-4}`), in Python as a mapping of the fields that differ from the class's default
for it, or None where that default is None. Where it is stored (hyperparameters, checkpoints) it is
a plain dict. A class lists its options from before the groups in `RENAMED` (old name -> "group.field"):
the CLI names the new place of an old option, and checkpoints with the old names still load
(vit.training.TrainingTask.upgrade_hparams).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import numbers
import typing
from collections.abc import Mapping
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


def upgrade(values: Mapping[str, Any], renamed: Mapping[str, str]) -> dict[str, Any]:
    """Flat options from before the groups (`lr`, `optimizer: adamw`) moved into their groups
    (`optimizer: {lr: ..., name: adamw}`); options already in today's form are left as they are."""
    upgraded, moved = dict(values), {}
    for old, new in renamed.items():
        group = new.split(".")[0]
        if old in upgraded and not (old == group and isinstance(upgraded[old], Mapping)):
            moved[new] = upgraded.pop(old)
    for new, value in moved.items():
        group, field = new.split(".")
        upgraded[group] = {**(upgraded.get(group) or {}), field: value}
    return upgraded


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
