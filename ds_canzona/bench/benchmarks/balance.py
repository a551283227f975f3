"""Load-balance study on the shipped Qwen3 configs, and the planner's speed.

``python -m ds_canzona.bench balance``: for each model, DP size and bucket size, the busiest
rank's optimizer FLOPs (Muon) over the ideal average, for

- ``uniform``: DeepSpeed's equal cuts, each split matrix charged to every rank it touches (that
  is how DeepSpeed's Muon runs it: all-reduced and orthogonalised on each of them);
- ``start_index``: equal cuts, each tensor owned by the rank holding its start;
- Algorithm 1 of the paper, as we read it (FLOPs cost, alpha = 1), for reference;
- ``alpha_balanced`` planned with the paper's numel cost, and with the FLOPs cost (alpha = 1);
- unconstrained LPT, the reference: it ignores the buffer entirely;

with the memory ratio, as a markdown table (and optionally JSON and a PNG plot); then an alpha
sweep showing the trade between even communication and even compute.

``python -m ds_canzona.bench balance --memory``: the default plan (roofline cost, pieces of 2^22,
5e8 buckets, bf16 Muon state) before and after memory became its second criterion: the busiest
rank's cost and state bytes over their averages, against unconstrained LPT and the memory target
max(1.25, 1.05 x largest item / average); ``--families`` adds the config.json files of other
families (``FAMILY_CONFIGS``), read through ``specs_from_hf_config`` like ``--hf-config``; ``--ns-methods
gram,standard`` plans each with both Newton-Schulz pricings of the Muon cost.

``python -m ds_canzona.bench plan-speed``: how long planning 10,000 tensors for DP=1024 takes.
Times are CPU seconds of the planning process (the planner is single-threaded, so on an idle
machine this is the wall time; on a shared one it does not count other processes' load).
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import json
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from ...cli import Command
from ...plan import DPPlan, ParamSpec, cost_model, lpt_loads, model_specs, plan_buckets, plan_dp_partitions
from ...plan.dp import DEFAULT_SPLIT_NUMEL, MemoryCapError, alpha_balanced

__all__ = ["BALANCE", "FAMILY_CONFIGS", "PLAN_SPEED", "BalanceRow", "MemoryRow", "SweepRow", "alpha_sweep",
           "balance_study", "memory_study", "plan_speed"]

MODELS = ("qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b", "qwen3-14b", "qwen3-32b")
DP_SIZES = (16, 32, 64, 128)
BUCKET_SIZES = (40_000_000, 500_000_000)
SWEEP_ALPHAS = tuple(round(0.1 * step, 1) for step in range(11))
# What the memory study plans with: `ds-canzona plan`'s defaults (the runtime's, on a GPU).
MEMORY_BUCKET = 500_000_000
MEMORY_MACHINE_BALANCE = 150.0
# config.json of other families a user would bring, at their published sizes.
FAMILY_CONFIGS: dict[str, dict[str, Any]] = {
    "llama3-8b": {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 128256,
                  "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                  "num_key_value_heads": 8, "tie_word_embeddings": False, "max_position_embeddings": 8192},
    "gemma-7b": {"model_type": "gemma", "architectures": ["GemmaForCausalLM"], "vocab_size": 256000,
                 "hidden_size": 3072, "intermediate_size": 24576, "num_hidden_layers": 28, "num_attention_heads": 16,
                 "num_key_value_heads": 16, "head_dim": 256, "tie_word_embeddings": True},
    "gemma2-9b": {"model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"], "vocab_size": 256000,
                  "hidden_size": 3584, "intermediate_size": 14336, "num_hidden_layers": 42, "num_attention_heads": 16,
                  "num_key_value_heads": 8, "head_dim": 256, "tie_word_embeddings": True, "attention_bias": False,
                  "query_pre_attn_scalar": 256, "sliding_window": 4096},
    "qwen2.5-7b": {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "vocab_size": 152064,
                   "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
                   "num_key_value_heads": 4, "tie_word_embeddings": False},
    "olmoe-64-experts": {"model_type": "olmoe", "architectures": ["OlmoeForCausalLM"], "vocab_size": 50304,
                         "hidden_size": 2048, "intermediate_size": 1024, "num_hidden_layers": 16,
                         "num_attention_heads": 16, "num_key_value_heads": 16, "num_experts": 64,
                         "num_experts_per_tok": 8, "tie_word_embeddings": False},
}


@dataclass(frozen=True, kw_only=True)
class BalanceRow:
    """One (model, DP, bucket) cell: FLOPs max/avg per strategy, and memory max/avg."""

    model: str
    dp: int
    bucket_numel: int
    lpt: float
    algorithm1: float
    uniform: float
    start_index: float
    alpha_numel: float
    alpha_flops: float
    memory_uniform: float
    memory_alpha_numel: float
    memory_alpha_flops: float
    seconds: float

    @property
    def over_lpt(self) -> float:
        """How far the FLOPs-planned busiest rank is above LPT's (negative: below)."""
        return self.alpha_flops / self.lpt - 1.0


