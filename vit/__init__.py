"""vit: Vision Transformers (timm-compatible), ResNet baselines and a small GPT, one shared Block."""

from vit import gpt, resnet, vision_transformer  # noqa: F401  (importing registers the models)
from vit.gpt import GPT, GPTConfig
from vit.layers import Attention, Block, set_fused_attn
from vit.registry import create_model, list_models, model_config
from vit.resnet import CifarResNet, CifarResNetConfig, ResNetConfig
from vit.vision_transformer import VisionTransformer, ViTConfig, resample_pos_embed

__all__ = [
    "GPT",
    "Attention",
    "Block",
    "CifarResNet",
    "CifarResNetConfig",
    "GPTConfig",
    "ResNetConfig",
    "ViTConfig",
    "VisionTransformer",
    "create_model",
    "list_models",
    "model_config",
    "resample_pos_embed",
    "set_fused_attn",
]
