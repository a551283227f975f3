"""ZeRO-3 owner placement (MatrixFSDP): every matrix lives whole on one rank.

Under ZeRO-3 each rank normally holds a slice of every tensor, and Muon would have to rebuild
each matrix every step. MatrixFSDP instead gives each matrix one owner, whose shard is the whole
matrix while the other ranks hold empty shards; the ordinary gradient reduction then lands the
full matrix on its owner, and the optimizer step needs no collective.

There is no buffer geometry here, so placement is free, and two things need balancing: the
optimizer step (cost) and memory (elements), since the owner of a matrix holds it whole. A rank's
load is the larger of its shares of the average cost and of the average elements. Tensors go
largest share first, each onto the rank where that load ends smallest (LPT on the larger share;
ties on the lower rank). Non-matrix tensors stay on AdamW, whose cost is small: the big ones
(embeddings and the head, under the default rule) are placed early for their memory, so a rank
holding one takes fewer matrices instead of doubling its memory; the small ones (norms, biases)
come last and fill whatever rank has room: these are the "tail owners".

Pieces. With ``split_numel``, a non-matrix tensor above that size is planned as its canonical
pieces (``piece_bounds``, the same items as the ZeRO-1/2 plan and the single-process clipping
norm), each owned by one rank: AdamW is elementwise, so a 256k-vocabulary embedding spreads
over many ranks instead of sitting whole on one. A 3-D expert stack above that size is planned
as pieces of whole experts (``item_bounds``), each a stack of its own to the matrix rule.
"""

from __future__ import annotations

import hashlib
import heapq
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .cost import CostModel, cost_model
from .dp import expand_pieces
from .specs import ParamSpec, PlanError

__all__ = ["Zero3Plan", "plan_zero3_owners"]

# Ranks compared per placement: the lowest-share ones; the result of adding a tensor depends on
# both of a rank's loads, so the lowest share is not always the best destination.
_CANDIDATES = 8


@dataclass(frozen=True, kw_only=True)
class Zero3Plan:
    """The owner rank of every item (a tensor, or a canonical piece of one), the same on every rank.

    ``specs``, ``costs`` and ``owner`` are per item, in parameter order; ``pieces[i]`` is item i's
    ``(tensor index, first element, stop element)`` in the planner's input ``specs``.
    """

    world_size: int
    cost_model: str
    cost_label: str
    specs: tuple[ParamSpec, ...]
    costs: tuple[float, ...]
    owner: tuple[int, ...]
    pieces: tuple[tuple[int, int, int], ...]
    split_numel: int | None = None

    def tensor_items(self) -> list[list[int]]:
        """For each input tensor, its items (one, or its pieces in element order)."""
        items: list[list[int]] = []
        for item, (tensor, _, _) in enumerate(self.pieces):
            if tensor == len(items):
                items.append([])
            items[tensor].append(item)
        return items

    def rank_costs(self) -> list[float]:
        loads = [0.0] * self.world_size
        for index, rank in enumerate(self.owner):
            loads[rank] += self.costs[index]
        return loads

    def rank_numels(self) -> list[int]:
        numels = [0] * self.world_size
        for spec, rank in zip(self.specs, self.owner):
            numels[rank] += spec.numel
        return numels

    def owned_params(self, rank: int) -> list[int]:
        if not 0 <= rank < self.world_size:
            raise PlanError(f"Invalid rank={rank}: must be in [0, {self.world_size}).")
        return [index for index, owner in enumerate(self.owner) if owner == rank]

    @property
    def flops_ratio(self) -> float:
        costs = self.rank_costs()
        return max(costs) * self.world_size / sum(costs) if sum(costs) > 0 else 1.0

    @property
    def memory_ratio(self) -> float:
        numels = self.rank_numels()
        return max(numels) * self.world_size / sum(numels)

    def to_dict(self) -> dict[str, Any]:
        costs, numels = self.rank_costs(), self.rank_numels()
        return {
            "world_size": self.world_size,
            "cost_model": self.cost_model,
            "cost_label": self.cost_label,
            "split_numel": self.split_numel,
            "params": [{**spec.to_dict(), "owner": rank} for spec, rank in zip(self.specs, self.owner)],
            "ranks": [
                {"cost": c, "numel": n, "tensors": self.owner.count(r)} for r, (c, n) in enumerate(zip(costs, numels))
            ],
            "flops_ratio": self.flops_ratio,
            "memory_ratio": self.memory_ratio,
        }

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def digest(self) -> str:
        content = {
            "world_size": self.world_size,
            "cost_label": self.cost_label,
            "params": [[s.name, list(s.shape), s.matrix, s.tp_dim, s.tp_size] for s in self.specs],
            "owner": list(self.owner),
        }
        if self.split_numel is not None:  # absent otherwise, so unsplit digests stay as they were
            content["split_numel"] = self.split_numel
            content["pieces"] = [list(piece) for piece in self.pieces]
        canonical = json.dumps(content, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
        return hashlib.sha256(canonical.encode("ascii")).hexdigest()


def plan_zero3_owners(specs: Sequence[ParamSpec], *, world_size: int, cost: CostModel | None = None,
                      split_numel: int | None = None) -> Zero3Plan:
    """One owner per item: matrices balanced on cost, the rest packed to even out memory.

    ``split_numel`` (default: none) plans non-matrix tensors above that size as canonical pieces.
    """
    if not tuple(specs):
        raise PlanError("Cannot plan an empty list of params.")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise PlanError(f"Invalid world_size={world_size!r}: must be a positive integer.")
    if split_numel is not None and (isinstance(split_numel, bool) or not isinstance(split_numel, int)
                                    or split_numel < 1):
        raise PlanError(f"Invalid split_numel={split_numel!r}: must be a positive integer or None.")
    specs, pieces = expand_pieces(tuple(specs), split_numel)
    model = cost if cost is not None else cost_model("roofline", "muon")
    costs = tuple(float(model.cost(spec)) for spec in specs)
    total_cost = sum(costs) or 1.0
    total_numel = sum(spec.numel for spec in specs)

    def share(cost: float, numel: int) -> float:
        # A rank's load is the larger of its share of the average cost and of the average memory.
        return max(cost * world_size / total_cost, numel * world_size / total_numel)

    owner = [0] * len(specs)
    loads = [0.0] * world_size
    numels = [0] * world_size
    order = sorted(range(len(specs)), key=lambda i: (-share(costs[i], specs[i].numel), i))
    heap = [(0.0, rank) for rank in range(world_size)]
    for index in order:
        # Largest first onto the rank where the result is smallest; ranks are kept in a heap
        # by their current share, and the few cheapest are compared on the result.
        candidates = [heapq.heappop(heap) for _ in range(min(_CANDIDATES, world_size))]
        results = [
            (share(loads[rank] + costs[index], numels[rank] + specs[index].numel), current, rank)
            for current, rank in candidates
        ]
        _, _, rank = min(results)
        for current, other in candidates:
            if other != rank:
                heapq.heappush(heap, (current, other))
        owner[index] = rank
        loads[rank] += costs[index]
        numels[rank] += specs[index].numel
        heapq.heappush(heap, (share(loads[rank], numels[rank]), rank))

    return Zero3Plan(
        world_size=world_size,
        cost_model=model.name,
        cost_label=model.label,
        specs=specs,
        costs=costs,
        owner=tuple(owner),
        pieces=pieces,
        split_numel=split_numel,
    )
