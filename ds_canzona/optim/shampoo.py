"""Shampoo's per-tensor rule: Kronecker-factored preconditioning grafted onto AdamW's step size.

A tensor is viewed as a rows x cols matrix (a 3-D stack ``[experts, rows, cols]`` as one such
matrix per expert, see "Expert stacks" below) and cut into blocks of at most
``max_preconditioner_dim`` along each side; every block b keeps its own statistics

    L_b <- beta2 * L_b + (1 - beta2) * G_b G_b^T        R_b <- beta2 * R_b + (1 - beta2) * G_b^T G_b

(``beta2 == 1``: plain sums, L_b <- L_b + G_b G_b^T). Every step also advances AdamW's moments
m, v of the whole tensor (m doubles as Shampoo's momentum). At step t:

    before ``start_preconditioning_step``:  D = A := m_hat / (sqrt(v_hat) + graft_eps)   (AdamW alone)
    from it on:  S_b = (L_b + eps I)^(-1/4) m_hat_b (R_b + eps I)^(-1/4)
                 D_b = S_b * ||A_b|| / ||S_b||          (the step length of AdamW, per block)
    W <- W * (1 - lr * weight_decay);  W <- W - lr * D

The inverse 4th roots are recomputed at the start step and every ``precondition_frequency``
steps after it: by an eigendecomposition (``inverse_root='eigh'``, in ``root_dtype``) or by a
coupled Newton iteration (``inverse_root='newton'``, ``kernels.inverse_root_newton``: matmuls
only). The statistics are not bias-corrected: grafting resets the step length, so their scale only
matters against ``epsilon``.

Guarded refresh. Before the roots of a tensor are refreshed, one host read of each statistic's
largest magnitude sorts them: a non-finite statistic keeps the root it had (the warning says so),
an all-zero one (a tensor whose gradient never arrives) takes the closed form eps^(-1/4) I, the
others are decomposed. cuSOLVER's float32 ``eigh`` has crashed on low-rank statistics with an
illegal memory access that poisons the CUDA context (pytorch#94772, #105359; float64 and the CPU
succeeded on every reported matrix), so a retry after the crash cannot be relied on: on CUDA the
decomposition runs in float64 from the start, and a float64 failure there is retried on the CPU.
On the CPU a float32 failure (LAPACK did not converge) is retried in float64. When every attempt
fails, the statistic keeps its root and a warning says so. Healthy CPU inputs take exactly the
path they always did.

Expert stacks. Each expert e of a 3-D tensor ``[experts, rows, cols]`` (a fused MoE stack,
``base.matrix_stack_shape``) is blocked, preconditioned and grafted exactly as a 2-D tensor of its
shape, with its own statistics and roots (state keys ``left_stat.e.i.j``; a 2-D tensor's stay
``left_stat.i.j``); AdamW's moments and ``step`` are the stack's, elementwise, so each expert's
update is bit for bit the one it would get as a parameter of its own. What stays per tensor: one
host read for the refresh guard of all its statistics, and the non-finite skip (a NaN in one
expert's gradient skips the whole stack's step, as for any tensor).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from ds_canzona import kernels
from ds_canzona.optim.adamw import adam_direction_
from ds_canzona.optim.base import (
    RuleBase,
    check_betas,
    check_choice,
    check_float,
    check_int,
    expert_tags,
    matrix_stack_shape,
    matrix_views,
    new_step,
    register_rule,
    require_matrix,
    state_dtype,
)

INVERSE_ROOT_METHODS = ("eigh", "newton")
ROOT_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float64": torch.float64}
ROOT = 4  # Shampoo for matrices: each side gets the inverse 4th root


def block_bounds(size: int, block: int) -> list[tuple[int, int]]:
    """[start, end) of the consecutive blocks of at most ``block`` along a dimension of ``size``."""
    return [(start, min(start + block, size)) for start in range(0, size, block)]


logger = logging.getLogger("ds_canzona")


def statistic_health(stats: Sequence[Tensor]) -> list[str]:
    """'finite', 'zero' or 'non-finite' for each statistic, from one host read for all of them.

    The largest magnitude tells all three: NaN or inf when something is not finite, 0 when every
    entry is zero.
    """
    if not stats:
        return []
    peaks = torch.stack([s.abs().amax().to(torch.float64) for s in stats]).tolist()
    return ["non-finite" if not math.isfinite(p) else "zero" if p == 0.0 else "finite" for p in peaks]


def eigh_attempts(device_type: str, dtype: torch.dtype) -> list[tuple[torch.dtype, str]]:
    """(dtype, 'here' | 'cpu') of each decomposition to try in turn, the first that succeeds wins.

    On CUDA float64 comes first: a failed float32 cuSOLVER call can leave the context unusable.
    """
    if device_type == "cuda":
        return [(torch.float64, "here"), (torch.float64, "cpu")]
    if dtype == torch.float64:
        return [(torch.float64, "here")]
    return [(dtype, "here"), (torch.float64, "here")]


def symmetric_eigh(stat: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(eigenvalues ascending, eigenvectors) of the symmetrised ``stat``, in ``dtype`` or wider.

    The attempts of ``eigh_attempts``; the result is on ``stat``'s device, in the dtype of the
    attempt that succeeded. Raises the last ``torch.linalg.LinAlgError`` when every attempt fails.
    """
    error: torch.linalg.LinAlgError | None = None
    for work_dtype, where in eigh_attempts(stat.device.type, dtype):
        matrix = stat.to(work_dtype) if where == "here" else stat.to("cpu", work_dtype)
        matrix = (matrix + matrix.mT) / 2  # symmetric to the last bit, as eigh assumes
        try:
            values, vectors = torch.linalg.eigh(matrix)
        except torch.linalg.LinAlgError as err:
            error = err
            continue
        return values.to(stat.device), vectors.to(stat.device)
    assert error is not None
    raise error


