"""Matrix kernels for the per-tensor optimizers (installed as ``ds_canzona.kernels``).

One module per kernel family, each holding the Triton kernel, its wrapper and a plain-torch
reference of the same function:

* ``syrk``: ``alpha A Bᵀ + beta C`` with a symmetric result, upper tiles computed and mirrored;
* ``newton_schulz``: one fused Newton-Schulz step (Muon);
* ``shampoo``: the statistic update and the coupled Newton inverse root (on the syrk kernel).

The functions below pick the implementation per call through ``dispatch`` (``default``: Triton on
CUDA once each shape class has passed a first-use check against the torch reference, the torch
reference elsewhere; ``set_backend`` or ``DS_CANZONA_KERNELS`` force either). ``backend_report()``
says what ran. Triton is optional: without it ``TRITON_AVAILABLE`` is False and the references run.
See docs/KERNELS.md for the contracts and the tolerances.
"""

from __future__ import annotations

import sys as _sys

if __name__ == "kernels":
    # This folder is installed as ds_canzona.kernels. It is imported as a top-level `kernels` only
    # when the checkout's root is on sys.path (`python -m ...` or `python -m pytest` run from the
    # root), and there it would shadow HuggingFace's `kernels` package, which transformers imports
    # when it is installed. Hand the name to that package; the rest of this file then runs in a
    # module nobody keeps.
    def _import_shadowed(name: str) -> object:
        import importlib.machinery
        import importlib.util
        import os

        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        others = [p for p in _sys.path if os.path.abspath(p or os.curdir) != root]
        spec = importlib.machinery.PathFinder.find_spec(name, others)
        if spec is None:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        module = importlib.util.module_from_spec(spec)
        _sys.modules[name] = module
        spec.loader.exec_module(module)
        return module

    _import_shadowed("kernels")

import torch

from ds_canzona.kernels._common import TRITON_AVAILABLE, TileConfig
from ds_canzona.kernels import dispatch as _dispatch
from ds_canzona.kernels.dispatch import (
    backend_report,
    backend_status,
    backend_summary,
    choose,
    get_backend,
    set_backend,
)
from ds_canzona.kernels.newton_schulz import ns_step_kernel, ns_step_reference
from ds_canzona.kernels.newton_schulz import ns_step as _ns_step_triton
from ds_canzona.kernels.shampoo import (
    coupled_newton_step_reference,
    inverse_root_newton_reference,
    sym_stat_update_reference,
)
from ds_canzona.kernels.shampoo import _inverse_root
from ds_canzona.kernels.shampoo import coupled_newton_step as _coupled_newton_step_triton
from ds_canzona.kernels.shampoo import sym_stat_update_ as _sym_stat_update_triton
from ds_canzona.kernels.syrk import has_c_term, syrk_kernel, syrk_reference
from ds_canzona.kernels.syrk import syrk as _syrk_triton
from ds_canzona.kernels.validation import Thunks

