"""The engine behind ``alpha_balanced``: monotone chains packed against one shared capacity.

The problem. Tensors come in buckets; inside a bucket the owner rank must be non-decreasing in
buffer order (a bucket is a *chain*), and, when ``alpha < 1``, each bucket's segment on a rank may
hold at most ``cap`` elements. Minimise the busiest rank's cost.

Why not bucket by bucket. The paper's Algorithm 1 cuts one bucket at a time against the running
loads. Each bucket then decides alone, and at DP=128 on Qwen3 the busiest rank stays up to 55%
above what unconstrained LPT reaches. What the constraint actually fixes is only the *order* of
ranks inside a bucket; *which* ranks a bucket uses is free. So the packers here look at all
buckets at once:

- first fit (:func:`pack_first_fit`): one capacity C for every rank; each bucket, in turn, is laid
  down as a chain, each tensor on the first rank at or above its predecessor's rank that has room;
- frontier (:func:`pack_frontier`): ranks are filled one after the other, rank r taking the
  costliest *head* (first unplaced tensor) of any bucket that still fits under C; this never
  breaks a chain, because every later placement lands on a later rank;
- recipes (:func:`pack_recipes`): LPT, ignoring the buffer, says which *mix* of costs each rank
  should get (say 3 MLP + 3 attention matrices); the frontier then fills rank after rank with one
  of those recipes, realised by taking chain prefixes whose costs match it. Models repeat the
  same few shapes, so recipes are usually realisable, and the result matches LPT's balance.

The first two are run at the smallest capacity that works (bisection); the recipes run in two
flavours, serving first the chains with the most work left (so that none falls behind) or the
prefixes worth the most. A local search then moves tensors off the busiest rank or swaps them
for lighter ones (:class:`LocalSearch`). The best result wins (:func:`balance`); ties break on
the owner list, so the plan is a deterministic function of the input. On Qwen3 1.7B-32B at
DP 16-128 the busiest rank ends within about 1% of unconstrained LPT (docs/PLANNER.md).
"""

from __future__ import annotations

import bisect
import heapq
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ._loads import LoadTree

# Tensors cheaper than this fraction of the average rank load (norms, biases) do not shape the
# balance; the recipe packer lets them ride along with their chain instead of matching them.
FREE_RIDER_FRACTION = 0.01
# Above this many distinct costs the input is not a repeated architecture, and recipes, which
# match costs exactly, would rarely be realisable; the packer is skipped.
MAX_RECIPE_CLASSES = 64
# Buckets examined per cost class when matching a recipe to chain prefixes.
RECIPE_CANDIDATES = 16
# Above this many (tensor, rank) pairs a problem is "large": the portfolio is trimmed to stay fast.
LARGE_PROBLEM = 1_000_000
# Relative gap at which the capacity bisection stops.
BISECTION_TOLERANCE = 1e-4


@dataclass(frozen=True, kw_only=True)
class BucketCap:
    """A bucket's element cap per segment, with what a chain needs to look ahead.

    ``prefix[j]`` is the bucket's elements before its j-th param; ``runs[j]`` the fewest segments
    params j.. can be packed into under ``cap`` (``runs[len] == 0``).
    """

    cap: float
    prefix: tuple[int, ...]
    runs: tuple[int, ...]

    def ranks_after(self, local: int, room: float) -> int:
        """Ranks params ``local..`` need beyond the current one, which has ``room`` elements left."""
        end = bisect.bisect_right(self.prefix, self.prefix[local] + room) - 1
        return self.runs[max(end, local)]


