"""The feed-forward layers: Mlp, SwiGLU (and timm's packed and split layouts), mixture of experts."""

from __future__ import annotations

import math

import torch
from torch import nn

from vit.layers.norm import make_act, make_norm


class Mlp(nn.Module):
    """fc1 -> GELU (or `act`) -> fc2, the transformer feed-forward layer. `norm` (a make_norm kind)
    normalises the hidden layer before fc2 (timm's `norm_layer`, NormFormer's; EVA's scale_mlp).
    `bias=False`: fc1 and fc2 without biases (timm's `proj_bias`, AIMv2). `fc1`: a subclass's own
    first layers (SwiGLU's), registered, and so initialised, first."""

    def __init__(
        self, dim: int, hidden_dim: int, drop: float = 0.0, act: str = "gelu", norm: str | None = None,
        norm_eps: float = 1e-6, bias: bool = True, **fc1: nn.Module,
    ) -> None:  # fmt: skip
        super().__init__()
        for name, layer in (fc1 or {"fc1": nn.Linear(dim, hidden_dim, bias=bias)}).items():
            setattr(self, name, layer)
        self.act = make_act(act)
        self.drop1 = nn.Dropout(drop)
        self.norm = make_norm(norm, hidden_dim, norm_eps) if norm else nn.Identity()
        self.fc2 = nn.Linear(hidden_dim, dim, bias=bias)
        self.drop2 = nn.Dropout(drop)

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        """Everything before fc2: forward(x) is output(hidden(x))."""
        return self.norm(self.drop1(self.act(self.fc1(x))))

    def output(self, h: torch.Tensor) -> torch.Tensor:
        return self.drop2(self.fc2(h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output(self.hidden(x))


class SwiGLU(Mlp):
    """fc2(SiLU(gate) * value): the gated feed-forward layer of PaLM and LLaMA (Shazeer 2020).

    fc1 computes value and gate in one matmul (first half value, second half gate). Three
    dim x hidden matrices instead of two, so `make_mlp` gives it 2/3 of the GELU MLP's hidden
    width to keep the parameter count (and FLOPs) about the same. `gate_first=True` is timm's
    packed layout (`GluMlp`, `SwiGLUPacked`: the first half is the gate); `split=True` is timm's
    `SwiGLU`, gate and value in two matrices `fc1_g`, `fc1_x`. `norm`, `bias`: as in Mlp.
    """

    def __init__(
        self, dim: int, hidden_dim: int, drop: float = 0.0, act: str = "silu", gate_first: bool = False,
        split: bool = False, norm: str | None = None, norm_eps: float = 1e-6, bias: bool = True,
    ) -> None:  # fmt: skip
        if split:
            fc1 = {"fc1_g": nn.Linear(dim, hidden_dim, bias=bias), "fc1_x": nn.Linear(dim, hidden_dim, bias=bias)}
        else:
            fc1 = {"fc1": nn.Linear(dim, 2 * hidden_dim, bias=bias)}
        super().__init__(dim, hidden_dim, drop, act, norm, norm_eps, bias, **fc1)
        self.gate_first = gate_first

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "fc1_g"):
            value, gate = self.fc1_x(x), self.fc1_g(x)
        else:
            value, gate = self.fc1(x).chunk(2, dim=-1)
            if self.gate_first:
                value, gate = gate, value
        return self.norm(self.drop1(self.act(gate) * value))


def swiglu_hidden_dim(mlp_hidden_dim: int, multiple_of: int = 8) -> int:
    """2/3 of a GELU MLP's hidden width, to the nearest multiple of 8: 8/3 x width for mlp_ratio 4."""
    return max(multiple_of, multiple_of * round(2 * mlp_hidden_dim / 3 / multiple_of))


class MoE(nn.Module):
    """Mixture-of-experts feed-forward layer: E expert MLPs, each token processed by its top-k.

    Why: the parameter count grows with E while each token still costs k MLPs (Shazeer et al.
    2017, GShard, Switch Transformer, Mixtral).

    Routing: a linear router gives every token a softmax over the experts; the token goes to its
    k most probable experts and their outputs are summed, weighted by those probabilities,
    renormalised over the k chosen when k > 1 (GShard, Mixtral) and left as they are when k = 1
    (Switch), so that the router still gets a gradient from the task loss.

    Load balancing: left alone, the router sends most tokens to the few experts that got ahead
    early. Every forward stores `self.aux_loss` = E * sum_i f_i * P_i (Switch Transformer, eq. 4),
    with f_i the fraction of the N*k routing slots that went to expert i and P_i the mean router
    probability of expert i. It is 1 for uniform routing and grows to E when every token goes to
    one expert (with P following f it is E * sum f_i^2 >= 1, equality iff f is uniform). The model's
    `aux_loss()` sums these and the training step adds `aux_loss_weight * aux` (0.01 in Switch).

    Capacity: `capacity_factor=None` is dropless: each expert takes every token routed to it (one
    device, variable-size batches per expert, nothing lost). With a factor c, expert i takes at
    most ceil(c * N * k / E) slots, first come (token order) first served; the overflow is dropped,
    contributes zero and the token carries on through the residual connection. That fixed size is
    what accelerator implementations need; `dropped_fraction` reports what it cost on the last batch.
    """

    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        num_experts: int,
        top_k: int = 2,
        capacity_factor: float | None = None,
        kind: str = "gelu",
        drop: float = 0.0,
        act: str | None = None,
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be between 1 and num_experts={num_experts}, got {top_k}")
        if capacity_factor is not None and capacity_factor <= 0:
            raise ValueError(f"capacity_factor must be positive (or None for dropless), got {capacity_factor}")
        self.num_experts, self.top_k, self.capacity_factor = num_experts, top_k, capacity_factor
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.experts = nn.ModuleList([make_mlp(kind, dim, hidden_dim, drop, act=act) for _ in range(num_experts)])
        self.aux_loss: torch.Tensor | None = None
        self.dropped_fraction = 0.0

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Tokens (N, dim) -> (expert ids (N, k), their weights (N, k), router probabilities (N, E))."""
        probs = self.router(x).float().softmax(dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.top_k > 1:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights, probs

    def capacity(self, num_tokens: int) -> int | None:
        """Routing slots each expert accepts for a batch of num_tokens tokens; None: no limit."""
        if self.capacity_factor is None:
            return None
        return math.ceil(self.capacity_factor * num_tokens * self.top_k / self.num_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        experts, weights, probs = self.route(x)
        slots_per_expert = torch.bincount(experts.flatten(), minlength=self.num_experts).float()
        self.aux_loss = self.num_experts * (slots_per_expert / experts.numel() * probs.mean(dim=0)).sum()

        token_of_slot = torch.arange(x.shape[0], device=x.device).repeat_interleave(self.top_k)
        expert_of_slot, weight_of_slot = experts.flatten(), weights.flatten().to(x.dtype)
        capacity, dropped = self.capacity(x.shape[0]), 0
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            slots = (expert_of_slot == i).nonzero().squeeze(1)  # in token order
            if capacity is not None and len(slots) > capacity:
                dropped += len(slots) - capacity
                slots = slots[:capacity]
            if len(slots) == 0:
                continue
            tokens = token_of_slot[slots]
            out = out.index_add(0, tokens, expert(x[tokens]) * weight_of_slot[slots, None])
        self.dropped_fraction = dropped / experts.numel()
        return out.reshape(shape)


def make_mlp(
    kind: str,
    dim: int,
    hidden_dim: int,
    drop: float = 0.0,
    num_experts: int = 1,
    top_k: int = 2,
    capacity_factor: float | None = None,
    act: str | None = None,
    norm: str | None = None,
    norm_eps: float = 1e-6,
    align_to: int = 0,
    bias: bool = True,
) -> nn.Module:
    """The feed-forward layer by name: "gelu" (Mlp, timm's; GELU unless `act` names another),
    "swiglu" (SwiGLU at 2/3 of hidden_dim, the same parameter count) or "glu" (timm's packed
    GluMlp in a ViT: fc1 is hidden_dim wide, its first half the gate; GELU unless `act`: with "silu"
    it is timm's SwiGLUPacked). timm's EVA SwiGLUs have hidden_dim gate and hidden_dim value
    channels: "swiglu_packed" in one fc1 (gate first), "swiglu_split" in fc1_g and fc1_x, hidden_dim
    rounded up to a multiple of `align_to`. `norm`: a norm before fc2 (not for "swiglu"/"glu");
    `bias=False`: no biases in its linears (dense layers only).
    num_experts > 1 makes it a MoE of such MLPs; with num_experts = 1 it is the dense layer itself."""
    if num_experts > 1:
        return MoE(dim, hidden_dim, num_experts, top_k, capacity_factor, kind, drop, act)
    if kind == "gelu":
        return Mlp(dim, hidden_dim, drop, act or "gelu", norm, norm_eps, bias)
    if kind == "swiglu":
        return SwiGLU(dim, swiglu_hidden_dim(hidden_dim), drop, act or "silu", bias=bias)
    if kind == "glu":
        return SwiGLU(dim, hidden_dim // 2, drop, act or "gelu", gate_first=True, bias=bias)
    if kind == "swiglu_packed":
        return SwiGLU(dim, hidden_dim, drop, act or "silu", gate_first=True, norm=norm, norm_eps=norm_eps, bias=bias)
    if kind == "swiglu_split":
        hidden_dim += -hidden_dim % align_to if align_to else 0
        return SwiGLU(dim, hidden_dim, drop, act or "silu", split=True, norm=norm, norm_eps=norm_eps, bias=bias)
    raise ValueError(f"unknown mlp {kind!r}; expected one of {MLP_KINDS}")


MLP_KINDS = ("gelu", "swiglu", "glu", "swiglu_packed", "swiglu_split")


def moe_aux_loss(model: nn.Module) -> torch.Tensor:
    """Sum of the load-balancing losses every MoE layer of `model` stored in its last forward;
    a zero tensor when the model has none (so a training step can always add it)."""
    losses = [m.aux_loss for m in model.modules() if isinstance(m, MoE) and m.aux_loss is not None]
    return torch.stack(losses).sum() if losses else torch.zeros(())
