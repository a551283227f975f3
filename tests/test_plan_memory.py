"""The planner's memory model and the memory criterion: bytes per item, the lexicographic objective, the cap.

The bytes per item are checked against the state tensors the per-tensor rules allocate
(``init_state``) and, on gloo ranks, against everything the runtime allocated for a rank's items.
"""

from __future__ import annotations

import math

import pytest
import torch

from ds_canzona.plan import ParamSpec, PlanError, cost_model, lpt_loads, model_specs, plan_dp_partitions
from ds_canzona.plan.dp import MemoryCapError
from ds_canzona.plan.memory import StateMemory, memory_model, state_elements

SHAPES = [(24, 24), (12, 24), (44, 24), (24, 44), (7, 3, 5), (1030, 20), (20, 2100), (5,), (300,)]


def rule(kind: str, **options):
    from ds_canzona.optim import rule_for_group
    group = {"kind": kind, "lr": 1e-3, **options}
    if kind != "adamw":
        group.setdefault("adam_lr", 1e-3)
    return rule_for_group(group)


def allocated_elements(state: dict) -> int:
    return sum(v.numel() for k, v in state.items() if k != "step")


@pytest.mark.parametrize("kind, options", [
    ("muon", {}),
    ("shampoo", {}),
    ("shampoo", {"max_preconditioner_dim": 16}),
    ("soap", {}),
    ("soap", {"max_precond_dim": 30}),
])
def test_state_elements_match_what_the_rules_allocate(kind, options):
    try:
        matrix_rule = rule(kind, **options)
    except (KeyError, ValueError, TypeError) as error:  # pragma: no cover - group keys differ per rule
        pytest.fail(f"cannot build the {kind} rule: {error}")
    adamw = rule("adamw")
    model_options = {"max_preconditioner_dim": v for v in options.values()}
    for shape in SHAPES:
        param = torch.zeros(shape)
        matrix = len(shape) >= 2
        state = (matrix_rule if matrix else adamw).init_state(param)
        spec = ParamSpec(name="p", shape=shape, matrix=matrix)
        assert state_elements(spec, kind, **model_options) == allocated_elements(state), (kind, options, shape)


def test_bytes_per_item_by_dtype():
    spec = ParamSpec(name="w", shape=(8, 4), matrix=True)
    vector = ParamSpec(name="b", shape=(10,), matrix=False)
    # bf16: fp32 master (4) + bf16 gradient segment (2) + Muon momentum (4) per element.
    assert StateMemory(param_bytes=2).bytes(spec) == 32 * 10
    # fp32: the buffer is the master; gradient segment 4 + momentum 4.
    assert StateMemory(param_bytes=4).bytes(spec) == 32 * 8
    # AdamW: two moments.
    assert StateMemory(param_bytes=2).bytes(vector) == 10 * (4 + 2 + 8)
    # Shampoo's factors grow as m² + n²: a 2000 x 10 matrix in blocks of 1024 holds 2·(1024² + 976²) + 4·10².
    shampoo = memory_model("shampoo", param_bytes=4)
    tall = ParamSpec(name="t", shape=(2000, 10), matrix=True)
    assert shampoo.bytes(tall) == 4 * 20000 + 4 * (2 * 20000 + 2 * (1024**2 + 976**2) + 4 * 100)
    with pytest.raises(PlanError, match="optimizer"):
        StateMemory(optimizer="lion")
    with pytest.raises(PlanError, match="param_bytes"):
        StateMemory(param_bytes=3)


def cost_only(plan):
    """Per-rank cost and memory of the cost-only packing of the same items (the planner before memory counted)."""
    from ds_canzona.plan.dp import alpha_balanced
    ranges = [(b.first, b.stop) for b in plan.buckets]
    owner, _ = alpha_balanced([s.numel for s in plan.specs], list(plan.costs), ranges, plan.world_size)
    cost, memory = [0.0] * plan.world_size, [0.0] * plan.world_size
    for item, rank in enumerate(owner):
        cost[rank] += plan.costs[item]
        memory[rank] += plan.memory[item]
    return cost, memory


