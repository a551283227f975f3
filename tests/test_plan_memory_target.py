"""The default plan's memory target on every family, both Newton-Schulz pricings, DP 16 to 128.

The target is max(1.25 x the average state bytes, 1.05 x the largest item); the busiest cost must
stay within 2% of unconstrained LPT and at most 2% above the cost-only plan (the planner before
memory counted, on the buckets as they were before tensors in pieces had their own;
``MAKESPAN_OVER_COST_ONLY``, which the planner spends only where memory is off target). The full grid (11
families x 2 pricings x 4 DP sizes) takes about 40 CPU s here; this file plans a subset that still
gives every family every DP size: each Qwen3 model two DP sizes per pricing, rotating, and the other
families the standard pricing at every size (tests/test_plan_hf.py plans them with Gram at every
size). docs/PLANNER.md has the full grid, printed by
``python -m ds_canzona.bench balance --memory --families --ns-methods gram,standard``.

Cells out of reach are not planned here but proven where they are: Qwen3-0.6B and 1.7B at DP=128
in tests/test_plan_memory.py. Llama-3-8B at DP=128 with standard pricing is out of reach at the
cost-only plan's makespan (below) and met with the 2% above it.
"""

from __future__ import annotations

import functools
import json
import math

import pytest

from ds_canzona.plan import (ParamSpec, cost_model, lpt_loads, model_specs, plan_buckets, plan_dp_partitions,
                              specs_from_hf_config)
from ds_canzona.plan._memory_fit import MAKESPAN_OVER_COST_ONLY
from ds_canzona.plan.dp import alpha_balanced

QWEN3 = ("qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b", "qwen3-14b", "qwen3-32b")
OTHERS = ("llama3-8b", "gemma-7b", "gemma2-9b", "qwen2.5-7b", "olmoe-64-experts")
DP_SIZES = (16, 32, 64, 128)
BUCKET = 500_000_000

# Proven out of reach (see the module docstring): not planned in the grid below.
OUT_OF_REACH = {("qwen3-0.6b", "gram", 128), ("qwen3-0.6b", "standard", 128), ("qwen3-1.7b", "gram", 128),
                ("qwen3-1.7b", "standard", 128)}


def _cells() -> list[tuple[str, str, int]]:
    cells = []
    for index, name in enumerate(QWEN3):
        for method, offsets in (("gram", (0, 2)), ("standard", (1, 3))):
            cells += [(name, method, DP_SIZES[(index + offset) % 4]) for offset in offsets]
    cells += [(name, "standard", dp) for name in OTHERS for dp in DP_SIZES]
    cells.append(("qwen3-1.7b", "gram", 64))  # missed at 1.266 before the slack; the rotation skips it
    return [cell for cell in dict.fromkeys(cells) if cell not in OUT_OF_REACH]


@functools.lru_cache(maxsize=None)
def _specs(name: str, folder: str) -> tuple:
    if name in QWEN3:
        return tuple(model_specs(name))
    from pathlib import Path

    from ds_canzona.bench.benchmarks.balance import FAMILY_CONFIGS

    path = Path(folder) / f"{name}.json"
    path.write_text(json.dumps(FAMILY_CONFIGS[name]))
    return tuple(specs_from_hf_config(path))


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("configs"))


def _plan(name: str, method: str, world: int, folder: str):
    specs = _specs(name, folder)
    roofline = cost_model("roofline", "muon", machine_balance=150.0, ns_method=method)  # `ds-canzona plan`'s
    plan = plan_dp_partitions(specs, world_size=world, bucket_numel=BUCKET, cost=roofline, split_numel=2**22)
    return specs, plan


def _cost_only_makespan(specs, plan) -> float:
    """Busiest cost of the cost portfolio on the buckets before tensors in pieces had their own."""
    first_item: dict[int, int] = {}
    for item, (tensor, _, _) in enumerate(plan.pieces):
        first_item.setdefault(tensor, item)
    first_item[len(specs)] = len(plan.specs)
    joint = [(first_item[first], first_item[stop]) for first, stop in plan_buckets(specs, BUCKET)]
    owner, _ = alpha_balanced([s.numel for s in plan.specs], list(plan.costs), joint, plan.world_size)
    loads = [0.0] * plan.world_size
    for item, rank in enumerate(owner):
        loads[rank] += plan.costs[item]
    return max(loads)


@pytest.mark.parametrize("name, method, world", _cells())
def test_memory_target_holds(name, method, world, folder):
    specs, plan = _plan(name, method, world, folder)
    busiest = max(plan.rank_costs())
    assert busiest <= 1.02 * max(lpt_loads(plan.costs, world)) * (1 + 1e-12)
    assert busiest <= (1 + MAKESPAN_OVER_COST_ONLY) * _cost_only_makespan(specs, plan) * (1 + 1e-9)
    average = sum(plan.memory) / world
    target = max(1.25 * average, 1.05 * max(plan.memory))
    assert max(plan.rank_memory()) <= target, plan.state_bytes_ratio


