"""DP partition planner: invariants over random inputs, the alpha blend, and balance on Qwen3."""

from __future__ import annotations

import functools
import json
import os
import random
import subprocess
import sys

import pytest

from ds_canzona.plan import (
    DEFAULT_SPLIT_NUMEL,
    DPPlan,
    ParamSpec,
    PlanError,
    cost_model,
    lpt_loads,
    model_specs,
    piece_bounds,
    plan_buckets,
    plan_dp_partitions,
    shard_for_tp,
)

STRATEGIES = ("alpha_balanced", "start_index", "uniform")


def random_specs(rng: random.Random, count: int) -> list[ParamSpec]:
    specs = []
    for index in range(count):
        kind = rng.random()
        if kind < 0.3:
            shape: tuple[int, ...] = (rng.randint(1, 300),)
        elif kind < 0.9:
            shape = (rng.randint(1, 300), rng.randint(1, 300))
        else:
            shape = (rng.randint(1, 8), rng.randint(1, 8), rng.randint(1, 5))
        specs.append(ParamSpec(name=f"p{index}", shape=shape, matrix=len(shape) >= 2 and rng.random() < 0.9))
    return specs


def random_cases(seed: int, cases: int):
    rng = random.Random(seed)
    for _ in range(cases):
        specs = random_specs(rng, rng.randint(1, 40))
        total = sum(spec.numel for spec in specs)
        world = rng.choice([1, 2, 3, 4, 7, 8, 16, 33, 64, 128, 512, rng.randint(1, 512)])
        bucket = rng.choice([1, rng.randint(1, total), total, 10 * total, max(1, total // rng.randint(1, 8))])
        alpha = rng.choice([0.0, 1.0, rng.random(), round(rng.random(), 1)])
        yield specs, world, bucket, alpha


def check_invariants(plan: DPPlan, specs: list[ParamSpec], world: int, bucket_numel: int) -> None:
    assert plan.specs == tuple(specs), "params are never reordered"
    assert len(plan.owner) == len(plan.bucket_of) == len(plan.offset) == len(specs)
    expected = plan_buckets(specs, bucket_numel)
    assert [(b.first, b.stop) for b in plan.buckets] == expected
    assert [b.index for b in plan.buckets] == list(range(len(expected)))
    for bucket in plan.buckets:
        sizes = [specs[i].numel for i in range(bucket.first, bucket.stop)]
        starts = [sum(sizes[:k]) for k in range(len(sizes))]
        assert bucket.numel == sum(sizes)
        assert len(bucket.cuts) == world + 1
        assert bucket.cuts[0] == 0 and bucket.cuts[-1] == bucket.numel
        assert all(a <= b for a, b in zip(bucket.cuts, bucket.cuts[1:])), "segments are in rank order"
        if plan.strategy != "uniform":
            boundaries = set(starts) | {bucket.numel}
            assert set(bucket.cuts) <= boundaries, "no cut inside a tensor"
        for local, param in enumerate(range(bucket.first, bucket.stop)):
            assert plan.bucket_of[param] == bucket.index
            assert plan.offset[param] == starts[local]
            rank = plan.owner[param]
            assert 0 <= rank < world
            assert bucket.cuts[rank] <= starts[local] < bucket.cuts[rank + 1], "owned by the segment holding its start"
        owners = [plan.owner[p] for p in range(bucket.first, bucket.stop)]
        assert owners == sorted(owners)
    assert sum(plan.rank_numels()) == sum(spec.numel for spec in specs)
    owned = sorted(p for rank in range(world) for p in plan.owned_params(rank))
    assert owned == list(range(len(specs))), "every tensor owned exactly once"
    if plan.strategy != "uniform":
        assert sum(plan.rank_costs()) == pytest.approx(sum(plan.costs))
        numels = [0] * world
        for param, rank in enumerate(plan.owner):
            numels[rank] += specs[param].numel
        assert numels == plan.rank_numels(), "a rank's segments are exactly its tensors"


def reference_min_max_segment(sizes: list[int], world: int) -> int:
    """Exhaustive dynamic programme over contiguous partitions, independent of the planner's."""
    if len(sizes) <= world:
        return max(sizes)

    @functools.cache
    def best(start: int, parts: int) -> int:
        rest = sum(sizes[start:])
        if parts == 1:
            return rest
        answer, running = rest, 0
        for end in range(start + 1, len(sizes)):
            running += sizes[end - 1]
            answer = min(answer, max(running, best(end, parts - 1)))
        return answer

    return best(0, world)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_invariants_on_random_inputs(strategy: str) -> None:
    seed = STRATEGIES.index(strategy)
    for specs, world, bucket, alpha in random_cases(seed=seed, cases=60):
        plan = plan_dp_partitions(specs, world_size=world, bucket_numel=bucket, alpha=alpha, strategy=strategy)
        check_invariants(plan, specs, world, bucket)


def test_alpha_zero_is_the_most_even_element_split() -> None:
    rng = random.Random(7)
    for _ in range(60):
        specs = random_specs(rng, rng.randint(1, 14))
        world = rng.choice([1, 2, 3, 4, 5, 8, 20])
        bucket = rng.choice([sum(s.numel for s in specs), rng.randint(1, sum(s.numel for s in specs))])
        plan = plan_dp_partitions(specs, world_size=world, bucket_numel=bucket, alpha=0.0)
        for b in plan.buckets:
            sizes = [specs[i].numel for i in range(b.first, b.stop)]
            assert b.max_segment() == reference_min_max_segment(sizes, world)


def test_alpha_caps_the_largest_segment_linearly() -> None:
    rng = random.Random(11)
    for _ in range(40):
        specs = random_specs(rng, rng.randint(2, 14))
        world = rng.choice([2, 3, 4, 6, 9])
        alpha = rng.random()
        plan = plan_dp_partitions(specs, world_size=world, bucket_numel=10**9, alpha=alpha)
        for b in plan.buckets:
            sizes = [specs[i].numel for i in range(b.first, b.stop)]
            tightest = reference_min_max_segment(sizes, world)
            assert b.max_segment() <= tightest + alpha * (b.numel - tightest) + 1e-9


def test_alpha_trades_communication_for_compute() -> None:
    specs = model_specs("qwen3-1.7b")
    even = plan_dp_partitions(specs, world_size=16, bucket_numel=500_000_000, alpha=0.0)
    compute = plan_dp_partitions(specs, world_size=16, bucket_numel=500_000_000, alpha=1.0)
    assert even.comm_ratio <= compute.comm_ratio
    assert compute.flops_ratio <= even.flops_ratio


def test_more_ranks_than_tensors() -> None:
    specs = [ParamSpec(name=f"w{i}", shape=(64, 32 + i), matrix=True) for i in range(5)]
    for strategy in STRATEGIES:
        plan = plan_dp_partitions(specs, world_size=512, bucket_numel=10**6, strategy=strategy)
        check_invariants(plan, specs, 512, 10**6)
    plan = plan_dp_partitions(specs, world_size=512, bucket_numel=10**6)
    assert len(set(plan.owner)) == 5, "each matrix on a rank of its own"
    assert sum(1 for n in plan.rank_numels() if n == 0) == 507


def test_uniform_charges_a_straddling_tensor_to_every_rank_it_touches() -> None:
    specs = [ParamSpec(name="a", shape=(10, 10), matrix=True), ParamSpec(name="b", shape=(10,), matrix=False)]
    numel = cost_model("numel")
    plan = plan_dp_partitions(specs, world_size=4, bucket_numel=1000, strategy="uniform", cost=numel)
    assert plan.buckets[0].cuts == (0, 27, 55, 82, 110)
    assert plan.owner == (0, 3)
    assert list(plan.touched_ranks(0)) == [0, 1, 2, 3]
    assert plan.rank_costs() == [100.0, 100.0, 100.0, 110.0]
    assert plan.flops_ratio == pytest.approx(110 / (110 / 4))


def test_start_index_moves_each_cut_to_the_next_tensor_start() -> None:
    specs = [ParamSpec(name=f"t{i}", shape=(n,), matrix=False) for i, n in enumerate((30, 30, 30, 10))]
    plan = plan_dp_partitions(specs, world_size=4, bucket_numel=1000, strategy="start_index", cost=cost_model("numel"))
    # Equal cuts at 0, 25, 50, 75, 100: starts 0, 30, 60, 90 land in segments 0, 1, 2, 3.
    assert plan.owner == (0, 1, 2, 3)
    assert plan.buckets[0].cuts == (0, 30, 60, 90, 100)


def test_buckets_follow_buffer_order_and_size() -> None:
    specs = [ParamSpec(name=f"t{i}", shape=(n,), matrix=False) for i, n in enumerate((4, 4, 9, 1, 1, 3))]
    assert plan_buckets(specs, 8) == [(0, 2), (2, 3), (3, 6)]
    assert plan_buckets(specs, 1) == [(i, i + 1) for i in range(6)]
    assert plan_buckets(specs, 100) == [(0, 6)]


def test_buckets_close_on_the_held_elements_where_given() -> None:
    """Under TP a rank holds a slice of each split tensor: buckets close on those counts, not the specs'."""
    specs = [ParamSpec(name=f"t{i}", shape=shape, matrix=len(shape) == 2)
             for i, shape in enumerate(((4, 2), (4, 2), (6,), (4, 4), (1,), (3,)))]
    held = [4, 4, 6, 8, 1, 3]  # halves of the matrices, the rest whole (replicated)
    assert plan_buckets(specs, 8) == [(0, 1), (1, 2), (2, 3), (3, 4), (4, 6)]
    assert plan_buckets(specs, 8, held_numels=held) == [(0, 2), (2, 3), (3, 4), (4, 6)]
    # Pieces stay a matter of the whole tensor: t3 (16 elements, 8 held) is no AdamW tensor in pieces,
    # t2 (6 elements) is one at split_numel 5 and keeps a bucket of its own.
    assert plan_buckets(specs, 8, split_numel=5, held_numels=held) == [(0, 2), (2, 3), (3, 4), (4, 6)]
    assert plan_buckets(specs, 100, split_numel=5, held_numels=held) == [(0, 2), (2, 3), (3, 6)]
    for wrong in ([4] * 5, [4, 4, 6, 8, 1, -1], [4, 4, 7, 8, 1, 3], [4, 4, 6, 8, 1, 3.0]):
        with pytest.raises(PlanError, match="held_numels"):
            plan_buckets(specs, 8, held_numels=wrong)
        with pytest.raises(PlanError, match="held_numels"):
            plan_dp_partitions(specs, world_size=2, bucket_numel=8, held_numels=wrong)


@pytest.mark.parametrize("tp", [2, 8])
def test_tp_buckets_follow_the_slices_and_the_plan_still_prices_whole_matrices(tp: int) -> None:
    """Qwen3-8B, logical specs with each tensor's TP slice as what a rank holds (the AutoTP runtime's plan).

    The buckets are those of the sliced model (what DeepSpeed's buckets count under AutoTP), far
    fewer than the 17 of the logical model; items, costs and memory are the logical model's.
    """
    logical = model_specs("qwen3-8b")
    sliced = shard_for_tp(logical, tp)
    held = [spec.numel for spec in sliced]
    assert sum(held) < sum(spec.numel for spec in logical)
    bucket, world = 500_000_000, 8
    whole = plan_dp_partitions(logical, world_size=world, bucket_numel=bucket, split_numel=DEFAULT_SPLIT_NUMEL)
    plan = plan_dp_partitions(logical, world_size=world, bucket_numel=bucket, split_numel=DEFAULT_SPLIT_NUMEL,
                              held_numels=held)
    ranges = plan_buckets(logical, bucket, split_numel=DEFAULT_SPLIT_NUMEL, held_numels=held)
    assert ranges == plan_buckets(sliced, bucket, split_numel=DEFAULT_SPLIT_NUMEL)
    assert len(whole.buckets) == 17
    assert len(plan.buckets) == len(ranges) == {2: 10, 8: 4}[tp]
    assert plan.specs == whole.specs and plan.costs == whole.costs and plan.memory == whole.memory
    first_item = {tensor: item for item, (tensor, start, _) in enumerate(plan.pieces) if start == 0}
    assert [(b.first, b.stop) for b in plan.buckets] == [
        (first_item[first], first_item[stop] if stop < len(logical) else len(plan.pieces)) for first, stop in ranges]
    for first, stop in ranges:  # at most a bucket's worth of held elements, unless one tensor alone
        assert stop - first == 1 or sum(held[first:stop]) <= bucket
    assert plan.digest() == plan_dp_partitions(logical, world_size=world, bucket_numel=bucket,
                                               split_numel=DEFAULT_SPLIT_NUMEL, held_numels=held).digest()
    assert plan.digest() != whole.digest()


def test_plan_is_deterministic_and_its_digest_is_stable_across_processes() -> None:
    specs = model_specs("qwen3-0.6b")
    first = plan_dp_partitions(specs, world_size=24, bucket_numel=40_000_000)
    second = plan_dp_partitions(specs, world_size=24, bucket_numel=40_000_000)
    assert first.owner == second.owner and first.buckets == second.buckets
    assert first.digest() == second.digest()
    script = (
        "from ds_canzona.plan import model_specs, plan_dp_partitions;"
        "print(plan_dp_partitions(model_specs('qwen3-0.6b'), world_size=24, bucket_numel=40_000_000).digest())"
    )
    for seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        output = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
        assert output.stdout.strip() == first.digest()
    changed = plan_dp_partitions(specs, world_size=24, bucket_numel=40_000_000, alpha=0.5)
    assert changed.digest() != first.digest()


def test_to_dict_matches_the_json_schema() -> None:
    specs = model_specs("qwen3-0.6b")
    plan = plan_dp_partitions(specs, world_size=8, bucket_numel=100_000_000)
    document = json.loads(plan.to_json())
    assert document["world_size"] == 8 and document["strategy"] == "alpha_balanced"
    assert document["alpha"] == 1.0 and document["cost_model"] == "roofline" and document["bucket_numel"] == 100_000_000
    assert [b["cuts"] for b in document["buckets"]] == [list(b.cuts) for b in plan.buckets]
    assert all(len(b["cuts"]) == 9 and b["cuts"][-1] == b["numel"] for b in document["buckets"])
    assert [p["name"] for p in document["params"]] == [s.name for s in specs]
    first = document["params"][0]
    assert set(first) >= {"name", "shape", "matrix", "bucket", "offset", "owner"}
    assert len(document["ranks"]) == 8 and set(document["ranks"][0]) == {"cost", "numel", "state_bytes", "tensors"}
    assert document["flops_ratio"] == pytest.approx(plan.flops_ratio)
    assert document["memory_ratio"] == pytest.approx(plan.memory_ratio)
    assert document["state_bytes_ratio"] == pytest.approx(plan.state_bytes_ratio)
    assert [r["state_bytes"] for r in document["ranks"]] == plan.rank_memory()
    assert document["memory_model"] == plan.memory_label and document["max_state_bytes_per_rank"] is None


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"world_size": 0}, "world_size"),
        ({"world_size": 2.0}, "world_size"),
        ({"bucket_numel": 0}, "bucket_numel"),
        ({"alpha": -0.1}, "alpha"),
        ({"alpha": 1.5}, "alpha"),
        ({"alpha": float("nan")}, "alpha"),
        ({"strategy": "greedy"}, "strategy"),
        ({"split_numel": 0}, "split_numel"),
        ({"split_numel": 2.5}, "split_numel"),
        ({"split_numel": True}, "split_numel"),
    ],
)
def test_bad_arguments_name_the_field(kwargs: dict, field: str) -> None:
    arguments = {"world_size": 2, "bucket_numel": 100, **kwargs}
    with pytest.raises(PlanError, match=field):
        plan_dp_partitions([ParamSpec(name="w", shape=(4, 4), matrix=True)], **arguments)


