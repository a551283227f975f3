"""``python -m ds_canzona.bench stack-pieces``: MoE expert stacks planned whole against in pieces of whole experts.

A fused expert stack ``[experts, out, in]`` (transformers 5's Qwen3-MoE and OLMoE) is one tensor
of tens to hundreds of millions of elements. Owned whole, one stack can be most of a rank's share
of the step and of the bytes. The default plan cuts a stack above ``split_numel`` into pieces of
whole experts (``ds_canzona.plan.stack_piece_bounds``); this command plans the MoE shapes of
``bench plan-bounds`` (``SHAPES``) both ways, at the same defaults, and prints side by side the
busiest rank's cost (the step time the plan sets, in the cost model's units, and the pieces'
over the whole stacks') and its state bytes over the average.

Both columns of cost are absolute, not over LPT: LPT over pieces is lower than over whole stacks,
so "within 2% of LPT" is a stricter target in pieces (``bench plan-bounds`` reports it).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from ...cli import Command
from ...plan import cost_model, lpt_loads, plan_dp_partitions
from ...plan.dp import DEFAULT_SPLIT_NUMEL
from .plan_bounds import BUCKET, DP_SIZES, MACHINE_BALANCE, PRICINGS, SHAPES, rows_of_cells

__all__ = ["STACK_PIECES", "StackRow", "moe_stack_shapes", "stack_row"]


@dataclass(frozen=True)
class StackRow:
    shape: str
    pricing: str
    dp: int
    items_whole: int
    items_pieces: int
    cost_whole_over_lpt: float  # the whole-stack plan against LPT over whole stacks
    cost_pieces_over_whole: float  # the busiest rank's cost, in pieces over whole
    memory_whole: float  # busiest bytes over the average
    memory_pieces: float
    seconds_whole: float
    seconds_pieces: float


def moe_stack_shapes() -> list[str]:
    """The shapes of ``SHAPES`` with 3-D matrix stacks."""
    return [name for name, (build, arguments) in SHAPES.items()
            if any(spec.matrix and len(spec.shape) == 3 for spec in build(**arguments))]


def stack_row(shape: str, pricing: str, world: int) -> StackRow:
    build, arguments = SHAPES[shape]
    specs = build(**arguments)
    cost = cost_model("roofline", "muon", machine_balance=MACHINE_BALANCE, ns_method=pricing)
    measured = []
    for split_stacks in (False, True):
        start = time.process_time()
        plan = plan_dp_partitions(specs, world_size=world, bucket_numel=BUCKET, cost=cost,
                                  split_numel=DEFAULT_SPLIT_NUMEL, split_stacks=split_stacks)
        seconds = time.process_time() - start
        average = sum(plan.memory) / world
        measured.append((plan, max(plan.rank_costs()), max(plan.rank_memory()) / average, seconds))
    (whole, whole_cost, whole_memory, whole_seconds), (pieces, pieces_cost, pieces_memory, pieces_seconds) = measured
    return StackRow(shape=shape, pricing=pricing, dp=world, items_whole=len(whole.specs), items_pieces=len(pieces.specs),
                    cost_whole_over_lpt=whole_cost / max(lpt_loads(whole.costs, world)),
                    cost_pieces_over_whole=pieces_cost / whole_cost, memory_whole=whole_memory,
                    memory_pieces=pieces_memory, seconds_whole=whole_seconds, seconds_pieces=pieces_seconds)


def markdown(rows: Sequence[StackRow]) -> str:
    lines = ["| shape | pricing | DP | items whole / pieces | whole: cost / LPT | pieces: busiest cost / whole's "
             "| bytes / average, whole | in pieces | plan s, whole / pieces |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r.shape} | {r.pricing} | {r.dp} | {r.items_whole} / {r.items_pieces} | "
                     f"{r.cost_whole_over_lpt:.3f} | {r.cost_pieces_over_whole:.3f} | {r.memory_whole:.3f} | "
                     f"{r.memory_pieces:.3f} | {r.seconds_whole:.1f} / {r.seconds_pieces:.1f} |")
    faster = sum(r.cost_pieces_over_whole < 1 - 1e-9 for r in rows)
    slower = sum(r.cost_pieces_over_whole > 1 + 1e-9 for r in rows)
    lighter = sum(r.memory_pieces < r.memory_whole - 1e-9 for r in rows)
    heavier = sum(r.memory_pieces > r.memory_whole + 1e-9 for r in rows)
    ratios = sorted(r.cost_pieces_over_whole for r in rows)
    lines += ["", f"{len(rows)} cells. Busiest cost in pieces: lower in {faster}, higher in {slower} "
              f"(ratio {ratios[0]:.3f} to {ratios[-1]:.3f}, median {ratios[len(ratios) // 2]:.3f}); "
              f"busiest bytes: lower in {lighter}, higher in {heavier}."]
    return "\n".join(lines)


def add_stack_pieces_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shapes", default=None, help="comma-separated shapes (default: every MoE-stack shape of "
                                                       "bench plan-bounds)")
    parser.add_argument("--dp", default=",".join(map(str, DP_SIZES)), help="comma-separated DP sizes")
    parser.add_argument("--pricings", default=",".join(PRICINGS), help="Newton-Schulz pricings of the Muon cost")
    parser.add_argument("--processes", type=int, default=1, help="plan cells in this many processes")
    parser.add_argument("--json", metavar="FILE", help="also write every row as JSON")


def run_stack_pieces(args: argparse.Namespace) -> int:
    rows = rows_of_cells(args, "stack-pieces", moe_stack_shapes(), stack_row, unknown_label="unknown or stackless")
    print(markdown(rows))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({"rows": [asdict(row) for row in rows]}, handle, indent=1)
    return 0


STACK_PIECES = Command(
    description="MoE expert stacks planned whole against in pieces of whole experts, side by side.",
    add_arguments=add_stack_pieces_arguments,
    run=run_stack_pieces,
)