@dataclass(frozen=True, kw_only=True)
class MemoryRow:
    """One (model, DP) cell of the memory study: busiest cost and state bytes over their averages."""

    model: str
    dp: int
    lpt: float
    cost_before: float
    memory_before: float
    cost_after: float
    memory_after: float
    memory_target: float
    largest_memory: str
    seconds: float
    cost_at_target: float | None = None
    """Where memory misses the target: the cost of the plan capped at the target (canzona.max_state_bytes_per_rank);
    inf if the planner finds no plan under it."""
    ns_method: str = "gram"

    @property
    def cost_ok(self) -> bool:
        return self.cost_after <= 1.02 * self.lpt

    @property
    def memory_ok(self) -> bool:
        return self.memory_after <= self.memory_target


@dataclass(frozen=True, kw_only=True)
class SweepRow:
    alpha: float
    flops_ratio: float
    comm_ratio: float
    memory_ratio: float


def balance_study(
    models: Sequence[str] = MODELS, dp_sizes: Sequence[int] = DP_SIZES, bucket_sizes: Sequence[int] = BUCKET_SIZES
) -> list[BalanceRow]:
    flops, numel = cost_model("flops", "muon"), cost_model("numel")
    rows = []
    for model in models:
        specs = model_specs(model)
        costs = [flops.cost(spec) for spec in specs]
        for bucket in bucket_sizes:
            for dp in dp_sizes:
                average = sum(costs) / dp
                plans = {}
                for name, strategy, model_cost in (
                    ("uniform", "uniform", flops),
                    ("start_index", "start_index", flops),
                    ("alpha_numel", "alpha_balanced", numel),
                ):
                    plans[name] = plan_dp_partitions(
                        specs, world_size=dp, bucket_numel=bucket, strategy=strategy, cost=model_cost
                    )
                started = time.process_time()
                plans["alpha_flops"] = plan_dp_partitions(specs, world_size=dp, bucket_numel=bucket, cost=flops)
                seconds = time.process_time() - started
                busiest = {name: max(plan.rank_costs(flops)) / average for name, plan in plans.items()}
                greedy = max(algorithm1_loads(costs, plan_buckets(specs, bucket), dp)) / average
                rows.append(
                    BalanceRow(
                        model=model,
                        dp=dp,
                        bucket_numel=bucket,
                        lpt=max(lpt_loads(costs, dp)) / average,
                        algorithm1=greedy,
                        uniform=busiest["uniform"],
                        start_index=busiest["start_index"],
                        alpha_numel=busiest["alpha_numel"],
                        alpha_flops=busiest["alpha_flops"],
                        memory_uniform=plans["uniform"].memory_ratio,
                        memory_alpha_numel=plans["alpha_numel"].memory_ratio,
                        memory_alpha_flops=plans["alpha_flops"].memory_ratio,
                        seconds=seconds,
                    )
                )
    return rows


