"""Counting what every system does, the same way for all of them, inside one rank.

:class:`CollectiveMeter` wraps the collectives of ``deepspeed.comm`` (which DeepSpeed's ZeRO,
its engine and ds_canzona all call through the module attribute), and records per kind the
calls and the bytes. Only the outermost call counts, so a wrapper such as ``reduce_scatter_fn``
that calls ``reduce_scatter_tensor`` is one call.

Bytes, per call:

- ``input``: what this rank hands in (the local shard for an all-gather);
- ``payload``: the whole logical buffer of the collective (the reduced tensor of an all-reduce or a
  reduce, the full input of a reduce-scatter, the full output of an all-gather, the broadcast
  tensor), which is what an uneven or padded collective really moves;
- ``wire``: an estimate of the bytes each rank sends on a ring: 2(R-1)/R of the payload for an
  all-reduce, (R-1)/R for a reduce-scatter, an all-gather, a reduce and an all-to-all, and the
  payload for a broadcast. This is where an all-reduce costs twice a reduce-scatter.

:class:`NewtonSchulzMeter` counts orthogonalisations: calls of DeepSpeed's ``muon_update`` (one
Newton-Schulz run per matrix; ZeRO-1/2 call it once per matrix a rank touches) and of
ds_canzona's ``orthogonalize`` (a batched call counts its batch).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["CollectiveMeter", "NewtonSchulzMeter", "force_deepspeed_ns_dtype"]


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(item) for item in value)
    return 0


def _arg(args: tuple, kwargs: dict, index: int, *names: str) -> Any:
    if len(args) > index:
        return args[index]
    for name in names:
        if name in kwargs:
            return kwargs[name]
    return None


# name -> (kind, payload(args, kwargs), input(args, kwargs), wire factor(R))
_RING = lambda r: (r - 1) / r  # noqa: E731
_COLLECTIVES: dict[str, tuple[str, Callable, Callable, Callable[[int], float]]] = {
    "all_reduce": ("all_reduce", lambda a, k: _nbytes(_arg(a, k, 0, "tensor")),
                   lambda a, k: _nbytes(_arg(a, k, 0, "tensor")), lambda r: 2 * (r - 1) / r),
    "inference_all_reduce": ("all_reduce", lambda a, k: _nbytes(_arg(a, k, 0, "tensor")),
                             lambda a, k: _nbytes(_arg(a, k, 0, "tensor")), lambda r: 2 * (r - 1) / r),
    "all_reduce_coalesced": ("all_reduce", lambda a, k: _nbytes(_arg(a, k, 0, "tensors")),
                             lambda a, k: _nbytes(_arg(a, k, 0, "tensors")), lambda r: 2 * (r - 1) / r),
    "reduce": ("reduce", lambda a, k: _nbytes(_arg(a, k, 0, "tensor")),
               lambda a, k: _nbytes(_arg(a, k, 0, "tensor")), _RING),
    "reduce_scatter": ("reduce_scatter", lambda a, k: _nbytes(_arg(a, k, 1, "input_list")),
                       lambda a, k: _nbytes(_arg(a, k, 1, "input_list")), _RING),
    "reduce_scatter_tensor": ("reduce_scatter", lambda a, k: _nbytes(_arg(a, k, 1, "tensor", "input_tensor")),
                              lambda a, k: _nbytes(_arg(a, k, 1, "tensor", "input_tensor")), _RING),
    "reduce_scatter_fn": ("reduce_scatter", lambda a, k: _nbytes(_arg(a, k, 1, "tensor")),
                          lambda a, k: _nbytes(_arg(a, k, 1, "tensor")), _RING),
    "all_gather": ("all_gather", lambda a, k: _nbytes(_arg(a, k, 0, "tensor_list")),
                   lambda a, k: _nbytes(_arg(a, k, 1, "tensor")), _RING),
    "all_gather_into_tensor": ("all_gather", lambda a, k: _nbytes(_arg(a, k, 0, "output_tensor")),
                               lambda a, k: _nbytes(_arg(a, k, 1, "tensor", "input_tensor")), _RING),
    "allgather_fn": ("all_gather", lambda a, k: _nbytes(_arg(a, k, 0, "output_tensor")),
                     lambda a, k: _nbytes(_arg(a, k, 1, "input_tensor")), _RING),
    "all_gather_coalesced": ("all_gather", lambda a, k: _nbytes(_arg(a, k, 0, "output_tensors")),
                             lambda a, k: _nbytes(_arg(a, k, 1, "input_tensors")), _RING),
    "broadcast": ("broadcast", lambda a, k: _nbytes(_arg(a, k, 0, "tensor")),
                  lambda a, k: _nbytes(_arg(a, k, 0, "tensor")), lambda r: 1.0),
    "all_to_all_single": ("all_to_all", lambda a, k: _nbytes(_arg(a, k, 1, "tensor", "input")),
                          lambda a, k: _nbytes(_arg(a, k, 1, "tensor", "input")), _RING),
}


@dataclass
class CollectiveMeter:
    """Calls and bytes per collective kind, counted while ``active``."""

    world_size: int
    active: bool = False
    calls: Counter = field(default_factory=Counter)
    payload: Counter = field(default_factory=Counter)
    input: Counter = field(default_factory=Counter)
    wire: Counter = field(default_factory=Counter)
    _originals: dict[str, Callable] = field(default_factory=dict)
    _local: threading.local = field(default_factory=threading.local)

    def install(self) -> CollectiveMeter:
        import deepspeed.comm as dist

        for name, (kind, payload, given, factor) in _COLLECTIVES.items():
            original = getattr(dist, name, None)
            if original is None or name in self._originals:
                continue
            self._originals[name] = original
            setattr(dist, name, self._wrap(original, kind, payload, given, factor(self.world_size)))
        return self

    def uninstall(self) -> None:
        import deepspeed.comm as dist

        for name, original in self._originals.items():
            setattr(dist, name, original)
        self._originals.clear()

    def _wrap(self, original: Callable, kind: str, payload: Callable, given: Callable, factor: float) -> Callable:
        meter = self

        def counted(*args: Any, **kwargs: Any) -> Any:
            depth = getattr(meter._local, "depth", 0)
            if meter.active and depth == 0:
                size = payload(args, kwargs)
                meter.calls[kind] += 1
                meter.payload[kind] += size
                meter.input[kind] += given(args, kwargs)
                meter.wire[kind] += int(round(size * factor))
            meter._local.depth = depth + 1
            try:
                return original(*args, **kwargs)
            finally:
                meter._local.depth = depth

        counted.__name__ = getattr(original, "__name__", kind)
        return counted

    def reset(self) -> None:
        for counter in (self.calls, self.payload, self.input, self.wire):
            counter.clear()

    def snapshot(self) -> dict[str, dict[str, int]]:
        return {"calls": dict(self.calls), "payload": dict(self.payload), "input": dict(self.input),
                "wire": dict(self.wire)}


@dataclass
class NewtonSchulzMeter:
    """Newton-Schulz runs on this rank: DeepSpeed's ``muon_update`` and ds_canzona's ``orthogonalize``."""

    runs: int = 0
    _restore: list[tuple[Any, str, Any]] = field(default_factory=list)

    def install(self) -> NewtonSchulzMeter:
        from ds_canzona.optim import muon as canzona_muon

        def count_ours(original: Callable) -> Callable:
            def orthogonalize(g: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
                self.runs += 1 if g.dim() == 2 else int(torch.Size(g.shape[:-2]).numel())
                return original(g, *args, **kwargs)
            return orthogonalize

        self._patch(canzona_muon, "orthogonalize", count_ours)
        try:
            from deepspeed.runtime.zero.muon import original_muon
        except ImportError:  # a DeepSpeed without Muon: nothing of it to count
            return self

        def count_deepspeed(original: Callable) -> Callable:
            def muon_update(grad: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
                heads = kwargs.get("num_heads")
                expert = kwargs.get("is_expert_group", False)
                self.runs += int(heads) if heads else (grad.shape[0] if expert and grad.dim() == 3 else 1)
                return original(grad, *args, **kwargs)
            return muon_update

        self._patch(original_muon, "muon_update", count_deepspeed)
        return self

    def _patch(self, module: Any, name: str, wrap: Callable[[Callable], Callable]) -> None:
        original = getattr(module, name)
        self._restore.append((module, name, original))
        setattr(module, name, wrap(original))

    def uninstall(self) -> None:
        for module, name, original in reversed(self._restore):
            setattr(module, name, original)
        self._restore.clear()


def force_deepspeed_ns_dtype(dtype: torch.dtype = torch.float32) -> None:
    """Make DeepSpeed's Newton-Schulz compute in ``dtype``, as ds_canzona does on the CPU.

    DeepSpeed picks fp16 for the Gram iteration wherever the accelerator reports fp16 support,
    which its CPU accelerator does on CPUs with AVX512-FP16/AMX (oneDNN), and bf16 for the
    standard one; ds_canzona keeps fp32 on the CPU. The benchmark compares distribution, not
    precision, so both run fp32.
    """
    from deepspeed.runtime.zero.muon import original_muon

    original_muon.ns_compute_dtype = lambda ns_method="gram": dtype
