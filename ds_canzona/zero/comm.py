"""Uneven bucket collectives over deepspeed.comm, with the bytes they move counted.

A bucket is cut into one contiguous segment per rank (``cuts``); segments may differ in size
and may be empty. reduce-scatter with uneven input lists works on every backend we use (gloo,
NCCL). gloo rejects all-gather of uneven sizes; there each non-empty segment is broadcast from
its owner straight into place. That moves exactly the bucket (no padding, no staging copies),
and gloo's broadcast measured 3-5x faster than its all-gather of the same bytes here
(docs/BENCHMARKS.md). Backends that take uneven lists (NCCL) get one uneven all_gather.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

import deepspeed.comm as dist


@dataclass
class CommCounter:
    """Bytes this rank sends into each kind of collective, and how many were launched."""

    bytes: Counter = field(default_factory=Counter)
    calls: Counter = field(default_factory=Counter)

    def add(self, kind: str, nbytes: int) -> None:
        self.bytes[kind] += int(nbytes)
        self.calls[kind] += 1

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()


def _backend_name(group) -> str:
    return str(torch.distributed.get_backend(group)).lower()


def segment_views(flat: torch.Tensor, cuts: tuple[int, ...]) -> list[torch.Tensor]:
    return [flat[cuts[r]:cuts[r + 1]] for r in range(len(cuts) - 1)]


def reduce_scatter_uneven(out: torch.Tensor, flat: torch.Tensor, cuts: tuple[int, ...], *, group,
                          counter: CommCounter, async_op: bool):
    """Sum ``flat`` over ranks; rank r receives its segment [cuts[r], cuts[r+1]) into ``out``."""
    counter.add("reduce_scatter", flat.numel() * flat.element_size())
    return dist.reduce_scatter(out, segment_views(flat, cuts), group=group, async_op=async_op)


def all_gather_uneven(flat: torch.Tensor, cuts: tuple[int, ...], rank: int, *, group,
                      counter: CommCounter) -> None:
    """Every rank's segment of ``flat`` is broadcast into the same place on all ranks, in place."""
    sizes = [cuts[r + 1] - cuts[r] for r in range(len(cuts) - 1)]
    world = len(sizes)
    if world == 1:
        return
    if _backend_name(group) != "gloo":
        counter.add("all_gather", flat.numel() * flat.element_size())
        dist.all_gather(segment_views(flat, cuts), flat[cuts[rank]:cuts[rank + 1]], group=group)
        return
    _broadcast_segments(flat, cuts, sizes, group=group, counter=counter)


def _broadcast_segments(flat: torch.Tensor, cuts: tuple[int, ...], sizes: list[int], *, group,
                        counter: CommCounter) -> None:
    handles = []
    for r, size in enumerate(sizes):
        if size:
            counter.add("broadcast", size * flat.element_size())
            src = dist.get_global_rank(group, r) if group is not None else r
            handles.append(dist.broadcast(flat[cuts[r]:cuts[r + 1]], src=src, group=group, async_op=True))
    for handle in handles:
        handle.wait()


def all_reduce_sum(tensor: torch.Tensor, *, group, counter: CommCounter, kind: str) -> None:
    counter.add(kind, tensor.numel() * tensor.element_size())
    dist.all_reduce(tensor, group=group)


class PlanMismatchError(RuntimeError):
    """Ranks computed different plans: different models, configs or library versions."""


def check_digest_agreement(digest_hex: str, *, group, device) -> None:
    """All-gather a plan's digest and raise ``PlanMismatchError`` unless every rank has the same one.

    Runs before any other collective of ours, so ranks that planned differently stop here.
    """
    world_size = dist.get_world_size(group=group)
    if world_size == 1:
        return
    mine = torch.tensor(list(bytes.fromhex(digest_hex)), dtype=torch.uint8, device=device)
    # The list form: torch deprecates all_gather_into_tensor (a FutureWarning on every start).
    rows = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(rows, mine, group=group)
    rows = [row.cpu() for row in rows]
    differ = [r for r in range(world_size) if not torch.equal(rows[r], rows[0])]
    if differ:
        raise PlanMismatchError(f"optimizer plans differ across ranks: ranks {differ} disagree with rank 0 (different "
                                "models, configs or ds_canzona versions)")
