"""What a collective that sends nothing writes into its outputs, so that a run goes on with finite numbers.

Shared by the collective recorder (``collective_log``, the fake world of ``bench collectives``) and
the tests' stream-recording stand-in: a reduce-scatter leaves this rank's own slice, an all-gather
this rank's input in every slot of its size (zeros in the others), a broadcast receives zeros. Each
function takes the call's arguments as a dict of parameter names, as ``inspect.signature(...).bind``
gives them for the ``torch.distributed`` function.
"""

from __future__ import annotations

import torch

__all__ = ["fill_all_gather", "fill_all_gather_into_tensor", "fill_broadcast", "fill_reduce_scatter", "is_root",
           "tensors_in"]


def tensors_in(value) -> list[torch.Tensor]:
    """The tensors of an argument: itself, or those of a (nested) list or tuple."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in tensors_in(item)]
    return []


def is_root(a: dict, key: str) -> bool:
    """Whether this rank is the collective's root (``src``/``dst`` global, or ``group_src``/``group_dst``)."""
    if a.get(key) is not None:
        return a[key] == torch.distributed.get_rank()
    return a.get(f"group_{key}") == torch.distributed.get_rank(group=a["group"])


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.numel() == b.numel()


def fill_reduce_scatter(a: dict) -> None:
    # A copy first: the output may be a view of this rank's own input.
    a["output"].copy_(a["input_list"][torch.distributed.get_rank(group=a["group"])].clone())


def fill_all_gather(a: dict) -> None:
    for slot in a["tensor_list"]:
        if _same_memory(slot, a["tensor"]):
            continue
        if slot.shape == a["tensor"].shape:
            slot.copy_(a["tensor"])
        else:
            slot.zero_()


def fill_all_gather_into_tensor(a: dict) -> None:
    # The input is often the output's own slot (DeepSpeed's partitions, an in-place all-gather as
    # NCCL allows): copy it out first.
    a["output_tensor"].view(-1, a["input_tensor"].numel()).copy_(a["input_tensor"].reshape(1, -1).clone())


def fill_broadcast(a: dict) -> None:
    if not is_root(a, "src"):
        a["tensor"].zero_()
