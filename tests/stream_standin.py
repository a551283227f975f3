"""A stand-in accelerator whose streams are real in a model, and a checker of the order they give.

DeepSpeed's CPU accelerator reports a synchronised device: every stream, event and wait is a
no-op there, so no ordering mistake can show on the CPU. ``StreamModel`` installs, in one process,
an accelerator that says its streams are real (``is_synchronized_device()`` false) and models what
CUDA and NCCL would do, while the tensors stay on the CPU:

- a *timeline* is a stream or one collective; each keeps a vector clock of what is ordered before
  its next operation. A stream orders its own operations; ``wait_stream``, ``wait_event`` after
  ``Event.record`` and host syncs (``synchronize``, a value read by the host such as ``.item()``)
  order across streams, and nothing else does;
- every torch operation (seen by a ``TorchDispatchMode``) is an access on the current stream: it
  reads its tensor arguments and writes its mutable arguments and its fresh outputs;
- every collective of ``torch.distributed`` (which deepspeed.comm calls) is a timeline of its own
  that starts after the work queued on the stream that issued it, reads its inputs and writes its
  outputs (NCCL's semantics). Its result is visible on a stream T only once T waited for it:
  ``work.wait()`` called while T is current (a synchronous collective waits on the issuing
  stream), or a wait_stream/event chain from such a stream. The process group underneath is
  torch's fake one (``tests/fake_world.py``): no collective runs, and outputs get stand-in
  values (zeros, or the input for an all-gather) so the run stays finite;
- accesses are tracked per tensor storage (byte ranges of it), and every conflicting pair
  (write/read, read/write, write/write on another timeline) must be ordered: otherwise a
  *race* is recorded with both sites;
- a storage freed while a timeline other than the stream it was allocated on may still be using
  it is recorded too, unless that use is ordered before the allocating stream's current point or
  before the current point of a stream it was ``record_stream``-ed to (CUDA's caching allocator
  hands the memory out again after exactly that);
- ``work.wait()`` inside backward (a graph task running) while a compute stream (the default
  stream, or a stream made by ``compute_stream``) is current is recorded: it would make backward's
  compute wait for communication.
- host memory (what ``ds_canzona.zero.offload.host_empty`` allocates, page-locked or not) has a
  timeline of its own, the host's: an operation on host tensors only is host compute, ordered
  after what the host synchronised with; a ``copy_`` between host and device memory runs on the
  current stream and, unless it is ``non_blocking`` from or to page-locked memory, the host
  waits for it (CUDA copies through pageable memory synchronously). So a host read of what an
  asynchronous copy wrote is a race unless the host synchronised with its stream (or an event
  after it). Freed host memory is not checked: torch's pinned-memory allocator keeps a block
  until the copies that used it are done.

``StreamModel.violations`` lists what was found, one line each, with the places in the code.
"""

from __future__ import annotations

import functools
import sys
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from ds_canzona.bench.standins.stand_in_outputs import fill_all_gather, fill_all_gather_into_tensor, fill_broadcast, \
    fill_reduce_scatter, is_root, tensors_in

__all__ = ["StreamModel", "install_stream_model"]


# --------------------------------------------------------------------------- timelines and clocks
class Timeline:
    """A stream or a collective: its operations in order, and the vector clock of what precedes the next one."""

    def __init__(self, name: str, *, kind: str, compute: bool = False) -> None:
        self.name = name
        self.kind = kind  # "stream", "collective" or "host"
        self.compute = compute
        self.count = 0
        self.clock: dict[Timeline, int] = {}

    def tick(self) -> int:
        self.count += 1
        self.clock[self] = self.count
        return self.count

    def snapshot(self) -> dict:
        return dict(self.clock)

    def join(self, clock: dict) -> None:
        for timeline, index in clock.items():
            if self.clock.get(timeline, 0) < index:
                self.clock[timeline] = index

    def knows(self, timeline: Timeline, index: int) -> bool:
        """Whether operation ``index`` of ``timeline`` is ordered before this timeline's next one."""
        return self.clock.get(timeline, 0) >= index

    def __repr__(self) -> str:
        return self.name


@dataclass
class _Access:
    start: int
    stop: int
    write: bool
    timeline: Timeline
    index: int
    op: str
    site: str


@dataclass
class _Storage:
    pointer: int
    weak: StorageWeakRef
    allocated_on: Timeline
    label: str
    history: list[_Access] = field(default_factory=list)
    recorded: set = field(default_factory=set)  # streams given by record_stream
    shared: bool = False  # used by a timeline other than the allocating stream


