"""Readable reports of a plan: the per-rank table, the TP micro-groups, a plot.

Formatting only: the ``ds-canzona plan`` command (``ds_canzona.plan_command``) parses the
arguments, builds the plan and calls these. Only the standard library is imported here;
:func:`plot_dp` brings in matplotlib when called.
"""

from __future__ import annotations

from typing import Any

from .collectives import BucketForms
from .dp import DPPlan, lpt_loads
from .gather_groups import step_launches
from .owners import Zero3Plan
from .specs import PlanError
from .tp import TPPlan

__all__ = ["COMMUNICATION_LEGEND", "format_all_gather_groups", "format_collective_forms", "format_dp_table",
           "format_tp_groups", "format_zero3_table", "plot_dp"]

# What the table's "communication" number is, and what alpha trades (docs/PLANNER.md, "Reading the table").
COMMUNICATION_LEGEND = (
    "communication: how long the uneven reduce-scatters and all-gathers take against DeepSpeed's equal cuts\n"
    "(each bucket's largest segment, summed, over the even segments); alpha 0 keeps it lowest, alpha 1 evens the cost."
)


def format_collective_forms(forms: BucketForms) -> str:
    """How many buckets take each form, per collective, the padding bytes per step that costs, and the model's prices."""
    lines = [f"collectives ({forms.setting}, backend {forms.backend}), per step:"]
    for name, summary in (("reduce-scatter", forms.reduce_scatter_summary), ("all-gather", forms.all_gather_summary)):
        lines.append(f"  {name}: {summary.padded} buckets padded, {summary.all_reduced} all-reduced, {summary.grouped} "
                     f"grouped, {summary.operations:,} operations; padding {summary.padding_bytes:,} bytes "
                     f"({summary.padding_fraction:.2%} of the bucket bytes), second passes "
                     f"{summary.second_pass_bytes:,} bytes; model: "
                     f"all grouped {summary.grouped_s * 1e3:.3g} ms, all padded {summary.padded_s * 1e3:.3g} ms")
    return "\n".join(lines)


def format_all_gather_groups(groups: tuple[tuple[int, ...], ...], forms: BucketForms, setting: int | str,
                             world_size: int) -> str:
    """The gather groups (how many buckets each) and the step's collective launches they give."""
    sizes = sorted({len(group) for group in groups}, reverse=True)
    held = "-".join(str(size) for size in (sizes[-1], sizes[0])) if len(sizes) > 1 else str(sizes[0] if sizes else 0)
    launches = step_launches(groups, forms.all_gather, world_size)
    noun = "group" if len(groups) == 1 else "groups"
    return (f"all-gather groups ({setting}): {len(groups)} {noun} of {held} consecutive buckets; launches per step "
            f"where the backend groups: {launches['reduce_scatter']} reduce-scatter + {launches['all_gather']} all-gather + "
            f"{launches['all_reduce']} norm all-reduce = {sum(launches.values())}")


def format_zero3_table(plan: Zero3Plan, *, title: str = "") -> str:
    """The ZeRO-3 owner plan per rank: cost and elements with their shares of the average, items owned.

    Under it the ratios and the largest item (named): no plan puts less than it on one rank.
    """
    costs, numels = plan.rank_costs(), plan.rank_numels()
    mean_cost = sum(plan.costs) / plan.world_size
    mean_numel = sum(spec.numel for spec in plan.specs) / plan.world_size
    items = [len(plan.owned_params(rank)) for rank in range(plan.world_size)]
    pieces = sum(len(items) for items in plan.tensor_items() if len(items) > 1)
    lines = [title] if title else []
    lines.append(f"ZeRO-3 owner placement, cost {plan.cost_label}, DP {plan.world_size}, {len(plan.specs)} items"
                 + (f" ({pieces} of them pieces of at most {plan.split_numel:,} elements)" if pieces else ""))
    lines.append("")
    lines.append(f"{'rank':>5}  {'cost':>11}  {'cost/avg':>8}  {'elements':>15}  {'elem/avg':>8}  {'items':>6}")
    for rank in range(plan.world_size):
        cost_share = costs[rank] / mean_cost if mean_cost > 0 else 0.0
        numel_share = numels[rank] / mean_numel if mean_numel > 0 else 0.0
        lines.append(f"{rank:>5}  {costs[rank]:>11.4g}  {cost_share:>8.3f}  {numels[rank]:>15,}  {numel_share:>8.3f}  "
                     f"{items[rank]:>6}")
    largest = max(range(len(plan.specs)), key=lambda i: plan.specs[i].numel)
    lines.append("")
    lines.append(f"max/avg: cost {plan.flops_ratio:.3f}, elements {plan.memory_ratio:.3f}; largest item "
                 f"{plan.specs[largest].name} ({plan.specs[largest].numel:,} elements, "
                 f"{plan.specs[largest].numel / mean_numel:.3f} of the average)")
    return "\n".join(lines)


