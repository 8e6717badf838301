"""Muon (Jordan et al. 2024) for a transformer's hidden weight matrices, AdamW for everything else.

Muon orthogonalises each 2-D weight's momentum update (Newton-Schulz iterations), which trains
transformers in fewer steps than AdamW; embeddings, the head, norms and biases stay on AdamW, as
its authors advise. With `adjust_lr_fn="match_rms_adamw"` (Liu et al. 2025, "Muon is scalable")
Muon's updates have AdamW's typical size, so both parts share one learning rate and weight decay.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch


class Muon(torch.optim.Muon):
    """`torch.optim.Muon` with its Newton-Schulz iteration in `ns_dtype` (same state, same update).

    torch runs the iteration in bfloat16, which suits GPUs but not CPUs without bfloat16 units: on
    an AVX2 CPU it made the whole ViT step ~5x slower (66 img/s where AdamW trains at ~300).
    `ns_dtype=None` picks bfloat16 for CUDA tensors and float32 elsewhere; a task trained in
    bf16-mixed passes bfloat16 (vit.training.TrainingTask.make_optimizer).
    """

    def __init__(self, params: Any, ns_dtype: torch.dtype | None = None, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, momentum = group["lr"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p.grad))
                buf.lerp_(p.grad, 1 - momentum)
                update = p.grad.lerp(buf, momentum) if group["nesterov"] else buf
                dtype = self.ns_dtype or (torch.bfloat16 if p.is_cuda else torch.float32)
                update = orthogonalize(update, group["ns_coefficients"], group["ns_steps"], group["eps"], dtype)
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(update.to(p.dtype), alpha=-lr * _lr_ratio(group["adjust_lr_fn"], p.shape))
        return loss


def orthogonalize(
    g: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float, dtype: torch.dtype
) -> torch.Tensor:
    """Muon's quintic Newton-Schulz iteration towards U V^T of g = U S V^T (singular values end
    near 1, not exactly 1, by design of the coefficients), computed in `dtype`."""
    a, b, c = coefficients
    x = g.to(dtype)
    tall = g.size(0) > g.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)  # spectral norm <= Frobenius norm <= 1
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def _lr_ratio(adjust_lr_fn: str | None, shape: torch.Size) -> float:
    """torch.optim.Muon's per-matrix lr scale: "match_rms_adamw" gives updates AdamW's RMS."""
    fan_out, fan_in = shape[:2]
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(fan_out, fan_in))
    if adjust_lr_fn in (None, "original"):
        return math.sqrt(max(1, fan_out / fan_in))
    raise ValueError(f"adjust_lr_fn must be None, 'original' or 'match_rms_adamw', got {adjust_lr_fn!r}")


class MuonAdamW(torch.optim.Optimizer):
    """One optimizer (as Lightning's automatic optimization and LR schedulers expect) that steps
    `Muon` on the groups marked `muon=True` and `torch.optim.AdamW` on the others.

    The inner optimizers share this optimizer's group dicts and state, so schedulers, checkpoints
    (`state_dict`) and moving state to a device see everything in one place.
    """

    def __init__(
        self,
        groups: list[dict[str, Any]],
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        momentum: float = 0.95,
        fused: bool = False,
        ns_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(groups, {"lr": lr, "muon": False})
        muon_groups = [g for g in self.param_groups if g["muon"]]
        adam_groups = [g for g in self.param_groups if not g["muon"]]
        if not muon_groups:
            raise ValueError("optimizer 'muon' found no 2-D hidden weight matrices (transformer blocks) to apply it to")
        self._muon = Muon(muon_groups, lr=lr, momentum=momentum, adjust_lr_fn="match_rms_adamw", ns_dtype=ns_dtype)
        self._adamw = torch.optim.AdamW(adam_groups, lr=lr, betas=betas, fused=fused) if adam_groups else None
        self._share()

    def _share(self) -> None:
        self._muon.param_groups = [g for g in self.param_groups if g["muon"]]
        self._muon.state = self.state
        if self._adamw is not None:
            self._adamw.param_groups = [g for g in self.param_groups if not g["muon"]]
            self._adamw.state = self.state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)  # replaces the group dicts and the state: share them again
        self._share()

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = self._muon.step(closure)  # evaluates the closure (once) before stepping
        if self._adamw is not None:
            self._adamw.step()
        return loss


def split_muon_groups(groups: list[dict[str, Any]], muon_params: set[torch.nn.Parameter]) -> list[dict[str, Any]]:
    """Each (lr, weight decay) group split into its Muon part (`muon_params`) and the rest."""
    out = []
    for g in groups:
        for flag in (True, False):
            params = [p for p in g["params"] if (p in muon_params) == flag]
            if params:
                out.append({**g, "params": params, "muon": flag})
    return out
