"""Grouped and padded bucket collectives: the choice, its config key, and both forms at work.

- The choice (``ds_canzona.plan.collectives``) in one process: the cost model in both directions,
  the override, the constants, invalid settings; the config key's errors; the plan command's report.
- Equal results, on 3 gloo ranks (one spawn): the tiny model's buckets at DP=3 have uneven
  segments and empty ones. Stage 2 grouped and padded, stage 1 padded, and stages 2 and 1 with the
  grouped reduce-scatter of other backends (a reduce per non-empty segment, switched on for gloo), train 3 steps on
  gradients rounded to multiples of 2**-20 (so the sum over ranks is exact in fp32 whatever
  order a collective adds in: gloo's list reduce-scatter and its reduce_scatter_tensor add in
  different orders at DP>=3, and so would NCCL's ncclReduce and ncclReduceScatter). The
  parameters of all five are bitwise equal, and equal the single-process optimizer fed the
  runtime's averaged gradients.
- Launches at DP=64, in one process on torch's fake process group: the padded form issues one
  reduce_scatter_tensor and one all_gather_into_tensor per bucket; the grouped form one grouped
  launch per bucket and collective holding a reduce (or broadcast) per non-empty segment, counted
  from the cuts (fewer than 64: most ranks own nothing in a bucket). The default is the cost
  model's choice for each bucket (padded for some here).
"""

from __future__ import annotations

import math

import pytest
import torch

from distributed import run_ranks

STEPS = 3
GRID = 2.0 ** -20


# --------------------------------------------------------------------------- the choice, one process
def test_cost_model_picks_padded_when_launches_outweigh_the_padding():
    from ds_canzona.plan.collectives import CollectiveCosts, choose_form, padding_numel

    costs = CollectiveCosts(launch_s=5e-6, bytes_per_s=50e9)
    cuts = (0, 100, 250, 250, 400)  # sizes 100, 150, 0, 150: padding 4 * 150 - 400 = 200 elements
    assert padding_numel(cuts) == 200
    # 3 ops (the empty segment issues none) of 10 us each against one op, the staging and 800 bytes: padded.
    assert costs.grouped_s(cuts) == pytest.approx(3 * 5e-6 * 2)
    assert costs.padded_s(cuts, 4) == pytest.approx(5e-6 * 2 + 2 * 5e-6 + 800 / 50e9)
    assert choose_form(cuts, element_bytes=4, backend="nccl") == "padded"
    # The same cuts scaled up until the padding costs more on the wire than the launches save.
    huge = tuple(c * 10_000_000 for c in cuts)
    assert costs.padded_s(huge, 4) > costs.grouped_s(huge)
    assert choose_form(huge, element_bytes=4, backend="nccl") == "grouped"
    # A slower wire moves the threshold: fewer bytes of padding already tip it.
    assert choose_form(tuple(c * 10_000 for c in cuts), element_bytes=4, backend="nccl",
                       costs=CollectiveCosts(bytes_per_s=1e8)) == "grouped"
    # Equal segments: nothing to pad, one launch beats P at any size.
    assert choose_form((0, 10**9, 2 * 10**9), element_bytes=4, backend="nccl") == "padded"


def test_latency_grows_with_the_ring_and_grouped_pays_for_non_empty_segments_only():
    from ds_canzona.plan.collectives import CollectiveCosts, choose_form, nonempty_segments

    costs = CollectiveCosts()
    assert costs.latency_s(2) == costs.latency_s(1) == costs.launch_s
    assert costs.latency_s(1024) == pytest.approx(10 * costs.launch_s)
    # One rank holding the whole bucket: one reduce / broadcast, however many ranks; padding can only lose.
    numel = 2_000_000
    at_1024 = (0, numel) + (numel,) * 1023
    assert nonempty_segments(at_1024) == 1
    assert costs.grouped_s(at_1024) == pytest.approx(costs.latency_s(1024))
    assert choose_form(at_1024, element_bytes=2, backend="nccl") == "grouped"
    # 256 equal owners among 1024 ranks: 256 launches of 50 us against one collective and 768
    # empty slots of padding: at small segments padded wins, at large ones the padding costs more.
    small = tuple(min(r, 256) * 1_000 for r in range(1025))
    large = tuple(min(r, 256) * 1_000_000 for r in range(1025))
    assert nonempty_segments(small) == nonempty_segments(large) == 256
    assert choose_form(small, element_bytes=2, backend="nccl") == "padded"
    assert choose_form(large, element_bytes=2, backend="nccl") == "grouped"


