"""ZeRO-1/2 along data parallelism with DeepSpeed AutoTP along tensor parallelism.

Each rank of a (DP x TP) mesh holds AutoTP's slices of the sharded linear layers and whole copies
of the rest. The optimizer step keeps the ZeRO-1/2 runtime (``stage12.CanzonaZeroOptimizer``) and
adds Canzona's micro-group pipeline for the sharded matrices:

- The data-parallel plan is made from logical (unsharded) shapes, so it is the same on every rank
  of the mesh and every TP rank of a matrix agrees on its DP owner. Each rank's buffers hold its
  local slices in the plan's order (``layout.BufferLayout.local``), and the reduce-scatters and
  all-gathers of ZeRO-1/2 run over the DP group on those slices.
- A sharded matrix owned by DP rank d is updated by the TP group of d: its host (one TP rank,
  ``ds_canzona.plan.plan_tp_hosts``, by cost, in micro-groups of at most
  ``canzona.tp_micro_group_bytes`` gathered bytes per host) receives every slice of the clipped
  fp32 gradient, runs the same per-tensor rule as the single-process optimizer on the whole
  matrix, and sends every TP rank its slice of the new values (``tp_exchange``).
- Where state lives: the host keeps the whole matrix's fp32 master and its optimizer state
  (momentum, Shampoo/SOAP factors). Shampoo's and SOAP's factors need the whole matrix anyway;
  keeping the momentum there too makes the host's computation exactly the single-process one on
  the same numbers, and the returned slices are copies of the host's master. The cost: the whole
  matrix's state on one rank of its TP group (``plan.memory.tp_host_bytes``), balanced across
  the TP group by the plan.
- Everything else (non-matrix tensors, sharded or not, and matrices AutoTP leaves whole) is
  updated where it lies, by its DP owner on every TP rank: AdamW is elementwise, so a slice
  updates exactly as the same elements of the whole tensor, and replicated tensors get the same
  gradient on every TP rank (AutoTP all-reduces the gradients of the replicated parameters that
  see sharded activations, such as Qwen3's q_norm and k_norm).
- The clipping norm: one all-reduce over the whole DP x TP world of the per-item squared norms;
  a sharded item contributes its slice's squared norm from every TP rank of its DP owner, a
  replicated item only from TP rank 0, so every element counts exactly once.

Per step, then: the ZeRO-1/2 reduce-scatters and all-gathers over DP, one norm all-reduce, and two
all-to-alls per micro-group over TP.
"""

from __future__ import annotations

import hashlib

import torch

import deepspeed.comm as dist

from ds_canzona.optim import rule_for_group
from ds_canzona.plan import ParamSpec, TPPlan, plan_tp_hosts, tp_host_bytes
from ds_canzona.zero.layout import BufferLayout
from ds_canzona.zero.stage12 import CanzonaZeroOptimizer, OwnedTensor, PlanMismatchError
from ds_canzona.zero.tp_exchange import ExchangedMatrix, MicroGroupExchange
from ds_canzona.zero.tp_layout import TPSplit, read_tp_splits

__all__ = ["CanzonaTPZeroOptimizer"]


