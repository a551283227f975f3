"""The micro-group exchange: TP slices of each matrix to its host, the updated matrix back.

Under AutoTP every rank of a TP group holds a slice of each sharded matrix; a matrix optimizer
needs the whole matrix. Canzona's answer (the paper's Algorithm 2, planned by
``ds_canzona.plan.plan_tp_hosts``): each matrix has one host rank in its TP group, and matrices
travel in micro-groups. Per micro-group there are exactly two collectives on the TP group:

    gather:   one all_to_all_single: every rank sends, to each host, its slices of the matrices
              that host computes (fp32 gradients); the host reassembles each whole matrix from
              AutoTP's split (``TPSplit``, per sub-parameter for a fused qkv or gate_up), never
              by equal chunks
    scatter:  one all_to_all_single: each host sends every rank its slice of each updated matrix

Split sizes may be zero (a rank past the KV-head count holds an empty slice; a rank that hosts
nothing in a group receives nothing). The exchange is pipelined: the gather of group k+1 is
launched before group k is computed, and the scatter of group k is completed only after group k+1
has been launched, so on a backend with asynchronous collectives the communication of one group
runs behind the computation of another.

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
class _InFlight:
    handle: object
    send: torch.Tensor  # kept alive until the collective is done
    receive: torch.Tensor


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
        start = time.perf_counter()
        flight.handle.wait()
        self.wait_seconds += time.perf_counter() - start

    def hosted(self, k: int) -> list[ExchangedMatrix]:
        return [m for m in self.groups[k] if m.host == self.tp_rank]

    # ------------------------------------------------------------------ one collective each
    def _all_to_all(self, send_parts: list[torch.Tensor], send_sizes: list[int], receive_sizes: list[int]) -> _InFlight:
        send = torch.cat(send_parts) if send_parts else torch.empty(0, dtype=torch.float32, device=self.device)
        receive = torch.empty(sum(receive_sizes), dtype=torch.float32, device=self.device)
        self.counter.add("all_to_all", send.numel() * send.element_size())
        # Bytes only (not a call of its own): what actually leaves this rank, its own split staying local.
        self.counter.bytes["tp_exchange_sent"] += (send.numel() - send_sizes[self.tp_rank]) * send.element_size()
        handle = dist.all_to_all_single(receive, send, output_split_sizes=receive_sizes, input_split_sizes=send_sizes,
                                        group=self.tp_group, async_op=True)
        return _InFlight(handle=handle, send=send, receive=receive)

    def launch_gather(self, k: int, slices: dict[int, torch.Tensor]) -> _InFlight:
        """Send this rank's fp32 slices of group k's matrices to their hosts."""
        me, ranks = self.tp_rank, range(self.tp_size)
        parts, send_sizes = [], []
        for host in ranks:
            to_host = [m for m in self.groups[k] if m.host == host]
            parts += [slices[m.item].reshape(-1) for m in to_host]
            send_sizes.append(sum(m.split.local_numel(me) for m in to_host))
        hosted = self.hosted(k)
        receive_sizes = [sum(m.split.local_numel(r) for m in hosted) for r in ranks]
        return self._all_to_all(parts, send_sizes, receive_sizes)

    def finish_gather(self, k: int, flight: _InFlight) -> dict[int, torch.Tensor]:
        """The whole fp32 matrices this rank hosts in group k, reassembled from every rank's slice."""
        self._wait(flight)
        hosted = self.hosted(k)
        full = {m.item: torch.empty(m.split.logical_shape, dtype=torch.float32, device=self.device) for m in hosted}
        position = 0
        for rank in range(self.tp_size):
            for m in hosted:
                numel = m.split.local_numel(rank)
                piece = flight.receive[position:position + numel].view(m.split.local_shape(rank))
                m.split.write_slice(full[m.item], rank, piece)
                position += numel
        return full

    def launch_scatter(self, k: int, full: dict[int, torch.Tensor]) -> _InFlight:
        """Send every rank its slice of each matrix this rank hosts in group k."""
        me, ranks = self.tp_rank, range(self.tp_size)
        hosted = self.hosted(k)
        parts = [m.split.slice_of(full[m.item], rank).reshape(-1) for rank in ranks for m in hosted]
        send_sizes = [sum(m.split.local_numel(rank) for m in hosted) for rank in ranks]
        receive_sizes = [sum(m.split.local_numel(me) for m in self.groups[k] if m.host == host) for host in ranks]
        return self._all_to_all(parts, send_sizes, receive_sizes)

    def finish_scatter(self, k: int, flight: _InFlight, write: SliceWriter) -> None:
        self._wait(flight)
        me, position = self.tp_rank, 0
        for host in range(self.tp_size):
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

    def run(self, slices: dict[int, torch.Tensor], update: HostUpdate, write: SliceWriter) -> None:
        """One optimizer step of the TP-sharded matrices: gather, update on the hosts, scatter, pipelined.

        Collective order on every rank: gather 0, gather 1, scatter 0, gather 2, scatter 1, ...,
        scatter n-1. While group k is reassembled and updated, the gather of group k+1 and the
        scatter of group k-1 are in flight.
        """
        count = len(self.groups)
        if count == 0:
            return
        gathering = self.launch_gather(0, slices)
        scattering: tuple[int, _InFlight] | None = None
        for k in range(count):
            following = self.launch_gather(k + 1, slices) if k + 1 < count else None
            updated = update(self.finish_gather(k, gathering))
            flight = self.launch_scatter(k, updated)
            if scattering is not None:
                self.finish_scatter(*scattering, write)
            scattering = (k, flight)
            gathering = following
        self.finish_scatter(*scattering, write)
