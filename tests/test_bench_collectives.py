"""``bench collectives`` counts what the runtimes issue, checked against counts taken from the runtimes' own plans.

One spawned process (rank 0 of a fake world of 8 ranks; 23 s here at a load average of 7, 126 s
at 25) builds, on the tiny Qwen3 config, ds_canzona's ZeRO-2 engine and DeepSpeed's own ZeRO-2
Muon engine, first with real tensors and then under FakeTensorMode, and records the collectives
of steps 2 and 3 of each.

What each count must be is derived from the engine, not from the recorder:

- ds_canzona: per bucket of its plan one reduce-scatter launch, in the form the runtime chose for
  the bucket (``collective_forms``): grouped, one ``reduce`` per non-empty segment of the bucket's
  cuts inside one coalesced launch, carrying the bucket's bytes; padded, one
  ``reduce_scatter_tensor`` over P slots of the largest segment; per gather group
  (``gather_groups``) one launch per all-gather form its buckets take: the grouped buckets'
  ``broadcast`` per non-empty segment, the padded buckets' ``all_gather_into_tensor``; plus the one
  all-reduce of the per-item squared norms;
- DeepSpeed: one all-gather per parameter group of its flat bf16 buffers (``bit16_groups_flat``),
  carrying those buffers; its gradients are all-reduced, each once, so the all-reduces above a few
  bytes carry the model's gradients in bf16.

The fake-tensor run must record exactly what the real one does, call for call, and step 3 exactly
what step 2 did (the counted step is a steady state).

The same process then runs DeepSpeed's ZeRO-3 Muon engine and ds_canzona's ZeRO-3 under one config:
DeepSpeed's parameter coordinator issues every module fetch of both, so the fetch launches of
forward and of backward must be the same for both, and ds_canzona may add nothing else to forward.
It runs DeepSpeed's ZeRO-3 Muon engine with real tensors twice, with and without
``fake_engine.deepspeed_zero3_rearranged_at_once`` (the replacements of its per-rank copy loops that
make DP 256 and 1024 finish): the calls recorded must be the same, call for call, and the parameter
partitions after three steps the same to the bit (the replacements move the same elements).

A second spawn (rank 0 of TP=2 x DP=2; 14 s at a load average of 7, 92 s at 25) counts AutoTP
cells, both systems at stage 2 with real tensors, and ds_canzona's under FakeTensorMode too:

- ds_canzona: on the TP group in the step, the ``all_to_all_single`` launches of its TP plan's
  micro-groups (``tp_plans``: the gathers of slices to the hosts and the scatters back, the first two
  gathers in one launch and a scatter sharing its launch with the gather two groups on: groups + 1);
  on the DP group, its buckets' collectives as above, over the local slices' cuts; one norm
  all-reduce over the whole world;
- both systems: in forward and backward on the TP group, AutoTP's own collectives (the model's):
  the same calls for ds_canzona and for DeepSpeed; nothing on the DP group in forward;
- DeepSpeed: its all-gathers of the flat bf16 groups and its gradient all-reduces over DP carry
  this rank's slices of the model.

The last test runs the bench's command line (``--model qwen3-h128 --reduce-bucket-size 200000``)
at DP 8 and 1024, stages 2 and 3, both systems: ds_canzona's operations per step must not grow
with the world size and stay at most DeepSpeed's.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from distributed import run_ranks

WORLD = 8
TP = 2
TP_DP = 2
TINY = str(Path(__file__).resolve().parents[1] / "examples" / "configs" / "qwen3-tiny.json")
BUCKET_NUMEL = 4000  # a few buckets on the tiny model
# The fetch comparison's config: no parameter persistent (the tiny model's are all below DeepSpeed's
# default threshold), none kept for reuse, and a prefetch of a few parameters (the default reaches
# across the whole tiny model), so forward fetches every module, a prefetch coalescing several
# parameters; the test also runs it with prefetching off, where backward fetches every module again.
ZERO3_EVERY_MODULE_FETCHED = {"stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0,
                              "stage3_prefetch_bucket_size": 2000}


def _expected_canzona(engine, dp: int = WORLD) -> dict:
    """Per kind of call over DP: (calls, launches, NCCL operations, payload bytes), from the plan's cuts and forms."""
    zero = engine.optimizer
    expected: dict[str, list[int]] = {}

    def add(kind, calls, ops, payload):
        row = expected.setdefault(kind, [0, 0, 0, 0])
        row[0] += calls
        row[1] += 1  # one launch: a grouped form's calls go out as one coalesced block
        row[2] += ops
        row[3] += payload

    def sizes(b):
        cuts = zero.layout.bucket_cuts[b]
        return [cuts[r + 1] - cuts[r] for r in range(dp)]

    for b in range(len(zero.plan.buckets)):
        nonempty = sum(1 for size in sizes(b) if size)
        if zero.collective_forms.reduce_scatter[b] == "grouped":
            add("reduce", nonempty, nonempty, sum(sizes(b)) * 2)  # bf16 gradients
        elif zero.collective_forms.reduce_scatter[b] == "allreduce":
            add("all_reduce", 1, 1, sum(sizes(b)) * 2)
        else:
            add("reduce_scatter_tensor", 1, 1, dp * max(sizes(b)) * 2)
    # The all-gathers: per gather group one launch per form its buckets take.
    for group in zero.gather_groups:
        grouped = [b for b in group if zero.collective_forms.all_gather[b] == "grouped"]
        padded = [b for b in group if zero.collective_forms.all_gather[b] == "padded"]
        if grouped:
            nonempty = sum(1 for b in grouped for size in sizes(b) if size)
            add("broadcast", nonempty, nonempty, sum(sum(sizes(b)) for b in grouped) * 2)  # bf16 parameters
        if padded:
            add("all_gather_into_tensor", len(padded), len(padded), sum(dp * max(sizes(b)) for b in padded) * 2)
        if all(zero.collective_forms.all_gather[b] == "allreduce" for b in group):
            add("all_reduce", 1, 1, sum(sum(sizes(b)) for b in group) * 2)  # one over the group's buffer
    return {kind: tuple(row) for kind, row in expected.items()}


