"""Bucket collectives (grouped, padded, allreduce): the choice, its config key, and every form at work.

- The choice (``ds_canzona.plan.collectives``) in one process: by default one operation per
  bucket and per gather group (a lone owner's reduce / broadcast, else padded or allreduce as the
  cost model prices them), the overrides, the constants, invalid settings; the config key's
  errors; the plan command's report.
- The all-reduced gather in one process against a recording stand-in: each rank's buffer as it
  enters the all-reduce, summed in every order, is the owners' values bit for bit (-0.0, inf,
  NaN, subnormals).
- Equal results, on 3 gloo ranks (one spawn): the tiny model's buckets at DP=3 have uneven
  segments and empty ones. Stage 2 grouped, padded and allreduce, stage 1 padded and allreduce,
  and stages 2 and 1 with the grouped reduce-scatter of other backends (a reduce per non-empty
  segment, switched on for gloo), train 3 steps on gradients rounded to multiples of 2**-20 (so
  the sum over ranks is exact in fp32 whatever order a collective adds in). The parameters of
  all eight are bitwise equal, and equal the single-process optimizer fed the runtime's
  averaged gradients.
- Launches at DP=64, in one process on torch's fake process group: per bucket one
  reduce_scatter_tensor (padded), one all_reduce (allreduce) or one grouped launch of a reduce
  per non-empty segment (grouped), the norm's all-reduce, then per gather group one launch of
  its form. The default gives one operation per bucket and per group.
- Gather groups in one process: the grouping at both extremes and between, the default's rule,
  launches per group and form, bad settings; the plan command's report of them.
- ZeRO-3 launches in one process: the priced form of a fetch or gradient bucket of owner-placed
  pieces (one piece alone, else padded or allreduce by the same cost model), and what "default"
  means per backend. The forms at work are tests/test_zero3.py (exact on gloo) and
  tests/test_zero3_collectives.py (one operation per launch at DP=8).
"""

from __future__ import annotations

import math

import pytest
import torch

from distributed import run_ranks

STEPS = 3
GRID = 2.0 ** -20


# --------------------------------------------------------------------------- the choice, one process
def test_default_is_one_operation_padded_or_all_reduced_as_the_cost_model_prices():
    from ds_canzona.plan.collectives import CollectiveCosts, choose_form, padding_numel

    costs = CollectiveCosts(launch_s=5e-6, bytes_per_s=50e9)
    cuts = (0, 100, 250, 250, 400)  # sizes 100, 150, 0, 150: padding 4 * 150 - 400 = 200 elements
    assert padding_numel(cuts) == 200
    # 3 ops (the empty segment issues none) of 10 us each; one op with the staging and 800 bytes of padding; one
    # all-reduce whose second pass moves the 1600 bytes again: the all-reduce, one operation, in place.
    assert costs.grouped_s(cuts) == pytest.approx(3 * 5e-6 * 2)
    assert costs.padded_s(cuts, 4) == pytest.approx(5e-6 * 2 + 2 * 5e-6 + 800 / 50e9)
    assert costs.all_reduce_s(cuts, 4) == pytest.approx(5e-6 * 2 + 1600 / 50e9)
    assert choose_form(cuts, element_bytes=4, backend="nccl") == "allreduce"
    # Large and nearly even: the padding (0.5e6 elements) costs less than a second pass of 3.5e6: padded.
    even = (0, 10**6, 2 * 10**6, 3 * 10**6, 3 * 10**6 + 5 * 10**5)
    assert costs.padded_s(even, 4) < costs.all_reduce_s(even, 4)
    assert choose_form(even, element_bytes=4, backend="nccl") == "padded"
    # Large and one big segment: 8.5e6 elements of padding against 3.5e6 again: the all-reduce.
    skewed = (0, 3 * 10**6, 3 * 10**6, 3 * 10**6, 3 * 10**6 + 5 * 10**5)
    assert choose_form(skewed, element_bytes=4, backend="nccl") == "allreduce"
    # A slower wire makes the staging's two launches cheap against bytes: 10 elements of padding then beat 390.
    near = (0, 100, 200, 300, 390)
    assert choose_form(near, element_bytes=4, backend="nccl") == "allreduce"
    assert choose_form(near, element_bytes=4, backend="nccl", costs=CollectiveCosts(bytes_per_s=1e8)) == "padded"
    # Equal segments: nothing to pad, no staging: padded at any size.
    assert choose_form((0, 10**9, 2 * 10**9), element_bytes=4, backend="nccl") == "padded"
    assert choose_form((0, 3, 6), element_bytes=4, backend="nccl") == "padded"


