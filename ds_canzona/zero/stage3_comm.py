"""How ZeRO-3 with owner placement launches its collectives: per piece, grouped, or padded.

Owner placement moves each piece of a tensor between its owner and the other ranks, so its
natural collectives are point-rooted: a ``broadcast`` per piece to fetch it, a ``reduce`` per
item to sum its gradient onto the owner. On gloo with a few ranks those are cheap; on NCCL at
64-1024 ranks every launch costs tens of microseconds, and one forward of a 32-layer model would
issue hundreds. So ``canzona.collectives`` chooses (``zero3_collectives``):

- ``per_piece`` (what "default" means on gloo): one broadcast per piece per fetch, one reduce
  per item per backward, no parameter persistent. gloo cannot group collectives
  (no ``startCoalescing``), and this measured best there (docs/NOTES.md);
- ``grouped`` ("default" on every other backend): the same broadcasts and reduces, but a
  fetch's broadcasts, a gradient bucket's reduces and the post-step refresh of the persistent
  parameters each go out as one grouped launch (``LaunchGroup``: torch's coalescing manager,
  one ``ncclGroupStart/End`` on NCCL). The bytes are exactly the pieces', and no staging copy is
  made: each broadcast lands in the parameter's full buffer, the owner of a whole tensor lends
  its shard;
- ``padded``: one equal-size collective per fetch (``all_gather_into_tensor``) and per gradient
  bucket (``reduce_scatter_tensor``), each rank's segment padded to the largest
  (``PaddedSegments``). One launch on every backend, gloo included, at the price of the padding
  bytes, one copy of what each rank sends into the flat buffer, and that buffer for the life of
  one fetch or bucket (freed at ``wait()``: no parameter keeps a view of it).

``grouped`` and ``padded`` also honour DeepSpeed's ``stage3_param_persistence_threshold`` and
bucket the gradient reduce by ``reduce_bucket_size`` (``ds_canzona.zero.stage3``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

import deepspeed.comm as dist
from deepspeed.comm.torch import get_coalescing_manager

PER_PIECE, GROUPED, PADDED = "per_piece", "grouped", "padded"
ZERO3_MODES = (PER_PIECE, GROUPED, PADDED)
# The ``canzona.collectives`` values stage 3 takes ("allreduce" is a stage 1/2 form only).
ZERO3_SETTINGS = ("default", GROUPED, PADDED)


def backend_name(group) -> str:
    return str(torch.distributed.get_backend(group)).lower()


def zero3_collectives(choice: str, group) -> str:
    """The ZeRO-3 mode that ``canzona.collectives`` = ``choice`` means on ``group``'s backend."""
    if choice == "default":
        return PER_PIECE if backend_name(group) == "gloo" else GROUPED
    if choice in (GROUPED, PADDED):
        return choice
    raise ValueError(f"canzona.collectives must be 'default', 'grouped' or 'padded', got {choice!r}")


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


__all__ = ["GROUPED", "PADDED", "PER_PIECE", "ZERO3_MODES", "ZERO3_SETTINGS", "LaunchGroup", "PaddedSegments", "backend_name",
           "padded_all_gather", "padded_reduce_scatter", "zero3_collectives"]
