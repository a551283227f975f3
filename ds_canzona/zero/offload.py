"""Optimizer offload: the owner's fp32 masters and optimizer state in host memory.

With ``zero_optimization.offload_optimizer: {"device": "cpu"}`` each owner rank keeps the fp32
master and the optimizer state of the items it owns in host memory (page-locked where the
accelerator can pin: ``get_accelerator().pin_memory``; DeepSpeed's CPU accelerator cannot and
keeps ordinary memory). Ownership is what makes this cheap: a rank holds the state of what it owns
and nothing else, and each matrix still runs its rule once, on its owner.

The step (``OptimizerOffload.update_``), given each owned item's averaged fp32 gradient on the
device:

    matrix items (Muon, Shampoo, SOAP), on the accelerator, in waves of at most half the
    staging budget (``canzona.offload_staging_bytes``):
        host master + state  --copy stream-->  device staging (wave k+1)
        the group's rule on wave k (compute stream)
        the new low-precision values -> the item's parameter view (device to device)
        device staging  --copy stream-->  host master + state (wave k)
    non-matrix items (AdamW), on the host:
        gradient  device -> host, the rule on the host copy (``canzona.offload_host_adam``:
        ds_canzona's AdamW rule, or DeepSpeed's CPU Adam kernel), then only the new
        low-precision values host -> device into the item's parameter view

so the all-gather (ZeRO-1/2) or the owner's shard (ZeRO-3) reads the new values where it always
does. The rules are those of ``ds_canzona.optim`` (``rule_for_group``) called through their
``update_``, whose result for one tensor does not depend on which others share the call: staging
a tensor elsewhere changes where its math runs, not the math.

Double buffering needs concurrent streams (CUDA); on a synchronised device (the CPU accelerator)
the copies run in order and every "device" tensor is one more host tensor. Every byte copied
between host and device is counted (``TransferCounter``), per step and in total.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from deepspeed.accelerator import get_accelerator

from ds_canzona.optim import rule_for_group
from ds_canzona.optim.base import MATRIX_KINDS, is_step_counter
from ds_canzona.zero.owned import OwnedTensor
from ds_canzona.zero.streams import streams_are_real

# canzona.offload_staging_bytes's default: device memory for the matrix items in flight (two waves).
DEFAULT_STAGING_BYTES = 256 * 2**20
HOST_ADAM_CHOICES = ("canzona", "deepspeed_cpu_adam")


@dataclass(frozen=True)
class OffloadSettings:
    """What the config asks of the offload: pinning, the staging budget, the host AdamW."""

    pin_memory: bool = False
    staging_bytes: int = DEFAULT_STAGING_BYTES
    host_adam: str = "canzona"

    def __post_init__(self) -> None:
        if self.staging_bytes <= 0:
            raise ValueError(f"the offload staging budget must be positive, got {self.staging_bytes}")
        if self.host_adam not in HOST_ADAM_CHOICES:
            raise ValueError(f"host_adam must be one of {HOST_ADAM_CHOICES}, got {self.host_adam!r}")


def offload_settings(engine, config) -> OffloadSettings | None:
    """The engine's optimizer offload (``None`` without one); support.py has refused what is not built."""
    if not engine.zero_cpu_offload():
        return None
    offload = engine.zero_offload_optimizer()
    return OffloadSettings(pin_memory=bool(getattr(offload, "pin_memory", False)),
                           staging_bytes=int(config.offload_staging_bytes), host_adam=config.offload_host_adam)


@dataclass(frozen=True)
class OffloadedDeviceMemory:
    """The planner's memory model under offload: what an item pins on its owner's device.

    Only its reduced-gradient segment (the parameters' dtype): the master and the state are in
    host memory, so ``canzona.max_state_bytes_per_rank`` caps these bytes. ``host`` is the
    model without offload, which ``host_bytes`` reads for the rest.
    """

    host: object  # a ds_canzona.plan StateMemory
    name = "device_bytes_offloaded"

    @property
    def label(self) -> str:
        return f"{self.name}({self.host.label})"

    def bytes(self, spec) -> float:
        return float(self.host.param_bytes * spec.numel)

    def host_bytes(self, spec) -> float:
        """An item's host bytes: its fp32 master (at every dtype: the device keeps the parameters) and its state."""
        state = self.host.bytes(spec) - (self.host.master_bytes_per_element + self.host.param_bytes) * spec.numel
        return float(4 * spec.numel + state)


