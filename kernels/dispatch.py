"""Which implementation runs: ``default``, ``triton`` or ``torch``.

* ``default``: the Triton kernel when Triton is importable, every tensor is on CUDA and the shape and
  dtypes are supported, once the kernel has passed its first-use check for the call's shape class
  (``validation.py``: the kernel against the torch reference and a float64 oracle on the caller's
  input, or on a slice of it of the same class where the input is large; any error in the check or
  a miss sends the operation to torch for the rest of the process, with one warning). The torch
  reference otherwise (CPU tensors, float64, empty inputs, an in-place argument the kernel cannot
  write through a view, ...).
* ``triton``: always the kernel, never checked; an input it cannot take and any error of the kernel
  raise, never a silent fallback. Under ``TRITON_INTERPRET=1`` the kernels take CPU tensors (this
  is how the tests run them).
* ``torch``: always the reference.

``auto``, the former name of ``default``, is still accepted here (``set_backend``, the environment
variable) but not in a config's ``canzona`` section: the HuggingFace Trainer takes every ``"auto"``
value in a DeepSpeed config for a placeholder of its own and stops on one it cannot fill.

Set it with ``set_backend(name)`` or the environment variable ``DS_CANZONA_KERNELS`` (read when
this module is imported). Each (operation, implementation, reason) choice is logged once at INFO
on the ``ds_canzona.kernels`` logger and counted for ``backend_report()``.

``device_type(tensor)`` is the one place the device decision is made: tests replace it so that
CPU tensors count as CUDA (a stand-in device for the first-use check and its fallback).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ds_canzona.kernels import validation
from ds_canzona.kernels._common import (
    MAX_BATCH,
    MAX_OFFSET,
    SUPPORTED_DTYPES,
    TRITON_AVAILABLE,
    TileConfig,
    is_interpreted,
    matrix_extent,
    stack_view,
)

__all__ = [
    "BACKENDS",
    "ENV_VAR",
    "backend_report",
    "backend_status",
    "backend_summary",
    "choose",
    "device_type",
    "get_backend",
    "run",
    "set_backend",
]

BACKENDS = ("default", "triton", "torch")
ALIASES = {"auto": "default"}
ENV_VAR = "DS_CANZONA_KERNELS"

logger = logging.getLogger("ds_canzona.kernels")

_lock = threading.Lock()
_logged: set[tuple[str, str, str]] = set()


def _validate(name: str, source: str) -> str:
    value = str(name).strip().lower()
    value = ALIASES.get(value, value)
    if value not in BACKENDS:
        raise ValueError(f"Invalid {source}={name!r}. Must be one of {', '.join(BACKENDS)}.")
    return value


_backend = _validate(os.environ.get(ENV_VAR, "default") or "default", ENV_VAR)


def set_backend(name: str) -> None:
    """Select ``'default'``, ``'triton'`` or ``'torch'`` for every kernel call from now on (``'auto'``: default).

    First-use checks passed and fallbacks taken under ``default`` are kept across changes.
    """
    global _backend
    _backend = _validate(name, "kernels backend")


def get_backend() -> str:
    """The selected backend name (``'default'`` unless set)."""
    return _backend


def device_type(tensor: torch.Tensor) -> str:
    """The device type the dispatch decides on (``tensor.device.type``; tests stand CPU in for CUDA)."""
    return tensor.device.type


def _triton_refusal(
    kernel: object, tensors: tuple[torch.Tensor, ...], square: int | None, writes: Sequence[torch.Tensor] = ()
) -> str | None:
    """Why the Triton kernel cannot take these tensors, or None when it can (``writes``: the ones it updates in place)."""
    if not TRITON_AVAILABLE:
        return "Triton is not importable"
    if square is not None and square * square > MAX_OFFSET:
        return f"a {square} x {square} result (offsets beyond int32)"
    interpreted = is_interpreted(kernel)
    if len({t.device for t in tensors}) > 1:
        return f"tensors on different devices ({', '.join(sorted({str(t.device) for t in tensors}))})"
    for t in tensors:
        if t.dtype not in SUPPORTED_DTYPES:
            return f"dtype {t.dtype} (kernels take float16, bfloat16, float32)"
        if t.ndim < 2:
            return f"rank {t.ndim} (kernels take matrices or stacks of them)"
        if t.numel() == 0:
            return "empty input"
        if matrix_extent(t) > MAX_OFFSET:
            return f"shape {tuple(t.shape)} (offsets beyond int32)"
        if t.shape[:-2].numel() > MAX_BATCH:
            return f"a stack of more than {MAX_BATCH} matrices"
        if interpreted and t.device.type != "cpu":
            return f"device {t.device} (the interpreter runs on the CPU)"
        if not interpreted and device_type(t) != "cuda":
            return f"device {t.device} (kernels need CUDA)"
    for t in writes:
        if stack_view(t) is None:  # the wrappers write through one (B, r, c) view
            return f"an in-place argument {tuple(t.shape)} whose leading dims do not merge into one view"
    return None


def _route(
    op: str, kernel: object, tensors: tuple[torch.Tensor, ...], square: int | None, writes: Sequence[torch.Tensor] = ()
) -> tuple[str, str]:
    """('torch' | 'triton' | 'check', reason): the reference, the kernel alone, or the kernel once checked."""
    backend = _backend
    if backend == "torch":
        return "torch", "backend 'torch'"
    refusal = _triton_refusal(kernel, tensors, square, writes)
    if refusal is not None:
        if backend == "triton":
            raise ValueError(f"kernels backend 'triton' cannot run {op}: {refusal}")
        return "torch", refusal
    if backend == "triton":
        return "triton", "backend 'triton'" + (" under the interpreter" if is_interpreted(kernel) else "")
    if any(device_type(t) != "cuda" for t in tensors):
        return "torch", "'default' takes Triton on CUDA only; the interpreter runs when 'triton' is forced"
    fallback = validation.fallback_reason(op)
    if fallback is not None:
        return "torch", f"fell back after a failed first-use check ({fallback})"
    return "check", "backend 'default' on CUDA, each shape class checked on first use"


def _log_once(op: str, implementation: str, reason: str) -> None:
    key = (op, implementation, reason)
    if key not in _logged:
        with _lock:
            if key not in _logged:
                _logged.add(key)
                logger.info("ds_canzona.kernels: %s runs on %s (%s)", op, implementation, reason)


def choose(op: str, kernel: object, *tensors: torch.Tensor, square: int | None = None) -> bool:
    """True when ``op`` on ``tensors`` goes to the Triton ``kernel``, False for the torch reference.

    Under ``default`` on CUDA, True means "Triton, subject to the first-use check": ``run`` makes
    that check (and may still fall back); ``choose`` only routes.

    ``square``: the size of a square result the kernel will allocate (xxt's m x m output).
    Raises ValueError when the backend is ``'triton'`` and the kernel cannot take the inputs.
    """
    where, reason = _route(op, kernel, tensors, square)
    implementation = "torch" if where == "torch" else "triton"
    _log_once(op, implementation, reason)
    validation.record_route(op, implementation, reason)
    return where != "torch"


def run(
    op: str,
    kernel: Any,
    arguments: Mapping[str, torch.Tensor | None],
    bind: Callable[..., validation.Thunks],
    *,
    square: int | None = None,
    config: TileConfig | None = None,
    constexprs: Sequence[tuple[str, Any]] = (),
) -> Any:
    """Run ``op`` on the implementation the backend picks; under ``default`` on CUDA, check first use.

    ``arguments``: the call's tensor arguments by name (None for one not given); ``bind(**arguments)``
    gives its ``validation.Thunks`` (the kernel wrapper, the torch reference, the reference on
    float64 copies, the arguments updated in place), and the first-use check binds it to a slice of
    them where the call is large. ``config``: the caller's pinned tiles; ``constexprs``: (name, value)
    of the kernel constexprs the call's values decide (both part of the shape class).
    """
    tensors = tuple(t for t in arguments.values() if t is not None)
    call = bind(**arguments)
    where, reason = _route(op, kernel, tensors, square, call.writes)
    if where == "check":
        cls = validation.shape_class(op, tensors, config, constexprs)
        verdict = validation.class_verdict(op, cls)
        if verdict == "gave up":
            where, reason = "torch", f"no conclusive first-use check for {cls.text}"
        elif verdict == "validated":
            where, reason = "triton", "passed its first-use check"
    if where == "check":
        result, implementation, reason = validation.check_first_use(
            op, getattr(kernel, "__name__", str(kernel)), cls, arguments, bind)
    else:
        implementation = where
        result = call.reference() if where == "torch" else call.triton()
    _log_once(op, implementation, reason)
    validation.record_route(op, implementation, reason)
    return result


def backend_status() -> dict[str, dict[str, Any]]:
    """Per operation: which implementation ran, each route's reason and call count, the shape classes
    that passed their first-use check, and the fallback (``validation.backend_status``)."""
    return validation.backend_status()


def backend_report() -> str:
    """Which implementation each kernel operation ran in this process, and why (with call counts)."""
    return validation.backend_report(_backend)


def backend_summary(device: torch.device | str) -> str:
    """One line for the plan log: what the selected backend does with matrix kernels on ``device``."""
    device = torch.device(device)
    switch = "canzona.kernels, DS_CANZONA_KERNELS or kernels.set_backend"
    if _backend == "torch":
        return f"kernels: torch reference everywhere (backend 'torch'; {switch} selects)"
    if _backend == "triton":
        return "kernels: Triton always (backend 'triton'): no first-use check, and a kernel error raises"
    if not TRITON_AVAILABLE:
        return "kernels: torch reference (Triton is not importable)"
    if device.type != "cuda":
        return f"kernels: torch reference on {device.type} (backend 'default' runs Triton on CUDA only)"
    return ("kernels: Triton on CUDA (backend 'default'), each (operation, shape class) checked on first use "
            "against the torch reference and float64; an operation that fails runs on torch with one warning; "
            f"kernels.backend_report() lists what ran ({switch} forces 'triton' or 'torch')")
