"""Running a function on N gloo ranks on the CPU, for the distributed tests.

The spawner is the benchmarks' (ds_canzona.bench.standins._ranks): each rank is a fresh process with the
environment DeepSpeed's launcher would give it and one torch thread (the CI machine has two
cores); a rank that raises fails the run with its traceback, a run past ``timeout`` is killed,
and DeepSpeed's shared-memory buffers of the run are removed afterwards.
"""

from ds_canzona.bench.standins._ranks import free_port, run_ranks

__all__ = ["free_port", "run_ranks"]
