"""Bytes DeepSpeed 0.19.8's offloaded ZeRO-1/2 Muon copies between host and device, per rank per step.

ds_canzona's offload counts its own copies (``OptimizerOffload.counter``). DeepSpeed's do not
count themselves, so ``bench step-offload`` measures them from outside, without touching its
math, in two independent ways that tests/test_offload.py checks against each other:

- ``HostDeviceCopyMeter``: a ``TorchDispatchMode`` active for one step that sees every
  ``aten.copy_`` and counts those with exactly one side in memory DeepSpeed placed on the host
  (``deepspeed_host_storages``: the fp32 partition and its gradient, the optimizer state, the
  bit16 staging buffer, the gradient-accumulation buffers). On a GPU the device placement
  alone would tell the two apart; on the CPU accelerator both sides are host memory, so the
  classification is by which of DeepSpeed's tensors a copy touches.
- ``deepspeed_zero2_step_bytes``: the same count from reading DeepSpeed's code, from the
  partition layout alone. Per rank, per step at gradient accumulation 1:

      to host:   each parameter's slice in this rank's partition, its reduced gradient in fp32
                 (``async_inplace_copy_grad_to_fp32_buffer_from_gpu``: converted on the device)
                 + for each Muon slice, the orthogonalized update and the new momentum in fp32
                 (``_apply_muon_updates_cpu_offload``)
      to device: for each Muon slice, its gradient and momentum (``_muon_all_gather_partitions``
                 packs them into a device buffer before the all-gather; on a step whose momentum
                 is new, the gradient only) + the whole updated bit16 partition, padding included
                 (``step``: ``bit16_partitions[rank].copy_(param_buffer_of_bit16_for_cpu_offload)``)

Neither counts one-element tensors (the per-parameter norms read with ``.item()``, the overflow
flag): a handful of scalars per step on both systems. A cross-device ``copy_`` is counted at the
element size of the tensor that crosses: PyTorch converts a host-to-device copy to the
destination dtype on the host, and a device-to-host one at the source dtype (blocking) or, with
``non_blocking``, to the destination dtype on the device first.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode


@dataclass
class CopyCount:
    """Bytes host -> device and device -> host."""

    to_device: int = 0
    to_host: int = 0

    @property
    def total(self) -> int:
        return self.to_device + self.to_host


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def deepspeed_host_storages(optimizer) -> set[int]:
    """The storages of DeepSpeed's ZeRO-1/2 optimizer that live in host memory under cpu offload."""
    if not getattr(optimizer, "cpu_offload", False):
        raise ValueError(f"{type(optimizer).__name__} is not DeepSpeed's ZeRO-1/2 optimizer with cpu offload")
    tensors = []
    for flat in optimizer.single_partition_of_fp32_groups:
        tensors.append(flat)
        if flat.grad is not None:
            tensors.append(flat.grad)
    for state in optimizer.optimizer.state.values():
        tensors.extend(v for v in state.values() if torch.is_tensor(v) and v.numel() > 1)
    tensors.extend(optimizer.param_buffer_of_bit16_for_cpu_offload_groups)
    tensors.extend(getattr(optimizer, "accumulated_grads_in_cpu", {}).values())
    spare = getattr(optimizer, "temp_grad_buffer_for_cpu_offload", None)
    if spare is not None:
        tensors.append(spare)
    return {_storage(t) for t in tensors}


class HostDeviceCopyMeter(TorchDispatchMode):
    """Counts the bytes of every ``copy_`` between a host storage (``host_storages()``) and any other.

    ``host_storages`` is called at each copy, so state a step creates (Muon's momentum on the
    first step) counts from then on.
    """

    def __init__(self, host_storages):
        super().__init__()
        self._host_storages = host_storages
        self.count = CopyCount()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.copy_.default:
            destination, source = args[0], args[1]
            if torch.is_tensor(source) and destination.numel() > 1:
                self._count(destination, source, bool(kwargs.get("non_blocking", args[2] if len(args) > 2 else False)))
        return func(*args, **kwargs)

    def _count(self, destination: torch.Tensor, source: torch.Tensor, non_blocking: bool) -> None:
        host = self._host_storages()
        to_host, from_host = _storage(destination) in host, _storage(source) in host
        if to_host == from_host:
            return  # both on the host (DeepSpeed's bit16 staging) or both on the device
        if from_host:
            self.count.to_device += destination.numel() * destination.element_size()
        else:
            size = destination.element_size() if non_blocking else source.element_size()
            self.count.to_host += destination.numel() * size


def deepspeed_zero2_step_bytes(optimizer, *, momentum_exists: bool, without_grad=frozenset()) -> CopyCount:
    """Bytes one step of DeepSpeed's offloaded ZeRO-1/2 Muon copies on this rank (module docstring), from its layout.

    ``momentum_exists``: False for the first step, whose momentum DeepSpeed creates as zeros
    instead of copying it to the device. ``without_grad``: ``id``s of parameters that take no
    gradient this step: their gradient hook never runs, so no gradient is copied, but a Muon
    one still goes through the Muon update. Gradient accumulation 1 only (with more, DeepSpeed
    also moves every micro-step's whole-parameter gradients through host buffers).
    """
    if optimizer.gradient_accumulation_steps != 1:
        raise ValueError("deepspeed_zero2_step_bytes counts gradient accumulation 1 only")
    count = CopyCount()
    muon_buffers = 2 if momentum_exists else 1
    master = optimizer.single_partition_of_fp32_groups
    for group, params in enumerate(optimizer.params_in_partition):
        grad_size = master[group].element_size()
        for param in params:
            if not param.requires_grad:
                continue
            slice_numel = optimizer.grad_position[optimizer.get_param_id(param)][3]
            if id(param) not in without_grad:
                count.to_host += slice_numel * grad_size
            if getattr(param, "use_muon", False):
                count.to_host += 2 * slice_numel * grad_size  # the update and the momentum
                count.to_device += muon_buffers * slice_numel * grad_size
        partition = optimizer.parallel_partitioned_bit16_groups[group][_rank(optimizer, group)]
        count.to_device += partition.numel() * partition.element_size()
    return count


def _rank(optimizer, group: int) -> int:
    import deepspeed.comm as dist

    return dist.get_rank(group=optimizer.real_dp_process_group[group])


__all__ = ["CopyCount", "HostDeviceCopyMeter", "deepspeed_host_storages", "deepspeed_zero2_step_bytes"]
