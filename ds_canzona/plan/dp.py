"""Data-parallel ownership: which rank updates each tensor, as cut points inside each bucket.

The flat buffer is split into buckets of consecutive tensors (:func:`plan_buckets`). Inside a
bucket, rank r's segment is ``[cuts[r], cuts[r+1])``: segments are contiguous and in rank order,
every cut falls on a tensor boundary (empty segments are allowed), and a tensor belongs to the
segment holding its start index. Equivalently, inside one bucket the owner is a non-decreasing
function of the buffer position, and any such function is a valid plan. Tensors never move.

Three strategies, one function each:

- :func:`uniform`: DeepSpeed's equal cuts. They split tensors, so a straddling matrix is charged
  to every rank it touches (DeepSpeed's Muon all-reduces it and orthogonalises it on each of them).
- :func:`start_index`: the same equal cuts, each tensor owned by the rank holding its start index.
- :func:`alpha_balanced`: cuts chosen to balance the cost across ranks, subject to an element
  cap per segment that ``alpha`` sets (see that function for the exact blend).

Pieces. An optimizer item is a whole tensor, or, with ``split_numel``, a piece of a non-matrix
tensor: AdamW is elementwise, so nothing needs it whole, and a huge embedding owned whole would
bound the busiest rank by itself. A non-matrix tensor of more than ``split_numel`` elements is
planned as consecutive pieces of ``split_numel`` elements (the last one shorter): canonical, a
function of the tensor alone, so per-piece gradient norms are the same numbers at every world
size. Buckets are formed from whole tensors first (a tensor stays in one bucket); the strategies
then see the pieces as the items. Matrices are never cut.

``alpha_balanced`` goes beyond the paper's per-bucket greedy (Algorithm 1), which decides one
bucket at a time and, at DP=128 on Qwen3 1.7B-32B, leaves the busiest rank up to 55% above the
LPT reference (which ignores the buffer entirely); it packs all buckets together (see
``_packing``) and lands within about 1% of LPT. See docs/PLANNER.md for the measurements.

Memory. Each item also pins bytes on its owner (``memory``: fp32 master, optimizer state, gradient
segment; ``ds_canzona.plan.memory``). ``alpha_balanced`` minimises the busiest rank's cost first,
then its bytes (``_memory_fit``); ``max_state_bytes_per_rank`` makes the bytes a hard cap.
"""

from __future__ import annotations

import bisect
import hashlib
import heapq
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ._memory_fit import MemoryCapUnreachable, fit
from ._packing import Problem, balance, min_max_segment, segment_caps
from .cost import CostModel, FlopsCost, NumelCost, RooflineCost, cost_model
from .memory import MemoryModel, StateMemory
from .specs import ParamSpec, PlanError

__all__ = [
    "DEFAULT_SPLIT_NUMEL",
    "STRATEGIES",
    "BucketPlan",
    "DPPlan",
    "MemoryCapError",
    "alpha_balanced",
    "lpt_loads",
    "min_max_segment",
    "expand_pieces",
    "item_bounds",
    "piece_bounds",
    "stack_piece_bounds",
    "plan_buckets",
    "plan_dp_partitions",
    "start_index",
    "uniform",
]

STRATEGIES = ("alpha_balanced", "start_index", "uniform")

# The runtime's piece size for non-matrix tensors (16 MiB of fp32): large enough that a piece's
# AdamW update runs at full bandwidth, small enough that a big embedding spreads over many ranks.
DEFAULT_SPLIT_NUMEL = 2**22


class MemoryCapError(PlanError):
    """No plan keeps every rank's state under ``max_state_bytes_per_rank``.

    ``smallest`` is the busiest-rank memory of the best plan found with no limit on step time;
    ``bound`` the lower bound no plan can beat, set by ``tensor`` (one item alone) or, when
    ``tensor`` is None, by the average over the ranks.
    """

    def __init__(self, *, cap: int, smallest: float, bound: float, tensor: str | None, world_size: int) -> None:
        self.cap, self.smallest, self.bound, self.tensor = cap, smallest, bound, tensor
        reason = (f"{tensor!r} alone needs {math.ceil(bound):,} bytes" if tensor is not None
                  else f"the average over {world_size} ranks is {math.ceil(bound):,} bytes")
        super().__init__(
            f"max_state_bytes_per_rank={cap:,} cannot be met: the smallest busiest-rank state the planner "
            f"reaches is {math.ceil(smallest):,} bytes ({reason}). Raise the cap to at least "
            f"{math.ceil(smallest):,}, or use more ranks."
        )


