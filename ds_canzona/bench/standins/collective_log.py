"""Recording every collective a process issues, as NCCL would launch it, instead of running it.

:class:`CollectiveLog` replaces ``torch.distributed``'s collectives (which ``deepspeed.comm``, and so
DeepSpeed's ZeRO and ds_canzona, call) with recorders. Install it before ``deepspeed.comm`` is
initialised (DeepSpeed's torch backend keeps references to some of them from its start), inside
``fake_world`` (torch's fake process group: ranks and groups of a world that does not exist). Nothing
is sent: a recorder writes stand-in values into the outputs so the run goes on with finite numbers
(a reduce-scatter leaves this rank's own slice, an all-gather this rank's input in every slot, a
broadcast receives zeros; fake tensors, which have no values, get none), and returns a finished
work handle.

Per call it records, for a group of P ranks:

- ``launches``: 1, or 0 for a call inside ``torch.distributed``'s coalescing manager after the
  first (the manager issues its calls as one grouped launch);
- ``p2p_ops``: the NCCL operations inside the launch. torch's NCCL process group turns a
  ``reduce_scatter`` whose input list has unequal sizes into one group of P ``ncclReduce`` (one
  rooted at each rank) and an ``all_gather`` with unequal output sizes into P ``ncclBroadcast``;
  with equal sizes either is 1 operation, as is every other collective;
- ``payload``: the bytes of the collective's whole logical buffer (the reduced tensor, the full
  input of a reduce-scatter, the full output of an all-gather, the broadcast tensor);
- ``sent``: bytes each rank sends, averaged over the group, on NCCL's ring algorithms: 2(P-1)/P of
  the payload for an all-reduce, (P-1)/P for a reduce-scatter, an all-gather, a broadcast and a
  reduce (a ring chain: P-1 of the P ranks forward the whole tensor), and the input minus this
  rank's own slice for an all-to-all. A grouped uneven reduce-scatter (P reduces of the P
  segments) sends, in sum, what one ring reduce-scatter of the bucket does; what it costs more is
  P launches of latency, not bytes.

Each call is also labelled with its process group (:meth:`CollectiveLog.label_groups`, a function
of the group; by default "world" for the default group and "P ranks" for any other) and with the
phase the caller set (:attr:`CollectiveLog.phase`), so the collectives of a tensor-parallel group
and of a data-parallel group, or of forward and of the optimizer step, can be told apart. A call
issued from inside DeepSpeed's ZeRO-3 parameter coordinator (its module fetches and prefetches,
whichever runtime's parameters answer them) is marked ``fetch``: the coordinator decides when to
fetch and how much, so those launches are the same for every runtime under one config.

``padding`` is not visible in a call (an equal-size collective cannot tell its padding from its
data): a caller states the bytes of data a block of calls carries with :meth:`CollectiveLog.carrying`,
and the payload beyond it is recorded as padding.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch
from torch._subclasses.fake_tensor import is_fake

from .stand_in_outputs import fill_all_gather, fill_all_gather_into_tensor, fill_broadcast, fill_reduce_scatter, \
    is_root, tensors_in

__all__ = ["CollectiveCall", "CollectiveLog"]


@dataclass(frozen=True)
class CollectiveCall:
    """One recorded collective, as NCCL would launch it."""

    kind: str  # the torch.distributed function, aliases folded ("_all_gather_base" -> "all_gather_into_tensor")
    group_size: int
    launches: int
    p2p_ops: int
    payload: int
    sent: float
    site: str  # the innermost ds_canzona or DeepSpeed frame that issued it
    group: str = "world"  # the process group, as :meth:`CollectiveLog.label_groups` names it
    phase: str = ""  # what the process was doing, as :attr:`CollectiveLog.phase` said ("forward", ...)
    fetch: bool = False  # issued inside DeepSpeed's ZeRO-3 parameter coordinator (a module fetch or prefetch)

    def to_dict(self) -> dict:
        return asdict(self)


def _nbytes(value) -> int:
    return sum(t.numel() * t.element_size() for t in tensors_in(value))


def _all_equal(tensors: list[torch.Tensor]) -> bool:
    return len({t.numel() for t in tensors}) <= 1


def _group_rank(group) -> int:
    return torch.distributed.get_rank(group=group)


# --------------------------------------------------------------------------- stand-in outputs
def _fill_reduce_scatter_tensor(a) -> None:
    output = a["output"]
    a["output"].copy_(a["input"].view(-1)[_group_rank(a["group"]) * output.numel():][:output.numel()].view_as(output))


def _fill_all_to_all(a) -> None:
    for tensor in tensors_in(a.get("output_tensor_list", a.get("output"))):
        tensor.zero_()


# --------------------------------------------------------------------------- what a call is on NCCL
def _ring(p: int) -> float:
    return (p - 1) / p


# name -> (payload(args), whether P rank-rooted operations (args), sent factor(P), stand-in output)
_KINDS: dict[str, tuple[Callable, Callable, Callable[[int], float], Callable | None]] = {
    "all_reduce": (lambda a: _nbytes(a["tensor"]), lambda a: False, lambda p: 2 * _ring(p), None),
    "all_reduce_coalesced": (lambda a: _nbytes(a["tensors"]), lambda a: False, lambda p: 2 * _ring(p), None),
    "reduce": (lambda a: _nbytes(a["tensor"]), lambda a: False, _ring, None),
    "broadcast": (lambda a: _nbytes(a["tensor"]), lambda a: False, _ring, fill_broadcast),
    "reduce_scatter": (lambda a: _nbytes(a["input_list"]), lambda a: not _all_equal(a["input_list"]), _ring,
                       fill_reduce_scatter),
    "reduce_scatter_tensor": (lambda a: _nbytes(a["input"]), lambda a: False, _ring, _fill_reduce_scatter_tensor),
    "all_gather": (lambda a: _nbytes(a["tensor_list"]), lambda a: not _all_equal(a["tensor_list"]), _ring,
                   fill_all_gather),
    "all_gather_into_tensor": (lambda a: _nbytes(a["output_tensor"]), lambda a: False, _ring,
                               fill_all_gather_into_tensor),
    "all_to_all_single": (lambda a: _nbytes(a["input"]), lambda a: False, _ring, _fill_all_to_all),
    "all_to_all": (lambda a: _nbytes(a["input_tensor_list"]), lambda a: False, _ring, _fill_all_to_all),
    "barrier": (lambda a: 0, lambda a: False, lambda p: 0.0, None),
}
_ALIASES = {"_all_gather_base": "all_gather_into_tensor", "_reduce_scatter_base": "reduce_scatter_tensor"}


class _DoneWork:
    """The handle of a collective that has already happened (nothing was sent)."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def get_future(self):
        future = torch.futures.Future()
        future.set_result(None)
        return future


