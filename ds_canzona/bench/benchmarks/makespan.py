"""``python -m ds_canzona.bench makespan``: the optimizer step at DP 16-128, emulated with real compute.

This machine cannot run 128 ranks, but the optimizer step of data parallelism needs no
communication inside the math: each rank updates the tensors it holds, and the step ends when the
busiest rank does. So the step's makespan at DP=R is the largest per-rank sum of per-tensor
update times. Here:

1. A shipped Qwen3 config is scaled down (``--scale s`` divides the hidden size, the
   intermediate size, the number of attention and KV heads and the vocabulary by s; the layer count
   and head dim stay), so every layer keeps its shapes' proportions and the model keeps its
   number of tensors, which is what sets the balance at large DP.
2. Each distinct tensor shape's update (the same per-tensor rule the runtime runs: Muon with
   Gram Newton-Schulz in fp32 for matrices, AdamW for the rest) is timed on this machine, one
   thread, median of ``--repeats``.
3. Every strategy's assignment is charged those times, per rank, at each DP size:

   - ds_canzona (alpha-balanced, alpha 1, roofline cost with this machine's default balance,
     non-matrix tensors in pieces of ``DEFAULT_SPLIT_NUMEL`` scaled by 1/s^2 like the model):
     the plan the runtime computes here;
   - ds_canzona with every tensor whole (the same cost), and with whole tensors and the FLOPs
     cost model (which prices AdamW's memory-bound passes as free);
   - start-index: equal cuts, each tensor owned by the rank holding its start (the paper's naive
     start-index ownership);
   - DeepSpeed 0.19.8's Muon: equal partitions of each param group (Muon group sorted by size),
     a straddling matrix orthogonalised on every rank it touches;
   - layer-wise: whole-tensor LPT owners over the same roofline cost (unconstrained by the buffer);
   - synchronous: every rank updates every tensor.

It reports the busiest rank's time and its ratio to ds_canzona's, and the ideal (total / DP); and,
for the ds_canzona plans and layer-wise LPT, the busiest rank's state bytes (fp32 model: Muon
momentum or AdamW moments, and the gradient segment; ``ds_canzona.plan.memory``) over the average.

``--timings FILE`` reuses the per-shape times of an earlier ``--json FILE`` instead of timing
again (shapes it lacks are timed), so the plans can be re-scored without a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from ...cli import Command, OneLineParser

__all__ = ["MAKESPAN", "MakespanRow", "main", "makespan_study", "scaled_config", "time_shapes"]

STRATEGIES = ("ds_canzona", "ds_canzona_whole", "ds_canzona_flops", "start_index", "deepspeed_muon", "layerwise",
              "synchronous")
LABELS = {
    "ds_canzona": "ds_canzona",
    "ds_canzona_whole": "ds_canzona, whole tensors",
    "ds_canzona_flops": "ds_canzona, whole, FLOPs cost",
    "start_index": "start-index",
    "deepspeed_muon": "DeepSpeed Muon",
    "layerwise": "layer-wise (LPT)",
    "synchronous": "synchronous",
}


def scaled_config(name: str, scale: int) -> dict[str, Any]:
    """A shipped Qwen3 config with hidden, intermediate, heads, KV heads and vocab divided by ``scale``."""
    from ...plan import load_model_config

    config = dict(load_model_config(name))
    if scale < 1:
        raise ValueError(f"--scale must be >= 1, got {scale}")
    heads = int(config["num_attention_heads"])
    config["head_dim"] = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    for key in ("hidden_size", "intermediate_size", "vocab_size"):
        config[key] = max(1, int(config[key]) // scale)
    config["num_attention_heads"] = max(1, heads // scale)
    config["num_key_value_heads"] = max(1, int(config.get("num_key_value_heads") or heads) // scale)
    return config


def _piece_size(text: str) -> int:
    """--split-numel: a non-negative element count (0: whole tensors)."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"invalid piece size {text!r}: must be 0 (whole tensors) or positive")
    return value


def _rule(kind: str, ns_method: str):
    from ...optim import rule_for_group

    if kind == "muon":
        return rule_for_group({"kind": "muon", "ns_method": ns_method})
    return rule_for_group({"kind": "adamw"})


