"""jsonargparse's parse errors as one line a user reads: an unknown option or class named with the
closest real one, a value of the wrong type with the types its option takes, a config file that is not
valid YAML with its line and column. `TrainArgumentParser.error` (vit.cli) asks here first and keeps
jsonargparse's message where nothing here recognises it."""

from __future__ import annotations

import ast
import dataclasses
import difflib
import importlib
import inspect
import pkgutil
import re
from pathlib import Path

from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import LightningArgumentParser

from vit.options import option_groups


def class_of(class_path: str) -> type:
    """The class a config's class_path names."""
    module, _, name = class_path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _suggest(name: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(name, choices, n=1, cutoff=0.6)
    return f"; did you mean {close[0]}?" if close else ""


def short_parse_error(message: str, parser: LightningArgumentParser, argv: list[str]) -> str | None:
    """One line for an unknown option or class (with a suggestion) or a config file that is not
    valid YAML (with its name), or None to keep jsonargparse's message."""
    if message.startswith("Problems parsing config") and "<unicode string>" in message:
        return _yaml_error(argv) or None
    missing = re.search(r"Problem with given class_path '([\w.]+)':\s*(module '[\w.]+' has no|No module)", message)
    group = re.search(r'Parser key "([\w.]+)"', message)
    if missing and group:
        return f"--{group[1]} {missing[1]}: {_no_such_class(missing[1])}"
    unknown = re.search(
        r"Problem with given class_path '([\w.]+)':\s*(?:(?:Option|Key) '([\w.]+)' is not"
        r"|unrecognized arguments: --([\w.]+)|Parser key \"(\w+)\":\s*Unable to load config)",
        message,
    )
    group = re.search(r'Parser key "([\w.]+)"', message)
    if unknown and group:
        class_path, option = unknown[1], unknown[2] or unknown[3] or unknown[4]
        nested = _nested_arg(message)
        if nested is not None and nested[0].endswith(f".{option}"):  # a group's field: name it from the class
            class_path, option = re.search(r"Problem with given class_path '([\w.]+)'", message)[1], nested[0]
        try:
            cls = class_of(class_path)
        except (ImportError, AttributeError):
            return None
        if cls in (LightningModule, LightningDataModule):  # options given, but no class chosen for them
            return (
                f"--{group[1]}.{option} is given but no {group[1]} class is: a config that only changes options "
                f"(such as configs/cifar10_vit_long.yaml) goes after the config it changes, e.g. --config "
                f"configs/cifar10_vit.yaml --config configs/cifar10_vit_long.yaml; or set --{group[1]}.class_path"
            )
        # The class's and its bases' __init__ arguments: jsonargparse follows **kwargs up the bases.
        params = [p for c in cls.__mro__ if "__init__" in vars(c) for p in inspect.signature(c.__init__).parameters]
        choices = [f"--{group[1]}.{p}" for p in params if p not in ("self", "args", "kwargs")]
        renamed = getattr(cls, "RENAMED", {}).get(option)
        if isinstance(renamed, str):  # a config or command line from before the option groups (not StillWorks)
            return f"--{group[1]}.{option} is now --{group[1]}.{renamed} (the options of {class_path} are grouped)"
        if unknown[4]:  # a value for a whole group
            return f"--{group[1]}.{option} is a group of options: set one as --{group[1]}.{option}.NAME VALUE"
        groups = option_groups(cls)
        choices += [f"--{group[1]}.{name}.{f.name}" for name, kind in groups.items() for f in dataclasses.fields(kind)]
        leaves = {choice.rsplit(".", 1)[-1]: choice for choice in reversed(choices)}  # a group's field by its name
        close = difflib.get_close_matches(option.rsplit(".", 1)[-1], list(leaves), n=1, cutoff=0.6)
        hint = f"; did you mean {leaves[close[0]]}?" if close else ""
        return f"--{group[1]}.{option} is not an option of {class_path}{hint}"
    typed = _nested_value_error(message) or _type_error(message)
    if typed is not None:
        return typed
    unrecognized = re.search(r"unrecognized arguments: (.*)", message, re.IGNORECASE)
    if unrecognized:
        options = [a for a in unrecognized[1].split() if a.startswith("--")]
        if options:
            choices = list(parser._option_string_actions)
            option = options[0].split("=")[0]
            return f"unknown option {option}{_suggest(option, choices)} (run with --help for the options)"
    return None


# jsonargparse's names of the types an option expects, as a user reads them.
_TYPE_NAMES = {"int": "a whole number", "float": "a number", "bool": "true or false", "str": "text",
               "tuple": "a list in brackets", "list": "a list in brackets",
               "dict": "a mapping such as {name: value}"}  # fmt: skip


def _nested_arg(message: str) -> tuple[str, str] | None:
    """The (dotted option, text) a class's option was given as on the command line: jsonargparse's
    NestedArg, the outermost (last) one of its message."""
    given = re.findall(r"^\s*Given value: NestedArg\(key='([\w.]+)', val=(.*)\)\s*$", message, re.M)
    if not given:
        return None
    key, text = given[-1]
    try:
        return key, str(ast.literal_eval(text))
    except (ValueError, SyntaxError):
        return key, text


def _nested_value_error(message: str) -> str | None:
    """`--data.data_process: got 'sometimes', expected true or false, or null` for a value of the
    wrong type given to a class's option or a group's field on the command line, or None."""
    group, nested = re.match(r'Parser key "(\w+)":', message), _nested_arg(message)
    if group is None or nested is None:
        return None
    (key, value), option = nested, f"{group[1]}.{nested[0]}"
    start = message.rfind(f'Parser key "{key.rsplit(".", 1)[-1]}"')
    if start < 0:
        return None
    section = message[start : message.find("Given value type", start) % (len(message) + 1)]
    class_path = re.search(r"Problem with given class_path '([\w.]+)'", message)
    cls = class_of(class_path[1]) if class_path else None
    if cls is not None and key in option_groups(cls):
        return f"--{option}: got {value!r}, expected its options one by one (--{option}.NAME VALUE), or null"
    # The option's own types: the first "Expected" and those at its column (deeper or shallower ones
    # belong to other alternatives, such as the Optional group around a field).
    found = [
        (m.start() - section.rfind("\n", 0, m.start()), m[1])
        for m in re.finditer(r"Expected a <class '(\w+)'>", section)
    ]
    if not found:
        return None
    kinds = list(dict.fromkeys(kind for column, kind in found if column == found[0][0]))
    names = [_TYPE_NAMES.get(kind, kind) for kind in kinds if kind != "NoneType"]
    expected = " or ".join(names) + (", or null" if "NoneType" in kinds else "")
    if "dict" in kinds and re.search(r":\S", value):  # YAML reads `{depth:0}` as one key, not a mapping
        expected += " (YAML needs a space after each colon: {depth: 0})"
    return f"--{option}: got {value!r}, expected {expected}"


def _type_error(message: str) -> str | None:
    """`--data.batch_size: got 'abc', expected a whole number` for a value of the wrong type (a
    class's option, a group's field, or a top-level option), or None."""
    nested = re.search(
        r"Problem with given class_path '[\w.]+':\s*Parser key \"([\w.]+)\":\s*(?:Does not validate.*?- )?"
        r"Expected (.*?)\. Got value: ([^\n]*)",
        message, re.S,
    )  # fmt: skip
    group = re.match(r'Parser key "([\w.]+)":', message)
    if nested and group:
        name, expected, value = f"{group[1]}.{nested[1]}", nested[2], nested[3]
    else:
        top = re.search(
            r"\A[^\n]*Parser key \"([\w.]+)\":.*?Expected ([^\n]*?)\n.*Given value: ([^\n]*)", message, re.S
        )
        if top is None:
            return None
        name, expected, value = top[1], top[2], top[3]
    expected = re.sub(r"a <class '(\w+)'>", lambda m: _TYPE_NAMES.get(m[1], m[1]), expected)
    return f"--{name}: got {value!r}, expected {expected}"


def _no_such_class(class_path: str) -> str:
    """Why `class_path` names no class, with the closest class or module of the nearest one that imports."""
    module, _, name = class_path.rpartition(".")
    try:
        found = importlib.import_module(module)
    except ImportError:
        package = module.rpartition(".")[0]
        try:
            parent = importlib.import_module(package) if package else None
        except ImportError:
            parent = None
        siblings = [f"{package}.{m.name}" for m in pkgutil.iter_modules(getattr(parent, "__path__", []))]
        return f"there is no module {module}{_suggest(module, siblings)}"
    # dir and getattr, not vars: a package that imports its names on first use (vit.data) lists them in __dir__
    names = [n for n in dir(found) if not n.startswith("_")]
    classes = [f"{module}.{n}" for n in names if inspect.isclass(getattr(found, n, None))]
    return f"there is no {name} in {module}{_suggest(class_path, classes)}"


def _yaml_error(args: list[str]) -> str:
    """The first --config file of the command line that is not valid YAML, named with the parser's
    message (jsonargparse's names `<unicode string>`); empty if each one parses."""
    import yaml

    files = [args[i + 1] for i, a in enumerate(args[:-1]) if a in ("--config", "-c")]
    files += [a.split("=", 1)[1] for a in args if a.startswith("--config=")]
    for file in files:
        try:
            yaml.safe_load(Path(file).read_text())
        except yaml.MarkedYAMLError as e:
            where = f", line {e.problem_mark.line + 1}, column {e.problem_mark.column + 1}" if e.problem_mark else ""
            context = f" ({e.context} at line {e.context_mark.line + 1})" if e.context and e.context_mark else ""
            return f"{file} is not valid YAML{where}: {e.problem}{context}"
        except yaml.YAMLError as e:
            return f"{file} is not valid YAML: {e}"
        except OSError:
            continue
    return ""