class _DoneGroup(_DoneWork):
    """What torch's coalescing manager yields: the group's handle, with the works it collected (none here)."""

    def __init__(self) -> None:
        self.works: list = []


def _site() -> str:
    frame = sys._getframe(3)
    fallback = None
    while frame is not None:
        name = frame.f_code.co_filename
        where = f"{frame.f_lineno} ({frame.f_code.co_name})"
        if "/ds_canzona/zero/" in name:
            return f"{name[name.index('/ds_canzona/') + 1:]}:{where}"
        if fallback is None and "/deepspeed/" in name and "/deepspeed/comm/" not in name:
            fallback = f"{name[name.index('/deepspeed/') + 1:]}:{where}"
        frame = frame.f_back
    return fallback or "?"


# DeepSpeed's ZeRO-3 parameter coordinator: fetch_sub_module and its prefetches gather from here.
_COORDINATOR_FILE = "/deepspeed/runtime/zero/partitioned_param_coordinator.py"


def _in_parameter_fetch() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename.endswith(_COORDINATOR_FILE):
            return True
        frame = frame.f_back
    return False


def _default_group_label(group) -> str:
    if group is None or group is torch.distributed.group.WORLD:
        return "world"
    return f"{torch.distributed.get_world_size(group=group)} ranks"


