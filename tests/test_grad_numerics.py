"""The averaged gradient against plain torch, and DeepSpeed's gradient numerics keys.

One spawn at DP=3 (ZeRO stage 2) and one at DP=2 (stage 1) each train a row of engines on
TinyLM with gradient accumulation 3, 2 steps, clipping on. For each, the averaged gradient every
owner sees (``CanzonaZeroOptimizer.owned_gradients``) is compared with the mean of per-rank
gradients that plain torch computes without DeepSpeed (tests/grad_reference.py): the two use the
same per-rank gradients, so they may differ only by the order and precision of the sum over
ranks and by the divisions, which ``sum_order_bound`` bounds elementwise. The same bound must
reject a wrong averaging factor and a micro-batch counted twice, and a bf16 accumulation where
``grad_accum_dtype`` asks for fp32. Parameters after the last step must equal (torch.equal) the
single-process ds_canzona.optim optimizer fed the same averaged gradients, fp32 masters included
(bf16 end to end at DP 2 and 3).
"""

from __future__ import annotations

import pytest
import torch
from deepspeed.accelerator import get_accelerator

from distributed import run_ranks
from grad_reference import Replay, mean_gradient, merged_grads, outside_bound, rank_gradients, sum_order_bound
from test_zero_stage12 import assert_params_equal
from tiny_model import make_model
from zero_workers import make_config, train_runs

MUON = {"type": "Muon", "params": {"lr": 0.02, "adam_lr": 0.003, "weight_decay": 0.01, "ns_method": "gram"}}
CLIP, GA, STEPS = 1.0, 3, 2
FP16_SCALE = 1024.0
FP16_SUPPORTED = get_accelerator().is_fp16_supported()
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# name: (top-level config keys, parameter dtype, accumulation dtype, communication dtype, pre-division)
# (W in the pre-division means the world size)
CASES = {
    "fp32": ({}, "fp32", "fp32", "fp32", 1),
    "fp32_prescale": ({"prescale_gradients": True}, "fp32", "fp32", "fp32", "W"),
    "fp32_predivide": ({"gradient_predivide_factor": 2.0}, "fp32", "fp32", "fp32", 2),
    "fp32_communicate_bf16": ({"communication_data_type": "bf16"}, "fp32", "fp32", "bf16", 1),
    "bf16": ({"bf16": {"enabled": True}}, "bf16", "bf16", "bf16", 1),
    "bf16_accumulate_fp32": ({"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}},
                             "bf16", "fp32", "bf16", 1),
    "bf16_accumulate_and_communicate_fp32": ({"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"},
                                              "communication_data_type": "fp32"}, "bf16", "fp32", "fp32", 1),
    "fp16": ({"fp16": {"enabled": True, "loss_scale": FP16_SCALE}}, "fp16", "fp16", "fp16", 1),
}
SPAWNS = {3: (2, list(CASES)), 2: (1, ["fp32", "bf16", "bf16_accumulate_and_communicate_fp32", "fp16"])}
REFUSED = {
    "accumulate_below_parameters": ({"data_types": {"grad_accum_dtype": "bf16"}}, "data_types.grad_accum_dtype"),
    "predivide_zero": ({"gradient_predivide_factor": 0.0}, "gradient_predivide_factor"),
}


def _config(world_size: int, stage: int, top: dict) -> dict:
    return make_config(world_size, stage=stage, optimizer=MUON, gradient_accumulation_steps=GA, **top)


@pytest.fixture(scope="module")
def spawned():
    """Per DP size: {case name: per-rank results}, every engine of that size trained in one spawn."""
    cache: dict[int, dict[str, list[dict]]] = {}

    def get(world_size: int) -> dict[str, list[dict]]:
        if world_size not in cache:
            stage, names = SPAWNS[world_size]
            names = [n for n in names if DTYPES[CASES[n][1]] != torch.float16 or FP16_SUPPORTED]
            runs = [{"config": _config(world_size, stage, CASES[n][0]), "model": ("tiny", {}), "steps": STEPS,
                     "raw": True} for n in names]
            if world_size == 2:  # refused at init; last, after the engines that train
                names = names + list(REFUSED)
                runs += [{"config": _config(world_size, stage, top), "model": ("tiny", {}), "steps": 1}
                         for top, _ in REFUSED.values()]
            results = run_ranks(train_runs, world_size, runs, timeout=900)
            cache[world_size] = {name: [r[i] for r in results] for i, name in enumerate(names)}
        return cache[world_size]

    return get