def _gather_launches(engine) -> int:
    from ds_canzona.plan.gather_groups import all_gather_launches

    zero = engine.optimizer
    return all_gather_launches(zero.gather_groups, zero.collective_forms.all_gather, WORLD)


def _expected_deepspeed(engine) -> dict:
    flats = engine.optimizer.bit16_groups_flat
    gradients = sum(p.numel() for p in engine.module.parameters() if p.requires_grad) * 2
    return {"all_gather_into_tensor": (len(flats), len(flats), sum(f.numel() * f.element_size() for f in flats)),
            "gradient_all_reduce_payload": gradients}


def _signature(calls) -> list[tuple]:
    return [(c.kind, c.group_size, c.launches, c.p2p_ops, c.payload, c.sent, c.group, c.phase, c.fetch) for c in calls]


def _zero3_with_and_without_rearranging(log) -> dict:
    """DeepSpeed's ZeRO-3 Muon, real tensors: calls of steps 2-3 and partitions after 3 steps, per variant."""
    import contextlib

    from deepspeed.runtime.zero.partition_parameters import AllGatherCoalescedHandle
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    from ds_canzona.bench.benchmarks.collectives import build_engine, count_steps
    from ds_canzona.bench.standins.fake_engine import deepspeed_zero3_rearranged_at_once

    out = {}
    for rearranged in (False, True):
        used = {"wait": 0, "gather": 0}
        with contextlib.ExitStack() as stack:
            if rearranged:
                stack.enter_context(deepspeed_zero3_rearranged_at_once())
                for owner, name, key in ((AllGatherCoalescedHandle, "wait", "wait"),
                                         (DeepSpeedZeroOptimizer_Stage3, "_partitioned_buffers_all_gather", "gather")):
                    replacement = getattr(owner, name)

                    def counted(*args, _replacement=replacement, _key=key, **kwargs):
                        used[_key] += 1
                        return _replacement(*args, **kwargs)

                    setattr(owner, name, counted)  # restored by the context's exit, which saved the original
            # No parameter persistent (the tiny model's are all below DeepSpeed's default threshold),
            # so every module is fetched and the prefetch coalesces several parameters per fetch.
            engine = build_engine("deepspeed", 3, WORLD, {"hf_config": TINY}, bucket_numel=BUCKET_NUMEL,
                                  zero_overrides={"stage3_param_persistence_threshold": 0})
            steps = count_steps(engine, log, stage=3, steps=3)
            partitions = [p.ds_tensor.detach().clone() for p in engine.module.parameters()]
            engine.destroy()
        out[rearranged] = {"steps": [_signature(calls) for calls, _ in steps], "partitions": partitions, "used": used}
    return out


