"""The character GPT: causal, built on the very same Block as the ViT."""

from __future__ import annotations

import pytest
import torch

from vit import GPT, create_model, set_fused_attn


def _gpt(**kwargs) -> GPT:
    return create_model("gpt_char_cpu", vocab_size=20, block_size=16, **kwargs).eval()


def test_changing_a_future_token_never_changes_earlier_logits():
    model = _gpt()
    idx = torch.randint(0, 20, (2, 12))
    changed = idx.clone()
    changed[:, 7] = (changed[:, 7] + 1) % 20
    with torch.no_grad():
        a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, :7], b[:, :7], atol=0, rtol=0)
    assert not torch.allclose(a[:, 7:], b[:, 7:])


def test_fused_and_explicit_attention_give_the_same_logits():
    model = _gpt()
    idx = torch.randint(0, 20, (3, 16))
    with torch.no_grad():
        fused = model(idx)
        set_fused_attn(model, False)
        explicit = model(idx)
    torch.testing.assert_close(fused, explicit, atol=1e-5, rtol=1e-5)


def test_lm_head_is_tied_to_the_token_embedding():
    model = _gpt()
    assert model.lm_head.weight is model.tok_embed.weight


def test_an_untied_head_is_a_parameter_of_its_own_and_trains_apart_from_the_embedding():
    model = _gpt(tie_head=False)
    assert model.lm_head.weight is not model.tok_embed.weight
    names = dict(model.named_parameters())
    assert "lm_head.weight" in names and sum(p.numel() for p in names.values()) == (
        sum(p.numel() for p in _gpt().parameters()) + 20 * 128
    )
    model(torch.randint(0, 20, (2, 8))).square().mean().backward()
    assert not torch.equal(model.lm_head.weight.grad, model.tok_embed.weight.grad)


def test_zero_init_starts_every_block_as_the_identity():
    model = _gpt(tie_head=False, zero_init=True)
    idx = torch.randint(0, 20, (2, 12))
    zeroed = [n for n, p in model.named_parameters() if n.endswith("weight") and not p.any()]
    assert sorted(zeroed) == sorted(
        [f"blocks.{i}.{w}" for i in range(4) for w in ("attn.proj.weight", "mlp.fc2.weight")] + ["lm_head.weight"]
    )
    with torch.no_grad():
        x = model.tok_embed(idx) + model.pos_embed(torch.arange(12))
        for block in model.blocks:  # each adds zero to the residual stream
            assert torch.equal(block(x), x)
        assert torch.equal(model(idx), torch.zeros(2, 12, 20))  # uniform predictions: loss ln(20) at step 0


def test_relu_squared_mlp_is_relu_then_square():
    model = _gpt(act_layer="relu_squared")
    mlp = model.blocks[0].mlp
    x = torch.randn(3, 5, 128)
    with torch.no_grad():
        expected = mlp.fc2(torch.relu(mlp.fc1(x)) ** 2)
        torch.testing.assert_close(mlp(x), expected, atol=0, rtol=0)


def test_generation_is_reproducible_with_a_seeded_generator():
    model = _gpt()
    prompt = torch.tensor([[1, 2, 3]])
    runs = [
        model.generate(prompt, 30, temperature=1.0, top_k=5, generator=torch.Generator().manual_seed(7))
        for _ in range(2)
    ]
    assert runs[0].shape == (1, 33) and torch.equal(runs[0], runs[1])
    assert torch.equal(runs[0][:, :3], prompt)
    other = model.generate(prompt, 30, temperature=1.0, top_k=5, generator=torch.Generator().manual_seed(8))
    assert not torch.equal(runs[0], other)


def test_greedy_generation_follows_the_argmax_past_the_context_length():
    model = _gpt()
    out = model.generate(torch.tensor([[4]]), 20, temperature=0)  # 21 tokens > block_size 16
    with torch.no_grad():
        expected_next = model(out[:, -17:-1])[:, -1].argmax(-1)
    assert out[0, -1] == expected_next[0]


def test_too_long_input_is_a_clear_error():
    with pytest.raises(ValueError, match="length 17 exceeds block_size 16"):
        _gpt()(torch.zeros(1, 17, dtype=torch.long))
