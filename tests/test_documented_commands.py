"""Every command README, docs/ and benchmarks/*.md show in a shell block runs as written as far as
its parser goes: the script, module or installed command exists and takes each option the line
gives it (read from its own `--help`, for the subcommand the line names). scripts/train.py's
options are the configs' (tests/test_training.py parses every config)."""

from __future__ import annotations

import contextlib
import io
import re
import runpy
import sys

import pytest

from tests.conftest import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "benchmarks").glob("*.md"))]
SCRIPTS = dict(re.findall(r'^(vit-[\w-]+) = "vit\.tools\.(\w+):cli"$', (ROOT / "pyproject.toml").read_text(), re.M))
COMMAND = re.compile(
    r"(?:python3?|\.venv/bin/python)\s+(?P<script>scripts/\w+\.py|-m\s+benchmarks\.\w+)(?P<rest>.*)"
    r"|(?<![\w/-])(?P<installed>vit-[a-z-]+)(?P<rest2>(?:\s.*)?)$"
)


def _commands() -> list[tuple[str, str, list[str], list[str]]]:
    """(where, target, subcommand words, options) of each command line in the docs' shell blocks."""
    found = []
    for doc in DOCS:
        for block in re.findall(r"```(?:bash|sh|shell)\n(.*?)```", doc.read_text(), re.S):
            for line in block.replace("\\\n", " ").splitlines():
                match = COMMAND.search(line.split(" #")[0])
                if match is None:
                    continue
                if match["installed"]:
                    if match["installed"] not in SCRIPTS:
                        found.append((doc.name, match["installed"], [], []))
                        continue
                    target, rest = f"scripts/{SCRIPTS[match['installed']]}.py", match["rest2"]
                else:
                    target, rest = re.sub(r"\s+", " ", match["script"]), match["rest"]
                words = rest.split(" -- ")[0].split()  # after "--": options passed on to scripts/train.py
                sub = []
                for word in words:  # a subcommand: the plain words before the first option or path
                    if word.startswith("-") or any(c in word for c in "/.=:"):
                        break
                    sub.append(word)
                options = [w.split("=")[0] for w in words if re.fullmatch(r"--[a-z][\w-]*(=\S*)?", w)]
                found.append((doc.name, target, sub, options))
    return found


COMMANDS = _commands()


def _help(target: str, sub: list[str]) -> str:
    """The target's `--help` (of its subcommand), run in this process."""
    argv = [target, *sub, "--help"]
    out = io.StringIO()
    saved = sys.argv
    sys.argv = argv
    try:
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
            if target.startswith("-m "):
                runpy.run_module(target[3:], run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(str(ROOT / target), run_name="__main__")
    finally:
        sys.argv = saved
    return out.getvalue()


def test_the_docs_show_commands():
    assert len(COMMANDS) > 50 and {t for _, t, _, _ in COMMANDS} >= {"scripts/train.py", "-m benchmarks.ablate"}


@pytest.mark.parametrize(
    ("target", "sub"),
    sorted({(t, tuple(s)) for _, t, s, _ in COMMANDS if t != "scripts/train.py"}),
    ids=lambda v: " ".join(v) if isinstance(v, tuple) else v,
)
def test_each_documented_command_takes_the_options_it_is_shown_with(target, sub, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert target.startswith("-m ") or (ROOT / target).is_file(), f"{target} does not exist"
    text = _help(target, list(sub))
    known = set(re.findall(r"--[a-z][\w-]*", text))
    wrong = sorted({(where, o) for where, t, s, options in COMMANDS if t == target and tuple(s) == sub
                    for o in options if o not in known})  # fmt: skip
    assert not wrong, f"{target} {' '.join(sub)} does not take: {wrong}"
