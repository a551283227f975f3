"""Memory after makespan: the second criterion of ``alpha_balanced``, and the hard memory cap.

The objective is lexicographic. First the busiest rank's cost (the step's makespan): the best of
the cost portfolio in ``_packing``, of the "rocks and sand" packings below and, for one or two
buckets, of the exact optimum (``_two_chains``), give or take ``MAKESPAN_TOLERANCE`` (but never
past ``MAKESPAN_OVER_LPT`` above LPT when the best is inside it), and never above the cost
portfolio's own plan. Then, among plans that keep every rank's cost at or under
that makespan C, the smallest busiest-rank memory (bytes of master, optimizer state and gradient
segment, from a ``MemoryModel``). If that memory is above the target (``MEMORY_OVER_AVERAGE`` x
the average, ``MEMORY_OVER_LARGEST`` x the largest item), C may rise to the least value that
reaches it, within ``MAKESPAN_OVER_LPT`` of unconstrained LPT and up to the cost portfolio's plan;
where that does not reach it, up to ``MAKESPAN_OVER_COST_ONLY`` above that plan, kept only if it
reaches it. That plan is the planner's before memory counted: when tensors in pieces have
buckets of their own (``plan_buckets``), the cost portfolio on the joint buckets they had before
(``reference_owner``, a valid plan on the finer buckets too), which also joins the candidates. A
hard cap raises C as far as needed.

Rocks and sand. Matrices are *rocks*: few, lumpy, and they set the makespan. Non-matrix items
(norms, biases and the pieces of embeddings and heads) are *sand*: fine-grained, cheap per byte
under AdamW, and where the memory sits. Sand between two rocks of a bucket may go to any rank
between those rocks' owners (non-decreasing within the run); sand at a bucket's start or end, or
in a bucket with no rock (an embedding in pieces larger than a bucket), has a window reaching rank
0 or R - 1. So, with the rocks placed, the sand is poured: runs in order of their window's width,
each item on the first rank of its window (from its predecessor's rank) with room under both a
cost capacity and a memory capacity. Bisection on the memory capacity, at the cost capacity C,
gives the smallest busiest-rank memory this pouring reaches; bisection on the cost capacity with
no memory limit gives the pouring's makespan (what LPT does with small items: fill the emptiest
ranks). Rocks come from the cost plan itself; from the cost portfolio run on the rocks alone
(also with the first or last ranks kept for the sand at bucket ends); from the portfolio run with
sand merged into grains, weighed by its cost or by its bytes; from the exact two-bucket optimum;
and, when memory misses the target, from the portfolio run on the bytes and on cost plus bytes
blended at a few weights (``BLEND_WEIGHTS``).

A local search (:class:`MemorySearch`) then moves an item off the busiest-memory rank, or swaps
it for a lighter one, within its bucket neighbours' ranks and the element caps, where no rank's
cost goes above C and the busiest memory strictly drops. Where that leaves memory above the
target, the sand is poured again around the rocks as the search left them, and searched again
(``REPOUR_ROUNDS``): a search moves one item at a time, a pouring moves a whole run.

Exchanges (``_free_chains``): the pieces of a tensor alone in its bucket are moved by counts, any
number of them to any rank, against a run of items coming back the other way; where one exchange
would only move the excess, two (an ejection). A plan a little above the makespan whose memory is
good is repaired towards it by the same moves with memory held (:class:`CostRepair`); where memory
is off target at the budget, a plan a hair above the budget that is within target is repaired
down to the budget, with swaps as well.

Under ``alpha < 1`` (element caps per segment) the pouring is skipped: memory is improved by the
local search alone, which respects the caps.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ._chain_beam import MAX_EXPANSIONS as BEAM_EXPANSIONS, beam_owner
from ._free_chains import COST, MEMORY, ChainExchanges
from ._loads import LoadTree
from ._packing import Assignment, LocalSearch, Problem, _assignment, _search_budget, balance
from ._three_chains import owner_at
from ._two_chains import optimal_owner

if TYPE_CHECKING:  # the grid search needs numpy: imported where it runs, so plain planning does not
    from ._chain_grid import WorkBudget

# Relative gap at which a bisection (on the memory or the cost capacity) stops.
FIT_TOLERANCE = 1e-3
# Two loads within this relative distance count as the same makespan (rounding).
SAME_MAKESPAN = 1e-9
# Plans whose makespan is within this fraction of the best one found count as equally fast: memory
# decides among them (a 0.1% faster plan should not win at three times the memory).
MAKESPAN_TOLERANCE = 0.005
# When the busiest rank's memory is above MEMORY_OVER_AVERAGE x the average and MEMORY_OVER_LARGEST
# x the largest item, the makespan may rise, up to MAKESPAN_OVER_LPT above unconstrained LPT on the
# same items and MAKESPAN_OVER_COST_ONLY above the cost portfolio's plan (the planner before memory
# counted), to the least makespan that gets it there.
MEMORY_OVER_AVERAGE = 1.25
MEMORY_OVER_LARGEST = 1.05
MAKESPAN_OVER_LPT = 0.02
# The cost-only plan is a packing heuristic's, not a bound: where it lands at or near LPT's
# makespan, holding the memory criterion to it leaves nothing to buy memory with (Llama-3-8B at
# DP=128: its makespan is one MLP matrix), and a cost model that prices small items lower (AdamW's
# multi-tensor launches on CUDA) tightens it on plans that were within target. A step up to 2%
# slower for a busiest rank that no longer holds 1.3-1.8x the average state is the trade the
# criterion exists for; so step time above the cost-only plan is spent only where it reaches the
# target or cuts the busiest memory by MEMORY_WORTH_BUYING (where it does neither, a hundredth of
# a percent less memory is not worth 0.7% of a step: Qwen3-0.6B at DP=128), and MAKESPAN_OVER_LPT
# still bounds it, so no plan is further above LPT than before. 1% met the target in 82 of the 88
# cells of docs/PLANNER.md's grid, 2% in 84 (the other four proven out of reach).
MAKESPAN_OVER_COST_ONLY = 0.02
# The least fraction of the busiest memory a plan above the cost-only plan must save where the
# target stays out of reach. Shapes outside the shipped grid showed what reaching the target
# alone left behind: a 24-layer Qwen3 at hidden 1536, DP=64, stayed at 2.40x the average bytes
# (eight pieces of the head on one rank) where 1.7% more step time gives 1.26x; a 16-layer MoE with
# 2-D experts at hidden 1024, 3.34x where 0.7% gives 1.34x, the least any plan holds there
# (``python -m ds_canzona.bench plan-bounds``).
MEMORY_WORTH_BUYING = 0.10
# When memory misses the target, rocks also come from the cost portfolio run on cost + w x bytes
# (bytes in cost units: an average rank's bytes weigh an average rank's cost), for each w here.
BLEND_WEIGHTS = (0.1, 0.25, 0.5, 1.0, 2.0, 4.0)
# Where memory is still off target at the budget: rocks from the plans at these fractions above
# it, the sand poured again around them at the budget. At the budget the search reaches a plan
# whose rocks fit but whose sand does not; a hair looser, the rocks land elsewhere (Qwen3-1.7B at
# DP=64: a plan 0.007% over the makespan at 1.08x the average memory, its rocks under the makespan).
LOOSER_ROCKS = (FIT_TOLERANCE, 10 * FIT_TOLERANCE)
# Bisection steps of the exact three-bucket search under the memory target (0.4-0.5 s each on
# Qwen3-0.6B at DP=64): the makespan found is within 1/16 of the way from the best to the budget.
THREE_CHAIN_STEPS = 4
# The exact chain-grid search (``_chain_grid``) on buffers of other than three buckets: bisection
# steps under the memory target (each 0.1-3 s where the grid is large: a 24-layer Qwen3 at hidden
# 2048, DP=64, five buckets), and the (frontier cell, run combination) pairs all its searches in
# one plan may extend (about 20 million a second here), so that no plan waits long on it.
GRID_STEPS = 2
GRID_PAIRS = 150_000_000
# Where every candidate is above the LPT target: the capacities (x LPT's makespan) the chain-prefix
# beam (``_chain_beam``) is asked for, in order, up to the target.
BEAM_CAPACITIES = (1.0, 1.01, 1.0 + MAKESPAN_OVER_LPT)
# Rounds of pouring the sand again around the rocks a memory search has moved.
REPOUR_ROUNDS = 2
# Sand worth less than this fraction of an average rank (in cost and in memory) cannot change
# either criterion much: the rock-only portfolio is not run for it (it keeps large inputs fast).
SAND_WORTH_PACKING = 0.25
# Sand is planned for cost in grains of about this fraction of an average rank's cost.
GRAIN_FRACTION = 0.1


@dataclass(frozen=True, kw_only=True)
class FitResult:
    """The chosen owners, their busiest cost and memory."""

    owner: list[int]
    makespan: float
    peak_memory: float


class _Pouring:
    """Sand poured around fixed rocks: the runs, their windows, and the rocks' loads.

    With ``rockless_only``, only the sand of buckets that hold no rock (a tensor in pieces) is
    poured; the sand between rocks stays where ``rock_owner`` has it, as if it were rock.
    """

    def __init__(self, problem: Problem, memory: Sequence[float], sand: Sequence[bool], rock_owner: Sequence[int],
                 *, rockless_only: bool = False):
        self.problem, self.memory = problem, memory
        world = problem.world
        self.base_owner = list(rock_owner)
        self.rock_cost = [0.0] * world
        self.rock_memory = [0.0] * world
        runs: list[tuple[int, int, int, list[int]]] = []
        for first, stop in problem.buckets:
            # Sand kept in place counts as rock here.
            pour_sand = not rockless_only or all(sand[item] for item in range(first, stop))
            previous_rank = 0
            run: list[int] = []
            for item in range(first, stop):
                if pour_sand and sand[item]:
                    run.append(item)
                    continue
                rank = rock_owner[item]
                self.rock_cost[rank] += problem.costs[item]
                self.rock_memory[rank] += memory[item]
                if run:
                    runs.append((rank - previous_rank, run[0], previous_rank, run))
                    run = []
                previous_rank = rank
            if run:
                runs.append((world - 1 - previous_rank, run[0], previous_rank, run))
        # Narrow windows first: a wide run can go elsewhere, a narrow one cannot.
        runs.sort(key=lambda entry: (entry[0], entry[1]))
        self.runs = [(low, low + width, run) for width, _, low, run in runs]

    def pour(self, cost_capacity: float, memory_capacity: float) -> tuple[list[int], bool]:
        """Owners with the sand placed, and whether every rank stayed within both capacities."""
        costs, memory = self.problem.costs, self.memory
        owner = list(self.base_owner)
        cost, mem = list(self.rock_cost), list(self.rock_memory)
        cost_room = cost_capacity * (1.0 + SAME_MAKESPAN)
        fits = max(cost) <= cost_room and max(mem) <= memory_capacity
        for low, high, run in self.runs:
            rank = low
            for item in run:
                c, m = costs[item], memory[item]
                while rank < high and not (cost[rank] + c <= cost_room and mem[rank] + m <= memory_capacity):
                    rank += 1
                if not (cost[rank] + c <= cost_room and mem[rank] + m <= memory_capacity):
                    fits = False
                owner[item] = rank
                cost[rank] += c
                mem[rank] += m
        return owner, fits

    def fewest_memory(self, cost_capacity: float, lower: float) -> list[int] | None:
        """The pouring at (close to) the smallest memory capacity that fits under ``cost_capacity``."""
        infinite = float("inf")
        owner, fits = self.pour(cost_capacity, infinite)
        if not fits:
            return None
        best = owner
        high = max(_loads(self.problem.world, owner, self.memory))
        low = max(lower, max(self.rock_memory))
        while high > low * (1.0 + FIT_TOLERANCE):
            middle = (low + high) / 2.0
            owner, fits = self.pour(cost_capacity, middle)
            if fits:
                best, high = owner, max(_loads(self.problem.world, owner, self.memory))
            else:
                low = middle
        return best

    def fewest_cost(self, lower: float) -> list[int]:
        """The pouring at (close to) the smallest cost capacity, with no memory limit."""
        infinite = float("inf")
        best, _ = self.pour(infinite, infinite)
        high = max(_loads(self.problem.world, best, self.problem.costs))
        low = max(lower, max(self.rock_cost))
        while high > low * (1.0 + FIT_TOLERANCE / 10):
            middle = (low + high) / 2.0
            owner, fits = self.pour(middle, infinite)
            if fits:
                best, high = owner, max(_loads(self.problem.world, owner, self.problem.costs))
            else:
                low = middle
        return best


class MemorySearch(ChainExchanges, LocalSearch):
    """Lower the busiest rank's memory by moves, swaps and free-chain exchanges that keep every cost within ``capacity``."""

    def __init__(self, problem: Problem, assignment: Assignment, memory: Sequence[float], capacity: float,
                 budget: int, chains: Sequence[tuple[int, int]] = (), goal: float = 0.0) -> None:
        super().__init__(problem, assignment, budget)
        self.memory = memory
        self.capacity = capacity * (1.0 + SAME_MAKESPAN)
        # Two-step exchanges (ejections) cost many single ones: tried only above this memory.
        self.goal = goal
        self.memory_loads = LoadTree.from_loads(_loads(problem.world, assignment.owner, memory))
        # ``chains``: tensors in pieces alone in a bucket, re-partitioned by counts (exchanges).
        self.track_chains(chains)

    def run(self) -> None:
        while self.budget > 0:
            busiest = self.memory_loads.busiest()
            if not (self._best_memory_move(busiest) or self._best_memory_swap(busiest)
                    or self.best_exchange(busiest, MEMORY, self.capacity)
                    or (self.memory_loads.max_load() > self.goal and self.ejection(busiest, MEMORY, self.capacity))):
                return

    def _best_memory_move(self, busiest: int) -> bool:
        # Plain lists of the loads: nothing moves until the best move is chosen.
        loads, mem = self.state.loads.loads(), self.memory_loads.loads()
        costs, memory = self.problem.costs, self.memory
        top = mem[busiest]
        improving = top * (1.0 - 1e-12)
        best: tuple[float, int, int] | None = None
        for item in self.on_rank[busiest]:
            low, high = self._window(item)
            if low == high:
                continue
            # The budget counts every rank of the window, scanned or not: the bound below only
            # skips scans that cannot win, so the search (and its answer) is the unpruned one.
            self.budget -= high - low + 1
            item_memory = memory[item]
            # No rank of the window ends below its least memory plus the item: skip the window
            # when even that peak would not improve on the best move so far.
            bound = max(top - item_memory, self.memory_loads.min_in(low, high) + item_memory)
            if bound >= improving or (best is not None and bound > best[0]):
                continue
            for rank in range(low, high + 1):
                peak = max(top - item_memory, mem[rank] + item_memory)
                if not (peak < improving and (best is None or (peak, item, rank) < best)):
                    continue
                if rank == busiest or loads[rank] + costs[item] > self.capacity or not self._fits(item, rank):
                    continue
                best = (peak, item, rank)
        if best is None:
            return False
        _, item, rank = best
        self._move(item, busiest, rank)
        return True

    def _best_memory_swap(self, busiest: int) -> bool:
        # Plain lists of the loads: nothing moves until the best swap is chosen.
        loads, mem = self.state.loads.loads(), self.memory_loads.loads()
        costs, memory, owner, capacity = self.problem.costs, self.memory, self.state.owner, self.capacity
        top = mem[busiest]
        busiest_load = loads[busiest]
        best: tuple[float, int, int] | None = None
        for item in self.on_rank[busiest]:
            low, high = self._window(item)
            item_memory, item_cost = memory[item], costs[item]
            for rank in range(low, high + 1):
                rank_memory = mem[rank]
                gap = top - rank_memory
                if rank == busiest or gap <= 0.0:
                    continue
                rank_load = loads[rank]
                self.budget -= len(self.on_rank[rank])
                for other in self.on_rank[rank]:
                    delta = item_memory - memory[other]
                    if not 0.0 < delta < gap:
                        continue
                    shift = item_cost - costs[other]
                    if rank_load + shift > capacity or busiest_load - shift > capacity:
                        continue
                    peak = max(top - delta, rank_memory + delta)
                    if best is not None and (peak, item, other) >= best:
                        continue
                    owner[item], owner[other] = rank, busiest
                    valid = self._monotone(item) and self._monotone(other) and self._swap_fits(item, other)
                    owner[item], owner[other] = busiest, rank
                    if valid:
                        best = (peak, item, other)
            if self.budget <= 0:
                break
        if best is None:
            return False
        _, item, other = best
        rank = owner[other]
        self._move(item, busiest, rank)
        self._move(other, rank, busiest)
        return True

    def _move(self, param: int, source: int, target: int) -> None:
        super()._move(param, source, target)
        self.memory_loads.add(source, -self.memory[param])
        self.memory_loads.add(target, self.memory[param])
        self.count_move(param, source, target)


