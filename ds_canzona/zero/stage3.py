"""ZeRO stage 3 with owner placement (MatrixFSDP): each tensor lives whole on one rank.

Every trainable tensor has one owner (``ds_canzona.plan.plan_zero3_owners``: balanced on the
optimizer step's cost and on memory); a non-matrix tensor above ``canzona.split_numel`` elements
has one per canonical piece instead, and a 3-D expert stack above it one per piece of whole experts (see the end of this docstring). The owner's ZeRO-3 shard is the whole tensor, every other
rank's is empty (``ds_canzona.zero.owner_placement``); DeepSpeed's parameter coordinator still
fetches, prefetches and releases parameters around each module, now by broadcasts from the
owners. In backward each gradient is summed onto its owner only (a ``reduce`` per item), so
the owner holds the whole averaged gradient and the optimizer step is local: the per-tensor rule
of ``ds_canzona.optim`` runs on whole tensors and the next forward's fetch carries the result.
How those collectives are launched is ``canzona.collectives`` (``ds_canzona.zero.stage3_comm``):
one per piece and item (gloo's default), or one launch per fetch and per gradient bucket of
``reduce_bucket_size`` elements (by default off gloo one operation each, padded or all-reduced as
the cost model prices lower; or grouped), with DeepSpeed's persistent parameters kept resident
and refreshed in one fetch after the step.

Numeric contract: given the same averaged gradients, every owned tensor is updated by exactly
the per-tensor rule the single-process ``ds_canzona.optim`` optimizer runs, on the same fp32
values, and clipping uses a norm summed in float64 in parameter order, one squared norm per
tensor (``ds_canzona.optim.clipping``), so parameters after a step equal the single-process
result bit for bit at every world size. The averaged gradient is each micro-batch's local
gradient summed over ranks by the reduce (in the communication dtype; ``GradientReduction`` says
where the division by the world size happens) and accumulated on the owner over micro-batches in
the accumulation dtype, then divided in fp32. Only the order of the sums differs from
single-process training on the whole batch.

Data flow per optimizer step:

    forward/backward: DeepSpeed's coordinator fetches each module's parameters before it runs
               (one broadcast per item from its owner, or one launch per fetch) and releases them
               after (persistent ones stay)
    backward:  a post-accumulate-grad hook takes each gradient; tensors are reduced to their
               owners (each piece to its own) in one fixed order on every rank (last tensor
               first, as backward produces them), a few reduces (or buckets) in flight; whatever
               has not arrived when backward ends is reduced then (a tensor without a gradient
               counts as zero)
    step:      the owner's accumulated gradients -> fp32, divided; one all-reduce of per-tensor
               squared norms (overflow + clipping); each rank updates what it owns; the result
               is written into its shard. No other collective, except one fetch of the
               persistent parameters (every mode but per piece).

Where streams are real (CUDA) the reduces and the owner's accumulation run on a reduction stream
of this runtime (after the stream each gradient came on; it waits for the collectives itself),
the compute stream waits for it once before the step, and the next fetch, issued on DeepSpeed's
all-gather stream, waits for an event recorded after the owners wrote their shards
(``ds_canzona.zero.streams``; docs/ARCHITECTURE.md). On the CPU that is all a no-op.

Non-matrix tensors use the same owner layout: whole up to ``canzona.split_numel`` elements,
above it in the canonical pieces of ``ds_canzona.plan.item_bounds``, each piece owned like a
tensor (expert stacks too, in pieces of whole experts: each expert is its own matrix to the rule). That was chosen over DeepSpeed's even layout by measurement and by contract
(docs/NOTES.md, "ZeRO-3: non-matrix tensors in pieces"): the busiest rank's elements come within
a few percent of the even layout's (whole ownership: 2-33x the average with a large vocabulary),
while the items stay those of the ZeRO-1/2 plan and the single-process clipping norm, so the
step stays bit-exact at every world size and a checkpoint's items are the same at every stage.
Frozen parameters stay on DeepSpeed's even layout.
"""

from __future__ import annotations

import torch

import deepspeed.comm as dist
from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from deepspeed.utils.torch import register_grad_hook

