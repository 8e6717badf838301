"""The modern Transformer options of the shared Block: RMSNorm, SwiGLU, sinusoidal and rotary
positions, mixture of experts, cross-attention and qk-norm; each checked against a hand
computation or a property it must have, and the defaults left as they were."""

from __future__ import annotations

import math

import lightning as L
import pytest
import timm
import torch
import torch.nn.functional as F
from torch import nn

from tests.conftest import quiet_trainer
from vit import create_model
from vit.data import DigitsDataModule
from vit.layers import (
    Attention,
    Block,
    BlockConfig,
    CrossAttention,
    KVCache,
    Mlp,
    MoE,
    SwiGLU,
    make_mlp,
    make_norm,
    mimetic_init_,
    moe_aux_loss,
)
from vit.lit import ImageClassifier
from vit.position import apply_rope, rope_1d, rope_2d, sincos_1d, sincos_2d


def _params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


# -- normalisation and MLP ---------------------------------------------------------------------


def test_rmsnorm_is_x_over_its_root_mean_square_times_a_gain():
    norm = make_norm("rmsnorm", 16)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 2.0, 16))
    x = torch.randn(3, 5, 16) * 3 + 1
    expected = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight
    torch.testing.assert_close(norm(x), expected)
    assert _params(norm) == 16  # a gain, no bias
    with pytest.raises(ValueError, match="'layernorm' or 'rmsnorm'"):
        make_norm("batchnorm", 16)


@pytest.mark.parametrize(("width", "hidden"), [(128, 344), (192, 512), (384, 1024)])
def test_swiglu_hidden_is_8_3_of_the_width_and_keeps_the_parameter_count(width, hidden):
    gelu, swiglu = make_mlp("gelu", width, 4 * width), make_mlp("swiglu", width, 4 * width)
    assert isinstance(gelu, Mlp) and isinstance(swiglu, SwiGLU)
    assert swiglu.fc2.in_features == hidden and hidden % 8 == 0 and abs(hidden - 8 / 3 * width) <= 4
    assert abs(_params(swiglu) / _params(gelu) - 1) < 0.01


def test_swiglu_is_fc2_of_silu_gate_times_value():
    mlp = SwiGLU(8, 16).eval()
    x = torch.randn(2, 3, 8)
    h = x @ mlp.fc1.weight.T + mlp.fc1.bias
    value, gate = h[..., :16], h[..., 16:]
    expected = (gate / (1 + torch.exp(-gate)) * value) @ mlp.fc2.weight.T + mlp.fc2.bias
    torch.testing.assert_close(mlp(x), expected)


# -- sinusoidal tables -------------------------------------------------------------------------


def test_sincos_1d_is_vaswanis_closed_form():
    table = sincos_1d(50, 16)
    for pos in (0, 1, 7, 49):
        for i in range(8):
            angle = pos / 10000 ** (2 * i / 16)
            assert table[pos, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-5)
            assert table[pos, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-5)


def test_sincos_2d_is_big_visions_closed_form():
    h, w, dim = 3, 5, 16
    table = sincos_2d(h, w, dim)
    assert table.shape == (h * w, dim)
    q = dim // 4
    for row in range(h):
        for col in range(w):
            token = row * w + col  # row-major, like the patch tokens
            for i in range(q):
                omega = 1 / 10000 ** (i / (q - 1))
                expected = [
                    math.sin(col * omega),
                    math.cos(col * omega),
                    math.sin(row * omega),
                    math.cos(row * omega),
                ]
                got = [table[token, j * q + i].item() for j in range(4)]
                assert got == pytest.approx(expected, abs=1e-5)


def test_vit_sincos2d_is_a_fixed_buffer_with_no_position_for_cls():
    model = create_model("vit_nano_patch4_16", num_classes=3, posemb="sincos2d")
    assert "pos_embed" not in dict(model.named_parameters()) and "pos_embed" not in model.state_dict()
    torch.testing.assert_close(model.pos_embed[0, 0], torch.zeros(128))
    torch.testing.assert_close(model.pos_embed[0, 1:], sincos_2d(4, 4, 128))
    dynamic = create_model("vit_nano_patch4_16", num_classes=3, posemb="sincos2d", dynamic_img_size=True)
    assert dynamic(torch.randn(1, 3, 32, 32)).shape == (1, 3)  # the table is recomputed for 8x8


