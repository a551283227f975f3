"""Muon's per-tensor rule: Nesterov momentum, then a Newton-Schulz polar factor as the step.

For one tensor W with gradient G (each matrix of it on its own, see "Which matrices" below):

    B <- momentum * B + (1 - momentum) * G                     (B: state 'momentum_buffer')
    U <- (1 - momentum) * G + momentum * B   if nesterov, else B
    O <- NS(U)                                                 (approximate U V^T of U's SVD)
    W <- W * (1 - lr * weight_decay)                           (decoupled weight decay)
    W <- W - lr * scale * O

``scale`` is sqrt(max(1, rows / cols)) ("original", Keller Jordan's and DeepSpeed's) or
0.2 * sqrt(max(rows, cols)) ("match_rms_adamw", Moonshot's: an update with AdamW's RMS, so
AdamW's lr and weight decay carry over).

Which matrices (DeepSpeed 0.19.8's ``muon_update``): a 2-D tensor is one matrix; a 3-D tensor
``[experts, out, in]`` is a stack of ``experts`` matrices, each orthogonalised on its own and
scaled by its own shape; a 4-D convolution filter is one ``(out, in * kh * kw)`` matrix. With
``num_heads`` set (per-head Muon), a 2-D attention projection ``[heads * head_dim, in]`` is
``heads`` matrices of ``head_dim x in``. The matrices of a stack are orthogonalised one call each
(not as one batched call), so each one's result is bit-identical to orthogonalising it alone.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from ds_canzona.optim.base import (
    RuleBase,
    check_bool,
    check_choice,
    check_float,
    check_int,
    invalid,
    matrix_stack_shape,
    new_step,
    register_rule,
    require_matrix,
    state_dtype,
)
from ds_canzona.optim.newton_schulz import COEFFICIENT_SETS, NS_METHODS, CoefficientSet, coefficient_set, orthogonalize

LR_SCALINGS = ("original", "match_rms_adamw")
NS_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def lr_scale(rule: str, rows: int, cols: int) -> float:
    """The factor on lr for a rows x cols update (see the module docstring)."""
    if rule == "original":
        return math.sqrt(max(1.0, rows / cols))
    return 0.2 * math.sqrt(max(rows, cols))


def resolve_ns_dtype(ns_dtype: str | None, method: str, device: torch.device, work_dtype: torch.dtype) -> torch.dtype:
    """The dtype the iteration runs in.

    None follows DeepSpeed's choice on CUDA (bf16 for the standard iteration, fp16 for Gram,
    whose restart keeps fp16's narrower range safe and whose extra mantissa helps) and keeps
    the working precision elsewhere. DeepSpeed's CPU accelerator would also pick bf16/fp16;
    we do not, because on the CPU half-precision matmuls are slow and the CPU path is the
    exact reference the distributed runtime is checked against.
    """
    if ns_dtype is not None:
        return NS_DTYPES[ns_dtype]
    if device.type == "cuda":
        return torch.float16 if method == "gram" else torch.bfloat16
    return work_dtype


@register_rule
@dataclass(frozen=True, kw_only=True)
class MuonRule(RuleBase):
    """Hyper-parameters of the Muon kind (defaults: DeepSpeed 0.19.8's Muon)."""

    kind: ClassVar[str] = "muon"

    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    ns_method: str = "gram"
    ns_coefficients: str | tuple[float, float, float] = "quintic"
    ns_dtype: str | None = None
    gram_restart_steps: tuple[int, ...] = (2,)
    weight_decay: float = 0.0
    lr_scaling: str = "original"
    batch_same_shape: bool = False
    num_heads: int | None = None

    def __post_init__(self) -> None:
        kind = self.kind
        check_float(kind, "momentum", self.momentum, low=0.0, high=1.0, high_open=True)
        check_bool(kind, "nesterov", self.nesterov)
        check_int(kind, "ns_steps", self.ns_steps, low=1)
        check_choice(kind, "ns_method", self.ns_method, NS_METHODS)
        check_float(kind, "weight_decay", self.weight_decay, low=0.0)
        check_choice(kind, "lr_scaling", self.lr_scaling, LR_SCALINGS)
        check_bool(kind, "batch_same_shape", self.batch_same_shape)
        if self.num_heads is not None:
            check_int(kind, "num_heads", self.num_heads, low=1)
        if isinstance(self.ns_dtype, torch.dtype):  # accept torch.float32 as well as "float32"
            object.__setattr__(self, "ns_dtype", str(self.ns_dtype).removeprefix("torch."))
        if self.ns_dtype is not None:
            check_choice(kind, "ns_dtype", self.ns_dtype, NS_DTYPES)
        coefficients = self.ns_coefficients
        if isinstance(coefficients, str):
            check_choice(kind, "ns_coefficients", coefficients, COEFFICIENT_SETS)
        elif not (isinstance(coefficients, (tuple, list)) and len(coefficients) == 3
                  and all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                          for v in coefficients)):
            raise invalid(kind, "ns_coefficients", coefficients,
                          f"must be one of {', '.join(map(repr, COEFFICIENT_SETS))} or a triple (a, b, c)")
        else:
            object.__setattr__(self, "ns_coefficients", tuple(float(v) for v in coefficients))
        restarts = self.gram_restart_steps
        if not isinstance(restarts, (tuple, list)) or not all(
                isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in restarts):
            raise invalid(kind, "gram_restart_steps", restarts, "must be a sequence of step indices >= 1")
        object.__setattr__(self, "gram_restart_steps", tuple(restarts))

    @property
    def coefficient_set(self) -> CoefficientSet:
        return coefficient_set(self.ns_coefficients)

    def matrices(self, shape: tuple[int, ...]) -> tuple[int, int, int]:
        """(count, rows, cols) of the matrices a tensor of ``shape`` is orthogonalised as."""
        count, rows, cols = matrix_stack_shape(shape)
        if self.num_heads is None:
            return count, rows, cols
        return self.num_heads, rows // self.num_heads, cols

    def check_shape(self, shape: tuple[int, ...]) -> None:
        super().check_shape(shape)
        if self.num_heads is not None and (len(shape) != 2 or shape[0] % self.num_heads):
            raise ValueError(f"Per-head Muon (num_heads={self.num_heads}) needs a 2-D attention projection whose "
                             f"rows split evenly into heads, got shape {shape}")

    def plan_heads(self) -> int:
        return self.num_heads or 1

    def init_state(self, param: Tensor) -> dict[str, Tensor]:
        require_matrix(self.kind, param)
        self.check_shape(tuple(param.shape))
        # 'step' is not needed by the math; it is kept so every kind's state says how many
        # updates it has taken (and a skipped non-finite step is visible).
        return {"step": new_step(), "momentum_buffer": torch.zeros_like(param, dtype=state_dtype(param))}

    def cost_options(self) -> dict[str, Any]:
        return {"ns_steps": self.ns_steps, "ns_method": self.ns_method}

    # -- the update ---------------------------------------------------------------------------

    def _momentum_(self, grad: Tensor, state: dict[str, Tensor]) -> Tensor:
        """Advance the momentum buffer; return the matrix to orthogonalise (never ``grad`` itself)."""
        buf = state["momentum_buffer"]
        buf.lerp_(grad, 1.0 - self.momentum)
        state["step"] += 1
        return grad.lerp(buf, self.momentum) if self.nesterov else buf

    def _orthogonalize(self, u: Tensor) -> Tensor:
        dtype = resolve_ns_dtype(self.ns_dtype, self.ns_method, u.device, u.dtype)
        return orthogonalize(u, method=self.ns_method, coefficients=self.coefficient_set, steps=self.ns_steps,
                             dtype=dtype, restart_steps=self.gram_restart_steps)

    def _orthogonalize_matrices(self, u: Tensor) -> Tensor:
        """The orthogonalised update of one tensor, as a (count, rows, cols) stack of its matrices.

        One call per matrix: on the CPU a batched matmul is not bit-identical to the same
        products one by one (docs/NOTES.md), and each matrix's result must not depend on its
        neighbours. ``batch_same_shape`` opts into one batched call instead.
        """
        count, rows, cols = self.matrices(tuple(u.shape))
        stack = u.reshape(count, rows, cols)
        if count == 1:
            return self._orthogonalize(stack[0]).unsqueeze(0)
        if self.batch_same_shape:
            return self._orthogonalize(stack)
        out = torch.empty_like(stack)
        for index in range(count):
            out[index] = self._orthogonalize(stack[index])
        return out

    def _apply_(self, param: Tensor, ortho: Tensor, lr: float) -> None:
        _, rows, cols = self.matrices(tuple(param.shape))
        if self.weight_decay != 0.0:
            param.mul_(1.0 - lr * self.weight_decay)
        param.add_(ortho.reshape(param.shape).to(param.dtype), alpha=-lr * lr_scale(self.lr_scaling, rows, cols))

    def _update_one(self, param: Tensor, grad: Tensor, state: dict[str, Tensor], lr: float) -> None:
        u = self._momentum_(grad, state)
        self._apply_(param, self._orthogonalize_matrices(u), lr)

    def _update_finite(self, work: list[tuple[Tensor, Tensor, dict[str, Tensor]]], lr: float) -> None:
        if not self.batch_same_shape:
            super()._update_finite(work, lr)
            return
        # Opt-in batching: one batched iteration per (shape, dtype, device), over every matrix of
        # every tensor of that shape. Equal to the per-matrix result only up to rounding (see
        # docs/OPTIMIZERS.md), hence off by default.
        groups: dict[tuple[Any, ...], list[tuple[Tensor, Tensor, dict[str, Tensor]]]] = defaultdict(list)
        for item in work:
            param = item[0]
            groups[(tuple(param.shape), param.dtype, param.device)].append(item)
        for items in groups.values():
            if len(items) == 1:
                super()._update_finite(items, lr)
                continue
            masters = [p if p.dtype == state_dtype(p) else p.to(state_dtype(p)) for p, _, _ in items]
            updates = [self._momentum_(g.to(m.dtype), s) for m, (_, g, s) in zip(masters, items)]
            count, rows, cols = self.matrices(tuple(items[0][0].shape))
            ortho = self._orthogonalize(torch.cat([u.reshape(count, rows, cols) for u in updates]))
            for index, (master, (param, _, _)) in enumerate(zip(masters, items)):
                self._apply_(master, ortho[index * count:(index + 1) * count], lr)
                if master is not param:
                    param.copy_(master)


__all__ = ["MuonRule", "lr_scale", "resolve_ns_dtype", "LR_SCALINGS", "NS_DTYPES"]
