"""Stand-ins and instruments shared by the benchmarks and the tests: nothing here is a command.

What stands in for a cluster: ``fake_world`` (one process as rank r of an N-rank world, over torch's
fake process group), ``fake_engine`` (DeepSpeed engines under FakeTensorMode), ``collective_log``
(records every collective instead of running it) and ``stand_in_outputs`` (what such a collective
writes into its outputs). What measures from outside: ``_instrument`` (collectives and
Newton-Schulz calls per rank), ``_memory`` (memory per rank), ``host_syncs`` (host
synchronisations), ``offload_bytes`` (DeepSpeed's host-device copies). And ``_ranks``, which runs a
function on N gloo ranks of this machine. These modules import neither ``benchmarks`` nor ``gpu``.
"""
