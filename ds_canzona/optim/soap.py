"""SOAP's per-tensor rule: Adam run in the eigenbasis of Shampoo's statistics.

A tensor is viewed as a rows x cols matrix G. Each side no longer than ``max_precond_dim`` keeps
a statistic and an orthonormal basis (a longer side is left unrotated, its basis the identity):

    L <- beta * L + (1 - beta) G G^T,   R <- beta * R + (1 - beta) G^T G   (beta = shampoo_beta)
    rotate(X) = Q_L^T X Q_R,            unrotate(Y) = Q_L Y Q_R^T

The first call only fills the statistics and takes their eigenvectors (in descending order of
eigenvalue) as the bases; the parameter does not move, so a step never projects a gradient on
a basis built from that same gradient (as in the SOAP authors' code). Each later step k = 1, 2, ...:

    m <- lerp(m, G, 1 - beta1)                        (m lives in the parameter's own basis)
    v <- lerp(v, rotate(G)^2, 1 - beta2)              (v lives in the rotated basis)
    D <- unrotate( (rotate(m) / (1 - beta1^k)) / (sqrt(v / (1 - beta2^k)) + eps) )
    W <- W * (1 - lr * weight_decay);  W <- W - lr * D
    update L, R with G; every ``precondition_frequency`` steps refresh each basis by one power
    iteration, Q <- qr(S Q) (columns first sorted by their Rayleigh quotient, v permuted alike).

Deviations from the authors' code, for one AdamW formula across the package: weight decay is
applied before the step instead of after it, and eps is added to the bias-corrected sqrt(v).

Guarded bases, as Shampoo's roots (optim/shampoo.py): on the first call and on each refresh, one
host read of the statistics' largest magnitudes; a non-finite statistic keeps its basis (a
warning says so); an all-zero one takes the closed form on the first call (the reversed identity,
what LAPACK gives) and keeps its basis on a refresh (any basis is an eigenbasis of zero); the
eigendecomposition runs in float64 on CUDA (cuSOLVER's float32 ``eigh`` has crashed on low-rank
statistics, and the first call's statistic has rank at most min(rows, cols)), with the retries of
``shampoo.symmetric_eigh``; a statistic no attempt could decompose keeps its basis.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from ds_canzona import kernels
from ds_canzona.optim.base import (
    RuleBase,
    as_matrix,
    check_betas,
    check_float,
    check_int,
    matrix_shape,
    new_step,
    refuse_expert_stack,
    register_rule,
    require_matrix,
    state_dtype,
)
from ds_canzona.optim.shampoo import statistic_health, symmetric_eigh, warn_kept


def eigenbasis(stat: Tensor) -> Tensor:
    """Eigenvectors of a symmetric statistic, largest eigenvalue first (``shampoo.symmetric_eigh``'s
    attempts: float64 on CUDA, a float64 retry on the CPU). Raises ``torch.linalg.LinAlgError``
    when every attempt fails."""
    _, vectors = symmetric_eigh(stat, stat.dtype)
    return vectors.flip(-1).to(stat.dtype)


def zero_eigenbasis(stat: Tensor) -> Tensor:
    """The basis ``eigenbasis`` gives an all-zero statistic on the CPU (the identity, reversed), in closed form."""
    return torch.eye(stat.shape[-1], dtype=stat.dtype, device=stat.device).flip(-1)


def refresh_basis(stat: Tensor, basis: Tensor) -> tuple[Tensor, Tensor]:
    """One power-iteration step with re-orthonormalisation; returns (new basis, column order).

    Columns are first sorted by their Rayleigh quotient q^T S q (an estimate of the eigenvalue
    they track), so the basis stays in descending order; the caller permutes v the same way.
    """
    estimates = (basis * (stat @ basis)).sum(dim=0)
    order = torch.argsort(estimates, descending=True, stable=True)
    q, _ = torch.linalg.qr(stat @ basis[:, order])
    return q, order


@register_rule
@dataclass(frozen=True, kw_only=True)
class SOAPRule(RuleBase):
    """Hyper-parameters of the SOAP kind (defaults: the SOAP authors')."""

    kind: ClassVar[str] = "soap"

    betas: tuple[float, float] = (0.95, 0.95)
    shampoo_beta: float | None = None
    eps: float = 1e-8
    weight_decay: float = 0.01
    precondition_frequency: int = 10
    max_precond_dim: int = 10000

    def __post_init__(self) -> None:
        kind = self.kind
        object.__setattr__(self, "betas", check_betas(kind, "betas", self.betas))
        if self.shampoo_beta is None:
            object.__setattr__(self, "shampoo_beta", self.betas[1])
        check_float(kind, "shampoo_beta", self.shampoo_beta, low=0.0, high=1.0, high_open=True)
        check_float(kind, "eps", self.eps, low=0.0)
        check_float(kind, "weight_decay", self.weight_decay, low=0.0)
        check_int(kind, "precondition_frequency", self.precondition_frequency, low=1)
        check_int(kind, "max_precond_dim", self.max_precond_dim, low=1)

    def rotated_sides(self, shape: tuple[int, ...]) -> tuple[bool, bool]:
        rows, cols = matrix_shape(shape)
        return rows <= self.max_precond_dim, cols <= self.max_precond_dim

    def check_shape(self, shape: tuple[int, ...]) -> None:
        super().check_shape(shape)
        refuse_expert_stack(self.kind, shape)

    def init_state(self, param: Tensor) -> dict[str, Tensor]:
        require_matrix(self.kind, param)
        self.check_shape(tuple(param.shape))
        dtype = state_dtype(param)
        rows, cols = matrix_shape(param.shape)
        state = {
            "step": new_step(),
            "exp_avg": torch.zeros_like(param, dtype=dtype),
            "exp_avg_sq": torch.zeros(rows, cols, dtype=dtype, device=param.device),
        }
        left, right = self.rotated_sides(tuple(param.shape))
        for side, size, used in (("left", rows, left), ("right", cols, right)):
            if used:
                state[f"{side}_stat"] = torch.zeros(size, size, dtype=dtype, device=param.device)
                state[f"{side}_basis"] = torch.eye(size, dtype=dtype, device=param.device)
        return state

    def cost_options(self) -> dict[str, Any]:
        return {"max_preconditioner_dim": self.max_precond_dim, "precondition_frequency": self.precondition_frequency}

    # -- the update ---------------------------------------------------------------------------

    @staticmethod
    def _rotate(x: Tensor, state: dict[str, Tensor]) -> Tensor:
        if "left_basis" in state:
            x = state["left_basis"].mT @ x
        if "right_basis" in state:
            x = x @ state["right_basis"]
        return x

    @staticmethod
    def _unrotate(y: Tensor, state: dict[str, Tensor]) -> Tensor:
        if "left_basis" in state:
            y = state["left_basis"] @ y
        if "right_basis" in state:
            y = y @ state["right_basis"].mT
        return y

    def _accumulate_(self, g: Tensor, state: dict[str, Tensor]) -> None:
        assert self.shampoo_beta is not None  # resolved in __post_init__
        if "left_stat" in state:
            kernels.sym_stat_update_(state["left_stat"], g, self.shampoo_beta)
        if "right_stat" in state:
            kernels.sym_stat_update_(state["right_stat"], g.mT.contiguous(), self.shampoo_beta)

    def _update_one(self, param: Tensor, grad: Tensor, state: dict[str, Tensor], lr: float) -> None:
        state["step"] += 1
        calls = int(state["step"].item())
        g = as_matrix(grad).contiguous()
        if calls == 1:
            self._accumulate_(g, state)
            self._first_bases_(state)
            return

        k = calls - 1  # Adam's own step count: the first call did not step
        beta1, beta2 = self.betas
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        exp_avg.lerp_(grad, 1.0 - beta1)
        exp_avg_sq.lerp_(self._rotate(g, state).square(), 1.0 - beta2)
        first = self._rotate(as_matrix(exp_avg), state) / (1.0 - beta1**k)
        second = exp_avg_sq / (1.0 - beta2**k)
        direction = self._unrotate(first / (second.sqrt() + self.eps), state)
        if self.weight_decay != 0.0:
            param.mul_(1.0 - lr * self.weight_decay)
        param.add_(direction.reshape(param.shape), alpha=-lr)

        self._accumulate_(g, state)
        if k % self.precondition_frequency == 0:
            self._refresh_bases_(state)

    def _sides(self, state: dict[str, Tensor]) -> list[str]:
        return [side for side in ("left", "right") if f"{side}_stat" in state]

    def _first_bases_(self, state: dict[str, Tensor]) -> None:
        """The first bases: eigenvectors of each statistic, guarded (module docstring)."""
        sides = self._sides(state)
        for side, health in zip(sides, statistic_health([state[f"{side}_stat"] for side in sides])):
            stat, basis = state[f"{side}_stat"], state[f"{side}_basis"]
            if health == "non-finite":
                warn_kept(self.kind, "basis", tuple(stat.shape), "is not finite")
            elif health == "zero":
                basis.copy_(zero_eigenbasis(stat))
            else:
                try:
                    basis.copy_(eigenbasis(stat))
                except torch.linalg.LinAlgError as err:
                    warn_kept(self.kind, "basis", tuple(stat.shape), f"could not be decomposed ({err})")

    def _refresh_bases_(self, state: dict[str, Tensor]) -> None:
        """One power-iteration step per basis, v permuted alike; a non-finite or zero statistic keeps its basis."""
        exp_avg_sq = state["exp_avg_sq"]
        sides = self._sides(state)
        for side, health in zip(sides, statistic_health([state[f"{side}_stat"] for side in sides])):
            if health == "non-finite":
                warn_kept(self.kind, "basis", tuple(state[f"{side}_stat"].shape), "is not finite")
                continue
            if health == "zero":
                continue
            basis, order = refresh_basis(state[f"{side}_stat"], state[f"{side}_basis"])
            state[f"{side}_basis"].copy_(basis)
            exp_avg_sq.copy_(exp_avg_sq[order, :] if side == "left" else exp_avg_sq[:, order])
