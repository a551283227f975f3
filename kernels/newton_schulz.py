"""One fused Newton-Schulz step (Muon's orthogonalisation): ``X' = a X + (b A + c A A) X``, ``A = X Xᵀ``.

Three launches, no elementwise pass between them:

1. ``A = X Xᵀ`` with the symmetric kernel (upper tiles only, mirrored; ``syrk.py``);
2. ``B = b A + c A A``: the same kernel with ``A Aᵀ = A A`` (A is symmetric) and the ``b A`` term in
   its epilogue; the result is symmetric again, so again only upper tiles are computed;
3. ``X' = B X + a X``: a general product (``ns_step_kernel`` below) with ``a X`` in the epilogue.

A tall ``X`` (m > n) is handled as its transpose: the step is an odd matrix polynomial, so
``step(X) = step(Xᵀ)ᵀ`` and the Gram matrix stays min(m, n) square. ``A`` and ``B`` are kept in
X's dtype, as in the torch step (Keller Jordan's ``zeropower_via_newtonschulz5``); every product
accumulates in fp32.
"""

from __future__ import annotations

import torch

from ds_canzona.kernels._common import (
    TileConfig,
    as_stack,
    cdiv,
    check_operand,
    default_config,
    dot_precision,
    interp_bf16_flag,
    is_interpreted,
    jit,
    overlaps,
    round_bf16_rne,
    tl,
)
from ds_canzona.kernels.syrk import syrk

__all__ = ["ns_step", "ns_step_kernel", "ns_step_reference"]


