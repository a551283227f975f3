"""How rank processes end: with exit code 0 or 1, never a native abort at interpreter exit.

A process that reaches interpreter finalisation with a live gloo group can abort
("terminate called without an active exception") after its work is done. run_ranks retries a
run once on such a signal, which would hide it, so these runs go through ``_run_once``, which
never retries: any rank that dies from a signal fails the test.
"""

from __future__ import annotations

import pytest

from ds_canzona.bench.standins._ranks import RankCrashed, _run_once
from zero_workers import init_engine, make_config

from tiny_model import batches

RUNS = 3  # the abort was seen about once in hundreds of runs; each run here is ~3 s


def _train_one_step_then_maybe_raise(rank: int, world_size: int, raise_on_rank: int | None) -> float:
    engine = init_engine(make_config(world_size, stage=2))
    for micro in range(engine.gradient_accumulation_steps()):
        loss = engine(batches(0, micro, rank, world_size))
        engine.backward(loss)
        engine.step()
    if rank == raise_on_rank:
        raise ValueError(f"rank {rank} raises after its step, with its process group live")
    return float(loss)


def test_ranks_that_finish_leave_with_their_group_destroyed_several_times():
    for _ in range(RUNS):
        losses = _run_once(_train_one_step_then_maybe_raise, 2, (None,), {}, timeout=300, threads=1, env=None)
        assert len(losses) == 2 and all(loss == loss for loss in losses)


def test_a_rank_that_raises_fails_the_run_with_its_traceback_not_a_signal():
    for _ in range(RUNS - 1):
        with pytest.raises(RuntimeError) as failure:
            _run_once(_train_one_step_then_maybe_raise, 2, (1,), {}, timeout=300, threads=1, env=None)
        assert not isinstance(failure.value, RankCrashed)
        message = str(failure.value)
        assert "rank 1 raises after its step" in message and "exit code 1" in message
        assert "signal" not in message
