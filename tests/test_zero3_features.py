"""Everyday DeepSpeed features at ZeRO stage 3 (owner placement), against plain torch and the single-process step.

One spawn at DP=2 builds a row of stage-3 engines (tests/zero3_workers.py ``feature_runs``), each
trained 2-3 steps with clipping on, on the models of the stage-1/2 tests; one at DP=3 repeats the
gradient-arrival cases (the first three and the next two below):

- activation checkpointing: a transformers Qwen3 with tied embedding and output head under
  ``gradient_checkpointing_enable(use_reentrant=True)`` (the recomputation fetches every layer's
  parameters a second time, the tied tensor is fetched for the embedding and the head); blocks
  under ``deepspeed.checkpointing.checkpoint`` with a Linear used inside every block (two
  gradients per backward) and a branch unused on the first step; the same without reentrant
  checkpointing;
- a matrix of the root module with a gradient on rank 0 only (the others reduce zeros);
- LoRA: every base parameter frozen (DeepSpeed's even layout) beside owner-placed adapters;
- numerics keys: fp16 with a static and a dynamic loss scale (where the accelerator has fp16),
  bf16 with ``data_types.grad_accum_dtype`` fp32, ``communication_data_type`` bf16, ``prescale_gradients``,
  ``gradient_predivide_factor``;
- param groups as ``model_parameters`` with an LR scheduler, a callable client optimizer,
  ``engine.compile()``.

For every step the averaged gradient each owner saw must lie within a stated bound of the mean
of per-(rank, micro-batch) gradients computed by plain torch without DeepSpeed (``_bound``), and
the sum instead of the mean must fall outside it; the owners' sums before the division must be the
plain-torch sums divided as the keys say; the parameters after the last step and the owners' fp32
masters must equal (torch.equal) the single-process ``ds_canzona.optim`` optimizer fed those
averaged gradients. Reentrant checkpointing that gives a parameter a second gradient after its
reduce (a Linear in two checkpointed segments, registered last) must raise, not lose it.
"""

from __future__ import annotations

import pytest
import torch
from deepspeed.accelerator import get_accelerator

from distributed import run_ranks
from grad_reference import UNDERFLOW, UNIT_ROUNDOFF, Replay, merged_grads, rank_gradients
from test_zero_stage12 import assert_params_equal
from tiny_model import make_checkpointed_model, make_hf_model, make_model
from zero3_workers import feature_runs, make_rank_gated_model, schedule
from zero_workers import make_config

CLIP = 1.0
MUON = {"type": "Muon", "params": {"lr": 0.02, "adam_lr": 0.003, "weight_decay": 0.01, "ns_method": "gram"}}
FP16_SCALE = 1024.0
FP16_SUPPORTED = get_accelerator().is_fp16_supported()
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

TINY = ("tiny", {})
HF_TIED_REENTRANT = ("hf", {"tie_word_embeddings": True, "checkpointing": True})
HF_LORA = ("hf", {"tie_word_embeddings": False, "checkpointing": False, "lora_rank": 4})
DEEPSPEED_CHECKPOINT = ("checkpointed", {"checkpoint": "deepspeed"})
NON_REENTRANT = ("checkpointed", {"checkpoint": "non_reentrant"})

