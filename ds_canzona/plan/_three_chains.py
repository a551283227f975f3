"""An exact packing of a buffer of three buckets under a capacity (small tied models, pieces split off).

With the embedding in pieces split off into a bucket of its own, Qwen3-0.6B's buffer is three
buckets. As in ``_two_chains``, rank r's share is a contiguous run of each chain, the runs in rank
order. Which prefixes (a, b, c) of the three chains the first r ranks can cover under a capacity C
is kept as, for each prefix pair (a, c) of two chains, the longest prefix b of the third; one more
rank extends every state by a run of chain c and a run of chain a that fit under C, and the longest
run of chain b that fits in what is left. A state with no more of all three than another is dropped.
C is feasible iff the three chains are covered within R ranks.

The longest chain is the one taken greedily (b), so the states are the pairs of the two shorter
ones. A state the ranks left cannot finish at full capacity is dropped, and the last rank only
extends states to the end of all three chains: Qwen3-0.6B (310 tensors, 3 buckets) at DP=4 under
a memory capacity went from 10 s to 0.2-8 s per capacity. The planner asks only for a few
capacities (``owner_at``), and only where the packers miss the makespan target.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence

from ._packing import Problem

# Above this many (state, rank) pairs the search is not run.
MAX_WORK = 2_000_000


def owner_at(problem: Problem, capacities: Sequence[float], *, memory: Sequence[float] | None = None,
             memory_capacity: float | None = None) -> list[int] | None:
    """Owners under the first of ``capacities`` (tried in order) the three chains fit under, or None.

    With ``memory`` (per item) and ``memory_capacity``, every rank's memory must fit as well.
    """
    if problem.capped or len(problem.buckets) != 3:
        return None
    # chains[0] and chains[2] are the states' axes, chains[1] (the longest) is taken greedily.
    by_length = sorted(range(3), key=lambda b: (problem.buckets[b][1] - problem.buckets[b][0], b))
    chains = [problem.buckets[by_length[1]], problem.buckets[by_length[2]], problem.buckets[by_length[0]]]
    lengths = [stop - first for first, stop in chains]
    if (lengths[0] + 1) * (lengths[2] + 1) * problem.world > MAX_WORK:
        return None
    prefixes = [list(itertools.accumulate(problem.costs[first:stop], initial=0.0)) for first, stop in chains]
    bytes_prefixes = None
    if memory is not None and memory_capacity is not None:
        bytes_prefixes = [list(itertools.accumulate(memory[first:stop], initial=0.0)) for first, stop in chains]
        memory_capacity *= 1.0 + 1e-12
    for capacity in capacities:
        runs = _layout(prefixes, problem.world, capacity * (1.0 + 1e-12), bytes_prefixes, memory_capacity)
        if runs is not None:
            owner = [0] * len(problem.costs)
            for rank, rank_runs in enumerate(runs):
                for (first, _), (start, stop) in zip(chains, rank_runs):
                    for item in range(first + start, first + stop):
                        owner[item] = rank
            return owner
    return None


def _layout(prefixes: list[list[float]], world: int, capacity: float, bytes_prefixes: list[list[float]] | None = None,
            memory_capacity: float | None = None, *, prune: bool = True) -> list[list[tuple[int, int]]] | None:
    """Per rank, its runs of the three chains (as in ``prefixes``), or None if ``capacity`` is infeasible.

    With ``bytes_prefixes`` (the items' memory, summed the same way), a rank's memory must also
    stay within ``memory_capacity``: a run is then the longest that fits under both. ``prune=False``
    keeps every state (the plain search the prunes are tested against: same answer, same layout).
    """
    p0, p1, p2 = prefixes
    if bytes_prefixes is None or memory_capacity is None:
        # No memory limit: prefix sums of zeros never bind.
        bytes_prefixes, memory_capacity = [[0.0] * len(p) for p in prefixes], 1.0
    q0, q1, q2 = bytes_prefixes
    n0, n1, n2 = len(p0) - 1, len(p1) - 1, len(p2) - 1
    # reach[c][a]: the longest chain-1 prefix covered with chain-0 prefix a and chain-2 prefix c.
    reach = [[-1] * (n0 + 1) for _ in range(n2 + 1)]
    reach[0][0] = 0
    frontiers = [reach]
    parents: list[list[list[tuple[int, int]]]] = []
    total_cost, total_memory = p0[n0] + p1[n1] + p2[n2], q0[n0] + q1[n1] + q2[n2]
    while len(parents) < world and reach[n2][n0] != n1:
        # A state the ranks left cannot finish even when filled to both capacities is dropped: what
        # it leads to is no nearer the end, so no feasible layout runs through it. (The slack keeps
        # rounding in the prefix sums from dropping a state on the boundary.)
        ranks_left = world - len(parents)
        cost_floor = total_cost - ranks_left * capacity * (1.0 + 1e-9) if prune else -math.inf
        memory_floor = total_memory - ranks_left * memory_capacity * (1.0 + 1e-9) if prune else -math.inf
        last_rank = prune and ranks_left == 1  # only the layout's end, (n2, n0), is of use
        step = [[-1] * (n0 + 1) for _ in range(n2 + 1)]
        parent = [[(-1, -1)] * (n0 + 1) for _ in range(n2 + 1)]
        for c in range(n2 + 1):
            row = reach[c]
            last2 = min(bisect.bisect_right(p2, p2[c] + capacity), bisect.bisect_right(q2, q2[c] + memory_capacity)) - 1
            if last_rank and last2 < n2:
                continue
            for a in range(n0 + 1):
                b = row[a]
                if b < 0 or p0[a] + p1[b] + p2[c] < cost_floor or q0[a] + q1[b] + q2[c] < memory_floor:
                    continue
                for c2 in (n2,) if last_rank else range(c, last2 + 1):
                    room0 = capacity - (p2[c2] - p2[c])
                    memory_room0 = memory_capacity - (q2[c2] - q2[c])
                    last0 = min(bisect.bisect_right(p0, p0[a] + room0),
                                bisect.bisect_right(q0, q0[a] + memory_room0)) - 1
                    out, back = step[c2], parent[c2]
                    for a2 in ((n0,) if last0 >= n0 else ()) if last_rank else range(a, last0 + 1):
                        reached = min(bisect.bisect_right(p1, p1[b] + room0 - (p0[a2] - p0[a])),
                                      bisect.bisect_right(q1, q1[b] + memory_room0 - (q0[a2] - q0[a]))) - 1
                        if reached > out[a2]:
                            out[a2], back[a2] = reached, (c, a)
        # Drop dominated states: another with at least as much of all three chains.
        higher = [-1] * (n0 + 1)  # the most chain 1 of a state with more chain 2 and at least chain-0 prefix a
        for c in range(n2, -1, -1):
            out = step[c]
            most = -1
            for a in range(n0, -1, -1):
                if out[a] <= most or out[a] <= higher[a]:
                    most = max(most, out[a])
                    out[a] = -1
                else:
                    most = out[a]
            running = -1
            for a in range(n0, -1, -1):
                running = max(running, out[a], higher[a])
                higher[a] = running
        parents.append(parent)
        frontiers.append(step)
        reach = step
    if reach[n2][n0] != n1:
        return None
    runs: list[list[tuple[int, int]]] = []
    c2, a2 = n2, n0
    for rank in range(len(parents) - 1, -1, -1):
        c, a = parents[rank][c2][a2]
        runs.append([(a, a2), (frontiers[rank][c][a], frontiers[rank + 1][c2][a2]), (c, c2)])
        c2, a2 = c, a
    runs.reverse()
    runs.extend([(n0, n0), (n1, n1), (n2, n2)] for _ in range(world - len(runs)))
    return runs
