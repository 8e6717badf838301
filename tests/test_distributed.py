"""DDP as users run it (scripts/train.py, strategy ddp), on CPU with gloo: 2 processes on one
machine, and 2 "nodes" on localhost."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT
from vit import create_model
from vit.data import DigitsDataModule

pytestmark = pytest.mark.slow

TIMEOUT = 300


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _command(tmp_path: Path, *overrides: str) -> list[str]:
    extra = tmp_path / "report.yaml"
    extra.write_text(
        "trainer:\n  callbacks:\n    - class_path: tests.rank_report.RankReport\n"
        f"      init_args:\n        dirpath: {tmp_path / 'report'}\n"
    )
    return [
        sys.executable, str(ROOT / "scripts" / "train.py"), "fit",
        "--config", str(ROOT / "configs" / "default.yaml"), "--config", str(extra),
        "--trainer.default_root_dir", str(tmp_path / "run"), "--trainer.accelerator", "cpu",
        "--trainer.strategy", "ddp", "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "4",
        "--trainer.enable_progress_bar", "false", "--data.num_workers", "0", *overrides,
    ]  # fmt: skip


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **extra}
    env.pop("LOCAL_RANK", None)
    return env


def _reports(tmp_path: Path) -> list[dict]:
    return [json.loads((tmp_path / "report" / f"rank{r}.json").read_text()) for r in (0, 1)]


def _check_ranks_agree_and_one_checkpoint_set(tmp_path: Path) -> dict:
    reports = _reports(tmp_path)
    assert [r["world_size"] for r in reports] == [2, 2]
    assert [r["global_step"] for r in reports] == [4, 4]
    weights = [torch.load(tmp_path / "report" / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    for name, value in weights[0].items():
        assert torch.equal(value, weights[1][name]), name  # DDP kept the replicas identical
    checkpoints = sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("*.ckpt"))
    assert checkpoints == ["best-epoch000-step4.ckpt", "last.ckpt"]  # written once, by rank 0
    return {"reports": reports, "weights": weights[0]}


def _val_accuracy(state_dict: dict) -> float:
    """Accuracy of the final weights on the whole val split, computed in this process."""
    model = create_model("vit_nano_patch4_16", img_size=16, num_classes=10).eval()
    model.load_state_dict(state_dict)
    data = DigitsDataModule(batch_size=360, num_workers=0)
    data.setup("validate")
    x, y = next(iter(data.val_dataloader()))
    with torch.no_grad():
        return (model(x).argmax(1) == y).float().mean().item()


def test_two_process_ddp_on_cpu(tmp_path):
    # whiten_patch_embed sets the patch embedding from a batch, which differs between ranks: every
    # rank must take rank 0's, or the replicas part from the first step.
    command = _command(tmp_path, "--trainer.devices", "2", "--model.whiten_patch_embed", "true")
    result = subprocess.run(
        command, env=_env(MASTER_PORT=str(_free_port())),
        capture_output=True, text=True, timeout=TIMEOUT, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    checked = _check_ranks_agree_and_one_checkpoint_set(tmp_path)
    # val/acc1 is synced: each rank saw half of the 360 val images, both report the whole set's accuracy
    acc = [r["metrics"]["val/acc1"] for r in checked["reports"]]
    assert acc[0] == acc[1] == pytest.approx(_val_accuracy(checked["weights"]), abs=1e-6)


def test_two_nodes_on_localhost(tmp_path):
    port = str(_free_port())
    command = _command(tmp_path, "--trainer.num_nodes", "2", "--trainer.devices", "1")
    procs = [
        subprocess.Popen(
            command,
            env=_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, NODE_RANK=str(node)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        for node in (0, 1)
    ]
    for p in procs:
        _, err = p.communicate(timeout=TIMEOUT)
        assert p.returncode == 0, err[-3000:]
    _check_ranks_agree_and_one_checkpoint_set(tmp_path)
