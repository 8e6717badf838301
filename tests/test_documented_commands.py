"""Every command README, docs/ and benchmarks/*.md show in a shell block runs as written as far as
its parser goes: the script, module or installed command exists and takes each option the line
gives it (read from its own `--help`, for the subcommand the line names). scripts/train.py's
options are the configs' (tests/test_training.py parses every config); tests/test_documented_runs.py
builds what each scripts/train.py command would train."""

from __future__ import annotations

import contextlib
import io
import re
import runpy
import shlex
import sys
from collections.abc import Iterator
from typing import NamedTuple

import pytest

from tests.conftest import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "benchmarks").glob("*.md"))]
SCRIPTS = dict(re.findall(r'^(vit-[\w-]+) = "vit\.tools\.(\w+):cli"$', (ROOT / "pyproject.toml").read_text(), re.M))
COMMAND = re.compile(
    r"(?:python3?|\.venv/bin/python)\s+(?P<script>scripts/\w+\.py|-m\s+benchmarks\.\w+)(?P<rest>.*)"
    r"|(?<![\w/-])(?P<installed>vit-[a-z-]+)(?P<rest2>(?:\s.*)?)$"
)
SHELL_BLOCK = re.compile(r"```(?:bash|sh|shell)\n(.*?)```", re.S)


class Command(NamedTuple):
    """One documented command line."""

    where: str  # "docs/training.md:12": the doc and the line the command starts on
    target: str  # scripts/<name>.py (an installed vit-* command as its script) or "-m benchmarks.<name>"
    sub: list[str]  # its subcommand words (`fit`)
    options: list[str]  # the --options it is given, without values
    argv: list[str]  # the words the shell passes it, the block's variables expanded


def _split(text: str) -> list[str]:
    """Shell words, with `;`, `&&`, `|` and redirections as words of their own."""
    lexer = shlex.shlex(text, posix=True, punctuation_chars=";&|<>()")
    lexer.whitespace_split = True
    return list(lexer)


def _closed(text: str) -> bool:
    try:
        _split(text)
    except ValueError:  # a quote still open: the value goes on on the next line
        return False
    return True


def _shell_lines(block: str) -> Iterator[tuple[int, str]]:
    """(index of its first line, text) of each command of a shell block, comments cut: a line ended by
    a backslash and a quoted value over several lines are read on as the shell reads them. Variables
    the block sets (`K='...'`, `for R in 0 4`: the first value) are expanded."""
    lines, variables, i = block.splitlines(), {}, 0
    while i < len(lines):
        start, text = i, lines[i].split(" #")[0]
        while i + 1 < len(lines) and (text.endswith("\\") or not _closed(text)):
            i += 1
            text = text[:-1] + " " + lines[i].split(" #")[0] if text.endswith("\\") else text + "\n" + lines[i]
        i += 1
        text = re.sub(r"\$(?:\{(\w+)\}|(\w+))", lambda m: variables.get(m[1] or m[2], m[0]), text)
        assigned = re.fullmatch(r"\s*(\w+)=(\S.*)", text) or re.match(r"\s*for (\w+) in (\S+)", text)
        if assigned and _closed(assigned[2]) and len(_split(assigned[2])) == 1:
            variables[assigned[1]] = _split(assigned[2])[0]
        yield start, text


def _argv(text: str, word: str) -> list[str]:
    """The words after `word` (the command's script or name) up to the end of its command, looked for in
    a `bash -c '...'` string too; [] when the line is not one the shell reads."""
    try:
        words = _split(text)
    except ValueError:
        return []
    for i, w in enumerate(words):
        if w == word:
            rest = words[i + 1 :]
            end = next((j for j, r in enumerate(rest) if r.strip(";&|<>()") == ""), len(rest))
            return rest[:end]
        if word in w and w != word and re.search(r"\s", w):
            return _argv(w, word)
    return []