__all__ = [
    "TRITON_AVAILABLE",
    "TileConfig",
    "backend_report",
    "backend_status",
    "backend_summary",
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


# Each public function hands the dispatch its tensor arguments by name and a function binding them
# to three thunks (``Thunks``): the Triton wrapper, the torch reference, and the reference on
# float64 copies (the first-use check's oracle), plus the arguments it updates in place. The check
# binds the same function to a slice of the arguments when the call is large. The wrappers are
# looked up by name at call time.


def xxt(x: torch.Tensor, *, out: torch.Tensor | None = None, config: TileConfig | None = None) -> torch.Tensor:
    """X @ X^T for a matrix or a stack (..., m, n) -> (..., m, m) in x's dtype (or out's).

    The kernel computes the upper tiles only and mirrors them (fp32 accumulation); the result is
    exactly symmetric on both paths.
    """

    def bind(x: torch.Tensor, out: torch.Tensor | None) -> Thunks:
        return Thunks(
            triton=lambda: _syrk_triton(x, out=out, config=config),
            reference=lambda: syrk_reference(x, out=out),
            oracle=lambda: syrk_reference(x.double()),
            writes=() if out is None else (out,),
        )

    return _dispatch.run("xxt", syrk_kernel, {"x": x, "out": out}, bind,
                         square=x.shape[-2] if x.ndim >= 2 else None, config=config)


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

    def bind(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor | None, out: torch.Tensor | None) -> Thunks:
        return Thunks(
            triton=lambda: _syrk_triton(a, b, alpha=alpha, beta=beta, c=c, out=out, config=config),
            reference=lambda: syrk_reference(a, b, alpha=alpha, beta=beta, c=c, out=out),
            oracle=lambda: syrk_reference(a.double(), b.double(), alpha=alpha, beta=beta,
                                          c=None if c is None else c.double()),
            writes=() if out is None else (out,),
        )

    return _dispatch.run("sym_matmul", syrk_kernel, {"a": a, "b": b, "c": c, "out": out}, bind,
                         config=config, constexprs=(("HAS_C", has_c_term(c, beta)),))


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

    def bind(x: torch.Tensor, out: torch.Tensor | None) -> Thunks:
        def reference() -> torch.Tensor:
            res = ns_step_reference(x, a, b, c)
            return res if out is None else out.copy_(res)

        return Thunks(
            triton=lambda: _ns_step_triton(x, a, b, c, out=out, config=config),
            reference=reference,
            oracle=lambda: ns_step_reference(x.double(), a, b, c),
            writes=() if out is None else (out,),
        )

    # B = b A + c A A is the symmetric kernel with A as its C term, scaled by b
    return _dispatch.run("ns_step", ns_step_kernel, {"x": x, "out": out}, bind,
                         config=config, constexprs=(("HAS_C", has_c_term(x, b)),))


def sym_stat_update_(
    stat: torch.Tensor, g: torch.Tensor, beta: float, *, config: TileConfig | None = None
) -> torch.Tensor:
    """In place: stat = beta * stat + (1 - beta) * g g^T (Shampoo's left statistic; g.mT for the right).

    ``stat`` (..., m, m) must be symmetric; the kernel reads it on and above the diagonal only.
    """

    def bind(stat: torch.Tensor, g: torch.Tensor) -> Thunks:
        return Thunks(
            triton=lambda: _sym_stat_update_triton(stat, g, beta, config=config),
            reference=lambda: sym_stat_update_reference(stat, g, beta),
            oracle=lambda: sym_stat_update_reference(stat.double(), g.double(), beta),
            writes=(stat,),
        )

    return _dispatch.run("sym_stat_update_", syrk_kernel, {"stat": stat, "g": g}, bind,
                         config=config, constexprs=(("HAS_C", has_c_term(stat, beta)),))


def coupled_newton_step(
    x: torch.Tensor, m: torch.Tensor, root: int, *, config: TileConfig | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One coupled Newton inverse-root step: Mp = ((root+1) I - M) / root; (X Mp, Mp^root M)."""

    def bind(x: torch.Tensor, m: torch.Tensor) -> Thunks:  # its products have no C term
        return Thunks(
            triton=lambda: _coupled_newton_step_triton(x, m, root, config=config),
            reference=lambda: coupled_newton_step_reference(x, m, root),
            oracle=lambda: coupled_newton_step_reference(x.double(), m.double(), root),
        )

    return _dispatch.run("coupled_newton_step", syrk_kernel, {"x": x, "m": m}, bind, config=config)


def inverse_root_newton(
    a: torch.Tensor,
    root: int,
    *,
    epsilon: float = 0.0,
    max_iters: int = 100,
    tol: float = 1e-6,
    config: TileConfig | None = None,
) -> torch.Tensor:
    """(a + epsilon I)^(-1/root) of a symmetric positive definite matrix (or stack), coupled Newton.

    On the kernels, every iteration is a call of ``coupled_newton_step``, so its first-use check
    (and fallback) covers the iteration; on torch this is ``inverse_root_newton_reference``.
    """
    if not choose("inverse_root_newton", syrk_kernel, a):
        return inverse_root_newton_reference(a, root, epsilon=epsilon, max_iters=max_iters, tol=tol)

    def step(x: torch.Tensor, m: torch.Tensor, r: int) -> tuple[torch.Tensor, torch.Tensor]:
        return coupled_newton_step(x, m, r, config=config)

    return _inverse_root(a, root, step, epsilon=epsilon, max_iters=max_iters, tol=tol)
