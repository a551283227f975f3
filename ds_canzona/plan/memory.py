"""Memory models: how many bytes of the owner rank's memory one item pins for the whole run.

A memory model is a small object in the style of the cost models (``ds_canzona.plan.cost``): a
``name``, a ``label`` and one method, ``bytes(spec) -> float``. :class:`StateMemory` counts what
the ZeRO-1/2 runtime (``ds_canzona.zero.stage12``) allocates on the rank that owns an item, and
nothing that is the same on every rank:

- the fp32 master copy: 4 bytes per element when the model's parameters are not fp32 (bf16,
  fp16); none for fp32 parameters, which the owner updates in place inside the flat buffer;
- the optimizer state, fp32 (the state follows the master), counted from each rule's
  ``init_state`` in ``ds_canzona.optim``:

  - AdamW (every non-matrix item): two moments, 2 elements per element;
  - Muon: the momentum, 1 per element;
  - Shampoo: two moments (2 per element), and for every block of at most ``max_preconditioner_dim``
    along each side (a x b), a statistic and an inverse root per side: 2a² + 2b²;
  - SOAP: two moments (2 per element), and for each side no longer than ``max_preconditioner_dim``
    (size k), a statistic and an eigenbasis: 2k²;

  so Shampoo's and SOAP's factors grow as m² + n², not m·n;
- the reduced-gradient segment: the owner's slice of each bucket's reduce-scatter output, in the
  parameters' dtype. The runtime allocates it at ZeRO stage 1 and 2 alike (at stage 2 it is all of
  the gradient a rank keeps between steps; stage 1 also keeps the full gradient buffers, the same
  on every rank, which no plan changes).

Not counted: the 0-dim step counter of each item (4 bytes, kept on the host, like
``torch.optim``'s), and the flat parameter buffers, the same size on every rank. A matrix with
more than two dims is viewed as ``(shape[0], prod(shape[1:]))``, as the matrix rules do; a
tensor-parallel shard counts its local shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, runtime_checkable

from .specs import ParamSpec, PlanError

__all__ = ["MEMORY_OPTIMIZERS", "MemoryModel", "StateMemory", "state_elements", "tp_host_bytes"]

# Bytes of one element of a master weight or of optimizer state (fp32).
STATE_ELEMENT_BYTES = 4

# The matrix optimizers and the option that bounds their factor matrices, with its default (the
# rules' defaults in ds_canzona.optim.shampoo / soap).
MEMORY_OPTIMIZERS: dict[str, dict[str, int]] = {
    "muon": {},
    "normuon": {},
    "adamuon": {},
    "shampoo": {"max_preconditioner_dim": 1024},
    "soap": {"max_preconditioner_dim": 10000},
}


@runtime_checkable
class MemoryModel(Protocol):
    """What the planner needs: a label for the plan, and the bytes an item pins on its owner."""

    @property
    def name(self) -> str: ...

    @property
    def label(self) -> str: ...

    def bytes(self, spec: ParamSpec) -> float: ...


def state_elements(spec: ParamSpec, optimizer: str = "muon", *, max_preconditioner_dim: int | None = None) -> int:
    """fp32 elements of optimizer state for ``spec``: ``optimizer`` for a matrix, AdamW otherwise."""
    numel = spec.numel
    if not spec.matrix:
        return 2 * numel  # AdamW: exp_avg, exp_avg_sq
    # Shampoo and SOAP keep per-matrix statistics: a 3-D stack has one set per expert.
    count, rows, cols = spec.matrix_stack
    if optimizer == "muon":
        return numel  # momentum_buffer
    if optimizer == "normuon":
        _, _, matrix_cols = spec.matrix_stack
        return numel + numel // matrix_cols  # momentum_buffer, row_second_moment (one per row of each matrix)
    if optimizer == "adamuon":
        return 2 * numel  # momentum_buffer, second_moment
    limit = max_preconditioner_dim if max_preconditioner_dim is not None else \
        MEMORY_OPTIMIZERS[optimizer]["max_preconditioner_dim"]
    if optimizer == "shampoo":
        factors = 0
        for a in _block_sizes(rows, limit):
            for b in _block_sizes(cols, limit):
                factors += 2 * a * a + 2 * b * b  # left/right statistic and inverse root
        return 2 * numel + count * factors  # exp_avg, exp_avg_sq (grafting)
    if optimizer == "soap":
        factors = sum(2 * side * side for side in (rows, cols) if side <= limit)  # statistic and basis
        return 2 * numel + count * factors
    raise PlanError(f"Invalid optimizer={optimizer!r}: must be one of {sorted(MEMORY_OPTIMIZERS)}.")


@dataclass(frozen=True, kw_only=True)
class StateMemory:
    """Bytes an owner keeps for an item: fp32 master (non-fp32 models), optimizer state, gradient segment.

    ``param_bytes`` is the element size of the model's parameters (2 for bf16/fp16, 4 for fp32);
    ``optimizer`` the matrix optimizer (non-matrix items always use AdamW); ``options`` may set
    ``max_preconditioner_dim`` for Shampoo and SOAP (SOAP's rule calls it ``max_precond_dim``).
    """

    optimizer: str = "muon"
    param_bytes: int = 2
    options: tuple[tuple[str, Any], ...] = ()
    name: ClassVar[str] = "state_bytes"

    def __post_init__(self) -> None:
        if self.optimizer not in MEMORY_OPTIMIZERS:
            raise PlanError(f"Invalid optimizer={self.optimizer!r}: must be one of {sorted(MEMORY_OPTIMIZERS)}.")
        if isinstance(self.param_bytes, bool) or self.param_bytes not in (1, 2, 4, 8):
            raise PlanError(f"Invalid param_bytes={self.param_bytes!r}: must be 1, 2, 4 or 8.")
        allowed = MEMORY_OPTIMIZERS[self.optimizer]
        for key, value in self.options:
            if key not in allowed:
                raise PlanError(f"Invalid option {key!r} for the {self.optimizer} memory model: "
                                f"expected one of {sorted(allowed) or 'none'}.")
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PlanError(f"Invalid {key}={value!r} for the {self.optimizer} memory model: "
                                "must be a positive integer.")

    @property
    def master_bytes_per_element(self) -> int:
        """fp32 parameters are updated in place in the buffer; any other dtype keeps an fp32 master."""
        return 0 if self.param_bytes == 4 else STATE_ELEMENT_BYTES

    @property
    def label(self) -> str:
        options = "".join(f",{key}={value}" for key, value in sorted(self.options))
        return f"{self.name}:{self.optimizer}(param_bytes={self.param_bytes}{options})"

    def bytes(self, spec: ParamSpec) -> float:
        state = state_elements(spec, self.optimizer, **dict(self.options))
        per_element = self.master_bytes_per_element + self.param_bytes  # master and gradient segment
        return float(per_element * spec.numel + STATE_ELEMENT_BYTES * state)


def memory_model(optimizer: str = "muon", *, param_bytes: int = 2, **options: Any) -> StateMemory:
    """A :class:`StateMemory`; ``options`` may give ``max_preconditioner_dim`` (or SOAP's ``max_precond_dim``)."""
    if "max_precond_dim" in options:
        options["max_preconditioner_dim"] = options.pop("max_precond_dim")
    options = {key: value for key, value in options.items() if key in MEMORY_OPTIMIZERS.get(optimizer, {})}
    return StateMemory(optimizer=optimizer, param_bytes=param_bytes, options=tuple(sorted(options.items())))


def tp_host_bytes(memory: StateMemory, spec: ParamSpec) -> float:
    """Bytes the tensor-parallel host of a sharded matrix keeps for it (``spec``: the logical matrix).

    Under AutoTP (``ds_canzona.zero.tp``) one rank of the matrix's TP group computes its update on
    the whole matrix, so that rank keeps a full fp32 master (also for fp32 models: its buffer holds
    only its own slice) and the optimizer state of the whole matrix; the other TP ranks keep
    nothing for it beyond their slice of the gradient segment. The data-parallel plan's bytes of
    such a matrix (logical sizes) are its TP group's; this is how they fall on one rank of it.
    """
    state = state_elements(spec, memory.optimizer, **dict(memory.options))
    return float(STATE_ELEMENT_BYTES * (spec.numel + state))


def _block_sizes(size: int, block: int) -> list[int]:
    """Sizes of the consecutive blocks of at most ``block`` along a side (as Shampoo's ``block_bounds``)."""
    return [min(block, size - start) for start in range(0, size, block)]
