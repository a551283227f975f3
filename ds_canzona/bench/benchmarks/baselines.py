"""The distribution schemes ds_canzona is measured against, on ds_canzona's own per-tensor math.

Run (``benchmarks step``) as DeepSpeed ZeRO-0 engines with a client optimizer, so DeepSpeed's
own bucketed all-reduce averages the gradients and its own clipping applies:

- synchronous (:class:`ds_canzona.optim.Muon` / ``Shampoo`` as they are): every rank holds the
  whole state and updates every tensor (what the Canzona paper calls SC);
- layer-wise (:class:`LayerwiseOptimizer`): every tensor owned whole by one rank (LPT over the
  same cost model ds_canzona plans with), the owner updates it, and each rank then
  broadcasts its updated tensors to the others (all-reduce plus redistribution, as in NVIDIA's
  layer-wise distributed optimizer).

Emulated (``benchmarks makespan``): per-rank optimizer work of every strategy, given a time per
tensor: :func:`synchronous_loads`, :func:`layerwise_loads`, :func:`deepspeed_muon_loads` (DeepSpeed
0.19.8's equal partitions of each param group, a straddling matrix orthogonalised on every rank
it touches) and :func:`plan_loads` (a ds_canzona plan: alpha-balanced or start-index).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

import torch
from deepspeed.accelerator import get_accelerator

from ds_canzona.optim import rule_for_group
from ds_canzona.plan import DPPlan, ParamSpec, default_machine_balance

__all__ = [
    "LayerwiseOptimizer",
    "deepspeed_muon_loads",
    "deepspeed_partition_touches",
    "layerwise_loads",
    "lpt_owners",
    "plan_loads",
    "synchronous_loads",
]


def lpt_owners(costs: Sequence[float], world_size: int) -> list[int]:
    """Whole-tensor owners by LPT: largest cost first onto the least-loaded rank (ties: lower index, rank)."""
    heap = [(0.0, rank) for rank in range(world_size)]
    owners = [0] * len(costs)
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, rank = heapq.heappop(heap)
        owners[index] = rank
        heapq.heappush(heap, (load + costs[index], rank))
    return owners


class LayerwiseOptimizer(torch.optim.Optimizer):
    """Layer-wise scheme over the param groups of a ``ds_canzona.optim`` optimizer.

    Each tensor is owned whole by one rank of ``process_group`` (:func:`lpt_owners` over the
    cost model ds_canzona's runtime plans with by default: roofline, with the device's default
    machine balance). ``step`` expects gradients already averaged on every rank (DeepSpeed's
    ZeRO-0 all-reduce does that): the owner runs the per-tensor rule, keeping state for its own
    tensors only, then every rank broadcasts its updated tensors as one flat buffer.
    """

    def __init__(self, inner: torch.optim.Optimizer, *, process_group=None):
        import deepspeed.comm as dist

        super().__init__([{**group, "params": list(group["params"])} for group in inner.param_groups], defaults={})
        self.process_group = process_group
        self.world_size = dist.get_world_size(group=process_group)
        self.rank = dist.get_rank(group=process_group)
        self._sources = [dist.get_global_rank(process_group, r) if process_group is not None else r
                         for r in range(self.world_size)]
        tensors = [(p, group) for group in self.param_groups for p in group["params"]]
        balance = default_machine_balance(get_accelerator().device_name())
        costs = [rule_for_group(group).cost(tuple(p.shape), model="roofline", machine_balance=balance)
                 for p, group in tensors]
        owners = lpt_owners(costs, self.world_size)
        self.owner = {p: owner for (p, _), owner in zip(tensors, owners)}
        self.owned_by: list[list[torch.Tensor]] = [[] for _ in range(self.world_size)]
        for (p, _), owner in zip(tensors, owners):
            self.owned_by[owner].append(p)

    @torch.no_grad()
    def step(self, closure=None):
        import deepspeed.comm as dist

        for group in self.param_groups:
            mine = [p for p in group["params"] if self.owner[p] == self.rank and p.grad is not None]
            if not mine:
                continue
            rule = rule_for_group(group)
            states = []
            for p in mine:
                if not self.state[p]:
                    self.state[p] = rule.init_state(p)
                states.append(self.state[p])
            rule.update_(mine, [p.grad for p in mine], states, lr=group["lr"])
        for r, owned in enumerate(self.owned_by):
            if not owned:
                continue
            if r == self.rank:
                flat = torch.cat([p.reshape(-1) for p in owned])
            else:
                flat = torch.empty(sum(p.numel() for p in owned), dtype=owned[0].dtype, device=owned[0].device)
            dist.broadcast(flat, src=self._sources[r], group=self.process_group)
            if r != self.rank:
                offset = 0
                for p in owned:
                    p.copy_(flat[offset:offset + p.numel()].view_as(p))
                    offset += p.numel()
        return None

    def state_bytes(self) -> int:
        return sum(v.numel() * v.element_size() for s in self.state.values() for v in s.values() if torch.is_tensor(v))


# --------------------------------------------------------------------------------------------
# Emulated per-rank loads, for the makespan benchmark.
# --------------------------------------------------------------------------------------------


def synchronous_loads(times: Sequence[float], world_size: int) -> list[float]:
    """Every rank updates every tensor."""
    return [float(sum(times))] * world_size


def layerwise_loads(plan_costs: Sequence[float], times: Sequence[float], world_size: int) -> list[float]:
    """Whole-tensor LPT owners chosen on ``plan_costs`` (what the scheme knows), charged ``times``."""
    loads = [0.0] * world_size
    for index, owner in enumerate(lpt_owners(plan_costs, world_size)):
        loads[owner] += times[index]
    return loads


def plan_loads(plan: DPPlan, times: Sequence[float]) -> list[float]:
    """Per-rank time of a ds_canzona plan (each tensor on its owner)."""
    loads = [0.0] * plan.world_size
    for index, owner in enumerate(plan.owner):
        loads[owner] += times[index]
    return loads


def deepspeed_partition_touches(numels: Sequence[int], world_size: int) -> list[tuple[int, int, list[int]]]:
    """DeepSpeed 0.19.8 ZeRO-1/2 partitions of one param group: per tensor, (first, last, elements per rank).

    The group's tensors are flattened in order (no per-tensor padding, the default
    ``parameter_alignment=False``), padded to a multiple of 2·world_size and cut into world_size
    equal partitions; a tensor belongs to every partition it overlaps.
    """
    total = sum(numels)
    alignment = 2 * world_size
    size = int(math.ceil(total / alignment)) * alignment // world_size
    out = []
    offset = 0
    for numel in numels:
        first, last = offset // size, (offset + numel - 1) // size
        share = [0] * world_size
        for rank in range(first, last + 1):
            share[rank] = min(offset + numel, (rank + 1) * size) - max(offset, rank * size)
        out.append((first, last, share))
        offset += numel
    return out


def deepspeed_muon_loads(specs: Sequence[ParamSpec], times: Sequence[float],
                         world_size: int) -> tuple[list[float], int]:
    """Per-rank time of DeepSpeed's Muon at ZeRO-1/2, and its Newton-Schulz runs per step.

    DeepSpeed puts the Muon matrices and the rest in two param groups (Muon first) and partitions
    each alone (:func:`deepspeed_partition_touches`); ``MuonWithAuxAdam`` sorts the Muon group by
    ``param.size()``, largest first (a stable sort: equal shapes keep model order). A matrix is
    orthogonalised whole on every rank it touches; an AdamW tensor costs each rank its share of
    elements.
    """
    loads = [0.0] * world_size
    runs = 0
    for matrix in (True, False):
        members = [i for i, spec in enumerate(specs) if spec.matrix is matrix]
        if not members:
            continue
        if matrix:
            members = sorted(members, key=lambda i: tuple(specs[i].shape), reverse=True)
        touches = deepspeed_partition_touches([specs[i].numel for i in members], world_size)
        for index, (first, last, share) in zip(members, touches):
            if matrix:
                runs += last - first + 1
                for rank in range(first, last + 1):
                    loads[rank] += times[index]
            else:
                for rank in range(first, last + 1):
                    loads[rank] += times[index] * share[rank] / specs[index].numel
    return loads, runs
