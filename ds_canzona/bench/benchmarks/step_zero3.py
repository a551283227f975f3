"""The ZeRO-3 rows of ``python -m ds_canzona.bench step``, and memory per rank for every row.

Four systems are set side by side, on the same model, data and engine config:

- DeepSpeed 0.19.8's own ZeRO-3 Muon (``deepspeed-z3``). It refuses ``reduce_scatter: true``, so
  gradients are all-reduced in full; at the step it all-gathers each bucket's gradient and
  momentum partitions, orthogonalises the matrices round-robin over the ranks, and all-gathers
  the results and momentums again (``DeepSpeedZeroOptimizer_Stage3._apply_muon_to_accumulated_grads``);
- ds_canzona at stage 3 (``canzona-z3``): the same config plus the ``canzona`` section. While
  ds_canzona refuses stage 3 (a ``CanzonaConfigError`` inside ``deepspeed.initialize``) the row is
  printed as "not available: <the error>"; once the runtime accepts the config, the row is
  measured like the others, with nothing here to change;
- the same with the embedding and the untied head (AdamW tensors, below the default
  ``canzona.split_numel`` on the benchmark model, so owned whole above) in 8 canonical pieces each,
  each piece on its own owner (``canzona-z3-pieces``): one fetch broadcast and one gradient reduce
  per piece instead of per tensor, for a more even split of those tensors' memory;
- ds_canzona at stage 2 (``canzona-z2``), the runtime's most memory-frugal stage so far.

Memory per rank comes from :mod:`ds_canzona.bench.standins._memory` (held between steps by category, and
the peak of one step) and is printed for every system as max and average over the ranks.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from ..standins._memory import MEMORY_CATEGORIES

__all__ = ["ZERO3_SYSTEMS", "memory_summary", "memory_table", "zero3_checks", "zero3_table"]

# In the order the table prints them; the first is what the ratios divide by.
ZERO3_SYSTEMS = ("deepspeed-z3", "canzona-z3", "canzona-z3-pieces", "canzona-z2")
_MEMORY_FIELDS = (*MEMORY_CATEGORIES, "total", "step_peak", "step_extra", "held_after", "step_net")
_COLLECTIVE_KINDS = ("all_reduce", "reduce", "reduce_scatter", "all_gather", "broadcast")


def memory_summary(per_rank: Sequence[dict[str, int] | None]) -> dict[str, dict[str, Any]] | None:
    """Max, average and per-rank values of each memory field, over the ranks' measurements."""
    if any(m is None for m in per_rank):
        return None
    return {name: {"max": max(m[name] for m in per_rank), "avg": statistics.fmean(m[name] for m in per_rank),
                   "per_rank": [m[name] for m in per_rank]}
            for name in _MEMORY_FIELDS}


def _mb(value: float) -> str:
    return f"{value / 2**20:.1f}"


def _find(results: Sequence[Any], key: str, dp: int, optimizer: str = "muon"):
    return next((r for r in results if r.system == key and r.dp == dp and r.optimizer == optimizer), None)


def _refusal(unavailable: Sequence[dict[str, Any]], key: str, dp: int, optimizer: str = "muon") -> str | None:
    return next((u["error"] for u in unavailable
                 if u["system"] == key and u["dp"] == dp and u["optimizer"] == optimizer), None)


def _ratio(value: float, reference: Any, pick) -> str:
    if reference is None:
        return "-"
    base = pick(reference)
    return f"{value / base:.2f}x" if base else "-"


def zero3_table(results: Sequence[Any], unavailable: Sequence[dict[str, Any]], dp: int,
                labels: dict[str, str]) -> str:
    """Time and bytes of the ZeRO-3 systems at one DP size, as ratios to DeepSpeed's ZeRO-3, ds_canzona's
    ZeRO-3 (tensors whole) and ZeRO-2."""
    rows = [(key, _find(results, key, dp), _refusal(unavailable, key, dp)) for key in ZERO3_SYSTEMS]
    rows = [row for row in rows if row[1] is not None or row[2] is not None]
    if not rows:
        return ""
    deepspeed, canzona2 = _find(results, "deepspeed-z3", dp), _find(results, "canzona-z2", dp)
    canzona3 = _find(results, "canzona-z3", dp)
    lines = ["| system | iteration s | / DeepSpeed Z3 | / ds_canzona Z3 | / ds_canzona Z2 | NS runs (all / busiest) | "
             + " | ".join(f"{k} MB" for k in _COLLECTIVE_KINDS) + " | payload / wire MB per rank |",
             "|---|---:|---:|---:|---:|---:|" + "---:|" * len(_COLLECTIVE_KINDS) + "---:|"]
    for key, r, refusal in rows:
        if r is None:
            lines.append(f"| {labels[key]} | not available: {refusal} |" + " |" * (5 + len(_COLLECTIVE_KINDS)))
            continue
        kinds = " | ".join(_mb(r.comm_payload_bytes.get(k, 0)) for k in _COLLECTIVE_KINDS)
        ratios = " | ".join(_ratio(r.iteration_s, other, lambda x: x.iteration_s)
                            for other in (deepspeed, canzona3, canzona2))
        lines.append(
            f"| {r.label} | {r.iteration_s:.3f} | {ratios} | {r.ns_runs_total} / {r.ns_runs_max_rank} "
            f"| {kinds} | {_mb(sum(r.comm_payload_bytes.values()))} / {_mb(sum(r.comm_wire_bytes.values()))} |")
    return "\n".join(lines)


