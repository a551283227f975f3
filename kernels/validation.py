"""First-use check of the Triton kernels: a kernel is trusted on a device only once it has been right there.

Under the ``default`` backend on CUDA, the first call of each (operation, shape class) runs three
things on the caller's input: the float64 reference (the oracle), the torch reference in the
call's own precision, and the Triton kernel. The kernel passes when its relative Frobenius error
against the oracle is within the bound of the operation and output dtype (``BOUND_U``, the
documented error of the kernel, docs/KERNELS.md) or within ``TORCH_FACTOR`` times what the torch
reference achieves on the same input (for inputs less benign than the tests': long reductions,
larger norms). After a pass, calls of that class run the kernel alone.

A compile or launch error (any exception from the Triton path) or a miss switches the whole
operation to torch for the rest of the process, logs one warning (rank 0) naming the kernel, the
dtypes, the shape and the error, and the call returns the torch reference's result. The whole
operation, not just the class: a kernel that is wrong for one specialisation has a compiler or
driver problem that other classes, each checked on one input only, may share, and "this operation
runs on torch" is a state a reader of the log can act on.

An input that cannot tell a right kernel from a wrong one (the oracle zero or not finite, the
torch reference overflowing or more than ``INCONCLUSIVE_TORCH_ERROR`` off) is inconclusive: the
call returns the reference's result and the class stays unchecked; after ``MAX_INCONCLUSIVE``
such inputs the class runs torch for the rest of the process. The check reads its verdict on the
host (one synchronisation, on first use only) and holds, for that call only, a float64 copy of
the inputs and copies of the tensors the operation writes in place.

The shape class is everything a compiled kernel or its tile choice specialises on, per tensor:
dtype, stacked or not, whether each of the last two dims is a multiple of 16 and at least 1024
(``default_config``'s size regime), the layout (row-major, column-major or strided) with the
divisibility by 16 of every non-unit stride, and whether the data pointer is 16-byte aligned
(Triton specialises integer arguments and pointers on exactly these), plus a pinned tile config.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ds_canzona.kernels._common import TileConfig

__all__ = [
    "BOUND_U",
    "INCONCLUSIVE_TORCH_ERROR",
    "MAX_INCONCLUSIVE",
    "OPERATIONS",
    "TORCH_FACTOR",
    "UNIT_ROUNDOFF",
    "ShapeClass",
    "backend_report",
    "backend_status",
    "check_first_use",
    "reset",
    "shape_class",
]

logger = logging.getLogger("ds_canzona.kernels")

# The public operations, in the order the report lists them.
OPERATIONS = ("xxt", "sym_matmul", "ns_step", "sym_stat_update_", "coupled_newton_step", "inverse_root_newton")

UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}

# Relative Frobenius error against float64, in units of the output dtype's unit roundoff
# (docs/KERNELS.md, "Tests and tolerances", where each is derived and measured).
BOUND_U: dict[str, dict[torch.dtype, float]] = {
    # one product rounded once to a 16-bit output; fp32: a random walk of ~sqrt(k) roundings
    "xxt": {torch.float16: 1.0, torch.bfloat16: 1.0, torch.float32: 16.0},
    "sym_matmul": {torch.float16: 1.0, torch.bfloat16: 1.0, torch.float32: 16.0},
    # three products, A and B rounded to the dtype, their rounding scaled by up to 7
    "ns_step": {torch.float16: 2.0, torch.bfloat16: 2.0, torch.float32: 16.0},
    # beta stat + (1 - beta) g gᵀ in fp32, rounded once to the statistic's dtype
    "sym_stat_update_": {torch.float16: 1.0, torch.bfloat16: 1.0, torch.float32: 16.0},
    # four chained products of matrices with ||M - I|| < 1, each rounded once
    "coupled_newton_step": {torch.float16: 4.0, torch.bfloat16: 4.0, torch.float32: 16.0},
}
# Or no worse than this many times the torch reference's own error on the same input.
TORCH_FACTOR = 2.0
# Above this relative error of the torch reference, the input decides nothing.
INCONCLUSIVE_TORCH_ERROR = 0.1
# Inconclusive inputs of one class before that class gives up on the kernel.
MAX_INCONCLUSIVE = 4


@dataclasses.dataclass(frozen=True)
class ShapeClass:
    """What one first-use check covers: ``key`` compares, ``text`` names it in logs."""

    key: tuple
    text: str


def _layout(t: torch.Tensor) -> tuple[str, tuple[bool, ...]]:
    """('row-major' | 'column-major' | 'strided', divisibility by 16 of each non-unit stride)."""
    row_stride, col_stride = t.stride()[-2:]
    if col_stride == 1:
        kind = "row-major"
    elif row_stride == 1:
        kind = "column-major"
    else:
        kind = "strided"
    return kind, tuple(s % 16 == 0 for s in t.stride() if s != 1)


def shape_class(op: str, tensors: Sequence[torch.Tensor], config: TileConfig | None) -> ShapeClass:
    """The class of a call of ``op`` on ``tensors`` (see the module docstring for what it holds)."""
    parts: list[tuple] = []
    for t in tensors:
        rows, cols = t.shape[-2:]
        kind, strides16 = _layout(t)
        parts.append((
            t.dtype, t.ndim > 2, rows % 16 == 0, cols % 16 == 0, rows >= 1024, cols >= 1024,
            "wide" if rows < cols else "square" if rows == cols else "tall", kind, strides16, t.data_ptr() % 16 == 0,
        ))
    described: list[str] = []
    for t, part in zip(tensors, parts):
        described.append(f"{str(t.dtype).removeprefix('torch.')} {list(t.shape)} {part[7]}"
                         + (f" ({_tails(*t.shape[-2:])})" if part[2] is False or part[3] is False else "")
                         + ("" if part[9] else " unaligned"))
    counts = {d: described.count(d) for d in dict.fromkeys(described)}  # first appearance order
    text = ", ".join(d if n == 1 else f"{n} x {d}" for d, n in counts.items())
    text += f", tiles {config.block_m}x{config.block_n}x{config.block_k}" if config else ""
    return ShapeClass(key=(op, tuple(parts), config), text=text)


def _tails(rows: int, cols: int) -> str:
    return ", ".join(f"{name} % 16 = {size % 16}" for name, size in (("rows", rows), ("cols", cols)) if size % 16)


# --- the state of every operation (one process) ------------------------------------------------


@dataclasses.dataclass
class _OpState:
    validated: dict[tuple, str] = dataclasses.field(default_factory=dict)
    gave_up: dict[tuple, str] = dataclasses.field(default_factory=dict)
    inconclusive: dict[tuple, int] = dataclasses.field(default_factory=dict)
    fallback: str | None = None
    routes: dict[tuple[str, str], int] = dataclasses.field(default_factory=dict)


_lock = threading.Lock()
_states: dict[str, _OpState] = {}


def _state(op: str) -> _OpState:
    with _lock:
        return _states.setdefault(op, _OpState())


def reset() -> None:
    """Forget every check, fallback and route (tests; a new device or driver)."""
    with _lock:
        _states.clear()


def record_route(op: str, implementation: str, reason: str) -> None:
    """Count one call of ``op`` routed to ``implementation`` ('triton' | 'torch') for ``reason``."""
    state = _state(op)
    with _lock:
        state.routes[(implementation, reason)] = state.routes.get((implementation, reason), 0) + 1


def fallback_reason(op: str) -> str | None:
    """Why ``op`` runs on torch for the rest of the process, or None."""
    return _state(op).fallback


def class_verdict(op: str, cls: ShapeClass) -> str | None:
    """'validated', 'gave up' or None (unchecked) for ``cls`` of ``op``."""
    state = _state(op)
    if cls.key in state.validated:
        return "validated"
    if cls.key in state.gave_up:
        return "gave up"
    return None


# --- the check -------------------------------------------------------------------------------


class _Inconclusive(Exception):
    pass


def _leaves(result: Any) -> list[torch.Tensor]:
    return list(result) if isinstance(result, (tuple, list)) else [result]


def _judge(op: str, got: Any, want: Any, expected: Any) -> str | None:
    """None when the kernel's ``got`` passes against the float64 ``expected``, else what is wrong."""
    got_leaves, want_leaves, expected_leaves = _leaves(got), _leaves(want), _leaves(expected)
    if len(got_leaves) != len(expected_leaves):
        return f"returned {len(got_leaves)} tensors, the reference {len(expected_leaves)}"
    for g, w, e in zip(got_leaves, want_leaves, expected_leaves):
        if not isinstance(g, torch.Tensor) or g.shape != e.shape or g.dtype != w.dtype:
            what = f"{tuple(g.shape)} {g.dtype}" if isinstance(g, torch.Tensor) else type(g).__name__
            return f"returned {what}, the reference {tuple(w.shape)} {w.dtype}"
        # one host read for the whole verdict of this tensor
        distances = torch.stack([(g.double() - e).norm(), (w.double() - e).norm(), e.norm()])
        kernel_dist, torch_dist, scale = distances.tolist()
        torch_err = torch_dist / scale if 0.0 < scale < float("inf") else float("nan")
        if not torch_err <= INCONCLUSIVE_TORCH_ERROR:
            raise _Inconclusive(f"float64 result norm {scale:.3g}, torch reference error {torch_err:.3g}")
        kernel_err = kernel_dist / scale
        bound = max(BOUND_U[op][g.dtype] * UNIT_ROUNDOFF[g.dtype], TORCH_FACTOR * torch_err)
        if not kernel_err <= bound:
            return (f"relative error {kernel_err:.3g} against float64 > bound {bound:.3g} "
                    f"({BOUND_U[op][g.dtype]:g} u of {str(g.dtype).removeprefix('torch.')}, "
                    f"or {TORCH_FACTOR:g}x torch's {torch_err:.3g})")
    return None