def _site() -> str:
    """Where the current operation comes from: the innermost ds_canzona frame, else DeepSpeed's, else the test's."""
    frame = sys._getframe(2)
    deepspeed = test = None
    while frame is not None:
        name = frame.f_code.co_filename
        where = f"{frame.f_lineno} ({frame.f_code.co_name})"
        if "/ds_canzona/" in name:
            return f"{name[name.index('/ds_canzona/') + 1:]}:{where}"
        if deepspeed is None and "/deepspeed/" in name:
            deepspeed = f"{name[name.index('/deepspeed/') + 1:]}:{where}"
        if test is None and "/tests/" in name and not name.endswith("stream_standin.py"):
            test = f"{name[name.index('/tests/') + 1:]}:{where}"
        frame = frame.f_back
    return deepspeed or test or "?"


# --------------------------------------------------------------------------- the stand-in streams and events
class StandInStream:
    """What ``get_accelerator().Stream()`` returns: a timeline of the model."""

    def __init__(self, model: StreamModel, name: str, *, compute: bool = False) -> None:
        self.model = model
        self.timeline = Timeline(name, kind="stream", compute=compute)

    def wait_stream(self, other: StandInStream) -> None:
        self.model.note("wait_stream", self, other)
        self.timeline.join(other.timeline.snapshot())

    def wait_event(self, event: StandInEvent) -> None:
        self.model.note("wait_event", self, event)
        self.timeline.join(event.clock)

    def record_event(self, event: StandInEvent | None = None) -> StandInEvent:
        event = event if event is not None else StandInEvent(self.model)
        event.record(self)
        return event

    def synchronize(self) -> None:
        self.model.note("synchronize", self)
        self.model.host_sync(self.timeline.snapshot())

    def query(self) -> bool:
        return False  # the host learns nothing without a sync

    def __repr__(self) -> str:
        return f"<stream {self.timeline.name}>"


class StandInEvent:
    """What ``get_accelerator().Event()`` returns."""

    def __init__(self, model: StreamModel, **_) -> None:
        self.model = model
        self.clock: dict = {}

    def record(self, stream: StandInStream | None = None) -> None:
        stream = stream if stream is not None else self.model.current_stream()
        self.model.note("record", stream, self)
        self.clock = stream.timeline.snapshot()

    def wait(self, stream: StandInStream | None = None) -> None:
        (stream if stream is not None else self.model.current_stream()).wait_event(self)

    def synchronize(self) -> None:
        self.model.note("event.synchronize", self)
        self.model.host_sync(self.clock)

    def query(self) -> bool:
        return False

    def elapsed_time(self, other) -> float:
        return 0.0


class StandInWork:
    """The handle of an asynchronous collective: ``wait`` orders the current stream after it."""

    def __init__(self, model: StreamModel, timeline: Timeline, site: str) -> None:
        self.model = model
        self.timeline = timeline
        self.site = site

    def wait(self, timeout=None) -> bool:
        self.model.work_wait(self)
        return True

    def is_completed(self) -> bool:
        return False


# --------------------------------------------------------------------------- collectives
def _bind(function, args, kwargs) -> dict:
    import inspect
    bound = inspect.signature(function).bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def _all_reduce_fill(a) -> None:
    # As if every rank held the same tensor (DeepSpeed checks a TP group's inputs agree this way).
    if a["op"] == torch.distributed.ReduceOp.SUM and torch.distributed.is_initialized():
        a["tensor"].mul_(torch.distributed.get_world_size(group=a["group"]))


