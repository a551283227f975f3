"""Counting host synchronisations: the places where the host waits for a value the device computed.

On a GPU each such wait stalls Python until every kernel queued before it has run, so an
optimizer step that reads a device value per tensor, or once per Newton iteration, runs at the
pace of the host instead of the device's. ``HostSyncCounter`` counts them over a block of code::

    with HostSyncCounter() as syncs:
        engine.step()
    syncs.count   # how many
    syncs.sites   # one short string per sync: what, and the innermost ds_canzona/deepspeed frame

What counts (a TorchDispatchMode sees the aten operations, a TorchFunctionMode the Python-level
reads that never reach the dispatcher on the CPU, and the explicit waits are wrapped):

* value reads: ``aten._local_scalar_dense`` (behind ``item``, ``bool``, ``float``, ``int`` and
  formatting), ``aten.is_nonzero``, ``aten.equal``;
* results whose size depends on the values: ``nonzero`` (also behind ``torch.where(cond)`` and
  ``argwhere``), ``masked_select``, indexing or index assignment with a boolean mask, ``unique``,
  ``bincount``, ``repeat_interleave`` with a tensor of repeats and no ``output_size``;
* kernels that check their result on the host: ``torch.linalg.eigh`` and ``svd`` (cuSOLVER's
  ``info``), and the error check (``aten._linalg_check_errors``) behind ``cholesky``, ``inv``,
  ``solve`` and the other ``*_ex``-based functions. ``torch.linalg.qr`` is not among them:
  PyTorch's cuSOLVER and cuBLAS QR paths read ``info`` only in debug builds;
* blocking copies between the host and the device, both ways (``.cpu()``, ``.tolist()``,
  ``.numpy()``, ``.to("cpu")``, ``copy_``; PyTorch waits on the stream after a blocking copy to
  the device too);
* explicit waits: ``get_accelerator().synchronize()``, ``torch.cuda.synchronize()``, a CUDA
  stream's or event's ``synchronize()``, ``deepspeed.comm.barrier()``.

What "the device" is (``device=``, by default the DeepSpeed accelerator's device type):

* on a GPU (``"cuda"``): a read counts when the tensor read is on the GPU. CPU tensors are the
  host's own memory; reading them waits for nothing.
* on the CPU (``"cpu"``, DeepSpeed's CPU accelerator): the CPU stands in for the device, so every
  CPU tensor counts except those that live on the host by design: the optimizers' step counters
  (made by ``ds_canzona.optim.base.new_step``, recognised by identity) and the tensors passed in
  ``exclude=``. A CPU run so counts where a GPU run would wait: ``.cpu()``, ``.tolist()`` and
  ``.numpy()`` of a CPU tensor count although they copy nothing, an accelerator ``synchronize()``
  counts although the CPU accelerator's does nothing. What cannot be told apart from host work
  there is not counted: copies from the host to the device, and ``.to(device)``, which names the
  CPU both when code means "to the host" and when it means "to the device the model is on".

Non-blocking copies and ``wait()`` on a collective's handle do not count: neither makes the host
wait for the device (NCCL's ``wait`` makes the current stream wait, not the host). The modes add
Python work to every operation: time code outside the counter, not inside it.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from ds_canzona.optim.base import is_step_counter

__all__ = ["HostSync", "HostSyncCounter"]

aten = torch.ops.aten

# aten operations whose result is a host value read from the tensor.
_VALUE_READS = frozenset({aten._local_scalar_dense, aten.is_nonzero, aten.equal})
# Operations whose output size depends on the values: the host reads the size before allocating.
_VALUE_SHAPED = frozenset({aten.nonzero, aten.masked_select, aten._unique, aten._unique2, aten.unique_dim,
                           aten.unique_consecutive, aten.unique_dim_consecutive, aten.bincount})
# Indexing that turns a boolean mask into indices (a nonzero inside the kernel).
_INDEXING = frozenset({aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_})
# Kernels whose CUDA implementation reads the solver's ``info`` on the host before returning.
_HOST_CHECKED = frozenset({aten._linalg_eigh, aten._linalg_svd, aten._linalg_check_errors})
# Python-level reads that the CPU serves without a dispatcher call (so the dispatch mode cannot
# see them on a CPU run; on a GPU they dispatch a copy to the host, which it does see).
_HOST_COPY_METHODS = frozenset({"tolist", "numpy", "__array__", "cpu"})


@dataclass(frozen=True)
class HostSync:
    """One host synchronisation: what it was, and where.

    ``site`` is the innermost ds_canzona or deepspeed frame ("module:line (function)"); ``origin``
    the innermost frame outside torch, where that is somewhere else (the model's code, run by
    DeepSpeed's ``engine.forward``), else None.
    """

    what: str
    site: str
    origin: str | None = None

    def __str__(self) -> str:
        return f"{self.what} at {self.site}" + (f" in {self.origin}" if self.origin else "")

    @property
    def owner(self) -> str:
        """The top-level package of the code that made it: "ds_canzona", "deepspeed", "transformers", ..."""
        return (self.origin or self.site).split(":")[0].split(".")[0]

    @property
    def ours(self) -> bool:
        """Whether ds_canzona's own code made it (not DeepSpeed's, the model's or the caller's)."""
        return self.owner == "ds_canzona"


def _in_package(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _frame_name(frame) -> str:
    return f"{frame.f_globals.get('__name__', '?')}:{frame.f_lineno} ({frame.f_code.co_name})"


def _where(what: str) -> HostSync:
    """``what`` attributed to the innermost ds_canzona or deepspeed frame and the innermost non-torch one."""
    frame = sys._getframe(1)
    innermost = None
    while frame is not None:
        module = frame.f_globals.get("__name__", "?")
        if module != __name__ and not _in_package(module, "torch"):
            if innermost is None:
                innermost = frame
            if _in_package(module, "ds_canzona") or _in_package(module, "deepspeed"):
                origin = None if frame is innermost else _frame_name(innermost)
                return HostSync(what, _frame_name(frame), origin)
        frame = frame.f_back
    return HostSync(what, _frame_name(innermost) if innermost is not None else "?")


def _tensors(values: Iterable[Any]) -> list[torch.Tensor]:
    """The tensors among ``values``, one level into lists and tuples (aten's ``Tensor?[]`` arguments)."""
    out = []
    for value in values:
        if isinstance(value, torch.Tensor):
            out.append(value)
        elif isinstance(value, (list, tuple)):
            out.extend(v for v in value if isinstance(v, torch.Tensor))
    return out


def _default_device_type() -> str:
    from deepspeed.accelerator import get_accelerator

    return torch.device(get_accelerator().device_name()).type


class HostSyncCounter:
    """Counts host synchronisations inside a ``with`` block (see the module docstring).

    ``device``: the device type whose tensors count ("cuda", "cpu", ...); by default DeepSpeed's
    accelerator's. ``exclude``: tensors never counted (host tensors by design, on a CPU run); the
    optimizers' step counters are excluded without being named. Counters nest: each counts
    everything inside its own block.
    """

    def __init__(self, *, device: str | torch.device | None = None, exclude: Iterable[torch.Tensor] = ()):
        self.device_type = torch.device(device).type if device is not None else _default_device_type()
        self._excluded = {id(t): t for t in exclude}  # held, so an id cannot be reused while we run
        self.events: list[HostSync] = []
        self._modes: list[Any] = []
        self._restore: list[tuple[Any, str, Any, bool]] = []
        self._in_wait = threading.local()

    # -- results ------------------------------------------------------------------------------

    @property
    def count(self) -> int:
        return len(self.events)

    @property
    def sites(self) -> list[str]:
        return [str(event) for event in self.events]

    # -- deciding what counts -----------------------------------------------------------------

    def counts(self, tensor: torch.Tensor) -> bool:
        """Whether reading ``tensor`` on the host waits for the device."""
        if tensor.device.type != self.device_type:
            return False
        if self._excluded.get(id(tensor)) is tensor:
            return False
        return not is_step_counter(tensor)

    def _record(self, what: str) -> None:
        self.events.append(_where(what))

    def _on_dispatch(self, func, args: tuple, kwargs: dict) -> None:
        packet = func.overloadpacket
        name = f"aten.{packet.__name__}"
        if packet in _VALUE_READS or packet in _VALUE_SHAPED or packet in _HOST_CHECKED:
            if any(self.counts(t) for t in _tensors(args)):
                self._record(name)
        elif packet in _INDEXING:
            masks = [t for t in _tensors(args[1:2]) if t.dtype in (torch.bool, torch.uint8)]
            if any(self.counts(m) for m in masks):
                self._record(f"{name} (boolean mask)")
        elif packet is aten.repeat_interleave:
            repeats = args[0] if args else None
            if (func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None
                    and isinstance(repeats, torch.Tensor) and self.counts(repeats)):
                self._record(name)
        elif packet is aten._to_copy or packet is aten.copy_:
            self._on_copy(name, func, args, kwargs)

    def _on_copy(self, name: str, func, args: tuple, kwargs: dict) -> None:
        if self.device_type == "cpu":
            return  # host and device are one memory: nothing is copied between them
        if func.overloadpacket is aten._to_copy:
            source = args[0]
            target = torch.device(kwargs["device"]) if kwargs.get("device") is not None else source.device
            non_blocking = kwargs.get("non_blocking", False)
        else:
            source = args[1] if isinstance(args[1], torch.Tensor) else None
            if source is None:
                return
            target = args[0].device
            non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
        if non_blocking:
            return
        if target.type == "cpu" and self.counts(source):
            self._record(f"{name} (device to host)")
        elif source.device.type == "cpu" and target.type == self.device_type:
            self._record(f"{name} (host to device)")

    def _on_function(self, func, args: tuple, kwargs: dict) -> None:
        """Python-level copies to the host of a CPU tensor: free on a CPU run, a wait on a GPU."""
        name = getattr(func, "__name__", "")
        if name in _HOST_COPY_METHODS and args and isinstance(args[0], torch.Tensor) and self.counts(args[0]):
            self._record(f"Tensor.{name}")

    # -- explicit waits -----------------------------------------------------------------------

    def _wrap_wait(self, owner: Any, attribute: str, what: str) -> None:
        original = getattr(owner, attribute, None)
        if original is None:
            return
        had_own = isinstance(owner, type) or attribute in getattr(owner, "__dict__", {})
        in_wait = self._in_wait

        def wait(*args, **kwargs):
            # Only the outermost wait counts: the accelerator's synchronize calls torch.cuda's.
            if getattr(in_wait, "active", False):
                return original(*args, **kwargs)
            in_wait.active = True
            try:
                self._record(what)
                return original(*args, **kwargs)
            finally:
                in_wait.active = False

        setattr(owner, attribute, wait)
        self._restore.append((owner, attribute, original, had_own))

    def _install_waits(self) -> None:
        import deepspeed.comm as dist
        from deepspeed.accelerator import get_accelerator

        self._wrap_wait(get_accelerator(), "synchronize", "accelerator.synchronize")
        self._wrap_wait(dist, "barrier", "deepspeed.comm.barrier")
        if self.device_type == "cuda":
            self._wrap_wait(torch.cuda, "synchronize", "torch.cuda.synchronize")
            self._wrap_wait(torch.cuda.Stream, "synchronize", "Stream.synchronize")
            self._wrap_wait(torch.cuda.Event, "synchronize", "Event.synchronize")

    def _remove_waits(self) -> None:
        while self._restore:
            owner, attribute, original, had_own = self._restore.pop()
            if had_own:
                setattr(owner, attribute, original)
            else:
                delattr(owner, attribute)  # the class's method shows through again

    # -- the context --------------------------------------------------------------------------

    def __enter__(self) -> HostSyncCounter:
        if self._modes:
            raise RuntimeError("a HostSyncCounter is not re-entrant; nest a new one instead")
        self._install_waits()
        self._modes = [_DispatchCounter(self)]
        if self.device_type == "cpu":
            self._modes.append(_FunctionCounter(self))
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc_info) -> None:
        while self._modes:
            self._modes.pop().__exit__(*exc_info)
        self._remove_waits()


class _DispatchCounter(TorchDispatchMode):

    def __init__(self, counter: HostSyncCounter):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.counter._on_dispatch(func, args, kwargs)
        return func(*args, **kwargs)


class _FunctionCounter(TorchFunctionMode):

    def __init__(self, counter: HostSyncCounter):
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.counter._on_function(func, args, kwargs)
        return func(*args, **kwargs)