class CanzonaTPZeroOptimizer(CanzonaZeroOptimizer):
    """``CanzonaZeroOptimizer`` on AutoTP slices: sharded matrices get their whole-matrix update.

    ``tp_process_group`` is AutoTP's tensor-parallel group (consecutive ranks); the other
    arguments are the base class's, ``dp_process_group`` the data-parallel group of this rank.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, tp_process_group, **kwargs):
        self.tp_group = tp_process_group
        self.tp_size = dist.get_world_size(group=tp_process_group)
        self.tp_rank = dist.get_rank(group=tp_process_group)
        super().__init__(optimizer, **kwargs)
        self.norm_group = None  # the whole world: DP x TP

    # ------------------------------------------------------------------ planning
    def _plan_shapes(self) -> list[tuple[int, ...]]:
        self.splits: list[TPSplit | None] = read_tp_splits(list(zip(self.names, self.params)), tp_rank=self.tp_rank,
                                                           tp_size=self.tp_size)
        return [split.logical_shape if split else tuple(p.shape) for split, p in zip(self.splits, self.params)]

    def _is_tp_matrix(self, item: int) -> bool:
        tensor = self.plan.pieces[item][0]
        return self.splits[tensor] is not None and self.groups[tensor]["kind"] != "adamw"

    def _buffer_layout(self) -> BufferLayout:
        # The TP plans are pure functions of the DP plan: made here, before the plan summary prints them.
        self.tp_plans = [self._plan_tp(rank) for rank in range(self.world_size)]

        def held_before(tensor: int, index: int) -> int:
            split = self.splits[tensor]
            return index if split is None else split.held_before(self.tp_rank, index)

        return BufferLayout.local(self.plan, held_before)

    def _plan_tp(self, dp_rank: int) -> tuple[list[int], TPPlan]:
        """(items, micro-group plan) of the sharded matrices DP rank ``dp_rank`` owns; specs are logical."""
        items = [j for j in self.plan.owned_params(dp_rank) if self._is_tp_matrix(j)]
        specs = [self.plan.specs[j] for j in items]
        return items, plan_tp_hosts(specs, tp_size=self.tp_size, capacity_bytes=self.config.tp_micro_group_bytes,
                                    cost=self._plan_cost_model())

    def _check_plan_agreement(self) -> None:
        """Compare the DP plan's and this TP group's plan digests across the whole world."""
        tp_digests = hashlib.sha256("".join(tp_plan.digest() for _, tp_plan in self.tp_plans).encode("ascii"))
        digest = bytes.fromhex(self.plan.digest()) + tp_digests.digest()
        mine = torch.tensor(list(digest), dtype=torch.uint8, device=self.device)
        world = dist.get_world_size()
        rows = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(rows, mine)
        rows = [row.cpu() for row in rows]
        differ = [r for r in range(world) if not torch.equal(rows[r], rows[0])]
        if differ:
            raise PlanMismatchError(f"optimizer plans differ across ranks: ranks {differ} disagree with rank 0 "
                                    "(different models, configs, AutoTP splits or ds_canzona versions)")

    def plan_summary(self) -> str:
        lines = [super().plan_summary()]
        memory = self._plan_memory_model()
        lines.append(f"ds_canzona TP: TP={self.tp_size}, micro-groups of at most {self.config.tp_micro_group_bytes} "
                     "gathered bytes per host")
        for dp_rank, (items, tp_plan) in enumerate(self.tp_plans):
            costs = tp_plan.rank_costs()
            held = [0.0] * self.tp_size
            for group in tp_plan.groups:
                for index, host in zip(group.params, group.hosts):
                    held[host] += tp_host_bytes(memory, tp_plan.specs[index])
            lines.append(f"  DP rank {dp_rank}: {len(items)} sharded matrices in {len(tp_plan.groups)} micro-groups, "
                         f"host cost max/avg={_ratio(costs):.3f} (max {max(costs):.3e}), "
                         f"host bytes max/avg={_ratio(held):.3f} (max {max(held):.0f})")
        return "\n".join(lines)

    # ------------------------------------------------------------------ state
    def _build_owned_state(self) -> list[OwnedTensor]:
        """Local items as in ZeRO-1/2; sharded matrices get a whole fp32 master and state on their host."""
        owned = [self._own_item(j) for j in self.plan.owned_params(self.rank) if not self._is_tp_matrix(j)]
        items, tp_plan = self.tp_plans[self.rank]
        self._tp_items = items
        self.exchange = MicroGroupExchange(
            [[ExchangedMatrix(item=items[index], host=host, split=self.splits[self.plan.pieces[items[index]][0]])
              for index, host in zip(group.params, group.hosts)] for group in tp_plan.groups],
            tp_rank=self.tp_rank, tp_size=self.tp_size, tp_group=self.tp_group, counter=self.comm, device=self.device)
        masters = self.exchange.gather_all({j: self.item_view(j).detach().float() for j in items})
        self._hosted: dict[int, OwnedTensor] = {}
        for j, master in masters.items():
            tensor = self.plan.pieces[j][0]
            group = self.groups[tensor]
            self._hosted[j] = OwnedTensor(index=j, name=self.plan.specs[j].name, master=master,
                                          state=rule_for_group(group).init_state(master), group=group, tensor=tensor)
        return owned

    def hosted_tensors(self) -> list[OwnedTensor]:
        """The whole sharded matrices this rank hosts (fp32 master and state of the logical matrix)."""
        return [self._hosted[j] for j in sorted(self._hosted)]

    # ------------------------------------------------------------------ step
    def _step_items(self) -> list[int]:
        return super()._step_items() + self._tp_items

    def _counts_in_norm(self, item: int) -> bool:
        # A slice is counted on every TP rank (the slices sum to the matrix); a replica on one.
        return self.splits[self.plan.pieces[item][0]] is not None or self.tp_rank == 0

    def _update_owned(self, grads: list[torch.Tensor]) -> None:
        local = len(self._owned)
        super()._update_owned(grads[:local])
        slices = dict(zip(self._tp_items, grads[local:]))
        self.exchange.run(slices, self._update_hosted, self._write_slice)

    def _update_hosted(self, full_grads: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """The per-tensor rule on the whole matrices of one micro-group this rank hosts, group by group."""
        hosted = [self._hosted[j] for j in sorted(full_grads)]
        for group in self.optimizer.param_groups:
            members = [t for t in hosted if t.group is group]
            if members:
                rule_for_group(group).update_([t.master for t in members], [full_grads[t.index] for t in members],
                                              [t.state for t in members], lr=group["lr"], known_finite=True)
        return {t.index: t.master for t in hosted}

    @torch.no_grad()
    def _write_slice(self, item: int, values: torch.Tensor) -> None:
        self.item_view(item).copy_(values)


def _ratio(values: list[float]) -> float:
    mean = sum(values) / len(values) if values else 0.0
    return max(values) / mean if mean > 0 else 1.0
