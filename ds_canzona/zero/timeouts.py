"""Bounded waits: the ``canzona.comm_timeout_s`` deadline on the engine's process groups.

A rank that dies (SIGKILL, a lost node) or stops answering (a hung kernel, a frozen process)
would otherwise leave its peers blocked in the next collective for the process group's
timeout: DeepSpeed creates the default group with ``DEEPSPEED_TIMEOUT`` minutes (10 unless set)
and torch gives groups made with ``new_group`` 30 minutes (gloo) or 10 (NCCL).

When the engine builds the ds_canzona optimizer, :func:`apply_comm_timeout` sets
``comm_timeout_s`` as the timeout of every process group ds_canzona communicates over
(:func:`canzona_process_groups`: the default group, the engine's data-parallel groups and,
under AutoTP, the tensor-parallel group), so that every collective ds_canzona runs from then on
(bucket reduce-scatters and all-gathers, the micro-group all-to-alls, the gradient-norm
all-reduce, the checkpoint agreements) raises in the surviving ranks within that many seconds of
a peer going silent:

* gloo raises ``RuntimeError`` from the collective (``Timed out waiting ...ms``); a peer that
  died outright usually closes its sockets and the error comes at once ("Connection closed by
  peer").
* NCCL's watchdog aborts the communicator after the timeout and tears the process down
  (``TORCH_NCCL_ASYNC_ERROR_HANDLING``, on by default).

Collectives that run before the optimizer is built (DeepSpeed's parameter broadcast at engine
start) still use the timeout the process group was created with: pass
``deepspeed.init_distributed(timeout=...)`` or set ``DEEPSPEED_TIMEOUT`` to bound them too.
"""

from __future__ import annotations

import logging
from datetime import timedelta

logger = logging.getLogger("ds_canzona")


def _set_timeout(group, timeout: timedelta) -> bool:
    # deepspeed.comm has no way to change a group's timeout; torch's setter is private but stable
    # since 2.3, and any torch without it keeps the timeout the group was created with.
    try:
        from torch.distributed.distributed_c10d import _set_pg_timeout
    except ImportError:  # torch without the (private) setter: keep the group's own timeout
        return False
    _set_pg_timeout(timeout, group)
    return True


def canzona_process_groups(engine) -> list:
    """Every process group the ds_canzona runtimes of ``engine`` communicate over (None: the default group)."""
    from ds_canzona.zero.support import autotp_size

    candidates = [None, getattr(engine, "data_parallel_group", None), getattr(engine, "seq_data_parallel_group", None)]
    if autotp_size(engine) > 1:  # the micro-groups' all-to-alls and the masters' gather (ds_canzona.zero.tp)
        from deepspeed.utils import groups as deepspeed_groups
        candidates.append(deepspeed_groups.get_tensor_model_parallel_group())
    groups = [None]
    for group in candidates[1:]:
        if group is not None and all(group is not g for g in groups):
            groups.append(group)
    return groups


def apply_comm_timeout(engine, seconds: float) -> None:
    """Give every process group ds_canzona uses (``canzona_process_groups``) a ``seconds`` timeout."""
    import torch.distributed as torch_dist

    if not torch_dist.is_available() or not torch_dist.is_initialized():
        return
    timeout = timedelta(seconds=float(seconds))
    for group in canzona_process_groups(engine):
        if not _set_timeout(group, timeout):
            logger.warning("ds_canzona: this torch cannot change a process group's timeout; canzona.comm_timeout_s "
                           "is not enforced (set DEEPSPEED_TIMEOUT or deepspeed.init_distributed(timeout=...))")
            return
