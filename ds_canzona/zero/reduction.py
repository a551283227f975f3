"""How gradients are accumulated, summed over ranks and averaged: DeepSpeed's numerics keys.

Shared by the ZeRO-1/2 (``stage12``) and ZeRO-3 (``stage3``) runtimes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GradientReduction:
    """How gradients are accumulated, summed over ranks and averaged (DeepSpeed's numerics keys).

    ``accumulate_dtype`` is the flat gradient buffers' dtype (``data_types.grad_accum_dtype``),
    ``communicate_dtype`` the reduce-scatter's (``communication_data_type``); each rank's buffer is
    divided by ``pre_divide`` in the communication dtype before the sum, and the sum by
    ``post_divide`` in fp32 after it (``prescale_gradients``, ``gradient_predivide_factor``).
    """

    accumulate_dtype: torch.dtype
    communicate_dtype: torch.dtype
    pre_divide: float
    post_divide: float


def gradient_reduction(*, param_dtype: torch.dtype, world_size: int, grad_accum_dtype: torch.dtype | None = None,
                       communication_dtype: torch.dtype | None = None, gradient_average: bool = True,
                       postscale_gradients: bool = True, gradient_predivide_factor: float = 1.0) -> GradientReduction:
    """The reduction DeepSpeed 0.19.8's ZeRO-1/2 configures from the same keys.

    Unset dtypes are the parameter dtype (DeepSpeed's defaults: ``get_data_types`` and
    ``communication_data_type``). Averaging follows ``gradient_reduction_w_predivide``: with
    ``prescale_gradients`` every rank divides by the world size before the sum; otherwise by
    ``gradient_predivide_factor`` before and by ``world_size / factor`` after; a summing
    ``gradient_allreduce_op`` (``gradient_average`` false) divides by nothing.
    """
    accumulate = grad_accum_dtype or param_dtype
    if accumulate not in (param_dtype, torch.float32):
        raise ValueError(f"gradients accumulate in the parameter dtype or in fp32, got {accumulate} for "
                         f"{param_dtype} parameters")
    if not gradient_average:
        pre, post = 1.0, 1.0
    elif not postscale_gradients:
        pre, post = float(world_size), 1.0
    else:
        pre, post = float(gradient_predivide_factor), world_size / float(gradient_predivide_factor)
    return GradientReduction(accumulate_dtype=accumulate, communicate_dtype=communication_dtype or param_dtype,
                             pre_divide=pre, post_divide=post)


__all__ = ["GradientReduction", "gradient_reduction"]