class CollectiveLog:
    """Records the collectives issued while :attr:`active`; see the module docstring."""

    def __init__(self) -> None:
        self.calls: list[CollectiveCall] = []
        self.active = False
        self.padding = 0  # payload beyond the data stated by ``carrying`` blocks, while active
        self.carried = 0  # data stated by ``carrying`` blocks, while active
        self._coalescing = 0
        self._coalesced_launched = False
        self._carrying: list[list[int]] = []  # per open block: [stated data, payload recorded in it]
        self._saved: list[tuple[object, str, object]] = []
        self.phase = ""  # labels the calls recorded from now on
        self._group_label: Callable[[object], str] = _default_group_label
        # id(group) -> (group, label), since a label is asked per call; holding the group keeps its id unique
        self._labels: dict[int, tuple[object, str]] = {}

    # ------------------------------------------------------------------ results
    def reset(self) -> None:
        self.calls.clear()
        self.padding = 0
        self.carried = 0

    @contextmanager
    def carrying(self, data_bytes: int) -> Iterator[None]:
        """The calls of this block carry ``data_bytes`` of data: the rest of their payload is padding."""
        block = [int(data_bytes), 0]
        self._carrying.append(block)
        try:
            yield
        finally:
            self._carrying.pop()
            if self.active and block[1]:
                self.carried += block[0]
                self.padding += max(0, block[1] - block[0])

    def label_groups(self, group_label: Callable[[object], str]) -> None:
        """Name the process group of each call recorded from now on with ``group_label(group)``."""
        self._group_label = group_label
        self._labels.clear()

    def label(self, group) -> str:
        key = id(group)
        if key not in self._labels:
            self._labels[key] = (group, self._group_label(group))
        return self._labels[key][1]

    # ------------------------------------------------------------------ installing
    def install(self) -> CollectiveLog:
        import torch.distributed as tdist
        import torch.distributed.distributed_c10d as c10d

        for name in list(_KINDS) + list(_ALIASES):
            original = getattr(c10d, name, None)
            if original is None:
                continue
            recorder = functools.wraps(original)(self._recorder(_ALIASES.get(name, name), original))
            for owner in (tdist, c10d):
                if getattr(owner, name, None) is original:
                    self._patch(owner, name, recorder)

        def all_gather_object(object_list, obj, group=None):
            object_list[:] = [obj] * len(object_list)

        def broadcast_object_list(object_list, src=None, group=None, device=None, group_src=None):
            return None

        for name, value in (("all_gather_object", all_gather_object), ("broadcast_object_list", broadcast_object_list),
                            ("_coalescing_manager", self._coalescing_manager)):
            for owner in (tdist, c10d):
                if hasattr(owner, name):
                    self._patch(owner, name, value)
        return self

    def uninstall(self) -> None:
        for owner, name, value in reversed(self._saved):
            setattr(owner, name, value)
        self._saved.clear()

    def _patch(self, owner, name: str, value) -> None:
        self._saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    @contextmanager
    def _coalescing_manager(self, group=None, device=None, async_ops=False, **_):
        """torch's coalescing manager: the calls inside it go out as one grouped launch."""
        if self._coalescing == 0:
            self._coalesced_launched = False
        self._coalescing += 1
        try:
            yield _DoneGroup()  # torch yields its manager object whether or not the ops are async
        finally:
            self._coalescing -= 1

    def _recorder(self, kind: str, original: Callable) -> Callable:
        payload_of, uneven, factor, fill = _KINDS[kind]
        signature = inspect.signature(original)
        log = self

        def record(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            a = dict(bound.arguments)
            group_size = torch.distributed.get_world_size(group=a.get("group"))
            if log.active:
                payload = payload_of(a)
                launches = 1
                if log._coalescing:
                    launches = 0 if log._coalesced_launched else 1
                    log._coalesced_launched = True
                sent = payload * factor(group_size)
                if kind == "all_to_all_single":
                    sent = payload - _nbytes(a["input"]) / group_size
                log.calls.append(CollectiveCall(kind=kind, group_size=group_size, launches=launches,
                                                p2p_ops=group_size if uneven(a) and group_size > 1 else 1,
                                                payload=payload, sent=sent, site=_site(),
                                                group=log.label(a.get("group")), phase=log.phase,
                                                fetch=_in_parameter_fetch()))
                for block in log._carrying:
                    block[1] += payload
            if fill is not None and group_size > 1 and not any(map(is_fake, tensors_in(list(a.values())))):
                with torch.no_grad():
                    fill(a)
            return _DoneWork() if a.get("async_op") else None

        return record