class CostRepair(ChainExchanges, LocalSearch):
    """Lower the busiest rank's cost, keeping every rank's memory within ``memory_capacity``.

    The memory search's dual, for a plan that holds memory well but sits a little above the
    makespan: moves of one item within its window, and exchanges of free-chain pieces; with
    ``swaps``, also swaps of two items (the cost search's, with memory held).
    """

    def __init__(self, problem: Problem, assignment: Assignment, memory: Sequence[float], memory_capacity: float,
                 budget: int, chains: Sequence[tuple[int, int]], swaps: bool = False) -> None:
        super().__init__(problem, assignment, budget)
        self.memory = memory
        self.memory_capacity = memory_capacity
        # Swaps too (``_best_capped_swap``): only where memory is off target at the budget. At the
        # makespan a repair that succeeds more often ends the search on the first plan within target,
        # before the rocks placed for memory are tried, and those can hold less.
        self.swaps = swaps
        self.memory_loads = LoadTree.from_loads(_loads(problem.world, assignment.owner, memory))
        self.track_chains(chains)

    def run_to(self, goal: float) -> None:
        while self.budget > 0 and self.state.loads.max_load() > goal:
            busiest = self.state.loads.busiest()
            if not (self._best_capped_move(busiest) or (self.swaps and self._best_capped_swap(busiest))
                    or self.best_exchange(busiest, COST, self.memory_capacity)):
                return

    def _best_capped_move(self, busiest: int) -> bool:
        loads, mem = self.state.loads.loads(), self.memory_loads.loads()
        costs, memory = self.problem.costs, self.memory
        top = loads[busiest]
        best: tuple[float, int, int] | None = None
        for item in self.on_rank[busiest]:
            low, high = self._window(item)
            self.budget -= high - low + 1
            for rank in range(low, high + 1):
                if rank == busiest or mem[rank] + memory[item] > self.memory_capacity or not self._fits(item, rank):
                    continue
                peak = max(top - costs[item], loads[rank] + costs[item])
                if peak < top * (1.0 - 1e-12) and (best is None or (peak, item, rank) < best):
                    best = (peak, item, rank)
        if best is None:
            return False
        _, item, rank = best
        self._move(item, busiest, rank)
        return True

    def _best_capped_swap(self, busiest: int) -> bool:
        # The cost search's swap, where neither rank's memory ends above the capacity.
        loads, mem = self.state.loads.loads(), self.memory_loads.loads()
        costs, memory, owner = self.problem.costs, self.memory, self.state.owner
        top, busiest_memory = loads[busiest], mem[busiest]
        best: tuple[float, int, int] | None = None
        for item in self.on_rank[busiest]:
            low, high = self._window(item)
            for rank in range(low, high + 1):
                gap = top - loads[rank]
                if rank == busiest or gap <= 0.0:
                    continue
                self.budget -= len(self.on_rank[rank])
                for other in self.on_rank[rank]:
                    delta = costs[item] - costs[other]
                    if not 0.0 < delta < gap:
                        continue
                    shift = memory[item] - memory[other]
                    if mem[rank] + shift > self.memory_capacity or busiest_memory - shift > self.memory_capacity:
                        continue
                    peak = max(top - delta, loads[rank] + delta)
                    if best is not None and (peak, item, other) >= best:
                        continue
                    owner[item], owner[other] = rank, busiest
                    valid = self._monotone(item) and self._monotone(other) and self._swap_fits(item, other)
                    owner[item], owner[other] = busiest, rank
                    if valid:
                        best = (peak, item, other)
            if self.budget <= 0:
                break
        if best is None:
            return False
        _, item, other = best
        rank = owner[other]
        self._move(item, busiest, rank)
        self._move(other, rank, busiest)
        return True

    def _move(self, param: int, source: int, target: int) -> None:
        super()._move(param, source, target)
        self.memory_loads.add(source, -self.memory[param])
        self.memory_loads.add(target, self.memory[param])
        self.count_move(param, source, target)