def _clone(result: Any) -> Any:
    if isinstance(result, (tuple, list)):
        return type(result)(t.clone() for t in result)
    return result.clone()


def check_first_use(
    op: str,
    kernel_name: str,
    cls: ShapeClass,
    *,
    triton: Callable[[], Any],
    reference: Callable[[], Any],
    oracle: Callable[[], Any],
    writes: Sequence[torch.Tensor] = (),
) -> tuple[Any, str, str]:
    """Run the first call of ``cls``: the oracle, the reference and the kernel.

    Returns (the result to use, the implementation it came from, why). ``writes``: the tensors the
    operation updates in place (``out``, the statistic); each run starts from their original
    values, and the call leaves in them the result it returns.
    """
    expected = oracle()  # from the untouched inputs (an out= may alias an input, as c in sym_matmul)
    before = [w.clone() for w in writes]
    want = reference()  # a reference error is the caller's (a bad shape): raise it, judge nothing
    want_copy = _clone(want)
    reference_writes = [w.clone() for w in writes]
    for w, b in zip(writes, before):
        w.copy_(b)
    del before
    inconclusive = None
    try:
        got = triton()
        verdict = _judge(op, got, want_copy, expected)
    except _Inconclusive as why:
        verdict, inconclusive = None, str(why)
    except Exception as err:  # a compile, launch or shape error of the Triton path
        verdict = f"{type(err).__name__}: {err}"
    state = _state(op)
    if verdict is None and inconclusive is None:
        with _lock:
            state.validated[cls.key] = cls.text
        logger.info("ds_canzona.kernels: %s (%s) passed its first-use check on %s", op, kernel_name, cls.text)
        return got, "triton", "passed its first-use check"
    for w, r in zip(writes, reference_writes):
        w.copy_(r)
    if inconclusive is not None:
        with _lock:
            count = state.inconclusive[cls.key] = state.inconclusive.get(cls.key, 0) + 1
            if count >= MAX_INCONCLUSIVE:
                state.gave_up[cls.key] = f"{cls.text}: {count} inconclusive inputs ({inconclusive})"
        logger.info("ds_canzona.kernels: %s first-use check on %s inconclusive (%s); torch result used",
                    op, cls.text, inconclusive)
        return want, "torch", "first-use check inconclusive (the input decides nothing)"
    with _lock:
        first = state.fallback is None
        if first:
            state.fallback = f"{kernel_name} on {cls.text}: {verdict}"
    if first:
        _warn_rank0(f"ds_canzona.kernels: the Triton kernel {kernel_name} failed its first-use check for {op} "
                    f"on {cls.text}: {verdict}. {op} runs on torch for the rest of this process "
                    f"(canzona.kernels: \"torch\" silences this; \"triton\" raises instead).")
    return want, "torch", "failed its first-use check"


