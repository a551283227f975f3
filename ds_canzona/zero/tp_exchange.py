"""The micro-group exchange: TP slices of each matrix to its host, the updated matrix back.

Under AutoTP every rank of a TP group holds a slice of each sharded matrix; a matrix optimizer
needs the whole matrix. Canzona's answer (the paper's Algorithm 2, planned by
``ds_canzona.plan.plan_tp_hosts``): each matrix has one host rank in its TP group, and matrices
travel in micro-groups. Per micro-group there are two messages on the TP group, each an
``all_to_all_single`` of its own or sharing one (below):

    gather:   one all_to_all_single: every rank sends, to each host, its slices of the matrices
              that host computes (fp32 gradients); the host reassembles each whole matrix from
              AutoTP's split (``TPSplit``, per sub-parameter for a fused qkv or gate_up), never
              by equal chunks
    scatter:  one all_to_all_single: each host sends every rank its slice of each updated matrix

Split sizes may be zero (a rank past the KV-head count holds an empty slice; a rank that hosts
nothing in a group receives nothing). The exchange is pipelined: the gather of group k+1 is
in flight while group k is computed, and the scatter of group k is completed only after group k+1
has been launched, so on a backend with asynchronous collectives the communication of one group
runs behind the computation of another. Messages that leave at the same moment share one
all_to_all_single, each rank's segment holding them back to back: the gathers of groups 0 and 1
go first, together, and the step's local work (the items that are not TP-sharded) runs while they
travel; after update k the scatter of group k goes with the gather of group k+2. A step is n + 1
launches for n >= 2 groups (2 for one), not 2n, with the same bytes.

Why the first two gathers share a launch. Sent as two launches after the local work (as before),
the first gather was exposed whole and the second rode behind update 0; sent as one launch
before the local work, both ride behind it, and update 0 waits only for what the local work did
not hide of the two. One launch fewer keeps the step within DeepSpeed's launch count under AutoTP
(docs/BENCHMARKS.md, Qwen3-8B at TP 2 x DP 8: 344, DeepSpeed 344). The local work is uneven
across DP ranks (the embedding's owner has the most), so a rank with little of it waits for both
gathers: at most the second gather's bytes more than a schedule launching the two separately
before the local work would, one launch (tens of microseconds on NCCL) fewer.

Streams (CUDA): the exchange runs inside the optimizer step, on the compute stream. An
asynchronous NCCL collective starts after the work queued so far on the stream that issues it
(the slices it sends were written there), and its ``wait()``, called on that same stream before
the received slices are read, orders the stream after it; the send and receive buffers stay
referenced until then. So no stream of its own is needed, and no wait runs in a backward hook
(tests/test_stream_order.py checks the order). On NCCL ``wait()`` does not block the host, so
``wait_seconds`` measures the blocked time on gloo only.

Every rank of the TP group walks the groups in the same order and issues the same collectives,
whatever it hosts.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

import deepspeed.comm as dist

from ds_canzona.zero.comm import CommCounter
from ds_canzona.zero.tp_layout import TPSplit

__all__ = ["ExchangedMatrix", "MicroGroupExchange"]

# Updates the matrices of one micro-group this rank hosts: full gradients by item -> full matrices by item.
HostUpdate = Callable[[dict[int, torch.Tensor]], dict[int, torch.Tensor]]
# Receives this rank's slice of an updated matrix: (item, slice shaped like the local parameter).
SliceWriter = Callable[[int, torch.Tensor], None]


@dataclass(frozen=True)
class ExchangedMatrix:
    """One TP-sharded matrix: its plan item, its host (a TP rank) and how AutoTP split it."""

    item: int
    host: int
    split: TPSplit


@dataclass
class _Message:
    """One direction of one micro-group: this rank's parts for each rank, and what it receives from each."""

    parts: list[list[torch.Tensor]]  # per destination TP rank, in order
    receive_sizes: list[int]  # elements from each source TP rank


@dataclass
class _InFlight:
    """One all_to_all_single carrying one or more messages; ``offsets[i][r]``: where message i from rank r starts."""

    handle: object
    send: torch.Tensor  # kept alive until the collective is done
    receive: torch.Tensor
    offsets: list[list[int]]
    done: bool = False


