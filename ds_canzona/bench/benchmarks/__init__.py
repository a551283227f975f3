"""The benchmark commands of ``python -m ds_canzona.bench``, each printing ds_canzona beside its baselines.

One module per command (``balance`` with ``plan-speed``, ``step``, ``step_offload``, ``tp_step``,
``makespan``, ``memory3`` for ``zero3-memory``, ``collectives``, ``kernels``, ``calibrate``), plus
the pieces only these commands use: the distribution schemes measured against (``baselines``) and
the parts of ``step`` (``step_systems``: the rows and their engine configs, ``step_worker``: the
rank side, ``step_report``: the tables, ``step_zero3``: the ZeRO-3 and memory tables,
``step_ops``: ``step --ops``'s launch counts). They run ranks, fake worlds and meters from
``ds_canzona.bench.standins``; nothing outside the benchmarks imports them except the tests.
"""
