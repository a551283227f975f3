"""Which form each bucket collective takes: one operation (padded or all-reduced) or grouped rank-rooted ones.

A ZeRO-1/2 bucket is cut into one contiguous segment per rank; the segments differ in size and
may be empty. Its reduce-scatter, and the all-gather of a gather group of consecutive buckets
(``ds_canzona.plan.gather_groups``), take one of three forms:

- *grouped*: one rank-rooted operation per NON-EMPTY segment, all in one grouped launch: a
  ``reduce`` to the segment's owner for the reduce-scatter, a ``broadcast`` from it for the
  all-gather (``ds_canzona.zero.comm``; one ncclGroupStart/End on NCCL). It moves no extra byte,
  but it is k NCCL operations for k owners, and NCCL runs Reduce and Broadcast on a ring only,
  so each of them pays the ring's latency. gloo keeps its uneven list reduce-scatter (one call,
  measured best there) and the broadcasts.
- *padded*: every segment padded to the bucket's largest, then one equal-size collective
  (``reduce_scatter_tensor`` / ``all_gather_into_tensor``). One operation, but the padding
  travels too, and a bucket whose segments differ is staged through a padded buffer.
- *allreduce*: one ``all_reduce`` of the whole bucket. As a reduce-scatter each rank reads its
  own segment of the sum; as an all-gather every rank first writes -0.0 over the segments it
  does not own (-0.0 is the exact identity of addition: x + -0.0 is x, bit for bit, for every x,
  +0.0 and NaN included), so the sum is each owner's values. One operation over a gather group's
  contiguous buffer, whatever the number of buckets and owners, in place; it moves the bucket
  twice (the all-reduce's reduce-scatter and all-gather halves), N elements more than the data.

The default is one operation per collective, which is what keeps a step's NCCL operations from
growing with the world size: per bucket one reduce-scatter, per gather group one all-gather,
plus the norm's all-reduce: ``B + G + 1``, at most DeepSpeed's stage 2 (``B + 3`` and more:
``ds_canzona.plan.gather_groups``). Among the one-operation forms the cost model below picks: a
bucket (or group) with a single owner takes its one reduce / broadcast (grouped, nothing extra);
otherwise padded where its padding costs less than the all-reduce's second pass, else
allreduce. A gather group of several buckets is one all-reduce (a padded gather would be one
operation per bucket). Measured on the Qwen3-8B plan at DP 8 to 1024, every one-operation form
costs about N extra elements (padded buckets 3x to 100x N, padded gather groups 0.8x to 13x N;
docs/NOTES.md), so the all-reduce's N is the floor of what one operation costs here. A run bound
by bytes rather than launches sets ``canzona.collectives`` to "grouped" (fewest bytes).

The choice is made once at init, as a pure function of the cuts, the gather groups, the element
size, the world size, the backend and two constants, so every rank takes the same form
(collectives must match). With P ranks, a bucket of N elements whose largest segment is m, k of
its P segments non-empty, padding ``P*m - N`` elements of e bytes:

    latency(P) = launch_s * max(1, log2 P)        one collective operation's fixed time
    grouped    = k * latency(P)                   k rank-rooted operations (one per non-empty segment)
    padded     = latency(P)                       one operation
                 + 2 * launch_s  (if padding)     staging: a fill and a copy on the device
                 + padding * e / bytes_per_s      the padding on the wire
    allreduce  = latency(P) + N * e / bytes_per_s the second pass over the bucket

The data's own N elements are in every form, so that term is left out. Between padded and
allreduce a tie goes to allreduce (in place, no staging buffer). Defaults are NCCL-like:
``launch_s`` 5 us, ``bytes_per_s`` 50e9 (one 400 Gb/s NIC per GPU). gloo (the CPU) keeps the
grouped form by default: measured there, the padded reduce-scatter is not faster at bucket sizes
that matter and the padded all-gather is slower than its broadcasts (docs/NOTES.md).

Only the standard library is imported: ``ds-canzona plan`` reports the choice offline.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "ALL_REDUCE",
    "COLLECTIVE_FORMS",
    "COLLECTIVE_SETTINGS",
    "DEFAULT_COLLECTIVE_BYTES_PER_S",
    "DEFAULT_COLLECTIVE_LAUNCH_S",
    "GROUPED",
    "PADDED",
    "BucketForms",
    "CollectiveCosts",
    "FormSummary",
    "bucket_forms",
    "choose_form",
    "choose_forms",
    "choose_gather_form",
    "choose_piece_form",
    "form_operations",
    "nonempty_segments",
    "owner_cuts",
    "padding_numel",
    "summarize_forms",
]

GROUPED = "grouped"
PADDED = "padded"
ALL_REDUCE = "allreduce"
COLLECTIVE_FORMS = (GROUPED, PADDED, ALL_REDUCE)
# The ``canzona.collectives`` values: "default" is one operation per collective, priced by the cost model.
COLLECTIVE_SETTINGS = ("default",) + COLLECTIVE_FORMS

DEFAULT_COLLECTIVE_LAUNCH_S = 5e-6
DEFAULT_COLLECTIVE_BYTES_PER_S = 50e9


@dataclass(frozen=True)
class CollectiveCosts:
    """The two constants of the cost model: seconds per launch (per hop), wire bytes per second."""

    launch_s: float = DEFAULT_COLLECTIVE_LAUNCH_S
    bytes_per_s: float = DEFAULT_COLLECTIVE_BYTES_PER_S

    def __post_init__(self) -> None:
        for name in ("launch_s", "bytes_per_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"CollectiveCosts.{name} must be a positive finite number, got {value!r}")

    def latency_s(self, world_size: int) -> float:
        return self.launch_s * max(1.0, math.log2(world_size))

    def grouped_s(self, cuts: Sequence[int]) -> float:
        return nonempty_segments(cuts) * self.latency_s(len(cuts) - 1)

    def padded_s(self, cuts: Sequence[int], element_bytes: int) -> float:
        padding = padding_numel(cuts)
        staging = 2 * self.launch_s if padding else 0.0
        return self.latency_s(len(cuts) - 1) + staging + padding * element_bytes / self.bytes_per_s

    def all_reduce_s(self, cuts: Sequence[int], element_bytes: int) -> float:
        return self.latency_s(len(cuts) - 1) + (cuts[-1] - cuts[0]) * element_bytes / self.bytes_per_s


def nonempty_segments(cuts: Sequence[int]) -> int:
    """Segments of a bucket that hold elements: the operations its grouped form issues."""
    return sum(b > a for a, b in zip(cuts, cuts[1:]))


def padding_numel(cuts: Sequence[int]) -> int:
    """Elements the padded form adds to a bucket: P times its largest segment, less its size."""
    world_size = len(cuts) - 1
    largest = max(cuts[r + 1] - cuts[r] for r in range(world_size))
    return world_size * largest - (cuts[-1] - cuts[0])


def form_operations(form: str, cuts: Sequence[int]) -> int:
    """NCCL operations one bucket's collective issues in ``form`` (none with one rank)."""
    if len(cuts) <= 2:
        return 0
    return nonempty_segments(cuts) if form == GROUPED else 1


