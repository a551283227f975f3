"""Which form each bucket's collectives take: grouped uneven operations or one padded collective.

A ZeRO-1/2 bucket is cut into one contiguous segment per rank; the segments differ in size and
may be empty. Its reduce-scatter and all-gather can run in two forms:

- *grouped*: one rank-rooted operation per NON-EMPTY segment, all in one grouped launch: a
  ``reduce`` to the segment's owner for the reduce-scatter, a ``broadcast`` from it for the
  all-gather (``ds_canzona.zero.comm``; one ncclGroupStart/End on NCCL). With whole-tensor
  ownership most segments are empty at large P (a few hundred tensors for 1024 ranks), so this
  is far fewer than the P operations torch issues for an uneven list. gloo keeps its uneven
  list reduce-scatter (one call, measured best there) and the broadcasts. No extra bytes.
- *padded*: every segment padded to the bucket's largest, then one equal-size collective
  (``reduce_scatter_tensor`` / ``all_gather_into_tensor``). One operation, but the padding
  travels too, and a bucket whose segments differ is staged through a padded buffer.

The choice is made per bucket and per collective (their dtypes may differ) from a small cost
model, once at init, as a pure function of the cuts, the element size, the world size, the
backend and two constants, so every rank takes the same form (collectives must match). With P
ranks, a bucket of N elements whose largest segment is m, k of its P segments non-empty, padding
``P*m - N`` elements of e bytes:

    latency(P) = launch_s * max(1, log2 P)        one collective operation's fixed time; it grows
                                                   with the ring/tree of P ranks
    grouped    = k * latency(P)                   k rank-rooted operations (one per non-empty segment)
    padded     = latency(P)                       one operation
                 + 2 * launch_s  (if padding)     staging: a fill and a copy on the device
                 + padding * e / bytes_per_s      the padding on the wire

Both forms move the bucket's own N elements, so that term is left out of both. Padded is taken
when it is strictly cheaper; a tie goes to grouped, which moves no extra bytes. Defaults are
NCCL-like: ``launch_s`` 5 us (about 5 us per hop of small-message latency: 15 us at 8 ranks, 50 us
at 1024), ``bytes_per_s`` 50e9 (one 400 Gb/s NIC per GPU). gloo (the CPU) keeps the grouped form
by default: measured there, the padded reduce-scatter is not faster at bucket sizes that matter
and the padded all-gather is slower than its broadcasts (docs/NOTES.md).

Only the standard library is imported: ``ds-canzona plan`` reports the choice offline.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
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
    "nonempty_segments",
    "padding_numel",
    "summarize_forms",
]

GROUPED = "grouped"
PADDED = "padded"
# The ``canzona.collectives`` values: "default" is the cost model (grouped on gloo).
COLLECTIVE_SETTINGS = ("default", GROUPED, PADDED)

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


def nonempty_segments(cuts: Sequence[int]) -> int:
    """Segments of a bucket that hold elements: the operations its grouped form issues."""
    return sum(b > a for a, b in zip(cuts, cuts[1:]))


def padding_numel(cuts: Sequence[int]) -> int:
    """Elements the padded form adds to a bucket: P times its largest segment, less its size."""
    world_size = len(cuts) - 1
    largest = max(cuts[r + 1] - cuts[r] for r in range(world_size))
    return world_size * largest - (cuts[-1] - cuts[0])


def choose_form(cuts: Sequence[int], *, element_bytes: int, backend: str, setting: str = "default",
                costs: CollectiveCosts = CollectiveCosts()) -> str:
    """GROUPED or PADDED for one collective of one bucket (``cuts``: P + 1 segment bounds)."""
    if setting not in COLLECTIVE_SETTINGS:
        raise ValueError(f"collectives must be one of {COLLECTIVE_SETTINGS}, got {setting!r}")
    if len(cuts) < 2 or any(b < a for a, b in zip(cuts, cuts[1:])):
        raise ValueError(f"cuts must be at least two non-decreasing bounds, got {tuple(cuts)}")
    if len(cuts) == 2:
        return GROUPED  # one rank: no collective runs at all
    if setting != "default":
        return setting
    if backend == "gloo":
        return GROUPED
    return PADDED if costs.padded_s(cuts, element_bytes) < costs.grouped_s(cuts) else GROUPED


def choose_forms(bucket_cuts: Sequence[Sequence[int]], **kwargs) -> tuple[str, ...]:
    """:func:`choose_form` for every bucket, in bucket order."""
    return tuple(choose_form(cuts, **kwargs) for cuts in bucket_cuts)


@dataclass(frozen=True)
class FormSummary:
    """How many buckets take each form in one kind of collective, and the padding bytes that costs."""

    padded: int
    grouped: int
    padding_bytes: int  # per step: the padded buckets' padding, once each
    bucket_bytes: int  # per step: every bucket's own bytes, once each
    grouped_s: float  # the cost model's seconds per step with every bucket grouped (launches only)
    padded_s: float  # ... with every bucket padded (launch, staging, padding on the wire)
    operations: int  # per step, under the chosen forms: non-empty segments of a grouped bucket, 1 for a padded one

    @property
    def padding_fraction(self) -> float:
        return self.padding_bytes / self.bucket_bytes if self.bucket_bytes else 0.0


def summarize_forms(bucket_cuts: Sequence[Sequence[int]], forms: Sequence[str], element_bytes: int,
                    costs: CollectiveCosts = CollectiveCosts()) -> FormSummary:
    if len(forms) != len(bucket_cuts):
        raise ValueError(f"{len(forms)} forms for {len(bucket_cuts)} buckets")
    padding = sum(padding_numel(cuts) for cuts, form in zip(bucket_cuts, forms) if form == PADDED)
    real = [cuts for cuts in bucket_cuts if len(cuts) > 2]  # one rank: no collective to price
    return FormSummary(padded=sum(form == PADDED for form in forms), grouped=sum(form == GROUPED for form in forms),
                       padding_bytes=padding * element_bytes,
                       bucket_bytes=sum(cuts[-1] - cuts[0] for cuts in bucket_cuts) * element_bytes,
                       grouped_s=sum(costs.grouped_s(cuts) for cuts in real),
                       padded_s=sum(costs.padded_s(cuts, element_bytes) for cuts in real),
                       operations=sum(1 if form == PADDED else nonempty_segments(cuts)
                                      for cuts, form in zip(bucket_cuts, forms) if len(cuts) > 2))


@dataclass(frozen=True)
class BucketForms:
    """Per bucket, the form of its reduce-scatter (communication dtype) and of its all-gather (parameter dtype)."""

    reduce_scatter: tuple[str, ...]
    all_gather: tuple[str, ...]
    setting: str
    backend: str
    reduce_scatter_summary: FormSummary
    all_gather_summary: FormSummary


def bucket_forms(bucket_cuts: Sequence[Sequence[int]], *, reduce_scatter_bytes: int, all_gather_bytes: int,
                 backend: str, setting: str = "default", costs: CollectiveCosts = CollectiveCosts()) -> BucketForms:
    """Both collectives' forms for every bucket, with what they cost in padding (``*_bytes``: element sizes)."""
    reduce_scatter = choose_forms(bucket_cuts, element_bytes=reduce_scatter_bytes, backend=backend, setting=setting,
                                  costs=costs)
    all_gather = choose_forms(bucket_cuts, element_bytes=all_gather_bytes, backend=backend, setting=setting,
                              costs=costs)
    return BucketForms(reduce_scatter=reduce_scatter, all_gather=all_gather, setting=setting, backend=backend,
                       reduce_scatter_summary=summarize_forms(bucket_cuts, reduce_scatter, reduce_scatter_bytes, costs),
                       all_gather_summary=summarize_forms(bucket_cuts, all_gather, all_gather_bytes, costs))