def inverse_root_eigh(stat: Tensor, root: int, epsilon: float, dtype: torch.dtype) -> Tensor:
    """(stat + epsilon I)^(-1/root) by a symmetric eigendecomposition, computed in ``dtype`` (or wider).

    Eigenvalues are clamped at zero first: rounding makes those of a singular PSD matrix
    slightly negative, and only ``epsilon`` should decide how far a null direction is boosted.
    Raises ``torch.linalg.LinAlgError`` when no decomposition succeeded (``symmetric_eigh``).
    """
    values, vectors = symmetric_eigh(stat, dtype)
    scaled = (values.clamp_min(0.0) + epsilon).pow(-1.0 / root)
    return ((vectors * scaled.unsqueeze(-2)) @ vectors.mT).to(stat.dtype)


def zero_inverse_root(stat: Tensor, root: int, epsilon: float, dtype: torch.dtype) -> Tensor:
    """(0 + epsilon I)^(-1/root) for an all-zero ``stat``: what the decomposition gives, in closed form."""
    values = torch.zeros(stat.shape[-1], dtype=dtype, device=stat.device)
    return torch.diag_embed((values.clamp_min(0.0) + epsilon).pow(-1.0 / root)).to(stat.dtype)


_warned: set[str] = set()


def warn_kept(kind: str, what: str, shape: tuple[int, ...], why: str) -> None:
    """Say that a statistic keeps its last root or basis: a warning the first time per reason, then DEBUG."""
    message = f"{kind}: a {'x'.join(map(str, shape))} statistic {why}; its {what} is kept from the last refresh"
    if why not in _warned:
        _warned.add(why)
        logger.warning("%s (further cases at DEBUG on the 'ds_canzona' logger)", message)
    else:
        logger.debug(message)


