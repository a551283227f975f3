"""Owner placement of ZeRO-3 parameters (MatrixFSDP): each tensor's shard is the whole tensor on one rank.

A non-matrix tensor planned in canonical pieces (``canzona.split_numel``) is placed piece by
piece: each piece lives whole on its own owner, and a rank's shard of the tensor is the
concatenation of the pieces it owns (often none). Everything below holds per piece; a whole
tensor is the one-piece case.

DeepSpeed's ZeRO-3 (``deepspeed.zero.Init``, ``DeepSpeedZeRoOffload`` and its parameter
coordinator) keeps, per parameter, a partition ``param.ds_tensor`` (an equal, padded slice per
rank), frees ``param.data`` between uses, and fetches it before a module runs by calling the
parameter's own closures. Those closures are attributes that ``Init._convert_to_deepspeed_param``
sets on every parameter, so the layout can be changed per parameter without touching a class:

- ``all_gather_coalesced(params, safe_mode=False, quantize=False)`` (the coordinator's fetch and
  prefetch) and ``all_gather(param_list=None, async_op=False, hierarchy=0)`` (``GatheredParameters``,
  ``param.item()``): replaced on every ZeRO-3 parameter of the module by a router that fetches
  owner-placed parameters from their owners, straight into the full buffer (the owner of a whole
  tensor uses its shard as the buffer, no copy), and hands the rest to DeepSpeed's original
  closure of the same parameter. How the pieces travel is the layout's mode
  (``ds_canzona.zero.stage3_comm``): one broadcast per piece, the same broadcasts as one grouped
  launch per fetch, one padded all-gather or one all-reduce per fetch, or (by default off gloo)
  whichever one operation the cost model prices lowest for that fetch;
- ``partition(param_list=None, hierarchy=0, has_been_updated=False, free_data=True)`` (the
  coordinator's release, ``GatheredParameters`` on exit): an owner-placed parameter frees its
  full buffer on the other ranks; with ``has_been_updated`` (weights written inside
  ``GatheredParameters(modifier_rank=...)``, e.g. a checkpoint load) the owners keep the new values;
- ``partition_numel``, ``padding_size``, ``aligned_size``: the sizes of the owner layout (no
  padding; ``partition_numel`` is the whole tensor's, on every rank: DeepSpeed 0.19.8's coordinator
  reads it only to decide whether a module has anything to fetch and to count what it waited for).

Nothing else of DeepSpeed's ZeRO-3 changes: the coordinator's trace, prefetch, release, the
module hooks, ``zero.Init`` itself. The closures' names and signatures were checked against
DeepSpeed 0.19.0-0.19.8 (``partition_parameters.py``) and the runtime run on each
(``scripts/compat.sh``); stage 3 is refused on any other version
(``ds_canzona.zero.versions.STAGE3_DEEPSPEED_VERSIONS``).

A parameter is converted once, at engine start: DeepSpeed's own fetch gathers its even layout,
each rank keeps the pieces it owns as its new ``ds_tensor`` (the whole tensor on the owner of an
unsplit one, empty on the other ranks).
In the per-piece mode owner-placed parameters are never persistent (``ds_persist`` false): a
persistent copy on every rank needs a fetch after each step, which that mode keeps out of the step.
Every other mode keeps DeepSpeed's choice (``stage3_param_persistence_threshold``):
a persistent parameter's full buffer stays on every rank between steps, the coordinator skips it,
and the runtime refreshes all of them after the step in one fetch.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus, free_param

from ds_canzona.zero.comm import CommCounter
from ds_canzona.plan.collectives import CollectiveCosts
from ds_canzona.zero.stage3_comm import ALL_REDUCE, PADDED, PER_PIECE, ZERO3_MODES, LaunchGroup, PaddedSegments, \
    all_reduce_launch, back_to_back, launch_form, padded_all_gather
from ds_canzona.zero.streams import WriteMark, streams_are_real

# On an owner-placed parameter: its pieces ((start, stop, owner rank in the data-parallel group), ...)
# in element order; a tensor owned whole is one piece.
PIECES_ATTR = "ds_canzona_pieces"
# On an owner-placed parameter: the pieces this rank owns, ((start, stop, offset in ds_tensor), ...).
LOCAL_PIECES_ATTR = "ds_canzona_local_pieces"
# DeepSpeed's original closures, kept on each parameter the router was installed on.
_ORIGINAL_ATTR = "ds_canzona_even_layout"
# The closures DeepSpeed 0.19.x sets in Init._convert_to_deepspeed_param that this module replaces.
PATCHED_PARAM_CLOSURES = ("all_gather", "all_gather_coalesced", "partition", "partition_numel", "padding_size",
                          "aligned_size")



def is_owner_placed(param) -> bool:
    return hasattr(param, PIECES_ATTR)


def _whole_here(param, rank: int) -> bool:
    """Whether ``rank`` owns the parameter whole (its shard then serves as the full buffer)."""
    pieces = getattr(param, PIECES_ATTR)
    return len(pieces) == 1 and pieces[0][2] == rank


class OwnerFetchHandle:
    """The coordinator's handle for a fetch from owners: ``wait`` finishes the collectives.

    ``copy_out`` (the padded mode) copies the received pieces out of the flat buffer into the
    parameters' full buffers and drops the flat buffer, so nothing keeps it alive after ``wait``.
    """

    def __init__(self, params: list, works: list, copy_out=None) -> None:
        self._params = params
        self._works = works
        self._copy_out = copy_out
        self._complete = False

    def wait(self, **kwargs) -> None:
        if self._complete:
            return
        for work in self._works:
            work.wait()
        if self._copy_out is not None:
            self._copy_out()
            self._copy_out = None
        for param in self._params:
            param.ds_status = ZeroParamStatus.AVAILABLE
        self._complete = True


class _BothHandles:
    """A fetch that went partly to owners and partly to DeepSpeed's even layout."""

    def __init__(self, *handles) -> None:
        self._handles = [h for h in handles if h is not None]

    def wait(self, **kwargs) -> None:
        for handle in self._handles:
            handle.wait(**kwargs)


