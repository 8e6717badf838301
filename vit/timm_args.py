"""timm's model arguments, read and written, for the ViT family.

Reading: timm's model functions pass their arguments to private builders (`_create_vision_transformer`,
`_create_eva`, ...); `record_timm_builder` calls a model function with its builder swapped for a
recorder, so nothing is built, and the family modules (eva, relpos, sam, naflex) turn what it records
into their configs (with `timm_norm`). The ViT's, DeiT's and the hybrids' names are read and
registered here (`timm_model_args`, `from_timm_args`), and our size table's (VIT_MODELS). The same
reading gives `create_model(name, **kwargs)` timm's meaning of timm's arguments (vit.registry.TimmArgs):
a timm name's model function is called again with them; a table name takes them one by one. Where an
installed timm changed its builders, vit.registry.register_timm_names lists the names affected as
unsupported with the error, and the name-count tests (tests/test_vision_transformer.py,
tests/test_relpos_sam.py) fail naming them; `import vit` stands.

Writing: `timm_kwargs(config)`, the kwargs of timm's VisionTransformer that builds our config (the
tests' and the benchmark's reference model, Google's `.npz` reader).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from types import ModuleType
from typing import Any
from unittest import mock

import timm
from torch import nn

from vit.layers import ACTIVATIONS, BlockConfig
from vit.registry import TimmArgs, register_model, register_timm_names
from vit.vision_transformer import (
    HYBRID_BACKBONES,
    VIT_MODELS,
    VIT_SIZES,
    VisionTransformer,
    ViTConfig,
    build_backbone,
)

# Activation classes in timm's backbone arguments, by the name timm's constructors also take.
_ACT_NAMES = {nn.GELU: "gelu", nn.ReLU: "relu", nn.SiLU: "silu"}


class _Recorded(Exception):
    pass


@dataclass(frozen=True)
class _RecordedBackbone:
    """What a hybrid model function asked a backbone constructor for, in place of the backbone."""

    spec: dict[str, Any]


def _backbone_recorder(name: str, build: Callable) -> Callable[..., _RecordedBackbone]:
    signature = inspect.signature(build)

    def record(*args: object, **kwargs: object) -> _RecordedBackbone:
        spec: dict[str, Any] = {"name": name}
        for key, value in signature.bind(*args, **kwargs).arguments.items():
            spec.update(value if signature.parameters[key].kind is inspect.Parameter.VAR_KEYWORD else {key: value})
        for key in ("pretrained", "in_chans", "device", "dtype"):  # no weights; in_chans is the config's
            spec.pop(key, None)
        for key, value in spec.items():
            if isinstance(value, type):
                if value not in _ACT_NAMES:
                    raise ValueError(f"timm's {name} backbone takes {key}={value.__name__}, which has no name here")
                spec[key] = _ACT_NAMES[value]
        return _RecordedBackbone(spec)

    return record


def timm_model_args(name: str, **kwargs: object) -> dict:
    """The kwargs timm's `create_model(name, **kwargs)` builds its VisionTransformer with: those its model
    function passes (read by calling it with the builders, of the ViT, of DeiT and of the hybrids, and the
    hybrids' backbone constructors swapped for recorders, so nothing is built) and the defaults its
    builder takes from the name's pretrained config (image size, classes). A DeiT built as
    VisionTransformerDistilled records distilled=True; a hybrid records timm's `embed_layer`, a
    HybridEmbed of a recorded backbone."""
    import timm.models.deit as timm_deit
    import timm.models.vision_transformer as timm_vit
    import timm.models.vision_transformer_hybrid as timm_hybrid

    recorded: dict = {}

    def record(variant: str, pretrained: bool = False, distilled: bool = False, **kwargs: object) -> None:
        recorded.update(kwargs, **({"distilled": True} if distilled else {}))
        raise _Recorded

    def record_hybrid(cls: type, variant: str, pretrained: bool, pretrained_filter_fn=None, feature_cfg=None, **kwargs):
        if cls is not timm_vit.VisionTransformer:
            raise ValueError(f"timm's {name} is a {cls.__name__}, not timm's VisionTransformer")
        recorded.update(kwargs)  # with timm's hybrid defaults: patch_size 1, embed_layer HybridEmbed
        raise _Recorded

    with contextlib.ExitStack() as patches:
        patches.enter_context(mock.patch.object(timm_vit, "_create_vision_transformer", record))
        patches.enter_context(mock.patch.object(timm_deit, "_create_deit", record))
        patches.enter_context(mock.patch.object(timm_hybrid, "build_model_with_cfg", record_hybrid))
        for ours, attr in HYBRID_BACKBONES.items():
            recorder = _backbone_recorder(ours, getattr(timm_hybrid, attr))
            patches.enter_context(mock.patch.object(timm_hybrid, attr, recorder))
        try:
            timm.models.model_entrypoint(name)(**kwargs)
        except _Recorded:
            pass
        else:
            raise ValueError(
                f"timm's {name} does not build a VisionTransformer through timm's ViT, DeiT or hybrid builder"
            )
    return timm_pretrained_defaults(name) | recorded


def record_timm_builder(name: str, module: object, builder: str, **kwargs: object) -> dict:
    """The kwargs timm's `create_model(name, **kwargs)` passes to `module.builder`, the private function
    that builds the model (called with it swapped for a recorder, so nothing is built), with the defaults
    it takes from the name's pretrained config (image size, classes)."""
    recorded: dict = {}

    def record(variant: str, pretrained: bool = False, **passed: object) -> None:
        recorded.update(passed)
        raise _Recorded

    with mock.patch.object(module, builder, record):
        try:
            timm.models.model_entrypoint(name)(**kwargs)
        except _Recorded:
            pass
        else:
            raise ValueError(f"timm's {name} does not build its model through timm's {builder}")
    return timm_pretrained_defaults(name) | recorded


def timm_family(
    family: str, module: ModuleType, builder: str, build: Callable[[Any], nn.Module], config_cls: type, timm_cls: type
) -> Callable[[Callable[[dict], dict]], Callable[[dict], dict]]:
    """A decorator that registers the names of timm's model `module` (vit.registry.register_timm_names):
    the decorated function turns the kwargs timm's `builder` gets for a name (`record_timm_builder`) into
    `config_cls` fields, or refuses them with a ValueError; `timm_cls` is the timm class they build."""

    def register(from_timm_args: Callable[[dict], dict]) -> Callable[[dict], dict]:
        def fields_of(name: str, **kwargs: object) -> dict:
            return from_timm_args(record_timm_builder(name, module, builder, **kwargs))

        register_timm_names(
            family, [("*", module.__name__.rpartition(".")[2])], build, config_cls, fields_of, timm_arg_names(timm_cls)
        )
        return from_timm_args

    return register


def no_equivalent(timm_cls: str, key: str, value: object) -> ValueError:
    """The error for a kwarg of timm's `timm_cls` that means nothing here."""
    return ValueError(f"timm's {timm_cls} {key}={getattr(value, '__name__', value)!r} has no equivalent here")


def timm_arg_names(cls: type) -> frozenset[str]:
    """The arguments timm's model class takes by name (not where to build it: device, dtype)."""
    parameters = inspect.signature(cls).parameters.values()
    return frozenset(p.name for p in parameters if p.kind is not p.VAR_KEYWORD and p.name not in ("device", "dtype"))


def timm_pretrained_defaults(name: str) -> dict:
    """What timm's builder adds to a model function's kwargs from the name's default pretrained
    config (DINOv2: 518 px, no head)."""
    cfg = timm.models.get_pretrained_cfg(name)
    if cfg is None:
        return {}
    defaults = {"in_chans": cfg.input_size[0]}
    if cfg.num_classes is not None and cfg.num_classes >= 0:
        defaults["num_classes"] = cfg.num_classes
    if cfg.fixed_input_size:
        defaults["img_size"] = tuple(cfg.input_size[-2:])
    return defaults


def timm_norm(value: object) -> tuple[str, float] | None:
    """timm's norm_layer (a class, a partial with eps, or timm's name) as (our norm kind, eps); None if
    it has no equal here."""
    from timm.layers import LayerNorm, RmsNorm

    if value in ("layernorm", "rmsnorm"):  # timm's get_norm_layer: its LayerNorm / RmsNorm, eps 1e-6
        return value, 1e-6
    func, keywords = getattr(value, "func", value), getattr(value, "keywords", {})
    if func not in (LayerNorm, RmsNorm, nn.LayerNorm, nn.RMSNorm) or set(keywords) - {"eps"}:
        return None
    kind = "layernorm" if func in (LayerNorm, nn.LayerNorm) else "rmsnorm"
    return kind, keywords.get("eps", 1e-5 if func is nn.LayerNorm else 1e-6)


# timm's VisionTransformer kwargs that are ViTConfig fields under another name.
_TIMM_RENAMED = {"scale_attn_norm": "scale_attn_inner", "scale_mlp_norm": "scale_mlp"}
# ViTConfig fields whose timm kwarg of the same name means something else (a class, not our name).
_NOT_TIMMS = ("norm", "mlp", "posemb", "act_layer", "embed_norm", "block_fn", "attn_layer", *_TIMM_RENAMED.values())


def _timm_blocks() -> dict[type, dict[str, Any]]:
    """timm's ViT block classes as our block options."""
    import timm.models.vision_transformer as timm_vit

    return {
        timm_vit.Block: {},
        timm_vit.ResPostBlock: {"post_norm": True},
        timm_vit.ParallelScalingBlock: {"block_fn": "parallel_scaling"},
        timm_vit.DiffParallelScalingBlock: dict(block_fn="parallel_scaling", attn_layer="diff", fuse_out_proj=True),
        timm_vit.ParallelThingsBlock: {"block_fn": "parallel_things"},
    }


def _timm_block_options(config: BlockConfig) -> dict[str, Any]:
    """The block options of a config that pick timm's block class (`_timm_blocks`)."""
    names = ("post_norm", "block_fn", "attn_layer", "fuse_out_proj", "num_parallel")
    return {name: getattr(config, name) for name in names}


def _timm_attentions() -> tuple[type, type]:
    """timm's ViT attention classes: plain, differential."""
    from timm.layers import Attention, DiffAttention

    return Attention, DiffAttention


def from_timm_args(args: dict) -> dict:
    """timm's VisionTransformer kwargs as ViTConfig fields; anything without an equal is a ValueError."""
    from timm.layers import GluMlp, SwiGLU
    from timm.layers import HybridEmbed as TimmHybridEmbed

    fields = {f.name for f in dataclasses.fields(ViTConfig)}
    out, embed_norm = {}, None
    for key, value in args.items():
        func, keywords = getattr(value, "func", value), getattr(value, "keywords", {})
        if key == "embed_layer" and func is TimmHybridEmbed:
            out.update(_from_timm_hybrid_embed(keywords))
            continue
        if key == "norm_layer" and (value is None or timm_norm(value)):
            out["norm"], out["norm_eps"] = timm_norm(value) if value else ("layernorm", 1e-6)  # timm's default
        elif key == "embed_norm_layer" and (value is None or timm_norm(value)):
            embed_norm = value and timm_norm(value)
        elif key == "act_layer" and (value in ACTIVATIONS or func in (nn.SiLU, nn.GELU)):
            out["act_layer"] = value if isinstance(value, str) else {nn.SiLU: "silu", nn.GELU: "gelu"}[func]
        elif key == "mlp_layer" and func is GluMlp and not keywords.get("gate_last", True):
            out["mlp"] = "glu"
        elif key == "mlp_layer" and func is SwiGLU and not set(keywords) - {"align_to"}:
            out.update(mlp="swiglu_split", swiglu_align_to=keywords.get("align_to", 0))
        elif key == "pos_embed" and value in ("learn", "none", ""):
            out["posemb"] = value or "none"
        elif key == "block_fn" and func in _timm_blocks() and set(keywords) <= {"num_parallel", "fuse_out_proj"}:
            out.update(_timm_blocks()[func], **keywords)
        elif key == "attn_layer" and (value in ("", "attn", "diff") or func in _timm_attentions()):
            out["attn_layer"] = "diff" if value == "diff" or func is _timm_attentions()[-1] else "attn"
        elif key in _TIMM_RENAMED:
            out[_TIMM_RENAMED[key]] = value
        elif key in fields and key not in _NOT_TIMMS:
            out[key] = value
        else:
            raise ValueError(f"timm's {key}={getattr(func, '__name__', value)!r} has no equivalent here")
    if embed_norm:  # ours is the blocks' norm: timm's must be the same kind and eps
        if embed_norm != (out.get("norm", "layernorm"), out.get("norm_eps", 1e-6)):
            raise ValueError(f"timm's embed_norm_layer {embed_norm} differs from its norm_layer; no equivalent here")
        out["embed_norm"] = True
    return out


def _from_timm_hybrid_embed(keywords: dict[str, Any]) -> dict[str, Any]:
    """timm's HybridEmbed arguments (a recorded backbone, `proj`) as ViTConfig fields."""
    backbone = keywords.get("backbone")
    if not isinstance(backbone, _RecordedBackbone):
        raise ValueError(
            f"timm's HybridEmbed backbone {type(backbone).__name__} is built by none of timm's constructors "
            f"rebuilt here ({', '.join(HYBRID_BACKBONES.values())} of timm.models.vision_transformer_hybrid)"
        )
    unknown = sorted(set(keywords) - {"backbone", "proj"})
    if unknown:
        raise ValueError(f"timm's HybridEmbed arguments {unknown} have no equivalent here")
    return {"backbone": backbone.spec, **({"backbone_proj": False} if keywords.get("proj") is False else {})}


def _vit_table_fields(defaults: dict[str, Any], **kwargs: object) -> dict[str, Any]:
    """A VIT_MODELS name's fields, `defaults`, with timm's VisionTransformer kwargs applied one by one."""
    return {**defaults, **from_timm_args(kwargs)}


_VIT_ARGS = timm_arg_names(timm.models.vision_transformer.VisionTransformer)

# Our size table's names read no timm builder; those timm has too take the defaults timm's builder takes
# from the name's pretrained config, as every name read from timm does (ViT-H/14: no head, its in21k weights').
for _name, (_size, _patch, _img) in VIT_MODELS.items():
    _defaults = {**timm_pretrained_defaults(_name), **VIT_SIZES[_size], "patch_size": _patch, "img_size": _img}
    _timm = TimmArgs(_VIT_ARGS, partial(_vit_table_fields, _defaults))
    register_model(_name, VisionTransformer, ViTConfig, _timm, **_defaults)

# timm's ViT names we build identically; the rest are named unsupported, with the reason.
register_timm_names(
    "ViT", [("*", "vision_transformer"), ("deit*", "deit"), ("vit_*", "vision_transformer_hybrid")],
    VisionTransformer, ViTConfig, lambda name, **kw: from_timm_args(timm_model_args(name, **kw)), _VIT_ARGS,
    skip=VIT_MODELS,
)  # fmt: skip


# -- our config as timm's VisionTransformer kwargs -------------------------------------------------

# Our options that timm's VisionTransformer builds the same way, under the same names.
_TIMM_FIELDS = (
    "img_size", "patch_size", "in_chans", "num_classes", "global_pool", "class_token", "embed_dim", "depth",
    "num_heads", "mlp_ratio", "qkv_bias", "qk_norm", "init_values", "fc_norm", "drop_rate", "pos_drop_rate",
    "proj_drop_rate", "attn_drop_rate", "drop_path_rate", "dynamic_img_size", "patch_drop_rate", "reg_tokens",
    "no_embed_class", "pre_norm", "final_norm", "dynamic_img_pad", "proj_bias", "pool_include_prefix", "fix_init",
)  # fmt: skip


def timm_kwargs(config: ViTConfig) -> dict:
    """The kwargs of timm's `VisionTransformer` that builds this config with the same parameter names,
    shapes and function; options timm has no equal for (set away from their defaults) are an error."""
    from timm.layers import GluMlp, LayerNorm, RmsNorm, SwiGLU

    default = ViTConfig()
    eva_options = ("qkv_fused", "k_bias", "layer_scale")  # timm's Eva has them
    others = ("rel_pos_type", "window_size", "global_attn_indexes")  # timm's relpos and SAM ViTs have them
    unmatched = {
        name: getattr(config, name)
        for name in ("num_experts", "stem_channels", "stem_pool", "shifted_patches", *eva_options, *others)
        if getattr(config, name) != getattr(default, name)
    }
    if config.attn_layer == "lsa":
        unmatched["attn_layer"] = config.attn_layer
    if config.posemb not in ("learn", "none"):
        unmatched["posemb"] = config.posemb
    if config.mlp not in ("gelu", "glu", "swiglu_split"):  # timm's ViT has no SwiGLU of ours nor a packed one
        unmatched["mlp"] = config.mlp
    block = {k: v for k, v in _timm_block_options(config).items() if v != getattr(default, k)}
    diff_attn = "block_fn" not in block and block.pop("attn_layer", "attn") == "diff"  # timm's attn_layer="diff"
    blocks = [type_ for type_, options in _timm_blocks().items() if options == block]
    if len(blocks) != 1:  # num_parallel or fuse_out_proj where timm's class has them fixed
        unmatched.update(block)
    if unmatched:
        raise ValueError(f"timm's VisionTransformer has no equivalent of {unmatched}")
    kwargs = {name: getattr(config, name) for name in _TIMM_FIELDS}
    norm = partial(LayerNorm if config.norm == "layernorm" else RmsNorm, eps=config.norm_eps)
    kwargs.update(
        pos_embed=config.posemb, norm_layer=norm, block_fn=blocks[0], attn_layer="diff" if diff_attn else "",
        act_layer=config.act_layer or ("silu" if config.mlp == "swiglu_split" else "gelu"),
        scale_attn_norm=config.scale_attn_inner, scale_mlp_norm=config.scale_mlp,
    )  # fmt: skip
    if config.embed_norm:
        kwargs["embed_norm_layer"] = norm
    if config.mlp == "glu":
        kwargs["mlp_layer"] = partial(GluMlp, gate_last=False)
    if config.mlp == "swiglu_split":
        kwargs["mlp_layer"] = partial(SwiGLU, align_to=config.swiglu_align_to)
    if config.backbone is not None:  # a fresh backbone: timm's model gets its own modules
        from timm.layers import HybridEmbed as TimmHybridEmbed

        backbone = build_backbone(config.backbone, config.in_chans)
        kwargs["embed_layer"] = partial(TimmHybridEmbed, backbone=backbone, proj=config.backbone_proj)
    return kwargs