from ds_canzona.config import CanzonaConfig
from ds_canzona.optim import rule_for_group
from ds_canzona.optim.base import logical_shape
from ds_canzona.plan import ParamSpec, Zero3Plan, plan_zero3_owners
from ds_canzona.zero.comm import check_digest_agreement
from ds_canzona.zero.owned import GradientAfterReductionError, OwnedTensor
from ds_canzona.zero.owner_placement import LOCAL_PIECES_ATTR, OwnerLayout
from ds_canzona.zero.owner_runtime import OwnerRuntime
from ds_canzona.zero.stage3_comm import ALL_REDUCE, PADDED, PER_PIECE, LaunchGroup, PaddedSegments, \
    all_reduce_launch, back_to_back, padded_reduce_scatter, zero3_collectives
from ds_canzona.zero.streams import StreamOrder

# Reduces launched and not yet waited on during backward; each holds one tensor's gradient. Where
# streams are real (CUDA) the wait is queued on the reduction stream, not on the host or the
# compute stream (``ds_canzona.zero.streams``).
REDUCES_IN_FLIGHT = 4
# The same for gradient buckets (every mode but per piece): each holds up to
# reduce_bucket_size elements of gradients (and, padded, its flat buffers).
BUCKETS_IN_FLIGHT = 2


class _Reduction:
    """One launch of the gradient reduce in flight: its works, what this rank receives, what it read."""

    def __init__(self, works: list, received: list[tuple[int, torch.Tensor]], used: list[torch.Tensor]) -> None:
        self.works = works
        self.received = received  # (item, its summed values on this rank: meaningful on the item's owner)
        self.used = used  # buffers the collective or the reduction stream used, kept alive until it passed


