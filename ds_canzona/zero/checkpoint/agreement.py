"""The cross-rank agreement that turns a failure on one rank into an error on every rank.

Every step of a save or a load that can fail on one rank (a full disk, a bad file) is followed by
one small all-gather of a few integers per rank, column 0 being "it worked here". Every rank then
raises, or every rank goes on: never one rank waiting in a collective that the others skipped.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from ds_canzona.zero.checkpoint.format import CheckpointError


@dataclass(frozen=True)
class Agreement:
    """The ranks that save or load one checkpoint together: the data-parallel group."""

    rank: int
    world_size: int
    group: Any
    device: torch.device

    def gather(self, values: Iterable[int]) -> torch.Tensor:
        """Every rank's ``values`` as a [world, k] int64 CPU tensor (one all-gather on the group)."""
        mine = torch.tensor([int(v) for v in values], dtype=torch.int64, device=self.device)
        if self.world_size == 1:
            return mine.view(1, -1).cpu()
        import deepspeed.comm as dist

        # The list form: torch deprecates all_gather_into_tensor (a FutureWarning on every call).
        rows = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(rows, mine, group=self.group)
        return torch.stack(rows).cpu()

    def check(self, rows: torch.Tensor, error: BaseException | None, action: str) -> None:
        """Raise on every rank if ``action`` failed on any (column 0 is the success flag)."""
        if error is not None:
            if isinstance(error, CheckpointError):
                raise error
            raise CheckpointError(f"{action} failed on rank {self.rank}: {type(error).__name__}: {error}") from error
        failed = [r for r in range(rows.shape[0]) if int(rows[r, 0]) == 0]
        if failed:
            raise CheckpointError(f"{action} failed on rank(s) {failed}; rank {failed[0]}'s error says why")


def tag_hash(tag: Any) -> int:
    """A tag as a 56-bit integer, to check in one all-gather that every rank passed the same tag."""
    return int.from_bytes(hashlib.sha256(str(tag).encode()).digest()[:7], "little")