# name -> (tensors read, tensors written, output values); each of an argument dict
_COLLECTIVES = {
    "all_reduce": (lambda a: [a["tensor"]], lambda a: [a["tensor"]], _all_reduce_fill),
    "all_reduce_coalesced": (lambda a: tensors_in(a["tensors"]), lambda a: tensors_in(a["tensors"]), None),
    "reduce": (lambda a: [a["tensor"]], lambda a: [a["tensor"]] if is_root(a, "dst") else [], None),
    "broadcast": (lambda a: [a["tensor"]] if is_root(a, "src") else [],
                  lambda a: [] if is_root(a, "src") else [a["tensor"]],
                  fill_broadcast),
    "reduce_scatter": (lambda a: tensors_in(a["input_list"]), lambda a: [a["output"]], fill_reduce_scatter),
    "reduce_scatter_tensor": (lambda a: [a["input"]], lambda a: [a["output"]], lambda a: a["output"].zero_()),
    "all_gather": (lambda a: [a["tensor"]], lambda a: tensors_in(a["tensor_list"]), fill_all_gather),
    "all_gather_into_tensor": (lambda a: [a["input_tensor"]], lambda a: [a["output_tensor"]], fill_all_gather_into_tensor),
    "all_to_all_single": (lambda a: [a["input"]], lambda a: [a["output"]], lambda a: a["output"].zero_()),
    "all_to_all": (lambda a: tensors_in(a["input_tensor_list"]), lambda a: tensors_in(a["output_tensor_list"]),
                   lambda a: [t.zero_() for t in a["output_tensor_list"]]),
}
# Same semantics under another name (DeepSpeed's fallbacks for older torch).
# DeepSpeed's backend keeps references to some of them from before the model was installed, and those
# call the single-tensor forms.
_ALIASES = {"_all_gather_base": "all_gather_into_tensor", "_reduce_scatter_base": "reduce_scatter_tensor",
            "all_gather_single": "all_gather_into_tensor", "reduce_scatter_single": "reduce_scatter_tensor"}


