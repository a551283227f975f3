"""What the ZeRO-1/2 and ZeRO-3 runtimes share: owners, one norm all-reduce, the per-tensor rules.

Both runtimes (``stage12.CanzonaZeroOptimizer`` and its AutoTP subclass, ``stage3.CanzonaZero3Optimizer``)
are DeepSpeed ZeRO optimizers in which each plan item has one owner rank that receives the item's
whole averaged gradient and updates it alone. They differ in where parameters live and how
gradients reach the owner; the rest is here, written once:

- which tensors are trained (the model's ``named_parameters()`` order restricted to the
  optimizer's parameters, so every rank derives the same order), their dtype, the gradient
  numerics (``GradientReduction``) and the loss scaler;
- the step: the owned items' averaged fp32 gradients, one all-reduce of per-item squared norms
  for overflow and clipping and one host read of their total (the step's only host
  synchronisation), each group's per-tensor rule on what this rank owns, then the subclass
  publishes the new values;
- the glue the engine and the checkpoint package call.

A subclass provides ``_step_gradients`` (finish the reductions; the owned items and their
averaged fp32 gradients), ``_publish_updates`` (make the updated masters the parameters),
``refresh_params_from_masters`` and ``zero_grad``.
"""

from __future__ import annotations

import math

import torch

import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.base_optimizer import ZeROOptimizer
from deepspeed.runtime.fp16.loss_scaler import CreateLossScaler

from ds_canzona.config import CanzonaConfig
from ds_canzona.kernels import backend_summary
from ds_canzona.optim import rule_for_group
from ds_canzona.optim.clipping import clip_coefficient, tensor_sq_norm
from ds_canzona.plan import CostModel
from ds_canzona.zero.comm import CommCounter, all_reduce_sum
from ds_canzona.zero.fragments import FragmentAPI
from ds_canzona.zero.offload import OffloadSettings, OptimizerOffload
from ds_canzona.zero.owned import OwnedTensor, ParameterStateView, parameter_groups
from ds_canzona.zero.pricing import plan_cost_model
from ds_canzona.zero.reduction import gradient_reduction


class UnusedParametersError(RuntimeError, AssertionError):
    """A trainable tensor got no gradient in a step while ``zero_optimization.ignore_unused_parameters`` is false.

    An ``AssertionError`` too: DeepSpeed's own ZeRO-1/2 asserts in that case, and code written
    against it catches that.
    """


