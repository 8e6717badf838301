"""Data that is not there (a CIFAR root without the dataset, a download the network refuses) ends a
`scripts/train.py fit` in one line, `error: <what to do>`, exit 1, not a traceback from inside
Lightning; an OSError that is not ours (a library's, the system's) keeps its traceback."""

from __future__ import annotations

import socket
import urllib.error
from pathlib import Path

import pytest

from tests.conftest import ROOT
from vit.cli import main
from vit.data import TextDataModule

QUIET = [
    "--trainer.enable_progress_bar",
    "false",
    "--trainer.enable_model_summary",
    "false",
    "--trainer.logger",
    "false",
]


def _last_error_line(capsys) -> tuple[str, str]:
    err = capsys.readouterr().err
    return err, err.strip().splitlines()[-1]


def test_a_cifar_root_without_the_dataset_is_one_line_with_exit_1(tmp_path, capsys):
    root = tmp_path / "nonexistent"
    with pytest.raises(SystemExit) as stop:
        main(["fit", "--config", str(ROOT / "configs/cifar10_vit.yaml"), "--trainer.default_root_dir", str(tmp_path),
              "--data.root", str(root), "--data.download", "false", *QUIET])  # fmt: skip
    err, last = _last_error_line(capsys)
    assert stop.value.code == 1 and "Traceback" not in err
    assert last.startswith(f"error: cifar10 is not in {root / 'cifar-10-batches-py'}")
    assert f"Download https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz and extract it into {root}" in last


def test_an_offline_tiny_shakespeare_download_is_one_line_naming_data_path(tmp_path, capsys, monkeypatch):
    def offline(url, timeout=None):
        raise urllib.error.URLError(socket.gaierror(-3, "Temporary failure in name resolution"))

    monkeypatch.setattr("urllib.request.urlopen", offline)
    with pytest.raises(SystemExit) as stop:
        main(["fit", "--config", str(ROOT / "configs/gpt/cpu.yaml"), "--trainer.default_root_dir", str(tmp_path),
              "--data.download_dir", str(tmp_path / "data"), *QUIET])  # fmt: skip
    err, last = _last_error_line(capsys)
    assert stop.value.code == 1 and "Traceback" not in err
    assert last.startswith("error: could not download Tiny Shakespeare (<urlopen error [Errno -3] Temporary failure")
    assert "fetch https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt" in last
    assert "pass the file with --data.path /path/to/input.txt" in last


def _library_error() -> None:
    raise OSError("a library's own words")


def _bare_open_in_vit() -> None:
    from vit.checkpoint import _torch_load

    _torch_load(Path("/nonexistent/x.ckpt"))  # open() itself raises: an errno, no advice of ours


@pytest.mark.parametrize("fail", [_library_error, _bare_open_in_vit], ids=["raised-outside-vit", "errno-from-open"])
def test_an_oserror_that_is_not_our_advice_keeps_its_traceback(tmp_path, monkeypatch, fail):
    monkeypatch.setattr(TextDataModule, "prepare_data", lambda self: fail())
    with pytest.raises(OSError) as raised:
        main(["fit", "--config", str(ROOT / "configs/gpt/cpu.yaml"), "--trainer.default_root_dir", str(tmp_path),
              "--data.download_dir", str(tmp_path / "data"), *QUIET])  # fmt: skip
    assert "a library's own words" in str(raised.value) or raised.value.errno == 2


def test_our_log_lines_go_to_stderr_as_it_is_when_they_are_logged(monkeypatch):
    """A run's handler outlives the stream stderr was when it was made (a redirect, a test's capture
    that is closed): a later line goes to stderr as it is then, with no logging error."""
    import io
    import logging
    import sys

    from vit.cli import show_our_logs

    logger = logging.getLogger("vit")
    monkeypatch.setattr(logger, "handlers", [])
    monkeypatch.setattr(logger, "level", logger.level)
    first, second = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    show_our_logs()
    first.close()
    monkeypatch.setattr(sys, "stderr", second)
    logging.getLogger("vit.data").info("resampled pos_embed")
    assert second.getvalue() == "[vit] resampled pos_embed\n"