def test_memory_comes_second_to_the_makespan_on_qwen3_8b():
    """Never slower than the cost-only plan, within 2% of LPT; memory at the target, or below the cost-only plan's."""
    specs = model_specs("qwen3-8b")
    roofline = cost_model("roofline", "muon", machine_balance=150.0)
    for world in (32, 64):
        plan = plan_dp_partitions(specs, world_size=world, bucket_numel=500_000_000, cost=roofline,
                                  split_numel=2**22)
        before_cost, before_memory = cost_only(plan)
        # Within the target at the cost-only plan's makespan: none of MAKESPAN_OVER_COST_ONLY is spent.
        assert max(plan.rank_costs()) <= max(before_cost) * (1 + 1e-9)
        assert max(plan.rank_costs()) <= 1.02 * max(lpt_loads(plan.costs, world))
        average = sum(plan.memory) / world
        # DP 32: 1.14 x the average (1.24 before); DP 64: 1.22 x (3.50 before) at LPT's makespan.
        # (At 10 launches per norm the cost-only plans held 4.60 and 4.61: pricing the norms at
        # their share of CUDA's multi-tensor launches moved where the cost portfolio puts the pieces.)
        assert max(plan.rank_memory()) <= 1.25 * average
        assert max(plan.rank_memory()) < max(before_memory)
        if world == 64:
            assert max(before_memory) > 3 * average


def test_memory_cap_trades_step_time_and_errors_name_the_bound():
    specs = model_specs("qwen3-0.6b")
    kwargs = dict(world_size=16, bucket_numel=500_000_000, split_numel=2**22)
    free = plan_dp_partitions(specs, **kwargs)
    peak = max(free.rank_memory())
    average = sum(free.memory) / 16
    cap = math.ceil((peak + 1.1 * average) / 2)  # between the free plan's peak and 1.1 x the average
    capped = plan_dp_partitions(specs, max_state_bytes_per_rank=cap, **kwargs)
    assert max(capped.rank_memory()) <= cap < peak
    assert max(capped.rank_costs()) >= max(free.rank_costs())  # bought with step time
    assert capped.max_state_bytes_per_rank == cap and capped.digest() != free.digest()
    with pytest.raises(MemoryCapError) as caught:
        plan_dp_partitions(specs, max_state_bytes_per_rank=int(average * 0.9), **kwargs)
    error = caught.value
    assert "max_state_bytes_per_rank=" in str(error) and error.smallest >= average
    assert error.tensor is None and "the average over 16 ranks is" in str(error)
    largest = max(range(len(free.specs)), key=lambda i: free.memory[i])
    with pytest.raises(MemoryCapError, match=r"'model\.embed_tokens\.weight\[0:4194304\]' alone needs") as caught:
        plan_dp_partitions(specs, max_state_bytes_per_rank=int(free.memory[largest]) - 1, world_size=512,
                           bucket_numel=500_000_000, split_numel=2**22)
    assert caught.value.bound == free.memory[largest]


def test_runtime_allocates_what_the_planner_predicted():
    """Masters + optimizer state + gradient segments, measured from the tensors each rank allocated."""
    from distributed import run_ranks
    from zero_workers import allocated_state_bytes, make_config

    scenarios = [
        make_config(2, stage=2, bf16={"enabled": True}, canzona={"split_numel": 500}),
        make_config(2, stage=1, optimizer={"type": "Shampoo", "params": {
            "lr": 0.003, "adam_lr": 0.003, "max_preconditioner_dim": 16}}),
        make_config(2, stage=2, bf16={"enabled": True}, optimizer={"type": "SOAP", "params": {
            "lr": 0.003, "adam_lr": 0.003, "max_precond_dim": 30}}),
        make_config(2, stage=2, canzona={"max_state_bytes_per_rank": 1}),
    ]
    results = run_ranks(allocated_state_bytes, 2, scenarios, timeout=600)
    for rank_results in results:
        *measured, capped = rank_results
        for scenario in measured:
            assert scenario["measured"] == scenario["planned"] == scenario["printed"], scenario
            assert scenario["state"] > 0 and scenario["segments"] > 0
        muon_bf16, shampoo_fp32, soap_bf16 = measured
        assert muon_bf16["masters"] > 0 and soap_bf16["masters"] > 0 and shampoo_fp32["masters"] == 0
        assert "shampoo" in shampoo_fp32["memory_label"] and "soap" in soap_bf16["memory_label"]
        assert capped["error"].startswith("canzona.max_state_bytes_per_rank=1 cannot be met"), capped


