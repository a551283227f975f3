"""Gradient-norm clipping that gives the same bits at every world size, read by the host once.

The global norm is summed from per-item squared norms in float64, in buffer order; an item is a
tensor, or one of the canonical pieces of a large non-matrix tensor
(``ds_canzona.plan.piece_bounds``: a function of the tensor alone). The distributed step fills in
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


def tensor_sq_norm(grad: torch.Tensor) -> torch.Tensor:
    """Squared L2 norm of one gradient, accumulated in float64 (a 0-dim float64 tensor)."""
    g = grad.detach().to(torch.float64)
    return torch.dot(g.reshape(-1), g.reshape(-1))


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