def test_one_operation_at_every_world_size_and_one_owner_keeps_its_reduce():
    from ds_canzona.plan.collectives import CollectiveCosts, choose_form, form_operations, nonempty_segments

    costs = CollectiveCosts()
    assert costs.latency_s(2) == costs.latency_s(1) == costs.launch_s
    assert costs.latency_s(1024) == pytest.approx(10 * costs.launch_s)
    # One rank holding the whole bucket: one reduce / broadcast, however many ranks; nothing else is one operation
    # with no extra byte.
    numel = 2_000_000
    at_1024 = (0, numel) + (numel,) * 1023
    assert nonempty_segments(at_1024) == 1
    assert choose_form(at_1024, element_bytes=2, backend="nccl") == "grouped"
    assert form_operations("grouped", at_1024) == 1
    # 256 equal owners among 1024 ranks: grouped would be 256 operations; the padding (3x the data) costs more
    # than the all-reduce's second pass, small or large.
    for scale in (1_000, 1_000_000):
        cuts = tuple(min(r, 256) * scale for r in range(1025))
        assert nonempty_segments(cuts) == 256 == form_operations("grouped", cuts)
        assert choose_form(cuts, element_bytes=2, backend="nccl") == "allreduce"
        assert form_operations("allreduce", cuts) == form_operations("padded", cuts) == 1
    assert form_operations("allreduce", (0, 5)) == 0  # one rank: no collective


def test_settings_override_gloo_and_one_rank():
    from ds_canzona.plan.collectives import bucket_forms, choose_form

    cuts = (0, 10, 20, 30, 30)
    assert choose_form(cuts, element_bytes=4, backend="gloo") == "grouped"  # gloo's default: measured
    assert choose_form(cuts, element_bytes=4, backend="nccl") == "allreduce"
    assert choose_form(cuts, element_bytes=4, backend="nccl", setting="grouped") == "grouped"
    assert choose_form(cuts, element_bytes=4, backend="gloo", setting="padded") == "padded"
    assert choose_form(cuts, element_bytes=4, backend="gloo", setting="allreduce") == "allreduce"
    assert choose_form((0, 7), element_bytes=4, backend="nccl", setting="padded") == "grouped"  # no collective
    all_cuts = [cuts, (0, 5, 10, 15, 20), (0, 8, 8, 8, 8)]
    forms = bucket_forms(all_cuts, reduce_scatter_bytes=4, all_gather_bytes=2, backend="nccl")
    # Per bucket (no groups given): uneven -> all-reduced, equal -> padded, one owner -> its one reduce / broadcast.
    assert forms.reduce_scatter == forms.all_gather == ("allreduce", "padded", "grouped")
    assert (forms.reduce_scatter_summary.padding_bytes, forms.all_gather_summary.padding_bytes) == (0, 0)
    assert (forms.reduce_scatter_summary.second_pass_bytes, forms.all_gather_summary.second_pass_bytes) == (120, 60)
    assert forms.reduce_scatter_summary.bucket_bytes == 58 * 4
    assert forms.all_gather_summary.extra_fraction == pytest.approx(60 / 116)
    assert forms.reduce_scatter_summary.operations == forms.all_gather_summary.operations == 3
    padded = bucket_forms(all_cuts, reduce_scatter_bytes=4, all_gather_bytes=2, backend="nccl", setting="padded")
    # Forced: 4 * 10 - 30 = 10 padding elements in the first bucket, none in the second (equal), 4 * 8 - 8 = 24 in
    # the third (one owner, padded all the same).
    assert (padded.reduce_scatter_summary.padding_bytes, padded.all_gather_summary.padding_bytes) == (136, 68)
    assert padded.all_gather_summary.padding_fraction == pytest.approx(68 / 116)