def format_dp_table(plan: DPPlan, *, title: str = "") -> str:
    """A readable per-rank table (cost, state bytes, elements, items), the ratios and the lower bounds.

    For cost and for memory, the two bounds no plan can beat are printed: the average (total over
    the ranks) and the largest single item, named, with which of the two binds.
    """
    costs, numels, tensors, state = plan.rank_costs(), plan.rank_numels(), plan.rank_tensors(), plan.rank_memory()
    mean_cost = sum(plan.costs) / plan.world_size
    mean_state = sum(plan.memory) / plan.world_size
    mean_numel = sum(spec.numel for spec in plan.specs) / plan.world_size
    lpt = max(lpt_loads(plan.costs, plan.world_size)) / mean_cost if mean_cost > 0 else 1.0
    lines = []
    if title:
        lines.append(title)
    lines.append(
        f"strategy {plan.strategy}, alpha {plan.alpha:g}, cost {plan.cost_label}, DP {plan.world_size}, "
        f"bucket {plan.bucket_numel:,} elements ({len(plan.buckets)} buckets)"
    )
    lines.append(f"memory {plan.memory_label}: per rank, fp32 masters + optimizer state + gradient segment"
                 + (f"; cap {plan.max_state_bytes_per_rank:,} bytes" if plan.max_state_bytes_per_rank else ""))
    if plan.strategy == "uniform":
        lines.append(
            "(uniform: a tensor split by a cut is charged to every rank it touches, as DeepSpeed's Muon runs it)"
        )
    lines.append("")
    lines.append(f"{'rank':>5}  {'cost':>11}  {'cost/avg':>8}  {'state bytes':>17}  {'bytes/avg':>9}  "
                 f"{'elements':>15}  {'elem/avg':>8}  {'items':>6}")
    for rank in range(plan.world_size):
        cost_share = costs[rank] / mean_cost if mean_cost > 0 else 0.0
        state_share = state[rank] / mean_state if mean_state > 0 else 0.0
        numel_share = numels[rank] / mean_numel if mean_numel > 0 else 0.0
        lines.append(
            f"{rank:>5}  {costs[rank]:>11.4g}  {cost_share:>8.3f}  {state[rank]:>17,.0f}  {state_share:>9.3f}  "
            f"{numels[rank]:>15,}  {numel_share:>8.3f}  {tensors[rank]:>6}"
        )
    lines.append("")
    lines.append(
        f"max/avg: {plan.cost_model} {plan.flops_ratio:.3f}, state bytes {plan.state_bytes_ratio:.3f}, "
        f"elements {plan.memory_ratio:.3f}, communication {plan.comm_ratio:.3f}; unconstrained LPT reaches {lpt:.3f}"
    )
    lines.append(_bound_line("cost", plan.costs, max(costs), plan, "{:.4g}"))
    lines.append(_bound_line("state bytes", plan.memory, max(state), plan, "{:,.0f}"))
    # When one tensor alone outweighs a rank's fair share, no whole-tensor plan can do better: say so.
    costliest = max(range(len(plan.specs)), key=lambda i: plan.costs[i])
    atom = plan.costs[costliest] / mean_cost if mean_cost > 0 else 0.0
    if atom > 1.0:
        spec = plan.specs[costliest]
        lines.append(f"the costliest tensor alone, {spec.name}, is {atom:.3f} x a rank's average: "
                     "whole-tensor ownership cannot go below it"
                     + ("" if spec.matrix else " (--split-numel plans non-matrix tensors in pieces)"))
    return "\n".join(lines)


def _bound_line(what: str, values: tuple[float, ...], busiest: float, plan: DPPlan, number: str) -> str:
    """``what``'s lower bounds (the average, the largest item, named) and which one binds."""
    average = sum(values) / plan.world_size
    largest = max(range(len(values)), key=lambda i: (values[i], -i))
    binding = f"the largest item, {plan.specs[largest].name}" if values[largest] >= average else "the average"
    gap = busiest / max(average, values[largest]) if max(average, values[largest]) > 0 else 1.0
    return (f"{what} lower bounds: average {number.format(average)}, largest item {number.format(values[largest])} "
            f"({plan.specs[largest].name}); {binding} binds; the busiest rank is {gap:.3f} x the bound")


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
    """Bars of each rank's cost and state bytes against their averages, saved to ``path``."""
    pyplot = _pyplot()
    costs, state = plan.rank_costs(), plan.rank_memory()
    ranks = list(range(plan.world_size))
    figure, (top, bottom) = pyplot.subplots(
        2, 1, figsize=(max(6.0, min(20.0, 0.15 * plan.world_size + 4)), 6), sharex=True
    )
    for axis, values, label in ((top, costs, f"cost ({plan.cost_model})"), (bottom, state, "state bytes")):
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


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise PlanError("--plot needs matplotlib (pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as pyplot

    return pyplot