def count_both(rank: int, world_size: int) -> dict:
    import ds_canzona  # noqa: F401  (installs the engine hook)
    from ds_canzona.bench.standins.collective_log import CollectiveLog
    from ds_canzona.bench.benchmarks.collectives import build_engine, count_steps, summarise
    from ds_canzona.bench.standins.fake_engine import fake_tensors
    from ds_canzona.bench.standins.fake_world import fake_world

    log = CollectiveLog().install()
    out = {}
    with fake_world(0, WORLD):
        for system in ("canzona", "deepspeed"):
            for fake in (False, True):
                with fake_tensors(enabled=fake):
                    engine = build_engine(system, 2, WORLD, {"hf_config": TINY}, bucket_numel=BUCKET_NUMEL)
                    steps = count_steps(engine, log, stage=2, steps=3)
                    expected = (_expected_canzona if system == "canzona" else _expected_deepspeed)(engine)
                    numel = sum(p.numel() for p in engine.module.parameters())
                    summary = summarise(steps[0][0], stage=2, model_numel=numel, param_bytes=2, comm_bytes=2,
                                        stated_padding=0)
                    engine.destroy()
                out[(system, fake)] = {"steps": [_signature(calls) for calls, _ in steps], "expected": expected,
                                       "summary": summary,
                                       "buckets": len(engine.optimizer.plan.buckets) if system == "canzona" else None,
                                       "gather_launches": _gather_launches(engine) if system == "canzona" else None,
                                       "norm_sized": [c.payload for c in steps[0][0] if c.kind == "all_reduce"],
                                       "items": len(engine.optimizer.plan.pieces) if system == "canzona" else None}
        out["zero3"] = _zero3_with_and_without_rearranging(log)
        # Both systems' ZeRO-3 under one config, for the launches of the fetches: with the prefetch
        # above, and without prefetching (then every module is fetched again in backward too).
        for prefetch in (ZERO3_EVERY_MODULE_FETCHED["stage3_prefetch_bucket_size"], 0):
            for system in ("canzona", "deepspeed"):
                engine = build_engine(system, 3, WORLD, {"hf_config": TINY}, bucket_numel=BUCKET_NUMEL,
                                      zero_overrides={**ZERO3_EVERY_MODULE_FETCHED,
                                                      "stage3_prefetch_bucket_size": prefetch})
                [(calls, _)] = count_steps(engine, log, stage=3, steps=2)
                out[("zero3 fetches", system, prefetch)] = _signature(calls)
                engine.destroy()
    return out


@pytest.fixture(scope="module")
def counted():
    [out] = run_ranks(count_both, 1, env={"TORCHDYNAMO_DISABLE": "1"}, timeout=600)
    return out