@dataclass
class TransferCounter:
    """Bytes copied host -> device and device -> host: this step's and the total since init."""

    to_device: int = 0
    to_host: int = 0
    total_to_device: int = 0
    total_to_host: int = 0

    def new_step(self) -> None:
        self.to_device = self.to_host = 0

    def add(self, direction: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if direction == "to_device":
            self.to_device += nbytes
            self.total_to_device += nbytes
        else:
            self.to_host += nbytes
            self.total_to_host += nbytes

    @property
    def step_bytes(self) -> int:
        return self.to_device + self.to_host


def host_empty(shape, dtype: torch.dtype, *, pin: bool) -> torch.Tensor:
    """Host memory for the offload, page-locked when ``pin`` (and the accelerator pins).

    Only page-locked memory lets a ``copy_(..., non_blocking=True)`` to or from the device run
    asynchronously; from pageable memory CUDA copies synchronously (the host waits), so with
    ``pin_memory: false`` the double buffering overlaps nothing. Every host tensor of the offload
    comes from here (the stream stand-in of tests/test_stream_order.py tells host from device by it).
    """
    host = torch.empty(shape, dtype=dtype, device="cpu")
    return get_accelerator().pin_memory(host) if pin else host


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


@dataclass
class _Staged:
    """One matrix item's device copies during its wave."""

    owned: OwnedTensor
    grad: torch.Tensor
    master: torch.Tensor
    state: dict = field(default_factory=dict)


class OptimizerOffload:
    """Host placement of the owned items' masters and state, and the streamed owner update.

    ``owned`` are the runtime's items (their ``master`` and ``state`` are moved to the host here,
    in place in each ``OwnedTensor``); ``view_of(item)`` is the item's low-precision parameter
    view on the device (the bucket view at ZeRO-1/2, the shard at ZeRO-3), which the update writes.
    """

    def __init__(self, owned: list[OwnedTensor], view_of: Callable[[int], torch.Tensor], settings: OffloadSettings,
                 *, device: torch.device):
        self.settings = settings
        self.device = device
        self.counter = TransferCounter()
        self._view_of = view_of
        self._accelerator = get_accelerator()
        self._streams = streams_are_real()
        self._copy_stream = self._accelerator.Stream() if self._streams else None
        # True from an offloaded update until the runtime's next write of the views (the publish that
        # follows it), which then has nothing left to do; any other write (a checkpoint load) copies.
        self._views_match_masters = False
        self._cpu_adam = _CPUAdamKernel() if settings.host_adam == "deepspeed_cpu_adam" else None
        for t in owned:
            t.master = self._host_copy(t.master)
            t.state = {key: self._host_copy(value) if _moves(value) else value for key, value in t.state.items()}
        self.host_bytes = sum(_nbytes(t.master) + sum(_nbytes(v) for v in t.state.values() if _moves(v))
                              for t in owned)
        self.largest_matrix_bytes = max((self._staged_bytes(t) for t in owned if _is_matrix(t)), default=0)
        # What the accelerator did with pin_memory (DeepSpeed's CPU accelerator pins nothing).
        self.pinned = bool(owned) and all(self._accelerator.is_pinned(t.master) for t in owned)

    # ------------------------------------------------------------------ placement
    def _host_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host copy of ``tensor`` (never the tensor itself: at fp32 the master was the parameter view)."""
        host = host_empty(tensor.shape, tensor.dtype, pin=self.settings.pin_memory)
        host.copy_(tensor)
        return host

    def _staged_bytes(self, t: OwnedTensor) -> int:
        """Device bytes one matrix item takes while staged: master, gradient, state."""
        return 2 * _nbytes(t.master) + sum(_nbytes(v) for v in t.state.values() if _moves(v))

    def _waves(self, items: list[tuple[OwnedTensor, torch.Tensor]]) -> list[list[tuple[OwnedTensor, torch.Tensor]]]:
        """Consecutive runs of items, each within half the staging budget (two waves are on the device at once).

        An item larger than that goes alone: it must be updated, and the plan log says the
        budget is then exceeded by it.
        """
        limit = self.settings.staging_bytes // 2
        waves: list[list] = []
        used = limit + 1
        for t, g in items:
            size = self._staged_bytes(t)
            if used + size > limit:
                waves.append([])
                used = 0
            waves[-1].append((t, g))
            used += size
        return waves

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def update_(self, owned: list[OwnedTensor], grads: list[torch.Tensor], param_groups: list[dict]) -> None:
        """Every owned item's rule, matrices on the device and the rest on the host; writes each item's view."""
        self.counter.new_step()
        for group in param_groups:
            members = [(t, g) for t, g in zip(owned, grads) if t.group is group]
            if not members:
                continue
            rule = rule_for_group(group)
            if group["kind"] in MATRIX_KINDS:
                self._update_on_device(rule, members, lr=group["lr"])
            else:
                self._update_on_host(rule, group, members)
        if self._streams:
            # The host copies of this step's masters and state are complete before anything reads them.
            self._copy_stream.synchronize()
        self._views_match_masters = True

    def _update_on_device(self, rule, members: list[tuple[OwnedTensor, torch.Tensor]], *, lr: float) -> None:
        waves = self._waves(members)
        staged, copied_in = self._stage_in(waves[0])
        for k in range(len(waves)):
            # Wave k+1's copies are queued before wave k computes, so they overlap it.
            following = self._stage_in(waves[k + 1]) if k + 1 < len(waves) else (None, None)
            if copied_in is not None:
                self._accelerator.current_stream().wait_event(copied_in)
            rule.update_([s.master for s in staged], [s.grad for s in staged], [s.state for s in staged], lr=lr,
                         known_finite=True)  # the norm all-reduce already caught any overflow
            for s in staged:
                self._view_of(s.owned.index).copy_(s.master)  # on the device: no bytes cross
            self._stage_out(staged)
            staged, copied_in = following

    def _stage_in(self, wave: list[tuple[OwnedTensor, torch.Tensor]]) -> tuple[list[_Staged], object]:
        """Device copies of the wave's masters and state, filled on the copy stream where there is one.

        Returns them and the event that marks the copies' end (None on a synchronised device).
        """
        # Allocated on the compute stream, so the caching allocator orders their reuse there.
        staged = [_Staged(owned=t, grad=g, master=torch.empty_like(t.master, device=self.device),
                          state={key: torch.empty_like(v, device=self.device) if _moves(v) else v
                                 for key, v in t.state.items()})
                  for t, g in wave]
        with self._on_copy_stream(after_compute=True):
            for s in staged:
                s.master.copy_(s.owned.master, non_blocking=True)
                self.counter.add("to_device", s.master)
                for key, value in s.state.items():
                    if _moves(value):
                        value.copy_(s.owned.state[key], non_blocking=True)
                        self.counter.add("to_device", value)
            copied_in = None
            if self._streams:
                copied_in = self._accelerator.Event()
                copied_in.record(self._copy_stream)
        return staged, copied_in

    def _stage_out(self, staged: list[_Staged]) -> None:
        """Copy the wave's new masters and state back to the host, behind the compute that wrote them."""
        with self._on_copy_stream(after_compute=True):
            for s in staged:
                s.owned.master.copy_(s.master, non_blocking=True)
                self.counter.add("to_host", s.master)
                for key, value in s.state.items():
                    if not _moves(value):
                        s.owned.state[key] = value
                        continue
                    host = s.owned.state.get(key)
                    if not (torch.is_tensor(host) and host.shape == value.shape and host.dtype == value.dtype):
                        # The rule replaced the tensor with one of another shape: a host tensor of its own.
                        host = host_empty(value.shape, value.dtype, pin=self.settings.pin_memory)
                        s.owned.state[key] = host
                    host.copy_(value, non_blocking=True)
                    self.counter.add("to_host", value)
                if self._streams:
                    # The device copies are freed on the compute stream; their memory waits for these reads.
                    s.master.record_stream(self._copy_stream)
                    for value in s.state.values():
                        if _moves(value):
                            value.record_stream(self._copy_stream)

    def _on_copy_stream(self, *, after_compute: bool):
        if not self._streams:
            return _NoStream()
        if after_compute:
            self._copy_stream.wait_stream(self._accelerator.current_stream())
        return self._accelerator.stream(self._copy_stream)

    def _update_on_host(self, rule, group: dict, members: list[tuple[OwnedTensor, torch.Tensor]]) -> None:
        host_grads = []
        for t, g in members:
            host = host_empty(g.shape, g.dtype, pin=False)
            host.copy_(g)  # synchronous (pageable memory): the host computes on it next
            self.counter.add("to_host", host)
            host_grads.append(host)
        masters, states = [t.master for t, _ in members], [t.state for t, _ in members]
        if self._cpu_adam is not None:
            self._cpu_adam.update_(group, masters, host_grads, states)
        else:
            rule.update_(masters, host_grads, states, lr=group["lr"], known_finite=True)
        for t, _ in members:
            self._write_view(t)

    def _write_view(self, t: OwnedTensor) -> None:
        """The item's new values, rounded to the parameter dtype on the host, copied into its device view."""
        view = self._view_of(t.index)
        low = t.master if t.master.dtype == view.dtype else t.master.to(view.dtype)
        view.copy_(low)
        self.counter.add("to_device", low)

    # ------------------------------------------------------------------ other writers of the masters
    def write_views(self, owned: list[OwnedTensor]) -> None:
        """Make every owned view equal its host master (after a checkpoint load); no-op right after a step."""
        if self._views_match_masters:
            self._views_match_masters = False
            return
        for t in owned:
            self._write_view(t)

    def summary(self) -> str:
        budget = self.settings.staging_bytes
        over = "" if self.largest_matrix_bytes <= budget // 2 else (
            f"; the largest matrix needs {self.largest_matrix_bytes} staging bytes alone, above half the budget")
        adam = "DeepSpeed's CPU Adam" if self._cpu_adam is not None else "ds_canzona's AdamW rule"
        return (f"offload_optimizer cpu: owned fp32 masters and optimizer state in host memory "
                f"({self.host_bytes} bytes on this rank) "
                f"{'pinned' if self.pinned else 'not pinned'}"
                f"{' (pin_memory asked for; this accelerator does not pin)' if self.settings.pin_memory and not self.pinned else ''}"
                f", matrices updated on the device through "
                f"{budget} staging bytes (offload_staging_bytes), non-matrix items on the host by {adam}{over}")