class MicroGroupExchange:
    """Runs one TP group's micro-groups: ``groups[k]`` lists the matrices of group k, in plan order."""

    def __init__(self, groups: Sequence[Sequence[ExchangedMatrix]], *, tp_rank: int, tp_size: int, tp_group,
                 counter: CommCounter, device: torch.device):
        self.groups = [tuple(group) for group in groups]
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.tp_group = tp_group
        self.counter = counter
        self.device = device
        # Seconds spent blocked in wait() on the exchange's collectives (the part not hidden behind
        # compute); the benchmark reads it (python -m ds_canzona.bench tp-step).
        self.wait_seconds = 0.0

    def _wait(self, flight: _InFlight) -> None:
        if flight.done:  # a launch that carried two messages is waited for once
            return
        start = time.perf_counter()
        flight.handle.wait()
        self.wait_seconds += time.perf_counter() - start
        flight.done = True

    def hosted(self, k: int) -> list[ExchangedMatrix]:
        return [m for m in self.groups[k] if m.host == self.tp_rank]

    @staticmethod
    def launches_per_step(groups: int) -> int:
        """All-to-alls of one step's exchange of ``groups`` micro-groups (``run``): 2 for one, groups + 1 above."""
        return 0 if groups == 0 else 2 if groups == 1 else groups + 1

    # ------------------------------------------------------------------ messages and launches
    def _launch(self, messages: list[_Message]) -> _InFlight:
        """One all_to_all_single of ``messages``, each rank's segment holding them back to back in that order."""
        ranks = range(self.tp_size)
        parts = [part.reshape(-1) for r in ranks for message in messages for part in message.parts[r]]
        send = torch.cat(parts) if parts else torch.empty(0, dtype=torch.float32, device=self.device)
        send_sizes = [sum(part.numel() for message in messages for part in message.parts[r]) for r in ranks]
        receive_sizes = [sum(message.receive_sizes[r] for message in messages) for r in ranks]
        offsets = [[0] * self.tp_size for _ in messages]
        position = 0
        for r in ranks:
            for i, message in enumerate(messages):
                offsets[i][r] = position
                position += message.receive_sizes[r]
        receive = torch.empty(sum(receive_sizes), dtype=torch.float32, device=self.device)
        self.counter.add("all_to_all", send.numel() * send.element_size())
        # Bytes only (not a call of its own): what actually leaves this rank, its own split staying local.
        self.counter.bytes["tp_exchange_sent"] += (send.numel() - send_sizes[self.tp_rank]) * send.element_size()
        handle = dist.all_to_all_single(receive, send, output_split_sizes=receive_sizes, input_split_sizes=send_sizes,
                                        group=self.tp_group, async_op=True)
        return _InFlight(handle=handle, send=send, receive=receive, offsets=offsets)

    def _gather_message(self, k: int, slices: dict[int, torch.Tensor]) -> _Message:
        """This rank's fp32 slices of group k's matrices, to their hosts."""
        me, ranks = self.tp_rank, range(self.tp_size)
        parts = [[slices[m.item] for m in self.groups[k] if m.host == host] for host in ranks]
        hosted = self.hosted(k)
        return _Message(parts=parts, receive_sizes=[sum(m.split.local_numel(r) for m in hosted) for r in ranks])

    def _scatter_message(self, k: int, full: dict[int, torch.Tensor]) -> _Message:
        """Every rank's slice of each matrix this rank hosts in group k."""
        me, ranks = self.tp_rank, range(self.tp_size)
        hosted = self.hosted(k)
        parts = [[m.split.slice_of(full[m.item], rank) for m in hosted] for rank in ranks]
        receive_sizes = [sum(m.split.local_numel(me) for m in self.groups[k] if m.host == host) for host in ranks]
        return _Message(parts=parts, receive_sizes=receive_sizes)

    def launch_gather(self, k: int, slices: dict[int, torch.Tensor]) -> _InFlight:
        """Send this rank's fp32 slices of group k's matrices to their hosts (one all_to_all_single)."""
        return self._launch([self._gather_message(k, slices)])

    def launch_scatter(self, k: int, full: dict[int, torch.Tensor]) -> _InFlight:
        """Send every rank its slice of each matrix this rank hosts in group k (one all_to_all_single)."""
        return self._launch([self._scatter_message(k, full)])

    def finish_gather(self, k: int, flight: _InFlight, message: int = 0) -> dict[int, torch.Tensor]:
        """The whole fp32 matrices this rank hosts in group k, reassembled from every rank's slice."""
        self._wait(flight)
        hosted = self.hosted(k)
        full = {m.item: torch.empty(m.split.logical_shape, dtype=torch.float32, device=self.device) for m in hosted}
        for rank in range(self.tp_size):
            position = flight.offsets[message][rank]
            for m in hosted:
                numel = m.split.local_numel(rank)
                piece = flight.receive[position:position + numel].view(m.split.local_shape(rank))
                m.split.write_slice(full[m.item], rank, piece)
                position += numel
        return full

    def finish_scatter(self, k: int, flight: _InFlight, write: SliceWriter, message: int = 0) -> None:
        self._wait(flight)
        me = self.tp_rank
        for host in range(self.tp_size):
            position = flight.offsets[message][host]
            for m in self.groups[k]:
                if m.host != host:
                    continue
                numel = m.split.local_numel(me)
                write(m.item, flight.receive[position:position + numel].view(m.split.local_shape(me)))
                position += numel

    # ------------------------------------------------------------------ whole passes
    def gather_all(self, slices: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """Every hosted matrix whole (init: the hosts' fp32 masters), group after group."""
        full: dict[int, torch.Tensor] = {}
        for k in range(len(self.groups)):
            full.update(self.finish_gather(k, self.launch_gather(k, slices)))
        return full

    def run(self, slices: dict[int, torch.Tensor], update: HostUpdate, write: SliceWriter,
            local_work: Callable[[], None] | None = None) -> None:
        """One optimizer step of the TP-sharded matrices: gather, update on the hosts, scatter, pipelined.

        Collective order on every rank: gathers 0 and 1 in one launch, then ``local_work`` (the
        rest of the step, which the gathers travel behind), then after each update k one launch
        of scatter k with gather k+2 (while there is one): n groups take n + 1 all-to-alls (2 for
        one group). While group k is reassembled and updated, the gather of group k+1 and the
        scatter of group k-1 are in flight.
        """
        count = len(self.groups)
        if count == 0:
            if local_work is not None:
                local_work()
            return
        first = self._launch([self._gather_message(k, slices) for k in range(min(count, 2))])
        gathering: dict[int, tuple[_InFlight, int]] = {k: (first, k) for k in range(min(count, 2))}
        if local_work is not None:
            local_work()
        scattering: tuple[int, _InFlight] | None = None
        for k in range(count):
            updated = update(self.finish_gather(k, *gathering.pop(k)))
            messages = [self._scatter_message(k, updated)]
            if k + 2 < count:
                messages.append(self._gather_message(k + 2, slices))
            flight = self._launch(messages)
            if k + 2 < count:
                gathering[k + 2] = (flight, 1)
            if scattering is not None:
                self.finish_scatter(*scattering, write)
            scattering = (k, flight)
        self.finish_scatter(*scattering, write)
