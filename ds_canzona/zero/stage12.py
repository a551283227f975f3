"""ZeRO stage 1/2 with atomic start-index ownership (Canzona, data parallel).

Numeric contract: given the same averaged gradients, every owned tensor is updated by exactly
the per-tensor rule that the single-process ``ds_canzona.optim`` optimizers run, on the same
fp32 values, and gradient clipping uses a norm summed in float64 in buffer order, one squared
norm per plan item (``ds_canzona.optim.clipping``), so parameters after a step equal the
single-process result bit for bit at every world size. Items are whole tensors, and pieces of
non-matrix tensors and of 3-D expert stacks above ``canzona.split_numel`` (canonical: the same
at every world size; ``ds_canzona.plan.item_bounds``).
The averaged gradient itself is each rank's accumulated gradient summed over ranks by the
reduce-scatter and divided by the world size in fp32 (by default; ``GradientReduction`` for
DeepSpeed's keys that move the division before the sum or change the dtypes); what differs
from single-process training on the whole batch is only the order of that sum and, below fp32,
the roundings of the accumulation and communication dtypes (tests/test_grad_numerics.py bounds
both against plain torch).

Data flow per optimizer step:

    backward:  each gradient is added into its bucket's flat buffer (plan order, in the
               accumulation dtype) by a post-accumulate-grad hook
               stage 2: on the boundary micro-batch a bucket is reduce-scattered (uneven cuts,
               in the communication dtype) once every one of its tensors has had its gradient,
               buckets leaving in one fixed order (last first); its buffer is released once
               that is done; whatever is not complete is reduced when backward ends
               stage 1: all buckets when the boundary backward ends, buffers kept
    step:      fp32 copy of the owned segment, divided by the world size (the part of it not
               divided before the sum) and the loss scale,
               one all-reduce of per-item squared norms (overflow + clipping), each rank
               updates the items it owns (whole matrices, non-matrix tensors or their pieces),
               gather group by gather group (consecutive buckets, ``canzona.all_gather_groups``),
               each group's all-gathers issued as one launch once its buckets are updated

Each bucket's reduce-scatter and each gather group's all-gather is one operation by default (a padded equal-size
collective or an all-reduce; a single owner's reduce / broadcast), or grouped (a reduce / broadcast per non-empty
segment), chosen at init by ``ds_canzona.plan.collectives`` from ``canzona.collectives`` (``ds_canzona.zero.comm``).

Where streams are real (CUDA) the reduce-scatters, with their conversion and pre-division, run on
a reduction stream of this runtime that waits for every stream that wrote the bucket and for the
collectives' ends itself; the compute stream waits for it once before the step
(``ds_canzona.zero.streams``; docs/ARCHITECTURE.md, "Streams"). On the CPU that is all a no-op.

A tensor whose gradient never arrives (unused on this rank, this step) counts as zero. One whose
gradient arrives twice in one backward (reentrant activation checkpointing that uses it in two
checkpointed segments) is accumulated, and the engine stops launching buckets before backward
ends; a gradient that arrives for a bucket already reduce-scattered this step raises
``GradientAfterReductionError`` instead of being lost. No collective runs inside the optimizer
math.
"""

from __future__ import annotations

import torch

from ds_canzona.config import CANZONA_SECTION, CanzonaConfig, CanzonaConfigError
from ds_canzona.optim import rule_for_group
from ds_canzona.plan import DPPlan, MemoryCapError, ParamSpec, StateMemory, memory_model, plan_dp_partitions
from ds_canzona.plan.collectives import PADDED, BucketForms, bucket_forms
from ds_canzona.plan.gather_groups import all_gather_groups
from ds_canzona.plan.report import format_all_gather_groups, format_collective_forms
from ds_canzona.zero.comm import all_gather_buckets, backend_name, check_digest_agreement, reduce_scatter_bucket
from ds_canzona.zero.compat import at_accumulation_boundary
from ds_canzona.zero.layout import BufferLayout
from ds_canzona.zero.offload import OffloadedDeviceMemory
from ds_canzona.zero.owned import GradientAfterReductionError, OwnedTensor
from ds_canzona.zero.owner_runtime import OwnerRuntime
from ds_canzona.zero.streams import StreamOrder