class _NoStream:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _moves(value) -> bool:
    """Whether a state entry travels: tensors do, except the step counters (host tensors by design)."""
    return torch.is_tensor(value) and not is_step_counter(value)


def _is_matrix(t: OwnedTensor) -> bool:
    return t.group["kind"] in MATRIX_KINDS


class _CPUAdamKernel:
    """DeepSpeed's CPU Adam kernel (``DeepSpeedCPUAdam``'s op) on ds_canzona's AdamW state."""

    def __init__(self):
        from deepspeed.ops.op_builder import CPUAdamBuilder

        from ds_canzona.config import CanzonaConfigError

        try:
            self._op = CPUAdamBuilder().load()
        except Exception as error:  # the op builder raises whatever its compiler step raised
            raise CanzonaConfigError(f"canzona.offload_host_adam 'deepspeed_cpu_adam' needs DeepSpeed's cpu_adam op, "
                                     f"which did not build or load here ({type(error).__name__}: {error}); use "
                                     "'canzona' (ds_canzona's AdamW rule on the host)") from None
        self._ids: dict[int, int] = {}

    def update_(self, group: dict, masters, grads, states) -> None:
        rule = rule_for_group(group)
        key = id(group)
        if key not in self._ids:
            self._ids[key] = len(self._ids) + 10_000  # away from the ids DeepSpeedCPUAdam instances take
            self._op.create_adam(self._ids[key], group["lr"], rule.betas[0], rule.betas[1], rule.eps,
                                 rule.weight_decay, rule.adam_w_mode, False)
        beta1, beta2 = rule.betas
        for master, grad, state in zip(masters, grads, states):
            state["step"] += 1
            self._op.adam_update(self._ids[key], int(state["step"].item()), group["lr"], beta1, beta2, rule.eps,
                                 rule.weight_decay, True, master, grad, state["exp_avg"], state["exp_avg_sq"])


__all__ = ["DEFAULT_STAGING_BYTES", "HOST_ADAM_CHOICES", "OffloadSettings", "OffloadedDeviceMemory", "OptimizerOffload",
           "TransferCounter", "host_empty", "offload_settings"]