# --------------------------------------------------------------------------- the model
class StreamModel:
    """The device model and checker; see the module docstring. Install it with ``install_stream_model``."""

    def __init__(self) -> None:
        self.default = StandInStream(self, "default (compute)", compute=True)
        self._current: list[StandInStream] = []
        self.host = Timeline("host", kind="host")
        self._storages: dict[int, _Storage] = {}
        self._shared: list[_Storage] = []
        self.violations: list[str] = []
        self._seen: set = set()
        self.collectives: Counter = Counter()  # issued, by kind and issuing stream
        self.events: Counter = Counter()  # stream API calls by kind
        self.suspended = 0
        self._timelines: list[Timeline] = [self.default.timeline]  # every stream and collective, for a device sync
        self._host_memory: dict[int, tuple[StorageWeakRef, bool]] = {}  # storage pointer: (storage, page-locked)

    # ------------------------------------------------------------------ streams
    def current_stream(self) -> StandInStream:
        return self._current[-1] if self._current else self.default

    def new_stream(self, name: str | None = None, *, compute: bool = False) -> StandInStream:
        count = sum(t.kind == "stream" for t in self._timelines)
        stream = StandInStream(self, name or f"stream {count}", compute=compute)
        self._timelines.append(stream.timeline)
        return stream

    def compute_stream(self, name: str) -> StandInStream:
        """A stream backward compute runs on (torch.compile's side streams): waits there are violations too."""
        return self.new_stream(name, compute=True)

    @contextmanager
    def gradient_from(self, stream: StandInStream, param: torch.Tensor):
        """Run the block (a gradient hook) as if ``param.grad`` had been produced on ``stream``.

        What torch.compile does in backward on a GPU: the op producing the gradient runs on a side
        stream, after the work it depends on, and autograd runs the parameter's hooks on that stream.
        """
        stream.wait_stream(self.current_stream())
        with self.suspend():
            grad = param.grad.clone()
        self.access(self._issue_point(stream), grad, write=True, op="backward op on a side stream", site="(compiled)",
                    fresh=True)
        param.grad = grad
        del grad
        with self.on_stream(stream):
            yield

    @contextmanager
    def on_stream(self, stream: StandInStream | None):
        if stream is None:
            yield
            return
        self._current.append(stream)
        try:
            yield
        finally:
            self._current.pop()

    def note(self, what: str, *_) -> None:
        self.poll()
        self.events[what] += 1

    def host_sync(self, clock: dict) -> None:
        self.host.join(clock)

    def _issue_point(self, stream: StandInStream) -> Timeline:
        """The stream, ordered after everything the host has synchronised with (the host issues after it)."""
        timeline = stream.timeline
        timeline.join(self.host.clock)
        return timeline

    @contextmanager
    def suspend(self):
        self.suspended += 1
        try:
            yield
        finally:
            self.suspended -= 1

    # ------------------------------------------------------------------ host memory
    def register_host(self, tensor: torch.Tensor, *, pinned: bool) -> None:
        """``tensor``'s storage is host memory (page-locked or not), allocated by the host: no earlier use."""
        storage = tensor.untyped_storage()
        self._host_memory[storage.data_ptr()] = (StorageWeakRef(storage), pinned)
        record = self._record(tensor, self.host, "host allocation", _site(), fresh=True)
        record.history.clear()
        record.allocated_on = self.host

    def host_memory(self, tensor: torch.Tensor) -> str | None:
        """"pinned", "pageable", or None (device memory) for ``tensor``'s storage."""
        if tensor.numel() == 0:
            return None
        entry = self._host_memory.get(tensor.untyped_storage().data_ptr())
        if entry is None or entry[0].expired():
            return None
        return "pinned" if entry[1] else "pageable"

    # ------------------------------------------------------------------ findings
    def violation(self, kind: str, message: str, key) -> None:
        if (kind, key) in self._seen:
            return
        self._seen.add((kind, key))
        self.violations.append(f"{kind}: {message}")

    # ------------------------------------------------------------------ storages
    def _record(self, tensor: torch.Tensor, timeline: Timeline | None, op: str, site: str, *, fresh: bool) -> _Storage:
        storage = tensor.untyped_storage()
        pointer = storage.data_ptr()
        record = self._storages.get(pointer)
        if record is not None and not record.weak.expired():
            return record  # the same storage, even where an operation hands it out as new
        record = _Storage(pointer=pointer, weak=StorageWeakRef(storage), allocated_on=timeline or self.default.timeline,
                          label=f"{tensor.dtype}[{storage.nbytes() // tensor.element_size()}] from {op} at {site}"
                          if fresh else f"{tensor.dtype}[{storage.nbytes() // tensor.element_size()}] "
                          f"(first used by {op} at {site})")
        self._storages[pointer] = record
        return record

    def access(self, timeline: Timeline, tensor: torch.Tensor, *, write: bool, op: str, site: str,
               fresh: bool = False) -> None:
        if tensor.numel() == 0 or tensor.untyped_storage().nbytes() == 0:
            return
        record = self._record(tensor, timeline if fresh else None, op, site, fresh=fresh)
        size = tensor.element_size()
        start = tensor.storage_offset() * size
        span = 1 + sum((n - 1) * abs(s) for n, s in zip(tensor.shape, tensor.stride()))
        stop = start + span * size
        index = timeline.tick() if timeline.kind in ("stream", "host") else timeline.count
        for earlier in record.history:
            if earlier.timeline is timeline or earlier.stop <= start or stop <= earlier.start:
                continue
            if not (write or earlier.write) or timeline.knows(earlier.timeline, earlier.index):
                continue
            what = "writes" if write else "reads"
            did = "wrote" if earlier.write else "read"
            self.violation("race", f"{op} on {timeline} {what} {record.label} bytes [{start}, {stop}) at {site}, which "
                           f"{earlier.op} on {earlier.timeline} {did} at {earlier.site}, with no wait between",
                           (op, site, earlier.op, earlier.site))
        if write:
            record.history = [e for e in record.history if not (start <= e.start and e.stop <= stop)]
        else:
            record.history = [e for e in record.history
                              if not (e.timeline is timeline and not e.write and start <= e.start and e.stop <= stop)]
        record.history.append(_Access(start, stop, write, timeline, index, op, site))
        if timeline is not record.allocated_on and not record.shared:
            record.shared = True
            self._shared.append(record)

    def record_stream(self, tensor: torch.Tensor, stream: StandInStream) -> None:
        self.poll()
        self.events["record_stream"] += 1
        if tensor.numel() == 0:
            return
        record = self._record(tensor, None, "record_stream", _site(), fresh=False)
        record.recorded.add(stream.timeline)
        if not record.shared:
            record.shared = True
            self._shared.append(record)

    def poll(self) -> None:
        """Check the storages freed since the last event: CUDA's allocator would hand their memory out now."""
        if not self._shared:
            return
        alive = []
        for record in self._shared:
            if not record.weak.expired():
                alive.append(record)
                continue
            owner = record.allocated_on
            if owner is self.host:  # torch's host allocator waits for the copies itself
                if self._storages.get(record.pointer) is record:
                    del self._storages[record.pointer]
                continue
            for use in record.history:
                if use.timeline is owner or owner.knows(use.timeline, use.index):
                    continue
                if any(stream.knows(use.timeline, use.index) for stream in record.recorded):
                    continue
                self.violation("freed while in use", f"{record.label} was freed (its memory back to {owner}) while "
                               f"{use.op} on {use.timeline} at {use.site} was not ordered before {owner} or a stream "
                               "it was record_stream-ed to", (record.label, use.op, use.site))
            if self._storages.get(record.pointer) is record:
                del self._storages[record.pointer]
        self._shared = alive

    # ------------------------------------------------------------------ collectives
    def collective(self, name: str, arguments: dict, async_op: bool):
        self.poll()
        reads, writes, fill = _COLLECTIVES[name]
        site = _site()
        stream = self.current_stream()
        issuer = self._issue_point(stream)
        self.collectives[(name, stream.timeline.name)] += 1
        work = Timeline(f"{name}#{sum(self.collectives.values())}", kind="collective")
        self._timelines.append(work)
        work.join(issuer.snapshot())
        work.tick()
        for tensor in reads(arguments):
            self.access(work, tensor, write=False, op=name, site=site)
        for tensor in writes(arguments):
            self.access(work, tensor, write=True, op=name, site=site)
        if fill is not None:
            with self.suspend(), torch.no_grad():
                fill(arguments)
        handle = StandInWork(self, work, site)
        if not async_op:  # NCCL: the issuing stream waits for a synchronous collective
            issuer.join(work.snapshot())
            return None
        return handle

    def work_wait(self, handle: StandInWork) -> None:
        self.poll()
        self.events["work.wait"] += 1
        stream = self.current_stream()
        if stream.timeline.compute and torch._C._current_graph_task_id() != -1:
            site = _site()
            self.violation("compute waits in backward", f"work.wait() of {handle.timeline} (issued at {handle.site}) "
                           f"at {site}, inside backward with {stream.timeline} current: backward's compute waits "
                           "for the collective", (site, handle.site))
        self._issue_point(stream).join(handle.timeline.snapshot())