# Stage 2 reduce-scatters launched and not yet waited on. One is not enough on a busy host: the
# next bucket's gradients then wait inside backward for the previous collective (measured with
# gloo on 2 cores: 1% slower per iteration than DeepSpeed's stage 2 at DP=3); each extra one
# holds one more bucket of gradients. Where streams are real (CUDA) the wait is queued on the
# reduction stream, not on the host or the compute stream (``ds_canzona.zero.streams``): the limit
# bounds the buckets this runtime holds, and a released bucket's memory is the caching allocator's
# again once the reduction stream has passed the end of its collective.
REDUCE_SCATTERS_IN_FLIGHT = 2


class CanzonaZeroOptimizer(OwnerRuntime):
    """DeepSpeed ZeRO stage 1/2 optimizer in which every matrix is owned whole by one rank.

    ``optimizer`` is a ``ds_canzona.optim`` optimizer: its ``param_groups`` (with 'kind' and
    the hyper-parameters) are the ones the engine's lr scheduler edits, and its per-tensor rules
    are what this class runs on the owned tensors. Its own ``step`` is never called.

    ``grad_accum_dtype``, ``communication_dtype``, ``postscale_gradients``,
    ``gradient_predivide_factor`` and ``gradient_average`` are the engine's values of DeepSpeed's
    keys of the same meaning (``gradient_reduction``); unset dtypes are the parameter dtype.
    ``members`` and ``average_over``: one family of an expert-parallel model
    (``ds_canzona.zero.expert_parallel``): these parameters only, averaged over that many ranks.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, param_names: dict, config: CanzonaConfig,
                 stage: int, dp_process_group, clip_grad: float, bucket_numel: int,
                 static_loss_scale: float = 1.0, dynamic_loss_scale: bool = False, dynamic_loss_args=None,
                 grad_accum_dtype: torch.dtype | None = None, communication_dtype: torch.dtype | None = None,
                 gradient_predivide_factor: float = 1.0, postscale_gradients: bool = True,
                 gradient_average: bool = True, offload=None, ignore_unused_parameters: bool = True,
                 members=None, average_over: int | None = None):
        if stage not in (1, 2):
            raise ValueError(f"ds_canzona supports ZeRO stage 1 and 2, got {stage=}")
        super().__init__(optimizer, param_names=param_names, config=config, stage=stage,
                         dp_process_group=dp_process_group, clip_grad=clip_grad, grad_accum_dtype=grad_accum_dtype,
                         communication_dtype=communication_dtype, gradient_predivide_factor=gradient_predivide_factor,
                         postscale_gradients=postscale_gradients, gradient_average=gradient_average,
                         offload=offload, ignore_unused_parameters=ignore_unused_parameters,
                         members=members, average_over=average_over)

        self.plan = self._make_plan(bucket_numel)
        self.layout = self._buffer_layout()
        # Consecutive buckets whose all-gathers go out as one launch (a function of the plan: the same on every rank).
        self.gather_groups = all_gather_groups(len(self.plan.buckets), self.config.all_gather_groups)
        self.collective_forms = self._choose_collective_forms()
        self._check_plan_agreement()
        self._print_plan_summary()
        self._create_loss_scaler(static_loss_scale=static_loss_scale, dynamic_loss_scale=dynamic_loss_scale,
                                 dynamic_loss_args=dynamic_loss_args)

        # Where streams are real, the reduce-scatters run on a reduction stream of their own.
        self.streams = StreamOrder()
        self._index_tensors()
        self._build_buffers()
        self._owned = self._build_owned_state()
        self._offload_owned(self.item_view)
        # Stage 2 reduce-scatters a bucket during backward once all its tensors' gradients are in.
        # Turned off for good the first time a gradient arrives twice in one backward: this model's
        # gradients are then not final when they first arrive (see _record_arrival).
        self.early_launch = self.partition_gradients
        self._arrivals = [0] * len(self.params)  # gradients per tensor in the current backward
        self._register_grad_hooks()
        self._reset_reduction()
        self._expose_fragment_api()

    # ------------------------------------------------------------------ planning
    def _plan_shapes(self) -> list[tuple[int, ...]]:
        """The shape the plan prices for each tensor: its own (the tensor-parallel runtime: its logical one)."""
        return [tuple(p.shape) for p in self.params]

    def _held_numels(self) -> list[int] | None:
        """Per tensor, the elements a rank's buffers hold of it, on which buckets close (None: the planned shapes')."""
        return None

    def _buffer_layout(self) -> BufferLayout:
        """Where each plan item lies in this rank's flat buffers: the plan's own offsets without TP."""
        return BufferLayout.of_plan(self.plan)

    def _make_plan(self, bucket_numel: int) -> DPPlan:
        self.logical_shapes = self._plan_shapes()
        specs = [ParamSpec(name=name, shape=shape, matrix=group["kind"] != "adamw",
                           heads=rule_for_group(group).plan_heads())
                 for name, shape, group in zip(self.names, self.logical_shapes, self.groups)]
        cap = self.config.max_state_bytes_per_rank
        try:
            return plan_dp_partitions(specs, world_size=self.world_size, bucket_numel=bucket_numel,
                                      alpha=self.config.alpha, strategy=self.config.strategy,
                                      cost=self._plan_cost_model(), split_numel=self.config.split_numel,
                                      memory=self._plan_memory_model(), max_state_bytes_per_rank=cap,
                                      held_numels=self._held_numels())
        except MemoryCapError as error:  # before any buffer is allocated
            raise CanzonaConfigError(f"{CANZONA_SECTION}.{error}") from None

    def _plan_memory_model(self):
        """The memory the plan balances second: the owner's bytes per item (``_state_memory_model``).

        With offload_optimizer and ``canzona.max_state_bytes_per_rank`` the cap is on device bytes,
        so the plan counts those (``OffloadedDeviceMemory``: the gradient segment). Without a cap
        it balances all of the owner's bytes, host and device, as without offload: the plan, and so
        the order of every reduction, is then the same offloaded or not.
        """
        model = self._state_memory_model()
        if self.offload_settings is not None and self.config.max_state_bytes_per_rank is not None:
            return OffloadedDeviceMemory(model)
        return model

    def _state_memory_model(self) -> StateMemory:
        """What each item pins on its owner: masters (non-fp32 models), the rule's state, the gradient segment."""
        param_bytes = self.params[0].element_size()  # one dtype across the model (checked above)
        matrix_groups = [g for g in self.optimizer.param_groups if g["kind"] != "adamw"]
        if not matrix_groups:
            model = memory_model("muon", param_bytes=param_bytes)
        else:
            model = memory_model(matrix_groups[0]["kind"], param_bytes=param_bytes,
                                 **rule_for_group(matrix_groups[0]).cost_options())
        return model

    def _choose_collective_forms(self) -> BucketForms:
        """Each bucket's reduce-scatter form and each gather group's all-gather form: a function of the cuts, the
        groups and the config, so every rank agrees."""
        return bucket_forms(self.layout.bucket_cuts, backend=backend_name(self.dp_process_group),
                            reduce_scatter_bytes=self.reduction.communicate_dtype.itemsize,
                            all_gather_bytes=self.dtype.itemsize, setting=self.config.collectives,
                            costs=self.config.collective_costs, gather_groups=self.gather_groups)

    def _check_plan_agreement(self) -> None:
        """Compare the plan's digest across ranks before any other collective."""
        check_digest_agreement(self.plan.digest(), group=self.dp_process_group, device=self.device)

    def plan_summary(self) -> str:
        plan = self.plan
        costs, numels, state = plan.rank_costs(), plan.rank_numels(), plan.rank_memory()
        lines = [f"ds_canzona plan: {len(plan.buckets)} buckets, {len(plan.specs)} items ({len(self.params)} tensors), "
                 f"DP={plan.world_size}, "
                 f"strategy={plan.strategy}, alpha={plan.alpha}, cost={plan.cost_label}, "
                 f"cost max/avg={plan.flops_ratio:.3f}, state bytes max/avg={plan.state_bytes_ratio:.3f}, "
                 f"elements max/avg={plan.memory_ratio:.3f}, memory={plan.memory_label}"]
        ranks = range(plan.world_size)
        if plan.world_size > 8:  # short: the busiest and the lightest ranks, and the one holding the most bytes
            by_cost = sorted(ranks, key=lambda r: (costs[r], r))
            fullest = max(ranks, key=lambda r: (state[r], -r))
            ranks = sorted(set(by_cost[:2] + by_cost[-2:] + [fullest]))
        split = None if self.offload_settings is None else OffloadedDeviceMemory(self._state_memory_model())
        for r in ranks:
            if split is None:
                where = f"{state[r]:.0f} state bytes"
            else:  # offloaded: the gradient segments on the device, the masters and state in host memory
                items = [plan.specs[j] for j in plan.owned_params(r)]
                where = (f"{sum(map(split.bytes, items)):.0f} state bytes on the device, "
                         f"{sum(map(split.host_bytes, items)):.0f} in host memory")
            lines.append(f"  rank {r}: cost {costs[r]:.3e}, {where}, {numels[r]} elements, "
                         f"{len(plan.owned_params(r))} items")
        lines.extend("  " + line for line in format_collective_forms(self.collective_forms).splitlines())
        lines.append("  " + format_all_gather_groups(self.gather_groups, self.collective_forms,
                                                     self.config.all_gather_groups, plan.world_size))
        return "\n".join(lines)

    # ------------------------------------------------------------------ buffers and state
    def _index_tensors(self) -> None:
        """Where each tensor sits: the plan is over items, buffers and grad hooks are per tensor.

        A tensor's pieces are consecutive items of one bucket, so its first item gives its bucket
        and its offset there.
        """
        plan = self.plan
        self.tensor_bucket = [0] * len(self.params)
        self.tensor_offset = [0] * len(self.params)
        self.bucket_tensors: list[list[int]] = [[] for _ in plan.buckets]
        for item, (tensor, start, _) in enumerate(plan.pieces):
            if start == 0:
                self.tensor_bucket[tensor] = plan.bucket_of[item]
                self.tensor_offset[tensor] = self.layout.item_offset[item]
                self.bucket_tensors[plan.bucket_of[item]].append(tensor)

    def _item_slice(self, tensor_view: torch.Tensor, item: int) -> torch.Tensor:
        """Item ``item``'s part of its tensor's ``tensor_view``: the view itself when whole, else shaped
        like the item (1-D for a non-matrix piece, its experts for a piece of a matrix stack)."""
        start, stop = self.layout.piece_range[item]
        if start == 0 and stop == tensor_view.numel():
            return tensor_view
        return self._shaped_piece(tensor_view.view(-1)[start:stop], item)

    def _shaped_piece(self, flat: torch.Tensor, item: int) -> torch.Tensor:
        """A piece's flat elements in the item's shape: a stack piece ``[experts, rows, cols]`` (a matrix
        rule updates each expert as a matrix), a non-matrix piece 1-D as it is."""
        spec = self.plan.specs[item]
        return flat.view(spec.shape) if spec.matrix else flat

    def _build_buffers(self) -> None:
        plan = self.plan
        self.param_flat: list[torch.Tensor] = []
        # Stage 1 keeps every bucket's gradient buffer; stage 2 allocates one when its first
        # gradient of a step arrives and releases it once its reduce-scatter is done (None
        # in between), so only the buckets in flight hold gradients.
        self.grad_flat: list[torch.Tensor | None] = []
        self.grad_segment: list[torch.Tensor] = []
        self.param_views: list[torch.Tensor] = [None] * len(self.params)  # type: ignore[list-item]
        self.grad_views: list[torch.Tensor | None] = [None] * len(self.params)
        # Whether tensor i's view holds a gradient of this step (else its first one is copied in).
        self._holds_grad = [False] * len(self.params)
        self._bucket_gaps = self._bucket_gap_ranges()
        # One contiguous parameter buffer per gather group, its buckets consecutive views of it: an all-reduced
        # gather is then one operation for the whole group (ds_canzona.zero.comm).
        self.gather_buffers: list[torch.Tensor] = []
        bucket_flats: list[torch.Tensor] = [None] * len(plan.buckets)  # type: ignore[list-item]
        for group in self.gather_groups:
            sizes = [self.layout.bucket_numel[b] for b in group]
            buffer = torch.empty(sum(sizes), dtype=self.dtype, device=self.device)
            self.gather_buffers.append(buffer)
            for b, view in zip(group, torch.split(buffer, sizes)):
                bucket_flats[b] = view
        for bucket in plan.buckets:
            flat = bucket_flats[bucket.index]
            for i in self.bucket_tensors[bucket.index]:
                p, start = self.params[i], self.tensor_offset[i]
                view = flat[start:start + p.numel()].view_as(p)
                view.copy_(p.data)
                p.data = view
                self.param_views[i] = view
            self.param_flat.append(flat)
            self.grad_flat.append(None)
            cuts = self.layout.bucket_cuts[bucket.index]
            # A padded reduce-scatter writes the bucket's largest segment; past this rank's own is padding.
            padded = self.collective_forms.reduce_scatter[bucket.index] == PADDED
            sizes = [cuts[r + 1] - cuts[r] for r in range(len(cuts) - 1)]
            numel = max(sizes) if padded else sizes[self.rank]
            self.grad_segment.append(torch.empty(numel, dtype=self.reduction.communicate_dtype, device=self.device))
            if not self.partition_gradients:
                self._grad_bucket(bucket.index)

    def _grad_bucket(self, b: int) -> torch.Tensor:
        """Bucket b's flat gradient buffer, allocated (with its per-param views) if absent.

        Not zeroed: each tensor's first gradient of a step is copied into its view and later
        ones added (``_accumulate``); the views of tensors that got none are zeroed when the
        bucket leaves (``_zero_missing``). Elements between tensors, if any, are zeroed here.
        """
        flat = self.grad_flat[b]
        if flat is None:
            self.streams.use(b)  # allocated on the current stream
            flat = torch.empty(self.layout.bucket_numel[b], dtype=self.reduction.accumulate_dtype, device=self.device)
            for i in self.bucket_tensors[b]:
                start = self.tensor_offset[i]
                self.grad_views[i] = flat[start:start + self.params[i].numel()].view_as(self.params[i])
            for start, stop in self._bucket_gaps[b]:
                flat[start:stop].zero_()
            self.grad_flat[b] = flat
        return flat

    def _bucket_gap_ranges(self) -> list[list[tuple[int, int]]]:
        """Per bucket, the ranges of its flat buffer that no tensor's view covers (none without padding)."""
        gaps = []
        for b, tensors in enumerate(self.bucket_tensors):
            spans = sorted((self.tensor_offset[i], self.tensor_offset[i] + self.params[i].numel()) for i in tensors)
            ranges, position = [], 0
            for start, stop in spans:
                if start > position:
                    ranges.append((position, start))
                position = max(position, stop)
            if position < self.layout.bucket_numel[b]:
                ranges.append((position, self.layout.bucket_numel[b]))
            gaps.append(ranges)
        return gaps

    def _accumulate(self, i: int, grad: torch.Tensor) -> None:
        """Tensor i's gradient into its bucket view: copied if it is the first of this step, else added.

        A copy is what adding to zeros gives, bit for bit, but for the sign of a zero: -0.0 stays
        -0.0 (0.0 + -0.0 is +0.0), as the single-process optimizer sees it in ``param.grad``.
        """
        if self._holds_grad[i]:
            self.grad_views[i].add_(grad)  # into the accumulation dtype (an exact widening, if any)
        else:
            self.grad_views[i].copy_(grad)
            self._holds_grad[i] = True

    def _zero_missing(self, b: int) -> None:
        """Zero the views of bucket b's tensors that had no gradient this step: they count as zero."""
        missing = [self.grad_views[i] for i in self.bucket_tensors[b] if not self._holds_grad[i]]
        if missing:
            torch._foreach_zero_(missing)

    def _release_grad_bucket(self, b: int) -> None:
        self.streams.forget(b)
        self.grad_flat[b] = None
        for i in self.bucket_tensors[b]:
            self.grad_views[i] = None
            self._holds_grad[i] = False

    def item_view(self, item: int) -> torch.Tensor:
        """The low-precision parameter elements of plan item ``item`` (a view into its bucket)."""
        return self._item_slice(self.param_views[self.plan.pieces[item][0]], item)

    def _build_owned_state(self) -> list[OwnedTensor]:
        return [self._own_item(j) for j in self.plan.owned_params(self.rank)]

    def _own_item(self, j: int) -> OwnedTensor:
        tensor = self.plan.pieces[j][0]
        view = self.item_view(j)
        # fp32 models update the buffer in place; lower precision keeps an fp32 master.
        master = view if view.dtype == torch.float32 else view.detach().float().clone()
        group = self.groups[tensor]
        return OwnedTensor(index=j, name=self.plan.specs[j].name, master=master,
                           state=rule_for_group(group).init_state(master), group=group, tensor=tensor)

    def _segment_grad(self, j: int, segments: list[torch.Tensor] | None = None) -> torch.Tensor:
        """The reduced gradient of owned item j inside this rank's segment of its bucket (shaped like its master).

        ``segments``: per bucket, the buffer to read (by default the reduce-scatter's output).
        """
        b = self.plan.bucket_of[j]
        start = self.layout.item_offset[j] - self.layout.bucket_cuts[b][self.rank]
        numel = self.layout.item_numel[j]
        segment = (self.grad_segment if segments is None else segments)[b][start:start + numel]
        tensor = self.plan.pieces[j][0]
        start, stop = self.layout.piece_range[j]
        whole = start == 0 and stop == self.params[tensor].numel()
        return segment.view_as(self.params[tensor]) if whole else self._shaped_piece(segment, j)

    # ------------------------------------------------------------------ backward
    def _register_grad_hooks(self) -> None:
        self._hook_handles = []
        for i, p in enumerate(self.params):
            self._hook_handles.append(p.register_post_accumulate_grad_hook(self._make_grad_hook(i)))

    def _make_grad_hook(self, i: int):
        bucket = self.tensor_bucket[i]

        def hook(param: torch.Tensor) -> None:
            if self._bucket_launched(bucket):
                raise GradientAfterReductionError(self._late_gradient_message(i))
            # This hook's stream (the gradient's) may not be the one that last wrote the bucket.
            self.streams.use(bucket)
            self._grad_bucket(bucket)
            self._accumulate(i, param.grad)
            param.grad = None
            self._record_arrival(i, bucket)

        return hook

    def _record_arrival(self, i: int, bucket: int) -> None:
        """Count tensor i's gradient; on the boundary micro-batch, launch the buckets it completes.

        A bucket counts as complete when each of its tensors has had a gradient in this
        backward; a second gradient for the same tensor does not count again. Tensors that get
        none (unused here, on this step) leave their bucket, and every bucket after it in the
        launch order, to the flush when backward ends. Ranks may decide differently (a branch
        taken on one rank only): that changes when a rank launches a bucket, never which
        collective comes next, because every rank launches the buckets in the same order.
        """
        self._arrivals[i] += 1
        if self._arrivals[i] > 1:
            # Reentrant activation checkpointing runs a nested backward per checkpointed
            # segment, so a tensor used in two segments gets two gradients; a first gradient
            # is then no proof that the tensor is done. From here on this engine reduces
            # only when backward has ended.
            self.early_launch = False
            return
        if self.partition_gradients and at_accumulation_boundary(self):
            self._pending[bucket] -= 1
            if self.early_launch and self._pending[bucket] == 0:
                self._launch_ready_buckets()

    def _bucket_launched(self, b: int) -> bool:
        return b > self._next_bucket  # buckets leave last first, so these are the ones gone

    def _late_gradient_message(self, i: int) -> str:
        name = self.names[i]
        if self._next_bucket < 0:
            return (f"ds_canzona: a gradient for {name!r} arrived after this step's gradients were reduce-scattered "
                    "(at the end of the boundary micro-batch's backward), so it would be lost. Call engine.step() "
                    "after every engine.backward(); to accumulate micro-batches use gradient_accumulation_steps.")
        return (f"ds_canzona: {name!r} received a second gradient in one backward pass after its bucket had been "
                "reduce-scattered, so it would be lost. A parameter gets more than one gradient per backward when "
                "reentrant activation checkpointing (use_reentrant=True, deepspeed.checkpointing) uses it in more "
                "than one checkpointed segment; ZeRO stage 2 stops reducing during backward once it has seen that, "
                "but here it was first seen too late. Use non-reentrant checkpointing (use_reentrant=False) or "
                "ZeRO stage 1.")

    def backward_epilogue(self, **kwargs) -> None:
        """Engine hook after every backward: the next backward counts gradients afresh."""
        self._note_arrivals(self._arrivals)
        self._arrivals = [0] * len(self.params)

    def _reset_reduction(self) -> None:
        self._pending = [len(tensors) for tensors in self.bucket_tensors]
        self._next_bucket = len(self.plan.buckets) - 1
        self._handles: list = []

    def _launch_bucket(self, b: int) -> None:
        flat = self._grad_bucket(b)  # a bucket with no gradient this step still takes part, as zeros
        self.streams.use(b)  # the zeroing below writes the bucket on the current stream
        self._zero_missing(b)
        reduction = self.reduction
        # On the reduction stream, after every stream that wrote the bucket (no-op on a synchronised device).
        with self.streams.on_side(b):
            send = flat if flat.dtype == reduction.communicate_dtype else flat.to(reduction.communicate_dtype)
            if reduction.pre_divide != 1.0:
                send.div_(reduction.pre_divide)
            # send becomes the padded copy where this bucket's form stages one.
            handle, send = reduce_scatter_bucket(self.grad_segment[b], send, self.layout.bucket_cuts[b],
                                                 self.collective_forms.reduce_scatter[b], group=self.dp_process_group,
                                                 counter=self.comm, async_op=self.partition_gradients)
        if send is not flat and self.partition_gradients:
            # The copy (communication dtype, padded) carries the gradients now; the reduction stream read the bucket.
            self.streams.keep_alive(flat)
            self._release_grad_bucket(b)
        if handle is not None:
            self._handles.append((b, handle, send))  # send stays alive until the collective is done
        if self.partition_gradients:
            # Keep a few reduce-scatters in flight behind backward; finish the older ones and
            # give their gradient memory back.
            while len(self._handles) > REDUCE_SCATTERS_IN_FLIGHT:
                self._complete_oldest()

    def _complete_oldest(self) -> None:
        b, handle, send = self._handles.pop(0)
        self.streams.wait(handle)  # on the reduction stream where streams are real: never the compute stream's wait
        self.streams.keep_alive(send)
        if self.partition_gradients:
            self._release_grad_bucket(b)

    def _launch_ready_buckets(self, *, all_remaining: bool = False) -> None:
        # Buckets go out in one fixed order on every rank (last bucket first, as backward
        # completes them), so ranks never disagree on which collective comes next.
        while self._next_bucket >= 0 and (all_remaining or self._pending[self._next_bucket] == 0):
            self._next_bucket -= 1
            self._launch_bucket(self._next_bucket + 1)

    def _finish_reduction(self) -> None:
        self._launch_ready_buckets(all_remaining=True)
        while self._handles:
            self._complete_oldest()
        # Not called from a gradient hook: at the end of backward or before the step, which reads the segments.
        self.streams.compute_waits()

    def overlapping_partition_gradients_reduce_epilogue(self) -> None:
        """Engine hook after every backward under stage 2: flush at the boundary."""
        if at_accumulation_boundary(self):
            self._finish_reduction()

    def reduce_gradients(self, pipeline_parallel: bool = False) -> None:
        """Engine hook at the accumulation boundary under stage 1: reduce-scatter every bucket."""
        self._finish_reduction()

    # ------------------------------------------------------------------ step
    def owned_gradients(self) -> dict[str, torch.Tensor]:
        """The averaged (unclipped) fp32 gradients of the owned tensors, for tests and tools."""
        self._finish_reduction()
        return {t.name: self._averaged_grad(t.index) for t in self._owned}

    def _averaged_grad(self, i: int) -> torch.Tensor:
        """Item i's averaged fp32 gradient as a new tensor (the segment stays as reduced)."""
        return self._unscaled(self._segment_grad(i).to(torch.float32, copy=True))

    def _step_gradients(self) -> tuple[list[int], list[torch.Tensor]]:
        self._finish_reduction()
        items = self._step_items()
        segments = self._averaged_segments()
        return items, [self._segment_grad(j, segments) for j in items]

    def _averaged_segments(self) -> list[torch.Tensor]:
        """This rank's segment of every bucket as averaged fp32 gradients, for the step to consume.

        Per bucket, not per item: one conversion (none when the reduce-scatter already delivered
        fp32, the segment is then divided in place) and the divisions of ``_unscaled``, each an
        elementwise operation, so every item's gradient has the bits the per-item copy had. The
        segments are written again by the next step's reduce-scatters only.
        """
        averaged = []
        for segment in self.grad_segment:
            fp32 = segment if segment.dtype == torch.float32 else segment.float()
            averaged.append(self._unscaled(fp32) if fp32.numel() else fp32)
        return averaged

    def _step_items(self) -> list[int]:
        """The plan items whose reduced gradient this rank reads in the step: what it owns."""
        return [t.index for t in self._owned]

    def _publish_updates(self) -> None:
        self.refresh_params_from_masters()

    def _update_and_publish(self, grads: list[torch.Tensor]) -> None:
        """Gather group by gather group: update the owned items of its buckets, round them into their parameters,
        all-gather the group's buckets in one launch.

        Each group's all-gathers are issued as soon as this rank has updated what it owns in the
        group's buckets, so where streams are real they run (on the side stream) while the next
        group is updated; the compute stream waits for the gathers once, at the end. Groups are
        consecutive buckets and go in plan order on every rank, the order the collectives must
        agree on (``ds_canzona.plan.gather_groups``). Every item's update depends on its own
        gradient and state only, so the order changes no bits. A subclass that updates more than
        the owned items (the tensor-parallel runtime's hosted matrices, whose slices land in these
        buckets after the exchange) keeps the plain order: update all, then gather the groups; so
        does optimizer offload, whose staged waves cross bucket boundaries (zero/offload.py).
        """
        if self.offload is not None or type(self)._update_owned is not OwnerRuntime._update_owned:
            super()._update_and_publish(grads)
            return
        by_bucket: list[list[tuple[OwnedTensor, torch.Tensor]]] = [[] for _ in self.plan.buckets]
        for t, g in zip(self._owned, grads):
            by_bucket[self.plan.bucket_of[t.index]].append((t, g))
        for group in self.gather_groups:
            work = [pair for b in group for pair in by_bucket[b]]
            self._run_rules(work)
            self._write_masters([t for t, _ in work])
            self._gather_group(group)
        self.streams.compute_waits()

    def zero_grad(self, set_to_none: bool = True) -> None:
        # The step has read the reduced segments; the next reduce-scatters write them again.
        self.streams.side_waits()
        # Buckets kept between steps (stage 1) are not zeroed: the next gradients are copied in.
        self._holds_grad = [False] * len(self.params)
        for p in self.params:
            p.grad = None
        self._reset_reduction()

    # ------------------------------------------------------------------ engine glue
    @torch.no_grad()
    def refresh_params_from_masters(self) -> None:
        """Write owned masters into the low-precision params and all-gather every bucket, group by gather group."""
        if self.offload is not None:
            self.offload.write_views(self._owned)  # host masters; right after an offloaded step, already written
        else:
            self._write_masters(self._owned)
        for group in self.gather_groups:
            self._gather_group(group)
        self.streams.compute_waits()

    def _write_masters(self, owned: list[OwnedTensor]) -> None:
        """Round the fp32 masters of ``owned`` into their parameter views (nothing for fp32 models: the same memory)."""
        copies = [(self.item_view(t.index), t.master) for t in owned]
        copies = [(view, master) for view, master in copies if master is not view]
        if copies:  # one launch for all of them
            torch._foreach_copy_([view for view, _ in copies], [master for _, master in copies])

    def _gather_group(self, group: tuple[int, ...]) -> None:
        """All-gather the parameters of a gather group's buckets in one launch (one per form, where they differ),
        on the side stream after the compute stream's writes into every one of them."""
        keys = [("params", b) for b in group]
        for key in keys:
            self.streams.use(key)
        with self.streams.on_side(*keys):
            all_gather_buckets([self.param_flat[b] for b in group], [self.layout.bucket_cuts[b] for b in group],
                               self.rank, [self.collective_forms.all_gather[b] for b in group],
                               group=self.dp_process_group, counter=self.comm,
                               buffer=self.gather_buffers[self.gather_groups.index(group)])
