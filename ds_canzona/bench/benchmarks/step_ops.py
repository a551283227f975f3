"""``python -m ds_canzona.bench step --ops``: kernel launches and bytes allocated per owned item per step.

Counted, not timed: a ``TorchDispatchMode`` (``LaunchCounter``) sees every aten operation of one
steady-state ``engine.step()`` on each rank. An operation counts as one launch unless it only
makes a view (no kernel), only allocates (``empty``: the allocator, no kernel) or touches the
optimizers' step counters alone (host tensors by design, ``ds_canzona.optim.base.new_step``). A
foreach operation counts once: on a GPU it is one multi-tensor kernel per batch of tensors
(torch fits a few dozen tensors, or a few hundred 64K-element chunks, into one launch), where
the per-tensor form launches once per tensor. Bytes allocated are the storages of the new
tensors operations return (not views, not in place), summed over the step: its temporaries.

The count is split by where it happens: inside the AdamW rule (per owned AdamW item), inside the
matrix rules (per owned matrix), and the rest of the step (gradients, norm, clipping,
publishing: per owned item). ``BEFORE`` holds the same counts of the step as it was before the
step's per-item overhead was removed, measured once with this module on that code (commit in
``BEFORE["commit"]``; the default model at DP=2, docs/BENCHMARKS.md) and printed beside the live
numbers when the setting is the same.
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from ds_canzona.optim.base import is_step_counter

__all__ = ["BEFORE", "LaunchCounter", "ops_table", "count_step_ops"]

aten = torch.ops.aten

# Operations that allocate without a kernel.
_ALLOCATION_ONLY = frozenset({aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default,
                              aten.new_empty.default, aten.new_empty_strided.default})


class LaunchCounter(TorchDispatchMode):
    """Counts launches and allocated bytes of the aten operations run inside it, by phase.

    ``phase`` (a string the caller sets, "step" by default) labels what runs now; ``count`` and
    ``allocated_bytes`` are the totals, ``launches`` and ``allocated`` the per-phase counters.
    """

    def __init__(self) -> None:
        super().__init__()
        self.phase = "step"
        self.launches: Counter = Counter()
        self.allocated: Counter = Counter()

    @property
    def count(self) -> int:
        return sum(self.launches.values())

    @property
    def allocated_bytes(self) -> int:
        return sum(self.allocated.values())

    @contextmanager
    def in_phase(self, phase: str):
        previous, self.phase = self.phase, phase
        try:
            yield
        finally:
            self.phase = previous

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if inputs and all(is_step_counter(t) for t in inputs):
            return out
        if func in _ALLOCATION_ONLY:
            return out
        if func.is_view:
            return out
        self.launches[self.phase] += 1
        held = {t.untyped_storage().data_ptr() for t in inputs}
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in held and t.numel():
                held.add(t.untyped_storage().data_ptr())
                self.allocated[self.phase] += t.untyped_storage().nbytes()
        return out


def count_step_ops(engine) -> dict[str, Any]:
    """Launches and bytes of one ``engine.step()`` on this rank, by phase, and the owned items by kind.

    The caller has run forward and backward; the rules are wrapped for the one step, so launches
    inside them are told apart from the rest of the step.
    """
    from ds_canzona.optim.base import RuleBase

    optimizer = engine.optimizer
    owned = optimizer.owned_tensors()
    items = {"adamw": sum(t.group["kind"] == "adamw" for t in owned),
             "matrix": sum(t.group["kind"] != "adamw" for t in owned)}
    counter = LaunchCounter()
    update = RuleBase.update_

    def counted_update_(rule, *args, **kwargs):
        with counter.in_phase("adamw" if rule.kind == "adamw" else "matrix"):
            return update(rule, *args, **kwargs)

    RuleBase.update_ = counted_update_  # every rule's entry point (none overrides it)
    try:
        with counter:
            engine.step()
    finally:
        RuleBase.update_ = update
    return {"items": items, "launches": dict(counter.launches), "allocated": dict(counter.allocated)}


def _ops_rank_main(rank: int, world_size: int, settings: dict[str, Any]) -> list[dict[str, Any]]:
    """Each system in turn: a few steps, then forward, backward and one counted step."""
    import logging

    import deepspeed
    import ds_canzona  # noqa: F401  (installs the engine hook)

    from .step_systems import SYSTEMS
    from .step_worker import _batch, _build_case, _Case

    for name in ("DeepSpeed", "deepspeed", "ds_canzona"):
        logging.getLogger(name).setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    shape = settings["shape"]
    out = []
    for key in settings["systems"]:
        case = _Case(SYSTEMS[key], settings["optimizer"])
        _build_case(case, settings, world_size)
        if case.unavailable is not None:
            out.append({"system": key, "unavailable": case.unavailable})
            continue
        engine = case.engine
        for step in range(settings["warmup"] + 1):
            tokens = _batch(shape, step, rank)
            engine.backward(engine(input_ids=tokens, labels=tokens).loss)
            if step < settings["warmup"]:
                engine.step()
        out.append({"system": key, **count_step_ops(engine)})
        engine.destroy()
    return out


def measure_ops(*, dp: int, systems: list[str], optimizer: str, shape, bucket_numel: int, ns_method: str,
                warmup: int, timeout: float) -> dict[str, list[dict[str, Any]]]:
    """Per system, this DP size's rows (one per rank) of ``count_step_ops``."""
    from ..standins._ranks import run_ranks

    settings = {"shape": shape, "systems": systems, "optimizer": optimizer, "bucket_numel": bucket_numel,
                "ns_method": ns_method, "warmup": warmup}
    env = {"DS_ACCELERATOR": "cpu", "TRANSFORMERS_VERBOSITY": "error", "DS_CANZONA_KERNELS": "torch",
           "TORCHDYNAMO_DISABLE": "1"}
    per_rank = run_ranks(_ops_rank_main, dp, settings, timeout=timeout, env=env)
    rows: dict[str, list[dict[str, Any]]] = {}
    for rank_rows in per_rank:
        for row in rank_rows:
            if "unavailable" not in row:
                rows.setdefault(row["system"], []).append(row)
    return rows


