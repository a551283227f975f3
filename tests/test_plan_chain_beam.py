"""The chain-prefix beam (``ds_canzona.plan._chain_beam``) on two buffers every other packer left above 1.02x LPT."""

from __future__ import annotations

import functools

import pytest

from ds_canzona.plan import cost_model, lpt_loads, plan_dp_partitions
from ds_canzona.plan._chain_beam import beam_owner
from ds_canzona.plan._packing import Problem

BUCKET = 500_000_000


@functools.lru_cache(maxsize=None)
def _plan(shape: str, pricing: str, world: int):
    from ds_canzona.bench.benchmarks.plan_bounds import SHAPES

    build, arguments = SHAPES[shape]
    roofline = cost_model("roofline", "muon", machine_balance=150.0, ns_method=pricing)
    return plan_dp_partitions(build(**arguments), world_size=world, bucket_numel=BUCKET, cost=roofline,
                              split_numel=2**22)


def _problem(plan) -> Problem:
    return Problem([s.numel for s in plan.specs], list(plan.costs), [(b.first, b.stop) for b in plan.buckets],
                   plan.world_size, [None] * len(plan.buckets))


def _valid(owner: list[int], problem: Problem) -> bool:
    """Every item owned by a rank, owners non-decreasing inside each bucket (the start-index geometry)."""
    if len(owner) != len(problem.costs) or not all(0 <= rank < problem.world for rank in owner):
        return False
    return all(owner[i] <= owner[i + 1] for first, stop in problem.buckets for i in range(first, stop - 1))


def test_tied_hidden_2048_at_dp64_is_planned_within_the_lpt_target():
    """16 layers, hidden 2048, intermediate 8192, tied, DP=64, Gram: 1.077x LPT before the beam."""
    plan = _plan("dense-h2048-i8192-l16-tied", "gram", 64)
    lpt = max(lpt_loads(plan.costs, 64))
    assert max(plan.rank_costs()) <= 1.02 * lpt
    assert max(plan.rank_costs()) / lpt == pytest.approx(1.0008, abs=5e-4)


def test_olmoe_16_experts_at_dp32_meets_both_targets():
    """OLMoE architecture, 16 experts as 3-D stacks, hidden 1024, DP=32, standard: 1.084x LPT before the beam."""
    pytest.importorskip("transformers")
    plan = _plan("olmoe16-h1024-i512-l16", "standard", 32)
    lpt = max(lpt_loads(plan.costs, 32))
    assert max(plan.rank_costs()) <= 1.02 * lpt
    average = sum(plan.memory) / 32
    assert max(plan.rank_memory()) <= max(1.25 * average, 1.05 * max(plan.memory))


def test_beam_owner_is_a_valid_plan_within_the_capacity_and_deterministic():
    plan = _plan("dense-h2048-i8192-l16-tied", "gram", 64)
    problem = _problem(plan)
    lpt = max(lpt_loads(plan.costs, 64))
    in_pieces = [(b.first, b.stop) for b in plan.buckets if "[" in plan.specs[b.first].name]
    assert in_pieces, "the tied embedding is planned in pieces, alone in its bucket"
    owner, spent = beam_owner(problem, lpt, in_pieces)
    assert owner is not None and spent > 0
    assert _valid(owner, problem)
    loads = [0.0] * 64
    for item, rank in enumerate(owner):
        loads[rank] += plan.costs[item]
    assert max(loads) <= lpt * (1 + 1e-12)
    assert beam_owner(problem, lpt, in_pieces)[0] == owner


def test_beam_owner_finds_nothing_below_the_average_or_past_its_budget():
    plan = _plan("dense-h2048-i8192-l16-tied", "gram", 64)
    problem = _problem(plan)
    average = sum(plan.costs) / 64
    assert beam_owner(problem, 0.99 * average)[0] is None
    lpt = max(lpt_loads(plan.costs, 64))
    owner, spent = beam_owner(problem, lpt, budget=10)
    assert owner is None and spent > 10
