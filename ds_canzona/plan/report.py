"""``ds-canzona plan``: plan offline and report the balance as a table, JSON or a plot.

Only the standard library is imported on the ``--shapes`` and ``--model`` paths, so the command
starts in well under a second; ``--hf-config`` brings in torch and transformers, ``--plot``
brings in matplotlib.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from ..cli import Command
from .cost import COST_MODELS, DEFAULT_MACHINE_BALANCE, CostModel, cost_model
from .dp import DEFAULT_SPLIT_NUMEL, STRATEGIES, DPPlan, lpt_loads, plan_dp_partitions
from .models import model_specs, shipped_models
from .specs import ParamSpec, PlanError, shard_for_tp, specs_from_hf_config, specs_from_shapes_file
from .tp import DEFAULT_CAPACITY_BYTES, TPPlan, plan_tp_micro_groups

__all__ = ["COMMAND", "format_dp_table", "format_tp_groups", "plot_dp", "run_plan"]

DEFAULT_BUCKET_NUMEL = 500_000_000  # DeepSpeed's default reduce_bucket_size

# What the table's "communication" number is, and what alpha trades (docs/PLANNER.md, "Reading the table").
COMMUNICATION_LEGEND = (
    "communication: how long the uneven reduce-scatters and all-gathers take against DeepSpeed's equal cuts\n"
    "(each bucket's largest segment, summed, over the even segments); alpha 0 keeps it lowest, alpha 1 evens the cost."
)


def format_dp_table(plan: DPPlan, *, title: str = "") -> str:
    """A readable per-rank table (cost, elements, tensors) and the max/avg ratios."""
    costs, numels, tensors = plan.rank_costs(), plan.rank_numels(), plan.rank_tensors()
    total_cost = sum(plan.costs)
    mean_cost = total_cost / plan.world_size
    mean_numel = sum(spec.numel for spec in plan.specs) / plan.world_size
    lpt = max(lpt_loads(plan.costs, plan.world_size)) / mean_cost if mean_cost > 0 else 1.0
    lines = []
    if title:
        lines.append(title)
    lines.append(
        f"strategy {plan.strategy}, alpha {plan.alpha:g}, cost {plan.cost_label}, DP {plan.world_size}, "
        f"bucket {plan.bucket_numel:,} elements ({len(plan.buckets)} buckets)"
    )
    if plan.strategy == "uniform":
        lines.append(
            "(uniform: a tensor split by a cut is charged to every rank it touches, as DeepSpeed's Muon runs it)"
        )
    lines.append("")
    lines.append(f"{'rank':>5}  {'cost':>11}  {'cost/avg':>8}  {'elements':>15}  {'elem/avg':>8}  {'tensors':>7}")
    for rank in range(plan.world_size):
        cost_share = costs[rank] / mean_cost if mean_cost > 0 else 0.0
        numel_share = numels[rank] / mean_numel if mean_numel > 0 else 0.0
        lines.append(
            f"{rank:>5}  {costs[rank]:>11.4g}  {cost_share:>8.3f}  "
            f"{numels[rank]:>15,}  {numel_share:>8.3f}  {tensors[rank]:>7}"
        )
    lines.append("")
    lines.append(
        f"max/avg: {plan.cost_model} {plan.flops_ratio:.3f}, memory {plan.memory_ratio:.3f}, "
        f"communication {plan.comm_ratio:.3f}; unconstrained LPT reaches {lpt:.3f}"
    )
    # When one tensor alone outweighs a rank's fair share, no whole-tensor plan can do better: say so.
    costliest = max(range(len(plan.specs)), key=lambda i: plan.costs[i])
    atom = plan.costs[costliest] / mean_cost if mean_cost > 0 else 0.0
    if atom > 1.0:
        spec = plan.specs[costliest]
        lines.append(f"the costliest tensor alone, {spec.name}, is {atom:.3f} x a rank's average: "
                     "whole-tensor ownership cannot go below it"
                     + ("" if spec.matrix else " (--split-numel plans non-matrix tensors in pieces)"))
    return "\n".join(lines)


def format_tp_groups(tp_plan: TPPlan) -> str:
    """One line per micro-group: its tensors, hosts and the busiest host's bytes and cost."""
    lines = [
        f"TP micro-groups: TP {tp_plan.tp_size}, C_max {tp_plan.capacity_bytes / 2**20:,.0f} MiB, "
        f"{len(tp_plan.groups)} groups; host max/avg: cost {tp_plan.flops_ratio:.3f}, bytes {tp_plan.memory_ratio:.3f}",
        "",
        f"{'group':>5}  {'tensors':>7}  {'max MiB/host':>12}  {'cost max/avg':>12}  tensors per host",
    ]
    for group in tp_plan.groups:
        mean = sum(group.rank_costs) / tp_plan.tp_size
        balance = max(group.rank_costs) / mean if mean > 0 else 1.0
        hosts = ",".join(str(group.hosts.count(rank)) for rank in range(tp_plan.tp_size))
        lines.append(
            f"{group.index:>5}  {len(group.params):>7}  "
            f"{max(group.rank_bytes) / 2**20:>12,.1f}  {balance:>12.3f}  {hosts}"
        )
    return "\n".join(lines)