def _check_setting(setting: str) -> None:
    if setting not in COLLECTIVE_SETTINGS:
        raise ValueError(f"collectives must be one of {COLLECTIVE_SETTINGS}, got {setting!r}")


def _check_cuts(cuts: Sequence[int]) -> None:
    if len(cuts) < 2 or any(b < a for a, b in zip(cuts, cuts[1:])):
        raise ValueError(f"cuts must be at least two non-decreasing bounds, got {tuple(cuts)}")


def choose_form(cuts: Sequence[int], *, element_bytes: int, backend: str, setting: str = "default",
                costs: CollectiveCosts = CollectiveCosts()) -> str:
    """The form of one bucket's collective (``cuts``: P + 1 segment bounds): a reduce-scatter, or a one-bucket gather."""
    _check_setting(setting)
    _check_cuts(cuts)
    if len(cuts) == 2:
        return GROUPED  # one rank: no collective runs at all
    if setting != "default":
        return setting
    if backend == "gloo" or nonempty_segments(cuts) <= 1:
        return GROUPED  # gloo: measured best there; one owner: its one reduce / broadcast is one operation already
    if costs.padded_s(cuts, element_bytes) < costs.all_reduce_s(cuts, element_bytes):
        return PADDED
    return ALL_REDUCE


def choose_forms(bucket_cuts: Sequence[Sequence[int]], **kwargs) -> tuple[str, ...]:
    """:func:`choose_form` for every bucket, in bucket order."""
    return tuple(choose_form(cuts, **kwargs) for cuts in bucket_cuts)