def test_a_gather_group_is_one_operation():
    from ds_canzona.plan.collectives import bucket_forms, choose_gather_form

    group = [(0, 10, 20, 30, 30), (0, 5, 10, 15, 20), (0, 8, 8, 8, 8)]
    # Several buckets with several owners: one all-reduce over the group's buffer (padded gathers: one per bucket).
    assert choose_gather_form(group, element_bytes=2, backend="nccl") == "allreduce"
    assert choose_gather_form(group, element_bytes=2, backend="gloo") == "grouped"
    assert choose_gather_form(group, element_bytes=2, backend="nccl", setting="padded") == "padded"
    # Every bucket of the group owned by one rank: its broadcasts, one per bucket, in one launch.
    assert choose_gather_form([(0, 8, 8, 8, 8), (0, 4, 4, 4, 4)], element_bytes=2, backend="nccl") == "grouped"
    # A group of one bucket is that bucket's choice.
    assert choose_gather_form([(0, 5, 10, 15, 20)], element_bytes=2, backend="nccl") == "padded"
    forms = bucket_forms(group, reduce_scatter_bytes=4, all_gather_bytes=2, backend="nccl",
                         gather_groups=((0, 1, 2),))
    assert forms.all_gather == ("allreduce",) * 3 and forms.all_gather_summary.operations == 1
    assert forms.reduce_scatter_summary.operations == 3  # a reduce-scatter per bucket, one operation each
    assert forms.gather_groups == ((0, 1, 2),)
    with pytest.raises(ValueError, match="do not cover"):
        bucket_forms(group, reduce_scatter_bytes=4, all_gather_bytes=2, backend="nccl", gather_groups=((0, 2),))


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


# --------------------------------------------------------------------------- gather groups, one process
def test_gather_groups_at_both_extremes_and_between():
    from ds_canzona.plan.gather_groups import all_gather_group_count, all_gather_groups

    assert all_gather_groups(5, 1) == ((0, 1, 2, 3, 4),)  # one launch after the whole update
    assert all_gather_groups(5, "per_bucket") == ((0,), (1,), (2,), (3,), (4,))  # one launch per bucket
    # Consecutive, as even as possible, the earlier groups the larger: the last one (nothing hides its gather) is small.
    assert all_gather_groups(17, 5) == ((0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10), (11, 12, 13), (14, 15, 16))
    assert all_gather_groups(6, 3) == ((0, 1), (2, 3), (4, 5))
    assert all_gather_groups(2, 9) == ((0,), (1,))  # more groups than buckets: one per bucket
    assert all_gather_groups(0, "per_bucket") == all_gather_groups(0) == ()
    for buckets in range(1, 40):
        for setting in (1, 2, 3, 7, "per_bucket", "default"):
            groups = all_gather_groups(buckets, setting)
            assert [b for g in groups for b in g] == list(range(buckets))
            assert len(groups) == all_gather_group_count(buckets, setting)
            assert max(map(len, groups)) - min(map(len, groups)) <= 1


def test_default_issues_as_many_gather_launches_as_deepspeed_stage2():
    from ds_canzona.plan.gather_groups import DEEPSPEED_STAGE2_ALL_GATHERS, all_gather_group_count

    assert DEEPSPEED_STAGE2_ALL_GATHERS == 2
    assert all_gather_group_count(17) == all_gather_group_count(66) == 2  # Qwen3-8B, Qwen3-32B at 5e8 elements
    assert all_gather_group_count(1) == 1
    # A step: B reduce-scatters + G all-gathers + 1 norm all-reduce; DeepSpeed's at least B + 1 + 2.
    for buckets in (1, 2, 17, 66):
        assert buckets + all_gather_group_count(buckets) + 1 <= buckets + 1 + DEEPSPEED_STAGE2_ALL_GATHERS


def test_launches_per_group_count_each_form_once():
    from ds_canzona.plan.gather_groups import all_gather_groups, all_gather_launches, step_launches

    forms = ("grouped", "padded", "grouped", "grouped", "padded")
    assert all_gather_launches(all_gather_groups(5, 1), forms, 8) == 2  # one launch per form, never mixed
    assert all_gather_launches(all_gather_groups(5, "per_bucket"), forms, 8) == 5
    assert all_gather_launches(((0, 1, 2), (3, 4)), forms, 8) == 4
    assert all_gather_launches(((0, 1, 2), (3, 4)), forms, 1) == 0  # one rank: nothing gathered
    assert step_launches(((0, 1, 2), (3, 4)), ("grouped",) * 5, 64) == {"reduce_scatter": 5, "all_gather": 2,
                                                                         "all_reduce": 1}
    with pytest.raises(ValueError, match="do not cover"):
        all_gather_launches(((0, 1), (3, 4)), forms, 8)


@pytest.mark.parametrize("bad", [0, -2, True, 2.5, "auto", "2", None])
def test_gather_groups_reject_bad_settings(bad):
    from ds_canzona.config import CanzonaConfigError, parse_canzona_section
    from ds_canzona.plan.gather_groups import all_gather_groups

    with pytest.raises(ValueError):
        all_gather_groups(4, bad)
    with pytest.raises(CanzonaConfigError, match="canzona.all_gather_groups"):
        parse_canzona_section({"canzona": {"all_gather_groups": bad}})


