"""How DeepSpeed's AutoTP split each parameter, read from AutoTP's own per-parameter metadata.

AutoTP (``deepspeed.module_inject.layers``) replaces linear layers by column-parallel
``LinearLayer`` (weight and bias split along dim 0) and row-parallel ``LinearAllreduce`` (weight
split along dim 1, bias replicated), and records on every parameter it touched a metadata dict
(``DS_AUTOTP_UC_META``): the partition dim, the logical (unsharded) shape and
``partition_sizes``, one extent per TP rank. Extents are uneven where whole KV heads are divided
(3 KV heads at TP=2: 2 and 1 heads), and may be zero past the head count. The split is read from
that metadata, never recomputed: ``torch.chunk`` would cut uneven layouts in the wrong place.

What is handled: a parameter split once, contiguously, along one dim (one range of the partition
dim per rank, rank order), and parameters AutoTP marks replicated. Everything else AutoTP can
produce is refused at init with an error naming the parameter: fused sub-parameters (``SubParam*``
layers: a fused qkv or gate_up slice is a piece of each of q, k and v, each its own matrix for a
matrix optimizer), layouts AutoTP itself calls unsupported, and a tensor-parallel parameter
without metadata.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ds_canzona.config import CanzonaConfigError

__all__ = ["TPSplit", "read_tp_splits"]


@dataclass(frozen=True)
class TPSplit:
    """One parameter split along ``dim``: TP rank r holds ``sizes[r]`` consecutive indices, in rank order."""

    logical_shape: tuple[int, ...]
    dim: int
    sizes: tuple[int, ...]

    def offset(self, rank: int) -> int:
        return sum(self.sizes[:rank])

    def local_shape(self, rank: int) -> tuple[int, ...]:
        shape = list(self.logical_shape)
        shape[self.dim] = self.sizes[rank]
        return tuple(shape)

    def local_numel(self, rank: int) -> int:
        return math.prod(self.local_shape(rank))

    @property
    def logical_numel(self) -> int:
        return math.prod(self.logical_shape)

    def slice_of(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank ``rank``'s slice of the logical tensor ``full`` (a view)."""
        return full.narrow(self.dim, self.offset(rank), self.sizes[rank])

    def held_before(self, rank: int, index: int) -> int:
        """How many of rank ``rank``'s elements have a logical (row-major) flat index below ``index``.

        Read in row-major order, a rank's slice is an increasing run of the logical tensor's
        elements, so a logical flat range [a, b) is the local range [held_before(a), held_before(b)).
        """
        inner = math.prod(self.logical_shape[self.dim + 1:])
        extent = self.logical_shape[self.dim] * inner
        start, size = self.offset(rank), self.sizes[rank]
        outer, rest = divmod(index, extent)
        position, within = divmod(rest, inner)
        count = outer * size * inner + min(max(position - start, 0), size) * inner
        if start <= position < start + size:
            count += within
        return count

    def logical_index(self, rank: int, low: int, high: int) -> torch.Tensor:
        """Logical flat indices of rank ``rank``'s local flat elements ``[low, high)`` (int64)."""
        if high <= low:
            return torch.empty(0, dtype=torch.int64)
        inner = math.prod(self.logical_shape[self.dim + 1:])
        extent = self.logical_shape[self.dim] * inner
        local = torch.arange(low, high, dtype=torch.int64)
        outer, rest = local // (self.sizes[rank] * inner), local % (self.sizes[rank] * inner)
        return outer * extent + (rest // inner + self.offset(rank)) * inner + rest % inner


def _refuse(name: str, why: str) -> CanzonaConfigError:
    return CanzonaConfigError(
        f"tensor_parallel.autotp_size: parameter {name!r} is {why}; ds_canzona's tensor-parallel optimizer step "
        "handles parameters AutoTP splits once along one dim (LinearLayer, LinearAllreduce and their biases) and "
        "replicated ones. Keep this layer out of AutoTP's partition config (or unfused), set "
        "tensor_parallel.autotp_size to 1, or remove the 'canzona' section to use DeepSpeed's own optimizer")


def read_tp_splits(named_params: list[tuple[str, torch.nn.Parameter]], *, tp_rank: int,
                   tp_size: int) -> list[TPSplit | None]:
    """Each parameter's split (None: replicated on every TP rank); a layout not handled is one error."""
    from deepspeed.checkpoint.constants import DS_AUTOTP_UC_META

    splits: list[TPSplit | None] = []
    for name, param in named_params:
        meta = getattr(param, DS_AUTOTP_UC_META, None)
        if meta is None:
            if getattr(param, "tensor_model_parallel", False):
                raise _refuse(name, "tensor-parallel but carries no AutoTP partition metadata")
            splits.append(None)
            continue
        unsupported = (meta.get("conversion") or {}).get("unsupported_reason")
        if unsupported:
            raise _refuse(name, f"split in a layout AutoTP itself marks unsupported ({unsupported})")
        if meta.get("replicated"):
            splits.append(None)
            continue
        if meta.get("sub_param_sizes") is not None or meta.get("sub_param_shape") is not None:
            raise _refuse(name, "a fused sub-parameter weight (e.g. fused qkv or gate_up: each TP slice holds a "
                                "piece of every sub-parameter)")
        dim, sizes, logical = meta.get("partition_dim"), meta.get("partition_sizes"), meta.get("logical_shape")
        if dim is None or sizes is None or logical is None:
            raise _refuse(name, f"tensor-parallel with partition metadata missing its dim, sizes or logical shape "
                                f"({meta.get('partition_type')!r})")
        split = TPSplit(logical_shape=tuple(int(d) for d in logical), dim=int(dim), sizes=tuple(int(s) for s in sizes))
        if len(split.sizes) != tp_size or sum(split.sizes) != split.logical_shape[split.dim]:
            raise _refuse(name, f"split as {split.sizes} along dim {split.dim} of {split.logical_shape}, which is not "
                                f"a {tp_size}-way split")
        if tuple(param.shape) != split.local_shape(tp_rank):
            raise _refuse(name, f"of shape {tuple(param.shape)} on TP rank {tp_rank}, where its metadata says "
                                f"{split.local_shape(tp_rank)}")
        splits.append(split)
    return splits