def test_settings_override_gloo_and_one_rank():
    from ds_canzona.plan.collectives import bucket_forms, choose_form

    cuts = (0, 10, 20, 30, 30)  # 3 reduces of 10 us against one collective, the staging and 10 elements of padding
    assert choose_form(cuts, element_bytes=4, backend="gloo") == "grouped"  # gloo's default: measured
    assert choose_form(cuts, element_bytes=4, backend="nccl") == "padded"
    assert choose_form(cuts, element_bytes=4, backend="nccl", setting="grouped") == "grouped"
    assert choose_form(cuts, element_bytes=4, backend="gloo", setting="padded") == "padded"
    assert choose_form((0, 7), element_bytes=4, backend="nccl", setting="padded") == "grouped"  # no collective
    forms = bucket_forms([cuts, (0, 5, 10, 15, 20), (0, 8, 8, 8, 8)], reduce_scatter_bytes=4, all_gather_bytes=2,
                         backend="nccl")
    # The third bucket has one owner: one operation, grouped.
    assert forms.reduce_scatter == forms.all_gather == ("padded", "padded", "grouped")
    # 4 * 10 - 30 = 10 padding elements in the first bucket, none in the second (equal), none taken in the third.
    assert (forms.reduce_scatter_summary.padding_bytes, forms.all_gather_summary.padding_bytes) == (40, 20)
    assert forms.reduce_scatter_summary.bucket_bytes == 58 * 4
    assert forms.all_gather_summary.padding_fraction == pytest.approx(20 / 116)
    assert forms.reduce_scatter_summary.operations == forms.all_gather_summary.operations == 1 + 1 + 1


@pytest.mark.parametrize("bad", [{"setting": "fast"}, {"cuts": (0, 5, 3)}, {"cuts": (0,)}])
def test_choice_rejects_bad_input(bad):
    from ds_canzona.plan.collectives import choose_form

    with pytest.raises(ValueError):
        choose_form(bad.get("cuts", (0, 1, 2)), element_bytes=4, backend="nccl", setting=bad.get("setting", "default"))


@pytest.mark.parametrize("value", [0, -1.0, math.inf, True, "5e-6"])
def test_costs_reject_non_positive_constants(value):
    from ds_canzona.plan.collectives import CollectiveCosts

    with pytest.raises(ValueError):
        CollectiveCosts(launch_s=value)
    with pytest.raises(ValueError):
        CollectiveCosts(bytes_per_s=value)


def test_config_key_and_constants():
    from ds_canzona.config import CanzonaConfigError, parse_canzona_section
    from ds_canzona.plan.collectives import CollectiveCosts

    assert parse_canzona_section({"canzona": {}}).collectives == "default"
    assert parse_canzona_section({"canzona": {}}).collective_costs == CollectiveCosts()
    tuned = parse_canzona_section({"canzona": {"collective_launch_s": 2e-5, "collective_bytes_per_s": 1e10}})
    assert tuned.collective_costs == CollectiveCosts(launch_s=2e-5, bytes_per_s=1e10)
    for raw, message in (({"collectives": "fast"}, "canzona.collectives"),
                         ({"collectives": True}, "canzona.collectives"),
                         ({"collective_launch_s": 0}, "canzona.collective_launch_s"),
                         ({"collective_bytes_per_s": "1e9"}, "canzona.collective_bytes_per_s"),
                         ({"collectives": "padded", "collective_launch_s": 1e-5}, "'default' only")):
        with pytest.raises(CanzonaConfigError, match=message):
            parse_canzona_section({"canzona": raw})


# --------------------------------------------------------------------------- both forms on 3 gloo ranks
def _on_grid(grad: torch.Tensor) -> torch.Tensor:
    return torch.round(grad / GRID) * GRID


def _gridded_model():
    from tiny_model import make_model

    model = make_model()
    for param in model.parameters():
        param.register_hook(_on_grid)
    return model


