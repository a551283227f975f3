"""The per-tensor rule interface shared by the single-process optimizers and the owner step.

A rule is a small frozen dataclass built from one param group. It knows how to create the
state of one whole tensor, how to update a list of whole tensors in place, and what one tensor
costs. It never touches a process group: the distributed runtime hands each owner its own
tensors and calls the very same ``update_`` the single-process optimizers call.

Contract of ``update_`` (relied on by the runtime's tests):

* each tensor's result depends only on that tensor, its gradient, its state and ``lr``; it is
  bit-for-bit the same whichever other tensors share the call;
* a tensor whose gradient holds a NaN or an infinity is skipped: neither it nor its state
  changes (its ``step`` does not advance either);
* state is kept in float32 (float64 for float64 parameters), whatever the parameter's dtype;
  ``step`` is a 0-dim float32 tensor on the CPU, as in ``torch.optim``, so reading it never
  waits for the device.
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch
from torch import Tensor

# Kinds whose tensors are updated as matrices; every other tensor goes to "adamw".
MATRIX_KINDS: frozenset[str] = frozenset({"muon", "normuon", "adamuon", "shampoo", "soap"})


def is_matrix(name: str, shape: Sequence[int]) -> bool:
    """The matrix rule: >= 2 dims, and neither an embedding nor the output head.

    One rule for the whole package: the planner's ``default_matrix_rule`` (DeepSpeed's Muon
    rule), so the optimizers and the plans never disagree on which tensors are matrices.
    """
    from ds_canzona.plan.specs import default_matrix_rule  # pure Python, no torch

    return default_matrix_rule(name, shape)


def logical_shape(tensor) -> tuple[int, ...]:
    """The shape a parameter stands for: ``ds_shape`` under DeepSpeed's ZeRO-3, else its own.

    A parameter partitioned by ``deepspeed.zero.Init`` is an empty 1-D placeholder between
    uses and carries its full shape as ``ds_shape``; judging it by ``shape`` would make every
    matrix 1-D and send it to AdamW (DeepSpeed #8438). Duck-typed: no DeepSpeed import here.
    """
    return tuple(getattr(tensor, "ds_shape", tensor.shape))


@runtime_checkable
class TensorRule(Protocol):
    """The per-tensor math of one optimizer kind, configured by one param group."""

    kind: ClassVar[str]

    def init_state(self, param: Tensor) -> dict[str, Tensor]:
        """Fresh state of one whole tensor (float32, or float64 for a float64 parameter)."""
        ...

    def update_(self, params: list[Tensor], grads: list[Tensor], states: list[dict[str, Tensor]], *,
                lr: float, known_finite: bool = False) -> None:
        """Update each whole parameter and its state in place from its gradient.

        ``known_finite=True`` skips the per-tensor finiteness check, for callers that have
        already checked every gradient (the ZeRO step does, through its norm all-reduce).
        """
        ...

    def cost(self, shape: tuple[int, ...], *, model: str = "flops", machine_balance: float | None = None) -> float:
        """The optimizer-step cost of one tensor of this shape, from the planner's cost ``model``."""
        ...


# --------------------------------------------------------------------------- validation helpers


def invalid(kind: str, key: str, value: Any, why: str) -> ValueError:
    """A ValueError that names the group key, its kind and the value."""
    return ValueError(f"Invalid {kind} {key}={value!r}: {why}")


def check_float(kind: str, key: str, value: Any, *, low: float | None = None, high: float | None = None,
                low_open: bool = False, high_open: bool = False) -> float:
    """``value`` as a finite float inside the given interval, or a ValueError naming ``key``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise invalid(kind, key, value, "must be a finite number")
    value = float(value)
    if low is not None and (value <= low if low_open else value < low):
        raise invalid(kind, key, value, f"must be {'>' if low_open else '>='} {low}")
    if high is not None and (value >= high if high_open else value > high):
        raise invalid(kind, key, value, f"must be {'<' if high_open else '<='} {high}")
    return value


def check_int(kind: str, key: str, value: Any, *, low: int) -> int:
    """``value`` as an int >= ``low`` (bools refused), or a ValueError naming ``key``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(kind, key, value, "must be an integer")
    if value < low:
        raise invalid(kind, key, value, f"must be >= {low}")
    return value


def check_choice(kind: str, key: str, value: Any, choices: Iterable[str]) -> str:
    """``value`` if it is one of ``choices``, or a ValueError naming ``key`` and the choices."""
    choices = tuple(choices)
    if value not in choices:
        raise invalid(kind, key, value, f"must be one of {', '.join(repr(c) for c in choices)}")
    return value


def check_bool(kind: str, key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise invalid(kind, key, value, "must be True or False")
    return value


def check_betas(kind: str, key: str, value: Any, *, allow_one: Sequence[bool] = (False, False)) -> tuple[float, float]:
    """A pair of decay factors, each in [0, 1) (or [0, 1] where ``allow_one`` says so)."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or len(value) != 2:
        raise invalid(kind, key, value, "must be a pair (beta1, beta2)")
    out = []
    for index, (beta, one_ok) in enumerate(zip(value, allow_one)):
        if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not math.isfinite(beta):
            raise invalid(kind, key, value, f"{key}[{index}] must be a finite number")
        if not (0.0 <= beta <= 1.0 if one_ok else 0.0 <= beta < 1.0):
            raise invalid(kind, key, value, f"{key}[{index}] must be in [0, {'1]' if one_ok else '1)'}")
        out.append(float(beta))
    return out[0], out[1]


def check_lr(lr: Any, kind: str = "") -> float:
    if isinstance(lr, Tensor):
        if lr.numel() != 1:
            raise ValueError(f"Invalid {kind} lr: a tensor lr must have one element, got shape {tuple(lr.shape)}")
        lr = lr.item()
    return check_float(kind or "group", "lr", lr, low=0.0)


# --------------------------------------------------------------------------- shared tensor helpers


def state_dtype(param: Tensor) -> torch.dtype:
    """float64 state for float64 parameters, float32 for everything else (bf16 and fp16 included)."""
    return torch.float64 if param.dtype == torch.float64 else torch.float32


# Every live step counter, by identity. They are host tensors by design, so a tool that counts
# the host's reads of device values (ds_canzona.bench.standins.host_syncs) must be able to leave them out
# on a CPU run, where every tensor lives in the same memory.
_STEP_COUNTERS: weakref.WeakValueDictionary[int, Tensor] = weakref.WeakValueDictionary()


def new_step() -> Tensor:
    """A fresh step counter: a 0-dim float32 tensor on the CPU, like ``torch.optim``'s."""
    step = torch.zeros((), dtype=torch.float32)
    _STEP_COUNTERS[id(step)] = step
    return step


def is_step_counter(tensor: Tensor) -> bool:
    """Whether ``tensor`` is a step counter made by ``new_step`` (and still alive)."""
    return _STEP_COUNTERS.get(id(tensor)) is tensor


def finite_flags(grads: Sequence[Tensor]) -> list[bool]:
    """Whether each gradient is entirely finite, with one host synchronisation for the list."""
    if not grads:
        return []
    flags = [torch.isfinite(g).all() for g in grads]
    devices = {f.device for f in flags}
    if len(devices) == 1:
        return [bool(f) for f in torch.stack(flags).tolist()]
    return [bool(f) for f in flags]


def matrix_stack_shape(shape: Sequence[int]) -> tuple[int, int, int]:
    """(count, rows, cols): the independent matrices in which matrix rules see a tensor of >= 2 dims.

    * 2 dims: one matrix.
    * 3 dims: a stack of ``shape[0]`` matrices of ``shape[1] x shape[2]``, each its own matrix: a
      fused MoE expert stack ``[experts, out, in]`` (DeepSpeed's and the reference Muon's rule).
    * 4 or more dims: one matrix ``(shape[0], rest)``: a convolution filter ``[out, in, kh, kw]``.
    """
    if len(shape) == 3:
        return int(shape[0]), int(shape[1]), int(shape[2])
    rows = int(shape[0])
    return 1, rows, math.prod(int(s) for s in shape[1:])


def as_matrix(t: Tensor) -> Tensor:
    """The 2-D view (rows, everything else) of a tensor of 2 or >= 4 dims (see ``matrix_stack_shape``)."""
    return t.reshape(t.shape[0], -1)


def matrix_shape(shape: Sequence[int]) -> tuple[int, int]:
    """(rows, cols) of ``as_matrix`` for a tensor of 2 or >= 4 dims."""
    rows = int(shape[0])
    return rows, math.prod(int(s) for s in shape[1:])


def require_matrix(kind: str, param: Tensor) -> None:
    if param.dim() < 2:
        raise ValueError(f"The {kind} rule updates tensors with >= 2 dims, got shape {tuple(param.shape)}; "
                         "give 1-D tensors to 'adamw' (the single-process optimizers do so by the matrix rule)")


def matrix_views(t: Tensor) -> list[Tensor]:
    """The matrices of ``t`` (``matrix_stack_shape``) as 2-D views that share its memory.

    Each expert ``t[e]`` of a 3-D stack; the one ``as_matrix(t)`` otherwise (a view when ``t`` is
    contiguous or 2-D: callers that write through it allocate ``t`` contiguous).
    """
    if t.dim() == 3:
        return list(t.unbind(0))
    return [as_matrix(t)]


def expert_tags(shape: Sequence[int]) -> list[str | None]:
    """The name of each matrix of ``shape`` in the state keys of per-matrix state (Shampoo, SOAP).

    None for the one matrix of a 2-D or >= 4-D tensor, whose keys stay those checkpoints have
    always had (``left_stat.0.1``, ``left_basis``); ``"e"`` for expert e of a 3-D stack, which
    ``state_key`` puts right after the key's name (``left_stat.e.0.1``, ``left_basis.e``).
    """
    count, _, _ = matrix_stack_shape(shape)
    return [str(e) for e in range(count)] if len(shape) == 3 else [None]


def state_key(*parts: str | None) -> str:
    """The parts joined by dots, None left out (``state_key("left_stat", None) == "left_stat"``)."""
    return ".".join(part for part in parts if part is not None)


# A 3-D stack's state, expert by expert. A stack may be planned whole or in pieces of whole
# experts (ds_canzona.plan.stack_piece_bounds), and a checkpoint saved one way loads the other; so
# its state must be cut and joined at expert boundaries. Every rule keeps three kinds of entries:
# per expert by key (``left_stat.e.i.j``: ``state_key`` puts the expert right after the name),
# per expert along the first dim (the momentum and every elementwise tensor ``[experts, rows,
# cols]``, NorMuon's ``[experts, rows]``), and shared (``step``).

def _expert_of_key(key: str) -> tuple[str, int, str | None] | None:
    """(name, expert, rest) of a per-expert key of a stack's state, or None."""
    parts = key.split(".", 2)
    if len(parts) < 2 or not parts[1].isdigit():
        return None
    return parts[0], int(parts[1]), parts[2] if len(parts) == 3 else None


def _along_experts(value: Any, experts: int) -> bool:
    return isinstance(value, Tensor) and value.dim() >= 1 and value.shape[0] == experts


def slice_stack_state(state: dict[str, Any], experts: int, first: int, stop: int) -> dict[str, Any]:
    """The state of experts ``[first, stop)`` of a stack of ``experts`` whose state is ``state``,
    keyed as the state of a stack of ``stop - first`` experts (keys renumbered from 0)."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        tagged = _expert_of_key(key)
        if tagged is not None:
            name, expert, rest = tagged
            if first <= expert < stop:
                out[state_key(name, str(expert - first), rest)] = value
        elif _along_experts(value, experts):
            out[key] = value[first:stop]
        else:
            out[key] = value
    return out


def join_stack_states(parts: Sequence[tuple[int, dict[str, Any]]]) -> dict[str, Any]:
    """The state of one stack from ``(experts, state)`` of consecutive expert ranges, in order:
    per-expert keys renumbered by the experts before them, tensors along the experts
    concatenated, shared entries from the first part."""
    out: dict[str, Any] = {}
    along: dict[str, list[Tensor]] = {}
    offset = 0
    for number, (experts, state) in enumerate(parts):
        for key, value in state.items():
            tagged = _expert_of_key(key)
            if tagged is not None:
                name, expert, rest = tagged
                out[state_key(name, str(expert + offset), rest)] = value
            elif _along_experts(value, experts):
                along.setdefault(key, []).append(value)
            elif number == 0:
                out[key] = value
        offset += experts
    for key, values in along.items():
        out[key] = torch.cat(values)
    return out


def check_update_args(params: list[Tensor], grads: list[Tensor], states: list[dict[str, Tensor]]) -> None:
    if not (len(params) == len(grads) == len(states)):
        raise ValueError(f"update_ needs one grad and one state per param: got {len(params)} params, "
                         f"{len(grads)} grads, {len(states)} states")
    for param, grad in zip(params, grads):
        if grad.shape != param.shape:
            raise ValueError(f"grad shape {tuple(grad.shape)} does not match param shape {tuple(param.shape)}")
        if grad.is_sparse or grad.is_complex() or param.is_complex():
            raise ValueError("sparse or complex tensors are not supported")


class RuleBase:
    """Shared driver of the rules: argument checks, the non-finite skip, dtype handling.

    Subclasses are frozen keyword-only dataclasses (their fields are the group's hyper-parameters)
    and implement ``init_state`` and ``_update_one``; Muon overrides ``_update_finite`` to batch.
    """

    kind: ClassVar[str]

    @classmethod
    def hyper_parameters(cls) -> tuple[str, ...]:
        """The group keys this rule reads (besides ``lr``)."""
        return tuple(f.name for f in dataclasses.fields(cls))  # type: ignore[arg-type]

    @classmethod
    def from_group(cls, group: Mapping[str, Any]) -> RuleBase:
        if "lr" in group:
            check_lr(group["lr"], cls.kind)
        kwargs = {name: group[name] for name in cls.hyper_parameters() if name in group}
        return cls(**kwargs)

    def update_(self, params: list[Tensor], grads: list[Tensor], states: list[dict[str, Tensor]], *,
                lr: float, known_finite: bool = False) -> None:
        check_update_args(params, grads, states)
        lr = check_lr(lr, self.kind)
        finite = [True] * len(grads) if known_finite else finite_flags(grads)
        work = [(p, g, s) for p, g, s, ok in zip(params, grads, states, finite) if ok]
        self._update_finite(work, lr)

    def _update_finite(self, work: list[tuple[Tensor, Tensor, dict[str, Tensor]]], lr: float) -> None:
        for param, grad, state in work:
            with_master(param, lambda master: self._update_one(master, grad.to(master.dtype), state, lr))

    def _update_one(self, param: Tensor, grad: Tensor, state: dict[str, Tensor], lr: float) -> None:
        raise NotImplementedError

    def check_shape(self, shape: tuple[int, ...]) -> None:
        """A ValueError if this rule cannot update a tensor of ``shape`` (checked when groups are built)."""
        if self.kind in MATRIX_KINDS and len(shape) < 2:
            raise ValueError(f"matrix kinds need >= 2 dims, got shape {shape}")

    def cost_options(self) -> dict[str, Any]:
        """This kind's hyper-parameters under the names the planner's FLOPs model takes."""
        return {}

    def plan_heads(self) -> int:
        """``ParamSpec.heads`` of this group's matrices: how many row blocks each is updated as."""
        return 1

    def cost(self, shape: tuple[int, ...], *, model: str = "flops", machine_balance: float | None = None) -> float:
        """One update of a tensor of ``shape`` priced by the planner's ``model`` (FLOPs by default)."""
        # Imported here: the planner is a neighbour, not a dependency of the math.
        from ds_canzona.plan import ParamSpec, cost_model

        # The planner's models price a non-matrix spec as AdamW whichever matrix optimizer they
        # are built for, so AdamW asks the default model with matrix=False.
        extra = {} if machine_balance is None else {"machine_balance": machine_balance}
        matrix = self.kind in MATRIX_KINDS
        if matrix:
            pricing = cost_model(name=model, optimizer=self.kind, **extra, **self.cost_options())
        else:
            pricing = cost_model(name=model, **extra)
        heads = self.plan_heads() if matrix else 1
        spec = ParamSpec(name=self.kind, shape=tuple(int(d) for d in shape), matrix=matrix, heads=heads)
        return float(pricing.cost(spec))


def with_master(param: Tensor, fn: Any) -> None:
    """Run ``fn`` on a float32 (or float64) version of ``param``, writing back when it is a copy.

    The runtime hands fp32 masters, so this is the identity there; a single-process optimizer
    over bf16 parameters computes in fp32 and rounds once at the end.
    """
    dtype = state_dtype(param)
    if param.dtype == dtype:
        fn(param)
        return
    master = param.to(dtype)
    fn(master)
    param.copy_(master)


# --------------------------------------------------------------------------- registry

_RULES: dict[str, type[RuleBase]] = {}


def register_rule(cls: type[RuleBase]) -> type[RuleBase]:
    """Class decorator: make ``cls`` the rule of ``cls.kind``."""
    if cls.kind in _RULES and _RULES[cls.kind] is not cls:
        raise ValueError(f"a rule for kind {cls.kind!r} is already registered")
    _RULES[cls.kind] = cls
    return cls


def rule_class(kind: str) -> type[RuleBase]:
    if kind not in _RULES:
        raise ValueError(f"Invalid param group kind={kind!r}: must be one of {', '.join(map(repr, sorted(_RULES)))}")
    return _RULES[kind]


def known_kinds() -> tuple[str, ...]:
    return tuple(sorted(_RULES))


def rule_for_group(group: Mapping[str, Any]) -> TensorRule:
    """The validated rule of a param group (``group['kind']`` plus that kind's hyper-parameters).

    Keys the kind does not read (``params``, ``param_names``, ``initial_lr`` of LR schedulers,
    ...) are ignored here; the single-process optimizers refuse unknown keys at construction.
    """
    if "kind" not in group:
        raise ValueError(f"param group has no 'kind' (one of {', '.join(map(repr, known_kinds()))})")
    return rule_class(group["kind"]).from_group(group)  # type: ignore[return-value]
