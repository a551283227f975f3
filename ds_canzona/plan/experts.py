"""Plans under expert parallelism: the dense tensors over the data-parallel world, the experts within
their expert-data-parallel group (pure; no process group).

With EP ranks of experts, EP rank r holds 1/EP of each MoE layer's experts; the W / EP ranks
with the same EP rank (its expert-data-parallel group) hold the same experts. So the runtime
(``ds_canzona.zero.expert_parallel``) plans two families with ``plan_dp_partitions``, each balanced
inside its own group: the dense tensors over W ranks, and one EP rank's local experts over W / EP
ranks. Every EP rank's expert plan has the same shapes, so one plan describes them all, up to
the experts' names.

Rank layout, as ``deepspeed.utils.groups`` makes it: EP groups are runs of EP consecutive ranks,
so world rank ``r`` is EP rank ``r % EP`` and rank ``r // EP`` of its expert-data-parallel group.
A rank's load is its dense share plus its expert share (``rank_costs``, ``rank_memory``).

Which tensors are experts: a name with ``experts.<i>.`` (HuggingFace's per-expert modules,
DeepSpeed's ``deepspeed_experts.<i>``), expert ``i`` of the layer named before it; or a fused 3-D
stack ``[experts, out, in]`` whose name contains ``experts``, split along its first dim.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from .dp import DPPlan, plan_dp_partitions
from .specs import ParamSpec, PlanError

__all__ = ["ExpertParallelPlan", "local_expert_specs", "plan_expert_parallel"]

_PER_EXPERT = re.compile(r"(^|\.)(?:deepspeed_)?experts\.(\d+)\.")


def _is_stack(spec: ParamSpec) -> bool:
    return len(spec.shape) == 3 and "experts" in spec.name


def local_expert_specs(specs: Sequence[ParamSpec], ep_size: int) -> tuple[list[ParamSpec], list[ParamSpec]]:
    """(dense specs, EP rank 0's expert specs): per-expert tensors of experts ``0 .. E/EP - 1`` of each
    layer, fused stacks cut to their first ``E/EP`` experts. Raises ``PlanError`` when a layer's
    expert count is not a multiple of ``ep_size``, or there are no experts."""
    if ep_size < 1:
        raise PlanError(f"Invalid expert-parallel size {ep_size}: must be a positive integer.")
    layer_experts: dict[str, set[int]] = {}
    for spec in specs:
        match = _PER_EXPERT.search(spec.name)
        if match is not None:
            layer_experts.setdefault(spec.name[:match.start(2)], set()).add(int(match.group(2)))
    dense, experts = [], []
    for spec in specs:
        match = _PER_EXPERT.search(spec.name)
        if match is not None:
            count = len(layer_experts[spec.name[:match.start(2)]])
            if count % ep_size:
                raise PlanError(f"{spec.name[:match.start(2)]}* has {count} experts, not a multiple of the "
                                f"expert-parallel size {ep_size}.")
            if int(match.group(2)) < count // ep_size:
                experts.append(spec)
        elif _is_stack(spec):
            if spec.shape[0] % ep_size:
                raise PlanError(f"{spec.name} stacks {spec.shape[0]} experts, not a multiple of the expert-parallel "
                                f"size {ep_size}.")
            experts.append(replace(spec, shape=(spec.shape[0] // ep_size, *spec.shape[1:])))
        else:
            dense.append(spec)
    if not experts:
        raise PlanError("no expert tensors found (names with 'experts.<i>.' or 3-D stacks named '*experts*'): "
                        "drop the expert-parallel size, or check the model")
    return dense, experts


@dataclass(frozen=True)
class ExpertParallelPlan:
    """The two families' plans: ``dense`` over the world, ``experts`` over one expert-data-parallel group."""

    ep_size: int
    dense: DPPlan | None  # None when every trained tensor is an expert
    experts: DPPlan

    @property
    def world_size(self) -> int:
        return self.experts.world_size * self.ep_size

    def _per_world_rank(self, dense: list[float], experts: list[float]) -> list[float]:
        return [(dense[r] if dense else 0.0) + experts[r // self.ep_size] for r in range(self.world_size)]

    def rank_costs(self) -> list[float]:
        return self._per_world_rank(self.dense.rank_costs() if self.dense else [], self.experts.rank_costs())

    def rank_memory(self) -> list[float]:
        return self._per_world_rank(self.dense.rank_memory() if self.dense else [], self.experts.rank_memory())

    @staticmethod
    def _ratio(loads: list[float]) -> float:
        mean = sum(loads) / len(loads)
        return max(loads) / mean if mean > 0 else 1.0

    @property
    def flops_ratio(self) -> float:
        """The busiest world rank's optimizer cost over the average (dense and expert shares together)."""
        return self._ratio(self.rank_costs())

    @property
    def state_bytes_ratio(self) -> float:
        return self._ratio(self.rank_memory())

    def to_dict(self) -> dict[str, Any]:
        return {"ep_size": self.ep_size, "world_size": self.world_size,
                "expert_data_parallel_size": self.experts.world_size,
                "cost_max_over_avg": self.flops_ratio, "state_bytes_max_over_avg": self.state_bytes_ratio,
                "dense": self.dense.to_dict() if self.dense else None, "experts": self.experts.to_dict()}


def plan_expert_parallel(specs: Sequence[ParamSpec], *, world_size: int, ep_size: int,
                         **plan_options: Any) -> ExpertParallelPlan:
    """Both families' plans; ``plan_options`` go to ``plan_dp_partitions`` for each (the same for both)."""
    if world_size % ep_size:
        raise PlanError(f"Invalid expert-parallel size {ep_size}: the world size {world_size} must be a multiple "
                        "of it.")
    dense, experts = local_expert_specs(specs, ep_size)
    dense_plan = plan_dp_partitions(dense, world_size=world_size, **plan_options) if dense else None
    expert_plan = plan_dp_partitions(experts, world_size=world_size // ep_size, **plan_options)
    return ExpertParallelPlan(ep_size=ep_size, dense=dense_plan, experts=expert_plan)
