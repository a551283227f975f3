"""Plain-torch references for the runtime's gradient path, and the single-process replay.

The runtime's averaged gradient of a step is ``sum_r a_r / W`` (then divided by the loss scale),
``a_r`` being rank r's gradient accumulated over the step's micro-batches. Here ``a_r`` is computed
by plain torch, without DeepSpeed, on a copy of the model at the step's parameters: each
micro-batch's ``(loss / GA * loss_scale).backward()``, accumulated as the runtime accumulates
(in ``.grad``, the parameter dtype, or from each micro-batch's gradient in fp32). Those are the
same operations the ranks run, so ``a_r`` is the ranks' own accumulated gradient; what can differ
is the sum over ranks (the reduce-scatter's order, in the communication dtype) and the divisions.
``sum_order_bound`` bounds exactly that, elementwise, from the standard error bound of a sum
computed in any order, ``|fl(sum x_i) - sum x_i| <= (n - 1) u sum |x_i|`` (u the unit roundoff).

``Replay`` is the single-process ``ds_canzona.optim`` optimizer fed the runtime's averaged gradients
(clipped as the runtime clips), on fp32 parameters that start from the runtime's initial values.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch

from test_zero_stage12 import merged_grads, whole_grads  # noqa: F401  (re-exported for the tests)
from tiny_model import batches, uses_branch

UNIT_ROUNDOFF = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}
# Half the spacing of the subnormals: the absolute error of one rounding near zero.
UNDERFLOW = {torch.float32: 2.0 ** -150, torch.bfloat16: 2.0 ** -134, torch.float16: 2.0 ** -25}


def rank_gradients(model: torch.nn.Module, *, step: int, rank: int, world_size: int, ga: int, micro_batch: int = 2,
                   branch: bool = False, loss_scale: float = 1.0, accumulate_dtype: torch.dtype | None = None,
                   micros: list[int] | None = None) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s accumulated gradient of ``step`` by plain torch, by parameter name (trainable only).

    ``micros`` lists the micro-batches to run (default: each once), to build wrong variants.
    """
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    accumulated: dict[str, torch.Tensor] = {}
    model.zero_grad(set_to_none=True)
    for micro in (range(ga) if micros is None else micros):
        tokens = batches(step, micro, rank, world_size, micro_batch)
        loss = model(tokens, use_branch=uses_branch(step, rank)) if branch else model(tokens)
        # The engine's order of operations: loss / GA, then times the loss scale, then backward.
        scaled = loss / ga
        if loss_scale != 1.0:
            scaled = scaled * loss_scale
        scaled.backward()
        if accumulate_dtype is not None:  # the runtime adds each micro-batch's gradient into wider buffers
            for n, p in trainable:
                if p.grad is not None:
                    widened = p.grad.to(accumulate_dtype)
                    accumulated[n] = accumulated[n].add_(widened) if n in accumulated else widened.clone()
            model.zero_grad(set_to_none=True)
    if accumulate_dtype is None:
        accumulated = {n: p.grad.clone() for n, p in trainable if p.grad is not None}
    # A parameter that got no gradient counts as zero, as in the runtime.
    return {n: accumulated.get(n, torch.zeros_like(p, dtype=accumulate_dtype or p.dtype)) for n, p in trainable}


def mean_gradient(per_rank: list[dict[str, torch.Tensor]], *, divide_by: float, loss_scale: float = 1.0
                  ) -> dict[str, torch.Tensor]:
    """``sum_r a_r / divide_by / loss_scale`` in fp32 (``divide_by`` = W for the true mean)."""
    out = {}
    for name in per_rank[0]:
        total = per_rank[0][name].float().clone()
        for grads in per_rank[1:]:
            total += grads[name].float()
        out[name] = total / divide_by / loss_scale
    return out


def sum_order_bound(per_rank: list[dict[str, torch.Tensor]], *, communicate_dtype: torch.dtype,
                    roundings_before_sum: int, loss_scale: float = 1.0) -> dict[str, torch.Tensor]:
    """Elementwise bound on |runtime's average - fp32 mean of the same a_r|, both computed from identical a_r.

    Runtime: each a_r rounded ``roundings_before_sum`` times in the communication dtype (a
    conversion, a pre-division), summed over W ranks in it (any order: at most (W-1) roundings on
    the way), then divided twice in fp32 (world size, loss scale). Reference: the sum in fp32, then
    the same two divisions. So, with S = sum_r |a_r| / (W * loss_scale), u_c and u_32 the unit
    roundoffs: |difference| <= ((k + W - 1) u_c + (W - 1) u_32 + 4 u_32) * S * (1 + 1e-3), plus
    (k + W) subnormal half-spacings of the communication dtype for values near underflow.
    """
    world_size = len(per_rank)
    u_c, u_32 = UNIT_ROUNDOFF[communicate_dtype], UNIT_ROUNDOFF[torch.float32]
    k = roundings_before_sum
    relative = ((k + world_size - 1) * u_c + (world_size - 1) * u_32 + 4 * u_32) * (1 + 1e-3)
    absolute = (k + world_size) * UNDERFLOW[communicate_dtype] / (world_size * loss_scale)
    out = {}
    for name in per_rank[0]:
        magnitude = sum(grads[name].float().abs() for grads in per_rank) / (world_size * loss_scale)
        out[name] = relative * magnitude + absolute
    return out


