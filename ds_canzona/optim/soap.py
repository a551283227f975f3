"""SOAP's per-tensor rule: Adam run in the eigenbasis of Shampoo's statistics.

A tensor is viewed as a rows x cols matrix G (a 3-D stack as one G per expert, see "Expert
stacks" below). Each side no longer than ``max_precond_dim`` keeps
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

Expert stacks. Each expert e of a 3-D tensor ``[experts, rows, cols]`` (a fused MoE stack,
``base.matrix_stack_shape``) is its own G: its own statistics and bases (state keys
``left_stat.e``, ``left_basis.e``; a 2-D tensor's stay ``left_stat``, ``left_basis``), sides rotated
by its own shape, and its slice ``exp_avg_sq[e]`` of v (``[experts, rows, cols]``), so each
expert's update is bit for bit the one it would get as a parameter of its own. What stays per
tensor: ``step``, one host read for the guard of all its statistics, and the non-finite skip.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from ds_canzona import kernels
from ds_canzona.optim.base import (
    RuleBase,
    check_betas,
    check_float,
    check_int,
    expert_tags,
    matrix_stack_shape,
    matrix_views,
    new_step,
    register_rule,
    require_matrix,
    state_dtype,
    state_key,
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
        """Whether each matrix of ``shape`` (each expert of a 3-D stack) rotates its (left, right) side."""
        _, rows, cols = matrix_stack_shape(shape)
        return rows <= self.max_precond_dim, cols <= self.max_precond_dim

    def init_state(self, param: Tensor) -> dict[str, Tensor]:
        require_matrix(self.kind, param)
        self.check_shape(tuple(param.shape))
        dtype = state_dtype(param)
        count, rows, cols = matrix_stack_shape(param.shape)
        # v lives in the rotated basis of each matrix: (rows, cols), or one per expert of a stack.
        second_shape = (count, rows, cols) if param.dim() == 3 else (rows, cols)
        state = {
            "step": new_step(),
            "exp_avg": torch.zeros_like(param, dtype=dtype),
            "exp_avg_sq": torch.zeros(second_shape, dtype=dtype, device=param.device),
        }
        left, right = self.rotated_sides(tuple(param.shape))
        for tag in expert_tags(param.shape):
            for side, size, used in (("left", rows, left), ("right", cols, right)):
                if used:
                    state[state_key(f"{side}_stat", tag)] = torch.zeros(size, size, dtype=dtype, device=param.device)
                    state[state_key(f"{side}_basis", tag)] = torch.eye(size, dtype=dtype, device=param.device)
        return state

    def cost_options(self) -> dict[str, Any]:
        return {"max_preconditioner_dim": self.max_precond_dim, "precondition_frequency": self.precondition_frequency}

    # -- the update ---------------------------------------------------------------------------

    @staticmethod
    def _matrices(state: dict[str, Tensor], shape: tuple[int, ...]) -> list[dict[str, Tensor]]:
        """Per matrix of ``shape``, its statistics and bases by side ("left_stat", ...; a side left
        unrotated is absent), and its second moment ``exp_avg_sq`` (a view of the tensor's)."""
        out = []
        for tag, second in zip(expert_tags(shape), matrix_views(state["exp_avg_sq"])):
            matrix = {"exp_avg_sq": second}
            for name in ("left_stat", "left_basis", "right_stat", "right_basis"):
                if state_key(name, tag) in state:
                    matrix[name] = state[state_key(name, tag)]
            out.append(matrix)
        return out

    @staticmethod
    def _rotate(x: Tensor, matrix: dict[str, Tensor]) -> Tensor:
        if "left_basis" in matrix:
            x = matrix["left_basis"].mT @ x
        if "right_basis" in matrix:
            x = x @ matrix["right_basis"]
        return x

    @staticmethod
    def _unrotate(y: Tensor, matrix: dict[str, Tensor]) -> Tensor:
        if "left_basis" in matrix:
            y = matrix["left_basis"] @ y
        if "right_basis" in matrix:
            y = y @ matrix["right_basis"].mT
        return y

    def _accumulate_(self, g: Tensor, matrix: dict[str, Tensor]) -> None:
        assert self.shampoo_beta is not None  # resolved in __post_init__
        if "left_stat" in matrix:
            kernels.sym_stat_update_(matrix["left_stat"], g, self.shampoo_beta)
        if "right_stat" in matrix:
            kernels.sym_stat_update_(matrix["right_stat"], g.mT.contiguous(), self.shampoo_beta)

    def _update_one(self, param: Tensor, grad: Tensor, state: dict[str, Tensor], lr: float) -> None:
        state["step"] += 1
        calls = int(state["step"].item())
        matrices = self._matrices(state, tuple(param.shape))
        grads = [g.contiguous() for g in matrix_views(grad)]
        if calls == 1:
            for g, matrix in zip(grads, matrices):
                self._accumulate_(g, matrix)
            self._first_bases_(matrices)
            return

        k = calls - 1  # Adam's own step count: the first call did not step
        beta1, beta2 = self.betas
        exp_avg = state["exp_avg"]
        exp_avg.lerp_(grad, 1.0 - beta1)
        directions = []
        for g, m, matrix in zip(grads, matrix_views(exp_avg), matrices):
            exp_avg_sq = matrix["exp_avg_sq"]
            exp_avg_sq.lerp_(self._rotate(g, matrix).square(), 1.0 - beta2)
            first = self._rotate(m, matrix) / (1.0 - beta1**k)
            second = exp_avg_sq / (1.0 - beta2**k)
            directions.append(self._unrotate(first / (second.sqrt() + self.eps), matrix))
        direction = directions[0] if len(directions) == 1 else torch.stack(directions)
        if self.weight_decay != 0.0:
            param.mul_(1.0 - lr * self.weight_decay)
        param.add_(direction.reshape(param.shape), alpha=-lr)

        for g, matrix in zip(grads, matrices):
            self._accumulate_(g, matrix)
        if k % self.precondition_frequency == 0:
            self._refresh_bases_(matrices)

    @staticmethod
    def _sides(matrices: list[dict[str, Tensor]]) -> list[tuple[dict[str, Tensor], str]]:
        """(matrix, side) of every rotated side of every matrix of one tensor."""
        return [(matrix, side) for matrix in matrices for side in ("left", "right") if f"{side}_stat" in matrix]

    def _first_bases_(self, matrices: list[dict[str, Tensor]]) -> None:
        """The first bases: eigenvectors of each statistic, guarded (module docstring)."""
        sides = self._sides(matrices)
        for (matrix, side), health in zip(sides, statistic_health([m[f"{side}_stat"] for m, side in sides])):
            stat, basis = matrix[f"{side}_stat"], matrix[f"{side}_basis"]
            if health == "non-finite":
                warn_kept(self.kind, "basis", tuple(stat.shape), "is not finite")
            elif health == "zero":
                basis.copy_(zero_eigenbasis(stat))
            else:
                try:
                    basis.copy_(eigenbasis(stat))
                except torch.linalg.LinAlgError as err:
                    warn_kept(self.kind, "basis", tuple(stat.shape), f"could not be decomposed ({err})")

    def _refresh_bases_(self, matrices: list[dict[str, Tensor]]) -> None:
        """One power-iteration step per basis, v permuted alike; a non-finite or zero statistic keeps its basis."""
        sides = self._sides(matrices)
        for (matrix, side), health in zip(sides, statistic_health([m[f"{side}_stat"] for m, side in sides])):
            if health == "non-finite":
                warn_kept(self.kind, "basis", tuple(matrix[f"{side}_stat"].shape), "is not finite")
                continue
            if health == "zero":
                continue
            exp_avg_sq = matrix["exp_avg_sq"]
            basis, order = refresh_basis(matrix[f"{side}_stat"], matrix[f"{side}_basis"])
            matrix[f"{side}_basis"].copy_(basis)
            exp_avg_sq.copy_(exp_avg_sq[order, :] if side == "left" else exp_avg_sq[:, order])