def memory_study(sources: Sequence[tuple[str, list[ParamSpec]]], dp_sizes: Sequence[int] = DP_SIZES,
                 ns_methods: Sequence[str] = ("gram",)) -> list[MemoryRow]:
    """The default plan against the cost-only one (the planner before memory counted), per source, pricing and DP."""
    rows = []
    for name, specs in sources:
        for ns_method in ns_methods:
            roofline = cost_model("roofline", "muon", machine_balance=MEMORY_MACHINE_BALANCE, ns_method=ns_method)
            for dp in dp_sizes:
                started = time.process_time()
                plan = plan_dp_partitions(specs, world_size=dp, bucket_numel=MEMORY_BUCKET, cost=roofline,
                                          split_numel=DEFAULT_SPLIT_NUMEL)
                seconds = time.process_time() - started
                # Before: the cost-only packing on the buckets as they were (tensors in pieces sharing
                # buckets with their neighbours), which is also a plan on the default plan's buckets.
                before, _ = alpha_balanced([spec.numel for spec in plan.specs], list(plan.costs),
                                           joint_item_buckets(plan, plan_buckets(specs, MEMORY_BUCKET)), dp)
                cost_before, memory_before = [0.0] * dp, [0.0] * dp
                for item, rank in enumerate(before):
                    cost_before[rank] += plan.costs[item]
                    memory_before[rank] += plan.memory[item]
                mean_cost, mean_memory = sum(plan.costs) / dp, sum(plan.memory) / dp
                largest = max(range(len(plan.specs)), key=lambda i: (plan.memory[i], -i))
                target = max(1.25, 1.05 * plan.memory[largest] / mean_memory)
                cost_at_target = None
                if plan.state_bytes_ratio > target:
                    try:
                        capped = plan_dp_partitions(specs, world_size=dp, bucket_numel=MEMORY_BUCKET, cost=roofline,
                                                    split_numel=DEFAULT_SPLIT_NUMEL,
                                                    max_state_bytes_per_rank=int(target * mean_memory))
                        cost_at_target = capped.flops_ratio
                    except MemoryCapError:
                        cost_at_target = float("inf")
                rows.append(MemoryRow(
                    model=name, dp=dp, lpt=max(lpt_loads(plan.costs, dp)) / mean_cost,
                    cost_before=max(cost_before) / mean_cost, memory_before=max(memory_before) / mean_memory,
                    cost_after=plan.flops_ratio, memory_after=plan.state_bytes_ratio,
                    memory_target=target, largest_memory=plan.specs[largest].name, seconds=seconds,
                    cost_at_target=cost_at_target, ns_method=ns_method))
    return rows


def joint_item_buckets(plan: DPPlan, tensor_buckets: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """``tensor_buckets`` (ranges over the planner's input tensors) as ranges over ``plan``'s items."""
    first_item: dict[int, int] = {}
    for item, (tensor, _, _) in enumerate(plan.pieces):
        first_item.setdefault(tensor, item)
    first_item[len(first_item)] = len(plan.pieces)
    return [(first_item[first], first_item[stop]) for first, stop in tensor_buckets]


def memory_markdown(rows: Sequence[MemoryRow]) -> str:
    lines = [
        "| model | NS | DP | LPT | cost before | cost after | vs LPT | memory before | memory after | target | met "
        "| cost with memory capped at target |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for row in rows:
        met = {(True, True): "both", (True, False): "cost", (False, True): "memory"}.get((row.cost_ok, row.memory_ok),
                                                                                       "neither")
        lines.append(
            f"| {row.model} | {row.ns_method} | {row.dp} | {row.lpt:.3f} | {row.cost_before:.3f} | **{row.cost_after:.3f}** "
            f"| {row.cost_after / row.lpt - 1:+.1%} | {row.memory_before:.3f} | **{row.memory_after:.3f}** "
            f"| {row.memory_target:.3f} | {met} | {_capped_cell(row.cost_at_target)} |"
        )
    return "\n".join(lines)


def _capped_cell(value: float | None) -> str:
    if value is None:
        return ""
    return "no plan" if value == float("inf") else f"{value:.3f}"


def family_specs(names: Sequence[str], folder: str) -> list[tuple[str, list[ParamSpec]]]:
    """Specs of ``FAMILY_CONFIGS`` entries, each written as ``folder/<name>/config.json`` and read back."""
    import os

    from ...plan import specs_from_hf_config

    sources = []
    for name in names:
        directory = os.path.join(folder, name)
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, "config.json"), "w", encoding="utf-8") as handle:
            json.dump(FAMILY_CONFIGS[name], handle, indent=1)
        sources.append((name, specs_from_hf_config(directory)))
    return sources