def fit(problem: Problem, memory: Sequence[float], sand: Sequence[bool], cost_owner: list[int],
        *, memory_cap: float | None = None, reference_owner: list[int] | None = None,
        chains: Sequence[tuple[int, int]] = ()) -> FitResult:
    """The lexicographic plan: least makespan, then least busiest memory (see the module docstring).

    With ``memory_cap``, a plan over the cap is not accepted: the makespan is raised (bisection on
    the cost capacity) until one fits. Raises ``MemoryCapUnreachable`` if none does. ``chains``:
    the item ranges of tensors in pieces, each alone in its bucket (see ``_free_chains``).
    """
    world = problem.world
    candidates = [cost_owner]
    rock_plans = [cost_owner]
    # The planner's step time before memory counted: the cost-only plan on the joint buckets when
    # given (valid here too), else on these.
    ceiling_owner = cost_owner
    if reference_owner is not None:
        candidates.append(reference_owner)
        rock_plans.append(reference_owner)
        ceiling_owner = reference_owner
    total_memory = sum(memory)
    memory_bound = max(total_memory / world, max(memory, default=0.0))
    rocks = [item for item, is_sand in enumerate(sand) if not is_sand]
    pourable = not problem.capped and rocks and len(rocks) < len(sand)
    if pourable and _sand_matters(problem, memory, sand):
        rock_plans.append(_rocks_alone(problem, rocks))
        for lead, trail in _kept_ranks(problem, sand):
            rock_plans.append(_rocks_alone(problem, rocks, lead=lead, trail=trail))
        grained = _grained(problem, sand, GRAIN_FRACTION * sum(problem.costs) / world)
        rock_plans.append(grained)
        candidates.append(grained)
        # Sand weighed by its bytes, in cost units (an average rank's bytes weigh an average rank's cost).
        exchange = sum(problem.costs) / total_memory if total_memory > 0 else 0.0
        rock_plans.append(_grained(problem, sand, GRAIN_FRACTION * sum(problem.costs) / world,
                                   [exchange * m for m in memory]))
    # One or two buckets (small models): the exact optimum of the busiest cost is cheap; it joins in.
    exact = optimal_owner(problem, min(_max_load(world, owner, problem.costs) for owner in candidates))
    if exact is not None:
        candidates.append(exact)
        rock_plans.append(exact)
    pourings = [_Pouring(problem, memory, sand, owner) for owner in rock_plans] if pourable else []
    for pouring in pourings:
        candidates.append(_polished(problem, pouring.fewest_cost(problem.lower_bound())))
    lpt_makespan = _lpt_makespan(problem.costs, world)
    grid_work: list[WorkBudget] = []  # the grid searches' budget, made by the first (``_grid_owner``)
    over_lpt_target = (1.0 + MAKESPAN_OVER_LPT) * lpt_makespan
    if min(_max_load(world, owner, problem.costs) for owner in candidates) > over_lpt_target:
        # Three buckets (a small tied model, its embedding split off) and no packing within the
        # target: the exact search, at LPT's makespan or at the target.
        three = owner_at(problem, [lpt_makespan, (1.0 + MAKESPAN_OVER_LPT) * lpt_makespan])
        if three is not None:
            candidates.append(three)
            if pourable:
                pourings.append(_Pouring(problem, memory, sand, three))
                candidates.append(_polished(problem, pourings[-1].fewest_cost(problem.lower_bound())))
        # More buckets: the beam over chain prefixes, at LPT's makespan or up to the target.
        left = BEAM_EXPANSIONS
        for factor in BEAM_CAPACITIES:
            beamed, spent = beam_owner(problem, factor * lpt_makespan, chains, budget=left)
            left -= spent
            if beamed is not None:
                candidates.append(beamed)
                if pourable:
                    pourings.append(_Pouring(problem, memory, sand, beamed))
                break
            if left <= 0:
                break
        # Still none within the target: the exact search over a few chains (``_chain_grid``), where
        # the buffer, its alike pieces laid end to end, is few enough chains.
        if min(_max_load(world, owner, problem.costs) for owner in candidates) > over_lpt_target:
            for factor in BEAM_CAPACITIES:
                gridded = _grid_owner(problem, memory, factor * lpt_makespan, math.inf, grid_work)
                if gridded is not None:
                    candidates.append(gridded)
                    if pourable:
                        pourings.append(_Pouring(problem, memory, sand, gridded))
                    break
    # The makespan: the best found (give or take MAKESPAN_TOLERANCE), never above the cost
    # portfolio's own plan; up to the budget if that buys memory down to the target (see the
    # module docstring and MAKESPAN_OVER_COST_ONLY).
    best_makespan = min(_max_load(world, owner, problem.costs) for owner in candidates)
    portfolio_makespan = _max_load(world, ceiling_owner, problem.costs)
    over_lpt = (1.0 + MAKESPAN_OVER_LPT) * lpt_makespan
    # The tolerance never carries the plan past the LPT bound the best candidate is inside (a
    # Qwen3-architecture model at hidden 5120 and DP=64: best 1.016x LPT, 1.0202x with the 0.5%).
    # Divided by SAME_MAKESPAN: plans are accepted that far above a capacity.
    makespan = min(portfolio_makespan, best_makespan * (1.0 + MAKESPAN_TOLERANCE),
                   max(best_makespan, over_lpt / (1.0 + SAME_MAKESPAN)))
    strict_budget = min(portfolio_makespan, max(makespan, over_lpt))
    budget = min((1.0 + MAKESPAN_OVER_COST_ONLY) * portfolio_makespan, max(makespan, over_lpt))
    loosest_budget = budget
    memory_target = max(MEMORY_OVER_AVERAGE * total_memory / world,
                        MEMORY_OVER_LARGEST * max(memory, default=0.0))
    # Where the search is worth its two-step exchanges: above the target, or the cap if lower.
    goal = memory_target if memory_cap is None else min(memory_target, memory_cap)
    if pourable:
        # Plans a little slower than the makespan may get there without giving up their memory.
        for owner in list(candidates):
            if makespan * (1.0 + SAME_MAKESPAN) < _max_load(world, owner, problem.costs) \
                    <= makespan * (1.0 + MAKESPAN_TOLERANCE):
                assignment = _assignment(problem, list(owner))
                repair = CostRepair(problem, assignment, memory, max(_max_load(world, owner, memory), memory_target),
                                    budget=_memory_budget(problem), chains=chains)
                repair.run_to(makespan)
                if assignment.loads.max_load() <= makespan * (1.0 + SAME_MAKESPAN):
                    candidates.append(assignment.owner)

    def best_at(capacity: float) -> tuple[list[int], float]:
        room = capacity * (1.0 + SAME_MAKESPAN)
        options = [owner for owner in candidates if _max_load(world, owner, problem.costs) <= room]
        for pouring in pourings:
            poured = pouring.fewest_memory(capacity, memory_bound)
            if poured is not None:
                options.append(poured)
        chosen: tuple[float, list[int]] | None = None
        for owner in options:
            for _ in range(REPOUR_ROUNDS + 1 if pourable and not problem.capped else 1):
                assignment = _assignment(problem, list(owner))
                search = MemorySearch(problem, assignment, memory, capacity, budget=_memory_budget(problem), chains=chains,
                                      goal=goal)
                search.run()
                key = (search.memory_loads.max_load(), assignment.owner)
                if chosen is None or key < chosen:
                    chosen = key
                if key[0] <= memory_target:
                    break
                # The search moved rocks: pour the sand again around them.
                owner = _Pouring(problem, memory, sand, assignment.owner).fewest_memory(capacity, memory_bound)
                if owner is None:
                    break
        assert chosen is not None
        return chosen[1], chosen[0]

    added: list[bool] = []

    def add_memory_rocks() -> None:
        """Rocks from the cost portfolio run on the bytes, and on cost and bytes blended (once)."""
        if added or problem.capped:
            return
        added.append(True)
        memory_rocks = balance(problem.numels, memory, problem.buckets, world, 1.0)
        candidates.append(memory_rocks)
        if pourable:
            pourings.append(_Pouring(problem, memory, sand, memory_rocks))
        exchange = sum(problem.costs) / total_memory if total_memory > 0 else 0.0
        for weight in BLEND_WEIGHTS:
            blend = [c + weight * exchange * m for c, m in zip(problem.costs, memory)]
            blended = balance(problem.numels, blend, problem.buckets, world, 1.0)
            candidates.append(blended)
            if pourable:
                pourings.append(_Pouring(problem, memory, sand, blended))

    owner, peak = best_at(makespan)
    if peak > memory_target:
        # Off target: rocks placed for memory may pour better at the same makespan.
        add_memory_rocks()
        owner, peak = best_at(makespan)

    def bought(budget: float, owner: list[int], peak: float) -> tuple[list[int], float]:
        """Memory bought with step time up to ``budget``: the least makespan that reaches the target, else
        the least memory found at the budget (``owner``, ``peak``: the plan at the makespan)."""
        if peak > memory_target and budget > makespan * (1.0 + FIT_TOLERANCE):
            # Buy memory with step time, within the budget: the least makespan that reaches the target,
            # or, if none does, the budget's own plan when it holds less memory.
            loose, loose_peak = best_at(budget)
            if loose_peak < peak:
                low, high = makespan, budget
                owner, peak = loose, loose_peak
                while loose_peak <= memory_target and high > low * (1.0 + FIT_TOLERANCE):
                    middle = (low + high) / 2.0
                    trial, trial_peak = best_at(middle)
                    if trial_peak <= memory_target:
                        owner, peak, high = trial, trial_peak, middle
                    else:
                        low = middle
        if peak > memory_target and pourable:
            # Still off target: rocks placed at a slightly looser makespan, with the sand poured again
            # around them at the budget (see ``LOOSER_ROCKS``).
            for looser in LOOSER_ROCKS:
                rocks_owner, rocks_peak = best_at(budget * (1.0 + looser))
                if rocks_peak <= memory_target:
                    # Within the target a hair above the budget: moves, swaps and exchanges with every
                    # rank's memory held under the target may bring it down to the budget (a 16-expert
                    # MoE at DP=128: 1.36x the average at the budget, 1.10x at 0.1% above it and 1.021x
                    # LPT; repaired to 1.0197x LPT at 1.14x). The pouring below cannot: it keeps the rocks.
                    assignment = _assignment(problem, list(rocks_owner))
                    repair = CostRepair(problem, assignment, memory, memory_target, budget=_memory_budget(problem),
                                        chains=chains, swaps=True)
                    repair.run_to(budget)
                    if assignment.loads.max_load() <= budget * (1.0 + SAME_MAKESPAN):
                        owner, peak = assignment.owner, repair.memory_loads.max_load()
                        break
                poured = _Pouring(problem, memory, sand, rocks_owner, rockless_only=True).fewest_memory(budget, memory_bound)
                if poured is None:
                    continue
                assignment = _assignment(problem, poured)
                search = MemorySearch(problem, assignment, memory, budget, budget=_memory_budget(problem), chains=chains,
                                      goal=goal)
                search.run()
                if search.memory_loads.max_load() < peak:
                    owner, peak = assignment.owner, search.memory_loads.max_load()
                if peak <= memory_target:
                    break
        if peak > memory_target and len(problem.buckets) != 3 and not problem.capped \
                and budget >= loosest_budget:
            # Other bucket counts: the exact search over a few chains (``_chain_grid``) with the
            # memory target as a second capacity, at the loosest budget (it covers the stricter one:
            # the bisection goes down to the makespan) and bisected down ``GRID_STEPS``. Where it
            # finds none, the plan stays as it is (none may exist in this order).
            high_owner = _grid_owner(problem, memory, budget, memory_target, grid_work)
            if high_owner is not None:
                high_owner, high = _bisected_down(
                    lambda capacity: _grid_owner(problem, memory, capacity, memory_target, grid_work),
                    makespan, budget, high_owner, GRID_STEPS)
                candidates.append(high_owner)
                owner, peak = best_at(high)
        if peak > memory_target and len(problem.buckets) == 3 and not problem.capped:
            # Three buckets (a small tied model): the exact search with the memory target as a second
            # capacity, at the makespan, else at the budget bisected down (``THREE_CHAIN_STEPS``).
            high_owner = owner_at(problem, [makespan], memory=memory, memory_capacity=memory_target)
            low, high = makespan, makespan
            if high_owner is None and budget > makespan:
                high_owner = owner_at(problem, [budget], memory=memory, memory_capacity=memory_target)
                high = budget
            if high_owner is not None:
                high_owner, high = _bisected_down(
                    lambda capacity: owner_at(problem, [capacity], memory=memory, memory_capacity=memory_target),
                    low, high, high_owner, THREE_CHAIN_STEPS)
                candidates.append(high_owner)
                owner, peak = best_at(high)
            else:
                # Out of reach at the budget: the least memory the search finds there, bisected on the
                # memory capacity between the target and the plan so far.
                floor_memory, ceiling_memory = memory_target, peak
                for _ in range(THREE_CHAIN_STEPS):
                    middle = (floor_memory + ceiling_memory) / 2.0
                    trial = owner_at(problem, [budget], memory=memory, memory_capacity=middle)
                    if trial is None:
                        floor_memory = middle
                    else:
                        high_owner, ceiling_memory = trial, middle
                if high_owner is not None:
                    candidates.append(high_owner)
                    owner, peak = best_at(budget)
        return owner, peak

    # Step time up to the cost-only plan first, as much as that buys; above it (MAKESPAN_OVER_COST_ONLY),
    # only a plan within the target is worth it, the least makespan that gets there.
    at_makespan = (owner, peak)
    owner, peak = bought(strict_budget, owner, peak)
    if peak > memory_target and budget > strict_budget * (1.0 + SAME_MAKESPAN):
        reached, reached_peak = bought(budget, *at_makespan)
        if reached_peak <= memory_target or reached_peak <= (1.0 - MEMORY_WORTH_BUYING) * peak:
            owner, peak = reached, reached_peak
    if memory_cap is None or peak <= memory_cap:
        return FitResult(owner=owner, makespan=_max_load(world, owner, problem.costs), peak_memory=peak)

    # Over the cap: trade step time for memory, bisecting on the cost capacity between the
    # makespan and no limit at all.
    add_memory_rocks()
    unlimited = sum(problem.costs) + 1.0
    owner, peak = best_at(unlimited)
    if peak > memory_cap:
        raise MemoryCapUnreachable(owner=owner, peak_memory=peak)
    low, high = makespan, _max_load(world, owner, problem.costs)
    while high > low * (1.0 + FIT_TOLERANCE):
        middle = (low + high) / 2.0
        trial, trial_peak = best_at(middle)
        if trial_peak <= memory_cap:
            owner, peak, high = trial, trial_peak, _max_load(world, trial, problem.costs)
        else:
            low = middle
    return FitResult(owner=owner, makespan=_max_load(world, owner, problem.costs), peak_memory=peak)