def test_empty_spec_list_is_an_error() -> None:
    with pytest.raises(PlanError, match="empty"):
        plan_dp_partitions([], world_size=2, bucket_numel=100)


QWEN3 = ("qwen3-1.7b", "qwen3-4b", "qwen3-8b", "qwen3-14b", "qwen3-32b")


@pytest.mark.parametrize("model", QWEN3)
def test_qwen3_busiest_rank_within_5_percent_of_lpt(model: str) -> None:
    flops = cost_model("flops", "muon")
    specs = model_specs(model)
    costs = [flops.cost(spec) for spec in specs]
    for bucket in (40_000_000, 500_000_000):
        for world in (16, 32, 64, 128):
            plan = plan_dp_partitions(specs, world_size=world, bucket_numel=bucket, cost=flops)
            reference = max(lpt_loads(costs, world))
            assert max(plan.rank_costs()) <= 1.05 * reference, (model, bucket, world)


def test_qwen3_32b_at_dp32_is_far_below_the_papers_ratio() -> None:
    specs = model_specs("qwen3-32b")
    for bucket in (40_000_000, 500_000_000):
        plan = plan_dp_partitions(specs, world_size=32, bucket_numel=bucket)
        assert plan.flops_ratio < 1.05  # the paper reports 1.43


# ----------------------------------------------------------------------------- pieces


