"""Muon (Jordan et al. 2024) for a transformer's hidden weight matrices, AdamW for everything else.

Muon orthogonalises each 2-D weight's momentum update (Newton-Schulz iterations), which trains
transformers in fewer steps than AdamW; embeddings, the head, norms and biases stay on AdamW, as
its authors advise. With `adjust_lr_fn="match_rms_adamw"` (Liu et al. 2025, "Muon is scalable")
Muon's updates have AdamW's typical size, so both parts share one learning rate and weight decay.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class MuonAdamW(torch.optim.Optimizer):
    """One optimizer (as Lightning's automatic optimization and LR schedulers expect) that steps
    `torch.optim.Muon` on the groups marked `muon=True` and `torch.optim.AdamW` on the others.

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
    ) -> None:
        super().__init__(groups, {"lr": lr, "muon": False})
        muon_groups = [g for g in self.param_groups if g["muon"]]
        adam_groups = [g for g in self.param_groups if not g["muon"]]
        if not muon_groups:
            raise ValueError("optimizer 'muon' found no 2-D hidden weight matrices (transformer blocks) to apply it to")
        self._muon = torch.optim.Muon(muon_groups, lr=lr, momentum=momentum, adjust_lr_fn="match_rms_adamw")
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
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._muon.step()
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
