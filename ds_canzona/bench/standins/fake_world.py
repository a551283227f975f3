"""One process as rank r of an N-rank world: deepspeed.comm over torch's fake process group.

torch's fake backend (``torch.testing._internal.distributed.fake_pg``) answers ranks, world sizes
and sub-groups like a real world of ``world_size`` ranks, and its collectives do nothing. That is
enough to build DeepSpeed engines and ds_canzona's runtimes at any data-parallel size in one
process, and to count or order what they issue. What a collective would have delivered is not
there, and the fake backend still checks shapes (it rejects ds_canzona's uneven all-gather of a
bucket, the NCCL path it takes on a backend other than gloo): wrap ``torch.distributed``'s
collectives, as ``ds_canzona.bench.standins.collective_log`` and ``tests/stream_standin.py`` do, to record
them and give outputs values.

Use it in a process of its own (``ds_canzona.bench.standins._ranks.run_ranks(fn, 1)``): it sets the
environment DeepSpeed reads, initialises the global process group and leaves DeepSpeed's group
caches filled, which nothing undoes completely.
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager

import torch


@contextmanager
def fake_world(rank: int, world_size: int):
    """deepspeed.comm initialised as ``rank`` of ``world_size`` on the fake backend, for the block."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    # What DeepSpeed's launcher would set; LOCAL_SIZE is the CPU accelerator's device count.
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    torch.distributed.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)

    import deepspeed.comm as dist
    # DeepSpeed's CPU backend builds a shared-memory all-reduce and waits in it for the other
    # ranks' processes, which do not exist here.
    torch_backend = sys.modules["deepspeed.comm.torch"]
    build_shm_op = torch_backend.build_shm_op
    torch_backend.build_shm_op = lambda: None
    try:
        dist.init_distributed(dist_backend="fake", auto_mpi_discovery=False)
        yield
    finally:
        torch_backend.build_shm_op = build_shm_op
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        sys.modules["deepspeed.comm.comm"].cdb = None


__all__ = ["fake_world"]
