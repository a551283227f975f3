"""What the kernel modules share: the optional Triton import, tile configs, input checks.

Triton is optional: on a machine without it (or where importing it fails) ``TRITON_AVAILABLE`` is
False, ``triton``/``tl`` are None, ``jit`` leaves the function undecorated, and only the torch
references run. Importing Triton costs about 0.25 s on the CPU (measured with triton 3.9).

Triton's CPU interpreter (``TRITON_INTERPRET=1``) is chosen when a kernel is *defined*, so the
variable must be set before ``ds_canzona.kernels`` is first imported; ``is_interpreted(kernel)``
tells afterwards which kind a kernel is.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

try:  # pragma: no cover - depends on the machine
    import triton
    import triton.language as tl

    TRITON_AVAILABLE = True
except Exception:  # ImportError, or a broken install: the references still work
    triton = None
    tl = None
    TRITON_AVAILABLE = False

__all__ = [
    "LARGE_TILES_FROM",
    "MAX_BATCH",
    "MAX_OFFSET",
    "SUPPORTED_DTYPES",
    "TRITON_AVAILABLE",
    "TileConfig",
    "as_stack",
    "cdiv",
    "check_operand",
    "default_config",
    "dot_precision",
    "interp_bf16_flag",
    "is_interpreted",
    "jit",
    "matrix_extent",
    "overlaps",
    "round_bf16_rne",
    "stack_view",
    "tl",
    "triton",
]

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# Grid axis 1 (the stack of matrices) is limited to 65535 programs by CUDA.
MAX_BATCH = 65535
# Offsets within one matrix are int32 in the kernels (the batch offset is int64).
MAX_OFFSET = 2**31 - 1


def matrix_extent(x: torch.Tensor) -> int:
    """The largest element offset within one matrix of ``x`` (its last two dims)."""
    if x.numel() == 0:
        return 0
    return sum((size - 1) * abs(stride) for size, stride in zip(x.shape[-2:], x.stride()[-2:]))


def jit(fn: Any) -> Any:
    """``triton.jit`` when Triton is importable; otherwise the plain function (never launched)."""
    return triton.jit(fn) if TRITON_AVAILABLE else fn


def is_interpreted(kernel: Any) -> bool:
    """Whether ``kernel`` was defined under Triton's interpreter (runs on CPU tensors)."""
    if not TRITON_AVAILABLE:
        return False
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernel, InterpretedFunction)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TileConfig:
    """Launch meta-parameters of one matmul-shaped kernel.

    ``block_m``/``block_n`` are the output tile (the symmetric kernels need them equal),
    ``block_k`` the reduction step, ``group_m`` the L2 swizzle of the general product.
    """

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 3
    group_m: int = 8

    def __post_init__(self) -> None:
        for field in ("block_m", "block_n", "block_k"):
            value = getattr(self, field)
            if value < 16 or value & (value - 1):
                raise ValueError(f"Invalid TileConfig.{field}={value}. Must be a power of two >= 16.")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"Invalid TileConfig.num_warps={self.num_warps}. Must be 1, 2, 4, 8 or 16.")
        if self.num_stages < 1:
            raise ValueError(f"Invalid TileConfig.num_stages={self.num_stages}. Must be >= 1.")
        if self.group_m < 1:
            raise ValueError(f"Invalid TileConfig.group_m={self.group_m}. Must be >= 1.")


# default_config takes the large tiles from this size of the larger output dim on (16-bit dtypes).
LARGE_TILES_FROM = 1024

# Interpreter: each program costs a few ms per K step, whatever the tile, so take big tiles.
INTERPRETER_CONFIG = TileConfig(block_m=128, block_n=128, block_k=128, num_warps=4, num_stages=1)


def default_config(m: int, n: int, dtype: torch.dtype, *, interpreted: bool) -> TileConfig:
    """The tile config used when the caller pins none.

    Chosen for Hopper (H100/H200) by the usual rules, not yet measured (no GPU was lent while
    writing this; ``python -m ds_canzona.bench kernels --sweep`` measures the candidates):
    128x128x64 tiles with 8 warps for 16-bit operands on outputs of 1024 and more, 64x64 tiles
    below that (more programs for the 132 SMs), 64x64x32 for fp32 (IEEE fp32 has no tensor cores).
    """
    if interpreted:
        return INTERPRETER_CONFIG
    if dtype == torch.float32:
        return TileConfig(block_m=64, block_n=64, block_k=32, num_warps=4, num_stages=3)
    if max(m, n) < LARGE_TILES_FROM:
        return TileConfig(block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=4)
    return TileConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=4)


