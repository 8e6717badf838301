"""Lightning's private members that vit uses are all in vit/lightning_compat.py, and all there.

An upgrade that renames one fails here, naming it, rather than in a run; a file that reaches into
Lightning's internals past vit.lightning_compat fails here too, naming the file and line."""

from __future__ import annotations

import ast
import contextlib
import importlib
import inspect
import pkgutil
import re
from pathlib import Path

import lightning
import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.cli import LightningCLI
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import vit
from vit import lightning_compat as compat

ROOT = Path(__file__).resolve().parents[1]
COMPAT = ROOT / "vit" / "lightning_compat.py"
LIGHTNING_PACKAGES = ("lightning", "pytorch_lightning", "lightning_fabric")


def test_installed_lightning_has_every_private_member() -> None:
    missing = compat.missing_private_members()
    assert not missing, (
        f"Lightning {lightning.__version__} lacks {', '.join(missing)}: vit/lightning_compat.py says what each is "
        "used for; change the accessor there (and the override that uses it) to this release's equivalent"
    )


@pytest.mark.parametrize(
    ("owner", "name", "named"),
    [
        (ModelCheckpoint, "_save_topk_checkpoint", "ModelCheckpoint._save_topk_checkpoint"),
        (LightningCLI, "_parse_ckpt_path", "LightningCLI._parse_ckpt_path"),
        ("lightning.fabric.utilities.load", "_load_distributed_checkpoint",
         "lightning.fabric.utilities.load._load_distributed_checkpoint"),
    ],
)  # fmt: skip
def test_a_missing_member_is_named(monkeypatch: pytest.MonkeyPatch, owner: object, name: str, named: str) -> None:
    owner = importlib.import_module(owner) if isinstance(owner, str) else owner
    monkeypatch.delattr(owner, name)
    assert named in compat.missing_private_members()


def test_a_missing_checkpoint_field_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    fit_loop = type(L.Trainer(accelerator="cpu", logger=False).fit_loop)
    state_dict = fit_loop.state_dict

    def without_val_progress(self: object) -> dict:
        state = state_dict(self)
        del state["epoch_loop.val_loop.batch_progress"]
        del state["epoch_loop.batch_progress"]["current"]["processed"]
        return state

    monkeypatch.setattr(fit_loop, "state_dict", without_val_progress)
    missing = compat.missing_private_members()
    assert 'checkpoint["loops"]["fit_loop"]["epoch_loop.val_loop.batch_progress"]' in missing
    assert 'checkpoint["loops"]["fit_loop"]["epoch_loop.batch_progress"]["current"]["processed"]' in missing


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 1)
        self.ready_at_transfer: list[int] = []

    def on_after_batch_transfer(self, batch: list[torch.Tensor], dataloader_idx: int) -> list[torch.Tensor]:
        self.ready_at_transfer.append(compat.batches_ready(self.trainer))  # the datamodules' Mixup batch index
        return batch

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.layer(batch[0]).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.randn(12, 2)), batch_size=2)


class Positions(Callback):
    """What the accessors say at each training batch, beside Lightning's batch_idx."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, int, int]] = []
        self.attached: list[bool] = []

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: object, i: int) -> None:
        self.seen.append((i, compat.batches_ready(trainer), compat.batches_processed(trainer)))
        self.attached.append(compat.attached_trainer(pl_module) is trainer)


def test_the_accessors_read_what_vit_expects(tmp_path: Path) -> None:
    """batches_ready is a batch's index while it is transferred (the datamodules seed Mixup with it),
    batches_processed counts the batches trained before this one (vit.data.sampling resumes after
    them); a checkpoint holds both loops' progress."""
    positions = Positions()
    trainer = L.Trainer(default_root_dir=tmp_path, accelerator="cpu", devices=1, logger=False, max_steps=3,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[positions])  # fmt: skip
    module = Tiny()
    assert compat.attached_trainer(module) is None
    trainer.fit(module)
    assert module.ready_at_transfer == [0, 1, 2]
    assert positions.seen == [(0, 1, 0), (1, 2, 1), (2, 3, 2)]
    assert all(positions.attached)
    trainer.save_checkpoint(tmp_path / "tiny.ckpt")
    checkpoint = torch.load(tmp_path / "tiny.ckpt", weights_only=True)
    progress = compat.saved_batch_progress(checkpoint)
    assert progress is not None and progress["current"]["processed"] == 3 and not progress["is_last_batch"]
    assert set(progress["current"]) == set(compat.COUNTER_FIELDS)
    assert compat.saved_val_batch_progress(checkpoint) is not None


# -- the one door ----------------------------------------------------------------------------------


def _lightning_private_names() -> set[str]:
    """Private names Lightning defines: methods, attributes set on self, module-level names."""
    pattern = re.compile(
        r"\bdef (_[A-Za-z]\w*)|\bself\.(_[A-Za-z]\w*)\s*(?::[^=\n]*)?=(?!=)|^(_[A-Za-z]\w*)\s*(?::[^=\n]*)?=(?!=)"
        r"|^class (_[A-Za-z]\w*)",
        re.MULTILINE,
    )
    names = set()
    for path in Path(lightning.__file__).parent.rglob("*.py"):
        for match in pattern.finditer(path.read_text(errors="replace")):
            names.add(next(group for group in match.groups() if group))
    return {name for name in names if not name.startswith("__")}


def _vit_files() -> list[Path]:
    return sorted(p for p in (ROOT / "vit").rglob("*.py") if p != COMPAT)


def _defined_by_vit(trees: dict[Path, ast.AST]) -> set[str]:
    """Names vit's own code defines (functions, classes, variables, attributes it assigns to self)."""
    names = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _is_self(node.value):
                names.add(node.attr)  # on another object (`trainer._x = ...`) it is that object's
    return names


