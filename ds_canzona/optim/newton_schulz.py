"""Newton-Schulz orthogonalisation for Muon: coefficient sets, the standard and the Gram iteration.

Each step applies an odd quintic p(x) = a x + b x^3 + c x^5 to every singular value of X, written
with matrices as X <- (a I + b A + c A^2) X where A = X X^T. After the input is scaled so its
spectral norm is at most 1, a few steps push every singular value towards 1, so X approaches
U V^T of the input's SVD (the polar factor) without an SVD.

Why the numerics are acceptable: Muon needs a coarse polar factor, not a precise one. The classic
coefficients converge to singular values spread over roughly [0.7, 1.2] rather than to 1, and the
iteration is stable in bf16/fp16, so on GPUs it runs in half precision. The result is compared
against a float64 run of the same iteration in the tests, never against the exact SVD.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ds_canzona import kernels

Coefficients = tuple[float, float, float]

# Added to the Frobenius norm before dividing, so an all-zero update stays zero instead of NaN
# (the value DeepSpeed and torch.optim.Muon use).
NORMALIZE_EPS = 1e-7


@dataclass(frozen=True)
class CoefficientSet:
    """Per-step coefficients; a run longer than the list repeats the last entry.

    ``norm_scale`` > 1 divides the input by a little more than its norm, leaving room for the
    rounding of half precision (Polar Express's coefficients assume singular values <= 1).
    """

    name: str
    steps: tuple[Coefficients, ...]
    norm_scale: float = 1.0

    def for_steps(self, count: int) -> list[Coefficients]:
        return [self.steps[min(i, len(self.steps) - 1)] for i in range(count)]


# Keller Jordan's quintic, tuned for the largest slope at zero: fast, but it plateaus near 1.
QUINTIC = CoefficientSet("quintic", ((3.4445, -4.7750, 2.0315),))


def _polar_express() -> CoefficientSet:
    # Amsel, Persson, Musco, Gower, "The Polar Express" (arXiv:2505.16932), degree 5, for
    # singular values in [1e-3, 1]. Each polynomial is minimax-optimal on the interval the
    # previous ones leave; from the eighth step on the optimum no longer changes. All but the
    # last are divided by the safety factor 1.01 in the argument, p(x/1.01)-style, which keeps
    # rounding from pushing a value past the interval where the polynomial behaves.
    raw = (
        (8.28721201814563, -23.595886519098837, 17.300387312530933),
        (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
        (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
        (3.3184196573706015, -2.488488024314874, 0.51004894012372),
        (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
        (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
        (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
        (1.875, -1.25, 0.375),
    )
    safety = 1.01
    scaled = tuple((a / safety, b / safety**3, c / safety**5) for a, b, c in raw[:-1]) + (raw[-1],)
    return CoefficientSet("polar_express", scaled, norm_scale=safety)


POLAR_EXPRESS = _polar_express()

COEFFICIENT_SETS: dict[str, CoefficientSet] = {s.name: s for s in (QUINTIC, POLAR_EXPRESS)}

NS_METHODS = ("standard", "gram")


def coefficient_set(spec: str | Sequence[float]) -> CoefficientSet:
    """A named set, or one explicit (a, b, c) used at every step."""
    if isinstance(spec, str):
        if spec not in COEFFICIENT_SETS:
            known = ", ".join(map(repr, COEFFICIENT_SETS))
            raise ValueError(f"unknown coefficient set {spec!r}: must be one of {known}")
        return COEFFICIENT_SETS[spec]
    a, b, c = (float(v) for v in spec)
    return CoefficientSet("custom", ((a, b, c),))


# --------------------------------------------------------------------------- iterations


def normalize(x: Tensor, norm_scale: float = 1.0, eps: float = NORMALIZE_EPS) -> Tensor:
    """Divide each matrix by (a little more than) its Frobenius norm, a bound on its spectral norm."""
    return x / (x.norm(dim=(-2, -1), keepdim=True) * norm_scale + eps)


def newton_schulz_standard(x: Tensor, coefficients: Sequence[Coefficients]) -> Tensor:
    """Iterate X <- a X + (b A + c A^2) X on a wide (rows <= cols) normalised X, batched or not."""
    for a, b, c in coefficients:
        x = kernels.ns_step(x, a, b, c)
    return x


def _eye_like(r: Tensor) -> Tensor:
    return torch.eye(r.size(-1), dtype=r.dtype, device=r.device).expand_as(r)


def newton_schulz_gram(x: Tensor, coefficients: Sequence[Coefficients], restart_steps: Sequence[int] = (2,)) -> Tensor:
    """The same iteration as ``newton_schulz_standard``, run on the small Gram matrix R = X X^T.

    Every step's polynomial P = a I + b R + c R^2 is a polynomial in R, so it commutes with R:
    the new Gram matrix is P R P = P^2 R and the product Q = P_k ... P_1 accumulates the steps.
    X is touched again only at the end (Q X), so for an n x m input with n << m each step costs
    O(n^3) instead of O(n^2 m).

    Carrying R through P^2 R compounds rounding in half precision, so at each ``restart_steps``
    index the accumulated Q is folded into X and R is recomputed from X (one O(n^2 m) step).
    """
    restarts = set(restart_steps)
    r = kernels.xxt(x)
    q: Tensor | None = None  # None: no step accumulated since the last restart
    for i, (a, b, c) in enumerate(coefficients):
        if i in restarts and i > 0 and q is not None:
            x = q @ x
            r = kernels.xxt(x)
            q = None
        z = b * r + c * (r @ r)  # P = a I + z
        q = a * _eye_like(z) + z if q is None else a * q + z @ q
        is_last = i == len(coefficients) - 1
        if not is_last and (i + 1) not in restarts:
            pr = a * r + z @ r  # P R
            r = a * pr + z @ pr  # P (P R)
    return x if q is None else q @ x


def orthogonalize(g: Tensor, *, method: str = "standard", coefficients: CoefficientSet = QUINTIC, steps: int = 5,
                  dtype: torch.dtype | None = None, restart_steps: Sequence[int] = (2,)) -> Tensor:
    """Approximate polar factor of a matrix (or a batch of same-shape matrices, ``(..., m, n)``).

    The input is transposed to be wide (the iteration multiplies by X X^T, the smaller Gram),
    normalised in its own dtype (so an fp16 run cannot overflow on a large gradient), cast to
    ``dtype`` (default: the input's) and iterated. Gram runs only where it saves work (strictly
    wide after the transpose); a square matrix takes the standard iteration. The result has the
    input's shape and ``dtype``.
    """
    if g.dim() < 2:
        raise ValueError(f"orthogonalize needs a matrix or a batch of matrices, got shape {tuple(g.shape)}")
    if method not in NS_METHODS:
        raise ValueError(f"unknown Newton-Schulz method {method!r}: must be one of {', '.join(map(repr, NS_METHODS))}")
    tall = g.size(-2) > g.size(-1)
    x = g.mT if tall else g
    x = normalize(x, coefficients.norm_scale).to(dtype or g.dtype).contiguous()
    schedule = coefficients.for_steps(steps)
    if method == "gram" and x.size(-2) < x.size(-1):
        x = newton_schulz_gram(x, schedule, restart_steps)
    else:
        x = newton_schulz_standard(x, schedule)
    return x.mT if tall else x
