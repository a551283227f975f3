"""Benchmarks, run as ``python -m ds_canzona.bench <command>``; see ``__main__`` for the list.

The package has three rooms. ``benchmarks/`` holds the commands that measure ds_canzona and print
it side by side with its baselines (``balance``, ``step``, ``makespan``, ``collectives``,
``kernels``, ``calibrate``, ...) and the pieces only they use (the baseline schemes, the step
benchmark's systems, workers and reports). ``gpu/`` holds the prepared GPU session's checks
(``gpu-check``: kernels against float64, engine steps on one device, Newton-Schulz timings, the
sync counter they share). ``standins/`` holds what stands in for a real cluster or measures from
outside, for the benchmarks and the tests alike: the fake world and fake engines, the collective
recorder and its stand-in outputs, the meters and counters (collectives, Newton-Schulz calls,
memory, host syncs, offload copies) and the rank spawner. Imports go one way: ``benchmarks`` and
``gpu`` may import ``standins``; ``standins`` imports neither (tests/test_layering.py checks it).
"""
