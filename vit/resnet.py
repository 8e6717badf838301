"""ResNet baselines: torchvision's ImageNet ResNets and the CIFAR ResNet-20/32/44/56/110 of He et al. 2016.

The CIFAR family uses option-A (parameter-free, zero-padded) shortcuts and the parameter names of
akamaster/pytorch_resnet_cifar10, so its published checkpoints load (after `module.` is stripped).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import torchvision
from torch import nn

from vit.registry import register_model


@dataclass
class ResNetConfig:
    arch: str = "resnet50"  # torchvision constructor name: resnet18 / resnet34 / resnet50
    num_classes: int = 1000
    # 3x3 stride-1 first conv and no max-pool, so 32x32 inputs keep a 32x32 first feature map.
    cifar_stem: bool = False
    zero_init_residual: bool = False


def torchvision_resnet(config: ResNetConfig) -> torchvision.models.ResNet:
    if config.arch not in ("resnet18", "resnet34", "resnet50", "resnet101", "resnet152"):
        raise ValueError(f"unknown torchvision ResNet {config.arch!r}")
    model = getattr(torchvision.models, config.arch)(
        weights=None, num_classes=config.num_classes, zero_init_residual=config.zero_init_residual
    )
    if config.cifar_stem:
        model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
        nn.init.kaiming_normal_(model.conv1.weight, mode="fan_out", nonlinearity="relu")
        model.maxpool = nn.Identity()
    return model


@dataclass
class CifarResNetConfig:
    depth: int = 20  # 6n + 2: 20, 32, 44, 56, 110
    num_classes: int = 10

    def __post_init__(self) -> None:
        if (self.depth - 2) % 6:
            raise ValueError(f"CIFAR ResNet depth must be 6n + 2 (20, 32, 44, 56, 110), got {self.depth}")


class ShortcutA(nn.Module):
    """Option-A shortcut: subsample by 2 and zero-pad the new channels; no parameters."""

    def __init__(self, pad: int) -> None:
        super().__init__()
        self.pad = pad

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.pad(x[:, :, ::2, ::2], (0, 0, 0, 0, self.pad, self.pad))


class BasicBlock(nn.Module):
    def __init__(self, in_planes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        changes_shape = stride != 1 or in_planes != planes
        self.shortcut = ShortcutA((planes - in_planes) // 2) if changes_shape else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class CifarResNet(nn.Module):
    def __init__(self, config: CifarResNetConfig) -> None:
        super().__init__()
        self.config = config
        n = (config.depth - 2) // 6
        self.conv1 = nn.Conv2d(3, 16, 3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.layer1 = self._stage(16, 16, n, stride=1)
        self.layer2 = self._stage(16, 32, n, stride=2)
        self.layer3 = self._stage(32, 64, n, stride=2)
        self.linear = nn.Linear(64, config.num_classes)
        for m in self.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                nn.init.kaiming_normal_(m.weight)

    @staticmethod
    def _stage(in_planes: int, planes: int, n: int, stride: int) -> nn.Sequential:
        blocks = [BasicBlock(in_planes, planes, stride)] + [BasicBlock(planes, planes) for _ in range(n - 1)]
        return nn.Sequential(*blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = self.layer3(self.layer2(self.layer1(x)))
        return self.linear(F.adaptive_avg_pool2d(x, 1).flatten(1))


for _arch in ("resnet18", "resnet34", "resnet50"):
    register_model(_arch, torchvision_resnet, ResNetConfig, arch=_arch)
for _depth in (20, 32, 44, 56, 110):
    register_model(f"resnet{_depth}", CifarResNet, CifarResNetConfig, depth=_depth)
