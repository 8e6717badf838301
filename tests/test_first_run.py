"""What a first run tells its user to type next runs as printed, from the shell that started it: the
end-of-run summary names TensorBoard by a path that needs no activated virtual environment."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import sysconfig
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.conftest import ROOT
from vit import cli
from vit.cli import tensorboard_command
from vit.schedule import WallClockBudget
from vit.wording import counted


def test_the_printed_tensorboard_command_runs_from_a_shell_without_the_venv(monkeypatch):
    monkeypatch.chdir(ROOT)
    command = tensorboard_command("runs/default/lightning_logs/version_0")
    program, *options = shlex.split(command)
    assert options == ["--logdir", "runs/default/lightning_logs/version_0"]
    if sys.prefix != sys.base_prefix and Path(sys.executable).absolute().is_relative_to(ROOT):
        assert program == ".venv/bin/tensorboard"  # README's quick start shows this line
    scripts = sysconfig.get_path("scripts")
    path = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if p != scripts)  # not activated
    done = subprocess.run([program, "--version"], cwd=ROOT, env={**os.environ, "PATH": path},
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip()[0].isdigit(), done.stderr


@pytest.fixture
def python_in(tmp_path, monkeypatch):
    """A Python at tmp_path/env/bin/python, run from tmp_path; call with in_venv and what PATH holds."""
    scripts = tmp_path / "env" / "bin"
    scripts.mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sysconfig, "get_path", lambda name: str(scripts))
    monkeypatch.setattr(sys, "executable", str(scripts / "python"))

    def setup(in_venv: bool, on_path: Path | None = None) -> Path:
        monkeypatch.setattr(sys, "prefix", str(scripts.parent) if in_venv else sys.base_prefix)
        monkeypatch.setenv("PATH", str(on_path) if on_path else str(tmp_path / "empty"))
        return scripts

    return setup


def _program(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    program = folder / "tensorboard"
    program.write_text("#!/bin/sh\n")
    program.chmod(0o755)
    return program


def test_in_a_venv_tensorboard_is_named_by_its_path_activated_or_not(python_in):
    scripts = python_in(in_venv=True)
    _program(scripts)
    assert tensorboard_command("runs/a b/version_0") == "env/bin/tensorboard --logdir 'runs/a b/version_0'"
    python_in(in_venv=True, on_path=scripts)  # activated: the path still runs
    assert tensorboard_command("logs") == "env/bin/tensorboard --logdir logs"


def test_outside_a_venv_the_tensorboard_on_path_is_named_by_its_name(python_in, tmp_path):
    python_in(in_venv=False, on_path=tmp_path / "user")  # pip install --user: ~/.local/bin
    _program(tmp_path / "user")
    assert tensorboard_command("logs") == "tensorboard --logdir logs"
    scripts = python_in(in_venv=False, on_path=tmp_path / "env" / "bin")
    _program(scripts)
    assert tensorboard_command("logs") == "tensorboard --logdir logs"
    python_in(in_venv=False)  # this Python's own, not on PATH
    assert tensorboard_command("logs") == "env/bin/tensorboard --logdir logs"


def test_without_tensorboard_the_summary_says_how_to_install_it(python_in):
    python_in(in_venv=True)
    assert tensorboard_command("logs") == "TensorBoard is not installed: env/bin/python -m pip install tensorboard"


FAKE_PYTHON = """#!/bin/sh
# A stand-in Python of version $FAKE_VERSION: answers the Makefile's version questions, makes a venv
# whose python is a 3.11 stand-in, and logs every other command to $LOG instead of running it.
v=${FAKE_VERSION:-3.11.9}
case "$1" in
  -c) case "$2" in
        *python_version*) echo "$v";;
        *version_info*) case "$v" in 3.9*) exit 1;; *) exit 0;; esac;;
      esac;;
  -m) if [ "$2" = venv ]; then
        mkdir -p "$3/bin"; printf '#!/bin/sh\\nFAKE_VERSION=3.11.9 exec %s "$@"\\n' "$0" > "$3/bin/python"
        chmod +x "$3/bin/python"; echo "venv $3" >> "$LOG"
      else echo "$*" >> "$LOG"; fi;;
  *) echo "$*" >> "$LOG";;