# -- rotary embeddings -------------------------------------------------------------------------


def _scores(q: torch.Tensor, k: torch.Tensor, table: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return apply_rope(q, *table) @ apply_rope(k, *table).transpose(-2, -1)


def test_rope_1d_scores_depend_only_on_relative_offsets():
    q, k = torch.randn(2, 10, 32, dtype=torch.float64), torch.randn(2, 10, 32, dtype=torch.float64)
    pos = torch.arange(10)
    base = _scores(q, k, rope_1d(pos, 32))
    for shift in (1, 17, 1000):
        torch.testing.assert_close(_scores(q, k, rope_1d(pos + shift, 32)), base, atol=1e-4, rtol=1e-4)
    # and they do depend on the offsets: spreading the positions apart changes them
    assert not torch.allclose(_scores(q, k, rope_1d(pos * 2, 32)), base, atol=1e-3)
    # a rotation: lengths are kept
    torch.testing.assert_close(apply_rope(q, *rope_1d(pos, 32)).norm(dim=-1), q.norm(dim=-1))


def test_rope_2d_scores_depend_only_on_the_row_and_column_offsets():
    q, k = torch.randn(3, 12, 16), torch.randn(3, 12, 16)  # a 3x4 grid
    base = _scores(q, k, rope_2d((3, 4), 16))
    torch.testing.assert_close(_scores(q, k, rope_2d((3, 4), 16, offset=(5, 11))), base, atol=1e-4, rtol=1e-4)
    # rows and columns are told apart: a shift along one axis only is still a pure shift...
    torch.testing.assert_close(_scores(q, k, rope_2d((3, 4), 16, offset=(0, 3))), base, atol=1e-4, rtol=1e-4)
    # ...but the same tokens laid out on a 4x3 grid have other offsets and other scores
    assert not torch.allclose(_scores(q, k, rope_2d((4, 3), 16)), base, atol=1e-3)


def test_rope_leaves_prefix_tokens_unrotated():
    x = torch.randn(2, 4, 1 + 6, 8)  # CLS + a 2x3 grid
    cos, sin = rope_2d((2, 3), 8)
    out = apply_rope(x, cos, sin)
    assert torch.equal(out[:, :, 0], x[:, :, 0])
    torch.testing.assert_close(out[:, :, 1:], apply_rope(x[:, :, 1:], cos, sin))


def test_attention_with_rope_is_invariant_to_shifting_every_position():
    attn = Attention(32, num_heads=4, causal=True).eval()
    x = torch.randn(2, 9, 32)
    pos = torch.arange(9)
    out = attn(x, rope=rope_1d(pos, 8))
    torch.testing.assert_close(attn(x, rope=rope_1d(pos + 50, 8)), out, atol=1e-5, rtol=1e-4)
    assert not torch.allclose(attn(x), out, atol=1e-4)  # it did rotate


def test_gpt_with_rope_runs_past_its_training_context_and_caches_at_the_right_positions():
    model = create_model("gpt_char_cpu", vocab_size=20, block_size=16, posemb="rope").eval()
    assert model.pos_embed is None
    idx = torch.randint(0, 20, (2, 40))
    with torch.no_grad():
        full = model(idx)  # 40 > block_size 16: no error with rotary positions
        assert full.shape == (2, 40, 20)
        caches = [KVCache() for _ in model.blocks]
        steps = [model(idx[:, :25], caches)] + [model(idx[:, t : t + 1], caches) for t in range(25, 40)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="exceeds block_size"):
        create_model("gpt_char_cpu", vocab_size=20, block_size=16)(idx)  # learned positions stop there


# -- the models with every option --------------------------------------------------------------

VIT_OPTIONS = [
    {"posemb": "rope"},
    {"posemb": "rope", "global_pool": "avg", "class_token": False},
    {"posemb": "sincos2d"},
    {"norm": "rmsnorm", "mlp": "swiglu", "qk_norm": True},
    {"num_experts": 4, "experts_top_k": 2},
]


@pytest.mark.parametrize("kwargs", VIT_OPTIONS)
def test_vit_options_keep_the_cls_shortcut_and_attention_maps_exact(kwargs):
    model = create_model("vit_nano_patch4_16", num_classes=5, **kwargs).eval()
    x = torch.randn(3, 3, 16, 16)
    with torch.no_grad():
        logits = model(x)
        assert logits.shape == (3, 5)
        torch.testing.assert_close(logits, model.forward_head(model.forward_features(x)), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(model.forward_with_attn(x)[0], logits, atol=1e-5, rtol=1e-5)


def test_parameter_counts_of_the_options():
    def count(name: str, **kwargs) -> int:
        return _params(create_model(name, **kwargs))

    base = count("gpt_char_cpu")
    assert base == 809_856
    assert count("gpt_char_cpu", posemb="rope") == count("gpt_char_cpu", posemb="sincos") == base - 64 * 128
    assert count("gpt_char_cpu", norm="rmsnorm") == base - 9 * 128  # no biases in 2 norms x 4 blocks + final
    assert count("gpt_char_cpu", qk_norm=True) == base + 4 * 2 * (32 + 32)  # q_norm, k_norm per block
    modern = count("gpt_char_cpu", norm="rmsnorm", mlp="swiglu", posemb="rope")
    assert abs(modern / base - 1) < 0.01
    # MoE: E copies of the MLP plus a router per block
    mlp = 128 * 512 + 512 + 512 * 128 + 128
    assert count("gpt_char_cpu", num_experts=4) == base + 4 * (3 * mlp + 4 * 128)
    vit_base = count("vit_micro_patch4_32", num_classes=10)
    assert count("vit_micro_patch4_32", num_classes=10, posemb="rope") == vit_base - 65 * 192
    assert abs(count("vit_micro_patch4_32", num_classes=10, mlp="swiglu") / vit_base - 1) < 0.001


def test_qk_norm_vit_loads_timms_qk_norm_weights_and_matches_its_logits():
    theirs = timm.create_model("vit_tiny_patch16_224", qk_norm=True, img_size=64, num_classes=7).eval()
    with torch.no_grad():
        for p in theirs.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    ours = create_model("vit_tiny_patch16_224", qk_norm=True, img_size=64, num_classes=7).eval()
    ours.load_state_dict(theirs.state_dict(), strict=True)
    assert "blocks.0.attn.q_norm.weight" in ours.state_dict()
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), atol=1e-5, rtol=1e-5)