def summed(rows: dict[str, list[dict[str, Any]]]) -> dict[str, list[dict[str, Any]]]:
    """Each system's rows summed over ranks (one row): what ``BEFORE`` records."""
    out = {}
    for system, ranks in rows.items():
        total = {"items": Counter(), "launches": Counter(), "allocated": Counter()}
        for row in ranks:
            for key in total:
                total[key].update(row[key])
        out[system] = [{key: dict(value) for key, value in total.items()}]
    return out


# The step before its per-item overhead was removed (commit 5ef1695): this module's
# ``measure_ops`` run on that code, default model, DP=2, Muon, warm-up 1, sums over the ranks
# (docs/BENCHMARKS.md, "step --ops").
BEFORE: dict[str, Any] = {'commit': '5ef1695',
                           'dp': 2,
                           'optimizer': 'muon',
                           'model': {'hidden': 256,
                                     'layers': 8,
                                     'intermediate': 1024,
                                     'vocab': 8192,
                                     'heads': 4,
                                     'kv_heads': 1,
                                     'head_dim': 64,
                                     'seq': 128,
                                     'micro_batch': 2},
                           'bucket_numel': 11801856,
                           'systems': {'canzona-z1': [{'items': {'adamw': 35, 'matrix': 56},
                                                       'launches': {'step': 564, 'matrix': 3568, 'adamw': 315},
                                                       'allocated': {'step': 141624488, 'matrix': 697565856,
                                                                     'adamw': 100792320}}],
                                       'canzona-z2': [{'items': {'adamw': 35, 'matrix': 56},
                                                       'launches': {'step': 560, 'matrix': 3568, 'adamw': 315},
                                                       'allocated': {'step': 141624488, 'matrix': 697565856,
                                                                     'adamw': 100792320}}]}}


def _per_item(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Sums over ranks, divided by the owned items of the kind each phase works on."""
    items = Counter()
    launches = Counter()
    allocated = Counter()
    for row in rows:
        items.update(row["items"])
        launches.update(row["launches"])
        allocated.update(row["allocated"])
    total_items = items["adamw"] + items["matrix"]
    out = {"adamw items": items["adamw"], "matrix items": items["matrix"]}
    out["launches per AdamW item (in the rule)"] = launches["adamw"] / max(1, items["adamw"])
    out["launches per matrix (in the rule)"] = launches["matrix"] / max(1, items["matrix"])
    out["launches per item, rest of the step"] = launches["step"] / max(1, total_items)
    out["launches per item, whole step"] = sum(launches.values()) / max(1, total_items)
    out["KiB allocated per AdamW item (in the rule)"] = allocated["adamw"] / 1024 / max(1, items["adamw"])
    out["KiB allocated per item, rest of the step"] = allocated["step"] / 1024 / max(1, total_items)
    return out


def ops_table(after: dict[str, list[dict[str, Any]]], before: dict[str, Any] | None = None) -> str:
    """One table per system: before (recorded) and after (this run), per owned item per step."""
    before_rows = (before or {}).get("systems", {})
    lines = []
    for system, rows in after.items():
        now = _per_item(rows)
        then = _per_item(before_rows[system]) if system in before_rows else {}
        lines += [f"{system}:", "", "| per owned item, one steady-state step | before | after | after / before |",
                  "|---|---:|---:|---:|"]
        for key, value in now.items():
            old = then.get(key)
            ratio = f"{value / old:.2f}" if old else "-"
            lines.append(f"| {key} | {_cell(old)} | {_cell(value)} | {ratio} |")
        lines.append("")
    return "\n".join(lines)


def _cell(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.0f}" if float(value).is_integer() else f"{value:.1f}"