def algorithm1_loads(
    costs: Sequence[float], buckets: Sequence[tuple[int, int]], world: int, alpha: float = 1.0
) -> list[float]:
    """Per-rank loads of the paper's Algorithm 1 as we read it, for reference in the table.

    Buckets in decreasing cost (LPT rule); for each, the target per rank is
    (1 - alpha)·C/R + alpha·(C spread in proportion to each rank's deficit against the running
    ideal average); the targets become consecutive cost intervals, and each tensor goes to the
    rank whose interval holds its cost-start. Each bucket is cut on its own, against the loads
    the buckets before it left.
    """
    loads = [0.0] * world
    order = sorted(range(len(buckets)), key=lambda b: (-sum(costs[buckets[b][0] : buckets[b][1]]), b))
    for b in order:
        first, stop = buckets[b]
        total = sum(costs[first:stop])
        ideal = (sum(loads) + total) / world
        deficit = [max(0.0, ideal - load) for load in loads]
        spread = sum(deficit)
        fill = [total * d / spread for d in deficit] if spread > 0 else [total / world] * world
        bounds = list(itertools.accumulate((1 - alpha) * total / world + alpha * f for f in fill))
        start = 0.0
        for param in range(first, stop):
            loads[min(bisect.bisect_right(bounds, start), world - 1)] += costs[param]
            start += costs[param]
    return loads


def alpha_sweep(
    model: str = "qwen3-32b", dp: int = 32, bucket_numel: int = 500_000_000, alphas: Sequence[float] = SWEEP_ALPHAS
) -> list[SweepRow]:
    specs = model_specs(model)
    rows = []
    for alpha in alphas:
        # The study is in FLOPs (the balance table's unit), whatever the runtime's default cost model.
        plan = plan_dp_partitions(specs, world_size=dp, bucket_numel=bucket_numel, alpha=alpha,
                                  cost=cost_model("flops", "muon"))
        rows.append(
            SweepRow(
                alpha=alpha, flops_ratio=plan.flops_ratio, comm_ratio=plan.comm_ratio, memory_ratio=plan.memory_ratio
            )
        )
    return rows


def balance_markdown(rows: Sequence[BalanceRow]) -> str:
    lines = [
        "| model | DP | bucket | LPT | uniform (DS Muon) | start_index | Alg. 1 (paper) | α-bal. numel | α-bal. FLOPs "
        "| vs LPT | memory: uniform / α numel / α FLOPs |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row.model} | {row.dp} | {row.bucket_numel:.0e} | {row.lpt:.3f} | {row.uniform:.2f} "
            f"| {row.start_index:.2f} | {row.algorithm1:.3f} "
            f"| {row.alpha_numel:.3f} | **{row.alpha_flops:.3f}** | {row.over_lpt:+.1%} "
            f"| {row.memory_uniform:.2f} / {row.memory_alpha_numel:.2f} / {row.memory_alpha_flops:.2f} |"
        )
    return "\n".join(lines)