# name: (model, top-level config keys, gradient accumulation, steps, worker flags,
#        (parameter, accumulation, communication dtype), pre-division ("W": the world size))
CASES = {
    "hf_tied_reentrant": (HF_TIED_REENTRANT, {}, 2, 2, {}, ("fp32", "fp32", "fp32"), 1),
    "hf_lora": (HF_LORA, {}, 2, 2, {}, ("fp32", "fp32", "fp32"), 1),
    # Steps 0 and 1: the branch unused on every rank, then used on every rank.
    "deepspeed_checkpoint": (DEEPSPEED_CHECKPOINT, {}, 2, 2, {"branch": True}, ("fp32", "fp32", "fp32"), 1),
    "non_reentrant_branch": (NON_REENTRANT, {}, 2, 2, {"branch": True}, ("fp32", "fp32", "fp32"), 1),
    # A root-module matrix used on no rank, on every rank, then on rank 0 only.
    "rank_dependent_gradient": (("rank_gated", {}), {}, 2, 3, {"branch": True}, ("fp32", "fp32", "fp32"), 1),
    "fp16": (TINY, {"fp16": {"enabled": True, "loss_scale": FP16_SCALE}}, 2, 2, {}, ("fp16", "fp16", "fp16"), 1),
    # Dynamic: starts at 2**10 = FP16_SCALE and keeps it (no overflow, window 1000 steps).
    "fp16_dynamic": (TINY, {"fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 10}}, 2, 2, {},
                     ("fp16", "fp16", "fp16"), 1),
    "bf16_accumulate_fp32": (TINY, {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}}, 2, 2, {},
                             ("bf16", "fp32", "bf16"), 1),
    "communicate_bf16": (TINY, {"communication_data_type": "bf16"}, 2, 2, {}, ("fp32", "fp32", "bf16"), 1),
    "prescale": (TINY, {"prescale_gradients": True}, 2, 2, {}, ("fp32", "fp32", "fp32"), "W"),
    "predivide": (TINY, {"gradient_predivide_factor": 2.0}, 2, 2, {}, ("fp32", "fp32", "fp32"), 2.0),
    "groups_scheduler": (TINY, {}, 1, 3, {"groups": True, "scheduler": True}, ("fp32", "fp32", "fp32"), 1),
    "client_optimizer": (TINY, {}, 1, 2, {"client": True}, ("fp32", "fp32", "fp32"), 1),
    "compile": (TINY, {}, 1, 2, {"compile": True}, ("fp32", "fp32", "fp32"), 1),
}
# Gradient arrival: also at DP=3, where two ranks of three lack the gradient of a rank-0-only use.
AT_DP3 = ["hf_tied_reentrant", "deepspeed_checkpoint", "non_reentrant_branch", "hf_lora", "rank_dependent_gradient"]
# ``shared`` registered last, so it is the first tensor reduced: block 2's gradient launches its
# reduce, block 1's (the reentrant recomputation's second backward) comes after it.
REENTRANT_REUSE = ("checkpointed", {"checkpoint": "reentrant", "shared_first": False, "branch": False})

# DeepSpeed's ZeRO-3 module hooks put extra autograd nodes around every module, so autograd sums a
# tensor's gradient contributions in another order than plain torch (test_zero3.BACKWARD_ORDER);
# compiled kernels fuse and reorder fp32 operations likewise. Relative to the tensor's largest mean
# entry; far below what a wrong average moves (the sum instead of the mean: checked on every step).
# Measured on these cases, everything but the sum's rounding included: fp32 at most 4.9e-7 (compile),
# fp16 7.1e-4 (1.5 fp16 roundings), bf16 4.0e-3 (1 bf16 rounding); the fp16 allowance is bf16's in
# units of its own roundoff (16 u).
BACKWARD_ORDER = {torch.float32: 2.0 ** -16, torch.bfloat16: 2.0 ** -4, torch.float16: 2.0 ** -7}


def _config(case: tuple, world_size: int) -> dict:
    _, top, ga, *_ = case
    config = make_config(world_size, stage=3, optimizer=MUON, gradient_accumulation_steps=ga, gradient_clipping=CLIP,
                         **top)
    # DeepSpeed's memory_efficient_linear swaps F.linear for its own autograd function (another
    # bias-gradient kernel, other roundings than the plain-torch reference), as in test_zero3.
    config["zero_optimization"]["memory_efficient_linear"] = False
    return config


def _names() -> list[str]:
    return [n for n, case in CASES.items() if case[5][0] != "fp16" or FP16_SUPPORTED]


@pytest.fixture(scope="module")
def spawned():
    """Per DP size: {case name: per-rank results}; DP=2 runs every case, DP=3 those of ``AT_DP3``."""
    cache: dict[int, dict[str, list[dict]]] = {}

    def get(world_size: int) -> dict[str, list[dict]]:
        if world_size not in cache:
            names = _names() if world_size == 2 else AT_DP3
            runs = [{"config": _config(CASES[n], world_size), "model": CASES[n][0], "steps": CASES[n][3],
                     **CASES[n][4]} for n in names]
            if world_size == 2:  # last: a run that raises leaves its engine behind
                runs.append({"config": _config((REENTRANT_REUSE, {}, 1), world_size), "model": REENTRANT_REUSE,
                             "steps": 1})
                names = names + ["reentrant_reuse"]
            results = run_ranks(feature_runs, world_size, runs, timeout=900)
            cache[world_size] = {name: [r[i] for r in results] for i, name in enumerate(names)}
        return cache[world_size]

    return get