esac
"""


@pytest.fixture
def checkout(tmp_path, monkeypatch):
    """The Makefile and pyproject.toml in a folder of their own, with stand-in Pythons (python3.11 and
    python3.9) that log what make has them do: `run(target)` returns make's exit status, its stderr and
    the commands the Pythons were given."""
    for name in ("Makefile", "pyproject.toml"):
        (tmp_path / name).write_text((ROOT / name).read_text())
    fake = tmp_path / "bin" / "python3.11"
    fake.parent.mkdir()
    fake.write_text(FAKE_PYTHON)
    (tmp_path / "bin" / "python3.9").write_text(f'#!/bin/sh\nFAKE_VERSION=3.9.18 exec {fake} "$@"\n')
    for program in (tmp_path / "bin").iterdir():
        program.chmod(0o755)
    log = tmp_path / "log"
    monkeypatch.setenv("LOG", str(log))

    def run(target: str, python: str = "python3.11") -> tuple[int, str, list[str]]:
        log.write_text("")
        done = subprocess.run(["make", "-s", target, f"PYTHON={tmp_path / 'bin' / python}"], cwd=tmp_path,
                              capture_output=True, text=True, timeout=60)  # fmt: skip
        return done.returncode, done.stderr, log.read_text().splitlines()

    return tmp_path, run


def test_make_train_installs_what_training_needs_and_make_test_adds_the_dev_extras(checkout):
    folder, run = checkout
    status, _, commands = run("train")
    assert status == 0
    assert commands == ["venv .venv", "-m pip install --quiet --upgrade pip", "-m pip install --quiet -e .",
                        "scripts/train.py fit --config configs/default.yaml"]  # fmt: skip
    assert run("train")[2] == ["scripts/train.py fit --config configs/default.yaml"]  # installed once
    status, _, commands = run("lint")  # a dev target after `make train`: the extras, then ruff (not here)
    assert commands == ["-m pip install --quiet -e .[dev]"]
    (folder / "pyproject.toml").touch()  # changed: installed again
    assert run("train")[2][:2] == ["-m pip install --quiet --upgrade pip", "-m pip install --quiet -e ."]


def test_a_venv_of_a_python_older_than_the_project_takes_is_made_again(checkout):
    folder, run = checkout
    (folder / ".venv" / "bin").mkdir(parents=True)
    (folder / ".venv" / "bin" / "python").symlink_to(folder / "bin" / "python3.9")
    (folder / ".venv" / "old-file").write_text("")
    status, _, commands = run("train")
    assert status == 0 and commands[0] == "venv .venv" and commands[2] == "-m pip install --quiet -e ."
    assert not (folder / ".venv" / "old-file").exists()
    assert subprocess.run([folder / ".venv" / "bin" / "python", "-c", "platform.python_version()"],
                          capture_output=True, text=True).stdout == "3.11.9\n"  # fmt: skip


def test_without_a_python_new_enough_make_says_which_to_name(checkout):
    folder, run = checkout
    status, stderr, commands = run("train", python="python3.9")
    assert status != 0 and commands == [] and not (folder / ".venv").exists()
    assert stderr.splitlines()[0] == (
        f"error: {folder}/bin/python3.9 is Python 3.9.18, this project needs >= 3.10: name a newer one, "
        "e.g. make PYTHON=python3.11"
    )


def test_a_short_run_without_validation_says_nothing_its_user_cannot_act_on(tmp_path, capfd, caplog):
    """No ModelCheckpoint warning that the monitored val/acc1 is missing (there is no validation to
    score), no Lightning tip to install litlogger, no FutureWarning from Lightning's use of torch."""
    args = ["fit", "--config", str(ROOT / "configs" / "default.yaml"), "--trainer.default_root_dir", str(tmp_path),
            "--trainer.max_epochs", "2", "--trainer.limit_train_batches", "2", "--trainer.limit_val_batches", "0",
            "--trainer.log_every_n_steps", "1", "--trainer.enable_progress_bar", "false",
            "--trainer.enable_model_summary", "false", "--model.schedule.warmup_epochs", "0"]  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # pytest's filters (pyproject.toml) hide the FutureWarning
        cli.main(args)
    said = capfd.readouterr()
    noise = [str(w.message) for w in caught if "monitored key" in str(w.message) or "LeafSpec" in str(w.message)]
    assert noise == []
    assert "Tip:" not in said.out + said.err + caplog.text
    assert (tmp_path / "checkpoints" / "last.ckpt").is_file()
    with warnings.catch_warnings(record=True) as caught:  # a second run in the folder moves the first's aside
        warnings.simplefilter("always")
        cli.main(args)
    assert [str(w.message) for w in caught if "exists and is not empty" in str(w.message)] == []
    assert len(list((tmp_path / "checkpoints" / "earlier").glob("*/last.ckpt"))) == 1


def test_a_count_of_one_is_said_in_the_singular():
    assert [counted(n, "image") for n in (0, 1, 2, 1200)] == ["0 images", "1 image", "2 images", "1,200 images"]
    assert [counted(m, "minute") for m in (1.0, 0.5, 60.0)] == ["1 minute", "0.5 minutes", "60 minutes"]


def test_a_one_minute_budget_that_ran_out_says_1_minute(caplog):
    budget = WallClockBudget(minutes=1)
    budget.load_state_dict({"elapsed": 61.0})  # resumed after its minute
    trainer = SimpleNamespace(strategy=SimpleNamespace(broadcast=lambda x: x), is_global_zero=True, global_step=9,
                              should_stop=False)  # fmt: skip
    with caplog.at_level("INFO", logger="vit"):
        budget.on_train_start(trainer, None)
    assert trainer.should_stop and "The run's budget of 1 minute was used up at step 9" in caplog.text
