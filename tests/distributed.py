"""Running a function on N gloo ranks on the CPU, for the distributed tests.

Each rank is a fresh spawned process with the environment DeepSpeed's launcher would give it
(RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_SIZE, MASTER_ADDR/PORT), one torch thread (the CI machine has
two cores), and the result of ``fn(rank, world_size, *args)`` saved with torch.save. A rank that
raises fails the whole run with its traceback; a run past ``timeout`` is killed, never left hanging.
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
import traceback

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, outdir: str, fn, args, kwargs) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank), LOCAL_SIZE=str(world_size), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    try:
        result = fn(rank, world_size, *args, **kwargs)
        torch.save(result, os.path.join(outdir, f"rank{rank}.pt"))
    except BaseException:
        with open(os.path.join(outdir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise


def run_ranks(fn, world_size: int, *args, timeout: float = 300.0, **kwargs) -> list:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` processes; the per-rank results."""
    with tempfile.TemporaryDirectory() as outdir:
        context = mp.start_processes(_entry, args=(world_size, free_port(), outdir, fn, args, kwargs), nprocs=world_size,
                                     join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        try:
            while not context.join(timeout=1.0):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"distributed run of {fn.__name__} exceeded {timeout:.0f}s")
        except Exception as error:
            for p in context.processes:
                if p.is_alive():
                    p.kill()
            errors = [open(os.path.join(outdir, f)).read() for f in sorted(os.listdir(outdir)) if f.endswith(".err")]
            raise RuntimeError(f"{error}\n" + "\n".join(errors)) from None
        return [torch.load(os.path.join(outdir, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]