@register_rule
@dataclass(frozen=True, kw_only=True)
class ShampooRule(RuleBase):
    """Hyper-parameters of the Shampoo kind."""

    kind: ClassVar[str] = "shampoo"

    betas: tuple[float, float] = (0.9, 1.0)
    epsilon: float = 1e-12
    weight_decay: float = 0.0
    precondition_frequency: int = 10
    start_preconditioning_step: int | None = None
    max_preconditioner_dim: int = 1024
    inverse_root: str = "eigh"
    root_dtype: str = "float32"
    graft_beta2: float = 0.999
    graft_eps: float = 1e-8

    def __post_init__(self) -> None:
        kind = self.kind
        object.__setattr__(self, "betas", check_betas(kind, "betas", self.betas, allow_one=(False, True)))
        if self.betas[1] == 0.0:
            raise ValueError(f"Invalid {kind} betas={self.betas!r}: betas[1] must be > 0 (1.0 sums the statistics)")
        check_float(kind, "epsilon", self.epsilon, low=0.0, low_open=True)
        check_float(kind, "weight_decay", self.weight_decay, low=0.0)
        check_int(kind, "precondition_frequency", self.precondition_frequency, low=1)
        if self.start_preconditioning_step is None:
            object.__setattr__(self, "start_preconditioning_step", self.precondition_frequency)
        check_int(kind, "start_preconditioning_step", self.start_preconditioning_step, low=1)
        check_int(kind, "max_preconditioner_dim", self.max_preconditioner_dim, low=1)
        check_choice(kind, "inverse_root", self.inverse_root, INVERSE_ROOT_METHODS)
        check_choice(kind, "root_dtype", self.root_dtype, ROOT_DTYPES)
        check_float(kind, "graft_beta2", self.graft_beta2, low=0.0, high=1.0, high_open=True)
        check_float(kind, "graft_eps", self.graft_eps, low=0.0)

    def blocks(self, shape: tuple[int, ...]) -> list[tuple[str, int, slice, slice]]:
        """(suffix, matrix, row slice, col slice) of every block, matrix by matrix, each row-major.

        The matrices are ``matrix_stack_shape``'s: each expert of a 3-D stack is blocked on its own
        exactly as a 2-D tensor of its shape, and its suffixes name it first (``"e.i.j"``); the one
        matrix of any other tensor keeps the suffixes ``"i.j"`` its checkpoints hold.
        """
        _, rows, cols = matrix_stack_shape(shape)
        out = []
        for matrix, tag in enumerate(expert_tags(shape)):
            prefix = "" if tag is None else f"{tag}."
            for i, (r0, r1) in enumerate(block_bounds(rows, self.max_preconditioner_dim)):
                for j, (c0, c1) in enumerate(block_bounds(cols, self.max_preconditioner_dim)):
                    out.append((f"{prefix}{i}.{j}", matrix, slice(r0, r1), slice(c0, c1)))
        return out

    def init_state(self, param: Tensor) -> dict[str, Tensor]:
        require_matrix(self.kind, param)
        self.check_shape(tuple(param.shape))
        dtype = state_dtype(param)
        state = {
            "step": new_step(),
            "exp_avg": torch.zeros_like(param, dtype=dtype),
            "exp_avg_sq": torch.zeros_like(param, dtype=dtype),
        }
        for suffix, _, rows, cols in self.blocks(tuple(param.shape)):
            n_rows, n_cols = rows.stop - rows.start, cols.stop - cols.start
            eye = lambda n: torch.eye(n, dtype=dtype, device=param.device)  # noqa: E731
            state[f"left_stat.{suffix}"] = torch.zeros(n_rows, n_rows, dtype=dtype, device=param.device)
            state[f"right_stat.{suffix}"] = torch.zeros(n_cols, n_cols, dtype=dtype, device=param.device)
            state[f"left_root.{suffix}"] = eye(n_rows)
            state[f"right_root.{suffix}"] = eye(n_cols)
        return state

    def cost_options(self) -> dict[str, Any]:
        return {"max_preconditioner_dim": self.max_preconditioner_dim,
                "precondition_frequency": self.precondition_frequency}

    # -- the update ---------------------------------------------------------------------------

    def _accumulate_(self, stat: Tensor, g: Tensor) -> None:
        """stat <- beta2 stat + (1 - beta2) g g^T, or stat + g g^T when beta2 is 1."""
        beta2 = self.betas[1]
        if beta2 == 1.0:
            stat.add_(kernels.xxt(g))
        else:
            kernels.sym_stat_update_(stat, g, beta2)

    def _inverse_root(self, stat: Tensor) -> Tensor:
        if self.inverse_root == "newton":
            # Coupled Newton (matmuls only): stops at max |M - I| <= 1e-6, after 100 steps, or at
            # the rounding floor, returning the best iterate (see docs/KERNELS.md).
            return kernels.inverse_root_newton(stat, ROOT, epsilon=self.epsilon)
        return inverse_root_eigh(stat, ROOT, self.epsilon, ROOT_DTYPES[self.root_dtype])

    def _refresh_roots_(self, state: dict[str, Tensor], suffixes: list[str]) -> None:
        """Recompute the roots of every block, guarded (module docstring): one host read per tensor."""
        names = [f"{side}_stat.{suffix}" for suffix in suffixes for side in ("left", "right")]
        for name, health in zip(names, statistic_health([state[n] for n in names])):
            stat, root = state[name], state[name.replace("_stat.", "_root.")]
            if health == "non-finite":
                warn_kept(self.kind, "inverse root", tuple(stat.shape), "is not finite")
            elif health == "zero":
                root.copy_(zero_inverse_root(stat, ROOT, self.epsilon, ROOT_DTYPES[self.root_dtype]))
            else:
                try:
                    root.copy_(self._inverse_root(stat))
                except torch.linalg.LinAlgError as err:
                    warn_kept(self.kind, "inverse root", tuple(stat.shape), f"could not be decomposed ({err})")

    def _update_one(self, param: Tensor, grad: Tensor, state: dict[str, Tensor], lr: float) -> None:
        state["step"] += 1
        step = int(state["step"].item())
        start = self.start_preconditioning_step
        assert start is not None  # resolved in __post_init__
        refresh = step >= start and (step - start) % self.precondition_frequency == 0
        adam = adam_direction_(grad, state["exp_avg"], state["exp_avg_sq"], step, (self.betas[0], self.graft_beta2),
                               self.graft_eps)
        momentum = state["exp_avg"] / (1.0 - self.betas[0]**step)  # Shampoo preconditions m_hat

        # Per matrix (each expert of a 3-D stack, else the tensor's one matrix), per block.
        grads, moments, grafts = matrix_views(grad), matrix_views(momentum), matrix_views(adam)
        blocks = self.blocks(tuple(param.shape))
        for suffix, matrix, rows, cols in blocks:
            g_block = grads[matrix][rows, cols].contiguous()
            self._accumulate_(state[f"left_stat.{suffix}"], g_block)
            self._accumulate_(state[f"right_stat.{suffix}"], g_block.mT.contiguous())
        if refresh:
            self._refresh_roots_(state, [suffix for suffix, _, _, _ in blocks])
        direction = adam
        if step >= start:
            # Contiguous, so that its matrix views are views and the writes below land in it.
            direction = torch.empty(param.shape, dtype=adam.dtype, device=adam.device)
            targets = matrix_views(direction)
            for suffix, matrix, rows, cols in blocks:
                shampoo = state[f"left_root.{suffix}"] @ moments[matrix][rows, cols] @ state[f"right_root.{suffix}"]
                graft = grafts[matrix][rows, cols].norm() / shampoo.norm().clamp_min(torch.finfo(shampoo.dtype).tiny)
                targets[matrix][rows, cols] = shampoo * graft
        if self.weight_decay != 0.0:
            param.mul_(1.0 - lr * self.weight_decay)
        param.add_(direction.reshape(param.shape), alpha=-lr)