@pytest.fixture(scope="module")
def gloo_runs():
    return run_ranks(_forms_ranks_with_layout, 3, timeout=600)


def _forms_ranks_with_layout(rank: int, world_size: int) -> dict:
    import zero_workers

    zero_workers.MODELS["gridded"] = _gridded_model
    captured = {}
    original_init = zero_workers.init_engine

    def init_and_keep(config, model=None):
        engine = original_init(config, model=model)
        captured["zero"] = engine.optimizer
        return engine

    zero_workers.init_engine = init_and_keep
    import ds_canzona.zero.comm as bucket_comm

    out = {}
    for name, stage, collectives in (("grouped2", 2, "grouped"), ("padded2", 2, "padded"), ("padded1", 1, "padded"),
                                     ("owners2", 2, "grouped"), ("owners1", 1, "grouped")):
        # owners*: the grouped reduce-scatter of other backends (a reduce per non-empty segment) run on gloo.
        bucket_comm._REDUCE_TO_OWNERS_ON_GLOO = name.startswith("owners")
        config = zero_workers.make_config(world_size, stage=stage, canzona={"collectives": collectives})
        try:
            result = zero_workers.train(rank, world_size, config, STEPS, model_name="gridded")
        finally:
            bucket_comm._REDUCE_TO_OWNERS_ON_GLOO = False
        zero = captured["zero"]
        result["cuts"] = zero.layout.bucket_cuts
        result["forms"] = (zero.collective_forms.reduce_scatter, zero.collective_forms.all_gather)
        result["calls"] = dict(zero.comm.calls)
        result["operations"] = dict(zero.comm.operations)
        result["padding"] = dict(zero.comm.padding)
        out[name] = result
    return out


def test_padded_and_grouped_forms_are_bitwise_equal_and_the_single_process_step(gloo_runs):
    from test_zero_stage12 import assert_params_equal, merged_grads, single_process_replay
    from zero_workers import BASE_CONFIG

    rank0 = gloo_runs[0]
    cuts = rank0["padded2"]["cuts"]
    sizes = [[c[r + 1] - c[r] for r in range(3)] for c in cuts]
    assert any(0 in s for s in sizes), f"no bucket has an empty segment: {sizes}"
    assert any(len({x for x in s if x}) > 1 for s in sizes), f"no bucket has uneven non-empty segments: {sizes}"
    buckets = len(cuts)
    assert rank0["grouped2"]["forms"] == rank0["owners2"]["forms"] == (("grouped",) * buckets,) * 2
    # The list reduce-scatter counts P operations per bucket, the reduces to the owners one per non-empty segment.
    nonempty = sum(sum(size > 0 for size in s) for s in sizes)
    for lists, owners in (("grouped2", "owners2"), ("padded1", "owners1")):
        launches = rank0[owners]["calls"]["reduce_scatter"]  # one per bucket per reduction (stage 2: per micro-batch)
        assert launches == rank0[lists]["calls"]["reduce_scatter"] and launches % buckets == 0
        assert rank0[owners]["operations"]["reduce_scatter"] == nonempty * launches // buckets
    assert rank0["grouped2"]["operations"]["reduce_scatter"] == 3 * rank0["grouped2"]["calls"]["reduce_scatter"]
    for name in ("padded2", "padded1"):
        assert rank0[name]["forms"] == (("padded",) * buckets,) * 2
        assert rank0[name]["padding"]["reduce_scatter"] > 0 and rank0[name]["padding"]["all_gather"] > 0
    assert "all_gather" not in rank0["grouped2"]["calls"]  # gloo's grouped all-gather: broadcasts
    for name in ("grouped2", "padded2", "padded1", "owners2", "owners1"):
        results = [r[name] for r in gloo_runs]
        for r in results[1:]:
            assert_params_equal(results[0]["params"], r["params"])
        replay = single_process_replay(BASE_CONFIG["optimizer"], merged_grads(results), clip=1.0)
        assert_params_equal(results[0]["params"], replay)
    assert_params_equal(rank0["grouped2"]["params"], rank0["padded2"]["params"])
    for name in ("padded1", "owners2", "owners1"):
        assert_params_equal(rank0["grouped2"]["params"], rank0[name]["params"])


