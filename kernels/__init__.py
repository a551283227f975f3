"""Matrix kernels for the per-tensor optimizers (installed as ``ds_canzona.kernels``).

One module per kernel family, each holding the Triton kernel, its wrapper and a plain-torch
reference of the same function:

* ``syrk``: ``alpha A Bᵀ + beta C`` with a symmetric result, upper tiles computed and mirrored;
* ``newton_schulz``: one fused Newton-Schulz step (Muon);
* ``shampoo``: the statistic update and the coupled Newton inverse root (on the syrk kernel).

The functions below pick the implementation per call through ``dispatch`` (``auto``: Triton on
CUDA, the torch reference elsewhere; ``set_backend`` or ``DS_CANZONA_KERNELS`` override it).
Triton is optional: without it ``TRITON_AVAILABLE`` is False and the references run.
See docs/KERNELS.md for the contracts and the tolerances.
"""

from __future__ import annotations

import torch

from ds_canzona.kernels._common import TRITON_AVAILABLE, TileConfig
from ds_canzona.kernels.dispatch import choose, get_backend, set_backend
from ds_canzona.kernels.newton_schulz import ns_step_kernel, ns_step_reference
from ds_canzona.kernels.newton_schulz import ns_step as _ns_step_triton
from ds_canzona.kernels.shampoo import (
    coupled_newton_step_reference,
    inverse_root_newton_reference,
    sym_stat_update_reference,
)
from ds_canzona.kernels.shampoo import coupled_newton_step as _coupled_newton_step_triton
from ds_canzona.kernels.shampoo import inverse_root_newton as _inverse_root_newton_triton
from ds_canzona.kernels.shampoo import sym_stat_update_ as _sym_stat_update_triton
from ds_canzona.kernels.syrk import syrk_kernel, syrk_reference
from ds_canzona.kernels.syrk import syrk as _syrk_triton

__all__ = [
    "TRITON_AVAILABLE",
    "TileConfig",
    "coupled_newton_step",
    "coupled_newton_step_reference",
    "get_backend",
    "inverse_root_newton",
    "inverse_root_newton_reference",
    "ns_step",
    "ns_step_reference",
    "set_backend",
    "sym_matmul",
    "sym_stat_update_",
    "sym_stat_update_reference",
    "xxt",
    "xxt_reference",
]


def xxt_reference(x: torch.Tensor) -> torch.Tensor:
    """X @ X^T for a matrix or a stack (..., m, n) -> (..., m, m), in x's dtype, exactly symmetric."""
    return syrk_reference(x)


def xxt(x: torch.Tensor, *, out: torch.Tensor | None = None, config: TileConfig | None = None) -> torch.Tensor:
    """X @ X^T for a matrix or a stack (..., m, n) -> (..., m, m) in x's dtype (or out's).

    The kernel computes the upper tiles only and mirrors them (fp32 accumulation); the result is
    exactly symmetric on both paths.
    """
    if choose("xxt", syrk_kernel, x, *(() if out is None else (out,)), square=x.shape[-2] if x.ndim >= 2 else None):
        return _syrk_triton(x, out=out, config=config)
    return syrk_reference(x, out=out)


def sym_matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    alpha: float = 1.0,
    beta: float = 0.0,
    c: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    config: TileConfig | None = None,
) -> torch.Tensor:
    """``alpha * a @ b.mT + beta * c`` whose result the caller knows to be symmetric.

    For symmetric commuting ``a`` and ``b`` (polynomials in one matrix) this is ``alpha a b + beta c``.
    Only the upper tiles are computed; ``c`` is read on and above the diagonal; ``out`` may be ``c``.
    """
    tensors = [t for t in (a, b, c, out) if t is not None]
    if choose("sym_matmul", syrk_kernel, *tensors):
        return _syrk_triton(a, b, alpha=alpha, beta=beta, c=c, out=out, config=config)
    return syrk_reference(a, b, alpha=alpha, beta=beta, c=c, out=out)


def ns_step(
    x: torch.Tensor,
    a: float,
    b: float,
    c: float,
    *,
    out: torch.Tensor | None = None,
    config: TileConfig | None = None,
) -> torch.Tensor:
    """One quintic Newton-Schulz step: A = X X^T, B = b A + c A A, X' = a X + B X (tall X via X^T).

    ``x`` (..., m, n); returns a new contiguous tensor of x's shape and dtype (or ``out``).
    """
    tensors = (x,) if out is None else (x, out)
    if choose("ns_step", ns_step_kernel, *tensors):
        return _ns_step_triton(x, a, b, c, out=out, config=config)
    res = ns_step_reference(x, a, b, c)
    if out is None:
        return res
    return out.copy_(res)


def sym_stat_update_(
    stat: torch.Tensor, g: torch.Tensor, beta: float, *, config: TileConfig | None = None
) -> torch.Tensor:
    """In place: stat = beta * stat + (1 - beta) * g g^T (Shampoo's left statistic; g.mT for the right).

    ``stat`` (..., m, m) must be symmetric; the kernel reads it on and above the diagonal only.
    """
    if choose("sym_stat_update_", syrk_kernel, stat, g):
        return _sym_stat_update_triton(stat, g, beta, config=config)
    return sym_stat_update_reference(stat, g, beta)


def coupled_newton_step(
    x: torch.Tensor, m: torch.Tensor, root: int, *, config: TileConfig | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One coupled Newton inverse-root step: Mp = ((root+1) I - M) / root; (X Mp, Mp^root M)."""
    if choose("coupled_newton_step", syrk_kernel, x, m):
        return _coupled_newton_step_triton(x, m, root, config=config)
    return coupled_newton_step_reference(x, m, root)


def inverse_root_newton(
    a: torch.Tensor,
    root: int,
    *,
    epsilon: float = 0.0,
    max_iters: int = 100,
    tol: float = 1e-6,
    config: TileConfig | None = None,
) -> torch.Tensor:
    """(a + epsilon I)^(-1/root) of a symmetric positive definite matrix (or stack), coupled Newton."""
    if choose("inverse_root_newton", syrk_kernel, a):
        return _inverse_root_newton_triton(a, root, epsilon=epsilon, max_iters=max_iters, tol=tol, config=config)
    return inverse_root_newton_reference(a, root, epsilon=epsilon, max_iters=max_iters, tol=tol)