def choose_gather_form(group_cuts: Sequence[Sequence[int]], *, element_bytes: int, backend: str,
                       setting: str = "default", costs: CollectiveCosts = CollectiveCosts()) -> str:
    """The one form of a gather group's all-gather (``group_cuts``: its buckets' cuts, in order).

    One bucket: as :func:`choose_form`. Several, by default on a backend that groups: a single
    owner of all of them broadcasts (one operation), anything else is one all-reduce over the
    group's buffer (padded gathers would be one operation per bucket).
    """
    _check_setting(setting)
    for cuts in group_cuts:
        _check_cuts(cuts)
    if len(group_cuts) == 1:
        return choose_form(group_cuts[0], element_bytes=element_bytes, backend=backend, setting=setting, costs=costs)
    if not group_cuts or len(group_cuts[0]) == 2:
        return GROUPED
    if setting != "default":
        return setting
    owners = {r for cuts in group_cuts for r in range(len(cuts) - 1) if cuts[r + 1] > cuts[r]}
    if backend == "gloo" or len(owners) <= 1:
        return GROUPED
    return ALL_REDUCE


def owner_cuts(pieces: Sequence[tuple[int, int]], world_size: int) -> tuple[int, ...]:
    """The cuts of a launch of owner-placed pieces ``((length, owner), ...)``, laid out owner segment by segment.

    ZeRO-3 moves pieces between their owners and every rank; put in one buffer, each owner's pieces
    back to back, they are a bucket whose rank r segment is everything rank r owns in the launch.
    """
    used = [0] * world_size
    for length, owner in pieces:
        used[owner] += length
    cuts = [0]
    for size in used:
        cuts.append(cuts[-1] + size)
    return tuple(cuts)


def choose_piece_form(pieces: Sequence[tuple[int, int]], *, world_size: int, element_bytes: int,
                      costs: CollectiveCosts = CollectiveCosts()) -> str:
    """The one-operation form of one ZeRO-3 launch (a fetch, a gradient bucket) of ``(length, owner)`` pieces.

    One piece: its own broadcast or reduce (grouped), in place. Several: padded where its padding
    costs less than the all-reduce's second pass (as :func:`choose_form` prices a bucket), else
    allreduce. A single owner of several pieces is priced the same way: its pieces sit in separate
    tensors, so one operation means one staged buffer either way.
    """
    if world_size <= 1 or len(pieces) <= 1:
        return GROUPED
    cuts = owner_cuts(pieces, world_size)
    if costs.padded_s(cuts, element_bytes) < costs.all_reduce_s(cuts, element_bytes):
        return PADDED
    return ALL_REDUCE


@dataclass(frozen=True)
class FormSummary:
    """How many buckets take each form in one kind of collective, and the extra bytes that costs."""

    padded: int
    grouped: int
    all_reduced: int
    padding_bytes: int  # per step: the padded buckets' padding, once each
    second_pass_bytes: int  # per step: the all-reduced buckets' own bytes again (the all-reduce's second half)
    bucket_bytes: int  # per step: every bucket's own bytes, once each
    grouped_s: float  # the cost model's seconds per step with every bucket grouped (launches only)
    padded_s: float  # ... with every bucket padded (launch, staging, padding on the wire)
    operations: int  # per step, under the chosen forms (a gather group in one all-reduce: one)

    @property
    def padding_fraction(self) -> float:
        return self.padding_bytes / self.bucket_bytes if self.bucket_bytes else 0.0

    @property
    def extra_fraction(self) -> float:
        """Bytes beyond the data, padding and second passes, over the buckets' bytes."""
        return (self.padding_bytes + self.second_pass_bytes) / self.bucket_bytes if self.bucket_bytes else 0.0