def test_qk_norm_normalises_each_heads_queries_and_keys():
    attn = Attention(32, num_heads=4, qk_norm=True, norm="rmsnorm").eval()
    assert isinstance(attn.q_norm, nn.RMSNorm) and attn.q_norm.weight.shape == (8,)
    x = torch.randn(2, 6, 32) * 50  # large activations: the logits stay bounded
    _, weights = attn(x, return_attn=True)
    q, k, _ = attn.qkv(x).reshape(2, 6, 3, 4, 8).unbind(2)
    q, k = (F.rms_norm(t, (8,), eps=1e-6).transpose(1, 2) for t in (q, k))
    torch.testing.assert_close(weights, (q @ k.transpose(-2, -1) / 8**0.5).softmax(-1), atol=1e-6, rtol=1e-5)


def test_defaults_are_todays_block():
    block = Block(BlockConfig(embed_dim=64, num_heads=4))
    assert isinstance(block.mlp, Mlp) and isinstance(block.mlp.act, nn.GELU)
    assert isinstance(block.norm1, nn.LayerNorm) and not block.attn.causal
    assert isinstance(block.attn.q_norm, nn.Identity) and not hasattr(block.attn, "kv")
    names = {n for n, _ in block.named_parameters()}
    assert names == {
        f"{m}.{p}"
        for m in ("norm1", "attn.qkv", "attn.proj", "norm2", "mlp.fc1", "mlp.fc2")
        for p in ("weight", "bias")
    }
    assert make_mlp("gelu", 64, 256, num_experts=1).__class__ is Mlp  # E = 1 is the dense path


