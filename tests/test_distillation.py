"""DeiT distillation: a ViT's distillation token and second head (timm's VisionTransformerDistilled),
and ImageClassifier's teacher losses (hard and soft)."""

from __future__ import annotations

import lightning as L
import pytest
import timm
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from vit import create_model
from vit.lit import Distillation, ImageClassifier
from vit.vision_transformer import VisionTransformer, ViTConfig

SMALL = dict(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=2, num_classes=10)


@pytest.mark.parametrize("global_pool", ["token", "avg"])
def test_a_distilled_vit_is_timms_deit_distilled_model(global_pool):
    """timm's DeiT checkpoints load strictly; inference averages the two heads, training with
    distilled_training returns them apart, as timm does. With average pooling (which timm's class
    does not have) the class head reads the patch tokens and the distillation head its token."""
    ours = VisionTransformer(ViTConfig(**SMALL, distilled=True, global_pool=global_pool))
    x = torch.randn(3, 3, 32, 32)
    if global_pool == "token":
        theirs = timm.models.deit.VisionTransformerDistilled(**SMALL).eval()
        ours.load_state_dict(theirs.state_dict(), strict=True)
        torch.testing.assert_close(ours.eval()(x), theirs(x), atol=1e-5, rtol=0)
        ours.set_distilled_training(True)
        theirs.set_distilled_training(True)
        for a, b in zip(ours.train()(x), theirs.train()(x), strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    else:
        ours.set_distilled_training(True)
        cls, dist = ours.train()(x)
        tokens = ours.forward_features(x)
        torch.testing.assert_close(cls, ours.head(ours.fc_norm(tokens[:, 2:].mean(1))))
        torch.testing.assert_close(dist, ours.head_dist(ours.fc_norm(tokens[:, 1])))
        torch.testing.assert_close(ours.eval()(x), (cls + dist) / 2)
    assert ours.num_prefix_tokens == 2 and ours.pos_embed.shape[1] == 16 + 2


def _resnet20_file(tmp_path, num_classes=10):
    path = tmp_path / "teacher.pth"
    torch.save(create_model("resnet20", num_classes=num_classes).state_dict(), path)
    return str(path)


@pytest.mark.parametrize(("distillation", "alpha", "tau"), [("hard", 0.5, 1.0), ("soft", 0.3, 2.0)])
def test_the_loss_is_the_weighted_label_and_teacher_terms(tmp_path, distillation, alpha, tau):
    teacher_file = _resnet20_file(tmp_path)
    module = ImageClassifier(
        "vit_micro_patch4_32", {"distilled": True, "depth": 1}, num_classes=10, label_smoothing=0.1,
        distillation=Distillation(teacher_file, "resnet20", kind=distillation, alpha=alpha, tau=tau),
    )  # fmt: skip
    x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))
    module.model.train()
    cls, dist = module(x)
    teacher = create_model("resnet20", num_classes=10)
    teacher.load_state_dict(torch.load(teacher_file))
    t = teacher.eval()(x).detach()
    if distillation == "hard":
        teacher_term = F.cross_entropy(dist, t.argmax(-1))
    else:
        p_t = F.softmax(t / tau, -1)
        teacher_term = (p_t * (p_t.log() - F.log_softmax(dist / tau, -1))).sum(-1).mean() * tau**2
    expected = (1 - alpha) * F.cross_entropy(cls, y, label_smoothing=0.1) + alpha * teacher_term
    with pytest.warns(UserWarning, match="self.log"):
        got = module.distillation_loss(x, (cls, dist), y)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert not any("linear" in k or "layer1" in k for k in module.state_dict())  # the teacher is not saved


class _RightHalfTeacher(nn.Module):
    """Says class 1 when the image's right half is bright, else 0: not the labels' rule."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = x[..., x.shape[-1] // 2 :].mean(dim=(1, 2, 3))
        return torch.stack([-m, m], dim=1) * 10


def _halves(n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Images whose left half is bright or dark (the label) and right half too (the teacher's rule)."""
    left, right = torch.randint(0, 2, (n,), generator=generator), torch.randint(0, 2, (n,), generator=generator)
    x = torch.randn(n, 3, 16, 16, generator=generator) * 0.3
    x[..., :8] += (left.float() * 2 - 1).view(-1, 1, 1, 1)
    x[..., 8:] += (right.float() * 2 - 1).view(-1, 1, 1, 1)
    return x, left, right


def test_the_distillation_head_learns_the_teacher_and_the_class_head_the_labels(tmp_path):
    """Labels follow the left half's brightness, the teacher the right half's (independent): each
    head learns its own target."""
    generator = torch.Generator().manual_seed(0)
    (x, left, _), (test, test_left, test_right) = _halves(768, generator), _halves(256, generator)
    L.seed_everything(0)
    module = ImageClassifier(
        "vit_nano_patch4_16", {"distilled": True, "depth": 2}, num_classes=2, optimizer={"lr": 3e-3},
        schedule={"warmup_fraction": 0.1},
        distillation=Distillation(_resnet20_file(tmp_path, num_classes=2), "resnet20"),
    )  # fmt: skip
    module.__dict__["_teacher"] = _RightHalfTeacher()
    trainer = L.Trainer(
        default_root_dir=tmp_path, accelerator="cpu", max_epochs=12, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False,
    )  # fmt: skip
    trainer.fit(module, DataLoader(TensorDataset(x, left), batch_size=32, shuffle=True))
    with torch.no_grad():
        cls, dist = module.model.train()(test)  # dropout-free model: train mode only splits the heads
    assert (cls.argmax(1) == test_left).float().mean() > 0.95
    assert (dist.argmax(1) == test_right).float().mean() > 0.95
    assert 0.3 < (cls.argmax(1) == test_right).float().mean() < 0.7  # the class head ignores the teacher's rule


def test_a_teacher_for_another_class_count_or_a_distilled_model_without_one_is_refused(tmp_path):
    with pytest.raises(ValueError, match="predicts 100 classes but the model has 10"):
        ImageClassifier(
            "vit_nano_patch4_16",
            num_classes=10,
            distillation={"teacher": _resnet20_file(tmp_path, 100), "teacher_model": "resnet20"},
        )
    with pytest.raises(ValueError, match="needs a teacher"):
        ImageClassifier("vit_nano_patch4_16", {"distilled": True}, num_classes=10)