def test_gather_groups_config_key():
    from ds_canzona.config import parse_canzona_section

    assert parse_canzona_section({"canzona": {}}).all_gather_groups == "default"
    for value in (1, 4, "per_bucket", "default"):
        assert parse_canzona_section({"canzona": {"all_gather_groups": value}}).all_gather_groups == value


def test_gather_groups_need_a_bucket_count():
    from ds_canzona.plan.gather_groups import all_gather_groups

    for buckets in (-1, 2.0, True):
        with pytest.raises(ValueError, match="buckets"):
            all_gather_groups(buckets, 1)


# --------------------------------------------------------------------------- both forms on 3 gloo ranks
def _on_grid(grad: torch.Tensor) -> torch.Tensor:
    return torch.round(grad / GRID) * GRID


def _gridded_model():
    from tiny_model import make_model

    model = make_model()
    for param in model.parameters():
        param.register_hook(_on_grid)
    return model


# (name, stage, canzona.collectives, canzona.all_gather_groups): both gather-group extremes on each form.
GLOO_ENGINES = (("grouped2", 2, "grouped", "per_bucket"), ("grouped2_one_gather", 2, "grouped", 1),
                ("padded2", 2, "padded", 1), ("padded1", 1, "padded", "per_bucket"),
                ("owners2", 2, "grouped", "default"), ("owners1", 1, "grouped", 1),
                ("allreduce2", 2, "allreduce", "default"), ("allreduce1", 1, "allreduce", "per_bucket"))


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
    for name, stage, collectives, gather_groups in GLOO_ENGINES:
        # owners*: the grouped reduce-scatter of other backends (a reduce per non-empty segment) run on gloo.
        bucket_comm._REDUCE_TO_OWNERS_ON_GLOO = name.startswith("owners")
        config = zero_workers.make_config(world_size, stage=stage, canzona={"collectives": collectives,
                                                                            "all_gather_groups": gather_groups})
        try:
            result = zero_workers.train(rank, world_size, config, STEPS, model_name="gridded")
        finally:
            bucket_comm._REDUCE_TO_OWNERS_ON_GLOO = False
        zero = captured["zero"]
        result["cuts"] = zero.layout.bucket_cuts
        result["gather_groups"] = zero.gather_groups
        result["forms"] = (zero.collective_forms.reduce_scatter, zero.collective_forms.all_gather)
        result["calls"] = dict(zero.comm.calls)
        result["operations"] = dict(zero.comm.operations)
        result["padding"] = dict(zero.comm.padding)
        out[name] = result
    return out


def test_padded_and_grouped_forms_are_bitwise_equal_and_the_single_process_step(gloo_runs):
    from ds_canzona.plan.gather_groups import all_gather_groups
    from test_zero_stage12 import assert_params_equal, merged_grads, single_process_replay
    from zero_workers import BASE_CONFIG

    rank0 = gloo_runs[0]
    cuts = rank0["padded2"]["cuts"]
    sizes = [[c[r + 1] - c[r] for r in range(3)] for c in cuts]
    assert any(0 in s for s in sizes), f"no bucket has an empty segment: {sizes}"
    assert any(len({x for x in s if x}) > 1 for s in sizes), f"no bucket has uneven non-empty segments: {sizes}"
    buckets = len(cuts)
    assert buckets > 2  # so one gather group, two (the default) and one per bucket all differ
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
    for name, _, _, setting in GLOO_ENGINES:
        assert rank0[name]["gather_groups"] == all_gather_groups(buckets, setting)
    # gloo cannot group: a padded bucket in a gather group of several is still a gather of its own.
    assert rank0["padded2"]["calls"]["all_gather"] == rank0["padded1"]["calls"]["all_gather"]
    assert rank0["padded2"]["calls"]["all_gather"] % buckets == 0
    assert rank0["grouped2_one_gather"]["calls"]["broadcast"] == rank0["grouped2"]["calls"]["broadcast"]
    for name, _, _, _ in GLOO_ENGINES:
        results = [r[name] for r in gloo_runs]
        for r in results[1:]:
            assert_params_equal(results[0]["params"], r["params"])
        replay = single_process_replay(BASE_CONFIG["optimizer"], merged_grads(results), clip=1.0)
        assert_params_equal(results[0]["params"], replay)
    # The all-reduce forms: one call per bucket's reduce-scatter and one per gather group's all-gather.
    for name, _, _, setting in GLOO_ENGINES[-2:]:
        assert rank0[name]["forms"] == (("allreduce",) * buckets,) * 2
        reductions = rank0[name]["calls"]["reduce_scatter"]
        assert reductions % buckets == 0 and rank0[name]["operations"]["reduce_scatter"] == reductions
        gathers = rank0[name]["calls"]["all_gather"]
        assert gathers % len(all_gather_groups(buckets, setting)) == 0
        assert rank0[name]["operations"]["all_gather"] == gathers
    assert rank0["allreduce2"]["calls"]["all_gather"] < rank0["allreduce1"]["calls"]["all_gather"]
    assert_params_equal(rank0["grouped2"]["params"], rank0["padded2"]["params"])
    for name in ("grouped2_one_gather", "padded1", "owners2", "owners1", "allreduce2", "allreduce1"):
        assert_params_equal(rank0["grouped2"]["params"], rank0[name]["params"])


