"""``python -m ds_canzona.bench plan-bounds``: the default plan on shapes no shipped config has, and a lower bound.

The planner's two targets (docs/PLANNER.md): the busiest rank's cost within 2% of unconstrained
LPT, and its state bytes within max(1.25 x the average, 1.05 x the largest item). The shipped
grid meets both (tests/test_plan_memory_target.py); this command plans a wider grid of shapes
(``SHAPES``: the Qwen3 architecture at other sizes, tied and untied; 16-expert MoEs with experts
as 3-D stacks, as transformers 5 builds Qwen3-MoE and OLMoE, and as one 2-D matrix per expert
projection; Qwen3-30B-A3B's and OLMoE-1B-7B's published sizes) at DP 16-128 with both
Newton-Schulz pricings, and says of every miss whether it is out of reach.

The bound: a configuration LP. A plan with every rank's cost within the capacity ``1.02 x LPT``
is W rank contents, each within that capacity and, if the busiest rank holds at most M bytes,
within M. Count rank contents by the number of items of each class (items alike in cost and
bytes) they hold: then the plan is a choice of W such contents covering every item. Taken
fractionally, covering rather than partitioning, and with the items under 1% of an average
rank in both cost and bytes left out, that is a linear program that accepts every M a plan
reaches, in any buffer order (so the planner's too); the least M it accepts (bisection,
``BISECTION_STEPS``) is a lower bound on the busiest memory of any plan within the capacity. A
cell whose bound is at or above the target is out of reach.

The order: where the bound is below the target, and for every cost miss, the exact search over
the buffer's chains (``ds_canzona.plan._chain_grid``; ``order_search``) asks whether any plan in
this buffer order has every rank within 1.02x LPT (and, for a memory miss, within the target).
On the relaxed chains (items under 0.1% of an average rank left out, buckets of alike pieces laid
end to end) a "no" is a proof: the cell is out of reach. On the restricted chains (those small
items kept with a neighbour) a "yes" is a plan the planner missed: the cell stays open. Buffers
of too many chains (MoEs with many buckets) are not decided.

Needs scipy for the LP (``scipy.optimize.linprog``); without it the bound column says so.
Shapes with MoE stacks are built through ``specs_from_hf_config`` (torch and transformers).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from ...cli import Command
from ...plan import (DPPlan, ParamSpec, cost_model, load_model_config, lpt_loads, plan_dp_partitions, qwen3_specs,
                     specs_from_hf_config)
from ...plan._chain_grid import chain_layout, relaxed_chains, restricted_chains
from ...plan._memory_fit import MAKESPAN_OVER_LPT, MEMORY_OVER_AVERAGE, MEMORY_OVER_LARGEST
from ...plan.dp import DEFAULT_SPLIT_NUMEL

__all__ = ["PLAN_BOUNDS", "SHAPES", "BoundRow", "configuration_bound", "moe_2d_expert_specs", "plan_bound_row"]

DP_SIZES = (16, 32, 64, 128)
PRICINGS = ("gram", "standard")
BUCKET = 500_000_000
MACHINE_BALANCE = 150.0  # `ds-canzona plan`'s default (a GPU's)
# Items under this fraction of an average rank in both cost and bytes are left out of the bound.
NEGLIGIBLE = 0.01
BISECTION_STEPS = 24
MAX_CONFIGURATIONS = 200_000


# ---------------------------------------------------------------------------------------- shapes

def dense_qwen3_specs(*, hidden: int, inter: int, layers: int, heads: int, kv_heads: int, tied: bool) -> list[ParamSpec]:
    """The Qwen3 architecture at other sizes (152k vocabulary; head_dim 128 from hidden 2048 up)."""
    config = dict(load_model_config("qwen3-8b"))
    config.update(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=kv_heads, head_dim=128 if hidden >= 2048 else hidden // heads,
                  tie_word_embeddings=tied)
    return qwen3_specs(config)


def moe_2d_expert_specs(*, layers: int, hidden: int, inter: int, experts: int, vocab: int, heads: int, kv_heads: int,
                        head_dim: int) -> list[ParamSpec]:
    """A MoE whose experts are separate 2-D matrices (one Linear per expert projection), untied head."""
    specs = [ParamSpec(name="model.embed_tokens.weight", shape=(vocab, hidden), matrix=False)]
    for layer in range(layers):
        prefix = f"model.layers.{layer}"
        specs += [ParamSpec(name=f"{prefix}.self_attn.q_proj.weight", shape=(heads * head_dim, hidden), matrix=True),
                  ParamSpec(name=f"{prefix}.self_attn.k_proj.weight", shape=(kv_heads * head_dim, hidden), matrix=True),
                  ParamSpec(name=f"{prefix}.self_attn.v_proj.weight", shape=(kv_heads * head_dim, hidden), matrix=True),
                  ParamSpec(name=f"{prefix}.self_attn.o_proj.weight", shape=(hidden, heads * head_dim), matrix=True),
                  ParamSpec(name=f"{prefix}.mlp.gate.weight", shape=(experts, hidden), matrix=True)]
        for expert in range(experts):
            specs += [ParamSpec(name=f"{prefix}.mlp.experts.{expert}.gate_proj.weight", shape=(inter, hidden), matrix=True),
                      ParamSpec(name=f"{prefix}.mlp.experts.{expert}.up_proj.weight", shape=(inter, hidden), matrix=True),
                      ParamSpec(name=f"{prefix}.mlp.experts.{expert}.down_proj.weight", shape=(hidden, inter), matrix=True)]
        specs += [ParamSpec(name=f"{prefix}.input_layernorm.weight", shape=(hidden,), matrix=False),
                  ParamSpec(name=f"{prefix}.post_attention_layernorm.weight", shape=(hidden,), matrix=False)]
    specs.append(ParamSpec(name="model.norm.weight", shape=(hidden,), matrix=False))
    specs.append(ParamSpec(name="lm_head.weight", shape=(vocab, hidden), matrix=False))
    return specs


def _hf_specs(config: dict) -> list[ParamSpec]:
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "config.json")
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(config, handle)
        return specs_from_hf_config(path)


def qwen3_moe_specs(*, hidden: int, moe_inter: int, layers: int, heads: int, kv_heads: int, experts: int,
                    top_k: int) -> list[ParamSpec]:
    """transformers' Qwen3-MoE (experts as 3-D stacks ``gate_up_proj`` and ``down_proj``), untied."""
    return _hf_specs({"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 151936,
                      "hidden_size": hidden, "intermediate_size": 4 * moe_inter, "moe_intermediate_size": moe_inter,
                      "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
                      "head_dim": 128, "num_experts": experts, "num_local_experts": experts,
                      "num_experts_per_tok": top_k, "decoder_sparse_step": 1, "mlp_only_layers": [],
                      "attention_bias": False, "tie_word_embeddings": False})