# --------------------------------------------------------------------------- the torch operations
# Factories whose tensor argument is read for its shape and dtype only, never its data.
_SHAPE_ONLY = frozenset({"empty_like", "zeros_like", "ones_like", "full_like", "new_empty", "new_empty_strided",
                         "new_zeros", "new_ones", "new_full"})


class _AccessMode(TorchDispatchMode):
    """Every torch operation as reads and writes on the current stream."""

    def __init__(self, model: StreamModel) -> None:
        super().__init__()
        self.model = model

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        model = self.model
        if model.suspended:
            return func(*args, **kwargs)
        if func.namespace == "c10d":
            raise RuntimeError(f"stream model: collective {func} outside torch.distributed's wrapped functions")
        model.poll()
        out = func(*args, **kwargs)
        schema = func._schema
        written, read = [], []
        for argument, value in zip(schema.arguments, list(args) + [kwargs.get(a.name) for a in
                                                                  schema.arguments[len(args):]]):
            tensors = tensors_in(value)
            if argument.alias_info is not None and argument.alias_info.is_write:
                written += tensors
            else:
                read += tensors
        if func.overloadpacket.__name__ in _SHAPE_ONLY:
            read = []  # the argument gives a shape and dtype (and, on a GPU, a device of the caller's choice)
        inputs = {t.untyped_storage().data_ptr() for t in written + read if t.numel()}
        outputs = tensors_in(out)
        fresh = [t for t in outputs if t.numel() and t.untyped_storage().data_ptr() not in inputs]
        if not written and outputs and not fresh:
            return out  # a view (or an empty result): no data is touched
        site = _site()
        op = str(func.overloadpacket.__name__)
        placed = [model.host_memory(t) for t in written + read]
        if any(placed):
            named = dict(zip((a.name for a in schema.arguments), args), **kwargs)  # copy_'s non_blocking: positional
            return self._host_operation(func, op, site, written, read, fresh, placed, named, out)
        stream = model.current_stream()
        timeline = model._issue_point(stream)
        for tensor in read:
            model.access(timeline, tensor, write=False, op=op, site=site)
        for tensor in written:
            model.access(timeline, tensor, write=True, op=op, site=site)
        for tensor in fresh:
            model.access(timeline, tensor, write=True, op=op, site=site, fresh=True)
        if not outputs and not written:
            # A value for the host (.item(), torch.equal): on a GPU the host waits for the stream.
            model.host_sync(timeline.snapshot())
        return out


    def _host_operation(self, func, op, site, written, read, fresh, placed, kwargs, out):
        """An operation on host memory: a copy to or from the device on the current stream, or host compute."""
        model = self.model
        on_device = [t for t, where in zip(written + read, placed) if where is None]
        if op == "copy_" and on_device:
            timeline = model._issue_point(model.current_stream())
            asynchronous = bool(kwargs.get("non_blocking")) and all(where in (None, "pinned") for where in placed)
        else:  # the host computes (a device tensor read here unordered shows as a race)
            timeline, asynchronous = model.host, True
        for tensor in read:
            model.access(timeline, tensor, write=False, op=op, site=site)
        for tensor in written:
            model.access(timeline, tensor, write=True, op=op, site=site)
        for tensor in fresh:
            if timeline is model.host:
                model.register_host(tensor, pinned=False)  # computed by the host: host memory
            model.access(timeline, tensor, write=True, op=op, site=site, fresh=timeline is not model.host)
        if not asynchronous:
            model.host_sync(timeline.snapshot())  # the host waits for a copy through pageable memory
        return out