def brute_force_optimum(costs: list[float], chains: list[tuple[int, int]], world: int) -> float:
    """Least busiest cost over every owner map that is non-decreasing along each chain."""
    import itertools

    def monotone_maps(length: int):
        return itertools.combinations_with_replacement(range(world), length)

    best = math.inf
    (a, b), (c, d) = chains
    for first in monotone_maps(b - a):
        for second in monotone_maps(d - c):
            loads = [0.0] * world
            for item, rank in zip(range(a, b), first):
                loads[rank] += costs[item]
            for item, rank in zip(range(c, d), second):
                loads[rank] += costs[item]
            best = min(best, max(loads))
    return best


def test_two_chain_optimum_equals_brute_force():
    import random

    from ds_canzona.plan._packing import Problem
    from ds_canzona.plan._two_chains import TOLERANCE, optimal_owner

    rng = random.Random(3)
    for _ in range(25):
        n0, n1, world = rng.randint(1, 5), rng.randint(0, 4), rng.randint(1, 4)
        costs = [float(rng.randint(1, 9)) for _ in range(n0 + n1)]
        chains = [(0, n0), (n0, n0 + n1)] if n1 else [(0, n0)]
        problem = Problem([1] * len(costs), costs, chains, world, [None] * len(chains))
        owner = optimal_owner(problem, sum(costs))
        assert owner is not None
        for first, stop in chains:
            assert owner[first:stop] == sorted(owner[first:stop])
        loads = [0.0] * world
        for item, rank in enumerate(owner):
            loads[rank] += costs[item]
        exact = brute_force_optimum(costs, chains if n1 else [(0, n0), (n0, n0)], world)
        assert exact <= max(loads) <= exact * (1 + 2 * TOLERANCE), (costs, chains, world)


def joint_buckets(plan, specs, bucket_numel):
    """The plan's items bucketed as before tensors in pieces had buckets of their own."""
    from ds_canzona.bench.benchmarks.balance import joint_item_buckets
    from ds_canzona.plan import plan_buckets
    return joint_item_buckets(plan, plan_buckets(specs, bucket_numel))


def test_three_chain_search_equals_brute_force():
    import itertools
    import random

    from ds_canzona.plan._packing import Problem
    from ds_canzona.plan._three_chains import owner_at

    def brute(costs, chains, world):
        best = math.inf
        def maps(n):
            return itertools.combinations_with_replacement(range(world), n)
        for runs in itertools.product(*(list(maps(stop - first)) for first, stop in chains)):
            loads = [0.0] * world
            for (first, stop), ranks in zip(chains, runs):
                for item, rank in zip(range(first, stop), ranks):
                    loads[rank] += costs[item]
            best = min(best, max(loads))
        return best

    rng = random.Random(2)
    for _ in range(60):
        sizes = [rng.randint(1, 4) for _ in range(3)]
        costs = [float(rng.randint(1, 9)) for _ in range(sum(sizes))]
        chains = [(0, sizes[0]), (sizes[0], sizes[0] + sizes[1]), (sizes[0] + sizes[1], sum(sizes))]
        world = rng.randint(1, 3)
        problem = Problem([1] * len(costs), costs, chains, world, [None] * 3)
        exact = brute(costs, chains, world)
        owner = owner_at(problem, [exact * 0.999, exact])
        assert owner is not None and owner_at(problem, [exact * 0.999]) is None
        loads = [0.0] * world
        for item, rank in enumerate(owner):
            loads[rank] += costs[item]
        assert max(loads) <= exact * (1 + 1e-9)
        for first, stop in chains:
            assert owner[first:stop] == sorted(owner[first:stop])


