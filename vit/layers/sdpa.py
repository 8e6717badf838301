"""softmax(q k^T / sqrt(d) + mask) v, the two ways: PyTorch's fused kernel and written out (which can
return the weights), and the masks both take (SDPA's convention: boolean True = may attend, floats added)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def merge_masks(
    attn_mask: torch.Tensor | None, is_causal: bool, n_q: int, n_k: int, device: torch.device
) -> torch.Tensor | None:
    """Fold `is_causal` into `attn_mask` so both attention paths see one mask.

    Masks follow `scaled_dot_product_attention`: boolean True means "may attend", a float mask is
    added to the scores. The causal mask is aligned to the bottom-right, so the last query sees
    every key (this is what a key/value cache needs when n_q < n_k).
    """
    if not is_causal:
        return attn_mask
    causal = torch.ones(n_q, n_k, dtype=torch.bool, device=device).tril(diagonal=n_k - n_q)
    if attn_mask is None:
        return causal
    if attn_mask.dtype == torch.bool:
        return attn_mask & causal
    return attn_mask.masked_fill(~causal, float("-inf"))


def fused_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None, dropout_p: float, is_causal: bool
) -> torch.Tensor:
    """`F.scaled_dot_product_attention`, computed in fp32 for half-precision inputs on a CPU.

    PyTorch's CPU flash kernel in half precision is 3-6x slower than in fp32 at ViT sequence
    lengths (fwd+bwd, 32-64 tokens: 26.6 vs 4.1 ms; 197 tokens: 103 vs 100 ms), and under bf16
    autocast on an AMX Xeon it took over half of the ViT's training step; the matmuls around it
    stay in bf16. Autocast is switched off for the call, since it would cast the inputs back down.
    """
    if q.device.type != "cpu" or q.dtype not in (torch.bfloat16, torch.float16):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal)
    if attn_mask is not None and attn_mask.is_floating_point():
        attn_mask = attn_mask.float()
    with torch.autocast("cpu", enabled=False):
        x = F.scaled_dot_product_attention(
            q.float(), k.float(), v.float(), attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal
        )
    return x.to(q.dtype)


def add_bias(attn_mask: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor | None:
    """An SDPA mask (boolean or additive) with an additive bias added: one float mask, the bias's dtype."""
    if bias is None:
        return attn_mask
    if attn_mask is None:
        return bias
    if attn_mask.dtype == torch.bool:
        return bias.masked_fill(~attn_mask, float("-inf"))
    return attn_mask.to(bias.dtype) + bias


def attention_weights(q: torch.Tensor, k: torch.Tensor, attn_mask: torch.Tensor | None) -> torch.Tensor:
    """softmax(q k^T + mask) over the keys; q is already scaled. Returns (B, heads, Nq, Nk)."""
    scores = q @ k.transpose(-2, -1)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask
    return scores.softmax(dim=-1)