class OwnerLayout:
    """Fetch, release and sizes of owner-placed parameters over one data-parallel group."""

    def __init__(self, *, group, counter: CommCounter, mode: str = PER_PIECE,
                 costs: CollectiveCosts = CollectiveCosts()) -> None:
        if mode not in ZERO3_MODES:
            raise ValueError(f"unknown ZeRO-3 fetch mode {mode!r}")
        self.group = group
        self.mode = mode
        self.costs = costs
        self.rank = dist.get_rank(group=group)
        self.world_size = dist.get_world_size(group=group)
        self.counter = counter
        self.device = None
        # The last writes of owners into their shards (on the compute stream), which a fetch on
        # DeepSpeed's all-gather stream must not overtake (``ds_canzona.zero.streams``).
        self._shard_writes = WriteMark()

    def shards_written(self) -> None:
        """The owners' shards were just written on the current stream: later fetches wait for that."""
        self._shard_writes.record()

    def launch_form(self, pieces: Sequence[tuple[int, int]], element_bytes: int) -> str:
        """The form of one launch of ``(length, owner)`` pieces (a fetch, a gradient bucket) in this layout's mode."""
        return launch_form(self.mode, pieces, world_size=self.world_size, element_bytes=element_bytes,
                           costs=self.costs)

    # ------------------------------------------------------------------ conversion
    @torch.no_grad()
    def place(self, params: Sequence, pieces: Sequence[Sequence[tuple[int, int, int]]], *,
              keep_persistent: bool = False) -> None:
        """Move ZeRO-3 parameters from DeepSpeed's even layout to their owners (collective, at start-up).

        ``pieces[i]`` is parameter i's ``((start, stop, owner), ...)`` over its flattened elements.
        ``keep_persistent``: a parameter DeepSpeed marked persistent stays so (it is released here
        like the others; the first fetch brings it back and nothing releases it before the step).
        """
        for param, layout_pieces in zip(params, pieces):
            if param.ds_status == ZeroParamStatus.NOT_AVAILABLE:
                param.all_gather()  # DeepSpeed's even-layout fetch, once
            full = param.data.reshape(-1)
            mine = [(start, stop) for start, stop, owner in layout_pieces if owner == self.rank]
            if mine:
                shard = torch.cat([full[start:stop] for start, stop in mine]).detach().clone()
            else:
                shard = torch.empty(0, dtype=full.dtype, device=full.device)
            local, offset = [], 0
            for start, stop in mine:
                local.append((start, stop, offset))
                offset += stop - start
            shard.requires_grad = False
            previous = param.ds_tensor
            shard.ds_numel = shard.numel()
            shard.status = getattr(previous, "status", None)
            shard.final_location = None
            param.ds_tensor = shard
            param.ds_numel_aligned = param.ds_numel
            setattr(param, PIECES_ATTR, tuple((int(a), int(b), int(o)) for a, b, o in layout_pieces))
            setattr(param, LOCAL_PIECES_ATTR, tuple(local))
            param.ds_persist = bool(keep_persistent and getattr(param, "ds_persist", False))
            param.ds_active_sub_modules.clear()
            free_param(param)
            param.ds_status = ZeroParamStatus.NOT_AVAILABLE
        self.shards_written()

    def install(self, params: Iterable) -> None:
        """Put the routing closures on every ZeRO-3 parameter of the module (owner-placed or not)."""
        for param in params:
            if hasattr(param, _ORIGINAL_ATTR):
                continue
            setattr(param, _ORIGINAL_ATTR, {name: getattr(param, name) for name in PATCHED_PARAM_CLOSURES})
            self._install_one(param)

    def _install_one(self, param) -> None:
        layout = self
        original = getattr(param, _ORIGINAL_ATTR)

        def all_gather_coalesced(params, safe_mode: bool = False, quantize: bool = False):
            params = list(params)
            owned = [p for p in params if is_owner_placed(p)]
            even = [p for p in params if not is_owner_placed(p)]
            even_handle = getattr(even[0], _ORIGINAL_ATTR)["all_gather_coalesced"](
                even, safe_mode=safe_mode, quantize=quantize) if even else None
            owner_handle = layout.fetch(owned) if owned else None
            if even_handle is None:
                return owner_handle
            return even_handle if owner_handle is None else _BothHandles(even_handle, owner_handle)

        def all_gather(param_list=None, async_op: bool = False, hierarchy: int = 0):
            param_list = [param] if param_list is None else list(param_list)
            owned = [p for p in param_list if is_owner_placed(p) and p.ds_status == ZeroParamStatus.NOT_AVAILABLE]
            even = [p for p in param_list if not is_owner_placed(p)]
            if owned:
                layout.fetch(owned).wait()
            if even:
                return getattr(even[0], _ORIGINAL_ATTR)["all_gather"](even, async_op=async_op, hierarchy=hierarchy)
            return [] if async_op else None

        def partition(param_list=None, hierarchy: int = 0, has_been_updated: bool = False, free_data: bool = True):
            param_list = [param] if param_list is None else list(param_list)
            even = [p for p in param_list if not is_owner_placed(p)]
            for p in param_list:
                if is_owner_placed(p):
                    layout.release(p, has_been_updated=has_been_updated, free_data=free_data)
            if even:
                getattr(even[0], _ORIGINAL_ATTR)["partition"](even, hierarchy=hierarchy,
                                                               has_been_updated=has_been_updated, free_data=free_data)

        def partition_numel():
            # The coordinator fetches a module only if its released parameters' partition_numel()
            # sum to more than zero; an owner-placed tensor is fetched whole on every rank.
            return param.ds_numel if is_owner_placed(param) else original["partition_numel"]()

        def padding_size():
            return 0 if is_owner_placed(param) else original["padding_size"]()

        def aligned_size():
            return param.ds_numel if is_owner_placed(param) else original["aligned_size"]()

        param.all_gather_coalesced = all_gather_coalesced
        param.all_gather = all_gather
        param.partition = partition
        param.partition_numel = partition_numel
        param.padding_size = padding_size
        param.aligned_size = aligned_size

    # ------------------------------------------------------------------ fetch and release
    def fetch(self, params: list) -> OwnerFetchHandle:
        """Start fetching the parameters' pieces from their owners into full buffers (asynchronous)."""
        params = sorted(params, key=lambda p: p.ds_id)  # the same order on every rank
        # This runs on the stream that is current here (DeepSpeed's all-gather stream for the
        # coordinator's fetches); the owners wrote their shards on the compute stream.
        self._shard_writes.wait()
        if not params:
            return OwnerFetchHandle([], [])
        buffers = [self._full_buffer(param) for param in params]
        if self.world_size == 1:
            return OwnerFetchHandle(params, [])
        sends = [(buffer[start:stop], owner) for param, buffer in zip(params, buffers)
                 for start, stop, owner in getattr(param, PIECES_ATTR)]
        form = self.launch_form([(piece.numel(), owner) for piece, owner in sends], buffers[0].element_size())
        if form == PADDED:
            return self._fetch_padded(params, buffers)
        if form == ALL_REDUCE:
            return self._fetch_all_reduced(params, sends)
        if self.mode == PER_PIECE:
            works = [self._broadcast(piece, owner) for piece, owner in sends]
            return OwnerFetchHandle(params, works)
        with LaunchGroup(group=self.group, device=buffers[0].device) as launch:
            for piece, owner in sends:
                launch.add(self._broadcast(piece, owner))
        return OwnerFetchHandle(params, launch.works)

    def _full_buffer(self, param) -> torch.Tensor:
        """Mark the parameter in flight and give it its full buffer, holding this rank's own pieces already."""
        if param.ds_status != ZeroParamStatus.NOT_AVAILABLE:
            raise RuntimeError(f"ds_canzona: fetching a ZeRO-3 parameter that is not released: {param.ds_summary()}")
        param.ds_status = ZeroParamStatus.INFLIGHT
        shard = param.ds_tensor
        if _whole_here(param, self.rank):
            buffer = shard
        else:
            buffer = torch.empty(param.ds_numel, dtype=shard.dtype, device=shard.device)
            for start, stop, offset in getattr(param, LOCAL_PIECES_ATTR):
                buffer[start:stop].copy_(shard[offset:offset + stop - start])
        param.data = buffer.view(param.ds_shape)
        return buffer

    def _broadcast(self, piece: torch.Tensor, owner: int):
        self.counter.add("broadcast", piece.numel() * piece.element_size())
        return dist.broadcast(piece, src=dist.get_global_rank(self.group, owner), group=self.group, async_op=True)

    def _fetch_padded(self, params: list, buffers: list[torch.Tensor]) -> OwnerFetchHandle:
        """One all-gather of every rank's pieces, laid out owner segment by owner segment and padded."""
        pieces = [(param, buffer, start, stop, owner) for param, buffer in zip(params, buffers)
                  for start, stop, owner in getattr(param, PIECES_ATTR)]
        layout = PaddedSegments([(stop - start, owner) for _, _, start, stop, owner in pieces], self.world_size)
        reference = buffers[0]
        flat = torch.empty(layout.numel, dtype=reference.dtype, device=reference.device)
        mine = torch.empty(layout.segment, dtype=reference.dtype, device=reference.device)
        # This rank's pieces, back to back in fetch order: the order PaddedSegments laid its segment out in.
        used = 0
        for _, buffer, start, stop, owner in pieces:
            if owner == self.rank:
                mine[used:used + stop - start].copy_(buffer[start:stop])
                used += stop - start
        if used < layout.segment:
            mine[used:].zero_()
        self.counter.add("all_gather_into_tensor", mine.numel() * mine.element_size())
        work = padded_all_gather(flat, mine, group=self.group)

        def copy_out() -> None:
            for (_, buffer, start, stop, owner), position in zip(pieces, layout.position):
                if owner != self.rank:
                    buffer[start:stop].copy_(flat[position:position + stop - start])
            if streams_are_real():
                # Allocated on the fetch's stream, last read here: not reused before this read.
                flat.record_stream(get_accelerator().current_stream())
                mine.record_stream(get_accelerator().current_stream())

        return OwnerFetchHandle(params, [work], copy_out)

    def _fetch_all_reduced(self, params: list, sends: list[tuple[torch.Tensor, int]]) -> OwnerFetchHandle:
        """One all-reduce of every piece back to back: the owner's values, -0.0 from every other rank."""
        positions = back_to_back([piece.numel() for piece, _ in sends])
        reference = sends[0][0]
        # -0.0, not 0.0: 0.0 + -0.0 is +0.0, which would flip an owner's negative zero.
        flat = torch.full((sum(piece.numel() for piece, _ in sends),), -0.0, dtype=reference.dtype,
                          device=reference.device)
        for (piece, owner), position in zip(sends, positions):
            if owner == self.rank:
                flat[position:position + piece.numel()].copy_(piece)
        self.counter.add("all_reduce_fetch", flat.numel() * flat.element_size())
        work = all_reduce_launch(flat, group=self.group)

        def copy_out() -> None:
            for (piece, owner), position in zip(sends, positions):
                if owner != self.rank:
                    piece.copy_(flat[position:position + piece.numel()])
            if streams_are_real():
                flat.record_stream(get_accelerator().current_stream())  # as in _fetch_padded

        return OwnerFetchHandle(params, [work], copy_out)

    @torch.no_grad()
    def release(self, param, *, has_been_updated: bool, free_data: bool) -> None:
        if param.ds_status == ZeroParamStatus.INFLIGHT:
            raise RuntimeError(f"ds_canzona: releasing a ZeRO-3 parameter in flight: {param.ds_summary()}")
        if param.ds_status == ZeroParamStatus.AVAILABLE:
            full = param.data.reshape(-1)
            if has_been_updated and full.data_ptr() != param.ds_tensor.data_ptr():
                # Weights written while gathered (GatheredParameters with a modifier rank, which
                # broadcast them first): each owner keeps its pieces of the new values.
                for start, stop, offset in getattr(param, LOCAL_PIECES_ATTR):
                    param.ds_tensor[offset:offset + stop - start].copy_(full[start:stop])
                self.shards_written()
            if free_data:
                free_param(param)
        param.ds_status = ZeroParamStatus.NOT_AVAILABLE


__all__ = ["LOCAL_PIECES_ATTR", "PIECES_ATTR", "PATCHED_PARAM_CLOSURES", "OwnerFetchHandle", "OwnerLayout", "is_owner_placed"]
