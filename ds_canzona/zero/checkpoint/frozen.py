"""Frozen parameters that ZeRO-3 keeps on DeepSpeed's even layout, into and out of a checkpoint.

At stage 3 a frozen parameter (``requires_grad=False``, e.g. a LoRA base weight) stays
partitioned as DeepSpeed partitions it: each rank of the data-parallel group holds one equal
slice of the flattened tensor in ``param.ds_tensor`` (the last one padded), and ``param.data``
is an empty placeholder between uses. A checkpoint holds such a parameter whole, in the
manifest's ``module_extra``, as a stage-1/2 checkpoint holds any frozen parameter, so a
checkpoint of either stage loads at the other.

Saving gathers them whole. A gather is a collective, so every rank gathers the same
parameters in the same order (the module's ``state_dict`` order), one at a time: rank 0 copies
each to the CPU, every rank frees the full tensor before the next, so the peak is one full
frozen tensor. ``digest`` lets the ranks check, in the save's first agreement, that they are
about to gather the same list; ``gather_to_cpu`` never stops half-way on one rank.

Loading needs no collective: every rank reads the manifest, so each copies its own slice of
the saved value into ``ds_tensor``, as DeepSpeed's own load of frozen fragments writes
``ds_tensor`` (``DeepSpeedEngine.load_module_state_dict``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from ds_canzona.zero.checkpoint.format import CheckpointError


def is_partitioned(value: torch.Tensor) -> bool:
    """Whether ``value`` is a ZeRO-3 parameter (its local ``data`` is not its value)."""
    return hasattr(value, "ds_id")


def logical_shape(value: torch.Tensor) -> list[int]:
    return list(value.ds_shape if is_partitioned(value) else value.shape)


@dataclass(frozen=True)
class PartitionedFrozen:
    """One ZeRO-3 frozen parameter and its ``state_dict`` names (more than one when tied)."""

    keys: tuple[str, ...]
    param: torch.nn.Parameter


def partitioned_frozen(extra: dict[str, torch.Tensor]) -> list[PartitionedFrozen]:
    """The ZeRO-3 parameters among ``extra`` (buffers and frozen parameters), each once, in order.

    Raises when one is being fetched: a save runs between steps, never inside a forward.
    """
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    keys: dict[int, list[str]] = {}
    params: dict[int, torch.nn.Parameter] = {}
    for key, value in extra.items():
        if not is_partitioned(value):
            continue
        if value.ds_status == ZeroParamStatus.INFLIGHT:
            raise CheckpointError(f"frozen parameter {key!r} is being fetched by ZeRO-3; save between steps")
        keys.setdefault(id(value), []).append(key)
        params[id(value)] = value
    return [PartitionedFrozen(keys=tuple(keys[i]), param=params[i]) for i in keys]


def digest(entries: list[PartitionedFrozen]) -> int:
    """A 56-bit hash of what ``gather_to_cpu`` will do here: which parameters, in which order, and
    which of them need a collective (those not already gathered). Equal on every rank, or the
    ranks' gathers would not pair."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    text = repr([(e.keys, list(e.param.ds_shape), e.param.ds_status == ZeroParamStatus.NOT_AVAILABLE)
                 for e in entries])
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "little")


def gather_to_cpu(entries: list[PartitionedFrozen], *, keep: bool) -> tuple[dict[str, torch.Tensor],
                                                                                BaseException | None]:
    """Every entry's full value, gathered one at a time; CPU copies kept where ``keep`` (rank 0).

    Collective: call it on every rank of the group with the same ``entries`` (``digest``). A
    failure to copy (e.g. out of CPU memory) is returned, not raised, after this rank has taken
    part in every remaining gather, so the ranks reach the agreement that follows together.
    """
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    values: dict[str, torch.Tensor] = {}
    error: BaseException | None = None
    for entry in entries:
        param = entry.param
        # A parameter already gathered (fetched and not yet released) is read as it is: no
        # collective, and it stays gathered. The others are gathered and freed on exit.
        with deepspeed.zero.GatheredParameters([param], enabled=param.ds_status == ZeroParamStatus.NOT_AVAILABLE):
            if not keep or error is not None:
                continue
            try:
                full = _cpu_value(param)
                for i, key in enumerate(entry.keys):
                    # Tied names get their own copies: the consolidated safetensors refuse shared storage.
                    values[key] = full if i == 0 else full.clone()
            except Exception as caught:
                error = caught
                values.clear()
    return values, error


def _cpu_value(param: torch.nn.Parameter) -> torch.Tensor:
    """A gathered parameter's full value, copied to the CPU."""
    return param.data.detach().view(param.ds_shape).to("cpu", copy=True).contiguous()


def check_value(key: str, current: torch.Tensor, saved: torch.Tensor) -> None:
    """A saved buffer or frozen parameter fits the module's: same shape (the dtype is converted)."""
    if list(saved.shape) != logical_shape(current):
        raise CheckpointError(f"{key!r} has shape {list(saved.shape)} in the checkpoint, the model's is "
                              f"{logical_shape(current)}")


@torch.no_grad()
def write_full_value(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Put the full ``value`` into ZeRO-3 parameter ``param``: this rank's slice into its partition.

    The slice is DeepSpeed's even layout (``Init._partition_param``): rank r of the parameter's
    group holds flat elements [r * P, (r + 1) * P), P = ``partition_numel()``, the tail past
    the tensor's end being padding (left as it is). The partition is the parameter's value: a
    copy gathered right now is dropped, not written back, when it is released (the load
    releases every parameter afterwards, ``after_load``), and the next fetch gathers the new value.
    """
    import deepspeed.comm as dist

    flat = value.reshape(-1)
    size = param.partition_numel()
    start = dist.get_rank(group=param.ds_process_group) * size
    stop = min(start + size, flat.numel())
    if start < stop:
        param.ds_tensor.narrow(0, 0, stop - start).copy_(flat[start:stop])


__all__ = ["PartitionedFrozen", "check_value", "digest", "gather_to_cpu", "is_partitioned", "logical_shape",
           "partitioned_frozen", "write_full_value"]