def test_unknown_options_are_clear_errors():
    with pytest.raises(ValueError, match="posemb must be 'learn', 'sincos2d', 'rope' or 'none'"):
        create_model("vit_nano_patch4_16", posemb="sincos")
    with pytest.raises(ValueError, match="posemb must be 'learn', 'sincos' or 'rope'"):
        create_model("gpt_char_cpu", posemb="sincos2d")
    with pytest.raises(ValueError, match="unknown mlp 'relu'"):
        create_model("gpt_char_cpu", mlp="relu")
    with pytest.raises(ValueError, match="top_k must be between 1 and num_experts=2"):
        create_model("gpt_char_cpu", num_experts=2, experts_top_k=3)
    with pytest.raises(ValueError, match="weight_init must be '' \\(timm's default\\) or 'mimetic', got 'jax'"):
        create_model("vit_nano_patch4_16", weight_init="jax")


# -- mimetic initialisation ---------------------------------------------------------------------


def _first_block_attention(weight_init: str) -> torch.Tensor:
    """The first block's attention at step 0, averaged over heads and 8 noise images: (64, 64)."""
    torch.manual_seed(0)
    model = create_model(
        "vit_micro_patch4_32", num_classes=10, posemb="sincos2d", global_pool="avg", class_token=False,
        embed_dim=128, num_heads=4, weight_init=weight_init,
    ).eval()  # fmt: skip
    with torch.no_grad():
        _, attns = model.forward_with_attn(torch.randn(8, 3, 32, 32))
    return attns[0].mean((0, 1))


def test_mimetic_init_starts_attention_local_where_timms_init_starts_it_uniform():
    rows, cols = torch.arange(64) // 8, torch.arange(64) % 8
    distance = (rows[:, None] - rows).abs() + (cols[:, None] - cols).abs()  # on the 8 x 8 patch grid
    uniform = 1 / 64
    default = _first_block_attention("")
    torch.testing.assert_close(default, torch.full_like(default, uniform), atol=0.05 * uniform, rtol=0)
    mimetic = _first_block_attention("mimetic")
    itself, neighbours, far = mimetic.diag().mean(), mimetic[distance == 1].mean(), mimetic[distance >= 4].mean()
    assert itself > 0.3  # measured 0.46: each token attends mostly to itself ...
    assert neighbours > 1.5 * far  # ... then to its neighbours (0.0150 against 0.0070): a conv-like start


def test_mimetic_init_makes_each_heads_qk_a_positive_rank_head_dim_form_and_value_output_minus_identity():
    torch.manual_seed(0)
    dim, heads, head_dim = 128, 4, 32
    attn = Attention(dim, heads)
    mimetic_init_(attn)
    w = attn.qkv.weight  # rows: q, k, v; each head's rows in turn
    vo = w[2 * dim :].T @ attn.proj.weight.T  # x -> x @ vo when every token attends to itself
    off_diagonal = vo[~torch.eye(dim, dtype=torch.bool)]
    assert vo.diag().mean().item() == pytest.approx(-0.4, abs=0.01)  # a Z - b I with b = 0.4 ...
    assert off_diagonal.std().item() == pytest.approx(0.4 / dim**0.5, rel=0.05)  # ... and Z's entries N(0, 1/dim)
    forms = []
    for h in range(heads):
        q, k = w[h * head_dim : (h + 1) * head_dim], w[dim + h * head_dim : dim + (h + 1) * head_dim]
        form = q.T @ k  # score(x, x') = x @ form @ x'
        assert torch.linalg.matrix_rank(form).item() == head_dim
        assert form.trace().item() > 0.7 * head_dim  # the identity part survives the rank cut
        forms.append(form)
    assert not torch.allclose(forms[0], forms[1])  # every head draws its own Z
    assert not attn.qkv.bias.any() and not attn.proj.bias.any()


def test_mimetic_init_changes_only_the_attention_weights_values_not_names_or_shapes():
    """From the same seed, the two inits give the same tensors but for each block's qkv and proj
    (weights, and biases set to zero); names and shapes stay timm's, so checkpoints load either way."""
    models = {}
    for init in ("", "mimetic"):
        torch.manual_seed(0)
        models[init] = create_model("vit_nano_patch4_16", weight_init=init).state_dict()
    default, mimetic = models[""], models["mimetic"]
    assert {k: v.shape for k, v in default.items()} == {k: v.shape for k, v in mimetic.items()}
    changed = {name for name in default if not torch.equal(default[name], mimetic[name])}
    depth = len({name.split(".")[1] for name in default if name.startswith("blocks.")})
    assert changed == {f"blocks.{i}.attn.{layer}.weight" for i in range(depth) for layer in ("qkv", "proj")}


