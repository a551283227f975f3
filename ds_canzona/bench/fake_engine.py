"""DeepSpeed engines under torch's ``FakeTensorMode``: every tensor has a shape and a dtype, and no storage.

Inside :func:`fake_tensors` the model, the engine, its buffers and every operation of a training
step produce fake tensors (``torch._subclasses.fake_tensor``): shapes, dtypes and devices are
computed, nothing is allocated or computed. So a stage-1/2 engine of Qwen3-32B, where every rank
holds the whole model, builds and steps in a few seconds on a machine with a few GiB. The control
flow of the runtimes depends on shapes, plans and configs, which are all real; what it can not
have is a value, and the few places that read one on the host are answered here:

- a host read of a tensor's value (``.item()``, ``float(t)``, ``bool(t)``: ATen's
  ``_local_scalar_dense``, ``is_nonzero``) returns 0, unless the tensor was made from Python
  numbers (``torch.tensor(...)``), whose value FakeTensorMode keeps: then it is that value
  (DeepSpeed's ZeRO-3 broadcasts such lists from rank 0 and checks them). The runtimes read the gradient norm and the
  overflow flag this way: a norm of 0 is finite, so no step is skipped and clipping is a no-op
  (the clip coefficient is then not applied, which changes no collective);
- ``torch.equal`` returns True (ds_canzona compares the plan digests all ranks sent; every rank of
  the fake world is this process, so they agree).

- ``Module.to`` to the device and dtype a module already has returns the module (DeepSpeed moves
  the model to its device; torch would swap every fake parameter for a new one, which fails on
  parameters that something holds a weak reference to).

- DeepSpeed's ``get_lst_from_rank0`` (ZeRO-3's check, in the first steps, that every rank traced
  the same module order) broadcasts the list as before and returns this process's own list: this
  process is rank 0, and the value of each element read back is lost in fake tensors;
- DeepSpeed's fused multi-tensor kernels (``MultiTensorApply``, the AdamW of its Muon's non-matrix
  parameters) do nothing: they are compiled code that reads raw storage pointers, which fake
  tensors do not have, and they issue no collective.

Nothing else is patched. Collectives never reach a process group (``collective_log`` records
them and writes stand-in values, which on fake tensors are fake too).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["fake_tensors"]


class _HostValues(TorchDispatchMode):
    """Answers the ATen calls that hand a value to the host, which fake tensors do not have."""

    def __init__(self) -> None:
        super().__init__()
        aten = torch.ops.aten
        self.answers = {aten._local_scalar_dense.default: 0, aten.is_nonzero.default: False,
                        aten.equal.default: True}
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func not in self.answers:
            return func(*args, **(kwargs or {}))
        self.reads += 1
        constants = [getattr(t, "constant", None) for t in args if isinstance(t, torch.Tensor)]
        if all(c is not None for c in constants):
            # A tensor made from Python numbers (torch.tensor(...)): FakeTensorMode keeps its value.
            return func(*constants, **(kwargs or {}))
        if func is torch.ops.aten._local_scalar_dense.default:
            dtype = args[0].dtype
            return False if dtype == torch.bool else 0.0 if dtype.is_floating_point else 0
        return self.answers[func]


@contextlib.contextmanager
def fake_tensors(*, enabled: bool) -> Iterator[None]:
    """Every tensor made in the block is fake (see the module docstring); a no-op when not ``enabled``."""
    if not enabled:
        yield
        return
    from torch._subclasses.fake_tensor import FakeTensorMode

    original_to = torch.nn.Module.to

    def to(module, *args, **kwargs):
        device, dtype, _, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        tensors = list(module.parameters()) + list(module.buffers())
        if dtype is None and memory_format is None and all(device is None or t.device == device for t in tensors):
            return module
        return original_to(module, *args, **kwargs)

    from deepspeed.ops.adam.multi_tensor_apply import MultiTensorApply
    original_apply = MultiTensorApply.__call__
    MultiTensorApply.__call__ = lambda self, op, noop_flag_buffer, tensor_lists, *args: None

    import deepspeed.runtime.zero.utils as zero_utils
    original_list_from_rank0 = zero_utils.get_lst_from_rank0

    def get_lst_from_rank0(lst):
        original_list_from_rank0(lst)  # its broadcast
        return list(lst)

    zero_utils.get_lst_from_rank0 = get_lst_from_rank0
    torch.nn.Module.to = to
    try:
        # Real tensors made before the block (DeepSpeed's module-level constants) may meet fake ones.
        with FakeTensorMode(allow_non_fake_inputs=True), _HostValues():
            yield
    finally:
        torch.nn.Module.to = original_to
        MultiTensorApply.__call__ = original_apply
        zero_utils.get_lst_from_rank0 = original_list_from_rank0