def test_qwen3_0_6b_at_dp128_on_three_buckets():
    """Joint, the two buckets' exact optimum is 0.7% above LPT; split off, a plan at LPT's makespan exists.

    The planner keeps the joint optimum's makespan (0.7% above LPT, within the 2% it allows): the
    exact three-bucket search only runs where no packing is within 2% of LPT. Before the launch
    floor the joint optimum was 3.2% above LPT, and the search found LPT's makespan.
    """
    from ds_canzona.plan._packing import Problem
    from ds_canzona.plan._three_chains import owner_at
    from ds_canzona.plan._two_chains import optimal_owner

    roofline = cost_model("roofline", "muon", machine_balance=150.0)
    specs = model_specs("qwen3-0.6b")
    plan = plan_dp_partitions(specs, world_size=128, bucket_numel=500_000_000, cost=roofline, split_numel=2**22)
    joint = joint_buckets(plan, specs, 500_000_000)
    assert len(joint) == 2 and len(plan.buckets) == 3  # the embedding is split off the first bucket
    problem = Problem([s.numel for s in plan.specs], plan.costs, joint, 128, [None] * 2)
    owner = optimal_owner(problem, sum(plan.costs))
    loads = [0.0] * 128
    for item, rank in enumerate(owner):
        loads[rank] += plan.costs[item]
    lpt = max(lpt_loads(plan.costs, 128))
    assert 1.005 * lpt < max(loads) < 1.01 * lpt
    assert max(plan.rank_costs()) <= max(loads) * (1 + 1e-9)
    three = Problem([s.numel for s in plan.specs], plan.costs, [(b.first, b.stop) for b in plan.buckets], 128,
                    [None] * 3)
    assert owner_at(three, [lpt]) is not None


def test_pieces_get_buckets_of_their_own_and_small_tied_models_meet_the_memory_target():
    """A tensor in pieces is split off its bucket (the other boundaries stay); tied Qwen3 models then even out memory."""
    from ds_canzona.plan import plan_buckets
    from ds_canzona.plan.dp import alpha_balanced

    specs = [ParamSpec(name="embed", shape=(100, 10), matrix=False), ParamSpec(name="w", shape=(10, 10), matrix=True),
             ParamSpec(name="norm", shape=(10,), matrix=False), ParamSpec(name="big", shape=(500,), matrix=False),
             ParamSpec(name="v", shape=(10, 10), matrix=True)]
    assert plan_buckets(specs, 2000) == [(0, 5)]
    assert plan_buckets(specs, 2000, split_numel=300) == [(0, 1), (1, 3), (3, 4), (4, 5)]
    assert plan_buckets(specs, 1150, split_numel=300) == [(0, 1), (1, 3), (3, 4), (4, 5)]
    assert plan_buckets(specs, 1150) == [(0, 3), (3, 5)]
    assert plan_buckets(specs, 2000, split_numel=1000) == [(0, 5)]  # nothing above 1000: nothing moves

    roofline = cost_model("roofline", "muon", machine_balance=150.0)
    # (Qwen3-1.7B at DP=64 met it too before the launch floor; now at 1.266: tests/test_plan_memory_target.py.)
    for name, world in (("qwen3-0.6b", 16), ("qwen3-1.7b", 32), ("qwen3-0.6b", 64)):
        specs = model_specs(name)
        plan = plan_dp_partitions(specs, world_size=world, bucket_numel=500_000_000, cost=roofline,
                                  split_numel=2**22)
        assert plan.specs[plan.buckets[0].stop].name == "model.layers.0.self_attn.q_proj.weight"
        assert max(plan.rank_memory()) <= 1.25 * sum(plan.memory) / world, (name, world, plan.state_bytes_ratio)
        assert max(plan.rank_costs()) <= 1.02 * max(lpt_loads(plan.costs, world))
        # Never slower than the cost-only plan on the buckets as they were (4.6x, 1.37x, 5.1x the average memory).
        before, _ = alpha_balanced([s.numel for s in plan.specs], list(plan.costs),
                                   joint_buckets(plan, specs, 500_000_000), world)
        before_loads = [0.0] * world
        before_memory = [0.0] * world
        for item, rank in enumerate(before):
            before_loads[rank] += plan.costs[item]
            before_memory[rank] += plan.memory[item]
        assert max(plan.rank_costs()) <= max(before_loads) * (1 + 1e-9)
        assert max(before_memory) > 1.3 * sum(plan.memory) / world