def _factory(model: tuple[str, dict]):
    """The case's model for plain torch: torch's reentrant checkpoint in place of DeepSpeed's."""
    name, kwargs = model
    if name == "hf":
        return lambda: make_hf_model(**kwargs)
    if name == "checkpointed":
        checkpoint = "reentrant" if kwargs["checkpoint"] == "deepspeed" else kwargs["checkpoint"]
        return lambda: make_checkpointed_model(**{**kwargs, "checkpoint": checkpoint})
    if name == "rank_gated":
        return make_rank_gated_model
    return make_model


def _replay(name: str, model_factory, param_dtype: torch.dtype) -> tuple[Replay, object]:
    """The single-process optimizer the case's engine stands for, and its LR scheduler (or None)."""
    from ds_canzona.optim import Muon

    replay = Replay(MUON, model_factory, clip=CLIP, param_dtype=param_dtype)
    if name == "groups_scheduler":
        rest = [(n, p) for n, p in replay.named if p.ndim >= 2]
        no_decay = [(n, p) for n, p in replay.named if p.ndim < 2]
        # ds_canzona.optim's own keywords for zero3_workers.feature_groups: a group's lr and
        # weight_decay reach both halves (docs/OPTIMIZERS.md).
        replay.optimizer = Muon([{"params": rest},
                                 {"params": no_decay, "weight_decay": 0.0, "adam_weight_decay": 0.0, "lr": 0.001,
                                  "adam_lr": 0.001}],
                                lr=0.02, adam_lr=0.003, weight_decay=0.01, adam_weight_decay=0.01, ns_method="gram")
        return replay, torch.optim.lr_scheduler.LambdaLR(replay.optimizer, schedule)
    if name == "client_optimizer":  # the very call zero3_workers makes, on the single-process model
        replay.optimizer = Muon(replay.named, lr=0.02, adam_lr=0.003, weight_decay=0.01, ns_method="gram")
    return replay, None


def _bound(per_micro: list[dict[str, torch.Tensor]], *, world_size: int, param: torch.dtype, accumulate: torch.dtype,
           communicate: torch.dtype, pre: float, scale: float, ga: int) -> dict[str, torch.Tensor]:
    """Elementwise bound on |runtime's average - fp32 mean| of the per-(rank, micro-batch) gradients.

    The runtime sends each micro-batch's local gradient (rounded k times before the sum: a
    conversion to the communication dtype, a pre-division), sums W of them in the communication
    dtype (W - 1 roundings), accumulates GA such sums on the owner in the accumulation dtype (GA
    roundings with the conversion), then divides in fp32; the reference sums n = W * GA terms in
    fp32 and divides. So ((k + W - 1) u_c + GA u_a + (n + 3) u_32) * sum |g| / (W scale) (1 + 1e-3),
    plus n (k + 1) subnormal half-spacings of the communication dtype, plus the backward-order
    allowance of the parameter dtype.
    """
    n = len(per_micro)
    k = int(communicate != param) + int(pre != 1)
    u_c, u_a, u32 = UNIT_ROUNDOFF[communicate], UNIT_ROUNDOFF[accumulate], UNIT_ROUNDOFF[torch.float32]
    relative = ((k + world_size - 1) * u_c + ga * u_a + (n + 3) * u32) * (1 + 1e-3)
    absolute = n * (k + 1) * UNDERFLOW[communicate] / (world_size * scale)
    bound = {}
    for name in per_micro[0]:
        magnitude = sum(g[name].float().abs() for g in per_micro) / (world_size * scale)
        mean = sum(g[name].float() for g in per_micro) / (world_size * scale)
        bound[name] = relative * magnitude + absolute + BACKWARD_ORDER[param] * mean.abs().max()
    return bound


def _outside(got: dict, want: dict, bound: dict) -> dict[str, int]:
    return {n: bad for n, m in want.items()
            if (bad := int(((got[n].float().reshape(m.shape) - m).abs() > bound[n]).sum()))}