def test_counts_match_the_plans_and_fake_tensors_match_real_ones(counted):
    out = counted

    for system in ("canzona", "deepspeed"):
        real, fake = out[(system, False)], out[(system, True)]
        assert real["steps"][0] == real["steps"][1], f"{system}: step 3 differs from step 2"
        assert fake["steps"] == real["steps"], f"{system}: FakeTensorMode recorded other collectives"

    canzona = out[("canzona", False)]
    kinds = canzona["summary"]["by_kind"]
    expected = canzona["expected"]
    # Besides the buckets' all-reduces (if any), one more: the per-item squared norms, a float64 each.
    bucket_all_reduces = expected.get("all_reduce", (0, 0, 0, 0))
    norm_bytes = kinds["all_reduce"]["payload"] - bucket_all_reduces[3]
    assert norm_bytes in canzona["norm_sized"] and norm_bytes == 8 * canzona["items"]
    expected["all_reduce"] = tuple(a + b for a, b in zip(bucket_all_reduces, (1, 1, 1, norm_bytes)))
    for kind, (calls, launches, ops, payload) in expected.items():
        got = kinds[kind]
        assert (got["calls"], got["launches"], got["p2p_ops"], got["payload"]) == (calls, launches, ops, payload), kind
    assert set(kinds) == set(expected)
    assert canzona["summary"]["launches"] == canzona["buckets"] + canzona["gather_launches"] + 1
    if not {"reduce_scatter_tensor", "all_gather_into_tensor"} & set(expected):
        assert canzona["summary"]["padding"] == 0  # uneven segments, no padded form: no padding

    deepspeed = out[("deepspeed", False)]
    kinds = deepspeed["summary"]["by_kind"]
    calls, ops, payload = deepspeed["expected"]["all_gather_into_tensor"]
    gather = kinds["all_gather_into_tensor"]
    assert (gather["calls"], gather["p2p_ops"], gather["payload"]) == (calls, ops, payload)
    # The norm and overflow all-reduces are a few bytes; the rest are the gradients, each once.
    gradients = sum(size for size in deepspeed["norm_sized"] if size > 16)
    assert gradients == deepspeed["expected"]["gradient_all_reduce_payload"]


def test_deepspeed_zero3_rearranged_at_once_issues_the_same_calls_and_moves_the_same_values(counted):
    plain, rearranged = counted["zero3"][False], counted["zero3"][True]
    assert rearranged["used"]["wait"] > 0 and rearranged["used"]["gather"] > 0, rearranged["used"]
    assert plain["steps"][0], "no collective recorded"
    assert rearranged["steps"] == plain["steps"]
    assert len(rearranged["partitions"]) == len(plain["partitions"])
    for a, b in zip(rearranged["partitions"], plain["partitions"]):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


# --------------------------------------------------------------------------- AutoTP
def count_tp(rank: int, world_size: int) -> dict:
    import ds_canzona  # noqa: F401  (installs the engine hook)
    from ds_canzona.bench.standins.collective_log import CollectiveLog
    from ds_canzona.bench.benchmarks.collectives import build_engine, count_steps, group_labeller, summarise
    from ds_canzona.bench.standins.fake_engine import fake_tensors
    from ds_canzona.bench.standins.fake_world import fake_world
    from deepspeed.utils import groups

    import ds_canzona.zero.timeouts as timeouts

    log = CollectiveLog().install()
    label = group_labeller(TP * TP_DP, TP)
    log.label_groups(label)
    # The groups canzona.comm_timeout_s is applied to (the fake backend has no timeout to set).
    timed_out: list[str] = []
    timeouts._set_timeout = lambda group, timeout: timed_out.append(label(group)) or True
    out = {}
    with fake_world(0, TP * TP_DP):
        groups._init_tp_mesh_device(tensor_model_parallel_size=TP)
        for system, fake in (("canzona", False), ("canzona", True), ("deepspeed", False)):
            with fake_tensors(enabled=fake):
                timed_out.clear()
                engine = build_engine(system, 2, TP_DP, {"hf_config": TINY}, bucket_numel=BUCKET_NUMEL, tp=TP)
                [(calls, _)] = count_steps(engine, log, stage=2)
                local = sum(p.numel() for p in engine.module.parameters() if p.requires_grad)
                summary = summarise(calls, stage=2, model_numel=local, param_bytes=2, comm_bytes=2, stated_padding=0)
                row = {"calls": _signature(calls), "summary": summary, "local_bytes": local * 2,
                       "timed_out": sorted(set(timed_out))}
                if system == "canzona":
                    zero = engine.optimizer
                    row["micro_groups"] = len(zero.tp_plans[zero.rank][1].groups)
                    row["hosted_here"] = len(zero.hosted_tensors())
                    row["expected_dp"] = _expected_canzona(engine, TP_DP)
                    row["dp_rank"] = zero.rank
                    row["buckets"] = _bucket_tensor_ranges(zero)
                    row["held"] = [p.numel() for p in zero.params]
                    row["largest_slices"] = zero._held_numels()
                    row["logical"] = [math.prod(shape) for shape in zero.logical_shapes]
                    row["local_bucket_numels"] = list(zero.layout.bucket_numel)
                    row["items"] = len(zero.plan.pieces)
                else:
                    flats = engine.optimizer.bit16_groups_flat
                    row["flat_gathers"] = (len(flats), sum(f.numel() * f.element_size() for f in flats))
                engine.destroy()
            out[(system, fake)] = row
    return out


