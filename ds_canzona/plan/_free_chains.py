"""Free chains: the pieces of one tensor, alone in their bucket, re-partitioned by counts.

A non-matrix tensor planned in pieces has a bucket of its own (``plan_buckets``), and its pieces
are identical items except the last, which may be shorter. Inside the bucket the owner must be
non-decreasing, but since the pieces are interchangeable only *how many* each rank holds
matters: any count per rank is a valid plan, its owners following in rank order. So j pieces can
go from any rank to any other in one step, while a move of the local searches keeps an item
between its bucket neighbours' ranks and takes a piece one rank along the chain at a time.

That is what the memory search needs where a cost-only plan piles a big embedding on a few ranks
whose matrices are light (Gemma-2-9B at DP=16: 151 of 219 pieces on one rank, 2.17x the average
bytes, with every rank's cost within 0.07% of the makespan). No single move helps there: a piece
costs more than any rank's spare cost, and a swap for a matrix must match its cost in one item.
An *exchange* does it: the busiest rank takes one item (a matrix, or sand bound between matrices)
from another rank and gives back as many pieces as keep both ranks' costs under the makespan (a
k_proj is worth about seven pieces of that embedding, at a seventh of their bytes).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence

from ._loads import LoadTree

# Which load an exchange lowers (the other is held under a capacity).
COST, MEMORY = 0, 1
# Items in a run an exchange may bring to the busiest rank at once (from the end of the run just
# before it in a bucket, or the start of the run just after it).
EXCHANGE_RUN = 8
# First exchanges an ejection tries before giving up on the busiest rank.
EJECTION_TRIES = 8


class FreeChain:
    """One bucket of pieces: their per-rank counts, and the loads a re-partition changes.

    ``counts[r]`` is how many of the bucket's items rank ``r`` holds; the last item (the short
    piece, when the tensor does not divide evenly) lies on the highest rank with a count.
    """

    def __init__(self, first: int, stop: int, costs: Sequence[float], memory: Sequence[float],
                 owner: Sequence[int], world: int) -> None:
        self.first, self.stop = first, stop
        self.unit_cost, self.unit_memory = costs[first], memory[first]
        self.last_cost, self.last_memory = costs[stop - 1], memory[stop - 1]
        self.counts = [0] * world
        for item in range(first, stop):
            self.counts[owner[item]] += 1

    def highest(self) -> int:
        """The rank holding the last item: the highest with a count."""
        return max(rank for rank, count in enumerate(self.counts) if count)

    def deltas(self, source: int, target: int, moved: int, highest: int) -> dict[int, tuple[float, float]]:
        """(cost, memory) change per rank when ``moved`` items go from ``source`` to ``target``.

        ``highest`` is :meth:`highest`, passed in because callers ask about many moves at once.
        """
        after = highest
        if target > highest:
            after = target
        elif source == highest and self.counts[source] == moved:
            after = max([target] + [rank for rank in range(source) if self.counts[rank]])
        changes: dict[int, tuple[float, float]] = {}

        def add(rank: int, cost: float, memory: float) -> None:
            old_cost, old_memory = changes.get(rank, (0.0, 0.0))
            changes[rank] = (old_cost + cost, old_memory + memory)

        add(source, -moved * self.unit_cost, -moved * self.unit_memory)
        add(target, moved * self.unit_cost, moved * self.unit_memory)
        if after != highest:
            # The last item moves with the highest rank: where it was, a full piece takes its
            # place in the count; where it goes, it takes a full piece's.
            add(highest, self.unit_cost - self.last_cost, self.unit_memory - self.last_memory)
            add(after, self.last_cost - self.unit_cost, self.last_memory - self.unit_memory)
        return changes

    def repartition(self, owner: list[int], source: int, target: int, moved: int) -> list[tuple[int, int, int]]:
        """Apply the counts and rewrite the owners in rank order: (item, old rank, new rank) for each change."""
        self.counts[source] -= moved
        self.counts[target] += moved
        changed = []
        item = self.first
        for rank, count in enumerate(self.counts):
            for _ in range(count):
                if owner[item] != rank:
                    changed.append((item, owner[item], rank))
                    owner[item] = rank
                item += 1
        return changed


def free_chains(ranges: Sequence[tuple[int, int]], costs: Sequence[float], memory: Sequence[float],
                owner: Sequence[int], world: int) -> list[FreeChain]:
    """Free chains over ``ranges``: the item ranges of tensors in pieces, each alone in its bucket.

    Every piece but the last must be alike in cost and bytes (canonical pieces of one tensor are).
    """
    chains = []
    for first, stop in ranges:
        if stop - first < 2:
            continue
        if not all(costs[item] == costs[first] and memory[item] == memory[first] for item in range(first + 1, stop - 1)):
            raise ValueError(f"items {first}..{stop - 1} are not alike pieces")
        chains.append(FreeChain(first, stop, costs, memory, owner, world))
    return chains


class ChainExchanges:
    """Exchanges for a local search over ``problem``, ``state`` (its owners and cost loads),
    ``memory`` and ``memory_loads``, ``on_rank`` and ``budget`` (``LocalSearch`` and its subclasses).

    :meth:`best_exchange` lowers one load of the busiest rank (``COST`` or ``MEMORY``) and keeps the
    other under a capacity; :meth:`count_move` keeps the chains' counts in step with single moves.
    """

    def track_chains(self, ranges: Sequence[tuple[int, int]]) -> None:
        """Count the items of ``ranges`` (tensors in pieces, alone in their buckets) by rank."""
        problem = self.problem
        self.chains = [] if problem.capped else free_chains(
            ranges, problem.costs, self.memory, self.state.owner, problem.world)
        self.chain_of = [-1] * len(problem.numels)
        for index, chain in enumerate(self.chains):
            self.chain_of[chain.first:chain.stop] = [index] * (chain.stop - chain.first)

    def count_move(self, param: int, source: int, target: int) -> None:
        if self.chain_of[param] >= 0:
            counts = self.chains[self.chain_of[param]].counts
            counts[source] -= 1
            counts[target] += 1

    def best_exchange(self, busiest: int, lowered: int, capacity: float, ceiling: float | None = None) -> bool:
        """Pieces of a free chain one way between ``busiest`` and another rank, a run of items the other.

        Either the pieces leave ``busiest`` and a run of the other rank's items outside the free
        chains comes back (or nothing does), or a run of ``busiest``'s items leaves and pieces come
        back; a run is one that may move as a whole (the end of a rank's part of a bucket next to
        the other rank). Per pair, as many pieces as bring the two ranks' ``lowered`` loads
        closest, within what keeps the other load of both under ``capacity``. The best is taken
        where every changed rank ends below ``ceiling`` (default: the busiest rank's load).
        """
        if ceiling is None:
            ceiling = self._loads(lowered)[busiest] * (1.0 - 1e-12)
        best = min((key for key, _ in self._exchanges(busiest, lowered, capacity) if key[0] < ceiling), default=None)
        if best is None:
            return False
        self._apply_exchange(best)
        return True

    def ejection(self, busiest: int, lowered: int, capacity: float) -> bool:
        """Two exchanges, where one alone would only move the excess onto the other rank.

        The first takes ``busiest`` below its load but leaves one other rank above it; the second,
        from that rank, must bring it back below (and every rank it changes) for the pair to stay.
        Up to ``EJECTION_TRIES`` first steps are tried, those leaving the least excess first.
        """
        loads = self._loads(lowered)
        top = loads[busiest] * (1.0 - 1e-12)
        tries = []
        for key, changes in self._exchanges(busiest, lowered, capacity):
            over = [r for r, change in changes.items() if loads[r] + change[lowered] >= top]
            if len(over) == 1 and over[0] != busiest:
                tries.append((key[0], key, over[0]))
        for _, key, other in sorted(tries)[:EJECTION_TRIES]:
            saved = self._snapshot()
            self._apply_exchange(key)
            if self.best_exchange(other, lowered, capacity, ceiling=top):
                return True
            self._restore(saved)
        return False

    def _loads(self, which: int) -> list[float]:
        return (self.state.loads if which == COST else self.memory_loads).loads()

    def _exchanges(self, busiest: int, lowered: int, capacity: float):
        """Every exchange at ``busiest`` within ``capacity``: (key, load changes per rank); key[0] its peak."""
        if not self.chains:
            return
        loads = (self.state.loads.loads(), self.memory_loads.loads())
        kept = 1 - lowered
        top, held = loads[lowered], loads[kept]
        options = self._exchange_options(busiest)
        for index, chain in enumerate(self.chains):
            counts, highest = chain.counts, chain.highest()
            unit = (chain.unit_cost, chain.unit_memory)
            self.budget -= len(options)
            for source, target, run_first, run_stop, run in options:
                have = counts[source]
                if not have:
                    continue
                # Whole pieces: few enough for ``target``'s capacity, enough for ``source``'s.
                low, high = 1, have
                if unit[kept] > 0:
                    low = max(low, math.ceil((held[source] + run[kept] - capacity) / unit[kept]))
                    high = min(high, math.floor((capacity - held[target] + run[kept]) / unit[kept]))
                if low > high:
                    continue
                balanced = high
                if unit[lowered] > 0:
                    balanced = (top[source] - top[target] + 2.0 * run[lowered]) / (2.0 * unit[lowered])
                for moved in sorted({min(high, max(low, math.floor(balanced))),
                                     min(high, max(low, math.ceil(balanced)))}):
                    changes = chain.deltas(source, target, moved, highest)
                    changes[source] = _plus(changes.get(source, (0.0, 0.0)), run)
                    changes[target] = _plus(changes.get(target, (0.0, 0.0)), (-run[0], -run[1]))
                    if any(held[r] + change[kept] > capacity for r, change in changes.items() if change[kept] > 0):
                        continue
                    peak = max(top[r] + change[lowered] for r, change in changes.items())
                    yield (peak, run_first, source, target, index, moved, run_stop), changes

    def _apply_exchange(self, key: tuple[float, int, int, int, int, int, int]) -> None:
        _, run_first, source, target, index, moved, run_stop = key
        chain = self.chains[index]
        for r, (cost, memory) in chain.deltas(source, target, moved, chain.highest()).items():
            self.state.loads.add(r, cost)
            self.memory_loads.add(r, memory)
        for piece, old, new in chain.repartition(self.state.owner, source, target, moved):
            self.on_rank[old].remove(piece)
            bisect.insort(self.on_rank[new], piece)
        for item in range(run_first, run_stop):
            self._move(item, target, source)

    def _snapshot(self) -> tuple:
        return (list(self.state.owner), self.state.loads.loads(), self.memory_loads.loads(),
                [list(items) for items in self.on_rank], [list(chain.counts) for chain in self.chains], self.budget)

    def _restore(self, saved: tuple) -> None:
        owner, cost_loads, memory_loads, on_rank, counts, budget = saved
        self.state.owner[:] = owner
        self.state.loads = LoadTree.from_loads(cost_loads)
        self.memory_loads = LoadTree.from_loads(memory_loads)
        self.on_rank = on_rank
        for chain, chain_counts in zip(self.chains, counts):
            chain.counts = chain_counts
        self.budget = budget

    def _exchange_options(self, busiest: int) -> list[tuple[int, int, int, int, tuple[float, float]]]:
        """What :meth:`best_exchange` weighs: (pieces from, pieces to, run first, run stop, the run's loads)."""
        world, owner = self.problem.world, self.state.owner
        chain_ranks = sorted({rank for chain in self.chains for rank, count in enumerate(chain.counts) if count})
        # Pieces leave ``busiest`` for any rank, with nothing back ...
        options = [(busiest, rank, 0, 0, (0.0, 0.0)) for rank in range(world) if rank != busiest]
        for first, stop in self.problem.buckets:
            if self.chain_of[first] >= 0:
                continue
            # ... or with a run that may come to ``busiest`` (from just below or above it) ...
            below = bisect.bisect_left(owner, busiest, first, stop) - 1
            above = bisect.bisect_right(owner, busiest, first, stop)
            for run_first, run_stop, values in self._runs(below, first, stop, -1) + self._runs(above, first, stop, 1):
                options.append((busiest, owner[run_first], run_first, run_stop, values))
            # ... or a run of ``busiest``'s own leaves for a rank its neighbours allow, pieces coming back.
            start = bisect.bisect_left(owner, busiest, first, stop)
            if start == above:
                continue
            lowest = owner[start - 1] if start > first else 0
            highest = owner[above] if above < stop else world - 1
            for run_first, run_stop, values in self._runs(start, first, stop, 1):
                options.extend((rank, busiest, run_first, run_stop, values)
                               for rank in chain_ranks if lowest <= rank < busiest)
            for run_first, run_stop, values in self._runs(above - 1, first, stop, -1):
                options.extend((rank, busiest, run_first, run_stop, values)
                               for rank in chain_ranks if busiest < rank <= highest)
        return options

    def _runs(self, end: int, first: int, stop: int, step: int) -> list[tuple[int, int, tuple[float, float]]]:
        """Runs of one rank's items in bucket ``[first, stop)`` from item ``end`` on, towards ``step``.

        Up to ``EXCHANGE_RUN`` items, all on ``end``'s rank: the end of that rank's part of the
        bucket, which may move together to a neighbouring rank and keep the bucket monotone.
        """
        owner, costs, memory = self.state.owner, self.problem.costs, self.memory
        runs = []
        if not first <= end < stop:
            return runs
        cost = held = 0.0
        item = end
        while first <= item < stop and owner[item] == owner[end] and abs(item - end) < EXCHANGE_RUN:
            cost, held = cost + costs[item], held + memory[item]
            runs.append((min(item, end), max(item, end) + 1, (cost, held)))
            item += step
        return runs


def _plus(left: tuple[float, float], right: tuple[float, float]) -> tuple[float, float]:
    return left[0] + right[0], left[1] + right[1]