# --------------------------------------------------------------------------- installing it
def _stand_in_accelerator(model: StreamModel):
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    class StreamRecordingAccelerator(CPU_Accelerator):
        """DeepSpeed's CPU accelerator, except that its streams are real (in ``model``)."""

        def is_synchronized_device(self):
            return False

        def resolves_data_dependency(self):
            return False

        def handles_memory_backpressure(self):
            return False

        def use_host_timers(self):
            return True

        @property
        def Stream(self):
            def make(*args, **kwargs):
                return model.new_stream()
            return make

        def stream(self, stream):
            return model.on_stream(stream)

        def current_stream(self, device_index=None):
            return model.current_stream()

        def default_stream(self, device_index=None):
            return model.default

        @property
        def Event(self):
            return functools.partial(StandInEvent, model)

        def pin_memory(self, tensor, align_bytes=1):
            with model.suspend():
                pinned = tensor.clone()
            model.register_host(pinned, pinned=True)
            return pinned

        def is_pinned(self, tensor):
            return model.host_memory(tensor) == "pinned"

        def synchronize(self, device_index=None):
            model.note("device synchronize")
            for timeline in model._timelines:  # every stream and every collective issued so far
                model.host_sync(timeline.snapshot())

        def create_op_builder(self, class_name):
            if class_name == "ShareMemCommBuilder":  # its all-reduce waits for ranks that do not exist here
                return None
            return super().create_op_builder(class_name)

    return StreamRecordingAccelerator()


@contextmanager
def install_stream_model():
    """The stand-in accelerator, the wrapped collectives and the access recording, for the block.

    Run inside ``fake_world`` (tests/fake_world.py), in a process of its own.
    """
    import torch.distributed as tdist
    import torch.distributed.distributed_c10d as c10d
    from deepspeed.accelerator import get_accelerator, set_accelerator

    model = StreamModel()
    previous_accelerator = get_accelerator()
    set_accelerator(_stand_in_accelerator(model))
    saved = []

    def patch(owner, name, value):
        saved.append((owner, name, owner.__dict__[name] if name in owner.__dict__ else None))
        setattr(owner, name, value)

    for name in list(_COLLECTIVES) + list(_ALIASES):
        if not hasattr(c10d, name):
            continue
        kind = _ALIASES.get(name, name)
        original = getattr(c10d, name)

        def wrapped(*args, _original=original, _kind=kind, **kwargs):
            arguments = _bind(_original, args, kwargs)
            return model.collective(_kind, arguments, bool(arguments.get("async_op", False)))

        for owner in (tdist, c10d):
            if getattr(owner, name, None) is original:
                patch(owner, name, functools.wraps(original)(wrapped))

    def barrier(*args, **kwargs):
        return None

    def all_gather_object(object_list, obj, group=None):
        object_list[:] = [obj] * len(object_list)

    def broadcast_object_list(object_list, src=None, group=None, device=None, group_src=None):
        return None

    for name, value in (("barrier", barrier), ("all_gather_object", all_gather_object),
                        ("broadcast_object_list", broadcast_object_list)):
        for owner in (tdist, c10d):
            patch(owner, name, value)

    def record_stream(tensor, stream):
        if isinstance(stream, StandInStream):
            model.record_stream(tensor, stream)
        else:
            raise TypeError(f"record_stream with {stream!r}: the stream model knows only its own streams")

    patch(torch.Tensor, "record_stream", record_stream)

    import ds_canzona.zero.offload as offload
    allocate_host = offload.host_empty

    def host_empty(shape, dtype, *, pin):
        with model.suspend():
            host = allocate_host(shape, dtype, pin=False)
        if pin:
            return get_accelerator().pin_memory(host)
        model.register_host(host, pinned=False)
        return host

    patch(offload, "host_empty", host_empty)
    mode = _AccessMode(model)
    try:
        with mode:
            yield model
        model.poll()
    finally:
        for owner, name, value in reversed(saved):
            if value is None:
                delattr(owner, name)  # it was inherited (torch.Tensor.record_stream)
            else:
                setattr(owner, name, value)
        set_accelerator(previous_accelerator)
