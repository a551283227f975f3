"""Plain-torch references of the kernel functions (placeholder until the kernel modules land)."""

import torch


def xxt_reference(x: torch.Tensor) -> torch.Tensor:
    """X @ X^T for a matrix or a stack of matrices (..., m, n) -> (..., m, m)."""
    return x @ x.mT


def ns_step_reference(x: torch.Tensor, a: float, b: float, c: float) -> torch.Tensor:
    """One quintic Newton-Schulz step: A = X X^T, B = b A + c A A, X' = a X + B X."""
    gram = x @ x.mT
    poly = b * gram + c * (gram @ gram)
    return a * x + poly @ x


def sym_stat_update_reference(stat: torch.Tensor, g: torch.Tensor, beta: float) -> torch.Tensor:
    """In place: stat = beta * stat + (1 - beta) * g g^T (Shampoo's left statistic)."""
    stat.mul_(beta).add_(g @ g.mT, alpha=1.0 - beta)
    return stat
