"""Gradients that do not arrive exactly once per backward, at DP 2 and 3, ZeRO stage 1 and 2, GA 1 and 3.

Four models, each trained at ZeRO stage 1 and 2 and gradient accumulation 1 and 3, all sixteen
engines built one after the other in one spawn per DP size:

- ``hf_tied_reentrant``: a transformers Qwen3 whose embedding and output head are one parameter
  (``tie_word_embeddings``), under ``gradient_checkpointing_enable(use_reentrant=True)``: each
  layer's gradients arrive in a nested backward;
- ``hf_lora``: the same architecture with every base parameter frozen and LoRA adapters the only
  trainable tensors, under ``use_reentrant=False``;
- ``deepspeed_checkpoint``: blocks under ``deepspeed.checkpointing.checkpoint`` (reentrant), a
  Linear used inside every block (two gradients per backward: stage 2 must notice and reduce after
  backward) and a branch that gets no gradient on the first step, one on every rank on the second
  and on rank 0 only on the third;
- ``branch``: the same without reentrant checkpointing (every gradient once), so stage 2 reduces
  during backward, on the ranks that take the branch, and at the end of backward on the others:
  the ranks launch their reduce-scatters at different times, in the same order.

For every step the runtime's averaged gradients must lie within the summation-order bound of
the mean of per-rank gradients computed by plain torch (tests/grad_reference.py; at DP=2 the
sum of two terms is the same in either order, so there they must be equal), and the
parameters after the last step must equal, bit for bit, the single-process optimizer's fed the
runtime's gradients. A gradient that would be lost (a second gradient for a bucket already
reduce-scattered) must raise instead.
"""

from __future__ import annotations

import pytest
import torch

from distributed import run_ranks
from grad_reference import Replay, mean_gradient, merged_grads, outside_bound, rank_gradients, sum_order_bound
from test_zero_stage12 import assert_params_equal
from tiny_model import make_checkpointed_model, make_hf_model, uses_branch
from zero_workers import make_config, train_runs

MUON = {"type": "Muon", "params": {"lr": 0.02, "adam_lr": 0.003, "weight_decay": 0.01, "ns_method": "gram"}}
CLIP = 1.0

# name: (model: name in zero_workers.MODELS and its kwargs, bucket size, branch)
SCENARIOS = {
    "hf_tied_reentrant": (("hf", {"tie_word_embeddings": True, "checkpointing": True}), 20_000, False),
    "hf_lora": (("hf", {"tie_word_embeddings": False, "checkpointing": False, "lora_rank": 4}), 2_000, False),
    "deepspeed_checkpoint": (("checkpointed", {"checkpoint": "deepspeed"}), 4_000, True),
    "branch": (("checkpointed", {"checkpoint": "non_reentrant"}), 4_000, True),
}
STEPS = 3  # the branch: unused everywhere, used everywhere, used on rank 0 only


def _runs(world_size: int) -> list[dict]:
    runs = []
    for stage in (1, 2):
        for name, (model, bucket_numel, branch) in SCENARIOS.items():
            for ga in (1, 3):
                config = make_config(world_size, stage=stage, optimizer=MUON, gradient_accumulation_steps=ga,
                                     canzona={"bucket_numel": bucket_numel})
                runs.append({"name": name, "stage": stage, "ga": ga, "config": config, "model": model,
                             "steps": STEPS, "branch": branch})
    return runs


def _reference_model(model: tuple[str, dict]):
    """The scenario's model for plain torch: torch's reentrant checkpoint instead of DeepSpeed's."""
    name, kwargs = model
    if name == "hf":
        return lambda: make_hf_model(**kwargs)
    checkpoint = "reentrant" if kwargs["checkpoint"] == "deepspeed" else kwargs["checkpoint"]
    return lambda: make_checkpointed_model(**{**kwargs, "checkpoint": checkpoint})


