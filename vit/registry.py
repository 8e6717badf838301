"""Model registry: a name maps to a model class, its config dataclass and that name's defaults.

`create_model("vit_small_patch16_224", num_classes=10)` is `VisionTransformer(ViTConfig(**defaults,
num_classes=10))`. A name plus its overrides is all a checkpoint needs to rebuild the model.
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import numbers
import types
import typing
import warnings
from collections.abc import Callable, Collection
from dataclasses import dataclass
from functools import partial
from typing import Any

from torch import nn

from vit.options import OptionError, require


@dataclass(frozen=True)
class TimmArgs:
    """timm's arguments for a name: `names`, those its timm model class takes, and `fields(**kwargs)`,
    the config's fields (all of them) that `timm.create_model(name, **kwargs)` means; a ValueError names
    an argument without an equivalent here."""

    names: frozenset[str]
    fields: Callable[..., dict[str, Any]]


@dataclass(frozen=True)
class ModelEntry:
    build: Callable[[Any], nn.Module]  # takes the config, returns the model
    config_cls: type
    defaults: dict[str, Any]
    timm_args: TimmArgs | None = None


_MODELS: dict[str, ModelEntry] = {}
_UNSUPPORTED: dict[str, str] = {}  # names we know of (timm's) but do not build, and why


def register_model(
    name: str, build: Callable[[Any], nn.Module], config_cls: type, timm_args: TimmArgs | None = None, **defaults: Any
) -> None:
    """`name` builds `build(config_cls(**defaults, **overrides))`; with `timm_args`, the overrides may
    also be timm's arguments of the name (those that are not config fields), with timm's meaning."""
    if name in _MODELS:
        raise ValueError(f"model {name!r} is registered twice")
    _check_fields(name, config_cls, defaults)
    _MODELS[name] = ModelEntry(build, config_cls, defaults, timm_args)


def register_unsupported(name: str, reason: str) -> None:
    """A name users may ask for that we do not build: `create_model(name)` then says why."""
    _UNSUPPORTED[name] = reason


def unsupported_models() -> dict[str, str]:
    """Known names (timm's) that are not built here, with the reason."""
    return dict(_UNSUPPORTED)


def list_models(pattern: str = "*") -> list[str]:
    """Registered model names matching a shell-style pattern, e.g. `list_models("vit_*")`."""
    return sorted(n for n in _MODELS if fnmatch.fnmatch(n, pattern))


def model_config(name: str, **overrides: Any) -> Any:
    """The config dataclass `create_model(name, **overrides)` would build the model from. An override
    that is not a config field but one of timm's arguments for the name (`pos_embed="none"`,
    `num_reg_tokens=2`) sets the fields timm's meaning gives it; the config's own names win."""
    entry = _entry(name)
    timm_args = entry.timm_args
    fields = {f.name for f in dataclasses.fields(entry.config_cls)}
    theirs = {k: v for k, v in overrides.items() if k not in fields and timm_args and k in timm_args.names}
    overrides = {k: v for k, v in overrides.items() if k not in theirs}
    _check_fields(name, entry.config_cls, overrides, timm_args is not None)
    defaults = entry.defaults
    if theirs:
        try:
            defaults = timm_args.fields(**theirs)
        except OptionError:
            raise
        except ValueError as e:
            raise ValueError(f"model {name!r}: {e}") from None
    changed = {k: v for k, v in defaults.items() if k not in entry.defaults or entry.defaults[k] != v}
    hints = typing.get_type_hints(entry.config_cls)
    for field, value in {**changed, **overrides}.items():
        require(_fits(value, hints[field]), field, value, _described(hints[field]))
    return entry.config_cls(**{**defaults, **overrides})


def create_model(name: str, **overrides: Any) -> nn.Module:
    """Build a registered model; `overrides` replace fields of its config (e.g. `num_classes=10`)."""
    return _entry(name).build(model_config(name, **overrides))


def _entry(name: str) -> ModelEntry:
    if name in _UNSUPPORTED:
        raise ValueError(f"model {name!r} is not supported: {_UNSUPPORTED[name]}")
    if name not in _MODELS:
        close = difflib.get_close_matches(name, _MODELS, n=3)
        hint = f" Did you mean {', '.join(close)}?" if close else ""
        raise ValueError(f"unknown model {name!r}.{hint} See vit.list_models() for the {len(_MODELS)} registered names")
    return _MODELS[name]


def _check_fields(name: str, config_cls: type, kwargs: dict[str, Any], takes_timms: bool = False) -> None:
    fields = {f.name for f in dataclasses.fields(config_cls)}
    unknown = sorted(set(kwargs) - fields)
    if unknown:
        timms = " (or timm's arguments of the same model)" if takes_timms else ""
        raise ValueError(
            f"model {name!r} has no option(s) {', '.join(unknown)}; "
            f"{config_cls.__name__} fields are: {', '.join(sorted(fields))}{timms}"
        )


# A config field's plain types as a user reads them (YAML gives lists where a field holds a tuple).
_TYPE_NAMES = {bool: "true or false", int: "a whole number", float: "a number", str: "text", type(None): "null",
               tuple: "a list", list: "a list", dict: "a mapping"}  # fmt: skip


def _fits(value: Any, hint: Any) -> bool:
    """Whether `value` is of the config field type `hint` (plain types, unions, tuples and lists of
    them, dicts); a type named otherwise is not checked here."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, arg) for arg in args)
    if hint in (int, float) or hint is bool:
        number = isinstance(value, numbers.Integral if hint is int else numbers.Real)
        return isinstance(value, bool) if hint is bool else number and not isinstance(value, bool)
    if hint in (str, type(None)):
        return isinstance(value, hint)
    if (origin or hint) in (tuple, list):
        if not isinstance(value, tuple | list):
            return False
        if origin is tuple and args and args[-1] is not Ellipsis:
            return len(value) == len(args) and all(_fits(v, a) for v, a in zip(value, args, strict=True))
        return not args or all(_fits(v, args[0]) for v in value)
    if (origin or hint) is dict:
        return isinstance(value, dict)
    return True


def _described(hint: Any) -> str:
    """A config field's type as a user reads it: `a whole number or a list`."""
    kinds = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    names = dict.fromkeys(_TYPE_NAMES.get(typing.get_origin(k) or k, str(k)) for k in kinds)
    return " or ".join(names)


def register_timm_names(
    family: str,
    modules: list[tuple[str, str]],
    build: Callable[[Any], nn.Module],
    config_cls: type,
    fields_of: Callable[..., dict[str, Any]],
    timm_names: Collection[str],
    skip: Collection[str] = (),
) -> None:
    """Register timm's names of a family, (pattern, module) pairs of timm's, that we build
    identically: `fields_of(name)` gives the config's fields, or ValueError when timm's arguments
    have no equal here (the name is listed unsupported, with the reason); `fields_of(name, **kwargs)`
    those of `timm.create_model(name, **kwargs)`, which `create_model(name, **kwargs)` builds for
    `timm_names`, the arguments of timm's model class (TimmArgs). Reading the arguments relies on
    timm's private builders: where an installed timm changed them, the names affected (or every
    name) are listed unsupported with the error and one warning says so; `import vit` stands."""
    import timm

    changed, names = [], []
    timm_names = frozenset(timm_names)
    for pattern, module in modules:
        try:
            names += timm.list_models(pattern, module=module)
        except Exception as e:
            changed.append(f"timm.list_models(module={module!r}): {type(e).__name__}: {e}")
    for name in names:
        if name in skip:
            continue
        try:
            register_model(name, build, config_cls, TimmArgs(timm_names, partial(fields_of, name)), **fields_of(name))
        except ValueError as e:
            register_unsupported(name, str(e))
        except Exception as e:
            register_unsupported(name, f"could not be read from timm {timm.__version__} ({type(e).__name__}: {e})")
            changed.append(f"{name}: {type(e).__name__}: {e}")
    if changed:
        warnings.warn(
            f"{len(changed)} of timm's {family} names could not be read from timm {timm.__version__}, whose model "
            f"builders differ from those vit was written against; they are not available by name (vit's own "
            f"names are). First: {changed[0]}",
            stacklevel=3,
        )