def test_piece_bounds_are_canonical() -> None:
    assert piece_bounds(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert piece_bounds(8, 4) == [(0, 4), (4, 8)]
    assert piece_bounds(4, 4) == piece_bounds(4, None) == [(0, 4)]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_non_matrix_tensors_are_planned_in_pieces_inside_their_bucket(strategy: str) -> None:
    specs = [ParamSpec(name="embed", shape=(100, 10), matrix=False),
             ParamSpec(name="w", shape=(40, 40), matrix=True),
             ParamSpec(name="bias", shape=(40,), matrix=False),
             ParamSpec(name="head", shape=(250,), matrix=False)]
    plan = plan_dp_partitions(specs, world_size=3, bucket_numel=2000, strategy=strategy, split_numel=300)
    names = [spec.name for spec in plan.specs]
    assert names == ["embed[0:300]", "embed[300:600]", "embed[600:900]", "embed[900:1000]", "w", "bias", "head"]
    assert plan.pieces == ((0, 0, 300), (0, 300, 600), (0, 600, 900), (0, 900, 1000), (1, 0, 1600), (2, 0, 40),
                           (3, 0, 250))
    # Buckets are cut at tensor boundaries: the embedding (1000) and the matrix (1600) do not share one.
    assert [(b.first, b.stop) for b in plan.buckets] == [(0, 4), (4, 7)]
    assert plan.offset[:4] == (0, 300, 600, 900)  # the pieces are consecutive in their bucket
    for bucket in plan.buckets:
        owners = plan.owner[bucket.first:bucket.stop]
        assert list(owners) == sorted(owners)
        if strategy != "uniform":  # cuts on item boundaries
            starts = {plan.offset[i] for i in range(bucket.first, bucket.stop)} | {bucket.numel}
            assert set(bucket.cuts) <= starts
    assert sum(plan.rank_numels()) == sum(spec.numel for spec in specs)
    unsplit = plan_dp_partitions(specs, world_size=3, bucket_numel=2000, strategy=strategy)
    assert unsplit.pieces == tuple((i, 0, spec.numel) for i, spec in enumerate(specs))
    assert plan.digest() != unsplit.digest()
    assert unsplit.digest() == plan_dp_partitions(specs, world_size=3, bucket_numel=2000, strategy=strategy,
                                                  split_numel=None).digest()


def test_split_buckets_refine_the_joint_ones() -> None:
    """Each tensor in pieces is alone in its bucket; every other boundary is one of the joint buckets'."""
    rng = random.Random(11)
    for _ in range(200):
        specs = random_specs(rng, rng.randint(1, 30))
        total = sum(spec.numel for spec in specs)
        bucket = rng.randint(1, 2 * total)
        split = rng.randint(1, 300)
        joint = plan_buckets(specs, bucket)
        fine = plan_buckets(specs, bucket, split_numel=split)
        assert fine[0][0] == 0 and fine[-1][1] == len(specs)
        assert all(a[1] == b[0] for a, b in zip(fine, fine[1:])), "contiguous, in order"
        joint_edges = {first for first, _ in joint}
        for first, stop in fine:
            pieced = [i for i in range(first, stop) if not specs[i].matrix and specs[i].numel > split]
            if pieced:
                assert (first, stop) == (pieced[0], pieced[0] + 1), "a tensor in pieces has its bucket alone"
            elif first not in joint_edges:
                assert first - 1 >= 0 and not specs[first - 1].matrix and specs[first - 1].numel > split
        for first, _ in joint:
            assert any(f == first for f, _ in fine), "every joint boundary stays"


def test_pieces_lift_the_embedding_floor_on_qwen3_8b() -> None:
    """Whole, the 151936 x 4096 AdamW embedding alone is 1.84x a rank's share at DP=128 (GPU launch floor)."""
    specs = model_specs("qwen3-8b")
    whole = plan_dp_partitions(specs, world_size=128, bucket_numel=500_000_000)
    pieces = plan_dp_partitions(specs, world_size=128, bucket_numel=500_000_000, split_numel=2**22)
    assert whole.flops_ratio > 1.84
    # In pieces the floor is the largest matrix; the plan matches unconstrained LPT over the items.
    assert pieces.flops_ratio < 1.3
    assert max(pieces.rank_costs()) <= 1.01 * max(lpt_loads(pieces.costs, 128))
