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

The rule runs the sequence above over lists of tensors (``torch._foreach_*``): one launch per
operation for a whole group of tensors of one device, dtype and step count, instead of one per
operation and tensor. Each foreach operation is the same elementwise operation as its
per-tensor form, so the result is the same bits (tests/test_step_overhead.py checks it against
the per-tensor sequence on the CPU; on CUDA the division by a scalar is written as the
per-tensor kernel computes it, see ``_divided``); a group is cut at ``FOREACH_GROUP_NUMEL``
elements so that its temporaries (three lists of full-size tensors) stay bounded.
"""

from __future__ import annotations

import struct
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from ds_canzona.optim.base import RuleBase, check_betas, check_bool, check_float, new_step, register_rule, state_dtype

# Elements of one foreach group: tensors are added to a group until it holds this many, and a
# larger tensor is a group of its own. The group's temporaries are three times its size in
# fp32, so this bounds them at 3 x max(16 Mi elements, the largest tensor) x 4 bytes, while the
# many small tensors of a model (norms, biases) share one launch per operation.
FOREACH_GROUP_NUMEL = 1 << 24


def adam_direction_(grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, step: int, betas: tuple[float, float],
                    eps: float) -> Tensor:
    """Advance Adam's moments in place and return the bias-corrected step direction."""
    beta1, beta2 = betas
    exp_avg.lerp_(grad, 1.0 - beta1)
    exp_avg_sq.lerp_(grad.square(), 1.0 - beta2)
    first = exp_avg / (1.0 - beta1**step)
    second = exp_avg_sq / (1.0 - beta2**step)
    return first / (second.sqrt() + eps)


def adam_directions_(grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor], step: int,
                     betas: tuple[float, float], eps: float) -> list[Tensor]:
    """``adam_direction_`` over lists of tensors that share a step count: the same operations in foreach form."""
    beta1, beta2 = betas
    torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)
    squares = torch._foreach_mul(grads, grads)  # what Tensor.square computes
    torch._foreach_lerp_(exp_avg_sqs, squares, 1.0 - beta2)
    del squares
    first = _divided(exp_avgs, 1.0 - beta1**step)
    second = _divided(exp_avg_sqs, 1.0 - beta2**step)
    torch._foreach_sqrt_(second)
    torch._foreach_add_(second, eps)
    torch._foreach_div_(first, second)
    return first


def _divided(tensors: list[Tensor], divisor: float) -> list[Tensor]:
    """``[t / divisor for t in tensors]``, rounded as that per-tensor division rounds on the tensors' device.

    On CUDA, ``Tensor / python_scalar`` multiplies by the reciprocal, computed in the tensor's
    dtype (PyTorch's ``div_true_kernel_cuda``: "compute a * reciprocal(b)"), while the CPU
    divides; the foreach form is given the same arithmetic explicitly. The reciprocal is
    computed on the host: in float64 and rounded to float32 for float32 tensors, which is the
    float32 division (double rounding is exact for a division when 53 >= 2 x 24 + 2 bits).
    """
    if tensors[0].device.type != "cuda":
        return torch._foreach_div(tensors, divisor)
    if tensors[0].dtype == torch.float64:
        return torch._foreach_mul(tensors, 1.0 / divisor)
    return torch._foreach_mul(tensors, _to_float32(1.0 / _to_float32(divisor)))


def _to_float32(value: float) -> float:
    """``value`` rounded to the nearest float32 (ties to even), as a Python float."""
    return struct.unpack("f", struct.pack("f", value))[0]


def _bounded_groups(items: list, numel: int) -> Iterator[list]:
    """``items`` (param first) cut in order into runs of at most ``numel`` elements, a larger one alone."""
    run: list = []
    held = 0
    for item in items:
        size = item[0].numel()
        if run and held + size > numel:
            yield run
            run, held = [], 0
        run.append(item)
        held += size
    if run:
        yield run


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
        self._update_finite([(param, grad, state)], lr)

    def _update_finite(self, work: list[tuple[Tensor, Tensor, dict[str, Tensor]]], lr: float) -> None:
        if not work:
            return
        steps = [state["step"] for _, _, state in work]
        torch._foreach_add_(steps, 1.0)
        # The step counters live on the host (``new_step``): reading them waits for no device.
        counts = [int(step.item()) for step in steps]
        groups: dict[tuple, list[tuple[Tensor, Tensor, dict[str, Tensor]]]] = defaultdict(list)
        for (param, grad, state), count in zip(work, counts):
            groups[(param.device, param.dtype, count)].append((param, grad, state))
        for (_, _, count), items in groups.items():
            for run in _bounded_groups(items, FOREACH_GROUP_NUMEL):
                self._update_group(run, count, lr)

    def _update_group(self, items: list[tuple[Tensor, Tensor, dict[str, Tensor]]], step: int, lr: float) -> None:
        """One foreach pass over tensors of one device, dtype and step count (see the module docstring)."""
        params = [param for param, _, _ in items]
        # bf16/fp16 parameters (single-process) are computed in fp32 and rounded once at the end;
        # the runtime hands fp32 masters, for which these are the parameters themselves.
        masters = [p if p.dtype == state_dtype(p) else p.to(state_dtype(p)) for p in params]
        grads = [grad.to(master.dtype) for master, (_, grad, _) in zip(masters, items)]
        if not self.adam_w_mode and self.weight_decay != 0.0:
            grads = torch._foreach_add(grads, masters, alpha=self.weight_decay)  # the caller's gradients stay
        directions = adam_directions_(grads, [s["exp_avg"] for _, _, s in items],
                                      [s["exp_avg_sq"] for _, _, s in items], step, self.betas, self.eps)
        if self.adam_w_mode and self.weight_decay != 0.0:
            torch._foreach_mul_(masters, 1.0 - lr * self.weight_decay)
        torch._foreach_add_(masters, directions, alpha=-lr)
        copies = [(p, m) for p, m in zip(params, masters) if m is not p]
        if copies:
            torch._foreach_copy_([p for p, _ in copies], [m for _, m in copies])