# --------------------------------------------------------------------------- launches at DP=64, one process
FAKE_WORLD = 64
BUCKET_COLLECTIVES = ("reduce_scatter", "reduce_scatter_tensor", "all_gather", "all_gather_into_tensor", "broadcast",
                      "reduce", "all_reduce")


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


# (canzona.collectives, canzona.all_gather_groups) of the engines counted at DP=64.
LAUNCH_CASES = (("default", "default"), ("grouped", "default"), ("grouped", "per_bucket"), ("padded", 1),
                ("allreduce", "per_bucket"), ("default", 1))


def _launches_at_64(rank: int, world_size: int) -> dict:
    from fake_world import fake_world
    from tiny_model import batches
    import zero_workers

    out = {}
    with fake_world(0, FAKE_WORLD):
        log: list = ["off"]
        _record_bucket_collectives(log)
        for collectives, groups in LAUNCH_CASES:
            canzona = {"collectives": collectives, "all_gather_groups": groups}
            config = zero_workers.make_config(FAKE_WORLD, stage=2, gradient_accumulation_steps=1, canzona=canzona)
            engine = zero_workers.init_engine(config)
            zero = engine.optimizer
            zero.comm.reset()
            log[:] = ["on"]
            engine.backward(engine(batches(0, 0, 0, FAKE_WORLD)))
            engine.step()
            out[(collectives, groups)] = {
                "calls": log[1:], "cuts": zero.layout.bucket_cuts, "groups": zero.gather_groups,
                "forms": (zero.collective_forms.reduce_scatter, zero.collective_forms.all_gather),
                # what CommCounter counted for the buckets (the norm's all-reduce left out)
                "operations": {k: zero.comm.operations[k] for k in ("reduce_scatter", "all_gather")},
                "counted_calls": {k: zero.comm.calls[k] for k in ("reduce_scatter", "all_gather")},
                "summary": zero.plan_summary()}
            log[:] = ["off"]
    return out


def _expected_launches(cuts, forms, groups) -> tuple[list, list, dict]:
    """(reduce-scatter launches, all-gather launches in order, operations), from the cuts, forms and gather groups.

    Per bucket one padded reduce-scatter, one all-reduce, or one grouped launch of a reduce per
    non-empty segment; per gather group one launch of a broadcast per non-empty segment of its
    grouped buckets, one of an all_gather_into_tensor per padded bucket, and one all-reduce of the
    group's buffer where its buckets are all-reduced (each only where the group has such buckets).
    """
    from ds_canzona.plan.collectives import nonempty_segments

    single = {"padded": "reduce_scatter_tensor", "allreduce": "all_reduce"}
    reduce_scatters = [("launch", ("reduce",) * nonempty_segments(c)) if form == "grouped" else single[form]
                       for c, form in zip(cuts, forms[0])]
    gathers = []
    for group in groups:
        broadcasts = sum(nonempty_segments(cuts[b]) for b in group if forms[1][b] == "grouped")
        padded = sum(forms[1][b] == "padded" for b in group)
        if broadcasts:
            gathers.append(("launch", ("broadcast",) * broadcasts))
        if padded:
            gathers.append(("launch", ("all_gather_into_tensor",) * padded))
        if any(forms[1][b] == "allreduce" for b in group):
            gathers.append("all_reduce")
    operations = {"reduce_scatter": sum(1 if form != "grouped" else nonempty_segments(c)
                                        for c, form in zip(cuts, forms[0])),
                  "all_gather": sum(1 if form == "padded" else nonempty_segments(c)
                                    for c, form in zip(cuts, forms[1]) if form != "allreduce")
                  + sum(1 for g in groups if any(forms[1][b] == "allreduce" for b in g))}
    return reduce_scatters, gathers, operations