def _check_run(run: dict, results: list[dict], world_size: int) -> None:
    label = f"{run['name']} stage {run['stage']} GA={run['ga']}"
    for r in results[1:]:
        assert_params_equal(results[0]["params"], r["params"])  # every rank holds the same model
    replay = Replay(MUON, _reference_model(run["model"]), clip=CLIP)
    for step, grads in enumerate(merged_grads(results)):
        per_rank = [rank_gradients(replay.model, step=step, rank=rank, world_size=world_size, ga=run["ga"],
                                   branch=run["branch"]) for rank in range(world_size)]
        assert set(grads) == set(per_rank[0]), label  # every trainable tensor, frozen ones not at all
        bound = sum_order_bound(per_rank, communicate_dtype=torch.float32, roundings_before_sum=0)
        mean = mean_gradient(per_rank, divide_by=world_size)
        outside = outside_bound(grads, mean, bound)
        assert not outside, f"{label} step {step}: elements outside the summation-order bound {outside}"
        if world_size == 2:  # fp32 a + b is the same number in either order: nothing is left to differ
            assert all(torch.equal(grads[n].reshape(m.shape), m) for n, m in mean.items()), label
        replay.step(grads)
    assert_params_equal(results[0]["params"], replay.params())


LATE = {
    # A second engine.backward before engine.step: the first already reduced everything.
    "double_backward": {"model": ("tiny", {}), "double_backward": True, "bucket_numel": 4000, "stages": (1, 2)},
    # ``shared`` alone in the first bucket to leave: its first gradient (block 2) completes the
    # bucket, which stage 2 reduce-scatters at once; block 1's gradient then comes too late.
    "reentrant_reuse": {"model": ("checkpointed", {"checkpoint": "reentrant", "shared_first": False, "branch": False}),
                        "bucket_numel": 600, "stages": (2,)},
}


@pytest.mark.parametrize("world_size", [2, 3])
def test_irregular_gradients_equal_plain_torch_and_the_single_process_step(one_thread, world_size):
    runs = _runs(world_size)
    late = []
    if world_size == 2:  # the errors, after the scenarios (a run that raises leaves its engine behind)
        for name, case in LATE.items():
            for stage in case["stages"]:
                config = make_config(world_size, stage=stage, optimizer=MUON, gradient_accumulation_steps=1,
                                     canzona={"bucket_numel": case["bucket_numel"]})
                late.append({"name": name, "stage": stage, "config": config, "model": case["model"], "steps": 1,
                             "double_backward": case.get("double_backward", False)})
    results = run_ranks(train_runs, world_size, runs + late, timeout=900)
    for i, run in enumerate(runs):
        per_rank = [r[i] for r in results]
        assert all("error" not in r for r in per_rank), (run["name"], per_rank[0].get("error"))
        _check_run(run, per_rank, world_size)
        if run["stage"] == 1:
            continue
        launched = [r["launched_before_flush"] for r in per_rank]  # per rank, per step
        if run["name"] == "deepspeed_checkpoint":
            # ``shared`` got two gradients per backward: this engine stopped reducing during backward.
            assert not any(r["early_launch"] for r in per_rank)
            assert all(n == 0 for steps in launched for n in steps), launched
        elif run["name"] == "branch":
            # ``branch`` is in the first bucket to leave: a rank that does not use it on a step
            # reduces only at the flush, one that does reduces during backward, in the same order.
            for step in range(STEPS):
                users = [uses_branch(step, rank) for rank in range(world_size)]
                assert [n > 0 for n in (steps[step] for steps in launched)] == users, (step, launched)
        else:
            assert all(r["early_launch"] for r in per_rank), run["name"]
            assert all(n > 0 for steps in launched for n in steps), (run["name"], launched)
    for i, run in enumerate(late, start=len(runs)):
        for r in results:
            assert "error" in r[i], f"{run['name']}: a gradient after its bucket's reduce-scatter did not raise"
            if run["name"] == "double_backward":
                assert "arrived after this step's gradients were reduce-scattered" in r[i]["error"]
            else:
                assert "'shared.weight' received a second gradient" in r[i]["error"]
                assert "use_reentrant=False" in r[i]["error"]
