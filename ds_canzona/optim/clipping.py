"""Gradient-norm clipping that gives the same bits at every world size.

The global norm is summed from per-item squared norms in float64, in buffer order; an item is a
tensor, or one of the canonical pieces of a large non-matrix tensor
(``ds_canzona.plan.piece_bounds``: a function of the tensor alone). The distributed step fills in
the entries of the items a rank owns, all-reduces the vector (every entry is non-zero on exactly
one rank, so the sum is exact) and then every rank sums it in the same order. The single-process
reference calls the same two functions on the same items, so the clip coefficient is
bit-identical whatever the world size or plan.
"""

from __future__ import annotations

import torch


def tensor_sq_norm(grad: torch.Tensor) -> torch.Tensor:
    """Squared L2 norm of one gradient, accumulated in float64 (a 0-dim float64 tensor)."""
    g = grad.detach().to(torch.float64)
    return torch.dot(g.reshape(-1), g.reshape(-1))


def clip_coefficient(sq_norms: torch.Tensor, max_norm: float) -> tuple[float, float]:
    """(total_norm, coefficient) for a vector of per-tensor squared norms in buffer order.

    The coefficient follows DeepSpeed's rule: max_norm / (norm + 1e-6), applied only when it is
    below 1; max_norm <= 0 disables clipping (coefficient 1.0). A non-finite norm is returned as
    is with coefficient 1.0, for the caller's overflow check.
    """
    total_norm = float(sq_norms.to(torch.float64).sum().sqrt())
    if max_norm <= 0.0 or not torch.isfinite(torch.tensor(total_norm)):
        return total_norm, 1.0
    coefficient = max_norm / (total_norm + 1e-6)
    return total_norm, min(coefficient, 1.0)
