"""Sharded training for ViTs past one GPU's memory: `ShardedStrategy`, and consolidation of its
checkpoints into one file.

`ShardedStrategy` is Lightning's ModelParallelStrategy with PyTorch's `fully_shard` (FSDP2) applied
to our models: every transformer `Block` is one unit (its parameters are gathered just before it
runs and freed after), the rest of the model (patch and position embeddings, final norm, head) the
root unit. Parameters, gradients and optimizer states are sharded over all processes (one shard per
GPU), activations are recomputed per Block in the backward pass, and under `bf16-mixed` the blocks
compute with bfloat16 parameters while gradients are reduced in float32. Checkpoints are sharded:
a directory per checkpoint (`last.ckpt/`) with one file per process, written to a temporary name
and renamed, and never with non-finite weights; `--ckpt_path last` resumes from them on any number
of processes. `consolidate` turns one into a single `.ckpt` that `vit.checkpoint.load_model` and
`--model.finetune.init_from` read.

Why not Lightning's FSDPStrategy (FSDP1, `auto_wrap_policy={Block}`): with torch 2.14 it refuses
to run without a GPU (`RuntimeError: FSDP needs a non-CPU accelerator device`, and Lightning's
own check: "The strategy `fsdp` requires a GPU accelerator"), so nothing of it could be tested on
CPU; and it flattens each unit's parameters into 1-D shards before the optimizer is built, so the
optimizer groups that exclude biases and norms from weight decay (by `ndim`) would see none. FSDP2
keeps every parameter as a DTensor of its own shape and runs on CPU with gloo.
"""

from __future__ import annotations

import argparse
import logging
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn

from vit import lightning_compat as compat
from vit.fault_tolerance import (
    DCP_METADATA,
    METADATA,
    AtomicCheckpointIO,
    NonFiniteLossError,
    checkpoint_complete,
    nan_advice,
)
from vit.layers import BLOCKS

log = logging.getLogger(__name__)