def _bucket_tensor_ranges(zero) -> list[tuple[int, int]]:
    """The plan's buckets as (first, stop) tensor ranges (a tensor in pieces is one tensor)."""
    ranges = []
    for bucket in zero.plan.buckets:
        first = zero.plan.pieces[bucket.first][0]
        ranges.append((first, zero.plan.pieces[bucket.stop - 1][0] + 1))
    return ranges


@pytest.fixture(scope="module")
def tp_counted():
    [out] = run_ranks(count_tp, 1, env={"TORCHDYNAMO_DISABLE": "1"}, timeout=600)
    return out


def _calls(row, group=None, phase=None, kind=None):
    return [c for c in row["calls"] if (group is None or c[6] == group) and (phase is None or c[7] == phase)
            and (kind is None or c[0] == kind)]


def test_tp_counts_the_micro_group_exchanges_and_the_dp_collectives_of_the_plan(tp_counted):
    from ds_canzona.zero.tp_exchange import MicroGroupExchange

    canzona = tp_counted[("canzona", False)]
    assert canzona["dp_rank"] == 0
    assert canzona["micro_groups"] > 0, "the tiny model's sharded matrices make no micro-group on DP rank 0"
    exchange = _calls(canzona, "tp", "step")
    launches = MicroGroupExchange.launches_per_step(canzona["micro_groups"])
    assert [c[0] for c in exchange] == ["all_to_all_single"] * launches
    assert all(c[1] == TP and c[2] == 1 for c in exchange)

    over_dp = _calls(canzona, "dp")
    got: dict[str, list[int]] = {}
    for kind, size, launches, ops, payload, *_ in over_dp:
        assert size == TP_DP
        row = got.setdefault(kind, [0, 0, 0, 0])
        for i, value in enumerate((1, launches, ops, payload)):
            row[i] += value
    assert {kind: tuple(row) for kind, row in got.items()} == canzona["expected_dp"]
    assert [c[0] for c in _calls(canzona, "world")] == ["all_reduce"]  # the per-item squared norms
    assert not _calls(canzona, phase="forward", group="dp")
    assert set(c[6] for c in canzona["calls"]) == {"tp", "dp", "world"}

    by_group = canzona["summary"]["by_group"]
    assert by_group["tp"]["phases"]["step"]["launches"] == 2 * canzona["micro_groups"]
    assert sum(row["launches"] for row in by_group.values()) == canzona["summary"]["launches"]


def test_tp_comm_timeout_is_set_on_every_group_the_step_communicates_over(tp_counted):
    """canzona.comm_timeout_s reaches the TP group too: every group of a training step's collectives got it."""
    for fake in (False, True):
        row = tp_counted[("canzona", fake)]
        used = {c[6] for c in row["calls"]}
        assert used == {"dp", "tp", "world"}, used
        assert used <= set(row["timed_out"]), (used, row["timed_out"])
    assert tp_counted[("deepspeed", False)]["timed_out"] == []  # DeepSpeed's own optimizer: not ours to set


def test_tp_buckets_close_on_the_slices_a_rank_holds(tp_counted):
    """Under AutoTP the buckets are ``reduce_bucket_size`` elements of the TP slices, not of the logical tensors.

    The tiny model's 2 KV heads split evenly at TP=2, so every TP rank holds the same counts and
    the largest slice is this rank's own.
    """
    from ds_canzona.plan import ParamSpec, plan_buckets

    canzona = tp_counted[("canzona", False)]
    held, logical = canzona["held"], canzona["logical"]
    assert canzona["largest_slices"] == held
    assert sum(held) < sum(logical), "AutoTP split nothing"
    assert canzona["items"] == len(held), "no tensor of the tiny model is planned in pieces"

    def buckets_of(counts):
        return plan_buckets([ParamSpec(name=f"t{i}", shape=(n,), matrix=True) for i, n in enumerate(counts)],
                            BUCKET_NUMEL)

    assert canzona["buckets"] == buckets_of(held)
    assert len(canzona["buckets"]) < len(buckets_of(logical))
    for (first, stop), local in zip(canzona["buckets"], canzona["local_bucket_numels"]):
        assert local == sum(held[first:stop])
        assert stop - first == 1 or local <= BUCKET_NUMEL
    # Each bucket is as full as the size allows: the next tensor would take it past BUCKET_NUMEL.
    for (first, stop), (after, _) in zip(canzona["buckets"], canzona["buckets"][1:]):
        assert stop == after and sum(held[first:stop]) + held[after] > BUCKET_NUMEL


