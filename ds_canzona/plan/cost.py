"""Cost models: how much optimizer work one tensor is.

A cost model is a small object with a ``name`` and one method, ``cost(spec) -> float``. Two kinds:

- ``numel``: the paper's linear model, W(p) = numel(p).
- ``flops``: floating-point operations of one optimizer step on that tensor, counted from the
  algorithm (matrix products as 2·m·n·k, elementwise ops one flop per element and operation).
  Matrices pay the matrix optimizer (Muon, Shampoo or SOAP); other tensors pay AdamW.

The FLOP counts are exact for the algorithms as written in each docstring; what they do not model
is kernel efficiency (a small matrix runs further from peak than a big one), which matters little
for balance, since it is the big matrices that set the busiest rank.

Matrices with more than two dims (convolutions) are flattened to ``(shape[0], prod(shape[1:]))``,
as Muon does. A tensor-parallel shard costs its full matrix's work divided by ``tp_size``: its TP
group computes the full update once, on one host rank, so on average each member carries 1/tp_size.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, runtime_checkable

from .specs import ParamSpec, PlanError

__all__ = [
    "ADAMW_FLOPS_PER_ELEMENT",
    "CostModel",
    "FlopsCost",
    "NumelCost",
    "adamw_flops",
    "cost_model",
    "muon_flops",
    "newton_schulz_flops",
    "shampoo_flops",
    "soap_flops",
]

# One AdamW step per element: m = b1*m + (1-b1)*g (3), v = b2*v + (1-b2)*g*g (4), two bias
# corrections (2), sqrt (1), + eps (1), divide (1), p -= lr*update (2), decoupled decay p *= 1-lr*wd (1).
ADAMW_FLOPS_PER_ELEMENT = 15

# Muon's elementwise work per element besides Newton-Schulz: momentum lerp (3), Nesterov lerp (3),
# Frobenius normalisation (square-add 2, divide 1), decay and scaled update (3).
_MUON_ELEMENTWISE_FLOPS = 12

# Symmetric eigendecomposition with eigenvectors (tridiagonalisation plus implicit QR), about
# 9·k^3 flops (Golub & Van Loan, Matrix Computations, Table 8.3.1 gives ~9n^3 for Q and Lambda).
_EIGH_FLOPS_COEFF = 9.0
# Householder QR of a k x k matrix: (4/3)·k^3.
_QR_FLOPS_COEFF = 4.0 / 3.0


@runtime_checkable
class CostModel(Protocol):
    """What the planners need: a name for the plan, and a cost per tensor."""

    @property
    def name(self) -> str: ...

    @property
    def label(self) -> str: ...

    def cost(self, spec: ParamSpec) -> float: ...


def adamw_flops(numel: int) -> float:
    """AdamW step on ``numel`` elements: ``ADAMW_FLOPS_PER_ELEMENT · numel`` (15 flops per element)."""
    return float(ADAMW_FLOPS_PER_ELEMENT * numel)


def newton_schulz_flops(rows: int, cols: int, *, steps: int = 5, method: str = "gram") -> float:
    """Flops of ``steps`` quintic Newton-Schulz iterations on a ``rows x cols`` matrix.

    Let n = min(rows, cols) and m = max(rows, cols); the iteration runs on the n x m orientation.

    ``standard``, per step: A = X Xᵀ (2n²m), B = bA + cA² (2n³ + 3n²), X = aX + BX (2n²m + 2nm):
        steps · (4n²m + 2n³ + 3n² + 2nm).

    ``gram`` (iterates on the n x n Gram matrix R = X Xᵀ and applies the accumulated polynomial
    Q to X at the end, with a restart at step 2 that re-forms X = QX and R = XXᵀ for stability):
        R = XXᵀ (2n²m), then per step Z = bR + cR² (2n³ + 3n²); Q = Z + aI on the first step after
        a (re)start (n), else Q = aQ + ZQ (2n³ + 2n²); R = a(aR + ZR) + Z(aR + ZR) (4n³ + 4n²)
        except on the last step and just before the restart; the restart costs QX and XXᵀ (4n²m);
        the final X = QX (2n²m). For 5 steps: 8n²m + 28n³ + O(n²), against 20n²m + 10n³ for
        ``standard``: about 1.6x fewer flops at the aspect ratio 5 of an MLP weight.
        A square matrix (m == n) gains nothing from the Gram form and runs ``standard``.
    """
    if method not in ("gram", "standard"):
        raise PlanError(f"Invalid ns_method={method!r}: must be 'gram' or 'standard'.")
    n, m = min(rows, cols), max(rows, cols)
    if method == "standard" or m == n:
        return float(steps * (4 * n * n * m + 2 * n**3 + 3 * n * n + 2 * n * m))
    restart_at = 2
    flops = 2 * n * n * m
    fresh_q = True
    for step in range(steps):
        if step == restart_at:
            flops += 4 * n * n * m
            fresh_q = True
        flops += 2 * n**3 + 3 * n * n
        if fresh_q:
            flops += n
            fresh_q = False
        else:
            flops += 2 * n**3 + 2 * n * n
        if step < steps - 1 and step + 1 != restart_at:
            flops += 4 * n**3 + 4 * n * n
    flops += 2 * n * n * m
    return float(flops)


def muon_flops(shape: tuple[int, ...], *, ns_steps: int = 5, ns_method: str = "gram") -> float:
    """One Muon step on a matrix: Newton-Schulz plus 12 elementwise flops per element.

    The elementwise part is the momentum and Nesterov lerps (6), the Frobenius normalisation
    before the iteration (3) and the decayed, scaled update (3); see :func:`newton_schulz_flops`.
    """
    rows, cols = _as_matrix(shape)
    return newton_schulz_flops(rows, cols, steps=ns_steps, method=ns_method) + _MUON_ELEMENTWISE_FLOPS * rows * cols


def shampoo_flops(
    shape: tuple[int, ...], *, precondition_frequency: int = 100, max_preconditioner_dim: int = 1024
) -> float:
    """One Shampoo step on a matrix, with the inverse roots amortised over their refresh interval.

    The matrix is cut into blocks of at most ``max_preconditioner_dim`` along each dim (as
    distributed Shampoo does); each a x b block keeps a left (a x a) and right (b x b) factor:

    - statistics L += GGᵀ, R += GᵀG, as EMAs: 2a²b + 3a² + 2ab² + 3b²;
    - preconditioning L^(-1/4) G R^(-1/4): 2a²b + 2ab²;
    - inverse 4th roots by eigendecomposition, every ``precondition_frequency`` steps, per factor of
      size k: 9k³ (eigh) + 2k³ + k² (Q·diag·Qᵀ), i.e. (11(a³ + b³) + a² + b²) / frequency;
    - Adam grafting and the update: 15 flops per element (AdamW's count) plus 5 for the two
      Frobenius norms and the rescale.
    """
    rows, cols = _as_matrix(shape)
    flops = 0.0
    for a, a_count in _blocks(rows, max_preconditioner_dim):
        for b, b_count in _blocks(cols, max_preconditioner_dim):
            per_block = 2 * a * a * b + 3 * a * a + 2 * a * b * b + 3 * b * b
            per_block += 2 * a * a * b + 2 * a * b * b
            per_block += (11 * (a**3 + b**3) + a * a + b * b) / precondition_frequency
            per_block += (ADAMW_FLOPS_PER_ELEMENT + 5) * a * b
            flops += a_count * b_count * per_block
    return flops


def soap_flops(
    shape: tuple[int, ...], *, precondition_frequency: int = 10, max_preconditioner_dim: int = 10000
) -> float:
    """One SOAP step on a matrix (Adam in the eigenbasis of Shampoo's factors), amortised.

    Following the SOAP reference, a side longer than ``max_preconditioner_dim`` is not rotated
    (its basis is the identity and it keeps no factor). For rotated sides of size a (left) and b
    (right), one rotation Q_Lᵀ X Q_R costs 2a²b + 2ab² (only the rotated terms):

    - statistics L += GGᵀ, R += GᵀG, as EMAs: 2a²b + 3a² + 2ab² + 3b²;
    - three rotations: the gradient and the first moment into the basis, the update back out;
    - Adam in the rotated basis: 15 flops per element;
    - eigenbasis refresh every ``precondition_frequency`` steps, per factor of size k: one power
      step LQ (2k³), the eigenvalue estimate diag(Qᵀ(LQ)) (2k³) and a QR ((4/3)k³); plus rotating
      the second moment to the new order (a·b), i.e. ((16/3)(a³ + b³) + ab) / frequency.
    """
    rows, cols = _as_matrix(shape)
    a = rows if rows <= max_preconditioner_dim else 0
    b = cols if cols <= max_preconditioner_dim else 0
    rotation = 2 * a * a * cols + 2 * rows * b * b
    statistics = 2 * a * a * cols + 3 * a * a + 2 * rows * b * b + 3 * b * b
    refresh = ((4.0 + _QR_FLOPS_COEFF) * (a**3 + b**3) + rows * cols) / precondition_frequency
    return float(statistics + 3 * rotation + ADAMW_FLOPS_PER_ELEMENT * rows * cols + refresh)


@dataclass(frozen=True, kw_only=True)
class NumelCost:
    """The paper's cost model: W(p) = numel(p), the same for matrices and the rest."""

    name: ClassVar[str] = "numel"

    @property
    def label(self) -> str:
        return "numel"

    def cost(self, spec: ParamSpec) -> float:
        return float(spec.numel)


_OPTIMIZER_DEFAULTS: dict[str, dict[str, Any]] = {
    "muon": {"ns_steps": 5, "ns_method": "gram"},
    "shampoo": {"precondition_frequency": 100, "max_preconditioner_dim": 1024},
    "soap": {"precondition_frequency": 10, "max_preconditioner_dim": 10000},
}
_OPTIMIZER_FLOPS: dict[str, Callable[..., float]] = {"muon": muon_flops, "shampoo": shampoo_flops, "soap": soap_flops}


@dataclass(frozen=True, kw_only=True)
class FlopsCost:
    """Flops of one step: the matrix optimizer's for matrices, AdamW's for the rest."""

    optimizer: str = "muon"
    options: tuple[tuple[str, Any], ...] = ()
    name: ClassVar[str] = "flops"

    def __post_init__(self) -> None:
        if self.optimizer not in _OPTIMIZER_DEFAULTS:
            raise PlanError(f"Invalid optimizer={self.optimizer!r}: must be one of {sorted(_OPTIMIZER_DEFAULTS)}.")
        allowed = _OPTIMIZER_DEFAULTS[self.optimizer]
        merged = dict(allowed)
        for key, value in self.options:
            if key not in allowed:
                raise PlanError(
                    f"Invalid option {key!r} for the {self.optimizer} cost model: expected one of {sorted(allowed)}."
                )
            merged[key] = value
        for key in ("ns_steps", "precondition_frequency", "max_preconditioner_dim"):
            if key in merged and (not isinstance(merged[key], int) or merged[key] < 1):
                raise PlanError(f"Invalid {key}={merged[key]!r}: must be an int >= 1.")
        if "ns_method" in merged and merged["ns_method"] not in ("gram", "standard"):
            raise PlanError(f"Invalid ns_method={merged['ns_method']!r}: must be 'gram' or 'standard'.")
        object.__setattr__(self, "options", tuple(sorted(merged.items())))

    @property
    def label(self) -> str:
        settings = ",".join(f"{key}={value}" for key, value in self.options)
        return f"flops:{self.optimizer}({settings})"

    def cost(self, spec: ParamSpec) -> float:
        if not spec.matrix:
            return adamw_flops(spec.numel)
        flops = _OPTIMIZER_FLOPS[self.optimizer](spec.full_shape, **dict(self.options))
        return flops / spec.tp_size


def cost_model(name: str = "flops", optimizer: str = "muon", **options: Any) -> CostModel:
    """Build a cost model: ``numel``, or ``flops`` of ``optimizer`` with its options.

    Options: Muon ``ns_steps`` (5), ``ns_method`` ("gram" or "standard"); Shampoo and SOAP
    ``precondition_frequency`` (100 / 10) and ``max_preconditioner_dim`` (1024 / 10000).
    """
    if name == "numel":
        if options:
            raise PlanError(f"The numel cost model takes no options, got {sorted(options)}.")
        return NumelCost()
    if name == "flops":
        return FlopsCost(optimizer=optimizer, options=tuple(sorted(options.items())))
    raise PlanError(f"Invalid cost model name={name!r}: must be 'numel' or 'flops'.")


def _as_matrix(shape: tuple[int, ...]) -> tuple[int, int]:
    if len(shape) < 2:
        raise PlanError(f"A matrix optimizer needs a tensor with 2 or more dims, got shape {shape}.")
    return shape[0], math.prod(shape[1:])


def _blocks(size: int, max_dim: int) -> list[tuple[int, int]]:
    """(block size, how many) pairs covering ``size`` in blocks of at most ``max_dim``."""
    full, rest = divmod(size, max_dim)
    blocks = [(max_dim, full)] if full else []
    if rest:
        blocks.append((rest, 1))
    return blocks
