"""The exact chain-grid search (plan/_chain_grid.py) against enumerating every layout.

Small buffers (1-3 buckets, up to 3 ranks) are laid out every possible way (every rank a run of
every bucket, the runs in rank order); the search must say feasible exactly when some layout has
every rank within both capacities, and its layout must be one. Relaxed chains may only say
"no layout" when there is none; restricted chains may only give layouts of the buffer.
"""

from __future__ import annotations

import itertools
import math
import random

import pytest

from ds_canzona.plan._chain_grid import bucket_chains, chain_layout, relaxed_chains, restricted_chains


def _any_layout(buckets, costs, memory, world, capacity, memory_capacity) -> bool:
    cut_choices = [list(itertools.combinations_with_replacement(range(stop - first + 1), world - 1))
                   for first, stop in buckets]
    for cuts in itertools.product(*cut_choices):
        load, held = [0.0] * world, [0.0] * world
        for (first, stop), inner in zip(buckets, cuts):
            bounds = [0, *inner, stop - first]
            for rank in range(world):
                for item in range(first + bounds[rank], first + bounds[rank + 1]):
                    load[rank] += costs[item]
                    held[rank] += memory[item]
        if max(load) <= capacity * (1 + 1e-12) and max(held) <= memory_capacity * (1 + 1e-12):
            return True
    return False


def _check_layout(owner, buckets, costs, memory, world, capacity, memory_capacity) -> None:
    load, held = [0.0] * world, [0.0] * world
    for first, stop in buckets:
        ranks = [owner[item] for item in range(first, stop)]
        assert ranks == sorted(ranks), "runs in rank order"
        assert all(0 <= rank < world for rank in ranks)
        for item in range(first, stop):
            load[owner[item]] += costs[item]
            held[owner[item]] += memory[item]
    assert max(load, default=0.0) <= capacity * (1 + 1e-9)
    assert max(held, default=0.0) <= memory_capacity * (1 + 1e-9)


def _random_case(rng: random.Random):
    buckets, position = [], 0
    for _ in range(rng.randint(1, 3)):
        length = rng.randint(0, 4)
        buckets.append((position, position + length))
        position += length
    costs = [float(rng.choice([0, 1, 2, 3, 5])) for _ in range(position)]
    memory = [float(rng.choice([0, 1, 2, 4])) for _ in range(position)]
    world = rng.randint(1, 3)
    capacity = float(rng.choice([3, 4, 5, 6, 8]))
    memory_capacity = rng.choice([3.0, 4.0, 6.0, 8.0, math.inf])
    return buckets, costs, memory, world, capacity, memory_capacity


def test_exact_against_every_layout():
    rng = random.Random(7)
    decided = {True: 0, False: 0}
    for _ in range(400):
        buckets, costs, memory, world, capacity, memory_capacity = _random_case(rng)
        want = _any_layout(buckets, costs, memory, world, capacity, memory_capacity)
        got = chain_layout(bucket_chains(buckets), costs, memory, world, capacity, memory_capacity)
        assert got is not None
        assert (got is not False) == want, (buckets, costs, memory, world, capacity, memory_capacity)
        if got is not False:
            _check_layout(got, buckets, costs, memory, world, capacity, memory_capacity)
        decided[want] += 1
    assert min(decided.values()) > 50  # both answers are exercised


def test_relaxed_and_restricted_bracket_the_answer():
    rng = random.Random(11)
    for _ in range(300):
        buckets, costs, memory, world, capacity, memory_capacity = _random_case(rng)
        # Some buckets of alike pieces, with a smaller last piece, as an embedding in pieces.
        if rng.random() < 0.5:
            for first, stop in buckets[: rng.randint(1, len(buckets))]:
                for item in range(first, stop):
                    costs[item], memory[item] = 2.0, 2.0
                if stop - first > 1 and rng.random() < 0.5:
                    costs[stop - 1], memory[stop - 1] = 1.0, 1.0
        want = _any_layout(buckets, costs, memory, world, capacity, memory_capacity)
        relaxed = chain_layout(relaxed_chains(buckets, costs, memory, world), costs, memory, world, capacity,
                               memory_capacity)
        restricted = chain_layout(restricted_chains(buckets, costs, memory, world), costs, memory, world,
                                  capacity, memory_capacity)
        if relaxed is False:
            assert not want
        if restricted not in (None, False):
            assert len(restricted) == len(costs)
            _check_layout(restricted, buckets, costs, memory, world, capacity, memory_capacity)


def test_alike_buckets_are_pooled_and_tiny_items_left_out():
    # An embedding and a head in three pieces each (the last smaller), a bucket of matrices with a norm.
    costs = [4.0, 4.0, 1.0, 10.0, 0.0, 9.0, 4.0, 4.0, 1.0]
    memory = [8.0, 8.0, 2.0, 1.0, 0.0, 1.0, 8.0, 8.0, 2.0]
    buckets = [(0, 3), (3, 6), (6, 9)]
    relaxed = relaxed_chains(buckets, costs, memory, world=4)
    assert relaxed == [[(3,), (5,)], [(0,), (1,), (6,), (7,)]]
    restricted = restricted_chains(buckets, costs, memory, world=4)
    assert restricted == [[(3, 4), (5,)], [(0,), (1,), (2,), (6,), (7,), (8,)]]


@pytest.mark.parametrize("world", [2, 3])
def test_grid_over_its_limit_is_not_decided(monkeypatch, world):
    import ds_canzona.plan._chain_grid as chain_grid

    monkeypatch.setattr(chain_grid, "MAX_GRID", 3)
    buckets = [(0, 3), (3, 6), (6, 9)]
    assert chain_layout(bucket_chains(buckets), [1.0] * 9, [1.0] * 9, world, 10.0, 10.0) is None