def test_tp_fake_tensors_record_the_real_calls_and_autotp_is_the_same_model_for_both(tp_counted):
    canzona, deepspeed = tp_counted[("canzona", False)], tp_counted[("deepspeed", False)]
    assert tp_counted[("canzona", True)]["calls"] == canzona["calls"]
    model = [c for c in canzona["calls"] if c[7] in ("forward", "backward")]
    assert model and all(c[6] == "tp" for c in model if c[7] == "forward")
    assert _calls(canzona, "tp", "forward") == _calls(deepspeed, "tp", "forward")
    assert _calls(canzona, "tp", "backward") == _calls(deepspeed, "tp", "backward")

    count, payload = deepspeed["flat_gathers"]
    gathers = _calls(deepspeed, "dp", kind="all_gather_into_tensor")
    assert (len(gathers), sum(c[4] for c in gathers)) == (count, payload)
    gradients = sum(c[4] for c in _calls(deepspeed, "dp", kind="all_reduce") if c[4] > 16)
    assert gradients == deepspeed["local_bytes"]  # this rank's slices, each all-reduced once over DP


def test_markdown_names_the_tp_columns_and_where_each_cell_was_counted():
    from ds_canzona.bench.benchmarks.collectives import format_markdown, merge_documents

    def cell(system, tp, launches, tp_model, tp_step, commit):
        phases = {"forward": {"launches": tp_model, "p2p_ops": tp_model}, "step": {"launches": tp_step, "p2p_ops": 1}}
        return {"system": system, "stage": 2, "dp": 8, "tp": tp, "launches": launches, "p2p_ops": launches,
                "sent": 2**20, "padding": 0, "commit": commit,
                "by_group": {"tp": {"launches": tp_model + tp_step, "p2p_ops": 0, "sent": 0, "phases": phases}}}

    run = {"model": "m", "tensors": "fake", "bucket_numel": 1, "tokens": 8}
    older = {**run, "cells": [cell("deepspeed", 2, 99, 40, 3, "aaaaaaa")]}
    newer = {**run, "cells": [cell("canzona", 2, 50, 40, 6, "bbbbbbb"), cell("deepspeed", 2, 60, 40, 3, "ccccccc")]}
    table = format_markdown(merge_documents([older, newer]))
    assert "| TP | DP | stage | launches | TP launches: forward + backward | TP launches: step |" in table
    assert "| 2 | 8 | 2 | 50 / 60 | 40 / 40 | 6 / 3 |" in table  # the later run's DeepSpeed cell replaces the older
    assert "bbbbbbb: ds_canzona stage 2 TP 2; ccccccc: DeepSpeed Muon stage 2 TP 2." in table


def test_zero3_fetch_launches_are_the_coordinators_and_the_same_for_both_systems(counted):
    """Under one config DeepSpeed's coordinator decides every fetch, for both: equal fetch launches per phase."""

    def launches(calls, phase, fetch):
        return sum(c[2] for c in calls if c[7] == phase and c[8] == fetch)

    for prefetch in (ZERO3_EVERY_MODULE_FETCHED["stage3_prefetch_bucket_size"], 0):
        ours, theirs = (counted[("zero3 fetches", system, prefetch)] for system in ("canzona", "deepspeed"))
        for phase in ("forward", "backward", "step"):
            assert launches(ours, phase, True) == launches(theirs, phase, True), (prefetch, phase)
        assert launches(ours, "forward", True) > 0
        assert launches(ours, "forward", False) == 0  # forward communicates only to fetch
        # ds_canzona's own launches: its gradient buckets in backward, the norm (and nothing else) in the step.
        assert launches(ours, "backward", False) > 0
        assert [c[0] for c in ours if c[7] == "step"] == ["all_reduce"]
    # Without prefetching every module is fetched again in backward (with it, the prefetch of the
    # last forward modules reaches across the tiny model's backward, and nothing is released).
    assert launches(counted[("zero3 fetches", "canzona", 0)], "backward", True) > 0


