"""First-use check of the Triton kernels: a kernel is trusted on a device only once it has been right there.

Under the ``default`` backend on CUDA, the first call of each (operation, shape class) runs three
things: the float64 reference (the oracle), the torch reference in the call's own precision, and
the Triton kernel. The kernel passes when its relative Frobenius error against the oracle is within
the bound of the operation and output dtype (``BOUND_U``, the documented error of the kernel,
docs/KERNELS.md) or within ``TORCH_FACTOR`` times what the torch reference achieves on the same
input (for inputs less benign than the tests': long reductions, larger norms). After a pass, calls
of that class run the kernel alone.

The check runs on the caller's input when that is small: no tensor of the check (inputs, results,
intermediates) above ``CHECK_MAX_ELEMENTS`` elements. A larger call is checked on a slice of its
own arguments, of the same shape class and compiled variant (``capped_arguments``: every dim of
``LARGE_TILES_FROM`` or more cut to 1024-1055 with its remainder mod 16, a stack cut to
``CHECK_MAX_MATRICES`` matrices), and then runs whole on the implementation the verdict picks; so
the float64 oracle of a 16384 x 53248 matrix (7 GB for its float64 copy alone, over 25 GB for
ns_step's) never exists.

Any exception in the check (of the oracle, the reference, the kernel's compile or launch, or the
comparison) or a miss switches the whole operation to torch for the rest of the process, logs one
warning (rank 0) naming the kernel, the dtypes, the shape and the error, and the call returns the
torch reference's result. The whole operation, not just the class: a kernel that is wrong for one
specialisation has a compiler or driver problem that other classes, each checked on one input
only, may share, and "this operation runs on torch" is a state a reader of the log can act on.

On CUDA the check runs on a stream of its own, synchronised after the references and again after
the kernel, so an asynchronous device fault (an illegal address) surfaces inside the check, charged
to the part that ran last. Such a fault poisons the CUDA context: every later CUDA call of the
process fails, the torch fallback included. The check then raises ``DeviceFault``, naming the
kernel and the shape class and saying to restart with the ``torch`` backend.

An input that cannot tell a right kernel from a wrong one (the oracle zero or not finite, the
torch reference overflowing or more than ``INCONCLUSIVE_TORCH_ERROR`` off) is inconclusive: the
call returns the reference's result and the class stays unchecked; after ``MAX_INCONCLUSIVE``
such inputs the class runs torch for the rest of the process. The check reads its verdict on the
host (synchronisations on first use only) and holds, for that call only, float64 copies of the
checked inputs and copies of the tensors the operation writes in place.

The shape class is everything a compiled kernel or its tile choice specialises on, per tensor as
the wrapper hands it to the kernel: dtype, stacked or not; of each of the last two dims whether
it is 1, its remainder mod 16 and whether it is at least ``LARGE_TILES_FROM`` (``default_config``'s
size regime); wide, square or tall; the layout (row-major, column-major or strided) and of every
stride whether it is 1 and its remainder mod 16; whether the data pointer is 16-byte aligned; plus
the kernel's constexprs taken from the call's values (``HAS_C``: beta non-zero) and a pinned tile
config. Triton specialises an integer argument on == 1 (a constant) and on divisibility by 16, a
pointer on 16-byte alignment; remainders, not just divisibility, because the wrapper derives
further integer arguments from these (a 2-d matrix's batch stride rows * row stride, an
intermediate's m * m) whose divisibility by 16 the remainders of their factors decide.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import sys
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from ds_canzona.kernels._common import LARGE_TILES_FROM, TileConfig, stack_view

__all__ = [
    "BOUND_U",
    "CHECK_MAX_ELEMENTS",
    "CHECK_MAX_MATRICES",
    "INCONCLUSIVE_TORCH_ERROR",
    "MAX_INCONCLUSIVE",
    "OPERATIONS",
    "TORCH_FACTOR",
    "UNIT_ROUNDOFF",
    "DeviceFault",
    "ShapeClass",
    "Thunks",
    "backend_report",
    "backend_status",
    "capped_arguments",
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
# A call whose stacks of max(rows, cols)-square matrices stay within this many elements is checked
# on its own input: no tensor of the check is larger (inputs, results, ns_step's min(m, n)-square
# intermediates), so no float64 tensor of the oracle is over 32 MiB. A larger call is checked on
# a slice (``capped_arguments``), whose tensors are at most 2 x 1055 x 1055 elements.
CHECK_MAX_ELEMENTS = 2**22
# Matrices of a stack the sliced check keeps: two, so that the batch offset is exercised.
CHECK_MAX_MATRICES = 2


class DeviceFault(RuntimeError):
    """A device fault during a first-use check: the CUDA context is lost, the process cannot go on."""


@dataclasses.dataclass(frozen=True)
class ShapeClass:
    """What one first-use check covers: ``key`` compares, ``text`` names it in logs."""

    key: tuple
    text: str


@dataclasses.dataclass(frozen=True)
class Thunks:
    """One call of an operation, bound to its arguments: the Triton wrapper, the torch reference,
    the reference on float64 copies (the oracle), and the arguments the call updates in place."""

    triton: Callable[[], Any]
    reference: Callable[[], Any]
    oracle: Callable[[], Any]
    writes: tuple[torch.Tensor, ...] = ()


def _launched(t: torch.Tensor) -> tuple[tuple[int, ...], bool, bool]:
    """(strides, 16-byte aligned, copied) of ``t`` as the wrapper hands it to the kernel: its
    (B, r, c) view, or the fresh contiguous stack ``as_stack`` copies leading dims that do not merge
    into (the caching allocators align every block to far more than 16 bytes)."""
    view = stack_view(t)
    if view is None:
        rows, cols = t.shape[-2:]
        return (rows * cols, cols, 1), True, True
    return view.stride(), view.data_ptr() % 16 == 0, False


def _layout(strides: Sequence[int]) -> str:
    row_stride, col_stride = strides[-2:]
    if col_stride == 1:
        return "row-major"
    if row_stride == 1:
        return "column-major"
    return "strided"


def _integer_facts(value: int) -> tuple[bool, int]:
    """What Triton specialises an integer argument on (== 1, divisibility by 16), as the remainder
    mod 16, which also decides the divisibility of products the wrapper forms from it."""
    return value == 1, value % 16


def shape_class(
    op: str,
    tensors: Sequence[torch.Tensor],
    config: TileConfig | None,
    constexprs: Sequence[tuple[str, Any]] = (),
) -> ShapeClass:
    """The class of a call of ``op`` on ``tensors`` (see the module docstring for what it holds).

    ``constexprs``: (name, value) of the kernel's constexprs that the call's values decide (HAS_C).
    """
    parts: list[tuple] = []
    described: list[str] = []
    for t in tensors:
        rows, cols = t.shape[-2:]
        strides, aligned, copied = _launched(t)
        kind = _layout(strides)
        parts.append((
            t.dtype, t.ndim > 2,
            *((*_integer_facts(size), size >= LARGE_TILES_FROM) for size in (rows, cols)),
            "wide" if rows < cols else "square" if rows == cols else "tall",
            kind, tuple(_integer_facts(stride) for stride in strides), aligned,
        ))  # not whether leading dims were copied: the kernel sees the copy's strides and pointer, as above
        described.append(f"{str(t.dtype).removeprefix('torch.')} {list(t.shape)} {kind}"
                         + (f" ({_tails(rows, cols)})" if rows % 16 or cols % 16 else "")
                         + (" (leading dims copied into one)" if copied else "")
                         + ("" if aligned else " unaligned"))
    counts = {d: described.count(d) for d in dict.fromkeys(described)}  # first appearance order
    text = ", ".join(d if n == 1 else f"{n} x {d}" for d, n in counts.items())
    text += "".join(f", {name}={value}" for name, value in constexprs)
    text += f", tiles {config.block_m}x{config.block_n}x{config.block_k}" if config else ""
    return ShapeClass(key=(op, tuple(parts), tuple(constexprs), config), text=text)


def _tails(rows: int, cols: int) -> str:
    return ", ".join(f"{name} % 16 = {size % 16}" for name, size in (("rows", rows), ("cols", cols)) if size % 16)


# --- the slice a large call is checked on ------------------------------------------------------


def _check_footprint(tensors: Iterable[torch.Tensor]) -> int:
    """Elements of the largest tensor a check of these arguments may hold, bounded by each
    argument's stack of max(rows, cols)-square matrices (xxt's m x m result of an m x k input)."""
    return max(t.shape[:-2].numel() * max(t.shape[-2:]) ** 2 for t in tensors)


def _capped_sizes(sizes: Iterable[int]) -> dict[int, int]:
    """Each matrix dim of a call -> its length in the sliced check.

    Below ``LARGE_TILES_FROM`` a dim stays. The others become, in increasing order, the shortest
    lengths from ``LARGE_TILES_FROM`` on with their remainder mod 16, each above the one before:
    the order and the equalities between dims survive (wide, square or tall; the m of the
    statistic and the m of g), and so does every fact the shape class holds. One call has at most
    two distinct dims here, so a capped dim is at most 1024 + 15 + 16 = 1055.
    """
    capped: dict[int, int] = {}
    previous = LARGE_TILES_FROM - 1
    for size in sorted(set(sizes)):
        if size < LARGE_TILES_FROM:
            capped[size] = size
            continue
        length = LARGE_TILES_FROM + (size - LARGE_TILES_FROM) % 16
        while length <= previous:
            length += 16
        capped[size] = previous = length
    return capped


def _capped(t: torch.Tensor, sizes: Mapping[int, int]) -> torch.Tensor:
    rows, cols = sizes[t.shape[-2]], sizes[t.shape[-1]]
    view = stack_view(t)
    if view is None:  # the wrapper copies such a stack (as_stack): so does the check, two matrices only
        firsts = itertools.islice(itertools.product(*map(range, t.shape[:-2])), CHECK_MAX_MATRICES)
        return torch.stack([t[index][:rows, :cols] for index in firsts])
    return view[:rows, :cols] if view.ndim == 2 else view[:CHECK_MAX_MATRICES, :rows, :cols]


def capped_arguments(arguments: Mapping[str, torch.Tensor | None]) -> dict[str, torch.Tensor | None] | None:
    """The slice of a call's arguments its first-use check runs on, or None: the call is small
    enough (``CHECK_MAX_ELEMENTS``) to be checked on its own input.

    A slice (the leading rows and columns, the first ``CHECK_MAX_MATRICES`` matrices of a stack)
    keeps the caller's data, data pointer and strides, and ``_capped_sizes`` keeps every dim's
    remainder mod 16, its being 1 and its size regime. So every integer argument of every launch
    (sizes, strides, those the wrapper derives, the intermediates' sizes and strides) has the same
    facts as in the whole call, each pointer the same alignment, ``default_config`` picks the same
    tiles and warps, and the constexprs (dtype flags, HAS_C, tiles) are the same: Triton compiles the
    same variant, and the check tests the kernel the whole call runs. What differs is the grid
    (fewer programs and matrices) and the loop trip counts, so the check does not reach the
    programs of a large triangular tile map (its closed form is tested for every T below 1200,
    tests/test_kernels.py) nor offsets near 2^31 (those go to torch, dispatch's refusals), and the
    rounding error of a reduction longer than 1055 is not measured. One specialisation is not kept:
    a dim beyond 2^31 - 1 (only a stride-0, expanded tensor has one) is an int64 argument, its cut
    an int32 one. Arguments that are one tensor (``out`` is ``c``) stay one tensor.
    """
    tensors = [t for t in arguments.values() if t is not None]
    if _check_footprint(tensors) <= CHECK_MAX_ELEMENTS:
        return None
    sizes = _capped_sizes(size for t in tensors for size in t.shape[-2:])
    cut: dict[int, torch.Tensor] = {}
    for t in tensors:
        if id(t) not in cut:
            cut[id(t)] = _capped(t, sizes)
    return {name: None if t is None else cut[id(t)] for name, t in arguments.items()}


# --- the stream the check runs on --------------------------------------------------------------


class _CheckStream:
    """A CUDA stream of the check's own, synchronised before anything of the check is read, so that
    an asynchronous fault surfaces inside the check; on other devices (the CPU: the interpreter,
    the tests' stand-in device) nothing."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.side = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.caller = torch.cuda.current_stream(device) if self.side is not None else None
        self._within: Any = None

    def __enter__(self) -> _CheckStream:
        if self.side is not None:
            self.side.wait_stream(self.caller)  # the inputs come from work queued on the caller's stream
            self._within = torch.cuda.stream(self.side)
            self._within.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._within is not None:
            within, self._within = self._within, None
            within.__exit__(*exc)

    def synchronize(self) -> None:
        if self.side is not None:
            self.side.synchronize()

    def hand_over(self, tensors: Iterable[Any]) -> None:
        """Results made on the check's stream, returned to the caller: its stream is ordered after
        them, and their memory is not reused while its stream may still read them."""
        if self.side is None:
            return
        self.caller.wait_stream(self.side)
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.device.type == "cuda":
                t.record_stream(self.caller)

    def context_lost(self) -> bool:
        """Whether the CUDA context is poisoned (a sticky fault: every CUDA call fails since)."""
        if self.side is None:
            return False
        try:
            torch.cuda.synchronize(self.device)
        except Exception:
            return True
        return False


# Where the check runs; the tests put a stand-in here (the CPU has no streams).
_check_stream: Callable[[torch.device], _CheckStream] = _CheckStream


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


def _error(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"


@dataclasses.dataclass
class _Outcome:
    """What the check found. ``verdict`` None and ``inconclusive`` None: a pass. ``got`` / ``want``:
    the kernel's and the reference's results, ``before`` / ``reference_writes``: the in-place
    arguments before the check and after the reference (None where that part did not finish)."""

    verdict: str | None = None
    inconclusive: str | None = None
    got: Any = None
    want: Any = None
    before: list[torch.Tensor] | None = None
    reference_writes: list[torch.Tensor] | None = None
    fault: str | None = None  # the part that ran when the CUDA context was lost


def _run_check(op: str, thunks: Thunks, stream: _CheckStream) -> _Outcome:
    """The oracle, the reference and the kernel on ``thunks``' arguments, then the comparison.

    Every exception is caught and becomes the verdict, naming the part that raised. The kernel
    starts from the in-place arguments' values from before the check and leaves its own in them;
    the caller puts back whichever values it returns.
    """
    writes = thunks.writes
    outcome = _Outcome()
    part = "the float64 oracle"
    try:
        with stream:
            expected = thunks.oracle()  # from the untouched inputs (an out= may alias an input, as c in sym_matmul)
            part = "copying the in-place arguments"
            outcome.before = [w.clone() for w in writes]
            part = "the torch reference"
            want = thunks.reference()
            want_copy = _clone(want)
            reference_writes = [w.clone() for w in writes]
            for w, b in zip(writes, outcome.before):
                w.copy_(b)
        part = "the float64 oracle or the torch reference"  # what this synchronisation reports
        stream.synchronize()
    except Exception as err:
        outcome.verdict = f"{part} raised {_error(err)}"
        outcome.fault = part if stream.context_lost() else None
        return outcome
    outcome.want, outcome.reference_writes = want, reference_writes
    try:
        with stream:
            got = thunks.triton()
        stream.synchronize()  # an asynchronous fault of the kernel surfaces here, charged to it
    except Exception as err:  # a compile, launch or shape error of the Triton path, or a device fault
        outcome.verdict = _error(err)
        outcome.fault = "the kernel" if stream.context_lost() else None
        return outcome
    outcome.got = got
    try:
        outcome.verdict = _judge(op, got, want_copy, expected)
    except _Inconclusive as why:
        outcome.inconclusive = str(why)
    except Exception as err:
        outcome.verdict = f"the comparison with float64 raised {_error(err)}"
    return outcome


def _put_back(stream: _CheckStream, writes: Sequence[torch.Tensor], values: Sequence[torch.Tensor] | None) -> None:
    if values is None:
        return
    with stream:
        for w, v in zip(writes, values):
            w.copy_(v)
    stream.synchronize()


def check_first_use(
    op: str,
    kernel_name: str,
    cls: ShapeClass,
    arguments: Mapping[str, torch.Tensor | None],
    bind: Callable[..., Thunks],
) -> tuple[Any, str, str]:
    """Run the first call of ``cls``: check the kernel, then run the call on what the check picks.

    ``bind(**arguments)`` gives the call's ``Thunks``; the check binds the same function to a slice
    of the arguments where the call is large (``capped_arguments``), else checks the call itself.
    Returns (the result to use, the implementation it came from, why). The call's in-place
    arguments end holding the result it returns. Raises ``DeviceFault`` only when the CUDA context
    was lost during the check (nothing can run after that).
    """
    call = bind(**arguments)
    cut = capped_arguments(arguments)
    thunks = call if cut is None else bind(**cut)
    where = cls.text
    if cut is not None:
        shapes = dict.fromkeys(str(list(t.shape)) for t in cut.values() if t is not None)
        where += f" (checked on a slice: {', '.join(shapes)})"
    device = next(t for t in arguments.values() if t is not None).device
    stream = _check_stream(device)
    outcome = _run_check(op, thunks, stream)
    state = _state(op)
    passed = outcome.verdict is None and outcome.inconclusive is None
    if outcome.fault is None and (cut is not None or not passed):
        # The slice is part of the caller's arguments: as before the check, for the call itself.
        # The call checked whole and not passed: the reference's values, or (it did not finish) the first.
        _put_back(stream, thunks.writes, outcome.before if cut is not None or outcome.want is None
                  else outcome.reference_writes)
    if passed:
        with _lock:
            state.validated[cls.key] = cls.text
        logger.info("ds_canzona.kernels: %s (%s) passed its first-use check on %s", op, kernel_name, where)
        if cut is not None:
            return call.triton(), "triton", "passed its first-use check"
        stream.hand_over(_leaves(outcome.got))
        return outcome.got, "triton", "passed its first-use check"
    if outcome.inconclusive is not None:
        with _lock:
            count = state.inconclusive[cls.key] = state.inconclusive.get(cls.key, 0) + 1
            if count >= MAX_INCONCLUSIVE:
                state.gave_up[cls.key] = f"{cls.text}: {count} inconclusive inputs ({outcome.inconclusive})"
        logger.info("ds_canzona.kernels: %s first-use check on %s inconclusive (%s); torch result used",
                    op, where, outcome.inconclusive)
        reason = "first-use check inconclusive (the input decides nothing)"
    else:
        with _lock:
            first = state.fallback is None
            if first:
                state.fallback = f"{kernel_name} on {where}: {outcome.verdict}"
        if outcome.fault is not None:
            message = (f"ds_canzona.kernels: a device fault in {outcome.fault} during the first-use check of the "
                       f"Triton kernel {kernel_name} for {op} on {where}: {outcome.verdict}. It leaves this "
                       f"process's CUDA context unusable (every later CUDA call fails, the torch fallback "
                       f"included), so training cannot go on in this process: restart it with "
                       f"canzona.kernels: \"torch\" (or DS_CANZONA_KERNELS=torch) and report the kernel and "
                       f"the shapes.")
            logger.error(message)
            raise DeviceFault(message)
        if first:
            _warn_rank0(f"ds_canzona.kernels: the Triton kernel {kernel_name} failed its first-use check for {op} "
                        f"on {where}: {outcome.verdict}. {op} runs on torch for the rest of this process "
                        f"(canzona.kernels: \"torch\" silences this; \"triton\" raises instead).")
        reason = "failed its first-use check"
    if cut is None and outcome.want is not None:  # the reference ran on the call itself: its result
        stream.hand_over(_leaves(outcome.want))
        return outcome.want, "torch", reason
    return call.reference(), "torch", reason


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
