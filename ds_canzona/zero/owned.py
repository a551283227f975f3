"""What an owner rank keeps per item, and the pieces of the optimizer both runtimes read.

Shared by the ZeRO-1/2 (``stage12``) and ZeRO-3 (``stage3``) runtimes and the checkpoint glue.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch


class GradientAfterReductionError(RuntimeError):
    """A gradient arrived after its bucket (ZeRO-1/2) or its tensor (ZeRO-3) was reduced this step (it would be lost)."""


@dataclass
class OwnedTensor:
    """What the owner rank keeps for one item (a whole tensor, or a piece of a non-matrix one or of an expert stack).

    ``index`` is the item's index in the plan, ``tensor`` its tensor's index in ``params``;
    ``name`` is the tensor's name for a whole tensor, ``name[start:stop]`` for a piece.
    """

    index: int
    name: str
    master: torch.Tensor
    state: dict
    group: dict
    tensor: int = -1


def parameter_groups(optimizer: torch.optim.Optimizer) -> dict[torch.Tensor, dict]:
    """Each parameter's param group (the group carries the rule's 'kind' and hyper-parameters)."""
    groups: dict[torch.Tensor, dict] = {}
    for group in optimizer.param_groups:
        if "kind" not in group:
            raise ValueError("ds_canzona's ZeRO optimizer needs param groups with a 'kind' "
                             "(use ds_canzona.optim.Muon, NorMuon, AdaMuon, Shampoo, SOAP or AdamW)")
        for p in group["params"]:
            groups[p] = group
    return groups


__all__ = ["GradientAfterReductionError", "OwnedTensor", "parameter_groups"]


class ParameterStateView(Mapping):
    """``optimizer.state`` of the basic optimizer under a ds_canzona runtime: parameter -> state.

    Code written for ``torch.optim`` reads ``optimizer.state[param]["step"]`` (LR warm-up
    callbacks, trainers' logging, DeepSpeed's own tests). Under ZeRO the basic optimizer never
    steps, so its own ``state`` would be empty; this view answers instead. A parameter this rank
    owns whole maps to its live state (``step`` and the rule's tensors, e.g. AdamW's ``exp_avg``
    and ``exp_avg_sq``, DeepSpeed's names); any other trainable parameter maps to ``{"step": n}``
    only: every tensor takes the same applied steps, so the count is the same everywhere, while
    the tensors live on the owner. Read-only, like the rest of the state API (see
    ``OwnerRuntime.state_dict``).
    """

    def __init__(self, params: list[torch.Tensor], names: list[str], owned: Callable[[], list[OwnedTensor]],
                 steps_here: Callable[[], int]):
        self._index = {id(p): i for i, p in enumerate(params)}
        self._params = params
        self._names = names
        self._owned = owned
        self._steps_here = steps_here  # for a rank that owns nothing: the steps it applied since start

    def _whole(self) -> dict[int, OwnedTensor]:
        return {t.tensor: t for t in self._owned() if t.tensor >= 0 and t.name == self._names[t.tensor]}

    def step_count(self) -> torch.Tensor:
        """The applied-step counter: any owned state's ``step`` (they are equal, and a checkpoint
        restores them); on a rank that owns nothing, the steps it applied since it started."""
        for t in self._owned():
            if "step" in t.state:
                return t.state["step"]
        return torch.tensor(float(self._steps_here()))

    def __getitem__(self, param: torch.Tensor) -> dict:
        index = self._index.get(id(param))
        if index is None:
            raise KeyError("not a trainable parameter of this optimizer")
        whole = self._whole().get(index)
        return whole.state if whole is not None else {"step": self.step_count()}

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(self._params)

    def __len__(self) -> int:
        return len(self._params)