class CanzonaZero3Optimizer(OwnerRuntime):
    """DeepSpeed ZeRO stage 3 optimizer whose shards are whole tensors on their owners.

    ``optimizer`` is a ``ds_canzona.optim`` optimizer (param groups with 'kind'); its rules run
    on the owned tensors, its own ``step`` never. ``offload_kwargs`` are the keyword arguments of
    DeepSpeed's ``DeepSpeedZeRoOffload`` (the parameter coordinator and its module hooks) other
    than the module, as DeepSpeed's own stage 3 passes them.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, module: torch.nn.Module, param_names: dict,
                 config: CanzonaConfig, dp_process_group, clip_grad: float, offload_kwargs: dict,
                 static_loss_scale: float = 1.0, dynamic_loss_scale: bool = False, dynamic_loss_args=None,
                 grad_accum_dtype: torch.dtype | None = None, communication_dtype: torch.dtype | None = None,
                 gradient_predivide_factor: float = 1.0, postscale_gradients: bool = True,
                 gradient_average: bool = True, reduce_bucket_numel: int | None = None, offload=None,
                 ignore_unused_parameters: bool = True):
        super().__init__(optimizer, param_names=param_names, config=config, stage=3,
                         dp_process_group=dp_process_group, clip_grad=clip_grad, grad_accum_dtype=grad_accum_dtype,
                         communication_dtype=communication_dtype, gradient_predivide_factor=gradient_predivide_factor,
                         postscale_gradients=postscale_gradients, gradient_average=gradient_average,
                         offload=offload, ignore_unused_parameters=ignore_unused_parameters)
        self.module = module
        self.logical_shapes = [logical_shape(p) for p in self.params]  # ds_shape under zero.Init

        self.plan = self._make_plan()
        check_digest_agreement(self.plan.digest(), group=dp_process_group, device=self.device)
        self._print_plan_summary()
        self._create_loss_scaler(static_loss_scale=static_loss_scale, dynamic_loss_scale=dynamic_loss_scale,
                                 dynamic_loss_args=dynamic_loss_args)

        # DeepSpeed's ZeRO-3 machinery: converts a model not built under zero.Init (even layout),
        # then fetches and releases around each module. The owner layout replaces the layout of
        # the trainable parameters underneath it.
        self.parameter_offload = DeepSpeedZeRoOffload(module, dp_process_group=dp_process_group, **offload_kwargs)
        # Per piece, priced, grouped, padded or allreduce (ds_canzona.zero.stage3_comm); all but the
        # first keep DeepSpeed's persistent parameters resident and reduce gradients in buckets.
        self.collectives = zero3_collectives(config.collectives, dp_process_group)
        self.reduce_bucket_numel = int(reduce_bucket_numel or 0)
        if self.collectives != PER_PIECE and self.reduce_bucket_numel <= 0:
            raise ValueError(f"ds_canzona: ZeRO-3 with {self.collectives} collectives needs a reduce bucket size > 0, "
                             f"got {reduce_bucket_numel!r}")
        self.layout = OwnerLayout(group=dp_process_group, counter=self.comm, mode=self.collectives,
                                  costs=config.collective_costs)
        self.layout.install(module.parameters())
        self._tensor_items = self.plan.tensor_items()
        layout_pieces: list[list[tuple[int, int, int]]] = [[] for _ in self.params]
        for item, (tensor, start, stop) in enumerate(self.plan.pieces):
            layout_pieces[tensor].append((start, stop, self.plan.owner[item]))
        keep_persistent = self.collectives != PER_PIECE
        self.layout.place(self.params, layout_pieces, keep_persistent=keep_persistent)
        if not keep_persistent:
            placed = set(map(id, self.params))
            self.parameter_offload.persistent_parameters[:] = [
                p for p in self.parameter_offload.persistent_parameters if id(p) not in placed]

        self._owned = self._build_owned_state()
        self._offload_owned(self.item_shard)
        # Where streams are real, the reduces and the owner's accumulation run on a reduction stream.
        self.streams = StreamOrder()
        self._accumulated: list[torch.Tensor | None] = [None] * len(self.plan.specs)  # per item, on its owner
        self._local: list[torch.Tensor | None] = [None] * len(self.params)  # this backward, not yet sent
        self._arrivals = [0] * len(self.params)
        self.early_launch = True
        self._inflight: list[_Reduction] = []
        # Grouped and padded collectives: gradients converted and waiting for their bucket's launch.
        self._bucket: list[tuple[int, torch.Tensor]] = []
        self._bucket_numel = 0
        self._next = len(self.params) - 1
        self._hook_handles = [register_grad_hook(p, self._make_grad_hook(i)) for i, p in enumerate(self.params)]
        self._expose_fragment_api()

    # ------------------------------------------------------------------ planning
    def _make_plan(self) -> Zero3Plan:
        specs = [ParamSpec(name=name, shape=shape, matrix=group["kind"] != "adamw",
                           heads=rule_for_group(group).plan_heads())
                 for name, shape, group in zip(self.names, self.logical_shapes, self.groups)]
        return plan_zero3_owners(specs, world_size=self.world_size, cost=self._plan_cost_model(),
                                 split_numel=self.config.split_numel)

    def plan_summary(self) -> str:
        plan = self.plan
        costs, numels = plan.rank_costs(), plan.rank_numels()
        split = len(plan.specs) - len(self.params)
        pieces = f" ({split + sum(len(i) > 1 for i in plan.tensor_items())} of them pieces)" if split else ""
        lines = [f"ds_canzona ZeRO-3 owner plan: {len(plan.specs)} items{pieces}, DP={plan.world_size}, "
                 f"cost={plan.cost_label}, cost max/avg={plan.flops_ratio:.3f}, elements max/avg={plan.memory_ratio:.3f}"]
        for r in range(plan.world_size):
            lines.append(f"  rank {r}: cost {costs[r]:.3e}, {numels[r]} elements, {len(plan.owned_params(r))} items")
        return "\n".join(lines)

    def _build_owned_state(self) -> list[OwnedTensor]:
        owned = []
        for item in self.plan.owned_params(self.rank):
            shard = self.item_shard(item)
            # fp32 models update the shard in place; lower precision keeps an fp32 master.
            master = shard if shard.dtype == torch.float32 else shard.detach().float().clone()
            tensor = self.plan.pieces[item][0]
            group = self.groups[tensor]
            owned.append(OwnedTensor(index=item, name=self.plan.specs[item].name, master=master,
                                     state=rule_for_group(group).init_state(master), group=group, tensor=tensor))
        return owned

    def item_shard(self, item: int) -> torch.Tensor:
        """Item ``item``'s low-precision values in its owner's shard, shaped like the item (owner only)."""
        tensor, start, stop = self.plan.pieces[item]
        param = self.params[tensor]
        for first, last, offset in getattr(param, LOCAL_PIECES_ATTR):
            if (first, last) == (start, stop):
                return param.ds_tensor[offset:offset + stop - start].view(self.plan.specs[item].shape)
        raise KeyError(f"ds_canzona: rank {self.rank} does not own {self.plan.specs[item].name!r}")

    # ------------------------------------------------------------------ backward
    def _make_grad_hook(self, i: int):

        def hook(param: torch.Tensor) -> None:
            if i > self._next:
                raise GradientAfterReductionError(
                    f"ds_canzona: {self.names[i]!r} received a gradient after it was reduced to its owner in this "
                    "backward pass (it would be lost). A parameter gets more than one gradient per backward under "
                    "reentrant activation checkpointing (use_reentrant=True) that uses it in more than one "
                    "checkpointed segment; use non-reentrant checkpointing (use_reentrant=False).")
            grad = param.grad
            param.grad = None
            # This hook's stream (the gradient's) may not be the one an earlier gradient of it came on.
            self.streams.use(i)
            if self._local[i] is None:
                self._local[i] = grad
            else:
                # The earlier gradient may have come on another stream: summed and dropped on this one,
                # its memory must not go back to its own stream's pool before this read.
                previous = self._local[i]
                self._local[i] = previous + grad
                self.streams.read_here(previous)
                del previous
            self._arrivals[i] += 1
            if self._arrivals[i] > 1:
                # Its first gradient was no proof that it was done: reduce only when backward ends.
                self.early_launch = False
            elif self.early_launch:
                self._launch_ready()

        return hook

    def _launch_ready(self, *, all_remaining: bool = False) -> None:
        # Tensors leave in one fixed order on every rank (last first, as backward produces them),
        # so ranks never disagree on which reduce comes next.
        while self._next >= 0 and (all_remaining or self._arrivals[self._next] > 0):
            self._launch(self._next)
            self._next -= 1

    def _launch(self, i: int) -> None:
        """Send tensor i's gradient of this backward towards its owner(s): at once per item, or into the bucket."""
        reduction = self.reduction
        grad = self._local[i]
        self._local[i] = None
        # On the reduction stream, after the stream(s) the gradient came on (no-op on a synchronised device).
        with self.streams.on_side(i):
            if grad is None:  # no gradient on this rank in this backward: it takes part as zeros
                grad = torch.zeros(self.logical_shapes[i], dtype=reduction.communicate_dtype, device=self.device)
            send = grad.to(reduction.communicate_dtype)
            if reduction.pre_divide != 1.0:
                send = send / reduction.pre_divide if send is grad else send.div_(reduction.pre_divide)
            flat = send.reshape(-1)
            if self.collectives == PER_PIECE:  # one reduce per item
                for item in self._tensor_items[i]:
                    piece = self._item_piece(flat, item)
                    work = self._reduce(piece, item)
                    self._inflight.append(_Reduction([work], [(item, piece)], [piece]))
        self.streams.forget(i)
        if send is not grad:
            self.streams.keep_alive(grad)  # read by the reduction stream; the pieces in flight hold the copy
        if self.collectives == PER_PIECE:
            self._limit_in_flight(REDUCES_IN_FLIGHT)
            return
        # Buckets close in the one fixed order of tensors, at the same sizes on every rank.
        self._bucket.append((i, flat))
        self._bucket_numel += flat.numel()
        if self._bucket_numel >= self.reduce_bucket_numel:
            self._launch_bucket()

    def _item_piece(self, flat: torch.Tensor, item: int) -> torch.Tensor:
        _, start, stop = self.plan.pieces[item]
        return flat[start:stop]

    def _reduce(self, piece: torch.Tensor, item: int):
        self.comm.add("reduce", piece.numel() * piece.element_size())
        owner = dist.get_global_rank(self.dp_process_group, self.plan.owner[item])
        return dist.reduce(piece, dst=owner, group=self.dp_process_group, async_op=True)

    def _launch_bucket(self) -> None:
        """Reduce the bucket's items to their owners in one launch: grouped reduces, one padded reduce-scatter,
        or one all-reduce (the layout's mode, or the form it prices lowest for these pieces)."""
        if not self._bucket:
            return
        bucket, self._bucket, self._bucket_numel = self._bucket, [], 0
        pieces = [(item, self._item_piece(flat, item)) for i, flat in bucket for item in self._tensor_items[i]]
        form = self.layout.launch_form([(piece.numel(), self.plan.owner[item]) for item, piece in pieces],
                                       self.reduction.communicate_dtype.itemsize)
        with self.streams.on_side():
            if form == PADDED:
                reduction = self._reduce_scatter_padded(pieces)
            elif form == ALL_REDUCE:
                reduction = self._reduce_all_reduced(pieces)
            else:
                with LaunchGroup(group=self.dp_process_group, device=self.device) as launch:
                    for item, piece in pieces:
                        launch.add(self._reduce(piece, item))
                reduction = _Reduction(launch.works, pieces, [piece for _, piece in pieces])
        self._inflight.append(reduction)
        self._limit_in_flight(BUCKETS_IN_FLIGHT)

    def _reduce_scatter_padded(self, pieces: list[tuple[int, torch.Tensor]]) -> _Reduction:
        """One reduce-scatter of the bucket, each owner's items back to back in its segment, padded to the longest."""
        layout = PaddedSegments([(piece.numel(), self.plan.owner[item]) for item, piece in pieces], self.world_size)
        dtype = self.reduction.communicate_dtype
        flat = torch.empty(layout.numel, dtype=dtype, device=self.device)
        layout.zero_padding(flat)
        received = []
        segment_start = self.rank * layout.segment
        out = torch.empty(layout.segment, dtype=dtype, device=self.device)
        for (item, piece), position in zip(pieces, layout.position):
            flat[position:position + piece.numel()].copy_(piece)
            if self.plan.owner[item] == self.rank:
                offset = position - segment_start
                received.append((item, out[offset:offset + piece.numel()]))
        self.comm.add("reduce_scatter_tensor", flat.numel() * flat.element_size())
        work = padded_reduce_scatter(out, flat, group=self.dp_process_group)
        return _Reduction([work], received, [flat, out] + [piece for _, piece in pieces])

    def _reduce_all_reduced(self, pieces: list[tuple[int, torch.Tensor]]) -> _Reduction:
        """One in-place all-reduce of the bucket's items back to back; each owner reads its items' sums."""
        positions = back_to_back([piece.numel() for _, piece in pieces])
        flat = torch.empty(sum(piece.numel() for _, piece in pieces), dtype=self.reduction.communicate_dtype,
                           device=self.device)
        received = []
        for (item, piece), position in zip(pieces, positions):
            summed = flat[position:position + piece.numel()]
            summed.copy_(piece)
            if self.plan.owner[item] == self.rank:
                received.append((item, summed))
        self.comm.add("all_reduce_gradients", flat.numel() * flat.element_size())
        work = all_reduce_launch(flat, group=self.dp_process_group)
        return _Reduction([work], received, [flat] + [piece for _, piece in pieces])

    def _limit_in_flight(self, limit: int) -> None:
        while len(self._inflight) > limit:
            self._complete_oldest()

    def _complete_oldest(self) -> None:
        reduction = self._inflight.pop(0)
        for work in reduction.works:
            self.streams.wait(work)  # on the reduction stream where streams are real: never the compute stream's wait
        mine = [(item, summed) for item, summed in reduction.received if self.plan.owner[item] == self.rank]
        if mine:
            # The owner's accumulators live on the reduction stream until the step.
            with self.streams.on_side():
                for item, summed in mine:
                    if self._accumulated[item] is None:
                        self._accumulated[item] = summed.to(self.reduction.accumulate_dtype, copy=True)
                    else:
                        self._accumulated[item].add_(summed)
        self.streams.keep_alive(*reduction.used)

    def _wait_reductions(self) -> None:
        """Every reduce in flight completed (where streams are real: queued on the reduction stream)."""
        while self._inflight:
            self._complete_oldest()

    def _reduced_gradients_ready(self) -> None:
        """Before the owners' accumulators are read off the reduction stream: the compute stream waits for it."""
        self._wait_reductions()
        self.streams.compute_waits()

    def overlapping_partition_gradients_reduce_epilogue(self) -> None:
        """Engine hook after every backward at stage 3 (on every rank): reduce what is left of it.

        The only place that launches the rest, so every rank issues one reduce per tensor per
        backward, whatever gradients it saw.
        """
        self._launch_ready(all_remaining=True)
        self._launch_bucket()
        self._wait_reductions()
        self._next = len(self.params) - 1
        self._note_arrivals(self._arrivals)
        self._arrivals = [0] * len(self.params)

    def backward_epilogue(self, **kwargs) -> None:
        release = getattr(self.parameter_offload, "release_backward_leftovers", None)
        # Frees the parameters of modules whose post-backward hook never fired (a no-grad input).
        # DeepSpeed 0.19.0-0.19.2 have no such call (0.19.3 on do); there they stay fetched until
        # partition_all_parameters at the start of the step.
        if release is not None:
            release()

    # ------------------------------------------------------------------ step
    def owned_gradients(self) -> dict[str, torch.Tensor]:
        """The averaged (unclipped) fp32 gradients of the owned tensors, for tests and tools."""
        self._reduced_gradients_ready()
        return {t.name: self._averaged_grad(t.index) for t in self._owned}

    def _averaged_grad(self, item: int, *, consume: bool = False) -> torch.Tensor:
        """Item ``item``'s averaged fp32 gradient; ``consume``: an fp32 accumulator is divided in place
        (the step's case: it is dropped afterwards, so no second copy of every gradient is made)."""
        shape = self.plan.specs[item].shape
        accumulated = self._accumulated[item]
        if accumulated is None:
            return torch.zeros(shape, dtype=torch.float32, device=self.device)
        return self._unscaled(accumulated.to(torch.float32, copy=not consume).view(shape))

    def _step_gradients(self) -> tuple[list[int], list[torch.Tensor]]:
        self._reduced_gradients_ready()
        # Nothing stays gathered across the update: the next forward fetches the new values.
        self.parameter_offload.partition_all_parameters()
        return [t.index for t in self._owned], [self._averaged_grad(t.index, consume=True) for t in self._owned]

    def _publish_updates(self) -> None:
        self.write_masters_to_shards()
        self._fetch_persistent()

    def refresh_params_from_masters(self) -> None:
        """After masters were written (a checkpoint load): release every fetched copy, update the shards."""
        self.parameter_offload.partition_all_parameters()
        self.write_masters_to_shards()
        self._fetch_persistent()

    def _fetch_persistent(self) -> None:
        """The persistent parameters' new values to every rank, in one fetch (as DeepSpeed's stage 3 after its step).

        The per-piece mode keeps none persistent: the coordinator fetches frozen persistent ones
        when a module next needs them, as before.
        """
        if self.collectives == PER_PIECE:
            return
        released = [p for p in self.parameter_offload.persistent_parameters
                    if p.ds_status == ZeroParamStatus.NOT_AVAILABLE]
        if released:
            released[0].all_gather(released)

    @torch.no_grad()
    def write_masters_to_shards(self) -> None:
        if self.offload is not None:
            self.offload.write_views(self._owned)  # host masters; right after an offloaded step, already written
        for t in self._owned if self.offload is None else ():
            shard = self.item_shard(t.index)
            if t.master.data_ptr() != shard.data_ptr():  # fp32: the master is the shard itself
                shard.copy_(t.master)
        # The next fetch broadcasts the shards from DeepSpeed's all-gather stream: it waits for these
        # writes (and, fp32, for the update that wrote the shard in place).
        self.layout.shards_written()

    def zero_grad(self, set_to_none: bool = True) -> None:
        # The step has read the accumulators (compute stream); they are dropped here and the next
        # backward's reduces reuse their memory from the reduction stream.
        self.streams.side_waits()
        self._accumulated = [None] * len(self.plan.specs)
        for p in self.params:
            p.grad = None

    # ------------------------------------------------------------------ engine glue
    def empty_partition_cache(self) -> None:
        self.parameter_offload.empty_partition_cache()

    def destroy(self) -> None:
        for handle in self._hook_handles:
            handle.remove()
        self.parameter_offload.destroy()


__all__ = ["CanzonaZero3Optimizer"]
