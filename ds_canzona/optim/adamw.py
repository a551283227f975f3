"""AdamW's per-tensor rule, in the form of DeepSpeed's auxiliary Adam (``adam_update``).

For one tensor W with gradient G at step t (counting from 1):

    m <- lerp(m, G, 1 - beta1)            v <- lerp(v, G^2, 1 - beta2)
    D <- (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps)
    W <- W * (1 - lr * weight_decay)      W <- W - lr * D

This is the exact sequence of DeepSpeed's ``adam_update`` (so the two agree bit for bit in
fp32); ``torch.optim.AdamW`` folds the bias corrections differently and agrees to rounding.

``adam_w_mode=False`` (DeepSpeed's key, FusedAdam's meaning) is Adam with L2 regularisation
instead: G <- G + weight_decay * W before the moments, and no decoupled decay; that is
``torch.optim.Adam``'s ``weight_decay`` and DeepSpeed's ``adam_w_mode: false``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from ds_canzona.optim.base import RuleBase, check_betas, check_bool, check_float, new_step, register_rule, state_dtype


def adam_direction_(grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, step: int, betas: tuple[float, float],
                    eps: float) -> Tensor:
    """Advance Adam's moments in place and return the bias-corrected step direction."""
    beta1, beta2 = betas
    exp_avg.lerp_(grad, 1.0 - beta1)
    exp_avg_sq.lerp_(grad.square(), 1.0 - beta2)
    first = exp_avg / (1.0 - beta1**step)
    second = exp_avg_sq / (1.0 - beta2**step)
    return first / (second.sqrt() + eps)


@register_rule
@dataclass(frozen=True, kw_only=True)
class AdamWRule(RuleBase):
    """Hyper-parameters of the AdamW kind (the single-process AdamW defaults are torch's)."""

    kind: ClassVar[str] = "adamw"

    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    # True: decoupled weight decay (AdamW); False: L2, the decay added to the gradient (Adam).
    adam_w_mode: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "betas", check_betas(self.kind, "betas", self.betas))
        check_float(self.kind, "eps", self.eps, low=0.0)
        check_float(self.kind, "weight_decay", self.weight_decay, low=0.0)
        check_bool(self.kind, "adam_w_mode", self.adam_w_mode)

    def init_state(self, param: Tensor) -> dict[str, Tensor]:
        dtype = state_dtype(param)
        return {
            "step": new_step(),
            "exp_avg": torch.zeros_like(param, dtype=dtype),
            "exp_avg_sq": torch.zeros_like(param, dtype=dtype),
        }

    def _update_one(self, param: Tensor, grad: Tensor, state: dict[str, Tensor], lr: float) -> None:
        state["step"] += 1
        if not self.adam_w_mode and self.weight_decay != 0.0:
            grad = grad.add(param, alpha=self.weight_decay)  # a new tensor: the caller's gradient stays
        direction = adam_direction_(grad, state["exp_avg"], state["exp_avg_sq"], int(state["step"].item()),
                                    self.betas, self.eps)
        if self.adam_w_mode and self.weight_decay != 0.0:
            param.mul_(1.0 - lr * self.weight_decay)
        param.add_(direction, alpha=-lr)