def test_launches_at_dp64_are_one_operation_per_bucket_and_per_gather_group_and_the_norm():
    from ds_canzona.plan.collectives import bucket_forms
    from ds_canzona.plan.gather_groups import all_gather_groups

    (runs,) = run_ranks(_launches_at_64, 1, timeout=600)
    cuts = runs[LAUNCH_CASES[0]]["cuts"]
    buckets = len(cuts)
    assert buckets > 2
    segments = sum(sum(b > a for a, b in zip(c, c[1:])) for c in cuts)
    assert segments < FAKE_WORLD * buckets  # empty segments exist, so fewer operations than an uneven list's P
    assert segments > 2 * buckets  # and grouped is more than one operation per bucket
    # The default is one operation each, priced by the cost model, on a backend that is not gloo (fp32 here).
    chosen = bucket_forms(cuts, reduce_scatter_bytes=4, all_gather_bytes=4, backend="fake",
                          gather_groups=all_gather_groups(buckets))
    assert runs[("default", "default")]["forms"] == (chosen.reduce_scatter, chosen.all_gather)
    assert "allreduce" in chosen.reduce_scatter and set(chosen.all_gather) == {"allreduce"}
    assert runs[("grouped", "default")]["forms"] == (("grouped",) * buckets,) * 2
    assert runs[("padded", 1)]["forms"] == (("padded",) * buckets,) * 2
    assert runs[("allreduce", "per_bucket")]["forms"] == (("allreduce",) * buckets,) * 2
    for case, run in runs.items():
        collectives, setting = case
        groups = all_gather_groups(buckets, setting)
        assert run["groups"] == groups, case
        reduce_scatters, gathers, operations = _expected_launches(cuts, run["forms"], groups)
        calls = run["calls"]
        # Reduce-scatters in backward (buckets last first), the norm's all-reduce, then the gathers in plan order.
        assert sorted(map(str, calls[:buckets])) == sorted(map(str, reduce_scatters)), case
        assert calls[buckets] == "all_reduce", case
        assert calls[buckets + 1:] == gathers, case
        assert run["operations"] == operations, case
        assert run["counted_calls"] == {"reduce_scatter": buckets, "all_gather": len(gathers)}, case
        assert f"= {len(calls)}" in run["summary"], run["summary"]  # the plan summary's count of launches per step
    # One form per group: launches per step = buckets + groups + 1; by default each of them one operation.
    assert len(runs[("grouped", "default")]["calls"]) == buckets + 2 + 1
    assert len(runs[("grouped", "per_bucket")]["calls"]) == 2 * buckets + 1
    assert len(runs[("padded", 1)]["calls"]) == buckets + 1 + 1
    assert runs[("default", "default")]["operations"] == {"reduce_scatter": buckets, "all_gather": 2}
    assert runs[("default", 1)]["operations"] == {"reduce_scatter": buckets, "all_gather": 1}
    assert runs[("grouped", "default")]["operations"] == {"reduce_scatter": segments, "all_gather": segments}


def test_bucket_collectives_refuse_an_unknown_form_and_a_short_output():
    from ds_canzona.zero.comm import CommCounter, all_gather_buckets, reduce_scatter_bucket

    flat, cuts = torch.zeros(6), (0, 1, 6)
    with pytest.raises(ValueError, match="one of .'grouped', 'padded', 'allreduce'., got 'default'"):
        all_gather_buckets([flat], [cuts], 0, ["default"], group=None, counter=CommCounter())
    with pytest.raises(ValueError, match="writes 5 elements"):  # before any collective is issued
        reduce_scatter_bucket(torch.zeros(1), flat, cuts, "padded", group=None, counter=CommCounter(), async_op=False)