def time_shapes(shapes: Sequence[tuple[tuple[int, ...], bool]], *, ns_method: str = "gram", repeats: int = 5,
                threads: int = 1, log=None) -> dict[tuple[tuple[int, ...], bool], float]:
    """Median seconds of one update of each (shape, matrix) with the runtime's per-tensor rule."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        generator = torch.Generator().manual_seed(0)
        work = []
        for shape, matrix in shapes:
            rule = _rule("muon" if matrix else "adamw", ns_method)
            param = torch.randn(shape, generator=generator) * 0.02
            state = rule.init_state(param)
            grad = torch.randn(shape, generator=generator)
            rule.update_([param], [grad], [state], lr=1e-3)  # warm-up
            work.append((rule, param, grad, state))
        # Round-robin over the shapes, so a burst of load on the machine hits all of them alike.
        samples: list[list[float]] = [[] for _ in shapes]
        for _ in range(repeats):
            for index, (rule, param, grad, state) in enumerate(work):
                started = time.perf_counter()
                rule.update_([param], [grad], [state], lr=1e-3)
                samples[index].append(time.perf_counter() - started)
        out = {}
        for (shape, matrix), times in zip(shapes, samples):
            out[(tuple(shape), matrix)] = statistics.median(times)
            if log:
                log(f"  {'muon ' if matrix else 'adamw'} {tuple(shape)}: {out[(tuple(shape), matrix)] * 1e3:.1f} ms")
        return out
    finally:
        torch.set_num_threads(previous)


@dataclass(frozen=True, kw_only=True)
class MakespanRow:
    """One (model, DP) cell: the busiest rank's seconds per strategy."""

    model: str
    scale: int
    dp: int
    bucket_numel: int
    ideal: float
    machine_balance: float
    split_numel: int | None  # None: whole tensors
    ds_canzona: float
    ds_canzona_whole: float
    ds_canzona_flops: float
    start_index: float
    deepspeed_muon: float
    layerwise: float
    synchronous: float
    deepspeed_ns_runs: int
    matrices: int
    state_mib: float = 0.0
    """ds_canzona's busiest rank's state, MiB."""
    state_ratio: float = 0.0
    """Busiest rank's state over the average: ds_canzona, whole tensors, layer-wise (LPT)."""
    state_ratio_whole: float = 0.0
    state_ratio_layerwise: float = 0.0

    def ratio(self, strategy: str) -> float:
        return getattr(self, strategy) / self.ds_canzona


