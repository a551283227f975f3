"""Where each plan item lies in one rank's flat buffers.

The plan (``ds_canzona.plan.DPPlan``) places items by their planned sizes. Without tensor
parallelism those are the sizes a rank holds, and the layout is the plan's own offsets and cuts.
Under AutoTP the plan is made from logical (unsharded) sizes, so that every TP rank of a matrix
agrees on its data-parallel owner, while a rank's buffers hold its local slices: the same items
in the same buckets and order, each as long as this rank's slice of it. Cuts fall on item
boundaries, so they translate item by item.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ds_canzona.plan import DPPlan

__all__ = ["BufferLayout"]


@dataclass(frozen=True)
class BufferLayout:
    """Per item: its offset in its bucket's local buffer, its local length, its range in its tensor.

    ``piece_range[i]`` is item i's ``[start, stop)`` inside its tensor's local (flattened) elements;
    ``bucket_cuts[b][r]`` is where rank r's segment of bucket b starts in the local buffer.
    """

    item_offset: tuple[int, ...]
    item_numel: tuple[int, ...]
    piece_range: tuple[tuple[int, int], ...]
    bucket_numel: tuple[int, ...]
    bucket_cuts: tuple[tuple[int, ...], ...]

    @classmethod
    def of_plan(cls, plan: DPPlan) -> BufferLayout:
        return cls(item_offset=tuple(plan.offset), item_numel=tuple(spec.numel for spec in plan.specs),
                   piece_range=tuple((start, stop) for _, start, stop in plan.pieces),
                   bucket_numel=tuple(bucket.numel for bucket in plan.buckets),
                   bucket_cuts=tuple(tuple(bucket.cuts) for bucket in plan.buckets))

    @classmethod
    def local(cls, plan: DPPlan, held_before: Callable[[int, int], int]) -> BufferLayout:
        """The layout of local slices: ``held_before(tensor, k)`` counts the tensor's local elements
        whose logical flat index is below k (a rank's slice, read in row-major order, is an increasing
        subsequence of the logical tensor's elements, so a logical piece is a contiguous local range)."""
        piece_range = tuple((held_before(tensor, start), held_before(tensor, stop)) for tensor, start, stop in plan.pieces)
        item_numel = tuple(stop - start for start, stop in piece_range)
        item_offset = [0] * len(plan.specs)
        bucket_numel, bucket_cuts = [], []
        in_bucket: list[list[int]] = [[] for _ in plan.buckets]
        for i, b in enumerate(plan.bucket_of):
            in_bucket[b].append(i)
        for bucket in plan.buckets:
            items = in_bucket[bucket.index]
            local_at = {0: 0}  # logical offset of an item boundary -> local offset
            position = 0
            for i in sorted(items, key=lambda i: plan.offset[i]):
                item_offset[i] = position
                position += item_numel[i]
                local_at[plan.offset[i] + plan.specs[i].numel] = position
            bucket_numel.append(position)
            bucket_cuts.append(tuple(local_at[cut] for cut in bucket.cuts))
        return cls(item_offset=tuple(item_offset), item_numel=item_numel, piece_range=piece_range,
                   bucket_numel=tuple(bucket_numel), bucket_cuts=tuple(bucket_cuts))
