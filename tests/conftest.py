"""Session-wide test setup."""

from __future__ import annotations

import glob
import os
import time

import pytest

_SESSION_START = time.time()


def _mapped_shm_paths() -> set[str]:
    """The /dev/shm files some live process still maps (readable for our own processes)."""
    mapped: set[str] = set()
    for maps in glob.glob("/proc/[0-9]*/maps"):
        try:
            with open(maps) as f:
                mapped.update(line.split(None, 5)[-1].strip() for line in f if "/dev/shm/" in line)
        except OSError:
            pass
    return mapped


def pytest_sessionfinish(session, exitstatus):
    """Remove the shared-memory buffers DeepSpeed's CPU accelerator left during this session.

    Every DeepSpeed rank on the CPU maps a ~66 MiB /dev/shm buffer and never unlinks it; the
    spawner removes its own, but launcher-based tests leave theirs. Only files created since
    this session started and mapped by no live process are touched, so a test run going on
    beside this one keeps its buffers.
    """
    uid = os.getuid() if hasattr(os, "getuid") else 0
    in_use = _mapped_shm_paths()
    for path in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_{uid}_*"):
        try:
            if os.stat(path).st_mtime >= _SESSION_START and path not in in_use:
                os.unlink(path)
        except OSError:
            pass


@pytest.fixture
def one_thread():
    """One torch thread, as the spawned ranks run: plain-torch references then block their
    products the same way, so their gradients are the ranks' own numbers."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
