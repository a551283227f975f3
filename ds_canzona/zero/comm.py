"""Bucket collectives over deepspeed.comm, in the form chosen per bucket, with what they move counted.

A bucket is cut into one contiguous segment per rank (``cuts``); segments may differ in size
and may be empty. Each bucket's reduce-scatter and each gather group's all-gather take one of
three forms, chosen once at init by ``ds_canzona.plan.collectives`` (the same on every rank):

- grouped: one rank-rooted operation per non-empty segment, all in one grouped launch
  (``LaunchGroup``: one ncclGroupStart/End on NCCL). The reduce-scatter is a ``reduce`` of each
  non-empty segment to its owner, in place in the send buffer; the owner's sum is copied into
  ``out`` when the work is waited on. The all-gather is a ``broadcast`` of each non-empty segment
  from its owner straight into place. An uneven list would be P operations on NCCL (torch runs
  it as one ncclReduce / ncclBroadcast per rank, the empty segments included). gloo cannot
  group; it keeps its uneven list reduce-scatter (one call, measured best there) and the
  broadcasts, which move exactly the bucket and measured 3-5x faster than gloo's all-gather of
  the same bytes (docs/BENCHMARKS.md). No padding.
- padded: every segment padded to the bucket's largest (m elements), one equal-size
  ``reduce_scatter_tensor`` / ``all_gather_into_tensor`` on any backend. Where the segments
  differ the bucket is staged through a buffer of P x m (a fill and one multi-tensor copy); where
  they are all equal the bucket itself is the buffer. The reduce-scatter writes m elements, so
  its output holds at least m (the runtime allocates its segment buffers that long); the
  elements past this rank's own segment are padding and never read.
- allreduce: one ``all_reduce``, in place. The reduce-scatter sums the whole bucket and copies
  this rank's segment of the sum into ``out`` when waited on. The all-gather runs over a gather
  group's contiguous buffer (its buckets are views of it): each rank writes -0.0 over every
  element it does not own, and the sum is then each owner's values exactly (x + -0.0 == x for
  every x, signed zeros and NaN included), one operation for the whole group.

``CommCounter`` counts, per kind of call, the bytes handed to it (padding included), the calls
launched (a gather group's launch counts once), the operations inside them (a grouped launch: its
non-empty segments; gloo's list reduce-scatter: P) and the padding bytes.
"""

from __future__ import annotations

import functools
import warnings
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

import deepspeed.comm as dist

from ds_canzona.plan.collectives import ALL_REDUCE, COLLECTIVE_FORMS, GROUPED, PADDED
from ds_canzona.zero.stage3_comm import LaunchGroup

__all__ = ["CommCounter", "PlanMismatchError", "all_gather_buckets", "all_reduce_sum",
           "backend_name", "check_digest_agreement", "reduce_scatter_bucket", "segment_views"]


@dataclass
class CommCounter:
    """Per kind of call: bytes this rank hands in, calls launched, operations inside them, padding bytes."""

    bytes: Counter = field(default_factory=Counter)
    calls: Counter = field(default_factory=Counter)
    operations: Counter = field(default_factory=Counter)
    padding: Counter = field(default_factory=Counter)

    def add(self, kind: str, nbytes: int, *, operations: int = 1, padding_bytes: int = 0) -> None:
        self.bytes[kind] += int(nbytes)
        self.calls[kind] += 1
        self.operations[kind] += int(operations)
        if padding_bytes:
            self.padding[kind] += int(padding_bytes)

    def reset(self) -> None:
        for counter in (self.bytes, self.calls, self.operations, self.padding):
            counter.clear()


def backend_name(group) -> str:
    """The process group's backend, lower case ("gloo", "nccl", ...)."""
    return str(torch.distributed.get_backend(group)).lower()


def segment_views(flat: torch.Tensor, cuts: tuple[int, ...]) -> list[torch.Tensor]:
    return [flat[cuts[r]:cuts[r + 1]] for r in range(len(cuts) - 1)]


def _check_form(form: str) -> None:
    if form not in COLLECTIVE_FORMS:
        raise ValueError(f"a bucket collective is one of {COLLECTIVE_FORMS}, got {form!r}")