def plot_dp(plan: DPPlan, path: str, *, title: str = "") -> None:
    """Bars of each rank's cost and elements against their averages, saved to ``path``."""
    pyplot = _pyplot()
    costs, numels = plan.rank_costs(), plan.rank_numels()
    ranks = list(range(plan.world_size))
    figure, (top, bottom) = pyplot.subplots(
        2, 1, figsize=(max(6.0, min(20.0, 0.15 * plan.world_size + 4)), 6), sharex=True
    )
    for axis, values, label in ((top, costs, f"cost ({plan.cost_model})"), (bottom, numels, "elements")):
        axis.bar(ranks, values, width=0.8, color="tab:blue" if axis is top else "tab:orange")
        mean = sum(values) / len(values)
        axis.axhline(mean, color="black", linewidth=1, linestyle="--", label="average")
        axis.set_ylabel(label)
        axis.legend(loc="upper right")
    top.set_title(
        title or f"{plan.strategy} (alpha {plan.alpha:g}), DP {plan.world_size}: max/avg {plan.flops_ratio:.3f}"
    )
    bottom.set_xlabel("DP rank")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    pyplot.close(figure)


def run_plan(args: argparse.Namespace) -> int:
    for flag, value in (("--dp", args.dp), ("--tp", args.tp), ("--tp-capacity-mb", args.tp_capacity_mb)):
        if value < 1:
            raise PlanError(f"Invalid {flag} {value}: must be a positive integer.")
    specs, source = _load_specs(args)
    cost = _cost_model(args)
    if args.tp > 1:
        specs = shard_for_tp(specs, args.tp)
    plan = plan_dp_partitions(
        specs, world_size=args.dp, bucket_numel=args.bucket_numel, alpha=args.alpha, strategy=args.strategy, cost=cost,
        split_numel=args.split_numel,
    )
    tp_plan = None
    if args.tp > 1:
        tp_plan = plan_tp_micro_groups(specs, tp_size=args.tp, capacity_bytes=args.tp_capacity_mb * 2**20, cost=cost)
    if args.plot:
        plot_dp(plan, args.plot, title=f"{source}: {plan.strategy} (alpha {plan.alpha:g}), DP {plan.world_size}")
    if args.json:
        document: dict[str, Any] = plan.to_dict()
        document["digest"] = plan.digest()
        if tp_plan is not None:
            document["tp"] = tp_plan.to_dict()
        json.dump(document, sys.stdout)
        sys.stdout.write("\n")
        return 0
    total = sum(spec.numel for spec in specs)
    title = f"{source}: {len(specs)} tensors, {total:,} elements"
    if args.tp > 1:
        title += f" (TP-local shards, TP {args.tp})"
    print(format_dp_table(plan, title=title))
    print(COMMUNICATION_LEGEND)
    if tp_plan is not None:
        print()
        print(format_tp_groups(tp_plan))
    if args.plot:
        print(f"\nplot written to {args.plot}")
    return 0


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--shapes", metavar="FILE", help='JSON list of {"name", "shape", "matrix"} in buffer order')
    source.add_argument(
        "--hf-config", metavar="PATH", help="HuggingFace config.json (file or folder); needs torch and transformers"
    )
    source.add_argument("--model", metavar="NAME", help=f"a shipped config: {', '.join(shipped_models())}")
    parser.add_argument("--dp", type=int, default=32, metavar="R", help="data-parallel world size (default 32)")
    parser.add_argument(
        "--tp", type=int, default=1, metavar="T", help="tensor-parallel size; > 1 also plans micro-groups"
    )
    parser.add_argument(
        "--alpha", type=float, default=1.0, metavar="A", help="0: even elements, 1: even cost (default 1)"
    )
    parser.add_argument(
        "--bucket-numel",
        type=_count,
        default=DEFAULT_BUCKET_NUMEL,
        metavar="N",
        help="bucket size in elements (default 5e8)",
    )
    parser.add_argument("--cost", choices=COST_MODELS, default="roofline",
                        help="cost model (default roofline, as the runtime)")
    parser.add_argument("--machine-balance", type=float, default=None, metavar="B",
                        help=f"for --cost roofline: matmul FLOPs per elementwise byte (default "
                             f"{DEFAULT_MACHINE_BALANCE['cuda']:g}, GPUs; the CPU's is {DEFAULT_MACHINE_BALANCE['cpu']:g})")
    parser.add_argument("--optimizer", choices=("muon", "shampoo", "soap"), default="muon",
                        help="for --cost roofline or flops")
    parser.add_argument("--ns-method", choices=("gram", "standard"), default=None, help="Muon's Newton-Schulz variant")
    parser.add_argument("--strategy", choices=STRATEGIES, default="alpha_balanced")
    parser.add_argument("--split-numel", type=_split_count, default=DEFAULT_SPLIT_NUMEL, metavar="N",
                        help=f"plan non-matrix tensors above N elements in pieces of N (default {DEFAULT_SPLIT_NUMEL}, "
                             "as the runtime; 0: every tensor whole)")
    parser.add_argument(
        "--tp-capacity-mb",
        type=int,
        default=DEFAULT_CAPACITY_BYTES // 2**20,
        metavar="MB",
        help="micro-group C_max (default 512)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--plot", metavar="FILE.png", help="draw per-rank cost and memory (needs matplotlib)")