def _is_self(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def _delegations(tree: ast.AST) -> set[int]:
    """ids of `super().NAME` inside `def NAME`: an override calling the member it overrides."""
    allowed = set()
    for function in ast.walk(tree):
        if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(function):
                if (isinstance(node, ast.Attribute) and node.attr == function.name and isinstance(node.value, ast.Call)
                        and isinstance(node.value.func, ast.Name) and node.value.func.id == "super"):  # fmt: skip
                    allowed.add(id(node))
    return allowed


def one_door_violations(files: list[Path]) -> list[str]:
    """Lines of `files` that use a Lightning internal other than through vit.lightning_compat: a
    member PRIVATE_MEMBERS lists (its first name: `fit_loop`, `_signal_connector`, ...), a private
    name of Lightning's that vit does not define itself, a private Lightning import, or a key of
    the checkpoint's loop state."""
    trees = {path: ast.parse(path.read_text(), filename=str(path)) for path in files}
    listed = {member.split(".")[0] for _owner, member, _why in compat.PRIVATE_MEMBERS}
    private = _lightning_private_names() - _defined_by_vit(trees)
    keys = {"loops", "fit_loop"} | {key for key, _why in compat.CHECKPOINT_LOOP_KEYS}
    found = []
    for path, tree in trees.items():
        allowed = _delegations(tree)
        where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and id(node) not in allowed and node.attr in listed | private:
                found.append(f"{where}:{node.lineno}: .{node.attr}")
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in LIGHTNING_PACKAGES:
                parts = [*node.module.split("."), *(alias.name for alias in node.names)]
                found += [f"{where}:{node.lineno}: import {part}" for part in parts if part.startswith("_")]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in keys | private:
                found.append(f"{where}:{node.lineno}: {node.value!r}")
    return found


def test_lightning_internals_only_in_lightning_compat() -> None:
    found = one_door_violations(_vit_files())
    assert not found, (
        "Lightning's private members are used through vit/lightning_compat.py only (an accessor there, with why, "
        "and its entry in PRIVATE_MEMBERS); used elsewhere:\n  " + "\n  ".join(found)
    )


def test_the_one_door_check_finds_a_use(tmp_path: Path) -> None:
    """The check above can fail: a listed member, an unlisted private member, a private import
    and a checkpoint key, each used outside vit.lightning_compat, are all found."""
    source = tmp_path / "uses.py"
    source.write_text(
        "from lightning.fabric.utilities.load import _load_distributed_checkpoint\n"
        "def f(trainer, callback, checkpoint):\n"
        "    callback._save_topk_checkpoint(trainer, {})\n"
        "    trainer._checkpoint_connector.dump_checkpoint()\n"
        "    return trainer.fit_loop, checkpoint['loops']\n"
    )
    found = [line.split(": ", 1)[1] for line in one_door_violations([*_vit_files(), source])]
    assert set(found) >= {"import _load_distributed_checkpoint", "._save_topk_checkpoint", "._checkpoint_connector",
                          ".fit_loop", "'loops'"}  # fmt: skip


# -- overrides -------------------------------------------------------------------------------------


def _vit_classes() -> list[type]:
    classes = []
    for info in pkgutil.walk_packages(vit.__path__, "vit."):
        module = importlib.import_module(info.name)
        classes += [c for c in vars(module).values() if inspect.isclass(c) and c.__module__ == module.__name__]
    return classes


def _private_names(cls: type) -> set[str]:
    """Private names a class defines or reaches through `self` in its own body."""
    names = {name for name in vars(cls) if name.startswith("_") and not name.startswith("__")}
    with contextlib.suppress(OSError, TypeError):  # a class without source
        names |= set(re.findall(r"\bself\.(_[A-Za-z]\w*)", inspect.getsource(cls)))
    return names - {"_abc_impl"}  # abc's, on every ABC


def unlisted_overrides(classes: list[type]) -> list[str]:
    """`Class._name` for each private member that a subclass of a Lightning class defines, overrides
    or reads through self and that Lightning's base class has too, and PRIVATE_MEMBERS lacks."""
    listed = {(owner.rpartition(".")[2], member.split(".")[0]) for owner, member, _why in compat.PRIVATE_MEMBERS}
    found = []
    for cls in classes:
        bases = [b for b in cls.__mro__[1:] if b.__module__.split(".")[0] in LIGHTNING_PACKAGES]
        ours = _private_names(cls)
        for base in bases:
            for name in sorted(ours & _private_names(base)):
                if not any((b.__name__, name) in listed for b in bases):
                    found.append(f"{cls.__module__}.{cls.__qualname__}.{name} ({base.__name__} has it)")
    return sorted(set(found))


def test_overridden_lightning_members_are_listed() -> None:
    found = unlisted_overrides(_vit_classes())
    assert not found, (
        "these private members of Lightning's classes are defined or used by vit's subclasses: list each in "
        "vit/lightning_compat.py's PRIVATE_MEMBERS with why (and use it through an accessor there):\n  "
        + "\n  ".join(found)
    )


def test_the_override_check_finds_one() -> None:
    class Sneaky(ModelCheckpoint):
        def _find_last_checkpoints(self, trainer: L.Trainer) -> set[str]:  # a private hook, not listed
            return set()

        def refresh(self) -> None:
            self._last_checkpoint_saved = ""

    found = unlisted_overrides([Sneaky])
    assert any(f.endswith("Sneaky._find_last_checkpoints (ModelCheckpoint has it)") for f in found), found
    assert any(f.endswith("Sneaky._last_checkpoint_saved (ModelCheckpoint has it)") for f in found), found
