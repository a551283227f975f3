"""ZeRO-1/2 with DeepSpeed's expert parallelism: one Canzona runtime per parameter family.

A model with ``deepspeed.moe`` layers trains two kinds of tensors. A dense one is the same
tensor on every rank and its gradient is averaged over the data-parallel group (W ranks). An
expert exists only on the ranks of its expert-parallel rank: EP rank r holds, per MoE layer,
experts ``r * L`` to ``r * L + L - 1`` (L local experts), replicated over its expert-data-parallel
group (the W / EP ranks with the same EP rank). DeepSpeed's ZeRO-1/2 sums an expert's gradient
over that group and divides it by W, as a dense one: the tokens an expert saw came through the
all-to-all from every EP rank, so the sum over its expert-data-parallel group is the sum over all
W ranks' tokens, and the division by W makes it the gradient of the mean loss.

So each family gets a ``CanzonaZeroOptimizer`` of its own (``families``): the dense tensors over
the data-parallel group, and per expert group (``ep_size_N``) its expert tensors over that
expert-data-parallel group, averaged over W. Each family plans, balances (alpha-balanced atomic
ownership, buckets, collective forms), reduce-scatters and all-gathers within its own group;
every rank of an expert-data-parallel group has the same local experts, so their plans agree,
and the plans of two EP ranks are the same up to the experts' names. An expert tensor is named by
its global index (``...deepspeed_experts.{r * L + i}...``), so optimizer state and checkpoints
name each expert of the model once, whatever the EP size.

The step keeps DeepSpeed's clipping norm, the L2 norm over every trained tensor with each expert
counted once, in one collective: the families' per-item squared norms laid out as [dense items |
expert group 1: EP rank 0's items, EP rank 1's, ... | ...], each entry non-zero on its owner only,
all-reduced over the whole data-parallel world and summed in that order, the same number on
every rank. Then each family clips, updates what the rank owns and publishes, in family order.

Two families' collectives go to two process groups; every rank launches them in the order its
backward completes buckets, which is the same on every rank for one model (as for one family).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ds_canzona.zero.comm import all_reduce_sum
from ds_canzona.zero.compat import at_accumulation_boundary
from ds_canzona.zero.owned import OwnedTensor
from ds_canzona.zero.owner_runtime import OwnerRuntime
from ds_canzona.zero.stage12 import CanzonaZeroOptimizer

__all__ = ["CanzonaExpertParallelOptimizer", "ExpertGroup", "expert_groups", "expert_name"]

_LOCAL_EXPERT = re.compile(r"(^|\.)deepspeed_experts\.(\d+)\.")


@dataclass(frozen=True)
class ExpertGroup:
    """One expert group of the model (DeepSpeed's ``param.group_name``, ``ep_size_N``) on this rank."""

    name: str
    ep_size: int
    ep_rank: int
    data_parallel_group: object  # the expert-data-parallel group: the ranks with this rank's EP rank
    params: tuple[torch.nn.Parameter, ...]


def expert_groups(module: torch.nn.Module, trained: Mapping[torch.nn.Parameter, str]) -> list[ExpertGroup]:
    """The model's expert groups with their trained parameters, in first-appearance order; empty without MoE."""
    from deepspeed.moe.utils import is_moe_param
    from deepspeed.utils import groups

    by_name: dict[str, list[torch.nn.Parameter]] = {}
    for param in trained:
        if is_moe_param(param):
            by_name.setdefault(param.group_name, []).append(param)
    return [ExpertGroup(name=name, ep_size=groups._get_expert_parallel_world_size(name),
                        ep_rank=groups._get_expert_parallel_rank(name),
                        data_parallel_group=groups._get_expert_data_parallel_group(name), params=tuple(params))
            for name, params in by_name.items()]


def _expert_slots(module: torch.nn.Module, param_names: Mapping[torch.nn.Parameter, str],
                  groups: list[ExpertGroup]) -> dict[torch.nn.Parameter, tuple[str, tuple[int, int] | None]]:
    """Each parameter's (name with global expert index, (L, local index) for an expert else None).

    DeepSpeed names the experts of a layer by their index on the rank (``deepspeed_experts.i``),
    so two EP ranks use the same names for different tensors; ``r * L + i`` names each once.
    """
    from deepspeed.moe.experts import Experts

    ep_rank = {p: g.ep_rank for g in groups for p in g.params}
    local_count = {}
    for name, sub in module.named_modules():
        if isinstance(sub, Experts):
            for p in sub.parameters():
                local_count[p] = sub.num_local_experts
    slots: dict[torch.nn.Parameter, tuple[str, tuple[int, int] | None]] = {p: (n, None) for p, n in param_names.items()}
    for param, rank in ep_rank.items():
        name = param_names[param]
        match = _LOCAL_EXPERT.search(name)
        if match is None or param not in local_count:
            raise ValueError(f"ds_canzona: expert parameter {name!r} is not inside a deepspeed.moe Experts module "
                             "(deepspeed_experts.<i>): its global expert index is unknown")
        local = int(match.group(2))
        index = rank * local_count[param] + local
        slots[param] = (name[:match.start(2)] + str(index) + name[match.end(2):], (local_count[param], local))
    return slots


def expert_name(name: str, index: int) -> str:
    """``name`` (an expert tensor's, with its global index) for expert ``index`` of the same layer."""
    match = _LOCAL_EXPERT.search(name)
    return name[:match.start(2)] + str(index) + name[match.end(2):]


class CanzonaExpertParallelOptimizer(OwnerRuntime):
    """The ZeRO-1/2 optimizer of a model with expert parallelism: a dense family and one per expert group."""

    def __init__(self, optimizer: torch.optim.Optimizer, *, module: torch.nn.Module, param_names: dict, config,
                 stage: int, dp_process_group, clip_grad: float, bucket_numel: int, expert_groups: list[ExpertGroup],
                 static_loss_scale: float = 1.0, dynamic_loss_scale: bool = False, dynamic_loss_args=None,
                 **numerics):
        """``param_names``: DeepSpeed's (local expert indices); experts are renamed here (``_expert_slots``)."""
        if not expert_groups:
            raise ValueError("CanzonaExpertParallelOptimizer needs at least one expert group")
        slots = _expert_slots(module, param_names, expert_groups)
        param_names = {p: name for p, (name, _) in slots.items()}
        super().__init__(optimizer, param_names=param_names, config=config, stage=stage,
                         dp_process_group=dp_process_group, clip_grad=clip_grad, **numerics)
        self._create_loss_scaler(static_loss_scale=static_loss_scale, dynamic_loss_scale=dynamic_loss_scale,
                                 dynamic_loss_args=dynamic_loss_args)
        self.expert_groups = list(expert_groups)
        experts = {p for g in self.expert_groups for p in g.params}
        # The families stay quiet at init: this runtime prints all of their plans at once.
        family = dict(optimizer=optimizer, param_names=param_names, config=config.model_copy(update={"log_plan": False}),
                      stage=stage, clip_grad=clip_grad, bucket_numel=bucket_numel, **numerics)
        dense = [p for p in self.params if p not in experts]
        self.families: list[CanzonaZeroOptimizer] = []
        self.family_names: list[str] = []
        if dense:
            self.families.append(CanzonaZeroOptimizer(**family, dp_process_group=dp_process_group,
                                                      members=set(dense)))
            self.family_names.append("dense")
        for group in self.expert_groups:
            self.families.append(CanzonaZeroOptimizer(**family, dp_process_group=group.data_parallel_group,
                                                      members=set(group.params), average_over=self.world_size))
            self.family_names.append(group.name)
        for runtime in self.families:
            runtime.loss_scaler = self.loss_scaler  # one scale; this runtime updates it
            runtime.norm_group = dp_process_group
            # The engine tells this runtime where an accumulation ends; the families ask it.
            runtime.is_gradient_accumulation_boundary = lambda: at_accumulation_boundary(self)
        self._ep_layout = [(1, 0)] * (1 if dense else 0) + [(g.ep_size, g.ep_rank) for g in self.expert_groups]
        self._index = {id(p): i for i, p in enumerate(self.params)}
        ep_size = {p: g.ep_size for g in self.expert_groups for p in g.params}
        # Every expert tensor of the model, on every EP rank, by global name: what a checkpoint holds.
        self._model_shapes: dict[str, list[int]] = {}
        for p, name in zip(self.params, self.names):
            slot = slots[p][1]
            if slot is None:
                self._model_shapes[name] = list(p.shape)
                continue
            local_experts, local = slot
            for rank in range(ep_size[p]):
                self._model_shapes[expert_name(name, rank * local_experts + local)] = list(p.shape)
        self.plan = self.families[0].plan  # the first family's, for tools that read one (plan_summary has all)
        self._expose_state_api()  # the families set their own; this one answers for all of them
        self._print_plan_summary()

    # ------------------------------------------------------------------ backward (the engine's hooks)
    def backward_epilogue(self, **kwargs) -> None:
        for runtime in self.families:
            runtime.backward_epilogue(**kwargs)

    def overlapping_partition_gradients_reduce_epilogue(self) -> None:
        for runtime in self.families:
            runtime.overlapping_partition_gradients_reduce_epilogue()

    def reduce_gradients(self, pipeline_parallel: bool = False) -> None:
        for runtime in self.families:
            runtime.reduce_gradients(pipeline_parallel)

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure=None):
        parts = [runtime._gradients_for_step() for runtime in self.families]
        vectors = [self._placed(runtime._owned_sq_norms(items, grads), *layout)
                   for (items, grads), runtime, layout in zip(parts, self.families, self._ep_layout)]
        checked = self._got_gradient is not None
        missing = []
        if checked:
            for runtime in self.families:
                missing += [n for n, got in zip(runtime.names, runtime._got_gradient) if not got]
                runtime._got_gradient = [False] * len(runtime.params)
            vectors.append(vectors[0].new_tensor([float(len(missing))]))
        sq_norms = torch.cat(vectors)
        all_reduce_sum(sq_norms, group=self.dp_process_group, counter=self.comm, kind="all_reduce")
        if checked:
            self._raise_if_unused(missing, int(sq_norms[-1].item()))
            sq_norms = sq_norms[:-1]
        coefficient = self._apply_norm(sq_norms)
        if coefficient is None:
            return None
        for runtime, (_, grads) in zip(self.families, parts):
            runtime._apply_step(grads, coefficient)
        self._applied_steps += 1
        return None

    @staticmethod
    def _placed(sq_norms: torch.Tensor, ep_size: int, ep_rank: int) -> torch.Tensor:
        """A family's entries at its EP rank's block of the world's vector (the dense family: as they are)."""
        if ep_size == 1:
            return sq_norms
        placed = sq_norms.new_zeros(ep_size * sq_norms.numel())
        placed[ep_rank * sq_norms.numel():(ep_rank + 1) * sq_norms.numel()] = sq_norms
        return placed

    def zero_grad(self, set_to_none: bool = True) -> None:
        for runtime in self.families:
            runtime.zero_grad(set_to_none)

    @torch.no_grad()
    def refresh_params_from_masters(self) -> None:
        for runtime in self.families:
            runtime.refresh_params_from_masters()

    def owned_gradients(self) -> dict[str, torch.Tensor]:
        """The averaged (unclipped) fp32 gradients of the owned tensors of every family, for tests and tools."""
        grads: dict[str, torch.Tensor] = {}
        for runtime in self.families:
            grads.update(runtime.owned_gradients())
        return grads

    def owned_tensors(self) -> list[OwnedTensor]:
        """Every family's owned items, ``tensor`` indexing this runtime's ``params``."""
        return [dataclasses.replace(t, tensor=self._index[id(runtime.params[t.tensor])])
                for runtime in self.families for t in runtime.owned_tensors()]

    def plan_summary(self) -> str:
        """Each family's plan on this rank (rank 0 prints it at init: the dense family and EP rank 0's experts)."""
        lines = [f"ds_canzona expert parallelism: {len(self.families)} families, one norm all-reduce over the "
                 f"{self.world_size} data-parallel ranks per step"]
        for name, runtime, (ep_size, ep_rank) in zip(self.family_names, self.families, self._ep_layout):
            where = "data-parallel group" if ep_size == 1 else (f"expert-data-parallel group of EP rank {ep_rank} "
                                                               f"of {ep_size}")
            lines.append(f"family {name} ({len(runtime.params)} tensors, {where}):")
            lines.append(runtime.plan_summary())
        return "\n".join(lines)

    # ------------------------------------------------------------------ checkpoints (zero/checkpoint/engine.py)
    # Every rank writes one shard of what it owns in every family (experts by global name), so a
    # checkpoint lists each tensor of the model once and loads at any EP and DP size: each rank
    # then reads its owned items by name.
    def checkpoint_parts(self) -> list[CanzonaZeroOptimizer]:
        """The runtimes whose plan items a load reads into, each with its own plan."""
        return list(self.families)

    def model_shapes(self) -> dict[str, list[int]]:
        """Every trained tensor of the model by name, the experts of every EP rank included."""
        return dict(self._model_shapes)

    def owned_entry_keys(self) -> list[tuple[int, int, int]]:
        """A key per item of ``checkpoint_items()`` that orders the manifest the same whoever wrote it:
        (family, EP rank, plan item)."""
        return [(f, self._ep_layout[f][1], t.index) for f, runtime in enumerate(self.families)
                for t in runtime.owned_tensors()]

    def state_dict(self) -> dict:
        state = super().state_dict()
        state["families"] = {name: {"world_size": runtime.world_size, "rank": runtime.rank}
                             for name, runtime in zip(self.family_names, self.families)}
        return state

