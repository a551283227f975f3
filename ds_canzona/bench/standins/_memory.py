"""Memory per rank on the CPU: what an engine holds between steps, and the peak of one step.

Every system of ``bench step`` lives in the same rank processes at once, so process-wide numbers
(RSS, the allocator's total) cannot tell them apart. Two measurements that can:

**Held between steps** (:func:`held_bytes`): every tensor storage reachable from the engine
object, each storage counted once at its full size (a view into a flat buffer counts the whole
buffer once), sorted into four categories, first match wins:

- ``parameters``: the storages of the module's parameters, their ZeRO-3 partitions
  (``ds_tensor``, ``ds_secondary_tensor``) and whatever flat buffer those are views of; under
  ZeRO-3 a parameter gathered for good (below DeepSpeed's persistence threshold) counts whole;
- ``gradients``: the parameters' ``.grad`` and every tensor whose shortest path from the
  optimizer passes an attribute or key whose name says gradient (``grad``, ``ipg``: DeepSpeed's
  bucket buffers and gradient partitions, ds_canzona's gradient buckets and segments);
- ``optimizer``: everything else reachable from ``engine.optimizer``: optimizer state, fp32
  master copies, staging copies and communication caches it keeps between steps;
- ``other``: everything else reachable from the engine (module buffers such as rotary tables).

The walk follows instance attributes, containers, tensors' own attributes and closures, never
module globals, classes or other engines, so it sees what the engine keeps alive, not what the
process does.

**The peak of a step** (:func:`measure_step_memory`): the torch profiler with
``profile_memory=True`` reports every CPU allocation and free of torch storage, with its size.
Two consecutive steps run under it; the second is measured: its running sum of allocations minus
frees, from the step's start, peaks at the step's extra bytes, and held + extra is the step's
peak. The first step is there so that a storage allocated in one step and freed in the next is
seen at both ends (the profiler cannot size a free of a block allocated before it started). Only
a storage that outlived a whole step and is freed during the measured one is missed, which makes
the peak an upper bound; ``held_after`` against ``held`` + ``step_net`` shows whether that
happened. Activations, the loss and the step's temporaries are all in the peak; memory outside
torch's allocator (gloo's own buffers, DeepSpeed's shared-memory all-reduce buffer) is in neither
number.
"""

from __future__ import annotations

import re
import types
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["MEMORY_CATEGORIES", "held_bytes", "measure_step_memory"]

MEMORY_CATEGORIES = ("parameters", "gradients", "optimizer", "other")
_GRADIENT_NAME = re.compile(r"grad|ipg", re.IGNORECASE)
_SKIPPED_TYPES = (types.ModuleType, type, types.BuiltinFunctionType, types.CodeType, types.FrameType,
                  str, bytes, int, float, complex, bool, type(None))
_MEASURED_RANGE = "ds_canzona.bench: measured step"


def _children(obj: Any, follow_grad: bool) -> Iterator[tuple[str, Any]]:
    """(name, child) pairs the walk follows from ``obj``: the name is what a gradient is recognised by."""
    if isinstance(obj, torch.Tensor):
        gradient = obj._grad  # not .grad, which warns on non-leaf tensors
        if follow_grad and gradient is not None:
            yield "grad", gradient
        yield from vars(obj).items()  # DeepSpeed's ds_tensor, ds_secondary_tensor, ...
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield (key if isinstance(key, str) else ""), value
            if isinstance(key, torch.Tensor):  # an optimizer's state is keyed by its tensors
                yield "", key
    elif isinstance(obj, (list, tuple, set, frozenset)) or type(obj).__name__ == "deque":
        for item in obj:
            yield "", item
    elif isinstance(obj, types.FunctionType):
        for cell in obj.__closure__ or ():
            try:
                yield "", cell.cell_contents
            except ValueError:  # an empty cell
                pass
    elif isinstance(obj, types.MethodType):
        yield "", obj.__self__
        yield "", obj.__func__
    else:
        attributes = getattr(obj, "__dict__", None)
        if isinstance(attributes, dict):
            yield from attributes.items()
        for name in getattr(type(obj), "__slots__", ()):
            if isinstance(name, str) and hasattr(obj, name):
                yield name, getattr(obj, name)


