"""How ZeRO-3 with owner placement launches its collectives: per piece, grouped, padded, all-reduced, or priced.

Owner placement moves each piece of a tensor between its owner and the other ranks, so its
natural collectives are point-rooted: a ``broadcast`` per piece to fetch it, a ``reduce`` per
item to sum its gradient onto the owner. On gloo with a few ranks those are cheap; on NCCL at
64-1024 ranks every operation costs tens of microseconds, and one forward of a 32-layer model would
issue thousands. So ``canzona.collectives`` chooses (``zero3_collectives``):

- ``per_piece`` (what "default" means on gloo): one broadcast per piece per fetch, one reduce
  per item per backward, no parameter persistent. gloo cannot group collectives
  (no ``startCoalescing``), and this measured best there (docs/NOTES.md);
- ``priced`` (what "default" means on every other backend): every launch is ONE operation, so a
  step's operations do not grow with the world size or the number of pieces. A launch of one
  piece is its broadcast or reduce; a launch of several takes padded or allreduce, whichever the
  cost model of ``ds_canzona.plan.collectives`` prices lower (``choose_piece_form``: the padding
  against the all-reduce's second pass). The choice is a pure function of the pieces' lengths and
  owners, which every rank has, so every rank picks the same form;
- ``grouped``: a fetch's broadcasts, a gradient bucket's reduces and the post-step refresh of the
  persistent parameters each go out as one grouped launch (``LaunchGroup``: torch's coalescing
  manager, one ``ncclGroupStart/End`` on NCCL), one NCCL operation per piece inside it. The bytes
  are exactly the pieces', and no staging copy is made: each broadcast lands in the parameter's
  full buffer, the owner of a whole tensor lends its shard;
- ``padded``: one equal-size collective per fetch (``all_gather_into_tensor``) and per gradient
  bucket (``reduce_scatter_tensor``), each rank's segment padded to the largest
  (``PaddedSegments``), at the price of the padding bytes, one copy of what each rank sends into
  the flat buffer, and that buffer for the life of one fetch or bucket (freed at ``wait()``: no
  parameter keeps a view of it);
- ``allreduce``: one ``all_reduce`` per fetch and per gradient bucket over a buffer of the
  launch's pieces back to back. A bucket's sum is read by each owner from its pieces; for a
  fetch every rank writes -0.0 where it owns nothing (x + -0.0 is x, bit for bit, for every x,
  +0.0 and NaN included), so the sum is each owner's values. One operation whatever the owners,
  twice the pieces' bytes on the wire, and a staging buffer as padded has.

All but ``per_piece`` honour DeepSpeed's ``stage3_param_persistence_threshold`` and bucket the
gradient reduce by ``reduce_bucket_size`` (``ds_canzona.zero.stage3``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

import deepspeed.comm as dist
from deepspeed.comm.torch import get_coalescing_manager

from ds_canzona.plan.collectives import CollectiveCosts, choose_piece_form

PER_PIECE, GROUPED, PADDED, ALL_REDUCE, PRICED = "per_piece", "grouped", "padded", "allreduce", "priced"
ZERO3_MODES = (PER_PIECE, GROUPED, PADDED, ALL_REDUCE, PRICED)
# The ``canzona.collectives`` values stage 3 takes.
ZERO3_SETTINGS = ("default", GROUPED, PADDED, ALL_REDUCE)


def backend_name(group) -> str:
    return str(torch.distributed.get_backend(group)).lower()


def zero3_collectives(choice: str, group) -> str:
    """The ZeRO-3 mode that ``canzona.collectives`` = ``choice`` means on ``group``'s backend."""
    if choice == "default":
        return PER_PIECE if backend_name(group) == "gloo" else PRICED
    if choice in (GROUPED, PADDED, ALL_REDUCE):
        return choice
    raise ValueError(f"canzona.collectives must be one of {ZERO3_SETTINGS}, got {choice!r}")


def launch_form(mode: str, pieces: Sequence[tuple[int, int]], *, world_size: int, element_bytes: int,
                costs: CollectiveCosts) -> str:
    """The form one fetch or gradient bucket of ``(length, owner)`` pieces takes under ``mode``.

    ``per_piece`` and ``grouped`` broadcast / reduce piece by piece (one launch or many); ``priced``
    asks the cost model for one operation (``choose_piece_form``).
    """
    if mode == PRICED:
        return choose_piece_form(pieces, world_size=world_size, element_bytes=element_bytes, costs=costs)
    if mode not in ZERO3_MODES:
        raise ValueError(f"unknown ZeRO-3 collectives mode {mode!r}")
    return mode