def olmoe_specs(*, hidden: int, inter: int, layers: int, heads: int, experts: int) -> list[ParamSpec]:
    """transformers' OLMoE (experts as 3-D stacks), 50k vocabulary, untied."""
    return _hf_specs({"model_type": "olmoe", "architectures": ["OlmoeForCausalLM"], "vocab_size": 50304,
                      "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
                      "num_attention_heads": heads, "num_key_value_heads": heads, "num_experts": experts,
                      "num_experts_per_tok": 4, "attention_bias": False, "tie_word_embeddings": False})


def _shapes() -> dict[str, tuple[Callable[..., list[ParamSpec]], dict]]:
    shapes: dict[str, tuple[Callable[..., list[ParamSpec]], dict]] = {}
    for hidden, inter, layers, heads, kv in [(1024, 2816, 16, 16, 8), (1280, 3456, 20, 10, 2), (1536, 4608, 24, 12, 4),
                                             (2048, 5632, 24, 16, 8), (2048, 8192, 16, 16, 8), (2560, 6912, 32, 20, 4),
                                             (3072, 8192, 32, 24, 8), (3584, 18944, 28, 28, 4), (4096, 14336, 32, 32, 8),
                                             (5120, 13824, 40, 40, 8), (6144, 16384, 48, 48, 8), (8192, 28672, 32, 64, 8)]:
        for tied in (False, True) if hidden <= 2048 else (False,):
            shapes[f"dense-h{hidden}-i{inter}-l{layers}{'-tied' if tied else ''}"] = (
                dense_qwen3_specs, dict(hidden=hidden, inter=inter, layers=layers, heads=heads, kv_heads=kv, tied=tied))
    for hidden, moe_inter, layers in [(1024, 512, 16), (1536, 768, 28), (2048, 512, 48), (2048, 768, 24),
                                      (2048, 1408, 24), (3072, 768, 32), (4096, 1536, 48)]:
        shapes[f"qwen3moe16-h{hidden}-mi{moe_inter}-l{layers}"] = (
            qwen3_moe_specs, dict(hidden=hidden, moe_inter=moe_inter, layers=layers, heads=max(8, hidden // 128),
                                  kv_heads=4, experts=16, top_k=4))
    for hidden, inter, layers in [(1024, 512, 16), (2048, 1024, 16), (2048, 2048, 24)]:
        shapes[f"olmoe16-h{hidden}-i{inter}-l{layers}"] = (
            olmoe_specs, dict(hidden=hidden, inter=inter, layers=layers, heads=16, experts=16))
    for hidden, inter, layers in [(1024, 512, 16), (2048, 768, 24), (2048, 1408, 16), (4096, 1536, 32)]:
        shapes[f"moe2d16-h{hidden}-i{inter}-l{layers}"] = (
            moe_2d_expert_specs, dict(layers=layers, hidden=hidden, inter=inter, experts=16, vocab=151936,
                                      heads=max(8, hidden // 128), kv_heads=4, head_dim=128))
    # Published sizes (experts as stacks).
    shapes["qwen3-30b-a3b"] = (qwen3_moe_specs, dict(hidden=2048, moe_inter=768, layers=48, heads=32, kv_heads=4,
                                                     experts=128, top_k=8))
    shapes["olmoe-1b-7b"] = (olmoe_specs, dict(hidden=2048, inter=1024, layers=16, heads=16, experts=64))
    return shapes


SHAPES = _shapes()


# ------------------------------------------------------------------------------------ the bound

def _classes(costs: Sequence[float], memory: Sequence[float]) -> list[tuple[float, float, int]]:
    """(cost, bytes, count) of each class of alike items."""
    counts = Counter((round(c, 12), round(m, 12)) for c, m in zip(costs, memory))
    return sorted(((c, m, n) for (c, m), n in counts.items()), reverse=True)


def _configurations(classes: Sequence[tuple[float, float, int]], cost_capacity: float,
                    memory_capacity: float) -> list[tuple[int, ...]] | None:
    """Every count vector a rank may hold within both capacities (None past ``MAX_CONFIGURATIONS``)."""
    found: list[tuple[int, ...]] = []
    slack = 1.0 + 1e-12

    def extend(index: int, cost: float, held: float, counts: list[int]) -> bool:
        if index == len(classes):
            found.append(tuple(counts))
            return len(found) <= MAX_CONFIGURATIONS
        item_cost, item_memory, available = classes[index]
        k = 0
        while k <= available and cost + k * item_cost <= cost_capacity * slack \
                and held + k * item_memory <= memory_capacity * slack:
            counts.append(k)
            going = extend(index + 1, cost + k * item_cost, held + k * item_memory, counts)
            counts.pop()
            if not going:
                return False
            k += 1
        return True

    return found if extend(0, 0.0, 0.0, []) else None


def _ranks_needed(classes: Sequence[tuple[float, float, int]], configurations: list[tuple[int, ...]]) -> float:
    """The LP: the fewest (fractional) rank contents covering every item."""
    from scipy.optimize import linprog

    matrix = [[-float(configuration[k]) for configuration in configurations] for k in range(len(classes))]
    result = linprog([1.0] * len(configurations), A_ub=matrix, b_ub=[-float(n) for _, _, n in classes],
                     bounds=(0, None), method="highs")
    return float(result.fun) if result.status == 0 else float("inf")


def configuration_bound(costs: Sequence[float], memory: Sequence[float], world: int, cost_capacity: float) -> float | None:
    """A lower bound on the busiest rank's bytes of any plan with every rank's cost within ``cost_capacity``.

    In the units of ``memory``; None where the configurations are too many to enumerate. Raises
    ImportError without scipy.
    """
    average_cost, average_memory = sum(costs) / world, sum(memory) / world
    kept = [i for i in range(len(costs))
            if costs[i] > NEGLIGIBLE * average_cost or memory[i] > NEGLIGIBLE * average_memory]
    classes = _classes([costs[i] for i in kept], [memory[i] for i in kept])

    def reachable(memory_capacity: float) -> bool | None:
        configurations = _configurations(classes, cost_capacity, memory_capacity)
        if configurations is None:
            return None
        return _ranks_needed(classes, configurations) <= world * (1.0 + 1e-9)

    low = max((m for _, m, _ in classes), default=0.0)
    high = max(2.0 * low, sum(memory))
    top = reachable(high)
    if top is None:
        return None
    if not top:  # not even one rank's worth of room per class: the cost capacity alone is infeasible
        return float("inf")
    for _ in range(BISECTION_STEPS):
        middle = (low + high) / 2.0
        answer = reachable(middle)
        if answer is None:
            return None
        if answer:
            high = middle
        else:
            low = middle
    return low


# ------------------------------------------------------------------------------------ the study

@dataclass(frozen=True)
class BoundRow:
    shape: str
    pricing: str
    dp: int
    cost_over_lpt: float
    memory_over_average: float
    target_over_average: float
    bound_over_average: float | None  # None: not computed (see ``note``)
    # The exact search in the buffer's order, for a miss (``order_search``): "no plan", "a plan"
    # (the planner missed it), "not decided" (too many chains), "" (not asked: the cell is met).
    order: str
    verdict: str  # "met", "out of reach", "open" (memory), "cost open"
    note: str
    seconds: float


def plan_bound_row(shape: str, pricing: str, world: int, *, with_bound: bool = True) -> BoundRow:
    build, arguments = SHAPES[shape]
    specs = build(**arguments)
    cost = cost_model("roofline", "muon", machine_balance=MACHINE_BALANCE, ns_method=pricing)
    start = time.process_time()
    plan = plan_dp_partitions(specs, world_size=world, bucket_numel=BUCKET, cost=cost, split_numel=DEFAULT_SPLIT_NUMEL)
    seconds = time.process_time() - start
    lpt = max(lpt_loads(plan.costs, world))
    average = sum(plan.memory) / world
    target = max(MEMORY_OVER_AVERAGE * average, MEMORY_OVER_LARGEST * max(plan.memory))
    cost_ratio = max(plan.rank_costs()) / lpt
    peak = max(plan.rank_memory())
    cost_met = cost_ratio <= (1.0 + MAKESPAN_OVER_LPT) * (1.0 + 1e-12)
    memory_met = peak <= target * (1.0 + 1e-12)
    bound, note = None, ""
    if with_bound and not memory_met:
        try:
            value = configuration_bound([c / lpt for c in plan.costs], [m / average for m in plan.memory], world,
                                        1.0 + MAKESPAN_OVER_LPT)
        except ImportError:
            note = "no scipy: bound not computed"
        else:
            if value is None:
                note = f"over {MAX_CONFIGURATIONS} rank contents: bound not computed"
            else:
                bound = value
    order = ""
    over_lpt = (1.0 + MAKESPAN_OVER_LPT) * lpt
    if not cost_met:
        order = order_search(plan, world, over_lpt, math.inf)
        verdict = "out of reach" if order == "no plan" else "cost open"
    elif memory_met:
        verdict = "met"
    elif bound is not None and bound >= (target / average) * (1.0 - 1e-9):
        verdict = "out of reach"
    else:
        order = order_search(plan, world, over_lpt, target)
        verdict = "out of reach" if order == "no plan" else "open"
    return BoundRow(shape=shape, pricing=pricing, dp=world, cost_over_lpt=cost_ratio, memory_over_average=peak / average,
                    target_over_average=target / average, bound_over_average=bound, order=order, verdict=verdict,
                    note=note, seconds=seconds)


def order_search(plan: DPPlan, world: int, capacity: float, memory_capacity: float) -> str:
    """Whether any plan in ``plan``'s buffer order has every rank within both capacities (the exact
    chain-grid search, ``ds_canzona.plan._chain_grid``): "no plan" (its relaxed chains have no
    layout: a proof), "a plan" (its restricted chains have one: a plan of the buffer), or "not
    decided" (too many chains for the grid, or neither answer)."""
    buckets = [(bucket.first, bucket.stop) for bucket in plan.buckets]
    costs, memory = list(plan.costs), list(plan.memory)
    relaxed = chain_layout(relaxed_chains(buckets, costs, memory, world), costs, memory, world, capacity,
                           memory_capacity)
    if relaxed is False:
        return "no plan"
    if relaxed is None:
        return "not decided"
    restricted = chain_layout(restricted_chains(buckets, costs, memory, world), costs, memory, world, capacity,
                              memory_capacity)
    return "a plan" if isinstance(restricted, dict) else "not decided"


def markdown(rows: Sequence[BoundRow], *, misses_only: bool) -> str:
    lines = ["| shape | pricing | DP | busiest cost / LPT | busiest bytes / average | target | bound | in order | verdict |",
             "|---|---|---:|---:|---:|---:|---:|---|---|"]
    for row in rows:
        if misses_only and row.verdict == "met":
            continue
        bound = "-" if row.bound_over_average is None else f"{row.bound_over_average:.3f}"
        lines.append(f"| {row.shape} | {row.pricing} | {row.dp} | {row.cost_over_lpt:.4f} | "
                     f"{row.memory_over_average:.3f} | {row.target_over_average:.3f} | {bound} | {row.order or '-'} | "
                     f"{row.verdict} |")
    verdicts = Counter(row.verdict for row in rows)
    lines.append("")
    lines.append(f"{len(rows)} cells: " + ", ".join(f"{verdicts[v]} {v}" for v in ("met", "out of reach", "open", "cost open")))
    return "\n".join(lines)


def add_plan_bounds_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shapes", default=None, help=f"comma-separated shapes (default: all {len(SHAPES)})")
    parser.add_argument("--dp", default=",".join(map(str, DP_SIZES)), help="comma-separated DP sizes")
    parser.add_argument("--pricings", default=",".join(PRICINGS), help="Newton-Schulz pricings of the Muon cost")
    parser.add_argument("--processes", type=int, default=1, help="plan cells in this many processes")
    parser.add_argument("--all", action="store_true", help="print every cell, not only the misses")
    parser.add_argument("--json", metavar="FILE", help="also write every row as JSON")


def rows_of_cells(args: argparse.Namespace, command: str, known: Sequence[str], row: Callable, *,
                  unknown_label: str = "unknown") -> list:
    """``row(shape, pricing, dp)`` for every cell the command line asks for (``--shapes`` among
    ``known``, ``--pricings``, ``--dp``), in ``--processes`` processes; ``row`` must pickle."""
    shapes = list(known) if args.shapes is None else [s.strip() for s in args.shapes.split(",") if s.strip()]
    unknown = [s for s in shapes if s not in known]
    if unknown:
        raise SystemExit(f"{command}: {unknown_label} shape(s) {', '.join(unknown)}; known: {', '.join(known)}")
    cells = [(shape, pricing, int(dp)) for shape in shapes for pricing in args.pricings.split(",")
             for dp in args.dp.split(",")]
    if args.processes > 1:
        from multiprocessing import Pool

        with Pool(args.processes) as pool:
            return pool.starmap(row, cells)
    return [row(*cell) for cell in cells]


def run_plan_bounds(args: argparse.Namespace) -> int:
    rows = rows_of_cells(args, "plan-bounds", list(SHAPES), plan_bound_row)
    print(markdown(rows, misses_only=not args.all))
    notes = sorted({row.note for row in rows if row.note})
    for note in notes:
        print(f"note: {note}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({"rows": [asdict(row) for row in rows]}, handle, indent=1)
    return 0


PLAN_BOUNDS = Command(
    description="The default plan on shapes no shipped config has, against a configuration-LP lower bound.",
    add_arguments=add_plan_bounds_arguments,
    run=run_plan_bounds,
)