# --------------------------------------------------------------------------- launches at DP=64, one process
FAKE_WORLD = 64
BUCKET_COLLECTIVES = ("reduce_scatter", "reduce_scatter_tensor", "all_gather", "all_gather_into_tensor", "broadcast",
                      "reduce")


class _Done:
    def wait(self):
        return None


def _record_bucket_collectives(log: list):
    """deepspeed.comm's bucket collectives and the grouped launches around them, recorded while ``log`` is on.

    A call is logged as its name; a grouped launch (``LaunchGroup``) as ("launch", the names issued
    inside it). The fake backend does nothing with a collective and rejects uneven lists, so an
    uneven list is recorded and not passed on (a reduce-scatter's output gets zeros: the step stays finite).
    """
    import deepspeed.comm as dist
    from ds_canzona.zero.stage3_comm import LaunchGroup

    def wrap(name, original):
        def recorded(*args, **kwargs):
            listed = next((a for a in list(args) + list(kwargs.values()) if isinstance(a, list)), None)
            if log and log[0] == "on":
                (log[-1][1] if log[-1] and isinstance(log[-1], tuple) and log[-1][0] == "open" else log).append(name)
            if listed is not None and len({t.numel() for t in listed}) > 1:
                output = args[0] if args else kwargs.get("output")
                if name == "reduce_scatter":
                    output.zero_()
                return _Done() if kwargs.get("async_op") else None
            return original(*args, **kwargs)
        return recorded

    for name in BUCKET_COLLECTIVES:
        setattr(dist, name, wrap(name, getattr(dist, name)))
    enter, leave = LaunchGroup.__enter__, LaunchGroup.__exit__

    def entered(self):
        if log and log[0] == "on":
            log.append(("open", []))
        return enter(self)

    def left(self, *exc):
        if log and log[0] == "on":
            log[-1] = ("launch", tuple(log[-1][1]))
        return leave(self, *exc)

    LaunchGroup.__enter__, LaunchGroup.__exit__ = entered, left


def _launches_at_64(rank: int, world_size: int) -> dict:
    from fake_world import fake_world
    from tiny_model import batches
    import zero_workers

    out = {}
    with fake_world(0, FAKE_WORLD):
        log: list = ["off"]
        _record_bucket_collectives(log)
        for collectives in ("default", "grouped"):  # "padded" runs on gloo
            config = zero_workers.make_config(FAKE_WORLD, stage=2, gradient_accumulation_steps=1,
                                              canzona={"collectives": collectives})
            engine = zero_workers.init_engine(config)
            zero = engine.optimizer
            zero.comm.reset()
            log[:] = ["on"]
            engine.backward(engine(batches(0, 0, 0, FAKE_WORLD)))
            engine.step()
            out[collectives] = {"calls": log[1:], "cuts": zero.layout.bucket_cuts,
                                "forms": (zero.collective_forms.reduce_scatter, zero.collective_forms.all_gather),
                                # what CommCounter counted for the buckets (the norm's all-reduce left out)
                                "operations": {k: zero.comm.operations[k] for k in ("reduce_scatter", "all_gather")},
                                "counted_calls": {k: zero.comm.calls[k] for k in ("reduce_scatter", "all_gather")}}
            log[:] = ["off"]
    return out


def _expected_launches(cuts, forms) -> tuple[list, dict]:
    """Per bucket and collective: one padded call, or one grouped launch of a reduce / broadcast per non-empty segment."""
    from ds_canzona.plan.collectives import nonempty_segments

    calls, operations = [], {"reduce_scatter": 0, "all_gather": 0}
    for kind, kind_forms, padded_name, rooted in (("reduce_scatter", forms[0], "reduce_scatter_tensor", "reduce"),
                                                  ("all_gather", forms[1], "all_gather_into_tensor", "broadcast")):
        for bucket_cuts, form in zip(cuts, kind_forms):
            if form == "padded":
                calls.append(padded_name)
                operations[kind] += 1
            else:
                calls.append(("launch", (rooted,) * nonempty_segments(bucket_cuts)))
                operations[kind] += nonempty_segments(bucket_cuts)
    return calls, operations