def sweep_markdown(rows: Sequence[SweepRow], *, model: str, dp: int, bucket_numel: int) -> str:
    lines = [
        f"Alpha sweep, {model}, DP {dp}, bucket {bucket_numel:.0e}, Muon FLOPs cost "
        "(communication: padded uneven collectives over equal ones):",
        "",
        "| alpha | FLOPs max/avg | communication | memory max/avg |",
        "|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(f"| {row.alpha:.1f} | {row.flops_ratio:.3f} | {row.comm_ratio:.3f} | {row.memory_ratio:.3f} |")
    return "\n".join(lines)


def plot_balance(rows: Sequence[BalanceRow], sweep: Sequence[SweepRow], path: str, *, sweep_title: str) -> None:
    from ...plan.report import _pyplot

    pyplot = _pyplot()
    models = list(dict.fromkeys(row.model for row in rows))
    buckets = list(dict.fromkeys(row.bucket_numel for row in rows))
    figure = pyplot.figure(figsize=(3.2 * len(models), 3.0 * (len(buckets) + 1)))
    grid = figure.add_gridspec(len(buckets) + 1, len(models))
    series = (
        ("uniform", "uniform (DS Muon)", ":"),
        ("start_index", "start_index", "-."),
        ("algorithm1", "Alg. 1 (paper)", (0, (3, 1, 1, 1, 1, 1))),
        ("alpha_numel", "α-balanced, numel", "--"),
        ("alpha_flops", "α-balanced, FLOPs", "-"),
        ("lpt", "LPT (no buffer)", "-"),
    )
    for row_index, bucket in enumerate(buckets):
        for column, model in enumerate(models):
            axis = figure.add_subplot(grid[row_index, column])
            cells = [row for row in rows if row.model == model and row.bucket_numel == bucket]
            dps = [row.dp for row in cells]
            for attribute, label, style in series:
                color = "black" if attribute == "lpt" else None
                axis.plot(
                    dps,
                    [getattr(row, attribute) for row in cells],
                    linestyle=style,
                    marker="o",
                    markersize=3,
                    label=label,
                    color=color,
                )
            axis.set_xscale("log", base=2)
            axis.set_yscale("log")
            axis.set_xticks(dps, [str(dp) for dp in dps])
            axis.set_title(f"{model}, bucket {bucket:.0e}", fontsize=9)
            if column == 0:
                axis.set_ylabel("busiest / ideal FLOPs")
            if row_index == len(buckets) - 1:
                axis.set_xlabel("DP")
    figure.axes[0].legend(fontsize=7)
    axis = figure.add_subplot(grid[len(buckets), :])
    alphas = [row.alpha for row in sweep]
    axis.plot(alphas, [row.flops_ratio for row in sweep], "-o", label="FLOPs max/avg")
    axis.plot(alphas, [row.comm_ratio for row in sweep], "-s", label="communication (padded / even)")
    axis.plot(alphas, [row.memory_ratio for row in sweep], "-^", label="memory max/avg")
    axis.set_yscale("log")
    axis.set_xlabel("alpha")
    axis.set_title(sweep_title, fontsize=9)
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    pyplot.close(figure)


def run_balance(args: argparse.Namespace) -> int:
    models = [name.strip().lower() for name in args.models.split(",")]
    dps = [int(value) for value in args.dp.split(",")]
    if args.memory:
        return run_memory(args, models, dps)
    buckets = [int(float(value)) for value in args.buckets.split(",")]
    rows = balance_study(models, dps, buckets)
    sweep = alpha_sweep(args.sweep_model, args.sweep_dp, args.sweep_bucket)
    print(balance_markdown(rows))
    print()
    worst = max(rows, key=lambda row: row.over_lpt)
    print(
        f"α-balanced FLOPs vs LPT: worst {worst.over_lpt:+.2%} "
        f"({worst.model}, DP {worst.dp}, bucket {worst.bucket_numel:.0e}); "
        f"within 2% in {sum(row.over_lpt <= 0.02 for row in rows)}/{len(rows)} cells; "
        f"slowest plan {max(row.seconds for row in rows):.2f} CPU s"
    )
    print()
    print(sweep_markdown(sweep, model=args.sweep_model, dp=args.sweep_dp, bucket_numel=args.sweep_bucket))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(
                {"balance": [asdict(row) for row in rows], "alpha_sweep": [asdict(row) for row in sweep]},
                handle,
                indent=1,
            )
    if args.plot:
        title = f"alpha sweep: {args.sweep_model}, DP {args.sweep_dp}, bucket {args.sweep_bucket:.0e}"
        plot_balance(rows, sweep, args.plot, sweep_title=title)
        print(f"\nplot written to {args.plot}")
    return 0


def run_memory(args: argparse.Namespace, models: list[str], dps: list[int]) -> int:
    import tempfile

    sources = [(model, model_specs(model)) for model in models]
    if args.families:
        with tempfile.TemporaryDirectory() as folder:
            sources += family_specs(list(FAMILY_CONFIGS), folder)
    rows = memory_study(sources, dps, [method.strip() for method in args.ns_methods.split(",")])
    print(memory_markdown(rows))
    print()
    print(f"cost within 2% of LPT in {sum(row.cost_ok for row in rows)}/{len(rows)} cells, memory within target in "
          f"{sum(row.memory_ok for row in rows)}/{len(rows)}; "
          f"slowest plan {max(row.seconds for row in rows):.2f} CPU s")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({"memory": [asdict(row) for row in rows]}, handle, indent=1)
    return 0


def add_balance_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--memory", action="store_true",
                        help="the default plan's cost and state bytes, before and after memory became its second "
                             "criterion (roofline, pieces, 5e8 buckets, bf16 Muon)")
    parser.add_argument("--families", action="store_true",
                        help="with --memory: also Llama-3, Gemma, Qwen2.5 and a 64-expert MoE from config.json "
                             "(needs torch and transformers)")
    parser.add_argument("--ns-methods", default="gram",
                        help="with --memory: comma-separated Newton-Schulz pricings of the Muon cost (gram, standard)")
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated shipped models")
    parser.add_argument("--dp", default=",".join(map(str, DP_SIZES)), help="comma-separated DP sizes")
    parser.add_argument("--buckets", default="4e7,5e8", help="comma-separated bucket sizes in elements")
    parser.add_argument("--sweep-model", default="qwen3-32b")
    parser.add_argument("--sweep-dp", type=int, default=32)
    parser.add_argument("--sweep-bucket", type=lambda text: int(float(text)), default=500_000_000)
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    parser.add_argument("--plot", metavar="FILE.png", help="also draw them (needs matplotlib)")


