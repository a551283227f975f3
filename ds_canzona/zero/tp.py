"""ZeRO-1/2 along data parallelism with DeepSpeed AutoTP along tensor parallelism.

Each rank of a (DP x TP) mesh holds AutoTP's slices of the sharded linear layers and whole copies
of the rest. The optimizer step keeps the ZeRO-1/2 runtime (``stage12.CanzonaZeroOptimizer``) and
adds Canzona's micro-group pipeline for the sharded matrices:

- The data-parallel plan is made from logical (unsharded) shapes, so it is the same on every rank
  of the mesh and every TP rank of a matrix agrees on its DP owner. Each rank's buffers hold its
  local slices in the plan's order (``layout.BufferLayout.local``), and the reduce-scatters and
  all-gathers of ZeRO-1/2 run over the DP group on those slices. Buckets close at the bucket size
  counted in slices (each tensor's largest over the TP group, ``_held_numels``), as DeepSpeed's
  buckets do under AutoTP; the plan's costs stay those of the logical matrices.
- A sharded matrix owned by DP rank d is updated by the TP group of d: its host (one TP rank,
  ``ds_canzona.plan.plan_tp_hosts``, by cost, in micro-groups of at most
  ``canzona.tp_micro_group_bytes`` gathered bytes per host) receives every slice of the clipped
  fp32 gradient, runs the same per-tensor rule as the single-process optimizer on the whole
  matrix, and sends every TP rank its slice of the new values (``tp_exchange``). A fused weight
  AutoTP cuts per sub-parameter (qkv, gate_up) is reassembled whole and updated as its
  sub-parameters, each its own matrix (``_sub_parameters``); Muon only, as Shampoo's and SOAP's
  per-matrix factors have no place in a fused tensor's state.
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

import functools
import hashlib

import torch

import deepspeed.comm as dist

from ds_canzona.config import CanzonaConfigError
from ds_canzona.optim import rule_for_group
from ds_canzona.plan import TPPlan, plan_tp_hosts, tp_host_bytes
from ds_canzona.zero.layout import BufferLayout
from ds_canzona.zero.comm import PlanMismatchError
from ds_canzona.zero.owned import OwnedTensor
from ds_canzona.zero.stage12 import CanzonaZeroOptimizer
from ds_canzona.zero.tp_exchange import ExchangedMatrix, MicroGroupExchange
from ds_canzona.zero.tp_layout import TPSplit, read_tp_splits

__all__ = ["CanzonaTPZeroOptimizer"]

# Kinds that can update a fused weight AutoTP splits per sub-parameter: their state is elementwise
# (Muon's momentum; AdamW's moments), so the fused state is the sub-parameters' states side by
# side. Shampoo's and SOAP's factors are per matrix and would need a state layout of their own.
FUSED_KINDS = frozenset({"muon", "adamw"})


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
        if dist.get_rank() != self.rank * self.tp_size + self.tp_rank:
            raise RuntimeError(f"ds_canzona expects AutoTP's (DP, TP) mesh with TP innermost; global rank "
                               f"{dist.get_rank()} is DP rank {self.rank}, TP rank {self.tp_rank}")

    # ------------------------------------------------------------------ planning
    def _plan_shapes(self) -> list[tuple[int, ...]]:
        self.splits: list[TPSplit | None] = read_tp_splits(list(zip(self.names, self.params)), tp_rank=self.tp_rank,
                                                           tp_size=self.tp_size)
        for name, split, group in zip(self.names, self.splits, self.groups):
            if split is not None and split.fused and group["kind"] not in FUSED_KINDS:
                raise CanzonaConfigError(
                    f"optimizer.type: {group['kind']} cannot update parameter {name!r}, a fused weight AutoTP splits "
                    f"per sub-parameter (sizes {split.sub_sizes}): each sub-parameter is its own matrix, and "
                    f"{group['kind']}'s preconditioner state is per matrix. Use Muon for it, keep the layer unfused "
                    "or out of AutoTP's partition config, or set tensor_parallel.autotp_size to 1")
        return [split.logical_shape if split else tuple(p.shape) for split, p in zip(self.splits, self.params)]

    def _held_numels(self) -> list[int]:
        # Buckets close on a TP slice, not on the logical tensor: a rank reduces only its slices, so
        # logical counts would keep the unsharded model's bucket count at every TP size, each bucket
        # about 1/TP full. The largest slice over the TP group rather than this rank's own: uneven
        # splits (whole KV heads) differ between TP ranks, every rank of the world must make the
        # same plan, and no rank's bucket then holds more than the bucket size.
        return [p.numel() if split is None else max(split.local_numel(r) for r in range(self.tp_size))
                for split, p in zip(self.splits, self.params)]

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
        lines.append(f"ds_canzona TP: TP={self.tp_size}, buckets closing at {self.plan.bucket_numel} elements counted "
                     f"in each tensor's largest TP slice, micro-groups of at most {self.config.tp_micro_group_bytes} "
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
        slices = dict(zip(self._tp_items, grads[local:]))
        # The items that are not TP-sharded are updated while the first gathers travel.
        self.exchange.run(slices, self._update_hosted, self._write_slice,
                          local_work=functools.partial(super()._update_owned, grads[:local]))

    def _update_hosted(self, full_grads: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """The per-tensor rule on the whole matrices of one micro-group this rank hosts, group by group."""
        hosted = [self._hosted[j] for j in sorted(full_grads)]
        for group in self.optimizer.param_groups:
            members = [t for t in hosted if t.group is group]
            if not members:
                continue
            masters, grads, states, write_back = [], [], [], []
            for t in members:
                split = self.splits[t.tensor]
                if split.fused:
                    sub_masters, sub_grads, sub_states = _sub_parameters(split, t.master, full_grads[t.index], t.state)
                    masters += sub_masters
                    grads += sub_grads
                    states += sub_states
                    write_back.append((t.state, sub_states[0], t.master))
                else:
                    masters.append(t.master)
                    grads.append(full_grads[t.index])
                    states.append(t.state)
            rule_for_group(group).update_(masters, grads, states, lr=group["lr"], known_finite=True)
            for state, first, master in write_back:
                _keep_counters(state, first, master)
        return {t.index: t.master for t in hosted}

    @torch.no_grad()
    def _write_slice(self, item: int, values: torch.Tensor) -> None:
        self.item_view(item).copy_(values)

    # ------------------------------------------------------------------ checkpoints: logical tensors by name
    # One shard file per rank of the world. An item is written by one rank of its DP owner's TP
    # group: a TP-sharded matrix by its host (whole master and state), an item replicated over TP
    # by TP rank 0, and a TP-sharded non-matrix item (AdamW slices) by TP rank 0 after gathering
    # its slices. Loading reads logical tensors by name and takes this rank's part.

    def checkpoint_ranks(self) -> tuple[int, int, object]:
        return dist.get_rank(), dist.get_world_size(), None

    def item_file(self, item: int) -> int:
        dp_rank = self.plan.owner[item]
        items, tp_plan = self.tp_plans[dp_rank]
        host = 0
        if item in items:
            position = items.index(item)
            host = next(h for g in tp_plan.groups for index, h in zip(g.params, g.hosts) if index == position)
        return dp_rank * self.tp_size + host  # the mesh is (DP, TP), TP innermost (checked at init)

    def _sliced(self) -> list[OwnedTensor]:
        """Owned items that are TP slices of a non-matrix tensor (updated where they lie)."""
        return [t for t in self._owned if self.splits[t.tensor] is not None]

    def _slice_range(self, item: int, rank: int) -> tuple[int, int]:
        """TP rank ``rank``'s local element range of item ``item`` (a logical piece)."""
        tensor, start, stop = self.plan.pieces[item]
        split = self.splits[tensor]
        return split.held_before(rank, start), split.held_before(rank, stop)

    def _logical_item_shape(self, item: int) -> tuple[int, ...]:
        tensor, start, stop = self.plan.pieces[item]
        whole = start == 0 and stop == self.splits[tensor].logical_numel
        return self.splits[tensor].logical_shape if whole else (stop - start,)

    @torch.no_grad()
    def checkpoint_items(self) -> list[OwnedTensor]:
        items = [t for t in self._owned if self.splits[t.tensor] is None] if self.tp_rank == 0 else []
        items += self.hosted_tensors()
        for t in self._sliced():  # the same items, in the same order, on every TP rank of this DP rank
            gathered = self._gather_slices(t)
            if gathered is not None:
                items.append(gathered)
        return items

    def _gather_slices(self, owned: OwnedTensor) -> OwnedTensor | None:
        """One item's master and elementwise state from every TP rank, whole on TP rank 0 (None elsewhere)."""
        keys = [k for k, v in owned.state.items() if torch.is_tensor(v) and v.shape == owned.master.shape]
        parts = 1 + len(keys)
        counts = [high - low for low, high in (self._slice_range(owned.index, r) for r in range(self.tp_size))]
        width = max(counts) * parts
        mine = torch.zeros(width, dtype=torch.float32, device=self.device)
        local = torch.cat([owned.master.reshape(-1).float()] + [owned.state[k].reshape(-1).float() for k in keys])
        mine[:local.numel()] = local
        rows = [torch.empty_like(mine) for _ in range(self.tp_size)]
        dist.all_gather(rows, mine, group=self.tp_group)
        if self.tp_rank != 0:
            return None
        tensor, start, stop = self.plan.pieces[owned.index]
        whole = [torch.empty(stop - start, dtype=torch.float32, device=self.device) for _ in range(parts)]
        for rank, row in enumerate(rows):
            low, high = self._slice_range(owned.index, rank)
            positions = self.splits[tensor].logical_index(rank, low, high).to(self.device) - start
            count = high - low
            for part in range(parts):
                whole[part][positions] = row[part * count:(part + 1) * count]
        shape = self._logical_item_shape(owned.index)
        state = {k: v for k, v in owned.state.items() if k not in keys}
        state.update({k: whole[1 + n].view(shape) for n, k in enumerate(keys)})
        return OwnedTensor(index=owned.index, name=owned.name, master=whole[0].view(shape), state=state,
                           group=owned.group, tensor=owned.tensor)

    def load_targets(self) -> list[OwnedTensor]:
        # Sliced items are read whole into stand-ins of the logical shape; after_load takes this rank's part.
        self._load_stand_ins = []
        for t in self._sliced():
            shape = self._logical_item_shape(t.index)
            state = {k: torch.empty(shape, dtype=v.dtype, device=self.device)
                     if torch.is_tensor(v) and v.shape == t.master.shape else v for k, v in t.state.items()}
            stand_in = OwnedTensor(index=t.index, name=t.name, master=torch.empty(shape, device=self.device),
                                   state=state, group=t.group, tensor=t.tensor)
            self._load_stand_ins.append((t, stand_in))
        return ([t for t in self._owned if self.splits[t.tensor] is None] + self.hosted_tensors()
                + [stand_in for _, stand_in in self._load_stand_ins])

    @torch.no_grad()
    def after_load(self) -> None:
        for owned, stand_in in getattr(self, "_load_stand_ins", []):
            tensor, start, _ = self.plan.pieces[owned.index]
            low, high = self._slice_range(owned.index, self.tp_rank)
            positions = self.splits[tensor].logical_index(self.tp_rank, low, high).to(self.device) - start
            owned.master.copy_(stand_in.master.reshape(-1)[positions].view_as(owned.master))
            for key, value in stand_in.state.items():
                current = owned.state[key]
                if torch.is_tensor(current) and current.shape == owned.master.shape:
                    current.copy_(value.reshape(-1)[positions].view_as(current))
                elif torch.is_tensor(current):
                    current.copy_(value)
                else:
                    owned.state[key] = value
        self._load_stand_ins = []
        # The hosts' masters back into every rank's slices, then the usual DP all-gather.
        for k in range(len(self.exchange.groups)):
            masters = {m.item: self._hosted[m.item].master for m in self.exchange.hosted(k)}
            self.exchange.finish_scatter(k, self.exchange.launch_scatter(k, masters), self._write_slice)
        self.refresh_params_from_masters()