COMMAND = Command(
    description="Plan data-parallel ownership offline and report the per-rank balance.",
    add_arguments=add_plan_arguments,
    run=run_plan,
)


def _load_specs(args: argparse.Namespace) -> tuple[list[ParamSpec], str]:
    if args.shapes:
        return specs_from_shapes_file(args.shapes), args.shapes
    if args.model:
        return model_specs(args.model), args.model.lower()
    return specs_from_hf_config(args.hf_config), args.hf_config


def _cost_model(args: argparse.Namespace) -> CostModel:
    if args.cost == "numel":
        return cost_model("numel")
    options = {"ns_method": args.ns_method} if args.ns_method and args.optimizer == "muon" else {}
    if args.cost == "roofline" and args.machine_balance is not None:
        options["machine_balance"] = args.machine_balance
    elif args.machine_balance is not None:
        raise PlanError(f"--machine-balance applies to --cost roofline only, not {args.cost}.")
    return cost_model(args.cost, args.optimizer, **options)


def _split_count(text: str) -> int | None:
    """--split-numel: a positive element count, or 0 for whole tensors."""
    return None if text.strip() == "0" else _count(text)


def _count(text: str) -> int:
    """A positive element count, written as an integer or in scientific notation (5e8)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid count {text!r}") from None
    if not value.is_integer() or value < 1:
        raise argparse.ArgumentTypeError(f"invalid count {text!r}: must be a positive integer")
    return int(value)


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise PlanError("--plot needs matplotlib (pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as pyplot

    return pyplot


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m ds_canzona.plan``: the same as ``ds-canzona plan``."""
    from ..cli import dispatch

    return dispatch(
        "ds-canzona",
        {"plan": ("ds_canzona.plan.report:COMMAND", "")},
        ["plan", *(sys.argv[1:] if argv is None else argv)],
    )