def _check(name: str, results: list[dict], world_size: int = 2) -> None:
    model, _, ga, steps, flags, dtypes, pre = CASES[name]
    param, accumulate, communicate = (DTYPES[d] for d in dtypes)
    pre = float(world_size) if pre == "W" else float(pre)
    scale = FP16_SCALE if param == torch.float16 else 1.0
    for r in results:
        assert "error" not in r and "init_error" not in r, r
        assert r["skipped"] == 0 and len(r["grads"]) == steps
        assert r["loss_scale"] == scale, (name, r["loss_scale"])
        assert r["accumulate_dtypes"] in ([], [str(accumulate)]), (name, r["accumulate_dtypes"])
    factory = _factory(model)
    replay, scheduler = _replay(name, factory, param)
    # Every tensor is reduced once per micro-batch in the communication dtype, frozen ones never.
    trainable_numel = sum(p.numel() for _, p in replay.named)
    assert all(r["reduce_bytes"] == trainable_numel * communicate.itemsize * ga * steps for r in results), name
    raw_steps = merged_grads([{"grads": r["raw"]} for r in results])
    for step, grads in enumerate(merged_grads(results)):
        assert set(grads) == {n for n, _ in replay.named}, name  # every trainable tensor, frozen ones not at all
        model_now = replay.model_in(param)
        per_micro = [rank_gradients(model_now, step=step, rank=rank, world_size=world_size, ga=ga, micros=[micro],
                                    branch=flags.get("branch", False), loss_scale=scale)
                     for rank in range(world_size) for micro in range(ga)]
        mean = {n: sum(g[n].float() for g in per_micro) / (world_size * scale) for n in per_micro[0]}
        bound = _bound(per_micro, world_size=world_size, param=param, accumulate=accumulate, communicate=communicate,
                       pre=pre, scale=scale, ga=ga)
        outside = _outside(grads, mean, bound)
        assert not outside, f"{name} step {step}: averaged gradient outside the bound: {outside}"
        assert _outside(grads, {n: m * world_size for n, m in mean.items()}, bound), f"{name}: the sum passes"
        # The owners' sums before the division after the reduce: each rank's share divided by ``pre``
        # (and still times the loss scale); a tensor that got no gradient anywhere may be absent.
        raw_want = {n: m * world_size / pre * scale for n, m in mean.items() if n in raw_steps[step]}
        raw_bound = {n: b * world_size / pre * scale for n, b in bound.items()}
        outside = _outside(raw_steps[step], raw_want, raw_bound)
        assert not outside, f"{name} step {step}: owners' sums outside the bound: {outside}"
        replay.step(grads)
        if scheduler is not None:
            scheduler.step()
    assert_params_equal(results[0]["params"], replay.params())
    masters = {n: m for r in results for n, m in r["masters"].items()}
    assert set(masters) == {n for n, _ in replay.named}
    assert_params_equal(masters, {n: p for n, p in replay.params(torch.float32).items() if n in masters})


@pytest.mark.parametrize("world_size,name", [(ws, name) for ws in (2, 3) for name in AT_DP3])
def test_checkpointing_tied_frozen_and_unused_parameters_equal_plain_torch_and_the_single_process_step(
        spawned, one_thread, world_size, name):
    _check(name, spawned(world_size)[name], world_size)


@pytest.mark.parametrize("name", ["fp16", "fp16_dynamic", "bf16_accumulate_fp32", "communicate_bf16", "prescale",
                                  "predivide"])
def test_numerics_keys_equal_plain_torch_and_the_single_process_step(spawned, one_thread, name):
    if CASES[name][5][0] == "fp16" and not FP16_SUPPORTED:
        pytest.skip("this accelerator has no fp16 (get_accelerator().is_fp16_supported())")
    _check(name, spawned(2)[name])


def test_param_groups_and_lr_scheduler_equal_the_single_process_step(spawned, one_thread):
    results = spawned(2)["groups_scheduler"]
    _check("groups_scheduler", results)
    settings = results[0]["group_settings"]
    no_decay = [g for g in settings if g["weight_decay"] == 0.0]
    assert no_decay and all(g["kind"] == "adamw" for g in no_decay)
    # The scheduler's edits reached every group before each step.
    first = results[0]["lrs"][0]
    for step, lrs in enumerate(results[0]["lrs"]):
        assert lrs == pytest.approx([lr * schedule(step) for lr in first]), step


def test_callable_client_optimizer_equals_the_single_process_step(spawned, one_thread):
    results = spawned(2)["client_optimizer"]
    _check("client_optimizer", results)
    kinds = results[0]["kinds"]
    assert kinds["embed_tokens.weight"] == "adamw" and kinds["layers.0.up_proj.weight"] == "muon"


def test_compiled_module_equals_plain_torch_and_the_single_process_step(spawned, one_thread):
    _check("compile", spawned(2)["compile"])


def test_second_gradient_after_the_reduce_raises(spawned):
    for r in spawned(2)["reentrant_reuse"]:
        assert "error" in r, "a gradient after its reduce to the owner did not raise"
        assert "'shared.weight' received a gradient after it was reduced" in r["error"]
        assert "use_reentrant=False" in r["error"]
