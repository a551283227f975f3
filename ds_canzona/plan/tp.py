"""Tensor-parallel micro-groups (the paper's Algorithm 2).

Under TP a matrix is split across the ``tp_size`` ranks of its TP group, and a matrix optimizer
needs it whole. Each TP-sharded matrix gets one *host* rank in its TP group, which gathers the
shards, computes the update and scatters the slices back. Matrices travel in micro-groups: one
all-to-all gathers a whole group to its hosts, so a group is sized to keep every host's gathered
bytes within a capacity ``C_max``, and the pipeline overlaps one group's communication with
another's compute.

Construction: matrices sorted by cost (costliest first, ties by index) join the open group one at
a time; the group's tasks are placed on hosts by LPT (a min-heap of host loads); if a host's
gathered bytes would pass ``C_max``, the matrix is rolled back, the group closes and a new one
opens with it. A matrix larger than ``C_max`` on its own gets a group of its own.
"""

from __future__ import annotations

import hashlib
import heapq
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .cost import CostModel, cost_model
from .specs import ParamSpec, PlanError

__all__ = ["MicroGroup", "TPPlan", "plan_tp_hosts", "plan_tp_micro_groups"]

DEFAULT_CAPACITY_BYTES = 512 * 2**20  # the paper saw no gain above ~512 MB


@dataclass(frozen=True, kw_only=True)
class MicroGroup:
    """One micro-group: its params (indices into the specs, costliest first) and their hosts."""

    index: int
    params: tuple[int, ...]
    hosts: tuple[int, ...]
    rank_costs: tuple[float, ...]
    rank_bytes: tuple[int, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "params": list(self.params),
            "hosts": list(self.hosts),
            "rank_costs": list(self.rank_costs),
            "rank_bytes": list(self.rank_bytes),
        }