def test_three_chain_search_with_a_memory_capacity_equals_brute_force():
    """With a memory capacity as well, the three-chain search finds a plan exactly when one exists."""
    import itertools
    import random

    from ds_canzona.plan._packing import Problem
    from ds_canzona.plan._three_chains import owner_at

    def feasible(costs, memory, chains, world, capacity, memory_capacity):
        def maps(n):
            return itertools.combinations_with_replacement(range(world), n)
        for runs in itertools.product(*(list(maps(stop - first)) for first, stop in chains)):
            loads, held = [0.0] * world, [0.0] * world
            for (first, stop), ranks in zip(chains, runs):
                for item, rank in zip(range(first, stop), ranks):
                    loads[rank] += costs[item]
                    held[rank] += memory[item]
            if max(loads) <= capacity and max(held) <= memory_capacity:
                return True
        return False

    rng = random.Random(5)
    found = 0
    for _ in range(80):
        sizes = [rng.randint(1, 4) for _ in range(3)]
        n = sum(sizes)
        costs = [float(rng.randint(1, 9)) for _ in range(n)]
        memory = [float(rng.randint(1, 9)) for _ in range(n)]
        chains = [(0, sizes[0]), (sizes[0], sizes[0] + sizes[1]), (sizes[0] + sizes[1], n)]
        world = rng.randint(1, 3)
        capacity = float(rng.randint(int(max(costs)), int(sum(costs))))
        memory_capacity = float(rng.randint(int(max(memory)), int(sum(memory))))
        problem = Problem([1] * n, costs, chains, world, [None] * 3)
        owner = owner_at(problem, [capacity], memory=memory, memory_capacity=memory_capacity)
        assert (owner is not None) == feasible(costs, memory, chains, world, capacity, memory_capacity)
        if owner is not None:
            found += 1
            loads, held = [0.0] * world, [0.0] * world
            for item, rank in enumerate(owner):
                loads[rank] += costs[item]
                held[rank] += memory[item]
            assert max(loads) <= capacity and max(held) <= memory_capacity
            for first, stop in chains:
                assert owner[first:stop] == sorted(owner[first:stop])
    assert 10 < found < 70  # both answers are exercised


