"""Sharded training (vit.sharding.ShardedStrategy, FSDP2) as users run it: scripts/train.py on CPU
with gloo, 2 processes; stopped, resumed from its sharded checkpoint, equal to the DDP run;
consolidated into one file that load_model reads. And the ViT-H/14 config."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch

from tests.conftest import ROOT
from vit.checkpoint import load_model, read_lightning_checkpoint
from vit.cli import main
from vit.registry import create_model
from vit.sharding import consolidate, sharded_checkpoint_complete

TIMEOUT = 300


class SigtermAt(L.Callback):
    """SIGTERM to rank 0 after optimizer step `step`, as a scheduler's pre-emption."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: L.Trainer, *args) -> None:
        if trainer.global_step == self.step and trainer.global_rank == 0:
            os.kill(os.getpid(), signal.SIGTERM)


class ShardReport(L.Callback):
    """Each rank writes how many of the model's parameters it holds (its shards) and in all."""

    def __init__(self, dirpath: str) -> None:
        self.dirpath = Path(dirpath)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        params = list(pl_module.model.parameters())
        local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in params)
        self.dirpath.mkdir(parents=True, exist_ok=True)
        report = {"local": local, "total": sum(p.numel() for p in params), "world_size": trainer.world_size}
        (self.dirpath / f"rank{trainer.global_rank}.json").write_text(json.dumps(report))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train(tmp_path: Path, name: str, strategy: str, *extra: str, callbacks: str = "") -> subprocess.CompletedProcess:
    """scripts/train.py fit: the default config (vit_nano_patch4_16 on the digits), 6 steps of 2 x 32
    images on 2 CPU processes."""
    config = tmp_path / f"{name}.yaml"
    callbacks = callbacks or "    []\n"
    config.write_text(f"trainer:\n  strategy:\n{strategy}  callbacks:\n{callbacks}")
    command = [
        sys.executable, str(ROOT / "scripts" / "train.py"), "fit",
        "--config", str(ROOT / "configs" / "default.yaml"), "--config", str(config),
        "--trainer.default_root_dir", str(tmp_path / name), "--trainer.accelerator", "cpu", "--trainer.devices", "2",
        "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "6", "--trainer.limit_val_batches", "1",
        "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
        "--trainer.logger", "false",
        "--data.batch_size", "32", "--data.num_workers", "0", *extra,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "MASTER_PORT": str(_free_port())}
    env.pop("LOCAL_RANK", None)
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=TIMEOUT, cwd=ROOT)


SHARDED = "    class_path: vit.sharding.ShardedStrategy\n"


@pytest.mark.slow
def test_sharded_fit_resumes_and_matches_ddp(tmp_path):
    report = tmp_path / "report"
    callbacks = (
        f"    - class_path: tests.test_sharded.ShardReport\n      init_args:\n        dirpath: {report}\n"
        "    - class_path: tests.test_sharded.SigtermAt\n      init_args:\n        step: 3\n"
    )
    stopped = _train(tmp_path, "sharded", SHARDED, callbacks=callbacks)
    assert stopped.returncode == 143, stopped.stderr[-3000:]  # SIGTERM after step 3: all ranks stop after step 4, saved
    checkpoints = tmp_path / "sharded" / "checkpoints"
    interrupted = checkpoints / "last-interrupted.ckpt"
    assert sharded_checkpoint_complete(interrupted)
    assert sorted(p.name for p in interrupted.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]  # a shard per rank
    shards = [json.loads((report / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [s["world_size"] for s in shards] == [2, 2]
    assert sum(s["local"] for s in shards) == shards[0]["total"]  # each parameter held once, split in two
    assert max(s["local"] for s in shards) < 0.6 * shards[0]["total"]

    resumed = _train(tmp_path, "sharded", SHARDED, "--ckpt_path", "last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Restored all states from the checkpoint" in resumed.stdout + resumed.stderr
    assert not list(checkpoints.glob(".*"))  # no temporary directories left
    ddp = _train(tmp_path, "ddp", "    ddp\n")
    assert ddp.returncode == 0, ddp.stderr[-3000:]

    # the sharded run, stopped at step 4 and resumed, ends where the uninterrupted DDP run does
    full = consolidate(checkpoints / "last.ckpt", tmp_path / "vit_nano.ckpt")
    checkpoint = read_lightning_checkpoint(full)
    assert checkpoint["global_step"] == 6 and len(checkpoint["optimizer_states"]) == 1
    sharded_model = load_model(full)
    ddp_model = load_model(tmp_path / "ddp" / "checkpoints" / "last.ckpt")
    expected = ddp_model.state_dict()
    for name, value in sharded_model.state_dict().items():
        torch.testing.assert_close(value, expected[name], atol=1e-6, rtol=1e-5, msg=name)
    x = torch.randn(4, 3, 16, 16)
    torch.testing.assert_close(sharded_model(x), ddp_model(x), atol=1e-5, rtol=1e-5)


def test_vit_h14_config_parses_and_its_parameter_count_is_the_models(capsys):
    config = ROOT / "configs" / "imagenet_vit_h14_fsdp.yaml"
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(config), "--print_config"])
    assert exit_info.value.code in (0, None)
    printed = capsys.readouterr().out
    assert "class_path: vit.sharding.ShardedStrategy" in printed and "model_name: vit_huge_patch14_224" in printed
    with torch.device("meta"):  # the memory arithmetic in the config's header starts from this count
        model = create_model("vit_huge_patch14_224", num_classes=1000)
    assert sum(p.numel() for p in model.parameters()) == 632_045_800
    assert sum(p.numel() for p in model.blocks[0].parameters()) == 19_677_440
    assert "632,045,800" in config.read_text() and "19,677,440" in config.read_text()


@pytest.mark.parametrize(
    ("options", "reason"),
    [
        ({"optimizer": {"name": "muon"}}, "optimizer.name muon needs whole weight matrices"),
        ({"ema_decay": 0.999}, "ema_decay keeps an unsharded copy of the model"),
        ({"speed": {"compile": True}}, "speed.compile is not supported with ShardedStrategy"),
        ({"model_name": "resnet18"}, "ShardedStrategy shards models made of vit.layers.Block"),
    ],
)
def test_what_sharding_cannot_train_is_refused_with_the_reason(options, reason):
    """The refusals README promises, as ShardedStrategy.setup meets them, before anything is sharded;
    the same task without the option passes, and with a distillation teacher is refused."""
    from vit.lit import ImageClassifier
    from vit.sharding import check_shardable

    task = ImageClassifier(**{"model_name": "vit_nano_patch4_16", "num_classes": 10, **options})
    with pytest.raises(ValueError, match=reason):
        check_shardable(task, task.model)
    plain = ImageClassifier("vit_nano_patch4_16", num_classes=10)
    check_shardable(plain, plain.model)
    plain._teacher = create_model("vit_nano_patch4_16", num_classes=10)  # as a loaded teacher is held
    with pytest.raises(ValueError, match="distillation \\(teacher\\) is not supported with ShardedStrategy"):
        check_shardable(plain, plain.model)
