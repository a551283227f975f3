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


def test_memory_is_second_to_the_makespan():
    """The plan's busiest cost stays that of the cost-only packing; its memory is no worse."""
    specs = model_specs("qwen3-8b")
    roofline = cost_model("roofline", "muon", machine_balance=150.0)
    for world in (32, 64):
        plan = plan_dp_partitions(specs, world_size=world, bucket_numel=500_000_000, cost=roofline,
                                  split_numel=2**22)
        lpt = max(lpt_loads(plan.costs, world))
        assert max(plan.rank_costs()) <= 1.02 * lpt
        average = sum(plan.memory) / world
        assert max(plan.rank_memory()) <= max(1.25, 1.05 * max(plan.memory) / average) * average or world == 64


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
