"""Symmetric rank-k product: ``out = alpha * A Bᵀ + beta * C`` where the result is symmetric.

With ``B = A`` (the default) this is BLAS's SYRK, ``X Xᵀ``: the Gram matrix of Newton-Schulz and
of Shampoo's statistics. With ``B`` another matrix the caller asserts that ``A Bᵀ`` is symmetric,
which holds when A and B are symmetric matrices that commute (then ``A Bᵀ = A B``): the products
of the coupled Newton inverse-root iteration, and ``A·A`` for a symmetric ``A``.

Only the tiles on and above the diagonal are computed (T(T+1)/2 of the T² output tiles, about
half the FLOPs for large T); each is stored twice, in place and mirrored. On diagonal tiles the
upper triangle comes from the tile and the strictly lower one from its transpose, so the output is
exactly symmetric, bit for bit, and ``C`` is read only on and above the diagonal (like BLAS's
``uplo='U'``). ``out`` may be ``C`` itself (in place): each program reads only the C tile it owns
and writes only that tile and its mirror, which no other program reads.
"""

from __future__ import annotations

import torch

from ds_canzona.kernels._common import (
    MAX_OFFSET,
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

__all__ = ["has_c_term", "syrk", "syrk_kernel", "syrk_reference"]


def has_c_term(c: torch.Tensor | None, beta: float) -> bool:
    """The kernel's ``HAS_C``: whether ``beta * C`` is added (a constexpr, so each value is its own
    compiled variant and its own first-use shape class)."""
    return c is not None and beta != 0.0


@jit
def syrk_kernel(
    a_ptr,  # *A: (BATCH, M, K), any strides
    b_ptr,  # *B: (BATCH, M, K), any strides; the same pointer as a_ptr for X Xᵀ
    c_ptr,  # *C: (BATCH, M, M), read on and above the diagonal; unused unless HAS_C
    out_ptr,  # *OUT: (BATCH, M, M), every element written; may equal c_ptr
    M,  # rows of A and B = rows and columns of OUT
    K,  # columns of A and B (the reduction length)
    stride_ab, stride_am, stride_ak,  # A strides: batch, row, column (elements)
    stride_bb, stride_bm, stride_bk,  # B strides
    stride_cb, stride_cm, stride_cn,  # C strides
    stride_ob, stride_om, stride_on,  # OUT strides
    alpha,  # fp32 scale of A Bᵀ
    beta,  # fp32 scale of C
    HAS_C: tl.constexpr,  # add beta * C
    INTERP_BF16: tl.constexpr,  # interpreter bf16 fixes: fp32 loads, RNE stores (GPU builds: off)
    INPUT_PRECISION: tl.constexpr,  # tl.dot input_precision for fp32 operands; None for 16-bit
    BLOCK: tl.constexpr,  # output tile is BLOCK x BLOCK (square: tiles mirror onto tiles)
    BLOCK_K: tl.constexpr,  # reduction step
):
    """One program per upper-triangle output tile (ti <= tj) of one matrix of the stack.

    Grid: (T * (T + 1) // 2, BATCH) with T = cdiv(M, BLOCK). Program p of a row-major walk over
    the upper triangle finds its tile row ti in closed form (row ti starts at ti*T - ti*(ti-1)/2)
    with one integer correction each way for fp32 rounding of the square root.
    """
    pid = tl.program_id(0)
    batch = tl.program_id(1).to(tl.int64)
    num_tiles = tl.cdiv(M, BLOCK)
    two_t1 = 2 * num_tiles + 1
    ti = ((two_t1 - tl.sqrt((two_t1 * two_t1 - 8 * pid).to(tl.float32))) * 0.5).to(tl.int32)
    ti = tl.where(ti * num_tiles - (ti * (ti - 1)) // 2 > pid, ti - 1, ti)
    ti = tl.where((ti + 1) * num_tiles - ((ti + 1) * ti) // 2 <= pid, ti + 1, ti)
    tj = pid - (ti * num_tiles - (ti * (ti - 1)) // 2) + ti

    rows = ti * BLOCK + tl.arange(0, BLOCK)  # output rows: rows of A
    cols = tj * BLOCK + tl.arange(0, BLOCK)  # output columns: rows of B
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < M

    a_ptrs = a_ptr + batch * stride_ab + rows[:, None] * stride_am + ks[None, :] * stride_ak
    b_ptrs = b_ptr + batch * stride_bb + ks[:, None] * stride_bk + cols[None, :] * stride_bm
    acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + ks) < K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)  # a tile of Bᵀ
        if INTERP_BF16:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    acc = acc * alpha
    in_bounds = row_ok[:, None] & col_ok[None, :]
    if HAS_C:
        c_ptrs = c_ptr + batch * stride_cb + rows[:, None] * stride_cm + cols[None, :] * stride_cn
        acc += beta * tl.load(c_ptrs, mask=in_bounds, other=0.0).to(tl.float32)
    if INTERP_BF16 and out_ptr.dtype.element_ty == tl.bfloat16:
        acc = round_bf16_rne(acc)
    res = acc.to(out_ptr.dtype.element_ty)

    out_base = out_ptr + batch * stride_ob
    out_ptrs = out_base + rows[:, None] * stride_om + cols[None, :] * stride_on
    mirror_ptrs = out_base + cols[:, None] * stride_om + rows[None, :] * stride_on
    mirror_ok = col_ok[:, None] & row_ok[None, :]
    res_t = tl.trans(res)
    if ti == tj:
        # Diagonal tile: the upper triangle (with the diagonal) from the tile, the strictly lower
        # one from its transpose, so the result is symmetric bit for bit.
        tl.store(out_ptrs, res, mask=in_bounds & (rows[:, None] <= cols[None, :]))
        tl.store(mirror_ptrs, res_t, mask=mirror_ok & (cols[:, None] > rows[None, :]))
    else:
        # Off-diagonal tile: the whole tile in place and its transpose at the mirror position
        # (masks only for the tails, so the stores vectorise).
        tl.store(out_ptrs, res, mask=in_bounds)
        tl.store(mirror_ptrs, res_t, mask=mirror_ok)


def syrk(
    a: torch.Tensor,
    b: torch.Tensor | None = None,
    *,
    alpha: float = 1.0,
    beta: float = 0.0,
    c: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    config: TileConfig | None = None,
    fp32_precision: str = "ieee",
) -> torch.Tensor:
    """``alpha * a @ b.mT + beta * c`` for a matrix or a stack, computing the upper tiles only.

    Shapes: ``a`` and ``b`` (..., m, k), ``c`` and ``out`` (..., m, m), the same leading dims;
    ``b`` defaults to ``a``. Dtypes: ``a``/``b`` float16, bfloat16 or float32 (the same);
    ``c``/``out`` any of those; accumulation is fp32 (IEEE fp32 for fp32 operands unless
    ``fp32_precision='tf32'``). Any strides are accepted. ``out`` (default: new, ``out_dtype`` or
    a's dtype) may be ``c`` for an in-place update, and must not overlap ``a`` or ``b``. Contract: the result is symmetric (always for
    ``b is None``; the caller's promise otherwise), and ``c`` is read on and above the diagonal only.
    ``config.block_m`` sets the square output tile and ``config.block_k`` the reduction step.
    """
    check_operand("a", a, kernel=syrk_kernel)
    if b is None:
        b = a
    else:
        check_operand("b", b, kernel=syrk_kernel)
        if b.shape != a.shape or b.dtype != a.dtype or b.device != a.device:
            raise ValueError(f"b must match a in shape, dtype and device: a {tuple(a.shape)} {a.dtype}, b {tuple(b.shape)} {b.dtype}")
    lead, m, k = a.shape[:-2], a.shape[-2], a.shape[-1]
    if c is not None:
        check_operand("c", c, kernel=syrk_kernel)
        if c.shape != (*lead, m, m) or c.device != a.device:
            raise ValueError(f"c must have shape {(*lead, m, m)} on {a.device}, got {tuple(c.shape)} on {c.device}")
    if out is None:
        if m * m > MAX_OFFSET:
            raise ValueError(f"a {m} x {m} output has element offsets beyond int32; use the torch reference")
        out = torch.empty((*lead, m, m), dtype=out_dtype or a.dtype, device=a.device)
    else:
        check_operand("out", out, kernel=syrk_kernel)
        if out.shape != (*lead, m, m) or out.device != a.device:
            raise ValueError(f"out must have shape {(*lead, m, m)} on {a.device}, got {tuple(out.shape)} on {out.device}")
        if out_dtype is not None and out.dtype != out_dtype:
            raise ValueError(f"out has dtype {out.dtype} but out_dtype={out_dtype}")
    if overlaps(out, a) or overlaps(out, b):
        raise ValueError("out must not overlap a or b (it may be c, for an in-place update)")
    if out.numel() == 0:
        return out
    try:
        out3 = out.view(-1, m, m)
    except RuntimeError as err:
        raise ValueError("out's leading dims must be mergeable into one (a view), so that the kernel writes into it") from err

    a3, b3 = as_stack(a), as_stack(b)
    c3 = as_stack(c) if c is not None else out3
    cfg = config or default_config(m, m, a.dtype, interpreted=is_interpreted(syrk_kernel))
    tiles = cdiv(m, cfg.block_m)
    grid = (tiles * (tiles + 1) // 2, a3.shape[0])
    syrk_kernel[grid](
        a3, b3, c3, out3,
        m, k,
        a3.stride(0), a3.stride(1), a3.stride(2),
        b3.stride(0), b3.stride(1), b3.stride(2),
        c3.stride(0), c3.stride(1), c3.stride(2),
        out3.stride(0), out3.stride(1), out3.stride(2),
        float(alpha), float(beta),
        HAS_C=has_c_term(c, beta),
        INTERP_BF16=interp_bf16_flag(a.dtype, out3.dtype, kernel=syrk_kernel),
        INPUT_PRECISION=dot_precision(a.dtype, fp32_precision),
        BLOCK=cfg.block_m,
        BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out


def syrk_reference(
    a: torch.Tensor,
    b: torch.Tensor | None = None,
    *,
    alpha: float = 1.0,
    beta: float = 0.0,
    c: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Plain torch ``alpha * a @ b.mT + beta * c`` (full product, in a's dtype), same contract.

    Symmetrised from the upper triangle like the kernel, so ``c`` is read on and above the
    diagonal only and the result is exactly symmetric.
    """
    prod = a @ (a if b is None else b).mT
    if alpha != 1.0:
        prod = prod * alpha
    if c is not None and beta != 0.0:
        wide = torch.promote_types(prod.dtype, c.dtype)
        prod = prod.to(wide) + beta * c.to(wide)
    upper = prod.triu()
    res = upper + upper.triu(1).mT
    res = res.to(out.dtype if out is not None else (out_dtype or a.dtype))
    if out is None:
        return res
    out.copy_(res)
    return out