def min_max_segment(numels: Sequence[int], world: int) -> int:
    """The smallest possible largest segment when ``numels`` are cut into ``world`` runs."""
    if len(numels) <= world:
        return max(numels)
    low, high = max(max(numels), -(-sum(numels) // world)), sum(numels)
    while low < high:
        middle = (low + high) // 2
        if _runs_needed(numels, middle) <= world:
            high = middle
        else:
            low = middle + 1
    return low


def segment_caps(
    numels: Sequence[int], buckets: Sequence[tuple[int, int]], world: int, alpha: float
) -> list[BucketCap | None]:
    """Per bucket, the cap ``E + alpha·(|B| - E)`` (``E`` = :func:`min_max_segment`), or None if it never binds."""
    caps: list[BucketCap | None] = []
    for first, stop in buckets:
        sizes = numels[first:stop]
        total = sum(sizes)
        tightest = min_max_segment(sizes, world)
        cap = tightest + alpha * (total - tightest)
        if cap >= total:
            caps.append(None)
            continue
        prefix = [0]
        for size in sizes:
            prefix.append(prefix[-1] + size)
        runs = [0] * (len(sizes) + 1)
        count, filled = 0, 0
        # Packing greedily from the end gives the fewest segments of every suffix at once.
        for local in range(len(sizes) - 1, -1, -1):
            if count == 0 or filled + sizes[local] > cap:
                count, filled = count + 1, 0
            filled += sizes[local]
            runs[local] = count
        caps.append(BucketCap(cap=cap, prefix=tuple(prefix), runs=tuple(runs)))
    return caps


class Problem:
    """The packing input, with what every packer derives from it once."""

    def __init__(
        self,
        numels: Sequence[int],
        costs: Sequence[float],
        buckets: Sequence[tuple[int, int]],
        world: int,
        caps: Sequence[BucketCap | None],
    ) -> None:
        self.numels = numels
        self.costs = costs
        self.buckets = buckets
        self.world = world
        self.caps = caps
        self.capped = any(cap is not None for cap in caps)
        self.bucket_of = [b for b, (first, stop) in enumerate(buckets) for _ in range(first, stop)]
        # The highest rank a param may open a new segment on and still leave enough ranks, under
        # the cap, for the rest of its bucket.
        self.highest_start = [world - 1] * len(numels)
        for b, (first, stop) in enumerate(buckets):
            cap = caps[b]
            if cap is None:
                continue
            for local in range(stop - first - 1):
                needed = cap.ranks_after(local + 1, cap.cap - numels[first + local])
                self.highest_start[first + local] = world - 1 - needed

    def lower_bound(self) -> float:
        return max(sum(self.costs) / self.world, max(self.costs))

    def deadline(self, param: int) -> int:
        """The rank by which chain head ``param`` must be placed, for the rest of its bucket to fit.

        Uncapped buckets can wait for the last rank; a capped one needs ``runs`` more segments.
        """
        b = self.bucket_of[param]
        cap = self.caps[b]
        if cap is None:
            return self.world - 1
        return self.world - cap.runs[param - self.buckets[b][0]]


@dataclass(kw_only=True)
class Assignment:
    """A complete, valid owner map with its loads (and segment sizes of capped buckets)."""

    owner: list[int]
    loads: LoadTree
    segment: dict[tuple[int, int], int]

    def key(self) -> tuple[float, list[int]]:
        return self.loads.max_load(), self.owner


def _assignment(problem: Problem, owner: list[int]) -> Assignment:
    loads = LoadTree.from_loads(_sum_loads(problem, owner))
    segment: dict[tuple[int, int], int] = {}
    if problem.capped:
        for param, rank in enumerate(owner):
            b = problem.bucket_of[param]
            if problem.caps[b] is not None:
                segment[(b, rank)] = segment.get((b, rank), 0) + problem.numels[param]
    return Assignment(owner=owner, loads=loads, segment=segment)


def _sum_loads(problem: Problem, owner: Sequence[int]) -> list[float]:
    loads = [0.0] * problem.world
    for param, rank in enumerate(owner):
        loads[rank] += problem.costs[param]
    return loads


# --------------------------------------------------------------------------------------------
# Packers.
# --------------------------------------------------------------------------------------------


def pack_first_fit(problem: Problem, capacity: float, order: Sequence[int]) -> Assignment | None:
    """Lay each bucket (in ``order``) down as a first-fit monotone chain under ``capacity``, or None."""
    numels, costs, caps, world = problem.numels, problem.costs, problem.caps, problem.world
    highest_start = problem.highest_start
    tree = LoadTree(world)
    loads = [0.0] * world
    owner = [0] * len(numels)
    for b in order:
        first, stop = problem.buckets[b]
        cap = caps[b]
        current, filled = 0, 0
        for param in range(first, stop):
            cost = costs[param]
            room = capacity - cost
            joins = loads[current] <= room
            if joins and cap is not None:
                left = cap.cap - filled - numels[param]
                joins = left >= 0 and cap.ranks_after(param + 1 - first, left) <= world - 1 - current
            if joins:
                filled += numels[param]
            else:
                rank = tree.first_at_most(current + 1, room)
                if rank < 0 or rank > highest_start[param]:
                    return None
                current, filled = rank, numels[param]
            loads[current] += cost
            tree.add(current, cost)
            owner[param] = current
    return _assignment(problem, owner)


def pack_frontier(problem: Problem, capacity: float) -> Assignment:
    """Fill ranks one at a time, each from the heads of every bucket's unplaced chain.

    Rank r takes, over and over, the costliest head that still fits under ``capacity``, until
    none fits; then rank r + 1 opens. A head that cannot wait any longer (its bucket would run
    out of ranks under its element cap; on the last rank, every head) is placed on r whatever the
    capacity says, so this always returns a complete assignment; the caller compares its busiest
    load with ``capacity``.
    """
    if not problem.capped:
        return _pack_frontier_uncapped(problem, capacity)
    numels, costs, caps, world, buckets = problem.numels, problem.costs, problem.caps, problem.world, problem.buckets
    owner = [0] * len(numels)
    loads = [0.0] * world
    head = [first for first, _ in buckets]
    chain_rank = [-1] * len(buckets)
    filled = [0] * len(buckets)
    heads = sorted((costs[first], -b) for b, (first, _) in enumerate(buckets))
    # (rank by which the head must be placed, bucket, head); entries go stale as heads advance.
    deadlines = [(problem.deadline(first), b, first) for b, (first, _) in enumerate(buckets)]
    heapq.heapify(deadlines)

    def place(b: int, rank: int) -> None:
        param = head[b]
        heads.pop(bisect.bisect_left(heads, (costs[param], -b)))
        if chain_rank[b] == rank:
            filled[b] += numels[param]
        else:
            chain_rank[b], filled[b] = rank, numels[param]
        owner[param] = rank
        loads[rank] += costs[param]
        head[b] = param + 1
        if param + 1 < buckets[b][1]:
            bisect.insort(heads, (costs[param + 1], -b))
            heapq.heappush(deadlines, (problem.deadline(param + 1), b, param + 1))

    def may_join(b: int, rank: int) -> bool:
        cap = caps[b]
        if cap is None:
            return True
        param = head[b]
        if chain_rank[b] != rank:
            return rank <= problem.highest_start[param]
        left = cap.cap - filled[b] - numels[param]
        return left >= 0 and cap.ranks_after(param + 1 - buckets[b][0], left) <= world - 1 - rank

    for rank in range(world):
        while deadlines and deadlines[0][0] <= rank:
            _, b, param = heapq.heappop(deadlines)
            if head[b] == param:
                place(b, rank)
        while heads:
            index = bisect.bisect_right(heads, (capacity - loads[rank], 0)) - 1
            while index >= 0 and not may_join(-heads[index][1], rank):
                index -= 1
            if index < 0:
                break
            place(-heads[index][1], rank)
    assert not heads, "the last rank takes every remaining head"
    return _assignment(problem, owner)


def _pack_frontier_uncapped(problem: Problem, capacity: float) -> Assignment:
    """:func:`pack_frontier` without element caps: the same placements, without the deadline bookkeeping.

    Every head's deadline is then the last rank, which takes whatever the others left.
    """
    costs, world, buckets = problem.costs, problem.world, problem.buckets
    owner = [world - 1] * len(costs)
    head = [first for first, _ in buckets]
    stops = [stop for _, stop in buckets]
    heads = sorted((costs[first], -b) for b, (first, _) in enumerate(buckets))
    for rank in range(world - 1):
        load = 0.0
        while heads:
            index = bisect.bisect_right(heads, (capacity - load, 0)) - 1
            if index < 0:
                break
            cost, negative = heads.pop(index)
            param = head[-negative]
            owner[param] = rank
            load += cost
            head[-negative] = param + 1
            if param + 1 < stops[-negative]:
                bisect.insort(heads, (costs[param + 1], negative))
    return _assignment(problem, owner)


def pack_recipes(problem: Problem, *, pace: bool = True) -> Assignment | None:
    """Fill ranks in order with the cost mixes ("recipes") that unconstrained LPT chooses.

    Tensors cheaper than ``FREE_RIDER_FRACTION`` of the average load are free riders: they go
    with the chain prefix that reaches past them, or, if none does, to the least-loaded rank their
    neighbours allow. For the rest, LPT on the remaining ranks gives a multiset of recipes; each
    rank takes the most common recipe it can realise from chain prefixes (see
    :meth:`_RecipeChains.realise`; ``pace`` picks which chains serve first). If none is
    realisable, the rank is filled with the costliest heads up to the remaining average, and the
    recipes are recomputed for what is left. Returns None where recipes do not apply: capped
    buckets, or too many distinct costs.
    """
    if problem.capped:
        return None
    costs, buckets, world = problem.costs, problem.buckets, problem.world
    threshold = FREE_RIDER_FRACTION * sum(costs) / world
    free = [cost <= threshold for cost in costs]
    big = [param for param, is_free in enumerate(free) if not is_free]
    if not big or len({costs[param] for param in big}) > MAX_RECIPE_CLASSES:
        return None

    owner = [-1] * len(costs)
    loads = [0.0] * world
    chains = _RecipeChains(problem, free, pace=pace)
    recipes = _lpt_recipes([costs[param] for param in big], world)

    for rank in range(world - 1):
        if not recipes:
            break
        complete: tuple[tuple[float, ...], list[tuple[int, int]]] | None = None
        for recipe, _ in sorted(recipes.items(), key=lambda item: (-item[1], item[0])):
            taken, missing = chains.realise(recipe)
            if not missing:
                complete = (recipe, taken)
                break
        if complete is not None:
            recipe, taken = complete
            recipes[recipe] -= 1
            if not recipes[recipe]:
                del recipes[recipe]
        else:
            # No mix is realisable from the chains as they stand: fill up to the remaining average
            # with the costliest heads, and ask LPT again for what is left.
            left = [param for param in big if owner[param] < 0]
            taken = chains.fill(sum(costs[param] for param in left) / (world - rank))
        for b, last in taken:
            for param in range(chains.head[b], last + 1):
                owner[param] = rank
                loads[rank] += costs[param]
            chains.advance(b, last + 1)
        if complete is None:
            recipes = _lpt_recipes([costs[param] for param in big if owner[param] < 0], world - rank - 1)

    # The last rank takes every chain up to its last big tensor; free riders after that go to
    # the least-loaded rank between their predecessor's rank and the end.
    for b in range(len(buckets)):
        for param in range(chains.head[b], chains.last_big[b] + 1):
            owner[param] = world - 1
            loads[world - 1] += costs[param]
    tree = LoadTree.from_loads(loads)
    for first, stop in buckets:
        for param in range(first, stop):
            if owner[param] < 0:
                rank = tree.argmin(owner[param - 1] if param > first else 0, world - 1)
                owner[param] = rank
                tree.add(rank, costs[param])
    return _assignment(problem, owner)


class _RecipeChains:
    """Each bucket's unplaced chain, indexed by the cost of its next big tensor.

    ``by_cost[c]`` lists, as ``(-big work left, bucket)``, the buckets whose next big tensor costs
    ``c``: in that order a search can stop as soon as no bucket left could beat the best prefix.
    """

    def __init__(self, problem: Problem, free: Sequence[bool], *, pace: bool) -> None:
        self.pace = pace
        self.costs = problem.costs
        self.free = free
        self.head = [first for first, _ in problem.buckets]
        self.last_big: list[int] = []
        self.remaining: list[float] = []
        for first, stop in problem.buckets:
            bigs = [param for param in range(first, stop) if not free[param]]
            self.last_big.append(bigs[-1] if bigs else first - 1)
            self.remaining.append(sum(self.costs[param] for param in bigs))
        self.next_big = [-1] * len(problem.buckets)
        self.by_cost: dict[float, list[tuple[float, int]]] = {}
        for b, (first, _) in enumerate(problem.buckets):
            self._index(b, first)

    def _following(self, b: int, param: int) -> int:
        """The first big tensor of bucket ``b`` at or after ``param``, or -1."""
        while param <= self.last_big[b] and self.free[param]:
            param += 1
        return param if param <= self.last_big[b] else -1

    def _index(self, b: int, param: int) -> None:
        self.next_big[b] = self._following(b, param)
        if self.next_big[b] >= 0:
            bisect.insort(self.by_cost.setdefault(self.costs[self.next_big[b]], []), (-self.remaining[b], b))

    def advance(self, b: int, head: int) -> None:
        """Mark bucket ``b``'s params before ``head`` as placed."""
        if self.next_big[b] >= 0:
            entries = self.by_cost[self.costs[self.next_big[b]]]
            del entries[bisect.bisect_left(entries, (-self.remaining[b], b))]
        for param in range(self.head[b], head):
            if not self.free[param]:
                self.remaining[b] -= self.costs[param]
        self.head[b] = head
        self._index(b, head)

    def fill(self, target: float) -> list[tuple[int, int]]:
        """Chain prefixes for one rank, costliest big tensor first, while the total stays within ``target``.

        Taking a head exposes the next big tensor of its chain, which may be taken next. Always
        takes at least one tensor, so that every rank moves the chains forward.
        """
        cursor = {b: param for b, param in enumerate(self.next_big) if param >= 0}
        taken: dict[int, int] = {}
        total = 0.0
        while cursor:
            room = target - total
            fitting = [(self.costs[p], -b) for b, p in cursor.items() if not taken or self.costs[p] <= room]
            if not fitting:
                break
            cost, b = max(fitting)
            b = -b
            taken[b] = cursor.pop(b)
            total += cost
            following = self._following(b, taken[b] + 1)
            if following >= 0:
                cursor[b] = following
        return sorted(taken.items())

    def realise(self, recipe: tuple[float, ...]) -> tuple[list[tuple[int, int]], float]:
        """Chain prefixes covering ``recipe``: ([(bucket, last param)], cost left uncovered).

        Repeatedly takes a bucket's longest prefix of needed costs, from the bucket with the most
        big work left (``pace``: chains that would otherwise fall behind, with too few ranks left
        for them, go first; ties: the more valuable prefix) or from the bucket whose prefix is
        worth the most (ties: more work left); then the lower index. Long prefixes come whole,
        which is what lets a rank take, say, attention and MLP of the same layer.
        """
        need = Counter(recipe)
        used: set[int] = set()
        taken: list[tuple[int, int]] = []
        while need:
            best: tuple[float, float, int] | None = None
            best_last = -1
            for cost in need:
                # Buckets are near-copies of each other in a real model, so a few candidates per
                # cost class, the ones with the most work left, are enough.
                for negative_left, b in self.by_cost.get(cost, ())[:RECIPE_CANDIDATES]:
                    # The list is sorted by work left, which bounds any prefix's value: once a
                    # bucket cannot beat the best even on the tie-breaks, none after it can.
                    if best is not None and not _may_beat(-negative_left, b, best, self.pace):
                        break
                    if b in used:
                        continue
                    value, last = self._prefix(b, need)
                    key = (negative_left, -value, b) if self.pace else (-value, negative_left, b)
                    if best is None or key < best:
                        best, best_last = key, last
            if best is None:
                break
            b = best[2]
            param = self.next_big[b]
            while 0 <= param <= best_last:
                need[self.costs[param]] -= 1
                if not need[self.costs[param]]:
                    del need[self.costs[param]]
                param = self._following(b, param + 1)
            used.add(b)
            taken.append((b, best_last))
        return taken, sum(cost * count for cost, count in need.items())

    def _prefix(self, b: int, need: Counter[float]) -> tuple[float, int]:
        """Value and last param of bucket ``b``'s longest prefix of big tensors that ``need`` covers."""
        costs = self.costs
        param, value, last = self.next_big[b], 0.0, -1
        counted: dict[float, int] = {}
        while param >= 0:
            cost = costs[param]
            if counted.get(cost, 0) >= need.get(cost, 0):
                break
            counted[cost] = counted.get(cost, 0) + 1
            value += cost
            last = param
            param = self._following(b, param + 1)
        return value, last


def _may_beat(left: float, bucket: int, best: tuple[float, float, int], pace: bool) -> bool:
    """Whether a bucket with ``left`` big work could beat ``best`` (see ``realise`` for the keys)."""
    if pace:
        return left >= -best[0]
    value, best_left, best_bucket = -best[0], -best[1], best[2]
    if left != value:
        return left > value
    return best_left == value and bucket < best_bucket


def _lpt_recipes(costs: Sequence[float], world: int) -> Counter[tuple[float, ...]]:
    """The multiset of per-rank cost mixes that LPT makes of ``costs`` on ``world`` ranks."""
    heap = [(0.0, rank) for rank in range(world)]
    bins: list[list[float]] = [[] for _ in range(world)]
    for cost in sorted(costs, reverse=True):
        load, rank = heapq.heappop(heap)
        bins[rank].append(cost)
        heapq.heappush(heap, (load + cost, rank))
    return Counter(tuple(sorted(items, reverse=True)) for items in bins if items)


def pack_tightest(
    problem: Problem,
    pack: Callable[[float], Assignment | None],
    incumbent: float = float("inf"),
    tolerance: float = BISECTION_TOLERANCE,
) -> Assignment | None:
    """The packing at (close to) the smallest capacity that ``pack`` manages, or None.

    Without an ``incumbent``, capacities grow geometrically from the lower bound until one fits.
    With one (the busiest load some other packing already reached), the first try is just below
    it, and a packer that cannot beat it there is given up (None): packers are close to
    monotone in the capacity, and this keeps the portfolio cheap on large problems. Then
    bisection closes the gap to ``tolerance``. Since packers are not exactly monotone, the
    best packing seen (by its real busiest load) is kept, not the last.
    """
    low = problem.lower_bound()
    best: Assignment | None = None

    def attempt(capacity: float) -> bool:
        nonlocal best
        assignment = pack(capacity)
        if assignment is None:
            return False
        if best is None or assignment.loads.max_load() < best.loads.max_load():
            best = assignment
        return assignment.loads.max_load() <= capacity * (1.0 + 1e-12)

    failed, step = low, 2 * tolerance
    if incumbent < float("inf"):
        if not attempt(incumbent * (1.0 - tolerance)):
            return None
    else:
        capacity = low
        while not attempt(capacity):
            failed = capacity
            capacity = low * (1.0 + step)
            step *= 2.0
            assert step < 1e6, "an unbounded capacity always fits"
    assert best is not None
    fitted = best.loads.max_load()
    while fitted > failed * (1.0 + tolerance):
        middle = (failed + fitted) / 2.0
        if attempt(middle):
            fitted = min(middle, best.loads.max_load())
        else:
            failed = middle
    return best


# --------------------------------------------------------------------------------------------
# Local search.
# --------------------------------------------------------------------------------------------


class LocalSearch:
    """Lower the busiest rank by moving one of its tensors away, or swapping it for a lighter one.

    A tensor may take any rank between its bucket neighbours' ranks (so the bucket stays
    monotone) where its segment stays within the bucket's element cap. Each accepted step
    strictly lowers the busiest rank's load and leaves the other rank below the old peak, so the
    search ends; it stops when the busiest rank cannot be helped, or when its work budget (in
    candidate pairs examined, so deterministic) runs out.
    """

    def __init__(self, problem: Problem, assignment: Assignment, budget: int) -> None:
        self.problem = problem
        self.state = assignment
        self.budget = budget
        self.on_rank: list[list[int]] = [[] for _ in range(problem.world)]
        for param, rank in enumerate(assignment.owner):
            self.on_rank[rank].append(param)

    def run(self) -> None:
        while self.budget > 0:
            busiest = self.state.loads.busiest()
            if not (self._best_move(busiest) or self._best_swap(busiest)):
                return

    def _window(self, param: int) -> tuple[int, int]:
        problem, owner = self.problem, self.state.owner
        first, stop = problem.buckets[problem.bucket_of[param]]
        low = owner[param - 1] if param > first else 0
        high = owner[param + 1] if param + 1 < stop else problem.world - 1
        return low, high

    def _fits(self, param: int, rank: int, leaving: int = 0) -> bool:
        """Whether ``param`` fits its bucket's cap on ``rank`` (after ``leaving`` elements leave it)."""
        b = self.problem.bucket_of[param]
        cap = self.problem.caps[b]
        if cap is None:
            return True
        return self.state.segment.get((b, rank), 0) - leaving + self.problem.numels[param] <= cap.cap

    def _best_move(self, busiest: int) -> bool:
        loads, costs, caps = self.state.loads, self.problem.costs, self.problem.caps
        top = loads[busiest]
        best: tuple[float, int, int] | None = None
        for param in self.on_rank[busiest]:
            low, high = self._window(param)
            if caps[self.problem.bucket_of[param]] is None:
                self.budget -= 1
                target = loads.argmin(low, high)
                candidates = [target] if target != busiest else []
            else:
                self.budget -= high - low + 1
                candidates = [r for r in range(low, high + 1) if r != busiest and self._fits(param, r)]
            for rank in candidates:
                peak = max(top - costs[param], loads[rank] + costs[param])
                if peak < top * (1.0 - 1e-12) and (best is None or (peak, param, rank) < best):
                    best = (peak, param, rank)
        if best is None:
            return False
        _, param, rank = best
        self._move(param, busiest, rank)
        return True

    def _best_swap(self, busiest: int) -> bool:
        loads, costs, owner = self.state.loads, self.problem.costs, self.state.owner
        top = loads[busiest]
        best: tuple[float, int, int] | None = None
        for param in self.on_rank[busiest]:
            low, high = self._window(param)
            for rank in range(low, high + 1):
                gap = top - loads[rank]
                if rank == busiest or gap <= 0.0:
                    continue
                self.budget -= len(self.on_rank[rank])
                for other in self.on_rank[rank]:
                    delta = costs[param] - costs[other]
                    if not 0.0 < delta < gap:
                        continue
                    peak = max(top - delta, loads[rank] + delta)
                    if best is not None and (peak, param, other) >= best:
                        continue
                    owner[param], owner[other] = rank, busiest
                    valid = self._monotone(param) and self._monotone(other) and self._swap_fits(param, other)
                    owner[param], owner[other] = busiest, rank
                    if valid:
                        best = (peak, param, other)
            if self.budget <= 0:
                break
        if best is None:
            return False
        _, param, other = best
        rank = owner[other]
        self._move(param, busiest, rank)
        self._move(other, rank, busiest)
        return True

    def _monotone(self, param: int) -> bool:
        low, high = self._window(param)
        return low <= self.state.owner[param] <= high

    def _swap_fits(self, param: int, other: int) -> bool:
        owner, problem = self.state.owner, self.problem
        if problem.bucket_of[param] != problem.bucket_of[other]:
            return self._fits(param, owner[param]) and self._fits(other, owner[other])
        # Same bucket: each of the two segments gives one tensor and takes the other.
        return self._fits(param, owner[param], leaving=problem.numels[other]) and self._fits(
            other, owner[other], leaving=problem.numels[param]
        )

    def _move(self, param: int, source: int, target: int) -> None:
        state, problem = self.state, self.problem
        state.owner[param] = target
        state.loads.add(source, -problem.costs[param])
        state.loads.add(target, problem.costs[param])
        self.on_rank[source].remove(param)
        bisect.insort(self.on_rank[target], param)
        b = problem.bucket_of[param]
        if problem.caps[b] is not None:
            size = problem.numels[param]
            state.segment[(b, source)] -= size
            state.segment[(b, target)] = state.segment.get((b, target), 0) + size


# --------------------------------------------------------------------------------------------
# Driver.
# --------------------------------------------------------------------------------------------


def balance(
    numels: Sequence[int], costs: Sequence[float], buckets: Sequence[tuple[int, int]], world: int, alpha: float
) -> list[int]:
    """Owner per param: the best of the packers above, each polished by the local search.

    The search stops early once some packing reaches the lower bound (the average load, or the
    costliest tensor).
    """
    problem = Problem(numels, costs, buckets, world, segment_caps(numels, buckets, world, alpha))
    in_order = list(range(len(buckets)))
    heaviest_first = _heaviest_first(problem)
    # On large problems, capacity-driven packers that cannot beat the best so far are dropped
    # after one try (see pack_tightest), and the second recipe variant is skipped.
    large = len(numels) * world > LARGE_PROBLEM
    tolerance = 10 * BISECTION_TOLERANCE if large else BISECTION_TOLERANCE
    builders: list[Callable[[float], Assignment | None]] = [
        lambda incumbent: pack_recipes(problem, pace=True),
        lambda incumbent: pack_tightest(problem, lambda c: pack_first_fit(problem, c, in_order), incumbent, tolerance),
        lambda incumbent: pack_tightest(problem, lambda c: pack_frontier(problem, c), incumbent, tolerance),
    ]
    if not large:
        builders.append(lambda incumbent: pack_recipes(problem, pace=False))
    if heaviest_first != in_order:
        builders.append(
            lambda incumbent: pack_tightest(
                problem, lambda c: pack_first_fit(problem, c, heaviest_first), incumbent, tolerance
            )
        )
    optimal = problem.lower_bound() * (1.0 + BISECTION_TOLERANCE)
    best: Assignment | None = None
    for build in builders:
        assignment = build(best.loads.max_load() if best is not None and large else float("inf"))
        if assignment is None:
            continue
        LocalSearch(problem, assignment, budget=_search_budget(problem)).run()
        if best is None or assignment.key() < best.key():
            best = assignment
        if best.loads.max_load() <= optimal:
            break
    assert best is not None
    return best.owner


def _heaviest_first(problem: Problem) -> list[int]:
    """Buckets by decreasing cost: the LPT rule of the paper's Algorithm 1."""
    weights = [sum(problem.costs[first:stop]) for first, stop in problem.buckets]
    return sorted(range(len(problem.buckets)), key=lambda b: (-weights[b], b))


def _search_budget(problem: Problem) -> int:
    return 200_000 + 20 * len(problem.numels)


def _runs_needed(numels: Sequence[int], cap: int) -> int:
    runs, filled = 1, 0
    for size in numels:
        if filled + size > cap:
            runs, filled = runs + 1, 0
        filled += size
    return runs