class LaunchGroup:
    """Collectives issued inside the block go out as one launch where the backend can group them.

    On NCCL (any backend with ``startCoalescing``) torch's coalescing manager queues them and
    issues one group at the end of the block; gloo has no such call, so there each runs as it is
    issued. Issue every collective with ``async_op=True`` and hand its work to ``add``; ``works``
    then holds everything to wait for (the group's one work, and whichever single works the
    backend returned).

    ``queued=True`` is for blocks of ``all_gather_into_tensor`` (or ``reduce_scatter_tensor``, or
    ``all_reduce``) calls only, all of one kind: torch queues those itself and issues them at the
    end as one ``*_coalesced`` call, so the backend's own grouping (``startCoalescing``, which the
    rank-rooted broadcasts and reduces need) is not opened. Issue them without ``async_op``: inside
    the block torch returns no work per call; the block's one work is in ``works``.
    """

    def __init__(self, *, group, device: torch.device, queued: bool = False) -> None:
        self._group = group
        self._device = None if queued else device
        self._grouping = backend_name(group) != "gloo"
        self._manager = None
        self._works: list = []

    def __enter__(self) -> LaunchGroup:
        if self._grouping:
            self._context = get_coalescing_manager(self._group, self._device, None, True)
            self._manager = self._context.__enter__()
        return self

    def add(self, work) -> None:
        self._works.append(work)

    def __exit__(self, *exc) -> bool:
        if self._manager is not None:
            self._context.__exit__(*exc)
        return False

    @property
    def works(self) -> list:
        # Inside a coalesced block NCCL returns no work per collective (None); the group's work ends them all.
        grouped = self._manager.works if self._manager is not None else []
        return [w for w in self._works + list(grouped) if w is not None]


class PaddedSegments:
    """Where each rank's pieces sit in a flat buffer of one padded equal-size collective.

    ``pieces`` are ``(length, owner)`` in one order that every rank agrees on; each owner's
    pieces are laid out back to back in that order in its segment, and every segment is as long
    as the longest (``segment``), so the flat buffer holds ``world_size * segment`` elements.
    ``position[k]`` is piece k's first element in the flat buffer.
    """

    def __init__(self, pieces: Sequence[tuple[int, int]], world_size: int) -> None:
        used = [0] * world_size
        self.position: list[int] = []
        offsets: list[tuple[int, int]] = []
        for length, owner in pieces:
            offsets.append((owner, used[owner]))
            used[owner] += length
        self.used = used
        self.segment = max(used) if used else 0
        self.position = [owner * self.segment + offset for owner, offset in offsets]
        self.world_size = world_size

    @property
    def numel(self) -> int:
        return self.world_size * self.segment

    @property
    def padding(self) -> int:
        """Elements of the flat buffer that no piece fills (sent and received for nothing)."""
        return self.numel - sum(self.used)

    def zero_padding(self, flat: torch.Tensor) -> None:
        """Zero the unfilled tail of every segment, so the collective never reads uninitialised memory."""
        for owner, used in enumerate(self.used):
            if used < self.segment:
                flat[owner * self.segment + used:(owner + 1) * self.segment].zero_()


def padded_all_gather(flat: torch.Tensor, mine: torch.Tensor, *, group):
    """Start gathering every rank's ``mine`` (one segment each) into ``flat``; returns the work."""
    return dist.all_gather_into_tensor(flat, mine, group=group, async_op=True)


def padded_reduce_scatter(out: torch.Tensor, flat: torch.Tensor, *, group):
    """Start summing ``flat`` over ranks, this rank's segment into ``out``; returns the work."""
    return dist.reduce_scatter_tensor(out, flat, group=group, async_op=True)


def back_to_back(lengths: Sequence[int]) -> list[int]:
    """Where each of pieces of ``lengths`` starts in a buffer that holds them back to back (an all-reduced launch)."""
    positions, used = [], 0
    for length in lengths:
        positions.append(used)
        used += length
    return positions


def all_reduce_launch(flat: torch.Tensor, *, group):
    """Start summing ``flat`` over ranks in place; returns the work."""
    return dist.all_reduce(flat, group=group, async_op=True)


__all__ = ["ALL_REDUCE", "GROUPED", "PADDED", "PER_PIECE", "PRICED", "ZERO3_MODES", "ZERO3_SETTINGS", "LaunchGroup",
           "PaddedSegments", "all_reduce_launch", "back_to_back", "backend_name", "launch_form", "padded_all_gather",
           "padded_reduce_scatter", "zero3_collectives"]