def _largest_segment(cuts: tuple[int, ...]) -> int:
    return max(cuts[r + 1] - cuts[r] for r in range(len(cuts) - 1))


def _padded_slots(padded: torch.Tensor, cuts: tuple[int, ...], largest: int) -> list[torch.Tensor]:
    """Each rank's segment's place in a padded buffer: the first (its size) elements of its slot."""
    return [padded[r * largest:r * largest + cuts[r + 1] - cuts[r]] for r in range(len(cuts) - 1)]


def _copy_nonempty(destinations: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """One multi-tensor copy (a few launches on CUDA, whatever P is) of the non-empty pairs."""
    pairs = [(d, s) for d, s in zip(destinations, sources) if d.numel()]
    if pairs:
        torch._foreach_copy_([d for d, _ in pairs], [s for _, s in pairs])


@functools.cache  # one filter, installed on first use
def _quiet_tensor_collectives() -> None:
    # torch 2.13 deprecates the *_tensor names that deepspeed.comm calls (a FutureWarning per process);
    # the message is about DeepSpeed's backend, not something a user of ds_canzona can change.
    warnings.filterwarnings("ignore", message=r".*torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)"
                            r"` is deprecated", category=FutureWarning)


def reduce_scatter_bucket(out: torch.Tensor, flat: torch.Tensor, cuts: tuple[int, ...], form: str, *, group,
                          counter: CommCounter, async_op: bool):
    """Sum ``flat`` over ranks; this rank's segment [cuts[r], cuts[r+1]) of the sum lands at the start of ``out``.

    Returns (work handle or None, the tensor the collective reads): keep that tensor alive until
    the collective is done (it is ``flat`` itself unless the padded form staged a copy). The
    grouped form outside gloo reduces in place, so ``flat`` holds no gradient to read afterwards.
    """
    _check_form(form)
    world = len(cuts) - 1
    element = flat.element_size()
    if form == ALL_REDUCE:
        counter.add("reduce_scatter", flat.numel() * element)
        rank = dist.get_rank(group=group)
        work = dist.all_reduce(flat, group=group, async_op=True)
        arrival = _OwnSegmentArrival([work], out, flat[cuts[rank]:cuts[rank + 1]])
        if not async_op:
            arrival.wait()
            return None, flat
        return arrival, flat
    if form == GROUPED:
        if backend_name(group) == "gloo" and not _REDUCE_TO_OWNERS_ON_GLOO:
            counter.add("reduce_scatter", flat.numel() * element, operations=world)
            return dist.reduce_scatter(out, segment_views(flat, cuts), group=group, async_op=async_op), flat
        work = _reduce_to_owners(out, flat, cuts, group=group, counter=counter)
        if not async_op:
            work.wait()
            return None, flat
        return work, flat
    largest = _largest_segment(cuts)
    if out.numel() < largest:
        raise ValueError(f"the padded reduce-scatter writes {largest} elements; the output holds {out.numel()}")
    send = flat
    if world * largest != flat.numel():
        send = torch.zeros(world * largest, dtype=flat.dtype, device=flat.device)
        _copy_nonempty(_padded_slots(send, cuts, largest), segment_views(flat, cuts))
    counter.add("reduce_scatter", send.numel() * element, padding_bytes=(send.numel() - flat.numel()) * element)
    _quiet_tensor_collectives()
    return dist.reduce_scatter_tensor(out[:largest], send, group=group, async_op=async_op), send


def all_gather_buckets(flats: Sequence[torch.Tensor], bucket_cuts: Sequence[tuple[int, ...]], rank: int,
                       forms: Sequence[str], *, group, counter: CommCounter, buffer: torch.Tensor | None = None) -> None:
    """All-gather several buckets in place, in as few launches as their forms allow (a gather group).

    ``buffer``: the contiguous tensor the buckets are consecutive views of, in order; with it, a
    group whose buckets all take the allreduce form is one ``all_reduce`` over it. Without it each
    all-reduced bucket is an ``all_reduce`` of its own. Where the backend groups collectives (not
    gloo), the grouped buckets' broadcasts go out as one launch and the padded buckets'
    ``all_gather_into_tensor`` calls as another (torch coalesces ops of one type; the kinds are
    never mixed in one launch: ``ds_canzona.plan.gather_groups``). gloo issues each call on its
    own. Returns once every gather is done (on the current stream where streams are real).
    """
    if not len(flats) == len(bucket_cuts) == len(forms):
        raise ValueError(f"{len(flats)} buckets, {len(bucket_cuts)} cuts and {len(forms)} forms")
    for form in forms:
        _check_form(form)
    if not flats or len(bucket_cuts[0]) - 1 == 1:
        return  # one rank: nothing to gather
    grouped = [(flat, cuts) for flat, cuts, form in zip(flats, bucket_cuts, forms) if form == GROUPED]
    padded = [(flat, cuts) for flat, cuts, form in zip(flats, bucket_cuts, forms) if form == PADDED]
    all_reduced = [(flat, cuts) for flat, cuts, form in zip(flats, bucket_cuts, forms) if form == ALL_REDUCE]
    if grouped:
        _broadcast_segments(grouped, group=group, counter=counter)
    if padded:
        _all_gather_padded(padded, rank, group=group, counter=counter)
    if all_reduced:
        if buffer is not None and len(all_reduced) == len(flats):
            _all_reduce_gather(buffer, all_reduced, rank, group=group, counter=counter)
        else:
            for flat, cuts in all_reduced:
                _all_reduce_gather(flat, [(flat, cuts)], rank, group=group, counter=counter)


def _all_reduce_gather(buffer: torch.Tensor, buckets: list[tuple[torch.Tensor, tuple[int, ...]]], rank: int, *,
                       group, counter: CommCounter) -> None:
    """One in-place ``all_reduce`` over ``buffer`` (the buckets' consecutive views): -0.0 wherever this rank
    owns nothing, so the sum is each owner's values, bit for bit."""
    base, position, others = buffer.storage_offset(), 0, []
    root = buffer._base if buffer._base is not None else buffer
    for flat, cuts in buckets:
        start = flat.storage_offset() - base
        # Views of one tensor (identity of the base, not storage pointers: fake tensors have none).
        if start != position or (flat._base if flat._base is not None else flat) is not root:
            raise ValueError("an all-reduced gather group's buckets must be consecutive views of its buffer")
        if cuts[rank] > 0:
            others.append(buffer[position:start + cuts[rank]])
        position = start + cuts[rank + 1]
        if cuts[rank + 1] < flat.numel():
            others.append(buffer[position:start + flat.numel()])
        position = start + flat.numel()
    if position != buffer.numel():
        raise ValueError(f"the buckets cover {position} of the buffer's {buffer.numel()} elements")
    if others:  # -0.0, not 0.0: 0.0 + -0.0 is +0.0, which would flip an owner's negative zero
        torch._foreach_zero_(others)
        torch._foreach_neg_(others)
    counter.add("all_gather", buffer.numel() * buffer.element_size())
    dist.all_reduce(buffer, group=group)


def _all_gather_padded(buckets: list[tuple[torch.Tensor, tuple[int, ...]]], rank: int, *, group,
                       counter: CommCounter) -> None:
    """One ``all_gather_into_tensor`` per bucket over its segments padded to the largest, in one launch."""
    staged = []  # (flat, cuts, the padded buffer, its slot size)
    for flat, cuts in buckets:
        world, largest = len(cuts) - 1, _largest_segment(cuts)
        # In place: this rank's input is its own slot of the output (NCCL's in-place all-gather).
        gathered = flat
        if world * largest != flat.numel():
            gathered = torch.empty(world * largest, dtype=flat.dtype, device=flat.device)
            own = cuts[rank + 1] - cuts[rank]
            gathered[rank * largest:rank * largest + own].copy_(flat[cuts[rank]:cuts[rank + 1]])
            # The padding is sent but never read; zeroed, the bytes on the wire do not depend on old memory.
            gathered[rank * largest + own:(rank + 1) * largest].zero_()
        staged.append((flat, cuts, gathered, largest))
    element = buckets[0][0].element_size()
    nbytes = sum(gathered.numel() for _, _, gathered, _ in staged) * element
    padding = sum(gathered.numel() - flat.numel() for flat, _, gathered, _ in staged) * element
    if backend_name(group) != "gloo":
        counter.add("all_gather", nbytes, operations=len(staged), padding_bytes=padding)
    else:  # gloo cannot group: each bucket's gather is a launch of its own
        for flat, _, gathered, _ in staged:
            counter.add("all_gather", gathered.numel() * element,
                        padding_bytes=(gathered.numel() - flat.numel()) * element)
    _quiet_tensor_collectives()
    # torch queues the calls and issues them as one allgather_into_tensor_coalesced at the end of the
    # block (on gloo each runs here).
    with LaunchGroup(group=group, device=staged[0][0].device, queued=True) as launch:
        for _, _, gathered, largest in staged:
            dist.all_gather_into_tensor(gathered, gathered[rank * largest:(rank + 1) * largest], group=group)
    for work in launch.works:
        work.wait()
    for flat, cuts, gathered, largest in staged:
        if gathered is not flat:
            others = [r for r in range(len(cuts) - 1) if r != rank]
            slots, segments = _padded_slots(gathered, cuts, largest), segment_views(flat, cuts)
            _copy_nonempty([segments[r] for r in others], [slots[r] for r in others])


# The grouped reduce-scatter on gloo is the uneven list (measured best there); tests switch this on
# to check the reduces to the owners against it on gloo, the only backend they can run.
_REDUCE_TO_OWNERS_ON_GLOO = False


def _global_rank(group, r: int) -> int:
    return dist.get_global_rank(group, r) if group is not None else r


def _nonempty(flat: torch.Tensor, cuts: tuple[int, ...]) -> list[tuple[int, torch.Tensor]]:
    return [(r, segment) for r, segment in enumerate(segment_views(flat, cuts)) if segment.numel()]


class _OwnSegmentArrival:
    """The work of a grouped reduce-scatter: waiting ends the reduces, then moves this rank's sum into ``out``.

    The copy runs on the stream current at ``wait()`` (the runtime's reduction stream), so it is
    ordered after the collective like any reader of a waited work.
    """

    def __init__(self, works: list, out: torch.Tensor, summed: torch.Tensor) -> None:
        self._works, self._out, self._summed = works, out, summed

    def wait(self) -> None:
        for work in self._works:
            work.wait()
        self._works = []
        if self._summed.numel():
            self._out[:self._summed.numel()].copy_(self._summed)


def _reduce_to_owners(out: torch.Tensor, flat: torch.Tensor, cuts: tuple[int, ...], *, group,
                      counter: CommCounter) -> _OwnSegmentArrival:
    """One ``reduce`` per non-empty segment to its owner, in one grouped launch; returns the work to wait for.

    In place: the owner's segment of ``flat`` receives the sum, the other ranks' copies of it are
    left unspecified (the runtime never reads a bucket after its reduce-scatter).
    """
    segments = _nonempty(flat, cuts)
    counter.add("reduce_scatter", flat.numel() * flat.element_size(), operations=len(segments))
    with LaunchGroup(group=group, device=flat.device) as launch:
        for r, segment in segments:
            launch.add(dist.reduce(segment, dst=_global_rank(group, r), group=group, async_op=True))
    rank = dist.get_rank(group=group)
    return _OwnSegmentArrival(launch.works, out, flat[cuts[rank]:cuts[rank + 1]])


def _broadcast_segments(buckets: list[tuple[torch.Tensor, tuple[int, ...]]], *, group, counter: CommCounter) -> None:
    """One ``broadcast`` per non-empty segment from its owner, for every bucket, in one grouped launch (each on its
    own on gloo)."""
    segments = [(r, segment) for flat, cuts in buckets for r, segment in _nonempty(flat, cuts)]
    element = buckets[0][0].element_size()
    if backend_name(group) != "gloo":
        counter.add("all_gather", sum(flat.numel() for flat, _ in buckets) * element, operations=len(segments))
    else:  # gloo cannot group: each broadcast is a launch of its own
        for _, segment in segments:
            counter.add("broadcast", segment.numel() * element)
    with LaunchGroup(group=group, device=buckets[0][0].device) as launch:
        for r, segment in segments:
            launch.add(dist.broadcast(segment, src=_global_rank(group, r), group=group, async_op=True))
    for work in launch.works:
        work.wait()


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