def _check_case(name: str, results: list[dict], world_size: int, *, wrong: dict | None = None) -> None:
    """Averaged gradients within the bound of plain torch's mean at every step, raw sums likewise,
    each ``wrong`` variant outside it, and parameters and fp32 masters bit-equal to the replay."""
    _, param, accumulate, communicate, pre = CASES[name]
    param, accumulate, communicate = DTYPES[param], DTYPES[accumulate], DTYPES[communicate]
    pre = world_size if pre == "W" else pre
    scale = FP16_SCALE if param == torch.float16 else 1.0
    # Roundings of each rank's buffer before the sum: a conversion to the communication dtype and
    # a pre-division, where there is one.
    roundings = int(accumulate != communicate) + int(pre != 1)
    for r in results:
        assert "error" not in r and "init_error" not in r, r
        assert r["skipped"] == 0 and r["segment_dtypes"] == [str(communicate)], (name, r["segment_dtypes"])
        assert r["flat_dtypes"] in ([], [str(accumulate)]), (name, r["flat_dtypes"])  # stage 2 keeps none
    replay = Replay(MUON, make_model, clip=CLIP, param_dtype=param)
    raw_steps = merged_grads([{"grads": r["raw"]} for r in results])
    for step, grads in enumerate(merged_grads(results)):
        model = replay.model_in(param)
        per_rank = [rank_gradients(model, step=step, rank=rank, world_size=world_size, ga=GA, loss_scale=scale,
                                   accumulate_dtype=accumulate if accumulate != param else None)
                    for rank in range(world_size)]
        bound = sum_order_bound(per_rank, communicate_dtype=communicate, roundings_before_sum=roundings,
                                loss_scale=scale)
        mean = mean_gradient(per_rank, divide_by=world_size, loss_scale=scale)
        outside = outside_bound(grads, mean, bound)
        assert not outside, f"{name} step {step}: averaged gradient outside the bound: {outside}"
        if world_size == 2 and accumulate == communicate == torch.float32 and pre == 1:
            # fp32 a + b is the same number in either order: nothing is left to differ.
            assert all(torch.equal(grads[n].reshape(m.shape), m) for n, m in mean.items()), name
        # Before the division after the sum: each rank's share was divided by ``pre`` before it.
        raw_bound = {n: b * (world_size / pre) * scale for n, b in bound.items()}
        outside = outside_bound(raw_steps[step], mean_gradient(per_rank, divide_by=pre), raw_bound)
        assert not outside, f"{name} step {step}: reduced sums outside the bound: {outside}"
        for label, variant in (wrong or {}).items():
            assert outside_bound(grads, variant(model, step, per_rank), bound), \
                f"{name} step {step}: the bound does not reject {label}"
        replay.step(grads)
    assert_params_equal(results[0]["params"], replay.params())
    masters = {n: m for r in results for n, m in r["masters"].items()}
    assert_params_equal(masters, {n: p for n, p in replay.params(torch.float32).items() if n in masters})
    assert set(masters) == {n for n, _ in replay.named}


def _recomputed(world_size: int, **kwargs):
    def variant(model, step, _):
        return mean_gradient([rank_gradients(model, step=step, rank=rank, world_size=world_size, ga=GA, **kwargs)
                              for rank in range(world_size)], divide_by=world_size)
    return variant


@pytest.mark.parametrize("world_size", [3, 2])
def test_fp32_average_is_plain_torch_mean_and_wrong_averages_are_rejected(spawned, one_thread, world_size):
    wrong = {
        "the sum instead of the mean": lambda model, step, per_rank: mean_gradient(per_rank, divide_by=1),
        "a mean over ranks and micro-batches": lambda model, step, per_rank: mean_gradient(
            per_rank, divide_by=world_size * GA),
        "the last micro-batch counted twice": _recomputed(world_size, micros=[0, 1, 2, 2]),
        "a micro-batch left out": _recomputed(world_size, micros=[0, 1]),
    }
    _check_case("fp32", spawned(world_size)["fp32"], world_size, wrong=wrong)


@pytest.mark.parametrize("name", ["fp32_prescale", "fp32_predivide", "fp32_communicate_bf16"])
def test_prescale_predivide_and_communication_dtype_follow_deepspeed(spawned, one_thread, name):
    _check_case(name, spawned(3)[name], 3)