def test_llama3_8b_at_dp128_standard_memory_target_needs_time_above_the_cost_only_plan(folder):
    """At the cost-only plan's makespan, an MLP matrix alone: the other ranks cannot hold the rest under the target.

    With standard Newton-Schulz pricing the cost-only plan's busiest rank is one MLP matrix (LPT's
    too). At that step time every other item costs something, so each of the 96 MLP ranks holds
    its MLP alone; the other 32 hold everything else, on average over 1.25x the average bytes: in
    any order, out of reach. Above it (``MAKESPAN_OVER_COST_ONLY``) the plan meets the target.
    """
    world = 128
    specs, plan = _plan("llama3-8b", "standard", world, folder)
    mlp = [item for item, spec in enumerate(plan.specs) if spec.matrix and ".mlp." in spec.name]
    largest = plan.costs[mlp[0]]
    assert len(mlp) == 96 and len({plan.costs[item] for item in mlp}) == 1
    ceiling = _cost_only_makespan(specs, plan)
    assert ceiling == pytest.approx(largest, rel=1e-12) and max(plan.costs) == largest
    assert min(plan.costs) > 1e-6 * largest  # every item, norms included, pushes an MLP rank over
    others = world - len(mlp)
    rest = sum(memory for item, memory in enumerate(plan.memory) if item not in set(mlp))
    average = sum(plan.memory) / world
    assert rest / others > 1.25 * average and 1.25 * average > 1.05 * max(plan.memory)
    assert rest / others / average == pytest.approx(1.332, abs=5e-4)
    assert ceiling < max(plan.rank_costs()) <= (1 + MAKESPAN_OVER_COST_ONLY) * ceiling * (1 + 1e-9)
    assert max(plan.rank_memory()) <= 1.25 * average


# ---------------------------------------------------- shapes the grid above does not hold (issue 32 item 4)

def _moe_specs(**shape) -> list[ParamSpec]:
    """A MoE whose experts are separate 2-D matrices (one Linear per expert projection), untied head."""
    from ds_canzona.bench.benchmarks.plan_bounds import moe_2d_expert_specs

    return moe_2d_expert_specs(**shape)


