"""Gradient-norm clipping that gives the same bits at every world size, read by the host once.

The global norm is summed from per-item squared norms in float64, in buffer order; an item is a
tensor, or one of the canonical pieces of a large non-matrix tensor or expert stack
(``ds_canzona.plan.item_bounds``: a function of the tensor alone). The distributed step fills in
the entries of the items a rank owns, all-reduces the vector (every entry is non-zero on exactly
one rank, so the sum is exact) and then every rank sums it in the same order. The single-process
reference calls the same two functions on the same items, so the clip coefficient is
bit-identical whatever the world size or plan.

The norm is the only device value the step needs on the host, and it also answers the overflow
question: a NaN or infinite entry makes the float64 sum non-finite, and finite entries cannot
overflow it (each is at most numel * 3.4e38**2, about 1e77 per element of an fp32 gradient,
against float64's 1.8e308). So the step reads one number per optimizer step (docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import math

import torch


# Elements of a gradient widened to float64 at a time for its squared norm: 2 MB of float64,
# small enough to stay in a GPU's L2 cache (and a CPU core's), so the widened copy costs no
# memory traffic beyond the one read of the gradient and no full-size allocation.
NORM_CHUNK_NUMEL = 1 << 18


def tensor_sq_norm(grad: torch.Tensor) -> torch.Tensor:
    """Squared L2 norm of one gradient, accumulated in float64 (a 0-dim float64 tensor).

    The gradient is widened to float64 ``NORM_CHUNK_NUMEL`` elements at a time; each chunk's
    dot product is one float64 partial sum, and one float64 sum adds the partial sums. Up to
    one chunk this is exactly ``dot(g64, g64)``, as before; above, the same float64 products
    (exact for fp32 and narrower gradients) are summed in a different grouping. Both sums are of
    n non-negative terms, so each lies within n x 2**-53 of the exact sum, relatively (the
    textbook bound of any summation order), and they differ by at most twice that; measured
    (tests/test_step_overhead.py): 2.5e-14 relative on 8e5 elements, against a bound of 1.8e-10.
    Every caller (the runtimes and the single-process references) uses this one function on the
    same items, so distributed and single-process clipping stay bit-identical.
    """
    flat = grad.detach().reshape(-1)
    if flat.numel() <= NORM_CHUNK_NUMEL:
        wide = flat.to(torch.float64)
        return torch.dot(wide, wide)
    partial = []
    for chunk in flat.split(NORM_CHUNK_NUMEL):
        wide = chunk.to(torch.float64)
        partial.append(torch.dot(wide, wide))
    return torch.stack(partial).sum()


def clip_coefficient(sq_norms: torch.Tensor, max_norm: float) -> tuple[float, float]:
    """(total_norm, coefficient) for a vector of per-tensor squared norms in buffer order.

    One host read: the float64 sum's square root. The coefficient follows DeepSpeed's rule:
    max_norm / (norm + 1e-6), applied only when it is below 1; max_norm <= 0 disables clipping
    (coefficient 1.0). A non-finite norm (some entry was NaN or infinite) is returned as is with
    coefficient 1.0: the caller's overflow check is ``not math.isfinite(total_norm)``.
    """
    total_norm = float(sq_norms.to(torch.float64).sum().sqrt())
    if max_norm <= 0.0 or not math.isfinite(total_norm):
        return total_norm, 1.0
    coefficient = max_norm / (total_norm + 1e-6)
    return total_norm, min(coefficient, 1.0)
