"""NorMuon and AdaMuon: Muon's orthogonalised step, normalised by a second moment of itself.

Both rules keep everything of Muon (``MuonRule``: the Nesterov momentum, both Newton-Schulz
methods and coefficient sets, stacks and per-head matrices) and add one step between the
orthogonalisation and the weight update. For each matrix O of the orthogonalised update (rows x
cols; a 3-D stack and per-head Muon as in ``ds_canzona.optim.muon``):

NorMuon (Li et al. 2025, arXiv:2510.05491), one second moment per row (per output neuron)::

    v <- beta2 v + (1 - beta2) mean_cols(O * O)          state 'row_second_moment', one per row
    N  = O / (sqrt(v) + eps)                             (v broadcast along the row)

AdaMuon (Si et al. 2025, arXiv:2507.11005), one second moment per element::

    S  = sign(U) if sign_momentum else U                 U: the matrix Muon would orthogonalise
    O  = NS(S)
    V <- beta2 V + (1 - beta2) O * O                     state 'second_moment', the tensor's shape
    N  = O / (sqrt(V) + eps)

Then N is rescaled to a fixed Frobenius norm per matrix and stepped with Muon's scale::

    "original":        N' = N ||O||_F / (||N||_F + eps);          W <- W - lr sqrt(max(1, rows/cols)) N'
    "match_rms_adamw": N' = N sqrt(min(rows, cols)) / (||N||_F + eps); W <- W - lr 0.2 sqrt(max(rows, cols)) N'

so under "match_rms_adamw" the update's Frobenius norm is 0.2 sqrt(rows cols) (RMS 0.2, both
papers' rescaling) and under "original" it is Muon's (NorMuon's reference code). Weight decay is
decoupled, as in Muon. docs/OPTIMIZERS.md gives the defaults' sources and what differs from
the papers' code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from ds_canzona.optim.base import check_bool, check_float, invalid, register_rule, state_dtype
from ds_canzona.optim.muon import MuonRule


@dataclass(frozen=True, kw_only=True)
class _NormalisedMuonRule(MuonRule):
    """Muon with a second-moment normalisation of the orthogonalised update (see the module docstring)."""

    second_moment_key: ClassVar[str]

    beta2: float = 0.95
    eps: float = 1e-10

    def __post_init__(self) -> None:
        super().__post_init__()
        check_float(self.kind, "beta2", self.beta2, low=0.0, high=1.0, high_open=True)
        # eps > 0: a row (or element) of O that is exactly zero, e.g. from a row of gradients that
        # stays zero, has a zero second moment and must give a zero update, not 0 / 0.
        check_float(self.kind, "eps", self.eps, low=0.0, low_open=True)
        if self.batch_same_shape:
            # Muon's batched path goes from the momentum straight to the weights; the
            # normalisation would need a batched path of its own, and its result is not
            # bit-identical to the per-matrix one anyway (docs/OPTIMIZERS.md).
            raise invalid(self.kind, "batch_same_shape", True, "not supported for this kind (use 'muon')")

    def _second_moment_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        raise NotImplementedError

    def init_state(self, param: Tensor) -> dict[str, Tensor]:
        state = super().init_state(param)
        state[self.second_moment_key] = torch.zeros(self._second_moment_shape(tuple(param.shape)),
                                                    dtype=state_dtype(param), device=param.device)
        return state

    def _to_orthogonalize(self, u: Tensor) -> Tensor:
        """The matrix handed to Newton-Schulz (AdaMuon may take its sign)."""
        return u

    def _normalise_(self, ortho: Tensor, state: dict[str, Tensor]) -> Tensor:
        """Advance the second moment from ``ortho`` (count, rows, cols); return ortho / (sqrt(moment) + eps)."""
        raise NotImplementedError

    def _rescale(self, normalised: Tensor, ortho: Tensor) -> Tensor:
        """``normalised`` scaled per matrix to the Frobenius norm that ``lr_scaling`` asks for."""
        _, rows, cols = ortho.shape
        norms = normalised.square().sum(dim=(-2, -1), keepdim=True).sqrt()
        if self.lr_scaling == "original":
            target = ortho.square().sum(dim=(-2, -1), keepdim=True).sqrt()
            return normalised * (target / (norms + self.eps))
        return normalised * (math.sqrt(min(rows, cols)) / (norms + self.eps))

    def cost_options(self) -> dict[str, Any]:
        return {**super().cost_options(), "lr_scaling": self.lr_scaling}

    def _update_one(self, param: Tensor, grad: Tensor, state: dict[str, Tensor], lr: float) -> None:
        u = self._momentum_(grad, state)
        # The iteration may run in half precision (ns_dtype); the statistics are kept in the state's.
        # Contiguous: a lone matrix comes back from Newton-Schulz transposed when it is tall, and the
        # reductions below would then sum it in another order than the same matrix inside a stack,
        # so an expert's update would depend on whether its stack is planned whole or in pieces.
        ortho = self._orthogonalize_matrices(self._to_orthogonalize(u)).to(
            state[self.second_moment_key].dtype).contiguous()
        self._apply_(param, self._rescale(self._normalise_(ortho, state), ortho), lr)


@register_rule
@dataclass(frozen=True, kw_only=True)
class NorMuonRule(_NormalisedMuonRule):
    """NorMuon: Muon with a per-row (per-neuron) second moment (defaults: the NorMuon authors' code)."""

    kind: ClassVar[str] = "normuon"
    second_moment_key: ClassVar[str] = "row_second_moment"

    beta2: float = 0.95
    eps: float = 1e-10

    def _second_moment_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        # One entry per row of every matrix: [rows] for a 2-D tensor (also per-head: its heads'
        # rows in order), [experts, rows] for a 3-D stack, [out] for a 4-D filter.
        return tuple(shape[:2]) if len(shape) == 3 else (shape[0],)

    def _normalise_(self, ortho: Tensor, state: dict[str, Tensor]) -> Tensor:
        count, rows, _ = ortho.shape
        moment = state[self.second_moment_key].view(count, rows, 1)
        moment.lerp_(ortho.square().mean(dim=-1, keepdim=True), 1.0 - self.beta2)
        return ortho / (moment.sqrt() + self.eps)


@register_rule
@dataclass(frozen=True, kw_only=True)
class AdaMuonRule(_NormalisedMuonRule):
    """AdaMuon: Muon with an element-wise second moment (defaults: the AdaMuon authors' code and paper)."""

    kind: ClassVar[str] = "adamuon"
    second_moment_key: ClassVar[str] = "second_moment"

    beta2: float = 0.999
    eps: float = 1e-8
    sign_momentum: bool = True
    lr_scaling: str = "match_rms_adamw"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_bool(self.kind, "sign_momentum", self.sign_momentum)

    def _second_moment_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(shape)

    def cost_options(self) -> dict[str, Any]:
        return {**super().cost_options(), "sign_momentum": self.sign_momentum}

    def _to_orthogonalize(self, u: Tensor) -> Tensor:
        return torch.sign(u) if self.sign_momentum else u

    def _normalise_(self, ortho: Tensor, state: dict[str, Tensor]) -> Tensor:
        moment = state[self.second_moment_key].view(ortho.shape)
        moment.lerp_(ortho.square(), 1.0 - self.beta2)
        return ortho / (moment.sqrt() + self.eps)


__all__ = ["NorMuonRule", "AdaMuonRule"]