def _walk(roots: list[tuple[Any, bool]], stop: Callable[[Any], bool], *,
          follow_grad: bool = True) -> dict[tuple[str, int], tuple[int, bool]]:
    """Storages reachable from ``roots``: (device, address) -> (bytes, reached under a gradient name).

    Breadth first, each object once: a storage takes the mark of its shortest path from the
    roots. (Any-path marking would not do: DeepSpeed keeps its gradient hooks under a gradient
    name, and their closures lead back to the whole optimizer.)
    """
    found: dict[tuple[str, int], tuple[int, bool]] = {}
    seen: set[int] = set()
    queue = deque(roots)
    while queue:
        obj, marked = queue.popleft()
        if isinstance(obj, _SKIPPED_TYPES) or id(obj) in seen or stop(obj):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor) and obj.device.type != "meta":
            storage = obj.untyped_storage()
            if storage.nbytes() > 0:
                found.setdefault((obj.device.type, storage.data_ptr()), (storage.nbytes(), marked))
        for name, child in _children(obj, follow_grad):
            queue.append((child, marked or bool(_GRADIENT_NAME.search(name))))
    return found


def held_bytes(engine) -> dict[str, int]:
    """Bytes of the tensor storages ``engine`` keeps alive, per category (module docstring), and their total."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    def other_engine(obj: Any) -> bool:
        return isinstance(obj, DeepSpeedEngine) and obj is not engine

    params = list(engine.module.parameters())
    parameter_tensors = [t for p in params for t in (p, getattr(p, "ds_tensor", None),
                                                       getattr(p, "ds_secondary_tensor", None)) if t is not None]
    parameters = _walk([(t, False) for t in parameter_tensors], lambda obj: not isinstance(obj, torch.Tensor),
                       follow_grad=False)
    # The optimizer's own tensors are not inside modules, and whatever leads back to the engine
    # (a hook's closure) is the engine's, not the optimizer's.
    optimizer = _walk([(p._grad, True) for p in params if p._grad is not None] + [(engine.optimizer, False)],
                      lambda obj: isinstance(obj, (DeepSpeedEngine, torch.nn.Module)))
    everything = _walk([(engine, False)], other_engine)
    out = dict.fromkeys(MEMORY_CATEGORIES, 0)
    assigned: set[tuple[str, int]] = set()
    for found, category in ((parameters, "parameters"), (optimizer, None), (everything, "other")):
        for key, (size, marked) in found.items():
            if key not in assigned:
                out[category or ("gradients" if marked else "optimizer")] += size
                assigned.add(key)
    out["total"] = sum(out[c] for c in MEMORY_CATEGORIES)
    return out


def measure_step_memory(engine, run_step: Callable[[int], None]) -> dict[str, int]:
    """Held bytes between two steps and the peak of the second (module docstring).

    ``run_step(k)`` runs training step k (0: the primer, 1: the measured one), forward, backward
    and optimizer step. Returns the held categories before the measured step, ``held_after`` (the
    total after it), ``step_extra`` (the most bytes the measured step had allocated beyond what
    it started with), ``step_peak`` (held total + step_extra) and ``step_net`` (allocated minus
    freed over the measured step).
    """
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        run_step(0)
        held = held_bytes(engine)
        with record_function(_MEASURED_RANGE):
            run_step(1)
    held_after = held_bytes(engine)["total"]
    events = profiler.profiler.kineto_results.events()
    ranges = [(e.start_ns(), e.end_ns()) for e in events if e.name() == _MEASURED_RANGE]
    if len(ranges) != 1:
        raise RuntimeError(f"expected one profiler range {_MEASURED_RANGE!r}, found {len(ranges)}")
    start, end = ranges[0]
    changes = sorted((e.start_ns(), e.nbytes()) for e in events
                     if e.name() == "[memory]" and str(e.device_type()).endswith("CPU")
                     and start <= e.start_ns() <= end)
    running = extra = 0
    for _, change in changes:
        running += change
        extra = max(extra, running)
    return {**held, "held_after": held_after, "step_extra": extra, "step_peak": held["total"] + extra,
            "step_net": running}
