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

Two more patches (:func:`deepspeed_zero3_rearranged_at_once`) replace loops of DeepSpeed's ZeRO-3
that copy one slice per rank: at DP=1024 they are millions of fake-tensor operations per step
(about 0.3 ms each here), which is why DeepSpeed's ZeRO-3 at DP 256 and 1024 did not finish in 16
minutes. Each replacement issues the same collectives, on the same buffers' sizes, and produces the
same values with one copy per parameter (tests/test_bench_collectives.py checks both on real tensors):

- ``AllGatherCoalescedHandle.wait`` (the end of every parameter fetch) cut each parameter out of
  the P gathered partitions with P ``narrow`` and one ``cat``; here the partitions are stacked into
  a (P, partition) table once and each parameter is its columns, read row by row;
- ``DeepSpeedZeroOptimizer_Stage3._partitioned_buffers_all_gather`` (its Muon's all-gather of the
  gradient and momentum partitions) rearranged the gathered buffer with P ``narrow`` + ``copy_``
  per parameter; here the same one ``all_gather_into_tensor`` fills a (P, local) table, read the
  same way. Its cache of scratch buffers (memory, not communication) is not used.

Nothing else is patched. Collectives never reach a process group (``collective_log`` records
them and writes stand-in values, which on fake tensors are fake too).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["deepspeed_zero3_rearranged_at_once", "fake_tensors"]


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


def _columns(table: torch.Tensor, start: int, width: int, numel: int) -> torch.Tensor:
    """The first ``numel`` elements of columns [start, start + width) of ``table``, read row by row."""
    return table[:, start:start + width].reshape(-1)[:numel]


@contextlib.contextmanager
def deepspeed_zero3_rearranged_at_once() -> Iterator[None]:
    """DeepSpeed's ZeRO-3 with its per-rank copy loops done as one copy per parameter (module docstring)."""
    import deepspeed.comm as dist
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.zero.partition_parameters import AllGatherCoalescedHandle, ZeroParamStatus
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Stage3

    original_wait = AllGatherCoalescedHandle.wait
    original_gather = Stage3._partitioned_buffers_all_gather

    def wait(handle, handle_dependency=True):
        if (handle.complete or handle.quantization or handle.use_secondary_tensor
                or not get_accelerator().is_synchronized_device()):
            return original_wait(handle, handle_dependency)
        handle.allgather_handle.wait()
        table = torch.stack(list(handle.partitions))  # row r: rank r's partition of every parameter
        start = 0
        for param in handle.params:
            if param.ds_status != ZeroParamStatus.INFLIGHT:
                raise RuntimeError(f"expected param {param.ds_summary()} to be inflight")
            width = param.ds_tensor.ds_numel
            param.data = _columns(table, start, width, param.ds_numel).view(param.ds_shape).to(param.ds_tensor.dtype)
            param.ds_status = ZeroParamStatus.AVAILABLE
            start += width
        handle.complete = True

    def partitioned_buffers_all_gather(optimizer, params, buffers_to_allgather, communication_data_type,
                                       additional_buffers_to_allgather=None):
        group = optimizer._get_param_partition_group(params[0])
        world = dist.get_world_size(group=group)
        if world == 1:
            return original_gather(optimizer, params, buffers_to_allgather, communication_data_type,
                                   additional_buffers_to_allgather)
        optimizer._assert_same_partition_group(params)
        lists = [buffers_to_allgather] + ([additional_buffers_to_allgather]
                                          if additional_buffers_to_allgather is not None else [])
        local = torch.cat([buffer.reshape(-1).to(communication_data_type) for buffers in lists for buffer in buffers])
        gathered = torch.empty(world * local.numel(), dtype=communication_data_type, device=local.device)
        mine = gathered.narrow(0, local.numel() * dist.get_rank(group=group), local.numel())
        mine.copy_(local)
        dist.all_gather_into_tensor(gathered, mine, group=group)
        table = gathered.view(world, local.numel())
        outputs, start = [], 0
        for buffers in lists:
            outputs.append([])
            for param, buffer in zip(params, buffers):
                numel = getattr(param, "ds_numel", param.numel())
                shape = getattr(param, "ds_shape", param.shape)
                outputs[-1].append(_columns(table, start, buffer.numel(), numel).view(shape))
                start += buffer.numel()
        return outputs[0] if additional_buffers_to_allgather is None else outputs

    AllGatherCoalescedHandle.wait = wait
    Stage3._partitioned_buffers_all_gather = partitioned_buffers_all_gather
    try:
        yield
    finally:
        AllGatherCoalescedHandle.wait = original_wait
        Stage3._partitioned_buffers_all_gather = original_gather


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
        with FakeTensorMode(allow_non_fake_inputs=True), _HostValues(), deepspeed_zero3_rearranged_at_once():
            yield
    finally:
        torch.nn.Module.to = original_to
        MultiTensorApply.__call__ = original_apply
        zero_utils.get_lst_from_rank0 = original_list_from_rank0