def test_plan_report_counts_the_operations_of_the_chosen_forms():
    from ds_canzona.plan.collectives import bucket_forms
    from ds_canzona.plan.report import format_collective_forms

    # One owner of 4 (grouped: 1 operation) and 3 owners of 4 forced grouped (3 operations).
    forms = bucket_forms([(0, 8, 8, 8, 8), (0, 4, 4, 9, 12)], reduce_scatter_bytes=4, all_gather_bytes=2,
                         backend="nccl", setting="grouped")
    assert forms.reduce_scatter_summary.operations == forms.all_gather_summary.operations == 4
    assert "0 all-reduced, 2 grouped, 4 operations" in format_collective_forms(forms)
    padded = bucket_forms([(0, 8, 8, 8, 8), (0, 4, 4, 9, 12)], reduce_scatter_bytes=4, all_gather_bytes=2,
                          backend="nccl", setting="padded")
    assert "2 buckets padded, 0 all-reduced, 0 grouped, 2 operations" in format_collective_forms(padded)
    # The default: the one owner keeps its reduce, the three owners' bucket is one all-reduce; one gather group of
    # both is one all-reduce.
    default = bucket_forms([(0, 8, 8, 8, 8), (0, 4, 4, 9, 12)], reduce_scatter_bytes=4, all_gather_bytes=2,
                           backend="nccl", gather_groups=((0, 1),))
    report = format_collective_forms(default)
    assert "reduce-scatter: 0 buckets padded, 1 all-reduced, 1 grouped, 2 operations" in report
    assert "all-gather: 0 buckets padded, 2 all-reduced, 0 grouped, 1 operations" in report


def test_plan_command_reports_the_forms_and_their_padding(capsys):
    import json

    from ds_canzona.cli import main
    from ds_canzona.plan.collectives import padding_numel
    from ds_canzona.plan.gather_groups import all_gather_groups

    assert main(["plan", "--model", "qwen3-0.6b", "--dp", "8", "--json", "--collectives", "padded"]) == 0
    document = json.loads(capsys.readouterr().out)
    cuts = [bucket["cuts"] for bucket in document["buckets"]]
    reduce_scatter = document["collectives"]["reduce_scatter"]
    assert reduce_scatter["forms"] == ["padded"] * len(cuts) and reduce_scatter["grouped"] == 0
    assert reduce_scatter["padding_bytes"] == 2 * sum(padding_numel(c) for c in cuts)  # bf16
    assert reduce_scatter["padded_s"] > reduce_scatter["grouped_s"]  # whole-tensor segments: padding costs more
    groups = document["all_gather_groups"]
    assert groups["setting"] == "default" and groups["groups"] == [list(g) for g in all_gather_groups(len(cuts))]
    # Padded everywhere: one all-gather launch per group, one reduce-scatter per bucket, the norm.
    assert groups["launches_per_step"] == {"reduce_scatter": len(cuts), "all_gather": 2, "all_reduce": 1}
    assert main(["plan", "--model", "qwen3-0.6b", "--dp", "8"]) == 0
    table = capsys.readouterr().out
    assert "collectives (default, backend nccl), per step:" in table and "0 buckets padded" in table
    assert "all-gather groups (default): 2 groups" in table and f"= {len(cuts) + 3}" in table
    assert main(["plan", "--model", "qwen3-0.6b", "--dp", "8", "--all-gather-groups", "per_bucket"]) == 0
    assert f"{len(cuts)} all-gather + 1 norm all-reduce = {2 * len(cuts) + 1}" in capsys.readouterr().out


def test_all_reduced_gather_of_a_group_is_each_owners_values_bit_for_bit(monkeypatch):
    """The allreduce all-gather in one process: each of 3 ranks' buffers as it enters the all-reduce (a recorded
    stand-in for it), summed in fp32 in every order a backend could add them, is the owners' values exactly:
    -0.0, +0.0, inf, NaN and subnormals included, in a group of three buckets with empty and uneven segments."""
    import itertools

    import deepspeed.comm as dist
    from ds_canzona.zero import comm

    world = 3
    bucket_cuts = [(0, 4, 4, 9), (0, 0, 6, 6), (0, 2, 5, 7)]  # rank 1 owns nothing in bucket 0's middle, etc.
    sizes = [c[-1] for c in bucket_cuts]
    specials = torch.tensor([-0.0, 0.0, float("inf"), -float("inf"), float("nan"), 1e-45, -1e-45, 3.5, -2.0])
    truth = torch.cat([specials, torch.randn(sum(sizes) - len(specials))])
    entered = []
    monkeypatch.setattr(dist, "all_reduce", lambda tensor, group=None, **_: entered.append(tensor.clone()))
    for rank in range(world):
        buffer = torch.randn(sum(sizes))  # stale values everywhere but this rank's own segments
        flats = list(torch.split(buffer, sizes))
        start = 0
        for flat, cuts, size in zip(flats, bucket_cuts, sizes):
            flat[cuts[rank]:cuts[rank + 1]] = truth[start + cuts[rank]:start + cuts[rank + 1]]
            start += size
        counter = comm.CommCounter()
        comm.all_gather_buckets(flats, bucket_cuts, rank, ["allreduce"] * 3, group=None, counter=counter,
                                buffer=buffer)
        assert counter.calls["all_gather"] == 1 and counter.operations["all_gather"] == 1
    for order in itertools.permutations(range(world)):
        total = entered[order[0]]
        for r in order[1:]:
            total = total + entered[r]
        assert torch.equal(total.view(torch.int32)[~truth.isnan()], truth.view(torch.int32)[~truth.isnan()]), order
        assert torch.equal(total.isnan(), truth.isnan())
    # Without the buffer each all-reduced bucket is an all-reduce of its own; buckets not views of it are refused.
    entered.clear()
    buffer = torch.zeros(sum(sizes))
    comm.all_gather_buckets(list(torch.split(buffer, sizes)), bucket_cuts, 0, ["allreduce"] * 3, group=None,
                            counter=comm.CommCounter())
    assert [t.numel() for t in entered] == sizes
    with pytest.raises(ValueError, match="consecutive views"):
        comm.all_gather_buckets([torch.zeros(s) for s in sizes], bucket_cuts, 0, ["allreduce"] * 3, group=None,
                                counter=comm.CommCounter(), buffer=buffer)


