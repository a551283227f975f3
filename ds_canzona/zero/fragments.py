"""DeepSpeed's tensor-fragment API on ds_canzona's runtimes.

``deepspeed.utils.safe_get_full_fp32_param``, ``safe_set_full_fp32_param``, ``safe_get_full_grad``,
``safe_set_full_grad``, ``safe_get_full_optimizer_state``, ``safe_set_full_optimizer_state``, the
ZeRO-3 ``safe_get_local_*`` / ``safe_set_local_*`` functions and ``safe_update_full_grad_vectorized``
dispatch on attributes of the parameter: at stage 1/2 on ``param._hp_mapping`` and methods bound to
the parameter (``get_full_hp_param``, ``set_full_hp_param``, ``get_full_hp_grad``,
``set_full_hp_grad``), at stage 3 on ``param.ds_id`` and ``param._z3_optimizer``. DeepSpeed's own
optimizers set these; ``FragmentAPI`` sets them for a ds_canzona runtime, so DeepSpeed's functions
run unpatched and answer from the owners:

- Every plan item (a whole tensor, or a canonical piece of a large non-matrix one) has one owner
  rank that holds its fp32 master, its optimizer state and its averaged gradient. A full getter
  is a collective over the data-parallel group, as DeepSpeed's is (every rank calls it, in the
  same order): each item is broadcast from its owner, and every rank returns the whole fp32
  tensor. A full setter is called by every rank with the same whole value (as DeepSpeed's); each
  owner keeps its items' part, no collective.
- Setting a parameter writes the owner's fp32 master and also the low-precision parameter
  (stage 1/2: every rank writes the value it was given into its copy; stage 3: the owner into its
  shard, which the next fetch broadcasts), so the next forward sees the new value on every rank
  alike, as after setting a parameter in plain torch. DeepSpeed writes only the master, so its
  next forward still sees the old parameter (until the next step copies the master into it).
- Gradients, as DeepSpeed's ZeRO optimizers give them: the averaged gradient over the
  data-parallel group, before clipping, still multiplied by the loss scale (fp16; 1 otherwise),
  in fp32. At stage 1/2 they exist between the boundary micro-batch's backward and
  ``engine.step()`` (DeepSpeed's rule; other times ``ValueError``, as DeepSpeed raises); at
  stage 3 it is what has been reduced to the owner since the last step (zeros right after one). A set gradient is the step's gradient
  of that tensor (divided by the loss scale there), kept exactly in fp32; call it after the
  boundary backward.
- Optimizer state: the per-element state tensors of the tensor's rule by the rule's names (AdamW:
  ``exp_avg``, ``exp_avg_sq``; Muon: ``momentum_buffer``; Shampoo's grafting and SOAP's moments:
  ``exp_avg``, ``exp_avg_sq``; DeepSpeed's names, same meaning for AdamW and Muon). Other names
  raise ``ValueError`` listing the tensor's names (Shampoo's and SOAP's statistics and the step
  counters are whole-tensor state: ``engine.optimizer.state_dict()`` on the owner).
- Local API (stage 3 only, as DeepSpeed's): this rank's part of the tensor, laid out as its
  ``ds_tensor`` (the owned pieces at their shard offsets): the whole tensor on its owner, an empty
  tensor on the other ranks (DeepSpeed's meaning, "this rank's partition", and what its tests
  expect: a tensor on every rank for a trainable parameter). At stage 1/2 DeepSpeed's local
  functions assert a ZeRO-3 parameter, as they do for DeepSpeed's own stage 1/2.
- AutoTP: a parameter is this rank's TP slice, as in DeepSpeed, and "full" means the full value
  of that slice across data parallelism. A sharded matrix's master and state live whole on its
  host (``zero/tp.py``): a getter broadcasts them over its DP owner's TP group first, a setter
  gathers the slices to the host.

Frozen parameters: the getters return None and the setters do nothing (DeepSpeed's behaviour).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

import deepspeed.comm as dist

from ds_canzona.optim import rule_for_group
from ds_canzona.zero.owned import OwnedTensor
from ds_canzona.zero.owner_placement import LOCAL_PIECES_ATTR

__all__ = ["FragmentAPI", "OwnerMapping"]


@dataclass(frozen=True)
class OwnerMapping:
    """What ``param._hp_mapping`` is at stage 1/2 (DeepSpeed reads only that it is not None): where the tensor lives."""

    name: str
    items: tuple[int, ...]
    owners: tuple[int, ...]


class FragmentAPI:
    """The tensor-fragment API for one runtime (``stage12.CanzonaZeroOptimizer``, its AutoTP subclass or
    ``stage3.CanzonaZero3Optimizer``); ``attach`` puts DeepSpeed's attributes on the parameters.

    Reads the runtime's plan and buffers directly (it is part of the runtime, kept apart because
    these functions serve users, not the step).
    """

    def __init__(self, runtime):
        self.runtime = runtime
        self.zero3 = runtime.stage == 3
        self.tp = getattr(runtime, "tp_group", None) is not None
        plan = runtime.plan
        self.items_of: list[list[int]] = [[] for _ in runtime.params]
        for item, (tensor, _, _) in enumerate(plan.pieces):
            self.items_of[tensor].append(item)
        self.index_of = {id(p): i for i, p in enumerate(runtime.params)}
        self._state_keys: dict[int, list[str]] = {}
        # Gradients set through the API, by plan item, on the owner: averaged, times the loss scale, fp32.
        self.gradient_overrides: dict[int, torch.Tensor] = {}

    # ------------------------------------------------------------------ attaching
    def attach(self) -> None:
        runtime = self.runtime
        if self.zero3:
            for param in runtime.module.parameters():
                param._z3_optimizer = self  # frozen ones too: DeepSpeed's functions then return None for them
            return
        for i, param in enumerate(runtime.params):
            param._hp_mapping = OwnerMapping(name=runtime.names[i], items=tuple(self.items_of[i]),
                                             owners=tuple(runtime.plan.owner[j] for j in self.items_of[i]))
            param.get_full_hp_param = functools.partial(self.full_value, i)
            param.set_full_hp_param = functools.partial(self.set_value, i)
            param.get_full_hp_grad = functools.partial(self.full_grad, i)
            param.set_full_hp_grad = functools.partial(self.set_grad, i)

    # ------------------------------------------------------------------ ZeRO-3: DeepSpeed's _z3_optimizer methods
    def _trained(self, param) -> int | None:
        if not param.requires_grad:
            return None
        index = self.index_of.get(id(param))
        if index is None:
            raise ValueError("ds_canzona: this parameter is trainable but not trained by the engine's optimizer")
        return index

    def get_full_hp_param(self, param, optim_state_key=None):
        index = self._trained(param)
        return None if index is None else self.full_value(index, optim_state_key)

    def set_full_hp_param(self, value, param, optim_state_key=None):
        index = self._trained(param)
        if index is not None:
            self.set_value(index, value, optim_state_key)

    def get_fp32_grad_for_param(self, param):
        index = self._trained(param)
        return None if index is None else self.full_grad(index)

    def set_fp32_grad_for_param(self, value, param):
        index = self._trained(param)
        if index is not None:
            self.set_grad(index, value)

    def update_fp32_grad_for_param_vectorized(self, update_func, param_list):
        for param in param_list:
            index = self._trained(param)
            if index is not None:
                self.set_grad(index, update_func(self.full_grad(index), param))

    def get_local_fp32_param(self, param, optim_state_key=None):
        index = self._trained(param)
        return None if index is None else self.local_value(index, self._source(index, optim_state_key))

    def set_local_hp_param(self, value, param, optim_state_key=None):
        index = self._trained(param)
        if index is not None:
            self.set_local(index, value, self._writer(index, optim_state_key))
            if optim_state_key is None:
                self._refresh_parameter(index, None)

    def get_local_fp32_grad_for_param(self, param):
        index = self._trained(param)
        return None if index is None else self.local_value(index, self._grad_source())

    def set_local_grad_for_param(self, value, param):
        index = self._trained(param)
        if index is not None:
            self.set_local(index, value, self._grad_writer)

    # ------------------------------------------------------------------ full values
    def full_value(self, tensor: int, optim_state_key: str | None = None) -> torch.Tensor:
        """The whole fp32 parameter (or its state ``optim_state_key``) on every rank: a collective."""
        return self._gather(tensor, self._source(tensor, optim_state_key), optim_state_key)

    def set_value(self, tensor: int, value: torch.Tensor, optim_state_key: str | None = None) -> None:
        """Write the whole value (the same on every rank) into the owners' masters or state."""
        flat = self._checked_flat(tensor, value)
        self._scatter(tensor, flat, self._writer(tensor, optim_state_key), optim_state_key)
        if optim_state_key is None:
            self._refresh_parameter(tensor, flat)

    def full_grad(self, tensor: int) -> torch.Tensor:
        """The averaged gradient (times the loss scale) in fp32 on every rank: a collective."""
        self._check_gradients_available(tensor)
        return self._gather(tensor, self._grad_source(), "grad")

    def set_grad(self, tensor: int, value: torch.Tensor) -> None:
        self._check_gradients_available(tensor)
        self._scatter(tensor, self._checked_flat(tensor, value), self._grad_writer, "grad")

    def gradients_for_step(self, items: list[int], grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """The step's gradients with those set through the API in place (divided by the loss scale); consumes them."""
        overrides, self.gradient_overrides = self.gradient_overrides, {}
        scale = self.runtime.loss_scaler.cur_scale
        for position, item in enumerate(items):
            if item in overrides:
                grad = overrides[item].clone().view_as(grads[position])
                grads[position] = grad.div_(scale) if scale != 1.0 else grad
        return grads

    # ------------------------------------------------------------------ local values (ZeRO-3)
    def local_value(self, tensor: int, source) -> torch.Tensor:
        """This rank's part, laid out as its ``ds_tensor`` (fp32, 1-D; empty on a rank that owns none of it)."""
        param = self.runtime.params[tensor]
        out = torch.zeros(param.ds_tensor.numel(), dtype=torch.float32, device=self.runtime.device)
        for item, offset in self._local_items(tensor):
            piece = source(item).reshape(-1)
            out[offset:offset + piece.numel()].copy_(piece)
        return out

    def set_local(self, tensor: int, value: torch.Tensor, write) -> None:
        param = self.runtime.params[tensor]
        if value.numel() != param.ds_tensor.numel():
            raise ValueError(f"ds_canzona: {self.runtime.names[tensor]!r}: a local value of {value.numel()} elements "
                             f"for a local partition of {param.ds_tensor.numel()}")
        flat = value.detach().to(device=self.runtime.device, dtype=torch.float32).reshape(-1)
        for item, offset in self._local_items(tensor):
            write(item, flat[offset:offset + self._item_numel(item)])

    def _local_items(self, tensor: int) -> list[tuple[int, int]]:
        """(item, offset in ds_tensor) of the pieces of ``tensor`` this rank owns."""
        by_start = {self.runtime.plan.pieces[item][1]: item for item in self.items_of[tensor]}
        return [(by_start[start], offset) for start, _, offset in getattr(self.runtime.params[tensor], LOCAL_PIECES_ATTR)]

    # ------------------------------------------------------------------ where an item's values are
    def _owned(self, item: int) -> OwnedTensor | None:
        """This rank's record of ``item`` if it updates it (for a TP-sharded matrix: its host's whole matrix)."""
        runtime = self.runtime
        if self.tp and runtime._is_tp_matrix(item):
            return runtime._hosted.get(item)
        return next((t for t in runtime._owned if t.index == item), None)

    def _range(self, item: int) -> tuple[int, int]:
        """The item's [start, stop) in its tensor's (local, flattened) elements."""
        if self.zero3:
            return self.runtime.plan.pieces[item][1:]
        return self.runtime.layout.piece_range[item]

    def _item_numel(self, item: int) -> int:
        start, stop = self._range(item)
        return stop - start

    def _shape(self, tensor: int) -> tuple[int, ...]:
        return tuple(self.runtime.logical_shapes[tensor]) if self.zero3 else tuple(self.runtime.params[tensor].shape)

    def _is_owner(self, item: int) -> bool:
        return self.runtime.plan.owner[item] == self.runtime.rank

    def _hosted_matrix(self, item: int) -> bool:
        return self.tp and self.runtime._is_tp_matrix(item)

    def state_keys(self, tensor: int) -> list[str]:
        """The per-element state of the tensor's rule, by name (the same on every rank: from the rule, not the owner)."""
        if tensor not in self._state_keys:
            item = self.items_of[tensor][0]
            shape = tuple(self.runtime.plan.specs[item].shape)
            template = rule_for_group(self.runtime.groups[tensor]).init_state(torch.empty(shape, device="meta"))
            # Per-element state is allocated like the parameter (its shape, on its device: meta
            # here); counters are CPU tensors by design and statistics have other shapes.
            self._state_keys[tensor] = [k for k, v in template.items()
                                        if torch.is_tensor(v) and v.is_meta and tuple(v.shape) == shape]
        return self._state_keys[tensor]

    def _check_key(self, tensor: int, key: str) -> None:
        keys = self.state_keys(tensor)
        if key not in keys:
            group = self.runtime.groups[tensor]
            raise ValueError(f"ds_canzona: {self.runtime.names[tensor]!r} (rule {group['kind']}) has no per-element "
                             f"optimizer state {key!r}; it has {keys}. Whole-tensor state (statistics, step "
                             "counters) is in engine.optimizer.state_dict() on the tensor's owner")

    def _source(self, tensor: int, key: str | None):
        """item -> its fp32 values on the owner (the master, or the state ``key``)."""
        if key is not None:
            self._check_key(tensor, key)
        return lambda item: self._owned(item).master if key is None else self._owned(item).state[key]

    def _writer(self, tensor: int, key: str | None):
        """(item, flat fp32 values) -> written into the owner's master or state ``key``."""
        if key is not None:
            self._check_key(tensor, key)

        @torch.no_grad()
        def write(item: int, values: torch.Tensor) -> None:
            owned = self._owned(item)
            target = owned.master if key is None else owned.state[key]
            target.copy_(values.view_as(target))

        return write

    def _grad_source(self):
        runtime = self.runtime

        def read(item: int) -> torch.Tensor:
            if item in self.gradient_overrides:
                return self.gradient_overrides[item]
            if self.zero3:
                runtime._reduced_gradients_ready()
                reduced = runtime._accumulated[item]
                if reduced is None:  # nothing reduced since the last step
                    return torch.zeros(self._item_numel(item), dtype=torch.float32, device=runtime.device)
            else:
                reduced = runtime._segment_grad(item)
            grad = reduced.to(torch.float32, copy=True)
            # The division the step makes before unscaling (the world size, unless done before the sum).
            post_divide = runtime.reduction.post_divide
            return grad.div_(post_divide) if post_divide != 1.0 else grad

        return read

    def _grad_writer(self, item: int, values: torch.Tensor) -> None:
        self.gradient_overrides[item] = values.clone()

    def _check_gradients_available(self, tensor: int) -> None:
        if not self.zero3 and self.runtime._next_bucket >= 0:
            # ValueError, as DeepSpeed's ZeRO-1/2 raises for the same call.
            raise ValueError(f"ds_canzona: the gradient of {self.runtime.names[tensor]!r} is available only between "
                               "the backward of a gradient accumulation boundary and engine.step() (as with DeepSpeed's "
                               "ZeRO-1/2): it has not been reduced yet")

    # ------------------------------------------------------------------ collectives
    def _checked_flat(self, tensor: int, value: torch.Tensor) -> torch.Tensor:
        shape = self._shape(tensor)
        numel = 1
        for size in shape:
            numel *= size
        if value.numel() != numel:
            raise ValueError(f"ds_canzona: {self.runtime.names[tensor]!r} has shape {list(shape)}, "
                             f"got a value of shape {list(value.shape)}")
        return value.detach().to(device=self.runtime.device, dtype=torch.float32).reshape(-1)

    def _gather(self, tensor: int, source, key) -> torch.Tensor:
        runtime = self.runtime
        shape = self._shape(tensor)
        out = torch.zeros(shape, dtype=torch.float32, device=runtime.device).view(-1)
        for item in self.items_of[tensor]:
            start, stop = self._range(item)
            piece = out[start:stop]
            if self._is_owner(item):
                if self._hosted_matrix(item):
                    piece.copy_(self._slice_from_host(item, source, key).reshape(-1))
                else:
                    piece.copy_(source(item).reshape(-1))
            if runtime.world_size > 1:
                runtime.comm.add("fragment", piece.numel() * piece.element_size())
                dist.broadcast(piece, src=dist.get_global_rank(runtime.dp_process_group, runtime.plan.owner[item]),
                               group=runtime.dp_process_group)
        return out.view(shape)

    def _scatter(self, tensor: int, flat: torch.Tensor, write, key) -> None:
        for item in self.items_of[tensor]:
            if not self._is_owner(item):
                continue
            start, stop = self._range(item)
            if self._hosted_matrix(item) and key != "grad":  # the reduced gradient of a slice is this rank's own
                self._write_to_host(item, flat[start:stop], write)
            else:
                write(item, flat[start:stop])

    @torch.no_grad()
    def _refresh_parameter(self, tensor: int, flat: torch.Tensor | None) -> None:
        """After its masters were set: the low-precision parameter too (stage 3: the owner's shard; else ``flat``)."""
        runtime = self.runtime
        if self.zero3:
            for item, _ in self._local_items(tensor):
                shard = runtime.item_shard(item)
                master = self._owned(item).master
                if master.data_ptr() != shard.data_ptr():
                    shard.copy_(master)
            runtime.layout.shards_written()
        else:
            param = runtime.params[tensor]
            param.data.copy_(flat.view_as(param))

    # ------------------------------------------------------------------ AutoTP: a sharded matrix's host
    def _host_rank(self, item: int) -> int:
        """The TP rank (within the DP owner's TP group) that hosts the whole matrix."""
        return self.runtime.item_file(item) % self.runtime.tp_size

    def _slice_from_host(self, item: int, source, key) -> torch.Tensor:
        """This TP rank's slice of the host's whole matrix (or of its gradient's: the local segment)."""
        runtime = self.runtime
        if key == "grad":
            return source(item)
        split = runtime.splits[runtime.plan.pieces[item][0]]
        whole = torch.empty(split.logical_shape, dtype=torch.float32, device=runtime.device)
        host = self._host_rank(item)
        if runtime.tp_rank == host:
            whole.copy_(source(item).view(split.logical_shape))
        runtime.comm.add("fragment", whole.numel() * whole.element_size())
        dist.broadcast(whole, src=runtime.rank * runtime.tp_size + host, group=runtime.tp_group)
        return split.slice_of(whole, runtime.tp_rank)

    def _write_to_host(self, item: int, values: torch.Tensor, write) -> None:
        """Every TP rank's slice of the new whole matrix, gathered to its host, which writes it."""
        runtime = self.runtime
        split = runtime.splits[runtime.plan.pieces[item][0]]
        width = max(split.local_numel(r) for r in range(runtime.tp_size))
        mine = torch.zeros(width, dtype=torch.float32, device=runtime.device)
        mine[:values.numel()] = values
        rows = [torch.empty_like(mine) for _ in range(runtime.tp_size)]
        runtime.comm.add("fragment", mine.numel() * mine.element_size())
        dist.all_gather(rows, mine, group=runtime.tp_group)
        if runtime.tp_rank != self._host_rank(item):
            return
        whole = torch.empty(split.logical_shape, dtype=torch.float32, device=runtime.device)
        for rank, row in enumerate(rows):
            split.write_slice(whole, rank, row[:split.local_numel(rank)].view(split.local_shape(rank)))
        write(item, whole.reshape(-1))