@dataclass(frozen=True, kw_only=True)
class BucketPlan:
    """One bucket: params ``[first, stop)`` of the buffer, and the ``world_size + 1`` cut points."""

    index: int
    first: int
    stop: int
    numel: int
    cuts: tuple[int, ...]

    def segment(self, rank: int) -> tuple[int, int]:
        """``[start, stop)`` element range of ``rank``'s segment inside this bucket."""
        return self.cuts[rank], self.cuts[rank + 1]

    def max_segment(self) -> int:
        return max(self.cuts[r + 1] - self.cuts[r] for r in range(len(self.cuts) - 1))


@dataclass(frozen=True, kw_only=True)
class DPPlan:
    """A DP partition plan: a plain value, the same on every rank, with a stable :meth:`digest`.

    ``specs``, ``costs``, ``owner``, ``bucket_of`` and ``offset`` are per item (a whole tensor, or a
    piece of one when ``split_numel`` is set), in buffer order; ``offset`` is the item's start index
    inside its bucket, and ``pieces[i]`` is item i's ``(tensor index, first element, stop element)``
    in the planner's input ``specs`` (``(i, 0, numel)`` for every item of an unsplit plan). Under ``uniform`` the owner is the rank holding the
    start index (to stay well defined), but :meth:`rank_costs` charges a straddling tensor to
    every rank it touches, since that is what runs.

    Ratios are the busiest rank over the ideal average (the total over ``world_size``); for
    strategies that own tensors whole this is the usual max/mean.
    """

    world_size: int
    strategy: str
    alpha: float
    cost_model: str
    cost_label: str
    bucket_numel: int
    specs: tuple[ParamSpec, ...]
    costs: tuple[float, ...]
    buckets: tuple[BucketPlan, ...]
    owner: tuple[int, ...]
    bucket_of: tuple[int, ...]
    offset: tuple[int, ...]
    pieces: tuple[tuple[int, int, int], ...] = ()
    split_numel: int | None = None
    memory: tuple[float, ...] = ()
    memory_label: str = ""
    max_state_bytes_per_rank: int | None = None
    _cached: dict[str, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    def rank_costs(self, cost: CostModel | None = None) -> list[float]:
        """Per-rank cost, under the plan's own cost model or under ``cost`` (to compare models)."""
        costs = self.costs if cost is None else [cost.cost(spec) for spec in self.specs]
        loads = [0.0] * self.world_size
        if self.strategy != "uniform":
            for index, rank in enumerate(self.owner):
                loads[rank] += costs[index]
            return loads
        for index in range(len(self.specs)):
            for rank in self.touched_ranks(index):
                loads[rank] += costs[index]
        return loads

    def touched_ranks(self, index: int) -> range | list[int]:
        """Ranks whose segment overlaps param ``index`` (one rank unless the cuts split it)."""
        cuts = self.buckets[self.bucket_of[index]].cuts
        start = self.offset[index]
        stop = start + self.specs[index].numel
        first = self.owner[index]
        last = bisect.bisect_right(cuts, stop - 1) - 1
        if first == last:
            return [first]
        return [rank for rank in range(first, last + 1) if cuts[rank] < cuts[rank + 1]]

    def rank_numels(self) -> list[int]:
        """Elements of each rank's segments (its optimizer state and its share of the collectives)."""
        numels = [0] * self.world_size
        for bucket in self.buckets:
            cuts = bucket.cuts
            for rank in range(self.world_size):
                numels[rank] += cuts[rank + 1] - cuts[rank]
        return numels

    def rank_memory(self) -> list[float]:
        """Bytes each rank keeps for the items it owns, under the plan's memory model (``memory``)."""
        loads = [0.0] * self.world_size
        for index, rank in enumerate(self.owner):
            loads[rank] += self.memory[index]
        return loads

    def rank_tensors(self) -> list[int]:
        counts = [0] * self.world_size
        for rank in self.owner:
            counts[rank] += 1
        return counts

    def owned_params(self, rank: int) -> list[int]:
        """Indices (buffer order) of the items whose optimizer state lives on ``rank``."""
        if not 0 <= rank < self.world_size:
            raise PlanError(f"Invalid rank={rank}: must be in [0, {self.world_size}).")
        return [index for index, owner in enumerate(self.owner) if owner == rank]

    @property
    def flops_ratio(self) -> float:
        """Busiest rank's cost over the ideal average, in the plan's cost model (named for the FLOPs one)."""
        return _ratio(self.rank_costs(), sum(self.costs), self.world_size)

    @property
    def memory_ratio(self) -> float:
        """Largest rank's elements over the average."""
        return _ratio(self.rank_numels(), sum(spec.numel for spec in self.specs), self.world_size)

    @property
    def state_bytes_ratio(self) -> float:
        """Largest rank's state bytes (memory model) over the average."""
        return _ratio(self.rank_memory(), sum(self.memory), self.world_size)

    @property
    def comm_ratio(self) -> float:
        """Uneven collectives over even ones: sum over buckets of the largest segment, over |B|/R.

        An uneven reduce-scatter or all-gather finishes with its largest segment (and gloo pads every
        segment to it), so this is the collective time relative to DeepSpeed's equal cuts.
        """
        padded = sum(bucket.max_segment() for bucket in self.buckets)
        even = sum(bucket.numel for bucket in self.buckets) / self.world_size
        return padded / even

    def to_dict(self) -> dict[str, Any]:
        """The ``ds-canzona plan --json`` schema."""
        numels = self.rank_numels()
        costs = self.rank_costs()
        tensors = self.rank_tensors()
        state = self.rank_memory()
        return {
            "world_size": self.world_size,
            "strategy": self.strategy,
            "alpha": self.alpha,
            "cost_model": self.cost_model,
            "cost_label": self.cost_label,
            "bucket_numel": self.bucket_numel,
            "split_numel": self.split_numel,
            "memory_model": self.memory_label,
            "max_state_bytes_per_rank": self.max_state_bytes_per_rank,
            "buckets": [{"numel": bucket.numel, "cuts": list(bucket.cuts)} for bucket in self.buckets],
            "params": [
                {**spec.to_dict(), "bucket": self.bucket_of[i], "offset": self.offset[i], "owner": self.owner[i]}
                for i, spec in enumerate(self.specs)
            ],
            "ranks": [{"cost": costs[r], "numel": numels[r], "state_bytes": state[r], "tensors": tensors[r]}
                      for r in range(self.world_size)],
            "flops_ratio": self.flops_ratio,
            "memory_ratio": self.memory_ratio,
            "state_bytes_ratio": self.state_bytes_ratio,
            "comm_ratio": self.comm_ratio,
        }

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def digest(self) -> str:
        """sha256 of the plan's defining content, as canonical JSON.

        Only ints, strings, bools and ``alpha`` (whose JSON form is its shortest repr) go in, so the
        digest is the same in every process whatever its hash seed; the runtime compares it across
        ranks before the first collective.
        """
        if "digest" not in self._cached:
            content = {
                "world_size": self.world_size,
                "strategy": self.strategy,
                "alpha": self.alpha,
                "cost_label": self.cost_label,
                "bucket_numel": self.bucket_numel,
                "params": [[s.name, list(s.shape), s.matrix, s.tp_dim, s.tp_size] for s in self.specs],
                "buckets": [[b.first, b.stop, list(b.cuts)] for b in self.buckets],
                "owner": list(self.owner),
            }
            if self.split_numel is not None:  # absent otherwise, so unsplit digests stay as they were
                content["split_numel"] = self.split_numel
                content["pieces"] = [list(piece) for piece in self.pieces]
            canonical = json.dumps(content, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
            self._cached["digest"] = hashlib.sha256(canonical.encode("ascii")).hexdigest()
        return self._cached["digest"]


def piece_bounds(numel: int, split_numel: int | None) -> list[tuple[int, int]]:
    """The canonical ``[start, stop)`` pieces of a non-matrix tensor of ``numel`` elements."""
    if split_numel is None or numel <= split_numel:
        return [(0, numel)]
    return [(start, min(start + split_numel, numel)) for start in range(0, numel, split_numel)]


def stack_piece_bounds(shape: Sequence[int], split_numel: int | None) -> list[tuple[int, int]]:
    """The canonical ``[start, stop)`` element pieces of a 3-D matrix stack ``[experts, rows, cols]``.

    Each piece is whole experts: as many as fit in ``split_numel`` elements, at least one. Every
    matrix rule updates each matrix of a stack on its own (``ds_canzona.optim.base.matrix_stack_shape``),
    so a piece is updated exactly as its experts are inside the whole stack, and a fused MoE stack
    of a few hundred million elements spreads over ranks at expert boundaries instead of pinning
    one owner (docs/PLANNER.md, "Expert stacks in pieces").
    """
    experts, rows, cols = (int(s) for s in shape)
    numel = experts * rows * cols
    if split_numel is None or numel <= split_numel or experts == 1:
        return [(0, numel)]
    per_piece = max(1, split_numel // (rows * cols)) * rows * cols
    return [(start, min(start + per_piece, numel)) for start in range(0, numel, per_piece)]


def item_bounds(shape: Sequence[int], matrix: bool, split_numel: int | None) -> list[tuple[int, int]]:
    """The canonical ``[start, stop)`` element ranges of a tensor's plan items (one range: the tensor whole).

    A function of the tensor alone (its shape, whether a matrix rule updates it, ``split_numel``),
    so every world size and both ZeRO planners cut a tensor alike, and the single-process
    clipping norm sums over the same items: a non-matrix tensor above ``split_numel`` in
    ``piece_bounds``, a 3-D matrix stack above it in ``stack_piece_bounds``, anything else whole.
    """
    numel = math.prod(int(s) for s in shape)
    if not matrix:
        return piece_bounds(numel, split_numel)
    if len(shape) == 3:
        return stack_piece_bounds(shape, split_numel)
    return [(0, numel)]


# The project's own models price a spec by its shape, kind and TP layout alone, never its name.
_SHAPE_PRICED = (NumelCost, FlopsCost, RooflineCost, StateMemory)


def _priced(model: object, price: Callable[[ParamSpec], float], specs: Sequence[ParamSpec]) -> list[float]:
    """``price(spec)`` for every spec, as floats; computed once per shape for the project's own models.

    A deep model repeats a few shapes thousands of times. A model of the user's own may read
    anything, the name included, so it is asked about every spec.
    """
    if type(model) not in _SHAPE_PRICED:
        return [float(price(spec)) for spec in specs]
    seen: dict[tuple[Any, ...], float] = {}
    values = []
    for spec in specs:
        key = (spec.shape, spec.matrix, spec.tp_dim, spec.tp_size, spec.heads)
        value = seen.get(key)
        if value is None:
            value = seen[key] = float(price(spec))
        values.append(value)
    return values


def expand_pieces(specs: Sequence[ParamSpec], split_numel: int | None, *,
                  held_numels: Sequence[int] | None = None, split_stacks: bool = True,
                  ) -> tuple[tuple[ParamSpec, ...], tuple[tuple[int, int, int], ...]]:
    """The plan items of ``specs`` (a piece spec for each canonical piece) and their ``(tensor, start, stop)``.

    Each tensor becomes its ``item_bounds``: a non-matrix piece is a 1-D spec, a piece of a 3-D
    matrix stack a stack spec of its experts. A stack a rank's buffer does not hold whole
    (``held_numels`` below its numel: a tensor-parallel slice, whose experts are not contiguous
    in the buffer) stays one item, as does every stack with ``split_stacks=False`` (the plan before
    stacks were cut, which ``bench stack-pieces`` compares with). Shared by the ZeRO-1/2 and the
    ZeRO-3 planners, so both own the same items.
    """
    items: list[ParamSpec] = []
    pieces: list[tuple[int, int, int]] = []
    for index, spec in enumerate(specs):
        held_whole = held_numels is None or held_numels[index] == spec.numel
        if spec.matrix and not (held_whole and split_stacks):
            bounds = [(0, spec.numel)]
        else:
            bounds = item_bounds(spec.shape, spec.matrix, split_numel)
        if len(bounds) == 1:
            items.append(spec)
        elif spec.matrix:
            per_expert = spec.shape[1] * spec.shape[2]
            items.extend(ParamSpec(name=f"{spec.name}[{start}:{stop}]",
                                   shape=((stop - start) // per_expert, *spec.shape[1:]), matrix=True)
                         for start, stop in bounds)
        else:
            items.extend(ParamSpec(name=f"{spec.name}[{start}:{stop}]", shape=(stop - start,), matrix=False)
                         for start, stop in bounds)
        pieces.extend((index, start, stop) for start, stop in bounds)
    return tuple(items), tuple(pieces)


def _expand_pieces(
    specs: Sequence[ParamSpec], ranges: Sequence[tuple[int, int]], split_numel: int | None,
    held_numels: Sequence[int] | None = None, split_stacks: bool = True,
) -> tuple[tuple[ParamSpec, ...], tuple[tuple[int, int, int], ...], list[tuple[int, int]]]:
    """Items (piece specs), their ``(tensor, start, stop)``, and the bucket ranges over items."""
    if split_numel is None:
        return tuple(specs), tuple((index, 0, spec.numel) for index, spec in enumerate(specs)), list(ranges)
    items, pieces = expand_pieces(specs, split_numel, held_numels=held_numels, split_stacks=split_stacks)
    first_item = [0] * (len(specs) + 1)
    for item, (tensor, start, _) in enumerate(pieces):
        if start == 0:
            first_item[tensor] = item
    first_item[len(specs)] = len(items)
    return items, pieces, [(first_item[first], first_item[stop]) for first, stop in ranges]


def plan_buckets(specs: Sequence[ParamSpec], bucket_numel: int, *, split_numel: int | None = None,
                 held_numels: Sequence[int] | None = None) -> list[tuple[int, int]]:
    """Consecutive params, in buffer order, grouped into ``(first, stop)`` buckets.

    A bucket closes when the next param would take it past ``bucket_numel`` elements; a param
    larger than that gets a bucket of its own. The elements counted are ``held_numels[i]`` for
    param i where given (what a rank's buffer holds of it: under tensor parallelism its slice,
    while the spec keeps the whole tensor's shape for pricing), else the spec's own numel.
    Whether a tensor is planned in pieces stays a question of its spec (pieces are canonical
    pieces of the whole tensor). With ``split_numel``, every tensor planned in
    pieces (a non-matrix tensor above ``split_numel`` elements: an embedding, a head) is then
    split off its bucket into a bucket of its own, so its pieces form a chain that may spread
    over any ranks. Sharing a bucket with the first (or last) layers, they could only go to the
    ranks up to (from) the owner of that bucket's first (last) matrix, and those few ranks would
    hold most of the model's AdamW state. The other boundaries stay where they were, so every
    plan on the buckets without ``split_numel`` is a plan on these.
    """
    _check_positive_int("bucket_numel", bucket_numel)
    held = _held_numels(specs, held_numels)
    buckets = []
    first, filled = 0, 0
    for index, numel in enumerate(held):
        if filled and filled + numel > bucket_numel:
            buckets.append((first, index))
            first, filled = index, 0
        filled += numel
    if specs:
        buckets.append((first, len(specs)))
    if split_numel is None:
        return buckets
    split: list[tuple[int, int]] = []
    for first, stop in buckets:
        start = first
        for index in range(first, stop):
            spec = specs[index]
            if not spec.matrix and spec.numel > split_numel:
                if start < index:
                    split.append((start, index))
                split.append((index, index + 1))
                start = index + 1
        if start < stop:
            split.append((start, stop))
    return split


def plan_dp_partitions(
    specs: Sequence[ParamSpec],
    *,
    world_size: int,
    bucket_numel: int,
    alpha: float = 1.0,
    strategy: str = "alpha_balanced",
    cost: CostModel | None = None,
    split_numel: int | None = None,
    memory: MemoryModel | None = None,
    max_state_bytes_per_rank: int | None = None,
    held_numels: Sequence[int] | None = None,
    split_stacks: bool = True,
) -> DPPlan:
    """Plan DP ownership of ``specs`` (in buffer order) over ``world_size`` ranks.

    A pure function of its arguments: every rank computes the same plan. ``cost`` defaults to the
    runtime's model: Muon roofline with the GPU machine balance (``cost_model("roofline")``).
    ``split_numel`` (default: none) plans non-matrix tensors above that size in pieces.
    ``memory`` (default: Muon state of a bf16 model, ``StateMemory()``) prices the bytes each item
    pins on its owner; ``alpha_balanced`` minimises the busiest rank's memory once the busiest
    cost is as low as it gets. ``max_state_bytes_per_rank`` is a hard cap on that memory, bought
    with step time if needed; :class:`MemoryCapError` if no plan meets it.

    ``held_numels`` (default: each spec's numel): per spec, the elements a rank's bucket buffers
    hold of it, on which buckets close (``plan_buckets``). The tensor-parallel runtime plans
    logical (whole-matrix) specs, so that costs price the whole matrix its host updates and every
    TP rank agrees on the plan, and passes each tensor's largest TP slice here, so that a bucket
    holds at most ``bucket_numel`` elements of what a rank actually reduces (or one larger tensor
    alone). Costs, memory, cuts and offsets stay in the specs' elements.

    ``split_stacks`` (default True): with ``split_numel``, 3-D matrix stacks above it are planned
    in pieces of whole experts (``stack_piece_bounds``); False keeps them whole, the plan before
    they were cut (the runtime always cuts; benchmarks compare the two).
    """
    specs = tuple(specs)
    if not specs:
        raise PlanError("Cannot plan an empty list of params.")
    for spec in specs:
        if not isinstance(spec, ParamSpec):
            raise PlanError(f"Invalid spec {spec!r}: expected a ParamSpec.")
    _check_positive_int("world_size", world_size)
    _check_positive_int("bucket_numel", bucket_numel)
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not 0.0 <= alpha <= 1.0:
        raise PlanError(f"Invalid alpha={alpha!r}: must be within [0, 1].")
    if strategy not in STRATEGIES:
        raise PlanError(f"Invalid strategy={strategy!r}: must be one of {', '.join(STRATEGIES)}.")
    if split_numel is not None:
        _check_positive_int("split_numel", split_numel)
    if max_state_bytes_per_rank is not None:
        _check_positive_int("max_state_bytes_per_rank", max_state_bytes_per_rank)
    model = cost if cost is not None else cost_model("roofline", "muon")
    memory_model = memory if memory is not None else StateMemory()
    held = _held_numels(specs, held_numels)
    tensor_ranges = plan_buckets(specs, bucket_numel, split_numel=split_numel, held_numels=held)
    # The buckets before tensors in pieces had buckets of their own: every plan on them is a plan
    # on the finer buckets, and the cost-only plan on them is the step time never to exceed.
    joint_ranges = tensor_ranges if split_numel is None else plan_buckets(specs, bucket_numel, held_numels=held)
    joint = (_expand_pieces(specs, joint_ranges, split_numel, held, split_stacks)[2]
             if joint_ranges != tensor_ranges else None)
    specs, pieces, ranges = _expand_pieces(specs, tensor_ranges, split_numel, held, split_stacks)
    costs = tuple(_priced(model, model.cost, specs))
    for spec, value in zip(specs, costs):
        if not (value >= 0.0 and math.isfinite(value)):
            raise PlanError(
                f"Cost model {model.label} gave {value!r} for {spec.name!r}: costs must be finite and >= 0."
            )
    item_bytes = tuple(_priced(memory_model, memory_model.bytes, specs))

    numels = [spec.numel for spec in specs]
    if strategy == "uniform":
        owner, cuts = uniform(numels, ranges, world_size)
    elif strategy == "start_index":
        owner, cuts = start_index(numels, ranges, world_size)
    else:
        try:
            # Buckets holding one tensor's pieces alone: the memory search re-partitions them by counts.
            in_pieces = [(first, stop) for first, stop in ranges
                         if stop - first > 1 and pieces[first][0] == pieces[stop - 1][0]]
            owner, cuts = alpha_balanced(numels, list(costs), ranges, world_size, alpha=float(alpha),
                                         memory=item_bytes, sand=[not spec.matrix for spec in specs],
                                         memory_cap=max_state_bytes_per_rank,
                                         joint_buckets=joint, piece_buckets=in_pieces)
        except MemoryCapUnreachable as unreachable:
            assert max_state_bytes_per_rank is not None
            raise _cap_error(specs, item_bytes, world_size, max_state_bytes_per_rank,
                             unreachable.peak_memory) from None
    if strategy != "alpha_balanced" and max_state_bytes_per_rank is not None:
        peak = max(_rank_sums(owner, item_bytes, world_size))
        if peak > max_state_bytes_per_rank:
            raise _cap_error(specs, item_bytes, world_size, max_state_bytes_per_rank, peak)

    bucket_of: list[int] = []
    offset: list[int] = []
    buckets = []
    for index, (first, stop) in enumerate(ranges):
        position = 0
        for param in range(first, stop):
            bucket_of.append(index)
            offset.append(position)
            position += numels[param]
        buckets.append(BucketPlan(index=index, first=first, stop=stop, numel=position, cuts=tuple(cuts[index])))
    return DPPlan(
        world_size=world_size,
        strategy=strategy,
        alpha=float(alpha),
        cost_model=model.name,
        cost_label=model.label,
        bucket_numel=bucket_numel,
        specs=specs,
        costs=costs,
        buckets=tuple(buckets),
        owner=tuple(owner),
        bucket_of=tuple(bucket_of),
        offset=tuple(offset),
        pieces=pieces,
        split_numel=split_numel,
        memory=item_bytes,
        memory_label=memory_model.label,
        max_state_bytes_per_rank=max_state_bytes_per_rank,
    )


# --------------------------------------------------------------------------------------------
# Strategies. Each takes per-param numels (and costs), the bucket ranges and the world size, and
# returns (owner per param, cuts per bucket).
# --------------------------------------------------------------------------------------------


def uniform(
    numels: Sequence[int], buckets: Sequence[tuple[int, int]], world_size: int
) -> tuple[list[int], list[list[int]]]:
    """Equal cuts ``floor(r·|B|/R)``, blind to tensor boundaries; owner = rank of the start index."""
    owner: list[int] = []
    all_cuts = []
    for first, stop in buckets:
        total = sum(numels[first:stop])
        cuts = [rank * total // world_size for rank in range(world_size + 1)]
        position = 0
        for param in range(first, stop):
            owner.append(bisect.bisect_right(cuts, position) - 1)
            position += numels[param]
        all_cuts.append(cuts)
    return owner, all_cuts


def start_index(
    numels: Sequence[int], buckets: Sequence[tuple[int, int]], world_size: int
) -> tuple[list[int], list[list[int]]]:
    """Equal cuts, each tensor owned by the rank whose equal segment holds its start index.

    The realised cuts move each equal cut forward to the next tensor start, so no tensor is split.
    """
    owner, _ = uniform(numels, buckets, world_size)
    return owner, [_cuts_from_owners(numels, owner, first, stop, world_size) for first, stop in buckets]


def alpha_balanced(
    numels: Sequence[int],
    costs: Sequence[float],
    buckets: Sequence[tuple[int, int]],
    world_size: int,
    *,
    alpha: float = 1.0,
    memory: Sequence[float] | None = None,
    sand: Sequence[bool] | None = None,
    memory_cap: float | None = None,
    joint_buckets: Sequence[tuple[int, int]] | None = None,
    piece_buckets: Sequence[tuple[int, int]] = (),
) -> tuple[list[int], list[list[int]]]:
    """Balance the cost over ranks, then the memory; ``alpha`` trades element evenness for compute balance.

    The blend. The paper blends two per-bucket targets, v* = (1 - alpha)·v_even + alpha·v_fill.
    Here the same two ends are kept and the blend is made exact as a cap. For each bucket b, let
    E_b be the smallest possible largest segment (in elements) that cuts on tensor boundaries
    allow, and |B_b| the bucket's size. Every segment of b may hold at most

        cap_b(alpha) = E_b + alpha·(|B_b| - E_b)   elements,

    and within those caps the busiest rank's cost is minimised. At alpha = 0 every bucket gets
    one of its most even element splits (largest segment = E_b, which is what an uneven
    reduce-scatter's time follows), and cost decides only among those; at alpha = 1 there is no
    element constraint and only cost counts; in between, the largest segment grows at most
    linearly in alpha. The communication price of a plan is reported as ``DPPlan.comm_ratio``.

    The packing looks at all buckets at once rather than one at a time: what the geometry fixes
    is only the order of ranks inside a bucket, not which ranks a bucket uses. Three packers
    (first-fit chains and a rank-by-rank frontier, both against one capacity shared by every
    rank and found by bisection; and a frontier that realises the cost mixes unconstrained LPT
    would give each rank) each feed a local search of moves and swaps, and the best result wins.
    See ``ds_canzona.plan._packing`` for the details. Ties break on the busiest load, then the
    owner list, so the plan is a deterministic function of the input.

    Memory. With ``memory`` (bytes per item) and ``sand`` (which items are non-matrix), the busiest
    rank's memory is minimised second, at the makespan found (and a hard ``memory_cap`` is bought
    with makespan if needed): see ``ds_canzona.plan._memory_fit``. Without ``memory``, cost alone
    decides, as before memory was a criterion.

    ``joint_buckets``: a coarser bucketing of the same items (each of ``buckets`` inside one of
    them), the layout before tensors in pieces got buckets of their own. Its cost-only plan is
    also a plan here; with memory it is the makespan the result never exceeds (the planner's step
    time before either change), and a candidate.

    ``piece_buckets``: the buckets that hold one tensor's pieces alone; the memory search moves
    their pieces by counts (``ds_canzona.plan._free_chains``).
    """
    owner = balance(numels, costs, buckets, world_size, alpha)
    if memory is not None:
        problem = Problem(numels, costs, buckets, world_size, segment_caps(numels, buckets, world_size, alpha))
        reference = None
        if joint_buckets is not None and not problem.capped:
            reference = balance(numels, costs, joint_buckets, world_size, alpha)
        owner = fit(problem, memory, sand if sand is not None else [False] * len(numels), owner,
                    memory_cap=memory_cap, reference_owner=reference, chains=piece_buckets).owner
    return owner, [_cuts_from_owners(numels, owner, first, stop, world_size) for first, stop in buckets]


def lpt_loads(costs: Sequence[float], world_size: int) -> list[float]:
    """Per-rank loads of unconstrained LPT (largest first onto the least-loaded rank).

    The reference the planner is measured against: it ignores buffer order and buckets entirely.
    """
    heap = [(0.0, rank) for rank in range(world_size)]
    loads = [0.0] * world_size
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, rank = heapq.heappop(heap)
        loads[rank] = load + costs[index]
        heapq.heappush(heap, (loads[rank], rank))
    return loads


# --------------------------------------------------------------------------------------------
# Helpers.
# --------------------------------------------------------------------------------------------


def _cuts_from_owners(numels: Sequence[int], owner: Sequence[int], first: int, stop: int, world: int) -> list[int]:
    """Cut points realising a monotone owner map: cuts[r] = start of the first param owned >= r."""
    total = sum(numels[first:stop])
    cuts = [total] * (world + 1)
    cuts[0] = 0
    assigned, position = 0, 0
    for param in range(first, stop):
        rank = owner[param]
        assert rank >= assigned, "owners must be non-decreasing inside a bucket"
        for cut in range(assigned + 1, rank + 1):
            cuts[cut] = position
        assigned = max(assigned, rank)
        position += numels[param]
    return cuts


def _rank_sums(owner: Sequence[int], values: Sequence[float], world: int) -> list[float]:
    sums = [0.0] * world
    for index, rank in enumerate(owner):
        sums[rank] += values[index]
    return sums


def _cap_error(specs: Sequence[ParamSpec], item_bytes: Sequence[float], world: int, cap: int,
               smallest: float) -> MemoryCapError:
    """The cap error, naming what bounds memory from below: the largest item, or the average."""
    largest = max(range(len(specs)), key=lambda i: (item_bytes[i], -i))
    average = sum(item_bytes) / world
    if item_bytes[largest] >= average:
        return MemoryCapError(cap=cap, smallest=smallest, bound=item_bytes[largest], tensor=specs[largest].name,
                              world_size=world)
    return MemoryCapError(cap=cap, smallest=smallest, bound=average, tensor=None, world_size=world)


def _ratio(values: Sequence[float], total: float, world: int) -> float:
    average = total / world
    return max(values) / average if average > 0 else 1.0


def _held_numels(specs: Sequence[ParamSpec], held_numels: Sequence[int] | None) -> list[int]:
    """``held_numels`` checked against ``specs`` (one count >= 0 per spec), or the specs' own numels."""
    if held_numels is None:
        return [spec.numel for spec in specs]
    held = list(held_numels)
    if len(held) != len(specs):
        raise PlanError(f"Invalid held_numels: {len(held)} counts for {len(specs)} specs.")
    for spec, numel in zip(specs, held):
        if isinstance(numel, bool) or not isinstance(numel, int) or not 0 <= numel <= spec.numel:
            raise PlanError(f"Invalid held_numels entry {numel!r} for {spec.name!r}: must be an int in "
                            f"[0, {spec.numel}] (a rank holds at most the whole tensor).")
    return held


def _check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PlanError(f"Invalid {name}={value!r}: must be a positive integer.")
