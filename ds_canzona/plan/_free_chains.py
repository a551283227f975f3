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

from collections.abc import Sequence


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


def free_chains(buckets: Sequence[tuple[int, int]], costs: Sequence[float], memory: Sequence[float],
                sand: Sequence[bool], owner: Sequence[int], world: int) -> list[FreeChain]:
    """The buckets of two or more sand items, all alike in cost and bytes but the last."""
    chains = []
    for first, stop in buckets:
        if stop - first < 2 or not all(sand[item] for item in range(first, stop)):
            continue
        if all(costs[item] == costs[first] and memory[item] == memory[first] for item in range(first + 1, stop - 1)):
            chains.append(FreeChain(first, stop, costs, memory, owner, world))
    return chains