BALANCE = Command(
    description="Load balance of the DP strategies on the shipped Qwen3 configs, against LPT.",
    add_arguments=add_balance_arguments,
    run=run_balance,
)


# --------------------------------------------------------------------------------------------
# plan-speed
# --------------------------------------------------------------------------------------------


def layered_specs(count: int, model: str = "qwen3-8b") -> list[ParamSpec]:
    """``count`` tensors repeating one decoder layer of ``model``: a very deep transformer."""
    layer = [spec for spec in model_specs(model) if spec.name.startswith("model.layers.0.")]
    specs = []
    while len(specs) < count:
        depth = len(specs) // len(layer)
        for spec in layer[: count - len(specs)]:
            specs.append(
                ParamSpec(name=spec.name.replace(".0.", f".{depth}.", 1), shape=spec.shape, matrix=spec.matrix)
            )
    return specs


def random_specs(count: int, seed: int = 0) -> list[ParamSpec]:
    """``count`` tensors of random shapes (a third of them 1-D), from a fixed seed."""
    rng = random.Random(seed)
    dims = (256, 512, 1024, 2048, 3072, 4096, 5120, 8192, 14336)
    specs = []
    for index in range(count):
        if rng.random() < 1 / 3:
            specs.append(ParamSpec(name=f"vector{index}", shape=(rng.choice(dims),), matrix=False))
        else:
            specs.append(ParamSpec(name=f"matrix{index}", shape=(rng.choice(dims), rng.choice(dims)), matrix=True))
    return specs


def plan_speed(
    count: int = 10_000, dp: int = 1024, bucket_numel: int = 500_000_000, repeats: int = 3
) -> list[dict[str, Any]]:
    results = []
    flops = cost_model("flops", "muon")
    for name, specs in (("layered qwen3-8b", layered_specs(count)), ("random shapes", random_specs(count))):
        times = []
        plan = None
        for _ in range(repeats):
            started = time.process_time()
            plan = plan_dp_partitions(specs, world_size=dp, bucket_numel=bucket_numel, cost=flops)
            times.append(time.process_time() - started)
        assert plan is not None
        results.append(
            {
                "input": name,
                "tensors": len(specs),
                "dp": dp,
                "bucket_numel": bucket_numel,
                "buckets": len(plan.buckets),
                "median_seconds": statistics.median(times),
                "flops_ratio": plan.flops_ratio,
                "lpt_ratio": max(lpt_loads(plan.costs, dp)) * dp / sum(plan.costs),
            }
        )
    return results


def run_plan_speed(args: argparse.Namespace) -> int:
    results = plan_speed(args.tensors, args.dp, args.bucket_numel, args.repeats)
    print("| input | tensors | DP | bucket | buckets | median CPU time | FLOPs max/avg | LPT |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for result in results:
        print(
            f"| {result['input']} | {result['tensors']:,} | {result['dp']} | {result['bucket_numel']:.0e} "
            f"| {result['buckets']} "
            f"| {result['median_seconds']:.2f} s | {result['flops_ratio']:.3f} | {result['lpt_ratio']:.3f} |"
        )
    return 0


def add_plan_speed_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tensors", type=int, default=10_000)
    parser.add_argument("--dp", type=int, default=1024)
    parser.add_argument("--bucket-numel", type=lambda text: int(float(text)), default=500_000_000)
    parser.add_argument("--repeats", type=int, default=3)


PLAN_SPEED = Command(
    description="Time the DP planner on 10,000 tensors for DP=1024.",
    add_arguments=add_plan_speed_arguments,
    run=run_plan_speed,
)