def memory_table(results: Sequence[Any], dp: int, order: Sequence[str], optimizer: str = "muon") -> str:
    """Memory per rank of every measured system at one DP size: max / average over the ranks, MB."""
    rows = [r for key in order for r in results
            if r.system == key and r.dp == dp and r.optimizer == optimizer and r.memory]
    if not rows:
        return ""
    deepspeed, canzona2 = _find(results, "deepspeed-z3", dp, optimizer), _find(results, "canzona-z2", dp, optimizer)
    lines = ["| system | parameters | gradients | optimizer state | other | held between steps | peak of a step "
             "| peak / DeepSpeed Z3 | peak / ds_canzona Z2 |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        cells = " | ".join(f"{_mb(r.memory[name]['max'])} / {_mb(r.memory[name]['avg'])}"
                           for name in (*MEMORY_CATEGORIES, "total", "step_peak"))
        peak = r.memory["step_peak"]["max"]
        pick = lambda other: other.memory["step_peak"]["max"] if other.memory else 0  # noqa: E731
        lines.append(f"| {r.label} | {cells} | {_ratio(peak, deepspeed, pick)} | {_ratio(peak, canzona2, pick)} |")
    return "\n".join(lines)


def zero3_checks(results: Sequence[Any], unavailable: Sequence[dict[str, Any]]) -> list[str]:
    """The issue's ZeRO-3 goals as lines of text: faster per iteration, no more memory on the busiest rank."""
    lines = []
    for dp in sorted({r.dp for r in results} | {u["dp"] for u in unavailable}):
        deepspeed = _find(results, "deepspeed-z3", dp)
        refusal = _refusal(unavailable, "canzona-z3", dp)
        if refusal is not None:
            lines.append(f"DP={dp} ds_canzona ZeRO-3: not available: {refusal}")
        for key in ("canzona-z3", "canzona-z3-pieces", "canzona-z2"):
            mine = _find(results, key, dp)
            if mine is None or deepspeed is None:
                continue
            speed = deepspeed.iteration_s / mine.iteration_s
            line = (f"DP={dp} {mine.label} vs {deepspeed.label}: {speed:.2f}x faster per iteration "
                    f"({'ok' if speed >= 1.0 else 'SLOWER'})")
            if mine.memory and deepspeed.memory:
                peak = mine.memory["step_peak"]["max"] / deepspeed.memory["step_peak"]["max"]
                held = mine.memory["total"]["max"] / deepspeed.memory["total"]["max"]
                line += (f"; busiest rank's peak {peak:.2f} of DeepSpeed's ({'ok' if peak <= 1.0 else 'MORE'}), "
                         f"held between steps {held:.2f}")
            lines.append(line)
        z3, z2 = _find(results, "canzona-z3", dp), _find(results, "canzona-z2", dp)
        if z3 is not None and z2 is not None and z3.memory and z2.memory:
            lines.append(f"DP={dp} ds_canzona ZeRO-3 vs ZeRO-2: {z2.iteration_s / z3.iteration_s:.2f}x the speed; "
                         f"busiest rank's peak {z3.memory['step_peak']['max'] / z2.memory['step_peak']['max']:.2f}, "
                         f"held {z3.memory['total']['max'] / z2.memory['total']['max']:.2f} of ZeRO-2's")
        pieces = _find(results, "canzona-z3-pieces", dp)
        if z3 is not None and pieces is not None and z3.memory and pieces.memory:
            lines.append(f"DP={dp} ds_canzona ZeRO-3, pieces vs whole: {pieces.iteration_s / z3.iteration_s:.2f}x "
                         f"the iteration time; {_calls(pieces)} vs {_calls(z3)} reduce + broadcast calls per step; "
                         f"busiest rank held {_balance(pieces, 'total')} vs {_balance(z3, 'total')}, "
                         f"peak {_balance(pieces, 'step_peak')} vs {_balance(z3, 'step_peak')}")
    return lines


def _calls(result: Any) -> int:
    return round(result.comm_calls.get("reduce", 0) + result.comm_calls.get("broadcast", 0))


def _balance(result: Any, name: str) -> str:
    """The busiest rank's MB of one memory field, and its ratio to the average over ranks."""
    field = result.memory[name]
    return f"{_mb(field['max'])} MB ({field['max'] / field['avg']:.3f}x the average)"