@jit
def ns_step_kernel(
    p_ptr,  # *P: (BATCH, M, M) the polynomial b A + c A A, any strides
    x_ptr,  # *X: (BATCH, M, N), any strides
    out_ptr,  # *OUT: (BATCH, M, N), every element written; must not overlap P or X
    M,  # rows of X (and the size of P)
    N,  # columns of X
    stride_pb, stride_pm, stride_pk,  # P strides: batch, row, column (elements)
    stride_xb, stride_xm, stride_xn,  # X strides
    stride_ob, stride_om, stride_on,  # OUT strides
    a_coef,  # fp32 coefficient of the a X term, added in the epilogue
    INTERP_BF16: tl.constexpr,  # interpreter bf16 fixes: fp32 loads, RNE stores (GPU builds: off)
    INPUT_PRECISION: tl.constexpr,  # tl.dot input_precision for fp32 operands; None for 16-bit
    BLOCK_M: tl.constexpr,  # output tile rows
    BLOCK_N: tl.constexpr,  # output tile columns
    BLOCK_K: tl.constexpr,  # reduction step (over the M columns of P)
    GROUP_M: tl.constexpr,  # tile rows per L2 swizzle group
):
    """``OUT = P @ X + a_coef * X`` for one output tile of one matrix of the stack.

    Grid: (cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N), BATCH); program ids walk GROUP_M tile rows at a time
    so that consecutive programs share P's row panels and X's column panels in L2.
    """
    pid = tl.program_id(0)
    batch = tl.program_id(1).to(tl.int64)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * grid_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < N

    p_ptrs = p_ptr + batch * stride_pb + rows[:, None] * stride_pm + ks[None, :] * stride_pk
    x_ptrs = x_ptr + batch * stride_xb + ks[:, None] * stride_xm + cols[None, :] * stride_xn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, M, BLOCK_K):
        k_ok = (k0 + ks) < M
        p = tl.load(p_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(x_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if INTERP_BF16:
            p = p.to(tl.float32)
            x = x.to(tl.float32)
        acc = tl.dot(p, x, acc, input_precision=INPUT_PRECISION)
        p_ptrs += BLOCK_K * stride_pk
        x_ptrs += BLOCK_K * stride_xm

    in_bounds = row_ok[:, None] & col_ok[None, :]
    x_tile = tl.load(
        x_ptr + batch * stride_xb + rows[:, None] * stride_xm + cols[None, :] * stride_xn, mask=in_bounds, other=0.0
    )
    acc += a_coef * x_tile.to(tl.float32)
    if INTERP_BF16 and out_ptr.dtype.element_ty == tl.bfloat16:
        acc = round_bf16_rne(acc)
    out_ptrs = out_ptr + batch * stride_ob + rows[:, None] * stride_om + cols[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=in_bounds)


def ns_step(
    x: torch.Tensor,
    a: float,
    b: float,
    c: float,
    *,
    out: torch.Tensor | None = None,
    config: TileConfig | None = None,
    fp32_precision: str = "ieee",
) -> torch.Tensor:
    """One quintic Newton-Schulz step ``a X + (b A + c A A) X`` with ``A = X Xᵀ`` (tall: via Xᵀ).

    ``x``: (..., m, n), float16, bfloat16 or float32, any strides; a stack is one launch per
    product. Returns ``out`` (default: a new contiguous tensor of x's shape and dtype); ``out`` must
    not overlap ``x``. ``config`` pins the tiles of all three products (the symmetric ones use
    ``block_m`` x ``block_m``). Intermediates A and B are held in x's dtype.
    """
    check_operand("x", x, kernel=ns_step_kernel)
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    else:
        check_operand("out", out, kernel=ns_step_kernel)
        if out.shape != x.shape or out.dtype != x.dtype or out.device != x.device:
            raise ValueError(f"out must match x ({tuple(x.shape)}, {x.dtype}), got {tuple(out.shape)}, {out.dtype}")
        if overlaps(out, x):
            raise ValueError("out must not overlap x")
    if x.numel() == 0:
        return out
    if x.shape[-2] > x.shape[-1]:
        _ns_step_wide(x.mT, a, b, c, out.mT, config, fp32_precision)
    else:
        _ns_step_wide(x, a, b, c, out, config, fp32_precision)
    return out


def _ns_step_wide(
    x: torch.Tensor, a: float, b: float, c: float, out: torch.Tensor, config: TileConfig | None, fp32_precision: str
) -> None:
    m, n = x.shape[-2], x.shape[-1]
    interpreted = is_interpreted(ns_step_kernel)
    gram_cfg = config or default_config(m, m, x.dtype, interpreted=interpreted)
    gram = syrk(x, config=gram_cfg, fp32_precision=fp32_precision)
    poly = syrk(gram, alpha=c, beta=b, c=gram, config=gram_cfg, fp32_precision=fp32_precision)

    p3, x3 = as_stack(poly), as_stack(x)
    try:
        out3 = out.view(-1, m, n)
    except RuntimeError as err:
        raise ValueError("out's leading dims must be mergeable into one (a view), so that the kernel writes into it") from err
    cfg = config or default_config(m, n, x.dtype, interpreted=interpreted)
    grid = (cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n), x3.shape[0])
    ns_step_kernel[grid](
        p3, x3, out3,
        m, n,
        p3.stride(0), p3.stride(1), p3.stride(2),
        x3.stride(0), x3.stride(1), x3.stride(2),
        out3.stride(0), out3.stride(1), out3.stride(2),
        float(a),
        INTERP_BF16=interp_bf16_flag(x.dtype, kernel=ns_step_kernel),
        INPUT_PRECISION=dot_precision(x.dtype, fp32_precision),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )


def ns_step_reference(x: torch.Tensor, a: float, b: float, c: float) -> torch.Tensor:
    """Plain torch Newton-Schulz step in x's dtype: ``A = X Xᵀ``, ``B = b A + c A A``, ``a X + B X``.

    A tall ``x`` is stepped as ``step(xᵀ)ᵀ`` (the same polynomial, a min(m, n) square Gram matrix);
    the result is contiguous, like the kernel's.
    """
    if x.shape[-2] > x.shape[-1]:
        return ns_step_reference(x.mT, a, b, c).mT.contiguous()
    gram = x @ x.mT
    poly = b * gram + c * (gram @ gram)
    return a * x + poly @ x
