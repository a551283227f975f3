"""Counting device-to-host synchronisations over a region of code, for the GPU session.

Two independent counters, each used where it can be:

* ``ds_canzona.bench.standins.host_syncs.HostSyncCounter``: a dispatch-mode counter of the ops that read a
  device value on the host (``item``, ``bool``, ``tolist``, ``nonzero``, copies to the CPU, ...), with
  the op and a short Python location per sync. It works on any device. If that module is not
  importable here, ``HOST_COUNTER_AVAILABLE`` is False and its count is None.
* CUDA's own: ``torch.cuda.set_sync_debug_mode("warn")`` makes every synchronising CUDA call
  emit a warning, which is caught and counted with its Python location. CUDA only (None elsewhere).

The timing code calls ``synchronize`` outside the counted regions, so its own waits are not counted.
"""

from __future__ import annotations

import warnings
from collections import Counter
from typing import Any

import torch

try:
    from ds_canzona.bench.standins.host_syncs import HostSyncCounter
except ImportError:  # the counter is another module's; the session still runs without it
    HostSyncCounter = None

__all__ = ["HOST_COUNTER_AVAILABLE", "SyncCount"]

HOST_COUNTER_AVAILABLE = HostSyncCounter is not None
_CUDA_SYNC_WARNING = "synchroniz"  # "called a synchronizing CUDA operation"


class SyncCount:
    """``with SyncCount(cuda=...) as count: ...``; then ``count.host``, ``count.cuda`` (int or None)
    and ``count.sites`` (a Counter of "counter: location" strings)."""

    def __init__(self, *, cuda: bool) -> None:
        self._cuda = cuda and torch.cuda.is_available()
        self._host: Any = None
        self._catcher: Any = None
        self._caught: list[warnings.WarningMessage] = []
        self._previous_mode = 0
        self.host: int | None = None
        self.cuda: int | None = None
        self.sites: Counter[str] = Counter()

    def __enter__(self) -> SyncCount:
        if HOST_COUNTER_AVAILABLE:
            self._host = HostSyncCounter()
            self._host.__enter__()
        if self._cuda:
            self._catcher = warnings.catch_warnings(record=True)
            self._caught = self._catcher.__enter__()
            warnings.simplefilter("always")
            # torch.cuda directly: DeepSpeed's accelerator has no equivalent of the sync debug mode.
            self._previous_mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._cuda:
            torch.cuda.set_sync_debug_mode(self._previous_mode)
            self._catcher.__exit__(*exc)
            syncs = [w for w in self._caught if _CUDA_SYNC_WARNING in str(w.message)]
            self.cuda = len(syncs)
            self.sites.update(f"cuda: {_short(w.filename)}:{w.lineno}" for w in syncs)
            for w in self._caught:  # the region's other warnings, as if nothing had caught them
                if _CUDA_SYNC_WARNING not in str(w.message):
                    warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
        if self._host is not None:
            self._host.__exit__(*exc)
            self.host = int(self._host.count)
            self.sites.update(f"host: {site}" for site in self._host.sites)


def _short(path: str) -> str:
    """The path from the package or library directory on (``ds_canzona/zero/stage12.py``)."""
    for marker in ("ds_canzona/", "kernels/", "deepspeed/", "transformers/", "torch/"):
        index = path.rfind(marker)
        if index >= 0:
            return path[index:]
    return path
