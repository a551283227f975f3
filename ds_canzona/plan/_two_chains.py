"""The exact busiest-cost optimum when the buffer is one or two buckets (small models).

With two chains, rank r's share is a contiguous run of each, the runs in rank order. Which
(chain 0, chain 1) prefixes the first r ranks can cover under a capacity C is a staircase: for
each chain-0 prefix i, the longest chain-1 prefix f(i) reachable. One more rank extends every
state (i, f(i)) by a chain-0 run that fits under C and the longest chain-1 run that fits in what is
left; a state with less of both than another is dropped (fewer items left is never harder). C is
feasible iff (n0, n1) is reached within R ranks; bisection on C gives the optimum to
``TOLERANCE``, which is what the packers' heuristics are measured against for such models (and,
where it is above unconstrained LPT, the bound the geometry sets).

Cost: O(R · n0 · w · log n1) per capacity, w the chain-0 items one rank can hold; the planner
runs it only on small inputs (``MAX_WORK``).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence

from ._packing import Problem

# Relative gap at which the bisection on the capacity stops.
TOLERANCE = 1e-4
# Above this many (chain-0 item, rank) pairs the exact search is not run.
MAX_WORK = 60_000


def optimal_owner(problem: Problem, high: float) -> list[int] | None:
    """Owners at (within ``TOLERANCE`` of) the least busiest cost, given a feasible ``high``; None if not applicable."""
    chains = problem.buckets
    if problem.capped or not 1 <= len(chains) <= 2:
        return None
    first = chains[0]
    second = chains[1] if len(chains) == 2 else (first[1], first[1])
    if (first[1] - first[0] + 1) * problem.world > MAX_WORK:
        return None
    costs = problem.costs
    prefix0 = list(itertools.accumulate(costs[first[0]:first[1]], initial=0.0))
    prefix1 = list(itertools.accumulate(costs[second[0]:second[1]], initial=0.0))
    low = problem.lower_bound()
    best = _layout(prefix0, prefix1, problem.world, high * (1.0 + 1e-12))
    if best is None:
        return None
    while high > low * (1.0 + TOLERANCE):
        middle = (low + high) / 2.0
        layout = _layout(prefix0, prefix1, problem.world, middle)
        if layout is None:
            low = middle
        else:
            best, high = layout, middle
    owner = [0] * len(costs)
    for rank, (run0, run1) in enumerate(best):
        for item in range(*run0):
            owner[first[0] + item] = rank
        for item in range(*run1):
            owner[second[0] + item] = rank
    return owner


def _layout(prefix0: Sequence[float], prefix1: Sequence[float], world: int,
            capacity: float) -> list[tuple[tuple[int, int], tuple[int, int]]] | None:
    """Per rank, its (chain-0 run, chain-1 run), or None if ``capacity`` is infeasible."""
    n0, n1 = len(prefix0) - 1, len(prefix1) - 1
    reach = [-1] * (n0 + 1)
    reach[0] = 0
    parents: list[list[int]] = []
    frontiers = [reach]
    for _ in range(world):
        step = [-1] * (n0 + 1)
        parent = [-1] * (n0 + 1)
        for i in range(n0 + 1):
            j = reach[i]
            if j < 0:
                continue
            last = bisect.bisect_right(prefix0, prefix0[i] + capacity) - 1
            for k in range(i, last + 1):
                room = capacity - (prefix0[k] - prefix0[i])
                reached = bisect.bisect_right(prefix1, prefix1[j] + room) - 1
                if reached > step[k]:
                    step[k], parent[k] = reached, i
        # Drop dominated states: another with at least as much of both chains.
        most = -1
        for k in range(n0, -1, -1):
            if step[k] <= most:
                step[k] = -1
            else:
                most = step[k]
        parents.append(parent)
        frontiers.append(step)
        reach = step
        if reach[n0] == n1:
            break
    if reach[n0] != n1:
        return None
    runs: list[tuple[tuple[int, int], tuple[int, int]]] = []
    k = n0
    for rank in range(len(parents) - 1, -1, -1):
        i = parents[rank][k]
        runs.append(((i, k), (frontiers[rank][i], frontiers[rank + 1][k])))
        k = i
    runs.reverse()
    runs.extend(((n0, n0), (n1, n1)) for _ in range(world - len(runs)))
    return runs
