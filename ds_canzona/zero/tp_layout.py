"""How DeepSpeed's AutoTP split each parameter, read from AutoTP's own per-parameter metadata.

AutoTP (``deepspeed.module_inject.layers``) replaces linear layers by column-parallel
``LinearLayer`` (weight and bias split along dim 0) and row-parallel ``LinearAllreduce`` (weight
split along dim 1, bias replicated), and records on every parameter it touched a metadata dict
(``DS_AUTOTP_UC_META``): the partition dim, the logical (unsharded) shape and
``partition_sizes``, one extent per TP rank. Extents are uneven where whole KV heads are divided
(3 KV heads at TP=2: 2 and 1 heads), and may be zero past the head count. The split is read from
that metadata, never recomputed: ``torch.chunk`` would cut uneven layouts in the wrong place.

Fused sub-parameter layers (``SubParamLinearLayer``, ``SubParamLinearAllreduce`` and
``SubParamColumnParallel``'s fused qkv and gate_up, e.g. Phi-3's ``qkv_proj`` and
``gate_up_proj`` under AutoTP's phi3 preset) cut each sub-parameter on its own: rank r holds
``[piece r of q; piece r of k; piece r of v]`` along the partition dim. Their metadata gives
``sub_param_sizes`` and ``sub_param_shard_widths`` (per sub-parameter, one width per rank), and
``TPSplit`` keeps exactly that: a rank holds one run of the partition dim per sub-parameter.
A plain split is the case of a single sub-parameter.

What is handled: those two layouts, and parameters AutoTP marks replicated. Everything else AutoTP
can produce is refused at init with an error naming the parameter: layouts AutoTP itself calls
unsupported (interleaved or replicated fused blocks), a sub-parameter view whose logical shape is
not the parameter's own shape (e.g. a ``(heads, head_dim, in)`` view of a 2-D weight), and a
tensor-parallel parameter without metadata.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ds_canzona.config import CanzonaConfigError

__all__ = ["TPSplit", "read_tp_splits"]


@dataclass(frozen=True)
class TPSplit:
    """One parameter split along ``dim``, per sub-parameter.

    The partition dim of the logical tensor is the sub-parameters one after another (sizes
    ``sub_sizes``; one sub-parameter for a plain split). ``widths[i][r]`` is how many consecutive
    indices of sub-parameter i TP rank r holds, in rank order; a rank's slice is its piece of
    every sub-parameter, concatenated in sub-parameter order.
    """

    logical_shape: tuple[int, ...]
    dim: int
    widths: tuple[tuple[int, ...], ...]

    @classmethod
    def plain(cls, logical_shape: tuple[int, ...], dim: int, sizes: tuple[int, ...]) -> TPSplit:
        """One contiguous range of the partition dim per rank (``LinearLayer``, ``LinearAllreduce``)."""
        return cls(logical_shape=logical_shape, dim=dim, widths=(tuple(sizes),))

    @property
    def fused(self) -> bool:
        """More than one sub-parameter: each is its own matrix for a matrix optimizer."""
        return len(self.widths) > 1

    @property
    def sub_sizes(self) -> tuple[int, ...]:
        return tuple(sum(per_rank) for per_rank in self.widths)

    @property
    def sizes(self) -> tuple[int, ...]:
        """Each rank's extent along the partition dim (its pieces of every sub-parameter)."""
        return tuple(sum(per_rank[rank] for per_rank in self.widths) for rank in range(len(self.widths[0])))

    def runs(self, rank: int) -> tuple[tuple[int, int], ...]:
        """(start, size) along the partition dim of each of rank ``rank``'s pieces, in sub-parameter order."""
        out, sub_start = [], 0
        for per_rank in self.widths:
            out.append((sub_start + sum(per_rank[:rank]), per_rank[rank]))
            sub_start += sum(per_rank)
        return tuple(out)

    def sub_ranges(self) -> tuple[tuple[int, int], ...]:
        """(start, size) of each sub-parameter along the partition dim of the logical tensor."""
        starts = [sum(self.sub_sizes[:i]) for i in range(len(self.widths))]
        return tuple(zip(starts, self.sub_sizes))

    def sub_views(self, full: torch.Tensor) -> list[torch.Tensor]:
        """The sub-parameters of the logical tensor ``full`` (views)."""
        return [full.narrow(self.dim, start, size) for start, size in self.sub_ranges()]

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
        """Rank ``rank``'s slice of the logical tensor ``full`` (a view for a plain split, a copy if fused)."""
        pieces = [full.narrow(self.dim, start, size) for start, size in self.runs(rank)]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=self.dim)

    def write_slice(self, full: torch.Tensor, rank: int, piece: torch.Tensor) -> None:
        """Copy rank ``rank``'s slice ``piece`` (of ``local_shape(rank)``) into the logical tensor ``full``."""
        local = 0
        for start, size in self.runs(rank):
            full.narrow(self.dim, start, size).copy_(piece.narrow(self.dim, local, size))
            local += size

    def held_before(self, rank: int, index: int) -> int:
        """How many of rank ``rank``'s elements have a logical (row-major) flat index below ``index``.

        Read in row-major order, a rank's slice is an increasing run of the logical tensor's
        elements (its pieces come in sub-parameter order, which is logical order), so a logical
        flat range [a, b) is the local range [held_before(a), held_before(b)).
        """
        inner = math.prod(self.logical_shape[self.dim + 1:])
        extent = self.logical_shape[self.dim] * inner
        outer, rest = divmod(index, extent)
        position, within = divmod(rest, inner)
        count = outer * self.sizes[rank] * inner
        for start, size in self.runs(rank):
            count += min(max(position - start, 0), size) * inner
            if start <= position < start + size:
                count += within
        return count

    def logical_index(self, rank: int, low: int, high: int) -> torch.Tensor:
        """Logical flat indices of rank ``rank``'s local flat elements ``[low, high)`` (int64)."""
        if high <= low:
            return torch.empty(0, dtype=torch.int64)
        inner = math.prod(self.logical_shape[self.dim + 1:])
        extent = self.logical_shape[self.dim] * inner
        # Local position along the partition dim -> logical position, run by run.
        along = torch.cat([torch.arange(start, start + size, dtype=torch.int64) for start, size in self.runs(rank)])
        local = torch.arange(low, high, dtype=torch.int64)
        outer, rest = local // (self.sizes[rank] * inner), local % (self.sizes[rank] * inner)
        return outer * extent + along[rest // inner] * inner + rest % inner


def _refuse(name: str, why: str) -> CanzonaConfigError:
    return CanzonaConfigError(
        f"tensor_parallel.autotp_size: parameter {name!r} is {why}; ds_canzona's tensor-parallel optimizer step "
        "handles parameters AutoTP splits along one dim (LinearLayer, LinearAllreduce, their biases, and fused "
        "SubParam* layers cut per sub-parameter) and replicated ones. Keep this layer out of AutoTP's partition "
        "config, set tensor_parallel.autotp_size to 1, or remove the 'canzona' section to use DeepSpeed's own "
        "optimizer")


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
        dim, logical = meta.get("partition_dim"), meta.get("logical_shape")
        widths = meta.get("sub_param_shard_widths")
        sizes = meta.get("partition_sizes")
        if dim is None or logical is None or (widths is None and sizes is None):
            raise _refuse(name, f"tensor-parallel with partition metadata missing its dim, sizes or logical shape "
                                f"({meta.get('partition_type')!r})")
        logical = tuple(int(d) for d in logical)
        if widths is not None:  # a SubParam* layer: each sub-parameter cut on its own
            split = TPSplit(logical_shape=logical, dim=int(dim),
                            widths=tuple(tuple(int(w) for w in per_rank) for per_rank in widths))
            sub_sizes = meta.get("sub_param_sizes")
            if any(len(per_rank) != tp_size for per_rank in split.widths) or (
                    sub_sizes is not None and tuple(int(s) for s in sub_sizes) != split.sub_sizes):
                raise _refuse(name, f"split per sub-parameter as {split.widths}, which does not describe a "
                                    f"{tp_size}-way split of sub-parameters {sub_sizes}")
        else:
            split = TPSplit.plain(logical, int(dim), tuple(int(s) for s in sizes))
        if len(split.sizes) != tp_size or sum(split.sizes) != split.logical_shape[split.dim]:
            raise _refuse(name, f"split as {split.sizes} along dim {split.dim} of {split.logical_shape}, which is not "
                                f"a {tp_size}-way split")
        if tuple(param.shape) != split.local_shape(tp_rank):
            raise _refuse(name, f"of shape {tuple(param.shape)} on TP rank {tp_rank}, where its metadata says "
                                f"{split.local_shape(tp_rank)} (a sub-parameter view of another shape than the "
                                "parameter's is not handled)")
        splits.append(split)
    return splits