def overlaps(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Whether the memory spans of ``x`` and ``y`` intersect (conservative: spans, not elements)."""
    if x.numel() == 0 or y.numel() == 0 or x.device != y.device:
        return False

    def span(t: torch.Tensor) -> tuple[int, int]:
        last = sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride()))
        return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()

    (x0, x1), (y0, y1) = span(x), span(y)
    return x0 < y1 and y0 < x1


def cdiv(n: int, d: int) -> int:
    """Ceiling division of non-negative ints."""
    return -(-n // d)


def as_stack(x: torch.Tensor) -> torch.Tensor:
    """View (..., r, c) as (B, r, c); copies only when the leading dims cannot be merged."""
    return x.reshape(-1, x.shape[-2], x.shape[-1])


def stack_view(x: torch.Tensor) -> torch.Tensor | None:
    """``x`` as the (B, r, c) view ``as_stack`` gives (``x`` itself up to rank 3), or None where
    ``as_stack`` must copy (leading dims that do not merge into one)."""
    if x.ndim <= 3:
        return x
    try:
        return x.view(-1, x.shape[-2], x.shape[-1])
    except RuntimeError:
        return None


def check_operand(name: str, x: torch.Tensor, *, kernel: Any) -> None:
    """Raise a ValueError naming ``name`` when ``x`` cannot be fed to ``kernel``.

    Any strides are accepted for the last two dims (a transposed view costs nothing); the leading
    dims are merged into one batch dim. The device must be CUDA, or the CPU under the interpreter.
    """
    if not TRITON_AVAILABLE:
        raise RuntimeError("Triton is not importable here; use the torch reference (backend 'torch').")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.ndim < 2:
        raise ValueError(f"{name} must have rank >= 2 (a matrix or a stack of matrices), got shape {tuple(x.shape)}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{name} has dtype {x.dtype}; the Triton kernels take float16, bfloat16 or float32")
    if is_interpreted(kernel):
        if x.device.type != "cpu":
            raise ValueError(f"{name} is on {x.device}; under TRITON_INTERPRET=1 the kernels run on CPU tensors")
    elif x.device.type != "cuda":
        raise ValueError(f"{name} is on {x.device}; the Triton kernels need CUDA tensors (the torch reference runs elsewhere)")
    if matrix_extent(x) > MAX_OFFSET:
        raise ValueError(f"{name} {tuple(x.shape)} has element offsets beyond int32 within one matrix; use the torch reference")
    if x.numel() and x.shape[:-2].numel() > MAX_BATCH:
        raise ValueError(f"{name} stacks {x.shape[:-2].numel()} matrices; at most {MAX_BATCH} per launch")


def interp_bf16_flag(*dtypes: torch.dtype, kernel: Any) -> bool:
    """Whether a kernel needs its interpreter bf16 workarounds (the ``INTERP_BF16`` constexpr).

    Only under the interpreter and only when a bfloat16 tensor is involved. Triton 3.9's
    interpreter computes bf16 arithmetic on raw bit patterns (so the kernels upcast operands to
    fp32 right after loading), and its fp32 -> bf16 cast truncates where compiled Triton rounds to
    nearest even (so the kernels round with ``round_bf16_rne`` before storing). Compiled kernels
    leave the flag off: bf16 operands go to the tensor cores, which accumulate in fp32.
    """
    return torch.bfloat16 in dtypes and is_interpreted(kernel)


@jit
def round_bf16_rne(x):
    """fp32 -> fp32 rounded to the nearest bf16 (ties to even), so that a truncating cast is exact.

    Only for the interpreter (see ``interp_bf16_flag``); finite values and infinities are right.
    """
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


def dot_precision(dtype: torch.dtype, fp32_precision: str) -> str | None:
    """``tl.dot`` input_precision: 'ieee', 'tf32' or 'tf32x3' for fp32 operands, None (the
    backend's default, which 16-bit operands ignore) otherwise."""
    if fp32_precision not in ("ieee", "tf32", "tf32x3"):
        raise ValueError(f"Invalid fp32_precision={fp32_precision!r}. Must be 'ieee', 'tf32' or 'tf32x3'.")
    return fp32_precision if dtype == torch.float32 else None