def test_zero_overrides_are_parsed_recorded_and_kept_apart_and_the_fetches_shown():
    import argparse

    from ds_canzona.bench.benchmarks.collectives import _zero_override, format_markdown, merge_documents

    assert _zero_override("stage3_prefetch_bucket_size=5e8") == ("stage3_prefetch_bucket_size", 5e8)
    assert _zero_override('leaf_module={"classes": ["A"]}') == ("leaf_module", {"classes": ["A"]})
    for bad in ("stage3_prefetch_bucket_size", "=1", "x={"):
        with pytest.raises(argparse.ArgumentTypeError):
            _zero_override(bad)

    def cell(system, launches, fetches):
        phases = {"forward": {"launches": launches, "p2p_ops": launches, "fetch_launches": fetches}}
        if fetches is None:  # a run written before fetches were counted
            del phases["forward"]["fetch_launches"]
        return {"system": system, "stage": 3, "dp": 8, "tp": 1, "launches": launches, "p2p_ops": launches,
                "sent": 0, "padding": 0, "commit": "aaaaaaa",
                "by_group": {"dp": {"launches": launches, "p2p_ops": launches, "sent": 0, "phases": phases}}}

    run = {"model": "m", "tensors": "fake", "bucket_numel": 1, "tokens": 8}
    table = format_markdown(merge_documents([{**run, "cells": [cell("canzona", 30, 20), cell("deepspeed", 50, None)]}]))
    assert "| DP | stage | launches | of them ZeRO-3 fetches |" in table
    assert "| 8 | 3 | 30 / 50 | 20 / ? |" in table
    coarse = {**run, "zero_overrides": {"stage3_prefetch_bucket_size": 5e8}, "cells": [cell("canzona", 20, 10)]}
    with pytest.raises(ValueError, match="zero_overrides"):
        merge_documents([{**run, "cells": [cell("canzona", 30, 20)]}, coarse])
    assert "stage3_prefetch_bucket_size=500000000.0" in format_markdown(merge_documents([coarse]))


def test_operations_per_step_do_not_grow_with_the_world_size_on_the_small_model_with_small_buckets():
    """``bench collectives --model qwen3-h128 --reduce-bucket-size 200000`` at DP 8 and 1024 (one fake-world
    process per DP; about 50 s here): ds_canzona's NCCL operations per step are the same at both sizes, one
    per launch, and at most DeepSpeed's, at stages 2 and 3."""
    import argparse

    from ds_canzona.bench.benchmarks.collectives import _count, add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--model", "qwen3-h128", "--reduce-bucket-size", "200000", "--dp", "8,1024",
                              "--stages", "2,3"])
    document = _count(args)
    assert document["model"] == "qwen3-h128" and document["zero_overrides"] == {"reduce_bucket_size": 200000}
    cells = {(c["system"], c["stage"], c["dp"]): c for c in document["cells"]}
    assert not [c for c in cells.values() if c.get("unavailable")], cells
    for stage in (2, 3):
        ours = [cells[("canzona", stage, dp)] for dp in (8, 1024)]
        assert ours[0]["p2p_ops"] == ours[1]["p2p_ops"], (stage, [c["p2p_ops"] for c in ours])
        for cell in ours:
            assert cell["p2p_ops"] == cell["launches"], (stage, cell["by_kind"])  # one operation per launch
            assert cell["p2p_ops"] <= cells[("deepspeed", stage, cell["dp"])]["p2p_ops"], (stage, cell["dp"])
    # The small buckets took effect: several gradient buckets at stage 2 (one bucket, one gather group
    # and the norm would be 3 operations).
    assert cells[("canzona", 2, 8)]["by_kind"]["all_reduce"]["calls"] > 4
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "qwen3-h128", "--reduce-bucket-size", "0"])
