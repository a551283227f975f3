"""The micro-group exchange in one process: TP ranks as threads, an in-memory all_to_all_single.

No process group: ``deepspeed.comm.all_to_all_single`` is replaced by a rendezvous of the rank
threads that moves each rank's send segments into the others' receive buffers, as the collective
does, so the data each host reassembles and each rank writes back is real. Checked against a
reference written from the split alone (the whole matrix built from the slices with
``torch.cat``, never through the exchange's own reassembly): the launch count per step, which
messages share the first launch, that the local work runs while the first gathers travel, and
every written slice bit for bit.
"""

from __future__ import annotations

import threading

import pytest
import torch

from ds_canzona.zero import tp_exchange
from ds_canzona.zero.comm import CommCounter
from ds_canzona.zero.tp_exchange import ExchangedMatrix, MicroGroupExchange
from ds_canzona.zero.tp_layout import TPSplit


class ThreadAllToAll:
    """``all_to_all_single`` among ``tp_size`` threads, one per TP rank; each call also logged per rank."""

    def __init__(self, tp_size: int):
        self.tp_size = tp_size
        self.barrier = threading.Barrier(tp_size, timeout=30)
        self.posted: dict[int, tuple[torch.Tensor, list[int]]] = {}
        self.log: dict[int, list[tuple]] = {r: [] for r in range(tp_size)}
        self.rank_of = threading.local()

    def __call__(self, output, tensor, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        rank = self.rank_of.value
        self.log[rank].append(("all_to_all", list(input_split_sizes)))
        self.posted[rank] = (tensor.clone(), list(input_split_sizes))
        self.barrier.wait()
        position = 0
        for source in range(self.tp_size):
            data, sizes = self.posted[source]
            start = sum(sizes[:rank])
            output[position:position + sizes[rank]].copy_(data[start:start + sizes[rank]])
            position += sizes[rank]
        assert position == output.numel() == sum(output_split_sizes)
        self.barrier.wait()  # every rank has read every post before the next call overwrites it
        return _Done()


class _Done:
    def wait(self):
        return None


def _matrices(groups: int, tp_size: int, seed: int) -> tuple[list[list[ExchangedMatrix]], dict[int, torch.Tensor]]:
    """``groups`` micro-groups of 1-3 matrices each, split along either dim unevenly, hosts rotating."""
    g = torch.Generator().manual_seed(seed)
    plan, full, item = [], {}, 0
    for _ in range(groups):
        members = []
        for _ in range(int(torch.randint(1, 4, (1,), generator=g))):
            shape = (int(torch.randint(3, 9, (1,), generator=g)), int(torch.randint(3, 9, (1,), generator=g)))
            dim = item % 2
            cut = [shape[dim] // tp_size] * tp_size
            cut[0] += shape[dim] - sum(cut)  # uneven: rank 0 holds the remainder
            members.append(ExchangedMatrix(item=item, host=item % tp_size,
                                           split=TPSplit.plain(shape, dim, tuple(cut))))
            full[item] = torch.randn(shape, generator=g, dtype=torch.float32)
            item += 1
        plan.append(members)
    return plan, full


def _update(full: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    return {item: matrix * 3.0 - 1.0 for item, matrix in full.items()}


def _run_ranks(groups: int, tp_size: int, monkeypatch) -> tuple[dict, dict, ThreadAllToAll, list]:
    plan, full = _matrices(groups, tp_size, seed=groups)
    fake = ThreadAllToAll(tp_size)
    monkeypatch.setattr(tp_exchange.dist, "all_to_all_single", fake)
    written = {r: {} for r in range(tp_size)}
    hosted_updates = {r: {} for r in range(tp_size)}
    errors = []

    def rank_main(rank: int) -> None:
        try:
            fake.rank_of.value = rank
            exchange = MicroGroupExchange(plan, tp_rank=rank, tp_size=tp_size, tp_group=None,
                                          counter=CommCounter(), device=torch.device("cpu"))
            slices = {m.item: m.split.slice_of(full[m.item], rank).contiguous() for group in plan for m in group}

            def update(gathered):
                hosted_updates[rank].update(gathered)
                return _update(gathered)

            def write(item, values):
                written[rank][item] = values.clone()

            exchange.run(slices, update, write, local_work=lambda: fake.log[rank].append(("local",)))
        except BaseException as error:  # noqa: BLE001 - reported by the main thread
            errors.append(error)
            fake.barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(tp_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return plan, full, fake, [written, hosted_updates]


@pytest.mark.parametrize("groups, tp_size, launches", [(1, 2, 2), (2, 2, 3), (3, 2, 4), (5, 2, 6), (4, 3, 5)])
def test_exchange_takes_groups_plus_one_launches_and_writes_every_slice_bitwise(groups, tp_size, launches, monkeypatch):
    plan, full, fake, (written, hosted) = _run_ranks(groups, tp_size, monkeypatch)
    expected = _update(full)
    for rank in range(tp_size):
        calls = [event for event in fake.log[rank] if event[0] == "all_to_all"]
        assert len(calls) == launches == MicroGroupExchange.launches_per_step(groups)
        for group in plan:
            for m in group:
                # The reference slice: the split's own narrowing of the updated whole matrix.
                reference = expected[m.item].narrow(m.split.dim, sum(m.split.sizes[:rank]), m.split.sizes[rank])
                assert torch.equal(written[rank][m.item], reference), (rank, m.item)
                if m.host == rank:  # the host saw the whole gradient, assembled from every rank's slice
                    assert torch.equal(hosted[rank][m.item], full[m.item])
        assert set(hosted[rank]) == {m.item for group in plan for m in group if m.host == rank}


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_first_launch_carries_the_first_two_gathers_and_the_local_work_runs_behind_it(groups, monkeypatch):
    plan, full, fake, _ = _run_ranks(groups, 2, monkeypatch)
    for rank in range(2):
        log = fake.log[rank]
        assert log[0][0] == "all_to_all" and log[1] == ("local",), log[:3]
        # What rank `rank` sends each host in the first launch: its slices of both groups' matrices.
        first = [m for group in plan[:2] for m in group]
        sent = [sum(m.split.local_numel(rank) for m in first if m.host == host) for host in range(2)]
        assert log[0][1] == sent
        assert sum(event == ("local",) for event in log) == 1


def test_no_groups_still_runs_the_local_work_and_launches_nothing(monkeypatch):
    plan, full, fake, _ = _run_ranks(0, 2, monkeypatch)
    assert fake.log == {0: [("local",)], 1: [("local",)]}