def _rank() -> int:
    """This process's rank: DeepSpeed's once its process group is up (never imported here), else 0."""
    dist = sys.modules.get("deepspeed.comm")
    try:
        return dist.get_rank() if dist is not None and dist.is_initialized() else 0
    except Exception:  # a DeepSpeed that cannot say: one process
        return 0


def _warn_rank0(message: str) -> None:
    rank = _rank()
    if rank == 0:
        logger.warning(message)
    else:  # every rank checks its own kernels; the others' fallbacks are in their backend_report()
        logger.info("(rank %d) %s", rank, message)


# --- the report ------------------------------------------------------------------------------


def backend_status() -> dict[str, dict[str, Any]]:
    """Per operation: 'backend' ('triton', 'torch', 'both' or 'not called'), 'routes'
    ({(implementation, reason): calls}), 'validated' and 'gave_up' (shape class texts) and
    'fallback' (why the operation runs on torch for good, or None)."""
    out: dict[str, dict[str, Any]] = {}
    with _lock:
        states = {op: dataclasses.replace(_states[op]) if op in _states else _OpState() for op in OPERATIONS}
    for op, state in states.items():
        used = {implementation for implementation, _ in state.routes}
        out[op] = {
            "backend": "not called" if not used else used.pop() if len(used) == 1 else "both",
            "routes": dict(state.routes),
            "validated": list(state.validated.values()),
            "gave_up": list(state.gave_up.values()),
            "fallback": state.fallback,
        }
    return out


def backend_report(backend: str) -> str:
    """Which implementation each operation ran and why, with call counts (for logs and users)."""
    lines = [f"ds_canzona.kernels, backend {backend!r}:"]
    for op, status in backend_status().items():
        lines.append(f"  {op}: {status['backend']}")
        for (implementation, reason), calls in status["routes"].items():
            lines.append(f"    {implementation}: {reason} ({calls} call{'s' if calls != 1 else ''})")
        if status["fallback"]:
            lines.append(f"    on torch for the rest of the process: {status['fallback']}")
        lines += [f"    passed its first-use check: {text}" for text in status["validated"]]
        lines += [f"    torch for {text}" for text in status["gave_up"]]
    return "\n".join(lines)