def test_three_chain_prunes_keep_the_plain_searchs_answer_and_layout():
    """Dropping states the ranks left cannot finish, and extending only to the end at the last rank,
    changes neither whether a capacity is feasible nor the layout found (the brute-force tests above
    are small; these problems are too large for them)."""
    import itertools
    import random

    from ds_canzona.plan._three_chains import _layout

    rng = random.Random(11)
    feasible = 0
    for _ in range(60):
        sizes = [rng.randint(1, 9) for _ in range(3)]
        world = rng.randint(1, 6)
        costs = [[float(rng.randint(1, 20)) for _ in range(n)] for n in sizes]
        memory = [[float(rng.randint(1, 20)) for _ in range(n)] for n in sizes]
        prefixes = [list(itertools.accumulate(chain, initial=0.0)) for chain in costs]
        bytes_prefixes = [list(itertools.accumulate(chain, initial=0.0)) for chain in memory]
        average = sum(p[-1] for p in prefixes) / world
        capacity = average * rng.choice([1.0, 1.05, 1.2, 1.5, 3.0])
        memory_capacity = sum(p[-1] for p in bytes_prefixes) / world * rng.choice([1.0, 1.1, 1.3, 2.0, 10.0])
        pruned = _layout(prefixes, world, capacity, bytes_prefixes, memory_capacity)
        plain = _layout(prefixes, world, capacity, bytes_prefixes, memory_capacity, prune=False)
        assert pruned == plain, (sizes, world, capacity, memory_capacity)
        assert _layout(prefixes, world, capacity) == _layout(prefixes, world, capacity, prune=False)
        feasible += pruned is not None
    assert 10 < feasible < 50  # both answers are exercised


def default_plan(name: str, world: int, ns_method: str = "gram"):
    roofline = cost_model("roofline", "muon", machine_balance=150.0, ns_method=ns_method)
    return plan_dp_partitions(model_specs(name), world_size=world, bucket_numel=500_000_000, cost=roofline,
                              split_numel=2**22)


# Standard pricing held 1.550 when each norm cost 10 launches; at CUDA's multi-tensor share both
# pricings reach the same 1.346, which the exact search below bounds from under within 1%.
@pytest.mark.parametrize("ns_method, planned", [("gram", 1.346), ("standard", 1.346)])
def test_qwen3_0_6b_at_dp128_memory_target_is_out_of_reach_under_the_contract(ns_method, planned):
    """The exact three-bucket search: no plan within 2% of LPT holds under 1.25x the average.

    The planner's busiest memory is within 1% of the least the search finds at that step time
    (the planner bisects the same search on the memory capacity where the target is out of reach).
    """
    from ds_canzona.plan._packing import Problem
    from ds_canzona.plan._three_chains import owner_at

    world = 128
    plan = default_plan("qwen3-0.6b", world, ns_method)
    assert len(plan.buckets) == 3
    problem = Problem([s.numel for s in plan.specs], plan.costs, [(b.first, b.stop) for b in plan.buckets], world,
                      [None] * 3)
    gate = 1.02 * max(lpt_loads(plan.costs, world))  # the most step time the memory criterion may buy
    average = sum(plan.memory) / world
    assert owner_at(problem, [gate], memory=plan.memory, memory_capacity=1.25 * average) is None
    peak = max(plan.rank_memory())
    assert peak / average == pytest.approx(planned, abs=5e-4)
    assert max(plan.rank_costs()) <= gate
    assert owner_at(problem, [gate], memory=plan.memory, memory_capacity=0.99 * peak) is None
    assert owner_at(problem, [gate], memory=plan.memory, memory_capacity=peak) is not None


def most_pieces(bins: int, classes: list[tuple[float, float, int]], piece: tuple[float, float], capacity: float,
                memory_capacity: float) -> int:
    """The most pieces ``bins`` alike ranks hold besides every item of two classes, in any order (exact).

    ``classes``: two (cost, bytes, count) classes that must all be placed; ``piece``: (cost, bytes) of
    one piece. A rank holding x of the first class and y of the second has room for a fixed number
    of pieces; dynamic programming over the ranks maximises their sum with exactly every item placed.
    """
    (cost_a, memory_a, count_a), (cost_b, memory_b, count_b) = classes
    piece_cost, piece_memory = piece
    mixes = []
    for x in range(count_a + 1):
        for y in range(count_b + 1):
            cost, held = x * cost_a + y * cost_b, x * memory_a + y * memory_b
            if cost <= capacity and held <= memory_capacity:
                room = min(math.floor((capacity - cost) / piece_cost), math.floor((memory_capacity - held) / piece_memory))
                mixes.append((x, y, room))
    best = {(0, 0): 0}
    for _ in range(bins):
        reached: dict[tuple[int, int], int] = {}
        for (a, b), pieces in best.items():
            for x, y, room in mixes:
                key = (a + x, b + y)
                if key[0] <= count_a and key[1] <= count_b and reached.get(key, -1) < pieces + room:
                    reached[key] = pieces + room
        best = reached
    return best.get((count_a, count_b), -1)


