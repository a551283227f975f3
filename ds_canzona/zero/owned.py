"""What an owner rank keeps per item, and the pieces of the optimizer both runtimes read.

Shared by the ZeRO-1/2 (``stage12``) and ZeRO-3 (``stage3``) runtimes and the checkpoint glue.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class GradientAfterReductionError(RuntimeError):
    """A gradient arrived after its bucket (ZeRO-1/2) or its tensor (ZeRO-3) was reduced this step (it would be lost)."""


@dataclass
class OwnedTensor:
    """What the owner rank keeps for one item (a whole tensor, or a piece of a non-matrix one).

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
