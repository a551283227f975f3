"""The planner under expert parallelism (ds_canzona/plan/experts.py) and ``ds-canzona plan --ep``: one process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ds_canzona.cli import main
from ds_canzona.plan import ParamSpec, plan_dp_partitions
from ds_canzona.plan.experts import local_expert_specs, plan_expert_parallel
from ds_canzona.plan.specs import PlanError


def spec(name: str, shape: tuple[int, ...], matrix: bool) -> ParamSpec:
    return ParamSpec(name=name, shape=shape, matrix=matrix)


def _per_expert_model(layers: int = 2, experts: int = 8) -> list[ParamSpec]:
    """HuggingFace's per-expert layout: mlp.experts.<i>.{gate,up,down}_proj, and dense attention and router."""
    specs = [spec("embed_tokens.weight", (500, 64), False)]
    for layer in range(layers):
        specs += [spec(f"layers.{layer}.attn.q.weight", (64, 64), True),
                  spec(f"layers.{layer}.mlp.gate.weight", (experts, 64), True)]
        for e in range(experts):
            specs += [spec(f"layers.{layer}.mlp.experts.{e}.up_proj.weight", (96 + 8 * e, 64), True),
                      spec(f"layers.{layer}.mlp.experts.{e}.down_proj.weight", (64, 96 + 8 * e), True)]
    return specs + [spec("lm_head.weight", (500, 64), False)]


def test_local_experts_are_ep_rank_zeros_and_stacks_are_cut() -> None:
    dense, experts = local_expert_specs(_per_expert_model(), 4)
    assert {s.name.split("experts.")[1].split(".")[0] for s in experts} == {"0", "1"}  # 8 experts / EP 4
    assert len(experts) == 2 * 2 * 2 and all("experts" not in s.name for s in dense) and len(dense) == 6
    stack = [spec("m.experts.gate_up_proj", (8, 256, 64), True), spec("m.q.weight", (64, 64), True)]
    dense, experts = local_expert_specs(stack, 4)
    assert [s.shape for s in experts] == [(2, 256, 64)] and [s.name for s in dense] == ["m.q.weight"]
    # DeepSpeed's own naming is an expert too.
    _, experts = local_expert_specs([spec("moe.deepspeed_moe.experts.deepspeed_experts.1.up.weight", (8, 4),
                                               True), spec("moe.deepspeed_moe.experts.deepspeed_experts.0.up.weight",
                                                                (8, 4), True)], 2)
    assert [s.name for s in experts] == ["moe.deepspeed_moe.experts.deepspeed_experts.0.up.weight"]
    with pytest.raises(PlanError, match="not a multiple of the expert-parallel size 3"):
        local_expert_specs(_per_expert_model(), 3)
    with pytest.raises(PlanError, match="no expert tensors found"):
        local_expert_specs([spec("q.weight", (4, 4), True)], 2)


def test_each_family_is_the_plan_of_its_group_and_world_ranks_add_both() -> None:
    specs = _per_expert_model()
    options = {"bucket_numel": 40_000, "alpha": 1.0}
    plan = plan_expert_parallel(specs, world_size=8, ep_size=4, **options)
    dense, experts = local_expert_specs(specs, 4)
    # The same function the runtime's families call, on the same tensors and group sizes.
    assert plan.dense.digest() == plan_dp_partitions(dense, world_size=8, **options).digest()
    assert plan.experts.digest() == plan_dp_partitions(experts, world_size=2, **options).digest()
    assert plan.world_size == 8 and plan.experts.world_size == 2
    dense_costs, expert_costs = plan.dense.rank_costs(), plan.experts.rank_costs()
    assert plan.rank_costs() == [dense_costs[r] + expert_costs[r // 4] for r in range(8)]
    # Balanced inside the expert group: both ranks take experts (8 tensors of different sizes).
    assert min(plan.experts.rank_tensors()) >= 3 and plan.experts.flops_ratio < 1.1
    assert plan.flops_ratio >= 1.0 and plan.to_dict()["expert_data_parallel_size"] == 2
    with pytest.raises(PlanError, match="must be a multiple of it"):
        plan_expert_parallel(specs, world_size=6, ep_size=4)


def test_plan_cli_shows_both_families(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "moe.json"
    path.write_text(json.dumps([{"name": s.name, "shape": list(s.shape), "matrix": s.matrix}
                                for s in _per_expert_model()]))
    assert main(["plan", "--shapes", str(path), "--dp", "8", "--ep", "4", "--bucket-numel", "40000"]) == 0
    text = capsys.readouterr().out
    assert "family dense: 6 tensors over the 8 data-parallel ranks" in text
    assert "family experts: EP rank 0's 8 expert tensors over its 2 expert-data-parallel ranks" in text
    assert "per world rank (dense + experts): cost max/avg" in text
    assert main(["plan", "--shapes", str(path), "--dp", "8", "--ep", "4", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert (document["ep_size"], document["world_size"], document["experts"]["world_size"]) == (4, 8, 2)
    assert main(["plan", "--shapes", str(path), "--dp", "8", "--ep", "3"]) == 2
    assert "world size 8 must be a multiple" in capsys.readouterr().err
    assert main(["plan", "--shapes", str(path), "--dp", "8", "--ep", "2", "--stage", "3"]) == 2
    assert "--ep plans ZeRO-1/2" in capsys.readouterr().err