class MemoryCapUnreachable(Exception):
    """No plan the packers find keeps every rank under the memory cap; the best one found."""

    def __init__(self, *, owner: list[int], peak_memory: float) -> None:
        super().__init__(f"busiest-rank memory {peak_memory:g} over the cap")
        self.owner = owner
        self.peak_memory = peak_memory


def _bisected_down(search: Callable[[float], list[int] | None], low: float, high: float, owner: list[int],
                   steps: int) -> tuple[list[int], float]:
    """``owner`` (found at cost capacity ``high``) and ``high``, moved down by ``steps`` bisection
    steps towards ``low`` while ``search`` still finds owners (none where ``high`` is not above ``low``)."""
    for _ in range(steps if high > low else 0):
        middle = (low + high) / 2.0
        trial = search(middle)
        if trial is None:
            low = middle
        else:
            owner, high = trial, middle
    return owner, high


def _grid_owner(problem: Problem, memory: Sequence[float], capacity: float, memory_capacity: float,
                work: list[WorkBudget]) -> list[int] | None:
    """Owners from the exact chain-grid search on the buffer's restricted chains, every rank within
    both capacities; None where there are none or the search is too large for them or for the
    plan's budget. ``work`` holds that budget, made on the first search (``GRID_PAIRS``): the
    search needs numpy, so a plan that never asks for one does not import it."""
    if problem.capped:
        return None
    from ._chain_grid import WorkBudget, chain_layout, restricted_chains

    if not work:
        work.append(WorkBudget(GRID_PAIRS))
    layout = chain_layout(restricted_chains(problem.buckets, problem.costs, memory, problem.world),
                          problem.costs, memory, problem.world, capacity, memory_capacity, budget=work[0])
    if not isinstance(layout, dict):
        return None
    return [layout[item] for item in range(len(problem.costs))]


