"""Exact feasibility of a buffer of a few buckets under a cost and a memory capacity.

Rank r's share of the buffer is a contiguous run of every bucket (a chain of items in buffer
order), the runs in rank order. Which prefixes of the chains the first r ranks can cover with
every rank within a cost capacity C and a memory capacity M is a set closed downwards: covering
less of every chain is never harder, since a run inside another costs and holds no more. This
module keeps that set as a grid over the prefixes of every chain but the longest, each cell
holding the longest prefix of that one (the *greedy* chain) reached with it, -1 where none is.
One more rank extends every cell by runs of the grid's chains (every combination of run lengths
one rank can hold, as whole-grid array operations) and the longest greedy run that fits in what
is left under both capacities; the result is closed downwards again (a running maximum from the
far end of every axis). The capacities are feasible iff the far corner reaches the greedy
chain's end within R ranks.

Where ``_two_chains`` and ``_three_chains`` walk their states in Python, this keeps the grid as
numpy arrays and extends only its frontier (the cells no other dominates), every combination at
once. Its size is the product of the grid chains' lengths (plus one), so it serves buffers of a
few chains (``MAX_GRID``), and a chain here is a list of *units* (items that go to one rank
together): ``relaxed_chains`` and ``restricted_chains`` shrink the buffer first, laying buckets of
alike pieces (an embedding and an untied head) end to end as one chain and dropping or joining
the items too small to matter. It answers both ways: a layout (and so a plan) when the
capacities are feasible, and, when they are not, the proof that no layout of these chains has
every rank within them (for the relaxed chains: no plan in the buffer's order).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# Above this many grid cells (the grid chains' prefixes) the search is not run.
MAX_GRID = 400_000
# Above this many grid cells over all ranks (the layouts kept to walk back) the search is not run.
MAX_HISTORY = 40_000_000
# Above this many run-length combinations per rank the search is not run (chains of many small
# items: 2-D experts by the hundred let one rank hold dozens of each, and the combinations multiply).
MAX_COMBINATIONS = 20_000
# (frontier cell, run-length combination) pairs extended at once.
CHUNK = 1 << 20
# Slack on both capacities, so that rounding in the prefix sums does not drop a run on the boundary.
SLACK = 1e-12


Unit = tuple[int, ...]  # items that go to one rank together, consecutive in their bucket


@dataclass
class WorkBudget:
    """(frontier cell, run-length combination) pairs a caller lets its searches extend, in all."""

    pairs: int


def chain_layout(chains: Sequence[Sequence[Unit]], costs: Sequence[float], memory: Sequence[float], world: int,
                 capacity: float, memory_capacity: float, *,
                 budget: WorkBudget | None = None) -> dict[int, int] | None | bool:
    """Owners with every rank within ``capacity`` (cost) and ``memory_capacity`` (bytes), if any.

    ``chains``: per chain, its units in order (``bucket_chains``, ``relaxed_chains``,
    ``restricted_chains``). Returns the owner of every item in a unit when a layout exists,
    ``False`` when none does (no layout of these chains has every rank within both capacities),
    and ``None`` when the grid is over ``MAX_GRID``, the grids of all ranks over ``MAX_HISTORY`` or
    the work over what is left of ``budget`` (not decided; the work done is taken off ``budget``
    either way, so a caller's searches stay within it and every rank plans the same).
    """
    chains = [list(chain) for chain in chains if chain]
    if not chains:
        return {}
    capacity *= 1.0 + SLACK
    memory_capacity *= 1.0 + SLACK
    unit_cost = [[sum(costs[i] for i in unit) for unit in chain] for chain in chains]
    unit_bytes = [[sum(memory[i] for i in unit) for unit in chain] for chain in chains]
    if any(c > capacity for chain in unit_cost for c in chain) or \
            any(m > memory_capacity for chain in unit_bytes for m in chain):
        return False
    greedy = max(range(len(chains)), key=lambda b: (len(chains[b]), -b))
    grid = [b for b in range(len(chains)) if b != greedy]
    shape = tuple(len(chains[b]) + 1 for b in grid)
    cells = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if cells > MAX_GRID:
        return None

    def prefix(values: Sequence[float]) -> np.ndarray:
        return np.concatenate(([0.0], np.cumsum(np.asarray(values, dtype=np.float64))))

    cost_g, bytes_g = prefix(unit_cost[greedy]), prefix(unit_bytes[greedy])
    n_g = len(chains[greedy])
    cost_p = [prefix(unit_cost[b]) for b in grid]
    bytes_p = [prefix(unit_bytes[b]) for b in grid]
    combos = _run_combinations(cost_p, bytes_p, capacity, memory_capacity)
    if combos is None:
        return None
    # The grid is padded beyond every chain's end by the longest run on its axis, at infinite cost:
    # a run past the end then fails the capacity test like any other, with no bounds to check.
    padding = [max(combo[axis] for combo in combos) for axis in range(len(shape))]
    padded = tuple(n + pad for n, pad in zip(shape, padding))
    if int(np.prod(padded, dtype=np.int64)) * world > MAX_HISTORY:
        return None
    strides = [int(np.prod(padded[axis + 1:], dtype=np.int64)) for axis in range(len(shape))]
    offsets = np.asarray([sum(d * stride for d, stride in zip(combo, strides)) for combo in combos], dtype=np.int64)
    total_cost = float(cost_g[-1]) + sum(float(p[-1]) for p in cost_p)
    total_bytes = float(bytes_g[-1]) + sum(float(q[-1]) for q in bytes_p)
    if total_cost > world * capacity or total_bytes > world * memory_capacity:
        return False
    # Covered cost and bytes of every grid cell's grid-chain prefixes (the greedy chain's added per cell).
    beyond = [np.full(pad, np.inf) for pad in padding]
    grid_cost = _outer_sum([np.concatenate((p, tail)) for p, tail in zip(cost_p, beyond)], padded)
    grid_bytes = _outer_sum([np.concatenate((q, tail)) for q, tail in zip(bytes_p, beyond)], padded)
    shape = padded
    reach = np.full(shape, -1, dtype=np.int32)
    reach[(0,) * len(shape)] = 0
    history = [reach]
    corner = tuple(len(p) - 1 for p in cost_p)
    while len(history) <= world and reach[corner] < n_g:
        ranks_left = world - (len(history) - 1)
        sources = _frontier(reach)
        if budget is not None:
            budget.pairs -= len(sources) * len(combos)
            if budget.pairs < 0:
                return None
        step = _extend(reach, sources, offsets, grid_cost, grid_bytes, cost_g, bytes_g, capacity,
                       memory_capacity, _floor(total_cost, ranks_left - 1, capacity),
                       _floor(total_bytes, ranks_left - 1, memory_capacity))
        step = _close_downwards(step)
        history.append(step)
        reach = step
    if reach[corner] < n_g:
        return False
    grid_runs, greedy_ends = _walk_back(history, combos, cost_p, bytes_p, cost_g, bytes_g, capacity, memory_capacity)
    owner: dict[int, int] = {}
    for axis, b in enumerate(grid):
        for rank, (start, end) in enumerate(grid_runs):
            for unit in chains[b][start[axis]:end[axis]]:
                owner.update((item, rank) for item in unit)
    covered = 0
    for rank, end in enumerate(greedy_ends):
        for unit in chains[greedy][covered:max(covered, end)]:
            owner.update((item, rank) for item in unit)
        covered = max(covered, end)
    return owner


def bucket_chains(buckets: Sequence[tuple[int, int]]) -> list[list[Unit]]:
    """The buffer as it is: every bucket a chain, every item a unit."""
    return [[(item,) for item in range(first, stop)] for first, stop in buckets]


def relaxed_chains(buckets: Sequence[tuple[int, int]], costs: Sequence[float], memory: Sequence[float],
                   world: int, negligible: float = 1e-3) -> list[list[Unit]]:
    """Chains whose every layout within the capacities follows from one of the buffer's: a smaller search.

    Items under ``negligible`` of an average rank in both cost and bytes are left out (a plan
    without them is no busier). Then the buckets whose items are all alike, and alike across
    them (an embedding and an untied head in pieces: the same piece, bar the last), are laid
    end to end: alike items go anywhere among themselves, so their order costs nothing, and one
    chain of them is exactly as free as several. A bucket whose last piece is smaller has that
    piece left out first (it holds less than the rest). So where these chains have no layout
    within the capacities, the buffer has none.
    """
    kept = _kept(buckets, costs, memory, world, negligible)
    chains: list[list[Unit]] = []
    pools: dict[tuple[float, float], list[Unit]] = {}
    for items in kept:
        alike = _alike_pieces(items, costs, memory)
        if alike is not None and (costs[items[-1]], memory[items[-1]]) != alike:
            items = items[:-1]  # a smaller last piece: left out
        if alike is not None:
            pools.setdefault(alike, []).extend((item,) for item in items)
        elif items:
            chains.append([(item,) for item in items])
    return chains + [pool for _, pool in sorted(pools.items())]


def restricted_chains(buckets: Sequence[tuple[int, int]], costs: Sequence[float], memory: Sequence[float],
                      world: int, negligible: float = 1e-3) -> list[list[Unit]]:
    """Chains whose every layout is a plan of the buffer: a smaller search that may miss some plans.

    Items under ``negligible`` of an average rank in both cost and bytes go with the item before
    them in their bucket (the first ones with the item after). Buckets of alike pieces (as in
    ``relaxed_chains``, last pieces included) are laid end to end: a run across the join is the
    end of one bucket and the start of the next, each in rank order.
    """
    chains: list[list[Unit]] = []
    pools: dict[tuple[float, float], list[Unit]] = {}
    average_cost = sum(costs) / world
    average_bytes = sum(memory) / world
    for first, stop in buckets:
        units: list[list[int]] = []
        pending: list[int] = []
        for item in range(first, stop):
            small = costs[item] <= negligible * average_cost and memory[item] <= negligible * average_bytes
            if small and units:
                units[-1].append(item)
            elif small:
                pending.append(item)
            else:
                units.append(pending + [item])
                pending = []
        if pending:
            units.append(pending)
        alike = _alike_pieces(list(range(first, stop)), costs, memory)
        if alike is not None:
            pools.setdefault(alike, []).extend(tuple(unit) for unit in units)
        elif units:
            chains.append([tuple(unit) for unit in units])
    return chains + [pool for _, pool in sorted(pools.items())]


def _kept(buckets, costs, memory, world, negligible) -> list[list[int]]:
    average_cost = sum(costs) / world
    average_bytes = sum(memory) / world
    return [[item for item in range(first, stop)
             if costs[item] > negligible * average_cost or memory[item] > negligible * average_bytes]
            for first, stop in buckets]


def _alike_pieces(items: Sequence[int], costs: Sequence[float], memory: Sequence[float]) -> tuple[float, float] | None:
    """(cost, bytes) of the pieces when ``items`` are alike pieces (all the same, or, three or more,
    all but a last one that costs and holds no more), else None."""
    if not items:
        return None
    key = (costs[items[0]], memory[items[0]])
    body = items[:-1] if len(items) >= 3 else items
    if any((costs[i], memory[i]) != key for i in body):
        return None
    last = items[-1]
    return key if costs[last] <= key[0] and memory[last] <= key[1] else None


def _floor(total: float, ranks: int, capacity: float) -> float:
    """The least a cell must cover for ``ranks`` more ranks, each within ``capacity``, to cover ``total``.

    The slack keeps rounding in the prefix sums (added in another order than ``total``) from
    dropping a cell on the boundary."""
    if ranks == 0:
        return total * (1.0 - 1e-9)
    if capacity == float("inf"):
        return -float("inf")
    return total - ranks * capacity - 1e-9 * (total + ranks * capacity)


def _run_combinations(cost_p: Sequence[np.ndarray], bytes_p: Sequence[np.ndarray], capacity: float,
                      memory_capacity: float) -> list[tuple[int, ...]] | None:
    """Every combination of run lengths (one per grid chain) some rank may hold within both
    capacities; None past ``MAX_COMBINATIONS`` (chains of many small items: the search would not
    finish in reasonable time or memory)."""
    cheapest: list[list[tuple[float, float]]] = []
    for p, q in zip(cost_p, bytes_p):
        n = len(p) - 1
        lengths = [(0.0, 0.0)]
        for d in range(1, n + 1):
            least_cost = float(np.min(p[d:] - p[:-d]))
            least_bytes = float(np.min(q[d:] - q[:-d]))
            if least_cost > capacity or least_bytes > memory_capacity:
                break
            lengths.append((least_cost, least_bytes))
        cheapest.append(lengths)
    found: list[tuple[int, ...]] = []

    def extend(chain: int, cost: float, held: float, lengths: list[int]) -> bool:
        if chain == len(cheapest):
            found.append(tuple(lengths))
            return len(found) <= MAX_COMBINATIONS
        for d, (c, m) in enumerate(cheapest[chain]):
            if cost + c > capacity or held + m > memory_capacity:
                break
            lengths.append(d)
            going = extend(chain + 1, cost + c, held + m, lengths)
            lengths.pop()
            if not going:
                return False
        return True

    return found if extend(0, 0.0, 0.0, []) else None


def _outer_sum(prefixes: Sequence[np.ndarray], shape: tuple[int, ...]) -> np.ndarray:
    total = np.zeros(shape, dtype=np.float64)
    for axis, prefix in enumerate(prefixes):
        total = total + prefix.reshape([-1 if a == axis else 1 for a in range(len(shape))])
    return total


def _close_downwards(step: np.ndarray) -> np.ndarray:
    """Every cell gets the most of any cell at or beyond it on every axis."""
    for axis in range(step.ndim):
        step = np.flip(np.maximum.accumulate(np.flip(step, axis), axis=axis), axis)
    return step


def _frontier(reach: np.ndarray) -> np.ndarray:
    """Flat indices of the cells no other cell dominates (more of some chain, no less of any)."""
    undominated = reach >= 0
    for axis in range(reach.ndim):
        beyond = np.full(reach.shape, -1, dtype=reach.dtype)
        inner = [slice(None)] * reach.ndim
        outer = [slice(None)] * reach.ndim
        inner[axis], outer[axis] = slice(0, -1), slice(1, None)
        beyond[tuple(inner)] = reach[tuple(outer)]
        undominated &= reach > beyond
    return np.flatnonzero(undominated)


def _extend(reach: np.ndarray, sources: np.ndarray, offsets: np.ndarray, grid_cost: np.ndarray,
            grid_bytes: np.ndarray, cost_g: np.ndarray, bytes_g: np.ndarray, capacity: float, memory_capacity: float,
            cost_floor: float, bytes_floor: float) -> np.ndarray:
    """The cells one more rank reaches from ``sources``, ``reach``'s frontier (not yet closed downwards).

    The frontier's cells are the only sources worth extending: from a dominated cell, the runs
    reach no cell that the runs from the cell dominating it do not dominate. All sources and all
    run-length combinations (``offsets``: each one's step in the flat grid) at once, in chunks of
    ``CHUNK`` pairs.
    """
    step = np.full(reach.size, -1, dtype=np.int32)
    flat_reach = reach.reshape(-1)
    flat_cost = grid_cost.reshape(-1)
    flat_bytes = grid_bytes.reshape(-1)
    with_memory = memory_capacity != np.inf
    per_chunk = max(1, CHUNK // max(1, len(offsets)))
    for begin in range(0, len(sources), per_chunk):
        chunk = sources[begin:begin + per_chunk]
        target = chunk[:, None] + offsets[None, :]
        room = capacity - (flat_cost[target] - flat_cost[chunk][:, None])
        ok = room >= 0.0
        if with_memory:
            memory_room = memory_capacity - (flat_bytes[target] - flat_bytes[chunk][:, None])
            ok &= memory_room >= 0.0
        # Only the pairs within both capacities go on (most combinations of long runs do not).
        row, column = np.nonzero(ok)
        target = target[row, column]
        room = room[row, column]
        start_g = flat_reach[chunk[row]].astype(np.int64)
        reached = np.searchsorted(cost_g, cost_g[start_g] + room, side="right") - 1
        if with_memory:
            memory_room = memory_room[row, column]
            by_bytes = np.searchsorted(bytes_g, bytes_g[start_g] + memory_room, side="right") - 1
            reached = np.minimum(reached, by_bytes)
        reached = np.maximum(reached, start_g)
        # A cell the ranks left cannot finish, even filled to both capacities, leads nowhere.
        finishing = flat_cost[target] + cost_g[reached] >= cost_floor
        if with_memory:
            finishing &= flat_bytes[target] + bytes_g[reached] >= bytes_floor
        np.maximum.at(step, target[finishing], reached[finishing].astype(np.int32))
    return step.reshape(reach.shape)


def _walk_back(history: list[np.ndarray], combos, cost_p, bytes_p, cost_g, bytes_g, capacity: float,
               memory_capacity: float) -> tuple[list[tuple[tuple[int, ...], tuple[int, ...]]], list[int]]:
    """From the far corner back to the origin: per rank its grid-chain runs (start and end cells)
    and the end of its greedy run (its start is where the rank before ended, or earlier)."""
    target_grid = tuple(len(p) - 1 for p in cost_p)
    target_g = len(cost_g) - 1
    grid_runs: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    greedy_ends: list[int] = []
    for rank in range(len(history) - 1, 0, -1):
        before = history[rank - 1]
        chosen = None
        for combo in combos:
            source = tuple(t - d for t, d in zip(target_grid, combo))
            if any(s < 0 for s in source):
                continue
            b = int(before[source])
            if b < 0:
                continue
            end_g = max(b, target_g)
            run_cost = sum(float(p[t] - p[s]) for p, s, t in zip(cost_p, source, target_grid))
            run_cost += float(cost_g[end_g] - cost_g[b])
            run_bytes = sum(float(q[t] - q[s]) for q, s, t in zip(bytes_p, source, target_grid))
            run_bytes += float(bytes_g[end_g] - bytes_g[b])
            if run_cost <= capacity and run_bytes <= memory_capacity:
                chosen = (source, b, end_g)
                break
        # A cell closed downwards from one the step reached has a source one rank back (the
        # module docstring): the runs to it lie inside the runs to the cell it was closed from.
        assert chosen is not None, "a reached cell has a source one rank back"
        source, b, end_g = chosen
        grid_runs.append((source, target_grid))
        greedy_ends.append(end_g)
        target_grid, target_g = source, b
    assert all(s == 0 for s in target_grid) and target_g == 0
    grid_runs.reverse()
    greedy_ends.reverse()
    return grid_runs, greedy_ends
