"""Shampoo's matrix kernels: the statistic update and the coupled Newton inverse root.

Both are symmetric products, so both run on the symmetric kernel of ``syrk.py`` (upper tiles
computed and mirrored, the ``beta C`` term fused in its epilogue); this module holds their wrappers
and torch references.

* ``sym_stat_update_(L, G, beta)``: in place ``L = beta L + (1 - beta) G Gᵀ`` (left statistic;
  pass ``G.mT`` for the right one, no copy). ``L`` may be fp32 while ``G`` is bf16/fp16.
* ``coupled_newton_step(X, M, root)``: one step of the coupled Newton iteration for ``A^(-1/root)``
  (Higham's coupled form; ``X → A^(-1/root)``, ``M = X^root A → I``). With ``Mp = ((root+1) I - M)
  / root`` it is ``X' = X Mp`` and ``M' = Mp^root M``. X, M and Mp are polynomials in A, so they are
  symmetric and commute, and every product is symmetric: ``P Q = P Qᵀ``, a symmetric product.
* ``inverse_root_newton(A, root)``: the iteration, from ``X = z^(1/root) I``, ``M = z A`` with
  ``z = (root+1) / (2 ||A||_F)``, until ``max |M - I| <= tol`` or it stops improving. The stopping
  test runs on the device; the host reads its flag every ``STOP_CHECK_EVERY`` steps.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ds_canzona.kernels._common import TileConfig
from ds_canzona.kernels.syrk import syrk, syrk_reference

__all__ = [
    "coupled_newton_step",
    "coupled_newton_step_reference",
    "inverse_root_newton",
    "inverse_root_newton_reference",
    "sym_stat_update_",
    "sym_stat_update_reference",
]


def sym_stat_update_(
    stat: torch.Tensor,
    g: torch.Tensor,
    beta: float,
    *,
    config: TileConfig | None = None,
    fp32_precision: str = "ieee",
) -> torch.Tensor:
    """In place ``stat = beta * stat + (1 - beta) * g @ g.mT`` with the symmetric kernel; returns stat.

    ``stat`` (..., m, m) symmetric, read on and above the diagonal only and fully rewritten;
    ``g`` (..., m, k) any strides (``g.mT`` gives the right statistic). fp32 accumulation.
    """
    if stat.shape[:-2] != g.shape[:-2] or stat.shape[-2:] != (g.shape[-2], g.shape[-2]):
        raise ValueError(f"stat must be (..., m, m) for g (..., m, k): stat {tuple(stat.shape)}, g {tuple(g.shape)}")
    return syrk(g, alpha=1.0 - beta, beta=beta, c=stat, out=stat, config=config, fp32_precision=fp32_precision)


def sym_stat_update_reference(stat: torch.Tensor, g: torch.Tensor, beta: float) -> torch.Tensor:
    """Plain torch, in place: ``stat = beta * stat + (1 - beta) * g g^T``; returns stat.

    The product is taken in the wider of the two dtypes (bf16 ``g`` into an fp32 ``stat`` is
    multiplied in fp32), as the kernel accumulates in fp32.
    """
    if stat.shape[:-2] != g.shape[:-2] or stat.shape[-2:] != (g.shape[-2], g.shape[-2]):
        raise ValueError(f"stat must be (..., m, m) for g (..., m, k): stat {tuple(stat.shape)}, g {tuple(g.shape)}")
    wide = g.to(torch.promote_types(g.dtype, stat.dtype))
    stat.mul_(beta).add_((wide @ wide.mT).to(stat.dtype), alpha=1.0 - beta)
    return stat


SymProduct = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _newton_step(x: torch.Tensor, m: torch.Tensor, root: int, product: SymProduct) -> tuple[torch.Tensor, torch.Tensor]:
    if root < 1:
        raise ValueError(f"Invalid root={root}. Must be a positive int.")
    eye = torch.eye(m.shape[-1], dtype=m.dtype, device=m.device)
    mp = m * (-1.0 / root) + eye * ((root + 1.0) / root)
    power = None  # Mp^root by binary powering; every factor is a power of Mp, so they commute
    base, e = mp, root
    while e:
        if e & 1:
            power = base if power is None else product(power, base)
        e >>= 1
        if e:
            base = product(base, base)
    return product(x, mp), product(power, m)


def coupled_newton_step(
    x: torch.Tensor,
    m: torch.Tensor,
    root: int,
    *,
    config: TileConfig | None = None,
    fp32_precision: str = "ieee",
) -> tuple[torch.Tensor, torch.Tensor]:
    """One coupled Newton step ``(X Mp, Mp^root M)``, every product on the symmetric kernel.

    ``x``, ``m``: (..., n, n) symmetric and commuting (as in the iteration), same dtype; float32
    recommended (inverse roots are ill-conditioned). A step costs ``floor(log2 root) + popcount(root)
    + 1`` symmetric products (4 for root 4, each at about half a dense matmul's cost).
    """

    def product(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        return syrk(p, None if q is p else q, config=config, fp32_precision=fp32_precision)

    return _newton_step(x, m, root, product)


def coupled_newton_step_reference(x: torch.Tensor, m: torch.Tensor, root: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch coupled Newton step, symmetrised like the kernel (from each product's upper triangle)."""

    def product(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        return syrk_reference(p, q)

    return _newton_step(x, m, root, product)


# Newton steps between two host reads of the stopping flag. A read waits for the device to finish
# everything queued, so the iteration reads only every few steps; at most this many minus one
# steps run past the stopping point, and their results are discarded (docs/KERNELS.md).
STOP_CHECK_EVERY = 4


def _inverse_root(
    a: torch.Tensor,
    root: int,
    step: Callable[[torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]],
    *,
    epsilon: float,
    max_iters: int,
    tol: float,
) -> torch.Tensor:
    if a.ndim < 2 or a.shape[-1] != a.shape[-2]:
        raise ValueError(f"a must be a square matrix or a stack of them, got shape {tuple(a.shape)}")
    n = a.shape[-1]
    eye = torch.eye(n, dtype=a.dtype, device=a.device)
    if epsilon:
        a = a + epsilon * eye
    z = (root + 1.0) / (2.0 * torch.linalg.matrix_norm(a, keepdim=True))
    x = z.pow(1.0 / root) * eye
    m = z * a
    # The answer and its error stay on the device. ``running`` turns false at the first step that
    # does not lower max |M - I| (the rounding floor, or divergence: that step is not kept) or
    # that reaches ``tol``; from then on ``best`` no longer changes. So the result is, bit for
    # bit, the iterate a loop reading the error after every step would stop at.
    best = x
    best_err = torch.full((), float("inf"), dtype=a.dtype, device=a.device)
    running = torch.ones((), dtype=torch.bool, device=a.device)
    for index in range(max_iters):
        x, m = step(x, m, root)
        err = (m - eye).abs().amax()
        improved = running & (err < best_err)
        best = torch.where(improved, x, best)
        best_err = torch.where(improved, err, best_err)
        running = improved & (err > tol)
        if (index + 1) % STOP_CHECK_EVERY == 0 and not bool(running):
            break
    return best


def inverse_root_newton(
    a: torch.Tensor,
    root: int,
    *,
    epsilon: float = 0.0,
    max_iters: int = 100,
    tol: float = 1e-6,
    config: TileConfig | None = None,
    fp32_precision: str = "ieee",
) -> torch.Tensor:
    """``(a + epsilon I)^(-1/root)`` for a symmetric positive definite matrix or stack, on the kernel.

    Stops when ``max |M - I| <= tol`` over the whole stack, after ``max_iters``, or when that
    error stops decreasing (the rounding floor of the dtype), returning the best iterate. The host
    reads whether to stop once every ``STOP_CHECK_EVERY`` steps, not after each one.
    """

    def step(x: torch.Tensor, m: torch.Tensor, r: int) -> tuple[torch.Tensor, torch.Tensor]:
        return coupled_newton_step(x, m, r, config=config, fp32_precision=fp32_precision)

    return _inverse_root(a, root, step, epsilon=epsilon, max_iters=max_iters, tol=tol)


def inverse_root_newton_reference(
    a: torch.Tensor, root: int, *, epsilon: float = 0.0, max_iters: int = 100, tol: float = 1e-6
) -> torch.Tensor:
    """The same iteration in plain torch (the CPU path and the oracle's twin)."""
    return _inverse_root(a, root, coupled_newton_step_reference, epsilon=epsilon, max_iters=max_iters, tol=tol)
