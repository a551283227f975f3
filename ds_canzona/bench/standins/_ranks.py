"""Running a benchmark function on N gloo ranks of this machine.

Each rank is a fresh process with the environment DeepSpeed's launcher would give it
(RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_SIZE, MASTER_ADDR/PORT), one torch thread per rank, plus any
``env`` the caller adds (set before the child imports torch, so switches read at import time, such
as ``TORCHDYNAMO_DISABLE``, take effect). ``fn(rank, world_size, *args)`` runs in each; its return
value comes back through a file. A rank that raises fails the run with its traceback and leaves
with exit code 1 (never a native abort at exit); a run past ``timeout`` is killed, never left
hanging.

Ranks start from a fork server that has imported torch, DeepSpeed and transformers once (importing
them costs each spawned rank seconds, most of a short test's time on a two-core machine); the
caller's environment and umask are copied into each rank when it starts. A run with ``env``
spawns fresh interpreters instead, because such switches must be set before torch is imported.

DeepSpeed's CPU accelerator maps a shared-memory all-reduce buffer per rank
(``/dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>``, about 66 MiB) and never
unlinks it; every run here removes its own afterwards, or repeated runs fill /dev/shm (RAM).
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["free_port", "remove_shm_buffers", "run_ranks"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def remove_shm_buffers(addr: str, port: int, world_size: int) -> None:
    """Unlink the shared-memory all-reduce buffers DeepSpeed's CPU accelerator left for this run."""
    uid = os.getuid() if hasattr(os, "getuid") else 0
    for rank in range(world_size):
        try:
            os.unlink(f"/dev/shm/deepspeed_allreduce_buffer_{uid}_{addr}_{port}_{rank}")
        except OSError:
            pass


def _entry(rank: int, world_size: int, port: int, outdir: str, threads: int, fn: Callable[..., Any],
           args: tuple[Any, ...], kwargs: Mapping[str, Any], environ: Mapping[str, str] | None = None,
           umask: int | None = None) -> None:
    import torch

    if environ is not None:
        # A forked rank has the fork server's environment and umask: give it the caller's, as a spawn would.
        os.environ.clear()
        os.environ.update(environ)
    if umask is not None:
        os.umask(umask)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank), LOCAL_SIZE=str(world_size))
    torch.set_num_threads(threads)
    try:
        result = fn(rank, world_size, *args, **kwargs)
        torch.save(result, os.path.join(outdir, f"rank{rank}.pt"))
    except BaseException:
        with open(os.path.join(outdir, f"rank{rank}.err"), "w", encoding="utf-8") as handle:
            handle.write(traceback.format_exc())
        # Leave without interpreter finalisation: it would destroy a live gloo group, whose
        # threads can abort the process ("terminate called without an active exception"), and
        # destroying the group here could wait on a peer that is still in a collective. The
        # parent reads the traceback from the file and kills the other ranks.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    # The group goes before the interpreter does, for the same reason.
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


# Imported once by the fork server, before it forks any rank. It imports, computes nothing, so it
# holds no thread (OpenMP, gloo) that a fork would leave broken.
_FORK_SERVER_PRELOAD = ["torch", "deepspeed", "ds_canzona.zero", "transformers"]


def _preload_fork_server() -> None:
    import multiprocessing

    multiprocessing.get_context("forkserver").set_forkserver_preload(_FORK_SERVER_PRELOAD)


class RankCrashed(RuntimeError):
    """A rank died from a signal (abort, segfault) without raising a Python exception."""


# Native crashes retried once: a rank that raises a Python exception, times out, or is killed on
# purpose (SIGKILL) is never retried.
_RETRIED_SIGNALS = ("SIGABRT", "SIGSEGV")


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 1800.0, threads: int = 1,
              env: Mapping[str, str] | None = None, **kwargs: Any) -> list[Any]:
    """``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` spawned processes; the per-rank results.

    A run in which a rank dies from SIGABRT or SIGSEGV without a Python exception is run once
    more, on a fresh port, with a warning on stderr: on this CPU setup such crashes have come
    from the environment (DeepSpeed's shared-memory comm op, gloo start-up), about once in
    hundreds of runs. A crash that repeats fails.
    """
    try:
        return _run_once(fn, world_size, args, kwargs, timeout=timeout, threads=threads, env=env)
    except RankCrashed as crash:
        print(f"warning: {crash}; running {fn.__name__} once more", file=sys.stderr, flush=True)
        return _run_once(fn, world_size, args, kwargs, timeout=timeout, threads=threads, env=env)


def _run_once(fn: Callable[..., Any], world_size: int, args: tuple[Any, ...], kwargs: Mapping[str, Any], *,
              timeout: float, threads: int, env: Mapping[str, str] | None) -> list[Any]:
    import torch
    import torch.multiprocessing as mp

    # Children inherit the environment at spawn time; set it here and restore it afterwards.
    overrides = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), **dict(env or {})}
    saved = {key: os.environ.get(key) for key in overrides}
    os.environ.update(overrides)
    port = free_port()
    try:
        with tempfile.TemporaryDirectory() as outdir:
            if env:
                start_method, environ, umask = "spawn", None, None
            else:
                start_method, environ = "forkserver", dict(os.environ)
                umask = os.umask(0o022)  # the only way to read it: set, then put back
                os.umask(umask)
                _preload_fork_server()
            context = mp.start_processes(_entry, args=(world_size, port, outdir, threads, fn, args, kwargs, environ, umask),
                                         nprocs=world_size, join=False, start_method=start_method)
            deadline = time.monotonic() + timeout
            try:
                while not context.join(timeout=1.0):
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"distributed run of {fn.__name__} exceeded {timeout:.0f}s")
            except Exception as error:
                for process in context.processes:
                    if process.is_alive():
                        process.kill()
                errors = [open(os.path.join(outdir, name), encoding="utf-8").read()
                          for name in sorted(os.listdir(outdir)) if name.endswith(".err")]
                if not errors and getattr(error, "signal_name", None) in _RETRIED_SIGNALS:
                    raise RankCrashed(str(error)) from None
                raise RuntimeError(f"{error}\n" + "\n".join(errors)) from None
            return [torch.load(os.path.join(outdir, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]
    finally:
        remove_shm_buffers("127.0.0.1", port, world_size)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