@dataclass(frozen=True, kw_only=True)
class TPPlan:
    """Micro-groups for one TP group, the same on every TP rank."""

    tp_size: int
    capacity_bytes: int
    bytes_per_element: int
    cost_model: str
    cost_label: str
    specs: tuple[ParamSpec, ...]
    groups: tuple[MicroGroup, ...]

    def rank_costs(self) -> list[float]:
        """Cost each TP rank hosts, over all groups."""
        return [sum(group.rank_costs[rank] for group in self.groups) for rank in range(self.tp_size)]

    def rank_bytes(self) -> list[int]:
        return [sum(group.rank_bytes[rank] for group in self.groups) for rank in range(self.tp_size)]

    @property
    def flops_ratio(self) -> float:
        return _max_over_mean(self.rank_costs())

    @property
    def memory_ratio(self) -> float:
        return _max_over_mean(self.rank_bytes())

    def to_dict(self) -> dict[str, Any]:
        return {
            "tp_size": self.tp_size,
            "capacity_bytes": self.capacity_bytes,
            "bytes_per_element": self.bytes_per_element,
            "cost_model": self.cost_model,
            "cost_label": self.cost_label,
            "groups": [group.to_dict() for group in self.groups],
            "ranks": [{"cost": c, "bytes": b} for c, b in zip(self.rank_costs(), self.rank_bytes())],
            "flops_ratio": self.flops_ratio,
            "memory_ratio": self.memory_ratio,
        }

    def digest(self) -> str:
        content = {
            "tp_size": self.tp_size,
            "capacity_bytes": self.capacity_bytes,
            "bytes_per_element": self.bytes_per_element,
            "cost_label": self.cost_label,
            "params": [[s.name, list(s.shape), s.matrix, s.tp_dim, s.tp_size] for s in self.specs],
            "groups": [[list(g.params), list(g.hosts)] for g in self.groups],
        }
        canonical = json.dumps(content, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
        return hashlib.sha256(canonical.encode("ascii")).hexdigest()


def plan_tp_micro_groups(
    specs: Sequence[ParamSpec],
    *,
    tp_size: int,
    capacity_bytes: int = DEFAULT_CAPACITY_BYTES,
    cost: CostModel | None = None,
    bytes_per_element: int = 4,
) -> TPPlan:
    """Micro-groups of the TP-sharded matrices in ``specs`` (those with ``tp_size > 1``).

    ``capacity_bytes`` is C_max: the most bytes of gathered full matrices one host holds in one
    group; ``bytes_per_element`` is the gradient's element size (4 for fp32 gradients). Host
    ranks are indices within the TP group.
    """
    specs = tuple(specs)
    _check_sizes(tp_size, capacity_bytes, bytes_per_element)
    sharded = [index for index, spec in enumerate(specs) if spec.matrix and spec.tp_size > 1]
    for index in sharded:
        if specs[index].tp_size != tp_size:
            raise PlanError(f"Invalid tp_size={tp_size}: {specs[index].name!r} is split {specs[index].tp_size} ways.")
    model = cost if cost is not None else cost_model("roofline", "muon")
    # The host computes the full update, so a task costs the whole matrix's work.
    task_cost = {index: model.cost(specs[index]) * specs[index].tp_size for index in sharded}
    return _plan(specs, sharded, task_cost, tp_size=tp_size, capacity_bytes=capacity_bytes, model=model,
                 bytes_per_element=bytes_per_element)


def plan_tp_hosts(
    specs: Sequence[ParamSpec],
    *,
    tp_size: int,
    capacity_bytes: int = DEFAULT_CAPACITY_BYTES,
    cost: CostModel | None = None,
    bytes_per_element: int = 4,
) -> TPPlan:
    """Micro-groups and hosts for whole matrices given by their logical (unsharded) specs.

    The runtime's entry point: AutoTP splits can be uneven (whole KV heads per rank), so the
    runtime plans every sharded matrix by its logical shape, priced as the whole matrix's update,
    and every rank of the TP group gets the same plan.
    """
    specs = tuple(specs)
    _check_sizes(tp_size, capacity_bytes, bytes_per_element)
    model = cost if cost is not None else cost_model("roofline", "muon")
    indices = list(range(len(specs)))
    task_cost = {index: model.cost(specs[index]) for index in indices}
    return _plan(specs, indices, task_cost, tp_size=tp_size, capacity_bytes=capacity_bytes, model=model,
                 bytes_per_element=bytes_per_element)


def _check_sizes(tp_size: int, capacity_bytes: int, bytes_per_element: int) -> None:
    for name, value in (
        ("tp_size", tp_size),
        ("capacity_bytes", capacity_bytes),
        ("bytes_per_element", bytes_per_element),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PlanError(f"Invalid {name}={value!r}: must be a positive integer.")


def _plan(specs: tuple[ParamSpec, ...], tasks: list[int], task_cost: dict[int, float], *, tp_size: int,
          capacity_bytes: int, model: CostModel, bytes_per_element: int) -> TPPlan:
    """Algorithm 2 over ``tasks`` (indices into ``specs``), each costing ``task_cost`` on its host."""
    task_bytes = {index: _full_numel(specs[index]) * bytes_per_element for index in tasks}
    order = sorted(tasks, key=lambda index: (-task_cost[index], index))

    # First fit, costliest first: a task goes into the first group it fits in (its hosts' gathered
    # bytes within C_max), else opens a group. The paper's next fit closes a group at the first
    # task that does not fit; first fit lets the smaller tasks that follow fill the room left, so
    # fewer groups (each one launch on the TP group) hold the same tasks.
    packed: list[list[int]] = []
    for index in order:
        for members in packed:
            if _lpt(members + [index], task_cost, task_bytes, tp_size)[2] <= capacity_bytes:
                members.append(index)
                break
        else:
            packed.append([index])
    groups = [_group(number, members, task_cost, task_bytes, tp_size) for number, members in enumerate(packed)]
    return TPPlan(
        tp_size=tp_size,
        capacity_bytes=capacity_bytes,
        bytes_per_element=bytes_per_element,
        cost_model=model.name,
        cost_label=model.label,
        specs=specs,
        groups=tuple(groups),
    )


def _lpt(
    members: Sequence[int], task_cost: dict[int, float], task_bytes: dict[int, int], tp_size: int
) -> tuple[list[int], list[float], int, list[int]]:
    """Hosts by LPT on cost: (host per member, cost per rank, the largest bytes per rank, bytes per rank)."""
    heap = [(0.0, rank) for rank in range(tp_size)]
    costs = [0.0] * tp_size
    sizes = [0] * tp_size
    hosts = []
    for index in members:  # already costliest first
        load, rank = heapq.heappop(heap)
        costs[rank] = load + task_cost[index]
        sizes[rank] += task_bytes[index]
        hosts.append(rank)
        heapq.heappush(heap, (costs[rank], rank))
    return hosts, costs, max(sizes), sizes


def _group(
    number: int, members: list[int], task_cost: dict[int, float], task_bytes: dict[int, int], tp_size: int
) -> MicroGroup:
    hosts, costs, _, sizes = _lpt(members, task_cost, task_bytes, tp_size)
    return MicroGroup(
        index=number, params=tuple(members), hosts=tuple(hosts), rank_costs=tuple(costs), rank_bytes=tuple(sizes)
    )


def _full_numel(spec: ParamSpec) -> int:
    numel = 1
    for dim in spec.full_shape:
        numel *= dim
    return numel


def _max_over_mean(values: Sequence[float]) -> float:
    mean = sum(values) / len(values) if values else 0.0
    return max(values) / mean if mean > 0 else 1.0