def _polished(problem: Problem, owner: list[int]) -> list[int]:
    """``owner`` after the cost portfolio's local search: a pouring's busiest rank, lowered where a move or swap can."""
    assignment = _assignment(problem, owner)
    LocalSearch(problem, assignment, budget=_search_budget(problem)).run()
    return assignment.owner


def _rocks_alone(problem: Problem, rocks: list[int], *, lead: int = 0, trail: int = 0) -> list[int]:
    """Owners of the rocks from the cost portfolio run on the rocks alone (sand left at rank 0).

    With ``lead`` (``trail``), the rocks use only ranks ``lead .. R - 1 - trail``: the first (last)
    ranks are kept for the sand ahead of (behind) the rocks of a bucket, which can go nowhere else.
    """
    position = {item: index for index, item in enumerate(rocks)}
    buckets = []
    for first, stop in problem.buckets:
        inside = [position[item] for item in range(first, stop) if item in position]
        if inside:
            buckets.append((inside[0], inside[-1] + 1))
    rock_owner = balance([problem.numels[i] for i in rocks], [problem.costs[i] for i in rocks], buckets,
                         problem.world - lead - trail, 1.0)
    owner = [0] * len(problem.numels)
    for index, item in enumerate(rocks):
        owner[item] = rock_owner[index] + lead
    return owner