def _commands() -> list[Command]:
    """Each command line in the docs' shell blocks."""
    found = []
    for doc in DOCS:
        text = doc.read_text()
        for block in SHELL_BLOCK.finditer(text):
            first = text.count("\n", 0, block.start(1)) + 1
            for offset, line in _shell_lines(block[1]):
                match = COMMAND.search(line)
                if match is None:
                    continue
                where = f"{doc.relative_to(ROOT)}:{first + offset}"
                if match["installed"]:
                    if match["installed"] not in SCRIPTS:
                        found.append(Command(where, match["installed"], [], [], []))
                        continue
                    target, rest = f"scripts/{SCRIPTS[match['installed']]}.py", match["rest2"]
                else:
                    target, rest = re.sub(r"\s+", " ", match["script"]), match["rest"]
                argv = _argv(line, (match["installed"] or match["script"]).split()[-1])
                words = rest.split(" -- ")[0].split()  # after "--": options passed on to scripts/train.py
                sub = []
                for word in words:  # a subcommand: the plain words before the first option or path
                    if word.startswith("-") or any(c in word for c in "/.=:"):
                        break
                    sub.append(word)
                options = [w.split("=")[0] for w in words if re.fullmatch(r"--[a-z][\w-]*(=\S*)?", w)]
                found.append(Command(where, target, sub, options, argv))
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
    assert len(COMMANDS) > 50 and {c.target for c in COMMANDS} >= {"scripts/train.py", "-m benchmarks.ablate"}


def test_a_command_is_read_as_the_shell_reads_it():
    """A continued line, a value quoted over two lines, the block's variables and a `bash -c` string."""
    block = (
        "K='{a: 1'\n"
        "for R in 0 4; do\n"
        'flock /tmp/l bash -c \'python scripts/train.py fit --x "$K, r: ${R}}" \\\n'
        '    --y "{b: 2,\n'
        "         c: 3}\"' && echo done  # a comment\n"
        "done\n"
    )
    start, line = next((i, line) for i, line in _shell_lines(block) if "train.py" in line)
    assert start == 2
    assert _argv(line, "scripts/train.py") == ["fit", "--x", "{a: 1, r: 0}", "--y", "{b: 2,\n         c: 3}"]


@pytest.mark.parametrize(
    ("target", "sub"),
    sorted({(c.target, tuple(c.sub)) for c in COMMANDS if c.target != "scripts/train.py"}),
    ids=lambda v: " ".join(v) if isinstance(v, tuple) else v,
)
def test_each_documented_command_takes_the_options_it_is_shown_with(target, sub, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert target.startswith("-m ") or (ROOT / target).is_file(), f"{target} does not exist"
    text = _help(target, list(sub))
    known = set(re.findall(r"--[a-z][\w-]*", text))
    wrong = sorted({(c.where, o) for c in COMMANDS if c.target == target and tuple(c.sub) == sub
                    for o in c.options if o not in known})  # fmt: skip
    assert not wrong, f"{target} {' '.join(sub)} does not take: {wrong}"


RUN_FILE = re.compile(r"\bruns/([\w.-]+)/(?:checkpoints/)?[\w.-]+\.(?:ckpt|onnx|safetensors)\b")


def _writers(run: str) -> list[str]:
    """What, named in a page, makes the run folder runs/<run>: a config whose default_root_dir it is,
    the override that sets it, or (for runs/default) README's `make train`."""
    configs = [str(path.relative_to(ROOT)) for path in sorted((ROOT / "configs").rglob("*.yaml"))
               if re.search(rf"^\s*default_root_dir:\s*runs/{re.escape(run)}\s*$", path.read_text(), re.M)]  # fmt: skip
    return [*configs, f"default_root_dir runs/{run}", *(["make train"] if run == "default" else [])]


def test_a_command_that_reads_a_runs_checkpoint_comes_after_what_makes_that_run():
    """A reader who runs a page's commands in order has each run's checkpoint before a command reads it:
    the page names the config (or `make train`) that writes runs/<name> before the first command that
    reads a checkpoint there (runs/x is a placeholder)."""
    unstated = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = doc.read_text()
        for block in SHELL_BLOCK.finditer(text):
            for match in RUN_FILE.finditer(block[1]):
                if match[1] in ("x", "..."):
                    continue
                at = block.start(1) + match.start()
                if not any(writer in text[:at] for writer in _writers(match[1])):
                    unstated.append(f"{doc.relative_to(ROOT)}:{text.count(chr(10), 0, at) + 1} reads runs/{match[1]}")
    assert not unstated, f"commands read a run's checkpoint before the page says what makes the run: {unstated}"
