"""Matrix kernels for the per-tensor optimizers (installed as ``ds_canzona.kernels``).

Every operation here has a plain-torch reference beside it. Until the Triton kernels land,
the public functions are the references.
"""

from ds_canzona.kernels.reference import ns_step_reference, sym_stat_update_reference, xxt_reference

xxt = xxt_reference
ns_step = ns_step_reference
sym_stat_update_ = sym_stat_update_reference

__all__ = ["xxt", "ns_step", "sym_stat_update_", "xxt_reference", "ns_step_reference", "sym_stat_update_reference"]