def test_grouped_launches_once_per_bucket_with_one_operation_per_non_empty_segment_at_dp64():
    from ds_canzona.plan.collectives import bucket_forms

    (runs,) = run_ranks(_launches_at_64, 1, timeout=600)
    cuts = runs["grouped"]["cuts"]
    buckets = len(cuts)
    assert buckets > 1
    segments = sum(sum(b > a for a, b in zip(c, c[1:])) for c in cuts)
    assert segments < FAKE_WORLD * buckets  # empty segments exist, so fewer operations than an uneven list's P
    # The default is the cost model's choice on a backend that is not gloo (fp32 gradients and parameters here).
    chosen = bucket_forms(cuts, reduce_scatter_bytes=4, all_gather_bytes=4, backend="fake")
    assert runs["default"]["forms"] == (chosen.reduce_scatter, chosen.all_gather)
    assert "padded" in chosen.reduce_scatter  # the padded path runs too
    assert runs["grouped"]["forms"] == (("grouped",) * buckets,) * 2
    for name in ("default", "grouped"):
        calls, operations = _expected_launches(cuts, runs[name]["forms"])
        assert sorted(map(str, runs[name]["calls"])) == sorted(map(str, calls)), name
        assert runs[name]["operations"] == operations, name
        assert runs[name]["counted_calls"] == {"reduce_scatter": buckets, "all_gather": buckets}, name
    assert runs["grouped"]["operations"] == {"reduce_scatter": segments, "all_gather": segments}


def test_bucket_collectives_refuse_an_unknown_form_and_a_short_output():
    from ds_canzona.zero.comm import CommCounter, all_gather_bucket, reduce_scatter_bucket

    flat, cuts = torch.zeros(6), (0, 1, 6)
    with pytest.raises(ValueError, match="'grouped' or 'padded'"):
        all_gather_bucket(flat, cuts, 0, "default", group=None, counter=CommCounter())
    with pytest.raises(ValueError, match="writes 5 elements"):  # before any collective is issued
        reduce_scatter_bucket(torch.zeros(1), flat, cuts, "padded", group=None, counter=CommCounter(), async_op=False)


def test_plan_report_counts_the_operations_of_the_chosen_forms():
    from ds_canzona.plan.collectives import bucket_forms
    from ds_canzona.plan.report import format_collective_forms

    # One owner of 4 (grouped: 1 operation) and 3 owners of 4 forced grouped (3 operations).
    forms = bucket_forms([(0, 8, 8, 8, 8), (0, 4, 4, 9, 12)], reduce_scatter_bytes=4, all_gather_bytes=2,
                         backend="nccl", setting="grouped")
    assert forms.reduce_scatter_summary.operations == forms.all_gather_summary.operations == 4
    assert "2 grouped, 4 operations" in format_collective_forms(forms)
    padded = bucket_forms([(0, 8, 8, 8, 8), (0, 4, 4, 9, 12)], reduce_scatter_bytes=4, all_gather_bytes=2,
                          backend="nccl", setting="padded")
    assert "2 buckets padded, 0 grouped, 2 operations" in format_collective_forms(padded)


def test_plan_command_reports_the_forms_and_their_padding(capsys):
    import json

    from ds_canzona.cli import main
    from ds_canzona.plan.collectives import padding_numel

    assert main(["plan", "--model", "qwen3-0.6b", "--dp", "8", "--json", "--collectives", "padded"]) == 0
    document = json.loads(capsys.readouterr().out)
    cuts = [bucket["cuts"] for bucket in document["buckets"]]
    reduce_scatter = document["collectives"]["reduce_scatter"]
    assert reduce_scatter["forms"] == ["padded"] * len(cuts) and reduce_scatter["grouped"] == 0
    assert reduce_scatter["padding_bytes"] == 2 * sum(padding_numel(c) for c in cuts)  # bf16
    assert reduce_scatter["padded_s"] > reduce_scatter["grouped_s"]  # whole-tensor segments: padding costs more
    assert main(["plan", "--model", "qwen3-0.6b", "--dp", "8"]) == 0
    table = capsys.readouterr().out
    assert "collectives (default, backend nccl), per step:" in table and "0 buckets padded" in table