# --------------------------------------------------------------------------- ZeRO-3 launches, one process
def test_zero3_launch_is_one_operation_priced_on_the_owners_segments():
    """A fetch or gradient bucket of (length, owner) pieces: one piece goes alone, several take padded or allreduce."""
    from ds_canzona.plan.collectives import ALL_REDUCE, GROUPED, PADDED, CollectiveCosts, choose_piece_form, \
        owner_cuts, padding_numel
    from ds_canzona.zero.stage3_comm import PRICED, launch_form

    assert owner_cuts([(5, 2), (3, 0), (4, 2)], 4) == (0, 3, 3, 12, 12)
    costs = CollectiveCosts()
    # One piece (even at 1024 ranks), or one rank: its own broadcast / reduce, nothing staged.
    assert choose_piece_form([(10**6, 7)], world_size=1024, element_bytes=2) == GROUPED
    assert choose_piece_form([(5, 0), (6, 0)], world_size=1, element_bytes=2) == GROUPED
    # Equal segments on every rank: padded costs no padding, so it beats the all-reduce's second pass.
    even = [(1000, r) for r in range(8)]
    assert padding_numel(owner_cuts(even, 8)) == 0
    assert choose_piece_form(even, world_size=8, element_bytes=2) == PADDED
    # Three owners among 64 ranks: padding 61 segments costs more than passing the data twice.
    few = [(4096, 3), (4096, 17), (1024, 40)]
    assert choose_piece_form(few, world_size=64, element_bytes=2) == ALL_REDUCE
    # A lone owner of several pieces: one operation still means one staged buffer, priced the same way.
    assert choose_piece_form([(100, 5), (100, 5)], world_size=16, element_bytes=2) == ALL_REDUCE
    # The choice follows the prices: where bytes are slow and segments nearly even, padded wins.
    nearly_even = [(10**6, r) for r in range(7)] + [(10**6 - 10, 7)]
    assert choose_piece_form(nearly_even, world_size=8, element_bytes=2) == PADDED
    slow_launches = CollectiveCosts(launch_s=1.0)  # the padded form's two staging launches then dominate
    assert choose_piece_form(nearly_even, world_size=8, element_bytes=2, costs=slow_launches) == ALL_REDUCE
    # The modes: priced asks the cost model, the others are what they say.
    for mode in ("per_piece", "grouped", "padded", "allreduce"):
        assert launch_form(mode, few, world_size=64, element_bytes=2, costs=costs) == mode
    assert launch_form(PRICED, few, world_size=64, element_bytes=2, costs=costs) == ALL_REDUCE
    with pytest.raises(ValueError, match="unknown ZeRO-3 collectives mode"):
        launch_form("scatter", few, world_size=64, element_bytes=2, costs=costs)


def test_zero3_default_is_priced_off_gloo_and_per_piece_on_gloo(monkeypatch):
    import ds_canzona.zero.stage3_comm as stage3_comm

    for backend, expected in (("gloo", "per_piece"), ("nccl", "priced"), ("fake", "priced")):
        monkeypatch.setattr(stage3_comm, "backend_name", lambda group, name=backend: name)
        assert stage3_comm.zero3_collectives("default", None) == expected
        for setting in ("grouped", "padded", "allreduce"):
            assert stage3_comm.zero3_collectives(setting, None) == setting
    with pytest.raises(ValueError, match="canzona.collectives must be one of"):
        stage3_comm.zero3_collectives("per_piece", None)
