"""Per-tensor optimizer math (no process groups) and single-process optimizers built on it.

The distributed runtime and the single-process optimizers share one path::

    rule = rule_for_group(group)                    # group['kind']: 'muon', 'normuon', 'adamuon', 'shampoo', 'soap', 'adamw'
    state = rule.init_state(param)                  # fp32 state of one whole tensor
    rule.update_(params, grads, states, lr=group['lr'])
    rule.cost(shape, model='flops')                 # the planner's cost model for this kind

Importing this package registers the six kinds.
"""

from ds_canzona.optim.adamw import AdamWRule
from ds_canzona.optim.adaptive_muon import AdaMuonRule, NorMuonRule
from ds_canzona.optim.base import MATRIX_KINDS, TensorRule, is_matrix, known_kinds, register_rule, rule_for_group
from ds_canzona.optim.muon import MuonRule
from ds_canzona.optim.newton_schulz import COEFFICIENT_SETS, orthogonalize
from ds_canzona.optim.shampoo import ShampooRule
from ds_canzona.optim.single_process import SOAP, AdaMuon, AdamW, Muon, NorMuon, RuleOptimizer, Shampoo
from ds_canzona.optim.soap import SOAPRule

__all__ = [
    "MATRIX_KINDS",
    "TensorRule",
    "rule_for_group",
    "register_rule",
    "known_kinds",
    "is_matrix",
    "MuonRule",
    "NorMuonRule",
    "AdaMuonRule",
    "ShampooRule",
    "SOAPRule",
    "AdamWRule",
    "Muon",
    "NorMuon",
    "AdaMuon",
    "Shampoo",
    "SOAP",
    "AdamW",
    "RuleOptimizer",
    "orthogonalize",
    "COEFFICIENT_SETS",
]