def _sub_parameters(split: TPSplit, master: torch.Tensor, grad: torch.Tensor,
                    state: dict) -> tuple[list[torch.Tensor], list[torch.Tensor], list[dict]]:
    """A fused matrix (qkv, gate_up) as its sub-parameters, each its own matrix for the rule.

    Masters and elementwise state (Muon's momentum) are views into the fused tensors, so the rule
    updates them in place and the fused master and state stay what checkpoints store. Gradients
    are contiguous copies (the rule's matmuls see the same memory layout as a separate matrix).
    Counters (0-dim state such as 'step') get one copy per sub-parameter; ``_keep_counters``
    writes the first back (every sub-parameter advances its counter alike).
    """
    elementwise = {k for k, v in state.items() if torch.is_tensor(v) and v.shape == master.shape}
    views = {k: split.sub_views(state[k]) for k in elementwise}
    states = [{k: views[k][i] if k in elementwise else (v.clone() if torch.is_tensor(v) else v)
               for k, v in state.items()} for i in range(len(split.widths))]
    return split.sub_views(master), [g.contiguous() for g in split.sub_views(grad)], states


def _keep_counters(state: dict, first: dict, master: torch.Tensor) -> None:
    """Write the first sub-parameter's counters back into the fused state (elementwise state is shared)."""
    for key, value in first.items():
        if not torch.is_tensor(state[key]):
            state[key] = value
        elif state[key].shape != master.shape:
            state[key].copy_(value)


def _ratio(values: list[float]) -> float:
    mean = sum(values) / len(values) if values else 0.0
    return max(values) / mean if mean > 0 else 1.0