class OwnerRuntime(ZeROOptimizer):
    """The part of a ds_canzona ZeRO optimizer that does not depend on the stage (see the module docstring)."""

    _owned: list[OwnedTensor]

    def __init__(self, optimizer: torch.optim.Optimizer, *, param_names: dict, config: CanzonaConfig, stage: int,
                 dp_process_group, clip_grad: float, grad_accum_dtype: torch.dtype | None = None,
                 communication_dtype: torch.dtype | None = None, gradient_predivide_factor: float = 1.0,
                 postscale_gradients: bool = True, gradient_average: bool = True,
                 offload: OffloadSettings | None = None, ignore_unused_parameters: bool = True,
                 members=None, average_over: int | None = None):
        # members: the parameters this runtime trains, when it trains a part of the optimizer's
        # (an expert-parallel family, ds_canzona.zero.expert_parallel); average_over: the ranks a
        # gradient is averaged over, when not this group's (expert gradients: the whole DP world).
        super().__init__()
        # offload_optimizer: the owned masters and state move to the host once the subclass has built them.
        self.offload_settings = offload
        self.offload: OptimizerOffload | None = None
        self.optimizer = optimizer
        self.fragments: FragmentAPI | None = None  # set by _expose_fragment_api once the parameters are placed
        self.config = config
        self.stage = stage
        self.partition_gradients = stage >= 2
        self.dp_process_group = dp_process_group
        # The clipping norm's all-reduce; the tensor-parallel runtime widens it to DP x TP.
        self.norm_group = dp_process_group
        self.clip_grad = float(clip_grad or 0.0)
        self.world_size = dist.get_world_size(group=dp_process_group)
        self.rank = dist.get_rank(group=dp_process_group)
        self.device = torch.device(get_accelerator().current_device_name())
        self.comm = CommCounter()
        self.overflow = False
        self._global_grad_norm = 0.0
        self._norm_index_key: tuple[int, ...] | None = None  # the items of _norm_index (see _owned_sq_norms)
        self.custom_loss_scaler = False
        self.external_loss_scale = None
        self.torch_autocast_gradscaler = None

        # The model's named_parameters() order, restricted to what the optimizer trains: every
        # rank derives the same order from the same model.
        group_of = parameter_groups(optimizer)
        self.params: list[torch.nn.Parameter] = [p for p in param_names if p in group_of and p.requires_grad
                                                 and (members is None or p in members)]
        unknown = [p for p in group_of if p not in param_names]
        if unknown:
            raise ValueError(f"{len(unknown)} optimizer parameters are not parameters of the model")
        if not self.params:
            raise ValueError("the optimizer has no trainable parameters of the model")
        self.names = [param_names[p] for p in self.params]
        self._expose_state_api()
        # zero_optimization.ignore_unused_parameters false: which tensors got a gradient in this
        # step's backward passes, checked across ranks in the step (None: not checked, the default).
        self._applied_steps = 0  # optimizer.state's step count on a rank that owns no tensor
        self._got_gradient: list[bool] | None = None if ignore_unused_parameters else [False] * len(self.params)
        self.groups = [group_of[p] for p in self.params]
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) != 1:
            raise ValueError(f"ds_canzona needs one parameter dtype across the model, found {sorted(map(str, dtypes))}")
        self.dtype = dtypes.pop()
        self.reduction = gradient_reduction(
            param_dtype=self.dtype, world_size=average_over or self.world_size, grad_accum_dtype=grad_accum_dtype,
            communication_dtype=communication_dtype, gradient_average=gradient_average,
            postscale_gradients=postscale_gradients, gradient_predivide_factor=gradient_predivide_factor)

    def _create_loss_scaler(self, *, static_loss_scale: float, dynamic_loss_scale: bool, dynamic_loss_args) -> None:
        self.loss_scaler = CreateLossScaler(dtype=self.dtype, static_loss_scale=static_loss_scale,
                                            dynamic_scaling=dynamic_loss_scale, dynamic_loss_args=dynamic_loss_args)
        self.dynamic_loss_scale = self.loss_scaler.dynamic

    def _plan_cost_model(self) -> CostModel:
        # Each matrix priced by its own group's rule.
        return plan_cost_model(self.config, self.names, self.groups, get_accelerator().device_name())

    def _print_plan_summary(self) -> None:
        # Printed, not logged at INFO: DeepSpeed's ranks log at WARNING by default, and a plan
        # summary that nobody sees cannot be checked.
        if self.config.log_plan and dist.get_rank() == 0:
            print(self.plan_summary(), flush=True)
            # The matrix kernels: which implementation runs here and how it is checked.
            print(backend_summary(self.device), flush=True)

    # ------------------------------------------------------------------ step
    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.cur_scale

    @property
    def cur_scale(self) -> float:
        return self.loss_scaler.cur_scale

    def _unscaled(self, grad: torch.Tensor) -> torch.Tensor:
        """Divide an fp32 summed gradient (in place) by what was not divided before the sum, and the loss scale.

        In fp32, whatever the communication dtype: the division is then exact to fp32's rounding
        (DeepSpeed divides in the communication dtype).
        """
        if self.reduction.post_divide != 1.0:
            grad.div_(self.reduction.post_divide)
        if self.loss_scaler.cur_scale != 1.0:
            grad.div_(self.loss_scaler.cur_scale)
        return grad

    @torch.no_grad()
    def step(self, closure=None):
        items, grads = self._gradients_for_step()
        # One collective for both the overflow check and clipping: every entry is non-zero on
        # its owner only, so the all-reduced vector is exact, and its sum in plan order is the
        # same number on every rank and at every world size.
        sq_norms, missing = self._norm_vector(items, grads)
        all_reduce_sum(sq_norms, group=self.norm_group, counter=self.comm, kind="all_reduce")
        if missing is not None:
            self._raise_if_unused(missing, int(sq_norms[-1].item()))
            sq_norms = sq_norms[:-1]
        coefficient = self._apply_norm(sq_norms)
        if coefficient is not None:
            self._apply_step(grads, coefficient)
        return None

    def _gradients_for_step(self) -> tuple[list[int], list[torch.Tensor]]:
        """The owned items and their averaged fp32 gradients, reductions finished."""
        items, grads = self._step_gradients()
        if self.fragments is not None:  # gradients set with deepspeed.utils.safe_set_full_grad
            grads = self.fragments.gradients_for_step(items, grads)
        return items, grads

    def _norm_vector(self, items: list[int], grads: list[torch.Tensor]) -> tuple[torch.Tensor, list[str] | None]:
        """This rank's entries of the per-item squared norms and, when unused parameters are checked,
        one more entry (its count of tensors without a gradient) and their names."""
        sq_norms = self._owned_sq_norms(items, grads)
        if self._got_gradient is None:
            return sq_norms, None
        missing = [name for name, got in zip(self.names, self._got_gradient) if not got]
        return torch.cat([sq_norms, sq_norms.new_tensor([float(len(missing))])]), missing

    def _apply_norm(self, sq_norms: torch.Tensor) -> float | None:
        """From the all-reduced squared norms: the clipping coefficient, or None after an overflow
        (the step skipped, the loss scale updated either way)."""
        # The step's one host read: the norm, which is non-finite exactly when some gradient
        # entry overflowed (see ds_canzona.optim.clipping).
        total_norm, coefficient = clip_coefficient(sq_norms, self.clip_grad)
        self.overflow = not math.isfinite(total_norm)
        self.loss_scaler.update_scale(self.overflow)
        if self.overflow:
            self._global_grad_norm = float("inf")
            self.zero_grad()
            return None
        self._global_grad_norm = total_norm
        return coefficient

    def _apply_step(self, grads: list[torch.Tensor], coefficient: float) -> None:
        """Clip, update what this rank owns, publish the new values, and get ready for the next step."""
        if coefficient < 1.0 and grads:  # a rank may own nothing (of an expert-parallel family, say)
            torch._foreach_mul_(grads, coefficient)
        # This is the basic optimizer's step under ZeRO; its own step() never runs. torch's LR
        # schedulers built on it (DeepSpeed hands engine.basic_optimizer to a scheduler callable,
        # the HF Trainer's among them) read this flag to check it stepped before they do.
        self.optimizer._opt_called = True
        self._update_and_publish(grads)
        self._applied_steps += 1
        self.zero_grad()

    def _note_arrivals(self, arrivals: list[int]) -> None:
        """After a backward: remember which tensors got a gradient (``arrivals``: gradients per tensor)."""
        if self._got_gradient is not None:
            self._got_gradient = [got or count > 0 for got, count in zip(self._got_gradient, arrivals)]

    def _raise_if_unused(self, missing_here: list[str], missing_everywhere: int) -> None:
        """Stop every rank alike, before any update, when some rank saw a tensor without a gradient.

        The count is the all-reduced one, so all ranks raise together (one rank raising alone
        would leave the others waiting in their next collective).
        """
        self._got_gradient = [False] * len(self.params)
        if missing_everywhere == 0:
            return
        here = (f"on this rank: {', '.join(repr(n) for n in missing_here[:5])}"
                f"{' and more' if len(missing_here) > 5 else ''}") if missing_here else "none on this rank"
        raise UnusedParametersError(
            f"ds_canzona: {missing_everywhere} trainable tensor(s), counted over the ranks, received no gradient in "
            f"this step's backward passes ({here}) and zero_optimization.ignore_unused_parameters is false. Set "
            "zero_optimization.ignore_unused_parameters to true (a missing gradient then counts as zero), make every "
            "trainable parameter take part in the loss, or set requires_grad=False on those that do not. Nothing "
            "was updated.")

    def _owned_sq_norms(self, items: list[int], grads: list[torch.Tensor]) -> torch.Tensor:
        """The vector of per-item squared norms, with this rank's entries filled in and zeros elsewhere.

        The entries go in with one ``index_copy_`` (not one indexed write per item); the index
        tensor is built once per list of items, so no step copies it to the device again.
        """
        sq_norms = torch.zeros(len(self.plan.specs), dtype=torch.float64, device=self.device)
        counted = [(j, g) for j, g in zip(items, grads) if self._counts_in_norm(j)]
        if not counted:
            return sq_norms
        key = tuple(j for j, _ in counted)
        if self._norm_index_key != key:
            self._norm_index_key = key
            self._norm_index = torch.tensor(key, dtype=torch.long, device=self.device)
        sq_norms.index_copy_(0, self._norm_index, torch.stack([tensor_sq_norm(g) for _, g in counted]))
        return sq_norms

    def _step_gradients(self) -> tuple[list[int], list[torch.Tensor]]:
        raise NotImplementedError

    def _publish_updates(self) -> None:
        raise NotImplementedError

    def _counts_in_norm(self, item: int) -> bool:
        """Whether this rank adds the item's squared norm (the tensor-parallel runtime counts replicas once)."""
        return True

    def _offload_owned(self, view_of) -> None:
        """With offload_optimizer: move the owned masters and state to the host (``view_of(item)``: its device view)."""
        if self.offload_settings is not None:
            self.offload = OptimizerOffload(self._owned, view_of, self.offload_settings, device=self.device)
            if self.config.log_plan and dist.get_rank() == 0:
                print(f"ds_canzona {self.offload.summary()}", flush=True)

    def _update_and_publish(self, grads: list[torch.Tensor]) -> None:
        """Update the owned items, then make the new values the parameters (ZeRO-1/2 interleaves the two)."""
        self._update_owned(grads)
        self._publish_updates()

    def _update_owned(self, grads: list[torch.Tensor]) -> None:
        """Run each group's per-tensor rule on the owned items of that group (``grads`` in ``_owned`` order first)."""
        if self.offload is not None:  # the same rules, with the state streamed from the host (zero/offload.py)
            self.offload.update_(self._owned, grads[:len(self._owned)], self.optimizer.param_groups)
            return
        self._run_rules(list(zip(self._owned, grads[:len(self._owned)])))

    def _run_rules(self, work: list[tuple[OwnedTensor, torch.Tensor]]) -> None:
        """Each group's rule on its items of ``work`` (owned item, averaged gradient), one call per group.

        One call, so the rule sees every item of its group together (AdamW's foreach groups).
        """
        for group in self.optimizer.param_groups:
            members = [(t, g) for t, g in work if t.group is group]
            if not members:
                continue
            # Every gradient is known finite here: the norm all-reduce already caught any overflow.
            rule_for_group(group).update_([t.master for t, _ in members], [g for _, g in members],
                                          [t.state for t, _ in members], lr=group["lr"], known_finite=True)

    # ------------------------------------------------------------------ engine glue
    def backward(self, loss, retain_graph: bool = False):
        self.enter_backward()
        self.scale_if_loss(loss).backward(retain_graph=retain_graph)
        self.backward_epilogue()
        self.exit_backward()

    def owned_tensors(self) -> list[OwnedTensor]:
        return list(self._owned)

    # ------------------------------------------------------------------ checkpoint glue (zero/checkpoint/engine.py)
    def checkpoint_ranks(self) -> tuple[int, int, object]:
        """(rank, number of ranks, group) of the ranks that write one shard file each."""
        return self.rank, self.world_size, self.dp_process_group

    def item_file(self, item: int) -> int:
        """The shard file (a ``checkpoint_ranks`` rank) that holds plan item ``item``: its owner's."""
        return self.plan.owner[item]

    def checkpoint_items(self) -> list[OwnedTensor]:
        """What this rank writes: its items with their plan shapes (logical under TP)."""
        return self.owned_tensors()

    def load_targets(self) -> list[OwnedTensor]:
        """What this rank reads into, shaped as saved; ``after_load`` puts it in place."""
        return self.owned_tensors()

    def after_load(self) -> None:
        self.refresh_params_from_masters()

    # ------------------------------------------------------------------ the torch state API
    def state_dict(self) -> dict:
        """This rank's owned optimizer state, by name, for reading.

        docs/CHECKPOINTS.md, "Optimizer state through the torch API", says why and how.

        ``{"state": {name: {key: tensor}}, "param_groups": [{**settings, "params": [names]}],
        "rank": r, "world_size": n}``: one entry per item this rank owns and updates, named as the
        checkpoint names it (a parameter's name; ``name[start:stop]`` for a piece of a non-matrix
        tensor at ZeRO-1/2); the keys are the rule's (``step``, ``exp_avg``, ``exp_avg_sq``,
        ``momentum_buffer``: DeepSpeed's names, same meaning; Shampoo's and SOAP's statistics).
        The tensors are the live fp32 state, as torch's ``state_dict`` gives them: clone to keep.
        ``rank`` and ``world_size`` are the data-parallel group's; under AutoTP a sliced tensor's
        entry is the slice this rank keeps. No collective: any rank may call it alone. Other
        ranks' tensors are theirs: the whole state is ``engine.save_checkpoint``'s.
        """
        rank, world_size = self.rank, self.world_size
        owned = self.owned_tensors()
        groups = []
        for group in self.optimizer.param_groups:
            settings = {k: v for k, v in group.items() if k not in ("params", "param_names")}
            groups.append({**settings, "params": [t.name for t in owned if t.group is group]})
        return {"state": {t.name: dict(t.state) for t in owned}, "param_groups": groups,
                "rank": rank, "world_size": world_size}

    def load_state_dict(self, *args, **kwargs):
        raise NotImplementedError(
            "ds_canzona's optimizer state is not loaded through load_state_dict (a state_dict() holds one rank's "
            "owned tensors only): save it with engine.save_checkpoint(save_dir) and load it with "
            "engine.load_checkpoint(load_dir), at any world size; `ds-canzona consolidate` writes one file")

    def _expose_state_api(self) -> None:
        """The basic optimizer's torch state API answers for this runtime: its own state is empty under ZeRO.

        ``engine.optimizer.optimizer`` (the ds_canzona.optim optimizer this runtime wraps) never
        steps here, so torch's ``state_dict`` and ``state`` of it would say nothing; code that
        reads optimizer state through it gets this rank's owned state (``state[param]``: see
        ``ParameterStateView``), and a load is refused the same way.
        """
        self.optimizer.state_dict = self.state_dict
        self.optimizer.load_state_dict = self.load_state_dict
        self.optimizer.state = ParameterStateView(self.params, self.names, self.owned_tensors, lambda: self._applied_steps)

    def _expose_fragment_api(self) -> None:
        """DeepSpeed's tensor-fragment functions (``deepspeed.utils.safe_get_full_fp32_param`` and the rest)
        answer for the trained parameters: ``ds_canzona.zero.fragments``. Called once they are placed."""
        self.fragments = FragmentAPI(self)
        self.fragments.attach()


__all__ = ["OwnerRuntime", "UnusedParametersError"]