def _kept_ranks(problem: Problem, sand: Sequence[bool]) -> list[tuple[int, int]]:
    """(lead, trail) rank counts worth keeping for the sand at the ends of buckets that hold rocks.

    Sand ahead of a bucket's first rock can only go to ranks up to that rock's owner (behind its
    last rock, from that owner on); the counts tried are what that sand's cost fills, rounded
    down and up.
    """
    costs, world = problem.costs, problem.world
    average = sum(costs) / world
    ahead = behind = 0.0
    for first, stop in problem.buckets:
        rocks = [item for item in range(first, stop) if not sand[item]]
        if not rocks:
            continue
        ahead += sum(costs[first:rocks[0]])
        behind += sum(costs[rocks[-1] + 1:stop])
    options: set[tuple[int, int]] = set()
    for lead in {int(ahead // average), int(-(-ahead // average))} if ahead > 0 else {0}:
        for trail in {int(behind // average), int(-(-behind // average))} if behind > 0 else {0}:
            if (lead or trail) and lead + trail < world:
                options.add((lead, trail))
    return sorted(options)


def _grained(problem: Problem, sand: Sequence[bool], grain_cost: float,
             weights: Sequence[float] | None = None) -> list[int]:
    """Owners from the cost portfolio run with each sand run merged into grains of about ``grain_cost``.

    Fewer, larger sand items keep the geometry honest (sand ahead of a bucket's first rock pushes
    that rock to a later rank, leaving room to pour into) at a fraction of the items. ``weights``
    replaces the sand's costs in that packing (the rocks keep theirs): sand weighed by its memory
    makes the packing leave room for the sand's bytes, not only for its cost.
    """
    numels = problem.numels
    costs = [w if s else c for w, c, s in zip(weights, problem.costs, sand)] if weights is not None else problem.costs
    groups: list[list[int]] = []  # consecutive items planned as one
    buckets = []
    for first, stop in problem.buckets:
        start = len(groups)
        grain: list[int] = []
        grain_total = 0.0
        for item in range(first, stop):
            if not sand[item]:
                if grain:
                    groups.append(grain)
                    grain, grain_total = [], 0.0
                groups.append([item])
                continue
            if grain and grain_total + costs[item] > grain_cost:
                groups.append(grain)
                grain, grain_total = [], 0.0
            grain.append(item)
            grain_total += costs[item]
        if grain:
            groups.append(grain)
        buckets.append((start, len(groups)))
    group_owner = balance([sum(numels[i] for i in group) for group in groups],
                          [sum(costs[i] for i in group) for group in groups], buckets, problem.world, 1.0)
    owner = [0] * len(numels)
    for group, rank in zip(groups, group_owner):
        for item in group:
            owner[item] = rank
    return owner


def _sand_matters(problem: Problem, memory: Sequence[float], sand: Sequence[bool]) -> bool:
    world = problem.world
    sand_cost = sum(c for c, s in zip(problem.costs, sand) if s)
    sand_memory = sum(m for m, s in zip(memory, sand) if s)
    return (sand_cost > SAND_WORTH_PACKING * sum(problem.costs) / world
            or sand_memory > SAND_WORTH_PACKING * sum(memory) / world)


def _lpt_makespan(costs: Sequence[float], world: int) -> float:
    """Busiest load of unconstrained LPT (largest first onto the least-loaded rank)."""
    heap = [(0.0, rank) for rank in range(world)]
    for cost in sorted(costs, reverse=True):
        load, rank = heapq.heappop(heap)
        heapq.heappush(heap, (load + cost, rank))
    return max(load for load, _ in heap)


def _loads(world: int, owner: Sequence[int], values: Sequence[float]) -> list[float]:
    loads = [0.0] * world
    for item, rank in enumerate(owner):
        loads[rank] += values[item]
    return loads


def _max_load(world: int, owner: Sequence[int], values: Sequence[float]) -> float:
    return max(_loads(world, owner, values))


def _memory_budget(problem: Problem) -> int:
    return 200_000 + 20 * len(problem.numels)
