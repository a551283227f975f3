"""Single-process ``torch.optim.Optimizer`` classes built on the per-tensor rules.

Each optimizer keeps ordinary torch param groups, every one tagged with a ``kind`` and that
kind's hyper-parameters, and its ``step`` calls ``rule_for_group(group).update_(...)``: the same
call the distributed owner step makes with its own subset of tensors. So these classes are the
reference the distributed runtime is tested against, bit for bit.

Parameters can be given as ``model.named_parameters()`` (names enable the matrix rule and the
by-name state dicts), as plain tensors, or as param groups. A group without ``kind`` is split by
the matrix rule into a matrix half and an AdamW half; its keys override the constructor's
keyword arguments of the same names (``lr``, ``weight_decay``, ``adam_lr``, ...). A group with
``kind`` is taken as it is; its keys are that kind's own hyper-parameter names.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar

import torch
from torch import Tensor

from ds_canzona.optim.base import is_matrix, logical_shape, rule_class, rule_for_group, state_dtype

# DeepSpeed's Muon gives its auxiliary Adam this lr when the config sets none.
DEEPSPEED_AUX_ADAM_LR = 3e-4

ParamsLike = Iterable[Tensor] | Iterable[tuple[str, Tensor]] | Iterable[dict[str, Any]]


class RuleOptimizer(torch.optim.Optimizer):
    """Base of the single-process optimizers: group building, ``step`` and by-name state dicts."""

    matrix_kind: ClassVar[str | None] = None

    def __init__(self, params: ParamsLike, settings: dict[str, Any]) -> None:
        self._settings = dict(settings)
        # Validate the constructor's hyper-parameters now, whether or not a half ends up used.
        for kind, group in self._split(self._settings).items():
            rule_for_group({**group, "kind": kind})
        super().__init__(params, defaults={})

    def __getstate__(self) -> dict[str, Any]:
        # torch's pickles only defaults, state and groups; add_param_group needs the settings too.
        return {**super().__getstate__(), "_settings": self._settings}

    # -- building groups ------------------------------------------------------------------------

    def _split(self, settings: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
        """Hyper-parameters (and lr) of each kind this optimizer runs, from constructor-style settings."""
        raise NotImplementedError

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, got {type(param_group).__name__}")
        group = dict(param_group)
        items = _named_items(group.pop("params", None), group.pop("param_names", None))
        kind = group.pop("kind", None)
        name = group.pop("name", None)
        use_muon = group.pop("use_muon", None)
        if use_muon is not None:
            kind = self._kind_of_use_muon(bool(use_muon), kind)
        defaults = self._split(self._settings)
        if kind is None:
            unknown = sorted(set(group) - set(self._settings))
            if unknown:
                raise ValueError(f"Invalid param group key(s) {unknown}: a group without 'kind' takes the "
                                 f"constructor's keywords ({', '.join(sorted(self._settings))})")
            per_kind = self._split({**self._settings, **group})
            by_kind: dict[str, list[tuple[str | None, Tensor]]] = {kind_: [] for kind_ in per_kind}
            for item in items:
                by_kind[self._kind_of(*item)].append(item)
        else:
            if kind not in defaults:
                raise ValueError(f"Invalid param group kind={kind!r}: {type(self).__name__} runs "
                                 f"{', '.join(map(repr, defaults))}")
            allowed = set(rule_class(kind).hyper_parameters()) | {"lr"}
            unknown = sorted(set(group) - allowed)
            if unknown:
                raise ValueError(f"Invalid param group key(s) {unknown} for kind {kind!r}: "
                                 f"its keys are {', '.join(sorted(allowed))}")
            per_kind = {kind: {**defaults[kind], **group}}
            by_kind = {kind: items}

        for kind_, kind_items in by_kind.items():
            if not kind_items:
                continue
            hyper = per_kind[kind_]
            rule = rule_for_group({**hyper, "kind": kind_})  # a bad value is an error here, not at the first step
            for item_name, tensor in kind_items:
                try:
                    rule.check_shape(logical_shape(tensor))
                except ValueError as error:
                    raise ValueError(f"A {kind_!r} group holds a tensor of shape {logical_shape(tensor)}"
                                     f"{f' ({item_name})' if item_name else ''}: {error}") from None
            named = all(item_name is not None for item_name, _ in kind_items)
            params: list[Any] = list(kind_items) if named else [tensor for _, tensor in kind_items]
            new_group: dict[str, Any] = {"params": params, "kind": kind_, **hyper}
            if name is not None:
                new_group["name"] = name
            self._mark_use_muon(new_group)
            super().add_param_group(new_group)

    def _kind_of_use_muon(self, use_muon: bool, kind: str | None) -> str:
        """The kind a DeepSpeed-style group's ``use_muon`` names (DeepSpeed's MuonWithAuxAdam groups carry it)."""
        if self.matrix_kind != "muon":
            raise ValueError(f"Invalid param group key 'use_muon': it names Muon's halves; {type(self).__name__} "
                             "groups take 'kind'")
        implied = "muon" if use_muon else "adamw"
        if kind is not None and kind != implied:
            raise ValueError(f"param group has kind={kind!r} and use_muon={use_muon}, which names {implied!r}")
        return implied

    def _mark_use_muon(self, group: dict[str, Any]) -> None:
        # Code written for DeepSpeed's Muon reads group["use_muon"]; the kind says the same thing.
        if self.matrix_kind == "muon":
            group["use_muon"] = group["kind"] == "muon"

    def _kind_of(self, name: str | None, tensor: Tensor) -> str:
        if self.matrix_kind is not None and is_matrix(name or "", logical_shape(tensor)):
            return self.matrix_kind
        return "adamw"

    # -- stepping -------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            rule = rule_for_group(group)
            params, grads, states = [], [], []
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:
                    state.update(rule.init_state(param))
                params.append(param)
                grads.append(param.grad)
                states.append(state)
            if params:
                rule.update_(params, grads, states, lr=group["lr"])
        return loss

    # -- state dicts ----------------------------------------------------------------------------

    def _named_params(self) -> dict[str, tuple[Tensor, dict[str, Any]]]:
        out: dict[str, tuple[Tensor, dict[str, Any]]] = {}
        for group in self.param_groups:
            names = group.get("param_names")
            if names is None:
                raise ValueError("state by name needs parameter names: build the optimizer from "
                                 "model.named_parameters() or (name, tensor) pairs")
            for name, param in zip(names, group["params"]):
                if name in out:
                    raise ValueError(f"parameter name {name!r} appears twice")
                out[name] = (param, group)
        return out

    def state_dict_by_name(self) -> dict[str, dict[str, Tensor]]:
        """``{param_name: {state_key: tensor}}`` for every parameter with state (tensors not copied)."""
        return {name: dict(self.state[param]) for name, (param, _) in self._named_params().items()
                if self.state.get(param)}

    def load_state_dict_by_name(self, states: Mapping[str, Mapping[str, Tensor]], *, strict: bool = True) -> None:
        """Load per-name state (copied, converted to each parameter's device and state dtype).

        strict: every name must be known and every parameter must have an entry.
        """
        named = self._named_params()
        if strict:
            unknown = sorted(set(states) - set(named))
            missing = sorted(set(named) - set(states))
            if unknown or missing:
                raise ValueError(f"state by name does not match the optimizer: unknown {unknown}, missing {missing}")
        for name, saved in states.items():
            if name not in named:
                continue
            param, group = named[name]
            fresh = rule_for_group(group).init_state(param)
            if set(saved) != set(fresh):
                raise ValueError(f"state of {name!r} has keys {sorted(saved)}, its {group['kind']!r} rule "
                                 f"expects {sorted(fresh)}")
            for key, tensor in fresh.items():
                value = torch.as_tensor(saved[key])
                if value.shape != tensor.shape:
                    raise ValueError(f"state {name!r}[{key!r}] has shape {tuple(value.shape)}, "
                                     f"expected {tuple(tensor.shape)}")
                tensor.copy_(value)
            self.state[param] = fresh

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        for group in self.param_groups:  # torch puts back the saved keys; a state dict from before use_muon lacks it
            self._mark_use_muon(group)
        saved_ids = [pid for group in state_dict["param_groups"] for pid in group["params"]]
        params = [param for group in self.param_groups for param in group["params"]]
        for pid, param in zip(saved_ids, params):
            saved = state_dict["state"].get(pid)
            if not saved:
                continue
            state = self.state[param]
            for key, value in saved.items():
                if not isinstance(value, Tensor):
                    continue
                if key != "step" and value.is_floating_point() and state_dtype(param) != param.dtype:
                    # torch casts floating state to its parameter's dtype; a rule keeps fp32 state
                    # for bf16 or fp16 parameters, so put back the saved precision for those.
                    state[key] = value.to(device=param.device, dtype=state_dtype(param), copy=True)
                elif state.get(key) is value:
                    # torch keeps a tensor that needs no cast, so the loaded optimizer and the
                    # saved one would update the same memory (the step counter included).
                    state[key] = value.clone()


def _named_items(params: Any, names: list[str] | None = None) -> list[tuple[str | None, Tensor]]:
    """(name or None, tensor) pairs from a group's 'params' (tensors or (name, tensor) pairs).

    ``names`` is a group's 'param_names' (a group copied from another torch optimizer has them).
    """
    if params is None:
        raise ValueError("param group has no 'params'")
    if isinstance(params, Tensor):
        params = [params]
    elif isinstance(params, set):
        raise TypeError("params must be an ordered collection (a set's order changes between runs)")
    if names is not None:
        params = list(params)
        if len(names) != len(params):
            raise ValueError(f"param group has {len(names)} param_names for {len(params)} params")
        params = list(zip(names, params))
    items: list[tuple[str | None, Tensor]] = []
    for item in params:
        if isinstance(item, tuple):
            name, tensor = item
            items.append((str(name), tensor))
        else:
            items.append((None, item))
    if items and len({name is None for name, _ in items}) > 1:
        raise ValueError("all params of a group must be named, or none")
    for _, tensor in items:
        if not isinstance(tensor, Tensor):
            raise TypeError(f"an optimizer can only optimize tensors, got {type(tensor).__name__}")
    return items


class _MatrixOptimizer(RuleOptimizer):
    """A matrix kind for matrices plus an AdamW half for everything else (``adam_*`` keywords)."""

    def _default_adam_lr(self, settings: Mapping[str, Any]) -> float:
        # Shampoo and SOAP graft to (or are) Adam: their lr is already on AdamW's scale.
        return settings["lr"]

    def _split(self, settings: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
        assert self.matrix_kind is not None
        fields = rule_class(self.matrix_kind).hyper_parameters()
        matrix = {"lr": settings["lr"], **{key: settings[key] for key in fields}}
        adam_lr = settings["adam_lr"]
        adam_wd = settings["adam_weight_decay"]
        adam = {
            "lr": self._default_adam_lr(settings) if adam_lr is None else adam_lr,
            "betas": settings["adam_betas"],
            "eps": settings["adam_eps"],
            "weight_decay": settings["weight_decay"] if adam_wd is None else adam_wd,
        }
        if "adam_w_mode" in settings:  # Muon's (DeepSpeed's MuonWithAuxAdam has the key)
            adam["adam_w_mode"] = settings["adam_w_mode"]
        return {self.matrix_kind: matrix, "adamw": adam}


class Muon(_MatrixOptimizer):
    """Muon for matrices, AdamW for the rest, in one optimizer (DeepSpeed's MuonWithAuxAdam, single process).

    Which tensors are matrices: >= 2 dims and a name without "embed" or "lm_head" (unnamed
    tensors: >= 2 dims). A 3-D tensor is a stack of matrices over its first dim (MoE experts
    ``[experts, out, in]``), each orthogonalised and scaled on its own; a 4-D one (a convolution
    filter) is one ``(shape[0], rest)`` matrix. ``num_heads`` (per-head Muon, DeepSpeed's
    ``per_head_muon``; usually set per param group, since queries and keys have different head
    counts) orthogonalises each of ``num_heads`` row blocks of a 2-D attention projection on its own.

    Defaults are DeepSpeed 0.19.8's Muon: lr 0.02, momentum 0.95 with Nesterov, 5 Newton-Schulz
    steps of the classic quintic, the Gram method, no weight decay, the sqrt(max(1, rows/cols))
    step scale; its auxiliary Adam's betas (0.9, 0.95) and eps 1e-10. ``adam_lr=None`` means
    ``lr`` under ``lr_scaling='match_rms_adamw'`` (that scaling exists to share AdamW's lr) and
    DeepSpeed's 3e-4 otherwise; ``adam_weight_decay=None`` means ``weight_decay``.
    ``adam_w_mode=False`` gives the auxiliary Adam L2 weight decay instead of decoupled
    (DeepSpeed's ``adam_w_mode``; the Muon half's decay stays decoupled, as there).

    Numeric contract:

    * ``ns_dtype=None`` iterates in bf16 (standard) or fp16 (Gram) on CUDA, like DeepSpeed, and
      in the parameter's precision (fp32; fp64 for fp64 parameters) elsewhere. DeepSpeed's CPU
      accelerator would pick bf16/fp16 too; we keep fp32 there so the CPU path is exact.
    * Bit-exact: the single-process result and the distributed owner step's (same rule, same
      call per tensor); a tensor's result whatever other tensors share the call; a non-finite
      gradient leaves the tensor and its state untouched.
    * Close, not bit-exact (relative error of one update; measured figures in docs/OPTIMIZERS.md):
      DeepSpeed's ``muon_update`` with its iteration in fp32 (it forms (c*A)@A and scales the
      update before adding; we form c*(A@A) and fold the scale into the step), ~5e-6;
      ``torch.optim.Muon`` against ours with ``ns_dtype='bfloat16'`` (it normalises in bf16 and
      fuses addmm), ~4e-2: bf16's resolution amplified by the iteration. In fp32 the iteration
      agrees with a float64 run of itself to ~6e-6.
    * Each matrix of a 3-D stack (or each head) gets the bit-exact result of orthogonalising it
      alone (one call per matrix). 4-D filters take their lr scale from ``(out, in*kh*kw)``;
      DeepSpeed's ``muon_update`` takes it from the kernel's ``kh/kw`` (1 for square kernels).
      ``torch.optim.Muon`` accepts only 2-D.
    * ``batch_same_shape=True`` stacks same-shape matrices (and the matrices of a stack) into one
      batched iteration; on the CPU batched matmuls are not slice-identical to single ones, so
      it trades the bit-exact independence above for fewer launches and is off by default.
    """

    matrix_kind = "muon"

    def __init__(self, params: ParamsLike, *, lr: float = 0.02, momentum: float = 0.95, nesterov: bool = True,
                 ns_steps: int = 5, ns_method: str = "gram",
                 ns_coefficients: str | tuple[float, float, float] = "quintic", ns_dtype: str | None = None,
                 gram_restart_steps: tuple[int, ...] = (2,), weight_decay: float = 0.0, lr_scaling: str = "original",
                 batch_same_shape: bool = False, num_heads: int | None = None, adam_lr: float | None = None,
                 adam_betas: tuple[float, float] = (0.9, 0.95), adam_eps: float = 1e-10,
                 adam_weight_decay: float | None = None, adam_w_mode: bool = True) -> None:
        super().__init__(params, dict(
            lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps, ns_method=ns_method,
            ns_coefficients=ns_coefficients, ns_dtype=ns_dtype, gram_restart_steps=gram_restart_steps,
            weight_decay=weight_decay, lr_scaling=lr_scaling, batch_same_shape=batch_same_shape, num_heads=num_heads,
            adam_lr=adam_lr,
            adam_betas=adam_betas, adam_eps=adam_eps, adam_weight_decay=adam_weight_decay, adam_w_mode=adam_w_mode))

    def _default_adam_lr(self, settings: Mapping[str, Any]) -> float:
        return settings["lr"] if settings["lr_scaling"] == "match_rms_adamw" else DEEPSPEED_AUX_ADAM_LR


class NorMuon(Muon):
    """NorMuon for matrices, AdamW for the rest: Muon with a per-row second moment (``ds_canzona.optim.adaptive_muon``).

    The orthogonalised update of each matrix is divided row by row by the root of an EMA
    (``beta2``) of its rows' mean squares, then rescaled to Muon's Frobenius norm
    (``lr_scaling='original'``, the authors' code) or to RMS 0.2 (``'match_rms_adamw'``, the
    paper's equation, lr on AdamW's scale). Everything else is ``Muon``'s: keywords, matrices,
    stacks, ``num_heads``, the auxiliary AdamW and the numeric contract (bit-exact with the
    distributed step; a non-finite gradient is skipped). Defaults: the NorMuon authors' code
    (lr 0.02, momentum 0.95, beta2 0.95, eps 1e-10, no weight decay); its auxiliary Adam's
    (0.9, 0.95), 1e-10 and 3e-4 are DeepSpeed's too. ``batch_same_shape`` is not offered.
    """

    matrix_kind = "normuon"

    def __init__(self, params: ParamsLike, *, lr: float = 0.02, momentum: float = 0.95, beta2: float = 0.95,
                 eps: float = 1e-10, nesterov: bool = True, ns_steps: int = 5, ns_method: str = "gram",
                 ns_coefficients: str | tuple[float, float, float] = "quintic", ns_dtype: str | None = None,
                 gram_restart_steps: tuple[int, ...] = (2,), weight_decay: float = 0.0, lr_scaling: str = "original",
                 num_heads: int | None = None, adam_lr: float | None = None,
                 adam_betas: tuple[float, float] = (0.9, 0.95), adam_eps: float = 1e-10,
                 adam_weight_decay: float | None = None, adam_w_mode: bool = True) -> None:
        # Muon's settings plus the rule's own (Muon.__init__ takes a fixed keyword set), and
        # batch_same_shape pinned off: the rule refuses it.
        RuleOptimizer.__init__(self, params, dict(
            lr=lr, momentum=momentum, beta2=beta2, eps=eps, nesterov=nesterov, ns_steps=ns_steps,
            ns_method=ns_method, ns_coefficients=ns_coefficients, ns_dtype=ns_dtype,
            gram_restart_steps=gram_restart_steps, weight_decay=weight_decay, lr_scaling=lr_scaling,
            batch_same_shape=False, num_heads=num_heads, adam_lr=adam_lr, adam_betas=adam_betas, adam_eps=adam_eps,
            adam_weight_decay=adam_weight_decay, adam_w_mode=adam_w_mode))


class AdaMuon(Muon):
    """AdaMuon for matrices, AdamW for the rest: Muon with an element-wise second moment (``adaptive_muon``).

    The momentum's sign (``sign_momentum``, the paper's sign-stabilised update) is orthogonalised,
    divided element by element by the root of an EMA (``beta2``) of its squares, and rescaled to
    RMS 0.2 (``lr_scaling='match_rms_adamw'``, the paper's RMS alignment: lr on AdamW's scale, so
    ``adam_lr=None`` follows ``lr``) or to Muon's norm (``'original'``). Everything else is
    ``Muon``'s. Defaults: momentum 0.95 with Nesterov, beta2 0.999, eps 1e-8 (the authors' code);
    lr 6e-4 and weight decay 0.1 (the authors' GPT-2 recipe). ``sign_momentum=False`` is the
    authors' published code, which has no sign step.
    """

    matrix_kind = "adamuon"

    def __init__(self, params: ParamsLike, *, lr: float = 6e-4, momentum: float = 0.95, beta2: float = 0.999,
                 eps: float = 1e-8, sign_momentum: bool = True, nesterov: bool = True, ns_steps: int = 5,
                 ns_method: str = "gram", ns_coefficients: str | tuple[float, float, float] = "quintic",
                 ns_dtype: str | None = None, gram_restart_steps: tuple[int, ...] = (2,), weight_decay: float = 0.1,
                 lr_scaling: str = "match_rms_adamw", num_heads: int | None = None, adam_lr: float | None = None,
                 adam_betas: tuple[float, float] = (0.9, 0.95), adam_eps: float = 1e-10,
                 adam_weight_decay: float | None = None, adam_w_mode: bool = True) -> None:
        RuleOptimizer.__init__(self, params, dict(
            lr=lr, momentum=momentum, beta2=beta2, eps=eps, sign_momentum=sign_momentum, nesterov=nesterov,
            ns_steps=ns_steps, ns_method=ns_method, ns_coefficients=ns_coefficients, ns_dtype=ns_dtype,
            gram_restart_steps=gram_restart_steps, weight_decay=weight_decay, lr_scaling=lr_scaling,
            batch_same_shape=False, num_heads=num_heads, adam_lr=adam_lr, adam_betas=adam_betas, adam_eps=adam_eps,
            adam_weight_decay=adam_weight_decay, adam_w_mode=adam_w_mode))


class Shampoo(_MatrixOptimizer):
    """Shampoo (blocked Kronecker factors, AdamW-grafted step size) for matrices, AdamW for the rest.

    See ``ds_canzona.optim.shampoo`` for the update. ``betas=(beta1, beta2)``: beta1 is the
    momentum of the gradient (shared with the graft), beta2 the statistics' decay (1.0: sums).
    ``start_preconditioning_step=None`` means ``precondition_frequency``; before it the step is
    AdamW's alone. ``adam_lr=None`` means ``lr``.

    Numeric contract: bit-exact between the single-process and the distributed step, and
    per tensor whatever shares the call; a non-finite gradient is skipped. Against a float64
    reference the fp32 update agrees to ~1e-5 relative when the statistics are full rank with
    cond up to ~1e3 (fp32 statistics hold their small eigenvalues to ~1e-7 * cond, and the 4th
    root quarters that); singular statistics with a tiny ``epsilon`` are not comparable across
    precisions at all. ``inverse_root='newton'`` agrees with 'eigh' to ~1e-6 on a regularised
    statistic and is the cheaper, less robust path.
    """

    matrix_kind = "shampoo"

    def __init__(self, params: ParamsLike, *, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 1.0),
                 epsilon: float = 1e-12, weight_decay: float = 0.0, precondition_frequency: int = 10,
                 start_preconditioning_step: int | None = None, max_preconditioner_dim: int = 1024,
                 inverse_root: str = "eigh", root_dtype: str = "float32", graft_beta2: float = 0.999,
                 graft_eps: float = 1e-8, adam_lr: float | None = None, adam_betas: tuple[float, float] = (0.9, 0.95),
                 adam_eps: float = 1e-10, adam_weight_decay: float | None = None) -> None:
        super().__init__(params, dict(
            lr=lr, betas=betas, epsilon=epsilon, weight_decay=weight_decay,
            precondition_frequency=precondition_frequency, start_preconditioning_step=start_preconditioning_step,
            max_preconditioner_dim=max_preconditioner_dim, inverse_root=inverse_root, root_dtype=root_dtype,
            graft_beta2=graft_beta2, graft_eps=graft_eps, adam_lr=adam_lr, adam_betas=adam_betas,
            adam_eps=adam_eps, adam_weight_decay=adam_weight_decay))


class SOAP(_MatrixOptimizer):
    """SOAP (Adam in the eigenbasis of Shampoo's statistics) for matrices, AdamW for the rest.

    See ``ds_canzona.optim.soap`` for the update; defaults are the SOAP authors'. The first step
    of each matrix only builds its bases and leaves it unchanged. ``adam_lr=None`` means ``lr``.

    Numeric contract: bit-exact between the single-process and the distributed step, and per
    tensor whatever shares the call; a non-finite gradient is skipped. Against a float64
    reference the fp32 update agrees to ~5e-5 relative when the statistics' eigenvalues are
    distinct; a repeated eigenvalue (a rank-deficient statistic, e.g. the long side of one
    gradient) leaves its eigenvectors, hence the basis, undetermined, so precisions diverge.
    """

    matrix_kind = "soap"

    def __init__(self, params: ParamsLike, *, lr: float = 3e-3, betas: tuple[float, float] = (0.95, 0.95),
                 shampoo_beta: float | None = None, eps: float = 1e-8, weight_decay: float = 0.01,
                 precondition_frequency: int = 10, max_precond_dim: int = 10000, adam_lr: float | None = None,
                 adam_betas: tuple[float, float] = (0.9, 0.95), adam_eps: float = 1e-10,
                 adam_weight_decay: float | None = None) -> None:
        super().__init__(params, dict(
            lr=lr, betas=betas, shampoo_beta=shampoo_beta, eps=eps, weight_decay=weight_decay,
            precondition_frequency=precondition_frequency, max_precond_dim=max_precond_dim, adam_lr=adam_lr,
            adam_betas=adam_betas, adam_eps=adam_eps, adam_weight_decay=adam_weight_decay))


class AdamW(RuleOptimizer):
    """AdamW on the rule path (kind 'adamw'), every tensor alike; defaults are ``torch.optim.AdamW``'s.

    Numeric contract: bit-exact with DeepSpeed's ``adam_update`` followed by its decoupled weight
    decay (the same operation sequence); equal to ``torch.optim.AdamW`` up to rounding (~1e-6
    relative), which orders the bias corrections differently. ``adam_w_mode=False`` is Adam
    with L2 weight decay (``torch.optim.Adam``'s ``weight_decay``), to rounding likewise.
    """

    def __init__(self, params: ParamsLike, *, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.01, adam_w_mode: bool = True) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                      adam_w_mode=adam_w_mode))

    def _split(self, settings: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
        return {"adamw": dict(settings)}
