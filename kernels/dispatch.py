"""Which implementation runs: ``default``, ``triton`` or ``torch``.

* ``default``: the Triton kernel when Triton is importable, every tensor is on CUDA and the shape and
  dtypes are supported; the torch reference otherwise (CPU tensors, float64, empty inputs, ...).
* ``triton``: always the kernel; an input it cannot take is an error, not a silent fallback.
  Under ``TRITON_INTERPRET=1`` the kernels take CPU tensors (this is how the tests run them).
* ``torch``: always the reference.

``auto``, the former name of ``default``, is still accepted here (``set_backend``, the environment
variable) but not in a config's ``canzona`` section: the HuggingFace Trainer takes every ``"auto"``
value in a DeepSpeed config for a placeholder of its own and stops on one it cannot fill.

Set it with ``set_backend(name)`` or the environment variable ``DS_CANZONA_KERNELS`` (read when
this module is imported). Each (operation, implementation, reason) choice is logged once at INFO
on the ``ds_canzona.kernels`` logger.
"""

from __future__ import annotations

import logging
import os
import threading

import torch

from ds_canzona.kernels._common import (
    MAX_BATCH,
    MAX_OFFSET,
    SUPPORTED_DTYPES,
    TRITON_AVAILABLE,
    is_interpreted,
    matrix_extent,
)

__all__ = ["BACKENDS", "ENV_VAR", "choose", "get_backend", "set_backend"]

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
    """Select ``'default'``, ``'triton'`` or ``'torch'`` for every kernel call from now on (``'auto'``: default)."""
    global _backend
    _backend = _validate(name, "kernels backend")


def get_backend() -> str:
    """The selected backend name (``'default'`` unless set)."""
    return _backend


def _triton_refusal(kernel: object, tensors: tuple[torch.Tensor, ...], square: int | None) -> str | None:
    """Why the Triton kernel cannot take these tensors, or None when it can."""
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
        if not interpreted and t.device.type != "cuda":
            return f"device {t.device} (kernels need CUDA)"
    return None


def choose(op: str, kernel: object, *tensors: torch.Tensor, square: int | None = None) -> bool:
    """True to run the Triton ``kernel`` for ``op`` on ``tensors``, False for the torch reference.

    ``square``: the size of a square result the kernel will allocate (xxt's m x m output).

    Raises ValueError when the backend is ``'triton'`` and the kernel cannot take the inputs.
    """
    backend = _backend
    if backend == "torch":
        use, reason = False, "backend 'torch'"
    else:
        refusal = _triton_refusal(kernel, tensors, square)
        if refusal is not None and backend == "triton":
            raise ValueError(f"kernels backend 'triton' cannot run {op}: {refusal}")
        if refusal is not None:
            use, reason = False, refusal
        elif backend == "default" and is_interpreted(kernel):
            use, reason = False, "'default' takes Triton on CUDA only; the interpreter runs when 'triton' is forced"
        else:
            use, reason = True, f"backend {backend!r}" + (" under the interpreter" if is_interpreted(kernel) else "")
    key = (op, "triton" if use else "torch", reason)
    if key not in _logged:
        with _lock:
            if key not in _logged:
                _logged.add(key)
                logger.info("ds_canzona.kernels: %s runs on %s (%s)", op, key[1], reason)
    return use