def summarize_forms(bucket_cuts: Sequence[Sequence[int]], forms: Sequence[str], element_bytes: int,
                    costs: CollectiveCosts = CollectiveCosts(),
                    groups: Sequence[Sequence[int]] | None = None) -> FormSummary:
    """``groups``: the gather groups when ``forms`` are all-gathers (an all-reduced group is one operation)."""
    if len(forms) != len(bucket_cuts):
        raise ValueError(f"{len(forms)} forms for {len(bucket_cuts)} buckets")
    groups = [(b,) for b in range(len(forms))] if groups is None else groups
    padding = sum(padding_numel(cuts) for cuts, form in zip(bucket_cuts, forms) if form == PADDED)
    second = sum(cuts[-1] - cuts[0] for cuts, form in zip(bucket_cuts, forms) if form == ALL_REDUCE and len(cuts) > 2)
    real = [cuts for cuts in bucket_cuts if len(cuts) > 2]  # one rank: no collective to price
    operations = 0
    for group in groups:
        per_bucket = [form_operations(forms[b], bucket_cuts[b]) for b in group]
        all_reduced = [b for b in group if forms[b] == ALL_REDUCE and len(bucket_cuts[b]) > 2]
        operations += sum(per_bucket) - len(all_reduced) + (1 if all_reduced else 0)
    return FormSummary(padded=sum(form == PADDED for form in forms), grouped=sum(form == GROUPED for form in forms),
                       all_reduced=sum(form == ALL_REDUCE for form in forms),
                       padding_bytes=padding * element_bytes, second_pass_bytes=second * element_bytes,
                       bucket_bytes=sum(cuts[-1] - cuts[0] for cuts in bucket_cuts) * element_bytes,
                       grouped_s=sum(costs.grouped_s(cuts) for cuts in real),
                       padded_s=sum(costs.padded_s(cuts, element_bytes) for cuts in real),
                       operations=operations)


@dataclass(frozen=True)
class BucketForms:
    """Per bucket, the form of its reduce-scatter (communication dtype) and of its all-gather (parameter dtype).

    Every bucket of a gather group carries the group's one all-gather form.
    """

    reduce_scatter: tuple[str, ...]
    all_gather: tuple[str, ...]
    setting: str
    backend: str
    reduce_scatter_summary: FormSummary
    all_gather_summary: FormSummary
    gather_groups: tuple[tuple[int, ...], ...] = ()


def bucket_forms(bucket_cuts: Sequence[Sequence[int]], *, reduce_scatter_bytes: int, all_gather_bytes: int,
                 backend: str, setting: str = "default", costs: CollectiveCosts = CollectiveCosts(),
                 gather_groups: Sequence[Sequence[int]] | None = None) -> BucketForms:
    """Both collectives' forms for every bucket, with what they cost (``*_bytes``: element sizes).

    ``gather_groups``: consecutive buckets whose all-gathers go out together (by default one per bucket).
    """
    groups = tuple((b,) for b in range(len(bucket_cuts))) if gather_groups is None \
        else tuple(tuple(g) for g in gather_groups)
    if sorted(b for g in groups for b in g) != list(range(len(bucket_cuts))):
        raise ValueError(f"the gather groups {groups} do not cover the {len(bucket_cuts)} buckets once each")
    reduce_scatter = choose_forms(bucket_cuts, element_bytes=reduce_scatter_bytes, backend=backend, setting=setting,
                                  costs=costs)
    all_gather = [GROUPED] * len(bucket_cuts)
    for group in groups:
        form = choose_gather_form([bucket_cuts[b] for b in group], element_bytes=all_gather_bytes, backend=backend,
                                  setting=setting, costs=costs)
        for b in group:
            all_gather[b] = form
    all_gather = tuple(all_gather)
    return BucketForms(reduce_scatter=reduce_scatter, all_gather=all_gather, setting=setting, backend=backend,
                       reduce_scatter_summary=summarize_forms(bucket_cuts, reduce_scatter, reduce_scatter_bytes, costs),
                       all_gather_summary=summarize_forms(bucket_cuts, all_gather, all_gather_bytes, costs, groups),
                       gather_groups=groups)
