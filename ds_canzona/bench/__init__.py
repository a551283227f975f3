"""Benchmarks, run as ``python -m ds_canzona.bench <command>``; see ``__main__`` for the list."""
