"""The plain-torch references, gathered (kept for imports written before the per-family modules).

Each reference lives beside its kernel: ``syrk.py``, ``newton_schulz.py``, ``shampoo.py``.
"""

from ds_canzona.kernels import xxt_reference
from ds_canzona.kernels.newton_schulz import ns_step_reference
from ds_canzona.kernels.shampoo import (
    coupled_newton_step_reference,
    inverse_root_newton_reference,
    sym_stat_update_reference,
)
from ds_canzona.kernels.syrk import syrk_reference

__all__ = [
    "coupled_newton_step_reference",
    "inverse_root_newton_reference",
    "ns_step_reference",
    "sym_stat_update_reference",
    "syrk_reference",
    "xxt_reference",
]