def _qwen3_at(*, hidden: int, inter: int, layers: int, heads: int, kv_heads: int) -> list[ParamSpec]:
    """The Qwen3 architecture at sizes no shipped config has (untied, 152k vocabulary)."""
    from ds_canzona.plan import load_model_config, qwen3_specs

    config = dict(load_model_config("qwen3-8b"))
    config.update(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=kv_heads, head_dim=hidden // heads, tie_word_embeddings=False)
    return qwen3_specs(config)


UNSHIPPED = {
    # Before: busiest memory 1.361x the average at DP=128 (target 1.25), every candidate at the
    # budget pouring the embedding's and head's pieces onto too few ranks; the plan a hair above
    # the budget held 1.10x and is now repaired down to it (CostRepair's swaps).
    "moe-16-experts": lambda: _moe_specs(layers=24, hidden=2048, inter=768, experts=16, vocab=151936, heads=32,
                                         kv_heads=4, head_dim=128),
    # Before: busiest cost 1.0202x LPT at DP=64, the best candidate at 1.016x and MAKESPAN_TOLERANCE
    # (0.5%) on top of it, past the 2% bound.
    "qwen3-h5120-i13824-l40": lambda: _qwen3_at(hidden=5120, inter=13824, layers=40, heads=40, kv_heads=8),
}


@pytest.mark.parametrize("name", sorted(UNSHIPPED))
def test_unshipped_shapes_meet_both_bounds_at_dp16_to_128(name):
    """Busiest cost within 2% of LPT, busiest memory within max(1.25 x avg, 1.05 x largest item), DP 16-128."""
    specs = UNSHIPPED[name]()
    roofline = cost_model("roofline", "muon", machine_balance=150.0)  # `ds-canzona plan`'s default
    for world in DP_SIZES:
        plan = plan_dp_partitions(specs, world_size=world, bucket_numel=BUCKET, cost=roofline, split_numel=2**22)
        lpt = max(lpt_loads(plan.costs, world))
        assert max(plan.rank_costs()) <= 1.02 * lpt, (name, world, max(plan.rank_costs()) / lpt)
        average = sum(plan.memory) / world
        target = max(1.25 * average, 1.05 * max(plan.memory))
        assert max(plan.rank_memory()) <= target, (name, world, plan.state_bytes_ratio)


@pytest.mark.parametrize("pricing", ["gram", "standard"])
def test_qwen3_30b_a3b_at_dp64_needs_its_expert_stacks_in_pieces(pricing):
    """Qwen3-30B-A3B's shape (48 layers, 128 experts in 3-D stacks) at DP=64: whole stacks cannot meet
    the memory target within 1.02x LPT; in pieces of whole experts (the default) the plan meets both.

    Whole, its 96 expert stacks (48 ``gate_up_proj``, 48 ``down_proj``) hold most of the bytes.
    Within 1.02x LPT a rank holds at most one gate_up (two are over the capacity) and at most two
    stacks (three downs are over it). Say g ranks hold a gate_up and a down; the other 48 - g
    gate_ups sit alone, and the other 48 - g downs at most two to a rank: g + (48 - g) +
    ceil((48 - g) / 2) ranks, at most 64, so g >= 16. Each of those g ranks holds a gate_up's and
    a down's bytes, 1.256x the average, above the target, in any order of the buffer. Planned in
    pieces of one or two experts (``stack_piece_bounds``), no item is a tenth of a rank.
    """
    from ds_canzona.bench.benchmarks.plan_bounds import SHAPES
    from ds_canzona.plan import StateMemory

    build, shape = SHAPES["qwen3-30b-a3b"]
    specs = build(**shape)
    world = 64
    roofline = cost_model("roofline", "muon", machine_balance=150.0, ns_method=pricing)
    memory = StateMemory()
    plan = plan_dp_partitions(specs, world_size=world, bucket_numel=BUCKET, cost=roofline, split_numel=2**22)
    average = sum(plan.memory) / world
    target = max(1.25 * average, 1.05 * max(plan.memory))
    assert max(plan.memory) < 0.1 * average
    assert max(plan.rank_memory()) <= target
    assert max(plan.rank_costs()) <= 1.02 * max(lpt_loads(plan.costs, world))

    # The same model with its stacks whole: the other items as planned, each stack one item.
    stacks = [spec for spec in specs if spec.name.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert len(stacks) == 96
    others = [i for i, spec in enumerate(plan.specs) if not spec.name.split("[")[0].endswith(
        ("experts.gate_up_proj", "experts.down_proj"))]
    whole_costs = [plan.costs[i] for i in others] + [roofline.cost(spec) for spec in stacks]
    capacity = 1.02 * max(lpt_loads(whole_costs, world))
    gate_up, down = stacks[0], stacks[1]
    assert gate_up.name.endswith("gate_up_proj") and down.name.endswith("down_proj")
    g_cost, d_cost = roofline.cost(gate_up), roofline.cost(down)
    g_bytes, d_bytes = memory.bytes(gate_up), memory.bytes(down)
    assert 2 * g_cost > capacity and 3 * d_cost > capacity and g_cost + d_cost <= capacity
    fewest_pairs = min(g for g in range(49) if g + (48 - g) + math.ceil((48 - g) / 2) <= world)
    assert fewest_pairs == 16
    whole_target = max(1.25 * average, 1.05 * max(g_bytes, d_bytes))
    assert g_bytes + d_bytes > whole_target  # out of reach whole
    assert (g_bytes + d_bytes) / average == pytest.approx(1.2558, abs=5e-4)


def test_hidden_1280_at_dp128_busiest_cost_is_out_of_reach_of_lpt_and_the_plan_is_optimal():
    """A 20-layer Qwen3 at hidden 1280, DP=128, Gram: 1.204x LPT, and no plan does better in this buffer.

    140 matrices on 128 ranks, so at least 12 ranks hold two or more. Within 1.02x LPT only two
    "light" matrices (q_proj, o_proj) share a rank, never three, and two light matrices of one
    bucket are never neighbours in it (k_proj and v_proj, or the MLP, lie between), so a rank's two
    come from two buckets. Two buckets hold matrices and the smaller holds 4 light ones: at most 4
    ranks pair within the capacity, so some rank holds a pair with a heavier matrix, at least a
    light plus the cheapest heavy one. LPT ignores the order and pairs light matrices freely.
    """
    from ds_canzona.bench.benchmarks.plan_bounds import SHAPES

    build, shape = SHAPES["dense-h1280-i3456-l20"]
    world = 128
    roofline = cost_model("roofline", "muon", machine_balance=150.0, ns_method="gram")
    plan = plan_dp_partitions(build(**shape), world_size=world, bucket_numel=BUCKET, cost=roofline, split_numel=2**22)
    lpt = max(lpt_loads(plan.costs, world))
    capacity = 1.02 * lpt
    matrices = [i for i, spec in enumerate(plan.specs) if spec.matrix]
    assert len(matrices) - world == 12
    cheapest = min(plan.costs[i] for i in matrices)
    light = {i for i in matrices if plan.costs[i] + cheapest <= capacity}
    assert {plan.specs[i].name.split(".")[-2] for i in light} == {"q_proj", "o_proj"}
    assert 3 * cheapest > capacity
    heavy_cheapest = min(plan.costs[i] for i in matrices if i not in light)
    with_matrices = []
    for bucket in plan.buckets:
        sequence = [i for i in range(bucket.first, bucket.stop) if plan.specs[i].matrix]
        if sequence:
            with_matrices.append(sum(i in light for i in sequence))
            assert not any(a in light and b in light for a, b in zip(sequence, sequence[1:]))
    assert len(with_matrices) == 2 and min(with_matrices) == 4 < 12
    floor = cheapest + heavy_cheapest
    assert floor / lpt == pytest.approx(1.204, abs=5e-4)
    assert floor <= max(plan.rank_costs()) <= floor * (1 + 1e-9)