# -- mixture of experts ------------------------------------------------------------------------


def test_moe_sends_each_token_to_k_experts_and_sums_their_weighted_outputs():
    moe = MoE(16, 32, num_experts=4, top_k=2).eval()
    x = torch.randn(3, 5, 16)
    seen = {i: [] for i in range(4)}
    for i, expert in enumerate(moe.experts):
        expert.register_forward_hook(lambda m, inp, out, i=i: seen[i].append(inp[0]))
    out = moe(x)

    tokens = x.reshape(15, 16)
    experts, weights, probs = moe.route(tokens)
    assert experts.shape == (15, 2) and (experts[:, 0] != experts[:, 1]).all()  # two distinct experts
    torch.testing.assert_close(weights.sum(-1), torch.ones(15))
    torch.testing.assert_close(weights, probs.gather(1, experts) / probs.gather(1, experts).sum(-1, keepdim=True))
    assert sum(len(rows[0]) for rows in seen.values() if rows) == 15 * 2  # every token exactly twice
    expected = torch.stack(
        [sum(weights[t, j] * moe.experts[int(experts[t, j])](tokens[t]) for j in range(2)) for t in range(15)]
    )
    torch.testing.assert_close(out, expected.reshape(3, 5, 16), atol=1e-6, rtol=1e-5)


def test_moe_top1_keeps_the_raw_router_probability_so_the_router_learns():
    moe = MoE(8, 16, num_experts=3, top_k=1)
    _, weights, probs = moe.route(torch.randn(10, 8))
    torch.testing.assert_close(weights[:, 0], probs.max(-1).values)
    moe(torch.randn(10, 8)).sum().backward()
    assert moe.router.weight.grad.abs().sum() > 0


def _router_with_assignment(moe: MoE, fractions: list[float], n: int = 400) -> torch.Tensor:
    """Tokens that the router sends, confidently, to expert i for a fraction fractions[i] of them."""
    dim = moe.router.in_features
    with torch.no_grad():
        moe.router.weight.copy_(torch.eye(moe.num_experts, dim) * 50)
    counts = [round(f * n) for f in fractions]
    return torch.cat([F.one_hot(torch.full((c,), i), dim).float() for i, c in enumerate(counts)])


def test_moe_aux_loss_is_one_for_uniform_routing_and_grows_to_e_as_it_collapses():
    moe = MoE(8, 16, num_experts=4, top_k=1)
    with torch.no_grad():
        moe.router.weight.zero_()  # every probability 1/E
    moe(torch.randn(50, 8))
    assert moe.aux_loss.item() == pytest.approx(1.0)

    losses = []
    for f in [[0.25] * 4, [0.4, 0.2, 0.2, 0.2], [0.7, 0.1, 0.1, 0.1], [1.0, 0, 0, 0]]:
        moe(_router_with_assignment(moe, f))
        losses.append(moe.aux_loss.item())
        assert losses[-1] == pytest.approx(4 * sum(p * p for p in f), rel=1e-3)  # E * sum f_i^2 when P = f
    assert losses[0] == pytest.approx(1.0, rel=1e-3) and losses[-1] == pytest.approx(4.0, rel=1e-3)
    assert losses == sorted(losses)  # balanced is the minimum


def test_moe_capacity_drops_the_overflow_and_dropless_drops_nothing():
    moe = MoE(8, 16, num_experts=4, top_k=1, capacity_factor=1.0)
    x = _router_with_assignment(moe, [0.7, 0.1, 0.1, 0.1], n=40)
    assert moe.capacity(40) == 10
    out = moe(x)
    assert moe.dropped_fraction == pytest.approx(18 / 40)  # expert 0 takes 10 of its 28 tokens
    assert (out[10:28] == 0).all() and (out[:10] != 0).any()  # first come, first served
    moe.capacity_factor = None
    dropless = moe(x)
    assert moe.dropped_fraction == 0 and (dropless[10:28] != 0).any()
    torch.testing.assert_close(dropless[:10], out[:10])