@pytest.mark.parametrize("world_size", [3, 2])
def test_bf16_end_to_end_equals_the_single_process_step(spawned, one_thread, world_size):
    """bf16 parameters, gradients accumulated and summed in bf16 (DeepSpeed's defaults), fp32 masters."""
    _check_case("bf16", spawned(world_size)["bf16"], world_size)


@pytest.mark.parametrize("world_size,name", [(3, "bf16_accumulate_fp32"), (3, "bf16_accumulate_and_communicate_fp32"),
                                             (2, "bf16_accumulate_and_communicate_fp32")])
def test_bf16_with_grad_accum_dtype_fp32_accumulates_in_fp32(spawned, one_thread, world_size, name):
    wrong = {}
    if CASES[name][3] == "fp32":
        # All in fp32 after each micro-batch's bf16 backward: the bound is fp32's, and a bf16
        # accumulation (DeepSpeed's default, grad_accum_dtype unset) falls outside it.
        wrong["accumulated in bf16"] = _recomputed(world_size)
    _check_case(name, spawned(world_size)[name], world_size, wrong=wrong)


@pytest.mark.skipif(not FP16_SUPPORTED, reason="this accelerator has no fp16 (get_accelerator().is_fp16_supported())")
@pytest.mark.parametrize("world_size", [3, 2])
def test_fp16_with_loss_scaling_averages_like_plain_torch(spawned, one_thread, world_size):
    _check_case("fp16", spawned(world_size)["fp16"], world_size)


def test_numerics_keys_that_cannot_be_honoured_are_refused_at_init(spawned):
    results = spawned(2)
    for name, (_, key) in REFUSED.items():
        for r in results[name]:
            assert "init_error" in r and key in r["init_error"], (name, r)


@pytest.mark.parametrize("keys,pre,post", [
    ({}, 1.0, 3.0),
    ({"postscale_gradients": False}, 3.0, 1.0),
    ({"postscale_gradients": False, "gradient_predivide_factor": 2.0}, 3.0, 1.0),  # prescale wins, as in DeepSpeed
    ({"gradient_predivide_factor": 2.0}, 2.0, 1.5),
    ({"gradient_average": False, "gradient_predivide_factor": 2.0}, 1.0, 1.0),  # gradient_allreduce_op "sum"
])
def test_pre_and_post_division_follow_deepspeeds_rules(keys, pre, post):
    from ds_canzona.zero.reduction import gradient_reduction
    reduction = gradient_reduction(param_dtype=torch.bfloat16, world_size=3, **keys)
    assert (reduction.pre_divide, reduction.post_divide) == (pre, post)
    assert reduction.accumulate_dtype == reduction.communicate_dtype == torch.bfloat16  # DeepSpeed's defaults


class _Engine:
    """The few engine methods ``gradient_numerics`` reads."""

    def __init__(self, param, accumulate, predivide=1.0, communicate=None):
        self._types, self._predivide, self.communication_data_type = (param, accumulate), predivide, communicate
        self.gradient_average = True

    def get_data_types(self):
        return self._types

    def gradient_predivide_factor(self):
        return self._predivide

    def postscale_gradients(self):
        return True


@pytest.mark.parametrize("engine,key", [
    (_Engine(torch.float32, torch.bfloat16), "data_types.grad_accum_dtype bf16 with fp32 parameters"),
    (_Engine(torch.float16, torch.bfloat16), "data_types.grad_accum_dtype bf16 with fp16 parameters"),
    (_Engine(torch.bfloat16, torch.float16), "data_types.grad_accum_dtype fp16 with bf16 parameters"),
    (_Engine(torch.float32, torch.float32, predivide=-1.0), "gradient_predivide_factor"),
    (_Engine(torch.float32, torch.float32, predivide=float("nan")), "gradient_predivide_factor"),
])
def test_numerics_that_cannot_be_honoured_name_their_key(engine, key):
    from ds_canzona.config import CanzonaConfigError
    from ds_canzona.zero.build import gradient_numerics
    with pytest.raises(CanzonaConfigError, match=key):
        gradient_numerics(engine)


def test_accepted_numerics_pass_through():
    from ds_canzona.zero.build import gradient_numerics
    numerics = gradient_numerics(_Engine(torch.bfloat16, torch.float32, predivide=2, communicate=torch.float32))
    assert numerics == {"grad_accum_dtype": torch.float32, "communication_dtype": torch.float32,
                        "gradient_predivide_factor": 2.0, "postscale_gradients": True, "gradient_average": True}
