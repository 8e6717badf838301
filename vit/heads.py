"""Which parameters are a classifier head, by name: what a new class count re-initialises and what
fine-tuning trains at the head's own learning rate."""

from __future__ import annotations

# The classifier of our ViTs (and a distilled ViT's second head), torchvision ResNets, CIFAR ResNets.
HEAD_NAMES = ("head", "head_dist", "fc", "linear")


def is_head(name: str) -> bool:
    """Whether parameter `name` belongs to a classifier head."""
    return name.split(".")[0] in HEAD_NAMES