class ShardedStrategy(ModelParallelStrategy):
    """Fully sharded data parallel (FSDP2) over every process, each Block its own unit.

    Args:
        activation_checkpointing: recompute each Block's activations in the backward pass (stores
            only the Blocks' inputs); the model's own `set_grad_checkpointing`.
        reshard_after_forward: free a Block's gathered parameters after its forward and gather them
            again for the backward (ZeRO-3; least memory). False keeps them to the backward (ZeRO-2:
            one all-gather fewer per Block and step, more memory).
        save_distributed_checkpoint: sharded checkpoint directories (True) or one full file
            gathered on rank 0 (False; every rank must hold the full model's CPU copy meanwhile).

    Precision comes from the Trainer: `bf16-mixed` adds FSDP2's mixed precision (bfloat16
    parameters in the forward and backward, float32 gradient reduction, float32 master weights and
    optimizer states); `32-true` is float32 throughout. Use it in a config as
    `trainer: {strategy: {class_path: vit.sharding.ShardedStrategy}}`.
    """

    def __init__(
        self,
        activation_checkpointing: bool = True,
        reshard_after_forward: bool = True,
        save_distributed_checkpoint: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(save_distributed_checkpoint=save_distributed_checkpoint, **kwargs)
        self.activation_checkpointing = activation_checkpointing
        self.reshard_after_forward = reshard_after_forward

    def setup_environment(self) -> None:
        # One data-parallel dimension over every process (no tensor parallelism): the mesh fully_shard uses.
        compat.set_parallel_sizes(self, data_parallel=self.num_nodes * self.num_processes, tensor_parallel=1)
        super().setup_environment()

    def setup(self, trainer: Any) -> None:
        task = self.lightning_module
        model = getattr(task, "model", None)
        check_shardable(task, model)
        if self.activation_checkpointing:
            model.set_grad_checkpointing(True)
        shard_model(model, self.device_mesh["data_parallel"], mixed_precision(trainer.precision),
                    self.reshard_after_forward)  # fmt: skip
        super().setup(trainer)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """A sharded checkpoint is written to `.<name>.tmp` and renamed into place once every rank
        has written its shard, so `name` is never a half-written mix of two steps; a checkpoint
        with non-finite weights is refused, as vit.fault_tolerance.AtomicCheckpointIO does."""
        if not compat.saves_distributed(self):
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        path = Path(self.broadcast(str(filepath)))
        bad = non_finite_shards(checkpoint.get("state_dict", {}))
        if self.reduce_boolean_decision(bool(bad), all=False):
            raise NonFiniteLossError(
                f"the weights are not finite after step {checkpoint.get('global_step')} ({', '.join(bad[:3])}); "
                f"not saving {path}. {nan_advice(path.parent)}"
            )
        tmp = path.with_name(f".{path.name}.tmp")
        if self.global_rank == 0 and tmp.exists():
            shutil.rmtree(tmp)
        self.barrier("sharded_checkpoint_tmp")
        super().save_checkpoint(checkpoint, tmp, storage_options)
        self.barrier("sharded_checkpoint_written")
        if self.global_rank == 0:
            old = path.with_name(f".{path.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            if path.is_dir():
                path.rename(old)
            elif path.exists():
                path.unlink()
            tmp.rename(path)
            shutil.rmtree(old, ignore_errors=True)
        self.barrier("sharded_checkpoint_renamed")
        return None


def check_shardable(task: Any, model: nn.Module | None) -> None:
    """What ShardedStrategy cannot train, refused before anything runs."""
    if model is None or not any(isinstance(m, BLOCKS) for m in model.modules()):
        raise ValueError(
            "ShardedStrategy shards models made of vit.layers.Block (the ViTs, the GPT); "
            f"{type(model).__name__} has none: use strategy ddp"
        )
    optimizer, speed = getattr(task, "optimizer", None), getattr(task, "speed", None)
    if getattr(optimizer, "name", None) == "muon":
        raise ValueError("optimizer.name muon needs whole weight matrices; with ShardedStrategy use adamw or sgd")
    if getattr(task, "ema", None) is not None:
        raise ValueError("ema_decay keeps an unsharded copy of the model; it is not supported with ShardedStrategy")
    if getattr(task, "_teacher", None) is not None:
        raise ValueError("distillation (teacher) is not supported with ShardedStrategy")
    if getattr(speed, "compile", False):
        raise ValueError("speed.compile is not supported with ShardedStrategy here (not tested); use strategy ddp")


def mixed_precision(precision: str) -> Any:
    """FSDP2's policy for the Trainer's precision: bfloat16 compute, float32 gradient reduction under
    bf16-mixed; None (float32) otherwise."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if str(precision) == "bf16-mixed":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if str(precision) != "32-true":
        raise ValueError(f"ShardedStrategy trains with precision 32-true or bf16-mixed, not {precision}")
    return None


def shard_model(model: nn.Module, mesh: Any, mp_policy: Any = None, reshard_after_forward: bool = True) -> nn.Module:
    """fully_shard each Block, then the model (its remaining parameters: embeddings, norm, head)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    options = {"mesh": mesh, "mp_policy": mp_policy or MixedPrecisionPolicy()}
    for module in model.modules():
        if isinstance(module, BLOCKS):
            fully_shard(module, reshard_after_forward=reshard_after_forward, **options)
    fully_shard(model, reshard_after_forward=reshard_after_forward, **options)
    return model


def non_finite_shards(state_dict: dict[str, Any]) -> list[str]:
    """Names of the tensors whose local shard (this rank's part of a DTensor) holds NaN or inf."""
    bad = []
    for name, value in state_dict.items():
        local = value.to_local() if hasattr(value, "to_local") else value
        if torch.is_tensor(local) and local.is_floating_point() and not local.isfinite().all():
            bad.append(name)
    return bad


# -- sharded checkpoints -----------------------------------------------------------------------


def is_sharded_checkpoint(path: str | Path) -> bool:
    return Path(path).is_dir() and (Path(path) / METADATA).is_file()


def sharded_checkpoint_complete(path: str | Path) -> bool:
    """Every shard was written in full: torch.distributed.checkpoint writes its index after all of
    them and Lightning its metadata file after that (ShardedStrategy renames the directory in place
    only then); vit.fault_tolerance.checkpoint_complete also checks each shard's length."""
    return Path(path).is_dir() and checkpoint_complete(path)


def consolidate(folder: str | Path, out: str | Path) -> Path:
    """One `.ckpt` file from a sharded checkpoint directory, in the layout of a single-process run
    (`state_dict`, `optimizer_states`, the hyperparameters and our `vit` metadata), so
    `vit.checkpoint.load_model(out)` rebuilds the model and `--model.finetune.init_from out` starts from it.

    Read with Lightning's loader for distributed checkpoints (the whole model in CPU memory).
    Lightning's own `python -m lightning.pytorch.utilities.consolidate_checkpoint` expects
    FSDPStrategy's layout (the weights under `model`) and stops with KeyError: 'model' on
    ModelParallelStrategy's (under `state_dict`); this takes both.
    """
    folder, out = Path(folder), Path(out)
    if not folder.exists():
        raise FileNotFoundError(f"{folder} does not exist; expected a sharded checkpoint directory")
    if not folder.is_dir():
        raise ValueError(
            f"{folder} is a file, not a sharded checkpoint directory: it is one checkpoint already "
            "(vit.checkpoint.load_model and --model.finetune.init_from read it as it is)"
        )
    if not sharded_checkpoint_complete(folder):
        raise ValueError(
            f"{folder} is not a complete sharded checkpoint: its index ({DCP_METADATA}) or {METADATA} is missing, "
            "or a shard is shorter than the index says (a kill or a full disk while it was written)"
        )
    checkpoint = compat.load_distributed_checkpoint(folder)
    if "model" in checkpoint:  # FSDPStrategy's layout
        checkpoint["state_dict"] = checkpoint.pop("model")
    optimizers = sorted((k for k in checkpoint if re.fullmatch(r"optimizer_\d+", k)), key=lambda k: int(k[10:]))
    if optimizers:
        checkpoint["optimizer_states"] = [checkpoint.pop(k) for k in optimizers]
    AtomicCheckpointIO().save_checkpoint(checkpoint, out)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="Consolidate a sharded checkpoint directory (vit.sharding.ShardedStrategy) into one .ckpt file "
        "that vit.checkpoint.load_model and --model.finetune.init_from read."
    )
    parser.add_argument("folder", type=Path, help="the sharded checkpoint, e.g. runs/x/checkpoints/last.ckpt")
    parser.add_argument("out", type=Path, help="the file to write, e.g. vit_h14.ckpt")
    args = parser.parse_args(argv)
    try:
        written = consolidate(args.folder, args.out)
    except (OSError, ValueError) as e:
        sys.exit(f"error: {e}")
    print(f"wrote {written}")


if __name__ == "__main__":
    main()