def makespan_study(models: Sequence[str], *, scale: int, dps: Sequence[int], bucket_numel: int | None,
                   machine_balance: float, split_numel: int | None = None, ns_method: str = "gram", repeats: int = 5,
                   stored: dict[str, Any] | None = None, log=None) -> tuple[list[MakespanRow], dict[str, Any]]:
    from ...plan import DEFAULT_SPLIT_NUMEL, cost_model, default_launch_bytes, plan_dp_partitions, qwen3_specs
    from ...plan.memory import memory_model
    from .baselines import deepspeed_muon_loads, layerwise_loads, lpt_owners, plan_loads, synchronous_loads

    memory = memory_model("muon", param_bytes=4)  # the shapes are timed in fp32

    cost = cost_model("roofline", "muon", machine_balance=machine_balance, ns_method=ns_method,
                      launch_bytes=default_launch_bytes("cpu"), device="cpu")  # the timings it scores are the CPU's
    flops = cost_model("flops", "muon", ns_method=ns_method)
    rows: list[MakespanRow] = []
    timings: dict[str, Any] = {}
    for model in models:
        config = scaled_config(model, scale)
        specs = qwen3_specs(config)
        # The runtime's piece size, scaled with the model's elements like the bucket; 0 means
        # whole tensors, as in the config and `ds-canzona plan`.
        split = max(1, DEFAULT_SPLIT_NUMEL // (scale * scale)) if split_numel is None else (split_numel or None)
        shapes = list(dict.fromkeys((tuple(spec.shape), spec.matrix) for spec in specs))
        if log:
            log(f"{model} / {scale}: hidden {config['hidden_size']}, intermediate {config['intermediate_size']}, "
                f"{config['num_hidden_layers']} layers, vocab {config['vocab_size']}: timing {len(shapes)} shapes")
        reused = {(tuple(entry["shape"]), entry["matrix"]): entry["seconds"] for entry in (stored or {}).get(model, [])}
        missing = [shape for shape in shapes if shape not in reused]
        if log and reused:
            log(f"  reusing stored times of {len(shapes) - len(missing)} shapes, timing {len(missing)}")
        timed = time_shapes(missing, ns_method=ns_method, repeats=repeats, log=log) if missing else {}
        measured = {**reused, **timed}
        measured = {shape: measured[shape] for shape in shapes}
        timings[model] = [{"shape": list(shape), "matrix": matrix, "seconds": seconds}
                          for (shape, matrix), seconds in measured.items()]
        times = [measured[(tuple(spec.shape), spec.matrix)] for spec in specs]
        costs = [cost.cost(spec) for spec in specs]
        # DeepSpeed's default reduce bucket (5e8 elements), scaled with the model's elements.
        bucket = bucket_numel or max(1, 500_000_000 // (scale * scale))
        item_bytes = [memory.bytes(spec) for spec in specs]
        for dp in dps:
            ours = plan_dp_partitions(specs, world_size=dp, bucket_numel=bucket, cost=cost, split_numel=split,
                                      memory=memory)
            # A piece is charged its share of the whole tensor's measured time, not its own: timed
            # alone, a small piece runs faster per element on this CPU (its temporaries stay in
            # cache), which a GPU would not repeat.
            item_times = [times[tensor] * (stop - start) / specs[tensor].numel for tensor, start, stop in ours.pieces]
            whole = plan_dp_partitions(specs, world_size=dp, bucket_numel=bucket, cost=cost, memory=memory)
            layerwise_state = [0.0] * dp
            for index, rank in enumerate(lpt_owners(costs, dp)):
                layerwise_state[rank] += item_bytes[index]
            average_state = sum(item_bytes) / dp
            by_flops = plan_dp_partitions(specs, world_size=dp, bucket_numel=bucket, cost=flops)
            naive = plan_dp_partitions(specs, world_size=dp, bucket_numel=bucket, strategy="start_index", cost=cost)
            deepspeed, runs = deepspeed_muon_loads(specs, times, dp)
            rows.append(MakespanRow(
                model=model, scale=scale, dp=dp, bucket_numel=bucket, ideal=sum(times) / dp,
                machine_balance=machine_balance, split_numel=split, ds_canzona=max(plan_loads(ours, item_times)),
                ds_canzona_whole=max(plan_loads(whole, times)), ds_canzona_flops=max(plan_loads(by_flops, times)),
                start_index=max(plan_loads(naive, times)),
                deepspeed_muon=max(deepspeed), layerwise=max(layerwise_loads(costs, times, dp)),
                synchronous=max(synchronous_loads(times, dp)), deepspeed_ns_runs=runs,
                matrices=sum(spec.matrix for spec in specs), state_mib=max(ours.rank_memory()) / 2**20,
                state_ratio=ours.state_bytes_ratio, state_ratio_whole=whole.state_bytes_ratio,
                state_ratio_layerwise=max(layerwise_state) / average_state))
    return rows, timings


def makespan_markdown(rows: Sequence[MakespanRow]) -> str:
    lines = [
        "| model (scaled) | DP | ideal ms | " + " | ".join(f"{LABELS[s]} ms" for s in STRATEGIES)
        + " | " + " | ".join(f"{LABELS[s]} / ours" for s in STRATEGIES[1:]) + " | DS NS runs / matrices "
        + "| ds_canzona state MiB, busiest | state max/avg: ds_canzona / whole / layer-wise |",
        "|---|---:|---:|" + "---:|" * (2 * len(STRATEGIES) - 1) + "---:|---:|---:|",
    ]
    for row in rows:
        times = " | ".join(f"{getattr(row, s) * 1e3:.1f}" for s in STRATEGIES)
        ratios = " | ".join(f"{row.ratio(s):.2f}x" for s in STRATEGIES[1:])
        lines.append(f"| {row.model} / {row.scale} | {row.dp} | {row.ideal * 1e3:.1f} | {times} | {ratios} "
                     f"| {row.deepspeed_ns_runs} / {row.matrices} | {row.state_mib:,.1f} "
                     f"| {row.state_ratio:.2f} / {row.state_ratio_whole:.2f} / {row.state_ratio_layerwise:.2f} |")
    return "\n".join(lines)


OTHERS = ("start_index", "deepspeed_muon", "layerwise", "synchronous")


def summary(rows: Sequence[MakespanRow]) -> list[str]:
    """Whether each ds_canzona variant's busiest rank is at or below every other strategy's, cell by cell."""
    lines = []
    for ours in ("ds_canzona", "ds_canzona_whole"):
        beaten = [(row, other) for row in rows for other in OTHERS if getattr(row, other) < getattr(row, ours)]
        cells = len({(row.model, row.dp) for row, _ in beaten})
        text = (f"{LABELS[ours]}: busiest rank at or below every other strategy's in {len(rows) - cells}/{len(rows)} "
                "cells")
        if beaten:
            text += "; above: " + ", ".join(
                f"{LABELS[other]} at {row.model} DP {row.dp} (ours {getattr(row, ours) / getattr(row, other):.3f}x)"
                for row, other in beaten)
        lines.append(text)
    return lines


def plot_makespan(rows: Sequence[MakespanRow], path: str) -> None:
    from ...plan.report import _pyplot

    pyplot = _pyplot()
    models = list(dict.fromkeys(row.model for row in rows))
    figure, axes = pyplot.subplots(1, len(models), figsize=(4.2 * len(models), 3.4), squeeze=False)
    for axis, model in zip(axes[0], models):
        cells = [row for row in rows if row.model == model]
        dps = [row.dp for row in cells]
        for strategy, style in zip(STRATEGIES, ("-", "-", "--", "-.", ":", "--", "-")):
            color = "black" if strategy == "ds_canzona" else None
            axis.plot(dps, [getattr(row, strategy) * 1e3 for row in cells], style, marker="o", markersize=3,
                      label=LABELS[strategy], color=color)
        axis.plot(dps, [row.ideal * 1e3 for row in cells], color="grey", linewidth=0.8, label="ideal (total / DP)")
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xticks(dps, [str(dp) for dp in dps])
        axis.set_xlabel("DP")
        axis.set_ylabel("busiest rank, ms")
        axis.set_title(f"{model} / {cells[0].scale}: optimizer step (Muon)", fontsize=9)
    axes[0][0].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    pyplot.close(figure)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", default="qwen3-8b,qwen3-32b", help="comma-separated shipped Qwen3 models")
    parser.add_argument("--scale", type=int, default=4, help="divide hidden, intermediate, heads and vocab by this")
    parser.add_argument("--dp", default="16,32,64,128", help="comma-separated DP sizes")
    parser.add_argument("--bucket-numel", type=lambda text: int(float(text)), default=None,
                        help="bucket in elements (default: DeepSpeed's 5e8 divided by scale^2)")
    parser.add_argument("--ns-method", choices=("gram", "standard"), default="gram")
    parser.add_argument("--split-numel", type=_piece_size, default=None,
                        help="piece size of non-matrix tensors, 0 for whole tensors (default: the runtime's, "
                             "divided by scale^2)")
    parser.add_argument("--machine-balance", type=float, default=None,
                        help="roofline balance, FLOPs per byte (default: the runtime's CPU default)")
    parser.add_argument("--repeats", type=int, default=5, help="timed updates per shape (median)")
    parser.add_argument("--timings", metavar="FILE",
                        help="reuse the per-shape times stored in an earlier --json FILE (shapes it lacks are timed)")
    parser.add_argument("--json", metavar="FILE", help="also write every number as JSON")
    parser.add_argument("--plot", metavar="FILE.png", help="also draw the makespans (needs matplotlib)")


def run(args: argparse.Namespace) -> int:
    models = [name.strip().lower() for name in args.models.split(",") if name.strip()]
    dps = [int(value) for value in args.dp.split(",") if value.strip()]
    if any(dp < 1 for dp in dps):
        raise ValueError(f"--dp sizes must be >= 1, got {args.dp!r}")
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    started = time.perf_counter()
    from ...plan import default_machine_balance

    balance = args.machine_balance or default_machine_balance("cpu")
    if balance <= 0:
        raise ValueError(f"--machine-balance must be > 0, got {balance}")
    stored = None
    if args.timings:
        with open(args.timings, encoding="utf-8") as handle:
            stored = json.load(handle)["timings"]
    rows, timings = makespan_study(models, scale=args.scale, dps=dps, bucket_numel=args.bucket_numel,
                                   machine_balance=balance, split_numel=args.split_numel, ns_method=args.ns_method,
                                   repeats=args.repeats, stored=stored,
                                   log=lambda text: print(text, file=sys.stderr))
    from .step import machine_info

    info = machine_info()
    print(f"Optimizer-step makespan (Muon, {args.ns_method} Newton-Schulz, fp32; AdamW for non-matrices), busiest "
          f"rank in ms, per-tensor updates timed on {info['cpu']} (one thread, median of {args.repeats}); "
          f"ds_canzona and layer-wise plan with the roofline cost, machine balance {balance:g}; ds_canzona's "
          + ("non-matrix tensors whole" if rows and rows[0].split_numel is None else
             f"non-matrix tensors in pieces of {rows[0].split_numel if rows else '-'} elements")
          + (f"; per-shape times reused from {args.timings}." if args.timings else "."))
    print()
    print(makespan_markdown(rows))
    print()
    for line in summary(rows):
        print(line)
    print(f"\n(total {time.perf_counter() - started:.0f} s)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({"machine": info, "settings": {"models": models, "scale": args.scale, "dp": dps,
                                                     "bucket_numel": args.bucket_numel, "ns_method": args.ns_method,
                                                     "machine_balance": balance, "split_numel": args.split_numel,
                                                     "repeats": args.repeats, "timings_from": args.timings},
                       "timings": timings, "rows": [asdict(row) for row in rows]}, handle, indent=1)
    if args.plot:
        plot_makespan(rows, args.plot)
        print(f"plot written to {args.plot}")
    return 0


MAKESPAN = Command(description="Optimizer-step makespan at DP 16-128 on scaled Qwen3 shapes, per-tensor updates "
                   "timed on this machine, for ds_canzona, DeepSpeed's Muon, start-index, layer-wise and synchronous.",
                   add_arguments=add_arguments, run=run)


def main(argv: Sequence[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m ds_canzona.bench makespan", description=MAKESPAN.description)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
