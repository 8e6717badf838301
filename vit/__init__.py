"""vit: Vision Transformers (timm-compatible), ResNet baselines and a small GPT, one shared Block."""

from vit import eva, gpt, naflex, relpos, resnet, sam, timm_args, vision_transformer  # noqa: F401  (importing registers the models)
from vit.adapt import checkpoint_filter_fn
from vit.eva import Eva, EvaConfig
from vit.gpt import GPT, GPTConfig
from vit.layers import Attention, Block, BlockConfig, CrossAttention, set_fused_attn
from vit.naflex import NaFlexConfig, NaFlexVit
from vit.registry import create_model, list_models, model_config
from vit.relpos import RelPosConfig, VisionTransformerRelPos
from vit.resnet import CifarResNet, CifarResNetConfig, ResNetConfig
from vit.sam import Sam, SamConfig
from vit.vision_transformer import VisionTransformer, ViTConfig

__all__ = [
    "GPT",
    "Attention",
    "Block",
    "BlockConfig",
    "CifarResNet",
    "CifarResNetConfig",
    "CrossAttention",
    "Eva",
    "EvaConfig",
    "GPTConfig",
    "NaFlexConfig",
    "NaFlexVit",
    "RelPosConfig",
    "ResNetConfig",
    "Sam",
    "SamConfig",
    "ViTConfig",
    "VisionTransformer",
    "VisionTransformerRelPos",
    "checkpoint_filter_fn",
    "create_model",
    "list_models",
    "model_config",
    "set_fused_attn",
]