def test_most_pieces_equals_brute_force():
    import itertools
    import random

    rng = random.Random(3)
    for _ in range(40):
        bins = rng.randint(1, 3)
        classes = [(float(rng.randint(1, 5)), float(rng.randint(1, 5)), rng.randint(0, 3)) for _ in range(2)]
        piece = (float(rng.randint(1, 3)), float(rng.randint(1, 3)))
        capacity, memory_capacity = float(rng.randint(3, 12)), float(rng.randint(3, 12))
        items = [0] * classes[0][2] + [1] * classes[1][2]
        best = -1
        for ranks in itertools.product(range(bins), repeat=len(items)):
            cost, held = [0.0] * bins, [0.0] * bins
            for kind, rank in zip(items, ranks):
                cost[rank] += classes[kind][0]
                held[rank] += classes[kind][1]
            if max(cost) <= capacity and max(held) <= memory_capacity:
                best = max(best, sum(min(math.floor((capacity - c) / piece[0]), math.floor((memory_capacity - h) / piece[1]))
                                     for c, h in zip(cost, held)))
        assert most_pieces(bins, classes, piece, capacity, memory_capacity) == best


@pytest.mark.parametrize("ns_method, planned", [("gram", 1.280), ("standard", 1.397)])
def test_qwen3_1_7b_at_dp128_memory_target_is_out_of_reach_in_any_order(ns_method, planned):
    """A bound in any buffer order: with every MLP rank full, the other ranks cannot hold the pieces.

    Items (the plan's own costs and bytes): MLP matrices (a), q/o projections (b), k/v projections
    (c), embedding pieces (p); norms and the short last piece are dropped (fewer items can only
    make room). At any makespan the memory criterion may buy (at most 2% above LPT), an MLP and a
    q/o or a k/v exceed it in cost and an MLP and a piece exceed 1.25x the average in bytes, so each
    of the 84 MLP ranks holds nothing else; the other 44 hold every b and c and, exactly counted
    (``most_pieces``), fewer pieces than there are.
    """
    world = 128
    plan = default_plan("qwen3-1.7b", world, ns_method)
    by_shape: dict[tuple[int, ...], list[int]] = {}
    for item, spec in enumerate(plan.specs):
        by_shape.setdefault(spec.shape, []).append(item)
    mlp = by_shape[(6144, 2048)] + by_shape[(2048, 6144)]
    qo, kv, pieces = by_shape[(2048, 2048)], by_shape[(1024, 2048)], by_shape[(2**22,)]
    for group in (mlp, qo, kv, pieces):  # each a class of equal items
        assert len({(plan.costs[i], plan.memory[i]) for i in group}) == 1
    (a, b, c, p), (ma, mb, mc, mp) = ((plan.costs[g[0]] for g in (mlp, qo, kv, pieces)),
                                      (plan.memory[g[0]] for g in (mlp, qo, kv, pieces)))
    gate = 1.02 * max(lpt_loads(plan.costs, world))
    average = sum(plan.memory) / world
    target = 1.25 * average
    assert target >= 1.05 * max(plan.memory)
    assert a + min(b, c) > gate and 2 * a > gate and ma + mp > target  # an MLP rank holds only its MLP
    others = world - len(mlp)
    placed = most_pieces(others, [(b, mb, len(qo)), (c, mc, len(kv))], (p, mp), gate, target)
    assert (len(mlp), len(qo), len(kv), len(pieces), others) == (84, 56, 56, 74, 44)
    assert placed < len(pieces), placed
    assert max(plan.rank_costs()) <= gate
    assert max(plan.rank_memory()) / average == pytest.approx(planned, abs=5e-4)
