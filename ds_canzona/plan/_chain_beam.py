"""A beam search over chain prefixes, rank by rank, for buffers the packers leave above LPT's target.

Where every packer misses 2% above LPT on more than three buckets, the cause is usually the
buffer order, not the loads: a 16-expert MoE whose experts are 3-D stacks puts each layer's
``down_proj`` stack between its ``gate_up_proj`` and the next layer's, and LPT's three downs on
one rank can only come from three buckets, with ``gate_up_proj`` owners between them in each.
Rank-by-rank packers that commit one rank at a time (the frontier, the recipes) take the wrong
mix early and pay for it at the end.

The search keeps several partial plans at once. A state is how far each chain holding matrices
has been placed (its head); one more rank extends a state by prefixes of up to
``CHAINS_PER_RANK`` chains under the capacity, each prefix ending after one of the next
``BOUNDARIES_PER_CHAIN`` heavy items of its chain (``HEAVY_FRACTION`` of an average rank or
more) or as long as it fits. Of the states reached, the ``BEAM_WIDTH`` with the least room left
unused beyond what the tensors in pieces will need are kept (ties: the room itself, then the
heads). A state whose remaining work cannot fit in the ranks left is dropped, and the last rank
must take every chain's rest. The tensors in pieces (free chains: any count per rank, in rank
order) are poured into the room afterwards, in rank order.

Measured (``python -m ds_canzona.bench plan-bounds``): an OLMoE-architecture model with 16
experts at hidden 1024, DP=32, standard pricing, from 1.084x LPT to within 1%; a 16-layer Qwen3 at
hidden 2048 / 8192, tied, DP=64, Gram, from 1.077x to 1.000x. It does not solve every such buffer
(docs/PLANNER.md lists those it does not), and it runs only where the other packers missed,
within ``MAX_EXPANSIONS`` prefix extensions.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from ._packing import Problem

__all__ = ["beam_owner"]

BEAM_WIDTH = 48
CHAINS_PER_RANK = 3
BOUNDARIES_PER_CHAIN = 3
HEAVY_FRACTION = 0.05
# Prefix extensions tried, in all the calls of one plan (``fit`` shares it between capacities).
MAX_EXPANSIONS = 200_000
_SLACK = 1.0 + 1e-12


def beam_owner(problem: Problem, capacity: float, free_chains: Sequence[tuple[int, int]] = (),
               *, budget: int = MAX_EXPANSIONS) -> tuple[list[int] | None, int]:
    """(Owners with every rank's cost within ``capacity`` or None, prefix extensions spent).

    ``free_chains``: the item ranges of tensors in pieces, each alone in its bucket; poured last.
    The search stops, with None, once it has spent ``budget`` extensions.
    """
    if problem.capped:
        return None, 0
    costs, world = problem.costs, problem.world
    free = set(map(tuple, free_chains))
    rock = [(first, stop) for first, stop in problem.buckets if (first, stop) not in free and stop > first]
    poured = [(first, stop) for first, stop in problem.buckets if (first, stop) in free]
    free_cost = sum(sum(costs[first:stop]) for first, stop in poured)
    heavy = HEAVY_FRACTION * sum(costs) / world
    stops = [stop for _, stop in rock]
    room_limit = capacity * _SLACK

    def prefixes(chain: int, head: int, room: float) -> list[tuple[int, float]]:
        """(new head, cost) of the prefixes chain ``chain`` may give from ``head`` within ``room``."""
        found: list[tuple[int, float]] = []
        taken, item, stop = 0.0, head, stops[chain]
        while item < stop and taken + costs[item] <= room * _SLACK:
            taken += costs[item]
            item += 1
            if costs[item - 1] >= heavy and len(found) < BOUNDARIES_PER_CHAIN:
                found.append((item, taken))
        if item > head and (not found or found[-1][0] != item):
            found.append((item, taken))
        return found

    remaining = sum(sum(costs[first:stop]) for first, stop in rock)
    # A state: (unused room so far, heads, rock work left, moves per rank so far).
    beam: list[tuple[float, tuple[int, ...], float, tuple]] = [(0.0, tuple(first for first, _ in rock), remaining, ())]
    expansions = 0
    for rank in range(world):
        reached: dict[tuple[int, ...], tuple[float, tuple[int, ...], float, tuple]] = {}
        for unused, heads, left, moves in beam:
            if rank == world - 1:
                if left <= room_limit:
                    rest = tuple((c, heads[c], stops[c]) for c in range(len(rock)) if heads[c] < stops[c])
                    final = tuple(stops)
                    reached[final] = (unused + capacity - left, final, 0.0, moves + (rest,))
                continue
            extensions: list[tuple[tuple, tuple[int, ...], float]] = [((), heads, 0.0)]
            frontier = extensions
            for _ in range(CHAINS_PER_RANK):
                grown = []
                for taken, state, used in frontier:
                    touched = {move[0] for move in taken}
                    for chain in range(len(rock)):
                        if chain in touched or state[chain] >= stops[chain]:
                            continue
                        for head, cost in prefixes(chain, state[chain], capacity - used):
                            expansions += 1
                            following = list(state)
                            following[chain] = head
                            grown.append((taken + ((chain, state[chain], head),), tuple(following), used + cost))
                if expansions > budget:
                    return None, expansions
                extensions += grown
                frontier = grown
                if not grown:
                    break
            ranks_left = world - rank - 1
            for taken, state, used in extensions:
                rest = left - used
                room = unused + capacity - used
                # The rest of the matrices' chains on the ranks left; the pieces anywhere there is room.
                if rest > ranks_left * room_limit or rest + free_cost > ranks_left * capacity + room + 1e-9 * capacity:
                    continue
                known = reached.get(state)
                if known is None or room < known[0]:
                    reached[state] = (room, state, rest, moves + (taken,))
        if not reached:
            return None, expansions
        beam = heapq.nsmallest(BEAM_WIDTH, reached.values(),
                               key=lambda entry: (max(0.0, entry[0] - free_cost), entry[0], entry[1]))
    done = [entry for entry in beam if entry[1] == tuple(stops)]
    if not done:
        return None, expansions
    owner = [0] * len(costs)
    loads = [0.0] * world
    for rank, taken in enumerate(done[0][3]):
        for chain, start, stop in taken:
            for item in range(start, stop):
                owner[item] = rank
                loads[rank] += costs[item]
    for first, stop in poured:
        rank = 0
        for item in range(first, stop):
            while rank < world - 1 and loads[rank] + costs[item] > room_limit:
                rank += 1
            owner[item] = rank
            loads[rank] += costs[item]
    return (owner if max(loads) <= room_limit else None), expansions