def outside_bound(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], bound: dict[str, torch.Tensor]
                  ) -> dict[str, int]:
    """How many elements of each tensor differ by more than the bound (empty: all within)."""
    counts = {}
    for name, value in want.items():
        bad = int(((got[name].float().reshape(value.shape) - value).abs() > bound[name]).sum())
        if bad:
            counts[name] = bad
    return counts


def whole_batch_training(optimizer: dict, model: torch.nn.Module,
                         loss: Callable[[torch.nn.Module, int, int, int], torch.Tensor], *, world_size: int,
                         steps: int, ga: int, clip: float) -> dict[str, torch.Tensor]:
    """Plain single-process training of ``model`` with ``ds_canzona.optim`` on each step's whole batch.

    ``loss(model, step, micro, rank)`` is one rank's micro-batch loss; each step's gradient is the
    mean over ranks and micro-batches, clipped by the global norm (per-tensor squared norms summed
    in float64, as the runtime clips). Returns the parameters after ``steps`` steps.
    """
    from ds_canzona.optim.clipping import clip_coefficient, tensor_sq_norm
    from ds_canzona.zero.build import translate_optimizer_params

    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    name = optimizer["type"].lower()
    opt = optimizer_class(name)(named, **translate_optimizer_params(name, optimizer["params"]))
    for step in range(steps):
        for micro in range(ga):
            for rank in range(world_size):
                (loss(model, step, micro, rank) / (ga * world_size)).backward()
        _, coefficient = clip_coefficient(torch.stack([tensor_sq_norm(p.grad) for _, p in named]), clip)
        if coefficient < 1.0:
            for _, p in named:
                p.grad.mul_(coefficient)
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def optimizer_class(name: str):
    """The single-process ds_canzona.optim class of a config's optimizer type (lower case)."""
    import ds_canzona.optim as optim

    return {"muon": optim.Muon, "normuon": optim.NorMuon, "adamuon": optim.AdaMuon, "shampoo": optim.Shampoo,
            "soap": optim.SOAP}[name]


class Replay:
    """The single-process ds_canzona.optim optimizer over ``model_factory()``, stepped with given gradients.

    ``param_dtype`` below fp32: the initial parameters are rounded to it first (DeepSpeed converts
    the model; the runtime's fp32 masters start from the rounded values), and ``model_in`` gives a
    copy in that dtype for the plain-torch gradients.
    """

    def __init__(self, optimizer: dict, model_factory: Callable[[], torch.nn.Module], *, clip: float,
                 param_dtype: torch.dtype = torch.float32, split_numel: int | None = None):
        from ds_canzona.zero.build import translate_optimizer_params

        self.model = model_factory()
        if param_dtype != torch.float32:
            with torch.no_grad():
                for p in self.model.parameters():
                    p.copy_(p.to(param_dtype).float())
        self.param_dtype = param_dtype
        self.clip = clip
        self.split_numel = split_numel  # the clipping norm's items: canonical pieces of large non-matrix tensors
        self.named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        name = optimizer["type"].lower()
        self.optimizer = optimizer_class(name)(self.named, **translate_optimizer_params(name, optimizer["params"]))

    def model_in(self, dtype: torch.dtype) -> torch.nn.Module:
        """A copy of the current model in ``dtype`` (the model itself for fp32)."""
        return self.model if dtype == torch.float32 else copy.deepcopy(self.model).to(dtype)

    def step(self, item_grads: dict[str, torch.Tensor]) -> None:
        """One optimizer step with the runtime's averaged gradients (by item name), clipped as it clips."""
        from ds_canzona.optim.clipping import clip_coefficient, tensor_sq_norm
        from ds_canzona.plan import item_bounds

        grads = whole_grads(item_grads, {n: p.shape for n, p in self.named})
        ordered = [grads[n].clone() for n, _ in self.named]
        matrix = {id(p): group["kind"] != "adamw" for group in self.optimizer.param_groups for p in group["params"]}
        sq_norms = [tensor_sq_norm(g.reshape(-1)[start:stop]) for (_, p), g in zip(self.named, ordered)
                    for start, stop in item_bounds(g.shape, matrix[id(p)], self.split_numel)]
        _, coefficient = clip_coefficient(torch.stack(sq_norms), self.clip)
        for (_, p), g in zip(self.named, ordered):
            p.grad = g.mul_(coefficient) if coefficient < 1.0 else g
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def params(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        dtype = dtype or self.param_dtype
        return {n: p.detach().to(dtype).clone() for n, p in self.model.named_parameters()}