def test_models_expose_the_summed_aux_loss_and_it_trains_the_routers():
    plain = create_model("gpt_char_cpu", vocab_size=20, block_size=16)
    plain(torch.randint(0, 20, (2, 16)))
    assert plain.aux_loss().item() == 0.0
    model = create_model("gpt_char_cpu", vocab_size=20, block_size=16, num_experts=4, experts_top_k=1)
    model(torch.randint(0, 20, (2, 16)))
    aux = model.aux_loss()
    assert aux.item() == pytest.approx(sum(b.mlp.aux_loss.item() for b in model.blocks)) and aux.item() > 3.5
    aux.backward()
    assert all(b.mlp.router.weight.grad.abs().sum() > 0 for b in model.blocks)
    vit_model = create_model("vit_nano_patch4_16", num_experts=2)
    vit_model(torch.randn(2, 3, 16, 16))
    torch.testing.assert_close(vit_model.aux_loss(), moe_aux_loss(vit_model))


class _AuxOnly(ImageClassifier):
    """The task loss zeroed, so the logged training loss is the weighted aux loss alone."""

    def loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return logits.sum() * 0


def test_image_classifier_adds_and_logs_the_aux_loss(tmp_path):
    L.seed_everything(0)
    module = _AuxOnly("vit_nano_patch4_16", {"num_experts": 2, "experts_top_k": 1}, num_classes=10, aux_loss_weight=0.5)
    trainer = quiet_trainer(tmp_path, max_epochs=1, limit_train_batches=2, limit_val_batches=1)
    trainer.fit(module, DigitsDataModule(batch_size=16, num_workers=0))
    aux, loss = trainer.callback_metrics["train/aux_loss"], trainer.callback_metrics["train/loss"]
    assert aux.item() > 3.5  # one MoE per block, each >= ~1
    torch.testing.assert_close(loss, 0.5 * aux)


# -- cross-attention and the attention-pool head ------------------------------------------------


def test_cross_attention_takes_keys_and_values_from_the_context():
    attn = CrossAttention(16, num_heads=2, context_dim=12).eval()
    x, context = torch.randn(2, 5, 16), torch.randn(2, 7, 12)
    q = (x @ attn.q.weight.T + attn.q.bias).reshape(2, 5, 2, 8).transpose(1, 2)
    k, v = (context @ attn.kv.weight.T + attn.kv.bias).reshape(2, 7, 2, 2, 8).unbind(2)
    k, v = k.transpose(1, 2), v.transpose(1, 2)
    weights = (q @ k.transpose(-2, -1) / math.sqrt(8)).softmax(-1)  # (2, heads, 5, 7)
    expected = (weights @ v).transpose(1, 2).reshape(2, 5, 16) @ attn.proj.weight.T + attn.proj.bias
    torch.testing.assert_close(attn(x, context), expected, atol=1e-5, rtol=1e-5)
    out, got_weights = attn(x, context, return_attn=True)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_weights, weights, atol=1e-6, rtol=1e-5)
    # a masked context position changes nothing
    mask = torch.ones(1, 1, 5, 7, dtype=torch.bool)
    mask[..., 3] = False
    changed = context.clone()
    changed[:, 3] += 10
    torch.testing.assert_close(attn(x, context, attn_mask=mask), attn(x, changed, attn_mask=mask))


@pytest.mark.parametrize("class_token", [False, True])
def test_map_head_equals_timm_and_pools_the_patch_tokens_by_a_learned_query(class_token):
    """global_pool="map" (SigLIP, big_vision): timm's weights load by name and give timm's logits."""
    kwargs = dict(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=4, num_classes=5)
    theirs = timm.models.vision_transformer.VisionTransformer(**kwargs, global_pool="map", class_token=class_token)
    ours = create_model("vit_nano_patch4_16", **kwargs, global_pool="map", class_token=class_token)
    ours.load_state_dict(theirs.eval().state_dict(), strict=True)
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(ours.eval()(x), theirs(x), atol=1e-5, rtol=1e-5)
        tokens = ours.forward_features(x)
        pool = ours.attn_pool
        # the latent query attends to the 16 patch tokens only, then a residual MLP
        y, weights = CrossAttention.forward(
            pool, pool.latent.expand(3, -1, -1), tokens[:, ours.num_prefix_tokens :], return_attn=True
        )
        assert weights.shape == (3, 4, 1, 16)
        expected = (y + pool.mlp(pool.norm(y)))[:, 0]
        torch.testing.assert_close(ours.forward_head(tokens, pre_logits=True), expected, atol=1e-6, rtol=1e-5)
